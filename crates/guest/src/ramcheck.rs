//! `idle`'s RAM pattern: guest-visible proof that its RAM moved with a snapshot or migration.
//!
//! At its start `idle` writes [`PAGES`] pages of its own guest cell, `stride` bytes apart from
//! `base` (both from the mailbox, see [`placement`]: spread over the cell's first range, so
//! several 2 MiB hugepages are involved). Page `p` holds a stamp in its first word and
//! [`word`]`(seed, p, j)` at byte `j * WORD_STRIDE` for `j` in `1..WORDS`, the seed being the
//! guest's `tsc_start`. On each timer tick `t` (counted in `ticks` first) the handler
//!
//! 1. rewrites the stamp of page `t % PAGES` with `t` (a real dirty page every tick), then
//! 2. verifies [`PAGES_PER_TICK`] pages in turn (`ram_checked` counts them): a page is wrong
//!    (one more `ram_errors`) when a word differs from its pattern or its stamp `s` is not the
//!    latest one it can hold: `s % PAGES != p` or `t - s >= PAGES` (wrapping).
//!
//! At the start the stamps are those the ticks up to `ticks` would have left ([`initial_stamp`]).
//! A target whose RAM did not receive the pages (zeros), or an older copy of a page rewritten
//! since, reports `ram_errors > 0` within one pass of [`PAGES`] / [`PAGES_PER_TICK`] ticks.
//!
//! The handler runs in ring 0, which this nested host emulates (~0.9 M instructions/s): a tick
//! costs ~150 instructions (~0.15 ms of a 10 ms period), hence few words and pages per tick.

/// Pattern pages per vCPU (a power of two).
pub const PAGES: u64 = 64;
/// Pages verified per timer tick.
pub const PAGES_PER_TICK: u64 = 2;
/// Bytes between the checked words of a page.
pub const WORD_STRIDE: u64 = 1024;
/// Checked words per page, the stamp (word 0) included.
pub const WORDS: u64 = 4;
/// Added to the seed ("ramcheck" in ASCII).
pub const TAG: u64 = u64::from_le_bytes(*b"ramcheck");
/// Page size of the pattern pages.
pub const PAGE: u64 = 4096;

const _: () = assert!(PAGES.is_power_of_two() && PAGES % PAGES_PER_TICK == 0);
const _: () = assert!(WORDS * WORD_STRIDE <= PAGE);

/// Word `j` (`1..WORDS`) of pattern page `page` for `seed` (the guest's `tsc_start`).
///
/// ```
/// use vmhost_guest::ramcheck::{word, TAG};
/// assert_eq!(word(0, 0, 1), TAG.wrapping_add(1 << 16));
/// assert_ne!(word(7, 1, 1), word(7, 2, 1));
/// ```
pub fn word(seed: u64, page: u64, j: u64) -> u64 {
    seed.wrapping_add(TAG)
        .wrapping_add(page << 32)
        .wrapping_add(j << 16)
}

/// The stamp page `page` gets at the start, when `ticks` is `t0`: the last tick up to `t0`
/// that would have rewritten it (wrapping below zero).
pub fn initial_stamp(t0: u64, page: u64) -> u64 {
    t0.wrapping_sub(t0.wrapping_sub(page) & (PAGES - 1))
}

/// Where vCPU `rank` (its place among the vCPUs of its guest cell) keeps its pattern pages in a
/// cell range at `gpa` of `len` bytes: `(base, stride)`, or `None` when the range is too small
/// for [`PAGES`] pages per vCPU of the cell.
///
/// ```
/// use vmhost_guest::ramcheck::placement;
/// assert_eq!(placement(0x4000_0000, 64 << 20, 1), Some((0x4000_1000, 1 << 20)));
/// assert_eq!(placement(0, 64 << 12, 1), None);
/// ```
pub fn placement(gpa: u64, len: u64, rank: u64) -> Option<(u64, u64)> {
    let stride = (len / PAGES) & !(PAGE - 1);
    let offset = rank.checked_mul(PAGE)?;
    if offset.checked_add(PAGE)? > stride {
        return None;
    }
    Some((gpa.checked_add(offset)?, stride))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn initial_stamps_are_the_latest_each_page_could_hold() {
        for t0 in [0u64, 5, 64, 1000] {
            for p in 0..PAGES {
                let s = initial_stamp(t0, p);
                assert_eq!(s & (PAGES - 1), p);
                assert!(t0.wrapping_sub(s) < PAGES);
                // The first tick rewrites the page it hits; the others still pass.
                let t = t0 + 1;
                if t % PAGES != p {
                    assert!(t.wrapping_sub(s) < PAGES, "t0 {t0} page {p}");
                }
            }
        }
    }

    #[test]
    fn zero_words_never_match() {
        assert!((1..WORDS).all(|j| word(0x1234_5678, 3, j) != 0));
        assert_eq!(initial_stamp(0, 0), 0);
    }
}
