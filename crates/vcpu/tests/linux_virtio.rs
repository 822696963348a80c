//! A Linux guest's virtio-mmio devices on real KVM, with a tiny PVH "kernel" built here (as in
//! `linux_devices.rs`, whose ELF writer this copies until the two move into `tests/common`):
//! it reads the first device's `MagicValue` and `DeviceID` registers at 0xd0000000 and prints
//! them on COM1, then powers off. The reads go through the vCPU's MMIO exit, the Linux devices
//! and the virtio bus to the device's transport.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;
use std::sync::{Arc, Mutex};

use common::pvh::{out8, pvh_elf};
use common::*;
use vmhost_boot::{S5_SLEEP_TYPE, SLEEP_CONTROL_PORT, SLP_EN};
use vmhost_memory::{GuestLayout, MMIO_HOLE_END, MMIO_HOLE_START};
use vmhost_vcpu::{ConsoleInput, RunStatus, SerialOut, UnknownAccessPolicy, Vm, VmOptions};

/// Prints the four bytes of the 32-bit MMIO register at `gpa` on COM1.
fn print_register_bytes(gpa: u32) -> Vec<u8> {
    let mut code = vec![0xa1]; // mov eax, [gpa]
    code.extend_from_slice(&gpa.to_le_bytes());
    code.extend_from_slice(&[0x66, 0xba, 0xf8, 0x03]); // mov dx, 0x3f8
    for i in 0..4 {
        if i > 0 {
            code.extend_from_slice(&[0xc1, 0xe8, 0x08]); // shr eax, 8
        }
        code.push(0xee); // out dx, al
    }
    code
}

/// Prints the low byte of the register at `gpa` as a decimal digit.
fn print_register_digit(gpa: u32) -> Vec<u8> {
    let mut code = vec![0xa1];
    code.extend_from_slice(&gpa.to_le_bytes());
    code.extend_from_slice(&[0x04, b'0']); // add al, '0'
    code.extend_from_slice(&[0x66, 0xba, 0xf8, 0x03, 0xee]);
    code
}

#[test]
fn a_linux_guest_reads_its_virtio_device_registers() {
    let test = "a_linux_guest_reads_its_virtio_device_registers";
    if !kvm_available(test) {
        return;
    }
    let _cpus = lock_cpus();
    let dir = std::env::temp_dir().join(format!("vmhost-{test}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut code = print_register_bytes(0xd000_0000);
    code.extend(print_register_digit(0xd000_0008));
    code.extend(out8(0x3f8, b'\n'));
    code.extend(out8(SLEEP_CONTROL_PORT, SLP_EN | (S5_SLEEP_TYPE << 2)));
    code.extend_from_slice(&[0xf4, 0xeb, 0xfd]);
    let kernel = dir.join("kernel.elf");
    std::fs::write(&kernel, pvh_elf(&code)).unwrap();
    let plan = plan_toml(&spec(&kernel));
    assert_eq!(plan.devices.slots.len(), 1);
    let layout = GuestLayout::from_plan(&plan, MMIO_HOLE_START..MMIO_HOLE_END).unwrap();
    let mem = layout.anonymous_memory().unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    let options = VmOptions {
        unknown_access: UnknownAccessPolicy::Stop,
        serial_out: Some(SerialOut(log.clone())),
        console_input: ConsoleInput::None,
        device_dir: Some(dir.clone()),
        ..Default::default()
    };
    let mut vm = Vm::new(&plan, (mem, layout), options).unwrap();
    let report = vm.run().unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    println!("{}", report.render_text());
    let out = String::from_utf8(log.lock().unwrap().clone()).unwrap();
    assert_eq!(
        out, "virt4\n",
        "MagicValue \"virt\", DeviceID 4 (virtio-rng)"
    );
    assert_eq!(report.status, RunStatus::PoweredOff);
    assert_eq!(report.vcpus[0].ignored_accesses, 0, "no access was unknown");
}

fn spec(kernel: &Path) -> String {
    format!(
        "name = \"fake\"\n[cpu]\ncores = 2\n[memory]\nguest = \"64Mi\"\n[devices.rng]\n[boot]\nkernel = \"{}\"\n",
        kernel.display()
    )
}
