//! What a guest controls at an exit: port I/O to the Linux devices (serial, power and reset
//! ports, PIC/PIT/CMOS stubs) with any port, size and data, and the mailbox a payload leaves
//! behind (any bytes, read back and turned into results). Never a panic or a wrapped figure.
#![no_main]

use std::sync::{Arc, Mutex, OnceLock};

use libfuzzer_sys::fuzz_target;
use vm_memory::{Bytes, GuestAddress};
use vmhost_memory::GuestMemoryMmap;
use vmhost_vcpu::devices::serial::{SerialConsole, SerialOut};
use vmhost_vcpu::devices::LinuxDevices;
use vmhost_vcpu::payload::{self, mailbox::Mailbox, PayloadKind};

const MAILBOX_GPA: u64 = 0x1000;

fn devices() -> &'static LinuxDevices {
    static D: OnceLock<LinuxDevices> = OnceLock::new();
    D.get_or_init(|| {
        let out = SerialOut(Arc::new(Mutex::new(std::io::sink())));
        LinuxDevices::new(SerialConsole::new(Some(out)).expect("serial console"))
    })
}

fn memory() -> &'static GuestMemoryMmap {
    static M: OnceLock<GuestMemoryMmap> = OnceLock::new();
    M.get_or_init(|| {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).expect("guest memory")
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&selector, rest)) = data.split_first() else {
        return;
    };
    if selector & 1 == 0 {
        // Port I/O: records of [write?, port lo, port hi, size, bytes...].
        let mut rest = rest;
        while rest.len() >= 4 {
            let (write, port, size) = (
                rest[0] & 1 == 1,
                u16::from_le_bytes([rest[1], rest[2]]),
                usize::from(rest[3] % 5).max(1),
            );
            rest = &rest[4..];
            let take = size.min(rest.len());
            if write {
                let _ = devices().pio_write(port, &rest[..take]);
            } else {
                let mut buf = [0u8; 4];
                let _ = devices().pio_read(port, &mut buf[..size]);
            }
            rest = &rest[take..];
        }
        return;
    }
    // A mailbox left by the guest: every byte guest-controlled.
    let mem = memory();
    let size = std::mem::size_of::<Mailbox>();
    let mut bytes = rest.to_vec();
    bytes.resize(size, 0);
    mem.write_slice(&bytes, GuestAddress(MAILBOX_GPA))
        .expect("mailbox fits");
    let Ok(m) = payload::read_mailbox(mem, MAILBOX_GPA) else {
        return;
    };
    let _ = payload::cpuid_results(&m);
    let tsc_khz = u32::from(selector >> 1) * 100_000;
    for kind in [
        PayloadKind::Touch,
        PayloadKind::NumaBench,
        PayloadKind::Halt,
        PayloadKind::Idle,
    ] {
        let _ = payload::collect(kind, &m, 0, &[0, 1, 2, 3], tsc_khz);
    }
});
