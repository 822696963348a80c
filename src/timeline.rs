//! Start-up timeline on `CLOCK_MONOTONIC`, comparable across processes (a benchmark that
//! spawns vmhost reads the same clock before the spawn).

use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

/// Nanoseconds on `CLOCK_MONOTONIC`.
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for the duration of the call, and
    // CLOCK_MONOTONIC is always available on Linux.
    let ret = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    if ret != 0 {
        return 0;
    }
    u64::try_from(ts.tv_sec).unwrap_or(0) * 1_000_000_000 + u64::try_from(ts.tv_nsec).unwrap_or(0)
}

static MAIN_NS: AtomicU64 = AtomicU64::new(0);

/// Records the moment `main` was entered.
pub fn mark_main() {
    MAIN_NS.store(now_ns(), Ordering::Relaxed);
}

/// When each start-up step ended (`CLOCK_MONOTONIC` ns; 0 when not reached).
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Timeline {
    /// `main` entered.
    pub main_ns: u64,
    /// The spec loaded and its boot inputs (kernel, initrd headers) checked.
    pub spec_loaded_ns: u64,
    /// The host's topology discovered (hwloc) and its hugepage pools read.
    pub host_discovered_ns: u64,
    /// Admitted through the host ledger (spec parsed, host discovered, plan made).
    pub admitted_ns: u64,
    /// Guest memory allocated, bound and prefaulted.
    pub memory_ready_ns: u64,
    /// KVM VM and vCPU state created.
    pub vm_created_ns: u64,
    /// Every vCPU thread pinned and its vCPU configured: the guest is released now.
    pub vcpus_runnable_ns: u64,
}

impl Timeline {
    /// A timeline whose `main_ns` is the recorded `main` entry.
    pub fn start() -> Self {
        Timeline {
            main_ns: MAIN_NS.load(Ordering::Relaxed),
            ..Default::default()
        }
    }
}
