//! Shared passes, room and the wait queue, priorities, replicas and routing, the prefix and
//! proposal caches.

use super::*;

/// A burst of long prompts, every one prefilled in chunks of 8 tokens on both workers (no
/// prefix cache to skip them), while the others' Verify and Propose calls run between the
/// chunks: every stream says what it said alone, and no session is left open.
#[tokio::test]
async fn a_burst_of_long_prompts_prefilled_in_chunks_says_what_each_says_alone() {
    let m = tiny_models();
    let [mut draft, mut target] = [&m.draft, &m.target].map(|model| worker_config(model));
    for c in [&mut draft, &mut target] {
        (c.prefill_chunk_tokens, c.prefix_cache_tokens) = (Some(8), 0);
    }
    let stack = Stack::start_with(draft, target);
    wait_stack(&stack).await;
    let url = stack.coordinator.url();
    let body = "def f(x): return x + 1 # the cat sat\n".repeat(4);
    let prompts: Vec<String> = (0..5).map(|i| format!("{i}: {body}")).collect();
    let mut expected = Vec::new();
    for p in &prompts {
        let alone = generate(&url, request(p, 32, TargetOnly)).await.unwrap();
        let prompt_tokens = alone.usage.prompt_tokens;
        assert!(prompt_tokens > 100, "{prompt_tokens} prompt tokens");
        expected.push(alone.token_ids);
    }
    let methods = [TargetOnly, DraftModel, Ngram, Auto];
    let runs = prompts.iter().flat_map(|p| {
        methods.map(|m| {
            let (url, p) = (url.clone(), p.clone());
            tokio::spawn(async move { generate(&url, request(&p, 32, m)).await })
        })
    });
    let results = futures::future::join_all(runs).await;
    for (i, r) in results.into_iter().enumerate() {
        let (p, m) = (i / methods.len(), methods[i % methods.len()]);
        let got = r.unwrap().unwrap().token_ids;
        assert_eq!(got, expected[p], "stream {i}: {m:?}");
    }
    wait_no_sessions(&stack, Duration::from_secs(10)).await;
}

/// Streams whose next call comes back quickly share the target's passes: four identical
/// target-only streams, once their return gaps are known, run every round in one pass.
/// Only the streams' start may run apart: a stream opened late (on a loaded machine, by
/// tens of passes of this tiny model) leaves the others to run alone until it joins. That
/// lag is time, not rounds, so the streams are long and the bound is half their rounds
/// more (without the wait, passes are nearly twice the rounds). The window is generous so
/// that a loaded machine does not make a stream late. Whether a run had to wait at all is
/// not asserted: on a machine loaded enough that the model thread is the slowest party,
/// every stream's next step is queued before the pass that answered it has ended, and the
/// passes are shared without a wait.
#[tokio::test]
async fn streams_due_back_share_the_target_passes() {
    let (_m, target, coordinator) = target_only(|c| c.batch_wait_ms = 2_000).await;
    let url = coordinator.url();
    let runs = (0..4).map(|_| {
        let url = url.clone();
        tokio::spawn(async move { generate(&url, request("the cat", 200, TargetOnly)).await })
    });
    let results = futures::future::join_all(runs).await;
    let rounds: Vec<u32> = results
        .into_iter()
        .map(|r| r.unwrap().unwrap().usage.rounds)
        .collect();
    assert!(rounds.iter().all(|&r| r == rounds[0]), "{rounds:?}");
    let want = f64::from(4 * rounds[0]);
    let t = scrape_until(&target, "duet_worker_batch_size_sum", want).await;
    let calls = sample(&t, "duet_worker_batch_size_sum");
    let passes = sample(&t, "duet_worker_batch_size_count");
    assert_eq!(calls, want);
    assert!(
        passes <= f64::from(rounds[0] + rounds[0] / 2),
        "{calls} calls in {passes} passes for {} rounds",
        rounds[0]
    );
}

/// A short target-only Generate call of its own.
fn spawn_generate(url: &str) -> tokio::task::JoinHandle<Result<Completion, tonic::Status>> {
    let url = url.to_string();
    tokio::spawn(async move { generate(&url, request("the cat", 4, TargetOnly)).await })
}

/// A stream that holds its place until dropped: its HTTP/2 window of 64 bytes fills after a
/// few messages, and with it the coordinator's stream buffer, so the generation waits for
/// a reader that does not come (for `limits.stream_stall_timeout_ms`).
async fn held_stream(url: &str) -> tonic::Streaming<pb::GenerateResponse> {
    held_stream_as(url, None).await
}

/// [`held_stream`] under bearer `token`.
async fn held_stream_as(url: &str, token: Option<&str>) -> tonic::Streaming<pb::GenerateResponse> {
    let channel = tonic::transport::Endpoint::from_shared(url.to_string())
        .unwrap()
        .initial_stream_window_size(64)
        .connect()
        .await
        .unwrap();
    let mut client = pb::generation_client::GenerationClient::new(channel);
    let mut req = tonic::Request::new(request("the cat", 200, TargetOnly));
    if let Some(token) = token {
        let bearer = format!("Bearer {token}").parse().unwrap();
        req.metadata_mut().insert("authorization", bearer);
    }
    let mut stream = client.generate(req).await.unwrap().into_inner();
    stream.message().await.unwrap().unwrap();
    stream
}

/// `max_concurrent_requests_per_token` over real gRPC, with two bearer tokens and a bound
/// of one place each: team-a's stream holds its place, so its next request waits in the
/// queue though places are free, while team-b's goes past it at once; team-a's runs once
/// its stream ends.
#[tokio::test]
async fn a_tokens_requests_hold_at_most_its_bound_and_others_go_past() {
    let m = tiny_models();
    let target = start_target(worker_config(&m.target));
    let dir = tempfile::tempdir().unwrap();
    let mut config = coordinator_config(&target.url(), None);
    ask_for_tokens(&mut config, dir.path(), "team-a\nteam-b\n");
    config.max_concurrent_requests_per_token = 1;
    let coordinator = start_coordinator(config);
    let url = coordinator.url();
    wait_serving(&url, "").await;
    let held = held_stream_as(&url, Some("team-a")).await;
    let waiting = tokio::spawn({
        let url = url.clone();
        async move { cached_as(&url, "team-a", "", "a dog").await }
    });
    wait_queued(&coordinator, 1.0).await;
    let passing = cached_as(&url, "team-b", "", "a dog").await;
    assert_eq!(passing.token_ids.len(), 8);
    assert!(!waiting.is_finished());
    assert_eq!(
        sample(&scrape(&coordinator).await, "duet_num_requests_waiting"),
        1.0
    );
    drop(held);
    assert_eq!(waiting.await.unwrap().token_ids, passing.token_ids);
}

/// What a Gateway API Inference Extension's endpoint picker reads, on the API's own port
/// and without a token though the API wants one: the wait queue, the running requests,
/// the target's KV in use (the target-worker's own figure while a stream holds its
/// session, 0 once it has closed) and vLLM's adapter list (none here).
#[tokio::test]
async fn the_api_port_answers_the_figures_an_inference_gateway_reads() {
    let m = tiny_models();
    let target = start_target(worker_config(&m.target));
    let dir = tempfile::tempdir().unwrap();
    let mut config = coordinator_config(&target.url(), None);
    ask_for_tokens(&mut config, dir.path(), "team-a\n");
    config.max_concurrent_requests = 1;
    config.target.health_interval_ms = 20;
    let coordinator = start_coordinator(config);
    let url = coordinator.url();
    wait_serving(&url, "").await;
    let api = coordinator.http_addr;
    assert_eq!(http(api, "GET", "/v1/models", &[], "").await.0, 401);
    let held = held_stream_as(&url, Some("team-a")).await;
    let waiting = tokio::spawn({
        let url = url.clone();
        async move { cached_as(&url, "team-a", "", "a dog").await }
    });
    wait_queued(&coordinator, 1.0).await;
    let t = scrape(&target).await;
    let reserved = sample(&t, "duet_worker_kv_tokens_reserved");
    assert!(reserved > 0.0, "{t}");
    let held_kv = reserved / sample(&t, "duet_worker_kv_token_budget");
    let figures = api_metrics_until(api, "duet_kv_cache_usage_perc", held_kv).await;
    assert_eq!(sample(&figures, "duet_kv_cache_usage_perc"), held_kv);
    assert_eq!(sample(&figures, "duet_num_requests_waiting"), 1.0);
    assert_eq!(sample(&figures, "duet_num_requests_running"), 1.0);
    let lora = "duet_lora_requests_info{max_lora=\"0\",running_lora_adapters=\"\",waiting_lora_adapters=\"\"}";
    assert!(sample(&figures, lora) > 1.7e9, "{figures}");
    drop(held);
    waiting.await.unwrap();
    let figures = api_metrics_until(api, "duet_kv_cache_usage_perc", 0.0).await;
    assert_eq!(sample(&figures, "duet_kv_cache_usage_perc"), 0.0);
    assert_eq!(sample(&figures, "duet_num_requests_running"), 0.0);
}

/// `GET /metrics` on the coordinator's API port once the sample `name` is `want` (or after
/// 5 s).
async fn api_metrics_until(api: std::net::SocketAddr, name: &str, want: f64) -> String {
    for _ in 0..250 {
        let (status, figures) = http(api, "GET", "/metrics", &[], "").await;
        assert_eq!(status, 200, "{figures}");
        if sample(&figures, name) == want {
            return figures;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    http(api, "GET", "/metrics", &[], "").await.1
}

/// A target-worker and a coordinator with `places` and a wait queue of `queued`, serving.
async fn queue_stack(places: usize, queued: usize) -> (TinyModels, Running, Running) {
    let m = tiny_models();
    let target = start_target(worker_config(&m.target));
    let mut config = coordinator_config(&target.url(), None);
    (config.max_concurrent_requests, config.max_queued) = (places, queued);
    let coordinator = start_coordinator(config);
    wait_serving(&coordinator.url(), "").await;
    (m, target, coordinator)
}

/// Waits until the coordinator's wait queue holds `n` requests.
async fn wait_queued(coordinator: &Running, n: f64) {
    for _ in 0..400 {
        if sample(&scrape(coordinator).await, "duet_num_requests_waiting") == n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("the wait queue never held {n} requests");
}

/// With every place taken, a request waits in the queue and runs when a place frees (its
/// wait in its usage, within its time to first token); one more than the queue holds is
/// refused at once; a queued request whose caller goes away leaves the queue at once.
#[tokio::test]
async fn requests_wait_for_a_place_in_a_bounded_queue() {
    let (_m, _target, coordinator) = queue_stack(1, 1).await;
    let url = coordinator.url();
    let held = held_stream(&url).await;

    let waiter = spawn_generate(&url);
    wait_queued(&coordinator, 1.0).await;
    let refused = generate(&url, request("the cat", 4, TargetOnly)).await;
    let refused = refused.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert_eq!(
        refused.message(),
        "too many generations running (max_concurrent_requests = 1) and the wait queue is full (max_queued = 1)"
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    drop(held);
    let done = waiter.await.unwrap().unwrap();
    assert_eq!(done.usage.completion_tokens, 4);
    let t = done.usage.timings.unwrap();
    assert!(t.admission_wait_ms >= 200.0, "{t:?}");
    assert!(t.time_to_first_token_ms >= t.admission_wait_ms, "{t:?}");

    // A queued caller that goes away frees its place in the queue at once.
    let held = held_stream(&url).await;
    let gone = spawn_generate(&url);
    wait_queued(&coordinator, 1.0).await;
    gone.abort();
    wait_queued(&coordinator, 0.0).await;
    let next = spawn_generate(&url);
    wait_queued(&coordinator, 1.0).await;
    drop(held);
    assert_eq!(next.await.unwrap().unwrap().usage.completion_tokens, 4);
    let c = scrape(&coordinator).await;
    assert_eq!(sample(&c, "duet_num_requests_waiting"), 0.0);
    assert!(sample(&c, "duet_request_queue_time_seconds_count") >= 4.0);
}

/// vLLM's priority over real gRPC, where the coordinator schedules by priority: with the
/// one place taken, a request of priority -1 that comes after one of priority 5 runs first
/// when the place frees.
#[tokio::test]
async fn a_lower_priority_waits_less() {
    let m = tiny_models();
    let target = start_target(worker_config(&m.target));
    let mut config = coordinator_config(&target.url(), None);
    (config.max_concurrent_requests, config.max_queued) = (1, 4);
    config.scheduling_policy = duet_coordinator::config::SchedulingPolicy::Priority;
    let coordinator = start_coordinator(config);
    let url = coordinator.url();
    wait_serving(&url, "").await;
    let held = held_stream(&url).await;
    let (done, mut finished) = tokio::sync::mpsc::unbounded_channel();
    let spawn = |priority: i32| {
        let (url, done) = (url.clone(), done.clone());
        let req = pb::GenerateRequest {
            priority,
            ..request("the cat", 4, TargetOnly)
        };
        tokio::spawn(async move {
            let got = generate(&url, req).await.unwrap();
            done.send((priority, got.usage.completion_tokens)).unwrap();
        })
    };
    let late = spawn(5);
    wait_queued(&coordinator, 1.0).await;
    let urgent = spawn(-1);
    wait_queued(&coordinator, 2.0).await;
    drop(held);
    let (urgent, late) = (urgent.await, late.await);
    assert!(urgent.is_ok() && late.is_ok());
    assert_eq!(finished.recv().await, Some((-1, 4)));
    assert_eq!(finished.recv().await, Some((5, 4)));
}

/// Preemption over real gRPC: the target-worker has room for one session, held by a
/// request of priority 5 drafting with the draft model; one of priority -1 takes the room
/// (the first closes its sessions at its next round), finishes first, and the first then
/// goes on from its committed tokens on a new session, its text token for token what it is
/// alone. The usage says where it gave way, and the metric counts it.
#[tokio::test]
async fn a_lower_priority_takes_a_running_requests_room_and_its_text_stays_the_same() {
    urgent_takes_the_room(false).await;
}

/// The same with the urgent request on another coordinator: the target-worker that refuses
/// it asks the running session to give way, and holds the room for it.
#[tokio::test]
async fn a_lower_priority_takes_the_room_of_another_coordinators_request() {
    urgent_takes_the_room(true).await;
}

async fn urgent_takes_the_room(from_another_coordinator: bool) {
    let m = tiny_models();
    let draft = start_draft(worker_config(&m.draft));
    let mut worker = worker_config(&m.target);
    worker.max_sessions = 1;
    let target = start_target(worker);
    let mut config = coordinator_config(&target.url(), Some(&draft.url()));
    config.scheduling_policy = duet_coordinator::config::SchedulingPolicy::Priority;
    let coordinator = start_coordinator(config.clone());
    let other = from_another_coordinator.then(|| start_coordinator(config));
    let url = coordinator.url();
    let urgent_url = other.as_ref().map_or(url.clone(), |c| c.url());
    wait_serving(&url, "").await;
    wait_serving(&urgent_url, "").await;
    let low = pb::GenerateRequest {
        priority: 5,
        ignore_eos: true,
        ..request("the cat", 200, DraftModel)
    };
    let high = pb::GenerateRequest {
        priority: -1,
        ..request("a dog", 16, TargetOnly)
    };
    let alone = (generate(&url, low.clone()).await).unwrap();
    let high_alone = (generate(&url, high.clone()).await).unwrap();
    wait_sessions_closed(&target.url(), Duration::from_secs(5)).await;

    let (ended, mut order) = tokio::sync::mpsc::unbounded_channel();
    let (started, first_text) = tokio::sync::oneshot::channel();
    let running = tokio::spawn({
        let (url, ended) = (url.clone(), ended.clone());
        async move {
            let mut stream = client(&url).await.generate(low).await?.into_inner();
            let mut got = Completion::default();
            while got.chunks == 0 {
                got.add(stream.message().await?.expect("a chunk"));
            }
            started.send(()).unwrap();
            got.read_rest(&mut stream, |_| {}).await?;
            ended.send("low").unwrap();
            Ok::<_, tonic::Status>(got)
        }
    });
    first_text.await.unwrap();
    let urgent = generate(&urgent_url, high).await.unwrap();
    ended.send("high").unwrap();
    let low = running.await.unwrap().unwrap();
    assert_eq!(
        (order.recv().await, order.recv().await),
        (Some("high"), Some("low"))
    );
    assert_eq!(urgent.token_ids, high_alone.token_ids);
    assert_eq!(low.token_ids, alone.token_ids);
    assert_eq!(low.token_ids.len(), 200);
    let at = low.usage.preempted_at.clone();
    assert_eq!(at.len(), 1, "{at:?}");
    assert!((1..200).contains(&at[0]), "{at:?}");
    assert_eq!(urgent.usage.preempted_at, Vec::<u32>::new());
    let c = scrape(&coordinator).await;
    assert_eq!(sample(&c, "duet_preemptions_total"), 1.0);
}

/// At full size: 64 places and a queue of 64. 64 streams hold the places, 64 more wait,
/// and of 72 more each is refused at once; when the places free, the 64 waiting complete.
/// Prints the slowest refusal (the issue asks for 50 ms; a loaded CI machine is allowed a
/// second).
#[tokio::test]
async fn a_full_queue_refuses_the_excess_at_once_and_the_queued_complete() {
    let (_m, _target, coordinator) = queue_stack(64, 64).await;
    let url = coordinator.url();
    let held = futures::future::join_all((0..64).map(|_| held_stream(&url))).await;
    let queued: Vec<_> = (0..64).map(|_| spawn_generate(&url)).collect();
    wait_queued(&coordinator, 64.0).await;
    let refusals = (0..72).map(|_| {
        let url = url.clone();
        async move {
            let started = Instant::now();
            let refused = generate(&url, request("the cat", 4, TargetOnly)).await;
            (refused.map(|_| ()).map_err(|e| e.code()), started.elapsed())
        }
    });
    let refusals = futures::future::join_all(refusals).await;
    assert!(
        refusals
            .iter()
            .all(|(r, _)| *r == Err(Code::ResourceExhausted)),
        "{refusals:?}"
    );
    let slowest = refusals.iter().map(|(_, t)| *t).max().unwrap();
    println!(
        "72 refusals, the slowest in {:.1} ms",
        slowest.as_secs_f64() * 1e3
    );
    assert!(slowest < Duration::from_secs(1), "{slowest:?}");
    drop(held);
    for q in queued {
        assert_eq!(q.await.unwrap().unwrap().usage.completion_tokens, 4);
    }
}

/// An open that finds one replica busy (its session limit reached, here by a session
/// another client holds) goes to the next replica instead of failing the request.
#[tokio::test]
async fn an_open_refused_by_a_busy_replica_tries_the_next() {
    let m = tiny_models();
    let mut one_session = worker_config(&m.target);
    one_session.max_sessions = 1;
    let busy = start_target(one_session);
    let free = start_target(worker_config(&m.target));
    for url in [busy.url(), free.url()] {
        wait_serving(&url, "").await;
    }
    let _taken = open_session(&busy.url(), 16).await;
    let replicas = format!("{}, {}", busy.url(), free.url());
    let coordinator = start_coordinator(coordinator_config(&replicas, None));
    wait_serving(&coordinator.url(), "").await;
    // The coordinator holds no session on either, so each request tries them in turn: every
    // one that starts on the busy replica moves on to the free one.
    for _ in 0..4 {
        let done = generate(&coordinator.url(), request("the cat", 4, TargetOnly)).await;
        assert_eq!(done.unwrap().usage.completion_tokens, 4);
    }
    assert_eq!(prefills(&free).await, 4.0);
}

/// Three conversations of three turns, interleaved, over two target replicas: with prefix
/// routing every later turn (its history most of its prompt) goes where its conversation
/// went and finds at least its last prompt in that replica's cache; by load alone, turns
/// land on the other replica and miss.
#[tokio::test]
async fn prefix_routing_sends_a_conversation_back_to_its_cache() {
    let m = tiny_models();
    let Some(chunk) = prefix_chunk(&m.target) else {
        // No cache to route to (`later_turns_take_their_prefix_...` checks it stays off).
        return;
    };
    let replicas: Vec<Running> = (0..2)
        .map(|_| start_target(chunked(worker_config(&m.target))))
        .collect();
    for r in &replicas {
        wait_serving(&r.url(), "").await;
    }
    let urls = format!("{}, {}", replicas[0].url(), replicas[1].url());
    let mut by_load = coordinator_config(&urls, None);
    by_load.routing.prefix_aware = false;
    let coordinators = [
        start_coordinator(coordinator_config(&urls, None)),
        start_coordinator(by_load),
    ];
    let mut missed = Vec::new();
    for (run, coordinator) in coordinators.iter().enumerate() {
        wait_serving(&coordinator.url(), "").await;
        let mut prompts: Vec<String> = (0..3)
            .map(|c| {
                format!(
                    "{run}{c} {}",
                    "the dog ran to the cat and then the cat ran away. ".repeat(3)
                )
            })
            .collect();
        let mut heads = [0; 3];
        let mut misses = 0;
        for turn in 0..3 {
            for (c, prompt) in prompts.iter_mut().enumerate() {
                let done = generate(&coordinator.url(), request(prompt, 8, TargetOnly))
                    .await
                    .unwrap();
                let cached = done.usage.prompt_tokens_cached;
                if turn > 0 && cached < heads[c] / chunk * chunk {
                    misses += 1;
                }
                heads[c] = done.usage.prompt_tokens - 1;
                prompt.push_str(&format!("{}\nturn {turn} of {c}: ", done.text));
            }
        }
        missed.push(misses);
    }
    assert_eq!(missed[0], 0, "prefix routing");
    assert!(missed[1] > 0, "by load: {missed:?}");
}

/// Two target replicas serving different models (the tiny target's and the tiny draft's):
/// the coordinator checks each replica's model against the first one it described, so every
/// request goes to the replica of that model, however the load would alternate them.
#[tokio::test]
async fn a_replica_serving_another_model_gets_no_session() {
    let m = tiny_models();
    let replicas = [&m.target, &m.draft].map(|model| start_target(worker_config(model)));
    for r in &replicas {
        wait_serving(&r.url(), "").await;
    }
    let urls = format!("{}, {}", replicas[0].url(), replicas[1].url());
    let coordinator = start_coordinator(coordinator_config(&urls, None));
    wait_serving(&coordinator.url(), "").await;
    for prompt in ["the cat", "a dog", "the end", "one more"] {
        let done = generate(&coordinator.url(), request(prompt, 6, TargetOnly)).await;
        assert_eq!(done.unwrap().usage.completion_tokens, 6, "{prompt}");
    }
    let counts = [prefills(&replicas[0]).await, prefills(&replicas[1]).await];
    assert!(counts == [4.0, 0.0] || counts == [0.0, 4.0], "{counts:?}");
}

/// A target replica replaced at the same address by a worker serving another model (a pod
/// rescheduled with the wrong image): the coordinator sees a session open on a new worker
/// instance there, asks its model again, closes the session and fails the request; the
/// next request opens nothing there.
#[tokio::test]
async fn a_replaced_replica_is_asked_its_model_again() {
    let m = tiny_models();
    let first = start_target(worker_config(&m.target));
    wait_serving(&first.url(), "").await;
    let coordinator = start_coordinator(coordinator_config(&first.url(), None));
    wait_serving(&coordinator.url(), "").await;
    let done = generate(&coordinator.url(), request("the cat", 6, TargetOnly)).await;
    assert_eq!(done.unwrap().usage.completion_tokens, 6);
    let addr = first.addr;
    drop(first);
    let replaced = start_target_at(worker_config(&m.draft), addr);
    wait_serving(&replaced.url(), "").await;
    for _ in 0..2 {
        let err = generate(&coordinator.url(), request("the cat", 6, TargetOnly))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::Internal, "{err:?}");
        assert!(err.message().contains("draft.gguf"), "{err:?}");
    }
    wait_sessions_closed(&replaced.url(), Duration::from_secs(5)).await;
    assert_eq!(prefills(&replaced).await, 1.0);
}

/// The proposal cache over real gRPC, with two bearer tokens (two tenants): a request
/// teaches it, the same request under the other token gets nothing from it, and under the
/// same token again its rounds take their proposals from it. Without tokens (the default
/// `per_token` sharing) it stays off.
#[tokio::test]
async fn the_proposal_cache_is_shared_within_a_token_only() {
    let m = tiny_models();
    let target = start_target(worker_config(&m.target));
    let dir = tempfile::tempdir().unwrap();
    let coordinator = start_coordinator_with_tokens(&target.url(), dir.path(), "team-a\nteam-b\n");
    let url = coordinator.url();
    wait_serving(&url, "").await;
    let prompt = "qx zv wk jb fp";
    let as_team = |token: &str| {
        let mut req = tonic::Request::new(request(prompt, 24, Ngram));
        let bearer = format!("Bearer {token}").parse().unwrap();
        req.metadata_mut().insert("authorization", bearer);
        req
    };
    let hits = || async {
        sample(
            &scrape(&coordinator).await,
            "duet_proposal_cache_hits_total",
        )
    };
    let first = generate(&url, as_team("team-a")).await.unwrap();
    assert_eq!(hits().await, 0.0);
    let other = generate(&url, as_team("team-b")).await.unwrap();
    assert_eq!(other.token_ids, first.token_ids);
    assert_eq!(hits().await, 0.0, "team-b was proposed team-a's text");
    let again = generate(&url, as_team("team-a")).await.unwrap();
    assert_eq!(again.token_ids, first.token_ids);
    assert!(hits().await >= 1.0);
    assert!(again.usage.draft_tokens_accepted > first.usage.draft_tokens_accepted);

    let (_m, _target, open) = target_only(|_| {}).await;
    for _ in 0..2 {
        generate(&open.url(), request(prompt, 24, Ngram))
            .await
            .unwrap();
    }
    let scraped = scrape(&open).await;
    assert_eq!(sample(&scraped, "duet_proposal_cache_hits_total"), 0.0);
    assert_eq!(sample(&scraped, "duet_proposal_cache_entries"), 0.0);
}

/// The prefix cache over real gRPC: a second turn (the first's prompt, its answer and a
/// new line) and a repeated request take their prompts' prefixes from earlier sessions on
/// both workers, and every token is what a target-worker without the cache gives (on a
/// GPU, whole prefill chunks of it and all of a repeated prompt with
/// `DUET_CUDA_PREFIX_CACHE=1`; without it nothing taken from it).
#[tokio::test]
async fn later_turns_take_their_prefix_from_the_cache_and_say_the_same() {
    let m = tiny_models();
    let stack = Stack::start_with(
        chunked(worker_config(&m.draft)),
        chunked(worker_config(&m.target)),
    );
    wait_stack(&stack).await;
    let (_m2, _plain_target, plain) = target_only(|c| {
        *c = chunked(c.clone());
        c.prefix_cache_tokens = 0;
    })
    .await;
    let (cached, plain) = (stack.coordinator.url(), plain.url());
    let first = "the cat sat on the mat and then the dog came in. ".repeat(2);
    let turn = |prompt: &str| request(prompt, 24, DraftModel);
    let a = generate(&cached, turn(&first)).await.unwrap();
    assert_eq!(a.usage.prompt_tokens_cached, 0);
    let second = format!("{first}{}\nand then?", a.text);
    let mut prompt_cached = Vec::new();
    for prompt in [&first, &second, &second] {
        let got = generate(&cached, turn(prompt)).await.unwrap();
        let want = generate(&plain, request(prompt, 24, TargetOnly))
            .await
            .unwrap();
        assert_eq!(got.token_ids, want.token_ids, "{prompt:?}");
        assert_eq!(want.usage.prompt_tokens_cached, 0);
        prompt_cached.push((got.usage.prompt_tokens_cached, got.usage.prompt_tokens - 1));
    }
    let Some(chunk) = prefix_chunk(&m.target) else {
        assert!(prompt_cached.iter().all(|c| c.0 == 0), "{prompt_cached:?}");
        return;
    };
    // A repeated prompt finds all of it but its last token (which the first call feeds);
    // the second turn finds at least the first turn's prompt (its whole chunks).
    assert_eq!(prompt_cached[0].0, prompt_cached[0].1);
    assert!(
        prompt_cached[1].0 >= prompt_cached[0].1 / chunk * chunk,
        "{prompt_cached:?}"
    );
    assert_eq!(prompt_cached[2].0, prompt_cached[2].1);
    wait_no_sessions(&stack, Duration::from_secs(5)).await;
    for worker in [&stack.target, &stack.draft] {
        let metrics = scrape(worker).await;
        let hit = sample(&metrics, "duet_worker_prefix_cache_hit_tokens_total");
        assert!(hit >= (prompt_cached[0].0 * 2) as f64, "{metrics}");
        assert!(sample(&metrics, "duet_worker_prefix_cache_tokens") > 0.0);
    }
}

/// The workers' prefix caches kept apart over real gRPC: with two bearer tokens (the
/// default `per_token` sharing), a prompt cached under one token is taken again under it
/// only, and under vLLM's `cache_salt` only with the same salt; where
/// `prefix_cache_sharing` is `everyone`, under either token. The tokens are the same
/// either way.
#[tokio::test]
async fn a_cached_prefix_is_taken_under_its_token_and_salt_only() {
    let m = tiny_models();
    if prefix_chunk(&m.target).is_none() {
        return; // No cache to keep apart (without DUET_CUDA_PREFIX_CACHE=1 on a GPU).
    }
    let target = start_target(worker_config(&m.target));
    let dir = tempfile::tempdir().unwrap();
    let tokens = "team-a\nteam-b\n";
    let per_token = start_coordinator_with_tokens(&target.url(), dir.path(), tokens);
    wait_serving(&per_token.url(), "").await;
    let prompt = "the cat sat on the mat and then the dog came in. ".repeat(2);
    let first = cached_as(&per_token.url(), "team-a", "", &prompt).await;
    let whole = first.prompt_tokens - 1;
    let mut taken = Vec::new();
    for (token, salt) in [
        ("team-b", ""),
        ("team-a", "s"),
        ("team-a", ""),
        ("team-a", "s"),
    ] {
        let got = cached_as(&per_token.url(), token, salt, &prompt).await;
        assert_eq!(got.token_ids, first.token_ids, "{token} {salt}");
        taken.push(got.prompt_tokens_cached);
    }
    assert_eq!(taken, [0, 0, whole, whole]);
    let mut config = coordinator_config(&target.url(), None);
    config.auth_token_file = dir.path().join("tokens").to_string_lossy().into_owned();
    config.prefix_cache_sharing = duet_coordinator::config::PrefixSharing::Everyone;
    let everyone = start_coordinator(config);
    wait_serving(&everyone.url(), "").await;
    let mut taken = Vec::new();
    for token in ["team-a", "team-b"] {
        let got = cached_as(&everyone.url(), token, "", &prompt).await;
        assert_eq!(got.token_ids, first.token_ids, "{token}");
        taken.push(got.prompt_tokens_cached);
    }
    assert_eq!(taken, [0, whole]);
}

/// A greedy target-only request of `prompt` under bearer `token` with `cache_salt` `salt`:
/// its tokens, and how many of its prompt's came from a prefix cache.
async fn cached_as(url: &str, token: &str, salt: &str, prompt: &str) -> Cached {
    let mut req = tonic::Request::new(pb::GenerateRequest {
        cache_salt: salt.into(),
        ..request(prompt, 8, TargetOnly)
    });
    let bearer = format!("Bearer {token}").parse().unwrap();
    req.metadata_mut().insert("authorization", bearer);
    let got = generate(url, req).await.unwrap();
    Cached {
        token_ids: got.token_ids,
        prompt_tokens: got.usage.prompt_tokens,
        prompt_tokens_cached: got.usage.prompt_tokens_cached,
    }
}

struct Cached {
    token_ids: Vec<u32>,
    prompt_tokens: u32,
    prompt_tokens_cached: u32,
}

/// A target-worker with room for one session (`max_sessions` = 1), held by another client
/// (as another coordinator would): a request waits for room
/// (`duet_num_requests_waiting_for_kv` counts it), trying again as it backs off, and runs
/// once the session is closed. With no room within `queue_timeout_ms` it answers
/// RESOURCE_EXHAUSTED.
#[tokio::test]
async fn a_request_without_room_waits_for_it() {
    let m = tiny_models();
    let mut worker = worker_config(&m.target);
    worker.max_sessions = 1;
    let target = start_target(worker);
    let mut config = coordinator_config(&target.url(), None);
    config.queue_timeout_ms = 2_000;
    let coordinator = start_coordinator(config);
    let url = coordinator.url();
    wait_serving(&url, "").await;
    let held = open_session(&target.url(), 16).await;
    let waiting = tokio::spawn({
        let url = url.clone();
        async move { generate(&url, request("a dog", 8, TargetOnly)).await }
    });
    let kv_waiting = "duet_num_requests_waiting_for_kv";
    let scraped = scrape_until(&coordinator, kv_waiting, 1.0).await;
    assert_eq!(sample(&scraped, kv_waiting), 1.0);
    let mut worker = duet_proto::v1::worker_client::WorkerClient::connect(target.url())
        .await
        .unwrap();
    let close = pb::CloseSessionRequest {
        session_id: held.session_id,
        instance_id: held.instance_id,
    };
    worker.close_session(close).await.unwrap();
    let done = waiting.await.unwrap().unwrap();
    assert_eq!(done.usage.completion_tokens, 8);
    assert_eq!(sample(&scrape(&coordinator).await, kv_waiting), 0.0);

    // The finished request's session closes in the background: its room first.
    wait_sessions_closed(&target.url(), Duration::from_secs(5)).await;
    let _held = open_session(&target.url(), 16).await;
    let started = Instant::now();
    let err = generate(&url, request("a dog", 8, TargetOnly))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    assert!(err.message().contains("queue_timeout_ms = 2000"), "{err:?}");
    assert!(started.elapsed() >= Duration::from_millis(1_900));
}

/// How finely the workers' prefix caches copy rows of `model` on the test device, with
/// [`chunked`] workers: any row where a token's keys and values do not depend on the pass
/// (the CPU), else whole prefill chunks with `DUET_CUDA_PREFIX_CACHE=1`; `None`: the
/// workers keep their caches off.
fn prefix_chunk(model: &std::path::Path) -> Option<u32> {
    if reference_model(model).kv_rows_invariant() {
        Some(1)
    } else {
        duet_worker_core::whole_chunks_switched_on().then_some(PREFILL_CHUNK as u32)
    }
}

/// Prefill chunks short enough for the tests' prompts to hold whole ones.
const PREFILL_CHUNK: usize = 8;

fn chunked(config: duet_worker_core::WorkerConfig) -> duet_worker_core::WorkerConfig {
    duet_worker_core::WorkerConfig {
        prefill_chunk_tokens: Some(PREFILL_CHUNK),
        ..config
    }
}
