//! Thin wrappers over the raw system calls guest memory needs and `libc` does not wrap, or
//! wraps only unsafely: `mbind`, `get_mempolicy`, `move_pages`, `memfd_create`, `madvise`,
//! and `statfs`; and the zero test of guest RAM in place ([`is_zero_volatile`]). CPU affinity
//! comes from `vmhost_topology::affinity` (re-exported here).
//!
//! This module owns every `unsafe` system call of the crate. Each wrapper returns
//! [`std::io::Error`] from `errno`; callers add the context (cell, node, address) in their own
//! error types. None of the calls here reads or writes the memory they are given: the kernel
//! validates the address ranges and fails with `EFAULT`/`ENOMEM` on unmapped ones, so the
//! wrappers taking addresses are safe functions.

pub use vmhost_topology::affinity::{current_thread as current_affinity, pin_current_thread};

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// `MPOL_DEFAULT`: the process (or system) default policy.
pub const MPOL_DEFAULT: i32 = 0;
/// `MPOL_PREFERRED`: prefer one node, fall back to others.
pub const MPOL_PREFERRED: i32 = 1;
/// `MPOL_BIND`: allocate only from the given nodes.
pub const MPOL_BIND: i32 = 2;
/// `MPOL_INTERLEAVE`: round-robin over the given nodes.
pub const MPOL_INTERLEAVE: i32 = 3;
/// `MPOL_LOCAL`: allocate on the node of the faulting CPU.
pub const MPOL_LOCAL: i32 = 4;
/// `MPOL_PREFERRED_MANY`: prefer a set of nodes.
pub const MPOL_PREFERRED_MANY: i32 = 5;
/// `MPOL_WEIGHTED_INTERLEAVE`: weighted round-robin.
pub const MPOL_WEIGHTED_INTERLEAVE: i32 = 6;
/// Mode flags the kernel may OR into the mode returned by `get_mempolicy`.
const MPOL_MODE_FLAGS: i32 = (1 << 15) | (1 << 14) | (1 << 13);

/// `mbind` flag: fail if existing pages do not follow the policy (after moving them).
pub const MPOL_MF_STRICT: u32 = 1 << 0;
/// `mbind` flag: move pages that are mapped only by this process onto the policy's nodes.
pub const MPOL_MF_MOVE: u32 = 1 << 1;

/// `get_mempolicy` flag: return a node id instead of the policy mode.
pub const MPOL_F_NODE: u64 = 1 << 0;
/// `get_mempolicy` flag: look up the policy (or node) of the given address.
pub const MPOL_F_ADDR: u64 = 1 << 1;

/// Number of node bits in the masks handed to the kernel (its `MAX_NUMNODES` ceiling).
const MASK_BITS: usize = 1024;
const WORD_BITS: usize = u64::BITS as usize;
const MASK_WORDS: usize = MASK_BITS / WORD_BITS;

/// Name of a memory policy mode, as `numa_maps` spells it.
pub fn policy_name(mode: i32) -> &'static str {
    match mode {
        MPOL_DEFAULT => "default",
        MPOL_PREFERRED => "prefer",
        MPOL_BIND => "bind",
        MPOL_INTERLEAVE => "interleave",
        MPOL_LOCAL => "local",
        MPOL_PREFERRED_MANY => "prefer (many)",
        MPOL_WEIGHTED_INTERLEAVE => "weighted interleave",
        _ => "unknown",
    }
}

fn node_mask(nodes: &[u32]) -> io::Result<[u64; MASK_WORDS]> {
    let mut mask = [0u64; MASK_WORDS];
    for &node in nodes {
        let bit = usize::try_from(node)
            .ok()
            .filter(|b| *b < MASK_BITS)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))?;
        mask[bit / WORD_BITS] |= 1 << (bit % WORD_BITS);
    }
    Ok(mask)
}

fn mask_nodes(mask: &[u64; MASK_WORDS]) -> Vec<u32> {
    (0..MASK_BITS)
        .filter(|bit| mask[bit / WORD_BITS] & (1 << (bit % WORD_BITS)) != 0)
        .filter_map(|bit| u32::try_from(bit).ok())
        .collect()
}

fn check(ret: libc::c_long) -> io::Result<libc::c_long> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// Sets the memory policy `mode` over `nodes` for the mapped range `[addr, addr + len)`.
///
/// `flags` are `MPOL_MF_*`. Page contents are preserved (`MPOL_MF_MOVE` migrates them).
#[expect(
    clippy::not_unsafe_ptr_arg_deref,
    reason = "the kernel, not this process, resolves the address and fails on unmapped ones"
)]
pub fn mbind(addr: *mut u8, len: usize, mode: i32, nodes: &[u32], flags: u32) -> io::Result<()> {
    let mask = node_mask(nodes)?;
    // The kernel reads `maxnode - 1` bits (a historical off-by-one that numactl also
    // compensates for), so pass one more than the mask holds.
    let maxnode = MASK_BITS + 1;
    // SAFETY: `mask` is a live array of MASK_WORDS words, which covers the `maxnode - 1` bits
    // the kernel reads; mbind does not access the memory at `addr` from user space, it only
    // changes the policy (and migrates pages, keeping contents) and fails with EFAULT/ENOMEM
    // when the range is not mapped.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_mbind,
            addr,
            len,
            mode,
            mask.as_ptr(),
            maxnode,
            flags,
        )
    };
    check(ret).map(|_| ())
}

/// The memory policy in force at `addr`: `(mode, nodes)`.
#[expect(
    clippy::not_unsafe_ptr_arg_deref,
    reason = "the kernel, not this process, resolves the address and fails on unmapped ones"
)]
pub fn policy_at(addr: *mut u8) -> io::Result<(i32, Vec<u32>)> {
    let mut mode: libc::c_int = 0;
    let mut mask = [0u64; MASK_WORDS];
    // SAFETY: `mode` and `mask` are live locals; the kernel writes one int to `mode` and at
    // most MASK_BITS bits to `mask`, which is exactly its size. With MPOL_F_ADDR alone the
    // kernel only looks up the VMA of `addr`, it does not touch the page.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_get_mempolicy,
            &mut mode as *mut libc::c_int,
            mask.as_mut_ptr(),
            MASK_BITS,
            addr,
            MPOL_F_ADDR,
        )
    };
    check(ret)?;
    Ok((mode & !MPOL_MODE_FLAGS, mask_nodes(&mask)))
}

/// The node that holds the page at `addr` (`get_mempolicy(MPOL_F_NODE | MPOL_F_ADDR)`).
///
/// Beware: the kernel faults the page in (as a read) if it is not present yet.
#[expect(
    clippy::not_unsafe_ptr_arg_deref,
    reason = "the kernel, not this process, resolves the address and fails on unmapped ones"
)]
pub fn node_of_page(addr: *mut u8) -> io::Result<u32> {
    let mut node: libc::c_int = -1;
    // SAFETY: `node` is a live local the kernel writes one int to; no node mask is passed.
    // The kernel resolves the page behind `addr` itself and fails with EFAULT if unmapped.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_get_mempolicy,
            &mut node as *mut libc::c_int,
            std::ptr::null_mut::<u64>(),
            0usize,
            addr,
            MPOL_F_NODE | MPOL_F_ADDR,
        )
    };
    check(ret)?;
    u32::try_from(node).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

/// Queries the node of each page in `pages` (`move_pages` with no target nodes).
///
/// `status[i]` receives the node of `pages[i]`, or a negative errno (`-ENOENT`: not present,
/// `-EFAULT`: not mapped).
pub fn query_pages(pages: &[*mut u8], status: &mut [i32]) -> io::Result<()> {
    if pages.len() != status.len() {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    // SAFETY: `pages` and `status` are live slices of equal length `pages.len()`: the kernel
    // reads that many pointers and writes that many ints. A null `nodes` array makes this a
    // pure query: nothing moves and the pages themselves are not accessed from user space.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_move_pages,
            0 as libc::pid_t,
            pages.len(),
            pages.as_ptr(),
            std::ptr::null::<libc::c_int>(),
            status.as_mut_ptr(),
            0 as libc::c_int,
        )
    };
    check(ret).map(|_| ())
}

/// `memfd_create` flags selecting a hugetlb page size (`MFD_HUGETLB | log2(size) << 26`).
pub fn memfd_hugetlb_flags(page_size: u64) -> io::Result<libc::c_uint> {
    if !page_size.is_power_of_two() {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    Ok(libc::MFD_HUGETLB | (page_size.trailing_zeros() << libc::MFD_HUGE_SHIFT))
}

/// Creates an anonymous memory file (`memfd_create`), close-on-exec.
///
/// `flags` are further `MFD_*` flags, e.g. from [`memfd_hugetlb_flags`].
pub fn memfd_create(name: &str, flags: libc::c_uint) -> io::Result<File> {
    let cname = CString::new(name).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: `cname` is a NUL-terminated string that outlives the call.
    let fd = unsafe { libc::memfd_create(cname.as_ptr(), flags | libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by memfd_create, is open, and nothing else owns it.
    Ok(File::from(unsafe { OwnedFd::from_raw_fd(fd) }))
}

/// `madvise` advice this crate gives; none of them discards data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Advice {
    /// `MADV_POPULATE_WRITE` (Linux 5.14+): fault every page in, writable.
    PopulateWrite,
    /// `MADV_HUGEPAGE`: ask for transparent hugepages.
    Hugepage,
    /// `MADV_DONTDUMP`: leave the range out of core dumps (guest RAM: the guest's secrets,
    /// and gigabytes a dump of the VMM does not need).
    DontDump,
}

/// Gives `advice` for the mapped range `[addr, addr + len)`.
pub fn madvise(addr: *mut u8, len: usize, advice: Advice) -> io::Result<()> {
    let advice = match advice {
        Advice::PopulateWrite => libc::MADV_POPULATE_WRITE,
        Advice::Hugepage => libc::MADV_HUGEPAGE,
        Advice::DontDump => libc::MADV_DONTDUMP,
    };
    // SAFETY: every advice here keeps page contents (populate faults pages in as a write
    // fault would, without writing data; HUGEPAGE and DONTDUMP only set VMA flags); an
    // unmapped range fails with ENOMEM instead of being accessed.
    let ret = unsafe { libc::madvise(addr.cast(), len, advice) };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Which pages of `page` bytes in `[at, at + len)` of the mapping at `addr` (of `map_len`
/// bytes) are resident (`mincore`): a page counts as resident when its first base page is. The
/// pages are not touched: a page never faulted in stays out. `at`, `len` and `page` must be
/// multiples of the base page size, and the range must lie inside the mapping.
pub fn resident_pages(
    addr: *mut u8,
    map_len: usize,
    at: usize,
    len: usize,
    page: usize,
) -> io::Result<Vec<bool>> {
    let base = usize::try_from(base_page_size()).unwrap_or(4096);
    let inside = at.checked_add(len).is_some_and(|end| end <= map_len);
    if !inside || at % base != 0 || len % base != 0 || page % base != 0 || page == 0 {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    let mut vec = vec![0u8; len / base];
    let start = addr.wrapping_add(at);
    // SAFETY: mincore only reads the page tables of `[start, start + len)` and writes one
    // byte per base page of it into `vec`, which has exactly `len / base` bytes; the range
    // lies inside the caller's mapping (checked above against its length) and a range that
    // is not mapped fails with ENOMEM without any access.
    let ret = unsafe { libc::mincore(start.cast(), len, vec.as_mut_ptr()) };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(vec.chunks(page / base).map(|c| c[0] & 1 == 1).collect())
}

/// Filesystem type magic and block size of the filesystem holding `path` (`statfs`).
pub fn statfs(path: &Path) -> io::Result<(u64, u64)> {
    let cpath = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: statfs is a plain C struct for which all-zeroes is a valid value.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `cpath` is NUL-terminated and `st` is a live statfs the kernel fills in.
    let ret = unsafe { libc::statfs(cpath.as_ptr(), &mut st) };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    // f_type is a signed word holding a 32-bit magic (negative on 32-bit hosts): keep the
    // low 32 bits.
    let f_type = (st.f_type as u64) & 0xffff_ffff;
    let f_bsize =
        u64::try_from(st.f_bsize).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    Ok((f_type, f_bsize))
}

/// The base page size of the host (`sysconf(_SC_PAGESIZE)`).
pub fn base_page_size() -> u64 {
    // SAFETY: sysconf only reads a configuration value.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(size).unwrap_or(4096)
}

/// Whether every byte of `slice` (guest RAM, which a running guest may be writing meanwhile) is
/// zero: read with volatile 64-bit loads, 64 bytes at a time with an early exit per block, as
/// `vmhost_persist::pages::is_zero_page` tests a buffer. No Rust reference to guest RAM is
/// made, and nothing is copied out: a save tests its pages here and copies only those that are
/// not zero. A slice not 8-byte aligned (never a guest page) is read a byte at a time.
pub fn is_zero_volatile<B: vm_memory::bitmap::BitmapSlice>(
    slice: &vm_memory::VolatileSlice<'_, B>,
) -> bool {
    const WORD: usize = std::mem::size_of::<u64>();
    let guard = slice.ptr_guard();
    let base = guard.as_ptr();
    let len = slice.len();
    let words = match base.align_offset(WORD) {
        0 => len / WORD,
        _ => 0,
    };
    let mut i = 0;
    while i < words {
        let block = (words - i).min(8);
        let mut or = 0u64;
        for k in i..i + block {
            // SAFETY: `base` is the start of `slice`, which vm-memory keeps mapped and
            // readable for `len` bytes while `guard` lives; word `k` < `words` = `len / 8`
            // ends inside it, and `base` is 8-byte aligned (checked above). A volatile read
            // makes no reference: a guest writing the word meanwhile changes only the value.
            or |= unsafe { std::ptr::read_volatile(base.add(k * WORD).cast::<u64>()) };
        }
        if or != 0 {
            return false;
        }
        i += block;
    }
    (words * WORD..len).all(|k| {
        // SAFETY: as above, byte `k` < `len` of the slice.
        unsafe { std::ptr::read_volatile(base.add(k)) == 0 }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every set bit of every byte is seen, in the 64-byte blocks, the last partial block and
    /// the bytes after the last word, whether the slice is 8-byte aligned or not.
    #[test]
    fn the_zero_test_in_place_sees_every_byte_aligned_or_not() {
        let mut buf = vec![0u8; 4096 + 32];
        let aligned = buf.as_ptr().align_offset(8);
        let bytes = &mut buf[aligned..];
        for (skew, len) in [(0, 4096), (0, 4096 + 5), (3, 4096), (1, 67)] {
            {
                let page = &mut bytes[skew..skew + len];
                assert!(is_zero_volatile(&vm_memory::VolatileSlice::from(
                    &mut *page
                )));
            }
            for at in 0..len {
                for bit in [0x01u8, 0x80] {
                    bytes[skew + at] = bit;
                    let page = &mut bytes[skew..skew + len];
                    assert!(
                        !is_zero_volatile(&vm_memory::VolatileSlice::from(page)),
                        "skew {skew}, len {len}, byte {at}, bit {bit:#x}"
                    );
                    bytes[skew + at] = 0;
                }
            }
        }
    }

    /// A private anonymous mapping owned by the test, unmapped on drop.
    struct Map(*mut u8, usize);

    impl Map {
        fn new(len: usize) -> Map {
            // SAFETY: a fresh private anonymous mapping at a kernel-chosen address; no
            // existing memory is affected.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            assert_ne!(p, libc::MAP_FAILED);
            Map(p.cast(), len)
        }
    }

    impl Drop for Map {
        fn drop(&mut self) {
            // SAFETY: (0, 1) is exactly the mapping created in `new`, unmapped once.
            unsafe { libc::munmap(self.0.cast(), self.1) };
        }
    }

    #[test]
    fn node_masks_round_trip() {
        let mask = node_mask(&[0, 3, 64, 1023]).unwrap();
        assert_eq!(mask_nodes(&mask), vec![0, 3, 64, 1023]);
        assert!(node_mask(&[1024]).is_err());
    }

    #[test]
    fn mbind_bind_then_policy_and_node_read_back() {
        let map = Map::new(1 << 20);
        mbind(map.0, map.1, MPOL_BIND, &[0], MPOL_MF_STRICT | MPOL_MF_MOVE).unwrap();
        assert_eq!(policy_at(map.0).unwrap(), (MPOL_BIND, vec![0]));
        // SAFETY: map.0 points at a live, writable mapping of map.1 bytes.
        unsafe { map.0.write_volatile(1) };
        assert_eq!(node_of_page(map.0).unwrap(), 0);
    }

    #[test]
    fn mbind_on_a_missing_node_fails() {
        let map = Map::new(1 << 20);
        let err = mbind(map.0, map.1, MPOL_BIND, &[1000], MPOL_MF_STRICT).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EINVAL));
    }

    #[test]
    fn default_policy_reads_back_as_default() {
        let map = Map::new(1 << 16);
        assert_eq!(policy_at(map.0).unwrap().0, MPOL_DEFAULT);
        assert_eq!(policy_name(MPOL_BIND), "bind");
    }

    #[test]
    fn query_pages_reports_present_and_absent_pages() {
        let page = usize::try_from(base_page_size()).unwrap();
        let map = Map::new(4 * page);
        // SAFETY: offset 0 and 2 pages are inside the live, writable mapping.
        unsafe {
            map.0.write_volatile(1);
            map.0.add(2 * page).write_volatile(1);
        }
        // SAFETY: offsets 0..4 pages stay within the mapping (pointers only, not accessed).
        let pages: Vec<*mut u8> = (0..4).map(|i| unsafe { map.0.add(i * page) }).collect();
        let mut status = vec![i32::MIN; 4];
        query_pages(&pages, &mut status).unwrap();
        assert_eq!(status[0], 0);
        assert_eq!(status[2], 0);
        assert_eq!(status[1], -libc::ENOENT);
        assert!(query_pages(&pages, &mut status[..1]).is_err());
    }

    #[test]
    fn madvise_populate_write_faults_pages_in() {
        let page = usize::try_from(base_page_size()).unwrap();
        let map = Map::new(8 * page);
        madvise(map.0, map.1, Advice::PopulateWrite).unwrap();
        madvise(map.0, map.1, Advice::Hugepage).unwrap();
        // SAFETY: offsets stay within the mapping (pointers only, not accessed).
        let pages: Vec<*mut u8> = (0..8).map(|i| unsafe { map.0.add(i * page) }).collect();
        let mut status = vec![-1; 8];
        query_pages(&pages, &mut status).unwrap();
        assert!(status.iter().all(|s| *s == 0), "{status:?}");
    }

    #[test]
    fn memfd_create_makes_a_sized_file() {
        let f = memfd_create("vmhost-sys-test", 0).unwrap();
        f.set_len(1 << 20).unwrap();
        assert_eq!(f.metadata().unwrap().len(), 1 << 20);
        assert!(memfd_create("nul\0name", 0).is_err());
        assert_eq!(
            memfd_hugetlb_flags(2 << 20).unwrap(),
            libc::MFD_HUGETLB | libc::MFD_HUGE_2MB
        );
        assert_eq!(
            memfd_hugetlb_flags(1 << 30).unwrap(),
            libc::MFD_HUGETLB | libc::MFD_HUGE_1GB
        );
        assert!(memfd_hugetlb_flags(3 << 20).is_err());
    }

    #[test]
    fn pinning_a_thread_reads_back() {
        let cpus = current_affinity().unwrap();
        assert!(!cpus.is_empty());
        let first = cpus[0];
        std::thread::spawn(move || {
            pin_current_thread(&[first]).unwrap();
            assert_eq!(current_affinity().unwrap(), vec![first]);
            assert!(pin_current_thread(&[100_000]).is_err());
        })
        .join()
        .unwrap();
    }

    #[test]
    fn statfs_sees_proc() {
        let (f_type, _) = statfs(Path::new("/proc")).unwrap();
        assert_eq!(f_type, 0x9fa0); // PROC_SUPER_MAGIC
        assert!(statfs(Path::new("/does/not/exist")).is_err());
    }
}
