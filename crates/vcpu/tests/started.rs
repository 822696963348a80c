//! `Vm::start` and `Started::wait` on real KVM: the guest runs while the caller does other
//! work between the two, and a `Started` dropped without waiting (the caller failed in
//! between) stops the VM and joins every thread, so none outlives the VM's memory.

mod common;

use common::*;
use vmhost_vcpu::{thread_placements, RunStatus, Vm, VmError, VmOptions, VmState};

/// The tids of this process's threads named `vcpu<N>` (from `/proc/self/task`).
fn vcpu_tids() -> Vec<i32> {
    thread_placements()
        .expect("/proc")
        .into_iter()
        .filter(|t| t.vcpu_index().is_some())
        .map(|t| t.tid)
        .collect()
}

fn idle_plan(name: &str) -> vmhost_plan::Plan {
    plan_toml(&format!(
        "name = \"{name}\"\n[cpu]\ncores = 2\n[memory]\nguest = \"16Mi\"\n[boot]\npayload = \"idle\"\n"
    ))
}

#[test]
fn a_started_vm_runs_while_the_caller_works_and_wait_reports_its_end() {
    if !kvm_available("a_started_vm_runs_while_the_caller_works_and_wait_reports_its_end") {
        return;
    }
    let _cpus = lock_cpus();
    let plan = idle_plan("started");
    let mut vm = Vm::new(&plan, memory(&plan), VmOptions::default()).expect("VM");
    let (handle, stop) = (vm.handle(), vm.stop_handle());
    let started = vm.start().expect("start");
    // The caller's own work between start and wait: the guest is already running.
    assert!(wait_for(60, || stop.ready_vcpus() == 2), "vCPUs ready");
    assert_eq!(handle.state(), VmState::Running);
    assert_eq!(vcpu_tids().len(), 2, "two vCPU threads");
    stop.stop();
    let report = started.wait().expect("report");
    assert_eq!(report.status, RunStatus::Stopped);
    assert!(vcpu_tids().is_empty(), "every vCPU thread joined");
    assert!(
        matches!(vm.run(), Err(VmError::AlreadyRun)),
        "a VM runs once"
    );
}

#[test]
fn a_started_vm_dropped_without_waiting_is_stopped_and_joined() {
    if !kvm_available("a_started_vm_dropped_without_waiting_is_stopped_and_joined") {
        return;
    }
    let _cpus = lock_cpus();
    let plan = idle_plan("dropped");
    let mut vm = Vm::new(&plan, memory(&plan), VmOptions::default()).expect("VM");
    let (handle, stop) = (vm.handle(), vm.stop_handle());
    let started = vm.start().expect("start");
    assert!(wait_for(60, || stop.ready_vcpus() == 2), "vCPUs ready");
    assert_eq!(vcpu_tids().len(), 2, "two vCPU threads");
    drop(started);
    assert!(stop.stop_requested(), "the drop asked the VM to stop");
    assert!(
        vcpu_tids().is_empty(),
        "the drop joined every vCPU thread before the VM can go away"
    );
    assert_ne!(handle.state(), VmState::Running);
    drop(vm);
}
