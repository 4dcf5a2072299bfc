//! Why a worker call failed: the domain error every worker job and RPC returns. The one
//! mapping to gRPC codes is in `service.rs`.

use duet_engine::EngineError;
use std::sync::Arc;
use thiserror::Error;

#[derive(Debug, Clone, Error)]
pub enum WorkerError {
    #[error("the model is still loading")]
    Loading,
    #[error("the worker is shutting down")]
    ShuttingDown,
    #[error("session {0} not found (closed, or expired after the idle TTL)")]
    SessionNotFound(crate::sessions::SessionId),
    /// The call names a session of another worker process: this one restarted.
    #[error(
        "session of worker instance {asked:016x}, but this is instance {this:016x} (the worker restarted)"
    )]
    OtherInstance { asked: u64, this: u64 },
    /// An open named an id that a session of this worker has (or is opening).
    #[error("session {0} already exists")]
    SessionExists(crate::sessions::SessionId),
    /// The session was closed before its open finished: the caller gave up on it.
    #[error("session {0} was closed before its open finished")]
    ClosedWhileOpening(crate::sessions::SessionId),
    #[error("session limit reached ({0} open sessions)")]
    SessionLimit(usize),
    #[error("KV-token budget exhausted: {requested} tokens requested, {free} free")]
    KvBudget { requested: usize, free: usize },
    #[error("the model queue is full ({0} calls waiting)")]
    QueueFull(usize),
    /// The room a session gives up is held for an open of this priority number, which
    /// asked for it (`OpenSessionRequest.ask_for_room`).
    #[error("the room freed here is held for a request of priority {0}")]
    RoomClaimed(i32),
    #[error("{field}: {message}")]
    InvalidArgument {
        field: &'static str,
        message: String,
    },
    /// The model thread dropped the call without answering: its job panicked (a bug; the
    /// thread goes on serving other calls).
    #[error("the model thread dropped the call (its job failed unexpectedly)")]
    Dropped,
    /// A Decode stream's step found a later call on its session: the caller has moved on.
    #[error("a later call on the session ended this Decode stream")]
    Superseded,
    /// Shared: one failed batched forward pass fails every call in it with the same error.
    #[error("model error: {0}")]
    Engine(Arc<EngineError>),
}

impl WorkerError {
    pub fn invalid(field: &'static str, message: impl Into<String>) -> Self {
        Self::InvalidArgument {
            field,
            message: message.into(),
        }
    }

    /// A structured output's error: the call's `structured_output` where the format or the
    /// completion does not fit it, else the engine's.
    pub fn of_format(e: EngineError) -> Self {
        match e {
            EngineError::Grammar(why) => Self::invalid("structured_output", why),
            other => other.into(),
        }
    }
}

/// Drafts and the distributions to test them with that do not fit together: the call's.
impl From<duet_engine::verify::VerifyError> for WorkerError {
    fn from(e: duet_engine::verify::VerifyError) -> Self {
        Self::invalid("sampling", e.to_string())
    }
}

impl From<EngineError> for WorkerError {
    fn from(e: EngineError) -> Self {
        Self::Engine(Arc::new(e))
    }
}
