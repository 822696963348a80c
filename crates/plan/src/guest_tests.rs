//! Tests of planning for a saved guest ([`crate::plan_for_guest`]).
#![allow(clippy::cast_possible_truncation)]

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;
use vmhost_config::{from_toml_str, VmSpec};
use vmhost_topology::{
    apply_hugepages, load_synthetic, parse_hugepages_arg, Distances, HostTopology,
};

use crate::*;

fn spec(text: &str) -> VmSpec {
    from_toml_str(text, "t.toml").unwrap().spec
}

fn host(desc: &str, pools: &str) -> HostTopology {
    let mut h = load_synthetic(desc).unwrap();
    if !pools.is_empty() {
        apply_hugepages(&mut h, &parse_hugepages_arg(pools).unwrap()).unwrap();
    }
    h
}

fn with_distances(mut h: HostTopology, matrix: Vec<Vec<u32>>) -> HostTopology {
    h.distances = Distances {
        nodes: h.nodes.iter().map(|n| n.os_index).collect(),
        matrix,
        assumed: false,
    };
    h
}

/// An AMD-like 4-node host: nodes 0-1 and 2-3 are pairs 16 apart, the pairs 32 apart; node 3
/// sees node 2 at 17 (an asymmetric SLIT entry). 4 cores of 1 PU per node.
fn four_nodes(pools: &str) -> HostTopology {
    with_distances(
        host("package:2 numa:2 core:4 pu:1", pools),
        vec![
            vec![10, 16, 32, 32],
            vec![16, 10, 32, 32],
            vec![32, 32, 10, 16],
            vec![32, 32, 17, 10],
        ],
    )
}

/// 6 vCPUs with NUMA passthrough, 48Mi of 2Mi pages, an isolated emulator.
fn passthrough_vm() -> VmSpec {
    spec(
        "[cpu]\ncores = 6\ndedicated_cpu_placement = true\nisolate_emulator_thread = true\n\
         numa = { guest_mapping_passthrough = true }\n\
         [memory]\nguest = \"48Mi\"\nhugepages = { page_size = \"2Mi\" }\n",
    )
}

fn nodes_of(p: &Plan) -> Vec<Option<u32>> {
    p.guest_cells.iter().map(|c| c.host_node).collect()
}

#[test]
fn cells_land_on_nodes_2_and_3_when_0_and_1_are_full() {
    let s = passthrough_vm();
    let src = four_nodes("node0:2Mi=32,node1:2Mi=32,node2:2Mi=32,node3:2Mi=32");
    let source = plan(&s, &src, &PlanOptions::default())
        .into_result()
        .unwrap();
    assert_eq!(nodes_of(&source), [Some(0), Some(1)]);
    let id = source.guest_identity();
    assert_eq!(id.distance_matrix(), [[10, 16], [16, 10]]);
    // Nodes 0 and 1: every PU held by other VMs (and no pages left on node 0).
    let tgt = four_nodes("node0:2Mi=0,node1:2Mi=32,node2:2Mi=32,node3:2Mi=32");
    let held: BTreeSet<u32> = tgt.nodes[..2].iter().flat_map(|n| n.cpus.clone()).collect();
    let opts = PlanOptions {
        held_cpus: held.clone(),
        ..PlanOptions::default()
    };
    let o = plan_for_guest(&s, &tgt, &id, &opts);
    assert!(o.fits, "{:?}", o.reasons);
    let p = &o.plan;
    assert_eq!(nodes_of(p), [Some(2), Some(3)]);
    assert_eq!(p.guest_identity(), id);
    // The guest keeps 16 both ways; the host has 16 one way and 17 back.
    assert_eq!(p.guest_cells[1].distances, [16, 10]);
    assert_eq!(
        p.distances.host,
        [[Some(10), Some(16)], [Some(17), Some(10)]]
    );
    assert_eq!(
        p.distances.diff,
        [DistanceDiff {
            cells: [1, 0],
            host_nodes: [3, 2],
            guest: 16,
            host: 17
        }]
    );
    assert!(p.vcpus.iter().all(|v| !held.contains(&v.host_cpu.unwrap())));
    assert!(!held.contains(&p.emulator.host_cpus[0]));
    let demand: Vec<(Option<u32>, u64)> = p
        .envelope
        .hugepages
        .iter()
        .map(|h| (h.node, h.count))
        .collect();
    assert_eq!(demand, [(Some(2), 12), (Some(3), 12)]);
    // The same host with everything free: the guest goes back where the distances match.
    let o = plan_for_guest(&s, &src, &id, &PlanOptions::default());
    assert_eq!(nodes_of(&o.plan), [Some(0), Some(1)]);
    assert!(o.plan.distances.diff.is_empty());
}

#[test]
fn same_distances_refuses_naming_the_pairs_and_values() {
    let s = passthrough_vm();
    let src = four_nodes("node0:2Mi=32,node1:2Mi=32,node2:2Mi=32,node3:2Mi=32");
    let id = plan(&s, &src, &PlanOptions::default())
        .into_result()
        .unwrap()
        .guest_identity();
    // Only nodes 1 and 2 have room: 32 apart where the guest was told 16.
    let tgt = four_nodes("node0:2Mi=0,node1:2Mi=32,node2:2Mi=32,node3:2Mi=0");
    let held: BTreeSet<u32> = [0, 3]
        .iter()
        .flat_map(|&n| tgt.nodes[n].cpus.clone())
        .collect();
    let mut opts = PlanOptions {
        held_cpus: held,
        ..PlanOptions::default()
    };
    let loose = plan_for_guest(&s, &tgt, &id, &opts);
    assert!(loose.fits, "{:?}", loose.reasons);
    assert_eq!(nodes_of(&loose.plan), [Some(1), Some(2)]);
    assert_eq!(loose.plan.distances.diff.len(), 2);
    assert!(render_text(&loose).contains("distance differs from the guest's: guest cells 0→1 are 16 apart, their host nodes node1→node2 32"));
    opts.same_distances = true;
    let strict = plan_for_guest(&s, &tgt, &id, &opts);
    assert!(!strict.fits);
    assert_eq!(
        strict.reason_details,
        [Reason::Distances {
            pairs: loose.plan.distances.diff.clone()
        }]
    );
    assert!(
        strict.reasons[0].contains("guest cells 0→1 are 16 apart, their host nodes node1→node2 32")
            && strict.reasons[0]
                .contains("guest cells 1→0 are 16 apart, their host nodes node2→node1 32"),
        "{}",
        strict.reasons[0]
    );
}

#[test]
fn cells_share_a_node_only_when_no_distinct_nodes_have_room() {
    let s = passthrough_vm();
    let src = four_nodes("node0:2Mi=32,node1:2Mi=32,node2:2Mi=32,node3:2Mi=32");
    let id = plan(&s, &src, &PlanOptions::default())
        .into_result()
        .unwrap()
        .guest_identity();
    // The source split 3 + 3 vCPUs, 24Mi + 24Mi. Node 0 has PUs but too few pages for
    // either cell; node 1 has room for both.
    assert_eq!(id.cells[1].memory_bytes, 24 << 20);
    let tgt = host("package:1 numa:2 core:8 pu:1", "node0:2Mi=10,node1:2Mi=24");
    let o = plan_for_guest(&s, &tgt, &id, &PlanOptions::default());
    assert!(o.fits, "{:?}", o.reasons);
    assert_eq!(nodes_of(&o.plan), [Some(1), Some(1)]);
    assert_eq!(o.plan.guest_identity(), id);
    assert!(o.plan.notes.iter().any(|n| n.contains("share a host node")));
    assert_eq!(o.plan.distances.diff.len(), 2, "guest 16 apart, host 10");
    assert_eq!(o.plan.envelope.hugepages[0].count, 24);
    // One page fewer and no node holds both: refused, naming each cell's needs and each
    // node's room.
    let tgt = host("package:1 numa:2 core:8 pu:1", "node0:2Mi=10,node1:2Mi=23");
    let o = plan_for_guest(&s, &tgt, &id, &PlanOptions::default());
    assert!(!o.fits);
    assert!(
        o.reasons[0].contains("cell 0: 3 PUs and 12 2Mi pages; cell 1: 3 PUs and 12 2Mi pages")
            && o.reasons[0].contains(
                "node0: 8 free PUs, 10 free 2Mi pages; node1: 8 free PUs, 23 free 2Mi pages"
            ),
        "{:?}",
        o.reasons
    );
}

#[test]
fn a_spec_that_contradicts_the_guest_is_refused_naming_the_field() {
    let s = passthrough_vm();
    let src = four_nodes("node0:2Mi=32,node1:2Mi=32,node2:2Mi=32,node3:2Mi=32");
    let id = plan(&s, &src, &PlanOptions::default())
        .into_result()
        .unwrap()
        .guest_identity();
    let other = spec(
        "[cpu]\ncores = 4\ndedicated_cpu_placement = true\n\
         [memory]\nguest = \"64Mi\"\nhugepages = { page_size = \"2Mi\" }\n",
    );
    let o = plan_for_guest(&other, &src, &id, &PlanOptions::default());
    assert!(!o.fits);
    let fields: Vec<&str> = o
        .reason_details
        .iter()
        .filter_map(|r| match r {
            Reason::GuestIdentity { field, .. } => Some(field.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(fields, ["cpu.sockets/cores/threads", "memory.guest", "cpu"]);
}

#[test]
fn a_one_cell_guest_keeps_one_cell_on_a_host_where_passthrough_would_split_it() {
    let s = passthrough_vm();
    let src = host("package:1 numa:1 core:8 pu:1", "node0:2Mi=32");
    let id = plan(&s, &src, &PlanOptions::default())
        .into_result()
        .unwrap()
        .guest_identity();
    assert_eq!(id.cells.len(), 1);
    let tgt = four_nodes("node0:2Mi=32,node1:2Mi=32,node2:2Mi=32,node3:2Mi=32");
    assert_eq!(
        plan(&s, &tgt, &PlanOptions::default())
            .plan
            .guest_cells
            .len(),
        2
    );
    let o = plan_for_guest(&s, &tgt, &id, &PlanOptions::default());
    assert!(o.fits, "{:?}", o.reasons);
    assert_eq!(o.plan.guest_identity(), id);
}

#[test]
fn the_cgroups_memory_nodes_bound_where_cells_go() {
    let s = passthrough_vm();
    let all = "node0:2Mi=32,node1:2Mi=32,node2:2Mi=32,node3:2Mi=32";
    let id = plan(&s, &four_nodes(all), &PlanOptions::default())
        .into_result()
        .unwrap()
        .guest_identity();
    let mut tgt = four_nodes(all);
    tgt.allowed_mems = Some(vmhost_topology::AllowedMems {
        nodes: vec![2, 3],
        cgroup: "/pod".into(),
        file: "cpuset.mems.effective".into(),
    });
    let o = plan_for_guest(&s, &tgt, &id, &PlanOptions::default());
    assert!(o.fits, "{:?}", o.reasons);
    assert_eq!(nodes_of(&o.plan), [Some(2), Some(3)]);
    // Only node 3 allowed: its 4 PUs hold one cell of 3 vCPUs, not both. Refused, naming the
    // cgroup.
    tgt.allowed_mems.as_mut().unwrap().nodes = vec![3];
    let o = plan_for_guest(&s, &tgt, &id, &PlanOptions::default());
    assert!(!o.fits);
    assert!(
        matches!(&o.reason_details[0], Reason::CgroupMems { cgroup, allowed, .. } if cgroup == "/pod" && *allowed == [3]),
        "{:?}",
        o.reasons
    );
}

/// A host of 1-4 nodes with random pools, distances and PUs other VMs hold.
fn arb_target() -> impl Strategy<Value = (HostTopology, BTreeSet<u32>)> {
    (
        (1u32..=2, 1u32..=2, 1u32..=4, 1u32..=2),
        proptest::collection::vec(0u64..96, 4),
        proptest::collection::vec(prop_oneof![Just(12u32), Just(16), Just(20), Just(32)], 16),
        (any::<u64>(), any::<u64>()),
    )
        .prop_map(|((pk, nu, co, pu), pools, far, (a, b))| {
            // About one PU in four held by other VMs.
            let held = a & b;
            let h = load_synthetic(&format!("package:{pk} numa:{nu} core:{co} pu:{pu}")).unwrap();
            let n = h.nodes.len();
            let arg: Vec<String> = h
                .nodes
                .iter()
                .zip(&pools)
                .map(|(nd, p)| format!("node{}:2Mi={p}", nd.os_index))
                .collect();
            let mut h = with_distances(
                h,
                (0..n)
                    .map(|i| {
                        (0..n)
                            .map(|j| if i == j { 10 } else { far[i * 4 + j] })
                            .collect()
                    })
                    .collect(),
            );
            apply_hugepages(&mut h, &parse_hugepages_arg(&arg.join(",")).unwrap()).unwrap();
            let held = h
                .allowed_cpus
                .iter()
                .copied()
                .filter(|c| held >> (c % 64) & 1 == 1)
                .collect();
            (h, held)
        })
}

/// A dedicated VM of 2-8 vCPUs, passthrough or not, in 2Mi pages.
fn arb_guest() -> impl Strategy<Value = VmSpec> {
    (1u32..=2, 1u32..=4, 1u32..=2, any::<bool>(), any::<bool>(), 1u64..=8).prop_map(
        |(so, co, th, iso, pt, mem)| {
            spec(&format!(
                "[cpu]\nsockets = {so}\ncores = {co}\nthreads = {th}\ndedicated_cpu_placement = true\n\
                 isolate_emulator_thread = {iso}\nnuma = {{ guest_mapping_passthrough = {pt} }}\n\
                 [memory]\nguest = \"{}Mi\"\nhugepages = {{ page_size = \"2Mi\" }}\n",
                mem * 8
            ))
        },
    )
}

/// Exhaustive check: does some assignment of the saved cells to distinct-or-shared nodes fit
/// the free PUs (the emulator's included) and pages, with equal distances when `same`?
fn some_assignment(
    s: &VmSpec,
    h: &HostTopology,
    held: &BTreeSet<u32>,
    id: &GuestIdentity,
    same: bool,
) -> bool {
    let free = |n: &vmhost_topology::NumaNode| {
        n.cpus
            .iter()
            .filter(|c| h.allowed_cpus.contains(c) && !held.contains(c))
            .count() as u32
    };
    let total: u32 = h.nodes.iter().map(free).sum();
    if total < s.vcpus() + s.emulator_pus() + s.io_pus() {
        return false;
    }
    let k = id.cells.len();
    let n = h.nodes.len();
    (0..n.pow(k as u32)).any(|mut code| {
        let pick: Vec<usize> = (0..k)
            .map(|_| {
                let p = code % n;
                code /= n;
                p
            })
            .collect();
        let mut pus = vec![0u32; n];
        let mut pages = vec![0u64; n];
        for (c, &p) in id.cells.iter().zip(&pick) {
            pus[p] += c.vcpus.len() as u32;
            pages[p] += c.memory_bytes / (2 << 20);
        }
        let room = h.nodes.iter().enumerate().all(|(i, nd)| {
            pus[i] <= free(nd) && pages[i] <= h.free_hugepages(nd.os_index, 2 << 20)
        });
        let equal = !same
            || id.cells.iter().enumerate().all(|(i, c)| {
                c.distances.iter().enumerate().all(|(j, &d)| {
                    d == h.distance(h.nodes[pick[i]].os_index, h.nodes[pick[j]].os_index)
                })
            });
        room && equal
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]
    #[test]
    fn a_guest_planned_elsewhere_keeps_its_identity(
        s in arb_guest(),
        (tgt, held) in arb_target(),
        src_nodes in 1u32..=6,
        same in any::<bool>(),
    ) {
        let pools: Vec<String> = (0..src_nodes).map(|n| format!("node{n}:2Mi=64")).collect();
        // Nodes of 2 PUs: most guests get several cells.
        let src = host(&format!("package:{src_nodes} numa:1 core:1 pu:2"), &pools.join(","));
        let source = plan(&s, &src, &PlanOptions::default());
        prop_assume!(source.fits);
        let id = source.plan.guest_identity();
        let opts = PlanOptions { held_cpus: held.clone(), same_distances: same, ..PlanOptions::default() };
        let o = plan_for_guest(&s, &tgt, &id, &opts);
        if id.cells.len() > 1 {
            let holds = some_assignment(&s, &tgt, &held, &id, same);
            prop_assert_eq!(o.fits, holds, "reasons {:?}", o.reasons);
        }
        if !o.fits {
            return Ok(());
        }
        let p = &o.plan;
        prop_assert_eq!(&p.guest_identity(), &id);
        // The guest keeps its distances; the host's between the chosen nodes are recorded.
        for (i, c) in p.guest_cells.iter().enumerate() {
            prop_assert_eq!(&c.distances, &id.cells[i].distances);
            for (j, d) in c.distances.iter().enumerate() {
                let b = &p.guest_cells[j];
                if let (Some(x), Some(y)) = (c.host_node, b.host_node) {
                    let h = tgt.distance(x, y);
                    prop_assert_eq!(p.distances.host[i][j], Some(h));
                    let listed = p.distances.diff.iter().any(|e| e.cells == [i as u32, j as u32]);
                    prop_assert_eq!(listed, i != j && *d != h);
                }
            }
        }
        if same {
            prop_assert!(p.distances.diff.is_empty());
        }
        // No node gives more pages than it has free, whatever cells share it.
        let mut per_node: BTreeMap<Option<u32>, u64> = BTreeMap::new();
        for part in p.guest_cells.iter().flat_map(GuestCell::memory_parts) {
            *per_node.entry(part.host_node).or_default() += part.memory_bytes / (2 << 20);
        }
        for (node, pages) in per_node {
            let node = node.unwrap_or_else(|| panic!("every cell of a fitting plan is bound: {}", render_text(&o)));
            prop_assert!(pages <= tgt.free_hugepages(node, 2 << 20), "node{} gives {} pages", node, pages);
        }
        // Every vCPU on its own allowed PU that no other VM holds, on its cell's node.
        let used: Vec<u32> = p.vcpus.iter().map(|v| v.host_cpu.expect("pinned")).collect();
        prop_assert_eq!(used.iter().collect::<BTreeSet<_>>().len(), used.len());
        for v in &p.vcpus {
            let pu = v.host_cpu.expect("pinned");
            prop_assert!(tgt.allowed_cpus.contains(&pu) && !held.contains(&pu));
            if p.guest_cells.len() > 1 {
                prop_assert_eq!(v.host_node, p.guest_cells[v.guest_cell as usize].host_node);
            }
        }
        if p.emulator.isolated {
            prop_assert!(p.emulator.host_cpus.iter().all(|e| !used.contains(e) && !held.contains(e)));
        }
    }
}
