//! The vsock device's host side (`vmhost_devices::vsock::backend`): a local program connects to
//! the device's Unix socket and sends any bytes, in chunks of any size, then closes its sending
//! side; the guest accepts every connection request. Invariants: a REQUEST goes to the guest
//! only for a line `CONNECT <port>` (at most 32 bytes before its newline) and to exactly the
//! port the line names, and every such line gets one; the program then reads exactly
//! `OK <host port>\n`, and everything it sent after the newline reaches the guest, in order and
//! nothing more, followed by SHUTDOWN; any other greeting closes the program's stream without
//! a packet to the guest.
//!
//! Input: `[chunk size, bytes the program sends...]`.
#![no_main]

use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use vmhost_devices::vsock::backend::Backend;
use vmhost_devices::vsock::packet::{Header, Op, HOST_CID, TYPE_STREAM};

const CID: u64 = 3;
/// Longest greeting line the backend reads (without its newline).
const MAX_LINE: usize = 32;

fn socket_path() -> &'static PathBuf {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| {
        std::env::temp_dir().join(format!("vmhost-fuzz-vsock-{}.sock", std::process::id()))
    })
}

/// The port a well-formed greeting names, by the protocol's definition: `CONNECT `, then a
/// decimal number that fits 32 bits, optionally `\r`, within [`MAX_LINE`] bytes.
fn canonical_port(line: &[u8]) -> Option<u32> {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let digits = line.strip_prefix(b"CONNECT ")?;
    if line.len() > MAX_LINE || digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(digits).ok()?.parse().ok()
}

/// Control packets and data for the guest until the backend has nothing more.
fn drain(backend: &mut Backend, out: &mut Vec<(Header, Vec<u8>)>) {
    backend.pump();
    let mut buf = [0u8; 4096];
    while let Some((hdr, n)) = backend.next_rx(&mut buf) {
        out.push((hdr, buf[..n].to_vec()));
    }
}

fn guest_header(op: Op, src_port: u32, dst_port: u32) -> Header {
    Header {
        src_cid: CID,
        dst_cid: HOST_CID,
        src_port,
        dst_port,
        len: 0,
        kind: TYPE_STREAM,
        op: op as u16,
        flags: 0,
        buf_alloc: 1 << 20,
        fwd_cnt: 0,
    }
}

/// The guest accepts `request`: the program reads exactly its OK line, and `rest` (what it
/// sent after the newline) reaches the guest, then SHUTDOWN.
fn accept_and_stream(
    backend: &mut Backend,
    program: &mut UnixStream,
    request: Header,
    rest: &[u8],
) {
    // The guest accepts; the program reads exactly its OK line.
    let response = guest_header(Op::Response, request.dst_port, request.src_port);
    backend.from_guest(&response, Op::Response, &[]);
    let ok = format!("OK {}\n", request.src_port);
    let mut got = vec![0u8; ok.len() + 1];
    let n = program.read(&mut got).expect("the OK line");
    assert_eq!(&got[..n], ok.as_bytes());

    // What followed the newline reaches the guest, then SHUTDOWN.
    let mut stream = Vec::new();
    let mut packets = Vec::new();
    for _ in 0..10_000 {
        drain(backend, &mut packets);
        if packets.iter().any(|(h, _)| h.op == Op::Shutdown as u16) {
            break;
        }
    }
    for (hdr, payload) in &packets {
        assert_eq!(
            (hdr.src_port, hdr.dst_port),
            (request.src_port, request.dst_port),
            "{hdr:?}"
        );
        assert_ne!(hdr.op, Op::Rst as u16, "the connection was reset: {hdr:?}");
        if hdr.op == Op::Rw as u16 {
            assert_eq!(hdr.len as usize, payload.len());
            stream.extend_from_slice(payload);
        }
    }
    assert!(
        packets.iter().any(|(h, _)| h.op == Op::Shutdown as u16),
        "no SHUTDOWN after the program closed its side"
    );
    assert_eq!(
        stream, rest,
        "the stream to the guest differs from what was sent"
    );
}

fuzz_target!(|data: &[u8]| {
    let Some((&chunk, sent)) = data.split_first() else {
        return;
    };
    // Within what the socket buffers hold, so that the program's writes never block.
    let sent = &sent[..sent.len().min(64 << 10)];
    let mut backend = Backend::new(CID, socket_path()).expect("vsock backend");
    let mut program = UnixStream::connect(socket_path()).expect("connect to the vsock socket");
    program.set_nonblocking(true).expect("non-blocking");
    let mut packets = Vec::new();
    let mut written = 0;
    for piece in sent.chunks(usize::from(chunk % 16) + 1) {
        if program.write_all(piece).is_err() {
            break; // EPIPE: the backend closed the stream (a refused greeting)
        }
        written += piece.len();
        drain(&mut backend, &mut packets);
    }
    let sent = &sent[..written];
    let _ = program.shutdown(std::net::Shutdown::Write);
    drain(&mut backend, &mut packets);

    let newline = sent.iter().position(|&b| b == b'\n');
    let expected = newline.and_then(|at| canonical_port(&sent[..at]));
    let requests: Vec<&Header> = packets
        .iter()
        .map(|(h, _)| h)
        .filter(|h| h.op == Op::Request as u16)
        .collect();
    assert!(packets.len() <= 1, "packets {packets:?} for one greeting");
    let Some(&&request) = requests.first() else {
        assert_eq!(expected, None, "no REQUEST for a valid greeting");
        let mut byte = [0u8; 1];
        let read = program.read(&mut byte);
        assert!(
            matches!(read, Ok(0))
                || matches!(&read, Err(e) if e.kind() == ErrorKind::ConnectionReset),
            "a refused greeting left the stream open: {read:?}"
        );
        return;
    };
    let at = newline.expect("a REQUEST without a newline");
    let line = String::from_utf8_lossy(&sent[..at]);
    let said = line
        .trim_end_matches('\r')
        .strip_prefix("CONNECT ")
        .map(str::trim)
        .and_then(|p| p.parse::<u32>().ok());
    assert!(at <= MAX_LINE, "a {at}-byte line was accepted");
    assert_eq!(
        said,
        Some(request.dst_port),
        "line {line:?} gave {request:?}"
    );
    if let Some(port) = expected {
        assert_eq!(port, request.dst_port);
    }
    assert_eq!(
        (request.src_cid, request.dst_cid, request.kind, request.len),
        (HOST_CID, CID, TYPE_STREAM, 0),
        "{request:?}"
    );

    accept_and_stream(&mut backend, &mut program, request, &sent[at + 1..]);
});
