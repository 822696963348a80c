//! Migration target check: can another host hold the same VM with the same guest topology?
//!
//! The guest's topology is the source's plan's [`GuestIdentity`]; the target plans the spec
//! keeping it ([`plan_for_guest`]). When it cannot, and a plan from scratch would give the
//! guest other cells, the reasons also show both guests' cells side by side.

use serde::Serialize;
use vmhost_config::{format_bytes, VmSpec};
use vmhost_topology::{cpulist, HostTopology, HugepagePool};

use crate::{plan, plan_for_guest, GuestIdentity, Outcome, PlanOptions};

/// A guest cell as the guest sees it: (vCPUs, memory bytes, distances to every cell).
type Cell = (Vec<u32>, u64, Vec<u32>);

/// The result of planning a VM on a migration target.
#[derive(Debug, Clone, Serialize)]
pub struct TargetCheck {
    /// True when the target holds the VM with the source's guest topology.
    pub fits: bool,
    /// Why not.
    pub reasons: Vec<String>,
    /// The plan on the target that keeps the guest's topology (its placement, target memory
    /// overhead, and `distances`: the host's distances between the nodes it chose).
    pub target: Outcome,
    /// Guest cells on the source: (vCPUs, memory bytes, distances) per cell.
    pub source_cells: Vec<(Vec<u32>, u64, Vec<u32>)>,
    /// The guest's topology the target must keep.
    pub identity: GuestIdentity,
}

/// Plans `spec` on `target` for the guest `spec` has on `source`, unchanged: same CPU topology
/// and APIC IDs, same NUMA cells (vCPUs and memory per cell), same page size and the same
/// distances between cells (the host's distances between the chosen nodes must equal them:
/// `same_distances` is set whatever `opts` says). [`check_target_identity`] takes a saved
/// identity and honours `opts.same_distances`.
pub fn check_target(
    spec: &VmSpec,
    source: &HostTopology,
    target: &HostTopology,
    opts: &PlanOptions,
) -> TargetCheck {
    let identity = source_identity(spec, source, opts);
    let strict = PlanOptions {
        same_distances: true,
        ..opts.clone()
    };
    check_target_identity(spec, &identity, target, &strict)
}

/// The guest `spec` has on `source` (its memory there already: the source's free pools do not
/// decide its cells).
pub fn source_identity(spec: &VmSpec, source: &HostTopology, opts: &PlanOptions) -> GuestIdentity {
    plan(spec, &with_own_memory(source, spec), opts)
        .plan
        .guest_identity()
}

/// Plans `spec` on `target` keeping the guest `identity` ([`plan_for_guest`]); PUs held on
/// the target are taken from `opts.held_cpus`.
pub fn check_target_identity(
    spec: &VmSpec,
    identity: &GuestIdentity,
    target: &HostTopology,
    opts: &PlanOptions,
) -> TargetCheck {
    let tgt = plan_for_guest(spec, target, identity, opts);
    let sc: Vec<Cell> = identity
        .cells
        .iter()
        .map(|c| {
            let vcpus = c.vcpus.iter().map(|v| v.vcpu).collect();
            (vcpus, c.memory_bytes, c.distances.clone())
        })
        .collect();
    let mut reasons = Vec::new();
    if !tgt.fits {
        // What a guest started afresh there would see, when that differs.
        let fresh = plan(spec, target, opts);
        let tc: Vec<Cell> = fresh
            .plan
            .guest_cells
            .iter()
            .map(|c| (c.vcpus.clone(), c.memory_bytes, c.distances.clone()))
            .collect();
        if fresh.fits && sc != tc {
            reasons.push(format!(
                "the target gives the guest {} NUMA cell(s), the source {}; the guest topology would change:\n{}",
                tc.len(),
                sc.len(),
                cell_table(&sc, &tc)
            ));
        }
    }
    reasons.extend(tgt.reasons.iter().cloned());
    TargetCheck {
        fits: tgt.fits,
        reasons,
        target: tgt,
        source_cells: sc,
        identity: identity.clone(),
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
        // The table first; then why the target cannot keep the guest's cells as they are.
        assert!(lines[5].contains("node distances differ"), "{reason}");
        assert_eq!(
            lines[1..5],
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
