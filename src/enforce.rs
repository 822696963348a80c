//! Envelope enforcement: the VMM in a cgroup of its own (`--cgroup NAME` or
//! `resources.cgroup`) whose cpuset, memory and hugetlb limits are the plan's.
//!
//! The VMM joins the cgroup before guest RAM is allocated, so every page it takes is charged
//! there. When the memory limit is reached:
//! - cgroup v1: the kernel holds the faulting thread (`oom_control`), a watch thread reports
//!   it, removes the cgroup and ends the process with [`EXIT_LIMIT`] and a message naming the
//!   limit and the fix;
//! - cgroup v2: the kernel kills the VMM, so the VMM runs as the child of a supervisor that
//!   stays outside the cgroup and reports the same message and status (`supervise`).
//!
//! Never a silent OOM kill.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result};
use serde_json::{json, Value};
use vmhost_cgroup::{Cgroup, Limits};
use vmhost_plan::Plan;

/// Exit status when the VM was stopped by its envelope's memory limit.
pub const EXIT_LIMIT: u8 = 5;

/// The VMM's cgroup while the VM runs; removed when dropped.
pub struct Enforcement {
    cgroup: Arc<Mutex<Option<Cgroup>>>,
}

impl Enforcement {
    /// Creates cgroup `vmhost/<name>` with the plan's limits, moves this process into it and
    /// starts the limit watch. `release` runs (ledger release) before the process exits on
    /// the limit.
    pub fn enter(
        name: &str,
        plan: &Plan,
        memory_limit: Option<u64>,
        release: (PathBuf, String),
        api_socket: Option<PathBuf>,
    ) -> Result<Arc<Self>> {
        // The pid the ledger admitted the VM under (the supervisor's, after a fork).
        let ledger_pid = std::process::id();
        let mut limits = Limits::from_plan(plan);
        if let Some(bytes) = memory_limit {
            limits.memory_max_bytes = Some(bytes.div_ceil(4096) * 4096);
        }
        let mut cg = Cgroup::create(name, &limits)
            .with_context(|| format!("creating cgroup vmhost/{name}"))?;
        if cg.kills_at_memory_limit() {
            let leftovers = crate::supervise::Leftovers {
                ledger: release.clone(),
                ledger_pid,
                api_socket,
            };
            cg = crate::supervise::split(cg, &leftovers)?;
        }
        cg.add_self()
            .with_context(|| format!("moving vmhost into cgroup vmhost/{name}"))?;
        let watch = cg
            .oom_watch()
            .context("watching the cgroup's memory limit")?;
        let cgroup = Arc::new(Mutex::new(Some(cg)));
        let shared = Arc::clone(&cgroup);
        watch
            .spawn(move |event| {
                eprintln!("vmhost: stopping VM: {event}");
                if let Ok(ledger) = vmhost_ledger::Ledger::open(&release.0) {
                    let _ = ledger.release(&release.1, ledger_pid);
                }
                if let Some(cg) = shared.lock().ok().and_then(|mut g| g.take()) {
                    if let Err(e) = cg.remove() {
                        eprintln!("vmhost: warning: {e}");
                    }
                }
                std::process::exit(i32::from(EXIT_LIMIT));
            })
            .context("starting the memory limit watch")?;
        Ok(Arc::new(Enforcement { cgroup }))
    }

    /// A message naming the limit when the cgroup's memory limit refused a charge (or the
    /// peak came within one page of it), for errors such as a prefault that the limit refused.
    pub fn limit_reached(&self) -> Option<String> {
        let guard = self.cgroup.lock().ok()?;
        let cg = guard.as_ref()?;
        let limit = cg.limits().memory_max_bytes?;
        let peak = cg.memory_peak_bytes().ok().flatten().unwrap_or(0);
        let hit = cg.memory_limit_hit().unwrap_or(false) || peak.saturating_add(4096) >= limit;
        hit.then(|| {
            format!(
                "the VM reached the memory limit of its envelope ({limit} bytes, {:.1} MiB) in cgroup {}; \
                 raise memory.reserved_overhead.added_overhead (or resources.limits.memory) and start it again",
                limit as f64 / f64::from(1u32 << 20),
                cg.dir(vmhost_cgroup::Controller::Memory).map_or_else(|| "vmhost".to_string(), |d| d.display().to_string())
            )
        })
    }

    /// The limits in force and the cgroup's memory usage, for the control API.
    pub fn readings(&self) -> Value {
        let guard = self.cgroup.lock();
        let Some(cg) = guard.as_ref().ok().and_then(|g| g.as_ref()) else {
            return Value::Null;
        };
        json!({
            "limits": cg.read_back().ok().map(|l| json!({
                "cpus": l.cpus, "mems": l.mems, "memory_max_bytes": l.memory_max_bytes, "hugetlb": l.hugetlb,
            })),
            "memory_usage_bytes": cg.memory_usage_bytes().ok(),
            "memory_peak_bytes": cg.memory_peak_bytes().ok().flatten(),
        })
    }
}

impl Drop for Enforcement {
    fn drop(&mut self) {
        if let Some(cg) = self.cgroup.lock().ok().and_then(|mut g| g.take()) {
            if let Err(e) = cg.remove() {
                eprintln!("vmhost: warning: {e}");
            }
        }
    }
}
