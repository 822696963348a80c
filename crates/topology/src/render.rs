//! A readable text summary of a [`HostTopology`], in the spirit of `numactl -H` and `lstopo`.

use std::fmt::Write as _;

use crate::{
    cpulist,
    hugepages::size_label,
    model::{HostTopology, NumaNode, TopologySource},
};

/// Cores shown per line under a node.
const CORES_PER_LINE: usize = 8;

/// Render a topology as text: source, packages → nodes → cores with their PUs, per node its
/// cpus, memory and hugepage pools, the online and allowed CPUs, and the distance matrix.
pub fn render_text(t: &HostTopology) -> String {
    let mut out = String::new();
    let source = match &t.source {
        TopologySource::Live => "live host".to_owned(),
        TopologySource::Xml(path) => format!("hwloc XML {path}"),
        TopologySource::Synthetic(desc) => format!("hwloc synthetic {desc:?}"),
    };
    let pus: usize = t.cores.iter().map(|c| c.pus.len()).sum();
    let _ = writeln!(out, "source: {source}");
    let _ = writeln!(
        out,
        "{} package(s), {} NUMA node(s), {} core(s), {} PU(s)",
        t.packages.len(),
        t.nodes.len(),
        t.cores.len(),
        pus
    );
    for package in &t.packages {
        let _ = writeln!(
            out,
            "package {}: nodes {}",
            package.os_index,
            cpulist::format(&package.nodes)
        );
        for node in t
            .nodes
            .iter()
            .filter(|n| package.nodes.contains(&n.os_index))
        {
            render_node(&mut out, t, node, Some(package.os_index));
        }
    }
    let orphans: Vec<&NumaNode> = t
        .nodes
        .iter()
        .filter(|n| !t.packages.iter().any(|p| p.nodes.contains(&n.os_index)))
        .collect();
    if !orphans.is_empty() {
        let _ = writeln!(out, "outside any package:");
        for node in orphans {
            render_node(&mut out, t, node, None);
        }
    }
    let _ = writeln!(
        out,
        "online cpus: {}",
        or_none(&cpulist::format(&t.online_cpus))
    );
    let _ = writeln!(
        out,
        "allowed cpus: {}",
        or_none(&cpulist::format(&t.allowed_cpus))
    );
    let sizes: Vec<String> = t.hugepage_sizes.iter().map(|&s| size_label(s)).collect();
    let _ = writeln!(out, "hugepage sizes: {}", or_none(&sizes.join(", ")));
    render_cgroup_limits(&mut out, t);
    render_distances(&mut out, t);
    out
}

/// One node block: header line, cores of this node (in `package`, if given), hugepage pools.
fn render_node(out: &mut String, t: &HostTopology, node: &NumaNode, package: Option<u32>) {
    let _ = writeln!(
        out,
        "  node {}: cpus {}, memory {}",
        node.os_index,
        or_none(&cpulist::format(&node.cpus)),
        memory_label(node.memory_bytes)
    );
    let cores: Vec<String> = t
        .cores
        .iter()
        .filter(|c| c.node == node.os_index && package.is_none_or(|p| c.package == p))
        .map(|c| format!("{}[{}]", c.index, cpulist::format(&c.pus)))
        .collect();
    if cores.is_empty() {
        let _ = writeln!(out, "    cores: none");
    }
    for (i, chunk) in cores.chunks(CORES_PER_LINE).enumerate() {
        let label = if i == 0 { "cores:" } else { "      " };
        let _ = writeln!(out, "    {label} {}", chunk.join(" "));
    }
    let pools: Vec<String> = node
        .hugepages
        .iter()
        .map(|p| {
            format!(
                "{} {} total/{} free",
                size_label(p.page_size_bytes),
                p.total,
                p.free
            )
        })
        .collect();
    let _ = writeln!(out, "    hugepages: {}", or_none(&pools.join(", ")));
}

/// The memory nodes and hugetlb pages this process's cgroups allow, next to what the host has.
fn render_cgroup_limits(out: &mut String, t: &HostTopology) {
    let nodes: Vec<u32> = t.nodes.iter().map(|n| n.os_index).collect();
    match &t.allowed_mems {
        Some(m) => {
            let _ = writeln!(
                out,
                "allowed memory nodes: {} of the host's {} (cpuset of cgroup {}: {})",
                or_none(&cpulist::format(&m.nodes)),
                cpulist::format(&nodes),
                m.cgroup,
                m.file
            );
        }
        None => {
            let _ = writeln!(
                out,
                "allowed memory nodes: {} (no cgroup cpuset)",
                cpulist::format(&nodes)
            );
        }
    }
    for l in &t.hugetlb_limits {
        let free: u64 = nodes
            .iter()
            .map(|&n| t.free_hugepages(n, l.page_size_bytes))
            .sum();
        let _ = writeln!(
            out,
            "hugetlb limit {}: {} pages may still be taken, the nodes have {free} free (cgroup {}: {} = {} bytes, {} used)",
            size_label(l.page_size_bytes),
            l.pages,
            l.cgroup,
            l.file,
            l.limit_bytes,
            l.usage_bytes
        );
    }
}

/// The distance matrix, `numactl -H` style.
fn render_distances(out: &mut String, t: &HostTopology) {
    let d = &t.distances;
    let _ = write!(out, "node distances:");
    if d.assumed {
        let _ = write!(out, " (assumed: no distance matrix in the topology)");
    }
    let _ = writeln!(out);
    let _ = write!(out, "node");
    for n in &d.nodes {
        let _ = write!(out, " {n:>4}");
    }
    let _ = writeln!(out);
    for (n, row) in d.nodes.iter().zip(&d.matrix) {
        let _ = write!(out, "{n:>3}:");
        for v in row {
            let _ = write!(out, " {v:>4}");
        }
        let _ = writeln!(out);
    }
}

/// Memory for people: `512 MiB`, `4.1 GiB`, or `unknown` for 0.
fn memory_label(bytes: u64) -> String {
    const GIB: u64 = 1 << 30;
    match bytes {
        0 => "unknown".to_owned(),
        b if b >= GIB && b % GIB == 0 => format!("{} GiB", b / GIB),
        b if b >= GIB => format!("{:.1} GiB", b as f64 / GIB as f64),
        b => format!("{} MiB", b >> 20),
    }
}

/// `none` for an empty rendering.
fn or_none(s: &str) -> &str {
    if s.is_empty() {
        "none"
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_labels() {
        assert_eq!(memory_label(0), "unknown");
        assert_eq!(memory_label(512 << 20), "512 MiB");
        assert_eq!(memory_label(2 << 30), "2 GiB");
        assert_eq!(memory_label(4_389_548_032), "4.1 GiB");
    }
}
