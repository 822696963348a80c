//! Live migration of a Linux guest across two emulated hosts (issue 22, "Across two hosts").
//!
//! `testbed/run.sh xhost` boots the 2-node host and the 4-node host side by side, each with a
//! virtio NIC on one QEMU UDP socket network on loopback and a third 9p device, tag `xshare`,
//! onto one directory of the machine that both see (mounted at [`XSHARE`] here). Each runs this
//! runner with a role: `--suite xhost --role source` in the 2-node host, `--role target` in
//! the 4-node host. Each side gives its NIC its address, measures the rate its KVM gives a
//! guest's TSC (`KVM_GET_TSC_KHZ` of a probe vCPU, [`tsc_khz`]) and writes it to the common
//! share (`source.tsc`, `target.tsc`).
//!
//! - **Target** (`xhost_target_receives`): `vmhost receive --listen tcp:TARGET:7700` in a
//!   pod-like cgroup with nodes 2–3; after the commit, the source's report (`--json`, from the
//!   common share) must name this host's nodes and PUs and match its own account: `numa_maps`
//!   of the receiving process (the pages on each cell's planned node) and `Cpus_allowed_list`
//!   of each vCPU thread (its planned PU) and the emulator thread; the guest's ticks go on
//!   here with the same boot id, every tick once and in order across the source's console
//!   (from the common share) and this one.
//! - **Source** (`xhost_source_migrates`): the guest of `migration_tests` (2 cells passthrough,
//!   128 MiB of 2 MiB pages, `testbed/guest/migrate.sh`) with its ext4 disk image on the common
//!   share, started on nodes 0–1; waits for the target's listener by polling a TCP connect with
//!   a deadline (the target logs that connection as refused and listens on), then `vmhost ctl
//!   migrate` with the key: ctl exits 0, the report's target cells are on nodes 2–3, the source
//!   exits 0, its pools are whole and its ledger empty.
//!
//! The TSC rule (docs/migration.md, "The guest's TSC rate"; the emulated hosts' KVM has no TSC
//! scaling): a target whose rate is within its KVM's tolerance of the source's
//! ([`TSC_TOLERANCE`], 250 ppm) takes the guest, and its report says so; beyond it the move is
//! refused at the hello. When the two measured rates are further apart than that, both sides
//! assert the refusal instead: ctl exits non-zero naming both rates, the guest ticks on at the
//! source, the target exits 2 with nothing held. `VMHOST_TESTBED_XHOST_TSC_TOLERANCE=0` (set on
//! the target's KVM before it measures) makes any difference a refusal, to exercise that side.

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::linux_tests::{assets, tail};
use crate::migration_tests::{
    check_report, check_tick_sequence, console, free, key_file, ledger_names, make_disk_in,
    migrate, pod, receive, spec, ticks, wait_tick_past, CELL_PAGES, MIGRATE_LIMIT,
};
use crate::snapshot_tests::check_placement;
use crate::vm::{at, num, Env, Running};
use crate::{ensure, host, Outcome};

/// Where the common share (9p tag [`XSHARE_TAG`]) is mounted in both hosts: the guest's disk
/// image and the files the two runners hand each other.
pub const XSHARE: &str = "/xshare";
const XSHARE_TAG: &str = "xshare";
/// The emulated hosts' NIC on the QEMU socket network, and each side's address on it.
const NIC: &str = "eth0";
const SOURCE_ADDR: &str = "192.168.77.1/24";
const TARGET_ADDR: &str = "192.168.77.2/24";
/// The target's listener (it binds only its own address).
const LISTEN: &str = "tcp:192.168.77.2:7700";
const LISTEN_AT: &str = "192.168.77.2:7700";
/// How long one side waits for the other to get somewhere: both hosts boot at once, and the
/// source boots its guest before it migrates (two TCG hosts share this machine's CPUs).
const PEER_LIMIT: Duration = Duration::from_secs(480);
/// How long the target waits for the commit or the refusal: the source's guest boot, the wait
/// for the listener and `ctl migrate` (within each host's 900 s, `VMHOST_TESTBED_TIMEOUT`).
const COMMIT_LIMIT: Duration = Duration::from_secs(600);
/// KVM's TSC tolerance (`kvm.tsc_tolerance_ppm`): within it of the host's rate KVM takes a
/// guest's rate without scaling; vmhost's migration hello applies the target's.
const TSC_TOLERANCE: &str = "/sys/module/kvm/parameters/tsc_tolerance_ppm";

/// The path of a file on the common share.
fn xfile(name: &str) -> PathBuf {
    Path::new(XSHARE).join(name)
}

/// Writes a file on the common share whole: the reader never sees it half-written.
fn write_x(name: &str, text: &str) -> Outcome {
    let tmp = xfile(&format!(".{name}.tmp"));
    std::fs::write(&tmp, text).map_err(|e| format!("write {}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, xfile(name)).map_err(|e| format!("rename {}: {e}", tmp.display()))
}

/// Fails when the `role` side wrote `<role>.failed`: it gave up, and waiting for it is vain.
fn peer_alive(role: &str) -> Outcome {
    match std::fs::read_to_string(xfile(&format!("{role}.failed"))) {
        Ok(why) => Err(format!("the {role} host's side failed: {why}")),
        Err(_) => Ok(()),
    }
}

/// Runs one side's test; a failure is written to `<role>.failed` for the other side.
fn side(role: &str, test: impl FnOnce() -> Outcome) -> Outcome {
    let outcome = test();
    if let Err(why) = &outcome {
        if let Err(e) = write_x(&format!("{role}.failed"), why) {
            println!("  xhost: could not tell the other host: {e}");
        }
    }
    outcome
}

/// Waits for the other host to write `name` (`<role>.<what>`) on the common share; returns its
/// text. Fails at once when that side has failed.
fn wait_x(name: &str, limit: Duration) -> Result<String, String> {
    let role = name.split('.').next().unwrap_or(name);
    let deadline = Instant::now() + limit;
    loop {
        if let Ok(text) = std::fs::read_to_string(xfile(name)) {
            return Ok(text);
        }
        peer_alive(role)?;
        ensure!(
            Instant::now() < deadline,
            "the other host wrote no {XSHARE}/{name} within {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `KVM_GET_TSC_KHZ` of a probe vCPU: the rate this host's KVM runs a new guest's TSC at (the
/// emulated host's calibrated `tsc_khz`: its KVM has no `KVM_CAP_TSC_CONTROL`).
pub fn tsc_khz() -> Result<u32, String> {
    const KVM_CREATE_VM: libc::c_ulong = 0xae01;
    const KVM_CREATE_VCPU: libc::c_ulong = 0xae41;
    const KVM_GET_TSC_KHZ: libc::c_ulong = 0xaea3;
    let kvm = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .map_err(|e| format!("/dev/kvm: {e}"))?;
    let new_fd = |fd: libc::c_int, what: &str| {
        if fd < 0 {
            return Err(format!("{what}: {}", std::io::Error::last_os_error()));
        }
        // SAFETY: `fd` was just returned by a successful KVM ioctl and nothing else owns it.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    };
    // SAFETY: KVM_CREATE_VM takes the machine type (0) by value and returns a new fd; no
    // memory is passed.
    let vm = new_fd(
        unsafe { libc::ioctl(kvm.as_raw_fd(), KVM_CREATE_VM, 0) },
        "KVM_CREATE_VM",
    )?;
    // SAFETY: KVM_CREATE_VCPU takes the vCPU id (0) by value on a VM fd we own.
    let vcpu = new_fd(
        unsafe { libc::ioctl(vm.as_raw_fd(), KVM_CREATE_VCPU, 0) },
        "KVM_CREATE_VCPU",
    )?;
    // SAFETY: KVM_GET_TSC_KHZ takes no argument and returns the rate or -1.
    let khz = unsafe { libc::ioctl(vcpu.as_raw_fd(), KVM_GET_TSC_KHZ, 0) };
    u32::try_from(khz).map_err(|_| format!("KVM_GET_TSC_KHZ: {}", std::io::Error::last_os_error()))
}

/// How far apart two TSC rates are, in ppm of the target's (as KVM measures its tolerance).
fn tsc_ppm(source: u32, target: u32) -> f64 {
    (f64::from(source) - f64::from(target)).abs() * 1e6 / f64::from(target.max(1))
}

/// Whether a guest may move between the two rates, `ppm` being the target KVM's tolerance.
fn tsc_compatible(source: u32, target: u32, ppm: u64) -> bool {
    u64::from(source.abs_diff(target)) * 1_000_000 <= u64::from(target) * ppm
}

/// A host's TSC account: its rate and its KVM's tolerance, as `<role>.tsc` holds them.
#[derive(Debug, Clone, Copy)]
struct Tsc {
    khz: u32,
    tolerance_ppm: u64,
}

/// This host's side of the common ground: the common share mounted, the NIC's address set,
/// this host's TSC rate and tolerance measured and written to `<role>.tsc`.
fn join(role: &str, addr: &str) -> Result<Tsc, String> {
    std::fs::create_dir_all(XSHARE).map_err(|e| format!("mkdir {XSHARE}: {e}"))?;
    let mounts = host::read("/proc/mounts")?;
    if !mounts.lines().any(|l| l.split(' ').nth(1) == Some(XSHARE)) {
        host::run_tool(&[
            "mount",
            "-t",
            "9p",
            "-o",
            "trans=virtio,version=9p2000.L,msize=1048576,cache=none",
            XSHARE_TAG,
            XSHARE,
        ])
        .map_err(|e| format!("the common share (testbed/boot.sh --xshare): {e}"))?;
    }
    ensure!(
        Path::new("/sys/class/net").join(NIC).exists(),
        "no {NIC}: the host was booted without its NIC (testbed/boot.sh --nic)"
    );
    host::run_tool(&["ip", "addr", "add", addr, "dev", NIC])?;
    host::run_tool(&["ip", "link", "set", NIC, "up"])?;
    if let (Ok(ppm), "target") = (std::env::var("VMHOST_TESTBED_XHOST_TSC_TOLERANCE"), role) {
        host::write(TSC_TOLERANCE, &ppm)?;
        println!(
            "  xhost: kvm.tsc_tolerance_ppm set to {ppm} (VMHOST_TESTBED_XHOST_TSC_TOLERANCE)"
        );
    }
    let tolerance = host::read(TSC_TOLERANCE)?;
    let tsc = Tsc {
        khz: tsc_khz()?,
        tolerance_ppm: tolerance
            .trim()
            .parse()
            .map_err(|e| format!("{TSC_TOLERANCE} holds {tolerance:?}: {e}"))?,
    };
    write_x(
        &format!("{role}.tsc"),
        &format!("{} {}", tsc.khz, tsc.tolerance_ppm),
    )?;
    println!(
        "  xhost: the {role} host's KVM_GET_TSC_KHZ: {} kHz (kvm.tsc_tolerance_ppm {})",
        tsc.khz, tsc.tolerance_ppm
    );
    Ok(tsc)
}

/// The other host's TSC account from the common share.
fn peer_tsc(role: &str) -> Result<Tsc, String> {
    let text = wait_x(&format!("{role}.tsc"), PEER_LIMIT)?;
    let bad = |e: &dyn std::fmt::Display| format!("{XSHARE}/{role}.tsc holds {text:?}: {e}");
    let (khz, ppm) = text
        .trim()
        .split_once(' ')
        .ok_or_else(|| bad(&"no space"))?;
    Ok(Tsc {
        khz: khz.parse().map_err(|e| bad(&e))?,
        tolerance_ppm: ppm.parse().map_err(|e| bad(&e))?,
    })
}

/// Prints both rates and what the target's rule makes of them; returns whether the guest may
/// move.
fn tsc_verdict(source: Tsc, target: Tsc) -> bool {
    let ok = tsc_compatible(source.khz, target.khz, target.tolerance_ppm);
    println!(
        "  xhost: TSC source {} kHz, target {} kHz: {:.1} ppm apart, {} the target KVM's \
         {} ppm: the move is {}",
        source.khz,
        target.khz,
        tsc_ppm(source.khz, target.khz),
        if ok { "within" } else { "beyond" },
        target.tolerance_ppm,
        if ok { "expected" } else { "to be refused" }
    );
    ok
}

/// Waits until the target's listener takes a TCP connection (closed at once: the target
/// refuses it for want of the key and listens on).
fn wait_listener(limit: Duration) -> Outcome {
    let addr: SocketAddr = LISTEN_AT.parse().map_err(|e| format!("{LISTEN_AT}: {e}"))?;
    let deadline = Instant::now() + limit;
    loop {
        match TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
            Ok(_) => return Ok(()),
            Err(e) if Instant::now() > deadline || peer_alive("target").is_err() => {
                peer_alive("target")?;
                return Err(format!(
                    "the target's listener {addr} within {limit:?}: {e}"
                ));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(250)),
        }
    }
}

/// The source side (module docs).
pub fn source_migrates(env: &Env) -> Outcome {
    side("source", || source_side(env))
}

fn source_side(env: &Env) -> Outcome {
    let started = Instant::now();
    let tsc = join("source", SOURCE_ADDR)?;
    host::set_2m_pools(&[CELL_PAGES; 2])?;
    let disk = make_disk_in(env, Path::new(XSHARE))?;
    let spec = spec(env, &disk)?.to_string_lossy().into_owned();
    let key = key_file(env, "mig.key", 7)?;
    let src = env.start("migsrc", env.command(&["--config", &spec]), 2)?;
    wait_tick_past(env, &["migsrc"], 0)?;
    let booted = started.elapsed().as_secs_f64();
    wait_listener(PEER_LIMIT)?;
    let compatible = tsc_verdict(tsc, peer_tsc("target")?);
    println!(
        "  xhost: guest ticking after {booted:.1} s, the target listening after {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let out = migrate(env, &src, LISTEN, &key)?;
    write_x("source.report.json", &out.stdout)?;
    let result = if compatible {
        source_after_move(env, &src, &out)
    } else {
        source_after_refusal(env, &src, &out, tsc.khz)
    };
    // The target checks the ticks across both consoles.
    write_x("source.console", &console(env, &["migsrc"]))?;
    println!(
        "  xhost: source side done after {:.1} s",
        started.elapsed().as_secs_f64()
    );
    result
}

/// The source after a move: ctl and the source exit 0, the report names the target's nodes
/// 2–3, every page is back in this host's pools and its ledger is empty.
fn source_after_move(env: &Env, src: &Running, out: &crate::vm::Output) -> Outcome {
    ensure!(
        out.code == 0,
        "ctl migrate: exit {}: {} {}",
        out.code,
        out.stdout,
        out.stderr
    );
    check_report(&out.json()?)?;
    let code = env.wait(src.pid)?;
    ensure!(
        code == 0,
        "the source after the switch: exit {code}: {}",
        src.stderr()
    );
    let pools = free()?;
    ensure!(
        pools == [CELL_PAGES; 2],
        "free 2 MiB pages per node after the source ended: {pools:?}, want {CELL_PAGES} each"
    );
    let live = ledger_names(env)?;
    ensure!(
        live.is_empty(),
        "live ledger entries on the source: {live:?}"
    );
    Ok(())
}

/// The source after a refusal for the TSC: ctl fails naming both rates, the guest ticks on
/// here, and SIGTERM ends it (exit 130).
fn source_after_refusal(env: &Env, src: &Running, out: &crate::vm::Output, tsc: u32) -> Outcome {
    let target = peer_tsc("target")?.khz;
    let said = format!("{} {}", out.stdout, out.stderr);
    ensure!(
        out.code != 0 && said.contains(&tsc.to_string()) && said.contains(&target.to_string()),
        "ctl migrate between TSC rates {tsc} and {target} kHz: exit {}, want non-zero naming \
         both rates: {said}",
        out.code
    );
    let job = out.json().unwrap_or_default();
    println!("  xhost: ctl migrate exit {}: {}", out.code, job["error"]);
    let last = ticks(&console(env, &["migsrc"])).last().map_or(0, |t| t.n);
    wait_tick_past(env, &["migsrc"], last + 2)?;
    env.signal(src.pid, libc::SIGTERM)?;
    let code = env.wait(src.pid)?;
    ensure!(code == 130, "the source guest after SIGTERM: exit {code}");
    Ok(())
}

/// The target side (module docs).
pub fn target_receives(env: &Env) -> Outcome {
    side("target", || target_side(env))
}

fn target_side(env: &Env) -> Outcome {
    let started = Instant::now();
    let tsc = join("target", TARGET_ADDR)?;
    host::set_2m_pools(&[CELL_PAGES; 4])?;
    assets(env)?; // the kernel and initramfs at the paths the source's spec names
    let key = key_file(env, "mig.key", 7)?;
    let pod_b = pod(env, "tbxdst", [2, 3])?;
    let dst = receive(env, "migdst", &pod_b, LISTEN, &key, None)?;
    let source = peer_tsc("source")?;
    let result = if tsc_verdict(source, tsc) {
        target_after_move(env, &dst, source.khz, tsc.khz)
    } else {
        target_after_refusal(env, &dst)
    };
    println!(
        "  xhost: target side done after {:.1} s",
        started.elapsed().as_secs_f64()
    );
    result
}

/// Whether process `pid` has ended (gone, or a zombie not yet reaped).
fn ended(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |s| {
        s.rsplit_once(") ").is_some_and(|(_, r)| r.starts_with('Z'))
    })
}

/// Waits for `vmhost receive` to print `what` on stderr; fails early when it ends first.
fn wait_receive(dst: &Running, what: &str, limit: Duration) -> Outcome {
    let deadline = Instant::now() + limit;
    loop {
        let err = dst.stderr();
        if err.contains(what) {
            return Ok(());
        }
        ensure!(
            !ended(dst.pid),
            "vmhost receive ended before {what:?}: {}",
            tail(&err)
        );
        peer_alive("source")?;
        ensure!(
            Instant::now() < deadline,
            "vmhost receive printed no {what:?} within {limit:?}: {}",
            tail(&err)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The target after the move: the report against this host's account, vmhost's audit, the
/// guest's ticks across both consoles; SIGTERM then ends the VM (exit 130).
fn target_after_move(env: &Env, dst: &Running, guest_khz: u32, host_khz: u32) -> Outcome {
    wait_receive(dst, "migration committed", COMMIT_LIMIT)?;
    let said = format!("TSC: the guest's {guest_khz} kHz, this host's {host_khz} kHz");
    let line = dst
        .stderr()
        .lines()
        .find(|l| l.contains(&said))
        .map(str::trim)
        .map(String::from);
    let line =
        line.ok_or_else(|| format!("the target's report has no {said:?}: {}", dst.stderr()))?;
    println!("  xhost: the target's report: {line}");
    let report = wait_x("source.report.json", MIGRATE_LIMIT)?;
    let job: Value =
        serde_json::from_str(&report).map_err(|e| format!("the source's report: {e}: {report}"))?;
    report_matches_account(&job, dst.vmm)?;
    println!(
        "  xhost: the report's target distances: {}",
        job["target_plan"]["distances"]
    );
    check_placement(
        env,
        dst,
        &[(2, CELL_PAGES), (3, CELL_PAGES)].into_iter().collect(),
    )?;
    let source_console = wait_x("source.console", PEER_LIMIT)?;
    std::fs::write(env.work.join("xsrc.out"), &source_console)
        .map_err(|e| format!("write xsrc.out: {e}"))?;
    let before = ticks(&source_console);
    let boot_id = before
        .first()
        .map(|t| t.boot_id.clone())
        .ok_or("no tick on the source's console")?;
    let last = before.last().map_or(0, |t| t.n);
    wait_tick_past(env, &["xsrc", "migdst"], last + 2)?;
    let seq = check_tick_sequence(env, &["xsrc", "migdst"], &boot_id)?;
    println!(
        "  xhost: the guest (boot id {boot_id}) ticked to n={last} on the source and on to \
         n={} here",
        seq.n
    );
    env.signal(dst.pid, libc::SIGTERM)?;
    let code = env.wait(dst.pid)?;
    ensure!(code == 130, "the migrated VM after SIGTERM: exit {code}");
    let live = ledger_names(env)?;
    ensure!(live.is_empty(), "live ledger entries left: {live:?}");
    Ok(())
}

/// The report's target placement (`target_plan` of `ctl migrate --json`) against this host's
/// own account of process `pid`: each cell's pages on its node (`numa_maps`), each vCPU
/// thread's and the emulator thread's `Cpus_allowed_list`, every PU on the node the plan says.
fn report_matches_account(job: &Value, pid: u32) -> Outcome {
    let plan = at(job, "/target_plan")?;
    let mut want: BTreeMap<u32, u64> = BTreeMap::new();
    for c in at(plan, "/guest_cells")?.as_array().ok_or("guest_cells")? {
        let node = num(&c["host_node"], "a cell's host node")?;
        *want.entry(node).or_default() += c["memory_bytes"].as_u64().unwrap_or(0) >> 21;
    }
    let seen = host::numa_maps_huge(pid)?.remove(&2048).unwrap_or_default();
    ensure!(
        seen == want,
        "the report's cells want 2 MiB pages per node {want:?}; numa_maps of pid {pid} has {seen:?}"
    );
    let threads = host::threads(pid)?;
    let allowed = |name: &str| {
        threads
            .iter()
            .find(|t| t.name == name)
            .map(|t| t.cpus.clone())
            .ok_or_else(|| format!("no thread {name} in /proc/{pid}/task"))
    };
    let mut account = Vec::new();
    for v in at(plan, "/vcpus")?.as_array().ok_or("vcpus")? {
        let (i, pu) = (num(&v["vcpu"], "vcpu")?, num(&v["host_cpu"], "host_cpu")?);
        let node = num(&v["host_node"], "a vCPU's host node")?;
        let cpus = allowed(&format!("vcpu{i}"))?;
        ensure!(
            cpus == [pu] && host::node_cpus(node)?.contains(&pu),
            "the report pins vCPU {i} to PU {pu} of node {node}; here vcpu{i} may run on \
             {cpus:?} and node {node} has PUs {:?}",
            host::node_cpus(node)?
        );
        account.push(format!("vcpu{i}→PU{pu} (node{node})"));
    }
    let emu = crate::vm::u32s(at(plan, "/emulator/host_cpus")?);
    let cpus = allowed("vmhost-emu")?;
    ensure!(
        cpus == emu,
        "the report's emulator PUs {emu:?}; here vmhost-emu may run on {cpus:?}"
    );
    let record = json!({"pages_2m_by_node": seen, "vcpus": account, "emulator": cpus});
    write_x("target.account.json", &record.to_string())?;
    println!("  xhost: the target's own account matches the report: {record}");
    Ok(())
}

/// The target after a refusal for the TSC: `vmhost receive` exits 2 at the hello, every pool
/// whole, no live ledger entry.
fn target_after_refusal(env: &Env, dst: &Running) -> Outcome {
    let deadline = Instant::now() + COMMIT_LIMIT;
    while !ended(dst.pid) {
        ensure!(
            Instant::now() < deadline,
            "vmhost receive still runs after the refusal: {}",
            tail(&dst.stderr())
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let code = env.wait(dst.pid)?;
    let err = dst.stderr();
    let why = err.lines().rev().find(|l| l.contains("kHz")).unwrap_or("");
    println!("  xhost: vmhost receive exit {code}: {}", why.trim());
    ensure!(
        code == 2,
        "vmhost receive for a guest whose TSC is out of tolerance: exit {code}, want 2: {}",
        dst.stderr()
    );
    let pools = free()?;
    ensure!(
        pools == [CELL_PAGES; 4],
        "free 2 MiB pages per node after the refusal: {pools:?}"
    );
    let live = ledger_names(env)?;
    ensure!(live.is_empty(), "live ledger entries left: {live:?}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tsc_tolerance_is_250_ppm_of_the_target() {
        assert!(tsc_compatible(2_000_000, 2_000_000, 250));
        assert!(tsc_compatible(2_000_500, 2_000_000, 250));
        assert!(tsc_compatible(1_999_500, 2_000_000, 250));
        assert!(!tsc_compatible(2_000_501, 2_000_000, 250));
        assert!(!tsc_compatible(2_100_000, 2_000_000, 250));
        assert!(!tsc_compatible(2_000_001, 2_000_000, 0));
        assert!((tsc_ppm(2_000_500, 2_000_000) - 250.0).abs() < 1e-9);
    }
}
