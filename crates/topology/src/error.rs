//! The error type of this crate: one variant per failing operation, each carrying the value
//! that failed and what was expected instead.

use std::path::PathBuf;

use thiserror::Error;

use crate::cpulist::CpuListError;

/// The cause reported by the hwloc binding, kept opaque so that no hwloc type leaks out.
pub type BackendError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Hugepage pool syntax shown in argument errors.
const HUGEPAGE_FORM: &str =
    "nodeN:SIZE=COUNT, comma-separated, e.g. node0:2Mi=512,node1:1Gi=8 (SIZE: 2Mi, 2M, 2048kB, 1Gi, 1G, 1048576kB)";

/// Everything that can go wrong while discovering, loading or adjusting a host topology.
#[derive(Debug, Error)]
pub enum TopologyError {
    /// hwloc could not discover the running host.
    #[error("cannot discover the host topology through hwloc (is /sys mounted?)")]
    Discover {
        /// What hwloc reported.
        #[source]
        source: BackendError,
    },

    /// An hwloc XML file could not be loaded.
    #[error("cannot load hwloc XML topology {} (expected a file written by `lstopo --of xml FILE`)", path.display())]
    LoadXml {
        /// The XML file.
        path: PathBuf,
        /// What hwloc reported.
        #[source]
        source: BackendError,
    },

    /// An hwloc synthetic description was rejected.
    #[error("invalid hwloc synthetic topology {description:?}: expected hwloc's synthetic syntax, e.g. \"package:2 numa:1 core:4 pu:2\" or \"package:2 [numa] core:4 pu:2\"")]
    LoadSynthetic {
        /// The description that was given.
        description: String,
        /// What hwloc reported.
        #[source]
        source: BackendError,
    },

    /// hwloc produced a topology that cannot be described by the model (no PU, a PU or NUMA
    /// node without an OS index, ...).
    #[error("unusable topology from {origin}: {reason}")]
    Unusable {
        /// Where the topology came from (`live host`, the XML path, the synthetic string).
        origin: String,
        /// What is missing.
        reason: String,
    },

    /// A sysfs or procfs file could not be read.
    #[error("cannot read {}", path.display())]
    ReadSysfs {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },

    /// A sysfs or procfs file held a CPU list that does not parse.
    #[error("unexpected CPU list in {}", path.display())]
    ParseSysfsCpuList {
        /// The file.
        path: PathBuf,
        /// The parse error (includes the text).
        #[source]
        source: CpuListError,
    },

    /// A sysfs file held something other than the decimal count expected.
    #[error("unexpected content {text:?} in {}: expected a decimal number", path.display())]
    ParseSysfsNumber {
        /// The file.
        path: PathBuf,
        /// Its trimmed content.
        text: String,
    },

    /// `sched_getaffinity` failed for this process.
    #[error("cannot read this process's CPU affinity (sched_getaffinity)")]
    Affinity {
        /// The OS error.
        #[source]
        source: std::io::Error,
    },

    /// A hugepage pool argument does not parse.
    #[error("invalid hugepage pool {arg:?}: {reason}; expected {HUGEPAGE_FORM}")]
    ParseHugepages {
        /// The offending item (or the whole argument when it is empty).
        arg: String,
        /// What is wrong with it.
        reason: String,
    },

    /// A hugepage pool names a node the topology does not have.
    #[error("hugepage pool for node{node}: the topology has no node{node} (its nodes: {available}); use one of those")]
    HugepageNode {
        /// The node OS index given.
        node: u32,
        /// The topology's nodes, e.g. `0,1`.
        available: String,
    },

    /// A hugepage pool uses a page size the host does not support.
    #[error("hugepage pool for node{node}: page size {page_size_bytes} bytes is not supported by this host (supported: {supported}); use one of those")]
    HugepageSize {
        /// The node OS index given.
        node: u32,
        /// The page size given.
        page_size_bytes: u64,
        /// The supported sizes, readable, e.g. `2Mi, 1Gi`.
        supported: String,
    },

    /// `restrict_allowed` was given a CPU that is not a PU of the topology.
    #[error("cannot restrict allowed CPUs to cpu {cpu}: it is not a PU of this topology (its PUs: {available}); list only those")]
    RestrictCpu {
        /// The CPU given.
        cpu: u32,
        /// The topology's PUs as a cpulist.
        available: String,
    },
}
