//! The live host state guest memory depends on, and the admission re-check against it.
//!
//! This module owns everything read from sysfs and `statfs` before memory is allocated: which
//! nodes exist, which hugepage sizes the kernel has, the free and reserved pages of each pool,
//! and whether a hugetlbfs mount is one, with the right page size. [`check_admission`] runs
//! all checks on a [`Plan`] and fails with the first problem, before anything is allocated.
//!
//! Pool arithmetic: the kernel reserves hugepages when a shared mapping is created
//! (`resv_hugepages` rises) but takes them off `free_hugepages` only when they are faulted
//! in. A reserved page is promised to its mapping, so what a new mapping can really get is
//! `free - resv` of the size (`HugePages_Free - HugePages_Rsvd` in `/proc/meminfo`).
//! Reservations are counted per size only, not per node, so per node the bound is the node's
//! `free_hugepages`, and both bounds must hold.

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};

use serde::Serialize;
use vmhost_config::format_bytes;
use vmhost_plan::{Backing, Plan};

use crate::policy::PolicyOverride;
use crate::sys;

/// `statfs` magic of hugetlbfs.
pub const HUGETLBFS_MAGIC: u64 = 0x9584_58f6;

/// Why the plan cannot be allocated on this host as it is now.
#[derive(Debug, thiserror::Error)]
pub enum AdmissionError {
    /// The plan has no guest cell.
    #[error("the plan has no guest cell")]
    NoCells,
    /// Two cells have the same number.
    #[error("guest cell {cell} appears twice in the plan")]
    DuplicateCell {
        /// Cell number.
        cell: u32,
    },
    /// A cell has no memory.
    #[error("guest cell {cell} has no memory")]
    EmptyCell {
        /// Cell number.
        cell: u32,
    },
    /// A cell's memory is not a whole number of pages.
    #[error(
        "guest cell {cell}: memory of {memory_bytes} bytes is not a multiple of the {} page size",
        format_bytes(*page_size_bytes)
    )]
    NotPageMultiple {
        /// Cell number.
        cell: u32,
        /// The cell's memory.
        memory_bytes: u64,
        /// The backing page size.
        page_size_bytes: u64,
    },
    /// A cell's per-node parts do not add up to its memory.
    #[error(
        "guest cell {cell}: its per-node parts hold {spans_bytes} bytes, the cell {memory_bytes}"
    )]
    SpansMismatch {
        /// Cell number.
        cell: u32,
        /// The cell's memory.
        memory_bytes: u64,
        /// Sum of its parts.
        spans_bytes: u64,
    },
    /// A cell is bound to a node the host does not have.
    #[error(
        "guest cell {cell} is bound to host node{node}, which does not exist (nodes: {nodes:?})"
    )]
    NodeMissing {
        /// Cell number.
        cell: u32,
        /// The missing node.
        node: u32,
        /// The host's nodes.
        nodes: Vec<u32>,
    },
    /// A memory-policy override names a node the host does not have.
    #[error(
        "memory policy {policy} names host node{node}, which does not exist (nodes: {nodes:?})"
    )]
    PolicyNodeMissing {
        /// The policy, as `numa_maps` spells it.
        policy: String,
        /// The missing node.
        node: u32,
        /// The host's nodes.
        nodes: Vec<u32>,
    },
    /// The kernel has no hugepage pool of the page size.
    #[error(
        "the host kernel has no {} hugepages (sizes: {})",
        format_bytes(*page_size_bytes),
        host_sizes.iter().map(|s| format_bytes(*s)).collect::<Vec<_>>().join(", ")
    )]
    PageSizeNotEnabled {
        /// The page size asked for.
        page_size_bytes: u64,
        /// Sizes the host has.
        host_sizes: Vec<u64>,
    },
    /// A node has fewer free hugepages of the size than the plan binds there.
    #[error(
        "node{node} has {free} free {} hugepages, the plan needs {needed}",
        format_bytes(*page_size_bytes)
    )]
    NodeShort {
        /// The node.
        node: u32,
        /// Page size.
        page_size_bytes: u64,
        /// Free pages on the node.
        free: u64,
        /// Pages the plan needs there.
        needed: u64,
    },
    /// The host as a whole has fewer unreserved free hugepages of the size than the plan needs.
    #[error(
        "the host has {} {} hugepages available ({free} free, {reserved} of them reserved by \
         other mappings), the plan needs {needed}",
        free.saturating_sub(*reserved),
        format_bytes(*page_size_bytes)
    )]
    HostShort {
        /// Page size.
        page_size_bytes: u64,
        /// Free pages of the size.
        free: u64,
        /// Pages reserved by existing mappings but not yet faulted in.
        reserved: u64,
        /// Pages the plan needs.
        needed: u64,
    },
    /// A sysfs pool counter could not be read.
    #[error("cannot read hugepage pool counter {path}")]
    ReadPool {
        /// The counter file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// A sysfs pool counter does not hold a number.
    #[error("hugepage pool counter {path} holds {text:?}, not a number")]
    ParsePool {
        /// The counter file.
        path: PathBuf,
        /// What it holds.
        text: String,
    },
    /// The hugetlbfs path cannot be examined.
    #[error("cannot statfs the hugetlbfs mount {path}")]
    Statfs {
        /// The mount path from the spec.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The hugetlbfs path is on another filesystem.
    #[error("{path} is not a hugetlbfs mount (filesystem magic {f_type:#x})")]
    NotHugetlbfs {
        /// The path from the spec.
        path: PathBuf,
        /// Its filesystem's magic.
        f_type: u64,
    },
    /// The hugetlbfs mount serves another page size.
    #[error(
        "hugetlbfs mount {path} serves {} pages, the plan asks for {}",
        format_bytes(*mount_page_size_bytes),
        format_bytes(*page_size_bytes)
    )]
    HugetlbfsPageSize {
        /// The mount path.
        path: PathBuf,
        /// The mount's page size.
        mount_page_size_bytes: u64,
        /// The plan's page size.
        page_size_bytes: u64,
    },
}

/// Hugepages of one size the plan takes from one node (or from any node).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PoolCheck {
    /// Node (`None`: cells not bound to a node).
    pub node: Option<u32>,
    /// Page size.
    pub page_size_bytes: u64,
    /// Pages needed.
    pub needed: u64,
    /// Free pages on the node (or on the host for `None`).
    pub free: u64,
    /// Pages of this size reserved host-wide by other mappings.
    pub reserved: u64,
}

/// The pools a plan was admitted against, as read just before allocating.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Admission {
    /// One entry per (node, page size) the plan draws from; empty for anonymous backing.
    pub pools: Vec<PoolCheck>,
}

/// Reads sysfs below a root (normally `/sys`; tests point it at a fake tree).
#[derive(Debug, Clone)]
pub struct HostState {
    root: PathBuf,
}

impl Default for HostState {
    fn default() -> Self {
        HostState {
            root: PathBuf::from("/sys"),
        }
    }
}

fn pool_dir_name(page_size_bytes: u64) -> String {
    format!("hugepages-{}kB", page_size_bytes / 1024)
}

impl HostState {
    /// A reader of the sysfs tree at `root`.
    pub fn with_root(root: impl Into<PathBuf>) -> Self {
        HostState { root: root.into() }
    }

    fn read_counter(&self, path: PathBuf) -> Result<u64, AdmissionError> {
        let text = std::fs::read_to_string(&path).map_err(|source| AdmissionError::ReadPool {
            path: path.clone(),
            source,
        })?;
        text.trim()
            .parse()
            .map_err(|_| AdmissionError::ParsePool { path, text })
    }

    /// The host's NUMA nodes (from `devices/system/node/node*`).
    pub fn nodes(&self) -> Vec<u32> {
        let dir = self.root.join("devices/system/node");
        let mut nodes: Vec<u32> = std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.strip_prefix("node")?.parse().ok())
            .collect();
        nodes.sort_unstable();
        nodes
    }

    /// Hugepage sizes the kernel has (from `kernel/mm/hugepages`), ascending.
    pub fn page_sizes(&self) -> Vec<u64> {
        let dir = self.root.join("kernel/mm/hugepages");
        let mut sizes: Vec<u64> = std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let name = e.file_name();
                let kb: u64 = name
                    .to_str()?
                    .strip_prefix("hugepages-")?
                    .strip_suffix("kB")?
                    .parse()
                    .ok()?;
                kb.checked_mul(1024)
            })
            .collect();
        sizes.sort_unstable();
        sizes
    }

    /// Free pages of a size on a node (`None`: host-wide).
    pub fn free_pages(
        &self,
        node: Option<u32>,
        page_size_bytes: u64,
    ) -> Result<u64, AdmissionError> {
        let dir = match node {
            Some(n) => self
                .root
                .join(format!("devices/system/node/node{n}/hugepages")),
            None => self.root.join("kernel/mm/hugepages"),
        };
        self.read_counter(
            dir.join(pool_dir_name(page_size_bytes))
                .join("free_hugepages"),
        )
    }

    /// Pages of a size reserved host-wide by mappings that have not faulted them in yet.
    pub fn reserved_pages(&self, page_size_bytes: u64) -> Result<u64, AdmissionError> {
        let dir = self
            .root
            .join("kernel/mm/hugepages")
            .join(pool_dir_name(page_size_bytes));
        self.read_counter(dir.join("resv_hugepages"))
    }

    /// The transparent-hugepage setting for shared memory (`shmem_enabled`'s chosen value).
    pub fn shmem_thp(&self) -> Option<String> {
        let text = std::fs::read_to_string(
            self.root
                .join("kernel/mm/transparent_hugepage/shmem_enabled"),
        )
        .ok()?;
        let start = text.find('[')? + 1;
        let end = start + text[start..].find(']')?;
        Some(text[start..end].to_string())
    }
}

/// Checks that `path` is a hugetlbfs mount serving `page_size_bytes` pages.
pub fn check_hugetlbfs(path: &Path, page_size_bytes: u64) -> Result<(), AdmissionError> {
    let (f_type, f_bsize) = sys::statfs(path).map_err(|source| AdmissionError::Statfs {
        path: path.to_path_buf(),
        source,
    })?;
    if f_type != HUGETLBFS_MAGIC {
        return Err(AdmissionError::NotHugetlbfs {
            path: path.to_path_buf(),
            f_type,
        });
    }
    if f_bsize != page_size_bytes {
        return Err(AdmissionError::HugetlbfsPageSize {
            path: path.to_path_buf(),
            mount_page_size_bytes: f_bsize,
            page_size_bytes,
        });
    }
    Ok(())
}

/// Checks the plan's shape: cells present, unique, non-empty, whole pages.
fn check_cells(plan: &Plan) -> Result<(), AdmissionError> {
    if plan.guest_cells.is_empty() {
        return Err(AdmissionError::NoCells);
    }
    let page = plan.backing.page_size_bytes();
    let mut seen = std::collections::BTreeSet::new();
    for c in &plan.guest_cells {
        if !seen.insert(c.cell) {
            return Err(AdmissionError::DuplicateCell { cell: c.cell });
        }
        if c.memory_bytes == 0 {
            return Err(AdmissionError::EmptyCell { cell: c.cell });
        }
        let parts = c.memory_parts();
        let bad = parts
            .iter()
            .map(|p| p.memory_bytes)
            .find(|&b| page == 0 || b % page != 0);
        if let Some(memory_bytes) = bad {
            return Err(AdmissionError::NotPageMultiple {
                cell: c.cell,
                memory_bytes,
                page_size_bytes: page,
            });
        }
        let sum: u64 = parts.iter().map(|p| p.memory_bytes).sum();
        if sum != c.memory_bytes {
            return Err(AdmissionError::SpansMismatch {
                cell: c.cell,
                memory_bytes: c.memory_bytes,
                spans_bytes: sum,
            });
        }
    }
    Ok(())
}

/// Re-checks a plan against the live host, before anything is allocated.
///
/// In order: the cells' shape, that bound nodes exist, that the page size is enabled, that a
/// named hugetlbfs mount is one with that page size, then the free pools per node and
/// host-wide (see the module docs for the reservation arithmetic).
pub fn check_admission(plan: &Plan, host: &HostState) -> Result<Admission, AdmissionError> {
    check_cells(plan)?;
    let nodes = host.nodes();
    for c in &plan.guest_cells {
        for node in c.memory_parts().iter().filter_map(|p| p.host_node) {
            if !nodes.contains(&node) {
                return Err(AdmissionError::NodeMissing {
                    cell: c.cell,
                    node,
                    nodes,
                });
            }
        }
    }
    let Backing::Hugetlb {
        page_size_bytes: page,
        hugetlbfs,
    } = &plan.backing
    else {
        if matches!(host.shmem_thp().as_deref(), Some("never" | "deny")) {
            tracing::warn!(
                "transparent hugepages for shared memory are disabled \
                 (transparent_hugepage/shmem_enabled); anonymous guest RAM uses 4 KiB pages"
            );
        }
        return Ok(Admission::default());
    };
    let page = *page;
    let host_sizes = host.page_sizes();
    if !host_sizes.contains(&page) {
        return Err(AdmissionError::PageSizeNotEnabled {
            page_size_bytes: page,
            host_sizes,
        });
    }
    if let Some(path) = hugetlbfs {
        check_hugetlbfs(path, page)?;
    }
    let mut per_node: BTreeMap<Option<u32>, u64> = BTreeMap::new();
    for part in plan.guest_cells.iter().flat_map(|c| c.memory_parts()) {
        *per_node.entry(part.host_node).or_default() += part.memory_bytes / page;
    }
    let reserved = host.reserved_pages(page)?;
    let mut pools = Vec::new();
    for (&node, &needed) in &per_node {
        let free = host.free_pages(node, page)?;
        if let Some(n) = node {
            if free < needed {
                return Err(AdmissionError::NodeShort {
                    node: n,
                    page_size_bytes: page,
                    free,
                    needed,
                });
            }
        }
        pools.push(PoolCheck {
            node,
            page_size_bytes: page,
            needed,
            free,
            reserved,
        });
    }
    let total: u64 = per_node.values().sum();
    let free = host.free_pages(None, page)?;
    if free.saturating_sub(reserved) < total {
        return Err(AdmissionError::HostShort {
            page_size_bytes: page,
            free,
            reserved,
            needed: total,
        });
    }
    Ok(Admission { pools })
}

/// Checks that every node of a memory-policy override exists on the host.
pub fn check_policy(policy: &PolicyOverride, host: &HostState) -> Result<(), AdmissionError> {
    let nodes = host.nodes();
    match policy.nodes().into_iter().find(|n| !nodes.contains(n)) {
        Some(node) => Err(AdmissionError::PolicyNodeMissing {
            policy: policy.policy_string(),
            node,
            nodes,
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
#[path = "host_tests.rs"]
mod tests;
