//! Plans built by hand for unit tests.

use vmhost_plan::{Backing, GuestCell, Plan};

/// A plan with one cell per `(host node, memory)` entry, numbered in order.
pub fn plan_with(cells: &[(Option<u32>, u64)], backing: Backing) -> Plan {
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
        })
        .collect();
    Plan::memory_only("test", guest_cells, backing)
}
