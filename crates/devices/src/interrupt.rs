//! The interrupt line of one virtio-mmio device: the `InterruptStatus` bits the driver reads
//! and acknowledges, and the eventfd that raises the device's GSI (a KVM irqfd once wired).

use std::sync::atomic::{AtomicU32, Ordering};

use virtio_bindings::virtio_mmio::{VIRTIO_MMIO_INT_CONFIG, VIRTIO_MMIO_INT_VRING};
use vmm_sys_util::eventfd::EventFd;

/// Why an interrupt could not be raised.
#[derive(Debug, thiserror::Error)]
pub enum InterruptError {
    /// Writing the irqfd failed.
    #[error("cannot signal the interrupt eventfd")]
    Signal(#[source] std::io::Error),
}

/// The interrupt of one device: status bits plus an eventfd (irqfd) to raise the line.
///
/// ```
/// use vmhost_devices::Interrupt;
/// use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
/// let fd = EventFd::new(EFD_NONBLOCK).unwrap();
/// let irq = Interrupt::new(fd.try_clone().unwrap());
/// irq.signal_used_queue().unwrap();
/// assert_eq!(irq.status(), 1);
/// assert_eq!(fd.read().unwrap(), 1);
/// irq.ack(1);
/// assert_eq!(irq.status(), 0);
/// ```
#[derive(Debug)]
pub struct Interrupt {
    status: AtomicU32,
    irqfd: EventFd,
}

impl Interrupt {
    /// An interrupt raised through `irqfd`.
    pub fn new(irqfd: EventFd) -> Self {
        Interrupt {
            status: AtomicU32::new(0),
            irqfd,
        }
    }

    /// The `InterruptStatus` register.
    pub fn status(&self) -> u32 {
        self.status.load(Ordering::SeqCst)
    }

    /// `InterruptACK`: clears the acknowledged bits.
    pub fn ack(&self, bits: u32) {
        self.status.fetch_and(!bits, Ordering::SeqCst);
    }

    /// Clears every bit (device reset).
    pub fn reset(&self) {
        self.status.store(0, Ordering::SeqCst);
    }

    /// The device used buffers of a queue.
    pub fn signal_used_queue(&self) -> Result<(), InterruptError> {
        self.raise(VIRTIO_MMIO_INT_VRING)
    }

    /// The configuration space (or the device status, e.g. NEEDS_RESET) changed.
    pub fn signal_config_change(&self) -> Result<(), InterruptError> {
        self.raise(VIRTIO_MMIO_INT_CONFIG)
    }

    fn raise(&self, bit: u32) -> Result<(), InterruptError> {
        self.status.fetch_or(bit, Ordering::SeqCst);
        self.irqfd.write(1).map_err(InterruptError::Signal)
    }
}
