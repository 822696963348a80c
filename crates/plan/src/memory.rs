//! Guest memory over host nodes: what each node offers, the split of a VM's memory over its
//! guest cells (NUMA passthrough) or over its vCPUs' nodes (one guest cell), and the reason
//! given when no node set can hold a passthrough VM.
//!
//! Both splits are in proportion to vCPUs, in whole pages ([`split_pages`]): a guest cell, or
//! a node's part of a single cell, gets memory in proportion to the vCPUs it holds.

use vmhost_config::{format_bytes, VmSpec};
use vmhost_topology::HostTopology;

use crate::model::{Reason, VcpuPlacement};
use crate::nodeset::{split_pages, NodeStat, Request};
use crate::placement::FreePus;

const TWO_MI: u64 = 2 << 20;

/// The unit memory is split and counted in: the hugepage size, else 2 MiB when the guest is
/// a multiple of it (so transparent hugepages stay whole at the boundaries), else 4 KiB.
pub fn unit(spec: &VmSpec) -> u64 {
    match &spec.memory.hugepages {
        Some(h) => h.page_size_bytes,
        None if spec.memory.guest_ram_bytes() % TWO_MI == 0 => TWO_MI,
        None => 4096,
    }
}

/// Guest memory in [`unit`]s.
pub fn guest_pages(spec: &VmSpec) -> u64 {
    spec.memory.guest_ram_bytes() / unit(spec)
}

/// Free [`unit`]s of `node` (`u64::MAX` when the node's memory size is unknown; 0 on a node
/// this process's cgroup cpuset does not allow).
pub(crate) fn capacity(spec: &VmSpec, host: &HostTopology, node: u32) -> u64 {
    if !host.node_allowed(node) {
        return 0;
    }
    match &spec.memory.hugepages {
        Some(h) => host.free_hugepages(node, h.page_size_bytes),
        None => match host.node(node).map(|n| n.memory_bytes) {
            Some(b) if b > 0 => b / unit(spec),
            _ => u64::MAX,
        },
    }
}

/// What each node with free PUs offers the VM, in host order.
pub fn node_stats(spec: &VmSpec, host: &HostTopology, free: &FreePus) -> Vec<NodeStat> {
    let t = spec.cpu.topology.threads;
    free.per_node(host)
        .into_iter()
        .map(|(node, pus)| NodeStat {
            node,
            free: pus,
            whole: free.whole_groups(node, t),
            pages: capacity(spec, host, node),
        })
        .collect()
}

/// Memory of each passthrough guest cell, in proportion to the cell's vCPUs (`counts`).
pub fn split_cells(spec: &VmSpec, counts: &[u64], reasons: &mut Vec<Reason>) -> Vec<u64> {
    let guest = spec.memory.guest_ram_bytes();
    let page = unit(spec);
    let n = counts.len();
    if n <= 1 {
        return vec![guest; n];
    }
    let pages = guest / page;
    if pages < n as u64 {
        reasons.push(Reason::NumaSplit {
            detail: format!(
                "NUMA passthrough gives {n} guest cells but memory.guest {} is only {pages} pages of {}: each cell needs at least one page",
                format_bytes(guest),
                format_bytes(page)
            ),
        });
    }
    split_pages(pages, counts)
        .into_iter()
        .map(|p| p * page)
        .collect()
}

/// Where the memory of a dedicated VM's single guest cell goes: (node, bytes) in host order.
///
/// Each of the vCPUs' nodes gets a part in proportion to its vCPUs; what a node cannot hold
/// goes to the other vCPU nodes (most vCPUs first), then to the nodes nearest vCPU 0's node.
/// Memory no node can hold stays on vCPU 0's node, where admission reports the shortfall.
pub fn single_cell_parts(
    spec: &VmSpec,
    host: &HostTopology,
    vcpus: &[VcpuPlacement],
    reasons: &mut Vec<Reason>,
    notes: &mut Vec<String>,
) -> Vec<(u32, u64)> {
    let page = unit(spec);
    let total = guest_pages(spec);
    let home = vcpus.first().and_then(|v| v.host_node).unwrap_or(0);
    let mut nodes: Vec<(u32, u64)> = Vec::new(); // (node, vCPUs), host order
    for n in &host.nodes {
        let c = vcpus
            .iter()
            .filter(|v| v.host_node == Some(n.os_index))
            .count() as u64;
        if c > 0 {
            nodes.push((n.os_index, c));
        }
    }
    let weights: Vec<u64> = nodes.iter().map(|&(_, c)| c).collect();
    let shares = split_pages(total, &weights);
    let mut parts: Vec<(u32, u64)> = Vec::new();
    let mut room: Vec<(u32, u64)> = Vec::new();
    let mut excess = 0u64;
    for (&(node, _), &share) in nodes.iter().zip(&shares) {
        let cap = capacity(spec, host, node);
        let take = share.min(cap);
        excess += share - take;
        parts.push((node, take));
        room.push((node, cap - take));
    }
    // Spill: the vCPU nodes with the most vCPUs, then the others nearest vCPU 0's node.
    let mut order: Vec<(u32, u64)> = nodes.clone();
    order.sort_by_key(|&(node, c)| (std::cmp::Reverse(c), node));
    let mut others: Vec<u32> = host
        .nodes
        .iter()
        .map(|n| n.os_index)
        .filter(|n| !nodes.iter().any(|&(m, _)| m == *n))
        .collect();
    others.sort_by_key(|&n| (host.distance(home, n), n));
    let spill_to: Vec<u32> = order.iter().map(|&(n, _)| n).chain(others).collect();
    for node in spill_to {
        if excess == 0 {
            break;
        }
        let cap = match room.iter().position(|&(n, _)| n == node) {
            Some(i) => &mut room[i].1,
            None => {
                room.push((node, capacity(spec, host, node)));
                parts.push((node, 0));
                let last = room.len() - 1;
                &mut room[last].1
            }
        };
        let add = excess.min(*cap);
        *cap -= add;
        excess -= add;
        if let Some(p) = parts.iter_mut().find(|(n, _)| *n == node) {
            p.1 += add;
        }
    }
    if excess > 0 {
        shortfall(spec, host, total, reasons);
        if let Some(p) = parts.iter_mut().find(|(n, _)| *n == home) {
            p.1 += excess;
        }
    }
    parts.retain(|&(_, p)| p > 0);
    parts.sort_by_key(|&(n, _)| host.nodes.iter().position(|m| m.os_index == n));
    let parts: Vec<(u32, u64)> = parts.into_iter().map(|(n, p)| (n, p * page)).collect();
    describe(&parts, &nodes, home, notes);
    parts
}

fn describe(parts: &[(u32, u64)], vcpu_nodes: &[(u32, u64)], home: u32, notes: &mut Vec<String>) {
    let remote = |n: u32| !vcpu_nodes.iter().any(|&(m, _)| m == n);
    match parts {
        [(node, _)] if remote(*node) => notes.push(format!(
            "guest memory is bound to node{node}, remote from vCPU 0 on node{home}: node{home} lacks room for it"
        )),
        [_] | [] => {}
        _ => {
            let list: Vec<String> = parts
                .iter()
                .map(|&(n, b)| {
                    let tag = if remote(n) { ", no vCPU there" } else { "" };
                    format!("node{n} {}{tag}", format_bytes(b))
                })
                .collect();
            notes.push(format!(
                "the guest sees one NUMA node while its memory spans host nodes: {} (split in proportion to the vCPUs on each node, bound per node)",
                list.join(", ")
            ));
        }
    }
}

/// The host as a whole lacks the memory: totals over the nodes this process may use. When
/// its cgroup cpuset leaves out some of the host's nodes, the reason names the cgroup.
fn shortfall(spec: &VmSpec, host: &HostTopology, total: u64, reasons: &mut Vec<Reason>) {
    let allowed: Vec<&vmhost_topology::NumaNode> = host
        .nodes
        .iter()
        .filter(|n| host.node_allowed(n.os_index))
        .collect();
    let reason = match &spec.memory.hugepages {
        // Admission names the missing page size.
        Some(h) if !host.hugepage_sizes.contains(&h.page_size_bytes) => return,
        Some(h) => Reason::Hugepages {
            node: None,
            page_size_bytes: h.page_size_bytes,
            free: allowed
                .iter()
                .map(|n| host.free_hugepages(n.os_index, h.page_size_bytes))
                .sum(),
            needed: total,
        },
        None => Reason::Other {
            detail: format!(
                "the host's nodes hold {} of memory in all, the guest needs {}",
                format_bytes(allowed.iter().map(|n| n.memory_bytes).sum()),
                format_bytes(spec.memory.guest_ram_bytes())
            ),
        },
    };
    reasons.push(match confining_mems(host) {
        Some((cgroup, nodes)) => Reason::CgroupMems {
            cgroup,
            allowed: nodes,
            detail: reason
                .to_string()
                .replace("the host has", "the allowed nodes have")
                .replace("the host's nodes hold", "the allowed nodes hold"),
        },
        None => reason,
    });
}

/// The cgroup and its nodes when its cpuset leaves out some of the host's nodes.
pub fn confining_mems(host: &HostTopology) -> Option<(String, Vec<u32>)> {
    let mems = host.allowed_mems.as_ref()?;
    host.nodes
        .iter()
        .any(|n| !mems.nodes.contains(&n.os_index))
        .then(|| (mems.cgroup.clone(), mems.nodes.clone()))
}

/// Why no node set holds a passthrough VM, in full: the free PUs and pages per node and in
/// all, the best set tried and the constraint that broke it.
pub fn no_node_set(
    spec: &VmSpec,
    host: &HostTopology,
    stats: &[NodeStat],
    req: &Request,
    detail: &str,
) -> Reason {
    let page = format_bytes(unit(spec));
    // Fewer pages than the guest cells the vCPUs need: say that, it is the whole story.
    let mut frees: Vec<u32> = stats.iter().map(|s| s.free / req.threads.max(1)).collect();
    frees.sort_unstable_by(|a, b| b.cmp(a));
    let cells = frees
        .iter()
        .scan(0u32, |held, f| {
            let before = *held;
            *held = held.saturating_add(*f);
            (before < req.groups).then_some(())
        })
        .count();
    if cells > 1 && req.pages < cells as u64 {
        return Reason::NumaSplit {
            detail: format!(
                "NUMA passthrough gives {cells} guest cells but memory.guest {} is only {} pages of {page}: each cell needs at least one page",
                format_bytes(spec.memory.guest_ram_bytes()),
                req.pages
            ),
        };
    }
    let per_node: Vec<String> = stats
        .iter()
        .map(|s| {
            let pages = if s.pages == u64::MAX {
                "unknown memory".to_string()
            } else {
                format!("{} free {page} pages", s.pages)
            };
            format!("node{}: {} free PUs, {pages}", s.node, s.free)
        })
        .collect();
    let pages_all: u64 = host
        .nodes
        .iter()
        .map(|n| capacity(spec, host, n.os_index))
        .fold(0, u64::saturating_add);
    let held: u32 = stats.iter().map(|s| req.cap(s)).sum();
    let reason = Reason::NumaSplit {
        detail: format!(
            "no set of host nodes holds {detail} with NUMA passthrough: passthrough needs each guest cell's memory on its vCPUs' node \
             ({} {page} pages in all, split in proportion to vCPUs) and each guest core of {} threads on one node. \
             Free per node: {}; the host has {pages_all} free {page} pages in all. The best set tried, every node, holds {held} of {} guest cores with their memory{}",
            req.pages,
            req.threads,
            per_node.join("; "),
            req.groups,
            if pages_all < req.pages {
                format!(" (the host lacks {} pages in all)", req.pages - pages_all)
            } else {
                "; without passthrough the VM fits, with its memory split over nodes".to_string()
            }
        ),
    };
    match confining_mems(host) {
        Some((cgroup, allowed)) => Reason::CgroupMems {
            cgroup,
            allowed,
            detail: reason.to_string(),
        },
        None => reason,
    }
}
