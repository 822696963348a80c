//! The statistics of the side-by-side benchmarks (`benches/peers.rs` on the CI host and the
//! emulated host's `linux_boot_vs_peers`, docs/benchmarks.md): the median, a 95 % bootstrap
//! confidence interval of a median of per-round ratios, and the verdict of an interval against
//! a target. One copy, so that both report their intervals the same way.

/// How many times the rounds are resampled for an interval.
pub const RESAMPLES: usize = 2000;

/// The median of `v` (the mean of the two middle values for an even count; NaN when empty).
pub fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// A small xorshift64 generator: the bootstrap needs no more, and a fixed seed makes the
/// intervals reproducible for the same measurements.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
}

/// The 95 % bootstrap interval of the median of `ratios`: the rounds resampled with
/// replacement [`RESAMPLES`] times, the 2.5th and 97.5th percentiles of the resampled medians
/// (NaN when `ratios` is empty).
#[allow(clippy::cast_possible_truncation)] // a percentile's index, 0..RESAMPLES
pub fn bootstrap_ci(ratios: &[f64]) -> (f64, f64) {
    if ratios.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    let mut rng = XorShift(0x9e37_79b9_7f4a_7c15);
    let n = ratios.len() as u64;
    let mut medians: Vec<f64> = (0..RESAMPLES)
        .map(|_| {
            let sample: Vec<f64> = (0..n)
                .map(|_| ratios[usize::try_from(rng.next() % n).unwrap_or(0)])
                .collect();
            median(&sample)
        })
        .collect();
    medians.sort_by(f64::total_cmp);
    let at = |q: f64| {
        // The percentile's index, within 0..RESAMPLES.
        let i = ((RESAMPLES - 1) as f64 * q).round() as usize;
        medians[i.min(RESAMPLES - 1)]
    };
    (at(0.025), at(0.975))
}

/// "met" only when the whole interval is at or below `target`, "not met" when it is all above,
/// "inconclusive" when it straddles the target.
pub fn verdict(ci: (f64, f64), target: f64) -> &'static str {
    if ci.1 <= target {
        "met"
    } else if ci.0 > target {
        "not met"
    } else {
        "inconclusive"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_odd_and_even() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
    }

    #[test]
    fn interval_holds_the_median_and_the_verdicts() {
        let r = [
            0.9, 0.95, 1.0, 1.05, 1.1, 0.97, 1.02, 0.99, 1.01, 0.98, 1.03,
        ];
        let ci = bootstrap_ci(&r);
        assert!(ci.0 <= median(&r) && median(&r) <= ci.1, "{ci:?}");
        assert_eq!(verdict(ci, 1.0), "inconclusive");
        assert_eq!(verdict((0.7, 0.79), 0.8), "met");
        assert_eq!(verdict((0.81, 0.9), 0.8), "not met");
    }
}
