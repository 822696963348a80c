//! Raw system calls and `/proc` reads: `flock(2)`, `kill(pid, 0)`, `sigtimedwait(2)` and a
//! process's start time.
//!
//! All `unsafe` of the crate lives here.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

/// What `/proc` and `kill(pid, 0)` say about a process id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Probe {
    /// A running (or sleeping, stopped…) process, with its start time in clock ticks after boot
    /// (`/proc/PID/stat` field 22).
    Running {
        /// Start time in clock ticks after boot.
        start_ticks: u64,
    },
    /// No such process, or a zombie (it has exited; only its exit status is left).
    Gone,
    /// The process exists (`kill(pid, 0)` did not say `ESRCH`) but `/proc/PID/stat` could not
    /// be read or parsed (e.g. `/proc` mounted with `hidepid`).
    Unknown,
}

/// Tries to take a `flock(2)` lock on `file`, exclusive or shared, without waiting; false when
/// another open file description holds a conflicting lock.
///
/// The lock belongs to the open file description: it is released when `file` is closed (also
/// when the process dies), and a second descriptor of the same file conflicts with it even in
/// the same process.
pub(crate) fn try_flock(file: &File, exclusive: bool) -> io::Result<bool> {
    let op = if exclusive {
        libc::LOCK_EX
    } else {
        libc::LOCK_SH
    };
    loop {
        // SAFETY: `file` owns an open descriptor for the whole call, so `flock` acts on a
        // valid fd; `flock` takes no pointers and touches no memory of this process.
        let rc = unsafe { libc::flock(file.as_raw_fd(), op | libc::LOCK_NB) };
        if rc == 0 {
            return Ok(true);
        }
        let err = io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::EWOULDBLOCK) => return Ok(false),
            Some(libc::EINTR) => {}
            _ => return Err(err),
        }
    }
}

/// Waits `time` between lock attempts; with `signals` (blocked by the caller), waits in
/// `sigtimedwait` and returns a signal of the set that is or becomes pending (taking it).
pub(crate) fn pause(signals: &[libc::c_int], time: std::time::Duration) -> Option<libc::c_int> {
    if signals.is_empty() {
        std::thread::sleep(time);
        return None;
    }
    // SAFETY: an all-zero sigset_t is a valid object for sigemptyset to initialise.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid, writable sigset_t.
    unsafe { libc::sigemptyset(&mut set) };
    for &s in signals {
        // SAFETY: `set` is initialised; an invalid signal number only makes sigaddset fail.
        unsafe { libc::sigaddset(&mut set, s) };
    }
    let ts = libc::timespec {
        tv_sec: libc::time_t::try_from(time.as_secs()).unwrap_or(libc::time_t::MAX),
        tv_nsec: libc::c_long::from(time.subsec_nanos()),
    };
    // SAFETY: `set` and `ts` are initialised and outlive the call; a null siginfo is allowed.
    let sig = unsafe { libc::sigtimedwait(&set, std::ptr::null_mut(), &ts) };
    // -1: the time passed (EAGAIN) or another signal's handler ran (EINTR): try the lock again.
    (sig > 0).then_some(sig)
}

/// The process holding a `flock` on the file with device `dev` and inode `ino`, from
/// `/proc/locks`: its pid and command name.
pub(crate) fn flock_holder(dev: u64, ino: u64) -> Option<(u32, String)> {
    let locks = std::fs::read_to_string("/proc/locks").ok()?;
    let pid = parse_locks(&locks, dev, ino)?;
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .map_or_else(|_| "?".to_string(), |c| c.trim().to_string());
    Some((pid, comm))
}

/// The pid of the first granted `FLOCK` in `/proc/locks` text on `dev`/`ino`. Lines read
/// `1: FLOCK  ADVISORY  WRITE 4242 00:19:1234 0 EOF`, the device as hex major:minor; waiters
/// carry `->` and are skipped.
pub(crate) fn parse_locks(text: &str, dev: u64, ino: u64) -> Option<u32> {
    // glibc's encoding of dev_t (gnu_dev_major / gnu_dev_minor).
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    let want = format!("{major:02x}:{minor:02x}:{ino}");
    text.lines().filter(|l| !l.contains("->")).find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        (f.get(1) == Some(&"FLOCK") && f.get(5) == Some(&want.as_str()))
            .then(|| f.get(4)?.parse().ok())
            .flatten()
    })
}

/// This process's effective user id.
pub(crate) fn euid() -> u32 {
    // Read once and kept: later calls can come from threads whose seccomp filter has no
    // `geteuid` (the first comes before any filter: opening the ledger at admission, setting
    // up the devices). The effective uid of vmhost never changes.
    static EUID: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    // SAFETY: geteuid takes no arguments, touches no memory of this process and cannot fail.
    *EUID.get_or_init(|| unsafe { libc::geteuid() })
}

/// True when `kill(pid, 0)` says the process does not exist (`ESRCH`).
fn no_such_process(pid: u32) -> bool {
    // pid 0 and negative pids address process groups: never signal them.
    let Ok(pid) = i32::try_from(pid) else {
        return true;
    };
    if pid <= 0 {
        return true;
    }
    // SAFETY: signal 0 performs only the existence and permission checks and delivers nothing;
    // `pid` is a single positive process id (checked above), never a process group.
    let rc = unsafe { libc::kill(pid, 0) };
    rc != 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
}

/// Probes process `pid`.
pub(crate) fn probe(pid: u32) -> Probe {
    if no_such_process(pid) {
        return Probe::Gone;
    }
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(text) => match parse_stat(&text) {
            Some(('Z' | 'X', _)) => Probe::Gone,
            Some((_, start_ticks)) => Probe::Running { start_ticks },
            None => Probe::Unknown,
        },
        Err(e) if e.kind() == io::ErrorKind::NotFound => Probe::Gone,
        Err(_) => Probe::Unknown,
    }
}

/// Parses `/proc/PID/stat`: (state, starttime). The command name (field 2) is in parentheses
/// and may itself contain spaces and parentheses, so fields are counted after the last `)`.
pub(crate) fn parse_stat(text: &str) -> Option<(char, u64)> {
    let rest = &text[text.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    // Field 3 (state) is the first after ')'; field 22 (starttime) is the 20th.
    let state = fields.next()?.chars().next()?;
    let start = fields.nth(18)?.parse().ok()?;
    Some((state, start))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_stat_counts_fields_after_the_last_parenthesis() {
        let line = "4242 (we (ird) name) S 1 4242 4242 0 -1 4194560 100 0 0 0 3 1 0 0 20 0 1 0 \
                    987654 1000 100 18446744073709551615";
        assert_eq!(parse_stat(line), Some(('S', 987_654)));
        assert_eq!(parse_stat("12 (x) S 1 2"), None);
        assert_eq!(parse_stat("garbage"), None);
    }

    #[test]
    fn the_flock_holder_is_found_by_device_and_inode() {
        let text = "1: POSIX  ADVISORY  WRITE 10 00:19:77 0 EOF\n\
                    2: FLOCK  ADVISORY  WRITE 4242 fd:01:1234 0 EOF\n\
                    2: -> FLOCK  ADVISORY  WRITE 4343 fd:01:1234 0 EOF\n";
        let dev = (0xfd << 8) | 0x01;
        assert_eq!(parse_locks(text, dev, 1234), Some(4242));
        assert_eq!(parse_locks(text, dev, 1235), None);
        assert_eq!(
            parse_locks(text, 0x19, 77),
            None,
            "POSIX locks are not flocks"
        );
    }

    #[test]
    fn probe_sees_this_process_and_not_pid_zero() {
        assert!(matches!(probe(std::process::id()), Probe::Running { .. }));
        assert_eq!(probe(0), Probe::Gone);
        assert_eq!(probe(u32::MAX), Probe::Gone);
    }
}
