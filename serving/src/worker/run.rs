//! Running a worker: the gRPC frame around a worker service, its `main`.

use super::{Handler, WorkerConfig, WorkerCore};
use crate::config::{Sources, flag_overrides, load};
use crate::grpc;
use crate::metrics::Listeners;
use clap::Parser;
use std::convert::Infallible;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use thiserror::Error;
use tonic::body::Body;
use tonic::server::NamedService;

#[derive(Debug, Error)]
pub enum RunError {
    #[error("{0}")]
    Load(String),
    #[error("serving: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// A generated tonic server that `tonic::service::RoutesBuilder::add_service` accepts.
pub trait GrpcService:
    tower_service::Service<
        http::Request<Body>,
        Response = http::Response<Body>,
        Error = Infallible,
        Future: Send + 'static,
    > + NamedService
    + Clone
    + Send
    + Sync
    + 'static
{
}

impl<S> GrpcService for S where
    S: tower_service::Service<
            http::Request<Body>,
            Response = http::Response<Body>,
            Error = Infallible,
            Future: Send + 'static,
        > + NamedService
        + Clone
        + Send
        + Sync
        + 'static
{
}

/// After the sessions have closed (or the drain timeout), how long the last calls may take.
const CALL_GRACE: Duration = Duration::from_secs(5);

/// Serves one worker on `listeners` until `shutdown` completes, then drains: health turns
/// NOT_SERVING, new sessions are refused, open sessions (requests in progress) get
/// `drain_timeout_ms` to finish, then the server stops.
/// The model loads in the background (health NOT_SERVING meanwhile); a load failure ends
/// the server with [`RunError::Load`].
pub async fn serve_worker<H, S>(
    mut listeners: Listeners,
    config: WorkerConfig,
    handler: H,
    make_service: impl FnOnce(Arc<WorkerCore<H::Job>>) -> S,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RunError>
where
    H: Handler,
    S: GrpcService,
{
    let drain_timeout = Duration::from_millis(config.drain_timeout_ms);
    let (health, mut routes) = grpc::frame(S::NAME).await;
    let (core, ready) = WorkerCore::start(config, health.clone(), handler);
    routes.add_service(make_service(core.clone()));
    let metrics_core = core.clone();
    let _metrics = listeners.spawn_metrics(Arc::new(move || metrics_core.render_metrics()));

    let load_failed = Arc::new(std::sync::Mutex::new(None::<String>));
    let stopping = Arc::new(tokio::sync::Notify::new());
    let stop_signal = {
        let (load_failed, stopping, core) = (load_failed.clone(), stopping.clone(), core.clone());
        async move {
            let failed = async {
                match ready.await {
                    Ok(Err(e)) => e,
                    // Loaded (or the thread is gone with the runtime): wait for shutdown.
                    _ => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = shutdown => tracing::info!("shutdown requested; draining"),
                e = failed => {
                    *load_failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                }
            }
            health.set(false).await;
            core.drain();
            // A session is a request in progress with more calls to make: keep taking its
            // calls until it closes (or the drain timeout), then stop the server.
            let deadline = tokio::time::Instant::now() + drain_timeout;
            while core.sessions().stats().active > 0 && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            stopping.notify_one();
        }
    };
    let server = grpc::serve(listeners.grpc, routes.routes(), stop_signal);
    tokio::pin!(server);
    let result = tokio::select! {
        r = &mut server => r.map_err(RunError::from),
        _ = async { stopping.notified().await; tokio::time::sleep(CALL_GRACE).await } => {
            tracing::warn!("calls still running after the drain; stopping anyway");
            Ok(())
        }
    };
    if let Some(e) = load_failed.lock().unwrap_or_else(|p| p.into_inner()).take() {
        return Err(RunError::Load(e));
    }
    result
}

/// Command-line flags shared by both workers; `--set key=value` reaches every key.
#[derive(Debug, Parser)]
pub struct WorkerArgs {
    /// TOML configuration file.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// gRPC listen address (key `listen`).
    #[arg(long)]
    pub listen: Option<String>,
    /// GGUF model file (key `model`).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Any configuration key, as KEY=VALUE; repeatable.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Load and check the configuration, print it as TOML, and exit.
    #[arg(long)]
    pub check_config: bool,
}

impl WorkerArgs {
    /// The configuration: `defaults` < file < `{env_prefix}__KEY` < flags, validated.
    pub fn load(&self, defaults: &WorkerConfig, env_prefix: &str) -> anyhow::Result<WorkerConfig> {
        let model = self.model.as_ref().map(|m| m.display().to_string());
        let overrides = flag_overrides(
            &[
                ("listen", self.listen.as_deref()),
                ("model", model.as_deref()),
            ],
            &self.set,
        );
        let config: WorkerConfig = load(
            defaults,
            &Sources {
                file: self.config.as_deref(),
                env_prefix,
                env: None,
                overrides,
            },
        )?;
        config.validate()?;
        Ok(config)
    }
}

/// A worker's `main`: configuration, telemetry, process settings, then serve until SIGTERM.
/// `service_name` is the OpenTelemetry `service.name` (e.g. `duet-target-worker`).
pub fn main<H, S>(
    service_name: &str,
    defaults: WorkerConfig,
    env_prefix: &str,
    handler: H,
    make_service: impl FnOnce(Arc<WorkerCore<H::Job>>) -> S,
) -> anyhow::Result<()>
where
    H: Handler,
    S: GrpcService,
{
    let args = WorkerArgs::parse();
    let config = args.load(&defaults, env_prefix)?;
    if args.check_config {
        print!("{}", crate::config::to_toml(&config)?);
        return Ok(());
    }
    let telemetry = crate::telemetry::Telemetry::new(
        service_name,
        &config.telemetry,
        crate::telemetry::LogFormat::from_json(config.log_json),
        "info",
    )?;
    telemetry.install()?;
    config.apply_process_settings();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        // The model has its own thread; the runtime only moves messages.
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let listeners = Listeners::bind(&config.listen, &config.metrics_listen).await?;
        tracing::info!(
            listen = %listeners.grpc.local_addr()?,
            metrics = %config.metrics_listen,
            model = %config.model.display(),
            service = S::NAME,
            "serving"
        );
        serve_worker(
            listeners,
            config,
            handler,
            make_service,
            crate::shutdown::signal(),
        )
        .await?;
        Ok::<_, anyhow::Error>(())
    })?;
    drop(runtime);
    telemetry.shutdown();
    Ok(())
}
