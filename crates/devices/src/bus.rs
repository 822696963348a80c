//! The virtio-mmio bus: guest-physical windows → transports. The vCPU's MMIO exit handler
//! asks the bus first; an address no window holds is left to the VM's unknown-access policy.
//!
//! The I/O thread holds a transport's lock while it serves a request, `preadv`/`pwritev`/
//! `fdatasync` included, so a register access can wait as long as the host's storage. A vCPU
//! therefore asks with [`MmioBus::read_or_give_up`]/[`MmioBus::write_or_give_up`]: it waits
//! for the lock only while its `give_up` check (the VM's stop flag) stays false, so a VM over
//! hung storage still stops.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError, TryLockError};
use std::time::Duration;

use crate::interrupt::Interrupt;
use crate::mmio::{MmioTransport, INTERRUPT_ACK_OFFSET, INTERRUPT_STATUS_OFFSET, MMIO_WINDOW_SIZE};
use crate::virtio_pci::{Region, VirtioPciFront};

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

/// What became of a guest access to the bus.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// A device served it.
    Done,
    /// No window holds the address.
    NotMine,
    /// The device was busy (its I/O thread holds it) and `give_up` said to stop waiting: the
    /// access was not done (reads leave `data` untouched).
    GaveUp,
}

/// Longest sleep between two attempts at a busy transport's lock.
const LOCK_POLL_MAX: Duration = Duration::from_millis(2);

/// A transport shared between the vCPUs (register accesses) and the I/O thread (queues).
pub type SharedTransport = Arc<Mutex<MmioTransport>>;

/// The virtio-mmio windows of one VM.
///
/// ```
/// use std::sync::{Arc, Mutex};
/// use vmhost_devices::bus::MmioBus;
/// use vmhost_devices::{Interrupt, MmioTransport, Rng};
/// use vm_memory::GuestAddress;
/// use vmhost_memory::GuestMemoryMmap;
/// use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
///
/// let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
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
    /// A virtio-pci function's BAR 0 instead of a virtio-mmio window.
    pci: Option<Arc<VirtioPciFront>>,
}

impl MmioBus {
    /// Puts `transport` at `base` (a [`MMIO_WINDOW_SIZE`] window).
    pub fn insert(&mut self, base: u64, transport: SharedTransport) -> Result<(), BusError> {
        self.insert_window(base, transport, None)
    }

    /// Puts `transport` behind a virtio-pci function whose BAR 0 is at `base` ([`front`]'s
    /// registers, the same size as a virtio-mmio window).
    ///
    /// [`front`]: VirtioPciFront
    pub fn insert_pci(
        &mut self,
        base: u64,
        transport: SharedTransport,
        front: Arc<VirtioPciFront>,
    ) -> Result<(), BusError> {
        self.insert_window(base, transport, Some(front))
    }

    fn insert_window(
        &mut self,
        base: u64,
        transport: SharedTransport,
        pci: Option<Arc<VirtioPciFront>>,
    ) -> Result<(), BusError> {
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
            pci,
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

    /// A guest read at `gpa`; false when no window holds it. Waits for a busy device however
    /// long it takes (see [`MmioBus::read_or_give_up`]).
    pub fn read(&self, gpa: u64, data: &mut [u8]) -> bool {
        self.read_or_give_up(gpa, data, &|| false) == Access::Done
    }

    /// A guest write at `gpa`; false when no window holds it. Waits for a busy device however
    /// long it takes (see [`MmioBus::write_or_give_up`]).
    pub fn write(&self, gpa: u64, data: &[u8]) -> bool {
        self.write_or_give_up(gpa, data, &|| false) == Access::Done
    }

    /// A guest read at `gpa`. While the device is busy, `give_up` is asked between attempts at
    /// its lock; once it says true the read is abandoned ([`Access::GaveUp`]).
    pub fn read_or_give_up(&self, gpa: u64, data: &mut [u8], give_up: &dyn Fn() -> bool) -> Access {
        let Some((offset, w)) = self.find(gpa) else {
            return Access::NotMine;
        };
        if let Some(front) = &w.pci {
            if VirtioPciFront::region(offset) == Region::Unlocked {
                front.read_unlocked(offset, data, &w.interrupt);
                return Access::Done;
            }
            return match lock_unless(&w.transport, give_up) {
                Some(t) => {
                    front.read(&t, offset, data);
                    Access::Done
                }
                None => Access::GaveUp,
            };
        }
        if offset == INTERRUPT_STATUS_OFFSET && data.len() == 4 {
            data.copy_from_slice(&w.interrupt.read_status().to_le_bytes());
            return Access::Done;
        }
        match lock_unless(&w.transport, give_up) {
            Some(t) => {
                t.read(offset, data);
                Access::Done
            }
            None => Access::GaveUp,
        }
    }

    /// A guest write at `gpa`. While the device is busy, `give_up` is asked between attempts
    /// at its lock; once it says true the write is dropped ([`Access::GaveUp`]).
    pub fn write_or_give_up(&self, gpa: u64, data: &[u8], give_up: &dyn Fn() -> bool) -> Access {
        let Some((offset, w)) = self.find(gpa) else {
            return Access::NotMine;
        };
        if let Some(front) = &w.pci {
            if VirtioPciFront::region(offset) == Region::Unlocked {
                front.write_unlocked(offset, data);
                return Access::Done;
            }
            return match lock_unless(&w.transport, give_up) {
                Some(mut t) => {
                    front.write(&mut t, offset, data);
                    Access::Done
                }
                None => Access::GaveUp,
            };
        }
        if let (INTERRUPT_ACK_OFFSET, Ok(bytes)) = (offset, <[u8; 4]>::try_from(data)) {
            w.interrupt.ack(u32::from_le_bytes(bytes));
            return Access::Done;
        }
        match lock_unless(&w.transport, give_up) {
            Some(mut t) => {
                t.write(offset, data);
                Access::Done
            }
            None => Access::GaveUp,
        }
    }

    /// The devices' windows and transports, by base address (the plan's slot order: the
    /// planner gives slots rising bases).
    pub fn transports(&self) -> impl Iterator<Item = (u64, &SharedTransport)> {
        self.windows.iter().map(|w| (w.base, &w.transport))
    }

    /// The virtio-pci front of the function whose BAR 0 is at `base`, if it is one.
    pub fn pci_front(&self, base: u64) -> Option<&Arc<VirtioPciFront>> {
        self.windows
            .iter()
            .find(|w| w.base == base)
            .and_then(|w| w.pci.as_ref())
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

/// The transport's lock, or None once `give_up` says true while it is held elsewhere. An
/// uncontended lock is taken at once; a held one is retried with a growing sleep (at most
/// [`LOCK_POLL_MAX`]), since a `Mutex` cannot be waited on with a condition beside it.
fn lock_unless<'a>(
    transport: &'a SharedTransport,
    give_up: &dyn Fn() -> bool,
) -> Option<MutexGuard<'a, MmioTransport>> {
    let mut pause = Duration::from_micros(20);
    loop {
        match transport.try_lock() {
            Ok(guard) => return Some(guard),
            Err(TryLockError::Poisoned(p)) => return Some(p.into_inner()),
            Err(TryLockError::WouldBlock) => {}
        }
        if give_up() {
            return None;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(LOCK_POLL_MAX);
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
