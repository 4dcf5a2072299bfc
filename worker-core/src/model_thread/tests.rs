use super::*;
use duet_engine::testing::TinyModel;
use duet_engine::{AttentionKernel, LoadOptions};

type W = Waiting<&'static str, u32>;

/// Several calls with whole rows of logits read side by side; one call, or none, here.
/// (Greedy summaries, which only a GPU gives, are read here however many calls.)
#[test]
fn only_several_calls_with_whole_rows_are_read_side_by_side() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    TinyModel::default().write(&path).unwrap();
    let model = Model::load(&path, &LoadOptions::default()).unwrap();
    let mut cache = model.new_cache(8).unwrap();
    let row = model.forward(&mut cache, &[1, 2], LogitsFor::Last).unwrap();
    assert!(!row.summarized());
    assert!(!read_side_by_side(&[]));
    assert!(!read_side_by_side(std::slice::from_ref(&row)));
    assert!(read_side_by_side(&[row.clone(), row]));
}

/// A session that takes over a lost one's sequence, ingested in chunks as the model
/// thread cuts them (`Thread::chunk`: the chunk's split at `generated_from`), holds the
/// lost one's tokens and rows: its prompt prefilled, what it generated fed as calls, a
/// chunk crossing from one to the other split there. (On a CPU a prefill's rows are a
/// call's, `kv_rows_invariant`, even with candle's portable attention on the tiny model;
/// where they are not, on a GPU, the services' failover test checks the text.)
#[test]
fn a_taken_over_sequence_is_ingested_as_the_lost_session_held_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    TinyModel::default().write(&path).unwrap();
    let model = Model::load(&path, &LoadOptions::default())
        .unwrap()
        .with_attention_kernel(AttentionKernel::Tensor)
        .unwrap();
    let prompt: Vec<u32> = (1..=20).collect();
    let generated: Vec<u32> = (30..42).collect();
    let seq: Vec<u32> = prompt.iter().chain(&generated).copied().collect();
    // The lost session: its prompt but the last token prefilled, then calls of three.
    let mut lost = model.new_cache(64).unwrap();
    model
        .prefill(&mut lost, &prompt[..19], LogitsFor::None)
        .unwrap();
    for call in seq[19..].chunks(3) {
        model.forward(&mut lost, call, LogitsFor::None).unwrap();
    }
    let next = |cache: &mut KvCache| model.forward(cache, &[7], LogitsFor::Last).unwrap();
    let want = next(&mut lost);
    let generated_from = prompt.len() - 1;
    let mut taken = model.new_cache(64).unwrap();
    for from in (0..seq.len()).step_by(8) {
        let to = (from + 8).min(seq.len());
        ingest(&model, &mut taken, &seq[from..to], from, generated_from).unwrap();
    }
    assert_eq!(taken.tokens(), &seq[..]);
    assert_eq!(next(&mut taken), want);
}

/// A call of session `i` whose job is `i`.
fn own(i: u32) -> Work<&'static str, u32> {
    Work::Own(Call {
        job: i,
        session: SessionKey(i as usize),
        queued: Instant::now(),
    })
}

fn waiting(work: Vec<Work<&'static str, u32>>) -> W {
    let mut w = W::default();
    for x in work {
        w.push(x);
    }
    w
}

/// `Next` with the calls' jobs only.
#[derive(Debug, PartialEq)]
enum Step {
    Calls(Vec<u32>),
    Prefill(&'static str),
    Idle,
}

/// The next step, taken as run: a run of calls or a prefill chunk of 10 ms each.
fn next(w: &mut W, max_batch: usize) -> Step {
    next_timed(w, max_batch, 10, 10)
}

/// The next step, a run of calls taking `calls_ms` and a prefill chunk `prefill_ms`.
fn next_timed(w: &mut W, max_batch: usize, calls_ms: u64, prefill_ms: u64) -> Step {
    match w.next(max_batch) {
        Next::Calls(c) => {
            w.ran_calls(Duration::from_millis(calls_ms));
            Step::Calls(c.into_iter().map(|c| c.job).collect())
        }
        Next::Prefill(p) => {
            w.ran_prefill(Duration::from_millis(prefill_ms));
            Step::Prefill(p)
        }
        Next::Idle => Step::Idle,
    }
}

fn timer() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap()
}

/// Sessions 1 and 2 have called and been answered twice (their return gaps known, so
/// both are due), and 1 has called again.
fn one_of_two_back(window: Duration) -> W {
    let mut w = W::new(window);
    w.answered(vec![SessionKey(1), SessionKey(2)]);
    w.push(own(1));
    w.push(own(2));
    assert_eq!(next(&mut w, 4), Step::Calls(vec![1, 2]));
    w.answered(vec![SessionKey(1), SessionKey(2)]);
    w.push(own(1));
    w
}

fn admit(w: &mut W, running: usize, max_batch: usize) -> Vec<u32> {
    w.admit(running, max_batch)
        .into_iter()
        .map(|c| c.job)
        .collect()
}

/// Calls run before the prefills queued ahead of them, then runs of calls and prefill
/// chunks take turns while both wait.
#[test]
fn calls_run_before_prefills_queued_ahead_of_them() {
    use Work::Prefill;
    let mut w = waiting(vec![Prefill("a"), own(1), Prefill("b"), own(2), own(3)]);
    assert_eq!(next(&mut w, 2), Step::Calls(vec![1, 2]));
    assert_eq!(next(&mut w, 2), Step::Prefill("a"));
    assert_eq!(next(&mut w, 2), Step::Calls(vec![3]));
    w.push(own(4));
    assert_eq!(next(&mut w, 2), Step::Prefill("b"));
    assert_eq!(next(&mut w, 2), Step::Calls(vec![4]));
    assert_eq!(next(&mut w, 2), Step::Idle);
    assert!(w.is_empty());
}

/// Prefill chunks shorter than a run of calls (prompts mostly cached) run back to back
/// for as long as the run took, then the calls again: a burst of new requests gets its
/// first tokens without a run of calls between each two prefills.
#[test]
fn short_prefills_run_for_as_long_as_a_run_of_calls_took() {
    use Work::Prefill;
    let mut w = waiting(vec![own(1), Prefill("a"), Prefill("b"), Prefill("c")]);
    w.push(Prefill("d"));
    let mut steps = Vec::new();
    for _ in 0..4 {
        steps.push(next_timed(&mut w, 4, 40, 15));
        w.push(own(1));
    }
    assert_eq!(
        steps,
        [
            Step::Calls(vec![1]),
            Step::Prefill("a"),
            Step::Prefill("b"),
            Step::Prefill("c"),
        ]
    );
    // 45 ms of prefill after a 40 ms run: the calls go next, then "d".
    assert_eq!(next_timed(&mut w, 4, 40, 15), Step::Calls(vec![1, 1, 1, 1]));
    assert_eq!(next_timed(&mut w, 4, 40, 15), Step::Prefill("d"));
}

/// Streams that queue their next step as soon as one answers (Decode calls) never leave
/// the queue without calls: a prefill still runs after one run of them, and the run
/// before it does not wait for streams due back.
#[test]
fn a_prefill_runs_between_runs_of_calls_that_never_stop_coming() {
    let (_tx, mut rx) = mpsc::channel(8);
    let mut w = one_of_two_back(Duration::from_secs(30));
    w.push(Work::Prefill("a"));
    // Session 2 is due back, but the prefill goes first: no wait for it.
    assert_eq!(w.gather(&mut rx, &timer(), 4), Duration::ZERO);
    assert_eq!(next(&mut w, 4), Step::Prefill("a"));
    assert_eq!(next(&mut w, 4), Step::Calls(vec![1]));
}

/// A prefill with chunks left goes on before the prefills queued after it, once the
/// calls that came meanwhile have run.
#[test]
fn a_chunked_prefill_resumes_after_the_calls_that_came_meanwhile() {
    use Work::Prefill;
    let mut w = waiting(vec![Prefill("a"), Prefill("b")]);
    assert_eq!(next(&mut w, 4), Step::Prefill("a"));
    w.resume("a");
    w.push(own(1));
    assert_eq!(next(&mut w, 4), Step::Calls(vec![1]));
    assert_eq!(next(&mut w, 4), Step::Prefill("a"));
    assert_eq!(next(&mut w, 4), Step::Prefill("b"));
    assert_eq!(next(&mut w, 4), Step::Idle);
}

#[test]
fn a_run_admits_calls_up_to_the_batch_until_a_prefill_waits() {
    let mut w = waiting(vec![own(1), own(2), own(3)]);
    assert_eq!(admit(&mut w, 2, 4), vec![1, 2]);
    assert_eq!(admit(&mut w, 4, 4), Vec::<u32>::new());
    w.push(Work::Prefill("a"));
    // The run drains; the prefill goes next, then the call that waited.
    assert_eq!(admit(&mut w, 0, 4), Vec::<u32>::new());
    assert_eq!(next(&mut w, 4), Step::Calls(vec![3]));
    assert_eq!(next(&mut w, 4), Step::Prefill("a"));
}

/// While calls come and go (busy polling) the model thread takes its work off the queue
/// without sleeping, and a closed queue ends it; once they stop it waits as before.
#[tokio::test]
async fn the_queue_is_polled_while_calls_come_and_go() {
    let busy = BusyPoll::start(1, Duration::from_secs(30));
    busy.touch();
    let (tx, mut rx) = mpsc::channel(4);
    let polled = busy.clone();
    let taker = std::thread::spawn(move || {
        let taken = [(); 3].map(|()| next_work(&mut rx, Some(&polled)));
        (taken, polled.recent())
    });
    for work in [1, 2] {
        tx.send(work).await.unwrap();
    }
    drop(tx);
    let (taken, polling) = taker.join().unwrap();
    assert_eq!((taken, polling), ([Some(1), Some(2), None], true));

    let quiet = BusyPoll::start(1, Duration::from_secs(30));
    let (tx, mut rx) = mpsc::channel(4);
    let taker = std::thread::spawn(move || next_work(&mut rx, Some(&quiet)));
    tx.send(3).await.unwrap();
    assert_eq!(taker.join().unwrap(), Some(3), "waited for");
}

#[test]
fn taking_from_the_queue_stops_at_its_capacity() {
    let (tx, mut rx) = mpsc::channel(3);
    let mut w = W::default();
    for i in 0..3 {
        tx.try_send(own(i)).unwrap();
    }
    w.take(&mut rx);
    for i in 3..6 {
        tx.try_send(own(i)).unwrap();
    }
    w.take(&mut rx);
    assert_eq!(next(&mut w, 10), Step::Calls(vec![0, 1, 2]));
    w.take(&mut rx);
    assert_eq!(next(&mut w, 10), Step::Calls(vec![3, 4, 5]));
}

/// Sessions 1 and 2 were answered together and came back quickly before; 1 is back: the
/// run waits for 2, which comes from another thread, and then starts with both. Without
/// 2's call the wait ends when the window closes; at `max_batch` there is no wait.
#[test]
fn a_run_waits_for_the_streams_due_back() {
    let timer = timer();
    let window = Duration::from_secs(30);
    let (tx, mut rx) = mpsc::channel(8);
    let mut w = one_of_two_back(window);
    let sender = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(20));
        tx.try_send(own(2)).unwrap();
        tx
    });
    let waited = w.gather(&mut rx, &timer, 4);
    assert!(waited >= Duration::from_millis(20), "{waited:?}");
    assert!(waited < window, "{waited:?}");
    assert_eq!(next(&mut w, 4), Step::Calls(vec![1, 2]));
    let tx = sender.join().unwrap();

    // Both due again; only 1 comes back, and the window is short.
    let mut w = W::new(Duration::from_millis(30));
    for _ in 0..2 {
        w.answered(vec![SessionKey(1), SessionKey(2)]);
        w.push(own(1));
        w.push(own(2));
        next(&mut w, 4);
    }
    w.answered(vec![SessionKey(1), SessionKey(2)]);
    w.push(own(1));
    let waited = w.gather(&mut rx, &timer, 4);
    assert!(waited >= Duration::from_millis(25), "{waited:?}");
    assert_eq!(next(&mut w, 4), Step::Calls(vec![1]));
    // 2 is not due any more (its window closed): no wait; nor with a full batch.
    w.answered(vec![SessionKey(1)]);
    w.push(own(1));
    assert_eq!(w.gather(&mut rx, &timer, 4), Duration::ZERO);
    assert_eq!(w.gather(&mut rx, &timer, 1), Duration::ZERO);
    drop(tx);
}
