//! A Linux guest's devices and ends on real KVM, with tiny PVH "kernels" built here: a few
//! 32-bit instructions at the PVH entry that write to COM1, probe an unknown port, and then
//! power off (ACPI S5), reboot (i8042 0xfe, ACPI reset register) or triple-fault. Each must end
//! the VM cleanly with exit status 0, with the serial output captured and timed, while the
//! second vCPU, never started by the "kernel", waits for INIT/SIPI until the VM stops.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;
use std::sync::{Arc, Mutex};

use common::*;
use vmhost_boot::{RESET_PORT, RESET_VALUE, S5_SLEEP_TYPE, SLEEP_CONTROL_PORT, SLP_EN};
use vmhost_memory::{GuestLayout, MMIO_HOLE_END, MMIO_HOLE_START};
use vmhost_vcpu::{
    BootReport, ConsoleInput, LinuxEntry, RebootVia, RunReport, RunStatus, SerialOut,
    UnknownAccessPolicy, VcpuOutcome, Vm, VmOptions,
};

/// Where the fake kernel is loaded (and entered).
const LOAD: u64 = 0x100_0000;

/// `mov dx, port; mov al, value; out dx, al`.
fn out8(port: u16, value: u8) -> Vec<u8> {
    let [lo, hi] = port.to_le_bytes();
    vec![0x66, 0xba, lo, hi, 0xb0, value, 0xee]
}

/// The fake kernel's code: "hi\n" to COM1, a write to an unknown port, then `tail`.
fn program(tail: &[u8]) -> Vec<u8> {
    let mut code = Vec::new();
    for b in b"hi\n" {
        code.extend(out8(0x3f8, *b));
    }
    code.extend(out8(0x1234, 0x42));
    code.extend_from_slice(tail);
    code.extend_from_slice(&[0xf4, 0xeb, 0xfd]); // hlt; jmp back to hlt
    code
}

/// A minimal ELF64 x86-64 executable: `code` at physical [`LOAD`], with a Xen PVH entry note
/// pointing at it.
fn pvh_elf(code: &[u8]) -> Vec<u8> {
    let mut note = Vec::new();
    for v in [4u32, 4, 18] {
        note.extend_from_slice(&v.to_le_bytes()); // namesz, descsz, XEN_ELFNOTE_PHYS32_ENTRY
    }
    note.extend_from_slice(b"Xen\0");
    note.extend_from_slice(&u32::try_from(LOAD).unwrap().to_le_bytes());
    let phdr = |p_type: u32, offset: u64, paddr: u64, size: u64| {
        let mut p = Vec::new();
        p.extend_from_slice(&p_type.to_le_bytes());
        p.extend_from_slice(&5u32.to_le_bytes());
        for v in [offset, paddr, paddr, size, size, 4] {
            p.extend_from_slice(&v.to_le_bytes());
        }
        p
    };
    let mut b = vec![0u8; 64];
    b[..4].copy_from_slice(b"\x7fELF");
    (b[4], b[5], b[6]) = (2, 1, 1);
    b[16..18].copy_from_slice(&2u16.to_le_bytes());
    b[18..20].copy_from_slice(&62u16.to_le_bytes());
    b[20..24].copy_from_slice(&1u32.to_le_bytes());
    b[24..32].copy_from_slice(&LOAD.to_le_bytes());
    b[32..40].copy_from_slice(&64u64.to_le_bytes());
    b[52..54].copy_from_slice(&64u16.to_le_bytes());
    b[54..56].copy_from_slice(&56u16.to_le_bytes());
    b[56..58].copy_from_slice(&2u16.to_le_bytes());
    let note_off = 64 + 2 * 56;
    let code_off = note_off + note.len() as u64;
    b.extend(phdr(1, code_off, LOAD, code.len() as u64));
    b.extend(phdr(4, note_off, 0, note.len() as u64));
    b.extend(note);
    b.extend_from_slice(code);
    b
}

/// Boots `code` as a PVH kernel on a 2-vCPU, 64 MiB VM and returns the report and the serial
/// output.
fn boot(test: &str, code: &[u8], policy: UnknownAccessPolicy) -> Option<(RunReport, String)> {
    if !kvm_available(test) {
        return None;
    }
    let _cpus = lock_cpus();
    let dir = std::env::temp_dir().join(format!("vmhost-{test}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let kernel = dir.join("kernel.elf");
    std::fs::write(&kernel, pvh_elf(code)).unwrap();
    let plan = plan_toml(&spec(&kernel));
    let layout = GuestLayout::from_plan(&plan, MMIO_HOLE_START..MMIO_HOLE_END).unwrap();
    let mem = layout.anonymous_memory().unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    let options = VmOptions {
        unknown_access: policy,
        serial_out: Some(SerialOut(log.clone())),
        console_input: ConsoleInput::None,
        ..Default::default()
    };
    let mut vm = Vm::new(&plan, (mem, layout), options).unwrap();
    let report = vm.run().unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    println!("{}", report.render_text());
    let out = String::from_utf8(log.lock().unwrap().clone()).unwrap();
    Some((report, out))
}

fn spec(kernel: &Path) -> String {
    format!(
        "name = \"fake\"\n[cpu]\ncores = 2\n[memory]\nguest = \"64Mi\"\n[boot]\nkernel = \"{}\"\n",
        kernel.display()
    )
}

/// The checks every clean end shares.
fn assert_clean_end(r: &RunReport, out: &str, status: RunStatus, bsp: &VcpuOutcome) {
    assert_eq!(out, "hi\n");
    assert_eq!(r.status, status);
    assert_eq!(r.exit_code(), 0);
    assert_eq!(&r.vcpus[0].outcome, bsp);
    assert_eq!(
        r.vcpus[1].outcome,
        VcpuOutcome::Stopped,
        "the AP waited for INIT/SIPI until the VM stopped"
    );
    assert_eq!(r.vcpus[0].ignored_accesses, 1, "port 0x1234 was ignored");
    assert_eq!(r.payload, None);
    let BootReport::Linux {
        entry,
        first_serial_byte_seconds,
        serial_bytes,
        ..
    } = &r.boot
    else {
        panic!("{:?}", r.boot)
    };
    assert_eq!(*entry, LinuxEntry::Pvh);
    assert_eq!(*serial_bytes, 3);
    assert!(first_serial_byte_seconds.is_some_and(|t| t <= r.run_seconds));
}

#[test]
fn acpi_s5_powers_the_guest_off() {
    let tail = out8(SLEEP_CONTROL_PORT, SLP_EN | (S5_SLEEP_TYPE << 2));
    let Some((r, out)) = boot(
        "acpi_s5_powers_the_guest_off",
        &program(&tail),
        UnknownAccessPolicy::Auto,
    ) else {
        return;
    };
    assert_clean_end(&r, &out, RunStatus::PoweredOff, &VcpuOutcome::PoweredOff);
}

#[test]
fn keyboard_controller_reset_reboots_the_guest() {
    let Some((r, out)) = boot(
        "keyboard_controller_reset_reboots_the_guest",
        &program(&out8(0x64, 0xfe)),
        UnknownAccessPolicy::Auto,
    ) else {
        return;
    };
    let how = RebootVia::KeyboardController;
    assert_clean_end(
        &r,
        &out,
        RunStatus::Rebooted,
        &VcpuOutcome::Rebooted { how },
    );
}

#[test]
fn acpi_reset_register_reboots_the_guest() {
    let Some((r, out)) = boot(
        "acpi_reset_register_reboots_the_guest",
        &program(&out8(RESET_PORT, RESET_VALUE)),
        UnknownAccessPolicy::Auto,
    ) else {
        return;
    };
    let how = RebootVia::AcpiResetRegister;
    assert_clean_end(
        &r,
        &out,
        RunStatus::Rebooted,
        &VcpuOutcome::Rebooted { how },
    );
}

#[test]
fn a_triple_fault_is_a_reboot() {
    // ud2 with the boot IDT's limit of 0: #UD, #DF, then shutdown.
    let Some((r, out)) = boot(
        "a_triple_fault_is_a_reboot",
        &program(&[0x0f, 0x0b]),
        UnknownAccessPolicy::Auto,
    ) else {
        return;
    };
    assert_eq!(r.status, RunStatus::Rebooted, "{:?}", r.vcpus[0].outcome);
    assert!(
        matches!(
            r.vcpus[0].outcome,
            VcpuOutcome::Rebooted {
                how: RebootVia::TripleFault { .. }
            }
        ),
        "{:?}",
        r.vcpus[0].outcome
    );
    assert_eq!(out, "hi\n");
    assert_eq!(r.exit_code(), 0);
}

#[test]
fn the_stop_policy_still_stops_a_linux_guest_on_an_unknown_port() {
    let Some((r, out)) = boot(
        "the_stop_policy_still_stops_a_linux_guest_on_an_unknown_port",
        &program(&out8(0x64, 0xfe)),
        UnknownAccessPolicy::Stop,
    ) else {
        return;
    };
    assert_eq!(out, "hi\n");
    assert_eq!(r.status, RunStatus::GuestFailed);
    assert_eq!(
        r.vcpus[0].outcome,
        VcpuOutcome::UnknownPort {
            port: 0x1234,
            write: true,
            size: 1
        }
    );
}
