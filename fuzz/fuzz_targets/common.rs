//! Shared by the spec targets: the hosts every fuzzed spec is planned on.

use vmhost_topology::{apply_hugepages, load_synthetic, parse_hugepages_arg, HostTopology};

/// A 1-node host, a 2-node SMT host with 2 MiB and 1 GiB pools, and a 4-node host with uneven
/// pools: small enough to plan quickly, varied enough to reach every placement branch.
pub fn hosts() -> Vec<HostTopology> {
    let mut out = Vec::new();
    for (desc, pools) in [
        ("package:1 numa:1 core:2 pu:1", "node0:2Mi=64"),
        (
            "package:2 numa:1 core:4 pu:2",
            "node0:2Mi=512,node1:2Mi=128,node0:1Gi=2,node1:1Gi=1",
        ),
        (
            "package:2 numa:2 core:2 pu:2",
            "node0:2Mi=16,node1:2Mi=64,node2:2Mi=0,node3:2Mi=256",
        ),
    ] {
        let mut host = load_synthetic(desc).expect("synthetic host");
        let pools = parse_hugepages_arg(pools).expect("pools");
        apply_hugepages(&mut host, &pools).expect("apply pools");
        out.push(host);
    }
    out
}

/// Plans `spec` on every host with both overhead models; a plan or a refusal must serialize.
pub fn plan_everywhere(spec: &vmhost_config::VmSpec, hosts: &[HostTopology]) {
    use vmhost_plan::{plan, OverheadModel, PlanOptions};
    for host in hosts {
        for model in [OverheadModel::Vmhost, OverheadModel::Kubevirt] {
            let opts = PlanOptions {
                overhead_model: model,
                ..PlanOptions::default()
            };
            let outcome = plan(spec, host, &opts);
            let _ = serde_json::to_string(&outcome).expect("a plan serializes");
            let _ = vmhost_plan::render_text(&outcome);
        }
    }
}
