//! `tandem-operator`: reconciles `PDDeployment`s. Thin wiring of the library: flags,
//! logging, the metrics/health server, leader election and the controller.
//!
//! Exit status: 0 after SIGTERM/SIGINT (running reconciles finish, the lease is
//! released); 1 when the leader lease is lost — the Deployment restarts the process,
//! which then competes for the lease again as a standby.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::{ArgAction, Parser, ValueEnum};
use kube::Client;
use kube::runtime::events::Reporter;
use tandem_operator::controller::{self, Context};
use tandem_operator::leader::{self, ElectionConfig, Elector, Outcome};
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
    about = "Kubernetes operator for Tandem PD-disaggregated serving"
)]
struct Args {
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

fn init_tracing(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("info,kube=warn,hyper=warn,tower=warn"));
    let fmt = tracing_subscriber::fmt().with_env_filter(filter);
    match format {
        LogFormat::Text => fmt.init(),
        LogFormat::Json => fmt.json().init(),
    }
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

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
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
