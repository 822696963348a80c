//! vmhost inside a pod-like cgroup v2 whose limits are narrower than the node: memory nodes
//! from `cpuset.mems` that are not the PUs' node, and a `hugetlb.2MB.max` below the node's
//! free pool. The plan must follow the cgroup, the pages must land where it allows
//! (`numa_maps`), and a VM the cgroup cannot hold is refused naming it, with no page taken.

use std::path::Path;

use crate::cgroup_tests::{command_in, make_pod_with};
use crate::host;
use crate::vm::{at, dedicated_spec, opt_num, Env};
use crate::{ensure, Outcome};

/// Runs vmhost in the pod and returns its output.
fn run_in(env: &Env, pod: &Path, args: &[&str], what: &str) -> Result<crate::vm::Output, String> {
    crate::vm::run_command(command_in(env, pod, args), what)
}

/// The host nodes of every memory part of the plan (a cell's node, or its spans' nodes).
fn memory_nodes(plan: &serde_json::Value) -> Result<Vec<u32>, String> {
    let mut nodes = Vec::new();
    for cell in at(plan, "/guest_cells")?.as_array().ok_or("guest_cells")? {
        let spans = cell["spans"].as_array().cloned().unwrap_or_default();
        if spans.is_empty() {
            nodes.push(opt_num(&cell["host_node"]).ok_or("a guest cell without a node")?);
        }
        for s in spans {
            nodes.push(opt_num(&s["host_node"]).ok_or("a span without a node")?);
        }
    }
    Ok(nodes)
}

/// A pod with node 0's PUs but only node 1 in `cpuset.mems`: the plan keeps the vCPUs on
/// node 0 and puts the memory on node 1, where `numa_maps` finds every page; a VM whose memory
/// does not fit on node 1 (though it would with node 0) is refused naming the cgroup, with
/// no page taken.
pub fn memory_on_the_pods_node(env: &Env) -> Outcome {
    host::set_2m_pools(&[64, 64])?;
    let node0 = host::node_cpus(0)?;
    let pod = make_pod_with(env, "tbpodmems", &node0, "1")?;
    ensure!(
        host::parse_list(&host::read(
            &pod.join("cpuset.mems.effective").to_string_lossy()
        )?)? == vec![1],
        "the pod's cpuset.mems.effective is not node 1"
    );
    let toml = dedicated_spec("podmems", 1, 1, "", "64Mi", "idle");
    let spec = env.spec("podmems", &toml)?.to_string_lossy().to_string();
    let topo = run_in(env, &pod, &["topology"], "vmhost topology in the pod")?;
    ensure!(
        topo.expect_code(0)?
            .stdout
            .contains("allowed memory nodes: 1 of the host's 0-1 (cpuset of cgroup /tbpodmems"),
        "vmhost topology does not show the pod's memory nodes:\n{}",
        topo.stdout
    );
    let plan = run_in(env, &pod, &["plan", "--json", "--config", &spec], "plan")?;
    let plan = plan.expect_code(0)?.json()?;
    for v in at(&plan, "/vcpus")?.as_array().ok_or("vcpus")? {
        let pu = opt_num(&v["host_cpu"]).ok_or("an unplaced vCPU")?;
        ensure!(
            node0.contains(&pu),
            "vCPU on PU {pu}, the pod has {node0:?}"
        );
    }
    ensure!(
        memory_nodes(&plan)? == vec![1],
        "memory planned on nodes {:?}, the pod allows node 1",
        memory_nodes(&plan)?
    );
    let vm = env.start("podmems", command_in(env, &pod, &["--config", &spec]), 1)?;
    let maps = host::numa_maps_huge(vm.vmm)?;
    let pages = maps.get(&2048).cloned().unwrap_or_default();
    ensure!(
        pages.keys().all(|&n| n == 1) && pages.get(&1) == Some(&32),
        "guest pages per node {pages:?}, want all 32 on node 1"
    );
    env.shutdown_ok(&vm)?;
    refuses_what_node1_cannot_hold(env, &pod)
}

/// 96 pages: node 1 has 64 free (with node 0's 64 it would fit, but the pod may not use it).
fn refuses_what_node1_cannot_hold(env: &Env, pod: &Path) -> Outcome {
    let toml = dedicated_spec("podbig", 1, 1, "", "192Mi", "idle");
    let spec = env.spec("podbig", &toml)?.to_string_lossy().to_string();
    let before = host::free_per_node(2048)?;
    let out = run_in(env, pod, &["--config", &spec], "vmhost in the pod")?;
    out.expect_code(3)?;
    ensure!(
        out.stderr
            .contains("cgroup /tbpodmems allows memory only on node(s) 1"),
        "the refusal does not name the pod's cgroup and its memory nodes: {}",
        out.stderr.trim()
    );
    let after = host::free_per_node(2048)?;
    ensure!(
        before == after,
        "free 2 MiB pages per node went from {before:?} to {after:?}"
    );
    Ok(())
}

/// A pod whose `hugetlb.2MB.max` holds 16 pages while node 1 has 64 free: `vmhost topology`
/// shows the limit next to the pool, a 32-page VM is refused naming the limit with no page
/// taken (the pools and the cgroup's `hugetlb.2MB.current` unchanged), a 16-page VM plans.
pub fn hugetlb_limit_refuses(env: &Env) -> Outcome {
    host::set_2m_pools(&[64, 64])?;
    let pod = make_pod_with(env, "tbpodhtlb", &host::node_cpus(1)?, "1")?;
    host::write(
        &pod.join("hugetlb.2MB.max").to_string_lossy(),
        &(16u64 << 21).to_string(),
    )?;
    let topo = run_in(env, &pod, &["topology"], "vmhost topology in the pod")?;
    ensure!(
        topo.expect_code(0)?.stdout.contains(
            "hugetlb limit 2Mi: 16 pages may still be taken, the nodes have 128 free (cgroup /tbpodhtlb"
        ),
        "vmhost topology does not show the pod's hugetlb limit:\n{}",
        topo.stdout
    );
    let small = env.spec(
        "htlbok",
        &dedicated_spec("htlbok", 1, 1, "", "32Mi", "idle"),
    )?;
    let plan = run_in(
        env,
        &pod,
        &["plan", "--json", "--config", &small.to_string_lossy()],
        "plan",
    )?;
    let plan = plan.expect_code(0)?.json()?;
    ensure!(
        at(&plan, "/envelope/hugepages/0/count")?.as_u64() == Some(16),
        "the 16-page VM plans {:?}",
        at(&plan, "/envelope/hugepages")?
    );
    let big = env.spec(
        "htlbbig",
        &dedicated_spec("htlbbig", 1, 1, "", "64Mi", "touch"),
    )?;
    let before = host::free_per_node(2048)?;
    let out = run_in(env, &pod, &["--config", &big.to_string_lossy()], "vmhost")?;
    out.expect_code(3)?;
    ensure!(
        out.stderr
            .contains("cgroup /tbpodhtlb may take only 16 more 2Mi hugepages")
            && out.stderr.contains("hugetlb.2MB.max")
            && out.stderr.contains("the plan needs 32"),
        "the refusal does not name the pod's hugetlb limit: {}",
        out.stderr.trim()
    );
    let after = host::free_per_node(2048)?;
    ensure!(
        before == after,
        "free 2 MiB pages per node went from {before:?} to {after:?}"
    );
    let used = host::read(&pod.join("hugetlb.2MB.current").to_string_lossy())?;
    ensure!(used == "0", "the pod's hugetlb.2MB.current is {used}");
    Ok(())
}
