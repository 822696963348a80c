//! The host-native baseline: the guest's chains and kernels, run by host threads pinned to
//! the vCPUs' PUs, over memory set up exactly like the guest's.
//!
//! Memory comes from [`vmhost_memory::GuestMemory`] on a plan with the same cells, nodes,
//! backing (hugetlb memfd of the same page size) and policy, each cell one working set; the
//! chains are built by the guest's own builder (`vmhost_vcpu::payload::bench::prepare`, same
//! seed, same entry points per thread) and then relocated from guest-physical addresses to
//! this process's addresses, so the host chases the very same permutation.

use std::sync::{Condvar, Mutex, PoisonError};

use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};
use vmhost_memory::{sys, GuestMemory, MemoryOptions};
use vmhost_plan::Plan;
use vmhost_vcpu::payload::bench::{prepare, LINE};
use vmhost_vcpu::payload::mailbox::BenchSlot;
use vmhost_vcpu::BenchOptions;

use crate::kernel::{self, ChaseOut, StreamOut, LOADS_PER_ITER};
use crate::BenchError;

/// The chain shuffle's seed: the value `vmhost_vcpu::Vm` uses, so guest and host chase the
/// same permutation (a test checks they agree).
pub const BENCH_SEED: u64 = 0x766d_686f_7374;

/// One cell of baseline memory, ready to measure.
#[derive(Debug, Clone)]
pub struct HostCell {
    /// Guest cell.
    pub cell: u32,
    /// The guest-form parameters (GPA-based) `prepare` produced.
    pub slot: BenchSlot,
    /// Layout address of the working set.
    pub gpa: u64,
    /// Host address of the working set.
    pub base: u64,
    /// Host address each thread enters the chain at.
    pub starts: Vec<u64>,
}

/// Baseline memory with relocated chains; the memory is released on drop.
pub struct HostMemory {
    /// The memory (kept alive while the chains are used).
    pub mem: GuestMemory,
    /// The cells, in cell order.
    pub cells: Vec<HostCell>,
}

/// What one thread measured on one cell.
#[derive(Debug, Clone, Copy)]
pub struct CellCycles {
    /// Guest cell.
    pub cell: u32,
    /// The chase.
    pub chase: ChaseOut,
    /// Dependent loads chased.
    pub loads: u64,
    /// The stream.
    pub stream: StreamOut,
    /// Bytes streamed.
    pub bytes: u64,
}

/// What one thread measured, and where it was allowed to run.
#[derive(Debug, Clone)]
pub struct ThreadResult {
    /// `sched_getaffinity` after pinning.
    pub cpus_allowed: Vec<u32>,
    /// Per cell, in cell order.
    pub cells: Vec<CellCycles>,
}

/// Allocates `plan`'s memory with `opts` and builds the chains for `threads` threads.
pub fn allocate(
    what: &str,
    plan: &Plan,
    opts: &MemoryOptions,
    bench: &BenchOptions,
    threads: usize,
) -> Result<HostMemory, BenchError> {
    let mem = GuestMemory::new(plan, opts).map_err(|source| BenchError::Memory {
        scenario: what.to_string(),
        side: "host baseline",
        source,
    })?;
    let chains =
        prepare(mem.memory(), mem.layout(), bench, BENCH_SEED, threads).map_err(|source| {
            BenchError::Chain {
                scenario: what.to_string(),
                source,
            }
        })?;
    let mut ids: Vec<u32> = mem.layout().regions.iter().map(|r| r.cell).collect();
    ids.dedup();
    let mut cells = Vec::with_capacity(chains.len());
    for (cell, chain) in ids.into_iter().zip(chains) {
        // `prepare` builds each chain in the cell's largest region, from its first byte.
        let gpa = chain.slot.stream_base;
        let base = relocate(what, &mem, gpa, chain.slot.stream_len)?;
        let starts = chain.starts.iter().map(|s| s - gpa + base).collect();
        cells.push(HostCell {
            cell,
            slot: chain.slot,
            gpa,
            base,
            starts,
        });
    }
    Ok(HostMemory { mem, cells })
}

/// Rewrites every link of the chain in `[gpa, gpa + len)` from a guest-physical address to
/// this process's address of the same line; returns the host address of `gpa`.
fn relocate(what: &str, mem: &GuestMemory, gpa: u64, len: u64) -> Result<u64, BenchError> {
    let access = |gpa: u64| {
        let what = what.to_string();
        move |source| BenchError::Access {
            scenario: what,
            gpa,
            source,
        }
    };
    let m = mem.memory();
    let base = m.get_host_address(GuestAddress(gpa)).map_err(access(gpa))? as u64;
    let end = gpa + len;
    for at in (0..len / LINE).map(|i| gpa + i * LINE) {
        let link: u64 = m.read_obj(GuestAddress(at)).map_err(access(at))?;
        if !(gpa..end).contains(&link) || link % LINE != 0 {
            return Err(BenchError::BadLink {
                scenario: what.to_string(),
                gpa: at,
                target: link,
            });
        }
        m.write_obj(link - gpa + base, GuestAddress(at))
            .map_err(access(at))?;
    }
    Ok(base)
}

/// Holds threads until every one has started (then all go) or one failed to (then all stop).
struct Gate {
    go: Mutex<Option<bool>>,
    cv: Condvar,
}

impl Gate {
    fn open(&self, go: bool) {
        *self.go.lock().unwrap_or_else(PoisonError::into_inner) = Some(go);
        self.cv.notify_all();
    }

    fn wait(&self) -> bool {
        let guard = self.go.lock().unwrap_or_else(PoisonError::into_inner);
        let guard = self
            .cv
            .wait_while(guard, |g| g.is_none())
            .unwrap_or_else(PoisonError::into_inner);
        guard.unwrap_or(false)
    }
}

/// Runs one thread per entry of `thread_cpus` (thread `i` pinned to `thread_cpus[i]`, entering
/// each chain at `starts[i]`), all released together, each chasing then streaming every cell
/// in order, as the guest's vCPUs do.
pub fn run_threads(
    mem: &HostMemory,
    thread_cpus: &[Vec<u32>],
) -> Result<Vec<ThreadResult>, BenchError> {
    let gate = Gate {
        go: Mutex::new(None),
        cv: Condvar::new(),
    };
    std::thread::scope(|s| {
        let mut handles = Vec::with_capacity(thread_cpus.len());
        for (i, cpus) in thread_cpus.iter().enumerate() {
            let gate = &gate;
            let spawned = std::thread::Builder::new()
                .name(format!("bench-host{i}"))
                .spawn_scoped(s, move || {
                    let pinned = sys::pin_current_thread(cpus);
                    let allowed = sys::current_affinity().unwrap_or_default();
                    let go = gate.wait();
                    pinned.map_err(|source| BenchError::Pin {
                        thread: i,
                        cpus: cpus.clone(),
                        source,
                    })?;
                    Ok(ThreadResult {
                        cpus_allowed: allowed,
                        cells: if go {
                            measure_cells(mem, i)
                        } else {
                            Vec::new()
                        },
                    })
                });
            match spawned {
                Ok(h) => handles.push(h),
                Err(source) => {
                    gate.open(false);
                    return Err(BenchError::Spawn { thread: i, source });
                }
            }
        }
        gate.open(true);
        handles
            .into_iter()
            .enumerate()
            .map(|(i, h)| {
                h.join()
                    .map_err(|_| BenchError::ThreadPanicked { thread: i })?
            })
            .collect()
    })
}

/// Thread `i`'s chase and stream over every cell.
fn measure_cells(mem: &HostMemory, i: usize) -> Vec<CellCycles> {
    mem.cells
        .iter()
        .map(|c| {
            let start = c.starts.get(i).copied().unwrap_or(c.base);
            // SAFETY: `start` is a line of a closed chain (every line of the working set is on
            // it) that `prepare` built and `relocate` rewrote to addresses inside the same mapping, which `mem` keeps alive for this
            // call; every thread only reads it.
            let chase = unsafe { kernel::chase(start, c.slot.chase_iters) };
            // SAFETY: `[base, base + stream_len)` is the cell's working set inside the live
            // mapping, and `prepare` made `stream_len` a non-zero multiple of 128 bytes.
            let stream = unsafe { kernel::stream(c.base, c.slot.stream_len, c.slot.stream_passes) };
            std::hint::black_box((chase.end, stream.sums));
            CellCycles {
                cell: c.cell,
                chase,
                loads: c.slot.chase_iters * LOADS_PER_ITER,
                stream,
                bytes: c.slot.stream_len * c.slot.stream_passes,
            }
        })
        .collect()
}

/// Nanoseconds per dependent load and GB/s of a measurement, at `tsc_khz`.
pub fn convert(c: &CellCycles, tsc_khz: u32) -> (f64, f64) {
    let secs = |cycles| vmhost_vcpu::payload::cycles_to_secs(cycles, tsc_khz);
    let chase = secs(c.chase.cycles);
    let stream = secs(c.stream.cycles);
    let ns = if c.loads > 0 {
        chase * 1e9 / c.loads as f64
    } else {
        0.0
    };
    let gbps = if stream > 0.0 {
        c.bytes as f64 / stream / 1e9
    } else {
        0.0
    };
    (ns, gbps)
}
