//! The built-in payloads on real KVM: touch over hugepage-backed memory (checked page by page
//! from the host), numa-bench, halt's start-up, and the lifecycle edges.

mod common;

use common::*;
use vmhost_vcpu::payload::touch;
use vmhost_vcpu::{
    AfterStart, PayloadResult, RunStatus, VcpuOutcome, Vm, VmError, VmHandle, VmOptions, VmState,
};

#[test]
fn touch_writes_every_page_of_each_cell_on_hugepages() {
    let test = "touch_writes_every_page_of_each_cell_on_hugepages";
    if !kvm_available(test) || !hugepages_wanted(test) {
        return;
    }
    let _cpus = lock_cpus();
    let _pool = lock_hugepages();
    require_2m_hugepages(test, 32);
    let free_before = free_2m_hugepages();
    let plan = plan_toml(
        "name = \"touch\"\n[cpu]\ncores = 2\n[memory]\nguest = \"64Mi\"\nhugepages = { page_size = \"2Mi\" }\n\
         [boot]\npayload = \"touch\"\n",
    );
    let mut vm = Vm::new(&plan, memory(&plan), VmOptions::default()).expect("VM");
    assert!(
        free_2m_hugepages() <= free_before - 32,
        "guest RAM is on 2 MiB hugepages"
    );
    let report = vm.run().expect("run");
    println!("{}", report.render_text());
    assert_eq!(report.status, RunStatus::Completed);
    let layout = vm.ram().guest_layout().clone();
    for v in &report.vcpus {
        let PayloadResult::Touch(t) = &v.result else {
            panic!("vCPU {}: {:?}", v.vcpu, v.result)
        };
        let cell_bytes: u64 = layout
            .cell_regions(v.guest_cell)
            .map(|r| r.size_bytes)
            .sum();
        assert_eq!(t.bytes, cell_bytes, "vCPU {} wrote its whole cell", v.vcpu);
        assert!(t.seconds > 0.0);
    }
    for r in &layout.regions {
        assert_eq!(
            touch::first_untouched(vm.ram().guest_memory(), r.gpa, r.size_bytes),
            None,
            "cell {} region {:#x}",
            r.cell,
            r.gpa
        );
    }
    drop(vm);
    assert_eq!(
        free_2m_hugepages(),
        free_before,
        "every hugepage returned to the pool"
    );
}

#[test]
fn numa_bench_measures_every_cell_from_every_vcpu() {
    if !kvm_available("numa_bench_measures_every_cell_from_every_vcpu") {
        return;
    }
    let _cpus = lock_cpus();
    let plan = plan_toml("name = \"bench\"\n[cpu]\ncores = 2\n[memory]\nguest = \"64Mi\"\n[boot]\npayload = \"numa-bench\"\n");
    let options = VmOptions {
        bench: vmhost_vcpu::BenchOptions {
            working_set_bytes: Some(48 << 20),
            chase_loads: None,
            stream_passes: Some(2),
        },
        ..Default::default()
    };
    let mut vm = Vm::new(&plan, memory(&plan), options).expect("VM");
    let report = vm.run().expect("run");
    println!("{}", report.render_text());
    assert_eq!(report.status, RunStatus::Completed);
    for v in &report.vcpus {
        let PayloadResult::NumaBench(cells) = &v.result else {
            panic!("vCPU {}: {:?}", v.vcpu, v.result)
        };
        assert_eq!(cells.len(), plan.guest_cells.len());
        for c in cells {
            assert_eq!(c.working_set_bytes, 48 << 20);
            assert_eq!(c.chase_loads, (48 << 20) / 64);
            assert!(c.chase_ns > 0.0 && c.stream_gb_per_s > 0.0, "{c:?}");
        }
    }
}

#[test]
fn halt_starts_reports_and_halts() {
    if !kvm_available("halt_starts_reports_and_halts") {
        return;
    }
    let _cpus = lock_cpus();
    let plan = plan_toml("name = \"halt\"\n[cpu]\ncores = 1\n[memory]\nguest = \"16Mi\"\n[boot]\npayload = \"halt\"\n");
    let t0 = std::time::Instant::now();
    let mut vm = Vm::new(&plan, memory(&plan), VmOptions::default()).expect("VM");
    let report = vm.run().expect("run");
    drop(vm);
    let total = t0.elapsed();
    println!(
        "{}\nhalt: Vm::new + run + drop = {:.3} ms",
        report.render_text(),
        total.as_secs_f64() * 1e3
    );
    assert_eq!(report.vcpus[0].outcome, VcpuOutcome::Halted);
    assert!(
        report.vcpus[0].first_doorbell_seconds.is_some(),
        "the guest reported before halting"
    );
    assert_eq!(report.exit_code(), 0);
}

#[test]
fn a_vm_runs_once() {
    if !kvm_available("a_vm_runs_once") {
        return;
    }
    let _cpus = lock_cpus();
    let plan = plan_toml("name = \"once\"\n[cpu]\ncores = 1\n[memory]\nguest = \"16Mi\"\n[boot]\npayload = \"halt\"\n");
    let mut vm = Vm::new(&plan, memory(&plan), VmOptions::default()).expect("VM");
    vm.run().expect("first run");
    assert!(matches!(vm.run(), Err(VmError::AlreadyRun)));
    assert_eq!(vm.handle().state(), vmhost_vcpu::VmState::Stopped);
}

#[test]
fn stop_before_the_guest_runs_ends_every_vcpu() {
    if !kvm_available("stop_before_the_guest_runs_ends_every_vcpu") {
        return;
    }
    let _cpus = lock_cpus();
    let plan = plan_toml("name = \"early\"\n[cpu]\ncores = 2\n[memory]\nguest = \"16Mi\"\n[boot]\npayload = \"touch\"\n");
    let mut vm = Vm::new(&plan, memory(&plan), VmOptions::default()).expect("VM");
    vm.stop_handle().stop();
    let report = vm.run().expect("run");
    assert_eq!(report.status, RunStatus::Stopped);
    assert!(report
        .vcpus
        .iter()
        .all(|v| v.outcome == VcpuOutcome::Stopped && v.exits == 0));
    assert_eq!(report.exit_code(), 130);
}

/// A handle made before the VM (a migration target serves its control API while guest memory
/// arrives): the VM answers through it once built; before that it is `Created`, a pause is
/// refused, and a stop is kept: the VM ends before any vCPU runs guest code. A handle for
/// another vCPU count is refused.
#[test]
fn a_handle_made_before_the_vm_controls_it() {
    if !kvm_available("a_handle_made_before_the_vm_controls_it") {
        return;
    }
    let _cpus = lock_cpus();
    let plan = plan_toml("name = \"early-handle\"\n[cpu]\ncores = 2\n[memory]\nguest = \"16Mi\"\n[boot]\npayload = \"touch\"\n");
    let wrong = VmOptions {
        handle: Some(VmHandle::unbuilt(3)),
        ..Default::default()
    };
    assert!(matches!(
        Vm::new(&plan, memory(&plan), wrong),
        Err(VmError::HandleMismatch {
            handle: 3,
            plan: 2,
            ..
        })
    ));
    let handle = VmHandle::unbuilt(2);
    assert_eq!(handle.state(), VmState::Created);
    assert!(handle.pause().is_err(), "nothing runs yet to pause");
    handle.stop();
    let options = VmOptions {
        handle: Some(handle.clone()),
        ..Default::default()
    };
    let mut vm = Vm::new(&plan, memory(&plan), options).expect("VM");
    assert_eq!(vm.handle().state(), VmState::Stopped, "the same control");
    let report = vm.run().expect("run");
    assert_eq!(report.status, RunStatus::Stopped);
    assert!(report
        .vcpus
        .iter()
        .all(|v| v.outcome == VcpuOutcome::Stopped && v.exits == 0));

    // Not stopped before: the VM runs to its end and the early handle sees it.
    let handle = VmHandle::unbuilt(2);
    let options = VmOptions {
        handle: Some(handle.clone()),
        ..Default::default()
    };
    let mut vm = Vm::new(&plan, memory(&plan), options).expect("VM");
    let report = vm.run().expect("run");
    assert_eq!(report.status, RunStatus::Completed);
    assert_eq!(handle.state(), VmState::Stopped);
}

/// [`AfterStart`] runs once, on the thread that called `Vm::run`, after the start gate opened
/// (the VM is no longer `Created`), with `started` true.
#[test]
fn after_start_runs_on_the_calling_thread_once_the_guest_runs() {
    if !kvm_available("after_start_runs_on_the_calling_thread_once_the_guest_runs") {
        return;
    }
    let _cpus = lock_cpus();
    let plan = plan_toml("name = \"after\"\n[cpu]\ncores = 1\n[memory]\nguest = \"16Mi\"\n[boot]\npayload = \"halt\"\n");
    let handle = VmHandle::unbuilt(1);
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let after = AfterStart::default();
    let (h, s) = (handle.clone(), std::sync::Arc::clone(&seen));
    after.set(Box::new(move |started| {
        s.lock()
            .unwrap()
            .push((started, std::thread::current().id(), h.state()));
    }));
    let options = VmOptions {
        handle: Some(handle),
        after_start: Some(after),
        ..Default::default()
    };
    let mut vm = Vm::new(&plan, memory(&plan), options).expect("VM");
    let report = vm.run().expect("run");
    assert_eq!(report.vcpus[0].outcome, VcpuOutcome::Halted);
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 1, "once: {seen:?}");
    let (started, thread, state) = seen[0];
    assert!(started);
    assert_eq!(thread, std::thread::current().id(), "on the calling thread");
    assert_ne!(state, VmState::Created, "after the gate opened");
}
