//! The snapshot directory on a real file system: modes, no overwrite, no link followed, and a
//! whole check before a restore that refuses a missing, extra, changed or linked file.
#![allow(clippy::cast_possible_truncation)] // small test sizes

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use vmhost_persist::container::RecordKind;
use vmhost_persist::dir::{DirError, FileName, Snapshot, SnapshotWriter, STATE_FILE};
use vmhost_persist::pages::{decode_run, is_zero_page, write_pages, CellGeometry};

const PS: u32 = 4096;
const VMSTATE: RecordKind = RecordKind(16);

/// Writes a two-cell snapshot into `root/snap`.
fn write_snapshot(root: &Path) -> PathBuf {
    let dir = root.join("snap");
    let mut w = SnapshotWriter::create(&dir, "0.1.0").expect("create");
    w.write_file(FileName::Spec, |f| {
        Ok(f.write_record(RecordKind::SPEC, b"name: web-1\n")?)
    })
    .expect("spec");
    w.write_file(FileName::Plan, |f| {
        Ok(f.write_record(RecordKind::PLAN, b"{}")?)
    })
    .expect("plan");
    for cell in 0..2u32 {
        let geometry = CellGeometry::new(cell, PS, 8 * u64::from(PS)).expect("geometry");
        let mut memory = vec![0u8; 8 * PS as usize];
        memory[3 * PS as usize] = 0x40 + cell as u8;
        w.write_file(FileName::MemoryCell(cell), |f| {
            write_pages(f, &geometry, 0, &memory, |_, p| is_zero_page(p))?;
            Ok(())
        })
        .expect("memory");
    }
    w.commit(|f| Ok(f.write_record(VMSTATE, b"vcpu state")?))
        .expect("commit")
}

fn names(dir: &Path) -> Vec<String> {
    let mut n: Vec<String> = fs::read_dir(dir)
        .expect("list")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    n.sort();
    n
}

#[test]
fn a_snapshot_is_written_private_and_reads_back() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = write_snapshot(root.path());
    assert_eq!(
        names(&dir),
        ["memory-cell0", "memory-cell1", "plan", "spec", "state"]
    );
    assert_eq!(fs::metadata(&dir).expect("dir").mode() & 0o777, 0o700);
    for n in names(&dir) {
        let mode = fs::metadata(dir.join(&n)).expect("file").mode() & 0o777;
        assert_eq!(mode, 0o600, "{n}");
    }
    let snap = Snapshot::open(&dir).expect("open");
    assert_eq!(snap.cells(), 2);
    assert_eq!(snap.header().vmhost_version, "0.1.0");
    // A cell's memory file: only the one non-zero page, at its offset.
    let geometry = CellGeometry::new(1, PS, 8 * u64::from(PS)).expect("geometry");
    let mut r = snap
        .open_file(FileName::MemoryCell(1), &[RecordKind::PAGES])
        .expect("cell 1");
    let rec = r.next_record().expect("record").expect("one run");
    let run = decode_run(&rec.payload, &geometry).expect("run");
    assert_eq!((run.offset, run.bytes[0]), (3 * u64::from(PS), 0x41));
    assert!(r.next_record().expect("end").is_none());
    // A snapshot of 2 × 32 KiB of memory holds 2 pages of it.
    let mem = fs::metadata(dir.join("memory-cell0"))
        .expect("cell 0")
        .len();
    assert!(mem < 2 * u64::from(PS), "{mem} bytes");
    // The state: the manifest, then the VMM's records.
    let mut s = snap.open_state(&[VMSTATE]).expect("state");
    assert_eq!(
        s.next_record().expect("r").expect("manifest").kind,
        RecordKind::MANIFEST_XXH3
    );
    assert_eq!(
        s.next_record().expect("r").expect("vm").payload,
        b"vcpu state"
    );
}

#[test]
fn an_existing_directory_or_file_is_never_overwritten() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = root.path().join("snap");
    fs::create_dir(&dir).expect("mkdir");
    let err = SnapshotWriter::create(&dir, "0.1.0").err().expect("exists");
    assert!(matches!(err, DirError::CreateDir { .. }), "{err:?}");

    // A link planted where the directory goes: refused, and its target untouched.
    let elsewhere = root.path().join("elsewhere");
    fs::create_dir(&elsewhere).expect("mkdir");
    let link = root.path().join("link");
    std::os::unix::fs::symlink(&elsewhere, &link).expect("symlink");
    assert!(SnapshotWriter::create(&link, "0.1.0").is_err());
    assert!(names(&elsewhere).is_empty());
}

#[test]
fn a_link_planted_as_a_snapshot_file_is_not_followed() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = root.path().join("snap");
    let victim = root.path().join("victim");
    fs::write(&victim, b"precious").expect("victim");
    let mut w = SnapshotWriter::create(&dir, "0.1.0").expect("create");
    // Another user races the snapshot and plants `spec` as a link to a file of ours.
    std::os::unix::fs::symlink(&victim, dir.join("spec")).expect("symlink");
    let err = w
        .write_file(FileName::Spec, |f| {
            Ok(f.write_record(RecordKind::SPEC, b"x")?)
        })
        .expect_err("link refused");
    assert!(matches!(err, DirError::CreateFile { .. }), "{err:?}");
    assert_eq!(fs::read(&victim).expect("victim"), b"precious");
}

#[test]
fn a_changed_file_is_refused_before_restore() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = write_snapshot(root.path());
    let cell = dir.join("memory-cell1");
    let mut bytes = fs::read(&cell).expect("read");
    // A byte of the page data: the record's CRC fails.
    let at = bytes.len() - 100;
    bytes[at] ^= 0x04;
    fs::write(&cell, &bytes).expect("write");
    let err = Snapshot::open(&dir).expect_err("corrupted");
    assert!(
        matches!(&err, DirError::Damaged { path, .. } if *path == cell),
        "{err:?}"
    );
}

#[test]
fn a_file_swapped_for_another_valid_one_is_refused() {
    // Cell 0's file replaced by cell 1's: each is a valid container, the manifest's
    // checksum tells them apart.
    let root = tempfile::tempdir().expect("tempdir");
    let dir = write_snapshot(root.path());
    fs::copy(dir.join("memory-cell1"), dir.join("memory-cell0")).expect("copy");
    let err = Snapshot::open(&dir).expect_err("swapped");
    assert!(matches!(err, DirError::Mismatch { .. }), "{err:?}");
    assert!(err.to_string().contains("memory-cell0"), "{err}");
}

#[test]
fn a_missing_extra_or_linked_file_is_refused() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = write_snapshot(root.path());
    fs::rename(dir.join("plan"), root.path().join("plan")).expect("move");
    let err = Snapshot::open(&dir).expect_err("missing");
    assert!(err.to_string().contains("plan is missing"), "{err}");

    // Back, plus a stray file.
    fs::rename(root.path().join("plan"), dir.join("plan")).expect("move back");
    Snapshot::open(&dir).expect("whole again");
    fs::write(dir.join("memory-cell2"), b"").expect("stray");
    let err = Snapshot::open(&dir).expect_err("extra");
    assert!(err.to_string().contains("memory-cell2"), "{err}");
    fs::remove_file(dir.join("memory-cell2")).expect("rm");

    // The state file as a link to a valid one elsewhere.
    let copy = root.path().join("state-copy");
    fs::copy(dir.join(STATE_FILE), &copy).expect("copy");
    fs::remove_file(dir.join(STATE_FILE)).expect("rm");
    std::os::unix::fs::symlink(&copy, dir.join(STATE_FILE)).expect("symlink");
    let err = Snapshot::open(&dir).expect_err("linked state");
    assert!(matches!(err, DirError::Open { .. }), "{err:?}");
    fs::remove_file(dir.join(STATE_FILE)).expect("rm");
    fs::rename(&copy, dir.join(STATE_FILE)).expect("restore");

    // A FIFO in place of a memory file: refused, not blocked on.
    fs::remove_file(dir.join("memory-cell1")).expect("rm");
    // mkfifo(1) keeps this test free of unsafe code.
    let status = std::process::Command::new("mkfifo")
        .arg(dir.join("memory-cell1"))
        .status()
        .expect("mkfifo");
    assert!(status.success());
    let err = Snapshot::open(&dir).expect_err("fifo");
    assert!(matches!(err, DirError::Open { .. }), "{err:?}");
}

#[test]
fn an_unfinished_snapshot_is_refused() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = root.path().join("snap");
    let mut w = SnapshotWriter::create(&dir, "0.1.0").expect("create");
    w.write_file(FileName::Spec, |f| {
        Ok(f.write_record(RecordKind::SPEC, b"x")?)
    })
    .expect("spec");
    // No state file yet: not a snapshot.
    let err = Snapshot::open(&dir).expect_err("no state");
    assert!(matches!(err, DirError::Open { .. }), "{err:?}");
    // Commit refuses a snapshot without its plan and memory.
    let err = w.commit(|_| Ok(())).expect_err("incomplete");
    assert!(err.to_string().contains("plan is missing"), "{err}");
    assert!(!dir.join(STATE_FILE).exists());
    // And a truncated state file.
    let second = root.path().join("b");
    fs::create_dir(&second).expect("mkdir");
    let dir2 = write_snapshot(&second);
    let state = dir2.join(STATE_FILE);
    let len = fs::metadata(&state).expect("state").len();
    fs::OpenOptions::new()
        .write(true)
        .open(&state)
        .and_then(|f| f.set_len(len - 10))
        .expect("truncate");
    let err = Snapshot::open(&dir2).expect_err("truncated state");
    assert!(err.to_string().contains("state"), "{err}");
}

#[test]
fn single_records_and_the_vm_state_read_back() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("snap");
    let mut w = SnapshotWriter::create(&dir, "0.1.0").unwrap();
    w.write_single(FileName::Spec, RecordKind::SPEC, b"name = \"a\"")
        .unwrap();
    w.write_single(FileName::Plan, RecordKind::PLAN, b"{\"plan\":1}")
        .unwrap();
    w.write_file(FileName::MemoryCell(0), |_| Ok(())).unwrap();
    w.commit(|out| Ok(out.write_record(RecordKind::VM_STATE, b"{\"vm\":2}")?))
        .unwrap();
    let snap = Snapshot::open(&dir).unwrap();
    assert_eq!(
        snap.read_single(FileName::Spec, RecordKind::SPEC).unwrap(),
        b"name = \"a\""
    );
    assert_eq!(
        snap.read_single(FileName::Plan, RecordKind::PLAN).unwrap(),
        b"{\"plan\":1}"
    );
    assert_eq!(
        snap.read_state(RecordKind::VM_STATE).unwrap(),
        b"{\"vm\":2}"
    );
    assert_eq!(RecordKind::VM_STATE.to_string(), "vm state (kind 16)");
}

#[test]
fn the_guest_identity_reads_back_beside_the_vm_state_and_an_unknown_one_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("snap");
    let mut w = SnapshotWriter::create(&dir, "0.1.0").unwrap();
    w.write_single(FileName::Spec, RecordKind::SPEC, b"s")
        .unwrap();
    w.write_single(FileName::Plan, RecordKind::PLAN, b"p")
        .unwrap();
    w.write_file(FileName::MemoryCell(0), |_| Ok(())).unwrap();
    w.commit(|out| {
        out.write_record(RecordKind::VM_STATE, b"{\"vm\":2}")?;
        Ok(out.write_record(RecordKind::GUEST_IDENTITY, b"{\"id\":3}")?)
    })
    .unwrap();
    let snap = Snapshot::open(&dir).unwrap();
    let both = [RecordKind::VM_STATE, RecordKind::GUEST_IDENTITY];
    assert_eq!(
        snap.read_state_records(&both).unwrap(),
        vec![
            (RecordKind::VM_STATE, b"{\"vm\":2}".to_vec()),
            (RecordKind::GUEST_IDENTITY, b"{\"id\":3}".to_vec())
        ]
    );
    // A reader that knows only the VM state refuses the mandatory identity it cannot honour.
    let err = snap
        .read_state_records(&[RecordKind::VM_STATE])
        .unwrap_err();
    assert!(
        matches!(
            &err,
            DirError::Damaged {
                source: vmhost_persist::ContainerError::UnknownMandatory { .. },
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(
        RecordKind::GUEST_IDENTITY.to_string(),
        "guest identity (kind 17)"
    );
}

#[test]
fn an_unfinished_snapshot_is_removed_but_nothing_else() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("snap");
    let mut w = SnapshotWriter::create(&dir, "0.1.0").unwrap();
    w.write_single(FileName::Spec, RecordKind::SPEC, b"x")
        .unwrap();
    w.write_file(FileName::MemoryCell(0), |_| Ok(())).unwrap();
    fs::write(dir.join("notes"), b"the user's").unwrap();
    assert!(vmhost_persist::dir::remove_unfinished(&dir).is_err());
    assert_eq!(names(&dir), vec!["notes".to_string()]);
    fs::remove_file(dir.join("notes")).unwrap();
    let mut w = SnapshotWriter::create(&tmp.path().join("s2"), "0.1.0").unwrap();
    w.write_single(FileName::Plan, RecordKind::PLAN, b"x")
        .unwrap();
    vmhost_persist::dir::remove_unfinished(w.dir()).unwrap();
    assert!(!tmp.path().join("s2").exists());
}
