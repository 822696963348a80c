//! VMM start-up and resident memory, vmhost side by side with QEMU, in one run.
//!
//! ```text
//! cargo bench --bench startup            # VMHOST_BENCH_REPS=15 by default
//! ```
//!
//! - **vmhost fixed start**: process spawn → every vCPU thread pinned and configured (the guest
//!   is released), minus the guest-RAM step (allocate, bind, prefault), for the `halt` payload
//!   with 1 vCPU and 64 MiB of 2 MiB hugepages; and spawn → the guest's first doorbell (its
//!   first `out`, after it read CPUID in ring 0).
//! - **QEMU**: spawn of `qemu-system-x86_64 -enable-kvm -S` with the same memory (a hugetlbfs
//!   `memory-backend-file`, `prealloc=off`) → its QMP monitor answers (machine initialised, vCPUs
//!   created and paused by `-S`).
//! - The host ledger's run directory is on tmpfs (`/dev/shm`), as `/run` is on systemd hosts;
//!   set `VMHOST_BENCH_RUN_DIR` to measure another one.
//! - **Resident memory beyond guest RAM**: `VmRSS` of a running VM (vmhost `idle` payload; QEMU
//!   paused with `-S`) whose guest RAM is on hugetlbfs, which `VmRSS` does not count.
#![allow(clippy::unwrap_used, clippy::cast_precision_loss)]

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{memory_mib, now_ns};

fn stats(name: &str, v: &mut [f64], unit: &str) {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    println!(
        "{name:<58} {:>9.2} {:>9.2} {:>9.2}  {unit}",
        v[v.len() / 2],
        v[0],
        v[v.len() - 1]
    );
}

fn tmpdir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("vmhost-bench-startup-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn write_spec(dir: &Path, payload: &str) -> PathBuf {
    let p = dir.join(format!("{payload}.toml"));
    std::fs::write(
        &p,
        format!("name = \"bench-{payload}\"\n[cpu]\ncores = 1\n[memory]\nguest = \"64Mi\"\nhugepages = {{ page_size = \"2Mi\" }}\n[boot]\npayload = \"{payload}\"\n"),
    )
    .unwrap();
    p
}

/// One vmhost `halt` run: (fixed start ms, first doorbell ms, guest RAM step ms).
fn vmhost_halt(bin: &Path, spec: &Path, run_dir: &Path) -> (f64, f64, f64) {
    let spawn = now_ns();
    let out = Command::new(bin)
        .args([
            "--json",
            "--run-dir",
            run_dir.to_str().unwrap(),
            "--config",
            spec.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let t = &j["timeline"];
    let ms = |k: &str| (t[k].as_u64().unwrap() - spawn) as f64 / 1e6;
    let ram = ms("memory_ready_ns") - ms("admitted_ns");
    let runnable = ms("vcpus_runnable_ns");
    let doorbell = j["report"]["vcpus"][0]["first_doorbell_seconds"]
        .as_f64()
        .unwrap()
        * 1e3;
    (runnable - ram, runnable + doorbell - ram, ram)
}

/// vmhost `idle` running: [VmRSS, Pss, anonymous] in MiB.
fn vmhost_rss(bin: &Path, spec: &Path, run_dir: &Path) -> [f64; 3] {
    let mut child = Command::new(bin)
        .args([
            "--run-dir",
            run_dir.to_str().unwrap(),
            "--config",
            spec.to_str().unwrap(),
        ])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id();
    let deadline = Instant::now() + Duration::from_secs(20);
    let running = || {
        std::fs::read_dir(format!("/proc/{pid}/task"))
            .into_iter()
            .flatten()
            .flatten()
            .any(|t| {
                std::fs::read_to_string(t.path().join("comm"))
                    .unwrap_or_default()
                    .trim()
                    == "vcpu0"
            })
    };
    while !running() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(200));
    let rss = memory_mib(pid);
    Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    child.wait().unwrap();
    rss
}

/// One QEMU start: (ms to QMP ready, [VmRSS, Pss, anonymous] MiB at that moment).
fn qemu(hugetlbfs: &Path, dir: &Path) -> (f64, [f64; 3]) {
    let sock = dir.join("qmp.sock");
    let _ = std::fs::remove_file(&sock);
    let start = Instant::now();
    let mut child = Command::new("qemu-system-x86_64")
        .args([
            "-enable-kvm",
            "-S",
            "-nodefaults",
            "-nographic",
            "-display",
            "none",
            "-machine",
            "pc",
            "-m",
            "64M",
        ])
        .arg("-object")
        .arg(format!(
            "memory-backend-file,id=m0,size=64M,mem-path={},share=on,prealloc=off",
            hugetlbfs.display()
        ))
        .args(["-numa", "node,memdev=m0", "-qmp"])
        .arg(format!("unix:{},server=on,wait=off", sock.display()))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stream = loop {
        if let Ok(s) = UnixStream::connect(&sock) {
            break s;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "qemu did not open its QMP socket"
        );
        std::thread::sleep(Duration::from_micros(200));
    };
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut line = String::new();
    reader.read_line(&mut line).unwrap(); // greeting
    (&stream)
        .write_all(b"{\"execute\":\"qmp_capabilities\"}\n")
        .unwrap();
    line.clear();
    reader.read_line(&mut line).unwrap();
    let ms = start.elapsed().as_secs_f64() * 1e3;
    let rss = memory_mib(child.id());
    (&stream).write_all(b"{\"execute\":\"quit\"}\n").unwrap();
    child.wait().unwrap();
    (ms, rss)
}

fn main() {
    let reps: usize = std::env::var("VMHOST_BENCH_REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(15);
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_vmhost"));
    let dir = tmpdir();
    // The host ledger's run directory on tmpfs, as /run is on systemd hosts (on a disk-backed
    // directory its fsyncs add about 0.9 ms to every start; VMHOST_BENCH_RUN_DIR overrides).
    let run_dir = std::env::var_os("VMHOST_BENCH_RUN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(format!("/dev/shm/vmhost-bench-run-{}", std::process::id()))
        });
    let halt = write_spec(&dir, "halt");
    let idle = write_spec(&dir, "idle");
    let mnt = dir.join("hugetlbfs");
    std::fs::create_dir_all(&mnt).unwrap();
    let have_qemu = Command::new("qemu-system-x86_64")
        .arg("--version")
        .output()
        .is_ok();
    let mounted = have_qemu
        && Command::new("mount")
            .args(["-t", "hugetlbfs", "-o", "pagesize=2M", "none"])
            .arg(&mnt)
            .status()
            .is_ok_and(|s| s.success());

    let (mut fixed, mut first, mut ram, mut q_ms) = (vec![], vec![], vec![], vec![]);
    let (mut vm_rss, mut q_rss): (Vec<[f64; 3]>, Vec<[f64; 3]>) = (vec![], vec![]);
    for _ in 0..reps {
        let (f, d, r) = vmhost_halt(&bin, &halt, &run_dir);
        fixed.push(f);
        first.push(d);
        ram.push(r);
        if mounted {
            let (ms, rss) = qemu(&mnt, &dir);
            q_ms.push(ms);
            q_rss.push(rss);
        }
    }
    for _ in 0..reps.min(5) {
        vm_rss.push(vmhost_rss(&bin, &idle, &run_dir));
    }
    println!("{reps} repetitions, interleaved; 1 vCPU, 64 MiB of 2 MiB hugepages\n");
    println!("{:<58} {:>9} {:>9} {:>9}", "case", "median", "min", "max");
    stats(
        "vmhost fixed start: spawn -> vCPUs runnable, minus RAM",
        &mut fixed,
        "ms",
    );
    stats(
        "vmhost spawn -> first guest doorbell, minus RAM",
        &mut first,
        "ms",
    );
    stats(
        "vmhost guest RAM step (allocate+bind+prefault 64 MiB)",
        &mut ram,
        "ms",
    );
    if mounted {
        stats("qemu -S spawn -> QMP ready (prealloc=off)", &mut q_ms, "ms");
    } else {
        println!("qemu rows skipped: qemu-system-x86_64 missing or hugetlbfs mount failed");
    }
    let kinds = ["VmRSS", "Pss", "private anonymous"];
    for (i, kind) in kinds.iter().enumerate() {
        let mut v: Vec<f64> = vm_rss.iter().map(|m| m[i]).collect();
        stats(
            &format!("vmhost {kind} beyond guest RAM (idle payload)"),
            &mut v,
            "MiB",
        );
        if mounted {
            let mut q: Vec<f64> = q_rss.iter().map(|m| m[i]).collect();
            stats(&format!("qemu -S {kind} beyond guest RAM"), &mut q, "MiB");
        }
    }
    if mounted {
        let _ = Command::new("umount").arg(&mnt).status();
    }
    let _ = std::fs::remove_dir_all(&dir);
    if std::env::var_os("VMHOST_BENCH_RUN_DIR").is_none() {
        let _ = std::fs::remove_dir_all(&run_dir);
    }
}
