//! Learning that a VM hit its memory limit, so the VMM can stop it with a clear message instead
//! of being killed without one.
//!
//! - cgroup v1: [`Cgroup::oom_watch`] disables the cgroup's OOM killer (`memory.oom_control` =
//!   1): a task that needs memory beyond the limit then *waits* in the kernel (killable)
//!   instead of being killed, and an eventfd registered through `cgroup.event_control` wakes the
//!   watcher. Dropping the watch re-enables the OOM killer, so a VM nobody watches is never left
//!   hanging. (Linux 6.18 logs "oom_control is deprecated and will be removed"; it works.)
//! - A VMM watching its own cgroup (it called [`Cgroup::add_self`] first) cannot report from
//!   inside: at the limit, any new page it touches (a heap page for the message, a stack page)
//!   blocks too. So the watch first moves the process back to the memory cgroup it came from,
//!   with one `write(2)` of bytes prepared in advance to a file opened in advance, and only
//!   then reads counters and builds the event. The thread that hit the limit stays blocked in
//!   the kernel (the VM is stopped in its tracks); the VMM must report and exit promptly, without
//!   joining that thread (exiting kills it). [`OomWatch::spawn`] pre-faults its stack.
//! - cgroup v2 has no such switch: the watcher polls `memory.events` and reports new `oom` /
//!   `oom_kill` counts. The kernel kills at `memory.max`, so on v2 the process that reports and
//!   stops the VM must be outside the cgroup: vmhost's supervisor process (the binary's
//!   `supervise` module) waits for the VMM and reads [`Cgroup::oom_kill_event`] after the kill.
//!   Proven on a real v2 memory controller in the emulated host (`make testbed`).

use std::fmt;
use std::fs::File;
use std::io::Write;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::cgroup::Cgroup;
use crate::error::CgroupError;
use crate::fsio;
use crate::hierarchy::Controller;
use crate::sys;

/// The longest single poll: removal of the cgroup is noticed at least this often.
const SLICE: Duration = Duration::from_millis(200);

/// The cgroup's memory limit was reached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OomEvent {
    /// The cgroup's memory directory.
    pub cgroup: PathBuf,
    /// The limit in bytes (`None`: none was set).
    pub limit_bytes: Option<u64>,
    /// Usage when the event was read, if readable.
    pub usage_bytes: Option<u64>,
    /// Peak usage, if the kernel keeps it.
    pub peak_bytes: Option<u64>,
    /// Processes the kernel's OOM killer killed in the cgroup so far (v2 `oom_kill`; v1 0,
    /// since the watch disables the killer).
    pub oom_kills: u64,
}

impl fmt::Display for OomEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mib = |b: u64| format!("{b} bytes ({:.1} MiB)", b as f64 / f64::from(1 << 20));
        let opt = |b: Option<u64>| b.map_or_else(|| "unknown".to_string(), mib);
        write!(
            f,
            "memory limit {} reached (usage {}, peak {}) in cgroup {}",
            opt(self.limit_bytes),
            opt(self.usage_bytes),
            opt(self.peak_bytes),
            self.cgroup.display()
        )?;
        if self.oom_kills > 0 {
            write!(
                f,
                "; the kernel OOM killer killed {} process(es)",
                self.oom_kills
            )?;
        }
        f.write_str(": the VM needs more memory than its envelope allows; raise `memory.reserved_overhead.added_overhead` (or `resources.limits.memory`) and start it again")
    }
}

/// What one [`OomWatch::wait`] saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OomWait {
    /// The memory limit was reached.
    Limit(OomEvent),
    /// Nothing happened before the timeout.
    TimedOut,
    /// The cgroup was removed.
    Removed,
}

#[derive(Debug)]
enum Source {
    V1 {
        efd: OwnedFd,
        control: File,
    },
    V2 {
        events: File,
        oom: u64,
        oom_kill: u64,
    },
}

/// A watch on a cgroup's memory limit (see the module docs); independent of the [`Cgroup`]
/// value, so it can move to a thread.
#[derive(Debug)]
pub struct OomWatch {
    dir: PathBuf,
    v1: bool,
    limit: Option<u64>,
    source: Source,
    /// v1, watching its own cgroup: the origin's `cgroup.procs`, opened, and this pid's digits.
    escape: Option<(File, Vec<u8>)>,
}

impl Cgroup {
    /// Starts watching the memory limit (v1: and holds off the OOM killer while watched).
    pub fn oom_watch(&self) -> Result<OomWatch, CgroupError> {
        let d = self
            .dir_entry(Controller::Memory)
            .ok_or(CgroupError::ControllerMissing {
                controller: "memory",
                unified: None,
                hint: "this cgroup was created without it",
            })?;
        let dir = d.path.clone();
        let limit = self.limits().memory_max_bytes;
        let mut escape = None;
        let source = if d.v1() {
            if let Some(origin) = self.self_origin(Controller::Memory) {
                let file = origin.join("cgroup.procs");
                let f = std::fs::OpenOptions::new()
                    .write(true)
                    .open(&file)
                    .map_err(|source| CgroupError::OomWatch { file, source })?;
                escape = Some((f, std::process::id().to_string().into_bytes()));
            }
            watch_v1(&dir)?
        } else {
            let file = dir.join("memory.events");
            let events = File::open(&file).map_err(|source| CgroupError::OomWatch {
                file: file.clone(),
                source,
            })?;
            let (oom, oom_kill) = v2_counts(&events);
            Source::V2 {
                events,
                oom,
                oom_kill,
            }
        };
        Ok(OomWatch {
            dir,
            v1: d.v1(),
            limit,
            source,
            escape,
        })
    }
}

impl Cgroup {
    /// True when the kernel *kills* at the memory limit (cgroup v2: no `oom_control` switch),
    /// so the VMM cannot report its own breach and needs a supervisor outside the cgroup.
    pub fn kills_at_memory_limit(&self) -> bool {
        self.dir_entry(Controller::Memory).is_some_and(|d| !d.v1())
    }

    /// After the VMM died: the limit breach that killed it, read from v2 `memory.events`
    /// (`oom_kill` > 0), or `None` when the OOM killer did not act here.
    pub fn oom_kill_event(&self) -> Option<OomEvent> {
        let d = self.dir_entry(Controller::Memory)?;
        let events = File::open(d.path.join("memory.events")).ok()?;
        let (_, oom_kills) = v2_counts(&events);
        let read = |f: &str| {
            std::fs::read_to_string(d.path.join(f))
                .ok()
                .and_then(|t| t.trim().parse().ok())
        };
        (oom_kills > 0).then(|| OomEvent {
            cgroup: d.path.clone(),
            limit_bytes: self.limits().memory_max_bytes,
            usage_bytes: read("memory.current"),
            peak_bytes: read("memory.peak"),
            oom_kills,
        })
    }
}

/// v1: eventfd on `memory.oom_control` through `cgroup.event_control`, then the killer off.
fn watch_v1(dir: &std::path::Path) -> Result<Source, CgroupError> {
    let file = dir.join("memory.oom_control");
    let err = |source| CgroupError::OomWatch {
        file: file.clone(),
        source,
    };
    let control = File::open(&file).map_err(err)?;
    let efd = sys::eventfd().map_err(err)?;
    let line = format!("{} {}", efd.as_raw_fd(), control.as_raw_fd());
    fsio::write(&dir.join("cgroup.event_control"), &line)?;
    fsio::write(&file, "1")?;
    Ok(Source::V1 { efd, control })
}

/// `(oom, oom_kill)` from v2 `memory.events` (zeros when unreadable).
fn v2_counts(events: &File) -> (u64, u64) {
    let mut buf = [0u8; 512];
    let n = events.read_at(&mut buf, 0).unwrap_or(0);
    let text = String::from_utf8_lossy(&buf[..n]);
    let get = |key: &str| {
        text.lines()
            .filter_map(|l| l.split_once(' '))
            .find(|(k, _)| *k == key)
            .and_then(|(_, v)| v.trim().parse().ok())
            .unwrap_or(0)
    };
    (get("oom"), get("oom_kill"))
}

impl OomWatch {
    /// Waits until the limit is reached, the cgroup is removed, or `timeout` passes (`None`:
    /// no timeout). Returns at once while a v1 cgroup is still at its limit.
    pub fn wait(&mut self, timeout: Option<Duration>) -> Result<OomWait, CgroupError> {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            if !self.dir.exists() {
                return Ok(OomWait::Removed);
            }
            if let Some(kills) = self.check()? {
                if let Some((procs, pid)) = &self.escape {
                    // No allocation before this write: see the module docs.
                    let _ = (&*procs).write(pid);
                }
                return Ok(OomWait::Limit(self.event(kills)));
            }
            let slice = match deadline {
                Some(d) => match d.checked_duration_since(Instant::now()) {
                    Some(left) => left.min(SLICE),
                    None => return Ok(OomWait::TimedOut),
                },
                None => SLICE,
            };
            let (fd, events) = match &self.source {
                Source::V1 { efd, .. } => (efd.as_fd(), libc::POLLIN),
                Source::V2 { events, .. } => (events.as_fd(), libc::POLLPRI),
            };
            let got = sys::poll_one(fd, events, slice).map_err(|source| CgroupError::OomWatch {
                file: self.dir.clone(),
                source,
            })?;
            if got & libc::POLLIN != 0 {
                if let Source::V1 { efd, .. } = &self.source {
                    let _ = sys::eventfd_read(efd.as_fd());
                }
            }
        }
    }

    /// Runs the watch on a thread that calls `report` once when the limit is reached (and ends
    /// when the cgroup is removed).
    pub fn spawn<F>(mut self, report: F) -> std::io::Result<JoinHandle<()>>
    where
        F: FnOnce(OomEvent) + Send + 'static,
    {
        // The watcher must have its stack in place before anyone can reach the limit: a
        // watcher that first touches its stack at the limit blocks like the VM. Under load the
        // caller used to outrun the new thread (a flaky `memory_limits` test), so wait for it.
        let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel::<()>(1);
        let handle = std::thread::Builder::new()
            .name("oom-watch".into())
            .spawn(move || {
                prefault_stack();
                vmhost_seccomp::install_current_or_abort(vmhost_seccomp::ThreadKind::OomWatch);
                let _ = ready_tx.send(());
                match self.wait(None) {
                    Ok(OomWait::Limit(ev)) => report(ev),
                    Ok(_) => {}
                    Err(e) => tracing::warn!(error = %e, "memory limit watch ended"),
                }
            })?;
        ready_rx.recv().map_err(|_| {
            std::io::Error::other("the memory limit watch thread ended before it was ready")
        })?;
        Ok(handle)
    }

    /// `Some(oom kills)` when the limit was reached since the last check.
    fn check(&mut self) -> Result<Option<u64>, CgroupError> {
        match &mut self.source {
            Source::V1 { control, .. } => {
                let mut buf = [0u8; 256];
                let n = match control.read_at(&mut buf, 0) {
                    Ok(n) => n,
                    Err(_) if !self.dir.exists() => return Ok(None),
                    Err(source) => {
                        return Err(CgroupError::Read {
                            file: self.dir.join("memory.oom_control"),
                            source,
                        })
                    }
                };
                let text = String::from_utf8_lossy(&buf[..n]);
                let under = text.lines().any(|l| l.trim() == "under_oom 1");
                Ok(under.then_some(0))
            }
            Source::V2 {
                events,
                oom,
                oom_kill,
            } => {
                let (o, k) = v2_counts(events);
                let hit = o > *oom || k > *oom_kill;
                (*oom, *oom_kill) = (o, k);
                Ok(hit.then_some(k))
            }
        }
    }

    fn event(&self, oom_kills: u64) -> OomEvent {
        let read = |f: &str| {
            std::fs::read_to_string(self.dir.join(f))
                .ok()
                .and_then(|t| t.trim().parse().ok())
        };
        let (usage, peak) = if self.v1 {
            ("memory.usage_in_bytes", "memory.max_usage_in_bytes")
        } else {
            ("memory.current", "memory.peak")
        };
        OomEvent {
            cgroup: self.dir.clone(),
            limit_bytes: self.limit,
            usage_bytes: read(usage),
            peak_bytes: read(peak),
            oom_kills,
        }
    }
}

/// Touches 128 KiB of this thread's stack, so that reaching the limit later needs no new stack
/// page (which would block like any other page).
#[inline(never)]
fn prefault_stack() {
    let mut probe = [0u8; 128 << 10];
    std::hint::black_box(&mut probe);
}

impl Drop for OomWatch {
    fn drop(&mut self) {
        // v1: nobody watches any more, so the kernel's OOM killer takes over again.
        if self.v1 && self.dir.exists() {
            let _ = fsio::write_raw(&self.dir.join("memory.oom_control"), "0");
        }
    }
}
