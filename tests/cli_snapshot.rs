//! Snapshot and restore end to end with the real binary, real `/dev/kvm` and 2 MiB hugepages:
//! `vmhost ctl snapshot` (the VM runs on), `ctl snapshot --stop` (the VM ends), `vmhost
//! restore` (the guest continues), and the refusals before `/dev/kvm` (a damaged snapshot, a
//! different spec). The restored idle guest verifies its RAM pattern (no page wrong), and
//! finds it wrong when restored from a copy whose `memory-cell0` holds no pages. Every
//! hugepage is back in the pool at the end.
#![allow(clippy::unwrap_used)]

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use vmhost_testsupport::{lock_cpus, lock_pool, need_kvm, need_pages, pool};

const PAGE_2M: u64 = 2 << 20;

const IDLE: &str = "name = \"snap-vm\"\n[cpu]\ncores = 1\n\
     [memory]\nguest = \"32Mi\"\nhugepages = { page_size = \"2Mi\" }\n[boot]\npayload = \"idle\"\n";

fn dir(test: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("vmhost-snap-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn vmhost(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_vmhost"))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

fn mode(p: &Path) -> u32 {
    std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o777
}

fn snapshot(sock: &Path, to: &Path, stop: bool) -> Output {
    let mut args = vec!["ctl", "--api-socket", sock.to_str().unwrap(), "snapshot"];
    args.push(to.to_str().unwrap());
    if stop {
        args.push("--stop");
    }
    vmhost(&args)
}

/// `vmhost --run-dir R ps --json`: the ledger's VM names.
fn ledger_names(run_dir: &Path) -> String {
    let o = vmhost(&["--run-dir", run_dir.to_str().unwrap(), "ps", "--json"]);
    common::stdout(&o)
}

/// Starts `vmhost … <extra> restore DIR` with its own API socket; waits until it runs.
fn restore(d: &Path, snap: &Path, sock: &Path, extra: &[&str]) -> Child {
    restore_with(d, snap, sock, extra, &[])
}

/// Starts `vmhost … <extra> restore DIR <after>` with its own API socket; waits until it runs.
fn restore_with(d: &Path, snap: &Path, sock: &Path, extra: &[&str], after: &[&str]) -> Child {
    let child = Command::new(env!("CARGO_BIN_EXE_vmhost"))
        .args(["--run-dir", d.join("run").to_str().unwrap()])
        .args(["--api-socket", sock.to_str().unwrap()])
        .args(extra)
        .args(["restore", snap.to_str().unwrap()])
        .args(after)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut child = child;
    let deadline = Instant::now() + Duration::from_secs(60);
    while common::ctl(sock, "info").1["state"] != "running" {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
            panic!("the restore ended before its VM ran ({status}):\n{err}");
        }
        assert!(Instant::now() < deadline, "the restored VM never ran");
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

fn check_modes(snap: &Path) {
    assert_eq!(mode(snap), 0o700, "{}", snap.display());
    let mut names: Vec<String> = std::fs::read_dir(snap)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["memory-cell0", "plan", "spec", "state"]);
    for n in names {
        assert_eq!(mode(&snap.join(&n)), 0o600, "{n}");
    }
}

#[test]
fn a_snapshot_keeps_the_vm_running_and_a_stopped_one_restores_and_continues() {
    if !need_kvm("cli_snapshot") {
        return;
    }
    let _cpus = lock_cpus();
    let _pool = lock_pool();
    if !need_pages("cli_snapshot", PAGE_2M, 16) {
        return;
    }
    let before = pool(PAGE_2M);
    let d = dir("flow");
    let spec = d.join("vm.toml");
    std::fs::write(&spec, IDLE).unwrap();
    let (mut child, sock) = common::start_with_api(&d, &spec, &[], Stdio::null());
    let (boot_id, _) = common::progress(&sock);
    assert!(boot_id > 0, "the idle payload stamps its start");
    common::ticks_pass(&sock, 2);

    // A snapshot that resumes the VM.
    let s1 = d.join("s1");
    let o = snapshot(&sock, &s1, false);
    assert_eq!(o.status.code(), Some(0), "{}", common::text(&o));
    let job: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(job["state"], "succeeded", "{job:#}");
    assert!(
        common::stderr(&o).contains("snapshot: succeeded"),
        "{}",
        common::text(&o)
    );
    check_modes(&s1);
    assert_eq!(common::ctl(&sock, "info").1["state"], "running");
    let (_, t) = common::progress(&sock);
    common::ticks_pass(&sock, t);
    // An existing directory is refused and left alone; the VM runs on.
    let o = snapshot(&sock, &s1, false);
    assert_eq!(o.status.code(), Some(1), "{}", common::text(&o));
    assert!(
        common::stdout(&o).contains("must not exist"),
        "{}",
        common::text(&o)
    );
    check_modes(&s1);
    assert_eq!(common::ctl(&sock, "info").1["state"], "running");

    // A snapshot that ends the VM.
    let (_, seen) = common::progress(&sock);
    let s2 = d.join("s2");
    let o = snapshot(&sock, &s2, true);
    assert_eq!(o.status.code(), Some(0), "{}", common::text(&o));
    assert_eq!(child.wait().unwrap().code(), Some(0));
    check_modes(&s2);
    let cell = std::fs::metadata(s2.join("memory-cell0")).unwrap().len();
    println!("memory-cell0: {cell} bytes");
    assert!(
        cell > vmhost_vcpu::payload::ramcheck::PAGES * 4096,
        "the memory file holds the guest's pattern pages: {cell} bytes"
    );
    assert!(!ledger_names(&d.join("run")).contains("snap-vm"));
    assert_eq!(pool(PAGE_2M), before, "the stopped VM's hugepages are back");

    refusals(&d, &s2, before);

    let sock2 = d.join("api2.sock");
    let restored = restore(&d, &s2, &sock2, &["--json"]);
    let (id, first) = common::progress(&sock2);
    assert_eq!(
        id, boot_id,
        "the guest continued: its start stamp is the same"
    );
    assert!(
        first >= seen,
        "restored ticks {first} start from the captured count >= {seen}"
    );
    common::ticks_pass(&sock2, first);
    let (checked, _) = common::ram_check(&sock2);
    common::ram_pass(&sock2, checked);
    // The kernel's account: every 2 MiB page of the guest's 32 MiB is faulted in, none
    // only reserved.
    assert_eq!(
        pool(PAGE_2M),
        (before.0 - 16, before.1),
        "(free, reserved) 2 MiB pages while the restored VM runs, from {before:?}"
    );
    assert!(ledger_names(&d.join("run")).contains("snap-vm"));
    assert_eq!(common::ctl(&sock2, "shutdown").0, 0);
    let out = restored.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", common::text(&out));
    // The default prefault was done before the guest ran (beside the memory files'
    // loaders), not left to a background one; the audit found every page on its node.
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["prefault"], "before-start", "{report:#}");
    let t = &report["timeline"];
    let ready = t["memory_ready_ns"].as_u64().unwrap();
    assert!(
        ready > 0 && ready <= t["vcpus_runnable_ns"].as_u64().unwrap(),
        "guest RAM ready (prefaulted) before the vCPUs ran: {t:#}"
    );
    for r in report["audit"]["regions"].as_array().unwrap() {
        assert_eq!(r["pages_not_present"], 0, "{report:#}");
        assert_eq!(
            r["violations"].as_array().map(Vec::len),
            Some(0),
            "{report:#}"
        );
    }
    assert_eq!(
        pool(PAGE_2M),
        before,
        "the restored VM's hugepages are back"
    );
    zeroed_ram_is_noticed(&d, &s2);
    assert_eq!(pool(PAGE_2M), before);

    // The first snapshot, restored with the same spec given again: it continues too.
    let sock3 = d.join("api3.sock");
    let mut again = restore(&d, &s1, &sock3, &["--config", spec.to_str().unwrap()]);
    assert_eq!(common::progress(&sock3).0, boot_id);
    assert_eq!(common::ctl(&sock3, "shutdown").0, 0);
    assert_eq!(again.wait().unwrap().code(), Some(0));
    assert_eq!(pool(PAGE_2M), before, "every hugepage is back in the pool");
}

/// The negative control of the RAM check: `good` with an empty (valid, all-zero)
/// `memory-cell0` restores, and the guest finds its RAM pattern wrong.
fn zeroed_ram_is_noticed(d: &Path, good: &Path) {
    use vmhost_persist::container::RecordKind;
    use vmhost_persist::dir::{FileName, Snapshot, SnapshotWriter};
    let s = Snapshot::open(good).unwrap();
    let zeroed = d.join("zeroed");
    let mut w = SnapshotWriter::create(&zeroed, &s.header().vmhost_version).unwrap();
    for (name, kind) in [
        (FileName::Spec, RecordKind::SPEC),
        (FileName::Plan, RecordKind::PLAN),
    ] {
        w.write_single(name, kind, &s.read_single(name, kind).unwrap())
            .unwrap();
    }
    w.write_file(FileName::MemoryCell(0), |_| Ok(())).unwrap();
    // The state file as it is: the VM state and the guest's identity.
    let records = s
        .read_state_records(&[RecordKind::VM_STATE, RecordKind::GUEST_IDENTITY])
        .unwrap();
    assert_eq!(
        records.len(),
        2,
        "the state file holds the VM state and the identity"
    );
    w.commit(|out| {
        for (kind, payload) in &records {
            out.write_record(*kind, payload)?;
        }
        Ok(())
    })
    .unwrap();
    let sock = d.join("api-zeroed.sock");
    let mut child = restore(d, &zeroed, &sock, &[]);
    let deadline = Instant::now() + Duration::from_secs(30);
    while common::ram_check(&sock).1 == 0 {
        assert!(
            Instant::now() < deadline,
            "zeroed RAM goes unnoticed: {:?}",
            common::ram_check(&sock)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    println!(
        "on zeroed RAM (checked, wrong): {:?}",
        common::ram_check(&sock)
    );
    assert_eq!(common::ctl(&sock, "shutdown").0, 0);
    assert_eq!(child.wait().unwrap().code(), Some(0));
}

/// A damaged snapshot and a different spec are refused with exit 2, nothing left allocated: no
/// ledger entry, the hugepage pool unchanged. The damaged memory file is found by its load
/// (every record's CRC), which names it and its damaged record.
fn refusals(d: &Path, good: &Path, before: (u64, u64)) {
    let run_dir = d.join("run");
    let bad = d.join("damaged");
    std::fs::create_dir(&bad).unwrap();
    for e in std::fs::read_dir(good).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), bad.join(e.file_name())).unwrap();
    }
    let cell = bad.join("memory-cell0");
    let mut bytes = std::fs::read(&cell).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0x40;
    std::fs::write(&cell, bytes).unwrap();
    let o = vmhost(&[
        "--run-dir",
        run_dir.to_str().unwrap(),
        "restore",
        bad.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", common::text(&o));
    assert!(
        common::stderr(&o).contains("memory file memory-cell0 is damaged")
            && common::stderr(&o).contains("is corrupted: XXH64"),
        "{}",
        common::text(&o)
    );
    assert!(!ledger_names(&run_dir).contains("snap-vm"));
    assert_eq!(pool(PAGE_2M), before);

    let other = d.join("other.toml");
    std::fs::write(&other, IDLE.replace("guest = \"32Mi\"", "guest = \"64Mi\"")).unwrap();
    let o = vmhost(&[
        "--run-dir",
        run_dir.to_str().unwrap(),
        "--config",
        other.to_str().unwrap(),
        "restore",
        good.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", common::text(&o));
    assert!(
        common::stderr(&o).contains("memory."),
        "{}",
        common::text(&o)
    );
    assert!(!ledger_names(&run_dir).contains("snap-vm"));
    assert_eq!(pool(PAGE_2M), before);
}

#[test]
fn ctl_snapshot_needs_a_directory_and_restore_a_snapshot() {
    let d = dir("args");
    let o = vmhost(&["ctl", "--api-socket", "/nonexistent.sock", "snapshot"]);
    assert_eq!(o.status.code(), Some(2), "{}", common::text(&o));
    assert!(
        common::stderr(&o).contains("snapshot DIR"),
        "{}",
        common::text(&o)
    );
    let o = vmhost(&[
        "--run-dir",
        d.join("run").to_str().unwrap(),
        "restore",
        d.join("none").to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", common::text(&o));
    assert!(common::stderr(&o).contains("state"), "{}", common::text(&o));
}

/// Copies the snapshot `good` into `out` record by record (new checksums and manifest), its
/// VM state (record kind 16) and guest identity (kind 17, `None`: left out) passed through
/// `edit` first: a snapshot vmhost could have written, with what a test needs changed.
fn forge(good: &Path, out: &Path, edit: impl FnOnce(&mut Value, &mut Option<Value>)) {
    use vmhost_persist::container::{Reader, Record, RecordKind};
    use vmhost_persist::dir::{FileName, SnapshotWriter};
    let records = |name: &str| -> Vec<Record> {
        let f = std::io::BufReader::new(std::fs::File::open(good.join(name)).unwrap());
        let mut r = Reader::any_kind(f).unwrap();
        let mut all = Vec::new();
        while let Some(rec) = r.next_record().unwrap() {
            if rec.kind != RecordKind::MANIFEST {
                all.push(rec);
            }
        }
        all
    };
    let mut w = SnapshotWriter::create(out, env!("CARGO_PKG_VERSION")).unwrap();
    for name in ["spec", "plan", "memory-cell0"] {
        let recs = records(name);
        w.write_file(FileName::parse(name).unwrap(), |f| {
            for r in &recs {
                if r.mandatory {
                    f.write_record(r.kind, &r.payload)?;
                } else {
                    f.write_optional(r.kind, &r.payload)?;
                }
            }
            Ok(())
        })
        .unwrap();
    }
    let state = records("state");
    let payload = |kind| state.iter().find(|r| r.kind == kind).map(|r| &r.payload);
    let mut vm: Value = serde_json::from_slice(payload(RecordKind::VM_STATE).unwrap()).unwrap();
    let mut id: Option<Value> =
        payload(RecordKind::GUEST_IDENTITY).map(|p| serde_json::from_slice(p).unwrap());
    edit(&mut vm, &mut id);
    w.commit(|f| {
        f.write_record(RecordKind::VM_STATE, &serde_json::to_vec(&vm).unwrap())?;
        if let Some(id) = &id {
            f.write_record(RecordKind::GUEST_IDENTITY, &serde_json::to_vec(id).unwrap())?;
        }
        Ok(())
    })
    .unwrap();
}

/// `vmhost restore` of `snap` that must be refused with exit 2 before anything is allocated
/// (no ledger entry, the pool unchanged), its message holding each of `names`.
fn refused(d: &Path, snap: &Path, before: (u64, u64), names: &[&str]) {
    let run_dir = d.join("run");
    let o = vmhost(&[
        "--run-dir",
        run_dir.to_str().unwrap(),
        "restore",
        snap.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", common::text(&o));
    for n in names {
        assert!(
            common::stderr(&o).contains(n),
            "{n} not named: {}",
            common::text(&o)
        );
    }
    assert!(!ledger_names(&run_dir).contains("snap-vm"));
    assert_eq!(pool(PAGE_2M), before, "no hugepage taken");
}

#[test]
fn a_restore_keeps_the_guest_identity_and_refuses_a_snapshot_the_spec_contradicts() {
    if !need_kvm("cli_snapshot") {
        return;
    }
    let _cpus = lock_cpus();
    let _pool = lock_pool();
    if !need_pages("cli_snapshot", PAGE_2M, 16) {
        return;
    }
    let before = pool(PAGE_2M);
    let d = dir("identity");
    let spec = d.join("vm.toml");
    std::fs::write(&spec, IDLE).unwrap();
    let (mut child, sock) = common::start_with_api(&d, &spec, &[], Stdio::null());
    common::ticks_pass(&sock, 1);
    let placement = common::ctl(&sock, "placement").1;
    let snap = d.join("s");
    let o = snapshot(&sock, &snap, true);
    assert_eq!(o.status.code(), Some(0), "{}", common::text(&o));
    assert_eq!(child.wait().unwrap().code(), Some(0));

    // What the guest has seen: one cell with vCPU 0 and 32 MiB in 2 MiB pages.
    let mut seen = None;
    forge(&snap, &d.join("copy"), |_, id| seen = id.clone());
    let seen = seen.expect("the snapshot holds the guest identity (record kind 17)");
    let id = &seen["identity"];
    assert_eq!(
        (id["sockets"].as_u64(), id["cores"].as_u64()),
        (Some(1), Some(1))
    );
    assert_eq!(id["page_size_bytes"], PAGE_2M);
    assert_eq!(id["cells"].as_array().unwrap().len(), 1, "{seen:#}");
    assert_eq!(id["cells"][0]["memory_bytes"], 32u64 << 20);
    assert_eq!(id["cells"][0]["vcpus"][0]["vcpu"], 0);

    // An identity the spec contradicts, each field named.
    let contradicted = d.join("contradicted");
    forge(&snap, &contradicted, |_, id| {
        let id = &mut id.as_mut().unwrap()["identity"];
        id["cores"] = 2.into();
        id["page_size_bytes"] = 4096.into();
    });
    refused(
        &d,
        &contradicted,
        before,
        &["cpu.sockets/cores/threads", "memory.hugepages.page_size"],
    );
    // No identity at all.
    let bare = d.join("bare");
    forge(&snap, &bare, |_, id| *id = None);
    refused(&d, &bare, before, &["guest identity (kind 17)"]);
    // A disk the saved devices used is missing: named, before /dev/kvm or memory.
    let missing = d.join("no-such-disk.img");
    let diskless = d.join("diskless");
    forge(&snap, &diskless, |vm, _| {
        vm["devices"] = serde_json::json!({"virtio": [{
            "base": 0xd000_0000u64,
            "transport": {"device_type": 2, "status": 15, "device_features_sel": 0,
                "driver_features_sel": 0, "acked_features": 0, "queue_sel": 0,
                "config_generation": 0, "interrupt_status": 0, "queues": []},
            "device": {"kind": "block", "path": missing, "run_scratch": false,
                "read_only": false, "capacity_sectors": 2048, "serial": ""}
        }]});
    });
    refused(&d, &diskless, before, &[missing.to_str().unwrap()]);

    // The real snapshot, restored with --same-distances: same cell, reported beside the
    // snapshot's node; the vCPU keeps its APIC ID.
    let sock2 = d.join("api2.sock");
    let restored = restore_with(&d, &snap, &sock2, &[], &["--same-distances"]);
    let again = common::ctl(&sock2, "placement").1;
    assert_eq!(common::ctl(&sock2, "shutdown").0, 0);
    let out = restored.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", common::text(&out));
    let node = placement["memory"][0]["expected_node"].as_u64().unwrap();
    let line = format!(
        "vmhost: restore: guest cell 0 (1 vCPUs, 32 MiB): node{node} in the snapshot, node{node} now"
    );
    assert!(
        common::stderr(&out).contains(&line),
        "{line}\n{}",
        common::text(&out)
    );
    for field in [
        "cell",
        "gpa",
        "size_bytes",
        "page_size_bytes",
        "expected_node",
        "pages_by_node",
    ] {
        assert_eq!(
            again["memory"][0][field], placement["memory"][0][field],
            "{field}: {again:#}"
        );
    }
    assert_eq!(pool(PAGE_2M), before, "every hugepage is back in the pool");
}
