//! Live migration end to end with the real binaries, real `/dev/kvm` and 2 MiB hugepages:
//! `vmhost receive` and `vmhost ctl … migrate` over a Unix socket and over TCP on 127.0.0.1
//! (the guest continues on the target and verifies its RAM pattern there, the pages sent, the
//! source exits 0, one ledger entry, every hugepage back), a wrong key refused while the source runs on, and the failure rules with the test
//! hook `VMHOST_TEST_MIGRATION_FAIL_AT` (the target killed at a round: the source runs on; the
//! source killed: the target ends non-zero with its pages back).
#![allow(clippy::unwrap_used)]

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use serde_json::Value;
use vmhost_persist::auth::{handshake, AuthKey, Role};
use vmhost_persist::container::{Reader, RecordKind, Writer};
use vmhost_persist::migration::{self, Answer, Hello};
use vmhost_testsupport::{lock_cpus, lock_pool, need_kvm, need_pages, pool};

const PAGE_2M: u64 = 2 << 20;

const IDLE: &str = "name = \"mig-vm\"\n[cpu]\ncores = 1\n\
     [memory]\nguest = \"32Mi\"\nhugepages = { page_size = \"2Mi\" }\n[boot]\npayload = \"idle\"\n";

fn dir(test: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("vmhost-mig-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(d.join("vm.toml"), IDLE).unwrap();
    for (name, byte) in [("key", 7u8), ("other-key", 9u8)] {
        let p = d.join(name);
        std::fs::write(&p, [byte; 48]).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    d
}

fn vmhost(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_vmhost"))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

/// Kills the processes it names when a test panics, so that a failing test leaves no VM
/// holding hugepages.
struct KillOnPanic(Vec<u32>);

impl Drop for KillOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for pid in &self.0 {
                let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            }
        }
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let _ = self.child.kill();
        }
    }
}

/// A running `vmhost receive` and its stderr lines.
struct Target {
    child: Child,
    lines: Receiver<String>,
    seen: Vec<String>,
}

impl Target {
    /// Starts `vmhost receive` with its own API socket; waits for its "listening" line.
    fn start(d: &Path, listen: &str, key: &str, api: &Path, env: &[(&str, &str)]) -> Target {
        let mut child = Command::new(env!("CARGO_BIN_EXE_vmhost"))
            .args(["--run-dir", d.join("run").to_str().unwrap()])
            .args(["--api-socket", api.to_str().unwrap()])
            .args(["receive", "--listen", listen, "--auth-key"])
            .arg(d.join(key))
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        let err = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for l in BufReader::new(err).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        let mut t = Target {
            child,
            lines,
            seen: Vec::new(),
        };
        t.wait_line("listening on");
        t
    }

    /// Waits for a stderr line containing `what` (the target's own event, no sleep).
    fn wait_line(&mut self, what: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    let hit = l.contains(what);
                    self.seen.push(l.clone());
                    if hit {
                        return l;
                    }
                }
                Err(RecvTimeoutError::Timeout) => panic!("no {what:?} line: {:#?}", self.seen),
                Err(RecvTimeoutError::Disconnected) => {
                    panic!("the target ended without {what:?}: {:#?}", self.seen)
                }
            }
        }
    }

    /// Waits for the end; its status and every stderr line.
    fn wait(self) -> (Option<i32>, String) {
        let (status, log) = self.wait_status();
        (status.code(), log)
    }

    /// [`Target::wait`] with the whole status.
    fn wait_status(mut self) -> (std::process::ExitStatus, String) {
        let status = self.child.wait().unwrap();
        self.seen.extend(self.lines.iter());
        (status, self.seen.join("\n"))
    }
}

fn migrate(sock: &Path, to: &str, key: &Path) -> Output {
    vmhost(&[
        "ctl",
        "--api-socket",
        sock.to_str().unwrap(),
        "--json",
        "migrate",
        to,
        "--auth-key",
        key.to_str().unwrap(),
    ])
}

/// The names of the ledger's entries whose process runs (`vmhost ps --json`).
fn ledger_names(run_dir: &Path) -> Vec<String> {
    let o = vmhost(&["--run-dir", run_dir.to_str().unwrap(), "ps", "--json"]);
    let v: Value = serde_json::from_slice(&o.stdout).unwrap_or(Value::Null);
    v["entries"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| e["liveness"] == "alive")
        .map(|e| e["entry"]["name"].as_str().unwrap_or("").to_string())
        .collect()
}

fn free_tcp_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Pages dirty at the end of a round are sent in the next one (the idle guest's dirty pages
/// are pattern pages, never zero); returns the pre-copy rounds after round 0 (dirty rounds).
fn dirty_rounds(job: &Value) -> usize {
    let rounds = job["rounds"].as_array().unwrap();
    let n = |r: &Value, k: &str| r[k].as_u64().unwrap();
    for pair in rounds.windows(2) {
        if n(&pair[0], "dirty_bytes_after") > 0 {
            assert!(n(&pair[1], "bytes") > 0, "dirty pages resent: {job:#}");
        }
    }
    rounds.len().saturating_sub(2)
}

/// One successful migration from the VM at `from` to a new target listening on `listen`:
/// checks the job's report, the guest going on at the target and the source's end.
fn migrate_ok(d: &Path, source: &mut Child, from: &Path, listen: &str, api: &Path) -> Target {
    let (stamp, _) = common::progress(from);
    let mut target = Target::start(d, listen, "key", api, &[]);
    let before = common::ticks_pass(from, 1);
    let o = migrate(from, listen, &d.join("key"));
    assert_eq!(o.status.code(), Some(0), "{}", common::text(&o));
    let job: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(job["state"], "succeeded", "{job:#}");
    let rounds = job["rounds"].as_array().unwrap();
    assert!(rounds.len() >= 2, "round 0 and a final round: {job:#}");
    assert_eq!(rounds.last().unwrap()["last"], true, "{job:#}");
    let bytes: u64 = rounds.iter().map(|r| r["bytes"].as_u64().unwrap()).sum();
    assert!(
        bytes >= vmhost_vcpu::payload::ramcheck::PAGES * 4096,
        "the guest's pattern pages were sent: {bytes} bytes in {job:#}"
    );
    println!("{bytes} bytes sent, {} dirty rounds", dirty_rounds(&job));
    assert!(job["downtime_ms"].as_f64().is_some(), "{job:#}");
    // Every step in order, each begun no earlier than the one before and within the job.
    let phases: Vec<(&str, f64)> = job["phases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["phase"].as_str().unwrap(), m["at"].as_f64().unwrap()))
        .collect();
    let names: Vec<&str> = phases.iter().map(|p| p.0).collect();
    assert_eq!(
        names,
        [
            "connect",
            "hello",
            "streams",
            "precopy",
            "pause",
            "state",
            "final-round",
            "commit"
        ],
        "{job:#}"
    );
    let total = job["seconds"].as_f64().unwrap();
    assert!(
        phases.windows(2).all(|w| w[0].1 <= w[1].1) && phases[7].1 <= total,
        "{job:#}"
    );
    assert!(job["target_plan"]["vcpus"].is_array(), "{job:#}");
    assert!(job["target_audit"].is_object(), "{job:#}");
    // The target prefaulted its RAM beside the receivers: every page present (move_pages)
    // and nothing out of place by the time of its audit, which the commit carries.
    for r in job["target_audit"]["regions"].as_array().unwrap() {
        assert_eq!(r["pages_not_present"], 0, "{job:#}");
        assert_eq!(r["violations"].as_array().map(Vec::len), Some(0), "{job:#}");
    }
    // The target's steps from the hello to its receivers, each named once, in order: the
    // page streams accepted right after the answer, before the memory.
    let steps = target.wait_line("ready for the rounds");
    let at: Vec<usize> = [
        "after the hello: hello checked ",
        ", boot inputs ",
        ", pools ",
        ", answered ",
        ", page streams ",
        ", cgroup and threads ",
        ", memory bound ",
    ]
    .iter()
    .map(|s| steps.find(s).unwrap_or_else(|| panic!("{s:?} in {steps}")))
    .collect();
    assert!(at.windows(2).all(|w| w[0] < w[1]), "{steps}");
    println!("{steps}");
    target.wait_line("migration committed");
    // The hello carried the guest's TSC rate; on one host it is this host's.
    let khz = vmhost_vcpu::persist::TargetCaps::of_this_host()
        .unwrap()
        .tsc_khz;
    target.wait_line(&format!(
        "TSC: the guest's {khz} kHz, this host's {khz} kHz: the same rate"
    ));
    assert_eq!(
        source.wait().unwrap().code(),
        Some(0),
        "the source ends with 0"
    );
    let (id, at_switch) = common::progress(api);
    assert_eq!(
        id, stamp,
        "the guest continued: its start stamp is the same"
    );
    assert!(at_switch >= before, "ticks {at_switch} go on from {before}");
    common::ticks_pass(api, at_switch);
    let (checked, _) = common::ram_check(api);
    common::ram_pass(api, checked);
    assert_eq!(ledger_names(&d.join("run")), ["mig-vm"], "one ledger entry");
    target
}

#[test]
fn an_idle_vm_migrates_over_a_unix_socket_then_back_over_tcp() {
    if !need_kvm("cli_migrate") {
        return;
    }
    let _cpus = lock_cpus();
    let _pool = lock_pool();
    if !need_pages("cli_migrate", PAGE_2M, 32) {
        return;
    }
    let before = pool(PAGE_2M);
    let d = dir("flow");
    let (mut source, sock) = common::start_with_api(&d, &d.join("vm.toml"), &[], Stdio::null());
    let mut _guard = KillOnPanic(vec![source.id()]);
    let unix = format!("unix:{}", d.join("mig.sock").display());
    let api2 = d.join("api2.sock");
    let mut second = migrate_ok(&d, &mut source, &sock, &unix, &api2);
    _guard.0.push(second.child.id());
    assert!(
        !d.join("mig.sock").exists(),
        "the listener's socket is removed"
    );

    let tcp = format!("tcp:127.0.0.1:{}", free_tcp_port());
    let api3 = d.join("api3.sock");
    let third = migrate_ok(&d, &mut second.child, &api2, &tcp, &api3);
    _guard.0.push(third.child.id());
    drop(second);
    assert_eq!(common::ctl(&api3, "shutdown").0, 0);
    let (code, log) = third.wait();
    assert_eq!(code, Some(0), "{log}");
    assert!(ledger_names(&d.join("run")).is_empty());
    assert_eq!(pool(PAGE_2M), before, "every hugepage is back in the pool");
}

#[test]
fn a_wrong_key_is_refused_on_both_sides_and_the_source_runs_on() {
    if !need_kvm("cli_migrate") {
        return;
    }
    let _cpus = lock_cpus();
    let _pool = lock_pool();
    if !need_pages("cli_migrate", PAGE_2M, 32) {
        return;
    }
    let before = pool(PAGE_2M);
    let d = dir("key");
    let (mut source, sock) = common::start_with_api(&d, &d.join("vm.toml"), &[], Stdio::null());
    let mut _guard = KillOnPanic(vec![source.id()]);
    let unix = format!("unix:{}", d.join("mig.sock").display());
    let mut target = Target::start(&d, &unix, "key", &d.join("api2.sock"), &[]);
    _guard.0.push(target.child.id());
    let o = migrate(&sock, &unix, &d.join("other-key"));
    assert_eq!(o.status.code(), Some(1), "{}", common::text(&o));
    let job: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(job["state"], "failed", "{job:#}");
    assert!(
        job["error"].as_str().unwrap().contains("authenticat"),
        "{job:#}"
    );
    target.wait_line("refused a connection");
    let (_, t) = common::progress(&sock);
    common::ticks_pass(&sock, t);
    assert_eq!(common::ctl(&sock, "info").1["state"], "running");
    target.child.kill().unwrap();
    let _ = target.wait();
    assert_eq!(common::ctl(&sock, "shutdown").0, 0);
    assert_eq!(source.wait().unwrap().code(), Some(0));
    assert_eq!(pool(PAGE_2M), before, "every hugepage is back in the pool");
}

#[test]
fn the_target_killed_at_round_1_leaves_the_source_running() {
    if !need_kvm("cli_migrate") {
        return;
    }
    let _cpus = lock_cpus();
    let _pool = lock_pool();
    if !need_pages("cli_migrate", PAGE_2M, 32) {
        return;
    }
    let before = pool(PAGE_2M);
    let d = dir("target-killed");
    let (mut source, sock) = common::start_with_api(&d, &d.join("vm.toml"), &[], Stdio::null());
    let mut _guard = KillOnPanic(vec![source.id()]);
    let unix = format!("unix:{}", d.join("mig.sock").display());
    let hook = [("VMHOST_TEST_MIGRATION_FAIL_AT", "round:1:target")];
    let target = Target::start(&d, &unix, "key", &d.join("api2.sock"), &hook);
    _guard.0.push(target.child.id());
    let o = migrate(&sock, &unix, &d.join("key"));
    assert_eq!(o.status.code(), Some(1), "{}", common::text(&o));
    let (status, log) = target.wait_status();
    assert_eq!(
        status.signal(),
        Some(libc::SIGABRT),
        "killed by the hook: {log}"
    );
    assert!(log.contains("killed now (test hook)"), "{log}");
    let (_, t) = common::progress(&sock);
    common::ticks_pass(&sock, t);
    assert_eq!(common::ctl(&sock, "info").1["state"], "running");
    assert_eq!(common::ctl(&sock, "shutdown").0, 0);
    assert_eq!(source.wait().unwrap().code(), Some(0));
    assert_eq!(pool(PAGE_2M), before, "every hugepage is back in the pool");
}

#[test]
fn the_source_killed_ends_the_target_non_zero_with_its_pages_back() {
    if !need_kvm("cli_migrate") {
        return;
    }
    let _cpus = lock_cpus();
    let _pool = lock_pool();
    if !need_pages("cli_migrate", PAGE_2M, 32) {
        return;
    }
    let before = pool(PAGE_2M);
    let d = dir("source-killed");
    let spec = d.join("vm.toml");
    let mut source = Command::new(env!("CARGO_BIN_EXE_vmhost"))
        .args(["--run-dir", d.join("run").to_str().unwrap()])
        .args(["--api-socket", d.join("api.sock").to_str().unwrap()])
        .args(["--config", spec.to_str().unwrap()])
        .env("VMHOST_TEST_MIGRATION_FAIL_AT", "round:1:source")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut _guard = KillOnPanic(vec![source.id()]);
    let sock = d.join("api.sock");
    let deadline = Instant::now() + Duration::from_secs(60);
    while common::ctl(&sock, "info").1["state"] != "running" {
        assert!(Instant::now() < deadline, "the VM never reported running");
        std::thread::sleep(Duration::from_millis(20));
    }
    let unix = format!("unix:{}", d.join("mig.sock").display());
    let target = Target::start(&d, &unix, "key", &d.join("api2.sock"), &[]);
    _guard.0.push(target.child.id());
    let o = migrate(&sock, &unix, &d.join("key"));
    assert_ne!(o.status.code(), Some(0), "{}", common::text(&o));
    let status = source.wait().unwrap();
    assert_eq!(
        status.signal(),
        Some(libc::SIGABRT),
        "killed by the hook: {status:?}"
    );
    let (code, log) = target.wait();
    assert_ne!(code, Some(0), "{log}");
    assert!(log.contains("receiving the migrating VM"), "{log}");
    assert!(
        ledger_names(&d.join("run")).is_empty(),
        "the target released its entry"
    );
    assert_eq!(pool(PAGE_2M), before, "every hugepage is back in the pool");
}

/// After a move that failed before its commit: the source's guest runs on, its ledger entry
/// is the only one, it shuts down with 0 and every hugepage is back in the pool (`before`).
fn the_source_runs_on_alone(d: &Path, sock: &Path, mut source: Child, before: (u64, u64)) {
    let (_, t) = common::progress(sock);
    common::ticks_pass(sock, t);
    assert_eq!(
        ledger_names(&d.join("run")),
        ["mig-vm"],
        "the source's entry only"
    );
    assert_eq!(common::ctl(sock, "shutdown").0, 0);
    assert_eq!(source.wait().unwrap().code(), Some(0));
    assert_eq!(pool(PAGE_2M), before, "every hugepage is back in the pool");
}

/// This host's CPU vendor string (`vendor_id` of /proc/cpuinfo, as CPUID leaf 0 gives it).
fn cpu_vendor() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap();
    let line = info.lines().find(|l| l.starts_with("vendor_id")).unwrap();
    line.split(':').nth(1).unwrap().trim().to_string()
}

/// Pretends to be a source: connects, authenticates with `key`, sends `hello` as the hello
/// record (with its last byte flipped when `corrupt`); the target's answer, if it sent one.
fn fake_source(sock: &Path, key: &Path, hello: &Hello, corrupt: bool) -> Option<Answer> {
    let mut s = UnixStream::connect(sock).unwrap();
    let key = AuthKey::load(key).unwrap();
    let session = handshake(&mut s, &key, Role::Source).unwrap();
    let mut w = Writer::authenticated(Vec::new(), "test", session.send).unwrap();
    w.write_record(RecordKind::MIG_HELLO, &migration::encode(hello))
        .unwrap();
    let at = usize::try_from(w.offset()).unwrap();
    let mut bytes = w.finish().unwrap();
    bytes.truncate(at);
    if corrupt {
        // The last byte of the hello's MAC.
        bytes[at - 1] ^= 0x40;
    }
    s.write_all(&bytes).unwrap();
    let mut r = Reader::authenticated(
        s.try_clone().unwrap(),
        &migration::SOURCE_READS,
        session.recv,
    )
    .ok()?;
    let rec = r.next_record().ok()??;
    migration::decode("answer", &rec.payload).ok()
}

#[test]
fn a_bad_hello_is_refused_with_exit_2_before_anything_is_allocated() {
    let _pool = lock_pool();
    let before = pool(PAGE_2M);
    let d = dir("bad-hello");
    let sock = d.join("mig.sock");
    let unix = format!("unix:{}", sock.display());
    let spec = std::fs::read_to_string(d.join("vm.toml")).unwrap();
    let hello = Hello {
        protocol: 99,
        vmhost_version: "test".into(),
        spec: serde_json::json!({"format": "toml", "origin": "vm.toml", "text": spec}),
        identity: Value::Null,
        source_plan: Value::Null,
        tsc_khz: 0,
        cpu_vendor: String::new(),
        same_distances: false,
    };
    // Another protocol version: refused with the reason, exit 2.
    let target = Target::start(&d, &unix, "key", &d.join("api2.sock"), &[]);
    let answer = fake_source(&sock, &d.join("key"), &hello, false);
    let (code, log) = target.wait();
    assert_eq!(code, Some(2), "{log}");
    assert!(log.contains("migration protocol 99"), "{log}");
    match answer {
        Some(Answer::Refused { reason }) => assert!(reason.contains("protocol 99"), "{reason}"),
        other => panic!("no refusal: {other:?}"),
    }
    // A hello whose MAC does not match (a corrupted stream): exit 2.
    let target = Target::start(&d, &unix, "key", &d.join("api2.sock"), &[]);
    let hello = Hello {
        protocol: migration::PROTOCOL_VERSION,
        ..hello
    };
    let _ = fake_source(&sock, &d.join("key"), &hello, true);
    let (code, log) = target.wait();
    assert_eq!(code, Some(2), "{log}");
    assert!(
        log.contains("authentication") || log.contains("MAC"),
        "{log}"
    );
    assert!(!log.contains("/dev/kvm"), "{log}");
    // A guest whose TSC ran 1 % faster than this host's: beyond KVM's tolerance where it
    // cannot scale, refused at the hello naming both rates; where KVM scales, taken (the
    // hello then fails on its null identity instead).
    let caps = vmhost_vcpu::persist::TargetCaps::of_this_host().unwrap();
    let faster = caps.tsc_khz + caps.tsc_khz / 100;
    let target = Target::start(&d, &unix, "key", &d.join("api3.sock"), &[]);
    let hello = Hello {
        tsc_khz: faster,
        cpu_vendor: cpu_vendor(),
        ..hello
    };
    let answer = fake_source(&sock, &d.join("key"), &hello, false);
    let (code, log) = target.wait();
    assert_eq!(code, Some(2), "{log}");
    let Some(Answer::Refused { reason }) = answer else {
        panic!("no refusal: {answer:?}");
    };
    println!("TSC scaling {}: refused with: {reason}", caps.tsc_scaling);
    if caps.tsc_scaling {
        assert!(reason.contains("identity"), "{reason}");
    } else {
        let rates = format!("{faster} kHz, this host's at {} kHz", caps.tsc_khz);
        assert!(
            reason.contains(&rates) && reason.contains("10000 ppm"),
            "{reason}"
        );
        assert!(log.contains(&rates), "{log}");
    }
    assert!(ledger_names(&d.join("run")).is_empty());
    assert_eq!(pool(PAGE_2M), before, "nothing was allocated");
}

/// A disk the source has open but the target cannot find (its image gone from the path) is
/// refused at the hello, before any memory moves or anything is allocated: the target exits 2
/// naming the disk's field and path, `ctl migrate` exits 1 with the reason, and the source's
/// guest runs on.
#[test]
fn a_disk_missing_on_the_target_is_refused_before_memory_moves() {
    if !need_kvm("cli_migrate") {
        return;
    }
    let _cpus = lock_cpus();
    let _pool = lock_pool();
    if !need_pages("cli_migrate", PAGE_2M, 32) {
        return;
    }
    let before = pool(PAGE_2M);
    let d = dir("missing-disk");
    let image = d.join("disk.img");
    std::fs::write(&image, vec![0u8; 1 << 20]).unwrap();
    let spec = format!(
        "{IDLE}[[devices.disks]]\nname = \"data\"\n[[volumes]]\nname = \"data\"\n\
         host_disk = {{ path = \"{}\", type = \"Disk\" }}\n",
        image.display()
    );
    std::fs::write(d.join("disk.toml"), spec).unwrap();
    let (source, sock) = common::start_with_api(&d, &d.join("disk.toml"), &[], Stdio::null());
    let mut _guard = KillOnPanic(vec![source.id()]);
    std::fs::remove_file(&image).unwrap();
    let unix = format!("unix:{}", d.join("mig.sock").display());
    let target = Target::start(&d, &unix, "key", &d.join("api2.sock"), &[]);
    _guard.0.push(target.child.id());
    let o = migrate(&sock, &unix, &d.join("key"));
    assert_eq!(o.status.code(), Some(1), "{}", common::text(&o));
    let job: Value = serde_json::from_slice(&o.stdout).unwrap();
    let error = job["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("volumes[0].host_disk.path") && error.contains("disk.img"),
        "{job:#}"
    );
    assert!(
        job["rounds"].as_array().is_none_or(Vec::is_empty),
        "no round: {job:#}"
    );
    let (code, log) = target.wait();
    assert_eq!(code, Some(2), "{log}");
    assert!(log.contains("volumes[0].host_disk.path"), "{log}");
    assert!(!log.contains("/dev/kvm"), "{log}");
    the_source_runs_on_alone(&d, &sock, source, before);
}

/// A control API socket the target cannot serve on (a regular file sits at its path) fails
/// the move: the target serves its API while the rounds arrive, before the commit, so the
/// source never commits, its guest runs on, and the target exits non-zero with the path named
/// and its hugepages back. Served after the commit instead, the failure would end the guest.
#[test]
fn a_target_api_socket_that_cannot_be_served_fails_the_move_and_the_source_runs_on() {
    if !need_kvm("cli_migrate") {
        return;
    }
    let _cpus = lock_cpus();
    let _pool = lock_pool();
    if !need_pages("cli_migrate", PAGE_2M, 32) {
        return;
    }
    let before = pool(PAGE_2M);
    let d = dir("bad-api");
    let (source, sock) = common::start_with_api(&d, &d.join("vm.toml"), &[], Stdio::null());
    let mut _guard = KillOnPanic(vec![source.id()]);
    let taken = d.join("api2.sock");
    std::fs::write(&taken, "not a socket").unwrap();
    let unix = format!("unix:{}", d.join("mig.sock").display());
    let target = Target::start(&d, &unix, "key", &taken, &[]);
    _guard.0.push(target.child.id());
    let o = migrate(&sock, &unix, &d.join("key"));
    assert_eq!(o.status.code(), Some(1), "{}", common::text(&o));
    let job: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(job["state"], "failed", "{job:#}");
    let (code, log) = target.wait();
    assert_ne!(code, Some(0), "{log}");
    assert!(
        log.contains("serving the control API") && log.contains("api2.sock"),
        "{log}"
    );
    assert!(!log.contains("migration committed"), "{log}");
    assert_eq!(
        std::fs::read_to_string(&taken).unwrap(),
        "not a socket",
        "the file is left alone"
    );
    the_source_runs_on_alone(&d, &sock, source, before);
}
