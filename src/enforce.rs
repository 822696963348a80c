//! Envelope enforcement: the VMM in a cgroup of its own (`--cgroup NAME` or
//! `resources.cgroup`) whose cpuset, memory and hugetlb limits are the plan's.
//!
//! The VMM joins the cgroup before guest RAM is allocated, so every page it takes is charged
//! there. When the memory limit is reached:
//! - cgroup v1: the kernel holds the faulting thread (`oom_control`), a watch thread reports
//!   it, releases the ledger entry, removes the cgroup and the API socket, restores the
//!   terminal and ends the process with [`EXIT_LIMIT`] and a message naming the limit and the
//!   fix;
//! - cgroup v2: the kernel kills the VMM, so the VMM runs as the child of a supervisor that
//!   stays outside the cgroup and reports the same message and status after the same clean-up
//!   (`supervise`).
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
    /// Files the limit exit removes (the API and vsock sockets): `process::exit` runs no
    /// destructor.
    leftovers: Arc<Mutex<Vec<PathBuf>>>,
    /// The envelope's PUs, the cpuset once guest RAM is prefaulted.
    envelope_cpus: Vec<u32>,
}

impl Enforcement {
    /// Creates cgroup `vmhost/<name>` with the plan's limits, moves this process into it and
    /// starts the limit watch. `release` runs (ledger release) before the process exits on
    /// the limit, which also removes the vsock socket of the plan's vsock device.
    pub fn enter(
        name: &str,
        plan: &Plan,
        memory_limit: Option<u64>,
        release: (PathBuf, String),
        api_socket: Option<PathBuf>,
    ) -> Result<Arc<Self>> {
        let vsock_socket = plan
            .devices
            .spec
            .vsock
            .as_ref()
            .and_then(|v| v.socket.clone());
        // The pid the ledger admitted the VM under (the supervisor's, after a fork).
        let ledger_pid = std::process::id();
        let mut limits = Limits::from_plan(plan);
        // Prefault workers run on their node's PUs, which the envelope's cpuset need not
        // hold: the cpuset starts wide enough for them and narrows to the envelope once guest
        // RAM is in place (`narrow_after_prefault`); the memory is charged here all along.
        let envelope_cpus = limits.cpus.clone();
        limits.cpus.extend(
            plan.guest_cells
                .iter()
                .flat_map(|c| c.memory_parts())
                .flat_map(|p| p.prefault_cpus.to_vec()),
        );
        limits.cpus.sort_unstable();
        limits.cpus.dedup();
        if let Some(bytes) = memory_limit {
            let rounded = bytes.checked_next_multiple_of(4096).ok_or_else(|| crate::Exit {
                code: crate::EXIT_INVALID,
                message: format!(
                    "--cgroup-memory-limit = {bytes}: rounded up to whole 4 KiB pages it does not fit in 64 bits; give a smaller limit"
                ),
            })?;
            limits.memory_max_bytes = Some(rounded);
        }
        let mut cg = Cgroup::create(name, &limits)
            .with_context(|| format!("creating cgroup vmhost/{name}"))?;
        if cg.kills_at_memory_limit() {
            let leftovers = crate::supervise::Leftovers {
                ledger: release.clone(),
                ledger_pid,
                api_socket,
                vsock_socket: vsock_socket.clone(),
            };
            cg = crate::supervise::split(cg, &leftovers)?;
        }
        cg.add_self()
            .with_context(|| format!("moving vmhost into cgroup vmhost/{name}"))?;
        let watch = cg
            .oom_watch()
            .context("watching the cgroup's memory limit")?;
        let cgroup = Arc::new(Mutex::new(Some(cg)));
        let leftovers: Arc<Mutex<Vec<PathBuf>>> =
            Arc::new(Mutex::new(vsock_socket.into_iter().collect()));
        let (shared, files) = (Arc::clone(&cgroup), Arc::clone(&leftovers));
        watch
            .spawn(move |event| {
                eprintln!("vmhost: stopping VM: {event}");
                limit_exit_cleanup(&release, ledger_pid, &shared, &files);
                std::process::exit(i32::from(EXIT_LIMIT));
            })
            .context("starting the memory limit watch")?;
        Ok(Arc::new(Enforcement {
            cgroup,
            leftovers,
            envelope_cpus,
        }))
    }

    /// Narrows the cpuset to the envelope's PUs once the prefault workers are done.
    pub fn narrow_after_prefault(&self) -> Result<()> {
        let mut guard = self
            .cgroup
            .lock()
            .map_err(|_| anyhow::anyhow!("cgroup lock poisoned"))?;
        if let Some(cg) = guard.as_mut() {
            if cg.limits().cpus != self.envelope_cpus {
                cg.set_cpus(&self.envelope_cpus)
                    .context("narrowing the cgroup's cpuset to the envelope after the prefault")?;
            }
        }
        Ok(())
    }

    /// Has the limit exit remove `path` (the API socket, once it is served).
    pub fn remove_at_limit_exit(&self, path: PathBuf) {
        if let Ok(mut files) = self.leftovers.lock() {
            files.push(path);
        }
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

/// What the limit exit does before `process::exit`, which runs no destructor: releases the
/// ledger entry, removes the cgroup and the API socket, and puts the terminal back in the mode
/// the serial console found it in.
fn limit_exit_cleanup(
    release: &(PathBuf, String),
    ledger_pid: u32,
    cgroup: &Mutex<Option<Cgroup>>,
    files: &Mutex<Vec<PathBuf>>,
) {
    if let Ok(ledger) = vmhost_ledger::Ledger::open(&release.0) {
        let _ = ledger.release(&release.1, ledger_pid);
    }
    if let Some(cg) = cgroup.lock().ok().and_then(|mut g| g.take()) {
        if let Err(e) = cg.remove() {
            eprintln!("vmhost: warning: {e}");
        }
    }
    for path in files.lock().map(|f| f.clone()).unwrap_or_default() {
        let is_socket = std::fs::symlink_metadata(&path)
            .is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()));
        if is_socket {
            if let Err(e) = std::fs::remove_file(&path) {
                eprintln!("vmhost: warning: cannot remove {}: {e}", path.display());
            }
        }
    }
    vmhost_vcpu::restore_terminal();
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

#[cfg(test)]
mod tests {
    use super::*;

    /// `process::exit` on the limit path used to leave the API socket behind (and the terminal
    /// raw): the clean-up it runs removes the socket, and only a socket. It runs on the
    /// `oom-watch` thread, under that thread's syscall filter, as in a real limit exit (a call
    /// the filter lacks kills this test binary with SIGSYS and names the call).
    #[test]
    fn the_limit_exit_removes_the_api_socket() {
        let dir = std::env::temp_dir().join(format!("vmhost-limit-exit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let sock = dir.join("api.sock");
        let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        let plain = dir.join("not-a-socket");
        std::fs::write(&plain, b"").unwrap();
        let run_dir = dir.join("run");
        // The ledger exists, as it does when a running VM reaches its limit.
        vmhost_ledger::Ledger::open(&run_dir).unwrap();
        let files = Mutex::new(vec![sock.clone(), plain.clone()]);
        std::thread::scope(|s| {
            std::thread::Builder::new()
                .name("oom-watch".into())
                .spawn_scoped(s, || {
                    vmhost_seccomp::install(
                        vmhost_seccomp::ThreadKind::OomWatch,
                        vmhost_seccomp::SeccompMode::On,
                    )
                    .unwrap();
                    limit_exit_cleanup(
                        &(run_dir.clone(), "vm".to_string()),
                        std::process::id(),
                        &Mutex::new(None),
                        &files,
                    );
                })
                .unwrap()
                .join()
                .unwrap();
        });
        assert!(!sock.exists(), "the API socket is removed");
        assert!(plain.exists(), "a file that is not a socket is left alone");
        drop(listener);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
