//! A plan built by hand for unit tests: 2 pinned vCPUs on PUs 0-1, emulator on PU 2, one guest
//! cell on node 0, 64 MiB of 2 MiB hugepages.

use std::collections::BTreeMap;

use vmhost_config::{BootSpec, CpuTopology, Payload};
use vmhost_plan::{
    Backing, EmulatorPlacement, Envelope, GuestCell, HugepageDemand, OverheadModel, Plan,
    VcpuPlacement,
};

const MIB: u64 = 1 << 20;

pub fn plan() -> Plan {
    let vcpu = |i: u32| VcpuPlacement {
        vcpu: i,
        socket: 0,
        core: i,
        thread: 0,
        apic_id: i,
        guest_cell: 0,
        host_cpu: Some(i),
        host_node: Some(0),
    };
    Plan {
        name: "test".to_string(),
        guest_topology: CpuTopology {
            sockets: 1,
            cores: 2,
            threads: 1,
        },
        envelope: Envelope {
            overhead_model: OverheadModel::default(),
            guest_memory_bytes: 64 * MIB,
            overhead_bytes: 9 * MIB,
            overhead_terms: BTreeMap::new(),
            memory_request_bytes: 9 * MIB,
            memory_limit_bytes: Some(9 * MIB),
            cpus: 3.0,
            dedicated_cpus: 3,
            hugepages: vec![HugepageDemand {
                node: Some(0),
                page_size_bytes: 2 * MIB,
                count: 32,
            }],
        },
        vcpus: vec![vcpu(0), vcpu(1)],
        floating_cpus: Vec::new(),
        emulator: EmulatorPlacement {
            host_cpus: vec![2],
            isolated: true,
        },
        guest_cells: vec![GuestCell {
            cell: 0,
            host_node: Some(0),
            vcpus: vec![0, 1],
            memory_bytes: 64 * MIB,
            prefault_cpus: vec![0, 1, 2],
            distances: vec![10],
            spans: vec![],
        }],
        backing: Backing::Hugetlb {
            page_size_bytes: 2 * MIB,
            hugetlbfs: None,
        },
        boot: BootSpec::Payload {
            payload: Payload::Touch,
        },
        devices: Default::default(),
        realtime: None,
        distances: Default::default(),
        notes: Vec::new(),
    }
}
