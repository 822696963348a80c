//! The plan: what a VM takes from the host, decided before anything is allocated.
//!
//! Memory and vCPU code consume a [`Plan`], never the raw spec.

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;

use serde::Serialize;
use vmhost_config::{BootSpec, CpuTopology};

/// Which overhead model computed the envelope.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum OverheadModel {
    /// vmhost's own VMM costs.
    #[default]
    Vmhost,
    /// KubeVirt's amd64 launcher-pod arithmetic, reproduced exactly.
    Kubevirt,
}

/// Hugepages a plan takes from one node's pool (or from any node when `node` is `None`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HugepageDemand {
    /// Host node OS index; `None` when the memory is not bound to a node.
    pub node: Option<u32>,
    /// Page size in bytes.
    pub page_size_bytes: u64,
    /// Number of pages.
    pub count: u64,
}

/// The host envelope around the guest, term by term.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Envelope {
    /// The overhead model used.
    pub overhead_model: OverheadModel,
    /// Memory the guest sees.
    pub guest_memory_bytes: u64,
    /// Sum of the overhead terms.
    pub overhead_bytes: u64,
    /// Overhead terms by name.
    pub overhead_terms: BTreeMap<String, u64>,
    /// Ordinary (non-hugepage) memory request: overhead, plus guest memory when it is not
    /// hugepage-backed.
    pub memory_request_bytes: u64,
    /// Memory limit (the request with dedicated placement; limits.memory + overhead when given).
    pub memory_limit_bytes: Option<u64>,
    /// Host CPUs the VM is entitled to (dedicated PUs, or the shared CPU request).
    pub cpus: f64,
    /// Host PUs held exclusively (vCPUs + isolated emulator); 0 when not dedicated.
    pub dedicated_cpus: u32,
    /// Hugepages per node and size.
    pub hugepages: Vec<HugepageDemand>,
}

/// Where one vCPU runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VcpuPlacement {
    /// vCPU index (= KVM vcpu id).
    pub vcpu: u32,
    /// Guest socket, core within the socket, thread within the core.
    pub socket: u32,
    /// Core within its socket.
    pub core: u32,
    /// Thread within its core.
    pub thread: u32,
    /// x2APIC / APIC ID the guest sees.
    pub apic_id: u32,
    /// Guest NUMA cell.
    pub guest_cell: u32,
    /// Host PU it is pinned to (`None`: floats over [`Plan::floating_cpus`]).
    pub host_cpu: Option<u32>,
    /// Host node of that PU.
    pub host_node: Option<u32>,
}

/// Where the emulator thread runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct EmulatorPlacement {
    /// PUs the emulator thread may run on.
    pub host_cpus: Vec<u32>,
    /// True when these PUs hold no vCPU.
    pub isolated: bool,
}

/// The part of a guest cell's memory that is bound to one host node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MemorySpan {
    /// Host node the part is bound to.
    pub host_node: u32,
    /// Bytes of the part (whole backing pages).
    pub memory_bytes: u64,
    /// Host PUs of `host_node` that this process may use: where its first-touch workers run.
    pub prefault_cpus: Vec<u32>,
}

/// A view of one host-bound part of a cell's memory (see [`GuestCell::memory_parts`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryPart<'a> {
    /// Host node (`None`: not bound).
    pub host_node: Option<u32>,
    /// Bytes of the part.
    pub memory_bytes: u64,
    /// Where its first-touch workers run.
    pub prefault_cpus: &'a [u32],
}

/// One guest NUMA cell and the host node(s) that back it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GuestCell {
    /// Guest cell number (0..).
    pub cell: u32,
    /// Host node its memory is bound to (`None`: not bound, or bound per part in `spans`).
    pub host_node: Option<u32>,
    /// vCPUs in this cell.
    pub vcpus: Vec<u32>,
    /// Guest memory of the cell.
    pub memory_bytes: u64,
    /// Host PUs of `host_node` that this process may use: where first-touch workers run.
    pub prefault_cpus: Vec<u32>,
    /// Guest distances from this cell to every cell (10 = local).
    pub distances: Vec<u32>,
    /// When the cell's memory is bound to several host nodes (a dedicated VM without NUMA
    /// passthrough whose memory is split over its vCPUs' nodes, or spills to a nearby node):
    /// the part on each node, in guest-physical order, summing to `memory_bytes`; `host_node`
    /// is then `None`. Empty when all of the memory is on `host_node` (or unbound).
    pub spans: Vec<MemorySpan>,
}

impl GuestCell {
    /// The cell's memory by host node, in guest-physical order: its `spans`, or one part on
    /// `host_node`. Memory and boot code consume this, so a cell bound to several nodes gets
    /// one region (one `mbind`) per node while the guest sees one NUMA node.
    ///
    /// ```
    /// use vmhost_plan::{GuestCell, MemorySpan};
    /// let mut cell = GuestCell { cell: 0, host_node: Some(1), vcpus: vec![0], memory_bytes: 8 << 20,
    ///     prefault_cpus: vec![2], distances: vec![10], spans: vec![] };
    /// assert_eq!(cell.memory_parts()[0].host_node, Some(1));
    /// cell.host_node = None;
    /// cell.spans = vec![
    ///     MemorySpan { host_node: 0, memory_bytes: 6 << 20, prefault_cpus: vec![0] },
    ///     MemorySpan { host_node: 1, memory_bytes: 2 << 20, prefault_cpus: vec![2] },
    /// ];
    /// let parts = cell.memory_parts();
    /// assert_eq!((parts[1].host_node, parts[1].memory_bytes), (Some(1), 2 << 20));
    /// ```
    pub fn memory_parts(&self) -> Vec<MemoryPart<'_>> {
        if self.spans.is_empty() {
            return vec![MemoryPart {
                host_node: self.host_node,
                memory_bytes: self.memory_bytes,
                prefault_cpus: &self.prefault_cpus,
            }];
        }
        self.spans
            .iter()
            .map(|s| MemoryPart {
                host_node: Some(s.host_node),
                memory_bytes: s.memory_bytes,
                prefault_cpus: &s.prefault_cpus,
            })
            .collect()
    }
}

/// How guest RAM is backed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Backing {
    /// Hugepages: memfd (`MFD_HUGETLB`) or a file on a hugetlbfs mount.
    Hugetlb {
        /// Page size in bytes.
        page_size_bytes: u64,
        /// A hugetlbfs mount to create the backing file in; `None` = memfd.
        hugetlbfs: Option<PathBuf>,
    },
    /// Anonymous shared memory with transparent hugepages requested.
    Anonymous,
}

impl Backing {
    /// The page size guest memory is allocated in (4 KiB for anonymous memory).
    pub fn page_size_bytes(&self) -> u64 {
        match self {
            Backing::Hugetlb {
                page_size_bytes, ..
            } => *page_size_bytes,
            Backing::Anonymous => 4096,
        }
    }
}

/// Realtime vCPU threads: SCHED_FIFO on PUs nothing else of the VM runs on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RealtimePlan {
    /// vCPUs whose threads run SCHED_FIFO (the realtime mask), ascending.
    pub vcpus: Vec<u32>,
    /// Their SCHED_FIFO priority.
    pub priority: i32,
}

impl RealtimePlan {
    /// SCHED_FIFO priority of realtime vCPU threads: libvirt's `<vcpusched scheduler='fifo'
    /// priority='1'>`, which KubeVirt writes for the masked vCPUs.
    pub const PRIORITY: i32 = 1;
}

/// A complete placement plan.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    /// VM name.
    pub name: String,
    /// Guest CPU topology.
    pub guest_topology: CpuTopology,
    /// The host envelope.
    pub envelope: Envelope,
    /// Per-vCPU placement, by vCPU index.
    pub vcpus: Vec<VcpuPlacement>,
    /// PUs that unpinned vCPU threads float over (all allowed PUs; empty when dedicated).
    pub floating_cpus: Vec<u32>,
    /// Emulator thread placement.
    pub emulator: EmulatorPlacement,
    /// Guest NUMA cells.
    pub guest_cells: Vec<GuestCell>,
    /// Guest RAM backing.
    pub backing: Backing,
    /// What the guest boots.
    pub boot: BootSpec,
    /// The virtio devices, resolved from the spec (disks, NICs, entropy), and their slots.
    pub devices: crate::devices::DevicePlan,
    /// Realtime vCPUs (`cpu.realtime`), if any.
    pub realtime: Option<RealtimePlan>,
    /// The host's distances between the guest cells' nodes, and where they differ from the
    /// distances the guest is given (`guest_cells[i].distances`): never for a fresh plan, where
    /// the guest gets the host's distances; possibly for [`crate::plan_for_guest`].
    pub distances: crate::CellDistances,
    /// Decisions worth telling the operator (where placement differs from KubeVirt and why).
    pub notes: Vec<String>,
}

/// Why a host cannot hold a VM.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Reason {
    /// Not enough free hugepages of a size on a node.
    Hugepages {
        /// Node (`None`: summed over all nodes).
        node: Option<u32>,
        /// Page size.
        page_size_bytes: u64,
        /// Free pages.
        free: u64,
        /// Pages the plan needs.
        needed: u64,
    },
    /// The host has no pool of this page size at all.
    PageSizeMissing {
        /// Page size.
        page_size_bytes: u64,
        /// Sizes the host has.
        host_sizes: Vec<u64>,
    },
    /// Not enough allowed PUs for dedicated placement.
    Cpus {
        /// PUs needed.
        needed: u32,
        /// Allowed free PUs.
        available: u32,
        /// How the need is made up.
        detail: String,
    },
    /// NUMA passthrough cannot split memory over the cells.
    NumaSplit {
        /// Explanation.
        detail: String,
    },
    /// The memory does not fit on the nodes this process's cgroup cpuset allows.
    CgroupMems {
        /// The cgroup (path as in `/proc/self/cgroup`).
        cgroup: String,
        /// The nodes its `cpuset.mems.effective` allows.
        allowed: Vec<u32>,
        /// What does not fit there.
        detail: String,
    },
    /// The hugetlb limit of this process's cgroup (or an ancestor) holds fewer pages than the
    /// plan needs, whatever the nodes' pools have free.
    HugetlbLimit {
        /// The cgroup whose limit is the tightest.
        cgroup: String,
        /// Its limit file.
        file: String,
        /// Page size.
        page_size_bytes: u64,
        /// Pages the limit still allows.
        allowed: u64,
        /// Pages the plan needs.
        needed: u64,
    },
    /// A size computed from the spec or an option does not fit 64 bits: the input is
    /// invalid (exit status 2), not too large for this host.
    Overflow {
        /// The field or option it comes from.
        field: String,
        /// What overflowed, and the fix.
        detail: String,
    },
    /// The saved guest ([`crate::GuestIdentity`]) does not match the spec it is planned with.
    GuestIdentity {
        /// The spec field (or identity part) that differs.
        field: String,
        /// What differs, and the fix.
        detail: String,
    },
    /// `same_distances` was asked and the host's nodes are not as far apart as the guest's
    /// cells are.
    Distances {
        /// The cell pairs whose host distance differs from the guest's.
        pairs: Vec<crate::DistanceDiff>,
    },
    /// Anything else, in words.
    Other {
        /// Explanation.
        detail: String,
    },
}

impl Reason {
    /// True when the reason is invalid input (a size overflow), not a shortfall of the host.
    pub fn is_invalid_input(&self) -> bool {
        matches!(self, Reason::Overflow { .. })
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let size = vmhost_config::format_bytes;
        match self {
            Reason::Hugepages { node: Some(n), page_size_bytes, free, needed } => write!(
                f,
                "node{n} has {free} free {} hugepages, the plan needs {needed}",
                size(*page_size_bytes)
            ),
            Reason::Hugepages { node: None, page_size_bytes, free, needed } => write!(
                f,
                "the host has {free} free {} hugepages in all, the plan needs {needed}",
                size(*page_size_bytes)
            ),
            Reason::PageSizeMissing { page_size_bytes, host_sizes } => write!(
                f,
                "the host kernel has no {} hugepages (sizes: {})",
                size(*page_size_bytes),
                host_sizes.iter().map(|s| size(*s)).collect::<Vec<_>>().join(", ")
            ),
            Reason::Cpus { needed, available, detail } => write!(
                f,
                "dedicated placement needs {needed} PUs ({detail}), the host allows {available} free"
            ),
            Reason::CgroupMems { cgroup, allowed, detail } => write!(
                f,
                "{detail}: cgroup {cgroup} allows memory only on node(s) {} (cpuset.mems.effective); give the pod (or this process's cgroup) more memory nodes or plan a smaller VM",
                vmhost_topology::cpulist::format(allowed)
            ),
            Reason::HugetlbLimit { cgroup, file, page_size_bytes, allowed, needed } => write!(
                f,
                "cgroup {cgroup} may take only {allowed} more {} hugepages ({file} minus its usage), the plan needs {needed}; raise the pod's hugepages-{} limit or plan a smaller VM",
                size(*page_size_bytes),
                size(*page_size_bytes)
            ),
            Reason::Overflow { field, detail } => write!(f, "{field}: {detail}"),
            Reason::GuestIdentity { field, detail } => {
                write!(f, "{field} differs from the saved guest's: {detail}")
            }
            Reason::Distances { pairs } => write!(
                f,
                "the host's node distances differ from the guest's (same_distances is set): {}; accept them by planning without same_distances (check-target: --allow-distance-change), or free host nodes as far apart as the guest's cells are",
                pairs.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
            ),
            Reason::NumaSplit { detail } | Reason::Other { detail } => f.write_str(detail),
        }
    }
}
