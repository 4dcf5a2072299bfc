//! TLS for every gRPC server and client, from PEM files (what a Kubernetes Secret mounts,
//! cert-manager's `tls.crt` / `tls.key` / `ca.crt` included). Off when no certificate is
//! configured: plaintext on loopback is the default.

use crate::config::ConfigError;
use serde::{Deserialize, Serialize};
use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

/// A server's TLS: its certificate and key, and, for mutual TLS, the CA whose certificates
/// clients must present.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ServerTls {
    /// PEM certificate chain; empty: plaintext.
    pub cert_file: String,
    /// PEM private key of `cert_file`.
    pub key_file: String,
    /// PEM CA bundle; set: every client must present a certificate it signed (mTLS).
    pub client_ca_file: String,
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

fn read(key: &str, path: &str) -> Result<Vec<u8>, ConfigError> {
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
    /// serves with, or `None` for plaintext.
    pub fn load(&self, prefix: &str) -> Result<Option<ServerTlsConfig>, ConfigError> {
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
        let identity = Identity::from_pem(
            read(&format!("{prefix}.cert_file"), &self.cert_file)?,
            read(&format!("{prefix}.key_file"), &self.key_file)?,
        );
        let mut tls = ServerTlsConfig::new().identity(identity);
        if !self.client_ca_file.is_empty() {
            let ca = read(&format!("{prefix}.client_ca_file"), &self.client_ca_file)?;
            tls = tls.client_ca_root(Certificate::from_pem(ca));
        }
        Ok(Some(tls))
    }
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
        let ca = read(&format!("{prefix}.ca_file"), &self.ca_file)?;
        let domain = if self.domain.is_empty() {
            host
        } else {
            &self.domain
        };
        let identity = match self.cert_file.is_empty() {
            true => None,
            false => Some((
                read(&format!("{prefix}.cert_file"), &self.cert_file)?,
                read(&format!("{prefix}.key_file"), &self.key_file)?,
            )),
        };
        Ok(client_config(Some(ca), identity, Some(domain)))
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
