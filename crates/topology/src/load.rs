//! Building a [`HostTopology`]: from the live host ([`discover`]), from an hwloc XML file
//! ([`load_xml`]) or from an hwloc synthetic description ([`load_synthetic`]).
//!
//! hwloc supplies the tree (through the private `hwloc` module); for the live host, sysfs
//! supplies online CPUs, hugepages and (when hwloc has no matrix) node distances, and
//! `sched_getaffinity` the CPUs this process may use.

use std::path::Path;

use crate::{
    cgroup::{self, Cgroups},
    error::TopologyError,
    hwloc::{self, BackendOrModel, HwlocView},
    model::{Distances, HostTopology, NumaNode, TopologySource},
    sysfs::{self, Sysfs},
};

/// Hugepage sizes assumed for loaded (XML, synthetic) hosts: x86_64's 2 MiB and 1 GiB.
pub const LOADED_HUGEPAGE_SIZES: [u64; 2] = [2 << 20, 1 << 30];

/// Discover the running host through hwloc, sysfs and the process's CPU affinity.
///
/// - nodes, packages, cores and PUs come from hwloc, including CPUs outside this process's
///   cpuset (they appear in the tree but not in `allowed_cpus`);
/// - `online_cpus` is `/sys/devices/system/cpu/online` (hwloc's view if that file is missing);
/// - `allowed_cpus` is `sched_getaffinity` ∩ hwloc's allowed cpuset ∩ online;
/// - hugepage pools per node come from `/sys/devices/system/node/nodeN/hugepages` and the
///   supported sizes from `/sys/kernel/mm/hugepages`;
/// - distances are hwloc's OS latency matrix, else the kernel's `nodeN/distance` files, else
///   assumed 10 local / 20 remote (`assumed: true`);
/// - `allowed_mems` is the cgroup cpuset's effective memory nodes and `hugetlb_limits` the
///   tightest `hugetlb.<size>.max` minus usage of the process's cgroup and its ancestors
///   (a missing file: no limit; an unreadable one: an error naming it).
pub fn discover() -> Result<HostTopology, TopologyError> {
    let view = hwloc::live()?;
    let affinity =
        crate::affinity::process().map_err(|source| TopologyError::Affinity { source })?;
    let mut topo = assemble_live(view, live_sysfs(), &affinity)?;
    read_cgroup_limits(&mut topo)?;
    Ok(topo)
}

/// This host's sysfs.
fn live_sysfs() -> Sysfs<'static> {
    Sysfs {
        root: Path::new(sysfs::ROOT),
    }
}

/// The per-node hugepage pools of `nodes` from `sysfs`.
fn read_pools(nodes: &mut [NumaNode], sysfs: &Sysfs<'_>) -> Result<(), TopologyError> {
    let single_node = nodes.len() == 1;
    for node in nodes {
        node.hugepages = sysfs.node_hugepages(node.os_index, single_node)?;
    }
    Ok(())
}

/// The process's cgroup: its effective memory nodes and hugetlb limits.
fn read_cgroup_limits(topo: &mut HostTopology) -> Result<(), TopologyError> {
    let cgroups = Cgroups {
        membership: Path::new(cgroup::MEMBERSHIP),
        mount: Path::new(cgroup::MOUNT),
    };
    topo.allowed_mems = cgroups.allowed_mems()?;
    topo.hugetlb_limits = cgroups.hugetlb_limits(&topo.hugepage_sizes)?;
    Ok(())
}

/// Reads again what changes on a running host, into a topology [`discover`] built earlier:
/// the per-node hugepage pools (free pages above all), the cgroup's memory nodes and its
/// hugetlb limits. The tree, distances and CPU sets stay as discovered. For a process that
/// discovers the host ahead (a migration target waiting for its source) and admits a VM
/// later. A topology that is not live is left as it is.
pub fn refresh_live(topo: &mut HostTopology) -> Result<(), TopologyError> {
    if topo.source != TopologySource::Live {
        return Ok(());
    }
    read_pools(&mut topo.nodes, &live_sysfs())?;
    read_cgroup_limits(topo)
}

/// Load a topology from an hwloc XML file as `lstopo --of xml FILE` writes it.
///
/// Hugepage pools are empty (see [`crate::apply_hugepages`]), `hugepage_sizes` is
/// [`LOADED_HUGEPAGE_SIZES`], online and allowed CPUs are what the XML's cpusets say (all PUs
/// for a plain export), distances are the XML's latency matrix if it has one, else assumed.
pub fn load_xml(path: &Path) -> Result<HostTopology, TopologyError> {
    let err = |source| TopologyError::LoadXml {
        path: path.to_owned(),
        source,
    };
    let xml = std::fs::read_to_string(path).map_err(|e| err(Box::new(e)))?;
    let origin = format!("hwloc XML {}", path.display());
    let view = hwloc::from_xml(&xml, &origin).map_err(|e| match e {
        BackendOrModel::Backend(source) => err(source),
        BackendOrModel::Model(model) => model,
    })?;
    Ok(assemble_loaded(
        view,
        TopologySource::Xml(path.display().to_string()),
    ))
}

/// Build a topology from an hwloc synthetic description, e.g. `"package:2 numa:1 core:4 pu:2"`
/// or `"package:2 [numa] core:4 pu:2"` (anything `lstopo --input` accepts as synthetic).
///
/// Like [`load_xml`]: no hugepage pools, [`LOADED_HUGEPAGE_SIZES`], all PUs online and allowed,
/// distances assumed. hwloc gives each node a default amount of memory.
pub fn load_synthetic(desc: &str) -> Result<HostTopology, TopologyError> {
    let view = hwloc::from_synthetic(desc).map_err(|e| match e {
        BackendOrModel::Backend(source) => TopologyError::LoadSynthetic {
            description: desc.to_owned(),
            source,
        },
        BackendOrModel::Model(model) => model,
    })?;
    Ok(assemble_loaded(
        view,
        TopologySource::Synthetic(desc.to_owned()),
    ))
}

/// Restrict the CPUs this process may use, to simulate a cpuset or offline CPUs on a loaded
/// host: `allowed_cpus = allowed_cpus ∩ cpus`.
///
/// Every CPU listed must be a PU of the topology.
pub fn restrict_allowed(topo: &mut HostTopology, cpus: &[u32]) -> Result<(), TopologyError> {
    let mut pus: Vec<u32> = topo
        .cores
        .iter()
        .flat_map(|c| c.pus.iter().copied())
        .collect();
    pus.sort_unstable();
    if let Some(&cpu) = cpus.iter().find(|c| pus.binary_search(c).is_err()) {
        return Err(TopologyError::RestrictCpu {
            cpu,
            available: crate::cpulist::format(&pus),
        });
    }
    topo.allowed_cpus.retain(|c| cpus.contains(c));
    Ok(())
}

/// A live topology from hwloc's view plus sysfs and the affinity mask.
fn assemble_live(
    view: HwlocView,
    sysfs: Sysfs<'_>,
    affinity: &[u32],
) -> Result<HostTopology, TopologyError> {
    let online = match sysfs.online_cpus()? {
        Some(sys_online) => intersect(&view.online, &sys_online),
        None => view.online.clone(),
    };
    let allowed = intersect(&intersect(&view.allowed, affinity), &online);
    let node_ids: Vec<u32> = view.nodes.iter().map(|n| n.os_index).collect();
    let mut nodes = view.nodes;
    read_pools(&mut nodes, &sysfs)?;
    let distances = match view.distances {
        Some(d) => d,
        None => match sysfs.node_distances(&node_ids)? {
            Some(matrix) => Distances {
                nodes: node_ids,
                matrix,
                assumed: false,
            },
            None => assumed_distances(&node_ids),
        },
    };
    Ok(HostTopology {
        source: TopologySource::Live,
        packages: view.packages,
        nodes,
        cores: view.cores,
        distances,
        online_cpus: online,
        allowed_cpus: allowed,
        hugepage_sizes: sysfs.hugepage_sizes()?,
        allowed_mems: None,
        hugetlb_limits: Vec::new(),
    })
}

/// A loaded topology: hwloc's view with the defaults for what a file cannot tell.
fn assemble_loaded(view: HwlocView, source: TopologySource) -> HostTopology {
    let node_ids: Vec<u32> = view.nodes.iter().map(|n| n.os_index).collect();
    HostTopology {
        source,
        packages: view.packages,
        nodes: view.nodes,
        cores: view.cores,
        distances: view
            .distances
            .unwrap_or_else(|| assumed_distances(&node_ids)),
        online_cpus: view.online,
        allowed_cpus: view.allowed,
        hugepage_sizes: LOADED_HUGEPAGE_SIZES.to_vec(),
        allowed_mems: None,
        hugetlb_limits: Vec::new(),
    }
}

/// 10 on the diagonal, 20 elsewhere, marked assumed.
fn assumed_distances(nodes: &[u32]) -> Distances {
    let matrix = nodes
        .iter()
        .map(|a| nodes.iter().map(|b| if a == b { 10 } else { 20 }).collect())
        .collect();
    Distances {
        nodes: nodes.to_vec(),
        matrix,
        assumed: true,
    }
}

/// Elements of sorted `a` that are in `b`, ascending.
fn intersect(a: &[u32], b: &[u32]) -> Vec<u32> {
    a.iter().copied().filter(|x| b.contains(x)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn assumed_matrix_is_10_local_20_remote() {
        let d = assumed_distances(&[0, 2]);
        assert_eq!(d.matrix, [[10, 20], [20, 10]]);
        assert!(d.assumed);
    }

    #[test]
    fn live_assembly_intersects_online_allowed_and_affinity() {
        // A 2-node synthetic tree stands in for hwloc's live view; a fake sysfs root without any
        // file stands in for a kernel without NUMA/hugetlb support.
        let view = hwloc::from_synthetic("package:2 numa:1 core:2 pu:1").unwrap();
        let empty = std::env::temp_dir().join("vmhost-topology-empty-sysfs-does-not-exist");
        let topo = assemble_live(view, Sysfs { root: &empty }, &[1, 2, 3, 9]).unwrap();
        assert_eq!(topo.online_cpus, [0, 1, 2, 3]);
        assert_eq!(topo.allowed_cpus, [1, 2, 3]);
        assert!(topo.hugepage_sizes.is_empty());
        assert!(topo.nodes.iter().all(|n| n.hugepages.is_empty()));
        assert!(topo.distances.assumed);
        assert_eq!(topo.source, TopologySource::Live);
    }
}
