//! Files read again while a service runs (certificates, bearer tokens): a Kubernetes Secret
//! changes under a running pod, and what it holds takes effect without a restart. A change
//! that does not load (a file half written, emptied) keeps what is in force, with a warning,
//! until the files change again.

use std::time::Duration;

/// The bytes of each of `files` (`None` for one that cannot be read).
pub fn read_all(files: &[String]) -> Vec<Option<Vec<u8>>> {
    files.iter().map(|f| std::fs::read(f).ok()).collect()
}

/// Every `interval`, reads `files` (`what` they hold, for the log); when their bytes differ
/// from `seen`, calls `reload`: `Ok(true)` takes the change, `Ok(false)` stops watching
/// (nobody uses the result any more), `Err(why)` logs it and tries again once the files
/// change again. Without a tokio runtime, nothing is watched.
pub fn watch_files(
    what: &'static str,
    files: Vec<String>,
    mut seen: Vec<Option<Vec<u8>>>,
    interval: Duration,
    mut reload: impl FnMut() -> Result<bool, String> + Send + 'static,
) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    runtime.spawn(async move {
        let mut failed: Option<Vec<Option<Vec<u8>>>> = None;
        loop {
            tokio::time::sleep(interval).await;
            let now = read_all(&files);
            if now == seen || failed.as_ref() == Some(&now) {
                continue;
            }
            match reload() {
                Ok(true) => {
                    tracing::info!(?files, "{what} changed: the new ones are in force");
                    (seen, failed) = (now, None);
                }
                Ok(false) => return,
                Err(why) => {
                    tracing::warn!(?files, error = %why, "{what} changed but do not load; keeping the ones in force");
                    failed = Some(now);
                }
            }
        }
    });
}
