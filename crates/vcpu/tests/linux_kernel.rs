//! Linux guests on real KVM, with Debian's 6.1 kernel as the witness: it parses the ACPI tables
//! built from the plan and prints what it understood on the serial console.
//!
//! The kernel comes from `crates/boot/scripts/fetch-test-kernel.sh` (into
//! `$VMHOST_TEST_KERNEL_DIR`, default `target/test-kernel`; CI runs it first); these tests fail
//! with that hint when it is missing, unless `VMHOST_SKIP_KERNEL_TESTS=1`.
//!
//! On the nested hosts vmhost is developed on, guest ring 0 is emulated at about a million
//! instructions per second, so the kernel cannot finish booting; it gets far enough to print
//! its parse of SRAT and MADT. The witness test reads the serial log until those lines appear,
//! then stops the VM. Measured there (Debian 6.1.0-57, 2 cells x 128 MiB on 2 MiB hugepages,
//! 2 vCPUs): first serial byte after about 20 s of run, the SRAT nodes and "Allowing 2 CPUs"
//! after about 32 s from `Vm::new`; the whole test takes about 35 s. Left running, the kernel
//! stops at about 90 s on `xrstor64` (`KVM_EXIT_INTERNAL_ERROR`; with `noxsave` on the command
//! line it gets to the `int3` self-test instead): see `arch::x86_64::nested` for why CPUID
//! masking cannot avoid that here.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use vmhost_boot::{BootError, BootMode};
use vmhost_memory::GuestMemory;
use vmhost_plan::{HugepageDemand, Plan};
use vmhost_vcpu::{
    BootReport, ConsoleInput, LinuxEntry, RunStatus, SerialOut, UnknownAccessPolicy, Vm, VmError,
    VmOptions,
};

/// How long the witness may take (the budget: about three minutes).
const BUDGET: Duration = Duration::from_secs(200);
const MIB: u64 = 1 << 20;

/// A TOML spec booting `kernel` with `mib` MiB of 2 MiB hugepages in two guest cells, one vCPU
/// each.
fn spec(kernel: &Path, mib: u64, cmdline: &str) -> String {
    format!(
        "name = \"witness\"\n[cpu]\ncores = 2\ndedicated_cpu_placement = true\n\
         numa = {{ guest_mapping_passthrough = true }}\n\
         [memory]\nguest = \"{mib}Mi\"\nhugepages = {{ page_size = \"2Mi\" }}\n\
         [boot]\nkernel = \"{}\"\ncmdline = \"{cmdline}\"\n",
        kernel.display()
    )
}

/// Plans `toml` against a synthetic two-node host (one PU per node, `pages` free 2 MiB pages
/// per node), then remaps it onto this one-node host: vCPU `i` on CPU `i % 2`, every cell's
/// memory on node 0. The guest still sees two NUMA cells.
fn two_cell_plan(toml: &str, pages: u64) -> Plan {
    let spec = vmhost_config::from_toml_str(toml, "witness.toml")
        .unwrap()
        .spec;
    let mut host = vmhost_topology::load_synthetic("package:2 numa:1 core:1 pu:1").unwrap();
    let pools =
        vmhost_topology::parse_hugepages_arg(&format!("node0:2Mi={pages},node1:2Mi={pages}"))
            .unwrap();
    vmhost_topology::apply_hugepages(&mut host, &pools).unwrap();
    let mut plan = vmhost_plan::plan(&spec, &host, &Default::default())
        .into_result()
        .unwrap();
    assert_eq!(plan.guest_cells.len(), 2, "{plan:#?}");
    remap_to_this_host(&mut plan);
    plan
}

/// Points every host PU and node of `plan` at CPUs 0-1 and node 0 of this host.
fn remap_to_this_host(plan: &mut Plan) {
    for v in &mut plan.vcpus {
        v.host_cpu = Some(v.vcpu % 2);
        v.host_node = Some(0);
    }
    for c in &mut plan.guest_cells {
        c.host_node = Some(0);
        c.prefault_cpus = vec![0, 1];
    }
    plan.emulator.host_cpus = vec![0, 1];
    plan.floating_cpus.clear();
    let (page, count) = plan
        .envelope
        .hugepages
        .iter()
        .fold((2 * MIB, 0), |(_, n), d| (d.page_size_bytes, n + d.count));
    plan.envelope.hugepages = vec![HugepageDemand {
        node: Some(0),
        page_size_bytes: page,
        count,
    }];
}

/// The serial log so far, as text.
fn text(log: &Mutex<Vec<u8>>) -> String {
    String::from_utf8_lossy(&log.lock().unwrap()).into_owned()
}

/// The last `n` lines of `s`.
fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// `[mem 0xSTART-0xEND]` of an SRAT memory line for `node`, if `line` is one.
fn srat_range(line: &str, node: u32) -> Option<(u64, u64)> {
    let rest = line
        .split_once(&format!("ACPI: SRAT: Node {node} PXM {node} [mem "))?
        .1;
    let (a, rest) = rest.split_once('-')?;
    let b = rest.split(']').next()?;
    let hex = |s: &str| u64::from_str_radix(s.trim().trim_start_matches("0x"), 16).ok();
    Some((hex(a)?, hex(b)?))
}

/// What the witness waits for: per cell, the SRAT ranges of its layout regions, and the CPU
/// count. Returns the lines still missing from `log`.
fn missing(log: &str, want: &[(u32, u64, u64)], cpus: usize) -> Vec<String> {
    let mut out: Vec<String> = want
        .iter()
        .filter(|&&(node, a, b)| {
            !log.lines()
                .any(|l| srat_range(l, node).is_some_and(|r| r == (a, b)))
        })
        .map(|(node, a, b)| format!("ACPI: SRAT: Node {node} PXM {node} [mem {a:#010x}-{b:#010x}]"))
        .collect();
    let allowing = format!("smpboot: Allowing {cpus} CPUs, 0 hotplug CPUs");
    if !log.contains(&allowing) {
        out.push(allowing);
    }
    out
}

#[test]
fn debian_kernel_reports_the_planned_numa_cells_and_cpus() {
    let test = "debian_kernel_reports_the_planned_numa_cells_and_cpus";
    let Some(vmlinux) = vmhost_testsupport::test_kernel_file("vmlinux") else {
        return;
    };
    if !kvm_available(test) || !hugepages_wanted(test) {
        return;
    }
    let _cpus = lock_cpus();
    let _pool = lock_hugepages();
    require_2m_hugepages(test, 128);
    let plan = two_cell_plan(&spec(&vmlinux, 256, "console=ttyS0 earlyprintk=serial"), 64);
    let memory = GuestMemory::new(&plan, &Default::default()).expect("guest memory");
    let want: Vec<(u32, u64, u64)> = memory
        .layout()
        .regions
        .iter()
        .map(|r| (r.cell, r.gpa, r.gpa + r.size_bytes - 1))
        .collect();
    let log = Arc::new(Mutex::new(Vec::new()));
    let options = VmOptions {
        mask_for_nested_emulation: true,
        serial_out: Some(SerialOut(log.clone())),
        console_input: ConsoleInput::None,
        ..Default::default()
    };
    let t0 = Instant::now();
    let mut vm = Vm::new(&plan, memory, options).expect("VM");
    assert_eq!(vm.linux_boot().unwrap().mode, BootMode::Pvh);
    assert_eq!(vm.unknown_access(), UnknownAccessPolicy::Ignore);
    let handle = vm.handle();
    let runner = std::thread::spawn(move || vm.run());
    let cpus = plan.vcpus.len();
    let mut seen = None;
    while t0.elapsed() < BUDGET && !handle.stop_handle().stop_requested() {
        if missing(&text(&log), &want, cpus).is_empty() {
            seen = Some(t0.elapsed());
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    handle.stop();
    let report = runner.join().unwrap().expect("run");
    let log = text(&log);
    println!("{}", report.render_text());
    println!("--- serial log tail ---\n{}", tail(&log, 40));
    let Some(seen) = seen else {
        panic!(
            "within {BUDGET:?} the kernel did not print {:?} ({:?}, {} serial bytes); log tail:\n{}",
            missing(&log, &want, cpus),
            report.status,
            log.len(),
            tail(&log, 40)
        );
    };
    let BootReport::Linux {
        entry,
        first_serial_byte_seconds,
        ..
    } = report.boot
    else {
        panic!("{:?}", report.boot)
    };
    assert_eq!(entry, LinuxEntry::Pvh);
    println!(
        "witness: first serial byte after {:.1} s of run, SRAT nodes and CPU count after {:.1} s \
         (Vm::new included), run ended {:?}",
        first_serial_byte_seconds.unwrap_or(f64::NAN),
        seen.as_secs_f64(),
        report.status
    );
    assert_eq!(report.status, RunStatus::Stopped);
}

/// A one-cell plan of this host booting `kernel`, for the bad-input tests (no KVM needed: the
/// kernel is checked before `/dev/kvm` is opened).
fn bad_input(kernel: &Path, initrd: Option<&Path>, cmdline: &str, mib: u64) -> VmError {
    let mut toml = format!(
        "name = \"bad\"\n[cpu]\ncores = 1\n[memory]\nguest = \"{mib}Mi\"\n[boot]\nkernel = \"{}\"\n",
        kernel.display()
    );
    if let Some(i) = initrd {
        toml.push_str(&format!("initrd = \"{}\"\n", i.display()));
    }
    toml.push_str(&format!("cmdline = \"{cmdline}\"\n"));
    let spec = vmhost_config::from_toml_str(&toml, "bad.toml")
        .unwrap()
        .spec;
    let host = vmhost_topology::load_synthetic("package:1 numa:1 core:1 pu:1").unwrap();
    let plan = vmhost_plan::plan(&spec, &host, &Default::default())
        .into_result()
        .unwrap();
    let layout = vmhost_memory::GuestLayout::from_plan(
        &plan,
        vmhost_memory::MMIO_HOLE_START..vmhost_memory::MMIO_HOLE_END,
    )
    .unwrap();
    let mem = layout.anonymous_memory().unwrap();
    Vm::new(&plan, (mem, layout), VmOptions::default()).unwrap_err()
}

fn kernel_error(e: VmError) -> BootError {
    match e {
        VmError::Kernel { source, .. } => source,
        other => panic!("expected a kernel error, got {other:?}"),
    }
}

#[test]
fn bad_kernels_initrds_and_command_lines_fail_in_vm_new() {
    let dir = std::env::temp_dir().join(format!("vmhost-bad-kernel-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let missing = dir.join("no-such-vmlinux");
    let e = kernel_error(bad_input(&missing, None, "", 64));
    assert!(matches!(e, BootError::OpenKernel { .. }), "{e:?}");

    let text = dir.join("not-a-kernel");
    std::fs::write(&text, b"#!/bin/sh\necho hello\n").unwrap();
    let e = kernel_error(bad_input(&text, None, "", 64));
    assert!(matches!(e, BootError::NotAKernel { .. }), "{e:?}");

    let Some(vmlinux) = vmhost_testsupport::test_kernel_file("vmlinux") else {
        return;
    };
    let e = kernel_error(bad_input(&vmlinux, Some(&missing), "", 128));
    assert!(matches!(e, BootError::OpenInitrd { .. }), "{e:?}");

    let e = kernel_error(bad_input(&vmlinux, None, &"x".repeat(3000), 128));
    assert!(
        matches!(e, BootError::CmdlineTooLong { len: 3000, .. }),
        "{e:?}"
    );

    let big = dir.join("big-initrd");
    std::fs::File::create(&big)
        .unwrap()
        .set_len(96 * MIB)
        .unwrap();
    let e = kernel_error(bad_input(&vmlinux, Some(&big), "", 128));
    assert!(matches!(e, BootError::InitrdTooLarge { .. }), "{e:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}
