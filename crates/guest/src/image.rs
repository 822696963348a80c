//! A generated program, ready to be copied into guest memory.

use crate::abi::IDT_VECTORS;

/// Alignment of the address a program is placed at: its loop heads are aligned to this
/// boundary relative to its start.
pub const CODE_ALIGN: u64 = 64;

/// Where a program's entry points are: offsets from its start in a [`ProgramImage`],
/// guest-physical addresses once placed ([`ProgramImage::entry_points_at`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EntryPoints {
    /// Ring-0 entry point (RIP of every vCPU at start).
    pub entry: u64,
    /// Ring-3 entry point.
    pub user_entry: u64,
    /// The IDT's handler of each vector: exceptions 0..31, then the timer tick
    /// ([`crate::abi::TICK_VECTOR`]) and the spurious interrupt ([`crate::abi::SPURIOUS_VECTOR`]).
    pub handlers: [u64; IDT_VECTORS],
}

/// A program's position-independent machine code and its entry points as offsets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProgramImage {
    /// Machine code; runs at any [`CODE_ALIGN`]-aligned address.
    pub code: &'static [u8],
    /// Entry points, as offsets into `code`.
    pub offsets: EntryPoints,
}

impl ProgramImage {
    /// The entry points of the program copied to `base`, or `None` when `base` is not
    /// [`CODE_ALIGN`]-aligned (or the addresses would overflow).
    ///
    /// ```
    /// use vmhost_guest::{EntryPoints, ProgramImage};
    /// let image = ProgramImage {
    ///     code: &[0xf4],
    ///     offsets: EntryPoints { entry: 0, user_entry: 0, handlers: [0; 34] },
    /// };
    /// assert_eq!(image.entry_points_at(0x1000).unwrap().entry, 0x1000);
    /// assert!(image.entry_points_at(0x1001).is_none());
    /// ```
    pub fn entry_points_at(&self, base: u64) -> Option<EntryPoints> {
        if base % CODE_ALIGN != 0 {
            return None;
        }
        let mut handlers = [0u64; IDT_VECTORS];
        for (h, off) in handlers.iter_mut().zip(self.offsets.handlers) {
            *h = base.checked_add(off)?;
        }
        Some(EntryPoints {
            entry: base.checked_add(self.offsets.entry)?,
            user_entry: base.checked_add(self.offsets.user_entry)?,
            handlers,
        })
    }
}
