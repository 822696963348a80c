//! The interrupt line of one virtio-mmio device: the `InterruptStatus` bits the driver reads
//! and acknowledges, and the eventfd that raises the device's GSI (a KVM irqfd once wired).
//!
//! The [`crate::MmioBus`] answers `InterruptStatus` and `InterruptACK` from here without
//! taking the transport's lock, so a vCPU in the guest's interrupt handler never waits for an
//! I/O thread that is serving the device's queues.
//!
//! With [`Interrupt::set_ack_on_read`] a read of `InterruptStatus` also acknowledges what it
//! returns. vmhost turns it on when KVM absorbs the driver's `InterruptACK` writes in an
//! ioeventfd, which saves one exit to vmhost per interrupt: Linux's virtio-mmio driver writes
//! back exactly the bits it has just read, so the two behave the same for it.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;

use virtio_bindings::virtio_mmio::{VIRTIO_MMIO_INT_CONFIG, VIRTIO_MMIO_INT_VRING};
use vmm_sys_util::eventfd::EventFd;

use crate::msix::Msix;

/// Why an interrupt could not be raised.
#[derive(Debug, thiserror::Error)]
pub enum InterruptError {
    /// Writing the irqfd (or sending the MSI-X message) failed.
    #[error("cannot signal the interrupt eventfd or MSI-X message")]
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
///
/// // Acknowledge on read: what a read returns is cleared.
/// irq.set_ack_on_read(true);
/// irq.signal_used_queue().unwrap();
/// assert_eq!(irq.read_status(), 1);
/// assert_eq!(irq.read_status(), 0);
/// ```
#[derive(Debug)]
pub struct Interrupt {
    status: AtomicU32,
    ack_on_read: AtomicBool,
    irqfd: EventFd,
    /// A virtio-pci function's vectors: while the driver has MSI-X on, queue and
    /// configuration interrupts are messages and the status bits stay clear.
    msix: Option<Arc<Msix>>,
}

impl Interrupt {
    /// An interrupt raised through `irqfd`.
    pub fn new(irqfd: EventFd) -> Self {
        Interrupt {
            status: AtomicU32::new(0),
            ack_on_read: AtomicBool::new(false),
            irqfd,
            msix: None,
        }
    }

    /// An interrupt of a virtio-pci function: MSI-X messages through `msix` once the driver
    /// enables it, `irqfd` and the status bits (the ISR) before.
    pub fn with_msix(irqfd: EventFd, msix: Arc<Msix>) -> Self {
        Interrupt {
            msix: Some(msix),
            ..Interrupt::new(irqfd)
        }
    }

    /// The function's MSI-X vectors, for a virtio-pci device.
    pub fn msix(&self) -> Option<&Arc<Msix>> {
        self.msix.as_ref()
    }

    fn msix_on(&self) -> Option<&Msix> {
        self.msix.as_deref().filter(|m| m.enabled())
    }

    /// The status bits, without side effects.
    pub fn status(&self) -> u32 {
        self.status.load(Ordering::SeqCst)
    }

    /// A driver's read of the `InterruptStatus` register: the status bits, which are also
    /// acknowledged when [`Interrupt::set_ack_on_read`] is on.
    pub fn read_status(&self) -> u32 {
        if self.ack_on_read.load(Ordering::Relaxed) {
            self.status.swap(0, Ordering::SeqCst)
        } else {
            self.status()
        }
    }

    /// Makes reads of `InterruptStatus` acknowledge what they return (for when the driver's
    /// `InterruptACK` writes never reach the device, absorbed by a KVM ioeventfd).
    pub fn set_ack_on_read(&self, on: bool) {
        self.ack_on_read.store(on, Ordering::Relaxed);
    }

    /// `InterruptACK`: clears the acknowledged bits.
    pub fn ack(&self, bits: u32) {
        self.status.fetch_and(!bits, Ordering::SeqCst);
    }

    /// Clears every bit (device reset).
    pub fn reset(&self) {
        self.status.store(0, Ordering::SeqCst);
    }

    /// Sets the status bits a restored device had (without raising the line: see
    /// [`Interrupt::raise_pending`]).
    pub fn restore_status(&self, bits: u32) {
        self.status.store(bits, Ordering::SeqCst);
    }

    /// Raises the line for the bits already set (a restored device whose interrupt was
    /// pending when it was saved).
    pub fn raise_pending(&self) -> Result<(), InterruptError> {
        self.irqfd.write(1).map_err(InterruptError::Signal)
    }

    /// The device used buffers of a queue.
    pub fn signal_used_queue(&self) -> Result<(), InterruptError> {
        self.raise(VIRTIO_MMIO_INT_VRING)
    }

    /// The device used buffers of the queues in `mask` (bit per queue): each queue's MSI-X
    /// vector when the driver enabled MSI-X, else one [`Interrupt::signal_used_queue`].
    pub fn signal_queues(&self, mask: u64) -> Result<(), InterruptError> {
        let Some(m) = self.msix_on() else {
            return self.signal_used_queue();
        };
        (0..64)
            .filter(|q| mask & (1 << q) != 0)
            .try_for_each(|q| m.signal_queue(q).map_err(InterruptError::Signal))
    }

    /// The configuration space (or the device status, e.g. NEEDS_RESET) changed.
    pub fn signal_config_change(&self) -> Result<(), InterruptError> {
        match self.msix_on() {
            Some(m) => m.signal_config().map_err(InterruptError::Signal),
            None => self.raise(VIRTIO_MMIO_INT_CONFIG),
        }
    }

    fn raise(&self, bit: u32) -> Result<(), InterruptError> {
        self.status.fetch_or(bit, Ordering::SeqCst);
        self.irqfd.write(1).map_err(InterruptError::Signal)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use vmm_sys_util::eventfd::EFD_NONBLOCK;

    use super::*;
    use crate::msix::{MsiSink, MSIX_CONTROL_ENABLE, MSIX_ENTRY_SIZE};

    #[derive(Debug, Default)]
    struct Sent(Mutex<Vec<u32>>);
    impl MsiSink for Sent {
        fn send(&self, _address: u64, data: u32) -> std::io::Result<()> {
            self.0.lock().unwrap().push(data);
            Ok(())
        }
    }

    /// Two used rings in one pass (the kernel's vhost): each queue's vector is raised once
    /// MSI-X is on; before, one edge on the line and the status bit.
    #[test]
    fn used_queues_raise_each_vector_under_msix() {
        let sent = Arc::new(Sent::default());
        let msix = Arc::new(Msix::new(3, 2, sent.clone()));
        let line = EventFd::new(EFD_NONBLOCK).unwrap();
        let irq = Interrupt::with_msix(line.try_clone().unwrap(), msix.clone());
        irq.signal_queues(0b11).unwrap();
        assert_eq!(line.read().unwrap(), 1, "one edge before MSI-X is on");
        assert_eq!(irq.status(), 1);
        irq.ack(1);
        for v in 0..2u16 {
            let at = u64::from(v) * MSIX_ENTRY_SIZE;
            msix.table_write(at, &0xfee0_0000u32.to_le_bytes());
            msix.table_write(at + 8, &(0x40 + u32::from(v)).to_le_bytes());
            msix.table_write(at + 12, &0u32.to_le_bytes());
            msix.set_queue_vector(usize::from(v), v);
        }
        msix.set_control(MSIX_CONTROL_ENABLE);
        irq.signal_queues(0b11).unwrap();
        assert_eq!(*sent.0.lock().unwrap(), vec![0x40, 0x41]);
        assert_eq!(irq.status(), 0, "no status bit with MSI-X");
        assert!(line.read().is_err(), "and no edge on the line");
    }
}
