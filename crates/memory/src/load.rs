//! Loading a cell from a snapshot's memory file with its page runs read straight into guest
//! RAM: the kernel copies each piece of a run from the file into the cell's pages, and the
//! loader then reads the piece back (still in the CPU's cache) for the record's checksum. A
//! run is moved once through memory instead of three times (into a buffer, through the
//! checksum, into guest RAM), and the loader holds no record-sized buffer.
//!
//! The checksum of a record is checked when the record ends, after its pages are in guest
//! RAM: a damaged file fails the load, and the restore that loads it ends before the guest
//! runs (nothing has run the guest while it loads). Guest RAM is still touched only through
//! vm-memory's volatile copies, never as a `&[u8]`.

use std::fs::File;
use std::io::{self, BufRead, BufReader, Read};

use vm_memory::{Bytes, GuestMemoryError, MemoryRegionAddress};
use vmhost_persist::container::{Reader, RecordKind, RecordParts};
use vmhost_persist::pages::{decode_run_header, CellGeometry, RUN_HEADER};

use crate::backing::MappedRegion;
use crate::cells::{cell_regions, pieces, run_geometry, CellIoError};
use crate::GuestRegionMmap;

/// The bytes of a run the kernel copies into guest RAM before the loader reads them back for
/// the checksum: small enough that they are still in the CPU's cache.
const PIECE: usize = 512 * 1024;
/// The buffer the loader reads a piece back into, for the checksum.
const SUM_BUFFER: usize = 64 * 1024;

/// A memory file read in order, whose page runs can be read straight into guest RAM.
pub trait CellSource: Read + Send {
    /// Reads exactly `len` bytes into `region` at `at`; an early end of input is
    /// [`io::ErrorKind::UnexpectedEof`].
    fn read_into(
        &mut self,
        region: &GuestRegionMmap,
        at: MemoryRegionAddress,
        len: usize,
    ) -> io::Result<()>;
}

fn io_error(e: GuestMemoryError) -> io::Error {
    match e {
        GuestMemoryError::IOError(e) => e,
        GuestMemoryError::PartialBuffer { .. } => io::ErrorKind::UnexpectedEof.into(),
        other => io::Error::other(other),
    }
}

/// Sources vm-memory reads into guest RAM itself (its `ReadVolatile`).
macro_rules! read_volatile_source {
    ($($source:ty),*) => {$(
        impl CellSource for $source {
            fn read_into(
                &mut self,
                region: &GuestRegionMmap,
                at: MemoryRegionAddress,
                len: usize,
            ) -> io::Result<()> {
                region
                    .read_exact_volatile_from(at, self, len)
                    .map_err(io_error)
            }
        }
    )*};
}

read_volatile_source!(File, &[u8]);

/// What the buffer holds first, then straight from the file.
impl CellSource for BufReader<File> {
    fn read_into(
        &mut self,
        region: &GuestRegionMmap,
        at: MemoryRegionAddress,
        len: usize,
    ) -> io::Result<()> {
        let buffered = self.buffer();
        let first = buffered.len().min(len);
        region
            .write_slice(&buffered[..first], at)
            .map_err(io_error)?;
        self.consume(first);
        let rest = MemoryRegionAddress(at.0 + first as u64);
        region
            .read_exact_volatile_from(rest, self.get_mut(), len - first)
            .map_err(io_error)
    }
}

/// Reads the page runs of cell `cell` from `input` (a container of pages records) into the
/// cell's `regions`, each record's checksum checked as it ends. Returns the bytes and records.
pub fn load_cell<R: CellSource>(
    regions: &[MappedRegion],
    cell: u32,
    input: R,
) -> Result<(u64, u64), CellIoError> {
    let (mine, geometry) = cell_regions(regions, cell)?;
    let rec_err = |source| CellIoError::Record { cell, source };
    let mut reader = Reader::new(input, &[RecordKind::PAGES]).map_err(rec_err)?;
    let mut sum_buf = vec![0u8; SUM_BUFFER];
    let (mut bytes, mut records) = (0u64, 0u64);
    while let Some(mut rec) = reader.next_parts().map_err(rec_err)? {
        if rec.kind() != RecordKind::PAGES {
            rec.read_to_end().map_err(rec_err)?;
            rec.finish().map_err(rec_err)?;
            continue;
        }
        bytes += place_run(&mut rec, &mine, &geometry, &mut sum_buf)?;
        rec.finish().map_err(rec_err)?;
        records += 1;
    }
    reader.expect_eof().map_err(rec_err)?;
    Ok((bytes, records))
}

/// Reads one pages record's run into the regions that hold it, a piece at a time, handing
/// each piece back to the record's checksum. Returns the bytes placed.
fn place_run<R: CellSource>(
    rec: &mut RecordParts<'_, R>,
    regions: &[&MappedRegion],
    geometry: &CellGeometry,
    sum_buf: &mut [u8],
) -> Result<u64, CellIoError> {
    let cell = geometry.cell();
    let rec_err = |source| CellIoError::Record { cell, source };
    let len = rec.len() as usize;
    let mut head = [0u8; RUN_HEADER];
    // A record too short for its header is refused by the decoder below, not read past.
    if len >= RUN_HEADER {
        rec.read_exact(&mut head).map_err(rec_err)?;
    }
    let g = run_geometry(cell, geometry, &head)?;
    let offset =
        decode_run_header(&head, len, &g).map_err(|source| CellIoError::Pages { cell, source })?;
    let run = len - RUN_HEADER;
    for (r, range, at) in pieces(regions, offset, run) {
        let mut done = 0usize;
        while done < range.len() {
            let n = PIECE.min(range.len() - done);
            let addr = MemoryRegionAddress(at.0 + done as u64);
            rec.read_unsummed(n, |input| input.read_into(&r.region, addr, n))
                .map_err(rec_err)?;
            sum_back(rec, r, addr, n, sum_buf)?;
            done += n;
        }
    }
    Ok(run as u64)
}

/// Reads `n` bytes at `addr` of `r` back (just written, still cached) into the record's
/// checksum.
fn sum_back<R: CellSource>(
    rec: &mut RecordParts<'_, R>,
    r: &MappedRegion,
    addr: MemoryRegionAddress,
    n: usize,
    sum_buf: &mut [u8],
) -> Result<(), CellIoError> {
    let cell = r.layout.cell;
    let mut done = 0usize;
    while done < n {
        let k = sum_buf.len().min(n - done);
        let from = MemoryRegionAddress(addr.0 + done as u64);
        r.region
            .read_slice(&mut sum_buf[..k], from)
            .map_err(|source| CellIoError::Copy {
                cell,
                offset: r.layout.file_offset + from.0,
                len: k as u64,
                source,
            })?;
        rec.sum(&sum_buf[..k])
            .map_err(|source| CellIoError::Record { cell, source })?;
        done += k;
    }
    Ok(())
}
