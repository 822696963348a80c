//! Live migration of a Linux guest between node pairs of the 4-node host (issue 22), with the
//! failure rules on the way.
//!
//! The guest: 2 sockets × 1 core, NUMA passthrough (two cells), 128 MiB of 2 MiB pages, an ext4
//! disk and a NIC. It runs `testbed/guest/migrate.sh`: a counter in memory, a line per tick
//! appended to a file on its disk and read back, 1 MiB of guest RAM rewritten and checked every
//! tick, its NUMA view compared with the first, and a TCP echo server. The source vmhost runs in
//! a pod-like cgroup with nodes 0–1 (PUs and memory), every target in one with nodes 2–3 (and
//! the way back in nodes 0–1 again). Both taps are put on one bridge that holds the host's
//! address, so one TCP connection from the host to the guest outlives the move.
//!
//! In order, on one guest:
//! 1. a target killed by the test hook when round 1 begins: `ctl migrate` fails, the source's
//!    guest goes on (its counter, its RAM check and its disk);
//! 2. a guest writing 128 MiB/s (`dirty 32 128`, started over TCP): pre-copy does not converge
//!    at `--max-downtime 1` and gives up after `--timeout 5`: `ctl migrate`
//!    fails naming it, the target exits non-zero with every page back in the pools and no
//!    ledger entry, and the guest goes on at the source (its writer's beats and its ticks);
//! 3. a peer with the wrong key: refused on both sides, the guest goes on, and the same
//!    listener then takes the migration with the right key;
//! 4. after the switch: the source exits 0 and every page it had is back in nodes 0–1's pools;
//!    the ledger holds one entry; the guest's boot id, counter (every tick once, in order, across
//!    both consoles), RAM check, disk file and NUMA view carry on; the TCP connection echoes;
//!    every page of the target is on its planned node (`numa_maps`) and every vCPU thread on its
//!    planned PU (`/proc/<pid>/task/*/status`), all in nodes 2–3;
//! 5. the way back with the source (now the target of step 4) killed by the test hook at round
//!    1: the new target exits non-zero and every pool is whole again.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::cgroup_tests::{command_in, make_pod_with};
use crate::dm_log::DmDevice;
use crate::host;
use crate::linux_tests::{assets, linux_spec, tail};
use crate::snapshot_tests::check_placement;
use crate::vm::{at, num, Env, Running};
use crate::{ensure, Outcome};

/// 2 MiB pages per guest cell (64 MiB): the pool of each node holds exactly one cell.
pub(crate) const CELL_PAGES: u64 = 32;
/// How long the guest may take to boot and report ready, and any later wait for a tick.
const GUEST_LIMIT: Duration = Duration::from_secs(150);
/// How long the guest's disk reader may take to make progress on the target.
const READER_LIMIT: Duration = Duration::from_secs(60);
/// The bridge both taps join, and the host's address on it (the guest is 10.0.2.15).
const BRIDGE: &str = "tbmigbr";
const HOST_IP: &str = "10.0.2.1/24";
const GUEST_ADDR: &str = "10.0.2.15:7000";
/// The guest's writer (`dirty 32 16` while a connection stays open; testbed/guest/migrate.sh).
const DIRTY_ADDR: &str = "10.0.2.15:7001";
/// The VM's name, in the spec and the ledger.
const VM: &str = "migvm";

/// One `GUEST-MIGTICK` line's fields.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Tick {
    pub(crate) n: u64,
    pub(crate) boot_id: String,
    lines: u64,
    whole: bool,
    mem_ok: bool,
    numa_same: bool,
    /// Passes of the guest's background disk reader so far.
    pub(crate) reads: u64,
    /// The guest kernel found no 8259 PIC (a split irqchip), when the line says.
    pub(crate) nopic: Option<bool>,
    /// Interrupts the guest counted on ttyS0.
    pub(crate) serial_irqs: u64,
}

/// Every whole `GUEST-MIGTICK` line of `text`, in order.
pub(crate) fn ticks(text: &str) -> Vec<Tick> {
    let whole = &text[..text.rfind('\n').map_or(0, |i| i + 1)];
    whole
        .lines()
        .filter_map(|l| l.trim_end_matches('\r').strip_prefix("GUEST-MIGTICK "))
        .filter_map(|l| {
            let f: std::collections::BTreeMap<&str, &str> = l
                .split_whitespace()
                .filter_map(|kv| kv.split_once('='))
                .collect();
            Some(Tick {
                n: f.get("n")?.parse().ok()?,
                boot_id: f.get("boot_id")?.to_string(),
                lines: f.get("lines")?.parse().ok()?,
                whole: *f.get("whole")? == "1",
                mem_ok: *f.get("mem_ok")? == "1",
                numa_same: *f.get("numa_same")? == "1",
                // Absent from older lines (the unit tests' shapes): none counted.
                reads: f.get("reads").and_then(|r| r.parse().ok()).unwrap_or(0),
                nopic: f.get("nopic").map(|v| *v == "1"),
                serial_irqs: f
                    .get("serial_irqs")
                    .and_then(|r| r.parse().ok())
                    .unwrap_or(0),
            })
        })
        .collect()
}

/// The consoles of the guest so far, in the order the guest ran on them.
pub(crate) fn console(env: &Env, names: &[&str]) -> String {
    names
        .iter()
        .map(|n| {
            // Lossy: a stray byte breaks its own line, not the whole console.
            let bytes = std::fs::read(env.work.join(format!("{n}.out"))).unwrap_or_default();
            guest_output(&String::from_utf8_lossy(&bytes)).to_owned()
        })
        .collect()
}

/// The guest's console in a vmhost's stdout, without vmhost's own lines: the plan and the
/// placement table it prints before the guest runs (leading lines that start with `VM ` or
/// two spaces) and the report it prints when the run ends (from its last `VM …` line that
/// counts serial bytes). A guest line the switch split (its start on the source, its end on
/// the target) is whole again when the two are put together; vmhost's lines around the
/// switch would otherwise cut it.
pub(crate) fn guest_output(text: &str) -> &str {
    let mut start = 0;
    for line in text.split_inclusive('\n') {
        if !line.ends_with('\n') || !(line.starts_with("VM ") || line.starts_with("  ")) {
            break;
        }
        start += line.len();
    }
    let rest = &text[start..];
    match rest.rfind("VM ") {
        Some(i)
            if rest[i..]
                .lines()
                .next()
                .is_some_and(|l| l.contains("serial bytes")) =>
        {
            &rest[..i]
        }
        _ => rest,
    }
}

/// Waits until the consoles `names` show a tick past `after`; returns the last tick. Every
/// tick must be whole: the disk file, the RAM check and the NUMA view.
pub(crate) fn wait_tick_past(env: &Env, names: &[&str], after: u64) -> Result<Tick, String> {
    let deadline = Instant::now() + GUEST_LIMIT;
    loop {
        let text = console(env, names);
        let all = ticks(&text);
        if let Some(bad) = all.iter().find(|t| !(t.whole && t.mem_ok && t.numa_same)) {
            return Err(format!(
                "the guest's own check failed: {bad:?}; {}",
                tail(&text)
            ));
        }
        if let Some(t) = all.last().filter(|t| t.n > after) {
            return Ok(t.clone());
        }
        ensure!(
            Instant::now() < deadline,
            "no GUEST-MIGTICK past n={after} within {GUEST_LIMIT:?} on {names:?}: {}\n--- \
             the guest's own stall report: {}\n--- every vmhost's threads (a vCPU halted in \
             KVM is a guest waiting; one in user space or on a futex is the VMM): {}",
            tail(&text),
            stall_report(&text),
            crate::diagnose::vmhost_threads()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// What the guest printed from its first `GUEST-MIGSTALL` line on (testbed/guest/migrate.sh:
/// interrupt counts, the disk's requests in flight, the UART's counters and the blocked
/// tasks), at most 120 lines and without its ticks; "none" when it printed no such line.
pub(crate) fn stall_report(text: &str) -> String {
    let lines: Vec<&str> = text
        .lines()
        .skip_while(|l| !l.contains("GUEST-MIGSTALL"))
        .filter(|l| !l.contains("GUEST-MIGTICK"))
        .take(120)
        .collect();
    if lines.is_empty() {
        "none".to_string()
    } else {
        lines.join(" | ")
    }
}

/// Waits for a line containing `what` in `<name>.err`.
pub(crate) fn wait_stderr(env: &Env, name: &str, what: &str, limit: Duration) -> Outcome {
    let path = env.work.join(format!("{name}.err"));
    let deadline = Instant::now() + limit;
    loop {
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        if text.contains(what) {
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "{name} printed no {what:?} within {limit:?}: {text}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The bridge with the host's address; removed on drop.
struct Bridge;

impl Bridge {
    fn create() -> Result<Self, String> {
        let _ = Command::new("ip").args(["link", "del", BRIDGE]).output();
        host::run_tool(&["ip", "link", "add", BRIDGE, "type", "bridge"])?;
        let b = Bridge;
        host::run_tool(&["ip", "addr", "add", HOST_IP, "dev", BRIDGE])?;
        host::run_tool(&["ip", "link", "set", BRIDGE, "up"])?;
        Ok(b)
    }

    /// Waits for a `vmhost*` tap that is on no bridge yet and puts it on this one (the
    /// kernel may give the target's tap the name the source's had).
    fn attach_new(&self) -> Result<String, String> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let tap = std::fs::read_dir("/sys/class/net")
                .map_err(|e| format!("/sys/class/net: {e}"))?
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .find(|n| {
                    n.starts_with("vmhost")
                        && !Path::new("/sys/class/net").join(n).join("master").exists()
                });
            if let Some(tap) = tap {
                host::run_tool(&["ip", "link", "set", &tap, "master", BRIDGE])?;
                host::run_tool(&["ip", "link", "set", &tap, "up"])?;
                return Ok(tap);
            }
            ensure!(
                Instant::now() < deadline,
                "no vmhost* tap off the bridge within 60 s"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Bridge {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["link", "del", BRIDGE]).output();
    }
}

/// One TCP connection from the host to the guest's echo server.
struct Echo {
    stream: TcpStream,
    reader: BufReader<TcpStream>,
}

impl Echo {
    fn connect() -> Result<Self, String> {
        let stream = connect_guest(GUEST_ADDR)?;
        let reader = BufReader::new(stream.try_clone().map_err(|e| e.to_string())?);
        Ok(Echo { stream, reader })
    }

    /// Sends a line and reads it back from the guest.
    fn round_trip(&mut self, what: &str) -> Outcome {
        let line = format!("{what} {}\n", std::process::id());
        self.stream
            .write_all(line.as_bytes())
            .map_err(|e| format!("send {what:?} to the guest: {e}"))?;
        let mut back = String::new();
        self.reader
            .read_line(&mut back)
            .map_err(|e| format!("the guest's echo of {what:?}: {e}"))?;
        ensure!(
            back == line,
            "the guest echoed {back:?} for {line:?} on the same TCP connection"
        );
        Ok(())
    }
}

/// A TCP connection to the guest's `addr` (its listener may still be starting: retried for
/// 60 s), reads waiting 60 s at most.
fn connect_guest(addr: &str) -> Result<TcpStream, String> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let to = addr.parse().map_err(|e| format!("{addr}: {e}"))?;
    let stream = loop {
        match TcpStream::connect_timeout(&to, Duration::from_secs(3)) {
            Ok(s) => break s,
            Err(e) if Instant::now() > deadline => {
                return Err(format!("connect to the guest's {addr}: {e}"))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(500)),
        }
    };
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .map_err(|e| e.to_string())?;
    Ok(stream)
}

/// The guest's writer, running while this connection is open: its beat lines (one per 10 ms
/// of guest time) are counted by a reader thread; closing the connection ends it (SIGPIPE).
struct Dirtier {
    stream: TcpStream,
    beats: Arc<AtomicU64>,
    reader: std::thread::JoinHandle<()>,
}

impl Dirtier {
    /// Connects and waits for the writer's `GUEST-DIRTY` line (its buffer is resident).
    fn start() -> Result<Self, String> {
        let stream = connect_guest(DIRTY_ADDR)?;
        let mut lines = BufReader::new(stream.try_clone().map_err(|e| e.to_string())?);
        let mut first = String::new();
        lines
            .read_line(&mut first)
            .map_err(|e| format!("the guest's writer: {e}"))?;
        ensure!(
            first.starts_with("GUEST-DIRTY buf_mib=32 rate_mib_s=128 "),
            "the guest's writer said {first:?}"
        );
        let beats = Arc::new(AtomicU64::new(0));
        let counted = Arc::clone(&beats);
        let reader = std::thread::spawn(move || {
            for line in lines.lines() {
                match line {
                    Ok(l) if l.starts_with("B ") => {
                        counted.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(_) => {}
                    Err(_) => break,
                }
            }
        });
        Ok(Dirtier {
            stream,
            beats,
            reader,
        })
    }

    /// Waits until `more` beats past `from` arrived: the writer runs.
    fn wait_beats(&self, from: u64, more: u64) -> Outcome {
        let deadline = Instant::now() + GUEST_LIMIT;
        while self.beats.load(Ordering::Relaxed) < from + more {
            ensure!(
                Instant::now() < deadline && !self.reader.is_finished(),
                "the guest's writer stopped at {} beats (waited for {})",
                self.beats.load(Ordering::Relaxed),
                from + more
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(())
    }

    /// Closes the connection: the writer's next beat gets SIGPIPE.
    fn stop(self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        let _ = self.reader.join();
    }
}

/// A 0600 key file of 48 bytes of `byte`.
pub(crate) fn key_file(env: &Env, name: &str, byte: u8) -> Result<String, String> {
    let p = env.work.join(name);
    std::fs::write(&p, [byte; 48]).map_err(|e| format!("{}: {e}", p.display()))?;
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| e.to_string())?;
    Ok(p.to_string_lossy().into_owned())
}

/// A copy in `/tmp` of the share's empty 32 MiB ext4 image (testbed/build-disks.sh: the
/// emulated host has no mkfs), for the guest's log.
pub(crate) fn make_disk(env: &Env) -> Result<PathBuf, String> {
    make_disk_in(env, &env.work)
}

/// [`make_disk`] in `dir` (the common share of two emulated hosts: `xhost_tests`).
pub(crate) fn make_disk_in(env: &Env, dir: &Path) -> Result<PathBuf, String> {
    assets(env)?; // copies the share's guest directory, the image with it, to /tmp
    let from = env.work.join("guest/virtio/empty.ext4");
    let p = dir.join("migdisk.ext4");
    std::fs::copy(&from, &p)
        .map_err(|e| format!("copy {} to {}: {e}", from.display(), p.display()))?;
    Ok(p)
}

/// The guest's spec: 2 cells passthrough, 128 MiB of 2 MiB pages, the log disk and a NIC.
pub(crate) fn spec(env: &Env, disk: &Path) -> Result<PathBuf, String> {
    spec_with(
        env,
        disk,
        (2, 1),
        "numa = { guest_mapping_passthrough = true }",
        "",
    )
}

/// [`spec`] with `sockets` × `cores` vCPUs, `extra_cpu` in `[cpu]` and `boot_extra` in
/// `[boot]` (`pci_tests`: one cell, `virtio_announce = "pci"`).
pub(crate) fn spec_with(
    env: &Env,
    disk: &Path,
    shape: (u32, u32),
    extra_cpu: &str,
    boot_extra: &str,
) -> Result<PathBuf, String> {
    let a = assets(env)?;
    let initrd = env.work.join("guest/initramfs-devices.cpio");
    let base = linux_spec(
        VM, shape, extra_cpu, "128Mi", &a.vmlinux, &initrd, "migrate",
    ) + boot_extra;
    let devices = format!(
        "[[devices.disks]]\nname = \"log\"\n[[volumes]]\nname = \"log\"\n\
         host_disk = {{ path = \"{}\", type = \"Disk\" }}\n\
         [[devices.interfaces]]\nname = \"default\"\nbridge = {{}}\n\
         mac_address = \"02:00:00:00:22:01\"\n[[networks]]\nname = \"default\"\npod = {{}}\n",
        disk.display()
    );
    env.spec(VM, &format!("{base}{devices}"))
}

/// The PUs of `nodes`, and a pod-like cgroup `name` confined to them and their memory.
pub(crate) fn pod(env: &Env, name: &str, nodes: [u32; 2]) -> Result<PathBuf, String> {
    let mut cpus = host::node_cpus(nodes[0])?;
    cpus.extend(host::node_cpus(nodes[1])?);
    make_pod_with(env, name, &cpus, &format!("{}-{}", nodes[0], nodes[1]))
}

/// `vmhost receive` in `pod`, listening on `listen`; waits for its "listening on" line.
pub(crate) fn receive(
    env: &Env,
    name: &str,
    pod: &Path,
    listen: &str,
    key: &str,
    hook: Option<&str>,
) -> Result<Running, String> {
    let args = ["receive", "--listen", listen, "--auth-key", key];
    let mut cmd = command_in(env, pod, &args);
    if let Some(h) = hook {
        cmd.env("VMHOST_TEST_MIGRATION_FAIL_AT", h);
    }
    let r = env.spawn(name, cmd)?;
    wait_stderr(env, name, "listening on", Duration::from_secs(60))?;
    Ok(r)
}

/// The longest one `ctl migrate` may take (a debug vmhost in the emulated host).
pub(crate) const MIGRATE_LIMIT: Duration = Duration::from_secs(400);
/// `--max-downtime` of these migrations, ms. The emulated host moves a few MB/s (every
/// record's tag runs in emulated software, and a debug vmhost copies), so a Linux guest's few MB of dirty pages per round never fit the
/// default 300 ms here. This test proves what arrives and where; the benchmark
/// (`make bench-testbed`, docs/benchmarks.md) measures downtime against QEMU's.
const MAX_DOWNTIME_MS: &str = "5000";

/// `vmhost ctl --json migrate` of the VM at `from` to `to` with `key`. A failure to finish
/// names the source's and every target's last lines.
pub(crate) fn migrate(
    env: &Env,
    from: &Running,
    to: &str,
    key: &str,
) -> Result<crate::vm::Output, String> {
    migrate_with(env, from, to, key, &["--max-downtime", MAX_DOWNTIME_MS])
}

/// [`migrate`] with the options `extra` instead of this test's `--max-downtime`.
fn migrate_with(
    env: &Env,
    from: &Running,
    to: &str,
    key: &str,
    extra: &[&str],
) -> Result<crate::vm::Output, String> {
    let sock = from.socket.to_string_lossy().to_string();
    let mut args = vec![
        "ctl",
        "--api-socket",
        &sock,
        "--json",
        "migrate",
        to,
        "--auth-key",
        key,
    ];
    args.extend_from_slice(extra);
    let what = format!("vmhost {}", args.join(" "));
    let out = crate::vm::run_command_for(env.command(&args), &what, MIGRATE_LIMIT);
    out.map_err(|e| format!("{e}{}", side_logs(env, from)))
}

/// The job report `ctl --json migrate` printed; when there is none, why: the last lines of
/// every vmhost of this test, the source's API socket and the source VMM's threads.
fn job_of(env: &Env, from: &Running, out: &crate::vm::Output) -> Result<Value, String> {
    out.json()
        .map_err(|e| format!("{e}{}", side_logs(env, from)))
}

/// The stderr tails of the source and the targets, whether the source's API socket is there,
/// and the source VMM's threads with their states.
fn side_logs(env: &Env, from: &Running) -> String {
    let mut s = String::new();
    let names = std::fs::read_dir(&env.work)
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str().map(str::to_string))
                .filter(|n| n.starts_with("mig") && n.ends_with(".err"))
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    for n in names {
        let t = std::fs::read_to_string(env.work.join(&n)).unwrap_or_default();
        s.push_str(&format!("\n--- {n}:\n{}", tail(&t)));
    }
    let socket = match std::fs::symlink_metadata(&from.socket) {
        Ok(m) => format!("{:?}", m.file_type()),
        Err(e) => e.to_string(),
    };
    s.push_str(&format!("\n--- {}: {socket}", from.socket.display()));
    // The source's console and vmhost's own lines on it (a VM that ended prints why).
    let out = std::fs::read(env.work.join("migsrc.out")).unwrap_or_default();
    s.push_str(&format!(
        "\n--- migsrc.out:\n{}",
        tail(&String::from_utf8_lossy(&out))
    ));
    let tasks = crate::diagnose::threads(from.vmm);
    s.push_str(&format!("\n--- source VMM {} threads: {tasks}", from.vmm));
    if std::fs::symlink_metadata(&from.socket).is_err() {
        s.push_str(&source_end(env, from));
    }
    s
}

/// A source whose API socket went away is ending: once it has, its exit status, its stderr
/// (a stop signal names its sender there) and the end of its stdout (the report: the run's
/// status and each vCPU's outcome), the guest's tick lines left out.
fn source_end(env: &Env, from: &Running) -> String {
    let end = env
        .wait(from.pid)
        .map_or_else(|e| e, |code| format!("exit {code}"));
    let err = std::fs::read_to_string(env.work.join("migsrc.err")).unwrap_or_default();
    let out = std::fs::read(env.work.join("migsrc.out")).unwrap_or_default();
    let out = String::from_utf8_lossy(&out);
    let report: Vec<&str> = out
        .lines()
        .filter(|l| !l.contains("GUEST-MIGTICK"))
        .collect();
    format!(
        "\n--- the source ended: {end}; its stderr:\n{}\n--- the end of its stdout:\n{}",
        last_lines(&err, 20),
        report[report.len().saturating_sub(40)..].join("\n")
    )
}

fn last_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Free 2 MiB pages of every node.
pub(crate) fn free() -> Result<Vec<u64>, String> {
    host::free_per_node(2048)
}

/// The names of the ledger's live entries (`vmhost ps --json`).
pub(crate) fn ledger_names(env: &Env) -> Result<Vec<String>, String> {
    let v = env.run(&["ps", "--json"])?.expect_code(0)?.json()?;
    Ok(v["entries"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| e["liveness"] == "alive")
        .map(|e| e["entry"]["name"].as_str().unwrap_or("").to_string())
        .collect())
}

/// Step 1: the target killed at round 1; the source's guest goes on.
fn target_killed(env: &Env, src: &Running, pod_b: &Path, key: &str) -> Outcome {
    let listen = format!("unix:{}", env.work.join("mig-a.sock").display());
    let dst = receive(env, "migdst-a", pod_b, &listen, key, Some("round:1:target"))?;
    let before = free()?;
    let out = migrate(env, src, &listen, key)?;
    ensure!(
        out.code == 1 && job_of(env, src, &out)?["state"] == "failed",
        "ctl migrate to a target killed at round 1: exit {}, {}",
        out.code,
        out.stdout
    );
    let code = env.wait(dst.pid)?;
    ensure!(
        code != 0 && dst.stderr().contains("killed now (test hook)"),
        "the target killed by the hook: exit {code}: {}",
        dst.stderr()
    );
    let last = ticks(&console(env, &["migsrc"])).last().map_or(0, |t| t.n);
    wait_tick_past(env, &["migsrc"], last + 2)?;
    ensure!(
        free()? == before,
        "free 2 MiB pages per node {before:?} before, {:?} after the target died",
        free()?
    );
    Ok(())
}

/// Step 2: a guest writing 128 MiB/s never fits a 1 ms pause: it writes faster than the
/// emulated host's stream sends (13-42 MB/s), so every round leaves about its whole 32 MiB
/// buffer dirty; `--timeout 5` gives up, the target ends with nothing held, and the guest
/// (writer and ticks) goes on. (At the default 300 ms a 16 MiB/s writer converged once the
/// stream got faster, format 3 in a CI run; and at 1 ms it converged too on 6 December: its
/// rounds shrank below the writer's 10 ms period, until one round found no page dirty and
/// an estimate of 0 ms.)
fn gives_up(env: &Env, src: &Running, pod_b: &Path, key: &str) -> Outcome {
    let dirtier = Dirtier::start()?;
    let listen = format!("unix:{}", env.work.join("mig-g.sock").display());
    let dst = receive(env, "migdst-g", pod_b, &listen, key, None)?;
    let before = free()?;
    let out = migrate_with(
        env,
        src,
        &listen,
        key,
        &["--max-downtime", "1", "--timeout", "5"],
    )?;
    let job = job_of(env, src, &out)?;
    let error = job["error"].as_str().unwrap_or("");
    ensure!(
        out.code == 1 && job["state"] == "failed" && error.contains("did not converge"),
        "ctl migrate of a guest writing 128 MiB/s at --max-downtime 1 with --timeout 5: exit {}, {job}",
        out.code
    );
    let rounds = job["rounds"].as_array().map_or(0, Vec::len);
    ensure!(
        rounds >= 1 && job["downtime_ms"].is_null(),
        "pre-copy rounds and no pause: {job}"
    );
    println!("  migration: gave up after {rounds} round(s): {error}");
    let code = env.wait(dst.pid)?;
    ensure!(
        code != 0
            && dst
                .stderr()
                .contains("the peer cancelled the migration: pre-copy did not converge"),
        "the target of a cancelled migration: exit {code}: {}",
        dst.stderr()
    );
    ensure!(
        free()? == before,
        "free 2 MiB pages per node {before:?} before, {:?} after the give-up",
        free()?
    );
    let names = ledger_names(env)?;
    if names != [VM] {
        // What the ledger held, whatever its state, and whether the source still runs.
        let ps = env.run(&["ps", "--json"]).map(|o| o.stdout);
        return Err(format!(
            "the ledger after the give-up: {names:?}; vmhost ps --json: {ps:?}; the source \
             (pid {}): {}",
            src.vmm,
            std::fs::read_to_string(format!("/proc/{}/stat", src.vmm))
                .unwrap_or_else(|e| format!("no /proc entry: {e}"))
        ));
    }
    dirtier
        .wait_beats(dirtier.beats.load(Ordering::Relaxed), 50)
        .map_err(|e| {
            format!(
                "{e} after the give-up; the source's console:\n{}{}",
                tail(&console(env, &["migsrc"])),
                side_logs(env, src)
            )
        })?;
    let last = ticks(&console(env, &["migsrc"])).last().map_or(0, |t| t.n);
    wait_tick_past(env, &["migsrc"], last + 1)?;
    dirtier.stop();
    Ok(())
}

/// Step 3, first half: a source with the wrong key is refused by `dst`, which listens on.
fn wrong_key_refused(env: &Env, src: &Running, listen: &str, wrong: &str) -> Outcome {
    let out = migrate(env, src, listen, wrong)?;
    let job = job_of(env, src, &out)?;
    ensure!(
        out.code == 1
            && job["state"] == "failed"
            && job["error"].as_str().unwrap_or("").contains("authenticat"),
        "ctl migrate with the wrong key: exit {}, {job}",
        out.code
    );
    wait_stderr(
        env,
        "migdst",
        "refused a connection",
        Duration::from_secs(30),
    )?;
    let last = ticks(&console(env, &["migsrc"])).last().map_or(0, |t| t.n);
    wait_tick_past(env, &["migsrc"], last + 1)?;
    Ok(())
}

/// Step 4's checks of the job's report: rounds, downtime, and the target's plan on nodes 2–3.
pub(crate) fn check_report(job: &Value) -> Result<(), String> {
    ensure!(job["state"] == "succeeded", "the migration job: {job}");
    let rounds = at(job, "/rounds")?.as_array().ok_or("rounds")?;
    ensure!(
        rounds.len() >= 2 && rounds.last().map(|r| r["last"] == true) == Some(true),
        "round 0 and a final round: {job}"
    );
    let bytes: u64 = rounds.iter().filter_map(|r| r["bytes"].as_u64()).sum();
    ensure!(
        bytes >= 16 << 20,
        "{bytes} bytes sent for a guest with 128 MiB that booted Linux"
    );
    let cells = at(job, "/target_plan/guest_cells")?
        .as_array()
        .ok_or("guest_cells")?;
    let nodes: Vec<u32> = cells
        .iter()
        .map(|c| num(&c["host_node"], "a cell's node"))
        .collect::<Result<_, _>>()?;
    ensure!(
        nodes == [2, 3],
        "the target plan's cells are on nodes {nodes:?}, want [2, 3]"
    );
    println!(
        "  migration: {} rounds, {:.1} MiB, downtime {} ms, total {} s",
        rounds.len(),
        bytes as f64 / f64::from(1 << 20),
        job["downtime_ms"],
        job["seconds"]
    );
    for r in rounds {
        println!(
            "  migration: round {} {} bytes in {} s; senders {}",
            r["round"], r["bytes"], r["seconds"], r["senders"]
        );
    }
    Ok(())
}

/// Every tick on the consoles once, in order, with one boot id; returns the last.
pub(crate) fn check_tick_sequence(
    env: &Env,
    names: &[&str],
    boot_id: &str,
) -> Result<Tick, String> {
    let all = ticks(&console(env, names));
    for (i, t) in all.iter().enumerate() {
        ensure!(
            t.n == i as u64 && t.boot_id == boot_id,
            "tick {i} on the consoles {names:?} is {t:?} (boot id before: {boot_id}); \
             the consoles from tick {} on: {}",
            i.saturating_sub(1),
            around_tick(env, names, i.saturating_sub(1))
        );
    }
    all.last().cloned().ok_or_else(|| "no tick".to_string())
}

/// Each console's text from tick `n`'s line on (or its last 800 bytes when that tick is not
/// on it), at most 1,500 bytes each, with its size: what a gap in the ticks looks like.
fn around_tick(env: &Env, names: &[&str], n: usize) -> String {
    let marker = format!("GUEST-MIGTICK n={n} ");
    names
        .iter()
        .map(|name| {
            let bytes = std::fs::read(env.work.join(format!("{name}.out"))).unwrap_or_default();
            let text = String::from_utf8_lossy(&bytes);
            let from = text
                .find(&marker)
                .unwrap_or_else(|| text.len().saturating_sub(800));
            let from = (from..=text.len())
                .find(|&i| text.is_char_boundary(i))
                .unwrap_or(0);
            let to = (from + 1500).min(text.len());
            let to = (to..=text.len())
                .find(|&i| text.is_char_boundary(i))
                .unwrap_or(text.len());
            format!("[{name}.out, {} bytes: {:?}]", bytes.len(), &text[from..to])
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Step 4: the migration to nodes 2–3 and everything that must hold after it. A disk read is
/// held in flight across the source's pause ([`request_in_flight_at_the_pause`]).
fn migrate_to_nodes_2_3(
    env: &Env,
    src: &Running,
    (listen, key): (&str, &str),
    disk: &DmDevice,
) -> Outcome {
    let boot_id = ticks(&console(env, &["migsrc"]))
        .first()
        .map(|t| t.boot_id.clone())
        .ok_or("no tick before the migration")?;
    let out = request_in_flight_at_the_pause(src, disk, || migrate(env, src, listen, key))?;
    ensure!(
        out.code == 0,
        "ctl migrate: exit {}: {} {}",
        out.code,
        out.stdout,
        out.stderr
    );
    check_report(&out.json()?)?;
    wait_stderr(
        env,
        "migdst",
        "migration committed",
        Duration::from_secs(60),
    )?;
    let code = env.wait(src.pid)?;
    ensure!(
        code == 0,
        "the source after the switch: exit {code}: {}",
        src.stderr()
    );
    let at_switch = ticks(&console(env, &["migsrc"]))
        .last()
        .map_or((0, 0), |t| (t.n, t.reads));
    let before = at_switch.0;
    let last = wait_tick_past(env, &["migsrc", "migdst"], before + 2)?;
    let seq = check_tick_sequence(env, &["migsrc", "migdst"], &boot_id)
        .map_err(|e| format!("{e}; the source's stderr: {}", src.stderr()))?;
    ensure!(
        seq.n >= last.n && last.lines > before,
        "the guest's disk file has {} lines at tick {}",
        last.lines,
        last.n
    );
    reader_goes_on(env, at_switch.1)
}

/// Runs `migrate` with a guest disk request in flight at the source's pause: the disk is
/// suspended until the source's I/O thread waits in it (the guest's background reader always
/// has a read out), and resumed once the job's phase is `state`, the capture that quiesces
/// the devices. The request completes then, writing guest RAM (the data and the used ring)
/// while the vCPUs are paused: the source must send those pages in its final round. (Before
/// 5 December the capture came after the final round; the completion's pages then never
/// reached the target, and its reader, or its ext4, waited for the request for good.)
fn request_in_flight_at_the_pause(
    src: &Running,
    disk: &DmDevice,
    migrate: impl FnOnce() -> Result<crate::vm::Output, String> + Send,
) -> Result<crate::vm::Output, String> {
    disk.suspend(true)?;
    let held = Instant::now();
    let in_d = loop {
        if !crate::device_tests::io_threads_in_d(src.vmm).is_empty() {
            break Ok(());
        }
        if held.elapsed() > GUEST_LIMIT {
            break Err(format!(
                "no I/O thread of the source waited on the suspended disk within {GUEST_LIMIT:?}"
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let (out, seen) = match in_d {
        Ok(()) => std::thread::scope(|s| {
            let job = s.spawn(migrate);
            let seen = wait_for_phase(&src.socket, "state");
            // At the phase, or at once when it never came: the job never waits on the disk.
            let resumed = disk.suspend(false);
            (job.join(), seen.and_then(|seen| resumed.map(|()| seen)))
        }),
        Err(e) => {
            let _ = disk.suspend(false);
            (Ok(Err(e)), Ok(String::new()))
        }
    };
    let out = out.map_err(|_| "the migration's thread panicked".to_string())??;
    println!("  migration: a disk read in flight at the pause: {}", seen?);
    Ok(out)
}

/// Polls the source's `GET /vm/migrate` until the running job's phase is `phase`; what it
/// saw. Fails when the job ends or `MIGRATE_LIMIT` passes first.
fn wait_for_phase(sock: &Path, phase: &str) -> Result<String, String> {
    let started = Instant::now();
    let (mut seen, mut running) = (Vec::new(), false);
    loop {
        let job = api_get(sock, "/vm/migrate").ok();
        let now = job
            .as_ref()
            .and_then(|j| j["phase"].as_str())
            .map(str::to_string);
        if let Some(p) = now.as_ref().filter(|p| seen.last() != Some(*p)) {
            seen.push(p.clone());
        }
        let state = job.as_ref().and_then(|j| j["state"].as_str());
        // The socket answers with the last job (an earlier, failed one) until this one runs.
        running |= state == Some("running");
        if !running {
            seen.clear();
            ensure!(
                started.elapsed() < GUEST_LIMIT,
                "the migration job never ran: {job:?}"
            );
        } else if now.as_deref() == Some(phase) {
            return Ok(format!(
                "the disk resumed at phase {phase}, {:.1} s after the migration started \
                 (phases seen: {})",
                started.elapsed().as_secs_f64(),
                seen.join(", ")
            ));
        } else {
            ensure!(
                !matches!(state, Some("failed" | "succeeded")) && started.elapsed() < MIGRATE_LIMIT,
                "the migration job ended or took too long before phase {phase}: {job:?}; \
                 phases seen: {}",
                seen.join(", ")
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// `GET uri` on a vmhost API socket: the JSON body of a 2xx answer.
fn api_get(sock: &Path, uri: &str) -> Result<Value, String> {
    let body = crate::vm::api_call(sock, "GET", uri)?;
    serde_json::from_str(&body).map_err(|e| format!("GET {uri}: {e}: {body}"))
}

/// The guest's background disk reader makes progress on the target: its passes go past
/// `at_switch` + 2 within [`READER_LIMIT`]. A read in flight at the pause whose completion
/// the target's RAM lacks (its used ring entry) hangs the reader for good.
fn reader_goes_on(env: &Env, at_switch: u64) -> Outcome {
    let deadline = Instant::now() + READER_LIMIT;
    loop {
        let now = ticks(&console(env, &["migsrc", "migdst"]))
            .last()
            .map_or(0, |t| t.reads);
        if now > at_switch + 2 {
            println!(
                "  migration: the guest's disk reader: {at_switch} passes at the switch, {now} now"
            );
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "the guest's disk reader stopped at the switch: {now} passes, {at_switch} at the \
             source's last tick; {}",
            tail(&console(env, &["migdst"]))
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// The host's and the kernel's account after step 4.
fn after_the_switch(env: &Env, dst: &Running) -> Outcome {
    let pools = free()?;
    ensure!(
        pools[0] == CELL_PAGES && pools[1] == CELL_PAGES,
        "free 2 MiB pages per node after the source ended: {pools:?}; nodes 0 and 1 should have \
         all {CELL_PAGES} back"
    );
    ensure!(
        ledger_names(env)? == [VM],
        "the ledger's live entries: {:?}, want only {VM}",
        ledger_names(env)?
    );
    check_placement(
        env,
        dst,
        &[(2, CELL_PAGES), (3, CELL_PAGES)].into_iter().collect(),
    )
}

/// Step 5: back to nodes 0–1 with the source (`dst`, started with the hook) killed at round 1.
fn source_killed_on_the_way_back(env: &Env, dst: &Running, pod_a: &Path, key: &str) -> Outcome {
    let listen = format!("unix:{}", env.work.join("mig-back.sock").display());
    let back = receive(env, "migback", pod_a, &listen, key, None)?;
    let out = migrate(env, dst, &listen, key)?;
    ensure!(
        out.code != 0,
        "ctl migrate from a source killed at round 1: exit 0"
    );
    let code = env.wait(dst.pid)?;
    ensure!(
        dst.stderr().contains("killed now (test hook)"),
        "the source (exit {code}) was not killed by the hook: {}",
        dst.stderr()
    );
    let code = env.wait(back.pid)?;
    ensure!(
        code != 0,
        "the target whose source died: exit 0: {}",
        back.stderr()
    );
    let pools = free()?;
    ensure!(
        pools == [CELL_PAGES; 4],
        "free 2 MiB pages per node after both ended: {pools:?}, want {CELL_PAGES} on each"
    );
    ensure!(
        ledger_names(env)?.is_empty(),
        "live ledger entries left: {:?}",
        ledger_names(env)?
    );
    Ok(())
}

/// The whole sequence (module docs). A failure also lists every rewrite of the emulated
/// host's kernel text made while the test ran (`diagnose::TextPokes`).
pub fn linux_between_node_pairs(env: &Env) -> Outcome {
    let pokes = crate::diagnose::TextPokes::start();
    let outcome = sequence(env).map_err(|e| {
        format!(
            "{e}\n--- the host kernel's text rewritten during the test:\n{}",
            pokes.report()
        )
    });
    if let (Ok(()), Some(0)) = (&outcome, pokes.count()) {
        println!("  migration: the host kernel's text was not rewritten during the test");
    } else if let (Ok(()), Some(n)) = (&outcome, pokes.count()) {
        println!(
            "  migration: the host kernel's text was rewritten {n} times during the test: {}",
            pokes.summary()
        );
    }
    outcome
}

fn sequence(env: &Env) -> Outcome {
    let started = Instant::now();
    host::set_2m_pools(&[CELL_PAGES; 4])?;
    let bridge = Bridge::create()?;
    // The disk through a dm-linear device over a loop device, so that step 4 can hold a read
    // in flight across the source's pause (`request_in_flight_at_the_pause`).
    let disk = make_disk(env)?;
    let sectors = std::fs::metadata(&disk)
        .map_err(|e| format!("{}: {e}", disk.display()))?
        .len()
        / 512;
    let backing = crate::device_tests::Loop::attach(&disk)?;
    let dm = DmDevice::create(
        "vmhost-migdisk",
        sectors,
        &format!("linear {} 0", backing.0),
    )?;
    let spec = spec(env, Path::new(&dm.dev))?
        .to_string_lossy()
        .into_owned();
    let (key, wrong) = (
        key_file(env, "mig.key", 7)?,
        key_file(env, "mig-wrong.key", 9)?,
    );
    let pod_a = pod(env, "tbmigsrc", [0, 1])?;
    let pod_b = pod(env, "tbmigdst", [2, 3])?;
    let src = env.start("migsrc", command_in(env, &pod_a, &["--config", &spec]), 2)?;
    bridge.attach_new()?;
    wait_tick_past(env, &["migsrc"], 0)?;
    let mut echo = Echo::connect()?;
    echo.round_trip("before")?;
    println!(
        "  migration: guest ready {:.1} s",
        started.elapsed().as_secs_f64()
    );
    target_killed(env, &src, &pod_b, &key)?;
    echo.round_trip("after a failed migration")?;
    gives_up(env, &src, &pod_b, &key)?;
    echo.round_trip("after a migration that gave up")?;
    let listen = format!("unix:{}", env.work.join("mig.sock").display());
    let dst = receive(env, "migdst", &pod_b, &listen, &key, Some("round:1:source"))?;
    wrong_key_refused(env, &src, &listen, &wrong)?;
    migrate_to_nodes_2_3(env, &src, (&listen, &key), &dm)?;
    bridge.attach_new()?;
    echo.round_trip("after the migration")?;
    after_the_switch(env, &dst)?;
    println!(
        "  migration: moved and checked {:.1} s",
        started.elapsed().as_secs_f64()
    );
    source_killed_on_the_way_back(env, &dst, &pod_a, &key)
}

#[cfg(test)]
mod console_tests {
    use super::{guest_output, ticks};

    /// The shape a CI run failed on: the source's report glued to the guest's half line, the
    /// target's plan and placement table before the line's other half.
    #[test]
    fn a_tick_line_split_by_the_switch_is_whole_again() {
        let source = "VM migvm: the plan (`vmhost plan` prints it in full)\n  guest  2 vCPUs\n\
            VM migvm: placement read back from /proc at start\n  vCPU  thread id\n\
            [    1.0] PCI: Fatal: No config space access function found\n\
            GUEST-MIGTICK n=0 boot_id=b uptime=1.0 lines=1 whole=1 mem_ok=1 numa_same=1\r\n\
            GUEST-MIGTICK n=1 boot_id=b uptime=26.VM migvm: Linux elf via Pvh, first serial \
            byte at 1.188 s, 2800 serial bytes, user space at 3.044 s, Stopped (exit code 130)\n  \
            setup 306.016 ms\n  vcpu0 apic 0 pu 0 cell 0: stopped, 669 exits\n";
        let target = "VM migvm: the plan (`vmhost plan` prints it in full)\n  guest  2 vCPUs\n\
            VM migvm: placement read back from /proc at start\n     1          3       64Mi    \
            2Mi   node3 100.0%\n.51 lines=2 whole=1 mem_ok=1 numa_same=1\r\n\
            GUEST-MIGTICK n=2 boot_id=b uptime=28.1 lines=3 whole=1 mem_ok=1 numa_same=1\r\n";
        let both = format!("{}{}", guest_output(source), guest_output(target));
        let seen: Vec<u64> = ticks(&both).iter().map(|t| t.n).collect();
        assert_eq!(seen, [0, 1, 2], "{both}");
        // Without vmhost's lines removed, tick 1 is lost.
        let raw: Vec<u64> = ticks(&format!("{source}{target}"))
            .iter()
            .map(|t| t.n)
            .collect();
        assert_eq!(raw, [0, 2]);
    }
}
