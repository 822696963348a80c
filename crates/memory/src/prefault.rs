//! Prefaulting: the first touch of guest RAM, in parallel, on the right node.
//!
//! This module owns the workers that fault guest memory in before the guest runs. Each cell's
//! regions are cut into chunks; the cell's workers are pinned one per CPU of the cell's host
//! node (the plan's `prefault_cpus`), so the first touch happens on that node, and take chunks
//! from a shared counter. A chunk is populated with `MADV_POPULATE_WRITE` (Linux 5.14+), or, on
//! kernels without it, with an atomic no-op read-modify-write of one byte per page (the guest
//! may already run and write: see [`touch`]). Cells are prefaulted concurrently. A progress bar is drawn on stderr when it is a terminal and the
//! memory is large; a hook can observe progress otherwise.

use std::fmt;
use std::io::{self, IsTerminal};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use crate::backing::MappedRegion;
use crate::sys;

/// Why prefaulting failed.
#[derive(Debug, thiserror::Error)]
pub enum PrefaultError {
    /// A worker thread could not be started.
    #[error("cannot start a prefault worker for guest cell {cell}")]
    Spawn {
        /// Cell number.
        cell: u32,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// A worker could not be pinned to its CPU.
    #[error("cannot pin the prefault worker of guest cell {cell} to host CPU {cpu}")]
    Pin {
        /// Cell number.
        cell: u32,
        /// The CPU.
        cpu: u32,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// `MADV_POPULATE_WRITE` failed on a chunk (`ENOMEM`/`EFAULT`: the node ran out of pages).
    #[error("cannot populate guest cell {cell} at GPA {gpa:#x} (+{len:#x} bytes)")]
    Populate {
        /// Cell number.
        cell: u32,
        /// Guest-physical address of the chunk.
        gpa: u64,
        /// Chunk length.
        len: u64,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// A worker panicked.
    #[error("a prefault worker of guest cell {cell} panicked")]
    Panic {
        /// Cell number.
        cell: u32,
    },
    /// [`PrefaultOptions::cancel`] was set (a stop signal): the workers stopped after their
    /// chunk in progress.
    #[error("prefaulting was cancelled after {done} of {total} bytes")]
    Cancelled {
        /// Bytes faulted in.
        done: u64,
        /// Bytes in all.
        total: u64,
    },
}

/// How pages are faulted in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PrefaultMethod {
    /// `MADV_POPULATE_WRITE` where the kernel has it, else the touch loop.
    #[default]
    Auto,
    /// `MADV_POPULATE_WRITE` only.
    PopulateWrite,
    /// An atomic no-op read-modify-write of one byte per page (safe while the guest runs).
    Touch,
}

impl fmt::Display for PrefaultMethod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PrefaultMethod::Auto => "auto",
            PrefaultMethod::PopulateWrite => "MADV_POPULATE_WRITE",
            PrefaultMethod::Touch => "touch loop",
        })
    }
}

/// Whether to draw a progress bar.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Progress {
    /// On stderr when it is a terminal and the memory is at least the threshold.
    #[default]
    Auto,
    /// Never.
    Hidden,
}

/// Called with `(bytes done, bytes in all)` after each chunk, from the worker threads.
pub type ProgressHook = Arc<dyn Fn(u64, u64) + Send + Sync>;

/// Prefault settings.
#[derive(Clone)]
pub struct PrefaultOptions {
    /// How pages are faulted in.
    pub method: PrefaultMethod,
    /// Workers per cell; `None`: one per CPU in the cell's `prefault_cpus` (or per CPU this
    /// process may use, unpinned, when the plan names none).
    pub threads_per_cell: Option<usize>,
    /// Bytes a worker takes at a time (rounded up to whole pages).
    pub chunk_bytes: u64,
    /// Progress bar policy.
    pub progress: Progress,
    /// Memory size from which [`Progress::Auto`] draws a bar.
    pub progress_threshold_bytes: u64,
    /// Progress hook.
    pub on_progress: Option<ProgressHook>,
    /// Set from any thread to stop the workers after their chunk in progress (a stop signal
    /// during a long prefault); the prefault then fails with [`PrefaultError::Cancelled`].
    pub cancel: Option<Arc<AtomicBool>>,
}

impl Default for PrefaultOptions {
    fn default() -> Self {
        PrefaultOptions {
            method: PrefaultMethod::Auto,
            threads_per_cell: None,
            chunk_bytes: 64 << 20,
            progress: Progress::Auto,
            progress_threshold_bytes: 4 << 30,
            on_progress: None,
            cancel: None,
        }
    }
}

impl fmt::Debug for PrefaultOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PrefaultOptions")
            .field("method", &self.method)
            .field("threads_per_cell", &self.threads_per_cell)
            .field("chunk_bytes", &self.chunk_bytes)
            .field("progress", &self.progress)
            .field("progress_threshold_bytes", &self.progress_threshold_bytes)
            .field("on_progress", &self.on_progress.as_ref().map(|_| "<hook>"))
            .field("cancel", &self.cancel)
            .finish()
    }
}

/// What was done for one cell.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CellPrefault {
    /// Cell number.
    pub cell: u32,
    /// Workers used.
    pub threads: usize,
    /// CPUs the workers were pinned to (one each, round robin); empty: unpinned.
    pub cpus: Vec<u32>,
    /// Bytes faulted in.
    pub bytes: u64,
}

/// What prefaulting did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PrefaultStats {
    /// The method that actually ran (`populate_write` or `touch`).
    pub method: PrefaultMethod,
    /// Per cell, or per host-node part of a cell bound to several nodes.
    pub cells: Vec<CellPrefault>,
}

/// A cell (or one host-node part of a cell) to prefault: its mapped regions and the CPUs of
/// its node.
#[derive(Debug, Clone, Copy)]
pub struct CellTarget<'a> {
    /// Cell number.
    pub cell: u32,
    /// The cell's mapped regions.
    pub regions: &'a [MappedRegion],
    /// CPUs to pin workers to; empty: do not pin.
    pub cpus: &'a [u32],
}

/// One piece of work: `len` bytes at `offset` in `regions[region]`.
#[derive(Debug, Clone, Copy)]
struct Chunk {
    region: usize,
    offset: usize,
    len: usize,
}

fn chunks_of(regions: &[MappedRegion], chunk_bytes: u64) -> Vec<Chunk> {
    let mut chunks = Vec::new();
    for (i, r) in regions.iter().enumerate() {
        let page = r.page_size_bytes.max(1);
        let step = chunk_bytes.max(1).div_ceil(page).saturating_mul(page);
        let step = usize::try_from(step).unwrap_or(usize::MAX);
        let mut offset = 0;
        while offset < r.len() {
            let len = step.min(r.len() - offset);
            chunks.push(Chunk {
                region: i,
                offset,
                len,
            });
            offset += len;
        }
    }
    chunks
}

/// State shared by all workers of one prefault run.
struct Shared {
    stop: AtomicBool,
    cancel: Option<Arc<AtomicBool>>,
    use_touch: AtomicBool,
    done: AtomicU64,
    total: u64,
    bar: Option<ProgressBar>,
    hook: Option<ProgressHook>,
    method: PrefaultMethod,
    first_error: Mutex<Option<PrefaultError>>,
}

impl Shared {
    /// The state of a run over `total` bytes: nothing done, no failure, and the progress bar
    /// and hook `opts` asks for.
    fn new(total: u64, opts: &PrefaultOptions) -> Self {
        Shared {
            stop: AtomicBool::new(false),
            cancel: opts.cancel.clone(),
            use_touch: AtomicBool::new(false),
            done: AtomicU64::new(0),
            total,
            bar: progress_bar(total, opts),
            hook: opts.on_progress.clone(),
            method: opts.method,
            first_error: Mutex::new(None),
        }
    }

    /// True when the workers must stop: a failure, or a cancel (recorded as the failure).
    fn stopping(&self) -> bool {
        if self.stop.load(Ordering::Relaxed) {
            return true;
        }
        if self
            .cancel
            .as_ref()
            .is_some_and(|c| c.load(Ordering::SeqCst))
        {
            self.fail(PrefaultError::Cancelled {
                done: self.done.load(Ordering::Relaxed),
                total: self.total,
            });
            return true;
        }
        false
    }

    fn fail(&self, err: PrefaultError) {
        self.stop.store(true, Ordering::SeqCst);
        if let Ok(mut slot) = self.first_error.lock() {
            slot.get_or_insert(err);
        }
    }

    fn advance(&self, bytes: u64) {
        let done = self.done.fetch_add(bytes, Ordering::Relaxed) + bytes;
        if let Some(bar) = &self.bar {
            bar.inc(bytes);
        }
        if let Some(hook) = &self.hook {
            hook(done, self.total);
        }
    }
}

/// Faults in every page of `[addr, addr + len)` for write with an atomic no-op
/// read-modify-write (`lock or byte [p], 0`) on its first byte. With `--prefault background`
/// the guest runs meanwhile: a plain read and write-back would put back a stale byte when a
/// guest store lands between the two; the atomic one never stores anything but the byte's
/// current value.
fn touch(addr: *mut u8, len: usize, page: usize) {
    let mut off = 0;
    while off < len {
        // SAFETY: `addr..addr + len` lies inside a live MAP_SHARED, PROT_READ|PROT_WRITE
        // mapping owned by a MappedRegion that the caller borrows for the whole prefault, so
        // `p` is valid for reads and writes for that time; a u8 has alignment 1. Chunks given
        // to workers are disjoint; the only other access is the guest's (outside this
        // process's memory model), which the atomic read-modify-write cannot undo.
        let byte = unsafe { AtomicU8::from_ptr(addr.add(off)) };
        // A compare-exchange of the value with itself: a locked write that leaves the byte as
        // it is. Not `fetch_or(0)`: LLVM turns an idempotent read-modify-write into a plain
        // (fenced) load, which faults nothing in writable — the optimised build touched no page
        // at all (`every_method_faults_every_page_in`).
        let mut v = byte.load(Ordering::Relaxed);
        while let Err(now) = byte.compare_exchange_weak(v, v, Ordering::Relaxed, Ordering::Relaxed)
        {
            v = now;
        }
        off += page;
    }
}

fn populate(shared: &Shared, region: &MappedRegion, chunk: Chunk) -> Result<(), PrefaultError> {
    // SAFETY: chunk.offset < region.len(), so the pointer stays inside the mapping; it is only
    // handed to madvise or the touch loop, never turned into a reference.
    let addr = unsafe { region.host_addr().add(chunk.offset) };
    let page = usize::try_from(region.page_size_bytes)
        .unwrap_or(4096)
        .max(1);
    if shared.method == PrefaultMethod::Touch || shared.use_touch.load(Ordering::Relaxed) {
        touch(addr, chunk.len, page);
        return Ok(());
    }
    match sys::madvise(addr, chunk.len, sys::Advice::PopulateWrite) {
        Ok(()) => Ok(()),
        Err(e)
            if shared.method == PrefaultMethod::Auto && e.raw_os_error() == Some(libc::EINVAL) =>
        {
            tracing::debug!("MADV_POPULATE_WRITE unavailable, touching pages instead");
            shared.use_touch.store(true, Ordering::Relaxed);
            touch(addr, chunk.len, page);
            Ok(())
        }
        Err(source) => Err(PrefaultError::Populate {
            cell: region.layout.cell,
            gpa: region.layout.gpa + chunk.offset as u64,
            len: chunk.len as u64,
            source,
        }),
    }
}

fn worker(
    shared: &Shared,
    target: &CellTarget<'_>,
    chunks: &[Chunk],
    next: &AtomicUsize,
    cpu: Option<u32>,
) {
    if let Some(cpu) = cpu {
        if let Err(source) = sys::pin_current_thread(&[cpu]) {
            shared.fail(PrefaultError::Pin {
                cell: target.cell,
                cpu,
                source,
            });
            return;
        }
    }
    vmhost_seccomp::install_current_or_abort(vmhost_seccomp::ThreadKind::Prefault);
    while !shared.stopping() {
        let Some(chunk) = chunks.get(next.fetch_add(1, Ordering::Relaxed)) else {
            return;
        };
        if let Err(e) = populate(shared, &target.regions[chunk.region], *chunk) {
            shared.fail(e);
            return;
        }
        shared.advance(chunk.len as u64);
    }
}

fn progress_bar(total: u64, opts: &PrefaultOptions) -> Option<ProgressBar> {
    if opts.progress != Progress::Auto
        || total < opts.progress_threshold_bytes
        || !io::stderr().is_terminal()
    {
        return None;
    }
    let bar = ProgressBar::new(total).with_message("prefaulting guest memory");
    if let Ok(style) = ProgressStyle::with_template(
        "{msg} [{bar:40}] {binary_bytes}/{binary_total_bytes} ({binary_bytes_per_sec}, {eta})",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    Some(bar)
}

fn default_threads(cpus: &[u32]) -> usize {
    if cpus.is_empty() {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        cpus.len()
    }
}

/// Faults in every page of every cell, cells concurrently, workers pinned to the cells' CPUs.
///
/// On error the first failure is returned after all workers have stopped; the memory stays
/// mapped (and partly faulted in) until the caller drops it.
pub fn prefault(
    targets: &[CellTarget<'_>],
    opts: &PrefaultOptions,
) -> Result<PrefaultStats, PrefaultError> {
    let plans = plan_workers(targets, opts);
    let total: u64 = targets
        .iter()
        .flat_map(|t| t.regions)
        .map(|r| r.len() as u64)
        .sum();
    let shared = Shared::new(total, opts);
    run_workers(&shared, targets, &plans);
    if let Some(bar) = &shared.bar {
        bar.finish_and_clear();
    }
    if let Some(err) = shared.first_error.into_inner().ok().flatten() {
        return Err(err);
    }
    let method = match opts.method {
        PrefaultMethod::Auto if shared.use_touch.load(Ordering::Relaxed) => PrefaultMethod::Touch,
        PrefaultMethod::Auto => PrefaultMethod::PopulateWrite,
        m => m,
    };
    let cells = cell_stats(targets, &plans);
    Ok(PrefaultStats { method, cells })
}

/// Each target's chunks and the number of its workers: `threads_per_cell`, else one per CPU
/// of the target; at least one, and no more than it has chunks.
fn plan_workers(targets: &[CellTarget<'_>], opts: &PrefaultOptions) -> Vec<(Vec<Chunk>, usize)> {
    targets
        .iter()
        .map(|t| {
            let chunks = chunks_of(t.regions, opts.chunk_bytes);
            let threads = opts
                .threads_per_cell
                .unwrap_or_else(|| default_threads(t.cpus));
            let threads = threads.clamp(1, chunks.len().max(1));
            (chunks, threads)
        })
        .collect()
}

/// The CPU worker `i` of a target is pinned to: its CPUs round robin; `None` when it has none.
fn worker_cpu(cpus: &[u32], i: usize) -> Option<u32> {
    (!cpus.is_empty()).then(|| cpus[i % cpus.len()])
}

/// Starts every target's workers (`plans`, from [`plan_workers`]) and joins them all; a worker
/// that cannot start or that panics fails the run ([`Shared::fail`]).
fn run_workers(shared: &Shared, targets: &[CellTarget<'_>], plans: &[(Vec<Chunk>, usize)]) {
    let counters: Vec<AtomicUsize> = targets.iter().map(|_| AtomicUsize::new(0)).collect();
    std::thread::scope(|scope| {
        let mut handles = Vec::new();
        for ((target, (chunks, threads)), next) in targets.iter().zip(plans).zip(&counters) {
            for i in 0..*threads {
                let cpu = worker_cpu(target.cpus, i);
                let spawned = std::thread::Builder::new()
                    .name(format!("prefault-c{}-{i}", target.cell))
                    .spawn_scoped(scope, move || worker(shared, target, chunks, next, cpu));
                match spawned {
                    Ok(h) => handles.push((target.cell, h)),
                    Err(source) => shared.fail(PrefaultError::Spawn {
                        cell: target.cell,
                        source,
                    }),
                }
            }
        }
        for (cell, h) in handles {
            if h.join().is_err() {
                shared.fail(PrefaultError::Panic { cell });
            }
        }
    });
}

/// What was done for each target: its workers, their CPUs and its bytes.
fn cell_stats(targets: &[CellTarget<'_>], plans: &[(Vec<Chunk>, usize)]) -> Vec<CellPrefault> {
    targets
        .iter()
        .zip(plans)
        .map(|(t, (_, threads))| CellPrefault {
            cell: t.cell,
            threads: *threads,
            cpus: (0..*threads)
                .filter_map(|i| worker_cpu(t.cpus, i))
                .collect(),
            bytes: t.regions.iter().map(|r| r.len() as u64).sum(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backing::{bind_region, create_file, map_region};
    use crate::layout::LayoutRegion;
    use vmhost_plan::Backing;

    fn anon_region(cell: u32, size: u64) -> MappedRegion {
        let file = Arc::new(create_file("prefault-unit", cell, size, &Backing::Anonymous).unwrap());
        let layout = LayoutRegion {
            cell,
            host_node: Some(0),
            gpa: 0,
            size_bytes: size,
            file_offset: 0,
        };
        let m = map_region(&file, layout, &Backing::Anonymous).unwrap();
        bind_region(&m).unwrap();
        m
    }

    fn present_pages(r: &MappedRegion) -> usize {
        let pages: Vec<*mut u8> = (0..r.len() / 4096)
            // SAFETY: offsets stay inside the mapping; the pointers are only passed to the kernel.
            .map(|i| unsafe { r.host_addr().add(i * 4096) })
            .collect();
        let mut status = vec![-1; pages.len()];
        sys::query_pages(&pages, &mut status).unwrap();
        status.iter().filter(|s| **s >= 0).count()
    }

    #[test]
    fn a_cancel_stops_the_workers_after_their_chunk() {
        let regions = vec![anon_region(0, 4 << 20)];
        let cancel = Arc::new(AtomicBool::new(false));
        let hook_cancel = Arc::clone(&cancel);
        let opts = PrefaultOptions {
            chunk_bytes: 64 << 10,
            threads_per_cell: Some(1),
            progress: Progress::Hidden,
            // A stop signal arriving after the first chunk.
            on_progress: Some(Arc::new(move |_, _| {
                hook_cancel.store(true, Ordering::SeqCst)
            })),
            cancel: Some(cancel),
            ..PrefaultOptions::default()
        };
        let target = CellTarget {
            cell: 0,
            regions: &regions,
            cpus: &[],
        };
        let err = prefault(&[target], &opts).unwrap_err();
        assert!(
            matches!(
                err,
                PrefaultError::Cancelled {
                    done: 65536,
                    total: 4194304
                }
            ),
            "{err:?}"
        );
        assert_eq!(present_pages(&regions[0]), 16, "one chunk, then stop");
    }

    #[test]
    fn chunks_cover_regions_in_whole_pages() {
        let r = anon_region(0, 10 << 12);
        let chunks = chunks_of(std::slice::from_ref(&r), 3 << 12);
        let lens: Vec<usize> = chunks.iter().map(|c| c.len).collect();
        assert_eq!(lens, vec![3 << 12, 3 << 12, 3 << 12, 1 << 12]);
        assert_eq!(chunks[3].offset, 9 << 12);
    }

    #[test]
    fn every_method_faults_every_page_in() {
        for method in [
            PrefaultMethod::Auto,
            PrefaultMethod::PopulateWrite,
            PrefaultMethod::Touch,
        ] {
            let regions = vec![anon_region(0, 1 << 20), anon_region(0, 256 << 10)];
            let cpus = sys::current_affinity().unwrap();
            let seen = Arc::new(AtomicU64::new(0));
            let seen2 = Arc::clone(&seen);
            let opts = PrefaultOptions {
                method,
                chunk_bytes: 64 << 10,
                progress: Progress::Hidden,
                on_progress: Some(Arc::new(move |done, total| {
                    assert!(done <= total);
                    seen2.fetch_max(done, Ordering::Relaxed);
                })),
                ..PrefaultOptions::default()
            };
            let stats = prefault(
                &[CellTarget {
                    cell: 0,
                    regions: &regions,
                    cpus: &cpus,
                }],
                &opts,
            )
            .unwrap();
            assert_ne!(stats.method, PrefaultMethod::Auto);
            assert_eq!(stats.cells[0].bytes, (1 << 20) + (256 << 10));
            assert_eq!(stats.cells[0].threads, cpus.len().min(20));
            assert_eq!(seen.load(Ordering::Relaxed), (1 << 20) + (256 << 10));
            assert_eq!(present_pages(&regions[0]), 256, "{method:?}");
            assert_eq!(present_pages(&regions[1]), 64, "{method:?}");
        }
    }

    /// Keeps writing a new value into the first byte of every page of `region` (the byte the
    /// touch fallback reads) until `stop`, and counts the visits that find a value other than
    /// its own last one: a write someone else undid.
    fn write_counters(addr: usize, pages: usize, stop: &AtomicBool) -> (u64, u64) {
        let mut last = vec![0u8; pages];
        let (mut lost, mut writes) = (0, 0);
        let mut value = 0u8;
        loop {
            let stopping = stop.load(Ordering::SeqCst);
            value = value.wrapping_add(1).max(1);
            for (i, last) in last.iter_mut().enumerate() {
                // SAFETY: page `i` of a live mapping the test owns; a u8 has alignment 1.
                let byte = unsafe { AtomicU8::from_ptr((addr as *mut u8).add(i * 4096)) };
                if byte.load(Ordering::Relaxed) != *last {
                    lost += 1;
                }
                byte.store(value, Ordering::Relaxed);
                *last = value;
                writes += 1;
            }
            if stopping {
                return (lost, writes);
            }
        }
    }

    /// `--prefault background` with the touch method: the guest writes while the prefault
    /// touches its pages. A plain read and write-back of the byte lost a store that landed in
    /// between (the writer found its own last value replaced by an older one).
    #[test]
    fn a_background_touch_prefault_never_undoes_a_concurrent_write() {
        let (mut lost, mut writes) = (0, 0);
        for _ in 0..400 {
            let regions = vec![anon_region(0, 256 << 10)];
            let addr = regions[0].host_addr() as usize;
            let stop = AtomicBool::new(false);
            let opts = PrefaultOptions {
                method: PrefaultMethod::Touch,
                chunk_bytes: 16 << 10,
                threads_per_cell: Some(1),
                progress: Progress::Hidden,
                ..PrefaultOptions::default()
            };
            let target = CellTarget {
                cell: 0,
                regions: &regions,
                cpus: &[],
            };
            let (l, w) = std::thread::scope(|s| {
                let writer = s.spawn(|| write_counters(addr, 64, &stop));
                prefault(&[target], &opts).unwrap();
                stop.store(true, Ordering::SeqCst);
                writer.join().unwrap()
            });
            lost += l;
            writes += w;
        }
        assert_eq!(
            lost, 0,
            "{lost} of {writes} guest writes undone by the touch prefault"
        );
    }

    #[test]
    fn pinning_to_a_missing_cpu_fails_with_cell_and_cpu() {
        let regions = vec![anon_region(4, 1 << 20)];
        let opts = PrefaultOptions {
            progress: Progress::Hidden,
            ..PrefaultOptions::default()
        };
        let err = prefault(
            &[CellTarget {
                cell: 4,
                regions: &regions,
                cpus: &[4000],
            }],
            &opts,
        )
        .unwrap_err();
        assert!(
            matches!(
                err,
                PrefaultError::Pin {
                    cell: 4,
                    cpu: 4000,
                    ..
                }
            ),
            "{err:?}"
        );
    }
}
