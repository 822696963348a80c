//! Unit tests that need the crate's internals: entries written by hand.

use super::*;

fn entry_for(name: &str, pid: u32, proc_start_ticks: u64) -> Entry {
    Entry {
        name: name.into(),
        pid,
        proc_start_ticks,
        started_at_unix_ms: 0,
        state: VmState::Running,
        role: EntryRole::Vm,
        vcpu_pus: vec![Some(0)],
        floating_cpus: vec![],
        emulator_pus: vec![0],
        emulator_isolated: false,
        io_pool_pus: Vec::new(),
        hugepages: vec![],
        memory: vec![],
        api_socket: None,
    }
}

fn write(ledger: &Ledger, entry: &Entry) -> PathBuf {
    let text = entry::encode(entry).expect("encode");
    store::write_atomic(&ledger.vms_dir, &entry.file_name(), text.as_bytes()).expect("write");
    ledger.vms_dir.join(entry.file_name())
}

#[test]
fn a_reused_pid_does_not_keep_an_entry_alive() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ledger = Ledger::open(dir.path()).expect("open");
    let me = std::process::id();
    let sys::Probe::Running { start_ticks } = sys::probe(me) else {
        panic!("cannot probe this process");
    };
    // Same pid, another start time: an earlier VM whose pid this test process now has.
    let path = write(&ledger, &entry_for("old", me, start_ticks + 1));
    let alive = write(&ledger, &entry_for("current", me, start_ticks));

    let listed = ledger.list().expect("list").entries;
    let liveness: Vec<_> = listed
        .iter()
        .map(|l| (l.entry.name.as_str(), l.liveness))
        .collect();
    assert_eq!(
        liveness,
        [("current", Liveness::Alive), ("old", Liveness::PidReused)]
    );

    let reclaimed = ledger.gc().expect("gc");
    assert_eq!(reclaimed.len(), 1);
    assert_eq!(
        (&reclaimed[0].path, reclaimed[0].liveness),
        (&path, Liveness::PidReused)
    );
    assert!(!path.exists() && alive.exists());
}

#[test]
fn a_file_whose_content_contradicts_its_name_is_unreadable() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ledger = Ledger::open(dir.path()).expect("open");
    let me = std::process::id();
    let entry = entry_for("a", me, 1);
    let text = entry::encode(&entry).expect("encode");
    let renamed = entry::FileKey {
        name: "b".into(),
        pid: me,
        start_ticks: 1,
    }
    .file_name();
    store::write_atomic(&ledger.vms_dir, &renamed, text.as_bytes()).expect("write");
    let snapshot = ledger.list().expect("list");
    assert!(snapshot.entries.is_empty());
    assert!(snapshot.unreadable[0]
        .detail
        .contains("does not match the file name"));
}

#[test]
fn held_counts_dedicated_pus_and_pages_of_starting_vms_only() {
    let mut starting = entry_for("s", 1, 1);
    starting.state = VmState::Starting;
    starting.vcpu_pus = vec![Some(1), Some(2)];
    starting.emulator_pus = vec![3];
    starting.emulator_isolated = true;
    starting.hugepages = vec![HugepageReservation {
        node: Some(0),
        page_size_bytes: 2 << 20,
        count: 10,
    }];
    let mut running = starting.clone();
    running.state = VmState::Running;
    running.vcpu_pus = vec![Some(5)];
    running.emulator_isolated = false;
    running.emulator_pus = vec![5];
    let mut floating = entry_for("f", 1, 1);
    floating.vcpu_pus = vec![None];
    floating.floating_cpus = vec![6, 7];
    floating.emulator_pus = vec![6, 7];
    let held = held(&[starting.clone(), running, floating]);
    assert_eq!(held.cpus, BTreeSet::from([1, 2, 3, 5]));
    assert_eq!(held.unallocated_hugepages, starting.hugepages);
}

#[test]
fn an_entry_is_never_written_through_a_symlink_at_its_temporary_name() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ledger = Ledger::open(dir.path().join("run")).expect("open");
    let outside = dir.path().join("outside");
    std::fs::write(&outside, b"precious").expect("write outside");
    let entry = entry_for("vm", 4242, 7);
    std::os::unix::fs::symlink(
        &outside,
        ledger.vms_dir.join(format!(".{}.tmp", entry.file_name())),
    )
    .expect("symlink");
    let path = write(&ledger, &entry);
    assert_eq!(std::fs::read(&outside).expect("read outside"), b"precious");
    let meta = std::fs::symlink_metadata(&path).expect("entry");
    assert!(meta.file_type().is_file(), "{meta:?}");
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o777,
        0o600
    );
}
