//! What a guest controls on a virtio-mmio device: every byte of its memory (descriptor tables,
//! available rings, request headers, buffers) and any register access after a normal driver
//! start. The device is a virtio-blk over a scratch image (read-write or read-only), a
//! virtio-rng, a virtio-net over a datagram socket playing the tap (with one frame waiting
//! to be received; mergeable receive buffers negotiated or not), or a virtio-vsock on its Unix socket (guest CID 3). Never a panic, an out-of-bounds access or a hang.
//!
//! Input: `[device, queue size, n_ops, n_ops × (op, a, b, c, d, e), guest memory image...]`.
#![no_main]

use std::fs::File;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixDatagram;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use libfuzzer_sys::fuzz_target;
use virtio_bindings::virtio_config::{VIRTIO_CONFIG_S_DRIVER_OK, VIRTIO_F_VERSION_1};
use virtio_bindings::virtio_mmio::*;
use vm_memory::{Bytes, GuestAddress};
use vmhost_devices::mmio::DRIVER_INIT_SEQUENCE;
use vmhost_devices::{
    Block, BlockConfig, CacheMode, Interrupt, MmioTransport, Net, Rng, VirtioDevice, Vsock,
    MMIO_WINDOW_SIZE,
};
use vmhost_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// Guest RAM: 64 KiB, so that guest-chosen addresses land both inside and outside it.
const MEM: usize = 1 << 16;
/// Queue `q`'s rings: descriptor table, available ring, used ring.
const RINGS: u64 = 0x3000;

/// A 64 KiB scratch image in the temporary directory, shared by every run (its content does
/// not matter).
fn image() -> &'static PathBuf {
    static IMAGE: OnceLock<PathBuf> = OnceLock::new();
    IMAGE.get_or_init(|| {
        let path = std::env::temp_dir().join("vmhost-fuzz-virtio-blk.img");
        let file = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .expect("scratch image");
        file.set_len(64 << 10).expect("scratch image size");
        path
    })
}

fn device(kind: u8) -> Option<(Box<dyn VirtioDevice>, Option<UnixDatagram>)> {
    match kind % 5 {
        0 | 1 => {
            let config = BlockConfig {
                path: image().clone(),
                read_only: kind % 4 == 1,
                cache: CacheMode::Writeback,
                serial: "fuzz".into(),
            };
            Some((Box::new(Block::new(&config).ok()?), None))
        }
        2 => Some((Box::new(Rng::new()), None)),
        3 => {
            let path =
                std::env::temp_dir().join(format!("vmhost-fuzz-{}.vsock", std::process::id()));
            Some((Box::new(Vsock::new(3, &path).ok()?), None))
        }
        _ => {
            let (a, b) = UnixDatagram::pair().ok()?;
            a.set_nonblocking(true).ok()?;
            b.set_nonblocking(true).ok()?;
            let net = Net::new(File::from(OwnedFd::from(a)), [2, 0, 0, 0, 0, 1]);
            Some((Box::new(net), Some(b)))
        }
    }
}

fn write(dev: &mut MmioTransport, reg: u32, value: u32) {
    dev.write(u64::from(reg), &value.to_le_bytes());
}

fn read(dev: &MmioTransport, reg: u32) -> u32 {
    let mut b = [0u8; 4];
    dev.read(u64::from(reg), &mut b);
    u32::from_le_bytes(b)
}

/// What a Linux driver does first: status, every offered feature but those in `declined`
/// (low word), each queue's rings at `q * RINGS` with `size` entries, DRIVER_OK.
fn start(dev: &mut MmioTransport, queues: usize, size: u32, declined: u32) {
    write(dev, VIRTIO_MMIO_STATUS, DRIVER_INIT_SEQUENCE[0]);
    write(dev, VIRTIO_MMIO_STATUS, DRIVER_INIT_SEQUENCE[1]);
    for sel in 0..2 {
        write(dev, VIRTIO_MMIO_DEVICE_FEATURES_SEL, sel);
        let offered = read(dev, VIRTIO_MMIO_DEVICE_FEATURES);
        write(dev, VIRTIO_MMIO_DRIVER_FEATURES_SEL, sel);
        let (version, declined) = if sel == 1 {
            (1 << (VIRTIO_F_VERSION_1 - 32), 0)
        } else {
            (0, declined)
        };
        write(
            dev,
            VIRTIO_MMIO_DRIVER_FEATURES,
            (offered & !declined) | version,
        );
    }
    write(dev, VIRTIO_MMIO_STATUS, DRIVER_INIT_SEQUENCE[2]);
    for q in 0..queues {
        let base = (q as u64) * RINGS;
        write(dev, VIRTIO_MMIO_QUEUE_SEL, q as u32);
        write(dev, VIRTIO_MMIO_QUEUE_NUM, size);
        write(dev, VIRTIO_MMIO_QUEUE_DESC_LOW, base as u32);
        write(dev, VIRTIO_MMIO_QUEUE_AVAIL_LOW, (base + 0x1000) as u32);
        write(dev, VIRTIO_MMIO_QUEUE_USED_LOW, (base + 0x2000) as u32);
        write(dev, VIRTIO_MMIO_QUEUE_READY, 1);
    }
    let status = read(dev, VIRTIO_MMIO_STATUS);
    write(dev, VIRTIO_MMIO_STATUS, status | VIRTIO_CONFIG_S_DRIVER_OK);
}

fuzz_target!(|data: &[u8]| {
    let [kind, size, n_ops, rest @ ..] = data else {
        return;
    };
    let n_ops = usize::from(*n_ops % 32);
    let Some((ops, image)) = rest.split_at_checked(n_ops * 6) else {
        return;
    };
    let Ok(mem) = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM)]) else {
        return;
    };
    let image = &image[..image.len().min(MEM)];
    if mem.write_slice(image, GuestAddress(0)).is_err() {
        return;
    }
    let Some((device, peer)) = device(*kind) else {
        return;
    };
    if let Some(peer) = &peer {
        // A frame from the "tap" for the receive queue: the image's tail, any length.
        let _ = peer.send(&image[image.len() / 2..]);
    }
    let queues = device.queue_max_sizes().len();
    let Ok(irq) = EventFd::new(EFD_NONBLOCK) else {
        return;
    };
    let interrupt = Arc::new(Interrupt::new(irq));
    let Ok(mut dev) = MmioTransport::new(device, mem, interrupt) else {
        return;
    };
    // Powers of two up to 512 (above every device's maximum) or odd sizes the device refuses.
    let size = if size & 0x80 == 0 {
        1 << (size % 10)
    } else {
        u32::from(size & 0x7f) * 2 + 1
    };
    // The high bit of the device byte: the driver declines VIRTIO_NET_F_MRG_RXBUF (bit 15), so
    // a NIC's single-chain receive is exercised as well as its mergeable one.
    let declined = if kind & 0x80 != 0 { 1 << 15 } else { 0 };
    start(&mut dev, queues, size, declined);
    for op in ops.chunks_exact(6) {
        let offset = u64::from(u16::from_le_bytes([op[1], op[2]])) % MMIO_WINDOW_SIZE;
        let value = [op[3], op[4], op[5], 0];
        match op[0] % 4 {
            0 => dev.write(offset, &value[..usize::from(op[0] / 4 % 4) + 1]),
            1 => {
                let mut b = [0u8; 4];
                dev.read(offset, &mut b[..usize::from(op[0] / 4 % 4) + 1]);
            }
            _ => dev.notify(usize::from(op[1]) % (queues + 1)),
        }
    }
    // Then every queue once, as a driver kicking after posting its buffers.
    for q in 0..queues {
        dev.notify(q);
    }
});
