//! End to end: `vmhost --config vm.toml` boots Debian's 6.1 vmlinux (from
//! `crates/boot/scripts/fetch-test-kernel.sh`) with its serial console on vmhost's stdout, the
//! kernel prints its parse of vmhost's ACPI tables (SRAT node, CPU count), and SIGTERM stops
//! the VM with the report (exit status 130: stopped before the guest ended).
//!
//! Guest ring 0 is emulated on the nested hosts vmhost is developed on, so this takes about
//! 30-40 s there. Skipped with `VMHOST_SKIP_KERNEL_TESTS=1` (kernel not fetched) or
//! `VMHOST_SKIP_KVM_TESTS=1`.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const BUDGET: Duration = Duration::from_secs(200);

#[test]
fn vmhost_boots_a_kernel_that_reports_vmhosts_acpi_tables() {
    let test = "vmhost_boots_a_kernel_that_reports_vmhosts_acpi_tables";
    let Some(kernel) = vmhost_testsupport::test_kernel_file("vmlinux") else {
        return;
    };
    if !vmhost_testsupport::need_kvm(test) {
        return;
    }
    let _cpus = vmhost_testsupport::lock_cpus();
    let dir = std::env::temp_dir().join(format!("vmhost-linux-boot-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let spec = dir.join("linux.toml");
    std::fs::write(
        &spec,
        format!(
            "name = \"linux-e2e\"\n[cpu]\ncores = 2\n[memory]\nguest = \"256Mi\"\n\
             [boot]\nkernel = \"{}\"\ncmdline = \"console=ttyS0 earlyprintk=serial\"\n",
            kernel.display()
        ),
    )
    .unwrap();
    let t0 = Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_vmhost"))
        .args(["--config", spec.to_str().unwrap(), "--run-dir"])
        .arg(dir.join("run"))
        .current_dir(common::root())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = Arc::new(Mutex::new(String::new()));
    let reader = {
        let (out, stdout) = (Arc::clone(&out), child.stdout.take().unwrap());
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let mut o = out.lock().unwrap();
                o.push_str(&line);
                o.push('\n');
            }
        })
    };
    let wanted = [
        "ACPI: SRAT: Node 0 PXM 0 [mem 0x00000000-",
        "smpboot: Allowing 2 CPUs, 0 hotplug CPUs",
    ];
    let mut seen = None;
    while t0.elapsed() < BUDGET {
        if wanted.iter().all(|w| out.lock().unwrap().contains(w)) {
            seen = Some(t0.elapsed());
            break;
        }
        if child.try_wait().unwrap().is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let pid = i32::try_from(child.id()).unwrap();
    // SAFETY: `pid` is our own child, not yet waited for, so it names that process.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let status = child.wait().unwrap();
    let exited = t0.elapsed();
    reader.join().unwrap();
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    let out = out.lock().unwrap().clone();
    let _ = std::fs::remove_dir_all(&dir);
    let tail: Vec<&str> = out.lines().rev().take(30).collect();
    let tail: Vec<&str> = tail.into_iter().rev().collect();
    let Some(seen) = seen else {
        panic!(
            "the kernel did not print {wanted:?} within {BUDGET:?}; exit {status:?}\n\
             stdout tail:\n{}\nstderr:\n{stderr}",
            tail.join("\n")
        );
    };
    println!(
        "vmhost: kernel printed its SRAT and CPU count after {seen:.1?}; vmhost exited at \
         {exited:.1?}"
    );
    assert!(
        out.contains("Linux elf via Pvh, first serial byte at"),
        "report: {}\nstderr: {stderr}",
        tail.join("\n")
    );
    assert_eq!(status.code(), Some(130), "stopped by SIGTERM: {stderr}");
}
