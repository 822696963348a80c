//! Real cgroups on this host (cgroup v1 cpuset and memory; hugetlb on the cgroup2 mount):
//! limits from planned VMs read back equal, processes join and leave, and every exit path
//! removes the VM's directories. Runs as root; each test uses its own cgroup name.

mod common;

use std::path::Path;

use common::{assert_gone, need_v1_root, plan_for, unique, Kid};
use vmhost_cgroup::{Cgroup, CgroupError, CgroupVersion, Controller, Limits};

const DEDICATED_HUGEPAGES: &str = "[cpu]\ncores = 1\ndedicated_cpu_placement = true\n\
    isolate_emulator_thread = true\n[memory]\nguest = \"64Mi\"\nhugepages = { page_size = \"2Mi\" }\n";

#[test]
fn child_entry() {
    common::children::child_main();
}

#[test]
fn dedicated_hugepage_vm_limits_read_back_equal_to_the_plan() {
    need_v1_root("dedicated_hugepage_vm_limits_read_back_equal_to_the_plan");
    let plan = plan_for(DEDICATED_HUGEPAGES);
    let limits = Limits::from_plan(&plan);
    assert_eq!(
        limits.cpus.len(),
        2,
        "one vCPU PU and one emulator PU: {limits:?}"
    );
    assert_eq!(limits.mems, [0]);
    assert_eq!(limits.memory_max_bytes, plan.envelope.memory_limit_bytes);
    assert_eq!(limits.memory_max_bytes, Some(plan.envelope.overhead_bytes));
    assert_eq!(limits.hugetlb, [(2 << 20, 64 << 20)]);

    let name = unique("dedicated");
    let cg = Cgroup::create(&name, &limits).unwrap();
    assert!(cg.notes().is_empty(), "{:?}", cg.notes());
    assert_eq!(cg.limits(), &limits);
    assert_eq!(cg.read_back().unwrap(), limits);
    let h = vmhost_cgroup::detect().unwrap();
    assert_eq!(
        h.controller(Controller::Hugetlb).unwrap().version,
        CgroupVersion::V2,
        "this host's hugetlb controller is on its cgroup2 mount"
    );
    let mem = cg.dir(Controller::Memory).unwrap().to_path_buf();
    let huge = cg.dir(Controller::Hugetlb).unwrap().to_path_buf();
    assert_eq!(mem, Path::new("/sys/fs/cgroup/memory/vmhost").join(&name));
    assert_eq!(huge, Path::new("/sys/fs/cgroup/unified/vmhost").join(&name));
    let file = |p: &Path, f: &str| std::fs::read_to_string(p.join(f)).unwrap();
    assert_eq!(
        file(&huge, "hugetlb.2MB.rsvd.max").trim(),
        (64u64 << 20).to_string()
    );
    assert_eq!(
        file(&mem, "memory.memsw.limit_in_bytes").trim(),
        limits.memory_max_bytes.unwrap().to_string(),
        "memory+swap at the memory limit: no swap"
    );
    drop(cg);
    assert_gone(&name);
}

#[test]
fn shared_anonymous_vm_limit_is_guest_plus_overhead_and_nodes_are_inherited() {
    need_v1_root("shared_anonymous_vm_limit_is_guest_plus_overhead_and_nodes_are_inherited");
    let plan = plan_for(
        "[cpu]\ncores = 2\n[memory]\nguest = \"128Mi\"\n[resources.limits]\nmemory = \"128Mi\"\n",
    );
    let limits = Limits::from_plan(&plan);
    let e = &plan.envelope;
    assert_eq!(
        limits.memory_max_bytes,
        Some((e.guest_memory_bytes + e.overhead_bytes).div_ceil(4096) * 4096)
    );
    assert!(limits.hugetlb.is_empty());
    assert!(!limits.cpus.is_empty());
    let name = unique("shared");
    let cg = Cgroup::create(&name, &limits).unwrap();
    let back = cg.read_back().unwrap();
    assert_eq!(&back, cg.limits());
    assert_eq!(back.cpus, limits.cpus);
    assert_eq!(back.memory_max_bytes, limits.memory_max_bytes);
    if limits.mems.is_empty() {
        assert_eq!(back.mems, [0], "unbound memory: all nodes of the parent");
    }
    assert!(
        cg.dir(Controller::Hugetlb).is_none(),
        "no hugepages, no hugetlb cgroup"
    );
    drop(cg);
    assert_gone(&name);
}

#[test]
fn added_child_runs_on_the_planned_cpus_and_drop_removes_the_cgroup_after_it_exits() {
    need_v1_root("added_child_runs_on_the_planned_cpus");
    let plan =
        plan_for("[cpu]\ncores = 1\ndedicated_cpu_placement = true\n[memory]\nguest = \"64Mi\"\n");
    let limits = Limits::from_plan(&plan);
    assert_eq!(
        limits.cpus.len(),
        1,
        "emulator shares the vCPU's PU: {limits:?}"
    );
    let name = unique("child");
    let cg = Cgroup::create(&name, &limits).unwrap();
    let mut kid = Kid::spawn("wait");
    assert_eq!(kid.hear(), "ready");
    cg.add_process(kid.pid()).unwrap();
    assert_eq!(cg.processes(), [kid.pid()]);
    let cgroups = std::fs::read_to_string(format!("/proc/{}/cgroup", kid.pid())).unwrap();
    for c in ["cpuset", "memory"] {
        let want = format!(":{c}:/vmhost/{name}\n");
        assert!(cgroups.contains(&want), "{want:?} not in {cgroups}");
    }
    let status = std::fs::read_to_string(format!("/proc/{}/status", kid.pid())).unwrap();
    let allowed = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .unwrap()
        .trim();
    assert_eq!(allowed, limits.cpus[0].to_string());
    let (st, _) = kid.finish();
    assert!(st.success());
    drop(cg);
    assert_gone(&name);
}

#[test]
fn remove_while_a_process_is_inside_reports_it() {
    need_v1_root("remove_while_a_process_is_inside_reports_it");
    let name = unique("busy");
    let limits = Limits {
        memory_max_bytes: Some(64 << 20),
        ..Limits::default()
    };
    let cg = Cgroup::create(&name, &limits).unwrap();
    let mut kid = Kid::spawn("wait");
    assert_eq!(kid.hear(), "ready");
    cg.add_process(kid.pid()).unwrap();
    let err = cg.remove().unwrap_err();
    assert!(
        matches!(&err, CgroupError::Remove { pids, .. } if pids == &[kid.pid()]),
        "{err}"
    );
    assert!(
        err.to_string().contains("stop them, then `rmdir` it"),
        "{err}"
    );
    kid.finish();
    for d in common::leaf_dirs(&name) {
        let _ = std::fs::remove_dir(d);
    }
    assert_gone(&name);
}

#[test]
fn add_self_in_a_child_and_drop_moves_it_back_out() {
    need_v1_root("add_self_in_a_child_and_drop_moves_it_back_out");
    let name = unique("self");
    let mut kid = Kid::spawn(&format!("self:{name}"));
    let before = kid.hear();
    let inside = kid.hear();
    let after = kid.hear();
    let (st, err) = kid.finish();
    assert!(st.success(), "{}: {err}", common::describe(&st));
    assert!(
        inside.contains(&format!(":cpuset:/vmhost/{name}")),
        "{inside}"
    );
    assert!(
        inside.contains(&format!(":memory:/vmhost/{name}")),
        "{inside}"
    );
    assert_eq!(
        before.strip_prefix("before "),
        after.strip_prefix("after "),
        "back where it started"
    );
    assert_gone(&name);
}

#[test]
fn invalid_cpu_fails_at_once_and_leaves_nothing_behind() {
    need_v1_root("invalid_cpu_fails_at_once_and_leaves_nothing_behind");
    let name = unique("badcpu");
    let limits = Limits {
        cpus: vec![4095],
        memory_max_bytes: Some(64 << 20),
        ..Limits::default()
    };
    let err = Cgroup::create(&name, &limits).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(&err, CgroupError::Write { value, .. } if value == "4095"),
        "{msg}"
    );
    assert!(
        msg.contains("cpuset.cpus: the host has no such CPU"),
        "{msg}"
    );
    assert_gone(&name);
}

#[test]
fn failure_in_the_last_hierarchy_removes_the_earlier_ones() {
    need_v1_root("failure_in_the_last_hierarchy_removes_the_earlier_ones");
    let name = unique("badsize");
    // cpuset and memory (v1) are made first; the hugetlb cgroup (v2) then has no 4 MiB size.
    let limits = Limits {
        memory_max_bytes: Some(64 << 20),
        hugetlb: vec![(4 << 20, 8 << 20)],
        ..Limits::default()
    };
    let err = Cgroup::create(&name, &limits).unwrap_err();
    assert!(
        err.to_string().contains("the kernel has no 4MB hugepages"),
        "{err}"
    );
    assert_gone(&name);
}

#[test]
fn leftover_cgroup_of_a_killed_vmm_is_replaced() {
    need_v1_root("leftover_cgroup_of_a_killed_vmm_is_replaced");
    let name = unique("stale");
    let limits = Limits {
        memory_max_bytes: Some(64 << 20),
        ..Limits::default()
    };
    let cg = Cgroup::create(&name, &limits).unwrap();
    std::mem::forget(cg); // as if the VMM had been SIGKILLed: no drop
    let cg = Cgroup::create(&name, &limits).unwrap();
    assert_eq!(cg.read_back().unwrap().memory_max_bytes, Some(64 << 20));
    drop(cg);
    assert_gone(&name);
}
