//! Dirty page tracking for live migration's pre-copy (issue 22): KVM's dirty log on every RAM
//! memslot, ORed with the pages the VMM itself wrote through vm-memory.
//!
//! [`VmHandle::start_dirty_log`] registers every RAM memslot again with
//! `KVM_MEM_LOG_DIRTY_PAGES` (same slot, range and mapping: KVM changes only the flags) and
//! clears the VMM's bitmaps; [`VmHandle::take_dirty`] reads and clears one cell's log
//! (`KVM_GET_DIRTY_LOG` per slot of the cell, which also write-protects the pages again) and
//! the VMM's bitmaps of the same slots, mapped to 4 KiB page offsets in the cell;
//! [`VmHandle::stop_dirty_log`] registers the slots again without the flag. All three work
//! while the guest runs (pre-copy rounds) and while it is paused (the final round), from any
//! thread; they take one lock, so two callers do not interleave.
//!
//! Guest writes reach KVM's log; the VMM's writes through vm-memory (used rings, a device
//! filling guest buffers, `iov::GuestDst` after a `preadv`/`readv`) reach the
//! [`vmhost_memory::AtomicBitmap`] of their region. The kernel's vhost-vsock writes guest
//! memory directly and logs nowhere vmhost reads (`VHOST_F_LOG_ALL` is not set up): a VM with
//! a vhost-vsock device refuses to start the dirty log ([`DirtyLogError::VhostVsock`]), so it
//! cannot be migrated live until that is built (docs/migration.md).
//!
//! The payload boot area (page tables, descriptor tables, code, mailboxes) is not RAM and is
//! not logged: it moves as the payload's state, not as pages.
//!
//! **Use.** Start the log, then send all of RAM (writes before the start are in that copy);
//! each round then takes the dirty pages *before* reading them, so a write made while they
//! are sent is in the next round's log; the final round takes them with the VM paused and
//! its device I/O quiesced.

use std::sync::{Arc, Mutex, Weak};

use kvm_bindings::KVM_MEM_LOG_DIRTY_PAGES;
use kvm_ioctls::VmFd;
use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryRegion};
use vmhost_memory::{DirtyBitmap, GuestLayout, GuestMemoryMmap, DIRTY_PAGE_BYTES};

use crate::control::{lock, VmHandle};
use crate::sys;

/// Why dirty logging could not be started, read or stopped.
#[derive(Debug, thiserror::Error)]
pub enum DirtyLogError {
    /// The VM has been dropped (its KVM VM is closed, its RAM released).
    #[error("the VM is gone; there is no dirty log to read")]
    VmGone,
    /// The VM has a vhost-vsock device, whose kernel writes to guest memory are not logged.
    #[error("VM {vm}: its vsock device runs on the kernel's vhost-vsock, whose writes to guest memory are not tracked; live migration needs devices.vsock.backend = \"unix\"")]
    VhostVsock {
        /// VM name.
        vm: String,
    },
    /// The VM was built without a dirty log (every `Vm` constructor gives it one: a bug).
    #[error("this VM has no dirty log (it was built without one)")]
    NoLog,
    /// `start_dirty_log` was called while the log is already on.
    #[error("VM {vm}: dirty logging is already on")]
    AlreadyOn {
        /// VM name.
        vm: String,
    },
    /// KVM has no dirty log for the slot: logging is off (never started, or stopped).
    #[error("VM {vm}: memslot {slot} has no dirty log (start_dirty_log first)")]
    Off {
        /// VM name.
        vm: String,
        /// The memslot.
        slot: u32,
    },
    /// No guest cell has that number.
    #[error("VM {vm}: no guest cell {cell} (the guest has cells 0..{cells})")]
    NoCell {
        /// VM name.
        vm: String,
        /// The cell asked for.
        cell: u32,
        /// How many cells there are.
        cells: usize,
    },
    /// Registering a memslot again (with or without the log flag) failed.
    #[error(
        "VM {vm}: cannot {what} dirty logging on memslot {slot} (GPA {gpa:#x}, {size:#x} bytes)"
    )]
    Memslot {
        /// VM name.
        vm: String,
        /// `start` or `stop`.
        what: &'static str,
        /// The memslot.
        slot: u32,
        /// Its guest-physical start.
        gpa: u64,
        /// Its size.
        size: u64,
        /// The cause.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// `KVM_GET_DIRTY_LOG` failed.
    #[error("VM {vm}: KVM_GET_DIRTY_LOG on memslot {slot} failed")]
    GetLog {
        /// VM name.
        vm: String,
        /// The memslot.
        slot: u32,
        /// The cause.
        #[source]
        source: kvm_ioctls::Error,
    },
}

/// One RAM memslot and where it sits in its cell.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RamSlot {
    pub slot: u32,
    pub gpa: u64,
    pub size: u64,
    pub cell: u32,
    /// Offset of the slot's first byte in the cell's memory.
    pub cell_offset: u64,
}

/// What a VM needs to log its dirty pages. The `Vm` owns it (its RAM clone must not outlive
/// the VM); [`crate::control::Control`] holds it weakly for the handles.
pub(crate) struct DirtyLog {
    vm_name: String,
    vm: Weak<VmFd>,
    /// A clone of the VM's RAM: the same regions (and their bitmaps and mappings).
    ram: GuestMemoryMmap,
    slots: Vec<RamSlot>,
    /// Each cell's size, by cell number.
    cell_sizes: Vec<u64>,
    vhost_vsock: bool,
    /// Whether the log is on; its lock serializes start, take and stop.
    on: Mutex<bool>,
}

/// Builds the dirty log of a VM just created for `plan` on `ram` (memslots registered) and
/// gives `control` weak access to it; the `Vm` keeps the returned `Arc`. Every `Vm`
/// constructor calls this (`Vm::new`; a restored VM the same way).
pub(crate) fn attach(
    plan: &vmhost_plan::Plan,
    fd: &Arc<VmFd>,
    ram: &dyn crate::vm::GuestRam,
    linux: bool,
    control: &crate::control::Control,
) -> Arc<DirtyLog> {
    let vhost = plan
        .devices
        .spec
        .vsock
        .as_ref()
        .is_some_and(|v| v.backend == vmhost_config::VsockBackend::Vhost);
    let log = Arc::new(DirtyLog::new(
        &plan.name,
        fd,
        ram.guest_memory(),
        ram.guest_layout(),
        linux && vhost,
    ));
    control.set_dirty_log(&log);
    log
}

impl DirtyLog {
    /// The dirty log of a VM whose RAM memslots are `ram`'s regions numbered from 0 in order
    /// (as `setup::register_memslots` numbers them), placed in cells by `layout`.
    pub fn new(
        vm_name: &str,
        vm: &Arc<VmFd>,
        ram: &GuestMemoryMmap,
        layout: &GuestLayout,
        vhost_vsock: bool,
    ) -> Self {
        let slots = (0u32..)
            .zip(ram.iter())
            .filter_map(|(slot, region)| {
                let gpa = region.start_addr().0;
                let l = layout.regions.iter().find(|l| l.gpa == gpa)?;
                Some(RamSlot {
                    slot,
                    gpa,
                    size: region.len(),
                    cell: l.cell,
                    cell_offset: l.file_offset,
                })
            })
            .collect();
        let cells = layout.regions.iter().map(|r| r.cell + 1).max().unwrap_or(0);
        let cell_sizes = (0..cells)
            .map(|c| layout.cell_regions(c).map(|r| r.size_bytes).sum())
            .collect();
        DirtyLog {
            vm_name: vm_name.to_string(),
            vm: Arc::downgrade(vm),
            ram: ram.clone(),
            slots,
            cell_sizes,
            vhost_vsock,
            on: Mutex::new(false),
        }
    }

    fn vm(&self) -> Result<Arc<VmFd>, DirtyLogError> {
        self.vm.upgrade().ok_or(DirtyLogError::VmGone)
    }

    fn start(&self) -> Result<(), DirtyLogError> {
        let mut on = lock(&self.on);
        if self.vhost_vsock {
            return Err(DirtyLogError::VhostVsock {
                vm: self.vm_name.clone(),
            });
        }
        if *on {
            return Err(DirtyLogError::AlreadyOn {
                vm: self.vm_name.clone(),
            });
        }
        let vm = self.vm()?;
        for (i, s) in self.slots.iter().enumerate() {
            if let Err(e) = self.set_flags(&vm, s, KVM_MEM_LOG_DIRTY_PAGES, "start") {
                // Leave no slot half-logged.
                for done in &self.slots[..i] {
                    let _ = self.set_flags(&vm, done, 0, "stop");
                }
                return Err(e);
            }
        }
        // Dirty from now on: KVM's fresh logs are clean, and so are the VMM's bitmaps.
        for s in &self.slots {
            if let Some(bitmap) = self.vmm_bitmap(s) {
                bitmap.reset();
            }
        }
        *on = true;
        Ok(())
    }

    fn stop(&self) -> Result<(), DirtyLogError> {
        let mut on = lock(&self.on);
        let vm = self.vm()?;
        for s in &self.slots {
            self.set_flags(&vm, s, 0, "stop")?;
        }
        *on = false;
        Ok(())
    }

    fn take(&self, cell: u32) -> Result<DirtyBitmap, DirtyLogError> {
        let _on = lock(&self.on);
        let size = usize::try_from(cell)
            .ok()
            .and_then(|c| self.cell_sizes.get(c))
            .ok_or_else(|| DirtyLogError::NoCell {
                vm: self.vm_name.clone(),
                cell,
                cells: self.cell_sizes.len(),
            })?;
        let vm = self.vm()?;
        let mut dirty = DirtyBitmap::new(cell, *size);
        for s in self.slots.iter().filter(|s| s.cell == cell) {
            let first_page = s.cell_offset / DIRTY_PAGE_BYTES;
            let len = usize::try_from(s.size).unwrap_or(usize::MAX);
            let words = vm.get_dirty_log(s.slot, len).map_err(|source| {
                if source.errno() == libc::ENOENT {
                    DirtyLogError::Off {
                        vm: self.vm_name.clone(),
                        slot: s.slot,
                    }
                } else {
                    DirtyLogError::GetLog {
                        vm: self.vm_name.clone(),
                        slot: s.slot,
                        source,
                    }
                }
            })?;
            dirty.or_words(first_page, &words);
            if let Some(bitmap) = self.vmm_bitmap(s) {
                dirty.or_words(first_page, &bitmap.get_and_reset());
            }
        }
        Ok(dirty)
    }

    /// The VMM's bitmap of slot `s`'s region (one bit per 4 KiB host page from its start).
    fn vmm_bitmap(&self, s: &RamSlot) -> Option<&vmhost_memory::AtomicBitmap> {
        let region = self.ram.find_region(GuestAddress(s.gpa))?;
        Some(std::ops::Deref::deref(region).bitmap())
    }

    fn set_flags(
        &self,
        vm: &VmFd,
        s: &RamSlot,
        flags: u32,
        what: &'static str,
    ) -> Result<(), DirtyLogError> {
        let err = |source| DirtyLogError::Memslot {
            vm: self.vm_name.clone(),
            what,
            slot: s.slot,
            gpa: s.gpa,
            size: s.size,
            source,
        };
        let region = self
            .ram
            .find_region(GuestAddress(s.gpa))
            .ok_or_else(|| err(kvm_ioctls::Error::new(libc::EFAULT)))?;
        sys::set_memslot_flags(vm, s.slot, region, flags).map_err(err)
    }
}

impl VmHandle {
    /// Starts dirty logging on every RAM memslot: from now on [`VmHandle::take_dirty`] reports
    /// the pages the guest or the VMM wrote. Refused for a VM with a vhost-vsock device
    /// ([`DirtyLogError::VhostVsock`]) and when the log is already on.
    pub fn start_dirty_log(&self) -> Result<(), DirtyLogError> {
        self.dirty_log()?.start()
    }

    /// The pages of guest cell `cell` written since the log started or since the last
    /// `take_dirty` of that cell (KVM's log ORed with the VMM's writes; both cleared by the
    /// read). [`DirtyLogError::Off`] when logging is not on.
    pub fn take_dirty(&self, cell: u32) -> Result<DirtyBitmap, DirtyLogError> {
        self.dirty_log()?.take(cell)
    }

    /// Stops dirty logging: every RAM memslot is registered again without the flag, and the
    /// guest keeps running at full speed.
    pub fn stop_dirty_log(&self) -> Result<(), DirtyLogError> {
        self.dirty_log()?.stop()
    }

    /// Whether dirty logging is on.
    pub fn dirty_logging(&self) -> bool {
        self.dirty_log().is_ok_and(|d| *lock(&d.on))
    }

    /// The VM's dirty log, held for one call (the `Vm` owns it).
    fn dirty_log(&self) -> Result<Arc<DirtyLog>, DirtyLogError> {
        self.0
            .dirty_log()
            .ok_or(DirtyLogError::NoLog)?
            .upgrade()
            .ok_or(DirtyLogError::VmGone)
    }
}

#[cfg(test)]
mod tests {
    use vmhost_memory::layout::CellSpan;
    use vmhost_memory::{MMIO_HOLE_END, MMIO_HOLE_START};

    use super::*;

    #[test]
    fn a_vm_with_vhost_vsock_refuses_to_start_the_dirty_log() {
        if !vmhost_testsupport::need_kvm("a_vm_with_vhost_vsock_refuses_to_start_the_dirty_log") {
            return;
        }
        let kvm = kvm_ioctls::Kvm::new().expect("/dev/kvm");
        let vm = Arc::new(kvm.create_vm().expect("KVM_CREATE_VM"));
        let cells = [CellSpan {
            cell: 0,
            host_node: None,
            size_bytes: 4 << 20,
        }];
        let layout = GuestLayout::new(&cells, MMIO_HOLE_START..MMIO_HOLE_END, 4096).unwrap();
        let ram = layout.anonymous_memory().unwrap();
        let log = DirtyLog::new("vsock-vm", &vm, &ram, &layout, true);
        let err = log.start().unwrap_err();
        assert!(matches!(err, DirtyLogError::VhostVsock { .. }), "{err}");
        assert!(err.to_string().contains("devices.vsock.backend = \"unix\""));
        assert!(!*lock(&log.on));
    }
}
