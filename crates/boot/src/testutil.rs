//! Plans and guest memory built by hand for unit tests.

use vmhost_memory::GuestMemoryMmap;
use vmhost_memory::{GuestLayout, MMIO_HOLE_END, MMIO_HOLE_START};
use vmhost_plan::{Backing, GuestCell, Plan, VcpuPlacement};

/// A plan with vCPUs `(apic_id, guest_cell)` and cells `(memory_bytes, distances)`.
pub fn plan(vcpus: &[(u32, u32)], cells: &[(u64, Vec<u32>)]) -> Plan {
    let vcpus: Vec<VcpuPlacement> = vcpus
        .iter()
        .zip(0u32..)
        .map(|(&(apic_id, guest_cell), vcpu)| VcpuPlacement {
            vcpu,
            socket: 0,
            core: vcpu,
            thread: 0,
            apic_id,
            guest_cell,
            host_cpu: None,
            host_node: None,
        })
        .collect();
    let guest_cells: Vec<GuestCell> = cells
        .iter()
        .zip(0u32..)
        .map(|((memory_bytes, distances), cell)| GuestCell {
            cell,
            host_node: Some(cell),
            vcpus: vcpus
                .iter()
                .filter(|v| v.guest_cell == cell)
                .map(|v| v.vcpu)
                .collect(),
            memory_bytes: *memory_bytes,
            prefault_cpus: Vec::new(),
            distances: distances.clone(),
            spans: Vec::new(),
        })
        .collect();
    let mut plan = Plan::memory_only("test", guest_cells, Backing::Anonymous);
    plan.guest_topology.cores = u32::try_from(vcpus.len()).unwrap();
    plan.vcpus = vcpus;
    plan
}

/// Two cells of `cell_bytes` each, two vCPUs per cell (APIC IDs 0..4), distances 10/21.
pub fn two_cell_plan(cell_bytes: u64) -> Plan {
    plan(
        &[(0, 0), (1, 0), (2, 1), (3, 1)],
        &[(cell_bytes, vec![10, 21]), (cell_bytes, vec![21, 10])],
    )
}

/// The plan's layout with the default MMIO hole.
pub fn layout_of(plan: &Plan) -> GuestLayout {
    GuestLayout::from_plan(plan, MMIO_HOLE_START..MMIO_HOLE_END).unwrap()
}

/// Anonymous guest memory with one region per layout region.
pub fn guest_memory(layout: &GuestLayout) -> GuestMemoryMmap {
    layout.anonymous_memory().unwrap()
}
