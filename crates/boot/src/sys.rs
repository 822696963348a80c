//! The raw system calls of this crate: clearing a descriptor's `O_NONBLOCK`. Everything else
//! goes through `std::fs` and vm-memory.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

/// Clears `O_NONBLOCK` on the open file description of `fd`, so reads block until they have
/// data (on 9p, a non-blocking read of a regular file returns at most one server reply).
pub(crate) fn clear_nonblocking(fd: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: F_GETFL takes no pointer argument; `fd` is borrowed, so it stays open for the
    // call.
    let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    if flags & libc::O_NONBLOCK == 0 {
        return Ok(());
    }
    // SAFETY: F_SETFL takes an int of status flags, not a pointer; `fd` is borrowed, so it
    // stays open for the call.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags & !libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
