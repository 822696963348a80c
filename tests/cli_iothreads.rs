//! Device I/O threads end to end on this host's /dev/kvm: a Linux-boot VM (a tiny PVH kernel
//! that halts forever, so its virtio devices are attached) with two virtio disks, one with a
//! dedicated I/O thread, and rng. Every `vmhost-io-<n>` thread's affinity is read back from
//! `/proc/<pid>/task/*/status` and must equal the plan (`vmhost plan --json`), never include a
//! vCPU's PU, and be what the control API's placement view lists.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::Value;
use vmhost_testsupport::pvh::pvh_elf;
use vmhost_testsupport::{lock_cpus, need_kvm};

fn dir(test: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("vmhost-io-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The spec: `head` (top-level keys), `cpu` lines, disk `a` (empty disk), disk `b` (an image,
/// with a dedicated I/O thread), rng, and a PVH kernel that halts forever.
fn write_spec(d: &Path, head: &str, cpu: &str) -> PathBuf {
    // hlt; jmp back to the hlt (interrupts are off at the PVH entry: the vCPU sleeps in KVM).
    std::fs::write(d.join("kernel.elf"), pvh_elf(&[0xf4, 0xeb, 0xfd])).unwrap();
    std::fs::write(d.join("b.img"), vec![0u8; 1 << 20]).unwrap();
    let spec = format!(
        r#"name = "io-e2e"
{head}
[cpu]
{cpu}
[memory]
guest = "64Mi"
[devices]
rng = {{}}
[[devices.disks]]
name = "a"
[[devices.disks]]
name = "b"
dedicated_io_thread = true
[[volumes]]
name = "a"
empty_disk = {{ capacity = "1Mi" }}
[[volumes]]
name = "b"
host_disk = {{ path = "{}" }}
[boot]
kernel = "kernel.elf"
"#,
        d.join("b.img").display()
    );
    let path = d.join("vm.toml");
    std::fs::write(&path, spec).unwrap();
    path
}

fn vmhost(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_vmhost"))
        .args(args)
        .output()
        .unwrap()
}

fn cpulist(text: &str) -> Vec<u32> {
    vmhost_topology::cpulist::parse(text.trim()).unwrap()
}

/// `vmhost-io-*` threads of process `pid`: name → (tid, allowed PUs), from `/proc`.
fn io_threads(pid: u32) -> BTreeMap<String, (i64, Vec<u32>)> {
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let path = e.unwrap().path();
        let Ok(comm) = std::fs::read_to_string(path.join("comm")) else {
            continue;
        };
        let name = comm.trim().to_string();
        if !name.starts_with("vmhost-io-") {
            continue;
        }
        let status = std::fs::read_to_string(path.join("status")).unwrap();
        let allowed = status
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
            .map(cpulist)
            .unwrap();
        let tid = path.file_name().unwrap().to_str().unwrap().parse().unwrap();
        out.insert(name, (tid, allowed));
    }
    out
}

fn u32s(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| u32::try_from(x.as_u64().unwrap()).unwrap())
        .collect()
}

/// Plans, starts, and checks every I/O thread against the plan, the vCPUs and the API;
/// returns the plan's I/O threads (JSON) for the caller's own checks.
fn run_and_check(test: &str, head: &str, cpu: &str) -> Vec<Value> {
    let d = dir(test);
    let spec = write_spec(&d, head, cpu);
    let run = d.join("run");
    let o = vmhost(&[
        "plan",
        "--json",
        "--run-dir",
        run.to_str().unwrap(),
        "--config",
        spec.to_str().unwrap(),
    ]);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    let plan: Value = serde_json::from_slice(&o.stdout).unwrap();
    let planned = plan["devices"]["io_threads"].as_array().unwrap().clone();
    let vcpu_pus: Vec<u32> = plan["vcpus"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v["host_cpu"].as_u64())
        .map(|c| u32::try_from(c).unwrap())
        .collect();
    assert_eq!(vcpu_pus.len(), 1, "a dedicated vCPU");

    let (mut child, sock) = common::start_with_api(&d, &spec, &[], Stdio::piped());
    let live = io_threads(child.id());
    let view = common::ctl(&sock, "placement").1;
    // Stop before asserting, so a failure leaves no VM behind.
    // SAFETY: kill(2) on our own child's pid with SIGTERM; no memory is involved.
    unsafe { libc::kill(i32::try_from(child.id()).unwrap(), libc::SIGTERM) };
    let status = child.wait().unwrap();
    let _ = std::fs::remove_dir_all(&d);

    assert_eq!(
        live.keys().collect::<Vec<_>>(),
        planned
            .iter()
            .map(|t| t["name"].as_str().unwrap())
            .collect::<Vec<_>>()
            .iter()
            .collect::<Vec<_>>(),
        "the threads running are the planned ones"
    );
    for t in &planned {
        let name = t["name"].as_str().unwrap();
        let want = u32s(&t["host_cpus"]);
        assert!(!want.is_empty(), "{name}: planned PUs");
        let (tid, allowed) = &live[name];
        assert_eq!(allowed, &want, "{name}: Cpus_allowed_list = the plan");
        assert!(
            !allowed.iter().any(|c| vcpu_pus.contains(c)),
            "{name} may run on a vCPU PU: {allowed:?} vs {vcpu_pus:?}"
        );
        let listed = view["io_threads"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == name)
            .unwrap_or_else(|| panic!("{name} not in the placement view: {view}"));
        assert_eq!(listed["thread"]["tid"].as_i64(), Some(*tid), "{name}: tid");
        assert_eq!(u32s(&listed["thread"]["cpus_allowed"]), want);
        assert_eq!(u32s(&listed["planned_cpus"]), want);
        assert!(listed["deviation"].is_null(), "{listed}");
    }
    assert_eq!(view["deviations"], 0, "{view}");
    assert_eq!(status.code(), Some(130), "stopped by SIGTERM");
    planned
}

#[test]
fn io_threads_share_the_isolated_emulator_pu_never_a_vcpu_pu() {
    let test = "io_threads_share_the_isolated_emulator_pu_never_a_vcpu_pu";
    if !need_kvm(test) {
        return;
    }
    let _cpus = lock_cpus();
    let planned = run_and_check(
        "emulator",
        "io_threads_policy = \"shared\"",
        "cores = 1\ndedicated_cpu_placement = true\nisolate_emulator_thread = true",
    );
    let roles: Vec<&str> = planned
        .iter()
        .map(|t| t["role"].as_str().unwrap())
        .collect();
    assert_eq!(roles, ["shared", "dedicated"]);
    assert_eq!(
        planned[0]["devices"],
        serde_json::json!([0, 2]),
        "disk a and rng"
    );
    assert_eq!(
        planned[1]["devices"],
        serde_json::json!([1]),
        "disk b alone"
    );
}

#[test]
fn a_supplemental_pool_thread_runs_on_a_pu_of_its_own() {
    let test = "a_supplemental_pool_thread_runs_on_a_pu_of_its_own";
    if !need_kvm(test) {
        return;
    }
    let _cpus = lock_cpus();
    let planned = run_and_check(
        "pool",
        "io_threads_policy = \"supplementalPool\"\nio_threads = { supplemental_pool_thread_count = 1 }",
        "cores = 1\ndedicated_cpu_placement = true",
    );
    assert_eq!(planned.len(), 1);
    assert_eq!(planned[0]["role"], "supplemental_pool");
    assert_eq!(planned[0]["exclusive"], true);
    assert_eq!(planned[0]["devices"], serde_json::json!([0, 1, 2]));
}

/// The example manifest plans as its comment says, on any 2-PU host.
#[test]
fn the_example_manifest_plans_two_io_threads_on_the_emulator_pu() {
    let yaml = common::root().join("configs/iothreads.yaml");
    let o = vmhost(&[
        "plan",
        "--json",
        "--topology",
        "synthetic:package:1 numa:1 core:2 pu:1",
        "--config",
        yaml.to_str().unwrap(),
    ]);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let plan: Value = serde_json::from_slice(&o.stdout).unwrap();
    let threads = plan["devices"]["io_threads"].as_array().unwrap();
    let emulator = u32s(&plan["emulator"]["host_cpus"]);
    assert_eq!(threads.len(), 2);
    for t in threads {
        assert_eq!(u32s(&t["host_cpus"]), emulator);
    }
    assert_eq!(threads[1]["role"], "dedicated");
}
