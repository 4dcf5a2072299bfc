//! TLS for every gRPC server and client, from PEM files (what a Kubernetes Secret mounts,
//! cert-manager's `tls.crt` / `tls.key` / `ca.crt` included). Off when no certificate is
//! configured: plaintext on loopback is the default.

use crate::config::ConfigError;
use crate::tls_files::{self, Alpn, ServerConfigFiles};
use rustls::pki_types::ServerName;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::Duration;
use tonic::Status;
use tonic::transport::{Certificate, ClientTlsConfig, Identity};

/// A server's TLS: its certificate and key, and, for mutual TLS, the CA whose certificates
/// clients must present.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ServerTls {
    /// PEM certificate chain; empty: plaintext.
    pub cert_file: String,
    /// PEM private key of `cert_file`.
    pub key_file: String,
    /// PEM CA bundle; set: every client must present a certificate it signed (mTLS).
    pub client_ca_file: String,
    /// With `client_ca_file`: a client's certificate must also carry one of these names (DNS
    /// names or IP addresses, as its subject alternative names), so that of the services
    /// holding certificates from the same CA only these clients get in (the workers: the
    /// coordinator's). Empty: any certificate the CA signed.
    #[serde(default)]
    pub client_names: Vec<String>,
    /// How often the files are read again (and, on the coordinator, those of `target.tls`
    /// and `draft.tls`): when they changed, new connections use them (a renewed
    /// certificate needs no restart); files that do not load keep the ones in use.
    pub reload_interval_ms: u64,
}

impl Default for ServerTls {
    fn default() -> Self {
        Self {
            cert_file: String::new(),
            key_file: String::new(),
            client_ca_file: String::new(),
            client_names: Vec::new(),
            reload_interval_ms: crate::tls_files::RELOAD_INTERVAL.as_millis() as u64,
        }
    }
}

/// The names a client's certificate must carry (`client_names`), checked on every call.
#[derive(Debug, Clone, Default)]
pub struct ClientNames(Arc<Vec<ServerName<'static>>>);

impl ClientNames {
    /// Lets `request` through when no names are set, or when its client's certificate is
    /// valid for one of them; else PERMISSION_DENIED (the CA signed it, for another service).
    pub fn check(&self, request: tonic::Request<()>) -> Result<tonic::Request<()>, Status> {
        if self.0.is_empty() {
            return Ok(request);
        }
        let certs = request.peer_certs();
        let leaf = certs.as_deref().and_then(|c| c.first());
        let leaf = leaf.ok_or_else(|| Status::unauthenticated("no client certificate"))?;
        let cert = webpki::EndEntityCert::try_from(leaf)
            .map_err(|e| Status::unauthenticated(format!("client certificate: {e}")))?;
        if self
            .0
            .iter()
            .any(|name| cert.verify_is_valid_for_subject_name(name).is_ok())
        {
            return Ok(request);
        }
        Err(Status::permission_denied(
            "the client certificate carries none of this server's tls.client_names",
        ))
    }
}

/// A client's TLS toward one worker (on when the worker's URLs are `https://`).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ClientTls {
    /// PEM CA bundle that signed the worker's certificate.
    pub ca_file: String,
    /// PEM certificate this client presents (mTLS); empty: none.
    pub cert_file: String,
    /// PEM private key of `cert_file`.
    pub key_file: String,
    /// The name the worker's certificate must carry; empty: the host of its URL.
    pub domain: String,
}

/// The bytes of the file at `path`, named by its configuration `key` in an error.
pub(crate) fn read(key: &str, path: &str) -> Result<Vec<u8>, ConfigError> {
    std::fs::read(path).map_err(|e| ConfigError::invalid(key, format!("{path}: {e}")))
}

/// Both or neither of a certificate and its key.
fn check_pair(prefix: &str, cert: &str, key: &str) -> Result<(), ConfigError> {
    if cert.is_empty() != key.is_empty() {
        return Err(ConfigError::invalid(
            &format!("{prefix}.key_file"),
            "set both cert_file and key_file, or neither",
        ));
    }
    Ok(())
}

impl ServerTls {
    pub fn enabled(&self) -> bool {
        !self.cert_file.is_empty()
    }

    /// Checks the settings under `prefix` (`tls`) and reads the files: what the server
    /// speaking `alpn` serves with (read again as the files change), or `None` for
    /// plaintext.
    pub fn load(&self, prefix: &str, alpn: Alpn) -> Result<Option<LoadedTls>, ConfigError> {
        let Some(client_names) = self.client_names(prefix)? else {
            return Ok(None);
        };
        let interval = Duration::from_millis(self.reload_interval_ms);
        let config = ServerConfigFiles::watch(self, prefix, alpn, interval)?;
        Ok(Some(LoadedTls {
            config,
            client_names,
        }))
    }

    /// What [`ServerTls::load`] checks (the settings, and that the files load), for a
    /// configuration check: nothing is kept or watched.
    pub fn check(&self, prefix: &str) -> Result<(), ConfigError> {
        if self.client_names(prefix)?.is_some() {
            tls_files::server_config(self, prefix, Alpn::H2)?;
        }
        Ok(())
    }

    /// Checks the settings under `prefix`: the client names parsed, or `None` for
    /// plaintext.
    fn client_names(&self, prefix: &str) -> Result<Option<ClientNames>, ConfigError> {
        check_pair(prefix, &self.cert_file, &self.key_file)?;
        if !self.enabled() {
            if !self.client_ca_file.is_empty() {
                return Err(ConfigError::invalid(
                    &format!("{prefix}.client_ca_file"),
                    "mutual TLS needs the server's own cert_file and key_file",
                ));
            }
            return Ok(None);
        }
        if !self.client_names.is_empty() && self.client_ca_file.is_empty() {
            return Err(ConfigError::invalid(
                &format!("{prefix}.client_names"),
                "checking client names needs client_ca_file (mutual TLS)",
            ));
        }
        if self.reload_interval_ms == 0 {
            return Err(ConfigError::invalid(
                &format!("{prefix}.reload_interval_ms"),
                "must be at least 1",
            ));
        }
        let names = self.client_names.iter().map(|n| {
            ServerName::try_from(n.clone()).map_err(|_| {
                ConfigError::invalid(
                    &format!("{prefix}.client_names"),
                    format!("{n:?} is not a DNS name or an IP address"),
                )
            })
        });
        Ok(Some(ClientNames(Arc::new(
            names.collect::<Result<_, _>>()?,
        ))))
    }
}

/// A server's TLS as it serves: its configuration (following the files), the client
/// names parsed.
#[derive(Debug, Clone)]
pub struct LoadedTls {
    pub config: ServerConfigFiles,
    pub client_names: ClientNames,
}

impl ClientTls {
    /// Checks the settings under `prefix` (`target.tls`) and reads the files; `host` is the
    /// worker's host name, the default `domain`.
    pub fn load(&self, prefix: &str, host: &str) -> Result<ClientTlsConfig, ConfigError> {
        check_pair(prefix, &self.cert_file, &self.key_file)?;
        if self.ca_file.is_empty() {
            return Err(ConfigError::invalid(
                &format!("{prefix}.ca_file"),
                "an https:// worker needs the CA that signed its certificate",
            ));
        }
        let key = |k: &str| format!("{prefix}.{k}");
        // Parsed as PEM here too, so that a bad file is refused now, not at the first
        // connection.
        let ca = read(&key("ca_file"), &self.ca_file)?;
        tls_files::certificates(&ca, key("ca_file"))?;
        let identity = match self.cert_file.is_empty() {
            true => None,
            false => {
                let cert = read(&key("cert_file"), &self.cert_file)?;
                let private = read(&key("key_file"), &self.key_file)?;
                tls_files::certificates(&cert, key("cert_file"))?;
                tls_files::private_key(&private, key("key_file"))?;
                Some((cert, private))
            }
        };
        let domain = if self.domain.is_empty() {
            host
        } else {
            &self.domain
        };
        Ok(client_config(Some(ca), identity, Some(domain)))
    }

    /// The files it reads.
    pub fn files(&self) -> Vec<String> {
        [&self.ca_file, &self.cert_file, &self.key_file]
            .into_iter()
            .filter(|f| !f.is_empty())
            .cloned()
            .collect()
    }

    /// Whether any setting is made (they mean nothing for a plaintext worker).
    pub fn is_set(&self) -> bool {
        self != &Self::default()
    }
}

/// A client's TLS from PEM bytes: trusting `ca` (without one, the system's roots),
/// presenting `identity` (certificate and key: mutual TLS), and expecting `domain` on the
/// server's certificate (without one, the host of the address).
pub fn client_config(
    ca: Option<Vec<u8>>,
    identity: Option<(Vec<u8>, Vec<u8>)>,
    domain: Option<&str>,
) -> ClientTlsConfig {
    let mut tls = match ca {
        Some(ca) => ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca)),
        None => ClientTlsConfig::new().with_native_roots(),
    };
    if let Some(domain) = domain {
        tls = tls.domain_name(domain);
    }
    if let Some((cert, key)) = identity {
        tls = tls.identity(Identity::from_pem(cert, key));
    }
    tls
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_names_need_mutual_tls_and_must_be_names() {
        let dir = tempfile::tempdir().unwrap();
        let mut tls = tls_files::tests::self_signed(dir.path(), "worker.duet.svc");
        tls.client_names = vec!["coordinator.duet.svc".into()];
        let refusal = |tls: &ServerTls| tls.load("tls", Alpn::H2).unwrap_err().to_string();
        assert!(
            refusal(&tls).contains("needs client_ca_file"),
            "{}",
            refusal(&tls)
        );
        tls.client_ca_file = tls.cert_file.clone();
        let loaded = tls.load("tls", Alpn::H2).unwrap().unwrap();
        assert_eq!(loaded.client_names.0.len(), 1);
        tls.client_names.push("not a name".into());
        assert!(
            refusal(&tls).contains("\"not a name\" is not a DNS name"),
            "{}",
            refusal(&tls)
        );
    }
}
