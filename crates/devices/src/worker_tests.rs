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
