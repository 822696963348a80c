//! The unsafe edges of the devices crate: an aligned heap buffer for O_DIRECT, `getrandom`,
//! and the tap ioctls. The other one is [`crate::iov`] (vectored I/O on guest memory);
//! everything else in the crate is safe code.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::ptr::NonNull;

/// This process's effective user id (the owner its files and sockets get).
pub fn euid() -> u32 {
    // Read once and kept: later calls can come from threads whose seccomp filter has no
    // `geteuid` (the first comes before any filter: opening the ledger at admission, setting
    // up the devices). The effective uid of vmhost never changes.
    static EUID: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    // SAFETY: geteuid takes no arguments, touches no memory of this process and cannot fail.
    *EUID.get_or_init(|| unsafe { libc::geteuid() })
}

/// Alignment of O_DIRECT buffers, offsets and lengths: a page, which covers 512-byte and
/// 4 KiB logical blocks.
pub const DIRECT_ALIGN: usize = 4096;

/// A zeroed heap buffer aligned to [`DIRECT_ALIGN`].
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: AlignedBuf owns its allocation exclusively (like a Box<[u8]>); no aliasing pointer
// escapes except through borrows of `self`.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    /// A buffer of `len` bytes (rounded up to the alignment; at least one block).
    pub fn new(len: usize) -> io::Result<Self> {
        let size = len.max(1).div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN;
        let layout = Layout::from_size_align(size, DIRECT_ALIGN)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "buffer too large"))?;
        // SAFETY: `layout` has a non-zero size (at least DIRECT_ALIGN bytes).
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or(io::ErrorKind::OutOfMemory)?;
        Ok(AlignedBuf { ptr, layout })
    }

    /// Capacity in bytes.
    pub fn len(&self) -> usize {
        self.layout.size()
    }

    /// The whole buffer.
    #[cfg(test)]
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` points to `layout.size()` initialised (zeroed) bytes owned by `self`
        // and living as long as the borrow of `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.layout.size()) }
    }

    /// The whole buffer, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`; the `&mut self` borrow makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: `ptr` was returned by `alloc_zeroed` with exactly this `layout` and is freed
        // only here.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// Fills `buf` from the kernel's random pool (`getrandom(2)`, blocking until it is
/// initialised). Returns how many bytes were written.
pub fn getrandom(buf: &mut [u8]) -> io::Result<usize> {
    loop {
        // SAFETY: the pointer and length describe `buf`, a writable slice that outlives the
        // call; flags 0 is a valid getrandom mode.
        let n = unsafe { libc::getrandom(buf.as_mut_ptr().cast(), buf.len(), 0) };
        match usize::try_from(n) {
            Ok(n) => return Ok(n),
            Err(_) => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
}

const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const TUNSETVNETHDRSZ: libc::c_ulong = 0x4004_54d8;
/// `_IOW('T', 208, unsigned int)`.
const TUNSETOFFLOAD: libc::c_ulong = 0x4004_54d0;
/// `TUN_F_*`: what the tap may hand us with a virtio-net header saying so.
pub const TUN_F_CSUM: u32 = 0x01;
/// TCP segmentation offload, IPv4.
pub const TUN_F_TSO4: u32 = 0x02;
/// TCP segmentation offload, IPv6.
pub const TUN_F_TSO6: u32 = 0x04;
/// TSO with the ECN bit.
pub const TUN_F_TSO_ECN: u32 = 0x08;
/// A tap (Ethernet) interface.
pub const IFF_TAP: i16 = 0x0002;
/// No packet-information prefix on frames.
pub const IFF_NO_PI: i16 = 0x1000;
/// Frames carry a virtio-net header.
pub const IFF_VNET_HDR: i16 = 0x4000;
/// Longest interface name, without the NUL (IFNAMSIZ - 1).
pub const IFNAME_MAX: usize = 15;

/// `struct ifreq` with the `ifr_flags` member of its union (40 bytes on x86_64).
#[repr(C)]
struct IfReqFlags {
    name: [u8; 16],
    flags: i16,
    _pad: [u8; 22],
}

/// `TUNSETIFF` on an open `/dev/net/tun`: creates or attaches to interface `name` with
/// `flags`. Returns the kernel's name for it.
pub fn tun_set_iff(fd: BorrowedFd<'_>, name: &str, flags: i16) -> io::Result<String> {
    if name.len() > IFNAME_MAX || name.bytes().any(|b| b == 0) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "bad interface name",
        ));
    }
    let mut req = IfReqFlags {
        name: [0; 16],
        flags,
        _pad: [0; 22],
    };
    req.name[..name.len()].copy_from_slice(name.as_bytes());
    // SAFETY: TUNSETIFF reads and writes a `struct ifreq`; `req` is a properly sized, writable
    // repr(C) ifreq that lives across the call, and `fd` is an open descriptor.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), TUNSETIFF, &mut req as *mut IfReqFlags) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    let end = req.name.iter().position(|&b| b == 0).unwrap_or(16);
    Ok(String::from_utf8_lossy(&req.name[..end]).into_owned())
}

/// `TUNSETVNETHDRSZ`: the size of the virtio-net header the tap prepends and expects.
pub fn tun_set_vnet_hdr_size(fd: BorrowedFd<'_>, size: usize) -> io::Result<()> {
    let size = libc::c_int::try_from(size)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "header size"))?;
    // SAFETY: TUNSETVNETHDRSZ reads one int through the pointer; `size` lives across the call.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), TUNSETVNETHDRSZ, &size as *const libc::c_int) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `TUNSETOFFLOAD`: the offloads (`TUN_F_*`) the tap may use for frames it hands us, i.e. what
/// the guest's driver accepted (partial checksums, TSO frames up to 64 KiB).
pub fn tun_set_offload(fd: BorrowedFd<'_>, flags: u32) -> io::Result<()> {
    // SAFETY: TUNSETOFFLOAD takes the flags by value in the argument register; no memory is
    // read or written through it.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), TUNSETOFFLOAD, libc::c_ulong::from(flags)) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `path` as a `sockaddr_un` and its length.
fn sockaddr_un(path: &std::path::Path) -> io::Result<(libc::sockaddr_un, libc::socklen_t)> {
    use std::os::unix::ffi::OsStrExt;

    // SAFETY: sockaddr_un is a plain C struct of integers and a byte array; all zeroes is a
    // valid (empty) value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    let bytes = path.as_os_str().as_bytes();
    // Room for the terminating NUL.
    if bytes.is_empty() || bytes.len() >= addr.sun_path.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "Unix socket path empty or too long",
        ));
    }
    // AF_UNIX (1) fits sa_family_t.
    addr.sun_family = libc::sa_family_t::try_from(libc::AF_UNIX).unwrap_or(1);
    for (dst, &src) in addr.sun_path.iter_mut().zip(bytes) {
        *dst = src as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + bytes.len() + 1;
    // At most sizeof(sockaddr_un), 110 bytes.
    Ok((
        addr,
        libc::socklen_t::try_from(len).unwrap_or(libc::socklen_t::MAX),
    ))
}

/// A new Unix stream socket with `flags` (`SOCK_NONBLOCK`, …; always close-on-exec).
fn unix_socket(flags: libc::c_int) -> io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;

    // SAFETY: socket(2) takes no pointers; the result is checked before use.
    let fd = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC | flags,
            0,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a new socket this function owns; OwnedFd closes it on every path.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}

fn check(rc: libc::c_int) -> io::Result<()> {
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Connects a non-blocking Unix stream socket to `path` without waiting: a listener whose
/// backlog is full gives `WouldBlock` instead of stalling the I/O thread (std's `connect`
/// blocks there).
pub fn unix_connect_nonblocking(
    path: &std::path::Path,
) -> io::Result<std::os::unix::net::UnixStream> {
    let (addr, len) = sockaddr_un(path)?;
    let owned = unix_socket(libc::SOCK_NONBLOCK)?;
    // SAFETY: `addr` is a valid sockaddr_un that outlives the call, `len` does not exceed its
    // size (checked by `sockaddr_un`), and `owned` keeps the socket open.
    check(unsafe {
        libc::connect(
            owned.as_raw_fd(),
            std::ptr::addr_of!(addr).cast::<libc::sockaddr>(),
            len,
        )
    })?;
    Ok(std::os::unix::net::UnixStream::from(owned))
}

/// Binds and listens on a new non-blocking Unix stream socket at `path` whose file gets
/// `mode` from its first moment: Linux creates the socket file with the socket inode's mode
/// (less the umask), which `fchmod` on the unbound socket sets. The umask is left alone (it
/// is process-wide and would race with other threads). `EADDRINUSE` when `path` exists.
pub fn unix_listen_with_mode(
    path: &std::path::Path,
    mode: u32,
) -> io::Result<std::os::unix::net::UnixListener> {
    let (addr, len) = sockaddr_un(path)?;
    let owned = unix_socket(libc::SOCK_NONBLOCK)?;
    // SAFETY: fchmod takes no pointers; `owned` keeps the descriptor open for the call.
    check(unsafe { libc::fchmod(owned.as_raw_fd(), mode) })?;
    // SAFETY: `addr` is a valid sockaddr_un that outlives the call, `len` does not exceed its
    // size (checked by `sockaddr_un`), and `owned` keeps the socket open.
    check(unsafe {
        libc::bind(
            owned.as_raw_fd(),
            std::ptr::addr_of!(addr).cast::<libc::sockaddr>(),
            len,
        )
    })?;
    // SAFETY: listen takes no pointers; `owned` keeps the bound socket open.
    check(unsafe { libc::listen(owned.as_raw_fd(), 128) })?;
    Ok(std::os::unix::net::UnixListener::from(owned))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The process's umask, from `/proc/self/status` (reading it with umask(2) would change it
    /// for every thread).
    fn umask() -> u32 {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let line = status.lines().find(|l| l.starts_with("Umask:")).unwrap();
        u32::from_str_radix(line["Umask:".len()..].trim(), 8).unwrap()
    }

    /// This kernel creates a socket's file with the mode fchmod gave the unbound socket (less
    /// the umask), which `unix_listen_with_mode` relies on: a socket bound without it gets
    /// 0777 less the umask.
    #[test]
    fn the_kernel_honours_fchmod_before_bind() {
        use std::os::unix::fs::{FileTypeExt, PermissionsExt};

        let dir = tempfile::tempdir().unwrap();
        let mask = umask();
        for mode in [0o600, 0o640, 0o700] {
            let path = dir.path().join(format!("s{mode:o}"));
            let _listener = unix_listen_with_mode(&path, mode).unwrap();
            let meta = std::fs::symlink_metadata(&path).unwrap();
            assert!(meta.file_type().is_socket());
            assert_eq!(
                meta.permissions().mode() & 0o7777,
                mode & !mask,
                "umask {mask:o}"
            );
        }
        let plain = dir.path().join("plain");
        let _listener = std::os::unix::net::UnixListener::bind(&plain).unwrap();
        let mode = std::fs::symlink_metadata(&plain)
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o7777, 0o777 & !mask);
        // Nothing is replaced.
        let again = unix_listen_with_mode(&plain, 0o600).unwrap_err();
        assert_eq!(again.raw_os_error(), Some(libc::EADDRINUSE));
    }

    #[test]
    fn aligned_buf_is_aligned_zeroed_and_rounded() {
        let buf = AlignedBuf::new(5000).unwrap();
        assert_eq!(buf.len(), 8192);
        assert_eq!(buf.as_slice().as_ptr() as usize % DIRECT_ALIGN, 0);
        assert!(buf.as_slice().iter().all(|&b| b == 0));
    }

    #[test]
    fn tun_name_longer_than_ifnamsiz_is_refused() {
        let f = std::fs::File::open("/dev/null").unwrap();
        use std::os::fd::AsFd;
        let e = tun_set_iff(f.as_fd(), "a-very-long-interface-name", IFF_TAP).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    }
}
