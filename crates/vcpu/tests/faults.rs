//! Guests that fault on purpose: a triple fault, a write to an unknown port, a write to
//! guest-physical memory no memslot backs, a page fault through the guest's IDT. Each must end
//! as a clean guest failure with vCPU and address, never a panic, and return every hugepage.

mod common;

use common::*;
use vmhost_vcpu::payload::program::{UNKNOWN_PORT, UNMAPPED_GPA, UNMAPPED_VA};
use vmhost_vcpu::{
    FaultPayload, PayloadKind, RunReport, RunStatus, UnknownAccessPolicy, VcpuOutcome, Vm,
    VmOptions,
};

const SPEC: &str = "name = \"fault\"\n[cpu]\ncores = 1\n[memory]\nguest = \"16Mi\"\nhugepages = { page_size = \"2Mi\" }\n\
                    [boot]\npayload = \"halt\"\n";

/// Runs `fault` on a hugepage-backed one-vCPU VM and checks that the pool is whole afterwards.
fn run_fault(test: &str, fault: FaultPayload, policy: UnknownAccessPolicy) -> Option<RunReport> {
    if !kvm_available(test) || !hugepages_wanted(test) {
        return None;
    }
    let _cpus = lock_cpus();
    let _pool = lock_hugepages();
    require_2m_hugepages(test, 8);
    let free_before = free_2m_hugepages();
    let plan = plan_toml(SPEC);
    let options = VmOptions {
        unknown_access: policy,
        payload_override: Some(PayloadKind::Fault(fault)),
        ..Default::default()
    };
    let mut vm = Vm::new(&plan, memory(&plan), options).expect("VM");
    let report = vm.run().expect("a guest fault is a report, not an error");
    drop(vm);
    assert_eq!(free_2m_hugepages(), free_before, "{test}: hugepages leaked");
    println!("{}", report.render_text());
    Some(report)
}

fn only_outcome(r: &RunReport) -> &VcpuOutcome {
    assert_eq!(r.vcpus.len(), 1);
    &r.vcpus[0].outcome
}

#[test]
fn triple_fault_ends_the_run_as_a_guest_failure() {
    let Some(r) = run_fault(
        "triple_fault_ends_the_run_as_a_guest_failure",
        FaultPayload::TripleFault,
        UnknownAccessPolicy::Stop,
    ) else {
        return;
    };
    assert_eq!(r.status, RunStatus::GuestFailed);
    assert_eq!(r.exit_code(), 4);
    // The payload faults in ring 3 with an IDT of limit 0; its mailbox says how far it got.
    assert!(
        matches!(
            only_outcome(&r),
            VcpuOutcome::Shutdown {
                payload_status: Some(2),
                ..
            }
        ),
        "{:?}",
        only_outcome(&r)
    );
}

#[test]
fn unknown_port_write_stops_the_vm_with_the_port() {
    let Some(r) = run_fault(
        "unknown_port_write_stops_the_vm_with_the_port",
        FaultPayload::UnknownPort,
        UnknownAccessPolicy::Stop,
    ) else {
        return;
    };
    assert_eq!(r.status, RunStatus::GuestFailed);
    assert_eq!(
        only_outcome(&r),
        &VcpuOutcome::UnknownPort {
            port: UNKNOWN_PORT,
            write: true,
            size: 1
        }
    );
    assert_eq!(r.failures().count(), 1);
}

#[test]
fn unknown_port_write_is_ignored_under_the_ignore_policy() {
    let Some(r) = run_fault(
        "unknown_port_write_is_ignored_under_the_ignore_policy",
        FaultPayload::UnknownPort,
        UnknownAccessPolicy::Ignore,
    ) else {
        return;
    };
    assert_eq!(r.status, RunStatus::Completed);
    assert_eq!(only_outcome(&r), &VcpuOutcome::Done);
    assert_eq!(r.vcpus[0].ignored_accesses, 1);
}

#[test]
fn unmapped_memory_write_stops_the_vm_with_the_gpa() {
    let Some(r) = run_fault(
        "unmapped_memory_write_stops_the_vm_with_the_gpa",
        FaultPayload::UnmappedMemory,
        UnknownAccessPolicy::Stop,
    ) else {
        return;
    };
    assert_eq!(r.status, RunStatus::GuestFailed);
    assert_eq!(
        only_outcome(&r),
        &VcpuOutcome::UnknownMmio {
            gpa: UNMAPPED_GPA,
            write: true,
            size: 8
        }
    );
}

#[test]
fn page_fault_is_reported_from_the_guest_idt() {
    let Some(r) = run_fault(
        "page_fault_is_reported_from_the_guest_idt",
        FaultPayload::PageFault,
        UnknownAccessPolicy::Stop,
    ) else {
        return;
    };
    assert_eq!(r.status, RunStatus::GuestFailed);
    match only_outcome(&r) {
        VcpuOutcome::Exception {
            vector, ring, cr2, ..
        } => {
            assert_eq!((*vector, *ring, *cr2), (14, 3, UNMAPPED_VA));
        }
        other => panic!("expected a page fault, got {other:?}"),
    }
}
