//! A device's register page: the values of its virtio-mmio registers laid out as the window
//! holds them, in one page of host memory that the VMM maps into the guest read-only (a
//! `KVM_MEM_READONLY` memslot over the device's window).
//!
//! With it a guest reads every register, `InterruptStatus` included, without leaving the
//! vCPU; its writes still exit (or end in an ioeventfd). The transport
//! ([`crate::MmioTransport::mirror_registers`]) rewrites the page after every write that can
//! change what a read returns, and the device's [`crate::Interrupt`] keeps `InterruptStatus`
//! in it. Reading the status is then free, so it cannot acknowledge: the driver's
//! `InterruptACK` of the used-buffer bit ends in an ioeventfd and the bit stays set (Linux's
//! driver then checks its queues on every interrupt, which it does anyway); acknowledging the
//! configuration bit still exits and clears both.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::io;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU8, Ordering};

/// The page's size: one virtio-mmio window.
pub const REGISTER_PAGE_SIZE: usize = 4096;

/// One zeroed, page-aligned page of host memory holding a device's register values.
///
/// ```
/// use vmhost_devices::regpage::RegisterPage;
/// let page = RegisterPage::new().unwrap();
/// page.store_u32(0x70, 15);
/// assert_eq!(page.load_u32(0x70), 15);
/// page.store_bytes(0x100, &[1, 2, 3]);
/// assert_eq!(page.load_u32(0x100), 0x0003_0201);
/// ```
pub struct RegisterPage {
    ptr: NonNull<u8>,
}

// SAFETY: the page is only accessed through atomics (`store_u32`, `store_bytes`, `load_u32`),
// so sharing it between the vCPU, I/O and VMM threads is sound; the guest reads it through KVM.
unsafe impl Send for RegisterPage {}
// SAFETY: as above: every access through `&self` is atomic.
unsafe impl Sync for RegisterPage {}

impl std::fmt::Debug for RegisterPage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RegisterPage({:p})", self.ptr)
    }
}

impl RegisterPage {
    /// A zeroed page of its own (page-sized and page-aligned, so no other data shares it).
    pub fn new() -> io::Result<Self> {
        let raw = {
            let layout = Self::layout()?;
            // SAFETY: the layout has a non-zero size.
            unsafe { alloc_zeroed(layout) }
        };
        let ptr = NonNull::new(raw).ok_or(io::ErrorKind::OutOfMemory)?;
        Ok(RegisterPage { ptr })
    }

    fn layout() -> io::Result<Layout> {
        Layout::from_size_align(REGISTER_PAGE_SIZE, REGISTER_PAGE_SIZE)
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
    }

    /// The page's host address, for the memslot.
    pub fn host_address(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    fn word(&self, offset: usize) -> Option<&AtomicU32> {
        if offset % 4 != 0 || offset + 4 > REGISTER_PAGE_SIZE {
            return None;
        }
        // SAFETY: `offset + 4 <= REGISTER_PAGE_SIZE` and `offset` is 4-aligned in a page-aligned
        // allocation that lives as long as `self`; every access to it is atomic.
        Some(unsafe { &*self.ptr.as_ptr().add(offset).cast::<AtomicU32>() })
    }

    /// Stores a register (a 4-aligned `offset` in the page; others are ignored).
    pub fn store_u32(&self, offset: usize, value: u32) {
        if let Some(w) = self.word(offset) {
            w.store(value, Ordering::Release);
        }
    }

    /// A register's value (0 for an offset outside the page or unaligned).
    pub fn load_u32(&self, offset: usize) -> u32 {
        self.word(offset).map_or(0, |w| w.load(Ordering::Acquire))
    }

    /// Stores bytes from `offset` (the configuration space); bytes past the page are dropped.
    pub fn store_bytes(&self, offset: usize, bytes: &[u8]) {
        for (i, &b) in bytes.iter().enumerate() {
            let at = offset + i;
            if at >= REGISTER_PAGE_SIZE {
                break;
            }
            // SAFETY: `at` is inside the allocation, which lives as long as `self`; every
            // access to it is atomic.
            let cell = unsafe { &*self.ptr.as_ptr().add(at).cast::<AtomicU8>() };
            cell.store(b, Ordering::Release);
        }
    }
}

impl Drop for RegisterPage {
    fn drop(&mut self) {
        if let Ok(layout) = Self::layout() {
            // SAFETY: `ptr` came from `alloc_zeroed` with this layout and is freed only here.
            unsafe { dealloc(self.ptr.as_ptr(), layout) }
        }
    }
}
