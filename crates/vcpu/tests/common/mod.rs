//! Helpers shared by the KVM tests: opt-out variables, the cross-process CPU and hugepage-pool
//! locks, plans from TOML specs on the live host, guest memory.
#![allow(dead_code)]

use std::fs::File;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use vmhost_memory::{GuestMemory, MemoryOptions};
use vmhost_plan::{plan, Plan, PlanOptions};

/// True when KVM tests should run; prints a skip line when `VMHOST_SKIP_KVM_TESTS=1`, panics
/// when `/dev/kvm` is missing otherwise.
pub fn kvm_available(test: &str) -> bool {
    let _ = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::INFO)
        .with_test_writer()
        .try_init();
    if std::env::var("VMHOST_SKIP_KVM_TESTS").as_deref() == Ok("1") {
        println!("SKIP {test}: VMHOST_SKIP_KVM_TESTS=1");
        return false;
    }
    assert!(
        std::path::Path::new("/dev/kvm").exists(),
        "{test}: /dev/kvm is missing (set VMHOST_SKIP_KVM_TESTS=1 to skip KVM tests)"
    );
    true
}

/// True when hugepage tests should run (`VMHOST_SKIP_HUGEPAGE_TESTS=1` skips them).
pub fn hugepages_wanted(test: &str) -> bool {
    if std::env::var("VMHOST_SKIP_HUGEPAGE_TESTS").as_deref() == Ok("1") {
        println!("SKIP {test}: VMHOST_SKIP_HUGEPAGE_TESTS=1");
        return false;
    }
    true
}

/// An exclusive `flock`, held until dropped.
pub struct FileLock(File);

fn flock(path: &str) -> FileLock {
    let f = File::options()
        .create(true)
        .append(true)
        .open(path)
        .unwrap_or_else(|e| panic!("open {path}: {e}"));
    // SAFETY: `f` is an open file for the whole call; flock only takes a lock on it.
    let ret = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) };
    assert_eq!(ret, 0, "flock {path}: {}", std::io::Error::last_os_error());
    FileLock(f)
}

/// Serialises tests that pin threads (the host has 2 CPUs), across threads and processes.
pub fn lock_cpus() -> FileLock {
    flock("/tmp/vmhost-cpus.lock")
}

/// Held while a test uses the hugepage pool (shared with the other crates' tests).
pub fn lock_hugepages() -> FileLock {
    flock("/tmp/vmhost-hugepages.lock")
}

/// Free 2 MiB hugepages, host-wide.
pub fn free_2m_hugepages() -> u64 {
    let p = "/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages";
    std::fs::read_to_string(p)
        .unwrap_or_else(|e| panic!("read {p}: {e}"))
        .trim()
        .parse()
        .expect("a number")
}

/// Fails loudly when fewer than `pages` 2 MiB pages are free.
pub fn require_2m_hugepages(test: &str, pages: u64) {
    let free = free_2m_hugepages();
    assert!(
        free >= pages,
        "{test}: needs {pages} free 2 MiB hugepages, the pool has {free} \
         (echo N > /sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages, or VMHOST_SKIP_HUGEPAGE_TESTS=1)"
    );
}

/// Plans a TOML spec on this host.
pub fn plan_toml(toml: &str) -> Plan {
    let spec = vmhost_config::from_toml_str(toml, "test.toml")
        .expect("valid spec")
        .spec;
    let host = vmhost_topology::discover().expect("host topology");
    plan(&spec, &host, &PlanOptions::default())
        .into_result()
        .expect("the plan fits this host")
}

/// Allocates (and prefaults) the plan's guest memory.
pub fn memory(plan: &Plan) -> GuestMemory {
    GuestMemory::new(plan, &MemoryOptions::default()).expect("guest memory")
}

/// Polls `cond` every millisecond for up to `secs` seconds.
pub fn wait_for(secs: u64, mut cond: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < end {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    cond()
}
