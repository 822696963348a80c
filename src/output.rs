//! Text output of a run: the short plan printed before it starts and the placement table
//! printed when the guest starts.

use std::fmt::Write as _;

use vmhost_config::format_bytes;
use vmhost_memory::Audit;
use vmhost_plan::{Backing, Plan};
use vmhost_topology::{cpulist, HostTopology};
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

/// What the same VM would get with dedicated placement on this host, for the summary of a
/// shared VM: its plan, or the refusal in words.
pub type DedicatedAlternative = Result<Plan, String>;

/// Plans `spec` with dedicated placement on `host`, avoiding the PUs other VMs hold; `None`
/// when the spec is dedicated already.
pub fn dedicated_alternative(
    spec: &vmhost_config::VmSpec,
    host: &HostTopology,
    opts: &vmhost_plan::PlanOptions,
) -> Option<DedicatedAlternative> {
    if spec.cpu.dedicated_cpu_placement {
        return None;
    }
    let mut spec = spec.clone();
    spec.cpu.dedicated_cpu_placement = true;
    Some(
        vmhost_plan::plan(&spec, host, opts)
            .into_result()
            .map_err(|r| {
                r.reasons
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join("; ")
            }),
    )
}

/// The short plan printed before the run: the guest, the envelope with its terms, vCPU → PU,
/// the emulator's PUs, guest cells → host nodes and hugepages per node; what the host's
/// hugepage pools offer when the VM does not use them, and for a shared VM what dedicated
/// placement would give it.
pub fn plan_summary(
    plan: &Plan,
    host: &HostTopology,
    dedicated: Option<&DedicatedAlternative>,
) -> String {
    let e = &plan.envelope;
    let t = plan.guest_topology;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "VM {}: the plan (`vmhost plan` prints it in full)",
        plan.name
    );
    let _ = writeln!(
        s,
        "  guest      {} vCPUs ({} sockets x {} cores x {} threads), {} of RAM, {}",
        plan.vcpus.len(),
        t.sockets,
        t.cores,
        t.threads,
        format_bytes(e.guest_memory_bytes),
        backing_label(&plan.backing)
    );
    let terms: Vec<String> = e
        .overhead_terms
        .iter()
        .map(|(name, bytes)| format!("{name} {}", mib(*bytes)))
        .collect();
    let _ = writeln!(
        s,
        "  envelope   memory request {} ({} overhead {} = {}), limit {}, cpu {}{}",
        mib(e.memory_request_bytes),
        format!("{:?}", e.overhead_model).to_lowercase(),
        mib(e.overhead_bytes),
        terms.join(" + "),
        e.memory_limit_bytes.map_or_else(|| "none".to_string(), mib),
        e.cpus,
        if e.dedicated_cpus > 0 {
            format!(" ({} dedicated PUs)", e.dedicated_cpus)
        } else {
            " (shared)".to_string()
        }
    );
    let _ = writeln!(s, "  vCPU → PU  {}", vcpu_pus(plan));
    let _ = writeln!(
        s,
        "  emulator   PUs {}{}",
        or_dash(&cpulist::format(&plan.emulator.host_cpus)),
        if plan.emulator.isolated {
            " (isolated)"
        } else {
            ""
        }
    );
    let cells: Vec<String> = plan
        .guest_cells
        .iter()
        .map(|c| {
            format!(
                "cell {} → {} {}",
                c.cell,
                cell_nodes(c),
                format_bytes(c.memory_bytes)
            )
        })
        .collect();
    let _ = writeln!(s, "  cells      {}", cells.join(", "));
    let _ = writeln!(s, "  hugepages  {}", hugepages_line(plan, host));
    if let Some(alt) = dedicated {
        let _ = writeln!(s, "  dedicated  {}", dedicated_line(alt));
    }
    s
}

/// `0→2 1→3` for pinned vCPUs, or `0-1 float over PUs 0-3`.
fn vcpu_pus(plan: &Plan) -> String {
    if plan.vcpus.iter().all(|v| v.host_cpu.is_none()) {
        let ids: Vec<u32> = plan.vcpus.iter().map(|v| v.vcpu).collect();
        return format!(
            "vCPUs {} float over PUs {}",
            cpulist::format(&ids),
            or_dash(&cpulist::format(&plan.floating_cpus))
        );
    }
    plan.vcpus
        .iter()
        .map(|v| {
            let pu = v
                .host_cpu
                .map_or_else(|| "float".to_string(), |c| c.to_string());
            let node = v
                .host_node
                .map_or_else(String::new, |n| format!(" (node{n})"));
            format!("{}→{pu}{node}", v.vcpu)
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// A guest cell's host node(s): `node1`, `node0+node1`, or `any node`.
fn cell_nodes(c: &vmhost_plan::GuestCell) -> String {
    match (c.host_node, c.spans.is_empty()) {
        (Some(n), _) => format!("node{n}"),
        (None, false) => c
            .spans
            .iter()
            .map(|p| format!("node{} {}", p.host_node, format_bytes(p.memory_bytes)))
            .collect::<Vec<_>>()
            .join(" + "),
        (None, true) => "any node".to_string(),
    }
}

/// How the summary's hugepages line says the spec's hugepages fell back to normal pages.
const HUGEPAGES_FELL_BACK: &str = "as memory.hugepages.fallback allows";

/// The plan's hugepages per node, or (anonymous memory) what the host's pools have free.
fn hugepages_line(plan: &Plan, host: &HostTopology) -> String {
    if !plan.envelope.hugepages.is_empty() {
        return plan
            .envelope
            .hugepages
            .iter()
            .map(|h| {
                let node = h
                    .node
                    .map_or_else(|| "any node".to_string(), |n| format!("node{n}"));
                format!(
                    "{} x {} on {node}",
                    h.count,
                    format_bytes(h.page_size_bytes)
                )
            })
            .collect::<Vec<_>>()
            .join(", ");
    }
    if let Some(why) = plan
        .notes
        .iter()
        .find_map(|n| n.strip_prefix(vmhost_plan::HUGEPAGE_FALLBACK_NOTE))
    {
        return format!("none: anonymous memory, {HUGEPAGES_FELL_BACK}{why}");
    }
    let pools: Vec<String> = host
        .nodes
        .iter()
        .flat_map(|n| {
            n.hugepages.iter().filter(|p| p.free > 0).map(move |p| {
                format!(
                    "node{} {} x {}",
                    n.os_index,
                    p.free,
                    format_bytes(p.page_size_bytes)
                )
            })
        })
        .collect();
    let smallest = host
        .nodes
        .iter()
        .flat_map(|n| n.hugepages.iter().filter(|p| p.free > 0))
        .map(|p| p.page_size_bytes)
        .min();
    match smallest {
        None => "none: anonymous memory, and the host has no free hugepages".to_string(),
        Some(size) => format!(
            "none: anonymous memory; the host has {} free (memory.hugepages = {{ page_size = \"{}\" }} uses them)",
            pools.join(", "),
            format_bytes(size)
        ),
    }
}

/// What dedicated placement would give a shared VM.
fn dedicated_line(alt: &DedicatedAlternative) -> String {
    match alt {
        Ok(p) => {
            let cells: Vec<String> = p.guest_cells.iter().map(cell_nodes).collect();
            format!(
                "with cpu.dedicated_cpu_placement = true it would get vCPU → PU {}, memory on {}, and a Guaranteed pod's cpu {}",
                vcpu_pus(p),
                cells.join(", "),
                p.envelope.dedicated_cpus
            )
        }
        Err(why) => format!("with cpu.dedicated_cpu_placement = true it would not fit here: {why}"),
    }
}

fn backing_label(b: &Backing) -> String {
    match b {
        Backing::Hugetlb {
            page_size_bytes, ..
        } => format!("{} hugepages", format_bytes(*page_size_bytes)),
        Backing::Anonymous => "anonymous memory (transparent hugepages)".to_string(),
    }
}

/// Bytes as MiB with one decimal: `19.3 MiB`.
fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / f64::from(1u32 << 20))
}

fn or_dash(s: &str) -> &str {
    if s.is_empty() {
        "-"
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use vmhost_config::from_toml_str;
    use vmhost_plan::{plan, PlanOptions};
    use vmhost_topology::{apply_hugepages, load_synthetic, parse_hugepages_arg};

    use super::*;

    fn spec(text: &str) -> vmhost_config::VmSpec {
        from_toml_str(text, "t.toml").unwrap().spec
    }

    fn host(pools: &str) -> HostTopology {
        let mut h = load_synthetic("package:2 numa:1 core:2 pu:1").unwrap();
        if !pools.is_empty() {
            apply_hugepages(&mut h, &parse_hugepages_arg(pools).unwrap()).unwrap();
        }
        h
    }

    const QUICKSTART: &str = include_str!("../configs/quickstart.toml");

    #[test]
    fn shared_vm_summary_shows_envelope_pools_and_the_dedicated_alternative() {
        let s = spec(QUICKSTART);
        let h = host("node1:2Mi=64");
        let opts = PlanOptions::default();
        let p = plan(&s, &h, &opts).into_result().unwrap();
        let alt = dedicated_alternative(&s, &h, &opts);
        let text = plan_summary(&p, &h, alt.as_ref());
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0],
            "VM quickstart: the plan (`vmhost plan` prints it in full)"
        );
        assert_eq!(
            lines[1],
            "  guest      2 vCPUs (1 sockets x 2 cores x 1 threads), 256Mi of RAM, anonymous memory (transparent hugepages)"
        );
        let e = &p.envelope;
        assert!(
            lines[2].starts_with(&format!(
                "  envelope   memory request {} (vmhost overhead {} = ",
                mib(e.memory_request_bytes),
                mib(e.overhead_bytes)
            )),
            "{text}"
        );
        for name in e.overhead_terms.keys() {
            assert!(lines[2].contains(name.as_str()), "{name}: {text}");
        }
        assert!(
            lines[2].ends_with(&format!("cpu {} (shared)", e.cpus)),
            "{text}"
        );
        assert_eq!(lines[3], "  vCPU → PU  vCPUs 0-1 float over PUs 0-3");
        assert_eq!(lines[4], "  emulator   PUs 0-3");
        assert_eq!(lines[5], "  cells      cell 0 → any node 256Mi");
        assert_eq!(
            lines[6],
            "  hugepages  none: anonymous memory, as memory.hugepages.fallback allows: the host has 64 free 2Mi hugepages in all, the plan needs 128"
        );
        assert_eq!(
            lines[7],
            "  dedicated  with cpu.dedicated_cpu_placement = true it would get vCPU → PU 0→0 (node0), 1→1 (node0), memory on node0, and a Guaranteed pod's cpu 2"
        );
        assert_eq!(lines.len(), 8, "{text}");
    }

    #[test]
    fn the_quickstart_takes_hugepages_where_the_pool_has_them() {
        let s = spec(QUICKSTART);
        let h = host("node0:2Mi=16,node1:2Mi=200");
        let opts = PlanOptions::default();
        let p = plan(&s, &h, &opts).into_result().unwrap();
        assert!(
            !p.notes
                .iter()
                .any(|n| n.starts_with(vmhost_plan::HUGEPAGE_FALLBACK_NOTE)),
            "{:?}",
            p.notes
        );
        let text = plan_summary(&p, &h, None);
        assert!(
            text.contains("  hugepages  128 x 2Mi on any node"),
            "{text}"
        );
        assert!(text.contains("256Mi of RAM, 2Mi hugepages"), "{text}");
    }

    #[test]
    fn hugepage_vm_summary_shows_pages_per_node_and_pinned_pus() {
        let s = spec(
            "name = \"hp\"\n[cpu]\ncores = 3\ndedicated_cpu_placement = true\n\
             [memory]\nguest = \"96Mi\"\nhugepages = { page_size = \"2Mi\" }\n",
        );
        let h = host("node0:2Mi=16,node1:2Mi=64");
        let opts = PlanOptions::default();
        let p = plan(&s, &h, &opts).into_result().unwrap();
        assert!(dedicated_alternative(&s, &h, &opts).is_none());
        let text = plan_summary(&p, &h, None);
        assert!(
            text.contains("  vCPU → PU  0→0 (node0), 1→1 (node0), 2→2 (node1)"),
            "{text}"
        );
        assert!(text.contains("cpu 3 (3 dedicated PUs)"), "{text}");
        assert!(
            text.contains("  hugepages  16 x 2Mi on node0, 32 x 2Mi on node1"),
            "{text}"
        );
        assert!(!text.contains("dedicated  "), "{text}");
    }

    #[test]
    fn a_dedicated_alternative_that_does_not_fit_says_why() {
        let s = spec("[cpu]\ncores = 8\n[memory]\nguest = \"64Mi\"\n");
        let h = host("");
        let opts = PlanOptions::default();
        let p = plan(&s, &h, &opts).into_result().unwrap();
        let alt = dedicated_alternative(&s, &h, &opts);
        let text = plan_summary(&p, &h, alt.as_ref());
        assert!(
            text.contains("  dedicated  with cpu.dedicated_cpu_placement = true it would not fit here: dedicated placement needs 8 PUs"),
            "{text}"
        );
        assert!(
            text.contains("none: anonymous memory, and the host has no free hugepages"),
            "{text}"
        );
    }
}
