//! The local runtime, Tandem's embedded default: one `PDDeployment` run on this machine
//! with `tandem-dataplane` processes instead of pods (`tandem-operator local -f FILE`).
//!
//! One planner, two executors: [`crate::planner::plan`] makes every group decision here
//! exactly as it does for the Kubernetes controller; this module only observes processes
//! (as [`crate::planner::Observed`]) and carries out the planner's actions with them
//! ([`executor`]). A member gets the arguments and environment a pod would
//! ([`crate::resources::dataplane_invocation`]), the group key is made as the Secret's
//! would be, and names come from [`crate::names`].
//!
//! Modules: [`manifest`] and [`schema`] read and check the file; [`member`] is a process
//! as the planner sees it; [`executor`] carries out actions; [`process`] and [`probe`]
//! run and watch real processes; [`router`] is the OpenAI endpoint; [`display`] the
//! terminal status; [`watch`] follows edits of the file; [`runtime`] is the loop.

pub mod display;
pub mod env;
pub mod executor;
pub mod input;
pub mod manifest;
pub mod member;
pub mod metrics;
pub mod probe;
pub mod process;
pub mod record;
pub mod router;
pub mod runtime;
pub mod schema;
pub mod snapshot;
pub mod watch;

use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tracing::info;

use self::executor::{ExecutorConfig, LocalExecutor};
use self::input::Input;
use self::process::LocalProcesses;
use self::runtime::{Descr, Runtime};
use self::snapshot::Snapshot;
use crate::metrics::Metrics;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The manifest cannot be run; the message names the file and the field.
    #[error("{0}")]
    Manifest(String),
    #[error(
        "the dataplane binary {path} {why}: build it with `cargo build --release -p tandem-dataplane` or pass --dataplane"
    )]
    Dataplane { path: PathBuf, why: String },
    /// The API keys could not be read; the message names the flag, file and line.
    #[error("{0}")]
    ApiKeys(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

pub type Result<T> = std::result::Result<T, Error>;

/// How to run.
#[derive(Debug, Clone)]
pub struct Options {
    /// The `PDDeployment` manifest; edits are picked up while running.
    pub file: PathBuf,
    /// Address of the OpenAI endpoint.
    pub host: IpAddr,
    pub port: u16,
    /// The `tandem-dataplane` binary.
    pub dataplane: PathBuf,
    /// Where each member's output goes (`<pod>.log`).
    pub log_dir: PathBuf,
    /// SIGTERM → SIGKILL delay (a pod's termination grace period).
    pub grace: Duration,
    /// Draw the live status on stdout (a terminal).
    pub live: bool,
    /// The endpoint's routing: policy, retries, API keys (docs/routing.md).
    pub router: tandem_router::RouterConfig,
}

/// The dataplane binary next to the running executable (how `cargo build` and an
/// installed release lay them out).
pub fn default_dataplane() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(|d| d.join("tandem-dataplane")))
        .unwrap_or_else(|| PathBuf::from("tandem-dataplane"))
}

/// `<tmp>/tandem-local/<deployment>`.
pub fn default_log_dir(deployment: &str) -> PathBuf {
    std::env::temp_dir().join("tandem-local").join(deployment)
}

fn check_dataplane(path: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let bad = |why: String| Error::Dataplane {
        path: path.to_path_buf(),
        why,
    };
    let meta = std::fs::metadata(path).map_err(|e| bad(format!("cannot be used ({e})")))?;
    if !meta.is_file() || meta.permissions().mode() & 0o111 == 0 {
        return Err(bad("is not an executable file".into()));
    }
    Ok(())
}

/// Read the manifest now (an invalid one is an error before anything starts).
pub fn load(file: &Path) -> Result<manifest::Manifest> {
    manifest::load(file).map_err(Error::Manifest)
}

/// Run `manifest` (read from `opts.file`) until SIGINT, SIGTERM or SIGHUP, then stop every
/// member. Must run on a current-thread Tokio runtime (see [`process`]).
pub async fn run(opts: Options, manifest: manifest::Manifest) -> Result<()> {
    check_dataplane(&opts.dataplane)?;
    let seen = std::fs::read(&opts.file).map_err(|source| Error::Io {
        what: format!("reading {}", opts.file.display()),
        source,
    })?;
    std::fs::create_dir_all(&opts.log_dir).map_err(|source| Error::Io {
        what: format!("creating the log directory {}", opts.log_dir.display()),
        source,
    })?;
    let listener = tokio::net::TcpListener::bind((opts.host, opts.port))
        .await
        .map_err(|source| Error::Io {
            what: format!(
                "listening on {}:{} for the OpenAI endpoint (pick another with --port)",
                opts.host, opts.port
            ),
            source,
        })?;
    let addr = listener.local_addr().map_err(|source| Error::Io {
        what: "reading the endpoint's address".into(),
        source,
    })?;
    let endpoint = router::base_url(addr);
    let name = manifest.name().to_string();

    let mut metrics = Metrics::new();
    let local_metrics = metrics::LocalMetrics::register(&mut metrics.registry);
    let metrics = Arc::new(metrics);
    let (snap_tx, snap_rx) = tokio::sync::watch::channel(Arc::new(Snapshot::empty(
        &name,
        opts.file.clone(),
        endpoint.clone(),
        opts.log_dir.clone(),
        opts.grace.as_secs(),
    )));
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();

    let keys = opts.router.api_keys.len();
    let policy = opts.router.policy.mode;
    let retries = opts.router.retries;
    let router = Arc::new(router::Router::new(
        snap_rx.clone(),
        metrics.clone(),
        opts.router.clone(),
    ));
    let router_task = tokio::spawn(router::serve(listener, router));
    let watch_task = tokio::spawn(watch::run(opts.file.clone(), seen, tx.clone()));
    // Installed before any member starts, so a signal always means an orderly stop.
    let stop_signals = install_signals()?;
    let signal_task = tokio::spawn(signals(stop_signals, tx.clone()));

    info!(
        deployment = %name,
        endpoint = %format!("{endpoint}/v1"),
        dataplane = %opts.dataplane.display(),
        logs = %opts.log_dir.display(),
        model = %manifest.pdd.spec.model.path,
        routing = ?policy,
        retries,
        api_keys = keys,
        "local runtime started: the planner decides, local processes carry it out"
    );
    if !manifest.cluster_only.is_empty() {
        info!(
            fields = %manifest.cluster_only.join(", "),
            "cluster-only fields are ignored by the local runtime"
        );
    }
    let display = opts
        .live
        .then(|| tokio::spawn(display::run(snap_rx.clone())));

    let namespace = manifest
        .pdd
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".into());
    let exec = LocalExecutor::new(
        ExecutorConfig {
            deployment: name.clone(),
            namespace,
            host: IpAddr::V4(Ipv4Addr::LOCALHOST),
            grace: opts.grace,
            log_dir: opts.log_dir.clone(),
        },
        LocalProcesses::new(opts.dataplane.clone(), tx),
    );
    let mut rt = Runtime::new(
        Descr {
            file: opts.file.clone(),
            endpoint,
            log_dir: opts.log_dir.clone(),
            grace: opts.grace,
        },
        manifest,
        exec,
        metrics,
        local_metrics,
        snap_tx,
    );
    rt.run(rx).await;

    let left = rt.exec.running();
    if let Some(d) = display {
        d.abort();
        display::finish(&snap_rx.borrow());
        if left == 0 {
            println!("stopped: every member has exited");
        } else {
            println!("stopped: {left} member(s) still running after SIGKILL");
        }
    }
    for t in [router_task, watch_task, signal_task] {
        t.abort();
    }
    info!("local runtime stopped");
    Ok(())
}

type StopSignals = (
    tokio::signal::unix::Signal,
    tokio::signal::unix::Signal,
    tokio::signal::unix::Signal,
);

fn install_signals() -> Result<StopSignals> {
    use tokio::signal::unix::{SignalKind, signal};
    let io = |source| Error::Io {
        what: "listening for SIGINT, SIGTERM and SIGHUP".into(),
        source,
    };
    Ok((
        signal(SignalKind::terminate()).map_err(io)?,
        signal(SignalKind::interrupt()).map_err(io)?,
        signal(SignalKind::hangup()).map_err(io)?,
    ))
}

/// Forward every SIGINT, SIGTERM and SIGHUP (the terminal went away) to the runtime.
async fn signals(
    (mut term, mut int, mut hup): StopSignals,
    tx: tokio::sync::mpsc::UnboundedSender<Input>,
) {
    loop {
        let signal = tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
            _ = hup.recv() => "SIGHUP",
        };
        if tx.send(Input::Stop { signal }).is_err() {
            return;
        }
    }
}
