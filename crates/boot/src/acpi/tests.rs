use vm_memory::{Bytes, GuestAddress};

use super::*;
use crate::testutil::{guest_memory, layout_of, plan, two_cell_plan};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn sum(b: &[u8]) -> u8 {
    b.iter().fold(0u8, |s, x| s.wrapping_add(*x))
}

fn u32_at(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(b[off..off + 4].try_into().unwrap())
}

fn u64_at(b: &[u8], off: usize) -> u64 {
    u64::from_le_bytes(b[off..off + 8].try_into().unwrap())
}

/// (type, bytes) of each structure after a table's fixed part of `skip` bytes.
fn structures(table: &[u8], skip: usize) -> Vec<(u8, Vec<u8>)> {
    let mut out = Vec::new();
    let mut off = skip;
    while off < table.len() {
        let len = usize::from(table[off + 1]);
        out.push((table[off], table[off..off + len].to_vec()));
        off += len;
    }
    assert_eq!(off, table.len());
    out
}

fn build(plan: &Plan) -> AcpiTables {
    let layout = layout_of(plan);
    build_acpi(plan, &layout, ACPI_START).unwrap()
}

#[test]
fn every_checksum_and_length_is_right() {
    let t = build(&two_cell_plan(64 * MIB));
    assert_eq!(sum(&t.rsdp.bytes[..20]), 0, "RSDP ACPI 1.0 checksum");
    assert_eq!(sum(&t.rsdp.bytes), 0, "RSDP extended checksum");
    assert_eq!(u32_at(&t.rsdp.bytes, 20), 36);
    for (name, table) in t.files().into_iter().skip(1) {
        assert_eq!(sum(&table.bytes), 0, "{name}");
        assert_eq!(
            u32_at(&table.bytes, 4) as usize,
            table.bytes.len(),
            "{name}"
        );
        assert_eq!(&table.bytes[10..16], b"VMHOST", "{name}");
    }
}

/// A generic address structure at `off`: (space, bit width, address).
fn gas_at(b: &[u8], off: usize) -> (u8, u8, u64) {
    (b[off], b[off + 1], u64_at(b, off + 4))
}

#[test]
fn fadt_names_the_power_off_and_reset_ports_and_dsdt_has_s5() {
    let t = build(&two_cell_plan(64 * MIB));
    let f = &t.fadt.bytes;
    assert_ne!(u32_at(f, 112) & (1 << 10), 0, "RESET_REG_SUP");
    assert_eq!(gas_at(f, 116), (1, 8, u64::from(RESET_PORT)), "RESET_REG");
    assert_eq!(f[128], RESET_VALUE);
    assert_eq!(gas_at(f, 244), (1, 8, u64::from(SLEEP_CONTROL_PORT)));
    assert_eq!(gas_at(f, 256), (1, 8, u64::from(SLEEP_STATUS_PORT)));
    // Name (_S5_, Package (4) {5, 5, 0, 0})
    let s5 = [
        0x08, b'_', b'S', b'5', b'_', 0x12, 0x08, 0x04, 0x0a, 5, 0x0a, 5, 0x00, 0x00,
    ];
    assert!(
        t.dsdt.bytes.windows(s5.len()).any(|w| w == s5),
        "{:x?}",
        t.dsdt.bytes
    );
}

#[test]
fn pointers_chain_rsdp_xsdt_tables_and_fadt_dsdt() {
    let t = build(&two_cell_plan(64 * MIB));
    assert_eq!(t.rsdp_addr(), ACPI_START);
    assert_eq!(u64_at(&t.rsdp.bytes, 24), t.xsdt.addr);
    let entries: Vec<u64> = (36..t.xsdt.bytes.len())
        .step_by(8)
        .map(|o| u64_at(&t.xsdt.bytes, o))
        .collect();
    assert_eq!(
        entries,
        vec![t.fadt.addr, t.madt.addr, t.srat.addr, t.slit.addr]
    );
    assert_eq!(&t.fadt.bytes[..4], b"FACP");
    assert_eq!(u64_at(&t.fadt.bytes, 140), t.dsdt.addr, "X_DSDT");
    assert_eq!(u32_at(&t.fadt.bytes, 40), 0, "32-bit DSDT unused");
    assert_ne!(u32_at(&t.fadt.bytes, 112) & (1 << 20), 0, "HW_REDUCED_ACPI");
    // Tables are 16-byte aligned, in order, without overlap, inside the BIOS area.
    let files = t.files();
    for w in files.windows(2) {
        assert!(w[0].1.range().end <= w[1].1.addr);
        assert_eq!(w[1].1.addr % 16, 0);
    }
    assert!(t.range().end <= ACPI_END);
}

#[test]
fn madt_has_one_local_apic_per_vcpu_and_the_ioapic() {
    let t = build(&two_cell_plan(64 * MIB));
    assert_eq!(u32_at(&t.madt.bytes, 36), LAPIC_ADDR);
    let s = structures(&t.madt.bytes, 44);
    let lapics: Vec<(u8, u8, u32)> = s
        .iter()
        .filter(|(ty, _)| *ty == 0)
        .map(|(_, b)| (b[2], b[3], u32_at(b, 4)))
        .collect();
    assert_eq!(lapics, vec![(0, 0, 1), (1, 1, 1), (2, 2, 1), (3, 3, 1)]);
    let ioapic: Vec<&Vec<u8>> = s.iter().filter(|(ty, _)| *ty == 1).map(|s| &s.1).collect();
    assert_eq!(ioapic.len(), 1);
    assert_eq!(u32_at(ioapic[0], 4), IOAPIC_ADDR);
    assert_eq!(u32_at(ioapic[0], 8), 0, "GSI base");
}

#[test]
fn large_apic_ids_get_x2apic_entries_in_madt_and_srat() {
    let p = plan(
        &[(0, 0), (0x1_0000, 1)],
        &[(64 * MIB, vec![10, 20]), (64 * MIB, vec![20, 10])],
    );
    let t = build(&p);
    let madt = structures(&t.madt.bytes, 44);
    assert_eq!(madt[0].0, 0);
    assert_eq!(madt[1].0, 9);
    assert_eq!(u32_at(&madt[1].1, 4), 0x1_0000, "x2APIC ID");
    assert_eq!(u32_at(&madt[1].1, 12), 1, "UID");
    let srat = structures(&t.srat.bytes, 48);
    assert_eq!(srat[1].0, 2);
    assert_eq!(u32_at(&srat[1].1, 4), 1, "proximity domain");
    assert_eq!(u32_at(&srat[1].1, 8), 0x1_0000);
    for (name, table) in t.files() {
        assert_eq!(sum(&table.bytes), 0, "{name}");
    }
}

#[test]
fn srat_maps_vcpus_and_layout_regions_to_cells() {
    // Cell 1 straddles the MMIO hole: two memory affinity entries.
    let p = plan(
        &[(0, 0), (2, 1)],
        &[(2 * GIB, vec![10, 21]), (2 * GIB, vec![21, 10])],
    );
    let t = build(&p);
    assert_eq!(u32_at(&t.srat.bytes, 36), 1, "reserved 1");
    let s = structures(&t.srat.bytes, 48);
    let cpus: Vec<(u8, u8)> = s
        .iter()
        .filter(|(ty, _)| *ty == 0)
        .map(|(_, b)| (b[3], b[2]))
        .collect();
    assert_eq!(cpus, vec![(0, 0), (2, 1)]);
    let mem: Vec<(u32, u64, u64, u32)> = s
        .iter()
        .filter(|(ty, _)| *ty == 1)
        .map(|(_, b)| (u32_at(b, 2), u64_at(b, 8), u64_at(b, 16), u32_at(b, 28)))
        .collect();
    assert_eq!(
        mem,
        vec![
            (0, 0, 2 * GIB, 1),
            (1, 2 * GIB, GIB, 1),
            (1, 4 * GIB, GIB, 1)
        ]
    );
}

#[test]
fn slit_keeps_asymmetric_distances_row_by_row() {
    let p = plan(
        &[(0, 0), (1, 1), (2, 2)],
        &[
            (64 * MIB, vec![10, 20, 30]),
            (64 * MIB, vec![21, 10, 255]),
            (64 * MIB, vec![31, 41, 10]),
        ],
    );
    let t = build(&p);
    assert_eq!(u64_at(&t.slit.bytes, 36), 3);
    assert_eq!(&t.slit.bytes[44..], &[10, 20, 30, 21, 10, 255, 31, 41, 10]);
}

#[test]
fn bad_plans_are_rejected_with_context() {
    let layout = |p: &Plan| layout_of(p);
    let mut p = two_cell_plan(64 * MIB);
    p.vcpus.clear();
    assert!(matches!(
        build_acpi(&p, &layout(&p), ACPI_START),
        Err(AcpiError::NoVcpus)
    ));

    let p = plan(&[(0, 0)], &[(64 * MIB, vec![10, 20])]);
    let err = build_acpi(&p, &layout(&p), ACPI_START).unwrap_err();
    assert!(
        matches!(
            err,
            AcpiError::DistanceRow {
                cell: 0,
                len: 2,
                cells: 1
            }
        ),
        "{err:?}"
    );

    let p = plan(&[(0, 0)], &[(64 * MIB, vec![9])]);
    let err = build_acpi(&p, &layout(&p), ACPI_START).unwrap_err();
    assert!(
        matches!(err, AcpiError::Distance { distance: 9, .. }),
        "{err:?}"
    );
    let p = plan(&[(0, 0)], &[(64 * MIB, vec![256])]);
    let err = build_acpi(&p, &layout(&p), ACPI_START).unwrap_err();
    assert!(
        matches!(err, AcpiError::Distance { distance: 256, .. }),
        "{err:?}"
    );

    let p = plan(&[(0, 3)], &[(64 * MIB, vec![10])]);
    let err = build_acpi(&p, &layout(&p), ACPI_START).unwrap_err();
    assert!(
        matches!(
            err,
            AcpiError::VcpuCell {
                vcpu: 0,
                cell: 3,
                cells: 1
            }
        ),
        "{err:?}"
    );

    let mut p = two_cell_plan(64 * MIB);
    p.guest_cells[1].cell = 5;
    let err = build_acpi(&p, &layout(&p), ACPI_START).unwrap_err();
    assert!(
        matches!(err, AcpiError::CellNumbering { index: 1, cell: 5 }),
        "{err:?}"
    );

    let p = two_cell_plan(64 * MIB);
    let err = build_acpi(&p, &layout(&p), ACPI_START + 8).unwrap_err();
    assert!(matches!(err, AcpiError::Misaligned { .. }), "{err:?}");
    let err = build_acpi(&p, &layout(&p), ACPI_END - 0x100).unwrap_err();
    assert!(
        matches!(
            err,
            AcpiError::TooLarge {
                limit: ACPI_END,
                ..
            }
        ),
        "{err:?}"
    );

    let many: Vec<(u32, u32)> = (0..=u32::try_from(MAX_ACPI_VCPUS).unwrap())
        .map(|i| (i, 0))
        .collect();
    let p = plan(&many, &[(64 * MIB, vec![10])]);
    let err = build_acpi(&p, &layout(&p), ACPI_START).unwrap_err();
    assert!(matches!(err, AcpiError::TooManyVcpus { .. }), "{err:?}");
}

#[test]
fn a_thousand_vcpus_fit_in_the_bios_area() {
    let vcpus: Vec<(u32, u32)> = (0..1024).map(|i| (i, i % 2)).collect();
    let p = plan(
        &vcpus,
        &[(64 * MIB, vec![10, 21]), (64 * MIB, vec![21, 10])],
    );
    let t = build(&p);
    assert!(t.range().end <= ACPI_END, "{:x?}", t.range());
    for (name, table) in t.files() {
        assert_eq!(sum(&table.bytes), 0, "{name}");
    }
}

#[test]
fn tables_are_written_to_guest_memory_and_files() {
    let p = two_cell_plan(64 * MIB);
    let layout = layout_of(&p);
    let t = build_acpi(&p, &layout, ACPI_START).unwrap();
    let mem = guest_memory(&layout);
    t.write_to(&mem).unwrap();
    let mut sig = [0u8; 8];
    mem.read_slice(&mut sig, GuestAddress(ACPI_START)).unwrap();
    assert_eq!(&sig, b"RSD PTR ");
    let mut srat = vec![0u8; t.srat.bytes.len()];
    mem.read_slice(&mut srat, GuestAddress(t.srat.addr))
        .unwrap();
    assert_eq!(srat, t.srat.bytes);

    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("acpi");
    let files = write_tables(&t, &out).unwrap();
    let names: Vec<String> = files
        .iter()
        .map(|f| f.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        ["rsdp.dat", "xsdt.dat", "facp.dat", "dsdt.dat", "apic.dat", "srat.dat", "slit.dat"]
    );
    assert_eq!(std::fs::read(&files[5]).unwrap(), t.srat.bytes);

    let blocker = dir.path().join("file");
    std::fs::write(&blocker, b"x").unwrap();
    let err = write_tables(&t, &blocker.join("sub")).unwrap_err();
    assert!(matches!(err, AcpiError::CreateDir { .. }), "{err:?}");
}

#[test]
fn writing_outside_guest_memory_names_the_table() {
    let p = two_cell_plan(64 * MIB);
    let layout = layout_of(&p);
    let t = build_acpi(&p, &layout, 0x1_0000_0000).unwrap();
    let err = t.write_to(&guest_memory(&layout)).unwrap_err();
    assert!(
        matches!(
            err,
            AcpiError::WriteGuest {
                table: "rsdp.dat",
                addr: 0x1_0000_0000,
                ..
            }
        ),
        "{err:?}"
    );
}

/// A Linux plan with a disk, a NIC and an rng, announced as `announce` says.
fn plan_with_devices(announce: vmhost_config::VirtioAnnounce) -> Plan {
    use vmhost_config::{Binding, DeviceSpec, InterfaceSpec, MacAddress};
    let mut p = two_cell_plan(64 * MIB);
    p.boot = vmhost_config::BootSpec::Kernel {
        kernel: "/k".into(),
        initrd: None,
        cmdline: "console=ttyS0".into(),
        virtio_announce: announce,
        irqchip: vmhost_config::Irqchip::Kernel,
    };
    p.devices = vmhost_plan::devices::DevicePlan::new(DeviceSpec {
        disks: vec![],
        interfaces: vec![InterfaceSpec {
            name: "default".into(),
            binding: Binding::Bridge,
            mac: MacAddress::generate("vm", "default"),
            tap: None,
        }],
        rng: true,
        vsock: None,
    });
    p
}

fn iasl_dsdt(t: &AcpiTables) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("dsdt.dat");
    std::fs::write(&path, &t.dsdt.bytes).unwrap();
    let out = std::process::Command::new("iasl")
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
    std::fs::read_to_string(dir.path().join("dsdt.dsl")).unwrap()
}

/// Regression: the virtio devices were announced only on the command line; the DSDT now holds
/// one `LNRO0005` device per slot (iasl decodes each with its window and edge GSI) and the
/// command line holds none, so Linux probes each device exactly once.
#[test]
fn dsdt_announces_each_virtio_device_once() {
    let p = plan_with_devices(vmhost_config::VirtioAnnounce::Acpi);
    assert_eq!(p.virtio_cmdline(), "", "announced twice");
    let dsl = iasl_dsdt(&build(&p));
    assert_eq!(dsl.matches("\"LNRO0005\"").count(), 2, "{dsl}");
    for (i, (base, gsi)) in [("0xD0000000", "0x00000010"), ("0xD0001000", "0x00000011")]
        .into_iter()
        .enumerate()
    {
        let start = dsl.find(&format!("Device (VR{i:02X})")).expect(&dsl);
        let dev = &dsl[start..];
        let dev = &dev[..dev.find("EndTag").unwrap_or(dev.len())];
        assert!(
            dev.contains(&format!(
                "Name (_UID, {})",
                if i == 0 { "Zero" } else { "One" }
            )),
            "{dev}"
        );
        assert!(
            dev.contains(&format!(
                "Memory32Fixed (ReadWrite,\n                    {base},"
            )),
            "{dev}"
        );
        assert!(dev.contains("0x00001000,"), "{dev}");
        assert!(
            dev.contains("Interrupt (ResourceConsumer, Edge, ActiveHigh, Exclusive, ,, )"),
            "{dev}"
        );
        assert!(dev.contains(gsi), "{dev}");
    }
    // The processors, platform devices and \_S5_ are still there.
    for want in [
        "Device (C000)",
        "Device (COM1)",
        "Device (GED0)",
        "Name (_S5,",
    ] {
        assert!(dsl.contains(want), "{want} missing:\n{dsl}");
    }
}

/// `boot.virtio_announce = "cmdline"`: the command line names every device and the DSDT none.
#[test]
fn cmdline_fallback_leaves_the_dsdt_without_virtio_devices() {
    let p = plan_with_devices(vmhost_config::VirtioAnnounce::Cmdline);
    assert_eq!(
        p.virtio_cmdline(),
        "virtio_mmio.device=4K@0xd0000000:16 virtio_mmio.device=4K@0xd0001000:17"
    );
    let t = build(&p);
    assert!(!t.dsdt.bytes.windows(8).any(|w| w == b"LNRO0005"));
    assert!(!iasl_dsdt(&t).contains("LNRO0005"));
}
