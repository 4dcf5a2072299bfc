//! Authenticated, encrypted transport with certificates made at test time: TLS on every
//! server, mutual TLS between the coordinator and its workers, and the public API's bearer
//! token.

use duet_e2e::common::*;
use duet_proto::v1 as pb;
use duet_proto::v1::SpeculationMethod::DraftModel;
use duet_proto::v1::SpeculationMethod::None as TargetOnly;
use duet_proto::v1::generation_client::GenerationClient;
use duet_proto::v1::worker_client::WorkerClient;
use duet_serving::tls::{ClientTls, ServerTls};
use duet_tools::connect::Connection;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tonic::Code;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// A certificate authority whose files live in `dir`.
struct Ca {
    issuer: CertifiedIssuer<'static, KeyPair>,
    dir: PathBuf,
    name: String,
}

/// A PEM certificate and key on disk.
#[derive(Clone)]
struct Pair {
    cert: PathBuf,
    key: PathBuf,
}

impl Ca {
    fn new(dir: &Path, name: &str) -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        std::fs::write(dir.join(format!("{name}.pem")), issuer.pem()).unwrap();
        Self {
            issuer,
            dir: dir.to_path_buf(),
            name: name.into(),
        }
    }

    fn pem_file(&self) -> PathBuf {
        self.dir.join(format!("{}.pem", self.name))
    }

    fn pem(&self) -> String {
        self.issuer.pem()
    }

    /// A certificate for 127.0.0.1, localhost and `name`.duet.internal (servers and clients
    /// alike).
    fn issue(&self, name: &str) -> Pair {
        let names = ["127.0.0.1", "localhost", &format!("{name}.duet.internal")].map(String::from);
        let mut params = CertificateParams::new(names.to_vec()).unwrap();
        params.distinguished_name.push(DnType::CommonName, name);
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        let pair = Pair {
            cert: self.dir.join(format!("{name}.crt")),
            key: self.dir.join(format!("{name}.key")),
        };
        std::fs::write(&pair.cert, cert.pem()).unwrap();
        std::fs::write(&pair.key, key.serialize_pem()).unwrap();
        pair
    }
}

fn s(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

fn server_tls(pair: &Pair, client_ca: Option<&Ca>) -> ServerTls {
    ServerTls {
        cert_file: s(&pair.cert),
        key_file: s(&pair.key),
        client_ca_file: client_ca.map(|ca| s(&ca.pem_file())).unwrap_or_default(),
        client_names: Vec::new(),
        ..ServerTls::default()
    }
}

/// A TLS channel to `addr` trusting `ca`, presenting `identity` if any.
async fn tls_channel(
    addr: std::net::SocketAddr,
    ca: &Ca,
    identity: Option<&Pair>,
) -> Result<Channel, tonic::transport::Error> {
    tls_channel_to(addr, "127.0.0.1", ca, identity).await
}

/// A TLS channel to `addr`, whose certificate must carry `name`.
async fn tls_channel_to(
    addr: std::net::SocketAddr,
    name: &str,
    ca: &Ca,
    identity: Option<&Pair>,
) -> Result<Channel, tonic::transport::Error> {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca.pem()))
        .domain_name(name);
    if let Some(p) = identity {
        tls = tls.identity(Identity::from_pem(
            std::fs::read(&p.cert).unwrap(),
            std::fs::read(&p.key).unwrap(),
        ));
    }
    Channel::from_shared(format!("https://{addr}"))
        .unwrap()
        .tls_config(tls)?
        .connect()
        .await
}

/// Waits until the TLS server at `addr` reports SERVING.
async fn wait_tls_serving(addr: std::net::SocketAddr, ca: &Ca, identity: Option<&Pair>) {
    let wait = async {
        loop {
            if let Ok(channel) = tls_channel(addr, ca, identity).await {
                let answer = HealthClient::new(channel)
                    .check(tonic_health::pb::HealthCheckRequest::default())
                    .await;
                if answer.is_ok_and(|r| r.get_ref().status == ServingStatus::Serving as i32) {
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(60), wait)
        .await
        .unwrap_or_else(|_| panic!("{addr} did not serve over TLS"));
}

/// Workers that take only the coordinator's client certificate, a coordinator that serves
/// TLS and wants a bearer token: a client with the CA and the token gets its tokens; a
/// worker refuses clients without the right certificate (the target, with `client_names`,
/// also another service's from the same CA), and the public API refuses a missing or wrong
/// token with UNAUTHENTICATED.
#[tokio::test]
async fn mutual_tls_to_the_workers_and_a_token_on_the_public_api() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new(dir.path(), "duet-ca");
    let (worker, coordinator_client) = (ca.issue("worker"), ca.issue("coordinator"));
    let public = ca.issue("public");
    let stranger_ca = Ca::new(dir.path(), "stranger-ca");
    let stranger = stranger_ca.issue("stranger");
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "s3cret-token\n").unwrap();

    let m = tiny_models();
    let mut draft = worker_config(&m.draft);
    draft.tls = server_tls(&worker, Some(&ca));
    let mut target = worker_config(&m.target);
    target.tls = server_tls(&worker, Some(&ca));
    target.tls.client_names = vec!["coordinator.duet.internal".into()];
    let (draft, target) = (start_draft(draft), start_target(target));
    let client_tls = ClientTls {
        ca_file: s(&ca.pem_file()),
        cert_file: s(&coordinator_client.cert),
        key_file: s(&coordinator_client.key),
        domain: String::new(),
    };
    let mut config = coordinator_config(
        &format!("https://{}", target.addr),
        Some(&format!("https://{}", draft.addr)),
    );
    config.target.tls = client_tls.clone();
    config.draft.tls = client_tls;
    config.tls = server_tls(&public, None);
    config.auth_token_file = s(&token_file);
    // The coordinator serves once its target does; a draft-worker still loading when the
    // coordinator first asks for it is skipped for a while (its breaker), and the request
    // would run target-only.
    wait_tls_serving(draft.addr, &ca, Some(&coordinator_client)).await;
    let coordinator = start_coordinator(config);
    wait_tls_serving(coordinator.addr, &ca, None).await;

    // The whole path over TLS: the client to the coordinator (connected as duet-client and
    // duet-bench connect, with --ca-file, --tls-domain and --token-file), the coordinator to
    // both workers with its certificate.
    let tool = Connection {
        ca_file: Some(s(&ca.pem_file())),
        tls_domain: Some("localhost".into()),
        token_file: Some(s(&token_file)),
        ..Connection::default()
    };
    let url = format!("https://{}", coordinator.addr);
    let channel = tool.endpoint(&url).unwrap().connect().await.unwrap();
    let mut tool_client = tool.client(channel).unwrap();
    let req = request("the cat", 20, DraftModel);
    let g = Completion::read(
        tool_client.generate(req).await.unwrap().into_inner(),
        |_| {},
    )
    .await
    .unwrap();
    assert_eq!(g.usage.completion_tokens, 20);
    assert!(
        g.usage.draft_tokens_proposed > 0 && !g.usage.fell_back_to_target_only,
        "{:?}",
        g.usage
    );

    // The token: missing, wrong.
    let channel = tls_channel(coordinator.addr, &ca, None).await.unwrap();
    let mut client = GenerationClient::new(channel);
    for header in [None, Some("Bearer s3cret-tokenX"), Some("s3cret-token")] {
        let mut req = tonic::Request::new(request("the cat", 5, DraftModel));
        if let Some(h) = header {
            req.metadata_mut()
                .insert("authorization", h.parse().unwrap());
        }
        let err = client.generate(req).await.unwrap_err();
        assert_eq!(err.code(), Code::Unauthenticated, "{header:?}: {err:?}");
    }

    // A worker: the coordinator's certificate is let in; no certificate, one from another
    // CA, or plaintext are not.
    let stats = |channel: Channel| async move {
        WorkerClient::new(channel)
            .stats(pb::StatsRequest {})
            .await
            .map(|r| r.into_inner())
    };
    let ok = tls_channel(target.addr, &ca, Some(&coordinator_client))
        .await
        .unwrap();
    assert!(stats(ok).await.is_ok());
    for identity in [None, Some(&stranger)] {
        let refused = match tls_channel(target.addr, &ca, identity).await {
            Ok(channel) => stats(channel).await.is_err(),
            Err(_) => true,
        };
        assert!(
            refused,
            "a client with {:?} got in",
            identity.map(|p| &p.cert)
        );
    }
    // Signed by the same CA, but for another service (a draft-worker's own certificate).
    let channel = tls_channel(target.addr, &ca, Some(&worker)).await.unwrap();
    let denied = stats(channel).await.unwrap_err();
    assert_eq!(denied.code(), Code::PermissionDenied, "{denied:?}");
    let plaintext = Channel::from_shared(target.url()).unwrap().connect().await;
    let refused = match plaintext {
        Ok(channel) => stats(channel).await.is_err(),
        Err(_) => true,
    };
    assert!(refused, "a plaintext client got in");
}

/// Renewed certificates take effect without a restart (`tls.reload_interval_ms`, 100 ms
/// here), as cert-manager renews them in place: the coordinator's client certificate,
/// rewritten from one the target refuses (another service's name) to its own, gets its
/// requests through; the target's server certificate, rewritten for another name, is what
/// the next connection sees.
#[tokio::test]
async fn renewed_certificate_files_take_effect_without_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new(dir.path(), "duet-ca");
    let (served, presented) = (ca.issue("old"), ca.issue("draft"));
    let renew = |to: &Pair, from: &Pair| {
        std::fs::copy(&from.cert, &to.cert).unwrap();
        std::fs::copy(&from.key, &to.key).unwrap();
    };
    let m = tiny_models();
    let mut target = worker_config(&m.target);
    target.tls = server_tls(&served, Some(&ca));
    target.tls.client_names = vec!["coordinator.duet.internal".into()];
    target.tls.reload_interval_ms = 100;
    let target = start_target(target);
    let mut config = coordinator_config(&format!("https://{}", target.addr), None);
    config.target.tls = ClientTls {
        ca_file: s(&ca.pem_file()),
        cert_file: s(&presented.cert),
        key_file: s(&presented.key),
        domain: String::new(),
    };
    config.tls.reload_interval_ms = 100;
    config.target.health_interval_ms = 100;
    let coordinator = start_coordinator(config);
    let refused = generate(&coordinator.url(), request("the cat", 4, TargetOnly)).await;
    assert_eq!(refused.unwrap_err().code(), Code::Unavailable);

    renew(&presented, &ca.issue("coordinator"));
    wait_serving(&coordinator.url(), "").await;
    let done = generate(&coordinator.url(), request("the cat", 4, TargetOnly)).await;
    assert_eq!(done.unwrap().usage.completion_tokens, 4);

    let new_name = "new.duet.internal";
    let who = Some(&presented);
    assert!(
        tls_channel_to(target.addr, new_name, &ca, who)
            .await
            .is_err()
    );
    renew(&served, &ca.issue("new"));
    let renewed = async {
        while tls_channel_to(target.addr, new_name, &ca, who)
            .await
            .is_err()
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(5), renewed)
        .await
        .expect("the renewed server certificate was not served");
    let done = generate(&coordinator.url(), request("a dog", 4, TargetOnly)).await;
    assert_eq!(done.unwrap().usage.completion_tokens, 4);
}

/// A client that connects to a TLS gRPC server and never starts its handshake is dropped
/// after `http2.tls_handshake_timeout_ms`, while another client's handshake goes through
/// meanwhile (each handshake runs in a task of its own).
#[tokio::test]
async fn a_silent_client_is_dropped_at_the_handshake_deadline() {
    use tokio::io::AsyncReadExt;
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new(dir.path(), "duet-ca");
    let m = tiny_models();
    let mut target = worker_config(&m.target);
    target.tls = server_tls(&ca.issue("worker"), None);
    target.http2.tls_handshake_timeout_ms = 500;
    let target = start_target(target);
    wait_tls_serving(target.addr, &ca, None).await;
    let started = std::time::Instant::now();
    let mut silent = tokio::net::TcpStream::connect(target.addr).await.unwrap();
    let channel = tls_channel(target.addr, &ca, None).await.unwrap();
    let stats = WorkerClient::new(channel).stats(pb::StatsRequest {}).await;
    assert!(stats.is_ok(), "{stats:?}");
    assert!(started.elapsed() < Duration::from_millis(500));
    let mut byte = [0u8; 1];
    let read = tokio::time::timeout(Duration::from_secs(5), silent.read(&mut byte)).await;
    assert!(matches!(read, Ok(Ok(0)) | Ok(Err(_))), "{read:?}");
    assert!(started.elapsed() >= Duration::from_millis(500));
}

/// One `POST path` with a JSON body over TLS to `addr` (trusting `ca`, presenting
/// `identity` if any): the status, or the error of the handshake or the exchange.
async fn https_post(
    addr: std::net::SocketAddr,
    ca: &Ca,
    identity: Option<&Pair>,
    path: &str,
    body: &str,
) -> std::io::Result<u16> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(ca.pem().as_bytes()).unwrap())
        .unwrap();
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    let config = match identity {
        Some(p) => builder
            .with_client_auth_cert(
                vec![CertificateDer::from_pem_file(&p.cert).unwrap()],
                PrivateKeyDer::from_pem_file(&p.key).unwrap(),
            )
            .unwrap(),
        None => builder.with_no_client_auth(),
    };
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let name = ServerName::try_from("localhost").unwrap();
    let mut tls = connector.connect(name, tcp).await?;
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: duet\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    tls.write_all(request.as_bytes()).await?;
    let mut answer = String::new();
    tls.read_to_string(&mut answer).await?;
    let status = answer.split(' ').nth(1).and_then(|s| s.parse().ok());
    status.ok_or_else(|| std::io::Error::other(format!("no HTTP status in {answer:?}")))
}

/// With `tls` (mutual) set, the OpenAI-compatible API serves HTTPS with the gRPC server's
/// certificate and client check: a client with a certificate from the CA completes a
/// request; one without a certificate, and plaintext HTTP, do not.
#[tokio::test]
async fn the_http_api_serves_https_with_the_same_certificates() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new(dir.path(), "duet-ca");
    let (public, caller) = (ca.issue("public"), ca.issue("caller"));
    let m = tiny_models();
    let target = start_target(worker_config(&m.target));
    let mut config = coordinator_config(&target.url(), None);
    config.tls = server_tls(&public, Some(&ca));
    let coordinator = start_coordinator(config);
    wait_tls_serving(coordinator.addr, &ca, Some(&caller)).await;
    let body = r#"{"model": "x", "prompt": "the cat", "max_tokens": 5}"#;
    let addr = coordinator.http_addr;
    assert_eq!(
        https_post(addr, &ca, Some(&caller), "/v1/completions", body)
            .await
            .unwrap(),
        200
    );
    let anonymous = https_post(addr, &ca, None, "/v1/completions", body).await;
    assert!(anonymous.is_err(), "{anonymous:?}");
    // Plaintext HTTP on the HTTPS port: whatever comes back is no HTTP answer.
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut plain = tokio::net::TcpStream::connect(addr).await.unwrap();
    plain
        .write_all(b"GET /v1/models HTTP/1.1\r\nHost: duet\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(15), plain.read_to_end(&mut answer)).await;
    assert!(
        !answer.starts_with(b"HTTP/"),
        "{:?}",
        String::from_utf8_lossy(&answer)
    );
}
