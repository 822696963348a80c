//! Migration target check: can another host hold the same VM with the same guest topology?

use serde::Serialize;
use vmhost_config::VmSpec;
use vmhost_topology::HostTopology;

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
    let src = plan(spec, source, opts);
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
