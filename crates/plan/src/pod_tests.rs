//! The planner inside a pod: memory only on the nodes the cgroup's cpuset allows, hugepages
//! within the cgroup's hugetlb limit, and refusals that name the cgroup.

use vmhost_config::{from_toml_str, VmSpec};
use vmhost_topology::{
    apply_hugepages, load_synthetic, parse_hugepages_arg, restrict_allowed, AllowedMems,
    HostTopology, HugetlbLimit,
};

use super::*;

const MI2: u64 = 2 << 20;

fn spec(text: &str) -> VmSpec {
    from_toml_str(text, "t.toml").unwrap().spec
}

fn vm(guest: &str, cpu: &str) -> VmSpec {
    spec(&format!(
        "[cpu]\ncores = 1\n{cpu}\n[memory]\nguest = \"{guest}\"\nhugepages = {{ page_size = \"2Mi\" }}\n"
    ))
}

/// Two nodes of 2 PUs with 64 free 2 MiB pages each.
fn host() -> HostTopology {
    let mut h = load_synthetic("package:2 numa:1 core:2 pu:1").unwrap();
    apply_hugepages(
        &mut h,
        &parse_hugepages_arg("node0:2Mi=64,node1:2Mi=64").unwrap(),
    )
    .unwrap();
    h
}

/// The pod of the emulated-host test: node 0's PUs, memory on node 1 only.
fn pod() -> HostTopology {
    let mut h = host();
    restrict_allowed(&mut h, &[0, 1]).unwrap();
    h.allowed_mems = Some(AllowedMems {
        nodes: vec![1],
        cgroup: "/kubepods/pod-a".into(),
        file: "/sys/fs/cgroup/kubepods/pod-a/cpuset.mems.effective".into(),
    });
    h
}

fn memory_nodes(p: &Plan) -> Vec<Option<u32>> {
    p.guest_cells
        .iter()
        .flat_map(GuestCell::memory_parts)
        .map(|part| part.host_node)
        .collect()
}

#[test]
fn dedicated_memory_goes_to_the_allowed_node_not_the_vcpus_node() {
    let p = plan(
        &vm("64Mi", "dedicated_cpu_placement = true"),
        &pod(),
        &PlanOptions::default(),
    )
    .into_result()
    .unwrap();
    assert!(p.vcpus.iter().all(|v| v.host_node == Some(0)), "{p:?}");
    assert_eq!(memory_nodes(&p), [Some(1)]);
    assert_eq!(p.envelope.hugepages.len(), 1);
    assert_eq!(
        (p.envelope.hugepages[0].node, p.envelope.hugepages[0].count),
        (Some(1), 32)
    );
}

#[test]
fn shared_memory_is_bound_to_the_allowed_node() {
    let p = plan(&vm("64Mi", ""), &pod(), &PlanOptions::default())
        .into_result()
        .unwrap();
    assert_eq!(memory_nodes(&p), [Some(1)]);
    // Without the cgroup the same VM is bound to its floating PUs' node.
    let mut h = host();
    restrict_allowed(&mut h, &[0, 1]).unwrap();
    let p = plan(&vm("64Mi", ""), &h, &PlanOptions::default())
        .into_result()
        .unwrap();
    assert_eq!(memory_nodes(&p), [Some(0)]);
}

#[test]
fn a_vm_too_large_for_the_allowed_node_is_refused_naming_the_cgroup() {
    let spec = vm("256Mi", "dedicated_cpu_placement = true");
    // Without the cpuset the 128 pages fit over both nodes' 64 + 64.
    let mut h = host();
    restrict_allowed(&mut h, &[0, 1]).unwrap();
    assert!(plan(&spec, &h, &PlanOptions::default()).fits);
    let out = plan(&spec, &pod(), &PlanOptions::default());
    assert!(!out.fits);
    let text = out.reasons.join("; ");
    assert!(
        matches!(&out.reason_details[0], Reason::CgroupMems { cgroup, allowed, .. } if cgroup == "/kubepods/pod-a" && *allowed == [1]),
        "{:?}",
        out.reason_details
    );
    assert!(
        text.contains("cgroup /kubepods/pod-a allows memory only on node(s) 1"),
        "{text}"
    );
    assert!(text.contains("64 free 2Mi hugepages"), "{text}");
    assert_eq!(out.reason_details.len(), 1, "{text}");
}

#[test]
fn passthrough_cannot_leave_its_vcpus_node_and_names_the_cgroup() {
    let out = plan(
        &vm(
            "64Mi",
            "dedicated_cpu_placement = true\nnuma = { guest_mapping_passthrough = true }",
        ),
        &pod(),
        &PlanOptions::default(),
    );
    assert!(!out.fits);
    let text = out.reasons.join("; ");
    assert!(text.contains("cgroup /kubepods/pod-a"), "{text}");
}

#[test]
fn hugetlb_limit_caps_the_pages_over_all_nodes() {
    let mut h = host();
    h.hugetlb_limits.push(HugetlbLimit {
        page_size_bytes: MI2,
        pages: 10,
        cgroup: "/kubepods/pod-b".into(),
        file: "/sys/fs/cgroup/kubepods/pod-b/hugetlb.2MB.max".into(),
        limit_bytes: 20 << 20,
        usage_bytes: 0,
    });
    let opts = PlanOptions::default();
    assert!(plan(&vm("20Mi", "dedicated_cpu_placement = true"), &h, &opts).fits);
    let out = plan(&vm("22Mi", "dedicated_cpu_placement = true"), &h, &opts);
    assert_eq!(
        out.reason_details,
        [Reason::HugetlbLimit {
            cgroup: "/kubepods/pod-b".into(),
            file: "/sys/fs/cgroup/kubepods/pod-b/hugetlb.2MB.max".into(),
            page_size_bytes: MI2,
            allowed: 10,
            needed: 11,
        }]
    );
    let text = out.reasons.join("; ");
    assert!(
        text.contains("cgroup /kubepods/pod-b may take only 10 more 2Mi hugepages (/sys/fs/cgroup/kubepods/pod-b/hugetlb.2MB.max minus its usage), the plan needs 11"),
        "{text}"
    );
    // Another page size is not limited by it.
    let spec_1g =
        spec("[cpu]\ncores = 1\n[memory]\nguest = \"1Gi\"\nhugepages = { page_size = \"1Gi\" }\n");
    apply_hugepages(&mut h, &parse_hugepages_arg("node0:1Gi=1").unwrap()).unwrap();
    assert!(plan(&spec_1g, &h, &opts).fits);
}

#[test]
fn anonymous_memory_stays_on_allowed_nodes() {
    let spec =
        spec("[cpu]\ncores = 1\ndedicated_cpu_placement = true\n[memory]\nguest = \"64Mi\"\n");
    let p = plan(&spec, &pod(), &PlanOptions::default())
        .into_result()
        .unwrap();
    assert_eq!(memory_nodes(&p), [Some(1)]);
}
