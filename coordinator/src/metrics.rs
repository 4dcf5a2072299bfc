//! The coordinator's Prometheus metrics, named after vLLM's where vLLM has one
//! (`vllm:spec_decode_num_draft_tokens` → `duet_spec_decode_num_draft_tokens_total`).

use crate::workers::BreakerState;
use duet_serving::busy_poll::{BUSY_POLLING, BusyPoll};
use duet_serving::metrics::{Mirrored, encode, latency_buckets};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::Mutex;
use std::sync::atomic::AtomicU64;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// `length`, `stop`, `eos`, `cancelled`; empty when the call failed.
    pub finish_reason: String,
    /// The gRPC code the call ended with (`OK` for a finished generation).
    pub code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PositionLabel {
    pub position: u32,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HttpLabels {
    /// The route as the API serves it (`/v1/chat/completions`), or `unmatched`.
    pub route: String,
    /// The HTTP status answered (a stream's, once its head is sent).
    pub status: String,
}

/// vLLM's `lora_requests_info` labels, which the Gateway API Inference Extension reads:
/// adapter names comma-separated.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LoraLabels {
    pub max_lora: String,
    pub running_lora_adapters: String,
    pub waiting_lora_adapters: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MethodLabel {
    /// Who proposed: `draft_model`, `ngram`, or `none` (a target-only step).
    pub method: &'static str,
}

#[derive(Debug)]
pub struct CoordinatorMetrics {
    registry: Registry,
    pub requests: Family<RequestLabels, Counter>,
    pub http_requests: Family<HttpLabels, Counter>,
    pub drafts: Counter,
    pub draft_tokens: Counter,
    pub accepted_tokens: Counter,
    pub accepted_per_position: Family<PositionLabel, Counter>,
    pub rounds_by_method: Family<MethodLabel, Counter>,
    pub draft_tokens_by_method: Family<MethodLabel, Counter>,
    pub accepted_tokens_by_method: Family<MethodLabel, Counter>,
    pub fallbacks: Counter,
    pub prompt_tokens: Counter,
    pub prompt_tokens_cached: Counter,
    pub generation_tokens: Counter,
    pub time_to_first_token: Histogram,
    pub inter_token_latency: Histogram,
    pub e2e_latency: Histogram,
    pub running: Gauge,
    /// Requests waiting for a place among `max_concurrent_requests`.
    pub waiting: Gauge,
    /// Requests holding a place that wait for KV room on the target (`room`).
    pub waiting_for_kv: Gauge,
    /// Arrival to a place (0 for a request admitted at once), or to its refusal.
    pub queue_time: Histogram,
    pub stalled_streams: Counter,
    pub target_failovers: Counter,
    /// Target sessions given up for a request of a lower priority number waiting for room.
    pub preemptions: Counter,
    pub drafted_ahead: Counter,
    pub drafted_ahead_used: Counter,
    pub drafted_ahead_dropped: Counter,
    /// Target-only tokens that came from a Decode stream (`speculation.target_streams`).
    pub target_streamed_tokens: Counter,
    /// Decode stream steps that verified prompt lookup's drafts (`speculation.stream_lookup`).
    pub stream_lookup_passes: Counter,
    /// Other candidates verified beside the draft model's chain (trees), and those the
    /// target chose.
    pub tree_alternatives: Counter,
    pub tree_alternatives_accepted: Counter,
    /// Rounds whose prompt lookup found its proposal in the proposal cache.
    pub proposal_cache_hits: Counter,
    /// Runs of tokens the proposal cache holds.
    pub proposal_cache_entries: Gauge,
    /// 1 while a target-worker replica answered SERVING at the last check.
    pub target_serving: Gauge,
    /// The target replicas' KV-cache budget their open sessions reserve (0 to 1).
    pub kv_cache_usage: Gauge<f64, AtomicU64>,
    /// The adapters the target serves, in vLLM's shape (one series, its time as value).
    lora_requests_info: Family<LoraLabels, Gauge<f64, AtomicU64>>,
    /// The labels of its series now: a new list replaces it.
    lora_shown: Mutex<Option<LoraLabels>>,
    /// `max_concurrent_requests`: running generations past it are refused.
    max_concurrent_requests: Gauge,
    draft_breaker_open: Gauge,
    draft_breaker_trips: Mirrored,
    busy_polling: Gauge,
}

impl Default for CoordinatorMetrics {
    fn default() -> Self {
        let mut r = Registry::with_prefix("duet");
        let draft_breaker_trips = Mirrored::register(
            &mut r,
            "draft_breaker_trips",
            "Times the draft-worker's circuit breaker opened after a failure",
        );
        let m = Self {
            requests: Family::default(),
            http_requests: Family::default(),
            drafts: Counter::default(),
            draft_tokens: Counter::default(),
            accepted_tokens: Counter::default(),
            accepted_per_position: Family::default(),
            rounds_by_method: Family::default(),
            draft_tokens_by_method: Family::default(),
            accepted_tokens_by_method: Family::default(),
            fallbacks: Counter::default(),
            prompt_tokens: Counter::default(),
            prompt_tokens_cached: Counter::default(),
            generation_tokens: Counter::default(),
            time_to_first_token: Histogram::new(latency_buckets()),
            inter_token_latency: Histogram::new(latency_buckets()),
            e2e_latency: Histogram::new(latency_buckets()),
            running: Gauge::default(),
            waiting: Gauge::default(),
            waiting_for_kv: Gauge::default(),
            queue_time: Histogram::new(latency_buckets()),
            stalled_streams: Counter::default(),
            target_failovers: Counter::default(),
            preemptions: Counter::default(),
            drafted_ahead: Counter::default(),
            drafted_ahead_used: Counter::default(),
            drafted_ahead_dropped: Counter::default(),
            target_streamed_tokens: Counter::default(),
            stream_lookup_passes: Counter::default(),
            tree_alternatives: Counter::default(),
            tree_alternatives_accepted: Counter::default(),
            proposal_cache_hits: Counter::default(),
            proposal_cache_entries: Gauge::default(),
            target_serving: Gauge::default(),
            kv_cache_usage: Gauge::default(),
            lora_requests_info: Family::default(),
            lora_shown: Mutex::default(),
            max_concurrent_requests: Gauge::default(),
            draft_breaker_open: Gauge::default(),
            draft_breaker_trips,
            busy_polling: Gauge::default(),
            registry: Registry::default(),
        };
        m.register_requests(&mut r);
        m.register_speculation(&mut r);
        m.register_drafting_ahead(&mut r);
        m.register_state(&mut r);
        // The export counters of the subscriber this service runs under.
        duet_serving::telemetry::ExportStats::current().register(&mut r);
        Self { registry: r, ..m }
    }
}

impl CoordinatorMetrics {
    /// The metrics of a coordinator that runs at most `limit` generations at once.
    pub fn with_request_limit(limit: usize) -> Self {
        let m = Self::default();
        m.max_concurrent_requests.set(limit as i64);
        m
    }

    /// Requests: outcomes, tokens, latencies, what runs now, failures on the way.
    fn register_requests(&self, r: &mut Registry) {
        r.register(
            "requests",
            "Generate/Complete calls by finish reason and gRPC code",
            self.requests.clone(),
        );
        r.register(
            "http_requests",
            "HTTP API calls by route and status (generations, tokenizer calls, probes)",
            self.http_requests.clone(),
        );
        r.register(
            "stalled_streams",
            "Generations ended because their caller took no stream message for limits.stream_stall_timeout_ms",
            self.stalled_streams.clone(),
        );
        r.register(
            "target_failovers",
            "Target sessions rebuilt from the committed tokens after their replica was lost mid-stream",
            self.target_failovers.clone(),
        );
        r.register(
            "preemptions",
            "Target sessions a running request gave up, keeping its tokens, for a request of a lower priority number waiting for KV room (priority_preemption)",
            self.preemptions.clone(),
        );
        r.register(
            "prompt_tokens",
            "Prompt tokens of finished requests",
            self.prompt_tokens.clone(),
        );
        r.register(
            "prompt_tokens_cached",
            "Of the prompt tokens of finished requests, those the target-worker copied from its prefix cache",
            self.prompt_tokens_cached.clone(),
        );
        r.register(
            "generation_tokens",
            "Completion tokens of finished requests",
            self.generation_tokens.clone(),
        );
        r.register(
            "time_to_first_token_seconds",
            "Request arrival to the first committed token",
            self.time_to_first_token.clone(),
        );
        r.register(
            "inter_token_latency_seconds",
            "Time per completion token after the first: a round's time over the tokens it committed",
            self.inter_token_latency.clone(),
        );
        r.register(
            "e2e_request_latency_seconds",
            "Request arrival to the final message",
            self.e2e_latency.clone(),
        );
        r.register(
            "num_requests_waiting",
            "Requests waiting for a place among max_concurrent_requests (the wait queue)",
            self.waiting.clone(),
        );
        r.register(
            "num_requests_waiting_for_kv",
            "Requests holding a place that wait for a target replica to have room for their KV (every replica answered busy)",
            self.waiting_for_kv.clone(),
        );
        r.register(
            "request_queue_time_seconds",
            "Time a request waited for a place among max_concurrent_requests (0: none), refused ones included",
            self.queue_time.clone(),
        );
        r.register(
            "num_requests_running",
            "Generations running now",
            self.running.clone(),
        );
    }

    /// Speculation: rounds, drafts and acceptance, overall (vLLM's names) and by proposer.
    fn register_speculation(&self, r: &mut Registry) {
        r.register(
            "spec_decode_num_drafts",
            "Speculation rounds (draft proposals verified)",
            self.drafts.clone(),
        );
        r.register(
            "spec_decode_num_draft_tokens",
            "Draft tokens proposed",
            self.draft_tokens.clone(),
        );
        r.register(
            "spec_decode_num_accepted_tokens",
            "Draft tokens accepted by the target",
            self.accepted_tokens.clone(),
        );
        r.register(
            "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the round (0 = first draft token)",
            self.accepted_per_position.clone(),
        );
        r.register(
            "speculation_rounds",
            "Rounds (target passes) by the proposer that drafted them: draft_model, ngram, none",
            self.rounds_by_method.clone(),
        );
        r.register(
            "speculation_draft_tokens",
            "Draft tokens proposed, by proposer",
            self.draft_tokens_by_method.clone(),
        );
        r.register(
            "speculation_accepted_tokens",
            "Draft tokens accepted, by proposer",
            self.accepted_tokens_by_method.clone(),
        );
        r.register(
            "spec_decode_fallbacks",
            "Requests that fell back to target-only (draft-worker skipped or failed)",
            self.fallbacks.clone(),
        );
    }

    /// Drafting ahead beside Verify (`speculation.overlap_drafting`).
    fn register_drafting_ahead(&self, r: &mut Registry) {
        r.register(
            "drafted_ahead",
            "Propose calls run while the target verified (speculation.overlap_drafting)",
            self.drafted_ahead.clone(),
        );
        r.register(
            "drafted_ahead_used",
            "Rounds whose drafts were made ahead, while the target verified the round before",
            self.drafted_ahead_used.clone(),
        );
        r.register(
            "drafted_ahead_dropped",
            "Propose calls run while the target verified, stopped as soon as the Verify rejected a draft (greedy requests: their drafts could no longer be used)",
            self.drafted_ahead_dropped.clone(),
        );
        r.register(
            "target_streamed_tokens",
            "Target-only tokens that came from a Decode stream (speculation.target_streams) instead of a Verify call each: far fewer than the target-only rounds (speculation_rounds, method none) where target-workers refuse streams (older than the coordinator); a stream's steps that verified lookup drafts count in stream_lookup_passes",
            self.target_streamed_tokens.clone(),
        );
        r.register(
            "stream_lookup_passes",
            "Decode stream steps that verified prompt lookup's drafts (speculation.stream_lookup): lookup rounds without a round trip, counted with the others in speculation_rounds and the draft-token counters under method ngram",
            self.stream_lookup_passes.clone(),
        );
        r.register(
            "tree_alternatives",
            "Other candidates verified beside the draft model's chain in the same target pass (trees of drafts)",
            self.tree_alternatives.clone(),
        );
        r.register(
            "tree_alternatives_accepted",
            "Verified alternatives the target chose where it rejected the chain's token: each committed one more token than the chain would have",
            self.tree_alternatives_accepted.clone(),
        );
        r.register(
            "proposal_cache_hits",
            "Rounds whose prompt lookup found its proposal in the proposal cache (what followed the same tokens in earlier requests)",
            self.proposal_cache_hits.clone(),
        );
        r.register(
            "proposal_cache_entries",
            "Runs of tokens the proposal cache holds (speculation.proposal_cache.max_entries at most)",
            self.proposal_cache_entries.clone(),
        );
    }

    /// What an SRE alerts on: the limit, the target's readiness, the draft's breaker.
    fn register_state(&self, r: &mut Registry) {
        r.register(
            "max_concurrent_requests",
            "Generations that may run at once (max_concurrent_requests); more wait in the queue (max_queued)",
            self.max_concurrent_requests.clone(),
        );
        r.register(
            "target_serving",
            "1 while a target-worker replica answered SERVING at the coordinator's last check (its readiness)",
            self.target_serving.clone(),
        );
        r.register(
            "kv_cache_usage_perc",
            "Fraction (0 to 1) of the target replicas' KV-cache budget (kv_token_budget) reserved by their open sessions, all coordinators' sessions counted, summed over the replicas that answered the last check (every target.health_interval_ms); vLLM's kv_cache_usage_perc",
            self.kv_cache_usage.clone(),
        );
        r.register(
            "lora_requests_info",
            "The LoRA adapters the target-worker serves (running_lora_adapters, comma-separated; max_lora: how many; waiting_lora_adapters: always empty), as vLLM's lora_requests_info; the value is when it was read (Unix seconds)",
            self.lora_requests_info.clone(),
        );
        r.register(
            "draft_breaker_open",
            "1 while requests skip the draft-worker (its circuit breaker is open or half-open)",
            self.draft_breaker_open.clone(),
        );
        r.register(
            "busy_polling_threads",
            BUSY_POLLING,
            self.busy_polling.clone(),
        );
    }

    pub fn render(&self) -> String {
        encode(&self.registry)
    }

    /// How many async threads poll now (`runtime.busy_poll_ms`; none without it).
    pub fn observe_busy_polling(&self, busy: Option<&BusyPoll>) {
        self.busy_polling
            .set(busy.map_or(0, BusyPoll::polling) as i64);
    }

    /// Shows `adapters` (none before the target is known) as the one series of
    /// `lora_requests_info`, read now.
    pub fn observe_adapters(&self, adapters: &[String]) {
        let labels = LoraLabels {
            max_lora: adapters.len().to_string(),
            running_lora_adapters: adapters.join(","),
            waiting_lora_adapters: String::new(),
        };
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
        let mut shown = self.lora_shown.lock().unwrap_or_else(|e| e.into_inner());
        (self.lora_requests_info.get_or_create(&labels)).set(now.map_or(0.0, |d| d.as_secs_f64()));
        if let Some(old) = shown.replace(labels.clone()).filter(|old| *old != labels) {
            self.lora_requests_info.remove(&old);
        }
    }

    /// Follows the draft-worker's breaker (none without a draft-worker: shown closed).
    pub fn observe_draft_breaker(&self, state: Option<BreakerState>) {
        let state = state.unwrap_or(BreakerState {
            open: false,
            trips: 0,
        });
        self.draft_breaker_open.set(i64::from(state.open));
        self.draft_breaker_trips.follow(state.trips);
    }

    /// Counts one call that ended.
    pub fn request_ended(&self, finish_reason: &str, code: tonic::Code) {
        self.requests
            .get_or_create(&RequestLabels {
                finish_reason: finish_reason.to_string(),
                code: code_name(code),
            })
            .inc();
    }

    /// One verified round drafted by `method`: `proposed` drafts of which the first
    /// `accepted` were accepted.
    pub fn round(&self, method: &'static str, proposed: usize, accepted: usize) {
        let label = MethodLabel { method };
        self.rounds_by_method.get_or_create(&label).inc();
        if proposed == 0 {
            return;
        }
        self.draft_tokens_by_method
            .get_or_create(&label)
            .inc_by(proposed as u64);
        self.accepted_tokens_by_method
            .get_or_create(&label)
            .inc_by(accepted as u64);
        self.drafts.inc();
        self.draft_tokens.inc_by(proposed as u64);
        self.accepted_tokens.inc_by(accepted as u64);
        for position in 0..accepted {
            self.accepted_per_position
                .get_or_create(&PositionLabel {
                    position: position as u32,
                })
                .inc();
        }
    }
}

/// `Code::InvalidArgument` → `INVALID_ARGUMENT`, as gRPC spells codes.
pub fn code_name(code: tonic::Code) -> String {
    let mut out = String::new();
    for (i, ch) in format!("{code:?}").chars().enumerate() {
        if ch.is_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(ch.to_ascii_uppercase());
    }
    match out.as_str() {
        "O_K" => "OK".into(),
        _ => out,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_spelled_as_grpc_does() {
        assert_eq!(code_name(tonic::Code::Ok), "OK");
        assert_eq!(code_name(tonic::Code::InvalidArgument), "INVALID_ARGUMENT");
        assert_eq!(code_name(tonic::Code::Unavailable), "UNAVAILABLE");
    }

    #[test]
    fn the_breaker_shows_as_a_gauge_and_its_trips_as_a_counter() {
        let m = CoordinatorMetrics::default();
        let line = |text: &str, name: &str| {
            text.lines()
                .find(|l| l.starts_with(&format!("{name} ")))
                .map(str::to_string)
        };
        let observe = |open, trips| {
            m.observe_draft_breaker(Some(BreakerState { open, trips }));
            m.render()
        };
        let text = observe(true, 0);
        assert_eq!(
            line(&text, "duet_draft_breaker_open").as_deref(),
            Some("duet_draft_breaker_open 1")
        );
        let text = observe(true, 2);
        assert_eq!(
            line(&text, "duet_draft_breaker_trips_total").as_deref(),
            Some("duet_draft_breaker_trips_total 2")
        );
        let text = observe(false, 3);
        assert_eq!(
            line(&text, "duet_draft_breaker_open").as_deref(),
            Some("duet_draft_breaker_open 0")
        );
        assert_eq!(
            line(&text, "duet_draft_breaker_trips_total").as_deref(),
            Some("duet_draft_breaker_trips_total 3")
        );
        m.observe_draft_breaker(None);
        assert_eq!(
            line(&m.render(), "duet_draft_breaker_open").as_deref(),
            Some("duet_draft_breaker_open 0")
        );
    }

    #[test]
    fn rounds_count_per_position() {
        let m = CoordinatorMetrics::default();
        m.round("draft_model", 4, 2);
        m.round("ngram", 4, 4);
        m.round("none", 0, 0);
        let text = m.render();
        assert!(
            text.contains("duet_spec_decode_num_drafts_total 2"),
            "{text}"
        );
        assert!(
            text.contains("duet_spec_decode_num_draft_tokens_total 8"),
            "{text}"
        );
        assert!(
            text.contains("duet_spec_decode_num_accepted_tokens_total 6"),
            "{text}"
        );
        assert!(
            text.contains("duet_spec_decode_num_accepted_tokens_per_pos_total{position=\"0\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("duet_spec_decode_num_accepted_tokens_per_pos_total{position=\"3\"} 1"),
            "{text}"
        );
        for line in [
            "duet_speculation_rounds_total{method=\"none\"} 1",
            "duet_speculation_draft_tokens_total{method=\"ngram\"} 4",
            "duet_speculation_accepted_tokens_total{method=\"draft_model\"} 2",
        ] {
            assert!(text.contains(line), "{line}: {text}");
        }
    }
}
