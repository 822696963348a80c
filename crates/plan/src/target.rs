//! Migration target check: can another host hold the same VM with the same guest topology?

use serde::Serialize;
use vmhost_config::VmSpec;
use vmhost_topology::{HostTopology, HugepagePool};

use crate::{plan, Outcome, PlanOptions};

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
    let cells = |o: &Outcome| -> Vec<(Vec<u32>, u64, Vec<u32>)> {
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
            "the target gives the guest {} NUMA cell(s) {:?}, the source {} {:?} (vCPUs, memory, distances per cell); the guest topology would change",
            tc.len(),
            tc,
            sc.len(),
            sc
        ));
    }
    TargetCheck {
        fits: reasons.is_empty(),
        reasons,
        target: tgt,
        source_cells: sc,
    }
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
