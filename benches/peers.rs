//! Start -> exit on the CI host: vmhost, Cloud Hypervisor and Firecracker side by side, in one
//! run, on real `/dev/kvm` (docs/benchmarks.md, "Start -> exit on the CI host").
//!
//! ```text
//! VMHOST_BENCH_CH=/path/to/cloud-hypervisor VMHOST_BENCH_FC=/path/to/firecracker \
//!     cargo bench --bench peers       # as root, 2 MiB hugepages free; VMHOST_BENCH_ROUNDS=31 (at least 11)
//! ```
//!
//! - **Guest**: a PVH ELF "kernel" (`vmhost_testsupport::pvh::pvh_elf`) whose first instruction
//!   ends the VM, 1 vCPU, 64 MiB of 2 MiB hugepages. Two exits, each one the peers act on:
//!   ACPI S5 (`out 0x600, 0x34`: Cloud Hypervisor's and vmhost's sleep control register) and
//!   the i8042 reset (`out 0x64, 0xfe`: Firecracker ends on it; Cloud Hypervisor would reboot
//!   the guest). vmhost acts on both and is run with each: vmhost (S5) is compared with Cloud
//!   Hypervisor, vmhost (i8042) with Firecracker. vmhost (S5) also runs with `--prefault
//!   background` (guest RAM faulted in while the guest starts; the peers fault it in lazily),
//!   and with `boot.irqchip = "split"` (KVM's LAPICs only, no in-kernel PIC, IOAPIC or PIT,
//!   as Cloud Hypervisor runs), with and without `--prefault background`.
//! - **Time**: `CLOCK_MONOTONIC` just before the spawn -> `wait` returned (the process exited).
//! - **Method**: every round runs every VMM once, the order rotated by one each round; per VMM
//!   the median; per pair the median of the per-round ratios with a 95 % bootstrap interval
//!   (rounds resampled with replacement, 2000 times, xorshift64 with a fixed seed).
//! - **Resident memory beyond guest RAM**: `VmRSS`, `Pss` and `Pss_Anon` of a running VM whose
//!   guest halts in a loop (`hlt; jmp`), guest RAM on hugetlb pages, which `VmRSS` does not
//!   count; vmhost also with its `idle` payload (benches/startup.rs).
#![allow(
    clippy::unwrap_used,
    clippy::cast_precision_loss,
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss
)]

mod common;

use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{memory_mib, now_ns};

use vmhost_testsupport::pvh::{out8, pvh_elf};
use vmhost_testsupport::stats::{bootstrap_ci, median, verdict, RESAMPLES};

/// `hlt; jmp back to the hlt`.
const HLT_LOOP: [u8; 3] = [0xf4, 0xeb, 0xfd];
/// What a run may take before the watchdog kills it (a VMM that ignored the guest's exit).
const RUN_LIMIT: Duration = Duration::from_secs(20);

/// The guest's ways to end the VM.
#[derive(Clone, Copy, PartialEq)]
enum Guest {
    /// ACPI S5: `SLP_TYP` 5, `SLP_EN` to port 0x600.
    S5,
    /// 0xfe to the i8042 command port.
    I8042,
    /// Halts in a loop: for the resident-memory figures.
    Halts,
}

impl Guest {
    fn code(self) -> Vec<u8> {
        let mut code = match self {
            Guest::S5 => out8(0x600, 5 << 2 | 1 << 5),
            Guest::I8042 => out8(0x64, 0xfe),
            Guest::Halts => vec![],
        };
        code.extend_from_slice(&HLT_LOOP);
        code
    }

    fn name(self) -> &'static str {
        match self {
            Guest::S5 => "s5",
            Guest::I8042 => "i8042",
            Guest::Halts => "halts",
        }
    }
}

/// The VMMs compared and how each is started.
#[derive(Clone, Copy, PartialEq)]
enum Vmm {
    Vmhost(Guest),
    /// vmhost with `--prefault background` (the S5 guest): guest RAM faulted in while the guest
    /// runs.
    VmhostBackground,
    /// vmhost with `boot.irqchip = "split"` (the S5 guest): KVM's LAPICs only, no in-kernel
    /// PIC, IOAPIC or PIT, as Cloud Hypervisor runs; with `--prefault background` or not.
    VmhostSplit {
        background: bool,
    },
    CloudHypervisor,
    Firecracker,
}

impl Vmm {
    fn is_vmhost(self) -> bool {
        matches!(
            self,
            Vmm::Vmhost(_) | Vmm::VmhostBackground | Vmm::VmhostSplit { .. }
        )
    }
}

struct Setup {
    vmhost: PathBuf,
    ch: Option<PathBuf>,
    fc: Option<PathBuf>,
    dir: PathBuf,
    run_dir: PathBuf,
}

impl Setup {
    fn kernel(&self, g: Guest) -> PathBuf {
        self.dir.join(format!("{}.elf", g.name()))
    }

    fn label(&self, v: Vmm) -> String {
        match v {
            Vmm::Vmhost(g) => format!("vmhost ({})", g.name()),
            Vmm::VmhostBackground => "vmhost (s5, --prefault background)".into(),
            Vmm::VmhostSplit { background: false } => "vmhost (s5, split irqchip)".into(),
            Vmm::VmhostSplit { background: true } => "vmhost (s5, split, --prefault bg)".into(),
            Vmm::CloudHypervisor => "cloud-hypervisor (s5)".into(),
            Vmm::Firecracker => "firecracker (i8042)".into(),
        }
    }

    /// The command that boots `g`'s kernel with `v`, stdout and stderr to files in the bench's
    /// directory.
    fn command(&self, v: Vmm, g: Guest) -> Command {
        let mut c = match v {
            Vmm::Vmhost(_) | Vmm::VmhostBackground | Vmm::VmhostSplit { .. } => {
                let mut c = Command::new(&self.vmhost);
                if matches!(
                    v,
                    Vmm::VmhostBackground | Vmm::VmhostSplit { background: true }
                ) {
                    c.args(["--prefault", "background"]);
                }
                c.arg("--json").arg("--run-dir").arg(&self.run_dir);
                let spec = match v {
                    Vmm::VmhostSplit { .. } => format!("{}-split.toml", g.name()),
                    _ => format!("{}.toml", g.name()),
                };
                c.arg("--config").arg(self.dir.join(spec));
                c
            }
            Vmm::CloudHypervisor => {
                let mut c = Command::new(self.ch.as_ref().unwrap());
                c.arg("--kernel").arg(self.kernel(g));
                c.args([
                    "--memory",
                    "size=64M,hugepages=on,hugepage_size=2M",
                    "--cpus",
                    "boot=1",
                ]);
                c.args(["--serial", "off", "--console", "off"]);
                c
            }
            Vmm::Firecracker => {
                let mut c = Command::new(self.fc.as_ref().unwrap());
                c.args(["--no-api", "--level", "Error", "--config-file"]);
                c.arg(self.dir.join(format!("fc-{}.json", g.name())));
                c
            }
        };
        let out = std::fs::File::create(self.dir.join("stdout")).unwrap();
        let err = std::fs::File::create(self.dir.join("stderr")).unwrap();
        c.stdin(Stdio::null()).stdout(out).stderr(err);
        c
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(self.dir.join("stderr")).unwrap_or_default()
    }
}

/// Writes the guests' kernels, vmhost's specs and Firecracker's configurations.
fn write_inputs(s: &Setup) {
    for g in [Guest::S5, Guest::I8042, Guest::Halts] {
        let kernel = s.kernel(g);
        std::fs::write(&kernel, pvh_elf(&g.code())).unwrap();
        std::fs::write(
            s.dir.join(format!("{}.toml", g.name())),
            format!(
                "name = \"bench-peers-{}\"\n[cpu]\ncores = 1\n[memory]\nguest = \"64Mi\"\n\
                 hugepages = {{ page_size = \"2Mi\" }}\n[boot]\nkernel = \"{}\"\n",
                g.name(),
                kernel.display()
            ),
        )
        .unwrap();
        std::fs::write(
            s.dir.join(format!("{}-split.toml", g.name())),
            format!(
                "name = \"bench-peers-{}\"\n[cpu]\ncores = 1\n[memory]\nguest = \"64Mi\"\n\
                 hugepages = {{ page_size = \"2Mi\" }}\n[boot]\nkernel = \"{}\"\n\
                 irqchip = \"split\"\n",
                g.name(),
                kernel.display()
            ),
        )
        .unwrap();
        let fc = serde_json::json!({
            "boot-source": { "kernel_image_path": kernel },
            "drives": [],
            "machine-config": { "vcpu_count": 1, "mem_size_mib": 64, "huge_pages": "2M" },
        });
        std::fs::write(s.dir.join(format!("fc-{}.json", g.name())), fc.to_string()).unwrap();
    }
    std::fs::write(
        s.dir.join("idle.toml"),
        "name = \"bench-peers-idle\"\n[cpu]\ncores = 1\n[memory]\nguest = \"64Mi\"\n\
         hugepages = { page_size = \"2Mi\" }\n[boot]\npayload = \"idle\"\n",
    )
    .unwrap();
}

/// Waits for `child`; a watchdog kills it after [`RUN_LIMIT`]. Returns its status when the
/// child ended by itself, and `CLOCK_MONOTONIC` in ns right after `wait` returned: taken before
/// the watchdog is woken and joined, so that no poll period lands in the figure (until 5
/// December 2026 the watchdog slept in 5 ms steps and the time was read after joining it,
/// which rounded every run up to the next step: docs/benchmarks.md).
fn wait_guarded(child: &mut Child) -> (Option<ExitStatus>, u64) {
    let pid = child.id() as libc::pid_t;
    let killed = Arc::new(AtomicBool::new(false));
    let k = Arc::clone(&killed);
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let watchdog = std::thread::spawn(move || {
        if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(RUN_LIMIT) {
            k.store(true, Ordering::Release);
            // SAFETY: kill only sends a signal. No message within RUN_LIMIT: the child has not
            // been reaped unless it ended in this very instant (then the signal finds no
            // process, or, with a pid reused that fast, a stray one: a bench-only risk).
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    });
    let status = child.wait().unwrap();
    let end = now_ns();
    let _ = tx.send(());
    watchdog.join().unwrap();
    ((!killed.load(Ordering::Acquire)).then_some(status), end)
}

/// One start -> exit of `v`: wall milliseconds, and for vmhost its `--json` timeline
/// (milliseconds after the spawn, in the order of [`TIMELINE`]).
fn start_exit(s: &Setup, v: Vmm) -> (f64, Vec<f64>) {
    let g = match v {
        Vmm::Vmhost(g) => g,
        Vmm::VmhostBackground | Vmm::VmhostSplit { .. } | Vmm::CloudHypervisor => Guest::S5,
        Vmm::Firecracker => Guest::I8042,
    };
    let mut cmd = s.command(v, g);
    let spawn = now_ns();
    let mut child = cmd.spawn().unwrap();
    let (ended, end) = wait_guarded(&mut child);
    let ms = (end - spawn) as f64 / 1e6;
    let Some(status) = ended else {
        panic!("{} did not end the VM: {}", s.label(v), s.stderr());
    };
    assert!(
        status.success(),
        "{} exited with {status}: {}",
        s.label(v),
        s.stderr()
    );
    let mut marks = vec![];
    if v.is_vmhost() {
        let out = std::fs::read(s.dir.join("stdout")).unwrap();
        let j: serde_json::Value = serde_json::from_slice(&out)
            .unwrap_or_else(|e| panic!("vmhost --json: {e}: {}", s.stderr()));
        for k in TIMELINE {
            let t = j["timeline"][k].as_u64().unwrap_or(0);
            marks.push(t.saturating_sub(spawn) as f64 / 1e6);
        }
    }
    (ms, marks)
}

/// vmhost's start-up steps (`timeline` of `vmhost --json`).
const TIMELINE: [&str; 7] = [
    "main_ns",
    "spec_loaded_ns",
    "host_discovered_ns",
    "admitted_ns",
    "memory_ready_ns",
    "vm_created_ns",
    "vcpus_runnable_ns",
];

fn stats_row(name: &str, v: &[f64], unit: &str) {
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    println!(
        "{name:<44} {:>9.2} {:>9.2} {:>9.2}  {unit}",
        median(v),
        lo,
        hi
    );
}

/// The measured rounds: `times[i][r]` is VMM `i`'s wall time in round `r`.
struct Rounds {
    vmms: Vec<Vmm>,
    times: Vec<Vec<f64>>,
    /// vmhost (S5)'s timeline of each round.
    marks: Vec<Vec<f64>>,
    /// vmhost (S5, split irqchip)'s.
    split_marks: Vec<Vec<f64>>,
}

fn run_rounds(s: &Setup, vmms: Vec<Vmm>, rounds: usize) -> Rounds {
    let n = vmms.len();
    let mut times = vec![vec![]; n];
    let mut marks = vec![];
    let mut split_marks = vec![];
    for r in 0..rounds {
        for k in 0..n {
            let i = (r + k) % n;
            let (ms, m) = start_exit(s, vmms[i]);
            times[i].push(ms);
            match vmms[i] {
                Vmm::Vmhost(Guest::S5) => marks.push(m),
                Vmm::VmhostSplit { background: false } => split_marks.push(m),
                _ => {}
            }
        }
    }
    Rounds {
        vmms,
        times,
        marks,
        split_marks,
    }
}

fn report_rounds(s: &Setup, r: &Rounds) {
    let rounds = r.times[0].len();
    println!(
        "{rounds} rounds, order rotated every round; 1 vCPU, 64 MiB of 2 MiB hugepages\n\
         spawn -> process exit (CLOCK_MONOTONIC)\n"
    );
    println!(
        "{:<44} {:>9} {:>9} {:>9}",
        "VMM (guest's exit)", "median", "min", "max"
    );
    for (i, v) in r.vmms.iter().enumerate() {
        stats_row(&s.label(*v), &r.times[i], "ms");
    }
    let at = |v: Vmm| r.vmms.iter().position(|x| *x == v);
    let pairs = [
        (Vmm::Vmhost(Guest::S5), Vmm::CloudHypervisor, Some(0.5)),
        (Vmm::VmhostBackground, Vmm::CloudHypervisor, Some(0.5)),
        (
            Vmm::VmhostSplit { background: false },
            Vmm::CloudHypervisor,
            Some(0.5),
        ),
        (
            Vmm::VmhostSplit { background: true },
            Vmm::CloudHypervisor,
            Some(0.5),
        ),
        (
            Vmm::VmhostSplit { background: false },
            Vmm::Vmhost(Guest::S5),
            None,
        ),
        (Vmm::Vmhost(Guest::I8042), Vmm::Firecracker, None),
    ];
    println!("\nratio (median of per-round ratios, 95 % bootstrap CI, {RESAMPLES} resamples)");
    for (ours, peer, target) in pairs {
        let (Some(a), Some(b)) = (at(ours), at(peer)) else {
            continue;
        };
        let ratios: Vec<f64> = (0..rounds).map(|k| r.times[a][k] / r.times[b][k]).collect();
        let ci = bootstrap_ci(&ratios);
        let what = format!("{} / {}", s.label(ours), s.label(peer));
        let goal = target.map_or(String::new(), |t| {
            format!("  target <= {t}: {}", verdict(ci, t))
        });
        println!(
            "{what:<44} {:>6.3}  [{:.3}, {:.3}]{goal}",
            median(&ratios),
            ci.0,
            ci.1
        );
    }
    println!("\nvmhost timeline, ms after spawn (medians): s5, s5 with a split irqchip");
    for (k, name) in TIMELINE.iter().enumerate() {
        let at = |marks: &[Vec<f64>]| {
            let v: Vec<f64> = marks.iter().map(|m| m[k]).collect();
            if v.is_empty() {
                f64::NAN
            } else {
                median(&v)
            }
        };
        println!(
            "  {name:<22} {:>7.2} {:>7.2}",
            at(&r.marks),
            at(&r.split_marks)
        );
    }
}

/// True once a thread of `pid` has a name with "vcpu" in it (vmhost's and Cloud Hypervisor's
/// `vcpu0`, Firecracker's `fc_vcpu 0`).
fn has_vcpu_thread(pid: u32) -> bool {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
        .any(|t| {
            std::fs::read_to_string(t.path().join("comm"))
                .unwrap_or_default()
                .contains("vcpu")
        })
}

/// A running VM's memory: `v` boots the halting guest (vmhost: `spec`), measured 300 ms after
/// its vCPU thread appeared; then SIGTERM (SIGKILL for a VMM that ignores it).
fn running_rss(s: &Setup, v: Vmm, spec: &str) -> [f64; 3] {
    let mut cmd = s.command(v, Guest::Halts);
    if matches!(v, Vmm::Vmhost(_)) {
        cmd = Command::new(&s.vmhost);
        cmd.arg("--run-dir").arg(&s.run_dir);
        cmd.arg("--config").arg(s.dir.join(spec));
        cmd.stdout(Stdio::null()).stderr(Stdio::null());
    }
    let mut child = cmd.spawn().unwrap();
    let pid = child.id();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !has_vcpu_thread(pid) && Instant::now() < deadline {
        assert!(child.try_wait().unwrap().is_none(), "{}", s.stderr());
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(300));
    let m = memory_mib(pid);
    // SAFETY: kill only sends a signal to our child, not yet reaped.
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
    wait_guarded(&mut child);
    m
}

fn report_rss(s: &Setup, vmms: &[Vmm]) {
    let mut cases: Vec<(String, Vmm, &str)> = vec![
        (
            "vmhost (idle payload)".into(),
            Vmm::Vmhost(Guest::Halts),
            "idle.toml",
        ),
        (
            "vmhost (hlt loop)".into(),
            Vmm::Vmhost(Guest::Halts),
            "halts.toml",
        ),
    ];
    let peers = vmms.iter().filter(|v| !v.is_vmhost());
    for v in peers {
        let name = s.label(*v);
        let name = name.split(' ').next().unwrap();
        cases.push((format!("{name} (hlt loop)"), *v, ""));
    }
    let mut all: Vec<Vec<[f64; 3]>> = vec![vec![]; cases.len()];
    for _ in 0..5 {
        for (i, (_, v, spec)) in cases.iter().enumerate() {
            all[i].push(running_rss(s, *v, spec));
        }
    }
    println!("\nresident memory beyond guest RAM, running VM, 5 samples each");
    println!(
        "{:<44} {:>9} {:>9} {:>9}",
        "VMM: measure", "median", "min", "max"
    );
    for (k, kind) in ["VmRSS", "Pss", "Pss_Anon"].iter().enumerate() {
        for (i, (name, _, _)) in cases.iter().enumerate() {
            let v: Vec<f64> = all[i].iter().map(|m| m[k]).collect();
            stats_row(&format!("{name}: {kind}"), &v, "MiB");
        }
    }
}

fn peer(var: &str, how: &str) -> Option<PathBuf> {
    let p = std::env::var_os(var).map(PathBuf::from);
    if p.is_none() {
        println!("{var} unset: its rows are skipped ({how}; docs/benchmarks.md, \"How to get the peers\")");
    }
    p
}

fn main() {
    let rounds: usize = std::env::var("VMHOST_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(31)
        .max(11);
    let dir = std::env::temp_dir().join(format!("vmhost-bench-peers-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let s = Setup {
        vmhost: PathBuf::from(env!("CARGO_BIN_EXE_vmhost")),
        ch: peer(
            "VMHOST_BENCH_CH",
            "build Cloud Hypervisor with `cargo build --release --bin cloud-hypervisor`",
        ),
        fc: peer(
            "VMHOST_BENCH_FC",
            "build Firecracker with `cargo build --release --bin firecracker`",
        ),
        run_dir: PathBuf::from(format!(
            "/dev/shm/vmhost-bench-peers-run-{}",
            std::process::id()
        )),
        dir,
    };
    write_inputs(&s);
    let mut vmms = vec![
        Vmm::Vmhost(Guest::S5),
        Vmm::VmhostBackground,
        Vmm::VmhostSplit { background: false },
        Vmm::VmhostSplit { background: true },
        Vmm::Vmhost(Guest::I8042),
    ];
    if s.ch.is_some() {
        vmms.push(Vmm::CloudHypervisor);
    }
    if s.fc.is_some() {
        vmms.push(Vmm::Firecracker);
    }
    let r = run_rounds(&s, vmms.clone(), rounds);
    report_rounds(&s, &r);
    report_rss(&s, &vmms);
    let _ = std::fs::remove_dir_all(&s.dir);
    let _ = std::fs::remove_dir_all(&s.run_dir);
}
