//! The virtio-mmio (version 2) transport: the register file a driver sees in a device's MMIO
//! window, and the device status state machine behind it.
//!
//! It does not know KVM. The VMM forwards guest accesses to [`MmioTransport::read`] and
//! [`MmioTransport::write`]; a queue notification that arrives through an ioeventfd instead of
//! the `QueueNotify` register is delivered with [`MmioTransport::notify`]. Interrupts go out
//! through the device's [`Interrupt`] (an irqfd).
//!
//! A device that meets malformed guest input is put into NEEDS_RESET: the error is logged
//! once, the driver gets a configuration-change interrupt, and further notifications are
//! ignored until the driver resets the device (writes 0 to `Status`).
//!
//! Guest input is checked here before virtio-queue sees it (its `QueueT` setters and
//! `is_valid` log an error for every bad value, which a guest could repeat without end): a
//! queue size or ring address the driver may not write is ignored, as virtio-queue would, and
//! warned about once per device reset. Every warning a guest can cause goes through the
//! device's [`LogBudget`] ([`DEVICE_LOG_BURST`] per [`DEVICE_LOG_WINDOW`], surviving resets),
//! so a driver that loops on reset and bad input cannot flood the log.

use std::num::Wrapping;
use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{debug, warn};
use virtio_bindings::virtio_config::{
    VIRTIO_CONFIG_S_ACKNOWLEDGE, VIRTIO_CONFIG_S_DRIVER, VIRTIO_CONFIG_S_DRIVER_OK,
    VIRTIO_CONFIG_S_FAILED, VIRTIO_CONFIG_S_FEATURES_OK, VIRTIO_CONFIG_S_NEEDS_RESET,
    VIRTIO_F_VERSION_1,
};
use virtio_bindings::virtio_mmio::*;
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryBackend};
use vmhost_memory::GuestMemoryMmap;

use crate::device::{DeviceError, VirtioDevice};
use crate::interrupt::Interrupt;
use crate::ratelimit::LogBudget;

/// `MagicValue`: "virt" in little endian.
pub const MMIO_MAGIC: u32 = 0x7472_6976;
/// The transport version implemented (virtio 1.x "modern" MMIO).
pub const MMIO_VERSION: u32 = 2;
/// `VendorID` reported to the driver ("VMHO").
pub const MMIO_VENDOR_ID: u32 = 0x4f48_4d56;
/// Size of a device's MMIO window (registers plus configuration space).
pub const MMIO_WINDOW_SIZE: u64 = 0x1000;

const CONFIG_START: u64 = VIRTIO_MMIO_CONFIG as u64;
/// Offset of `QueueNotify` in the window: where the VMM registers each queue's ioeventfd
/// (the written value is the queue index).
pub const QUEUE_NOTIFY_OFFSET: u64 = VIRTIO_MMIO_QUEUE_NOTIFY as u64;
/// Offset of the `InterruptStatus` register in a device's window.
pub const INTERRUPT_STATUS_OFFSET: u64 = VIRTIO_MMIO_INTERRUPT_STATUS as u64;
/// Offset of the `InterruptACK` register (write-only) in a device's window: vmhost registers
/// a KVM ioeventfd here so that acknowledgements never leave the kernel.
pub const INTERRUPT_ACK_OFFSET: u64 = VIRTIO_MMIO_INTERRUPT_ACK as u64;

/// Warnings one device may write per [`DEVICE_LOG_WINDOW`] about its guest's input.
pub const DEVICE_LOG_BURST: u32 = 10;
/// The window of a device's log budget.
pub const DEVICE_LOG_WINDOW: Duration = Duration::from_secs(10);

/// Why a transport could not be built.
#[derive(Debug, thiserror::Error)]
pub enum MmioError {
    /// The device asked for a queue size virtio-queue refuses.
    #[error("queue {index}: invalid maximum size {size}")]
    QueueSize {
        /// Queue index.
        index: usize,
        /// The size asked for.
        size: u16,
        /// virtio-queue's error.
        #[source]
        source: virtio_queue::Error,
    },
}

/// One queue's setup as the driver wrote it ([`MmioTransport::queue_info`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueInfo {
    /// Queue size.
    pub size: u16,
    /// Whether the driver made it ready.
    pub ready: bool,
    /// Descriptor table address.
    pub desc: u64,
    /// Available (driver) ring address.
    pub avail: u64,
    /// Used (device) ring address.
    pub used: u64,
}

/// One device's virtio-mmio register file and status.
pub struct MmioTransport {
    device: Box<dyn VirtioDevice>,
    mem: GuestMemoryMmap,
    interrupt: Arc<Interrupt>,
    queues: Vec<Queue>,
    status: u32,
    device_features_sel: u32,
    driver_features_sel: u32,
    driver_features: u64,
    queue_sel: u32,
    config_generation: u32,
    failure_logged: bool,
    /// An ignored queue register write was logged since the last reset.
    invalid_logged: bool,
    /// Bounds every warning the guest can cause, across resets.
    log_budget: LogBudget,
}

impl std::fmt::Debug for MmioTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MmioTransport")
            .field("device_type", &self.device.device_type())
            .field("status", &self.status)
            .finish_non_exhaustive()
    }
}

impl MmioTransport {
    /// A transport for `device` over guest memory `mem`, interrupting through `interrupt`.
    pub fn new(
        device: Box<dyn VirtioDevice>,
        mem: GuestMemoryMmap,
        interrupt: Arc<Interrupt>,
    ) -> Result<Self, MmioError> {
        let queues = device
            .queue_max_sizes()
            .iter()
            .enumerate()
            .map(|(index, &size)| {
                Queue::new(size).map_err(|source| MmioError::QueueSize {
                    index,
                    size,
                    source,
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(MmioTransport {
            device,
            mem,
            interrupt,
            queues,
            status: 0,
            device_features_sel: 0,
            driver_features_sel: 0,
            driver_features: 0,
            queue_sel: 0,
            config_generation: 0,
            failure_logged: false,
            invalid_logged: false,
            log_budget: LogBudget::new(DEVICE_LOG_BURST, DEVICE_LOG_WINDOW),
        })
    }

    /// The device's interrupt (status bits and irqfd).
    pub fn interrupt(&self) -> &Arc<Interrupt> {
        &self.interrupt
    }

    /// The device status register (`VIRTIO_CONFIG_S_*` bits).
    pub fn status(&self) -> u32 {
        self.status
    }

    /// Whether the device is in its error state.
    pub fn needs_reset(&self) -> bool {
        self.status & VIRTIO_CONFIG_S_NEEDS_RESET != 0
    }

    /// Features the driver accepted.
    pub fn acked_features(&self) -> u64 {
        self.driver_features
    }

    /// The device behind the transport.
    pub fn device(&self) -> &dyn VirtioDevice {
        self.device.as_ref()
    }

    /// Queue `index` as the driver set it up (for a transport that reads the queue registers
    /// back, such as virtio-pci's common configuration); `None` for a queue that does not
    /// exist.
    pub fn queue_info(&self, index: usize) -> Option<QueueInfo> {
        self.queues.get(index).map(|q| QueueInfo {
            size: q.size(),
            ready: q.ready(),
            desc: q.desc_table(),
            avail: q.avail_ring(),
            used: q.used_ring(),
        })
    }

    fn offered_features(&self) -> u64 {
        self.device.features() | (1 << VIRTIO_F_VERSION_1)
    }

    fn selected_queue(&self) -> Option<&Queue> {
        self.queues.get(self.queue_sel as usize)
    }

    /// A guest read of `data.len()` bytes at `offset` in the window.
    pub fn read(&self, offset: u64, data: &mut [u8]) {
        if offset >= CONFIG_START {
            let config = self.device.config();
            for (i, byte) in data.iter_mut().enumerate() {
                *byte = (offset - CONFIG_START)
                    .checked_add(i as u64)
                    .and_then(|o| usize::try_from(o).ok())
                    .and_then(|o| config.get(o).copied())
                    .unwrap_or(0);
            }
            return;
        }
        let value = match register(offset, data.len()) {
            Some(reg) => self.read_register(reg),
            None => {
                debug!(
                    offset,
                    len = data.len(),
                    "virtio-mmio: unaligned register read"
                );
                0
            }
        };
        if let Some(dst) = data.get_mut(..4) {
            dst.copy_from_slice(&value.to_le_bytes());
        }
    }

    fn read_register(&self, reg: u32) -> u32 {
        let features = self.offered_features();
        match reg {
            VIRTIO_MMIO_MAGIC_VALUE => MMIO_MAGIC,
            VIRTIO_MMIO_VERSION => MMIO_VERSION,
            VIRTIO_MMIO_DEVICE_ID => self.device.device_type(),
            VIRTIO_MMIO_VENDOR_ID => MMIO_VENDOR_ID,
            VIRTIO_MMIO_DEVICE_FEATURES => match self.device_features_sel {
                0 => low32(features),
                1 => low32(features >> 32),
                _ => 0,
            },
            VIRTIO_MMIO_QUEUE_NUM_MAX => self.selected_queue().map_or(0, |q| q.max_size().into()),
            VIRTIO_MMIO_QUEUE_READY => self.selected_queue().map_or(0, |q| q.ready().into()),
            VIRTIO_MMIO_INTERRUPT_STATUS => self.interrupt.read_status(),
            VIRTIO_MMIO_STATUS => self.status,
            VIRTIO_MMIO_CONFIG_GENERATION => self.config_generation,
            _ => 0,
        }
    }

    /// A guest write of `data` at `offset` in the window.
    pub fn write(&mut self, offset: u64, data: &[u8]) {
        if offset >= CONFIG_START {
            debug!(offset, "virtio-mmio: configuration space is read-only");
            return;
        }
        let (Some(reg), Ok(bytes)) = (register(offset, data.len()), <[u8; 4]>::try_from(data))
        else {
            debug!(
                offset,
                len = data.len(),
                "virtio-mmio: unaligned register write"
            );
            return;
        };
        let value = u32::from_le_bytes(bytes);
        match reg {
            VIRTIO_MMIO_DEVICE_FEATURES_SEL => self.device_features_sel = value,
            VIRTIO_MMIO_DRIVER_FEATURES => self.write_driver_features(value),
            VIRTIO_MMIO_DRIVER_FEATURES_SEL => self.driver_features_sel = value,
            VIRTIO_MMIO_QUEUE_SEL => self.queue_sel = value,
            VIRTIO_MMIO_QUEUE_NOTIFY => self.notify(value as usize),
            VIRTIO_MMIO_INTERRUPT_ACK => self.interrupt.ack(value),
            VIRTIO_MMIO_STATUS => self.write_status(value),
            _ => self.write_queue_register(reg, value),
        }
    }

    fn write_driver_features(&mut self, value: u32) {
        if self.status & VIRTIO_CONFIG_S_DRIVER == 0
            || self.status & VIRTIO_CONFIG_S_FEATURES_OK != 0
        {
            debug!("virtio-mmio: driver features written outside feature negotiation");
            return;
        }
        let value = u64::from(value);
        match self.driver_features_sel {
            0 => self.driver_features = (self.driver_features & !0xffff_ffff) | value,
            1 => self.driver_features = (self.driver_features & 0xffff_ffff) | (value << 32),
            _ => {}
        }
    }

    /// Queue registers may only change after FEATURES_OK and before DRIVER_OK.
    fn write_queue_register(&mut self, reg: u32, value: u32) {
        let configuring = self.status
            & (VIRTIO_CONFIG_S_FEATURES_OK | VIRTIO_CONFIG_S_DRIVER_OK | VIRTIO_CONFIG_S_FAILED)
            == VIRTIO_CONFIG_S_FEATURES_OK;
        let Some(queue) = self.queues.get_mut(self.queue_sel as usize) else {
            debug!(queue = self.queue_sel, "virtio-mmio: no such queue");
            return;
        };
        if !configuring {
            debug!(
                reg,
                "virtio-mmio: queue register written outside queue setup"
            );
            return;
        }
        // virtio-queue's checking setters: they refuse a bad value without logging it.
        let result = match reg {
            VIRTIO_MMIO_QUEUE_NUM => u16::try_from(value)
                .map_err(|_| virtio_queue::Error::InvalidSize)
                .and_then(|size| queue.try_set_size(size)),
            VIRTIO_MMIO_QUEUE_READY => {
                queue.set_ready(value == 1);
                Ok(())
            }
            VIRTIO_MMIO_QUEUE_DESC_LOW
            | VIRTIO_MMIO_QUEUE_DESC_HIGH
            | VIRTIO_MMIO_QUEUE_AVAIL_LOW
            | VIRTIO_MMIO_QUEUE_AVAIL_HIGH
            | VIRTIO_MMIO_QUEUE_USED_LOW
            | VIRTIO_MMIO_QUEUE_USED_HIGH => set_ring_address(queue, reg, value),
            _ => {
                debug!(reg, "virtio-mmio: write to a read-only or unknown register");
                Ok(())
            }
        };
        if let Err(e) = result {
            self.invalid_write(reg, value, &e);
        }
    }

    /// A queue register value the driver may not write: ignored (the register keeps its
    /// value, as virtio-queue's own setters do), logged once per device reset.
    fn invalid_write(&mut self, reg: u32, value: u32, e: &virtio_queue::Error) {
        if std::mem::replace(&mut self.invalid_logged, true) {
            return;
        }
        let queue = self.queue_sel;
        self.guest_warn(format_args!(
            "virtio-mmio: queue {queue}: register {reg:#x} = {value:#x} ignored ({e}); \
             further invalid queue writes are not logged until the device is reset"
        ));
    }

    /// A warning caused by the guest, within the device's log budget.
    fn guest_warn(&mut self, message: std::fmt::Arguments<'_>) {
        let device_type = self.device.device_type();
        let take = self.log_budget.take(Instant::now());
        if take.suppressed_before > 0 {
            warn!(
                device_type,
                suppressed = take.suppressed_before,
                "virtio device warnings not logged (rate limit)"
            );
        }
        if take.allowed {
            warn!(device_type, "{message}");
        }
    }

    fn write_status(&mut self, value: u32) {
        if value == 0 {
            self.reset();
            return;
        }
        // The driver only adds bits; NEEDS_RESET belongs to the device.
        let kept = self.status & VIRTIO_CONFIG_S_NEEDS_RESET;
        let value = value & !VIRTIO_CONFIG_S_NEEDS_RESET;
        if value & self.status != self.status & !VIRTIO_CONFIG_S_NEEDS_RESET {
            debug!(
                old = self.status,
                new = value,
                "virtio-mmio: status bits cleared without reset"
            );
            return;
        }
        let added = value & !self.status;
        let mut value = value;
        if added & VIRTIO_CONFIG_S_FEATURES_OK != 0 && !self.features_acceptable() {
            value &= !VIRTIO_CONFIG_S_FEATURES_OK;
        }
        if added & VIRTIO_CONFIG_S_DRIVER_OK != 0 {
            if value & VIRTIO_CONFIG_S_FEATURES_OK == 0 {
                debug!("virtio-mmio: DRIVER_OK without FEATURES_OK");
                return;
            }
            if let Some(index) = self.invalid_queue() {
                self.status = value | kept;
                self.fail(&format!(
                    "queue {index} is not inside guest memory or has an invalid size"
                ));
                return;
            }
            let event_idx = self.driver_features & (1 << VIRTIO_RING_F_EVENT_IDX) != 0;
            for q in &mut self.queues {
                q.set_event_idx(event_idx);
            }
            if let Err(why) =
                self.device
                    .activate_queues(self.driver_features, &self.queues, &self.mem)
            {
                self.status = value | kept;
                self.fail(&why);
                return;
            }
        }
        self.status = value | kept;
    }

    /// Driver features must be a subset of the offer and include VIRTIO_F_VERSION_1.
    fn features_acceptable(&self) -> bool {
        let offered = self.offered_features();
        self.driver_features & !offered == 0
            && self.driver_features & (1 << VIRTIO_F_VERSION_1) != 0
    }

    fn invalid_queue(&self) -> Option<usize> {
        self.queues
            .iter()
            .position(|q| q.ready() && !rings_in_memory(q, &self.mem))
    }

    fn reset(&mut self) {
        self.device.reset();
        for queue in &mut self.queues {
            queue.reset();
        }
        self.status = 0;
        self.device_features_sel = 0;
        self.driver_features_sel = 0;
        self.driver_features = 0;
        self.queue_sel = 0;
        self.failure_logged = false;
        self.invalid_logged = false;
        self.interrupt.reset();
    }

    /// Queue `index` has new buffers (a `QueueNotify` write or its ioeventfd).
    pub fn notify(&mut self, index: usize) {
        let running = self.status & (VIRTIO_CONFIG_S_DRIVER_OK | VIRTIO_CONFIG_S_NEEDS_RESET)
            == VIRTIO_CONFIG_S_DRIVER_OK;
        let Some(queue) = self.queues.get_mut(index) else {
            debug!(
                index,
                "virtio-mmio: notification for a queue that does not exist"
            );
            return;
        };
        if !running || !queue.ready() {
            return;
        }
        // With VIRTIO_RING_F_EVENT_IDX the driver notifies only when told to (the used ring's
        // avail_event): re-arm after each pass and serve what came in meanwhile, then
        // interrupt only if the driver's used_event asks for it.
        let event_idx = self.driver_features & (1 << VIRTIO_RING_F_EVENT_IDX) != 0;
        match serve(self.device.as_mut(), index, queue, &self.mem, event_idx) {
            Ok(false) => {}
            Ok(true) => {
                let used = self.device.used_queues(index);
                if let Err(e) = self.interrupt.signal_queues(used) {
                    warn!(error = %e, "virtio-mmio: cannot raise the queue interrupt");
                }
            }
            Err(why) => self.fail(&why),
        }
    }

    /// Puts the device into NEEDS_RESET, logs once, and tells the driver.
    fn fail(&mut self, why: &str) {
        self.status |= VIRTIO_CONFIG_S_NEEDS_RESET;
        if !self.failure_logged {
            self.failure_logged = true;
            self.guest_warn(format_args!("virtio device needs reset: {why}"));
        }
        if self.status & VIRTIO_CONFIG_S_DRIVER_OK != 0 {
            if let Err(e) = self.interrupt.signal_config_change() {
                warn!(error = %e, "virtio-mmio: cannot raise the config interrupt");
            }
        }
    }
}

impl Drop for MmioTransport {
    /// The last word of the device's log budget: warnings its window refused.
    fn drop(&mut self) {
        let suppressed = self.log_budget.unreported();
        if suppressed > 0 {
            warn!(
                device_type = self.device.device_type(),
                suppressed, "virtio device warnings not logged (rate limit)"
            );
        }
    }
}

/// Serves queue `index` until it is empty (re-arming notifications with EVENT_IDX); returns
/// whether the driver is to be interrupted.
fn serve(
    device: &mut dyn VirtioDevice,
    index: usize,
    queue: &mut Queue,
    mem: &GuestMemoryMmap,
    event_idx: bool,
) -> Result<bool, String> {
    let queue_err = |e: virtio_queue::Error| format!("queue {index}: {e}");
    let mut used = false;
    let first_used = queue.next_used();
    loop {
        let before = queue.next_avail();
        used |= device
            .process_queue(index, queue, mem)
            .map_err(|e| error_chain(&e))?;
        if !event_idx || !queue.enable_notification(mem).map_err(queue_err)? {
            break;
        }
        // Buffers are still available. A pass that took none is a device waiting for its
        // backend (a receive queue with no frame yet): it is served again when one comes.
        if queue.next_avail() == before {
            break;
        }
    }
    Ok(used && needs_interrupt(queue, mem, event_idx, first_used).map_err(queue_err)?)
}

/// Whether the driver wants an interrupt for the used entries from `first_used` to the used
/// index now: always without VIRTIO_RING_F_EVENT_IDX, else when its `used_event` lies among
/// them (virtio 1.2, 2.7.10). Computed from the used indexes rather than virtio-queue's count
/// of `add_used` calls, so entries added together (`device::add_used_together`) count too.
fn needs_interrupt(
    queue: &Queue,
    mem: &GuestMemoryMmap,
    event_idx: bool,
    first_used: u16,
) -> Result<bool, virtio_queue::Error> {
    if !event_idx {
        return Ok(true);
    }
    // The used index stores happened before this load of used_event.
    fence(Ordering::SeqCst);
    // The available ring: flags, idx, `size` entries of 2 bytes, then used_event.
    let offset = 4 + 2 * u64::from(queue.size());
    let addr = GuestAddress(queue.avail_ring())
        .checked_add(offset)
        .ok_or(virtio_queue::Error::AddressOverflow)?;
    let used_event: u16 = mem
        .load(addr, Ordering::Acquire)
        .map(u16::from_le)
        .map_err(virtio_queue::Error::GuestMemory)?;
    let new = Wrapping(queue.next_used());
    Ok(new - Wrapping(used_event) - Wrapping(1) < new - Wrapping(first_used))
}

/// Writes half of a ring address through virtio-queue's checking setter (which refuses a
/// misaligned address without logging); the other half keeps its value.
fn set_ring_address(queue: &mut Queue, reg: u32, value: u32) -> Result<(), virtio_queue::Error> {
    let current = match reg {
        VIRTIO_MMIO_QUEUE_DESC_LOW | VIRTIO_MMIO_QUEUE_DESC_HIGH => queue.desc_table(),
        VIRTIO_MMIO_QUEUE_AVAIL_LOW | VIRTIO_MMIO_QUEUE_AVAIL_HIGH => queue.avail_ring(),
        _ => queue.used_ring(),
    };
    let value = u64::from(value);
    let addr = GuestAddress(match reg {
        VIRTIO_MMIO_QUEUE_DESC_LOW | VIRTIO_MMIO_QUEUE_AVAIL_LOW | VIRTIO_MMIO_QUEUE_USED_LOW => {
            (current & !0xffff_ffff) | value
        }
        _ => (current & 0xffff_ffff) | (value << 32),
    });
    match reg {
        VIRTIO_MMIO_QUEUE_DESC_LOW | VIRTIO_MMIO_QUEUE_DESC_HIGH => {
            queue.try_set_desc_table_address(addr)
        }
        VIRTIO_MMIO_QUEUE_AVAIL_LOW | VIRTIO_MMIO_QUEUE_AVAIL_HIGH => {
            queue.try_set_avail_ring_address(addr)
        }
        _ => queue.try_set_used_ring_address(addr),
    }
}

/// Whether a ready queue's descriptor table, available and used rings lie inside guest memory
/// (virtio-queue's `is_valid` without its error log).
fn rings_in_memory(queue: &Queue, mem: &GuestMemoryMmap) -> bool {
    let size = u64::from(queue.size());
    // virtq_desc is 16 bytes; the rings have flags, idx and the event word around their
    // 2-byte (available) or 8-byte (used) entries.
    let rings = [
        (queue.desc_table(), 16 * size),
        (queue.avail_ring(), 6 + 2 * size),
        (queue.used_ring(), 6 + 8 * size),
    ];
    rings.iter().all(|&(addr, len)| {
        usize::try_from(len)
            .is_ok_and(|len| GuestMemoryBackend::check_range(mem, GuestAddress(addr), len))
    })
}

/// The register at `offset` for a 4-byte aligned access.
fn register(offset: u64, len: usize) -> Option<u32> {
    if len != 4 || offset % 4 != 0 {
        return None;
    }
    u32::try_from(offset).ok()
}

fn low32(value: u64) -> u32 {
    (value & 0xffff_ffff) as u32
}

fn error_chain(e: &DeviceError) -> String {
    let mut out = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        out.push_str(": ");
        out.push_str(&cause.to_string());
        source = cause.source();
    }
    out
}

/// Status bits a driver sets on the way to DRIVER_OK, in order (used by tests and the VMM's
/// own diagnostics).
pub const DRIVER_INIT_SEQUENCE: [u32; 3] = [
    VIRTIO_CONFIG_S_ACKNOWLEDGE,
    VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER,
    VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER | VIRTIO_CONFIG_S_FEATURES_OK,
];

#[path = "mmio_persist.rs"]
mod persist;
pub use persist::{QueueState, TransportState};

#[cfg(test)]
#[path = "mmio_tests.rs"]
mod tests;
