//! The guest-physical layout of guest RAM.
//!
//! This module owns where each guest cell's memory appears in guest-physical address space.
//! Cells are laid out in cell order from GPA 0, skipping the MMIO hole below 4 GiB (where
//! device MMIO, the LAPIC/IOAPIC and firmware tables live). A cell that straddles the hole is
//! split into two regions of the same backing file: the part below the hole at file offset 0,
//! the rest from 4 GiB at the matching file offset. Boot code describes RAM from this layout
//! (e820 entries, ACPI SRAT memory affinity); the VM code registers one KVM memslot per region.
//!
//! The layout is pure arithmetic and is computed, and checked, before anything is allocated.

use std::ops::Range;

use crate::GuestMemoryMmap;
use serde::Serialize;
use vm_memory::mmap::FromRangesError;
use vm_memory::GuestAddress;
use vmhost_plan::Plan;

/// Start of the MMIO hole: guest RAM below 4 GiB ends here (3 GiB).
pub const MMIO_HOLE_START: u64 = 0xC000_0000;
/// End of the MMIO hole: guest RAM resumes here (4 GiB).
pub const MMIO_HOLE_END: u64 = 1 << 32;

/// Why a layout cannot be made.
#[derive(Debug, thiserror::Error)]
pub enum LayoutError {
    /// The hole's bounds are not page-aligned or not ordered.
    #[error(
        "MMIO hole {start:#x}..{end:#x} is not an ordered range aligned to {page_size_bytes:#x}"
    )]
    BadHole {
        /// Hole start.
        start: u64,
        /// Hole end.
        end: u64,
        /// Backing page size.
        page_size_bytes: u64,
    },
    /// A cell's memory is not a whole number of pages.
    #[error("guest cell {cell}: {size_bytes:#x} bytes is not a multiple of {page_size_bytes:#x}")]
    Unaligned {
        /// Cell number.
        cell: u32,
        /// Its size.
        size_bytes: u64,
        /// Backing page size.
        page_size_bytes: u64,
    },
    /// The cells do not fit in the 64-bit guest-physical space.
    #[error("guest cell {cell} ends past the end of the guest-physical address space")]
    Overflow {
        /// Cell number.
        cell: u32,
    },
}

/// One cell's memory to lay out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CellSpan {
    /// Guest cell number.
    pub cell: u32,
    /// Host node its memory is bound to.
    pub host_node: Option<u32>,
    /// Bytes of guest RAM.
    pub size_bytes: u64,
}

/// A contiguous range of guest RAM backed by one contiguous range of one cell's file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct LayoutRegion {
    /// Guest cell the memory belongs to (its SRAT proximity domain).
    pub cell: u32,
    /// Host node backing it.
    pub host_node: Option<u32>,
    /// Guest-physical start address.
    pub gpa: u64,
    /// Length in bytes.
    pub size_bytes: u64,
    /// Offset of the range in the cell's backing file.
    pub file_offset: u64,
}

impl LayoutRegion {
    /// The guest-physical range `gpa..gpa + size_bytes`.
    pub fn gpa_range(&self) -> Range<u64> {
        self.gpa..self.gpa + self.size_bytes
    }
}

/// Guest RAM in guest-physical order, and the MMIO hole.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GuestLayout {
    /// RAM regions, ascending by `gpa`, never overlapping the hole.
    pub regions: Vec<LayoutRegion>,
    /// Start of the MMIO hole below 4 GiB.
    pub mmio_hole_start: u64,
    /// End of the MMIO hole.
    pub mmio_hole_end: u64,
}

impl GuestLayout {
    /// Lays out `cells` in the given order from GPA 0 around the MMIO hole `hole`.
    /// Consecutive spans of the same cell continue in its backing file.
    ///
    /// Every size and the hole bounds must be multiples of `page_size_bytes`, so each region
    /// starts and ends on a backing page.
    pub fn new(
        cells: &[CellSpan],
        hole: Range<u64>,
        page_size_bytes: u64,
    ) -> Result<Self, LayoutError> {
        let page = page_size_bytes.max(1);
        if hole.start > hole.end || hole.start % page != 0 || hole.end % page != 0 {
            return Err(LayoutError::BadHole {
                start: hole.start,
                end: hole.end,
                page_size_bytes,
            });
        }
        let mut regions: Vec<LayoutRegion> = Vec::new();
        let mut gpa = 0u64;
        for c in cells {
            if c.size_bytes % page != 0 {
                return Err(LayoutError::Unaligned {
                    cell: c.cell,
                    size_bytes: c.size_bytes,
                    page_size_bytes,
                });
            }
            let mut left = c.size_bytes;
            // A cell may come in several spans (one per host node): they share the cell's
            // backing file, one after the other.
            let mut file_offset = match regions.last() {
                Some(r) if r.cell == c.cell => r.file_offset + r.size_bytes,
                _ => 0,
            };
            while left > 0 {
                if hole.contains(&gpa) {
                    gpa = hole.end;
                }
                let chunk = if gpa < hole.start {
                    left.min(hole.start - gpa)
                } else {
                    left
                };
                regions.push(LayoutRegion {
                    cell: c.cell,
                    host_node: c.host_node,
                    gpa,
                    size_bytes: chunk,
                    file_offset,
                });
                gpa = gpa
                    .checked_add(chunk)
                    .ok_or(LayoutError::Overflow { cell: c.cell })?;
                file_offset += chunk;
                left -= chunk;
            }
        }
        Ok(GuestLayout {
            regions,
            mmio_hole_start: hole.start,
            mmio_hole_end: hole.end,
        })
    }

    /// The layout of a plan's cells, in ascending cell number, around `hole` (normally
    /// [`MMIO_HOLE_START`]..[`MMIO_HOLE_END`]). A cell whose memory is bound to several host
    /// nodes ([`vmhost_plan::GuestCell::memory_parts`]) gets one span per node, in order, so
    /// each region is bound to one node while the guest sees one proximity domain.
    pub fn from_plan(plan: &Plan, hole: Range<u64>) -> Result<Self, LayoutError> {
        let mut cells: Vec<&vmhost_plan::GuestCell> = plan.guest_cells.iter().collect();
        cells.sort_by_key(|c| c.cell);
        let spans: Vec<CellSpan> = cells
            .iter()
            .flat_map(|c| {
                c.memory_parts().into_iter().map(|p| CellSpan {
                    cell: c.cell,
                    host_node: p.host_node,
                    size_bytes: p.memory_bytes,
                })
            })
            .collect();
        Self::new(&spans, hole, plan.backing.page_size_bytes())
    }

    /// The regions of one guest cell (one, or two when it straddles the hole).
    pub fn cell_regions(&self, cell: u32) -> impl Iterator<Item = &LayoutRegion> {
        self.regions.iter().filter(move |r| r.cell == cell)
    }

    /// One past the highest guest RAM address.
    pub fn ram_end(&self) -> u64 {
        self.regions.last().map_or(0, |r| r.gpa + r.size_bytes)
    }

    /// Total guest RAM in bytes.
    pub fn ram_bytes(&self) -> u64 {
        self.regions.iter().map(|r| r.size_bytes).sum()
    }

    /// The MMIO hole as a range.
    pub fn mmio_hole(&self) -> Range<u64> {
        self.mmio_hole_start..self.mmio_hole_end
    }

    /// Plain anonymous memory with one region per layout region: no NUMA binding, no
    /// hugepages, no prefault. For tests and tools that need guest RAM in this layout without
    /// a plan's placement; a VM's RAM is a [`crate::GuestMemory`].
    ///
    /// ```
    /// use vmhost_memory::{GuestLayout, layout::CellSpan, MMIO_HOLE_END, MMIO_HOLE_START};
    /// let cells = [CellSpan { cell: 0, host_node: None, size_bytes: 16 << 20 }];
    /// let layout = GuestLayout::new(&cells, MMIO_HOLE_START..MMIO_HOLE_END, 4096).unwrap();
    /// let mem = layout.anonymous_memory().unwrap();
    /// assert_eq!(vm_memory::GuestMemoryBackend::num_regions(&mem), 1);
    /// ```
    pub fn anonymous_memory(&self) -> Result<GuestMemoryMmap, FromRangesError> {
        let ranges: Vec<(GuestAddress, usize)> = self
            .regions
            .iter()
            .map(|r| {
                let size = usize::try_from(r.size_bytes).unwrap_or(usize::MAX);
                (GuestAddress(r.gpa), size)
            })
            .collect();
        GuestMemoryMmap::from_ranges(&ranges)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;
    const HOLE: Range<u64> = MMIO_HOLE_START..MMIO_HOLE_END;

    fn span(cell: u32, size_bytes: u64) -> CellSpan {
        CellSpan {
            cell,
            host_node: Some(cell),
            size_bytes,
        }
    }

    #[test]
    fn small_cells_are_consecutive_from_zero() {
        let l = GuestLayout::new(&[span(0, GIB), span(1, GIB)], HOLE, 2 << 20).unwrap();
        let got: Vec<_> = l
            .regions
            .iter()
            .map(|r| (r.cell, r.gpa, r.size_bytes, r.file_offset))
            .collect();
        assert_eq!(got, vec![(0, 0, GIB, 0), (1, GIB, GIB, 0)]);
        assert_eq!(l.ram_end(), 2 * GIB);
        assert_eq!(l.ram_bytes(), 2 * GIB);
    }

    #[test]
    fn a_cell_straddling_the_hole_is_split_with_matching_file_offset() {
        let l = GuestLayout::new(&[span(0, 2 * GIB), span(1, 2 * GIB)], HOLE, 1 << 30).unwrap();
        let got: Vec<_> = l
            .regions
            .iter()
            .map(|r| (r.cell, r.gpa, r.size_bytes, r.file_offset))
            .collect();
        assert_eq!(
            got,
            vec![
                (0, 0, 2 * GIB, 0),
                (1, 2 * GIB, GIB, 0),
                (1, 4 * GIB, GIB, GIB)
            ]
        );
        assert_eq!(l.cell_regions(1).count(), 2);
        assert!(l.regions.iter().all(|r| {
            let g = r.gpa_range();
            g.end <= l.mmio_hole_start || g.start >= l.mmio_hole_end
        }));
    }

    #[test]
    fn a_cell_starting_at_the_hole_moves_above_it() {
        let l = GuestLayout::new(&[span(0, 3 * GIB), span(1, GIB)], HOLE, 2 << 20).unwrap();
        assert_eq!(l.regions[1].gpa, 4 * GIB);
        assert_eq!(l.regions[1].file_offset, 0);
        assert_eq!(l.ram_end(), 5 * GIB);
    }

    #[test]
    fn misaligned_inputs_are_rejected() {
        let err = GuestLayout::new(&[span(0, GIB + 4096)], HOLE, 2 << 20).unwrap_err();
        assert!(
            matches!(err, LayoutError::Unaligned { cell: 0, .. }),
            "{err:?}"
        );
        let err = GuestLayout::new(&[span(0, GIB)], (3 * GIB + (2 << 20))..(4 * GIB), 1 << 30)
            .unwrap_err();
        assert!(matches!(err, LayoutError::BadHole { .. }), "{err:?}");
        let err = GuestLayout::new(&[span(0, u64::MAX - 4095)], HOLE, 4096).unwrap_err();
        assert!(matches!(err, LayoutError::Overflow { cell: 0 }), "{err:?}");
    }

    #[test]
    fn a_cell_over_two_nodes_gets_a_region_per_node_in_one_file() {
        let mut plan =
            crate::testutil::plan("test", &[(None, 3 * GIB)], vmhost_plan::Backing::Anonymous);
        plan.guest_cells[0].spans = vec![
            vmhost_plan::MemorySpan {
                host_node: 0,
                memory_bytes: 2 * GIB,
                prefault_cpus: vec![0],
            },
            vmhost_plan::MemorySpan {
                host_node: 1,
                memory_bytes: GIB,
                prefault_cpus: vec![1],
            },
        ];
        let l = GuestLayout::from_plan(&plan, HOLE).unwrap();
        let got: Vec<_> = l
            .regions
            .iter()
            .map(|r| (r.cell, r.host_node, r.gpa, r.size_bytes, r.file_offset))
            .collect();
        // Node 1's part straddles the hole: two regions, file offsets continuing.
        assert_eq!(
            got,
            vec![
                (0, Some(0), 0, 2 * GIB, 0),
                (0, Some(1), 2 * GIB, GIB, 2 * GIB),
            ]
        );
        plan.guest_cells[0].spans[1].memory_bytes = 2 * GIB;
        plan.guest_cells[0].memory_bytes = 4 * GIB;
        let l = GuestLayout::from_plan(&plan, HOLE).unwrap();
        assert_eq!(l.regions[2].file_offset, 3 * GIB);
        assert_eq!(l.regions[2].gpa, 4 * GIB);
        assert_eq!(l.regions[2].host_node, Some(1));
    }

    #[test]
    fn from_plan_orders_by_cell_number() {
        let mut plan = crate::testutil::plan(
            "test",
            &[(Some(0), GIB), (Some(0), 2 * GIB)],
            vmhost_plan::Backing::Anonymous,
        );
        plan.guest_cells.swap(0, 1);
        let l = GuestLayout::from_plan(&plan, HOLE).unwrap();
        assert_eq!(l.regions[0].cell, 0);
        assert_eq!(l.regions[0].size_bytes, GIB);
        assert_eq!(l.regions[1].gpa, GIB);
        assert_eq!(l.mmio_hole(), HOLE);
    }
}
