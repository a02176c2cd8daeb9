//! `tandem-dataplane`: parse the configuration, build the serving stack, serve until
//! SIGTERM/SIGINT, drain, exit 0. With `--check-config`: check the configuration, print
//! it as JSON and exit 0, or say what is wrong and exit 2 (as for a bad flag).

use anyhow::Context;
use tandem_dataplane::app;
use tandem_dataplane::config::{Config, LogFormat};
use tandem_dataplane::server;

/// After the drain: how long stopping the KV loops and the engine thread may take.
const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_millis(600);

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {}", report(&e));
        std::process::exit(1);
    }
}

/// The error and its causes on one line, each cause once: the library's errors already
/// print their source in their message, which a plain cause chain would repeat.
fn report(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.contains(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}

fn run() -> anyhow::Result<()> {
    tandem_dataplane::parent::die_with_parent()?; // no orphan when the local runtime dies
    let (cfg, deprecated) =
        match Config::parse_with_deprecations(std::env::args_os(), |k| std::env::var_os(k)) {
            Ok(parsed) => parsed,
            Err(e) => e.exit(),
        };
    if cfg.check_config {
        // stdout carries the JSON: the warnings go to stderr.
        for w in &deprecated {
            eprintln!("warning: {w}");
        }
        return check_config(&cfg);
    }
    init_tracing(cfg.log_format);
    for w in &deprecated {
        tracing::warn!("{w}");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("tandem-http")
        .build()
        .context("starting the tokio runtime")?;
    let app = app::build(&cfg).with_context(|| format!("loading {}", cfg.model.path.display()))?;
    let result = rt.block_on(serve(&cfg, app.state.clone()));
    // Every wait from here on is bounded: the process exits within the drain deadline plus
    // about `SHUTDOWN_GRACE`, abandoning (and logging) any thread that has not ended.
    server::finish(app.state, app.engine_thread, SHUTDOWN_GRACE);
    rt.shutdown_timeout(std::time::Duration::from_millis(100));
    result
}

/// `--check-config`: exit 0 with the effective configuration on stdout, or exit 2 with
/// the reason on stderr. Loads no model, binds nothing, logs nothing.
fn check_config(cfg: &Config) -> anyhow::Result<()> {
    match cfg.check() {
        Ok(()) => {
            println!("{}", serde_json::to_string_pretty(&cfg.effective())?);
            Ok(())
        }
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    }
}

async fn serve(cfg: &Config, state: std::sync::Arc<server::AppState>) -> anyhow::Result<()> {
    let addr = format!("{}:{}", cfg.http.host, cfg.http.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    tracing::info!(addr = %listener.local_addr()?, role = cfg.role.as_str(), "listening");
    server::serve(listener, state, shutdown_signal(), cfg.drain()).await;
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
