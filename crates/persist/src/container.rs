//! The record container shared by snapshot files and the migration stream.
//!
//! A container is a header, then records, then an end record; all integers are little-endian:
//!
//! ```text
//! header   magic "VMHOSTPF" (8) | format version u32 | version string length u16 (<= 64)
//!          | vmhost version (UTF-8) | CRC-64/XZ of the bytes before it (u64)
//! record   kind u16 | flags u16 | payload length u32 (<= MAX_PAYLOAD) | payload
//!          | checksum of kind..payload (u64): XXH64 (seed 0) from version 5, CRC-64/XZ
//!          before; 0 on an authenticated stream from version 2
//! end      a record of kind END whose 8-byte payload is the number of records before it
//! ```
//!
//! Flag bit 0 marks a record **mandatory**: a reader that does not know its kind refuses the
//! container. A reader yields unknown optional records to its caller, which skips them. The
//! other flag bits must be zero.
//!
//! On an authenticated stream ([`crate::auth`]) the header and every record (the end record
//! too) are followed by a tag bound to a sequence number (0 for the header, then 1, 2, …) and
//! the exact bytes of the header or record; see [`RecordMac`]. From version 3 it is a 16-byte
//! Poly1305 tag with a one-time ChaCha20-derived key per record (from version 4 a record's
//! kind and flags are bound through that key's nonce and its payload is tagged where it lies);
//! before, a 32-byte HMAC-SHA256 tag. From version 2 an authenticated stream's records carry
//! no CRC-64 (the field is 0, and from version 4 a reader refuses anything else): the MAC
//! already covers every byte, and the CRC was most of the sender's time in an emulated host
//! without SHA extensions. Snapshot files (not authenticated) keep a checksum per record: from
//! version 5 XXH64, which the emulated host computes about nine times as fast as the CRC's
//! table lookups (2.7 GB/s against 0.31), and natively six times; the CRC-64 was most of a
//! restore's load. Version 5 streams are version 4's.
//!
//! A reader accepts its own format version and the one before it ([`FORMAT_VERSION`]).
//! Version 1 is the first: there is no version 0, and a header that says 0 is refused as
//! older than the oldest version this reader reads.
//!
//! [`RecordMac`]: crate::auth::RecordMac

use std::io;

use crc::{Crc, Table, CRC_64_XZ};

mod parts;
mod reader;
mod writer;
pub use parts::RecordParts;
pub use reader::Reader;
pub use writer::{WriteTiming, Writer};

/// The first eight bytes of every container.
pub const MAGIC: [u8; 8] = *b"VMHOSTPF";
/// The format version this crate writes (5: XXH64 record checksums in files; 4: record tags
/// that bind the head through the nonce; 3: Poly1305 record tags on authenticated streams; 2:
/// no record CRC on them).
pub const FORMAT_VERSION: u32 = 5;
/// The first format version whose records' checksum is XXH64 instead of CRC-64/XZ.
const XXH64_FROM: u32 = 5;
/// The largest record payload a reader accepts (8 MiB + 4 KiB): a reader never allocates more
/// than this for one record, whatever length a hostile input claims.
pub const MAX_PAYLOAD: u32 = 8 * 1024 * 1024 + 4096;
/// The longest vmhost version string a header carries.
pub const MAX_VERSION_STRING: usize = 64;

const FLAG_MANDATORY: u16 = 1;
const RECORD_HEADER: usize = 8;
/// Slicing-by-16 (a 32 KiB table): the same checksums as the crate's default one-table form,
/// several times faster per byte; every record of a migration stream and of a snapshot file
/// goes through it.
static CRC: Crc<u64, Table<16>> = Crc::<u64, Table<16>>::new(&CRC_64_XZ);

/// The CRC-64/XZ (ECMA-182, reflected; as `xz`) of `bytes`: the header's checksum, and a
/// record's before format 5.
pub fn crc64(bytes: &[u8]) -> u64 {
    CRC.checksum(bytes)
}

/// The checksum of a record of format `version` whose bytes from its kind to the end of its
/// payload are `head` then `payload` (an unauthenticated record's; see the module docs).
pub fn record_checksum(version: u32, head: &[u8], payload: &[u8]) -> u64 {
    let mut sum = Sum::new(version, head);
    sum.update(payload);
    sum.finish()
}

/// The record checksum of a format version, computed as the bytes arrive.
enum Sum {
    Xxh64(Box<xxhash_rust::xxh64::Xxh64>),
    Crc(crc::Digest<'static, u64, Table<16>>),
}

impl Sum {
    fn new(version: u32, head: &[u8]) -> Self {
        let mut sum = if version >= XXH64_FROM {
            Sum::Xxh64(Box::new(xxhash_rust::xxh64::Xxh64::new(0)))
        } else {
            Sum::Crc(CRC.digest())
        };
        sum.update(head);
        sum
    }

    fn update(&mut self, bytes: &[u8]) {
        match self {
            Sum::Xxh64(h) => h.update(bytes),
            Sum::Crc(d) => d.update(bytes),
        }
    }

    fn finish(self) -> u64 {
        match self {
            Sum::Xxh64(h) => h.digest(),
            Sum::Crc(d) => d.finalize(),
        }
    }
}

/// The name of the record checksum of format `version`, for messages.
fn record_checksum_name(version: u32) -> &'static str {
    if version >= XXH64_FROM {
        "XXH64"
    } else {
        "CRC-64"
    }
}

/// A record's kind. Kinds below 16 belong to this crate; the VMM's state records take kinds
/// from 16 on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RecordKind(pub u16);

impl RecordKind {
    /// The end record.
    pub const END: RecordKind = RecordKind(0);
    /// The snapshot manifest with SHA-256 digests (first record of the `state` file of a
    /// snapshot written before [`RecordKind::MANIFEST_XXH3`]; still read, [`crate::dir`]).
    pub const MANIFEST: RecordKind = RecordKind(1);
    /// The snapshot manifest with XXH3-128 digests: the first record of a snapshot's `state`
    /// file as written now ([`crate::dir`]).
    pub const MANIFEST_XXH3: RecordKind = RecordKind(5);
    /// The VM spec, as the user wrote it (UTF-8 text).
    pub const SPEC: RecordKind = RecordKind(2);
    /// The resolved plan the VM ran under (JSON).
    pub const PLAN: RecordKind = RecordKind(3);
    /// A run of guest memory pages ([`crate::pages`]).
    pub const PAGES: RecordKind = RecordKind(4);
    /// The VM's state without its memory: the JSON of the vCPU crate's `SavedVm` (every vCPU,
    /// the VM's irqchip/PIT/clock, a built-in payload's boot area, the devices). The first of
    /// the VMM's kinds; 18 and up are reserved for later state records.
    pub const VM_STATE: RecordKind = RecordKind(16);
    /// Live migration, source → target: the [`crate::migration::Hello`] (JSON), first record of
    /// the control stream.
    pub const MIG_HELLO: RecordKind = RecordKind(32);
    /// Live migration, target → source: the [`crate::migration::Answer`] (JSON).
    pub const MIG_ANSWER: RecordKind = RecordKind(33);
    /// Live migration, source → target: a pre-copy round of one cell begins
    /// ([`crate::migration::Round`], JSON); its page runs follow as [`RecordKind::PAGES`].
    pub const MIG_ROUND: RecordKind = RecordKind(34);
    /// Live migration, source → target: the round of [`RecordKind::MIG_ROUND`] ended
    /// ([`crate::migration::RoundEnd`], JSON).
    pub const MIG_ROUND_END: RecordKind = RecordKind(35);
    /// Live migration, target → source: the [`crate::migration::Commit`] (JSON): the target
    /// loaded the state and resumes the guest. The commit point.
    pub const MIG_COMMIT: RecordKind = RecordKind(36);
    /// Live migration, either way: the sender gives up ([`crate::migration::Cancel`], JSON).
    pub const MIG_CANCEL: RecordKind = RecordKind(37);
    /// Live migration, source → target: the first record of a cell's page stream
    /// ([`crate::migration::CellStream`], JSON).
    pub const MIG_CELL: RecordKind = RecordKind(38);
    /// What the guest has seen of its topology and where its cells were on the source host:
    /// the JSON of the binary's `vmstate::GuestRecord` (the plan crate's `GuestIdentity` and
    /// each cell's source node). A restore plans for this guest, not afresh.
    pub const GUEST_IDENTITY: RecordKind = RecordKind(17);
}

impl std::fmt::Display for RecordKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match *self {
            RecordKind::END => "end",
            RecordKind::MANIFEST => "manifest (SHA-256)",
            RecordKind::MANIFEST_XXH3 => "manifest",
            RecordKind::SPEC => "spec",
            RecordKind::PLAN => "plan",
            RecordKind::PAGES => "pages",
            RecordKind::VM_STATE => "vm state",
            RecordKind::MIG_HELLO => "migration hello",
            RecordKind::MIG_ANSWER => "migration answer",
            RecordKind::MIG_ROUND => "migration round",
            RecordKind::MIG_ROUND_END => "migration round end",
            RecordKind::MIG_COMMIT => "migration commit",
            RecordKind::MIG_CANCEL => "migration cancel",
            RecordKind::MIG_CELL => "migration cell stream",
            RecordKind::GUEST_IDENTITY => "guest identity",
            _ => return write!(f, "kind {}", self.0),
        };
        write!(f, "{name} (kind {})", self.0)
    }
}

/// A container's header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// The format version it was written in.
    pub version: u32,
    /// The version of the vmhost that wrote it.
    pub vmhost_version: String,
}

/// One record as read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// Its kind.
    pub kind: RecordKind,
    /// Whether a reader that does not know `kind` must refuse the container.
    pub mandatory: bool,
    /// Its payload.
    pub payload: Vec<u8>,
    /// The offset of its first byte in the container.
    pub offset: u64,
}

/// Why a container could not be written or read. Offsets count from the container's first byte.
#[derive(Debug, thiserror::Error)]
pub enum ContainerError {
    /// Reading failed.
    #[error("cannot read the container at offset {offset}")]
    Read {
        /// Where.
        offset: u64,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// Writing failed.
    #[error("cannot write the container at offset {offset}")]
    Write {
        /// Where.
        offset: u64,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The input ended inside the header or a record, or before the end record.
    #[error("the container is truncated at offset {offset}: it ends inside {what}")]
    Truncated {
        /// Where the input ended.
        offset: u64,
        /// What was being read (`the header`, `a pages (kind 4) record`, `the record stream
        /// before the end record`).
        what: String,
    },
    /// The first eight bytes are not [`MAGIC`].
    #[error("not a vmhost snapshot or migration stream: the magic is {found:02x?}, not {MAGIC:02x?} (\"VMHOSTPF\")")]
    BadMagic {
        /// The bytes found.
        found: [u8; 8],
    },
    /// The format version is older than the oldest this reader accepts.
    #[error("format version {found} is older than the oldest this vmhost reads ({oldest}); read it with the vmhost that wrote it, or an older vmhost that reads both")]
    VersionTooOld {
        /// The header's version.
        found: u32,
        /// The oldest version this reader accepts.
        oldest: u32,
    },
    /// The format version is newer than this reader's.
    #[error("format version {found} is newer than this vmhost's format version {newest}; upgrade vmhost on this side")]
    VersionTooNew {
        /// The header's version.
        found: u32,
        /// This reader's version.
        newest: u32,
    },
    /// The header's vmhost version string is too long or not UTF-8.
    #[error("the header's vmhost version string (length {len}) is not UTF-8 of at most {MAX_VERSION_STRING} bytes")]
    BadVersionString {
        /// Its length.
        len: usize,
    },
    /// The header's checksum does not match.
    #[error(
        "the container header is corrupted: CRC-64 {found:#018x} stored, {computed:#018x} computed"
    )]
    HeaderChecksum {
        /// The stored checksum.
        found: u64,
        /// The checksum of the bytes read.
        computed: u64,
    },
    /// A record's checksum does not match.
    #[error("the {kind} record at offset {offset} is corrupted: {algorithm} {found:#018x} stored, {computed:#018x} computed")]
    RecordChecksum {
        /// Where the record starts.
        offset: u64,
        /// Its kind.
        kind: RecordKind,
        /// The checksum's algorithm (`XXH64`, or `CRC-64` before format 5).
        algorithm: &'static str,
        /// The stored checksum.
        found: u64,
        /// The checksum of the bytes read.
        computed: u64,
    },
    /// A record is longer than [`MAX_PAYLOAD`].
    #[error("the {kind} record at offset {offset} claims {len} bytes of payload; the limit is {MAX_PAYLOAD}")]
    Oversized {
        /// Where the record starts.
        offset: u64,
        /// Its kind.
        kind: RecordKind,
        /// The claimed payload length.
        len: u64,
    },
    /// A record's flags have bits this version does not define.
    #[error("the {kind} record at offset {offset} has unknown flags {flags:#06x}")]
    BadFlags {
        /// Where the record starts.
        offset: u64,
        /// Its kind.
        kind: RecordKind,
        /// The flags.
        flags: u16,
    },
    /// A mandatory record of a kind the reader does not know.
    #[error("the mandatory {kind} record at offset {offset} is unknown to this vmhost; read it with a vmhost that knows it")]
    UnknownMandatory {
        /// Where the record starts.
        offset: u64,
        /// Its kind.
        kind: RecordKind,
    },
    /// The end record is malformed or counts a different number of records.
    #[error("the end record at offset {offset} is wrong: it counts {claimed:?} records, {read} were read (records were dropped or added)")]
    BadEnd {
        /// Where the end record starts.
        offset: u64,
        /// The count it holds (`None`: its payload is not 8 bytes).
        claimed: Option<u64>,
        /// The records read before it.
        read: u64,
    },
    /// Bytes follow the end record of a file.
    #[error("{extra} unexpected bytes follow the end record at offset {offset}")]
    TrailingData {
        /// Where they start.
        offset: u64,
        /// How many (at least).
        extra: usize,
    },
    /// A record's MAC does not match: it was altered, replayed, reordered or injected.
    #[error("the {what} at offset {offset} (sequence number {seq}) fails authentication: it was altered, replayed, reordered or injected, or a record before it was dropped")]
    Authentication {
        /// Where it starts.
        offset: u64,
        /// `the header` or the record's kind.
        what: String,
        /// The sequence number expected.
        seq: u64,
    },
    /// A record handed to the writer is too long.
    #[error("a {kind} record of {len} bytes is longer than the limit {MAX_PAYLOAD}")]
    PayloadTooLarge {
        /// Its kind.
        kind: RecordKind,
        /// Its length.
        len: usize,
    },
    /// The writer was asked to write an end record, or a version string that does not fit.
    #[error("invalid argument for the container writer: {0}")]
    Usage(&'static str),
}

/// The versions a reader of format `newest` accepts: `newest` and the one before it; there is
/// no version 0.
fn accepted_versions(newest: u32) -> std::ops::RangeInclusive<u32> {
    newest.saturating_sub(1).max(1)..=newest
}

/// Checks a header's version against a reader of format `newest`.
fn check_version(found: u32, newest: u32) -> Result<(), ContainerError> {
    let accepted = accepted_versions(newest);
    if found < *accepted.start() {
        return Err(ContainerError::VersionTooOld {
            found,
            oldest: *accepted.start(),
        });
    }
    if found > newest {
        return Err(ContainerError::VersionTooNew { found, newest });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::{handshake, AuthKey, Role, Session};

    /// Both ends' sessions of one handshake over a socket pair.
    fn sessions() -> (Session, Session) {
        let key = || AuthKey::from_bytes(&[3u8; 48]).unwrap();
        let (mut a, mut b) = std::os::unix::net::UnixStream::pair().unwrap();
        let t = std::thread::spawn(move || handshake(&mut b, &key(), Role::Target).unwrap());
        let s = handshake(&mut a, &key(), Role::Source).unwrap();
        (s, t.join().unwrap())
    }

    /// One authenticated container of format `version` with a pages record of `payload`; the
    /// bytes, the record's checksum field and what a reader makes of it.
    fn authenticated_at(
        version: u32,
        payload: &[u8],
    ) -> (Vec<u8>, u64, Result<Vec<u8>, ContainerError>) {
        let (src, tgt) = sessions();
        let mut w = Writer::start_at(Vec::new(), version, "t", Some(src.send)).unwrap();
        let at = usize::try_from(w.offset()).unwrap();
        w.write_record(RecordKind::PAGES, payload).unwrap();
        let bytes = w.finish().unwrap();
        let sum_at = at + RECORD_HEADER + payload.len();
        let sum = u64::from_le_bytes(bytes[sum_at..sum_at + 8].try_into().unwrap());
        let read = Reader::authenticated(&bytes[..], &[RecordKind::PAGES], tgt.recv)
            .and_then(|mut r| r.next_record())
            .map(|r| r.map(|r| r.payload).unwrap_or_default());
        (bytes, sum, read)
    }

    /// An authenticated record's length on the wire after `at`: header, payload, checksum
    /// field and tag.
    fn record_len(bytes: &[u8], at: usize) -> usize {
        let len = u32::from_le_bytes(bytes[at + 4..at + 8].try_into().unwrap());
        RECORD_HEADER + len as usize + 8
    }

    /// Records read into a recycled buffer (larger, then smaller, then larger than the last)
    /// are the records written; a payload cut short in a recycled buffer is named with its
    /// offset.
    #[test]
    fn records_read_into_a_recycled_buffer_are_the_records_written() {
        let payloads: Vec<Vec<u8>> = [5000usize, 10, 3000, 9000]
            .iter()
            .enumerate()
            .map(|(i, &n)| (0..n).map(|b| (b * 7 + i).to_le_bytes()[0]).collect())
            .collect();
        let mut w = Writer::new(Vec::new(), "t").unwrap();
        for p in &payloads {
            w.write_record(RecordKind::PAGES, p).unwrap();
        }
        let bytes = w.finish().unwrap();
        let mut r = Reader::new(&bytes[..], &[RecordKind::PAGES]).unwrap();
        for p in &payloads {
            let rec = r.next_record().unwrap().unwrap();
            assert_eq!(&rec.payload, p);
            r.recycle(rec.payload);
        }
        assert!(r.next_record().unwrap().is_none());
        r.expect_eof().unwrap();

        // Cut 100 bytes into the last payload: its record header is whole.
        let last = bytes.len() - 8 - (8 + 8 + 8) - 9000;
        let cut = &bytes[..last + 100];
        let mut r = Reader::new(cut, &[RecordKind::PAGES]).unwrap();
        for _ in 0..3 {
            let rec = r.next_record().unwrap().unwrap();
            r.recycle(rec.payload);
        }
        match r.next_record() {
            Err(ContainerError::Truncated { offset, .. }) => assert_eq!(offset, cut.len() as u64),
            other => panic!("{other:?}"),
        }
    }

    /// Version 5 tags an authenticated stream's header and records as version 4 did (16-byte
    /// Poly1305 tags, record heads bound through the nonce, no record checksum), version 4 is
    /// still read and version 3 is refused as too old.
    #[test]
    fn authenticated_records_carry_bound_tags_in_versions_5_and_4_and_version_3_is_refused() {
        let payload = b"guest pages".repeat(100);
        for version in [5, 4] {
            let (bytes, sum, read) = authenticated_at(version, &payload);
            assert_eq!(sum, 0, "version {version}");
            assert_eq!(read.unwrap(), payload, "version {version}");
            // header (23 bytes with the version string "t"), tag, record, tag, end, tag.
            let first = 23 + 16;
            let end = first + record_len(&bytes, first) + 16;
            assert_eq!(
                bytes.len(),
                end + record_len(&bytes, end) + 16,
                "version {version}"
            );
        }
        let (_, _, read) = authenticated_at(3, &payload);
        assert!(
            matches!(
                read,
                Err(ContainerError::VersionTooOld {
                    found: 3,
                    oldest: 4
                })
            ),
            "{read:?}"
        );
    }

    /// A plain (file) record's checksum: XXH64 (seed 0) of its head and payload from version
    /// 5, computed here in one piece by the one-shot function; CRC-64/XZ in a version-4 file,
    /// which still reads. A damaged version-5 record is refused naming XXH64.
    #[test]
    fn a_file_record_carries_xxh64_from_version_5_and_crc_64_before() {
        let payload = b"guest pages".repeat(100);
        let mut head = [0u8; RECORD_HEADER];
        head[0..2].copy_from_slice(&RecordKind::PAGES.0.to_le_bytes());
        head[2..4].copy_from_slice(&FLAG_MANDATORY.to_le_bytes());
        head[4..8].copy_from_slice(&u32::try_from(payload.len()).unwrap().to_le_bytes());
        let whole = [&head[..], &payload].concat();
        for (version, sum) in [
            (5, xxhash_rust::xxh64::xxh64(&whole, 0)),
            (4, crc64(&whole)),
        ] {
            let mut w = Writer::start_at(Vec::new(), version, "t", None).unwrap();
            let at = usize::try_from(w.offset()).unwrap();
            w.write_record(RecordKind::PAGES, &payload).unwrap();
            let mut bytes = w.finish().unwrap();
            let sum_at = at + RECORD_HEADER + payload.len();
            assert_eq!(
                bytes[sum_at..sum_at + 8],
                sum.to_le_bytes(),
                "version {version}"
            );
            let mut r = Reader::new(&bytes[..], &[RecordKind::PAGES]).unwrap();
            assert_eq!(r.next_record().unwrap().unwrap().payload, payload);
            bytes[at + RECORD_HEADER + 3] ^= 1;
            let mut r = Reader::new(&bytes[..], &[RecordKind::PAGES]).unwrap();
            let err = r.next_record().unwrap_err();
            let name = if version == 5 { "XXH64" } else { "CRC-64" };
            assert!(
                matches!(err, ContainerError::RecordChecksum { algorithm, .. } if algorithm == name),
                "version {version}: {err:?}"
            );
            assert!(
                err.to_string().contains(&format!("corrupted: {name} ")),
                "{err}"
            );
        }
        // XXH64's reference value of the empty input (seed 0), as `xxhsum -H1` prints it.
        assert_eq!(record_checksum(5, b"", b""), 0xef46_db37_51d8_e999);
    }

    /// A version-5 stream whose header is rewritten to say version 4 (CRC fixed up) fails the
    /// header's tag: the header's bytes, its version among them, are tagged with the key.
    #[test]
    fn a_stream_relabelled_as_the_older_version_fails_its_header_tag() {
        let (src, tgt) = sessions();
        let w = Writer::start_at(Vec::new(), 5, "t", Some(src.send)).unwrap();
        let mut forged = w.finish().unwrap();
        forged[8..12].copy_from_slice(&4u32.to_le_bytes());
        let crc = crc64(&forged[..15]);
        forged[15..23].copy_from_slice(&crc.to_le_bytes());
        let err = Reader::authenticated(&forged[..], &[RecordKind::PAGES], tgt.recv)
            .err()
            .expect("the relabelled header is refused");
        assert!(
            matches!(err, ContainerError::Authentication { seq: 0, .. }),
            "{err:?}"
        );
        // The same bytes unaltered read (the refusal is the relabelling's).
        let (src, tgt) = sessions();
        let w = Writer::start_at(Vec::new(), 5, "t", Some(src.send)).unwrap();
        let bytes = w.finish().unwrap();
        let mut r = Reader::authenticated(&bytes[..], &[], tgt.recv).unwrap();
        assert!(r.next_record().unwrap().is_none());
    }

    /// CRC-64/XZ's check value (the catalogue's `check`, of "123456789"), and the table form
    /// agrees with a bitwise computation on lengths around the 16-byte slices.
    #[test]
    fn crc64_is_crc_64_xz() {
        assert_eq!(crc64(b"123456789"), 0x995d_c9bb_df19_39fa);
        let bitwise = Crc::<u64, crc::NoTable>::new(&CRC_64_XZ);
        let data: Vec<u8> = (0..200u8)
            .map(|i| i.wrapping_mul(37).wrapping_add(11))
            .collect();
        for len in [0, 1, 15, 16, 17, 31, 32, 33, 199, 200] {
            assert_eq!(crc64(&data[..len]), bitwise.checksum(&data[..len]), "{len}");
        }
    }

    #[test]
    fn a_reader_accepts_its_version_and_the_one_before() {
        // At format 1, only version 1; there is no version 0.
        assert!(check_version(1, 1).is_ok());
        assert!(matches!(
            check_version(0, 1),
            Err(ContainerError::VersionTooOld {
                found: 0,
                oldest: 1
            })
        ));
        // The rule once version 2 exists: 1 and 2 read, 0 and 3 refused.
        assert!(check_version(1, 2).is_ok());
        assert!(check_version(2, 2).is_ok());
        assert!(matches!(
            check_version(0, 2),
            Err(ContainerError::VersionTooOld {
                found: 0,
                oldest: 1
            })
        ));
        assert!(matches!(
            check_version(3, 2),
            Err(ContainerError::VersionTooNew {
                found: 3,
                newest: 2
            })
        ));
        // And at version 5: 4 and 5.
        assert!(check_version(4, 5).is_ok());
        assert!(matches!(
            check_version(3, 5),
            Err(ContainerError::VersionTooOld {
                found: 3,
                oldest: 4
            })
        ));
    }
}
