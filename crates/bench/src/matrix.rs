//! Result matrices (rows: threads/vCPUs, columns: cells/nodes), shared by the terminal tables
//! and the SVG heatmaps.

use serde::Serialize;

use crate::stats::Spread;

/// Which direction is better for a matrix's numbers (it sets the heatmap colours).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Better {
    /// Latency: lower is better.
    Lower,
    /// Bandwidth: higher is better.
    Higher,
    /// A guest/host ratio: 1.0 is native, at least 0.95 is the target.
    Ratio,
}

/// One matrix of spreads.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Matrix {
    /// Title (scenario, metric, side, unit).
    pub title: String,
    /// Short name used as a column prefix in tables (`guest`, `host`, `ratio`).
    pub short: String,
    /// Row labels.
    pub rows: Vec<String>,
    /// Column labels.
    pub cols: Vec<String>,
    /// `values[row][col]`; `None` where nothing was measured.
    pub values: Vec<Vec<Option<Spread>>>,
    /// Decimals to print.
    pub decimals: usize,
    /// Which direction is better.
    pub better: Better,
}

/// Something that can be shown as matrices (a benchmark report).
pub trait Matrices {
    /// A title for the whole set.
    fn heading(&self) -> String;
    /// The matrices, in display order.
    fn matrices(&self) -> Vec<Matrix>;
}

/// Renders same-shaped matrices side by side as one text table: one row per matrix row, and
/// for each column of the matrices one column per matrix.
pub fn render_side_by_side(label: &str, ms: &[&Matrix]) -> String {
    let Some(first) = ms.first() else {
        return String::new();
    };
    let mut table: Vec<Vec<String>> = Vec::new();
    let mut header = vec![label.to_string()];
    for col in &first.cols {
        for m in ms {
            header.push(format!("{} {col}", m.short));
        }
    }
    table.push(header);
    for (r, row) in first.rows.iter().enumerate() {
        let mut line = vec![row.clone()];
        for c in 0..first.cols.len() {
            for m in ms {
                let cell = m
                    .values
                    .get(r)
                    .and_then(|v| v.get(c))
                    .copied()
                    .flatten()
                    .map_or_else(|| "-".to_string(), |s| s.render(m.decimals));
                line.push(cell);
            }
        }
        table.push(line);
    }
    align(&table)
}

/// Left-aligns the first column and right-aligns the others, two spaces apart.
fn align(table: &[Vec<String>]) -> String {
    let cols = table.iter().map(Vec::len).max().unwrap_or(0);
    let width = |c: usize| {
        table
            .iter()
            .filter_map(|r| r.get(c))
            .map(|s| s.chars().count())
            .max()
            .unwrap_or(0)
    };
    let widths: Vec<usize> = (0..cols).map(width).collect();
    let mut out = String::new();
    for row in table {
        let mut line = String::from("  ");
        for (c, cell) in row.iter().enumerate() {
            if c == 0 {
                line.push_str(&format!("{cell:<w$}", w = widths[c]));
            } else {
                line.push_str(&format!("  {cell:>w$}", w = widths[c]));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn side_by_side_interleaves_the_matrices_per_column() {
        let m = |short: &str, v: f64| Matrix {
            title: String::new(),
            short: short.into(),
            rows: vec!["vcpu0".into(), "vcpu1".into()],
            cols: vec!["cell0".into()],
            values: vec![vec![Some(Spread::of(&[v]))], vec![None]],
            decimals: 1,
            better: Better::Lower,
        };
        let (g, h) = (m("guest", 236.0), m("host", 248.0));
        let text = render_side_by_side("latency ns", &[&g, &h]);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(lines[0].contains("guest cell0") && lines[0].contains("host cell0"));
        assert!(lines[1].contains("236.0 [236.0–236.0]"), "{text}");
        assert!(lines[1].find("236.0").unwrap() < lines[1].find("248.0").unwrap());
        assert!(lines[2].trim_end().ends_with('-'), "{text}");
    }
}
