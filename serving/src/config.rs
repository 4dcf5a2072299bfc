//! Layered configuration: defaults < TOML file < `PREFIX__KEY` environment < CLI overrides,
//! deserialized into one struct per service. Nested keys use `.` in files and overrides and
//! `__` in the environment: `draft.timeout_ms` is `DUET_COORDINATOR__DRAFT__TIMEOUT_MS`.

use serde::Serialize;
use serde::de::DeserializeOwned;
use std::path::Path;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("configuration: {0}")]
    Load(#[from] ::config::ConfigError),
    #[error("configuration key `{key}`: {message}")]
    Invalid { key: String, message: String },
    #[error("override `{0}` is not KEY=VALUE")]
    Override(String),
}

impl ConfigError {
    /// A value that parsed but is not acceptable, naming its key.
    pub fn invalid(key: &str, message: impl Into<String>) -> Self {
        Self::Invalid {
            key: key.to_string(),
            message: message.into(),
        }
    }
}

/// Where one service's configuration comes from, lowest precedence first after the defaults.
#[derive(Debug, Clone, Default)]
pub struct Sources<'a> {
    /// A TOML file (`--config`); must exist when given.
    pub file: Option<&'a Path>,
    /// Environment prefix such as `DUET_COORDINATOR`; variables are `PREFIX__KEY__SUBKEY`.
    pub env_prefix: &'a str,
    /// Environment to read (normally `std::env::vars()`; tests pass their own).
    pub env: Option<std::collections::HashMap<String, String>>,
    /// `key=value` pairs from the command line, highest precedence.
    pub overrides: Vec<String>,
}

/// Builds `T` from `defaults` and the given sources. Unknown keys are errors when `T` says
/// `#[serde(deny_unknown_fields)]`, which every duet config does.
pub fn load<T: Serialize + DeserializeOwned>(
    defaults: &T,
    sources: &Sources<'_>,
) -> Result<T, ConfigError> {
    let mut builder = ::config::Config::builder().add_source(::config::Config::try_from(defaults)?);
    if let Some(file) = sources.file {
        builder = builder.add_source(
            ::config::File::from(file)
                .format(::config::FileFormat::Toml)
                .required(true),
        );
    }
    let mut env = ::config::Environment::with_prefix(sources.env_prefix)
        .prefix_separator("__")
        .separator("__")
        .try_parsing(true);
    if let Some(vars) = &sources.env {
        env = env.source(Some(vars.clone()));
    }
    builder = builder.add_source(env);
    for pair in &sources.overrides {
        let (key, value) = pair
            .split_once('=')
            .ok_or_else(|| ConfigError::Override(pair.clone()))?;
        builder = builder.set_override(key.trim(), parse_scalar(value.trim()))?;
    }
    Ok(builder.build()?.try_deserialize()?)
}

/// A loaded configuration as TOML (what `--check-config` prints).
pub fn to_toml<T: Serialize>(config: &T) -> Result<String, ConfigError> {
    toml::to_string(config).map_err(|e| ConfigError::invalid("", e.to_string()))
}

/// Overrides from named command-line flags (those given) followed by `--set` pairs, in
/// the `key=value` form [`Sources::overrides`] takes.
pub fn flag_overrides(flags: &[(&str, Option<&str>)], set: &[String]) -> Vec<String> {
    flags
        .iter()
        .filter_map(|(key, value)| value.map(|v| format!("{key}={v}")))
        .chain(set.iter().cloned())
        .collect()
}

/// Checks that `value` (key `key`) is a socket address such as `0.0.0.0:50061`; with
/// `optional`, empty means "none".
pub fn check_listen(key: &str, value: &str, optional: bool) -> Result<(), ConfigError> {
    if (optional && value.is_empty()) || value.parse::<std::net::SocketAddr>().is_ok() {
        return Ok(());
    }
    let none = if optional { " (or empty for none)" } else { "" };
    Err(ConfigError::invalid(
        key,
        format!("`{value}` is not an address such as 0.0.0.0:50061{none}"),
    ))
}

/// CLI values arrive as text; numbers and booleans are typed like the environment's.
fn parse_scalar(value: &str) -> ::config::Value {
    if let Ok(b) = value.parse::<bool>() {
        return b.into();
    }
    if let Ok(i) = value.parse::<i64>() {
        return i.into();
    }
    if let Ok(f) = value.parse::<f64>() {
        return f.into();
    }
    value.into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Serialize, Deserialize, PartialEq)]
    #[serde(default, deny_unknown_fields)]
    struct Example {
        listen: String,
        limits: Limits,
    }

    #[derive(Debug, Serialize, Deserialize, PartialEq)]
    #[serde(default, deny_unknown_fields)]
    struct Limits {
        max_sessions: u32,
        ttl_ms: u64,
    }

    impl Default for Example {
        fn default() -> Self {
            Self {
                listen: "127.0.0.1:1".into(),
                limits: Limits::default(),
            }
        }
    }

    impl Default for Limits {
        fn default() -> Self {
            Self {
                max_sessions: 8,
                ttl_ms: 1000,
            }
        }
    }

    fn env(pairs: &[(&str, &str)]) -> Option<std::collections::HashMap<String, String>> {
        Some(
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    }

    #[test]
    fn layers_apply_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("c.toml");
        std::fs::write(
            &file,
            "listen = \"0.0.0.0:5\"\n[limits]\nmax_sessions = 3\nttl_ms = 7\n",
        )
        .unwrap();
        let defaults: Example = load(
            &Example::default(),
            &Sources {
                env_prefix: "T",
                env: env(&[]),
                ..Sources::default()
            },
        )
        .unwrap();
        assert_eq!(defaults, Example::default());

        let c: Example = load(
            &Example::default(),
            &Sources {
                file: Some(&file),
                env_prefix: "T",
                env: env(&[("T__LIMITS__MAX_SESSIONS", "4"), ("OTHER__LISTEN", "x")]),
                overrides: vec!["limits.ttl_ms=9".into()],
            },
        )
        .unwrap();
        assert_eq!(c.listen, "0.0.0.0:5");
        assert_eq!(c.limits.max_sessions, 4);
        assert_eq!(c.limits.ttl_ms, 9);
    }

    #[test]
    fn errors_name_the_key() {
        let err = load(
            &Example::default(),
            &Sources {
                env_prefix: "T",
                env: env(&[("T__LIMITS__MAX_SESSIONS", "many")]),
                ..Sources::default()
            },
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("max_sessions"), "{err}");

        let err = load(
            &Example::default(),
            &Sources {
                env_prefix: "T",
                env: env(&[]),
                overrides: vec!["limits.max_sesions=2".into()],
                ..Sources::default()
            },
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("max_sesions"), "{err}");

        let err = load(
            &Example::default(),
            &Sources {
                env_prefix: "T",
                env: env(&[]),
                overrides: vec!["nonsense".into()],
                ..Sources::default()
            },
        )
        .unwrap_err();
        assert!(matches!(err, ConfigError::Override(_)));
    }
}
