//! Sessions' opens, a slow draft, metrics, and target replicas spread, stuck, dying and
//! draining.

use super::*;

/// A caller that gives up on an OpenSession closes the session by the id it named, on any
/// instance: an open that arrives after that close fails, an id in use is refused, and a
/// close so named of an open session closes it.
#[tokio::test]
async fn an_open_named_by_its_caller_can_be_closed_before_it_answers() {
    use duet_proto::v1::worker_client::WorkerClient;
    let (_m, target) = serving_target().await;
    let mut c = WorkerClient::connect(target.url()).await.unwrap();
    let open = |session_id: Vec<u8>| pb::OpenSessionRequest {
        session_id,
        prompt: vec![1, 2, 3],
        capacity: 16,
        sampling: None,
        generated_after: 0,
        ..Default::default()
    };
    let close = |session_id: Vec<u8>| pb::CloseSessionRequest {
        session_id,
        instance_id: 0,
    };
    let early = vec![7; 16];
    let closed = c.close_session(close(early.clone())).await.unwrap();
    assert!(!closed.into_inner().closed);
    let err = c.open_session(open(early.clone())).await.unwrap_err();
    assert_eq!(err.code(), Code::Aborted, "{err:?}");
    assert_eq!(worker_sessions(&target.url()).await, 0);
    // The close is spent on the open it stopped.
    let opened = c.open_session(open(early.clone())).await.unwrap();
    assert_eq!(opened.into_inner().session_id, early);
    let err = c.open_session(open(early.clone())).await.unwrap_err();
    assert_eq!(err.code(), Code::AlreadyExists, "{err:?}");
    assert_eq!(worker_sessions(&target.url()).await, 1);
    let closed = c.close_session(close(early)).await.unwrap();
    assert!(closed.into_inner().closed);
    assert_eq!(worker_sessions(&target.url()).await, 0);
    // Both closes by name count as opens given up on.
    let scraped = scrape(&target).await;
    assert_eq!(sample(&scraped, "duet_worker_opens_abandoned_total"), 2.0);
    let err = c.open_session(open(vec![1; 8])).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
}

/// An open's deadline grows with the prompt it prefills: a prompt that takes a wide target
/// longer than the base deadline to prefill opens when the prefill is allowed its time per
/// token, and times out, naming the deadline and the tokens, when it is not.
#[tokio::test]
async fn an_open_is_allowed_time_for_its_prompt() {
    use duet_coordinator::workers::{CallError, Deadlines, Failure, Open, Party, WorkerClient};
    let m = tiny_models();
    // 200 prompt tokens take well over 1 ms to prefill.
    write_slow_model(&m.target);
    let target = start_target(worker_config(&m.target));
    wait_serving(&target.url(), "").await;
    let prompt: Vec<u32> = (1..=200).collect();
    let sampling = duet_engine::sampling::SamplingParams::greedy();
    let open = |prefill_per_token| {
        let client = WorkerClient::new(
            Party::Target,
            &target.url(),
            None,
            Duration::from_secs(5),
            Duration::from_secs(60),
            Deadlines {
                call: Duration::from_secs(5),
                call_floor: Duration::from_secs(5),
                open: Duration::from_millis(1),
                prefill_per_token,
                control: Duration::from_secs(5),
            },
            None,
        );
        let prompt = &prompt;
        let sampling = &sampling;
        async move {
            // Resolves the replica.
            client.describe(false).await.unwrap();
            let lease = duet_coordinator::workers::Lease::default();
            let open = Open::plain(prompt, 256, sampling, &lease);
            client.open(open, None).await.map(|(session, ..)| session)
        }
    };
    let err = open(Duration::ZERO).await.unwrap_err();
    let CallError {
        party: Party::Target,
        failure: Failure::TimedOut(why),
        ..
    } = err
    else {
        panic!("{err:?}");
    };
    assert_eq!(
        why,
        "OpenSession (200 prompt tokens, 0 more prefilling before it on the replica for this \
         coordinator) took longer than 1 ms"
    );
    // 1 ms, and 100 ms for each of the 200 tokens.
    let session = open(Duration::from_millis(100)).await.unwrap();
    drop(session);
    wait_sessions_closed(&target.url(), Duration::from_secs(5)).await;
}

/// The coordinator's OpenSession call dropped at any moment (before it is sent, while the
/// worker prefills, as its answer comes back) leaves no session open on the worker: the
/// call names the session, and dropping it closes that name.
#[tokio::test]
async fn an_open_dropped_at_any_moment_leaves_nothing_open() {
    use duet_coordinator::workers::{Open, WorkerClient};
    let (_m, target) = serving_target().await;
    let deadlines = duet_coordinator::workers::Deadlines {
        call: Duration::from_secs(5),
        call_floor: Duration::from_secs(5),
        open: Duration::from_secs(5),
        prefill_per_token: Duration::ZERO,
        control: Duration::from_secs(5),
    };
    let client = WorkerClient::new(
        duet_coordinator::workers::Party::Target,
        &target.url(),
        None,
        Duration::from_secs(5),
        Duration::from_secs(60),
        deadlines,
        None,
    );
    let prompt: Vec<u32> = (1..40).collect();
    let sampling = duet_engine::sampling::SamplingParams::greedy();
    let lease = duet_coordinator::workers::Lease::default();
    let open = || client.open(Open::plain(&prompt, 64, &sampling, &lease), None);
    // Resolve the replica and warm the connection.
    client.describe(false).await.unwrap();
    drop(open().await.unwrap());
    wait_sessions_closed(&target.url(), Duration::from_secs(5)).await;
    // From no poll at all up to as many as an open takes on this machine, whatever its
    // speed: one more poll each time, 5% more from 400 on, until twenty opens finished.
    let (mut finished, mut dropped, mut polls) = (0, 0, 0usize);
    while finished < 20 {
        assert!(polls < 1_000_000, "no open finished; {dropped} dropped");
        // The open runs beside `polls` yields of this task, then goes away if not done.
        let give_up = async {
            for _ in 0..polls {
                tokio::task::yield_now().await;
            }
        };
        tokio::select! {
            biased;
            opened = open() => {
                drop(opened.unwrap());
                finished += 1;
            }
            () = give_up => dropped += 1,
        }
        // Paced like a coordinator's calls: the worker's HTTP/2 server takes a burst of
        // streams reset before it accepted them for an attack (rapid reset) and refuses more.
        tokio::time::sleep(Duration::from_millis(1)).await;
        polls = if polls < 400 {
            polls + 1
        } else {
            polls * 21 / 20
        };
    }
    // Far below the worker's 60 s TTL.
    wait_sessions_closed(&target.url(), Duration::from_secs(5)).await;
}

/// Reaching a worker is not enough to drive or close someone else's session: ids are 16
/// random bytes, and a call must name the worker instance that opened the session.
#[tokio::test]
async fn sessions_cannot_be_guessed_or_reached_across_instances() {
    use duet_proto::v1::target_worker_client::TargetWorkerClient;
    use duet_proto::v1::worker_client::WorkerClient;
    let (_m, target) = serving_target().await;
    let mut c = WorkerClient::connect(target.url()).await.unwrap();
    let a = open_session(&target.url(), 16).await;
    let b = open_session(&target.url(), 16).await;
    assert_eq!((a.session_id.len(), b.session_id.len()), (16, 16));
    assert_ne!(a.session_id, b.session_id);
    assert_eq!(a.instance_id, b.instance_id);
    let mut verify = TargetWorkerClient::connect(target.url()).await.unwrap();
    let call = |session_id: Vec<u8>, instance_id: u64| pb::VerifyRequest {
        session_id,
        instance_id,
        keep: 2,
        append: vec![3],
        draft: vec![],
        ..Default::default()
    };
    // Its neighbour's id plus one, as sequential ids would have been.
    let mut guessed = a.session_id.clone();
    guessed[15] = guessed[15].wrapping_add(1);
    let err = verify
        .verify(call(guessed, a.instance_id))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{err:?}");
    let err = verify
        .verify(call(a.session_id.clone(), a.instance_id ^ 1))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    assert!(err.message().contains("the worker restarted"), "{err:?}");
    let closed = c
        .close_session(pb::CloseSessionRequest {
            session_id: a.session_id.clone(),
            instance_id: a.instance_id ^ 1,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!closed.closed);
    verify
        .verify(call(a.session_id, a.instance_id))
        .await
        .expect("the right id and instance reach the session");
}

/// A draft-worker slower than `draft.timeout_ms` is treated as failed: the request goes on
/// target-only with the same tokens and says why.
#[tokio::test]
async fn slow_draft_worker_falls_back() {
    let m = tiny_models();
    // A draft of the same vocabulary, drafting 8 tokens well over the 1 ms the coordinator
    // allows.
    write_slow_model(&m.draft);
    let draft = start_draft(worker_config(&m.draft));
    let target = start_target(worker_config(&m.target));
    let mut config = coordinator_config(&target.url(), Some(&draft.url()));
    config.draft.timeout_ms = 1;
    config.speculation.num_speculative_tokens = 8;
    let coordinator = start_coordinator(config);
    wait_serving(&coordinator.url(), "duet.v1.DraftWorker").await;
    let url = coordinator.url();
    let plain = generate(&url, request("the cat", 30, TargetOnly))
        .await
        .unwrap();
    let g = generate(&url, request("the cat", 30, DraftModel))
        .await
        .unwrap();
    assert_eq!(g.token_ids, plain.token_ids);
    assert!(g.usage.fell_back_to_target_only);
    assert!(
        g.usage.fallback_reason.contains("longer than 1 ms"),
        "{}",
        g.usage.fallback_reason
    );
}

/// Each service's `/metrics`, scraped over HTTP after a request, agrees with its usage; the
/// workers' warm-up at start shows apart from it.
#[tokio::test]
async fn metrics_agree_with_the_usage() {
    let (_m, stack) = tiny_stack().await;
    let url = stack.coordinator.url();
    let mut req = request("the cat", 40, DraftModel);
    req.num_speculative_tokens = 3;
    let g = generate(&url, req).await.unwrap();
    let u = &g.usage;
    let bad = generate(&url, request("", 4, DraftModel))
        .await
        .unwrap_err();
    assert_eq!(bad.code(), Code::InvalidArgument);

    let c = scrape(&stack.coordinator).await;
    let n = |name: &str| sample(&c, name);
    assert_eq!(
        n("duet_spec_decode_num_draft_tokens_total"),
        f64::from(u.draft_tokens_proposed)
    );
    assert_eq!(
        n("duet_spec_decode_num_accepted_tokens_total"),
        f64::from(u.draft_tokens_accepted)
    );
    let per_position: f64 = (0..3)
        .map(|p| {
            n(&format!(
                "duet_spec_decode_num_accepted_tokens_per_pos_total{{position=\"{p}\"}}"
            ))
        })
        .sum();
    assert_eq!(per_position, f64::from(u.draft_tokens_accepted));
    let drafts = n("duet_spec_decode_num_drafts_total");
    assert!(
        drafts > 0.0 && drafts <= f64::from(u.rounds),
        "{drafts} vs {}",
        u.rounds
    );
    assert_eq!(
        n("duet_generation_tokens_total"),
        f64::from(u.completion_tokens)
    );
    assert_eq!(n("duet_prompt_tokens_total"), f64::from(u.prompt_tokens));
    let finish = duet_proto::finish_reason_name(g.finish_reason.unwrap());
    assert_eq!(
        n(&format!(
            "duet_requests_total{{finish_reason=\"{finish}\",code=\"OK\"}}"
        )),
        1.0,
        "{c}"
    );
    assert_eq!(
        n("duet_requests_total{finish_reason=\"\",code=\"INVALID_ARGUMENT\"}"),
        1.0,
        "{c}"
    );
    assert_eq!(n("duet_time_to_first_token_seconds_count"), 1.0);
    assert_eq!(n("duet_e2e_request_latency_seconds_count"), 1.0);
    assert_eq!(
        n("duet_inter_token_latency_seconds_count"),
        f64::from(u.completion_tokens) - 1.0
    );
    assert_eq!(n("duet_spec_decode_fallbacks_total"), 0.0);
    // The limits and states beside them: the defaults, a serving target, a closed breaker.
    assert_eq!(n("duet_max_concurrent_requests"), 64.0);
    assert_eq!(n("duet_target_serving"), 1.0);
    assert_eq!(n("duet_draft_breaker_open"), 0.0);
    assert_eq!(n("duet_draft_breaker_trips_total"), 0.0);

    wait_no_sessions(&stack, Duration::from_secs(5)).await;
    let t = scrape_until(
        &stack.target,
        "duet_worker_forward_seconds_count{kind=\"call\"}",
        f64::from(u.rounds),
    )
    .await;
    // One model call per round (no other session to batch with), plus the prompt prefill.
    assert_eq!(
        sample(&t, "duet_worker_forward_seconds_count{kind=\"call\"}"),
        f64::from(u.rounds)
    );
    assert_eq!(
        sample(&t, "duet_worker_forward_seconds_count{kind=\"prefill\"}"),
        1.0
    );
    assert_eq!(sample(&t, "duet_worker_active_sessions"), 0.0);
    assert_eq!(sample(&t, "duet_worker_kv_tokens_reserved"), 0.0);
    assert_eq!(sample(&t, "duet_worker_max_sessions"), 64.0);
    assert_eq!(sample(&t, "duet_worker_kv_token_budget"), 65_536.0);
    // The draft-worker served each Propose call once; calls that arrive while others
    // draft join their passes, so a model run may serve several.
    let d = scrape(&stack.draft).await;
    assert_eq!(sample(&d, "duet_worker_batch_size_sum"), drafts);
    let runs = sample(&d, "duet_worker_forward_seconds_count{kind=\"call\"}");
    assert!(
        runs > 0.0 && runs <= drafts,
        "{runs} runs for {drafts} calls"
    );
    // Both workers ran their warm-up passes before they were ready, none of it counted
    // above; on a GPU those captured the graphs of 1, 2, 4 and 8 rows.
    let gpu = duet_engine::testing::test_device() == "cuda";
    for scraped in [&t, &d] {
        assert!(
            sample(scraped, "duet_worker_warm_up_seconds") > 0.0,
            "{scraped}"
        );
        let graphs = sample(scraped, "duet_worker_cuda_graphs");
        match gpu {
            true => assert!(graphs >= 4.0, "{graphs} graphs"),
            false => assert_eq!(graphs, 0.0),
        }
    }
}

/// Two target-worker replicas behind one address: sessions spread over both, each stays on
/// its replica (the tokens are exactly target-only's), and when one goes away new requests
/// open their sessions on the other.
#[tokio::test]
async fn sessions_spread_over_replicas_and_survive_one_leaving() {
    let m = tiny_models();
    let draft = start_draft(worker_config(&m.draft));
    let first = start_target(worker_config(&m.target));
    let mut second = start_target(worker_config(&m.target));
    let replicas = format!("{}, {}", first.url(), second.url());
    let mut config = coordinator_config(&replicas, Some(&draft.url()));
    // Each DRAFT_MODEL request opens its draft session beside the target's and waits for
    // both. On shared cores, with other streams running, a request goes on with target-only
    // steps while its draft session opens, and on a loaded machine a short request can end
    // before it is open, having drafted nothing: by design, but not what this test counts.
    config.speculation.concurrent_prefill = true;
    config.speculation.take_turns = false;
    let coordinator = start_coordinator(config);
    for url in [draft.url(), first.url(), second.url(), coordinator.url()] {
        wait_serving(&url, "").await;
    }
    wait_serving(&coordinator.url(), "duet.v1.DraftWorker").await;
    let url = coordinator.url();
    let prompts = ["the cat", "a b c d", "def f(x):", "once upon"];
    let mut expected = Vec::new();
    for p in prompts {
        let plain = generate(&url, request(p, 30, TargetOnly)).await.unwrap();
        expected.push(plain.token_ids);
    }
    let runs = prompts
        .iter()
        .map(|p| generate(&url, request(p, 30, DraftModel)));
    for (out, want) in futures::future::join_all(runs)
        .await
        .into_iter()
        .zip(&expected)
    {
        let out = out.unwrap();
        assert!(out.usage.draft_tokens_proposed > 0);
        assert_eq!(&out.token_ids, want);
    }
    let (a, b) = (prefills(&first).await, prefills(&second).await);
    assert_eq!(a + b, 8.0, "one session per request");
    assert!(a >= 2.0 && b >= 2.0, "sessions not spread: {a} and {b}");

    second.kill();
    for (p, want) in prompts.iter().zip(&expected) {
        let out = generate(&url, request(p, 30, DraftModel))
            .await
            .unwrap_or_else(|e| panic!("{p:?} after a replica left: {e:?}"));
        assert_eq!(&out.token_ids, want);
    }
}

/// A replica that accepts connections but never answers (a wedged process) delays the
/// coordinator's health checks by at most the control deadline: replicas are checked at
/// once, so the healthy one makes the coordinator ready.
#[tokio::test]
async fn a_stuck_replica_does_not_hold_up_readiness() {
    let m = tiny_models();
    // Replicas are ordered by address: the stuck one (127.0.0.1) comes first.
    let target = start_target_at(worker_config(&m.target), "127.0.0.2:0".parse().unwrap());
    wait_serving(&target.url(), "").await;
    // The kernel completes the TCP handshake; nothing ever speaks HTTP/2.
    let stuck = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let stuck_url = format!("http://{}", stuck.local_addr().unwrap());
    let mut config = coordinator_config(&format!("{stuck_url}, {}", target.url()), None);
    config.target.control_timeout_ms = 300;
    let started = Instant::now();
    let coordinator = start_coordinator(config);
    tokio::time::timeout(Duration::from_secs(5), wait_serving(&coordinator.url(), ""))
        .await
        .expect("the coordinator waited on the stuck replica");
    assert!(started.elapsed() < Duration::from_secs(5));
}

/// The target replica serving a request dies mid-stream: the coordinator reopens the
/// session on the other replica from the committed tokens, the client sees no error, the
/// tokens are exactly an undisturbed run's, and `usage` records the failover. A structured
/// output's constraint picks up where the completion stands on the new replica.
#[tokio::test]
async fn a_target_replica_dying_mid_stream_loses_nothing() {
    let m = tiny_models();
    let draft = start_draft(worker_config(&m.draft));
    let mut targets = [
        start_target(worker_config(&m.target)),
        start_target(worker_config(&m.target)),
    ];
    let replicas = format!("{}, {}", targets[0].url(), targets[1].url());
    let coordinator = start_coordinator(coordinator_config(&replicas, Some(&draft.url())));
    for url in [&draft, &targets[0], &targets[1], &coordinator].map(|s| s.url()) {
        wait_serving(&url, "").await;
    }
    wait_serving(&coordinator.url(), "duet.v1.DraftWorker").await;
    let url = coordinator.url();
    let letters = pb::StructuredOutput {
        format: Some(pb::structured_output::Format::Regex("[a-z ]{400}".into())),
    };
    for (method, k, format) in [
        (TargetOnly, 0, None),
        (DraftModel, 3, None),
        (DraftModel, 3, Some(letters)),
    ] {
        let mut req = request("the cat", 200, method);
        req.num_speculative_tokens = k;
        req.structured_output = format;
        let want = generate(&url, req.clone()).await.unwrap();
        let mut stream = open_stream(&url, req).await;
        let mut out = Completion::default();
        // Not reading holds the generation a few rounds ahead of the reader.
        out.add(stream.message().await.unwrap().unwrap());
        let mut serving = None;
        for (i, t) in targets.iter().enumerate() {
            if worker_sessions(&t.url()).await == 1 {
                serving = Some(i);
            }
        }
        let serving = serving.expect("one replica holds the session");
        targets[serving].kill();
        out.read_rest(&mut stream, |_| {})
            .await
            .unwrap_or_else(|e| panic!("{method:?}: {e:?}"));
        assert_eq!(out.token_ids, want.token_ids, "{method:?}");
        assert_eq!(out.finish_reason, want.finish_reason);
        let failovers = &out.usage.target_failovers;
        assert_eq!(failovers.len(), 1, "{method:?}: {failovers:?}");
        assert!(
            failovers[0].at_completion_tokens > 0
                && failovers[0].at_completion_tokens < out.usage.completion_tokens,
            "{failovers:?}"
        );
        assert!(
            failovers[0]
                .reason
                .starts_with(&format!("target-worker at {}: ", targets[serving].addr)),
            "{failovers:?}"
        );
        // The next request runs on the survivor; bring the dead one back for the next case.
        let survivor = &targets[1 - serving];
        wait_sessions_closed(&survivor.url(), Duration::from_secs(5)).await;
        targets[serving] = start_target_at(worker_config(&m.target), targets[serving].addr);
        wait_serving(&targets[serving].url(), "").await;
    }
    let scraped = scrape(&coordinator).await;
    assert_eq!(sample(&scraped, "duet_target_failovers_total"), 3.0);
}

/// SIGTERM on a target-worker mid-request: it stops taking new sessions but serves the open
/// one to the end (a rolling update loses no request), then stops.
#[tokio::test]
async fn a_draining_target_worker_finishes_its_running_requests() {
    let (_m, stack) = tiny_stack().await;
    let url = stack.coordinator.url();
    let want = generate(&url, request("the cat", 120, DraftModel))
        .await
        .unwrap();
    let mut stream = open_stream(&url, request("the cat", 120, DraftModel)).await;
    let mut out = Completion::default();
    // Not reading fills the stream's buffer and holds the generation mid-way.
    out.add(stream.message().await.unwrap().unwrap());
    stack.target.shutdown.trigger();
    wait_health(&stack.target.url(), "", ServingStatus::NotServing).await;
    let refused = generate(&url, request("a b", 5, TargetOnly))
        .await
        .expect_err("a draining worker took a new session");
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
    assert!(
        refused.message().starts_with("target-worker at ")
            && refused.message().contains("shutting down"),
        "{refused:?}"
    );
    out.read_rest(&mut stream, |_| {}).await.unwrap();
    assert_eq!(out.finish_reason, Some(pb::FinishReason::Length as i32));
    assert_eq!(out.token_ids, want.token_ids);
    // Its last session closed: the worker stops.
    let deadline = Instant::now() + Duration::from_secs(10);
    while tokio::net::TcpStream::connect(stack.target.addr)
        .await
        .is_ok()
    {
        assert!(
            Instant::now() < deadline,
            "the drained worker is still listening"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A tiny model of the tiny models' vocabulary at `path`, wide and deep enough that its
/// passes take milliseconds.
fn write_slow_model(path: &std::path::Path) {
    let model = duet_engine::testing::TinyModel {
        layers: 8,
        hidden: 512,
        heads: 8,
        kv_heads: 4,
        ffn_hidden: 2048,
        ..Default::default()
    };
    model.write(path).unwrap();
}
