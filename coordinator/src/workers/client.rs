//! A client for one worker's replicas: deadlines on every call, gRPC statuses turned into
//! [`CallError`]s naming the worker, health checks, Describe, and sessions pinned to the
//! replica that opened them (`pool.rs`) that close when they drop. The target-worker and
//! the draft-worker share this client: both serve `duet.v1.Worker`.

use super::pool::{Hold, ModelCheck, Pool, PrefixMemory, Replica, Traced};
use super::{CallError, Failure, Lease, Open, Party, TargetOpened, WorkerTiming};
use crate::config::worker_tls;
use duet_engine::logprobs::TokenLogprobs;
use duet_proto::v1 as pb;
use duet_proto::v1::worker_client::WorkerClient as SessionsClient;
use duet_serving::grpc::MAX_MESSAGE_BYTES;
use duet_serving::telemetry::{client_span, set_failed};
use duet_serving::tls::ClientTls;
use duet_serving::watch;
use duet_serving::wire::{format_to_wire, logprobs_from_wire, sampling_to_wire};
use std::borrow::Cow;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;
use tonic::{Code, Status};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// Deadlines of one worker's calls.
#[derive(Debug, Clone, Copy)]
pub struct Deadlines {
    /// One Propose or Verify: at most this, and before any call's time is known, this.
    pub call: Duration,
    /// One Propose or Verify once calls have been timed: [`SLACK`] times the pace, and at
    /// least this (equal to `call`: a fixed deadline).
    pub call_floor: Duration,
    /// OpenSession, before the time its prefill is allowed ([`Deadlines::open_for`]).
    pub open: Duration,
    /// The time allowed per prompt token an open has the worker prefill (the inverse of
    /// `min_prefill_tokens_per_s`).
    pub prefill_per_token: Duration,
    /// Health checks, Describe, CloseSession: control calls, not bound by a tight per-round
    /// deadline.
    pub control: Duration,
}

impl Deadlines {
    /// The deadline of an OpenSession for a prompt of `own` tokens while `before` more are
    /// prefilling on its replica for this coordinator (the opens in flight before it): a
    /// long prompt, or one queued behind others, is not a stuck worker. The queue counts
    /// up to [`MAX_QUEUED_PREFILL`] tokens, so a deep queue never stretches the wait on a
    /// stuck replica without bound.
    pub fn open_for(&self, own: usize, before: usize) -> Duration {
        let tokens = own.saturating_add(before.min(MAX_QUEUED_PREFILL));
        let tokens = u32::try_from(tokens).unwrap_or(u32::MAX);
        self.open
            .saturating_add(self.prefill_per_token.saturating_mul(tokens))
    }
}

/// The most prompt tokens queued before an open that its deadline allows time for (a few
/// long prompts): past it, a replica that answers no open in that time is taken as stuck.
pub const MAX_QUEUED_PREFILL: usize = 8_192;

/// A call's deadline is this many times the slowest recent call's time.
pub const SLACK: u32 = 8;

/// The pace of a worker's rounds: a slowly decaying maximum of its Propose or Verify calls'
/// times, from which their deadline follows. A replica that stops answering is then given
/// up after a few of its usual passes, not after the configured ceiling.
#[derive(Debug, Default)]
pub struct Pace(Mutex<Option<Duration>>);

impl Pace {
    /// A call that took `took`; the maximum so far decays by 1% a call, so a slow pass
    /// (a batch at its largest, a prefill chunk queued before it) counts for a few
    /// hundred calls.
    pub fn record(&self, took: Duration) {
        let mut max = self.0.lock().unwrap_or_else(|e| e.into_inner());
        *max = Some(max.map_or(took, |m| took.max(m.mul_f64(0.99))));
    }

    /// [`SLACK`] times the pace within `floor..=ceiling`; `ceiling` before any call.
    pub fn deadline(&self, floor: Duration, ceiling: Duration) -> Duration {
        let max = *self.0.lock().unwrap_or_else(|e| e.into_inner());
        max.map_or(ceiling, |m| (m * SLACK).max(floor).min(ceiling))
    }
}

/// The gRPC status of a worker call as the coordinator's failure kinds.
pub fn failure(status: &Status) -> Failure {
    let message = status.message().to_string();
    match status.code() {
        // Refused connections and broken streams arrive as UNAVAILABLE, UNKNOWN or CANCELLED.
        Code::Unavailable | Code::Unknown | Code::Cancelled => Failure::Unreachable(message),
        Code::DeadlineExceeded => Failure::TimedOut(message),
        Code::ResourceExhausted => Failure::Busy(message),
        Code::NotFound => Failure::SessionLost(message),
        Code::InvalidArgument
        | Code::FailedPrecondition
        | Code::OutOfRange
        | Code::Unimplemented
        | Code::AlreadyExists
        | Code::Aborted => Failure::Refused(message),
        Code::Ok
        | Code::Internal
        | Code::DataLoss
        | Code::PermissionDenied
        | Code::Unauthenticated => Failure::Failed(message),
    }
}

/// One worker (all its replicas).
#[derive(Debug, Clone)]
pub struct WorkerClient {
    party: Party,
    /// As configured (URLs, comma-separated).
    address: String,
    /// The worker's own gRPC service, whose health says it is that kind of worker and ready.
    service: &'static str,
    pool: Arc<Pool>,
    deadlines: Deadlines,
    /// The pace of its Propose or Verify calls, for their deadline.
    pace: Arc<Pace>,
    /// What every replica's model must be (set once the models are known): a replica
    /// that describes another gets no session.
    expected: Arc<OnceLock<Expected>>,
}

/// The model every replica of a worker must serve.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expected {
    pub vocabulary_sha256: String,
    /// The model file's name (target replicas: the same model, or the output would depend
    /// on the replica); `None` where only the vocabulary must agree (draft replicas).
    pub model: Option<String>,
}

impl WorkerClient {
    /// Starts resolving `address` (in the background, every `discovery_interval`).
    pub fn new(
        party: Party,
        address: &str,
        tls: Option<tonic::transport::ClientTlsConfig>,
        connect_timeout: Duration,
        discovery_interval: Duration,
        deadlines: Deadlines,
        prefix_routing: Option<crate::config::PrefixRouting>,
    ) -> Self {
        let pool = Pool::new(address, tls, connect_timeout, prefix_routing);
        pool.keep_resolving(discovery_interval);
        Self {
            party,
            address: address.to_string(),
            service: match party {
                Party::Target => duet_proto::v1::target_worker_server::SERVICE_NAME,
                Party::Draft => duet_proto::v1::draft_worker_server::SERVICE_NAME,
            },
            pool,
            deadlines,
            pace: Arc::default(),
            expected: Arc::default(),
        }
    }

    /// Reads the TLS files of `tls` (keys under `prefix`; the address is `https://`) again
    /// every `interval`: when they change and load, new connections to every replica use
    /// them.
    pub fn follow_tls_files(&self, prefix: &str, tls: &ClientTls, interval: Duration) {
        let files = tls.files();
        let seen = watch::read_all(&files);
        let pool = Arc::downgrade(&self.pool);
        let (prefix, tls, address) = (prefix.to_string(), tls.clone(), self.address.clone());
        let reload = move || -> Result<bool, String> {
            let Some(pool) = pool.upgrade() else {
                return Ok(false);
            };
            let config = worker_tls(&prefix, &address, &tls).map_err(|e| e.to_string())?;
            if let Some(config) = config {
                pool.set_tls(config);
            }
            Ok(true)
        };
        watch::watch_files("TLS files", files, seen, interval, reload);
    }

    /// From now on every replica must serve this model (checked once per replica).
    pub fn expect(&self, expected: Expected) {
        let _ = self.expected.set(expected);
    }

    /// `Err(why)` when `replica` serves another model than the expected one (asked once,
    /// then remembered; a replica that cannot answer is asked again next time).
    async fn check_model(&self, replica: &Replica) -> Result<(), CallError> {
        let Some(expected) = self.expected.get() else {
            return Ok(());
        };
        let known = match replica.model_check() {
            Some(known) => known,
            None => {
                let mut client = sessions_client(replica.traced());
                let without_tokenizer = true;
                let describe = client.describe(pb::DescribeRequest { without_tokenizer });
                let d = self
                    .call(replica.addr, "Describe", self.deadlines.control, describe)
                    .await?
                    .into_inner();
                let known = self.judge(replica.addr, expected, d);
                replica.set_model_check(Some(known.clone()));
                known
            }
        };
        known
            .verdict
            .map_err(|why| self.error(replica.addr.to_string(), Failure::Refused(why)))
    }

    /// Whether the model `d` at `addr` is the `expected` one; logged when it is not.
    fn judge(&self, addr: SocketAddr, expected: &Expected, d: pb::ModelDescription) -> ModelCheck {
        let differs = d.vocabulary_sha256 != expected.vocabulary_sha256
            || expected.model.as_ref().is_some_and(|m| *m != d.model);
        let verdict = match differs {
            true => {
                let why = format!(
                    "{addr} serves {} (vocabulary {}), not the {}'s model; it gets no sessions",
                    d.model, d.vocabulary_sha256, self.party
                );
                tracing::error!("{why}");
                Err(why)
            }
            false => Ok(()),
        };
        ModelCheck {
            instance: d.instance_id,
            verdict,
            verifies_trees: d.verifies_trees,
            decodes_with_lookup: d.decodes_with_lookup,
            applies_penalties: d.applies_penalties,
            scores_prompts: d.scores_prompts,
            applies_logit_bias: d.applies_logit_bias,
            applies_min_tokens: d.applies_min_tokens,
            applies_structured_output: d.applies_structured_output,
            applies_min_p: d.applies_min_p,
            applies_repetition_penalty: d.applies_repetition_penalty,
            holds_stop_tokens: d.holds_stop_tokens,
            adapters: d.adapters,
            adapters_from_dir: d.adapters_from_dir,
        }
    }

    /// After a session opened on `replica`'s worker `instance`: when another instance than
    /// the one whose model was checked answered (the pod was replaced at the same
    /// address), its model is asked again.
    async fn recheck_model(&self, replica: &Replica, instance: u64) -> Result<(), CallError> {
        match replica.model_check() {
            Some(known) if known.instance != instance => {
                tracing::info!(replica = %replica.addr, "a new worker instance; checking its model");
                replica.set_model_check(None);
                self.check_model(replica).await
            }
            _ => Ok(()),
        }
    }

    pub fn party(&self) -> Party {
        self.party
    }

    pub fn address(&self) -> &str {
        &self.address
    }

    pub fn deadlines(&self) -> Deadlines {
        self.deadlines
    }

    /// Runs one Propose or Verify `call` within its deadline from the calls' pace, timing it.
    pub async fn step<T>(
        &self,
        at: impl std::fmt::Display,
        what: &str,
        call: impl Future<Output = Result<T, Status>>,
    ) -> Result<T, CallError> {
        let d = &self.deadlines;
        let limit = self.pace.deadline(d.call_floor, d.call);
        let started = tokio::time::Instant::now();
        let answer = self.call(at, what, limit, call).await?;
        self.pace.record(started.elapsed());
        Ok(answer)
    }

    /// A failure of this worker at `at` (a replica, or the configured address).
    pub fn error(&self, at: impl std::fmt::Display, failure: Failure) -> CallError {
        CallError {
            party: self.party,
            at: Some(at.to_string()),
            failure,
        }
    }

    /// Runs `call` with a deadline; a failure or running out becomes a [`CallError`] at `at`.
    pub async fn call<T>(
        &self,
        at: impl std::fmt::Display,
        what: &str,
        limit: Duration,
        call: impl Future<Output = Result<T, Status>>,
    ) -> Result<T, CallError> {
        match tokio::time::timeout(limit, call).await {
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(status)) => Err(self.error(at, failure(&status))),
            Err(_) => Err(self.error(
                at,
                Failure::TimedOut(format!("{what} took longer than {} ms", limit.as_millis())),
            )),
        }
    }

    /// The first replica (in resolution order) whose health check says its worker service
    /// is SERVING; `Ok(Err(why))` when one answered but none serves (loading, draining, or
    /// not this kind of worker), the error otherwise. All replicas are checked at once, each
    /// within the control deadline: one stuck replica delays nothing.
    pub async fn first_serving(&self) -> Result<Result<Replica, String>, CallError> {
        if self.pool.replicas().is_empty() {
            // Not resolved yet (or nothing was found last time): ask now, not at the next round.
            self.pool.refresh().await;
        }
        let mut unreachable = self.error(
            &self.address,
            Failure::Unreachable("no replica resolved (yet)".into()),
        );
        let mut not_serving = None;
        let replicas = self.pool.replicas();
        let checks = replicas.iter().map(|replica| {
            let mut health = HealthClient::new(replica.channel.clone());
            let service = self.service.to_string();
            async move {
                let check = health.check(tonic_health::pb::HealthCheckRequest { service });
                self.call(replica.addr, "health check", self.deadlines.control, check)
                    .await
            }
        });
        let answers = futures::future::join_all(checks).await;
        for (replica, answer) in replicas.into_iter().zip(answers) {
            match answer {
                Ok(r) if r.get_ref().status == ServingStatus::Serving as i32 => {
                    return Ok(Ok(replica));
                }
                Ok(_) => {
                    not_serving = Some(format!(
                        "the {} at {} is not serving (loading or draining)",
                        self.party, replica.addr
                    ));
                }
                Err(CallError {
                    failure: Failure::SessionLost(_),
                    ..
                }) => {
                    // The health service does not know the name: another kind of server.
                    not_serving = Some(format!(
                        "{} does not serve {} (is it a {}?)",
                        replica.addr, self.service, self.party
                    ));
                }
                Err(e) => unreachable = e,
            }
        }
        match not_serving {
            Some(reason) => Ok(Err(reason)),
            None => Err(unreachable),
        }
    }

    /// The fraction of the replicas' KV-cache budgets their open sessions reserve, over the
    /// replicas whose Stats answer within the control deadline (all asked at once); `None`
    /// when none answers.
    pub async fn kv_usage(&self) -> Option<f64> {
        let replicas = self.pool.replicas();
        let asks = replicas.iter().map(|replica| {
            // Not traced: a figure read every health round would fill the traces.
            let mut client = SessionsClient::new(replica.channel.clone());
            async move {
                let stats = client.stats(pb::StatsRequest {});
                self.call(replica.addr, "Stats", self.deadlines.control, stats)
                    .await
            }
        });
        let answers = futures::future::join_all(asks).await;
        let stats = answers.into_iter().filter_map(Result::ok);
        let (reserved, budget) = stats.fold((0, 0), |(r, b), s| {
            let s = s.into_inner();
            (r + s.kv_tokens_reserved, b + s.kv_token_budget)
        });
        (budget > 0).then(|| reserved as f64 / budget as f64)
    }

    /// The first serving replica's Describe, `without_tokenizer` where the caller knows it.
    pub async fn describe(
        &self,
        without_tokenizer: bool,
    ) -> Result<pb::ModelDescription, CallError> {
        let replica = self
            .first_serving()
            .await?
            .map_err(|reason| self.error(&self.address, Failure::Unreachable(reason)))?;
        let mut client = sessions_client(replica.traced());
        let describe = client.describe(pb::DescribeRequest { without_tokenizer });
        let d = self
            .call(replica.addr, "Describe", self.deadlines.control, describe)
            .await?;
        Ok(d.into_inner())
    }

    /// Opens a session on the replica holding the longest prefix of the prompt, or the least
    /// loaded (`Pool::for_prompt`; `failed`, a replica that just failed, is tried after
    /// all others), trying the next one while a replica cannot be reached or is
    /// busy (its session limit, KV budget or queue full: other coordinators' sessions count
    /// there too); nothing was opened there, so another may take it.
    pub async fn open(
        &self,
        open: Open<'_>,
        failed: Option<std::net::SocketAddr>,
    ) -> Result<TargetOpened<Session>, CallError> {
        // Named here, so that a call given up on can still close what it opened.
        let id: [u8; 16] = rand::random();
        let mut request = pb::OpenSessionRequest {
            session_id: id.to_vec(),
            prompt: open.prompt.to_vec(),
            capacity: open.capacity as u32,
            sampling: Some(sampling_to_wire(open.sampling)),
            generated_after: open.generated_after as u32,
            top_logprobs: open.logprobs.map(|n| n as u32),
            presence_penalty: open.penalties.presence,
            frequency_penalty: open.penalties.frequency,
            repetition_penalty: open.penalties.repetition,
            prompt_logprobs: open.prompt_logprobs.map(|n| n as u32),
            logit_bias: open.logit_bias.entries().iter().copied().collect(),
            min_tokens: open.min_tokens as u32,
            structured_output: open.format.map(format_to_wire),
            cache_salt: open.cache_salt,
            stop_token_ids: open.stop_token_ids.to_vec(),
            priority: open.priority,
            ask_for_room: open.ask_for_room,
            adapter: open.adapter.unwrap_or_default().to_string(),
            adapter_if_loaded: self.party == Party::Draft,
        };
        let span = client_span(duet_proto::v1::worker_server::SERVICE_NAME, "OpenSession");
        let attempts = async {
            let mut last = self.error(
                &self.address,
                Failure::Unreachable("no replica resolved yet".into()),
            );
            let blocks = duet_engine::prefix_block_hashes(open.prompt, open.cache_salt);
            let mut replicas = self.pool.for_prompt(open.prompt.len(), &blocks);
            // A stable sort: the others keep their order.
            replicas.sort_by_key(|r| Some(r.addr) == failed);
            for replica in replicas {
                match self.open_on(&replica, &request, &open).await? {
                    Ok(opened) => {
                        replica.remember(&blocks);
                        return Ok(opened);
                    }
                    Err(e) => last = e,
                }
                // One session is asked to give way for one refused open, not one a replica.
                request.ask_for_room = false;
            }
            Err(last)
        };
        traced_call(span, attempts).await
    }

    /// Opens the session of `request` on one replica. Inside: the session, or why this
    /// replica did not take it while another may (unreachable, busy, another model; nothing
    /// is left open there); outside, an error that ends the open.
    async fn open_on(
        &self,
        replica: &Replica,
        request: &pb::OpenSessionRequest,
        open: &Open<'_>,
    ) -> Result<Result<TargetOpened<Session>, CallError>, CallError> {
        if let Err(e) = self.check_model(replica).await {
            return Ok(Err(e));
        }
        if let Some(why) = unfit(replica.model_check().as_ref(), open, self.party) {
            return Ok(Err(
                self.error(replica.addr.to_string(), Failure::Refused(why))
            ));
        }
        let request = for_replica(request, replica.model_check().as_ref(), self.party);
        let channel = replica.traced();
        let hold = replica.hold();
        let mut stub = sessions_client(channel.clone());
        let mut pending = PendingOpen {
            id: request.session_id.clone(),
            channel: channel.clone(),
            deadline: self.deadlines.control,
            answered: false,
            lease: open.lease.clone(),
        };
        let own = open.prompt.len();
        let (_prefilling, before) = replica.prefill(own);
        let what = format!(
            "OpenSession ({own} prompt tokens, {before} more prefilling before it on the \
             replica for this coordinator)"
        );
        let call = stub.open_session(request.into_owned());
        let limit = self.deadlines.open_for(own, before);
        let answer = self.call(replica.addr, &what, limit, call).await;
        // A refusal is an answer: nothing was opened. A timeout or a broken connection is
        // not: the worker may have opened the session all the same.
        pending.answered = !matches!(
            &answer,
            Err(CallError {
                failure: Failure::TimedOut(_) | Failure::Unreachable(_),
                ..
            })
        );
        let r = match answer {
            Ok(r) => r.into_inner(),
            Err(e) if matches!(e.failure, Failure::Unreachable(_) | Failure::Busy(_)) => {
                tracing::warn!(error = %e, "replica unavailable or busy; trying the next");
                return Ok(Err(e));
            }
            Err(e) => return Err(e),
        };
        let mut session = Session {
            id: r.session_id,
            instance: r.instance_id,
            addr: replica.addr,
            channel,
            hold: std::sync::Mutex::new(Some(hold)),
            close_deadline: self.deadlines.control,
            lease: open.lease.clone(),
            prefixes: replica.prefix_memory(),
            verifies_trees: false,
            decodes_with_lookup: false,
        };
        if let Err(e) = self.recheck_model(replica, r.instance_id).await {
            drop(session); // closes it
            return Ok(Err(e));
        }
        let check = replica.model_check();
        session.verifies_trees = check.as_ref().is_some_and(|c| c.verifies_trees);
        session.decodes_with_lookup = check.is_some_and(|c| c.decodes_with_lookup);
        let timing = WorkerTiming {
            cached: r.cached_tokens as usize,
            ..timing(r.timing)
        };
        let figures = prompt_figures(&r.prompt_logprobs, open)
            .map_err(|why| self.error(replica.addr.to_string(), Failure::Malformed(why)))?;
        Ok(Ok((session, timing, figures)))
    }
}

/// Why a `party` replica whose Describe said `check` cannot take `open`'s session, if it
/// cannot: a target from before a field the open sets would leave it out of its answers (a
/// draft from before one only proposes without it: acceptance, not exactness).
fn unfit(check: Option<&ModelCheck>, open: &Open<'_>, party: Party) -> Option<String> {
    let check = check.filter(|_| party == Party::Target)?;
    let loads = |name: &str| check.adapters_from_dir || check.adapters.iter().any(|a| a == name);
    if let Some(name) = open.adapter.filter(|name| !loads(name)) {
        return Some(format!("the worker loads no adapter `{name}`"));
    }
    let predates = match () {
        _ if !check.applies_logit_bias && !open.logit_bias.is_empty() => "logit_bias",
        _ if !check.applies_repetition_penalty && open.penalties.repeats() => "repetition_penalty",
        // Greedy choices read no min-p.
        _ if !check.applies_min_p && open.sampling.min_p > 0.0 && !open.sampling.is_greedy() => {
            "min_p"
        }
        _ if !check.applies_penalties && !open.penalties.is_none() => {
            "presence_penalty and frequency_penalty"
        }
        _ if !check.applies_penalties && open.logprobs.is_some() => "logprobs",
        _ if !check.scores_prompts && open.prompt_logprobs.is_some() => "prompt_logprobs",
        _ if !check.applies_min_tokens && open.min_tokens > 0 => "min_tokens",
        _ if !check.holds_stop_tokens && !open.stop_token_ids.is_empty() => {
            "stop_token_ids with min_tokens"
        }
        _ if !check.applies_structured_output && open.format.is_some() => "structured_output",
        _ => return None,
    };
    Some(format!(
        "the worker predates {predates}: it would leave them out"
    ))
}

/// What a `party` replica whose Describe said `check` is sent of `request`: all of it, but
/// to a draft replica, a structured output where it takes none (from before it, or its
/// vocabulary llguidance cannot read: it would refuse the session), which then proposes
/// unconstrained, and an adapter where it neither lists it nor reads a directory (a worker
/// from before draft adapters would refuse the session), which then drafts without it.
fn for_replica<'a>(
    request: &'a pb::OpenSessionRequest,
    check: Option<&ModelCheck>,
    party: Party,
) -> Cow<'a, pb::OpenSessionRequest> {
    if party != Party::Draft {
        return Cow::Borrowed(request);
    }
    // A replica not described yet gets the format, as before draft adapters, not an adapter.
    let format = check.is_none_or(|c| c.applies_structured_output);
    let adapter =
        check.is_some_and(|c| c.adapters_from_dir || c.adapters.contains(&request.adapter));
    let strips_format = !format && request.structured_output.is_some();
    let strips_adapter = !adapter && !request.adapter.is_empty();
    if !strips_format && !strips_adapter {
        return Cow::Borrowed(request);
    }
    Cow::Owned(pb::OpenSessionRequest {
        structured_output: request.structured_output.clone().filter(|_| format),
        adapter: if adapter {
            request.adapter.clone()
        } else {
            String::new()
        },
        ..request.clone()
    })
}

/// The prompt's figures an open answered: one for each prompt token after the first where
/// `open` asked for them, else none.
fn prompt_figures(
    wire: &[pb::TokenLogprobs],
    open: &Open<'_>,
) -> Result<Vec<TokenLogprobs>, String> {
    let want = open.prompt_logprobs.map_or(0, |_| open.prompt.len() - 1);
    if wire.len() != want {
        return Err(format!(
            "{} prompt figures for {} prompt tokens",
            wire.len(),
            open.prompt.len()
        ));
    }
    let read = wire.iter().map(logprobs_from_wire).collect::<Option<_>>();
    read.ok_or_else(|| "prompt_logprobs: alternatives' ids and figures differ in number".into())
}

/// Runs `call` inside `span` (a client span); a failure marks the span failed with its
/// message.
pub async fn traced_call<T>(
    span: tracing::Span,
    call: impl Future<Output = Result<T, CallError>>,
) -> Result<T, CallError> {
    use tracing::Instrument;
    let result = call.instrument(span.clone()).await;
    if let Err(e) = &result {
        set_failed(&span, &e.to_string());
    }
    result
}

fn sessions_client(channel: Traced) -> SessionsClient<Traced> {
    SessionsClient::new(channel)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES)
}

/// A worker's timing off the wire.
pub fn timing(t: Option<pb::Timing>) -> WorkerTiming {
    let t = t.unwrap_or_default();
    WorkerTiming {
        queue: Duration::from_micros(t.queue_us),
        forward: Duration::from_micros(t.forward_us),
        batch_calls: t.batch_calls as usize,
        batch_rows: t.batch_rows as usize,
        share: Duration::from_micros(t.share_us),
        cached: 0,
    }
}

/// A session open on a worker replica. Dropping it closes the session in the background
/// (best effort: the worker's idle TTL is the backstop), so every way out of a request
/// frees it.
pub struct Session {
    /// The worker's random id of the session (16 bytes).
    pub id: Vec<u8>,
    /// The worker process that holds it.
    pub instance: u64,
    /// The replica that holds the session: every call of the session goes there.
    pub addr: std::net::SocketAddr,
    pub channel: Traced,
    /// It counts among the replica's sessions (routing) until it is closed.
    hold: std::sync::Mutex<Option<Hold>>,
    close_deadline: Duration,
    /// Let go of once the worker has answered the close.
    lease: Lease,
    /// What routing knows its replica's prefix cache holds.
    prefixes: PrefixMemory,
    /// Its replica verifies trees of drafts (as its Describe said).
    pub verifies_trees: bool,
    /// Its replica looks up drafts inside its Decode streams (as its Describe said).
    pub decodes_with_lookup: bool,
}

impl Session {
    /// Its replica holds the rows of the sequence of block hashes `blocks` (see
    /// `Workers::hold_prefix`).
    pub fn held_prefix(&self, blocks: &[u64]) {
        self.prefixes.remember(blocks);
    }

    /// Closes the session now, waiting for the worker's answer (or the close deadline), so
    /// that its KV is free when this returns; its drop then sends nothing.
    pub async fn close(&self) {
        let hold = self.hold.lock().unwrap_or_else(|e| e.into_inner()).take();
        if hold.is_none() {
            return;
        }
        let request = pb::CloseSessionRequest {
            session_id: self.id.clone(),
            instance_id: self.instance,
        };
        close_call(&self.channel, request, self.close_deadline).await;
    }
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("id", &duet_serving::wire::hex(&self.id))
            .field("addr", &self.addr)
            .finish()
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        let hold = self.hold.get_mut().unwrap_or_else(|e| e.into_inner());
        if hold.take().is_none() {
            return; // closed already
        }
        let request = pb::CloseSessionRequest {
            session_id: std::mem::take(&mut self.id),
            instance_id: self.instance,
        };
        let lease = std::mem::take(&mut self.lease);
        close_in_background(&self.channel, request, self.close_deadline, lease);
    }
}

/// An OpenSession call in flight. Dropped before the worker answered (the request ended, the
/// call timed out, its connection broke), it closes the session by the id the call named,
/// on whichever instance holds it: an answer nobody reads leaves nothing open until the
/// worker's TTL ("Giving up on an open" in worker.proto).
struct PendingOpen {
    id: Vec<u8>,
    channel: Traced,
    deadline: Duration,
    answered: bool,
    lease: Lease,
}

impl Drop for PendingOpen {
    fn drop(&mut self) {
        if self.answered {
            return;
        }
        let request = pb::CloseSessionRequest {
            session_id: std::mem::take(&mut self.id),
            instance_id: 0,
        };
        let lease = std::mem::take(&mut self.lease);
        close_in_background(&self.channel, request, self.deadline, lease);
    }
}

/// Sends CloseSession without waiting for it (best effort: the worker's idle TTL is the
/// backstop); `lease` goes when the worker has answered, or the deadline passed.
fn close_in_background(
    channel: &Traced,
    request: pb::CloseSessionRequest,
    limit: Duration,
    lease: Lease,
) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let channel = channel.clone();
    runtime.spawn(async move {
        close_call(&channel, request, limit).await;
        drop(lease);
    });
}

/// Sends CloseSession and waits at most `limit` for the answer (best effort either way).
async fn close_call(channel: &Traced, request: pb::CloseSessionRequest, limit: Duration) {
    let mut client = sessions_client(channel.clone());
    let _ = tokio::time::timeout(limit, client.close_session(request)).await;
}

#[cfg(test)]
mod tests;
