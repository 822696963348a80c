//! What the memory benchmarks share: their environment knobs and the one-cell plan they
//! allocate.

use vmhost_plan::Backing;

/// A 2 MiB hugepage.
pub const PAGE: u64 = 2 << 20;

/// The value of the environment variable `name` as a number, or `default`.
pub fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A plan named `name` of one guest cell of `bytes` in 2 MiB hugepages on node 0, prefaulted
/// by workers on `cpus`.
pub fn plan(name: &str, bytes: u64, cpus: &[u32]) -> vmhost_plan::Plan {
    let cell = vmhost_plan::GuestCell {
        cell: 0,
        host_node: Some(0),
        vcpus: vec![0],
        memory_bytes: bytes,
        prefault_cpus: cpus.to_vec(),
        distances: vec![10],
        spans: vec![],
    };
    let backing = Backing::Hugetlb {
        page_size_bytes: PAGE,
        hugetlbfs: None,
    };
    vmhost_plan::Plan::memory_only(name, vec![cell], backing)
}
