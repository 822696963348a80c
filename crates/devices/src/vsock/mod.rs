//! virtio-vsock in user space, exposed on a Unix socket the way Firecracker's hybrid vsock is
//! (docs/devices.md, "virtio-vsock").
//!
//! - [`packet`]: the 44-byte header and the checks a guest packet passes.
//! - [`conn`]: one connection's state and credit-based flow control.
//! - [`backend`]: the Unix sockets (`<path>` for host-initiated connections, `<path>_<port>`
//!   for guest-initiated ones), the connection table and the packets waiting for the guest.
//! - [`event`]: the event queue.
//! - [`vhost`]: the other back end, the kernel's vhost-vsock (`backend = "vhost"`), whose host
//!   side is `AF_VSOCK` instead of a Unix socket.
//!
//! Queues: 0 receive (device → guest), 1 transmit (guest → device), 2 event. The
//! configuration space is the guest's 64-bit CID. A transmit chain must be device-readable
//! only and hold at least a header; a receive chain device-writable only and hold at least a
//! header; anything else is a malformed chain (NEEDS_RESET). A well-formed chain whose packet
//! breaks the protocol (unknown operation, wrong type, a length that does not match) resets
//! only its connection (RST) and is logged once.

pub mod backend;
pub mod conn;
pub mod event;
pub mod packet;
pub mod vhost;
mod vhost_sys;

use std::os::fd::RawFd;
use std::path::Path;

use tracing::warn;
use virtio_bindings::virtio_ids::VIRTIO_ID_VSOCK;
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vmhost_memory::GuestMemoryMmap;

use crate::chain::{Chain, ChainError, ChainLimits};
use crate::device::{serve_queue, DeviceError, VirtioDevice};
use crate::persist::{DeviceState, StateError};
use backend::{Backend, BackendError};
use packet::{Header, HDR_LEN, MAX_PAYLOAD};

/// Size of each queue.
pub const VSOCK_QUEUE_SIZE: u16 = 256;
/// The lowest CID a guest may have (0-2 are reserved: hypervisor, local, host).
pub const MIN_GUEST_CID: u64 = 3;
/// Receive queue.
pub const RX: usize = 0;
/// Transmit queue.
pub const TX: usize = 1;
/// Event queue.
pub const EVENT: usize = 2;

const HDR: u64 = HDR_LEN as u64;

/// Why a vsock device could not be made (host errors).
#[derive(Debug, thiserror::Error)]
pub enum VsockError {
    /// The CID is reserved or not a guest address.
    #[error("guest CID {0} is reserved or out of range; use 3 to 4294967294")]
    ReservedCid(u64),
    /// The Unix socket could not be set up.
    #[error("cannot expose the vsock device on its Unix socket")]
    Backend(#[source] BackendError),
}

/// A virtio-vsock device.
#[derive(Debug)]
pub struct Vsock {
    cid: u64,
    backend: Backend,
    queue_sizes: [u16; 3],
    buf: Vec<u8>,
    packet_error_logged: bool,
}

impl Vsock {
    /// A device for guest `cid` listening on the Unix socket `path` (removed when the device
    /// is dropped).
    pub fn new(cid: u64, path: &Path) -> Result<Self, VsockError> {
        if cid < MIN_GUEST_CID || cid >= u64::from(u32::MAX) {
            return Err(VsockError::ReservedCid(cid));
        }
        Ok(Vsock {
            cid,
            backend: Backend::new(cid, path).map_err(VsockError::Backend)?,
            queue_sizes: [VSOCK_QUEUE_SIZE; 3],
            buf: vec![0; MAX_PAYLOAD as usize],
            packet_error_logged: false,
        })
    }

    /// The guest's CID.
    pub fn cid(&self) -> u64 {
        self.cid
    }

    /// The fd to watch: readable when the host side has work for the receive queue.
    pub fn poll_fd(&self) -> RawFd {
        self.backend.poll_fd()
    }

    /// The host side.
    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    fn process_tx(
        &mut self,
        queue: &mut Queue,
        mem: &GuestMemoryMmap,
    ) -> Result<bool, DeviceError> {
        let limits = ChainLimits {
            max_segments: usize::from(VSOCK_QUEUE_SIZE),
            max_readable: HDR + u64::from(MAX_PAYLOAD),
            max_writable: 0,
        };
        let used = serve_queue(TX, queue, mem, &limits, |chain, mem| {
            self.send(chain, mem).map(|()| 0)
        })?;
        if used {
            // Replies and freed credit go out through the receive queue.
            self.backend.kick();
        }
        Ok(used)
    }

    /// One guest packet to the backend.
    fn send(&mut self, chain: &Chain, mem: &GuestMemoryMmap) -> Result<(), ChainError> {
        if !chain.writable.is_empty() || chain.readable_len() < HDR {
            return Err(ChainError::Direction {
                head: chain.head,
                what: "a transmit packet is a device-readable 44-byte header and its payload",
            });
        }
        let mut raw = [0u8; HDR_LEN];
        chain.read_at(mem, 0, &mut raw)?;
        let hdr = Header::from_bytes(&raw);
        let op = match hdr.check_guest(self.cid, chain.readable_len() - HDR) {
            Ok(op) => op,
            Err(e) => {
                if !self.packet_error_logged {
                    self.packet_error_logged = true;
                    warn!(
                        src_port = hdr.src_port,
                        dst_port = hdr.dst_port,
                        "virtio-vsock: malformed guest packet, connection reset: {e}"
                    );
                }
                self.backend.refuse(&hdr);
                return Ok(());
            }
        };
        let len = hdr.len as usize;
        chain.read_at(mem, HDR, &mut self.buf[..len])?;
        self.backend.from_guest(&hdr, op, &self.buf[..len]);
        Ok(())
    }

    fn process_rx(
        &mut self,
        queue: &mut Queue,
        mem: &GuestMemoryMmap,
    ) -> Result<bool, DeviceError> {
        self.backend.pump();
        let limits = ChainLimits {
            max_segments: usize::from(VSOCK_QUEUE_SIZE),
            max_readable: 0,
            max_writable: u64::from(u32::MAX),
        };
        let mut used = false;
        while let Some(desc) = queue.iter(mem).map_err(DeviceError::queue(RX))?.next() {
            let chain = Chain::parse(desc, &limits).map_err(DeviceError::chain(RX))?;
            let Some(written) = self.receive(&chain, mem).map_err(DeviceError::chain(RX))? else {
                // Nothing to deliver: the buffer stays with the device for later.
                queue.go_to_previous_position();
                break;
            };
            queue
                .add_used(mem, chain.head, written)
                .map_err(DeviceError::queue(RX))?;
            used = true;
        }
        Ok(used)
    }

    /// Fills a receive chain with the next packet; `None` when there is none.
    fn receive(&mut self, chain: &Chain, mem: &GuestMemoryMmap) -> Result<Option<u32>, ChainError> {
        if !chain.readable.is_empty() || chain.writable_len() < HDR {
            return Err(ChainError::Direction {
                head: chain.head,
                what: "a receive buffer is device-writable and holds at least a 44-byte header",
            });
        }
        let room = usize::try_from(chain.writable_len() - HDR)
            .unwrap_or(usize::MAX)
            .min(self.buf.len());
        let Some((hdr, n)) = self.backend.next_rx(&mut self.buf[..room]) else {
            return Ok(None);
        };
        chain.write_at(mem, 0, &hdr.to_bytes())?;
        chain.write_at(mem, HDR, &self.buf[..n])?;
        // n <= MAX_PAYLOAD.
        Ok(Some(u32::try_from(HDR_LEN + n).unwrap_or(0)))
    }
}

impl VirtioDevice for Vsock {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_VSOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_sizes
    }

    /// Stream sockets only: no feature bits (SEQPACKET is not offered).
    fn features(&self) -> u64 {
        0
    }

    /// `struct virtio_vsock_config`: the guest CID.
    fn config(&self) -> Vec<u8> {
        self.cid.to_le_bytes().to_vec()
    }

    fn process_queue(
        &mut self,
        index: usize,
        queue: &mut Queue,
        mem: &GuestMemoryMmap,
    ) -> Result<bool, DeviceError> {
        match index {
            RX => self.process_rx(queue, mem),
            TX => self.process_tx(queue, mem),
            EVENT => event::process(queue, mem),
            _ => Err(DeviceError::NoSuchQueue { queue: index }),
        }
    }

    fn reset(&mut self) {
        self.backend.reset();
    }

    /// The connections' host ends stay on this host: a restored device starts with none and
    /// tells the guest so (see [`Vsock::restored`]).
    fn save_state(&mut self, _queues: &mut [Queue]) -> Result<DeviceState, StateError> {
        Ok(DeviceState::Vsock(VsockState { cid: self.cid }))
    }

    fn restore_state(&mut self, state: &DeviceState) -> Result<(), StateError> {
        match state {
            DeviceState::Vsock(saved) if saved.cid == self.cid => Ok(()),
            DeviceState::Vsock(saved) => Err(StateError::Mismatch {
                field: "vsock guest CID",
                saved: saved.cid.to_string(),
                built: self.cid.to_string(),
            }),
            other => Err(StateError::Kind {
                saved: other.kind().to_string(),
                built: "vsock".to_string(),
            }),
        }
    }

    /// The guest's connections ended with the old host: VIRTIO_VSOCK_EVENT_TRANSPORT_RESET
    /// in its event queue (it then drops them and reads its CID again), as Firecracker does.
    fn restored(
        &mut self,
        queues: &mut [Queue],
        mem: &GuestMemoryMmap,
    ) -> Result<bool, DeviceError> {
        self.backend.reset();
        match queues.get_mut(EVENT) {
            Some(q) if q.ready() => event::post_transport_reset(q, mem),
            _ => Ok(false),
        }
    }
}

/// virtio-vsock's own state: the guest's CID (checked on restore). Connections do not move:
/// the restored device resets them with a transport-reset event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VsockState {
    /// The guest's CID.
    pub cid: u64,
}

#[cfg(test)]
#[path = "tests.rs"]
mod tests;
