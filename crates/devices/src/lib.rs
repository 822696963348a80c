//! vmhost's virtio devices and their transports: virtio-mmio, and virtio-pci with MSI-X.
//!
//! - [`mmio`]: the virtio-mmio v2 register file and device status state machine, KVM-free.
//! - [`block`] (over [`disk`]), [`net`], [`rng`], [`vsock`]: the devices, one module each.
//! - [`chain`]: descriptor chains checked before a device reads them; malformed guest input
//!   becomes a [`DeviceError`] and the transport puts the device into NEEDS_RESET.
//! - [`iov`]: a chain's buffers as `iovec`s into guest memory, for `preadv`/`pwritev` and
//!   `readv`/`writev` without a bounce buffer.
//! - [`interrupt`]: interrupt status plus the eventfd (irqfd) that raises the GSI, or the
//!   MSI-X vectors ([`msix`]) of a virtio-pci function.
//! - [`ioapic`]: the I/O APIC of a VM with a split irqchip (its entries become MSI routes).
//! - [`pci`], [`virtio_pci`]: bus 0 behind configuration mechanism #1 and the virtio-pci
//!   transport, a front on the virtio-mmio one (the same status machine and queues).
//! - [`persist`]: the devices' state that moves with the VM (snapshot/restore, migration).
//! - [`ratelimit`]: the per-source log budget for warnings a guest can cause.
//!
//! Queues are rust-vmm's `virtio-queue`; constants come from `virtio-bindings`.
//!
//! ```
//! use std::sync::Arc;
//! use vmhost_devices::{Interrupt, MmioTransport, Rng, MMIO_MAGIC};
//! use vm_memory::GuestAddress;
//! use vmhost_memory::GuestMemoryMmap;
//! use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
//!
//! let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
//! let irq = Arc::new(Interrupt::new(EventFd::new(EFD_NONBLOCK).unwrap()));
//! let dev = MmioTransport::new(Box::new(Rng::new()), mem, irq).unwrap();
//! let mut magic = [0u8; 4];
//! dev.read(0, &mut magic);
//! assert_eq!(u32::from_le_bytes(magic), MMIO_MAGIC);
//! ```
#![warn(missing_docs)]

pub mod block;
pub mod bus;
pub mod chain;
pub mod device;
pub mod disk;
pub mod host;
pub mod interrupt;
pub mod ioapic;
pub mod iov;
pub mod mmio;
pub mod msix;
pub mod net;
pub mod pci;
pub mod persist;
pub mod ratelimit;
pub mod rng;
pub mod seed;
mod sys;
pub mod virtio_pci;
pub mod vsock;
pub mod worker;

#[cfg(test)]
mod testutil;

pub use block::{Block, BlockConfig, BlockError, BlockStats};
pub use device::{DeviceError, VirtioDevice};
pub use disk::{CacheMode, DiskError};
pub use interrupt::{Interrupt, InterruptError};
pub use mmio::{MmioError, MmioTransport, MMIO_MAGIC, MMIO_VERSION, MMIO_WINDOW_SIZE};
pub use net::{Net, NetError, NetStats, Tap};
pub use persist::{DevicesState, PersistError, StateError};
pub use ratelimit::LogBudget;
pub use rng::Rng;
pub use vsock::{Vsock, VsockError};
