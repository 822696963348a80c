//! A paused guest is told it was paused, on real `/dev/kvm`: a tiny PVH "kernel" enables
//! kvmclock (`MSR_KVM_SYSTEM_TIME_NEW`) with its time page in guest RAM and counts; after a
//! pause and a resume, KVM's own write of that page carries `PVCLOCK_GUEST_STOPPED`, the flag
//! Linux's soft-lockup and RCU-stall detectors check before they report a CPU stuck. Before the
//! pause KVM had written the page without it.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::{Arc, Mutex};

use common::pvh::pvh_elf;
use common::*;
use vm_memory::{Bytes, GuestAddress};
use vmhost_memory::{GuestLayout, GuestMemoryMmap, MMIO_HOLE_END, MMIO_HOLE_START};
use vmhost_vcpu::{ConsoleInput, RunStatus, SerialOut, Vm, VmOptions};

/// Where the guest counts (32 MiB, above the kernel at 16 MiB).
const COUNTER: u32 = 0x200_0000;
/// The guest's kvmclock page (`struct pvclock_vcpu_time_info`, 32 bytes).
const PVCLOCK: u32 = 0x210_0000;
/// `MSR_KVM_SYSTEM_TIME_NEW`.
const MSR_KVM_SYSTEM_TIME_NEW: u32 = 0x4b56_4d01;
/// `pvclock_vcpu_time_info.flags`: after `version` (4), `pad0` (4), `tsc_timestamp` (8),
/// `system_time` (8), `tsc_to_system_mul` (4) and `tsc_shift` (1).
const FLAGS_AT: u32 = 29;
/// `PVCLOCK_GUEST_STOPPED`.
const GUEST_STOPPED: u8 = 1 << 1;

/// `wrmsr(MSR_KVM_SYSTEM_TIME_NEW, PVCLOCK | enable)`, then `inc dword [COUNTER]; jmp back`
/// (32-bit protected mode, PVH entry).
fn program() -> Vec<u8> {
    let mut code = vec![0xb9];
    code.extend(MSR_KVM_SYSTEM_TIME_NEW.to_le_bytes()); // mov ecx, msr
    code.push(0xb8);
    code.extend((PVCLOCK | 1).to_le_bytes()); // mov eax, page | enable
    code.extend([0x31, 0xd2, 0x0f, 0x30]); // xor edx, edx; wrmsr
    code.extend([0xff, 0x05]);
    code.extend(COUNTER.to_le_bytes()); // inc dword [COUNTER]
    code.extend([0xeb, 0xf8]); // jmp back to the inc
    code
}

fn read_u32(mem: &GuestMemoryMmap, gpa: u32) -> u32 {
    mem.read_obj(GuestAddress(u64::from(gpa))).unwrap()
}

fn flags(mem: &GuestMemoryMmap) -> u8 {
    mem.read_obj(GuestAddress(u64::from(PVCLOCK + FLAGS_AT)))
        .unwrap()
}

#[test]
fn a_guest_resumed_after_a_pause_finds_guest_stopped_in_its_kvmclock_page() {
    let test = "a_guest_resumed_after_a_pause_finds_guest_stopped_in_its_kvmclock_page";
    if !kvm_available(test) {
        return;
    }
    let _cpus = lock_cpus();
    let dir = std::env::temp_dir().join(format!("vmhost-{test}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let kernel = dir.join("kernel.elf");
    std::fs::write(&kernel, pvh_elf(&program())).unwrap();
    let plan = plan_toml(&format!(
        "name = \"kvmclock\"\n[cpu]\ncores = 1\n[memory]\nguest = \"64Mi\"\n[boot]\nkernel = \"{}\"\n",
        kernel.display()
    ));
    let layout = GuestLayout::from_plan(&plan, MMIO_HOLE_START..MMIO_HOLE_END).unwrap();
    let mem = layout.anonymous_memory().unwrap();
    let options = VmOptions {
        serial_out: Some(SerialOut(Arc::new(Mutex::new(Vec::new())))),
        console_input: ConsoleInput::None,
        ..Default::default()
    };
    let mut vm = Vm::new(&plan, (mem.clone(), layout), options).unwrap();
    let handle = vm.handle();
    let runner = std::thread::spawn(move || vm.run());

    assert!(
        wait_for(60, || read_u32(&mem, COUNTER) > 10_000),
        "the guest counts"
    );
    // KVM wrote the page when the guest enabled it (an even, non-zero version: not mid-write).
    let version = read_u32(&mem, PVCLOCK);
    assert!(
        version != 0 && version % 2 == 0,
        "KVM wrote the guest's kvmclock page: version {version}"
    );
    assert_eq!(
        flags(&mem) & GUEST_STOPPED,
        0,
        "not flagged stopped before any pause"
    );

    handle.pause().unwrap();
    let at_pause = read_u32(&mem, COUNTER);
    handle.resume().unwrap();
    // KVM writes the page at the vCPU's next entry after KVM_KVMCLOCK_CTRL; the guest never
    // clears the flag (Linux does, in kvm_check_and_clear_guest_paused).
    assert!(
        wait_for(60, || flags(&mem) & GUEST_STOPPED != 0),
        "after the resume the guest's kvmclock page says it was stopped (flags {:#04x}, version {})",
        flags(&mem),
        read_u32(&mem, PVCLOCK)
    );
    assert!(
        wait_for(60, || read_u32(&mem, COUNTER) > at_pause + 10_000),
        "the guest runs on after the resume"
    );
    handle.stop();
    let report = runner.join().unwrap().unwrap();
    assert_eq!(report.status, RunStatus::Stopped);
    let _ = std::fs::remove_dir_all(&dir);
}
