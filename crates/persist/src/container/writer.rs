//! Writing a container: its header, then records (each with its checksum or, on an
//! authenticated stream, its tag), then the end record; and where the writer's time went.

use std::io::{IoSlice, Write};
use std::time::Instant;

use super::{
    crc64, record_checksum, ContainerError, RecordKind, FLAG_MANDATORY, FORMAT_VERSION, MAGIC,
    MAX_PAYLOAD, MAX_VERSION_STRING, RECORD_HEADER,
};
use crate::auth::RecordMac;

/// The bytes of a header (checksum included).
fn encode_header(version: u32, vmhost_version: &str) -> Result<Vec<u8>, ContainerError> {
    let len = u16::try_from(vmhost_version.len())
        .ok()
        .filter(|&l| usize::from(l) <= MAX_VERSION_STRING)
        .ok_or(ContainerError::Usage(
            "the vmhost version string is longer than 64 bytes",
        ))?;
    let mut out = Vec::with_capacity(22 + vmhost_version.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(vmhost_version.as_bytes());
    let sum = crc64(&out);
    out.extend_from_slice(&sum.to_le_bytes());
    Ok(out)
}

/// Writes a container: the header at creation, records, and the end record at [`finish`].
/// A record refused before any byte is written ([`ContainerError::PayloadTooLarge`]) leaves
/// the container as it was; after a write error the container is unusable.
///
/// [`finish`]: Writer::finish
pub struct Writer<W: Write> {
    out: W,
    offset: u64,
    records: u64,
    mac: Option<RecordMac>,
    /// The format version written (the record checksum depends on it).
    version: u32,
    timing: WriteTiming,
}

/// Where a [`Writer`]'s time went, summed over its records.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct WriteTiming {
    /// Computing each record's checksum and, on an authenticated stream, its MAC.
    pub sealing: std::time::Duration,
    /// Handing each record to the output (one vectored write: a socket's copy, or a wait
    /// for room in it).
    pub writing: std::time::Duration,
}

impl<W: Write> Writer<W> {
    /// Starts a container on `out` (a file) and writes its header.
    pub fn new(out: W, vmhost_version: &str) -> Result<Self, ContainerError> {
        Self::start(out, vmhost_version, None)
    }

    /// Starts an authenticated container on `out` (a stream), with the sending half of a
    /// session ([`crate::auth::Session`]).
    pub fn authenticated(
        out: W,
        vmhost_version: &str,
        mac: RecordMac,
    ) -> Result<Self, ContainerError> {
        Self::start(out, vmhost_version, Some(mac))
    }

    fn start(out: W, vmhost_version: &str, mac: Option<RecordMac>) -> Result<Self, ContainerError> {
        Self::start_at(out, FORMAT_VERSION, vmhost_version, mac)
    }

    pub(super) fn start_at(
        out: W,
        version: u32,
        vmhost_version: &str,
        mac: Option<RecordMac>,
    ) -> Result<Self, ContainerError> {
        let header = encode_header(version, vmhost_version)?;
        let mut w = Writer {
            out,
            offset: 0,
            records: 0,
            mac,
            version,
            timing: WriteTiming::default(),
        };
        w.put(&header)?;
        if let Some(mac) = &mut w.mac {
            mac.use_format(version);
            let tag = mac.sign(&[&header]);
            let len = mac.tag_len();
            w.put(&tag[..len])?;
        }
        Ok(w)
    }

    fn put(&mut self, bytes: &[u8]) -> Result<(), ContainerError> {
        self.put_all(&mut [IoSlice::new(bytes)])
    }

    /// Writes every byte of `parts`, with as few (vectored) writes as the output takes.
    fn put_all(&mut self, mut parts: &mut [IoSlice<'_>]) -> Result<(), ContainerError> {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        while !parts.is_empty() {
            match self.out.write_vectored(parts) {
                Ok(0) => {
                    let source = std::io::Error::from(std::io::ErrorKind::WriteZero);
                    return Err(ContainerError::Write {
                        offset: self.offset,
                        source,
                    });
                }
                Ok(n) => IoSlice::advance_slices(&mut parts, n),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(source) => {
                    return Err(ContainerError::Write {
                        offset: self.offset,
                        source,
                    })
                }
            }
        }
        self.offset += total as u64;
        Ok(())
    }

    /// Where this writer's time went so far.
    pub fn timing(&self) -> WriteTiming {
        self.timing
    }

    /// Records written so far.
    pub fn records(&self) -> u64 {
        self.records
    }

    /// Writes a mandatory record.
    pub fn write_record(&mut self, kind: RecordKind, payload: &[u8]) -> Result<(), ContainerError> {
        self.record(kind, FLAG_MANDATORY, payload)
    }

    /// Writes an optional record: a reader that does not know its kind skips it.
    pub fn write_optional(
        &mut self,
        kind: RecordKind,
        payload: &[u8],
    ) -> Result<(), ContainerError> {
        self.record(kind, 0, payload)
    }

    fn record(
        &mut self,
        kind: RecordKind,
        flags: u16,
        payload: &[u8],
    ) -> Result<(), ContainerError> {
        if kind == RecordKind::END {
            return Err(ContainerError::Usage(
                "the end record is written by finish()",
            ));
        }
        self.raw_record(kind, flags, payload)?;
        self.records += 1;
        Ok(())
    }

    fn raw_record(
        &mut self,
        kind: RecordKind,
        flags: u16,
        payload: &[u8],
    ) -> Result<(), ContainerError> {
        let len = u32::try_from(payload.len())
            .ok()
            .filter(|&l| l <= MAX_PAYLOAD)
            .ok_or(ContainerError::PayloadTooLarge {
                kind,
                len: payload.len(),
            })?;
        let mut head = [0u8; RECORD_HEADER];
        head[0..2].copy_from_slice(&kind.0.to_le_bytes());
        head[2..4].copy_from_slice(&flags.to_le_bytes());
        head[4..8].copy_from_slice(&len.to_le_bytes());
        let sealing = Instant::now();
        let sum = if self.mac.is_some() && self.version >= 2 {
            [0u8; 8]
        } else {
            record_checksum(self.version, &head, payload).to_le_bytes()
        };
        let tag = self
            .mac
            .as_mut()
            .map(|m| (m.sign_record(&head, payload, &sum), m.tag_len()));
        let writing = Instant::now();
        let mut parts = [
            IoSlice::new(&head),
            IoSlice::new(payload),
            IoSlice::new(&sum),
            IoSlice::new(tag.as_ref().map_or(&[][..], |(t, len)| &t[..*len])),
        ];
        self.put_all(&mut parts)?;
        self.timing.sealing += writing - sealing;
        self.timing.writing += writing.elapsed();
        Ok(())
    }

    /// Writes the end record, flushes, and hands back the output.
    pub fn finish(mut self) -> Result<W, ContainerError> {
        let count = self.records.to_le_bytes();
        self.raw_record(RecordKind::END, FLAG_MANDATORY, &count)?;
        self.out.flush().map_err(|source| ContainerError::Write {
            offset: self.offset,
            source,
        })?;
        Ok(self.out)
    }

    /// The number of bytes written so far.
    pub fn offset(&self) -> u64 {
        self.offset
    }
}
