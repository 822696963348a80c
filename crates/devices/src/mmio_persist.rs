//! The virtio-mmio transport's state that moves with the VM: the register file, the
//! interrupt status and each queue, ring indices included (Firecracker's
//! `devices/virtio/persist.rs` keeps the same).
//!
//! A restore checks every value before it changes anything: the device type and queue count
//! against the device built here, the status bits, the acknowledged features against what
//! the device offers, and each queue through virtio-queue's checking setters (size a power
//! of two up to the maximum, aligned ring addresses) and, when it is ready, its rings inside
//! guest RAM. The interrupt status is taken over without raising the line; it is raised by
//! [`MmioTransport::resume`], once the VM's interrupt controller is restored too.

use serde::{Deserialize, Serialize};
use virtio_bindings::virtio_config::{
    VIRTIO_CONFIG_S_ACKNOWLEDGE, VIRTIO_CONFIG_S_DRIVER, VIRTIO_CONFIG_S_DRIVER_OK,
    VIRTIO_CONFIG_S_FAILED, VIRTIO_CONFIG_S_FEATURES_OK, VIRTIO_CONFIG_S_NEEDS_RESET,
};
use virtio_bindings::virtio_mmio::{VIRTIO_MMIO_INT_CONFIG, VIRTIO_MMIO_INT_VRING};
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use virtio_queue::{Queue, QueueT};
use vm_memory::GuestAddress;

use super::{rings_in_memory, MmioTransport};
use crate::persist::{DeviceState, StateError};

const STATUS_BITS: u32 = VIRTIO_CONFIG_S_ACKNOWLEDGE
    | VIRTIO_CONFIG_S_DRIVER
    | VIRTIO_CONFIG_S_FEATURES_OK
    | VIRTIO_CONFIG_S_DRIVER_OK
    | VIRTIO_CONFIG_S_NEEDS_RESET
    | VIRTIO_CONFIG_S_FAILED;
const INTERRUPT_BITS: u32 = VIRTIO_MMIO_INT_VRING | VIRTIO_MMIO_INT_CONFIG;

/// A virtio-mmio transport's registers and queues.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TransportState {
    /// `DeviceID` (checked against the device built here).
    pub device_type: u32,
    /// `Status` (`VIRTIO_CONFIG_S_*`).
    pub status: u32,
    /// `DeviceFeaturesSel`.
    pub device_features_sel: u32,
    /// `DriverFeaturesSel`.
    pub driver_features_sel: u32,
    /// The features the driver accepted.
    pub acked_features: u64,
    /// `QueueSel`.
    pub queue_sel: u32,
    /// `ConfigGeneration`.
    pub config_generation: u32,
    /// `InterruptStatus`: the bits the driver has not acknowledged yet.
    pub interrupt_status: u32,
    /// One per queue of the device, in index order.
    pub queues: Vec<QueueState>,
}

/// One split virtqueue as the driver set it up, and how far the device got in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QueueState {
    /// The device's maximum size (checked against the device built here).
    pub max_size: u16,
    /// The size the driver chose.
    pub size: u16,
    /// `QueueReady`.
    pub ready: bool,
    /// Guest-physical address of the descriptor table.
    pub desc_table: u64,
    /// Guest-physical address of the available ring.
    pub avail_ring: u64,
    /// Guest-physical address of the used ring.
    pub used_ring: u64,
    /// The next available ring entry the device takes.
    pub next_avail: u16,
    /// The next used ring entry the device fills.
    pub next_used: u16,
    /// `VIRTIO_RING_F_EVENT_IDX` is in use.
    pub event_idx: bool,
}

impl QueueState {
    fn of(queue: &Queue) -> Self {
        QueueState {
            max_size: queue.max_size(),
            size: queue.size(),
            ready: queue.ready(),
            desc_table: queue.desc_table(),
            avail_ring: queue.avail_ring(),
            used_ring: queue.used_ring(),
            next_avail: queue.next_avail(),
            next_used: queue.next_used(),
            event_idx: queue.event_idx_enabled(),
        }
    }

    /// A queue of maximum size `max_size` set to this state, every value checked.
    fn to_queue(self, index: usize, max_size: u16) -> Result<Queue, StateError> {
        let bad = |what: String| StateError::Queue { queue: index, what };
        if self.max_size != max_size {
            return Err(bad(format!(
                "saved maximum size {}, the device here has {max_size}",
                self.max_size
            )));
        }
        let mut q =
            Queue::new(max_size).map_err(|e| bad(format!("maximum size {max_size}: {e}")))?;
        q.try_set_size(self.size).map_err(|_| {
            bad(format!(
                "size {} is not a power of two from 1 to {max_size}",
                self.size
            ))
        })?;
        let address =
            |what: &str, addr: u64| bad(format!("{what} address {addr:#x} is misaligned"));
        q.try_set_desc_table_address(GuestAddress(self.desc_table))
            .map_err(|_| address("descriptor table", self.desc_table))?;
        q.try_set_avail_ring_address(GuestAddress(self.avail_ring))
            .map_err(|_| address("available ring", self.avail_ring))?;
        q.try_set_used_ring_address(GuestAddress(self.used_ring))
            .map_err(|_| address("used ring", self.used_ring))?;
        q.set_ready(self.ready);
        q.set_next_avail(self.next_avail);
        q.set_next_used(self.next_used);
        q.set_event_idx(self.event_idx);
        Ok(q)
    }
}

impl MmioTransport {
    /// The transport's and the device's state, with the device quiesced: the caller holds
    /// the transport (so no request is being served) and has paused its I/O thread (so no
    /// new one starts until it resumes).
    pub fn save(&mut self) -> Result<(TransportState, DeviceState), StateError> {
        let device = self.device.save_state(&mut self.queues)?;
        let transport = TransportState {
            device_type: self.device.device_type(),
            status: self.status,
            device_features_sel: self.device_features_sel,
            driver_features_sel: self.driver_features_sel,
            acked_features: self.driver_features,
            queue_sel: self.queue_sel,
            config_generation: self.config_generation,
            interrupt_status: self.interrupt.status(),
            queues: self.queues.iter().map(QueueState::of).collect(),
        };
        Ok((transport, device))
    }

    /// Applies a saved state to this transport, built for the same slot as on a fresh
    /// start and not used by a driver yet. Everything is checked before anything changes;
    /// then the device takes its own state, is activated if the driver had set DRIVER_OK
    /// (so a tap gets its offloads), and does what it does once after a restore (vsock's
    /// transport reset). Call [`MmioTransport::resume`] before the guest runs.
    pub fn restore(
        &mut self,
        saved: &TransportState,
        device: &DeviceState,
    ) -> Result<(), StateError> {
        let queues = self.check(saved)?;
        self.device.restore_state(device)?;
        self.queues = queues;
        self.status = saved.status;
        self.device_features_sel = saved.device_features_sel;
        self.driver_features_sel = saved.driver_features_sel;
        self.driver_features = saved.acked_features;
        self.queue_sel = saved.queue_sel;
        self.config_generation = saved.config_generation;
        self.interrupt.restore_status(saved.interrupt_status);
        // A device in NEEDS_RESET is not started: it serves nothing until the driver resets
        // it, which starts from scratch.
        let running = self.status
            & (VIRTIO_CONFIG_S_DRIVER_OK | VIRTIO_CONFIG_S_FAILED | VIRTIO_CONFIG_S_NEEDS_RESET)
            == VIRTIO_CONFIG_S_DRIVER_OK;
        if !running {
            return Ok(());
        }
        self.device
            .activate_queues(self.driver_features, &self.queues, &self.mem)
            .map_err(StateError::Activate)?;
        let used = self
            .device
            .restored(&mut self.queues, &self.mem)
            .map_err(|e| StateError::Activate(super::error_chain(&e)))?;
        if used {
            match self.interrupt.msix().filter(|m| m.enabled()) {
                // A virtio-pci function (its MSI-X restored first): every queue's vector, held
                // until the vCPUs are loaded; the device did not say which queue it used.
                Some(msix) => {
                    for queue in 0..self.queues.len() {
                        if let Err(e) = msix.signal_queue(queue) {
                            tracing::warn!(error = %e, "virtio-pci: cannot queue a restored message");
                        }
                    }
                }
                None => self
                    .interrupt
                    .restore_status(self.interrupt.status() | VIRTIO_MMIO_INT_VRING),
            }
        }
        Ok(())
    }

    /// The saved state's queues, once every value is checked against this transport.
    fn check(&self, saved: &TransportState) -> Result<Vec<Queue>, StateError> {
        let built = self.device.device_type();
        if saved.device_type != built {
            return Err(StateError::Mismatch {
                field: "device type",
                saved: saved.device_type.to_string(),
                built: built.to_string(),
            });
        }
        let register = |register, value: u32| StateError::Register {
            register,
            value: u64::from(value),
        };
        if saved.status & !STATUS_BITS != 0 {
            return Err(register("Status", saved.status));
        }
        if saved.interrupt_status & !INTERRUPT_BITS != 0 {
            return Err(register("InterruptStatus", saved.interrupt_status));
        }
        let offered = self.offered_features();
        if saved.acked_features & !offered != 0 {
            return Err(StateError::Features {
                acked: saved.acked_features,
                offered,
            });
        }
        let event_idx = saved.acked_features & (1 << VIRTIO_RING_F_EVENT_IDX) != 0;
        let max_sizes = self.device.queue_max_sizes();
        if saved.queues.len() != max_sizes.len() {
            return Err(StateError::Mismatch {
                field: "queue count",
                saved: saved.queues.len().to_string(),
                built: max_sizes.len().to_string(),
            });
        }
        let mut queues = Vec::with_capacity(max_sizes.len());
        for (index, (q, &max)) in saved.queues.iter().zip(max_sizes).enumerate() {
            if q.event_idx != event_idx && q.ready {
                return Err(StateError::Queue {
                    queue: index,
                    what: format!(
                        "event_idx {} while the driver {} VIRTIO_RING_F_EVENT_IDX",
                        q.event_idx,
                        if event_idx { "accepted" } else { "declined" }
                    ),
                });
            }
            let queue = q.to_queue(index, max)?;
            if queue.ready() && !rings_in_memory(&queue, &self.mem) {
                return Err(StateError::Queue {
                    queue: index,
                    what: format!(
                        "rings at {:#x} (descriptors), {:#x} (available), {:#x} (used) for \
                         {} entries are not all inside guest RAM",
                        q.desc_table, q.avail_ring, q.used_ring, q.size
                    ),
                });
            }
            queues.push(queue);
        }
        Ok(queues)
    }

    /// After a restore, once the VM's interrupt controller is restored and before the guest
    /// runs: serves each ready queue once, so work the driver made available before the save
    /// and did not notify again is not left waiting. What that serving signals, and what was
    /// pending at the save, is raised by [`MmioTransport::raise_restored_interrupt`].
    pub fn resume(&mut self) {
        for index in 0..self.queues.len() {
            self.notify(index);
        }
    }

    /// After a restore, once every vCPU and its LAPIC are loaded and before the guest runs:
    /// raises the line again when the driver has bits to acknowledge. An edge raised earlier
    /// (while the irqchip was being restored, or before any vCPU existed) reaches no LAPIC,
    /// and the driver would wait for it forever. Returns whether it raised one.
    pub fn raise_restored_interrupt(&self) -> bool {
        if self.interrupt.status() == 0 {
            return false;
        }
        match self.interrupt.raise_pending() {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(error = %e, "virtio-mmio: cannot raise the restored interrupt");
                false
            }
        }
    }
}
