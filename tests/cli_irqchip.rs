//! `boot.irqchip` end to end on this host's real KVM: a tiny PVH guest programs the I/O APIC
//! itself and must take two interrupts through it to end, so the guest's own view decides.
//!
//! The guest masks the 8259s and LINT0, enables its LAPIC, installs interrupt gates for
//! vectors 0x34 and 0x35, points I/O APIC pins 4 (COM1) and 5 (the power button's GED) at
//! them, prints `R` and halts with interrupts on. The test then asks the control API to shut
//! the VM down, which presses the power button (`KVM_IRQ_LINE` on GSI 5, from the API
//! thread): vector 0x35's handler enables COM1's transmitter-empty interrupt and prints `P`;
//! that interrupt (COM1's irqfd on GSI 4, raised by the serial device) reaches vector 0x34,
//! whose handler powers off (ACPI S5). With KVM's irqchip the in-kernel I/O APIC routes both;
//! with `boot.irqchip = "split"` vmhost's does, through the MSI routes it installed when the
//! guest wrote the entries. A route that is missing leaves the guest halted and the test
//! fails; and the host kernel's own account shows the PIT: a `kvm-pit/<pid>` thread with KVM's
//! irqchip, none with the split one.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};
use vmhost_testsupport::pvh::{out8, pvh_elf, LOAD};
use vmhost_testsupport::{has_kvm_pit, lock_cpus, need_kvm};

const IDT: u32 = 0x30_0000;
const IDTR: u32 = 0x2f_fff0;
const LAPIC: u32 = 0xfee0_0000;
const IOAPIC: u32 = 0xfec0_0000;

fn le(v: u32) -> [u8; 4] {
    v.to_le_bytes()
}

/// `mov dword [addr], value`.
fn store32(addr: u32, value: u32) -> Vec<u8> {
    [&[0xc7, 0x05][..], &le(addr), &le(value)].concat()
}

/// A 32-bit interrupt gate for `vector` at [`IDT`] pointing at `handler`, selector CS.
fn gate(vector: u32, handler: u32) -> Vec<u8> {
    let e = IDT + vector * 8;
    let mut c = vec![0xb8];
    c.extend(le(handler)); // mov eax, handler
    c.extend([&[0x66, 0xa3][..], &le(e)].concat()); // mov [e], ax
    c.extend([0xc1, 0xe8, 0x10]); // shr eax, 16
    c.extend([&[0x66, 0xa3][..], &le(e + 6)].concat()); // mov [e+6], ax
    c.extend([0x66, 0x8c, 0xc8]); // mov ax, cs
    c.extend([&[0x66, 0xa3][..], &le(e + 2)].concat()); // mov [e+2], ax
    c.extend([&[0xc6, 0x05][..], &le(e + 4), &[0x00]].concat()); // mov byte [e+4], 0
    c.extend([&[0xc6, 0x05][..], &le(e + 5), &[0x8e]].concat()); // present, DPL 0, int gate
    c
}

/// Pin `pin` of the I/O APIC to `vector`, fixed delivery to APIC 0, edge, unmasked.
fn route(pin: u32, vector: u32) -> Vec<u8> {
    [
        store32(IOAPIC, 0x11 + 2 * pin),
        store32(IOAPIC + 0x10, 0),
        store32(IOAPIC, 0x10 + 2 * pin),
        store32(IOAPIC + 0x10, vector),
    ]
    .concat()
}

const HALT_LOOP: [u8; 3] = [0xf4, 0xeb, 0xfd];

/// The guest (see the module docs), loaded and entered at [`LOAD`].
fn guest() -> Vec<u8> {
    // The handlers, after the set-up (whose length depends only on constants).
    let h35 = [
        store32(LAPIC + 0xb0, 0), // EOI
        out8(0x3f9, 0x02),        // COM1 IER: transmitter holding register empty
        out8(0x3f8, b'P'),
        vec![0xfb], // sti
        HALT_LOOP.to_vec(),
    ]
    .concat();
    let h34 = [out8(0x600, 5 << 2 | 1 << 5), HALT_LOOP.to_vec()].concat();
    let setup = |h35_at: u32, h34_at: u32| {
        [
            out8(0x21, 0xff),
            out8(0xa1, 0xff),
            store32(LAPIC + 0x350, 0x1_0000), // LINT0 masked
            store32(LAPIC + 0xf0, 0x1ff),     // SVR: software-enabled
            gate(0x34, h34_at),
            gate(0x35, h35_at),
            [&[0x66, 0xc7, 0x05][..], &le(IDTR), &0x7ffu16.to_le_bytes()].concat(),
            store32(IDTR + 2, IDT),
            [&[0x0f, 0x01, 0x1d][..], &le(IDTR)].concat(), // lidt [IDTR]
            route(4, 0x34),
            route(5, 0x35),
            out8(0x3f8, b'R'),
            vec![0xfb], // sti
            HALT_LOOP.to_vec(),
        ]
        .concat()
    };
    let len = u32::try_from(setup(0, 0).len()).unwrap();
    let base = u32::try_from(LOAD).unwrap();
    let h35_at = base + len;
    let h34_at = h35_at + u32::try_from(h35.len()).unwrap();
    [setup(h35_at, h34_at), h35, h34].concat()
}

fn run(d: &Path, irqchip: &str) {
    std::fs::create_dir_all(d).unwrap();
    std::fs::write(d.join("guest.elf"), pvh_elf(&guest())).unwrap();
    let spec = d.join("vm.toml");
    std::fs::write(
        &spec,
        format!(
            "name = \"irq-{irqchip}\"\n[cpu]\ncores = 1\n[memory]\nguest = \"64Mi\"\n\
             [boot]\nkernel = \"guest.elf\"\nirqchip = \"{irqchip}\"\n"
        ),
    )
    .unwrap();
    let out = d.join("stdout");
    let file = std::fs::File::create(&out).unwrap();
    let (mut child, sock) = common::start_with_api(d, &spec, &[], Stdio::from(file));
    let console = || std::fs::read_to_string(&out).unwrap_or_default();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !console().contains('R') {
        assert!(
            Instant::now() < deadline,
            "the guest never got ready: {}",
            console()
        );
        assert!(child.try_wait().unwrap().is_none(), "vmhost ended early");
        std::thread::sleep(Duration::from_millis(5));
    }
    let pit = has_kvm_pit(child.id());
    assert_eq!(
        pit,
        irqchip == "kernel",
        "irqchip {irqchip}: the host kernel has {} kvm-pit thread for vmhost",
        if pit { "a" } else { "no" }
    );
    assert_eq!(common::ctl(&sock, "shutdown").0, 0);
    let status = common::wait_exit(&mut child, 60, || {
        format!(
            "irqchip {irqchip}: the guest did not power off; its console: {:?}",
            console()
        )
    });
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        use std::io::Read;
        e.read_to_string(&mut err).unwrap();
    }
    assert_eq!(status.code(), Some(0), "irqchip {irqchip}: {err}");
    assert!(
        console().contains("RP"),
        "irqchip {irqchip}: the power button's interrupt did not run its handler: {:?}",
        console()
    );
    std::fs::remove_dir_all(d).unwrap();
}

#[test]
fn a_guest_takes_its_interrupts_through_either_irqchips_ioapic() {
    if !need_kvm("a_guest_takes_its_interrupts_through_either_irqchips_ioapic") {
        return;
    }
    let _cpus = lock_cpus();
    let base = std::env::temp_dir().join(format!("vmhost-irqchip-{}", std::process::id()));
    for irqchip in ["kernel", "split"] {
        run(&base.join(irqchip), irqchip);
    }
    let _ = std::fs::remove_dir_all(&base);
}
