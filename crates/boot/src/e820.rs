//! The guest's physical memory map (e820 / PVH memmap), derived from the memory layout.
//!
//! RAM comes from [`GuestLayout`] regions (one entry per region, so per guest cell, split at
//! the MMIO hole); the caller's reserved ranges are cut out of RAM and reported as reserved.
//! The MMIO hole itself is not listed: a gap in the map is what the kernel treats as MMIO.

use std::ops::Range;

use vmhost_memory::GuestLayout;

/// What an e820 entry describes (values are the e820 / PVH memmap type codes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum E820Kind {
    /// Usable RAM (type 1).
    Ram = 1,
    /// Reserved (type 2): firmware areas, ACPI tables in the BIOS area.
    Reserved = 2,
}

impl E820Kind {
    /// The numeric type the boot protocols use.
    pub fn code(self) -> u32 {
        self as u32
    }
}

/// One entry of the memory map.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct E820Entry {
    /// First guest-physical address.
    pub addr: u64,
    /// Length in bytes (never 0).
    pub size: u64,
    /// Type.
    pub kind: E820Kind,
}

impl E820Entry {
    /// The range `addr..addr + size`.
    pub fn range(&self) -> Range<u64> {
        self.addr..self.addr + self.size
    }
}

/// The memory map of `layout` with `reserved` carved out of RAM.
///
/// Entries are sorted by address and never overlap. Reserved ranges are merged when they
/// overlap or touch and are listed even where they do not cover RAM; empty ranges are ignored.
pub fn e820_map(layout: &GuestLayout, reserved: &[Range<u64>]) -> Vec<E820Entry> {
    let reserved = merge(reserved);
    let mut out = Vec::new();
    for region in &layout.regions {
        let mut pieces = vec![region.gpa_range()];
        for r in &reserved {
            pieces = pieces.into_iter().flat_map(|p| subtract(p, r)).collect();
        }
        out.extend(pieces.into_iter().map(|p| entry(p, E820Kind::Ram)));
    }
    out.extend(reserved.into_iter().map(|r| entry(r, E820Kind::Reserved)));
    out.sort_by_key(|e| (e.addr, e.kind));
    out
}

fn entry(r: Range<u64>, kind: E820Kind) -> E820Entry {
    E820Entry {
        addr: r.start,
        size: r.end - r.start,
        kind,
    }
}

/// Sorted, non-empty, non-overlapping, non-touching ranges covering the same addresses.
fn merge(ranges: &[Range<u64>]) -> Vec<Range<u64>> {
    let mut v: Vec<Range<u64>> = ranges.iter().filter(|r| r.start < r.end).cloned().collect();
    v.sort_by_key(|r| r.start);
    let mut out: Vec<Range<u64>> = Vec::with_capacity(v.len());
    for r in v {
        match out.last_mut() {
            Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
            _ => out.push(r),
        }
    }
    out
}

/// `a` minus `b`: zero, one or two non-empty ranges.
fn subtract(a: Range<u64>, b: &Range<u64>) -> Vec<Range<u64>> {
    if b.end <= a.start || b.start >= a.end {
        return vec![a];
    }
    let mut out = Vec::new();
    if a.start < b.start {
        out.push(a.start..b.start);
    }
    if b.end < a.end {
        out.push(b.end..a.end);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmhost_memory::layout::CellSpan;
    use vmhost_memory::{MMIO_HOLE_END, MMIO_HOLE_START};

    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;

    fn layout(cells: &[u64]) -> GuestLayout {
        let spans: Vec<CellSpan> = cells
            .iter()
            .enumerate()
            .map(|(i, &size_bytes)| CellSpan {
                cell: u32::try_from(i).unwrap(),
                host_node: None,
                size_bytes,
            })
            .collect();
        GuestLayout::new(&spans, MMIO_HOLE_START..MMIO_HOLE_END, 2 * MIB).unwrap()
    }

    fn triples(map: &[E820Entry]) -> Vec<(u64, u64, E820Kind)> {
        map.iter().map(|e| (e.addr, e.size, e.kind)).collect()
    }

    #[test]
    fn firmware_area_is_cut_out_of_the_first_cell() {
        let firmware = 0xa_0000..0x10_0000;
        let map = e820_map(
            &layout(&[64 * MIB, 64 * MIB]),
            std::slice::from_ref(&firmware),
        );
        assert_eq!(
            triples(&map),
            vec![
                (0, 0xa_0000, E820Kind::Ram),
                (0xa_0000, 0x6_0000, E820Kind::Reserved),
                (0x10_0000, 63 * MIB, E820Kind::Ram),
                (64 * MIB, 64 * MIB, E820Kind::Ram),
            ]
        );
    }

    #[test]
    fn the_mmio_hole_is_a_gap_and_split_cells_give_two_entries() {
        let map = e820_map(&layout(&[2 * GIB, 2 * GIB]), &[]);
        assert_eq!(
            triples(&map),
            vec![
                (0, 2 * GIB, E820Kind::Ram),
                (2 * GIB, GIB, E820Kind::Ram),
                (4 * GIB, GIB, E820Kind::Ram),
            ]
        );
    }

    #[test]
    fn overlapping_and_empty_reserved_ranges_merge() {
        let map = e820_map(
            &layout(&[64 * MIB]),
            &[0xe_0000..0x10_0000, 0xa_0000..0xe_8000, 0x5000..0x5000],
        );
        assert_eq!(
            triples(&map),
            vec![
                (0, 0xa_0000, E820Kind::Ram),
                (0xa_0000, 0x6_0000, E820Kind::Reserved),
                (0x10_0000, 63 * MIB, E820Kind::Ram),
            ]
        );
    }

    #[test]
    fn reserved_ranges_outside_ram_and_inside_a_region_are_listed() {
        let map = e820_map(
            &layout(&[64 * MIB]),
            &[8 * MIB..9 * MIB, 0xfec0_0000..0xfec0_1000],
        );
        assert_eq!(
            triples(&map),
            vec![
                (0, 8 * MIB, E820Kind::Ram),
                (8 * MIB, MIB, E820Kind::Reserved),
                (9 * MIB, 55 * MIB, E820Kind::Ram),
                (0xfec0_0000, 0x1000, E820Kind::Reserved),
            ]
        );
        assert!(map.windows(2).all(|w| w[0].range().end <= w[1].addr));
    }
}
