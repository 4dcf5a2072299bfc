//! A worker's configuration (the same keys for the draft-worker and the target-worker).

use duet_serving::config::ConfigError;
use duet_serving::telemetry::TelemetryConfig;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WorkerConfig {
    /// gRPC listen address.
    pub listen: String,
    /// Prometheus `/metrics` listen address; empty: no metrics endpoint.
    pub metrics_listen: String,
    /// GGUF model file.
    pub model: PathBuf,
    /// `cpu`, `cuda` or `cuda:N`. A GPU that is not there fails the start loudly.
    pub device: String,
    /// Compute threads for the forward pass; 0 = one per core.
    pub threads: usize,
    /// CPU cores the process runs on (Linux core numbers); empty: wherever the system
    /// puts it. Two workers on one machine, each on its own cores, stand in for two
    /// devices (with `threads` = the number of cores given).
    // `default`: the layered configuration drops an empty list.
    #[serde(default)]
    pub cpu_affinity: Vec<usize>,
    /// CPU matmul kernels: `auto` (the best this CPU has), `amx` (AVX-512 with Intel AMX tiles
    /// for passes of 12 rows or more, on Xeons since Sapphire Rapids: the same results, faster
    /// prefill and batches), `avx512` (without the tiles), `avxvnni`, `avx2`, `off` (candle's).
    pub cpu_kernels: String,
    /// Draft-workers only: the draft computes logits (and so drafts) only for the first this
    /// many token ids, the special tokens and each session's own rarer tokens (those of its
    /// prompt and text). Tokenizers number their tokens by BPE merge order, so the first
    /// are the common ones, and the vocabulary projection is the largest matmul of a small
    /// model (docs/benchmarks.md, "Draft vocabulary shortlist", has the speed and the
    /// acceptance it costs on the default 0.5B draft). The target checks every draft, so
    /// output is unchanged. 0: the whole vocabulary (a target-worker refuses anything
    /// else).
    pub vocab_shortlist: usize,
    /// LoRA adapters (PEFT's format: a directory with `adapter_config.json` and
    /// `adapter_model.safetensors`) by the name a request chooses one with (gRPC `adapter`,
    /// OpenAI's `model`): `lora_adapters.NAME = "PATH"`. Each is loaded at start (one that
    /// does not load fails it) and applied to the sessions that ask for it, beside the rest
    /// in the same passes (on a GPU: ranks up to 512, added by the CUDA step; a worker
    /// without it, `DUET_CUDA_STEP=off`, refuses adapters). A target-worker's are what
    /// requests may name; a draft-worker's are adapters of the draft model under the same
    /// names (drafting closer to the adapted target: more drafts accepted), and it drafts
    /// without one for a name it lacks.
    // `default`: the layered configuration drops an empty table.
    #[serde(default)]
    pub lora_adapters: std::collections::BTreeMap<String, PathBuf>,
    /// A directory of LoRA adapters, each a subdirectory in PEFT's format whose name is
    /// the adapter's (letters, digits, `_`, `-` and `.`, not first), read when a session
    /// first asks for it rather than at start. Describe lists those present, so an adapter
    /// copied in is served without a restart (the coordinators look again when a request
    /// names one they do not know); one whose files change is read again by the next
    /// session that asks for it. Empty: none.
    pub lora_adapter_dir: PathBuf,
    /// How many of `lora_adapter_dir`'s adapters stay loaded: past it, the one asked for
    /// least recently is given up (its running sessions keep it) and read again when next
    /// asked for. `lora_adapters` are always loaded and not counted. On a GPU each loaded
    /// adapter's deltas take GPU memory beside the KV caches (`kv_token_budget` does not
    /// count them): 2 bytes a value of its `lora_A` and `lora_B`, about 37 MB for rank 16
    /// on every projection of a 1.5B model.
    pub max_loaded_adapters: usize,
    /// On a CUDA device: replay each row bucket's decode and verify step from a CUDA graph
    /// captured at its first use (one launch a step instead of ~13 a layer). A capture
    /// that fails leaves the step eager, logged once and shown by
    /// `duet_worker_cuda_graph_failed`. Ignored on a CPU.
    pub cuda_graphs: bool,
    /// Tokens one session may hold at most; 0 = the model's context length.
    pub max_context: usize,
    /// Open sessions at most; more answer RESOURCE_EXHAUSTED.
    pub max_sessions: usize,
    /// KV-cache tokens all open sessions may reserve together.
    pub kv_token_budget: usize,
    /// The prefix cache: closed sessions' KV caches of up to this many tokens (by capacity,
    /// within `kv_token_budget`, given up first when a session needs room) stay for later
    /// sessions, which copy the longest prompt prefix they share with one, or with an open
    /// session's prompt, instead of prefilling it. 0: off. The cache must not change a
    /// single output token: where a token's keys and values depend on the pass that
    /// computed them (a GPU's prefill kernels) it is off, unless `DUET_CUDA_PREFIX_CACHE=1`
    /// in the environment, which copies only whole prefill chunks (`prefill_chunk_tokens`),
    /// or a whole prompt prefilled to the same end: what a fresh prefill computes alike.
    pub prefix_cache_tokens: usize,
    /// A session with no call for this long is closed.
    pub session_ttl_ms: u64,
    /// Calls from different sessions run in one forward pass, up to this many (the
    /// target-worker's Verify calls; the draft-worker's Propose calls, which step together).
    pub max_batch: usize,
    /// Before a run of calls starts, it waits up to this long for the streams due back:
    /// those whose last call was answered within this window and whose call came within it
    /// the time before (a stream that drafts between its calls, or has ended, is not waited
    /// for). Without it the first stream back runs alone and the others wait a whole pass.
    /// 0: never wait.
    pub batch_wait_ms: u64,
    /// A prompt is prefilled this many tokens at a time, with the waiting calls run between
    /// chunks, so that a long prompt holds up the other streams for one chunk, not for all
    /// of it. 0: the whole prompt in one pass. Unset: by device
    /// ([`WorkerConfig::prefill_chunk`]).
    pub prefill_chunk_tokens: Option<usize>,
    /// On SIGTERM: how long in-flight calls may take before the process exits anyway.
    pub drain_timeout_ms: u64,
    /// The model thread busy with one step (a prefill, one batch of calls, one pass of a
    /// drafting run) for longer than this counts as stuck: readiness and liveness turn
    /// NOT_SERVING until it moves again. Longer than the slowest step the worker takes (a
    /// prefill chunk, a batch of calls).
    pub model_stall_timeout_ms: u64,
    /// TLS of the gRPC server (mutual with `tls.client_ca_file`); off by default.
    pub tls: duet_serving::tls::ServerTls,
    /// Bounds on the gRPC server's connections.
    pub http2: duet_serving::grpc::Http2Limits,
    /// The async runtime's threads, and whether they poll instead of sleeping.
    pub runtime: duet_serving::startup::RuntimeConfig,
    /// Log JSON lines instead of human-readable ones.
    pub log_json: bool,
    /// Traces: OTLP endpoint, sampling, service name.
    pub telemetry: TelemetryConfig,
}

impl WorkerConfig {
    /// Defaults for a worker listening on `listen` and loading `model`.
    pub fn with(listen: &str, metrics_listen: &str, model: &str) -> Self {
        Self {
            listen: listen.into(),
            metrics_listen: metrics_listen.into(),
            model: model.into(),
            device: "cpu".into(),
            threads: 0,
            cpu_affinity: Vec::new(),
            cpu_kernels: "auto".into(),
            vocab_shortlist: 0,
            lora_adapters: Default::default(),
            lora_adapter_dir: PathBuf::new(),
            max_loaded_adapters: 8,
            cuda_graphs: true,
            max_context: 4096,
            max_sessions: 64,
            kv_token_budget: 65_536,
            prefix_cache_tokens: 16_384,
            session_ttl_ms: 60_000,
            max_batch: 16,
            batch_wait_ms: 5,
            prefill_chunk_tokens: None,
            drain_timeout_ms: 30_000,
            model_stall_timeout_ms: 120_000,
            tls: Default::default(),
            http2: Default::default(),
            // The model has threads of its own; the async ones only move messages.
            runtime: duet_serving::startup::RuntimeConfig {
                async_threads: 2,
                ..Default::default()
            },
            log_json: false,
            telemetry: TelemetryConfig::default(),
        }
    }

    /// Tokens a prompt is prefilled at a time: `prefill_chunk_tokens`, or by device. On a CPU
    /// 64: those rows fill every matmul tile (8 rows a tile), so a CPU prefills as fast per
    /// token as in longer chunks, and a chunk of the 1.5B on two Zen 5 cores takes about a
    /// quarter of a second, the longest another stream's token waits for it (docs/benchmarks.md,
    /// "Prefill chunks"). On a GPU 256, as before that measurement: a GPU pass costs
    /// little per row, so smaller chunks would only add passes to a prompt's prefill.
    pub fn prefill_chunk(&self) -> usize {
        self.prefill_chunk_tokens
            .unwrap_or(if self.device == "cpu" { 64 } else { 256 })
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        self.telemetry.validate()?;
        self.http2.validate()?;
        self.runtime.validate()?;
        duet_serving::config::check_listen("listen", &self.listen, false)?;
        duet_serving::config::check_listen("metrics_listen", &self.metrics_listen, true)?;
        if self.model.as_os_str().is_empty() {
            return Err(ConfigError::invalid("model", "no model file given"));
        }
        if !self.model.is_file() {
            return Err(ConfigError::invalid(
                "model",
                format!(
                    "{} is not a file (scripts/fetch-models fetches the defaults)",
                    self.model.display()
                ),
            ));
        }
        let device_ok = self.device == "cpu"
            || self.device == "cuda"
            || self
                .device
                .strip_prefix("cuda:")
                .is_some_and(|n| n.parse::<usize>().is_ok());
        if !device_ok {
            return Err(ConfigError::invalid(
                "device",
                format!("`{}`: expected cpu, cuda or cuda:N", self.device),
            ));
        }
        let kernels = self.cpu_kernels.as_str();
        if kernels != "auto" && !duet_engine::CPU_KERNELS.contains(&kernels) {
            return Err(ConfigError::invalid(
                "cpu_kernels",
                format!(
                    "`{kernels}`: expected auto or one of {}",
                    duet_engine::CPU_KERNELS.join(", ")
                ),
            ));
        }
        for (key, value) in [
            ("max_sessions", self.max_sessions),
            ("kv_token_budget", self.kv_token_budget),
            ("max_batch", self.max_batch),
            ("max_loaded_adapters", self.max_loaded_adapters),
        ] {
            if value == 0 {
                return Err(ConfigError::invalid(key, "must be at least 1"));
            }
        }
        self.tls.check("tls")?;
        if self.model_stall_timeout_ms == 0 {
            return Err(ConfigError::invalid(
                "model_stall_timeout_ms",
                "must be at least 1",
            ));
        }
        if self.session_ttl_ms == 0 {
            return Err(ConfigError::invalid("session_ttl_ms", "must be at least 1"));
        }
        check_cpus(&self.cpu_affinity)?;
        Ok(())
    }

    /// Process-wide settings the engine reads from the environment at its first forward pass.
    /// Call before any thread starts (start of `main`).
    pub fn apply_process_settings(&self) {
        // SAFETY: called at the start of main, before the runtime or any other thread exists.
        unsafe {
            if self.threads > 0 {
                std::env::set_var("CANDLE_NUM_THREADS", self.threads.to_string());
            }
            if self.cpu_kernels != "auto" {
                std::env::set_var("DUET_CPU_KERNELS", &self.cpu_kernels);
            }
        }
        if !self.cpu_affinity.is_empty() {
            // Threads started later (the runtime's, the engine's) inherit the mask. The cores
            // were checked to be allowed, so this fails only if that changed since.
            if let Err(e) = pin_to(&self.cpu_affinity) {
                tracing::warn!(cpus = ?self.cpu_affinity, error = %e, "cpu_affinity not applied");
            }
        }
    }
}

/// Each core in `cpus` must be one this process may run on.
fn check_cpus(cpus: &[usize]) -> Result<(), ConfigError> {
    if cpus.is_empty() {
        return Ok(());
    }
    let allowed = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)).map_err(|e| {
        ConfigError::invalid("cpu_affinity", format!("reading the allowed cores: {e}"))
    })?;
    for &cpu in cpus {
        if !allowed.is_set(cpu).unwrap_or(false) {
            return Err(ConfigError::invalid(
                "cpu_affinity",
                format!("core {cpu} is not one this process may run on"),
            ));
        }
    }
    Ok(())
}

/// Restricts the calling thread (and the threads it starts from now on) to `cpus`.
fn pin_to(cpus: &[usize]) -> nix::Result<()> {
    let mut set = nix::sched::CpuSet::new();
    for &cpu in cpus {
        set.set(cpu)?;
    }
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_values_name_their_key() {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("m.gguf");
        std::fs::write(&model, b"GGUF").unwrap();
        let good = WorkerConfig::with("127.0.0.1:1", "", &model.to_string_lossy());
        good.validate().unwrap();
        type Break = fn(&mut WorkerConfig);
        let cases: [(&str, Break); 10] = [
            ("listen", |c| c.listen = "here".into()),
            ("model", |c| c.model = "/nonexistent.gguf".into()),
            ("device", |c| c.device = "tpu".into()),
            ("device", |c| c.device = "cuda:x".into()),
            ("cpu_kernels", |c| c.cpu_kernels = "sse2".into()),
            ("max_sessions", |c| c.max_sessions = 0),
            ("session_ttl_ms", |c| c.session_ttl_ms = 0),
            ("cpu_affinity", |c| c.cpu_affinity = vec![0, 4096]),
            ("max_loaded_adapters", |c| c.max_loaded_adapters = 0),
            ("runtime.async_threads", |c| {
                c.runtime = duet_serving::startup::RuntimeConfig {
                    async_threads: 0,
                    busy_poll_ms: 50,
                }
            }),
        ];
        for (key, breaks) in cases {
            let mut c = good.clone();
            breaks(&mut c);
            let err = c.validate().unwrap_err().to_string();
            assert!(err.contains(key), "{key}: {err}");
        }
    }

    /// Unset, the prefill chunk follows the device; set (on the command line, 0 included),
    /// it is what was set.
    #[test]
    fn the_prefill_chunk_is_by_device_unless_set() {
        let defaults = WorkerConfig::with("127.0.0.1:1", "", "m.gguf");
        let load = |device: &str, overrides: &[&str]| {
            let mut sets = vec![format!("device={device}")];
            sets.extend(overrides.iter().map(|s| s.to_string()));
            let sources = duet_serving::config::Sources {
                file: None,
                env_prefix: "DUET_TEST_WORKER",
                env: Some(Default::default()),
                overrides: sets,
            };
            duet_serving::config::load(&defaults, &sources)
                .unwrap()
                .prefill_chunk()
        };
        assert_eq!(load("cpu", &[]), 64);
        assert_eq!(load("cuda", &[]), 256);
        assert_eq!(load("cuda:1", &[]), 256);
        assert_eq!(load("cuda", &["prefill_chunk_tokens=32"]), 32);
        assert_eq!(load("cpu", &["prefill_chunk_tokens=0"]), 0);
    }

    #[test]
    fn pinning_to_an_allowed_core_takes_effect() {
        // On a thread of its own: the mask stays with that thread.
        std::thread::spawn(|| {
            let me = nix::unistd::Pid::from_raw(0);
            let allowed = nix::sched::sched_getaffinity(me).unwrap();
            let first = (0..nix::sched::CpuSet::count())
                .find(|&c| allowed.is_set(c).unwrap())
                .unwrap();
            check_cpus(&[first]).unwrap();
            pin_to(&[first]).unwrap();
            let now = nix::sched::sched_getaffinity(me).unwrap();
            let set: Vec<usize> = (0..nix::sched::CpuSet::count())
                .filter(|&c| now.is_set(c).unwrap())
                .collect();
            assert_eq!(set, vec![first]);
        })
        .join()
        .unwrap();
    }
}
