//! Disks, volumes, interfaces, networks, entropy and vsock ([`crate::vsock`]): [`RawSpec`] → [`DeviceSpec`].
//!
//! Disks pair with volumes and interfaces with networks by name, as in KubeVirt. Paths are
//! checked here (an image that is missing, a directory or a FIFO is a spec error naming the
//! field) but nothing is created: images for `DiskOrCreate`, empty disks and cloud-init seeds
//! are made when the VM starts, so a refused spec leaves nothing behind.

use std::collections::BTreeSet;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::spec::{RawDisk, RawInterface, RawSpec, RawVolume};
use crate::validate::{is_dns_label, Checker};
use crate::vsock::{check_vsock, VsockSpec};
use crate::MacAddress;

/// Bytes of a disk serial the guest can read (virtio-blk GET_ID).
pub const SERIAL_MAX: usize = 20;
/// Largest `user_data` or `network_data` accepted for a NoCloud seed.
pub const CLOUD_INIT_MAX: usize = 1 << 20;
/// O_DIRECT (`cache = "none"`) needs images in whole 4 KiB blocks.
pub const DIRECT_BLOCK: u64 = 4096;
/// Most virtio devices in a VM: each takes one of the I/O APIC pins 16-23.
pub const MAX_DEVICES: usize = 8;

/// Host caching of a disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DiskCache {
    /// O_DIRECT: no host page cache.
    None,
    /// The host page cache; guest flushes become `fdatasync`.
    Writeback,
    /// `cache` left out: O_DIRECT where the image's file system supports it and the image is
    /// whole 4 KiB blocks, the page cache otherwise (KubeVirt's rule, decided when the image
    /// is opened).
    Auto,
}

impl DiskCache {
    /// The spec's spelling (`none`, `writeback`; `auto` when left out).
    pub fn as_str(self) -> &'static str {
        match self {
            DiskCache::None => "none",
            DiskCache::Writeback => "writeback",
            DiskCache::Auto => "auto",
        }
    }
}

/// Where a disk's bytes come from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum DiskSource {
    /// A raw image (or block device) on the host.
    Image {
        /// The file.
        path: PathBuf,
        /// `DiskOrCreate`: create it sparse with this many bytes if it is missing.
        create_bytes: Option<u64>,
    },
    /// A NoCloud seed generated at start (a FAT volume labelled `cidata`).
    CloudInitNoCloud {
        /// `user-data`.
        user_data: String,
        /// `network-config`, if any.
        network_data: Option<String>,
    },
    /// A sparse scratch file created at start and removed at stop.
    EmptyDisk {
        /// Size in bytes.
        capacity_bytes: u64,
    },
}

/// How a Linux guest learns its virtio devices, and which transport they use
/// (`boot.virtio_announce`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum VirtioAnnounce {
    /// One `LNRO0005` device per slot in the DSDT (Linux's virtio_mmio driver probes them).
    #[default]
    Acpi,
    /// `virtio_mmio.device=` parameters on the kernel command line, and none in the DSDT: for
    /// kernels without ACPI (or booted with `acpi=off`).
    Cmdline,
    /// virtio-pci functions (modern, with MSI-X) on the PCI bus 0 of a host bridge the DSDT
    /// declares, found by the guest's PCI scan: each queue interrupt is one message, with no
    /// register access (virtio-mmio's costs two exits). The guest needs `virtio_pci`.
    Pci,
}

impl VirtioAnnounce {
    /// The spec's spellings.
    pub const NAMES: [&'static str; 3] = ["acpi", "cmdline", "pci"];

    fn parse(s: &str) -> Option<Self> {
        match s {
            "acpi" => Some(VirtioAnnounce::Acpi),
            "cmdline" => Some(VirtioAnnounce::Cmdline),
            "pci" => Some(VirtioAnnounce::Pci),
            _ => None,
        }
    }
}

/// `boot.virtio_announce`: absent is `acpi`.
pub(crate) fn check_announce(c: &mut Checker<'_>, value: Option<&str>) -> VirtioAnnounce {
    let Some(value) = value else {
        return VirtioAnnounce::default();
    };
    VirtioAnnounce::parse(value).unwrap_or_else(|| {
        c.fail(
            "boot.virtio_announce",
            format!("{value:?}"),
            "is not a way to announce virtio devices",
            format!("use one of {}", VirtioAnnounce::NAMES.join(", ")),
        );
        VirtioAnnounce::default()
    })
}

/// Where a Linux guest's interrupt controllers are emulated (`boot.irqchip`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Irqchip {
    /// KVM's in-kernel irqchip: both 8259 PICs, the I/O APIC and the local APICs, and the
    /// in-kernel PIT.
    #[default]
    Kernel,
    /// A split irqchip (`KVM_CAP_SPLIT_IRQCHIP`): the local APICs in KVM, the I/O APIC in
    /// vmhost (its entries become MSI routes), and no 8259 PIC and no PIT. The guest keeps time
    /// with kvmclock and the LAPIC's TSC-deadline timer. A VM starts and ends faster (no
    /// in-kernel PIT and I/O APIC to tear down) at the cost of the 8254 and 8259, which old
    /// kernels and some firmware need.
    Split,
}

impl Irqchip {
    /// The spec's spellings.
    pub const NAMES: [&'static str; 2] = ["kernel", "split"];

    fn parse(s: &str) -> Option<Self> {
        match s {
            "kernel" => Some(Irqchip::Kernel),
            "split" => Some(Irqchip::Split),
            _ => None,
        }
    }
}

/// `boot.irqchip`: absent is `kernel`.
pub(crate) fn check_irqchip(c: &mut Checker<'_>, value: Option<&str>) -> Irqchip {
    let Some(value) = value else {
        return Irqchip::default();
    };
    Irqchip::parse(value).unwrap_or_else(|| {
        c.fail(
            "boot.irqchip",
            format!("{value:?}"),
            "is not an interrupt controller model",
            format!("use one of {}", Irqchip::NAMES.join(", ")),
        );
        Irqchip::default()
    })
}

/// A resolved virtio-blk disk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DiskSpec {
    /// Disk (and volume) name.
    pub name: String,
    /// The data.
    pub source: DiskSource,
    /// Writes are refused (VIRTIO_BLK_F_RO).
    pub read_only: bool,
    /// Host caching.
    pub cache: DiskCache,
    /// GET_ID answer (at most 20 bytes).
    pub serial: String,
}

/// How an interface reaches the outside.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Binding {
    /// Frames go to the tap unchanged.
    Bridge,
    /// Accepted for KubeVirt manifests; on a standalone host the same tap as bridge (no NAT).
    Masquerade,
}

/// A resolved virtio-net interface.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct InterfaceSpec {
    /// Interface (and network) name.
    pub name: String,
    /// Binding as written.
    pub binding: Binding,
    /// The guest's MAC address.
    pub mac: MacAddress,
    /// An existing tap to attach to; `None`: vmhost creates one.
    pub tap: Option<String>,
}

/// The VM's virtio devices, resolved.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct DeviceSpec {
    /// Disks, in spec order.
    pub disks: Vec<DiskSpec>,
    /// NICs, in spec order.
    pub interfaces: Vec<InterfaceSpec>,
    /// A virtio-rng device.
    pub rng: bool,
    /// A virtio-vsock device.
    pub vsock: Option<VsockSpec>,
}

/// Checks and resolves the devices of `raw` for VM `vm`.
pub(crate) fn check_devices(c: &mut Checker<'_>, raw: &RawSpec, vm: &str) -> DeviceSpec {
    let disks = check_disks(c, raw);
    let interfaces = check_interfaces(c, raw, vm);
    let vsock = check_vsock(c, raw.devices.vsock.as_ref(), raw.devices.autoattach_vsock);
    let count = raw.devices.disks.len()
        + raw.devices.interfaces.len()
        + usize::from(raw.devices.rng.is_some())
        + usize::from(vsock.is_some());
    if count > MAX_DEVICES {
        c.fail(
            "devices",
            format!("{count} virtio devices"),
            &format!("a VM has at most {MAX_DEVICES} virtio devices (one I/O APIC pin each)"),
            "drop disks or interfaces",
        );
    }
    DeviceSpec {
        disks,
        interfaces,
        rng: raw.devices.rng.is_some(),
        vsock,
    }
}

/// Reports names that are empty or repeated; returns the set of names.
fn unique_names<'a>(
    c: &mut Checker<'_>,
    list: &str,
    names: impl Iterator<Item = &'a str>,
    vmi: bool,
) -> BTreeSet<&'a str> {
    let mut seen = BTreeSet::new();
    for (i, name) in names.enumerate() {
        let field = format!("{list}[{i}].name");
        if name.is_empty() {
            c.fail_at(&field, vmi, "\"\"", "must not be empty", "name it");
        } else if !seen.insert(name) {
            c.fail_at(
                &field,
                vmi,
                format!("{name:?}"),
                "is a duplicate name",
                "give each entry its own name",
            );
        }
    }
    seen
}

fn check_disks(c: &mut Checker<'_>, raw: &RawSpec) -> Vec<DiskSpec> {
    let disks = &raw.devices.disks;
    unique_names(
        c,
        "devices.disks",
        disks.iter().map(|d| d.name.as_str()),
        false,
    );
    // A disk's name becomes part of file names in the run directory (scratch images, seeds).
    for (i, disk) in disks.iter().enumerate() {
        if !disk.name.is_empty() && !is_dns_label(&disk.name) {
            c.fail(
                &format!("devices.disks[{i}].name"),
                format!("{:?}", disk.name),
                "must be a DNS label: 1-63 lowercase letters, digits or '-', not starting or ending with '-' (it names files in the run directory)",
                "rename the disk and its volume, e.g. \"data-1\"",
            );
        }
    }
    let volumes = unique_names(
        c,
        "volumes",
        raw.volumes.iter().map(|v| v.name.as_str()),
        true,
    );
    for (i, v) in raw.volumes.iter().enumerate() {
        if !v.name.is_empty() && !disks.iter().any(|d| d.name == v.name) {
            c.fail_at(
                &format!("volumes[{i}].name"),
                true,
                format!("{:?}", v.name),
                "is not used by any disk",
                format!(
                    "add a devices.disks entry named {:?} or remove the volume",
                    v.name
                ),
            );
        }
    }
    let mut out = Vec::new();
    for (i, disk) in disks.iter().enumerate() {
        let volume = raw
            .volumes
            .iter()
            .enumerate()
            .find(|(_, v)| v.name == disk.name);
        let Some((vi, volume)) = volume.filter(|_| volumes.contains(disk.name.as_str())) else {
            if !disk.name.is_empty() {
                c.fail(
                    &format!("devices.disks[{i}].name"),
                    format!("{:?}", disk.name),
                    "has no volume of the same name",
                    format!("add a volumes entry named {:?} with a host_disk, cloud_init_no_cloud or empty_disk", disk.name),
                );
            }
            continue;
        };
        if let Some(d) = check_disk(c, i, disk, vi, volume) {
            out.push(d);
        }
    }
    out
}

fn check_disk(
    c: &mut Checker<'_>,
    i: usize,
    disk: &RawDisk,
    vi: usize,
    volume: &RawVolume,
) -> Option<DiskSpec> {
    let field = |f: &str| format!("devices.disks[{i}].{f}");
    let cdrom = match disk.bus.as_deref().unwrap_or("virtio") {
        "virtio" => false,
        "cdrom" => true,
        other => {
            c.fail(
                &field("bus"),
                format!("{other:?}"),
                "vmhost has only virtio disks",
                "use bus = \"virtio\" (or \"cdrom\" for a read-only disk)",
            );
            false
        }
    };
    let cache = match disk.cache.as_deref().unwrap_or("auto") {
        "auto" => DiskCache::Auto,
        "none" => DiskCache::None,
        "writeback" => DiskCache::Writeback,
        other => {
            c.fail(
                &field("cache"),
                format!("{other:?}"),
                "is not a cache mode vmhost has",
                "use \"none\" (O_DIRECT), \"writeback\", or leave it out",
            );
            DiskCache::Auto
        }
    };
    let serial = disk
        .serial
        .clone()
        .unwrap_or_else(|| truncate(&disk.name, SERIAL_MAX));
    if serial.len() > SERIAL_MAX {
        c.fail(
            &field("serial"),
            format!("{serial:?}"),
            "is longer than the 20 bytes virtio-blk reports",
            "shorten it",
        );
    }
    let source = check_volume(c, vi, volume, cache, &field("cache"))?;
    Some(DiskSpec {
        name: disk.name.clone(),
        source,
        read_only: disk.read_only || cdrom,
        cache,
        serial,
    })
}

fn truncate(s: &str, max: usize) -> String {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

fn check_volume(
    c: &mut Checker<'_>,
    vi: usize,
    v: &RawVolume,
    cache: DiskCache,
    cache_field: &str,
) -> Option<DiskSource> {
    let field = |f: &str| format!("volumes[{vi}].{f}");
    let cluster_only = [
        ("container_disk", v.container_disk.is_some()),
        (
            "persistent_volume_claim",
            v.persistent_volume_claim.is_some(),
        ),
    ];
    for (name, present) in cluster_only {
        if present {
            c.fail_at(
                &field(name),
                true,
                "(set)",
                "needs a Kubernetes cluster and cannot be resolved on a standalone host",
                "use a host_disk (hostDisk) volume with the image's path on this host, or a TOML spec with that path",
            );
        }
    }
    let sources = [
        v.host_disk.is_some(),
        v.cloud_init_no_cloud.is_some(),
        v.empty_disk.is_some(),
    ];
    match sources.iter().filter(|&&s| s).count() {
        1 => {}
        0 if cluster_only.iter().any(|(_, p)| *p) => return None,
        n => {
            c.fail_at(
                &field("name"),
                true,
                format!("{:?} ({n} sources)", v.name),
                "a volume needs exactly one source",
                "give it one of host_disk, cloud_init_no_cloud, empty_disk",
            );
            return None;
        }
    }
    if let Some(h) = &v.host_disk {
        return check_host_disk(c, &field("host_disk"), h, cache, cache_field);
    }
    if let Some(ci) = &v.cloud_init_no_cloud {
        return Some(check_cloud_init(c, &field("cloud_init_no_cloud"), ci));
    }
    let e = v.empty_disk.as_ref()?;
    let cap_field = field("empty_disk.capacity");
    let capacity_bytes = c.bytes(&cap_field, Some(&e.capacity)).filter(|&b| b > 0);
    if capacity_bytes.is_none() {
        c.fail_at(
            &cap_field,
            true,
            &e.capacity,
            "must be more than 0 bytes",
            "write e.g. \"1Gi\"",
        );
    }
    Some(DiskSource::EmptyDisk {
        capacity_bytes: capacity_bytes?,
    })
}

fn check_cloud_init(
    c: &mut Checker<'_>,
    field: &str,
    ci: &crate::spec::RawCloudInit,
) -> DiskSource {
    if ci.user_data.is_none() {
        c.fail_at(
            &format!("{field}.user_data"),
            true,
            "(absent)",
            "a NoCloud seed needs user-data",
            "add user_data (a #cloud-config document)",
        );
    }
    for (name, text) in [
        ("user_data", &ci.user_data),
        ("network_data", &ci.network_data),
    ] {
        if text.as_ref().is_some_and(|t| t.len() > CLOUD_INIT_MAX) {
            c.fail_at(
                &format!("{field}.{name}"),
                true,
                "(too long)",
                "must be at most 1 MiB",
                "shorten it",
            );
        }
    }
    DiskSource::CloudInitNoCloud {
        user_data: ci.user_data.clone().unwrap_or_default(),
        network_data: ci.network_data.clone(),
    }
}

fn check_host_disk(
    c: &mut Checker<'_>,
    field: &str,
    h: &crate::spec::RawHostDisk,
    cache: DiskCache,
    cache_field: &str,
) -> Option<DiskSource> {
    let create = match h.kind.as_deref().unwrap_or("Disk") {
        "Disk" => false,
        "DiskOrCreate" => true,
        other => {
            c.fail_at(
                &format!("{field}.type"),
                true,
                format!("{other:?}"),
                "is not a hostDisk type",
                "use \"Disk\" or \"DiskOrCreate\"",
            );
            return None;
        }
    };
    let create_bytes = if create {
        let cap_field = format!("{field}.capacity");
        let b = c.bytes(&cap_field, h.capacity.as_ref()).filter(|&b| b > 0);
        if b.is_none() {
            c.fail_at(
                &cap_field,
                true,
                "(absent or 0)",
                "DiskOrCreate needs the size of the image to create",
                "add capacity, e.g. \"10Gi\"",
            );
        }
        b
    } else {
        None
    };
    let image = ImageCheck {
        path_field: format!("{field}.path"),
        cache,
        cache_field,
        create_bytes,
    };
    image.check(c, &h.path, create).then(|| DiskSource::Image {
        path: h.path.clone(),
        create_bytes,
    })
}

/// What the host says about an image path.
struct ImageCheck<'a> {
    path_field: String,
    cache: DiskCache,
    cache_field: &'a str,
    create_bytes: Option<u64>,
}

impl ImageCheck<'_> {
    /// Reports what is wrong with `path`; true when the disk can be resolved.
    fn check(&self, c: &mut Checker<'_>, path: &Path, create: bool) -> bool {
        let shown = format!("{:?}", path.display().to_string());
        let fail = |c: &mut Checker<'_>, rule: &str, fix: &str| {
            c.fail_at(&self.path_field, true, &shown, rule, fix);
        };
        if !path.is_absolute() {
            fail(c, "must be an absolute path", "write the image's full path");
            return false;
        }
        match std::fs::metadata(path) {
            Ok(meta) => self.check_existing(c, path, &meta, fail),
            Err(_) if create => {
                if !path.parent().is_some_and(Path::is_dir) {
                    fail(
                        c,
                        "its directory does not exist",
                        "create the directory first",
                    );
                }
                let unaligned = self.create_bytes.is_some_and(|b| b % DIRECT_BLOCK != 0);
                if self.cache == DiskCache::None && unaligned {
                    c.fail(
                        self.cache_field,
                        "\"none\"",
                        "O_DIRECT needs a capacity of whole 4 KiB blocks",
                        "use a capacity such as \"10Gi\"",
                    );
                }
                true
            }
            Err(e) => {
                fail(
                    c,
                    &format!("cannot be used: {e}"),
                    "create the image, fix the path, or use type DiskOrCreate with a capacity",
                );
                false
            }
        }
    }

    fn check_existing(
        &self,
        c: &mut Checker<'_>,
        path: &Path,
        meta: &std::fs::Metadata,
        fail: impl Fn(&mut Checker<'_>, &str, &str),
    ) -> bool {
        let kind = meta.file_type();
        let bad = if kind.is_dir() {
            Some("is a directory")
        } else if kind.is_fifo() {
            Some("is a FIFO")
        } else if kind.is_socket() || kind.is_char_device() {
            Some("is a socket or character device")
        } else {
            None
        };
        if let Some(why) = bad {
            let rule = format!("{why}, not a disk image");
            fail(c, &rule, "point it at a raw image file or a block device");
            return false;
        }
        if self.cache == DiskCache::None && kind.is_file() && meta.len() % DIRECT_BLOCK != 0 {
            c.fail(
                self.cache_field,
                "\"none\"",
                &format!(
                    "O_DIRECT needs an image of whole 4 KiB blocks; {} is {} bytes",
                    path.display(),
                    meta.len()
                ),
                "use cache = \"writeback\" or resize the image (truncate -s)",
            );
        }
        if self.cache == DiskCache::None && kind.is_file() && !takes_o_direct(path) {
            c.fail(
                self.cache_field,
                "\"none\"",
                &format!(
                    "the file system of {} does not support O_DIRECT",
                    path.display()
                ),
                "leave cache out (the page cache is used there), use cache = \"writeback\", or move the image",
            );
        }
        true
    }
}

/// Whether `path` opens with O_DIRECT (read-only; nothing is written). Only EINVAL — the file
/// system's answer — counts as no: other errors surface when the VM opens the image.
fn takes_o_direct(path: &Path) -> bool {
    let opened = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC)
        .open(path);
    !matches!(opened, Err(e) if e.raw_os_error() == Some(libc::EINVAL))
}

fn check_interfaces(c: &mut Checker<'_>, raw: &RawSpec, vm: &str) -> Vec<InterfaceSpec> {
    let ifaces = &raw.devices.interfaces;
    unique_names(
        c,
        "devices.interfaces",
        ifaces.iter().map(|d| d.name.as_str()),
        false,
    );
    unique_names(
        c,
        "networks",
        raw.networks.iter().map(|n| n.name.as_str()),
        true,
    );
    for (i, n) in raw.networks.iter().enumerate() {
        if n.multus.is_some() {
            c.fail_at(
                &format!("networks[{i}].multus"),
                true,
                "(set)",
                "needs a Kubernetes cluster (Multus CNI)",
                "use pod = {} (a tap on this host)",
            );
        } else if n.pod.is_none() {
            c.fail_at(
                &format!("networks[{i}].pod"),
                true,
                "(absent)",
                "a network needs a source",
                "add pod = {}",
            );
        }
        if !ifaces.iter().any(|f| f.name == n.name) {
            c.fail_at(
                &format!("networks[{i}].name"),
                true,
                format!("{:?}", n.name),
                "is not used by any interface",
                format!(
                    "add a devices.interfaces entry named {:?} or remove the network",
                    n.name
                ),
            );
        }
    }
    ifaces
        .iter()
        .enumerate()
        .filter_map(|(i, f)| check_interface(c, raw, vm, i, f))
        .collect()
}

fn check_interface(
    c: &mut Checker<'_>,
    raw: &RawSpec,
    vm: &str,
    i: usize,
    f: &RawInterface,
) -> Option<InterfaceSpec> {
    let field = |s: &str| format!("devices.interfaces[{i}].{s}");
    if !raw.networks.iter().any(|n| n.name == f.name) {
        c.fail(
            &field("name"),
            format!("{:?}", f.name),
            "has no network of the same name",
            format!("add a networks entry named {:?} with pod = {{}}", f.name),
        );
    }
    let binding = match (&f.bridge, &f.masquerade) {
        (Some(_), None) => Binding::Bridge,
        (None, Some(_)) => Binding::Masquerade,
        _ => {
            c.fail(
                &field("bridge"),
                "(bridge and masquerade)",
                "an interface needs exactly one binding",
                "keep one of bridge = {} or masquerade = {}",
            );
            return None;
        }
    };
    if let Some(m) = f.model.as_deref().filter(|m| *m != "virtio") {
        c.fail(
            &field("model"),
            format!("{m:?}"),
            "vmhost has only virtio NICs",
            "use model = \"virtio\" or leave it out",
        );
    }
    if let Some(t) = f.tap.as_deref() {
        let ok = !t.is_empty()
            && t.len() <= 15
            && t.bytes()
                .all(|b| b.is_ascii_graphic() && b != b'/' && b != b':');
        if !ok {
            c.fail(
                &field("tap"),
                format!("{t:?}"),
                "is not an interface name (1-15 printable characters, no '/' or ':')",
                "name an existing tap, e.g. \"tap0\"",
            );
        }
    }
    let mac = match f.mac_address.as_deref() {
        None => MacAddress::generate(vm, &f.name),
        Some(text) => match text.parse::<MacAddress>() {
            Ok(m) => m,
            Err(e) => {
                c.fail(
                    &field("mac_address"),
                    format!("{text:?}"),
                    &e.to_string(),
                    "write e.g. \"02:00:00:00:00:01\"",
                );
                return None;
            }
        },
    };
    Some(InterfaceSpec {
        name: f.name.clone(),
        binding,
        mac,
        tap: f.tap.clone(),
    })
}
