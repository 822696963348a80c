//! The only module that talks to hwloc (through hwlocality): builds a topology from the live
//! host, an XML text or a synthetic description, and converts it to the plain model.
//!
//! Nothing from hwlocality leaves this module; callers get an [`HwlocView`] of model types.

use hwlocality::{
    bitmap::BitmapRef,
    cpu::cpuset::CpuSet,
    object::{
        attributes::ObjectAttributes, distance::DistancesKind, types::ObjectType, TopologyObject,
    },
    topology::{
        builder::{BuildFlags, TopologyBuilder, TypeFilter},
        Topology,
    },
};

use crate::{
    error::{BackendError, TopologyError},
    model::{Core, Distances, NumaNode, Package},
};

/// What hwloc knows about a topology, already in model types.
#[derive(Debug, Clone)]
pub(crate) struct HwlocView {
    /// Packages, ascending by OS index.
    pub packages: Vec<Package>,
    /// NUMA nodes, ascending by OS index, without hugepage pools.
    pub nodes: Vec<NumaNode>,
    /// Cores in hwloc's logical order, numbered densely.
    pub cores: Vec<Core>,
    /// The NUMA latency matrix, when the topology has one covering every node.
    pub distances: Option<Distances>,
    /// PUs hwloc considers present and online (the topology's cpuset), ascending.
    pub online: Vec<u32>,
    /// PUs hwloc considers allowed (its allowed cpuset ∩ online), ascending.
    pub allowed: Vec<u32>,
}

/// Discover the running host.
pub(crate) fn live() -> Result<HwlocView, TopologyError> {
    let err = |e: BackendError| TopologyError::Discover { source: e };
    // hwloc must not rebind this process while discovering: vmhost may already run pinned
    // threads (this disables only hwloc's x86 CPUID backend; Linux sysfs discovery stays).
    let topology = builder(BuildFlags::DONT_CHANGE_BINDING)
        .map_err(err)?
        .build()
        .map_err(|e| err(e.into()))?;
    view(&topology, "the live host")
}

/// Load an hwloc XML document (the text of a file written by `lstopo --of xml`).
///
/// `origin` names the document in errors.
pub(crate) fn from_xml(xml: &str, origin: &str) -> Result<HwlocView, BackendOrModel> {
    let topology = builder(BuildFlags::empty())?
        .from_xml(xml)
        .map_err(boxed)?
        .build()
        .map_err(boxed)?;
    view(&topology, origin).map_err(BackendOrModel::Model)
}

/// Build a topology from an hwloc synthetic description (`"package:2 numa:1 core:4 pu:2"`).
pub(crate) fn from_synthetic(description: &str) -> Result<HwlocView, BackendOrModel> {
    let topology = builder(BuildFlags::empty())?
        .from_synthetic(description)
        .map_err(boxed)?
        .build()
        .map_err(boxed)?;
    view(&topology, &format!("synthetic description {description:?}"))
        .map_err(BackendOrModel::Model)
}

/// A load failure: either hwloc refused the input, or the result does not fit the model.
#[derive(Debug)]
pub(crate) enum BackendOrModel {
    /// hwloc refused the input.
    Backend(BackendError),
    /// The topology loaded but cannot be described by the model.
    Model(TopologyError),
}

impl From<BackendError> for BackendOrModel {
    fn from(e: BackendError) -> Self {
        Self::Backend(e)
    }
}

/// Box any hwlocality error so that its type stays inside this module.
fn boxed<E: std::error::Error + Send + Sync + 'static>(e: E) -> BackendOrModel {
    BackendOrModel::Backend(Box::new(e))
}

/// A builder that keeps disallowed PUs and nodes in the tree, so that the model describes the
/// whole host and the allowed set is reported separately; `extra` flags are added. CPU caches
/// and I/O objects are filtered out: the model has none, and skipping them makes discovery
/// faster (it is on every VM's start-up path).
fn builder(extra: BuildFlags) -> Result<TopologyBuilder, BackendError> {
    Ok(Topology::builder()
        .with_flags(BuildFlags::INCLUDE_DISALLOWED | extra)?
        .with_cpu_cache_type_filter(TypeFilter::KeepNone)?
        .with_cpu_icache_type_filter(TypeFilter::KeepNone)?
        .with_io_type_filter(TypeFilter::KeepNone)?)
}

/// Convert a loaded topology to model types. `origin` names it in errors.
fn view(topology: &Topology, origin: &str) -> Result<HwlocView, TopologyError> {
    let unusable = |reason: String| TopologyError::Unusable {
        origin: origin.to_owned(),
        reason,
    };
    let online = bits(topology.cpuset());
    if online.is_empty() {
        return Err(unusable("it has no online PU".to_owned()));
    }
    let allowed: Vec<u32> = bits(topology.allowed_cpuset())
        .into_iter()
        .filter(|c| online.binary_search(c).is_ok())
        .collect();

    let node_objs = numa_objects(topology, &unusable)?;
    let nodes: Vec<NumaNode> = node_objs
        .iter()
        .map(|(os, obj)| numa_node(*os, obj))
        .collect();
    let packages = packages(topology, &node_objs);
    let cores = cores(topology, &nodes);
    if cores.is_empty() {
        return Err(unusable(
            "it has no core or PU with an online CPU".to_owned(),
        ));
    }
    let distances = latency_matrix(topology, &node_objs);
    Ok(HwlocView {
        packages,
        nodes,
        cores,
        distances,
        online,
        allowed,
    })
}

/// The NUMA node objects with their OS indexes, ascending by OS index.
fn numa_objects<'t>(
    topology: &'t Topology,
    unusable: &dyn Fn(String) -> TopologyError,
) -> Result<Vec<(u32, &'t TopologyObject)>, TopologyError> {
    let mut nodes = Vec::new();
    for obj in topology.objects_with_type(ObjectType::NUMANode) {
        let os = obj
            .os_index()
            .and_then(|i| u32::try_from(i).ok())
            .ok_or_else(|| {
                unusable(format!(
                    "NUMA node L#{} has no OS index",
                    obj.logical_index()
                ))
            })?;
        nodes.push((os, obj));
    }
    if nodes.is_empty() {
        return Err(unusable("it has no NUMA node".to_owned()));
    }
    nodes.sort_by_key(|(os, _)| *os);
    Ok(nodes)
}

/// One NUMA node in model form (no hugepage pools: the caller fills them in).
fn numa_node(os_index: u32, obj: &TopologyObject) -> NumaNode {
    let memory_bytes = match obj.attributes() {
        Some(ObjectAttributes::NUMANode(attr)) => attr.local_memory().map_or(0, |m| m.get()),
        _ => 0,
    };
    NumaNode {
        os_index,
        cpus: obj.cpuset().map(bits).unwrap_or_default(),
        memory_bytes,
        hugepages: Vec::new(),
    }
}

/// An object's OS index, or its logical index when hwloc does not know the OS one.
fn os_or_logical(obj: &TopologyObject) -> u32 {
    let index = obj.os_index().unwrap_or_else(|| obj.logical_index());
    u32::try_from(index).unwrap_or(u32::MAX)
}

/// Packages and the nodes whose PUs (or, for CPU-less nodes, whose position in the tree) sit in
/// them. A topology without Package objects gets one package 0 holding every node.
fn packages(topology: &Topology, nodes: &[(u32, &TopologyObject)]) -> Vec<Package> {
    let mut packages: Vec<Package> = topology
        .objects_with_type(ObjectType::Package)
        .map(|pkg| {
            let nodes = nodes
                .iter()
                .filter(|(_, node)| {
                    let in_tree = node.ancestors().any(|a| std::ptr::eq(a, pkg));
                    let shares_pus = match (node.cpuset(), pkg.cpuset()) {
                        (Some(n), Some(p)) => n.intersects(p),
                        _ => false,
                    };
                    in_tree || shares_pus
                })
                .map(|(os, _)| *os)
                .collect();
            Package {
                os_index: os_or_logical(pkg),
                nodes,
            }
        })
        .collect();
    if packages.is_empty() {
        packages.push(Package {
            os_index: 0,
            nodes: nodes.iter().map(|(os, _)| *os).collect(),
        });
    }
    packages.sort_by_key(|p| p.os_index);
    packages
}

/// Cores with their online PUs, in hwloc's logical order. Cores without an online PU are
/// left out. A topology without Core objects (e.g. synthetic `"package:1 pu:4"`) gets one core
/// per PU.
fn cores(topology: &Topology, nodes: &[NumaNode]) -> Vec<Core> {
    let mut core_objs: Vec<&TopologyObject> =
        topology.objects_with_type(ObjectType::Core).collect();
    if core_objs.is_empty() {
        core_objs = topology.objects_with_type(ObjectType::PU).collect();
    }
    core_objs
        .into_iter()
        .filter_map(|obj| {
            let pus = obj.cpuset().map(bits).unwrap_or_default();
            let first = *pus.first()?;
            let package = obj
                .first_ancestor_with_type(ObjectType::Package)
                .map_or(0, os_or_logical);
            let node = nodes
                .iter()
                .find(|n| n.cpus.binary_search(&first).is_ok())
                .or_else(|| nodes.first())
                .map_or(0, |n| n.os_index);
            Some((package, node, pus))
        })
        .zip(0u32..)
        .map(|((package, node, pus), index)| Core {
            index,
            package,
            node,
            pus,
        })
        .collect()
}

/// The NUMA latency matrix in the order of `nodes`, preferring an OS-provided one (ACPI SLIT).
/// `None` when there is none or it does not cover every node.
fn latency_matrix(topology: &Topology, nodes: &[(u32, &TopologyObject)]) -> Option<Distances> {
    let matrices = topology
        .distances_with_type(Some(DistancesKind::MEANS_LATENCY), ObjectType::NUMANode)
        .ok()?;
    let chosen = matrices
        .iter()
        .find(|d| d.kind().contains(DistancesKind::FROM_OS))
        .or_else(|| matrices.first())?;
    let mut matrix = Vec::with_capacity(nodes.len());
    for (_, from) in nodes {
        let mut row = Vec::with_capacity(nodes.len());
        for (_, to) in nodes {
            let (there, _back) = chosen.object_pair_distance((from, to))?;
            row.push(u32::try_from(there).unwrap_or(u32::MAX));
        }
        matrix.push(row);
    }
    Some(Distances {
        nodes: nodes.iter().map(|(os, _)| *os).collect(),
        matrix,
        assumed: false,
    })
}

/// The set bits of a cpuset (PU OS indexes), ascending.
fn bits(set: BitmapRef<'_, CpuSet>) -> Vec<u32> {
    set.iter_set()
        .filter_map(|i| u32::try_from(i).ok())
        .collect()
}
