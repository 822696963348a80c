//! The unsafe edge of the API crate: a listening Unix socket whose file mode is set on the
//! socket before `bind` gives it a name, so the name never exists with a wider mode.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixListener;
use std::path::Path;

/// The listen backlog (std's for Unix listeners).
const BACKLOG: libc::c_int = 128;

/// Binds and listens on a new Unix stream socket at `path` whose file gets `mode` from its
/// first moment: Linux creates the socket file with the socket inode's mode (less the
/// umask), which `fchmod` on the unbound socket sets. No umask change (it is process-wide and
/// would race with other threads). Fails with `EADDRINUSE` when anything exists at `path`.
pub(crate) fn bind_unix_with_mode(path: &Path, mode: u32) -> io::Result<UnixListener> {
    // SAFETY: sockaddr_un is a plain C struct of integers and a byte array; all zeroes is a
    // valid (empty) value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    let bytes = path.as_os_str().as_bytes();
    // Room for the terminating NUL (already zero).
    if bytes.is_empty() || bytes.len() >= addr.sun_path.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "Unix socket path empty or too long",
        ));
    }
    addr.sun_family = libc::sa_family_t::try_from(libc::AF_UNIX).unwrap_or(1);
    for (dst, &src) in addr.sun_path.iter_mut().zip(bytes) {
        *dst = src as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + bytes.len() + 1;
    let len = libc::socklen_t::try_from(len).unwrap_or(libc::socklen_t::MAX);
    // SAFETY: socket(2) takes no pointers; the result is checked before use.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a new socket this function owns; OwnedFd closes it on every path.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: fchmod takes no pointers; `owned` keeps the descriptor open for the call.
    check(unsafe { libc::fchmod(owned.as_raw_fd(), mode) })?;
    // SAFETY: `addr` is a valid sockaddr_un that outlives the call, `len` does not exceed its
    // size (the path length is checked above), and `owned` keeps the socket open.
    check(unsafe {
        libc::bind(
            owned.as_raw_fd(),
            std::ptr::addr_of!(addr).cast::<libc::sockaddr>(),
            len,
        )
    })?;
    // SAFETY: listen takes no pointers; `owned` keeps the bound socket open.
    check(unsafe { libc::listen(owned.as_raw_fd(), BACKLOG) })?;
    Ok(UnixListener::from(owned))
}

fn check(rc: libc::c_int) -> io::Result<()> {
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
