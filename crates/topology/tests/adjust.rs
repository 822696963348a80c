//! Simulating a host on loaded topologies: hugepage pools and a restricted cpuset.

#![allow(clippy::unwrap_used)] // helpers outside #[test] fns panic on bad host data too

use vmhost_topology::{
    apply_hugepages, load_synthetic, parse_hugepages_arg, render_text, restrict_allowed,
    HugepageArg, HugepagePool, TopologyError,
};

const MI2: u64 = 2 << 20;
const GI1: u64 = 1 << 30;

#[test]
fn hugepage_pools_land_on_their_nodes() {
    let mut t = load_synthetic("package:2 numa:1 core:4 pu:2").unwrap();
    let args = parse_hugepages_arg("node0:2Mi=512,node1:1Gi=8,node0:1G=2").unwrap();
    apply_hugepages(&mut t, &args).unwrap();
    assert_eq!(
        t.nodes[0].hugepages,
        [
            HugepagePool {
                page_size_bytes: MI2,
                total: 512,
                free: 512
            },
            HugepagePool {
                page_size_bytes: GI1,
                total: 2,
                free: 2
            }
        ]
    );
    assert_eq!(
        t.nodes[1].hugepages,
        [HugepagePool {
            page_size_bytes: GI1,
            total: 8,
            free: 8
        }]
    );
    assert_eq!(t.free_hugepages(0, MI2), 512);
    assert_eq!(t.free_hugepages(1, MI2), 0);
    let text = render_text(&t);
    assert!(
        text.contains("hugepages: 2Mi 512 total/512 free, 1Gi 2 total/2 free"),
        "{text}"
    );
}

#[test]
fn repeated_node_and_size_last_wins() {
    let mut t = load_synthetic("package:1 numa:1 core:2 pu:1").unwrap();
    apply_hugepages(
        &mut t,
        &parse_hugepages_arg("node0:2Mi=1,node0:2048kB=7").unwrap(),
    )
    .unwrap();
    assert_eq!(
        t.nodes[0].hugepages,
        [HugepagePool {
            page_size_bytes: MI2,
            total: 7,
            free: 7
        }]
    );
    // A later call replaces the pool too.
    apply_hugepages(
        &mut t,
        &[HugepageArg {
            node: 0,
            page_size_bytes: MI2,
            free: 3,
        }],
    )
    .unwrap();
    assert_eq!(t.free_hugepages(0, MI2), 3);
}

#[test]
fn unknown_node_is_named_and_nothing_changes() {
    let mut t = load_synthetic("package:2 numa:1 core:4 pu:2").unwrap();
    let before = t.clone();
    let args = parse_hugepages_arg("node0:2Mi=4,node5:2Mi=512").unwrap();
    let e = apply_hugepages(&mut t, &args).unwrap_err();
    assert!(
        matches!(e, TopologyError::HugepageNode { node: 5, .. }),
        "{e:?}"
    );
    let msg = e.to_string();
    assert!(
        msg.contains("node5") && msg.contains("its nodes: 0-1"),
        "{msg}"
    );
    assert_eq!(t, before, "no partial update");
}

#[test]
fn unsupported_size_is_named() {
    let mut t = load_synthetic("package:1 numa:1 core:2 pu:1").unwrap();
    let e = apply_hugepages(&mut t, &parse_hugepages_arg("node0:4Mi=1").unwrap()).unwrap_err();
    assert!(
        matches!(e, TopologyError::HugepageSize { node: 0, page_size_bytes, .. } if page_size_bytes == 4 << 20),
        "{e:?}"
    );
    assert!(e.to_string().contains("supported: 2Mi, 1Gi"), "{e}");
}

#[test]
fn parse_errors_show_the_item_and_the_expected_form() {
    for (bad, why) in [
        ("nodeA:2Mi=512", "\"nodeA\" is not a node"),
        ("n0:2Mi=512", "\"n0\" is not a node"),
        ("node0:3Xi=512", "\"3Xi\" is not a page size"),
        ("node0:2Mi", "missing '='"),
        ("node0:2Mi=lots", "\"lots\" is not a page count"),
    ] {
        let e = parse_hugepages_arg(&format!("node1:1Gi=1,{bad}")).unwrap_err();
        assert!(
            matches!(&e, TopologyError::ParseHugepages { arg, .. } if arg == bad),
            "{e:?}"
        );
        let msg = e.to_string();
        assert!(msg.contains(why), "{bad}: {msg}");
        assert!(
            msg.contains("node0:2Mi=512"),
            "the message shows an example: {msg}"
        );
    }
}

#[test]
fn restrict_allowed_intersects() {
    let mut t = load_synthetic("package:2 numa:1 core:4 pu:2").unwrap();
    restrict_allowed(&mut t, &[2, 3, 4, 5, 8, 9]).unwrap();
    assert_eq!(t.allowed_cpus, [2, 3, 4, 5, 8, 9]);
    restrict_allowed(&mut t, &[0, 1, 2, 3]).unwrap();
    assert_eq!(t.allowed_cpus, [2, 3]);
    assert_eq!(t.online_cpus.len(), 16, "online CPUs unchanged");
    assert!(render_text(&t).contains("allowed cpus: 2-3"));
}

#[test]
fn restrict_allowed_rejects_unknown_cpu() {
    let mut t = load_synthetic("package:1 numa:1 core:4 pu:1").unwrap();
    let e = restrict_allowed(&mut t, &[1, 4]).unwrap_err();
    assert!(
        matches!(e, TopologyError::RestrictCpu { cpu: 4, .. }),
        "{e:?}"
    );
    assert!(e.to_string().contains("its PUs: 0-3"), "{e}");
    assert_eq!(t.allowed_cpus, [0, 1, 2, 3], "unchanged on error");
}

#[test]
fn render_shows_the_cgroup_limits_next_to_the_pools() {
    let mut t = load_synthetic("package:2 numa:1 core:2 pu:1").unwrap();
    apply_hugepages(
        &mut t,
        &parse_hugepages_arg("node0:2Mi=64,node1:2Mi=64").unwrap(),
    )
    .unwrap();
    let text = render_text(&t);
    assert!(
        text.contains("allowed memory nodes: 0-1 (no cgroup cpuset)"),
        "{text}"
    );
    assert!(!text.contains("hugetlb limit"), "{text}");
    t.allowed_mems = Some(vmhost_topology::AllowedMems {
        nodes: vec![1],
        cgroup: "/pod".into(),
        file: "/sys/fs/cgroup/pod/cpuset.mems.effective".into(),
    });
    t.hugetlb_limits.push(vmhost_topology::HugetlbLimit {
        page_size_bytes: MI2,
        pages: 10,
        cgroup: "/pod".into(),
        file: "/sys/fs/cgroup/pod/hugetlb.2MB.max".into(),
        limit_bytes: 20 << 20,
        usage_bytes: 0,
    });
    assert!(!t.node_allowed(0) && t.node_allowed(1));
    let text = render_text(&t);
    assert!(
        text.contains("allowed memory nodes: 1 of the host's 0-1 (cpuset of cgroup /pod: /sys/fs/cgroup/pod/cpuset.mems.effective)"),
        "{text}"
    );
    assert!(
        text.contains("hugetlb limit 2Mi: 10 pages may still be taken, the nodes have 128 free (cgroup /pod: /sys/fs/cgroup/pod/hugetlb.2MB.max = 20971520 bytes, 0 used)"),
        "{text}"
    );
}
