//! The event queue (queue 2). The only event virtio-vsock defines is TRANSPORT_RESET, which a
//! device sends when the guest's connections became invalid behind its back: vmhost sends it
//! once after a snapshot restore or a live migration ([`post_transport_reset`]), as
//! Firecracker does, since the host ends of the connections stayed on the old host. Otherwise
//! the guest's event buffers stay with the device; a notification checks that the ring itself
//! is readable.

use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vmhost_memory::GuestMemoryMmap;

use super::{EVENT, VSOCK_QUEUE_SIZE};
use crate::chain::{Chain, ChainError, ChainLimits};
use crate::device::DeviceError;

/// `VIRTIO_VSOCK_EVENT_TRANSPORT_RESET`.
pub const TRANSPORT_RESET: u32 = 0;

/// The guest posted event buffers: keep them. A broken available ring (an index more than a
/// queue size ahead) is a device error like on every other queue.
pub(crate) fn process(queue: &mut Queue, mem: &GuestMemoryMmap) -> Result<bool, DeviceError> {
    // The iterator checks the available index; dropping it consumes nothing.
    queue.iter(mem).map_err(DeviceError::queue(EVENT))?;
    Ok(false)
}

/// Size of `struct virtio_vsock_event`.
const EVENT_LEN: u64 = 4;

/// Puts a TRANSPORT_RESET event in the guest's next event buffer; `Ok(false)` when the guest
/// posted none (it is then told nothing, and its connections time out instead).
pub(crate) fn post_transport_reset(
    queue: &mut Queue,
    mem: &GuestMemoryMmap,
) -> Result<bool, DeviceError> {
    let limits = ChainLimits {
        max_segments: usize::from(VSOCK_QUEUE_SIZE),
        max_readable: 0,
        max_writable: u64::from(u32::MAX),
    };
    let Some(desc) = queue.iter(mem).map_err(DeviceError::queue(EVENT))?.next() else {
        return Ok(false);
    };
    let chain = Chain::parse(desc, &limits).map_err(DeviceError::chain(EVENT))?;
    if !chain.readable.is_empty() || chain.writable_len() < EVENT_LEN {
        return Err(DeviceError::Chain {
            queue: EVENT,
            source: ChainError::Direction {
                head: chain.head,
                what: "an event buffer is device-writable and holds the 4-byte event",
            },
        });
    }
    chain
        .write_at(mem, 0, &TRANSPORT_RESET.to_le_bytes())
        .map_err(DeviceError::chain(EVENT))?;
    queue
        .add_used(mem, chain.head, 4)
        .map_err(DeviceError::queue(EVENT))?;
    Ok(true)
}
