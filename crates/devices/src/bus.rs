//! The virtio-mmio bus: guest-physical windows → transports. The vCPU's MMIO exit handler
//! asks the bus first; an address no window holds is left to the VM's unknown-access policy.

use std::sync::{Arc, Mutex, PoisonError};

use crate::mmio::{MmioTransport, MMIO_WINDOW_SIZE};

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
    windows: Vec<(u64, SharedTransport)>,
}

impl MmioBus {
    /// Puts `transport` at `base` (a [`MMIO_WINDOW_SIZE`] window).
    pub fn insert(&mut self, base: u64, transport: SharedTransport) -> Result<(), BusError> {
        if let Some((other, _)) = self
            .windows
            .iter()
            .find(|(b, _)| base < b + MMIO_WINDOW_SIZE && *b < base + MMIO_WINDOW_SIZE)
        {
            return Err(BusError::Overlap {
                base,
                other: *other,
            });
        }
        self.windows.push((base, transport));
        self.windows.sort_by_key(|(b, _)| *b);
        Ok(())
    }

    fn find(&self, gpa: u64) -> Option<(u64, &SharedTransport)> {
        let i = self
            .windows
            .partition_point(|(b, _)| *b <= gpa)
            .checked_sub(1)?;
        let (base, t) = &self.windows[i];
        (gpa - base < MMIO_WINDOW_SIZE).then_some((gpa - base, t))
    }

    /// A guest read at `gpa`; false when no window holds it.
    pub fn read(&self, gpa: u64, data: &mut [u8]) -> bool {
        let Some((offset, t)) = self.find(gpa) else {
            return false;
        };
        t.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .read(offset, data);
        true
    }

    /// A guest write at `gpa`; false when no window holds it.
    pub fn write(&self, gpa: u64, data: &[u8]) -> bool {
        let Some((offset, t)) = self.find(gpa) else {
            return false;
        };
        t.lock()
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
}
