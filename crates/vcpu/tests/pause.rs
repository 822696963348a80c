//! Pause and resume on real KVM: every vCPU parks outside `KVM_RUN`, the guest makes no
//! progress while paused, and after a resume it finishes as if nothing happened; a paused VM
//! can still be stopped.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::*;
use vm_memory::{Bytes, GuestAddress};
use vmhost_memory::GuestMemoryMmap;
use vmhost_memory::{GuestLayout, MMIO_HOLE_END, MMIO_HOLE_START};
use vmhost_vcpu::payload::touch;
use vmhost_vcpu::{
    thread_placements, ControlError, PayloadResult, RunStatus, VcpuOutcome, Vm, VmOptions, VmState,
};

#[test]
fn idle_vm_pauses_resumes_and_stops_while_paused() {
    if !kvm_available("idle_vm_pauses_resumes_and_stops_while_paused") {
        return;
    }
    let _cpus = lock_cpus();
    let plan = plan_toml(
        "name = \"pause-idle\"\n[cpu]\ncores = 2\n[memory]\nguest = \"16Mi\"\n[boot]\npayload = \"idle\"\n",
    );
    let mut vm = Vm::new(&plan, memory(&plan), VmOptions::default()).expect("VM");
    let handle = vm.handle();
    assert_eq!(handle.state(), VmState::Created);
    assert!(matches!(
        handle.pause(),
        Err(ControlError::State {
            state: VmState::Created,
            ..
        })
    ));
    let stop = vm.stop_handle();
    let runner = std::thread::spawn(move || vm.run());
    assert!(wait_for(60, || stop.ready_vcpus() == 2), "vCPUs ready");
    assert_eq!(handle.state(), VmState::Running);

    // vCPU threads by tid, as /proc names them.
    let threads = handle.vcpu_threads();
    assert_eq!(threads.iter().map(|t| t.0).collect::<Vec<_>>(), vec![0, 1]);
    let live = thread_placements().expect("/proc");
    for (vcpu, tid) in &threads {
        let t = live.iter().find(|t| t.tid == *tid).expect("tid alive");
        assert_eq!(t.vcpu_index(), Some(*vcpu), "{t:?}");
    }

    for round in 0..3 {
        let t = std::time::Instant::now();
        handle.pause().expect("pause");
        println!("round {round}: paused in {:?}", t.elapsed());
        assert_eq!(handle.state(), VmState::Paused);
        handle.pause().expect("pausing a paused VM is a no-op");
        handle.resume().expect("resume");
        assert_eq!(handle.state(), VmState::Running);
        assert!(matches!(
            handle.resume(),
            Err(ControlError::State {
                state: VmState::Running,
                ..
            })
        ));
    }
    handle.pause().expect("pause");
    handle.stop();
    let report = runner.join().expect("runner").expect("run");
    println!("{}", report.render_text());
    assert_eq!(handle.state(), VmState::Stopped);
    assert!(handle.vcpu_threads().is_empty());
    assert_eq!(report.status, RunStatus::Stopped);
    assert!(report
        .vcpus
        .iter()
        .all(|v| v.outcome == VcpuOutcome::Stopped));
    assert_eq!(report.exit_code(), 0, "stopping idle is its normal end");
}

/// Guest RAM that is not prefaulted, so that `touch` pays a first-touch exit per 4 KiB page and
/// runs long enough to be paused midway.
fn cold_memory(plan: &vmhost_plan::Plan) -> (GuestMemoryMmap, GuestLayout) {
    let layout = GuestLayout::from_plan(plan, MMIO_HOLE_START..MMIO_HOLE_END).expect("layout");
    (
        layout.anonymous_memory().expect("anonymous guest RAM"),
        layout,
    )
}

/// How far `touch`, which writes its range in order, has got: a binary search for the first
/// page whose first word is not yet the pattern (cheap enough to poll while the guest runs).
fn written_up_to(mem: &GuestMemoryMmap, gpa: u64, len: u64) -> u64 {
    let written = |page: u64| {
        mem.read_obj::<u64>(GuestAddress(page))
            .is_ok_and(|w| w == touch::pattern(page))
    };
    let (mut lo, mut hi) = (0, len / touch::TOUCH_PAGE);
    while lo < hi {
        let mid = (lo + hi) / 2;
        if written(gpa + mid * touch::TOUCH_PAGE) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    gpa + lo * touch::TOUCH_PAGE
}

#[test]
fn touch_paused_midway_makes_no_progress_and_completes_after_resume() {
    if !kvm_available("touch_paused_midway_makes_no_progress_and_completes_after_resume") {
        return;
    }
    let _cpus = lock_cpus();
    let plan = plan_toml(
        "name = \"pause-touch\"\n[cpu]\ncores = 1\n[memory]\nguest = \"768Mi\"\n[boot]\npayload = \"touch\"\n",
    );
    let (mem, layout) = cold_memory(&plan);
    let probe = mem.clone();
    let region = layout.regions[0];
    let progress = move || written_up_to(&probe, region.gpa, region.size_bytes);
    let mut vm = Vm::new(&plan, (mem, layout), VmOptions::default()).expect("VM");
    let handle = vm.handle();
    let runner = std::thread::spawn(move || {
        let report = vm.run();
        (report, vm)
    });
    let start = region.gpa;
    assert!(
        wait_for(30, || progress() > start + (16 << 20)),
        "the guest starts writing"
    );
    if let Err(e) = handle.pause() {
        let (report, _vm) = runner.join().expect("runner");
        panic!("pause mid-run: {e}: {}", report.expect("run").render_text());
    }
    let at_pause = progress();
    std::thread::sleep(Duration::from_millis(300));
    let later = progress();
    println!(
        "paused at {} of {} MiB",
        (at_pause - start) >> 20,
        region.size_bytes >> 20
    );
    assert_eq!(handle.state(), VmState::Paused);
    assert_eq!(at_pause, later, "no guest progress while paused");
    assert!(
        at_pause < start + region.size_bytes,
        "paused before the end (the run was too fast to test)"
    );
    handle.resume().expect("resume");
    let (report, vm) = runner.join().expect("runner");
    let report = report.expect("run");
    println!("{}", report.render_text());
    assert_eq!(report.status, RunStatus::Completed);
    let PayloadResult::Touch(t) = &report.vcpus[0].result else {
        panic!("{:?}", report.vcpus[0].result)
    };
    assert_eq!(t.bytes, region.size_bytes);
    let ram = vm.ram().guest_memory();
    for r in &vm.ram().guest_layout().regions {
        assert_eq!(touch::first_untouched(ram, r.gpa, r.size_bytes), None);
    }
    let pids: BTreeSet<i32> = handle.vcpu_threads().into_iter().map(|t| t.1).collect();
    assert!(pids.is_empty(), "vCPU threads are gone");
}
