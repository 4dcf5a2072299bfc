//! The DraftWorker gRPC service: a Propose call off the wire is checked and queued; the
//! drafted tokens go back on the wire as they come. Errors map through the worker core's
//! one table (`duet_worker_core::status`).

use crate::worker::{Drafted, ProposeJob};
use duet_proto::v1 as pb;
use duet_proto::v1::draft_worker_server::{DraftWorker, DraftWorkerServer, SERVICE_NAME};
use duet_serving::grpc::MAX_MESSAGE_BYTES;
use duet_serving::telemetry::{server_span, set_error, traced};
use duet_serving::wire::encode_distribution;
use duet_worker_core::{CallTrace, SessionKey, WorkerCore, WorkerError, status, timing_to_wire};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status};
use tracing_opentelemetry::OpenTelemetrySpanExt;

#[derive(Debug, Clone)]
pub struct DraftService {
    core: Arc<WorkerCore<ProposeJob>>,
}

impl DraftService {
    pub fn server(core: Arc<WorkerCore<ProposeJob>>) -> DraftWorkerServer<Self> {
        DraftWorkerServer::new(Self { core })
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES)
    }

    /// Checks a Propose and queues it for the model thread; tokens arrive on the receiver.
    fn start_propose(
        &self,
        req: pb::ProposeRequest,
        span: tracing::Span,
    ) -> Result<mpsc::Receiver<Result<Drafted, WorkerError>>, WorkerError> {
        let max = duet_proto::MAX_DRAFT_TOKENS;
        let k = req.k as usize;
        if k == 0 || k > max {
            return Err(WorkerError::invalid(
                "k",
                format!("{k} is not in 1..={max}"),
            ));
        }
        let stop_below = req.stop_below;
        if !(0.0..=1.0).contains(&stop_below) {
            return Err(WorkerError::invalid(
                "stop_below",
                format!("{stop_below} is not in 0..=1"),
            ));
        }
        let above = req.alternatives_above;
        if !(0.0..=1.0).contains(&above) {
            let why = format!("{above} is not in 0..=1");
            return Err(WorkerError::invalid("alternatives_above", why));
        }
        let most = duet_proto::MAX_ALTERNATIVES;
        if req.max_alternatives as usize > most {
            let why = format!("{} is more than {most}", req.max_alternatives);
            return Err(WorkerError::invalid("max_alternatives", why));
        }
        self.core.check_tokens("append", &req.append)?;
        let limit = duet_proto::MAX_PROPOSE_APPEND;
        if req.append.len() > limit {
            return Err(WorkerError::invalid(
                "append",
                format!("{} tokens; at most {limit} a call", req.append.len()),
            ));
        }
        let session = self.core.session(&req.session_id, req.instance_id)?;
        let (out, rx) = mpsc::channel(k);
        self.core.submit(
            SessionKey::of(&session),
            ProposeJob {
                session,
                keep: req.keep as usize,
                append: req.append,
                k,
                stop_below,
                alternatives: match above > 0.0 {
                    true => (above, req.max_alternatives as usize),
                    false => (0.0, 0),
                },
                out,
                enqueued: Instant::now(),
                trace: CallTrace::queued(span),
            },
        )?;
        Ok(rx)
    }
}

type ProposeStream = Pin<Box<dyn Stream<Item = Result<pb::ProposeResponse, Status>> + Send>>;

/// A call's drafted tokens, ending with the last one (the one with the timings) or an error,
/// not when the model thread lets go of the channel a moment later: the stream's end then
/// leaves with its last token instead of waking the caller once more on its own.
fn through_last(
    rx: mpsc::Receiver<Result<Drafted, WorkerError>>,
) -> impl Stream<Item = Result<Drafted, WorkerError>> {
    futures::stream::unfold(Some(rx), |rx| async move {
        let mut rx = rx?;
        let drafted = rx.recv().await?;
        let last = drafted.as_ref().map_or(true, |d| d.timing.is_some());
        Some((drafted, (!last).then_some(rx)))
    })
}

#[tonic::async_trait]
impl DraftWorker for DraftService {
    type ProposeStream = ProposeStream;

    async fn propose(
        &self,
        request: Request<pb::ProposeRequest>,
    ) -> Result<Response<ProposeStream>, Status> {
        let span = server_span(&request, SERVICE_NAME, "Propose");
        let req = request.into_inner();
        span.set_attribute("duet.session_id", duet_serving::wire::hex(&req.session_id));
        span.set_attribute("duet.keep", req.keep as i64);
        span.set_attribute("duet.append_tokens", req.append.len() as i64);
        span.set_attribute("duet.k", req.k as i64);
        if req.stop_below > 0.0 {
            span.set_attribute("duet.stop_below", f64::from(req.stop_below));
        }
        let vocab = self.core.describe().map(|d| d.vocab_size);
        let started = vocab.and_then(|vocab| Ok((vocab, self.start_propose(req, span.clone())?)));
        traced(span.clone(), async move {
            let (vocab, rx) = started?;
            let stream = through_last(rx).map(move |drafted| match drafted {
                Ok(d) => Ok(pb::ProposeResponse {
                    token: d.token,
                    q: d.q.map(|q| encode_distribution(&q, vocab)),
                    timing: d.timing.map(timing_to_wire),
                    alternatives: d.alternatives,
                }),
                Err(e) => {
                    let s = status(&e);
                    set_error(&span, &s);
                    Err(s)
                }
            });
            Ok(Response::new(Box::pin(stream) as ProposeStream))
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use duet_worker_core::Timing;
    use std::time::Duration;

    fn drafted(token: u32, last: bool) -> Result<Drafted, WorkerError> {
        Ok(Drafted {
            token,
            q: None,
            timing: last.then(Timing::default),
            alternatives: Vec::new(),
        })
    }

    async fn tokens(rx: mpsc::Receiver<Result<Drafted, WorkerError>>) -> Vec<Option<u32>> {
        let stream = through_last(rx).map(|d| d.ok().map(|d| d.token));
        let all = tokio::time::timeout(Duration::from_secs(1), stream.collect());
        all.await.expect("the stream did not end")
    }

    /// The model thread still holds the channel: the stream ends with the token that carries
    /// the timings (or with an error), not when the channel closes.
    #[tokio::test(start_paused = true)]
    async fn a_propose_stream_ends_with_its_last_token() {
        let (tx, rx) = mpsc::channel(4);
        for (token, last) in [(5, false), (6, true), (7, false)] {
            tx.send(drafted(token, last)).await.unwrap();
        }
        assert_eq!(tokens(rx).await, [Some(5), Some(6)]);

        let (tx, rx) = mpsc::channel(4);
        tx.send(drafted(5, false)).await.unwrap();
        tx.send(Err(WorkerError::Dropped)).await.unwrap();
        tx.send(drafted(6, true)).await.unwrap();
        assert_eq!(tokens(rx).await, [Some(5), None]);
        drop(tx);
    }
}
