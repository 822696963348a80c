//! Reading a container whole record by record: the header checked, then each record's head,
//! payload, checksum or tag and flags, up to the end record and its count. Reading a file's
//! records in parts ([`super::parts`]) shares the head, flags and end checks.

use std::io::{self, Read};

use super::{
    check_version, record_checksum, record_checksum_name, ContainerError, Header, Record,
    RecordKind, CRC, FLAG_MANDATORY, FORMAT_VERSION, MAGIC, MAX_PAYLOAD, MAX_VERSION_STRING,
    RECORD_HEADER,
};
use crate::auth::RecordMac;

/// A record's head as read: where it starts, its bytes, and what they say.
pub(super) struct RecordHead {
    pub(super) start: u64,
    pub(super) head: [u8; RECORD_HEADER],
    pub(super) kind: RecordKind,
    pub(super) flags: u16,
    pub(super) len: u32,
}

/// Reads a container: the header at creation, then records until the end record.
pub struct Reader<R: Read> {
    pub(super) input: R,
    pub(super) header: Header,
    pub(super) offset: u64,
    pub(super) records: u64,
    /// `None`: every kind is known (a check of the container's integrity only).
    known: Option<Vec<RecordKind>>,
    pub(super) mac: Option<RecordMac>,
    ended: bool,
    /// A payload buffer given back ([`Reader::recycle`]) for the next record.
    spare: Vec<u8>,
    /// A record read in parts was begun and not finished ([`RecordParts`]): the input is
    /// inside it, and no further record can be read.
    ///
    /// [`RecordParts`]: super::RecordParts
    pub(super) unfinished: bool,
}

impl<R: Read> Reader<R> {
    /// Reads and checks the header of a container (a file). `known` lists the record kinds
    /// the caller understands: a mandatory record of another kind is refused.
    pub fn new(input: R, known: &[RecordKind]) -> Result<Self, ContainerError> {
        Self::start(input, Some(known.to_vec()), None)
    }

    /// Reads a container checking only its integrity: every record kind is accepted.
    pub fn any_kind(input: R) -> Result<Self, ContainerError> {
        Self::start(input, None, None)
    }

    /// Reads and authenticates the header of a container on a stream, with the receiving half
    /// of a session ([`crate::auth::Session`]).
    pub fn authenticated(
        input: R,
        known: &[RecordKind],
        mac: RecordMac,
    ) -> Result<Self, ContainerError> {
        Self::start(input, Some(known.to_vec()), Some(mac))
    }

    fn start(
        input: R,
        known: Option<Vec<RecordKind>>,
        mac: Option<RecordMac>,
    ) -> Result<Self, ContainerError> {
        let mut r = Reader {
            input,
            header: Header {
                version: 0,
                vmhost_version: String::new(),
            },
            offset: 0,
            records: 0,
            known,
            mac,
            ended: false,
            spare: Vec::new(),
            unfinished: false,
        };
        r.header = r.read_header()?;
        Ok(r)
    }

    /// The container's header.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// The offset of the next byte to read.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    pub(super) fn take(
        &mut self,
        buf: &mut [u8],
        what: &dyn Fn() -> String,
    ) -> Result<(), ContainerError> {
        let mut done = 0;
        while done < buf.len() {
            match self.input.read(&mut buf[done..]) {
                Ok(0) => {
                    return Err(ContainerError::Truncated {
                        offset: self.offset + done as u64,
                        what: what(),
                    })
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(source) => {
                    return Err(ContainerError::Read {
                        offset: self.offset + done as u64,
                        source,
                    })
                }
            }
        }
        self.offset += buf.len() as u64;
        Ok(())
    }

    /// The next `len` bytes (at most [`MAX_PAYLOAD`]) in the spare buffer when there is one:
    /// read into its capacity, neither zeroed first nor allocated (and faulted in) again.
    fn take_payload(
        &mut self,
        len: u32,
        what: &dyn Fn() -> String,
    ) -> Result<Vec<u8>, ContainerError> {
        let mut payload = std::mem::take(&mut self.spare);
        payload.clear();
        let want = len as usize;
        payload.reserve_exact(want);
        let got = (&mut self.input)
            .take(u64::from(len))
            .read_to_end(&mut payload)
            .map_err(|source| ContainerError::Read {
                offset: self.offset,
                source,
            })?;
        if got < want {
            return Err(ContainerError::Truncated {
                offset: self.offset + got as u64,
                what: what(),
            });
        }
        self.offset += u64::from(len);
        Ok(payload)
    }

    /// Gives a record's payload buffer back, for the next record to be read into: a caller
    /// done with each record before the next saves an allocation (and its page faults) per
    /// record.
    pub fn recycle(&mut self, payload: Vec<u8>) {
        if payload.capacity() > self.spare.capacity() {
            self.spare = payload;
        }
    }

    fn read_header(&mut self) -> Result<Header, ContainerError> {
        let what = || "the header".to_string();
        let mut fixed = [0u8; 14];
        self.take(&mut fixed, &what)?;
        let mut magic = [0u8; 8];
        magic.copy_from_slice(&fixed[0..8]);
        if magic != MAGIC {
            return Err(ContainerError::BadMagic { found: magic });
        }
        let len = usize::from(u16::from_le_bytes([fixed[12], fixed[13]]));
        if len > MAX_VERSION_STRING {
            return Err(ContainerError::BadVersionString { len });
        }
        let mut rest = vec![0u8; len + 8];
        self.take(&mut rest, &what)?;
        let (text, sum) = rest.split_at(len);
        let mut crc = CRC.digest();
        crc.update(&fixed);
        crc.update(text);
        let computed = crc.finalize();
        let found = u64::from_le_bytes(sum.try_into().unwrap_or_default());
        if found != computed {
            return Err(ContainerError::HeaderChecksum { found, computed });
        }
        let version = u32::from_le_bytes([fixed[8], fixed[9], fixed[10], fixed[11]]);
        check_version(version, FORMAT_VERSION)?;
        // The version picks the tag; a changed version fails the tag (of either kind) as any
        // other changed byte does.
        if let Some(mac) = &mut self.mac {
            mac.use_format(version);
        }
        self.check_tag(0, "the header".to_string(), |m, tag| {
            m.verify(&[&fixed, &rest], tag)
        })?;
        let vmhost_version = String::from_utf8(text.to_vec())
            .map_err(|_| ContainerError::BadVersionString { len })?;
        Ok(Header {
            version,
            vmhost_version,
        })
    }

    /// Reads the MAC tag after the bytes at `start` and checks it with `verify` (authenticated
    /// readers only).
    fn check_tag(
        &mut self,
        start: u64,
        what: String,
        verify: impl FnOnce(&mut RecordMac, &[u8]) -> bool,
    ) -> Result<(), ContainerError> {
        let Some(mut mac) = self.mac.take() else {
            return Ok(());
        };
        let mut tag = [0u8; crate::auth::TAG_LEN];
        let tag = &mut tag[..mac.tag_len()];
        let read = self.take(tag, &|| format!("the tag of {what}"));
        let seq = mac.seq();
        let ok = read.is_ok() && verify(&mut mac, tag);
        self.mac = Some(mac);
        read?;
        if !ok {
            return Err(ContainerError::Authentication {
                offset: start,
                what,
                seq,
            });
        }
        Ok(())
    }

    /// Reads a record's head (kind, flags, payload length), refusing a length over
    /// [`MAX_PAYLOAD`].
    /// `None` after the end record.
    pub(super) fn read_head(&mut self) -> Result<Option<RecordHead>, ContainerError> {
        if self.ended {
            return Ok(None);
        }
        if self.unfinished {
            return Err(ContainerError::Usage(
                "a record read in parts was not finished",
            ));
        }
        let start = self.offset;
        let mut head = [0u8; RECORD_HEADER];
        self.take(&mut head, &|| {
            "the record stream before the end record".to_string()
        })?;
        let kind = RecordKind(u16::from_le_bytes([head[0], head[1]]));
        let flags = u16::from_le_bytes([head[2], head[3]]);
        let len = u32::from_le_bytes([head[4], head[5], head[6], head[7]]);
        if len > MAX_PAYLOAD {
            let len = u64::from(len);
            return Err(ContainerError::Oversized {
                offset: start,
                kind,
                len,
            });
        }
        Ok(Some(RecordHead {
            start,
            head,
            kind,
            flags,
            len,
        }))
    }

    /// The next record, or `None` after the end record (whose count is checked). Unknown
    /// optional records are returned too: the caller skips the kinds it does not use.
    pub fn next_record(&mut self) -> Result<Option<Record>, ContainerError> {
        let Some(RecordHead {
            start,
            head,
            kind,
            flags,
            len,
        }) = self.read_head()?
        else {
            return Ok(None);
        };
        let what = || format!("a {kind} record");
        let payload = self.take_payload(len, &what)?;
        let mut sum = [0u8; 8];
        self.take(&mut sum, &what)?;
        self.check_tag(start, format!("{kind} record"), |m, tag| {
            m.verify_record(&head, &payload, &sum, tag)
        })?;
        // The MAC just checked every byte of a version-2 authenticated record.
        let summed = self.mac.is_none() || self.header.version < 2;
        let version = self.header.version;
        let computed = match summed {
            true => record_checksum(version, &head, &payload),
            false => 0,
        };
        let found = u64::from_le_bytes(sum);
        if found != computed {
            let offset = start;
            return Err(ContainerError::RecordChecksum {
                offset,
                kind,
                algorithm: record_checksum_name(version),
                found,
                computed,
            });
        }
        let mandatory = self.check_flags(start, kind, flags)?;
        if kind == RecordKind::END {
            return self.end(start, mandatory, &payload).map(|()| None);
        }
        self.records += 1;
        Ok(Some(Record {
            kind,
            mandatory,
            payload,
            offset: start,
        }))
    }

    /// Whether a record of `kind` with `flags` is mandatory; refuses flags this version does
    /// not define and a mandatory kind the reader does not know (the end record is known).
    pub(super) fn check_flags(
        &self,
        start: u64,
        kind: RecordKind,
        flags: u16,
    ) -> Result<bool, ContainerError> {
        if flags & !FLAG_MANDATORY != 0 {
            return Err(ContainerError::BadFlags {
                offset: start,
                kind,
                flags,
            });
        }
        let mandatory = flags & FLAG_MANDATORY != 0;
        let unknown = self.known.as_ref().is_some_and(|k| !k.contains(&kind));
        if mandatory && kind != RecordKind::END && unknown {
            return Err(ContainerError::UnknownMandatory {
                offset: start,
                kind,
            });
        }
        Ok(mandatory)
    }

    pub(super) fn end(
        &mut self,
        offset: u64,
        mandatory: bool,
        payload: &[u8],
    ) -> Result<(), ContainerError> {
        let claimed = <[u8; 8]>::try_from(payload).ok().map(u64::from_le_bytes);
        if !mandatory || claimed != Some(self.records) {
            let read = self.records;
            return Err(ContainerError::BadEnd {
                offset,
                claimed,
                read,
            });
        }
        self.ended = true;
        Ok(())
    }

    /// After the end record of a file: checks that nothing follows it.
    pub fn expect_eof(&mut self) -> Result<(), ContainerError> {
        let mut probe = [0u8; 64];
        loop {
            match self.input.read(&mut probe) {
                Ok(0) => return Ok(()),
                Ok(extra) => {
                    let offset = self.offset;
                    return Err(ContainerError::TrailingData { offset, extra });
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(source) => {
                    let offset = self.offset;
                    return Err(ContainerError::Read { offset, source });
                }
            }
        }
    }

    /// Whether the end record has been read.
    pub fn ended(&self) -> bool {
        self.ended
    }
}
