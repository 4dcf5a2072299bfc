//! The start of every duet binary: configuration from its layers, `--check-config`,
//! telemetry, process settings, a runtime, the listeners, then serve until SIGTERM or Ctrl-C
//! (a graceful drain), and flush the traces on the way out.

use crate::busy_poll::BusyPoll;
use crate::config::{ConfigError, Sources, flag_overrides, load};
use crate::config_doc::{commented_toml, describe};
use crate::metrics::Listeners;
use crate::telemetry::{LogFormat, Telemetry, TelemetryConfig};
use schemars::JsonSchema;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;

/// Flags every duet binary takes (flatten into its own `clap` arguments).
#[derive(Debug, Clone, clap::Args)]
pub struct CommonArgs {
    /// TOML configuration file.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Any configuration key, as KEY=VALUE (nested keys with dots); repeatable.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Load and check the configuration, print it as TOML, and exit.
    #[arg(long)]
    pub check_config: bool,
    /// Print the defaults as TOML, each key with its meaning, and exit.
    #[arg(long)]
    pub print_config: bool,
}

/// What starting a service needs to know of its configuration. [`service_config!`] writes
/// it for a struct with the fields every duet service has.
pub trait ServiceConfig: Serialize + DeserializeOwned + JsonSchema + Send + 'static {
    /// Checks values that parsed, naming the bad key.
    fn check(&self) -> Result<(), ConfigError>;
    fn telemetry(&self) -> &TelemetryConfig;
    fn log_json(&self) -> bool;
    fn runtime(&self) -> &RuntimeConfig;
    /// The gRPC listen address and the `/metrics` one (empty: none).
    fn listen(&self) -> (&str, &str);
    /// The HTTP API's listen address (empty: none).
    fn http_listen(&self) -> &str {
        ""
    }
}

/// Implements [`ServiceConfig`] for a configuration struct with the fields `listen`,
/// `metrics_listen`, `log_json`, `runtime` and `telemetry` and a `validate(&self)` method.
#[macro_export]
macro_rules! service_config {
    ($config:ty, http_listen) => {
        $crate::service_config!(@impl $config, fn http_listen(&self) -> &str {
            &self.http_listen
        });
    };
    ($config:ty) => {
        $crate::service_config!(@impl $config,);
    };
    (@impl $config:ty, $($http:tt)*) => {
        impl $crate::startup::ServiceConfig for $config {
            fn check(&self) -> Result<(), $crate::config::ConfigError> {
                self.validate()
            }
            fn telemetry(&self) -> &$crate::telemetry::TelemetryConfig {
                &self.telemetry
            }
            fn log_json(&self) -> bool {
                self.log_json
            }
            fn runtime(&self) -> &$crate::startup::RuntimeConfig {
                &self.runtime
            }
            fn listen(&self) -> (&str, &str) {
                (&self.listen, &self.metrics_listen)
            }
            $($http)*
        }
    };
}

/// The process's async runtime: the threads that carry gRPC and HTTP calls (the models run
/// on threads of their own); by default one thread a core, sleeping when idle.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RuntimeConfig {
    /// Async threads; 0: one per core.
    pub async_threads: usize,
    /// After a call's last sign of life (its arrival, each part of its answer; health checks,
    /// probes and listings aside), every async thread (and a worker's model thread) polls
    /// for work for this long instead of sleeping, so that the next call of a speculative
    /// round finds the threads awake: waking them costs about as much as a worker call's
    /// whole time outside its pass. It keeps a core per polling thread busy while calls come
    /// and go: for hosts with cores to spare (a GPU's), and only with `async_threads` set
    /// (the coordinator's default, a thread a core, would poll on every core). 0: off,
    /// threads sleep when idle.
    pub busy_poll_ms: u64,
}

impl RuntimeConfig {
    /// Busy polling needs `async_threads` set: every async thread polls, a core each, and
    /// one a core of a large host would take them all.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.busy_poll_ms > 0 && self.async_threads == 0 {
            return Err(ConfigError::invalid(
                "runtime.async_threads",
                "set it (every async thread polls, a core each) when runtime.busy_poll_ms is",
            ));
        }
        Ok(())
    }

    /// Starts the pollers `busy_poll_ms` asks for, one per thread of the current runtime.
    pub fn start_busy_poll(&self) -> Option<BusyPoll> {
        let threads = tokio::runtime::Handle::current().metrics().num_workers();
        (self.busy_poll_ms > 0)
            .then(|| BusyPoll::start(threads, Duration::from_millis(self.busy_poll_ms)))
    }
}

/// One service's identity.
#[derive(Debug, Clone)]
pub struct Service<C> {
    /// OpenTelemetry `service.name`, such as `duet-target-worker`.
    pub name: &'static str,
    /// Environment prefix of its keys, such as `DUET_TARGET_WORKER`.
    pub env_prefix: &'static str,
    pub defaults: C,
    /// Process-wide settings from the configuration, applied before any thread starts.
    pub prepare: fn(&C),
}

impl<C: ServiceConfig> Service<C> {
    /// The configuration: defaults < `--config` file < `{env_prefix}__KEY` < `flags` (named
    /// flags given on the command line) < `--set`, validated.
    pub fn config(
        &self,
        args: &CommonArgs,
        flags: &[(&str, Option<&str>)],
    ) -> Result<C, ConfigError> {
        let config: C = load(
            &self.defaults,
            &Sources {
                file: args.config.as_deref(),
                env_prefix: self.env_prefix,
                env: None,
                overrides: flag_overrides(flags, &args.set),
            },
        )?;
        config.check()?;
        Ok(config)
    }

    /// A binary's `main`: load the configuration (print it and stop with `--check-config`),
    /// then serve with `serve(listeners, config, shutdown)` until SIGTERM or Ctrl-C.
    pub fn main<F, Fut, E>(
        &self,
        args: &CommonArgs,
        flags: &[(&str, Option<&str>)],
        serve: F,
    ) -> anyhow::Result<()>
    where
        F: FnOnce(Listeners, C, crate::shutdown::Signal) -> Fut,
        Fut: Future<Output = Result<(), E>>,
        E: Into<anyhow::Error>,
    {
        if args.print_config {
            print!("{}", commented_toml(&describe(&self.defaults)));
            return Ok(());
        }
        let config = self.config(args, flags)?;
        if args.check_config {
            print!("{}", crate::config::to_toml(&config)?);
            return Ok(());
        }
        let telemetry = Telemetry::new(
            self.name,
            config.telemetry(),
            LogFormat::from_json(config.log_json()),
            "info",
        )?;
        telemetry.install()?;
        (self.prepare)(&config);
        let mut runtime = tokio::runtime::Builder::new_multi_thread();
        if config.runtime().async_threads > 0 {
            runtime.worker_threads(config.runtime().async_threads);
        }
        let runtime = runtime.enable_all().build()?;
        runtime.block_on(async move {
            let (listen, metrics) = config.listen();
            let listeners = Listeners::bind(listen, metrics, config.http_listen()).await?;
            tracing::info!(
                service = self.name,
                listen = %listeners.grpc.local_addr()?,
                metrics = %metrics,
                "serving"
            );
            serve(listeners, config, Box::pin(crate::shutdown::signal()))
                .await
                .map_err(Into::into)
        })?;
        drop(runtime);
        telemetry.shutdown();
        Ok(())
    }
}
