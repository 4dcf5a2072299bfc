//! What the API answers about the server itself, beside the models: its readiness
//! (`/health`), its metrics (`/metrics`), its release (`/version`), and a route it does
//! not serve.

use super::{App, authorized, error_json, json_response, refuse};
use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use duet_serving::metrics::{CONTENT_TYPE_TEXT, Render};
use serde_json::json;
use std::sync::atomic::Ordering;

/// `GET /health`, vLLM's, on the API's own port for load balancers that probe it there: 200
/// while the coordinator serves (the probes' readiness), else 503. It asks for no token, as
/// vLLM's does not, and tells nothing but that.
pub(super) async fn health(State(app): State<App>) -> StatusCode {
    match app.ready.load(Ordering::Relaxed) {
        true => StatusCode::OK,
        false => StatusCode::SERVICE_UNAVAILABLE,
    }
}

/// `GET /metrics` on the API's port too, as vLLM's and TGI's servers answer it there: the
/// port a Gateway API Inference Extension's endpoint picker, or a scraper pointed at the
/// API, reads. Without a token, as on the metrics port.
pub(super) async fn metrics_text(render: Render) -> Response {
    ([(CONTENT_TYPE, CONTENT_TYPE_TEXT)], render()).into_response()
}

/// `GET /version`, vLLM's: duet's own release, for clients that log or gate on it.
pub(super) async fn version(State(app): State<App>, headers: HeaderMap) -> Response {
    match authorized(&app, &headers) {
        Ok(_) => json_response(
            StatusCode::OK,
            &json!({"version": env!("CARGO_PKG_VERSION")}),
        ),
        Err(refused) => refuse(refused),
    }
}

/// A route the API does not serve: 404 with OpenAI's error body naming it, so a client
/// shows what it asked for rather than an empty answer.
pub(super) async fn not_found(method: axum::http::Method, uri: axum::http::Uri) -> Response {
    let message = format!("{method} {} is not served here", uri.path());
    let body = error_json("invalid_request_error", &message, None);
    json_response(StatusCode::NOT_FOUND, &body)
}
