//! Migration target check: can another host hold the same VM with the same guest topology?

use serde::Serialize;
use vmhost_config::{format_bytes, VmSpec};
use vmhost_topology::{cpulist, HostTopology, HugepagePool};

use crate::{plan, Outcome, PlanOptions};

/// A guest cell as the guest sees it: (vCPUs, memory bytes, distances to every cell).
type Cell = (Vec<u32>, u64, Vec<u32>);

/// The result of planning a VM on a migration target.
#[derive(Debug, Clone, Serialize)]
pub struct TargetCheck {
    /// True when the target holds the VM with the source's guest topology.
    pub fits: bool,
    /// Why not.
    pub reasons: Vec<String>,
    /// The plan on the target (its placement and target memory overhead).
    pub target: Outcome,
    /// Guest cells on the source: (vCPUs, memory bytes, distances) per cell.
    pub source_cells: Vec<(Vec<u32>, u64, Vec<u32>)>,
}

/// Plans `spec` on `target` and compares the guest it would see with the guest on `source`.
///
/// The guest must see the same NUMA cells (same vCPUs, memory and distances per cell); the
/// CPU topology and hugepage size come from the spec and so are the same by construction.
pub fn check_target(
    spec: &VmSpec,
    source: &HostTopology,
    target: &HostTopology,
    opts: &PlanOptions,
) -> TargetCheck {
    let src = plan(spec, &with_own_memory(source, spec), opts);
    let tgt = plan(
        spec,
        target,
        &PlanOptions {
            held_cpus: Default::default(),
            ..opts.clone()
        },
    );
    let cells = |o: &Outcome| -> Vec<Cell> {
        o.plan
            .guest_cells
            .iter()
            .map(|c| (c.vcpus.clone(), c.memory_bytes, c.distances.clone()))
            .collect()
    };
    let (sc, tc) = (cells(&src), cells(&tgt));
    let mut reasons = tgt.reasons.clone();
    if tgt.fits && sc != tc {
        reasons.push(format!(
            "the target gives the guest {} NUMA cell(s), the source {}; the guest topology would change:\n{}",
            tc.len(),
            sc.len(),
            cell_table(&sc, &tc)
        ));
    }
    TargetCheck {
        fits: reasons.is_empty(),
        reasons,
        target: tgt,
        source_cells: sc,
    }
}

/// Both hosts' guest cells as a table: one row per host and cell with its vCPUs, memory and
/// distances to the other cells.
fn cell_table(source: &[Cell], target: &[Cell]) -> String {
    let mut rows = vec![[
        "host".to_string(),
        "cell".to_string(),
        "vCPUs".to_string(),
        "memory".to_string(),
        "distances".to_string(),
    ]];
    for (host, cells) in [("source", source), ("target", target)] {
        for (i, (vcpus, memory, distances)) in cells.iter().enumerate() {
            rows.push([
                host.to_string(),
                i.to_string(),
                cpulist::format(vcpus),
                format_bytes(*memory),
                distances
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(" "),
            ]);
        }
    }
    let widths: Vec<usize> = (0..5)
        .map(|c| rows.iter().map(|r| r[c].len()).max().unwrap_or(0))
        .collect();
    rows.iter()
        .map(|r| {
            let cols: Vec<String> = r
                .iter()
                .zip(&widths)
                .map(|(v, w)| format!("{v:<w$}"))
                .collect();
            format!("      {}", cols.join("  ").trim_end())
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The source as the running VM sees it: its guest memory is there already, so the source's
/// free pools (often empty, or not given with `--source-topology`) do not decide the guest
/// topology; every node is given room for the whole guest.
fn with_own_memory(source: &HostTopology, spec: &VmSpec) -> HostTopology {
    let mut h = source.clone();
    let Some(page) = spec.memory.hugepages.as_ref().map(|p| p.page_size_bytes) else {
        return h;
    };
    let pages = spec.memory.guest_ram_bytes().div_ceil(page);
    for n in &mut h.nodes {
        match n.hugepages.iter_mut().find(|p| p.page_size_bytes == page) {
            Some(p) => p.free = p.free.max(pages),
            None => {
                n.hugepages.push(HugepagePool {
                    page_size_bytes: page,
                    total: pages,
                    free: pages,
                });
                n.hugepages.sort_by_key(|p| p.page_size_bytes);
            }
        }
    }
    if !h.hugepage_sizes.contains(&page) {
        h.hugepage_sizes.push(page);
        h.hugepage_sizes.sort_unstable();
    }
    h
}

#[cfg(test)]
mod tests {
    use vmhost_config::from_toml_str;
    use vmhost_topology::{apply_hugepages, load_synthetic, parse_hugepages_arg};

    use super::*;

    #[test]
    fn a_changed_guest_topology_is_shown_as_a_table_not_tuples() {
        let spec = from_toml_str(
            "[cpu]\ncores = 6\ndedicated_cpu_placement = true\nnuma = { guest_mapping_passthrough = true }\n\
             [memory]\nguest = \"64Mi\"\nhugepages = { page_size = \"2Mi\" }\n",
            "t.toml",
        )
        .unwrap()
        .spec;
        let source = load_synthetic("package:2 numa:1 core:4 pu:1").unwrap();
        let mut target = load_synthetic("package:1 numa:1 core:8 pu:1").unwrap();
        apply_hugepages(&mut target, &parse_hugepages_arg("node0:2Mi=64").unwrap()).unwrap();
        let check = check_target(&spec, &source, &target, &PlanOptions::default());
        assert!(!check.fits);
        let reason = check.reasons.join("\n");
        assert!(!reason.contains("(["), "{reason}");
        let lines: Vec<&str> = reason.lines().map(str::trim_end).collect();
        assert_eq!(
            lines[1..],
            [
                "      host    cell  vCPUs  memory  distances",
                "      source  0     0-3    42Mi    10 20",
                "      source  1     4-5    22Mi    20 10",
                "      target  0     0-5    64Mi    10",
            ],
            "{reason}"
        );
    }
}
