//! What the user wrote: the serde structs of a vmhost TOML spec.
//!
//! Field names mirror KubeVirt's `VirtualMachineInstance.spec.domain` in snake_case. Unknown
//! keys are rejected (`deny_unknown_fields`). Nothing here is validated; see
//! [`crate::validate`] for the resolved [`crate::VmSpec`].

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::Quantity;

/// The whole spec file.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawSpec {
    /// VM name (a DNS label: lowercase letters, digits, '-'; at most 63 characters).
    pub name: Option<String>,
    /// CPU topology and placement (`spec.domain.cpu`).
    pub cpu: Option<RawCpu>,
    /// Guest memory (`spec.domain.memory`).
    #[serde(default)]
    pub memory: RawMemory,
    /// Resource requests and limits (`spec.domain.resources`).
    #[serde(default)]
    pub resources: RawResources,
    /// Devices (`spec.domain.devices`).
    #[serde(default)]
    pub devices: RawDevices,
    /// What the VM boots.
    #[serde(default)]
    pub boot: RawBoot,
    /// Where the disks' data comes from (`spec.volumes`).
    #[serde(default)]
    pub volumes: Vec<RawVolume>,
    /// Networks the interfaces attach to (`spec.networks`).
    #[serde(default)]
    pub networks: Vec<RawNetwork>,
    /// How many device I/O threads there are (`spec.domain.ioThreadsPolicy`): `shared`,
    /// `auto` or `supplementalPool`.
    pub io_threads_policy: Option<String>,
    /// I/O thread options (`spec.domain.ioThreads`).
    pub io_threads: Option<RawIoThreads>,
    /// Seconds a guest with an ACPI power button has to power itself off after a shutdown
    /// request before vmhost stops it (`spec.terminationGracePeriodSeconds`; default 30).
    pub termination_grace_period_seconds: Option<u64>,
}

/// `io_threads` section (`spec.domain.ioThreads`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawIoThreads {
    /// Threads of the `supplementalPool` policy, each on a PU of its own with dedicated
    /// placement.
    pub supplemental_pool_thread_count: Option<u32>,
}

/// `cpu` section.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawCpu {
    /// Guest sockets (0 or absent: 1).
    pub sockets: Option<u32>,
    /// Cores per socket (0 or absent: 1).
    pub cores: Option<u32>,
    /// Threads per core (0 or absent: 1).
    pub threads: Option<u32>,
    /// Pin each vCPU to a host PU of its own.
    #[serde(default)]
    pub dedicated_cpu_placement: bool,
    /// Give the emulator thread a host PU of its own (needs dedicated placement).
    #[serde(default)]
    pub isolate_emulator_thread: bool,
    /// Give the isolated emulator a second PU when the vCPUs are even in number, so that the
    /// VM holds an even number of PUs (KubeVirt's
    /// `alpha.kubevirt.io/EmulatorThreadCompleteToEvenParity` annotation).
    #[serde(default)]
    pub emulator_thread_complete_to_even_parity: bool,
    /// Realtime vCPUs (needs dedicated placement and an isolated emulator thread).
    pub realtime: Option<RawRealtime>,
    /// Guest NUMA settings.
    pub numa: Option<RawNuma>,
    /// CPU model (`host-passthrough`, `host-model`); informational for now.
    pub model: Option<String>,
}

/// `cpu.realtime` section.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRealtime {
    /// The vCPUs that run SCHED_FIFO, as a vCPU list (`"0-3,^1"`); absent: all of them.
    pub mask: Option<String>,
}

/// `cpu.numa` section.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawNuma {
    /// Mirror the host NUMA nodes that hold the vCPUs as guest cells.
    #[serde(default)]
    pub guest_mapping_passthrough: bool,
}

/// `memory` section.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawMemory {
    /// Memory the guest sees (default: limits.memory, else requests.memory).
    pub guest: Option<Quantity>,
    /// Back guest RAM with hugepages.
    pub hugepages: Option<RawHugepages>,
    /// Overhead to reserve on top of the computed one.
    pub reserved_overhead: Option<RawReservedOverhead>,
}

/// `memory.hugepages` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawHugepages {
    /// Page size: `2Mi` or `1Gi` on x86_64.
    pub page_size: Quantity,
    /// A hugetlbfs mount to create the backing files in (default: memfd, nothing to mount).
    pub hugetlbfs: Option<PathBuf>,
    /// What to do when the host's pools (or this cgroup's hugetlb limit) cannot hold the
    /// guest: `refuse` (default: the plan is refused, exit 3) or `normal-pages` (back the guest
    /// with normal pages and say so in the plan).
    pub fallback: Option<String>,
}

/// `memory.reserved_overhead` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawReservedOverhead {
    /// Memory added to the computed overhead.
    pub added_overhead: Quantity,
}

/// `resources` section.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawResources {
    /// Requests.
    #[serde(default)]
    pub requests: RawResourceList,
    /// Limits.
    #[serde(default)]
    pub limits: RawResourceList,
    /// Put the VMM in a cgroup of this name (under `vmhost/`) that enforces the envelope.
    pub cgroup: Option<String>,
}

/// `resources.requests` / `resources.limits`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawResourceList {
    /// CPUs (`4`, `"500m"`).
    pub cpu: Option<Quantity>,
    /// Memory (`"16Gi"`).
    pub memory: Option<Quantity>,
}

/// `devices` section.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawDevices {
    /// KubeVirt attaches a graphics device (32Mi of video RAM) unless this is false.
    pub autoattach_graphics_device: Option<bool>,
    /// Block devices (`devices.disks[]`), each backed by the volume of the same name.
    #[serde(default)]
    pub disks: Vec<RawDisk>,
    /// NICs (`devices.interfaces[]`), each attached to the network of the same name.
    #[serde(default)]
    pub interfaces: Vec<RawInterface>,
    /// `rng = {}` adds a virtio-rng device.
    pub rng: Option<RawEmpty>,
    /// KubeVirt's `autoattachVSOCK`: a virtio-vsock device with the default CID and socket.
    pub autoattach_vsock: Option<bool>,
    /// A virtio-vsock device on a Unix socket (`[devices.vsock]`).
    pub vsock: Option<crate::vsock::RawVsock>,
}

/// An empty table (`{}`): KubeVirt's presence-only fields (`rng`, `bridge`, `pod`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawEmpty {}

/// `devices.disks[]`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawDisk {
    /// Name; a volume of the same name supplies the data.
    pub name: String,
    /// `virtio` (default) or `cdrom` (a read-only virtio disk; KubeVirt's `cdrom: {}`).
    pub bus: Option<String>,
    /// Refuse writes (KubeVirt's `disk.readonly`); always true for `cdrom`.
    #[serde(default)]
    pub read_only: bool,
    /// Serial reported to the guest (GET_ID); default: the disk name.
    pub serial: Option<String>,
    /// Host caching: `none` (default, O_DIRECT) or `writeback`.
    pub cache: Option<String>,
    /// Serve this disk on an I/O thread of its own (KubeVirt's `dedicatedIOThread`; virtio
    /// bus only).
    #[serde(default)]
    pub dedicated_io_thread: bool,
}

/// `volumes[]`: exactly one source per volume.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawVolume {
    /// Name, matched by a disk.
    pub name: String,
    /// A raw image on the host (`hostDisk`).
    pub host_disk: Option<RawHostDisk>,
    /// A generated NoCloud seed (`cloudInitNoCloud`).
    pub cloud_init_no_cloud: Option<RawCloudInit>,
    /// A sparse scratch file removed at stop (`emptyDisk`).
    pub empty_disk: Option<RawEmptyDisk>,
    /// KubeVirt's `containerDisk`: refused (needs a container runtime).
    pub container_disk: Option<serde_json::Value>,
    /// KubeVirt's `persistentVolumeClaim`: refused (needs a cluster).
    pub persistent_volume_claim: Option<serde_json::Value>,
}

/// `volumes[].host_disk`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawHostDisk {
    /// The image file (or block device).
    pub path: std::path::PathBuf,
    /// `Disk` (must exist) or `DiskOrCreate` (created sparse with `capacity` if missing).
    #[serde(rename = "type")]
    pub kind: Option<String>,
    /// Size of a created image.
    pub capacity: Option<Quantity>,
}

/// `volumes[].cloud_init_no_cloud`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawCloudInit {
    /// The `user-data` file.
    pub user_data: Option<String>,
    /// The `network-config` file.
    pub network_data: Option<String>,
}

/// `volumes[].empty_disk`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawEmptyDisk {
    /// Size.
    pub capacity: Quantity,
}

/// `devices.interfaces[]`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawInterface {
    /// Name; a network of the same name says what it attaches to.
    pub name: String,
    /// Bridge binding: the guest's frames go to the tap as they are.
    pub bridge: Option<RawEmpty>,
    /// Masquerade binding (KubeVirt NATs it; vmhost does not: see docs/spec.md).
    pub masquerade: Option<RawEmpty>,
    /// MAC address (`02:00:00:00:00:01`); default: generated from the VM and interface names.
    pub mac_address: Option<String>,
    /// NIC model: `virtio` (the only one).
    pub model: Option<String>,
    /// vmhost only: an existing tap to attach to; default: vmhost creates one.
    pub tap: Option<String>,
}

/// `networks[]`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawNetwork {
    /// Name, matched by an interface.
    pub name: String,
    /// The pod network: on a standalone host, a tap.
    pub pod: Option<RawEmpty>,
    /// KubeVirt's `multus`: refused (needs a cluster).
    pub multus: Option<serde_json::Value>,
}

/// `boot` section.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawBoot {
    /// Built-in guest payload (`touch`, `numa-bench`, `halt`, `idle`).
    pub payload: Option<String>,
    /// Linux kernel image (vmlinux or bzImage).
    pub kernel: Option<PathBuf>,
    /// Initial ramdisk.
    pub initrd: Option<PathBuf>,
    /// Kernel command line.
    pub cmdline: Option<String>,
    /// How the kernel learns the virtio devices: `acpi` (default), `cmdline` or `pci`.
    pub virtio_announce: Option<String>,
    /// Interrupt controllers: `kernel` (default, KVM's) or `split` (I/O APIC in vmhost).
    pub irqchip: Option<String>,
}
