//! A snapshot's memory file read into 2 MiB hugepage guest RAM, side by side in one run: what
//! a restore does with it against the plain read it is measured by (issue 22's target: a
//! restore within 1.2× the time to read the memory files into hugepages on their nodes).
//!
//! - **read**: the file read with one `read` into a fresh hugetlb mapping bound to node 0 (as
//!   `testbed/runner/src/migration_bench.rs` times it in the emulated host): the page faults
//!   and one copy, nothing checked;
//! - **load**: [`GuestMemory::load_cells`] into guest RAM allocated and bound with its prefault
//!   deferred: every record's checksum checked, its run decoded and written;
//! - **load + prefault beside**: what a restore runs (`src/run/memory.rs`): the same load while
//!   the deferred prefault faults the whole RAM in on the cell's CPUs.
//!
//! The file is written once by [`cells::save_cell`] from RAM filled with non-zero bytes (no
//! page left out), so the three cases move the same bytes. Cases are interleaved round by
//! round; each round's ratio to the read is reported with the median and a 95 % bootstrap
//! interval (`vmhost_testsupport::stats`).
//!
//! Run: `cargo bench -p vmhost-memory --bench load` as root with enough free 2 MiB pages
//! (`bash scripts/with-hugepages.sh cargo bench -p vmhost-memory --bench load`).
//! `VMHOST_BENCH_MIB` (default 256) and `VMHOST_BENCH_REPS` (default 11) change the size and
//! the rounds.

mod common;

use common::{env_u64, plan, PAGE};

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::PathBuf;
use std::time::Instant;

use vm_memory::{Bytes, MemoryRegionAddress};
use vmhost_memory::{cells, GuestMemory, MemoryOptions, PrefaultOptions, PrefaultTiming, Progress};
use vmhost_persist::container::Writer;
use vmhost_testsupport::stats::{bootstrap_ci, median};

const PAGE_BYTES: usize = 2 << 20;

fn memory(plan: &vmhost_plan::Plan, timing: PrefaultTiming) -> GuestMemory {
    let opts = MemoryOptions {
        timing,
        prefault: PrefaultOptions {
            progress: Progress::Hidden,
            ..PrefaultOptions::default()
        },
        ..MemoryOptions::default()
    };
    GuestMemory::new(plan, &opts).expect("guest memory (free 2 MiB pages on node 0?)")
}

/// Writes the memory file of RAM filled with non-zero bytes (every 4 KiB page differs).
fn write_file(plan: &vmhost_plan::Plan, path: &PathBuf) -> u64 {
    let mem = memory(plan, PrefaultTiming::BeforeStart);
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    let mut chunk = vec![0u8; PAGE_BYTES];
    for r in mem.regions() {
        let mut at = 0u64;
        while at < r.len() as u64 {
            for w in chunk.chunks_exact_mut(8) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                w.copy_from_slice(&(x | 1).to_le_bytes());
            }
            r.region
                .write_slice(&chunk, MemoryRegionAddress(at))
                .expect("fill guest RAM");
            at += PAGE;
        }
    }
    let out = BufWriter::new(File::create(path).expect("create the memory file"));
    let mut w = Writer::new(out, "bench").expect("container header");
    let saved = cells::save_cell(mem.regions(), 0, &mut w, |_, _| false).expect("save the cell");
    w.finish().expect("end record").flush().expect("flush");
    saved.bytes
}

/// A shared 2 MiB hugetlb mapping bound to node 0, unmapped on drop.
struct HugeMap {
    addr: *mut libc::c_void,
    len: usize,
}

impl HugeMap {
    fn new(len: usize) -> HugeMap {
        // SAFETY: a new anonymous mapping at a kernel-chosen address.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_HUGETLB | libc::MAP_HUGE_2MB,
                -1,
                0,
            )
        };
        assert_ne!(
            addr,
            libc::MAP_FAILED,
            "mmap: {}",
            std::io::Error::last_os_error()
        );
        let mask: u64 = 1;
        // SAFETY: sets the policy of the mapping made above; `mask` outlives the call.
        let bound = unsafe { libc::syscall(libc::SYS_mbind, addr, len, 2u64, &mask, 64u64, 0u32) };
        assert_eq!(bound, 0, "mbind: {}", std::io::Error::last_os_error());
        HugeMap { addr, len }
    }

    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: the mapping is `len` bytes, readable and writable, alive while `self` is,
        // and only reached through this exclusive borrow.
        unsafe { std::slice::from_raw_parts_mut(self.addr.cast::<u8>(), self.len) }
    }
}

impl Drop for HugeMap {
    fn drop(&mut self) {
        // SAFETY: exactly the mapping made in `new`, unmapped once.
        unsafe { libc::munmap(self.addr, self.len) };
    }
}

fn read_once(path: &PathBuf) -> f64 {
    let start = Instant::now();
    let mut f = File::open(path).expect("open the memory file");
    let size = usize::try_from(f.metadata().expect("stat").len()).expect("size fits");
    let mut map = HugeMap::new(size.div_ceil(PAGE_BYTES) * PAGE_BYTES);
    f.read_exact(&mut map.bytes()[..size]).expect("read");
    let secs = start.elapsed().as_secs_f64();
    drop(map);
    secs
}

fn load_once(plan: &vmhost_plan::Plan, path: &PathBuf, beside: bool) -> f64 {
    let mem = memory(plan, PrefaultTiming::Background);
    let start = Instant::now();
    let file = std::io::BufReader::new(File::open(path).expect("open the memory file"));
    std::thread::scope(|s| {
        let load = s.spawn(|| mem.load_cells(plan, vec![(0, file)]).expect("load"));
        if beside {
            mem.prefault_deferred().expect("prefault");
        }
        load.join().expect("loader thread");
    });
    let secs = start.elapsed().as_secs_f64();
    drop(mem);
    secs
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        println!("load benchmark: run it with `cargo bench -p vmhost-memory --bench load`");
        return;
    }
    let mib = env_u64("VMHOST_BENCH_MIB", 256);
    let reps = env_u64("VMHOST_BENCH_REPS", 11);
    let cpus = vmhost_memory::sys::current_affinity().expect("CPU affinity");
    let plan = plan("bench-load", mib << 20, &cpus);
    let path = std::env::temp_dir().join(format!("vmhost-bench-load-{}", std::process::id()));
    let bytes = write_file(&plan, &path);
    println!(
        "{mib} MiB of 2 MiB hugepages on node 0, a memory file of {} MiB, {reps} rounds, CPUs \
         {cpus:?}\n",
        bytes >> 20
    );
    let (mut read, mut load, mut beside) = (Vec::new(), Vec::new(), Vec::new());
    // One of each first, untimed: the file in the page cache, the code faulted in.
    read_once(&path);
    load_once(&plan, &path, true);
    for _ in 0..reps {
        read.push(read_once(&path));
        load.push(load_once(&plan, &path, false));
        beside.push(load_once(&plan, &path, true));
    }
    let _ = std::fs::remove_file(&path);
    let ms = |v: &[f64]| median(v) * 1000.0;
    println!("read into hugepages        {:8.1} ms", ms(&read));
    for (name, v) in [("load", &load), ("load + prefault beside", &beside)] {
        let ratios: Vec<f64> = v.iter().zip(&read).map(|(a, b)| a / b).collect();
        let (lo, hi) = bootstrap_ci(&ratios);
        println!(
            "{name:<26} {:8.1} ms   / read {:.2} [{lo:.2}, {hi:.2}]",
            ms(v),
            median(&ratios)
        );
    }
}
