//! The binary's few raw calls.

use std::io;

/// Blocks `signals` in the calling thread; threads it starts afterwards inherit the mask.
/// Called first on the run path with the stop signals, so that no helper thread (API,
/// memory-limit watch, prefault workers) can take a stop signal's default action: a signal is
/// taken by the signal thread alone, which stops the VM in order.
pub fn block_signals(signals: &[libc::c_int]) -> io::Result<()> {
    let set = sigset(signals);
    // SAFETY: `set` is initialised; a null old-set pointer is allowed.
    let ret = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    if ret == 0 {
        Ok(())
    } else {
        Err(io::Error::from_raw_os_error(ret))
    }
}

/// Waits for one of `signals` (blocked by the caller) and returns its number.
pub fn wait_signal(signals: &[libc::c_int]) -> io::Result<libc::c_int> {
    let set = sigset(signals);
    let mut sig: libc::c_int = 0;
    // SAFETY: `set` is initialised and `sig` is a valid place for the result.
    let ret = unsafe { libc::sigwait(&set, &mut sig) };
    if ret == 0 {
        Ok(sig)
    } else {
        Err(io::Error::from_raw_os_error(ret))
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
