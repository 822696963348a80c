//! The emulated devices of a Linux guest, all on port I/O: COM1 ([`serial`]), the legacy
//! ports the kernel probes, and the ACPI power-off and reset registers ([`legacy`]); with
//! virtio-pci devices, PCI configuration mechanism #1 is the virtio attachment's. The
//! console input thread is in [`console`].
//!
//! KVM's in-kernel irqchip and PIT (`boot.irqchip = "kernel"`, the default) handle the PIC,
//! I/O APIC, local APICs, PIT and speaker port without exits. With a split irqchip the I/O
//! APIC is [`ioapic`]'s (an MMIO window) and the PIC and PIT ports are absent devices in
//! [`legacy`]. Ports nothing here claims go to the VM's unknown-access policy.

pub mod console;
pub mod debugport;
pub mod ioapic;
pub mod legacy;
pub mod output;
mod persist;
pub mod serial;

pub use persist::RestoreError;

use std::sync::{Arc, Mutex};

use crate::control::lock;
use debugport::{BootMarks, DEBUG_PORT};
use ioapic::UserIoapic;
use legacy::{Legacy, PortAction};
use serial::SerialConsole;
use vmhost_devices::bus::Access;

/// The port-I/O bus of a Linux guest, and its virtio-mmio devices.
#[derive(Debug)]
pub struct LinuxDevices {
    virtio: Option<crate::virtio::VirtioAttachment>,
    serial: Arc<SerialConsole>,
    legacy: Mutex<Legacy>,
    marks: Arc<BootMarks>,
    /// The I/O APIC of a split irqchip.
    ioapic: Option<UserIoapic>,
}

impl LinuxDevices {
    /// The devices around `serial`.
    pub fn new(serial: SerialConsole) -> Self {
        LinuxDevices {
            virtio: None,
            serial: Arc::new(serial),
            legacy: Mutex::new(Legacy::default()),
            marks: Arc::default(),
            ioapic: None,
        }
    }

    /// The same devices for a VM with a split irqchip: `ioapic`, and the PIC and PIT ports as
    /// absent devices (the legacy ports' state starts afresh).
    pub fn with_ioapic(mut self, ioapic: UserIoapic) -> Self {
        self.ioapic = Some(ioapic);
        self.legacy = Mutex::new(Legacy::without_pic_and_pit());
        self
    }

    /// The user-space I/O APIC (a split irqchip only).
    pub fn ioapic(&self) -> Option<&UserIoapic> {
        self.ioapic.as_ref()
    }

    /// The boot markers the guest wrote to the debug port.
    pub fn marks(&self) -> &Arc<BootMarks> {
        &self.marks
    }

    /// COM1.
    pub fn serial(&self) -> &Arc<SerialConsole> {
        &self.serial
    }

    /// A guest `in` from `port`; false (and `data` untouched) when no device has the port.
    pub fn pio_read(&self, port: u16, data: &mut [u8]) -> bool {
        if SerialConsole::claims(port) {
            self.serial.read(port, data);
            return true;
        }
        if self.virtio.as_ref().is_some_and(|v| v.pio_read(port, data)) {
            return true;
        }
        lock(&self.legacy).read(port, data)
    }

    /// A guest `out` to `port`.
    pub fn pio_write(&self, port: u16, data: &[u8]) -> PortAction {
        if SerialConsole::claims(port) {
            self.serial.write(port, data);
            return PortAction::Handled;
        }
        if port == DEBUG_PORT && data.len() == 1 {
            self.marks.record(data[0], crate::sys::monotonic_ns());
            return PortAction::Handled;
        }
        if self
            .virtio
            .as_ref()
            .is_some_and(|v| v.pio_write(port, data))
        {
            return PortAction::Handled;
        }
        lock(&self.legacy).write(port, data)
    }

    /// The same devices with the virtio-mmio devices of `virtio`.
    pub fn with_virtio(mut self, virtio: crate::virtio::VirtioAttachment) -> Self {
        self.virtio = Some(virtio);
        self
    }

    /// The virtio devices, if the guest has any.
    pub fn virtio(&self) -> Option<&crate::virtio::VirtioAttachment> {
        self.virtio.as_ref()
    }

    /// A guest MMIO read (`data` untouched unless [`Access::Done`]); a device busy in a
    /// request is waited for only while `give_up` (the VM's stop flag) is false.
    pub fn mmio_read(&self, gpa: u64, data: &mut [u8], give_up: &dyn Fn() -> bool) -> Access {
        if let Some(ioapic) = self.ioapic.as_ref().filter(|_| UserIoapic::claims(gpa)) {
            ioapic.read(gpa, data);
            return Access::Done;
        }
        self.virtio.as_ref().map_or(Access::NotMine, |v| {
            v.mmio_read_or_give_up(gpa, data, give_up)
        })
    }

    /// A guest MMIO write; as [`LinuxDevices::mmio_read`].
    pub fn mmio_write(&self, gpa: u64, data: &[u8], give_up: &dyn Fn() -> bool) -> Access {
        if let Some(ioapic) = self.ioapic.as_ref().filter(|_| UserIoapic::claims(gpa)) {
            ioapic.write(gpa, data);
            return Access::Done;
        }
        self.virtio.as_ref().map_or(Access::NotMine, |v| {
            v.mmio_write_or_give_up(gpa, data, give_up)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use legacy::RebootVia;

    #[test]
    fn ports_are_routed_to_their_device() {
        let out = serial::SerialOut(Arc::new(Mutex::new(std::io::sink())));
        let d = LinuxDevices::new(SerialConsole::new(Some(out)).unwrap());
        assert_eq!(d.pio_write(0x3f8, b"x"), PortAction::Handled);
        assert_eq!(d.serial().stats().bytes(), 1);
        assert_eq!(
            d.pio_write(0x64, &[0xfe]),
            PortAction::Reboot(RebootVia::KeyboardController)
        );
        assert_eq!(d.pio_write(0x5a5a, &[1]), PortAction::Unknown);
        assert_eq!(d.pio_write(0x80, &[0x60]), PortAction::Handled);
        assert_eq!(d.marks().marks().len(), 1, "the user-space marker");
        let mut b = [0u8; 1];
        assert!(d.pio_read(0x3fd, &mut b));
        assert!(!d.pio_read(0x5a5a, &mut b));
    }
}
