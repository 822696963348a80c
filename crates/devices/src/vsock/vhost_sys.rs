//! The vhost and vhost-vsock ioctls on `/dev/vhost-vsock`: the unsafe edge of the vhost back
//! end ([`super::vhost`]). Structures and request numbers follow `<linux/vhost.h>` and
//! `<linux/vhost_types.h>`.

use std::fs::File;
use std::io;
use std::mem::size_of;
use std::os::fd::{AsRawFd, RawFd};

const VHOST_VIRTIO: u64 = 0xaf;

/// `_IOC(dir, 0xAF, nr, size)` on x86-64.
fn ioc(dir: u64, nr: u64, size: usize) -> libc::c_ulong {
    (dir << 30) | ((size as u64) << 16) | (VHOST_VIRTIO << 8) | nr
}

fn io_none(nr: u64) -> libc::c_ulong {
    ioc(0, nr, 0)
}

fn iow<T>(nr: u64) -> libc::c_ulong {
    ioc(1, nr, size_of::<T>())
}

fn ior<T>(nr: u64) -> libc::c_ulong {
    ioc(2, nr, size_of::<T>())
}

#[repr(C)]
struct VringState {
    index: u32,
    num: u32,
}

#[repr(C)]
struct VringFile {
    index: u32,
    fd: i32,
}

#[repr(C)]
struct VringAddr {
    index: u32,
    flags: u32,
    desc_user_addr: u64,
    used_user_addr: u64,
    avail_user_addr: u64,
    log_guest_addr: u64,
}

/// `struct vhost_memory` without its flexible array of regions.
#[repr(C)]
struct MemoryHeader {
    nregions: u32,
    padding: u32,
}

/// One guest memory region for [`set_mem_table`]: guest-physical address, size, and the
/// address of its mapping in this process.
#[derive(Debug, Clone, Copy)]
pub struct MemRegion {
    /// Guest-physical start.
    pub guest_phys_addr: u64,
    /// Bytes.
    pub size: u64,
    /// Where this process maps it.
    pub userspace_addr: u64,
}

fn check(r: libc::c_int) -> io::Result<()> {
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// An ioctl whose argument is `*arg`, which the kernel reads (`_IOW`) and, for `_IOR`, writes.
fn ioctl_with<T>(f: &File, request: libc::c_ulong, arg: &mut T) -> io::Result<()> {
    // SAFETY: `request` encodes size_of::<T>() (built by `iow`/`ior` for the same T), so the
    // kernel accesses exactly the `T` behind the exclusive reference, which outlives the call;
    // the fd is an open /dev/vhost-vsock file.
    check(unsafe { libc::ioctl(f.as_raw_fd(), request, std::ptr::from_mut(arg)) })
}

/// VHOST_SET_OWNER: this process owns the device (its memory is the guest's).
pub fn set_owner(f: &File) -> io::Result<()> {
    // SAFETY: VHOST_SET_OWNER takes no argument; the fd is open.
    check(unsafe { libc::ioctl(f.as_raw_fd(), io_none(0x01)) })
}

/// VHOST_GET_FEATURES.
pub fn get_features(f: &File) -> io::Result<u64> {
    let mut v = 0u64;
    ioctl_with(f, ior::<u64>(0x00), &mut v)?;
    Ok(v)
}

/// VHOST_SET_FEATURES.
pub fn set_features(f: &File, features: u64) -> io::Result<()> {
    let mut v = features;
    ioctl_with(f, iow::<u64>(0x00), &mut v)
}

/// VHOST_SET_MEM_TABLE.
pub fn set_mem_table(f: &File, regions: &[MemRegion]) -> io::Result<()> {
    // The header and the regions, as u64 words (8-byte aligned like the kernel's structs).
    let mut words = vec![0u64; 1 + 4 * regions.len()];
    let n = u32::try_from(regions.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "too many regions"))?;
    words[0] = u64::from(n); // nregions (low half on little endian), padding 0
    for (i, r) in regions.iter().enumerate() {
        let at = 1 + 4 * i;
        words[at..at + 4].copy_from_slice(&[r.guest_phys_addr, r.size, r.userspace_addr, 0]);
    }
    // SAFETY: the request's size is the header's; the kernel then reads `nregions` regions of
    // 32 bytes right after it, which `words` holds; `words` outlives the call and the fd is
    // open.
    check(unsafe { libc::ioctl(f.as_raw_fd(), iow::<MemoryHeader>(0x03), words.as_ptr()) })
}

/// VHOST_SET_VRING_NUM.
pub fn set_vring_num(f: &File, index: u32, num: u16) -> io::Result<()> {
    let mut s = VringState {
        index,
        num: u32::from(num),
    };
    ioctl_with(f, iow::<VringState>(0x10), &mut s)
}

/// VHOST_SET_VRING_BASE: where the device starts in the available ring.
pub fn set_vring_base(f: &File, index: u32, base: u16) -> io::Result<()> {
    let mut s = VringState {
        index,
        num: u32::from(base),
    };
    ioctl_with(f, iow::<VringState>(0x12), &mut s)
}

/// VHOST_SET_VRING_ADDR, with addresses in this process.
///
/// # Safety
///
/// The kernel reads and writes the rings through these addresses, in this process's memory,
/// for as long as the device runs. `desc`, `used` and `avail` must each point into a live
/// mapping that covers, from that address on, the whole ring for the queue size set with
/// [`set_vring_num`] (descriptor table 16·n, used ring 6+8·n, available ring 6+2·n bytes), and
/// that mapping must be one of the regions given to [`set_mem_table`] and stay mapped until
/// the device is stopped. A ring that runs past the end of its mapping lets the kernel write
/// over whatever follows it in this process.
pub unsafe fn set_vring_addr(
    f: &File,
    index: u32,
    desc: u64,
    used: u64,
    avail: u64,
) -> io::Result<()> {
    let mut a = VringAddr {
        index,
        flags: 0,
        desc_user_addr: desc,
        used_user_addr: used,
        avail_user_addr: avail,
        log_guest_addr: 0,
    };
    ioctl_with(f, iow::<VringAddr>(0x11), &mut a)
}

/// VHOST_SET_VRING_KICK: the eventfd that tells the kernel the queue has buffers.
pub fn set_vring_kick(f: &File, index: u32, fd: RawFd) -> io::Result<()> {
    let mut v = VringFile { index, fd };
    ioctl_with(f, iow::<VringFile>(0x20), &mut v)
}

/// VHOST_SET_VRING_CALL: the eventfd the kernel signals after using buffers.
pub fn set_vring_call(f: &File, index: u32, fd: RawFd) -> io::Result<()> {
    let mut v = VringFile { index, fd };
    ioctl_with(f, iow::<VringFile>(0x21), &mut v)
}

/// VHOST_VSOCK_SET_GUEST_CID (host-wide unique: EADDRINUSE otherwise).
pub fn set_guest_cid(f: &File, cid: u64) -> io::Result<()> {
    let mut v = cid;
    ioctl_with(f, iow::<u64>(0x60), &mut v)
}

/// VHOST_VSOCK_SET_RUNNING.
pub fn set_running(f: &File, running: bool) -> io::Result<()> {
    let mut v = libc::c_int::from(running);
    ioctl_with(f, iow::<libc::c_int>(0x61), &mut v)
}
