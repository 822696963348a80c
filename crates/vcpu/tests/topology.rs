//! The guest reads its CPUID topology leaves in ring 0 and reports them through its mailbox:
//! they must describe the spec's sockets × cores × threads.

mod common;

use common::*;
use vmhost_vcpu::{decode_topology, RunStatus, Vm, VmOptions};

fn check_topology(toml: &str, dedicated: bool) {
    let _cpus = lock_cpus();
    let plan = plan_toml(toml);
    let t = plan.guest_topology;
    let mut vm = Vm::new(&plan, memory(&plan), VmOptions::default()).expect("VM");
    let report = vm.run().expect("run");
    println!("{}", report.render_text());
    assert_eq!(report.status, RunStatus::Completed);
    assert_eq!(
        report.vcpus.len(),
        (t.sockets * t.cores * t.threads) as usize
    );
    for (v, placed) in report.vcpus.iter().zip(&plan.vcpus) {
        assert!(!v.cpuid.is_empty(), "vCPU {} reported no CPUID", v.vcpu);
        let leaf1 = v.cpuid.iter().find(|r| r.leaf == 1).expect("leaf 1");
        assert_eq!(
            leaf1.ebx >> 24,
            placed.apic_id & 0xff,
            "vCPU {}: leaf 1 initial APIC ID",
            v.vcpu
        );
        let d = decode_topology(&v.cpuid).expect("topology leaves");
        assert_eq!(d.apic_id, placed.apic_id, "vCPU {}: {d:?}", v.vcpu);
        assert_eq!(
            (d.package, d.core, d.thread),
            (placed.socket, placed.core, placed.thread),
            "vCPU {}: {d:?}",
            v.vcpu
        );
        assert_eq!(d.threads_per_core, t.threads, "vCPU {}: {d:?}", v.vcpu);
        assert_eq!(
            d.logical_per_package,
            t.cores * t.threads,
            "vCPU {}: {d:?}",
            v.vcpu
        );
        // The hint needs exclusive vCPU PUs: dedicated placement and an isolated emulator.
        assert_eq!(
            d.realtime_hint,
            plan.vcpu_pus_exclusive(),
            "vCPU {}: KVM_HINTS_REALTIME",
            v.vcpu
        );
        if !dedicated {
            assert!(!d.realtime_hint, "vCPU {}: hint on floating vCPUs", v.vcpu);
        }
    }
}

#[test]
fn one_socket_two_cores_dedicated() {
    if !kvm_available("one_socket_two_cores_dedicated") {
        return;
    }
    check_topology(
        "name = \"topo-a\"\n[cpu]\nsockets = 1\ncores = 2\nthreads = 1\ndedicated_cpu_placement = true\n\
         [memory]\nguest = \"16Mi\"\n[boot]\npayload = \"halt\"\n",
        true,
    );
}

#[test]
fn two_sockets_four_cores_two_threads_floating() {
    if !kvm_available("two_sockets_four_cores_two_threads_floating") {
        return;
    }
    check_topology(
        "name = \"topo-b\"\n[cpu]\nsockets = 2\ncores = 4\nthreads = 2\n[memory]\nguest = \"16Mi\"\n[boot]\npayload = \"halt\"\n",
        false,
    );
}
