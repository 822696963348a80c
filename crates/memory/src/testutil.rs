//! Plans built by hand for tests: the crate's unit tests use this module, its integration tests
//! include the same file (`tests/common/mod.rs`).

use vmhost_plan::{Backing, GuestCell, Plan};

/// A plan named `name` with one cell per `(host node, memory)` entry, cells numbered in order.
pub fn plan(name: &str, cells: &[(Option<u32>, u64)], backing: Backing) -> Plan {
    let guest_cells: Vec<GuestCell> = cells
        .iter()
        .zip(0u32..)
        .map(|(&(host_node, memory_bytes), cell)| GuestCell {
            cell,
            host_node,
            vcpus: vec![cell],
            memory_bytes,
            prefault_cpus: Vec::new(),
            distances: vec![10; cells.len()],
            spans: vec![],
        })
        .collect();
    Plan::memory_only(name, guest_cells, backing)
}
