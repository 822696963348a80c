//! SIGTERM, delivered to the `vmhost-sig` thread that [`stop_on_signals`] starts, stops a
//! running VM in order: every vCPU kicked out of `KVM_RUN`, every thread joined.
//!
//! Its own test binary: it blocks SIGINT/SIGTERM in the calling thread, which only threads
//! started afterwards inherit.

mod common;

use common::*;
use vmhost_vcpu::{stop_on_signals, thread_placements, RunStatus, VcpuOutcome, Vm, VmOptions};

#[test]
fn sigterm_stops_an_idle_vm() {
    if !kvm_available("sigterm_stops_an_idle_vm") {
        return;
    }
    let _cpus = lock_cpus();
    let plan = plan_toml("name = \"sig\"\n[cpu]\ncores = 2\n[memory]\nguest = \"16Mi\"\n[boot]\npayload = \"idle\"\n");
    let mut vm = Vm::new(&plan, memory(&plan), VmOptions::default()).expect("VM");
    let stop = vm.stop_handle();
    stop_on_signals(stop.clone()).expect("signal thread");
    let runner = std::thread::spawn(move || vm.run());
    assert!(
        wait_for(60, || stop.ready_vcpus() == 2),
        "vCPUs did not become ready"
    );
    let sig = thread_placements()
        .unwrap()
        .into_iter()
        .find(|t| t.name == "vmhost-sig")
        .expect("vmhost-sig thread");
    // SAFETY: tgkill only sends a signal; the target is a thread of this process that blocks
    // SIGTERM and waits for it with sigwait.
    let rc = unsafe { libc::syscall(libc::SYS_tgkill, libc::getpid(), sig.tid, libc::SIGTERM) };
    assert_eq!(rc, 0, "tgkill: {}", std::io::Error::last_os_error());
    let report = runner.join().expect("runner").expect("run");
    assert!(stop.stop_requested());
    assert_eq!(report.status, RunStatus::Stopped);
    assert!(report
        .vcpus
        .iter()
        .all(|v| v.outcome == VcpuOutcome::Stopped));
    assert!(
        thread_placements()
            .unwrap()
            .iter()
            .all(|t| t.vcpu_index().is_none() && t.name != "vmhost-emu"),
        "every vCPU and emulator thread is joined"
    );
}
