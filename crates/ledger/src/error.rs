//! Ledger errors: one variant per failing operation, with the path, VM name or pid involved.

use std::io;
use std::path::PathBuf;

/// Why a ledger operation failed.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    /// The run directory (or its `vms/` directory) could not be created.
    #[error("cannot create the ledger directory {path} (is the run directory writable? choose another one with the run-directory option)")]
    CreateDir {
        /// The directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The lock file could not be opened (or created).
    #[error("cannot open the ledger lock file {path} (is the run directory writable?)")]
    OpenLock {
        /// The lock file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// `flock` on the lock file failed.
    #[error("cannot lock the ledger lock file {path}")]
    Lock {
        /// The lock file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The lock stayed held by another process for the whole timeout.
    #[error("the ledger lock {path} has been held by {holder} for {}s; wait for that command to finish, or stop it if it hangs", waited.as_secs())]
    LockTimeout {
        /// The lock file.
        path: PathBuf,
        /// How long this operation waited.
        waited: std::time::Duration,
        /// Who holds it, from `/proc/locks` (`process 4242 (vmhost)`), or `another process`.
        holder: String,
    },
    /// A signal of [`LockWait::interrupt`](crate::LockWait::interrupt) arrived while the
    /// operation waited for the lock (the caller's orderly stop, e.g. SIGTERM during a start).
    #[error("interrupted by signal {signal} while waiting for the ledger lock {path}")]
    Interrupted {
        /// The lock file.
        path: PathBuf,
        /// The signal number (taken: no longer pending).
        signal: i32,
    },
    /// The permissions of the run directory, `vms/` or the lock file could not be narrowed to
    /// the owner.
    #[error("cannot restrict {path} to its owner (mode {mode:o}); make the run directory yours, or choose another one with the run-directory option")]
    Permissions {
        /// The file or directory.
        path: PathBuf,
        /// The mode it should have.
        mode: u32,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The run directory or `vms/` could not be opened as a directory (a symlink is refused).
    #[error("cannot open the ledger directory {path} (it must be a directory, not a symlink; remove it or choose another one with the run-directory option)")]
    OpenDir {
        /// The directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The run directory or `vms/` belongs to another user or is writable by others.
    #[error("the ledger directory {path} is owned by uid {owner} with mode {mode:o}, but must belong to uid {euid} (this user) and not be writable by group or others; remove it, chown it to uid {euid} and chmod it 0700, or choose another one with the run-directory option")]
    NotPrivate {
        /// The directory.
        path: PathBuf,
        /// Its owner.
        owner: u32,
        /// Its mode.
        mode: u32,
        /// This process's effective uid.
        euid: u32,
    },
    /// The `vms/` directory could not be listed.
    #[error("cannot list the ledger directory {path}")]
    ReadDir {
        /// The directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// An entry file could not be read (an I/O error, not bad content).
    #[error("cannot read ledger entry {path}")]
    Read {
        /// The entry file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// Writing, syncing or renaming an entry file failed.
    #[error("cannot write ledger entry {path} (is the run directory writable?)")]
    Write {
        /// The file being written.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// Removing an entry file failed.
    #[error("cannot remove ledger entry {path}")]
    Remove {
        /// The entry file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// An entry could not be serialized.
    #[error("cannot encode the ledger entry of VM {name}")]
    Encode {
        /// The VM name.
        name: String,
        /// The cause.
        #[source]
        source: serde_json::Error,
    },
    /// An entry file cannot be read and its VM may still run: its PUs are unknown, so nothing
    /// is placed until an operator resolves it.
    #[error("{}", corrupt_message(path, *pid, detail))]
    Corrupt {
        /// The entry file.
        path: PathBuf,
        /// The pid its file name records (`None`: the file name is not in ledger form).
        pid: Option<u32>,
        /// What is wrong with it.
        detail: String,
    },
    /// The VM name is not a DNS label.
    #[error("invalid VM name {name:?}: {reason}")]
    InvalidName {
        /// The name.
        name: String,
        /// The rule it breaks.
        reason: &'static str,
    },
    /// The process to record is not running.
    #[error("process {pid} is not running: it cannot hold a ledger entry")]
    ProcessNotRunning {
        /// The pid.
        pid: u32,
    },
    /// The start time of the process to record could not be read from `/proc/PID/stat`.
    #[error("cannot read the start time of process {pid} from /proc/{pid}/stat")]
    ProcStat {
        /// The pid.
        pid: u32,
    },
    /// A live VM already has this name.
    #[error(
        "a VM named {name} already runs on this host (pid {pid}); VM names are unique per host"
    )]
    NameInUse {
        /// The name.
        name: String,
        /// The pid of the running VM.
        pid: u32,
    },
    /// A live process already reserves this VM name as the target of a migration.
    #[error("process {pid} is already the incoming target of a migration of VM {name}; one migration per VM at a time (abort that one, or wait for it to end)")]
    IncomingInUse {
        /// The name.
        name: String,
        /// The pid of the incoming target.
        pid: u32,
    },
    /// The plan pins a PU that another live VM holds (the planner ignored the held PUs).
    #[error("the plan for VM {name} takes PU {pu}, which VM {holder} (pid {holder_pid}) holds")]
    PuConflict {
        /// The VM being admitted.
        name: String,
        /// The PU.
        pu: u32,
        /// The VM holding it.
        holder: String,
        /// Its pid.
        holder_pid: u32,
    },
    /// No incoming entry for this VM name and pid to hand the VM over to.
    #[error("the ledger has no incoming entry for VM {name} with pid {pid} (admit it with admit_incoming first; it may have been aborted, or reclaimed because pid {pid} died)")]
    NotIncoming {
        /// The name.
        name: String,
        /// The pid.
        pid: u32,
    },
    /// No entry for this VM name and pid.
    #[error("the ledger has no entry for VM {name} with pid {pid}")]
    NotFound {
        /// The name.
        name: String,
        /// The pid.
        pid: u32,
    },
}

fn corrupt_message(path: &std::path::Path, pid: Option<u32>, detail: &str) -> String {
    let owner = match pid {
        Some(pid) => format!(
            "its process {pid} is still running, so the PUs it holds are unknown; stop that VM, \
             or, if process {pid} is not a vmhost VM, delete the file"
        ),
        None => "its file name does not say which process owns it; delete the file if no VM \
                 uses it"
            .to_owned(),
    };
    format!(
        "ledger entry {} is unreadable ({detail}) and {owner}; no VM is placed until then",
        path.display()
    )
}

/// Why [`crate::Ledger::admit`] failed: the ledger, or the planner.
#[derive(Debug, thiserror::Error)]
pub enum AdmitError<E> {
    /// The ledger refused or failed (nothing was recorded).
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    /// The planner's error (e.g. the host cannot hold the VM); nothing was recorded.
    #[error(transparent)]
    Plan(E),
}
