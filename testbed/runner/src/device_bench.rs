//! The virtio devices' throughput, vmhost next to QEMU, Cloud Hypervisor and Firecracker in
//! the same emulated host (benchmark suite, `testbed/run.sh bench`): the same vmlinux and
//! device initramfs, 2 vCPUs, 256 MiB of 2 MiB hugepages (QEMU: anonymous memory), a 256 MiB
//! raw image on the host's tmpfs with the host page cache (`writeback` for vmhost, QEMU and
//! Firecracker, Cloud Hypervisor's default `direct=off`: tmpfs on Linux 6.1 takes no
//! O_DIRECT), and a tap on the host at 10.0.2.1. vmhost runs twice per round: with its
//! default virtio-mmio devices (blk, net), as Firecracker gives, and as "vmhost (pci)" with
//! `boot.virtio_announce = "pci"` (virtio-pci functions with MSI-X), as QEMU 7.2
//! `-enable-kvm` and Cloud Hypervisor give (the guest loads `virtio_pci`). The peers are the bundles of `testbed/build-guest.sh`
//! (`VMHOST_BENCH_CH`, `VMHOST_BENCH_FC`); a missing one is left out with one line saying how
//! to get it.
//!
//! The guest (`testbed/guest/iobench-run`, `iobench.c`) times everything on its own clock:
//! sequential write and read of 128 MiB in 1 MiB O_DIRECT requests, 4 KiB O_DIRECT random
//! reads at queue depth 1 for 5 s, and 64 MiB over TCP each way to `nc` on the host. After one
//! warm-up round (not counted), `VMHOST_BENCH_ROUNDS` rounds (default 11) run every VMM once,
//! the order rotated by one each round; per figure the median of each VMM and the median of
//! the per-round ratios vmhost / peer for each vmhost transport (higher is better for vmhost)
//! with a 95 % bootstrap interval. The host kernel's `kvm_exit` counts ([`crate::kvm_exits`]) are read each time
//! the guest prints a figure, so the exits of the sequential-read and random-read phases are
//! reported per 1,000 of the guest's requests. Emulated timings mean something only as these
//! ratios (docs/benchmarks.md).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use vmhost_testsupport::stats::{bootstrap_ci, median};

use crate::host;
use crate::kvm_exits::ExitCounter;
use crate::linux_tests::{assets, linux_spec, Assets, CMDLINE};
use crate::peers_bench::{bundled, peer_bundles};
use crate::vm::Env;
use crate::{ensure, Outcome};
/// The longest one guest run may take (boot, the figures, poweroff).
const LIMIT: Duration = Duration::from_secs(240);
/// The figures, in the order the guest prints them.
const FIGURES: [&str; 5] = ["seqwrite", "seqread", "randread", "tcpsend", "tcprecv"];
/// The addresses: the guest's (with its prefix) and the host's, on the tap.
const GUEST_NET: &str = "10.0.2.15/24,10.0.2.1";
const HOST_IP: &str = "10.0.2.1/24";
/// The target: vmhost / peer at least this on every figure (reported, not asserted).
const TARGET: f64 = 1.0;
/// The guest's requests in the phases whose exits are counted per request: 128 MiB in 1 MiB
/// reads; random reads: the IOPS figure times its 5 s.
pub(crate) const SEQREAD_REQUESTS: f64 = 128.0;
pub(crate) const RANDREAD_SECONDS: f64 = 5.0;
/// How long a VMM may run on after its guest printed `IOBENCH-DONE` (Firecracker does not end
/// on the guest's power-off; it is stopped then).
const DONE_GRACE: Duration = Duration::from_secs(15);

/// A process killed (and reaped) when dropped.
pub(crate) struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The host's two `nc` endpoints for one run: 5001 swallows what the guest sends, 5002 sends
/// `payload`.
pub(crate) fn nc_endpoints(payload: &Path) -> Result<[Killed; 2], String> {
    let spawn = |args: &[&str]| {
        Command::new("nc")
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .map(Killed)
            .map_err(|e| format!("spawn nc {args:?}: {e}"))
    };
    let send = payload.to_string_lossy().into_owned();
    Ok([
        spawn(&["-l", "-p", "5001", "-e", "sh", "-c", "cat > /dev/null"])?,
        spawn(&["-l", "-p", "5002", "-e", "cat", &send])?,
    ])
}

/// Network interfaces whose name starts with `prefix`.
fn interfaces(prefix: &str) -> Vec<String> {
    std::fs::read_dir("/sys/class/net")
        .map(|d| {
            d.filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(prefix))
                .collect()
        })
        .unwrap_or_default()
}

fn ip(args: &[&str]) -> Outcome {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip {args:?}: {e}"))?;
    ensure!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Vmm {
    Vmhost,
    /// vmhost with `boot.virtio_announce = "pci"`: virtio-pci functions with MSI-X.
    VmhostPci,
    Qemu,
    CloudHypervisor,
    Firecracker,
}

impl Vmm {
    fn label(self) -> &'static str {
        match self {
            Vmm::Vmhost => "vmhost",
            Vmm::VmhostPci => "vmhost (pci)",
            Vmm::Qemu => "QEMU",
            Vmm::CloudHypervisor => "Cloud Hypervisor",
            Vmm::Firecracker => "Firecracker",
        }
    }

    /// The name (prefix) of the tap the VMM creates.
    fn tap(self) -> &'static str {
        match self {
            Vmm::Vmhost | Vmm::VmhostPci => "vmhost",
            Vmm::Qemu => "tapq",
            Vmm::CloudHypervisor => "tapc",
            Vmm::Firecracker => "tapf",
        }
    }
}

/// What a guest run needs.
pub(crate) struct Setup {
    a: Assets,
    /// The vmhost to run: the release build of `run.sh bench` ([`setup`]), or the suite's own
    /// in a test.
    pub(crate) vmhost: PathBuf,
    run_dir: PathBuf,
    spec: PathBuf,
    /// The same spec with `boot.virtio_announce = "pci"`.
    spec_pci: PathBuf,
    initrd: PathBuf,
    image: PathBuf,
    action: String,
    fc_config: PathBuf,
    peers: BTreeMap<&'static str, PathBuf>,
}

fn command(s: &Setup, v: Vmm) -> Command {
    match v {
        Vmm::Vmhost | Vmm::VmhostPci => {
            let spec = if v == Vmm::VmhostPci {
                &s.spec_pci
            } else {
                &s.spec
            };
            let mut c = Command::new(&s.vmhost);
            c.arg("--run-dir").arg(&s.run_dir).arg("--config").arg(spec);
            c
        }
        Vmm::Qemu => {
            let mut c = crate::linux_bench::qemu_command(&s.a, &s.initrd, &s.action);
            c.arg("-drive")
                .arg(format!(
                    "file={},if=none,id=d0,format=raw,cache=writeback",
                    s.image.display()
                ))
                .args(["-device", "virtio-blk-pci,drive=d0"])
                .args(["-netdev", "tap,id=n0,ifname=tapq,script=no,downscript=no"])
                .args(["-device", "virtio-net-pci,netdev=n0,romfile="]);
            c
        }
        Vmm::CloudHypervisor => {
            let mut c = bundled(&s.peers["ch"], "ch");
            c.arg("--kernel")
                .arg(&s.a.vmlinux)
                .arg("--initramfs")
                .arg(&s.initrd)
                .arg("--cmdline")
                .arg(format!("{CMDLINE} vmhost.action={}", s.action))
                .args(["--cpus", "boot=2"])
                .args(["--memory", "size=256M,hugepages=on,hugepage_size=2M"])
                .args(["--serial", "tty", "--console", "off", "--disk"])
                .arg(format!("path={},image_type=raw", s.image.display()))
                .args(["--net", "tap=tapc"]);
            c
        }
        Vmm::Firecracker => {
            let mut c = bundled(&s.peers["fc"], "fc");
            c.args(["--no-api", "--level", "Error", "--config-file"])
                .arg(&s.fc_config);
            c
        }
    }
}

/// Firecracker's configuration: the same kernel, initramfs, command line, vCPUs, hugepage
/// memory, disk (page cache) and a tap.
fn fc_config(s: &Setup) -> serde_json::Value {
    serde_json::json!({
        "boot-source": {
            "kernel_image_path": s.a.vmlinux,
            "initrd_path": s.initrd,
            "boot_args": format!("{CMDLINE} vmhost.action={}", s.action),
        },
        "drives": [{
            "drive_id": "bench",
            "path_on_host": s.image,
            "is_root_device": false,
            "is_read_only": false,
            "cache_type": "Writeback",
        }],
        "network-interfaces": [{ "iface_id": "eth0", "host_dev_name": "tapf" }],
        "machine-config": { "vcpu_count": 2, "mem_size_mib": 256, "huge_pages": "2M" },
    })
}

/// One guest run: the figures, and the host's exit counts when each figure's line came.
pub(crate) struct Figures {
    pub(crate) values: BTreeMap<String, f64>,
    pub(crate) exits_at: BTreeMap<String, BTreeMap<String, u64>>,
    /// The guest's `GUEST key=value` lines (its view of the devices and their interrupts).
    pub(crate) lines: Vec<BTreeMap<String, String>>,
}

/// Waits until no tap of an earlier run with `prefix` is left.
fn wait_no_tap(prefix: &str, what: &str) -> Outcome {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !interfaces(prefix).is_empty() {
        ensure!(
            Instant::now() < deadline,
            "{what}: a {prefix}* tap of an earlier run is still there"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

/// Runs one guest under VMM `v`: addresses its tap when it appears, reads its serial lines
/// as they come (the exit counts at each `IOBENCH` line), and waits for it to end.
pub(crate) fn run_guest(s: &Setup, v: Vmm, exits: &ExitCounter) -> Result<Figures, String> {
    let (what, tap_prefix) = (v.label(), v.tap());
    wait_no_tap(tap_prefix, what)?;
    let mut cmd = command(s, v);
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    exits.clear()?;
    let mut child = Killed(cmd.spawn().map_err(|e| format!("spawn {what}: {e}"))?);
    let stdout = child.0.stdout.take().ok_or("no stdout pipe")?;
    let mut stderr = child.0.stderr.take().ok_or("no stderr pipe")?;
    let err_reader = std::thread::spawn(move || {
        let mut e = String::new();
        let _ = stderr.read_to_string(&mut e);
        e
    });
    let done = AtomicBool::new(false);
    let (out, exits_at, status, addressed) = std::thread::scope(|scope| {
        let reader = scope.spawn(|| read_serial(stdout, exits, &done));
        let waited = wait_guest(&mut child.0, what, tap_prefix, &done);
        let _ = child.0.kill();
        let _ = child.0.wait();
        let (out, at) = reader.join().unwrap_or_default();
        waited.map(|(status, addressed)| (out, at, status, addressed))
    })?;
    let err = err_reader.join().unwrap_or_default();
    let tail: Vec<&str> = out.lines().rev().take(80).collect();
    ensure!(
        out.contains("IOBENCH-DONE"),
        "{what}: no IOBENCH-DONE (exit {status:?}, tap addressed: {addressed}); last lines \
         {tail:?}; stderr {err}"
    );
    let values: BTreeMap<String, f64> = out
        .lines()
        .filter_map(|l| l.trim_end_matches('\r').strip_prefix("IOBENCH "))
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            Some((f.next()?.to_string(), f.next()?.parse().ok()?))
        })
        .collect();
    for f in FIGURES {
        ensure!(values.contains_key(f), "{what}: no {f} figure: {tail:?}");
    }
    let lines = crate::linux_tests::guest_lines(&out);
    Ok(Figures {
        values,
        exits_at,
        lines,
    })
}

type ExitsAt = BTreeMap<String, BTreeMap<String, u64>>;

/// Everything the guest printed, and the exit counts read when each `IOBENCH name` line came.
/// Sets `done` at `IOBENCH-DONE`.
fn read_serial(
    stdout: std::process::ChildStdout,
    exits: &ExitCounter,
    done: &AtomicBool,
) -> (String, ExitsAt) {
    let (mut out, mut at) = (String::new(), BTreeMap::new());
    for line in BufReader::new(stdout).lines().map_while(Result::ok) {
        if line.contains("IOBENCH-DONE") {
            done.store(true, Ordering::Release);
        }
        if let Some(name) = line
            .strip_prefix("IOBENCH ")
            .and_then(|l| l.split_whitespace().next())
        {
            if let Ok(counts) = exits.read() {
                at.insert(name.to_string(), counts);
            }
        }
        out.push_str(&line);
        out.push('\n');
    }
    (out, at)
}

/// Addresses the VMM's tap when it appears and waits for the VMM to end: by itself, or
/// [`DONE_GRACE`] after the guest said `IOBENCH-DONE` (`done`), or at [`LIMIT`].
fn wait_guest(
    child: &mut Child,
    what: &str,
    tap_prefix: &str,
    done: &AtomicBool,
) -> Result<(Option<std::process::ExitStatus>, bool), String> {
    let start = Instant::now();
    let mut addressed = false;
    let mut done_at = None;
    loop {
        if done_at.is_none() && done.load(Ordering::Acquire) {
            done_at = Some(Instant::now());
        }
        if done_at.is_some_and(|t| t.elapsed() > DONE_GRACE) {
            return Ok((None, addressed));
        }
        if !addressed {
            if let Some(tap) = interfaces(tap_prefix).first() {
                ip(&["addr", "add", HOST_IP, "dev", tap])?;
                ip(&["link", "set", tap, "up"])?;
                addressed = true;
            }
        }
        match child.try_wait() {
            Ok(Some(s)) => return Ok((Some(s), addressed)),
            Ok(None) if start.elapsed() > LIMIT => return Ok((None, addressed)),
            Ok(None) => std::thread::sleep(Duration::from_millis(100)),
            Err(e) => return Err(format!("wait {what}: {e}")),
        }
    }
}

/// The inputs of a run: the image, vmhost's specs (virtio-mmio and virtio-pci) and, with
/// `peers`, the bundled peers (each missing one said in a line) and Firecracker's
/// configuration.
pub(crate) fn setup(env: &Env, peers: bool) -> Result<Setup, String> {
    let a = assets(env)?;
    let initrd = env.work.join("guest/initramfs-devices.cpio");
    let image = env.work.join("iobench.img");
    std::fs::File::create(&image)
        .and_then(|f| f.set_len(256 << 20))
        .map_err(|e| format!("create {}: {e}", image.display()))?;
    let action = format!("iobench vmhost.net={GUEST_NET}");
    let spec = |boot_extra: &str| {
        format!(
            "{}{boot_extra}[[devices.disks]]\nname = \"bench\"\ncache = \"writeback\"\n\
             [[volumes]]\nname = \"bench\"\nhost_disk = {{ path = \"{}\", type = \"Disk\" }}\n\
             [[devices.interfaces]]\nname = \"default\"\nbridge = {{}}\n[[networks]]\n\
             name = \"default\"\npod = {{}}\n",
            linux_spec("iobench", (1, 2), "", "256Mi", &a.vmlinux, &initrd, &action),
            image.display()
        )
    };
    let s = Setup {
        vmhost: a.vmhost_release.clone(),
        spec: env.spec("iobench", &spec(""))?,
        spec_pci: env.spec("iobench-pci", &spec("virtio_announce = \"pci\"\n"))?,
        run_dir: env.run_dir.clone(),
        fc_config: env.work.join("iobench-fc.json"),
        peers: if peers {
            peer_bundles(&a)
        } else {
            BTreeMap::new()
        },
        initrd,
        image,
        action,
        a,
    };
    if !s.peers.contains_key("fc") {
        return Ok(s);
    }
    std::fs::write(&s.fc_config, fc_config(&s).to_string())
        .map_err(|e| format!("write {}: {e}", s.fc_config.display()))?;
    Ok(s)
}

/// Times the virtio disk and network under vmhost, QEMU and the peers in the same emulated
/// host and prints each figure's medians, the ratios with their intervals against the >= 1.0
/// target, and the exits per 1,000 requests of the read phases.
pub fn virtio_vs_qemu(env: &Env) -> Outcome {
    let s = setup(env, true)?;
    ensure!(
        s.a.qemu.exists(),
        "benchmark asset {} missing (testbed/run.sh bench copies it)",
        s.a.qemu.display()
    );
    host::set_2m_pools(&[160, 0])?;
    let payload = env.work.join("iobench-to-guest.bin");
    std::fs::write(&payload, vec![0x5au8; 64 << 20]).map_err(|e| e.to_string())?;
    let mut vmms = vec![Vmm::Vmhost, Vmm::VmhostPci, Vmm::Qemu];
    if s.peers.contains_key("ch") {
        vmms.push(Vmm::CloudHypervisor);
    }
    if s.peers.contains_key("fc") {
        vmms.push(Vmm::Firecracker);
    }
    let exits = ExitCounter::attach()?;
    let rounds = crate::peers_bench::rounds();
    let n = vmms.len();
    let mut runs: Vec<Vec<Figures>> = (0..n).map(|_| Vec::new()).collect();
    // Round 0 warms up: the first guest after the image is created runs on cold host caches.
    for round in 0..=rounds {
        for k in 0..n {
            let i = (round + k) % n;
            let figures = run_retried(&s, vmms[i], &exits, &payload)?;
            if round > 0 {
                runs[i].push(figures);
            }
        }
    }
    drop(exits);
    report(&vmms, &runs, rounds);
    Ok(())
}

/// [`run_guest`], run again (at most twice) after a failed run, which is printed: a guest that
/// died in the emulated host (Cloud Hypervisor's guest once triple-faulted there, and the VMM
/// rebooted it) should not cost the whole benchmark.
fn run_retried(s: &Setup, v: Vmm, exits: &ExitCounter, payload: &Path) -> Result<Figures, String> {
    let mut failure = String::new();
    for attempt in 1..=3 {
        let _nc = nc_endpoints(payload)?;
        match run_guest(s, v, exits) {
            Ok(f) => return Ok(f),
            Err(e) => {
                let short: String = e.chars().take(600).collect();
                println!(
                    "     {} run failed (attempt {attempt} of 3): {short}",
                    v.label()
                );
                failure = e;
            }
        }
    }
    Err(failure)
}

fn report(vmms: &[Vmm], runs: &[Vec<Figures>], rounds: usize) {
    println!(
        "     {rounds} rounds after a warm-up round, order rotated every round; guest-timed; \
         vmhost / peer: median of per-round ratios, 95 % bootstrap CI (target >= {TARGET}: \
         met when the whole interval is at or above it)"
    );
    for f in FIGURES {
        let unit = if f == "randread" { "IOPS" } else { "MB/s" };
        for (v, r) in vmms.iter().zip(runs) {
            let x: Vec<f64> = r.iter().map(|g| g.values[f]).collect();
            println!(
                "     {f:<9} {:<17} {:>8.1} {unit} {x:.1?}",
                v.label(),
                median(&x)
            );
        }
        // Each vmhost transport against every VMM after it (the pci one against the mmio one
        // too: the second row).
        for (j, ours) in vmms.iter().enumerate().take(2) {
            for (i, peer) in vmms.iter().enumerate().skip(j + 1) {
                ratio_line(f, ours, peer, &runs[j], &runs[i]);
            }
        }
    }
    exits_per_request(vmms, runs);
}

/// One `ours / peer` line: the median per-round ratio of figure `f`, its interval, and the
/// verdict against [`TARGET`].
fn ratio_line(f: &str, ours: &Vmm, peer: &Vmm, a: &[Figures], b: &[Figures]) {
    let ratios: Vec<f64> = a
        .iter()
        .zip(b)
        .map(|(a, b)| a.values[f] / b.values[f])
        .collect();
    let ci = bootstrap_ci(&ratios);
    let verdict = if ci.0 >= TARGET {
        "met"
    } else if ci.1 < TARGET {
        "not met"
    } else {
        "inconclusive"
    };
    println!(
        "     {f:<9} {} / {:<17} {:.3} [{:.3}, {:.3}]  {verdict}",
        ours.label(),
        peer.label(),
        median(&ratios),
        ci.0,
        ci.1
    );
}

/// The exits of the sequential-read and random-read phases per 1,000 of the guest's requests
/// (medians over the rounds), with the reasons that make most of them.
fn exits_per_request(vmms: &[Vmm], runs: &[Vec<Figures>]) {
    println!(
        "     VM exits per 1,000 guest requests (kvm_exit counts between the figure lines; \
         seqread 1 MiB requests, randread 4 KiB):"
    );
    for (phase, before) in [("seqread", "seqwrite"), ("randread", "seqread")] {
        for (v, r) in vmms.iter().zip(runs) {
            let mut per: BTreeMap<String, Vec<f64>> = BTreeMap::new();
            for g in r {
                let (Some(b), Some(a)) = (g.exits_at.get(before), g.exits_at.get(phase)) else {
                    continue;
                };
                let requests = if phase == "seqread" {
                    SEQREAD_REQUESTS
                } else {
                    g.values[phase] * RANDREAD_SECONDS
                };
                let mut total = 0;
                for (reason, &n) in a {
                    let d = n.saturating_sub(b.get(reason).copied().unwrap_or(0));
                    total += d;
                    per.entry(reason.clone())
                        .or_default()
                        .push(d as f64 * 1000.0 / requests);
                }
                per.entry("total".into())
                    .or_default()
                    .push(total as f64 * 1000.0 / requests);
            }
            let mut list: Vec<(f64, &String)> = per.iter().map(|(k, x)| (median(x), k)).collect();
            list.sort_by(|a, b| b.0.total_cmp(&a.0));
            let list: Vec<String> = list
                .iter()
                .filter(|(c, _)| *c >= 0.5)
                .take(7)
                .map(|(c, k)| format!("{k} {c:.0}"))
                .collect();
            println!("     {phase:<9} {:<17} {}", v.label(), list.join(", "));
        }
    }
}
