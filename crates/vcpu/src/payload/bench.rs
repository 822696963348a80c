//! `numa-bench`: for each vCPU and each guest cell, a dependent-load pointer chase (latency) and
//! a sequential read stream (bandwidth), both in ring 3 and timed with `rdtsc` in the guest.
//!
//! The VMM builds one chase chain per cell before the run: the cache lines of a working set
//! larger than the host's last-level cache, linked in one random cycle (Sattolo's algorithm), the
//! first word of each line holding the GPA of the next. Every vCPU chases the same chain (it is
//! only read) and then streams over the same working set, so vCPUs running at once share the
//! memory system, as the guest's own threads would.

use std::path::Path;

use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};
use vmhost_memory::GuestLayout;
use vmhost_memory::GuestMemoryMmap;

use vmhost_guest::mailbox::{BenchSlot, MAX_BENCH_CELLS};

use super::PayloadError;

pub use vmhost_guest::bench::{LINE, LOADS_PER_ITER, STREAM_STEP};

/// Sizes of the benchmark; `None` picks a default.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BenchOptions {
    /// Working set per cell (default: twice the host's last-level cache, at least 64 MiB,
    /// at most the cell's largest RAM region).
    pub working_set_bytes: Option<u64>,
    /// Dependent loads per chase (default: one full cycle through the working set).
    pub chase_loads: Option<u64>,
    /// Passes of the sequential read (default 2).
    pub stream_passes: Option<u32>,
}

/// The host's last-level cache size, from sysfs (`None` when not readable).
pub fn host_llc_bytes() -> Option<u64> {
    let dir = Path::new("/sys/devices/system/cpu/cpu0/cache");
    let mut best: Option<(u32, u64)> = None;
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let read = |f: &str| std::fs::read_to_string(entry.path().join(f)).ok();
        let (Some(level), Some(size)) = (read("level"), read("size")) else {
            continue;
        };
        let Ok(level) = level.trim().parse::<u32>() else {
            continue;
        };
        let size = size.trim();
        let bytes = match size.strip_suffix('K') {
            Some(k) => k.parse::<u64>().ok().map(|k| k << 10),
            None => size
                .strip_suffix('M')
                .and_then(|m| m.parse::<u64>().ok())
                .map(|m| m << 20),
        };
        if let Some(bytes) = bytes {
            if best.is_none_or(|(l, _)| level > l) {
                best = Some((level, bytes));
            }
        }
    }
    best.map(|(_, b)| b)
}

/// One cell's chain: the benchmark parameters and where each vCPU enters the cycle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CellChain {
    /// Parameters (`chain_start` is set per vCPU from `starts`).
    pub slot: BenchSlot,
    /// Entry line of vCPU `i`: evenly spaced along the cycle, so vCPUs that chase at the same
    /// time miss on different lines instead of trailing each other through the same misses.
    pub starts: Vec<u64>,
}

/// Builds every cell's chain in `memory` for `vcpus` vCPUs and returns the per-cell
/// parameters, in cell order.
pub fn prepare(
    memory: &GuestMemoryMmap,
    layout: &GuestLayout,
    opts: &BenchOptions,
    seed: u64,
    vcpus: usize,
) -> Result<Vec<CellChain>, PayloadError> {
    let mut cells: Vec<u32> = layout.regions.iter().map(|r| r.cell).collect();
    cells.dedup();
    if cells.len() > MAX_BENCH_CELLS {
        return Err(PayloadError::TooManyCells {
            cells: cells.len(),
            max: MAX_BENCH_CELLS,
        });
    }
    let default_ws = host_llc_bytes()
        .unwrap_or(32 << 20)
        .saturating_mul(2)
        .max(64 << 20);
    let mut slots = Vec::new();
    for cell in cells {
        let Some(region) = layout.cell_regions(cell).max_by_key(|r| r.size_bytes) else {
            continue;
        };
        let ws = opts
            .working_set_bytes
            .unwrap_or(default_ws)
            .min(region.size_bytes)
            / STREAM_STEP
            * STREAM_STEP;
        if ws < STREAM_STEP {
            return Err(PayloadError::CellTooSmall {
                cell,
                bytes: region.size_bytes,
            });
        }
        let starts = build_chain(memory, region.gpa, ws, seed ^ u64::from(cell), vcpus)?;
        let loads = opts.chase_loads.unwrap_or(ws / LINE).max(LOADS_PER_ITER);
        let slot = BenchSlot {
            chain_start: starts.first().copied().unwrap_or(region.gpa),
            chase_iters: loads.div_ceil(LOADS_PER_ITER),
            stream_base: region.gpa,
            stream_len: ws,
            stream_passes: u64::from(opts.stream_passes.unwrap_or(2).max(1)),
            ..Default::default()
        };
        slots.push(CellChain { slot, starts });
    }
    Ok(slots)
}

/// splitmix64: a small, good-enough generator for the permutation (no crate needed).
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        // Multiply-shift: unbiased enough for a benchmark's shuffle.
        ((u128::from(self.next()) * u128::from(n)) >> 64) as u64
    }
}

/// A random cyclic permutation of `0..n` (Sattolo): `next[i]` follows `i`, one cycle through
/// all; and the cycle in walking order.
fn cyclic_permutation(n: u64, seed: u64) -> (Vec<u64>, Vec<u64>) {
    let mut order: Vec<u64> = (0..n).collect();
    let mut rng = SplitMix(seed);
    let mut i = n;
    while i > 1 {
        i -= 1;
        let j = rng.below(i);
        order.swap(as_index(i), as_index(j));
    }
    // `order` is a cycle read in sequence: order[k] -> order[k + 1].
    let mut next = vec![0u64; order.len()];
    for k in 0..order.len() {
        next[as_index(order[k])] = order[(k + 1) % order.len()];
    }
    (next, order)
}

fn as_index(v: u64) -> usize {
    usize::try_from(v).unwrap_or(usize::MAX)
}

/// Writes the chain and returns `vcpus` entry addresses evenly spaced along the cycle.
fn build_chain(
    memory: &GuestMemoryMmap,
    base: u64,
    bytes: u64,
    seed: u64,
    vcpus: usize,
) -> Result<Vec<u64>, PayloadError> {
    let lines = bytes / LINE;
    let (next, order) = cyclic_permutation(lines, seed);
    let len = usize::try_from(bytes).map_err(|_| PayloadError::CellTooSmall { cell: 0, bytes })?;
    let slice = memory
        .get_slice(GuestAddress(base), len)
        .map_err(|source| PayloadError::Write { gpa: base, source })?;
    for (i, n) in next.iter().enumerate() {
        let at = i * as_index(LINE);
        slice
            .write_obj(base + n * LINE, at)
            .map_err(|source| PayloadError::Write {
                gpa: base + at as u64,
                source: source.into(),
            })?;
    }
    let n = vcpus.max(1);
    Ok((0..n)
        .map(|k| base + order[k * order.len() / n] * LINE)
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmhost_memory::layout::CellSpan;
    use vmhost_memory::{MMIO_HOLE_END, MMIO_HOLE_START};

    #[test]
    fn permutation_is_one_cycle_through_every_line() {
        for n in [1u64, 2, 3, 1000] {
            let (next, order) = cyclic_permutation(n, 7);
            assert_eq!(order.len() as u64, n);
            let mut seen = vec![false; next.len()];
            let mut at = 0u64;
            for _ in 0..n {
                assert!(!seen[as_index(at)], "n={n}: revisited {at}");
                seen[as_index(at)] = true;
                at = next[as_index(at)];
            }
            assert_eq!(at, 0, "n={n}: the walk returns to the start");
        }
    }

    #[test]
    fn chains_are_built_inside_each_cell() {
        let cells = [
            CellSpan {
                cell: 0,
                host_node: Some(0),
                size_bytes: 4 << 20,
            },
            CellSpan {
                cell: 1,
                host_node: Some(0),
                size_bytes: 2 << 20,
            },
        ];
        let layout = GuestLayout::new(&cells, MMIO_HOLE_START..MMIO_HOLE_END, 2 << 20).unwrap();
        let mem = layout.anonymous_memory().unwrap();
        let opts = BenchOptions {
            working_set_bytes: Some(1 << 20),
            chase_loads: None,
            stream_passes: None,
        };
        let chains = prepare(&mem, &layout, &opts, 1, 2).unwrap();
        let slots: Vec<BenchSlot> = chains.iter().map(|c| c.slot).collect();
        assert_eq!(slots.len(), 2);
        let cell1 = (4 << 20)..(5 << 20);
        assert_eq!(slots[1].chain_start, chains[1].starts[0]);
        assert!(chains[1].starts.iter().all(|s| cell1.contains(s)));
        assert_ne!(chains[1].starts[0], chains[1].starts[1]);
        assert_eq!(slots[0].chase_iters, (1 << 20) / LINE / LOADS_PER_ITER);
        assert_eq!(slots[0].stream_passes, 2);
        // Follow the chain of cell 1: it stays in the working set and closes after every line.
        let mut at = slots[1].chain_start;
        for _ in 0..(1 << 20) / LINE {
            at = mem.read_obj(GuestAddress(at)).unwrap();
            assert!((4 << 20..(4 << 20) + (1 << 20)).contains(&at));
            assert_eq!(at % LINE, 0);
        }
        assert_eq!(at, slots[1].chain_start);
    }
}
