//! A Linux guest's devices and ends on real KVM, with tiny PVH "kernels" built here: a few
//! 32-bit instructions at the PVH entry that write to COM1, probe an unknown port, and then
//! power off (ACPI S5), reboot (i8042 0xfe, ACPI reset register) or triple-fault. Each must end
//! the VM cleanly with exit status 0, with the serial output captured and timed, while the
//! second vCPU, never started by the "kernel", waits for INIT/SIPI until the VM stops.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;
use std::sync::{Arc, Mutex};

use common::pvh::{out8, pvh_elf};
use common::*;
use vmhost_boot::{RESET_PORT, RESET_VALUE, S5_SLEEP_TYPE, SLEEP_CONTROL_PORT, SLP_EN};
use vmhost_memory::{GuestLayout, MMIO_HOLE_END, MMIO_HOLE_START};
use vmhost_vcpu::{
    BootReport, ConsoleInput, LinuxEntry, RebootVia, RunReport, RunStatus, SerialOut,
    UnknownAccessPolicy, VcpuOutcome, Vm, VmOptions,
};

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
