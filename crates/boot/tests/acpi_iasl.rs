//! Independent check of the ACPI tables: ACPICA's `iasl -d` disassembles them without errors
//! or checksum warnings, and the disassembled MADT, SRAT, SLIT, XSDT and FADT match the plan.
//!
//! `iasl` (Debian package `acpica-tools`) must be installed: the tests fail with a clear message
//! when it is missing, unless `VMHOST_SKIP_IASL_TESTS=1`. `iasl -d` cannot read an RSDP (it is
//! not a table with a standard header; ACPICA: "Loading an RSDP is not supported"), so the RSDP
//! is checked byte by byte here.
#![allow(clippy::unwrap_used)] // helpers outside #[test] fns panic on bad fixtures too

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use vmhost_boot::acpi::IOAPIC_ADDR;
use vmhost_boot::{
    build_acpi, write_tables, AcpiTables, ACPI_START, RESET_PORT, SLEEP_CONTROL_PORT,
    SLEEP_STATUS_PORT,
};
use vmhost_memory::{GuestLayout, MMIO_HOLE_END, MMIO_HOLE_START};
use vmhost_plan::Plan;

const SPEC: &str = r#"
name = "numa2"
[cpu]
cores = 4
dedicated_cpu_placement = true
numa = { guest_mapping_passthrough = true }
[memory]
guest = "128Mi"
hugepages = { page_size = "2Mi" }
"#;

/// The SDT files `iasl -d` disassembles (everything but the RSDP).
const SDT_FILES: [&str; 6] = [
    "xsdt.dat", "facp.dat", "dsdt.dat", "apic.dat", "srat.dat", "slit.dat",
];

/// A 2-cell, 4-vCPU plan on a synthetic 2-node host.
fn two_cell_plan() -> Plan {
    let mut host = vmhost_topology::load_synthetic("package:2 numa:1 core:2 pu:1").unwrap();
    let pools = vmhost_topology::parse_hugepages_arg("node0:2Mi=64,node1:2Mi=64").unwrap();
    vmhost_topology::apply_hugepages(&mut host, &pools).unwrap();
    let spec = vmhost_config::from_toml_str(SPEC, "numa2.toml")
        .unwrap()
        .spec;
    let plan = vmhost_plan::plan(&spec, &host, &Default::default())
        .into_result()
        .unwrap();
    assert_eq!(plan.vcpus.len(), 4);
    assert_eq!(plan.guest_cells.len(), 2);
    plan
}

fn layout(plan: &Plan) -> GuestLayout {
    GuestLayout::from_plan(plan, MMIO_HOLE_START..MMIO_HOLE_END).unwrap()
}

/// False (skip) only when iasl is missing and the opt-out variable is set.
fn iasl_available() -> bool {
    match Command::new("iasl").arg("-v").output() {
        Ok(_) => true,
        Err(_) if std::env::var("VMHOST_SKIP_IASL_TESTS").as_deref() == Ok("1") => {
            eprintln!("iasl not installed: skipped (VMHOST_SKIP_IASL_TESTS=1)");
            false
        }
        Err(e) => panic!(
            "iasl not found ({e}): install ACPICA (`apt-get install acpica-tools`), \
             or set VMHOST_SKIP_IASL_TESTS=1 to skip"
        ),
    }
}

/// Runs `iasl -d` on `files` in `dir` and returns its output, or why the tables are not clean:
/// a non-zero exit, an error or warning in the output, or an "Incorrect checksum" / "Invalid"
/// comment in a disassembly (iasl reports checksum mismatches only there, and exits 0).
fn disassemble(dir: &Path, files: &[&str]) -> Result<String, String> {
    let out = Command::new("iasl")
        .arg("-d")
        .args(files)
        .current_dir(dir)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if !out.status.success() {
        return Err(format!("iasl -d failed:\n{text}"));
    }
    let lower = text.to_lowercase();
    if lower.contains("error") || lower.contains("warning") {
        return Err(format!("iasl -d reported problems:\n{text}"));
    }
    for f in files {
        let dsl = std::fs::read_to_string(dir.join(f).with_extension("dsl"))
            .map_err(|e| format!("no disassembly of {f}: {e}"))?;
        let bad: Vec<&str> = dsl
            .lines()
            .filter(|l| l.contains("Incorrect checksum") || l.contains("Invalid"))
            .collect();
        if !bad.is_empty() {
            return Err(format!("{f}: {}", bad.join("\n")));
        }
    }
    Ok(text)
}

/// `[off dec len]  Field Name : value` lines of a data-table disassembly (and the unbracketed
/// `Flag Name : value` lines that decode flags), split into the table's own fields (first
/// group) and one group per subtable.
fn fields(dsl: &str) -> Vec<Vec<(String, String)>> {
    let mut groups = vec![Vec::new()];
    for line in dsl.lines() {
        if line.starts_with("Raw Table Data") {
            break;
        }
        let line = line.trim_start();
        let kv = match line.strip_prefix('[') {
            Some(rest) => match rest.split_once(']') {
                Some((_, kv)) => kv,
                None => continue,
            },
            None if line.starts_with('*') || line.starts_with('/') => continue,
            None => line,
        };
        let Some((k, v)) = kv.split_once(" : ") else {
            continue;
        };
        let (k, v) = (k.trim().to_string(), v.trim().to_string());
        if k == "Subtable Type" {
            groups.push(Vec::new());
        }
        groups.last_mut().unwrap().push((k, v));
    }
    groups
}

/// The hex number at the start of a value (`"0000000004000000"`, `"01 [Memory Affinity]"`).
fn hex(v: &str) -> u64 {
    u64::from_str_radix(v.split_whitespace().next().unwrap(), 16).unwrap()
}

fn get<'a>(group: &'a [(String, String)], key: &str) -> &'a str {
    group
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
        .unwrap_or_else(|| panic!("no {key} in {group:?}"))
}

fn subtables(groups: &[Vec<(String, String)>], ty: u64) -> Vec<&Vec<(String, String)>> {
    groups[1..]
        .iter()
        .filter(|g| hex(get(g, "Subtable Type")) == ty)
        .collect()
}

fn read_dsl(dir: &Path, name: &str) -> String {
    std::fs::read_to_string(dir.join(name)).unwrap()
}

fn check_rsdp(t: &AcpiTables) {
    let b = &t.rsdp.bytes;
    let sum = |s: &[u8]| s.iter().fold(0u8, |a, x| a.wrapping_add(*x));
    assert_eq!(&b[..8], b"RSD PTR ");
    assert_eq!(b[15], 2, "revision");
    assert_eq!(sum(&b[..20]), 0, "RSDP checksum");
    assert_eq!(sum(b), 0, "RSDP extended checksum");
    assert_eq!(
        u64::from_le_bytes(b[24..32].try_into().unwrap()),
        t.xsdt.addr
    );
}

#[test]
fn iasl_disassembles_the_tables_of_a_two_cell_plan_and_they_match_the_plan() {
    if !iasl_available() {
        return;
    }
    let plan = two_cell_plan();
    let layout = layout(&plan);
    let tables = build_acpi(&plan, &layout, ACPI_START).unwrap();
    let dir = tempfile::tempdir().unwrap();
    write_tables(&tables, dir.path()).unwrap();
    disassemble(dir.path(), &SDT_FILES).unwrap();
    check_rsdp(&tables);

    // MADT: one enabled local APIC per vCPU with the plan's APIC ID, and the I/O APIC.
    let madt = fields(&read_dsl(dir.path(), "apic.dsl"));
    let lapics: Vec<(u64, u64, u64)> = subtables(&madt, 0)
        .iter()
        .map(|g| {
            (
                hex(get(g, "Processor ID")),
                hex(get(g, "Local Apic ID")),
                hex(get(g, "Processor Enabled")),
            )
        })
        .collect();
    let want: Vec<(u64, u64, u64)> = plan
        .vcpus
        .iter()
        .map(|v| (u64::from(v.vcpu), u64::from(v.apic_id), 1))
        .collect();
    assert_eq!(lapics, want);
    let ioapic = subtables(&madt, 1);
    assert_eq!(ioapic.len(), 1);
    assert_eq!(hex(get(ioapic[0], "Address")), u64::from(IOAPIC_ADDR));

    // SRAT: each vCPU's APIC ID in its cell's proximity domain; each layout region in its cell.
    let srat = fields(&read_dsl(dir.path(), "srat.dsl"));
    let cpus: Vec<(u64, u64)> = subtables(&srat, 0)
        .iter()
        .map(|g| {
            let domain = hex(get(g, "Proximity Domain Low(8)"))
                | (hex(get(g, "Proximity Domain High(24)")) << 8);
            (hex(get(g, "Apic ID")), domain)
        })
        .collect();
    let want: Vec<(u64, u64)> = plan
        .vcpus
        .iter()
        .map(|v| (u64::from(v.apic_id), u64::from(v.guest_cell)))
        .collect();
    assert_eq!(cpus, want);
    let mem: Vec<(u64, u64, u64, u64)> = subtables(&srat, 1)
        .iter()
        .map(|g| {
            (
                hex(get(g, "Proximity Domain")),
                hex(get(g, "Base Address")),
                hex(get(g, "Address Length")),
                hex(get(g, "Enabled")),
            )
        })
        .collect();
    let want: Vec<(u64, u64, u64, u64)> = layout
        .regions
        .iter()
        .map(|r| (u64::from(r.cell), r.gpa, r.size_bytes, 1))
        .collect();
    assert_eq!(mem, want);
    assert_eq!(
        want,
        vec![(0, 0, 64 << 20, 1), (1, 64 << 20, 64 << 20, 1)],
        "two 64 MiB cells"
    );

    // SLIT: the plan's guest distances, row by row.
    let slit = fields(&read_dsl(dir.path(), "slit.dsl"));
    assert_eq!(hex(get(&slit[0], "Localities")), 2);
    let mut rows = BTreeMap::new();
    for (k, v) in &slit[0] {
        if let Some(i) = k.strip_prefix("Locality") {
            let row: Vec<u32> = v
                .split_whitespace()
                .map(|b| u32::from_str_radix(b, 16).unwrap())
                .collect();
            rows.insert(i.trim().parse::<u32>().unwrap(), row);
        }
    }
    for c in &plan.guest_cells {
        assert_eq!(rows[&c.cell], c.distances, "cell {}", c.cell);
    }
    assert_eq!(rows[&0], vec![10, 20]);

    // XSDT and FADT pointers.
    let xsdt = fields(&read_dsl(dir.path(), "xsdt.dsl"));
    let entries: Vec<u64> = xsdt[0]
        .iter()
        .filter(|(k, _)| k.starts_with("ACPI Table Address"))
        .map(|(_, v)| hex(v))
        .collect();
    let want = [
        tables.fadt.addr,
        tables.madt.addr,
        tables.srat.addr,
        tables.slit.addr,
    ];
    assert_eq!(entries, want);
    let fadt = fields(&read_dsl(dir.path(), "facp.dsl"));
    let dsdt_addrs: Vec<u64> = fadt[0]
        .iter()
        .filter(|(k, _)| k == "DSDT Address")
        .map(|(_, v)| hex(v))
        .collect();
    assert_eq!(
        dsdt_addrs,
        vec![0, tables.dsdt.addr],
        "32-bit and 64-bit DSDT"
    );
    assert_eq!(hex(get(&fadt[0], "Hardware Reduced (V5)")), 1);
    assert_eq!(hex(get(&fadt[0], "Reset Register Supported (V2)")), 1);
    let addresses: Vec<u64> = fadt[0]
        .iter()
        .filter(|(k, _)| k == "Address")
        .map(|(_, v)| hex(v))
        .collect();
    for port in [RESET_PORT, SLEEP_CONTROL_PORT, SLEEP_STATUS_PORT] {
        assert!(
            addresses.contains(&u64::from(port)),
            "port {port:#x} in {addresses:x?}"
        );
    }

    // DSDT: one processor device per vCPU, and \_S5_ for power-off.
    let dsdt = read_dsl(dir.path(), "dsdt.dsl");
    assert_eq!(dsdt.matches("\"ACPI0007\"").count(), plan.vcpus.len());
    assert!(dsdt.contains("Name (_S5, Package"), "{dsdt}");
}

#[test]
fn iasl_decodes_x2apic_entries_for_large_apic_ids() {
    if !iasl_available() {
        return;
    }
    let mut plan = two_cell_plan();
    plan.vcpus[3].apic_id = 0x1_0003;
    let layout = layout(&plan);
    let tables = build_acpi(&plan, &layout, ACPI_START).unwrap();
    let dir = tempfile::tempdir().unwrap();
    write_tables(&tables, dir.path()).unwrap();
    disassemble(dir.path(), &SDT_FILES).unwrap();

    let madt = fields(&read_dsl(dir.path(), "apic.dsl"));
    assert_eq!(subtables(&madt, 0).len(), 3);
    let x2 = subtables(&madt, 9);
    assert_eq!(x2.len(), 1);
    assert_eq!(hex(get(x2[0], "Processor x2Apic ID")), 0x1_0003);
    assert_eq!(hex(get(x2[0], "Processor UID")), 3);
    let srat = fields(&read_dsl(dir.path(), "srat.dsl"));
    let x2 = subtables(&srat, 2);
    assert_eq!(x2.len(), 1);
    assert_eq!(hex(get(x2[0], "Apic ID")), 0x1_0003);
    assert_eq!(hex(get(x2[0], "Proximity Domain")), 1);
}

#[test]
fn a_corrupted_checksum_is_caught_by_the_iasl_check() {
    if !iasl_available() {
        return;
    }
    let plan = two_cell_plan();
    let tables = build_acpi(&plan, &layout(&plan), ACPI_START).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut srat = tables.srat.bytes.clone();
    srat[9] = srat[9].wrapping_add(1);
    std::fs::write(dir.path().join("srat.dat"), srat).unwrap();
    let err = disassemble(dir.path(), &["srat.dat"]).unwrap_err();
    assert!(err.contains("Incorrect checksum"), "{err}");
}
