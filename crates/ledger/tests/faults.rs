//! Faults: missing and unwritable run directories, empty/truncated/garbage/altered entry
//! files, files of unknown origin, leftover temporary files.
#![allow(clippy::unwrap_used)]

mod common;

use std::fs;
use std::path::{Path, PathBuf};

use common::{dedicated, host, planner, Proc};
use vmhost_ledger::{AdmitError, Ledger, LedgerError, Liveness};

/// A ledger in a fresh run directory whose 2-PU host is entirely held by a live child process.
fn full_ledger() -> (tempfile::TempDir, Ledger, Proc, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let ledger = Ledger::open(dir.path().join("run")).unwrap();
    let child = Proc::sleep();
    let holder = dedicated("holder", 2);
    let admitted = ledger
        .admit("holder", child.pid(), None, planner(&holder, &host2()))
        .unwrap();
    (dir, ledger, child, admitted.path)
}

fn host2() -> vmhost_topology::HostTopology {
    host("package:1 numa:1 core:2 pu:1")
}

fn admit_next(
    ledger: &Ledger,
) -> Result<vmhost_ledger::Admitted, AdmitError<vmhost_plan::Rejection>> {
    let next = dedicated("next", 1);
    ledger.admit("next", std::process::id(), None, planner(&next, &host2()))
}

/// Damage done to an entry file: the new content from the valid content.
type Damage = fn(&[u8]) -> Vec<u8>;

/// Ways an entry file can be damaged.
fn corruptions() -> Vec<(&'static str, Damage)> {
    vec![
        ("empty", |_| Vec::new()),
        ("truncated", |v| v[..v.len() / 2].to_vec()),
        ("garbage", |_| b"\x00\xff\x13 not json at all".to_vec()),
        ("not an object", |_| b"[1, 2, 3]\n".to_vec()),
        ("altered", |v| {
            String::from_utf8(v.to_vec())
                .unwrap()
                .replace("\"state\": \"starting\"", "\"state\": \"running\"")
                .into_bytes()
        }),
    ]
}

fn corrupt(path: &Path, how: Damage) {
    let valid = fs::read(path).unwrap();
    let bad = how(&valid);
    assert_ne!(valid, bad);
    fs::write(path, bad).unwrap();
}

#[test]
fn a_missing_run_directory_is_created() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("a/b/vmhost");
    let ledger = Ledger::open(&run).unwrap();
    assert!(run.join("vms").is_dir() && run.join("ledger.lock").is_file());
    assert_eq!(ledger.run_dir(), run);
    assert!(ledger.list().unwrap().entries.is_empty());
}

#[test]
fn an_unwritable_run_directory_is_named_in_the_error() {
    // Both fail even for root: a path under a character device, and a new directory in /proc.
    for (run, named) in [
        ("/dev/null/vmhost", "/dev/null/vmhost"),
        ("/proc", "/proc/vms"),
    ] {
        let err = Ledger::open(run).unwrap_err();
        assert!(
            matches!(&err, LedgerError::CreateDir { path, .. } if path == Path::new(named)),
            "{err:?}"
        );
        assert!(err.to_string().contains(named), "{err}");
    }
}

#[test]
fn a_readonly_handle_lists_a_missing_run_directory_as_empty() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = Ledger::open_readonly(dir.path().join("never-created"));
    assert!(ledger.list().unwrap().entries.is_empty());
    assert!(!dir.path().join("never-created").exists());
}

#[test]
fn a_damaged_entry_of_a_live_vm_refuses_admission_and_names_the_file() {
    for (what, how) in corruptions() {
        let (_dir, ledger, child, path) = full_ledger();
        corrupt(&path, how);
        let err = admit_next(&ledger).unwrap_err();
        match &err {
            AdmitError::Ledger(LedgerError::Corrupt { path: p, pid, .. }) => {
                assert_eq!((p, *pid), (&path, Some(child.pid())), "{what}");
            }
            other => panic!("{what}: expected Corrupt, got {other:?}"),
        }
        let msg = err.to_string();
        assert!(
            msg.contains(&path.display().to_string()) && msg.contains("still running"),
            "{msg}"
        );

        let snapshot = ledger.list().unwrap();
        assert!(snapshot.entries.is_empty(), "{what}");
        assert_eq!(snapshot.unreadable.len(), 1, "{what}");
        assert_eq!(snapshot.unreadable[0].liveness, Liveness::Alive);
        assert_eq!(snapshot.unreadable[0].name.as_deref(), Some("holder"));
        // gc leaves it to the operator; the file is kept.
        assert!(ledger.gc().unwrap().is_empty(), "{what}");
        assert!(path.exists(), "{what}");
    }
}

#[test]
fn a_damaged_entry_of_a_dead_vm_is_reclaimed() {
    for (what, how) in corruptions() {
        let (_dir, ledger, mut child, path) = full_ledger();
        corrupt(&path, how);
        child.kill();
        let admitted = admit_next(&ledger).unwrap();
        assert_eq!(admitted.reclaimed.len(), 1, "{what}");
        let r = &admitted.reclaimed[0];
        assert_eq!(
            (&r.path, r.pid, r.entry.is_none()),
            (&path, child.pid(), true),
            "{what}"
        );
        assert!(!path.exists(), "{what}");
    }
}

#[test]
fn a_file_of_unknown_origin_refuses_admission() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = Ledger::open(dir.path()).unwrap();
    let stray = dir.path().join("vms/notes.json");
    fs::write(&stray, "{}").unwrap();
    let err = admit_next(&ledger).unwrap_err();
    assert!(
        matches!(&err, AdmitError::Ledger(LedgerError::Corrupt { path, pid: None, .. }) if *path == stray),
        "{err:?}"
    );
    assert!(err.to_string().contains("delete the file"), "{err}");
    assert_eq!(
        ledger.list().unwrap().unreadable[0].liveness,
        Liveness::Unknown
    );
    // Files that are not JSON are not the ledger's.
    fs::remove_file(&stray).unwrap();
    fs::write(dir.path().join("vms/README"), "x").unwrap();
    admit_next(&ledger).unwrap();
}

#[test]
fn leftover_temporary_files_are_never_read_and_are_removed() {
    let (_dir, ledger, _child, path) = full_ledger();
    let tmp = path.with_file_name(format!(
        ".{}.tmp",
        path.file_name().unwrap().to_string_lossy()
    ));
    fs::write(&tmp, "{ half a wri").unwrap();
    assert_eq!(ledger.list().unwrap().entries.len(), 1);
    assert!(ledger.list().unwrap().unreadable.is_empty());
    assert!(
        tmp.exists(),
        "list holds a shared lock and must not remove files"
    );
    ledger.gc().unwrap();
    assert!(!tmp.exists());
    // Writes leave no temporary files behind.
    ledger.release("holder", _child.pid()).unwrap();
    admit_next(&ledger).unwrap();
    let names: Vec<_> = fs::read_dir(path.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names.len(), 1, "{names:?}");
}
