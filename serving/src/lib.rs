//! What duet's services share: layered configuration, the gRPC server frame (health,
//! reflection, graceful drain), traces and logs, wire conversions, and the worker core that
//! both workers build on (sessions, the model queue, the shared RPCs).

pub mod config;
pub mod grpc;
pub mod metrics;
pub mod shutdown;
pub mod telemetry;
pub mod wire;
pub mod worker;
