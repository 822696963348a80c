//! Reading a file's records in parts: the caller reads a record's payload piece by piece and
//! may have large pieces read straight from the input into memory of its own (a snapshot's
//! page runs into guest RAM), handing those bytes back for the record's checksum. The
//! checksum is still checked over every byte of the record before [`RecordParts::finish`]
//! returns, so a caller that placed a damaged record's bytes learns it before it uses them.

use std::io::{self, Read};

use super::{record_checksum_name, ContainerError, Reader, RecordKind, Sum};

/// A record of a file being read in parts ([`Reader::next_parts`]). Its payload is read in
/// order, by [`RecordParts::read_exact`] or [`RecordParts::read_unsummed`] (then
/// [`RecordParts::sum`]); [`RecordParts::finish`] checks the record's checksum and must be
/// called before the reader reads on.
pub struct RecordParts<'a, R: Read> {
    reader: &'a mut Reader<R>,
    start: u64,
    kind: RecordKind,
    mandatory: bool,
    len: u32,
    /// Payload bytes not read yet.
    left: u32,
    /// Bytes read by [`RecordParts::read_unsummed`] and not yet handed to the checksum.
    owed: u64,
    sum: Sum,
}

impl<R: Read> Reader<R> {
    /// The next record of a file for its caller to read in parts, or `None` after the end
    /// record (whose count is checked). The head is checked as [`Reader::next_record`] checks
    /// it (length, flags, a mandatory kind the reader does not know); the checksum when the
    /// record is finished. Records of an authenticated stream are read whole, with
    /// [`Reader::next_record`]: their tag covers the payload before any of it may be used.
    pub fn next_parts(&mut self) -> Result<Option<RecordParts<'_, R>>, ContainerError> {
        if self.mac.is_some() {
            return Err(ContainerError::Usage(
                "an authenticated stream's records are read whole",
            ));
        }
        let Some(h) = self.read_head()? else {
            return Ok(None);
        };
        let (start, kind, len) = (h.start, h.kind, h.len);
        let mandatory = self.check_flags(start, kind, h.flags)?;
        let sum = Sum::new(self.header.version, &h.head);
        self.unfinished = true;
        let mut parts = RecordParts {
            reader: self,
            start,
            kind,
            mandatory,
            len,
            left: len,
            owed: 0,
            sum,
        };
        if kind == RecordKind::END {
            let payload = parts.read_to_end()?;
            let reader = parts.finish_checksum()?;
            return reader.end(start, mandatory, &payload).map(|()| None);
        }
        Ok(Some(parts))
    }
}

impl<'a, R: Read> RecordParts<'a, R> {
    /// The record's kind.
    pub fn kind(&self) -> RecordKind {
        self.kind
    }

    /// Whether a reader that does not know its kind must refuse the container.
    pub fn mandatory(&self) -> bool {
        self.mandatory
    }

    /// The payload's length.
    pub fn len(&self) -> u32 {
        self.len
    }

    /// Whether the payload is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The payload bytes not read yet.
    pub fn remaining(&self) -> u32 {
        self.left
    }

    fn what(&self) -> String {
        format!("a {} record", self.kind)
    }

    /// Takes `n` payload bytes off the count, refusing more than are left.
    fn claim(&mut self, n: usize) -> Result<(), ContainerError> {
        match u32::try_from(n).ok().filter(|&n| n <= self.left) {
            Some(n) => {
                self.left -= n;
                Ok(())
            }
            None => Err(ContainerError::Usage(
                "a read past the end of a record's payload",
            )),
        }
    }

    /// Reads the next `buf.len()` payload bytes into `buf`, into the checksum too.
    pub fn read_exact(&mut self, buf: &mut [u8]) -> Result<(), ContainerError> {
        self.claim(buf.len())?;
        let what = self.what();
        self.reader.take(buf, &|| what.clone())?;
        self.sum.update(buf);
        Ok(())
    }

    /// The rest of the payload, read into a new buffer (a record the caller does not place).
    pub fn read_to_end(&mut self) -> Result<Vec<u8>, ContainerError> {
        let mut rest = vec![0u8; self.left as usize];
        self.read_exact(&mut rest)?;
        Ok(rest)
    }

    /// Lets `fill` read the next `n` payload bytes straight from the input, into memory of
    /// the caller's. `fill` must read exactly `n` bytes; an early end of input
    /// ([`io::ErrorKind::UnexpectedEof`]) is the container's truncation. The bytes are not in
    /// the checksum yet: the caller hands them back with [`RecordParts::sum`], in order, and
    /// [`RecordParts::finish`] refuses a record with bytes not handed back.
    pub fn read_unsummed(
        &mut self,
        n: usize,
        fill: impl FnOnce(&mut R) -> io::Result<()>,
    ) -> Result<(), ContainerError> {
        self.claim(n)?;
        let offset = self.reader.offset;
        match fill(&mut self.reader.input) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                let what = self.what();
                return Err(ContainerError::Truncated { offset, what });
            }
            Err(source) => return Err(ContainerError::Read { offset, source }),
        }
        self.reader.offset += n as u64;
        self.owed += n as u64;
        Ok(())
    }

    /// Hands bytes read by [`RecordParts::read_unsummed`] to the checksum, in the order they
    /// were read.
    pub fn sum(&mut self, bytes: &[u8]) -> Result<(), ContainerError> {
        self.owed = self
            .owed
            .checked_sub(bytes.len() as u64)
            .ok_or(ContainerError::Usage(
                "more bytes handed to a record's checksum than were read",
            ))?;
        self.sum.update(bytes);
        Ok(())
    }

    /// Reads the record's stored checksum and compares it with the bytes read; the reader
    /// then goes on to the next record.
    pub fn finish(self) -> Result<(), ContainerError> {
        let reader = self.finish_checksum()?;
        reader.records += 1;
        Ok(())
    }

    /// Checks the whole payload was read and summed, and the checksum; gives the reader back.
    fn finish_checksum(self) -> Result<&'a mut Reader<R>, ContainerError> {
        if self.left != 0 || self.owed != 0 {
            return Err(ContainerError::Usage(
                "a record finished before its payload was read and summed",
            ));
        }
        let what = self.what();
        let mut stored = [0u8; 8];
        self.reader.take(&mut stored, &|| what.clone())?;
        let version = self.reader.header.version;
        let (found, computed) = (u64::from_le_bytes(stored), self.sum.finish());
        if found != computed {
            return Err(ContainerError::RecordChecksum {
                offset: self.start,
                kind: self.kind,
                algorithm: record_checksum_name(version),
                found,
                computed,
            });
        }
        self.reader.unfinished = false;
        Ok(self.reader)
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Writer, RECORD_HEADER};
    use super::*;

    const OPTIONAL: RecordKind = RecordKind(90);

    /// A file of format `version` with a pages record, an optional record of a kind the reader
    /// does not know, and a second pages record; its bytes and the first payload's offset.
    fn file(version: u32) -> (Vec<u8>, usize, Vec<u8>, Vec<u8>) {
        let a: Vec<u8> = (0..9000u32)
            .map(|i| (i * 7 % 256).to_le_bytes()[0])
            .collect();
        let b = b"second run".repeat(50);
        let mut w = Writer::start_at(Vec::new(), version, "t", None).unwrap();
        let at = usize::try_from(w.offset()).unwrap() + RECORD_HEADER;
        w.write_record(RecordKind::PAGES, &a).unwrap();
        w.write_optional(OPTIONAL, b"skip me").unwrap();
        w.write_record(RecordKind::PAGES, &b).unwrap();
        (w.finish().unwrap(), at, a, b)
    }

    /// Reads every pages record the way a snapshot's loader does: its first 20 bytes summed
    /// as read, the rest read unsummed (here into a buffer of the test's) in 4000-byte pieces
    /// and handed back; other records read whole and dropped.
    fn read_placed(bytes: &[u8]) -> Result<Vec<Vec<u8>>, ContainerError> {
        let mut r = Reader::new(bytes, &[RecordKind::PAGES])?;
        let mut out = Vec::new();
        while let Some(mut rec) = r.next_parts()? {
            if rec.kind() != RecordKind::PAGES {
                rec.read_to_end()?;
                rec.finish()?;
                continue;
            }
            let mut payload = vec![0u8; rec.len() as usize];
            let (head, rest) = payload.split_at_mut(20);
            rec.read_exact(head)?;
            for piece in rest.chunks_mut(4000) {
                rec.read_unsummed(piece.len(), |input| input.read_exact(piece))?;
                rec.sum(piece)?;
            }
            rec.finish()?;
            out.push(payload);
        }
        r.expect_eof()?;
        Ok(out)
    }

    #[test]
    fn records_read_in_parts_are_the_records_written_in_either_version() {
        for version in [5, 4] {
            let (bytes, _, a, b) = file(version);
            assert_eq!(
                read_placed(&bytes).unwrap(),
                vec![a, b],
                "version {version}"
            );
        }
    }

    /// A damaged byte of a payload placed unsummed is found at the record's finish, naming the
    /// version's checksum, whichever piece it is in.
    #[test]
    fn a_damaged_placed_byte_fails_the_records_checksum() {
        for (version, name) in [(5, "XXH64"), (4, "CRC-64")] {
            for damaged in [3, 25, 8999] {
                let (mut bytes, at, _, _) = file(version);
                bytes[at + damaged] ^= 0x40;
                let err = read_placed(&bytes).unwrap_err();
                assert!(
                    matches!(err, ContainerError::RecordChecksum { algorithm, .. } if algorithm == name),
                    "version {version}, byte {damaged}: {err:?}"
                );
            }
        }
    }

    #[test]
    fn a_record_with_bytes_not_summed_or_not_read_is_refused_at_its_finish() {
        let (bytes, _, a, _) = file(5);
        let mut r = Reader::new(&bytes[..], &[RecordKind::PAGES]).unwrap();
        let mut rec = r.next_parts().unwrap().unwrap();
        let mut buf = vec![0u8; a.len()];
        rec.read_unsummed(buf.len(), |input| input.read_exact(&mut buf))
            .unwrap();
        rec.sum(&buf[..100]).unwrap();
        assert!(matches!(rec.finish(), Err(ContainerError::Usage(_))));

        let mut r = Reader::new(&bytes[..], &[RecordKind::PAGES]).unwrap();
        let mut rec = r.next_parts().unwrap().unwrap();
        assert!(matches!(rec.sum(b"x"), Err(ContainerError::Usage(_))));
        let mut small = [0u8; 10];
        rec.read_exact(&mut small).unwrap();
        assert!(matches!(rec.finish(), Err(ContainerError::Usage(_))));

        let mut r = Reader::new(&bytes[..], &[RecordKind::PAGES]).unwrap();
        let mut rec = r.next_parts().unwrap().unwrap();
        let too_many = rec.len() as usize + 1;
        let called = rec.read_unsummed(too_many, |_| panic!("fill called past the payload"));
        assert!(matches!(called, Err(ContainerError::Usage(_))));
    }

    #[test]
    fn a_file_cut_inside_a_placed_run_is_truncated_there() {
        let (bytes, at, _, _) = file(5);
        let cut = &bytes[..at + 5000];
        let err = read_placed(cut).unwrap_err();
        assert!(
            matches!(&err, ContainerError::Truncated { offset, .. } if *offset == (at + 20) as u64 + 4000),
            "{err:?}"
        );
    }

    /// A record begun and dropped unfinished leaves the input inside it: the reader refuses
    /// to read on rather than take its checksum for the next record's head.
    #[test]
    fn no_record_is_read_after_one_left_unfinished() {
        let (bytes, _, _, _) = file(5);
        let mut r = Reader::new(&bytes[..], &[RecordKind::PAGES]).unwrap();
        let mut rec = r.next_parts().unwrap().unwrap();
        rec.read_to_end().unwrap();
        drop(rec);
        assert!(matches!(r.next_parts(), Err(ContainerError::Usage(_))));
        assert!(matches!(r.next_record(), Err(ContainerError::Usage(_))));
    }
}
