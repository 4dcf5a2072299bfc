//! The served models as clients list them (`GET /v1/models`) and look one up (`GET
//! /v1/models/{id}`): the target's model, then its LoRA adapters, in OpenAI's shape (vLLM's
//! fields) or, to a caller that sends `anthropic-version` (Anthropic's SDKs), in Anthropic's.

use super::{App, Refusal, anthropic, error_json, json_response, refuse, served};
use crate::workers::Models;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use serde_json::{Value, json};

/// `GET /v1/models`: the model this coordinator serves (its target's), then its LoRA
/// adapters, each with the target as its `parent` (as vLLM lists them); to an Anthropic
/// client (it sends `anthropic-version`), in Anthropic's shape.
pub(super) async fn list(State(app): State<App>, headers: HeaderMap) -> Response {
    if headers.contains_key("anthropic-version") {
        return anthropic_list(&app, &headers).await;
    }
    let m = match served(&app, &headers).await {
        Ok(m) => m,
        Err(refused) => return refuse(refused),
    };
    let ids = served_ids(&app, &m).await;
    let data: Vec<Value> = ids.iter().map(|id| model_card(&m, id)).collect();
    json_response(StatusCode::OK, &json!({"object": "list", "data": data}))
}

/// `GET /v1/models/{id}` (OpenAI's and Anthropic's retrieve, `id` percent-decoded and
/// slashes kept, as a repository's name has them): the card `/v1/models` lists for it, in
/// the caller's shape; 404 naming it where no served model has that name.
pub(super) async fn retrieve(
    State(app): State<App>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let anthropic = headers.contains_key("anthropic-version");
    let m = match anthropic {
        true => anthropic::served(&app, &headers).await,
        false => served(&app, &headers).await,
    };
    let found = match m {
        Ok(m) => app.coord.serves(&m, &id).await.then_some(m),
        Err(refused) => return refuse_as(anthropic, refused),
    };
    match (found, anthropic) {
        (Some(_), true) => json_response(StatusCode::OK, &anthropic_card(&app, &id)),
        (Some(m), false) => json_response(StatusCode::OK, &model_card(&m, &id)),
        (None, _) => {
            let message = format!("the model {} is not served here", crate::request::echo(&id));
            let mut body = error_json("invalid_request_error", &message, Some("model"));
            body["error"]["code"] = json!("model_not_found");
            refuse_as(anthropic, (StatusCode::NOT_FOUND, body))
        }
    }
}

/// The served models' names: the target's, then its adapters' (listed again where the
/// target-workers read a directory).
async fn served_ids(app: &App, m: &Models) -> Vec<String> {
    let mut ids = vec![m.target_model.clone()];
    ids.extend(app.coord.adapters(m).await);
    ids
}

/// A refusal in Anthropic's shape to its clients, else OpenAI's.
fn refuse_as(anthropic: bool, refused: Refusal) -> Response {
    match anthropic {
        true => anthropic::refuse(refused),
        false => refuse(refused),
    }
}

/// OpenAI's card of the served model `id`: an adapter's `parent` is the target (as vLLM
/// lists them); vLLM's `max_model_len`, the target's context, as clients size their
/// requests by it.
fn model_card(m: &Models, id: &str) -> Value {
    let parent = (id != m.target_model).then_some(m.target_model.as_str());
    json!({"id": id, "object": "model", "created": 0, "owned_by": "duet",
           "parent": parent, "max_model_len": m.context})
}

/// `GET /v1/models` from an Anthropic client: the served model (the target's), then its
/// LoRA adapters, in Anthropic's list (one page); the key as for messages.
async fn anthropic_list(app: &App, headers: &HeaderMap) -> Response {
    let m = match anthropic::served(app, headers).await {
        Ok(m) => m,
        Err(refused) => return anthropic::refuse(refused),
    };
    let ids = served_ids(app, &m).await;
    let data: Vec<Value> = ids.iter().map(|id| anthropic_card(app, id)).collect();
    let page = json!({"data": data, "has_more": false, "first_id": ids.first(),
                      "last_id": ids.last()});
    json_response(StatusCode::OK, &page)
}

/// Anthropic's card of the served model `id`, dated by when the API started.
fn anthropic_card(app: &App, id: &str) -> Value {
    let created = super::rfc3339(app.started);
    json!({"type": "model", "id": id, "display_name": id, "created_at": created})
}
