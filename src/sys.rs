//! The binary's few raw calls.

use std::io;

/// Blocks `signals` in the calling thread; threads it starts afterwards inherit the mask.
/// `main` calls it first with the stop signals, so that a stop signal at any point of a start
/// (spec, topology, ledger lock, admission) stays pending until a setup step or the signal
/// thread takes it, and no helper thread (API, memory-limit watch, prefault workers) can take
/// a stop signal's default action.
pub fn block_signals(signals: &[libc::c_int]) -> io::Result<()> {
    set_mask(libc::SIG_BLOCK, signals)
}

/// Unblocks `signals` in the calling thread (a pending one is delivered at once).
pub fn unblock_signals(signals: &[libc::c_int]) -> io::Result<()> {
    set_mask(libc::SIG_UNBLOCK, signals)
}

fn set_mask(how: libc::c_int, signals: &[libc::c_int]) -> io::Result<()> {
    let set = sigset(signals);
    // SAFETY: `set` is initialised; a null old-set pointer is allowed.
    let ret = unsafe { libc::pthread_sigmask(how, &set, std::ptr::null_mut()) };
    if ret == 0 {
        Ok(())
    } else {
        Err(io::Error::from_raw_os_error(ret))
    }
}

/// The first of `signals` that is pending (blocked and sent) for this thread or the process;
/// it stays pending.
pub fn pending_signal(signals: &[libc::c_int]) -> Option<libc::c_int> {
    let mut set = sigset(&[]);
    // SAFETY: `set` is a valid, writable sigset_t for sigpending to fill.
    if unsafe { libc::sigpending(&mut set) } != 0 {
        return None;
    }
    signals.iter().copied().find(|&s| {
        // SAFETY: `set` is initialised; sigismember only reads it.
        let member = unsafe { libc::sigismember(&set, s) };
        member == 1
    })
}

/// A stop signal as it arrived: its number and the process that sent it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Received {
    /// The signal's number.
    pub signal: libc::c_int,
    /// The sender's pid (`si_pid`); 0 when the kernel sent it (a terminal's hang-up, a
    /// parent-death signal is sent as from the dead parent).
    pub pid: libc::pid_t,
}

/// Waits for one of `signals` (blocked by the caller) and returns it with its sender.
pub fn wait_signal(signals: &[libc::c_int]) -> io::Result<Received> {
    let set = sigset(signals);
    // SAFETY: an all-zero siginfo_t is a valid object for sigwaitinfo to fill.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: `set` is initialised and `info` is a valid, writable siginfo_t.
        let sig = unsafe { libc::sigwaitinfo(&set, &mut info) };
        if sig > 0 {
            // SAFETY: the kernel filled `info` for a signal that carries a sender (kill,
            // tgkill, sigqueue, or the kernel's own with si_pid 0), as sigwaitinfo returned it.
            let pid = unsafe { info.si_pid() };
            return Ok(Received { signal: sig, pid });
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

fn sigset(signals: &[libc::c_int]) -> libc::sigset_t {
    // SAFETY: an all-zero sigset_t is a valid object for sigemptyset to initialise.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid, writable sigset_t.
    unsafe { libc::sigemptyset(&mut set) };
    for &s in signals {
        // SAFETY: `set` is initialised; the signal numbers are valid constants.
        unsafe { libc::sigaddset(&mut set, s) };
    }
    set
}

/// The signals the cgroup v2 supervisor waits for: the stop signals and SIGCHLD.
const SUPERVISOR_SIGNALS: [libc::c_int; 5] = [
    libc::SIGINT,
    libc::SIGTERM,
    libc::SIGHUP,
    libc::SIGQUIT,
    libc::SIGCHLD,
];

/// How a forked child ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChildEnd {
    /// It exited with this status.
    Exited(u8),
    /// A signal killed it.
    Killed(i32),
}

/// Forks. `Ok(None)` in the child, `Ok(Some(pid))` in the parent. Only call it while the
/// process has a single thread: the child gets a copy of the calling thread alone.
pub fn fork() -> io::Result<Option<libc::pid_t>> {
    // SAFETY: the caller guarantees a single-threaded process, so no lock (allocator, stdio)
    // can be held by a thread that does not exist in the child.
    match unsafe { libc::fork() } {
        -1 => Err(io::Error::last_os_error()),
        0 => Ok(None),
        pid => Ok(Some(pid)),
    }
}

/// In a child: receive `signal` when the parent dies; returns false when it already died.
pub fn stop_with_parent(parent: libc::pid_t, signal: i32) -> bool {
    // SAFETY: PR_SET_PDEATHSIG takes a signal number and changes only this thread's setting.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, signal as libc::c_ulong, 0, 0, 0) };
    // SAFETY: getppid has no arguments and cannot fail.
    unsafe { libc::getppid() == parent }
}

/// Blocks the supervisor's signals in the calling (only) thread.
pub fn block_supervisor_signals() -> io::Result<()> {
    block_signals(&SUPERVISOR_SIGNALS)
}

/// Waits up to `ms` milliseconds for one of the (blocked) supervisor signals; returns it.
pub fn wait_supervisor_signal(ms: u32) -> Option<i32> {
    let set = sigset(&SUPERVISOR_SIGNALS);
    let ts = libc::timespec {
        tv_sec: libc::time_t::from(ms / 1000),
        tv_nsec: libc::c_long::from(ms % 1000) * 1_000_000,
    };
    // SAFETY: `set` and `ts` are initialised and outlive the call; a null siginfo is allowed.
    let sig = unsafe { libc::sigtimedwait(&set, std::ptr::null_mut(), &ts) };
    (sig > 0).then_some(sig)
}

/// Reaps `pid` if it has ended (never blocks).
pub fn try_reap(pid: libc::pid_t) -> Option<ChildEnd> {
    let mut status = 0;
    // SAFETY: `status` is a valid out pointer; WNOHANG makes the call return at once.
    let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
    if r != pid {
        return None;
    }
    if libc::WIFEXITED(status) {
        Some(ChildEnd::Exited(
            u8::try_from(libc::WEXITSTATUS(status)).unwrap_or(1),
        ))
    } else {
        Some(ChildEnd::Killed(libc::WTERMSIG(status)))
    }
}

/// Sends `signal` to `pid` (errors ignored: the child may be gone already).
pub fn send(pid: libc::pid_t, signal: i32) {
    // SAFETY: kill only sends a signal; `pid` is our own unreaped child, so it cannot have
    // been reused by another process.
    unsafe { libc::kill(pid, signal) };
}

/// The terminal settings of standard input, when it is a terminal.
pub fn save_terminal() -> Option<libc::termios> {
    // SAFETY: an all-zero termios is a valid buffer for tcgetattr to fill.
    let mut t: libc::termios = unsafe { std::mem::zeroed() };
    // SAFETY: fd 0 is checked by the kernel; `t` is a valid out pointer.
    (unsafe { libc::tcgetattr(0, &mut t) } == 0).then_some(t)
}

/// Puts standard input's terminal settings back.
pub fn restore_terminal(t: &libc::termios) {
    // SAFETY: `t` is a termios tcgetattr filled in; fd 0 is checked by the kernel.
    unsafe { libc::tcsetattr(0, libc::TCSANOW, t) };
}

/// Threads of this process (from `/proc/self/task`).
pub fn thread_count() -> usize {
    std::fs::read_dir("/proc/self/task").map_or(0, Iterator::count)
}

/// Makes `accept` on the listening socket `fd` fail with `EAGAIN`/`EWOULDBLOCK` after
/// `timeout` without a connection (Linux applies `SO_RCVTIMEO` to `accept`).
pub fn set_accept_timeout(
    fd: std::os::fd::BorrowedFd<'_>,
    timeout: std::time::Duration,
) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let tv = libc::timeval {
        tv_sec: libc::time_t::try_from(timeout.as_secs()).unwrap_or(libc::time_t::MAX),
        tv_usec: libc::suseconds_t::from(timeout.subsec_micros()),
    };
    let len = libc::socklen_t::try_from(std::mem::size_of::<libc::timeval>())
        .unwrap_or(libc::socklen_t::MAX);
    // SAFETY: `tv` is a valid timeval that outlives the call and `len` is its size; `fd` is a
    // socket kept open by the borrow.
    let ret = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            std::ptr::addr_of!(tv).cast::<libc::c_void>(),
            len,
        )
    };
    if ret == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Makes glibc's allocator serve every thread from its main arena (`M_ARENA_MAX` 1) unless
/// the user chose a count (`MALLOC_ARENA_MAX`, or a `GLIBC_TUNABLES` that names
/// `glibc.malloc.arena_max`). Call it before any thread exists.
///
/// By default each thread that allocates gets an arena of its own, and each arena keeps pages
/// of its own resident: about 110 KiB of vmhost's 0.6 MiB of anonymous memory for a Linux
/// guest (docs/benchmarks.md). The hot paths allocate little (a device request's storage is
/// reused, `crates/devices/src/iov.rs`), and what they do allocate is small enough for the
/// per-thread cache, which takes no lock.
pub fn single_malloc_arena() {
    let chosen = std::env::var_os("MALLOC_ARENA_MAX").is_some()
        || std::env::var("GLIBC_TUNABLES").is_ok_and(|t| t.contains("glibc.malloc.arena_max"));
    if !chosen {
        // SAFETY: mallopt only changes the allocator's parameters; no thread allocates
        // concurrently (the caller runs before any other thread exists).
        unsafe { libc::mallopt(libc::M_ARENA_MAX, 1) };
    }
}
