//! The virtio-vsock packet header (`struct virtio_vsock_hdr`, 44 bytes, little endian) and the
//! checks a guest packet passes before the connection layer sees it.
//!
//! Bounds are checked on the header's own fields: a known operation, the stream type, a
//! payload length that fits the chain and the device's packet limit, and no payload on a
//! control packet. A packet that fails is answered with RST (see [`super::backend`]); a chain
//! that cannot even hold a header is a malformed chain and puts the device into NEEDS_RESET.

/// Size of the header on the wire.
pub const HDR_LEN: usize = 44;
/// Largest payload of one packet (Linux's `VIRTIO_VSOCK_MAX_PKT_BUF_SIZE`).
pub const MAX_PAYLOAD: u32 = 64 * 1024;
/// The host's context ID (`VMADDR_CID_HOST`).
pub const HOST_CID: u64 = 2;
/// `VIRTIO_VSOCK_TYPE_STREAM`, the only socket type offered.
pub const TYPE_STREAM: u16 = 1;
/// `VIRTIO_VSOCK_SHUTDOWN_RCV`: the sender will receive no more data.
pub const SHUTDOWN_RCV: u32 = 1;
/// `VIRTIO_VSOCK_SHUTDOWN_SEND`: the sender will send no more data.
pub const SHUTDOWN_SEND: u32 = 2;
/// Both shutdown flags.
pub const SHUTDOWN_BOTH: u32 = SHUTDOWN_RCV | SHUTDOWN_SEND;

/// A packet operation (`VIRTIO_VSOCK_OP_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Connection request.
    Request = 1,
    /// Connection accepted.
    Response = 2,
    /// Connection refused or reset.
    Rst = 3,
    /// No more data in one or both directions (`flags`).
    Shutdown = 4,
    /// Data.
    Rw = 5,
    /// The sender's receive credit changed.
    CreditUpdate = 6,
    /// The sender asks for a credit update.
    CreditRequest = 7,
}

impl Op {
    /// The operation of a wire value, if it is one.
    pub fn from_wire(v: u16) -> Option<Op> {
        Some(match v {
            1 => Op::Request,
            2 => Op::Response,
            3 => Op::Rst,
            4 => Op::Shutdown,
            5 => Op::Rw,
            6 => Op::CreditUpdate,
            7 => Op::CreditRequest,
            _ => return None,
        })
    }
}

/// A guest packet that breaks the protocol; its connection is reset.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PacketError {
    /// `op` is not a vsock operation.
    #[error("unknown operation {0}")]
    UnknownOp(u16),
    /// `type` is not VIRTIO_VSOCK_TYPE_STREAM.
    #[error("socket type {0} is not offered (only stream, 1)")]
    WrongType(u16),
    /// `len` is more than the chain carries.
    #[error("header says {declared} payload bytes, the chain carries {available}")]
    LenMismatch {
        /// The header's `len`.
        declared: u32,
        /// Payload bytes in the chain.
        available: u64,
    },
    /// `len` is more than one packet may carry.
    #[error("payload of {0} bytes exceeds the 64 KiB packet limit")]
    TooLong(u32),
    /// A control packet with a payload.
    #[error("{op:?} packet with a {len}-byte payload")]
    PayloadOnControl {
        /// The operation.
        op: Op,
        /// The header's `len`.
        len: u32,
    },
    /// The source is not the guest's CID.
    #[error("source CID {0} is not the guest's")]
    WrongSource(u64),
    /// The destination is not the host.
    #[error("destination CID {0} is not the host (2)")]
    WrongDestination(u64),
}

/// `struct virtio_vsock_hdr`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Header {
    /// Source context ID.
    pub src_cid: u64,
    /// Destination context ID.
    pub dst_cid: u64,
    /// Source port.
    pub src_port: u32,
    /// Destination port.
    pub dst_port: u32,
    /// Payload length.
    pub len: u32,
    /// Socket type.
    pub kind: u16,
    /// Operation (raw: unknown values are kept to be refused).
    pub op: u16,
    /// Operation flags (SHUTDOWN).
    pub flags: u32,
    /// The sender's receive buffer size.
    pub buf_alloc: u32,
    /// Bytes the sender has consumed from its receive buffer.
    pub fwd_cnt: u32,
}

fn le<const N: usize>(b: &[u8; HDR_LEN], at: usize) -> [u8; N] {
    let mut out = [0u8; N];
    out.copy_from_slice(&b[at..at + N]);
    out
}

impl Header {
    /// Decodes a header.
    pub fn from_bytes(b: &[u8; HDR_LEN]) -> Header {
        Header {
            src_cid: u64::from_le_bytes(le(b, 0)),
            dst_cid: u64::from_le_bytes(le(b, 8)),
            src_port: u32::from_le_bytes(le(b, 16)),
            dst_port: u32::from_le_bytes(le(b, 20)),
            len: u32::from_le_bytes(le(b, 24)),
            kind: u16::from_le_bytes(le(b, 28)),
            op: u16::from_le_bytes(le(b, 30)),
            flags: u32::from_le_bytes(le(b, 32)),
            buf_alloc: u32::from_le_bytes(le(b, 36)),
            fwd_cnt: u32::from_le_bytes(le(b, 40)),
        }
    }

    /// Encodes the header.
    pub fn to_bytes(&self) -> [u8; HDR_LEN] {
        let mut b = [0u8; HDR_LEN];
        b[0..8].copy_from_slice(&self.src_cid.to_le_bytes());
        b[8..16].copy_from_slice(&self.dst_cid.to_le_bytes());
        b[16..20].copy_from_slice(&self.src_port.to_le_bytes());
        b[20..24].copy_from_slice(&self.dst_port.to_le_bytes());
        b[24..28].copy_from_slice(&self.len.to_le_bytes());
        b[28..30].copy_from_slice(&self.kind.to_le_bytes());
        b[30..32].copy_from_slice(&self.op.to_le_bytes());
        b[32..36].copy_from_slice(&self.flags.to_le_bytes());
        b[36..40].copy_from_slice(&self.buf_alloc.to_le_bytes());
        b[40..44].copy_from_slice(&self.fwd_cnt.to_le_bytes());
        b
    }

    /// Checks a packet the guest sent (`guest_cid` is the device's CID, `payload` the bytes the
    /// chain carries after the header) and returns its operation.
    pub fn check_guest(&self, guest_cid: u64, payload: u64) -> Result<Op, PacketError> {
        let op = Op::from_wire(self.op).ok_or(PacketError::UnknownOp(self.op))?;
        if self.kind != TYPE_STREAM {
            return Err(PacketError::WrongType(self.kind));
        }
        if self.src_cid != guest_cid {
            return Err(PacketError::WrongSource(self.src_cid));
        }
        if self.dst_cid != HOST_CID {
            return Err(PacketError::WrongDestination(self.dst_cid));
        }
        if self.len > MAX_PAYLOAD {
            return Err(PacketError::TooLong(self.len));
        }
        if u64::from(self.len) > payload {
            return Err(PacketError::LenMismatch {
                declared: self.len,
                available: payload,
            });
        }
        if op != Op::Rw && self.len != 0 {
            return Err(PacketError::PayloadOnControl { op, len: self.len });
        }
        Ok(op)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rw(len: u32) -> Header {
        Header {
            src_cid: 3,
            dst_cid: HOST_CID,
            src_port: 1000,
            dst_port: 52,
            len,
            kind: TYPE_STREAM,
            op: Op::Rw as u16,
            flags: 0,
            buf_alloc: 1 << 18,
            fwd_cnt: 7,
        }
    }

    #[test]
    fn a_header_round_trips_through_its_wire_form() {
        let h = rw(10);
        let b = h.to_bytes();
        assert_eq!(b[24..28], 10u32.to_le_bytes());
        assert_eq!(b[30..32], 5u16.to_le_bytes());
        assert_eq!(Header::from_bytes(&b), h);
    }

    #[test]
    fn guest_packets_are_checked_field_by_field() {
        assert_eq!(rw(10).check_guest(3, 10), Ok(Op::Rw));
        assert_eq!(
            rw(11).check_guest(3, 10),
            Err(PacketError::LenMismatch {
                declared: 11,
                available: 10
            })
        );
        assert_eq!(
            rw(MAX_PAYLOAD + 1).check_guest(3, u64::MAX),
            Err(PacketError::TooLong(MAX_PAYLOAD + 1))
        );
        assert_eq!(rw(0).check_guest(4, 0), Err(PacketError::WrongSource(3)));
        let mut h = rw(0);
        h.op = 99;
        assert_eq!(h.check_guest(3, 0), Err(PacketError::UnknownOp(99)));
        h.op = Op::Request as u16;
        h.kind = 2;
        assert_eq!(h.check_guest(3, 0), Err(PacketError::WrongType(2)));
        h.kind = TYPE_STREAM;
        h.dst_cid = 7;
        assert_eq!(h.check_guest(3, 0), Err(PacketError::WrongDestination(7)));
        h.dst_cid = HOST_CID;
        h.len = 4;
        assert_eq!(
            h.check_guest(3, 4),
            Err(PacketError::PayloadOnControl {
                op: Op::Request,
                len: 4
            })
        );
    }
}
