//! Planning for a guest that already exists: a migration target, or a restore.
//!
//! A running guest has seen its topology: its CPU topology and APIC IDs, its NUMA cells
//! (which vCPUs, how much memory, in which guest-physical order), the distances between them
//! and the page size backing them. [`GuestIdentity`] is that view, taken from the source's
//! plan ([`Plan::guest_identity`]) and saved with the VM. [`plan_for_guest`] plans the same
//! spec on this host keeping the identity exactly: it only chooses host nodes and PUs. It
//! reuses the planner's stages (PU taking, emulator and I/O pool placement, devices, memory
//! admission, envelope); what differs is that the cells are given, not derived from where the
//! vCPUs land. The cell → node choice itself is [`crate::cellmap`]'s.

use serde::{Deserialize, Serialize};
use vmhost_config::{format_bytes, VmSpec};
use vmhost_topology::HostTopology;

use crate::model::{GuestCell, Plan, Reason, VcpuPlacement};
use crate::placement::FreePus;
use crate::{cellmap, cells, iothreads, memory, Outcome, PlanOptions};

/// One vCPU as the guest sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdentityVcpu {
    /// vCPU index (= KVM vcpu id).
    pub vcpu: u32,
    /// Its x2APIC / APIC ID.
    pub apic_id: u32,
    /// Guest socket.
    pub socket: u32,
    /// Core within the socket.
    pub core: u32,
    /// Thread within the core.
    pub thread: u32,
}

/// One NUMA cell as the guest sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdentityCell {
    /// Cell number (0..), in guest-physical memory order.
    pub cell: u32,
    /// Its vCPUs, ascending.
    pub vcpus: Vec<IdentityVcpu>,
    /// Its memory.
    pub memory_bytes: u64,
    /// The distances the guest was given from this cell to every cell (its SLIT row).
    pub distances: Vec<u32>,
}

/// What a running guest has seen of its topology; a plan for it elsewhere must keep all of it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestIdentity {
    /// Guest sockets.
    pub sockets: u32,
    /// Cores per socket.
    pub cores: u32,
    /// Threads per core.
    pub threads: u32,
    /// Page size backing guest memory (4096 for anonymous memory).
    pub page_size_bytes: u64,
    /// The NUMA cells, by cell number.
    pub cells: Vec<IdentityCell>,
    /// Whether the guest was told its vCPUs are never preempted (`KVM_HINTS_REALTIME`,
    /// [`Plan::vcpu_pus_exclusive`]).
    pub realtime_hint: bool,
}

impl GuestIdentity {
    /// The distance matrix the guest was given (rows and columns by cell).
    pub fn distance_matrix(&self) -> Vec<Vec<u32>> {
        self.cells.iter().map(|c| c.distances.clone()).collect()
    }

    /// Guest memory in all.
    pub fn memory_bytes(&self) -> u64 {
        self.cells.iter().map(|c| c.memory_bytes).sum()
    }
}

impl Plan {
    /// What the guest of this plan sees of its topology: the identity a plan on another host
    /// (or for a restore) must keep.
    ///
    /// ```
    /// use vmhost_plan::{plan, plan_for_guest, PlanOptions};
    /// let spec = vmhost_config::from_toml_str(
    ///     "[cpu]\ncores = 4\ndedicated_cpu_placement = true\nnuma = { guest_mapping_passthrough = true }\n\
    ///      [memory]\nguest = \"64Mi\"\nhugepages = { page_size = \"2Mi\" }\n",
    ///     "vm.toml",
    /// ).unwrap().spec;
    /// let mut source = vmhost_topology::load_synthetic("package:2 numa:1 core:2 pu:1").unwrap();
    /// let pools = vmhost_topology::parse_hugepages_arg("node0:2Mi=32,node1:2Mi=32").unwrap();
    /// vmhost_topology::apply_hugepages(&mut source, &pools).unwrap();
    /// let id = plan(&spec, &source, &PlanOptions::default()).into_result().unwrap().guest_identity();
    /// assert_eq!(id.cells.len(), 2);
    /// // A host with one node of 8 PUs holds both cells there; the guest keeps its 2 cells.
    /// let mut target = vmhost_topology::load_synthetic("package:1 numa:1 core:8 pu:1").unwrap();
    /// let pools = vmhost_topology::parse_hugepages_arg("node0:2Mi=64").unwrap();
    /// vmhost_topology::apply_hugepages(&mut target, &pools).unwrap();
    /// let o = plan_for_guest(&spec, &target, &id, &PlanOptions::default());
    /// assert!(o.fits, "{:?}", o.reasons);
    /// assert_eq!(o.plan.guest_identity(), id);
    /// assert_eq!(o.plan.distances.diff.len(), 2); // guest 20 apart, host 10
    /// ```
    pub fn guest_identity(&self) -> GuestIdentity {
        let vcpu = |i: u32| {
            self.vcpus
                .iter()
                .find(|v| v.vcpu == i)
                .map(|v| IdentityVcpu {
                    vcpu: v.vcpu,
                    apic_id: v.apic_id,
                    socket: v.socket,
                    core: v.core,
                    thread: v.thread,
                })
        };
        let t = self.guest_topology;
        GuestIdentity {
            sockets: t.sockets,
            cores: t.cores,
            threads: t.threads,
            page_size_bytes: self.backing.page_size_bytes(),
            cells: self
                .guest_cells
                .iter()
                .map(|c| IdentityCell {
                    cell: c.cell,
                    vcpus: c.vcpus.iter().filter_map(|&i| vcpu(i)).collect(),
                    memory_bytes: c.memory_bytes,
                    distances: c.distances.clone(),
                })
                .collect(),
            realtime_hint: self.vcpu_pus_exclusive(),
        }
    }
}

/// Plans `spec` on `host` for the existing guest `identity`: the guest keeps its CPU topology,
/// APIC IDs, cells (vCPUs and memory per cell, in order), page size and the distances it was
/// given; the planner only chooses host nodes and PUs, under the same constraints as
/// [`crate::plan`] (allowed PUs and memory nodes, PUs other VMs hold, hugepage pools per node,
/// the cgroup's hugetlb limit, dedicated CPUs, the emulator's and I/O pool's PUs).
///
/// Each cell goes to one host node; two cells share a node only when no set of distinct nodes
/// holds them. [`Plan::distances`] reports the pairs whose host distance differs from the
/// guest's; with [`PlanOptions::same_distances`] they are a refusal ([`Reason::Distances`]).
/// A spec that does not match the identity is refused with [`Reason::GuestIdentity`] naming
/// the field.
pub fn plan_for_guest(
    spec: &VmSpec,
    host: &HostTopology,
    identity: &GuestIdentity,
    opts: &PlanOptions,
) -> Outcome {
    let mismatch = check_identity(spec, identity);
    if !mismatch.is_empty() {
        let mut o = crate::plan(spec, host, opts);
        let mut all = mismatch;
        all.append(&mut o.reason_details);
        o.reason_details = all;
        o.reasons = o.reason_details.iter().map(ToString::to_string).collect();
        o.fits = false;
        return o;
    }
    let mut o = if identity.cells.len() <= 1 {
        one_cell(spec, host, identity, opts)
    } else {
        keep_cells(spec, host, identity, opts)
    };
    if identity.realtime_hint && o.fits && !o.plan.vcpu_pus_exclusive() {
        o.reason_details.push(Reason::GuestIdentity {
            field: "cpu.isolate_emulator_thread".into(),
            detail: "the guest was told its vCPUs are never preempted (KVM_HINTS_REALTIME) but this plan does not give each vCPU a PU of its own".into(),
        });
        o.reasons = o.reason_details.iter().map(ToString::to_string).collect();
        o.fits = false;
    }
    o
}

/// A guest with one NUMA cell: the ordinary planner without NUMA passthrough gives exactly
/// one cell (its memory may span nodes, bound per node, as a fresh plan's may).
fn one_cell(
    spec: &VmSpec,
    host: &HostTopology,
    identity: &GuestIdentity,
    opts: &PlanOptions,
) -> Outcome {
    let mut one = spec.clone();
    let passthrough = one.cpu.numa_passthrough;
    one.cpu.numa_passthrough = false;
    let mut o = crate::plan(&one, host, opts);
    if let (Some(c), Some(saved)) = (o.plan.guest_cells.first_mut(), identity.cells.first()) {
        c.distances = saved.distances.clone();
    }
    o.plan.distances = crate::CellDistances::of(host, &o.plan.guest_cells);
    if passthrough {
        o.plan.notes.push(
            "the saved guest has one NUMA cell and keeps it: NUMA passthrough does not add cells to a running guest".into(),
        );
    }
    o
}

/// A guest with several cells: each cell on one host node, its vCPUs on that node's PUs.
fn keep_cells(
    spec: &VmSpec,
    host: &HostTopology,
    identity: &GuestIdentity,
    opts: &PlanOptions,
) -> Outcome {
    let mut reasons = Vec::new();
    let mut notes = Vec::new();
    let mut vcpus = cells::guest_vcpus(spec);
    let mut free = FreePus::new(host, &opts.held_cpus);
    let (n, emu, io) = (spec.vcpus(), spec.emulator_pus(), spec.io_pus());
    let available = free.total();
    let mut nodes = None;
    if available < n + io + emu {
        reasons.push(Reason::Cpus {
            needed: n + io + emu,
            available,
            detail: cells::need_detail(n, io, emu),
        });
    } else {
        let demand = cell_demand(spec, identity);
        let rooms = node_rooms(spec, host, &free);
        nodes = cellmap::choose(&demand, &rooms, host);
        if nodes.is_none() {
            reasons.push(no_room(spec, host, &demand, &rooms));
        }
    }
    let mut extra = cells::ExtraPus::default();
    if let Some(nodes) = &nodes {
        take_cell_pus(spec, identity, nodes, &mut free, &mut vcpus, &mut notes);
        let home = vcpus.first().and_then(|v| v.host_node).unwrap_or(nodes[0]);
        extra = cells::place_extras(
            spec,
            host,
            &mut free,
            home,
            available,
            &mut reasons,
            &mut notes,
        );
        if nodes
            .iter()
            .enumerate()
            .any(|(i, n)| nodes[..i].contains(n))
        {
            notes.push("some of the saved guest's NUMA cells share a host node: no set of distinct nodes has room for them".into());
        }
    }
    for (cell, saved) in identity.cells.iter().enumerate() {
        for v in &saved.vcpus {
            if let Some(p) = vcpus.get_mut(v.vcpu as usize) {
                p.guest_cell = u32::try_from(cell).unwrap_or(u32::MAX);
            }
        }
    }
    let io_pool = extra.io_pool.clone();
    let emulator = crate::dedicated_emulator(spec, extra, &vcpus, &mut notes);
    let devices =
        iothreads::device_plan(spec, &emulator, &io_pool, &free, &mut reasons, &mut notes);
    let guest_cells = saved_cells(host, opts, identity, nodes.as_deref());
    let placed = crate::Placed {
        vcpus,
        floating_cpus: Vec::new(),
        emulator,
        devices,
        guest_cells,
    };
    crate::assemble(spec, host, opts, placed, reasons, notes)
}

/// What each saved cell needs on its node: (PUs, memory in the planner's units).
fn cell_demand(spec: &VmSpec, identity: &GuestIdentity) -> Vec<cellmap::Demand> {
    let unit = memory::unit(spec);
    identity
        .cells
        .iter()
        .map(|c| cellmap::Demand {
            pus: u32::try_from(c.vcpus.len()).unwrap_or(u32::MAX),
            pages: c.memory_bytes.div_ceil(unit),
            distances: c.distances.clone(),
        })
        .collect()
}

/// What every host node offers, in host order.
fn node_rooms(spec: &VmSpec, host: &HostTopology, free: &FreePus) -> Vec<cellmap::Room> {
    let pus = free.per_node(host);
    host.nodes
        .iter()
        .map(|n| cellmap::Room {
            node: n.os_index,
            pus: pus
                .iter()
                .find(|&&(m, _)| m == n.os_index)
                .map_or(0, |&(_, c)| c),
            pages: memory::capacity(spec, host, n.os_index),
        })
        .collect()
}

/// Takes each cell's PUs on its node, whole guest cores on sibling PUs where the node has
/// them, and records them on the cell's vCPUs.
fn take_cell_pus(
    spec: &VmSpec,
    identity: &GuestIdentity,
    nodes: &[u32],
    free: &mut FreePus,
    vcpus: &mut [VcpuPlacement],
    notes: &mut Vec<String>,
) {
    let t = spec.cpu.topology.threads.max(1);
    for (saved, &node) in identity.cells.iter().zip(nodes) {
        let count = u32::try_from(saved.vcpus.len()).unwrap_or(u32::MAX);
        let (groups, threads) = if count % t == 0 {
            (count / t, t)
        } else {
            (count, 1)
        };
        let Some((pus, straddled)) = free.take_groups(node, groups, threads) else {
            continue; // the node was chosen with room: cannot happen
        };
        if straddled {
            notes.push(format!("no host core on node{node} has {t} free PUs for every guest core of cell {}: some guest cores span host cores", saved.cell));
        }
        for (v, pu) in saved.vcpus.iter().zip(pus) {
            if let Some(p) = vcpus.get_mut(v.vcpu as usize) {
                p.host_cpu = Some(pu);
                p.host_node = Some(node);
            }
        }
    }
}

/// The saved cells as the plan's guest cells, on `nodes` (unbound when there are none).
fn saved_cells(
    host: &HostTopology,
    opts: &PlanOptions,
    identity: &GuestIdentity,
    nodes: Option<&[u32]>,
) -> Vec<GuestCell> {
    let usable = |node: u32| -> Vec<u32> {
        host.node(node).map_or_else(Vec::new, |n| {
            n.cpus
                .iter()
                .copied()
                .filter(|c| host.allowed_cpus.contains(c) && !opts.held_cpus.contains(c))
                .collect()
        })
    };
    identity
        .cells
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let node = nodes.and_then(|n| n.get(i).copied());
            GuestCell {
                cell: c.cell,
                host_node: node,
                vcpus: c.vcpus.iter().map(|v| v.vcpu).collect(),
                memory_bytes: c.memory_bytes,
                prefault_cpus: node.map(usable).unwrap_or_default(),
                distances: c.distances.clone(),
                spans: Vec::new(),
            }
        })
        .collect()
}

/// Why no host nodes hold the saved cells: each cell's needs and each node's room.
fn no_room(
    spec: &VmSpec,
    host: &HostTopology,
    demand: &[cellmap::Demand],
    rooms: &[cellmap::Room],
) -> Reason {
    let unit = format_bytes(memory::unit(spec));
    let cells: Vec<String> = demand
        .iter()
        .enumerate()
        .map(|(i, d)| format!("cell {i}: {} PUs and {} {unit} pages", d.pus, d.pages))
        .collect();
    let nodes: Vec<String> = rooms
        .iter()
        .map(|r| {
            let pages = if r.pages == u64::MAX {
                "unknown memory".to_string()
            } else {
                format!("{} free {unit} pages", r.pages)
            };
            format!("node{}: {} free PUs, {pages}", r.node, r.pus)
        })
        .collect();
    let detail = format!(
        "no host nodes hold the saved guest's {} NUMA cells unchanged (each cell's vCPUs and memory on one node). Needed: {}. Free per node: {}",
        demand.len(),
        cells.join("; "),
        nodes.join("; ")
    );
    match memory::confining_mems(host) {
        Some((cgroup, allowed)) => Reason::CgroupMems {
            cgroup,
            allowed,
            detail,
        },
        None => Reason::NumaSplit { detail },
    }
}

/// Where `spec` contradicts what the guest has seen, one [`Reason::GuestIdentity`] per field
/// (empty when the spec fits the identity). Host-independent: a restore checks it before
/// anything is planned or allocated; [`plan_for_guest`] refuses with the same reasons.
pub fn check_identity(spec: &VmSpec, id: &GuestIdentity) -> Vec<Reason> {
    let mut out = Vec::new();
    let mut bad = |field: &str, detail: String| {
        out.push(Reason::GuestIdentity {
            field: field.into(),
            detail,
        })
    };
    let t = spec.cpu.topology;
    if (t.sockets, t.cores, t.threads) != (id.sockets, id.cores, id.threads) {
        bad(
            "cpu.sockets/cores/threads",
            format!(
                "the spec gives {}x{}x{}, the guest has {}x{}x{}; plan with the VM's own spec",
                t.sockets, t.cores, t.threads, id.sockets, id.cores, id.threads
            ),
        );
    }
    let page = spec
        .memory
        .hugepages
        .as_ref()
        .map_or(4096, |h| h.page_size_bytes);
    if page != id.page_size_bytes {
        bad(
            "memory.hugepages.page_size",
            format!(
                "the spec backs guest memory with {} pages, the guest's memory is in {} pages",
                format_bytes(page),
                format_bytes(id.page_size_bytes)
            ),
        );
    }
    if spec.memory.guest_ram_bytes() != id.memory_bytes() {
        bad(
            "memory.guest",
            format!(
                "the spec gives {}, the guest has {}",
                format_bytes(spec.memory.guest_ram_bytes()),
                format_bytes(id.memory_bytes())
            ),
        );
    }
    let mut seen: Vec<&IdentityVcpu> = id.cells.iter().flat_map(|c| &c.vcpus).collect();
    seen.sort_by_key(|v| v.vcpu);
    let expect = cells::guest_vcpus(spec);
    let same = seen.len() == expect.len()
        && seen.iter().zip(&expect).all(|(s, e)| {
            (s.vcpu, s.apic_id, s.socket, s.core, s.thread)
                == (e.vcpu, e.apic_id, e.socket, e.core, e.thread)
        });
    if !same {
        bad("cpu", format!(
            "the guest's {} vCPUs (each in one cell) do not have the {} vCPUs and APIC IDs the spec gives",
            seen.len(),
            expect.len()
        ));
    }
    let k = id.cells.len();
    let shaped = id.cells.iter().enumerate().all(|(i, c)| {
        c.cell as usize == i
            && c.distances.len() == k
            && c.memory_bytes % id.page_size_bytes.max(1) == 0
    });
    if !shaped {
        bad("guest identity", "cells are not numbered 0.. in order, a distance row is not one per cell, or a cell's memory is not whole pages: the saved identity is damaged".into());
    }
    if k > 1 && !spec.cpu.dedicated_cpu_placement {
        bad("cpu.dedicated_cpu_placement", format!(
            "the guest has {k} NUMA cells, each pinned to a host node: plan it with dedicated_cpu_placement = true"
        ));
    }
    out
}
