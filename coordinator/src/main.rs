//! `duet-coordinator`: configuration, logging, serve until SIGTERM.

use clap::Parser;
use duet_coordinator::{CoordinatorConfig, ENV_PREFIX, SERVICE_NAME};
use duet_serving::config::{Sources, flag_overrides, load};
use duet_serving::telemetry::{LogFormat, Telemetry};
use std::path::PathBuf;

#[derive(Debug, Parser)]
#[command(
    about = "duet's coordinator: the public Generate API over a draft-worker and a target-worker"
)]
struct Args {
    /// TOML configuration file.
    #[arg(long)]
    config: Option<PathBuf>,
    /// gRPC listen address (key `listen`).
    #[arg(long)]
    listen: Option<String>,
    /// Target-worker URL (key `target.address`).
    #[arg(long)]
    target: Option<String>,
    /// Draft-worker URL (key `draft.address`; empty for none).
    #[arg(long)]
    draft: Option<String>,
    /// Any configuration key, as KEY=VALUE (nested keys with dots); repeatable.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// Load and check the configuration, print it as TOML, and exit.
    #[arg(long)]
    check_config: bool,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let overrides = flag_overrides(
        &[
            ("listen", args.listen.as_deref()),
            ("target.address", args.target.as_deref()),
            ("draft.address", args.draft.as_deref()),
        ],
        &args.set,
    );
    let config: CoordinatorConfig = load(
        &CoordinatorConfig::default(),
        &Sources {
            file: args.config.as_deref(),
            env_prefix: ENV_PREFIX,
            env: None,
            overrides,
        },
    )?;
    config.validate()?;
    if args.check_config {
        print!("{}", duet_serving::config::to_toml(&config)?);
        return Ok(());
    }
    let telemetry = Telemetry::new(
        SERVICE_NAME,
        &config.telemetry,
        LogFormat::from_json(config.log_json),
        "info",
    )?;
    telemetry.install()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let listeners =
            duet_serving::metrics::Listeners::bind(&config.listen, &config.metrics_listen).await?;
        tracing::info!(
            listen = %listeners.grpc.local_addr()?,
            metrics = %config.metrics_listen,
            target = %config.target.address,
            draft = %config.draft.address,
            "serving"
        );
        duet_coordinator::run(listeners, config, duet_serving::shutdown::signal()).await?;
        Ok::<_, anyhow::Error>(())
    })?;
    drop(runtime);
    telemetry.shutdown();
    Ok(())
}
