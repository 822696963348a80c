//! cgroup v2 on a real hierarchy: the envelope written from the plan and read back, a VM
//! forced past its envelope stopped with vmhost's message and exit 5, and vmhost started
//! inside a pod-like cgroup whose cpuset is a subset of the host.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::host;
use crate::vm::{at, dedicated_spec, opt_num, u32s, Env, Running};
use crate::{ensure, Outcome};

const ROOT: &str = "/sys/fs/cgroup";

fn read_list(dir: &Path, file: &str) -> Result<Vec<u32>, String> {
    host::parse_list(&host::read(&dir.join(file).to_string_lossy())?)
}

fn read_u64(dir: &Path, file: &str) -> Result<u64, String> {
    let p = dir.join(file);
    let s = host::read(&p.to_string_lossy())?;
    s.parse()
        .map_err(|e| format!("{}: {s:?}: {e}", p.display()))
}

/// The plan's PUs (vCPUs ∪ emulator), ascending.
fn plan_cpus(plan: &serde_json::Value) -> Result<Vec<u32>, String> {
    let mut cpus: Vec<u32> = at(plan, "/vcpus")?
        .as_array()
        .ok_or("vcpus")?
        .iter()
        .filter_map(|v| opt_num(&v["host_cpu"]))
        .collect();
    cpus.extend(u32s(at(plan, "/emulator/host_cpus")?));
    cpus.sort_unstable();
    cpus.dedup();
    Ok(cpus)
}

/// `--cgroup` writes cpuset.cpus, cpuset.mems, memory.max and hugetlb.2MB.max from the plan;
/// they read back equal while the VM runs, and the cgroup is gone after it stops.
pub fn limits_from_plan(env: &Env) -> Outcome {
    host::set_2m_pools(&[64, 64])?;
    let spec = env.spec(
        "cg",
        &dedicated_spec("cg", 1, 1, "isolate_emulator_thread = true", "64Mi", "idle"),
    )?;
    let plan = env.plan(&spec)?;
    let vm = env.start(
        "cg",
        env.command(&["--config", &spec.to_string_lossy(), "--cgroup", "tbcg"]),
        1,
    )?;
    let dir = PathBuf::from(ROOT).join("vmhost/tbcg");
    let procs = host::read(&dir.join("cgroup.procs").to_string_lossy())?;
    ensure!(
        procs.lines().any(|l| l == vm.vmm.to_string()),
        "the VMM (pid {}) is not in {}: {procs:?}",
        vm.vmm,
        dir.display()
    );
    ensure!(
        vm.vmm != vm.pid && !procs.lines().any(|l| l == vm.pid.to_string()),
        "on cgroup v2 the VMM (pid {}) must run under a supervisor (pid {}) outside the cgroup",
        vm.vmm,
        vm.pid
    );
    let want_cpus = plan_cpus(&plan)?;
    ensure!(
        read_list(&dir, "cpuset.cpus")? == want_cpus,
        "cpuset.cpus {:?}, plan {want_cpus:?}",
        read_list(&dir, "cpuset.cpus")?
    );
    ensure!(
        read_list(&dir, "cpuset.cpus.effective")? == want_cpus,
        "cpuset.cpus.effective differs from the plan"
    );
    let want_mems: Vec<u32> = at(&plan, "/guest_cells")?
        .as_array()
        .ok_or("cells")?
        .iter()
        .filter_map(|c| opt_num(&c["host_node"]))
        .collect();
    ensure!(
        read_list(&dir, "cpuset.mems")? == want_mems,
        "cpuset.mems {:?}, plan {want_mems:?}",
        read_list(&dir, "cpuset.mems")?
    );
    let limit = at(&plan, "/envelope/memory_limit_bytes")?
        .as_u64()
        .ok_or("the plan has no memory limit")?;
    let want_max = limit.div_ceil(4096) * 4096;
    ensure!(
        read_u64(&dir, "memory.max")? == want_max,
        "memory.max {}, plan {want_max}",
        read_u64(&dir, "memory.max")?
    );
    let guest = at(&plan, "/envelope/guest_memory_bytes")?
        .as_u64()
        .ok_or("guest memory")?;
    ensure!(
        read_u64(&dir, "hugetlb.2MB.max")? == guest,
        "hugetlb.2MB.max {}, plan's hugepages {guest}",
        read_u64(&dir, "hugetlb.2MB.max")?
    );
    env.shutdown_ok(&vm)?;
    ensure!(
        !dir.exists(),
        "{} is still there after the VM stopped",
        dir.display()
    );
    Ok(())
}

/// A VM whose envelope is forced too small stops with vmhost's message and exit 5 (not a
/// silent kill); its cgroup, ledger entry and control socket are gone afterwards.
pub fn envelope_breach(env: &Env) -> Outcome {
    host::set_2m_pools(&[0, 0])?;
    let toml = "name = \"breach\"\n[cpu]\ncores = 1\ndedicated_cpu_placement = true\n\
                [memory]\nguest = \"96Mi\"\n[boot]\npayload = \"touch\"\n";
    let spec = env.spec("breach", toml)?;
    let socket = env.work.join("breach.sock");
    let sock = socket.to_string_lossy().to_string();
    let limit = (32u64 << 20).to_string();
    let out = env.run(&[
        "--config",
        &spec.to_string_lossy(),
        "--cgroup",
        "tbbreach",
        "--cgroup-memory-limit",
        &limit,
        "--api-socket",
        &sock,
    ])?;
    out.expect_code(5)?;
    ensure!(
        out.stderr.contains("memory limit"),
        "no message naming the memory limit: {}",
        out.stderr.trim()
    );
    ensure!(
        out.stderr.contains("added_overhead"),
        "the message does not say how to fix it: {}",
        out.stderr.trim()
    );
    let dir = PathBuf::from(ROOT).join("vmhost/tbbreach");
    ensure!(!dir.exists(), "{} is still there", dir.display());
    ensure!(!socket.exists(), "the control socket {sock} is still there");
    let ps = env.run(&["ps", "--json"])?.expect_code(0)?.json()?;
    ensure!(
        !ps.to_string().contains("\"breach\""),
        "the ledger still lists the VM: {ps}"
    );
    Ok(())
}

/// On cgroup v2 a stop signal to vmhost (the supervisor outside the cgroup) reaches the VMM,
/// which stops in order: SIGTERM and SIGINT each end an idle VM with 0, its cgroup, control
/// socket and ledger entry gone. The stop signals are blocked from `main` on, before the fork:
/// the supervisor waits for them, the VMM's signal thread takes the forwarded one.
pub fn stop_signals_through_the_supervisor(env: &Env) -> Outcome {
    host::set_2m_pools(&[16, 16])?;
    for (sig, tag) in [(libc::SIGTERM, "term"), (libc::SIGINT, "int")] {
        let name = format!("cgsig{tag}");
        let spec = env.spec(&name, &dedicated_spec(&name, 1, 1, "", "16Mi", "idle"))?;
        let cg = format!("tbsig{tag}");
        let cmd = env.command(&["--config", &spec.to_string_lossy(), "--cgroup", &cg]);
        let vm = env.start(&name, cmd, 1)?;
        ensure!(
            vm.vmm != vm.pid,
            "on cgroup v2 the VMM (pid {}) must run under a supervisor (pid {})",
            vm.vmm,
            vm.pid
        );
        env.signal(vm.pid, sig)?;
        let code = env.wait(vm.pid)?;
        ensure!(
            code == 0,
            "signal {sig} gave exit {code}, want 0 (an idle VM stopped in order); stderr: {}",
            vm.stderr()
        );
        let dir = PathBuf::from(ROOT).join("vmhost").join(&cg);
        ensure!(!dir.exists(), "{} is still there", dir.display());
        ensure!(
            !vm.socket.exists(),
            "the control socket {} is still there",
            vm.socket.display()
        );
        let ps = env.run(&["ps", "--json"])?.expect_code(0)?.json()?;
        ensure!(
            !ps.to_string().contains(&format!("\"{name}\"")),
            "the ledger still lists the VM: {ps}"
        );
    }
    Ok(())
}

/// A pod-like cgroup (what a Guaranteed pod gets under the static CPU manager): node 1's PUs
/// and memory only. Returns its directory.
fn make_pod(env: &Env, name: &str) -> Result<PathBuf, String> {
    make_pod_with(env, name, &host::node_cpus(1)?, "1")
}

/// A pod-like cgroup `name` with `cpus` in `cpuset.cpus` and `mems` in `cpuset.mems`, removed
/// by the runner's cleanup. Returns its directory.
pub(crate) fn make_pod_with(
    env: &Env,
    name: &str,
    cpus: &[u32],
    mems: &str,
) -> Result<PathBuf, String> {
    host::write(
        &format!("{ROOT}/cgroup.subtree_control"),
        "+cpuset +memory +hugetlb",
    )?;
    let dir = PathBuf::from(ROOT).join(name);
    if !dir.exists() {
        std::fs::create_dir(&dir).map_err(|e| format!("mkdir {}: {e}", dir.display()))?;
    }
    env.cgroups
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(dir.clone());
    let list = cpus
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",");
    host::write(&dir.join("cpuset.cpus").to_string_lossy(), &list)?;
    host::write(&dir.join("cpuset.mems").to_string_lossy(), mems)?;
    Ok(dir)
}

/// A vmhost command that starts inside cgroup `dir` (it moves itself there, then execs).
pub(crate) fn command_in(env: &Env, dir: &Path, args: &[&str]) -> Command {
    let inner = env.command(args);
    let mut c = Command::new("/bin/sh");
    c.arg("-c")
        .arg(format!(
            "echo $$ > {}/cgroup.procs && exec \"$@\"",
            dir.display()
        ))
        .arg("sh")
        .arg(inner.get_program())
        .args(inner.get_args());
    c
}

/// vmhost started inside the pod plans, pins, prefaults and binds inside the pod's cpuset.
pub fn pod_confines_vmhost(env: &Env) -> Outcome {
    host::set_2m_pools(&[64, 64])?;
    let pod = make_pod(env, "tbpod")?;
    let pod_cpus = read_list(&pod, "cpuset.cpus.effective")?;
    ensure!(
        read_list(&pod, "cpuset.mems.effective")? == vec![1],
        "the pod's cpuset.mems.effective is not node 1"
    );
    let spec = env.spec(
        "inpod",
        &dedicated_spec(
            "inpod",
            1,
            1,
            "isolate_emulator_thread = true",
            "64Mi",
            "idle",
        ),
    )?;
    let spec_s = spec.to_string_lossy().to_string();
    let out = crate::vm::run_command(
        command_in(env, &pod, &["plan", "--json", "--config", &spec_s]),
        "vmhost plan in the pod",
    )?;
    let plan = out.expect_code(0)?.json()?;
    let cpus = plan_cpus(&plan)?;
    ensure!(
        cpus.iter().all(|c| pod_cpus.contains(c)),
        "planned PUs {cpus:?} outside the pod's {pod_cpus:?}"
    );
    for cell in at(&plan, "/guest_cells")?.as_array().ok_or("cells")? {
        ensure!(
            cell["host_node"].as_u64() == Some(1),
            "guest cell on node {}, the pod has node 1",
            cell["host_node"]
        );
        let pf = u32s(&cell["prefault_cpus"]);
        ensure!(
            !pf.is_empty() && pf.iter().all(|c| pod_cpus.contains(c)),
            "prefault workers planned on {pf:?}, the pod has {pod_cpus:?}"
        );
    }
    let vm = env.start("inpod", command_in(env, &pod, &["--config", &spec_s]), 1)?;
    for t in host::threads(vm.vmm)? {
        ensure!(
            t.cpus.iter().all(|c| pod_cpus.contains(c)),
            "thread {} (tid {}) allowed on {:?}, the pod has {pod_cpus:?}",
            t.name,
            t.tid,
            t.cpus
        );
        ensure!(
            t.mems == vec![1],
            "thread {} may allocate on nodes {:?}, the pod has node 1",
            t.name,
            t.mems
        );
    }
    let maps = host::numa_maps_huge(vm.vmm)?;
    let pages = maps.get(&2048).cloned().unwrap_or_default();
    ensure!(
        pages.keys().all(|&n| n == 1) && pages.get(&1) == Some(&32),
        "guest pages per node {pages:?}, want 32 on node 1"
    );
    env.shutdown_ok(&vm)?;
    Ok(())
}

/// A VM that needs more PUs than the pod was given is refused with exit 3 naming the cpuset.
pub fn pod_refuses_oversized_vm(env: &Env) -> Outcome {
    host::set_2m_pools(&[64, 64])?;
    let pod = make_pod(env, "tbpod2")?;
    let spec = env.spec(
        "bigpod",
        &dedicated_spec("bigpod", 1, 3, "", "64Mi", "idle"),
    )?;
    let out = crate::vm::run_command(
        command_in(env, &pod, &["--config", &spec.to_string_lossy()]),
        "vmhost in the pod",
    )?;
    out.expect_code(3)?;
    ensure!(
        out.stderr.contains("cpuset"),
        "the refusal does not name the pod's cpuset: {}",
        out.stderr.trim()
    );
    ensure!(
        out.stderr.contains("tbpod2"),
        "the refusal does not name the pod's cgroup: {}",
        out.stderr.trim()
    );
    Ok(())
}

/// A running VM whose cgroup limit is lowered below its usage is OOM-killed by the kernel; the
/// supervisor outside the cgroup reports it with vmhost's message and exit 5, and removes the
/// cgroup, the ledger entry and the control socket.
pub fn breach_while_running(env: &Env) -> Outcome {
    host::set_2m_pools(&[0, 0])?;
    // 16 MiB of added overhead: this test is about a limit shrunk under a running VM, not
    // about the model's margin, and the debug vmhost of the testbed starts with more of its
    // own text charged to the cgroup than the release build the overhead model is calibrated
    // for (in one CI run it breached the plain envelope before it was ready: 3.4 MiB anon,
    // 3.8 MiB file-backed, 64 MiB guest RAM against 66.8 MiB).
    let toml = "name = \"breach2\"\n[cpu]\ncores = 1\ndedicated_cpu_placement = true\n\
                [memory]\nguest = \"64Mi\"\n\
                reserved_overhead = { added_overhead = \"16Mi\" }\n\
                [boot]\npayload = \"idle\"\n";
    let spec = env.spec("breach2", toml)?;
    let vm = env.start(
        "breach2",
        env.command(&["--config", &spec.to_string_lossy(), "--cgroup", "tbbreach2"]),
        1,
    )?;
    let dir = PathBuf::from(ROOT).join("vmhost/tbbreach2");
    let current = read_u64(&dir, "memory.current")?;
    ensure!(
        current > 64 << 20,
        "memory.current {current} does not hold the 64 MiB of guest RAM"
    );
    // The operator (or a bug) shrinks the envelope under the running VM.
    host::write(
        &dir.join("memory.max").to_string_lossy(),
        &(current / 2).to_string(),
    )?;
    let code = env.wait(vm.pid)?;
    let stderr = vm.stderr();
    ensure!(
        code == 5,
        "vmhost exited {code} (want 5); stderr: {}",
        stderr.trim()
    );
    ensure!(
        stderr.contains("memory limit") && stderr.contains("added_overhead"),
        "no limit message: {}",
        stderr.trim()
    );
    ensure!(!dir.exists(), "{} is still there", dir.display());
    ensure!(!vm.socket.exists(), "the control socket is still there");
    let ps = env.run(&["ps", "--json"])?.expect_code(0)?.json()?;
    ensure!(
        !ps.to_string().contains("\"breach2\""),
        "the ledger still lists the VM: {ps}"
    );
    Ok(())
}

/// A prefault worker thread as the kernel showed it, last time it was seen alive.
#[derive(Debug)]
struct Worker {
    name: String,
    /// Its `Cpus_allowed_list`.
    allowed: Vec<u32>,
    /// The CPU it last ran on (`stat` field 39).
    last_cpu: u32,
    /// Its cgroup (`/proc/<pid>/task/<tid>/cgroup`).
    cgroup: String,
    /// The cgroup's `cpuset.cpus.effective` at that moment.
    effective: Vec<u32>,
}

/// Watches a starting `--cgroup` VM for its prefault workers (`prefault-c<cell>-<i>` threads
/// of the VMM, the supervisor's child) and records what the kernel says about each.
#[derive(Debug, Default)]
struct PrefaultWatch {
    vmm: Option<u32>,
    workers: std::collections::BTreeMap<u32, Worker>,
    /// Set once workers were seen and then none was left: the prefault is over.
    done: bool,
}

impl PrefaultWatch {
    /// One poll; true while the prefault may still be running (poll fast).
    fn poll(&mut self, supervisor: u32, dir: &Path) -> bool {
        if self.done {
            return false;
        }
        // Read first: a worker still alive after this read was alive during it, so this is
        // the cpuset before the narrowing that follows the prefault.
        let effective = read_list(dir, "cpuset.cpus.effective");
        // The VMM is the supervisor's child that has prefault workers.
        let candidates = self
            .vmm
            .map_or_else(|| host::children(supervisor), |v| vec![v]);
        let found = candidates.into_iter().find_map(|p| {
            let threads = host::threads(p).ok()?;
            let workers: Vec<host::Thread> = threads
                .into_iter()
                .filter(|t| t.name.starts_with("prefault-c"))
                .collect();
            (!workers.is_empty()).then_some((p, workers))
        });
        let Some((vmm, workers)) = found else {
            // None seen yet, or (once the VMM is known) none left: the prefault is over.
            self.done = self.vmm.is_some();
            return !self.done;
        };
        self.vmm = Some(vmm);
        for t in workers {
            let (Ok(last_cpu), Ok(cgroup), Ok(effective)) = (
                host::last_cpu(vmm, t.tid),
                host::task_cgroup(vmm, t.tid),
                effective.clone(),
            ) else {
                continue;
            };
            let w = Worker {
                name: t.name,
                allowed: t.cpus,
                last_cpu,
                cgroup,
                effective,
            };
            self.workers.insert(t.tid, w);
        }
        true
    }
}

/// Under `--cgroup`, a dedicated 512 MiB VM whose envelope holds only its own PUs still
/// prefaults with workers on its node's PUs, inside its cgroup; the cpuset is wide while they
/// run and narrows to the envelope afterwards; its pages are all on the planned node. All of
/// it read from the kernel: the workers' `/proc` entries caught while they run, the cgroup's
/// `cgroup.procs` and `cpuset.cpus.effective`, the VMM's `numa_maps`.
pub fn prefault_inside_the_cgroup(env: &Env) -> Outcome {
    host::set_2m_pools(&[288, 288])?;
    let spec = env.spec("pf", &dedicated_spec("pf", 1, 1, "", "512Mi", "idle"))?;
    let plan = env.plan(&spec)?;
    let planned = u32s(at(&plan, "/guest_cells/0/prefault_cpus")?);
    ensure!(
        planned.len() > 1,
        "the plan prefaults with {planned:?}: want the node's PUs"
    );
    let node = opt_num(at(&plan, "/guest_cells/0/host_node")?).ok_or("no host_node in cell 0")?;
    let node_cpus = host::node_cpus(node)?;
    let envelope = plan_cpus(&plan)?;
    ensure!(
        planned.iter().any(|c| !envelope.contains(c)),
        "the plan's prefault PUs {planned:?} are all in its envelope {envelope:?}: this test \
         needs an envelope narrower than the node"
    );
    let dir = PathBuf::from(ROOT).join("vmhost/tbpf");
    let mut watch = PrefaultWatch::default();
    let cmd = env.command(&["--config", &spec.to_string_lossy(), "--cgroup", "tbpf"]);
    let vm = env.start_watching("pf", cmd, 1, &mut |pid| watch.poll(pid, &dir))?;
    ensure!(
        !watch.workers.is_empty(),
        "no prefault-c* thread of the VMM seen while the VM started (VMM {:?})",
        watch.vmm
    );
    for w in watch.workers.values() {
        ensure!(
            w.cgroup == "/vmhost/tbpf",
            "{} ran in cgroup {}, not /vmhost/tbpf",
            w.name,
            w.cgroup
        );
        ensure!(
            !w.allowed.is_empty()
                && w.allowed.iter().all(|c| node_cpus.contains(c))
                && node_cpus.contains(&w.last_cpu),
            "{} allowed {:?}, last on CPU {}: want node{node}'s PUs {node_cpus:?}",
            w.name,
            w.allowed,
            w.last_cpu
        );
        let wide = w
            .allowed
            .iter()
            .chain(&envelope)
            .all(|c| w.effective.contains(c))
            && w.effective.len() > envelope.len();
        ensure!(
            wide,
            "while {} ran cpuset.cpus.effective was {:?}: want it wider than the envelope \
             {envelope:?} and holding the worker's {:?}",
            w.name,
            w.effective,
            w.allowed
        );
    }
    check_running_in_cgroup(&vm, &dir, &envelope, node)?;
    env.shutdown_ok(&vm)?;
    ensure!(!dir.exists(), "the cgroup is still there");
    Ok(())
}

/// The running VM's VMM (not its supervisor) is in the cgroup, the cpuset narrowed to the
/// envelope, and every guest page of the VMM (`numa_maps`) is a 2 MiB page on `node`.
fn check_running_in_cgroup(vm: &Running, dir: &Path, envelope: &[u32], node: u32) -> Outcome {
    let procs = host::read(&dir.join("cgroup.procs").to_string_lossy())?;
    let listed = |pid: u32| procs.lines().any(|l| l == pid.to_string());
    ensure!(
        listed(vm.vmm) && vm.vmm != vm.pid && !listed(vm.pid),
        "cgroup.procs {procs:?}: want the VMM {} and not its supervisor {}",
        vm.vmm,
        vm.pid
    );
    let effective = read_list(dir, "cpuset.cpus.effective")?;
    ensure!(
        effective == envelope,
        "after the prefault cpuset.cpus.effective is {effective:?}, the envelope {envelope:?}"
    );
    let pages = host::numa_maps_huge(vm.vmm)?;
    let want =
        std::collections::BTreeMap::from([(2048, std::collections::BTreeMap::from([(node, 256)]))]);
    ensure!(
        pages == want,
        "the VMM's hugepages per size and node (numa_maps) are {pages:?}, want {want:?}"
    );
    Ok(())
}
