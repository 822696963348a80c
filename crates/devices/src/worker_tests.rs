#![allow(clippy::cast_possible_truncation)] // test data: small known values

use std::fs::File;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixDatagram;
use std::sync::{Arc, Mutex};

use vm_memory::{Bytes, GuestAddress};

use super::*;
use crate::interrupt::Interrupt;
use crate::mmio::MmioTransport;
use crate::net::{Net, VNET_HDR_LEN};
use crate::rng::Rng;
use crate::testutil::{activate, memory, wait_for, TestQueue, DATA};

#[test]
fn a_queue_event_is_served_on_the_io_thread() {
    let mem = memory();
    let irq = EventFd::new(EFD_NONBLOCK).unwrap();
    let interrupt = Arc::new(Interrupt::new(irq.try_clone().unwrap()));
    let mut t = MmioTransport::new(Box::new(Rng::new()), mem.clone(), interrupt).unwrap();
    let mut q = TestQueue::new(&mem, 0, 16);
    activate(&mut t, &[(0, &q, 16)]);
    let t = Arc::new(Mutex::new(t));
    let kick = EventFd::new(EFD_NONBLOCK).unwrap();
    let source = IoSource::QueueEvent {
        transport: t.clone(),
        queue: 0,
        event: kick.try_clone().unwrap(),
    };
    let io = IoThread::spawn("vmhost-io-test", vec![source]).unwrap();
    assert_eq!(io.thread().unwrap().name(), Some("vmhost-io-test"));
    q.post(&[(DATA, 32, true)]);
    kick.write(1).unwrap();
    assert!(
        wait_for(|| q.used_idx() == 1),
        "the I/O thread used the buffer"
    );
    assert!(wait_for(|| irq.read().is_ok()), "and raised the interrupt");
    io.stop().unwrap();
}

#[test]
fn a_readable_backend_delivers_a_frame_and_stop_joins() {
    let mem = memory();
    let (a, peer) = UnixDatagram::pair().unwrap();
    a.set_nonblocking(true).unwrap();
    let net = Net::new(File::from(OwnedFd::from(a)), [2, 0, 0, 0, 0, 1]);
    let fd = net.backend().as_raw_fd();
    let interrupt = Arc::new(Interrupt::new(EventFd::new(EFD_NONBLOCK).unwrap()));
    let mut t = MmioTransport::new(Box::new(net), mem.clone(), interrupt).unwrap();
    let mut rx = TestQueue::new(&mem, 0, 16);
    let tx = TestQueue::new(&mem, 0x8000, 16);
    activate(&mut t, &[(0, &rx, 16), (1, &tx, 16)]);
    let t = Arc::new(Mutex::new(t));
    rx.post(&[(DATA, 2048, true)]);
    let io = IoThread::spawn(
        "vmhost-io-net",
        vec![IoSource::Backend {
            transport: t.clone(),
            queue: 0,
            fd,
        }],
    )
    .unwrap();
    let mut frame = vec![0u8; VNET_HDR_LEN];
    frame.extend_from_slice(b"an ethernet frame, more or less");
    peer.send(&frame).unwrap();
    assert!(wait_for(|| rx.used_idx() == 1), "the frame was delivered");
    let mut got = vec![0u8; frame.len()];
    mem.read_slice(&mut got, GuestAddress(DATA)).unwrap();
    assert_eq!(got[VNET_HDR_LEN..], frame[VNET_HDR_LEN..]);
    drop(io);
    assert_eq!(
        Arc::strong_count(&t),
        1,
        "the thread is gone and released the transport"
    );
}

/// A virtio-blk request: (type, sector), data to write, bytes to read.
type BlkRequest<'a> = ((u32, u64), Option<&'a [u8]>, u32);

/// One virtio-blk request (header, data, status) at `base`; returns the status byte's address.
fn post_blk(
    mem: &vm_memory::GuestMemoryMmap,
    q: &mut TestQueue<'_>,
    base: u64,
    (kind, sector): (u32, u64),
    data: Option<&[u8]>,
    read_len: u32,
) -> u64 {
    let mut h = [0u8; 16];
    h[..4].copy_from_slice(&kind.to_le_bytes());
    h[8..].copy_from_slice(&sector.to_le_bytes());
    mem.write_slice(&h, GuestAddress(base)).unwrap();
    let (buf, status) = (base + 0x1000, base + 0x2000);
    mem.write_obj(0xeeu8, GuestAddress(status)).unwrap();
    let mut bufs = vec![(base, 16, false)];
    match data {
        Some(d) => {
            mem.write_slice(d, GuestAddress(buf)).unwrap();
            bufs.push((buf, d.len() as u32, false));
        }
        None if read_len > 0 => bufs.push((buf, read_len, true)),
        None => {}
    }
    bufs.push((status, 1, true));
    q.post(&bufs);
    status
}

/// A disk's writes, flushes and reads are served on the I/O thread, under its syscall filter
/// (`pwrite64`, `fdatasync`, `pread64`; a call the filter lacks kills this test binary with
/// SIGSYS and names it), in both cache modes.
#[test]
fn disk_requests_are_served_on_the_io_thread_under_its_filter() {
    use crate::block::{Block, BlockConfig};
    use crate::disk::CacheMode;
    use virtio_bindings::virtio_blk::{VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT};
    for cache in [CacheMode::Writeback, CacheMode::None] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disk.img");
        std::fs::write(&path, vec![0u8; 64 << 10]).unwrap();
        let blk = Block::new(&BlockConfig {
            path: path.clone(),
            read_only: false,
            cache,
            serial: "io-test".into(),
        })
        .unwrap();
        let mem = memory();
        let irq = EventFd::new(EFD_NONBLOCK).unwrap();
        let interrupt = Arc::new(Interrupt::new(irq.try_clone().unwrap()));
        let mut t = MmioTransport::new(Box::new(blk), mem.clone(), interrupt).unwrap();
        let mut q = TestQueue::new(&mem, 0, 16);
        activate(&mut t, &[(0, &q, 16)]);
        let kick = EventFd::new(EFD_NONBLOCK).unwrap();
        let source = IoSource::QueueEvent {
            transport: Arc::new(Mutex::new(t)),
            queue: 0,
            event: kick.try_clone().unwrap(),
        };
        let io = IoThread::spawn("vmhost-io", vec![source]).unwrap();
        let pattern: Vec<u8> = (0..4096u32).map(|i| (i * 13 % 251) as u8).collect();
        let requests: [BlkRequest<'_>; 3] = [
            ((VIRTIO_BLK_T_OUT, 8), Some(&pattern), 0),
            ((VIRTIO_BLK_T_FLUSH, 0), None, 0),
            ((VIRTIO_BLK_T_IN, 8), None, 4096),
        ];
        for (i, (head, data, read_len)) in requests.into_iter().enumerate() {
            let base = DATA + (i as u64) * 0x10_000;
            let status = post_blk(&mem, &mut q, base, head, data, read_len);
            kick.write(1).unwrap();
            assert!(
                wait_for(|| q.used_idx() == i as u16 + 1),
                "{cache:?}: request {i} served"
            );
            assert_eq!(mem.read_obj::<u8>(GuestAddress(status)).unwrap(), 0, "OK");
        }
        let mut back = vec![0u8; 4096];
        mem.read_slice(&mut back, GuestAddress(DATA + 0x2_0000 + 0x1000))
            .unwrap();
        assert_eq!(
            back, pattern,
            "{cache:?}: the read returns what was written"
        );
        let file = std::fs::read(&path).unwrap();
        assert_eq!(&file[8 * 512..8 * 512 + 4096], &pattern[..], "{cache:?}");
        io.stop().unwrap();
    }
}
