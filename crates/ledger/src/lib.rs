//! vmhost's host ledger: which VMs run on this host, and which PUs and hugepages each holds.
//!
//! Every VM is its own `vmhost` process. At start it is admitted through the ledger: under an
//! exclusive lock the ledger drops the entries of dead processes, hands the PUs that live VMs
//! hold to the planner, and records the new VM's plan before the lock is released. Two VMs
//! starting at the same moment are serialized by the lock, so no PU is given twice.
//!
//! # On disk
//!
//! A run directory (default [`DEFAULT_RUN_DIR`], `/run/vmhost`) holds:
//!
//! ```text
//! ledger.lock                      empty, mode 0600; flock(2)ed by every ledger operation
//! vms/<name>.<pid>.<start>.json    one entry per VM (start: /proc/<pid>/stat field 22)
//! vms/.<entry file>.tmp            a write in progress (or interrupted: removed by the next
//!                                  exclusive operation)
//! ```
//!
//! One file per VM (not one shared file) confines damage: a corrupt entry affects that VM only,
//! and because its file name carries the owner's pid and process start time, a corrupt entry
//! whose process is gone is deleted safely. An entry file is JSON (the `entry` value is
//! pretty-printed in real files; shown compacted here):
//!
//! ```text
//! {
//! "format": "vmhost-ledger-entry",
//! "version": 1,
//! "crc32": 3994800446,
//! "entry": { "name": "web-1", "pid": 4242, "proc_start_ticks": 987654,
//!            "started_at_unix_ms": 1700000000000, "state": "running",
//!            "vcpu_pus": [2, 3], "floating_cpus": [], "emulator_pus": [4],
//!            "emulator_isolated": true,
//!            "hugepages": [{ "node": 0, "page_size_bytes": 1073741824, "count": 2 }],
//!            "memory": [{ "node": 0, "page_size_bytes": 1073741824, "bytes": 2147483648 }],
//!            "api_socket": "/run/vmhost/web-1.sock" }
//! }
//! ```
//!
//! `crc32` (IEEE, as zlib) covers the exact bytes of the `entry` value; see [`Entry`] for the
//! fields. The target of a migration within the host has an entry of its own under the VM's
//! name with `"role": "incoming"` (the field is left out for a VM's entry); see
//! [`Ledger::admit_incoming`] and [`Ledger::hand_over`]. Files are written atomically: temporary file in `vms/`, `fsync`, `rename(2)` over
//! the entry, `fsync` of `vms/`.
//!
//! # Locking protocol
//!
//! Every operation opens `ledger.lock` afresh (a `flock` belongs to an open file description;
//! a fresh one per operation makes threads of one process exclude each other too) and takes
//! - `LOCK_EX` for [`Ledger::admit`], [`Ledger::admit_incoming`], [`Ledger::hand_over`],
//!   [`Ledger::abort_incoming`], [`Ledger::release`], [`Ledger::update_state`],
//!   [`Ledger::gc`]: read → reclaim → plan → write happen under it;
//! - `LOCK_SH` for [`Ledger::list`].
//!
//! The kernel drops the lock when its holder dies, so a VM killed mid-admission blocks nobody.
//! The run directory and `vms/` are mode 0700 and the lock file 0600: another local user can
//! neither hold the lock nor read the entries. An operation waits at most [`LOCK_TIMEOUT`]
//! for the lock, then fails naming the holder (pid and command, from `/proc/locks`); a
//! [`LockWait`] can announce the wait and end it early on a signal.
//!
//! # Liveness and reclamation
//!
//! An entry is alive while a process with its pid exists, is not a zombie, and has the recorded
//! start time (so a later process reusing the pid does not keep the PUs). A process that
//! exists but whose `/proc/PID/stat` cannot be read counts as alive. Dead entries (crash,
//! SIGKILL) are removed by the next [`Ledger::admit`] or by [`Ledger::gc`]; orderly stops call
//! [`Ledger::release`]. All VMs must run in one pid namespace.
//!
//! # Faults
//!
//! - run directory or `vms/` missing: created by [`Ledger::open`] (as on first use; `/run` is
//!   emptied only at boot, when no VM runs);
//! - run directory not writable: [`LedgerError::CreateDir`] or [`LedgerError::OpenLock`] naming
//!   the path;
//! - run directory or `vms/` a symlink, owned by another user or writable by group or others
//!   (another user could plant files or symlinks there): [`LedgerError::OpenDir`] or
//!   [`LedgerError::NotPrivate`] naming the path, its owner and mode, before anything is
//!   written; entry files are created new (`O_EXCL|O_NOFOLLOW`), never through a symlink;
//! - an entry file empty, truncated, garbage, of another version, or altered (checksum): if its
//!   process is gone it is deleted like any dead entry; if alive (or the file name names no
//!   process), [`Ledger::admit`] refuses with [`LedgerError::Corrupt`] naming the file and what
//!   to do — the ledger never guesses that PUs are free. [`Ledger::list`] reports such files
//!   in [`Snapshot::unreadable`].
//!
//! # Hugepages
//!
//! The kernel's free-hugepage counts already exclude pages that running VMs allocated, but not
//! pages an admitted VM has yet to allocate: [`Held::unallocated_hugepages`] sums the
//! reservations of entries still in [`VmState::Starting`]; the VM moves to
//! [`VmState::Running`] with [`Ledger::update_state`] once its guest memory is allocated.
//!
//! # Example
//!
//! ```
//! use vmhost_ledger::{Ledger, VmState};
//! use vmhost_plan::{plan, PlanOptions};
//!
//! let spec = vmhost_config::from_toml_str(
//!     "name = \"web-1\"\n[cpu]\ncores = 2\ndedicated_cpu_placement = true\n\
//!      [memory]\nguest = \"1Gi\"\n",
//!     "vm.toml",
//! )
//! .unwrap()
//! .spec;
//! let host = vmhost_topology::load_synthetic("package:1 numa:1 core:4 pu:1").unwrap();
//! let run_dir = tempfile::tempdir().unwrap();
//! let ledger = Ledger::open(run_dir.path().join("vmhost")).unwrap();
//!
//! let pid = std::process::id();
//! let admitted = ledger
//!     .admit("web-1", pid, None, |held| {
//!         let opts = PlanOptions { held_cpus: held.cpus.clone(), ..PlanOptions::default() };
//!         plan(&spec, &host, &opts).into_result()
//!     })
//!     .unwrap();
//! assert_eq!(admitted.entry.dedicated_pus().len(), 2);
//!
//! // The name is taken while this process lives.
//! assert!(ledger.admit("web-1", pid, None, |_| plan(&spec, &host, &PlanOptions::default()).into_result()).is_err());
//!
//! ledger.update_state("web-1", pid, VmState::Running).unwrap();
//! let snapshot = ledger.list().unwrap();
//! assert_eq!(snapshot.entries[0].entry.state, VmState::Running);
//! assert!(ledger.release("web-1", pid).unwrap());
//! assert!(ledger.list().unwrap().entries.is_empty());
//! ```
#![warn(missing_docs)]

mod entry;
mod error;
#[cfg(feature = "fuzzing")]
mod fuzzing;
mod incoming;
mod store;
mod sys;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use vmhost_plan::Plan;

pub use entry::{Entry, EntryRole, HugepageReservation, NodeMemory, VmState, FORMAT, VERSION};
pub use error::{AdmitError, LedgerError};
#[cfg(feature = "fuzzing")]
pub use fuzzing::fuzz_encode_entry;
pub use incoming::HandedOver;

use entry::check_name;
use store::Scanned;

/// The default run directory.
pub const DEFAULT_RUN_DIR: &str = "/run/vmhost";

/// Whether the process behind an entry still runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Liveness {
    /// The process runs (or exists and cannot be inspected).
    Alive,
    /// The process is gone (or a zombie).
    Exited,
    /// A process with that pid runs, but it started at another time: not the VM.
    PidReused,
    /// The entry's file name names no process.
    Unknown,
}

impl Liveness {
    /// True when the entry's process is known to be gone.
    pub fn is_dead(self) -> bool {
        matches!(self, Liveness::Exited | Liveness::PidReused)
    }
}

/// What live VMs hold, handed to the planner during [`Ledger::admit`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Held {
    /// PUs held exclusively by live VMs (dedicated vCPUs and isolated emulators): pass as
    /// `PlanOptions::held_cpus`.
    pub cpus: BTreeSet<u32>,
    /// Hugepages reserved by live VMs still [`VmState::Starting`], per node and size: pages
    /// the kernel still counts as free but that are promised.
    pub unallocated_hugepages: Vec<HugepageReservation>,
}

/// A VM admitted by [`Ledger::admit`].
#[derive(Debug, Clone)]
pub struct Admitted {
    /// The plan the planner made (against the PUs other VMs hold).
    pub plan: Plan,
    /// The entry recorded for it.
    pub entry: Entry,
    /// Its entry file.
    pub path: PathBuf,
    /// Entries of dead processes removed on the way.
    pub reclaimed: Vec<Reclaimed>,
}

/// A readable entry, as [`Ledger::list`] found it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Listed {
    /// The entry file.
    pub path: PathBuf,
    /// Whether its process still runs.
    pub liveness: Liveness,
    /// The entry.
    pub entry: Entry,
}

/// An entry file that could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Unreadable {
    /// The file.
    pub path: PathBuf,
    /// VM name from the file name, when it is in ledger form.
    pub name: Option<String>,
    /// Pid from the file name, when it is in ledger form.
    pub pid: Option<u32>,
    /// Whether that process still runs.
    pub liveness: Liveness,
    /// What is wrong with the file.
    pub detail: String,
}

/// Everything in the ledger, with liveness checked against `/proc`.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Snapshot {
    /// Readable entries, by file name.
    pub entries: Vec<Listed>,
    /// Files that could not be decoded.
    pub unreadable: Vec<Unreadable>,
}

/// An entry removed because its process is gone.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Reclaimed {
    /// The removed file.
    pub path: PathBuf,
    /// VM name.
    pub name: String,
    /// Pid of the dead process.
    pub pid: u32,
    /// Why it counts as dead.
    pub liveness: Liveness,
    /// The entry, when the file was readable.
    pub entry: Option<Entry>,
}

/// The ledger of one run directory.
#[derive(Debug, Clone)]
pub struct Ledger {
    run_dir: PathBuf,
    vms_dir: PathBuf,
    lock_path: PathBuf,
    wait: LockWait,
}

/// How long a ledger operation waits for the lock before it fails naming the holder.
pub const LOCK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// How a ledger operation waits while another process holds the lock.
#[derive(Debug, Clone)]
pub struct LockWait {
    /// Give up after this long with [`LedgerError::LockTimeout`] (default [`LOCK_TIMEOUT`]).
    pub timeout: std::time::Duration,
    /// Signals that end the wait with [`LedgerError::Interrupted`]. The calling thread must
    /// block them (a stop request at start-up); the wait takes one that is or becomes pending
    /// (`sigtimedwait`) between attempts. Empty: the wait only sleeps.
    pub interrupt: Vec<libc::c_int>,
    /// Called once, when the lock is first found held, with the lock file and its holder
    /// (`process 4242 (vmhost)`, or `another process`): a marker that the wait began.
    pub on_wait: Option<fn(&Path, &str)>,
}

impl Default for LockWait {
    fn default() -> Self {
        LockWait {
            timeout: LOCK_TIMEOUT,
            interrupt: Vec::new(),
            on_wait: None,
        }
    }
}

impl Ledger {
    /// Opens the ledger in `run_dir`, creating the directory and `vms/` (mode 0700) and the
    /// lock file (mode 0600) when missing, and narrowing those of an existing ledger to their
    /// owner: another user who could open the lock file could hold it forever. Fails with the
    /// path when they cannot be created or opened for writing.
    pub fn open(run_dir: impl Into<PathBuf>) -> Result<Ledger, LedgerError> {
        Ledger::open_with(run_dir, LockWait::default())
    }

    /// [`Ledger::open`], with every lock wait (this one's included) done as `wait` says.
    pub fn open_with(run_dir: impl Into<PathBuf>, wait: LockWait) -> Result<Ledger, LedgerError> {
        let mut ledger = Ledger::at(run_dir.into());
        ledger.wait = wait;
        let existing = ledger.lock_path.exists();
        // A ledger made before the run directory was private is narrowed too; a directory
        // that holds no ledger yet is not ours to change, and is refused unless private.
        store::create_dir(&ledger.run_dir)?;
        store::check_private_dir(&ledger.run_dir, existing)?;
        store::create_dir(&ledger.vms_dir)?;
        store::check_private_dir(&ledger.vms_dir, true)?;
        drop(ledger.lock(false, true)?);
        Ok(ledger)
    }

    /// The same ledger, with lock waits of at most `timeout` (default [`LOCK_TIMEOUT`]).
    pub fn with_lock_timeout(mut self, timeout: std::time::Duration) -> Ledger {
        self.wait.timeout = timeout;
        self
    }

    /// The same ledger, with lock waits done as `wait` says.
    pub fn with_lock_wait(mut self, wait: LockWait) -> Ledger {
        self.wait = wait;
        self
    }

    fn lock(&self, exclusive: bool, create: bool) -> Result<store::Locked, LedgerError> {
        store::lock(&self.lock_path, exclusive, create, &self.wait)
    }

    /// A ledger handle that creates nothing, for listing with read access only (e.g. `ps` by
    /// an unprivileged user). [`Ledger::list`] of a run directory that does not exist is
    /// empty; the other operations fail as the file system allows.
    pub fn open_readonly(run_dir: impl Into<PathBuf>) -> Ledger {
        Ledger::at(run_dir.into())
    }

    fn at(run_dir: PathBuf) -> Ledger {
        Ledger {
            vms_dir: run_dir.join(store::VMS_DIR),
            lock_path: run_dir.join(store::LOCK_FILE),
            run_dir,
            wait: LockWait::default(),
        }
    }

    /// The run directory.
    pub fn run_dir(&self) -> &Path {
        &self.run_dir
    }

    /// Admits VM `name`, run by process `pid` (normally `std::process::id()`).
    ///
    /// Under the exclusive lock: removes dead entries, refuses when an entry file of a live (or
    /// unknown) process is unreadable or when a live VM (or an incoming migration,
    /// [`Ledger::admit_incoming`]) has the same name, calls `planner` with what live VMs
    /// hold, checks that the plan uses no held PU, and records the entry in state
    /// [`VmState::Starting`]. When the planner fails nothing is recorded.
    pub fn admit<E, F>(
        &self,
        name: &str,
        pid: u32,
        api_socket: Option<PathBuf>,
        planner: F,
    ) -> Result<Admitted, AdmitError<E>>
    where
        F: FnOnce(&Held) -> Result<Plan, E>,
    {
        self.admit_as(EntryRole::Vm, name, pid, api_socket, planner)
    }

    /// [`Ledger::admit`] for `role`; see [`Ledger::admit_incoming`] for how an incoming entry
    /// shares the name.
    fn admit_as<E, F>(
        &self,
        role: EntryRole,
        name: &str,
        pid: u32,
        api_socket: Option<PathBuf>,
        planner: F,
    ) -> Result<Admitted, AdmitError<E>>
    where
        F: FnOnce(&Held) -> Result<Plan, E>,
    {
        check_name(name).map_err(|reason| LedgerError::InvalidName {
            name: name.to_owned(),
            reason,
        })?;
        let start_ticks = match sys::probe(pid) {
            sys::Probe::Running { start_ticks } => start_ticks,
            sys::Probe::Gone => return Err(LedgerError::ProcessNotRunning { pid }.into()),
            sys::Probe::Unknown => return Err(LedgerError::ProcStat { pid }.into()),
        };
        let _lock = self.lock(true, true)?;
        let (live, reclaimed) = reclaim(store::scan(&self.vms_dir, true)?, true)?;
        incoming::check_name_free(role, name, &live)?;
        let held = held(&live);
        let plan = planner(&held).map_err(AdmitError::Plan)?;
        let mut entry = Entry::from_plan(name, pid, start_ticks, now_unix_ms(), api_socket, &plan);
        entry.role = role;
        check_conflicts(&entry, &live)?;
        let file_name = entry.file_name();
        let text = entry::encode(&entry).map_err(|source| LedgerError::Encode {
            name: name.to_owned(),
            source,
        })?;
        store::write_atomic(&self.vms_dir, &file_name, text.as_bytes())?;
        Ok(Admitted {
            plan,
            path: self.vms_dir.join(file_name),
            entry,
            reclaimed,
        })
    }

    /// Removes the entry of VM `name` run by `pid` (orderly stop). Returns false when there was
    /// none.
    pub fn release(&self, name: &str, pid: u32) -> Result<bool, LedgerError> {
        let _lock = self.lock(true, true)?;
        let mut found = false;
        for s in store::scan(&self.vms_dir, true)? {
            if s.key
                .as_ref()
                .is_some_and(|k| k.name == name && k.pid == pid)
            {
                store::remove(&s.path)?;
                found = true;
            }
        }
        Ok(found)
    }

    /// Records a new lifecycle state for VM `name` run by `pid`; returns the updated entry.
    pub fn update_state(&self, name: &str, pid: u32, state: VmState) -> Result<Entry, LedgerError> {
        let _lock = self.lock(true, true)?;
        let scanned = store::scan(&self.vms_dir, true)?;
        let s = scanned
            .into_iter()
            .find(|s| {
                s.key
                    .as_ref()
                    .is_some_and(|k| k.name == name && k.pid == pid)
            })
            .ok_or_else(|| LedgerError::NotFound {
                name: name.to_owned(),
                pid,
            })?;
        let mut entry = s.entry.map_err(|detail| LedgerError::Corrupt {
            path: s.path.clone(),
            pid: Some(pid),
            detail,
        })?;
        entry.state = state;
        let text = entry::encode(&entry).map_err(|source| LedgerError::Encode {
            name: name.to_owned(),
            source,
        })?;
        store::write_atomic(&self.vms_dir, &entry.file_name(), text.as_bytes())?;
        Ok(entry)
    }

    /// Every entry, with its process checked against `/proc`, under a shared lock.
    pub fn list(&self) -> Result<Snapshot, LedgerError> {
        let _lock = match self.lock(false, false) {
            Ok(lock) => Some(lock),
            Err(LedgerError::OpenLock { source, .. })
                if source.kind() == std::io::ErrorKind::NotFound =>
            {
                None
            }
            Err(e) => return Err(e),
        };
        let scanned = match store::scan(&self.vms_dir, false) {
            Err(LedgerError::ReadDir { source, .. })
                if _lock.is_none() && source.kind() == std::io::ErrorKind::NotFound =>
            {
                return Ok(Snapshot::default())
            }
            other => other?,
        };
        let mut snapshot = Snapshot::default();
        for s in scanned {
            match s.entry {
                Ok(entry) => snapshot.entries.push(Listed {
                    path: s.path,
                    liveness: s.liveness,
                    entry,
                }),
                Err(detail) => snapshot.unreadable.push(Unreadable {
                    path: s.path,
                    name: s.key.as_ref().map(|k| k.name.clone()),
                    pid: s.key.as_ref().map(|k| k.pid),
                    liveness: s.liveness,
                    detail,
                }),
            }
        }
        Ok(snapshot)
    }

    /// Removes the entries (readable or not) of processes that are gone, and leftover
    /// temporary files; returns the removed entries. Unreadable entries of live processes are
    /// left for the operator (see [`Ledger::list`]).
    pub fn gc(&self) -> Result<Vec<Reclaimed>, LedgerError> {
        let _lock = self.lock(true, true)?;
        let (_, reclaimed) = reclaim(store::scan(&self.vms_dir, true)?, false)?;
        Ok(reclaimed)
    }
}

/// Removes the dead among `scanned`; returns the live readable entries and the removed ones.
/// With `strict`, an unreadable entry that is not dead is an error.
fn reclaim(
    scanned: Vec<Scanned>,
    strict: bool,
) -> Result<(Vec<Entry>, Vec<Reclaimed>), LedgerError> {
    let mut live = Vec::new();
    let mut reclaimed = Vec::new();
    for s in scanned {
        match (s.key, s.entry) {
            (Some(key), entry) if s.liveness.is_dead() => {
                store::remove(&s.path)?;
                reclaimed.push(Reclaimed {
                    path: s.path,
                    name: key.name,
                    pid: key.pid,
                    liveness: s.liveness,
                    entry: entry.ok(),
                });
            }
            (_, Ok(entry)) => live.push(entry),
            (key, Err(detail)) if strict => {
                return Err(LedgerError::Corrupt {
                    path: s.path,
                    pid: key.map(|k| k.pid),
                    detail,
                })
            }
            (_, Err(_)) => {}
        }
    }
    Ok((live, reclaimed))
}

/// What the live entries hold.
fn held(live: &[Entry]) -> Held {
    let mut pages: BTreeMap<(Option<u32>, u64), u64> = BTreeMap::new();
    for e in live.iter().filter(|e| e.state == VmState::Starting) {
        for h in &e.hugepages {
            *pages.entry((h.node, h.page_size_bytes)).or_default() += h.count;
        }
    }
    Held {
        cpus: live.iter().flat_map(Entry::dedicated_pus).collect(),
        unallocated_hugepages: pages
            .into_iter()
            .map(|((node, page_size_bytes), count)| HugepageReservation {
                node,
                page_size_bytes,
                count,
            })
            .collect(),
    }
}

/// Refuses a plan that runs anything on a PU another live VM holds.
fn check_conflicts(entry: &Entry, live: &[Entry]) -> Result<(), LedgerError> {
    let used = entry
        .vcpu_pus
        .iter()
        .flatten()
        .chain(&entry.floating_cpus)
        .chain(&entry.emulator_pus)
        .chain(&entry.io_pool_pus);
    for pu in used {
        if let Some(holder) = live.iter().find(|e| e.dedicated_pus().contains(pu)) {
            return Err(LedgerError::PuConflict {
                name: entry.name.clone(),
                pu: *pu,
                holder: holder.name.clone(),
                holder_pid: holder.pid,
            });
        }
    }
    Ok(())
}

fn now_unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests;
