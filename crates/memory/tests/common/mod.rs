//! Helpers shared by the hugepage integration tests: the pool lock, pool counters read from
//! sysfs, the opt-out variable, and plans built by hand.
#![allow(dead_code)]

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::PathBuf;

use vmhost_plan::{Backing, GuestCell, Plan};

pub const MIB: u64 = 1 << 20;
pub const PAGE_2M: u64 = 2 << 20;
pub const PAGE_1G: u64 = 1 << 30;

/// Held while a test uses the hugepage pool: an exclusive `flock` on a file shared with the
/// other crates' tests.
pub struct PoolLock(File);

pub fn lock_pool() -> PoolLock {
    let f = File::options()
        .create(true)
        .append(true)
        .open("/tmp/vmhost-hugepages.lock")
        .expect("open /tmp/vmhost-hugepages.lock");
    // SAFETY: `f` is an open file for the whole call; flock only takes a lock on it.
    let ret = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) };
    assert_eq!(
        ret,
        0,
        "flock /tmp/vmhost-hugepages.lock: {}",
        std::io::Error::last_os_error()
    );
    PoolLock(f)
}

fn pool_dir(page: u64) -> PathBuf {
    PathBuf::from(format!(
        "/sys/kernel/mm/hugepages/hugepages-{}kB",
        page / 1024
    ))
}

fn counter(page: u64, name: &str) -> u64 {
    let path = pool_dir(page).join(name);
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
        .trim()
        .parse()
        .expect("pool counter is a number")
}

/// `(free, reserved)` pages of a size, host-wide.
pub fn pool(page: u64) -> (u64, u64) {
    (
        counter(page, "free_hugepages"),
        counter(page, "resv_hugepages"),
    )
}

/// Free pages of a size on node 0.
pub fn node0_free(page: u64) -> u64 {
    let path = format!(
        "/sys/devices/system/node/node0/hugepages/hugepages-{}kB/free_hugepages",
        page / 1024
    );
    std::fs::read_to_string(&path)
        .expect("node0 pool")
        .trim()
        .parse()
        .expect("number")
}

/// True when hugepage tests should be skipped (`VMHOST_SKIP_HUGEPAGE_TESTS=1`).
pub fn skipping(test: &str) -> bool {
    if std::env::var("VMHOST_SKIP_HUGEPAGE_TESTS").as_deref() == Ok("1") {
        println!("SKIP {test}: VMHOST_SKIP_HUGEPAGE_TESTS=1");
        return true;
    }
    false
}

/// Fails the test with instructions unless `count` pages of `page` are available on node 0
/// (free and not reserved). Returns false when hugepage tests are skipped.
pub fn need_pages(test: &str, page: u64, count: u64) -> bool {
    if skipping(test) {
        return false;
    }
    let dir = pool_dir(page);
    assert!(
        dir.exists(),
        "{test}: the kernel has no {} KiB hugepage size",
        page / 1024
    );
    let (free, resv) = pool(page);
    let available = free.saturating_sub(resv).min(node0_free(page));
    assert!(
        available >= count,
        "{test} needs {count} free {} KiB hugepages on node0, the host has {available} \
         ({free} free, {resv} reserved). Reserve them with \
         `echo N > {}/nr_hugepages` (as root), or set VMHOST_SKIP_HUGEPAGE_TESTS=1 to skip",
        page / 1024,
        dir.display()
    );
    true
}

/// A plan with one cell per `(host node, memory)` entry, cells numbered in order.
pub fn plan(name: &str, cells: &[(Option<u32>, u64)], backing: Backing) -> Plan {
    let n = cells.len();
    let guest_cells = cells
        .iter()
        .zip(0u32..)
        .map(|(&(host_node, memory_bytes), cell)| GuestCell {
            cell,
            host_node,
            vcpus: vec![cell],
            memory_bytes,
            prefault_cpus: Vec::new(),
            distances: vec![10; n],
        })
        .collect();
    Plan::memory_only(name, guest_cells, backing)
}

pub fn hugetlb_2m() -> Backing {
    Backing::Hugetlb {
        page_size_bytes: PAGE_2M,
        hugetlbfs: None,
    }
}

/// The line of `/proc/self/numa_maps` that starts at `addr`, read independently of the crate.
pub fn numa_maps_line(addr: u64) -> String {
    let maps = std::fs::read_to_string("/proc/self/numa_maps").expect("read numa_maps");
    let key = format!("{addr:x} ");
    maps.lines()
        .find(|l| l.starts_with(&key))
        .unwrap_or_else(|| panic!("no numa_maps line at {addr:#x}:\n{maps}"))
        .to_string()
}

/// A hugetlbfs mount in a fresh directory, unmounted and removed on drop.
pub struct Mount(pub PathBuf);

impl Mount {
    pub fn hugetlbfs(tag: &str, pagesize: &str) -> Mount {
        let dir =
            std::env::temp_dir().join(format!("vmhost-hugetlbfs-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create mount point");
        let out = std::process::Command::new("mount")
            .args([
                "-t",
                "hugetlbfs",
                "-o",
                &format!("pagesize={pagesize}"),
                "none",
            ])
            .arg(&dir)
            .output()
            .expect("run mount");
        assert!(
            out.status.success(),
            "mount -t hugetlbfs -o pagesize={pagesize} {} failed (tests run as root): {}",
            dir.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        Mount(dir)
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir(&self.0);
    }
}
