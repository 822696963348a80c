//! Snapshot and restore of a Linux guest on the 2-node host (issue 22): the guest's memory is
//! on node 0; a `ctl snapshot` lets it run on (its console goes on ticking); `ctl snapshot
//! --stop` ends the VM (exit 0); node 0's 2 MiB pool is then shrunk to nothing
//! so that only node 1 has room, and `vmhost restore` continues the guest there. A corrupted
//! copy of the snapshot is refused first (exit 2, no hugepage taken).
//!
//! The guest (`vmhost.action=tick`, testbed/guest/init) prints its boot id and uptime once a
//! second on the serial console: the restored guest must print the same boot id (the same
//! kernel, not a new boot) with an uptime past the last one before the snapshot, on the
//! restored vmhost's stdout. Its memory is checked where the kernel says it is: vmhost's live
//! audit and `/proc/<pid>/numa_maps` (every page on node 1), and each vCPU thread's
//! `Cpus_allowed_list` in `/proc/<pid>/task/*/status` (its planned PU, on node 1).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::linux_tests::{assets, guest_lines, linux_spec, tail};
use crate::vm::{at, num, Env, Running};
use crate::{ensure, host, Outcome};

/// Guest memory: 48 pages of 2 MiB. 64 MiB is too small to load the kernel; more costs time:
/// every snapshot and restore scans and hashes all of it, which a debug vmhost in the emulated
/// host does slowly.
const GUEST_PAGES: u64 = 48;
/// How long a guest may take to print its ticks (boot included; emulated host).
const TICK_LIMIT: Duration = Duration::from_secs(120);

/// The last whole `GUEST-TICK` line of `out` as (boot id, uptime in seconds). The console is
/// written a byte at a time: a line without its end is still being printed and not read.
fn last_tick(out: &Path) -> Option<(String, f64)> {
    let serial = std::fs::read_to_string(out).unwrap_or_default();
    let whole = &serial[..serial.rfind('\n').map_or(0, |i| i + 1)];
    let ticks: Vec<_> = guest_lines(&whole.replace("GUEST-TICK ", "GUEST tick=1 "))
        .into_iter()
        .filter(|l| l.contains_key("tick"))
        .collect();
    let l = ticks.last()?;
    Some((l.get("boot_id")?.clone(), l.get("uptime")?.parse().ok()?))
}

/// Waits until `out` has a tick that `ok` accepts.
fn wait_tick(
    vm: &Running,
    out: &Path,
    ok: &dyn Fn(&str, f64) -> bool,
) -> Result<(String, f64), String> {
    let deadline = Instant::now() + TICK_LIMIT;
    loop {
        if let Some((id, up)) = last_tick(out) {
            if ok(&id, up) {
                return Ok((id, up));
            }
        }
        if Instant::now() > deadline {
            let serial = std::fs::read_to_string(out).unwrap_or_default();
            return Err(format!(
                "no expected GUEST-TICK within {TICK_LIMIT:?} (last {:?}): {}; stderr: {}",
                last_tick(out),
                tail(&serial),
                vm.stderr()
            ));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Every page of `vm` on its planned node with `want[node]` 2 MiB pages per node, by
/// vmhost's live audit and by `numa_maps`, and every vCPU thread allowed exactly its planned
/// PU, on one of `want`'s nodes.
pub(crate) fn check_placement(env: &Env, vm: &Running, want: &BTreeMap<u32, u64>) -> Outcome {
    let sock = vm.socket.to_string_lossy().to_string();
    let live = env
        .run(&["ctl", "--api-socket", &sock, "placement"])?
        .expect_code(0)?
        .json()?;
    let mut audit = BTreeMap::new();
    for region in at(&live, "/memory")?.as_array().ok_or("memory")? {
        let node = num(&region["expected_node"], "expected_node")?;
        let by_node = region["pages_by_node"].as_object().ok_or("pages_by_node")?;
        ensure!(
            by_node.keys().all(|n| *n == node.to_string()),
            "guest memory not all on its planned node{node}: {region}"
        );
        *audit.entry(node).or_insert(0) += by_node.values().filter_map(Value::as_u64).sum::<u64>();
    }
    ensure!(
        &audit == want,
        "vmhost's audit: 2 MiB pages per node {audit:?}, want {want:?}"
    );
    let maps = host::numa_maps_huge(vm.vmm)?;
    let seen = maps.get(&2048).cloned().unwrap_or_default();
    ensure!(
        &seen == want,
        "numa_maps of pid {}: 2 MiB pages per node {seen:?}, want {want:?}",
        vm.vmm
    );
    let mut pus = Vec::new();
    for node in want.keys() {
        pus.extend(host::node_cpus(*node)?);
    }
    let threads = host::threads(vm.vmm)?;
    for v in at(&live, "/vcpus")?.as_array().ok_or("vcpus")? {
        let pu = num(&v["planned_cpu"], "a vCPU's planned PU")?;
        let name = v["thread"]["name"].as_str().unwrap_or_default();
        let t = threads
            .iter()
            .find(|t| t.name == name)
            .ok_or_else(|| format!("no thread {name} in /proc/{}/task", vm.vmm))?;
        ensure!(
            pus.contains(&pu) && t.cpus == vec![pu],
            "{name} (tid {}) allowed on {:?}, planned PU{pu}; the nodes' PUs are {pus:?}",
            t.tid,
            t.cpus
        );
    }
    Ok(())
}

/// A copy of the snapshot with one byte of its memory file flipped: `vmhost restore` exits 2
/// naming the file, and no node's pool changes.
fn corrupted_is_refused(env: &Env, snap: &Path) -> Outcome {
    let bad = env.work.join("linsnap-bad");
    let _ = std::fs::remove_dir_all(&bad);
    std::fs::create_dir(&bad).map_err(|e| format!("mkdir {}: {e}", bad.display()))?;
    for e in std::fs::read_dir(snap)
        .map_err(|e| e.to_string())?
        .flatten()
    {
        std::fs::copy(e.path(), bad.join(e.file_name())).map_err(|e| e.to_string())?;
    }
    let cell = bad.join("memory-cell0");
    let mut bytes = std::fs::read(&cell).map_err(|e| e.to_string())?;
    let at = bytes.len() / 2;
    bytes[at] ^= 0x40;
    std::fs::write(&cell, bytes).map_err(|e| e.to_string())?;
    let before = (host::hugepages(0, 2048)?, host::hugepages(1, 2048)?);
    let out = env.run(&["restore", &bad.to_string_lossy()])?;
    let after = (host::hugepages(0, 2048)?, host::hugepages(1, 2048)?);
    ensure!(
        out.code == 2 && out.stderr.contains("memory-cell0"),
        "a corrupted snapshot: exit {}, want 2 naming memory-cell0; stderr: {}",
        out.code,
        out.stderr
    );
    ensure!(
        before == after,
        "(total, free) 2 MiB pages per node {before:?} before, {after:?} after the refusal"
    );
    Ok(())
}

/// Elapsed time at each step of the test, for its output line.
type Phases = Vec<(&'static str, Duration)>;

/// `ctl snapshot` (the guest runs on: its console ticks after it), then `ctl snapshot --stop`
/// into the returned directory (exit 0, the VM ends 0); the guest's uptime at the last tick.
fn snapshot_twice(env: &Env, vm: &Running, out: &Path) -> Result<(PathBuf, f64), String> {
    let sock = vm.socket.to_string_lossy().to_string();
    let ctl_snapshot = |dir: &Path, stop: bool| {
        let _ = std::fs::remove_dir_all(dir);
        let dir = dir.to_string_lossy();
        let mut args = vec!["ctl", "--api-socket", &sock, "snapshot", &dir];
        if stop {
            args.push("--stop");
        }
        let t = Instant::now();
        let out = env.run(&args)?;
        let job = out.expect_code(0)?.json()?;
        println!(
            "  linsnap: ctl snapshot{} {:.1} s, the job {} s, cells {}",
            if stop { " --stop" } else { "" },
            t.elapsed().as_secs_f64(),
            job["seconds"],
            job["cells"]
        );
        Ok::<(), String>(())
    };
    ctl_snapshot(&env.work.join("linsnap-run-on"), false)?;
    let (_, up_first) = last_tick(out).ok_or("no tick before the first snapshot")?;
    wait_tick(vm, out, &|_, up| up > up_first)?;
    let snap = env.work.join("linsnap-snap");
    ctl_snapshot(&snap, true)?;
    let code = env.wait(vm.pid)?;
    ensure!(
        code == 0,
        "the VM snapshotted with --stop: exit {code}, want 0; stderr: {}",
        vm.stderr()
    );
    let (_, up) = last_tick(out).ok_or("no tick before the snapshot")?;
    Ok((snap, up))
}

/// `vmhost ctl snapshot --stop` of a Linux guest on node 0, `vmhost restore` with only node 1
/// free: the guest continues there.
pub fn linux_restore_onto_the_other_node(env: &Env) -> Outcome {
    let started = Instant::now();
    let mut phases: Phases = Vec::new();
    let mut mark = |what| phases.push((what, started.elapsed()));
    let a = assets(env)?;
    host::set_2m_pools(&[GUEST_PAGES, 0])?;
    let toml = linux_spec("linsnap", (1, 1), "", "96Mi", &a.vmlinux, &a.initrd, "tick");
    let spec = env.spec("linsnap", &toml)?;
    let vm = env.start(
        "linsnap",
        env.command(&["--config", &spec.to_string_lossy()]),
        1,
    )?;
    let out = env.work.join("linsnap.out");
    let (boot_id, _) = wait_tick(&vm, &out, &|_, _| true)?;
    mark("booted");
    let (snap, up_before) = snapshot_twice(env, &vm, &out)?;
    mark("snapshots taken");
    corrupted_is_refused(env, &snap)?;
    // Only node 1 has room now.
    host::set_2m_pools(&[0, GUEST_PAGES])?;
    let restored = env.start(
        "linsnap-r",
        env.command(&["restore", &snap.to_string_lossy()]),
        1,
    )?;
    mark("restored");
    let out_r = env.work.join("linsnap-r.out");
    let (id, up) = wait_tick(&restored, &out_r, &|_, up| up > up_before)?;
    mark("ticking");
    for line in restored.stderr().lines().filter(|l| l.contains("restore:")) {
        println!("  linsnap: {line}");
    }
    ensure!(
        id == boot_id,
        "the restored guest's boot id {id}, before the snapshot {boot_id}: it booted again"
    );
    ensure!(
        restored
            .stderr()
            .contains("guest cell 0 (1 vCPUs, 96 MiB): node0 in the snapshot, node1 now"),
        "the restore report does not say cell 0 moved from node0 to node1: {}",
        restored.stderr()
    );
    check_placement(env, &restored, &[(1, GUEST_PAGES)].into_iter().collect())?;
    env.signal(restored.pid, libc::SIGTERM)?;
    let code = env.wait(restored.pid)?;
    ensure!(
        code == 130,
        "the restored VM after SIGTERM: exit {code}, want 130"
    );
    mark("stopped");
    let phases: Vec<String> = phases
        .iter()
        .map(|(w, t)| format!("{w} {:.1} s", t.as_secs_f64()))
        .collect();
    println!(
        "  linsnap: uptime {up_before:.2} s at the snapshot, {up:.2} s after the restore; {}",
        phases.join(", ")
    );
    Ok(())
}
