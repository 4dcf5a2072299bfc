//! How the command-line tools (duet-client, duet-bench) reach a coordinator as a caller
//! does: plaintext, or TLS for an `https://` address (the CA that signed the coordinator's
//! certificate, or the system's roots; a client certificate for mutual TLS), and the public
//! API's bearer token (`auth_token_file` on the server).

use duet_proto::v1::generation_client::GenerationClient;
use duet_serving::tls::client_config;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Status};

/// Largest message the tools accept (the services' own limit).
const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// The connection flags the tools share.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct Connection {
    /// PEM CA bundle that signed the coordinator's certificate (an https:// address; without
    /// it, the system's trusted roots).
    #[arg(long, value_name = "PEM")]
    pub ca_file: Option<String>,
    /// PEM certificate this client presents, for a coordinator that requires mutual TLS.
    #[arg(long, value_name = "PEM", requires = "key_file")]
    pub cert_file: Option<String>,
    /// PEM private key of --cert-file.
    #[arg(long, value_name = "PEM", requires = "cert_file")]
    pub key_file: Option<String>,
    /// The name the coordinator's certificate must carry (default: the address's host).
    #[arg(long, value_name = "NAME")]
    pub tls_domain: Option<String>,
    /// File holding the bearer token the coordinator expects (its `auth_token_file`).
    #[arg(long, value_name = "PATH", env = "DUET_TOKEN_FILE")]
    pub token_file: Option<String>,
}

/// A Generation client that sends the bearer token, if any, on every call.
pub type Client = GenerationClient<InterceptedService<Channel, Bearer>>;

/// Adds `authorization: Bearer <token>` to each call (nothing without a token).
#[derive(Debug, Clone, Default)]
pub struct Bearer(Option<MetadataValue<Ascii>>);

impl Interceptor for Bearer {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(value) = &self.0 {
            request
                .metadata_mut()
                .insert("authorization", value.clone());
        }
        Ok(request)
    }
}

fn read(flag: &str, path: &str) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("{flag} {path}: {e}"))
}

impl Connection {
    /// The endpoint for `url`: TLS when it is `https://`. TLS flags for an `http://` address
    /// are refused rather than ignored (the caller meant an encrypted connection).
    pub fn endpoint(&self, url: &str) -> Result<Endpoint, String> {
        let endpoint = Endpoint::from_shared(url.to_string())
            .map_err(|e| format!("invalid address {url:?}: {e}"))?;
        let tls_flags =
            self.ca_file.is_some() || self.cert_file.is_some() || self.tls_domain.is_some();
        if !url.trim().starts_with("https://") {
            if tls_flags {
                return Err(format!(
                    "TLS flags for {url}, a plaintext address (use https://)"
                ));
            }
            return Ok(endpoint);
        }
        let ca = self
            .ca_file
            .as_ref()
            .map(|p| read("--ca-file", p))
            .transpose()?;
        let identity = match (&self.cert_file, &self.key_file) {
            (Some(cert), Some(key)) => Some((read("--cert-file", cert)?, read("--key-file", key)?)),
            _ => None,
        };
        let tls = client_config(ca, identity, self.tls_domain.as_deref());
        endpoint
            .tls_config(tls)
            .map_err(|e| format!("TLS for {url}: {e}"))
    }

    /// The bearer token's interceptor (surrounding whitespace in the file is not part of
    /// the token, as on the server).
    pub fn bearer(&self) -> Result<Bearer, String> {
        let Some(path) = &self.token_file else {
            return Ok(Bearer(None));
        };
        let text = String::from_utf8(read("--token-file", path)?)
            .map_err(|_| format!("--token-file {path}: not UTF-8 text"))?;
        let token = text.trim();
        if token.is_empty() {
            return Err(format!("--token-file {path} is empty"));
        }
        let value = format!("Bearer {token}")
            .parse()
            .map_err(|_| format!("--token-file {path}: not a valid header value"))?;
        Ok(Bearer(Some(value)))
    }

    /// A Generation client on `channel` with the bearer token and the message size limit.
    pub fn client(&self, channel: Channel) -> Result<Client, String> {
        Ok(GenerationClient::with_interceptor(channel, self.bearer()?)
            .max_decoding_message_size(MAX_MESSAGE_BYTES))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_flags_need_an_https_address() {
        let c = Connection {
            ca_file: Some("ca.pem".into()),
            ..Connection::default()
        };
        let err = c.endpoint("http://127.0.0.1:50061").unwrap_err();
        assert_eq!(
            err,
            "TLS flags for http://127.0.0.1:50061, a plaintext address (use https://)"
        );
        let err = c.endpoint("https://127.0.0.1:50061").unwrap_err();
        assert!(err.starts_with("--ca-file ca.pem: "), "{err}");
    }

    #[test]
    fn the_token_is_sent_as_a_bearer_header() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, "s3cret\n").unwrap();
        let c = Connection {
            token_file: Some(path.to_string_lossy().into_owned()),
            ..Connection::default()
        };
        let request = c.bearer().unwrap().call(Request::new(())).unwrap();
        assert_eq!(
            request.metadata().get("authorization").unwrap(),
            "Bearer s3cret"
        );
        std::fs::write(&path, " \n").unwrap();
        assert!(c.bearer().unwrap_err().ends_with("is empty"));
        let mut none = Connection::default().bearer().unwrap();
        let request = none.call(Request::new(())).unwrap();
        assert!(request.metadata().get("authorization").is_none());
    }
}
