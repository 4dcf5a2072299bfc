//! The gRPC server frame every duet service runs in: `grpc.health.v1` (NOT_SERVING until the
//! service says it is ready), server reflection v1 and v1alpha (grpcurl 1.8 speaks only
//! v1alpha), TCP_NODELAY, and a graceful drain when the shutdown future completes.

use std::future::Future;
use std::time::Duration;
use tokio::net::TcpListener;
use tonic::service::{Routes, RoutesBuilder};
use tonic::transport::server::TcpIncoming;
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

/// Largest message a duet service accepts or sends. Sampling sessions exchange full-vocabulary
/// distributions (151,936 floats each for Qwen), K + 1 of them per Verify answer.
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// Health name that is SERVING while the server runs, whatever the service's readiness: for
/// liveness probes (a coordinator whose target-worker is down is alive, just not ready).
pub const LIVENESS: &str = "liveness";

/// Health of one server: the overall status ("") and its named gRPC services move together.
/// The same readiness and liveness are also kept for HTTP probes ([`Probes`]).
#[derive(Clone)]
pub struct Health {
    reporter: HealthReporter,
    services: std::sync::Arc<[&'static str]>,
    probes: Probes,
}

/// Readiness and liveness as plain flags, for `GET /readyz` and `/livez` on the metrics
/// port: Kubernetes' gRPC probes speak plaintext only, so a TLS server is probed there.
#[derive(Debug, Clone, Default)]
pub struct Probes {
    pub ready: std::sync::Arc<std::sync::atomic::AtomicBool>,
    pub live: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl std::fmt::Debug for Health {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Health")
            .field("services", &self.services)
            .finish()
    }
}

fn status(serving: bool) -> ServingStatus {
    if serving {
        ServingStatus::Serving
    } else {
        ServingStatus::NotServing
    }
}

impl Health {
    /// The flags behind `/readyz` and `/livez`.
    pub fn probes(&self) -> Probes {
        self.probes.clone()
    }

    pub async fn set(&self, serving: bool) {
        use std::sync::atomic::Ordering;
        self.probes.ready.store(serving, Ordering::Relaxed);
        self.reporter.set_service_status("", status(serving)).await;
        for service in self.services.iter() {
            self.reporter
                .set_service_status(service, status(serving))
                .await;
        }
    }

    /// Reports a dependency's state under its own name, apart from the service's readiness.
    pub async fn set_named(&self, name: &str, serving: bool) {
        if name == LIVENESS {
            self.probes
                .live
                .store(serving, std::sync::atomic::Ordering::Relaxed);
        }
        self.reporter
            .set_service_status(name, status(serving))
            .await;
    }
}

/// Routes with health and reflection for the named services (full gRPC names, such as
/// `duet.v1.TargetWorker`), starting NOT_SERVING. Add the services themselves and serve.
pub async fn frame(services: &[&'static str]) -> (Health, RoutesBuilder) {
    let (reporter, health_service) = tonic_health::server::health_reporter();
    let health = Health {
        reporter,
        services: services.into(),
        probes: Probes::default(),
    };
    health.set(false).await;
    health.set_named(LIVENESS, true).await;
    let mut routes = RoutesBuilder::default();
    routes.add_service(health_service);
    // The descriptor sets hold every duet service; list only the ones served here.
    let reflection = || {
        services.iter().fold(
            tonic_reflection::server::Builder::configure()
                .register_encoded_file_descriptor_set(duet_proto::FILE_DESCRIPTOR_SET)
                .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
                .with_service_name(tonic_health::pb::health_server::SERVICE_NAME),
            |builder, service| builder.with_service_name(*service),
        )
    };
    // Both builds only fail on a malformed descriptor set, which is compiled in.
    routes.add_service(
        reflection()
            .build_v1()
            .expect("compiled-in descriptor sets are valid"),
    );
    routes.add_service(
        reflection()
            .build_v1alpha()
            .expect("compiled-in descriptor sets are valid"),
    );
    (health, routes)
}

/// Serves `routes` on `listener` (over TLS when `tls` is set) until `shutdown` completes,
/// then stops accepting connections and waits for in-flight calls (streams included) to
/// finish.
pub async fn serve(
    listener: TcpListener,
    tls: Option<tonic::transport::ServerTlsConfig>,
    routes: Routes,
    shutdown: impl Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    let incoming = TcpIncoming::from(listener)
        .with_nodelay(Some(true))
        .with_keepalive(Some(Duration::from_secs(30)));
    let mut server = tonic::transport::Server::builder();
    if let Some(tls) = tls {
        server = server.tls_config(tls)?;
    }
    server
        .http2_keepalive_interval(Some(Duration::from_secs(20)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)))
        .add_routes(routes)
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
}
