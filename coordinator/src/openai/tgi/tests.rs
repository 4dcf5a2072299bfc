//! TGI's parameters as duet's request, its errors, and tokens' texts.

use super::*;

fn request(body: Value) -> Request {
    serde_json::from_value(body).unwrap()
}

fn converted(body: Value, route: Route) -> Result<(pb::GenerateRequest, Answer), String> {
    let models = crate::generation::fakes::models();
    let converted = request(body).to_request(route, &models);
    converted.map_err(|u| u.message)
}

/// Greedy unless TGI samples; absent parameters sample, as TGI's defaults do; a stop
/// string stays in the text; the text before is the prompt on `POST /` alone.
#[test]
fn tgis_defaults_hold() {
    let (greedy, answer) = converted(
        json!({"inputs": "a", "parameters": {"max_new_tokens": 3}}),
        Route::Generate,
    )
    .unwrap();
    assert_eq!((greedy.temperature, greedy.max_tokens), (0.0, 3));
    assert_eq!((answer.seed, answer.before.as_str()), (None, ""));
    assert!(greedy.include_stop_str_in_output);
    assert!(!greedy.logprobs);
    let (sampled, answer) = converted(json!({"inputs": "a"}), Route::Compat).unwrap();
    assert_eq!(sampled.temperature, 1.0);
    assert_eq!(
        (answer.seed, answer.before.as_str()),
        (Some(sampled.seed), "a")
    );
    let body = json!({"inputs": "a", "parameters": {"top_k": 5, "seed": 7, "details": true,
                      "return_full_text": false, "stop": ["x"], "top_n_tokens": 2}});
    let (sampled, answer) = converted(body, Route::Compat).unwrap();
    assert_eq!(
        (sampled.temperature, sampled.top_k, sampled.seed),
        (1.0, 5, 7)
    );
    assert_eq!(
        (sampled.stop.as_slice(), answer.before.as_str()),
        (&["x".to_string()][..], "")
    );
    assert_eq!((sampled.logprobs, sampled.top_logprobs), (true, 2));
    assert_eq!(
        (answer.details, answer.top_n, answer.seed),
        (true, 2, Some(7))
    );
    // The `text-generation` package sends every field, unset ones as null.
    let nulls = json!({"inputs": "a", "stream": null, "parameters": {"do_sample": null,
        "stop": null, "temperature": null, "details": null, "watermark": null}});
    assert_eq!(converted(nulls, Route::Compat).unwrap().0.temperature, 0.0);
}

#[test]
fn grammars_become_structured_output() {
    let with = |grammar: Value| {
        let body = json!({"inputs": "a", "parameters": {"grammar": grammar}});
        converted(body, Route::Generate).map(|(r, _)| r.structured_output)
    };
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
    let json = with(json!({"type": "json", "value": schema})).unwrap();
    let text = with(json!({"type": "json", "value": schema.to_string()})).unwrap();
    let named = with(json!({"type": "json_schema", "value": {"name": "n", "schema": schema}}));
    assert!(json.is_some());
    assert_eq!((&text, &named.unwrap()), (&json, &json));
    assert!(
        with(json!({"type": "regex", "value": "[ab]+"}))
            .unwrap()
            .is_some()
    );
    assert_eq!(
        with(json!({"type": "lark", "value": "x"})).unwrap_err(),
        "grammar: of type json, json_schema or regex"
    );
}

#[test]
fn what_duet_cannot_honour_is_refused_by_name() {
    for (parameters, route, message) in [
        (
            json!({"best_of": 2}),
            Route::Generate,
            "best_of: 1 at most: one sequence a request",
        ),
        (
            json!({"typical_p": 0.5}),
            Route::Generate,
            "typical_p: duet does not take it",
        ),
        (
            json!({"watermark": true}),
            Route::Generate,
            "watermark: duet does not take it",
        ),
        (
            json!({"truncate": 8}),
            Route::Generate,
            "truncate: a prompt the context cannot hold is refused, not cut",
        ),
        (
            json!({"decoder_input_details": true}),
            Route::Stream,
            "decoder_input_details: not when streaming",
        ),
        (
            json!({"max_new_tokens": 0}),
            Route::Generate,
            "max_new_tokens: must be strictly positive",
        ),
        (json!({"top_k": -1}), Route::Generate, "top_k: 0 or more"),
    ] {
        let body = json!({"inputs": "a", "parameters": parameters});
        assert_eq!(converted(body, route).unwrap_err(), message);
    }
    assert_eq!(
        converted(json!({"inputs": ""}), Route::Generate).unwrap_err(),
        "inputs: cannot be empty"
    );
    // Asked for in a whole answer, the prompt's figures come with it.
    let body = json!({"inputs": "a", "parameters": {"decoder_input_details": true}});
    let (request, answer) = converted(body, Route::Generate).unwrap();
    assert_eq!((request.prompt_logprobs, answer.details), (Some(0), true));
}

/// Each token's text is what its bytes complete (`Utf8Stream`), so a character split
/// over two tokens comes whole with the second, and the texts add up to the sequence's.
#[test]
fn token_texts_add_up_to_the_text() {
    let mut pending = Utf8Stream::new();
    let e_acute = "é".as_bytes();
    assert_eq!(pending.push(b"a"), "a");
    assert_eq!(pending.push(&[b'b', e_acute[0]]), "b");
    assert_eq!(pending.push(&[e_acute[1], b'c']), "éc");
    assert_eq!(pending.push(&[0xff, b'd']), "\u{fffd}d");
    assert_eq!(pending.finish(), "");
    // Bytes no character is made of go out; a character opened after them waits.
    assert_eq!(pending.push(&[0xe2, b'e', 0xe2, 0x82]), "\u{fffd}e");
    assert_eq!(pending.push(&[0xac]), "€");
    let (_, answer) = converted(json!({"inputs": "a"}), Route::Generate).unwrap();
    let ids = answer
        .models
        .tokenizer
        .encode("the cat sat", false)
        .unwrap();
    let mut pieces = Utf8Stream::new();
    let texts: String = (ids.iter())
        .map(|&id| {
            answer.token(&mut pieces, id, None).0["text"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(
        texts + &pieces.finish(),
        answer.models.tokenizer.decode(&ids, false).unwrap()
    );
}

#[test]
fn refusals_have_tgis_error_types() {
    for (status, kind, want) in [
        (
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            (422, "validation"),
        ),
        (
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            (429, "overloaded"),
        ),
        (
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            (401, "authentication"),
        ),
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable_error",
            (503, "generation"),
        ),
    ] {
        let body = super::super::error_json(kind, "why", None);
        let (status, error) = tgi_error((status, body));
        assert_eq!(
            (status.as_u16(), error),
            (want.0, json!({"error": "why", "error_type": want.1}))
        );
    }
    let (status, error) = incomplete("early");
    let (status, error) = tgi_error((status, error));
    assert_eq!(
        (status.as_u16(), error),
        (
            500,
            json!({"error": "early", "error_type": "incomplete_generation"})
        )
    );
}
