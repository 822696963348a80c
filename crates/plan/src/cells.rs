//! vCPU coordinates, dedicated placement across nodes, guest NUMA cells, memory split and
//! memory admission.

use std::collections::BTreeMap;

use vmhost_config::{format_bytes, VmSpec};
use vmhost_topology::{cpulist, HostTopology};

use crate::model::{Backing, GuestCell, HugepageDemand, Reason, VcpuPlacement};
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

/// Pages (or bytes for anonymous memory) the whole guest needs on one node.
fn fits_memory_on(spec: &VmSpec, host: &HostTopology, node: u32) -> bool {
    match &spec.memory.hugepages {
        Some(h) => {
            host.free_hugepages(node, h.page_size_bytes)
                >= spec.memory.guest_bytes / h.page_size_bytes
        }
        None => host
            .node(node)
            .is_none_or(|n| n.memory_bytes == 0 || n.memory_bytes >= spec.memory.guest_bytes),
    }
}

/// Places the vCPUs of a dedicated VM; returns the emulator PU when it is isolated and placed.
pub fn place_dedicated(
    spec: &VmSpec,
    host: &HostTopology,
    free: &mut FreePus,
    vcpus: &mut [VcpuPlacement],
    reasons: &mut Vec<Reason>,
    notes: &mut Vec<String>,
) -> Option<u32> {
    let t = spec.cpu.topology.threads;
    let n = spec.vcpus();
    let emu = u32::from(spec.cpu.isolate_emulator_thread);
    let need = n + emu;
    let available = free.total();
    let detail = if emu == 1 {
        format!("{n} vCPUs + 1 isolated emulator thread")
    } else {
        format!("{n} vCPUs")
    };
    if available < need {
        reasons.push(Reason::Cpus {
            needed: need,
            available,
            detail,
        });
        return None;
    }
    let per_node = free.per_node(host);
    // One node that holds every vCPU (and the emulator), and the memory when possible.
    let single = per_node
        .iter()
        .find(|&&(node, c)| c >= need && fits_memory_on(spec, host, node))
        .or_else(|| per_node.iter().find(|&&(_, c)| c >= need))
        .map(|&(node, _)| node);
    let mut pus: Vec<(u32, u32)> = Vec::new(); // (pu, node) in vCPU order
    if let Some(node) = single {
        let (got, straddled) = free.take_groups(node, n / t, t)?;
        if straddled {
            notes.push(format!("no host core on node{node} has {t} free PUs for every guest core: some guest cores span host cores"));
        }
        pus.extend(got.into_iter().map(|p| (p, node)));
    } else {
        // Fewest nodes, largest free capacity first; whole guest sockets per node when they
        // fit (the guest's sockets then match its NUMA cells), else whole guest cores.
        let topo = spec.cpu.topology;
        let per_socket = topo.cores * t;
        let (take, groups_left) = match distribute(&per_node, topo.sockets, per_socket) {
            (take, 0) if topo.sockets > 1 => (
                take.into_iter()
                    .map(|(node, s)| (node, s * topo.cores))
                    .collect(),
                0,
            ),
            _ => distribute(&per_node, n / t, t),
        };
        for (&node, &g) in &take {
            if let Some((got, _)) = free.take_groups(node, g, t) {
                pus.extend(got.into_iter().map(|p| (p, node)));
            }
        }
        if groups_left > 0 {
            if spec.cpu.numa_passthrough {
                let counts: Vec<String> = per_node
                    .iter()
                    .map(|(nd, c)| format!("node{nd}: {c}"))
                    .collect();
                reasons.push(Reason::Cpus {
                    needed: need,
                    available,
                    detail: format!(
                        "{detail}; NUMA passthrough keeps each guest core of {t} threads on one host node and the free PUs per node ({}) hold only {} such cores",
                        counts.join(", "),
                        n / t - groups_left
                    ),
                });
                return None;
            }
            // Without passthrough a guest core may straddle nodes: use the leftovers.
            let mut missing = groups_left * t;
            for &(node, _) in &per_node {
                while missing > 0 {
                    let Some((got, _)) = free.take_groups(node, 1, 1) else {
                        break;
                    };
                    pus.extend(got.into_iter().map(|p| (p, node)));
                    missing -= 1;
                }
            }
            notes.push(
                "some guest cores span host NUMA nodes (no node has room for whole guest cores)"
                    .into(),
            );
        }
        let nodes: Vec<String> = take.keys().map(|n| format!("node{n}")).collect();
        if !spec.cpu.numa_passthrough {
            notes.push(format!(
                "vCPUs span host nodes {} but the guest sees one NUMA cell; enable cpu.numa.guest_mapping_passthrough to expose them",
                nodes.join(", ")
            ));
        }
    }
    for (v, &(pu, node)) in vcpus.iter_mut().zip(&pus) {
        v.host_cpu = Some(pu);
        v.host_node = Some(node);
    }
    if emu == 0 {
        return None;
    }
    let home = pus.first().map(|&(_, node)| node)?;
    if let Some(pu) = free.take_emulator(home) {
        return Some(pu);
    }
    for &(node, _) in &free.per_node(host) {
        if let Some(pu) = free.take_emulator(node) {
            notes.push(format!(
                "the emulator thread runs on node{node}: vCPU 0's node{home} has no PU left"
            ));
            return Some(pu);
        }
    }
    reasons.push(Reason::Cpus {
        needed: need,
        available,
        detail,
    });
    None
}

/// Spreads `units` of `size` PUs over nodes, largest free capacity first. Returns units per
/// node and the units that found no room.
fn distribute(per_node: &[(u32, u32)], units: u32, size: u32) -> (BTreeMap<u32, u32>, u32) {
    let mut by_size = per_node.to_vec();
    by_size.sort_by_key(|&(node, c)| (std::cmp::Reverse(c), node));
    let mut left = units;
    let mut take = BTreeMap::new();
    for (node, c) in by_size {
        let g = (c / size).min(left);
        if g > 0 {
            take.insert(node, g);
            left -= g;
        }
    }
    (take, left)
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
    let placed = vcpus.iter().all(|v| v.host_node.is_some());
    let nodes: Vec<Option<u32>> = if spec.cpu.numa_passthrough && placed {
        let set: std::collections::BTreeSet<u32> =
            vcpus.iter().filter_map(|v| v.host_node).collect();
        set.into_iter().map(Some).collect()
    } else if spec.cpu.dedicated_cpu_placement {
        vec![single_cell_node(spec, host, vcpus, notes)]
    } else {
        let mut set: Vec<u32> = floating
            .iter()
            .filter_map(|&c| host.node_of_cpu(c))
            .collect();
        set.dedup();
        vec![if set.len() == 1 { Some(set[0]) } else { None }]
    };
    let sizes = split_memory(spec, nodes.len(), reasons);
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

/// The node of a dedicated VM's single cell: vCPU 0's node when its memory fits there.
fn single_cell_node(
    spec: &VmSpec,
    host: &HostTopology,
    vcpus: &[VcpuPlacement],
    notes: &mut Vec<String>,
) -> Option<u32> {
    let home = vcpus.first().and_then(|v| v.host_node)?;
    if fits_memory_on(spec, host, home) {
        return Some(home);
    }
    // No node holds it: keep vCPU 0's node, admission reports the shortfall there.
    let Some(other) = host
        .nodes
        .iter()
        .map(|n| n.os_index)
        .find(|&n| fits_memory_on(spec, host, n))
    else {
        return Some(home);
    };
    notes.push(format!(
        "guest memory is bound to node{other}, remote from vCPU 0 on node{home}: node{home} lacks room for it"
    ));
    Some(other)
}

/// Splits guest memory over `n` cells in whole pages; the first cells get one page more.
fn split_memory(spec: &VmSpec, n: usize, reasons: &mut Vec<Reason>) -> Vec<u64> {
    let guest = spec.memory.guest_bytes;
    let page = spec
        .memory
        .hugepages
        .as_ref()
        .map_or(4096, |h| h.page_size_bytes);
    let n64 = n as u64;
    if n <= 1 {
        return vec![guest; n];
    }
    let pages = guest / page;
    if pages < n64 {
        reasons.push(Reason::NumaSplit {
            detail: format!(
                "NUMA passthrough gives {n} guest cells but memory.guest {} is only {pages} pages of {}: each cell needs at least one page",
                format_bytes(guest),
                format_bytes(page)
            ),
        });
    }
    let (base, extra) = (pages / n64, pages % n64);
    (0..n64)
        .map(|i| (base + u64::from(i < extra)) * page)
        .collect()
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
    for c in cells {
        *per.entry(c.host_node).or_default() += c.memory_bytes / page_size_bytes;
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

/// Checks the memory demand against the host's pools.
pub fn admit_memory(
    host: &HostTopology,
    cells: &[GuestCell],
    backing: &Backing,
    demand: &[HugepageDemand],
    reasons: &mut Vec<Reason>,
) {
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
        for d in demand {
            let free = match d.node {
                Some(n) => host.free_hugepages(n, d.page_size_bytes),
                None => host
                    .nodes
                    .iter()
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
        let Some(node) = c.host_node.and_then(|n| host.node(n)) else {
            continue;
        };
        if node.memory_bytes > 0 && node.memory_bytes < c.memory_bytes {
            reasons.push(Reason::Other {
                detail: format!(
                    "node{} has {} of memory, guest cell {} needs {}",
                    node.os_index,
                    format_bytes(node.memory_bytes),
                    c.cell,
                    format_bytes(c.memory_bytes)
                ),
            });
        }
    }
}
