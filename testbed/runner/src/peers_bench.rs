//! Linux boot to `/init`, vmhost next to Cloud Hypervisor, Firecracker and QEMU in the same
//! emulated host (benchmark suite, `testbed/run.sh bench --only linux_boot_vs_peers`;
//! docs/benchmarks.md, "Linux boot beside Cloud Hypervisor and Firecracker").
//!
//! - **Guest**: the same vmlinux (PVH entry for every VMM), busybox initramfs and command line
//!   (`console=ttyS0 loglevel=4`), 2 vCPUs, 256 MiB of 2 MiB hugepages: vmhost's spec, Cloud
//!   Hypervisor's `--memory size=256M,hugepages=on`, Firecracker's `huge_pages: "2M"`, QEMU's
//!   `-mem-path /dev/hugepages`. The guest's `/init` prints `GUEST-INIT`, then powers off;
//!   Firecracker has no ACPI power-off, so its guest reboots with `reboot=k` (the i8042 reset
//!   it exits on).
//! - **Time**: spawn → the first `GUEST-INIT` line on the VMM's stdout (its serial console),
//!   read by the runner as it arrives: the same for every VMM (Firecracker has no port-0x80
//!   timestamp). vmhost with its default `--prefault before-start` and with `--prefault
//!   background`.
//! - **Peak RSS beyond guest RAM**: `VmHWM` of the process that runs the vCPUs (vmhost's VMM,
//!   the child of its cgroup supervisor; the peers' only process), polled every 20 ms while it
//!   runs. Guest RAM is on hugetlb pages, which `VmHWM` does not count, so it is the VMM's
//!   own peak: heap, stacks, and the mapped pages of its binary and shared libraries. Beside
//!   it, the largest `Rss` of its `smaps_rollup` seen at those polls (the pages its page
//!   tables map, [`rollup_rss_mib`]): the emulated host's kernel keeps `VmHWM` behind.
//! - **Where the time goes**: spawn → the guest's first VM exit ([`crate::first_exit`]: the
//!   VMM's own start), from there to the guest kernel's clock (the `GUEST-INIT` time minus
//!   the uptime it prints: the guest's earliest boot), and the uptime. After the rounds, one
//!   more boot of each vmhost mode with `--json` gives its own timeline of the start.
//! - **VM exits per boot per exit reason**: the host kernel's `kvm_exit` tracepoint
//!   ([`crate::kvm_exits`]), spawn → VMM exit (the guest's `GUEST` lines and power-off
//!   included), in every run.
//! - **Method**: every round runs every VMM once, the order rotated by one each round;
//!   `VMHOST_BENCH_ROUNDS` rounds (default and at least 11). Per VMM the median; per pair the
//!   median of the per-round ratios vmhost / peer with a 95 % bootstrap interval
//!   (`vmhost_testsupport::stats`, shared with `benches/peers.rs`). A target is met only when
//!   the whole interval is on its side; an interval that straddles it is inconclusive.
//!
//! The peers are the bundles `testbed/build-guest.sh` makes from `VMHOST_BENCH_CH` and
//! `VMHOST_BENCH_FC` (binary, shared libraries, loader); a missing one is reported in one line
//! saying how to get it, and the rest run.
//!
//! The figures' lines after the rounds are [`report`](mod@report)'s.

mod report;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::first_exit::FirstExit;
use crate::host;
use crate::kvm_exits::ExitCounter;
use crate::linux_bench::{bench_assets, json_report, monotonic_ns, phases_ms};
use crate::linux_tests::{linux_spec, Assets, CMDLINE};
use crate::vm::Env;
use crate::{ensure, Outcome};
use report::{report, timeline_lines};

/// Is every boot preceded by [`scrub_pool`]? Yes unless `VMHOST_BENCH_SCRUB=0`.
fn scrubbing() -> bool {
    std::env::var("VMHOST_BENCH_SCRUB").map_or(true, |v| v != "0")
}

/// Clears the emulator's stale translations out of node 0's 2 MiB pool before a boot: maps
/// every free page, writes one byte of each (the kernel zeroes the whole page at the fault,
/// and TCG throws away the code it had translated from it) and unmaps them. Without it a
/// VMM pays for the pages the *earlier* VMMs' guests ran their kernels from: the pool hands
/// pages out last-freed first, so a VMM that faults RAM in lazily gets the clean pages at
/// the head and leaves the stale ones to the next VMM that takes the whole pool, which is
/// vmhost prefaulting 256 MiB (docs/benchmarks.md, "Where the time goes, and the stale pages
/// of other VMMs' guests").
/// A real CPU has no such cost.
fn scrub_pool() -> Result<(), String> {
    const PAGE: usize = 2 << 20;
    let free = host::hugepages(0, 2048)?.1;
    let pages = usize::try_from(free).map_err(|e| format!("free pages {free}: {e}"))?;
    if pages == 0 {
        return Ok(());
    }
    let mut map = host::HugeMap::new(pages * PAGE).map_err(|e| format!("scrub: {e}"))?;
    for page in map.bytes().chunks_mut(PAGE) {
        // A volatile write: the fault, not the value, is the point.
        // SAFETY: `page` is a valid, writable, non-empty slice of the mapping.
        unsafe { std::ptr::write_volatile(page.as_mut_ptr(), 1) };
    }
    Ok(())
}

/// Rounds unless `VMHOST_BENCH_ROUNDS` says more (fewer only for development: the figures in
/// docs/benchmarks.md come from at least 11).
const ROUNDS: usize = 11;
/// The longest a VMM may take from the spawn to the guest's `/init`.
const TO_INIT_LIMIT: Duration = Duration::from_secs(120);
/// How long after `/init` a VMM may take to exit when its guest powers off (or reboots).
const EXIT_LIMIT: Duration = Duration::from_secs(60);
/// The targets (reported, never asserted): boot at most 1.0x each peer's and 0.8x
/// QEMU's; peak RSS beyond guest RAM at most 3.5 MiB and at most each peer's.
const BOOT_TARGET_PEER: f64 = 1.0;
const BOOT_TARGET_QEMU: f64 = 0.8;
const RSS_TARGET_MIB: f64 = 3.5;
/// How to get each peer, for the line printed when its bundle is missing.
const HOW_TO_GET: [(&str, &str, &str); 2] = [
    (
        "ch",
        "VMHOST_BENCH_CH",
        "build Cloud Hypervisor from its own source with `cargo build --release --bin \
         cloud-hypervisor` and set VMHOST_BENCH_CH to the binary",
    ),
    (
        "fc",
        "VMHOST_BENCH_FC",
        "build Firecracker from its own source with `cargo build --release --bin firecracker` \
         and set VMHOST_BENCH_FC to the binary",
    ),
];

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Vmm {
    Vmhost,
    VmhostBackground,
    /// `boot.irqchip = "split"` and `--prefault background`: vmhost's fastest start.
    VmhostSplit,
    CloudHypervisor,
    Firecracker,
    Qemu,
}

impl Vmm {
    fn label(self) -> &'static str {
        match self {
            Vmm::Vmhost => "vmhost",
            Vmm::VmhostBackground => "vmhost --prefault background",
            Vmm::VmhostSplit => "vmhost split irqchip, background",
            Vmm::CloudHypervisor => "Cloud Hypervisor",
            Vmm::Firecracker => "Firecracker",
            Vmm::Qemu => "QEMU",
        }
    }
}

/// What every run needs: the guest's assets, vmhost's spec, the peers' bundles.
struct Setup {
    a: Assets,
    run_dir: PathBuf,
    work: PathBuf,
    spec: PathBuf,
    /// The same spec with `boot.irqchip = "split"`.
    spec_split: PathBuf,
    fc_config: PathBuf,
    peers: BTreeMap<&'static str, PathBuf>,
}

/// One VMM's run.
struct Run {
    /// Seconds from the spawn to `GUEST-INIT`.
    to_init: f64,
    /// Seconds from the spawn to the guest's first VM exit: the VMM's own start.
    first_exit: f64,
    /// vmhost's `--json` timeline, for a run with `--json`: each step's milliseconds after
    /// the spawn ([`PHASES`](crate::linux_bench::PHASES)).
    phases: Vec<f64>,
    /// The guest kernel's own uptime on the `GUEST-INIT` line, seconds.
    uptime: f64,
    /// `VmHWM` of the VMM process, MiB.
    hwm_mib: f64,
    /// `VmHWM` of the process spawned, when the VMM is its child (vmhost's supervisor), MiB.
    parent_hwm_mib: Option<f64>,
    /// The VMM's `RssAnon`, and `RssFile` plus `RssShmem` (its binary and libraries, on a tmpfs
    /// in the emulated host), when its `VmRSS` was the largest seen, MiB.
    parts_mib: (f64, f64),
    /// The largest `smaps_rollup` `Rss` of the VMM process seen ([`rollup_rss_mib`]), MiB.
    mapped_mib: f64,
    exits: BTreeMap<String, u64>,
}

/// A bundled binary (`testbed/build-guest.sh`): run through the bundle's own loader with its
/// own libraries.
pub fn bundled(dir: &Path, binary: &str) -> Command {
    let mut c = Command::new(dir.join("lib/ld-linux-x86-64.so.2"));
    c.arg("--library-path")
        .arg(dir.join("lib"))
        .arg(dir.join(binary));
    c
}

fn command(s: &Setup, v: Vmm) -> Command {
    let cmdline = format!("{CMDLINE} vmhost.action=poweroff");
    match v {
        Vmm::Vmhost | Vmm::VmhostBackground | Vmm::VmhostSplit => {
            let mut c = Command::new(&s.a.vmhost_release);
            let prefault = if v == Vmm::Vmhost {
                "before-start"
            } else {
                "background"
            };
            let spec = if v == Vmm::VmhostSplit {
                &s.spec_split
            } else {
                &s.spec
            };
            c.arg("--run-dir")
                .arg(&s.run_dir)
                .args(["--prefault", prefault, "--config"])
                .arg(spec);
            c
        }
        Vmm::CloudHypervisor => {
            let mut c = bundled(&s.peers["ch"], "ch");
            c.arg("--kernel")
                .arg(&s.a.vmlinux)
                .arg("--initramfs")
                .arg(&s.a.initrd)
                .arg("--cmdline")
                .arg(cmdline)
                .args(["--cpus", "boot=2"])
                .args(["--memory", "size=256M,hugepages=on,hugepage_size=2M"])
                .args(["--serial", "tty", "--console", "off"]);
            c
        }
        Vmm::Firecracker => {
            let mut c = bundled(&s.peers["fc"], "fc");
            c.args(["--no-api", "--level", "Error", "--config-file"])
                .arg(&s.fc_config);
            c
        }
        Vmm::Qemu => {
            let mut c = crate::linux_bench::qemu_command(&s.a, &s.a.initrd, "poweroff");
            c.args(["-mem-path", "/dev/hugepages"]);
            c
        }
    }
}

/// Firecracker's configuration: the same kernel, initramfs, command line (with `reboot=k`
/// and `vmhost.action=reboot`: its way out), vCPUs and hugepage memory.
fn fc_config(a: &Assets) -> serde_json::Value {
    serde_json::json!({
        "boot-source": {
            "kernel_image_path": a.vmlinux,
            "initrd_path": a.initrd,
            "boot_args": format!("{CMDLINE} vmhost.action=reboot reboot=k"),
        },
        "drives": [],
        "machine-config": { "vcpu_count": 2, "mem_size_mib": 256, "huge_pages": "2M" },
    })
}

/// A `kB` field of `/proc/<pid>/status`, in MiB.
fn status_mib(pid: u32, field: &str) -> Option<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib: f64 = s
        .lines()
        .find_map(|l| l.strip_prefix(field))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib / 1024.0)
}

/// The first child of `pid`, if it has one (vmhost's VMM under its cgroup supervisor).
fn first_child(pid: u32) -> Option<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The `Rss:` of `/proc/<pid>/smaps_rollup`, MiB: the pages mapped in the process's page
/// tables when it is read. Unlike `VmRSS`/`VmHWM` it does not depend on the kernel's
/// resident-page counters, which the emulated host's 6.1 kernel keeps per thread and adds to
/// the process's only every 64 faults (`SPLIT_RSS_COUNTING`, gone in 6.2): there `VmHWM`
/// fell short of the pages mapped at `/init` by up to 1 MiB (docs/benchmarks.md).
fn rollup_rss_mib(pid: u32) -> Option<f64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    let kb: f64 = text
        .lines()
        .find(|l| l.starts_with("Rss:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(kb / 1024.0)
}

/// The peaks seen so far: (the VMM process's, the spawned process's when they differ), and
/// the VMM's anonymous and file-backed (shmem included) resident memory when its `VmRSS` was
/// largest.
#[derive(Default)]
struct Peaks {
    vmm: f64,
    parent: Option<f64>,
    rss: f64,
    parts: (f64, f64),
    /// The largest `Rss` of the VMM's `smaps_rollup` seen (a walk of its page tables).
    mapped: f64,
}

impl Peaks {
    fn poll(&mut self, pid: u32) {
        let child = first_child(pid);
        let vmm = child.unwrap_or(pid);
        if let Some(m) = status_mib(vmm, "VmHWM:") {
            self.vmm = self.vmm.max(m);
        }
        if let Some(m) = rollup_rss_mib(vmm) {
            self.mapped = self.mapped.max(m);
        }
        if let Some(rss) = status_mib(vmm, "VmRSS:").filter(|r| *r > self.rss) {
            let part = |key| status_mib(vmm, key).unwrap_or(f64::NAN);
            let mapped_files = part("RssFile:") + part("RssShmem:");
            (self.rss, self.parts) = (rss, (part("RssAnon:"), mapped_files));
        }
        if child.is_some() {
            if let Some(m) = status_mib(pid, "VmHWM:") {
                self.parent = Some(self.parent.unwrap_or(0.0).max(m));
            }
        }
    }
}

/// Where the VMM process under `pid` (its child when it has one) is resident, from
/// `/proc/<pid>/smaps`: KiB per mapping name and permissions (anonymous ones as `[anon]`),
/// the ten largest first. For `VMHOST_BENCH_SMAPS=1`.
fn resident_by_mapping(pid: u32) -> String {
    let vmm = first_child(pid).unwrap_or(pid);
    let Ok(smaps) = std::fs::read_to_string(format!("/proc/{vmm}/smaps")) else {
        return "no smaps".to_string();
    };
    let mut by: BTreeMap<String, u64> = BTreeMap::new();
    let mut name = String::new();
    for line in smaps.lines() {
        let mut f = line.split_whitespace();
        match (f.next(), f.next()) {
            (Some("Rss:"), Some(kb)) => {
                *by.entry(name.clone()).or_default() += kb.parse::<u64>().unwrap_or(0);
            }
            (Some(first), _) if first.contains('-') && !first.ends_with(':') => {
                let fields: Vec<&str> = line.split_whitespace().collect();
                name = fields
                    .get(5)
                    .map_or("[anon]".to_string(), |n| (*n).to_string());
                name = format!("{name} {}", fields.get(1).unwrap_or(&""));
            }
            _ => {}
        }
    }
    let mut v: Vec<(String, u64)> = by.into_iter().filter(|(_, kb)| *kb > 0).collect();
    v.sort_by_key(|e| std::cmp::Reverse(e.1));
    v.iter()
        .take(10)
        .map(|(n, kb)| format!("{n} {kb} KiB"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Kills and reaps `child`, logging what its threads were doing.
fn stop(child: &mut Child, what: &str) {
    println!("     {what} hung: {}", host::thread_states(child.id()));
    let _ = child.kill();
    let _ = child.wait();
}

/// What the reader of a VMM's stdout gives back: the last lines, and a JSON report.
#[derive(Default)]
struct Output {
    tail: Vec<String>,
    json: String,
}

/// Reads a VMM's stdout as it comes: sends (seconds since `t0`, the uptime on the line) at
/// `GUEST-INIT`, keeps the last lines and, from a line `{` on, vmhost's `--json` report.
fn read_stdout(
    stdout: std::process::ChildStdout,
    t0: Instant,
    tx: mpsc::Sender<(f64, Option<f64>)>,
) -> Output {
    let mut out = Output::default();
    for line in BufReader::new(stdout).lines().map_while(Result::ok) {
        if line.contains("GUEST-INIT") {
            let uptime = crate::linux_bench::after(&line, "GUEST-INIT uptime=");
            let _ = tx.send((t0.elapsed().as_secs_f64(), uptime));
        }
        if line == "{" || !out.json.is_empty() {
            out.json.push_str(&line);
            out.json.push('\n');
        }
        out.tail.push(line);
        if out.tail.len() > 12 {
            out.tail.remove(0);
        }
    }
    out
}

/// The command that boots `v` (with `--json` when `json`): stdout piped, stderr written to
/// `<work>/peer-bench.err`, whose path comes with it.
fn boot_command(s: &Setup, v: Vmm, json: bool) -> Result<(Command, PathBuf), String> {
    let err_path = s.work.join("peer-bench.err");
    let err = std::fs::File::create(&err_path).map_err(|e| format!("create stderr: {e}"))?;
    let mut cmd = command(s, v);
    if json {
        cmd.arg("--json");
    }
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(err);
    Ok((cmd, err_path))
}

/// What [`follow`] saw of a VMM: how it ended (`None`: it hung and was stopped), its peaks,
/// and (seconds to `GUEST-INIT`, the uptime on that line) when that line came while it ran.
struct Followed {
    status: Option<ExitStatus>,
    peaks: Peaks,
    to_init: Option<(f64, Option<f64>)>,
}

/// Polls the VMM `child`, spawned at `t0`, every 20 ms until it exits: its peaks and, when
/// `GUEST-INIT` comes (on `rx`), the resident pages (`VMHOST_BENCH_SMAPS`) and text pages
/// (`VMHOST_BENCH_TEXT_PAGES`, with `json`) asked for. Stops it when it runs past
/// [`TO_INIT_LIMIT`] without `/init`, or past [`EXIT_LIMIT`] after it.
fn follow(
    s: &Setup,
    what: &str,
    json: bool,
    child: &mut Child,
    t0: Instant,
    rx: &mpsc::Receiver<(f64, Option<f64>)>,
) -> Result<Followed, String> {
    let pid = child.id();
    let mut peaks = Peaks::default();
    let mut to_init = None;
    let status = loop {
        peaks.poll(pid);
        if to_init.is_none() {
            to_init = rx.try_recv().ok();
            if to_init.is_some() && std::env::var_os("VMHOST_BENCH_SMAPS").is_some() {
                println!("     {what} at /init: {}", resident_by_mapping(pid));
            }
            if to_init.is_some() && crate::text_pages::wanted() && json {
                print_text_pages(s, first_child(pid).unwrap_or(pid), what);
            }
        }
        let limit = to_init.map_or(TO_INIT_LIMIT, |(t, _)| {
            Duration::from_secs_f64(t) + EXIT_LIMIT
        });
        match child.try_wait() {
            Ok(Some(st)) => break Some(st),
            Ok(None) if t0.elapsed() > limit => break None,
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(format!("wait {what}: {e}")),
        }
    };
    if status.is_none() {
        stop(child, what);
    }
    Ok(Followed {
        status,
        peaks,
        to_init,
    })
}

/// Once the VMM has ended and its stdout `out` is read: the seconds to `GUEST-INIT` and the
/// guest's uptime on that line. Fails, with its last lines and its stderr (`err_path`), when
/// no such line came or the VMM did not exit cleanly after it.
fn init_seen(
    what: &str,
    f: &Followed,
    rx: &mpsc::Receiver<(f64, Option<f64>)>,
    out: &Output,
    err_path: &Path,
) -> Result<(f64, f64), String> {
    let status = f.status;
    let tail = &out.tail;
    let stderr = std::fs::read_to_string(err_path).unwrap_or_default();
    let (to_init, uptime) = f.to_init.or_else(|| rx.try_recv().ok()).ok_or_else(|| {
        format!("{what}: no GUEST-INIT (exit {status:?}); last lines {tail:?}; stderr {stderr}")
    })?;
    let uptime = uptime.ok_or_else(|| format!("{what}: no uptime on the GUEST-INIT line"))?;
    ensure!(
        status.is_some_and(|st| st.success()),
        "{what}: exit {status:?} after the guest's /init; last lines {tail:?}; stderr {stderr}"
    );
    Ok((to_init, uptime))
}

/// Runs one VMM: times its guest to `GUEST-INIT` and to its first VM exit, follows its peak
/// RSS, waits for it to exit and reads the exits it caused; with `json` (vmhost only) adds
/// `--json` and reads its timeline.
fn boot(
    s: &Setup,
    v: Vmm,
    exits: &ExitCounter,
    first: &FirstExit,
    json: bool,
) -> Result<Run, String> {
    let what = v.label();
    let (mut cmd, err_path) = boot_command(s, v, json)?;
    if scrubbing() {
        scrub_pool()?;
    }
    exits.clear()?;
    first.clear()?;
    let spawn_ns = monotonic_ns();
    let t0 = Instant::now();
    let mut child = cmd.spawn().map_err(|e| format!("spawn {what}: {e}"))?;
    let stdout = child.stdout.take().ok_or("no stdout pipe")?;
    let (tx, rx) = mpsc::channel();
    let reader = std::thread::spawn(move || read_stdout(stdout, t0, tx));
    let followed = follow(s, what, json, &mut child, t0, &rx)?;
    let counts = exits.read()?;
    let first_exit = first.first_ns()?.saturating_sub(spawn_ns) as f64 / 1e9;
    let out = reader.join().unwrap_or_default();
    let (to_init, uptime) = init_seen(what, &followed, &rx, &out, &err_path)?;
    let phases = if json {
        phases_ms(&json_report(&out.json)?, spawn_ns)?
    } else {
        Vec::new()
    };
    let peaks = followed.peaks;
    Ok(Run {
        to_init,
        first_exit,
        phases,
        uptime,
        hwm_mib: peaks.vmm,
        parent_hwm_mib: peaks.parent,
        parts_mib: peaks.parts,
        mapped_mib: peaks.mapped,
        exits: counts,
    })
}

/// The peers' bundles that are there; one line for each that is not.
pub fn peer_bundles(a: &Assets) -> BTreeMap<&'static str, PathBuf> {
    let dir = a.vmlinux.with_file_name("peers");
    let mut found = BTreeMap::new();
    for (name, var, how) in HOW_TO_GET {
        let d = dir.join(name);
        if d.join(name).exists() {
            found.insert(name, d);
        } else {
            println!(
                "     {var} unset: its peer is left out ({how}; docs/benchmarks.md, \"How to \
                 get the peers\")"
            );
        }
    }
    found
}

fn setup(env: &Env) -> Result<Setup, String> {
    let a = bench_assets(env)?;
    let text = linux_spec(
        "peerboot",
        (1, 2),
        "",
        "256Mi",
        &a.vmlinux,
        &a.initrd,
        "poweroff",
    );
    let spec = env.spec("peerboot", &text)?;
    // linux_spec ends in its [boot] table.
    let spec_split = env.spec("peerboot-split", &format!("{text}irqchip = \"split\"\n"))?;
    let fc_path = env.work.join("peerboot-fc.json");
    std::fs::write(&fc_path, fc_config(&a).to_string())
        .map_err(|e| format!("write {}: {e}", fc_path.display()))?;
    Ok(Setup {
        peers: peer_bundles(&a),
        run_dir: env.run_dir.clone(),
        work: env.work.clone(),
        spec,
        spec_split,
        fc_config: fc_path,
        a,
    })
}

/// The rounds asked for: `VMHOST_BENCH_ROUNDS`, else [`ROUNDS`].
pub fn rounds() -> usize {
    std::env::var("VMHOST_BENCH_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .filter(|&r| r > 0)
        .unwrap_or(ROUNDS)
}

/// Boots vmhost, vmhost with background prefault, Cloud Hypervisor, Firecracker and QEMU in
/// rotated order, `rounds()` times, and prints the figures, their intervals and the exits.
pub fn linux_boot_vs_peers(env: &Env) -> Outcome {
    let s = setup(env)?;
    host::set_2m_pools(&[160, 0])?;
    if crate::text_pages::wanted() {
        return profile_text_pages(&s);
    }
    let mut vmms = vec![Vmm::Vmhost, Vmm::VmhostBackground, Vmm::VmhostSplit];
    if s.peers.contains_key("ch") {
        vmms.push(Vmm::CloudHypervisor);
    }
    if s.peers.contains_key("fc") {
        vmms.push(Vmm::Firecracker);
    }
    vmms.push(Vmm::Qemu);
    let exits = ExitCounter::attach()?;
    let first = FirstExit::start()?;
    let rounds = rounds();
    let n = vmms.len();
    let mut runs: Vec<Vec<Run>> = (0..n).map(|_| Vec::new()).collect();
    for r in 0..rounds {
        for k in 0..n {
            let i = (r + k) % n;
            runs[i].push(boot(&s, vmms[i], &exits, &first, false)?);
        }
    }
    // One more boot of each vmhost mode with `--json`, for its timeline (the rounds run the
    // plain command a user runs).
    let timelines = [Vmm::Vmhost, Vmm::VmhostBackground, Vmm::VmhostSplit]
        .iter()
        .map(|&v| Ok((v, boot(&s, v, &exits, &first, true)?)))
        .collect::<Result<Vec<_>, String>>()?;
    drop(first);
    drop(exits);
    report(&vmms, &runs, rounds);
    timeline_lines(&timelines);
    Ok(())
}

/// `VMHOST_BENCH_TEXT_PAGES=1`: no benchmark; with the kernel's fault-around at one page,
/// each vmhost mode boots (with `--json`) three times and prints the pages of its binary it has
/// mapped at `/init` (`crate::text_pages`), for `scripts/text-order.py --emulated-pages`.
fn profile_text_pages(s: &Setup) -> Outcome {
    let was = crate::text_pages::set_fault_around(4096)?;
    let exits = ExitCounter::attach()?;
    let first = FirstExit::start()?;
    let mut result = Ok(());
    for _ in 0..3 {
        for v in [Vmm::Vmhost, Vmm::VmhostBackground, Vmm::VmhostSplit] {
            if let Err(e) = boot(s, v, &exits, &first, true) {
                result = Err(e);
            }
        }
    }
    crate::text_pages::set_fault_around(was)?;
    result
}

/// Prints the pages of the vmhost binary process `pid` has mapped, one line per mapping.
fn print_text_pages(s: &Setup, pid: u32, what: &str) {
    let exe = std::fs::canonicalize(&s.a.vmhost_release).unwrap_or(s.a.vmhost_release.clone());
    match crate::text_pages::dump(pid, &exe) {
        Ok(lines) => lines.iter().for_each(|l| println!("     {what} {l}")),
        Err(e) => println!("     {what}: no text pages: {e}"),
    }
}
