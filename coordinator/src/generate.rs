//! The speculative loop of one request: draft K tokens, verify them in one target pass,
//! reconcile with the engine's verification functions, commit, stream the text; both caches
//! roll back through the next round's `keep`/`append` (see `proto/duet/v1/worker.proto`).
//! The draft-worker failing at any point turns the rest of the request target-only.

use crate::Coordinator;
use crate::request::{Method, ValidRequest};
use crate::workers::{Models, Session, trips_breaker};
use duet_engine::detokenize::{StopStrings, Utf8Stream};
use duet_engine::sampling::rng_for;
use duet_engine::verify::{Verdict, verify_greedy, verify_sampling};
use duet_proto::v1 as pb;
use rand_chacha::ChaCha8Rng;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc;
use tonic::Status;
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

type Out = mpsc::Sender<Result<pb::GenerateResponse, Status>>;

/// Why a generation ended early without a final message.
#[derive(Debug)]
pub enum Abort {
    /// The caller went away.
    Cancelled,
    /// The target-worker failed: the request cannot go on.
    Target(Status),
}

/// Tokens on each side: how much of the committed sequence each worker's cache holds.
#[derive(Debug, Default)]
struct Synced {
    target: usize,
    draft: usize,
}

#[derive(Debug, Default)]
struct Stats {
    proposed: u32,
    accepted: u32,
    rounds: u32,
    prefill_ms: f64,
    rounds_ms: f64,
    draft_forward_ms: f64,
    target_forward_ms: f64,
    queue_ms: f64,
    first_token_ms: Option<f64>,
}

impl Stats {
    fn add_timing(&mut self, t: &pb::Timing, draft: bool) {
        let forward = t.forward_us as f64 / 1e3;
        if draft {
            self.draft_forward_ms += forward;
        } else {
            self.target_forward_ms += forward;
        }
        self.queue_ms += t.queue_us as f64 / 1e3;
    }
}

/// Turns committed tokens into text deltas and finish conditions.
struct Output {
    utf8: Utf8Stream,
    stops: StopStrings,
    generated: usize,
    max_tokens: usize,
}

impl Output {
    /// Takes this round's tokens in order; returns the tokens kept, the text released and
    /// the finish reason if one was reached (tokens after it are dropped).
    fn take(
        &mut self,
        models: &Models,
        tokens: &[u32],
    ) -> Result<(Vec<u32>, String, Option<pb::FinishReason>), Status> {
        let mut kept = Vec::new();
        let mut text = String::new();
        for &t in tokens {
            kept.push(t);
            self.generated += 1;
            if models.tokenizer.is_eos(t) {
                return Ok((kept, text, Some(pb::FinishReason::Eos)));
            }
            let bytes = models
                .tokenizer
                .token_bytes(t)
                .map_err(|e| Status::internal(format!("detokenizing {t}: {e}")))?;
            let piece = self.utf8.push(&bytes);
            let released = self.stops.push(&piece);
            text.push_str(&released.text);
            if released.stopped {
                return Ok((kept, text, Some(pb::FinishReason::Stop)));
            }
            if self.generated >= self.max_tokens {
                return Ok((kept, text, Some(pb::FinishReason::Length)));
            }
        }
        Ok((kept, text, None))
    }

    /// Text held back at the end (an incomplete character, a stop-string prefix).
    fn flush(&mut self, reason: pb::FinishReason) -> String {
        if reason == pb::FinishReason::Stop {
            return String::new();
        }
        let tail = self.utf8.finish();
        let mut text = self.stops.push(&tail).text;
        text.push_str(&self.stops.finish());
        text
    }
}

/// Runs one request to its end, sending chunks and the final message to `out`.
pub async fn generate(
    coord: Arc<Coordinator>,
    models: Arc<Models>,
    req: ValidRequest,
    arrived: Instant,
    out: Out,
) -> Result<(), Abort> {
    // Both sessions close when `g` (which owns them) goes, whatever the outcome.
    let prefill = tracing::info_span!("prefill");
    let mut g = Generation::start(coord, models, req, arrived, &out)
        .instrument(prefill)
        .await?;
    g.run(&out).await
}

struct Generation {
    coord: Arc<Coordinator>,
    models: Arc<Models>,
    req: ValidRequest,
    arrived: Instant,
    target: Session,
    /// The draft session while speculation is on.
    draft: Option<Session>,
    fallback: Option<String>,
    seq: Vec<u32>,
    synced: Synced,
    stats: Stats,
    rng: ChaCha8Rng,
}

/// Awaits `call` unless the caller goes away first.
async fn unless_cancelled<T>(
    out: &Out,
    call: impl std::future::Future<Output = T>,
) -> Result<T, Abort> {
    tokio::select! {
        r = call => Ok(r),
        _ = out.closed() => Err(Abort::Cancelled),
    }
}

impl Generation {
    async fn start(
        coord: Arc<Coordinator>,
        models: Arc<Models>,
        req: ValidRequest,
        arrived: Instant,
        out: &Out,
    ) -> Result<Self, Abort> {
        let capacity = req.prompt.len() + req.max_tokens;
        let mut fallback = None;
        let draft = match (req.method, &coord.draft) {
            (Method::None, _) => None,
            (Method::DraftModel, None) => {
                fallback = Some("no draft-worker is configured".to_string());
                None
            }
            (Method::DraftModel, Some(d)) => match d.available() {
                Ok(()) => Some(d.clone()),
                Err(reason) => {
                    fallback = Some(format!("draft-worker skipped (circuit open): {reason}"));
                    None
                }
            },
        };
        let started = Instant::now();
        let target_open = coord.target.open(&req.prompt, capacity, &req.sampling);
        let (target, draft_opened) = match &draft {
            Some(d) if coord.config.speculation.concurrent_prefill => {
                let draft_open = d.open(&req.prompt, capacity, &req.sampling);
                let (t, d) =
                    unless_cancelled(out, async { tokio::join!(target_open, draft_open) }).await?;
                (t, Some(d))
            }
            Some(d) => {
                let t = unless_cancelled(out, target_open).await?;
                let d = match &t {
                    Ok(_) => {
                        let open = d.open(&req.prompt, capacity, &req.sampling);
                        Some(unless_cancelled(out, open).await?)
                    }
                    Err(_) => None,
                };
                (t, d)
            }
            None => (unless_cancelled(out, target_open).await?, None),
        };
        // On any early return the sessions already opened close as they drop.
        let target = target.map_err(Abort::Target)?;
        let draft_session = match (draft_opened, &draft) {
            (Some(Ok(session)), _) => Some(session),
            (Some(Err(status)), Some(d)) => {
                if trips_breaker(&status) {
                    d.trip(status.message().to_string());
                }
                fallback = Some(format!(
                    "draft-worker failed to open a session: {}",
                    status.message()
                ));
                None
            }
            _ => None,
        };
        let mut stats = Stats {
            prefill_ms: started.elapsed().as_secs_f64() * 1e3,
            ..Stats::default()
        };
        stats.queue_ms += target.timing.queue_us as f64 / 1e3;
        let prompt_len = req.prompt.len();
        Ok(Self {
            rng: rng_for(req.sampling.seed),
            seq: req.prompt.clone(),
            synced: Synced {
                target: prompt_len - 1,
                draft: prompt_len - 1,
            },
            coord,
            models,
            req,
            arrived,
            target,
            draft: draft_session,
            fallback,
            stats,
        })
    }

    /// Ends speculation for this request: the draft session closes, `reason` is recorded.
    fn stop_drafting(&mut self, reason: String) {
        self.draft = None;
        self.fallback = Some(reason);
    }

    async fn run(&mut self, out: &Out) -> Result<(), Abort> {
        let mut output = Output {
            utf8: Utf8Stream::new(),
            stops: StopStrings::new(self.req.stop.clone()),
            generated: 0,
            max_tokens: self.req.max_tokens,
        };
        let finish = loop {
            if self.coord.stopping.is_triggered() {
                break pb::FinishReason::Cancelled;
            }
            let round_start = Instant::now();
            let span =
                tracing::info_span!("speculate.round", duet.round = self.stats.rounds as i64);
            let committed = self
                .round(out, self.req.max_tokens - output.generated)
                .instrument(span)
                .await?;
            self.stats.rounds += 1;
            self.stats.rounds_ms += round_start.elapsed().as_secs_f64() * 1e3;
            let (kept, text, finish) = output
                .take(&self.models, &committed)
                .map_err(Abort::Target)?;
            self.seq.extend_from_slice(&kept);
            self.observe_latencies(round_start, kept.len());
            let chunk = pb::GenerateResponse {
                event: Some(pb::generate_response::Event::Chunk(pb::Chunk {
                    text,
                    token_ids: kept,
                })),
            };
            out.send(Ok(chunk)).await.map_err(|_| Abort::Cancelled)?;
            if let Some(reason) = finish {
                break reason;
            }
        };
        let text = output.flush(finish);
        let usage = self.usage(output.generated);
        self.observe_finish(finish, output.generated);
        trace_usage(&usage, finish);
        let finished = pb::GenerateResponse {
            event: Some(pb::generate_response::Event::Finished(pb::Finished {
                finish_reason: finish as i32,
                text,
                usage: Some(usage),
            })),
        };
        out.send(Ok(finished)).await.map_err(|_| Abort::Cancelled)
    }

    /// Time to first token, then per-token latency: the round's time shared by its tokens.
    fn observe_latencies(&mut self, round_start: Instant, tokens: usize) {
        let m = &self.coord.metrics;
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
    fn observe_finish(&self, finish: pb::FinishReason, completion: usize) {
        let m = &self.coord.metrics;
        m.request_ended(
            &duet_proto::finish_reason_name(finish as i32),
            tonic::Code::Ok,
        );
        m.e2e_latency.observe(self.arrived.elapsed().as_secs_f64());
        m.prompt_tokens.inc_by(self.req.prompt.len() as u64);
        m.generation_tokens.inc_by(completion as u64);
        if self.fallback.is_some() {
            m.fallbacks.inc();
        }
    }

    /// One round: a speculation round when a draft session is open and more than one token
    /// remains, else a target-only step. Returns the committed tokens (1 to K + 1).
    async fn round(&mut self, out: &Out, remaining: usize) -> Result<Vec<u32>, Abort> {
        let k = self.req.k.min(remaining.saturating_sub(1));
        let mut proposal = None;
        if let (Some(session), Some(draft), true) =
            (self.draft.as_ref(), self.coord.draft.clone(), k > 0)
        {
            let keep = self.synced.draft;
            let call = draft.propose(session, keep, &self.seq[keep..], k);
            match unless_cancelled(out, call).await? {
                Ok(p) => {
                    self.stats.add_timing(&p.timing, true);
                    proposal = Some(p);
                }
                Err(status) => {
                    if trips_breaker(&status) {
                        draft.trip(status.message().to_string());
                    }
                    tracing::warn!(error = %status.message(), "draft-worker failed; continuing target-only");
                    self.stop_drafting(format!("draft-worker failed: {}", status.message()));
                }
            }
        }
        let drafts: &[u32] = proposal.as_ref().map_or(&[], |p| &p.tokens);
        let keep = self.synced.target;
        let call = self
            .coord
            .target
            .verify(&self.target, keep, &self.seq[keep..], drafts);
        let verified = unless_cancelled(out, call).await?.map_err(Abort::Target)?;
        self.stats.add_timing(&verified.timing, false);
        let verdict = self.reconcile(drafts, proposal.as_ref().map(|p| &p.q[..]), &verified)?;
        let committed = verdict.committed(drafts);
        self.trace_round(drafts.len(), verdict.accepted, committed.len());

        let before = self.seq.len();
        self.synced.target = before + verdict.accepted;
        self.coord.metrics.round(drafts.len(), verdict.accepted);
        if !drafts.is_empty() {
            // The draft fed its tokens but the last one.
            self.synced.draft = before + verdict.accepted.min(drafts.len() - 1);
            self.stats.proposed += drafts.len() as u32;
            self.stats.accepted += verdict.accepted as u32;
        }
        Ok(committed)
    }

    /// The round's attributes on its span, and a `rollback` span when a draft token was
    /// rejected: what each worker drops at the start of its next call (`keep`).
    fn trace_round(&self, k: usize, accepted: usize, committed: usize) {
        let round = tracing::Span::current();
        round.set_attribute("duet.k", k as i64);
        round.set_attribute("duet.accepted", accepted as i64);
        round.set_attribute("duet.committed", committed as i64);
        round.set_attribute("duet.fallback", self.fallback.is_some());
        if accepted < k {
            // The target fed all K drafts; the draft fed all but the last.
            let target = k - accepted;
            let draft = (k - 1) - accepted.min(k - 1);
            round.set_attribute("duet.first_rejected_position", accepted as i64);
            round.set_attribute("duet.target.rollback_tokens", target as i64);
            round.set_attribute("duet.draft.rollback_tokens", draft as i64);
            let rollback = tracing::info_span!("rollback");
            rollback.set_attribute("duet.target.rollback_tokens", target as i64);
            rollback.set_attribute("duet.draft.rollback_tokens", draft as i64);
        }
    }

    fn reconcile(
        &mut self,
        drafts: &[u32],
        q: Option<&[duet_engine::sampling::Distribution]>,
        v: &crate::workers::Verified,
    ) -> Result<Verdict, Abort> {
        let bad = |e: duet_engine::verify::VerifyError| {
            Abort::Target(Status::internal(format!(
                "worker answers do not fit together: {e}"
            )))
        };
        if self.req.sampling.is_greedy() {
            verify_greedy(drafts, &v.argmax).map_err(bad)
        } else {
            verify_sampling(drafts, q.unwrap_or(&[]), &v.p, &mut self.rng).map_err(bad)
        }
    }

    fn usage(&self, completion: usize) -> pb::Usage {
        let s = &self.stats;
        let speculative = self.req.method == Method::DraftModel;
        pb::Usage {
            prompt_tokens: self.req.prompt.len() as u32,
            completion_tokens: completion as u32,
            draft_tokens_proposed: s.proposed,
            draft_tokens_accepted: s.accepted,
            rounds: s.rounds,
            method: self.req.method.to_wire() as i32,
            num_speculative_tokens: if speculative { self.req.k as u32 } else { 0 },
            fell_back_to_target_only: self.fallback.is_some(),
            fallback_reason: self.fallback.clone().unwrap_or_default(),
            timings: Some(pb::Timings {
                time_to_first_token_ms: s.first_token_ms.unwrap_or_default(),
                total_ms: self.arrived.elapsed().as_secs_f64() * 1e3,
                prefill_ms: s.prefill_ms,
                rounds_ms: s.rounds_ms,
                draft_forward_ms: s.draft_forward_ms,
                target_forward_ms: s.target_forward_ms,
                queue_ms: s.queue_ms,
            }),
        }
    }
}

/// The request's outcome on its span (the `Generate` span, current here).
fn trace_usage(usage: &pb::Usage, finish: pb::FinishReason) {
    let span = tracing::Span::current();
    span.set_attribute("duet.completion_tokens", usage.completion_tokens as i64);
    span.set_attribute("duet.rounds", usage.rounds as i64);
    span.set_attribute("duet.draft_tokens", usage.draft_tokens_proposed as i64);
    span.set_attribute("duet.accepted_tokens", usage.draft_tokens_accepted as i64);
    if usage.draft_tokens_proposed > 0 {
        let rate = usage.draft_tokens_accepted as f64 / usage.draft_tokens_proposed as f64;
        span.set_attribute("duet.acceptance_rate", rate);
    }
    span.set_attribute("duet.fallback", usage.fell_back_to_target_only);
    if usage.fell_back_to_target_only {
        span.set_attribute("duet.fallback_reason", usage.fallback_reason.clone());
    }
    span.set_attribute(
        "duet.finish_reason",
        duet_proto::finish_reason_name(finish as i32),
    );
}
