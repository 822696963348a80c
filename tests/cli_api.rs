//! The control API and envelope enforcement on a real running VM: `vmhost --api-socket`,
//! `vmhost ctl`, `--cgroup` (this host's cgroups), the memory limit's clear stop.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
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

/// Holds the exclusive `flock` on `<run>/ledger.lock`, as a start admitting a VM (or a stuck
/// `vmhost` command) would; released when dropped.
fn hold_ledger_lock(run: &Path) -> std::fs::File {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(run)
        .unwrap();
    let lock = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(run.join("ledger.lock"))
        .unwrap();
    // SAFETY: `lock` owns an open descriptor; flock touches no memory.
    assert_eq!(unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) }, 0);
    lock
}

/// Reads `child`'s stderr until a line contains `marker`; fails with what it printed when it
/// ends first. Returns the lines read and a thread collecting the rest.
fn wait_for_stderr(child: &mut Child, marker: &str) -> (String, std::thread::JoinHandle<String>) {
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut seen = String::new();
    loop {
        match lines.next() {
            Some(Ok(line)) => {
                seen.push_str(&line);
                seen.push('\n');
                if line.contains(marker) {
                    break;
                }
            }
            _ => panic!("vmhost ended (or closed stderr) before {marker:?}:\n{seen}"),
        }
    }
    let rest =
        std::thread::spawn(move || lines.map_while(Result::ok).collect::<Vec<_>>().join("\n"));
    (seen, rest)
}

fn kill(pid: u32, sig: &str) {
    let status = Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill -{sig} {pid}");
}

/// The entries of the ledger in `run` (`vmhost ps`).
fn ledger_entries(run: &Path) -> serde_json::Value {
    let (_, ps) = common::vmhost_json(&["ps", "--json", "--run-dir", run.to_str().unwrap()]);
    ps["entries"].clone()
}

/// Each stop signal while a start waits for the ledger lock (a setup step that can last 30 s)
/// ends the start in order: exit 130 naming the signal and the step, no ledger entry, no API
/// socket. Before, the signal was blocked only once the run began, so its default action
/// killed vmhost here (`signal: 15 (SIGTERM)`).
#[test]
fn a_stop_signal_during_setup_stops_the_vm_in_order() {
    for sig in ["TERM", "INT", "HUP", "QUIT"] {
        let d = dir(&format!("setup-{sig}"));
        let run = d.join("run");
        let path = d.join("vm.toml");
        std::fs::write(&path, IDLE).unwrap();
        let sock = d.join("api.sock");
        let lock = hold_ledger_lock(&run);
        let mut child = Command::new(env!("CARGO_BIN_EXE_vmhost"))
            .args(["--run-dir", run.to_str().unwrap()])
            .args(["--api-socket", sock.to_str().unwrap()])
            .args(["--config", path.to_str().unwrap()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (seen, rest) = wait_for_stderr(&mut child, "waiting for the ledger lock");
        assert!(
            seen.contains(&format!("held by process {}", std::process::id())),
            "{seen}"
        );
        kill(child.id(), sig);
        let status = child.wait().unwrap();
        let err = format!("{seen}{}", rest.join().unwrap());
        assert_eq!(status.code(), Some(130), "SIG{sig}: {status:?}\n{err}");
        assert!(
            err.contains(&format!(
                "stopped by SIG{sig} while waiting for the ledger lock"
            )),
            "{err}"
        );
        drop(lock);
        assert!(!sock.exists(), "SIG{sig}: no socket");
        assert_eq!(ledger_entries(&run), serde_json::json!([]), "SIG{sig}");
    }
}

/// A SIGTERM that comes before the spec has been read (the spec is a FIFO the test writes only
/// after the signal) ends the start in order. Before, it killed vmhost by its default action.
#[test]
fn a_stop_signal_before_the_spec_is_read_stops_the_start_in_order() {
    let d = dir("fifo-spec");
    let run = d.join("run");
    let fifo = d.join("vm.toml");
    let made = Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(made.success(), "mkfifo {}", fifo.display());
    let child = Command::new(env!("CARGO_BIN_EXE_vmhost"))
        .args(["--run-dir", run.to_str().unwrap()])
        .args(["--config", fifo.to_str().unwrap()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Opening the write end returns once vmhost has opened the read end: it is reading the spec.
    let mut writer = std::fs::OpenOptions::new().write(true).open(&fifo).unwrap();
    kill(child.id(), "TERM");
    // A vmhost the signal killed has closed the pipe: its exit status below says so.
    let _ = writer.write_all(IDLE.as_bytes());
    drop(writer);
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{:?}\n{err}", out.status);
    assert!(
        err.contains("stopped by SIGTERM while the spec was read"),
        "{err}"
    );
    assert!(
        !run.join("vms").exists() || ledger_entries(&run) == serde_json::json!([]),
        "no ledger entry"
    );
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
    let child = Command::new(env!("CARGO_BIN_EXE_vmhost"))
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
    kill(child.id(), "TERM");
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{err}");
    // "At once" as an order of events, not a duration: the prefault stopped part way.
    let marker = "stopped by a signal while its guest memory was set up (";
    let at = err.find(marker).unwrap_or_else(|| panic!("{err}")) + marker.len();
    let progress: Vec<u64> = err[at..]
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .take(2)
        .collect();
    assert_eq!(progress.len(), 2, "{err}");
    assert!(
        progress[0] < progress[1],
        "the prefault had finished: {err}"
    );
    assert_eq!(progress[1], 4096, "{err}");
    let (_, ps) =
        common::vmhost_json(&["ps", "--json", "--run-dir", d.join("run").to_str().unwrap()]);
    assert!(ps["entries"].as_array().unwrap().is_empty(), "{ps}");
}

/// glibc's per-thread arenas in `pid`'s address space, from the kernel's account
/// (`/proc/<pid>/maps`): an anonymous read-write mapping at a 64 MiB-aligned address followed
/// at once by the rest of its 64 MiB reserved with no access, the shape of every heap glibc
/// makes for an arena other than the main one (`HEAP_MAX_SIZE` on 64-bit).
fn thread_arenas(pid: u32) -> usize {
    const HEAP: u64 = 64 << 20;
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    let rows: Vec<(u64, u64, String, bool)> = maps
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let (lo, hi) = f[0].split_once('-').unwrap();
            let parse = |v| u64::from_str_radix(v, 16).unwrap();
            (parse(lo), parse(hi), f[1].to_string(), f.len() < 6)
        })
        .collect();
    rows.windows(2)
        .filter(|w| {
            let (a, b) = (&w[0], &w[1]);
            a.3 && b.3
                && a.0 % HEAP == 0
                && a.2 == "rw-p"
                && b.2 == "---p"
                && a.1 == b.0
                && b.1 == a.0 + HEAP
        })
        .count()
}

/// vmhost serves every thread from glibc's main arena (`sys::single_malloc_arena`): with the
/// VM running and its API thread answering, the process has no per-thread arena. The same VM
/// started with the user's own `MALLOC_ARENA_MAX` has glibc's per-thread arenas again (the
/// count sees them, and a chosen count is kept).
#[test]
fn every_thread_allocates_from_the_main_arena_unless_the_user_chose_otherwise() {
    if !need_kvm("arenas") {
        return;
    }
    let _cpus = lock_cpus();
    let _pool = lock_pool();
    if !need_pages("arenas", PAGE_2M, 16) {
        return;
    }
    for (chosen, want_some) in [(None, false), (Some("8"), true)] {
        let d = dir(&format!("arenas-{}", chosen.unwrap_or("default")));
        let spec = d.join("vm.toml");
        std::fs::write(&spec, IDLE).unwrap();
        let env: Vec<(&str, &str)> = chosen
            .map(|n| ("MALLOC_ARENA_MAX", n))
            .into_iter()
            .collect();
        let (mut child, sock) = common::start_with_api_env(&d, &spec, &[], Stdio::null(), &env);
        // Every answer is built on the API thread: it allocates as much as any thread does.
        for _ in 0..4 {
            assert_eq!(common::ctl(&sock, "info").1["state"], "running");
        }
        let arenas = thread_arenas(child.id());
        assert_eq!(
            arenas > 0,
            want_some,
            "MALLOC_ARENA_MAX {chosen:?}: {arenas} per-thread arenas in /proc/{}/maps",
            child.id()
        );
        assert_eq!(common::ctl(&sock, "shutdown").0, 0);
        assert_eq!(child.wait().unwrap().code(), Some(0));
    }
}
