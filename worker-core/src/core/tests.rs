use super::*;
use crate::model_thread::More;
use duet_engine::Model;
use duet_engine::logprobs::token_logprobs;
use duet_engine::testing::TinyModel;

/// Jobs that hold the model thread until their sender says go.
struct Holds;
type Hold = std::sync::mpsc::Receiver<()>;

impl Handler for Holds {
    type Job = Hold;
    fn run(&mut self, _: &Model, jobs: Vec<Self::Job>, _: More<'_, Self::Job>) {
        for job in jobs {
            let _ = job.recv();
        }
    }
}

/// A loaded core on a tiny model, its configuration adjusted by `adjust`, whose jobs
/// hold the model thread.
async fn core(
    adjust: impl FnOnce(&mut WorkerConfig),
) -> (tempfile::TempDir, Arc<WorkerCore<Hold>>) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    TinyModel::default().write(&path).unwrap();
    let mut config = WorkerConfig::with("127.0.0.1:0", "", &path.to_string_lossy());
    adjust(&mut config);
    let (core, ready) = WorkerCore::start(config, Holds, None);
    ready.await.unwrap().unwrap();
    (dir, core)
}

/// A model thread held in one step past `model_stall_timeout_ms` counts as stuck (what
/// readiness and liveness report), and stops counting once it moves again; an idle
/// thread is never stuck.
#[tokio::test]
async fn a_model_thread_held_in_one_step_is_stalled() {
    let (_dir, core) = core(|c| c.model_stall_timeout_ms = 50).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(core.model_stalled(), None, "idle is not stuck");
    let (go, held) = std::sync::mpsc::channel();
    core.submit(SessionKey(1), held).unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        core.model_stalled()
            .is_some_and(|busy| busy >= Duration::from_millis(50))
    );
    go.send(()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while core.model_stalled().is_some() {
        assert!(
            Instant::now() < deadline,
            "still stalled after the step ended"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A prompt prefilled 3 tokens at a time (the order of chunks and calls is
/// `model_thread`'s test): the session holds it all, its cache gives the same logits as
/// one prefilled in one pass, and it counts as one prefill.
#[tokio::test]
async fn a_prompt_prefilled_in_chunks_caches_the_same() {
    let prompt: Vec<u32> = (1..=11).collect();
    let open = |core: Arc<WorkerCore<Hold>>| {
        let prompt = prompt.clone();
        async move {
            let opened = core
                .open(open_request(&prompt, 40), tracing::Span::none())
                .await
                .unwrap();
            let session = core
                .session(&opened.session_id.0, opened.instance_id)
                .unwrap();
            let model = core.loaded.get().unwrap().model.clone();
            let mut s = session.lock().unwrap();
            let logits = model
                .forward(&mut s.cache, &[11], duet_engine::LogitsFor::Last)
                .unwrap();
            (opened.cache_len, logits)
        }
    };
    let (_whole_dir, whole) = core(|c| c.prefill_chunk_tokens = Some(0)).await;
    let (_dir, chunked) = core(|c| c.prefill_chunk_tokens = Some(3)).await;
    let (_, want) = open(whole).await;
    let (cache_len, logits) = open(chunked.clone()).await;
    assert_eq!(cache_len, prompt.len() - 1);
    assert_eq!(logits, want);
    assert!(
        chunked
            .render_metrics()
            .contains("duet_worker_forward_seconds_count{kind=\"prefill\"} 1"),
        "{}",
        chunked.render_metrics()
    );
}

/// A greedy open of `prompt`, every other field its default.
fn open_request(prompt: &[u32], capacity: usize) -> OpenRequest {
    OpenRequest {
        session_id: None,
        prompt: prompt.to_vec(),
        capacity,
        sampling: SamplingParams::greedy(),
        generated_after: 0,
        logprobs: None,
        penalties: Default::default(),
        prompt_logprobs: None,
        logit_bias: Default::default(),
        min_tokens: 0,
        format: None,
        cache_salt: 0,
        stop_token_ids: Vec::new(),
        priority: None,
        ask_for_room: false,
        adapter: None,
        adapter_if_loaded: false,
    }
}

async fn open_greedy(core: &WorkerCore<Hold>, prompt: &[u32], capacity: usize) -> Opened {
    let open = open_request(prompt, capacity);
    core.open(open, tracing::Span::none()).await.unwrap()
}

/// A scored open answers every prompt token's figures after the first, each from the
/// row before it as one pass over the whole prompt gives it, however the prefill is cut
/// and even where the prefix cache holds the prompt (its rows come without logits, so
/// the scored open takes none). Asking for more than 20 most likely tokens, or scoring a
/// taken-over sequence, is refused.
#[tokio::test]
async fn a_scored_prompt_answers_each_tokens_figures() {
    let prompt: Vec<u32> = (1..=11).map(|i| i * 7 % 50).collect();
    let (_dir, core) = core(|c| c.prefill_chunk_tokens = Some(3)).await;
    open_greedy(&core, &prompt, 40).await;
    let scored = |top: usize, generated_after: usize| OpenRequest {
        prompt_logprobs: Some(top),
        generated_after,
        ..open_request(&prompt, 40)
    };
    let opened = core
        .open(scored(2, 0), tracing::Span::none())
        .await
        .unwrap();
    assert_eq!((opened.cache_len, opened.cached_tokens), (10, 0));

    let model = core.loaded.get().unwrap().model.clone();
    let mut cache = model.new_cache(40).unwrap();
    let rows = model
        .prefill(&mut cache, &prompt, duet_engine::LogitsFor::All)
        .unwrap();
    let want: Vec<_> = (0..prompt.len() - 1)
        .map(|i| token_logprobs(rows.row(i), prompt[i + 1], 2).unwrap())
        .collect();
    assert_eq!(opened.prompt_logprobs, want);
    assert_eq!(want[0].top.len(), 2);

    let refused = |r: Result<Opened, WorkerError>| r.unwrap_err().to_string();
    let e = refused(core.open(scored(21, 0), tracing::Span::none()).await);
    assert_eq!(e, "prompt_logprobs: 21 is over 20");
    let e = refused(core.open(scored(0, 4), tracing::Span::none()).await);
    assert_eq!(
        e,
        "prompt_logprobs: a session taking over another's sequence has no prompt to score"
    );
}

/// Feeds `tokens` to an open session on the test's thread; the last row's logits.
fn feed(core: &WorkerCore<Hold>, opened: &Opened, tokens: &[u32]) -> duet_engine::Logits {
    let session = core
        .session(&opened.session_id.0, opened.instance_id)
        .unwrap();
    let model = core.loaded.get().unwrap().model.clone();
    let mut s = session.lock().unwrap();
    model
        .forward(&mut s.cache, tokens, duet_engine::LogitsFor::Last)
        .unwrap()
}

/// A second turn opens from the first turn's rows (its prompt and its text, after it
/// closed; a rejected draft rolled back), and a third request from an open session's
/// prompt: each copies the prefix it shares, prefills the rest, and then computes
/// bitwise what a worker without the cache computes. The closed cache counts in the
/// stats, and the metrics count the tokens looked up and found.
#[tokio::test]
async fn later_sessions_start_from_earlier_sessions_rows() {
    let first: Vec<u32> = (1..=70).collect();
    let text: Vec<u32> = (100..130).collect();
    let mut second = first.clone();
    second.extend(&text);
    second.extend(200..240);
    let (_d1, cached) = core(|_| {}).await;
    let (_d2, plain) = core(|c| c.prefix_cache_tokens = 0).await;

    let a = open_greedy(&cached, &first, 120).await;
    assert_eq!((a.cache_len, a.cached_tokens), (69, 0));
    feed(&cached, &a, &[first[69], text[0], 5, 6]);
    cached
        .session(&a.session_id.0, a.instance_id)
        .unwrap()
        .lock()
        .unwrap()
        .rewind(71, 0, 0)
        .unwrap();
    feed(&cached, &a, &text[1..]);
    assert!(cached.close(&a.session_id.0, a.instance_id));
    assert_eq!(cached.stats().sessions.prefix_cached_tokens, 120);

    let b = open_greedy(&cached, &second, 200).await;
    assert_eq!((b.cache_len, b.cached_tokens), (second.len() - 1, 100));
    let session = cached.session(&b.session_id.0, b.instance_id).unwrap();
    assert_eq!(session.lock().unwrap().prefilled, second.len() - 1);
    drop(session);
    let want = open_greedy(&plain, &second, 200).await;
    assert_eq!(want.cached_tokens, 0);
    let last = [*second.last().unwrap()];
    assert_eq!(feed(&cached, &b, &last), feed(&plain, &want, &last));

    // From the open second session's prompt (its rows past the prompt count too).
    let mut third = second[..90].to_vec();
    third.extend([7, 8, 9]);
    let c = open_greedy(&cached, &third, 100).await;
    assert_eq!(c.cached_tokens, 90);
    let want = open_greedy(&plain, &third, 100).await;
    assert_eq!(feed(&cached, &c, &[9]), feed(&plain, &want, &[9]));
    let metrics = cached.render_metrics();
    for line in [
        "duet_worker_prefix_cache_queried_tokens_total 300",
        "duet_worker_prefix_cache_hit_tokens_total 190",
    ] {
        assert!(metrics.contains(line), "{line}\n{metrics}");
    }
    // The second turn, closed, holds all the first did: the first's cache goes.
    assert!(cached.close(&b.session_id.0, b.instance_id));
    assert_eq!(cached.stats().sessions.prefix_cached_tokens, 200);
}

/// Two opens of one new prompt queued together: the second copies the first's rows,
/// offered as its prefill ends, before either open has answered.
#[tokio::test]
async fn an_open_queued_behind_the_same_prompt_copies_it() {
    let (_dir, core) = core(|_| {}).await;
    let prompt: Vec<u32> = (1..=80).collect();
    let (go, held) = std::sync::mpsc::channel();
    core.submit(SessionKey(1), held).unwrap();
    let opens: Vec<_> = (0..2)
        .map(|_| {
            let (core, prompt) = (core.clone(), prompt.clone());
            tokio::spawn(async move { open_greedy(&core, &prompt, 100).await })
        })
        .collect();
    while core.stats().sessions.reserved_tokens != 200 {
        tokio::task::yield_now().await;
    }
    go.send(()).unwrap();
    let mut cached = Vec::new();
    for open in opens {
        cached.push(open.await.unwrap().cached_tokens);
    }
    cached.sort();
    assert_eq!(cached, [0, 79]);
}

/// An OpenSession whose caller gives up while its prefill waits in the queue: the
/// session's KV tokens stay reserved as long as the queued prefill holds its memory, and
/// the model thread then drops it without running it.
#[tokio::test]
async fn a_cancelled_open_frees_its_budget_with_its_memory() {
    let (_dir, core) = core(|c| c.kv_token_budget = 100).await;
    let (go, held) = std::sync::mpsc::channel();
    core.submit(SessionKey(1), held).unwrap();
    let open = core.open(open_request(&[1, 2, 3], 40), tracing::Span::none());
    let gave_up = tokio::time::timeout(Duration::from_millis(50), open).await;
    assert!(gave_up.is_err(), "the prefill waits behind the held job");
    assert_eq!(core.stats().sessions.reserved_tokens, 40);
    go.send(()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while core.stats().sessions.reserved_tokens != 0 {
        assert!(
            Instant::now() < deadline,
            "the reservation was never released"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(core.stats().sessions.active, 0);
    assert!(
        !core
            .render_metrics()
            .contains("duet_worker_forward_seconds_count{kind=\"prefill\"} 1"),
        "the abandoned prefill ran"
    );
}

/// A session closed by its name while its prefill waits in the queue is not added when
/// the prefill ends: its open fails, and the tokens it reserved are free again.
#[tokio::test]
async fn a_session_closed_while_it_prefills_is_not_added() {
    let (_dir, core) = core(|c| c.kv_token_budget = 100).await;
    let (go, held) = std::sync::mpsc::channel();
    core.submit(SessionKey(1), held).unwrap();
    let id = SessionId([9; 16]);
    let open = tokio::spawn({
        let core = core.clone();
        async move {
            let open = OpenRequest {
                session_id: Some(id),
                ..open_request(&[1, 2, 3], 40)
            };
            core.open(open, tracing::Span::none()).await
        }
    });
    while core.stats().sessions.reserved_tokens != 40 {
        tokio::task::yield_now().await;
    }
    assert!(core.close(&id.0, 0));
    go.send(()).unwrap();
    let opened = open.await.unwrap();
    assert!(
        matches!(opened, Err(WorkerError::ClosedWhileOpening(i)) if i == id),
        "{opened:?}"
    );
    assert_eq!(core.stats().sessions.active, 0);
    assert_eq!(core.stats().sessions.reserved_tokens, 0);
}
