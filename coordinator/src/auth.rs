//! The public API's optional bearer tokens: with `auth_token_file` set, every Generation
//! call must carry `authorization: Bearer <token>` with one of the file's tokens (one per
//! line: one per calling team, say). Each token is a tenant: the proposal cache shares
//! text only among calls with the same token (`speculation.proposal_cache.sharing`). The
//! file is read again every few seconds, so a rotated Secret takes effect without a restart.

use crate::proposals::Tenant;
use duet_serving::config::ConfigError;
use duet_serving::request_id;
use duet_serving::watch;
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tonic::service::Interceptor;
use tonic::{Request, Status};

/// How often `auth_token_file` is read again.
pub const RELOAD_INTERVAL: Duration = Duration::from_secs(10);

/// The tokens in `path`, one per line (surrounding whitespace, such as a Secret's trailing
/// newline, is not part of a token; blank lines are skipped).
pub fn read_tokens(path: &str) -> Result<Vec<String>, ConfigError> {
    let key = "auth_token_file";
    let text = std::fs::read_to_string(path)
        .map_err(|e| ConfigError::invalid(key, format!("{path}: {e}")))?;
    let tokens: Vec<String> = text
        .lines()
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(String::from)
        .collect();
    if tokens.is_empty() {
        return Err(ConfigError::invalid(key, format!("{path} is empty")));
    }
    Ok(tokens)
}

/// `Bearer <token>` as the header must read, and its tenant.
type Accepted = Arc<[(Vec<u8>, Tenant)]>;

/// Checks each call's bearer token; lets every call through when there is none to check.
#[derive(Clone, Default)]
pub struct Auth {
    accepted: Option<Arc<RwLock<Accepted>>>,
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Auth")
            .field("tokens", &self.accepted.as_ref().map(|_| "<set>"))
            .finish()
    }
}

/// A token's tenant: a hash of it, the same in every coordinator (the workers' prefix
/// caches keep a tenant's blocks apart by it, whichever coordinator opened the session);
/// never 0, the tenant that stands for everyone.
fn tenant(token: &str) -> Tenant {
    Tenant(crate::request::stable_hash(("duet tenant", token)).max(1))
}

fn accepted(tokens: &[String]) -> Accepted {
    tokens
        .iter()
        .map(|t| (format!("Bearer {t}").into_bytes(), tenant(t)))
        .collect()
}

impl Auth {
    pub fn tokens(tokens: &[String]) -> Self {
        Self {
            accepted: Some(Arc::new(RwLock::new(accepted(tokens)))),
        }
    }

    /// The tokens in `path`, read again every `every` while this (or a clone) lives. A file
    /// that turns unreadable or empty keeps the last tokens, with a warning.
    pub fn from_file(path: &str, every: Duration) -> Result<Self, ConfigError> {
        let files = vec![path.to_string()];
        // Read before the tokens: a change in between is then seen as one.
        let seen = watch::read_all(&files);
        let auth = Self::tokens(&read_tokens(path)?);
        let slot = Arc::downgrade(auth.accepted.as_ref().expect("tokens"));
        let path = path.to_string();
        let reload = move || -> Result<bool, String> {
            let Some(slot) = slot.upgrade() else {
                return Ok(false);
            };
            let tokens = read_tokens(&path).map_err(|e| e.to_string())?;
            *slot.write().unwrap_or_else(|e| e.into_inner()) = accepted(&tokens);
            Ok(true)
        };
        watch::watch_files("bearer tokens", files, seen, every, reload);
        Ok(auth)
    }
}

/// A warning when the bearer token would cross the network in the clear: a token is set,
/// TLS is not, and the gRPC or HTTP API listens beyond loopback. (A mesh or an ingress may
/// well add TLS in front, so this warns rather than refuses.)
pub fn plaintext_token(config: &crate::CoordinatorConfig) -> Option<String> {
    if config.auth_token_file.is_empty() || config.tls.enabled() {
        return None;
    }
    let open = [
        ("listen", &config.listen),
        ("http_listen", &config.http_listen),
    ]
    .into_iter()
    .find(|(_, addr)| {
        addr.parse::<std::net::SocketAddr>()
            .is_ok_and(|a| !a.ip().is_loopback())
    })?;
    Some(format!(
        "auth_token_file is set without tls and {} = {} is reachable beyond this host: \
         the bearer token crosses the network in the clear unless something in front adds TLS",
        open.0, open.1
    ))
}

/// Equal, in time that depends on the lengths only (a wrong guess says nothing about
/// how much of it was right).
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

impl Auth {
    /// Checks a call's `authorization` header (gRPC metadata or HTTP alike): the tenant of
    /// its token, or `None` when no token is needed.
    pub fn check(&self, header: Option<&[u8]>) -> Result<Option<Tenant>, Status> {
        let Some(accepted) = &self.accepted else {
            return Ok(None);
        };
        let accepted = accepted.read().unwrap_or_else(|e| e.into_inner());
        let Some(header) = header else {
            return Err(Status::unauthenticated(
                "this server needs a bearer token: send `authorization: Bearer <token>`",
            ));
        };
        // Every token is compared, whichever matches.
        let found = accepted.iter().fold(None, |found, (expected, tenant)| {
            found.or(same(header, expected).then_some(*tenant))
        });
        match found {
            Some(tenant) => Ok(Some(tenant)),
            None => Err(Status::unauthenticated("the bearer token is not valid")),
        }
    }
}

impl Interceptor for Auth {
    /// Lets a call with a valid token through, its tenant in the request's extensions; a
    /// refusal carries the call's `x-request-id` (the caller's, else a fresh one), as every
    /// other refusal does.
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        let header = request
            .metadata()
            .get("authorization")
            .map(|v| v.as_bytes());
        let checked = self.check(header).map_err(|refused| {
            let id = request_id::of_call(request.metadata()).unwrap_or_else(request_id::fresh);
            crate::service::refused_with_id(refused, Some(&id))
        });
        if let Some(tenant) = checked? {
            request.extensions_mut().insert(tenant);
        }
        Ok(request)
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
        let mut auth = Auth::tokens(&["s3cret".into()]);
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

    /// A refused call's answer names it as the other refusals do: by the caller's id,
    /// else by a fresh one.
    #[test]
    fn a_refusal_carries_the_calls_id() {
        let auth = Auth::tokens(&["s3cret".into()]);
        let id_of = |id: Option<&str>| {
            let mut r = Request::new(());
            if let Some(id) = id {
                r.metadata_mut().insert("x-request-id", id.parse().unwrap());
            }
            let refused = auth.clone().call(r).unwrap_err();
            assert_eq!(refused.code(), Code::Unauthenticated);
            let id = refused.metadata().get("x-request-id").unwrap();
            id.to_str().unwrap().to_string()
        };
        assert_eq!(id_of(Some("gw-9a1c")), "gw-9a1c");
        let fresh = id_of(None);
        // A UUID, as `request_id::fresh` makes them.
        assert_eq!(
            (fresh.len(), fresh.matches('-').count()),
            (36, 4),
            "{fresh}"
        );
        assert_ne!(id_of(None), fresh);
    }

    /// A file of two tokens: each lets calls in as a tenant of its own, and the
    /// interceptor hands the tenant to the service.
    #[test]
    fn each_token_is_a_tenant() {
        let mut auth = Auth::tokens(&["team-a".into(), "team-b".into()]);
        let a = auth.check(Some(b"Bearer team-a")).unwrap().unwrap();
        let b = auth.check(Some(b"Bearer team-b")).unwrap().unwrap();
        assert_ne!(a, b);
        assert_eq!(auth.check(Some(b"Bearer team-a")).unwrap(), Some(a));
        let mut r = Request::new(());
        r.metadata_mut()
            .insert("authorization", "Bearer team-b".parse().unwrap());
        let passed = auth.call(r).unwrap();
        assert_eq!(passed.extensions().get::<Tenant>(), Some(&b));
        assert_eq!(Auth::default().check(None).unwrap(), None);
    }

    #[test]
    fn a_token_over_plaintext_beyond_loopback_is_warned_about() {
        let mut config = crate::CoordinatorConfig {
            auth_token_file: "/run/token".into(),
            http_listen: String::new(),
            ..Default::default()
        };
        assert_eq!(plaintext_token(&config), None);
        config.listen = "0.0.0.0:50061".into();
        let warning = plaintext_token(&config).unwrap();
        assert!(warning.contains("listen = 0.0.0.0:50061"), "{warning}");
        config.tls.cert_file = "/run/tls.crt".into();
        assert_eq!(plaintext_token(&config), None);
    }

    #[tokio::test]
    async fn a_changed_token_file_takes_effect_without_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, "first\n").unwrap();
        let path = path.to_str().unwrap();
        let mut auth = Auth::from_file(path, Duration::from_millis(20)).unwrap();
        assert_eq!(call(&mut auth, Some("Bearer first")), Ok(()));
        std::fs::write(path, "second\n").unwrap();
        let reloaded = async {
            while call(&mut auth, Some("Bearer second")).is_err() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(5), reloaded)
            .await
            .expect("the new token never took effect");
        assert_eq!(
            call(&mut auth, Some("Bearer first")),
            Err(Code::Unauthenticated)
        );
        // Emptied (a Secret mid-rotation): the last token stays.
        std::fs::write(path, "").unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(call(&mut auth, Some("Bearer second")), Ok(()));
    }
}
