//! The error type of this crate: one variant per failing operation, each carrying the cgroup
//! path or file, the value written, and what the user can do about it.

use std::io;
use std::path::PathBuf;

use thiserror::Error;

/// Everything that can go wrong while detecting, creating, filling, watching or removing a
/// VM's cgroup.
#[derive(Debug, Error)]
pub enum CgroupError {
    /// `/proc/self/mountinfo` (or another procfs file) could not be read.
    #[error("cannot read {} (is /proc mounted?)", path.display())]
    ReadProc {
        /// The procfs file.
        path: PathBuf,
        /// What the kernel reported.
        #[source]
        source: io::Error,
    },

    /// No cgroup file system is mounted at all.
    #[error("no cgroup file system is mounted (none in /proc/self/mountinfo): mount cgroup2 at /sys/fs/cgroup (`mount -t cgroup2 none /sys/fs/cgroup`)")]
    NotMounted,

    /// A controller the limits need is neither a v1 hierarchy nor enabled in the v2 one.
    #[error("the cgroup `{controller}` controller is not available: it is not mounted as a cgroup v1 hierarchy and not listed in {}; {hint}", unified.as_ref().map_or_else(|| "a cgroup2 mount (none)".to_string(), |p| p.join("cgroup.controllers").display().to_string()))]
    ControllerMissing {
        /// Controller name (`cpuset`, `memory`, `hugetlb`).
        controller: &'static str,
        /// The cgroup2 mount, when there is one.
        unified: Option<PathBuf>,
        /// What to do.
        hint: &'static str,
    },

    /// The VM name cannot be a cgroup directory name.
    #[error("invalid cgroup name {name:?}: {reason} (a DNS label: 1-63 characters a-z, 0-9, '-', starting and ending with a letter or digit)")]
    InvalidName {
        /// The name given.
        name: String,
        /// What is wrong with it.
        reason: &'static str,
    },

    /// The limits cannot be enforced as given.
    #[error("invalid cgroup limits: {reason}")]
    InvalidLimits {
        /// What is wrong.
        reason: String,
    },

    /// A cgroup directory could not be created.
    #[error("cannot create cgroup {}{}", path.display(), errno_hint(source, "mkdir"))]
    Create {
        /// The directory.
        path: PathBuf,
        /// What the kernel reported.
        #[source]
        source: io::Error,
    },

    /// A cgroup of this name already exists and still holds processes.
    #[error("cgroup {} already exists and holds processes {pids:?}: a VM of this name is running; stop it or choose another name", path.display())]
    InUse {
        /// The directory.
        path: PathBuf,
        /// Its processes.
        pids: Vec<u32>,
    },

    /// A controller could not be enabled for the children of a v2 cgroup.
    #[error("cannot enable the `{controller}` controller in {}{}", file.display(), errno_hint(source, "subtree_control"))]
    EnableController {
        /// The `cgroup.subtree_control` file.
        file: PathBuf,
        /// The controller.
        controller: &'static str,
        /// What the kernel reported.
        #[source]
        source: io::Error,
    },

    /// A value could not be written to a cgroup file.
    #[error("cannot write {value:?} to {}{}", file.display(), write_hint(file, source))]
    Write {
        /// The file.
        file: PathBuf,
        /// The value written.
        value: String,
        /// What the kernel reported.
        #[source]
        source: io::Error,
    },

    /// A cgroup file could not be read.
    #[error("cannot read {}{}", file.display(), errno_hint(source, "read"))]
    Read {
        /// The file.
        file: PathBuf,
        /// What the kernel reported.
        #[source]
        source: io::Error,
    },

    /// A cgroup file held something that is not what the kernel writes there.
    #[error("unexpected content {content:?} in {}: expected {expected}", file.display())]
    Parse {
        /// The file.
        file: PathBuf,
        /// What it held.
        content: String,
        /// What was expected.
        expected: &'static str,
    },

    /// A process could not be moved into (or out of) a cgroup.
    #[error("cannot move process {pid} into {}{}", file.display(), write_hint(file, source))]
    AddProcess {
        /// The process.
        pid: u32,
        /// The `cgroup.procs` file.
        file: PathBuf,
        /// What the kernel reported.
        #[source]
        source: io::Error,
    },

    /// A cgroup directory could not be removed.
    #[error("cannot remove cgroup {} (processes still inside: {pids:?}); stop them, then `rmdir` it", path.display())]
    Remove {
        /// The directory.
        path: PathBuf,
        /// Processes still listed in it when giving up.
        pids: Vec<u32>,
        /// What the kernel reported.
        #[source]
        source: io::Error,
    },

    /// The memory controller cannot report limit events for this cgroup.
    #[error("cannot watch {} for memory limit events", file.display())]
    OomWatch {
        /// The file watched (`memory.oom_control` on v1, `memory.events` on v2).
        file: PathBuf,
        /// What the kernel reported.
        #[source]
        source: io::Error,
    },
}

/// A hint chosen by errno: what usually causes it for this operation.
fn errno_hint(err: &io::Error, op: &str) -> &'static str {
    match (err.raw_os_error(), op) {
        (Some(libc::EACCES | libc::EPERM), _) | (Some(libc::EROFS), _) => {
            ": permission denied, vmhost must run as root (or in a cgroup subtree delegated to its user)"
        }
        (Some(libc::EBUSY), "subtree_control") => {
            ": the cgroup holds processes itself, and cgroup v2 allows controllers only for the children of a cgroup without processes (\"no internal processes\"); start vmhost from a cgroup other than this one"
        }
        (Some(libc::ENOENT), "mkdir") => ": the parent cgroup does not exist",
        (Some(libc::ENODEV), "read") => ": the cgroup was removed",
        _ => "",
    }
}

/// A hint for a failed write, chosen by the file and errno.
fn write_hint(file: &std::path::Path, err: &io::Error) -> &'static str {
    let name = file.file_name().and_then(|n| n.to_str()).unwrap_or("");
    match (err.raw_os_error(), name) {
        (Some(libc::ENOSPC), "cgroup.procs" | "tasks") => {
            ": the cgroup's cpuset.cpus or cpuset.mems is empty (cgroup v1 needs both before a task joins)"
        }
        (Some(libc::ERANGE), "cpuset.cpus") => ": the host has no such CPU",
        (Some(libc::EINVAL), "cpuset.cpus") => {
            ": a CPU is offline or not in the parent cgroup's cpuset.cpus"
        }
        (Some(libc::EINVAL), "cpuset.mems") => {
            ": a node has no memory or is not in the parent cgroup's cpuset.mems"
        }
        (Some(libc::EBUSY), _) => {
            ": the cgroup already uses more than this (lower limits need the usage to shrink first)"
        }
        (Some(libc::ESRCH), _) => ": no such process",
        (Some(code), _) => errno_hint(&io::Error::from_raw_os_error(code), "write"),
        (None, _) => "",
    }
}
