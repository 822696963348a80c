//! The control API and envelope enforcement on a real running VM: `vmhost --api-socket`,
//! `vmhost ctl`, `--cgroup` (this host's cgroups), the memory limit's clear stop.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use vmhost_testsupport::{lock_cpus, lock_pool, need_kvm, need_pages};

const PAGE_2M: u64 = 2 << 20;

/// [`common::start_with_api`] with `spec` written to `<d>/vm.toml`; stdout is not read.
fn start(d: &Path, spec: &str, extra: &[&str]) -> (Child, PathBuf) {
    let path = d.join("vm.toml");
    std::fs::write(&path, spec).unwrap();
    common::start_with_api(d, &path, extra, Stdio::null())
}

fn dir(test: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("vmhost-api-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

const IDLE: &str = "name = \"api-vm\"\n[cpu]\ncores = 1\ndedicated_cpu_placement = true\nisolate_emulator_thread = true\n\
     [memory]\nguest = \"32Mi\"\nhugepages = { page_size = \"2Mi\" }\n[boot]\npayload = \"idle\"\n";

#[test]
fn api_reports_live_placement_and_resources_and_controls_the_vm() {
    if !need_kvm("api") {
        return;
    }
    let _cpus = lock_cpus();
    let _pool = lock_pool();
    if !need_pages("api", PAGE_2M, 16) {
        return;
    }
    let d = dir("routes");
    let (mut child, sock) = start(&d, IDLE, &["--cgroup", "vmhost-api-test"]);
    let mode = std::fs::metadata(&sock)
        .map(|m| std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o777)
        .unwrap();
    assert_eq!(mode, 0o600);

    let (code, info) = common::ctl(&sock, "info");
    assert_eq!(code, 0);
    assert_eq!(info["name"], "api-vm");
    assert_eq!(info["pid"], child.id());

    // KVM's worker thread appears at the first KVM_RUN and is moved within a second.
    std::thread::sleep(Duration::from_millis(1200));
    let (_, p) = common::ctl(&sock, "placement");
    assert_eq!(p["deviations"], 0, "{p:#}");
    let vcpu = &p["vcpus"][0];
    assert_eq!(
        vcpu["thread"]["cpus_allowed"],
        serde_json::json!([vcpu["planned_cpu"]])
    );
    assert_eq!(p["memory"][0]["pages_by_node"]["0"], 16, "{p:#}");
    assert_eq!(p["memory"][0]["policy"], "bind:0");

    let (_, r) = common::ctl(&sock, "resources");
    assert_eq!(r["measured"]["guest_memory_bytes"], 32 << 20);
    assert_eq!(r["measured"]["hugetlb_bytes"], 32 << 20);
    assert!(r["measured"]["rss_beyond_guest_bytes"].as_u64().unwrap() > 0);
    assert!(r["measured"]["threads"]
        .as_array()
        .unwrap()
        .iter()
        .any(|t| t["name"] == "vcpu0"));
    // The default build is a static-pie binary (docs/dependencies.md, "Static linking"): the
    // running VMM maps no dynamic loader and no shared library.
    if cfg!(target_feature = "crt-static") {
        let maps = std::fs::read_to_string(format!("/proc/{}/maps", child.id())).unwrap();
        let shared: Vec<&str> = maps.lines().filter(|l| l.contains(".so")).collect();
        assert!(shared.is_empty(), "shared objects mapped: {shared:#?}");
    }
    // The cgroup's limits read back equal the plan.
    let limits = &r["measured"]["cgroup"]["limits"];
    let env = &r["envelope"];
    let mut cpus: Vec<u64> = vec![vcpu["planned_cpu"].as_u64().unwrap()];
    cpus.extend(
        p["emulator"]["planned_cpus"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c.as_u64().unwrap()),
    );
    cpus.sort_unstable();
    assert_eq!(limits["cpus"], serde_json::json!(cpus), "{r:#}");
    assert_eq!(limits["mems"], serde_json::json!([0]));
    assert_eq!(
        limits["memory_max_bytes"].as_u64().unwrap(),
        env["memory_limit_bytes"].as_u64().unwrap().div_ceil(4096) * 4096
    );
    assert_eq!(
        limits["hugetlb"],
        serde_json::json!([[PAGE_2M, 32u64 << 20]])
    );

    assert_eq!(
        common::ctl(&sock, "pause"),
        (0, serde_json::json!({"state": "paused"}))
    );
    let (code, again) = common::ctl(&sock, "pause");
    assert_eq!(code, 1);
    assert_eq!(again["error"], "the VM is already paused");
    assert_eq!(common::ctl(&sock, "info").1["state"], "paused");
    assert_eq!(
        common::ctl(&sock, "resume"),
        (0, serde_json::json!({"state": "running"}))
    );
    assert_eq!(common::ctl(&sock, "shutdown").0, 0);
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(0));
    assert!(!sock.exists(), "the socket is removed at stop");
    assert!(
        !Path::new("/sys/fs/cgroup/cpuset/vmhost/vmhost-api-test").exists(),
        "the cgroup is removed at stop"
    );
}

#[test]
fn ctl_without_a_running_vm_says_so() {
    let d = dir("nosock");
    let o = Command::new(env!("CARGO_BIN_EXE_vmhost"))
        .args([
            "ctl",
            "--api-socket",
            d.join("none.sock").to_str().unwrap(),
            "info",
        ])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("--api-socket"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn a_too_small_envelope_stops_the_vm_with_a_clear_message() {
    if !need_kvm("limit") {
        return;
    }
    let _cpus = lock_cpus();
    let d = dir("limit");
    let path = d.join("vm.toml");
    // Anonymous guest RAM is charged to the memory cgroup: 64 MiB cannot fit in 32 MiB.
    std::fs::write(
        &path,
        "name = \"tight\"\n[cpu]\ncores = 1\n[memory]\nguest = \"64Mi\"\n",
    )
    .unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_vmhost"))
        .args([
            "--run-dir",
            d.join("run").to_str().unwrap(),
            "--cgroup",
            "vmhost-limit-test",
            "--cgroup-memory-limit",
            "33554432",
        ])
        .args(["--config", path.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(5), "{err}");
    assert!(
        err.contains("reached the memory limit of its envelope (33554432 bytes"),
        "{err}"
    );
    assert!(
        err.contains("raise memory.reserved_overhead.added_overhead"),
        "{err}"
    );
    assert!(
        !Path::new("/sys/fs/cgroup/memory/vmhost/vmhost-limit-test").exists(),
        "cgroup removed on the error path"
    );
}

#[test]
fn a_stop_signal_during_setup_stops_the_vm_in_order() {
    if !need_kvm("signal_during_setup") {
        return;
    }
    let _cpus = lock_cpus();
    let d = dir("early-signal");
    let path = d.join("vm.toml");
    // 1 GiB of anonymous memory: the prefault takes a while, the signal lands in it or soon after.
    std::fs::write(&path, "name = \"early\"\n[cpu]\ncores = 1\n[memory]\nguest = \"1Gi\"\n[boot]\npayload = \"idle\"\n").unwrap();
    let sock = d.join("api.sock");
    let mut child = Command::new(env!("CARGO_BIN_EXE_vmhost"))
        .args([
            "--run-dir",
            d.join("run").to_str().unwrap(),
            "--api-socket",
            sock.to_str().unwrap(),
        ])
        .args([
            "--cgroup",
            "vmhost-early-signal",
            "--config",
            path.to_str().unwrap(),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(30));
    Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    let status = child.wait().unwrap();
    // Stopping an idle VM is its normal end; no thread took the signal's default action.
    assert_eq!(status.code(), Some(0), "{status:?}");
    assert!(!sock.exists(), "socket removed");
    assert!(
        !Path::new("/sys/fs/cgroup/cpuset/vmhost/vmhost-early-signal").exists(),
        "cgroup removed"
    );
    let (_, ps) =
        common::vmhost_json(&["ps", "--json", "--run-dir", d.join("run").to_str().unwrap()]);
    assert!(ps["entries"].as_array().unwrap().is_empty(), "{ps}");
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
fn sighup_and_sigquit_stop_the_vm_in_order_like_sigterm() {
    if !need_kvm("hup_quit") {
        return;
    }
    let _cpus = lock_cpus();
    for sig in ["HUP", "QUIT"] {
        let d = dir(&format!("sig-{sig}"));
        let spec = "name = \"hup\"\n[cpu]\ncores = 1\n[memory]\nguest = \"32Mi\"\n[boot]\npayload = \"idle\"\n";
        let (mut child, sock) = start(&d, spec, &[]);
        Command::new("kill")
            .args([&format!("-{sig}"), &child.id().to_string()])
            .status()
            .unwrap();
        let status = child.wait().unwrap();
        // Before: the default action killed vmhost, leaving the socket and the ledger entry.
        assert_eq!(status.code(), Some(0), "SIG{sig}: {status:?}");
        assert!(!sock.exists(), "SIG{sig}: socket removed");
        let (_, ps) =
            common::vmhost_json(&["ps", "--json", "--run-dir", d.join("run").to_str().unwrap()]);
        assert!(
            ps["entries"].as_array().unwrap().is_empty(),
            "SIG{sig}: {ps}"
        );
    }
}

#[test]
fn a_stop_during_a_long_prefault_stops_at_once() {
    if !need_kvm("prefault_stop") {
        return;
    }
    let _cpus = lock_cpus();
    let d = dir("prefault-stop");
    let path = d.join("vm.toml");
    // 4 GiB of anonymous memory: seconds of prefault on these hosts.
    std::fs::write(
        &path,
        "name = \"big\"\n[cpu]\ncores = 1\n[memory]\nguest = \"4Gi\"\n",
    )
    .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_vmhost"))
        .args(["--run-dir", d.join("run").to_str().unwrap()])
        .args(["--config", path.to_str().unwrap()])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !thread_names(child.id())
        .iter()
        .any(|n| n.starts_with("prefault-"))
    {
        assert!(Instant::now() < deadline, "the prefault never started");
        std::thread::sleep(Duration::from_millis(2));
    }
    let sent = Instant::now();
    Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    let status = child.wait().unwrap();
    let took = sent.elapsed();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    println!("stopped {took:?} after SIGTERM");
    assert_eq!(status.code(), Some(130), "{err}");
    assert!(
        err.contains("stopped by a signal while its guest memory was set up"),
        "{err}"
    );
    assert!(took < Duration::from_secs(1), "took {took:?}: {err}");
    let (_, ps) =
        common::vmhost_json(&["ps", "--json", "--run-dir", d.join("run").to_str().unwrap()]);
    assert!(ps["entries"].as_array().unwrap().is_empty(), "{ps}");
}
