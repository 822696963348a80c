//! The raw system calls of this crate: `eventfd`, `poll` on one descriptor, and an eventfd
//! counter read. Everything else goes through `std::fs`.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::time::Duration;

/// A new eventfd (counter 0, close-on-exec).
pub(crate) fn eventfd() -> io::Result<OwnedFd> {
    // SAFETY: eventfd takes no pointers; it returns a new descriptor or -1.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by eventfd, is open, and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Waits until `fd` reports one of `events` or `timeout` passes; returns the reported events
/// (0 on timeout). EINTR counts as a timeout: callers loop anyway.
pub(crate) fn poll_one(fd: BorrowedFd<'_>, events: i16, timeout: Duration) -> io::Result<i16> {
    let mut pfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events,
        revents: 0,
    };
    let ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
    // SAFETY: `pfd` is one valid, initialized pollfd that lives across the call, matching the
    // count 1; `fd` is borrowed, so it stays open for the call.
    let n = unsafe { libc::poll(&mut pfd, 1, ms) };
    if n < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            return Ok(0);
        }
        return Err(e);
    }
    Ok(if n == 0 { 0 } else { pfd.revents })
}

/// Reads (and so resets) an eventfd's counter.
pub(crate) fn eventfd_read(fd: BorrowedFd<'_>) -> io::Result<u64> {
    let mut v = 0u64;
    // SAFETY: the buffer is `v`, 8 writable bytes that live across the call, and 8 is the
    // length passed; `fd` is borrowed, so it stays open for the call.
    let n = unsafe { libc::read(fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
    if n != 8 {
        return Err(io::Error::last_os_error());
    }
    Ok(v)
}
