//! Guest memory page runs: zero and untouched pages left out, runs split at the record cap,
//! bounds checked against the cell, and encode → decode the identity.
#![allow(clippy::cast_possible_truncation)] // small test sizes

use proptest::prelude::*;
use vmhost_persist::container::{Reader, RecordKind, Writer, MAX_PAYLOAD};
use vmhost_persist::pages::{
    decode_run, is_zero_page, max_run_pages, write_pages, CellGeometry, PageError, PageRun,
    PageStats,
};

const PS: usize = 4096;

/// Encodes `memory` (cell 0 from offset 0) skipping zero pages, decodes it into fresh zeroed
/// memory, and returns that memory and the stats.
fn round_trip(geometry: &CellGeometry, memory: &[u8]) -> (Vec<u8>, PageStats, u64) {
    let mut w = Writer::new(Vec::new(), "t").expect("header");
    let stats = write_pages(&mut w, geometry, 0, memory, |_, p| is_zero_page(p)).expect("pages");
    let bytes = w.finish().expect("end");
    let mut r = Reader::new(&bytes[..], &[RecordKind::PAGES]).expect("header");
    let mut back = vec![0u8; usize::try_from(geometry.size()).expect("small")];
    let mut records = 0;
    while let Some(rec) = r.next_record().expect("record") {
        let run = decode_run(&rec.payload, geometry).expect("run");
        let at = usize::try_from(run.offset).expect("small");
        back[at..at + run.bytes.len()].copy_from_slice(run.bytes);
        records += 1;
    }
    (back, stats, records)
}

#[test]
fn zero_pages_are_left_out_and_the_rest_comes_back() {
    let geometry = CellGeometry::new(0, PS as u32, 16 * PS as u64).expect("geometry");
    let mut memory = vec![0u8; 16 * PS];
    for page in [1usize, 2, 3, 7, 15] {
        memory[page * PS + 5] = page as u8;
    }
    let (back, stats, records) = round_trip(&geometry, &memory);
    assert_eq!(back, memory);
    assert_eq!((stats.pages, stats.skipped), (5, 11));
    // Runs: 1-3, 7, 15.
    assert_eq!((stats.records, records), (3, 3));
}

#[test]
fn the_callers_predicate_chooses_the_pages() {
    // A pre-copy round: only the dirty pages (2 and 5) are sent, zero or not.
    let geometry = CellGeometry::new(3, PS as u32, 8 * PS as u64).expect("geometry");
    let memory = vec![0x11u8; 4 * PS];
    let mut w = Writer::new(Vec::new(), "t").expect("header");
    let mut asked = Vec::new();
    let stats = write_pages(&mut w, &geometry, 2 * PS as u64, &memory, |off, _| {
        asked.push(off);
        off != 2 * PS as u64 && off != 5 * PS as u64
    })
    .expect("pages");
    let offsets: Vec<u64> = (2..6).map(|p| p * PS as u64).collect();
    assert_eq!(asked, offsets);
    assert_eq!((stats.pages, stats.records), (2, 2));
    let bytes = w.finish().expect("end");
    let mut r = Reader::new(&bytes[..], &[RecordKind::PAGES]).expect("header");
    let first = r.next_record().expect("r").expect("one");
    let run = decode_run(&first.payload, &geometry).expect("run");
    assert_eq!((run.offset, run.bytes.len()), (2 * PS as u64, PS));
}

#[test]
fn long_runs_are_split_at_the_record_cap() {
    let pages = max_run_pages(PS as u32) as usize * 2 + 3;
    let geometry = CellGeometry::new(0, PS as u32, (pages * PS) as u64).expect("geometry");
    let memory = vec![0x5au8; pages * PS];
    let (back, stats, records) = round_trip(&geometry, &memory);
    assert_eq!(back, memory);
    assert_eq!(records, 3);
    assert_eq!(stats.pages, pages as u64);
    assert!(max_run_pages(PS as u32) as usize * PS + 20 <= MAX_PAYLOAD as usize);
    // 2 MiB pages: a run still fits.
    let big = 2 * 1024 * 1024;
    assert!(max_run_pages(big) >= 1);
}

#[test]
fn a_run_outside_the_cell_is_refused() {
    let geometry = CellGeometry::new(1, PS as u32, 4 * PS as u64).expect("geometry");
    let page = vec![1u8; PS];
    let ok = PageRun {
        offset: 3 * PS as u64,
        bytes: &page,
    }
    .to_payload(&geometry)
    .expect("last page");
    assert!(decode_run(&ok, &geometry).is_ok());

    let mut past = ok.clone();
    past[8..16].copy_from_slice(&(4 * PS as u64).to_le_bytes());
    let err = decode_run(&past, &geometry).expect_err("past the end");
    assert!(
        matches!(err, PageError::OutOfBounds { cell: 1, .. }),
        "{err:?}"
    );

    let mut wraps = ok.clone();
    wraps[8..16].copy_from_slice(&(u64::MAX - 4095).to_le_bytes());
    assert!(matches!(
        decode_run(&wraps, &geometry),
        Err(PageError::OutOfBounds { .. })
    ));

    let mut unaligned = ok.clone();
    unaligned[8..16].copy_from_slice(&100u64.to_le_bytes());
    assert!(matches!(
        decode_run(&unaligned, &geometry),
        Err(PageError::OutOfBounds { .. })
    ));

    let other_cell = CellGeometry::new(2, PS as u32, 4 * PS as u64).expect("geometry");
    let err = decode_run(&ok, &other_cell).expect_err("another cell");
    assert!(
        matches!(
            err,
            PageError::Geometry {
                cell: 1,
                want_cell: 2,
                ..
            }
        ),
        "{err:?}"
    );

    let mut count_lies = ok.clone();
    count_lies[16..20].copy_from_slice(&2u32.to_le_bytes());
    assert!(matches!(
        decode_run(&count_lies, &geometry),
        Err(PageError::Malformed { .. })
    ));
    assert!(matches!(
        decode_run(&ok[..10], &geometry),
        Err(PageError::Malformed { .. })
    ));

    // The writer refuses memory that does not fit the cell or is not whole pages.
    let mut w = Writer::new(Vec::new(), "t").expect("header");
    let err = write_pages(
        &mut w,
        &geometry,
        2 * PS as u64,
        &vec![1u8; 3 * PS],
        |_, _| false,
    )
    .expect_err("past the cell");
    assert!(matches!(err, PageError::Range { .. }), "{err:?}");
    assert!(write_pages(&mut w, &geometry, 0, &[1u8; 100], |_, _| false).is_err());
}

#[test]
fn page_and_cell_sizes_are_checked() {
    for ps in [0, 512, 4095, 6144, 4 * 1024 * 1024] {
        let err = CellGeometry::new(0, ps, 1 << 30).expect_err("bad page size");
        assert!(err.to_string().contains(&ps.to_string()), "{err}");
    }
    assert!(CellGeometry::new(0, 4096, 0).is_err());
    assert!(CellGeometry::new(0, 2 << 20, 3 << 20).is_err());
    assert!(CellGeometry::new(0, 2 << 20, 1 << 30).is_ok());
}

#[test]
fn is_zero_page_sees_every_byte() {
    let mut page = vec![0u8; PS + 7];
    assert!(is_zero_page(&page));
    for at in 0..page.len() {
        for bit in [0x01, 0x80] {
            page[at] = bit;
            assert!(!is_zero_page(&page), "byte {at}, bit {bit:#x}");
            page[at] = 0;
        }
    }
    assert!(is_zero_page(&page));
    assert!(is_zero_page(&[]));
}

proptest! {
    #[test]
    fn any_memory_round_trips(
        contents in proptest::collection::vec(
            prop_oneof![Just(0u8), any::<u8>()], 1..24,
        ),
        mark in any::<u64>(),
    ) {
        // Page i is zero when contents[i] is 0, else filled around a marker.
        let pages = contents.len();
        let geometry = CellGeometry::new(0, PS as u32, (pages * PS) as u64).expect("geometry");
        let mut memory = vec![0u8; pages * PS];
        for (i, &b) in contents.iter().enumerate() {
            if b != 0 {
                memory[i * PS..(i + 1) * PS].fill(b);
                memory[i * PS..i * PS + 8].copy_from_slice(&mark.to_le_bytes());
            }
        }
        let (back, stats, _) = round_trip(&geometry, &memory);
        prop_assert_eq!(&back, &memory);
        let nonzero = contents.iter().filter(|&&b| b != 0).count() as u64;
        prop_assert_eq!(stats.pages, nonzero);
    }

    #[test]
    fn any_run_payload_round_trips(page in 0u64..64, count in 1usize..4, fill in any::<u8>()) {
        let geometry = CellGeometry::new(9, PS as u32, 80 * PS as u64).expect("geometry");
        let bytes = vec![fill; count * PS];
        let run = PageRun { offset: page * PS as u64, bytes: &bytes };
        let payload = run.to_payload(&geometry).expect("encode");
        let back = decode_run(&payload, &geometry).expect("decode");
        prop_assert_eq!(back, run);
        prop_assert_eq!(back.to_payload(&geometry).expect("again"), payload);
    }
}
