//! Helpers shared by the KVM tests: opt-out variables, the cross-process CPU and hugepage-pool
//! locks, plans from TOML specs on the live host, guest memory.
#![allow(dead_code, unused_imports)]

pub use vmhost_testsupport::pvh;

use std::time::{Duration, Instant};

use vmhost_memory::{GuestMemory, MemoryOptions};
use vmhost_plan::{plan, Plan, PlanOptions};

pub use vmhost_testsupport::{lock_cpus, lock_pool as lock_hugepages};

/// True when KVM tests should run; prints a skip line when `VMHOST_SKIP_KVM_TESTS=1`, panics
/// when `/dev/kvm` is missing otherwise.
pub fn kvm_available(test: &str) -> bool {
    let _ = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::INFO)
        .with_test_writer()
        .try_init();
    vmhost_testsupport::need_kvm(test)
}

/// True when hugepage tests should run (`VMHOST_SKIP_HUGEPAGE_TESTS=1` skips them).
pub fn hugepages_wanted(test: &str) -> bool {
    !vmhost_testsupport::hugepage_tests_skipped(test)
}

/// Free 2 MiB hugepages, host-wide.
pub fn free_2m_hugepages() -> u64 {
    vmhost_testsupport::pool(2 << 20).0
}

/// Fails loudly when fewer than `pages` 2 MiB pages are available on node 0.
pub fn require_2m_hugepages(test: &str, pages: u64) {
    vmhost_testsupport::need_pages(test, 2 << 20, pages);
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
