//! The virtio-mmio bus: guest-physical windows → transports. The vCPU's MMIO exit handler
//! asks the bus first; an address no window holds is left to the VM's unknown-access policy.

use std::sync::{Arc, Mutex, PoisonError};

use crate::interrupt::Interrupt;
use crate::mmio::{MmioTransport, INTERRUPT_ACK_OFFSET, INTERRUPT_STATUS_OFFSET, MMIO_WINDOW_SIZE};

/// Why a device could not be put on the bus.
#[derive(Debug, thiserror::Error)]
pub enum BusError {
    /// The window overlaps one already on the bus.
    #[error("virtio-mmio window {base:#x} overlaps the device at {other:#x}")]
    Overlap {
        /// The new window.
        base: u64,
        /// The window it overlaps.
        other: u64,
    },
}

/// A transport shared between the vCPUs (register accesses) and the I/O thread (queues).
pub type SharedTransport = Arc<Mutex<MmioTransport>>;

/// The virtio-mmio windows of one VM.
///
/// ```
/// use std::sync::{Arc, Mutex};
/// use vmhost_devices::bus::MmioBus;
/// use vmhost_devices::{Interrupt, MmioTransport, Rng};
/// use vm_memory::{GuestAddress, GuestMemoryMmap};
/// use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
///
/// let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
/// let irq = Arc::new(Interrupt::new(EventFd::new(EFD_NONBLOCK).unwrap()));
/// let t = MmioTransport::new(Box::new(Rng::new()), mem, irq).unwrap();
/// let mut bus = MmioBus::default();
/// bus.insert(0xd000_0000, Arc::new(Mutex::new(t))).unwrap();
/// let mut id = [0u8; 4];
/// assert!(bus.read(0xd000_0008, &mut id));
/// assert_eq!(u32::from_le_bytes(id), 4); // virtio-rng
/// assert!(!bus.read(0xd000_1000, &mut id));
/// ```
#[derive(Debug, Default)]
pub struct MmioBus {
    windows: Vec<Window>,
}

/// One device's window: its transport, and its interrupt for the registers answered without
/// the transport's lock.
#[derive(Debug)]
struct Window {
    base: u64,
    transport: SharedTransport,
    interrupt: Arc<Interrupt>,
}

impl MmioBus {
    /// Puts `transport` at `base` (a [`MMIO_WINDOW_SIZE`] window).
    pub fn insert(&mut self, base: u64, transport: SharedTransport) -> Result<(), BusError> {
        if let Some(other) = self
            .windows
            .iter()
            .find(|w| base < w.base + MMIO_WINDOW_SIZE && w.base < base + MMIO_WINDOW_SIZE)
        {
            return Err(BusError::Overlap {
                base,
                other: other.base,
            });
        }
        let interrupt = Arc::clone(
            transport
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .interrupt(),
        );
        self.windows.push(Window {
            base,
            transport,
            interrupt,
        });
        self.windows.sort_by_key(|w| w.base);
        Ok(())
    }

    fn find(&self, gpa: u64) -> Option<(u64, &Window)> {
        let i = self
            .windows
            .partition_point(|w| w.base <= gpa)
            .checked_sub(1)?;
        let w = &self.windows[i];
        (gpa - w.base < MMIO_WINDOW_SIZE).then_some((gpa - w.base, w))
    }

    /// A guest read at `gpa`; false when no window holds it.
    pub fn read(&self, gpa: u64, data: &mut [u8]) -> bool {
        let Some((offset, w)) = self.find(gpa) else {
            return false;
        };
        if offset == INTERRUPT_STATUS_OFFSET && data.len() == 4 {
            data.copy_from_slice(&w.interrupt.read_status().to_le_bytes());
            return true;
        }
        w.transport
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .read(offset, data);
        true
    }

    /// A guest write at `gpa`; false when no window holds it.
    pub fn write(&self, gpa: u64, data: &[u8]) -> bool {
        let Some((offset, w)) = self.find(gpa) else {
            return false;
        };
        if let (INTERRUPT_ACK_OFFSET, Ok(bytes)) = (offset, <[u8; 4]>::try_from(data)) {
            w.interrupt.ack(u32::from_le_bytes(bytes));
            return true;
        }
        w.transport
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .write(offset, data);
        true
    }

    /// Number of devices on the bus.
    pub fn len(&self) -> usize {
        self.windows.len()
    }

    /// Whether the bus is empty.
    pub fn is_empty(&self) -> bool {
        self.windows.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

    use super::*;
    use crate::interrupt::Interrupt;
    use crate::rng::Rng;
    use crate::testutil::memory;

    fn transport() -> SharedTransport {
        let irq = Arc::new(Interrupt::new(EventFd::new(EFD_NONBLOCK).unwrap()));
        let t = MmioTransport::new(Box::new(Rng::new()), memory(), irq).unwrap();
        Arc::new(Mutex::new(t))
    }

    #[test]
    fn overlapping_windows_are_refused() {
        let mut bus = MmioBus::default();
        bus.insert(0xd000_0000, transport()).unwrap();
        bus.insert(0xd000_2000, transport()).unwrap();
        let err = bus.insert(0xd000_1800, transport()).unwrap_err();
        assert!(
            matches!(
                err,
                BusError::Overlap {
                    other: 0xd000_2000,
                    ..
                }
            ),
            "{err:?}"
        );
        assert_eq!(bus.len(), 2);
    }

    #[test]
    fn accesses_reach_the_window_that_holds_them() {
        let mut bus = MmioBus::default();
        let a = transport();
        bus.insert(0xd000_1000, a.clone()).unwrap();
        bus.insert(0xd000_0000, transport()).unwrap();
        assert!(
            bus.write(0xd000_1070, &1u32.to_le_bytes()),
            "Status = ACKNOWLEDGE"
        );
        assert_eq!(a.lock().unwrap().status(), 1);
        let mut b = [0u8; 4];
        assert!(bus.read(0xd000_1070, &mut b));
        assert_eq!(u32::from_le_bytes(b), 1);
        assert!(!bus.read(0xcfff_fffc, &mut b));
        assert!(!bus.write(0xd000_2000, &b));
    }

    /// InterruptStatus and InterruptACK are answered while an I/O thread holds the
    /// transport (serving a long request): a vCPU in the interrupt handler never waits.
    #[test]
    fn interrupt_registers_do_not_wait_for_the_transport_lock() {
        let mut bus = MmioBus::default();
        let t = transport();
        bus.insert(0xd000_0000, t.clone()).unwrap();
        let irq = Arc::clone(t.lock().unwrap().interrupt());
        irq.signal_used_queue().unwrap();
        let bus = Arc::new(bus);
        let held = t.lock().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let reader = {
            let bus = Arc::clone(&bus);
            std::thread::spawn(move || {
                let mut b = [0u8; 4];
                assert!(bus.read(0xd000_0060, &mut b));
                tx.send(u32::from_le_bytes(b)).unwrap();
                assert!(bus.write(0xd000_0064, &1u32.to_le_bytes()));
                tx.send(u32::MAX).unwrap();
            })
        };
        let got = rx.recv_timeout(std::time::Duration::from_secs(10));
        let acked = rx.recv_timeout(std::time::Duration::from_secs(10));
        drop(held);
        reader.join().unwrap();
        assert_eq!(
            got,
            Ok(1),
            "InterruptStatus read while the transport was held"
        );
        assert_eq!(
            acked,
            Ok(u32::MAX),
            "InterruptACK written while it was held"
        );
        assert_eq!(irq.status(), 0, "the ACK cleared the bit");
    }

    /// With acknowledge-on-read (KVM absorbs InterruptACK), a read returns the bits once.
    #[test]
    fn status_reads_acknowledge_when_asked_to() {
        let mut bus = MmioBus::default();
        let t = transport();
        bus.insert(0xd000_0000, t.clone()).unwrap();
        let irq = Arc::clone(t.lock().unwrap().interrupt());
        let read = || {
            let mut b = [0u8; 4];
            assert!(bus.read(0xd000_0060, &mut b));
            u32::from_le_bytes(b)
        };
        irq.signal_used_queue().unwrap();
        assert_eq!((read(), read()), (1, 1), "plain reads leave the bits");
        irq.set_ack_on_read(true);
        irq.signal_config_change().unwrap();
        assert_eq!(
            (read(), read()),
            (3, 0),
            "the first read acknowledged both bits"
        );
    }
}
