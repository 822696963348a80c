//! The record container: round trips, and every kind of bad input refused with a typed error
//! that names what is wrong and where.
#![allow(clippy::cast_possible_truncation)] // small test sizes

use proptest::prelude::*;
use vmhost_persist::container::{
    crc64, record_checksum, ContainerError, Reader, RecordKind, Writer, FORMAT_VERSION, MAGIC,
    MAX_PAYLOAD,
};

const KNOWN: &[RecordKind] = &[RecordKind::SPEC, RecordKind::PLAN, RecordKind::PAGES];

fn sample() -> Vec<u8> {
    let mut w = Writer::new(Vec::new(), "0.1.0-test").expect("header");
    w.write_record(RecordKind::SPEC, b"name: web-1\n")
        .expect("spec");
    w.write_optional(RecordKind(40), b"a later vmhost's extra")
        .expect("optional");
    w.write_record(RecordKind::PLAN, &[7u8; 1000])
        .expect("plan");
    w.finish().expect("end")
}

/// Reads every record of `bytes` as a file (trailing bytes refused).
fn read_all(
    bytes: &[u8],
    known: &[RecordKind],
) -> Result<Vec<(u16, bool, Vec<u8>)>, ContainerError> {
    let mut r = Reader::new(bytes, known)?;
    let mut out = Vec::new();
    while let Some(rec) = r.next_record()? {
        out.push((rec.kind.0, rec.mandatory, rec.payload));
    }
    r.expect_eof()?;
    Ok(out)
}

/// A header with any version, its checksum right.
fn header(version: u32, text: &str) -> Vec<u8> {
    let mut h = MAGIC.to_vec();
    h.extend_from_slice(&version.to_le_bytes());
    h.extend_from_slice(&u16::try_from(text.len()).expect("short").to_le_bytes());
    h.extend_from_slice(text.as_bytes());
    let sum = crc64(&h);
    h.extend_from_slice(&sum.to_le_bytes());
    h
}

/// A record of a container of format `version` with its checksum right.
fn record(version: u32, kind: u16, flags: u16, payload: &[u8]) -> Vec<u8> {
    let mut r = kind.to_le_bytes().to_vec();
    r.extend_from_slice(&flags.to_le_bytes());
    r.extend_from_slice(&u32::try_from(payload.len()).expect("short").to_le_bytes());
    let sum = record_checksum(version, &r, payload);
    r.extend_from_slice(payload);
    r.extend_from_slice(&sum.to_le_bytes());
    r
}

#[test]
fn records_round_trip_with_header_and_end() {
    let bytes = sample();
    let r = Reader::new(&bytes[..], KNOWN).expect("header");
    assert_eq!(r.header().version, FORMAT_VERSION);
    assert_eq!(r.header().vmhost_version, "0.1.0-test");
    let recs = read_all(&bytes, KNOWN).expect("reads");
    assert_eq!(
        recs,
        vec![
            (2, true, b"name: web-1\n".to_vec()),
            (40, false, b"a later vmhost's extra".to_vec()),
            (3, true, vec![7u8; 1000]),
        ]
    );
    // The bytes as documented: the header, then the first record at offset 8+4+2+10+8 = 32.
    assert_eq!(&bytes[..8], b"VMHOSTPF");
    assert_eq!(&bytes[32..40], &[2, 0, 1, 0, 12, 0, 0, 0]);
}

#[test]
fn every_truncation_is_a_truncated_error_at_the_cut() {
    let bytes = sample();
    for cut in 0..bytes.len() {
        match read_all(&bytes[..cut], KNOWN) {
            Err(ContainerError::Truncated { offset, what }) => {
                assert_eq!(offset, cut as u64, "cut at {cut}: {what}");
                assert!(!what.is_empty());
            }
            other => panic!("cut at {cut}: {other:?}"),
        }
    }
}

#[test]
fn every_flipped_bit_is_refused() {
    let bytes = sample();
    for at in 0..bytes.len() {
        for bit in 0..8 {
            let mut bad = bytes.clone();
            bad[at] ^= 1 << bit;
            let err = read_all(&bad, KNOWN).expect_err(&format!("byte {at} bit {bit}"));
            // Any typed error; the message names a place or a value.
            assert!(!err.to_string().is_empty());
        }
    }
}

#[test]
fn a_flipped_payload_bit_names_the_record_and_its_offset() {
    let mut bytes = sample();
    bytes[45] ^= 0x10; // inside the spec record's payload (record at 32, payload from 40)
    match read_all(&bytes, KNOWN) {
        Err(
            e @ ContainerError::RecordChecksum {
                offset: 32, kind, ..
            },
        ) => {
            assert_eq!(kind, RecordKind::SPEC);
            let text = e.to_string();
            assert!(
                text.contains("spec (kind 2)") && text.contains("offset 32"),
                "{text}"
            );
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn wrong_magic_is_refused() {
    let mut bytes = sample();
    bytes[..8].copy_from_slice(b"QEVM\0\0\0\x03");
    let err = read_all(&bytes, KNOWN).expect_err("foreign file");
    assert!(matches!(err, ContainerError::BadMagic { .. }), "{err:?}");
    assert!(err.to_string().contains("not a vmhost snapshot"), "{err}");
}

/// Versions before the one before this format are refused naming the oldest readable one:
/// version 0 (which never existed) and, from format 3, version 1.
#[test]
fn versions_older_than_the_oldest_readable_are_refused() {
    let oldest = FORMAT_VERSION - 1;
    for version in 0..oldest {
        let mut bytes = header(version, "0.0.1");
        bytes.extend(record(version, 0, 1, &0u64.to_le_bytes()));
        let err = read_all(&bytes, KNOWN).expect_err("too old");
        assert!(
            matches!(err, ContainerError::VersionTooOld { found, oldest: o } if found == version && o == oldest),
            "{err:?}"
        );
        let text = err.to_string();
        assert!(
            text.contains(&format!("format version {version}"))
                && text.contains(&format!("({oldest})")),
            "{text}"
        );
    }
    // The one before this format reads.
    let mut bytes = header(oldest, "0.0.1");
    bytes.extend(record(oldest, 0, 1, &0u64.to_le_bytes()));
    read_all(&bytes, KNOWN).expect("the previous format");
}

#[test]
fn a_newer_version_is_refused_naming_both_versions() {
    let newer = FORMAT_VERSION + 1;
    let mut bytes = header(newer, "9.9.9");
    bytes.extend(record(newer, 0, 1, &0u64.to_le_bytes()));
    let err = read_all(&bytes, KNOWN).expect_err("newer");
    assert!(
        matches!(err, ContainerError::VersionTooNew { found, newest } if found == newer && newest == FORMAT_VERSION),
        "{err:?}"
    );
    let text = err.to_string();
    assert!(
        text.contains(&format!("format version {newer}"))
            && text.contains(&format!("format version {FORMAT_VERSION}")),
        "{text}"
    );
}

#[test]
fn a_hostile_length_is_refused_before_allocating() {
    // A record claiming 4 GiB - 1 in a 40-byte input: refused on its length, not by failing to
    // read (or allocate) that much.
    let mut bytes = header(FORMAT_VERSION, "x");
    let at = bytes.len() as u64;
    bytes.extend_from_slice(&RecordKind::PAGES.0.to_le_bytes());
    bytes.extend_from_slice(&1u16.to_le_bytes());
    bytes.extend_from_slice(&u32::MAX.to_le_bytes());
    let err = read_all(&bytes, KNOWN).expect_err("oversized");
    assert!(
        matches!(err, ContainerError::Oversized { offset, kind: RecordKind::PAGES, len } if offset == at && len == u64::from(u32::MAX)),
        "{err:?}"
    );
    // One byte over the cap is refused, the cap itself is not.
    let mut bytes = header(FORMAT_VERSION, "x");
    bytes.extend_from_slice(&[4, 0, 1, 0]);
    bytes.extend_from_slice(&(MAX_PAYLOAD + 1).to_le_bytes());
    assert!(matches!(
        read_all(&bytes, KNOWN),
        Err(ContainerError::Oversized { .. })
    ));
    let mut w = Writer::new(Vec::new(), "x").expect("header");
    w.write_record(RecordKind::PAGES, &vec![0u8; MAX_PAYLOAD as usize])
        .expect("at the cap");
    assert!(matches!(
        w.write_record(RecordKind::PAGES, &vec![0u8; MAX_PAYLOAD as usize + 1]),
        Err(ContainerError::PayloadTooLarge { .. })
    ));
    let bytes = w.finish().expect("end");
    assert_eq!(read_all(&bytes, KNOWN).expect("reads").len(), 1);
}

#[test]
fn an_unknown_mandatory_record_is_refused_with_kind_and_offset() {
    let mut w = Writer::new(Vec::new(), "x").expect("header");
    w.write_record(RecordKind::SPEC, b"s").expect("spec");
    let at = w.offset();
    w.write_record(RecordKind(77), b"new").expect("new kind");
    let bytes = w.finish().expect("end");
    let err = read_all(&bytes, KNOWN).expect_err("unknown mandatory");
    assert!(
        matches!(err, ContainerError::UnknownMandatory { offset, kind: RecordKind(77) } if offset == at),
        "{err:?}"
    );
    assert!(err.to_string().contains("kind 77"), "{err}");
}

#[test]
fn unknown_flags_a_wrong_end_count_and_trailing_bytes_are_refused() {
    let mut bytes = header(FORMAT_VERSION, "x");
    bytes.extend(record(FORMAT_VERSION, 2, 0x8001, b"s"));
    assert!(matches!(
        read_all(&bytes, KNOWN),
        Err(ContainerError::BadFlags { flags: 0x8001, .. })
    ));

    // A record dropped cleanly between others: the end record's count differs.
    let mut bytes = header(FORMAT_VERSION, "x");
    bytes.extend(record(FORMAT_VERSION, 2, 1, b"s"));
    bytes.extend(record(FORMAT_VERSION, 0, 1, &2u64.to_le_bytes()));
    let err = read_all(&bytes, KNOWN).expect_err("count");
    assert!(
        matches!(
            err,
            ContainerError::BadEnd {
                claimed: Some(2),
                read: 1,
                ..
            }
        ),
        "{err:?}"
    );

    let mut bytes = sample();
    bytes.extend_from_slice(b"junk");
    assert!(matches!(
        read_all(&bytes, KNOWN),
        Err(ContainerError::TrailingData { extra: 4, .. })
    ));
}

proptest! {
    #[test]
    fn any_records_round_trip(
        version in "[0-9a-z.+-]{0,64}",
        records in proptest::collection::vec(
            (1u16..200, any::<bool>(), proptest::collection::vec(any::<u8>(), 0..300)),
            0..12,
        ),
    ) {
        let mut w = Writer::new(Vec::new(), &version).expect("header");
        for (kind, mandatory, payload) in &records {
            if *mandatory {
                w.write_record(RecordKind(*kind), payload).expect("record");
            } else {
                w.write_optional(RecordKind(*kind), payload).expect("record");
            }
        }
        let bytes = w.finish().expect("end");
        let known: Vec<RecordKind> = (1u16..200).map(RecordKind).collect();
        let mut r = Reader::new(&bytes[..], &known).expect("header");
        prop_assert_eq!(&r.header().vmhost_version, &version);
        let mut back = Vec::new();
        while let Some(rec) = r.next_record().expect("record") {
            back.push((rec.kind.0, rec.mandatory, rec.payload));
        }
        r.expect_eof().expect("nothing after the end");
        prop_assert_eq!(back, records);
    }
}
