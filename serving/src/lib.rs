//! What duet's three services share: layered configuration, the start of a binary, the gRPC
//! server frame (health, reflection, graceful drain), Prometheus metrics, traces and logs,
//! and the wire forms of engine values.

pub mod busy_poll;
pub mod config;
pub mod config_doc;
pub mod grpc;
pub mod https;
pub mod metrics;
pub mod request_id;
pub mod shutdown;
pub mod startup;
pub mod telemetry;
pub mod tls;
pub mod tls_files;
pub mod watch;
pub mod wire;
