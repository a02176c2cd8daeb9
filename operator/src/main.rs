//! `tandem-operator`: reconciles `PDDeployment`s. Thin wiring of the library: flags,
//! logging, the metrics/health server, leader election and the controller — or, with
//! `local -f FILE`, the local runtime that runs one `PDDeployment` with local processes.
//!
//! Exit status: 0 after SIGTERM/SIGINT (running reconciles finish, the lease is
//! released; locally, every member process has exited); 1 when the leader lease is lost —
//! the Deployment restarts the process, which then competes for the lease again as a
//! standby — or when the local manifest cannot be run.

use std::io::IsTerminal;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::{ArgAction, Args, Parser, Subcommand, ValueEnum};
use kube::Client;
use kube::runtime::events::Reporter;
use tandem_operator::controller::{self, Context};
use tandem_operator::leader::{self, ElectionConfig, Elector, Outcome};
use tandem_operator::local;
use tandem_operator::metrics::Metrics;
use tandem_operator::server::{self, ElectionView, Readiness};
use tokio::net::TcpListener;
use tokio::sync::{oneshot, watch};
use tracing::{info, warn};
use tracing_subscriber::EnvFilter;

/// Longest wait for an answer to one (non-watch) API request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// After a stop signal, longest wait for running reconciles to finish.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(20);

#[derive(Clone, Copy, Debug, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Parser, Debug)]
#[command(
    name = "tandem-operator",
    version,
    about = "Kubernetes operator for Tandem PD-disaggregated serving",
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// Without a subcommand: the Kubernetes controller.
    #[command(flatten)]
    controller: ControllerArgs,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run one PDDeployment on this machine: the same planner, local tandem-dataplane
    /// processes instead of pods, an OpenAI endpoint on localhost.
    Local(LocalArgs),
    /// The router of one PDDeployment on a cluster (the operator runs it for
    /// `spec.router`): follows the PDDeployment's status and its decode pods through the
    /// API server and routes `/v1/*` to decodes of groups Ready at their incarnation.
    Router(RouterArgs),
}

#[derive(Args, Debug)]
struct RouterArgs {
    /// Namespace of the PDDeployment.
    #[arg(long, env = "POD_NAMESPACE")]
    namespace: String,
    /// Name of the PDDeployment.
    #[arg(long)]
    deployment: String,
    /// Port of the OpenAI endpoint, /health, /ready and /metrics.
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// A directory whose every file holds accepted API keys (a mounted Secret).
    #[arg(long)]
    api_key_dir: Option<PathBuf>,
    /// Seconds a decode's engine may have work and make no step before the router sends
    /// it nothing new and moves what waits there for a first byte to another group
    /// (docs/routing.md); 0: off.
    #[arg(long, default_value_t = 5)]
    stall_seconds: u64,
    #[arg(long, env = "TANDEM_LOG_FORMAT", value_enum, default_value = "text")]
    log_format: LogFormat,
}

#[derive(Args, Debug)]
struct LocalArgs {
    /// The PDDeployment manifest (edits are picked up while it runs).
    #[arg(short = 'f', long = "file")]
    file: PathBuf,
    /// Port of the OpenAI endpoint (the local stand-in for the client Service).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Address of the OpenAI endpoint.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// The tandem-dataplane binary [default: the one next to this executable].
    #[arg(long, env = "TANDEM_DATAPLANE")]
    dataplane: Option<PathBuf>,
    /// Directory of the members' log files (and of this runtime's log while the live
    /// status is on the terminal) [default: <tmp>/tandem-local/<name>].
    #[arg(long)]
    log_dir: Option<PathBuf>,
    /// Seconds between SIGTERM and SIGKILL when a member is stopped (a pod's
    /// termination grace period).
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    grace_period_seconds: u64,
    /// `text`: a live status when stdout is a terminal, else log lines; `json`: JSON log
    /// lines.
    #[arg(long, env = "TANDEM_LOG_FORMAT", value_enum, default_value = "text")]
    log_format: LogFormat,
    /// How the endpoint picks a group for a request (docs/routing.md).
    #[arg(long, value_enum, default_value = "prefix-load")]
    routing: local::router::Routing,
    /// Sends of a request to another group after its decode failed before the first
    /// byte of its answer: 1 or 0.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(0..=1))]
    retries: u8,
    /// Seconds a decode's engine may have work and make no step before the router sends
    /// it nothing new and moves what waits there for a first byte to another group
    /// (docs/routing.md); 0: off.
    #[arg(long, default_value_t = 5)]
    stall_seconds: u64,
    /// A key clients must send as `Authorization: Bearer <key>` on `/v1/*` (`/health`,
    /// `/ready` and `/metrics` stay open). Prefer the variable or the file: a command
    /// line is visible to every user of the machine.
    #[arg(long, env = "TANDEM_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// A file of accepted keys, one a line (blank lines and `#` comments skipped).
    #[arg(long, env = "TANDEM_API_KEY_FILE")]
    api_key_file: Option<PathBuf>,
}

#[derive(Args, Debug)]
struct ControllerArgs {
    /// Namespace to watch; every namespace when unset.
    #[arg(long, env = "TANDEM_WATCH_NAMESPACE")]
    namespace: Option<String>,
    /// Address of the /metrics, /health and /ready server.
    #[arg(long, env = "TANDEM_METRICS_ADDR", default_value = "0.0.0.0:8080")]
    metrics_addr: SocketAddr,
    /// Elect a leader among replicas through a Lease (`--leader-election=false` to run
    /// the controller unconditionally).
    #[arg(long, env = "TANDEM_LEADER_ELECTION", default_value_t = true, action = ArgAction::Set)]
    leader_election: bool,
    /// Namespace of the leader Lease (the operator's own namespace).
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    lease_namespace: String,
    /// Base of this replica's identity (a random suffix is added); defaults to the pod
    /// name, then the hostname.
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
    #[arg(long, env = "TANDEM_LOG_FORMAT", value_enum, default_value = "text")]
    log_format: LogFormat,
    /// Image of the routers run for `spec.router` (the chart sets the operator's own
    /// image, which serves `tandem-operator router`).
    #[arg(long, env = "TANDEM_ROUTER_IMAGE")]
    router_image: Option<String>,
}

fn filter() -> EnvFilter {
    EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("info,kube=warn,hyper=warn,tower=warn"))
}

fn init_tracing(format: LogFormat) {
    let fmt = tracing_subscriber::fmt()
        .with_env_filter(filter())
        .with_ansi(std::io::stdout().is_terminal());
    match format {
        LogFormat::Text => fmt.init(),
        LogFormat::Json => fmt.json().init(),
    }
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Local(args)) => run_local(args),
        Some(Command::Router(args)) => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .context("starting the tokio runtime")?
            .block_on(run_router(args)),
        None => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .context("starting the tokio runtime")?
            .block_on(run_controller(cli.controller)),
    }
}

/// The local runtime. A current-thread Tokio runtime: member processes are started from
/// this thread, which lives as long as the process (see `local::process`).
fn run_local(args: LocalArgs) -> anyhow::Result<()> {
    let manifest = local::load(&args.file)?;
    let log_dir = args
        .log_dir
        .clone()
        .unwrap_or_else(|| local::default_log_dir(manifest.name()));
    let live = matches!(args.log_format, LogFormat::Text) && std::io::stdout().is_terminal();
    if live {
        // The terminal shows the live status; log lines go to a file beside the members'.
        std::fs::create_dir_all(&log_dir)
            .with_context(|| format!("creating {}", log_dir.display()))?;
        let path = log_dir.join("runtime.log");
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        tracing_subscriber::fmt()
            .with_env_filter(filter())
            .with_ansi(false)
            .with_writer(std::sync::Mutex::new(file))
            .init();
    } else {
        init_tracing(args.log_format);
    }
    let opts = local::Options {
        file: args.file,
        host: args.host,
        port: args.port,
        dataplane: args.dataplane.unwrap_or_else(local::default_dataplane),
        log_dir,
        grace: Duration::from_secs(args.grace_period_seconds),
        live,
        router: local::router::config(
            args.routing,
            args.retries,
            Duration::from_secs(args.stall_seconds),
            args.api_key.as_deref(),
            args.api_key_file.as_deref(),
        )?,
    };
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?
        .block_on(local::run(opts, manifest))?;
    Ok(())
}

/// The cluster router until SIGTERM/SIGINT (or its watches end for good).
async fn run_router(args: RouterArgs) -> anyhow::Result<()> {
    use tandem_operator::cluster_router::{self, ClusterRouter};
    init_tracing(args.log_format);
    let api_keys = match &args.api_key_dir {
        Some(dir) => cluster_router::api_keys_from_dir(dir).map_err(anyhow::Error::msg)?,
        None => tandem_contract::api_keys::ApiKeys::none(),
    };
    let cfg = tandem_router::RouterConfig {
        api_keys,
        stall_limit: Duration::from_secs(args.stall_seconds),
        ..tandem_router::RouterConfig::default()
    };
    let (_, watch_client) = clients().await?;
    let addr = SocketAddr::from(([0, 0, 0, 0], args.port));
    let listener = TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    info!(%addr, namespace = %args.namespace, deployment = %args.deployment, "routing");
    let router = Arc::new(ClusterRouter::new(cfg));
    tokio::select! {
        r = cluster_router::run(watch_client, &args.namespace, &args.deployment, listener, router) => {
            r.context("routing")?;
        }
        _ = shutdown_signal() => info!("stopped"),
    }
    Ok(())
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            warn!("cannot listen for SIGTERM: {e}");
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => info!("SIGTERM received"),
        _ = tokio::signal::ctrl_c() => info!("SIGINT received"),
    }
}

/// The Kubernetes controller: clients, metrics server, leader election (when on), then the
/// controller until a signal or the loss of the lease; a bounded shutdown; the lease
/// released. Each step is one function below.
async fn run_controller(args: ControllerArgs) -> anyhow::Result<()> {
    init_tracing(args.log_format);
    let (client, watch_client) = clients().await?;
    let metrics = Arc::new(Metrics::new());
    let identity = leader::identity(&base_identity(&args));
    let stop = stop_on_signal();
    let mut readiness = Readiness::default();
    let mut election = args
        .leader_election
        .then(|| Election::start(&client, &args.lease_namespace, &identity, stop.clone()));
    readiness.election = election.as_ref().map(|e| e.view.clone());
    serve_metrics(args.metrics_addr, &metrics, &readiness, &identity).await?;
    if let Some(e) = &mut election
        && !e.wait_until_leading(stop.clone()).await
    {
        info!("stopped while standing by");
        return Ok(());
    }
    metrics.is_leader.set(1);
    let reporter = Reporter {
        controller: "tandem-operator".into(),
        instance: Some(identity.clone()),
    };
    let ctx = Arc::new(
        Context::new(client, metrics.clone(), reporter)
            .with_watch_client(watch_client)
            .with_router_image(args.router_image.clone()),
    );
    readiness.set_controller_started(true);
    let leader = election.as_ref().map(|e| e.leader.clone());
    let run = run_until_stopped(ctx, args.namespace.as_deref(), stop, leader).await;
    readiness.set_controller_started(false);
    metrics.is_leader.set(0);
    run.context("running the controller")?;
    if let Some(e) = election {
        e.finish().await?;
    }
    info!("stopped");
    Ok(())
}

/// Two clients: requests time out after [`REQUEST_TIMEOUT`] (a hung request must not stall
/// a reconcile or the election forever); watches keep kube's long read timeout, since the
/// server holds a quiet watch open for minutes. Returns (requests, watches).
async fn clients() -> anyhow::Result<(Client, Client)> {
    let config = kube::Config::infer()
        .await
        .context("loading the Kubernetes client configuration")?;
    let watch_client = Client::try_from(config.clone()).context("building a Kubernetes client")?;
    let mut request_config = config;
    request_config.read_timeout = Some(REQUEST_TIMEOUT);
    let client = Client::try_from(request_config).context("building a Kubernetes client")?;
    Ok((client, watch_client))
}

fn base_identity(args: &ControllerArgs) -> String {
    args.identity
        .clone()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "tandem-operator".into())
}

/// One stop flag for everything, set by SIGTERM or SIGINT.
fn stop_on_signal() -> watch::Receiver<bool> {
    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::spawn(async move {
        shutdown_signal().await;
        stop_tx.send_replace(true);
    });
    stop_rx
}

async fn stopped(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}

/// Resolves when `leader` says the lease is lost; never without an election.
async fn lease_lost(leader: Option<watch::Receiver<bool>>) {
    match leader {
        Some(mut rx) => {
            let _ = rx.wait_for(|l| !*l).await;
        }
        None => std::future::pending::<()>().await,
    }
}

/// `/metrics`, `/health` and `/ready` on `addr`, for as long as the process runs.
async fn serve_metrics(
    addr: SocketAddr,
    metrics: &Arc<Metrics>,
    readiness: &Readiness,
    identity: &str,
) -> anyhow::Result<()> {
    let listener = TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    info!(%addr, %identity, "serving /metrics, /health, /ready");
    tokio::spawn(server::serve(
        listener,
        metrics.clone(),
        readiness.clone(),
        std::future::pending::<()>(),
    ));
    Ok(())
}

/// The leader election running beside the controller.
struct Election {
    leader: watch::Receiver<bool>,
    view: ElectionView,
    task: tokio::task::JoinHandle<(Elector, Outcome)>,
}

impl Election {
    fn start(
        client: &Client,
        namespace: &str,
        identity: &str,
        stop: watch::Receiver<bool>,
    ) -> Self {
        let cfg = ElectionConfig::new(namespace.to_string(), identity.to_string());
        let (leader_tx, leader_rx) = watch::channel(false);
        let (ok_tx, ok_rx) = watch::channel(None);
        let view = ElectionView {
            leader: leader_rx.clone(),
            last_ok: ok_rx,
            stale_after: cfg.lease_duration * 2,
        };
        let elector = Elector::new(client.clone(), cfg);
        let task = tokio::spawn(async move {
            let outcome = elector.run(leader_tx, ok_tx, stop).await;
            (elector, outcome)
        });
        Self {
            leader: leader_rx,
            view,
            task,
        }
    }

    /// Wait for the lease; false when a signal came first (the elector gives up only on a
    /// signal before leading).
    async fn wait_until_leading(&mut self, stop: watch::Receiver<bool>) -> bool {
        info!("waiting for the leader lease");
        let leading = tokio::select! {
            r = self.leader.wait_for(|l| *l) => r.is_ok(),
            _ = stopped(stop) => false,
        };
        if leading {
            info!("leading");
        }
        leading
    }

    /// After the controller stopped: an error when the lease was lost (the Deployment
    /// restarts this replica as a standby), else release the lease.
    async fn finish(self) -> anyhow::Result<()> {
        const LOST: &str =
            "lost the leader lease; exiting so that the Deployment restarts this replica";
        if !*self.leader.borrow() {
            bail!(LOST);
        }
        let (elector, outcome) = tokio::time::timeout(Duration::from_secs(10), self.task)
            .await
            .context("leader election did not stop")?
            .context("leader election task")?;
        if outcome == Outcome::Lost {
            bail!(LOST);
        }
        match tokio::time::timeout(REQUEST_TIMEOUT, elector.release()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => warn!("releasing the lease failed (it expires by itself): {e}"),
            Err(_) => warn!("releasing the lease timed out (it expires by itself)"),
        }
        Ok(())
    }
}

/// The controller until a signal or the loss of the lease; then running reconciles get
/// [`SHUTDOWN_GRACE`].
async fn run_until_stopped(
    ctx: Arc<Context>,
    namespace: Option<&str>,
    stop: watch::Receiver<bool>,
    leader: Option<watch::Receiver<bool>>,
) -> Result<(), controller::Error> {
    let told_to_stop = {
        let (stop, leader) = (stop.clone(), leader.clone());
        async move {
            tokio::select! {
                _ = stopped(stop) => {}
                _ = lease_lost(leader) => warn!("leader lease lost: stopping the controller"),
            }
        }
    };
    let (ctl_stop_tx, ctl_stop_rx) = oneshot::channel::<()>();
    tokio::spawn(async move {
        told_to_stop.await;
        let _ = ctl_stop_tx.send(());
    });
    let controller = controller::run(ctx, namespace, async move {
        let _ = ctl_stop_rx.await;
    });
    let deadline = async move {
        tokio::select! {
            _ = stopped(stop) => {}
            _ = lease_lost(leader) => {}
        }
        tokio::time::sleep(SHUTDOWN_GRACE).await;
    };
    tokio::select! {
        r = controller => r,
        _ = deadline => {
            warn!("reconciles still running {SHUTDOWN_GRACE:?} after the stop: exiting anyway");
            Ok(())
        }
    }
}
