//! The real workers over gRPC: the target-worker's and draft-worker's clients, the
//! draft-worker's circuit breaker, and the wire forms of Propose and Verify.

use super::breaker::{Breaker, BreakerState, Check};
use super::client::{Deadlines, Expected, Session, WorkerClient, timing, traced_call};
use super::{
    AdapterNames, CallError, Decode, Decoded, Failure, LookupPass, Models, Next, Open, Party,
    Proposal, Propose, TargetChoice, TargetOpened, Verified, Verify, WorkerTiming, Workers,
};
use crate::config::{CoordinatorConfig, worker_tls};
use duet_engine::Tokenizer;
use duet_engine::logprobs::TokenLogprobs;
use duet_engine::sampling::Distribution;
use duet_proto::v1 as pb;
use duet_proto::v1::draft_worker_client::DraftWorkerClient;
use duet_proto::v1::target_worker_client::TargetWorkerClient;
use duet_serving::config::ConfigError;
use duet_serving::grpc::{Health, MAX_MESSAGE_BYTES};
use duet_serving::telemetry::client_span;
use duet_serving::wire::{decode_distribution, encode_sparse, logprobs_from_wire};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

pub use super::breaker::DRAFT_HEALTH_NAME;

/// The draft-worker with its breaker.
#[derive(Debug)]
struct Draft {
    client: WorkerClient,
    breaker: Arc<Breaker>,
    /// The target's vocabulary hash, once known: the draft must match it.
    expected_vocabulary: Arc<OnceLock<String>>,
}

/// The two workers as configured.
#[derive(Debug)]
pub struct GrpcWorkers {
    pub target: WorkerClient,
    draft: Option<Draft>,
}

fn ms(ms: u64) -> Duration {
    Duration::from_millis(ms)
}

/// The time of one token at `rate` tokens per second (at least 1: checked by the
/// configuration).
fn per_token(rate: u64) -> Duration {
    Duration::from_secs(1) / u32::try_from(rate.max(1)).unwrap_or(u32::MAX)
}

impl GrpcWorkers {
    /// Clients for the configured workers (no draft-worker when its address is empty); they
    /// resolve their replicas in the background. Fails on unreadable TLS files.
    pub fn new(config: &CoordinatorConfig) -> Result<Self, ConfigError> {
        let t = &config.target;
        let target_tls = worker_tls("target.tls", &t.address, &t.tls)?;
        let target_https = target_tls.is_some();
        let target = WorkerClient::new(
            Party::Target,
            &t.address,
            target_tls,
            ms(t.connect_timeout_ms),
            ms(t.discovery_interval_ms),
            Deadlines {
                call: ms(t.timeout_ms),
                call_floor: ms(t.verify_timeout_floor_ms.min(t.timeout_ms)),
                open: ms(t.timeout_ms),
                prefill_per_token: per_token(t.min_prefill_tokens_per_s),
                control: ms(t.control_timeout_ms),
            },
            config.routing.prefix(),
        );
        let reload = ms(config.tls.reload_interval_ms);
        if target_https {
            target.follow_tls_files("target.tls", &t.tls, reload);
        }
        let d = &config.draft;
        let draft_tls = worker_tls("draft.tls", &d.address, &d.tls)?;
        let draft_https = draft_tls.is_some();
        let draft = (!d.address.is_empty()).then(|| {
            let client = WorkerClient::new(
                Party::Draft,
                &d.address,
                draft_tls,
                ms(d.connect_timeout_ms),
                ms(d.discovery_interval_ms),
                Deadlines {
                    call: ms(d.timeout_ms),
                    call_floor: ms(d.timeout_ms),
                    open: ms(d.open_timeout_ms),
                    prefill_per_token: per_token(d.min_prefill_tokens_per_s),
                    control: ms(d.control_timeout_ms),
                },
                config.routing.prefix(),
            );
            if draft_https {
                client.follow_tls_files("draft.tls", &d.tls, reload);
            }
            let expected_vocabulary = Arc::new(OnceLock::new());
            let check: Check = {
                let (client, expected) = (client.clone(), expected_vocabulary.clone());
                Arc::new(move || {
                    let client = client.clone();
                    let expected = expected.get().cloned();
                    Box::pin(async move { check_draft(&client, expected).await })
                })
            };
            Draft {
                client,
                // A trial request gets its draft session opened and its first Propose.
                breaker: Breaker::new(
                    ms(d.health_interval_ms),
                    ms(d.open_timeout_ms + d.timeout_ms),
                    check,
                ),
                expected_vocabulary,
            }
        });
        Ok(Self { target, draft })
    }

    /// Publishes the draft-worker's breaker on `health` (`duet.v1.DraftWorker`).
    pub fn report_to(&self, health: Health) {
        if let Some(d) = &self.draft {
            d.breaker.report_to(health);
        }
    }

    /// The draft-worker's breaker, when there is a draft-worker.
    pub fn draft_breaker(&self) -> Option<BreakerState> {
        self.draft.as_ref().map(|d| d.breaker.state())
    }

    /// `Ok(Ok(()))` when a target replica serves, `Ok(Err(why))` when one answered but none
    /// serves, `Err` when none could be reached.
    pub async fn target_serving(&self) -> Result<Result<(), String>, CallError> {
        Ok(self.target.first_serving().await?.map(|_| ()))
    }

    /// The fraction of the target replicas' KV-cache budget reserved now, `None` when no
    /// replica answers.
    pub async fn target_kv_usage(&self) -> Option<f64> {
        self.target.kv_usage().await
    }

    /// The models, from the target-worker's Describe.
    pub async fn models(&self) -> Result<Models, CallError> {
        let d = self.target.describe(false).await?;
        let tokenizer = Tokenizer::from_gguf_bytes(&d.tokenizer).map_err(|e| {
            self.target.error(
                self.target.address(),
                Failure::Malformed(format!("its tokenizer: {e}")),
            )
        })?;
        // Every target replica must serve this model, or the output would depend on which
        // replica a request meets.
        self.target.expect(Expected {
            vocabulary_sha256: d.vocabulary_sha256.clone(),
            model: Some(d.model.clone()),
        });
        let sizes = (d.vocab_size as usize, d.context_length as usize);
        let file = duet_engine::FileFacts {
            parameters: d.parameter_count,
            quantization: d.quantization,
            bytes: d.file_bytes,
            size_label: d.size_label,
        };
        let models = Models::new(tokenizer, d.vocabulary_sha256, sizes, d.model);
        let architecture = d.architecture;
        Ok(Models {
            architecture,
            file,
            adapters: AdapterNames::new(d.adapters, d.adapters_from_dir),
            device: d.device,
            ..models
        })
    }

    /// The adapters the first serving target replica lists now.
    pub async fn adapters(&self) -> Result<Vec<String>, CallError> {
        Ok(self.target.describe(true).await?.adapters)
    }

    /// The target's vocabulary is known: check the draft-worker against it now, then keep
    /// probing while it fails.
    pub async fn expect_vocabulary(&self, sha256: &str) {
        if let Some(d) = &self.draft {
            let _ = d.expected_vocabulary.set(sha256.to_string());
            d.client.expect(Expected {
                vocabulary_sha256: sha256.to_string(),
                model: None,
            });
            d.breaker.check_now().await;
        }
    }

    fn draft(&self) -> Result<&Draft, CallError> {
        self.draft.as_ref().ok_or_else(|| {
            CallError::new(
                Party::Draft,
                Failure::Refused("no draft-worker is configured".into()),
            )
        })
    }
}

/// The draft-worker serves, and its vocabulary is the target's.
async fn check_draft(client: &WorkerClient, expected: Option<String>) -> Result<(), String> {
    let Some(expected) = expected else {
        return Err("waiting for the target-worker's vocabulary".into());
    };
    let d = client.describe(true).await.map_err(|e| e.to_string())?;
    if d.vocabulary_sha256 != expected {
        return Err(format!(
            "the draft model {} has a different vocabulary from the target's; speculation needs the same one",
            d.model
        ));
    }
    Ok(())
}

fn draft_stub(session: &Session) -> DraftWorkerClient<super::pool::Traced> {
    DraftWorkerClient::new(session.channel.clone())
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES)
}

fn target_stub(session: &Session) -> TargetWorkerClient<super::pool::Traced> {
    TargetWorkerClient::new(session.channel.clone())
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES)
}

/// Decodes `raw` distributions (each up to a whole vocabulary, checked as it is decoded)
/// on a blocking thread, so that sampling requests' answers do not hold up the async
/// threads every other stream runs on. An error names the index of the distribution.
async fn decode_apart(raw: Vec<pb::Distribution>) -> Result<Vec<Distribution>, (usize, String)> {
    if raw.is_empty() {
        return Ok(Vec::new());
    }
    let decode = move || {
        let each = raw.iter().enumerate();
        each.map(|(i, d)| decode_distribution(d).map_err(|e| (i, e.to_string())))
            .collect()
    };
    tokio::task::spawn_blocking(decode)
        .await
        .unwrap_or_else(|e| Err((0, format!("decoding: {e}"))))
}

/// A sampling verdict and the p it carries: one, at the rejected draft, where it has no
/// token; none where it has one.
fn tested(v: pb::SamplingVerdict, mut p: Vec<Distribution>) -> Result<TargetChoice, String> {
    let next = match (v.token, p.len()) {
        (Some(token), 0) => Next::Drawn(token),
        (None, 1) => Next::Rejected(p.remove(0)),
        (token, n) => return Err(format!("a verdict with token {token:?} and {n} p")),
    };
    Ok(TargetChoice::Tested {
        accepted: v.accepted as usize,
        next,
        rng_position: v.rng_position,
    })
}

/// The chosen tokens' figures off the wire (how many the call's answer should carry is
/// `check_verified`'s to judge).
fn logprobs(wire: &[pb::TokenLogprobs]) -> Result<Vec<TokenLogprobs>, String> {
    let read = wire.iter().map(logprobs_from_wire).collect::<Option<_>>();
    read.ok_or_else(|| "logprobs: alternatives' ids and figures differ in number".into())
}

/// One pass of a Decode stream from its answers (`decode`): the last token's choice (its
/// argmax, or the token drawn and where the random stream then stands), each token's
/// figures, the first answer's timing, and where the pass verified lookup drafts, what it
/// made of them (whether that fits is `check_pass`'s to judge).
fn verified_pass(pass: Vec<pb::DecodeResponse>) -> Result<Verified, String> {
    let (first, last) = (&pass[0], &pass[pass.len() - 1]);
    let choice = match last.rng_position {
        None => TargetChoice::Argmax(vec![last.token]),
        Some(rng_position) => TargetChoice::Tested {
            accepted: 0,
            next: Next::Drawn(last.token),
            rng_position,
        },
    };
    let figures: Vec<_> = pass.iter().filter_map(|m| m.logprobs.clone()).collect();
    let looked_up = (!first.drafts.is_empty()).then(|| LookupPass {
        drafts: first.drafts.clone(),
        matched: first.matched as usize,
        accepted: first.accepted as usize,
        tokens: pass.iter().map(|m| m.token).collect(),
    });
    Ok(Verified {
        choice,
        logprobs: logprobs(&figures)?,
        timing: timing(first.timing),
        give_way: pass.iter().any(|m| m.give_way),
        pass: looked_up,
    })
}

impl Workers for GrpcWorkers {
    type Session = Session;

    async fn open_target(&self, open: Open<'_>) -> Result<TargetOpened<Session>, CallError> {
        self.target.open(open, None).await
    }

    async fn reopen_target(
        &self,
        open: Open<'_>,
        lost: &Session,
    ) -> Result<TargetOpened<Session>, CallError> {
        self.target.open(open, Some(lost.addr)).await
    }

    async fn close_target(&self, session: &Session) {
        session.close().await;
    }

    fn draft_available(&self) -> Result<(), String> {
        match &self.draft {
            None => Err("no draft-worker is configured".into()),
            Some(d) => d
                .breaker
                .available()
                .map_err(|reason| format!("draft-worker skipped (circuit open): {reason}")),
        }
    }

    async fn open_draft(&self, open: Open<'_>) -> Result<(Session, WorkerTiming), CallError> {
        let (session, timing, _) = self.draft()?.client.open(open.for_draft(), None).await?;
        Ok((session, timing))
    }

    /// Reads the whole Propose stream within the draft's deadline; a stream with more than
    /// `k` tokens, or a malformed q, is a malformed answer.
    async fn propose(&self, session: &Session, call: Propose<'_>) -> Result<Proposal, CallError> {
        let draft = self.draft()?;
        let client = &draft.client;
        let k = call.k;
        let request = pb::ProposeRequest {
            session_id: session.id.clone(),
            instance_id: session.instance,
            keep: call.keep as u32,
            append: call.append.to_vec(),
            k: k as u32,
            stop_below: call.stop_below,
            alternatives_above: call.alternatives.0,
            max_alternatives: call.alternatives.1 as u32,
        };
        let mut stub = draft_stub(session);
        let read = async move {
            let mut stream = stub.propose(request).await?.into_inner();
            let mut p = Proposal {
                tokens: Vec::with_capacity(k),
                ..Proposal::default()
            };
            let mut q = Vec::new();
            while let Some(m) = stream.message().await? {
                if p.tokens.len() == k {
                    return Ok(Err(format!("more than the {k} tokens asked for")));
                }
                p.tokens.push(m.token);
                q.extend(m.q);
                if call.alternatives.1 > 0 {
                    p.alternatives.push(m.alternatives);
                }
                if let Some(t) = m.timing {
                    p.timing = timing(Some(t));
                }
            }
            match decode_apart(q).await {
                Ok(q) => p.q = q,
                Err((i, e)) => return Ok(Err(format!("q of draft token {}: {e}", i + 1))),
            }
            Ok(Ok(p))
        };
        let at = session.addr;
        let propose = async {
            client
                .step(at, "draft Propose", read)
                .await?
                .map_err(|m| client.error(at, Failure::Malformed(m)))
        };
        let span = client_span(duet_proto::v1::draft_worker_server::SERVICE_NAME, "Propose");
        let proposal = traced_call(span, propose).await?;
        draft.breaker.succeeded();
        Ok(proposal)
    }

    async fn verify(&self, session: &Session, call: Verify<'_>) -> Result<Verified, CallError> {
        let client = &self.target;
        let mut stub = target_stub(session);
        let request = pb::VerifyRequest {
            session_id: session.id.clone(),
            instance_id: session.instance,
            keep: call.keep as u32,
            append: call.append.to_vec(),
            draft: call.drafts.to_vec(),
            parents: call.parents.to_vec(),
            sampling_test: call.test.map(|t| pb::SamplingTest {
                q: t.q.to_vec(),
                point_masses: t.point_masses,
                rng_position: t.rng_position,
                whole_q: t.whole.iter().map(encode_sparse).collect(),
            }),
        };
        let at = session.addr;
        let verify = async {
            let r = client
                .step(at, "target Verify", stub.verify(request))
                .await?
                .into_inner();
            let malformed = |e: String| client.error(at, Failure::Malformed(e));
            let p = match r.p.is_empty() {
                true => Vec::new(),
                false => decode_apart(r.p)
                    .await
                    .map_err(|(_, e)| malformed(format!("p: {e}")))?,
            };
            let choice = match r.verdict {
                Some(v) => tested(v, p).map_err(malformed)?,
                None if p.is_empty() => TargetChoice::Argmax(r.argmax),
                None => TargetChoice::P(p),
            };
            Ok(Verified {
                choice,
                logprobs: logprobs(&r.logprobs).map_err(malformed)?,
                timing: timing(r.timing),
                give_way: r.give_way,
                pass: None,
            })
        };
        let span = client_span(duet_proto::v1::target_worker_server::SERVICE_NAME, "Verify");
        traced_call(span, verify).await
    }

    /// Each token within the deadline of a Verify (the calls' pace), as one step is one
    /// pass; the call's client span lasts as long as the stream.
    async fn decode(&self, session: &Session, call: Decode<'_>) -> Result<Decoded, CallError> {
        let client = self.target.clone();
        let mut stub = target_stub(session);
        let request = pb::DecodeRequest {
            session_id: session.id.clone(),
            instance_id: session.instance,
            keep: call.keep as u32,
            append: call.append.to_vec(),
            max_tokens: u32::try_from(call.max_tokens).unwrap_or(u32::MAX),
            stop_tokens: call.stop.to_vec(),
            rng_position: call.rng_position,
            lookup: call.lookup.map(|l| pb::StreamLookup {
                min_match: l.min_match as u32,
                max_match: l.max_match as u32,
                drafts: l.drafts.iter().map(|&k| k as u32).collect(),
            }),
        };
        let at = session.addr;
        let span = client_span(duet_proto::v1::target_worker_server::SERVICE_NAME, "Decode");
        let start = client.step(at, "target Decode", stub.decode(request));
        let stream = traced_call(span.clone(), start).await?.into_inner();
        // The client and the span travel with the stream, not copied per token.
        let state = Some((stream, client, span));
        let passes = futures::stream::unfold(state, move |state| async move {
            let (mut stream, client, span) = state?;
            let mut pass = Vec::new();
            // A pass that accepted lookup drafts answers them and its own token back to
            // back: one item for all (fewer where a stop token among them ended the stream).
            let more = |m: &pb::DecodeResponse| (m.accepted as usize).min(m.drafts.len());
            while pass.first().is_none_or(|m| pass.len() <= more(m)) {
                let next = client.step(at, "target Decode", stream.message());
                match traced_call(span.clone(), next).await {
                    Ok(Some(m)) => pass.push(m),
                    Ok(None) if pass.is_empty() => return None,
                    Ok(None) => break,
                    Err(e) => return Some((Err(e), None)),
                }
            }
            match verified_pass(pass) {
                Ok(verified) => Some((Ok(verified), Some((stream, client, span)))),
                Err(e) => Some((Err(client.error(at, Failure::Malformed(e))), None)),
            }
        });
        Ok(Box::pin(passes))
    }

    fn trip_draft(&self, reason: &str) {
        if let Some(d) = &self.draft {
            d.breaker.trip(reason);
        }
    }

    fn verifies_trees(&self, session: &Session) -> bool {
        session.verifies_trees
    }

    fn decodes_with_lookup(&self, session: &Session) -> bool {
        session.decodes_with_lookup
    }

    fn hold_prefix(&self, sessions: &[&Session], tokens: &[u32], salt: u64) {
        let blocks = duet_engine::prefix_block_hashes(tokens, salt);
        for session in sessions {
            session.held_prefix(&blocks);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    /// A sampling Verify's answer (K + 1 = 9 whole-vocabulary distributions, ids shuffled)
    /// decodes on a blocking thread: on a runtime with one async thread, a ticker runs all
    /// the while. What comes out is what decoding in place gives, and a bad distribution
    /// is named by its index.
    #[tokio::test(flavor = "current_thread")]
    async fn sampling_distributions_decode_off_the_async_threads() {
        let vocab = 151_936u32;
        let shuffled = |seed: u32| pb::Distribution {
            ids: (0..vocab).map(|i| (i * 7_919 + seed) % vocab).collect(),
            probs: (0..vocab).map(|i| 1.0 + (i % 13) as f32).collect(),
        };
        let raw: Vec<_> = (0..9).map(shuffled).collect();
        let want: Vec<_> = raw
            .iter()
            .map(|d| decode_distribution(d).unwrap())
            .collect();
        let (done, ticks) = (AtomicBool::new(false), AtomicUsize::new(0));
        let ticker = async {
            while !done.load(Ordering::Relaxed) {
                ticks.fetch_add(1, Ordering::Relaxed);
                tokio::task::yield_now().await;
            }
        };
        let decode = async {
            let got = decode_apart(raw.clone()).await;
            done.store(true, Ordering::Relaxed);
            got
        };
        let (got, ()) = tokio::join!(decode, ticker);
        assert_eq!(got.unwrap(), want);
        assert!(
            ticks.load(Ordering::Relaxed) > 1,
            "the async thread was held"
        );

        let mut bad = raw;
        bad[4].probs[17] = -1.0;
        let (at, why) = decode_apart(bad).await.unwrap_err();
        assert_eq!(at, 4);
        assert!(why.contains("-1"), "{why}");
    }
}
