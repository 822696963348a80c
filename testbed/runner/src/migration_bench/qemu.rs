//! The migration benchmark's QEMU side: QEMU with the same guest on 2 MiB hugepages bound to a
//! node ([`qemu_command`]), a QMP connection, and one migration of a freshly booted guest to
//! an `-incoming` target, timed by its beats and by `query-migrate` ([`qemu_run`]).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::process::{gap_edges, longest_gap, pause_in_place, Proc};
use super::{
    field, Sample, Setup, AFTER_BEATS, BOOT_LIMIT, GUEST_PAGES, JOB_LIMIT, MAX_DOWNTIME_MS,
    QEMU_BANDWIDTH, WARM_BEATS,
};
use crate::ensure;
use crate::linux_tests::{Assets, CMDLINE};

/// QEMU (the bundle of `testbed/build-guest.sh`) with the same kernel, initramfs and command
/// line, 1 vCPU and 128 MiB of 2 MiB hugepages bound to `node` (`prealloc` as vmhost's
/// `--prefault before-start` on the source; the target faults pages in as they arrive, as
/// vmhost's target prefaults after the hello, inside the migration's time).
fn qemu_command(a: &Assets, action: &str, node: u32, prealloc: bool) -> Command {
    let q = &a.qemu;
    let mut c = Command::new(q.join("lib/ld-linux-x86-64.so.2"));
    let mib = GUEST_PAGES * 2;
    c.arg("--library-path")
        .arg(q.join("lib"))
        .arg(q.join("qemu-system-x86_64"))
        .arg("-L")
        .arg(q.join("share"))
        .args([
            "-enable-kvm",
            "-cpu",
            "host",
            "-smp",
            "1",
            "-m",
            &format!("{mib}M"),
        ])
        .arg("-object")
        .arg(format!(
            "memory-backend-memfd,id=ram0,size={mib}M,hugetlb=on,hugetlbsize=2M,\
             host-nodes={node},policy=bind,prealloc={}",
            if prealloc { "on" } else { "off" }
        ))
        .args(["-machine", "memory-backend=ram0"])
        .args(["-nodefaults", "-no-user-config", "-display", "none"])
        .args(["-serial", "stdio", "-no-reboot", "-kernel"])
        .arg(&a.vmlinux)
        .arg("-initrd")
        .arg(&a.initrd)
        .arg("-append")
        .arg(format!("{CMDLINE} vmhost.action={action}"));
    c
}

/// A QMP connection (capabilities negotiated).
struct Qmp {
    out: UnixStream,
    inp: BufReader<UnixStream>,
}

impl Qmp {
    /// Connects to QEMU's QMP socket `path` (waiting for it to appear) and leaves the
    /// capabilities negotiation mode.
    fn connect(path: &Path) -> Result<Qmp, String> {
        let deadline = Instant::now() + JOB_LIMIT;
        let out = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e) if Instant::now() > deadline => {
                    return Err(format!("QMP {}: {e}", path.display()))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        };
        out.set_read_timeout(Some(JOB_LIMIT))
            .map_err(|e| e.to_string())?;
        let inp = BufReader::new(out.try_clone().map_err(|e| e.to_string())?);
        let mut q = Qmp { out, inp };
        let greeting = q.read()?;
        ensure!(greeting.get("QMP").is_some(), "QMP greeting: {greeting}");
        q.call("qmp_capabilities", json!({}))?;
        Ok(q)
    }

    /// The next message that is not an event.
    fn read(&mut self) -> Result<Value, String> {
        loop {
            let mut line = String::new();
            let n = self
                .inp
                .read_line(&mut line)
                .map_err(|e| format!("QMP read: {e}"))?;
            ensure!(n > 0, "QMP: QEMU closed the connection");
            let v: Value = serde_json::from_str(&line).map_err(|e| format!("QMP {line:?}: {e}"))?;
            if v.get("event").is_none() {
                return Ok(v);
            }
        }
    }

    /// Executes `cmd` with `args`; its `return` value, or its error.
    fn call(&mut self, cmd: &str, args: Value) -> Result<Value, String> {
        let msg = json!({"execute": cmd, "arguments": args});
        writeln!(self.out, "{msg}").map_err(|e| format!("QMP write: {e}"))?;
        let answer = self.read()?;
        answer
            .get("return")
            .cloned()
            .ok_or_else(|| format!("QMP {cmd}: {answer}"))
    }
}

/// Sets the downtime limit and bandwidth, starts the migration to `to` and polls
/// `query-migrate` every 10 ms until it ends; its last answer.
fn qmp_migrate(qmp: &mut Qmp, to: &str) -> Result<Value, String> {
    qmp.call(
        "migrate-set-parameters",
        json!({"downtime-limit": MAX_DOWNTIME_MS, "max-bandwidth": QEMU_BANDWIDTH}),
    )?;
    qmp.call("migrate", json!({"uri": to}))?;
    let deadline = Instant::now() + JOB_LIMIT;
    loop {
        let q = qmp.call("query-migrate", json!({}))?;
        match q["status"].as_str() {
            // QEMU 7.2 sets the status before `total-time` and `downtime` (they read 0 for a
            // moment): the figures are those of the first answer that has them.
            Some("completed") if q["total-time"].as_u64().unwrap_or(0) > 0 => return Ok(q),
            Some("failed" | "cancelled") => return Err(format!("QEMU's migration: {q}")),
            _ => {}
        }
        ensure!(
            Instant::now() < deadline,
            "QEMU's migration: not done within {JOB_LIMIT:?}: {q}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// One QEMU migration of a freshly booted guest doing `action`: source → `-incoming`.
pub(super) fn qemu_run(s: &Setup, action: &str) -> Result<Sample, String> {
    // Paths of their own per run: a QEMU of an earlier run that unlinks its sockets as it
    // ends can never take this run's (one run found its QMP socket gone).
    static RUN: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let run = RUN.fetch_add(1, Ordering::Relaxed);
    let qmp_path = s.env.work.join(format!("qemu-src-{run}.qmp"));
    let listen = s.env.work.join(format!("qemu-mig-{run}.listen"));
    for p in [&qmp_path, &listen] {
        let _ = std::fs::remove_file(p);
    }
    let mut cmd = qemu_command(&s.a, action, 0, true);
    cmd.arg("-qmp")
        .arg(format!("unix:{},server=on,wait=off", qmp_path.display()));
    let mut src = Proc::spawn(cmd, s.env, "qemu source")?;
    src.wait_beats(WARM_BEATS, BOOT_LIMIT)?;
    let mut qmp = Qmp::connect(&qmp_path)?;
    let in_place = pause_in_place(&mut src, || {
        qmp.call("stop", json!({}))?;
        qmp.call("cont", json!({})).map(|_| ())
    })?;
    println!("       QEMU: {in_place}");
    let to = format!("unix:{}", listen.display());
    let mut cmd = qemu_command(&s.a, action, 1, false);
    cmd.args(["-incoming", &to]);
    let mut dst = Proc::spawn(cmd, s.env, "qemu target")?;
    let deadline = Instant::now() + JOB_LIMIT;
    while !listen.exists() {
        ensure!(
            Instant::now() < deadline,
            "QEMU's -incoming socket never appeared; {}",
            dst.tail()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let t0 = Instant::now();
    let q =
        qmp_migrate(&mut qmp, &to).map_err(|e| format!("{e}; {}; {}", src.tail(), dst.tail()))?;
    let t1 = Instant::now();
    dst.wait_beats(AFTER_BEATS, JOB_LIMIT)?;
    let (src_beats, dst_beats) = (src.beats(), dst.beats());
    println!(
        "       QEMU: the gap: {}; query-migrate: total {} ms, downtime {} ms",
        gap_edges(&src_beats, &dst_beats, t0),
        q["total-time"],
        q["downtime"]
    );
    let mut beats = src_beats;
    beats.extend(dst_beats);
    let gap_ms = longest_gap(beats, t0, t1)?;
    let _ = qmp.call("quit", json!({}));
    let code = src.wait_exit(JOB_LIMIT)?;
    ensure!(
        code.success(),
        "QEMU's source after quit: {code}; {}",
        src.tail()
    );
    dst.stop()?;
    Ok(Sample {
        gap_ms,
        own_downtime_ms: field(&q, "/downtime")?,
        total_s: field(&q, "/total-time")? / 1e3,
        bytes: field(&q, "/ram/transferred")?,
        rounds: field(&q, "/ram/dirty-sync-count")?,
        gave_up: None,
    })
}
