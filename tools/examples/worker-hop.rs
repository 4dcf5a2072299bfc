//! Where a worker call's time goes outside the worker's own pass: the same empty call
//! (Stats) back to back and after the services sat idle for a while, and the worker's one-token
//! call (a Propose of one draft, or a Verify without drafts) less the queue and pass times the
//! worker reports. Run against a worker on its own (scripts/run-local starts them):
//!
//!   cargo run --release --example worker-hop -p duet-tools -- http://127.0.0.1:50062 [MS]
//!
//! With MS the caller's async threads poll for that long around each call instead
//! of sleeping, as a coordinator's do with `runtime.busy_poll_ms` while it serves requests.

use anyhow::Context;
use duet_proto::v1 as pb;
use duet_proto::v1::draft_worker_client::DraftWorkerClient;
use duet_proto::v1::target_worker_client::TargetWorkerClient;
use duet_proto::v1::worker_client::WorkerClient;
use std::time::{Duration, Instant};
use tonic::transport::Channel;

/// Calls per figure; the first few of a model call's are left out (warming up).
const CALLS: u32 = 100;
const WARM_UP: u32 = 10;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let addr = std::env::args()
        .nth(1)
        .context("usage: worker-hop WORKER_ADDRESS [BUSY_POLL_MS]")?;
    let busy_poll_ms = std::env::args().nth(2).map(|ms| ms.parse()).transpose()?;
    let runtime = duet_serving::startup::RuntimeConfig {
        busy_poll_ms: busy_poll_ms.unwrap_or(0),
        ..Default::default()
    };
    let busy = runtime.start_busy_poll();
    let touch = || busy.iter().for_each(|b| b.touch());
    println!("worker at {addr}, busy polling {}", runtime.busy_poll_ms);
    let channel = Channel::from_shared(addr)?.connect().await?;
    let mut worker = WorkerClient::new(channel.clone());
    for idle_ms in [0, 1, 5, 15] {
        let mut spent = Duration::ZERO;
        for _ in 0..CALLS {
            tokio::time::sleep(Duration::from_millis(idle_ms)).await;
            let start = Instant::now();
            touch();
            worker.stats(pb::StatsRequest {}).await?;
            touch();
            spent += start.elapsed();
        }
        println!(
            "Stats after {idle_ms:>2} ms idle: {:.3} ms",
            ms(spent / CALLS)
        );
    }
    let open = pb::OpenSessionRequest {
        prompt: (100..140).collect(),
        capacity: 64,
        ..Default::default()
    };
    let session = worker.open_session(open).await?.into_inner();
    let (mut call, mut worker_side) = (Duration::ZERO, Duration::ZERO);
    for i in 0..CALLS + WARM_UP {
        let start = Instant::now();
        touch();
        let timing = one_token(&channel, &session).await?.unwrap_or_default();
        touch();
        if i >= WARM_UP {
            call += start.elapsed();
            worker_side += Duration::from_micros(timing.queue_us + timing.forward_us);
        }
    }
    let (call, worker_side) = (call / CALLS, worker_side / CALLS);
    println!(
        "one-token call: {:.3} ms, the worker's queue and pass {:.3} ms, outside them {:.3} ms",
        ms(call),
        ms(worker_side),
        ms(call.saturating_sub(worker_side))
    );
    Ok(())
}

/// One token on the session, the cache left as it was: a Propose of one draft on a
/// draft-worker, else a Verify without drafts.
async fn one_token(
    channel: &Channel,
    session: &pb::OpenSessionResponse,
) -> anyhow::Result<Option<pb::Timing>> {
    let (id, instance, keep) = (&session.session_id, session.instance_id, session.cache_len);
    let propose = pb::ProposeRequest {
        session_id: id.clone(),
        instance_id: instance,
        keep,
        append: vec![139],
        k: 1,
        ..Default::default()
    };
    match DraftWorkerClient::new(channel.clone())
        .propose(propose)
        .await
    {
        Ok(stream) => {
            let mut stream = stream.into_inner();
            let mut timing = None;
            while let Some(m) = stream.message().await? {
                timing = m.timing;
            }
            Ok(timing)
        }
        Err(s) if s.code() == tonic::Code::Unimplemented => {
            let verify = pb::VerifyRequest {
                session_id: id.clone(),
                instance_id: instance,
                keep,
                append: vec![139],
                ..Default::default()
            };
            let mut target = TargetWorkerClient::new(channel.clone());
            Ok(target.verify(verify).await?.into_inner().timing)
        }
        Err(s) => Err(s.into()),
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
