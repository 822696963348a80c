//! A guest that writes an invalid `QueueNum` to its virtio device over and over, run by the
//! real `vmhost` binary with stderr a pipe the test does not read while the VM runs: vmhost's
//! diagnostics stay bounded, no vCPU blocks on stderr, and SIGTERM still ends the VM in order
//! (exit 130) with its last lines on stderr: the device's count of the warnings its log
//! budget refused, written at teardown and flushed before vmhost exits.
//!
//! A second guest floods the diagnostics on purpose (`VMHOST_LOG=vmhost_devices=debug`, one
//! debug line per write to its device's read-only configuration space): the lines that do not
//! fit are dropped and counted, the vCPU still never blocks, and the count reaches stderr.
//!
//! Before the fix every bad write was one `ERROR virtio queue with invalid size` line from
//! virtio-queue, written synchronously by the vCPU thread under the transport lock: once the
//! 64 KiB pipe was full the vCPU stalled for good, the guest never reached its end marker, and
//! the watchdog below killed vmhost and failed the test.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vmhost_devices::mmio::{DEVICE_LOG_BURST, DEVICE_LOG_WINDOW};
use vmhost_testsupport::pvh::{out8, pvh_elf};
use vmhost_testsupport::{lock_cpus, need_kvm};

/// The first virtio-mmio window (the rng device's).
const MMIO_BASE: u32 = 0xd000_0000;
/// Bad `QueueNum` writes without a reset in between.
const BAD_WRITES: u32 = 20_000;
/// Reset → negotiate → bad `QueueNum` cycles.
const RESET_CYCLES: u32 = 2_000;
/// The guest's last words on COM1 (stdout), after all its bad writes.
const MARKER: &str = "QUEUE-NUM-LOOP-DONE";
/// Bounds on waiting for events that never come on the old code: watchdogs against a hang,
/// never measurements.
const WATCHDOG: Duration = Duration::from_secs(300);

/// `mov dword [MMIO_BASE + reg], value` (32-bit protected mode, flat segments: PVH entry).
fn mmio_write(reg: u32, value: u32) -> Vec<u8> {
    let mut code = vec![0xc7, 0x05];
    code.extend_from_slice(&(MMIO_BASE + reg).to_le_bytes());
    code.extend_from_slice(&value.to_le_bytes());
    code
}

/// ACKNOWLEDGE, DRIVER, VIRTIO_F_VERSION_1 (feature bit 32), FEATURES_OK, queue 0 selected:
/// from here on the queue registers are writable.
fn negotiate() -> Vec<u8> {
    let mut code = Vec::new();
    for (reg, value) in [
        (0x70, 1),
        (0x70, 3),
        (0x24, 1),
        (0x20, 1),
        (0x70, 0xb),
        (0x30, 0),
    ] {
        code.extend(mmio_write(reg, value));
    }
    code
}

/// `mov ecx, count; body; dec ecx; jnz body`.
fn repeat(count: u32, body: &[u8]) -> Vec<u8> {
    let mut code = vec![0xb9];
    code.extend_from_slice(&count.to_le_bytes());
    code.extend_from_slice(body);
    code.push(0x49); // dec ecx
    let back = i8::try_from(body.len() + 3)
        .map(|n| -n)
        .expect("a short loop body");
    code.extend_from_slice(&[0x75, back.to_le_bytes()[0]]);
    code
}

/// The `suppressed=N` count of a rate-limit line.
fn suppressed(line: &str) -> Option<u64> {
    let rest = line.split("suppressed=").nth(1)?;
    rest.split_whitespace().next()?.parse().ok()
}

fn guest() -> Vec<u8> {
    // QueueNum 3: not a power of two.
    let bad = mmio_write(0x38, 3);
    let mut code = negotiate();
    code.extend(repeat(BAD_WRITES, &bad));
    let mut cycle = mmio_write(0x70, 0); // reset
    cycle.extend(negotiate());
    cycle.extend(&bad);
    code.extend(repeat(RESET_CYCLES, &cycle));
    for b in MARKER.bytes().chain(*b"\n") {
        code.extend(out8(0x3f8, b));
    }
    code.extend_from_slice(&[0xf4, 0xeb, 0xfd]); // hlt; jmp hlt
    code
}

/// What the stdout reader saw: the guest's end marker, then the final report.
#[derive(Debug, PartialEq, Eq)]
enum Seen {
    Marker,
    Report,
}

/// A running vmhost: stderr a pipe nobody reads yet, stdout read by a thread that reports
/// [`Seen`] events and returns all of stdout.
struct Run {
    child: Child,
    seen: mpsc::Receiver<Seen>,
    stdout: JoinHandle<String>,
    dir: PathBuf,
}

fn start(name: &str, code: &[u8], log: Option<&str>) -> Run {
    let dir = std::env::temp_dir().join(format!("vmhost-logvolume-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("kernel.elf"), pvh_elf(code)).unwrap();
    let spec = dir.join("vm.toml");
    std::fs::write(
        &spec,
        "name = \"badqueue\"\n[cpu]\ncores = 1\n[memory]\nguest = \"64Mi\"\n[devices.rng]\n\
         [boot]\nkernel = \"kernel.elf\"\n",
    )
    .unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_vmhost"));
    cmd.args(["--run-dir", dir.join("run").to_str().unwrap()])
        .args(["--config", spec.to_str().unwrap()])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        // A pipe (64 KiB) nobody reads for now.
        .stderr(Stdio::piped())
        .env_remove("VMHOST_LOG");
    if let Some(directive) = log {
        cmd.env("VMHOST_LOG", directive);
    }
    let mut child = cmd.spawn().unwrap();
    let (tx, seen) = mpsc::channel();
    let mut out = child.stdout.take().unwrap();
    let stdout = std::thread::spawn(move || {
        let mut all = Vec::new();
        let mut buf = [0u8; 4096];
        let mut next = Some(Seen::Marker);
        while let Ok(n @ 1..) = out.read(&mut buf) {
            all.extend_from_slice(&buf[..n]);
            let text = String::from_utf8_lossy(&all);
            next = match next {
                Some(Seen::Marker) if text.contains(MARKER) => {
                    let _ = tx.send(Seen::Marker);
                    Some(Seen::Report)
                }
                Some(Seen::Report) if text.contains("(exit code ") => {
                    let _ = tx.send(Seen::Report);
                    None
                }
                other => other,
            };
        }
        String::from_utf8_lossy(&all).into_owned()
    });
    Run {
        child,
        seen,
        stdout,
        dir,
    }
}

impl Run {
    /// Waits for `what` on stdout; kills vmhost and fails when it never comes.
    fn wait_for(&mut self, what: Seen, why: &str) {
        if self.seen.recv_timeout(WATCHDOG).ok() != Some(what) {
            let _ = self.child.kill();
            let _ = self.child.wait();
            panic!("{why}");
        }
    }

    fn sigterm(&self) {
        let pid = libc::pid_t::try_from(self.child.id()).unwrap();
        // SAFETY: kill(2) only sends SIGTERM to our child, which has not been reaped.
        let rc = unsafe { libc::kill(pid, libc::SIGTERM) };
        assert_eq!(rc, 0, "kill: {}", std::io::Error::last_os_error());
    }

    /// Waits for vmhost to exit; kills it and fails when it does not.
    fn exit_status(&mut self) -> ExitStatus {
        let deadline = Instant::now() + WATCHDOG;
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("vmhost did not end after SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// A thread reading all of stderr (without ANSI colours).
    fn read_stderr(&mut self) -> JoinHandle<String> {
        let mut err = self.child.stderr.take().unwrap();
        std::thread::spawn(move || {
            let mut text = String::new();
            err.read_to_string(&mut text).unwrap();
            common::plain(&text)
        })
    }
}

fn remove(dir: &Path) {
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_guest_looping_on_a_bad_queue_num_neither_floods_nor_blocks_unread_stderr() {
    let test = "a_guest_looping_on_a_bad_queue_num_neither_floods_nor_blocks_unread_stderr";
    if !need_kvm(test) {
        return;
    }
    let _cpus = lock_cpus();
    let started = Instant::now();
    let mut run = start("badqueue", &guest(), None);
    run.wait_for(
        Seen::Marker,
        "the guest never finished its bad QueueNum writes: vmhost's vCPU is blocked (on stderr?)",
    );
    let guest_done = started.elapsed();
    run.sigterm();
    // stderr is read only after vmhost has exited: everything it wrote fit in the pipe.
    let status = run.exit_status();
    let stderr = run.read_stderr().join().unwrap();
    let stdout = run.stdout.join().unwrap();
    println!("stderr ({} bytes):\n{stderr}", stderr.len());
    assert_eq!(
        status.code(),
        Some(130),
        "SIGTERM stops the VM in order\n{stderr}"
    );
    assert!(stdout.contains("(exit code 130)"), "the report:\n{stdout}");
    // virtio-queue never logged a guest value.
    assert!(
        !stderr.contains("virtio queue with invalid size"),
        "virtio-queue logged the guest's bad QueueNum:\n{stderr}"
    );
    // vmhost said what the guest did: once per reset (the first run of bad writes, then one
    // per cycle), within the device's log budget; what the budget refused is counted, and
    // every warning is either written or counted.
    let ignored = stderr.lines().filter(|l| l.contains("ignored")).count() as u64;
    let refused: u64 = stderr
        .lines()
        .filter(|l| l.contains("not logged (rate limit)"))
        .filter_map(suppressed)
        .sum();
    assert!(
        ignored >= 1,
        "the bad QueueNum was never reported:\n{stderr}"
    );
    assert_eq!(
        ignored + refused,
        1 + u64::from(RESET_CYCLES),
        "warnings written + refused\n{stderr}"
    );
    // The last line: the device's count of refused warnings, written when the VM was torn
    // down after SIGTERM and flushed before vmhost exited.
    let last = stderr.lines().last().unwrap_or_default();
    assert!(
        last.contains("virtio device warnings not logged (rate limit)")
            && suppressed(last) > Some(0),
        "the last line is the teardown count: {last:?}"
    );
    // Each window that opened while the guest ran allows DEVICE_LOG_BURST warnings and one
    // count of those refused: the bound follows from how long the guest ran.
    let windows = guest_done.as_secs() / DEVICE_LOG_WINDOW.as_secs() + 2;
    let bound = windows * u64::from(DEVICE_LOG_BURST + 1);
    let lines = stderr.lines().count() as u64;
    assert!(
        lines <= bound,
        "{lines} lines for {} bad writes, more than {bound}:\n{stderr}",
        BAD_WRITES + RESET_CYCLES
    );
    remove(&run.dir);
}

/// A read of nothing: one debug line per write, `virtio-mmio: configuration space is read-only`.
fn config_space_flood() -> Vec<u8> {
    let mut code = repeat(FLOOD_WRITES, &mmio_write(0x100, 0));
    for b in MARKER.bytes().chain(*b"\n") {
        code.extend(out8(0x3f8, b));
    }
    code.extend_from_slice(&[0xf4, 0xeb, 0xfd]); // hlt; jmp hlt
    code
}

/// Debug lines the flood asks for: far more than a pipe and the writer's buffer hold.
const FLOOD_WRITES: u32 = 50_000;

#[test]
fn debug_lines_flooding_an_unread_stderr_are_dropped_and_counted_not_waited_for() {
    let test = "debug_lines_flooding_an_unread_stderr_are_dropped_and_counted_not_waited_for";
    if !need_kvm(test) {
        return;
    }
    let _cpus = lock_cpus();
    let mut run = start(
        "flood",
        &config_space_flood(),
        Some("warn,vmhost_devices=debug"),
    );
    run.wait_for(
        Seen::Marker,
        "the guest never finished its writes: vmhost's vCPU is blocked on stderr",
    );
    run.sigterm();
    // The VM stops and reports while stderr is still full and unread.
    run.wait_for(
        Seen::Report,
        "vmhost never printed its report after SIGTERM",
    );
    // Only now is stderr read: the writer thread and the final count get through.
    let stderr = run.read_stderr();
    let status = run.exit_status();
    let stderr = stderr.join().unwrap();
    let _ = run.stdout.join();
    let lines = stderr.lines().count();
    println!("stderr: {} bytes, {lines} lines; the last 3:", stderr.len());
    for l in stderr.lines().skip(lines.saturating_sub(3)) {
        println!("{l}");
    }
    assert_eq!(status.code(), Some(130), "SIGTERM stops the VM in order");
    let written = stderr
        .lines()
        .filter(|l| l.contains("configuration space is read-only"))
        .count() as u64;
    let dropped: u64 = stderr
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("vmhost: ")?;
            let (n, tail) = rest.split_once(' ')?;
            tail.starts_with("diagnostic lines dropped")
                .then(|| n.parse::<u64>().ok())?
        })
        .sum();
    assert!(dropped > 0, "no count of dropped lines reached stderr");
    assert!(
        written > 0 && written < u64::from(FLOOD_WRITES),
        "{written} lines written"
    );
    // Every line the guest caused was written or counted as dropped, but for what the
    // writer held when the process ended (its chunk in flight and its buffer, 64 KiB each,
    // under 1,100 lines each).
    assert!(
        written + dropped + 2_200 >= u64::from(FLOOD_WRITES),
        "{written} written + {dropped} dropped"
    );
    remove(&run.dir);
}
