//! The virtio-pci (modern, virtio 1.x) transport, as a front on the virtio-mmio one: a
//! function's BAR 0 holds the common configuration, ISR, notification and device-specific
//! structures and the MSI-X table, and each access is translated to the [`MmioTransport`]
//! register it stands for, so the device status machine, the queues, the devices and their
//! saved state are the same code for both transports.
//!
//! BAR 0 (4 KiB):
//!
//! | offset | structure |
//! |---|---|
//! | `0x000` | common configuration (`struct virtio_pci_common_cfg`) |
//! | `0x040` | ISR status (read to acknowledge) |
//! | `0x050` | notifications: every queue at the same address, the written value is the queue index (`notify_off_multiplier` 0), a KVM ioeventfd per queue |
//! | `0x100` | device-specific configuration |
//! | `0x800` | MSI-X table, one vector per queue plus one for configuration changes |
//! | `0xc00` | MSI-X pending bits |
//!
//! With MSI-X a queue's interrupt is one message and costs the guest no exit, where
//! virtio-mmio's costs a read of `InterruptStatus` and a write of `InterruptACK`.

use std::sync::atomic::{AtomicU16, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use serde::{Deserialize, Serialize};

use virtio_bindings::virtio_mmio::*;

use crate::interrupt::Interrupt;
use crate::mmio::MmioTransport;
use crate::msix::{Msix, MsixState, MSIX_ENTRY_SIZE};
use crate::pci::{PciConfig, PciFunction, CAP_ID_VENDOR, VIRTIO_PCI_BAR_SIZE};

/// Offset of the common configuration in BAR 0.
pub const COMMON_OFFSET: u64 = 0x000;
const COMMON_SIZE: u64 = 0x40;
/// Offset of the ISR status in BAR 0.
pub const ISR_OFFSET: u64 = 0x040;
const ISR_SIZE: u64 = 4;
/// Offset of the notification address in BAR 0 (2-byte writes of the queue index).
pub const NOTIFY_OFFSET: u64 = 0x050;
const NOTIFY_SIZE: u64 = 4;
/// Offset of the device-specific configuration in BAR 0.
pub const DEVICE_OFFSET: u64 = 0x100;
const DEVICE_SIZE: u64 = 0x100;
/// Offset of the MSI-X table in BAR 0.
pub const MSIX_TABLE_OFFSET: u64 = 0x800;
/// Offset of the MSI-X pending bits in BAR 0.
pub const MSIX_PBA_OFFSET: u64 = 0xc00;

/// Red Hat's (virtio's) PCI vendor id.
pub const VIRTIO_PCI_VENDOR: u16 = 0x1af4;
/// Device ids of modern virtio devices: this plus the virtio device type.
pub const VIRTIO_PCI_DEVICE_BASE: u16 = 0x1040;

const CFG_COMMON: u8 = 1;
const CFG_NOTIFY: u8 = 2;
const CFG_ISR: u8 = 3;
const CFG_DEVICE: u8 = 4;

/// What the vectors of a device with `queues` queues need: one per queue and one for
/// configuration changes.
pub fn msix_vectors(queues: usize) -> u16 {
    u16::try_from(queues + 1).unwrap_or(u16::MAX)
}

/// The configuration space of a virtio function of `device_type` whose BAR 0 is at `bar0`,
/// interrupting through `msix`.
pub fn function(device_number: u8, device_type: u32, bar0: u32, msix: Arc<Msix>) -> PciFunction {
    let id = VIRTIO_PCI_DEVICE_BASE.saturating_add(u16::try_from(device_type).unwrap_or(0));
    // Class: network controller for net, mass storage (other) for block, else "other".
    let class = match device_type {
        1 => 0x02_00_00,
        2 => 0x01_80_00,
        _ => 0xff_00_00,
    };
    let mut config = PciConfig::new(VIRTIO_PCI_VENDOR, id, 1, class, (VIRTIO_PCI_VENDOR, 0x40));
    config.set_bar0(bar0, low32(VIRTIO_PCI_BAR_SIZE));
    for (kind, offset, length) in [
        (CFG_COMMON, COMMON_OFFSET, COMMON_SIZE),
        (CFG_ISR, ISR_OFFSET, ISR_SIZE),
        (CFG_DEVICE, DEVICE_OFFSET, DEVICE_SIZE),
    ] {
        config.add_capability(CAP_ID_VENDOR, &virtio_cap(kind, offset, length, None));
    }
    let notify = virtio_cap(CFG_NOTIFY, NOTIFY_OFFSET, NOTIFY_SIZE, Some(0));
    config.add_capability(CAP_ID_VENDOR, &notify);
    config.add_msix(&msix, low32(MSIX_TABLE_OFFSET), low32(MSIX_PBA_OFFSET));
    PciFunction {
        device: device_number,
        config: Mutex::new(config),
        msix: Some(msix),
    }
}

/// `struct virtio_pci_cap` after its id and next bytes (and the notification multiplier).
fn virtio_cap(kind: u8, offset: u64, length: u64, multiplier: Option<u32>) -> Vec<u8> {
    let len: u8 = if multiplier.is_some() { 20 } else { 16 };
    let mut body = vec![len, kind, 0, 0, 0, 0];
    body.extend_from_slice(&low32(offset).to_le_bytes());
    body.extend_from_slice(&low32(length).to_le_bytes());
    if let Some(m) = multiplier {
        body.extend_from_slice(&m.to_le_bytes());
    }
    body
}

/// The registers of a function's BAR 0 that are not the transport's: the selectors the
/// driver reads back, and the MSI-X vectors.
#[derive(Debug)]
pub struct VirtioPciFront {
    function: Arc<PciFunction>,
    msix: Arc<Msix>,
    queues: u16,
    device_features_sel: AtomicU32,
    driver_features_sel: AtomicU32,
    queue_sel: AtomicU16,
}

/// Where an access in BAR 0 goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Region {
    /// Common configuration, device configuration or notification: the transport's lock.
    Transport,
    /// ISR or MSI-X: answered without the transport's lock.
    Unlocked,
}

impl VirtioPciFront {
    /// The front of `function` (built by [`function`]) for a device with `queues` queues.
    pub fn new(function: Arc<PciFunction>, queues: usize) -> Option<Self> {
        let msix = function.msix.clone()?;
        Some(VirtioPciFront {
            function,
            msix,
            queues: u16::try_from(queues).unwrap_or(u16::MAX),
            device_features_sel: AtomicU32::new(0),
            driver_features_sel: AtomicU32::new(0),
            queue_sel: AtomicU16::new(0),
        })
    }

    /// The PCI function (for the bus's configuration space).
    pub fn function(&self) -> &Arc<PciFunction> {
        &self.function
    }

    /// The function's vectors.
    pub fn msix(&self) -> &Arc<Msix> {
        &self.msix
    }

    /// Where an access at `offset` goes.
    pub fn region(offset: u64) -> Region {
        if (ISR_OFFSET..ISR_OFFSET + ISR_SIZE).contains(&offset) || offset >= MSIX_TABLE_OFFSET {
            Region::Unlocked
        } else {
            Region::Transport
        }
    }

    /// A read of an [`Region::Unlocked`] register.
    pub fn read_unlocked(&self, offset: u64, data: &mut [u8], interrupt: &Interrupt) {
        data.fill(0);
        if (ISR_OFFSET..ISR_OFFSET + ISR_SIZE).contains(&offset) {
            if offset == ISR_OFFSET {
                if let Some(b) = data.first_mut() {
                    *b = interrupt.read_status().to_le_bytes()[0];
                }
            }
        } else if offset >= MSIX_PBA_OFFSET {
            self.msix.pba_read(offset - MSIX_PBA_OFFSET, data);
        } else if offset - MSIX_TABLE_OFFSET < self.msix.table_size() {
            self.msix.table_read(offset - MSIX_TABLE_OFFSET, data);
        }
    }

    /// A write to an [`Region::Unlocked`] register.
    pub fn write_unlocked(&self, offset: u64, data: &[u8]) {
        if (MSIX_TABLE_OFFSET..MSIX_PBA_OFFSET).contains(&offset)
            && offset - MSIX_TABLE_OFFSET < self.msix.table_size()
        {
            self.msix.table_write(offset - MSIX_TABLE_OFFSET, data);
        }
    }

    /// A read of a [`Region::Transport`] register.
    pub fn read(&self, t: &MmioTransport, offset: u64, data: &mut [u8]) {
        data.fill(0);
        if (DEVICE_OFFSET..DEVICE_OFFSET + DEVICE_SIZE).contains(&offset) {
            t.read(offset - DEVICE_OFFSET + u64::from(VIRTIO_MMIO_CONFIG), data);
            return;
        }
        if offset >= COMMON_SIZE {
            return;
        }
        let value = self.read_common(t, offset);
        let bytes = value.to_le_bytes();
        let n = data.len().min(8);
        data[..n].copy_from_slice(&bytes[..n]);
    }

    fn read_common(&self, t: &MmioTransport, offset: u64) -> u64 {
        let sel = usize::from(self.queue_sel.load(Ordering::Relaxed));
        let queue = t.queue_info(sel);
        let mmio32 = |reg: u32| {
            let mut b = [0u8; 4];
            t.read(u64::from(reg), &mut b);
            u64::from(u32::from_le_bytes(b))
        };
        match offset {
            0x00 => self.device_features_sel.load(Ordering::Relaxed).into(),
            0x04 => mmio32(VIRTIO_MMIO_DEVICE_FEATURES),
            0x08 => self.driver_features_sel.load(Ordering::Relaxed).into(),
            0x0c => match self.driver_features_sel.load(Ordering::Relaxed) {
                0 => t.acked_features() & 0xffff_ffff,
                1 => t.acked_features() >> 32,
                _ => 0,
            },
            0x10 => self.msix.config_vector().into(),
            0x12 => self.queues.into(),
            // device_status and config_generation, one byte each.
            0x14 => u64::from(t.status() & 0xff) | (mmio32(VIRTIO_MMIO_CONFIG_GENERATION) << 8),
            0x15 => mmio32(VIRTIO_MMIO_CONFIG_GENERATION),
            0x16 => sel as u64,
            0x18 => queue.map_or(0, |q| q.size.into()),
            0x1a => self.msix.queue_vector(sel).into(),
            0x1c => queue.map_or(0, |q| q.ready.into()),
            0x1e => 0,
            0x20 => queue.map_or(0, |q| q.desc),
            0x24 => queue.map_or(0, |q| q.desc >> 32),
            0x28 => queue.map_or(0, |q| q.avail),
            0x2c => queue.map_or(0, |q| q.avail >> 32),
            0x30 => queue.map_or(0, |q| q.used),
            0x34 => queue.map_or(0, |q| q.used >> 32),
            _ => 0,
        }
    }

    /// A write to a [`Region::Transport`] register.
    pub fn write(&self, t: &mut MmioTransport, offset: u64, data: &[u8]) {
        if (NOTIFY_OFFSET..NOTIFY_OFFSET + NOTIFY_SIZE).contains(&offset) {
            // Normally a KVM ioeventfd; this is a queue index no ioeventfd matched.
            let mut b = [0u8; 2];
            let n = data.len().min(2);
            b[..n].copy_from_slice(&data[..n]);
            t.notify(usize::from(u16::from_le_bytes(b)));
            return;
        }
        if (DEVICE_OFFSET..DEVICE_OFFSET + DEVICE_SIZE).contains(&offset) {
            t.write(offset - DEVICE_OFFSET + u64::from(VIRTIO_MMIO_CONFIG), data);
            return;
        }
        if data.len() == 8 && offset % 8 == 0 && (0x20..0x38).contains(&offset) {
            self.write(t, offset, &data[..4]);
            self.write(t, offset + 4, &data[4..]);
            return;
        }
        let mut b = [0u8; 4];
        let n = data.len().min(4);
        b[..n].copy_from_slice(&data[..n]);
        let value = u32::from_le_bytes(b);
        self.write_common(t, offset, value);
    }

    fn write_common(&self, t: &mut MmioTransport, offset: u64, value: u32) {
        let mmio =
            |t: &mut MmioTransport, reg: u32, v: u32| t.write(u64::from(reg), &v.to_le_bytes());
        let sel = usize::from(self.queue_sel.load(Ordering::Relaxed));
        match offset {
            0x00 => {
                self.device_features_sel.store(value, Ordering::Relaxed);
                mmio(t, VIRTIO_MMIO_DEVICE_FEATURES_SEL, value);
            }
            0x08 => {
                self.driver_features_sel.store(value, Ordering::Relaxed);
                mmio(t, VIRTIO_MMIO_DRIVER_FEATURES_SEL, value);
            }
            0x0c => mmio(t, VIRTIO_MMIO_DRIVER_FEATURES, value),
            0x10 => {
                self.msix.set_config_vector(low16(value));
            }
            0x14 => {
                let status = value & 0xff;
                if status == 0 {
                    self.msix.reset_vectors();
                    self.queue_sel.store(0, Ordering::Relaxed);
                }
                mmio(t, VIRTIO_MMIO_STATUS, status);
            }
            0x16 => {
                self.queue_sel.store(low16(value), Ordering::Relaxed);
                mmio(t, VIRTIO_MMIO_QUEUE_SEL, value & 0xffff);
            }
            0x18 => mmio(t, VIRTIO_MMIO_QUEUE_NUM, value & 0xffff),
            0x1a => {
                self.msix.set_queue_vector(sel, low16(value));
            }
            0x1c => mmio(t, VIRTIO_MMIO_QUEUE_READY, value & 0xffff),
            0x20 => mmio(t, VIRTIO_MMIO_QUEUE_DESC_LOW, value),
            0x24 => mmio(t, VIRTIO_MMIO_QUEUE_DESC_HIGH, value),
            0x28 => mmio(t, VIRTIO_MMIO_QUEUE_AVAIL_LOW, value),
            0x2c => mmio(t, VIRTIO_MMIO_QUEUE_AVAIL_HIGH, value),
            0x30 => mmio(t, VIRTIO_MMIO_QUEUE_USED_LOW, value),
            0x34 => mmio(t, VIRTIO_MMIO_QUEUE_USED_HIGH, value),
            _ => tracing::debug!(
                offset,
                "virtio-pci: write to a read-only or unknown register"
            ),
        }
    }

    /// The function's state that moves with the VM (the transport's is the virtio-mmio one's).
    pub fn save(&self) -> PciSlotState {
        let config = self
            .function
            .config
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .save();
        PciSlotState {
            config,
            msix: self.msix.save(),
            device_features_sel: self.device_features_sel.load(Ordering::Relaxed),
            driver_features_sel: self.driver_features_sel.load(Ordering::Relaxed),
            queue_sel: self.queue_sel.load(Ordering::Relaxed),
        }
    }

    /// Takes over a saved state; its MSI-X messages wait for [`Msix::release`]. Nothing
    /// changes when it is refused.
    pub fn restore(&self, saved: &PciSlotState) -> Result<(), String> {
        self.msix.restore(&saved.msix)?;
        self.function
            .config
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .restore(&saved.config);
        self.device_features_sel
            .store(saved.device_features_sel, Ordering::Relaxed);
        self.driver_features_sel
            .store(saved.driver_features_sel, Ordering::Relaxed);
        self.queue_sel.store(saved.queue_sel, Ordering::Relaxed);
        Ok(())
    }
}

/// A virtio-pci function's own state: its configuration space (the writable bits are taken
/// on restore), MSI-X, and the selectors the driver reads back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PciSlotState {
    /// The 256 bytes of configuration space.
    pub config: Vec<u8>,
    /// The vector table, pending bits, enable and mask, and the queues' vectors.
    pub msix: MsixState,
    /// `device_feature_select`.
    pub device_features_sel: u32,
    /// `driver_feature_select`.
    pub driver_features_sel: u32,
    /// `queue_select`.
    pub queue_sel: u16,
}

/// The low 32 bits of `v` (the BAR's offsets and sizes all fit).
fn low32(v: u64) -> u32 {
    (v & 0xffff_ffff) as u32
}

/// The low 16 bits of a register write (16-bit registers written with 32 bits).
fn low16(v: u32) -> u16 {
    (v & 0xffff) as u16
}

/// The MSI-X table's end in BAR 0 for `vectors` vectors (it must stay below the pending bits).
pub fn msix_table_fits(vectors: u16) -> bool {
    MSIX_TABLE_OFFSET + u64::from(vectors) * MSIX_ENTRY_SIZE <= MSIX_PBA_OFFSET
}
