//! A device state that a snapshot file or a migration stream brings: `MmioTransport::restore`
//! of a virtio-rng transport over 64 KiB of guest RAM, from a transport state built out of
//! the input (status, features, selectors, interrupt bits, and per queue its size, readiness,
//! ring addresses and both ring indices), or from the input read as the state's JSON; a
//! restored transport is then resumed, notified and saved again.
//!
//! Invariants: never a panic; a refused state leaves the transport as built (status 0); an
//! accepted one reads back as given (queues included) and every ready queue's rings lie in
//! guest RAM; serving a restored queue over any guest RAM content never panics.
//!
//! Input: `[json?, status, features, sel bytes, interrupt, per queue: size, flags, three
//! ring addresses, next_avail, next_used], guest RAM image...`.
#![no_main]

use std::sync::Arc;

use libfuzzer_sys::fuzz_target;
use virtio_bindings::virtio_mmio::VIRTIO_MMIO_STATUS;
use vm_memory::{Bytes, GuestAddress};
use vmhost_devices::persist::{DeviceState, QueueState, RngState, TransportState};
use vmhost_devices::{Interrupt, MmioTransport, Rng};
use vmhost_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

const MEM: usize = 64 << 10;
/// Bytes of input that make up one queue's state.
const QUEUE_BYTES: usize = 1 + 1 + 3 * 3 + 2 + 2;

fn memory(image: &[u8]) -> GuestMemoryMmap {
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM)]).expect("guest RAM");
    let n = image.len().min(MEM);
    mem.write_slice(&image[..n], GuestAddress(0))
        .expect("the image fits");
    mem
}

fn transport(mem: &GuestMemoryMmap) -> MmioTransport {
    let irq = EventFd::new(EFD_NONBLOCK).expect("eventfd");
    let interrupt = Arc::new(Interrupt::new(irq));
    MmioTransport::new(Box::new(Rng::new()), mem.clone(), interrupt).expect("transport")
}

/// A ring address near guest RAM: inside, at its end, or past it, from 3 bytes.
fn address(b: &[u8]) -> u64 {
    let raw = u64::from(u16::from_le_bytes([b[0], b[1]])) << 4;
    if b[2] & 0x80 != 0 {
        raw << (b[2] & 0x3f)
    } else {
        raw
    }
}

fn queue(b: &[u8], max_size: u16) -> QueueState {
    QueueState {
        max_size: if b[1] & 0x40 != 0 {
            u16::from(b[0])
        } else {
            max_size
        },
        size: if b[1] & 0x80 != 0 {
            u16::from(b[0])
        } else {
            1 << (b[0] % 16)
        },
        ready: b[1] & 1 != 0,
        desc_table: address(&b[2..5]),
        avail_ring: address(&b[5..8]),
        used_ring: address(&b[8..11]),
        next_avail: u16::from_le_bytes([b[11], b[12]]),
        next_used: u16::from_le_bytes([b[13], b[14]]),
        event_idx: b[1] & 4 != 0,
    }
}

/// The template's registers and queues with the input's values in them.
fn built(template: &TransportState, data: &[u8]) -> Option<(TransportState, usize)> {
    let head = 8;
    let queues = template.queues.len();
    if data.len() < head + queues * QUEUE_BYTES {
        return None;
    }
    let mut s = template.clone();
    s.status = u32::from(data[0]);
    s.acked_features = u64::from(data[1]) << 32 | u64::from(data[2]) << 24;
    s.device_features_sel = u32::from(data[3] & 3);
    s.driver_features_sel = u32::from(data[4] & 3);
    s.queue_sel = u32::from(data[5] & 3);
    s.config_generation = u32::from(data[6]);
    s.interrupt_status = u32::from(data[7] & 7);
    for (i, q) in s.queues.iter_mut().enumerate() {
        let at = head + i * QUEUE_BYTES;
        *q = queue(&data[at..at + QUEUE_BYTES], q.max_size);
    }
    Some((s, head + queues * QUEUE_BYTES))
}

fn check(state: &TransportState, image: &[u8]) {
    let mem = memory(image);
    let mut t = transport(&mem);
    match t.restore(state, &DeviceState::Rng(RngState {})) {
        Ok(()) => {
            for q in state.queues.iter().filter(|q| q.ready) {
                let end = q.desc_table + 16 * u64::from(q.size);
                assert!(end <= MEM as u64, "a ready queue's table ends at {end:#x}");
            }
            t.resume();
            for i in 0..state.queues.len() {
                t.notify(i);
            }
            let (again, _) = t.save().expect("a restored transport saves");
            assert_eq!(again.queues.len(), state.queues.len());
        }
        Err(_) => {
            let mut status = [0u8; 4];
            t.read(u64::from(VIRTIO_MMIO_STATUS), &mut status);
            assert_eq!(
                u32::from_le_bytes(status),
                0,
                "a refused state changed the status"
            );
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let mem = memory(&[]);
    let Ok((template, _)) = transport(&mem).save() else {
        return;
    };
    if let Ok(state) = serde_json::from_slice::<TransportState>(data) {
        check(&state, &[]);
        return;
    }
    if let Some((state, used)) = built(&template, data) {
        check(&state, &data[used..]);
    }
});
