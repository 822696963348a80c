//! Guest RAM saved and loaded one cell at a time, as the page runs of `vmhost-persist`: a
//! snapshot's `memory-cell<N>` files (and later a migration's per-cell streams).
//!
//! Saving reads only pages that are resident ([`sys::resident_pages`], `mincore`), so a page
//! the guest never touched is left out without being faulted in; all-zero pages are left out
//! too. Loading writes each cell's pages with one worker per cell, pinned to the PUs the plan
//! gives that cell's node(s), after the memory was allocated and bound by
//! [`GuestMemory::new`](crate::GuestMemory::new): the pages land on the cell's node. A
//! snapshot's file is read straight into guest RAM ([`crate::load`]); a migration's runs
//! arrive in authenticated records and are copied in ([`load_run`]).
//!
//! Both go through vm-memory's `Bytes` (volatile copies), never through a `&[u8]` of guest
//! RAM, so a guest that runs meanwhile cannot break Rust's aliasing rules here.

use std::io::Write;
use std::time::Instant;

use serde::Serialize;
use vm_memory::{Bytes, GuestMemoryRegion, MemoryRegionAddress};
use vmhost_persist::container::{ContainerError, Writer};
use vmhost_persist::pages::{
    decode_run, max_run_pages, write_pages, CellGeometry, PageError, MAX_PAGE_SIZE,
};
use vmhost_plan::Plan;

use crate::backing::MappedRegion;
use crate::dirty::DIRTY_PAGE_BYTES;
use crate::load::{load_cell, CellSource};
use crate::sys;

/// Why a cell could not be saved or loaded.
#[derive(Debug, thiserror::Error)]
pub enum CellIoError {
    /// The memory has no such cell.
    #[error("guest cell {cell} does not exist in this VM's memory (it has cells {have:?})")]
    NoCell {
        /// The cell asked for.
        cell: u32,
        /// The cells there are.
        have: Vec<u32>,
    },
    /// `mincore` failed on a region.
    #[error("cell {cell}: cannot read which pages at GPA {gpa:#x} are resident (mincore)")]
    Residency {
        /// The cell.
        cell: u32,
        /// Guest-physical address of the range.
        gpa: u64,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Copying guest RAM failed.
    #[error("cell {cell}: cannot copy {len} bytes at offset {offset:#x} of the cell")]
    Copy {
        /// The cell.
        cell: u32,
        /// Offset in the cell.
        offset: u64,
        /// Bytes.
        len: u64,
        /// The cause.
        #[source]
        source: vm_memory::GuestMemoryError,
    },
    /// Encoding or decoding a page run failed.
    #[error("cell {cell}: bad page run")]
    Pages {
        /// The cell.
        cell: u32,
        /// The cause.
        #[source]
        source: PageError,
    },
    /// Reading a record of the cell's file failed.
    #[error("cell {cell}: cannot read its memory file")]
    Record {
        /// The cell.
        cell: u32,
        /// The cause.
        #[source]
        source: ContainerError,
    },
    /// A loader worker could not be started.
    #[error("cell {cell}: cannot start its loader thread")]
    Spawn {
        /// The cell.
        cell: u32,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A loader worker could not be pinned.
    #[error("cell {cell}: cannot pin its loader to host PUs {cpus:?}")]
    Pin {
        /// The cell.
        cell: u32,
        /// The PUs.
        cpus: Vec<u32>,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A loader worker panicked.
    #[error("cell {cell}: its loader thread panicked")]
    Panic {
        /// The cell.
        cell: u32,
    },
    /// A cell file was given twice, or none for a cell of the plan.
    #[error("the memory files do not match the plan's cells: {why}")]
    Files {
        /// What is wrong.
        why: String,
    },
}

/// What saving one cell did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct CellSaved {
    /// The cell.
    pub cell: u32,
    /// The page size of the encoding: 4 KiB, whatever the backing page size (the zero 4 KiB
    /// pages inside a resident hugepage are left out too).
    pub page_size_bytes: u32,
    /// Bytes of pages written.
    pub bytes: u64,
    /// Pages written.
    pub pages: u64,
    /// Pages left out: not resident, all zero, or skipped by the caller.
    pub skipped: u64,
    /// Seconds taken.
    pub seconds: f64,
    /// Of those, seconds copying guest memory out (and finding its zero pages).
    pub copy_seconds: f64,
}

/// What loading one cell did.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct CellLoaded {
    /// The cell.
    pub cell: u32,
    /// The host PUs its loader ran on (empty: not pinned).
    pub cpus: Vec<u32>,
    /// Bytes of pages written into guest RAM.
    pub bytes: u64,
    /// Page-run records read.
    pub records: u64,
    /// Seconds taken.
    pub seconds: f64,
}

/// The regions of `cell` in the order of their offset in the cell, and the cell's geometry.
pub(crate) fn cell_regions(
    regions: &[MappedRegion],
    cell: u32,
) -> Result<(Vec<&MappedRegion>, CellGeometry), CellIoError> {
    let mut mine: Vec<&MappedRegion> = regions.iter().filter(|r| r.layout.cell == cell).collect();
    if mine.is_empty() {
        let mut have: Vec<u32> = regions.iter().map(|r| r.layout.cell).collect();
        have.dedup();
        return Err(CellIoError::NoCell { cell, have });
    }
    mine.sort_by_key(|r| r.layout.file_offset);
    let size = mine
        .iter()
        .map(|r| r.layout.file_offset + r.layout.size_bytes)
        .max()
        .unwrap_or(0);
    let page = mine[0]
        .page_size_bytes
        .clamp(4096, u64::from(MAX_PAGE_SIZE));
    let page = u32::try_from(page).unwrap_or(MAX_PAGE_SIZE);
    let geometry = CellGeometry::new(cell, page, size)
        .map_err(|source| CellIoError::Pages { cell, source })?;
    Ok((mine, geometry))
}

/// Writes the resident, non-zero pages of guest cell `cell` of `regions` as page runs on `out`,
/// also leaving out each page for which `skip(offset in the cell, bytes)` is true. Pages that
/// are not resident are neither read nor faulted in.
///
/// Residency is known per backing page (a hugepage is resident whole), but the runs are in
/// 4 KiB pages ([`DIRTY_PAGE_BYTES`]) whatever the backing page size, and `skip` and the zero
/// test see 4 KiB pages: a resident 2 MiB page that holds a few KiB of data sends those, not
/// 2 MiB (an idle Linux guest on 2 MiB pages sent about 20 % zero bytes in its first round).
pub fn save_cell<W: Write>(
    regions: &[MappedRegion],
    cell: u32,
    out: &mut Writer<W>,
    skip: impl FnMut(u64, &[u8]) -> bool,
) -> Result<CellSaved, CellIoError> {
    save_cell_with(regions, cell, out, skip)
}

/// A pre-copy dirty round of live migration: writes the pages of cell `cell` that `dirty`
/// marks, all-zero ones included (a page the guest cleared since the last round must be sent:
/// the receiver already holds its old bytes). Pages `dirty` leaves clean are not read.
///
/// The runs are in 4 KiB pages ([`DIRTY_PAGE_BYTES`], the dirty log's unit) whatever the
/// backing page size: a guest that writes one word of a 2 MiB page sends 4 KiB, not 2 MiB.
/// [`load_run`] takes runs of any page size up to the cell's.
pub fn save_cell_dirty<W: Write>(
    regions: &[MappedRegion],
    cell: u32,
    out: &mut Writer<W>,
    dirty: &crate::dirty::DirtyBitmap,
) -> Result<CellSaved, CellIoError> {
    let start = Instant::now();
    let (mine, cell_geometry) = cell_regions(regions, cell)?;
    let page: u32 = 4096; // DIRTY_PAGE_BYTES
    let geometry = CellGeometry::new(cell, page, cell_geometry.size())
        .map_err(|source| CellIoError::Pages { cell, source })?;
    let chunk = u64::from(max_run_pages(page)) * DIRTY_PAGE_BYTES;
    let mut saved = CellSaved {
        cell,
        page_size_bytes: page,
        ..CellSaved::default()
    };
    let mut buf = vec![0u8; usize::try_from(chunk).unwrap_or(usize::MAX)];
    for run in dirty.runs() {
        let mut at = run.start;
        while at < run.end {
            let n = chunk.min(run.end - at);
            let bytes = &mut buf[..usize::try_from(n).unwrap_or(0)];
            let copy = Instant::now();
            read_run(&mine, cell, at, bytes)?;
            saved.copy_seconds += copy.elapsed().as_secs_f64();
            let stats = write_pages(out, &geometry, at, bytes, |_, _| false)
                .map_err(|source| CellIoError::Pages { cell, source })?;
            saved.pages += stats.pages;
            at += n;
        }
    }
    saved.bytes = saved.pages * DIRTY_PAGE_BYTES;
    saved.seconds = start.elapsed().as_secs_f64();
    Ok(saved)
}

/// [`save_cell`]: the resident non-zero pages `skip` does not refuse.
fn save_cell_with<W: Write>(
    regions: &[MappedRegion],
    cell: u32,
    out: &mut Writer<W>,
    mut skip: impl FnMut(u64, &[u8]) -> bool,
) -> Result<CellSaved, CellIoError> {
    let start = Instant::now();
    let (mine, backing) = cell_regions(regions, cell)?;
    // Residency per backing page; runs, zero test and `skip` per 4 KiB.
    let page = backing.page_size() as usize;
    let chunk = max_run_pages(backing.page_size()) as usize * page;
    let small: u32 = 4096; // DIRTY_PAGE_BYTES
    let geometry = CellGeometry::new(cell, small, backing.size())
        .map_err(|source| CellIoError::Pages { cell, source })?;
    let mut saved = CellSaved {
        cell,
        page_size_bytes: small,
        ..CellSaved::default()
    };
    let mut buf = vec![0u8; chunk];
    for r in mine {
        let mut at = 0usize;
        while at < r.len() {
            let n = chunk.min(r.len() - at);
            let base = r.layout.file_offset + at as u64;
            let copy = Instant::now();
            let resident = resident(r, at, n, page)?;
            // Per 4 KiB page of the chunk: left out (not resident, or all zero where it lies).
            let per = page / 4096;
            let mut left_out = vec![true; n / 4096];
            for (i, _) in resident.iter().enumerate().filter(|(_, res)| **res) {
                copy_nonzero(
                    r,
                    at + i * page,
                    &mut buf[i * page..(i + 1) * page],
                    &mut left_out[i * per..(i + 1) * per],
                )?;
            }
            saved.copy_seconds += copy.elapsed().as_secs_f64();
            let stats = write_pages(out, &geometry, base, &buf[..n], |off, p| {
                let i = usize::try_from((off - base) / u64::from(small)).unwrap_or(usize::MAX);
                left_out.get(i).copied().unwrap_or(true) || skip(off, p)
            })
            .map_err(|source| CellIoError::Pages { cell, source })?;
            saved.pages += stats.pages;
            saved.skipped += stats.skipped;
            at += n;
        }
    }
    saved.bytes = saved.pages * u64::from(small);
    saved.seconds = start.elapsed().as_secs_f64();
    Ok(saved)
}

/// Copies the 4 KiB pages of `dst.len()` bytes at `at` in region `r` that are not all zero into
/// `dst`, testing each where it lies ([`sys::is_zero_volatile`]): a zero page is neither
/// copied nor sent, so an idle guest's zero pages are read once instead of copied out and read
/// again. `left_out[k]` is set for each zero page and cleared for each copied one. In a live
/// migration's first round a page the guest writes after its test is in the dirty log, and is
/// sent in the next round, like any page written after it was copied.
fn copy_nonzero(
    r: &MappedRegion,
    at: usize,
    dst: &mut [u8],
    left_out: &mut [bool],
) -> Result<(), CellIoError> {
    let small: usize = 4096; // DIRTY_PAGE_BYTES
    let len = dst.len();
    let copy_error = |source| CellIoError::Copy {
        cell: r.layout.cell,
        offset: r.layout.file_offset + at as u64,
        len: len as u64,
        source,
    };
    let whole = r
        .region
        .get_slice(MemoryRegionAddress(at as u64), len)
        .map_err(copy_error)?;
    for (k, (page, out)) in dst.chunks_exact_mut(small).zip(left_out).enumerate() {
        let slice = whole
            .subslice(k * small, small)
            .map_err(|e| copy_error(e.into()))?;
        *out = sys::is_zero_volatile(&slice);
        if !*out {
            slice.copy_to(page);
        }
    }
    Ok(())
}

/// Which pages of `page` bytes of `len` bytes at `at` in region `r` are resident.
fn resident(
    r: &MappedRegion,
    at: usize,
    len: usize,
    page: usize,
) -> Result<Vec<bool>, CellIoError> {
    sys::resident_pages(r.host_addr(), r.len(), at, len, page).map_err(|source| {
        CellIoError::Residency {
            cell: r.layout.cell,
            gpa: r.layout.gpa + at as u64,
            source,
        }
    })
}

/// Writes one page run (the payload of a [`RecordKind::PAGES`] record, as a migration stream
/// carries it) into cell `cell` of `regions`. Returns the bytes written. The run's pages may
/// be smaller than the cell's (a dirty round sends 4 KiB pages of a hugepage-backed cell); a
/// page size the cell's is not a multiple of is refused.
pub fn load_run(regions: &[MappedRegion], cell: u32, payload: &[u8]) -> Result<u64, CellIoError> {
    let (mine, geometry) = cell_regions(regions, cell)?;
    let geometry = run_geometry(cell, &geometry, payload)?;
    let run =
        decode_run(payload, &geometry).map_err(|source| CellIoError::Pages { cell, source })?;
    write_run(&mine, cell, run.offset, run.bytes)?;
    Ok(run.bytes.len() as u64)
}

/// The geometry a run's payload is decoded with: the cell's, or the run's smaller page size
/// when the cell's is a multiple of it (4 KiB runs of a hugepage-backed cell). Any other page
/// size keeps the cell's geometry, which then refuses the run naming both sizes.
pub(crate) fn run_geometry(
    cell: u32,
    geometry: &CellGeometry,
    payload: &[u8],
) -> Result<CellGeometry, CellIoError> {
    let run_page = payload
        .get(4..8)
        .and_then(|b| b.try_into().ok())
        .map(u32::from_le_bytes);
    match run_page.filter(|&ps| ps > 0 && ps < geometry.page_size()) {
        Some(ps) if geometry.page_size() % ps == 0 => CellGeometry::new(cell, ps, geometry.size())
            .map_err(|source| CellIoError::Pages { cell, source }),
        _ => Ok(*geometry),
    }
}

/// The parts of the cell's bytes `offset..offset + len` each region holds: the region, the
/// range within the bytes and the address in the region.
pub(crate) fn pieces<'a>(
    regions: &'a [&'a MappedRegion],
    offset: u64,
    len: usize,
) -> impl Iterator<
    Item = (
        &'a MappedRegion,
        std::ops::Range<usize>,
        MemoryRegionAddress,
    ),
> {
    let end = offset + len as u64;
    regions.iter().filter_map(move |r| {
        let lo = r.layout.file_offset;
        let hi = lo + r.layout.size_bytes;
        let (from, to) = (offset.max(lo), end.min(hi));
        // Both differences are at most len, a usize.
        let idx = |v: u64| usize::try_from(v - offset).unwrap_or(len);
        (from < to).then(|| (*r, idx(from)..idx(to), MemoryRegionAddress(from - lo)))
    })
}

/// Reads `bytes.len()` bytes at `offset` of the cell from the regions that hold it.
fn read_run(
    regions: &[&MappedRegion],
    cell: u32,
    offset: u64,
    bytes: &mut [u8],
) -> Result<(), CellIoError> {
    for (r, range, at) in pieces(regions, offset, bytes.len()) {
        let len = range.len() as u64;
        r.region
            .read_slice(&mut bytes[range], at)
            .map_err(|source| CellIoError::Copy {
                cell,
                offset: r.layout.file_offset + at.0,
                len,
                source,
            })?;
    }
    Ok(())
}

/// Writes `bytes` at `offset` of the cell into the regions that hold it.
fn write_run(
    regions: &[&MappedRegion],
    cell: u32,
    offset: u64,
    bytes: &[u8],
) -> Result<(), CellIoError> {
    for (r, range, at) in pieces(regions, offset, bytes.len()) {
        let len = range.len() as u64;
        r.region
            .write_slice(&bytes[range], at)
            .map_err(|source| CellIoError::Copy {
                cell,
                offset: r.layout.file_offset + at.0,
                len,
                source,
            })?;
    }
    Ok(())
}

/// The host PUs a cell's loader runs on: those of every node the plan binds the cell to.
pub fn loader_cpus(plan: &Plan, cell: u32) -> Vec<u32> {
    let mut cpus: Vec<u32> = plan
        .guest_cells
        .iter()
        .filter(|c| c.cell == cell)
        .flat_map(|c| {
            c.memory_parts()
                .into_iter()
                .flat_map(|p| p.prefault_cpus.to_vec())
        })
        .collect();
    cpus.sort_unstable();
    cpus.dedup();
    cpus
}

/// Loads every cell of `plan` from its file in `files` (`(cell, reader)`, one per cell), each
/// by a worker (`load-c<cell>`) pinned to the PUs of the cell's node(s); cells load
/// concurrently. The first failure is returned after every worker has ended.
pub fn load_cells<R: CellSource>(
    regions: &[MappedRegion],
    plan: &Plan,
    files: Vec<(u32, R)>,
) -> Result<Vec<CellLoaded>, CellIoError> {
    check_files(plan, &files)?;
    std::thread::scope(|scope| {
        let mut handles = Vec::new();
        for (cell, input) in files {
            let cpus = loader_cpus(plan, cell);
            let spawned = std::thread::Builder::new()
                .name(format!("load-c{cell}"))
                .spawn_scoped(scope, move || load_worker(regions, cell, cpus, input));
            match spawned {
                Ok(h) => handles.push((cell, h)),
                Err(source) => return Err(CellIoError::Spawn { cell, source }),
            }
        }
        let mut out = Vec::new();
        let mut first_err = None;
        for (cell, h) in handles {
            match h.join() {
                Ok(Ok(done)) => out.push(done),
                Ok(Err(e)) => {
                    first_err.get_or_insert(e);
                }
                Err(_) => {
                    first_err.get_or_insert(CellIoError::Panic { cell });
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(out),
        }
    })
}

fn load_worker<R: CellSource>(
    regions: &[MappedRegion],
    cell: u32,
    cpus: Vec<u32>,
    input: R,
) -> Result<CellLoaded, CellIoError> {
    let start = Instant::now();
    if !cpus.is_empty() {
        sys::pin_current_thread(&cpus).map_err(|source| CellIoError::Pin {
            cell,
            cpus: cpus.clone(),
            source,
        })?;
    }
    vmhost_seccomp::install_current_or_abort(vmhost_seccomp::ThreadKind::Loader);
    let (bytes, records) = load_cell(regions, cell, input)?;
    Ok(CellLoaded {
        cell,
        cpus,
        bytes,
        records,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// One file per cell of the plan, none twice, none extra.
fn check_files<R>(plan: &Plan, files: &[(u32, R)]) -> Result<(), CellIoError> {
    let mut have: Vec<u32> = files.iter().map(|(c, _)| *c).collect();
    have.sort_unstable();
    let mut want: Vec<u32> = plan.guest_cells.iter().map(|c| c.cell).collect();
    want.sort_unstable();
    if have != want {
        let why = format!("the files are for cells {have:?}, the plan has cells {want:?}");
        return Err(CellIoError::Files { why });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::plan;
    use crate::{GuestMemory, MemoryOptions, PrefaultTiming};
    use vm_memory::GuestAddress;
    use vmhost_persist::container::{Reader, RecordKind};
    use vmhost_plan::Backing;

    const MIB: u64 = 1 << 20;

    /// Two cells of 8 MiB on node 0, anonymous, not prefaulted: only what a test writes is
    /// resident.
    fn memory(name: &str) -> (Plan, GuestMemory) {
        let mut p = plan(
            name,
            &[(Some(0), 8 * MIB), (Some(0), 8 * MIB)],
            Backing::Anonymous,
        );
        for c in &mut p.guest_cells {
            c.prefault_cpus = vmhost_topology::affinity::current_thread().unwrap();
        }
        let opts = MemoryOptions {
            timing: PrefaultTiming::Background,
            ..MemoryOptions::default()
        };
        let mem = GuestMemory::new(&p, &opts).unwrap();
        (p, mem)
    }

    fn resident_count(mem: &GuestMemory, cell: u32) -> usize {
        mem.regions()
            .iter()
            .filter(|r| r.layout.cell == cell)
            .map(|r| {
                let v = sys::resident_pages(r.host_addr(), r.len(), 0, r.len(), 4096).unwrap();
                v.iter().filter(|x| **x).count()
            })
            .sum()
    }

    #[test]
    fn save_leaves_out_untouched_and_zero_pages_and_load_puts_the_rest_back() {
        let (p, mem) = memory("cells-save");
        let cell1 = mem.layout().cell_regions(1).next().unwrap().gpa;
        let g = mem.memory();
        g.write_obj(0x1122_3344_u32, GuestAddress(0x3000)).unwrap();
        g.write_obj(0x5566_u16, GuestAddress(cell1 + 0x7000 + 12))
            .unwrap();
        // Resident but all zero.
        g.write_obj(0u64, GuestAddress(0x9000)).unwrap();
        assert_eq!(resident_count(&mem, 0), 2);

        let mut files = Vec::new();
        for cell in 0..2 {
            let mut w = Writer::new(Vec::new(), "test").unwrap();
            let saved = mem.save_cell(cell, &mut w, |_, _| false).unwrap();
            assert_eq!((saved.pages, saved.bytes), (1, 4096), "cell {cell}");
            assert_eq!(saved.skipped, 2047);
            files.push((cell, w.finish().unwrap()));
        }
        // Saving faulted nothing in.
        assert_eq!(resident_count(&mem, 0), 2);
        assert_eq!(resident_count(&mem, 1), 1);

        let (_, fresh) = memory("cells-load");
        let loaded = fresh
            .load_cells(&p, files.iter().map(|(c, b)| (*c, &b[..])).collect())
            .unwrap();
        assert_eq!(loaded.iter().map(|l| l.bytes).sum::<u64>(), 8192);
        let f = fresh.memory();
        assert_eq!(
            f.read_obj::<u32>(GuestAddress(0x3000)).unwrap(),
            0x1122_3344
        );
        assert_eq!(
            f.read_obj::<u16>(GuestAddress(cell1 + 0x7000 + 12))
                .unwrap(),
            0x5566
        );
        assert_eq!(resident_count(&fresh, 0), 1);
        let cpus = vmhost_topology::affinity::current_thread().unwrap();
        assert!(loaded.iter().all(|l| l.cpus == cpus));
    }

    #[test]
    fn the_caller_skips_pages_and_a_file_for_a_missing_cell_is_refused() {
        let (p, mem) = memory("cells-skip");
        mem.memory().write_obj(7u8, GuestAddress(0)).unwrap();
        mem.memory().write_obj(8u8, GuestAddress(0x1000)).unwrap();
        let mut w = Writer::new(Vec::new(), "test").unwrap();
        let saved = mem.save_cell(0, &mut w, |off, _| off == 0).unwrap();
        assert_eq!(saved.pages, 1);
        assert!(matches!(
            mem.save_cell(5, &mut w, |_, _| false),
            Err(CellIoError::NoCell { cell: 5, .. })
        ));
        let bytes = w.finish().unwrap();
        let err = mem.load_cells(&p, vec![(0, &bytes[..])]).unwrap_err();
        assert!(
            err.to_string()
                .contains("cells [0], the plan has cells [0, 1]"),
            "{err}"
        );
    }

    #[test]
    fn a_run_for_another_cell_is_refused() {
        let (p, mem) = memory("cells-wrong");
        mem.memory().write_obj(7u8, GuestAddress(0)).unwrap();
        let mut w = Writer::new(Vec::new(), "test").unwrap();
        mem.save_cell(0, &mut w, |_, _| false).unwrap();
        let bytes = w.finish().unwrap();
        let empty = Writer::new(Vec::new(), "test").unwrap().finish().unwrap();
        let err = mem
            .load_cells(&p, vec![(1, &bytes[..]), (0, &empty[..])])
            .unwrap_err();
        assert!(matches!(err, CellIoError::Pages { cell: 1, .. }), "{err:?}");
    }

    /// Reads the page-run records of a container and writes each with [`load_run`], as a
    /// migration target does.
    fn apply_runs(mem: &GuestMemory, cell: u32, bytes: &[u8]) -> u64 {
        let mut r = Reader::new(bytes, &[RecordKind::PAGES]).unwrap();
        let mut n = 0;
        while let Some(rec) = r.next_record().unwrap() {
            n += load_run(mem.regions(), cell, &rec.payload).unwrap();
        }
        n
    }

    #[test]
    fn a_dirty_round_sends_only_dirty_pages_zeroed_ones_included() {
        let (_, src) = memory("cells-dirty-src");
        let (_, dst) = memory("cells-dirty-dst");
        let g = src.memory();
        g.write_obj(0xaaaa_u32, GuestAddress(0x1000)).unwrap();
        g.write_obj(0xbbbb_u32, GuestAddress(0x2000)).unwrap();
        // Round 0: every resident non-zero page.
        let mut w = Writer::new(Vec::new(), "test").unwrap();
        src.save_cell(0, &mut w, |_, _| false).unwrap();
        assert_eq!(apply_runs(&dst, 0, &w.finish().unwrap()), 8192);
        // The guest clears one page and writes another; a third stays clean.
        g.write_obj(0u32, GuestAddress(0x1000)).unwrap();
        g.write_obj(0xcccc_u32, GuestAddress(0x5000)).unwrap();
        let mut dirty = crate::DirtyBitmap::new(0, 8 * MIB);
        dirty.mark_page(1);
        dirty.mark_page(5);
        let mut w = Writer::new(Vec::new(), "test").unwrap();
        let saved = src.save_cell_dirty(0, &mut w, &dirty).unwrap();
        assert_eq!(saved.pages, 2, "the zeroed page is sent too");
        assert_eq!(apply_runs(&dst, 0, &w.finish().unwrap()), 8192);
        let d = dst.memory();
        assert_eq!(d.read_obj::<u32>(GuestAddress(0x1000)).unwrap(), 0);
        assert_eq!(d.read_obj::<u32>(GuestAddress(0x2000)).unwrap(), 0xbbbb);
        assert_eq!(d.read_obj::<u32>(GuestAddress(0x5000)).unwrap(), 0xcccc);
    }

    /// A file read through a buffer smaller than a record's head (so a run starts in the
    /// buffer and goes on straight from the file) puts back every byte of a 3 MiB run; a
    /// byte damaged in the middle of the run is refused by the record's checksum.
    #[test]
    fn a_file_loaded_straight_into_guest_ram_matches_and_a_damaged_byte_is_refused() {
        use std::io::{BufReader, Seek, SeekFrom};
        let (p, mem) = memory("cells-direct-src");
        let pattern: Vec<u8> = (0..3u32 << 20)
            .map(|i| (i % 251).to_le_bytes()[0] | 1)
            .collect();
        mem.memory()
            .write_slice(&pattern, GuestAddress(0x10000))
            .unwrap();
        let dir = std::env::temp_dir().join(format!("cells-direct-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut files = Vec::new();
        for cell in 0..2 {
            let mut w = Writer::new(Vec::new(), "test").unwrap();
            mem.save_cell(cell, &mut w, |_, _| false).unwrap();
            let path = dir.join(format!("cell{cell}"));
            std::fs::write(&path, w.finish().unwrap()).unwrap();
            files.push(path);
        }
        let load = |into: &GuestMemory| {
            let open = |f| BufReader::with_capacity(23, std::fs::File::open(f).unwrap());
            into.load_cells(
                &p,
                files
                    .iter()
                    .zip(0u32..)
                    .map(|(f, c)| (c, open(f)))
                    .collect(),
            )
        };
        let (_, fresh) = memory("cells-direct-dst");
        let loaded = load(&fresh).unwrap();
        assert_eq!(loaded.iter().map(|l| l.bytes).sum::<u64>(), 3 * MIB);
        let mut back = vec![0u8; pattern.len()];
        fresh
            .memory()
            .read_slice(&mut back, GuestAddress(0x10000))
            .unwrap();
        assert!(back == pattern, "the loaded run differs from the saved one");

        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(&files[0])
            .unwrap();
        f.seek(SeekFrom::Start(2 * MIB)).unwrap();
        std::io::Write::write_all(&mut f, &[0]).unwrap();
        drop(f);
        let (_, fresh) = memory("cells-direct-bad");
        let err = load(&fresh).unwrap_err();
        assert!(
            matches!(
                &err,
                CellIoError::Record {
                    cell: 0,
                    source: ContainerError::RecordChecksum { .. }
                }
            ),
            "{err:?}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
