//! A Linux guest's virtio-mmio devices on real KVM, with a tiny PVH "kernel" built here (as in
//! `linux_devices.rs`, whose ELF writer this copies until the two move into `tests/common`):
//! it reads the first device's `MagicValue` and `DeviceID` registers at 0xd0000000 and prints
//! them on COM1, then powers off. The reads go through the vCPU's MMIO exit, the Linux devices
//! and the virtio bus to the device's transport.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;
use std::sync::{Arc, Mutex};

use common::*;
use vmhost_boot::{S5_SLEEP_TYPE, SLEEP_CONTROL_PORT, SLP_EN};
use vmhost_memory::{GuestLayout, MMIO_HOLE_END, MMIO_HOLE_START};
use vmhost_vcpu::{ConsoleInput, RunStatus, SerialOut, UnknownAccessPolicy, Vm, VmOptions};

/// Where the fake kernel is loaded (and entered).
const LOAD: u64 = 0x100_0000;

/// `mov dx, port; mov al, value; out dx, al`.
fn out8(port: u16, value: u8) -> Vec<u8> {
    let [lo, hi] = port.to_le_bytes();
    vec![0x66, 0xba, lo, hi, 0xb0, value, 0xee]
}

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

/// A minimal ELF64 x86-64 executable: `code` at physical [`LOAD`], with a Xen PVH entry note.
fn pvh_elf(code: &[u8]) -> Vec<u8> {
    let mut note = Vec::new();
    for v in [4u32, 4, 18] {
        note.extend_from_slice(&v.to_le_bytes());
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
