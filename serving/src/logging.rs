//! Log set-up: human-readable lines by default, JSON lines on request; `RUST_LOG` filters.

use tracing_subscriber::EnvFilter;

/// Installs the global subscriber (once per process; later calls are no-ops).
pub fn init(json: bool, default_filter: &str) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    let _ = if json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
}
