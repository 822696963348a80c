#![allow(clippy::cast_possible_truncation)] // test data: small known values
//! Test helpers: guest memory, a driver's view of a split queue (virtio-queue's mock), and
//! descriptor chains described as (address, length, writable) triples.

use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::Queue;
use vm_memory::GuestAddress;
use vmhost_memory::GuestMemoryMmap;

/// Guest RAM of the tests: 16 MiB at 0. Rings live at 0, buffers from [`DATA`] on.
pub const MEM_SIZE: usize = 16 << 20;
/// Where test buffers start.
pub const DATA: u64 = 0x10_0000;

pub fn memory() -> GuestMemoryMmap {
    GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).unwrap()
}

/// The guest-physical addresses of the 4 KiB pages set in `mem`'s dirty bitmaps (what live
/// migration would resend), in order.
pub fn dirty_pages(mem: &GuestMemoryMmap) -> Vec<u64> {
    use vm_memory::bitmap::Bitmap;
    use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};
    let mut pages = Vec::new();
    for r in mem.iter() {
        for off in (0..r.len()).step_by(4096) {
            if r.bitmap().dirty_at(off as usize) {
                pages.push(r.start_addr().0 + off);
            }
        }
    }
    pages
}

/// Clears `mem`'s dirty bitmaps (test set-up writes mark pages too).
pub fn clear_dirty(mem: &GuestMemoryMmap) {
    use vm_memory::GuestMemoryBackend;
    for r in mem.iter() {
        std::ops::Deref::deref(r).bitmap().reset();
    }
}

/// Where [`memory_two_regions`] splits guest RAM.
pub const SPLIT: u64 = 8 << 20;

/// The same 16 MiB as two regions (two host mappings) meeting at [`SPLIT`]: a buffer across
/// it is two host pieces.
pub fn memory_two_regions() -> GuestMemoryMmap {
    let half = MEM_SIZE / 2;
    GuestMemoryMmap::from_ranges(&[(GuestAddress(0), half), (GuestAddress(SPLIT), half)]).unwrap()
}

/// A buffer of a chain: address, length, device-writable.
pub type Buf = (u64, u32, bool);

/// A queue as the driver sees it plus the device-side `Queue` over the same rings.
pub struct TestQueue<'a> {
    pub mock: MockSplitQueue<'a, GuestMemoryMmap>,
    next_desc: u16,
    size: u16,
}

impl<'a> TestQueue<'a> {
    pub fn new(mem: &'a GuestMemoryMmap, start: u64, size: u16) -> Self {
        TestQueue {
            mock: MockSplitQueue::create(mem, GuestAddress(start), size),
            next_desc: 0,
            size,
        }
    }

    pub fn queue(&self) -> Queue {
        self.mock.create_queue::<Queue>().unwrap()
    }

    /// Posts one chain made of `bufs`, linked in order.
    pub fn post(&mut self, bufs: &[Buf]) {
        let first = self.next_desc;
        let descs: Vec<RawDescriptor> = bufs
            .iter()
            .enumerate()
            .map(|(i, &(addr, len, writable))| {
                let i = u16::try_from(i).unwrap();
                let mut flags = if writable {
                    VRING_DESC_F_WRITE as u16
                } else {
                    0
                };
                if usize::from(i) + 1 < bufs.len() {
                    flags |= VRING_DESC_F_NEXT as u16;
                }
                RawDescriptor::from(SplitDescriptor::new(addr, len, flags, first + i + 1))
            })
            .collect();
        self.mock.add_desc_chains(&descs, first).unwrap();
        self.next_desc += u16::try_from(bufs.len()).unwrap();
    }

    /// Posts raw descriptors at table index `at` (for malformed chains); the first is the
    /// head the available ring points to.
    pub fn post_raw(&mut self, descs: &[(u64, u32, u16, u16)], at: u16) {
        for (i, &(addr, len, flags, next)) in descs.iter().enumerate() {
            let raw = RawDescriptor::from(SplitDescriptor::new(addr, len, flags, next));
            self.mock
                .desc_table()
                .store(at + u16::try_from(i).unwrap(), raw)
                .unwrap();
        }
        let avail = self.mock.avail();
        let idx = avail.idx().load();
        avail
            .ring()
            .ref_at(usize::from(idx % self.size))
            .unwrap()
            .store(at);
        avail.idx().store(idx.wrapping_add(1));
    }

    /// The used ring's index.
    pub fn used_idx(&self) -> u16 {
        self.mock.used().idx().load()
    }

    /// Used element `i`: (head id, length).
    pub fn used(&self, i: u16) -> (u32, u32) {
        let e = self
            .mock
            .used()
            .ring()
            .ref_at(usize::from(i))
            .unwrap()
            .load();
        (e.id(), e.len())
    }
}

/// A readable, non-writable descriptor flag set with NEXT.
pub const F_NEXT: u16 = VRING_DESC_F_NEXT as u16;
/// Device-writable.
pub const F_WRITE: u16 = VRING_DESC_F_WRITE as u16;

/// Drives `dev` through the driver's handshake (VERSION_1 only) with `queues` as
/// (index, queue, size), then DRIVER_OK.
pub fn activate(dev: &mut crate::mmio::MmioTransport, queues: &[(u32, &TestQueue<'_>, u32)]) {
    use virtio_bindings::virtio_mmio::*;
    let mut wr = |reg: u32, v: u32| dev.write(u64::from(reg), &v.to_le_bytes());
    wr(VIRTIO_MMIO_STATUS, 1);
    wr(VIRTIO_MMIO_STATUS, 3);
    wr(VIRTIO_MMIO_DRIVER_FEATURES_SEL, 1);
    wr(VIRTIO_MMIO_DRIVER_FEATURES, 1);
    wr(VIRTIO_MMIO_STATUS, 11);
    for &(index, q, size) in queues {
        let m = &q.mock;
        wr(VIRTIO_MMIO_QUEUE_SEL, index);
        wr(VIRTIO_MMIO_QUEUE_NUM, size);
        wr(VIRTIO_MMIO_QUEUE_DESC_LOW, m.desc_table_addr().0 as u32);
        wr(VIRTIO_MMIO_QUEUE_AVAIL_LOW, m.avail_addr().0 as u32);
        wr(VIRTIO_MMIO_QUEUE_USED_LOW, m.used_addr().0 as u32);
        wr(VIRTIO_MMIO_QUEUE_READY, 1);
    }
    wr(VIRTIO_MMIO_STATUS, 15);
    assert_eq!(dev.status(), 15, "the device accepted the handshake");
}

/// Waits up to two seconds for `cond`.
pub fn wait_for(mut cond: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    while std::time::Instant::now() < deadline {
        if cond() {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    cond()
}
