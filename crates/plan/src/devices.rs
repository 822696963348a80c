//! Where each virtio device goes in the guest: one 4 KiB virtio-mmio window in the MMIO hole
//! and one I/O APIC pin per device, assigned in spec order (disks, then interfaces, then
//! rng, then vsock). The VMM builds its MMIO bus and the ACPI tables from the same slots, so the DSDT and
//! the `virtio_mmio.device=` command-line fallback always agree with the bus. Exactly one of
//! them announces the devices (`boot.virtio_announce`): [`crate::Plan::virtio_acpi_slots`] and
//! [`crate::Plan::virtio_cmdline`] never both return something.

use serde::Serialize;
use vmhost_config::{BootSpec, DeviceSpec, Irqchip, VirtioAnnounce};

use crate::Plan;

/// First virtio-mmio window (inside the 32-bit MMIO hole, below the I/O APIC and LAPIC).
pub const VIRTIO_MMIO_BASE: u64 = 0xd000_0000;
/// Size of one window.
pub const VIRTIO_MMIO_SIZE: u64 = 0x1000;
/// First GSI: the I/O APIC pins above the ISA range (16-23).
pub const VIRTIO_GSI_BASE: u32 = 16;
/// Devices that fit: one I/O APIC pin each.
pub const MAX_VIRTIO_DEVICES: usize = vmhost_config::devices::MAX_DEVICES;

/// What a slot holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", content = "index", rename_all = "snake_case")]
pub enum VirtioKind {
    /// `devices.disks[i]`.
    Disk(usize),
    /// `devices.interfaces[i]`.
    Net(usize),
    /// `devices.rng`.
    Rng,
    /// `devices.vsock` (or KubeVirt's `autoattachVSOCK`).
    Vsock,
}

/// One device's window and interrupt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct VirtioSlot {
    /// The device.
    pub device: VirtioKind,
    /// Guest-physical base of its registers.
    pub base: u64,
    /// Its GSI (edge-triggered, through an irqfd).
    pub gsi: u32,
}

impl VirtioSlot {
    /// The kernel command-line form, `virtio_mmio.device=4K@0xd0000000:16`.
    pub fn cmdline(&self) -> String {
        format!(
            "virtio_mmio.device={}K@{:#x}:{}",
            VIRTIO_MMIO_SIZE / 1024,
            self.base,
            self.gsi
        )
    }
}

/// The resolved devices and their slots.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct DevicePlan {
    /// Disks, NICs and entropy as resolved from the spec.
    pub spec: DeviceSpec,
    /// One slot per device, in spec order.
    pub slots: Vec<VirtioSlot>,
    /// The device I/O threads, the devices each serves and their PUs (filled in by the
    /// planner: [`crate::iothreads`]).
    pub io_threads: Vec<crate::iothreads::IoThreadPlan>,
}

impl DevicePlan {
    /// Assigns slots to `spec`'s devices (validation caps them at [`MAX_VIRTIO_DEVICES`]).
    ///
    /// ```
    /// use vmhost_config::DeviceSpec;
    /// use vmhost_plan::devices::{DevicePlan, VirtioKind};
    /// let p = DevicePlan::new(DeviceSpec { rng: true, ..DeviceSpec::default() });
    /// assert_eq!(p.slots[0].device, VirtioKind::Rng);
    /// assert_eq!(p.slots[0].cmdline(), "virtio_mmio.device=4K@0xd0000000:16");
    /// ```
    pub fn new(spec: DeviceSpec) -> Self {
        let kinds = (0..spec.disks.len())
            .map(VirtioKind::Disk)
            .chain((0..spec.interfaces.len()).map(VirtioKind::Net))
            .chain(spec.rng.then_some(VirtioKind::Rng))
            .chain(spec.vsock.is_some().then_some(VirtioKind::Vsock));
        let slots = kinds
            .take(MAX_VIRTIO_DEVICES)
            .zip(0u32..)
            .map(|(device, i)| VirtioSlot {
                device,
                base: VIRTIO_MMIO_BASE + u64::from(i) * VIRTIO_MMIO_SIZE,
                gsi: VIRTIO_GSI_BASE + i,
            })
            .collect();
        DevicePlan {
            spec,
            slots,
            io_threads: Vec::new(),
        }
    }

    /// Whether the VM has no virtio device.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// The command-line fallback for every device, space-separated.
    pub fn cmdline(&self) -> String {
        let parts: Vec<String> = self.slots.iter().map(VirtioSlot::cmdline).collect();
        parts.join(" ")
    }
}

impl Plan {
    /// How a Linux guest learns its devices; `None` for a built-in payload (it has no
    /// virtio drivers and gets no devices).
    pub fn virtio_announce(&self) -> Option<VirtioAnnounce> {
        match &self.boot {
            BootSpec::Kernel {
                virtio_announce, ..
            } => Some(*virtio_announce),
            BootSpec::Payload { .. } => None,
        }
    }

    /// Where a Linux guest's interrupt controllers are emulated (`boot.irqchip`); a built-in
    /// payload has KVM's.
    pub fn irqchip(&self) -> Irqchip {
        match &self.boot {
            BootSpec::Kernel { irqchip, .. } => *irqchip,
            BootSpec::Payload { .. } => Irqchip::Kernel,
        }
    }

    /// The slots the DSDT announces as `LNRO0005` devices: all of them unless
    /// `boot.virtio_announce = "cmdline"`.
    pub fn virtio_acpi_slots(&self) -> &[VirtioSlot] {
        match self.virtio_announce() {
            Some(VirtioAnnounce::Acpi) => &self.devices.slots,
            _ => &[],
        }
    }

    /// Whether the devices are virtio-pci functions (`boot.virtio_announce = "pci"`): each
    /// slot's base is then its function's BAR 0 and its device number is the slot index + 1.
    pub fn virtio_pci(&self) -> bool {
        self.virtio_announce() == Some(VirtioAnnounce::Pci)
    }

    /// The `virtio_mmio.device=` parameters to append to the kernel command line: empty unless
    /// `boot.virtio_announce = "cmdline"` (a device announced twice would be probed twice).
    pub fn virtio_cmdline(&self) -> String {
        match self.virtio_announce() {
            Some(VirtioAnnounce::Cmdline) => self.devices.cmdline(),
            _ => String::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmhost_config::{Binding, DiskCache, DiskSource, DiskSpec, InterfaceSpec, MacAddress};

    #[test]
    fn slots_follow_spec_order_with_consecutive_windows_and_gsis() {
        let disk = |name: &str| DiskSpec {
            name: name.into(),
            source: DiskSource::EmptyDisk {
                capacity_bytes: 1 << 20,
            },
            read_only: false,
            cache: DiskCache::Writeback,
            serial: name.into(),
        };
        let spec = DeviceSpec {
            disks: vec![disk("a"), disk("b")],
            interfaces: vec![InterfaceSpec {
                name: "n".into(),
                binding: Binding::Bridge,
                mac: MacAddress::generate("vm", "n"),
                tap: None,
            }],
            rng: true,
            vsock: Some(vmhost_config::VsockSpec {
                cid: 3,
                socket: None,
                backend: Default::default(),
            }),
        };
        let p = DevicePlan::new(spec);
        let got: Vec<(VirtioKind, u64, u32)> =
            p.slots.iter().map(|s| (s.device, s.base, s.gsi)).collect();
        assert_eq!(
            got,
            [
                (VirtioKind::Disk(0), 0xd000_0000, 16),
                (VirtioKind::Disk(1), 0xd000_1000, 17),
                (VirtioKind::Net(0), 0xd000_2000, 18),
                (VirtioKind::Rng, 0xd000_3000, 19),
                (VirtioKind::Vsock, 0xd000_4000, 20),
            ]
        );
        assert_eq!(
            p.cmdline(),
            "virtio_mmio.device=4K@0xd0000000:16 virtio_mmio.device=4K@0xd0001000:17 \
             virtio_mmio.device=4K@0xd0002000:18 virtio_mmio.device=4K@0xd0003000:19 \
             virtio_mmio.device=4K@0xd0004000:20"
        );
    }

    #[test]
    fn the_last_window_stays_below_the_io_apic() {
        let last = VIRTIO_MMIO_BASE + VIRTIO_MMIO_SIZE * MAX_VIRTIO_DEVICES as u64;
        assert!(last <= 0xfec0_0000);
        assert!(
            VIRTIO_GSI_BASE as usize + MAX_VIRTIO_DEVICES <= 24,
            "I/O APIC has 24 pins"
        );
    }
}
