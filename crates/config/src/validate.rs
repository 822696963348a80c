//! Parse, then resolve: [`RawSpec`] → [`VmSpec`] with KubeVirt's admission rules.
//!
//! Every rule that fails yields one [`SpecError`] naming the field (in the dialect the user
//! wrote: TOML snake_case or the KubeVirt YAML path), the value, the rule and the fix. All
//! failing rules are reported at once.

use std::fmt;

use serde::Serialize;

use crate::devices::{check_devices, DeviceSpec};
use crate::iothreads::{check_io_threads, IoThreadsSpec};
use crate::quantity::format_bytes;
use crate::spec::RawSpec;
use crate::Quantity;

mod boot;
mod cpu;
mod memory;

use boot::check_boot;
pub use boot::{BootSpec, Payload};
use cpu::check_cpu;
pub use cpu::{CpuSpec, CpuTopology, MAX_VCPUS};
use memory::check_memory;
pub use memory::{HugepageSpec, MemorySpec, ARCH_PAGE_SIZES};

/// The largest byte quantity a spec may hold (4 PiB): x86-64's largest guest-physical address
/// space (52 bits). No host holds more, and it keeps every size derived from the spec (the
/// envelope's sums, page counts, guest-physical addresses) far from 64-bit overflow.
pub const MAX_MEMORY_BYTES: u64 = 1 << 52;

/// One broken validation rule.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SpecError {
    /// The field, as the user wrote it (`memory.guest` or `spec.domain.memory.guest`).
    pub field: String,
    /// The value found (or `(absent)`).
    pub value: String,
    /// The rule it breaks.
    pub rule: String,
    /// How to fix it.
    pub fix: String,
}

impl fmt::Display for SpecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} = {}: {}; fix: {}",
            self.field, self.value, self.rule, self.fix
        )
    }
}

/// How field names are spelled in messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Dialect {
    /// vmhost TOML (`memory.hugepages.page_size`).
    Toml,
    /// KubeVirt YAML, with the path prefix to the domain (`spec.domain.` or
    /// `spec.template.spec.domain.`).
    KubeVirt(String),
}

impl Dialect {
    /// The name of a TOML field path in this dialect (a field of `spec.domain`).
    pub fn field(&self, toml_path: &str) -> String {
        match self {
            Dialect::Toml => toml_path.to_string(),
            Dialect::KubeVirt(prefix) => {
                if toml_path == "name" {
                    return "metadata.name".to_string();
                }
                camel(prefix, toml_path)
            }
        }
    }

    /// The name of a field of the VMI spec outside the domain (`volumes`, `networks`).
    pub fn vmi_field(&self, toml_path: &str) -> String {
        match self {
            Dialect::Toml => toml_path.to_string(),
            Dialect::KubeVirt(prefix) => {
                camel(prefix.strip_suffix("domain.").unwrap_or(prefix), toml_path)
            }
        }
    }
}

/// `prefix` + `toml_path` in camelCase.
fn camel(prefix: &str, toml_path: &str) -> String {
    let mut out = prefix.to_string();
    let mut upper = false;
    for c in toml_path.chars() {
        match c {
            '_' => upper = true,
            c if upper => {
                out.push(c.to_ascii_uppercase());
                upper = false;
            }
            c => out.push(c),
        }
    }
    // KubeVirt spells this one with a capital IO.
    out.replace("dedicatedIoThread", "dedicatedIOThread")
}

/// Resolved requests or limits.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ResourceList {
    /// CPU in milli-CPUs.
    pub cpu_millis: Option<u64>,
    /// Memory in bytes.
    pub memory_bytes: Option<u64>,
}

/// Resolved requests and limits.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Resources {
    /// `resources.requests`.
    pub requests: ResourceList,
    /// `resources.limits`.
    pub limits: ResourceList,
}

/// A validated, resolved VM spec: what the planner consumes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VmSpec {
    /// VM name.
    pub name: String,
    /// CPU.
    pub cpu: CpuSpec,
    /// Memory.
    pub memory: MemorySpec,
    /// Requests and limits as written.
    pub resources: Resources,
    /// KubeVirt's graphics device (video RAM overhead) is attached.
    pub autoattach_graphics_device: bool,
    /// Boot payload.
    pub boot: BootSpec,
    /// cgroup (under `vmhost/`) that enforces the envelope, if any.
    pub cgroup: Option<String>,
    /// Disks, NICs and entropy.
    pub devices: DeviceSpec,
    /// Device I/O threads (`io_threads_policy`, `io_threads`, dedicated disks).
    pub io_threads: IoThreadsSpec,
    /// How long a guest with an ACPI power button has to power itself off after a shutdown
    /// request before vmhost stops it (`termination_grace_period_seconds`, KubeVirt's
    /// `terminationGracePeriodSeconds`): [`DEFAULT_TERMINATION_GRACE`] unless written.
    pub termination_grace: std::time::Duration,
}

/// KubeVirt's default `terminationGracePeriodSeconds`: 30 s.
pub const DEFAULT_TERMINATION_GRACE: std::time::Duration = std::time::Duration::from_secs(30);

/// The longest `termination_grace_period_seconds` taken: one day.
pub const MAX_TERMINATION_GRACE_SECONDS: u64 = 86_400;

impl VmSpec {
    /// Number of vCPUs.
    pub fn vcpus(&self) -> u32 {
        self.cpu.topology.vcpus()
    }
}

/// Collects the broken rules of one spec.
pub(crate) struct Checker<'a> {
    dialect: &'a Dialect,
    errors: Vec<SpecError>,
}

impl Checker<'_> {
    /// A broken rule of a `spec.domain` field.
    pub(crate) fn fail(
        &mut self,
        field: &str,
        value: impl fmt::Display,
        rule: &str,
        fix: impl Into<String>,
    ) {
        self.fail_at(field, false, value, rule, fix);
    }

    /// A broken rule; `vmi`: the field lies outside the domain (`volumes`, `networks`).
    pub(crate) fn fail_at(
        &mut self,
        field: &str,
        vmi: bool,
        value: impl fmt::Display,
        rule: &str,
        fix: impl Into<String>,
    ) {
        let field = if vmi {
            self.dialect.vmi_field(field)
        } else {
            self.dialect.field(field)
        };
        self.errors.push(SpecError {
            field,
            value: value.to_string(),
            rule: rule.to_string(),
            fix: fix.into(),
        });
    }

    /// A quantity in bytes, or a broken rule.
    pub(crate) fn bytes(&mut self, field: &str, q: Option<&Quantity>) -> Option<u64> {
        let q = q?;
        match q.to_bytes() {
            Some(b) if b > MAX_MEMORY_BYTES => {
                self.fail(
                    field,
                    q,
                    "is larger than x86-64's largest guest-physical address space (4Pi, 52 bits)",
                    "write at most \"4Pi\"",
                );
                None
            }
            Some(b) => Some(b),
            None => {
                self.fail(
                    field,
                    q,
                    "must be a non-negative byte count",
                    "write e.g. \"4Gi\"",
                );
                None
            }
        }
    }

    fn millis(&mut self, field: &str, q: Option<&Quantity>) -> Option<u64> {
        let q = q?;
        match u64::try_from(q.to_millis()) {
            Ok(m) => Some(m),
            Err(_) => {
                self.fail(
                    field,
                    q,
                    "must be a non-negative CPU quantity",
                    "write e.g. 4 or \"500m\"",
                );
                None
            }
        }
    }
}

/// Validates and resolves a raw spec.
///
/// ```
/// use vmhost_config::{validate, Dialect, RawSpec};
/// let raw: RawSpec = toml::from_str("[memory]\nguest = \"1Gi\"\n[cpu]\ncores = 2\n").unwrap();
/// let spec = validate(&raw, &Dialect::Toml).unwrap();
/// assert_eq!(spec.vcpus(), 2);
/// assert_eq!(spec.memory.guest_bytes, 1 << 30);
/// ```
pub fn validate(raw: &RawSpec, dialect: &Dialect) -> Result<VmSpec, Vec<SpecError>> {
    let mut c = Checker {
        dialect,
        errors: Vec::new(),
    };
    let name = check_name(&mut c, raw.name.as_deref());
    let resources = check_resources(&mut c, raw);
    let cpu = check_cpu(&mut c, raw, &resources);
    let memory = check_memory(&mut c, raw, &resources);
    let boot = check_boot(&mut c, raw);
    let devices = check_devices(&mut c, raw, &name);
    let io_threads = check_io_threads(&mut c, raw);
    let termination_grace = check_termination_grace(&mut c, raw);
    if let Some(cg) = raw
        .resources
        .cgroup
        .as_deref()
        .filter(|cg| !is_dns_label(cg))
    {
        c.fail(
            "resources.cgroup",
            format!("{cg:?}"),
            "must be a DNS label: 1-63 lowercase letters, digits or '-'",
            "name the cgroup like the VM, e.g. \"db-1\"",
        );
    }
    if let Some(memory) = &memory {
        if cpu.numa_passthrough && memory.hugepages.is_none() {
            c.fail(
                "cpu.numa.guest_mapping_passthrough",
                true,
                "NUMA passthrough needs hugepage-backed memory",
                "add memory.hugepages.page_size (\"2Mi\" or \"1Gi\")",
            );
        }
        let fallback = memory
            .hugepages
            .as_ref()
            .is_some_and(|h| h.fallback_to_normal_pages);
        if cpu.numa_passthrough && fallback {
            c.fail(
                "memory.hugepages.fallback",
                "\"normal-pages\"",
                "NUMA passthrough needs hugepage-backed memory, so it cannot fall back",
                "remove memory.hugepages.fallback, or turn NUMA passthrough off",
            );
        }
    }
    match (memory, boot, c.errors.is_empty()) {
        (Some(memory), Some(boot), true) => Ok(VmSpec {
            name,
            cpu,
            memory,
            resources,
            autoattach_graphics_device: raw.devices.autoattach_graphics_device.unwrap_or(true),
            boot,
            cgroup: raw.resources.cgroup.clone(),
            devices,
            io_threads,
            termination_grace,
        }),
        _ => Err(c.errors),
    }
}

/// `termination_grace_period_seconds`: at most a day (0: a shutdown request stops the VM at
/// once, as KubeVirt's 0 does).
fn check_termination_grace(c: &mut Checker<'_>, raw: &RawSpec) -> std::time::Duration {
    match raw.termination_grace_period_seconds {
        None => DEFAULT_TERMINATION_GRACE,
        Some(s) if s <= MAX_TERMINATION_GRACE_SECONDS => std::time::Duration::from_secs(s),
        Some(s) => {
            c.fail_at(
                "termination_grace_period_seconds",
                true,
                s,
                "is longer than a day",
                format!("write at most {MAX_TERMINATION_GRACE_SECONDS} seconds"),
            );
            DEFAULT_TERMINATION_GRACE
        }
    }
}

pub(crate) fn is_dns_label(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name
            .chars()
            .all(|ch| ch.is_ascii_lowercase() || ch.is_ascii_digit() || ch == '-')
        && !name.starts_with('-')
        && !name.ends_with('-')
}

fn check_name(c: &mut Checker<'_>, name: Option<&str>) -> String {
    let Some(name) = name else {
        return "vm".to_string();
    };
    let ok = is_dns_label(name);
    if !ok {
        c.fail(
            "name",
            format!("{name:?}"),
            "must be a DNS label: 1-63 lowercase letters, digits or '-', not starting or ending with '-'",
            "rename the VM, e.g. \"db-1\"",
        );
    }
    name.to_string()
}

fn check_resources(c: &mut Checker<'_>, raw: &RawSpec) -> Resources {
    let r = &raw.resources;
    let res = Resources {
        requests: ResourceList {
            cpu_millis: c.millis("resources.requests.cpu", r.requests.cpu.as_ref()),
            memory_bytes: c.bytes("resources.requests.memory", r.requests.memory.as_ref()),
        },
        limits: ResourceList {
            cpu_millis: c.millis("resources.limits.cpu", r.limits.cpu.as_ref()),
            memory_bytes: c.bytes("resources.limits.memory", r.limits.memory.as_ref()),
        },
    };
    if let (Some(req), Some(lim)) = (res.requests.memory_bytes, res.limits.memory_bytes) {
        if req > lim {
            c.fail(
                "resources.requests.memory",
                format_bytes(req),
                &format!(
                    "must not exceed resources.limits.memory ({})",
                    format_bytes(lim)
                ),
                "lower the request or raise the limit",
            );
        }
    }
    if let (Some(req), Some(lim)) = (res.requests.cpu_millis, res.limits.cpu_millis) {
        if req > lim {
            c.fail(
                "resources.requests.cpu",
                format!("{req}m"),
                &format!("must not exceed resources.limits.cpu ({lim}m)"),
                "lower the request or raise the limit",
            );
        }
    }
    res
}
