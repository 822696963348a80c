//! The host topology data model: plain data, no hwloc types.
//!
//! Everything the planner needs to know about a host lives in [`HostTopology`]; it can be built
//! by discovery ([`crate::discover`]), by loading an hwloc XML or synthetic description
//! ([`crate::load`]), or by hand in tests.

use serde::{Deserialize, Serialize};

/// A hugepage size and its pool on one NUMA node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HugepagePool {
    /// Page size in bytes (2 MiB = 2097152, 1 GiB = 1073741824).
    pub page_size_bytes: u64,
    /// Pages reserved in the pool (`nr_hugepages`).
    pub total: u64,
    /// Pages free right now (`free_hugepages`).
    pub free: u64,
}

/// A NUMA node of the host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NumaNode {
    /// OS index of the node (`/sys/devices/system/node/nodeN`).
    pub os_index: u32,
    /// OS indexes of the PUs (logical CPUs) local to this node, ascending.
    pub cpus: Vec<u32>,
    /// Local memory in bytes (0 when unknown).
    pub memory_bytes: u64,
    /// Hugepage pools per page size, ascending by size.
    pub hugepages: Vec<HugepagePool>,
}

/// A physical core and its sibling PUs (hardware threads).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Core {
    /// Logical index of the core in the whole host (0..).
    pub index: u32,
    /// OS index of the package (socket) that holds the core.
    pub package: u32,
    /// OS index of the NUMA node that holds the core's PUs.
    pub node: u32,
    /// OS indexes of the core's PUs, ascending (siblings when more than one).
    pub pus: Vec<u32>,
}

/// A package (socket).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Package {
    /// OS index of the package.
    pub os_index: u32,
    /// OS indexes of the NUMA nodes whose PUs sit in this package.
    pub nodes: Vec<u32>,
}

/// The node distance matrix (ACPI SLIT semantics: 10 = local).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Distances {
    /// Node OS indexes in the order of the matrix rows and columns.
    pub nodes: Vec<u32>,
    /// `matrix[i][j]` = distance from `nodes[i]` to `nodes[j]`.
    pub matrix: Vec<Vec<u32>>,
    /// True when the host gave no matrix and 10 local / 20 remote was assumed.
    pub assumed: bool,
}

/// Where a topology came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", content = "detail", rename_all = "snake_case")]
pub enum TopologySource {
    /// Discovered on the running host.
    Live,
    /// Loaded from an hwloc XML file (path).
    Xml(String),
    /// Built from an hwloc synthetic description.
    Synthetic(String),
}

/// The memory nodes a cgroup's cpuset lets this process allocate on (`cpuset.mems.effective`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllowedMems {
    /// Node OS indexes, ascending.
    pub nodes: Vec<u32>,
    /// The cgroup (path as in `/proc/self/cgroup`) whose cpuset sets them.
    pub cgroup: String,
    /// The file they were read from.
    pub file: String,
}

/// The hugetlb limit of this process's cgroup and its ancestors for one page size: the fewest
/// pages any of them still lets it take (`hugetlb.<size>.max` minus its usage).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HugetlbLimit {
    /// Page size in bytes.
    pub page_size_bytes: u64,
    /// Pages of this size the process may still take, summed over all nodes.
    pub pages: u64,
    /// The cgroup whose limit is the tightest (path as in `/proc/self/cgroup`).
    pub cgroup: String,
    /// The limit file of that cgroup (`hugetlb.2MB.max`, `hugetlb.2MB.limit_in_bytes`).
    pub file: String,
    /// Its limit in bytes.
    pub limit_bytes: u64,
    /// Its usage in bytes (`hugetlb.2MB.current`, `hugetlb.2MB.usage_in_bytes`).
    pub usage_bytes: u64,
}

/// Everything vmhost knows about a host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostTopology {
    /// Where this description came from.
    pub source: TopologySource,
    /// Packages, ascending by OS index.
    pub packages: Vec<Package>,
    /// NUMA nodes, ascending by OS index.
    pub nodes: Vec<NumaNode>,
    /// Cores, in hwloc's logical order.
    pub cores: Vec<Core>,
    /// Node distances.
    pub distances: Distances,
    /// Online PUs (OS indexes, ascending).
    pub online_cpus: Vec<u32>,
    /// PUs this process may run on (affinity ∩ cpuset ∩ online), ascending.
    pub allowed_cpus: Vec<u32>,
    /// Hugepage sizes the host kernel supports (bytes, ascending), whether or not a pool exists.
    pub hugepage_sizes: Vec<u64>,
    /// The memory nodes this process's cgroup allows, when it has a cpuset (`None`: every node).
    #[serde(default)]
    pub allowed_mems: Option<AllowedMems>,
    /// Hugetlb limits of this process's cgroup and its ancestors, ascending by page size; a
    /// size without an entry is not limited.
    #[serde(default)]
    pub hugetlb_limits: Vec<HugetlbLimit>,
}

impl HostTopology {
    /// The node with this OS index.
    pub fn node(&self, os_index: u32) -> Option<&NumaNode> {
        self.nodes.iter().find(|n| n.os_index == os_index)
    }

    /// The OS index of the node that holds `cpu`, if any.
    pub fn node_of_cpu(&self, cpu: u32) -> Option<u32> {
        self.nodes
            .iter()
            .find(|n| n.cpus.contains(&cpu))
            .map(|n| n.os_index)
    }

    /// Distance between two nodes (by OS index); 10 for a node to itself when the matrix lacks it.
    pub fn distance(&self, from: u32, to: u32) -> u32 {
        let pos = |n| self.distances.nodes.iter().position(|&x| x == n);
        match (pos(from), pos(to)) {
            (Some(i), Some(j)) => self.distances.matrix[i][j],
            _ if from == to => 10,
            _ => 20,
        }
    }

    /// True when this process may allocate memory on node `os_index` (its cgroup's
    /// `cpuset.mems.effective` lists it, or no cpuset restricts memory).
    pub fn node_allowed(&self, os_index: u32) -> bool {
        self.allowed_mems
            .as_ref()
            .is_none_or(|m| m.nodes.contains(&os_index))
    }

    /// The cgroup limit on pages of `page_size_bytes`, if any.
    pub fn hugetlb_limit(&self, page_size_bytes: u64) -> Option<&HugetlbLimit> {
        self.hugetlb_limits
            .iter()
            .find(|l| l.page_size_bytes == page_size_bytes)
    }

    /// The free pages of `page_size_bytes` on node `os_index` (0 when there is no such pool).
    pub fn free_hugepages(&self, os_index: u32, page_size_bytes: u64) -> u64 {
        self.node(os_index)
            .and_then(|n| {
                n.hugepages
                    .iter()
                    .find(|p| p.page_size_bytes == page_size_bytes)
            })
            .map_or(0, |p| p.free)
    }
}
