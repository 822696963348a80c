//! Text output of a run: the placement table printed when the guest starts.

use std::fmt::Write as _;

use vmhost_memory::Audit;
use vmhost_plan::Plan;
use vmhost_topology::cpulist;
use vmhost_vcpu::ThreadPlacement;

/// The start-up table: vCPU → thread → PU → node, the other threads, guest cells → residency.
pub fn placement_table(plan: &Plan, audit: Option<&Audit>, threads: &[ThreadPlacement]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "VM {}: placement read back from /proc at start",
        plan.name
    );
    let _ = writeln!(s, "  vCPU  thread id  allowed PUs  planned PU  host node");
    for v in &plan.vcpus {
        let t = threads.iter().find(|t| t.vcpu_index() == Some(v.vcpu));
        let planned = v
            .host_cpu
            .map_or_else(|| "float".to_string(), |c| c.to_string());
        let node = v
            .host_node
            .map_or_else(|| "-".to_string(), |n| n.to_string());
        let (tid, allowed) = t.map_or(("?".to_string(), "?".to_string()), |t| {
            (t.tid.to_string(), t.cpus_allowed_list.clone())
        });
        let _ = writeln!(
            s,
            "  {:>4}  {:>9}  {:>11}  {:>10}  {:>9}",
            v.vcpu, tid, allowed, planned, node
        );
    }
    for t in threads.iter().filter(|t| t.vcpu_index().is_none()) {
        let _ = writeln!(
            s,
            "  thread {:<12} {:>9}  allowed PUs {}{}",
            t.name,
            t.tid,
            t.cpus_allowed_list,
            crate::iothreads::planned_suffix(plan, t).unwrap_or_default()
        );
    }
    let _ = writeln!(
        s,
        "  emulator PUs (plan): {}{}",
        cpulist::format(&plan.emulator.host_cpus),
        if plan.emulator.isolated {
            " (isolated)"
        } else {
            ""
        }
    );
    match audit {
        Some(audit) => s.push_str(&residency_table(plan, audit)),
        None => {
            let _ = writeln!(
                s,
                "  guest RAM: prefaulting in the background (--prefault background); residency \
                 follows when it is done"
            );
        }
    }
    s
}

/// Each guest cell's host node(s), size, page size and where its pages sit per the audit,
/// then the audit's violations.
pub fn residency_table(plan: &Plan, audit: &Audit) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "  cell  host node  memory     page   residency");
    for c in &plan.guest_cells {
        let regions: Vec<_> = audit.regions.iter().filter(|r| r.cell == c.cell).collect();
        let pages: u64 = regions.iter().map(|r| r.pages).sum();
        let by_node = regions.iter().flat_map(|r| r.pages_by_node.iter()).fold(
            std::collections::BTreeMap::<u32, u64>::new(),
            |mut m, (n, p)| {
                *m.entry(*n).or_default() += p;
                m
            },
        );
        let residency: Vec<String> = by_node
            .iter()
            .map(|(n, p)| {
                format!(
                    "node{n} {:.1}%",
                    100.0 * (*p as f64) / (pages.max(1) as f64)
                )
            })
            .collect();
        let _ = writeln!(
            s,
            "  {:>4}  {:>9}  {:>9}  {:>5}   {}",
            c.cell,
            match (c.host_node, c.spans.is_empty()) {
                (Some(n), _) => n.to_string(),
                (None, false) => c
                    .spans
                    .iter()
                    .map(|p| p.host_node.to_string())
                    .collect::<Vec<_>>()
                    .join("+"),
                (None, true) => "-".to_string(),
            },
            vmhost_config::format_bytes(c.memory_bytes),
            vmhost_config::format_bytes(plan.backing.page_size_bytes()),
            if residency.is_empty() {
                "not faulted in".to_string()
            } else {
                residency.join(", ")
            }
        );
    }
    for (cell, gpa, v) in audit.violations() {
        let _ = writeln!(s, "  VIOLATION cell {cell} GPA {gpa:#x}: {v}");
    }
    s
}
