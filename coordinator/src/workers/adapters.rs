//! The LoRA adapters requests may name: the target-worker's, as its Describe lists them.
//! A worker that reads adapters from a directory (`lora_adapter_dir`) serves one copied in
//! without a restart, so a name not listed here is asked about again, at most once a
//! second, before a request naming it is refused or served by the target alone.

use std::future::Future;
use std::sync::{Arc, RwLock};
use tokio::time::{Duration, Instant};

/// How long a list of a directory's adapters stands before a name it lacks is asked about.
const FRESH_FOR: Duration = Duration::from_secs(1);

/// The adapters' names (shared by every copy of the models).
#[derive(Debug, Clone, Default)]
pub struct AdapterNames {
    names: Arc<RwLock<Vec<String>>>,
    /// The worker reads adapters from a directory (`ModelDescription.adapters_from_dir`).
    from_dir: bool,
    /// When the worker was last asked for its list; one asks at a time.
    asked: Arc<tokio::sync::Mutex<Option<Instant>>>,
}

impl AdapterNames {
    pub fn new(names: Vec<String>, from_dir: bool) -> Self {
        Self {
            names: Arc::new(RwLock::new(names)),
            from_dir,
            asked: Default::default(),
        }
    }

    pub fn contains(&self, name: &str) -> bool {
        self.read().iter().any(|a| a == name)
    }

    /// The names, as last listed.
    pub fn list(&self) -> Vec<String> {
        self.read().clone()
    }

    /// The names joined for a message (the first 16 of a directory's many).
    pub fn joined(&self) -> String {
        duet_engine::adapter_names(&self.read())
    }

    pub fn is_empty(&self) -> bool {
        self.read().is_empty()
    }

    /// Why `name`, which none of them has, is refused: the names there are, or that the
    /// target-workers load none.
    pub fn refusing(&self, name: &str) -> String {
        match self.is_empty() {
            true => format!("`{name}`: the target-workers load no adapters"),
            false => format!("`{name}` is not one of {}", self.joined()),
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Vec<String>> {
        self.names.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Where the worker reads adapters from a directory: the list as `ask` answers it now,
    /// unless it was asked less than a second ago (then the list stands). A failed answer
    /// leaves the list as it was.
    pub async fn refresh<F, E>(&self, ask: impl FnOnce() -> F)
    where
        F: Future<Output = Result<Vec<String>, E>>,
        E: std::fmt::Display,
    {
        if !self.from_dir {
            return;
        }
        let mut asked = self.asked.lock().await;
        if asked.is_some_and(|at| at.elapsed() < FRESH_FOR) {
            return;
        }
        match ask().await {
            Ok(names) => *self.names.write().unwrap_or_else(|e| e.into_inner()) = names,
            Err(e) => tracing::warn!(error = %e, "listing the target-worker's adapters"),
        }
        *asked = Some(Instant::now());
    }

    /// Where the worker reads adapters from a directory: the list as `ask` answers it now,
    /// however recently it was asked (one ask at a time): after a worker refused an adapter
    /// this list has, which may have gone since.
    pub async fn refresh_now<F, E>(&self, ask: impl FnOnce() -> F)
    where
        F: Future<Output = Result<Vec<String>, E>>,
        E: std::fmt::Display,
    {
        if self.from_dir {
            *self.asked.lock().await = None;
            self.refresh(ask).await;
        }
    }

    /// [`Self::refresh`] where `name` is not listed: it may be an adapter added since.
    pub async fn learn<F, E>(&self, name: &str, ask: impl FnOnce() -> F)
    where
        F: Future<Output = Result<Vec<String>, E>>,
        E: std::fmt::Display,
    {
        if self.from_dir && !self.contains(name) {
            self.refresh(ask).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A worker that lists `names` and counts the times it is asked.
    fn worker(
        asked: &AtomicUsize,
        names: &[&str],
    ) -> impl Future<Output = Result<Vec<String>, String>> {
        asked.fetch_add(1, Ordering::Relaxed);
        let names = names.iter().map(|n| n.to_string()).collect();
        std::future::ready(Ok(names))
    }

    /// A name not listed is asked about at most once a second; a listed one never, nor
    /// any where the worker has no adapter directory.
    #[tokio::test(start_paused = true)]
    async fn an_unknown_name_is_asked_about_at_most_once_a_second() {
        let asked = AtomicUsize::new(0);
        let names = AdapterNames::new(vec!["sql".into()], true);
        names.learn("sql", || worker(&asked, &["sql", "new"])).await;
        assert_eq!(asked.load(Ordering::Relaxed), 0);
        names.learn("new", || worker(&asked, &["sql", "new"])).await;
        assert_eq!(asked.load(Ordering::Relaxed), 1);
        assert_eq!(names.list(), ["sql", "new"]);
        names
            .learn("newer", || worker(&asked, &["new", "newer"]))
            .await;
        assert_eq!(asked.load(Ordering::Relaxed), 1);
        assert!(!names.contains("newer"));
        tokio::time::advance(FRESH_FOR).await;
        names
            .learn("newer", || worker(&asked, &["new", "newer"]))
            .await;
        assert_eq!(asked.load(Ordering::Relaxed), 2);
        assert_eq!(names.joined(), "new, newer");

        let fixed = AdapterNames::new(vec!["sql".into()], false);
        fixed.learn("new", || worker(&asked, &["new"])).await;
        fixed.refresh(|| worker(&asked, &["new"])).await;
        fixed.refresh_now(|| worker(&asked, &["new"])).await;
        assert_eq!(asked.load(Ordering::Relaxed), 2);
        assert_eq!(fixed.list(), ["sql"]);
    }

    /// After a worker refused an adapter the list has, the list is asked for at once,
    /// however recently it was.
    #[tokio::test(start_paused = true)]
    async fn a_refused_adapter_has_the_list_asked_for_at_once() {
        let asked = AtomicUsize::new(0);
        let names = AdapterNames::new(vec!["sql".into(), "old".into()], true);
        names.refresh(|| worker(&asked, &["sql", "old"])).await;
        names.refresh(|| worker(&asked, &["sql"])).await;
        assert_eq!(
            (asked.load(Ordering::Relaxed), names.contains("old")),
            (1, true)
        );
        names.refresh_now(|| worker(&asked, &["sql"])).await;
        assert_eq!(
            (asked.load(Ordering::Relaxed), names.contains("old")),
            (2, false)
        );
    }

    /// A message names a directory's first 16 adapters and counts the rest.
    #[test]
    fn a_long_list_is_cut_for_messages() {
        let many: Vec<String> = (0..20).map(|i| format!("a{i}")).collect();
        let first: Vec<String> = many[..16].to_vec();
        let names = AdapterNames::new(many, true);
        assert_eq!(names.joined(), format!("{} and 4 more", first.join(", ")));
        assert_eq!(
            AdapterNames::new(first.clone(), true).joined(),
            first.join(", ")
        );
    }

    /// A worker that does not answer leaves the list as it was.
    #[tokio::test(start_paused = true)]
    async fn a_failed_answer_keeps_the_list() {
        let names = AdapterNames::new(vec!["sql".into()], true);
        let down = || std::future::ready(Err::<Vec<String>, _>("unreachable"));
        names.learn("new", down).await;
        assert_eq!(names.list(), ["sql"]);
    }
}
