//! Snapshot and restore of a running VM on real `/dev/kvm`: an `idle` VM is paused, captured
//! (each vCPU saving its own state on its parked thread) and stopped; a fresh VM built from the
//! same plan on a copy of its RAM restores the state and the guest continues: its timer ticks
//! go on from where they were and its boot stamp is unchanged (it did not start again). A
//! `touch` captured midway finishes every page after its restore. The idle guest verifies its
//! RAM pattern after the restore, and finds it wrong on zeroed RAM. A capture of a running VM
//! and a restore with another guest topology are refused.

mod common;

use common::*;
use vm_memory::GuestAddress;
use vm_memory::{ByteValued, Bytes, GuestMemoryBackend, GuestMemoryRegion};
use vmhost_memory::GuestMemoryMmap;
use vmhost_memory::{GuestLayout, GuestMemory, MMIO_HOLE_END, MMIO_HOLE_START};
use vmhost_plan::Plan;
use vmhost_vcpu::payload::mailbox::{status, Mailbox};
use vmhost_vcpu::payload::{ramcheck, touch};
use vmhost_vcpu::persist::{check_target, CompatError, SavedVm};
use vmhost_vcpu::{
    CaptureError, PayloadResult, RunReport, RunStatus, VcpuOutcome, Vm, VmError, VmHandle,
    VmOptions, VmState,
};

fn idle_plan(name: &str, cores: u32) -> Plan {
    plan_toml(&format!(
        "name = \"{name}\"\n[cpu]\ncores = {cores}\n[memory]\nguest = \"16Mi\"\n[boot]\npayload = \"idle\"\n"
    ))
}

fn mailboxes(handle: &VmHandle, n: usize) -> Vec<Mailbox> {
    (0..n)
        .map(|i| handle.payload_mailbox(i).expect("a payload's mailbox"))
        .collect()
}

fn ticks(handle: &VmHandle, n: usize) -> Vec<u64> {
    mailboxes(handle, n).iter().map(|m| m.ticks).collect()
}

/// True when every vCPU has verified a full pass of its RAM pattern since `from` (the
/// mailboxes at some earlier point).
fn checked_a_pass(handle: &VmHandle, from: &[Mailbox]) -> bool {
    mailboxes(handle, from.len())
        .iter()
        .zip(from)
        .all(|(m, f)| m.ram_checked >= f.ram_checked + ramcheck::PAGES)
}

/// The mailbox at the start of a saved vCPU block.
fn saved_mailbox(block: &[u8]) -> Mailbox {
    let mut m = Mailbox::new(0, 0);
    let n = std::mem::size_of::<Mailbox>();
    m.as_mut_slice().copy_from_slice(&block[..n]);
    m
}

/// Fresh guest memory for `plan` holding a copy of `from`, region by region.
fn copy_ram(plan: &Plan, from: &GuestMemoryMmap) -> GuestMemory {
    let to = memory(plan);
    for region in from.iter() {
        let len = usize::try_from(region.len()).expect("region size");
        let mut bytes = vec![0u8; len];
        from.read_slice(&mut bytes, region.start_addr())
            .expect("read source RAM");
        to.memory()
            .write_slice(&bytes, region.start_addr())
            .expect("write target RAM");
    }
    to
}

fn stopped_cleanly(report: &RunReport) {
    println!("{}", report.render_text());
    assert_eq!(report.status, RunStatus::Stopped);
    assert!(report
        .vcpus
        .iter()
        .all(|v| v.outcome == VcpuOutcome::Stopped));
}

/// Runs an idle VM until every vCPU has ticked, pauses it and captures it; returns the state,
/// the ticks at capture and a copy of its RAM, with the source stopped.
fn capture_idle(plan: &Plan) -> (SavedVm, Vec<Mailbox>, GuestMemory) {
    let n = plan.vcpus.len();
    let mem = memory(plan);
    let source_ram = mem.memory().clone();
    let mut vm = Vm::new(plan, mem, VmOptions::default()).expect("VM");
    let handle = vm.handle();
    let stop = vm.stop_handle();
    let runner = std::thread::spawn(move || vm.run());
    assert!(wait_for(60, || stop.ready_vcpus() == n), "vCPUs ready");
    assert!(
        wait_for(30, || ticks(&handle, n).iter().all(|&t| t >= 3)),
        "the idle payload ticks: {:?}",
        ticks(&handle, n)
    );
    let start = vec![Mailbox::new(0, 0); n];
    assert!(wait_for(30, || checked_a_pass(&handle, &start)), "a pass");
    for (i, m) in mailboxes(&handle, n).iter().enumerate() {
        assert!(m.ram_stride != 0, "vCPU {i} has RAM pattern pages");
        assert_eq!(m.ram_errors, 0, "vCPU {i}: its own RAM pattern");
    }
    let err = handle.capture().expect_err("capture of a running VM");
    assert!(
        matches!(
            err,
            CaptureError::NotPaused {
                state: VmState::Running
            }
        ),
        "{err}"
    );
    println!("refused as expected: {err}");
    handle.pause().expect("pause");
    let at_pause = mailboxes(&handle, n);
    let saved = handle.capture().expect("capture");
    assert_eq!(
        handle.state(),
        VmState::Paused,
        "a capture leaves it paused"
    );
    let copy = copy_ram(plan, &source_ram);
    handle.stop();
    stopped_cleanly(&runner.join().expect("runner").expect("run"));
    (saved, at_pause, copy)
}

#[test]
fn an_idle_vm_restored_into_fresh_memory_continues_without_starting_again() {
    if !kvm_available("an_idle_vm_restored_into_fresh_memory_continues_without_starting_again") {
        return;
    }
    let _cpus = lock_cpus();
    let plan = idle_plan("snap-idle", 2);
    let (saved, at_pause, copy) = capture_idle(&plan);
    assert_eq!(saved.vcpus.len(), 2);
    assert!(saved.devices.is_none());
    let payload = saved.payload.as_ref().expect("a payload's boot area");
    for (i, block) in payload.vcpu_blocks.iter().enumerate() {
        let m = saved_mailbox(block);
        assert_eq!(m.ticks, at_pause[i].ticks, "vCPU {i}: saved while paused");
        assert!(m.tsc_start != 0, "vCPU {i}: the boot stamp was written");
    }

    let json = serde_json::to_string(&saved).expect("serialize");
    println!("SavedVm: {} bytes of JSON", json.len());
    let saved: SavedVm = serde_json::from_str(&json).expect("deserialize");
    check_target(&saved).expect("this host runs its own state");

    let mut vm = Vm::restore(&plan, copy, VmOptions::default(), saved).expect("restore");
    let handle = vm.handle();
    let stop = vm.stop_handle();
    let restored = mailboxes(&handle, 2);
    for (i, (r, p)) in restored.iter().zip(&at_pause).enumerate() {
        assert_eq!(
            r.ticks, p.ticks,
            "vCPU {i}: mailbox restored before the run"
        );
    }
    let runner = std::thread::spawn(move || vm.run());
    let went_on = |t: &[u64]| t.iter().zip(&at_pause).all(|(t, p)| *t >= p.ticks + 5);
    assert!(
        wait_for(30, || went_on(&ticks(&handle, 2))),
        "the restored guest ticks on past {:?}: {:?}",
        at_pause.iter().map(|m| m.ticks).collect::<Vec<_>>(),
        ticks(&handle, 2)
    );
    assert!(
        wait_for(30, || checked_a_pass(&handle, &at_pause)),
        "a full pass of the RAM pattern after the restore"
    );
    let now = mailboxes(&handle, 2);
    for (i, (m, p)) in now.iter().zip(&at_pause).enumerate() {
        println!(
            "vCPU {i}: ticks {} at capture, {} now; RAM pages checked {}, wrong {}",
            p.ticks, m.ticks, m.ram_checked, m.ram_errors
        );
        assert_eq!(m.tsc_start, p.tsc_start, "vCPU {i} started again");
        assert_eq!(
            m.ram_errors, 0,
            "vCPU {i}: its RAM pattern came with the copy"
        );
    }
    assert_eq!(
        stop.ready_vcpus(),
        0,
        "no vCPU rang Ready again: the payload did not start over"
    );

    // The restored VM is captured in turn: its vCPUs save their restored state.
    handle.pause().expect("pause the restored VM");
    let again = handle.capture().expect("capture the restored VM");
    let blocks = &again.payload.as_ref().expect("payload").vcpu_blocks;
    for (i, block) in blocks.iter().enumerate() {
        assert!(saved_mailbox(block).ticks >= now[i].ticks);
    }
    handle.resume().expect("resume");
    handle.stop();
    stopped_cleanly(&runner.join().expect("runner").expect("run"));
}

/// A guest whose TSC ran at a rate 100 ppm from this host's (another host's calibration)
/// is restored at its own rate: KVM scales it where it can and otherwise takes it within its
/// tolerance, and reports it back (`KVM_GET_TSC_KHZ` of the restored vCPUs); the guest runs.
#[test]
fn a_guest_from_a_tsc_rate_within_kvms_tolerance_runs_at_its_rate() {
    if !kvm_available("a_guest_from_a_tsc_rate_within_kvms_tolerance_runs_at_its_rate") {
        return;
    }
    let _cpus = lock_cpus();
    let plan = idle_plan("snap-tsc", 2);
    let (mut saved, at_pause, copy) = capture_idle(&plan);
    let host_khz = saved.vcpus[0].tsc_khz;
    let guest_khz = host_khz + host_khz / 10_000;
    assert_ne!(guest_khz, host_khz);
    for v in &mut saved.vcpus {
        v.tsc_khz = guest_khz;
    }
    check_target(&saved).expect("100 ppm is within KVM's tolerance");
    let mut vm = Vm::restore(&plan, copy, VmOptions::default(), saved).expect("restore");
    let handle = vm.handle();
    let runner = std::thread::spawn(move || vm.run());
    let went_on = |t: &[u64]| t.iter().zip(&at_pause).all(|(t, p)| *t >= p.ticks + 5);
    assert!(
        wait_for(30, || went_on(&ticks(&handle, 2))),
        "the restored guest ticks on: {:?}",
        ticks(&handle, 2)
    );
    println!(
        "host {host_khz} kHz, guest {guest_khz} kHz, restored vCPUs run {} kHz",
        handle.tsc_khz()
    );
    assert_eq!(
        handle.tsc_khz(),
        guest_khz,
        "KVM_GET_TSC_KHZ of the restored vCPUs"
    );
    handle.pause().expect("pause");
    let again = handle.capture().expect("capture the restored VM");
    for v in &again.vcpus {
        assert_eq!(
            v.tsc_khz, guest_khz,
            "a capture saves the guest's rate again"
        );
    }
    handle.resume().expect("resume");
    handle.stop();
    stopped_cleanly(&runner.join().expect("runner").expect("run"));
}

/// The negative control of the RAM pattern: restored on zeroed RAM instead of a copy, the
/// guest finds its pattern pages wrong.
#[test]
fn an_idle_vm_restored_without_its_ram_reports_ram_errors() {
    if !kvm_available("an_idle_vm_restored_without_its_ram_reports_ram_errors") {
        return;
    }
    let _cpus = lock_cpus();
    let plan = idle_plan("snap-idle-zero", 1);
    let (saved, at_pause, _copy) = capture_idle(&plan);
    let mut vm = Vm::restore(&plan, memory(&plan), VmOptions::default(), saved).expect("restore");
    let handle = vm.handle();
    let runner = std::thread::spawn(move || vm.run());
    assert!(
        wait_for(30, || mailboxes(&handle, 1)[0].ram_errors > 0),
        "zeroed RAM goes unnoticed: {:?}",
        mailboxes(&handle, 1)[0]
    );
    let m = mailboxes(&handle, 1)[0];
    println!(
        "on zeroed RAM: {} of {} pages checked since the capture wrong",
        m.ram_errors,
        m.ram_checked - at_pause[0].ram_checked
    );
    assert_eq!(at_pause[0].ram_errors, 0);
    handle.stop();
    stopped_cleanly(&runner.join().expect("runner").expect("run"));
}

#[test]
fn a_restore_with_another_guest_topology_or_payload_or_tsc_rate_is_refused() {
    if !kvm_available("a_restore_with_another_guest_topology_or_payload_or_tsc_rate_is_refused") {
        return;
    }
    let _cpus = lock_cpus();
    let plan = idle_plan("snap-topology", 2);
    let (saved, _, _) = capture_idle(&plan);

    let one = idle_plan("snap-topology", 1);
    let err = Vm::restore(&one, memory(&one), VmOptions::default(), saved.clone())
        .expect_err("2 saved vCPUs into a 1-vCPU plan");
    println!("refused as expected: {err}");
    assert!(
        matches!(&err, VmError::RestoreMismatch { what, saved, planned, .. }
            if what == "vCPUs" && saved == "2" && planned == "1"),
        "{err}"
    );
    assert!(err.to_string().contains("2") && err.to_string().contains("1"));

    let halt = plan_toml(
        "name = \"snap-topology\"\n[cpu]\ncores = 2\n[memory]\nguest = \"16Mi\"\n[boot]\npayload = \"halt\"\n",
    );
    let err = Vm::restore(&halt, memory(&halt), VmOptions::default(), saved.clone())
        .expect_err("an idle guest restored as halt");
    println!("refused as expected: {err}");
    assert!(
        matches!(&err, VmError::RestoreMismatch { what, saved, planned, .. }
            if what == "guest" && saved.contains("Idle") && planned.contains("Halt")),
        "{err}"
    );

    let mut faster = saved.clone();
    faster.vcpus[1].tsc_khz += 100_000;
    match check_target(&faster) {
        Ok(()) => println!("KVM scales the TSC here: a 100 MHz faster guest is taken"),
        Err(err) => {
            println!("refused as expected: {err}");
            assert!(
                matches!(err, CompatError::TscKhz { saved_khz, target_khz, .. }
                    if saved_khz == target_khz + 100_000),
                "{err}"
            );
        }
    }

    let mut swapped = saved;
    swapped.vcpus.swap(0, 1);
    let err = Vm::restore(&plan, memory(&plan), VmOptions::default(), swapped)
        .expect_err("vCPU 0 with vCPU 1's APIC ID");
    println!("refused as expected: {err}");
    assert!(
        matches!(&err, VmError::RestoreMismatch { what, .. } if what == "vCPU 0 APIC ID"),
        "{err}"
    );
}

/// Guest RAM that is not prefaulted, so that `touch` pays a first-touch exit per 4 KiB page
/// and runs long enough to be captured midway.
fn cold_memory(plan: &Plan) -> (GuestMemoryMmap, GuestLayout) {
    let layout = GuestLayout::from_plan(plan, MMIO_HOLE_START..MMIO_HOLE_END).expect("layout");
    (
        layout.anonymous_memory().expect("anonymous guest RAM"),
        layout,
    )
}

/// Copies `from` into `to` in 2 MiB chunks, leaving out chunks that are all zeros (as a
/// snapshot's memory files do): the copy's untouched pages stay untouched.
fn copy_nonzero(from: &GuestMemoryMmap, to: &GuestMemoryMmap) -> u64 {
    const CHUNK: usize = 2 << 20;
    let mut copied = 0;
    let mut buf = vec![0u8; CHUNK];
    for region in from.iter() {
        let len = region.len();
        let mut at = 0;
        while at < len {
            let n = usize::try_from((len - at).min(CHUNK as u64)).expect("chunk");
            let gpa = GuestAddress(region.start_addr().0 + at);
            from.read_slice(&mut buf[..n], gpa).expect("read");
            if buf[..n].iter().any(|&b| b != 0) {
                to.write_slice(&buf[..n], gpa).expect("write");
                copied += n as u64;
            }
            at += n as u64;
        }
    }
    copied
}

/// How far `touch`, which writes its range in order, has got (a binary search for the first
/// page whose first word is not yet the pattern).
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
fn touch_captured_midway_finishes_every_page_after_its_restore() {
    if !kvm_available("touch_captured_midway_finishes_every_page_after_its_restore") {
        return;
    }
    let _cpus = lock_cpus();
    let plan = plan_toml(
        "name = \"snap-touch\"\n[cpu]\ncores = 1\n[memory]\nguest = \"768Mi\"\n[boot]\npayload = \"touch\"\n",
    );
    let (mem, layout) = cold_memory(&plan);
    let probe = mem.clone();
    let region = layout.regions[0];
    let progress = move || written_up_to(&probe, region.gpa, region.size_bytes);
    let mut vm = Vm::new(&plan, (mem.clone(), layout.clone()), VmOptions::default()).expect("VM");
    let handle = vm.handle();
    let runner = std::thread::spawn(move || vm.run());
    let start = region.gpa;
    assert!(
        wait_for(30, || progress() > start + (16 << 20)),
        "the guest starts writing"
    );
    handle.pause().expect("pause mid-run");
    let saved = handle.capture().expect("capture mid-run");
    let at = progress();
    println!(
        "captured at {} of {} MiB",
        (at - start) >> 20,
        region.size_bytes >> 20
    );
    assert!(
        at < start + region.size_bytes,
        "captured before the end (the run was too fast to test)"
    );
    let block = &saved.payload.as_ref().expect("payload").vcpu_blocks[0];
    assert_eq!(
        saved_mailbox(block).status,
        status::RING3,
        "in ring 3, mid-work"
    );
    let (copy, _) = cold_memory(&plan);
    let copied = copy_nonzero(&mem, &copy);
    println!("copied {} MiB of non-zero RAM", copied >> 20);
    handle.stop();
    stopped_cleanly(&runner.join().expect("runner").expect("run"));
    assert!(at < start + region.size_bytes, "the source stopped midway");

    let saved: SavedVm =
        serde_json::from_str(&serde_json::to_string(&saved).expect("serialize")).expect("parse");
    let mut vm = Vm::restore(&plan, (copy, layout), VmOptions::default(), saved).expect("restore");
    let report = vm.run().expect("run the restored VM");
    println!("{}", report.render_text());
    assert_eq!(report.status, RunStatus::Completed);
    let PayloadResult::Touch(t) = &report.vcpus[0].result else {
        panic!("{:?}", report.vcpus[0].result)
    };
    assert_eq!(
        t.bytes, region.size_bytes,
        "the restored guest counted every page"
    );
    let ram = vm.ram().guest_memory();
    for r in &vm.ram().guest_layout().regions {
        assert_eq!(touch::first_untouched(ram, r.gpa, r.size_bytes), None);
    }
}
