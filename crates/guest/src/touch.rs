//! `touch`: every vCPU writes every byte of every page of its own guest cell.
//!
//! When a cell has several vCPUs, each of them writes the whole cell (the pages are not split
//! between them), so per-vCPU bytes equal the cell's size and concurrent vCPUs of one cell share
//! its bandwidth; whichever vCPU writes a page first pays its first-touch fault. Every 8-byte
//! word of a 4 KiB page at GPA `p` gets [`pattern`]`(p)`, so the host can check afterwards that
//! the guest wrote every page. The loop runs in ring 3 (`rep stosq`) and is timed with `rdtsc`.

/// High bits of the touch pattern ("touch" in ASCII).
pub const TOUCH_TAG: u64 = 0x0068_6375_6f74_0000 << 8;
/// Granularity of the pattern.
pub const TOUCH_PAGE: u64 = 4096;

/// The word the guest writes throughout the 4 KiB page at `page_gpa`.
///
/// ```
/// use vmhost_guest::touch::{pattern, TOUCH_TAG};
/// assert_eq!(pattern(0x1000) ^ TOUCH_TAG, 0x1000);
/// ```
pub fn pattern(page_gpa: u64) -> u64 {
    page_gpa ^ TOUCH_TAG
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_differs_per_page_and_spells_touch() {
        assert_ne!(pattern(0), pattern(TOUCH_PAGE));
        assert_eq!(&TOUCH_TAG.to_le_bytes()[3..8], b"touch");
    }
}
