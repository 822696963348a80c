//! A migration within one host: the target's incoming entry next to the source's, the
//! hand-over at the switch, an abort, a dead target, one migration per VM at a time.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeSet;

use common::{dedicated, host, planner, Proc};
use vmhost_ledger::{AdmitError, EntryRole, Ledger, LedgerError, Liveness};
use vmhost_plan::Reason;

fn ledger() -> (tempfile::TempDir, Ledger) {
    let dir = tempfile::tempdir().unwrap();
    let ledger = Ledger::open(dir.path().join("vmhost")).unwrap();
    (dir, ledger)
}

/// 4 PUs; the VM takes 2.
const HOST: &str = "package:1 numa:1 core:4 pu:1";

fn pus(entry: &vmhost_ledger::Entry) -> BTreeSet<u32> {
    entry.dedicated_pus()
}

/// The source runs `web`; the target process is admitted as its incoming migration.
fn source_and_target(ledger: &Ledger) -> (Proc, Proc, BTreeSet<u32>, BTreeSet<u32>) {
    let (h, s) = (host(HOST), dedicated("web", 2));
    let source = Proc::sleep();
    let src = ledger
        .admit("web", source.pid(), None, planner(&s, &h))
        .unwrap();
    let target = Proc::sleep();
    let tgt = ledger
        .admit_incoming("web", target.pid(), None, planner(&s, &h))
        .unwrap();
    assert_eq!(tgt.entry.role, EntryRole::Incoming);
    (source, target, pus(&src.entry), pus(&tgt.entry))
}

#[test]
fn source_and_incoming_entries_are_held_at_once() {
    let (_dir, ledger) = ledger();
    let (source, target, src, tgt) = source_and_target(&ledger);
    assert_eq!((src.len(), tgt.len()), (2, 2));
    assert!(src.is_disjoint(&tgt), "{src:?} {tgt:?}");
    let listed = ledger.list().unwrap().entries;
    let roles: Vec<(u32, EntryRole)> = listed.iter().map(|l| (l.entry.pid, l.entry.role)).collect();
    assert_eq!(roles.len(), 2);
    assert!(roles.contains(&(source.pid(), EntryRole::Vm)));
    assert!(roles.contains(&(target.pid(), EntryRole::Incoming)));
    // Both count against admission: the host's 4 PUs are all held.
    let other = Proc::sleep();
    let err = ledger
        .admit(
            "other",
            other.pid(),
            None,
            planner(&dedicated("other", 1), &host(HOST)),
        )
        .unwrap_err();
    match err {
        AdmitError::Plan(r) => assert!(matches!(r.reasons[0], Reason::Cpus { available: 0, .. })),
        e => panic!("{e}"),
    }
    // A new VM cannot take the name while either holds it.
    let err = ledger
        .admit(
            "web",
            other.pid(),
            None,
            planner(&dedicated("web", 1), &host(HOST)),
        )
        .unwrap_err();
    assert!(
        matches!(err, AdmitError::Ledger(LedgerError::NameInUse { .. })),
        "{err}"
    );
}

#[test]
fn hand_over_makes_the_incoming_entry_the_vms_and_frees_the_source() {
    let (_dir, ledger) = ledger();
    let (source, target, src, tgt) = source_and_target(&ledger);
    let done = ledger.hand_over("web", target.pid()).unwrap();
    assert_eq!(done.entry.role, EntryRole::Vm);
    assert_eq!(done.replaced.len(), 1);
    assert!(!done.replaced[0].exists());
    let listed = ledger.list().unwrap().entries;
    assert_eq!(listed.len(), 1);
    assert_eq!(
        (listed[0].entry.pid, listed[0].entry.role),
        (target.pid(), EntryRole::Vm)
    );
    assert_eq!(pus(&listed[0].entry), tgt);
    // The source's PUs are free again; its own release finds nothing left to remove.
    let other = Proc::sleep();
    let admitted = ledger
        .admit(
            "other",
            other.pid(),
            None,
            planner(&dedicated("other", 2), &host(HOST)),
        )
        .unwrap();
    assert_eq!(pus(&admitted.entry), src);
    assert!(!ledger.release("web", source.pid()).unwrap());
    // Handed over once: a second hand-over and an abort find no incoming entry.
    assert!(matches!(
        ledger.hand_over("web", target.pid()),
        Err(LedgerError::NotIncoming { .. })
    ));
    assert!(!ledger.abort_incoming("web", target.pid()).unwrap());
    assert_eq!(ledger.list().unwrap().entries.len(), 2);
}

#[test]
fn an_aborted_incoming_entry_is_released_and_the_source_keeps_its_own() {
    let (_dir, ledger) = ledger();
    let (source, target, src, tgt) = source_and_target(&ledger);
    assert!(ledger.abort_incoming("web", target.pid()).unwrap());
    let listed = ledger.list().unwrap().entries;
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].entry.pid, source.pid());
    assert_eq!(pus(&listed[0].entry), src);
    // The target's PUs are free for the next VM.
    let other = Proc::sleep();
    let admitted = ledger
        .admit(
            "other",
            other.pid(),
            None,
            planner(&dedicated("other", 2), &host(HOST)),
        )
        .unwrap();
    assert_eq!(pus(&admitted.entry), tgt);
    // Aborting the VM's (source's) pid touches nothing: it has no incoming entry.
    assert!(!ledger.abort_incoming("web", source.pid()).unwrap());
    assert!(matches!(
        ledger.hand_over("web", target.pid()),
        Err(LedgerError::NotIncoming { .. })
    ));
}

#[test]
fn a_dead_targets_incoming_entry_is_reclaimed() {
    let (_dir, ledger) = ledger();
    let (source, mut target, src, _) = source_and_target(&ledger);
    target.kill();
    let snapshot = ledger.list().unwrap();
    let dead = snapshot
        .entries
        .iter()
        .find(|l| l.entry.role == EntryRole::Incoming)
        .unwrap();
    assert_eq!(dead.liveness, Liveness::Exited);
    let reclaimed = ledger.gc().unwrap();
    assert_eq!(reclaimed.len(), 1);
    assert_eq!(reclaimed[0].pid, target.pid());
    assert_eq!(
        reclaimed[0].entry.as_ref().unwrap().role,
        EntryRole::Incoming
    );
    let listed = ledger.list().unwrap().entries;
    assert_eq!(listed.len(), 1);
    assert_eq!(
        (listed[0].entry.pid, pus(&listed[0].entry)),
        (source.pid(), src)
    );
    // A new target can be admitted in its place.
    let next = Proc::sleep();
    let (h, s) = (host(HOST), dedicated("web", 2));
    ledger
        .admit_incoming("web", next.pid(), None, planner(&s, &h))
        .unwrap();
}

#[test]
fn two_incoming_entries_for_one_name_are_refused() {
    let (_dir, ledger) = ledger();
    let h = host("package:1 numa:1 core:8 pu:1");
    let s = dedicated("web", 2);
    let (first, second) = (Proc::sleep(), Proc::sleep());
    ledger
        .admit_incoming("web", first.pid(), None, planner(&s, &h))
        .unwrap();
    let err = ledger
        .admit_incoming("web", second.pid(), None, planner(&s, &h))
        .unwrap_err();
    match err {
        AdmitError::Ledger(LedgerError::IncomingInUse { name, pid }) => {
            assert_eq!((name.as_str(), pid), ("web", first.pid()));
        }
        e => panic!("{e}"),
    }
    assert_eq!(ledger.list().unwrap().entries.len(), 1);
}
