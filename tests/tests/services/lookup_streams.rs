//! Prompt lookup inside a target-worker's Decode stream (`DecodeRequest.lookup`): the tokens
//! are those of a stream without it, and each pass verifies what the lookup finds.

use super::*;
use duet_engine::ngram::NgramIndex;
use duet_proto::v1::target_worker_client::TargetWorkerClient;
use tonic::transport::Channel;

/// Suffixes of 1 to 4 tokens; 4 drafts for a match of one token, 6 for longer ones.
fn lookup() -> pb::StreamLookup {
    pb::StreamLookup {
        min_match: 1,
        max_match: 4,
        drafts: vec![4, 6],
    }
}

/// A Decode of `max_tokens` from the tiny prompt [1, 2, 3] on a new session `s`.
fn decode_call(
    s: &pb::OpenSessionResponse,
    max_tokens: u32,
    stop_tokens: Vec<u32>,
    lookup: Option<pb::StreamLookup>,
) -> pb::DecodeRequest {
    pb::DecodeRequest {
        session_id: s.session_id.clone(),
        instance_id: s.instance_id,
        keep: 2,
        append: vec![3],
        max_tokens,
        stop_tokens,
        lookup,
        ..Default::default()
    }
}

/// Every answer of [`decode_call`]'s Decode.
async fn decoded(
    c: &mut TargetWorkerClient<Channel>,
    s: &pb::OpenSessionResponse,
    max_tokens: u32,
    stop_tokens: Vec<u32>,
    lookup: Option<pb::StreamLookup>,
) -> Vec<pb::DecodeResponse> {
    let call = decode_call(s, max_tokens, stop_tokens, lookup);
    let mut stream = c.decode(call).await.unwrap().into_inner();
    let mut answers = Vec::new();
    while let Some(m) = stream.message().await.unwrap() {
        answers.push(m);
    }
    answers
}

fn tokens(answers: &[pb::DecodeResponse]) -> Vec<u32> {
    answers.iter().map(|m| m.token).collect()
}

/// Each pass's figures (drafts, accepted, matched) as the stream must give them, the
/// lookup redone here over `want` (the tokens the target chooses) after the prompt.
fn passes_of(want: &[u32], max_tokens: usize) -> Vec<(Vec<u32>, u32, u32)> {
    let mut seq = vec![1u32, 2, 3];
    let mut index = NgramIndex::new(1, 4);
    let mut passes = Vec::new();
    while seq.len() - 3 < max_tokens {
        let room = max_tokens - (seq.len() - 3);
        index.extend(&seq);
        let (drafts, matched) = match index.lookup(&seq, 6.min(room - 1)) {
            Some(l) => {
                let k = if l.matched == 1 { 4 } else { 6 };
                (l.tokens[..k.min(l.tokens.len())].to_vec(), l.matched)
            }
            None => (vec![], 0),
        };
        let next = &want[seq.len() - 3..];
        let accepted = drafts.iter().zip(next).take_while(|(d, t)| d == t).count();
        let matched = if drafts.is_empty() { 0 } else { matched as u32 };
        passes.push((drafts, accepted as u32, matched));
        seq.extend(&next[..=accepted]);
    }
    passes
}

/// A greedy stream with lookup answers the tokens of one without it, whatever it cuts at
/// (`max_tokens`, a stop token among a pass's accepted drafts); each pass's first answer
/// carries the pass's timing and the drafts it verified as the lookup finds them over the
/// session's tokens, the accepted ones, and the suffix they followed; its other answers a
/// zero timing and no figures. A lookup out of bounds is refused, naming the field.
#[tokio::test]
async fn a_decode_stream_with_lookup_answers_the_tokens_of_one_without() {
    let (_m, target) = serving_target().await;
    let url = target.url();
    let mut c = TargetWorkerClient::connect(url.clone()).await.unwrap();
    let s = open_session(&url, 96).await;
    let want = tokens(&decoded(&mut c, &s, 48, vec![], None).await);
    let s = open_session(&url, 96).await;
    let answers = decoded(&mut c, &s, 48, vec![], Some(lookup())).await;
    assert_eq!(tokens(&answers), want);
    let firsts: Vec<_> = answers
        .iter()
        .filter(|m| m.timing.unwrap().forward_us > 0)
        .map(|m| (m.drafts.clone(), m.accepted, m.matched))
        .collect();
    let passes = passes_of(&want, 48);
    assert_eq!(firsts, passes);
    let accepted: u32 = passes.iter().map(|p| p.1).sum();
    assert!(accepted >= 8, "the tiny model repeats itself: {passes:?}");
    assert_eq!(answers.len(), passes.len() + accepted as usize);
    for m in answers.iter().filter(|m| m.timing.unwrap().forward_us == 0) {
        assert_eq!((m.drafts.len(), m.accepted, m.matched), (0, 0, 0));
        assert_eq!(m.timing.unwrap(), pb::Timing::default());
    }

    // A stop token the lookup drafted and the target accepted ends the stream there.
    let (mut at, mut pass_start) = (0, 0);
    let in_run = passes.iter().find_map(|&(_, accepted, _)| {
        let found = (accepted >= 2).then_some(pass_start + 1);
        pass_start += accepted as usize + 1;
        found
    });
    let stop = want[in_run.unwrap()];
    while want[at] != stop {
        at += 1;
    }
    let s = open_session(&url, 96).await;
    let cut = decoded(&mut c, &s, 48, vec![stop], Some(lookup())).await;
    assert_eq!(tokens(&cut), want[..=at]);
    for max_tokens in [1, 7, 13] {
        let s = open_session(&url, 96).await;
        let cut = decoded(&mut c, &s, max_tokens, vec![], Some(lookup())).await;
        assert_eq!(tokens(&cut), want[..max_tokens as usize]);
    }

    let bounds = |min_match, max_match, drafts| pb::StreamLookup {
        min_match,
        max_match,
        drafts,
    };
    for lookup in [
        bounds(0, 4, vec![4]),
        bounds(3, 2, vec![4]),
        bounds(1, 33, vec![4]),
        bounds(1, 4, vec![65]),
        bounds(1, 4, vec![1; 33]),
    ] {
        let s = open_session(&url, 96).await;
        let call = decode_call(&s, 8, vec![], Some(lookup));
        let err = c.decode(call).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        assert!(err.message().starts_with("lookup:"), "{err:?}");
    }
}

/// A sampling stream with lookup tests each pass's drafts as a Verify with point masses
/// tests them (`SamplingTest.point_masses`), at the place in the seed's random stream the
/// pass before left: the reference here makes those Verify calls with the lookup's drafts,
/// and the stream answers the same tokens, every answer of a pass the place after it.
#[tokio::test]
async fn a_sampling_stream_with_lookup_tests_drafts_as_a_verify_would() {
    let (_m, target) = serving_target().await;
    let url = target.url();
    let mut c = TargetWorkerClient::connect(url.clone()).await.unwrap();
    let s = open_sampling_session(&url, 96).await;
    let (mut seq, mut at, mut keep) = (vec![1u32, 2, 3], 0, 2);
    let mut index = NgramIndex::new(1, 4);
    let mut want = Vec::new();
    while seq.len() - 3 < 40 {
        index.extend(&seq);
        let room = 40 - (seq.len() - 3);
        let draft = match index.lookup(&seq, 6.min(room - 1)) {
            Some(l) => l.tokens[..l.tokens.len().min(if l.matched == 1 { 4 } else { 6 })].to_vec(),
            None => vec![],
        };
        let test = (!draft.is_empty()).then(|| pb::SamplingTest {
            q: vec![1.0; draft.len()],
            point_masses: true,
            rng_position: at,
            ..Default::default()
        });
        let step = pb::VerifyRequest {
            session_id: s.session_id.clone(),
            instance_id: s.instance_id,
            keep,
            append: vec![seq[keep as usize]],
            draft: draft.clone(),
            sampling_test: test,
            ..Default::default()
        };
        let answer = c.verify(step).await.unwrap().into_inner();
        let (accepted, token) = match answer.verdict {
            Some(v) => {
                at = v.rng_position;
                (v.accepted as usize, v.token.unwrap())
            }
            // No drafts: the step's p, drawn from as a Decode step draws.
            None => {
                use duet_engine::sampling::rng_at;
                use duet_engine::verify::verify_sampling_tree;
                let p = [duet_serving::wire::decode_distribution(&answer.p[0]).unwrap()];
                let mut rng = rng_at(0, at);
                let token = verify_sampling_tree(&[], &[], &[], &p, &mut rng).unwrap().1;
                at = duet_engine::sampling::rng_position(&rng);
                (0, token)
            }
        };
        keep = (seq.len() + accepted) as u32;
        seq.extend(&draft[..accepted]);
        seq.push(token);
        want.extend(draft[..accepted].iter().map(|&t| (t, at)));
        want.push((token, at));
    }

    let s = open_sampling_session(&url, 96).await;
    let answers = decoded(&mut c, &s, 40, vec![], Some(lookup())).await;
    let got: Vec<_> = answers
        .iter()
        .map(|m| (m.token, m.rng_position.unwrap()))
        .collect();
    assert_eq!(got, want);
    let accepted: u32 = answers.iter().map(|m| m.accepted).sum();
    assert!(accepted >= 4, "the tiny model repeats itself: {accepted}");
}

/// A second coordinator on `stack`'s workers whose streams look up drafts themselves
/// (`speculation.stream_lookup`), serving.
async fn looking_up_in_streams(stack: &Stack) -> Running {
    let mut config = coordinator_config(&stack.target.url(), Some(&stack.draft.url()));
    config.speculation.stream_lookup = true;
    let on = start_coordinator(config);
    wait_serving(&on.url(), "duet.v1.DraftWorker").await;
    on
}

/// Over the whole stack, AUTO requests in a batch (four at once, so their target-only steps
/// stream) on a text that repeats itself give NONE's tokens, and their streams' steps verify lookup
/// drafts themselves (`speculation.stream_lookup`): passes counted. A coordinator with it
/// off (the default) counts none.
#[tokio::test]
async fn auto_streams_verify_lookup_drafts_in_a_batch() {
    let (_m, stack) = tiny_stack().await;
    let on = looking_up_in_streams(&stack).await;
    let off = &stack.coordinator;
    // The tiny target's text from "a" soon repeats one token.
    let prompt = "a";
    let url = on.url();
    let plain = generate(&url, request(prompt, 64, TargetOnly))
        .await
        .unwrap();
    for coordinator in [&url, &off.url()] {
        let batch = (0..4).map(|_| generate(coordinator, request(prompt, 64, Auto)));
        for done in futures::future::join_all(batch).await {
            let done = done.unwrap();
            assert_eq!(done.token_ids, plain.token_ids);
            assert!(!done.usage.fell_back_to_target_only);
        }
    }
    let passes = "duet_stream_lookup_passes_total";
    assert!(sample(&scrape(&on).await, passes) > 0.0);
    assert_eq!(sample(&scrape(off).await, passes), 0.0);
}

/// Over the whole stack an NGRAM request, alone, runs in one Decode stream that looks up its
/// drafts itself (`speculation.stream_lookup`): NONE's tokens, its lookup's accepted drafts
/// counted as its own, and every lookup round a pass of the stream.
#[tokio::test]
async fn an_ngram_request_looks_up_inside_its_stream() {
    let (_m, stack) = tiny_stack().await;
    let on = looking_up_in_streams(&stack).await;
    let url = on.url();
    let plain = generate(&url, request("a", 64, TargetOnly)).await.unwrap();
    let req = pb::GenerateRequest {
        num_speculative_tokens: 4,
        ..request("a", 64, Ngram)
    };
    let done = generate(&url, req).await.unwrap();
    assert_eq!(done.token_ids, plain.token_ids);
    let u = &done.usage;
    assert!(
        u.draft_tokens_accepted >= 8,
        "the tiny model repeats itself: {u:?}"
    );
    let lookup = u.proposers.iter().find(|p| p.method == Ngram as i32);
    let lookup_rounds = lookup.map_or(0, |p| p.rounds);
    let passes = sample(&scrape(&on).await, "duet_stream_lookup_passes_total");
    assert_eq!(passes, f64::from(lookup_rounds), "{u:?}");
}
