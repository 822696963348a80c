//! Guest buffers as `iovec`s: vectored I/O (`preadv`, `pwritev`, `readv`, `writev`) straight
//! between a disk image or a tap and guest memory, without a host bounce buffer.
//!
//! [`GuestSrc`] covers device-readable bytes of a chain (the guest wrote them; the device
//! sends them on with `pwritev` or `writev`), [`GuestDst`] device-writable ones (the device
//! fills them with `preadv` or `readv`). Both are built by [`crate::chain::Chain`] from
//! segments it already checked against guest memory; a segment that crosses a guest memory
//! region boundary becomes one `iovec` per region. They borrow the guest memory, so the
//! pointers cannot outlive the mapping, and they borrow an [`IoVecs`], the device's reusable
//! storage, so a request allocates nothing once the storage has grown.
//!
//! Guest bytes the kernel writes through a [`GuestDst`] are marked in guest memory's dirty
//! bitmap when the `GuestDst` is dropped, after the transfer: the kernel's copy bypasses
//! vm-memory, and live migration must resend those pages (marking before the copy could let a
//! pre-copy round clear the bit before the bytes land).
//!
//! Raw `iovec`s, not `IoSlice`/`IoSliceMut`: those are made from `&[u8]`/`&mut [u8]`, and a
//! Rust reference to memory the guest may change at any time is not allowed; vm-memory hands
//! out pointers for that reason. The kernel copying bytes to or from such memory is fine: the
//! guest racing with its own request gets torn data, as on real hardware.

use std::io;
use std::marker::PhantomData;
use std::os::fd::{AsFd, AsRawFd};

use vm_memory::bitmap::Bitmap;
use vm_memory::{GuestAddress, GuestMemory, GuestMemoryError, Permissions};
use vmhost_memory::GuestMemoryMmap;

/// Linux's `IOV_MAX`: most `iovec`s one call takes.
pub const IOV_MAX: usize = 1024;

/// Reusable storage for the `iovec`s of one request; empty between requests.
#[derive(Default)]
pub struct IoVecs {
    iov: Vec<libc::iovec>,
    /// The guest ranges of a [`GuestDst`], marked dirty when it drops.
    written: Vec<(GuestAddress, usize)>,
}

// SAFETY: the storage holds pointers only while a `GuestSrc`/`GuestDst` borrows it (they clear
// it when made and when dropped), and those borrow both the storage and the guest memory, so
// moving the empty storage to another thread moves no live pointer.
unsafe impl Send for IoVecs {}

impl std::fmt::Debug for IoVecs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IoVecs")
            .field("capacity", &self.iov.capacity())
            .finish()
    }
}

/// The `iovec`s of one request, over guest memory borrowed for `'a`.
struct Pieces<'a> {
    iov: &'a mut Vec<libc::iovec>,
    written: &'a mut Vec<(GuestAddress, usize)>,
    /// The guest memory of `written` (set by the first device-writable push).
    mem: Option<&'a GuestMemoryMmap>,
    _mem: PhantomData<&'a GuestMemoryMmap>,
}

impl Drop for Pieces<'_> {
    fn drop(&mut self) {
        self.iov.clear();
        if let Some(mem) = self.mem {
            for &(addr, len) in self.written.iter() {
                mark_dirty(mem, addr, len);
            }
        }
        self.written.clear();
    }
}

/// Marks `len` bytes at `addr` dirty in the bitmaps of the regions they lie in.
fn mark_dirty(mem: &GuestMemoryMmap, addr: GuestAddress, len: usize) {
    // The range was checked when it was pushed; a failure here cannot happen, and skipping
    // marks nothing that the push did not already check.
    if let Ok(slices) = mem.get_slices(addr, len, Permissions::Write) {
        for slice in slices.flatten() {
            slice.bitmap().mark_dirty(0, slice.len());
        }
    }
}

impl<'a> Pieces<'a> {
    fn new(store: &'a mut IoVecs) -> Self {
        store.iov.clear();
        store.written.clear();
        Pieces {
            iov: &mut store.iov,
            written: &mut store.written,
            mem: None,
            _mem: PhantomData,
        }
    }

    /// Appends `len` bytes of guest memory at `addr`, one `iovec` per memory region.
    fn push_guest(
        &mut self,
        mem: &'a GuestMemoryMmap,
        addr: GuestAddress,
        len: usize,
        access: Permissions,
    ) -> Result<(), GuestMemoryError> {
        for slice in mem.get_slices(addr, len, access)? {
            let slice = slice?;
            // `GuestMemoryMmap` is not a Xen mapping, so the guards are plain pointers:
            // nothing to unmap when they drop, and they mark nothing dirty (a device-writable
            // range is recorded below and marked when `self` drops). The pointer stays valid
            // as long as `mem` (borrowed for 'a).
            let base = if access == Permissions::Write {
                slice.ptr_guard_mut().as_ptr()
            } else {
                slice.ptr_guard().as_ptr().cast_mut()
            };
            if !slice.is_empty() {
                self.iov.push(libc::iovec {
                    iov_base: base.cast(),
                    iov_len: slice.len(),
                });
            }
        }
        if access == Permissions::Write && len > 0 {
            self.mem = Some(mem);
            self.written.push((addr, len));
        }
        Ok(())
    }

    fn total(&self) -> usize {
        self.iov.iter().map(|v| v.iov_len).sum()
    }

    /// Whether every base and length is a multiple of `align` (O_DIRECT's rule).
    fn aligned(&self, align: usize) -> bool {
        self.iov
            .iter()
            .all(|v| v.iov_base as usize % align == 0 && v.iov_len % align == 0)
    }

    /// Drops the first `n` bytes (after a short transfer) from the `iovec`s from `*start` on.
    fn advance(&mut self, start: &mut usize, mut n: usize) {
        while let Some(v) = self.iov.get_mut(*start) {
            if n < v.iov_len {
                v.iov_base = v.iov_base.cast::<u8>().wrapping_add(n).cast();
                v.iov_len -= n;
                return;
            }
            n -= v.iov_len;
            *start += 1;
        }
    }

    /// Runs `op` (one `preadv` or `pwritev`) until every byte is moved; `op` gets the
    /// remaining `iovec`s (at most [`IOV_MAX`]) and the file offset.
    fn transfer_all(
        &mut self,
        mut offset: u64,
        op: impl Fn(&[libc::iovec], i64) -> isize,
    ) -> io::Result<()> {
        let mut start = 0;
        while start < self.iov.len() {
            let end = self.iov.len().min(start + IOV_MAX);
            let off = i64::try_from(offset)
                .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "offset overflow"))?;
            let n = op(&self.iov[start..end], off);
            let n = match usize::try_from(n) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => n,
                Err(_) => {
                    let e = io::Error::last_os_error();
                    if e.kind() == io::ErrorKind::Interrupted {
                        continue;
                    }
                    return Err(e);
                }
            };
            offset += n as u64;
            self.advance(&mut start, n);
        }
        Ok(())
    }

    /// Runs `op` (one `readv` or `writev`) once, again after EINTR.
    fn transfer_once(&self, op: impl Fn(&[libc::iovec]) -> isize) -> io::Result<usize> {
        if self.iov.len() > IOV_MAX {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        loop {
            match usize::try_from(op(self.iov)) {
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
}

/// `iovcnt` for a slice of at most [`IOV_MAX`] `iovec`s.
fn count(iov: &[libc::iovec]) -> libc::c_int {
    libc::c_int::try_from(iov.len()).unwrap_or(libc::c_int::MAX)
}

/// Device-readable guest bytes, to be written to a file or tap.
pub struct GuestSrc<'a>(Pieces<'a>);

impl<'a> GuestSrc<'a> {
    /// Empty, over `store`.
    pub(crate) fn new(store: &'a mut IoVecs) -> Self {
        GuestSrc(Pieces::new(store))
    }

    /// Appends `len` bytes of guest memory at `addr`.
    pub(crate) fn push(
        &mut self,
        mem: &'a GuestMemoryMmap,
        addr: GuestAddress,
        len: usize,
    ) -> Result<(), GuestMemoryError> {
        self.0.push_guest(mem, addr, len, Permissions::Read)
    }

    /// Number of `iovec`s.
    pub fn count(&self) -> usize {
        self.0.iov.len()
    }

    /// Total bytes.
    pub fn len(&self) -> usize {
        self.0.total()
    }

    /// Whether there are no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether every base and length is a multiple of `align`.
    pub fn aligned(&self, align: usize) -> bool {
        self.0.aligned(align)
    }

    /// `pwritev` of all bytes at `offset`, looping over short writes and EINTR.
    pub fn write_all_at(&mut self, file: &impl AsFd, offset: u64) -> io::Result<()> {
        let fd = file.as_fd().as_raw_fd();
        self.0.transfer_all(offset, |iov, off| {
            // SAFETY: every iovec points into guest memory that stays mapped while `self`
            // borrows it (checked ranges from `get_slices`), or is what is left of one after
            // `advance`; the kernel only reads from them. `iov` is a live slice of at most
            // IOV_MAX entries. The guest may change the bytes meanwhile: the write then
            // carries torn data, which is its own doing and harmless to the host.
            unsafe { libc::pwritev(fd, iov.as_ptr(), count(iov), off) }
        })
    }

    /// One `writev` of all bytes (a tap takes one frame per call); returns the bytes written.
    pub fn write_once(&mut self, file: &impl AsFd) -> io::Result<usize> {
        let fd = file.as_fd().as_raw_fd();
        self.0.transfer_once(|iov| {
            // SAFETY: as in `write_all_at`: live iovecs into mapped guest memory, only read by
            // the kernel; `transfer_once` passes at most IOV_MAX of them.
            unsafe { libc::writev(fd, iov.as_ptr(), count(iov)) }
        })
    }
}

/// Device-writable guest bytes (plus, for a receive, a host buffer after them), to be filled
/// from a file or tap.
pub struct GuestDst<'a>(Pieces<'a>);

impl<'a> GuestDst<'a> {
    /// Empty, over `store`.
    pub(crate) fn new(store: &'a mut IoVecs) -> Self {
        GuestDst(Pieces::new(store))
    }

    /// Appends `len` bytes of guest memory at `addr`.
    pub(crate) fn push(
        &mut self,
        mem: &'a GuestMemoryMmap,
        addr: GuestAddress,
        len: usize,
    ) -> Result<(), GuestMemoryError> {
        self.0.push_guest(mem, addr, len, Permissions::Write)
    }

    /// Appends a host buffer (borrowed as long as the guest memory).
    pub fn push_host(&mut self, buf: &'a mut [u8]) {
        if !buf.is_empty() {
            self.0.iov.push(libc::iovec {
                iov_base: buf.as_mut_ptr().cast(),
                iov_len: buf.len(),
            });
        }
    }

    /// Forgets every buffer (the guest's are not written, so none is marked dirty).
    pub fn clear(&mut self) {
        self.0.iov.clear();
        self.0.written.clear();
    }

    /// Number of `iovec`s.
    pub fn count(&self) -> usize {
        self.0.iov.len()
    }

    /// Total bytes.
    pub fn len(&self) -> usize {
        self.0.total()
    }

    /// Whether there are no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether every base and length is a multiple of `align`.
    pub fn aligned(&self, align: usize) -> bool {
        self.0.aligned(align)
    }

    /// `preadv` of all bytes at `offset`, looping over short reads and EINTR; the end of the
    /// file before that is `UnexpectedEof`.
    pub fn read_exact_at(&mut self, file: &impl AsFd, offset: u64) -> io::Result<()> {
        let fd = file.as_fd().as_raw_fd();
        self.0.transfer_all(offset, |iov, off| {
            // SAFETY: every iovec points into guest memory that stays mapped while `self`
            // borrows it (checked ranges from `get_slices`, mapped read-write), or into a host
            // buffer borrowed as long, or is what is left of one after `advance`. No Rust
            // reference to the guest bytes exists, so the kernel writing them (while the
            // guest may also access them) breaks no aliasing rule. `iov` is a live slice of
            // at most IOV_MAX entries.
            unsafe { libc::preadv(fd, iov.as_ptr(), count(iov), off) }
        })
    }

    /// One `readv` (a tap gives one frame per call); returns what the call returned (a frame
    /// longer than the buffers: its full length from recent taps, the bytes copied otherwise).
    pub fn read_once(&mut self, file: &impl AsFd) -> io::Result<usize> {
        let fd = file.as_fd().as_raw_fd();
        self.0.transfer_once(|iov| {
            // SAFETY: as in `read_exact_at`: live iovecs into mapped guest memory or a
            // borrowed host buffer; `transfer_once` passes at most IOV_MAX of them.
            unsafe { libc::readv(fd, iov.as_ptr(), count(iov)) }
        })
    }

    /// One frame from `file` into these guest buffers, with `overflow` after them: a frame
    /// longer than the guest's buffers spills into it, and the read returning more than the
    /// room says so. Returns the room (0 when the guest's buffers are in more pieces than one
    /// `readv` takes: the frame then lands in `overflow` alone) and what the call returned.
    pub fn read_frame(
        mut self,
        overflow: &'a mut [u8],
        file: &impl AsFd,
    ) -> (usize, io::Result<usize>) {
        let room = if self.count() < IOV_MAX {
            self.len()
        } else {
            self.clear();
            0
        };
        self.push_host(overflow);
        (room, self.read_once(file))
    }
}

#[cfg(test)]
#[allow(clippy::cast_possible_truncation)] // test data: small known values
mod tests {
    use std::io::Write;

    use vm_memory::Bytes;

    use super::*;
    use crate::testutil::{dirty_pages, memory_two_regions, SPLIT};

    fn file_with(bytes: &[u8]) -> std::fs::File {
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(bytes).unwrap();
        f
    }

    #[test]
    fn a_buffer_across_two_regions_is_two_iovecs() {
        let mem = memory_two_regions();
        let mut store = IoVecs::default();
        let mut dst = GuestDst::new(&mut store);
        dst.push(&mem, GuestAddress(SPLIT - 100), 300).unwrap();
        assert_eq!((dst.count(), dst.len()), (2, 300));
        let data: Vec<u8> = (0..300u32).map(|i| (i * 7) as u8).collect();
        dst.read_exact_at(&file_with(&data), 0).unwrap();
        drop(dst);
        let mut got = vec![0u8; 300];
        mem.read_slice(&mut got, GuestAddress(SPLIT - 100)).unwrap();
        assert_eq!(got, data);
        assert!(store.iov.is_empty(), "no pointer is kept after the request");
    }

    #[test]
    fn a_read_into_guest_buffers_marks_their_pages_dirty_after_the_transfer() {
        let mem = memory_two_regions();
        let mut store = IoVecs::default();
        let mut dst = GuestDst::new(&mut store);
        dst.push(&mem, GuestAddress(SPLIT - 100), 300).unwrap();
        dst.push(&mem, GuestAddress(3 * 4096 + 10), 1).unwrap();
        dst.read_exact_at(&file_with(&[7u8; 301]), 0).unwrap();
        assert!(dirty_pages(&mem).is_empty(), "marked when the request ends");
        drop(dst);
        assert_eq!(dirty_pages(&mem), vec![3 * 4096, SPLIT - 4096, SPLIT]);
        assert!(store.written.is_empty());
    }

    #[test]
    fn guest_bytes_only_read_or_forgotten_are_not_marked_dirty() {
        let mem = memory_two_regions();
        let mut store = IoVecs::default();
        let mut src = GuestSrc::new(&mut store);
        src.push(&mem, GuestAddress(0), 8192).unwrap();
        src.write_all_at(&tempfile::tempfile().unwrap(), 0).unwrap();
        drop(src);
        let mut dst = GuestDst::new(&mut store);
        dst.push(&mem, GuestAddress(4096), 10).unwrap();
        dst.clear();
        drop(dst);
        assert!(dirty_pages(&mem).is_empty());
    }

    #[test]
    fn more_than_iov_max_buffers_take_several_calls() {
        // 1500 buffers of 3 bytes: two preadv and two pwritev calls.
        let data: Vec<u8> = (0..4500u32).map(|i| (i % 251) as u8).collect();
        let mut bufs = vec![[0u8; 3]; 1500];
        let mut store = IoVecs::default();
        let mut dst = GuestDst::new(&mut store);
        for b in &mut bufs {
            dst.push_host(b);
        }
        assert_eq!(dst.count(), 1500);
        dst.read_exact_at(&file_with(&data), 0).unwrap();
        drop(dst);
        assert_eq!(bufs.concat(), data);

        let mem = memory_two_regions();
        mem.write_slice(&data, GuestAddress(SPLIT - 2000)).unwrap();
        let mut src = GuestSrc::new(&mut store);
        for i in 0..1500u64 {
            src.push(&mem, GuestAddress(SPLIT - 2000 + 3 * i), 3)
                .unwrap();
        }
        assert_eq!(src.count(), 1501, "one buffer crosses the regions");
        let out = tempfile::tempfile().unwrap();
        src.write_all_at(&out, 100).unwrap();
        let mut written = vec![0u8; 4600];
        std::os::unix::fs::FileExt::read_exact_at(&out, &mut written, 0).unwrap();
        assert_eq!(written[100..], data[..]);
        assert_eq!(written[..100], [0; 100]);
    }

    #[test]
    fn a_short_transfer_advances_into_the_middle_of_a_buffer() {
        let mut bufs = [[0u8; 4]; 3];
        let second = bufs[1].as_ptr() as usize;
        let mut store = IoVecs::default();
        let mut dst = GuestDst::new(&mut store);
        for b in &mut bufs {
            dst.push_host(b);
        }
        let mut start = 0;
        dst.0.advance(&mut start, 6);
        assert_eq!(start, 1, "the first buffer is done");
        assert_eq!(dst.0.iov[1].iov_len, 2);
        assert_eq!(dst.0.iov[1].iov_base as usize, second + 2);
        dst.0.advance(&mut start, 2);
        assert_eq!((start, dst.0.iov[2].iov_len), (2, 4));
        dst.0.advance(&mut start, 4);
        assert_eq!(start, 3);
    }

    #[test]
    fn a_file_that_ends_early_is_an_error_not_a_loop() {
        let mut short = [0u8; 16];
        let mut store = IoVecs::default();
        let mut dst = GuestDst::new(&mut store);
        dst.push_host(&mut short);
        let err = dst.read_exact_at(&file_with(&[1; 12]), 0).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
    }
}
