//! Guest memory and vCPU placement on several nodes, read back from `/proc` while the VM
//! runs: residency per planned node (vmhost's live audit and `numa_maps` agree), vCPU and
//! emulator threads on their planned PUs, refusal without side effects, 1 GiB pages per node,
//! and `vmhost bench numa`'s four scenarios.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::host;
use crate::vm::{at, dedicated_spec, num, opt_num, u32s, Env, Running};
use crate::{ensure, Outcome};

const PASSTHROUGH: &str = "numa = { guest_mapping_passthrough = true }";

/// `vmhost ctl placement` of a running VM.
fn live_placement(env: &Env, vm: &Running) -> Result<Value, String> {
    let sock = vm.socket.to_string_lossy().to_string();
    env.run(&["ctl", "--api-socket", &sock, "placement"])?
        .expect_code(0)?
        .json()
}

/// Checks that every cell's pages sit on its planned node, per vmhost's live audit and per
/// the kernel's `numa_maps`, and returns the pages per node seen in `numa_maps`.
pub(crate) fn check_residency(
    env: &Env,
    vm: &Running,
    plan: &Value,
    page_kib: u64,
) -> Result<BTreeMap<u32, u64>, String> {
    let live = live_placement(env, vm)?;
    ensure!(
        at(&live, "/deviations")?.as_u64() == Some(0),
        "live placement has deviations: {live}"
    );
    let mut want: BTreeMap<u32, u64> = BTreeMap::new();
    for cell in at(plan, "/guest_cells")?.as_array().ok_or("guest_cells")? {
        // A cell bound per node (memory spanning nodes) lists its parts in `spans`.
        let parts = match cell["spans"].as_array().filter(|s| !s.is_empty()) {
            Some(spans) => spans.clone(),
            None => vec![cell.clone()],
        };
        for part in parts {
            let node = num(&part["host_node"], "a guest cell's host_node")?;
            *want.entry(node).or_default() +=
                part["memory_bytes"].as_u64().unwrap_or(0) / (page_kib * 1024);
        }
    }
    let mut audited: BTreeMap<u32, u64> = BTreeMap::new();
    for region in at(&live, "/memory")?.as_array().ok_or("memory")? {
        let node = num(&region["expected_node"], "a region's expected_node")?;
        let by_node = region["pages_by_node"].as_object().ok_or("pages_by_node")?;
        for (n, pages) in by_node {
            ensure!(
                n == &node.to_string(),
                "region of cell {} has pages on node{n}, planned node{node}",
                region["cell"]
            );
            *audited.entry(node).or_default() += pages.as_u64().unwrap_or(0);
        }
        ensure!(
            region["page_size_bytes"].as_u64() == Some(page_kib * 1024),
            "region page size {}",
            region["page_size_bytes"]
        );
    }
    ensure!(audited == want, "vmhost's audit: pages per node {audited:?}, the plan wants {want:?} (100% on each planned node)");
    let maps = host::numa_maps_huge(vm.vmm)?;
    let seen = maps.get(&page_kib).cloned().unwrap_or_default();
    ensure!(
        seen == want,
        "numa_maps of pid {}: {page_kib} KiB pages per node {seen:?}, the plan wants {want:?}",
        vm.vmm
    );
    Ok(seen)
}

/// Checks every vCPU thread is allowed exactly its planned PU, on the planned node.
fn check_vcpu_threads(vm: &Running, plan: &Value) -> Result<Vec<host::Thread>, String> {
    let threads = host::threads(vm.vmm)?;
    for v in at(plan, "/vcpus")?.as_array().ok_or("vcpus")? {
        let i = v["vcpu"].as_u64().unwrap_or(0);
        let pu = num(&v["host_cpu"], &format!("vCPU {i}'s planned PU"))?;
        let node = num(&v["host_node"], &format!("vCPU {i}'s planned node"))?;
        ensure!(
            host::node_cpus(node)?.contains(&pu),
            "plan puts vCPU {i} on PU{pu}, which sysfs puts outside node{node}"
        );
        let t = threads
            .iter()
            .find(|t| t.name == format!("vcpu{i}"))
            .ok_or_else(|| format!("no thread vcpu{i} in /proc/{}/task", vm.vmm))?;
        ensure!(
            t.cpus == vec![pu],
            "thread vcpu{i} (tid {}) allowed on {:?}, planned PU{pu}",
            t.tid,
            t.cpus
        );
    }
    Ok(threads)
}

/// A passthrough VM too big for one node gets a guest cell on node 0 and one on node 1, with
/// 100% of each cell's pages on its node.
pub fn two_cells_on_two_nodes(env: &Env) -> Outcome {
    host::set_2m_pools(&[64, 64])?;
    let spec = env.spec(
        "twocell",
        &dedicated_spec("twocell", 2, 2, PASSTHROUGH, "128Mi", "idle"),
    )?;
    let plan = env.plan(&spec)?;
    let nodes: Vec<u64> = at(&plan, "/guest_cells")?
        .as_array()
        .ok_or("cells")?
        .iter()
        .filter_map(|c| c["host_node"].as_u64())
        .collect();
    ensure!(
        nodes == vec![0, 1],
        "guest cells on host nodes {nodes:?}, want [0, 1]"
    );
    let vm = env.start(
        "twocell",
        env.command(&["--config", &spec.to_string_lossy()]),
        4,
    )?;
    check_vcpu_threads(&vm, &plan)?;
    let seen = check_residency(env, &vm, &plan, 2048)?;
    ensure!(seen.len() == 2, "pages on {} node(s)", seen.len());
    env.shutdown_ok(&vm)?;
    Ok(())
}

/// With hugepages on node 1 only, a dedicated VM with an isolated emulator gets its vCPU, its
/// emulator and every page on node 1; no other thread may run on the vCPU's PU.
pub fn vm_on_node1_only(env: &Env) -> Outcome {
    host::set_2m_pools(&[0, 64])?;
    let spec = env.spec(
        "node1",
        &dedicated_spec(
            "node1",
            1,
            1,
            "isolate_emulator_thread = true",
            "64Mi",
            "idle",
        ),
    )?;
    let plan = env.plan(&spec)?;
    let node1 = host::node_cpus(1)?;
    let emu = u32s(at(&plan, "/emulator/host_cpus")?);
    ensure!(
        emu.len() == 1 && node1.contains(&emu[0]),
        "emulator planned on {emu:?}, want one PU of node1 {node1:?}"
    );
    let vm = env.start(
        "node1",
        env.command(&["--config", &spec.to_string_lossy()]),
        1,
    )?;
    let threads = check_vcpu_threads(&vm, &plan)?;
    let vcpu_pu = num(at(&plan, "/vcpus/0/host_cpu")?, "vCPU 0's PU")?;
    ensure!(
        node1.contains(&vcpu_pu),
        "vCPU 0 planned on PU{vcpu_pu}, outside node1 {node1:?}"
    );
    ensure!(
        emu[0] != vcpu_pu,
        "the isolated emulator shares PU{vcpu_pu} with vCPU 0"
    );
    for t in threads.iter().filter(|t| !t.name.starts_with("vcpu")) {
        ensure!(
            !t.cpus.contains(&vcpu_pu),
            "thread {} (tid {}) may run on the vCPU's PU{vcpu_pu}: {:?}",
            t.name,
            t.tid,
            t.cpus
        );
    }
    let emu_thread = threads
        .iter()
        .find(|t| t.name == "vmhost-emu")
        .ok_or("no vmhost-emu thread")?;
    ensure!(
        emu_thread.cpus == emu,
        "vmhost-emu allowed on {:?}, planned {emu:?}",
        emu_thread.cpus
    );
    check_residency(env, &vm, &plan, 2048)?;
    env.shutdown_ok(&vm)?;
    Ok(())
}

/// A pool short on node 1 only: exit 3 naming node 1, every node's free count unchanged.
pub fn pool_short_on_node1_refused(env: &Env) -> Outcome {
    host::set_2m_pools(&[64, 8])?;
    let spec = env.spec(
        "short",
        &dedicated_spec("short", 2, 2, PASSTHROUGH, "128Mi", "touch"),
    )?;
    let before = host::free_per_node(2048)?;
    let out = env.run(&["--config", &spec.to_string_lossy()])?;
    let after = host::free_per_node(2048)?;
    out.expect_code(3)?;
    ensure!(
        out.stderr.contains("node1"),
        "the refusal does not name node1: {}",
        out.stderr.trim()
    );
    ensure!(
        !out.stderr.contains("node0 has"),
        "the refusal blames node0: {}",
        out.stderr.trim()
    );
    ensure!(
        before == after,
        "free 2 MiB pages per node changed: {before:?} -> {after:?}"
    );
    Ok(())
}

/// 1 GiB pages per node: a 2-cell VM takes the page reserved at boot on each node.
pub fn one_gig_pages_per_node(env: &Env) -> Outcome {
    host::set_2m_pools(&[0, 0])?;
    let pools = [host::hugepages(0, 1048576)?, host::hugepages(1, 1048576)?];
    for (node, (total, free)) in pools.iter().enumerate() {
        ensure!(
            *free >= 1,
            "node{node} has {free} free of {total} 1 GiB pages (testbed/boot.sh reserves one per \
             node); (total, free) per node: {pools:?}; kernel image: {}",
            host::read("/proc/iomem")?
                .lines()
                .find(|l| l.contains("Kernel code"))
                .unwrap_or("?")
                .trim()
        );
    }
    let toml =
        dedicated_spec("gig", 2, 2, PASSTHROUGH, "2Gi", "idle").replace("\"2Mi\"", "\"1Gi\"");
    let spec = env.spec("gig", &toml)?;
    let plan = env.plan(&spec)?;
    let vm = env.start(
        "gig",
        env.command(&["--config", &spec.to_string_lossy()]),
        4,
    )?;
    let seen = check_residency(env, &vm, &plan, 1048576)?;
    ensure!(
        seen == BTreeMap::from([(0, 1), (1, 1)]),
        "1 GiB pages per node {seen:?}, want one on each"
    );
    env.shutdown_ok(&vm)?;
    Ok(())
}

/// One scenario's read-back, every part of it required: an entry per guest cell for the
/// guest's and the host baseline's memory, an entry per vCPU for the vCPU and baseline threads.
struct Readback {
    /// Guest memory per cell: the nodes its pages are on (never empty).
    cell_nodes: Vec<Vec<u32>>,
    /// vCPU threads: the PUs the kernel allowed each (never empty, = the scenario's).
    vcpu_cpus: Vec<Vec<u32>>,
}

/// The nodes of a read-back cell's pages, each an online node of the host (sysfs).
fn cell_nodes(name: &str, cell: &Value, online: &[u32]) -> Result<Vec<u32>, String> {
    ensure!(
        cell["matches"] == true,
        "{name}: memory read back {} but the scenario set {}",
        cell["numa_maps"],
        cell["expected"]
    );
    let by_node = cell["pages_by_node"]
        .as_object()
        .ok_or_else(|| format!("{name}: a cell without pages_by_node: {cell}"))?;
    let mut nodes = Vec::new();
    for (node, pages) in by_node {
        let n: u32 = node
            .parse()
            .map_err(|e| format!("{name}: node {node:?}: {e}"))?;
        ensure!(online.contains(&n), "{name}: pages on node {n}, not online");
        if pages.as_u64() > Some(0) {
            nodes.push(n);
        }
    }
    ensure!(
        !nodes.is_empty(),
        "{name}: no page of a cell read back: {cell}"
    );
    Ok(nodes)
}

/// A scenario's read-back from `vmhost bench numa --json`; fails when any part is missing or
/// empty, when a count differs from the VM's vCPUs/cells, or when a thread's PUs differ from
/// the scenario's.
fn readback(report: &Value, name: &str, online: &[u32]) -> Result<Readback, String> {
    let s = at(report, "/scenarios")?
        .as_array()
        .ok_or("scenarios")?
        .iter()
        .find(|s| s["scenario"] == name)
        .ok_or_else(|| format!("no scenario {name}"))?;
    ensure!(
        s["skipped"].is_null(),
        "scenario {name} skipped: {}",
        s["skipped"]
    );
    ensure!(
        s["entries"].as_array().is_some_and(|e| !e.is_empty()),
        "scenario {name} has no results"
    );
    let (vcpus, cells) = (&report["vcpus"], &report["cells"]);
    let list = |part: &str, want: &Value| -> Result<Vec<Value>, String> {
        let items = s["readback"][part]
            .as_array()
            .ok_or_else(|| format!("{name}: no readback.{part}"))?;
        ensure!(
            Some(items.len() as u64) == want.as_u64() && !items.is_empty(),
            "{name}: readback.{part} has {} entries, the VM {want}",
            items.len()
        );
        Ok(items.clone())
    };
    for cell in list("host_memory", cells)? {
        cell_nodes(&format!("{name} (host baseline)"), &cell, online)?;
    }
    thread_cpus(
        &format!("{name} (host baseline)"),
        &list("host_threads", vcpus)?,
    )?;
    let vcpu_cpus = thread_cpus(name, &list("vcpu_threads", vcpus)?)?;
    let cell_nodes = list("guest_memory", cells)?
        .iter()
        .map(|c| cell_nodes(name, c, online))
        .collect::<Result<_, _>>()?;
    Ok(Readback {
        cell_nodes,
        vcpu_cpus,
    })
}

/// The PUs each read-back thread was allowed; fails when a thread's are empty or not the
/// scenario's.
fn thread_cpus(name: &str, threads: &[Value]) -> Result<Vec<Vec<u32>>, String> {
    let mut out = Vec::new();
    for t in threads {
        let allowed = u32s(&t["cpus_allowed"]);
        ensure!(
            !allowed.is_empty() && allowed == u32s(&t["expected"]),
            "{name}: thread allowed {} planned {}",
            t["cpus_allowed"],
            t["expected"]
        );
        out.push(allowed);
    }
    Ok(out)
}

/// The nodes (sysfs) whose PUs the threads may run on.
fn nodes_of_pus(threads: &[Vec<u32>]) -> Result<Vec<u32>, String> {
    let mut nodes = Vec::new();
    for n in host::nodes()? {
        let cpus = host::node_cpus(n)?;
        if threads.iter().flatten().any(|pu| cpus.contains(pu)) {
            nodes.push(n);
        }
    }
    Ok(nodes)
}

/// `vmhost bench numa` runs pinned, floating, remote and interleave, none skipped, and each
/// scenario's read-back placement is the scenario's: local, floating, remote, both nodes.
/// Every read-back part is required; nodes and PUs are checked against sysfs, and afterwards
/// every node's free 2 MiB pages are back (the kernel's count).
pub fn bench_numa_all_scenarios(env: &Env) -> Outcome {
    host::set_2m_pools(&[96, 96])?;
    let free_before = host::free_per_node(2048)?;
    let spec = env.spec(
        "bench",
        &dedicated_spec("bench", 1, 2, "", "128Mi", "numa-bench"),
    )?;
    let spec = spec.to_string_lossy();
    let out = env.run(&[
        "bench",
        "numa",
        "--config",
        &spec,
        "--repeat",
        "1",
        "--working-set-mib",
        "8",
        "--stream-passes",
        "2",
        "--json",
    ])?;
    let report = out.expect_code(0)?.json()?;
    let free_after = host::free_per_node(2048)?;
    ensure!(
        free_after == free_before,
        "free 2 MiB pages per node {free_after:?} after the bench, {free_before:?} before"
    );
    let online = host::nodes()?;
    let rb = |name: &str| readback(&report, name, &online);

    let pinned = rb("pinned")?;
    let pinned_nodes = nodes_of_pus(&pinned.vcpu_cpus)?;
    ensure!(
        pinned_nodes.len() == 1 && pinned.vcpu_cpus.iter().all(|c| c.len() == 1),
        "pinned: vCPUs allowed {:?} (nodes {pinned_nodes:?}), want one PU each on one node",
        pinned.vcpu_cpus
    );
    for nodes in &pinned.cell_nodes {
        ensure!(
            *nodes == pinned_nodes,
            "pinned: pages on {nodes:?}, vCPUs on {pinned_nodes:?}"
        );
    }
    let floating = rb("floating")?;
    ensure!(
        floating.vcpu_cpus.iter().all(|c| c.len() > 1),
        "floating: a vCPU thread is pinned to one PU: {:?}",
        floating.vcpu_cpus
    );
    let remote = rb("remote")?;
    let remote_vcpus = nodes_of_pus(&remote.vcpu_cpus)?;
    for nodes in &remote.cell_nodes {
        ensure!(
            nodes.iter().all(|x| !remote_vcpus.contains(x)),
            "remote: pages on {nodes:?}, vCPUs on {remote_vcpus:?}"
        );
    }
    for nodes in &rb("interleave")?.cell_nodes {
        ensure!(
            *nodes == vec![0, 1],
            "interleave: pages on {nodes:?}, want both nodes"
        );
    }
    Ok(())
}

/// On the 4-node host, a 4-socket passthrough VM gets one guest cell per node, the guest
/// distances are the host's asymmetric matrix, and every cell's pages are on its node.
pub fn four_cells_on_four_nodes(env: &Env) -> Outcome {
    host::set_2m_pools(&[32, 32, 32, 32])?;
    let spec = env.spec(
        "four",
        &dedicated_spec("four", 4, 2, PASSTHROUGH, "256Mi", "idle"),
    )?;
    let plan = env.plan(&spec)?;
    let cells = at(&plan, "/guest_cells")?
        .as_array()
        .ok_or("cells")?
        .clone();
    let nodes: Vec<u32> = cells
        .iter()
        .filter_map(|c| opt_num(&c["host_node"]))
        .collect();
    ensure!(
        nodes == vec![0, 1, 2, 3],
        "guest cells on host nodes {nodes:?}, want [0, 1, 2, 3]"
    );
    for (i, cell) in cells.iter().enumerate() {
        let row = u32s(&cell["distances"]);
        let host_row: Vec<u32> = {
            let full = host::distances(nodes[i])?;
            nodes.iter().map(|&n| full[n as usize]).collect()
        };
        ensure!(
            row == host_row,
            "guest cell {i} distances {row:?}, host node{} row {host_row:?}",
            nodes[i]
        );
    }
    let vm = env.start(
        "four",
        env.command(&["--config", &spec.to_string_lossy()]),
        8,
    )?;
    check_vcpu_threads(&vm, &plan)?;
    check_residency(env, &vm, &plan, 2048)?;
    env.shutdown_ok(&vm)?;
    Ok(())
}

/// Without passthrough, a VM whose memory is larger than its vCPUs' node's pool runs with its
/// memory bound per node (node 0 as far as its pool goes, the rest on node 1), one guest node.
pub fn memory_spans_nodes_without_passthrough(env: &Env) -> Outcome {
    host::set_2m_pools(&[50, 50])?;
    let spec = env.spec("span", &dedicated_spec("span", 1, 2, "", "160Mi", "idle"))?;
    let plan = env.plan(&spec)?;
    let cells = at(&plan, "/guest_cells")?
        .as_array()
        .ok_or("cells")?
        .clone();
    ensure!(
        cells.len() == 1,
        "{} guest cells, want one guest node",
        cells.len()
    );
    let spans: Vec<(u64, u64)> = cells[0]["spans"]
        .as_array()
        .map(|s| {
            s.iter()
                .map(|p| {
                    (
                        p["host_node"].as_u64().unwrap_or(99),
                        p["memory_bytes"].as_u64().unwrap_or(0) >> 20,
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    ensure!(
        spans == vec![(0, 100), (1, 60)],
        "memory parts (node, MiB) {spans:?}, want [(0, 100), (1, 60)]"
    );
    let notes = at(&plan, "/notes")?.to_string();
    ensure!(
        notes.contains("spans host nodes"),
        "no plan note says the memory spans nodes: {notes}"
    );
    let vm = env.start(
        "span",
        env.command(&["--config", &spec.to_string_lossy()]),
        2,
    )?;
    check_vcpu_threads(&vm, &plan)?;
    let seen = check_residency(env, &vm, &plan, 2048)?;
    ensure!(
        seen == BTreeMap::from([(0, 50), (1, 30)]),
        "pages per node {seen:?}, want 50 on node0 and 30 on node1"
    );
    env.shutdown_ok(&vm)?;
    Ok(())
}

/// A dedicated VM without passthrough whose vCPUs span nodes (2 on node 0, 1 on node 1) gets
/// its memory split in proportion to them, each part bound to its node.
pub fn memory_split_by_vcpus_without_passthrough(env: &Env) -> Outcome {
    host::set_2m_pools(&[96, 96])?;
    let spec = env.spec("split", &dedicated_spec("split", 1, 3, "", "192Mi", "idle"))?;
    let plan = env.plan(&spec)?;
    let vcpu_nodes: Vec<u64> = at(&plan, "/vcpus")?
        .as_array()
        .ok_or("vcpus")?
        .iter()
        .filter_map(|v| v["host_node"].as_u64())
        .collect();
    ensure!(
        vcpu_nodes == vec![0, 0, 1],
        "vCPUs on nodes {vcpu_nodes:?}, want [0, 0, 1]"
    );
    let vm = env.start(
        "split",
        env.command(&["--config", &spec.to_string_lossy()]),
        3,
    )?;
    check_vcpu_threads(&vm, &plan)?;
    let seen = check_residency(env, &vm, &plan, 2048)?;
    ensure!(
        seen == BTreeMap::from([(0, 64), (1, 32)]),
        "pages per node {seen:?}, want 64 (128 MiB) on node0 and 32 (64 MiB) on node1"
    );
    env.shutdown_ok(&vm)?;
    Ok(())
}

/// `cpu.realtime` with a mask: the masked vCPU threads run SCHED_FIFO, the others and every
/// helper thread stay SCHED_OTHER (policy read back from `/proc/<pid>/task/<tid>/stat`).
pub fn realtime_vcpus_run_fifo(env: &Env) -> Outcome {
    host::set_2m_pools(&[0, 64])?;
    let cpu = "isolate_emulator_thread = true\nrealtime = { mask = \"1\" }";
    let spec = env.spec("rt", &dedicated_spec("rt", 1, 2, cpu, "64Mi", "idle"))?;
    let vm = env.start("rt", env.command(&["--config", &spec.to_string_lossy()]), 2)?;
    for t in host::threads(vm.vmm)? {
        let policy = host::sched_policy(vm.vmm, t.tid)?;
        let want = if t.name == "vcpu1" { 1 } else { 0 };
        ensure!(
            policy == want,
            "thread {} (tid {}) has scheduling policy {policy}, want {want} (1 = SCHED_FIFO)",
            t.name,
            t.tid
        );
    }
    env.shutdown_ok(&vm)?;
    Ok(())
}
