//! Parse, then resolve: [`RawSpec`] → [`VmSpec`] with KubeVirt's admission rules.
//!
//! Every rule that fails yields one [`SpecError`] naming the field (in the dialect the user
//! wrote: TOML snake_case or the KubeVirt YAML path), the value, the rule and the fix. All
//! failing rules are reported at once.

use std::fmt;
use std::path::PathBuf;

use serde::Serialize;

use crate::devices::{
    check_announce, check_devices, check_irqchip, DeviceSpec, Irqchip, VirtioAnnounce,
};
use crate::iothreads::{check_io_threads, IoThreadsSpec};
use crate::quantity::format_bytes;
use crate::spec::RawSpec;
use crate::Quantity;

/// Page sizes the host architecture has (x86_64: 2 MiB and 1 GiB).
pub const ARCH_PAGE_SIZES: [u64; 2] = [2 << 20, 1 << 30];

/// The most vCPUs a KVM VM may have here (`KVM_CAP_MAX_VCPUS` on current kernels).
pub const MAX_VCPUS: u32 = 1024;

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

/// The guest CPU topology.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct CpuTopology {
    /// Sockets.
    pub sockets: u32,
    /// Cores per socket.
    pub cores: u32,
    /// Threads per core.
    pub threads: u32,
}

impl CpuTopology {
    /// sockets × cores × threads.
    pub fn vcpus(&self) -> u32 {
        self.sockets * self.cores * self.threads
    }
}

/// Resolved CPU settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CpuSpec {
    /// Guest topology.
    pub topology: CpuTopology,
    /// True when the topology came from `cpu.{sockets,cores,threads}` (KubeVirt then ignores
    /// CPU resources for the vCPU count).
    pub topology_given: bool,
    /// Pin each vCPU to a PU of its own.
    pub dedicated_cpu_placement: bool,
    /// Give the emulator thread a PU of its own.
    pub isolate_emulator_thread: bool,
    /// Mirror host NUMA nodes as guest cells.
    pub numa_passthrough: bool,
    /// CPU model, if given.
    pub model: Option<String>,
    /// The isolated emulator completes the VM's PUs to an even number (a second PU when the
    /// vCPUs are even in number).
    pub emulator_even_parity: bool,
    /// vCPUs that run SCHED_FIFO (`cpu.realtime`), ascending; `None` without realtime.
    pub realtime_vcpus: Option<Vec<u32>>,
}

impl CpuSpec {
    /// PUs of the isolated emulator thread: 0 without isolation, 2 with even parity and an
    /// even number of vCPUs (KubeVirt's rule), else 1.
    pub fn emulator_pus(&self) -> u32 {
        if !self.isolate_emulator_thread {
            0
        } else if self.emulator_even_parity && self.topology.vcpus() % 2 == 0 {
            2
        } else {
            1
        }
    }
}

/// Resolved hugepage backing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HugepageSpec {
    /// Page size in bytes.
    pub page_size_bytes: u64,
    /// hugetlbfs mount to use instead of memfd.
    pub hugetlbfs: Option<PathBuf>,
    /// `fallback = "normal-pages"`: when the pools cannot hold the guest, the planner backs
    /// it with normal pages instead of refusing it.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub fallback_to_normal_pages: bool,
}

/// Resolved memory settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MemorySpec {
    /// Memory the guest sees.
    pub guest_bytes: u64,
    /// Hugepage backing, if any.
    pub hugepages: Option<HugepageSpec>,
    /// `reserved_overhead.added_overhead` (0 when absent).
    pub added_overhead_bytes: u64,
}

impl MemorySpec {
    /// Guest RAM as allocated: `guest_bytes` rounded up to whole 4 KiB pages (hugepage-backed
    /// guests are already whole pages). Quantities such as `1G` (10^9 bytes) are valid, as in
    /// KubeVirt; the overhead is computed from the exact `guest_bytes`.
    ///
    /// ```
    /// let s = vmhost_config::from_toml_str("[memory]\nguest = \"1G\"\n", "t.toml").unwrap().spec;
    /// assert_eq!(s.memory.guest_bytes, 1_000_000_000);
    /// assert_eq!(s.memory.guest_ram_bytes(), 1_000_001_536);
    /// ```
    pub fn guest_ram_bytes(&self) -> u64 {
        self.guest_bytes
            .checked_next_multiple_of(4096)
            .unwrap_or(self.guest_bytes & !4095)
    }
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

/// A built-in guest payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Payload {
    /// Every vCPU writes every page of its guest cell.
    Touch,
    /// NUMA locality benchmark kernels.
    NumaBench,
    /// Start, report, halt.
    Halt,
    /// vCPUs wait halted until told to stop.
    Idle,
}

impl Payload {
    /// All payload names, for messages.
    pub const NAMES: [&'static str; 4] = ["touch", "numa-bench", "halt", "idle"];

    fn parse(s: &str) -> Option<Self> {
        match s {
            "touch" => Some(Payload::Touch),
            "numa-bench" => Some(Payload::NumaBench),
            "halt" => Some(Payload::Halt),
            "idle" => Some(Payload::Idle),
            _ => None,
        }
    }
}

/// What the VM boots.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum BootSpec {
    /// A built-in payload.
    Payload {
        /// Which one.
        payload: Payload,
    },
    /// A Linux kernel.
    Kernel {
        /// Kernel image.
        kernel: PathBuf,
        /// Initial ramdisk.
        initrd: Option<PathBuf>,
        /// Command line.
        cmdline: String,
        /// How the kernel learns the virtio devices.
        virtio_announce: VirtioAnnounce,
        /// Where the interrupt controllers are emulated.
        irqchip: Irqchip,
    },
}

impl BootSpec {
    /// Makes a relative kernel or initrd path relative to `dir` (the spec file's directory).
    pub fn resolve_paths(&mut self, dir: &std::path::Path) {
        if let BootSpec::Kernel { kernel, initrd, .. } = self {
            for p in std::iter::once(kernel).chain(initrd.as_mut()) {
                if p.is_relative() {
                    *p = dir.join(&*p);
                }
            }
        }
    }
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
}

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
        }),
        _ => Err(c.errors),
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

fn check_cpu(c: &mut Checker<'_>, raw: &RawSpec, res: &Resources) -> CpuSpec {
    let default = Default::default();
    let cpu = raw.cpu.as_ref().unwrap_or(&default);
    let factors = [cpu.sockets, cpu.cores, cpu.threads].map(|f| f.unwrap_or(0));
    let topology_given = factors.iter().any(|&f| f > 0);
    let topology = if topology_given {
        let [s, co, t] = factors.map(|f| f.max(1));
        CpuTopology {
            sockets: s,
            cores: co,
            threads: t,
        }
    } else {
        if raw.cpu.is_some()
            && [cpu.sockets, cpu.cores, cpu.threads]
                .iter()
                .any(Option::is_some)
        {
            c.fail(
                "cpu.sockets",
                0,
                "sockets × cores × threads must be at least 1",
                "set cpu.sockets, cpu.cores and cpu.threads to 1 or more",
            );
        }
        // KubeVirt: the CPU limit, else the request, rounded up; at least 1; as sockets.
        let millis = res
            .limits
            .cpu_millis
            .or(res.requests.cpu_millis)
            .unwrap_or(1000);
        let n = u32::try_from(millis.div_ceil(1000))
            .unwrap_or(u32::MAX)
            .max(1);
        CpuTopology {
            sockets: n,
            cores: 1,
            threads: 1,
        }
    };
    let vcpus =
        u64::from(topology.sockets) * u64::from(topology.cores) * u64::from(topology.threads);
    let mut topology = topology;
    if vcpus > u64::from(MAX_VCPUS) {
        c.fail(
            if topology_given {
                "cpu.sockets"
            } else {
                "resources.limits.cpu"
            },
            format!("{vcpus} vCPUs"),
            &format!("a KVM VM holds at most {MAX_VCPUS} vCPUs"),
            "lower cpu.sockets, cpu.cores or cpu.threads",
        );
        topology = CpuTopology {
            sockets: 1,
            cores: 1,
            threads: 1,
        };
    }
    let numa_passthrough = cpu
        .numa
        .as_ref()
        .is_some_and(|n| n.guest_mapping_passthrough);
    if cpu.isolate_emulator_thread && !cpu.dedicated_cpu_placement {
        c.fail(
            "cpu.isolate_emulator_thread",
            true,
            "an isolated emulator thread needs dedicated CPU placement",
            "set cpu.dedicated_cpu_placement = true, or drop isolate_emulator_thread",
        );
    }
    if numa_passthrough && !cpu.dedicated_cpu_placement {
        c.fail(
            "cpu.numa.guest_mapping_passthrough",
            true,
            "NUMA passthrough needs dedicated CPU placement",
            "set cpu.dedicated_cpu_placement = true",
        );
    }
    if cpu.dedicated_cpu_placement {
        if let Some(m) = res.limits.cpu_millis.or(res.requests.cpu_millis) {
            if m % 1000 != 0 {
                c.fail(
                    "resources.requests.cpu",
                    format!("{m}m"),
                    "dedicated CPU placement needs whole CPUs",
                    "use a whole number of CPUs or drop the CPU request",
                );
            }
        }
    }
    let realtime_vcpus = cpu
        .realtime
        .as_ref()
        .and_then(|rt| check_realtime(c, cpu, rt, topology.vcpus()));
    CpuSpec {
        topology,
        topology_given,
        dedicated_cpu_placement: cpu.dedicated_cpu_placement,
        isolate_emulator_thread: cpu.isolate_emulator_thread,
        numa_passthrough,
        model: cpu.model.clone(),
        emulator_even_parity: cpu.emulator_thread_complete_to_even_parity,
        realtime_vcpus,
    }
}

/// `cpu.realtime`: exclusive vCPU PUs (dedicated placement and an isolated emulator), and a
/// mask of existing vCPUs.
fn check_realtime(
    c: &mut Checker<'_>,
    cpu: &crate::spec::RawCpu,
    rt: &crate::spec::RawRealtime,
    vcpus: u32,
) -> Option<Vec<u32>> {
    if !cpu.dedicated_cpu_placement || !cpu.isolate_emulator_thread {
        c.fail(
            "cpu.realtime",
            "(set)",
            "realtime vCPUs need PUs nothing else runs on: dedicated CPU placement and an isolated emulator thread",
            "set cpu.dedicated_cpu_placement = true and cpu.isolate_emulator_thread = true",
        );
    }
    let Some(mask) = rt.mask.as_deref() else {
        return Some((0..vcpus).collect());
    };
    match crate::vcpumask::parse(mask, vcpus) {
        Ok(list) if !list.is_empty() => Some(list),
        Ok(_) => {
            c.fail(
                "cpu.realtime.mask",
                format!("{mask:?}"),
                "selects no vCPU",
                "name at least one vCPU, e.g. \"0\", or drop the mask for all vCPUs",
            );
            None
        }
        Err(why) => {
            c.fail(
                "cpu.realtime.mask",
                format!("{mask:?}"),
                &why,
                format!(
                    "write a vCPU list within 0-{}, e.g. \"0-1,^1\"",
                    vcpus.saturating_sub(1)
                ),
            );
            None
        }
    }
}

fn check_memory(c: &mut Checker<'_>, raw: &RawSpec, res: &Resources) -> Option<MemorySpec> {
    let m = &raw.memory;
    let explicit = c.bytes("memory.guest", m.guest.as_ref());
    if m.guest.is_some() && explicit.is_none() {
        return None; // reported by `bytes`
    }
    let guest = explicit
        .or(res.limits.memory_bytes)
        .or(res.requests.memory_bytes);
    let added = m
        .reserved_overhead
        .as_ref()
        .and_then(|r| {
            c.bytes(
                "memory.reserved_overhead.added_overhead",
                Some(&r.added_overhead),
            )
        })
        .unwrap_or(0);
    let hugepages = m.hugepages.as_ref().and_then(|h| {
        let size = h
            .page_size
            .to_bytes()
            .filter(|s| ARCH_PAGE_SIZES.contains(s));
        if size.is_none() {
            c.fail(
                "memory.hugepages.page_size",
                &h.page_size,
                "is not a hugepage size of x86_64",
                "use \"2Mi\" or \"1Gi\"",
            );
        }
        let fallback_to_normal_pages = match h.fallback.as_deref() {
            None | Some("refuse") => false,
            Some("normal-pages") => true,
            Some(other) => {
                c.fail(
                    "memory.hugepages.fallback",
                    other,
                    "is not a fallback vmhost knows",
                    "use \"refuse\" (the default) or \"normal-pages\"",
                );
                false
            }
        };
        size.map(|page_size_bytes| HugepageSpec {
            page_size_bytes,
            hugetlbfs: h.hugetlbfs.clone(),
            fallback_to_normal_pages,
        })
    });
    let Some(guest) = guest else {
        c.fail(
            "memory.guest",
            "(absent)",
            "the guest needs memory: memory.guest, resources.limits.memory or resources.requests.memory",
            "add memory.guest, e.g. \"1Gi\"",
        );
        return None;
    };
    let field = if explicit.is_some() {
        "memory.guest"
    } else {
        "resources.requests.memory"
    };
    if guest == 0 {
        c.fail(
            field,
            0,
            "guest memory must be positive",
            "give the guest e.g. \"1Gi\"",
        );
    }
    if let (Some(lim), Some(_)) = (res.limits.memory_bytes, explicit) {
        if guest > lim {
            c.fail(
                "memory.guest",
                format_bytes(guest),
                &format!(
                    "must not exceed resources.limits.memory ({})",
                    format_bytes(lim)
                ),
                "lower memory.guest or raise the limit",
            );
        }
    }
    if let Some(h) = &hugepages {
        if guest % h.page_size_bytes != 0 {
            let up = guest.div_ceil(h.page_size_bytes) * h.page_size_bytes;
            c.fail(
                field,
                format_bytes(guest),
                &format!(
                    "must be a multiple of the hugepage size {} (memory.hugepages.page_size)",
                    format_bytes(h.page_size_bytes)
                ),
                format!("use {} or a smaller page size", format_bytes(up)),
            );
        }
    }
    // Like KubeVirt, any byte count is accepted without hugepages; the guest gets whole 4 KiB
    // pages (MemorySpec::guest_ram_bytes) and the overhead uses the exact quantity.
    Some(MemorySpec {
        guest_bytes: guest,
        hugepages,
        added_overhead_bytes: added,
    })
}

fn check_boot(c: &mut Checker<'_>, raw: &RawSpec) -> Option<BootSpec> {
    let b = &raw.boot;
    match (&b.kernel, &b.payload) {
        (Some(_), Some(p)) => {
            c.fail(
                "boot.payload",
                format!("{p:?}"),
                "boot.payload and boot.kernel exclude each other",
                "keep one of them",
            );
            None
        }
        (Some(kernel), None) => Some(BootSpec::Kernel {
            kernel: kernel.clone(),
            initrd: b.initrd.clone(),
            cmdline: b
                .cmdline
                .clone()
                .unwrap_or_else(|| "console=ttyS0".to_string()),
            virtio_announce: check_announce(c, b.virtio_announce.as_deref()),
            irqchip: check_irqchip(c, b.irqchip.as_deref()),
        }),
        (None, p) => {
            let kernel_only = [
                ("boot.initrd", b.initrd.is_some()),
                ("boot.cmdline", b.cmdline.is_some()),
                ("boot.virtio_announce", b.virtio_announce.is_some()),
                ("boot.irqchip", b.irqchip.is_some()),
            ];
            if let Some((field, _)) = kernel_only.iter().find(|(_, set)| *set) {
                c.fail(
                    field,
                    "(set)",
                    "an initrd, command line, virtio_announce or irqchip needs boot.kernel",
                    "add boot.kernel or remove them",
                );
            }
            let name = p.as_deref().unwrap_or("touch");
            match Payload::parse(name) {
                Some(payload) => Some(BootSpec::Payload { payload }),
                None => {
                    c.fail(
                        "boot.payload",
                        format!("{name:?}"),
                        "is not a built-in payload",
                        format!("use one of {}", Payload::NAMES.join(", ")),
                    );
                    None
                }
            }
        }
    }
}
