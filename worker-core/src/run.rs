//! Running a worker: the gRPC frame around the shared `duet.v1.Worker` service and the
//! worker's own, the drain on shutdown, and the binaries' `main`.

use crate::WorkerConfig;
use crate::core::WorkerCore;
use crate::model_thread::Handler;
use crate::service::WorkerService;
use duet_serving::grpc::{self, Health};
use duet_serving::metrics::Listeners;
use duet_serving::startup::{CommonArgs, Service};
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
    #[error(transparent)]
    Config(#[from] duet_serving::config::ConfigError),
    #[error("serving: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// One kind of worker: what it is called, its model work and its own gRPC service.
pub trait Worker: 'static {
    type Handler: Handler + Default;
    /// A generated tonic server (what `RoutesBuilder::add_service` accepts).
    type Grpc: tower_service::Service<
            http::Request<Body>,
            Response = http::Response<Body>,
            Error = Infallible,
            Future: Send + 'static,
        > + NamedService
        + Clone
        + Send
        + Sync
        + 'static;

    /// Its model only drafts (the target checks its tokens), so it may shortlist its
    /// vocabulary (`vocab_shortlist`).
    const DRAFTS: bool;

    /// Its name, environment prefix and defaults.
    fn service() -> Service<WorkerConfig>;

    /// Its own gRPC service (Propose or Verify) over the core.
    fn grpc(core: Arc<WorkerCore<<Self::Handler as Handler>::Job>>) -> Self::Grpc;
}

/// After the sessions have closed (or the drain timeout), how long the last calls may take.
const CALL_GRACE: Duration = Duration::from_secs(5);

/// Serves worker `W` on `listeners` until `shutdown` completes, then drains: health turns
/// NOT_SERVING, new sessions are refused, open sessions (requests in progress) get
/// `drain_timeout_ms` to finish, then the server stops.
/// The model loads in the background (health NOT_SERVING meanwhile); a load failure ends
/// the server with [`RunError::Load`].
pub async fn serve<W: Worker>(
    mut listeners: Listeners,
    config: WorkerConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RunError> {
    if config.vocab_shortlist != 0 && !W::DRAFTS {
        return Err(RunError::Config(
            duet_serving::config::ConfigError::invalid(
                "vocab_shortlist",
                "only a draft-worker may shortlist its vocabulary: the target's tokens are the output",
            ),
        ));
    }
    let drain_timeout = Duration::from_millis(config.drain_timeout_ms);
    let tls = config.tls.load("tls", duet_serving::tls_files::Alpn::H2)?;
    let http2 = config.http2.clone();
    let busy_poll = config.runtime.start_busy_poll();
    let own = <W::Grpc as NamedService>::NAME;
    tracing::info!(model = %config.model.display(), service = own, "loading");
    let (health, mut routes) =
        grpc::frame(&[own, duet_proto::v1::worker_server::SERVICE_NAME]).await;
    let (core, ready) = WorkerCore::start(config, W::Handler::default(), busy_poll.clone());
    routes.add_service(W::grpc(core.clone()));
    routes.add_service(WorkerService::server(core.clone()));
    let metrics_core = core.clone();
    let render = Arc::new(move || metrics_core.render_metrics());
    let _metrics = listeners.spawn_metrics(render, &health, &http2);

    let load_failed = Arc::new(std::sync::Mutex::new(None::<String>));
    let stopping = Arc::new(tokio::sync::Notify::new());
    let stop_signal = {
        let (load_failed, stopping, core) = (load_failed.clone(), stopping.clone(), core.clone());
        async move {
            let failed = async {
                match ready.await {
                    Ok(Ok(())) => watch_model_thread(&core, &health).await,
                    Ok(Err(e)) => e,
                    // The model thread is gone with the runtime: wait for shutdown.
                    Err(_) => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = shutdown => tracing::info!("shutdown requested; draining"),
                e = failed => {
                    *load_failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                }
            }
            // Refuse new sessions before health says so: whoever sees NOT_SERVING can rely on it.
            core.drain();
            health.set(false).await;
            // A session is a request in progress with more calls to make: keep taking its
            // calls until it closes (or the drain timeout), then stop the server.
            let deadline = tokio::time::Instant::now() + drain_timeout;
            while core.sessions().stats().active > 0 && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            stopping.notify_one();
        }
    };
    let routes = routes.routes();
    let server = grpc::serve(listeners.grpc, tls, routes, &http2, busy_poll, stop_signal);
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

/// Once the model is loaded: keeps readiness and liveness in step with the model thread's
/// heartbeat. A thread stuck in one step (a wedged device, a deadlock) turns both
/// NOT_SERVING, so the coordinator stops sending work and Kubernetes restarts the pod; the
/// gRPC tasks alone would go on answering SERVING.
async fn watch_model_thread<J: Send + 'static>(core: &WorkerCore<J>, health: &Health) -> ! {
    let limit = Duration::from_millis(core.config().model_stall_timeout_ms);
    let period = (limit / 4).clamp(Duration::from_millis(10), Duration::from_secs(1));
    // The state last reported: stuck or not.
    let mut reported = None;
    loop {
        let stalled = core.model_stalled();
        let stuck = stalled.is_some();
        if reported != Some(stuck) {
            match stalled {
                Some(busy) => tracing::error!(
                    busy_ms = busy.as_millis() as u64,
                    "the model thread is stuck in one step; reporting NOT_SERVING"
                ),
                None if reported.is_some() => tracing::warn!("the model thread moves again"),
                None => {}
            }
            health.set(!stuck).await;
            health.set_named(grpc::LIVENESS, !stuck).await;
            reported = Some(stuck);
        }
        tokio::time::sleep(period).await;
    }
}

duet_serving::service_config!(WorkerConfig);

/// Command-line flags of both workers; `--set key=value` reaches every key.
#[derive(Debug, clap::Parser)]
pub struct WorkerArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    /// gRPC listen address (key `listen`).
    #[arg(long)]
    pub listen: Option<String>,
    /// GGUF model file (key `model`).
    #[arg(long)]
    pub model: Option<PathBuf>,
}

/// A worker binary's `main`.
pub fn main<W: Worker>() -> anyhow::Result<()> {
    let args = <WorkerArgs as clap::Parser>::parse();
    let model = args.model.as_ref().map(|m| m.display().to_string());
    let flags = [
        ("listen", args.listen.as_deref()),
        ("model", model.as_deref()),
    ];
    W::service().main(&args.common, &flags, serve::<W>)
}
