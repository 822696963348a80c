//! End-to-end tests of `vmhost --config vm.toml`: real KVM VMs, real pinning read back from
//! /proc, real hugepages.
#![allow(clippy::unwrap_used)]

mod common;

use common::{root, run_vm, stderr, stdout};
use serde_json::Value;
use std::process::Command;
use vmhost_testsupport::{lock_cpus, lock_pool, need_kvm, need_pages, pool};

const PAGE_2M: u64 = 2 << 20;

fn tmp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("vmhost-run-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn threads(j: &Value) -> Vec<(String, Vec<u64>)> {
    j["start"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            let cpus = t["cpus_allowed"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| c.as_u64().unwrap())
                .collect();
            (t["name"].as_str().unwrap().to_string(), cpus)
        })
        .collect()
}

#[test]
fn quickstart_runs_a_real_vm() {
    if !need_kvm("quickstart_runs_a_real_vm") {
        return;
    }
    let _cpus = lock_cpus();
    // The quickstart takes 2Mi hugepages when the pool has them.
    let _pool = lock_pool();
    let text = std::fs::read_to_string(root().join("configs/quickstart.toml")).unwrap();
    let (code, j, log) = run_vm("quickstart", &text);
    assert_eq!(code, 0, "{log}");
    assert_eq!(j["report"]["status"], "completed", "{log}");
    for v in j["report"]["vcpus"].as_array().unwrap() {
        assert_eq!(v["outcome"]["kind"], "done", "{v}");
    }
    assert_eq!(j["audit"]["regions"][0]["pages_not_present"], 0);
}

#[test]
fn the_default_command_runs_the_embedded_quickstart() {
    if !need_kvm("the_default_command_runs_the_embedded_quickstart") {
        return;
    }
    let _cpus = lock_cpus();
    // The quickstart takes 2Mi hugepages when the pool has them.
    let _pool = lock_pool();
    let run_dir = tmp("default").join("run");
    let o = Command::new(env!("CARGO_BIN_EXE_vmhost"))
        .args(["--run-dir", run_dir.to_str().unwrap()])
        .current_dir(std::env::temp_dir())
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains("VM quickstart: placement read back from /proc at start"),
        "{out}"
    );
    assert!(out.contains("Completed"), "{out}");
}

#[test]
fn dedicated_vcpu_threads_are_pinned_to_their_planned_pus() {
    if !need_kvm("dedicated_vcpu_threads_are_pinned_to_their_planned_pus") {
        return;
    }
    let _cpus = lock_cpus();
    let (code, j, log) = run_vm(
        "pinned",
        "[cpu]\ncores = 2\ndedicated_cpu_placement = true\n[memory]\nguest = \"32Mi\"\n[boot]\npayload = \"halt\"\n",
    );
    assert_eq!(code, 0, "{log}");
    for v in j["plan"]["vcpus"].as_array().unwrap() {
        let name = format!("vcpu{}", v["vcpu"]);
        let (_, allowed) = threads(&j).into_iter().find(|(n, _)| *n == name).unwrap();
        assert_eq!(allowed, vec![v["host_cpu"].as_u64().unwrap()], "{name}");
    }
}

#[test]
fn isolated_emulator_never_shares_the_vcpu_pu() {
    if !need_kvm("isolated_emulator_never_shares_the_vcpu_pu") {
        return;
    }
    let _cpus = lock_cpus();
    let (code, j, log) = run_vm(
        "isolated",
        "[cpu]\ncores = 1\ndedicated_cpu_placement = true\nisolate_emulator_thread = true\n\
         [memory]\nguest = \"32Mi\"\n[boot]\npayload = \"halt\"\n",
    );
    assert_eq!(code, 0, "{log}");
    let vcpu_pu = j["plan"]["vcpus"][0]["host_cpu"].as_u64().unwrap();
    let all = threads(&j);
    assert!(all.len() >= 3, "{all:?}");
    for (name, allowed) in all {
        if name == "vcpu0" {
            assert_eq!(allowed, vec![vcpu_pu]);
        } else {
            assert!(
                !allowed.contains(&vcpu_pu),
                "{name} may run on vCPU PU {vcpu_pu}: {allowed:?}"
            );
        }
    }
}

#[test]
fn touch_on_hugepages_is_resident_on_the_bound_node() {
    if !need_kvm("touch_on_hugepages_is_resident_on_the_bound_node") {
        return;
    }
    let _cpus = lock_cpus();
    let _pool = lock_pool();
    if !need_pages(
        "touch_on_hugepages_is_resident_on_the_bound_node",
        PAGE_2M,
        32,
    ) {
        return;
    }
    let before = pool(PAGE_2M);
    let (code, j, log) = run_vm(
        "touch",
        "[cpu]\ncores = 2\ndedicated_cpu_placement = true\n[memory]\nguest = \"64Mi\"\nhugepages = { page_size = \"2Mi\" }\n",
    );
    assert_eq!(code, 0, "{log}");
    let r = &j["audit"]["regions"][0];
    assert_eq!(r["pages_by_node"]["0"], 32, "{r}");
    assert!(r["violations"].as_array().unwrap().is_empty());
    for v in j["report"]["vcpus"].as_array().unwrap() {
        assert_eq!(v["result"]["kind"], "touch", "{v}");
        assert_eq!(v["result"]["bytes"], 64u64 << 20, "{v}");
    }
    assert_eq!(pool(PAGE_2M), before, "hugepages released");
}

#[test]
fn background_prefault_lets_the_guest_start_first_and_ends_resident_on_the_bound_node() {
    if !need_kvm("background_prefault") {
        return;
    }
    let _cpus = lock_cpus();
    let _pool = lock_pool();
    if !need_pages("background_prefault", PAGE_2M, 32) {
        return;
    }
    let before = pool(PAGE_2M);
    let dir = tmp("bgprefault");
    let spec = dir.join("vm.toml");
    std::fs::write(
        &spec,
        "name = \"bgpf\"\n[cpu]\ncores = 2\ndedicated_cpu_placement = true\n[memory]\nguest = \"64Mi\"\nhugepages = { page_size = \"2Mi\" }\n",
    )
    .unwrap();
    let run = |json: bool| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_vmhost"));
        c.args(["--prefault", "background", "--run-dir"])
            .arg(dir.join("run"))
            .arg("--config")
            .arg(&spec);
        if json {
            c.arg("--json");
        }
        c.output().unwrap()
    };
    // Text: the start-up table leaves residency to the prefault's own report (which may come
    // first: 64 MiB takes milliseconds here), the residency read back when the workers were done.
    let o = run(false);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains("guest RAM: prefaulting in the background"),
        "{out}"
    );
    let done = out
        .find("VM bgpf: guest RAM prefaulted in the background in")
        .expect(&out);
    let residency = out[done..].lines().nth(2).unwrap_or_default();
    assert!(residency.ends_with("node0 100.0%"), "{out}");
    assert_eq!(pool(PAGE_2M), before, "hugepages released");
    // JSON: the audit is the one read at the end of the prefault: every page on node 0.
    let o = run(true);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let j: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(j["prefault"], "background");
    let r = &j["audit"]["regions"][0];
    assert_eq!(r["pages_by_node"]["0"], 32, "{r}");
    assert_eq!(r["pages_not_present"], 0, "{r}");
    assert!(r["violations"].as_array().unwrap().is_empty(), "{r}");
    assert!(j["timeline"]["memory_ready_ns"].as_u64().unwrap() > 0);
    for v in j["report"]["vcpus"].as_array().unwrap() {
        assert_eq!(v["result"]["bytes"], 64u64 << 20, "{v}");
    }
    assert_eq!(pool(PAGE_2M), before, "hugepages released");
    guest_starts_before_the_background_prefault_ends(&dir);
}

/// Shared memory (`RssShmem`, bytes) `pid` has faulted in: the kernel's account of the guest
/// RAM a memfd-backed VM holds.
fn rss_shmem(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb = status
        .lines()
        .find_map(|l| l.strip_prefix("RssShmem:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .expect("RssShmem in /proc/PID/status");
    kb << 10
}

/// The order of the start, from vmhost's timeline and the kernel: with `--prefault background`
/// the guest is released (its API reports it running) while the guest RAM is not yet all
/// faulted in, and the timeline records the vCPUs runnable before the prefault's end.
fn guest_starts_before_the_background_prefault_ends(dir: &std::path::Path) {
    use std::io::Read;
    use std::process::Stdio;
    const GUEST: u64 = 2 << 30;
    let d = dir.join("order");
    std::fs::create_dir_all(&d).unwrap();
    let spec = d.join("vm.toml");
    // Anonymous 4 KiB pages: seconds of prefault here, milliseconds of VM creation.
    std::fs::write(
        &spec,
        "name = \"bgpf-order\"\n[cpu]\ncores = 1\n[memory]\nguest = \"2Gi\"\n[boot]\npayload = \"idle\"\n",
    )
    .unwrap();
    let extra = ["--prefault", "background", "--json"];
    let (mut child, sock) = common::start_with_api(&d, &spec, &extra, Stdio::piped());
    let pid = child.id();
    let faulted_at_start = rss_shmem(pid);
    let mut out = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        out.read_to_string(&mut text).unwrap();
        text
    });
    // The prefault ends (its thread is gone), then the VM is stopped.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while thread_names(pid).iter().any(|n| n == "vmhost-prefault") {
        assert!(
            std::time::Instant::now() < deadline,
            "the prefault never ended"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert_eq!(rss_shmem(pid), GUEST, "all guest RAM faulted in at the end");
    assert_eq!(common::ctl(&sock, "shutdown").0, 0);
    let status = child.wait().unwrap();
    let text = reader.join().unwrap();
    assert_eq!(status.code(), Some(0), "{text}");
    assert!(
        faulted_at_start < GUEST,
        "the guest ran only once all {GUEST} bytes were faulted in"
    );
    let j: Value = serde_json::from_str(&text).unwrap();
    let t = &j["timeline"];
    let (runnable, ready) = (
        t["vcpus_runnable_ns"].as_u64().unwrap(),
        t["memory_ready_ns"].as_u64().unwrap(),
    );
    assert!(runnable > 0 && ready > 0, "{t}");
    assert!(
        runnable < ready,
        "the guest was released after the prefault ended: {t}"
    );
    assert_eq!(j["audit"]["regions"][0]["pages_not_present"], 0, "{j:#}");
}

/// The kernel thread names of process `pid`.
fn thread_names(pid: u32) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| {
            d.filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
                .map(|c| c.trim().to_string())
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn guest_cpuid_describes_a_topology_larger_than_the_host() {
    if !need_kvm("guest_cpuid_describes_a_topology_larger_than_the_host") {
        return;
    }
    let _cpus = lock_cpus();
    let (code, j, log) = run_vm(
        "big",
        "[cpu]\nsockets = 2\ncores = 4\nthreads = 2\n[memory]\nguest = \"64Mi\"\n[boot]\npayload = \"halt\"\n",
    );
    assert_eq!(code, 0, "{log}");
    let vcpus = j["report"]["vcpus"].as_array().unwrap();
    assert_eq!(vcpus.len(), 16);
    for (i, v) in vcpus.iter().enumerate() {
        let leaf1 = v["cpuid"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["leaf"] == 1)
            .unwrap();
        let apic = leaf1["ebx"].as_u64().unwrap() >> 24;
        assert_eq!(
            apic,
            j["plan"]["vcpus"][i]["apic_id"].as_u64().unwrap(),
            "vCPU {i}"
        );
    }
}

#[test]
fn invalid_spec_and_no_fit_leave_no_ledger_entry() {
    let dir = tmp("nofit");
    let path = dir.join("vm.toml");
    std::fs::write(
        &path,
        "[cpu]\ncores = 64\ndedicated_cpu_placement = true\n[memory]\nguest = \"32Mi\"\n",
    )
    .unwrap();
    let run_dir = dir.join("run");
    let o = Command::new(env!("CARGO_BIN_EXE_vmhost"))
        .args([
            "--run-dir",
            run_dir.to_str().unwrap(),
            "--config",
            path.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("dedicated placement needs 64 PUs"),
        "{}",
        stderr(&o)
    );
    let left: Vec<_> = std::fs::read_dir(run_dir.join("vms"))
        .map(|d| d.collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "{left:?}");
}

/// Bytes waiting in the pipe `end` (`FIONREAD`).
fn bytes_in(end: &impl std::os::fd::AsRawFd) -> usize {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD on an open pipe descriptor writes one int to `n`, which outlives the call.
    let rc = unsafe { libc::ioctl(end.as_raw_fd(), libc::FIONREAD, &mut n) };
    assert_eq!(rc, 0);
    usize::try_from(n).unwrap()
}

/// True when `pid`'s `vmhost-serial` thread (the one that drains the guest's output into the
/// pipe) sleeps in `write(2)` on it: the pipe is full, the event the old code hung on (the
/// kernel's account, `/proc/PID/task/TID/syscall`).
fn serial_writer_blocked(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.filter_map(Result::ok).any(|t| {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        let call = std::fs::read_to_string(t.path().join("syscall")).unwrap_or_default();
        comm.trim() == "vmhost-serial"
            && call.split_whitespace().next() == Some(&libc::SYS_write.to_string())
    })
}

/// A Linux guest (a tiny PVH "kernel") that prints without end, run with stdout a pipe nobody
/// reads: once the pipe is full, SIGTERM still ends vmhost, with the ledger entry released. Before,
/// the vCPU blocked in its write to the full pipe and nothing stopped it; the final report, too,
/// would have blocked on stdout forever. stderr names the signal's sender.
#[test]
fn sigterm_ends_vmhost_whose_guest_prints_into_an_unread_stdout() {
    use std::os::fd::AsRawFd;
    use std::process::Stdio;
    use std::time::{Duration, Instant};
    use vmhost_testsupport::pvh::{out8, pvh_elf};
    if !need_kvm("unread_stdout") {
        return;
    }
    let _cpus = lock_cpus();
    let d = tmp("unread-stdout");
    let mut code = out8(0x3f8, b'x');
    code.extend_from_slice(&[0xeb, 0xf7]); // jmp back to the out
    std::fs::write(d.join("kernel.elf"), pvh_elf(&code)).unwrap();
    // A relative kernel path: resolved against the spec's directory.
    let spec = d.join("vm.toml");
    std::fs::write(
        &spec,
        "name = \"chatty\"\n[cpu]\ncores = 1\n[memory]\nguest = \"64Mi\"\n[boot]\nkernel = \"kernel.elf\"\n",
    )
    .unwrap();
    let errlog = std::fs::File::create(d.join("stderr")).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_vmhost"))
        .args(["--run-dir", d.join("run").to_str().unwrap()])
        .args(["--config", spec.to_str().unwrap()])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(errlog)
        .spawn()
        .unwrap();
    let unread = child.stdout.take().unwrap();
    // One page of pipe: the guest fills it at once.
    // SAFETY: fcntl on the pipe's open read end; F_SETPIPE_SZ takes an int argument.
    unsafe { libc::fcntl(unread.as_raw_fd(), libc::F_SETPIPE_SZ, 4096) };
    // The event the old code hung on: the pipe is full, so the next write would block.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !serial_writer_blocked(child.id()) {
        assert!(Instant::now() < deadline, "the guest never filled stdout");
        assert!(child.try_wait().unwrap().is_none(), "vmhost ended early");
        std::thread::sleep(Duration::from_millis(2));
    }
    // SAFETY: kill only sends a signal to our child.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let status = common::wait_exit(&mut child, 30, || "vmhost did not end after SIGTERM".into());
    let err = std::fs::read_to_string(d.join("stderr")).unwrap();
    assert_eq!(status.code(), Some(130), "{err}");
    // Who asked, a warning on stderr: the signal and this test's pid.
    let asked = format!("SIGTERM from pid {} (", std::process::id());
    assert!(err.contains(&asked), "no `{asked}` on stderr: {err}");
    // Nobody read stdout: the guest's output and the report were given up, not waited for.
    assert!(bytes_in(&unread) > 0, "{err}");
    let ps = common::vmhost(&["ps", "--json", "--run-dir", d.join("run").to_str().unwrap()]);
    let ps: Value = serde_json::from_slice(&ps.stdout).unwrap();
    assert!(ps["entries"].as_array().unwrap().is_empty(), "{ps}");
    drop(unread);
    std::fs::remove_dir_all(&d).unwrap();
}
