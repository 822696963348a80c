//! MADT and DSDT: the guest's processors and interrupt controllers.
//!
//! One processor entry per vCPU: a Processor Local APIC entry (type 0) when both the vCPU index
//! (ACPI processor UID) and the APIC ID fit below 0xFF, else a Processor Local x2APIC entry
//! (type 9), the convention QEMU and Linux follow. The APIC ID is `plan.vcpus[i].apic_id`, the
//! one the guest's CPUID reports. One I/O APIC at [`IOAPIC_ADDR`] with GSI base 0: the VM uses
//! KVM's in-kernel irqchip. There are no interrupt source overrides, because KVM's default GSI
//! routing maps ISA IRQ n to I/O APIC pin n (the PIT on pin 0).
//!
//! The DSDT declares one processor device (`_HID "ACPI0007"`) per vCPU under `\_SB`, with the
//! same `_UID` as the MADT entry.

use acpi_tables::aml::{Device, Name, Package, Path, Scope};
use acpi_tables::madt::{EnabledStatus, IoApic, ProcessorLocalApic};
use acpi_tables::sdt::Sdt;
use acpi_tables::Aml;
use vmhost_plan::Plan;

use super::{aml_bytes, OEM_ID, OEM_REVISION, OEM_TABLE_ID, S5_SLEEP_TYPE};

/// Guest-physical address of the I/O APIC (KVM's in-kernel I/O APIC).
pub const IOAPIC_ADDR: u32 = 0xfec0_0000;
/// I/O APIC ID (KVM's I/O APIC resets to ID 0).
pub const IOAPIC_ID: u8 = 0;
/// Guest-physical address of the local APICs.
pub const LAPIC_ADDR: u32 = 0xfee0_0000;

/// MADT revision (ACPI 6.3+).
const MADT_REVISION: u8 = 5;
/// MADT flag: the platform also has dual 8259 PICs (KVM's in-kernel irqchip does).
const PCAT_COMPAT: u32 = 1;
/// MADT structure type of a Processor Local x2APIC entry.
const MADT_LOCAL_X2APIC: u8 = 9;
/// Local APIC flag: the processor is usable.
const ENABLED: u32 = 1;
/// DSDT revision: 2 and above make AML integers 64-bit.
const DSDT_REVISION: u8 = 2;

/// True when a vCPU is described with the legacy 8-bit entries (MADT type 0, SRAT type 0).
pub(super) fn fits_xapic(uid: u32, apic_id: u32) -> bool {
    uid < 0xff && apic_id < 0xff
}

/// The MADT ("APIC") of the plan's vCPUs.
pub(super) fn madt(plan: &Plan) -> Vec<u8> {
    let mut t = Sdt::new(
        *b"APIC",
        44,
        MADT_REVISION,
        OEM_ID,
        OEM_TABLE_ID,
        OEM_REVISION,
    );
    t.write_u32(36, LAPIC_ADDR);
    t.write_u32(40, PCAT_COMPAT);
    for v in &plan.vcpus {
        match (u8::try_from(v.vcpu), u8::try_from(v.apic_id)) {
            (Ok(uid), Ok(id)) if fits_xapic(v.vcpu, v.apic_id) => {
                t.append_slice(&aml_bytes(&ProcessorLocalApic::new(
                    uid,
                    id,
                    EnabledStatus::Enabled,
                )));
            }
            _ => t.append_slice(&local_x2apic(v.vcpu, v.apic_id)),
        }
    }
    t.append_slice(&aml_bytes(&IoApic::new(IOAPIC_ID, IOAPIC_ADDR, 0)));
    t.as_slice().to_vec()
}

/// A Processor Local x2APIC structure (ACPI 6.5 §5.2.12.12), 16 bytes.
fn local_x2apic(uid: u32, x2apic_id: u32) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[0] = MADT_LOCAL_X2APIC;
    b[1] = 16;
    // b[2..4] reserved
    b[4..8].copy_from_slice(&x2apic_id.to_le_bytes());
    b[8..12].copy_from_slice(&ENABLED.to_le_bytes());
    b[12..16].copy_from_slice(&uid.to_le_bytes());
    b
}

/// Bytes that are already AML (the platform devices).
struct RawAml(Vec<u8>);

impl Aml for RawAml {
    fn to_aml_bytes(&self, sink: &mut dyn acpi_tables::AmlSink) {
        for b in &self.0 {
            sink.byte(*b);
        }
    }
}

/// The DSDT: a processor device per vCPU under `\_SB`, the platform devices, the virtio-mmio
/// devices (unless the command line announces them), and `\_S5_` (soft off) with
/// `SLP_TYP` = [`S5_SLEEP_TYPE`], which Linux needs before it powers off through the FADT's
/// sleep control register.
///
/// Device names are `C` and the vCPU index in three hex digits, so indices must be below
/// 0x1000 (checked by the caller).
pub(super) fn dsdt(plan: &Plan) -> Vec<u8> {
    let names: Vec<(String, Name, Name)> = plan
        .vcpus
        .iter()
        .map(|v| {
            (
                format!("C{:03X}", v.vcpu),
                Name::new("_HID".into(), &"ACPI0007"),
                Name::new("_UID".into(), &v.vcpu),
            )
        })
        .collect();
    let devices: Vec<Device> = names
        .iter()
        .map(|(path, hid, uid)| Device::new(Path::new(path), vec![hid as &dyn Aml, uid]))
        .collect();
    let children: Vec<&dyn Aml> = devices.iter().map(|d| d as &dyn Aml).collect();
    let platform = RawAml(super::devices::devices_aml());
    let virtio = RawAml(if plan.virtio_pci() && !plan.devices.is_empty() {
        super::virtio::pci_host_bridge_aml()
    } else {
        super::virtio::virtio_mmio_aml(plan.virtio_acpi_slots())
    });
    let mut children = children;
    children.push(&platform);
    children.push(&virtio);
    let scope = Scope::new("\\_SB_".into(), children);
    let mut t = Sdt::new(
        *b"DSDT",
        36,
        DSDT_REVISION,
        OEM_ID,
        OEM_TABLE_ID,
        OEM_REVISION,
    );
    t.append_slice(&aml_bytes(&scope));
    let s5 = Name::new(
        "_S5_".into(),
        &Package::new(vec![&S5_SLEEP_TYPE, &S5_SLEEP_TYPE, &0u8, &0u8]),
    );
    t.append_slice(&aml_bytes(&s5));
    t.as_slice().to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn x2apic_entry_layout() {
        let b = local_x2apic(0x1_0203, 0x0405_0607);
        assert_eq!(b[0], 9);
        assert_eq!(b[1], 16);
        assert_eq!(&b[4..8], &[7, 6, 5, 4]);
        assert_eq!(&b[8..12], &[1, 0, 0, 0]);
        assert_eq!(&b[12..16], &[3, 2, 1, 0]);
    }

    #[test]
    fn xapic_entries_only_below_0xff() {
        assert!(fits_xapic(0, 0));
        assert!(fits_xapic(254, 254));
        assert!(!fits_xapic(255, 0));
        assert!(!fits_xapic(0, 255));
        assert!(!fits_xapic(3, 300));
    }
}
