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

/// A NIC on one end of a datagram pair, behind a transport: (memory, transport, backend fd,
/// the other end playing the tap).
fn net_rig() -> (
    vmhost_memory::GuestMemoryMmap,
    MmioTransport,
    std::os::fd::RawFd,
    UnixDatagram,
) {
    let mem = memory();
    let (a, peer) = UnixDatagram::pair().unwrap();
    a.set_nonblocking(true).unwrap();
    let net = Net::new(File::from(OwnedFd::from(a)), [2, 0, 0, 0, 0, 1]);
    let fd = net.backend().as_raw_fd();
    let interrupt = Arc::new(Interrupt::new(EventFd::new(EFD_NONBLOCK).unwrap()));
    let t = MmioTransport::new(Box::new(net), mem.clone(), interrupt).unwrap();
    (mem, t, fd, peer)
}

#[test]
fn a_readable_backend_delivers_a_frame_and_stop_joins() {
    let (mem, mut t, fd, peer) = net_rig();
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

/// On the I/O thread, under its filter (`readv`, `writev`): a frame that arrives before any
/// receive buffer stays in the backend and is delivered when the guest posts one and notifies
/// queue 0; a transmit chain goes out whole.
#[test]
fn net_receive_resumes_when_the_guest_posts_buffers_and_transmit_works_on_the_io_thread() {
    let (mem, mut t, fd, peer) = net_rig();
    let mut rx = TestQueue::new(&mem, 0, 16);
    let mut tx = TestQueue::new(&mem, 0x8000, 16);
    activate(&mut t, &[(0, &rx, 16), (1, &tx, 16)]);
    let t = Arc::new(Mutex::new(t));
    let kick_rx = EventFd::new(EFD_NONBLOCK).unwrap();
    let kick_tx = EventFd::new(EFD_NONBLOCK).unwrap();
    let io = IoThread::spawn(
        "vmhost-io-net2",
        vec![
            IoSource::Backend {
                transport: t.clone(),
                queue: 0,
                fd,
            },
            IoSource::QueueEvent {
                transport: t.clone(),
                queue: 0,
                event: kick_rx.try_clone().unwrap(),
            },
            IoSource::QueueEvent {
                transport: t.clone(),
                queue: 1,
                event: kick_tx.try_clone().unwrap(),
            },
        ],
    )
    .unwrap();
    let mut frame = vec![0u8; VNET_HDR_LEN];
    frame.extend_from_slice(b"sent before the guest had a receive buffer");
    peer.send(&frame).unwrap();
    // The backend's readable edge comes and goes with no buffer to read into.
    std::thread::sleep(std::time::Duration::from_millis(50));
    assert_eq!(rx.used_idx(), 0);
    rx.post(&[(DATA, 16, true), (DATA + 0x1000, 2048, true)]);
    kick_rx.write(1).unwrap();
    assert!(wait_for(|| rx.used_idx() == 1), "delivered once posted");
    assert_eq!(rx.used(0).1 as usize, frame.len());
    let mut got = vec![0u8; frame.len() - 16];
    mem.read_slice(&mut got, GuestAddress(DATA + 0x1000))
        .unwrap();
    assert_eq!(got, frame[16..]);

    let out: Vec<u8> = (0..1500u32).map(|i| (i % 253) as u8).collect();
    mem.write_slice(&out[..VNET_HDR_LEN], GuestAddress(DATA + 0x4000))
        .unwrap();
    mem.write_slice(&out[VNET_HDR_LEN..], GuestAddress(DATA + 0x5000))
        .unwrap();
    tx.post(&[
        (DATA + 0x4000, VNET_HDR_LEN as u32, false),
        (DATA + 0x5000, 1500 - VNET_HDR_LEN as u32, false),
    ]);
    kick_tx.write(1).unwrap();
    assert!(wait_for(|| tx.used_idx() == 1), "transmitted");
    let mut sent = vec![0u8; 4096];
    let n = peer.recv(&mut sent).unwrap();
    assert_eq!(sent[..n], out[..]);
    io.stop().unwrap();
}

/// A virtio-blk request: (type, sector), data to write, bytes to read.
type BlkRequest<'a> = ((u32, u64), Option<&'a [u8]>, u32);

/// One virtio-blk request (header, data, status) at `base`; returns the status byte's address.
fn post_blk(
    mem: &vmhost_memory::GuestMemoryMmap,
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
/// (`pwritev`, `fdatasync`, `preadv`, and `pwrite64`/`pread64` for the O_DIRECT bounce path;
/// a call the filter lacks kills this test binary with SIGSYS and names it), in both cache
/// modes.
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
        // The last two at a buffer that is not page aligned: with O_DIRECT, the bounce path.
        let requests: [BlkRequest<'_>; 5] = [
            ((VIRTIO_BLK_T_OUT, 8), Some(&pattern), 0),
            ((VIRTIO_BLK_T_FLUSH, 0), None, 0),
            ((VIRTIO_BLK_T_IN, 8), None, 4096),
            ((VIRTIO_BLK_T_OUT, 40), Some(&pattern[..1024]), 0),
            ((VIRTIO_BLK_T_IN, 8), None, 1024),
        ];
        for (i, (head, data, read_len)) in requests.into_iter().enumerate() {
            let base = DATA + (i as u64) * 0x10_000 + if i >= 3 { 0x200 } else { 0 };
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
        mem.read_slice(&mut back[..1024], GuestAddress(DATA + 0x4_0000 + 0x1200))
            .unwrap();
        assert_eq!(back[..1024], pattern[..1024], "{cache:?}: the bounced read");
        let file = std::fs::read(&path).unwrap();
        assert_eq!(&file[8 * 512..8 * 512 + 4096], &pattern[..], "{cache:?}");
        assert_eq!(
            &file[40 * 512..41 * 512 + 512],
            &pattern[..1024],
            "{cache:?}"
        );
        io.stop().unwrap();
    }
}

/// A device whose request does not return until the test lets it: storage that hangs (a
/// `pwritev` to a suspended device-mapper table) as the I/O thread sees it. It says when a
/// request has started and holds the transport's lock, as a real request does, meanwhile.
struct Stalled {
    started: std::sync::mpsc::Sender<()>,
    release: std::sync::mpsc::Receiver<()>,
    sizes: [u16; 1],
}

impl crate::device::VirtioDevice for Stalled {
    fn device_type(&self) -> u32 {
        virtio_bindings::virtio_ids::VIRTIO_ID_BLOCK
    }
    fn queue_max_sizes(&self) -> &[u16] {
        &self.sizes
    }
    fn features(&self) -> u64 {
        0
    }
    fn config(&self) -> Vec<u8> {
        Vec::new()
    }
    fn process_queue(
        &mut self,
        _index: usize,
        _queue: &mut virtio_queue::Queue,
        _mem: &vmhost_memory::GuestMemoryMmap,
    ) -> Result<bool, crate::device::DeviceError> {
        let _ = self.started.send(());
        let _ = self.release.recv();
        Ok(false)
    }
}

/// With the I/O thread stuck in a device request (holding the transport): a vCPU's register
/// access gives up once the VM's stop flag is set instead of waiting for the lock, and stopping
/// the thread returns `Hung` instead of joining it; the thread lets the transport go when its
/// request returns.
#[test]
fn a_hung_request_blocks_neither_the_bus_nor_the_stop() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    use crate::bus::{Access, MmioBus};

    let mem = memory();
    let (started_tx, started) = std::sync::mpsc::channel();
    let (release, release_rx) = std::sync::mpsc::channel();
    let device = Stalled {
        started: started_tx,
        release: release_rx,
        sizes: [16],
    };
    let interrupt = Arc::new(Interrupt::new(EventFd::new(EFD_NONBLOCK).unwrap()));
    let mut t = MmioTransport::new(Box::new(device), mem.clone(), interrupt).unwrap();
    let q = TestQueue::new(&mem, 0, 16);
    activate(&mut t, &[(0, &q, 16)]);
    let t = Arc::new(Mutex::new(t));
    let mut bus = MmioBus::default();
    bus.insert(0xd000_0000, t.clone()).unwrap();
    let kick = EventFd::new(EFD_NONBLOCK).unwrap();
    let source = IoSource::QueueEvent {
        transport: t.clone(),
        queue: 0,
        event: kick.try_clone().unwrap(),
    };
    let io = IoThread::spawn("vmhost-io-hung", vec![source]).unwrap();
    kick.write(1).unwrap();
    started
        .recv_timeout(Duration::from_secs(10))
        .expect("the I/O thread entered the request");

    // A vCPU reads the Status register (behind the transport's lock) and the VM is stopped.
    let stop = Arc::new(AtomicBool::new(false));
    let (done_tx, done) = std::sync::mpsc::channel();
    let vcpu = {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            let mut b = [0u8; 4];
            let got = bus.read_or_give_up(0xd000_0070, &mut b, &|| stop.load(Ordering::SeqCst));
            done_tx.send(got).unwrap();
        })
    };
    stop.store(true, Ordering::SeqCst);
    let got = done.recv_timeout(Duration::from_secs(10));
    // The stop does not wait for the request either; it names the thread.
    let (stopped_tx, stopped) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = stopped_tx.send(io.stop_within(Duration::from_millis(100)));
    });
    let result = stopped.recv_timeout(Duration::from_secs(10));
    // The storage answers (before any assertion, so that a failure does not hang the test).
    release.send(()).unwrap();
    vcpu.join().unwrap();
    assert_eq!(
        got,
        Ok(Access::GaveUp),
        "the register read gave up on the stop instead of waiting for the hung request"
    );
    match result {
        Ok(Err(WorkerError::Hung { ref name, .. })) => assert_eq!(name, "vmhost-io-hung"),
        other => panic!("stopping the I/O thread in a hung request gave {other:?}"),
    }
    // The thread finished the request, ended and let the transport go.
    assert!(
        wait_for(|| Arc::strong_count(&t) == 1),
        "the left-behind I/O thread ended once its request returned"
    );
}

/// A pause completes the request the guest notified before it (used when `pause` returns),
/// parks the thread, and a notification while parked is served by the next drain after the
/// resume; a parked thread stops.
#[test]
fn a_pause_completes_notified_requests_and_parks_until_resumed() {
    let mem = memory();
    let interrupt = Arc::new(Interrupt::new(EventFd::new(EFD_NONBLOCK).unwrap()));
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
    let io = IoThread::spawn("vmhost-io-pause", vec![source]).unwrap();
    q.post(&[(DATA, 32, true)]);
    kick.write(1).unwrap();
    io.pause(STOP_WAIT).unwrap();
    assert!(io.is_paused());
    assert_eq!(
        q.used_idx(),
        1,
        "the notified request completed before the pause"
    );
    io.pause(STOP_WAIT).unwrap();
    assert!(io.is_paused(), "pausing a parked thread leaves it parked");
    q.post(&[(DATA + 0x1000, 32, true)]);
    kick.write(1).unwrap();
    // The transport is free (the thread is parked, not in a request) and nothing served it.
    drop(t.try_lock().expect("a parked thread holds no transport"));
    assert_eq!(q.used_idx(), 1);
    io.resume();
    io.pause(STOP_WAIT).unwrap();
    assert_eq!(
        q.used_idx(),
        2,
        "served after the resume, at the latest by the drain"
    );
    io.stop().unwrap();
}

/// A pause while the thread is stuck in a request reports `Hung` after its wait, naming the
/// thread; the pause stays asked for, so once the request returns the thread parks.
#[test]
fn a_pause_during_a_hung_request_is_reported_and_takes_effect_later() {
    use std::time::Duration;

    let mem = memory();
    let (started_tx, started) = std::sync::mpsc::channel();
    let (release, release_rx) = std::sync::mpsc::channel();
    let device = Stalled {
        started: started_tx,
        release: release_rx,
        sizes: [16],
    };
    let interrupt = Arc::new(Interrupt::new(EventFd::new(EFD_NONBLOCK).unwrap()));
    let mut t = MmioTransport::new(Box::new(device), mem.clone(), interrupt).unwrap();
    let q = TestQueue::new(&mem, 0, 16);
    activate(&mut t, &[(0, &q, 16)]);
    let t = Arc::new(Mutex::new(t));
    let kick = EventFd::new(EFD_NONBLOCK).unwrap();
    let source = IoSource::QueueEvent {
        transport: t.clone(),
        queue: 0,
        event: kick.try_clone().unwrap(),
    };
    let io = IoThread::spawn("vmhost-io-slow", vec![source]).unwrap();
    kick.write(1).unwrap();
    started
        .recv_timeout(Duration::from_secs(10))
        .expect("the I/O thread entered the request");
    let result = io.pause(Duration::from_millis(50));
    release.send(()).unwrap();
    match result {
        Err(WorkerError::Hung { ref name, .. }) => assert_eq!(name, "vmhost-io-slow"),
        other => panic!("pausing a thread in a hung request gave {other:?}"),
    }
    io.pause(Duration::from_secs(10)).unwrap();
    assert!(io.is_paused());
    io.stop().unwrap();
}
