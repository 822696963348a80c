//! The snapshot and migration container reader and the page-run decoder on arbitrary bytes.
//! Invariants: never a panic; a run that decodes lies inside the cell, on page boundaries;
//! a container of this format or the one before it is read; one of this format that reads
//! whole (header, records, end record, nothing after) is written again byte for byte by the
//! writer, and a run that decodes encodes to the same payload; a container read in parts (a
//! restore's loader, `Reader::next_parts`) reads the same records, or fails, as one read whole.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vmhost_persist::container::{Reader, RecordKind, Writer, FORMAT_VERSION};
use std::io::Read;
use vmhost_persist::pages::{decode_run, CellGeometry};

const KNOWN: &[RecordKind] = &[RecordKind::SPEC, RecordKind::PLAN, RecordKind::PAGES];

/// The cells every page run is decoded against: small, 4 KiB and 2 MiB pages.
fn geometries() -> [CellGeometry; 3] {
    [
        CellGeometry::new(0, 4096, 16 * 4096).expect("geometry"),
        CellGeometry::new(1, 4096, 1 << 30).expect("geometry"),
        CellGeometry::new(0, 2 << 20, 8 << 20).expect("geometry"),
    ]
}

fn check_run(payload: &[u8]) {
    for g in geometries() {
        if let Ok(run) = decode_run(payload, &g) {
            let end = run.offset + run.bytes.len() as u64;
            assert!(end <= g.size(), "run ends at {end}, cell is {}", g.size());
            assert_eq!(run.offset % u64::from(g.page_size()), 0);
            assert_eq!(run.bytes.len() % g.page_size() as usize, 0);
            assert!(!run.bytes.is_empty());
            let again = run.to_payload(&g).expect("a decoded run encodes");
            assert_eq!(again, payload, "the run does not re-encode to its payload");
        }
    }
}

/// Every record of a container (kind, whether mandatory, payload) read whole, or `None` when
/// it does not read to its end with nothing after it.
fn read_whole(data: &[u8]) -> Option<Vec<(RecordKind, bool, Vec<u8>)>> {
    let mut reader = Reader::new(data, KNOWN).ok()?;
    let mut out = Vec::new();
    while let Some(rec) = reader.next_record().ok()? {
        out.push((rec.kind, rec.mandatory, rec.payload));
    }
    reader.expect_eof().ok()?;
    Some(out)
}

/// The same, read in parts as a restore's loader reads a memory file: the first 20 bytes
/// summed as read, the rest read past the checksum in pieces of 1000 and handed back.
fn read_in_parts(data: &[u8]) -> Option<Vec<(RecordKind, bool, Vec<u8>)>> {
    let mut reader = Reader::new(data, KNOWN).ok()?;
    let mut out = Vec::new();
    while let Some(mut rec) = reader.next_parts().ok()? {
        let mut payload = vec![0u8; rec.len() as usize];
        let (head, rest) = payload.split_at_mut(rest_at(rec.len()));
        rec.read_exact(head).ok()?;
        for piece in rest.chunks_mut(1000) {
            rec.read_unsummed(piece.len(), |input| input.read_exact(piece))
                .ok()?;
            rec.sum(piece).ok()?;
        }
        let (kind, mandatory) = (rec.kind(), rec.mandatory());
        rec.finish().ok()?;
        out.push((kind, mandatory, payload));
    }
    reader.expect_eof().ok()?;
    Some(out)
}

fn rest_at(len: u32) -> usize {
    (len as usize).min(20)
}

fuzz_target!(|data: &[u8]| {
    check_run(data);
    assert_eq!(
        read_whole(data),
        read_in_parts(data),
        "read in parts, the container reads otherwise than whole"
    );
    let Ok(mut reader) = Reader::new(data, KNOWN) else {
        return;
    };
    let header = reader.header().clone();
    // This format and the one before it are read.
    assert!(header.version == FORMAT_VERSION || header.version + 1 == FORMAT_VERSION);
    let mut records = Vec::new();
    loop {
        match reader.next_record() {
            Ok(Some(rec)) => {
                assert!(
                    rec.payload.len() as u64 <= u64::from(vmhost_persist::container::MAX_PAYLOAD)
                );
                if rec.kind == RecordKind::PAGES {
                    check_run(&rec.payload);
                }
                records.push(rec);
            }
            Ok(None) => break,
            Err(_) => return,
        }
    }
    // The writer writes this format only: an older container is not written again.
    if reader.expect_eof().is_err() || header.version != FORMAT_VERSION {
        return;
    }
    let mut w = Writer::new(Vec::new(), &header.vmhost_version).expect("header re-encodes");
    for rec in &records {
        if rec.mandatory {
            w.write_record(rec.kind, &rec.payload)
                .expect("record re-encodes");
        } else {
            w.write_optional(rec.kind, &rec.payload)
                .expect("record re-encodes");
        }
    }
    let bytes = w.finish().expect("end re-encodes");
    assert_eq!(bytes, data, "the container does not re-encode to its bytes");
});
