//! The migration benchmark's statistics and report: medians with their spread, per-pair
//! ratios vmhost / QEMU with their 95 % bootstrap interval and verdict against a target, and
//! each workload's lines, both VMMs side by side ([`report_workload`]).

use vmhost_testsupport::stats;

use super::{Sample, FALLBACK_DOWNTIME_MS, MAX_DOWNTIME_MS, TARGET_DOWNTIME, TARGET_TOTAL};

/// Median, min and max.
fn spread(v: &[f64]) -> (f64, f64, f64) {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return (f64::NAN, f64::NAN, f64::NAN);
    }
    (v[n / 2], v[0], v[n - 1])
}

/// `median [min–max]` with `digits` decimals.
pub(super) fn show(v: &[f64], digits: usize) -> String {
    let (m, lo, hi) = spread(v);
    format!("{m:.digits$} [{lo:.digits$}-{hi:.digits$}]")
}

/// The per-pair ratios `vmhost / QEMU` of one figure.
fn pair_ratios(v: &[Sample], q: &[Sample], f: fn(&Sample) -> f64) -> Vec<f64> {
    v.iter().zip(q).map(|(v, q)| f(v) / f(q)).collect()
}

/// The median of the per-pair ratios `vmhost / QEMU` of one figure.
fn pair_ratio(v: &[Sample], q: &[Sample], f: fn(&Sample) -> f64) -> f64 {
    spread(&pair_ratios(v, q, f)).0
}

/// `median [lo, hi] verdict`: the median of `ratios`, its 95 % bootstrap interval, and the
/// verdict against `target` (at most): met only when the whole interval is at or below it.
pub(super) fn against(ratios: &[f64], target: f64) -> String {
    let ci = stats::bootstrap_ci(ratios);
    format!(
        "per-pair {:.2} [{:.2}, {:.2}]: {}",
        stats::median(ratios),
        ci.0,
        ci.1,
        stats::verdict(ci, target)
    )
}

/// One figure of both VMMs side by side (`digits` decimals): `vmhost median [min-max], QEMU
/// median [min-max]; ratio of medians R, median per-pair ratio P`.
fn side_by_side(v: &[Sample], q: &[Sample], f: fn(&Sample) -> f64, digits: usize) -> String {
    let of = |s: &[Sample]| s.iter().map(f).collect::<Vec<_>>();
    format!(
        "vmhost {}, QEMU {}; ratio of medians {:.2}, median per-pair ratio {:.2}",
        show(&of(v), digits),
        show(&of(q), digits),
        spread(&of(v)).0 / spread(&of(q)).0,
        pair_ratio(v, q, f)
    )
}

/// Prints one workload's figures, both VMMs side by side, and the targets.
pub(super) fn report_workload(name: &str, v: &[Sample], q: &[Sample]) {
    let col = |s: &[Sample], f: fn(&Sample) -> f64, d: usize| {
        show(&s.iter().map(f).collect::<Vec<_>>(), d)
    };
    let gave_up: Vec<f64> = v.iter().filter_map(|s| s.gave_up).collect();
    println!(
        "     {name}: vmhost converged at --max-downtime {MAX_DOWNTIME_MS} in {} of {} runs; \
         in the others it gave up (estimated downtime after its last round, ms: {}) and the \
         figures below are of a second migration of the same guest at --max-downtime \
         {FALLBACK_DOWNTIME_MS}",
        v.len() - gave_up.len(),
        v.len(),
        if gave_up.is_empty() {
            "none".to_string()
        } else {
            show(&gave_up, 0)
        }
    );
    let gap = |s: &Sample| s.gap_ms;
    let total = |s: &Sample| s.total_s;
    println!(
        "     {name}: downtime seen from outside (longest beat gap), ms, median [min-max] of \
         {}: {}",
        v.len(),
        side_by_side(v, q, gap, 0)
    );
    println!(
        "     {name}: own downtime, ms: vmhost (pause to commit) {}, QEMU (query-migrate) {}",
        col(v, |s| s.own_downtime_ms, 0),
        col(q, |s| s.own_downtime_ms, 0)
    );
    println!(
        "     {name}: total time (own reports), s: {}",
        side_by_side(v, q, total, 2)
    );
    println!(
        "     {name}: MiB sent: vmhost {}, QEMU {}; rounds: vmhost {}, QEMU dirty syncs {}",
        col(v, |s| s.bytes / 1048576.0, 1),
        col(q, |s| s.bytes / 1048576.0, 1),
        col(v, |s| s.rounds, 0),
        col(q, |s| s.rounds, 0)
    );
    println!(
        "     {name}: targets (95 % bootstrap interval of the median per-pair ratio): downtime \
         <= {TARGET_DOWNTIME} x QEMU's: {}; total time <= {TARGET_TOTAL} x QEMU's: {}",
        against(&pair_ratios(v, q, gap), TARGET_DOWNTIME),
        against(&pair_ratios(v, q, total), TARGET_TOTAL)
    );
}
