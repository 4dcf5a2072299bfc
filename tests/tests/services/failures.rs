//! Workers down, killed or slow; clients that stop reading or cancel; concurrent streams.

use super::*;

#[tokio::test]
async fn target_down_is_unavailable_quickly() {
    // A port that was just free: nothing listens there.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let coordinator = start_coordinator(coordinator_config(&format!("http://{port}"), None));
    let started = Instant::now();
    let err = generate(&coordinator.url(), request("the cat", 8, TargetOnly))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert!(err.message().contains("target-worker"), "{}", err.message());
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    // Not ready, yet alive: a liveness probe must not restart it for its dependency.
    let mut health = tonic_health::pb::health_client::HealthClient::new(
        tonic::transport::Channel::from_shared(coordinator.url())
            .unwrap()
            .connect()
            .await
            .unwrap(),
    );
    let check = |service: &str| tonic_health::pb::HealthCheckRequest {
        service: service.into(),
    };
    let status = |r: tonic::Response<tonic_health::pb::HealthCheckResponse>| r.into_inner().status;
    let serving = tonic_health::pb::health_check_response::ServingStatus::Serving as i32;
    assert_ne!(status(health.check(check("")).await.unwrap()), serving);
    assert_eq!(
        status(health.check(check("liveness")).await.unwrap()),
        serving
    );
    // The same on the metrics port, for HTTP probes.
    assert_eq!(http_status(&coordinator, "/readyz").await, 503);
    assert_eq!(http_status(&coordinator, "/livez").await, 200);
}

/// A ready stack answers its HTTP probes 200 on every service.
#[tokio::test]
async fn http_probes_follow_health() {
    let (_m, stack) = tiny_stack().await;
    for service in [&stack.draft, &stack.target, &stack.coordinator] {
        assert_eq!(http_status(service, "/readyz").await, 200);
        assert_eq!(http_status(service, "/livez").await, 200);
    }
}

#[tokio::test]
async fn draft_down_falls_back_and_recovers() {
    let m = tiny_models();
    let mut draft = start_draft(worker_config(&m.draft));
    let addr = draft.addr;
    let target = start_target(worker_config(&m.target));
    let coordinator = start_coordinator(coordinator_config(&target.url(), Some(&draft.url())));
    wait_serving(&coordinator.url(), "duet.v1.DraftWorker").await;
    let url = coordinator.url();
    let plain = generate(&url, request("the cat", 30, TargetOnly))
        .await
        .unwrap();

    draft.kill();
    let g = generate(&url, request("the cat", 30, DraftModel))
        .await
        .unwrap();
    assert_eq!(g.token_ids, plain.token_ids);
    assert!(g.usage.fell_back_to_target_only);
    assert!(!g.usage.fallback_reason.is_empty());
    // The failure tripped the breaker once; the probe's failing checks are no more trips.
    let scraped = scrape(&coordinator).await;
    assert_eq!(sample(&scraped, "duet_draft_breaker_open"), 1.0);
    assert_eq!(sample(&scraped, "duet_draft_breaker_trips_total"), 1.0);

    // A draft-worker back on the same address: once its health check passes the breaker
    // is half-open, the next request is the trial, and the trial's success closes it.
    let mut config = worker_config(&m.draft);
    config.listen = addr.to_string();
    let draft = start_draft_at(config, addr);
    wait_serving(&draft.url(), "").await;
    let deadline = Instant::now() + Duration::from_secs(10);
    let trial = loop {
        let g = generate(&url, request("the cat", 30, DraftModel))
            .await
            .unwrap();
        if !g.usage.fell_back_to_target_only {
            break g;
        }
        assert!(Instant::now() < deadline, "no trial request: {:?}", g.usage);
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(trial.token_ids, plain.token_ids);
    wait_serving(&url, "duet.v1.DraftWorker").await;
    assert_eq!(
        sample(&scrape(&coordinator).await, "duet_draft_breaker_open"),
        0.0
    );
    let g = generate(&url, request("the cat", 30, DraftModel))
        .await
        .unwrap();
    assert!(
        !g.usage.fell_back_to_target_only,
        "{}",
        g.usage.fallback_reason
    );
    assert_eq!(g.token_ids, plain.token_ids);
}

#[tokio::test]
async fn draft_killed_mid_stream_completes_target_only() {
    let (_m, mut stack) = tiny_stack().await;
    let url = stack.coordinator.url();
    let plain = generate(&url, request("the cat", 200, TargetOnly))
        .await
        .unwrap();
    let mut req = request("the cat", 200, DraftModel);
    req.num_speculative_tokens = 2;
    let mut stream = open_stream(&url, req).await;
    let mut out = Completion::default();
    // The first message is a target-only step (the draft session opens after it on shared
    // cores), the second a drafted round.
    for _ in 0..2 {
        out.add(stream.message().await.unwrap().unwrap());
    }
    stack.draft.kill();
    out.read_rest(&mut stream, |_| {}).await.unwrap();
    assert_eq!(out.token_ids, plain.token_ids);
    let usage = out.usage;
    // Speculation ran before the kill...
    assert!(usage.draft_tokens_proposed > 0);
    // ...and the stream was at most 9 rounds ahead of the reader when the draft died, with
    // 200 tokens to go (the tiny target does not stop early here), so the rest ran
    // target-only.
    assert_eq!(plain.finish_reason, Some(pb::FinishReason::Length as i32));
    assert!(usage.fell_back_to_target_only);
}

/// A client of `url` whose HTTP/2 windows are a few bytes: the server can send almost
/// nothing it has not read.
async fn narrow_window_client(
    url: &str,
) -> duet_proto::v1::generation_client::GenerationClient<tonic::transport::Channel> {
    let channel = tonic::transport::Endpoint::from_shared(url.to_string())
        .unwrap()
        .initial_stream_window_size(Some(16))
        .initial_connection_window_size(Some(16))
        .connect()
        .await
        .unwrap();
    duet_proto::v1::generation_client::GenerationClient::new(channel)
}

/// A client that stops reading (its HTTP/2 window full, the stream still open) loses its
/// generation after `limits.stream_stall_timeout_ms`: both sessions are freed and the
/// metric counts it.
#[tokio::test]
async fn a_client_that_stops_reading_is_cut_off() {
    let m = tiny_models();
    let draft = start_draft(worker_config(&m.draft));
    let target = start_target(worker_config(&m.target));
    let mut config = coordinator_config(&target.url(), Some(&draft.url()));
    config.limits.stream_stall_timeout_ms = 300;
    let coordinator = start_coordinator(config);
    for url in [draft.url(), target.url(), coordinator.url()] {
        wait_serving(&url, "").await;
    }
    let mut client = narrow_window_client(&coordinator.url()).await;
    let mut stream = client
        .generate(request("the cat", 200, DraftModel))
        .await
        .unwrap()
        .into_inner();
    stream.message().await.unwrap().unwrap();
    // Reads no more.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let stalled = sample(&scrape(&coordinator).await, "duet_stalled_streams_total");
        if stalled == 1.0 {
            break;
        }
        assert!(Instant::now() < deadline, "never cut off");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    wait_sessions_closed(&target.url(), Duration::from_secs(5)).await;
    wait_sessions_closed(&draft.url(), Duration::from_secs(5)).await;
    drop(stream);
}

/// A client that reads one message every 200 ms never stalls, yet its request ends at
/// `limits.request_timeout_ms` (here 1 s): `DEADLINE_EXCEEDED` after what it read, and its
/// sessions freed.
#[tokio::test]
async fn a_slow_reader_is_cut_off_at_the_request_deadline() {
    let m = tiny_models();
    let target = start_target(worker_config(&m.target));
    let mut config = coordinator_config(&target.url(), None);
    config.limits.request_timeout_ms = 1000;
    let coordinator = start_coordinator(config);
    wait_serving(&coordinator.url(), "").await;
    let mut client = narrow_window_client(&coordinator.url()).await;
    let started = Instant::now();
    let mut stream = client
        .generate(request("the cat", 200, TargetOnly))
        .await
        .unwrap()
        .into_inner();
    let mut read = 0;
    let ended = loop {
        match stream.message().await {
            Ok(Some(_)) => read += 1,
            Ok(None) => panic!("finished whole after {read} messages"),
            Err(status) => break status,
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(ended.code(), Code::DeadlineExceeded, "{ended:?}");
    assert!(
        ended
            .message()
            .contains("limits.request_timeout_ms (1000 ms)"),
        "{ended:?}"
    );
    assert!(
        read < 50 && started.elapsed() < Duration::from_secs(10),
        "{read}"
    );
    wait_sessions_closed(&target.url(), Duration::from_secs(5)).await;
}

#[tokio::test]
async fn cancelling_frees_the_sessions() {
    let (_m, stack) = tiny_stack().await;
    let url = stack.coordinator.url();
    let mut stream = open_stream(&url, request("the cat", 200, DraftModel)).await;
    stream.message().await.unwrap().unwrap();
    assert_eq!(worker_sessions(&stack.target.url()).await, 1);
    drop(stream);
    wait_no_sessions(&stack, Duration::from_secs(5)).await;
}

#[tokio::test]
async fn concurrent_streams_are_independent() {
    let (_m, stack) = tiny_stack().await;
    let url = stack.coordinator.url();
    let prompts = ["the cat", "def f(x):", "hello world", "12345"];
    let mut expected = Vec::new();
    for p in prompts {
        expected.push(
            generate(&url, request(p, 30, TargetOnly))
                .await
                .unwrap()
                .token_ids,
        );
    }
    // Every method at once: target passes and draft passes batch calls of several sessions.
    let methods = [DraftModel, TargetOnly, Ngram, Auto];
    let runs = prompts.iter().flat_map(|&p| {
        let url = url.clone();
        methods.map(move |m| {
            let url = url.clone();
            tokio::spawn(async move { generate(&url, request(p, 30, m)).await })
        })
    });
    let results = futures::future::join_all(runs).await;
    for (i, r) in results.into_iter().enumerate() {
        let (p, m) = (i / methods.len(), methods[i % methods.len()]);
        assert_eq!(
            r.unwrap().unwrap().token_ids,
            expected[p],
            "stream {i}: {m:?}"
        );
    }
}
