//! The platform devices the DSDT announces besides the processors: COM1 with its interrupt,
//! the ACPI power button behind a Generic Event Device (how a hardware-reduced platform signals
//! it), and a pvpanic device.
//!
//! - `\_SB_.COM1` (`PNP0501`): I/O 0x3f8-0x3ff, GSI 4 edge. A hardware-reduced FADT gives the
//!   kernel no legacy PIC and no pre-mapped ISA interrupts: without this entry the 8250 driver
//!   probes the port with an interrupt nothing routes, and only kernel messages (written by
//!   polling) come out; everything user space writes to the console is stuck.
//! - `\_SB_.PWRB` (`PNP0C0C`) and `\_SB_.GED0` (`ACPI0013`, interrupt [`GED_GSI`] edge):
//!   the VMM raises the GED interrupt, the kernel runs `_EVT`, which notifies the power button
//!   with 0x80 (pressed); Linux's `button` driver turns that into a `KEY_POWER` input event for
//!   user space (systemd-logind, acpid) to power off.
//! - `\_SB_.PEVT` (`QEMU0001`): the pvpanic device at I/O port [`PVPANIC_PORT`]; Linux's
//!   `pvpanic-mmio` driver writes 1 there when the kernel panics.

use acpi_tables::aml::{
    Device, EISAName, Interrupt, Method, Name, Notify, Path, ResourceTemplate, IO,
};
use acpi_tables::Aml;

use super::aml_bytes;

/// COM1's first I/O port.
pub const COM1_PORT: u16 = 0x3f8;
/// COM1's interrupt (GSI).
pub const COM1_GSI: u32 = 4;
/// The Generic Event Device's interrupt (GSI): raising it presses the power button.
pub const GED_GSI: u32 = 5;
/// The pvpanic device's I/O port (QEMU's default).
pub const PVPANIC_PORT: u16 = 0x505;
/// pvpanic event bit: the guest kernel panicked.
pub const PVPANIC_PANICKED: u8 = 1;
/// pvpanic event bit: a crash kernel was loaded and takes over.
pub const PVPANIC_CRASH_LOADED: u8 = 2;
/// ACPI notification value of a power button press.
const BUTTON_PRESSED: u8 = 0x80;

/// One device's AML: `_HID`, `_UID` 0, `_CRS` when it has resources, then `extra`.
fn device(name: &str, hid: &dyn Aml, crs: &[&dyn Aml], extra: &[&dyn Aml]) -> Vec<u8> {
    let hid = Name::new("_HID".into(), hid);
    let uid = Name::new("_UID".into(), &0u8);
    let template = ResourceTemplate::new(crs.to_vec());
    let crs_name = Name::new("_CRS".into(), &template);
    let mut children: Vec<&dyn Aml> = vec![&hid, &uid];
    if !crs.is_empty() {
        children.push(&crs_name);
    }
    children.extend_from_slice(extra);
    aml_bytes(&Device::new(Path::new(name), children))
}

/// The AML of the devices, to go into the `\_SB_` scope.
pub(super) fn devices_aml() -> Vec<u8> {
    let interrupt = |gsi: u32| Interrupt::new(true, true, false, false, gsi);
    let mut out = device(
        "COM1",
        &EISAName::new("PNP0501"),
        &[&IO::new(COM1_PORT, COM1_PORT, 1, 8), &interrupt(COM1_GSI)],
        &[],
    );
    out.extend(device("PWRB", &EISAName::new("PNP0C0C"), &[], &[]));
    let pwrb = Path::new("\\_SB_.PWRB");
    let notify = Notify::new(&pwrb, &BUTTON_PRESSED);
    let evt = Method::new("_EVT".into(), 1, true, vec![&notify]);
    out.extend(device("GED0", &"ACPI0013", &[&interrupt(GED_GSI)], &[&evt]));
    out.extend(device(
        "PEVT",
        &"QEMU0001",
        &[&IO::new(PVPANIC_PORT, PVPANIC_PORT, 1, 1)],
        &[],
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn has(hay: &[u8], needle: &[u8]) -> bool {
        hay.windows(needle.len()).any(|w| w == needle)
    }

    #[test]
    fn devices_name_their_ids_ports_and_interrupts() {
        let aml = devices_aml();
        for name in [
            &b"COM1"[..],
            b"PWRB",
            b"GED0",
            b"PEVT",
            b"_EVT",
            b"ACPI0013",
            b"QEMU0001",
        ] {
            assert!(has(&aml, name), "{}", String::from_utf8_lossy(name));
        }
        // IO descriptors: 0x47, decode16, min, max, align, length.
        assert!(
            has(&aml, &[0x47, 1, 0xf8, 0x03, 0xf8, 0x03, 1, 8]),
            "COM1 ports"
        );
        assert!(
            has(&aml, &[0x47, 1, 0x05, 0x05, 0x05, 0x05, 1, 1]),
            "pvpanic port"
        );
        // Extended interrupt descriptors: consumer + edge, one interrupt, the GSI.
        assert!(has(&aml, &[0x89, 6, 0, 3, 1, 4, 0, 0, 0]), "COM1 GSI 4");
        assert!(has(&aml, &[0x89, 6, 0, 3, 1, 5, 0, 0, 0]), "GED GSI 5");
    }
}
