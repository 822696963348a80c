//! `vmhost acpi` writes tables that ACPICA's `iasl -d` disassembles cleanly and that describe
//! the plan.
#![allow(clippy::unwrap_used)]

mod common;

use std::process::Command;

use common::{stderr, vmhost};

#[test]
fn acpi_command_tables_disassemble_and_match_the_plan() {
    let dir = std::env::temp_dir().join(format!("vmhost-cli-acpi-{}", std::process::id()));
    let spec = dir.join("two-cells.toml");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        &spec,
        "[cpu]\ncores = 4\ndedicated_cpu_placement = true\nnuma = { guest_mapping_passthrough = true }\n\
         [memory]\nguest = \"128Mi\"\nhugepages = { page_size = \"2Mi\" }\n",
    )
    .unwrap();
    let out = dir.join("tables");
    let o = vmhost(&[
        "acpi",
        "--config",
        spec.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--topology",
        "synthetic:package:2 numa:1 core:2 pu:1",
        "--hugepages",
        "node0:2Mi=64,node1:2Mi=64",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let names = ["xsdt", "facp", "dsdt", "apic", "srat", "slit"];
    let files: Vec<String> = names.iter().map(|n| format!("{n}.dat")).collect();
    let status = Command::new("iasl")
        .arg("-d")
        .args(&files)
        .current_dir(&out)
        .output()
        .expect("iasl (Debian package acpica-tools) must be installed: make setup installs it");
    assert!(
        status.status.success(),
        "iasl -d failed: {}",
        String::from_utf8_lossy(&status.stderr)
    );
    for n in names {
        let dsl = std::fs::read_to_string(out.join(format!("{n}.dsl"))).unwrap();
        assert!(!dsl.contains("Incorrect checksum"), "{n}: {dsl}");
    }
    let srat = std::fs::read_to_string(out.join("srat.dsl")).unwrap();
    // vCPUs 0,1 on node0 -> domain 0; 2,3 on node1 -> domain 1; 64Mi per cell.
    let domains: Vec<&str> = srat
        .lines()
        .filter(|l| l.contains("Proximity Domain Low(8)"))
        .map(|l| l.rsplit(':').next().unwrap().trim())
        .collect();
    assert_eq!(domains, ["00", "00", "01", "01"]);
    let lengths: Vec<&str> = srat
        .lines()
        .filter(|l| l.contains("Address Length"))
        .map(|l| l.rsplit(':').next().unwrap().trim())
        .collect();
    assert_eq!(lengths, ["0000000004000000", "0000000004000000"]);
    let slit = std::fs::read_to_string(out.join("slit.dsl")).unwrap();
    assert!(
        slit.contains("Locality   0 : 0A 14") && slit.contains("Locality   1 : 14 0A"),
        "{slit}"
    );
}
