//! hwloc XML topologies through `load_xml`: committed fixtures and a fresh `lstopo` export.

#![allow(clippy::unwrap_used)] // helpers outside #[test] fns panic on bad host data too

mod common;

use std::{path::Path, process::Command};

use common::{check_consistent, fixture, shape};
use vmhost_topology::{discover, load_synthetic, load_xml, TopologyError, TopologySource};

#[test]
fn synthetic_export_loads_like_the_synthetic_description() {
    // Generated with: lstopo --input "package:2 numa:1 core:4 pu:2" --of xml synthetic-2pkg-smt2.xml
    let path = fixture("synthetic-2pkg-smt2.xml");
    let xml = load_xml(&path).unwrap();
    check_consistent(&xml);
    assert_eq!(xml.source, TopologySource::Xml(path.display().to_string()));
    let mut synthetic = load_synthetic("package:2 numa:1 core:4 pu:2").unwrap();
    synthetic.source = xml.source.clone();
    assert_eq!(xml, synthetic);
}

#[test]
fn distance_matrix_is_read_row_by_row() {
    // synthetic "package:2 numa:2 core:2 pu:2" + `hwloc-annotate ... distances` (kind 5 =
    // FROM_OS|MEANS_LATENCY, name NUMALatency), deliberately asymmetric to check orientation.
    let t = load_xml(&fixture("synthetic-4node-distances.xml")).unwrap();
    check_consistent(&t);
    assert!(!t.distances.assumed);
    assert_eq!(t.distances.nodes, [0, 1, 2, 3]);
    assert_eq!(
        t.distances.matrix,
        [
            [10, 12, 32, 33],
            [13, 10, 34, 35],
            [32, 34, 10, 12],
            [33, 35, 13, 10]
        ]
    );
    assert_eq!(t.distance(0, 1), 12);
    assert_eq!(t.distance(1, 0), 13);
    assert!(!vmhost_topology::render_text(&t).contains("assumed"));
}

#[test]
fn allowed_cpuset_of_the_xml_is_kept() {
    // synthetic-2pkg-smt2.xml with the Machine's allowed_cpuset edited to 0x0000fff0.
    let t = load_xml(&fixture("synthetic-2pkg-smt2-allowed-4-15.xml")).unwrap();
    check_consistent(&t);
    assert_eq!(t.cores.len(), 8, "disallowed PUs stay in the tree");
    assert_eq!(t.online_cpus, (0..16).collect::<Vec<_>>());
    assert_eq!(t.allowed_cpus, (4..16).collect::<Vec<_>>());
}

#[test]
fn committed_host_fixture_loads_as_the_machine_it_was_taken_on() {
    // Generated with `lstopo --of xml tests/fixtures/host.xml` on a CI machine of this project
    // (1 package, 1 node, 2 cores, CPUs 0-1). The live host is compared with a fresh export in
    // `fresh_lstopo_export_matches_discover`, so this test holds on any host.
    let xml = load_xml(&fixture("host.xml")).unwrap();
    check_consistent(&xml);
    assert!(
        xml.distances.assumed,
        "a one-node hwloc export has no matrix"
    );
    assert_eq!(
        (xml.packages.len(), xml.nodes.len(), xml.cores.len()),
        (1, 1, 2)
    );
    assert_eq!(xml.nodes[0].cpus, [0, 1]);
    assert_eq!(xml.online_cpus, [0, 1]);
}

#[test]
fn fresh_lstopo_export_matches_discover() {
    let path =
        std::env::temp_dir().join(format!("vmhost-topology-host-{}.xml", std::process::id()));
    let status = Command::new("lstopo")
        .args(["--of", "xml", "-f"])
        .arg(&path)
        .status()
        .expect("lstopo (Debian package `hwloc`) must be installed for this test");
    assert!(status.success(), "lstopo --of xml failed: {status}");
    let xml = load_xml(&path);
    let _ = std::fs::remove_file(&path);
    let xml = xml.unwrap();
    check_consistent(&xml);
    let live = discover().unwrap();
    assert_eq!(shape(&xml), shape(&live));
    assert_eq!(xml.online_cpus, live.online_cpus);
    let total_xml: u64 = xml.nodes.iter().map(|n| n.memory_bytes).sum();
    assert!(total_xml > 0);
}

#[test]
fn missing_file_names_the_path() {
    let path = Path::new("/nonexistent/vmhost/topology.xml");
    let e = load_xml(path).unwrap_err();
    assert!(
        matches!(&e, TopologyError::LoadXml { path: p, .. } if p == path),
        "{e:?}"
    );
    assert!(
        e.to_string().contains("/nonexistent/vmhost/topology.xml"),
        "{e}"
    );
    assert!(e.to_string().contains("lstopo --of xml"), "{e}");
    let source = std::error::Error::source(&e).unwrap();
    assert!(source.to_string().contains("No such file"), "{source}");
}

#[test]
fn non_xml_file_is_rejected_by_hwloc() {
    let path = std::env::temp_dir().join(format!(
        "vmhost-topology-garbage-{}.xml",
        std::process::id()
    ));
    std::fs::write(&path, "this is not hwloc XML\n").unwrap();
    let result = load_xml(&path);
    let _ = std::fs::remove_file(&path);
    let e = result.unwrap_err();
    assert!(
        matches!(&e, TopologyError::LoadXml { path: p, .. } if *p == path),
        "{e:?}"
    );
}
