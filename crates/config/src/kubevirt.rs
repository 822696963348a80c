//! KubeVirt `VirtualMachineInstance` / `VirtualMachine` YAML → [`RawSpec`].
//!
//! The fields that govern resources map onto the same spec as the TOML form. A field that
//! changes resources and that vmhost does not model is an error naming it; every other field is
//! ignored and listed once in a warning.

use serde_yaml_ng::{Mapping, Value};

#[path = "kubevirt_devices.rs"]
mod devices;

use crate::spec::{
    RawCpu, RawHugepages, RawIoThreads, RawNuma, RawRealtime, RawReservedOverhead, RawResourceList,
    RawSpec,
};

/// KubeVirt's annotation that gives the isolated emulator a second PU for even parity.
pub const EVEN_PARITY_ANNOTATION: &str = "alpha.kubevirt.io/EmulatorThreadCompleteToEvenParity";
/// vmhost's annotation that chooses the virtio transport of a manifest's devices: `pci`
/// (virtio-pci with MSI-X, what KubeVirt's `bus: virtio` is) or `mmio` (the default);
/// `boot.virtio_announce` `pci` or `acpi` in a TOML spec.
pub const VIRTIO_TRANSPORT_ANNOTATION: &str = "vmhost.io/virtio-transport";
/// vmhost's annotation that chooses where the interrupt controllers are emulated: `kernel`
/// (KVM's, the default) or `split` (`boot.irqchip` in a TOML spec).
pub const IRQCHIP_ANNOTATION: &str = "vmhost.io/irqchip";
use crate::{ConfigError, Quantity};

/// A manifest mapped onto a raw spec, with the domain path and the ignored fields.
#[derive(Debug)]
pub struct Mapped {
    /// The spec.
    pub spec: RawSpec,
    /// `spec.domain.` or `spec.template.spec.domain.`.
    pub domain_prefix: String,
    /// Fields present in the manifest that vmhost ignores.
    pub ignored: Vec<String>,
}

/// Fields that change a VM's resources and that vmhost does not support, with why.
const UNSUPPORTED: &[(&str, &str)] = &[
    ("cpu.maxSockets", "CPU hotplug"),
    ("memory.maxGuest", "memory hotplug"),
    (
        "launchSecurity",
        "SEV/TDX memory encryption (256Mi overhead term)",
    ),
    ("devices.gpus", "GPU passthrough (VFIO, 1Gi overhead term)"),
    (
        "devices.hostDevices",
        "host device passthrough (VFIO, 1Gi overhead term)",
    ),
    ("devices.tpm", "a TPM device (53Mi overhead term)"),
    ("devices.downwardMetrics", "downward metrics"),
    (
        "resources.overcommitGuestOverhead",
        "overcommitted guest overhead",
    ),
];

struct Walker {
    ignored: Vec<String>,
    prefix: String,
}

impl Walker {
    fn string(&self, v: &Value, path: &str) -> Result<String, ConfigError> {
        v.as_str()
            .map(str::to_string)
            .ok_or_else(|| self.err(path, format!("must be a string, found {v:?}")))
    }

    fn seq<'v>(&self, v: &'v Value, path: &str) -> Result<&'v [Value], ConfigError> {
        v.as_sequence()
            .map(Vec::as_slice)
            .ok_or_else(|| self.err(path, "must be a list".to_string()))
    }

    fn err(&self, path: &str, why: String) -> ConfigError {
        ConfigError::Manifest {
            field: format!("{}{path}", self.prefix),
            why,
        }
    }

    /// Takes the known keys out of `map` (calling `f` for each), records the rest as ignored.
    fn take<'v>(
        &mut self,
        map: &'v Mapping,
        path: &str,
        known: &[&str],
    ) -> Vec<(&'v str, &'v Value)> {
        let mut out = Vec::new();
        for (k, v) in map {
            let key = k.as_str().unwrap_or("?");
            if known.contains(&key) {
                out.push((key, v));
            } else {
                self.ignored.push(format!("{}{path}{key}", self.prefix));
            }
        }
        out
    }

    fn mapping<'v>(&self, v: &'v Value, path: &str) -> Result<&'v Mapping, ConfigError> {
        v.as_mapping()
            .ok_or_else(|| self.err(path, "must be a mapping".to_string()))
    }

    fn u32(&self, v: &Value, path: &str) -> Result<u32, ConfigError> {
        v.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| self.err(path, format!("must be a non-negative integer, found {v:?}")))
    }

    fn bool(&self, v: &Value, path: &str) -> Result<bool, ConfigError> {
        v.as_bool()
            .ok_or_else(|| self.err(path, format!("must be true or false, found {v:?}")))
    }

    fn quantity(&self, v: &Value, path: &str) -> Result<Quantity, ConfigError> {
        let text = match v {
            Value::String(s) => s.clone(),
            Value::Number(n) => n.to_string(),
            _ => return Err(self.err(path, format!("must be a quantity, found {v:?}"))),
        };
        text.parse()
            .map_err(|e: crate::QuantityError| self.err(path, e.to_string()))
    }
}

/// Maps a KubeVirt manifest (already parsed YAML) onto a raw spec.
pub fn map_manifest(doc: &Value) -> Result<Mapped, ConfigError> {
    let top = doc.as_mapping().ok_or_else(|| ConfigError::Manifest {
        field: "(document)".into(),
        why: "a KubeVirt manifest must be a YAML mapping".into(),
    })?;
    let kind = top.get("kind").and_then(Value::as_str).unwrap_or("");
    let api = top.get("apiVersion").and_then(Value::as_str).unwrap_or("");
    if !api.starts_with("kubevirt.io/") {
        return Err(ConfigError::Manifest {
            field: "apiVersion".into(),
            why: format!("is {api:?}; vmhost reads kubevirt.io/v1 manifests"),
        });
    }
    let domain_prefix = match kind {
        "VirtualMachineInstance" => "spec.domain.",
        "VirtualMachine" => "spec.template.spec.domain.",
        other => {
            return Err(ConfigError::Manifest {
                field: "kind".into(),
                why: format!("is {other:?}; use VirtualMachineInstance or VirtualMachine"),
            })
        }
    };
    let mut w = Walker {
        ignored: Vec::new(),
        prefix: String::new(),
    };
    let mut spec = RawSpec {
        name: top
            .get("metadata")
            .and_then(|m| m.get("name"))
            .and_then(Value::as_str)
            .map(str::to_string),
        ..RawSpec::default()
    };
    for (k, _) in top {
        let key = k.as_str().unwrap_or("?");
        if !["apiVersion", "kind", "metadata", "spec"].contains(&key) {
            w.ignored.push(key.to_string());
        }
    }
    map_annotations(&mut w, top, &mut spec)?;
    let parts = find_domain(&mut w, top, kind)?;
    w.prefix = domain_prefix.to_string();
    if let Some(domain) = parts.domain {
        map_domain(&mut w, domain, &mut spec)?;
    }
    w.prefix = parts.prefix;
    if let Some(v) = parts.volumes {
        spec.volumes = devices::map_volumes(&mut w, v)?;
    }
    if let Some(v) = parts.networks {
        spec.networks = devices::map_networks(&mut w, v)?;
    }
    if let Some(v) = parts.termination_grace {
        let path = "terminationGracePeriodSeconds";
        let seconds = v
            .as_u64()
            .ok_or_else(|| w.err(path, format!("must be a non-negative integer, found {v:?}")))?;
        spec.termination_grace_period_seconds = Some(seconds);
    }
    Ok(Mapped {
        spec,
        domain_prefix: domain_prefix.to_string(),
        ignored: w.ignored,
    })
}

/// `metadata.annotations` (and the VirtualMachine template's): an annotation that changes
/// resources is honoured; every other one is listed as ignored, never dropped silently.
fn map_annotations(w: &mut Walker, top: &Mapping, spec: &mut RawSpec) -> Result<(), ConfigError> {
    let template = top
        .get("spec")
        .and_then(|s| s.get("template"))
        .and_then(|t| t.get("metadata"));
    for (prefix, meta) in [
        ("metadata.", top.get("metadata")),
        ("spec.template.metadata.", template),
    ] {
        let Some(a) = meta.and_then(|m| m.get("annotations")) else {
            continue;
        };
        let path = format!("{prefix}annotations");
        let a = a.as_mapping().ok_or_else(|| ConfigError::Manifest {
            field: path.clone(),
            why: "must be a mapping".into(),
        })?;
        for (k, v) in a {
            let key = k.as_str().unwrap_or("?");
            if key == VIRTIO_TRANSPORT_ANNOTATION {
                spec.boot.virtio_announce = Some(virtio_transport(v, &format!("{path}.{key}"))?);
            } else if key == IRQCHIP_ANNOTATION {
                spec.boot.irqchip = Some(irqchip(v, &format!("{path}.{key}"))?);
            } else if key == EVEN_PARITY_ANNOTATION {
                // KubeVirt tests for presence only; the value does not matter.
                let cpu = spec.cpu.get_or_insert_with(RawCpu::default);
                cpu.emulator_thread_complete_to_even_parity = true;
            } else {
                w.ignored.push(format!("{path}.{key}"));
            }
        }
    }
    Ok(())
}

/// The value of [`IRQCHIP_ANNOTATION`] as `boot.irqchip`.
fn irqchip(v: &Value, field: &str) -> Result<String, ConfigError> {
    match v.as_str() {
        Some(s @ ("kernel" | "split")) => Ok(s.into()),
        _ => Err(ConfigError::Manifest {
            field: field.to_string(),
            why: format!("{v:?} is not an irqchip: use \"kernel\" or \"split\""),
        }),
    }
}

/// The value of [`VIRTIO_TRANSPORT_ANNOTATION`] as `boot.virtio_announce`.
fn virtio_transport(v: &Value, field: &str) -> Result<String, ConfigError> {
    match v.as_str() {
        Some("pci") => Ok("pci".into()),
        Some("mmio") => Ok("acpi".into()),
        _ => Err(ConfigError::Manifest {
            field: field.to_string(),
            why: format!("{v:?} is not a virtio transport: use \"pci\" or \"mmio\""),
        }),
    }
}

/// The parts of the VMI spec vmhost reads: the domain, `volumes` and `networks`, and the
/// path prefix of the VMI spec (`spec.` or `spec.template.spec.`).
#[derive(Default)]
struct VmiParts<'v> {
    domain: Option<&'v Mapping>,
    volumes: Option<&'v Value>,
    networks: Option<&'v Value>,
    termination_grace: Option<&'v Value>,
    prefix: String,
}

fn find_domain<'v>(
    w: &mut Walker,
    top: &'v Mapping,
    kind: &str,
) -> Result<VmiParts<'v>, ConfigError> {
    let Some(spec) = top.get("spec") else {
        return Ok(VmiParts::default());
    };
    let mut spec = w.mapping(spec, "spec")?;
    if kind == "VirtualMachine" {
        w.prefix = "spec.".into();
        let t = w.take(spec, "", &["template"]);
        let Some((_, template)) = t.first() else {
            return Ok(VmiParts::default());
        };
        w.prefix = "spec.template.".into();
        let tm = w.mapping(template, "")?;
        let t = w.take(tm, "", &["spec", "metadata"]);
        let Some((_, s)) = t.iter().find(|(k, _)| *k == "spec") else {
            return Ok(VmiParts::default());
        };
        spec = w.mapping(s, "spec")?;
        w.prefix = "spec.template.spec.".into();
    } else {
        w.prefix = "spec.".into();
    }
    let mut parts = VmiParts {
        prefix: w.prefix.clone(),
        ..VmiParts::default()
    };
    let known = [
        "domain",
        "volumes",
        "networks",
        "terminationGracePeriodSeconds",
    ];
    for (key, v) in w.take(spec, "", &known) {
        match key {
            "domain" => parts.domain = Some(w.mapping(v, "domain")?),
            "volumes" => parts.volumes = Some(v),
            "networks" => parts.networks = Some(v),
            _ => parts.termination_grace = Some(v),
        }
    }
    Ok(parts)
}

fn map_domain(w: &mut Walker, domain: &Mapping, spec: &mut RawSpec) -> Result<(), ConfigError> {
    // Unsupported resource-changing fields first: they are errors, not warnings.
    for (path, what) in UNSUPPORTED {
        if lookup(domain, path).is_some() {
            return Err(w.err(
                path,
                format!(
                    "changes the VM's resources ({what}) and vmhost does not support it; remove it"
                ),
            ));
        }
    }
    let known = [
        "cpu",
        "memory",
        "resources",
        "devices",
        "ioThreadsPolicy",
        "ioThreads",
        "firmware",
    ];
    for (key, v) in w.take(domain, "", &known) {
        if key == "ioThreadsPolicy" {
            spec.io_threads_policy = Some(w.string(v, key)?);
            continue;
        }
        let m = w.mapping(v, key)?;
        match key {
            "ioThreads" => spec.io_threads = Some(map_io_threads(w, m)?),
            "cpu" => {
                let parity = spec
                    .cpu
                    .as_ref()
                    .is_some_and(|c| c.emulator_thread_complete_to_even_parity);
                let mut cpu = map_cpu(w, m)?;
                cpu.emulator_thread_complete_to_even_parity |= parity;
                spec.cpu = Some(cpu);
            }
            "memory" => map_memory(w, m, spec)?,
            "resources" => map_resources(w, m, spec)?,
            "firmware" => map_firmware(w, m, spec)?,
            _ => devices::map_devices(w, m, spec)?,
        }
    }
    Ok(())
}

fn map_io_threads(w: &mut Walker, m: &Mapping) -> Result<RawIoThreads, ConfigError> {
    let mut t = RawIoThreads::default();
    for (_, v) in w.take(m, "ioThreads.", &["supplementalPoolThreadCount"]) {
        t.supplemental_pool_thread_count = Some(w.u32(v, "ioThreads.supplementalPoolThreadCount")?);
    }
    Ok(t)
}

/// `firmware.kernelBoot`: KubeVirt boots `container.kernelPath` and `container.initrdPath` out
/// of a container image with `kernelArgs` as the command line. A standalone host has no image
/// to pull, so vmhost reads the two paths as files on this host (`container.image` and the
/// other firmware fields are listed as ignored).
fn map_firmware(w: &mut Walker, m: &Mapping, spec: &mut RawSpec) -> Result<(), ConfigError> {
    for (_, v) in w.take(m, "firmware.", &["kernelBoot"]) {
        let kb = w.mapping(v, "firmware.kernelBoot")?;
        for (key, v) in w.take(kb, "firmware.kernelBoot.", &["kernelArgs", "container"]) {
            let path = format!("firmware.kernelBoot.{key}");
            if key == "kernelArgs" {
                spec.boot.cmdline = Some(w.string(v, &path)?);
                continue;
            }
            let c = w.mapping(v, &path)?;
            let known = ["kernelPath", "initrdPath"];
            for (key, v) in w.take(c, "firmware.kernelBoot.container.", &known) {
                let path = format!("firmware.kernelBoot.container.{key}");
                let file = Some(w.string(v, &path)?.into());
                match key {
                    "kernelPath" => spec.boot.kernel = file,
                    _ => spec.boot.initrd = file,
                }
            }
        }
    }
    Ok(())
}

fn lookup<'v>(map: &'v Mapping, dotted: &str) -> Option<&'v Value> {
    let mut cur = map;
    let mut parts = dotted.split('.').peekable();
    while let Some(p) = parts.next() {
        let v = cur.get(p)?;
        if parts.peek().is_none() {
            return Some(v);
        }
        cur = v.as_mapping()?;
    }
    None
}

fn map_cpu(w: &mut Walker, m: &Mapping) -> Result<RawCpu, ConfigError> {
    let mut cpu = RawCpu::default();
    let known = [
        "sockets",
        "cores",
        "threads",
        "dedicatedCpuPlacement",
        "isolateEmulatorThread",
        "numa",
        "model",
        "realtime",
    ];
    for (key, v) in w.take(m, "cpu.", &known) {
        let path = format!("cpu.{key}");
        match key {
            "sockets" => cpu.sockets = Some(w.u32(v, &path)?),
            "cores" => cpu.cores = Some(w.u32(v, &path)?),
            "threads" => cpu.threads = Some(w.u32(v, &path)?),
            "dedicatedCpuPlacement" => cpu.dedicated_cpu_placement = w.bool(v, &path)?,
            "isolateEmulatorThread" => cpu.isolate_emulator_thread = w.bool(v, &path)?,
            "model" => cpu.model = v.as_str().map(str::to_string),
            "realtime" => {
                let rt = w.mapping(v, &path)?;
                let mut mask = None;
                for (_, m) in w.take(rt, "cpu.realtime.", &["mask"]) {
                    mask = Some(m.as_str().map(str::to_string).ok_or_else(|| {
                        w.err(
                            "cpu.realtime.mask",
                            format!("must be a vCPU list string, found {m:?}"),
                        )
                    })?);
                }
                cpu.realtime = Some(RawRealtime { mask });
            }
            _ => {
                let numa = w.mapping(v, &path)?;
                // KubeVirt writes `guestMappingPassthrough: {}`: presence enables it.
                let on = !w
                    .take(numa, "cpu.numa.", &["guestMappingPassthrough"])
                    .is_empty();
                cpu.numa = Some(RawNuma {
                    guest_mapping_passthrough: on,
                });
            }
        }
    }
    Ok(cpu)
}

fn map_memory(w: &mut Walker, m: &Mapping, spec: &mut RawSpec) -> Result<(), ConfigError> {
    for (key, v) in w.take(m, "memory.", &["guest", "hugepages", "reservedOverhead"]) {
        match key {
            "guest" => spec.memory.guest = Some(w.quantity(v, "memory.guest")?),
            "hugepages" => {
                let h = w.mapping(v, "memory.hugepages")?;
                let mut size = None;
                for (_, v) in w.take(h, "memory.hugepages.", &["pageSize"]) {
                    size = Some(w.quantity(v, "memory.hugepages.pageSize")?);
                }
                let page_size = size.ok_or_else(|| {
                    w.err(
                        "memory.hugepages.pageSize",
                        "is required with hugepages; use \"2Mi\" or \"1Gi\"".into(),
                    )
                })?;
                spec.memory.hugepages = Some(RawHugepages {
                    page_size,
                    hugetlbfs: None,
                    fallback: None,
                });
            }
            _ => {
                let r = w.mapping(v, "memory.reservedOverhead")?;
                for (_, v) in w.take(r, "memory.reservedOverhead.", &["addedOverhead"]) {
                    let added_overhead = w.quantity(v, "memory.reservedOverhead.addedOverhead")?;
                    spec.memory.reserved_overhead = Some(RawReservedOverhead { added_overhead });
                }
            }
        }
    }
    Ok(())
}

fn map_resources(w: &mut Walker, m: &Mapping, spec: &mut RawSpec) -> Result<(), ConfigError> {
    for (key, v) in w.take(m, "resources.", &["requests", "limits"]) {
        let list = w.mapping(v, &format!("resources.{key}"))?;
        let mut out = RawResourceList::default();
        for (name, q) in list {
            let name = name.as_str().unwrap_or("?");
            let path = format!("resources.{key}.{name}");
            match name {
                "cpu" => out.cpu = Some(w.quantity(q, &path)?),
                "memory" => out.memory = Some(w.quantity(q, &path)?),
                _ => {
                    return Err(w.err(
                        &path,
                        "is a resource vmhost does not manage; remove it (hugepages come from memory.hugepages.pageSize)".into(),
                    ))
                }
            }
        }
        if key == "requests" {
            spec.resources.requests = out;
        } else {
            spec.resources.limits = out;
        }
    }
    Ok(())
}
