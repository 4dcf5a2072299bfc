//! The workers as the speculative loop sees them: the [`Workers`] trait (open a session on
//! either worker, propose, verify, and the draft-worker's circuit breaker) and the domain
//! values those calls exchange. [`GrpcWorkers`] is the real implementation over gRPC; the
//! loop's unit tests drive it through fakes.

mod adapters;
mod breaker;
mod client;
mod grpc;
pub mod pool;
mod turns;

pub use adapters::AdapterNames;
pub use breaker::{Breaker, BreakerState};
pub use client::{Deadlines, Session, WorkerClient};
pub use grpc::{DRAFT_HEALTH_NAME, GrpcWorkers};
pub use turns::TakeTurns;

use duet_engine::Tokenizer;
use duet_engine::bias::LogitBias;
use duet_engine::logprobs::TokenLogprobs;
use duet_engine::penalties::Penalties;
use duet_engine::sampling::{Distribution, SamplingParams};
use duet_engine::structured::Format;
use futures::Stream;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

/// Which worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Party {
    Target,
    Draft,
}

impl std::fmt::Display for Party {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Target => "target-worker",
            Self::Draft => "draft-worker",
        })
    }
}

/// How a worker call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Failure {
    /// Not reachable, or the connection broke (retrying elsewhere may work).
    #[error("unreachable: {0}")]
    Unreachable(String),
    /// No answer within the call's deadline.
    #[error("{0}")]
    TimedOut(String),
    /// The worker refused for now: its session limit, KV budget or queue is full.
    #[error("busy: {0}")]
    Busy(String),
    /// The worker no longer holds the session (it restarted, or the session expired).
    #[error("session lost: {0}")]
    SessionLost(String),
    /// The worker refused the call as malformed: the coordinator built it wrong.
    #[error("refused the call: {0}")]
    Refused(String),
    /// The worker failed on its side.
    #[error("failed: {0}")]
    Failed(String),
    /// An answer came, but it does not fit the call (wrong length, a token outside the
    /// vocabulary, a malformed distribution).
    #[error("malformed answer: {0}")]
    Malformed(String),
}

/// A worker call that gave no usable answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{party}{}: {failure}", at.as_ref().map(|a| format!(" at {a}")).unwrap_or_default())]
pub struct CallError {
    pub party: Party,
    /// The replica or configured address, when known.
    pub at: Option<String>,
    pub failure: Failure,
}

impl CallError {
    pub fn new(party: Party, failure: Failure) -> Self {
        Self {
            party,
            at: None,
            failure,
        }
    }

    /// Whether the replica that holds the session is gone or stuck (unreachable, no answer
    /// in time, or it no longer has the session): the session can be rebuilt elsewhere.
    pub fn lost_replica(&self) -> bool {
        matches!(
            self.failure,
            Failure::Unreachable(_) | Failure::TimedOut(_) | Failure::SessionLost(_)
        )
    }

    /// Whether the worker itself is in trouble (open the breaker), rather than this one
    /// call being refused for now (busy: just skip it this time).
    pub fn trips_breaker(&self) -> bool {
        !matches!(self.failure, Failure::Busy(_))
    }
}

/// What the coordinator knows about the models, from the target-worker's Describe.
#[derive(Debug, Clone)]
pub struct Models {
    pub tokenizer: Tokenizer,
    pub vocabulary_sha256: String,
    pub vocab: usize,
    /// Tokens one session may hold (the target's context).
    pub context: usize,
    pub target_model: String,
    /// How the target writes tool calls, as its chat template teaches it.
    pub call_format: crate::tools::CallFormat,
    /// The target's chat template writes a thinking model's thoughts (`<think>` …).
    pub writes_thoughts: bool,
    /// What model lists show of the target (Ollama's `/api/tags`): its GGUF architecture
    /// (`qwen2`) and its file's weights, their storage and size, as its worker describes
    /// them.
    pub architecture: String,
    pub file: duet_engine::FileFacts,
    /// The LoRA adapters of the first target replica described: the names a request may
    /// ask for (`GenerateRequest.adapter`); a replica that does not load one gets no
    /// session of its requests (`ModelCheck::adapters`). Listed again where the worker
    /// reads them from a directory.
    pub adapters: AdapterNames,
    /// The kind of device holding the target (`cpu`, `cuda`), empty where its worker does
    /// not say.
    pub device: String,
}

impl Models {
    /// The target's models as `tokenizer` and the worker's description give them, with what
    /// its chat template tells (read once, not per request).
    pub fn new(
        tokenizer: Tokenizer,
        vocabulary_sha256: String,
        (vocab, context): (usize, usize),
        model: String,
    ) -> Self {
        let template = tokenizer.chat_template();
        Self {
            call_format: crate::tools::CallFormat::of_template(template),
            writes_thoughts: template.is_some_and(crate::reasoning::Thought::in_template),
            vocab,
            tokenizer,
            vocabulary_sha256,
            context,
            target_model: model,
            architecture: String::new(),
            file: duet_engine::FileFacts::default(),
            adapters: AdapterNames::default(),
            device: String::new(),
        }
    }

    /// Whether a GPU holds the target; `None` where its worker does not say (one from
    /// before `ModelDescription.device`).
    pub fn on_gpu(&self) -> Option<bool> {
        match self.device.as_str() {
            "" => None,
            device => Some(device != "cpu"),
        }
    }

    /// The model an answer names for a request that named `asked`: the adapter of that
    /// name, else the target.
    pub fn answering<'a>(&'a self, asked: Option<&'a str>) -> &'a str {
        match asked {
            Some(name) if self.adapters.contains(name) => name,
            _ => &self.target_model,
        }
    }
}

/// Opening a session: the prompt (the worker prefills all but its last token).
#[derive(Debug, Clone, Copy)]
pub struct Open<'a> {
    pub prompt: &'a [u32],
    /// Tokens the session may hold at most.
    pub capacity: usize,
    pub sampling: &'a SamplingParams,
    /// What the request holds while the session is open.
    pub lease: &'a Lease,
    /// A session taking over a lost one's sequence (a failover): the request's prompt
    /// length, after which `prompt` holds generated tokens, which the worker feeds as calls
    /// fed them (`OpenSessionRequest.generated_after`). 0: all of `prompt` is prompt.
    pub generated_after: usize,
    /// The target's answers carry each chosen token's figures, with this many most likely
    /// tokens' (`OpenSessionRequest.top_logprobs`); `None`: none.
    pub logprobs: Option<usize>,
    /// The penalties (`OpenSessionRequest.presence_penalty`, `frequency_penalty`,
    /// `repetition_penalty`).
    pub penalties: Penalties,
    /// The target's open answers the figures of each prompt token after the first, with
    /// this many most likely tokens' (`OpenSessionRequest.prompt_logprobs`); `None`: none.
    pub prompt_logprobs: Option<usize>,
    /// The request's logit bias (`OpenSessionRequest.logit_bias`): the target's choices and
    /// the draft's proposals take it.
    pub logit_bias: &'a LogitBias,
    /// No end token before this many completion tokens (`OpenSessionRequest.min_tokens`).
    pub min_tokens: usize,
    /// The structured output (`OpenSessionRequest.structured_output`): the target's choices
    /// and the draft's proposals keep to it.
    pub format: Option<&'a Format>,
    /// The prefix cache's salt (`OpenSessionRequest.cache_salt`; 0: none).
    pub cache_salt: u64,
    /// The request's own end tokens, held back until `min_tokens`
    /// (`OpenSessionRequest.stop_token_ids`; only where `min_tokens` is set).
    pub stop_token_ids: &'a [u32],
    /// Preemption (`OpenSessionRequest.priority`): the request's priority, where its
    /// session may be asked to give its room up; `None`: never.
    pub priority: Option<i32>,
    /// Refused for room, the open asks a session of a higher priority number to give way
    /// (`OpenSessionRequest.ask_for_room`).
    pub ask_for_room: bool,
    /// The LoRA adapter the target session runs with (`OpenSessionRequest.adapter`); `None`:
    /// the model alone. Never a draft session's.
    pub adapter: Option<&'a str>,
}

/// No logit bias, for opens that set none.
static UNBIASED: LogitBias = LogitBias::none();

impl<'a> Open<'a> {
    /// An open of `prompt` that asks for nothing beyond its sampling: no figures, no
    /// penalties, no bias, no `min_tokens`, no structured output, not a takeover.
    pub fn plain(
        prompt: &'a [u32],
        capacity: usize,
        sampling: &'a SamplingParams,
        lease: &'a Lease,
    ) -> Self {
        Self {
            prompt,
            capacity,
            sampling,
            lease,
            generated_after: 0,
            logprobs: None,
            penalties: Penalties::default(),
            prompt_logprobs: None,
            logit_bias: &UNBIASED,
            min_tokens: 0,
            format: None,
            cache_salt: 0,
            stop_token_ids: &[],
            priority: None,
            ask_for_room: false,
            adapter: None,
        }
    }

    /// What a draft session takes of this open: all that changes the target's choices (the
    /// prompt and where its completion starts, the sampling, the penalties, the bias,
    /// `min_tokens`, the structured output, the adapter, which a draft-worker applies where
    /// it has one of that name), so that the draft proposes what the target would choose;
    /// the figures are the target's alone. Verification keeps the output
    /// exact whatever the draft proposes: a draft replica from before a field proposes
    /// without it, which costs acceptance only.
    pub fn for_draft(self) -> Self {
        Self {
            logprobs: None,
            prompt_logprobs: None,
            // The target's KV is what requests wait for.
            priority: None,
            ask_for_room: false,
            ..self
        }
    }
}

/// A target session's open: the session, where the worker's time went, and (where
/// `Open::prompt_logprobs` asked) the figures of each prompt token after the first.
pub type TargetOpened<S> = (S, WorkerTiming, Vec<TokenLogprobs>);

/// What a request holds while any of its sessions is open on a worker: its place among
/// `max_concurrent_requests`. Each session keeps a clone until the worker has answered its
/// close, so the next request in the queue gets the place only once the worker has room for
/// its sessions (a place freed as the generation ends would let the next open arrive
/// before the close, and find the worker's session limit still full).
#[derive(Clone, Default)]
pub struct Lease(Option<Arc<dyn std::any::Any + Send + Sync>>);

impl Lease {
    pub fn new(held: impl std::any::Any + Send + Sync) -> Self {
        Self(Some(Arc::new(held)))
    }
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Lease(held)"
        } else {
            "Lease(none)"
        })
    }
}

/// Where a worker's time went in one call.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct WorkerTiming {
    /// Waiting in the worker's model queue, and (`speculation.take_turns`) for the other
    /// worker's turn to end.
    pub queue: Duration,
    /// In forward passes.
    pub forward: Duration,
    /// The passes were shared: the most calls in one, and the rows of all their calls.
    pub batch_calls: usize,
    pub batch_rows: usize,
    /// This call's part of the passes' time (by its rows).
    pub share: Duration,
    /// Opens only: prompt tokens the worker copied from its prefix cache.
    pub cached: usize,
}

/// One Propose call: cut the draft cache to `keep`, feed `append`, draft `k` tokens (or
/// fewer, at least one, where their joint probability falls below `stop_below` > 0).
#[derive(Debug, Clone, Copy)]
pub struct Propose<'a> {
    pub keep: usize,
    pub append: &'a [u32],
    pub k: usize,
    pub stop_below: f32,
    /// Beside each token, up to `.1` other candidates where they are worth verifying by the
    /// threshold `.0` (`ProposeRequest.alternatives_above`, `max_alternatives`).
    pub alternatives: (f32, usize),
}

/// The draft's answer.
#[derive(Debug, Clone, Default)]
pub struct Proposal {
    pub tokens: Vec<u32>,
    /// The distribution each token was sampled from; empty for greedy sessions.
    pub q: Vec<Distribution>,
    /// Other likely tokens at each position (`Propose::alternatives`): empty, or one list
    /// per token.
    pub alternatives: Vec<Vec<u32>>,
    pub timing: WorkerTiming,
}

/// One Verify call: cut the target cache to `keep`, feed `append`, then check `drafts`.
#[derive(Debug, Clone, Copy)]
pub struct Verify<'a> {
    pub keep: usize,
    pub append: &'a [u32],
    pub drafts: &'a [u32],
    /// Empty: the drafts are a chain; else each draft's parent (`VerifyRequest.parents`).
    pub parents: &'a [u32],
    /// A sampling session's chain, tested on the target (`VerifyRequest.sampling_test`).
    pub test: Option<SamplingTest<'a>>,
}

/// What the target tests a sampling session's chain with: the draft's probability of each
/// draft, whether each q is the point mass on its draft (a lookup's), each q whole where
/// the target is to draw a rejection's correction too (empty: the caller draws it), and
/// where the request's random stream stands.
#[derive(Debug, Clone, Copy)]
pub struct SamplingTest<'a> {
    pub q: &'a [f32],
    pub point_masses: bool,
    pub whole: &'a [Distribution],
    pub rng_position: u64,
}

/// One Decode call: cut the target cache to `keep`, feed `append`, then decode up to
/// `max_tokens` tokens, each fed after it is answered, ending after a `stop` token. A
/// sampling session draws its first token at `rng_position` of its seed's random stream.
#[derive(Debug, Clone, Copy)]
pub struct Decode<'a> {
    pub keep: usize,
    pub append: &'a [u32],
    pub max_tokens: usize,
    pub stop: &'a [u32],
    pub rng_position: u64,
    /// Prompt lookup between the steps (`DecodeRequest.lookup`): none, a token a step.
    pub lookup: Option<&'a StreamLookup>,
}

/// How a Decode stream looks up drafts for its steps (`StreamLookup`): suffixes of
/// `min_match..=max_match` tokens, and `drafts[n - min_match]` drafts for a match of n
/// (the last entry for longer ones; 0: none).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamLookup {
    pub min_match: usize,
    pub max_match: usize,
    pub drafts: Vec<usize>,
}

/// A Decode stream's pass that verified prompt lookup's drafts: the drafts, how long a
/// suffix they followed, the drafts the target accepted, and the tokens the pass answered
/// (the accepted drafts, then the target's own token, unless a stop token among the
/// drafts ended the stream).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LookupPass {
    pub drafts: Vec<u32>,
    pub matched: usize,
    pub accepted: usize,
    pub tokens: Vec<u32>,
}

/// A Decode call's tokens as they come, each as a Verify without drafts answers it (one
/// argmax; a sampling session's token drawn, `TargetChoice::Tested`), or with a lookup, a
/// pass's accepted drafts and token in one answer (`Verified::pass`). It ends after the
/// tokens asked for or a stop token, and may end earlier (the target's turn on a shared
/// device passed): the caller then starts another from where it is. Dropping it ends the
/// call.
pub type Decoded = Pin<Box<dyn Stream<Item = Result<Verified, CallError>> + Send>>;

/// The target's choice after the last appended token and after each draft token.
#[derive(Debug, Clone, PartialEq)]
pub enum TargetChoice {
    /// Greedy sessions.
    Argmax(Vec<u32>),
    /// Sampling sessions: p at each position.
    P(Vec<Distribution>),
    /// Sampling sessions, tested on the target (a chain's Verify with a `SamplingTest`,
    /// or a Decode step): the leading drafts accepted, what follows them, and where the
    /// request's random stream stands after the target's draws.
    Tested {
        accepted: usize,
        next: Next,
        rng_position: u64,
    },
}

/// What follows a tested chain's accepted drafts.
#[derive(Debug, Clone, PartialEq)]
pub enum Next {
    /// The token the target drew.
    Drawn(u32),
    /// The next draft was rejected: p there, for the correction the caller draws with the
    /// draft's q.
    Rejected(Distribution),
}

/// The target's answer.
#[derive(Debug, Clone)]
pub struct Verified {
    pub choice: TargetChoice,
    /// For a request that asks for them, the figures of each token the target chose
    /// (`VerifyResponse.logprobs`): one per argmax, or per accepted draft and drawn token
    /// of a tested chain; else empty.
    pub logprobs: Vec<TokenLogprobs>,
    pub timing: WorkerTiming,
    /// An open of a lower priority number asked the session to give its room up
    /// (`VerifyResponse.give_way`).
    pub give_way: bool,
    /// A Decode stream's pass with lookup drafts: its tokens, which `choice` (the last
    /// one's) and `logprobs` (each one's) come after.
    pub pass: Option<LookupPass>,
}

/// What the speculative loop needs from the two workers. Sessions close when their value
/// drops, so every way out of a request frees them.
pub trait Workers: Send + Sync + 'static {
    type Session: Send + Sync + 'static;

    /// Opens a session on the target-worker: the prompt's prefill.
    fn open_target(
        &self,
        open: Open<'_>,
    ) -> impl Future<Output = Result<TargetOpened<Self::Session>, CallError>> + Send;

    /// Opens a target session again after `lost`'s replica failed: on another replica
    /// when there is one (the lost one last: it may have restarted).
    fn reopen_target(
        &self,
        open: Open<'_>,
        lost: &Self::Session,
    ) -> impl Future<Output = Result<TargetOpened<Self::Session>, CallError>> + Send;

    /// Closes a target session now and waits for its worker's answer (or the close
    /// deadline), so that its KV is free when this returns: a request giving its room up to
    /// one of a lower priority number (`room.rs`). Its drop then sends nothing.
    fn close_target(&self, session: &Self::Session) -> impl Future<Output = ()> + Send;

    /// `Err(why)` when requests should not use the draft-worker now (none configured, or its
    /// circuit breaker is open).
    fn draft_available(&self) -> Result<(), String>;

    /// Opens a session on the draft-worker.
    fn open_draft(
        &self,
        open: Open<'_>,
    ) -> impl Future<Output = Result<(Self::Session, WorkerTiming), CallError>> + Send;

    /// Drafts `call.k` tokens (within the draft's deadline).
    fn propose(
        &self,
        session: &Self::Session,
        call: Propose<'_>,
    ) -> impl Future<Output = Result<Proposal, CallError>> + Send;

    /// Verifies drafts in one target forward pass (none: a plain decoding step).
    fn verify(
        &self,
        session: &Self::Session,
        call: Verify<'_>,
    ) -> impl Future<Output = Result<Verified, CallError>> + Send;

    /// Starts target-only decoding of a greedy session: one streamed call for many tokens,
    /// the target feeding each token it answers (`TargetWorker.Decode`).
    fn decode(
        &self,
        session: &Self::Session,
        call: Decode<'_>,
    ) -> impl Future<Output = Result<Decoded, CallError>> + Send;

    /// The draft-worker failed in a way that says it is in trouble: new requests skip it
    /// until it is healthy again.
    fn trip_draft(&self, reason: &str);

    /// Whether `session`'s target replica verifies trees of drafts (`VerifyRequest.parents`,
    /// as its Describe said): replicas of one model may differ (CPU and GPU).
    fn verifies_trees(&self, session: &Self::Session) -> bool;

    /// Whether `session`'s target replica looks up drafts inside its Decode streams
    /// (`DecodeRequest.lookup`, as its Describe said).
    fn decodes_with_lookup(&self, session: &Self::Session) -> bool;

    /// The workers of `sessions` hold the rows of `tokens` (a request's prompt and text,
    /// which their prefix caches keep once the sessions close): later prompts sharing them
    /// may be sent there.
    /// `salt`: the request's prefix-cache salt.
    fn hold_prefix(&self, _sessions: &[&Self::Session], _tokens: &[u32], _salt: u64) {}
}
