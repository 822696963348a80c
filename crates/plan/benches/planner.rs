//! Plan time of the node-set search on large synthetic hosts (issue 17 #5).
//!
//! - 16 nodes, 1,024 PUs (`package:8 numa:2 core:32 pu:2`), 64 free 1Gi pages per node: a
//!   4×32×2 passthrough VM with 512Gi (spread over 8 nodes), and the same VM without
//!   passthrough;
//! - 64 nodes, 4,096 PUs (`package:16 numa:4 core:32 pu:2`), 16 free 1Gi pages per node: the
//!   same VM (spread over 32 nodes).
//!
//! Run: `cargo bench -p vmhost-plan --bench planner`.

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use vmhost_config::{from_toml_str, VmSpec};
use vmhost_plan::{plan, PlanOptions};
use vmhost_topology::{apply_hugepages, load_synthetic, parse_hugepages_arg, HostTopology};

fn host(desc: &str, nodes: u32, pages: u64) -> HostTopology {
    let mut h = load_synthetic(desc).expect("synthetic host");
    let pools: Vec<String> = (0..nodes).map(|n| format!("node{n}:1Gi={pages}")).collect();
    apply_hugepages(
        &mut h,
        &parse_hugepages_arg(&pools.join(",")).expect("pools"),
    )
    .expect("apply pools");
    h
}

fn vm(passthrough: bool) -> VmSpec {
    from_toml_str(
        &format!(
            "[cpu]\nsockets = 4\ncores = 32\nthreads = 2\ndedicated_cpu_placement = true\n\
             numa = {{ guest_mapping_passthrough = {passthrough} }}\n\
             [memory]\nguest = \"512Gi\"\nhugepages = {{ page_size = \"1Gi\" }}\n"
        ),
        "bench.toml",
    )
    .expect("valid spec")
    .spec
}

fn bench(c: &mut Criterion) {
    let opts = PlanOptions::default();
    let h16 = host("package:8 numa:2 core:32 pu:2", 16, 64);
    let h64 = host("package:16 numa:4 core:32 pu:2", 64, 16);
    for (name, h, passthrough) in [
        ("16 nodes, passthrough", &h16, true),
        ("16 nodes, one guest cell", &h16, false),
        ("64 nodes, passthrough", &h64, true),
        ("64 nodes, one guest cell", &h64, false),
    ] {
        let spec = vm(passthrough);
        assert!(plan(&spec, h, &opts).fits, "{name}: the VM must fit");
        c.bench_function(name, |b| b.iter(|| plan(black_box(&spec), h, &opts)));
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
