//! `x-request-id` on an HTTP API, as OpenAI's API and gateways (Envoy, Istio, NGINX) use
//! it: a caller's id is kept when it is a short printable token, anything else is replaced
//! by a fresh UUID, and the answer carries the id back. The request's server span records
//! it too (`http_server_span`), so one id ties a gateway's log line, the caller's answer
//! and the trace in Jaeger together.

use axum::Router;
use axum::extract::Request;
use axum::http::HeaderName;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};

/// The header.
pub const HEADER: HeaderName = HeaderName::from_static("x-request-id");

/// The longest caller's id kept: a UUID is 36 characters, a trace id 32.
pub const MAX_LEN: usize = 128;

/// `router` with request ids: kept or made on the way in, sent back on the way out.
pub fn layer<S: Clone + Send + Sync + 'static>(router: Router<S>) -> Router<S> {
    // The last layer added runs first: an unfit id goes before one is made.
    router
        .layer(PropagateRequestIdLayer::new(HEADER))
        .layer(SetRequestIdLayer::new(HEADER, MakeRequestUuid))
        .layer(axum::middleware::map_request(drop_unfit))
}

/// Whether a caller's id is kept: 1 to `MAX_LEN` visible ASCII characters (no spaces),
/// short enough for a span's attribute and a log line, and nothing a log could misread.
pub fn fits(id: &[u8]) -> bool {
    (1..=MAX_LEN).contains(&id.len()) && id.iter().all(u8::is_ascii_graphic)
}

/// A fresh id, as the HTTP API makes one: a random UUID.
pub fn fresh() -> String {
    uuid::Uuid::new_v4().to_string()
}

/// A gRPC call's `x-request-id` metadata, where it fits.
pub fn of_call(metadata: &tonic::metadata::MetadataMap) -> Option<String> {
    let id = metadata.get(HEADER.as_str())?;
    let id = id.to_str().ok().filter(|id| fits(id.as_bytes()))?;
    Some(id.to_string())
}

/// Removes the caller's id where the first one does not fit (a fresh one replaces it).
async fn drop_unfit(mut request: Request) -> Request {
    if request
        .headers()
        .get(&HEADER)
        .is_some_and(|id| !fits(id.as_bytes()))
    {
        request.headers_mut().remove(&HEADER);
    }
    request
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_printable_ids_fit_and_others_do_not() {
        let fit = |id: &str| fits(id.as_bytes());
        assert!(fit("gw-7f3a"));
        assert!(fit("3f2b8c1e-5d4a-4b6e-9c7d-0a1b2c3d4e5f"));
        assert!(fit(&"a".repeat(MAX_LEN)));
        assert!(!fit(&"a".repeat(MAX_LEN + 1)));
        assert!(!fit(""));
        assert!(!fit("two words"));
        assert!(!fit("café"));
    }
}
