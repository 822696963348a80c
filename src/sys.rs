//! The binary's few raw calls.

use std::io;

/// Blocks SIGINT and SIGTERM in the calling thread; threads it starts afterwards inherit the
/// mask. Called first on the run path, so that no helper thread (API, memory-limit watch,
/// prefault workers) can take a stop signal's default action: a signal that arrives while
/// guest RAM is being set up stays pending until the signal thread waits for it, and then
/// stops the VM in order.
pub fn block_stop_signals() -> io::Result<()> {
    // SAFETY: an all-zero sigset_t is a valid object for sigemptyset to initialise.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid, writable sigset_t; the signal numbers are valid.
    unsafe {
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
    }
    // SAFETY: `set` is initialised; a null old-set pointer is allowed.
    let ret = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    if ret == 0 {
        Ok(())
    } else {
        Err(io::Error::from_raw_os_error(ret))
    }
}
