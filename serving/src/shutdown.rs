//! Shutdown signals: SIGTERM (Kubernetes) or Ctrl-C start a graceful drain.

use std::future::Future;
use std::pin::Pin;
use tokio::sync::watch;

/// A shutdown future handed to a service's `run`.
pub type Signal = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

/// Completes on SIGTERM or SIGINT.
pub async fn signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}

/// A shutdown trigger that many tasks can wait on (tests fire it by hand).
#[derive(Debug, Clone)]
pub struct Shutdown {
    tx: watch::Sender<bool>,
}

impl Default for Shutdown {
    fn default() -> Self {
        Self::new()
    }
}

impl Shutdown {
    pub fn new() -> Self {
        Self {
            tx: watch::channel(false).0,
        }
    }

    pub fn trigger(&self) {
        self.tx.send_replace(true);
    }

    pub fn is_triggered(&self) -> bool {
        *self.tx.borrow()
    }

    /// Completes once [`Shutdown::trigger`] has been called (at once if it already was).
    pub fn wait(&self) -> impl std::future::Future<Output = ()> + Send + use<> {
        let mut rx = self.tx.subscribe();
        async move {
            let _ = rx.wait_for(|t| *t).await;
        }
    }
}
