//! Ledger lifecycle with real processes: admission, reclamation after SIGKILL, names, states.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeSet;

use common::{dedicated, host, planner, shared, spec, Proc};
use vmhost_ledger::{AdmitError, Ledger, LedgerError, Liveness, VmState};
use vmhost_plan::Reason;

fn ledger() -> (tempfile::TempDir, Ledger) {
    let dir = tempfile::tempdir().unwrap();
    let ledger = Ledger::open(dir.path().join("run")).unwrap();
    (dir, ledger)
}

#[test]
fn sigkill_of_a_vm_frees_its_pus_for_the_next_vm() {
    let (_dir, ledger) = ledger();
    let host = host("package:1 numa:1 core:2 pu:1");
    let (a, b) = (dedicated("a", 2), dedicated("b", 1));
    let mut vm_a = Proc::sleep();
    let admitted = ledger
        .admit("a", vm_a.pid(), None, planner(&a, &host))
        .unwrap();
    assert_eq!(admitted.entry.dedicated_pus(), BTreeSet::from([0, 1]));

    let me = std::process::id();
    match ledger.admit("b", me, None, planner(&b, &host)) {
        Err(AdmitError::Plan(r)) => assert!(matches!(r.reasons[0], Reason::Cpus { .. })),
        other => panic!("expected a rejection, got {other:?}"),
    }
    // Nothing was recorded for the rejected VM.
    assert_eq!(ledger.list().unwrap().entries.len(), 1);

    vm_a.kill(); // a zombie now: dead, though not reaped
    let admitted = ledger.admit("b", me, None, planner(&b, &host)).unwrap();
    assert_eq!(admitted.reclaimed.len(), 1);
    assert_eq!(admitted.reclaimed[0].name, "a");
    assert_eq!(admitted.reclaimed[0].liveness, Liveness::Exited);
    assert_eq!(admitted.entry.dedicated_pus().len(), 1);
}

#[test]
fn gc_removes_the_entries_of_dead_processes_only() {
    let (_dir, ledger) = ledger();
    let host = host("package:1 numa:1 core:4 pu:1");
    let (a, b) = (dedicated("a", 1), dedicated("b", 1));
    let mut vm_a = Proc::sleep();
    let vm_b = Proc::sleep();
    ledger
        .admit("a", vm_a.pid(), None, planner(&a, &host))
        .unwrap();
    ledger
        .admit("b", vm_b.pid(), None, planner(&b, &host))
        .unwrap();
    vm_a.kill();
    vm_a.reap();

    let listed = ledger.list().unwrap().entries;
    let liveness: Vec<_> = listed
        .iter()
        .map(|l| (l.entry.name.as_str(), l.liveness))
        .collect();
    assert_eq!(liveness, [("a", Liveness::Exited), ("b", Liveness::Alive)]);

    let removed = ledger.gc().unwrap();
    assert_eq!(removed.len(), 1);
    assert_eq!(removed[0].entry.as_ref().unwrap().name, "a");
    assert!(!removed[0].path.exists());
    assert!(ledger.gc().unwrap().is_empty());
    assert_eq!(ledger.list().unwrap().entries.len(), 1);
}

#[test]
fn a_second_vm_with_a_running_vms_name_is_refused() {
    let (_dir, ledger) = ledger();
    let host = host("package:1 numa:1 core:4 pu:1");
    let web = dedicated("web", 1);
    let mut first = Proc::sleep();
    ledger
        .admit("web", first.pid(), None, planner(&web, &host))
        .unwrap();
    let err = ledger
        .admit("web", std::process::id(), None, planner(&web, &host))
        .unwrap_err();
    match &err {
        AdmitError::Ledger(LedgerError::NameInUse { name, pid }) => {
            assert_eq!((name.as_str(), *pid), ("web", first.pid()));
        }
        other => panic!("expected NameInUse, got {other:?}"),
    }
    assert!(err.to_string().contains("already runs"), "{err}");

    first.kill();
    ledger
        .admit("web", std::process::id(), None, planner(&web, &host))
        .unwrap();
}

#[test]
fn shared_vms_float_only_over_pus_no_dedicated_vm_holds() {
    let (_dir, ledger) = ledger();
    let host = host("package:1 numa:1 core:4 pu:1");
    let (d, s) = (dedicated("d", 1), shared("s"));
    let me = std::process::id();
    let held = ledger.admit("d", me, None, planner(&d, &host)).unwrap();
    let held_pus = held.entry.dedicated_pus();
    let floating = ledger.admit("s", me, None, planner(&s, &host)).unwrap();
    assert!(floating.entry.is_floating());
    assert_eq!(floating.entry.floating_cpus.len(), 3);
    assert!(floating
        .entry
        .floating_cpus
        .iter()
        .all(|pu| !held_pus.contains(pu)));
    // A shared VM holds nothing: a second dedicated VM still gets one of the 3 other PUs.
    assert!(floating.entry.dedicated_pus().is_empty());
    let d2 = dedicated("d2", 3);
    ledger.admit("d2", me, None, planner(&d2, &host)).unwrap();
}

#[test]
fn a_plan_that_ignores_held_pus_is_refused_by_the_ledger() {
    let (_dir, ledger) = ledger();
    let host = host("package:1 numa:1 core:2 pu:1");
    let (a, b) = (dedicated("a", 1), dedicated("b", 1));
    let me = std::process::id();
    ledger.admit("a", me, None, planner(&a, &host)).unwrap();
    let blind = |_: &vmhost_ledger::Held| {
        vmhost_plan::plan(&b, &host, &vmhost_plan::PlanOptions::default()).into_result()
    };
    match ledger.admit("b", me, None, blind) {
        Err(AdmitError::Ledger(LedgerError::PuConflict { pu, holder, .. })) => {
            assert_eq!((pu, holder.as_str()), (0, "a"));
        }
        other => panic!("expected PuConflict, got {other:?}"),
    }
}

#[test]
fn hugepages_and_memory_per_node_are_recorded() {
    let (_dir, ledger) = ledger();
    let mut host = host("package:2 numa:1 core:2 pu:1");
    let pools = vmhost_topology::parse_hugepages_arg("node0:2Mi=512,node1:2Mi=512").unwrap();
    vmhost_topology::apply_hugepages(&mut host, &pools).unwrap();
    let vm = spec(
        "huge",
        "cores = 2\ndedicated_cpu_placement = true",
        "guest = \"256Mi\"\nhugepages = { page_size = \"2Mi\" }",
    );
    let me = std::process::id();
    let admitted = ledger
        .admit(
            "huge",
            me,
            Some("/run/vmhost/huge.sock".into()),
            planner(&vm, &host),
        )
        .unwrap();
    let e = &admitted.entry;
    assert_eq!(e.state, VmState::Starting);
    assert_eq!(e.hugepages.iter().map(|h| h.count).sum::<u64>(), 128);
    assert_eq!(e.memory.iter().map(|m| m.bytes).sum::<u64>(), 256 << 20);
    assert!(e.memory.iter().all(|m| m.page_size_bytes == 2 << 20));
    assert_eq!(
        e.api_socket.as_deref(),
        Some("/run/vmhost/huge.sock".as_ref())
    );
    assert_eq!(ledger.list().unwrap().entries[0].entry, *e);

    // While it is starting, its pages are promised but not yet allocated.
    let probe = |ledger: &Ledger| {
        let mut seen = None;
        let _ = ledger.admit("probe", me, None, |held| {
            seen = Some(held.clone());
            Err::<vmhost_plan::Plan, _>("only looking")
        });
        seen.unwrap()
    };
    let held = probe(&ledger);
    assert_eq!(held.unallocated_hugepages, e.hugepages);
    assert_eq!(held.cpus, e.dedicated_pus());
    ledger.update_state("huge", me, VmState::Running).unwrap();
    assert!(probe(&ledger).unallocated_hugepages.is_empty());
}

#[test]
fn release_and_update_state_address_one_name_and_pid() {
    let (_dir, ledger) = ledger();
    let host = host("package:1 numa:1 core:2 pu:1");
    let a = dedicated("a", 1);
    let me = std::process::id();
    ledger.admit("a", me, None, planner(&a, &host)).unwrap();
    assert!(matches!(
        ledger.update_state("a", me + 1, VmState::Running),
        Err(LedgerError::NotFound { .. })
    ));
    assert_eq!(
        ledger.update_state("a", me, VmState::Paused).unwrap().state,
        VmState::Paused
    );
    assert!(!ledger.release("a", me + 1).unwrap());
    assert!(ledger.release("a", me).unwrap());
    assert!(!ledger.release("a", me).unwrap());
    assert!(ledger.list().unwrap().entries.is_empty());
}

#[test]
fn bad_names_and_dead_pids_are_refused_before_planning() {
    let (_dir, ledger) = ledger();
    let host = host("package:1 numa:1 core:2 pu:1");
    let a = dedicated("a", 1);
    for bad in ["../etc", "A", "a.b", ""] {
        let err = ledger
            .admit(bad, std::process::id(), None, planner(&a, &host))
            .unwrap_err();
        assert!(
            matches!(err, AdmitError::Ledger(LedgerError::InvalidName { .. })),
            "{bad}"
        );
    }
    let mut gone = Proc::sleep();
    let pid = gone.pid();
    gone.kill();
    gone.reap();
    let err = ledger
        .admit("a", pid, None, planner(&a, &host))
        .unwrap_err();
    assert!(
        matches!(err, AdmitError::Ledger(LedgerError::ProcessNotRunning { pid: p }) if p == pid),
        "{err:?}"
    );
    assert!(matches!(
        ledger.admit("a", 0, None, planner(&a, &host)),
        Err(AdmitError::Ledger(LedgerError::ProcessNotRunning {
            pid: 0
        }))
    ));
}
