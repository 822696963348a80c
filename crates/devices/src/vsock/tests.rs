#![allow(clippy::cast_possible_truncation)] // test data: small known values
use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;

use vm_memory::{Bytes, GuestAddress};

use super::conn::CONN_BUF_ALLOC;
use super::packet::{Op, HOST_CID, SHUTDOWN_BOTH, SHUTDOWN_SEND, TYPE_STREAM};
use super::*;
use crate::testutil::{memory, TestQueue, DATA};
use backend::MAX_CONNECTIONS;

const CID: u64 = 3;

/// A named chain: what is wrong with it, its buffers.
type Case = (&'static str, &'static [crate::testutil::Buf]);
/// Breaks a header.
type Corrupt = fn(&mut Header);
const RX_BUF: u32 = 4096;

/// The guest driver's side: receive and transmit queues over test memory, buffers handed out
/// from DATA upwards.
struct Guest<'a> {
    mem: &'a GuestMemoryMmap,
    rxq: TestQueue<'a>,
    txq: TestQueue<'a>,
    rx: Queue,
    tx: Queue,
    next_addr: u64,
    rx_descs: u32,
    rx_addr: HashMap<u32, u64>,
    rx_seen: u16,
}

impl<'a> Guest<'a> {
    fn new(mem: &'a GuestMemoryMmap) -> Self {
        let rxq = TestQueue::new(mem, 0, 256);
        let txq = TestQueue::new(mem, 0x1_0000, 256);
        let (rx, tx) = (rxq.queue(), txq.queue());
        Guest {
            mem,
            rxq,
            txq,
            rx,
            tx,
            next_addr: DATA,
            rx_descs: 0,
            rx_addr: HashMap::new(),
            rx_seen: 0,
        }
    }

    fn alloc(&mut self, len: u32) -> u64 {
        let a = self.next_addr;
        self.next_addr += u64::from(len).next_multiple_of(64);
        assert!(self.next_addr < (16 << 20), "test memory exhausted");
        a
    }

    fn post_rx(&mut self, n: usize) {
        for _ in 0..n {
            let a = self.alloc(HDR_LEN as u32 + RX_BUF);
            self.rxq.post(&[(a, HDR_LEN as u32 + RX_BUF, true)]);
            self.rx_addr.insert(self.rx_descs, a);
            self.rx_descs += 1;
        }
    }

    /// Sends one packet (header and payload in two descriptors, like Linux).
    fn send(&mut self, dev: &mut Vsock, hdr: Header, payload: &[u8]) {
        let h = self.alloc(HDR_LEN as u32);
        self.mem
            .write_slice(&hdr.to_bytes(), GuestAddress(h))
            .unwrap();
        if payload.is_empty() {
            self.txq.post(&[(h, HDR_LEN as u32, false)]);
        } else {
            let p = self.alloc(payload.len() as u32);
            self.mem.write_slice(payload, GuestAddress(p)).unwrap();
            self.txq
                .post(&[(h, HDR_LEN as u32, false), (p, payload.len() as u32, false)]);
        }
        assert!(dev.process_queue(TX, &mut self.tx, self.mem).unwrap());
    }

    /// Runs the receive queue and returns the packets delivered since the last call.
    fn recv(&mut self, dev: &mut Vsock) -> Vec<(Header, Vec<u8>)> {
        dev.process_queue(RX, &mut self.rx, self.mem).unwrap();
        let mut out = Vec::new();
        while self.rx_seen != self.rxq.used_idx() {
            let (id, len) = self.rxq.used(self.rx_seen % 256);
            let addr = self.rx_addr[&id];
            let mut raw = [0u8; HDR_LEN];
            self.mem.read_slice(&mut raw, GuestAddress(addr)).unwrap();
            let hdr = Header::from_bytes(&raw);
            let mut payload = vec![0u8; len as usize - HDR_LEN];
            self.mem
                .read_slice(&mut payload, GuestAddress(addr + HDR))
                .unwrap();
            assert_eq!(
                hdr.len as usize,
                payload.len(),
                "used length = header + len"
            );
            out.push((hdr, payload));
            self.rx_seen = self.rx_seen.wrapping_add(1);
        }
        out
    }
}

fn hdr(op: Op, src_port: u32, dst_port: u32, len: u32) -> Header {
    Header {
        src_cid: CID,
        dst_cid: HOST_CID,
        src_port,
        dst_port,
        len,
        kind: TYPE_STREAM,
        op: op as u16,
        flags: 0,
        buf_alloc: 1 << 20,
        fwd_cnt: 0,
    }
}

fn device() -> (Vsock, tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("vm.vsock");
    (Vsock::new(CID, &path).unwrap(), dir, path)
}

fn op(h: &Header) -> Option<Op> {
    Op::from_wire(h.op)
}

/// A host connection through `CONNECT 52`, accepted by the guest: (stream, host port).
fn host_connection(
    dev: &mut Vsock,
    g: &mut Guest<'_>,
    path: &std::path::Path,
) -> (UnixStream, u32) {
    let mut host = UnixStream::connect(path).unwrap();
    host.write_all(b"CONNECT 52\n").unwrap();
    g.post_rx(8);
    let got = g.recv(dev);
    assert_eq!(got.len(), 1, "one REQUEST");
    let req = got[0].0;
    assert_eq!(op(&req), Some(Op::Request));
    assert_eq!(
        (req.src_cid, req.dst_cid, req.dst_port),
        (HOST_CID, CID, 52)
    );
    assert!(req.src_port >= 1 << 30, "host ports start at 2^30");
    g.send(dev, hdr(Op::Response, 52, req.src_port, 0), &[]);
    let mut line = [0u8; 64];
    let n = host.read(&mut line).unwrap();
    assert_eq!(
        std::str::from_utf8(&line[..n]).unwrap(),
        format!("OK {}\n", req.src_port)
    );
    (host, req.src_port)
}

#[test]
fn config_space_is_the_cid_and_queues_are_rx_tx_event() {
    let (dev, _dir, path) = device();
    assert_eq!(dev.device_type(), 19);
    assert_eq!(dev.config(), 3u64.to_le_bytes());
    assert_eq!(dev.queue_max_sizes(), [256, 256, 256]);
    assert!(path.exists(), "the socket is listening");
}

#[test]
fn host_connects_with_connect_line_and_bytes_flow_both_ways() {
    let (mut dev, _dir, path) = device();
    let mem = memory();
    let mut g = Guest::new(&mem);
    let (mut host, port) = host_connection(&mut dev, &mut g, &path);
    host.write_all(b"ping from the host").unwrap();
    let got = g.recv(&mut dev);
    assert_eq!(got.len(), 1);
    assert_eq!(op(&got[0].0), Some(Op::Rw));
    assert_eq!((got[0].0.src_port, got[0].0.dst_port), (port, 52));
    assert_eq!(got[0].1, b"ping from the host");
    g.send(&mut dev, hdr(Op::Rw, 52, port, 4), b"pong");
    let mut back = [0u8; 4];
    host.read_exact(&mut back).unwrap();
    assert_eq!(&back, b"pong");
}

#[test]
fn bytes_sent_right_after_the_connect_line_are_kept_for_the_guest() {
    let (mut dev, _dir, path) = device();
    let mem = memory();
    let mut g = Guest::new(&mem);
    let mut host = UnixStream::connect(&path).unwrap();
    host.write_all(b"CONNECT 52\nearly bytes").unwrap();
    g.post_rx(4);
    let req = g.recv(&mut dev)[0].0;
    g.send(&mut dev, hdr(Op::Response, 52, req.src_port, 0), &[]);
    let got = g.recv(&mut dev);
    assert_eq!(got[0].1, b"early bytes");
}

#[test]
fn a_guest_rst_to_a_host_connect_closes_the_host_stream() {
    let (mut dev, _dir, path) = device();
    let mem = memory();
    let mut g = Guest::new(&mem);
    let mut host = UnixStream::connect(&path).unwrap();
    host.write_all(b"CONNECT 99\n").unwrap();
    g.post_rx(4);
    let req = g.recv(&mut dev)[0].0;
    g.send(&mut dev, hdr(Op::Rst, 99, req.src_port, 0), &[]);
    let mut buf = [0u8; 8];
    assert_eq!(host.read(&mut buf).unwrap(), 0, "EOF, no OK line");
    assert_eq!(dev.backend().connections(), 0);
}

#[test]
fn a_malformed_connect_line_closes_the_host_stream() {
    let (mut dev, _dir, path) = device();
    let mem = memory();
    let mut g = Guest::new(&mem);
    let mut host = UnixStream::connect(&path).unwrap();
    host.write_all(b"HELLO 52\n").unwrap();
    g.post_rx(2);
    assert!(g.recv(&mut dev).is_empty(), "no REQUEST for the guest");
    let mut buf = [0u8; 8];
    assert_eq!(host.read(&mut buf).unwrap(), 0);
}

#[test]
fn guest_connects_to_the_host_listener_at_path_underscore_port() {
    let (mut dev, _dir, path) = device();
    let listener = UnixListener::bind(format!("{}_6000", path.display())).unwrap();
    let mem = memory();
    let mut g = Guest::new(&mem);
    g.post_rx(4);
    g.send(&mut dev, hdr(Op::Request, 40000, 6000, 0), &[]);
    let got = g.recv(&mut dev);
    assert_eq!(op(&got[0].0), Some(Op::Response));
    assert_eq!((got[0].0.src_port, got[0].0.dst_port), (6000, 40000));
    let (mut peer, _) = listener.accept().unwrap();
    g.send(&mut dev, hdr(Op::Rw, 40000, 6000, 5), b"hello");
    let mut buf = [0u8; 5];
    peer.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"hello");
    peer.write_all(b"back").unwrap();
    let got = g.recv(&mut dev);
    assert_eq!(
        (op(&got[0].0), got[0].1.as_slice()),
        (Some(Op::Rw), &b"back"[..])
    );
}

#[test]
fn guest_connect_without_a_host_listener_is_refused_with_rst() {
    let (mut dev, _dir, _path) = device();
    let mem = memory();
    let mut g = Guest::new(&mem);
    g.post_rx(2);
    g.send(&mut dev, hdr(Op::Request, 40000, 7000, 0), &[]);
    let got = g.recv(&mut dev);
    assert_eq!(op(&got[0].0), Some(Op::Rst));
    assert_eq!((got[0].0.src_port, got[0].0.dst_port), (7000, 40000));
}

#[test]
fn data_to_the_guest_stops_at_its_credit_and_asks_for_more() {
    let (mut dev, _dir, path) = device();
    let mem = memory();
    let mut g = Guest::new(&mem);
    let mut host = UnixStream::connect(&path).unwrap();
    host.write_all(b"CONNECT 52\n").unwrap();
    g.post_rx(8);
    let req = g.recv(&mut dev)[0].0;
    let mut resp = hdr(Op::Response, 52, req.src_port, 0);
    resp.buf_alloc = 10;
    g.send(&mut dev, resp, &[]);
    let mut line = [0u8; 32];
    let _ = host.read(&mut line).unwrap();
    host.write_all(&[7u8; 25]).unwrap();
    let got = g.recv(&mut dev);
    let ops: Vec<_> = got.iter().map(|(h, p)| (op(h), p.len())).collect();
    assert_eq!(
        ops,
        [(Some(Op::Rw), 10), (Some(Op::CreditRequest), 0)],
        "10 bytes of credit, then one request"
    );
    let mut upd = hdr(Op::CreditUpdate, 52, req.src_port, 0);
    upd.buf_alloc = 10;
    upd.fwd_cnt = 10;
    g.send(&mut dev, upd, &[]);
    let got = g.recv(&mut dev);
    assert_eq!((op(&got[0].0), got[0].1.len()), (Some(Op::Rw), 10));
}

#[test]
fn credit_request_gets_a_credit_update_with_buf_alloc_and_fwd_cnt() {
    let (mut dev, _dir, path) = device();
    let mem = memory();
    let mut g = Guest::new(&mem);
    let (mut host, port) = host_connection(&mut dev, &mut g, &path);
    g.send(&mut dev, hdr(Op::Rw, 52, port, 3), b"abc");
    let mut buf = [0u8; 3];
    host.read_exact(&mut buf).unwrap();
    g.send(&mut dev, hdr(Op::CreditRequest, 52, port, 0), &[]);
    let got = g.recv(&mut dev);
    assert_eq!(op(&got[0].0), Some(Op::CreditUpdate));
    assert_eq!((got[0].0.buf_alloc, got[0].0.fwd_cnt), (CONN_BUF_ALLOC, 3));
}

#[test]
fn a_guest_sending_past_its_credit_is_reset() {
    let (mut dev, _dir, path) = device();
    let mem = memory();
    let mut g = Guest::new(&mem);
    let (mut host, port) = host_connection(&mut dev, &mut g, &path);
    // The host reads nothing: its socket buffer fills (at most wmem_default bytes), then the
    // connection's 256 KiB. Enough 64 KiB packets for both, in rounds of fresh rings.
    let wmem: usize = std::fs::read_to_string("/proc/sys/net/core/wmem_default")
        .ok()
        .and_then(|t| t.trim().parse().ok())
        .unwrap_or(1 << 20);
    let packets = (wmem + CONN_BUF_ALLOC as usize) / MAX_PAYLOAD as usize + 4;
    let chunk = vec![1u8; MAX_PAYLOAD as usize];
    let mut reset = false;
    'rounds: for _ in 0..packets.div_ceil(16) {
        let mut g = Guest::new(&mem);
        for _ in 0..16 {
            g.post_rx(2);
            g.send(&mut dev, hdr(Op::Rw, 52, port, MAX_PAYLOAD), &chunk);
            if g.recv(&mut dev).iter().any(|(h, _)| op(h) == Some(Op::Rst)) {
                reset = true;
                break 'rounds;
            }
        }
    }
    assert!(
        reset,
        "RST once the guest outran its credit ({packets} packets sent)"
    );
    assert_eq!(dev.backend().connections(), 0);
    // Blocking, bounded: another test of this process that spawns a command at this moment
    // holds a copy of the device's end (fork before exec) until its exec, so the EOF can
    // come a moment after the connection is gone.
    host.set_read_timeout(Some(std::time::Duration::from_secs(30)))
        .unwrap();
    let mut sink = vec![0u8; 1 << 20];
    let mut total = 0;
    loop {
        match host.read(&mut sink) {
            Ok(0) => break,
            Ok(n) => total += n,
            Err(e) => panic!("the stream ends with EOF after the reset, got {e}"),
        }
    }
    assert!(total > 0, "the bytes within credit arrived first");
}

#[test]
fn host_close_sends_shutdown_and_guest_shutdown_closes_the_host_stream() {
    let (mut dev, _dir, path) = device();
    let mem = memory();
    let mut g = Guest::new(&mem);
    let (host, port) = host_connection(&mut dev, &mut g, &path);
    drop(host);
    let got = g.recv(&mut dev);
    assert_eq!(op(&got[0].0), Some(Op::Shutdown));
    assert_eq!(got[0].0.flags, SHUTDOWN_SEND, "the host sends no more");
    // The guest's data has nowhere to go: RST.
    g.send(&mut dev, hdr(Op::Rw, 52, port, 2), b"hi");
    let got = g.recv(&mut dev);
    assert_eq!(op(&got[0].0), Some(Op::Rst));
    assert_eq!(dev.backend().connections(), 0);

    let (mut host, port) = host_connection(&mut dev, &mut g, &path);
    let mut shut = hdr(Op::Shutdown, 52, port, 0);
    shut.flags = SHUTDOWN_BOTH;
    g.send(&mut dev, shut, &[]);
    let got = g.recv(&mut dev);
    assert_eq!(op(&got[0].0), Some(Op::Rst), "the device ends it");
    let mut buf = [0u8; 4];
    assert_eq!(host.read(&mut buf).unwrap(), 0);
}

#[test]
fn a_host_half_close_still_carries_the_guest_reply() {
    let (mut dev, _dir, path) = device();
    let mem = memory();
    let mut g = Guest::new(&mem);
    let (mut host, port) = host_connection(&mut dev, &mut g, &path);
    host.write_all(b"request").unwrap();
    host.shutdown(std::net::Shutdown::Write).unwrap();
    let got = g.recv(&mut dev);
    let ops: Vec<_> = got.iter().map(|(h, _)| (op(h), h.flags)).collect();
    assert_eq!(
        ops,
        [(Some(Op::Rw), 0), (Some(Op::Shutdown), SHUTDOWN_SEND)]
    );
    g.send(&mut dev, hdr(Op::Rw, 52, port, 5), b"reply");
    let mut shut = hdr(Op::Shutdown, 52, port, 0);
    shut.flags = SHUTDOWN_BOTH;
    g.send(&mut dev, shut, &[]);
    let mut all = Vec::new();
    host.read_to_end(&mut all).unwrap();
    assert_eq!(all, b"reply", "the reply, then EOF");
    assert_eq!(op(&g.recv(&mut dev)[0].0), Some(Op::Rst));
}

#[test]
fn malformed_packets_reset_their_connection_and_the_device_keeps_working() {
    let (mut dev, _dir, path) = device();
    let mem = memory();
    let mut g = Guest::new(&mem);
    let (mut host, port) = host_connection(&mut dev, &mut g, &path);
    let mut bad = hdr(Op::Rw, 52, port, 0);
    bad.op = 42;
    g.send(&mut dev, bad, &[]);
    let got = g.recv(&mut dev);
    assert_eq!(op(&got[0].0), Some(Op::Rst), "unknown op");
    let mut buf = [0u8; 4];
    assert_eq!(host.read(&mut buf).unwrap(), 0, "host stream closed");

    let cases: [(&str, Corrupt); 3] = [
        ("wrong type", |h| h.kind = 2),
        ("length beyond the chain", |h| h.len = 100),
        ("payload on a control packet", |h| {
            h.op = Op::CreditUpdate as u16
        }),
    ];
    for (what, corrupt) in cases {
        let (_host, port) = host_connection(&mut dev, &mut g, &path);
        let mut h = hdr(Op::Rw, 52, port, 4);
        corrupt(&mut h);
        g.send(&mut dev, h, b"data");
        let got = g.recv(&mut dev);
        assert_eq!(op(&got[0].0), Some(Op::Rst), "{what}");
        assert_eq!(dev.backend().connections(), 0, "{what}");
    }
    // Data for a connection that does not exist: RST.
    g.send(&mut dev, hdr(Op::Rw, 1, 2, 1), b"x");
    assert_eq!(op(&g.recv(&mut dev)[0].0), Some(Op::Rst));
    // The device still connects.
    host_connection(&mut dev, &mut g, &path);
}

#[test]
fn malformed_chains_are_device_errors() {
    let (mut dev, _dir, _path) = device();
    let mem = memory();
    let h = hdr(Op::Request, 1, 6000, 0).to_bytes();
    mem.write_slice(&h, GuestAddress(DATA)).unwrap();
    let tx_cases: [Case; 3] = [
        ("shorter than a header", &[(DATA, 20, false)]),
        (
            "writable buffer in a transmit chain",
            &[(DATA, 44, false), (DATA + 0x100, 16, true)],
        ),
        (
            "longer than header + 64 KiB",
            &[(DATA, 44, false), (DATA + 0x100, 70_000, false)],
        ),
    ];
    for (what, bufs) in tx_cases {
        let mut q = TestQueue::new(&mem, 0, 16);
        let mut queue = q.queue();
        q.post(bufs);
        assert!(dev.process_queue(TX, &mut queue, &mem).is_err(), "{what}");
    }
    let rx_cases: [Case; 2] = [
        ("readable receive buffer", &[(DATA, 4096, false)]),
        ("receive buffer shorter than a header", &[(DATA, 40, true)]),
    ];
    for (what, bufs) in rx_cases {
        // Something to deliver: a refused guest request leaves an RST waiting.
        let mut q = TestQueue::new(&mem, 0, 16);
        let mut queue = q.queue();
        q.post(&[(DATA, 44, false)]);
        dev.process_queue(TX, &mut queue, &mem).unwrap();
        let mut q = TestQueue::new(&mem, 0x1_0000, 16);
        let mut queue = q.queue();
        q.post(bufs);
        assert!(dev.process_queue(RX, &mut queue, &mem).is_err(), "{what}");
        dev.reset();
    }
    // Outside guest memory.
    let mut q = TestQueue::new(&mem, 0, 16);
    let mut queue = q.queue();
    q.post(&[((16 << 20) - 8, 44, false)]);
    assert!(dev.process_queue(TX, &mut queue, &mem).is_err());
}

#[test]
fn a_malformed_chain_puts_the_transport_into_needs_reset() {
    use crate::interrupt::Interrupt;
    use crate::mmio::MmioTransport;
    use crate::testutil::activate;
    use std::sync::Arc;
    use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

    let (dev, _dir, _path) = device();
    let mem = memory();
    let irq = Arc::new(Interrupt::new(EventFd::new(EFD_NONBLOCK).unwrap()));
    let mut t = MmioTransport::new(Box::new(dev), mem.clone(), irq).unwrap();
    let rx = TestQueue::new(&mem, 0, 16);
    let mut tx = TestQueue::new(&mem, 0x1_0000, 16);
    let ev = TestQueue::new(&mem, 0x2_0000, 16);
    activate(&mut t, &[(0, &rx, 16), (1, &tx, 16), (2, &ev, 16)]);
    tx.post(&[(DATA, 8, false)]);
    t.notify(TX);
    assert!(t.needs_reset());
}

#[test]
fn the_socket_is_removed_on_drop_and_a_live_one_is_not_taken_over() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("a.vsock");
    let dev = Vsock::new(CID, &path).unwrap();
    let err = Vsock::new(4, &path).unwrap_err();
    assert!(
        format!("{:#}", std::error::Error::source(&err).unwrap()).contains("in use"),
        "{err:?}"
    );
    drop(dev);
    assert!(!path.exists(), "removed at stop");
    // A stale socket (its listener gone without cleanup) is replaced.
    let stale = UnixListener::bind(&path).unwrap();
    drop(stale);
    assert!(path.exists());
    let dev = Vsock::new(CID, &path).unwrap();
    assert!(UnixStream::connect(&path).is_ok());
    drop(dev);
    std::fs::write(&path, b"not a socket").unwrap();
    let err = Vsock::new(CID, &path).unwrap_err();
    assert!(matches!(
        err,
        VsockError::Backend(backend::BackendError::NotASocket(_))
    ));
    assert!(matches!(
        Vsock::new(2, &dir.path().join("b")),
        Err(VsockError::ReservedCid(2))
    ));
}

#[test]
fn the_io_thread_serves_a_host_connection_without_a_guest_notification() {
    use crate::interrupt::Interrupt;
    use crate::mmio::MmioTransport;
    use crate::testutil::{activate, wait_for};
    use crate::worker::{IoSource, IoThread};
    use std::sync::{Arc, Mutex};
    use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

    let (dev, _dir, path) = device();
    let fd = dev.poll_fd();
    let mem = memory();
    let irq = Arc::new(Interrupt::new(EventFd::new(EFD_NONBLOCK).unwrap()));
    let mut t = MmioTransport::new(Box::new(dev), mem.clone(), irq).unwrap();
    let mut rx = TestQueue::new(&mem, 0, 16);
    let tx = TestQueue::new(&mem, 0x1_0000, 16);
    let ev = TestQueue::new(&mem, 0x2_0000, 16);
    activate(&mut t, &[(0, &rx, 16), (1, &tx, 16), (2, &ev, 16)]);
    rx.post(&[(DATA, 44 + 4096, true)]);
    let t = Arc::new(Mutex::new(t));
    let source = IoSource::Backend {
        transport: t.clone(),
        queue: RX,
        fd,
    };
    let io = IoThread::spawn("vmhost-io-vsock", vec![source]).unwrap();
    let mut host = UnixStream::connect(&path).unwrap();
    host.write_all(b"CONNECT 52\n").unwrap();
    assert!(
        wait_for(|| rx.used_idx() == 1),
        "the REQUEST reached the guest"
    );
    let mut raw = [0u8; HDR_LEN];
    mem.read_slice(&mut raw, GuestAddress(DATA)).unwrap();
    assert_eq!(op(&Header::from_bytes(&raw)), Some(Op::Request));
    io.stop().unwrap();
}

/// xorshift64: a deterministic stream of test values.
struct Rand(u64);

impl Rand {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn pick<T: Copy>(&mut self, from: &[T]) -> T {
        from[(self.next() % from.len() as u64) as usize]
    }
}

#[test]
fn random_guest_packets_never_break_the_device() {
    let (mut dev, _dir, path) = device();
    let _listener = UnixListener::bind(format!("{}_6000", path.display())).unwrap();
    let mem = memory();
    let mut r = Rand(0x5eed_1234_abcd_0001);
    let mut hosts = Vec::new();
    for round in 0..20 {
        // Fresh rings every round (the test queues hold 256 descriptors).
        let mut g = Guest::new(&mem);
        // Take what the last round left for the guest.
        loop {
            g.post_rx(4);
            if g.recv(&mut dev).len() < 4 {
                break;
            }
        }
        let (host, port) = host_connection(&mut dev, &mut g, &path);
        hosts.push(host);
        for i in 0..40 {
            let len = r.pick(&[0u32, 1, 7, 100, MAX_PAYLOAD, MAX_PAYLOAD + 1, u32::MAX]);
            let h = Header {
                src_cid: r.pick(&[CID, CID, CID, 2, 0, u64::MAX]),
                dst_cid: r.pick(&[HOST_CID, HOST_CID, HOST_CID, CID, 1 << 40]),
                src_port: r.pick(&[52, 40000, 1, u32::MAX]),
                dst_port: r.pick(&[port, 6000, 7000, 1 << 30, 0]),
                len,
                kind: r.pick(&[TYPE_STREAM, TYPE_STREAM, 0, 2, u16::MAX]),
                op: r.pick(&[0u16, 1, 2, 3, 4, 5, 5, 5, 6, 7, 8, u16::MAX]),
                flags: r.pick(&[0, 1, 2, 3, u32::MAX]),
                buf_alloc: r.pick(&[0, 1, 4096, 1 << 18, u32::MAX]),
                fwd_cnt: r.pick(&[0, 1, u32::MAX]),
            };
            let payload = vec![0xa5u8; r.pick(&[0usize, 1, 7, 100])];
            g.send(&mut dev, h, &payload);
            g.post_rx(2);
            for (out, _) in g.recv(&mut dev) {
                assert_eq!(
                    (out.src_cid, out.dst_cid, out.kind),
                    (HOST_CID, CID, TYPE_STREAM),
                    "round {round} packet {i}: {out:?}"
                );
                assert!(op(&out).is_some(), "round {round} packet {i}: {out:?}");
            }
        }
    }
    // Still serving: a new host connection goes through.
    let mut g = Guest::new(&mem);
    loop {
        g.post_rx(4);
        if g.recv(&mut dev).len() < 4 {
            break;
        }
    }
    host_connection(&mut dev, &mut g, &path);
}

const NOBODY: u32 = 65534;

#[test]
fn the_vsock_socket_name_is_created_with_mode_0600_and_never_chmodded() {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    use vmhost_testsupport::dirwatch::{DirEvent, DirWatch};

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("vm.vsock");
    let mut watch = DirWatch::new(dir.path());
    let dev = Vsock::new(CID, &path).unwrap();
    assert_eq!(watch.events(), [DirEvent::Created("vm.vsock".into())]);
    let meta = std::fs::symlink_metadata(&path).unwrap();
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.permissions().mode() & 0o7777, 0o600);
    drop(dev);
}

#[test]
fn a_guest_connection_to_another_users_listener_is_refused() {
    let (mut dev, _dir, path) = device();
    let foreign = PathBuf::from(format!("{}_6000", path.display()));
    let listener = UnixListener::bind(&foreign).unwrap();
    listener.set_nonblocking(true).unwrap();
    std::os::unix::fs::chown(&foreign, Some(NOBODY), Some(NOBODY))
        .expect("chown needs root (the tests run as root, as CI does)");
    // A symlink at `<path>_<port>`, even to our own listener, is not a socket of ours either.
    let ours = path.with_file_name("elsewhere.sock");
    let _ours = UnixListener::bind(&ours).unwrap();
    std::os::unix::fs::symlink(&ours, format!("{}_6001", path.display())).unwrap();
    let mem = memory();
    let mut g = Guest::new(&mem);
    g.post_rx(4);
    for (src, port) in [(40000, 6000), (40001, 6001)] {
        g.send(&mut dev, hdr(Op::Request, src, port, 0), &[]);
        let got = g.recv(&mut dev);
        assert_eq!(op(&got[0].0), Some(Op::Rst), "port {port}");
        assert_eq!((got[0].0.src_port, got[0].0.dst_port), (port, src));
    }
    // connect(2) on a Unix socket queues at once: nothing was connected to the listener.
    let accepted = listener.accept().map(|_| ());
    assert_eq!(
        accepted.unwrap_err().kind(),
        std::io::ErrorKind::WouldBlock,
        "the other user's listener got a connection"
    );
    assert_eq!(dev.backend().connections(), 0);
}

#[test]
fn the_connection_limit_counts_host_greetings_and_guest_connections() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("vm.vsock");
    let mut backend = backend::Backend::new(CID, &path).unwrap();
    let listener = UnixListener::bind(format!("{}_6000", path.display())).unwrap();
    listener.set_nonblocking(true).unwrap();
    let mut peers = Vec::new();
    let mut guest_connect = |backend: &mut backend::Backend, src: u32| {
        backend.from_guest(&hdr(Op::Request, src, 6000, 0), Op::Request, &[]);
        while let Ok((peer, _)) = listener.accept() {
            peers.push(peer);
        }
    };
    for src in 0..MAX_CONNECTIONS as u32 - 1 {
        guest_connect(&mut backend, 40000 + src);
    }
    assert_eq!(backend.connections(), MAX_CONNECTIONS - 1);
    // A host connection still sending its CONNECT line takes the last place…
    let mut host = UnixStream::connect(&path).unwrap();
    backend.pump();
    // …so one more guest connection is refused,
    guest_connect(&mut backend, 50000);
    assert_eq!(backend.connections(), MAX_CONNECTIONS - 1);
    let mut buf = [0u8; HDR_LEN];
    let mut last = None;
    while let Some((h, _)) = backend.next_rx(&mut buf) {
        last = Some(h);
    }
    let last = last.unwrap();
    assert_eq!((op(&last), last.dst_port), (Some(Op::Rst), 50000));
    // …and the host connection, once it names its port, becomes the last one.
    host.write_all(b"CONNECT 52\n").unwrap();
    backend.pump();
    assert_eq!(backend.connections(), MAX_CONNECTIONS);
    // At the limit, a new host connection is closed before its CONNECT line is read.
    let mut late = UnixStream::connect(&path).unwrap();
    late.write_all(b"CONNECT 53\n").unwrap();
    backend.pump();
    assert_eq!(backend.connections(), MAX_CONNECTIONS);
    let mut byte = [0u8; 1];
    // Closed by vmhost: EOF, or a reset since its CONNECT line was never read.
    match late.read(&mut byte) {
        Ok(n) => assert_eq!(n, 0, "closed by vmhost"),
        Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset),
    }
}

/// Set in the child process of [`a_guest_connection_is_forwarded_under_the_io_threads_filter`].
const SECCOMP_CHILD: &str = "VMHOST_VSOCK_SECCOMP_CHILD";

/// The guest → host path as the I/O thread runs it, under its own seccomp filter (On: a call
/// off the list kills the process with SIGSYS, so it runs in a child process): the owner check
/// of `<socket>_<port>` and the connect are allowed calls, our listener gets the connection and
/// another user's does not.
#[test]
fn a_guest_connection_is_forwarded_under_the_io_threads_filter() {
    const NAME: &str = "vsock::tests::a_guest_connection_is_forwarded_under_the_io_threads_filter";
    if std::env::var_os(SECCOMP_CHILD).is_some() {
        return seccomp_child();
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", NAME, "--nocapture", "--test-threads=1"])
        .env(SECCOMP_CHILD, "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}: {stderr}", out.status);
    assert!(stderr.contains("FORWARDED-UNDER-FILTER"), "{stderr}");
}

fn seccomp_child() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("vm.vsock");
    let mut backend = backend::Backend::new(CID, &path).unwrap();
    let ours = UnixListener::bind(format!("{}_6000", path.display())).unwrap();
    ours.set_nonblocking(true).unwrap();
    let foreign_path = format!("{}_6001", path.display());
    let foreign = UnixListener::bind(&foreign_path).unwrap();
    foreign.set_nonblocking(true).unwrap();
    std::os::unix::fs::chown(&foreign_path, Some(NOBODY), Some(NOBODY)).unwrap();
    let backend = std::thread::spawn(move || {
        vmhost_seccomp::install(
            vmhost_seccomp::ThreadKind::DeviceIo,
            vmhost_seccomp::SeccompMode::On,
        )
        .unwrap();
        backend.from_guest(&hdr(Op::Request, 40000, 6000, 0), Op::Request, &[]);
        backend.from_guest(&hdr(Op::Request, 40001, 6001, 0), Op::Request, &[]);
        backend
    })
    .join()
    .unwrap();
    assert!(ours.accept().is_ok(), "our listener got no connection");
    let refused = foreign.accept().map(|_| ()).unwrap_err();
    assert_eq!(refused.kind(), std::io::ErrorKind::WouldBlock);
    assert_eq!(backend.connections(), 1);
    eprintln!("FORWARDED-UNDER-FILTER");
}
