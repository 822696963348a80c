//! Live migration of a running Linux guest within the 2-node emulated host, vmhost next to
//! QEMU (issue 22's benchmark): the same vmlinux and initramfs, 1 vCPU, 128 MiB of 2 MiB
//! hugepages on node 0 for the source and node 1 for the target (vmhost: its plan, the pools
//! leave no other room; QEMU: `memory-backend-memfd` with `hugetlb=on`, `host-nodes`,
//! `policy=bind`), over a Unix socket, with a downtime limit of 300 ms on both.
//! vmhost: `vmhost receive --listen unix:…` and `vmhost ctl … migrate unix:… --max-downtime
//! 300`; QEMU: `-incoming unix:…` on the target and, over QMP on the source,
//! `migrate-set-parameters` (`downtime-limit` 300, `max-bandwidth` 100 GiB/s so its 128 MiB/s
//! default does not cap it), `migrate` and `query-migrate` until it ends.
//!
//! The guest (`vmhost.action=beat|dirty`, testbed/guest/dirty.c) prints `B n` on its serial
//! console every 10 ms, idle or while writing 16 MiB/s over a 32 MiB buffer. The runner
//! timestamps every line as it arrives on the source's and the target's stdout; the longest
//! gap between consecutive beats while the migration runs is the downtime seen from outside,
//! reported beside each VMM's own figures (vmhost's report, QEMU's `query-migrate`). Pairs
//! alternate (vmhost, QEMU, vmhost, …), each run on a freshly booted guest. When vmhost's
//! pre-copy does not converge at 300 ms it gives up and the guest runs on; the same guest is
//! then migrated again at [`FALLBACK_DOWNTIME_MS`] so that its figures are measured at all,
//! and the report says so. During each vmhost migration the runner samples the state of its
//! migration threads every 250 ms (which side a slow migration waits for).
//!
//! Then a snapshot of a guest (`ctl snapshot --stop`) is restored to a running guest (spawn
//! to its first beat on the restored vmhost's stdout), alternating with the runner reading
//! the same memory files into 2 MiB hugepages mbound to node 0 (where the restore puts the
//! guest). Emulated timings mean something only as ratios (docs/benchmarks.md); the issue's
//! targets (downtime ≤ 0.5× QEMU's, total time ≤ 1.0×, restore ≤ 1.2× the read) are reported,
//! never asserted: the benchmark fails only when a run fails.
//!
//! Its parts: [`process`] (the VMM processes, their timestamped lines and the beat gaps),
//! [`vmhost`] and [`qemu`] (one migration by each), [`restore`] (restores against reads of
//! the same memory files) and [`report`] (the statistics and the lines printed).

mod process;
mod qemu;
mod report;
mod restore;
mod vmhost;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::Value;

use crate::linux_bench::bench_assets;
use crate::linux_tests::{linux_spec, Assets};
use crate::vm::{run_command_for, Env};
use crate::{host, Outcome};
use qemu::qemu_run;
use report::report_workload;
use restore::restore_vs_read;
use vmhost::vmhost_run;

/// Interleaved pairs (vmhost, QEMU) per workload; restores (and reads) likewise: the least,
/// and the default of [`pairs`].
const PAIRS: usize = 5;

/// The pairs asked for: `VMHOST_BENCH_PAIRS` when it says at least [`PAIRS`], else [`PAIRS`].
fn pairs() -> usize {
    std::env::var("VMHOST_BENCH_PAIRS")
        .ok()
        .and_then(|r| r.parse().ok())
        .filter(|&r| r >= PAIRS)
        .unwrap_or(PAIRS)
}
/// Guest memory in 2 MiB pages (128 MiB): one node's pool holds exactly one guest.
const GUEST_PAGES: u64 = 64;
/// The downtime limit given to both VMMs, ms.
const MAX_DOWNTIME_MS: u64 = 300;
/// QEMU's `max-bandwidth`, bytes/s: far above what the emulated host can move.
const QEMU_BANDWIDTH: u64 = 100 << 30;
/// Beats a guest must have printed (its program running for a second) before a migration.
const WARM_BEATS: usize = 100;
/// Beats the target must print after the switch before the run counts as done.
const AFTER_BEATS: usize = 50;
/// vmhost's pre-copy at [`MAX_DOWNTIME_MS`] gives up after this many seconds (`ctl migrate
/// --timeout`); its round 0 alone takes longer in the emulated host, so it decides after it.
const FIRST_TIMEOUT_S: u64 = 20;
/// When vmhost does not converge at [`MAX_DOWNTIME_MS`], the same guest is migrated again
/// with this downtime limit (2 minutes: the emulated host's pace, see docs/benchmarks.md),
/// so that its downtime and total time are measured at all; reported as such.
const FALLBACK_DOWNTIME_MS: u64 = 120_000;
const FALLBACK_TIMEOUT_S: u64 = 300;
/// How long a guest may take to boot to its first beats (emulated host).
const BOOT_LIMIT: Duration = Duration::from_secs(150);
/// How long one migration, snapshot or restore may take.
const JOB_LIMIT: Duration = Duration::from_secs(120);
/// The targets, reported and never asserted.
const TARGET_DOWNTIME: f64 = 0.5;
const TARGET_TOTAL: f64 = 1.0;
const TARGET_RESTORE: f64 = 1.2;

/// One migration's figures.
#[derive(Debug, Clone, Copy)]
struct Sample {
    /// The longest beat gap seen from outside, ms.
    gap_ms: f64,
    /// The VMM's own downtime, ms.
    own_downtime_ms: f64,
    /// The VMM's own total time, s.
    total_s: f64,
    /// Bytes the VMM sent.
    bytes: f64,
    /// Pre-copy rounds (vmhost) or dirty-bitmap syncs (QEMU).
    rounds: f64,
    /// vmhost only: pre-copy did not converge at [`MAX_DOWNTIME_MS`]; its last estimate of
    /// the downtime, ms (the figures are then those of the run at [`FALLBACK_DOWNTIME_MS`]).
    gave_up: Option<f64>,
}

/// What one benchmark run needs: the assets, the environment, the key and the spec files.
struct Setup<'a> {
    a: Assets,
    env: &'a Env,
    key: PathBuf,
}

impl Setup<'_> {
    /// The release vmhost with the shared run directory and `--api-socket <work>/<name>.sock`.
    fn vmhost(&self, name: &str, args: &[&str]) -> (Command, PathBuf) {
        let sock = self.env.work.join(format!("{name}.sock"));
        let _ = std::fs::remove_file(&sock);
        let mut c = Command::new(&self.a.vmhost_release);
        c.arg("--run-dir")
            .arg(&self.env.run_dir)
            .arg("--api-socket")
            .arg(&sock)
            .args(args);
        (c, sock)
    }

    /// `vmhost ctl --api-socket SOCK args…` (release build) to completion.
    fn ctl(
        &self,
        sock: &Path,
        args: &[&str],
        limit: Duration,
    ) -> Result<crate::vm::Output, String> {
        let mut c = Command::new(&self.a.vmhost_release);
        c.arg("ctl").arg("--api-socket").arg(sock).args(args);
        run_command_for(c, &format!("vmhost ctl {}", args.join(" ")), limit)
    }

    /// The guest's spec for `action` (1 dedicated vCPU, 128 MiB of 2 MiB pages).
    fn spec(&self, action: &str) -> Result<PathBuf, String> {
        let toml = linux_spec(
            "migbench",
            (1, 1),
            "",
            "128Mi",
            &self.a.vmlinux,
            &self.a.initrd,
            action,
        );
        self.env.spec(&format!("migbench-{action}"), &toml)
    }
}

/// A number of a JSON report, or an error naming it.
fn field(v: &Value, path: &str) -> Result<f64, String> {
    v.pointer(path)
        .and_then(Value::as_f64)
        .ok_or_else(|| format!("no number {path} in {v}"))
}

/// The key both vmhost sides use (48 bytes, mode 0600).
fn write_key(env: &Env) -> Result<PathBuf, String> {
    let key = env.work.join("migbench.key");
    std::fs::write(&key, [0x5a; 48]).map_err(|e| format!("write {}: {e}", key.display()))?;
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| format!("chmod {}: {e}", key.display()))?;
    Ok(key)
}

/// Live migration, vmhost next to QEMU, idle and dirtying guests; then restore vs a read.
pub fn migration_vs_qemu(env: &Env) -> Outcome {
    let a = bench_assets(env)?;
    let s = Setup {
        key: write_key(env)?,
        a,
        env,
    };
    for (name, action) in [("idle", "beat"), ("dirty 16 MiB/s over 32 MiB", "dirty")] {
        let (mut v, mut q) = (Vec::new(), Vec::new());
        for i in 0..pairs() {
            // Source on node0, target on node1: each pool holds exactly one guest.
            host::set_2m_pools(&[GUEST_PAGES, GUEST_PAGES])?;
            let one = vmhost_run(&s, action).map_err(|e| format!("{name}, vmhost run {i}: {e}"))?;
            println!("     {name} pair {i}: vmhost {one:.3?}");
            v.push(one);
            host::set_2m_pools(&[GUEST_PAGES, GUEST_PAGES])?;
            let one = qemu_run(&s, action).map_err(|e| format!("{name}, QEMU run {i}: {e}"))?;
            println!("     {name} pair {i}: QEMU   {one:.3?}");
            q.push(one);
        }
        report_workload(name, &v, &q);
    }
    restore_vs_read(&s)
}
