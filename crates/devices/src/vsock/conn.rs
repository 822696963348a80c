//! One vsock stream connection between a guest port and a host Unix stream: its state, the
//! credit-based flow control in both directions, and the bytes the host has not taken yet.
//!
//! Flow control (virtio spec 5.10.6.3): every packet carries the sender's `buf_alloc` and
//! `fwd_cnt`. Towards the guest, vmhost never sends more than the guest's free credit
//! (`peer_buf_alloc - (rx_cnt - peer_fwd_cnt)`) and asks for an update (CREDIT_REQUEST) when it
//! runs out. From the guest, vmhost advertises [`CONN_BUF_ALLOC`] bytes: what the Unix stream
//! does not take at once waits in the connection, `fwd_cnt` counts what it took, and a
//! CREDIT_UPDATE goes out once [`CREDIT_UPDATE_THRESHOLD`] bytes were forwarded since the
//! guest last heard. A guest that sends past its credit breaks the protocol: RST.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;

use super::packet::{
    Header, Op, HOST_CID, SHUTDOWN_BOTH, SHUTDOWN_RCV, SHUTDOWN_SEND, TYPE_STREAM,
};

/// Receive buffer each connection advertises to the guest.
pub const CONN_BUF_ALLOC: u32 = 256 * 1024;
/// Forwarded bytes after which the guest is sent a CREDIT_UPDATE unasked.
pub const CREDIT_UPDATE_THRESHOLD: u32 = CONN_BUF_ALLOC / 4;

/// Why a connection must be reset.
#[derive(Debug, thiserror::Error)]
pub enum ConnError {
    /// The guest sent more than the credit it was given.
    #[error("guest sent {len} bytes with {free} bytes of credit left")]
    CreditExceeded {
        /// Bytes in the packet.
        len: usize,
        /// Credit left.
        free: usize,
    },
    /// A packet that does not fit the connection's state.
    #[error("{op:?} packet in state {state:?}")]
    UnexpectedOp {
        /// The operation.
        op: Op,
        /// The connection's state.
        state: State,
    },
    /// The guest sent data after it said it would not.
    #[error("data after the guest's SHUTDOWN(SEND)")]
    DataAfterShutdown,
    /// The host's stream failed.
    #[error("host stream {op} failed")]
    Stream {
        /// `read` or `write`.
        op: &'static str,
        /// The cause.
        #[source]
        source: io::Error,
    },
}

/// Where a connection is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Host-initiated: REQUEST sent to the guest, waiting for its RESPONSE.
    Connecting,
    /// Data flows (in the directions neither side shut down).
    Established,
}

/// What reading the host stream for the guest produced.
#[derive(Debug, PartialEq, Eq)]
pub enum FromHost {
    /// `n` bytes are in the buffer.
    Data(usize),
    /// The host will send no more (end of stream: it closed or shut down its writing side).
    Eof,
    /// Data may wait but the guest has no credit; ask it for some (once per exhaustion).
    NeedCredit,
    /// Nothing to send now.
    Nothing,
}

/// One connection.
#[derive(Debug)]
pub struct Connection {
    stream: UnixStream,
    /// Host-side port (the guest's peer port).
    pub local_port: u32,
    /// The guest's port.
    pub peer_port: u32,
    /// Life cycle.
    pub state: State,
    fwd_cnt: u32,
    last_fwd_cnt_sent: u32,
    peer_buf_alloc: u32,
    peer_fwd_cnt: u32,
    rx_cnt: u32,
    pending: VecDeque<u8>,
    peer_shutdown: u32,
    write_shut: bool,
    host_eof: bool,
    credit_requested: bool,
}

impl Connection {
    /// A connection over `stream` (non-blocking).
    pub fn new(stream: UnixStream, local_port: u32, peer_port: u32, state: State) -> Self {
        Connection {
            stream,
            local_port,
            peer_port,
            state,
            fwd_cnt: 0,
            last_fwd_cnt_sent: 0,
            peer_buf_alloc: 0,
            peer_fwd_cnt: 0,
            rx_cnt: 0,
            pending: VecDeque::new(),
            peer_shutdown: 0,
            write_shut: false,
            host_eof: false,
            credit_requested: false,
        }
    }

    /// The host stream.
    pub fn stream(&mut self) -> &mut UnixStream {
        &mut self.stream
    }

    /// Bytes the guest may still receive.
    pub fn peer_credit(&self) -> u32 {
        self.peer_buf_alloc
            .saturating_sub(self.rx_cnt.wrapping_sub(self.peer_fwd_cnt))
    }

    /// Takes the guest's `buf_alloc` and `fwd_cnt` from any packet it sent.
    pub fn update_peer_credit(&mut self, hdr: &Header) {
        self.peer_buf_alloc = hdr.buf_alloc;
        self.peer_fwd_cnt = hdr.fwd_cnt;
        if self.peer_credit() > 0 {
            self.credit_requested = false;
        }
    }

    /// A packet of `op` from this connection to the guest `guest_cid`, carrying the current
    /// credit (which the guest now knows).
    pub fn header(&mut self, guest_cid: u64, op: Op) -> Header {
        self.last_fwd_cnt_sent = self.fwd_cnt;
        Header {
            src_cid: HOST_CID,
            dst_cid: guest_cid,
            src_port: self.local_port,
            dst_port: self.peer_port,
            len: 0,
            kind: TYPE_STREAM,
            op: op as u16,
            // vmhost shuts down only its sending side (the host's end of stream); the guest
            // may go on sending until it closes.
            flags: if op == Op::Shutdown { SHUTDOWN_SEND } else { 0 },
            buf_alloc: CONN_BUF_ALLOC,
            fwd_cnt: self.fwd_cnt,
        }
    }

    /// Data from the guest: to the host stream now, or queued within the credit.
    pub fn from_guest(&mut self, data: &[u8]) -> Result<(), ConnError> {
        if self.state != State::Established {
            return Err(ConnError::UnexpectedOp {
                op: Op::Rw,
                state: self.state,
            });
        }
        if self.peer_shutdown & SHUTDOWN_SEND != 0 {
            return Err(ConnError::DataAfterShutdown);
        }
        let free = CONN_BUF_ALLOC as usize - self.pending.len();
        if data.len() > free {
            return Err(ConnError::CreditExceeded {
                len: data.len(),
                free,
            });
        }
        self.pending.extend(data);
        self.flush()
    }

    /// Writes what the host stream takes of the queued bytes.
    pub fn flush(&mut self) -> Result<(), ConnError> {
        while !self.pending.is_empty() {
            let (front, _) = self.pending.as_slices();
            match self.stream.write(front) {
                Ok(0) => break,
                Ok(n) => {
                    self.pending.drain(..n);
                    // n <= CONN_BUF_ALLOC.
                    self.fwd_cnt = self.fwd_cnt.wrapping_add(u32::try_from(n).unwrap_or(0));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(source) => {
                    return Err(ConnError::Stream {
                        op: "write",
                        source,
                    })
                }
            }
        }
        if self.pending.is_empty() && self.peer_shutdown & SHUTDOWN_SEND != 0 && !self.write_shut {
            self.write_shut = true;
            // The host may have closed already; its EOF comes through the read side.
            let _ = self.stream.shutdown(Shutdown::Write);
        }
        Ok(())
    }

    /// Whether the guest should hear about freed buffer space.
    pub fn credit_update_due(&self) -> bool {
        self.fwd_cnt.wrapping_sub(self.last_fwd_cnt_sent) >= CREDIT_UPDATE_THRESHOLD
    }

    /// The guest's SHUTDOWN `flags` (accumulated).
    pub fn shutdown_from_guest(&mut self, flags: u32) {
        self.peer_shutdown |= flags & SHUTDOWN_BOTH;
    }

    /// The guest shut both directions and every byte it sent reached the host.
    pub fn finished(&self) -> bool {
        self.peer_shutdown == SHUTDOWN_BOTH && self.pending.is_empty()
    }

    /// Reads host bytes for the guest into `buf`, within the guest's credit.
    pub fn to_guest(&mut self, buf: &mut [u8]) -> Result<FromHost, ConnError> {
        if self.state != State::Established
            || self.host_eof
            || self.peer_shutdown & SHUTDOWN_RCV != 0
        {
            return Ok(FromHost::Nothing);
        }
        let credit = usize::try_from(self.peer_credit()).unwrap_or(usize::MAX);
        let want = buf.len().min(credit);
        if want == 0 {
            if self.credit_requested || buf.is_empty() {
                return Ok(FromHost::Nothing);
            }
            self.credit_requested = true;
            return Ok(FromHost::NeedCredit);
        }
        loop {
            return match self.stream.read(&mut buf[..want]) {
                Ok(0) => {
                    self.host_eof = true;
                    Ok(FromHost::Eof)
                }
                Ok(n) => {
                    // n <= want <= credit, a u32.
                    self.rx_cnt = self.rx_cnt.wrapping_add(u32::try_from(n).unwrap_or(0));
                    Ok(FromHost::Data(n))
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(FromHost::Nothing),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(source) => Err(ConnError::Stream { op: "read", source }),
            };
        }
    }
}
