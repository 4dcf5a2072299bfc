//! A call's spans on a worker: the call's server span, a `queue` span while it waits for the
//! model thread, and a `forward` span while the model works on it.

use tracing_opentelemetry::OpenTelemetrySpanExt;

/// A call's trace on the worker: its server span, and a `queue` span from submission until
/// the model thread takes the call.
#[derive(Debug)]
pub struct CallTrace {
    pub span: tracing::Span,
    queued: Option<tracing::Span>,
    /// Whether [`CallTrace::rewound`] records on the span (a Decode call's first step
    /// does, its later ones, which rewind nothing, do not overwrite it).
    rewinds: bool,
}

impl CallTrace {
    /// Starts the `queue` span under `span` (the call's server span).
    pub fn queued(span: tracing::Span) -> Self {
        let queued = tracing::info_span!(parent: &span, "queue");
        Self {
            span,
            queued: Some(queued),
            rewinds: true,
        }
    }

    /// A later step of a call that has recorded its rollback already.
    pub fn next_step(span: tracing::Span) -> Self {
        Self {
            rewinds: false,
            ..Self::queued(span)
        }
    }

    /// The model thread took the call: the `queue` span ends and a `forward` span starts.
    /// Both it and the call's span (which ends at its last exit, and a streaming call's
    /// handler has long returned) end when the returned guard is dropped.
    pub fn forward(&mut self) -> Forward {
        self.queued = None;
        let call = self.span.clone().entered();
        Forward {
            span: tracing::info_span!(parent: &self.span, "forward"),
            _call: call,
        }
    }

    /// Records how many cached tokens the call's `keep` dropped (the rollback).
    pub fn rewound(&self, cached: usize, keep: usize) {
        if !self.rewinds {
            return;
        }
        self.span
            .set_attribute("duet.rewound_tokens", cached.saturating_sub(keep) as i64);
    }
}

/// A call's model work in progress; see [`CallTrace::forward`].
#[derive(Debug)]
pub struct Forward {
    /// Dropped first: the `forward` span ends inside the call's span.
    pub span: tracing::Span,
    _call: tracing::span::EnteredSpan,
}
