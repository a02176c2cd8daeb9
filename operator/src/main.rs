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
    };
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?
        .block_on(local::run(opts, manifest))?;
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

async fn run_controller(args: ControllerArgs) -> anyhow::Result<()> {
    init_tracing(args.log_format);

    // Two clients: requests time out after REQUEST_TIMEOUT (a hung request must not stall
    // a reconcile or the election forever); watches keep kube's long read timeout, since
    // the server holds a quiet watch open for minutes.
    let config = kube::Config::infer()
        .await
        .context("loading the Kubernetes client configuration")?;
    let watch_client = Client::try_from(config.clone()).context("building a Kubernetes client")?;
    let mut request_config = config;
    request_config.read_timeout = Some(REQUEST_TIMEOUT);
    let client = Client::try_from(request_config).context("building a Kubernetes client")?;
    let metrics = Arc::new(Metrics::new());
    let base = args
        .identity
        .clone()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "tandem-operator".into());
    let identity = leader::identity(&base);

    // One stop flag for everything: set by a signal.
    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::spawn(async move {
        shutdown_signal().await;
        stop_tx.send_replace(true);
    });
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };

    let mut readiness = Readiness::default();
    let mut election = None;
    if args.leader_election {
        let cfg = ElectionConfig::new(args.lease_namespace.clone(), identity.clone());
        let (leader_tx, leader_rx) = watch::channel(false);
        let (ok_tx, ok_rx) = watch::channel(None);
        readiness.election = Some(ElectionView {
            leader: leader_rx.clone(),
            last_ok: ok_rx,
            stale_after: cfg.lease_duration * 2,
        });
        let elector = Elector::new(client.clone(), cfg);
        let stop = stop_rx.clone();
        let task = tokio::spawn(async move {
            let outcome = elector.run(leader_tx, ok_tx, stop).await;
            (elector, outcome)
        });
        election = Some((leader_rx, task));
    }

    let listener = TcpListener::bind(args.metrics_addr)
        .await
        .with_context(|| format!("binding {}", args.metrics_addr))?;
    info!(addr = %args.metrics_addr, %identity, "serving /metrics, /health, /ready");
    tokio::spawn(server::serve(
        listener,
        metrics.clone(),
        readiness.clone(),
        std::future::pending::<()>(),
    ));

    // Wait for the lease (or a signal while standing by).
    if let Some((leader_rx, _)) = &mut election {
        info!(identity, "waiting for the leader lease");
        tokio::select! {
            r = leader_rx.wait_for(|l| *l) => {
                // The elector only gives up on a signal (Stopped) before leading.
                if r.is_err() {
                    info!("stopped while standing by");
                    return Ok(());
                }
            }
            _ = stopped(stop_rx.clone()) => {
                info!("stopped while standing by");
                return Ok(());
            }
        }
        info!("leading");
    }
    metrics.is_leader.set(1);

    // The controller stops on a signal, or when the lease is lost.
    let (ctl_stop_tx, ctl_stop_rx) = oneshot::channel::<()>();
    let mut leader_watch = election.as_ref().map(|(rx, _)| rx.clone());
    let stop = stop_rx.clone();
    tokio::spawn(async move {
        let lost = async {
            match &mut leader_watch {
                Some(rx) => {
                    let _ = rx.wait_for(|l| !*l).await;
                }
                None => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            _ = stopped(stop) => {}
            _ = lost => warn!("leader lease lost: stopping the controller"),
        }
        let _ = ctl_stop_tx.send(());
    });

    let ctx = Arc::new(
        Context::new(
            client,
            metrics.clone(),
            Reporter {
                controller: "tandem-operator".into(),
                instance: Some(identity.clone()),
            },
        )
        .with_watch_client(watch_client),
    );
    readiness.set_controller_started(true);
    let controller = controller::run(ctx, args.namespace.as_deref(), async move {
        let _ = ctl_stop_rx.await;
    });
    // Bounded shutdown: once told to stop, running reconciles get SHUTDOWN_GRACE.
    let deadline = {
        let stop = stop_rx.clone();
        let leader = election.as_ref().map(|(rx, _)| rx.clone());
        async move {
            let lost = async {
                match leader {
                    Some(mut rx) => {
                        let _ = rx.wait_for(|l| !*l).await;
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            tokio::select! {
                _ = stopped(stop) => {}
                _ = lost => {}
            }
            tokio::time::sleep(SHUTDOWN_GRACE).await;
        }
    };
    let run = tokio::select! {
        r = controller => r,
        _ = deadline => {
            warn!("reconciles still running {SHUTDOWN_GRACE:?} after the stop: exiting anyway");
            Ok(())
        }
    };
    readiness.set_controller_started(false);
    metrics.is_leader.set(0);
    run.context("running the controller")?;

    if let Some((leader_rx, task)) = election {
        let lost = !*leader_rx.borrow();
        if lost {
            bail!("lost the leader lease; exiting so that the Deployment restarts this replica");
        }
        let (elector, outcome) = tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .context("leader election did not stop")?
            .context("leader election task")?;
        if outcome == Outcome::Lost {
            bail!("lost the leader lease; exiting so that the Deployment restarts this replica");
        }
        match tokio::time::timeout(REQUEST_TIMEOUT, elector.release()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => warn!("releasing the lease failed (it expires by itself): {e}"),
            Err(_) => warn!("releasing the lease timed out (it expires by itself)"),
        }
    }
    info!("stopped");
    Ok(())
}
