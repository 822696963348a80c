//! Prefault rate of 2 MiB hugepage guest memory, side by side in one run:
//!
//! - vmhost, 1 worker vs one pinned worker per CPU of node0 (`GuestMemory::new`; the
//!   prefault step alone, and the whole start: admission, allocate, bind, prefault);
//! - the host limit: a plain first touch of the same size of hugetlb memory (memfd, `mmap`,
//!   one write per page from 1 or N unpinned threads), no vmhost code;
//! - QEMU's own memory setup (`memory-backend-file` on a hugetlbfs mount, `prealloc=on`,
//!   `host-nodes=0,policy=bind`), when `qemu-system-x86_64` is installed.
//!
//! QEMU is timed from spawn until its QMP monitor answers `qmp_capabilities` (the main loop
//! runs only after machine init, which includes preallocating the backend; `-S` keeps the
//! guest stopped), then told to quit. The same command with `prealloc=off` is the baseline
//! start-up cost; the difference of the medians is QEMU's memory setup.
//!
//! Run: `cargo bench -p vmhost-memory --bench prefault` (as root, with enough free 2 MiB
//! pages: `echo 600 > /sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages`).
//! `VMHOST_BENCH_MIB` (default 1024) and `VMHOST_BENCH_REPS` (default 7) change the size and
//! the repetitions.

mod common;

use common::{env_u64, plan, PAGE};

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use vmhost_memory::{
    sys, GuestMemory, MemoryOptions, PrefaultMethod, PrefaultOptions, Progress, Step,
};

fn read_u64(path: &str) -> u64 {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// One benchmark row: seconds per repetition.
struct Row {
    name: String,
    secs: Vec<f64>,
}

impl Row {
    fn sorted(&self) -> Vec<f64> {
        let mut v = self.secs.clone();
        v.sort_by(f64::total_cmp);
        v
    }

    fn median(&self) -> f64 {
        let v = self.sorted();
        if v.is_empty() {
            return f64::NAN;
        }
        v[v.len() / 2]
    }
}

/// vmhost: `(prefault step, whole start)` seconds.
fn vmhost_once(bytes: u64, cpus: &[u32], threads: usize) -> (f64, f64) {
    let opts = MemoryOptions {
        prefault: PrefaultOptions {
            method: PrefaultMethod::Auto,
            threads_per_cell: Some(threads),
            progress: Progress::Hidden,
            ..PrefaultOptions::default()
        },
        ..MemoryOptions::default()
    };
    let start = Instant::now();
    let mem = GuestMemory::new(&plan("bench", bytes, cpus), &opts).expect("vmhost guest memory");
    let total = start.elapsed().as_secs_f64();
    let prefault = mem
        .timings()
        .iter()
        .find(|t| t.step == Step::Prefault)
        .map_or(f64::NAN, |t| t.seconds);
    drop(mem);
    (prefault, total)
}

/// A shared hugetlb mapping made with no vmhost code, unmapped on drop.
struct RawMap {
    addr: usize,
    len: usize,
    _file: std::fs::File,
}

impl RawMap {
    fn new(len: usize) -> RawMap {
        // libc directly (sys::memfd_create is a thin wrapper over the same call).
        let name = c"bench-raw";
        // SAFETY: `name` is a NUL-terminated literal.
        let fd =
            unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_HUGETLB | libc::MFD_HUGE_2MB) };
        assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
        // SAFETY: `fd` was just returned by memfd_create and is owned by nothing else.
        let file = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        file.set_len(len as u64).expect("size memfd");
        // SAFETY: a new shared mapping of the whole file at a kernel-chosen address.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        assert_ne!(
            p,
            libc::MAP_FAILED,
            "mmap: {}",
            std::io::Error::last_os_error()
        );
        RawMap {
            addr: p as usize,
            len,
            _file: file,
        }
    }
}

impl Drop for RawMap {
    fn drop(&mut self) {
        // SAFETY: exactly the mapping made in `new`, unmapped once.
        unsafe { libc::munmap(self.addr as *mut libc::c_void, self.len) };
    }
}

/// The host limit: `(touch, mmap + touch)` seconds, `threads` unpinned threads.
fn raw_once(bytes: u64, threads: usize) -> (f64, f64) {
    let len = usize::try_from(bytes).expect("size fits");
    let page = usize::try_from(PAGE).expect("page fits");
    let start = Instant::now();
    let map = RawMap::new(len);
    let touch_start = Instant::now();
    let pages = len / page;
    let per = pages.div_ceil(threads);
    std::thread::scope(|s| {
        for t in 0..threads {
            let base = map.addr;
            s.spawn(move || {
                for i in (t * per)..((t + 1) * per).min(pages) {
                    // SAFETY: page i < pages lies inside the live, writable shared mapping;
                    // threads write disjoint pages.
                    unsafe { ((base + i * page) as *mut u8).write_volatile(1) };
                }
            });
        }
    });
    let touch = touch_start.elapsed().as_secs_f64();
    let total = start.elapsed().as_secs_f64();
    drop(map);
    (touch, total)
}

/// A temporary hugetlbfs mount for QEMU's `mem-path`.
struct Mount(PathBuf);

impl Mount {
    fn new() -> Option<Mount> {
        let dir =
            std::env::temp_dir().join(format!("vmhost-bench-hugetlbfs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).ok()?;
        let ok = Command::new("mount")
            .args(["-t", "hugetlbfs", "-o", "pagesize=2M", "none"])
            .arg(&dir)
            .status()
            .ok()?
            .success();
        ok.then_some(Mount(dir))
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// Seconds from spawning QEMU until QMP answers `qmp_capabilities`.
fn qemu_once(qemu: &Path, mount: &Path, bytes: u64, prealloc: bool, threads: usize) -> Option<f64> {
    let mib = bytes >> 20;
    let backend = format!(
        "memory-backend-file,id=m0,size={mib}M,mem-path={},share=on,prealloc={},prealloc-threads={threads},host-nodes=0,policy=bind",
        mount.display(),
        if prealloc { "on" } else { "off" }
    );
    let start = Instant::now();
    let mut child = Command::new(qemu)
        .args([
            "-enable-kvm",
            "-machine",
            "pc",
            "-nodefaults",
            "-nographic",
            "-display",
            "none",
        ])
        .args([
            "-S",
            "-m",
            &format!("{mib}M"),
            "-object",
            &backend,
            "-numa",
            "node,memdev=m0",
        ])
        .args(["-qmp", "stdio"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let mut stdin = child.stdin.take()?;
    let mut lines = BufReader::new(child.stdout.take()?).lines();
    let greeting = lines.next()?.ok()?;
    if !greeting.contains("QMP") {
        let _ = child.kill();
        let _ = child.wait();
        return None;
    }
    writeln!(stdin, "{{\"execute\":\"qmp_capabilities\"}}").ok()?;
    let ready = loop {
        let line = lines.next()?.ok()?;
        if line.contains("\"return\"") {
            break start.elapsed().as_secs_f64();
        }
    };
    writeln!(stdin, "{{\"execute\":\"quit\"}}").ok()?;
    let _ = child.wait();
    Some(ready)
}

fn find_qemu() -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| Path::new(d).join("qemu-system-x86_64"))
        .find(|p| p.exists())
}

fn print_table(rows: &[Row], bytes: u64) {
    let gib = bytes as f64 / (1u64 << 30) as f64;
    println!(
        "{:<58} {:>9} {:>9} {:>9} {:>8}",
        "case", "median ms", "min ms", "max ms", "GiB/s"
    );
    for r in rows {
        let v = r.sorted();
        let (min, max) = (
            v.first().copied().unwrap_or(f64::NAN),
            v.last().copied().unwrap_or(f64::NAN),
        );
        let med = r.median();
        println!(
            "{:<58} {:>9.1} {:>9.1} {:>9.1} {:>8.2}",
            r.name,
            med * 1e3,
            min * 1e3,
            max * 1e3,
            gib / med
        );
    }
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        println!("prefault benchmark: run it with `cargo bench -p vmhost-memory --bench prefault`");
        return;
    }
    let mib = env_u64("VMHOST_BENCH_MIB", 1024);
    let reps = env_u64("VMHOST_BENCH_REPS", 7);
    let bytes = mib << 20;
    let pages = bytes / PAGE;
    let free = read_u64("/sys/devices/system/node/node0/hugepages/hugepages-2048kB/free_hugepages");
    if free < pages {
        eprintln!(
            "the benchmark needs {pages} free 2 MiB hugepages on node0, there are {free}: \
             echo {} > /sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages",
            pages + 8
        );
        std::process::exit(1);
    }
    let cpus = sys::current_affinity().expect("CPU affinity");
    let n = cpus.len();
    println!("{mib} MiB of 2 MiB hugepages on node0, {reps} repetitions, {n} CPUs {cpus:?}\n");

    let mut rows: Vec<Row> = Vec::new();
    let mut add = |name: String| {
        rows.push(Row {
            name,
            secs: Vec::new(),
        });
        rows.len() - 1
    };
    let v1 = add("vmhost prefault step, 1 pinned worker".into());
    let vn = add(format!("vmhost prefault step, {n} pinned workers"));
    let v1t = add("vmhost whole start (admit+alloc+bind+prefault), 1 worker".into());
    let vnt = add(format!(
        "vmhost whole start (admit+alloc+bind+prefault), {n} workers"
    ));
    let r1 = add("host limit: plain first touch, 1 thread".into());
    let rn = add(format!("host limit: plain first touch, {n} threads"));
    let r1t = add("host limit: memfd+mmap+first touch, 1 thread".into());
    let rnt = add(format!("host limit: memfd+mmap+first touch, {n} threads"));
    let qemu = find_qemu();
    let mount = qemu.as_ref().and_then(|_| Mount::new());
    let (q0, q1, qn) = if mount.is_some() {
        (
            Some(add("qemu start, prealloc=off (baseline)".into())),
            Some(add("qemu start, prealloc=on, prealloc-threads=1".into())),
            Some(add(format!(
                "qemu start, prealloc=on, prealloc-threads={n}"
            ))),
        )
    } else {
        (None, None, None)
    };
    for _ in 0..reps {
        // Interleave the cases so drift on a noisy host hits them alike.
        let (p, t) = vmhost_once(bytes, &cpus[..1], 1);
        rows[v1].secs.push(p);
        rows[v1t].secs.push(t);
        let (p, t) = vmhost_once(bytes, &cpus, n);
        rows[vn].secs.push(p);
        rows[vnt].secs.push(t);
        let (p, t) = raw_once(bytes, 1);
        rows[r1].secs.push(p);
        rows[r1t].secs.push(t);
        let (p, t) = raw_once(bytes, n);
        rows[rn].secs.push(p);
        rows[rnt].secs.push(t);
        if let (Some(q), Some(m)) = (&qemu, &mount) {
            for (row, prealloc, threads) in [(q0, false, 1), (q1, true, 1), (qn, true, n)] {
                if let (Some(row), Some(s)) = (row, qemu_once(q, &m.0, bytes, prealloc, threads)) {
                    rows[row].secs.push(s);
                }
            }
        }
    }
    print_table(&rows, bytes);
    println!();
    let ratio = |a: usize, b: usize| rows[a].median() / rows[b].median();
    println!(
        "vmhost prefault / host limit, 1 thread:  {:.3}",
        ratio(v1, r1)
    );
    println!(
        "vmhost prefault / host limit, {n} threads: {:.3}",
        ratio(vn, rn)
    );
    println!(
        "vmhost whole start / memfd+mmap+touch, {n} threads: {:.3}",
        ratio(vnt, rnt)
    );
    if let (Some(q0), Some(q1), Some(qn)) = (q0, q1, qn) {
        let base = rows[q0].median();
        println!(
            "qemu memory setup (median minus baseline): prealloc-threads=1 {:.1} ms, ={n} {:.1} ms",
            (rows[q1].median() - base) * 1e3,
            (rows[qn].median() - base) * 1e3
        );
    } else if qemu.is_none() {
        println!(
            "qemu-system-x86_64 not installed: QEMU rows skipped (apt-get install qemu-system-x86)"
        );
    } else {
        println!("could not mount hugetlbfs for QEMU's mem-path: QEMU rows skipped");
    }
}
