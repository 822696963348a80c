//! End-to-end tests of `vmhost plan`, `vmhost topology` and `vmhost check-target` over
//! synthetic hosts, hwloc XML hosts and this real host.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeSet;

use common::{root, stderr, stdout, vmhost, vmhost_json};
use serde_json::Value;

fn write_spec(name: &str, text: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("vmhost-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

fn host_cpus(j: &Value) -> Vec<u64> {
    j["vcpus"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["host_cpu"].as_u64().unwrap())
        .collect()
}

const DEDICATED_4: &str =
    "[cpu]\ncores = 4\ndedicated_cpu_placement = true\nisolate_emulator_thread = true\n\
     [memory]\nguest = \"1Gi\"\nhugepages = { page_size = \"2Mi\" }\n";

#[test]
fn one_node_without_smt() {
    let spec = write_spec("one-node.toml", DEDICATED_4);
    let (code, j) = vmhost_json(&[
        "plan",
        "--json",
        "--config",
        spec.to_str().unwrap(),
        "--topology",
        "synthetic:package:1 numa:1 core:8 pu:1",
        "--hugepages",
        "node0:2Mi=1024",
    ]);
    assert_eq!(code, 0, "{j}");
    assert_eq!(host_cpus(&j), vec![0, 1, 2, 3]);
    assert_eq!(j["emulator"]["host_cpus"], serde_json::json!([4]));
    assert_eq!(j["envelope"]["cpus"], 5.0);
    assert_eq!(
        j["envelope"]["hugepages"],
        serde_json::json!([{"node": 0, "page_size_bytes": 2097152, "count": 512}])
    );
    assert_eq!(j["guest_cells"][0]["host_node"], 0);
}

#[test]
fn two_sockets_smt2_keeps_guest_threads_on_siblings() {
    let spec = write_spec(
        "smt.toml",
        "[cpu]\ncores = 2\nthreads = 2\ndedicated_cpu_placement = true\n[memory]\nguest = \"1Gi\"\nhugepages = { page_size = \"1Gi\" }\n",
    );
    let (code, topo) = vmhost_json(&[
        "topology",
        "--json",
        "--topology",
        "synthetic:package:2 numa:1 core:4 pu:2",
    ]);
    assert_eq!(code, 0);
    let (code, j) = vmhost_json(&[
        "plan",
        "--json",
        "--config",
        spec.to_str().unwrap(),
        "--topology",
        "synthetic:package:2 numa:1 core:4 pu:2",
        "--hugepages",
        "node0:1Gi=1,node1:1Gi=1",
    ]);
    assert_eq!(code, 0, "{j}");
    let pus = host_cpus(&j);
    for pair in pus.chunks(2) {
        let core = topo["cores"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["pus"].as_array().unwrap().contains(&pair[0].into()))
            .unwrap();
        assert!(
            core["pus"].as_array().unwrap().contains(&pair[1].into()),
            "{pair:?} not siblings"
        );
    }
}

#[test]
fn four_nodes_passthrough_makes_a_cell_per_node_with_host_distances() {
    let xml = root().join("crates/topology/tests/fixtures/synthetic-4node-distances.xml");
    let (code, topo) = vmhost_json(&["topology", "--json", "--topology", xml.to_str().unwrap()]);
    assert_eq!(code, 0, "{topo}");
    let per_node = topo["nodes"][0]["cpus"].as_array().unwrap().len() as u64;
    let spec = write_spec(
        "four.toml",
        &format!(
            "[cpu]\ncores = {}\ndedicated_cpu_placement = true\nnuma = {{ guest_mapping_passthrough = true }}\n\
             [memory]\nguest = \"64Mi\"\nhugepages = {{ page_size = \"2Mi\" }}\n",
            per_node * 2
        ),
    );
    let pools = "node0:2Mi=64,node1:2Mi=64,node2:2Mi=64,node3:2Mi=64";
    let (code, j) = vmhost_json(&[
        "plan",
        "--json",
        "--config",
        spec.to_str().unwrap(),
        "--topology",
        xml.to_str().unwrap(),
        "--hugepages",
        pools,
    ]);
    assert_eq!(code, 0, "{j}");
    let cells = j["guest_cells"].as_array().unwrap();
    assert_eq!(cells.len(), 2);
    let (a, b) = (
        cells[0]["host_node"].as_u64().unwrap(),
        cells[1]["host_node"].as_u64().unwrap(),
    );
    assert!(a < b, "cells numbered in host order");
    // Guest distances are the host's, renumbered.
    let nodes: Vec<u64> = topo["distances"]["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_u64().unwrap())
        .collect();
    let (ia, ib) = (
        nodes.iter().position(|&n| n == a).unwrap(),
        nodes.iter().position(|&n| n == b).unwrap(),
    );
    assert_eq!(
        cells[0]["distances"][1],
        topo["distances"]["matrix"][ia][ib]
    );
    assert_eq!(
        cells[1]["distances"][0],
        topo["distances"]["matrix"][ib][ia]
    );
    assert_eq!(
        cells[0]["memory_bytes"].as_u64().unwrap() + cells[1]["memory_bytes"].as_u64().unwrap(),
        64 << 20
    );
}

#[test]
fn forbidden_and_offline_cpus_are_never_used() {
    let spec = write_spec("forbid.toml", DEDICATED_4);
    let (code, j) = vmhost_json(&[
        "plan",
        "--json",
        "--config",
        spec.to_str().unwrap(),
        "--topology",
        "synthetic:package:1 numa:1 core:8 pu:1",
        "--hugepages",
        "node0:2Mi=1024",
        "--allowed-cpus",
        "1,3,5-7",
    ]);
    assert_eq!(code, 0, "{j}");
    let used: BTreeSet<u64> = host_cpus(&j)
        .into_iter()
        .chain([j["emulator"]["host_cpus"][0].as_u64().unwrap()])
        .collect();
    assert!(used.is_subset(&BTreeSet::from([1, 3, 5, 6, 7])), "{used:?}");
    // The XML fixture whose allowed cpuset excludes PUs 0-3.
    let xml = root().join("crates/topology/tests/fixtures/synthetic-2pkg-smt2-allowed-4-15.xml");
    let (code, j) = vmhost_json(&[
        "plan",
        "--json",
        "--config",
        spec.to_str().unwrap(),
        "--topology",
        xml.to_str().unwrap(),
        "--hugepages",
        "node0:2Mi=1024,node1:2Mi=1024",
    ]);
    assert_eq!(code, 0, "{j}");
    assert!(host_cpus(&j).iter().all(|&c| c >= 4), "{j}");
}

#[test]
fn hugepages_on_one_node_pull_the_vm_there() {
    let spec = write_spec("one-pool.toml", DEDICATED_4);
    let (code, j) = vmhost_json(&[
        "plan",
        "--json",
        "--config",
        spec.to_str().unwrap(),
        "--topology",
        "synthetic:package:2 numa:1 core:8 pu:1",
        "--hugepages",
        "node1:2Mi=600",
    ]);
    assert_eq!(code, 0, "{j}");
    assert!(
        j["vcpus"]
            .as_array()
            .unwrap()
            .iter()
            .all(|v| v["host_node"] == 1),
        "{j}"
    );
    assert_eq!(j["guest_cells"][0]["host_node"], 1);
}

#[test]
fn kubevirt_and_vmhost_models_side_by_side() {
    let yaml = root().join("configs/kubevirt-vmi.yaml");
    let args = |m: &'static str| {
        vec![
            "plan",
            "--json",
            "--config",
            yaml.to_str().unwrap().to_owned().leak(),
            "--overhead-model",
            m,
            "--topology",
            "synthetic:package:1 numa:1 core:2 pu:1",
            "--hugepages",
            "node0:2Mi=64",
        ]
    };
    let (code, kv) = vmhost_json(&args("kubevirt"));
    assert_eq!(code, 0, "{kv}");
    // 128Mi request: page tables = ceil(134217728/1000)*1000/512 = 262144.
    let t = &kv["envelope"]["overhead_terms"];
    assert_eq!(t["page_tables"], 262_144);
    assert_eq!(t["dedicated_cpu_or_guaranteed_qos"], 100 << 20);
    assert!(t.get("video_ram").is_none());
    assert_eq!(
        kv["envelope"]["overhead_bytes"],
        262_144 + (248u64 + 8 + 100) * (1 << 20)
    );
    let (_, vm) = vmhost_json(&args("vmhost"));
    assert!(
        vm["envelope"]["overhead_bytes"].as_u64().unwrap()
            < kv["envelope"]["overhead_bytes"].as_u64().unwrap()
    );
    let o = vmhost(&[
        "plan",
        "--config",
        yaml.to_str().unwrap(),
        "--topology",
        "synthetic:package:1 numa:1 core:2 pu:1",
        "--hugepages",
        "node0:2Mi=64",
    ]);
    // The VMI's only field that changes no resources, `terminationGracePeriodSeconds`, is the
    // shutdown grace now: nothing is ignored.
    assert!(
        !stderr(&o).contains("ignoring KubeVirt fields"),
        "{}",
        stderr(&o)
    );
    let text = stdout(&o);
    for line in [
        "disk cloudinitdisk: cloud-init NoCloud seed, read-write, cache auto (none if the file system takes O_DIRECT) at 0xd0000000, GSI 16",
        "rng: host getrandom at 0xd0001000, GSI 17",
        "virtio devices are attached to Linux guests only",
    ] {
        assert!(text.contains(line), "{line} missing in:\n{text}");
    }
}

#[test]
fn overhead_ratio_is_applied_last() {
    let yaml = root().join("configs/kubevirt-vmi.yaml");
    let (_, j) = vmhost_json(&[
        "plan",
        "--json",
        "--config",
        yaml.to_str().unwrap(),
        "--overhead-model",
        "kubevirt",
        "--overhead-ratio",
        "1.5",
        "--topology",
        "synthetic:package:1 numa:1 core:2 pu:1",
        "--hugepages",
        "node0:2Mi=64",
    ]);
    let base: u64 = 262_144 + (248 + 8 + 100) * (1 << 20);
    assert_eq!(
        j["envelope"]["overhead_terms"]["overhead_ratio"],
        base.div_ceil(1000) / 2 * 1000
    );
}

#[test]
fn this_host_plans_the_embedded_quickstart() {
    let (code, j) = vmhost_json(&["plan", "--json"]);
    assert_eq!(code, 0, "{j}");
    let online = std::fs::read_to_string("/sys/devices/system/cpu/online").unwrap();
    let (code, topo) = vmhost_json(&["topology", "--json"]);
    assert_eq!(code, 0);
    assert_eq!(topo["source"]["kind"], "live");
    let last: u64 = online
        .trim()
        .rsplit(['-', ','])
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(
        topo["online_cpus"].as_array().unwrap().last().unwrap(),
        last
    );
    assert_eq!(j["floating_cpus"], topo["allowed_cpus"]);
    assert_eq!(j["name"], "quickstart");
}

#[test]
fn this_host_rejects_more_dedicated_pus_than_it_has() {
    let n = std::fs::read_dir("/sys/devices/system/cpu")
        .unwrap()
        .filter(|e| {
            let n = e.as_ref().unwrap().file_name();
            let n = n.to_string_lossy();
            n.starts_with("cpu") && n[3..].chars().all(|c| c.is_ascii_digit())
        })
        .count();
    let spec = write_spec("too-big.toml", &format!("[cpu]\ncores = {n}\ndedicated_cpu_placement = true\nisolate_emulator_thread = true\n[memory]\nguest = \"64Mi\"\n"));
    let o = vmhost(&["plan", "--config", spec.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(3));
    assert!(
        stdout(&o).contains(&format!("dedicated placement needs {} PUs", n + 1)),
        "{}",
        stdout(&o)
    );
}

#[test]
fn check_target_reports_a_changed_guest_topology() {
    let spec = write_spec(
        "mig.toml",
        "[cpu]\ncores = 6\ndedicated_cpu_placement = true\nnuma = { guest_mapping_passthrough = true }\n\
         [memory]\nguest = \"64Mi\"\nhugepages = { page_size = \"2Mi\" }\n",
    );
    let src = "synthetic:package:2 numa:1 core:4 pu:1";
    let o = vmhost(&[
        "check-target",
        "--config",
        spec.to_str().unwrap(),
        "--source-topology",
        src,
        "--topology",
        "synthetic:package:1 numa:1 core:8 pu:1",
        "--hugepages",
        "node0:2Mi=64",
    ]);
    assert_eq!(o.status.code(), Some(3), "{}{}", stdout(&o), stderr(&o));
    assert!(
        stdout(&o).contains("the guest topology would change"),
        "{}",
        stdout(&o)
    );
    let (code, j) = vmhost_json(&[
        "check-target",
        "--json",
        "--config",
        spec.to_str().unwrap(),
        "--source-topology",
        src,
        "--topology",
        src,
        "--hugepages",
        "node0:2Mi=64,node1:2Mi=64",
    ]);
    assert_eq!(code, 0, "{j}");
    assert_eq!(j["fits"], true);
    assert!(j["target"]["envelope"]["overhead_bytes"].as_u64().unwrap() > 0);
}

#[test]
fn check_target_keeps_the_guests_cells_and_reports_other_distances() {
    // The source's guest has 2 cells (4 + 2 vCPUs, 10/20 apart); the target has one node with
    // room for both. Refused by default (the guest would see 20 where the host has 10);
    // accepted with --allow-distance-change, both cells on node0 and the difference reported.
    let spec = write_spec(
        "mig-dist.toml",
        "[cpu]\ncores = 6\ndedicated_cpu_placement = true\nnuma = { guest_mapping_passthrough = true }\n\
         [memory]\nguest = \"64Mi\"\nhugepages = { page_size = \"2Mi\" }\n",
    );
    let args = |extra: &[&'static str]| {
        let mut a = vec![
            "check-target",
            "--json",
            "--config",
            spec.to_str().unwrap(),
            "--source-topology",
            "synthetic:package:2 numa:1 core:4 pu:1",
            "--topology",
            "synthetic:package:1 numa:1 core:8 pu:1",
            "--hugepages",
            "node0:2Mi=64",
        ];
        a.extend_from_slice(extra);
        a.iter().map(|s| s.to_string()).collect::<Vec<_>>()
    };
    let strict = args(&[]);
    let (code, j) = vmhost_json(&strict.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(code, 3, "{j}");
    assert_eq!(j["target"]["reason_details"][0]["kind"], "distances", "{j}");
    let loose = args(&["--allow-distance-change"]);
    let (code, j) = vmhost_json(&loose.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(code, 0, "{j}");
    assert_eq!(j["identity"]["cells"].as_array().unwrap().len(), 2);
    let cells = j["target"]["guest_cells"].as_array().unwrap();
    assert!(cells.iter().all(|c| c["host_node"] == 0), "{j}");
    assert_eq!(cells[0]["distances"], serde_json::json!([10, 20]));
    assert_eq!(
        j["target"]["distances"]["host"],
        serde_json::json!([[10, 10], [10, 10]])
    );
    assert_eq!(j["target"]["distances"]["diff"][0]["guest"], 20);
}

#[test]
fn usage_errors_are_clear() {
    let o = vmhost(&["plan", "--topology", "synthetic:bogus:3"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("synthetic"), "{}", stderr(&o));
    let o = vmhost(&["plan", "--hugepages", "node0:2Mi=4"]);
    assert!(
        stderr(&o).contains("--hugepages describes a loaded host"),
        "{}",
        stderr(&o)
    );
    let o = vmhost(&["plan", "--config", "/nonexistent.toml"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("cannot read spec file /nonexistent.toml"),
        "{}",
        stderr(&o)
    );
}
