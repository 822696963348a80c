//! Host topology for vmhost: NUMA nodes, packages, cores and their PUs, node distances, the
//! CPUs this process may use, and hugepage pools per node.
//!
//! A [`HostTopology`] (plain data, serde-serializable) comes from
//! - [`discover`]: the running host (hwloc + sysfs + `sched_getaffinity`), with the memory
//!   nodes and hugetlb pages this process's cgroups allow it (a pod's share of the node);
//! - [`load_xml`]: an hwloc XML file (`lstopo --of xml FILE`);
//! - [`load_synthetic`]: an hwloc synthetic description (`"package:2 numa:1 core:4 pu:2"`).
//!
//! Loaded hosts have no hugepage pools and all CPUs allowed; [`apply_hugepages`] (with
//! [`parse_hugepages_arg`]) and [`restrict_allowed`] simulate those. [`render_text`] prints a
//! summary.
//!
//! ```
//! let mut host = vmhost_topology::load_synthetic("package:2 numa:1 core:4 pu:2").unwrap();
//! assert_eq!((host.nodes.len(), host.cores.len()), (2, 8));
//! let pools = vmhost_topology::parse_hugepages_arg("node0:2Mi=512,node1:1Gi=8").unwrap();
//! vmhost_topology::apply_hugepages(&mut host, &pools).unwrap();
//! assert_eq!(host.free_hugepages(1, 1 << 30), 8);
//! vmhost_topology::restrict_allowed(&mut host, &[0, 1, 2, 3]).unwrap();
//! assert!(vmhost_topology::render_text(&host).contains("allowed cpus: 0-3"));
//! ```
//!
//! hwlocality is confined to the private `hwloc` module and sysfs reading to `sysfs`; no hwloc
//! type appears in this API.

#![warn(missing_docs)]

pub mod affinity;
mod cgroup;
pub mod cpulist;
mod error;
mod hugepages;
mod hwloc;
pub mod load;
pub mod model;
mod render;
mod sysfs;
#[cfg(target_feature = "crt-static")]
mod udev;

pub use error::{BackendError, TopologyError};
pub use hugepages::{apply_hugepages, parse_hugepages_arg, HugepageArg};
pub use load::{
    discover, load_synthetic, load_xml, refresh_live, restrict_allowed, LOADED_HUGEPAGE_SIZES,
};
pub use model::*;
pub use render::render_text;

/// The hwloc plugins vmhost never needs: I/O discovery (PCI, OpenCL, GL) and the libxml2-based
/// XML reader (hwloc's built-in XML parser reads `lstopo` exports as well).
pub const UNNEEDED_HWLOC_PLUGINS: &str = "hwloc_xml_libxml,hwloc_opencl,hwloc_gl,hwloc_pci";

/// Keeps hwloc from loading plugins vmhost does not use. Loading them (libxml2 with ICU,
/// OpenCL, X11 and libpciaccess) costs about 3 ms and resident memory at every start.
///
/// - Static builds (the default, see docs/dependencies.md): no plugin can load into a binary
///   that exports no hwloc symbols, so hwloc's plugin search is switched off
///   (`HWLOC_PLUGINS_PATH` empty), whatever the environment says.
/// - Dynamic builds: [`UNNEEDED_HWLOC_PLUGINS`] are blacklisted, unless the user set
///   `HWLOC_PLUGINS_BLACKLIST` already.
///
/// Call it at the very start of `main`, before any thread exists: it sets an environment
/// variable, which is only sound while no other thread can read the environment.
pub fn skip_unneeded_hwloc_plugins() {
    if cfg!(target_feature = "crt-static") {
        std::env::set_var("HWLOC_PLUGINS_PATH", "");
    } else if std::env::var_os("HWLOC_PLUGINS_BLACKLIST").is_none() {
        std::env::set_var("HWLOC_PLUGINS_BLACKLIST", UNNEEDED_HWLOC_PLUGINS);
    }
}
