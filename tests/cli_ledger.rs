//! Several VMs on one host: real `vmhost` processes sharing a host ledger (their own run
//! directory), dedicated PUs read back from /proc.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::vmhost_json;
use vmhost_testsupport::{lock_cpus, need_kvm};

struct Vm {
    child: Child,
    name: String,
}

impl Drop for Vm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn dir(test: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("vmhost-ledger-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn spec(d: &Path, name: &str) -> PathBuf {
    let p = d.join(format!("{name}.toml"));
    std::fs::write(
        &p,
        format!("name = \"{name}\"\n[cpu]\ncores = 1\ndedicated_cpu_placement = true\n[memory]\nguest = \"16Mi\"\n[boot]\npayload = \"idle\"\n"),
    )
    .unwrap();
    p
}

fn start(d: &Path, name: &str) -> Vm {
    let child = Command::new(env!("CARGO_BIN_EXE_vmhost"))
        .args([
            "--run-dir",
            d.join("run").to_str().unwrap(),
            "--config",
            spec(d, name).to_str().unwrap(),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    Vm {
        child,
        name: name.to_string(),
    }
}

/// The PU the process's vcpu0 thread is allowed on, once it exists (read from /proc).
fn vcpu0_pu(pid: u32) -> Option<u32> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        if stat
            .rsplit(')')
            .next()
            .is_some_and(|rest| rest.trim_start().starts_with('Z'))
        {
            return None; // exited, not yet reaped
        }
        if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
            for t in tasks.flatten() {
                let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
                if comm.trim() == "vcpu0" {
                    let status =
                        std::fs::read_to_string(t.path().join("status")).unwrap_or_default();
                    let list = status
                        .lines()
                        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))?
                        .trim()
                        .to_string();
                    return list.parse().ok();
                }
            }
        } else {
            return None; // exited
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

fn finish(mut vm: Vm) -> (i32, String) {
    let out = std::mem::replace(&mut vm.child, Command::new("true").spawn().unwrap())
        .wait_with_output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn sigterm(vm: &Vm) {
    Command::new("kill")
        .args(["-TERM", &vm.child.id().to_string()])
        .status()
        .unwrap();
}

#[test]
fn two_dedicated_vms_get_distinct_pus_a_third_is_refused_and_a_killed_ones_pu_is_reused() {
    if !need_kvm("ledger_two_vms") {
        return;
    }
    let _cpus = lock_cpus();
    let d = dir("three");
    let a = start(&d, "vm-a");
    let pa = vcpu0_pu(a.child.id()).expect("vm-a runs");
    let b = start(&d, "vm-b");
    let pb = vcpu0_pu(b.child.id()).expect("vm-b runs");
    assert_ne!(pa, pb, "two dedicated VMs pinned to the same PU");

    let (code, ps) = vmhost_json(&["ps", "--json", "--run-dir", d.join("run").to_str().unwrap()]);
    assert_eq!(code, 0);
    let names: Vec<&str> = ps["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["entry"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(names.len(), 2, "{ps}");
    assert!(
        ps["entries"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| e["liveness"] == "alive" && e["entry"]["state"] == "running"),
        "{ps}"
    );

    let c = start(&d, "vm-c");
    let (code, err) = finish(c);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("dedicated placement needs 1 PUs"), "{err}");

    // SIGKILL vm-a: no orderly release; the next start reclaims its PU.
    let mut a = a;
    a.child.kill().unwrap();
    a.child.wait().unwrap();
    let d2 = start(&d, "vm-d");
    assert_eq!(
        vcpu0_pu(d2.child.id()),
        Some(pa),
        "vm-d should get vm-a's PU"
    );

    sigterm(&b);
    sigterm(&d2);
    let (cb, eb) = finish(b);
    let (cd, ed) = finish(d2);
    assert_eq!((cb, cd), (0, 0), "{eb}\n{ed}");
    let (_, ps) = vmhost_json(&["ps", "--json", "--run-dir", d.join("run").to_str().unwrap()]);
    assert!(
        ps["entries"].as_array().unwrap().is_empty(),
        "orderly stops release their entries: {ps}"
    );
}

#[test]
fn a_running_vms_name_is_refused() {
    if !need_kvm("ledger_names") {
        return;
    }
    let _cpus = lock_cpus();
    let d = dir("names");
    let a = start(&d, "same");
    vcpu0_pu(a.child.id()).expect("first runs");
    let (code, err) = finish(start(&d, "same"));
    assert_ne!(code, 0);
    assert!(err.contains("same") && err.contains("already"), "{err}");
    sigterm(&a);
    assert_eq!(finish(a).0, 0);
}

#[test]
fn parallel_starts_never_share_a_pu() {
    if !need_kvm("ledger_race") {
        return;
    }
    let _cpus = lock_cpus();
    let d = dir("race");
    let vms: Vec<Vm> = (0..5).map(|i| start(&d, &format!("race-{i}"))).collect();
    let mut running = Vec::new();
    let mut refused = 0;
    for vm in vms {
        match vcpu0_pu(vm.child.id()) {
            Some(pu) => running.push((pu, vm)),
            None => {
                let name = vm.name.clone();
                let (code, err) = finish(vm);
                assert_eq!(code, 3, "{name}: {err}");
                refused += 1;
            }
        }
    }
    let pus: std::collections::BTreeSet<u32> = running.iter().map(|(p, _)| *p).collect();
    assert_eq!(pus.len(), running.len(), "a PU given twice");
    let cpus = std::thread::available_parallelism().unwrap().get();
    assert_eq!(running.len(), cpus.min(5), "as many VMs as PUs");
    assert_eq!(refused, 5 - running.len());
    for (_, vm) in &running {
        sigterm(vm);
    }
    for (_, vm) in running {
        assert_eq!(finish(vm).0, 0);
    }
}

#[test]
fn ledger_gc_reclaims_dead_entries() {
    if !need_kvm("ledger_gc") {
        return;
    }
    let _cpus = lock_cpus();
    let d = dir("gc");
    let mut a = start(&d, "doomed");
    vcpu0_pu(a.child.id()).expect("runs");
    a.child.kill().unwrap();
    a.child.wait().unwrap();
    let (code, ps) = vmhost_json(&["ps", "--json", "--run-dir", d.join("run").to_str().unwrap()]);
    assert_eq!(code, 0);
    assert_eq!(ps["entries"][0]["liveness"], "exited", "{ps}");
    let (code, gc) = vmhost_json(&[
        "ledger",
        "gc",
        "--json",
        "--run-dir",
        d.join("run").to_str().unwrap(),
    ]);
    assert_eq!(code, 0);
    assert_eq!(gc[0]["name"], "doomed", "{gc}");
    let (_, ps) = vmhost_json(&["ps", "--json", "--run-dir", d.join("run").to_str().unwrap()]);
    assert!(ps["entries"].as_array().unwrap().is_empty());
}

#[test]
fn an_unwritable_run_directory_is_named() {
    let d = dir("unwritable");
    let o = Command::new(env!("CARGO_BIN_EXE_vmhost"))
        .args([
            "--run-dir",
            "/dev/null/vmhost",
            "--config",
            spec(&d, "x").to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("/dev/null/vmhost"), "{err}");
}
