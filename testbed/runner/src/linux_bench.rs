//! Boot time of a Linux guest, vmhost next to QEMU in the same emulated host: the same vmlinux
//! (PVH entry for both; QEMU through its `pvh.bin` option ROM), initramfs, command line, 2 vCPUs
//! and 256 MiB, from spawning the VMM to the guest's `/init`
//! printing `GUEST-INIT` on its serial console (read from the VMM's stdout as it arrives).
//! QEMU is this machine's `qemu-system-x86_64 -enable-kvm -cpu host` with a direct kernel boot
//! (SeaBIOS and an option ROM), copied in with its libraries by
//! `testbed/build-guest.sh`; vmhost is a release build (`testbed/run.sh` builds one whatever
//! the suite's profile), once with its default `--prefault before-start` and once with
//! `--prefault background`. All run from `/tmp` (tmpfs). Runs alternate (vmhost, vmhost
//! background, QEMU, vmhost, ...); the medians are compared. Emulated timings are only
//! meaningful as this ratio (docs/benchmarks.md). Then one `--json` boot gives vmhost's phases,
//! and five more pairs time each boot after [`scrub`] (informational).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::host;
use crate::linux_tests::{assets, linux_spec, Assets, CMDLINE};
use crate::vm::Env;
use crate::{ensure, Outcome};

/// Runs of each VMM.
const RUNS: usize = 5;
/// The target for vmhost's spawn → `/init` as a fraction of QEMU's: reported, never
/// asserted (a benchmark fails only when a boot fails; timings are not test outcomes).
const TARGET_RATIO: f64 = 0.8;
/// The longest one boot may take, spawn to exit.
const LIMIT: Duration = Duration::from_secs(100);

/// One boot: seconds from the spawn to the first `GUEST-INIT` line on the VMM's stdout, the
/// guest kernel's own uptime at that line, and everything the VMM printed.
struct Boot {
    to_init: f64,
    kernel: f64,
    out: String,
}

/// Spawns `cmd` and times its guest to `/init` (see [`Boot`]); waits for it to exit (the
/// guest powers off) within [`LIMIT`].
fn time_to_init(mut cmd: Command, what: &str) -> Result<Boot, String> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let t0 = Instant::now();
    let mut child = cmd.spawn().map_err(|e| format!("spawn {what}: {e}"))?;
    let stdout = child.stdout.take().ok_or("no stdout pipe")?;
    let (tx, rx) = mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut all = String::new();
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if line.contains("GUEST-INIT") {
                let _ = tx.send(t0.elapsed().as_secs_f64());
            }
            all.push_str(&line);
            all.push('\n');
        }
        all
    });
    let at_init = rx.recv_timeout(LIMIT);
    let deadline = t0 + LIMIT;
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break Some(s),
            Ok(None) if Instant::now() > deadline => break None,
            Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => return Err(format!("wait {what}: {e}")),
        }
    };
    if status.is_none() {
        // What each of its threads was doing, for the log, before it is killed.
        println!("     {what} hung: {}", host::thread_states(child.id()));
        let _ = child.kill();
        let _ = child.wait();
    }
    // The reader ends at the pipe's end of file; never wait forever for it.
    let (done_tx, done_rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = done_tx.send(reader.join().unwrap_or_default());
    });
    let out = done_rx
        .recv_timeout(Duration::from_secs(10))
        .map_err(|_| format!("{what}: its output pipe stayed open after it ended"))?;
    let secs = at_init.map_err(|_| {
        let tail: Vec<&str> = out.lines().rev().take(8).collect();
        format!("{what}: no GUEST-INIT within {LIMIT:?}; last lines: {tail:?}")
    })?;
    ensure!(
        status.is_some_and(|s| s.success()),
        "{what}: exit {status:?} after the guest's poweroff"
    );
    let kernel = after(&out, "GUEST-INIT uptime=")
        .ok_or_else(|| format!("{what}: no guest uptime on the GUEST-INIT line"))?;
    Ok(Boot {
        to_init: secs,
        kernel,
        out,
    })
}

/// This machine's QEMU (the bundle `testbed/build-guest.sh` copies in) with a direct kernel
/// boot of the test vmlinux and `initrd`, 2 vCPUs, 256 MiB, the serial console on stdout and
/// `vmhost.action=action` on the command line: the baseline of the emulated host's benchmarks.
pub fn qemu_command(a: &Assets, initrd: &Path, action: &str) -> Command {
    let q = &a.qemu;
    let mut c = Command::new(q.join("lib/ld-linux-x86-64.so.2"));
    c.arg("--library-path")
        .arg(q.join("lib"))
        .arg(q.join("qemu-system-x86_64"))
        .arg("-L")
        .arg(q.join("share"))
        .args(["-enable-kvm", "-cpu", "host", "-smp", "2", "-m", "256"])
        .args(["-nodefaults", "-no-user-config", "-display", "none"])
        .args(["-serial", "stdio", "-no-reboot", "-kernel"])
        .arg(&a.vmlinux)
        .arg("-initrd")
        .arg(initrd)
        .arg("-append")
        .arg(format!("{CMDLINE} vmhost.action={action}"));
    c
}

/// `CLOCK_MONOTONIC` now, in ns (vmhost's `--json` timeline is on the same clock).
pub(crate) fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for the duration of the call.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    u64::try_from(ts.tv_sec).unwrap_or(0) * 1_000_000_000 + u64::try_from(ts.tv_nsec).unwrap_or(0)
}

/// The steps of vmhost's start in its `--json` report's `timeline`: (key, name).
pub(crate) const PHASES: [(&str, &str); 7] = [
    ("main_ns", "main"),
    ("spec_loaded_ns", "spec+kernel checked"),
    ("host_discovered_ns", "host discovered"),
    ("admitted_ns", "admitted"),
    ("memory_ready_ns", "guest RAM ready"),
    ("vm_created_ns", "VM created, kernel loaded"),
    ("vcpus_runnable_ns", "vCPUs runnable"),
];

/// The JSON report at the end of `vmhost --json`'s stdout `out`
/// (from its first line that is `{`, the first line of the text or a later one).
pub(crate) fn json_report(out: &str) -> Result<serde_json::Value, String> {
    let start = if out.starts_with("{\n") {
        0
    } else {
        out.find("\n{\n")
            .ok_or("vmhost --json printed no JSON report")?
            + 1
    };
    serde_json::from_str(&out[start..]).map_err(|e| format!("vmhost --json report: {e}"))
}

/// Each of [`PHASES`] in `report`, milliseconds after `spawn` (ns on `CLOCK_MONOTONIC`).
pub(crate) fn phases_ms(report: &serde_json::Value, spawn: u64) -> Result<Vec<f64>, String> {
    PHASES
        .iter()
        .map(|(key, _)| {
            let ns = report["timeline"][key]
                .as_u64()
                .ok_or_else(|| format!("vmhost --json: no timeline.{key}"))?;
            Ok(ns.saturating_sub(spawn) as f64 / 1e6)
        })
        .collect()
}

/// One more vmhost boot with `--json`: where its time from the spawn to the guest's `/init`
/// goes, step by step (milliseconds after the spawn, on `CLOCK_MONOTONIC`).
fn vmhost_phases(mut cmd: Command) -> Result<String, String> {
    cmd.arg("--json");
    let spawn = monotonic_ns();
    let b = time_to_init(cmd, "vmhost --json")?;
    let report = json_report(&b.out)?;
    let mut line = String::new();
    for ((_, name), ms) in PHASES.iter().zip(phases_ms(&report, spawn)?) {
        line.push_str(&format!("{name} {ms:.0}, "));
    }
    let marker = report["report"]["boot"]["markers"][0]["monotonic_ns"]
        .as_u64()
        .ok_or("vmhost --json: no report.boot.markers[0].monotonic_ns")?;
    line.push_str(&format!(
        "/init's port-0x80 marker {:.0}, GUEST-INIT line {:.0}",
        marker.saturating_sub(spawn) as f64 / 1e6,
        b.to_init * 1e3
    ));
    Ok(line)
}

/// The number right after `key` in `text`.
pub fn after(text: &str, key: &str) -> Option<f64> {
    let rest = text.split(key).nth(1)?;
    let end = rest
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Writes off the emulated host's stale code translations before a boot. The emulated host is
/// QEMU TCG: the first writes to a page it translated code from (here: the previous guest's
/// kernel) take a slow path that throws the translations away, so zeroing the memory of a new
/// guest costs 5-10x more right after a Linux guest ran in it (docs/benchmarks.md). This
/// faults in and releases the VM's hugepages from the pool (`vmhost memory`, the pages vmhost
/// gets next) and 1 GiB of anonymous memory (freed pages QEMU's guest is likely to get next),
/// so the boot after it pays what it would on a host without that emulator cost.
fn scrub(a: &Assets, env: &Env, spec: &Path) -> Result<(), String> {
    let mut memory = Command::new(&a.vmhost_release);
    memory
        .arg("--run-dir")
        .arg(&env.run_dir)
        .arg("--config")
        .arg(spec)
        .arg("memory");
    let out = crate::vm::run_command(memory, "vmhost memory")?;
    ensure!(
        out.code == 0,
        "vmhost memory: exit {}: {}",
        out.code,
        out.stderr
    );
    let mut anon = vec![0u8; 1 << 30];
    for page in anon.chunks_mut(4096) {
        page[0] = 1;
    }
    std::hint::black_box(&anon);
    Ok(())
}

/// The guest's assets ([`assets`]), failing when the benchmarks' QEMU or release vmhost is
/// missing (`testbed/run.sh bench` copies them in).
pub(crate) fn bench_assets(env: &Env) -> Result<Assets, String> {
    let a = assets(env)?;
    for p in [&a.qemu, &a.vmhost_release] {
        ensure!(
            p.exists(),
            "benchmark asset {} missing (testbed/run.sh bench copies it)",
            p.display()
        );
    }
    Ok(a)
}

/// What every boot of the benchmark needs: the assets, the environment and vmhost's spec.
struct Bench<'a> {
    a: Assets,
    env: &'a Env,
    spec: PathBuf,
}

impl Bench<'_> {
    /// The release vmhost booting the spec with `--prefault prefault`.
    fn vmhost(&self, prefault: &str) -> Command {
        let mut c = Command::new(&self.a.vmhost_release);
        c.arg("--run-dir")
            .arg(&self.env.run_dir)
            .args(["--prefault", prefault, "--config"])
            .arg(&self.spec);
        c
    }

    /// QEMU booting the same guest to its power-off.
    fn qemu(&self) -> Command {
        qemu_command(&self.a, &self.a.initrd, "poweroff")
    }
}

/// The benchmark's assets, its 2 MiB pool on node 0 and vmhost's spec (2 vCPUs, 256 MiB).
fn bench(env: &Env) -> Result<Bench<'_>, String> {
    let a = bench_assets(env)?;
    host::set_2m_pools(&[128, 0])?;
    let spec = env.spec(
        "linbench",
        &linux_spec(
            "linbench",
            (1, 2),
            "",
            "256Mi",
            &a.vmlinux,
            &a.initrd,
            "poweroff",
        ),
    )?;
    Ok(Bench { a, env, spec })
}

/// The timed runs' seconds: spawn → `/init` of vmhost (`vm`), vmhost with background prefault
/// (`bg`) and QEMU (`qm`); the guest kernel's uptime at `/init` under vmhost (`vk`) and QEMU
/// (`qk`); vmhost's port-0x80 marker after its run start (`marker`).
#[derive(Default)]
struct Timed {
    vm: Vec<f64>,
    bg: Vec<f64>,
    qm: Vec<f64>,
    vk: Vec<f64>,
    qk: Vec<f64>,
    marker: Vec<f64>,
}

/// [`RUNS`] rounds of vmhost, vmhost with background prefault and QEMU, in that order.
fn timed_runs(b: &Bench) -> Result<Timed, String> {
    let mut t = Timed::default();
    for _ in 0..RUNS {
        let run = time_to_init(b.vmhost("before-start"), "vmhost")?;
        // vmhost's own timestamp of the guest's debug-port marker, on the run's clock.
        t.marker.extend(after(&run.out, "user space at "));
        t.vm.push(run.to_init);
        t.vk.push(run.kernel);
        let run = time_to_init(b.vmhost("background"), "vmhost --prefault background")?;
        ensure!(
            run.out.contains("guest RAM prefaulted in the background"),
            "vmhost --prefault background did not report its prefault"
        );
        t.bg.push(run.to_init);
        let run = time_to_init(b.qemu(), "qemu")?;
        t.qm.push(run.to_init);
        t.qk.push(run.kernel);
    }
    Ok(t)
}

/// The same pairs again, each boot after [`scrub`]: (vmhost's, QEMU's) seconds to `/init`.
fn scrubbed_runs(b: &Bench) -> Result<(Vec<f64>, Vec<f64>), String> {
    let (mut vs, mut qs) = (Vec::new(), Vec::new());
    for _ in 0..RUNS {
        scrub(&b.a, b.env, &b.spec)?;
        vs.push(time_to_init(b.vmhost("before-start"), "vmhost after a scrub")?.to_init);
        scrub(&b.a, b.env, &b.spec)?;
        qs.push(time_to_init(b.qemu(), "qemu after a scrub")?.to_init);
    }
    Ok((vs, qs))
}

/// Prints the medians, the ratios, vmhost's `--json` phases, the scrubbed pairs and the target.
fn print_boot_times(t: Timed, phases: &str, scrubbed: (Vec<f64>, Vec<f64>)) {
    let Timed {
        mut vm,
        mut bg,
        mut qm,
        mut vk,
        mut qk,
        mut marker,
    } = t;
    let (mut vs, mut qs) = scrubbed;
    // Each vmhost run next to the QEMU run right after it: the machine's load drifts slowly.
    let paired: Vec<f64> = vm.iter().zip(&qm).map(|(v, q)| v / q).collect();
    let (v, q) = (median(&mut vm), median(&mut qm));
    let ratio = v / q;
    let b = median(&mut bg);
    let bg_ratio = b / q;
    println!(
        "     boot to /init (spawn -> GUEST-INIT, median of {RUNS}): vmhost {v:.2} s {vm:.2?}, \
         QEMU {q:.2} s {qm:.2?}, ratio {ratio:.2}; guest kernel uptime at /init: vmhost {:.2} s, \
         QEMU {:.2} s; vmhost's port-0x80 marker {:.2} s after its run start; per-pair ratios \
         {paired:.2?} (median {:.2})",
        median(&mut vk),
        median(&mut qk),
        median(&mut marker),
        median(&mut paired.clone())
    );
    println!("     with --prefault background: vmhost {b:.2} s {bg:.2?}, ratio {bg_ratio:.2}");
    println!("     one more vmhost run with --json, ms after the spawn: {phases}");
    let (sv, sq) = (median(&mut vs), median(&mut qs));
    println!(
        "     each boot after a scrub of the emulator's stale translations (not the target's \
         figure): vmhost {sv:.2} s {vs:.2?}, QEMU {sq:.2} s {qs:.2?}, ratio {:.2}",
        sv / sq
    );
    let met = |r: f64| {
        if r.total_cmp(&TARGET_RATIO).is_le() {
            "met"
        } else {
            "not met"
        }
    };
    println!(
        "     target vmhost <= {TARGET_RATIO} x QEMU: {} (before-start), {} (background)",
        met(ratio),
        met(bg_ratio)
    );
}

/// Times vmhost and QEMU from spawn to the guest's `/init`, same kernel, initramfs, vCPUs and
/// memory, in the same emulated host; prints both, the ratio and the 0.8 target.
pub fn boot_time_vs_qemu(env: &Env) -> Outcome {
    let b = bench(env)?;
    let timed = timed_runs(&b)?;
    // After the timed runs, so that its phases are those of a boot like them (see `scrub`).
    let phases = vmhost_phases(b.vmhost("before-start"))?;
    // The same pairs again, each boot after `scrub`: informational, not the target's figure.
    let scrubbed = scrubbed_runs(&b)?;
    ensure!(
        timed.marker.len() == RUNS,
        "vmhost reported the guest's user-space marker in {} of {RUNS} runs",
        timed.marker.len()
    );
    print_boot_times(timed, &phases, scrubbed);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::json_report;

    #[test]
    fn the_report_is_found_after_console_lines_or_at_the_start() {
        let report = "{\n  \"timeline\": {\"main_ns\": 7}\n}\n";
        for out in [
            report.to_string(),
            format!("GUEST-INIT uptime=1.0\n{report}"),
        ] {
            let v = json_report(&out).expect("the report");
            assert_eq!(v["timeline"]["main_ns"], 7, "{out}");
        }
        assert!(json_report("no report here\n").is_err());
    }
}
