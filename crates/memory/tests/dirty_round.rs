//! A pre-copy round end to end without KVM: a cell's pages marked dirty in a `DirtyBitmap`
//! are written with `vmhost_persist::pages::write_pages` (its `is_clean` as the skip
//! predicate), at the 4 KiB and 2 MiB stream page sizes, and applying the records to a stale
//! copy of the cell makes it equal to the source again.

use vmhost_memory::{DirtyBitmap, DIRTY_PAGE_BYTES};
use vmhost_persist::container::{Reader, RecordKind, Writer};
use vmhost_persist::pages::{decode_run, write_pages, CellGeometry};

const CELL: u64 = 8 << 20;

/// Sends the pages of `source` that `dirty` marks as one round at `page_size`, applies the
/// round to `target`, and returns the bytes sent.
fn round(source: &[u8], target: &mut [u8], dirty: &DirtyBitmap, page_size: u32) -> u64 {
    let geometry = CellGeometry::new(dirty.cell(), page_size, CELL).expect("geometry");
    let mut w = Writer::new(Vec::new(), "test").expect("header");
    let stats = write_pages(&mut w, &geometry, 0, source, |off, page| {
        dirty.is_clean(off, page)
    })
    .expect("pages");
    let bytes = w.finish().expect("end");
    let mut r = Reader::new(&bytes[..], &[RecordKind::PAGES]).expect("header");
    while let Some(rec) = r.next_record().expect("record") {
        let run = decode_run(&rec.payload, &geometry).expect("run");
        let at = usize::try_from(run.offset).expect("small");
        target[at..at + run.bytes.len()].copy_from_slice(run.bytes);
    }
    stats.pages * u64::from(page_size)
}

#[test]
fn a_round_of_the_dirty_pages_brings_a_stale_copy_up_to_date() {
    let mut source: Vec<u8> = (0..CELL).map(|i| (i % 251) as u8).collect();
    for page_size in [4096u32, 2 << 20] {
        let mut target = source.clone();
        let mut dirty = DirtyBitmap::new(2, CELL);
        // The guest writes three places after the copy was taken.
        for (at, v) in [(5u64 * 4096 + 7, 1u8), (3 << 20, 2), (CELL - 1, 3)] {
            let i = usize::try_from(at).expect("small");
            source[i] = source[i].wrapping_add(v);
            dirty.mark_range(at, 1);
        }
        assert_ne!(source, target);
        let sent = round(&source, &mut target, &dirty, page_size);
        assert_eq!(source, target, "page size {page_size}");
        let expected = if page_size == 4096 {
            3 * DIRTY_PAGE_BYTES
        } else {
            3 * (2 << 20)
        };
        assert_eq!(
            sent, expected,
            "only the dirty pages, page size {page_size}"
        );
        assert_eq!(dirty.dirty_bytes(), 3 * DIRTY_PAGE_BYTES);
    }
}
