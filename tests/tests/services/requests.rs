//! Chat messages and stop strings; invalid requests refused, naming the field.

use super::*;

#[tokio::test]
async fn chat_messages_and_stop_strings() {
    let (_m, stack) = tiny_stack().await;
    let url = stack.coordinator.url();
    let chat = pb::GenerateRequest {
        input: Some(pb::generate_request::Input::Messages(pb::Messages {
            messages: vec![pb::ChatMessage {
                role: "user".into(),
                content: "hi".into(),
                ..Default::default()
            }],
        })),
        max_tokens: 20,
        ..Default::default()
    };
    let g = generate(&url, chat).await.unwrap();
    // "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n" in the tiny vocabulary.
    assert!(g.usage.prompt_tokens >= 8, "{}", g.usage.prompt_tokens);

    // A stop string taken from the unconstrained output cuts it right before it, and is
    // the one the answer names (not the first given, which never comes).
    let free = generate(&url, request("the cat", 60, TargetOnly))
        .await
        .unwrap();
    assert_eq!(free.stop_string, "");
    let chars: Vec<char> = free.text.chars().collect();
    assert!(chars.len() >= 12, "too little text to cut: {:?}", free.text);
    let stop: String = chars[8..11].iter().collect();
    let mut req = request("the cat", 60, DraftModel);
    req.stop = vec!["never\u{7}".into(), stop.clone()];
    let cut = generate(&url, req.clone()).await.unwrap();
    let at = free.text.find(&stop).unwrap();
    assert_eq!(cut.text, free.text[..at]);
    assert_eq!(cut.finish_reason, Some(pb::FinishReason::Stop as i32));
    assert_eq!(cut.stop_string, stop);
    // vLLM's include_stop_str_in_output: the same cut after the stop string.
    req.include_stop_str_in_output = true;
    let kept = generate(&url, req).await.unwrap();
    assert_eq!(kept.text, free.text[..at + stop.len()]);
    assert_eq!(kept.finish_reason, Some(pb::FinishReason::Stop as i32));
}

#[tokio::test]
async fn invalid_requests_name_the_field() {
    let (_m, stack) = tiny_stack().await;
    let url = stack.coordinator.url();
    let base = request("the cat", 8, DraftModel);
    let cases: Vec<(&str, pb::GenerateRequest)> = vec![
        (
            "input",
            pb::GenerateRequest {
                input: None,
                ..base.clone()
            },
        ),
        ("prompt", request("", 8, DraftModel)),
        (
            "temperature",
            pb::GenerateRequest {
                temperature: -0.5,
                ..base.clone()
            },
        ),
        (
            "temperature",
            pb::GenerateRequest {
                temperature: f32::NAN,
                ..base.clone()
            },
        ),
        (
            "top_p",
            pb::GenerateRequest {
                top_p: Some(0.0),
                ..base.clone()
            },
        ),
        (
            "top_p",
            pb::GenerateRequest {
                top_p: Some(1.5),
                ..base.clone()
            },
        ),
        (
            "speculation",
            pb::GenerateRequest {
                speculation: 42,
                ..base.clone()
            },
        ),
        (
            "num_speculative_tokens",
            pb::GenerateRequest {
                num_speculative_tokens: 1000,
                ..base.clone()
            },
        ),
        (
            "top_logprobs",
            pb::GenerateRequest {
                logprobs: true,
                top_logprobs: 21,
                ..base.clone()
            },
        ),
        (
            "presence_penalty",
            pb::GenerateRequest {
                presence_penalty: 3.0,
                ..base.clone()
            },
        ),
        (
            "max_tokens",
            pb::GenerateRequest {
                max_tokens: 10_000,
                ..base.clone()
            },
        ),
        ("prompt", request(&"the cat ".repeat(400), 8, DraftModel)),
        (
            "stop",
            pb::GenerateRequest {
                stop: vec![String::new()],
                ..base.clone()
            },
        ),
        (
            "messages",
            pb::GenerateRequest {
                input: Some(pb::generate_request::Input::Messages(
                    pb::Messages::default(),
                )),
                ..base.clone()
            },
        ),
        ("messages", chat(&[("wizard", "hi")])),
        // A role-less message: the error must not copy its content.
        ("messages", chat(&[("", &"secret ".repeat(10_000))])),
        (
            "messages",
            chat(&vec![
                ("user", "hi");
                duet_coordinator::CoordinatorConfig::default()
                    .limits
                    .max_messages
                    + 1
            ]),
        ),
        // Over the byte limits: refused before tokenizing.
        ("prompt", request(&"x".repeat((1 << 20) + 1), 8, DraftModel)),
        (
            "messages",
            chat(&[
                ("system", &"x".repeat(1 << 19)),
                ("user", &"y".repeat((1 << 19) + 1)),
            ]),
        ),
        (
            "stop",
            pb::GenerateRequest {
                stop: vec!["z".repeat(257)],
                ..base.clone()
            },
        ),
    ];
    for (field, req) in cases {
        let err = generate(&url, req).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{field}: {err:?}");
        assert!(
            err.message().starts_with(field) && err.message().len() < 200,
            "{field}: {}",
            err.message()
        );
    }
    // Within the byte limit, yet each entry two bytes that decode to a whole struct: the
    // entries are counted, and the request refused, before it is decoded.
    let empty_messages = pb::GenerateRequest {
        input: Some(pb::generate_request::Input::Messages(pb::Messages {
            messages: vec![pb::ChatMessage::default(); 500_000],
        })),
        ..base.clone()
    };
    let empty_stops = pb::GenerateRequest {
        stop: vec![String::new(); 500_000],
        ..base.clone()
    };
    for (req, message) in [
        (empty_messages, "messages: more than 4096 messages"),
        (empty_stops, "stop: more than 16 strings"),
    ] {
        let err = generate(&url, req).await.unwrap_err();
        assert_eq!(
            (err.code(), err.message()),
            (Code::InvalidArgument, message)
        );
    }
    // Larger than any request the limits allow: refused before it is decoded.
    let huge = generate(&url, request(&"x".repeat(2 << 20), 8, DraftModel))
        .await
        .unwrap_err();
    assert_eq!(huge.code(), Code::OutOfRange, "{huge:?}");
    // Still serving.
    let g = generate(&url, base).await.unwrap();
    assert_eq!(g.usage.completion_tokens as usize, g.token_ids.len());
}

/// A gRPC answer carries the call's `x-request-id` in its metadata, as the HTTP API's
/// answers carry it: the caller's where it fits, else a fresh UUID, for Generate and
/// Complete alike.
#[tokio::test]
async fn grpc_answers_carry_the_request_id() {
    let (_m, stack) = tiny_stack().await;
    let url = stack.coordinator.url();
    let mut client = pb::generation_client::GenerationClient::connect(url)
        .await
        .unwrap();
    let call = |id: Option<&str>| {
        let mut call = tonic::Request::new(request("the cat", 2, TargetOnly));
        if let Some(id) = id {
            call.metadata_mut()
                .insert("x-request-id", id.parse().unwrap());
        }
        call
    };
    let id_of = |m: &tonic::metadata::MetadataMap| {
        m.get("x-request-id").unwrap().to_str().unwrap().to_string()
    };
    let streamed = client.generate(call(Some("gw-5e1d"))).await.unwrap();
    assert_eq!(id_of(streamed.metadata()), "gw-5e1d");
    let whole = client.complete(call(Some("gw-5e1e"))).await.unwrap();
    assert_eq!(id_of(whole.metadata()), "gw-5e1e");
    let mut fresh = Vec::new();
    for id in [None, Some("two words")] {
        let id = id_of(client.complete(call(id)).await.unwrap().metadata());
        assert!(is_uuid(&id), "{id}");
        fresh.push(id);
    }
    assert_ne!(fresh[0], fresh[1]);
    // A refusal carries it too: the caller's, else a fresh one.
    let empty = |id| {
        let mut call = call(id);
        call.get_mut().input = Some(pb::generate_request::Input::Prompt(String::new()));
        call
    };
    let refused = client.generate(empty(Some("gw-5e1f"))).await.unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument);
    assert_eq!(id_of(refused.metadata()), "gw-5e1f");
    let refused = client.complete(empty(None)).await.unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument);
    assert!(is_uuid(&id_of(refused.metadata())));
}
