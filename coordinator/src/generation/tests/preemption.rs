//! Preemption through fake workers with room for one target session: a request of a lower
//! priority number waiting for room takes it from a running one (of its coordinator, or
//! through the worker of another's), which goes on afterwards from its committed tokens
//! with the target's own text; requests of one priority never take each other's room; a
//! drain ends a request waiting to go on.

use super::*;

/// A target with room for one session, whose passes take 10 ms.
fn one_session_room() -> Arc<FakeWorkers> {
    FakeWorkers::new(Script {
        target_room: Some(1),
        verify_time: Duration::from_millis(10),
        ..Script::default()
    })
}

/// A request of `priority` with its own prompt (starting with `first`), `max_tokens` long.
fn of_priority(method: Method, first: u32, priority: i32, max_tokens: usize) -> ValidRequest {
    let mut req = request(method, 3, max_tokens);
    req.prompt = vec![first, 17, 42, 7];
    req.priority = priority;
    req
}

/// Runs `req` on `ctx` from `after` ms on: its run, and when it ended.
async fn run_at<W: Workers>(
    ctx: Context<W>,
    req: ValidRequest,
    after: u64,
) -> (Run, tokio::time::Instant) {
    tokio::time::sleep(Duration::from_millis(after)).await;
    let run = run_with(ctx, req).await;
    (run, tokio::time::Instant::now())
}

/// `context(workers, false)` sharing `first`'s room line (one coordinator's requests).
fn beside(first: &Context<FakeWorkers>, workers: &Arc<FakeWorkers>) -> Context<FakeWorkers> {
    Context {
        room: first.room.clone(),
        ..context(workers, false)
    }
}

/// On one coordinator the waiting request asks the running one itself; from another, the
/// worker that refuses its open asks the running one's session, whose next answer says so.
#[tokio::test(start_paused = true)]
async fn a_running_request_gives_its_room_up_to_a_lower_priority_and_goes_on_unchanged() {
    let methods = [Method::NONE, Method::DRAFT_MODEL, Method::Auto];
    for (method, one_coordinator) in methods.into_iter().flat_map(|m| [(m, true), (m, false)]) {
        let workers = one_session_room();
        let low_ctx = context(&workers, false);
        let high_ctx = match one_coordinator {
            true => beside(&low_ctx, &workers),
            false => context(&workers, false),
        };
        let metrics = low_ctx.metrics.clone();
        let low = of_priority(method, 5, 5, 60);
        let high = of_priority(Method::NONE, 6, 0, 8);
        let (low_prompt, high_prompt) = (low.prompt.clone(), high.prompt.clone());
        let ((low, low_ended), (high, high_ended)) =
            tokio::join!(run_at(low_ctx, low, 0), run_at(high_ctx, high, 55));
        assert_eq!(
            (&low.result, &high.result),
            (&Ok(()), &Ok(())),
            "{method:?} {one_coordinator}"
        );
        assert_eq!(
            low.tokens,
            target_only(&low_prompt, 60),
            "{method:?} {one_coordinator}"
        );
        assert_eq!(
            high.tokens,
            target_only(&high_prompt, 8),
            "{method:?} {one_coordinator}"
        );
        assert!(high_ended < low_ended, "{method:?} {one_coordinator}");
        // The low one gave its session up once, and its new session took the committed
        // tokens as generated ones.
        let at = usage(&low).preempted_at.clone();
        assert_eq!(at.len(), 1, "{method:?} {one_coordinator}");
        assert!(
            (1..60).contains(&at[0]),
            "{method:?} {one_coordinator}: {at:?}"
        );
        let opens = [(4, 0), (4, 0), (4 + at[0], 4)];
        assert_eq!(
            workers.target_opens(),
            opens,
            "{method:?} {one_coordinator}"
        );
        assert_eq!(workers.target_closes(), 1, "{method:?} {one_coordinator}");
        assert_eq!(
            usage(&high).preempted_at,
            Vec::<usize>::new(),
            "{method:?} {one_coordinator}"
        );
        assert_eq!(metrics.preemptions.get(), 1, "{method:?} {one_coordinator}");
        assert_eq!(workers.open_sessions(), 0, "{method:?} {one_coordinator}");
    }
}

/// Of one priority, the later request waits for the earlier to end.
#[tokio::test(start_paused = true)]
async fn a_request_of_the_same_priority_waits_for_the_room() {
    let workers = one_session_room();
    let first_ctx = context(&workers, false);
    let second_ctx = beside(&first_ctx, &workers);
    let first = of_priority(Method::NONE, 5, 3, 20);
    let second = of_priority(Method::NONE, 6, 3, 8);
    let started = tokio::time::Instant::now();
    let ((first, first_ended), (second, _)) =
        tokio::join!(run_at(first_ctx, first, 0), run_at(second_ctx, second, 55));
    assert_eq!((&first.result, &second.result), (&Ok(()), &Ok(())));
    assert_eq!(usage(&first).preempted_at, Vec::<usize>::new());
    assert_eq!(workers.target_closes(), 0);
    // It waited for the room from 55 ms until the first ended (20 steps of 10 ms).
    let first_ms = (first_ended - started).as_millis() as f64;
    assert_eq!(first_ms, 200.0);
    let waited = usage(&second).timings.admission_wait;
    assert!(waited >= first_ms - 55.0, "waited {waited} ms");
}

/// A request that gave its room up and waits to go on ends as `cancelled` when the drain
/// deadline passes, with the tokens it had.
#[tokio::test(start_paused = true)]
async fn a_drain_ends_a_request_waiting_to_go_on() {
    let workers = one_session_room();
    let low_ctx = context(&workers, false);
    let (stopping, high_ctx) = (low_ctx.stopping.clone(), beside(&low_ctx, &workers));
    let low = of_priority(Method::NONE, 5, 5, 60);
    // The high one holds the room past the drain.
    let high = of_priority(Method::NONE, 6, 0, 60);
    let low_prompt = low.prompt.clone();
    let drain = async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        stopping.trigger();
    };
    let ((low, _), _, _) = tokio::join!(run_at(low_ctx, low, 0), run_at(high_ctx, high, 55), drain);
    let finished = low.finished.expect("a final message");
    assert_eq!(finished.reason, FinishReason::Cancelled);
    let at = finished.usage.preempted_at[0];
    assert_eq!(low.tokens, target_only(&low_prompt, at));
    assert_eq!(finished.usage.completion_tokens, at);
}

/// A running request whose caller has stopped reading (its stream full) gives its room up
/// as soon as it is asked, not once the caller reads again (nor at `stall_timeout`): the
/// waiting request runs meanwhile, and the first, read again, goes on from its committed
/// tokens with the target's own text.
#[tokio::test(start_paused = true)]
async fn a_request_whose_caller_stopped_reading_gives_its_room_up_at_once() {
    let workers = one_session_room();
    let low_ctx = context(&workers, false);
    let high_ctx = beside(&low_ctx, &workers);
    let low = of_priority(Method::NONE, 5, 5, 60);
    let low_prompt = low.prompt.clone();
    let (tx, mut rx) = mpsc::channel(1);
    let started = tokio::time::Instant::now();
    let low = tokio::spawn(async move { generate(low_ctx, low, Arrival::now(), &tx).await });
    let mut tokens = match rx.recv().await {
        Some(Event::Chunk(c)) => c.tokens,
        other => panic!("{other:?}"),
    };
    // Its caller reads nothing more while the urgent request runs.
    let high = of_priority(Method::NONE, 6, 0, 8);
    let high_prompt = high.prompt.clone();
    let (high, high_ended) = run_at(high_ctx, high, 55).await;
    assert_eq!(high.result, Ok(()));
    assert_eq!(high.tokens, target_only(&high_prompt, 8));
    // 55 ms, the low one's close, then 8 steps of 10 ms.
    let ran = (high_ended - started).as_millis();
    assert!(
        (135..300).contains(&ran),
        "the urgent request ended at {ran} ms"
    );
    let mut finished = None;
    while let Some(event) = rx.recv().await {
        match event {
            Event::Chunk(c) => tokens.extend(c.tokens),
            Event::Finished(f) => finished = Some(f),
        }
    }
    assert_eq!(low.await.unwrap(), Ok(()));
    assert_eq!(tokens, target_only(&low_prompt, 60));
    let at = finished.expect("a final message").usage.preempted_at;
    assert_eq!(at.len(), 1);
    assert_eq!(workers.target_closes(), 1);
    assert_eq!(workers.open_sessions(), 0);
}
