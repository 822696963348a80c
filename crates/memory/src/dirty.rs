//! Which pages of one guest cell were written since the last look: a [`DirtyBitmap`], one bit
//! per 4 KiB page ([`DIRTY_PAGE_BYTES`]) at offsets within the cell (the cell's memory in
//! guest-physical order, as the snapshot and migration page streams address it).
//!
//! The vcpu crate fills it from KVM's dirty log (`KVM_GET_DIRTY_LOG`, the guest's writes) ORed
//! with the VMM's own writes (the [`crate::AtomicBitmap`] of each region of
//! [`crate::GuestMemoryMmap`]); a pre-copy round then sends the dirty pages, as runs
//! ([`DirtyBitmap::runs`]) or through `vmhost_persist::pages::write_pages` with
//! [`DirtyBitmap::is_clean`] as its skip predicate. Pure data: no KVM, no mapping.
//!
//! ```
//! use vmhost_memory::{DirtyBitmap, DIRTY_PAGE_BYTES as P};
//!
//! let mut d = DirtyBitmap::new(1, 64 * P);
//! d.mark_range(5 * P + 100, 2 * P); // touches pages 5, 6 and 7
//! d.or_words(60, &[0b11]); // KVM's log of a slot at page 60: pages 60 and 61
//! assert_eq!(d.runs().collect::<Vec<_>>(), vec![5 * P..8 * P, 60 * P..62 * P]);
//! assert!(d.is_clean(0, &[0u8; 4096]) && !d.is_clean(6 * P, &[0u8; 4096]));
//! assert_eq!(d.dirty_bytes(), 5 * P);
//! ```

use std::ops::Range;

/// The granularity of a [`DirtyBitmap`]: KVM's dirty log and vm-memory's bitmap track 4 KiB
/// pages, whatever the backing page size.
pub const DIRTY_PAGE_BYTES: u64 = 4096;

const WORD_BITS: u64 = u64::BITS as u64;

/// The dirty 4 KiB pages of one guest cell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirtyBitmap {
    cell: u32,
    size_bytes: u64,
    words: Vec<u64>,
}

impl DirtyBitmap {
    /// A clean bitmap for guest cell `cell` of `size_bytes` bytes (a partial last page counts
    /// as a page).
    pub fn new(cell: u32, size_bytes: u64) -> Self {
        let pages = size_bytes.div_ceil(DIRTY_PAGE_BYTES);
        let words = usize::try_from(pages.div_ceil(WORD_BITS)).unwrap_or(usize::MAX);
        DirtyBitmap {
            cell,
            size_bytes,
            words: vec![0; words],
        }
    }

    /// The guest cell.
    pub fn cell(&self) -> u32 {
        self.cell
    }

    /// The cell's size in bytes.
    pub fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    /// Number of 4 KiB pages tracked.
    pub fn pages(&self) -> u64 {
        self.size_bytes.div_ceil(DIRTY_PAGE_BYTES)
    }

    /// Marks page `page` (an index of 4 KiB pages in the cell) dirty; an index past the cell's
    /// end is ignored and returns false.
    pub fn mark_page(&mut self, page: u64) -> bool {
        if page >= self.pages() {
            return false;
        }
        let (word, bit) = split(page);
        self.words[word] |= 1 << bit;
        true
    }

    /// Marks every page that `len` bytes at `offset` in the cell touch (clamped to the cell).
    pub fn mark_range(&mut self, offset: u64, len: u64) {
        let Some(last) = offset.checked_add(len).filter(|_| len > 0) else {
            return;
        };
        let end = last.min(self.size_bytes);
        for page in offset / DIRTY_PAGE_BYTES..end.div_ceil(DIRTY_PAGE_BYTES) {
            self.mark_page(page);
        }
    }

    /// ORs in a bitmap laid out as KVM's dirty log and vm-memory's `AtomicBitmap` are: bit `b`
    /// of word `w` is page `first_page + 64 * w + b`. Pages past the cell's end are ignored;
    /// returns how many were.
    pub fn or_words(&mut self, first_page: u64, words: &[u64]) -> u64 {
        let mut outside = 0;
        let aligned = first_page % WORD_BITS == 0;
        let base = usize::try_from(first_page / WORD_BITS).unwrap_or(usize::MAX);
        for (w, &bits) in words.iter().enumerate().filter(|(_, &b)| b != 0) {
            let whole = aligned && w < self.words.len().saturating_sub(base) && {
                let page_end = first_page + (w as u64 + 1) * WORD_BITS;
                page_end <= self.pages()
            };
            if whole {
                self.words[base + w] |= bits;
                continue;
            }
            for bit in set_bits(bits) {
                let page = first_page.saturating_add(w as u64 * WORD_BITS + bit);
                if !self.mark_page(page) {
                    outside += 1;
                }
            }
        }
        outside
    }

    /// ORs `other` (the same cell and size) into this one.
    ///
    /// # Panics
    /// Never; a bitmap of another size is merged page by page, pages past this one's end
    /// dropped.
    pub fn union(&mut self, other: &DirtyBitmap) {
        if other.words.len() == self.words.len() {
            for (a, b) in self.words.iter_mut().zip(&other.words) {
                *a |= b;
            }
        } else {
            self.or_words(0, &other.words);
        }
    }

    /// Whether the page holding byte `offset` of the cell is dirty.
    pub fn is_dirty(&self, offset: u64) -> bool {
        let page = offset / DIRTY_PAGE_BYTES;
        if page >= self.pages() {
            return false;
        }
        let (word, bit) = split(page);
        self.words[word] & (1 << bit) != 0
    }

    /// Whether any page that `len` bytes at `offset` touch is dirty (a 2 MiB page of the
    /// stream holds 512 of these pages).
    pub fn any_dirty(&self, offset: u64, len: u64) -> bool {
        let end = offset.saturating_add(len).min(self.size_bytes);
        (offset / DIRTY_PAGE_BYTES..end.div_ceil(DIRTY_PAGE_BYTES))
            .any(|page| self.is_dirty(page * DIRTY_PAGE_BYTES))
    }

    /// The skip predicate of `vmhost_persist::pages::write_pages` for a pre-copy round: true
    /// (skip) when no byte of the stream page at `offset` is dirty.
    pub fn is_clean(&self, offset: u64, page: &[u8]) -> bool {
        !self.any_dirty(offset, page.len() as u64)
    }

    /// Number of dirty pages.
    pub fn dirty_pages(&self) -> u64 {
        self.words.iter().map(|w| u64::from(w.count_ones())).sum()
    }

    /// Bytes to send for the dirty pages (the last page clamped to the cell's end).
    pub fn dirty_bytes(&self) -> u64 {
        self.runs().map(|r| r.end - r.start).sum()
    }

    /// Whether no page is dirty.
    pub fn is_empty(&self) -> bool {
        self.words.iter().all(|&w| w == 0)
    }

    /// Clears every bit.
    pub fn clear(&mut self) {
        self.words.fill(0);
    }

    /// The dirty pages as maximal byte ranges of the cell, in order (the last clamped to the
    /// cell's end).
    pub fn runs(&self) -> DirtyRuns<'_> {
        DirtyRuns { map: self, next: 0 }
    }
}

/// Iterator over a [`DirtyBitmap`]'s dirty byte ranges.
#[derive(Debug)]
pub struct DirtyRuns<'a> {
    map: &'a DirtyBitmap,
    next: u64,
}

impl Iterator for DirtyRuns<'_> {
    type Item = Range<u64>;

    fn next(&mut self) -> Option<Range<u64>> {
        let pages = self.map.pages();
        let start = self.map.next_page(self.next, true).filter(|&p| p < pages)?;
        let end = self
            .map
            .next_page(start, false)
            .map_or(pages, |p| p.min(pages));
        self.next = end;
        let bytes = |p: u64| (p * DIRTY_PAGE_BYTES).min(self.map.size_bytes);
        Some(bytes(start)..bytes(end))
    }
}

impl DirtyBitmap {
    /// The first page from `from` on whose bit is `dirty`, a word at a time (`None`: none in
    /// the words; a clean search may return a page past the cell's end, in the last word).
    fn next_page(&self, from: u64, dirty: bool) -> Option<u64> {
        let first = usize::try_from(from / WORD_BITS).ok()?;
        let mut mask = u64::MAX << (from % WORD_BITS);
        for (i, &w) in self.words.iter().enumerate().skip(first) {
            let bits = if dirty { w } else { !w } & mask;
            if bits != 0 {
                return Some(i as u64 * WORD_BITS + u64::from(bits.trailing_zeros()));
            }
            mask = u64::MAX;
        }
        None
    }
}

fn split(page: u64) -> (usize, u64) {
    // The caller checked `page < pages()`, and the word vector has pages / 64 entries.
    ((page / WORD_BITS) as usize, page % WORD_BITS)
}

fn set_bits(mut bits: u64) -> impl Iterator<Item = u64> {
    std::iter::from_fn(move || {
        (bits != 0).then(|| {
            let b = u64::from(bits.trailing_zeros());
            bits &= bits - 1;
            b
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: u64 = DIRTY_PAGE_BYTES;

    #[test]
    fn marked_pages_come_back_as_merged_runs() {
        let mut m = DirtyBitmap::new(1, 200 * P);
        for page in [0, 1, 2, 63, 64, 65, 130, 199] {
            assert!(m.mark_page(page));
        }
        assert!(!m.mark_page(200), "past the end");
        let runs: Vec<_> = m.runs().collect();
        assert_eq!(
            runs,
            vec![0..3 * P, 63 * P..66 * P, 130 * P..131 * P, 199 * P..200 * P]
        );
        assert_eq!((m.dirty_pages(), m.dirty_bytes()), (8, 8 * P));
        assert_eq!(m.cell(), 1);
    }

    #[test]
    fn runs_span_whole_words_and_stop_at_the_cell_end() {
        let mut m = DirtyBitmap::new(0, 300 * P);
        for page in (10..140).chain(290..300) {
            m.mark_page(page);
        }
        assert_eq!(
            m.runs().collect::<Vec<_>>(),
            vec![10 * P..140 * P, 290 * P..300 * P]
        );
        let mut full = DirtyBitmap::new(0, 128 * P);
        full.mark_range(0, 128 * P);
        assert_eq!(full.runs().collect::<Vec<_>>(), vec![0..128 * P]);
        assert!(DirtyBitmap::new(0, 0).runs().next().is_none());
    }

    #[test]
    fn a_partial_last_page_is_clamped_to_the_cell() {
        let mut m = DirtyBitmap::new(0, 3 * P + 100);
        m.mark_range(3 * P + 50, 1000);
        assert_eq!(m.runs().collect::<Vec<_>>(), vec![3 * P..3 * P + 100]);
        assert_eq!(m.dirty_bytes(), 100);
    }

    #[test]
    fn mark_range_covers_every_touched_page() {
        let mut m = DirtyBitmap::new(0, 16 * P);
        m.mark_range(P - 1, 2);
        m.mark_range(10 * P, 0);
        m.mark_range(u64::MAX - 1, 10);
        assert_eq!(m.runs().collect::<Vec<_>>(), vec![0..2 * P]);
    }

    #[test]
    fn kvm_words_at_an_unaligned_slot_land_on_the_right_pages() {
        let mut aligned = DirtyBitmap::new(0, 256 * P);
        assert_eq!(aligned.or_words(64, &[0b101, 1 << 63]), 0);
        assert!(aligned.is_dirty(64 * P) && aligned.is_dirty(66 * P));
        assert!(aligned.is_dirty(191 * P) && !aligned.is_dirty(65 * P));
        let mut odd = DirtyBitmap::new(0, 256 * P);
        assert_eq!(odd.or_words(10, &[0b11, 1]), 0);
        assert_eq!(
            odd.runs().collect::<Vec<_>>(),
            vec![10 * P..12 * P, 74 * P..75 * P]
        );
        let mut short = DirtyBitmap::new(0, 70 * P);
        assert_eq!(
            short.or_words(64, &[u64::MAX]),
            58,
            "pages 70.. are outside"
        );
        assert_eq!(short.dirty_pages(), 6);
    }

    #[test]
    fn is_clean_asks_about_every_small_page_of_a_large_stream_page() {
        let two_mib = 2 << 20;
        let mut m = DirtyBitmap::new(0, 2 * two_mib);
        m.mark_page(two_mib / P + 511);
        let page = vec![0u8; 2 << 20];
        assert!(m.is_clean(0, &page));
        assert!(!m.is_clean(two_mib, &page));
        assert!(m.any_dirty(two_mib + 511 * P, 1));
        assert!(!m.any_dirty(two_mib + 510 * P, P));
    }

    #[test]
    fn union_and_clear() {
        let mut a = DirtyBitmap::new(0, 128 * P);
        let mut b = DirtyBitmap::new(0, 128 * P);
        a.mark_page(3);
        b.mark_page(100);
        a.union(&b);
        assert_eq!(a.dirty_pages(), 2);
        a.clear();
        assert!(a.is_empty() && a.runs().next().is_none());
    }
}
