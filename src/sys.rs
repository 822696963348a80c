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
