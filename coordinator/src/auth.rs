//! The public API's optional bearer token: with `auth_token_file` set, every Generation call
//! must carry `authorization: Bearer <token>`.

use duet_serving::config::ConfigError;
use std::sync::Arc;
use tonic::service::Interceptor;
use tonic::{Request, Status};

/// The token in `path` (surrounding whitespace, such as a Secret's trailing newline, is not
/// part of it).
pub fn read_token(path: &str) -> Result<String, ConfigError> {
    let key = "auth_token_file";
    let text = std::fs::read_to_string(path)
        .map_err(|e| ConfigError::invalid(key, format!("{path}: {e}")))?;
    let token = text.trim();
    if token.is_empty() {
        return Err(ConfigError::invalid(key, format!("{path} is empty")));
    }
    Ok(token.to_string())
}

/// Checks each call's bearer token; lets every call through when there is none to check.
#[derive(Clone, Default)]
pub struct Auth {
    expected: Option<Arc<[u8]>>,
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Auth")
            .field("token", &self.expected.as_ref().map(|_| "<set>"))
            .finish()
    }
}

impl Auth {
    pub fn token(token: &str) -> Self {
        Self {
            expected: Some(format!("Bearer {token}").into_bytes().into()),
        }
    }
}

/// Equal, in time that depends on the lengths only (a wrong guess says nothing about
/// how much of it was right).
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

impl Auth {
    /// Checks a call's `authorization` header (gRPC metadata or HTTP alike).
    pub fn check(&self, header: Option<&[u8]>) -> Result<(), Status> {
        let Some(expected) = &self.expected else {
            return Ok(());
        };
        match header {
            Some(v) if same(v, expected) => Ok(()),
            Some(_) => Err(Status::unauthenticated("the bearer token is not valid")),
            None => Err(Status::unauthenticated(
                "this server needs a bearer token: send `authorization: Bearer <token>`",
            )),
        }
    }
}

impl Interceptor for Auth {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        let header = request
            .metadata()
            .get("authorization")
            .map(|v| v.as_bytes());
        self.check(header).map(|()| request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    fn call(auth: &mut Auth, header: Option<&str>) -> Result<(), Code> {
        let mut r = Request::new(());
        if let Some(h) = header {
            r.metadata_mut().insert("authorization", h.parse().unwrap());
        }
        auth.call(r).map(|_| ()).map_err(|s| s.code())
    }

    #[test]
    fn calls_need_the_exact_bearer_token() {
        let mut open = Auth::default();
        assert_eq!(call(&mut open, None), Ok(()));
        let mut auth = Auth::token("s3cret");
        assert_eq!(call(&mut auth, Some("Bearer s3cret")), Ok(()));
        for wrong in [
            None,
            Some("Bearer s3cre"),
            Some("Bearer s3cret2"),
            Some("s3cret"),
        ] {
            assert_eq!(
                call(&mut auth, wrong),
                Err(Code::Unauthenticated),
                "{wrong:?}"
            );
        }
    }
}
