//! The virtio devices' throughput, vmhost next to QEMU in the same emulated host (benchmark
//! suite, `testbed/run.sh bench`): the same vmlinux and device initramfs, 2 vCPUs, 256 MiB, a
//! 256 MiB raw image on the host's tmpfs with the host page cache (`writeback` for both: tmpfs
//! on Linux 6.1 takes no O_DIRECT), and a tap on the host at 10.0.2.1. vmhost gives the guest
//! virtio-mmio devices (blk, net); QEMU 7.2 `-enable-kvm` gives it virtio-blk-pci and
//! virtio-net-pci on the same image and a tap of its own.
//!
//! The guest (`testbed/guest/iobench-run`, `iobench.c`) times everything on its own clock:
//! sequential write and read of 128 MiB in 1 MiB O_DIRECT requests, 4 KiB O_DIRECT random
//! reads at queue depth 1 for 5 s, and 64 MiB over TCP each way to `nc` on the host. After one
//! warm-up run of each (not counted), runs alternate QEMU, vmhost, vmhost, QEMU, …; medians are
//! compared, vmhost/QEMU (higher is better for vmhost). Emulated timings mean something only
//! as these ratios (docs/benchmarks.md).

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::host;
use crate::linux_tests::{assets, linux_spec};
use crate::vm::Env;
use crate::{ensure, Outcome};

/// Measured runs of each VMM, after one warm-up run each whose figures are not counted (the
/// first guest after the image is created runs on cold host caches, whichever VMM it is).
const RUNS: usize = 5;
/// The longest one guest run may take (boot, the figures, poweroff).
const LIMIT: Duration = Duration::from_secs(240);
/// The figures, in the order the guest prints them.
const FIGURES: [&str; 5] = ["seqwrite", "seqread", "randread", "tcpsend", "tcprecv"];
/// The addresses: the guest's (with its prefix) and the host's, on the tap.
const GUEST_NET: &str = "10.0.2.15/24,10.0.2.1";
const HOST_IP: &str = "10.0.2.1/24";
/// The target: vmhost/QEMU at least this on every figure (reported, not asserted).
const TARGET: f64 = 1.0;

/// A process killed (and reaped) when dropped.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The host's two `nc` endpoints for one run: 5001 swallows what the guest sends, 5002 sends
/// `payload`.
fn nc_endpoints(payload: &Path) -> Result<[Killed; 2], String> {
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

/// Runs one guest under `cmd`: waits for the VMM's tap (`tap_prefix`) to address it, then for
/// the VMM to end; returns the `IOBENCH` figures.
fn run_guest(
    mut cmd: Command,
    what: &str,
    tap_prefix: &str,
) -> Result<BTreeMap<String, f64>, String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !interfaces(tap_prefix).is_empty() {
        ensure!(
            Instant::now() < deadline,
            "{what}: a {tap_prefix}* tap of an earlier run is still there"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = Killed(cmd.spawn().map_err(|e| format!("spawn {what}: {e}"))?);
    let mut stdout = child.0.stdout.take().ok_or("no stdout pipe")?;
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stdout.read_to_string(&mut s);
        s
    });
    let start = Instant::now();
    let mut addressed = false;
    let status = loop {
        if !addressed {
            if let Some(tap) = interfaces(tap_prefix).first() {
                ip(&["addr", "add", HOST_IP, "dev", tap])?;
                ip(&["link", "set", tap, "up"])?;
                addressed = true;
            }
        }
        match child.0.try_wait() {
            Ok(Some(s)) => break Some(s),
            Ok(None) if start.elapsed() > LIMIT => break None,
            Ok(None) => std::thread::sleep(Duration::from_millis(100)),
            Err(e) => return Err(format!("wait {what}: {e}")),
        }
    };
    if status.is_none() {
        let _ = child.0.kill();
    }
    let _ = child.0.wait();
    let out = reader.join().unwrap_or_default();
    let mut err = String::new();
    if let Some(mut e) = child.0.stderr.take() {
        let _ = e.read_to_string(&mut err);
    }
    let tail: Vec<&str> = out.lines().rev().take(80).collect();
    ensure!(
        out.contains("IOBENCH-DONE"),
        "{what}: no IOBENCH-DONE (exit {status:?}, tap addressed: {addressed}); last lines \
         {tail:?}; stderr {err}"
    );
    let figures: BTreeMap<String, f64> = out
        .lines()
        .filter_map(|l| l.trim_end_matches('\r').strip_prefix("IOBENCH "))
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            Some((f.next()?.to_string(), f.next()?.parse().ok()?))
        })
        .collect();
    for f in FIGURES {
        ensure!(figures.contains_key(f), "{what}: no {f} figure: {tail:?}");
    }
    Ok(figures)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// Times the virtio disk and network under vmhost and under QEMU in the same emulated host and
/// prints each figure's medians and their ratio against the ≥ 1.0 target.
pub fn virtio_vs_qemu(env: &Env) -> Outcome {
    let a = assets(env)?;
    ensure!(
        a.qemu.exists(),
        "benchmark asset {} missing (testbed/run.sh bench copies it)",
        a.qemu.display()
    );
    host::set_2m_pools(&[128, 0])?;
    let initrd = env.work.join("guest/initramfs-devices.cpio");
    let image = env.work.join("iobench.img");
    std::fs::File::create(&image)
        .and_then(|f| f.set_len(256 << 20))
        .map_err(|e| format!("create {}: {e}", image.display()))?;
    let payload = env.work.join("iobench-to-guest.bin");
    std::fs::write(&payload, vec![0x5au8; 64 << 20]).map_err(|e| e.to_string())?;
    let action = format!("iobench vmhost.net={GUEST_NET}");
    let spec = format!(
        "{}[[devices.disks]]\nname = \"bench\"\ncache = \"writeback\"\n[[volumes]]\n\
         name = \"bench\"\nhost_disk = {{ path = \"{}\", type = \"Disk\" }}\n\
         [[devices.interfaces]]\nname = \"default\"\nbridge = {{}}\n[[networks]]\n\
         name = \"default\"\npod = {{}}\n",
        linux_spec("iobench", (1, 2), "", "256Mi", &a.vmlinux, &initrd, &action),
        image.display()
    );
    let spec = env.spec("iobench", &spec)?;
    let qemu = || {
        let mut c = crate::linux_bench::qemu_command(&a, &initrd, &action);
        c.arg("-drive")
            .arg(format!(
                "file={},if=none,id=d0,format=raw,cache=writeback",
                image.display()
            ))
            .args(["-device", "virtio-blk-pci,drive=d0"])
            .args(["-netdev", "tap,id=n0,ifname=tapq,script=no,downscript=no"])
            .args(["-device", "virtio-net-pci,netdev=n0,romfile="]);
        c
    };
    let mut runs: BTreeMap<(&str, &str), Vec<f64>> = BTreeMap::new();
    for round in 0..=RUNS {
        let vmhost = {
            let mut c = Command::new(&a.vmhost_release);
            c.arg("--run-dir")
                .arg(&env.run_dir)
                .arg("--config")
                .arg(&spec);
            c
        };
        let mut order = [("vmhost", vmhost, "vmhost"), ("qemu", qemu(), "tapq")];
        // Alternate which VMM goes first, so that neither always follows the other.
        if round % 2 == 0 {
            order.reverse();
        }
        for (who, cmd, tap) in order {
            let _nc = nc_endpoints(&payload)?;
            let figures = run_guest(cmd, who, tap)?;
            if round == 0 {
                continue;
            }
            for f in FIGURES {
                runs.entry((who, f)).or_default().push(figures[f]);
            }
        }
    }
    println!(
        "     {RUNS} runs each after a warm-up run each, interleaved, alternating which goes first; \
         guest-timed; vmhost/QEMU (target >= {TARGET})"
    );
    let mut met = Vec::new();
    for f in FIGURES {
        let v = runs.remove(&("vmhost", f)).unwrap_or_default();
        let q = runs.remove(&("qemu", f)).unwrap_or_default();
        let (mv, mq) = (median(v.clone()), median(q.clone()));
        let ratio = if mq > 0.0 { mv / mq } else { 0.0 };
        let unit = if f == "randread" { "IOPS" } else { "MB/s" };
        println!(
            "     {f:<9} vmhost {mv:>8.1} {unit} {v:.1?}  QEMU {mq:>8.1} {unit} {q:.1?}  ratio {ratio:.2}"
        );
        met.push(format!(
            "{f} {}",
            if ratio >= TARGET { "met" } else { "not met" }
        ));
    }
    println!("     target: {}", met.join(", "));
    Ok(())
}
