//! TLS for an HTTP server served by `axum::serve`: a listener whose connections come out of
//! their TLS handshake, from the same PEM files (and mutual-TLS CA) as the gRPC server's.
//! Handshakes run in their own tasks with a deadline, so that a client that connects and
//! sends nothing holds up no one else's connection.

use crate::config::ConfigError;
use crate::tls::ServerTls;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

/// How long a client may take over its TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Handshaken connections waiting for the server to take them.
const READY_BACKLOG: usize = 64;

fn invalid(key: String, e: impl std::fmt::Display) -> ConfigError {
    ConfigError::invalid(&key, e.to_string())
}

/// The rustls configuration of `tls` (under the keys `prefix.*`, already checked by
/// [`ServerTls::load`] for the gRPC server), serving HTTP/1.1; `None` for plaintext.
pub fn server_config(
    tls: &ServerTls,
    prefix: &str,
) -> Result<Option<Arc<rustls::ServerConfig>>, ConfigError> {
    if !tls.enabled() {
        return Ok(None);
    }
    let key = |k: &str| format!("{prefix}.{k}");
    let certs = CertificateDer::pem_file_iter(&tls.cert_file)
        .and_then(Iterator::collect::<Result<Vec<_>, _>>)
        .map_err(|e| invalid(key("cert_file"), e))?;
    let private =
        PrivateKeyDer::from_pem_file(&tls.key_file).map_err(|e| invalid(key("key_file"), e))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| invalid(key("cert_file"), e))?;
    let builder = match tls.client_ca_file.as_str() {
        "" => builder.with_no_client_auth(),
        ca => {
            let mut roots = rustls::RootCertStore::empty();
            for cert in
                CertificateDer::pem_file_iter(ca).map_err(|e| invalid(key("client_ca_file"), e))?
            {
                let cert = cert.map_err(|e| invalid(key("client_ca_file"), e))?;
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
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Some(Arc::new(config)))
}

/// A listener whose connections have completed their TLS handshake (for `axum::serve`).
pub struct TlsListener {
    ready: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
}

impl std::fmt::Debug for TlsListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsListener")
            .field("local", &self.local)
            .finish()
    }
}

impl TlsListener {
    /// Accepts on `listener` in the background, each handshake in a task of its own; a
    /// failed or slow handshake is dropped (logged at debug).
    pub fn new(listener: TcpListener, config: Arc<rustls::ServerConfig>) -> std::io::Result<Self> {
        let local = listener.local_addr()?;
        let (tx, ready) = mpsc::channel(READY_BACKLOG);
        let acceptor = TlsAcceptor::from(config);
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    accepted = listener.accept() => accepted,
                    // The server is gone: so is the port.
                    () = tx.closed() => return,
                };
                let (tcp, peer) = match accepted {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        tracing::debug!(error = %e, "accepting an HTTPS connection");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                };
                let (acceptor, tx) = (acceptor.clone(), tx.clone());
                tokio::spawn(async move {
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                        Ok(Ok(tls)) => _ = tx.send((tls, peer)).await,
                        Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                    }
                });
            }
        });
        Ok(Self { ready, local })
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(connection) => connection,
            // The accepting task only ends once this listener is gone.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}
