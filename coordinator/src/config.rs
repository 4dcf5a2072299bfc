//! The coordinator's configuration.

use crate::method::Method;
use duet_serving::config::ConfigError;
use duet_serving::telemetry::TelemetryConfig;
use duet_serving::tls::{ClientTls, ServerTls};
use serde::{Deserialize, Serialize};
use tonic::transport::ClientTlsConfig;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CoordinatorConfig {
    /// gRPC listen address of the public Generation service.
    pub listen: String,
    /// Prometheus `/metrics` listen address; empty: no metrics endpoint.
    pub metrics_listen: String,
    /// The OpenAI-compatible HTTP API's listen address (`/v1/completions`,
    /// `/v1/chat/completions`, `/v1/responses`, `/v1/models`, vLLM's tokenizer endpoints,
    /// llama.cpp's `/infill`, `/completion`, `/props` and `/apply-template`, Anthropic's
    /// `/v1/messages`, Ollama's `/api/chat`, `/api/generate` and model listings, TGI's
    /// `/generate`,
    /// `/generate_stream`, `POST /` and `/info`, SageMaker's `/ping` and `/invocations`,
    /// and `/metrics` as on `metrics_listen`); empty: none.
    /// With `tls` set: HTTPS, with the same certificate and client-certificate check as the
    /// gRPC server.
    pub http_listen: String,
    /// TLS of the public server; off by default.
    pub tls: ServerTls,
    /// Bounds on the public gRPC server's connections.
    pub http2: duet_serving::grpc::Http2Limits,
    /// The async runtime's threads, and whether they poll instead of sleeping.
    pub runtime: duet_serving::startup::RuntimeConfig,
    /// A file holding bearer tokens, one per line; set: every Generation call must send
    /// `authorization: Bearer <token>` with one of them (health and reflection stay open
    /// for probes). Each token is a tenant of the proposal cache and of the workers' prefix
    /// caches (`prefix_cache_sharing`).
    pub auth_token_file: String,
    pub target: TargetConfig,
    pub draft: DraftConfig,
    pub speculation: SpeculationConfig,
    pub routing: RoutingConfig,
    /// Whose cached prompt prefixes a request may start from on the workers: `per_token`,
    /// only requests of the same bearer token's (each token a tenant, so that how soon a
    /// first token comes says nothing about another tenant's prompts), or `everyone`. Without
    /// `auth_token_file` all callers are one tenant. A request's `cache_salt` narrows
    /// either further.
    pub prefix_cache_sharing: PrefixSharing,
    /// Completion tokens when a request does not say (capped by the context).
    pub default_max_tokens: u32,
    /// A thinking model's thought (`<think>` … `</think>`, where the target's chat template
    /// writes them: Qwen3, QwQ, DeepSeek-R1 and its distills) comes apart from the answer in
    /// chat completions: gRPC's `reasoning` fields, OpenAI's `reasoning_content`. Off: the
    /// thought stays in the text.
    pub separate_reasoning: bool,
    /// Generations running at once; more wait in the queue (`max_queued`).
    pub max_concurrent_requests: usize,
    /// Places among `max_concurrent_requests` one bearer token's requests may hold at once
    /// (each token a tenant, `auth_token_file`): more of its requests wait in the queue,
    /// within `queue_timeout_ms`, while other tokens' requests go past them, so that one
    /// caller's burst does not take every place. 0: no bound. Without `auth_token_file` all
    /// callers are one tenant, and this is a second `max_concurrent_requests`.
    pub max_concurrent_requests_per_token: usize,
    /// Requests that wait for a place when all `max_concurrent_requests` are taken (in the
    /// order `scheduling_policy` says); one more answers RESOURCE_EXHAUSTED at once. 0: no
    /// queue.
    pub max_queued: usize,
    /// The wait queue's order, as vLLM's `--scheduling-policy`: `fcfs`, first come first
    /// served (a request that sets a `priority` is refused); `priority`, a request's
    /// `priority` first (the lower sooner), then arrival; the wait for KV room on the target
    /// replicas goes in the same order. Any caller may set one: behind a gateway that lets
    /// callers through as they are, keep `fcfs`.
    pub scheduling_policy: SchedulingPolicy,
    /// Under `scheduling_policy = priority`: a request waiting for KV room (every target
    /// replica busy) takes it from a running request with a higher `priority` number (of
    /// this coordinator's, the highest, then the latest to arrive; where it has none, the
    /// target-worker asks one of another coordinator's that preempts too), which closes its
    /// sessions at its next round (at once where it waits on a caller that stopped
    /// reading), waits for room in its own place in line, and goes on
    /// from its committed tokens on a new session (its output unchanged; re-reading its
    /// prompt and text costs a prefill where no prefix cache holds them). false: nothing
    /// running is stopped for a priority, and this coordinator's sessions are never asked.
    pub priority_preemption: bool,
    /// A request waits this long at most, from its arrival, for a place and then for room
    /// for its KV on a target replica (every replica busy); then RESOURCE_EXHAUSTED.
    pub queue_timeout_ms: u64,
    /// What one request may hold, checked before any tokenizing.
    pub limits: LimitsConfig,
    /// On SIGTERM: how long running generations may go on before they end as `cancelled`.
    pub drain_timeout_ms: u64,
    /// Log JSON lines instead of human-readable ones.
    pub log_json: bool,
    /// Traces: OTLP endpoint, sampling, service name.
    pub telemetry: TelemetryConfig,
}

/// Which replica a new session opens on (both workers' replicas).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RoutingConfig {
    /// Open each session on the replica this coordinator sent the longest prefix of its
    /// prompt to (whose prefix cache may hold it: a conversation's earlier turns, a shared
    /// document), unless that replica holds more than `max_imbalance` of this
    /// coordinator's sessions over the least loaded one. Off: the least loaded replica.
    pub prefix_aware: bool,
    /// Sessions over the least loaded replica that prefix routing accepts to meet a cached
    /// prefix.
    pub max_imbalance: usize,
    /// Prefix routing follows a prefix only when it is at least this share of the prompt:
    /// a short shared system prompt alone does not herd every request onto one replica.
    pub min_prefix_share: f64,
}

impl RoutingConfig {
    /// Prefix routing's settings, `None` when it is off.
    pub fn prefix(&self) -> Option<PrefixRouting> {
        self.prefix_aware.then_some(PrefixRouting {
            max_imbalance: self.max_imbalance,
            min_share: self.min_prefix_share,
        })
    }
}

/// Prefix routing's bounds (`routing.*`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefixRouting {
    pub max_imbalance: usize,
    pub min_share: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TargetConfig {
    /// The target-worker, as `http://host:port`, or several, comma-separated. Every address
    /// a host name resolves to is a replica (a Kubernetes headless Service); each session
    /// stays on the replica that opened it.
    pub address: String,
    /// How often the host names are resolved again (replicas come and go).
    pub discovery_interval_ms: u64,
    /// Deadline of connecting to a replica.
    pub connect_timeout_ms: u64,
    /// Deadline of one call (one verification; a session open, with its prefill's
    /// allowance on top: `min_prefill_tokens_per_s`).
    pub timeout_ms: u64,
    /// Once Verify calls have been timed, a Verify's deadline is 8 times the slowest recent
    /// one (a maximum that decays by 1% a call), at least this and at most `timeout_ms`: a
    /// replica that stops answering is given up (and the request fails over) after a few
    /// seconds rather than `timeout_ms`.
    pub verify_timeout_floor_ms: u64,
    /// The slowest prefill the target-worker is taken to be capable of: an open's deadline
    /// is `timeout_ms` plus the time its prompt, and those of this coordinator's opens in
    /// flight on the same replica before it (up to 8,192 of theirs), take at this rate. A
    /// long prompt, or one queued behind others, is not a stuck worker.
    pub min_prefill_tokens_per_s: u64,
    /// Deadline of a control call: health check, Describe, CloseSession.
    pub control_timeout_ms: u64,
    /// How often the coordinator checks the target-worker's health (its own readiness).
    pub health_interval_ms: u64,
    /// When the replica serving a request is lost mid-stream (unreachable, no answer within
    /// `timeout_ms`, or it lost the session), the request reopens its session from the
    /// committed tokens, on another replica when there is one: at most this many times per
    /// request (0: the request fails instead).
    pub max_failovers: u32,
    /// TLS toward the target-worker: used when `address` is `https://`.
    pub tls: ClientTls,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DraftConfig {
    /// The draft-worker, as `http://host:port` (or several, as `target.address`); empty: no
    /// draft-worker (target only).
    pub address: String,
    /// How often the host names are resolved again.
    pub discovery_interval_ms: u64,
    /// Deadline of connecting to a replica: short, because a request waits for it before
    /// it falls back to target-only steps.
    pub connect_timeout_ms: u64,
    /// Deadline of one whole Propose stream. Past it the request goes on target-only and the
    /// circuit breaker opens.
    pub timeout_ms: u64,
    /// Deadline of opening a session (the draft's prompt prefill), with the prefill's
    /// allowance on top (`min_prefill_tokens_per_s`).
    pub open_timeout_ms: u64,
    /// As `target.min_prefill_tokens_per_s`, for the draft-worker's opens.
    pub min_prefill_tokens_per_s: u64,
    /// Deadline of a control call: health check, Describe, CloseSession.
    pub control_timeout_ms: u64,
    /// While the breaker is open, the draft-worker's health is checked this often; it
    /// closes when the draft-worker reports SERVING again.
    pub health_interval_ms: u64,
    /// TLS toward the draft-worker: used when `address` is `https://`.
    pub tls: ClientTls,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SpeculationConfig {
    /// What AUTO means: `adaptive` (the controller chooses the proposer and K round by
    /// round), or always one method: `draft_model`, `ngram`, `none`.
    pub auto_method: Method,
    /// Draft tokens per round for DRAFT_MODEL and NGRAM when a request leaves it to the
    /// server and `adaptive.choose_k` is off; with it on, only until the costs are measured
    /// (the first target pass).
    pub num_speculative_tokens: u32,
    /// The most a request may ask for; also AUTO's limit when a request sets none.
    pub max_speculative_tokens: u32,
    /// Prefill the prompt on both workers at once. Right when they run on separate machines
    /// (it hides the draft's prefill); wrong when they share CPU cores, where two prefills
    /// at once thrash each other: then the draft prefills after the target.
    pub concurrent_prefill: bool,
    /// While the target verifies a round, the draft model drafts the next one as if the
    /// round's drafts were all accepted. Right when the workers run on separate devices
    /// (the draft would otherwise idle during Verify); wrong when they share CPU cores,
    /// where the two passes slow each other.
    pub overlap_drafting: bool,
    /// The draft's and the target's calls (prefills, Propose, Verify) never run at once;
    /// calls to the same worker still do. Right when the workers share a device (CPU cores,
    /// one GPU), where a pass of one beside a pass of the other slows both several times
    /// over; wrong on separate devices, where it idles one while the other works. Excludes
    /// `concurrent_prefill` and `overlap_drafting`, which run the two side by side.
    pub take_turns: bool,
    /// With `take_turns`, the longest a call waits for its turn. Past it, the other worker's
    /// calls holding the turn have overrun (a long prefill, or a worker that stopped
    /// answering), and calls go ahead beside them until they end.
    pub turn_wait_ms: u64,
    /// Target-only steps come from one streamed Decode call instead of a Verify call each:
    /// the target-worker runs each step as soon as the one before answers, and the
    /// coordinator's work on a token overlaps the next pass. On a GPU, where a one-row pass
    /// is about as long as a round trip through the coordinator, that is most of the time
    /// between tokens. NONE requests stream all their tokens; AUTO streams its target-only
    /// steps in a batch, and alone once their run is long enough to pay for the step left
    /// in flight when a proposal ends it. A sampling request's streamed tokens are drawn on
    /// the target-worker where the coordinator would draw them: a seed gives the same text
    /// either way. Off: a Verify call a token (for target-workers from before Decode).
    pub target_streams: bool,
    /// AUTO's and NGRAM's Decode streams look up drafts themselves: before each step the
    /// target-worker looks up the request's longest suffix in its text so far
    /// (`speculation.ngram.min_match..max_match` tokens) and verifies what followed as
    /// drafts in the step's pass (`DecodeRequest.lookup`), and the stream goes on. AUTO's
    /// drafts: as many as the controller finds pay for a match of that length as rows of a
    /// streamed step, weighed when the stream starts (a stream that started looking up
    /// nothing, before the costs were known, is weighed again every 16 tokens and restarts
    /// once some K pays). NGRAM's: as many as its rounds would offer; such a request then
    /// runs as one stream from its first token. A prompt-lookup round in the request's own
    /// text then ends no stream and costs no round trip; the proposal cache's and a
    /// predicted output's proposals still come as rounds. Off, or against target-workers
    /// from before it: lookup rounds end the stream, as draft-model rounds do. Off by
    /// default until measured on a GPU, where a round trip costs about a one-row pass; on
    /// a CPU, batches of streams gain nothing by it (docs/benchmarks.md, "Prompt lookup
    /// inside the target's streams").
    pub stream_lookup: bool,
    pub ngram: NgramConfig,
    pub proposal_cache: ProposalCacheConfig,
    pub adaptive: AdaptiveConfig,
}

/// Prompt lookup (NGRAM, and AUTO's lookup).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NgramConfig {
    /// The shortest suffix prompt lookup looks up (suffixes of `min_match..=max_match`
    /// tokens, the longest first).
    pub min_match: usize,
    /// The longest suffix prompt lookup looks up (at most 32).
    pub max_match: usize,
}

/// The proposal cache (`proposals.rs`): prompt lookup (NGRAM, and AUTO's) also proposes
/// what followed the same tokens in earlier requests.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ProposalCacheConfig {
    /// Whose earlier requests a request's proposals may come from: `per_token` (those sent
    /// with the same bearer token; none without `auth_token_file`), `everyone` (all of
    /// this coordinator's: one caller's text may then be proposed to another, though only
    /// what the target itself would write is ever output), or `off`.
    pub sharing: Sharing,
    /// Runs of tokens the cache holds at most (about 200 bytes each; past it the least
    /// recently used go).
    pub max_entries: usize,
}

/// Whose text the proposal cache shares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Sharing {
    PerToken,
    Everyone,
    Off,
}

/// The wait queue's order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum SchedulingPolicy {
    Fcfs,
    Priority,
}

/// Whose cached prompt prefixes a request may start from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum PrefixSharing {
    PerToken,
    Everyone,
}

/// AUTO's controller, and K for the methods a request names without one.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AdaptiveConfig {
    /// The most draft tokens per round the controller takes from the draft model (AUTO's,
    /// and a named method's with `choose_k`).
    pub max_draft_model_tokens: u32,
    /// The most draft tokens per round the controller takes from prompt lookup.
    pub max_ngram_tokens: u32,
    /// A DRAFT_MODEL or NGRAM request that sets no `num_speculative_tokens` gets the
    /// controller's K for its method, round by round: at least 1, at most the limit above
    /// (its proposer drafts every round it can, as many tokens as pay). Off: exactly
    /// `num_speculative_tokens`.
    pub choose_k: bool,
    /// The draft model stops a round's drafting early where its own confidence in its
    /// drafts runs low (what one more token is worth, by the controller's costs).
    pub stop_early: bool,
    /// Where the target-worker verifies trees of drafts (on a CPU, and on a GPU through the
    /// CUDA step; its Describe says): at each position of
    /// the draft model's chain, up to this many other candidates are verified beside it in
    /// the same pass, each after the chain's tokens before it (greedy requests: the draft's
    /// next most likely tokens; sampling requests: more draws from its distribution there,
    /// tried in turn by multi-candidate rejection sampling); where the target takes one of
    /// them instead of the chain's token, the round commits it and the target's token after
    /// it. At most 7. 0 (the default): chains only; on the reference CPU trees of two
    /// alternatives read 0.88-1.12x of chains at one stream run to run, no gain
    /// (docs/benchmarks.md, "Trees of drafts").
    pub tree_alternatives: u32,
    /// An alternative is verified where its probability (sampling: the chance of another
    /// token than the chain's), times that of the draft's tokens before it in the round, is
    /// at least this, by the draft's own reckoning. 0: the controller's threshold, what one
    /// more verified row costs in committed tokens by the measured pass times, so that trees
    /// grow where rows are cheap and the draft unsure.
    pub tree_alternatives_above: f32,
}

/// Bounds on one request, and on a client that stops reading its stream.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LimitsConfig {
    /// Bytes of `prompt`, or of all messages' contents together.
    pub max_input_bytes: usize,
    /// Chat messages per request (at most 4096, the API's own bound).
    pub max_messages: usize,
    /// Bytes of one stop string.
    pub max_stop_bytes: usize,
    /// A stream whose client has not taken a message for this long ends (its sessions and
    /// its place among `max_concurrent_requests` are freed).
    pub stream_stall_timeout_ms: u64,
    /// A request ends (`DEADLINE_EXCEEDED`, after what it sent) this long after it arrived,
    /// queueing included, however it is read: its place and KV are freed.
    pub request_timeout_ms: u64,
}

impl LimitsConfig {
    /// The largest request message these limits allow (the public server refuses larger
    /// ones before decoding them): the input, the stop strings, and room for the framing
    /// of every field and message.
    pub fn max_request_bytes(&self) -> usize {
        self.max_input_bytes
            + duet_proto::MAX_STOP_STRINGS * (self.max_stop_bytes + 8)
            + self.max_messages * 32
            + 4096
    }

    /// The most JSON values an OpenAI-API request may hold (the HTTP API refuses more before
    /// parsing): a generous 16 a message (its fields, its content parts), and 1024 for the
    /// rest of the request (stop strings, and fields duet ignores, such as tool schemas).
    pub fn max_json_values(&self) -> usize {
        16 * self.max_messages + 1024
    }
}

impl Default for CoordinatorConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:50061".into(),
            metrics_listen: "127.0.0.1:50071".into(),
            http_listen: "127.0.0.1:50081".into(),
            tls: ServerTls::default(),
            http2: Default::default(),
            runtime: Default::default(),
            auth_token_file: String::new(),
            target: TargetConfig {
                address: "http://127.0.0.1:50063".into(),
                discovery_interval_ms: 5_000,
                connect_timeout_ms: 1_000,
                timeout_ms: 60_000,
                verify_timeout_floor_ms: 5_000,
                min_prefill_tokens_per_s: 20,
                control_timeout_ms: 2_000,
                health_interval_ms: 1_000,
                max_failovers: 2,
                tls: ClientTls::default(),
            },
            draft: DraftConfig {
                address: "http://127.0.0.1:50062".into(),
                discovery_interval_ms: 5_000,
                connect_timeout_ms: 500,
                timeout_ms: 2_000,
                open_timeout_ms: 30_000,
                min_prefill_tokens_per_s: 20,
                control_timeout_ms: 2_000,
                health_interval_ms: 1_000,
                tls: ClientTls::default(),
            },
            speculation: SpeculationConfig {
                auto_method: Method::Auto,
                num_speculative_tokens: 4,
                max_speculative_tokens: 16,
                concurrent_prefill: false,
                overlap_drafting: false,
                take_turns: true,
                turn_wait_ms: 2_000,
                target_streams: true,
                stream_lookup: false,
                ngram: NgramConfig {
                    min_match: 2,
                    max_match: 8,
                },
                proposal_cache: ProposalCacheConfig {
                    sharing: Sharing::PerToken,
                    max_entries: 200_000,
                },
                adaptive: AdaptiveConfig {
                    max_draft_model_tokens: 8,
                    max_ngram_tokens: 16,
                    choose_k: true,
                    stop_early: true,
                    tree_alternatives: 0,
                    tree_alternatives_above: 0.0,
                },
            },
            routing: RoutingConfig {
                prefix_aware: true,
                max_imbalance: 4,
                min_prefix_share: 0.5,
            },
            prefix_cache_sharing: PrefixSharing::PerToken,
            default_max_tokens: 256,
            separate_reasoning: true,
            max_concurrent_requests: 64,
            max_concurrent_requests_per_token: 0,
            max_queued: 64,
            scheduling_policy: SchedulingPolicy::Fcfs,
            priority_preemption: true,
            queue_timeout_ms: 30_000,
            limits: LimitsConfig {
                max_input_bytes: 1 << 20,
                max_messages: 1024,
                max_stop_bytes: 256,
                stream_stall_timeout_ms: 30_000,
                request_timeout_ms: 900_000,
            },
            drain_timeout_ms: 30_000,
            log_json: false,
            telemetry: TelemetryConfig::default(),
        }
    }
}

/// One or more comma-separated `http://host:port` (plaintext) or `https://host:port` (TLS)
/// URLs, all of one scheme, each with an explicit port.
fn check_url(key: &str, value: &str) -> Result<(), ConfigError> {
    let https = value.trim_start().starts_with("https://");
    let scheme = if https { "https://" } else { "http://" };
    for url in value.split(',').map(str::trim) {
        let ok = url.starts_with(scheme)
            && url
                .parse::<tonic::transport::Uri>()
                .is_ok_and(|u| u.host().is_some() && u.port().is_some());
        if !ok {
            return Err(ConfigError::invalid(
                key,
                format!(
                    "`{url}` is not a URL such as http://127.0.0.1:50063 (comma-separated for several, all http:// or all https://)"
                ),
            ));
        }
    }
    Ok(())
}

/// The client TLS toward a worker at `address` (settings under `prefix`): `None` when its
/// URLs are plaintext.
pub fn worker_tls(
    prefix: &str,
    address: &str,
    tls: &ClientTls,
) -> Result<Option<ClientTlsConfig>, ConfigError> {
    let Some(rest) = address.trim().strip_prefix("https://") else {
        if tls.is_set() {
            return Err(ConfigError::invalid(
                prefix,
                "TLS settings for a worker whose address is http:// (use https://)",
            ));
        }
        return Ok(None);
    };
    let authority = rest.split([',', '/']).next().unwrap_or_default().trim();
    let host = authority
        .rsplit_once(':')
        .map_or(authority, |(host, _)| host)
        .trim_matches(['[', ']']);
    tls.load(prefix, host).map(Some)
}

impl CoordinatorConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.telemetry.validate()?;
        self.http2.validate()?;
        self.runtime.validate()?;
        self.tls.check("tls")?;
        if !self.auth_token_file.is_empty() {
            crate::auth::read_tokens(&self.auth_token_file)?;
        }
        worker_tls("target.tls", &self.target.address, &self.target.tls)?;
        worker_tls("draft.tls", &self.draft.address, &self.draft.tls)?;
        duet_serving::config::check_listen("listen", &self.listen, false)?;
        duet_serving::config::check_listen("metrics_listen", &self.metrics_listen, true)?;
        duet_serving::config::check_listen("http_listen", &self.http_listen, true)?;
        if self.limits.max_messages > duet_proto::MAX_CHAT_MESSAGES {
            return Err(ConfigError::invalid(
                "limits.max_messages",
                format!(
                    "at most {} (the API's own bound)",
                    duet_proto::MAX_CHAT_MESSAGES
                ),
            ));
        }
        if !(0.0..=1.0).contains(&self.routing.min_prefix_share) {
            return Err(ConfigError::invalid(
                "routing.min_prefix_share",
                "a share of the prompt, from 0 to 1",
            ));
        }
        check_url("target.address", &self.target.address)?;
        if !self.draft.address.is_empty() {
            check_url("draft.address", &self.draft.address)?;
        }
        self.check_positive()?;
        self.speculation.validate()
    }

    /// Durations, rates and limits that 0 would make meaningless.
    fn check_positive(&self) -> Result<(), ConfigError> {
        for (key, value) in [
            ("target.connect_timeout_ms", self.target.connect_timeout_ms),
            ("target.timeout_ms", self.target.timeout_ms),
            (
                "target.verify_timeout_floor_ms",
                self.target.verify_timeout_floor_ms,
            ),
            (
                "target.min_prefill_tokens_per_s",
                self.target.min_prefill_tokens_per_s,
            ),
            (
                "draft.min_prefill_tokens_per_s",
                self.draft.min_prefill_tokens_per_s,
            ),
            ("target.control_timeout_ms", self.target.control_timeout_ms),
            ("draft.control_timeout_ms", self.draft.control_timeout_ms),
            ("target.health_interval_ms", self.target.health_interval_ms),
            (
                "target.discovery_interval_ms",
                self.target.discovery_interval_ms,
            ),
            (
                "draft.discovery_interval_ms",
                self.draft.discovery_interval_ms,
            ),
            ("draft.connect_timeout_ms", self.draft.connect_timeout_ms),
            ("draft.timeout_ms", self.draft.timeout_ms),
            ("draft.open_timeout_ms", self.draft.open_timeout_ms),
            ("draft.health_interval_ms", self.draft.health_interval_ms),
            ("default_max_tokens", u64::from(self.default_max_tokens)),
            (
                "max_concurrent_requests",
                self.max_concurrent_requests as u64,
            ),
            ("queue_timeout_ms", self.queue_timeout_ms),
            ("speculation.turn_wait_ms", self.speculation.turn_wait_ms),
            (
                "speculation.max_speculative_tokens",
                u64::from(self.speculation.max_speculative_tokens),
            ),
            ("limits.max_input_bytes", self.limits.max_input_bytes as u64),
            ("limits.max_messages", self.limits.max_messages as u64),
            ("limits.max_stop_bytes", self.limits.max_stop_bytes as u64),
            (
                "limits.stream_stall_timeout_ms",
                self.limits.stream_stall_timeout_ms,
            ),
            ("limits.request_timeout_ms", self.limits.request_timeout_ms),
        ] {
            if value == 0 {
                return Err(ConfigError::invalid(key, "must be at least 1"));
            }
        }
        Ok(())
    }
}

impl SpeculationConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        let s = self;
        for (key, on) in [
            ("speculation.concurrent_prefill", s.concurrent_prefill),
            ("speculation.overlap_drafting", s.overlap_drafting),
        ] {
            if on && s.take_turns {
                return Err(ConfigError::invalid(
                    key,
                    "runs the two workers side by side (separate devices), while \
                     speculation.take_turns makes them take turns (a shared device): set \
                     take_turns = false with it",
                ));
            }
        }
        if s.proposal_cache.max_entries == 0 {
            return Err(ConfigError::invalid(
                "speculation.proposal_cache.max_entries",
                "must be at least 1 (sharing = \"off\" turns the cache off)",
            ));
        }
        let n = &s.ngram;
        if n.min_match == 0 || n.min_match > n.max_match || n.max_match > 32 {
            return Err(ConfigError::invalid(
                "speculation.ngram.min_match",
                format!(
                    "{}..={} (max_match) must be a range within 1..=32",
                    n.min_match, n.max_match
                ),
            ));
        }
        s.validate_adaptive()?;
        if s.num_speculative_tokens == 0 || s.num_speculative_tokens > s.max_speculative_tokens {
            return Err(ConfigError::invalid(
                "speculation.num_speculative_tokens",
                format!(
                    "{} must be in 1..={} (speculation.max_speculative_tokens)",
                    s.num_speculative_tokens, s.max_speculative_tokens
                ),
            ));
        }
        let limit = duet_proto::MAX_DRAFT_TOKENS;
        if s.max_speculative_tokens as usize > limit {
            return Err(ConfigError::invalid(
                "speculation.max_speculative_tokens",
                format!("at most {limit} (the workers' limit)"),
            ));
        }
        Ok(())
    }

    /// AUTO's bounds (`speculation.adaptive`): each method's most K within the most any
    /// request may ask, and trees within what a Verify carries.
    fn validate_adaptive(&self) -> Result<(), ConfigError> {
        let s = self;
        for (key, value) in [
            (
                "speculation.adaptive.max_draft_model_tokens",
                s.adaptive.max_draft_model_tokens,
            ),
            (
                "speculation.adaptive.max_ngram_tokens",
                s.adaptive.max_ngram_tokens,
            ),
        ] {
            if value > s.max_speculative_tokens {
                return Err(ConfigError::invalid(
                    key,
                    format!(
                        "{value} exceeds speculation.max_speculative_tokens ({})",
                        s.max_speculative_tokens
                    ),
                ));
            }
            if value == 0 && s.adaptive.choose_k {
                return Err(ConfigError::invalid(
                    key,
                    "0 leaves that method no K to choose from (speculation.adaptive.choose_k): \
                     at least 1",
                ));
            }
        }
        let most = duet_proto::MAX_ALTERNATIVES;
        if s.adaptive.tree_alternatives as usize > most {
            let why = format!("{} is more than {most}", s.adaptive.tree_alternatives);
            return Err(ConfigError::invalid(
                "speculation.adaptive.tree_alternatives",
                why,
            ));
        }
        let above = s.adaptive.tree_alternatives_above;
        if !(0.0..=1.0).contains(&above) {
            return Err(ConfigError::invalid(
                "speculation.adaptive.tree_alternatives_above",
                format!("{above} is not in 0..=1"),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
