//! The `SIGSYS` handler: names the thread and the forbidden call on stderr, then has the kernel
//! kill the process.
//!
//! It runs inside a filtered thread, so it makes no system call but `write(2)` (on every list)
//! and, at the end, the forbidden call itself once more. `SIGSYS` is blocked while its handler
//! runs, and a seccomp trap whose signal is blocked makes the kernel reset `SIGSYS` to its
//! default action and deliver it: the process dies with `SIGSYS` (and a core dump, without
//! guest RAM: it is `MADV_DONTDUMP`), as `SECCOMP_RET_KILL_PROCESS` would have done, but
//! after saying why. The thread's name and id are saved in thread-local storage when its
//! filter is installed, because reading them later would take system calls.

use std::cell::Cell;
use std::io;
use std::sync::OnceLock;

use crate::ThreadKind;

/// `si_code` of a seccomp trap.
const SYS_SECCOMP: i32 = 1;

thread_local! {
    /// This thread's name (NUL-padded) as it was when its filter was installed.
    static NAME: Cell<[u8; 16]> = const { Cell::new([0; 16]) };
    /// This thread's id and filter kind.
    static WHO: Cell<(i32, Option<ThreadKind>)> = const { Cell::new((0, None)) };
}

/// Saves the calling thread's name, id and filter kind for the handler (before its filter).
pub(crate) fn remember_thread(kind: ThreadKind) {
    let mut name = [0u8; 16];
    // SAFETY: PR_GET_NAME writes at most 16 bytes (TASK_COMM_LEN) into `name`, which is 16
    // bytes long and lives across the call.
    let rc = unsafe { libc::prctl(libc::PR_GET_NAME, name.as_mut_ptr(), 0, 0, 0) };
    if rc != 0 {
        name = [b'?'; 16];
        name[1] = 0;
    }
    // SAFETY: gettid has no arguments and cannot fail.
    let tid = unsafe { libc::syscall(libc::SYS_gettid) };
    NAME.with(|n| n.set(name));
    WHO.with(|w| w.set((i32::try_from(tid).unwrap_or(-1), Some(kind))));
}

/// Installs the handler once per process.
pub(crate) fn install_handler() -> io::Result<()> {
    static DONE: OnceLock<Result<(), i32>> = OnceLock::new();
    let result = DONE.get_or_init(|| {
        // SAFETY: an all-zero sigaction is a valid value (empty mask, no flags) that is filled
        // in below before use.
        let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
        action.sa_sigaction = on_sigsys as extern "C" fn(_, _, _) as usize;
        action.sa_flags = libc::SA_SIGINFO;
        // SAFETY: `action` is a valid sigaction whose handler only writes to stderr and repeats
        // the trapped call (see the module docs); a null old-action pointer is allowed.
        let rc = unsafe { libc::sigaction(libc::SIGSYS, &action, std::ptr::null_mut()) };
        if rc == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error().raw_os_error().unwrap_or(0))
        }
    });
    result.map_err(io::Error::from_raw_os_error)
}

/// Makes a panic on a filtered thread print its message without a backtrace (the default
/// hook's backtrace reads files and `getcwd`, which the filters refuse); other threads keep
/// the previous hook.
pub(crate) fn install_panic_hook() {
    static DONE: OnceLock<()> = OnceLock::new();
    DONE.get_or_init(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if WHO.with(Cell::get).1.is_some() {
                let name = std::thread::current().name().map(str::to_owned);
                eprintln!(
                    "thread '{}' panicked at {}\n(no backtrace: the thread runs under a syscall filter)",
                    name.as_deref().unwrap_or("<unnamed>"),
                    info
                );
            } else {
                previous(info);
            }
        }));
    });
}

/// The `SIGSYS` part of `siginfo_t` on x86-64 (`_sigsys` in the kernel's `siginfo.h`).
#[repr(C)]
struct SigsysInfo {
    signo: i32,
    errno: i32,
    code: i32,
    _pad: i32,
    call_addr: usize,
    syscall: i32,
    arch: u32,
}

extern "C" fn on_sigsys(_sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    if info.is_null() || ctx.is_null() {
        return;
    }
    // SAFETY: the kernel passes a valid siginfo_t for an SA_SIGINFO handler; its SIGSYS layout
    // is `SigsysInfo` (a prefix of the 128-byte siginfo_t).
    let si = unsafe { &*info.cast::<SigsysInfo>() };
    if si.code != SYS_SECCOMP {
        // Sent by someone else (kill -SYS): not a filter's verdict; ignore it.
        return;
    }
    // SAFETY: the kernel passes a valid ucontext_t as the third argument of an SA_SIGINFO
    // handler; it lives until the handler returns.
    let uc = unsafe { &*ctx.cast::<libc::ucontext_t>() };
    let g = &uc.uc_mcontext.gregs;
    let reg = |r: libc::c_int| usize::try_from(r).ok().and_then(|i| g.get(i)).copied();
    let args = [
        reg(libc::REG_RDI),
        reg(libc::REG_RSI),
        reg(libc::REG_RDX),
        reg(libc::REG_R10),
        reg(libc::REG_R8),
        reg(libc::REG_R9),
    ]
    .map(|a| a.unwrap_or(0));
    report(si.syscall, &args);
    // Again, with SIGSYS blocked (we are in its handler): the kernel kills the process.
    // SAFETY: the same call with the same arguments that the filter refused a moment ago; the
    // filter refuses it again before the kernel looks at any argument.
    unsafe {
        libc::syscall(
            libc::c_long::from(si.syscall),
            args[0],
            args[1],
            args[2],
            args[3],
            args[4],
            args[5],
        );
    }
}

/// Writes `vmhost: seccomp: thread NAME (tid T, KIND filter) made the forbidden system call
/// NAME (NR)[ request 0x..]; SIGSYS kills the process` to stderr, with no allocation.
fn report(nr: i32, args: &[i64; 6]) {
    let mut line = Line::default();
    let (tid, kind) = WHO.with(Cell::get);
    match kind {
        Some(kind) => {
            line.push(b"vmhost: seccomp: thread ");
            let name = NAME.with(Cell::get);
            let len = name.iter().position(|&b| b == 0).unwrap_or(name.len());
            line.push(name.get(..len).unwrap_or(b"?"));
            line.push(b" (tid ");
            line.push_dec(i64::from(tid));
            line.push(b", ");
            line.push(kind.name().as_bytes());
            line.push(b" filter)");
        }
        // Its creator's filter, before its own: its name is not known without a system call.
        None => line.push(b"vmhost: seccomp: a new thread (under its creator's filter)"),
    }
    line.push(b" made the forbidden system call ");
    line.push(crate::syscall_name(i64::from(nr)).as_bytes());
    line.push(b" (");
    line.push_dec(i64::from(nr));
    line.push(b")");
    if i64::from(nr) == libc::SYS_ioctl {
        line.push(b" request 0x");
        line.push_hex(u64::from_ne_bytes(args[1].to_ne_bytes()));
    }
    line.push(b"; SIGSYS kills the process\n");
    let bytes = line.bytes();
    // SAFETY: `bytes` is a valid buffer of `bytes.len()` bytes for the duration of the call;
    // write(2) is async-signal-safe.
    unsafe { libc::write(libc::STDERR_FILENO, bytes.as_ptr().cast(), bytes.len()) };
}

/// A fixed buffer for the report line (no allocation in a signal handler).
struct Line {
    buf: [u8; 256],
    len: usize,
}

impl Default for Line {
    fn default() -> Self {
        Line {
            buf: [0; 256],
            len: 0,
        }
    }
}

impl Line {
    fn push(&mut self, s: &[u8]) {
        for &b in s {
            if let Some(slot) = self.buf.get_mut(self.len) {
                *slot = b;
                self.len += 1;
            }
        }
    }

    fn push_dec(&mut self, v: i64) {
        if v < 0 {
            self.push(b"-");
        }
        let mut digits = [0u8; 20];
        let mut n = v.unsigned_abs();
        let mut i = digits.len();
        loop {
            i -= 1;
            if let Some(d) = digits.get_mut(i) {
                *d = b'0' + (n % 10) as u8;
            }
            n /= 10;
            if n == 0 || i == 0 {
                break;
            }
        }
        self.push(digits.get(i..).unwrap_or(b"?"));
    }

    fn push_hex(&mut self, v: u64) {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut started = false;
        for shift in (0..16).rev() {
            let nibble = ((v >> (shift * 4)) & 0xf) as usize;
            if nibble != 0 || started || shift == 0 {
                started = true;
                self.push(&[HEX[nibble]]);
            }
        }
    }

    fn bytes(&self) -> &[u8] {
        self.buf.get(..self.len).unwrap_or(&[])
    }
}

/// The self-test's forbidden call (debug builds, `VMHOST_SECCOMP_SELFTEST`): `socket(2)`,
/// which no vmhost thread makes once filtered. Under `Log` it succeeds; the socket is closed.
pub(crate) fn forbidden_call() {
    // SAFETY: socket(2) with constant arguments; the descriptor, if any, is closed below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM, 0) };
    if fd >= 0 {
        // SAFETY: `fd` was just returned by socket(2) and is owned by nobody else.
        unsafe { libc::close(fd) };
    }
}

#[cfg(test)]
mod tests {
    use super::Line;

    #[test]
    fn the_report_line_formats_numbers_without_allocating() {
        let mut l = Line::default();
        l.push(b"x ");
        l.push_dec(0);
        l.push(b" ");
        l.push_dec(-41);
        l.push(b" ");
        l.push_dec(i64::MAX);
        l.push(b" 0x");
        l.push_hex(0xae80);
        l.push(b" 0x");
        l.push_hex(0);
        assert_eq!(l.bytes(), b"x 0 -41 9223372036854775807 0xae80 0x0");
    }

    #[test]
    fn the_report_line_is_cut_not_overflowed() {
        let mut l = Line::default();
        for _ in 0..100 {
            l.push(b"abcdef");
        }
        assert_eq!(l.bytes().len(), 256);
    }
}
