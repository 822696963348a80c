//! `vmhost bench numa` end to end: results from every vCPU × cell, scenarios that need more
//! nodes than this host has are skipped with the reason, the SVG is written. No timings are
//! asserted.
#![allow(clippy::unwrap_used)]

mod common;

use common::{root, vmhost_json};
use vmhost_testsupport::{lock_cpus, lock_pool, need_kvm, need_pages};

#[test]
fn numa_bench_reports_every_vcpu_and_cell_and_skips_what_the_host_cannot_do() {
    if !need_kvm("numa_bench") {
        return;
    }
    let _cpus = lock_cpus();
    let _pool = lock_pool();
    if !need_pages("numa_bench", 2 << 20, 320) {
        return;
    }
    let svg = std::env::temp_dir().join(format!("vmhost-bench-{}.svg", std::process::id()));
    let spec = root().join("configs/numa-bench.toml");
    let (code, j) = vmhost_json(&[
        "bench",
        "numa",
        "--json",
        "--repeat",
        "1",
        "--scenarios",
        "pinned,remote",
        "--plot",
        svg.to_str().unwrap(),
        "--config",
        spec.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{j}");
    let pinned = &j["scenarios"][0];
    assert_eq!(pinned["scenario"], "pinned");
    let entries = pinned["entries"].as_array().unwrap();
    assert_eq!(entries.len(), 2, "2 vCPUs x 1 cell: {pinned}");
    for e in entries {
        for k in ["latency_ns", "bandwidth_gb_per_s"] {
            for side in ["guest", "host", "ratio"] {
                assert_eq!(e[k][side]["runs"], 1, "{k} {side}: {e}");
                assert!(e[k][side]["median"].as_f64().unwrap() > 0.0);
            }
        }
    }
    let nodes = std::fs::read_dir("/sys/devices/system/node")
        .unwrap()
        .filter(|d| {
            d.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with("node")
        })
        .count();
    if nodes == 1 {
        assert_eq!(
            j["scenarios"][1]["skipped"],
            "needs ≥ 2 NUMA nodes, host has 1"
        );
    }
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(
        text.starts_with("<svg") || text.starts_with("<?xml"),
        "{}",
        &text[..80.min(text.len())]
    );
    assert!(text.contains("latency"), "the SVG names its matrices");
}
