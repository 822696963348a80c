//! The VM spec of vmhost.
//!
//! A spec is read from TOML (vmhost's own, snake_case form of KubeVirt's
//! `VirtualMachineInstance.spec.domain`) or from a KubeVirt `VirtualMachineInstance` /
//! `VirtualMachine` manifest in YAML, then validated with KubeVirt's admission rules and resolved
//! into a [`VmSpec`]: parse, then resolve.
//!
//! ```
//! use vmhost_config::{from_toml_str, Payload, BootSpec};
//! let loaded = from_toml_str("name = \"db\"\n[memory]\nguest = \"2Gi\"\n", "vm.toml").unwrap();
//! assert_eq!(loaded.spec.name, "db");
//! assert_eq!(loaded.spec.boot, BootSpec::Payload { payload: Payload::Touch });
//! ```
#![warn(missing_docs)]

pub mod devices;
pub mod iothreads;
mod kubevirt;
mod mac;
mod quantity;
pub mod spec;
mod validate;
mod vcpumask;
pub mod vsock;

use std::path::{Path, PathBuf};

pub use devices::{
    Binding, DeviceSpec, DiskCache, DiskSource, DiskSpec, InterfaceSpec, Irqchip, VirtioAnnounce,
};
pub use iothreads::{IoThreadsPolicy, IoThreadsSpec};
pub use mac::{MacAddress, MacError};
pub use quantity::{format_bytes, Quantity, QuantityError};
pub use spec::RawSpec;
pub use validate::{
    validate, BootSpec, CpuSpec, CpuTopology, Dialect, HugepageSpec, MemorySpec, Payload,
    ResourceList, Resources, SpecError, VmSpec, ARCH_PAGE_SIZES, DEFAULT_TERMINATION_GRACE,
    MAX_MEMORY_BYTES, MAX_TERMINATION_GRACE_SECONDS, MAX_VCPUS,
};
pub use vsock::{VsockBackend, VsockSpec};

/// A spec loaded and validated, with the warnings to show the user.
#[derive(Debug, Clone)]
pub struct LoadedSpec {
    /// The resolved spec.
    pub spec: VmSpec,
    /// One-line warnings (ignored manifest fields).
    pub warnings: Vec<String>,
}

/// Why a spec could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read spec file {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// TOML syntax error or unknown key; the message carries line and column.
    #[error("{path}: {message}")]
    Toml {
        /// The file.
        path: String,
        /// toml's message with line, column and a snippet.
        message: String,
    },
    /// YAML syntax error.
    #[error("{path}: YAML error: {message}")]
    Yaml {
        /// The file.
        path: String,
        /// The parser's message with line and column.
        message: String,
    },
    /// A KubeVirt manifest field that vmhost cannot accept.
    #[error("manifest field {field} {why}")]
    Manifest {
        /// The YAML path of the field.
        field: String,
        /// What is wrong and the fix.
        why: String,
    },
    /// The spec parsed but breaks validation rules.
    #[error("invalid spec:\n{}", .0.iter().map(|e| format!("  - {e}")).collect::<Vec<_>>().join("\n"))]
    Invalid(Vec<SpecError>),
}

/// Parses and validates a TOML spec. `origin` names the source in messages.
pub fn from_toml_str(text: &str, origin: &str) -> Result<LoadedSpec, ConfigError> {
    let raw: RawSpec = toml::from_str(text).map_err(|e| ConfigError::Toml {
        path: origin.to_string(),
        message: e.to_string(),
    })?;
    let spec = validate(&raw, &Dialect::Toml).map_err(ConfigError::Invalid)?;
    Ok(LoadedSpec {
        spec,
        warnings: Vec::new(),
    })
}

/// Parses, maps and validates a KubeVirt `VirtualMachineInstance` or `VirtualMachine` manifest.
pub fn from_yaml_str(text: &str, origin: &str) -> Result<LoadedSpec, ConfigError> {
    let doc: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(text).map_err(|e| ConfigError::Yaml {
            path: origin.to_string(),
            message: e.to_string(),
        })?;
    let mapped = kubevirt::map_manifest(&doc)?;
    let spec = validate(&mapped.spec, &Dialect::KubeVirt(mapped.domain_prefix))
        .map_err(ConfigError::Invalid)?;
    let mut warnings = Vec::new();
    if !mapped.ignored.is_empty() {
        warnings.push(format!(
            "warning: {origin}: ignoring KubeVirt fields that do not change resources: {}",
            mapped.ignored.join(", ")
        ));
    }
    Ok(LoadedSpec { spec, warnings })
}

/// Loads a spec file: `.yaml`/`.yml` as a KubeVirt manifest, anything else as TOML.
///
/// Relative `boot.kernel` and `boot.initrd` paths are resolved against the spec file's
/// directory, so a spec and its kernel can move together (docs/spec.md).
pub fn load(path: &Path) -> Result<LoadedSpec, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let origin = path.display().to_string();
    let mut loaded = match path.extension().and_then(|e| e.to_str()) {
        Some("yaml" | "yml") => from_yaml_str(&text, &origin),
        _ => from_toml_str(&text, &origin),
    }?;
    if let Some(dir) = path.parent() {
        loaded.spec.boot.resolve_paths(dir);
    }
    Ok(loaded)
}

#[cfg(test)]
mod devices_tests;
#[cfg(test)]
mod tests;
