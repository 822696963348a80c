//! The main job shows the translation: `vmhost` with the embedded quickstart prints a short
//! plan (guest, envelope and its terms, vCPU → PU, emulator, cells → nodes, hugepages, what
//! dedicated placement would give) before the placement read back from /proc; the embedded
//! quickstart is `configs/quickstart.toml`.
#![allow(clippy::unwrap_used)]

mod common;

use common::{root, stderr, stdout, vmhost_json};
use std::process::Command;
use vmhost_testsupport::{lock_cpus, lock_pool, need_kvm};

fn run_dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("vmhost-translation-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// This process's `Cpus_allowed_list`, as the kernel reports it.
fn cpus_allowed() -> String {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .unwrap()
        .trim()
        .to_string()
}

#[test]
fn the_embedded_quickstart_is_configs_quickstart_toml() {
    // Both plans see the same pool.
    let _pool = lock_pool();
    let rd = run_dir("same");
    let rd = rd.to_str().unwrap();
    let (code, embedded) = vmhost_json(&["plan", "--json", "--run-dir", rd]);
    assert_eq!(code, 0, "{embedded}");
    let file = root().join("configs/quickstart.toml");
    let (code, from_file) = vmhost_json(&[
        "plan",
        "--json",
        "--run-dir",
        rd,
        "--config",
        file.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{from_file}");
    assert_eq!(embedded, from_file);
}

#[test]
fn the_main_job_prints_the_plan_before_the_placement_read_back() {
    if !need_kvm("the_main_job_prints_the_plan_before_the_placement_read_back") {
        return;
    }
    let _cpus = lock_cpus();
    // The quickstart takes 2Mi hugepages when the pool has them: the pool must not change
    // between the plan and the run.
    let _pool = lock_pool();
    let rd = run_dir("main");
    let rd = rd.to_str().unwrap();
    let (code, plan) = vmhost_json(&["plan", "--json", "--run-dir", rd]);
    assert_eq!(code, 0, "{plan}");
    let o = Command::new(env!("CARGO_BIN_EXE_vmhost"))
        .args(["--run-dir", rd])
        .current_dir(std::env::temp_dir())
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    let summary = out
        .find("VM quickstart: the plan (`vmhost plan` prints it in full)")
        .unwrap_or_else(|| panic!("no plan summary: {out}"));
    let readback = out
        .find("VM quickstart: placement read back from /proc at start")
        .unwrap_or_else(|| panic!("no placement table: {out}"));
    assert!(
        summary < readback,
        "the plan comes after the placement: {out}"
    );
    let lines: Vec<&str> = out[summary..readback].lines().collect();
    let line = |label: &str| -> &str {
        lines
            .iter()
            .find(|l| l.starts_with(&format!("  {label:<10} ")))
            .unwrap_or_else(|| panic!("no {label} line: {out}"))
    };
    assert!(line("guest").contains("2 vCPUs (1 sockets x 2 cores x 1 threads), 256Mi of RAM"));
    let env = &plan["envelope"];
    let mib = |b: &serde_json::Value| format!("{:.1} MiB", b.as_u64().unwrap() as f64 / 1048576.0);
    let envelope = line("envelope");
    assert!(
        envelope.contains(&format!(
            "memory request {} (vmhost overhead {} = ",
            mib(&env["memory_request_bytes"]),
            mib(&env["overhead_bytes"])
        )),
        "{envelope}"
    );
    for (term, bytes) in env["overhead_terms"].as_object().unwrap() {
        assert!(
            envelope.contains(&format!("{term} {}", mib(bytes))),
            "{term}: {envelope}"
        );
    }
    assert_eq!(
        line("vCPU → PU"),
        format!("  vCPU → PU  vCPUs 0-1 float over PUs {}", cpus_allowed())
    );
    assert_eq!(
        line("emulator"),
        format!("  emulator   PUs {}", cpus_allowed())
    );
    assert!(line("cells").starts_with("  cells      cell 0 → "), "{out}");
    // Hugepages where the pool has them, else normal pages and why (the plan tells which).
    let pages = line("hugepages");
    match plan["backing"]["kind"].as_str() {
        Some("hugetlb") => assert!(pages.contains(" x 2Mi on node"), "{pages}\n{plan}"),
        _ => assert!(
            pages.starts_with(
                "  hugepages  none: anonymous memory, as memory.hugepages.fallback allows: "
            ),
            "{pages}\n{plan}"
        ),
    }
    assert!(
        line("dedicated")
            .starts_with("  dedicated  with cpu.dedicated_cpu_placement = true it would "),
        "{out}"
    );
}

#[test]
fn check_target_prints_the_cells_as_a_table() {
    let spec = run_dir("mig").join("mig.toml");
    std::fs::write(
        &spec,
        "[cpu]\ncores = 6\ndedicated_cpu_placement = true\nnuma = { guest_mapping_passthrough = true }\n\
         [memory]\nguest = \"64Mi\"\nhugepages = { page_size = \"2Mi\" }\n",
    )
    .unwrap();
    let o = common::vmhost(&[
        "check-target",
        "--config",
        spec.to_str().unwrap(),
        "--source-topology",
        "synthetic:package:2 numa:1 core:4 pu:1",
        "--topology",
        "synthetic:package:1 numa:1 core:8 pu:1",
        "--hugepages",
        "node0:2Mi=64",
    ]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(!out.contains("(["), "{out}");
    for row in [
        "host    cell  vCPUs  memory  distances",
        "source  0     0-3    42Mi    10 20",
        "source  1     4-5    22Mi    20 10",
        "target  0     0-5    64Mi    10",
    ] {
        assert!(out.lines().any(|l| l.trim() == row), "{row}: {out}");
    }
}
