//! A test stack: draft-worker, target-worker and coordinator, each on 127.0.0.1:0 in a
//! runtime of its own, so a test can kill one (its sockets close as a crashed process's
//! would) while the others go on.

mod api;
pub use api::*;

use duet_draft_worker::Drafter;
use duet_engine::testing::TinyModel;
pub use duet_proto::Completion;
use duet_proto::v1 as pb;
use duet_proto::v1::generation_client::GenerationClient;
use duet_serving::metrics::Listeners;
use duet_serving::shutdown::Shutdown;
use duet_serving::telemetry::{LogFormat, Telemetry, TelemetryConfig};
use duet_target_worker::Verifier;
use duet_worker_core::{Worker, WorkerConfig};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tonic::transport::Channel;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// One service running in its own runtime.
pub struct Running {
    pub addr: SocketAddr,
    /// Where `GET /metrics` answers.
    pub metrics_addr: SocketAddr,
    /// Where the coordinator's HTTP API answers (nothing does for a worker).
    pub http_addr: SocketAddr,
    pub shutdown: Shutdown,
    runtime: Option<tokio::runtime::Runtime>,
    /// The service's own traces and logs, when it was started with them.
    pub telemetry: Option<Telemetry>,
}

impl std::fmt::Debug for Running {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Running")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl Running {
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops the service abruptly: every task and socket of its runtime goes away.
    pub fn kill(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.kill();
    }
}

fn spawn<F, Fut, E>(telemetry: Option<Telemetry>, serve: F) -> Running
where
    F: FnOnce(Listeners, Shutdown) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<(), E>> + Send + 'static,
    E: std::fmt::Display,
{
    spawn_at("127.0.0.1:0".parse().unwrap(), telemetry, serve)
}

/// A listener on `addr`, waiting up to 5 s for a killed service's runtime (shut down in
/// the background) to let go of it.
fn bind_soon(addr: SocketAddr) -> std::net::TcpListener {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match std::net::TcpListener::bind(addr) {
            Ok(listener) => return listener,
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20))
            }
            Err(e) => panic!("binding {addr}: {e}"),
        }
    }
}

/// Runs `serve` in a runtime of its own; with `telemetry`, every thread of that runtime
/// (and so every span and log line of the service) goes to that service's subscriber, as
/// the process-wide one would in a real deployment.
fn spawn_at<F, Fut, E>(addr: SocketAddr, telemetry: Option<Telemetry>, serve: F) -> Running
where
    F: FnOnce(Listeners, Shutdown) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<(), E>> + Send + 'static,
    E: std::fmt::Display,
{
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder.worker_threads(2).enable_all();
    if let Some(t) = &telemetry {
        let dispatch = t.dispatch().clone();
        // The guard would restore the previous default; these threads keep this one.
        builder
            .on_thread_start(move || std::mem::forget(tracing::dispatcher::set_default(&dispatch)));
    }
    let runtime = builder.build().unwrap();
    let listener = bind_soon(addr);
    listener.set_nonblocking(true).unwrap();
    let addr = listener.local_addr().unwrap();
    let metrics = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    metrics.set_nonblocking(true).unwrap();
    let metrics_addr = metrics.local_addr().unwrap();
    let http = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    http.set_nonblocking(true).unwrap();
    let http_addr = http.local_addr().unwrap();
    let shutdown = Shutdown::new();
    let s = shutdown.clone();
    runtime.spawn(async move {
        let listeners = Listeners {
            grpc: tokio::net::TcpListener::from_std(listener).unwrap(),
            metrics: Some(tokio::net::TcpListener::from_std(metrics).unwrap()),
            http: Some(tokio::net::TcpListener::from_std(http).unwrap()),
        };
        if let Err(e) = serve(listeners, s).await {
            eprintln!("service on {addr} ended: {e}");
        }
    });
    Running {
        addr,
        metrics_addr,
        http_addr,
        shutdown,
        runtime: Some(runtime),
        telemetry,
    }
}

pub fn worker_config(model: &Path) -> WorkerConfig {
    let mut c = WorkerConfig::with("127.0.0.1:0", "", &model.to_string_lossy());
    c.max_context = 0;
    c.session_ttl_ms = 60_000;
    c.device = duet_engine::testing::test_device();
    c
}

/// The service's telemetry when its configuration names an OTLP endpoint.
fn telemetry(service: &str, config: &TelemetryConfig) -> Option<Telemetry> {
    (!config.otlp_endpoint.is_empty())
        .then(|| Telemetry::new(service, config, LogFormat::Text, "warn").unwrap())
}

/// Worker `W` with `config`, on `addr` (a restart where the coordinator expects it: no
/// traces) or any free port.
fn start_worker<W: Worker>(config: WorkerConfig, addr: Option<SocketAddr>) -> Running {
    let traces = addr
        .is_none()
        .then(|| telemetry(W::service().name, &config.telemetry));
    let addr = addr.unwrap_or_else(|| "127.0.0.1:0".parse().unwrap());
    spawn_at(addr, traces.flatten(), move |l, s| {
        duet_worker_core::serve::<W>(l, config, s.wait())
    })
}

pub fn start_draft(config: WorkerConfig) -> Running {
    start_worker::<Drafter>(config, None)
}

/// A draft-worker on a given address (to restart one where the coordinator expects it).
pub fn start_draft_at(config: WorkerConfig, addr: SocketAddr) -> Running {
    start_worker::<Drafter>(config, Some(addr))
}

/// Why worker `W` refuses to start with `config` (it must).
pub async fn refused_start<W: duet_worker_core::Worker>(config: WorkerConfig) -> String {
    let listeners = duet_serving::metrics::Listeners {
        grpc: tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap(),
        metrics: None,
        http: None,
    };
    let refused = duet_worker_core::serve::<W>(listeners, config, std::future::pending());
    refused.await.unwrap_err().to_string()
}

pub fn start_target(config: WorkerConfig) -> Running {
    start_worker::<Verifier>(config, None)
}

/// A target-worker on a given address (to restart one where the coordinator expects it).
pub fn start_target_at(config: WorkerConfig, addr: SocketAddr) -> Running {
    start_worker::<Verifier>(config, Some(addr))
}

/// A coordinator for the target at `target` (no draft) that wants a bearer token: one of
/// `tokens` (one per line), written to a file in `dir`.
pub fn start_coordinator_with_tokens(target: &str, dir: &Path, tokens: &str) -> Running {
    let mut config = coordinator_config(target, None);
    ask_for_tokens(&mut config, dir, tokens);
    start_coordinator(config)
}

/// Has `config` ask for one of `tokens` (one per line), written to a file in `dir`.
pub fn ask_for_tokens(config: &mut duet_coordinator::CoordinatorConfig, dir: &Path, tokens: &str) {
    let file = dir.join("tokens");
    std::fs::write(&file, tokens).unwrap();
    config.auth_token_file = file.to_string_lossy().into_owned();
}

pub fn coordinator_config(
    target: &str,
    draft: Option<&str>,
) -> duet_coordinator::CoordinatorConfig {
    let mut c = duet_coordinator::CoordinatorConfig {
        listen: "127.0.0.1:0".into(),
        ..Default::default()
    };
    c.target.address = target.into();
    c.target.health_interval_ms = 50;
    c.draft.address = draft.unwrap_or_default().into();
    c.draft.health_interval_ms = 50;
    // Two cores run every test at once: be generous before declaring the draft slow.
    c.draft.timeout_ms = 20_000;
    c
}

/// A target-worker on the tiny target, its configuration adjusted by `adjust`, and a
/// coordinator without a draft-worker, serving: the models, the target, the coordinator.
pub async fn target_only(
    adjust: impl FnOnce(&mut duet_worker_core::WorkerConfig),
) -> (TinyModels, Running, Running) {
    let m = tiny_models();
    let mut config = worker_config(&m.target);
    adjust(&mut config);
    let target = start_target(config);
    let coordinator = start_coordinator(coordinator_config(&target.url(), None));
    wait_serving(&coordinator.url(), "").await;
    (m, target, coordinator)
}

/// A second coordinator on `stack`'s workers that drafts ahead
/// (`speculation.overlap_drafting`, with `concurrent_prefill`: separate devices), serving.
pub async fn start_drafting_ahead(stack: &Stack) -> Running {
    let mut config = coordinator_config(&stack.target.url(), Some(&stack.draft.url()));
    config.speculation.concurrent_prefill = true;
    config.speculation.overlap_drafting = true;
    config.speculation.take_turns = false;
    let ahead = start_coordinator(config);
    wait_serving(&ahead.url(), "").await;
    ahead
}

pub fn start_coordinator(config: duet_coordinator::CoordinatorConfig) -> Running {
    let t = telemetry(duet_coordinator::service().name, &config.telemetry);
    spawn(t, move |l, s| duet_coordinator::run(l, config, s.wait()))
}

/// The three services on the given models.
#[derive(Debug)]
pub struct Stack {
    pub draft: Running,
    pub target: Running,
    pub coordinator: Running,
}

impl Stack {
    pub fn start(draft_model: &Path, target_model: &Path) -> Self {
        Self::start_traced(draft_model, target_model, "")
    }

    /// The three services, each exporting its spans to `otlp_endpoint` (empty: none).
    pub fn start_traced(draft_model: &Path, target_model: &Path, otlp_endpoint: &str) -> Self {
        let traces = TelemetryConfig {
            otlp_endpoint: otlp_endpoint.into(),
            export_interval_ms: 100,
            ..TelemetryConfig::default()
        };
        let mut draft = worker_config(draft_model);
        draft.telemetry = traces.clone();
        let mut target = worker_config(target_model);
        target.telemetry = traces;
        Self::start_with(draft, target)
    }

    /// The three services with these worker configurations (the coordinator exports its
    /// spans where the draft-worker does).
    pub fn start_with(draft: WorkerConfig, target: WorkerConfig) -> Self {
        let traces = draft.telemetry.clone();
        let draft = start_draft(draft);
        let target = start_target(target);
        let mut coordinator = coordinator_config(&target.url(), Some(&draft.url()));
        coordinator.telemetry = traces;
        let coordinator = start_coordinator(coordinator);
        Self {
            draft,
            target,
            coordinator,
        }
    }

    /// Sends every finished span still queued in the three services. Blocks: a receiver in
    /// the same process must run on another thread (a multi-thread test runtime).
    pub fn flush_traces(&self) {
        for s in [&self.draft, &self.target, &self.coordinator] {
            if let Some(t) = &s.telemetry {
                t.flush();
            }
        }
    }
}

/// Two tiny random models that share a vocabulary (a draft and a different target).
#[derive(Debug)]
pub struct TinyModels {
    _dir: tempfile::TempDir,
    pub draft: PathBuf,
    pub target: PathBuf,
}

pub fn tiny_models() -> TinyModels {
    tiny_models_with(Vec::new())
}

/// The tiny models, their vocabulary grown by `more_specials` (control tokens).
pub fn tiny_models_with(more_specials: Vec<String>) -> TinyModels {
    let dir = tempfile::tempdir().unwrap();
    let draft = dir.path().join("draft.gguf");
    let target = dir.path().join("target.gguf");
    TinyModel {
        seed: 11,
        more_specials: more_specials.clone(),
        ..TinyModel::default()
    }
    .write(&draft)
    .unwrap();
    TinyModel {
        layers: 3,
        seed: 7,
        more_specials,
        ..TinyModel::default()
    }
    .write(&target)
    .unwrap();
    TinyModels {
        _dir: dir,
        draft,
        target,
    }
}

/// A Watch of the overall health of the server at `url`, on a connection of its own made
/// now (a draining server takes no new connections, but keeps this one).
pub async fn watch_health(url: &str) -> tonic::Streaming<tonic_health::pb::HealthCheckResponse> {
    let channel = Channel::from_shared(url.to_string())
        .unwrap()
        .connect()
        .await
        .unwrap();
    HealthClient::new(channel)
        .watch(tonic_health::pb::HealthCheckRequest::default())
        .await
        .unwrap()
        .into_inner()
}

/// Reads `health` until it says NOT_SERVING (the statuses before may repeat), or fails
/// after `limit`.
pub async fn wait_not_serving(
    health: &mut tonic::Streaming<tonic_health::pb::HealthCheckResponse>,
    limit: Duration,
) {
    let not_serving = async {
        while let Some(m) = health.message().await.unwrap() {
            if m.status == ServingStatus::NotServing as i32 {
                return;
            }
        }
        panic!("the health stream ended while SERVING");
    };
    tokio::time::timeout(limit, not_serving)
        .await
        .expect("health never said NOT_SERVING");
}

/// Waits (watching grpc.health.v1) until the service at `url` reports SERVING.
pub async fn wait_serving(url: &str, service: &str) {
    wait_health(url, service, ServingStatus::Serving).await
}

/// Waits (watching grpc.health.v1) until `service` at `url` reports `want`.
pub async fn wait_health(url: &str, service: &str, want: ServingStatus) {
    let wait = async {
        loop {
            let Ok(channel) = Channel::from_shared(url.to_string())
                .unwrap()
                .connect()
                .await
            else {
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            };
            let mut health = HealthClient::new(channel);
            let Ok(stream) = health
                .watch(tonic_health::pb::HealthCheckRequest {
                    service: service.into(),
                })
                .await
            else {
                continue;
            };
            let mut stream = stream.into_inner();
            while let Ok(Some(m)) = stream.message().await {
                if m.status == want as i32 {
                    return;
                }
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(120), wait)
        .await
        .unwrap_or_else(|_| panic!("{url} did not become {want:?}"));
}

/// The three services on the tiny models, serving (the models' files live as long as the
/// returned `TinyModels`).
pub async fn tiny_stack() -> (TinyModels, Stack) {
    tiny_stack_with(0).await
}

/// The tiny stack, its draft-worker's `vocab_shortlist` set to `shortlist`.
pub async fn tiny_stack_with(shortlist: usize) -> (TinyModels, Stack) {
    let m = tiny_models();
    let mut draft = worker_config(&m.draft);
    draft.vocab_shortlist = shortlist;
    let stack = Stack::start_with(draft, worker_config(&m.target));
    wait_stack(&stack).await;
    (m, stack)
}

/// A stack of code models (with fill-in-the-middle tokens), and the target's tokenizer.
pub async fn code_stack() -> (TinyModels, Stack, duet_engine::Tokenizer) {
    let m = tiny_models_with(duet_engine::testing::infill_specials());
    let stack = Stack::start_with(worker_config(&m.draft), worker_config(&m.target));
    wait_stack(&stack).await;
    let tok = duet_engine::Tokenizer::load(&m.target).unwrap();
    (m, stack, tok)
}

/// Waits until the coordinator serves and its draft-worker's breaker has closed.
pub async fn wait_stack(stack: &Stack) {
    wait_serving(&stack.draft.url(), "").await;
    wait_serving(&stack.target.url(), "").await;
    wait_serving(&stack.coordinator.url(), "").await;
    wait_serving(&stack.coordinator.url(), "duet.v1.DraftWorker").await;
}

pub async fn client(url: &str) -> GenerationClient<Channel> {
    GenerationClient::connect(url.to_string())
        .await
        .unwrap()
        .max_decoding_message_size(64 << 20)
}

/// Starts a Generate stream (the caller reads it).
pub async fn open_stream(
    url: &str,
    req: pb::GenerateRequest,
) -> tonic::Streaming<pb::GenerateResponse> {
    client(url).await.generate(req).await.unwrap().into_inner()
}

/// One Generate call, read to its end.
pub async fn generate(
    url: &str,
    req: impl tonic::IntoRequest<pb::GenerateRequest>,
) -> Result<Completion, tonic::Status> {
    let stream = client(url).await.generate(req).await?.into_inner();
    Completion::read(stream, |_| {}).await
}

/// The model at `path` on the device the tests' workers use (`DUET_TEST_DEVICE`), for a
/// test's reference figures.
pub fn reference_model(path: &Path) -> duet_engine::Model {
    duet_engine::Model::load(path, &duet_engine::testing::test_load_options()).unwrap()
}

/// How far apart two computations of the same tokens' figures, a prefill's rows and
/// decoding steps', may be: `None` on the CPU, where both run the same kernels in the same
/// order (the same bits). On a GPU a prefill runs candle's kernels and a step ours, whose
/// logits agree within 1% of the largest (`the_cuda_step_agrees_with_candles_ops`); a
/// log-probability, a logit less the log of the row's sum, then within 2% of the largest
/// logit `target` gives after `ids`.
pub fn figures_bound(target: &Path, ids: &[u32]) -> Option<f32> {
    if duet_engine::testing::test_device() == "cpu" {
        return None;
    }
    let model = reference_model(target);
    let mut cache = model.new_cache(ids.len()).unwrap();
    let logits = model
        .forward(&mut cache, ids, duet_engine::LogitsFor::All)
        .unwrap();
    let rows = (0..logits.rows()).flat_map(|i| logits.row(i));
    Some(0.02 * rows.fold(0f32, |m, x| m.max(x.abs())))
}

/// `got` are `want` ([`figures_bound`]'s `bound`): bit for bit, or each log-probability
/// within it.
pub fn assert_same_figures(
    got: &[pb::TokenLogprobs],
    want: &[pb::TokenLogprobs],
    bound: Option<f32>,
) {
    let Some(bound) = bound else {
        assert_eq!(got, want);
        return;
    };
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g.logprob - w.logprob).abs() <= bound,
            "token {i}: {g:?} against {w:?} (within {bound})"
        );
    }
}

pub fn request(
    prompt: &str,
    max_tokens: u32,
    method: pb::SpeculationMethod,
) -> pb::GenerateRequest {
    pb::GenerateRequest {
        input: Some(pb::generate_request::Input::Prompt(prompt.into())),
        max_tokens,
        speculation: method as i32,
        ..Default::default()
    }
}

/// Opens a greedy session with prompt `[1, 2, 3]` on the worker at `url`, straight over the
/// worker protocol.
pub async fn open_session(url: &str, capacity: u32) -> pb::OpenSessionResponse {
    open_session_with(url, capacity, None).await
}

/// A session like [`open_session`]'s that samples at temperature 1 (no cut).
pub async fn open_sampling_session(url: &str, capacity: u32) -> pb::OpenSessionResponse {
    let sampling = pb::SamplingParams {
        temperature: 1.0,
        top_p: 1.0,
        ..Default::default()
    };
    open_session_with(url, capacity, Some(sampling)).await
}

async fn open_session_with(
    url: &str,
    capacity: u32,
    sampling: Option<pb::SamplingParams>,
) -> pb::OpenSessionResponse {
    duet_proto::v1::worker_client::WorkerClient::connect(url.to_string())
        .await
        .unwrap()
        .open_session(pb::OpenSessionRequest {
            session_id: vec![],
            prompt: vec![1, 2, 3],
            capacity,
            sampling,
            generated_after: 0,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
}

/// Active sessions on a worker, from its Stats RPC.
pub async fn worker_sessions(url: &str) -> u32 {
    let mut c = duet_proto::v1::worker_client::WorkerClient::connect(url.to_string())
        .await
        .unwrap();
    c.stats(pb::StatsRequest {})
        .await
        .unwrap()
        .into_inner()
        .active_sessions
}

/// Polls until both workers hold no session (or fails after `limit`).
pub async fn wait_no_sessions(stack: &Stack, limit: Duration) {
    for worker in [&stack.draft, &stack.target] {
        wait_sessions_closed(&worker.url(), limit).await;
    }
}

/// Polls until the worker at `url` holds no session (sessions close in the background
/// after their request ends), or fails after `limit`.
pub async fn wait_sessions_closed(url: &str, limit: Duration) {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let open = worker_sessions(url).await;
        if open == 0 {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{open} sessions still open on {url} after {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Path of a model `scripts/fetch-models` put in the cache; panics with the fix if absent.
pub fn real_model(file: &str) -> PathBuf {
    duet_engine::testing::cached_model(file)
}

/// The HTTP status of `GET path` on a service's metrics port.
pub async fn http_status(service: &Running, path: &str) -> u16 {
    http(service.metrics_addr, "GET", path, &[], "").await.0
}

/// `GET /metrics` of a service, as text.
pub async fn scrape(service: &Running) -> String {
    let (status, body) = http(service.metrics_addr, "GET", "/metrics", &[], "").await;
    assert_eq!(status, 200, "{body}");
    body
}

/// A scrape of a worker once its sample `name` reaches `want` (or after 2 s): the model
/// thread counts a run after its handler has replied, so the last run's figures may land a
/// moment after the answer.
pub async fn scrape_until(worker: &Running, name: &str, want: f64) -> String {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    let mut t = scrape(worker).await;
    while sample(&t, name) < want && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        t = scrape(worker).await;
    }
    t
}

/// Prompt prefills a worker has run (`duet_worker_forward_seconds` of kind `prefill`).
pub async fn prefills(worker: &Running) -> f64 {
    sample(
        &scrape(worker).await,
        "duet_worker_forward_seconds_count{kind=\"prefill\"}",
    )
}

/// The value of the sample `name` (with its labels, as exposed) in a scrape, 0 if absent.
pub fn sample(scrape: &str, name: &str) -> f64 {
    scrape
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// One HTTP/1.1 request with `headers` (the connection closes after it): status and body, a
/// chunked body put back together.
pub async fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String) {
    let (status, _, body) = http_exchange(addr, method, path, headers, body).await;
    (status, body)
}

/// Whether `id` is a UUID as the servers make request ids (36 characters, hex in 8-4-4-4-12).
pub fn is_uuid(id: &str) -> bool {
    let at = |(i, c): (usize, char)| match i {
        8 | 13 | 18 | 23 => c == '-',
        _ => c.is_ascii_hexdigit(),
    };
    id.len() == 36 && id.chars().enumerate().all(at)
}

/// The value of header `name` (lowercase) in the head of an answer from [`http_exchange`].
pub fn header_of<'a>(head: &'a [(String, String)], name: &str) -> Option<&'a str> {
    (head.iter()).find_map(|(k, v)| (k == name).then_some(v.as_str()))
}

/// [`http`] with the answer's headers too (names lowercase), between status and body.
pub async fn http_exchange(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, Vec<(String, String)>, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let extra: String = headers
        .iter()
        .map(|(k, v)| format!("{k}: {v}\r\n"))
        .collect();
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: duet\r\nConnection: close\r\nContent-Type: application/json\r\n{extra}Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await.unwrap();
    let raw = String::from_utf8(raw).unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap();
    let status = head[9..12].parse().unwrap();
    let fields: Vec<(String, String)> = (head.lines().skip(1))
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let chunked = header_of(&fields, "transfer-encoding") == Some("chunked");
    let body = if chunked {
        unchunk(body)
    } else {
        body.to_string()
    };
    (status, fields, body)
}

fn unchunk(mut body: &str) -> String {
    let mut out = String::new();
    loop {
        let (size, rest) = body.split_once("\r\n").unwrap();
        let size = usize::from_str_radix(size.trim(), 16).unwrap();
        if size == 0 {
            return out;
        }
        out.push_str(&rest[..size]);
        body = &rest[size + 2..];
    }
}
