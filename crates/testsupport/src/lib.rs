//! Test helpers shared by vmhost's crates (a dev-dependency only).
//!
//! Tests that use host resources serialize on them across test binaries and crates with
//! `flock`: [`lock_pool`] for the hugepage pool, [`lock_cpus`] for tests that pin threads or run
//! vCPUs on the host's few CPUs. Tests that need hugepages or `/dev/kvm` fail with
//! instructions when they are missing, unless the explicit opt-out variable is set
//! ([`SKIP_HUGEPAGES`], [`SKIP_KVM`]); CI never sets them.
#![warn(missing_docs)]
#![allow(clippy::unwrap_used, clippy::missing_panics_doc)]

pub mod dirwatch;
pub mod outer_seccomp;
pub mod pvh;
pub mod stats;

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::PathBuf;

/// Opt-out variable for tests that need hugepages.
pub const SKIP_HUGEPAGES: &str = "VMHOST_SKIP_HUGEPAGE_TESTS";
/// Opt-out variable for tests that need `/dev/kvm`.
pub const SKIP_KVM: &str = "VMHOST_SKIP_KVM_TESTS";
/// Opt-out variable for tests that need the test kernel.
pub const SKIP_KERNEL: &str = "VMHOST_SKIP_KERNEL_TESTS";

/// An exclusive `flock` held until dropped (closing the file releases it).
#[derive(Debug)]
pub struct HostLock {
    _file: File,
}

fn lock(path: &str) -> HostLock {
    let f = File::options()
        .create(true)
        .append(true)
        .open(path)
        .unwrap_or_else(|e| panic!("open {path}: {e}"));
    // SAFETY: `f` is an open file descriptor for the whole call; flock only locks it.
    let ret = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) };
    assert_eq!(ret, 0, "flock {path}: {}", std::io::Error::last_os_error());
    HostLock { _file: f }
}

/// Held while a test uses the hugepage pool.
pub fn lock_pool() -> HostLock {
    lock("/tmp/vmhost-hugepages.lock")
}

/// Held while a test pins threads or runs vCPUs on the host's CPUs.
pub fn lock_cpus() -> HostLock {
    lock("/tmp/vmhost-cpus.lock")
}

fn opted_out(var: &str, test: &str) -> bool {
    if std::env::var(var).as_deref() == Ok("1") {
        println!("SKIP {test}: {var}=1");
        return true;
    }
    false
}

fn pool_dir(page: u64) -> PathBuf {
    PathBuf::from(format!(
        "/sys/kernel/mm/hugepages/hugepages-{}kB",
        page / 1024
    ))
}

fn read_u64(path: &str) -> u64 {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("read {path}: {e}"))
        .trim()
        .parse()
        .unwrap()
}

/// `(free, reserved)` pages of `page` bytes, host-wide.
pub fn pool(page: u64) -> (u64, u64) {
    let d = pool_dir(page);
    let f = |n: &str| read_u64(&d.join(n).display().to_string());
    (f("free_hugepages"), f("resv_hugepages"))
}

/// Free pages of `page` bytes on `node`.
pub fn node_free(node: u32, page: u64) -> u64 {
    read_u64(&format!(
        "/sys/devices/system/node/node{node}/hugepages/hugepages-{}kB/free_hugepages",
        page / 1024
    ))
}

/// True (after printing a skip line) when hugepage tests are opted out.
pub fn hugepage_tests_skipped(test: &str) -> bool {
    opted_out(SKIP_HUGEPAGES, test)
}

/// Returns false (after printing a skip line) when hugepage tests are opted out; panics with
/// instructions when fewer than `count` pages of `page` bytes are available on node 0.
pub fn need_pages(test: &str, page: u64, count: u64) -> bool {
    if opted_out(SKIP_HUGEPAGES, test) {
        return false;
    }
    let dir = pool_dir(page);
    assert!(
        dir.exists(),
        "{test}: the kernel has no {} KiB hugepage size",
        page / 1024
    );
    let (free, resv) = pool(page);
    let available = free.saturating_sub(resv).min(node_free(0, page));
    assert!(
        available >= count,
        "{test} needs {count} free {} KiB hugepages on node0, the host has {available} ({free} free, {resv} reserved). \
         Reserve them with `echo N > {}/nr_hugepages` as root (make test does), or set {SKIP_HUGEPAGES}=1 to skip",
        page / 1024,
        dir.display()
    );
    true
}

/// Whether the host kernel runs KVM's PIT thread (`kvm-pit/<pid>`) for a VM that process
/// `pid` created: the kernel's own account of an in-kernel PIT.
pub fn has_kvm_pit(pid: u32) -> bool {
    let want = format!("kvm-pit/{pid}");
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .any(|e| std::fs::read_to_string(e.path().join("comm")).is_ok_and(|c| c.trim() == want))
}

/// Returns false (after printing a skip line) when KVM tests are opted out; panics when
/// `/dev/kvm` cannot be opened.
pub fn need_kvm(test: &str) -> bool {
    if opted_out(SKIP_KVM, test) {
        return false;
    }
    if let Err(e) = File::options().read(true).write(true).open("/dev/kvm") {
        panic!("{test} needs /dev/kvm ({e}); run on a host with KVM, or set {SKIP_KVM}=1 to skip");
    }
    true
}

/// The test kernel's file `name` (`vmlinux`, `bzImage`) in `$VMHOST_TEST_KERNEL_DIR`, default
/// `<workspace>/target/test-kernel` (written by `crates/boot/scripts/fetch-test-kernel.sh`).
/// Returns `None` (after printing a skip line) when it is missing and kernel tests are opted
/// out; panics with the fix otherwise.
pub fn test_kernel_file(name: &str) -> Option<PathBuf> {
    let dir = std::env::var_os("VMHOST_TEST_KERNEL_DIR").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/test-kernel"),
        PathBuf::from,
    );
    let path = dir.join(name);
    if path.is_file() {
        return Some(path);
    }
    if opted_out(SKIP_KERNEL, &format!("{} missing", path.display())) {
        return None;
    }
    panic!(
        "test kernel {} is missing: run crates/boot/scripts/fetch-test-kernel.sh (or set {SKIP_KERNEL}=1 to skip)",
        path.display()
    );
}
