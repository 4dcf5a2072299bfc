//! duet's coordinator: serves the public `Generation` API, validates requests, runs the
//! speculative loop over the draft-worker and the target-worker, and falls back to
//! target-only when the draft-worker fails.

pub mod admission;
pub mod auth;
pub mod config;
pub mod controller;
mod generation;
mod line;
pub mod method;
pub mod metrics;
mod openai;
pub mod output;
pub mod proposals;
pub mod reasoning;
pub mod request;
pub mod room;
mod service;
pub mod tools;
pub mod workers;

pub use config::CoordinatorConfig;
pub use service::GenerationService;

use duet_serving::busy_poll::BusyPoll;
use duet_serving::grpc::{self, Health};
use duet_serving::https;
use duet_serving::metrics::{Listeners, Render};
use duet_serving::shutdown::Shutdown;
use duet_serving::startup::Service;
use duet_serving::tls_files::Alpn;
use generation::Context;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::OnceCell;
use workers::{GrpcWorkers, Models, TakeTurns};

/// The coordinator's name, environment prefix and defaults.
pub fn service() -> Service<CoordinatorConfig> {
    Service {
        name: "duet-coordinator",
        env_prefix: "DUET_COORDINATOR",
        defaults: CoordinatorConfig::default(),
        prepare: |_| {},
    }
}

duet_serving::service_config!(CoordinatorConfig, http_listen);

/// State shared by every request.
#[derive(Debug)]
pub struct Coordinator {
    config: CoordinatorConfig,
    workers: Arc<TakeTurns<GrpcWorkers>>,
    models: OnceCell<Arc<Models>>,
    /// Why the models are not known yet (the target-worker is unreachable or loading).
    not_ready: Mutex<String>,
    admission: admission::Admission,
    /// Where requests wait when no target replica has room for their KV.
    room: Arc<room::RoomQueue>,
    /// What followed runs of tokens in earlier requests (`None`: sharing off).
    proposals: Option<Arc<proposals::ProposalCache>>,
    /// Fires when the drain deadline passes: running generations end as `cancelled`.
    stopping: Shutdown,
    metrics: Arc<metrics::CoordinatorMetrics>,
    speculation: Arc<config::SpeculationConfig>,
    /// What AUTO learns from every request.
    shared: Arc<controller::Shared>,
}

impl Coordinator {
    fn new(config: CoordinatorConfig) -> Result<Arc<Self>, duet_serving::config::ConfigError> {
        let metrics = Arc::new(metrics::CoordinatorMetrics::with_request_limit(
            config.max_concurrent_requests,
        ));
        let queue_timeout = Duration::from_millis(config.queue_timeout_ms);
        let preempts = config.scheduling_policy == config::SchedulingPolicy::Priority
            && config.priority_preemption;
        let room = room::RoomQueue::new(queue_timeout, metrics.waiting_for_kv.clone(), preempts);
        Ok(Arc::new(Self {
            workers: Arc::new(TakeTurns::new(
                GrpcWorkers::new(&config)?,
                (config.speculation.take_turns)
                    .then(|| Duration::from_millis(config.speculation.turn_wait_ms)),
            )),
            models: OnceCell::new(),
            not_ready: Mutex::new(format!(
                "the target-worker at {} has not answered yet",
                config.target.address
            )),
            admission: admission::Admission::new(
                admission::Places {
                    limit: config.max_concurrent_requests,
                    per_tenant: config.max_concurrent_requests_per_token,
                    max_queued: config.max_queued,
                    timeout: queue_timeout,
                },
                &metrics,
                room.freed(),
            ),
            room: Arc::new(room),
            proposals: (config.speculation.proposal_cache.sharing != config::Sharing::Off).then(
                || {
                    let entries = config.speculation.proposal_cache.max_entries;
                    Arc::new(proposals::ProposalCache::new(entries))
                },
            ),
            stopping: Shutdown::new(),
            metrics,
            speculation: Arc::new(config.speculation.clone()),
            shared: Arc::default(),
            config,
        }))
    }

    /// The salt of a request's prefix-cache blocks: its own (`own`, from its `cache_salt`)
    /// and its tenant's where `prefix_cache_sharing` keeps tenants apart; 0: none.
    fn prefix_salt(&self, tenant: Option<proposals::Tenant>, own: u64) -> u64 {
        let tenant = match self.config.prefix_cache_sharing {
            config::PrefixSharing::PerToken => tenant.map_or(0, |t| t.0),
            config::PrefixSharing::Everyone => 0,
        };
        request::mix_salts(tenant, own)
    }

    /// What a generation runs with; `tenant`: its bearer token's, if any.
    fn context(
        &self,
        models: Arc<Models>,
        lease: workers::Lease,
        tenant: Option<proposals::Tenant>,
    ) -> Context<TakeTurns<GrpcWorkers>> {
        // A tenant reads and feeds only its own part of the cache.
        let proposals = self.proposals.as_ref().and_then(|cache| {
            let tenant = match self.speculation.proposal_cache.sharing {
                config::Sharing::PerToken => tenant?,
                config::Sharing::Everyone => proposals::Tenant(0),
                config::Sharing::Off => return None,
            };
            Some((cache.clone(), tenant))
        });
        Context {
            workers: self.workers.clone(),
            models,
            speculation: self.speculation.clone(),
            shared: self.shared.clone(),
            metrics: self.metrics.clone(),
            stopping: self.stopping.clone(),
            stall_timeout: Duration::from_millis(self.config.limits.stream_stall_timeout_ms),
            max_failovers: self.config.target.max_failovers,
            lease,
            room: self.room.clone(),
            proposals,
        }
    }

    /// The metrics as `GET /metrics` answers them, the figures kept elsewhere read first.
    fn render(self: &Arc<Self>, busy: Option<BusyPoll>) -> Render {
        let coord = self.clone();
        Arc::new(move || {
            let metrics = &coord.metrics;
            metrics.observe_draft_breaker(coord.workers.inner.draft_breaker());
            metrics.observe_busy_polling(busy.as_ref());
            let adapters = coord.models.get().map(|m| m.adapters.list());
            metrics.observe_adapters(&adapters.unwrap_or_default());
            metrics.render()
        })
    }

    /// Learns the models from the target-worker (retrying until it answers), then keeps the
    /// coordinator's health in step with the target-worker's, reading its replicas' KV use
    /// beside each check.
    async fn watch_target(self: Arc<Self>, health: Health) {
        let interval = Duration::from_millis(self.config.target.health_interval_ms);
        let workers = &self.workers.inner;
        loop {
            let (serving, kv_usage) =
                tokio::join!(workers.target_serving(), workers.target_kv_usage());
            if let Some(usage) = kv_usage {
                self.metrics.kv_cache_usage.set(usage);
            }
            let serving = match serving {
                Ok(Ok(())) => self.ensure_models().await.is_ok(),
                Ok(Err(reason)) => {
                    self.set_not_ready(&reason);
                    false
                }
                Err(e) => {
                    self.set_not_ready(&e.to_string());
                    false
                }
            };
            self.metrics.target_serving.set(i64::from(serving));
            health.set(serving && !self.stopping.is_triggered()).await;
            tokio::time::sleep(interval).await;
        }
    }

    fn set_not_ready(&self, reason: &str) {
        *self.not_ready.lock().unwrap_or_else(|e| e.into_inner()) = reason.to_string();
    }

    async fn ensure_models(&self) -> Result<Arc<Models>, String> {
        if let Some(m) = self.models.get() {
            return Ok(m.clone());
        }
        match self.workers.inner.models().await {
            Ok(m) => {
                let m = self
                    .models
                    .get_or_init(|| async { Arc::new(m) })
                    .await
                    .clone();
                tracing::info!(model = %m.target_model, context = m.context, "target-worker ready");
                self.workers
                    .inner
                    .expect_vocabulary(&m.vocabulary_sha256)
                    .await;
                Ok(m)
            }
            Err(e) => {
                let reason = format!("the target-worker did not describe its model: {e}");
                self.set_not_ready(&reason);
                Err(reason)
            }
        }
    }

    /// Where the target-workers read adapters from a directory and no adapter is known by
    /// `name`, asks for their list again: it may be one copied in since.
    async fn learn_adapter(&self, models: &Models, name: &str) {
        if name == models.target_model {
            return;
        }
        let workers = &self.workers.inner;
        models.adapters.learn(name, || workers.adapters()).await;
    }

    /// Whether a model of that `name` is served: the target, or one of its adapters (where
    /// the target-workers read a directory, one copied in since is looked for, as a request
    /// naming it would).
    async fn serves(&self, models: &Models, name: &str) -> bool {
        self.learn_adapter(models, name).await;
        name == models.target_model || models.adapters.contains(name)
    }

    /// The adapters' names, asked for again where the target-workers read them from a
    /// directory (at most once a second).
    async fn adapters(&self, models: &Models) -> Vec<String> {
        let workers = &self.workers.inner;
        models.adapters.refresh(|| workers.adapters()).await;
        models.adapters.list()
    }

    /// The models, or why they are not known.
    async fn models(&self) -> Result<Arc<Models>, String> {
        if let Some(m) = self.models.get() {
            return Ok(m.clone());
        }
        // Not known yet: one immediate attempt, so a caller never waits for the next poll.
        self.ensure_models().await.map_err(|_| {
            self.not_ready
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone()
        })
    }
}

/// Serves the coordinator on `listeners` until `shutdown` completes, then drains: health turns
/// NOT_SERVING, new calls are refused by the closed listener, and running generations get
/// `drain_timeout_ms` before they end with finish reason `cancelled`.
pub async fn run(
    mut listeners: Listeners,
    config: CoordinatorConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    tracing::info!(target = %config.target.address, draft = %config.draft.address, "workers");
    let drain = Duration::from_millis(config.drain_timeout_ms);
    let tls = config.tls.load("tls", Alpn::H2)?;
    let config_tls = config.tls.clone();
    let http2 = config.http2.clone();
    let busy_poll = config.runtime.start_busy_poll();
    let auth = match config.auth_token_file.as_str() {
        "" => auth::Auth::default(),
        path => auth::Auth::from_file(path, auth::RELOAD_INTERVAL)?,
    };
    if let Some(warning) = auth::plaintext_token(&config) {
        tracing::warn!("{warning}");
    }
    let coord = Coordinator::new(config)?;
    let (health, mut routes) = grpc::frame(&[GenerationService::NAME]).await;
    routes.add_service(GenerationService::server(coord.clone(), auth.clone()));
    let render = coord.render(busy_poll.clone());
    let http_stop = Shutdown::new();
    if let Some(listener) = listeners.http.take() {
        let ready = health.probes().ready;
        let app = openai::router(coord.clone(), auth, ready, render.clone());
        let tls = config_tls.load("tls", Alpn::Http1)?.map(|t| t.config);
        let (limits, busy, stop) = (http2.clone(), busy_poll.clone(), http_stop.wait());
        // Its running streams go on after `stop`, as gRPC's do.
        tokio::spawn(async move { https::serve(listener, tls, app, &limits, busy, stop).await });
    }
    coord.workers.inner.report_to(health.clone());
    let watcher = tokio::spawn(coord.clone().watch_target(health.clone()));
    let stop_watching = watcher.abort_handle();
    let _metrics = listeners.spawn_metrics(render.clone(), &health, &http2);
    let stopping = coord.stopping.clone();
    let signal = async move {
        shutdown.await;
        tracing::info!("shutdown requested; draining");
        // The target's health checks would turn health SERVING again at the next check:
        // they stop (for good: the task is gone) before health turns NOT_SERVING.
        watcher.abort();
        let _ = watcher.await;
        health.set(false).await;
        // The HTTP API takes no new connection; its running streams go on, as gRPC's do.
        http_stop.trigger();
        tokio::spawn(async move {
            tokio::time::sleep(drain).await;
            stopping.trigger();
        });
    };
    let routes = routes.routes();
    let server = grpc::serve(listeners.grpc, tls, routes, &http2, busy_poll, signal);
    // Generations end by the drain deadline; calls that never end by themselves (a health
    // Watch stream) get a short grace after it, then the process stops anyway.
    let gave_up = async {
        coord.stopping.wait().await;
        tokio::time::sleep(CALL_GRACE).await;
    };
    let result = tokio::select! {
        r = server => r,
        _ = gave_up => {
            tracing::warn!("calls still open after the drain; stopping anyway");
            Ok(())
        }
    };
    stop_watching.abort();
    Ok(result?)
}

/// After the drain deadline, how long the last calls may take.
const CALL_GRACE: Duration = Duration::from_secs(5);
