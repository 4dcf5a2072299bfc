//! Shutdown and health, reflection, and the workers' own calls: sessions' lifetimes, Verify,
//! Decode and Propose.

use super::*;

#[tokio::test]
async fn shutdown_drains_running_streams() {
    let (_m, stack) = tiny_stack().await;
    let url = stack.coordinator.url();
    let mut stream = open_stream(&url, request("the cat", 120, DraftModel)).await;
    stream.message().await.unwrap().unwrap();
    stack.coordinator.shutdown.trigger();
    let mut finish = None;
    while let Some(m) = stream.message().await.unwrap() {
        if let Some(pb::generate_response::Event::Finished(f)) = m.event {
            finish = Some(f.finish_reason);
        }
    }
    // The running stream ended normally, not with CANCELLED or an error.
    let finish = finish.expect("a final message");
    assert_ne!(finish, pb::FinishReason::Cancelled as i32);
    // New connections are refused once the stream is done.
    let again = duet_proto::v1::generation_client::GenerationClient::connect(url).await;
    assert!(again.is_err());
}

/// While running streams drain, the coordinator's health stays NOT_SERVING: its checks of
/// the target-worker (every 50 ms here) must not turn it back to SERVING.
#[tokio::test]
async fn health_stays_not_serving_while_draining() {
    let (_m, stack) = tiny_stack().await;
    let url = stack.coordinator.url();
    // Opened before the signal: the draining server takes no new calls.
    let mut health = watch_health(&url).await;
    let first = health.message().await.unwrap().unwrap();
    assert_eq!(first.status, ServingStatus::Serving as i32);
    // A stream left unread keeps the drain going (its generation waits on it).
    let mut stream = open_stream(&url, request("the cat", 200, DraftModel)).await;
    stream.message().await.unwrap().unwrap();
    stack.coordinator.shutdown.trigger();
    // (Each target health check reports again, so SERVING may repeat until the signal.)
    wait_not_serving(&mut health, Duration::from_secs(5)).await;
    // Ten target health checks later, never SERVING again.
    let serving_again = async {
        while let Some(m) = health.message().await.unwrap() {
            assert_eq!(
                m.status,
                ServingStatus::NotServing as i32,
                "SERVING while draining"
            );
        }
    };
    let _ = tokio::time::timeout(Duration::from_millis(500), serving_again).await;
    drop(stream);
}

/// grpcurl 1.8 speaks reflection v1alpha only, newer tools v1: both list what is served.
#[tokio::test]
async fn reflection_v1_and_v1alpha_list_the_services() {
    use tonic_reflection::pb::{v1, v1alpha};
    let (_m, stack) = tiny_stack().await;
    for (url, service) in [
        (stack.coordinator.url(), "duet.v1.Generation"),
        (stack.draft.url(), "duet.v1.DraftWorker"),
        (stack.target.url(), "duet.v1.TargetWorker"),
    ] {
        let channel = tonic::transport::Channel::from_shared(url.clone())
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut c = v1::server_reflection_client::ServerReflectionClient::new(channel.clone());
        let request = v1::ServerReflectionRequest {
            host: String::new(),
            message_request: Some(v1::server_reflection_request::MessageRequest::ListServices(
                String::new(),
            )),
        };
        let mut answers = c
            .server_reflection_info(tokio_stream::once(request))
            .await
            .unwrap()
            .into_inner();
        let Some(v1::server_reflection_response::MessageResponse::ListServicesResponse(list)) =
            answers.message().await.unwrap().unwrap().message_response
        else {
            panic!("no service list from {url}");
        };
        let names: Vec<_> = list.service.into_iter().map(|s| s.name).collect();
        assert!(names.contains(&service.to_string()), "{names:?}");
        assert!(
            names.contains(&"grpc.health.v1.Health".to_string()),
            "{names:?}"
        );

        let mut c = v1alpha::server_reflection_client::ServerReflectionClient::new(channel);
        let request = v1alpha::ServerReflectionRequest {
            host: String::new(),
            message_request: Some(
                v1alpha::server_reflection_request::MessageRequest::FileContainingSymbol(
                    service.to_string(),
                ),
            ),
        };
        let mut answers = c
            .server_reflection_info(tokio_stream::once(request))
            .await
            .unwrap()
            .into_inner();
        let answer = answers.message().await.unwrap().unwrap().message_response;
        assert!(
            matches!(
                answer,
                Some(
                    v1alpha::server_reflection_response::MessageResponse::FileDescriptorResponse(_)
                )
            ),
            "{url}: {answer:?}"
        );
    }
}

/// A coordinator that vanishes leaves sessions behind; the worker's idle TTL closes them.
#[tokio::test]
async fn idle_sessions_expire_on_the_worker() {
    use duet_proto::v1::target_worker_client::TargetWorkerClient;
    use duet_proto::v1::worker_client::WorkerClient;
    let m = tiny_models();
    let mut config = worker_config(&m.target);
    config.session_ttl_ms = 100;
    let target = start_target(config);
    wait_serving(&target.url(), "").await;
    let mut c = WorkerClient::connect(target.url()).await.unwrap();
    let opened = open_session(&target.url(), 16).await;
    assert_eq!(opened.cache_len, 2);
    let stats = c.stats(pb::StatsRequest {}).await.unwrap().into_inner();
    assert_eq!((stats.active_sessions, stats.kv_tokens_reserved), (1, 16));
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let stats = c.stats(pb::StatsRequest {}).await.unwrap().into_inner();
        if stats.active_sessions == 0 {
            assert_eq!(stats.sessions_expired, 1);
            assert_eq!(stats.kv_tokens_reserved, 0);
            break;
        }
        assert!(Instant::now() < deadline, "session not expired: {stats:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut verify = TargetWorkerClient::connect(target.url()).await.unwrap();
    let err = verify
        .verify(pb::VerifyRequest {
            session_id: opened.session_id,
            instance_id: opened.instance_id,
            keep: 2,
            append: vec![3],
            draft: vec![],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
}

/// A session that takes over another's sequence (a failover's reopen: `generated_after`, the
/// first session's prompt length) answers as that session does, bit for bit: its prompt
/// prefilled as the first one's was, the generated tokens fed as its calls fed them. On a GPU,
/// where a prefill computes a row otherwise than a call does, this keeps a failover's text
/// the target's. A `generated_after` past the prompt is refused, naming the field, and so
/// are more than 20 most likely tokens' log-probabilities.
#[tokio::test]
async fn a_session_taking_over_a_sequence_answers_as_the_one_that_generated_it() {
    use duet_proto::v1::target_worker_client::TargetWorkerClient;
    use duet_proto::v1::worker_client::WorkerClient;
    let (_m, target) = serving_target().await;
    let mut w = WorkerClient::connect(target.url()).await.unwrap();
    let mut v = TargetWorkerClient::connect(target.url()).await.unwrap();
    let open = |prompt: Vec<u32>, generated_after: u32| pb::OpenSessionRequest {
        prompt,
        capacity: 64,
        sampling: Some(pb::SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            ..Default::default()
        }),
        generated_after,
        ..Default::default()
    };
    let call = |s: &pb::OpenSessionResponse, keep: usize, append: &[u32]| pb::VerifyRequest {
        session_id: s.session_id.clone(),
        instance_id: s.instance_id,
        keep: keep as u32,
        append: append.to_vec(),
        ..Default::default()
    };
    let prompt: Vec<u32> = (1..=24).collect();
    let seq: Vec<u32> = prompt.iter().copied().chain(40..52).collect();
    // The first session: its prompt, then calls appending three tokens each, up to all but
    // the last generated token.
    let first = w.open_session(open(prompt.clone(), 0)).await.unwrap();
    let first = first.into_inner();
    for keep in (prompt.len() - 1..seq.len() - 1).step_by(3) {
        v.verify(call(&first, keep, &seq[keep..keep + 3]))
            .await
            .unwrap();
    }
    let taken = w.open_session(open(seq.clone(), 24)).await.unwrap();
    let taken = taken.into_inner();
    assert_eq!(taken.cache_len as usize, seq.len() - 1);
    let keep = seq.len() - 1;
    let want = v.verify(call(&first, keep, &seq[keep..])).await.unwrap();
    let got = v.verify(call(&taken, keep, &seq[keep..])).await.unwrap();
    assert_eq!(got.into_inner().p, want.into_inner().p);

    let err = w.open_session(open(seq.clone(), 37)).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(
        err.message().starts_with("generated_after: 37 is past"),
        "{err:?}"
    );
    let too_many = pb::OpenSessionRequest {
        top_logprobs: Some(21),
        ..open(prompt, 0)
    };
    let err = w.open_session(too_many).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert_eq!(err.message(), "top_logprobs: 21 is over 20");
}

/// A Verify may append only what a round commits (at most 64 tokens): a longer one would be
/// a prefill inside a batched verification pass.
#[tokio::test]
async fn verify_appends_are_bounded() {
    use duet_proto::v1::target_worker_client::TargetWorkerClient;
    let (_m, target) = serving_target().await;
    let s = open_session(&target.url(), 200).await;
    let mut verify = TargetWorkerClient::connect(target.url()).await.unwrap();
    let call = |append: usize| pb::VerifyRequest {
        session_id: s.session_id.clone(),
        instance_id: s.instance_id,
        keep: 2,
        append: vec![3; append],
        draft: vec![],
        ..Default::default()
    };
    let err = verify.verify(call(65)).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(
        err.message().starts_with("append: 65 tokens; at most 64"),
        "{err:?}"
    );
    let ok = verify.verify(call(64)).await.unwrap().into_inner();
    assert_eq!(ok.argmax.len(), 1);
}

/// A Decode stream answers what Verify calls without drafts answer, one token per step
/// (each fed before the next is answered); it ends after `max_tokens` or a stop token. A
/// caller that stops reading goes on with a Verify whose `keep` drops what the stream fed
/// beyond what it took. `max_tokens` 0 is refused, naming the field. A sampling session's
/// tokens are drawn ([`decode_draws_as_the_caller_would`]).
#[tokio::test]
async fn a_decode_stream_answers_as_verify_steps_do() {
    use duet_proto::v1::target_worker_client::TargetWorkerClient;
    let (_m, target) = serving_target().await;
    let mut c = TargetWorkerClient::connect(target.url()).await.unwrap();
    // The reference: eight Verify steps without drafts from the prompt [1, 2, 3].
    let s = open_session(&target.url(), 64).await;
    let verify = |keep: usize, append: Vec<u32>| pb::VerifyRequest {
        session_id: s.session_id.clone(),
        instance_id: s.instance_id,
        keep: keep as u32,
        append,
        ..Default::default()
    };
    let mut seq = vec![1u32, 2, 3];
    for _ in 0..8 {
        let keep = seq.len() - 1;
        let answer = c.verify(verify(keep, vec![seq[keep]])).await.unwrap();
        seq.push(answer.into_inner().argmax[0]);
    }
    let want = seq[3..].to_vec();

    let d = open_session(&target.url(), 64).await;
    let decode = |max_tokens: u32, stop_tokens: Vec<u32>| pb::DecodeRequest {
        session_id: d.session_id.clone(),
        instance_id: d.instance_id,
        keep: 2,
        append: vec![3],
        max_tokens,
        stop_tokens,
        rng_position: 0,
        lookup: None,
    };
    let read = async |stream: &mut tonic::Streaming<pb::DecodeResponse>| {
        let mut tokens = Vec::new();
        while let Some(m) = stream.message().await.unwrap() {
            assert!(m.timing.unwrap().forward_us > 0);
            assert_eq!(m.rng_position, None, "a greedy session draws nothing");
            tokens.push(m.token);
        }
        tokens
    };
    let mut all = c.decode(decode(8, vec![])).await.unwrap().into_inner();
    assert_eq!(read(&mut all).await, want);
    let mut stopped = c
        .decode(decode(8, vec![want[4]]))
        .await
        .unwrap()
        .into_inner();
    let upto = want.iter().position(|&t| t == want[4]).unwrap();
    assert_eq!(read(&mut stopped).await, want[..=upto]);

    // Three tokens read, the stream dropped: a Verify from the three goes on as the
    // reference did, whatever the steps queued meanwhile fed.
    let mut cut = c.decode(decode(8, vec![])).await.unwrap().into_inner();
    for want in &want[..3] {
        assert_eq!(cut.message().await.unwrap().unwrap().token, *want);
    }
    drop(cut);
    let keep = 3 + 2;
    let on = pb::VerifyRequest {
        session_id: d.session_id.clone(),
        instance_id: d.instance_id,
        keep: keep as u32,
        append: vec![want[2]],
        draft: want[3..6].to_vec(),
        ..Default::default()
    };
    let argmax = c.verify(on).await.unwrap().into_inner().argmax;
    assert_eq!(argmax, want[3..7]);

    let err = c.decode(decode(0, vec![])).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().starts_with("max_tokens:"), "{err:?}");
    decode_draws_as_the_caller_would(&mut c, &target.url()).await;
}

/// A sampling session's Decode tokens are drawn where a caller of Verify would draw them
/// from each step's p (rejection sampling without drafts, the seed's random stream), and
/// each answer says where the stream then stands: two words on a token. A stream dropped
/// after three tokens and started again from there (with the position the third answer
/// gave) goes on with the same tokens.
async fn decode_draws_as_the_caller_would(
    c: &mut duet_proto::v1::target_worker_client::TargetWorkerClient<tonic::transport::Channel>,
    url: &str,
) {
    use duet_engine::sampling::rng_for;
    use duet_engine::verify::verify_sampling_tree;
    let s = open_sampling_session(url, 64).await;
    let mut rng = rng_for(0);
    let mut seq = vec![1u32, 2, 3];
    for _ in 0..8 {
        let keep = seq.len() - 1;
        let step = pb::VerifyRequest {
            session_id: s.session_id.clone(),
            instance_id: s.instance_id,
            keep: keep as u32,
            append: vec![seq[keep]],
            ..Default::default()
        };
        let p = c.verify(step).await.unwrap().into_inner().p;
        let p = [duet_serving::wire::decode_distribution(&p[0]).unwrap()];
        seq.push(verify_sampling_tree(&[], &[], &[], &p, &mut rng).unwrap().1);
    }
    let want = seq[3..].to_vec();
    let d = open_sampling_session(url, 64).await;
    let decode = |keep: usize, rng_position: u64| pb::DecodeRequest {
        session_id: d.session_id.clone(),
        instance_id: d.instance_id,
        keep: keep as u32,
        append: vec![seq[keep]],
        max_tokens: (seq.len() - 1 - keep) as u32,
        rng_position,
        ..Default::default()
    };
    let mut all = c.decode(decode(2, 0)).await.unwrap().into_inner();
    let mut got = Vec::new();
    while let Some(m) = all.message().await.unwrap() {
        got.push((m.token, m.rng_position));
    }
    let drawn: Vec<_> = (1..=8).map(|i| Some(2 * i)).collect();
    assert_eq!(got, want.iter().copied().zip(drawn).collect::<Vec<_>>());
    let mut cut = c.decode(decode(2, 0)).await.unwrap().into_inner();
    for _ in 0..3 {
        cut.message().await.unwrap().unwrap();
    }
    drop(cut);
    let mut on = c.decode(decode(5, 6)).await.unwrap().into_inner();
    let mut rest = Vec::new();
    while let Some(m) = on.message().await.unwrap() {
        rest.push(m.token);
    }
    assert_eq!(rest, want[3..]);
}

/// A Verify with a `SamplingTest` answers what the caller would decide from the whole
/// answer (every p): the engine's `test_sampled` on the p a Verify without the test gives
/// for the same call, at the stream position given, and p at the rejected draft where the
/// correction is the caller's (not for point masses or q's sent whole, whose correction is
/// drawn there). Over the cases: drafts all accepted (q half of p), one rejected (q 1,
/// alone, as point masses, or whole). A test that does not fit its chain is refused,
/// naming the field; a greedy session ignores it.
#[tokio::test]
async fn a_verify_tests_a_sampling_chain_as_the_caller_would() {
    use duet_engine::sampling::{Distribution, rng_at};
    use duet_engine::verify::{Drafted, rows, test_sampled};
    use duet_proto::v1::target_worker_client::TargetWorkerClient;
    use duet_serving::wire::{decode_distribution, encode_sparse};
    let (_m, target) = serving_target().await;
    let mut c = TargetWorkerClient::connect(target.url()).await.unwrap();
    let s = open_sampling_session(&target.url(), 64).await;
    let draft = vec![7u32, 9, 11];
    let verify = |sampling_test| pb::VerifyRequest {
        session_id: s.session_id.clone(),
        instance_id: s.instance_id,
        keep: 2,
        append: vec![3],
        draft: draft.clone(),
        sampling_test,
        ..Default::default()
    };
    let p = c.verify(verify(None)).await.unwrap().into_inner().p;
    let p: Vec<_> = p.iter().map(|d| decode_distribution(d).unwrap()).collect();
    let half: Vec<f32> = draft
        .iter()
        .zip(&p)
        .map(|(&x, p)| p.prob(x) / 2.0)
        .collect();
    let points: Vec<_> = draft.iter().map(|&x| Distribution::point(x)).collect();
    let whole: Vec<_> = (draft.iter())
        .map(|&x| Distribution::from_pairs([(x, 0.75), (x + 1, 0.25)]).unwrap())
        .collect();
    let (mut all_accepted, mut left_to_us, mut drawn_there) = (0, 0, 0);
    let cases = [
        (Drafted::Probabilities(&half), false),
        (Drafted::Probabilities(&[1.0; 3]), false),
        (Drafted::Whole(&points), true),
        (Drafted::Whole(&whole), false),
    ];
    for (drafted, point_masses) in cases {
        let (q, whole_q): (Vec<f32>, _) = match drafted {
            Drafted::Probabilities(q) => (q.to_vec(), Vec::new()),
            Drafted::Whole(_) if point_masses => (vec![1.0; 3], Vec::new()),
            Drafted::Whole(qs) => {
                let q = draft.iter().zip(qs).map(|(&x, q)| q.prob(x)).collect();
                (q, qs.iter().map(encode_sparse).collect())
            }
        };
        for rng_position in [0, 2, 10] {
            let test = pb::SamplingTest {
                q: q.clone(),
                point_masses,
                rng_position,
                whole_q: whole_q.clone(),
            };
            let answer = c.verify(verify(Some(test))).await.unwrap().into_inner();
            let mut rng = rng_at(0, rng_position);
            let (want, _) = test_sampled(&draft, drafted, rows(&p), &mut rng).unwrap();
            let verdict = pb::SamplingVerdict {
                accepted: want.accepted as u32,
                token: want.token,
                rng_position: duet_engine::sampling::rng_position(&rng),
            };
            assert_eq!(answer.verdict, Some(verdict), "{q:?} at {rng_position}");
            let rejected_p: Vec<_> = answer
                .p
                .iter()
                .map(|d| decode_distribution(d).unwrap())
                .collect();
            match want.token {
                Some(_) => assert!(rejected_p.is_empty()),
                None => assert_eq!(rejected_p, [p[want.accepted].clone()]),
            }
            assert!(answer.argmax.is_empty());
            all_accepted += usize::from(want.accepted == 3);
            left_to_us += usize::from(want.token.is_none());
            drawn_there += usize::from(!whole_q.is_empty() && want.accepted < 3);
        }
    }
    assert_eq!((all_accepted, left_to_us, drawn_there), (3, 3, 3));

    let refused = |q: Vec<f32>| pb::SamplingTest {
        q,
        ..Default::default()
    };
    let with_whole = |q: Vec<f32>, whole_q: Vec<pb::Distribution>| pb::SamplingTest {
        q,
        whole_q,
        ..Default::default()
    };
    let wire: Vec<_> = whole.iter().map(encode_sparse).collect();
    let beyond = pb::Distribution {
        ids: vec![7, 1 << 30],
        probs: vec![0.75, 0.25],
    };
    for (test, why) in [
        (refused(vec![0.5; 2]), "2 probabilities for 3 drafts"),
        (refused(vec![0.5, 1.5, 0.5]), "1.5, not in [0, 1]"),
        (
            with_whole(vec![0.75; 3], wire[..2].to_vec()),
            "2 distributions for 3 drafts",
        ),
        (
            with_whole(vec![0.5; 3], wire.clone()),
            "draft 0: gives token 7 0.75, not q's 0.5",
        ),
        (
            with_whole(
                vec![0.75; 3],
                vec![beyond, wire[1].clone(), wire[2].clone()],
            ),
            "draft 0: beyond the vocabulary",
        ),
        (
            pb::SamplingTest {
                point_masses: true,
                ..with_whole(vec![0.75; 3], wire.clone())
            },
            "whole_q and point_masses both given",
        ),
    ] {
        let err = c.verify(verify(Some(test))).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        assert!(err.message().starts_with("sampling_test"), "{err:?}");
        assert!(err.message().contains(why), "{err:?}");
    }
    let greedy = open_session(&target.url(), 64).await;
    let call = pb::VerifyRequest {
        session_id: greedy.session_id.clone(),
        instance_id: greedy.instance_id,
        sampling_test: Some(refused(vec![1.0; 3])),
        ..verify(None)
    };
    let answer = c.verify(call).await.unwrap().into_inner();
    assert_eq!((answer.argmax.len(), answer.verdict), (4, None));
}

/// A sampling NONE request streams its tokens from the target (drawn there where the
/// coordinator would draw them): each seed gives the text it gives a coordinator that
/// verifies a token a call (`target_streams = false`), on the same workers.
#[tokio::test]
async fn a_sampling_request_streamed_gives_its_seeds_text() {
    let (_m, stack) = tiny_stack().await;
    let mut config = coordinator_config(&stack.target.url(), Some(&stack.draft.url()));
    config.speculation.target_streams = false;
    let stepped = start_coordinator(config);
    wait_serving(&stepped.url(), "duet.v1.DraftWorker").await;
    let mut texts = std::collections::BTreeSet::new();
    for seed in 0..4 {
        let req = pb::GenerateRequest {
            temperature: 1.0,
            seed,
            ..request("the cat", 24, TargetOnly)
        };
        let streamed = generate(&stack.coordinator.url(), req.clone()).await;
        let verified = generate(&stepped.url(), req).await.unwrap();
        assert_eq!(
            streamed.unwrap().token_ids,
            verified.token_ids,
            "seed {seed}"
        );
        texts.insert(verified.token_ids);
    }
    assert_eq!(texts.len(), 4, "each seed its own text");
    let streamed = "duet_target_streamed_tokens_total";
    assert_eq!(sample(&scrape(&stack.coordinator).await, streamed), 96.0);
    assert_eq!(sample(&scrape(&stepped).await, streamed), 0.0);
}

/// A Propose may append at most 64 tokens (the coordinator feeds a draft that fell further
/// behind in pieces): a longer one would be a prefill inside a batched drafting pass.
#[tokio::test]
async fn propose_appends_are_bounded() {
    use duet_proto::v1::draft_worker_client::DraftWorkerClient;
    let (_m, draft) = serving_draft().await;
    let s = open_session(&draft.url(), 200).await;
    let mut c = DraftWorkerClient::connect(draft.url()).await.unwrap();
    let call = |append: usize| pb::ProposeRequest {
        session_id: s.session_id.clone(),
        instance_id: s.instance_id,
        keep: 2,
        append: vec![3; append],
        k: 1,
        stop_below: 0.0,
        ..Default::default()
    };
    let err = c.propose(call(65)).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(
        err.message().starts_with("append: 65 tokens; at most 64"),
        "{err:?}"
    );
    let mut ok = c.propose(call(64)).await.unwrap().into_inner();
    assert!(ok.message().await.unwrap().is_some());
}

/// A Propose with `stop_below` may answer fewer tokens than asked: at 1.0 one token (no
/// draft of the tiny model is that sure), at 0 all of them; a value outside 0..=1 is
/// refused, naming the field.
#[tokio::test]
async fn a_propose_may_stop_early_below_a_joint_probability() {
    use duet_proto::v1::draft_worker_client::DraftWorkerClient;
    let (_m, draft) = serving_draft().await;
    let mut c = DraftWorkerClient::connect(draft.url()).await.unwrap();
    // Five tokens after a fresh session's prompt.
    let call = |s: pb::OpenSessionResponse, stop_below| pb::ProposeRequest {
        session_id: s.session_id,
        instance_id: s.instance_id,
        keep: 2,
        append: vec![3],
        k: 5,
        stop_below,
        ..Default::default()
    };
    for (stop_below, want) in [(0.0, 5), (1.0, 1)] {
        let s = open_session(&draft.url(), 64).await;
        let mut stream = c.propose(call(s, stop_below)).await.unwrap().into_inner();
        let mut got = Vec::new();
        while let Some(m) = stream.message().await.unwrap() {
            got.push(m);
        }
        assert_eq!(got.len(), want, "stop_below {stop_below}");
        assert!(
            got[want - 1].timing.is_some(),
            "the last one carries the timing"
        );
    }
    for bad in [1.5, -0.1, f32::NAN] {
        let s = open_session(&draft.url(), 64).await;
        let err = c.propose(call(s, bad)).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{bad}");
        assert!(err.message().starts_with("stop_below: "), "{err:?}");
    }
}

/// A draft-worker with `vocab_shortlist` drafts only the first ids, the special tokens (the
/// tiny vocabulary's last three) and its session's own tokens, and greedy speculation with
/// it still gives the target's own tokens. A target-worker refuses a shortlist: its tokens
/// are the output.
#[tokio::test]
async fn a_shortlisted_draft_drafts_its_ids_and_output_stays_exact() {
    use duet_proto::v1::draft_worker_client::DraftWorkerClient;
    let (m, stack) = tiny_stack_with(64).await;
    let vocab = duet_engine::testing::tiny_vocab_size() as u32;
    let kept = |t: u32| t < 64 || t >= vocab - 3;
    let mut c = DraftWorkerClient::connect(stack.draft.url()).await.unwrap();
    let mut drafted = 0;
    for start in [3, 100, 200, 265] {
        // The session's own tokens (its prompt, [1, 2, 3], and `append`) are its extra ids.
        let own = |t: u32| kept(t) || t == start;
        let s = open_session(&stack.draft.url(), 64).await;
        let call = pb::ProposeRequest {
            session_id: s.session_id,
            instance_id: s.instance_id,
            keep: 2,
            append: vec![start],
            k: 12,
            stop_below: 0.0,
            ..Default::default()
        };
        let mut stream = c.propose(call).await.unwrap().into_inner();
        while let Some(m) = stream.message().await.unwrap() {
            assert!(own(m.token), "after {start}: {}", m.token);
            drafted += 1;
        }
    }
    assert_eq!(drafted, 48);

    let url = stack.coordinator.url();
    for prompt in ["the cat", "def f(x):\n\treturn"] {
        let plain = generate(&url, request(prompt, 30, TargetOnly))
            .await
            .unwrap();
        // The target's own text leaves the shortlist, so some drafts must fail.
        assert!(plain.token_ids.iter().any(|&t| !kept(t)), "{prompt:?}");
        for (method, k) in [(DraftModel, 3), (Auto, 4)] {
            let mut req = request(prompt, 30, method);
            req.num_speculative_tokens = k;
            let spec = generate(&url, req).await.unwrap();
            assert_eq!(spec.token_ids, plain.token_ids, "{prompt:?} {method:?}");
            assert!(!spec.usage.fell_back_to_target_only);
        }
    }

    let mut target = worker_config(&m.target);
    target.vocab_shortlist = 64;
    assert_eq!(
        refused_start::<duet_target_worker::Verifier>(target).await,
        "configuration key `vocab_shortlist`: only a draft-worker may shortlist its \
         vocabulary: the target's tokens are the output"
    );
}

/// With every service's async threads polling instead of sleeping (`runtime.busy_poll_ms`),
/// gRPC calls and streams between the services and the HTTP API's answers, whole and
/// streamed, pass through the polling layer as before: greedy speculation is target-only's.
#[tokio::test]
async fn busy_polling_services_answer_as_sleeping_ones() {
    let m = tiny_models();
    let busy = duet_serving::startup::RuntimeConfig {
        async_threads: 2,
        busy_poll_ms: 5,
    };
    let (mut draft, mut target) = (worker_config(&m.draft), worker_config(&m.target));
    (draft.runtime, target.runtime) = (busy.clone(), busy.clone());
    let (draft, target) = (start_draft(draft), start_target(target));
    let mut config = coordinator_config(&target.url(), Some(&draft.url()));
    config.runtime = busy;
    let coordinator = start_coordinator(config);
    let stack = Stack {
        draft,
        target,
        coordinator,
    };
    wait_stack(&stack).await;
    let url = stack.coordinator.url();
    let plain = generate(&url, request("def f(x):", 24, TargetOnly));
    let plain = plain.await.unwrap();
    for method in [DraftModel, Ngram, Auto] {
        let spec = generate(&url, request("def f(x):", 24, method))
            .await
            .unwrap();
        assert_eq!(spec.token_ids, plain.token_ids, "{method:?}");
        assert!(!spec.usage.fell_back_to_target_only, "{method:?}");
    }
    let http_addr = stack.coordinator.http_addr;
    let body = serde_json::json!({"prompt": "def f(x):", "max_tokens": 24});
    let (status, answer) = post(http_addr, "/v1/completions", &body.to_string()).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(json_of(&answer)["choices"][0]["text"], plain.text.as_str());
    let body = serde_json::json!({"prompt": "def f(x):", "max_tokens": 24, "stream": true});
    let (status, stream) = post(http_addr, "/v1/completions", &body.to_string()).await;
    assert_eq!(status, 200, "{stream}");
    let events = events(&stream);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let text: String = events[..events.len() - 1]
        .iter()
        .map(|e| {
            json_of(e)["choices"][0]["text"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(text, plain.text);
}

/// A running request keeps a busy-polling service's async threads polling (the metrics say
/// how many), and they sleep again once it has gone, the coordinator's health checks and
/// reads of the target's KV use every 50 ms notwithstanding.
#[tokio::test]
async fn a_running_request_keeps_the_threads_polling() {
    // The test's services run on two async threads each.
    let busy = duet_serving::startup::RuntimeConfig {
        async_threads: 2,
        busy_poll_ms: 1_000,
    };
    let (_m, target, coordinator) = target_only(|c| c.runtime = busy.clone()).await;
    let mut config = coordinator_config(&target.url(), None);
    config.runtime = busy;
    let coordinator_busy = start_coordinator(config);
    wait_serving(&coordinator_busy.url(), "").await;
    drop(coordinator);
    let gauges = [
        (&coordinator_busy, "duet_busy_polling_threads"),
        (&target, "duet_worker_busy_polling_threads"),
    ];
    // Waits (at most 10 s) until every service has `want` threads polling.
    let polling = async |want: f64| {
        let deadline = Instant::now() + Duration::from_secs(10);
        for (service, name) in gauges {
            while sample(&scrape(service).await, name) != want {
                assert!(Instant::now() < deadline, "{name} never {want}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    polling(0.0).await;
    let mut stream =
        open_stream(&coordinator_busy.url(), request("the cat", 240, TargetOnly)).await;
    stream.message().await.unwrap().unwrap();
    // Both threads of each, while its tokens flow (or within a second after).
    polling(2.0).await;
    drop(stream);
    polling(0.0).await;
}
