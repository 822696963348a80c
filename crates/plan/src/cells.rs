//! vCPU coordinates, dedicated placement on the chosen nodes, guest NUMA cells and memory
//! admission.

use std::collections::BTreeMap;

use vmhost_config::{format_bytes, VmSpec};
use vmhost_topology::{cpulist, HostTopology};

use crate::memory;
use crate::model::{Backing, GuestCell, HugepageDemand, MemorySpan, Reason, VcpuPlacement};
use crate::nodeset::{self, Request};
use crate::placement::FreePus;
use crate::PlanOptions;

/// Bits needed to number `n` items (x86 APIC ID field width).
fn bits(n: u32) -> u32 {
    if n <= 1 {
        0
    } else {
        32 - (n - 1).leading_zeros()
    }
}

/// vCPUs with their guest coordinates and APIC IDs, not yet placed.
pub fn guest_vcpus(spec: &VmSpec) -> Vec<VcpuPlacement> {
    let t = spec.cpu.topology;
    let (tb, cb) = (bits(t.threads), bits(t.cores));
    (0..t.vcpus())
        .map(|i| {
            let thread = i % t.threads;
            let core = (i / t.threads) % t.cores;
            let socket = i / (t.threads * t.cores);
            VcpuPlacement {
                vcpu: i,
                socket,
                core,
                thread,
                apic_id: (socket << (cb + tb)) | (core << tb) | thread,
                guest_cell: 0,
                host_cpu: None,
                host_node: None,
            }
        })
        .collect()
}

/// PUs a dedicated VM holds besides its vCPUs.
#[derive(Debug, Default)]
pub struct ExtraPus {
    /// The isolated emulator's PUs.
    pub emulator: Vec<u32>,
    /// The supplemental I/O thread pool's PUs, one per thread.
    pub io_pool: Vec<u32>,
}

/// Places the vCPUs of a dedicated VM; returns the supplemental I/O pool's and the isolated
/// emulator's PUs (empty when there are none or they could not be placed).
pub fn place_dedicated(
    spec: &VmSpec,
    host: &HostTopology,
    free: &mut FreePus,
    vcpus: &mut [VcpuPlacement],
    reasons: &mut Vec<Reason>,
    notes: &mut Vec<String>,
) -> ExtraPus {
    let t = spec.cpu.topology.threads;
    let n = spec.vcpus();
    let (emu, io) = (spec.emulator_pus(), spec.io_pus());
    let need = n + io + emu;
    let available = free.total();
    let detail = need_detail(n, io, emu);
    if available < need {
        reasons.push(Reason::Cpus {
            needed: need,
            available,
            detail,
        });
        return ExtraPus::default();
    }
    let stats = memory::node_stats(spec, host, free);
    let req = Request {
        groups: n / t,
        threads: t,
        cores_per_socket: spec.cpu.topology.cores,
        emulator: emu + io,
        pages: memory::guest_pages(spec),
        passthrough: spec.cpu.numa_passthrough,
    };
    let Some(choice) = nodeset::choose(&stats, host, &req) else {
        reasons.push(memory::no_node_set(spec, host, &stats, &req, &detail));
        return ExtraPus::default();
    };
    let mut pus: Vec<(u32, u32)> = Vec::new(); // (pu, node) in vCPU order
    for &(node, g) in choice.take.iter().filter(|&&(_, g)| g > 0) {
        if let Some((got, straddled)) = free.take_groups(node, g, t) {
            if straddled {
                notes.push(format!("no host core on node{node} has {t} free PUs for every guest core: some guest cores span host cores"));
            }
            pus.extend(got.into_iter().map(|p| (p, node)));
        }
    }
    if choice.straddling > 0 {
        take_straddling(free, &choice, t, &mut pus, notes);
    }
    if choice.take.len() > 1 && !spec.cpu.numa_passthrough {
        let nodes: Vec<String> = choice
            .take
            .iter()
            .map(|(n, _)| format!("node{n}"))
            .collect();
        notes.push(format!(
            "vCPUs span host nodes {} but the guest sees one NUMA cell; enable cpu.numa.guest_mapping_passthrough to expose them",
            nodes.join(", ")
        ));
    }
    for (v, &(pu, node)) in vcpus.iter_mut().zip(&pus) {
        v.host_cpu = Some(pu);
        v.host_node = Some(node);
    }
    let Some(home) = pus.first().map(|&(_, node)| node) else {
        return ExtraPus::default();
    };
    place_extras(spec, host, free, home, available, reasons, notes)
}

/// The supplemental I/O pool's and the isolated emulator's PUs of a dedicated VM whose vCPU 0
/// runs on node `home`; `available`: the free PUs before the vCPUs were taken (for the
/// reason when they do not fit).
pub(crate) fn place_extras(
    spec: &VmSpec,
    host: &HostTopology,
    free: &mut FreePus,
    home: u32,
    available: u32,
    reasons: &mut Vec<Reason>,
    notes: &mut Vec<String>,
) -> ExtraPus {
    let (n, emu, io) = (spec.vcpus(), spec.emulator_pus(), spec.io_pus());
    // KubeVirt pins the supplemental pool before the emulator thread.
    let io_pool = place_emulator(
        host,
        free,
        home,
        io,
        "the supplemental I/O threads run",
        notes,
    );
    let emulator = place_emulator(host, free, home, emu, "the emulator thread runs", notes);
    if let (Some(io_pool), Some(emulator)) = (io_pool, emulator) {
        return ExtraPus { emulator, io_pool };
    }
    reasons.push(Reason::Cpus {
        needed: n + io + emu,
        available,
        detail: need_detail(n, io, emu),
    });
    ExtraPus::default()
}

/// What a dedicated VM's PUs are for: `n` vCPUs, `io` supplemental I/O thread PUs, `emu`
/// isolated emulator PUs.
pub(crate) fn need_detail(n: u32, io: u32, emu: u32) -> String {
    let mut detail = format!("{n} vCPUs");
    if io > 0 {
        detail.push_str(&format!(" + {io} supplemental I/O thread PUs"));
    }
    match emu {
        0 => {}
        1 => detail.push_str(" + 1 isolated emulator thread"),
        _ => detail.push_str(" + 2 PUs of the isolated emulator thread (even parity)"),
    }
    detail
}

/// Without passthrough, guest cores no node has room for straddle nodes: the set's leftovers.
fn take_straddling(
    free: &mut FreePus,
    choice: &nodeset::Choice,
    t: u32,
    pus: &mut Vec<(u32, u32)>,
    notes: &mut Vec<String>,
) {
    // Without passthrough a guest core may straddle nodes: use the set's leftovers.
    let mut missing = choice.straddling * t;
    for &(node, _) in &choice.take {
        while missing > 0 {
            let Some((got, _)) = free.take_groups(node, 1, 1) else {
                break;
            };
            pus.extend(got.into_iter().map(|p| (p, node)));
            missing -= 1;
        }
    }
    notes.push(
        "some guest cores span host NUMA nodes, so they span host cores (no node has room for them whole)"
            .into(),
    );
}

/// `count` PUs for the isolated emulator (or the supplemental I/O pool, `what`): on vCPU 0's
/// node `home` when it has room.
fn place_emulator(
    host: &HostTopology,
    free: &mut FreePus,
    home: u32,
    count: u32,
    what: &str,
    notes: &mut Vec<String>,
) -> Option<Vec<u32>> {
    let mut out: Vec<u32> = Vec::new();
    for _ in 0..count {
        let near = out.first().copied();
        if let Some(pu) = free.take_emulator(home, near) {
            out.push(pu);
            continue;
        }
        let (node, pu) = free
            .per_node(host)
            .iter()
            .find_map(|&(node, _)| free.take_emulator(node, near).map(|pu| (node, pu)))?;
        notes.push(format!(
            "{what} on node{node}: vCPU 0's node{home} has no PU left"
        ));
        out.push(pu);
    }
    Some(out)
}

/// Builds the guest cells: one per host node holding vCPUs with NUMA passthrough, else one.
pub fn guest_cells(
    spec: &VmSpec,
    host: &HostTopology,
    opts: &PlanOptions,
    vcpus: &mut [VcpuPlacement],
    floating: &[u32],
    reasons: &mut Vec<Reason>,
    notes: &mut Vec<String>,
) -> Vec<GuestCell> {
    let usable = |node: Option<u32>| -> Vec<u32> {
        match node.and_then(|n| host.node(n)) {
            Some(n) => n
                .cpus
                .iter()
                .copied()
                .filter(|c| host.allowed_cpus.contains(c) && !opts.held_cpus.contains(c))
                .collect(),
            None => floating.to_vec(),
        }
    };
    let (nodes, sizes, mut spans) =
        cell_nodes(spec, host, vcpus, floating, &usable, reasons, notes);
    let mut cells = Vec::new();
    for (i, (node, memory_bytes)) in nodes.iter().zip(sizes).enumerate() {
        let cell = u32::try_from(i).unwrap_or(u32::MAX);
        let members: Vec<u32> = vcpus
            .iter_mut()
            .filter(|v| nodes.len() == 1 || v.host_node == *node)
            .map(|v| {
                v.guest_cell = cell;
                v.vcpu
            })
            .collect();
        let distances = nodes
            .iter()
            .map(|other| match (node, other) {
                (Some(a), Some(b)) => host.distance(*a, *b),
                _ => 10,
            })
            .collect();
        cells.push(GuestCell {
            cell,
            host_node: *node,
            vcpus: members,
            memory_bytes,
            prefault_cpus: usable(*node),
            distances,
            spans: std::mem::take(&mut spans),
        });
    }
    if nodes.len() == 1 && nodes[0].is_none() && !floating.is_empty() {
        notes.push(format!(
            "guest memory is not bound to a node: the floating PUs {} span several nodes",
            cpulist::format(floating)
        ));
    }
    cells
}

/// The host node and memory of each guest cell, and the per-node parts of a single cell
/// whose memory spans nodes.
fn cell_nodes(
    spec: &VmSpec,
    host: &HostTopology,
    vcpus: &[VcpuPlacement],
    floating: &[u32],
    usable: &dyn Fn(Option<u32>) -> Vec<u32>,
    reasons: &mut Vec<Reason>,
    notes: &mut Vec<String>,
) -> (Vec<Option<u32>>, Vec<u64>, Vec<MemorySpan>) {
    let placed = vcpus.iter().all(|v| v.host_node.is_some());
    let mut spans = Vec::new();
    let (nodes, sizes): (Vec<Option<u32>>, Vec<u64>) = if spec.cpu.numa_passthrough && placed {
        let set: std::collections::BTreeSet<u32> =
            vcpus.iter().filter_map(|v| v.host_node).collect();
        let nodes: Vec<Option<u32>> = set.into_iter().map(Some).collect();
        let counts: Vec<u64> = nodes
            .iter()
            .map(|n| vcpus.iter().filter(|v| v.host_node == *n).count() as u64)
            .collect();
        let sizes = memory::split_cells(spec, &counts, reasons);
        (nodes, sizes)
    } else if spec.cpu.dedicated_cpu_placement && placed {
        let parts = memory::single_cell_parts(spec, host, vcpus, reasons, notes);
        let node = match parts.as_slice() {
            [(node, _)] => Some(*node),
            _ => {
                spans = parts
                    .iter()
                    .map(|&(node, memory_bytes)| MemorySpan {
                        host_node: node,
                        memory_bytes,
                        prefault_cpus: usable(Some(node)),
                    })
                    .collect();
                None
            }
        };
        (vec![node], vec![spec.memory.guest_ram_bytes()])
    } else if spec.cpu.dedicated_cpu_placement {
        (vec![None], vec![spec.memory.guest_ram_bytes()])
    } else {
        // Bound to the floating PUs' node when they have one the cgroup allows memory on, else
        // to the one node it allows, else left to the kernel (within the cgroup's nodes).
        let mut set: Vec<u32> = floating
            .iter()
            .filter_map(|&c| host.node_of_cpu(c))
            .filter(|&n| host.node_allowed(n))
            .collect();
        set.dedup();
        let allowed: Vec<u32> = host
            .nodes
            .iter()
            .map(|n| n.os_index)
            .filter(|&n| host.node_allowed(n))
            .collect();
        let node = match (set.as_slice(), allowed.as_slice()) {
            ([one], _) | ([], [one]) => Some(*one),
            _ => None,
        };
        (vec![node], vec![spec.memory.guest_ram_bytes()])
    };
    (nodes, sizes, spans)
}

/// Hugepages per node and size (merged per node).
pub fn hugepage_demand(cells: &[GuestCell], backing: &Backing) -> Vec<HugepageDemand> {
    let Backing::Hugetlb {
        page_size_bytes, ..
    } = backing
    else {
        return Vec::new();
    };
    let mut per: BTreeMap<Option<u32>, u64> = BTreeMap::new();
    for part in cells.iter().flat_map(GuestCell::memory_parts) {
        *per.entry(part.host_node).or_default() += part.memory_bytes / page_size_bytes;
    }
    per.into_iter()
        .filter(|&(_, count)| count > 0)
        .map(|(node, count)| HugepageDemand {
            node,
            page_size_bytes: *page_size_bytes,
            count,
        })
        .collect()
}

/// No memory part on a node the cgroup cpuset does not allow (the memory split only puts
/// memory there when the allowed nodes cannot hold it, and then it has said so).
fn admit_allowed_nodes(host: &HostTopology, cells: &[GuestCell], reasons: &mut Vec<Reason>) {
    let Some((cgroup, allowed)) = memory::confining_mems(host) else {
        return;
    };
    if reasons
        .iter()
        .any(|r| matches!(r, Reason::CgroupMems { .. }))
    {
        return;
    }
    for c in cells {
        for part in c.memory_parts() {
            if let Some(n) = part.host_node.filter(|&n| !host.node_allowed(n)) {
                reasons.push(Reason::CgroupMems {
                    cgroup: cgroup.clone(),
                    allowed: allowed.clone(),
                    detail: format!(
                        "guest cell {} needs {} on node{n}",
                        c.cell,
                        format_bytes(part.memory_bytes)
                    ),
                });
                return;
            }
        }
    }
}

/// The cgroup hugetlb limit caps the pages of a size over all nodes together.
fn admit_hugetlb_limit(
    host: &HostTopology,
    demand: &[HugepageDemand],
    page_size_bytes: u64,
    reasons: &mut Vec<Reason>,
) {
    let Some(limit) = host.hugetlb_limit(page_size_bytes) else {
        return;
    };
    let needed: u64 = demand
        .iter()
        .filter(|d| d.page_size_bytes == page_size_bytes)
        .map(|d| d.count)
        .sum();
    if needed > limit.pages {
        reasons.push(Reason::HugetlbLimit {
            cgroup: limit.cgroup.clone(),
            file: limit.file.clone(),
            page_size_bytes,
            allowed: limit.pages,
            needed,
        });
    }
}

/// Checks the memory demand against the host's pools, the nodes the cgroup allows and its
/// hugetlb limit.
pub fn admit_memory(
    host: &HostTopology,
    cells: &[GuestCell],
    backing: &Backing,
    demand: &[HugepageDemand],
    reasons: &mut Vec<Reason>,
) {
    admit_allowed_nodes(host, cells, reasons);
    if let Backing::Hugetlb {
        page_size_bytes, ..
    } = backing
    {
        if !host.hugepage_sizes.contains(page_size_bytes) {
            reasons.push(Reason::PageSizeMissing {
                page_size_bytes: *page_size_bytes,
                host_sizes: host.hugepage_sizes.clone(),
            });
            return;
        }
        admit_hugetlb_limit(host, demand, *page_size_bytes, reasons);
        for d in demand {
            let free = match d.node {
                Some(n) if !host.node_allowed(n) => continue, // admit_allowed_nodes said it
                Some(n) => host.free_hugepages(n, d.page_size_bytes),
                None => host
                    .nodes
                    .iter()
                    .filter(|n| host.node_allowed(n.os_index))
                    .map(|n| host.free_hugepages(n.os_index, d.page_size_bytes))
                    .sum(),
            };
            if free < d.count {
                reasons.push(Reason::Hugepages {
                    node: d.node,
                    page_size_bytes: d.page_size_bytes,
                    free,
                    needed: d.count,
                });
            }
        }
        return;
    }
    for c in cells {
        for part in c.memory_parts() {
            let Some(node) = part.host_node.and_then(|n| host.node(n)) else {
                continue;
            };
            if node.memory_bytes > 0 && node.memory_bytes < part.memory_bytes {
                reasons.push(Reason::Other {
                    detail: format!(
                        "node{} has {} of memory, guest cell {} needs {} there",
                        node.os_index,
                        format_bytes(node.memory_bytes),
                        c.cell,
                        format_bytes(part.memory_bytes)
                    ),
                });
            }
        }
    }
}
