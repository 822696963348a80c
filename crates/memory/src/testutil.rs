//! Plans built by hand for unit tests.

use std::collections::BTreeMap;

use vmhost_config::{BootSpec, CpuTopology, Payload};
use vmhost_plan::{Backing, EmulatorPlacement, Envelope, GuestCell, OverheadModel, Plan};

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
    Plan {
        name: "test".to_string(),
        guest_topology: CpuTopology {
            sockets: 1,
            cores: 1,
            threads: 1,
        },
        envelope: Envelope {
            overhead_model: OverheadModel::default(),
            guest_memory_bytes: cells.iter().map(|c| c.1).sum(),
            overhead_bytes: 0,
            overhead_terms: BTreeMap::new(),
            memory_request_bytes: 0,
            memory_limit_bytes: None,
            cpus: 0.0,
            dedicated_cpus: 0,
            hugepages: Vec::new(),
        },
        vcpus: Vec::new(),
        floating_cpus: Vec::new(),
        emulator: EmulatorPlacement {
            host_cpus: Vec::new(),
            isolated: false,
        },
        guest_cells,
        backing,
        boot: BootSpec::Payload {
            payload: Payload::Touch,
        },
        notes: Vec::new(),
    }
}
