//! `vmhost topology --json` against sysfs: nodes, PUs, the distance matrix (asymmetric on
//! the 4-node host) and every node's 2 MiB and 1 GiB pools.

use crate::host;
use crate::vm::{at, num, opt_num, u32s, Env};
use crate::{ensure, Outcome};

/// Every node, its PUs, its distance row and its hugepage pools equal sysfs.
pub fn matches_sysfs(env: &Env) -> Outcome {
    let nodes = host::nodes()?;
    ensure!(
        nodes.len() >= 2,
        "the emulated host has {} NUMA node(s), want ≥ 2",
        nodes.len()
    );
    // Distinct, non-zero 2 MiB pools per node, so a mixed-up node shows.
    let pools: Vec<u64> = (0..nodes.len() as u64).map(|i| 4 + 3 * i).collect();
    host::set_2m_pools(&pools)?;
    let topo = env.run(&["topology", "--json"])?.expect_code(0)?.json()?;

    let reported = at(&topo, "/nodes")?
        .as_array()
        .ok_or("nodes is not an array")?;
    let ids: Vec<u32> = reported
        .iter()
        .filter_map(|n| opt_num(&n["os_index"]))
        .collect();
    ensure!(
        ids == nodes,
        "vmhost reports nodes {ids:?}, sysfs has {nodes:?}"
    );
    for node in reported {
        let id = num(&node["os_index"], "a node's os_index")?;
        let cpus = u32s(&node["cpus"]);
        ensure!(
            cpus == host::node_cpus(id)?,
            "node{id}: vmhost PUs {cpus:?}, sysfs {:?}",
            host::node_cpus(id)?
        );
        let pools = node["hugepages"]
            .as_array()
            .ok_or("hugepages is not an array")?;
        for (kib, name) in [(2048u64, "2 MiB"), (1048576, "1 GiB")] {
            let (total, free) = host::hugepages(id, kib)?;
            let p = pools
                .iter()
                .find(|p| p["page_size_bytes"].as_u64() == Some(kib * 1024))
                .ok_or_else(|| format!("node{id}: no {name} pool in vmhost's report"))?;
            let got = (
                p["total"].as_u64().unwrap_or(u64::MAX),
                p["free"].as_u64().unwrap_or(u64::MAX),
            );
            ensure!(
                got == (total, free),
                "node{id} {name} pool: vmhost (total, free) {got:?}, sysfs {:?}",
                (total, free)
            );
        }
    }
    ensure!(
        at(&topo, "/distances/assumed")?.as_bool() == Some(false),
        "vmhost assumed the distances"
    );
    let matrix = at(&topo, "/distances/matrix")?
        .as_array()
        .ok_or("matrix is not an array")?;
    for (i, &node) in nodes.iter().enumerate() {
        let row = u32s(matrix.get(i).ok_or_else(|| format!("no matrix row {i}"))?);
        let sys = host::distances(node)?;
        ensure!(
            row == sys,
            "distance row of node{node}: vmhost {row:?}, sysfs {sys:?}"
        );
    }
    host::set_2m_pools(&vec![0; nodes.len()])
}
