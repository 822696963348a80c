//! hwloc synthetic topologies through `load_synthetic`.

#![allow(clippy::unwrap_used)] // helpers outside #[test] fns panic on bad host data too

mod common;

use common::{all_pus, check_consistent};
use vmhost_topology::{load_synthetic, Core, Package, TopologyError, TopologySource};

const MI2: u64 = 2 << 20;
const GI1: u64 = 1 << 30;

#[test]
fn one_package_one_node_no_smt() {
    let desc = "package:1 numa:1 core:4 pu:1";
    let t = load_synthetic(desc).unwrap();
    check_consistent(&t);
    assert_eq!(t.source, TopologySource::Synthetic(desc.to_owned()));
    assert_eq!(
        t.packages,
        [Package {
            os_index: 0,
            nodes: vec![0]
        }]
    );
    assert_eq!(t.nodes.len(), 1);
    assert_eq!(t.nodes[0].cpus, [0, 1, 2, 3]);
    assert!(
        t.nodes[0].memory_bytes > 0,
        "synthetic numa gets hwloc's default memory"
    );
    assert!(t.nodes[0].hugepages.is_empty());
    let expected: Vec<Core> = (0..4)
        .map(|i| Core {
            index: i,
            package: 0,
            node: 0,
            pus: vec![i],
        })
        .collect();
    assert_eq!(t.cores, expected);
    assert_eq!(t.online_cpus, [0, 1, 2, 3]);
    assert_eq!(t.allowed_cpus, [0, 1, 2, 3]);
    assert_eq!(t.hugepage_sizes, [MI2, GI1]);
    assert_eq!(t.distances.matrix, [[10]]);
    assert!(t.distances.assumed);
}

#[test]
fn two_sockets_smt2_one_node_each() {
    let t = load_synthetic("package:2 numa:1 core:4 pu:2").unwrap();
    check_consistent(&t);
    assert_eq!(
        t.packages,
        [
            Package {
                os_index: 0,
                nodes: vec![0]
            },
            Package {
                os_index: 1,
                nodes: vec![1]
            }
        ]
    );
    assert_eq!(t.nodes.len(), 2);
    assert_eq!(t.nodes[0].cpus, (0..8).collect::<Vec<_>>());
    assert_eq!(t.nodes[1].cpus, (8..16).collect::<Vec<_>>());
    assert_eq!(t.cores.len(), 8);
    assert_eq!(all_pus(&t).len(), 16);
    for core in &t.cores {
        let i = core.index;
        assert_eq!(core.pus, [2 * i, 2 * i + 1], "siblings of core {i}");
        assert_eq!(core.node, i / 4, "node of core {i}");
        assert_eq!(core.package, i / 4, "package of core {i}");
    }
    assert_eq!(t.node_of_cpu(9), Some(1));
    assert_eq!(t.online_cpus, (0..16).collect::<Vec<_>>());
    assert_eq!(t.allowed_cpus, t.online_cpus);
    assert!(t.distances.assumed);
    assert_eq!(t.distances.nodes, [0, 1]);
    assert_eq!(t.distances.matrix, [[10, 20], [20, 10]]);
    assert_eq!(t.distance(0, 1), 20);
}

#[test]
fn two_sockets_two_nodes_each() {
    let t = load_synthetic("package:2 numa:2 core:2 pu:2").unwrap();
    check_consistent(&t);
    assert_eq!(
        t.packages,
        [
            Package {
                os_index: 0,
                nodes: vec![0, 1]
            },
            Package {
                os_index: 1,
                nodes: vec![2, 3]
            }
        ]
    );
    assert_eq!(t.nodes.len(), 4);
    for node in &t.nodes {
        let first = node.os_index * 4;
        assert_eq!(
            node.cpus,
            (first..first + 4).collect::<Vec<_>>(),
            "node {}",
            node.os_index
        );
    }
    assert_eq!(t.cores.len(), 8);
    for core in &t.cores {
        assert_eq!(core.node, core.index / 2);
        assert_eq!(core.package, core.index / 4);
        assert_eq!(core.pus.len(), 2);
    }
    assert!(t.distances.assumed);
    assert_eq!(t.distances.matrix.len(), 4);
    assert_eq!(t.distance(3, 3), 10);
    assert_eq!(t.distance(0, 3), 20);
}

#[test]
fn bracket_numa_syntax() {
    let t = load_synthetic("package:2 [numa] core:4 pu:2").unwrap();
    check_consistent(&t);
    assert_eq!(t.nodes.len(), 2);
    assert_eq!(t.cores.len(), 8);
    assert_eq!(t.nodes[1].cpus, (8..16).collect::<Vec<_>>());
}

#[test]
fn node_spanning_packages_is_listed_in_both() {
    let t = load_synthetic("[numa] package:2 core:2 pu:1").unwrap();
    check_consistent(&t);
    assert_eq!(t.nodes.len(), 1);
    assert_eq!(
        t.packages,
        [
            Package {
                os_index: 0,
                nodes: vec![0]
            },
            Package {
                os_index: 1,
                nodes: vec![0]
            }
        ]
    );
    assert_eq!(
        t.cores.iter().map(|c| c.package).collect::<Vec<_>>(),
        [0, 0, 1, 1]
    );
}

#[test]
fn topology_without_cores_gets_one_core_per_pu() {
    let t = load_synthetic("package:1 pu:4").unwrap();
    check_consistent(&t);
    assert_eq!(t.cores.len(), 4);
    assert!(t.cores.iter().all(|c| c.pus.len() == 1));
}

#[test]
fn invalid_description_names_it_and_the_syntax() {
    let e = load_synthetic("bogus:3").unwrap_err();
    assert!(
        matches!(&e, TopologyError::LoadSynthetic { description, .. } if description == "bogus:3"),
        "{e:?}"
    );
    let msg = e.to_string();
    assert!(msg.contains("\"bogus:3\""), "{msg}");
    assert!(msg.contains("package:2 numa:1 core:4 pu:2"), "{msg}");
    assert!(std::error::Error::source(&e).is_some());
    assert!(load_synthetic("").is_err());
    assert!(load_synthetic("core:2\0pu:2").is_err());
}
