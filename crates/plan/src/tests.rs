#![allow(clippy::cast_possible_truncation)]

use std::collections::BTreeSet;

use proptest::prelude::*;
use vmhost_config::{from_toml_str, VmSpec};
use vmhost_topology::{
    apply_hugepages, load_synthetic, parse_hugepages_arg, restrict_allowed, HostTopology,
};

use super::*;

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

fn dedicated(cores: u32, threads: u32, extra: &str) -> String {
    format!(
        "[cpu]\ncores = {cores}\nthreads = {threads}\ndedicated_cpu_placement = true\n{extra}\n[memory]\nguest = \"4Gi\"\nhugepages = {{ page_size = \"1Gi\" }}\n"
    )
}

fn pus(p: &Plan) -> Vec<u32> {
    p.vcpus.iter().map(|v| v.host_cpu.unwrap()).collect()
}

#[test]
fn smt_guest_threads_land_on_sibling_pus() {
    let h = host("package:2 numa:1 core:4 pu:2", "node0:1Gi=8,node1:1Gi=8");
    let p = plan(&spec(&dedicated(2, 2, "")), &h, &PlanOptions::default())
        .into_result()
        .unwrap();
    for pair in pus(&p).chunks(2) {
        let core = h.cores.iter().find(|c| c.pus.contains(&pair[0])).unwrap();
        assert!(
            core.pus.contains(&pair[1]),
            "guest core threads {pair:?} not siblings of {core:?}"
        );
    }
}

#[test]
fn whole_cores_before_fragmented_ones() {
    let mut h = host("package:1 numa:1 core:4 pu:2", "node0:1Gi=8");
    // Core 0 is fragmented: its second PU is forbidden to this process.
    let pu1 = h.cores[0].pus[1];
    let allowed: Vec<u32> = h
        .allowed_cpus
        .iter()
        .copied()
        .filter(|&p| p != pu1)
        .collect();
    restrict_allowed(&mut h, &allowed).unwrap();
    let p = plan(&spec(&dedicated(1, 2, "")), &h, &PlanOptions::default())
        .into_result()
        .unwrap();
    assert_eq!(pus(&p), h.cores[1].pus, "took the fragmented core");
}

#[test]
fn isolated_emulator_on_vcpu0_node_not_on_a_vcpu_pu() {
    let h = host("package:2 numa:1 core:4 pu:2", "node0:1Gi=8,node1:1Gi=8");
    let p = plan(
        &spec(&dedicated(3, 1, "isolate_emulator_thread = true")),
        &h,
        &PlanOptions::default(),
    )
    .into_result()
    .unwrap();
    let emu = p.emulator.host_cpus[0];
    assert!(p.emulator.isolated);
    assert!(!pus(&p).contains(&emu));
    assert_eq!(h.node_of_cpu(emu), p.vcpus[0].host_node);
    // Packing: 3 single-thread vCPUs use core 0 (2 PUs) and half of core 1; the emulator
    // takes core 1's leftover sibling rather than breaking a whole core.
    assert_eq!(emu, h.cores[1].pus[1]);
    assert_eq!(p.envelope.dedicated_cpus, 4);
}

#[test]
fn passthrough_spans_nodes_and_splits_memory() {
    let h = host("package:2 numa:1 core:2 pu:2", "node0:1Gi=8,node1:1Gi=8");
    let s = spec(&dedicated(
        6,
        1,
        "numa = { guest_mapping_passthrough = true }",
    ));
    let p = plan(&s, &h, &PlanOptions::default()).into_result().unwrap();
    assert_eq!(p.guest_cells.len(), 2);
    assert_eq!(p.guest_cells[0].host_node, Some(0));
    assert_eq!(p.guest_cells[1].host_node, Some(1));
    assert_eq!(p.guest_cells[0].vcpus, vec![0, 1, 2, 3]);
    assert_eq!(p.guest_cells[1].vcpus, vec![4, 5]);
    assert_eq!(
        p.guest_cells.iter().map(|c| c.memory_bytes).sum::<u64>(),
        4 << 30
    );
    // In proportion to vCPUs (4 of 6): 2.67 and 1.33 pages → 3 and 1.
    assert_eq!(p.guest_cells[0].memory_bytes, 3 << 30);
    assert_eq!(p.guest_cells[1].memory_bytes, 1 << 30);
    assert_eq!(p.guest_cells[0].distances, vec![10, 20]);
    for v in &p.vcpus {
        assert_eq!(
            Some(v.guest_cell),
            p.guest_cells
                .iter()
                .position(|c| c.host_node == v.host_node)
                .map(|i| i as u32)
        );
    }
    assert_eq!(
        p.envelope.hugepages,
        vec![
            HugepageDemand {
                node: Some(0),
                page_size_bytes: 1 << 30,
                count: 3
            },
            HugepageDemand {
                node: Some(1),
                page_size_bytes: 1 << 30,
                count: 1
            }
        ]
    );
}

#[test]
fn passthrough_split_remainder_goes_to_first_cells() {
    let h = host(
        "package:3 numa:1 core:1 pu:1",
        "node0:2Mi=100,node1:2Mi=100,node2:2Mi=100",
    );
    let s = spec(
        "[cpu]\ncores = 3\ndedicated_cpu_placement = true\nnuma = { guest_mapping_passthrough = true }\n\
         [memory]\nguest = \"64Mi\"\nhugepages = { page_size = \"2Mi\" }\n",
    );
    let p = plan(&s, &h, &PlanOptions::default()).into_result().unwrap();
    let sizes: Vec<u64> = p.guest_cells.iter().map(|c| c.memory_bytes >> 20).collect();
    assert_eq!(sizes, vec![22, 22, 20]);
}

#[test]
fn one_node_when_it_fits_cpus_and_memory() {
    // node0 has the PUs but no hugepages; node1 has both: all vCPUs go to node1.
    let h = host("package:2 numa:1 core:4 pu:1", "node1:1Gi=8");
    let p = plan(&spec(&dedicated(2, 1, "")), &h, &PlanOptions::default())
        .into_result()
        .unwrap();
    assert!(p.vcpus.iter().all(|v| v.host_node == Some(1)));
    assert_eq!(p.guest_cells[0].host_node, Some(1));
}

#[test]
fn hugepage_shortfall_is_exact() {
    // Neither node has 4 free 1Gi pages and both together have 3: the vCPUs go to node1 (more
    // of the memory local), the memory fills node1 then node0, and the rest is reported with
    // the host's total and the node that is short.
    let h = host("package:2 numa:1 core:4 pu:2", "node0:1Gi=1,node1:1Gi=2");
    let o = plan(&spec(&dedicated(2, 1, "")), &h, &PlanOptions::default());
    assert!(!o.fits);
    assert_eq!(
        o.reasons,
        vec![
            "the host has 3 free 1Gi hugepages in all, the plan needs 4".to_string(),
            "node1 has 2 free 1Gi hugepages, the plan needs 3".to_string()
        ]
    );
}

#[test]
fn memory_larger_than_a_node_spans_nodes_without_passthrough() {
    // Issue 17 #3: 2 free pages on node0, 3 on node1, 4 wanted: the vCPUs stay on one node,
    // the memory is split and bound per node, and a note says how much sits where.
    let h = host("package:2 numa:1 core:4 pu:2", "node0:1Gi=2,node1:1Gi=3");
    let p = plan(&spec(&dedicated(2, 1, "")), &h, &PlanOptions::default())
        .into_result()
        .unwrap();
    let node = p.vcpus[0].host_node.unwrap();
    assert!(p.vcpus.iter().all(|v| v.host_node == Some(node)));
    let c = &p.guest_cells[0];
    assert_eq!(p.guest_cells.len(), 1);
    assert_eq!(c.host_node, None);
    let parts: Vec<(Option<u32>, u64)> = c
        .memory_parts()
        .iter()
        .map(|m| (m.host_node, m.memory_bytes >> 30))
        .collect();
    // The vCPUs' node is filled first.
    let expect = if node == 0 {
        vec![(Some(0), 2), (Some(1), 2)]
    } else {
        vec![(Some(0), 1), (Some(1), 3)]
    };
    assert_eq!(parts, expect);
    assert!(c.spans.iter().all(|s| !s.prefault_cpus.is_empty()
        && s.prefault_cpus
            .iter()
            .all(|&pu| h.node_of_cpu(pu) == Some(s.host_node))));
    assert!(
        p.notes
            .iter()
            .any(|n| n.contains("the guest sees one NUMA node while its memory spans host nodes")),
        "{:?}",
        p.notes
    );
    let demand: u64 = p.envelope.hugepages.iter().map(|d| d.count).sum();
    assert_eq!(demand, 4);
}

#[test]
fn memory_moves_the_vcpus_to_the_node_with_pages() {
    let h = host("package:2 numa:1 core:4 pu:2", "node0:1Gi=2,node1:1Gi=4");
    let p = plan(&spec(&dedicated(2, 1, "")), &h, &PlanOptions::default())
        .into_result()
        .unwrap();
    assert!(p.vcpus.iter().all(|v| v.host_node == Some(1)));
}

#[test]
fn missing_page_size_is_reported() {
    let mut h = host("package:1 numa:1 core:2 pu:1", "");
    h.hugepage_sizes = vec![2 << 20];
    let o = plan(&spec(&dedicated(1, 1, "")), &h, &PlanOptions::default());
    assert_eq!(
        o.reasons,
        vec!["the host kernel has no 1Gi hugepages (sizes: 2Mi)".to_string()]
    );
}

#[test]
fn too_few_pus_is_exact() {
    let h = host("package:1 numa:1 core:2 pu:1", "node0:1Gi=8");
    let o = plan(
        &spec(&dedicated(2, 1, "isolate_emulator_thread = true")),
        &h,
        &PlanOptions::default(),
    );
    assert_eq!(
        o.reasons,
        vec!["dedicated placement needs 3 PUs (2 vCPUs + 1 isolated emulator thread), the host allows 2 free".to_string()]
    );
    assert!(o.plan.vcpus.iter().all(|v| v.host_cpu.is_none()));
}

#[test]
fn held_pus_are_avoided() {
    let h = host("package:1 numa:1 core:4 pu:1", "node0:1Gi=8");
    let opts = PlanOptions {
        held_cpus: BTreeSet::from([0, 1]),
        ..Default::default()
    };
    let p = plan(&spec(&dedicated(2, 1, "")), &h, &opts)
        .into_result()
        .unwrap();
    assert_eq!(pus(&p), vec![2, 3]);
    let shared = plan(
        &spec("[cpu]\ncores = 8\n[memory]\nguest = \"1Gi\"\n"),
        &h,
        &opts,
    )
    .into_result()
    .unwrap();
    assert_eq!(shared.floating_cpus, vec![2, 3]);
}

#[test]
fn shared_vm_floats_and_describes_big_topology() {
    let h = host("package:1 numa:1 core:2 pu:1", "");
    let p = plan(
        &spec("[cpu]\nsockets = 2\ncores = 4\nthreads = 2\n[memory]\nguest = \"256Mi\"\n"),
        &h,
        &PlanOptions::default(),
    )
    .into_result()
    .unwrap();
    assert_eq!(p.vcpus.len(), 16);
    assert!(p.vcpus.iter().all(|v| v.host_cpu.is_none()));
    assert_eq!(p.floating_cpus, vec![0, 1]);
    assert_eq!(
        p.guest_cells[0].host_node,
        Some(0),
        "one-node host: memory bound to it"
    );
    // APIC IDs: thread bit 0, core bits 1-2, socket bit 3.
    let v = &p.vcpus[13]; // socket 1, core 2, thread 1
    assert_eq!((v.socket, v.core, v.thread, v.apic_id), (1, 2, 1, 0b1101));
}

#[test]
fn apic_ids_pad_non_power_of_two_fields() {
    let h = host("package:1 numa:1 core:2 pu:1", "");
    let p = plan(
        &spec("[cpu]\nsockets = 2\ncores = 3\n[memory]\nguest = \"256Mi\"\n"),
        &h,
        &PlanOptions::default(),
    )
    .into_result()
    .unwrap();
    let ids: Vec<u32> = p.vcpus.iter().map(|v| v.apic_id).collect();
    assert_eq!(ids, vec![0, 1, 2, 4, 5, 6]);
}

#[test]
fn four_nodes_passthrough_numbering_follows_host_order() {
    let h = host(
        "package:2 numa:2 core:2 pu:1",
        "node0:2Mi=64,node1:2Mi=64,node2:2Mi=64,node3:2Mi=64",
    );
    let s = spec(
        "[cpu]\ncores = 6\ndedicated_cpu_placement = true\nnuma = { guest_mapping_passthrough = true }\n\
         [memory]\nguest = \"96Mi\"\nhugepages = { page_size = \"2Mi\" }\n",
    );
    let p = plan(&s, &h, &PlanOptions::default()).into_result().unwrap();
    let nodes: Vec<Option<u32>> = p.guest_cells.iter().map(|c| c.host_node).collect();
    assert_eq!(nodes, vec![Some(0), Some(1), Some(2)]);
    assert!(p.guest_cells.iter().all(|c| c.vcpus.len() == 2));
}

#[test]
fn kubevirt_model_in_plan_json() {
    let h = host("package:1 numa:1 core:4 pu:1", "node0:2Mi=1024");
    let s = spec("[cpu]\ncores = 2\n[resources.requests]\nmemory = \"1Gi\"\n");
    let o = plan(
        &s,
        &h,
        &PlanOptions {
            overhead_model: OverheadModel::Kubevirt,
            ..Default::default()
        },
    );
    let j = serde_json::to_value(&o).unwrap();
    assert_eq!(j["fits"], true);
    assert_eq!(j["envelope"]["overhead_terms"]["page_tables"], 2_097_152);
    assert_eq!(j["envelope"]["guest_memory_bytes"], 1u64 << 30);
    assert!(j["vcpus"][0]["host_cpu"].is_null());
    assert!(j["emulator"]["host_cpus"].is_array());
    assert!(j["guest_cells"][0]["memory_bytes"].is_u64());
    assert!(j["reasons"].as_array().unwrap().is_empty());
}

#[test]
fn target_with_fewer_nodes_changes_guest_topology() {
    let src = host("package:2 numa:1 core:2 pu:1", "node0:1Gi=8,node1:1Gi=8");
    let tgt = host("package:1 numa:1 core:8 pu:1", "node0:1Gi=8");
    let s = spec(&dedicated(
        4,
        1,
        "numa = { guest_mapping_passthrough = true }",
    ));
    let c = check_target(&s, &src, &tgt, &PlanOptions::default());
    assert!(!c.fits);
    assert!(c.reasons[0].contains("1 NUMA cell"), "{:?}", c.reasons);
    let same = check_target(&s, &src, &src, &PlanOptions::default());
    assert!(same.fits, "{:?}", same.reasons);
}

fn arb_host() -> impl Strategy<Value = HostTopology> {
    (1u32..=2, 1u32..=2, 1u32..=4, 1u32..=2, 0u64..64, 0u64..4).prop_map(
        |(pk, nu, co, pu, small, big)| {
            let mut h =
                load_synthetic(&format!("package:{pk} numa:{nu} core:{co} pu:{pu}")).unwrap();
            let pools: Vec<String> = h
                .nodes
                .iter()
                .flat_map(|n| {
                    [
                        format!("node{}:2Mi={small}", n.os_index),
                        format!("node{}:1Gi={big}", n.os_index),
                    ]
                })
                .collect();
            apply_hugepages(&mut h, &parse_hugepages_arg(&pools.join(",")).unwrap()).unwrap();
            h
        },
    )
}

fn arb_spec() -> impl Strategy<Value = VmSpec> {
    (1u32..=2, 1u32..=4, 1u32..=2, any::<bool>(), any::<bool>(), any::<bool>(), 1u64..=16, any::<bool>()).prop_map(
        |(so, co, th, ded, iso, pt, mem, big)| {
            let page = if big { "1Gi" } else { "2Mi" };
            let mem = if big { format!("{}Gi", mem.min(4)) } else { format!("{}Mi", mem * 8) };
            spec(&format!(
                "[cpu]\nsockets = {so}\ncores = {co}\nthreads = {th}\ndedicated_cpu_placement = {ded}\n\
                 isolate_emulator_thread = {}\nnuma = {{ guest_mapping_passthrough = {} }}\n\
                 [memory]\nguest = \"{mem}\"\nhugepages = {{ page_size = \"{page}\" }}\n",
                iso && ded,
                pt && ded
            ))
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]
    #[test]
    fn plan_invariants(h in arb_host(), s in arb_spec()) {
        let o = plan(&s, &h, &PlanOptions::default());
        let p = &o.plan;
        prop_assert_eq!(p.guest_cells.iter().map(|c| c.memory_bytes).sum::<u64>(), s.memory.guest_bytes);
        prop_assert_eq!(p.vcpus.len() as u32, s.vcpus());
        if !o.fits {
            return Ok(());
        }
        let used: Vec<u32> = p.vcpus.iter().filter_map(|v| v.host_cpu).collect();
        let set: BTreeSet<u32> = used.iter().copied().collect();
        prop_assert_eq!(set.len(), used.len(), "a PU used twice: {:?}", used);
        for u in &used {
            prop_assert!(h.allowed_cpus.contains(u));
        }
        if p.emulator.isolated {
            for e in &p.emulator.host_cpus {
                prop_assert!(!set.contains(e), "emulator PU {} is a vCPU PU", e);
            }
        }
        if s.cpu.dedicated_cpu_placement {
            prop_assert_eq!(used.len() as u32, s.vcpus());
        }
        if s.cpu.numa_passthrough {
            for c in &p.guest_cells {
                for v in &c.vcpus {
                    prop_assert_eq!(p.vcpus[*v as usize].host_node, c.host_node);
                }
            }
        }
        for d in &p.envelope.hugepages {
            let free = match d.node {
                Some(n) => h.free_hugepages(n, d.page_size_bytes),
                None => h.nodes.iter().map(|n| h.free_hugepages(n.os_index, d.page_size_bytes)).sum(),
            };
            prop_assert!(d.count <= free);
        }
        let pages: u64 = p.envelope.hugepages.iter().map(|d| d.count * d.page_size_bytes).sum();
        prop_assert_eq!(pages, s.memory.guest_bytes);
    }
}

#[test]
fn guest_sockets_align_with_host_nodes_when_spanning() {
    let h = host("package:2 numa:1 core:4 pu:2", "node0:1Gi=8,node1:1Gi=8");
    let s = spec(
        "[cpu]\nsockets = 2\ncores = 3\nthreads = 2\ndedicated_cpu_placement = true\nisolate_emulator_thread = true\n\
         numa = { guest_mapping_passthrough = true }\n[memory]\nguest = \"8Gi\"\nhugepages = { page_size = \"1Gi\" }\n",
    );
    let p = plan(&s, &h, &PlanOptions::default()).into_result().unwrap();
    for v in &p.vcpus {
        assert_eq!(
            v.host_node,
            Some(v.socket),
            "vCPU {} of socket {} on node {:?}",
            v.vcpu,
            v.socket,
            v.host_node
        );
        assert_eq!(v.guest_cell, v.socket);
    }
    assert_eq!(h.node_of_cpu(p.emulator.host_cpus[0]), Some(0));
}

#[test]
fn realtime_hint_only_when_vcpu_pus_are_exclusive() {
    // Issue 15 #2: dedicated placement alone leaves the emulator, API and signal threads on
    // the vCPU PUs, so the guest must not be told its vCPUs are never preempted.
    let h = host("package:1 numa:1 core:4 pu:1", "node0:1Gi=8");
    let shared_emu = plan(&spec(&dedicated(2, 1, "")), &h, &PlanOptions::default())
        .into_result()
        .unwrap();
    assert!(!shared_emu.vcpu_pus_exclusive());
    let isolated = plan(
        &spec(&dedicated(2, 1, "isolate_emulator_thread = true")),
        &h,
        &PlanOptions::default(),
    )
    .into_result()
    .unwrap();
    assert!(isolated.vcpu_pus_exclusive());
    let floating = plan(
        &spec("[cpu]\ncores = 2\n[memory]\nguest = \"1Gi\"\n"),
        &h,
        &PlanOptions::default(),
    )
    .into_result()
    .unwrap();
    assert!(!floating.vcpu_pus_exclusive());
}

#[test]
fn issue17_two_nodes_with_five_pages_each_hold_eight() {
    let h = host("package:2 numa:1 core:8 pu:2", "node0:1Gi=5,node1:1Gi=5");
    let base = "[cpu]\ncores = 4\ndedicated_cpu_placement = true\n";
    let mem = "[memory]\nguest = \"8Gi\"\nhugepages = { page_size = \"1Gi\" }\n";
    // With passthrough: two cells of 2 vCPUs + 4Gi, one per node.
    let s = spec(&format!(
        "{base}numa = {{ guest_mapping_passthrough = true }}\n{mem}"
    ));
    let p = plan(&s, &h, &PlanOptions::default()).into_result().unwrap();
    let cells: Vec<(Option<u32>, usize, u64)> = p
        .guest_cells
        .iter()
        .map(|c| (c.host_node, c.vcpus.len(), c.memory_bytes >> 30))
        .collect();
    assert_eq!(cells, vec![(Some(0), 2, 4), (Some(1), 2, 4)]);
    // Without: the vCPUs on one node, the memory over both, bound per node.
    let p = plan(&spec(&format!("{base}{mem}")), &h, &PlanOptions::default())
        .into_result()
        .unwrap();
    assert!(p.vcpus.iter().all(|v| v.host_node == Some(0)));
    let parts: Vec<(Option<u32>, u64)> = p.guest_cells[0]
        .memory_parts()
        .iter()
        .map(|m| (m.host_node, m.memory_bytes >> 30))
        .collect();
    assert_eq!(parts, vec![(Some(0), 5), (Some(1), 3)]);
}

#[test]
fn issue17_sixteen_nodes_spread_over_eight() {
    let mut h = host("package:8 numa:2 core:32 pu:2", "");
    let pools: Vec<String> = (0..16).map(|n| format!("node{n}:1Gi=64")).collect();
    apply_hugepages(&mut h, &parse_hugepages_arg(&pools.join(",")).unwrap()).unwrap();
    let s = spec(
        "[cpu]\nsockets = 4\ncores = 32\nthreads = 2\ndedicated_cpu_placement = true\n\
         numa = { guest_mapping_passthrough = true }\n\
         [memory]\nguest = \"512Gi\"\nhugepages = { page_size = \"1Gi\" }\n",
    );
    let p = plan(&s, &h, &PlanOptions::default()).into_result().unwrap();
    assert_eq!(p.guest_cells.len(), 8);
    for c in &p.guest_cells {
        assert_eq!((c.vcpus.len(), c.memory_bytes >> 30), (32, 64));
    }
    // Every guest core on one host core's siblings.
    for pair in pus(&p).chunks(2) {
        let core = h.cores.iter().find(|c| c.pus.contains(&pair[0])).unwrap();
        assert!(core.pus.contains(&pair[1]));
    }
}

#[test]
fn passthrough_refusal_names_totals_and_the_constraint() {
    let h = host("package:2 numa:1 core:8 pu:2", "node0:1Gi=3,node1:1Gi=3");
    let s = spec(
        "[cpu]\ncores = 4\ndedicated_cpu_placement = true\nnuma = { guest_mapping_passthrough = true }\n\
         [memory]\nguest = \"8Gi\"\nhugepages = { page_size = \"1Gi\" }\n",
    );
    let o = plan(&s, &h, &PlanOptions::default());
    assert!(!o.fits);
    let r = o.reasons.join("\n");
    assert!(r.contains("node0: 16 free PUs, 3 free 1Gi pages"), "{r}");
    assert!(r.contains("6 free 1Gi pages in all"), "{r}");
    assert!(
        r.contains("each guest cell's memory on its vCPUs' node"),
        "{r}"
    );
    assert!(r.contains("lacks 2 pages in all"), "{r}");
}

/// A host whose node 0 has only fragmented cores (one free PU each) and node 1 whole ones.
fn fragmented_node0() -> HostTopology {
    let mut h = host("package:2 numa:1 core:4 pu:2", "node0:1Gi=8,node1:1Gi=8");
    let allowed: Vec<u32> = h
        .cores
        .iter()
        .flat_map(|c| {
            if c.node == 0 {
                vec![c.pus[0]]
            } else {
                c.pus.clone()
            }
        })
        .collect();
    restrict_allowed(&mut h, &allowed).unwrap();
    h
}

#[test]
fn smt_guest_prefers_the_node_with_whole_cores() {
    let h = fragmented_node0();
    let p = plan(&spec(&dedicated(2, 2, "")), &h, &PlanOptions::default())
        .into_result()
        .unwrap();
    assert!(
        p.vcpus.iter().all(|v| v.host_node == Some(1)),
        "{:?}",
        pus(&p)
    );
    assert!(!p.notes.iter().any(|n| n.contains("span host cores")));
}

#[test]
fn guest_cores_spanning_host_cores_are_always_noted() {
    // Only fragmented PUs: 4 on node0, 4 on node1; a 2×2 guest spans host cores.
    let mut h = host("package:2 numa:1 core:4 pu:2", "node0:1Gi=8,node1:1Gi=8");
    let allowed: Vec<u32> = h.cores.iter().map(|c| c.pus[0]).collect();
    restrict_allowed(&mut h, &allowed).unwrap();
    let p = plan(&spec(&dedicated(2, 2, "")), &h, &PlanOptions::default())
        .into_result()
        .unwrap();
    assert!(
        p.notes.iter().any(|n| n.contains("span host cores")),
        "{:?}",
        p.notes
    );
    // Spanning nodes without room for whole guest cores: noted too.
    let p = plan(&spec(&dedicated(3, 2, "")), &h, &PlanOptions::default())
        .into_result()
        .unwrap();
    assert!(
        p.notes.iter().any(|n| n.contains("span host cores")),
        "{:?}",
        p.notes
    );
}

#[test]
fn even_parity_gives_the_emulator_a_sibling_or_refuses() {
    let h = host("package:1 numa:1 core:4 pu:2", "node0:1Gi=8");
    let iso = "isolate_emulator_thread = true\nemulator_thread_complete_to_even_parity = true";
    let p = plan(&spec(&dedicated(2, 1, iso)), &h, &PlanOptions::default())
        .into_result()
        .unwrap();
    assert_eq!(p.emulator.host_cpus.len(), 2);
    assert_eq!(p.envelope.dedicated_cpus, 4);
    let core = h
        .cores
        .iter()
        .find(|c| c.pus.contains(&p.emulator.host_cpus[0]))
        .unwrap();
    assert!(core.pus.contains(&p.emulator.host_cpus[1]), "siblings");
    // Odd vCPUs: one PU completes the parity.
    let p = plan(&spec(&dedicated(3, 1, iso)), &h, &PlanOptions::default())
        .into_result()
        .unwrap();
    assert_eq!(p.emulator.host_cpus.len(), 1);
    // 6 vCPUs + 2 = 8 fits 8 PUs; 8 vCPUs + 2 does not (KubeVirt refuses too).
    assert!(plan(&spec(&dedicated(6, 1, iso)), &h, &PlanOptions::default()).fits);
    let o = plan(&spec(&dedicated(8, 1, iso)), &h, &PlanOptions::default());
    assert_eq!(
        o.reasons,
        vec!["dedicated placement needs 10 PUs (8 vCPUs + 2 PUs of the isolated emulator thread (even parity)), the host allows 8 free".to_string()]
    );
}

#[test]
fn memory_not_whole_pages_is_rounded_up_with_a_note() {
    let h = host("package:1 numa:1 core:4 pu:1", "");
    let p = plan(
        &spec("[cpu]\ncores = 1\n[memory]\nguest = \"1G\"\n"),
        &h,
        &PlanOptions::default(),
    )
    .into_result()
    .unwrap();
    assert_eq!(p.guest_cells[0].memory_bytes, 1_000_001_536);
    assert_eq!(p.envelope.guest_memory_bytes, 1_000_001_536);
    assert!(p
        .notes
        .iter()
        .any(|n| n.contains("not a whole number of 4Ki pages")));
}

#[test]
fn realtime_mask_is_in_the_plan() {
    let h = host("package:1 numa:1 core:4 pu:1", "node0:1Gi=8");
    let p = plan(
        &spec(&dedicated(
            3,
            1,
            "isolate_emulator_thread = true\nrealtime = { mask = \"0-2,^1\" }",
        )),
        &h,
        &PlanOptions::default(),
    )
    .into_result()
    .unwrap();
    assert_eq!(p.realtime.as_ref().unwrap().vcpus, vec![0, 2]);
    assert!(p.vcpu_pus_exclusive());
}

#[test]
fn check_target_compares_cells_under_the_proportional_rule() {
    // Source: 6 + 2 vCPUs over two nodes → 6Gi + 2Gi. A target whose nodes hold 4 PUs each
    // splits 4 + 4 → 4Gi + 4Gi: the guest topology would change.
    let src = host("package:2 numa:1 core:6 pu:1", "node0:1Gi=8,node1:1Gi=8");
    let src_held = PlanOptions::default();
    let tgt = host("package:2 numa:1 core:4 pu:1", "node0:1Gi=8,node1:1Gi=8");
    let s = spec(
        "[cpu]\ncores = 8\ndedicated_cpu_placement = true\nnuma = { guest_mapping_passthrough = true }\n\
         [memory]\nguest = \"8Gi\"\nhugepages = { page_size = \"1Gi\" }\n",
    );
    let src_plan = plan(&s, &src, &src_held).into_result().unwrap();
    let mem: Vec<u64> = src_plan
        .guest_cells
        .iter()
        .map(|c| c.memory_bytes >> 30)
        .collect();
    assert_eq!(mem, vec![6, 2]);
    let c = check_target(&s, &src, &tgt, &PlanOptions::default());
    assert!(!c.fits, "{:?}", c.reasons);
    assert!(c.reasons[0].contains("guest topology would change"));
}

/// Exhaustive check: can any node set hold `s` on `h` (passthrough rules when set)?
fn some_set_holds(s: &VmSpec, h: &HostTopology) -> bool {
    let free = placement::FreePus::new(h, &BTreeSet::new());
    let per: Vec<(u32, u32)> = free.per_node(h);
    let t = s.cpu.topology.threads;
    let n = s.vcpus();
    let need = if s.cpu.dedicated_cpu_placement {
        n + s.cpu.emulator_pus()
    } else {
        1
    };
    if free.total() < need {
        return false;
    }
    let page = s
        .memory
        .hugepages
        .as_ref()
        .map_or(4096, |p| p.page_size_bytes);
    let pages = s.memory.guest_ram_bytes() / page;
    let pool = |node: u32| h.free_hugepages(node, page);
    let all: u64 = h.nodes.iter().map(|nd| pool(nd.os_index)).sum();
    if !s.cpu.dedicated_cpu_placement {
        // Shared: memory bound to the floating PUs' node when they are on one, else unbound.
        return match per.as_slice() {
            [(node, _)] => pool(*node) >= pages,
            _ => all >= pages,
        };
    }
    if !s.cpu.numa_passthrough {
        return all >= pages;
    }
    // Every split of the guest cores over the nodes with room, memory in proportion.
    fn rec(
        i: usize,
        left: u32,
        g: &mut Vec<u32>,
        caps: &[u32],
        f: &mut dyn FnMut(&[u32]) -> bool,
    ) -> bool {
        if i == caps.len() {
            return left == 0 && f(g);
        }
        for x in 0..=caps[i].min(left) {
            g.push(x);
            let ok = rec(i + 1, left - x, g, caps, f);
            g.pop();
            if ok {
                return true;
            }
        }
        false
    }
    let caps: Vec<u32> = per.iter().map(|&(_, c)| c / t).collect();
    let mut check = |g: &[u32]| {
        let used: Vec<(u32, u64)> = per
            .iter()
            .zip(g)
            .filter(|(_, &x)| x > 0)
            .map(|(&(node, _), &x)| (node, u64::from(x * t)))
            .collect();
        if used.len() > 1 && pages < used.len() as u64 {
            return false;
        }
        let w: Vec<u64> = used.iter().map(|&(_, v)| v).collect();
        let split = crate::nodeset::split_pages(pages, &w);
        used.iter()
            .zip(split)
            .all(|(&(node, _), p)| p <= pool(node))
    };
    rec(0, n / t, &mut Vec::new(), &caps, &mut check)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]
    #[test]
    fn refuses_only_when_no_node_set_can_hold(
        (pk, nu, co, pu) in (1u32..=2, 1u32..=2, 1u32..=3, 1u32..=2),
        pools in proptest::collection::vec(0u64..6, 4),
        s in arb_spec(),
    ) {
        let mut h = load_synthetic(&format!("package:{pk} numa:{nu} core:{co} pu:{pu}")).unwrap();
        let arg: Vec<String> = h.nodes.iter().zip(&pools)
            .flat_map(|(n, &p)| [format!("node{}:1Gi={p}", n.os_index), format!("node{}:2Mi={}", n.os_index, p * 3)])
            .collect();
        apply_hugepages(&mut h, &parse_hugepages_arg(&arg.join(",")).unwrap()).unwrap();
        let o = plan(&s, &h, &PlanOptions::default());
        let holds = some_set_holds(&s, &h);
        prop_assert_eq!(o.fits, holds, "reasons {:?} notes {:?}", o.reasons, o.plan.notes);
    }
}

/// The plan says how a Linux guest learns its virtio devices: the DSDT by default, the command
/// line with `boot.virtio_announce = "cmdline"` — and never both.
#[test]
fn plan_names_how_virtio_devices_are_announced() {
    let h = host("package:1 numa:1 core:2 pu:1", "");
    let text = |announce: &str| {
        let s = spec(&format!(
            "[memory]\nguest = \"256Mi\"\n[devices]\nrng = {{}}\n[boot]\nkernel = \"/k\"\n{announce}"
        ));
        let o = plan(&s, &h, &PlanOptions::default());
        let text = render_text(&o);
        let p = o.into_result().unwrap();
        (text, p.virtio_acpi_slots().len(), p.virtio_cmdline())
    };
    let (acpi, slots, cmdline) = text("");
    assert!(
        acpi.contains("virtio devices (virtio-mmio, announced in the DSDT as LNRO0005 devices):"),
        "{acpi}"
    );
    assert_eq!((slots, cmdline.as_str()), (1, ""));
    let (cmd, slots, cmdline) = text("virtio_announce = \"cmdline\"\n");
    assert!(
        cmd.contains("announced with virtio_mmio.device= on the command line"),
        "{cmd}"
    );
    assert_eq!(
        (slots, cmdline.as_str()),
        (0, "virtio_mmio.device=4K@0xd0000000:16")
    );
}

/// Regression (found by `refuses_only_when_no_node_set_can_hold`): 6 single-thread vCPUs with
/// passthrough and 4 GiB of 1Gi pages on 4 nodes of 2 PUs and one free page each. Filling the
/// nodes in order gives 2+2+2 cores and one node 2 pages; the spread 2+2+1+1 fits.
#[test]
fn passthrough_spreads_cores_when_filling_in_order_overflows_a_nodes_pages() {
    let mut h = load_synthetic("package:2 numa:2 core:1 pu:2").unwrap();
    apply_hugepages(
        &mut h,
        &parse_hugepages_arg("node0:1Gi=1,node1:1Gi=1,node2:1Gi=1,node3:1Gi=1").unwrap(),
    )
    .unwrap();
    let s = spec(
        "name = \"vm\"\n[cpu]\nsockets = 2\ncores = 3\nthreads = 1\n\
         dedicated_cpu_placement = true\nnuma = { guest_mapping_passthrough = true }\n\
         [memory]\nguest = \"4Gi\"\nhugepages = { page_size = \"1Gi\" }\n",
    );
    let o = plan(&s, &h, &PlanOptions::default());
    assert!(o.fits, "{:?}", o.reasons);
    let mut cells: Vec<(usize, u64)> = o
        .plan
        .guest_cells
        .iter()
        .map(|c| (c.vcpus.len(), c.memory_bytes >> 30))
        .collect();
    cells.sort_unstable();
    assert_eq!(cells, vec![(1, 1), (1, 1), (2, 1), (2, 1)]);
}

const FALLBACK: &str = "[cpu]\ncores = 2\n[memory]\nguest = \"256Mi\"\nhugepages = { page_size = \"2Mi\", fallback = \"normal-pages\" }\n";

#[test]
fn hugepages_fall_back_to_normal_pages_only_when_the_spec_allows_it() {
    let short = host("package:1 numa:2 core:2 pu:1", "node0:2Mi=60,node1:2Mi=60");
    let p = plan(&spec(FALLBACK), &short, &PlanOptions::default())
        .into_result()
        .unwrap();
    assert_eq!(p.backing, Backing::Anonymous);
    assert!(p.envelope.hugepages.is_empty());
    let note = p
        .notes
        .iter()
        .find_map(|n| n.strip_prefix(HUGEPAGE_FALLBACK_NOTE))
        .expect("a fallback note");
    assert!(note.contains("2Mi"), "{note}");
    // Without the fallback the same host refuses the VM, for the pages.
    let strict = FALLBACK.replace(", fallback = \"normal-pages\"", "");
    let r = plan(&spec(&strict), &short, &PlanOptions::default())
        .into_result()
        .unwrap_err();
    assert!(r
        .reasons
        .iter()
        .all(|r| matches!(r, Reason::Hugepages { .. })));
}

#[test]
fn hugepages_are_used_where_the_pool_has_them_even_with_a_fallback() {
    let room = host("package:1 numa:2 core:2 pu:1", "node0:2Mi=16,node1:2Mi=200");
    let p = plan(&spec(FALLBACK), &room, &PlanOptions::default())
        .into_result()
        .unwrap();
    assert!(
        matches!(p.backing, Backing::Hugetlb { page_size_bytes, .. } if page_size_bytes == 2 << 20)
    );
    assert_eq!(
        p.envelope.hugepages.iter().map(|h| h.count).sum::<u64>(),
        128
    );
    assert!(!p
        .notes
        .iter()
        .any(|n| n.starts_with(HUGEPAGE_FALLBACK_NOTE)));
}

#[test]
fn a_fallback_does_not_hide_other_reasons() {
    let tiny = host("package:1 numa:1 core:2 pu:1", "");
    let text = FALLBACK.replace(
        "[cpu]\ncores = 2\n",
        "[cpu]\ncores = 4\ndedicated_cpu_placement = true\n",
    );
    let r = plan(&spec(&text), &tiny, &PlanOptions::default())
        .into_result()
        .unwrap_err();
    assert!(
        r.reasons.iter().any(|r| matches!(r, Reason::Cpus { .. })),
        "{r}"
    );
}

#[test]
fn a_node_set_with_too_few_free_pus_is_never_chosen() {
    // Node 2 has the only pages but 3 free PUs (PU 8 is held) for 4 vCPUs: the planner used
    // to choose it alone and leave vCPU 3 unpinned in a plan that "fit".
    let h = host("package:2 numa:2 core:4 pu:1", "node2:2Mi=4");
    let opts = PlanOptions {
        held_cpus: BTreeSet::from([8]),
        ..PlanOptions::default()
    };
    let s = spec(
        "[cpu]\ncores = 2\nthreads = 2\ndedicated_cpu_placement = true\n\
         [memory]\nguest = \"8Mi\"\nhugepages = { page_size = \"2Mi\" }\n",
    );
    let p = plan(&s, &h, &opts).into_result().unwrap();
    assert!(
        p.vcpus.iter().all(|v| v.host_cpu.is_some()),
        "{:?}",
        p.vcpus
    );
}
