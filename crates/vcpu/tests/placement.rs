//! Thread placement on real KVM: vCPU threads pinned to their planned PUs before they run, the
//! emulator thread kept off vCPU PUs when isolated, all read back from `/proc`.

mod common;

use std::collections::BTreeSet;

use common::*;
use vmhost_vcpu::{
    current_tid, pin_current_thread_to_emulator, thread_placements, RunStatus, ThreadPlacement,
    VcpuOutcome, Vm, VmOptions,
};

/// Runs an `idle` VM, calls `check` with the live placement once every vCPU is ready, stops it.
fn with_idle_vm(
    toml: &str,
    check: impl FnOnce(&vmhost_plan::Plan, &[ThreadPlacement]),
) -> vmhost_vcpu::RunReport {
    let plan = plan_toml(toml);
    let mut vm = Vm::new(&plan, memory(&plan), VmOptions::default()).expect("VM");
    let stop = vm.stop_handle();
    let n = plan.vcpus.len();
    let runner = std::thread::spawn(move || vm.run());
    assert!(
        wait_for(60, || stop.ready_vcpus() == n),
        "only {} of {n} vCPUs became ready",
        stop.ready_vcpus()
    );
    let live = thread_placements().expect("read /proc/self/task");
    check(&plan, &live);
    stop.stop();
    let report = runner.join().expect("runner thread").expect("run");
    assert_eq!(
        report.status,
        RunStatus::Stopped,
        "{}",
        report.render_text()
    );
    assert!(report
        .vcpus
        .iter()
        .all(|v| v.outcome == VcpuOutcome::Stopped));
    assert_eq!(report.exit_code(), 0, "stopping idle is its normal end");
    report
}

fn vcpu_threads(threads: &[ThreadPlacement]) -> Vec<&ThreadPlacement> {
    threads
        .iter()
        .filter(|t| t.vcpu_index().is_some())
        .collect()
}

#[test]
fn two_vcpus_are_pinned_to_their_planned_pus() {
    if !kvm_available("two_vcpus_are_pinned_to_their_planned_pus") {
        return;
    }
    let _cpus = lock_cpus();
    let toml = "name = \"pin2\"\n[cpu]\ncores = 2\ndedicated_cpu_placement = true\n[memory]\nguest = \"16Mi\"\n[boot]\npayload = \"idle\"\n";
    let report = with_idle_vm(toml, |plan, live| {
        let vcpus = vcpu_threads(live);
        assert_eq!(vcpus.len(), 2, "{live:?}");
        let mut pus = BTreeSet::new();
        for t in vcpus {
            let planned = plan.vcpus[t.vcpu_index().unwrap() as usize]
                .host_cpu
                .expect("dedicated");
            assert_eq!(t.cpus_allowed, vec![planned], "{t:?}");
            pus.insert(planned);
        }
        assert_eq!(pus.len(), 2, "two distinct PUs");
        let emu = live
            .iter()
            .find(|t| t.name == "vmhost-emu")
            .expect("emulator thread");
        assert_eq!(emu.cpus_allowed, plan.emulator.host_cpus);
    });
    // The snapshot taken at the start gate says the same.
    for t in vcpu_threads(&report.placements) {
        let v = &report.vcpus[t.vcpu_index().unwrap() as usize];
        assert_eq!(t.cpus_allowed, vec![v.host_cpu.unwrap()]);
    }
    println!("{}", report.render_text());
}

#[test]
fn isolated_emulator_never_runs_on_a_vcpu_pu() {
    if !kvm_available("isolated_emulator_never_runs_on_a_vcpu_pu") {
        return;
    }
    let _cpus = lock_cpus();
    let toml = "name = \"iso\"\n[cpu]\ncores = 1\ndedicated_cpu_placement = true\nisolate_emulator_thread = true\n\
                [memory]\nguest = \"16Mi\"\n[boot]\npayload = \"idle\"\n";
    // This test thread plays the binary's main thread: pinned to the emulator PU first.
    let plan = plan_toml(toml);
    pin_current_thread_to_emulator(&plan).expect("pin the calling thread");
    let me = current_tid();
    let report = with_idle_vm(toml, |plan, live| {
        let vcpu_pus: BTreeSet<u32> = plan.vcpus.iter().filter_map(|v| v.host_cpu).collect();
        assert!(plan.emulator.isolated);
        assert!(
            plan.emulator
                .host_cpus
                .iter()
                .all(|c| !vcpu_pus.contains(c)),
            "{:?}",
            plan.emulator
        );
        for t in live {
            let vmhost_thread = t.name == "vmhost-emu" || t.tid == me;
            if let Some(i) = t.vcpu_index() {
                assert_eq!(
                    t.cpus_allowed,
                    vec![plan.vcpus[i as usize].host_cpu.unwrap()],
                    "{t:?}"
                );
            } else if vmhost_thread {
                assert!(
                    t.cpus_allowed.iter().all(|c| !vcpu_pus.contains(c)),
                    "{t:?} may run on a vCPU PU {vcpu_pus:?}"
                );
                assert!(
                    !vcpu_pus.contains(&t.last_cpu),
                    "{t:?} last ran on a vCPU PU"
                );
            }
        }
        assert!(live.iter().any(|t| t.name == "vmhost-emu"));
    });
    println!("{}", report.render_text());
}

#[test]
fn floating_vcpus_get_the_allowed_cpu_set() {
    if !kvm_available("floating_vcpus_get_the_allowed_cpu_set") {
        return;
    }
    let _cpus = lock_cpus();
    let toml = "name = \"float\"\n[cpu]\ncores = 2\n[memory]\nguest = \"16Mi\"\n[boot]\npayload = \"idle\"\n";
    with_idle_vm(toml, |plan, live| {
        assert!(!plan.floating_cpus.is_empty());
        for t in vcpu_threads(live) {
            assert_eq!(t.cpus_allowed, plan.floating_cpus, "{t:?}");
        }
    });
}
