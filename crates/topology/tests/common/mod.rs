//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use vmhost_topology::HostTopology;

/// A fixture under `tests/fixtures/`.
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// All PUs of the topology (from its cores), ascending.
pub fn all_pus(t: &HostTopology) -> Vec<u32> {
    let mut pus: Vec<u32> = t.cores.iter().flat_map(|c| c.pus.iter().copied()).collect();
    pus.sort_unstable();
    pus
}

/// The invariants every topology from this crate must satisfy.
pub fn check_consistent(t: &HostTopology) {
    let pus = all_pus(t);
    let mut dedup = pus.clone();
    dedup.dedup();
    assert_eq!(pus, dedup, "a PU belongs to two cores");
    let mut node_cpus: Vec<u32> = t
        .nodes
        .iter()
        .flat_map(|n| n.cpus.iter().copied())
        .collect();
    node_cpus.sort_unstable();
    assert_eq!(node_cpus, pus, "node cpus and core PUs differ");
    assert!(
        t.nodes.windows(2).all(|w| w[0].os_index < w[1].os_index),
        "nodes not ascending"
    );
    assert!(
        t.packages.windows(2).all(|w| w[0].os_index < w[1].os_index),
        "packages not ascending"
    );
    for (i, core) in t.cores.iter().enumerate() {
        assert_eq!(core.index as usize, i, "core indexes not dense");
        assert!(
            core.pus.windows(2).all(|w| w[0] < w[1]),
            "core PUs not ascending"
        );
        let node = t.node(core.node).expect("core's node exists");
        assert!(
            core.pus.iter().all(|p| node.cpus.contains(p)),
            "core {i} PUs outside its node"
        );
        let package = t
            .packages
            .iter()
            .find(|p| p.os_index == core.package)
            .expect("core's package exists");
        assert!(
            package.nodes.contains(&core.node),
            "core {i}'s node not in its package"
        );
    }
    for node in &t.nodes {
        assert!(
            t.packages.iter().any(|p| p.nodes.contains(&node.os_index)),
            "node {} in no package",
            node.os_index
        );
        assert!(node
            .hugepages
            .windows(2)
            .all(|w| w[0].page_size_bytes < w[1].page_size_bytes));
    }
    let ids: Vec<u32> = t.nodes.iter().map(|n| n.os_index).collect();
    assert_eq!(t.distances.nodes, ids);
    assert_eq!(t.distances.matrix.len(), ids.len());
    for (i, row) in t.distances.matrix.iter().enumerate() {
        assert_eq!(row.len(), ids.len());
        assert_eq!(row[i], 10, "diagonal of the distance matrix");
    }
    assert!(
        t.online_cpus.iter().all(|c| pus.contains(c)),
        "online cpu outside the topology"
    );
    assert!(
        t.allowed_cpus.iter().all(|c| t.online_cpus.contains(c)),
        "allowed cpu not online"
    );
    assert!(t.hugepage_sizes.windows(2).all(|w| w[0] < w[1]));
    let json = serde_json::to_string(t).expect("serializes");
    let back: HostTopology = serde_json::from_str(&json).expect("deserializes");
    assert_eq!(&back, t, "JSON roundtrip");
}

/// The shape of a topology without memory sizes, hugepages or source: what hwloc's tree says.
pub fn shape(t: &HostTopology) -> impl PartialEq + std::fmt::Debug {
    let nodes: Vec<(u32, Vec<u32>)> = t
        .nodes
        .iter()
        .map(|n| (n.os_index, n.cpus.clone()))
        .collect();
    (t.packages.clone(), nodes, t.cores.clone())
}
