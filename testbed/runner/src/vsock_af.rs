//! `AF_VSOCK` sockets for the vhost-vsock test: the host side of the kernel's vhost-vsock is the
//! host kernel's vsock address family, not a Unix socket. The unsafe edge of that test.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

fn last_err(what: &str) -> String {
    format!("{what}: {}", std::io::Error::last_os_error())
}

fn addr(cid: u32, port: u32) -> libc::sockaddr_vm {
    // SAFETY: sockaddr_vm is a plain C struct of integers; all zeroes is a valid value.
    let mut a: libc::sockaddr_vm = unsafe { std::mem::zeroed() };
    a.svm_family = libc::sa_family_t::try_from(libc::AF_VSOCK).unwrap_or(40);
    a.svm_cid = cid;
    a.svm_port = port;
    a
}

/// sizeof(struct sockaddr_vm): 16 bytes.
#[allow(clippy::cast_possible_truncation)] // a 16-byte struct
const ADDR_LEN: libc::socklen_t = std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t;

fn socket() -> Result<OwnedFd, String> {
    // SAFETY: socket(2) takes no pointers; the result is checked.
    let fd = unsafe { libc::socket(libc::AF_VSOCK, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(last_err("socket(AF_VSOCK)"));
    }
    // SAFETY: `fd` is a new socket owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Gives reads on `fd` a timeout (a bound so a broken device fails the test instead of hanging).
fn read_timeout(fd: &OwnedFd, limit: Duration) -> Result<(), String> {
    let tv = libc::timeval {
        tv_sec: libc::time_t::try_from(limit.as_secs()).unwrap_or(libc::time_t::MAX),
        tv_usec: 0,
    };
    // SAFETY: `tv` is a valid timeval that outlives the call; the length is its size.
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            std::ptr::addr_of!(tv).cast(),
            libc::socklen_t::try_from(std::mem::size_of::<libc::timeval>()).unwrap_or(16),
        )
    };
    if r < 0 {
        return Err(last_err("SO_RCVTIMEO"));
    }
    Ok(())
}

/// A stream connected to (cid, port), as a File for reads and writes; reads time out after
/// `limit`.
pub fn connect(cid: u32, port: u32, limit: Duration) -> Result<File, String> {
    let fd = socket()?;
    let a = addr(cid, port);
    // SAFETY: `a` is a valid sockaddr_vm of ADDR_LEN bytes that outlives the call.
    let r = unsafe { libc::connect(fd.as_raw_fd(), std::ptr::addr_of!(a).cast(), ADDR_LEN) };
    if r < 0 {
        return Err(last_err(&format!("connect to vsock {cid}:{port}")));
    }
    read_timeout(&fd, limit)?;
    Ok(File::from(fd))
}

/// `shutdown(SHUT_WR)`: the peer reads EOF.
pub fn shutdown_write(f: &File) -> Result<(), String> {
    // SAFETY: shutdown(2) on an open socket fd; no pointers.
    if unsafe { libc::shutdown(f.as_raw_fd(), libc::SHUT_WR) } < 0 {
        return Err(last_err("shutdown(SHUT_WR)"));
    }
    Ok(())
}

/// A listener on any CID, `port`.
pub fn listen(port: u32) -> Result<OwnedFd, String> {
    let fd = socket()?;
    let a = addr(libc::VMADDR_CID_ANY, port);
    // SAFETY: `a` is a valid sockaddr_vm of ADDR_LEN bytes that outlives the call.
    let r = unsafe { libc::bind(fd.as_raw_fd(), std::ptr::addr_of!(a).cast(), ADDR_LEN) };
    if r < 0 {
        return Err(last_err(&format!("bind vsock port {port}")));
    }
    // SAFETY: listen(2) on the bound socket; no pointers.
    if unsafe { libc::listen(fd.as_raw_fd(), 4) } < 0 {
        return Err(last_err("listen"));
    }
    Ok(fd)
}

/// Accepts one connection within `limit`, unless `stop` is set first (checked every 200 ms);
/// reads on it time out after `limit`.
pub fn accept(listener: &OwnedFd, limit: Duration, stop: &AtomicBool) -> Result<File, String> {
    let deadline = Instant::now() + limit;
    loop {
        if stop.load(Ordering::Relaxed) {
            return Err("stopped before a vsock connection came".into());
        }
        let mut p = libc::pollfd {
            fd: listener.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd that outlives the call.
        let n = unsafe { libc::poll(&mut p, 1, 200) };
        if n > 0 {
            break;
        }
        if Instant::now() > deadline {
            return Err("no vsock connection from the guest".into());
        }
    }
    // SAFETY: accept(2) with null address pointers (the peer's address is not wanted).
    let fd = unsafe {
        libc::accept4(
            listener.as_raw_fd(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            libc::SOCK_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(last_err("accept"));
    }
    // SAFETY: `fd` is a new socket owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    read_timeout(&fd, limit)?;
    Ok(File::from(fd))
}
