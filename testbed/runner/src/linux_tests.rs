//! Linux guests under vmhost: Debian's 6.1 kernel (vmlinux through PVH, bzImage through the
//! 64-bit boot protocol) with the busybox initramfs of `testbed/guest/init`, which reports the
//! guest's own view as `GUEST key=value` lines on its serial console (vmhost's stdout) and then
//! powers off, reboots, panics or waits for the ACPI power button, as `vmhost.action=` asks.
//!
//! What is checked, against the plan and the host: the guest reached `/init`; `nproc` and the
//! online CPUs; one guest NUMA node per cell with the cell's CPUs, its memory (present pages)
//! and distances equal to the host's between the cells' nodes (the asymmetric matrix on the
//! 4-node host); sockets, cores and threads in the guest's sysfs topology; hugepage backing by
//! vmhost's audit and `numa_maps`; and the lifecycle: `poweroff -f` exit 0, `reboot -f` exit 0
//! (a reboot ends the VM), a kernel panic exit 4 through pvpanic, SIGTERM exit 130, and
//! `PUT /vm/shutdown` powering the guest off through its power button. Two guests boot their
//! kernel and initramfs in place from a second 9p mount of the share with `msize=262144`
//! (`/mnt-small`), where a single `read()` may return less than asked.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::host;
use crate::memory_tests::check_residency;
use crate::vm::{at, num, u32s, Env, Running};
use crate::{ensure, Outcome};

/// How long a guest may take to reach its `/init` and report (emulated host, debug vmhost).
const BOOT_LIMIT: Duration = Duration::from_secs(100);
/// The kernel command line of every test guest (the action is appended). `loglevel=4` keeps
/// the serial console short: every byte is a VM exit.
pub const CMDLINE: &str = "console=ttyS0 loglevel=4";

/// The guest's kernel images and initramfs, copied once from the share (9p) to `/tmp`.
#[derive(Debug, Clone)]
pub struct Assets {
    /// The uncompressed ELF kernel (PVH entry).
    pub vmlinux: PathBuf,
    /// The same kernel as a bzImage.
    pub bzimage: PathBuf,
    /// The busybox initramfs.
    pub initrd: PathBuf,
    /// The QEMU bundle (binary, libraries, firmware) of the boot-time benchmark.
    pub qemu: PathBuf,
    /// A release build of vmhost, for the boot-time benchmark (copied by `run.sh bench` only).
    pub vmhost_release: PathBuf,
}

/// The assets, copied from `./guest` (the share) to `/tmp/testbed/guest` on first use.
pub fn assets(env: &Env) -> Result<Assets, String> {
    static ASSETS: OnceLock<Result<Assets, String>> = OnceLock::new();
    ASSETS.get_or_init(|| copy_assets(env)).clone()
}

fn copy_assets(env: &Env) -> Result<Assets, String> {
    let src = std::fs::canonicalize("guest").map_err(|e| {
        format!("guest assets ./guest in the share: {e} (testbed/run.sh copies them)")
    })?;
    let dst = env.work.join("guest");
    let status = std::process::Command::new("cp")
        .arg("-a")
        .arg(&src)
        .arg(&env.work)
        .status()
        .map_err(|e| format!("cp guest assets: {e}"))?;
    ensure!(
        status.success(),
        "cp -a {} {}: {status}",
        src.display(),
        env.work.display()
    );
    let a = Assets {
        vmlinux: dst.join("vmlinux"),
        bzimage: dst.join("bzImage"),
        initrd: dst.join("initramfs.cpio"),
        qemu: dst.join("qemu"),
        vmhost_release: dst.join("vmhost-release"),
    };
    // The QEMU bundle and the release vmhost are the benchmarks' and checked there.
    for p in [&a.vmlinux, &a.bzimage, &a.initrd] {
        ensure!(p.exists(), "guest asset {} missing", p.display());
    }
    Ok(a)
}

/// A Linux guest's spec: `sockets` × `cores` dedicated vCPUs with 2 MiB hugepages.
pub fn linux_spec(
    name: &str,
    (sockets, cores): (u32, u32),
    extra_cpu: &str,
    memory: &str,
    kernel: &Path,
    initrd: &Path,
    action: &str,
) -> String {
    format!(
        "name = \"{name}\"\n[cpu]\nsockets = {sockets}\ncores = {cores}\nthreads = 1\n\
         dedicated_cpu_placement = true\n{extra_cpu}\n\
         [memory]\nguest = \"{memory}\"\nhugepages = {{ page_size = \"2Mi\" }}\n\
         [boot]\nkernel = \"{}\"\ninitrd = \"{}\"\ncmdline = \"{CMDLINE} vmhost.action={action}\"\n",
        kernel.display(),
        initrd.display()
    )
}

/// The `GUEST` lines of a serial log as key=value maps.
pub(crate) fn guest_lines(serial: &str) -> Vec<BTreeMap<String, String>> {
    serial
        .lines()
        .filter_map(|l| l.trim_end_matches('\r').strip_prefix("GUEST "))
        .map(|l| {
            l.split_whitespace()
                .filter_map(|kv| kv.split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        })
        .collect()
}

/// The value of `key` on the first `GUEST` line that has it.
fn guest_value(lines: &[BTreeMap<String, String>], key: &str) -> Option<String> {
    lines.iter().find_map(|l| l.get(key).cloned())
}

/// Up to `n` console lines after the first line that is `marker`, for failure messages: what
/// the guest's kernel printed on its way down (`reboot: Power down` before its ACPI S5 write),
/// which the output's tail, vmhost's report, leaves out.
fn after_line(serial: &str, marker: &str, n: usize) -> String {
    let after: Vec<&str> = serial
        .lines()
        .skip_while(|l| l.trim_end() != marker)
        .skip(1)
        .take(n)
        .collect();
    match after.is_empty() {
        true => format!("(no line after {marker:?})"),
        false => after.join(" | "),
    }
}

/// The serial log's tail, for failure messages.
pub(crate) fn tail(serial: &str) -> String {
    let lines: Vec<&str> = serial.lines().collect();
    let last = lines[lines.len().saturating_sub(12)..].join(" | ");
    match oops(&lines) {
        Some(oops) => format!("{last} || the guest kernel's own report: {oops}"),
        None => last,
    }
}

/// The guest kernel's report of a panic, oops or CPU exception, if the console holds one: up
/// to 30 lines from its first line. The tail alone ends with vmhost's report, after it.
fn oops(lines: &[&str]) -> Option<String> {
    const MARKS: [&str; 7] = [
        "Kernel panic",
        "BUG:",
        "Oops:",
        "general protection fault",
        "invalid opcode",
        "double fault",
        "unable to handle page fault",
    ];
    let first = lines
        .iter()
        .position(|l| MARKS.iter().any(|m| l.contains(m)))?;
    Some(lines[first..lines.len().min(first + 30)].join(" | "))
}

/// Checks `nproc`, the online CPUs, each guest node (CPUs, memory, distances) and each CPU's
/// sysfs topology against `plan`.
fn check_guest_view(serial: &str, plan: &Value) -> Outcome {
    ensure!(
        serial.contains("GUEST-INIT"),
        "the guest never reached /init: {}",
        tail(serial)
    );
    let lines = guest_lines(serial);
    let vcpus = at(plan, "/vcpus")?.as_array().ok_or("vcpus")?;
    let n = vcpus.len();
    ensure!(
        guest_value(&lines, "nproc") == Some(n.to_string()),
        "guest nproc {:?}, the plan has {n} vCPUs",
        guest_value(&lines, "nproc")
    );
    let online = guest_value(&lines, "online").unwrap_or_default();
    ensure!(
        host::parse_list(&online)? == (0..u32::try_from(n).unwrap_or(0)).collect::<Vec<_>>(),
        "guest online CPUs {online:?}, want 0-{}",
        n - 1
    );
    check_guest_nodes(&lines, plan)?;
    check_guest_topology(&lines, vcpus)
}

fn check_guest_nodes(lines: &[BTreeMap<String, String>], plan: &Value) -> Outcome {
    let cells = at(plan, "/guest_cells")?.as_array().ok_or("guest_cells")?;
    let nodes: Vec<_> = lines.iter().filter(|l| l.contains_key("node")).collect();
    ensure!(
        nodes.len() == cells.len(),
        "the guest sees {} NUMA node(s), the plan has {} cell(s)",
        nodes.len(),
        cells.len()
    );
    let host_nodes: Vec<u32> = cells
        .iter()
        .map(|c| num(&c["host_node"], "a cell's host node"))
        .collect::<Result<_, _>>()?;
    for (i, cell) in cells.iter().enumerate() {
        let node = nodes
            .iter()
            .find(|l| l.get("node").map(String::as_str) == Some(&i.to_string()))
            .ok_or_else(|| format!("no guest node{i}"))?;
        let cpus = host::parse_list(node.get("cpus").map_or("", String::as_str))?;
        ensure!(
            cpus == u32s(&cell["vcpus"]),
            "guest node{i} has CPUs {cpus:?}, cell {i} has vCPUs {}",
            cell["vcpus"]
        );
        let want_kb = cell["memory_bytes"].as_u64().unwrap_or(0) / 1024;
        let kb: u64 = node
            .get("present_kb")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        // Node 0 lacks the BIOS area (0xa0000-0x100000) and page 0: at most 1 MiB less.
        ensure!(
            kb <= want_kb && kb + 1024 >= want_kb,
            "guest node{i} has {kb} KiB present, cell {i} has {want_kb} KiB"
        );
        let dist: Vec<u32> = node
            .get("distance")
            .map_or("", String::as_str)
            .split(',')
            .map(|d| d.parse().map_err(|e| format!("guest distance {d:?}: {e}")))
            .collect::<Result<_, _>>()?;
        let host_row = host::distances(host_nodes[i])?;
        let want: Vec<u32> = host_nodes
            .iter()
            .map(|&h| host_row.get(h as usize).copied().unwrap_or(0))
            .collect();
        ensure!(
            dist == want,
            "guest node{i} distances {dist:?}, the host's between the cells' nodes {host_nodes:?} are {want:?}"
        );
    }
    Ok(())
}

fn check_guest_topology(lines: &[BTreeMap<String, String>], vcpus: &[Value]) -> Outcome {
    for v in vcpus {
        let i = num(&v["vcpu"], "vcpu")?;
        let cpu = lines
            .iter()
            .find(|l| l.get("cpu") == Some(&i.to_string()))
            .ok_or_else(|| format!("no topology line for guest cpu{i}"))?;
        let get = |k: &str| cpu.get(k).cloned().unwrap_or_default();
        let (socket, core) = (num(&v["socket"], "socket")?, num(&v["core"], "core")?);
        ensure!(
            get("package") == socket.to_string() && get("core") == core.to_string(),
            "guest cpu{i}: package {} core {}, the plan has socket {socket} core {core}",
            get("package"),
            get("core")
        );
        let same = |f: &dyn Fn(&Value) -> bool| -> Vec<u32> {
            vcpus
                .iter()
                .filter(|w| f(w))
                .filter_map(|w| w["vcpu"].as_u64())
                .filter_map(|w| u32::try_from(w).ok())
                .collect()
        };
        let threads = same(&|w| w["socket"] == v["socket"] && w["core"] == v["core"]);
        let cores = same(&|w| w["socket"] == v["socket"]);
        ensure!(
            host::parse_list(&get("threads"))? == threads && host::parse_list(&get("cores"))? == cores,
            "guest cpu{i}: thread siblings {} and core siblings {}, the plan gives {threads:?} and {cores:?}",
            get("threads"),
            get("cores")
        );
    }
    Ok(())
}

/// Waits until the background VM's serial log (its stdout file) contains `marker`.
fn wait_for_serial(vm: &Running, out: &Path, marker: &str) -> Result<String, String> {
    let deadline = Instant::now() + BOOT_LIMIT;
    loop {
        let ended = vm.ended();
        let serial = std::fs::read_to_string(out).unwrap_or_default();
        if serial.contains(marker) {
            return Ok(serial);
        }
        if ended {
            return Err(format!(
                "the VM ended before {marker:?} was on the guest console: {}; stderr: {}",
                tail(&serial),
                vm.stderr()
            ));
        }
        if Instant::now() > deadline {
            return Err(format!(
                "no {marker:?} on the guest console within {BOOT_LIMIT:?}: {}; stderr: {}; \
                 the VMM's threads: {}",
                tail(&serial),
                vm.stderr(),
                host::thread_states(vm.vmm)
            ));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// vmlinux (PVH), 2 sockets × 2 cores on the two nodes: the guest sees two nodes with the
/// plan's CPUs, memory and the host's distances, the planned topology, hugepage-backed RAM on
/// the planned nodes; `PUT /vm/shutdown` presses the power button and the guest powers off.
pub fn vmlinux_two_cells_acpi_shutdown(env: &Env) -> Outcome {
    let a = assets(env)?;
    host::set_2m_pools(&[64, 64])?;
    let extra = "numa = { guest_mapping_passthrough = true }";
    // The guest's power-off gets 120 s instead of the default 30: a nested guest here can
    // stall for tens of seconds (docs/testing.md); it must still power itself off.
    let toml = format!(
        "termination_grace_period_seconds = 120\n{}",
        linux_spec(
            "lin2cell",
            (2, 2),
            extra,
            "256Mi",
            &a.vmlinux,
            &a.initrd,
            "wait",
        )
    );
    let spec = env.spec("lin2cell", &toml)?;
    let plan = env.plan(&spec)?;
    let vm = env.start(
        "lin2cell",
        env.command(&["--config", &spec.to_string_lossy()]),
        4,
    )?;
    let out = env.work.join("lin2cell.out");
    let serial = wait_for_serial(&vm, &out, "GUEST-WAITING")?;
    check_guest_view(&serial, &plan)?;
    let lines = guest_lines(&serial);
    ensure!(
        guest_value(&lines, "clocksource").as_deref() == Some("kvm-clock")
            && guest_value(&lines, "clockevent").as_deref() == Some("lapic-deadline"),
        "the guest's clocksource {:?} and clock event device {:?}, want kvm-clock and the \
         local APIC timer in TSC-deadline mode (lapic-deadline)",
        guest_value(&lines, "clocksource"),
        guest_value(&lines, "clockevent")
    );
    ensure!(
        !serial.contains("power_button=none"),
        "the guest found no ACPI power button: {}",
        tail(&serial)
    );
    let seen = check_residency(env, &vm, &plan, 2048)?;
    ensure!(
        seen.len() == 2,
        "guest RAM on {} node(s), want 2",
        seen.len()
    );
    let code = env.shutdown(&vm)?;
    let serial = std::fs::read_to_string(&out).unwrap_or_default();
    ensure!(
        code == 0 && serial.contains("GUEST power button pressed") && serial.contains("PoweredOff"),
        "after PUT /vm/shutdown: exit {code}, want 0 with the guest powering off itself; the \
         guest's last GUEST lines: {}; the console after the power button: {}; the output's \
         tail: {}; stderr: {}",
        serial
            .lines()
            .filter(|l| l.starts_with("GUEST"))
            .rev()
            .take(3)
            .collect::<Vec<_>>()
            .join(" | "),
        after_line(&serial, "GUEST power button pressed", 16),
        tail(&serial),
        vm.stderr()
    );
    Ok(())
}

/// Runs a Linux guest to its end and returns (exit status, stdout = serial + report).
fn run_guest(env: &Env, name: &str, toml: &str) -> Result<(i32, String), String> {
    let spec = env.spec(name, toml)?;
    let out = env.run(&["--config", &spec.to_string_lossy()])?;
    Ok((out.code, out.stdout + "\nstderr: " + &out.stderr))
}

/// bzImage, 1 vCPU: the guest reaches /init, sees one CPU, and its kernel panic (sysrq `c`)
/// ends the VM with exit 4 through the pvpanic device.
pub fn bzimage_one_vcpu_panic_exit_4(env: &Env) -> Outcome {
    let a = assets(env)?;
    host::set_2m_pools(&[128, 0])?;
    let toml = linux_spec(
        "linpanic",
        (1, 1),
        "",
        "256Mi",
        &a.bzimage,
        &a.initrd,
        "panic",
    );
    let plan = env.plan(&env.spec("linpanic", &toml)?)?;
    let (code, out) = run_guest(env, "linpanic", &toml)?;
    check_guest_view(&out, &plan)?;
    ensure!(
        code == 4 && out.contains("guest kernel panic (pvpanic)"),
        "a guest kernel panic gave exit {code} (want 4, reported as a pvpanic panic): {}",
        tail(&out)
    );
    // The Super I/O probe (ports 0x2e/0x2f/0x4e/0x4f) Debian's kernel makes on every boot is
    // a routine guest action, logged at debug level: no warning on stderr.
    let probes: Vec<&str> = out
        .lines()
        .filter(|l| l.contains("unknown I/O port"))
        .filter(|l| {
            ["0x2e", "0x2f", "0x4e", "0x4f"]
                .iter()
                .any(|p| l.contains(p))
        })
        .collect();
    ensure!(
        probes.is_empty(),
        "the boot's Super I/O probe was warned about: {probes:?}"
    );
    Ok(())
}

/// vmlinux, 2 vCPUs: `poweroff -f` is exit 0 (powered off); `reboot -f` is exit 0 too, and the
/// VM ends (vmhost does not restart a guest).
pub fn vmlinux_two_vcpus_poweroff_and_reboot(env: &Env) -> Outcome {
    let a = assets(env)?;
    host::set_2m_pools(&[128, 0])?;
    for (action, want) in [("poweroff", "PoweredOff"), ("reboot", "rebooted")] {
        let name = format!("lin{action}");
        let toml = linux_spec(&name, (1, 2), "", "256Mi", &a.vmlinux, &a.initrd, action);
        let plan = env.plan(&env.spec(&name, &toml)?)?;
        let (code, out) = run_guest(env, &name, &toml)?;
        check_guest_view(&out, &plan).map_err(|e| {
            // The VM's lines and each vCPU's outcome (how a reboot came: keyboard controller,
            // reset register, port 0xcf9 or a triple fault).
            let report: Vec<&str> = out
                .lines()
                .filter(|l| {
                    l.starts_with("VM ")
                        || ["rebooted", "powered off", "triple"]
                            .iter()
                            .any(|w| l.contains(w))
                })
                .collect();
            format!(
                "`{action}` boot: exit {code}, report {report:?}: {e}; the console and stderr: {}",
                tail(&out)
            )
        })?;
        ensure!(
            code == 0 && out.contains(want),
            "`{action} -f` in the guest: exit {code}, want 0 and {want:?} in the report: {}",
            tail(&out)
        );
    }
    Ok(())
}

/// bzImage, 2 vCPUs on one socket: SIGTERM to vmhost stops the running guest (exit 130).
pub fn bzimage_two_vcpus_sigterm_exit_130(env: &Env) -> Outcome {
    let a = assets(env)?;
    host::set_2m_pools(&[128, 0])?;
    let toml = linux_spec(
        "linterm",
        (1, 2),
        "",
        "256Mi",
        &a.bzimage,
        &a.initrd,
        "wait",
    );
    let spec = env.spec("linterm", &toml)?;
    let plan = env.plan(&spec)?;
    let vm = env.start(
        "linterm",
        env.command(&["--config", &spec.to_string_lossy()]),
        2,
    )?;
    let serial = wait_for_serial(&vm, &env.work.join("linterm.out"), "GUEST-WAITING")?;
    check_guest_view(&serial, &plan)?;
    env.signal(vm.pid, libc::SIGTERM)?;
    let code = env.wait(vm.pid)?;
    ensure!(
        code == 130,
        "SIGTERM gave exit {code}, want 130; stderr: {}",
        vm.stderr()
    );
    Ok(())
}

/// 4-node host, bzImage, one guest cell per node (4 sockets × 1 core, passthrough): the guest sees the
/// asymmetric distance matrix exactly, one CPU and 64 MiB per node, and powers off (exit 0).
pub fn four_cells_asymmetric(env: &Env) -> Outcome {
    let a = assets(env)?;
    host::set_2m_pools(&[32, 32, 32, 32])?;
    let extra = "numa = { guest_mapping_passthrough = true }";
    let toml = linux_spec(
        "lin4cell",
        (4, 1),
        extra,
        "256Mi",
        &a.bzimage,
        &a.initrd,
        "poweroff",
    );
    let plan = env.plan(&env.spec("lin4cell", &toml)?)?;
    let cells = at(&plan, "/guest_cells")?.as_array().map_or(0, Vec::len);
    ensure!(cells == 4, "the plan has {cells} guest cells, want 4");
    let (code, out) = run_guest(env, "lin4cell", &toml)?;
    check_guest_view(&out, &plan)?;
    let rows: Vec<String> = guest_lines(&out)
        .iter()
        .filter_map(|l| l.get("distance").cloned())
        .collect();
    ensure!(
        rows.iter().any(|r| r == "18,10,28,22"),
        "the guest's distance rows {rows:?} are not the asymmetric host matrix"
    );
    ensure!(code == 0, "exit {code} after poweroff: {}", tail(&out));
    Ok(())
}

/// Where `testbed/init` mounts the share a second time, with `msize=262144` and the default
/// cache mode (issue 23: a kernel on such a mount failed to load).
const SMALL_MSIZE_MOUNT: &str = "/mnt-small";

/// The guest assets' directory on the `msize=262144` mount, after checking in `/proc/mounts`
/// that it is a 9p mount with that msize.
fn small_msize_guest_dir() -> Result<PathBuf, String> {
    let mounts = host::read("/proc/mounts")?;
    let line = mounts
        .lines()
        .find(|l| l.split_whitespace().nth(1) == Some(SMALL_MSIZE_MOUNT))
        .ok_or_else(|| format!("nothing is mounted at {SMALL_MSIZE_MOUNT} (testbed/init)"))?;
    ensure!(
        line.split_whitespace().nth(2) == Some("9p") && line.contains("msize=262144"),
        "{SMALL_MSIZE_MOUNT} is not a 9p mount with msize=262144: {line}"
    );
    Ok(Path::new(SMALL_MSIZE_MOUNT).join("guest"))
}

/// Prints what one `read()` of all of `path` returns, with the file opened in blocking mode
/// and with `O_NONBLOCK` (as vmhost opened images before issue 23): fewer bytes than asked is
/// the short read a loader has to loop over.
fn note_one_read(path: &Path) -> Outcome {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let mut counts = Vec::new();
    for (mode, flags) in [("blocking", 0), ("O_NONBLOCK", libc::O_NONBLOCK)] {
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(flags)
            .open(path)
            .map_err(|e| format!("open {}: {e}", path.display()))?;
        let len = file
            .metadata()
            .map_err(|e| format!("stat {}: {e}", path.display()))?
            .len();
        let mut buf = vec![0u8; usize::try_from(len).map_err(|e| e.to_string())?];
        let got = file
            .read(&mut buf)
            .map_err(|e| format!("read {}: {e}", path.display()))?;
        counts.push(format!("{mode} {got} of {len}"));
    }
    println!(
        "     one read() of {}: {}",
        path.display(),
        counts.join(", ")
    );
    Ok(())
}

/// Boots `image` (`bzImage` or `vmlinux`) and the initramfs straight from the `msize=262144`
/// 9p mount (no copy): the guest reaches its `/init`, sees its CPU and memory, and powers off.
fn boot_from_small_msize(env: &Env, image: &str) -> Outcome {
    let dir = small_msize_guest_dir()?;
    let (kernel, initrd) = (dir.join(image), dir.join("initramfs.cpio"));
    note_one_read(&kernel)?;
    note_one_read(&initrd)?;
    note_one_read(&Path::new("guest").join(image))?;
    host::set_2m_pools(&[128, 0])?;
    let name = format!("lin9p{}", image.to_ascii_lowercase());
    let toml = linux_spec(&name, (1, 1), "", "256Mi", &kernel, &initrd, "poweroff");
    let plan = env.plan(&env.spec(&name, &toml)?)?;
    let (code, out) = run_guest(env, &name, &toml)?;
    check_guest_view(&out, &plan).map_err(|e| {
        format!(
            "{} with the initramfs from {SMALL_MSIZE_MOUNT}: exit {code}: {e}; {}",
            kernel.display(),
            tail(&out)
        )
    })?;
    ensure!(
        code == 0 && out.contains("PoweredOff"),
        "`poweroff -f` in the guest booted from {}: exit {code}, want 0: {}",
        kernel.display(),
        tail(&out)
    );
    Ok(())
}

/// A bzImage and initramfs on a 9p mount with `msize=262144` boot in place (issue 23).
pub fn bzimage_from_9p_msize_256k(env: &Env) -> Outcome {
    boot_from_small_msize(env, "bzImage")
}

/// A vmlinux (PVH) and initramfs on a 9p mount with `msize=262144` boot in place (issue 23).
pub fn vmlinux_from_9p_msize_256k(env: &Env) -> Outcome {
    boot_from_small_msize(env, "vmlinux")
}

#[cfg(test)]
mod tests {
    use super::{after_line, tail};

    #[test]
    fn the_console_after_the_power_button_is_quoted_up_to_n_lines() {
        let serial = "GUEST-WAITING x\nGUEST power button pressed\n[ 9.1] reboot: Power down\nVM report\nmore\n";
        assert_eq!(
            after_line(serial, "GUEST power button pressed", 2),
            "[ 9.1] reboot: Power down | VM report"
        );
        assert!(after_line(
            "GUEST power button pressed\n",
            "GUEST power button pressed",
            2
        )
        .starts_with("(no line after"));
        assert!(after_line("other\n", "GUEST power button pressed", 2).starts_with("(no line"));
    }

    #[test]
    fn a_guest_oops_is_quoted_beside_the_tail() {
        let mut serial = String::from("GUEST cpu=0 package=0\n[    2.1] BUG: unable to handle page fault for address: 0\n[    2.1] RIP: 0010:foo\n");
        for i in 0..20 {
            serial.push_str(&format!("vmhost report line {i}\n"));
        }
        let t = tail(&serial);
        let (last, report) = t.split_once(" || ").expect("the tail, then the report");
        assert!(last.contains("vmhost report line 19"), "{t}");
        assert!(!last.contains("vmhost report line 7 "), "{t}");
        assert!(
            report.starts_with("the guest kernel's own report: [    2.1] BUG: unable"),
            "{t}"
        );
        assert!(report.contains("RIP: 0010:foo"), "{t}");
        assert!(!tail("a\nb\n").contains("own report"));
    }
}
