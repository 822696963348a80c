//! The host ledger in the binary: admission of a VM against the VMs already running, and
//! `vmhost ps` / `vmhost ledger`.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use vmhost_config::{format_bytes, VmSpec};
use vmhost_ledger::{
    AdmitError, EntryRole, Held, Ledger, LedgerError, Liveness, LockWait, Snapshot, VmState,
};
use vmhost_plan::{plan, plan_for_guest, GuestIdentity, Plan, PlanOptions, Rejection};
use vmhost_topology::{cpulist, HostTopology};

use crate::Exit;

/// The run directory: `--run-dir`, else `$VMHOST_RUN_DIR`, else `/run/vmhost`.
pub fn run_dir(flag: Option<&Path>) -> PathBuf {
    flag.map(Path::to_path_buf)
        .or_else(|| std::env::var_os("VMHOST_RUN_DIR").map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from(vmhost_ledger::DEFAULT_RUN_DIR))
}

/// A VM's ledger entry, released when dropped (orderly stop or error after admission).
pub struct Admission {
    ledger: Ledger,
    name: String,
    pid: u32,
}

impl Admission {
    /// Marks the VM running (its hugepages are now allocated and show in the kernel's counts).
    pub fn running(&self) -> Result<()> {
        self.ledger
            .update_state(&self.name, self.pid, VmState::Running)?;
        Ok(())
    }
}

impl Admission {
    /// The switch of a migration on the target, to run once the guest runs: this incoming
    /// entry becomes the VM's and the source's entry is removed ([`Ledger::hand_over`]).
    pub fn handover(&self) -> HandOver {
        HandOver {
            ledger: self.ledger.clone(),
            name: self.name.clone(),
            pid: self.pid,
        }
    }
}

/// A migration target's ledger hand-over ([`Ledger::hand_over`]), owned: it runs once the
/// guest runs, after the commit.
pub struct HandOver {
    ledger: Ledger,
    name: String,
    pid: u32,
}

impl HandOver {
    /// Makes the incoming entry the VM's and removes the source's.
    pub fn run(&self) -> Result<()> {
        let done = self
            .ledger
            .hand_over(&self.name, self.pid)
            .context("taking over the VM's ledger entry")?;
        for p in &done.replaced {
            tracing::info!(entry = %p.display(), "the migration source's ledger entry removed");
        }
        Ok(())
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        if let Err(e) = self.ledger.release(&self.name, self.pid) {
            eprintln!(
                "vmhost: warning: cannot release ledger entry of {}: {e}",
                self.name
            );
        }
    }
}

/// Takes hugepages that admitted-but-not-yet-allocated VMs will take out of the free pools.
fn subtract_promised(host: &mut HostTopology, held: &Held) {
    for r in &held.unallocated_hugepages {
        let Some(node) = r.node else { continue };
        if let Some(pool) = host
            .nodes
            .iter_mut()
            .find(|n| n.os_index == node)
            .and_then(|n| {
                n.hugepages
                    .iter_mut()
                    .find(|p| p.page_size_bytes == r.page_size_bytes)
            })
        {
            pool.free = pool.free.saturating_sub(r.count);
        }
    }
}

/// How a VM comes to this host: what [`admit`] plans it for.
#[derive(Debug, Clone, Copy)]
pub enum Arrival<'a> {
    /// A new VM, planned from its spec.
    Boot,
    /// A snapshot's guest: its topology is kept.
    Restore(&'a GuestIdentity),
    /// A live migration's guest, whose source may run on this host: its topology is kept.
    Incoming(&'a GuestIdentity),
}

impl Arrival<'_> {
    fn identity(&self) -> Option<&GuestIdentity> {
        match self {
            Arrival::Boot => None,
            Arrival::Restore(id) | Arrival::Incoming(id) => Some(id),
        }
    }
}

/// Plans `spec` on this host under the ledger lock, against the PUs and hugepages other live
/// VMs hold, and records the VM. Exit status 3 when it does not fit; 130 when a stop signal
/// comes while it waits for the lock (nothing recorded).
///
/// A restore or an incoming migration brings its guest identity: the plan keeps that guest's
/// topology exactly ([`plan_for_guest`]) instead of planning afresh. An incoming migration is
/// admitted as the incoming target ([`Ledger::admit_incoming`]: a live VM of the same name, its
/// source on this host, is allowed and counted).
pub fn admit(
    run_dir: &Path,
    spec: &VmSpec,
    host: &HostTopology,
    opts: &PlanOptions,
    api_socket: Option<PathBuf>,
    arrival: Arrival<'_>,
) -> Result<(Plan, Admission)> {
    let ledger = Ledger::open_with(run_dir, crate::signals::ledger_lock_wait())
        .map_err(lock_wait_interrupted)
        .with_context(|| format!("opening the host ledger in {}", run_dir.display()))?;
    let pid = std::process::id();
    let planner = |held: &Held| -> Result<Plan, Rejection> {
        let mut host = host.clone();
        subtract_promised(&mut host, held);
        let opts = PlanOptions {
            held_cpus: held.cpus.clone(),
            ..opts.clone()
        };
        match arrival.identity() {
            Some(identity) => plan_for_guest(spec, &host, identity, &opts).into_result(),
            None => plan(spec, &host, &opts).into_result(),
        }
    };
    let admitted = match arrival {
        Arrival::Incoming(_) => ledger.admit_incoming(&spec.name, pid, api_socket, planner),
        _ => ledger.admit(&spec.name, pid, api_socket, planner),
    };
    match admitted {
        Ok(a) => {
            for r in &a.reclaimed {
                eprintln!(
                    "vmhost: reclaimed the ledger entry of {} (pid {}, {:?})",
                    r.name, r.pid, r.liveness
                );
            }
            Ok((
                a.plan,
                Admission {
                    // A stop signal after admission is the signal thread's: later lock waits
                    // (state, release) must not take it.
                    ledger: ledger.with_lock_wait(LockWait::default()),
                    name: spec.name.clone(),
                    pid,
                },
            ))
        }
        Err(AdmitError::Plan(r)) => Err(anyhow::Error::new(Exit {
            code: crate::rejection_code(&r),
            message: with_confinement(r.to_string(), host),
        })),
        Err(AdmitError::Ledger(e)) => Err(lock_wait_interrupted(e)).context("host ledger"),
    }
}

/// A stop signal during the wait for the ledger lock is the orderly stop of a start.
fn lock_wait_interrupted(e: LedgerError) -> anyhow::Error {
    match e {
        LedgerError::Interrupted { signal, .. } => anyhow::Error::new(crate::signals::interrupted(
            signal,
            "while waiting for the ledger lock",
        )),
        e => anyhow::Error::new(e),
    }
}

/// A refusal, followed by what confines this process when it may not use the whole host.
pub fn with_confinement(refusal: String, host: &HostTopology) -> String {
    match crate::host::confinement(host) {
        Some(note) => format!("{refusal}; {note}"),
        None => refusal,
    }
}

/// PUs that live VMs hold, for `vmhost plan` on this host (read-only; empty without a ledger).
pub fn held_cpus(run_dir: &Path) -> Result<BTreeSet<u32>> {
    let snap = Ledger::open_readonly(run_dir).list()?;
    Ok(snap
        .entries
        .iter()
        .filter(|e| !e.liveness.is_dead())
        .flat_map(|e| e.entry.dedicated_pus())
        .collect())
}

/// `vmhost ps`.
pub fn ps(run_dir: &Path, json: bool) -> Result<u8> {
    let snap = Ledger::open_readonly(run_dir).list()?;
    if json {
        println!("{}", serde_json::to_string_pretty(&snap)?);
    } else {
        print!("{}", render_ps(&snap));
    }
    Ok(0)
}

fn render_ps(snap: &Snapshot) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<16} {:>8}  {:<9} {:<8} {:<24} {:<9} {:<24} API",
        "NAME", "PID", "STATE", "PROCESS", "vCPUs -> PUs", "EMULATOR", "MEMORY"
    );
    for l in &snap.entries {
        let e = &l.entry;
        let vcpus = if e.is_floating() {
            format!(
                "{} floating over {}",
                e.vcpu_pus.len(),
                cpulist::format(&e.floating_cpus)
            )
        } else {
            e.vcpu_pus
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    format!(
                        "{i}:{}",
                        p.map_or_else(|| "-".to_string(), |p| p.to_string())
                    )
                })
                .collect::<Vec<_>>()
                .join(",")
        };
        let memory: Vec<String> = e
            .memory
            .iter()
            .map(|m| {
                let node = m
                    .node
                    .map_or_else(|| "any".to_string(), |n| format!("node{n}"));
                format!(
                    "{node} {} ({})",
                    format_bytes(m.bytes),
                    format_bytes(m.page_size_bytes)
                )
            })
            .collect();
        let process = match l.liveness {
            Liveness::Alive => "alive",
            Liveness::Exited => "exited",
            Liveness::PidReused => "gone",
            Liveness::Unknown => "unknown",
        };
        // The target of a migration within this host, next to the VM's own entry.
        let name = match e.role {
            EntryRole::Incoming => format!("{} (incoming)", e.name),
            EntryRole::Vm => e.name.clone(),
        };
        let _ = writeln!(
            s,
            "{:<16} {:>8}  {:<9} {:<8} {:<24} {:<9} {:<24} {}",
            name,
            e.pid,
            format!("{:?}", e.state).to_lowercase(),
            process,
            vcpus,
            cpulist::format(&e.emulator_pus),
            memory.join(", "),
            e.api_socket
                .as_ref()
                .map_or_else(|| "-".to_string(), |p| p.display().to_string())
        );
    }
    for u in &snap.unreadable {
        let _ = writeln!(s, "UNREADABLE {}: {}", u.path.display(), u.detail);
    }
    s
}

/// `vmhost ledger [gc]`.
pub fn ledger(run_dir: &Path, gc: bool, json: bool) -> Result<u8> {
    if gc {
        let ledger = Ledger::open(run_dir)?;
        let removed = ledger.gc()?;
        if json {
            println!("{}", serde_json::to_string_pretty(&removed)?);
        } else {
            for r in &removed {
                println!(
                    "reclaimed {} (pid {}, {:?}): {}",
                    r.name,
                    r.pid,
                    r.liveness,
                    r.path.display()
                );
            }
            println!(
                "{} entr{} reclaimed",
                removed.len(),
                if removed.len() == 1 { "y" } else { "ies" }
            );
        }
        return Ok(0);
    }
    let snap = Ledger::open_readonly(run_dir).list()?;
    println!("{}", serde_json::to_string_pretty(&snap)?);
    Ok(0)
}

#[cfg(test)]
mod tests {
    use vmhost_ledger::{Entry, Listed};

    use super::*;

    fn listed(pid: u32, role: EntryRole) -> Listed {
        Listed {
            path: PathBuf::from(format!("/run/vmhost/vms/web.{pid}.1.json")),
            liveness: Liveness::Alive,
            entry: Entry {
                name: "web".into(),
                pid,
                proc_start_ticks: 1,
                started_at_unix_ms: 0,
                state: VmState::Running,
                role,
                vcpu_pus: vec![Some(pid)],
                floating_cpus: vec![],
                emulator_pus: vec![pid],
                emulator_isolated: false,
                io_pool_pus: vec![],
                hugepages: vec![],
                memory: vec![],
                api_socket: None,
            },
        }
    }

    #[test]
    fn ps_marks_the_incoming_target_of_a_migration() {
        let snap = Snapshot {
            entries: vec![listed(1, EntryRole::Vm), listed(2, EntryRole::Incoming)],
            unreadable: vec![],
        };
        let out = render_ps(&snap);
        let rows: Vec<&str> = out.lines().skip(1).collect();
        assert!(
            rows[0].starts_with("web ") && !rows[0].contains("incoming"),
            "{out}"
        );
        assert!(rows[1].starts_with("web (incoming)"), "{out}");
    }
}
