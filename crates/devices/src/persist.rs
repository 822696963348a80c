//! The state of a VM's devices that moves with it (snapshot/restore, live migration): the
//! aggregate [`DevicesState`] and the errors of saving and restoring it.
//!
//! Each part lives with its owner, as in Firecracker (a `persist.rs` beside each device):
//!
//! - the virtio-mmio transport and its queues, ring indices included: [`crate::mmio`]
//!   ([`TransportState`], [`QueueState`]);
//! - each device's own state: [`crate::block`] ([`BlockState`]), [`crate::net`]
//!   ([`NetState`]), [`crate::rng`] ([`RngState`]), [`crate::vsock`] ([`VsockState`]);
//! - the port-I/O devices of a Linux guest (COM1, the legacy ports) are vmhost-vcpu's: their
//!   state is carried here as plain data ([`UartState`], [`LegacyState`]) and filled in by
//!   `vmhost_vcpu::devices::LinuxDevices::save`.
//!
//! The types are serde data and know no file or stream format (`vmhost-persist` has those).
//! A restore builds the devices from the plan as a fresh start does, then applies a
//! [`VirtioSlotState`] to each transport with [`MmioTransport::restore`]; every value is
//! checked first (queue sizes, ring addresses inside guest RAM, features the rebuilt device
//! offers, the image behind a disk), and a state that does not fit is refused with a
//! [`StateError`] naming the value, never applied in part.
//!
//! ```
//! use vmhost_devices::persist::{check_restorable, DevicesState};
//! let state: DevicesState = serde_json::from_str(r#"{"virtio": []}"#).unwrap();
//! check_restorable(&state).unwrap();
//! ```

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::disk::{CacheMode, DiskError, DiskImage, SECTOR_SIZE};
use crate::mmio::MmioTransport;
use crate::worker::WorkerError;

pub use crate::block::BlockState;
pub use crate::mmio::{QueueState, TransportState};
pub use crate::net::NetState;
pub use crate::rng::RngState;
pub use crate::vsock::VsockState;

/// The state of every device of a VM.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DevicesState {
    /// The virtio-mmio devices, in the plan's slot order.
    pub virtio: Vec<VirtioSlotState>,
    /// COM1 (a Linux guest's serial port).
    #[serde(default)]
    pub serial: Option<UartState>,
    /// The legacy ports (CMOS index; the power button, reset and pvpanic ports hold none).
    #[serde(default)]
    pub legacy: Option<LegacyState>,
    /// The user-space I/O APIC of a VM with a split irqchip (absent with KVM's in-kernel one,
    /// whose state is the VM's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ioapic: Option<crate::ioapic::IoapicState>,
}

/// One virtio-mmio slot: where it is, its transport and its device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VirtioSlotState {
    /// Guest-physical base of the slot's window (checked against the rebuilt plan's).
    pub base: u64,
    /// The register file and the queues.
    pub transport: TransportState,
    /// The device's own state.
    pub device: DeviceState,
    /// A virtio-pci function's configuration space and MSI-X (absent for virtio-mmio).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pci: Option<crate::virtio_pci::PciSlotState>,
}

/// A virtio device's own state, by kind.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum DeviceState {
    /// virtio-blk.
    Block(BlockState),
    /// virtio-net.
    Net(NetState),
    /// virtio-rng.
    Rng(RngState),
    /// virtio-vsock on a Unix socket.
    Vsock(VsockState),
}

impl DeviceState {
    /// The kind's name for messages.
    pub fn kind(&self) -> &'static str {
        match self {
            DeviceState::Block(_) => "block",
            DeviceState::Net(_) => "net",
            DeviceState::Rng(_) => "rng",
            DeviceState::Vsock(_) => "vsock",
        }
    }
}

/// A 16550A UART's registers and its receive FIFO (vm-superio's `SerialState` as serde
/// data).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(missing_docs)] // the 16550 register names
pub struct UartState {
    pub baud_divisor_low: u8,
    pub baud_divisor_high: u8,
    pub interrupt_enable: u8,
    pub interrupt_identification: u8,
    pub line_control: u8,
    pub line_status: u8,
    pub modem_control: u8,
    pub modem_status: u8,
    pub scratch: u8,
    /// Bytes received and not read by the guest yet (at most the FIFO's 64).
    pub in_buffer: Vec<u8>,
}

/// The legacy ports' state: only the CMOS index register holds any (the RTC's time is the
/// host's, the power-off, reset and pvpanic ports act on a write and keep nothing).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LegacyState {
    /// The last index written to port 0x70.
    pub cmos_index: u8,
}

/// Why one device's saved state cannot be applied to the device built on this host (or
/// cannot be taken).
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// The device cannot save its state yet.
    #[error("saving the state of {device} is not supported yet")]
    Unsupported {
        /// Which device.
        device: &'static str,
    },
    /// The saved device is of another kind than the one in the slot.
    #[error("the saved device is a {saved}, the slot holds a {built}; the specs differ")]
    Kind {
        /// What was saved.
        saved: String,
        /// What the slot holds here.
        built: String,
    },
    /// A field of the saved device differs from the device built here.
    #[error("{field}: saved {saved}, the device built here has {built}; the specs differ")]
    Mismatch {
        /// The field.
        field: &'static str,
        /// The saved value.
        saved: String,
        /// The value here.
        built: String,
    },
    /// A register value no driver can have written.
    #[error("{register} = {value:#x} is not a valid value")]
    Register {
        /// The register.
        register: &'static str,
        /// The value.
        value: u64,
    },
    /// The driver accepted features the device built here does not offer.
    #[error(
        "acknowledged features {acked:#x} are not all offered by the device built here \
         ({offered:#x})"
    )]
    Features {
        /// The saved features.
        acked: u64,
        /// What the device offers.
        offered: u64,
    },
    /// A saved queue does not fit the device.
    #[error("queue {queue}: {what}")]
    Queue {
        /// Queue index.
        queue: usize,
        /// What is wrong (the value is named).
        what: String,
    },
    /// The device refused to start with the restored queues.
    #[error("cannot start the restored device: {0}")]
    Activate(String),
    /// A disk image cannot be opened.
    #[error("disk image")]
    Disk(#[source] DiskError),
}

/// Why the devices' state could not be saved or restored.
#[derive(Debug, thiserror::Error)]
pub enum PersistError {
    /// The number of virtio slots differs.
    #[error("{saved} virtio devices were saved, the VM here has {built}; the specs differ")]
    SlotCount {
        /// Saved slots.
        saved: usize,
        /// Slots here.
        built: usize,
    },
    /// A slot's window moved.
    #[error("virtio slot {index}: saved at {saved:#x}, here at {built:#x}; the specs differ")]
    SlotBase {
        /// Slot index.
        index: usize,
        /// Saved base.
        saved: u64,
        /// Base here.
        built: u64,
    },
    /// One device's state.
    #[error("virtio device at {base:#x}")]
    Slot {
        /// The slot's base.
        base: u64,
        /// The cause.
        #[source]
        source: StateError,
    },
    /// An I/O thread could not be quiesced before the save.
    #[error("cannot quiesce the device I/O threads")]
    Quiesce(#[source] WorkerError),
    /// A disk's image is missing or unusable on this host.
    #[error(
        "disk image {path} of the virtio device at {base:#x} cannot be opened here; make it \
         reachable at the same path (shared storage or a copy) before restoring"
    )]
    DiskMissing {
        /// The image.
        path: PathBuf,
        /// The slot's base.
        base: u64,
        /// The cause.
        #[source]
        source: DiskError,
    },
    /// A disk's image here is not the size it was.
    #[error("disk image {path}: {size} bytes here, the saved disk had {saved} bytes")]
    DiskSize {
        /// The image.
        path: PathBuf,
        /// Its size here.
        size: u64,
        /// The saved capacity.
        saved: u64,
    },
    /// The UART state cannot be applied.
    #[error("serial port: {0}")]
    Serial(String),
    /// A slot was saved with the other transport (virtio-mmio against virtio-pci).
    #[error(
        "virtio slot {index}: saved as a {saved} device, here a {built} one; \
         boot.virtio_announce must be the same as the saved VM's"
    )]
    Transport {
        /// Slot index.
        index: usize,
        /// The saved transport.
        saved: &'static str,
        /// The transport here.
        built: &'static str,
    },
    /// A virtio-pci function's state does not fit the function built here.
    #[error("virtio-pci function at {base:#x}: {why}")]
    Pci {
        /// The slot's base.
        base: u64,
        /// What does not fit.
        why: String,
    },
}

/// Checks, before any memory moves, that `state` can be restored on this host: every disk
/// image the saved VM used (other than those vmhost makes for each run: empty disks and
/// cloud-init seeds) opens, as the saved disk did (read-only or read-write), and has the saved
/// size. The error names the path.
pub fn check_restorable(state: &DevicesState) -> Result<(), PersistError> {
    for slot in &state.virtio {
        let DeviceState::Block(disk) = &slot.device else {
            continue;
        };
        if disk.run_scratch {
            continue;
        }
        let image = DiskImage::open(&disk.path, disk.read_only, CacheMode::Writeback).map_err(
            |source| PersistError::DiskMissing {
                path: disk.path.clone(),
                base: slot.base,
                source,
            },
        )?;
        let saved = disk.capacity_sectors.saturating_mul(SECTOR_SIZE);
        if image.size() / SECTOR_SIZE != disk.capacity_sectors {
            return Err(PersistError::DiskSize {
                path: disk.path.clone(),
                size: image.size(),
                saved,
            });
        }
    }
    if let Some(uart) = &state.serial {
        if uart.in_buffer.len() > UART_FIFO {
            return Err(PersistError::Serial(format!(
                "{} buffered input bytes, the FIFO holds {UART_FIFO}",
                uart.in_buffer.len()
            )));
        }
    }
    Ok(())
}

/// The 16550A's receive FIFO.
pub const UART_FIFO: usize = 64;

/// Saves every transport of `slots` (base, transport) in order. Each transport is locked
/// while it is saved, so a request its I/O thread is serving completes first; the caller
/// quiesces the I/O threads before ([`crate::worker::IoThread::pause`]) so no new request
/// starts afterwards.
pub fn save_transports<'a>(
    slots: impl IntoIterator<Item = (u64, &'a crate::bus::SharedTransport)>,
) -> Result<Vec<VirtioSlotState>, PersistError> {
    slots
        .into_iter()
        .map(|(base, transport)| {
            let mut t = transport
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let (transport, device) = t
                .save()
                .map_err(|source| PersistError::Slot { base, source })?;
            Ok(VirtioSlotState {
                base,
                transport,
                device,
                pci: None,
            })
        })
        .collect()
}

/// Applies the saved `slot` to `transport` built at `base` for slot `index`: the base is
/// checked, then [`MmioTransport::restore`].
pub fn restore_slot(
    index: usize,
    base: u64,
    transport: &mut MmioTransport,
    slot: &VirtioSlotState,
) -> Result<(), PersistError> {
    if slot.base != base {
        return Err(PersistError::SlotBase {
            index,
            saved: slot.base,
            built: base,
        });
    }
    transport
        .restore(&slot.transport, &slot.device)
        .map_err(|source| PersistError::Slot { base, source })
}

#[cfg(test)]
#[path = "persist_tests.rs"]
mod tests;
