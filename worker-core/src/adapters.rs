//! The LoRA adapters a target-worker's sessions may ask for: those its configuration names
//! (`lora_adapters`, read at start and kept), and those of its adapter directory
//! (`lora_adapter_dir`), read when first asked for, read again when their files change, and
//! given up least recently used first past `max_loaded_adapters`.

use crate::{WorkerConfig, WorkerError};
use duet_engine::{Adapter, EngineError, Model};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

/// The adapters of a worker.
#[derive(Debug)]
pub(crate) struct Adapters {
    /// `lora_adapters`, loaded at start.
    fixed: BTreeMap<String, Arc<Adapter>>,
    /// `lora_adapter_dir`, if set.
    dir: Option<PathBuf>,
    max_loaded: usize,
    /// The directory's adapters loaded, by name.
    loaded: Mutex<BTreeMap<String, Entry>>,
    /// One read of the directory's adapters at a time: two sessions asking for one not yet
    /// loaded read it once.
    reading: tokio::sync::Mutex<()>,
    /// Lookups so far: the clock of [`Entry::used`].
    lookups: AtomicU64,
    /// Reads of the directory's adapters so far (`duet_worker_lora_adapter_loads_total`).
    pub reads: AtomicU64,
}

/// A directory adapter loaded: the files it was read from, as they were then.
#[derive(Debug)]
struct Entry {
    adapter: Arc<Adapter>,
    files: Stamp,
    /// The lookup that last found it.
    used: u64,
}

/// An adapter's two files' sizes and modification times: a copy or an edit changes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp([(u64, Option<SystemTime>); 2]);

impl Stamp {
    /// The stamp of the adapter in `dir`, or `None` where it has no configuration file.
    fn of(dir: &Path) -> Option<Self> {
        let file = |name| {
            let meta = std::fs::metadata(dir.join(name)).ok()?;
            Some((meta.len(), meta.modified().ok()))
        };
        let config = file("adapter_config.json")?;
        Some(Self([
            config,
            file("adapter_model.safetensors").unwrap_or((0, None)),
        ]))
    }
}

/// Whether `name` may name a directory adapter: a plain file name, never `..` nor hidden.
fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 255
        && !name.starts_with('.')
        && (name.bytes()).all(|b| b.is_ascii_alphanumeric() || b"_-.".contains(&b))
}

impl Adapters {
    /// Reads `config`'s adapters for `model`: those it names now, the directory's when asked
    /// for. A model that runs no adapter (`Model::adapters_refused`) refuses a directory
    /// at once.
    pub fn load(config: &WorkerConfig, model: &Model) -> Result<Self, EngineError> {
        let fixed = (config.lora_adapters.iter())
            .map(|(name, path)| Ok((name.clone(), model.load_adapter(name, path)?)))
            .collect::<Result<BTreeMap<_, _>, EngineError>>()?;
        let dir = Some(config.lora_adapter_dir.clone()).filter(|d| !d.as_os_str().is_empty());
        let refused = match &dir {
            Some(dir) if !dir.is_dir() => Some("not a directory (lora_adapter_dir)".into()),
            Some(_) => model.adapters_refused(),
            _ => None,
        };
        if let (Some(dir), Some(reason)) = (&dir, refused) {
            let path = dir.clone();
            return Err(EngineError::Adapter { path, reason });
        }
        Ok(Self {
            fixed,
            dir,
            max_loaded: config.max_loaded_adapters,
            loaded: Mutex::default(),
            reading: tokio::sync::Mutex::const_new(()),
            lookups: AtomicU64::new(0),
            reads: AtomicU64::new(0),
        })
    }

    /// Whether sessions may ask for adapters of a directory, which Describe lists as they
    /// are at the time.
    pub fn reads_dir(&self) -> bool {
        self.dir.is_some()
    }

    /// The names a session may ask for now: the configuration's and the directory's.
    pub fn names(&self) -> Vec<String> {
        let mut names: BTreeSet<String> = self.fixed.keys().cloned().collect();
        if let Some(entries) = self.dir.as_ref().and_then(|d| std::fs::read_dir(d).ok()) {
            let present = (entries.flatten()).filter_map(|e| e.file_name().into_string().ok());
            names.extend(present.filter(|name| self.in_dir(name).is_some()));
        }
        names.into_iter().collect()
    }

    /// The directory adapters loaded now.
    pub fn loaded(&self) -> usize {
        self.loaded.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// The adapter `name` and the stamp of its files, where the directory has it (under a
    /// plain file name: nothing outside it is read).
    fn in_dir(&self, name: &str) -> Option<(PathBuf, Stamp)> {
        let path = self.dir.as_ref().filter(|_| valid_name(name))?.join(name);
        Some((path.clone(), Stamp::of(&path)?))
    }

    /// The adapter named `name` for a session of `model`, read from the directory where it
    /// is not loaded, or was loaded from files that have changed since; `None` where there
    /// is none of that name ([`Self::unknown`] says why).
    pub async fn get(
        &self,
        model: &Model,
        name: &str,
    ) -> Result<Option<Arc<Adapter>>, WorkerError> {
        if let Some(adapter) = self.fixed.get(name) {
            return Ok(Some(adapter.clone()));
        }
        let Some((path, files)) = self.in_dir(name) else {
            return Ok(None);
        };
        if let Some(adapter) = self.cached(name, files) {
            return Ok(Some(adapter));
        }
        let _reading = self.reading.lock().await;
        if let Some(adapter) = self.cached(name, files) {
            return Ok(Some(adapter));
        }
        let (model, owned) = (model.clone(), name.to_string());
        let read = tokio::task::spawn_blocking(move || model.load_adapter(&owned, &path)).await;
        let adapter = read
            .map_err(|e| WorkerError::invalid("adapter", format!("`{name}`: {e}")))?
            .map_err(|e| WorkerError::invalid("adapter", e.to_string()))?;
        self.reads.fetch_add(1, Ordering::Relaxed);
        tracing::info!(adapter = name, "LoRA adapter read from lora_adapter_dir");
        self.keep(name, adapter.clone(), files);
        Ok(Some(adapter))
    }

    /// The loaded adapter `name`, if it was read from files stamped `files`.
    fn cached(&self, name: &str, files: Stamp) -> Option<Arc<Adapter>> {
        let mut loaded = self.loaded.lock().unwrap_or_else(|e| e.into_inner());
        let entry = loaded.get_mut(name).filter(|e| e.files == files)?;
        entry.used = self.lookups.fetch_add(1, Ordering::Relaxed);
        Some(entry.adapter.clone())
    }

    /// Keeps `adapter`, giving up the least recently used past `max_loaded`.
    fn keep(&self, name: &str, adapter: Arc<Adapter>, files: Stamp) {
        let used = self.lookups.fetch_add(1, Ordering::Relaxed);
        let mut loaded = self.loaded.lock().unwrap_or_else(|e| e.into_inner());
        let entry = Entry {
            adapter,
            files,
            used,
        };
        loaded.insert(name.to_string(), entry);
        while loaded.len() > self.max_loaded {
            let Some(oldest) = (loaded.iter()).min_by_key(|(_, e)| e.used) else {
                break;
            };
            let oldest = oldest.0.clone();
            tracing::info!(adapter = %oldest, "LoRA adapter given up (max_loaded_adapters)");
            loaded.remove(&oldest);
        }
    }

    /// A session's `adapter` names none of these adapters.
    pub fn unknown(&self, name: &str) -> WorkerError {
        let names = duet_engine::adapter_names(&self.names());
        let why = format!("`{name}` is not one of this worker's ({names})");
        WorkerError::invalid("adapter", why)
    }
}
