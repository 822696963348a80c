//! Memory limits on this host's cgroup v1 memory controller: a VM past its limit is reported
//! and stopped, not killed by the kernel without a word; and how memfd `MFD_HUGETLB` guest RAM
//! is charged (hugetlb controller, at `mmap` and at fault; not the memory controller).

mod common;

use std::os::unix::process::ExitStatusExt;
use std::time::Duration;

use common::{assert_gone, describe, need_v1_root, plan_for, unique, Kid, MIB, PAGE_2M};
use vmhost_cgroup::{Cgroup, Controller, Limits, OomWait};

#[test]
fn child_entry() {
    common::children::child_main();
}

fn oom_control(cg: &Cgroup) -> String {
    let d = cg.dir(Controller::Memory).expect("memory cgroup");
    std::fs::read_to_string(d.join("memory.oom_control")).expect("memory.oom_control")
}

#[test]
fn vm_past_its_memory_limit_is_reported_and_stopped_not_killed_by_the_kernel() {
    need_v1_root("vm_past_its_memory_limit_is_reported_and_stopped");
    // An anonymous 16 MiB guest: limit = 16 MiB + the planned overhead. The child then uses far
    // more than the overhead it was given, as a VMM whose overhead was planned too small would.
    let plan =
        plan_for("[cpu]\ncores = 1\ndedicated_cpu_placement = true\n[memory]\nguest = \"16Mi\"\n");
    let limits = Limits::from_plan(&plan);
    let limit = limits.memory_max_bytes.unwrap();
    let name = unique("oom");
    let cg = Cgroup::create(&name, &limits).unwrap();
    let mut kid = Kid::spawn(&format!("alloc:{}", 4 * limit));
    assert_eq!(kid.hear(), "ready");
    cg.add_process(kid.pid()).unwrap();
    let mut watch = cg.oom_watch().unwrap();
    assert!(oom_control(&cg).contains("oom_kill_disable 1"));
    kid.say("go");
    let ev = match watch.wait(Some(Duration::from_secs(60))).unwrap() {
        OomWait::Limit(ev) => ev,
        other => panic!("no memory limit event: {other:?}"),
    };
    let msg = ev.to_string();
    println!("{msg}");
    assert!(
        msg.starts_with(&format!("memory limit {limit} bytes")),
        "{msg}"
    );
    assert!(
        msg.contains("raise `memory.reserved_overhead.added_overhead`"),
        "{msg}"
    );
    assert!(ev.usage_bytes.unwrap() + MIB >= limit, "{msg}");
    assert_eq!(ev.oom_kills, 0);
    // The child waits in the kernel for memory; it is alive until the parent stops it.
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        kid.child.try_wait().unwrap().is_none(),
        "child ended by itself"
    );
    let states = common::thread_states(kid.pid());
    assert!(
        states.contains('D'),
        "no thread waits in the kernel: {states}"
    );
    let control = oom_control(&cg);
    assert!(control.contains("under_oom 1"), "{control}");
    assert!(control.contains("oom_kill 0"), "{control}");
    kid.signal(libc::SIGTERM);
    let st = kid.wait_within(30, "SIGTERM to a task waiting under OOM");
    assert_eq!(st.signal(), Some(libc::SIGTERM), "{}", describe(&st));
    drop(watch);
    drop(cg);
    assert_gone(&name);
}

#[test]
fn vmm_in_its_own_cgroup_reports_the_limit_removes_the_cgroup_and_exits_non_zero() {
    need_v1_root("vmm_in_its_own_cgroup_reports_the_limit");
    let name = unique("selfoom");
    let limit = 24 * MIB;
    let mut kid = Kid::spawn(&format!("self-oom:{name}:{limit}:{}", 96 * MIB));
    assert_eq!(kid.hear(), "ready");
    let st = kid.wait_within(60, "VMM over its memory limit");
    let err = kid.stderr();
    assert_eq!(st.code(), Some(3), "{}; stderr: {err}", describe(&st));
    let want = format!("vmhost: stopping VM {name}: memory limit {limit} bytes (24.0 MiB) reached");
    assert!(err.contains(&want), "{err}");
    assert!(!err.contains("cannot remove"), "{err}");
    assert_gone(&name);
}

#[test]
fn memfd_hugetlb_is_charged_to_hugetlb_at_mmap_and_fault_and_not_to_memory() {
    let test = "memfd_hugetlb_is_charged_to_hugetlb";
    need_v1_root(test);
    let _pool = vmhost_testsupport::lock_pool();
    if !vmhost_testsupport::need_pages(test, PAGE_2M, 5) {
        return;
    }
    let name = unique("hugecharge");
    let limits = Limits {
        memory_max_bytes: Some(64 * MIB),
        hugetlb: vec![(PAGE_2M, 4 * PAGE_2M)],
        ..Limits::default()
    };
    let cg = Cgroup::create(&name, &limits).unwrap();
    let mut kid = Kid::spawn("hugetlb");
    assert_eq!(kid.hear(), "ready");
    cg.add_process(kid.pid()).unwrap();
    let counters = |cg: &Cgroup| {
        (
            cg.hugetlb_reserved_bytes(PAGE_2M).unwrap().unwrap(),
            cg.hugetlb_usage_bytes(PAGE_2M).unwrap().unwrap(),
            cg.memory_usage_bytes().unwrap(),
        )
    };
    kid.say("map");
    assert_eq!(kid.hear(), "mapped true");
    let (rsvd, used, mem_mapped) = counters(&cg);
    assert_eq!(
        (rsvd, used),
        (2 * PAGE_2M, 0),
        "reserved at mmap, nothing faulted"
    );
    kid.say("touch");
    assert_eq!(kid.hear(), "touched");
    let (rsvd, used, mem_touched) = counters(&cg);
    assert_eq!((rsvd, used), (2 * PAGE_2M, 2 * PAGE_2M), "charged at fault");
    assert!(
        mem_touched < mem_mapped + MIB,
        "4 MiB of hugepages charged to memory: {mem_mapped} -> {mem_touched}"
    );
    // 2 + 3 pages > the 4-page limit: the reservation limit fails the mmap (ENOMEM), so a VMM
    // learns at setup rather than from a SIGBUS at first touch.
    kid.say("more");
    assert_eq!(kid.hear(), format!("more err {}", libc::ENOMEM));
    let peak = cg.memory_peak_bytes().unwrap().unwrap();
    assert!(peak < 64 * MIB);
    let (st, err) = kid.finish();
    assert!(st.success(), "{}: {err}", describe(&st));
    drop(cg);
    assert_gone(&name);
}
