//! The virtio devices under real Linux drivers: one KubeVirt `VirtualMachineInstance` manifest
//! with four `hostDisk`/`cloudInitNoCloud` disks, a bridge interface on the pod network and
//! `rng: {}` boots Debian's kernel in the emulated host. Its `/init` runs
//! `testbed/guest/devices.sh` (`vmhost.action=devices`), which loads virtio_mmio, virtio_blk,
//! virtio_net, virtio_rng, ext4 and vfat and reports what the drivers see; the host side (tap
//! address, two `nc` endpoints, the images) is set up and read back here.
//!
//! One boot serves every check ([`session`] runs it once, on the first test that asks); each
//! check is its own named test reading its part of that session:
//!
//! - the manifest boots and every device is bound to its driver, probed from the DSDT's
//!   `LNRO0005` devices alone (no `virtio_mmio.device=` on the command line);
//! - every file of the ext4 image (built by `testbed/build-disks.sh`) has its checksum;
//! - a pattern the guest wrote and synced to the scratch disk (a `dm-log-writes` device over a
//!   loop device, cache `none`) was on the device before a FLUSH that completed before the
//!   guest's sync returned, by the target's own log ([`crate::dm_log`]), and is in its backing
//!   file after vmhost is SIGKILLed;
//! - the read-only disk is read-only in the guest, a write fails, the image is unchanged;
//! - the guest pings the host over the tap and 64 MiB go each way with equal checksums;
//! - the NoCloud seed mounts and its `user-data` is the manifest's, byte for byte;
//! - `/dev/hwrng` is virtio_rng and gives 64 bytes.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::linux_tests::assets;
use crate::vm::{at, Env, Running};
use crate::{ensure, Outcome};

/// The guest's whole run: boot, device checks, 128 MiB over the network (about 45 s in the
/// emulated host).
const SESSION_LIMIT: Duration = Duration::from_secs(240);
/// Bytes sent each way over the network.
const NET_BYTES: u64 = 64 << 20;
/// The host's address on the tap (the guest is 10.0.2.15).
const HOST_IP: &str = "10.0.2.1/24";
/// The seed's `user-data`, which the guest must read back byte for byte.
const USER_DATA: &str = "#cloud-config\nhostname: virtio-vmi\n\
                         write_files:\n  - path: /etc/motd\n    content: \"vmhost seed \\u00e9\\n\"\n";
/// The VM's name (and the manifest's `metadata.name`).
const VM: &str = "virtio-vmi";

/// What one boot of the manifest showed, on both sides.
#[derive(Debug, Clone)]
pub struct Session {
    /// The `GUEST` lines of the console, as key=value maps.
    lines: Vec<BTreeMap<String, String>>,
    /// The console's last lines and vmhost's stderr, for failure messages.
    tail: String,
    /// The plan's MAC address of the interface.
    mac: String,
    /// Checksums of the files put into the ext4 image, by path relative to its root.
    files: BTreeMap<String, String>,
    /// The read-only image's checksum before and after the run.
    golden: (String, String),
    /// Checksum of the bytes sent to the guest, and of what the host received from it.
    net: (String, String),
    /// vmhost's exit status after SIGKILL.
    killed_code: i32,
    /// Checksum of the scratch image at the offset the guest wrote.
    scratch_sha: String,
    /// The scratch device's `dm-log-writes` log, read once the device was removed, checked
    /// against the bytes the image holds where the guest wrote: `Err` says what was missing.
    scratch_log: Result<(), String>,
    /// The open flags (octal, from `/proc/<vmm>/fdinfo`) of vmhost's fd on the scratch device.
    scratch_flags: Option<u32>,
    /// Checksum of the manifest's `user-data`.
    user_data_sha: String,
}

impl Session {
    /// The first `GUEST` line that has `key`.
    fn line(&self, key: &str) -> Result<&BTreeMap<String, String>, String> {
        self.lines
            .iter()
            .find(|l| l.contains_key(key))
            .ok_or_else(|| format!("no GUEST {key}=... line: {}", self.tail))
    }

    fn get(&self, key: &str, field: &str) -> Result<String, String> {
        let l = self.line(key)?;
        l.get(field)
            .cloned()
            .ok_or_else(|| format!("GUEST {key} line without {field}: {l:?}"))
    }
}

/// The session, run once per runner process.
pub fn session(env: &Env) -> Result<Session, String> {
    static SESSION: OnceLock<Result<Session, String>> = OnceLock::new();
    SESSION.get_or_init(|| run_session(env)).clone()
}

/// `sha256sum FILE` on the host.
fn sha256(path: &Path) -> Result<String, String> {
    shell(&format!("sha256sum < '{}'", path.display()))
}

/// Runs `sh -c script` and returns the first 64 characters of its stdout (a checksum).
fn shell(script: &str) -> Result<String, String> {
    let out = Command::new("sh")
        .arg("-c")
        .arg(script)
        .output()
        .map_err(|e| format!("sh -c {script:?}: {e}"))?;
    ensure!(
        out.status.success(),
        "sh -c {script:?}: {}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let s = String::from_utf8_lossy(&out.stdout);
    Ok(s.chars().take(64).collect())
}

/// Checksums of every file under `root`, by relative path.
fn checksums(root: &Path, dir: &Path, out: &mut BTreeMap<String, String>) -> Outcome {
    let entries = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for e in entries {
        let path = e.map_err(|e| e.to_string())?.path();
        if path.is_dir() {
            checksums(root, &path, out)?;
        } else {
            let rel = path.strip_prefix(root).map_err(|e| e.to_string())?;
            out.insert(rel.to_string_lossy().into_owned(), sha256(&path)?);
        }
    }
    Ok(())
}

/// Background host processes (the `nc` endpoints), killed when the session ends.
struct Helpers(Vec<Child>);

impl Helpers {
    fn spawn(&mut self, args: &[&str]) -> Outcome {
        let child = Command::new(args[0])
            .args(&args[1..])
            .stdin(Stdio::null())
            .spawn()
            .map_err(|e| format!("spawn {args:?}: {e}"))?;
        self.0.push(child);
        Ok(())
    }

    /// Waits (bounded) for every helper to finish by itself.
    fn wait_all(&mut self, limit: Duration) {
        let deadline = Instant::now() + limit;
        for c in &mut self.0 {
            while matches!(c.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

impl Drop for Helpers {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A loop device over a file, detached on drop.
pub(crate) struct Loop(pub(crate) String);

impl Loop {
    pub(crate) fn attach(file: &Path) -> Result<Self, String> {
        let free = Command::new("losetup")
            .arg("-f")
            .output()
            .map_err(|e| format!("losetup -f: {e}"))?;
        let dev = String::from_utf8_lossy(&free.stdout).trim().to_string();
        ensure!(
            dev.starts_with("/dev/loop"),
            "losetup -f found no free loop device ({dev:?}): is the loop module loaded? {}",
            String::from_utf8_lossy(&free.stderr)
        );
        crate::host::run_tool(&["losetup", &dev, &file.to_string_lossy()])?;
        Ok(Loop(dev))
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = Command::new("losetup").arg("-d").arg(&self.0).status();
    }
}

/// The manifest: 1 socket × 2 dedicated cores, 384 MiB, the test kernel through
/// `firmware.kernelBoot`, four disks (`scratch` is a dm block device with cache `none`:
/// O_DIRECT, which the host's tmpfs files do not take), a bridge interface on the pod network,
/// rng.
fn manifest(kernel: &Path, initrd: &Path, dir: &Path, scratch: &Path) -> String {
    let user_data = serde_json::to_string(USER_DATA).unwrap_or_default();
    format!(
        r#"apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata:
  name: {VM}
spec:
  domain:
    cpu: {{sockets: 1, cores: 2, threads: 1, dedicatedCpuPlacement: true}}
    memory: {{guest: 384Mi}}
    firmware:
      kernelBoot:
        kernelArgs: "{cmdline} vmhost.action=devices"
        container:
          image: registry.example/testbed-kernel:6.1
          kernelPath: {kernel}
          initrdPath: {initrd}
    devices:
      autoattachGraphicsDevice: false
      rng: {{}}
      disks:
        - name: data
          disk: {{bus: virtio}}
        - name: golden
          disk: {{bus: virtio, readonly: true}}
        - name: scratch
          disk: {{bus: virtio}}
          cache: none
        - name: cloudinitdisk
          disk: {{bus: virtio}}
      interfaces:
        - name: default
          bridge: {{}}
  networks:
    - name: default
      pod: {{}}
  volumes:
    - name: data
      hostDisk: {{path: {data}, type: Disk}}
    - name: golden
      hostDisk: {{path: {golden}, type: Disk}}
    - name: scratch
      hostDisk: {{path: {scratch}, type: Disk}}
    - name: cloudinitdisk
      cloudInitNoCloud:
        userData: {user_data}
"#,
        cmdline = crate::linux_tests::CMDLINE,
        kernel = kernel.display(),
        initrd = initrd.display(),
        data = dir.join("data.ext4").display(),
        golden = dir.join("golden.img").display(),
        scratch = scratch.display(),
    )
}

/// The tap vmhost created (`vmhost%d`), once it exists.
fn wait_for_tap(limit: Duration) -> Result<String, String> {
    let deadline = Instant::now() + limit;
    loop {
        let taps: Vec<String> = std::fs::read_dir("/sys/class/net")
            .map_err(|e| format!("/sys/class/net: {e}"))?
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("vmhost"))
            .collect();
        if let Some(t) = taps.first() {
            return Ok(t.clone());
        }
        ensure!(
            Instant::now() < deadline,
            "vmhost created no vmhost* tap within {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The host's side of the session, ready before the VM starts.
struct HostSide {
    /// Checksums of the ext4 image's files.
    files: BTreeMap<String, String>,
    /// The read-only image's checksum before the run.
    golden_before: String,
    /// The scratch disk.
    scratch: Scratch,
    /// Checksum of the 64 MiB the host sends.
    to_guest_sha: String,
    /// Where the host writes the checksum of what it received.
    from_guest: std::path::PathBuf,
    /// Checksum of the manifest's `user-data`.
    user_data_sha: String,
    /// The two `nc` endpoints.
    helpers: Helpers,
}

fn prepare_host(env: &Env, dir: &Path) -> Result<HostSide, String> {
    let mut files = BTreeMap::new();
    checksums(&dir.join("files"), &dir.join("files"), &mut files)?;
    ensure!(
        files.len() >= 4,
        "only {} files in {}",
        files.len(),
        dir.display()
    );
    let golden_before = sha256(&dir.join("golden.img"))?;
    let scratch = Scratch::new(env)?;
    let (to_guest, from_guest) = (
        env.work.join("virtio-to-guest.bin"),
        env.work.join("virtio-from-guest.sum"),
    );
    let _ = std::fs::remove_file(&from_guest);
    let to_guest_sha = shell(&format!(
        "head -c {NET_BYTES} /dev/urandom > '{0}' && sha256sum < '{0}'",
        to_guest.display()
    ))?;
    let user_data_file = env.work.join("virtio-user-data");
    std::fs::write(&user_data_file, USER_DATA).map_err(|e| e.to_string())?;
    let user_data_sha = sha256(&user_data_file)?;
    let mut helpers = Helpers(Vec::new());
    let recv = format!("sha256sum > '{}'", from_guest.display());
    helpers.spawn(&["nc", "-l", "-p", "5001", "-e", "sh", "-c", &recv])?;
    let send = to_guest.to_string_lossy().into_owned();
    helpers.spawn(&["nc", "-l", "-p", "5002", "-e", "cat", &send])?;
    Ok(HostSide {
        files,
        golden_before,
        scratch,
        to_guest_sha,
        from_guest,
        user_data_sha,
        helpers,
    })
}

/// The mark set in the scratch device's log once the guest's `GUEST-SYNCED` line is out.
const SYNCED: &str = "guest-synced";
/// Where the guest writes its pattern on the scratch disk, and how much (devices.sh).
const PATTERN: (u64, usize) = (1 << 20, 256 << 10);

/// The scratch disk: 16 MiB in a file behind a loop device, and a `dm-log-writes` device
/// over it that logs every write, FLUSH and mark to a second loop device (cache none needs a
/// block device for O_DIRECT; the log shows what reached the device and when).
struct Scratch {
    file: std::path::PathBuf,
    log_file: std::path::PathBuf,
    // Field order is drop order: the dm device goes before its loop devices.
    dm: crate::dm_log::DmDevice,
    _data: Loop,
    _log: Loop,
}

impl Scratch {
    fn new(env: &Env) -> Result<Self, String> {
        let file = env.work.join("virtio-scratch.img");
        let log_file = env.work.join("virtio-scratch.log");
        for (f, size) in [(&file, 16u64 << 20), (&log_file, 32 << 20)] {
            let _ = std::fs::remove_file(f);
            std::fs::File::create(f)
                .and_then(|h| h.set_len(size))
                .map_err(|e| format!("create {}: {e}", f.display()))?;
        }
        let (data, log) = (Loop::attach(&file)?, Loop::attach(&log_file)?);
        let target = format!("log-writes {} {}", data.0, log.0);
        let dm = crate::dm_log::DmDevice::create("vmhost-scratch", 32768, &target)?;
        Ok(Scratch {
            file,
            log_file,
            dm,
            _data: data,
            _log: log,
        })
    }

    /// Removes the dm device (its log is complete then) and checks the log: the bytes the
    /// image holds where the guest wrote were on the device before a FLUSH ahead of
    /// [`SYNCED`].
    fn check_log(&mut self) -> Result<(), String> {
        self.dm.remove()?;
        let log = std::fs::read(&self.log_file)
            .map_err(|e| format!("{}: {e}", self.log_file.display()))?;
        let image =
            std::fs::read(&self.file).map_err(|e| format!("{}: {e}", self.file.display()))?;
        let (offset, len) = PATTERN;
        let start = usize::try_from(offset).map_err(|e| e.to_string())?;
        let want = image
            .get(start..start + len)
            .ok_or_else(|| format!("the image is shorter than {}", start + len))?;
        crate::dm_log::parse(&log)?.flushed_before_mark(SYNCED, offset, want)
    }
}

/// Checksum of the scratch image where the guest's `GUEST-SYNCED` line says it wrote.
fn scratch_written(lines: &[BTreeMap<String, String>], scratch: &Path) -> Result<String, String> {
    let synced = lines.iter().find(|l| l.contains_key("offset"));
    match synced.and_then(|l| Some((l.get("offset")?, l.get("bytes")?))) {
        Some((off, len)) => shell(&format!(
            "dd if='{}' bs=4096 skip=$(({off} / 4096)) count=$(({len} / 4096)) 2>/dev/null | sha256sum",
            scratch.display()
        )),
        None => Ok(String::new()),
    }
}

fn run_session(env: &Env) -> Result<Session, String> {
    let a = assets(env)?;
    let dir = env.work.join("guest/virtio");
    let mut host = prepare_host(env, &dir)?;
    let yaml = env.work.join(format!("{VM}.yaml"));
    let initrd = env.work.join("guest/initramfs-devices.cpio");
    let text = manifest(&a.vmlinux, &initrd, &dir, Path::new(&host.scratch.dm.dev));
    std::fs::write(&yaml, text).map_err(|e| format!("write {}: {e}", yaml.display()))?;
    let plan = env.plan(&yaml)?;
    let mac = at(&plan, "/devices/spec/interfaces/0/mac")?
        .as_str()
        .unwrap_or_default()
        .to_string();
    let vm = env.start(VM, env.command(&["--config", &yaml.to_string_lossy()]), 2)?;
    let tap = wait_for_tap(Duration::from_secs(30))?;
    crate::host::run_tool(&["ip", "addr", "add", HOST_IP, "dev", &tap])?;
    crate::host::run_tool(&["ip", "link", "set", &tap, "up"])?;

    let out = env.work.join(format!("{VM}.out"));
    let serial = wait_for(&out, "GUEST-SYNCED", &vm)?;
    let scratch_flags = fd_flags(vm.vmm, &host.scratch.dm.dev);
    // After the guest's sync returned: everything it made durable is ahead of this mark.
    host.scratch.dm.message(&["mark", SYNCED])?;
    env.signal(vm.pid, libc::SIGKILL)?;
    let killed_code = env.wait(vm.pid)?;
    host.helpers.wait_all(Duration::from_secs(10));
    for l in vm.stderr().lines().filter(|l| !l.starts_with("warning: ")) {
        println!("     vmhost: {l}");
    }
    let lines = guest_lines(&serial);
    let scratch_sha = scratch_written(&lines, &host.scratch.file)?;
    let scratch_log = host.scratch.check_log();
    let received = std::fs::read_to_string(&host.from_guest).unwrap_or_default();
    Ok(Session {
        tail: format!("{}; stderr: {}", tail(&serial), vm.stderr()),
        lines,
        mac,
        files: std::mem::take(&mut host.files),
        golden: (host.golden_before.clone(), sha256(&dir.join("golden.img"))?),
        net: (
            host.to_guest_sha.clone(),
            received.chars().take(64).collect(),
        ),
        killed_code,
        scratch_sha,
        scratch_log,
        scratch_flags,
        user_data_sha: host.user_data_sha.clone(),
    })
}

/// The open flags of `pid`'s first fd on `path` (`flags:` in `/proc/<pid>/fdinfo/<fd>`, octal).
fn fd_flags(pid: u32, path: &str) -> Option<u32> {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?;
    fds.filter_map(|e| e.ok()).find_map(|e| {
        let target = std::fs::read_link(e.path()).ok()?;
        if target.to_string_lossy() != path {
            return None;
        }
        let info = std::fs::read_to_string(format!(
            "/proc/{pid}/fdinfo/{}",
            e.file_name().to_string_lossy()
        ))
        .ok()?;
        let flags = info.lines().find_map(|l| l.strip_prefix("flags:"))?;
        u32::from_str_radix(flags.trim(), 8).ok()
    })
}

/// Waits until the console log `out` contains `marker`, echoing the console to the runner's
/// output as it comes (the rng bytes left out), so a guest that hangs shows where. Each echoed
/// line carries [`crate::GUEST_PREFIX`]: a guest kernel's lockup report must never pass for
/// the emulated host's own (testbed/run.sh retries a host that locks up). A VM that ended
/// before the marker fails at once, with what it printed last.
fn wait_for(out: &Path, marker: &str, vm: &Running) -> Result<String, String> {
    let deadline = Instant::now() + SESSION_LIMIT;
    let mut shown = 0;
    loop {
        // Whether it had ended before this read: then the read has all it printed.
        let ended = vm.ended();
        let serial = std::fs::read_to_string(out).unwrap_or_default();
        let complete = serial.rfind('\n').map_or(0, |i| i + 1);
        for l in serial[shown.min(complete)..complete].lines() {
            let l = l.trim_end_matches('\r');
            println!(
                "{}{}",
                crate::GUEST_PREFIX,
                l.split(" hex=").next().unwrap_or(l)
            );
        }
        shown = complete;
        // Only a whole line counts: the console may be read in the middle of the marker's.
        if serial[..complete].contains(marker) {
            return Ok(serial[..complete].to_string());
        }
        ensure!(
            !ended,
            "the VM ended before {marker:?} was on the guest console: {}; stderr: {}",
            tail(&serial),
            vm.stderr()
        );
        ensure!(
            Instant::now() < deadline,
            "no {marker:?} on the guest console within {SESSION_LIMIT:?}: {}; stderr: {}",
            tail(&serial),
            vm.stderr()
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// `GUEST tag a=b c=d` lines (and `GUEST-SYNCED ...`) as maps; a word without `=` (the tag)
/// is a key with an empty value.
fn guest_lines(serial: &str) -> Vec<BTreeMap<String, String>> {
    serial
        .lines()
        .map(|l| l.trim_end_matches('\r'))
        .filter_map(|l| {
            l.strip_prefix("GUEST ")
                .or_else(|| l.strip_prefix("GUEST-SYNCED "))
        })
        .map(|l| {
            l.split_whitespace()
                .map(|kv| kv.split_once('=').unwrap_or((kv, "")))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        })
        .collect()
}

fn tail(serial: &str) -> String {
    let lines: Vec<&str> = serial.lines().collect();
    lines[lines.len().saturating_sub(15)..].join(" | ")
}

/// The `GUEST virtio=...` lines: (name, device id, parent, driver).
fn virtio_devices(s: &Session) -> Vec<(String, String, String, String)> {
    s.lines
        .iter()
        .filter(|l| l.contains_key("virtio"))
        .map(|l| {
            let g = |k: &str| l.get(k).cloned().unwrap_or_default();
            (g("virtio"), g("device"), g("parent"), g("driver"))
        })
        .collect()
}

/// The manifest boots: six virtio devices (4 × blk, net, rng), each bound to its driver; four
/// disks with their serials; the NIC has the plan's MAC.
pub fn kubevirt_vmi_boots(env: &Env) -> Outcome {
    let s = session(env)?;
    let mut ids: Vec<String> = virtio_devices(&s).into_iter().map(|d| d.1).collect();
    ids.sort();
    ensure!(
        ids == ["0x0001", "0x0002", "0x0002", "0x0002", "0x0002", "0x0004"],
        "virtio device IDs {ids:?}, want four blk (2), one net (1), one rng (4): {}",
        s.tail
    );
    for (name, _, _, driver) in virtio_devices(&s) {
        ensure!(!driver.is_empty(), "{name} has no driver bound: {}", s.tail);
    }
    let mut serials: Vec<String> = s
        .lines
        .iter()
        .filter_map(|l| l.get("serial").cloned())
        .collect();
    serials.sort();
    ensure!(
        serials == ["cloudinitdisk", "data", "golden", "scratch"],
        "disk serials {serials:?}"
    );
    let mac = s.get("net", "mac")?;
    ensure!(mac == s.mac, "guest eth0 has MAC {mac}, the plan {}", s.mac);
    Ok(())
}

/// Linux found every device through the DSDT: each virtio device's parent is an `LNRO0005`
/// ACPI platform device and the command line has no `virtio_mmio.device=`.
pub fn probed_from_acpi_alone(env: &Env) -> Outcome {
    let s = session(env)?;
    ensure!(
        s.get("cmdline_virtio", "cmdline_virtio")? == "0",
        "virtio_mmio.device= is on the guest's command line: {}",
        s.tail
    );
    let devices = virtio_devices(&s);
    ensure!(
        devices.len() == 6,
        "{} virtio devices, want 6",
        devices.len()
    );
    for (name, _, parent, _) in devices {
        ensure!(
            parent.starts_with("LNRO0005:"),
            "{name}'s parent is {parent}, not an LNRO0005 ACPI device"
        );
    }
    Ok(())
}

/// Every file of the ext4 image has the checksum it had on the host.
pub fn disk_checksums(env: &Env) -> Outcome {
    let s = session(env)?;
    s.line("files_done")?;
    let seen: BTreeMap<String, String> = s
        .lines
        .iter()
        .filter_map(|l| Some((l.get("file")?.clone(), l.get("sha256")?.clone())))
        .collect();
    ensure!(
        seen == s.files,
        "files in the guest {seen:?}, on the host {:?}",
        s.files
    );
    Ok(())
}

/// The guest's disk is in write-back mode (it sends FLUSH), the pattern it wrote with
/// `conv=fsync` and `sync` is in the image after SIGKILL, and the `dm-log-writes` log shows it
/// on the device before a FLUSH that completed before the guest's sync returned (a vmhost
/// whose FLUSH skips `fdatasync` leaves no FLUSH in the log ahead of the mark).
pub fn flush_durability(env: &Env) -> Outcome {
    let s = session(env)?;
    let want = s.get("offset", "sha256")?;
    let scratch = s
        .lines
        .iter()
        .find(|l| l.get("serial").map(String::as_str) == Some("scratch"))
        .ok_or_else(|| format!("no scratch disk in the guest: {}", s.tail))?;
    let cache = scratch.get("write_cache").cloned().unwrap_or_default();
    ensure!(
        cache == "write_back",
        "the guest's scratch disk has write_cache {cache:?}: without \"write back\" Linux sends \
         no FLUSH, and sync would not reach the device's fdatasync"
    );
    ensure!(
        s.killed_code == -1,
        "vmhost exited {} instead of dying of SIGKILL",
        s.killed_code
    );
    ensure!(
        s.scratch_flags
            .is_some_and(|f| f & libc::O_DIRECT as u32 != 0),
        "vmhost's fd on the scratch device (cache none) has flags {}, without O_DIRECT",
        s.scratch_flags
            .map_or_else(|| "(no fd found)".to_string(), |f| format!("{f:o}"))
    );
    ensure!(
        s.scratch_sha == want,
        "scratch image at the written offset has sha256 {}, the guest wrote {want}",
        s.scratch_sha
    );
    s.scratch_log
        .clone()
        .map_err(|e| format!("the scratch device's write log: {e}"))?;
    Ok(())
}

/// The read-only disk: read-only in the guest, a write fails, the image is unchanged.
pub fn read_only(env: &Env) -> Outcome {
    let s = session(env)?;
    let ro = s.get("golden", "ro")?;
    let rc = s.get("golden", "write_rc")?;
    ensure!(ro == "1", "the guest sees the read-only disk with ro={ro}");
    ensure!(
        rc != "0",
        "writing the read-only disk succeeded in the guest ({})",
        s.get("golden", "write_err")?
    );
    ensure!(
        s.golden.0 == s.golden.1,
        "the read-only image changed: {} → {}",
        s.golden.0,
        s.golden.1
    );
    Ok(())
}

/// Ping over the tap, then 64 MiB each way with matching checksums.
pub fn net_ping_and_64mib_each_way(env: &Env) -> Outcome {
    let s = session(env)?;
    // The transfers below run over mergeable receive buffers: the driver took
    // VIRTIO_NET_F_MRG_RXBUF (bit 15), so a TCP segment from the host spans several chains.
    let features = s.get("net", "features")?;
    ensure!(
        features.as_bytes().get(15) == Some(&b'1'),
        "the guest driver did not take VIRTIO_NET_F_MRG_RXBUF: features {features}"
    );
    let received = s.get("ping", "received")?;
    ensure!(
        received == "3",
        "{received} of 3 pings answered: {}",
        s.tail
    );
    let (bytes, out) = (s.get("net_out", "bytes")?, s.get("net_out", "sha256")?);
    ensure!(
        bytes == NET_BYTES.to_string() && s.get("net_out", "rc")? == "0",
        "guest → host: nc rc {}, {bytes} bytes",
        s.get("net_out", "rc")?
    );
    ensure!(
        out == s.net.1,
        "guest → host: the guest sent sha256 {out}, the host received {}",
        s.net.1
    );
    let got = s.get("net_in", "sha256")?;
    let bytes = s.get("net_in", "bytes")?;
    ensure!(
        bytes == NET_BYTES.to_string(),
        "host → guest: the guest received {bytes} bytes, want {NET_BYTES}"
    );
    ensure!(
        got == s.net.0,
        "host → guest: the host sent sha256 {}, the guest received {got}",
        s.net.0
    );
    Ok(())
}

/// The NoCloud seed mounts (vfat) and `user-data` is the manifest's, byte for byte.
pub fn cloud_init_seed(env: &Env) -> Outcome {
    let s = session(env)?;
    let files = s.get("user_data_sha256", "files")?;
    ensure!(
        files.split(',').any(|f| f == "user-data") && files.split(',').any(|f| f == "meta-data"),
        "seed files {files}, want user-data and meta-data"
    );
    let bytes = s.get("user_data_sha256", "user_data_bytes")?;
    ensure!(
        bytes == USER_DATA.len().to_string(),
        "user-data has {bytes} bytes in the guest, {} in the manifest",
        USER_DATA.len()
    );
    let sha = s.get("user_data_sha256", "user_data_sha256")?;
    ensure!(
        sha == s.user_data_sha,
        "user-data sha256 {sha} in the guest, {} in the manifest",
        s.user_data_sha
    );
    Ok(())
}

/// `/dev/hwrng` is virtio_rng and gives 64 bytes (not all zero).
pub fn hwrng(env: &Env) -> Outcome {
    let s = session(env)?;
    let current = s.get("hwrng", "current")?;
    ensure!(
        current.starts_with("virtio_rng"),
        "rng_current is {current}, not virtio_rng"
    );
    let bytes = s.get("hwrng", "bytes")?;
    ensure!(bytes == "64", "/dev/hwrng gave {bytes} of 64 bytes");
    let hex = s.get("hwrng", "hex")?;
    ensure!(
        hex.len() == 128 && hex.chars().any(|c| c != '0'),
        "/dev/hwrng bytes {hex:?}"
    );
    Ok(())
}

/// The VM of the hung-storage test.
const HUNG_VM: &str = "hung-vmi";
/// How long each step of the hung-storage test may take (a deadline, not a measurement).
const HUNG_STEP: Duration = Duration::from_secs(180);

/// One disk (`vdisk`, cache none) on `dev`, the test kernel and the devices initramfs.
fn hung_manifest(kernel: &Path, initrd: &Path, dev: &str) -> String {
    format!(
        r#"apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata:
  name: {HUNG_VM}
spec:
  domain:
    cpu: {{sockets: 1, cores: 2, threads: 1, dedicatedCpuPlacement: true}}
    memory: {{guest: 256Mi}}
    firmware:
      kernelBoot:
        kernelArgs: "{cmdline} vmhost.action=devices"
        container:
          image: registry.example/testbed-kernel:6.1
          kernelPath: {kernel}
          initrdPath: {initrd}
    devices:
      autoattachGraphicsDevice: false
      disks:
        - name: vdisk
          disk: {{bus: virtio}}
          cache: none
  volumes:
    - name: vdisk
      hostDisk: {{path: {dev}, type: Disk}}
"#,
        cmdline = crate::linux_tests::CMDLINE,
        kernel = kernel.display(),
        initrd = initrd.display(),
    )
}

/// Polls `what` every 100 ms until it gives `Some`, for at most [`HUNG_STEP`].
fn until<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> Result<T, String> {
    let deadline = Instant::now() + HUNG_STEP;
    loop {
        if let Some(v) = f() {
            return Ok(v);
        }
        ensure!(
            Instant::now() < deadline,
            "{what}: not within {HUNG_STEP:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A thread's state letter (`/proc/<pid>/task/<tid>/stat`, after the name).
fn task_state(pid: u32, tid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/stat")).ok()?;
    stat.rsplit_once(") ")?.1.chars().next()
}

/// vmhost's I/O threads that are in uninterruptible sleep (`D`).
pub(crate) fn io_threads_in_d(pid: u32) -> Vec<u32> {
    crate::host::threads(pid)
        .unwrap_or_default()
        .into_iter()
        .filter(|t| t.name.starts_with("vmhost-io"))
        .filter(|t| task_state(pid, t.tid) == Some('D'))
        .map(|t| t.tid)
        .collect()
}

/// Hung storage: the VM's disk is a dm-linear device over a loop device, suspended before
/// vmhost starts, so the guest's first read (the partition scan) leaves vmhost's I/O thread in
/// uninterruptible sleep. Then SIGTERM: vmhost prints its report and its vCPU threads are gone
/// (`/proc/<pid>/task`) while the device is still suspended and the process is alive; after
/// `dmsetup resume` it exits 130 (stopped from outside) and leaves no process behind.
pub fn hung_storage_stops(env: &Env) -> Outcome {
    let a = assets(env)?;
    let file = env.work.join("virtio-hung.img");
    let _ = std::fs::remove_file(&file);
    std::fs::File::create(&file)
        .and_then(|f| f.set_len(16 << 20))
        .map_err(|e| format!("create {}: {e}", file.display()))?;
    let backing = Loop::attach(&file)?;
    let dm =
        crate::dm_log::DmDevice::create("vmhost-hung", 32768, &format!("linear {} 0", backing.0))?;
    let yaml = env.work.join(format!("{HUNG_VM}.yaml"));
    let initrd = env.work.join("guest/initramfs-devices.cpio");
    std::fs::write(&yaml, hung_manifest(&a.vmlinux, &initrd, &dm.dev))
        .map_err(|e| format!("write {}: {e}", yaml.display()))?;
    // Suspended before vmhost starts (opening the disk does no I/O), so the guest's first
    // read, wherever its boot has got to, is the one that hangs: suspending after the start
    // raced a guest that had already scanned the disk, and then nothing ever hung.
    dm.suspend(true)?;
    let vm = env.start(
        HUNG_VM,
        env.command(&["--config", &yaml.to_string_lossy()]),
        2,
    )?;
    let hung = until(
        "vmhost's I/O thread in uninterruptible sleep on the suspended disk",
        || Some(io_threads_in_d(vm.vmm)).filter(|t| !t.is_empty()),
    )
    .map_err(|e| format!("{e}; stderr: {}", vm.stderr()))?;
    println!("     I/O thread(s) {hung:?} in D on the suspended disk; SIGTERM");
    env.signal(vm.pid, libc::SIGTERM)?;
    let out = env.work.join(format!("{HUNG_VM}.out"));
    let report = format!("VM {HUNG_VM}: ");
    let line = until("the report after SIGTERM while the disk hangs", || {
        let text = std::fs::read_to_string(&out).unwrap_or_default();
        text.lines()
            .find(|l| l.starts_with(&report) && l.contains("exit code"))
            .map(str::to_string)
    })
    .map_err(|e| format!("{e}; stderr: {}", vm.stderr()))?;
    // The report is out: now, with the device still suspended, the process must be alive
    // (its I/O thread cannot end) and every vCPU thread gone.
    let threads = crate::host::threads(vm.pid)?;
    let vcpus: Vec<&str> = threads
        .iter()
        .filter(|t| t.name.starts_with("vcpu"))
        .map(|t| t.name.as_str())
        .collect();
    let still_hung = io_threads_in_d(vm.vmm);
    let suspended = dm.suspended()?;
    dm.suspend(false)?;
    let code = env.wait(vm.pid)?;
    ensure!(
        suspended && !still_hung.is_empty(),
        "the device was resumed ({suspended}) or the I/O thread left D ({still_hung:?}) before \
         the report: the test did not hold the storage hung"
    );
    ensure!(
        vcpus.is_empty(),
        "vCPU threads {vcpus:?} still there after the report; stderr: {}",
        vm.stderr()
    );
    ensure!(
        line.contains("(exit code 130)") && code == 130,
        "report {line:?} and exit status {code}, want 130 (stopped from outside); stderr: {}",
        vm.stderr()
    );
    ensure!(
        !Path::new(&format!("/proc/{}", vm.pid)).exists(),
        "vmhost (pid {}) is still there after it was reaped",
        vm.pid
    );
    let stderr = vm.stderr();
    ensure!(
        stderr.contains("still in a device request"),
        "vmhost's stderr does not name the hung I/O thread: {stderr}"
    );
    Ok(())
}
