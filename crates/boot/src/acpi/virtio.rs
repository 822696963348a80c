//! The DSDT entries of the virtio-mmio devices: one `LNRO0005` device per plan slot (the
//! `_HID` Linux's virtio_mmio driver matches, as QEMU's and Firecracker's ACPI tables use),
//! with the slot's 4 KiB register window and its edge-triggered GSI. Linux then probes the
//! devices without `virtio_mmio.device=` on the command line.
//!
//! [`super::build_acpi`] puts them in the DSDT's `\_SB_` scope next to the platform devices,
//! for the slots of [`vmhost_plan::Plan::virtio_acpi_slots`] (none when
//! `boot.virtio_announce = "cmdline"` announces them on the command line instead).

use acpi_tables::aml::{
    AddressSpace, AddressSpaceCacheable, Device, EISAName, Interrupt, Memory32Fixed, Name, Path,
    ResourceTemplate, IO,
};
use acpi_tables::Aml;
use vmhost_plan::devices::{VirtioSlot, MAX_VIRTIO_DEVICES, VIRTIO_MMIO_BASE, VIRTIO_MMIO_SIZE};

use super::aml_bytes;

/// `_HID` of a virtio-mmio device.
pub const VIRTIO_MMIO_HID: &str = "LNRO0005";

/// The AML of the slots' devices (`\_SB_.VR00`, `VR01`, …), to go into the `\_SB_` scope.
/// Slots outside the 32-bit space are skipped (the plan never makes them).
pub fn virtio_mmio_aml(slots: &[VirtioSlot]) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, slot) in slots.iter().enumerate() {
        let (Ok(base), Ok(size)) = (u32::try_from(slot.base), u32::try_from(VIRTIO_MMIO_SIZE))
        else {
            continue;
        };
        let name = format!("VR{:02X}", i & 0xff);
        let uid = u32::try_from(i).unwrap_or(u32::MAX);
        let hid = Name::new("_HID".into(), &VIRTIO_MMIO_HID);
        let uid = Name::new("_UID".into(), &uid);
        let window = Memory32Fixed::new(true, base, size);
        // Consumer, edge-triggered, active high, exclusive.
        let irq = Interrupt::new(true, true, false, false, slot.gsi);
        let template = ResourceTemplate::new(vec![&window as &dyn Aml, &irq]);
        let crs = Name::new("_CRS".into(), &template);
        let device = Device::new(Path::new(&name), vec![&hid as &dyn Aml, &uid, &crs]);
        out.extend(aml_bytes(&device));
    }
    out
}

/// The PCI host bridge of `boot.virtio_announce = "pci"` (`\_SB_.PCI0`, `PNP0A08`/`PNP0A03`):
/// bus 0, configuration mechanism #1 at ports 0xcf8-0xcff, and one memory window over every
/// virtio slot, where vmhost puts each function's BAR 0. Linux finds the functions by scanning
/// the bus; their interrupts are MSI-X messages, so there is no `_PRT`.
pub fn pci_host_bridge_aml() -> Vec<u8> {
    let window_end = VIRTIO_MMIO_BASE + VIRTIO_MMIO_SIZE * MAX_VIRTIO_DEVICES as u64 - 1;
    let (Ok(start), Ok(end)) = (u32::try_from(VIRTIO_MMIO_BASE), u32::try_from(window_end)) else {
        return Vec::new();
    };
    let hid = Name::new("_HID".into(), &EISAName::new("PNP0A08"));
    let cid = Name::new("_CID".into(), &EISAName::new("PNP0A03"));
    let adr = Name::new("_ADR".into(), &0u32);
    let seg = Name::new("_SEG".into(), &0u32);
    let uid = Name::new("_UID".into(), &0u32);
    let bbn = Name::new("_BBN".into(), &0u32);
    let buses = AddressSpace::<u16>::new_bus_number(0, 0);
    let config_ports = IO::new(0xcf8, 0xcf8, 1, 8);
    let memory = AddressSpace::<u32>::new_memory(
        AddressSpaceCacheable::NotCacheable,
        true,
        start,
        end,
        None,
    );
    let template = ResourceTemplate::new(vec![&buses as &dyn Aml, &config_ports, &memory]);
    let crs = Name::new("_CRS".into(), &template);
    let device = Device::new(
        Path::new("PCI0"),
        vec![&hid as &dyn Aml, &cid, &adr, &seg, &uid, &bbn, &crs],
    );
    aml_bytes(&device)
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use acpi_tables::sdt::Sdt;
    use vmhost_config::DeviceSpec;
    use vmhost_plan::devices::DevicePlan;

    use super::*;

    fn slots() -> Vec<VirtioSlot> {
        DevicePlan::new(DeviceSpec {
            rng: true,
            ..DeviceSpec::default()
        })
        .slots
    }

    fn has(hay: &[u8], needle: &[u8]) -> bool {
        hay.windows(needle.len()).any(|w| w == needle)
    }

    #[test]
    fn each_slot_is_an_lnro0005_device_with_its_window_and_gsi() {
        let aml = virtio_mmio_aml(&slots());
        assert!(has(&aml, b"VR00"));
        assert!(has(&aml, b"LNRO0005\0"));
        // Memory32Fixed: tag 0x86, length 9, read-write, base, length.
        let mut mem = vec![0x86, 0x09, 0x00, 0x01];
        mem.extend_from_slice(&0xd000_0000u32.to_le_bytes());
        mem.extend_from_slice(&0x1000u32.to_le_bytes());
        assert!(has(&aml, &mem), "{aml:02x?}");
        // Extended interrupt: tag 0x89, length 6, consumer + edge, one interrupt, GSI 16.
        let mut irq = vec![0x89, 0x06, 0x00, 0x03, 0x01];
        irq.extend_from_slice(&16u32.to_le_bytes());
        assert!(has(&aml, &irq), "{aml:02x?}");
        assert!(virtio_mmio_aml(&[]).is_empty());
    }

    /// The first device byte for byte, as ACPI 6.5 §20 encodes it: the AML a reader must decode.
    #[test]
    fn the_first_device_is_exactly_this_aml() {
        let mut want = vec![0x5b, 0x82, 0x3a]; // DeviceOp, PkgLength 58
        want.extend_from_slice(b"VR00");
        want.extend_from_slice(b"\x08_HID\x0dLNRO0005\0"); // Name (_HID, "LNRO0005")
        want.extend_from_slice(b"\x08_UID\x00"); // Name (_UID, Zero)
                                                 // Name (_CRS, Buffer (23) {...}): BufferOp, PkgLength 26, BytePrefix 23.
        want.extend_from_slice(b"\x08_CRS\x11\x1a\x0a\x17");
        // Memory32Fixed (ReadWrite, 0xD0000000, 0x1000)
        want.extend_from_slice(&[0x86, 0x09, 0x00, 0x01, 0, 0, 0, 0xd0, 0, 0x10, 0, 0]);
        // Interrupt (ResourceConsumer, Edge, ActiveHigh, Exclusive) {16}
        want.extend_from_slice(&[0x89, 0x06, 0x00, 0x03, 0x01, 16, 0, 0, 0]);
        want.extend_from_slice(&[0x79, 0x00]); // EndTag
        let aml = virtio_mmio_aml(&slots()[..1]);
        assert_eq!(aml, want, "\ngot  {aml:02x?}\nwant {want:02x?}");
    }

    /// ACPICA disassembles the devices in an SSDT (iasl from acpica-tools, as the ACPI tests).
    #[test]
    fn iasl_reads_the_devices_back() {
        let dir = tempfile::tempdir().unwrap();
        let devices = RawAml(virtio_mmio_aml(&slots()));
        let scope = acpi_tables::aml::Scope::new("\\_SB_".into(), vec![&devices as &dyn Aml]);
        let mut t = Sdt::new(*b"SSDT", 36, 2, *b"VMHOST", *b"VIRTIO  ", 1);
        t.append_slice(&aml_bytes(&scope));
        t.update_checksum();
        let path = dir.path().join("ssdt.dat");
        std::fs::write(&path, t.as_slice()).unwrap();
        let out = Command::new("iasl")
            .arg("-d")
            .arg(&path)
            .current_dir(dir.path())
            .output()
            .expect("iasl is missing: run scripts/setup.sh (Debian package acpica-tools)");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let dsl = std::fs::read_to_string(dir.path().join("ssdt.dsl")).unwrap();
        for want in ["\"LNRO0005\"", "0xD0000000", "0x00001000", "0x00000010"] {
            assert!(dsl.contains(want), "{want} missing in:\n{dsl}");
        }
    }

    struct RawAml(Vec<u8>);

    impl Aml for RawAml {
        fn to_aml_bytes(&self, sink: &mut dyn acpi_tables::AmlSink) {
            for b in &self.0 {
                sink.byte(*b);
            }
        }
    }
}
