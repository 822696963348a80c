//! Guest memory as runs of pages: the payload of [`RecordKind::PAGES`] records.
//!
//! A cell's memory is sent (migration pre-copy rounds) or stored (a snapshot's
//! `memory-cell<N>` file) as records, each one run of consecutive pages:
//!
//! ```text
//! cell u32 | page size u32 | offset u64 (in the cell, a multiple of the page size)
//! | page count u32 (>= 1) | count × page size bytes
//! ```
//!
//! Pages the caller calls skippable (untouched, all-zero, or clean since the last round) are
//! left out; a reader leaves them as they are (zero in fresh memory). A later run may resend a
//! page (a dirty page in the next round): the last one wins. A run holds at most
//! [`max_run_pages`] pages so that its record stays within [`MAX_PAYLOAD`].

use std::io::Write;

use crate::container::{ContainerError, RecordKind, Writer, MAX_PAYLOAD};

/// The bytes before a run's pages.
pub const RUN_HEADER: usize = 20;
/// The smallest page size (granularity) of an encoding.
pub const MIN_PAGE_SIZE: u32 = 4096;
/// The largest page size of an encoding (a 1 GiB hugepage is sent in 2 MiB or 4 KiB units).
pub const MAX_PAGE_SIZE: u32 = 2 * 1024 * 1024;

/// Why pages could not be encoded or decoded.
#[derive(Debug, thiserror::Error)]
pub enum PageError {
    /// The page size is not a power of two in range.
    #[error(
        "page size {page_size} is not a power of two from {MIN_PAGE_SIZE} to {MAX_PAGE_SIZE} bytes"
    )]
    PageSize {
        /// The page size given or read.
        page_size: u32,
    },
    /// The cell size is not a positive multiple of the page size.
    #[error("cell {cell}: size {size} is not a positive multiple of the page size {page_size}")]
    CellSize {
        /// The cell.
        cell: u32,
        /// Its size.
        size: u64,
        /// The page size.
        page_size: u32,
    },
    /// The memory handed to the writer does not lie on page boundaries inside the cell.
    #[error("cell {cell}: memory of {len} bytes at offset {offset} is not whole pages of {page_size} bytes inside the cell's {size} bytes")]
    Range {
        /// The cell.
        cell: u32,
        /// Where the memory starts in the cell.
        offset: u64,
        /// Its length.
        len: u64,
        /// The page size.
        page_size: u32,
        /// The cell's size.
        size: u64,
    },
    /// A run record is shorter than its header or its pages.
    #[error("a pages record of {len} bytes is malformed: {why}")]
    Malformed {
        /// The payload length.
        len: usize,
        /// What is wrong.
        why: &'static str,
    },
    /// A run is for another cell or page size than the reader's.
    #[error("a pages record is for cell {cell} with {page_size}-byte pages; this reader reads cell {want_cell} with {want_page_size}-byte pages")]
    Geometry {
        /// The record's cell.
        cell: u32,
        /// The record's page size.
        page_size: u32,
        /// The reader's cell.
        want_cell: u32,
        /// The reader's page size.
        want_page_size: u32,
    },
    /// A run lies (partly) outside the cell.
    #[error("cell {cell}: a run of {count} pages at offset {offset:#x} lies outside the cell's {size} bytes or off a page boundary")]
    OutOfBounds {
        /// The cell.
        cell: u32,
        /// The run's offset.
        offset: u64,
        /// Its page count.
        count: u32,
        /// The cell's size.
        size: u64,
    },
    /// Writing a record failed.
    #[error("cannot write a pages record")]
    Write(#[source] ContainerError),
}

/// A cell's memory as the encoding sees it: its index, its page size and its size in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CellGeometry {
    cell: u32,
    page_size: u32,
    size: u64,
}

impl CellGeometry {
    /// Checks and makes a geometry: `page_size` a power of two from [`MIN_PAGE_SIZE`] to
    /// [`MAX_PAGE_SIZE`], `size` a positive multiple of it.
    pub fn new(cell: u32, page_size: u32, size: u64) -> Result<Self, PageError> {
        if !page_size.is_power_of_two() || !(MIN_PAGE_SIZE..=MAX_PAGE_SIZE).contains(&page_size) {
            return Err(PageError::PageSize { page_size });
        }
        if size == 0 || size % u64::from(page_size) != 0 {
            return Err(PageError::CellSize {
                cell,
                size,
                page_size,
            });
        }
        Ok(CellGeometry {
            cell,
            page_size,
            size,
        })
    }

    /// The cell's index.
    pub fn cell(&self) -> u32 {
        self.cell
    }

    /// The page size of the encoding.
    pub fn page_size(&self) -> u32 {
        self.page_size
    }

    /// The cell's size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }
}

/// The most pages one run of `page_size` holds.
pub fn max_run_pages(page_size: u32) -> u32 {
    // RUN_HEADER is 20.
    (MAX_PAYLOAD - 20) / page_size.max(1)
}

/// One run of pages: `bytes` belong at `offset` in the cell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageRun<'a> {
    /// The offset of the first page in the cell.
    pub offset: u64,
    /// Whole pages.
    pub bytes: &'a [u8],
}

impl PageRun<'_> {
    /// The record payload of this run in `geometry` (the inverse of [`decode_run`]).
    pub fn to_payload(&self, geometry: &CellGeometry) -> Result<Vec<u8>, PageError> {
        let count = check_run(geometry, self.offset, self.bytes.len())?;
        let mut out = Vec::with_capacity(RUN_HEADER + self.bytes.len());
        out.extend_from_slice(&geometry.cell.to_le_bytes());
        out.extend_from_slice(&geometry.page_size.to_le_bytes());
        out.extend_from_slice(&self.offset.to_le_bytes());
        out.extend_from_slice(&count.to_le_bytes());
        out.extend_from_slice(self.bytes);
        Ok(out)
    }
}

/// Checks that `len` bytes at `offset` are 1 to [`max_run_pages`] whole pages inside the cell;
/// returns the page count.
fn check_run(g: &CellGeometry, offset: u64, len: usize) -> Result<u32, PageError> {
    let ps = u64::from(g.page_size);
    let pages = len as u64 / ps;
    let bad = || PageError::OutOfBounds {
        cell: g.cell,
        offset,
        count: u32::try_from(pages).unwrap_or(u32::MAX),
        size: g.size,
    };
    let inside = offset
        .checked_add(len as u64)
        .is_some_and(|end| end <= g.size);
    if len == 0 || len as u64 % ps != 0 || offset % ps != 0 || !inside {
        return Err(bad());
    }
    u32::try_from(pages)
        .ok()
        .filter(|&n| n <= max_run_pages(g.page_size))
        .ok_or_else(bad)
}

fn le_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// Decodes the payload of a pages record for the cell `geometry` describes, checking that the
/// run is for that cell and page size and lies inside it.
pub fn decode_run<'a>(
    payload: &'a [u8],
    geometry: &CellGeometry,
) -> Result<PageRun<'a>, PageError> {
    let len = payload.len();
    let head = payload
        .get(..RUN_HEADER)
        .and_then(|h| <&[u8; RUN_HEADER]>::try_from(h).ok())
        .ok_or(PageError::Malformed {
            len,
            why: "shorter than its 20-byte header",
        })?;
    let offset = decode_run_header(head, len, geometry)?;
    Ok(PageRun {
        offset,
        bytes: &payload[RUN_HEADER..],
    })
}

/// Checks the 20-byte header of a pages record of `payload_len` bytes (for a reader that
/// places the pages itself, [`crate::container::RecordParts`]) against the cell `geometry`
/// describes, as [`decode_run`] does; returns the offset in the cell of its
/// `payload_len - RUN_HEADER` bytes of pages.
pub fn decode_run_header(
    head: &[u8; RUN_HEADER],
    payload_len: usize,
    geometry: &CellGeometry,
) -> Result<u64, PageError> {
    let len = payload_len;
    let (cell, page_size) = (le_u32(head, 0), le_u32(head, 4));
    if cell != geometry.cell || page_size != geometry.page_size {
        return Err(PageError::Geometry {
            cell,
            page_size,
            want_cell: geometry.cell,
            want_page_size: geometry.page_size,
        });
    }
    let mut off = [0u8; 8];
    off.copy_from_slice(&head[8..16]);
    let offset = u64::from_le_bytes(off);
    let count = le_u32(head, 16);
    let bytes = len.saturating_sub(RUN_HEADER);
    if len < RUN_HEADER || count == 0 || bytes as u64 != u64::from(count) * u64::from(page_size) {
        let why = "its page count does not match its length";
        return Err(PageError::Malformed { len, why });
    }
    check_run(geometry, offset, bytes)?;
    Ok(offset)
}

/// What [`write_pages`] wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PageStats {
    /// Pages written.
    pub pages: u64,
    /// Pages skipped.
    pub skipped: u64,
    /// Records written.
    pub records: u64,
}

/// Writes the pages of `memory`, which lies at `offset` in the cell, as pages records on `out`,
/// leaving out each page for which `skip(page offset in the cell, page bytes)` is true
/// (e.g. [`is_zero_page`], or "not dirty since the last round"). Consecutive kept pages form
/// one run, up to [`max_run_pages`].
pub fn write_pages<W: Write>(
    out: &mut Writer<W>,
    geometry: &CellGeometry,
    offset: u64,
    memory: &[u8],
    mut skip: impl FnMut(u64, &[u8]) -> bool,
) -> Result<PageStats, PageError> {
    let ps = geometry.page_size as usize;
    let in_cell = offset
        .checked_add(memory.len() as u64)
        .is_some_and(|end| end <= geometry.size);
    if memory.len() % ps != 0 || offset % ps as u64 != 0 || !in_cell {
        return Err(PageError::Range {
            cell: geometry.cell,
            offset,
            len: memory.len() as u64,
            page_size: geometry.page_size,
            size: geometry.size,
        });
    }
    let max_run = max_run_pages(geometry.page_size) as usize * ps;
    let mut stats = PageStats::default();
    let mut run_start: Option<usize> = None;
    for (i, page) in memory.chunks_exact(ps).enumerate() {
        let at = i * ps;
        if skip(offset + at as u64, page) {
            stats.skipped += 1;
            if let Some(start) = run_start.take() {
                emit(
                    out,
                    geometry,
                    offset + start as u64,
                    &memory[start..at],
                    &mut stats,
                )?;
            }
            continue;
        }
        stats.pages += 1;
        match run_start {
            Some(start) if at + ps - start > max_run => {
                emit(
                    out,
                    geometry,
                    offset + start as u64,
                    &memory[start..at],
                    &mut stats,
                )?;
                run_start = Some(at);
            }
            Some(_) => {}
            None => run_start = Some(at),
        }
    }
    if let Some(start) = run_start {
        emit(
            out,
            geometry,
            offset + start as u64,
            &memory[start..],
            &mut stats,
        )?;
    }
    Ok(stats)
}

fn emit<W: Write>(
    out: &mut Writer<W>,
    geometry: &CellGeometry,
    offset: u64,
    bytes: &[u8],
    stats: &mut PageStats,
) -> Result<(), PageError> {
    let payload = PageRun { offset, bytes }.to_payload(geometry)?;
    out.write_record(RecordKind::PAGES, &payload)
        .map_err(PageError::Write)?;
    stats.records += 1;
    Ok(())
}

/// Whether every byte of `page` is zero.
pub fn is_zero_page(page: &[u8]) -> bool {
    // 64-byte blocks as eight 64-bit words OR-ed together, with an early exit per block: as
    // fast as a byte fold on a real CPU (14–16 against 16–17 GiB/s here) and half again as fast
    // in the emulated test host (2.5 against 1.6 GiB/s), whose TCG runs the byte fold's
    // vector code slowly; a round 0 checks every resident page of the guest.
    let mut blocks = page.chunks_exact(64);
    blocks.all(|b| {
        let w = |i: usize| u64::from_ne_bytes(b[i * 8..i * 8 + 8].try_into().unwrap_or([1; 8]));
        (w(0) | w(1) | w(2) | w(3) | w(4) | w(5) | w(6) | w(7)) == 0
    }) && blocks.remainder().iter().all(|&b| b == 0)
}
