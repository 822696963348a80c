//! The event queue (queue 2). The only event virtio-vsock defines is TRANSPORT_RESET, which a
//! device sends when the guest's connections became invalid behind its back (a live
//! migration, a snapshot restore). vmhost does neither, so the guest's event buffers stay with
//! the device; a notification checks that the ring itself is readable.

use virtio_queue::{Queue, QueueOwnedT};
use vmhost_memory::GuestMemoryMmap;

use super::EVENT;
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
