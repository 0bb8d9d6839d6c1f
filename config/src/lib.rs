//! Loading Tessera's configuration files.
//!
//! Every component has one serde struct for its settings, with documented
//! defaults, `deny_unknown_fields`, and a [`Validate`] implementation that
//! checks values and names the offending key. This crate holds what they
//! share: the error type and the load-then-validate step.
//!
//! TOML parsing is the `toml` crate's (with serde): its errors already point
//! at the line and key of a malformed or mistyped value, so parse errors are
//! passed through as they are.
//!
//! A component's settings as Tessera writes them: defaults, unknown keys
//! refused, and a check that names the key it refuses:
//!
//! ```
//! use serde::Deserialize;
//! use tessera_config::{ConfigError, Validate, invalid};
//!
//! #[derive(Deserialize)]
//! #[serde(default, deny_unknown_fields)]
//! struct CacheConfig {
//!     /// Entries kept. Default 1,024.
//!     entries: u32,
//! }
//!
//! impl Default for CacheConfig {
//!     fn default() -> Self {
//!         Self { entries: 1024 }
//!     }
//! }
//!
//! impl Validate for CacheConfig {
//!     fn validate(&self) -> Result<(), ConfigError> {
//!         if self.entries == 0 {
//!             return Err(invalid("entries", "must be at least 1"));
//!         }
//!         Ok(())
//!     }
//! }
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = tempfile::tempdir()?;
//! let path = dir.path().join("cache.toml");
//! std::fs::write(&path, "entries = 0\n")?;
//! let refused = tessera_config::load::<CacheConfig>(&path).err().map(|e| e.to_string());
//! assert!(refused.is_some_and(|e| e.contains("entries")));
//! # Ok(())
//! # }
//! ```

use std::path::Path;

use serde::de::DeserializeOwned;

/// The environment variable that makes Tessera's binaries stop right after
/// parsing their command line: exit code 0, while a command line their
/// parser refuses still exits 2 with its message. The docs test
/// (`deploy/tests/docs.rs`) runs every command the book shows this way, so
/// that the book cannot name a flag the binaries no longer take.
pub const PARSE_ONLY_ENV: &str = "TESSERA_PARSE_ONLY";

/// Whether this process was started only to parse its command line
/// ([`PARSE_ONLY_ENV`] set).
pub fn parse_only() -> bool {
    std::env::var_os(PARSE_ONLY_ENV).is_some()
}

/// A configuration that cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not valid TOML for this configuration.
    #[error("config file {path}: {source}")]
    Parse {
        /// The file.
        path: String,
        /// The parser's message, which names the line and key.
        source: toml::de::Error,
    },
    /// A value is not allowed.
    #[error("invalid value for `{key}`: {reason}")]
    Invalid {
        /// The setting, with its position where it is in a list
        /// (`tables[1].dim`).
        key: String,
        /// Why the value was refused.
        reason: String,
    },
}

impl ConfigError {
    /// The key an `Invalid` error names.
    pub fn key(&self) -> Option<&str> {
        match self {
            ConfigError::Invalid { key, .. } => Some(key),
            _ => None,
        }
    }
}

/// An [`ConfigError::Invalid`] for `key`.
pub fn invalid(key: impl Into<String>, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        reason: reason.into(),
    }
}

/// A configuration that can check its own values.
pub trait Validate {
    /// Checks every setting; the error names the offending key.
    fn validate(&self) -> Result<(), ConfigError>;
}

/// Reads `path` as TOML into `T` and validates it.
pub fn load<T: DeserializeOwned + Validate>(path: &Path) -> Result<T, ConfigError> {
    let config: T = read(path)?;
    config.validate()?;
    Ok(config)
}

/// Reads `path` as TOML into `T` without validating it: for a binary that
/// applies its command-line overrides first and then validates the whole
/// (a file may leave a key to a flag, as the Kubernetes manifests leave
/// `checkpoint.dir` to `--checkpoint-dir`).
pub fn read<T: DeserializeOwned>(path: &Path) -> Result<T, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.display().to_string(),
        source,
    })?;
    toml::from_str(&text).map_err(|source| ConfigError::Parse {
        path: path.display().to_string(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Example {
        size: u32,
    }

    impl Validate for Example {
        fn validate(&self) -> Result<(), ConfigError> {
            if self.size == 0 {
                return Err(invalid("size", "must be at least 1"));
            }
            Ok(())
        }
    }

    fn load_text(text: &str) -> Result<Example, ConfigError> {
        let dir = std::env::temp_dir().join(format!("tessera-config-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(format!("{}.toml", text.len()));
        std::fs::write(&path, text).unwrap();
        let result = load(&path);
        let _ = std::fs::remove_file(&path);
        result
    }

    #[test]
    fn loads_validates_and_names_keys() {
        assert_eq!(load_text("size = 3").unwrap().size, 3);
        let err = load_text("size = 0").unwrap_err();
        assert_eq!(err.key(), Some("size"));
        assert_eq!(
            err.to_string(),
            "invalid value for `size`: must be at least 1"
        );
        let err = load_text("size = \"big\"").unwrap_err().to_string();
        assert!(err.contains("size"), "{err}");
        let err = load_text("size = 1\ncolour = 2").unwrap_err().to_string();
        assert!(err.contains("colour"), "{err}");
        assert!(matches!(
            load(Path::new("/nonexistent/tessera.toml")) as Result<Example, _>,
            Err(ConfigError::Read { .. })
        ));
    }
}
