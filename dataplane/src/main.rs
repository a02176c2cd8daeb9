//! `tandem-dataplane`: parse the configuration, build the serving stack, serve until
//! SIGTERM/SIGINT, drain, exit 0.

use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use tandem_dataplane::app;
use tandem_dataplane::config::{Config, LogFormat};
use tandem_dataplane::server;

fn main() -> anyhow::Result<()> {
    tandem_dataplane::parent::die_with_parent()?; // no orphan when the local runtime dies
    let cfg = Config::parse();
    init_tracing(cfg.log_format);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("tandem-http")
        .build()
        .context("starting the tokio runtime")?;
    let result = rt.block_on(run(cfg));
    // Threads that outlive the drain deadline (a busy engine, the KV loops) are abandoned
    // on purpose: the process exits now rather than when they finish.
    rt.shutdown_timeout(Duration::from_millis(500));
    result
}

async fn run(cfg: Config) -> anyhow::Result<()> {
    let app = app::build(&cfg).with_context(|| format!("loading {}", cfg.model.display()))?;
    let addr = format!("{}:{}", cfg.host, cfg.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    tracing::info!(addr = %listener.local_addr()?, role = cfg.role.as_str(), "listening");
    let deadline = cfg.drain();
    let started = Instant::now();
    server::serve(listener, app.state.clone(), shutdown_signal(), deadline).await;
    // The last engine handle goes with the state: the engine thread then finishes what is
    // left and exits. Wait for it, within what remains of the drain deadline.
    drop(app.state);
    let left = deadline
        .saturating_sub(started.elapsed())
        .max(Duration::from_secs(1));
    // A plain thread, not `spawn_blocking`: the runtime waits for its blocking tasks when
    // it is dropped, so a join that never ends would keep the process alive forever.
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("tandem-join".into())
        .spawn(move || {
            let _ = done_tx.send(app.engine_thread.join().is_ok());
        })
        .context("starting the shutdown thread")?;
    match tokio::time::timeout(left, done_rx).await {
        Ok(Ok(true)) => tracing::info!("shutdown complete"),
        Ok(_) => tracing::error!("engine thread panicked during shutdown"),
        Err(_) => tracing::warn!("engine thread still busy at the drain deadline; exiting"),
    }
    Ok(())
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot install the SIGTERM handler; only Ctrl-C stops the server");
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: draining"),
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: draining"),
    }
}

fn init_tracing(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Json => b.json().init(),
        LogFormat::Text => b.init(),
    }
}
