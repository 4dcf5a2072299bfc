//! TLS that follows its files. cert-manager renews a certificate in place (the Secret's
//! files change under a running pod), so every server reads its certificate, key and client
//! CA again when they change, and new connections use them; so does the coordinator's
//! client side toward its workers. A change that does not load (a half-written file, a key
//! that does not match its certificate) keeps what was serving and is logged until fixed.

use crate::config::ConfigError;
use crate::tls::{ServerTls, read};
use crate::watch;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::sync::{Arc, RwLock};
use std::time::Duration;

/// How often the files are read again, unless configured (`tls.reload_interval_ms`).
pub const RELOAD_INTERVAL: Duration = Duration::from_secs(10);

/// What a server speaks over TLS, offered by ALPN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Alpn {
    /// gRPC.
    H2,
    /// The HTTP API and the metrics port.
    Http1,
}

/// A server's rustls configuration, built again from its files when they change.
#[derive(Debug, Clone)]
pub struct ServerConfigFiles {
    current: Arc<RwLock<Arc<rustls::ServerConfig>>>,
}

impl ServerConfigFiles {
    /// Builds the configuration of `tls` (keys under `prefix`) now, and again whenever its
    /// files change (checked every `interval`, while a clone of this lives, on the current
    /// tokio runtime; without one, never).
    pub fn watch(
        tls: &ServerTls,
        prefix: &str,
        alpn: Alpn,
        interval: Duration,
    ) -> Result<Self, ConfigError> {
        let files = [&tls.cert_file, &tls.key_file, &tls.client_ca_file];
        let files: Vec<String> = files
            .into_iter()
            .filter(|f| !f.is_empty())
            .cloned()
            .collect();
        let seen = watch::read_all(&files);
        let current = Arc::new(RwLock::new(Arc::new(server_config(tls, prefix, alpn)?)));
        let weak = Arc::downgrade(&current);
        let (tls, prefix) = (tls.clone(), prefix.to_string());
        let reload = move || -> Result<bool, String> {
            let Some(current) = weak.upgrade() else {
                return Ok(false);
            };
            let config = server_config(&tls, &prefix, alpn).map_err(|e| e.to_string())?;
            *current.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(config);
            Ok(true)
        };
        watch::watch_files("TLS files", files, seen, interval, reload);
        Ok(Self { current })
    }

    /// The configuration a new connection gets.
    pub fn current(&self) -> Arc<rustls::ServerConfig> {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

fn invalid(key: String, e: impl std::fmt::Display) -> ConfigError {
    ConfigError::invalid(&key, e.to_string())
}

/// The certificates in `pem` (the configuration key `key` names its file in errors).
pub fn certificates(pem: &[u8], key: String) -> Result<Vec<CertificateDer<'static>>, ConfigError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| invalid(key.clone(), e))?;
    match certs.is_empty() {
        true => Err(invalid(key, "no PEM certificate in the file")),
        false => Ok(certs),
    }
}

/// The private key in `pem` (the configuration key `key` names its file in errors).
pub fn private_key(pem: &[u8], key: String) -> Result<PrivateKeyDer<'static>, ConfigError> {
    PrivateKeyDer::from_pem_slice(pem).map_err(|e| invalid(key, e))
}

/// The certificates in the PEM file at `path`, named by `key`.
fn certificates_in(path: &str, key: String) -> Result<Vec<CertificateDer<'static>>, ConfigError> {
    certificates(&read(&key, path)?, key)
}

/// The rustls configuration of `tls` (keys under `prefix`) speaking `alpn`.
pub(crate) fn server_config(
    tls: &ServerTls,
    prefix: &str,
    alpn: Alpn,
) -> Result<rustls::ServerConfig, ConfigError> {
    let key = |k: &str| format!("{prefix}.{k}");
    let certs = certificates_in(&tls.cert_file, key("cert_file"))?;
    let private = private_key(&read(&key("key_file"), &tls.key_file)?, key("key_file"))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| invalid(key("cert_file"), e))?;
    let builder = match tls.client_ca_file.as_str() {
        "" => builder.with_no_client_auth(),
        ca => {
            let mut roots = rustls::RootCertStore::empty();
            for cert in certificates_in(ca, key("client_ca_file"))? {
                roots
                    .add(cert)
                    .map_err(|e| invalid(key("client_ca_file"), e))?;
            }
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots),
                provider,
            )
            .build()
            .map_err(|e| invalid(key("client_ca_file"), e))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder
        .with_single_cert(certs, private)
        .map_err(|e| invalid(key("key_file"), e))?;
    config.alpn_protocols = vec![match alpn {
        Alpn::H2 => b"h2".to_vec(),
        Alpn::Http1 => b"http/1.1".to_vec(),
    }];
    Ok(config)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::path::Path;

    /// A server's TLS settings from a new self-signed certificate for `name`, written in
    /// `dir` (tls.crt, tls.key).
    pub(crate) fn self_signed(dir: &Path, name: &str) -> ServerTls {
        let made = rcgen::generate_simple_self_signed(vec![name.to_string()]).unwrap();
        let (cert, key) = (dir.join("tls.crt"), dir.join("tls.key"));
        std::fs::write(&cert, made.cert.pem()).unwrap();
        std::fs::write(&key, made.signing_key.serialize_pem()).unwrap();
        ServerTls {
            cert_file: cert.to_string_lossy().into_owned(),
            key_file: key.to_string_lossy().into_owned(),
            ..ServerTls::default()
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_change_that_loads_replaces_the_configuration_and_one_that_does_not_keeps_it() {
        let dir = tempfile::tempdir().unwrap();
        let tls = self_signed(dir.path(), "a.test");
        let interval = Duration::from_millis(100);
        let files = ServerConfigFiles::watch(&tls, "tls", Alpn::H2, interval).unwrap();
        let first = files.current();
        assert_eq!(first.alpn_protocols, [b"h2".to_vec()]);
        tokio::time::sleep(interval * 3).await;
        assert!(Arc::ptr_eq(&first, &files.current()), "unchanged files");

        // A certificate without its key (half of a renewal): the old configuration stays.
        let old_key = std::fs::read(&tls.key_file).unwrap();
        self_signed(dir.path(), "b.test");
        std::fs::write(&tls.key_file, &old_key).unwrap();
        tokio::time::sleep(interval * 3).await;
        assert!(Arc::ptr_eq(&first, &files.current()), "a mismatched pair");

        // The renewal completes.
        self_signed(dir.path(), "b.test");
        tokio::time::sleep(interval * 3).await;
        let renewed = files.current();
        assert!(!Arc::ptr_eq(&first, &renewed));
        assert_eq!(renewed.alpn_protocols, [b"h2".to_vec()]);
    }
}
