//! What a request reports and teaches: its usage (the final message), the coordinator's
//! metrics, the attributes of its spans, and what each round tells the controller (the
//! costs and acceptance all requests share, and AUTO's estimates for this request).

use super::{Generation, Round, Shadow};
use crate::controller::{RoundCosts, Seen, Source, lookup_bucket};
use crate::method::{Method, Proposer};
use crate::output::{FinishReason, ProposerUsage, Timings, Usage};
use crate::service::REQUEST_LOG;
use crate::workers::{Party, WorkerTiming, Workers};
use tracing_opentelemetry::OpenTelemetrySpanExt;

#[derive(Debug, Default)]
pub(super) struct Stats {
    /// All but the time to first token and the total, which are set when known.
    pub(super) timings: Timings,
    pub(super) first_token_ms: Option<f64>,
    pub(super) proposers: Vec<ProposerUsage>,
    /// Completion tokens committed at each target failover, and why it happened.
    pub(super) failovers: Vec<(usize, String)>,
    /// Completion tokens committed each time the request gave its room up (preemption).
    pub(super) preempted: Vec<usize>,
    /// Of the current round's time, ms spent waiting for a draft session's prefill
    /// (counted as prefill).
    pub(super) waited_in_round: f64,
    /// Of the current round's time, ms the coordinator awaited its Propose and Verify calls
    /// (round logs only).
    pub(super) calls_in_round: [f64; 2],
    /// Propose calls made while the target verified, and the rounds that used their drafts.
    pub(super) ahead_calls: usize,
    pub(super) ahead_used: usize,
    /// Prompt tokens the target's session took from its prefix cache.
    pub(super) prompt_cached: usize,
}

impl Stats {
    pub(super) fn count(&mut self, proposer: Proposer, proposed: usize, accepted: usize) {
        let at = match self.proposers.iter().position(|p| p.proposer == proposer) {
            Some(at) => at,
            None => {
                self.proposers.push(ProposerUsage {
                    proposer,
                    rounds: 0,
                    proposed: 0,
                    accepted: 0,
                });
                self.proposers.len() - 1
            }
        };
        let p = &mut self.proposers[at];
        p.rounds += 1;
        p.proposed += proposed;
        p.accepted += accepted;
    }

    /// Rounds, draft tokens proposed and accepted, over all proposers.
    pub(super) fn totals(&self) -> (usize, usize, usize) {
        self.proposers.iter().fold((0, 0, 0), |(r, p, a), x| {
            (r + x.rounds, p + x.proposed, a + x.accepted)
        })
    }

    pub(super) fn add_timing(&mut self, t: WorkerTiming, party: Party) {
        let forward = t.forward.as_secs_f64() * 1e3;
        match party {
            Party::Draft => self.timings.draft_forward += forward,
            Party::Target => self.timings.target_forward += forward,
        }
        self.timings.queue += t.queue.as_secs_f64() * 1e3;
    }
}

/// The request's outcome on its span (the `Generate` span, current here).
pub(super) fn trace_usage(usage: &Usage, finish: FinishReason) {
    let span = tracing::Span::current();
    span.set_attribute("duet.completion_tokens", usage.completion_tokens as i64);
    span.set_attribute("duet.rounds", usage.rounds as i64);
    span.set_attribute("duet.draft_tokens", usage.draft_tokens_proposed as i64);
    span.set_attribute("duet.accepted_tokens", usage.draft_tokens_accepted as i64);
    if usage.draft_tokens_proposed > 0 {
        let rate = usage.draft_tokens_accepted as f64 / usage.draft_tokens_proposed as f64;
        span.set_attribute("duet.acceptance_rate", rate);
    }
    span.set_attribute("duet.fallback", usage.fallback.is_some());
    if let Some(reason) = &usage.fallback {
        span.set_attribute("duet.fallback_reason", reason.clone());
    }
    span.set_attribute("duet.finish_reason", finish.name());
}

impl<W: Workers> Generation<W> {
    /// What a finished round teaches: the costs and acceptance all requests share, and this
    /// request's controller. Prompt lookup is scored in rounds that do not use it too,
    /// against the committed tokens.
    fn learn(&mut self, r: &Round<'_>) {
        let shadowed = self.score_shadow(r);
        let shared = &self.ctx.shared;
        let target = r.verified.timing;
        let used = r.proposer();
        let proposal = r.drafted.as_ref().map(|d| &d.proposal);
        // Drafts made ahead took their time in the round before, beside its Verify.
        let draft = proposal
            .filter(|_| used == Proposer::DraftModel && !r.drafted_ahead)
            .map(|p| (p.timing, p.tokens.len()));
        let (draft_timing, draft_tokens) = draft.unwrap_or_default();
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        let workers = target.forward + target.queue + draft_timing.forward + draft_timing.queue;
        shared.observe_round(&RoundCosts {
            pass_calls: target.batch_calls,
            pass_rows: target.batch_rows.max(r.own_rows),
            pass_ms: ms(target.forward),
            draft_ms: ms(draft_timing.share),
            draft_tokens,
            overhead_ms: (!r.streamed).then(|| ms(r.started.elapsed().saturating_sub(workers))),
            mode: self.mode(),
            committed: r.committed.len(),
            beside_ahead: r.ahead.as_ref().map(|a| match &a.answer {
                Some(Ok(p)) => (ms(p.timing.share), p.tokens.len()),
                Some(Err(_)) | None => (0.0, 0),
            }),
        });
        let proposed = r.drafts().len();
        let lookup = r.lookup.as_ref();
        let source = match used {
            Proposer::DraftModel => Some(Source::DraftModel),
            Proposer::Ngram => lookup.map(|l| Source::Ngram(lookup_bucket(l))),
            Proposer::None => None,
        };
        // The leading committed tokens lookup proposed, used or not.
        let copied = match (used, lookup) {
            (Proposer::Ngram, _) => r.accepted,
            (_, Some(l)) => (l.tokens.iter().zip(r.committed))
                .take_while(|(a, b)| a == b)
                .count(),
            (_, None) => 0,
        };
        let mut seen = Vec::new();
        if let Some(source) = source {
            seen.push((source, Seen::round(proposed, r.accepted)));
        }
        // Lookup in the request's own text that the round did not use: scored against the
        // round's committed tokens (the cache's proposals: across rounds, `score_shadow`).
        if let Some(l) = lookup.filter(|l| used != Proposer::Ngram && l.cache_votes.is_none()) {
            let n = l.tokens.len().min(r.committed.len());
            seen.push((Source::Ngram(lookup_bucket(l)), Seen::round(n, copied)));
        }
        seen.extend(shadowed);
        for &(source, what) in &seen {
            shared.observe_seen(source, what);
        }
        if self.ngram.is_some() {
            shared.observe_copied(self.req.prompt.len(), copied, r.committed.len());
        }
        if used != Proposer::DraftModel {
            shared.round_without_draft();
        }
        if let Some(c) = &mut self.controller {
            for (source, what) in seen {
                c.observe_seen(source, what);
            }
            c.observe_batch(target.batch_calls, target.batch_rows, r.own_rows);
            c.observe_copied(copied, r.committed.len());
            if used != Proposer::DraftModel {
                c.round_without_draft();
            }
        }
    }

    /// The proposal cache's proposal of a round that does not use it, scored one at a time
    /// against the committed text from there (`shadow.rs`): what this round showed of it.
    /// A round using lookup ends the one being scored (what it showed is learnt already).
    fn score_shadow(&mut self, r: &Round<'_>) -> Option<(Source, Seen)> {
        if r.proposer() == Proposer::Ngram {
            self.shadow = None;
            return None;
        }
        if self.shadow.is_none() {
            let l = r.lookup.as_ref().filter(|l| l.cache_votes.is_some())?;
            self.shadow = Shadow::new(lookup_bucket(l), l.tokens.clone());
        }
        let s = self.shadow.as_mut()?;
        let (shown, decided) = s.score(r.committed);
        let source = Source::Ngram(s.bucket);
        if decided {
            self.shadow = None;
        }
        Some((source, shown))
    }

    /// What a reconciled round reports and teaches: its span's attributes (and a
    /// `rollback` span when a draft token was rejected: what each worker drops at the start
    /// of its next call, `keep`), a debug line, and what the controller learns.
    pub(super) fn report_round(&mut self, r: &Round<'_>, draft_fed: usize) {
        let (k, accepted) = (r.drafts().len(), r.accepted);
        let round = tracing::Span::current();
        round.set_attribute("duet.method", r.proposer().name());
        round.set_attribute("duet.k", k as i64);
        round.set_attribute("duet.accepted", accepted as i64);
        round.set_attribute("duet.committed", r.committed.len() as i64);
        round.set_attribute("duet.fallback", self.fallback.is_some());
        if self.ctx.speculation.overlap_drafting {
            round.set_attribute("duet.drafts_made_ahead", r.drafted_ahead);
        }
        if r.alternatives > 0 {
            round.set_attribute("duet.tree_alternatives", r.alternatives as i64);
            round.set_attribute("duet.tree_alternative_taken", r.took_alternative);
        }
        if accepted < k {
            // The target fed all K drafts and the alternatives (keeping a taken one's row);
            // the draft `draft_fed` of the drafts.
            let target = k + r.alternatives - accepted - usize::from(r.took_alternative);
            let draft = draft_fed - accepted.min(draft_fed);
            round.set_attribute("duet.first_rejected_position", accepted as i64);
            round.set_attribute("duet.target.rollback_tokens", target as i64);
            round.set_attribute("duet.draft.rollback_tokens", draft as i64);
            let rollback = tracing::info_span!("rollback");
            rollback.set_attribute("duet.target.rollback_tokens", target as i64);
            rollback.set_attribute("duet.draft.rollback_tokens", draft as i64);
        }
        let timing = &r.verified.timing;
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        // A draft made ahead ran during the last round: none of this round's time.
        let draft = r.drafted.as_ref().filter(|_| !r.drafted_ahead);
        let draft = draft.map(|d| &d.proposal.timing);
        let calls = std::mem::take(&mut self.stats.calls_in_round);
        tracing::debug!(
            method = r.proposer().name(),
            k,
            accepted,
            lookup_matched = r.lookup.as_ref().map_or(0, |l| l.matched),
            lookup_tokens = r.lookup.as_ref().map_or(0, |l| l.tokens.len()),
            cache_votes = r.lookup.as_ref().and_then(|l| l.cache_votes),
            pass_rows = timing.batch_rows.max(r.own_rows),
            target_ms = ms(timing.forward),
            target_queue_ms = ms(timing.queue),
            draft_ms = draft.map(|t| ms(t.forward)),
            draft_queue_ms = draft.map(|t| ms(t.queue)),
            propose_call_ms = calls[0],
            verify_call_ms = calls[1],
            ms = ms(r.started.elapsed()),
            "round"
        );
        self.learn(r);
    }

    pub(super) fn observe_latencies(&mut self, round_start: tokio::time::Instant, tokens: usize) {
        let m = &self.ctx.metrics;
        let mut per_token = tokens;
        if self.stats.first_token_ms.is_none() {
            let ttft = self.arrived.elapsed().as_secs_f64();
            self.stats.first_token_ms = Some(ttft * 1e3);
            m.time_to_first_token.observe(ttft);
            per_token = tokens.saturating_sub(1);
        }
        if per_token > 0 {
            let each = round_start.elapsed().as_secs_f64() / tokens as f64;
            for _ in 0..per_token {
                m.inter_token_latency.observe(each);
            }
        }
    }

    /// Counts a finished generation.
    pub(super) fn observe_finish(&self, finish: FinishReason, usage: &Usage) {
        let m = &self.ctx.metrics;
        m.request_ended(finish.name(), tonic::Code::Ok);
        m.e2e_latency.observe(self.arrived.elapsed().as_secs_f64());
        m.prompt_tokens.inc_by(usage.prompt_tokens as u64);
        m.prompt_tokens_cached
            .inc_by(usage.prompt_tokens_cached as u64);
        m.generation_tokens.inc_by(usage.completion_tokens as u64);
        if usage.fallback.is_some() {
            m.fallbacks.inc();
        }
        let t = &usage.timings;
        tracing::info!(
            target: REQUEST_LOG,
            request_id = %self.req.request_id.as_deref().unwrap_or("-"),
            method = %self.req.method.name(),
            finish_reason = %finish.name(),
            prompt_tokens = usage.prompt_tokens,
            cached_tokens = usage.prompt_tokens_cached,
            completion_tokens = usage.completion_tokens,
            rounds = usage.rounds,
            draft_tokens = usage.draft_tokens_proposed,
            accepted_tokens = usage.draft_tokens_accepted,
            fallback = usage.fallback.is_some(),
            queue_ms = t.admission_wait.round() as u64,
            ttft_ms = t.time_to_first_token.round() as u64,
            ms = t.total.round() as u64,
            "request finished"
        );
    }

    /// The request's usage, of `completion` tokens, `reasoning` of them its thought's.
    pub(super) fn usage(&self, (completion, reasoning): (usize, usize)) -> Usage {
        let s = &self.stats;
        let (rounds, proposed, accepted) = s.totals();
        let speculative = self.req.method != Method::NONE;
        Usage {
            prompt_tokens: self.req.prompt.len(),
            prompt_tokens_cached: s.prompt_cached,
            completion_tokens: completion,
            reasoning_tokens: reasoning,
            repository_files_left_out: self.req.repository_files_left_out,
            draft_tokens_proposed: proposed,
            draft_tokens_accepted: accepted,
            rounds,
            method: self.req.method,
            num_speculative_tokens: if speculative { self.req.k } else { 0 },
            k_chosen_per_round: speculative && self.req.choose_k,
            fallback: self.fallback.clone(),
            timings: Timings {
                time_to_first_token: s.first_token_ms.unwrap_or_default(),
                total: self.arrived.elapsed().as_secs_f64() * 1e3,
                ..s.timings
            },
            proposers: s.proposers.clone(),
            target_failovers: s.failovers.clone(),
            preempted_at: s.preempted.clone(),
            drafted_ahead: s.ahead_calls,
            drafted_ahead_used: s.ahead_used,
        }
    }
}
