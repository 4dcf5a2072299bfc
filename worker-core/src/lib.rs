//! What both duet workers are: the loaded model on one thread fed by one bounded queue
//! (candle serialises concurrent forward passes anyway), the session table with its limits,
//! the `duet.v1.Worker` service both serve (Describe, OpenSession, CloseSession, Stats), and
//! running a worker binary. A worker adds its own model work through [`Handler`] and its own
//! gRPC service (Propose, Verify) by implementing [`Worker`].

mod adapters;
mod config;
mod core;
mod error;
mod gather;
mod load;
mod metrics;
mod model_thread;
mod prefix_cache;
mod run;
mod service;
mod sessions;
mod trace;

pub use config::WorkerConfig;
pub use core::{OpenRequest, Opened, WorkerCore, WorkerStats};
pub use error::WorkerError;
pub use gather::SessionKey;
pub use load::{ModelDescription, default_model_path};
pub use model_thread::{Handler, More, Timing, read_side_by_side, whole_chunks_switched_on};
pub use run::{RunError, Worker, main, serve};
pub use service::{WorkerService, status, timing_to_wire};
pub use sessions::{
    Clock, Limits, Reservation, Session, SessionId, SessionStats, Sessions, SystemClock,
};
pub use trace::{CallTrace, Forward};
