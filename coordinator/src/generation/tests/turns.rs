//! Taking turns (`speculation.take_turns`) through fake workers whose calls take time:
//! concurrent requests' draft and target calls never run at once (without it they overlap),
//! the text stays the target's, and a call's wait for its turn counts as queueing.

use super::*;
use crate::workers::{Propose, TakeTurns};

fn context_on(workers: &Arc<TakeTurns<FakeWorkers>>) -> Context<TakeTurns<FakeWorkers>> {
    Context {
        workers: workers.clone(),
        models: crate::generation::fakes::models(),
        speculation: Arc::new(crate::CoordinatorConfig::default().speculation),
        shared: Arc::default(),
        metrics: Arc::default(),
        stopping: Shutdown::new(),
        stall_timeout: Duration::from_secs(30),
        max_failovers: 2,
        lease: Lease::default(),
        room: Arc::new(crate::room::RoomQueue::new(
            Duration::from_secs(30),
            Default::default(),
            true,
        )),
        proposals: None,
    }
}

#[tokio::test(start_paused = true)]
async fn the_draft_and_the_target_never_run_at_once() {
    let script = Script {
        verify_time: Duration::from_millis(40),
        propose_time: Duration::from_millis(30),
        draft_open: Duration::from_millis(20),
        wrong_at: Some(2),
        ..Script::default()
    };
    for take_turns in [true, false] {
        let workers = Arc::new(TakeTurns::new(
            FakeWorkers::owned(script.clone()),
            take_turns.then_some(Duration::from_secs(10)),
        ));
        // Arriving 7 ms apart, so that their rounds interleave; the last two stream their
        // target-only tokens (NONE), which must end where a draft call waits.
        let runs = futures::future::join_all((0..6).map(|i| {
            let method = if i < 4 {
                Method::DRAFT_MODEL
            } else {
                Method::NONE
            };
            let mut req = request(method, 4, 30);
            req.prompt = vec![5, 17, 42, i];
            let ctx = context_on(&workers);
            async move {
                tokio::time::sleep(Duration::from_millis(7 * u64::from(i))).await;
                run_with(ctx, req).await
            }
        }))
        .await;
        for (i, r) in (0..).zip(&runs) {
            assert_eq!(r.result, Ok(()));
            assert_eq!(r.tokens, target_only(&[5, 17, 42, i], 30));
        }
        let fake = &workers.inner;
        let overlaps = (
            fake.proposes_while_verifying(),
            fake.verifies_while_proposing(),
            fake.verifies_while_draft_opens(),
        );
        if take_turns {
            assert_eq!(overlaps, (0, 0, 0));
            // Each stream was cut short at least once, dropping the step in flight.
            assert!(fake.decodes().len() > 2, "{:?}", fake.decodes());
            assert!(fake.steps_dropped() > 0);
        } else {
            assert!(
                overlaps.0 > 0 && overlaps.1 > 0 && overlaps.2 > 0,
                "{overlaps:?}"
            );
        }
    }
}

#[tokio::test(start_paused = true)]
async fn the_wait_for_a_turn_counts_as_queueing() {
    let workers = TakeTurns::new(
        FakeWorkers::owned(Script {
            propose_time: Duration::from_millis(30),
            ..Script::default()
        }),
        Some(Duration::from_secs(10)),
    );
    let sampling = SamplingParams::greedy();
    let lease = Lease::default();
    let open = Open::plain(&[5, 17, 42, 7], 64, &sampling, &lease);
    let (target, ..) = workers.open_target(open).await.unwrap();
    let (draft, _) = workers.open_draft(open).await.unwrap();
    let propose = Propose {
        keep: 3,
        append: &[7],
        k: 2,
        stop_below: 0.0,
        alternatives: (0.0, 0),
    };
    let verify = Verify {
        keep: 3,
        append: &[7],
        drafts: &[],
        parents: &[],
        test: None,
    };
    // The Propose takes the draft's turn first; the Verify waits for it to end.
    let (proposal, verified) = tokio::join!(workers.propose(&draft, propose), async {
        tokio::task::yield_now().await;
        workers.verify(&target, verify).await
    });
    assert_eq!(proposal.unwrap().timing.queue, Duration::ZERO);
    assert_eq!(verified.unwrap().timing.queue, Duration::from_millis(30));
}
