//! What every virtio device implements for the transport ([`crate::mmio`]).
//!
//! The transport owns the queues while the driver configures them and hands a device one
//! queue at a time when it is notified. A device never sees a register; it offers features,
//! a configuration space and the processing of its queues.

use std::num::Wrapping;
use std::sync::atomic::Ordering;
use virtio_queue::{Queue, QueueOwnedT, QueueT};

use vm_memory::{Address, Bytes, GuestAddress};
use vmhost_memory::GuestMemoryMmap;

use crate::chain::{Chain, ChainError, ChainLimits};
use crate::persist::{DeviceState, StateError};

/// A device failure caused by the guest (malformed queues or requests). The transport puts
/// the device into NEEDS_RESET and logs it once.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// A malformed descriptor chain.
    #[error("queue {queue}")]
    Chain {
        /// Queue index.
        queue: usize,
        /// What is wrong with it.
        #[source]
        source: ChainError,
    },
    /// The queue itself is broken (e.g. an available index too far ahead, unreadable rings).
    #[error("queue {queue}: virtqueue error")]
    Queue {
        /// Queue index.
        queue: usize,
        /// virtio-queue's error.
        #[source]
        source: virtio_queue::Error,
    },
    /// The device has no queue of this index.
    #[error("queue {queue} does not exist")]
    NoSuchQueue {
        /// Queue index.
        queue: usize,
    },
}

impl DeviceError {
    /// Wraps a chain error of `queue`.
    pub fn chain(queue: usize) -> impl FnOnce(ChainError) -> DeviceError {
        move |source| DeviceError::Chain { queue, source }
    }

    /// Wraps a virtqueue error of `queue`.
    pub fn queue(queue: usize) -> impl FnOnce(virtio_queue::Error) -> DeviceError {
        move |source| DeviceError::Queue { queue, source }
    }
}

/// Serves every available chain of a device's only queue (index 0) with `serve`; see
/// [`serve_queue`].
pub(crate) fn serve_single_queue(
    index: usize,
    queue: &mut Queue,
    mem: &GuestMemoryMmap,
    limits: &ChainLimits,
    serve: impl FnMut(&Chain, &GuestMemoryMmap) -> Result<u32, ChainError>,
) -> Result<bool, DeviceError> {
    if index != 0 {
        return Err(DeviceError::NoSuchQueue { queue: index });
    }
    serve_queue(index, queue, mem, limits, serve)
}

/// Serves every available chain of queue `index` with `serve`, which returns the bytes
/// written into the chain; `Ok(true)` when any chain was used. Chains are checked against
/// `limits` before `serve` sees them.
pub(crate) fn serve_queue(
    index: usize,
    queue: &mut Queue,
    mem: &GuestMemoryMmap,
    limits: &ChainLimits,
    mut serve: impl FnMut(&Chain, &GuestMemoryMmap) -> Result<u32, ChainError>,
) -> Result<bool, DeviceError> {
    let mut used = false;
    while let Some(desc) = queue.iter(mem).map_err(DeviceError::queue(index))?.next() {
        let chain = Chain::parse(desc, limits).map_err(DeviceError::chain(index))?;
        let len = serve(&chain, mem).map_err(DeviceError::chain(index))?;
        queue
            .add_used(mem, chain.head, len)
            .map_err(DeviceError::queue(index))?;
        used = true;
    }
    Ok(used)
}

/// Adds `entries` (chain head, bytes written) to queue `index`'s used ring and makes them
/// visible to the driver together, with one store of the used index: a frame spread over
/// several receive chains (`VIRTIO_NET_F_MRG_RXBUF`) must be, since the driver reads
/// `num_buffers` in the first and takes that many more as the same frame. (virtio-queue's
/// `add_used` publishes each entry as it adds it.) The transport's interrupt decision
/// counts these entries too (it compares used indexes, see `mmio::serve`).
pub(crate) fn add_used_together(
    index: usize,
    queue: &mut Queue,
    mem: &GuestMemoryMmap,
    entries: &[(u16, u32)],
) -> Result<(), DeviceError> {
    use virtio_queue::Error;
    let size = queue.size();
    let used = GuestAddress(queue.used_ring());
    let mut next = Wrapping(queue.next_used());
    let mut publish = || -> Result<(), Error> {
        for &(head, len) in entries {
            if head >= size {
                return Err(Error::InvalidDescriptorIndex);
            }
            // struct virtq_used_elem { le32 id; le32 len; } at 4 + 8 * slot.
            let slot = u64::from(next.0 % size);
            let addr = used
                .checked_add(4 + 8 * slot)
                .ok_or(Error::AddressOverflow)?;
            let elem = (u64::from(len) << 32) | u64::from(head);
            mem.write_obj(elem.to_le(), addr)
                .map_err(Error::GuestMemory)?;
            next += Wrapping(1);
        }
        let idx = used.checked_add(2).ok_or(Error::AddressOverflow)?;
        // Release: the elements are written before the driver can see the index that
        // covers them.
        mem.store(next.0.to_le(), idx, Ordering::Release)
            .map_err(Error::GuestMemory)
    };
    publish().map_err(DeviceError::queue(index))?;
    queue.set_next_used(next.0);
    Ok(())
}

/// A virtio device behind a transport.
pub trait VirtioDevice: Send {
    /// The virtio device ID (`VIRTIO_ID_*`).
    fn device_type(&self) -> u32;

    /// The maximum size of each queue; its length is the number of queues.
    fn queue_max_sizes(&self) -> &[u16];

    /// Feature bits the device offers (VIRTIO_F_VERSION_1 is added by the transport).
    fn features(&self) -> u64;

    /// The device-specific configuration space.
    fn config(&self) -> Vec<u8>;

    /// The driver accepted `features` (FEATURES_OK) and set DRIVER_OK.
    fn activate(&mut self, features: u64) {
        let _ = features;
    }

    /// DRIVER_OK with the queues as the driver set them up, for a device whose queues are
    /// served elsewhere (the kernel's vhost). `Err` puts the device into NEEDS_RESET with the
    /// message. The default calls [`VirtioDevice::activate`].
    fn activate_queues(
        &mut self,
        features: u64,
        queues: &[Queue],
        mem: &GuestMemoryMmap,
    ) -> Result<(), String> {
        let _ = (queues, mem);
        self.activate(features);
        Ok(())
    }

    /// Processes the available buffers of queue `index`. Returns whether buffers were used
    /// (so the transport raises the queue interrupt).
    fn process_queue(
        &mut self,
        index: usize,
        queue: &mut Queue,
        mem: &GuestMemoryMmap,
    ) -> Result<bool, DeviceError>;

    /// The queues whose used buffers the last [`VirtioDevice::process_queue`] of queue
    /// `served` (which returned true) published, as a bit mask: the queues to interrupt. The
    /// default: `served` alone. A device whose backend uses several rings at once (the
    /// kernel's vhost) says which, so that each queue's MSI-X vector is raised.
    fn used_queues(&self, served: usize) -> u64 {
        1u64.checked_shl(u32::try_from(served).unwrap_or(u32::MAX))
            .unwrap_or(0)
    }

    /// The driver reset the device: forget negotiated state.
    fn reset(&mut self) {}

    /// The device's own state for a snapshot or a migration ([`crate::persist`]), taken
    /// while the device is quiesced (its transport locked, its I/O thread paused). A device
    /// that took chains from `queues` without using them (chains held for later) gives them
    /// back first, so the saved `next_avail` is where the restored device starts. The
    /// default: the device cannot be saved.
    fn save_state(&mut self, queues: &mut [Queue]) -> Result<DeviceState, StateError> {
        let _ = queues;
        Err(StateError::Unsupported {
            device: "this virtio device",
        })
    }

    /// Checks the saved `state` against this device, built from the plan on this host, and
    /// takes it over; nothing is changed when it is refused. Called before the transport's
    /// state is applied.
    fn restore_state(&mut self, state: &DeviceState) -> Result<(), StateError> {
        Err(StateError::Kind {
            saved: state.kind().to_string(),
            built: format!("device of type {}", self.device_type()),
        })
    }

    /// The transport's and the device's state are restored (and the device activated if the
    /// driver had): what the device does once, before the guest runs again (vsock posts its
    /// transport-reset event). Returns whether it used buffers (an interrupt is due).
    fn restored(
        &mut self,
        queues: &mut [Queue],
        mem: &GuestMemoryMmap,
    ) -> Result<bool, DeviceError> {
        let _ = (queues, mem);
        Ok(false)
    }
}
