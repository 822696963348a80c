//! Helpers shared by the hugepage integration tests: the pool lock, pool counters read from
//! sysfs, the opt-out variable, and plans built by hand.
#![allow(dead_code)]

use std::path::PathBuf;

use vmhost_plan::Backing;

#[path = "../../src/testutil.rs"]
mod testutil;
pub use testutil::plan;

pub const MIB: u64 = 1 << 20;
pub const PAGE_2M: u64 = 2 << 20;
pub const PAGE_1G: u64 = 1 << 30;

pub use vmhost_testsupport::{lock_pool, need_pages, pool};

/// Free pages of a size on node 0.
pub fn node0_free(page: u64) -> u64 {
    vmhost_testsupport::node_free(0, page)
}

/// True when hugepage tests should be skipped (`VMHOST_SKIP_HUGEPAGE_TESTS=1`).
pub fn skipping(test: &str) -> bool {
    vmhost_testsupport::hugepage_tests_skipped(test)
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
