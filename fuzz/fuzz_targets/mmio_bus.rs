//! The vCPUs' MMIO path to the virtio devices: `vmhost_devices::bus::MmioBus` with the
//! transports at the plan's slot bases as `vmhost_vcpu::virtio::attach` puts them there
//! (virtio-blk over a scratch image, virtio-rng, virtio-net over a datagram socket, one empty
//! slot, virtio-vsock; acknowledge-on-read interrupts), a driver start or none, then any
//! sequence of reads and writes of any width at any address around and across the windows,
//! and queue notifications as the I/O thread delivers them. Guest RAM is two 64 KiB regions
//! with an unmapped gap, mapped from a file between canary stretches.
//!
//! Invariants: an access is taken exactly when a window holds its address, and a read no
//! window holds leaves the buffer alone; every window still answers its magic value, version
//! and device ID (no access reached the wrong device or broke the dispatch); no byte of the
//! file outside the two regions changed (nothing touched memory outside guest RAM).
//!
//! Input: `[start?, n_ops, n_ops × (op, addr 0-2, value 0-3), guest memory image...]`.
#![no_main]

use std::fs::File;
use std::os::fd::OwnedFd;
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixDatagram;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use libfuzzer_sys::fuzz_target;
use virtio_bindings::virtio_config::{VIRTIO_CONFIG_S_DRIVER_OK, VIRTIO_F_VERSION_1};
use virtio_bindings::virtio_mmio::*;
use vm_memory::{FileOffset, GuestAddress};
use vmhost_devices::bus::{MmioBus, SharedTransport};
use vmhost_devices::mmio::DRIVER_INIT_SEQUENCE;
use vmhost_devices::{
    Block, BlockConfig, CacheMode, Interrupt, MmioTransport, Net, Rng, VirtioDevice, Vsock,
    MMIO_MAGIC, MMIO_VERSION, MMIO_WINDOW_SIZE,
};
use vmhost_memory::GuestMemoryMmap;
use vmhost_plan::devices::{VIRTIO_MMIO_BASE, VIRTIO_MMIO_SIZE};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// One guest RAM region, and one canary stretch of the backing file.
const CHUNK: usize = 64 << 10;
/// The two regions: (guest address, file offset); canaries at file offsets 0, 2 and 4 chunks.
const REGIONS: [(u64, usize); 2] = [(0, CHUNK), (0x2_0000, 3 * CHUNK)];
const CANARY: u8 = 0xa5;
/// Slots that hold a device (slot 3 is empty).
const SLOTS: [u64; 4] = [0, 1, 2, 4];
/// Addresses the accesses reach: a window below the first slot to one above the last.
const SPAN: u64 = 7 * VIRTIO_MMIO_SIZE;
/// Queue size and ring spacing of the driver start.
const QUEUE_SIZE: u32 = 16;
const RING_STRIDE: u64 = 0x400;

fn scratch(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("vmhost-fuzz-mmio-{}.{name}", std::process::id()))
}

/// The guest RAM file, unlinked once open.
fn memory_file() -> &'static File {
    static F: OnceLock<File> = OnceLock::new();
    F.get_or_init(|| {
        let path = scratch("mem");
        let file = File::options()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .open(&path)
            .expect("memory file");
        std::fs::remove_file(&path).expect("unlink the memory file");
        file
    })
}

fn devices() -> Option<(Vec<Box<dyn VirtioDevice>>, UnixDatagram)> {
    let image = scratch("blk");
    File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&image)
        .and_then(|f| f.set_len(64 << 10))
        .ok()?;
    let block = Block::new(&BlockConfig {
        path: image,
        read_only: false,
        cache: CacheMode::Writeback,
        serial: "fuzz".into(),
    })
    .ok()?;
    let (tap, peer) = UnixDatagram::pair().ok()?;
    tap.set_nonblocking(true).ok()?;
    peer.set_nonblocking(true).ok()?;
    let net = Net::new(File::from(OwnedFd::from(tap)), [2, 0, 0, 0, 0, 1]);
    let vsock = Vsock::new(3, &scratch("vsock")).ok()?;
    let devices: Vec<Box<dyn VirtioDevice>> = vec![
        Box::new(block),
        Box::new(Rng::new()),
        Box::new(net),
        Box::new(vsock),
    ];
    Some((devices, peer))
}

fn write32(bus: &MmioBus, gpa: u64, value: u32) {
    assert!(bus.write(gpa, &value.to_le_bytes()));
}

fn read32(bus: &MmioBus, gpa: u64) -> u32 {
    let mut b = [0u8; 4];
    assert!(bus.read(gpa, &mut b));
    u32::from_le_bytes(b)
}

/// A Linux driver's start through the bus: every offered feature, each queue's rings in the
/// first region at `(slot * 4 + queue) * RING_STRIDE`, DRIVER_OK.
fn start(bus: &MmioBus, slot: u64, base: u64, queues: usize) {
    let reg = |r: u32| base + u64::from(r);
    write32(bus, reg(VIRTIO_MMIO_STATUS), DRIVER_INIT_SEQUENCE[0]);
    write32(bus, reg(VIRTIO_MMIO_STATUS), DRIVER_INIT_SEQUENCE[1]);
    for sel in 0..2 {
        write32(bus, reg(VIRTIO_MMIO_DEVICE_FEATURES_SEL), sel);
        let offered = read32(bus, reg(VIRTIO_MMIO_DEVICE_FEATURES));
        let version = if sel == 1 {
            1 << (VIRTIO_F_VERSION_1 - 32)
        } else {
            0
        };
        write32(bus, reg(VIRTIO_MMIO_DRIVER_FEATURES_SEL), sel);
        write32(bus, reg(VIRTIO_MMIO_DRIVER_FEATURES), offered | version);
    }
    write32(bus, reg(VIRTIO_MMIO_STATUS), DRIVER_INIT_SEQUENCE[2]);
    for q in 0..queues {
        let rings = (slot * 4 + q as u64) * RING_STRIDE;
        write32(bus, reg(VIRTIO_MMIO_QUEUE_SEL), q as u32);
        write32(bus, reg(VIRTIO_MMIO_QUEUE_NUM), QUEUE_SIZE);
        write32(bus, reg(VIRTIO_MMIO_QUEUE_DESC_LOW), rings as u32);
        write32(
            bus,
            reg(VIRTIO_MMIO_QUEUE_AVAIL_LOW),
            (rings + 0x100) as u32,
        );
        write32(bus, reg(VIRTIO_MMIO_QUEUE_USED_LOW), (rings + 0x200) as u32);
        write32(bus, reg(VIRTIO_MMIO_QUEUE_READY), 1);
    }
    let status = read32(bus, reg(VIRTIO_MMIO_STATUS));
    write32(
        bus,
        reg(VIRTIO_MMIO_STATUS),
        status | VIRTIO_CONFIG_S_DRIVER_OK,
    );
}

/// Writes the image between the canaries and maps the two regions from the file.
fn guest_memory(image: &[u8]) -> GuestMemoryMmap {
    let mut content = vec![CANARY; 5 * CHUNK];
    for (i, &(_, offset)) in REGIONS.iter().enumerate() {
        let part = image.get(i * CHUNK..).unwrap_or_default();
        let part = &part[..part.len().min(CHUNK)];
        content[offset..offset + CHUNK].fill(0);
        content[offset..offset + part.len()].copy_from_slice(part);
    }
    let file = memory_file();
    file.write_all_at(&content, 0).expect("write guest RAM");
    let ranges: Vec<_> = REGIONS
        .iter()
        .map(|&(gpa, offset)| {
            let fd = file.try_clone().expect("dup the memory file");
            (
                GuestAddress(gpa),
                CHUNK,
                Some(FileOffset::new(fd, offset as u64)),
            )
        })
        .collect();
    GuestMemoryMmap::from_ranges_with_files(&ranges).expect("guest memory")
}

fn check_canaries() {
    let mut stretch = vec![0u8; CHUNK];
    for offset in [0, 2 * CHUNK, 4 * CHUNK] {
        memory_file()
            .read_exact_at(&mut stretch, offset as u64)
            .expect("read a canary");
        if let Some(i) = stretch.iter().position(|&b| b != CANARY) {
            panic!(
                "file byte {:#x}, outside guest RAM, was written",
                offset + i
            );
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let [flags, n_ops, rest @ ..] = data else {
        return;
    };
    let Some((ops, image)) = rest.split_at_checked(usize::from(n_ops % 64) * 8) else {
        return;
    };
    let mem = guest_memory(image);
    let Some((devices, peer)) = devices() else {
        return;
    };
    let _ = peer.send(&image[image.len() / 2..]); // a frame waiting on the "tap"
    let mut bus = MmioBus::default();
    let mut slots: Vec<(u64, u32, usize, SharedTransport)> = Vec::new();
    for (device, slot) in devices.into_iter().zip(SLOTS) {
        let base = VIRTIO_MMIO_BASE + slot * VIRTIO_MMIO_SIZE;
        let (kind, queues) = (device.device_type(), device.queue_max_sizes().len());
        let interrupt = Arc::new(Interrupt::new(EventFd::new(EFD_NONBLOCK).expect("eventfd")));
        interrupt.set_ack_on_read(true);
        let transport = MmioTransport::new(device, mem.clone(), interrupt).expect("transport");
        let transport = Arc::new(Mutex::new(transport));
        bus.insert(base, transport.clone())
            .expect("slot on the bus");
        slots.push((base, kind, queues, transport));
    }
    if flags & 1 == 1 {
        for (slot, (base, _, queues, _)) in SLOTS.iter().zip(&slots) {
            start(&bus, *slot, *base, *queues);
        }
    }
    let held = |gpa: u64| {
        slots
            .iter()
            .any(|(base, ..)| (*base..*base + MMIO_WINDOW_SIZE).contains(&gpa))
    };
    for op in ops.chunks_exact(8) {
        let addr = u64::from(u32::from_le_bytes([op[1], op[2], op[3], 0])) % SPAN;
        let gpa = VIRTIO_MMIO_BASE - VIRTIO_MMIO_SIZE + addr;
        let width = [1, 2, 3, 4, 8][usize::from(op[0] >> 2) % 5];
        let value = [op[4], op[5], op[6], op[7], op[4], op[5], op[6], op[7]];
        match op[0] % 4 {
            0 => assert_eq!(bus.write(gpa, &value[..width]), held(gpa), "write {gpa:#x}"),
            1 => {
                let mut b = [0x5au8; 8];
                assert_eq!(bus.read(gpa, &mut b[..width]), held(gpa), "read {gpa:#x}");
                if !held(gpa) {
                    assert_eq!(b, [0x5a; 8], "a read nobody holds changed the buffer");
                }
            }
            _ => {
                // The I/O thread: a queue's ioeventfd (or a backend's fd) fired.
                let (_, _, queues, transport) = &slots[usize::from(op[1]) % slots.len()];
                let queue = usize::from(op[2]) % (queues + 1);
                transport.lock().expect("transport").notify(queue);
            }
        }
    }
    for (_, _, queues, transport) in &slots {
        for q in 0..*queues {
            transport.lock().expect("transport").notify(q);
        }
    }
    for (base, kind, ..) in &slots {
        assert_eq!(
            read32(&bus, base + u64::from(VIRTIO_MMIO_MAGIC_VALUE)),
            MMIO_MAGIC
        );
        assert_eq!(
            read32(&bus, base + u64::from(VIRTIO_MMIO_VERSION)),
            MMIO_VERSION
        );
        assert_eq!(read32(&bus, base + u64::from(VIRTIO_MMIO_DEVICE_ID)), *kind);
    }
    drop(slots);
    drop(bus);
    drop(mem);
    check_canaries();
});
