//! The binary's few raw calls.

use std::io;

/// Restricts thread `tid` of this process to `cpus`.
pub fn set_thread_affinity(tid: i32, cpus: &[u32]) -> io::Result<()> {
    // SAFETY: an all-zero cpu_set_t is the valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cpus {
        let c = usize::try_from(c).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        if c >= libc::CPU_SETSIZE as usize {
            return Err(io::Error::from(io::ErrorKind::InvalidInput));
        }
        // SAFETY: `c` is below CPU_SETSIZE, checked above, so CPU_SET stays inside `set`.
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    // SAFETY: `set` is a valid cpu_set_t of the size passed; the kernel only reads it.
    let ret = unsafe { libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if ret == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

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
