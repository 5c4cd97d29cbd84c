//! `shardgate-proxy`: the binary. Parses the command line, sets up logging, runs the proxy
//! until SIGTERM or SIGINT, then drains.

use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use shardgate_crds::settings::LogFormat;
use shardgate_crds::ProxySettings;
use shardgate_proxy::{Proxy, ProxyConfig};

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

async fn terminated() -> anyhow::Result<&'static str> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    Ok(tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    })
}

async fn run(settings: ProxySettings) -> anyhow::Result<()> {
    let config = ProxyConfig::from_settings(&settings)?;
    let proxy = Proxy::start(config)
        .await
        .context("shardgate-proxy cannot start")?;
    if let Some(addr) = proxy.admin_addr() {
        tracing::info!(%addr, "admin endpoints: /metrics /healthz /readyz /routes");
    }
    let signal = terminated().await?;
    tracing::info!(signal, "shutting down");
    proxy.shutdown().await;
    Ok(())
}

/// The tokio runtime for as many worker threads as tokio would start: `TOKIO_WORKER_THREADS`,
/// else the CPUs this process may use. With one, a single thread runs everything: there is
/// no other worker to steal from, so the multi-thread scheduler's bookkeeping is pure cost
/// (callgrind: 4.5% of the proxy's user-space instructions per request at pipeline 1).
fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    let workers = match std::env::var("TOKIO_WORKER_THREADS") {
        Ok(v) => v
            .trim()
            .parse::<usize>()
            .ok()
            .filter(|&n| n > 0)
            .with_context(|| {
                format!("TOKIO_WORKER_THREADS={v:?}: a number of threads, at least 1")
            })?,
        Err(_) => std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    let (mut builder, kind) = if workers == 1 {
        (
            tokio::runtime::Builder::new_current_thread(),
            "current-thread",
        )
    } else {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(workers);
        (b, "multi-thread")
    };
    let runtime = builder.enable_all().build()?;
    tracing::info!(workers, runtime = kind, "tokio runtime");
    Ok(runtime)
}

fn main() -> ExitCode {
    // The command line is the contracts crate's ProxySettings: its --help, its defaults.
    let settings = ProxySettings::parse();
    init_logging(settings.log_format);
    let runtime = match runtime() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("shardgate-proxy: cannot start the tokio runtime: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(settings)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            eprintln!("shardgate-proxy: {e:#}");
            ExitCode::FAILURE
        }
    }
}
