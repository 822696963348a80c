//! Repeat statistics: every number the benchmark reports is the median of its runs, with the
//! run count and the spread (min, max).

use std::fmt;

use serde::Serialize;

/// Median, minimum and maximum of repeated measurements.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Spread {
    /// Number of runs.
    pub runs: usize,
    /// Smallest value.
    pub min: f64,
    /// Median (the mean of the two middle values for an even count).
    pub median: f64,
    /// Largest value.
    pub max: f64,
}

impl Spread {
    /// The spread of `values` (NaN values are ignored; all zero when none is left).
    pub fn of(values: &[f64]) -> Spread {
        let mut v: Vec<f64> = values.iter().copied().filter(|x| !x.is_nan()).collect();
        v.sort_by(f64::total_cmp);
        let n = v.len();
        if n == 0 {
            return Spread {
                runs: 0,
                min: 0.0,
                median: 0.0,
                max: 0.0,
            };
        }
        let median = if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        };
        Spread {
            runs: n,
            min: v[0],
            median,
            max: v[n - 1],
        }
    }

    /// `median [min–max]` with `decimals` digits.
    pub fn render(&self, decimals: usize) -> String {
        format!(
            "{:.d$} [{:.d$}–{:.d$}]",
            self.median,
            self.min,
            self.max,
            d = decimals
        )
    }
}

impl fmt::Display for Spread {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.render(2))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_min_max() {
        let s = Spread::of(&[3.0, 1.0, 2.0]);
        assert_eq!((s.runs, s.min, s.median, s.max), (3, 1.0, 2.0, 3.0));
        let s = Spread::of(&[4.0, 1.0, 2.0, 3.0, f64::NAN]);
        assert_eq!((s.runs, s.median), (4, 2.5));
        assert_eq!(Spread::of(&[]).runs, 0);
        assert_eq!(Spread::of(&[1.0, 2.0, 9.0]).render(1), "2.0 [1.0–9.0]");
    }
}
