//! Amazon SageMaker's container contract, as vLLM's and TGI's servers keep it, so that the
//! coordinator serves as a SageMaker endpoint (its container answering on port 8080:
//! `http_listen = "0.0.0.0:8080"`): `GET /ping` (and `POST`), the readiness as `/health`
//! answers it, and `POST /invocations`, a request of one of the APIs above, told apart by
//! its body as vLLM tells them: chat `messages` a chat completion, a `prompt` a
//! completion; and TGI's `inputs` its `POST /`, the Responses API's `input` a response.

use super::{App, bad_request, refuse};
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::HeaderMap;
use axum::response::Response;
use serde::Deserialize;
use serde::de::IgnoredAny;

pub const PING: &str = "/ping";
pub const INVOCATIONS: &str = "/invocations";

/// The fields that tell the APIs' requests apart, each skipped unread.
#[derive(Debug, Default, Deserialize)]
struct Keys {
    messages: Option<IgnoredAny>,
    prompt: Option<IgnoredAny>,
    inputs: Option<IgnoredAny>,
    input: Option<IgnoredAny>,
}

/// Which API a body's request is of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Api {
    Chat,
    Completion,
    Tgi,
    Responses,
}

impl Keys {
    fn api(&self) -> Option<Api> {
        match self {
            Keys {
                messages: Some(_), ..
            } => Some(Api::Chat),
            Keys {
                prompt: Some(_), ..
            } => Some(Api::Completion),
            Keys {
                inputs: Some(_), ..
            } => Some(Api::Tgi),
            Keys { input: Some(_), .. } => Some(Api::Responses),
            _ => None,
        }
    }
}

/// `POST /invocations`: the request answered by the endpoint its body is for, with its
/// checks, token and span.
pub async fn invocations(
    State(app): State<App>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    // A body that does not read goes to completions, which say what is wrong with it.
    let keys = body
        .as_ref()
        .ok()
        .map(|b| serde_json::from_slice::<Keys>(b));
    let api = match keys {
        Some(Ok(keys)) => keys.api(),
        None | Some(Err(_)) => Some(Api::Completion),
    };
    let state = State(app);
    match api {
        Some(Api::Chat) => super::chat_completions(state, headers, body).await,
        Some(Api::Completion) => super::completions(state, headers, body).await,
        Some(Api::Tgi) => super::tgi::compat(state, headers, body).await,
        Some(Api::Responses) => super::responses::handle(state, headers, body).await,
        None => refuse(bad_request(
            "the body is a request of none of the APIs: a chat's `messages`, a completion's \
             `prompt`, TGI's `inputs` or a response's `input`",
            None,
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_body_tells_its_api_as_vllm_reads_it() {
        let api = |body: &str| serde_json::from_str::<Keys>(body).unwrap().api();
        assert_eq!(api(r#"{"messages": [], "prompt": "a"}"#), Some(Api::Chat));
        assert_eq!(
            api(r#"{"prompt": [1, 2], "inputs": "a"}"#),
            Some(Api::Completion)
        );
        assert_eq!(api(r#"{"inputs": "a", "parameters": {}}"#), Some(Api::Tgi));
        assert_eq!(api(r#"{"input": "a", "model": "m"}"#), Some(Api::Responses));
        assert_eq!(api(r#"{"model": "m"}"#), None);
    }
}
