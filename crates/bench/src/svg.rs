//! SVG heatmaps, hand-written (no plotting dependency): one panel per matrix, three panels to
//! a row; each cell coloured from red (worse) through yellow to green (better) and labelled
//! with its median and `[min–max]`.
//!
//! Colours compare against the best median of the same scenario and metric, guest and host
//! panels together: green is the best, red is half its bandwidth or twice its latency, so
//! differences of a few percent look alike and a remote node stands out. Ratio panels use a
//! fixed scale: green ≥ 1.0 (native), red ≤ 0.85.

use std::fmt::Write as _;
use std::path::Path;

use crate::matrix::{Better, Matrices, Matrix};
use crate::BenchError;

const CELL_W: f64 = 150.0;
const CELL_H: f64 = 44.0;
const ROW_LABEL_W: f64 = 110.0;
const HEAD_H: f64 = 58.0;
const PAD: f64 = 24.0;
const PER_ROW: usize = 3;
const RATIO_RED: f64 = 0.85;

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// Red → yellow → green for `g` in 0..=1.
fn colour(g: f64) -> String {
    let g = if g.is_finite() {
        g.clamp(0.0, 1.0)
    } else {
        0.5
    };
    let (red, yellow, green) = (
        (230.0, 124.0, 115.0),
        (255.0, 214.0, 102.0),
        (87.0, 187.0, 138.0),
    );
    let (a, b, t): ((f64, f64, f64), (f64, f64, f64), f64) = if g < 0.5 {
        (red, yellow, g * 2.0)
    } else {
        (yellow, green, (g - 0.5) * 2.0)
    };
    let mix = |x: f64, y: f64| (x + (y - x) * t).round();
    format!("rgb({},{},{})", mix(a.0, b.0), mix(a.1, b.1), mix(a.2, b.2))
}

/// The scale key of a matrix: its title up to the side (`pinned: latency`).
fn group(m: &Matrix) -> &str {
    m.title.split(',').next().unwrap_or(&m.title)
}

fn medians(m: &Matrix) -> impl Iterator<Item = f64> + '_ {
    m.values.iter().flatten().flatten().map(|s| s.median)
}

/// How good `v` is, 0..=1 (above 1 is clamped), against `best` of its group.
fn goodness(m: &Matrix, v: f64, best: f64) -> f64 {
    let q = match m.better {
        Better::Ratio => return (v - RATIO_RED) / (1.0 - RATIO_RED),
        Better::Lower => best / v,
        Better::Higher => v / best,
    };
    (q - 0.5) / 0.5
}

fn legend(m: &Matrix) -> &'static str {
    match m.better {
        Better::Lower => "lower is better; green = best, red = 2× the best",
        Better::Higher => "higher is better; green = best, red = half the best",
        Better::Ratio => "1.0 = native, target ≥ 0.95; green ≥ 1.0, red ≤ 0.85",
    }
}

/// Rough text width in pixels (sans-serif, average glyph ≈ 0.6 em).
fn text_w(text: &str, size: f64) -> f64 {
    text.chars().count() as f64 * size * 0.6
}

fn panel_size(m: &Matrix) -> (f64, f64) {
    let grid = ROW_LABEL_W + CELL_W * m.cols.len().max(1) as f64;
    let title = text_w(&m.title, 14.0).max(text_w(legend(m), 11.0) + 110.0);
    (
        grid.max(title) + PAD,
        HEAD_H + CELL_H * m.rows.len().max(1) as f64 + PAD,
    )
}

fn panel(out: &mut String, m: &Matrix, x: f64, y: f64, best: f64) {
    let runs = medians(m).next().map(|_| {
        m.values
            .iter()
            .flatten()
            .flatten()
            .map(|s| s.runs)
            .max()
            .unwrap_or(0)
    });
    let _ = writeln!(
        out,
        r#"<text x="{x}" y="{}" font-size="14" font-weight="bold">{}</text>"#,
        y + 16.0,
        esc(&m.title)
    );
    let _ = writeln!(
        out,
        r##"<text x="{x}" y="{}" font-size="11" fill="#555">{} · n={} runs · median [min–max]</text>"##,
        y + 31.0,
        legend(m),
        runs.unwrap_or(0)
    );
    for (c, label) in m.cols.iter().enumerate() {
        let cx = x + ROW_LABEL_W + CELL_W * (c as f64 + 0.5);
        let _ = writeln!(
            out,
            r#"<text x="{cx}" y="{}" font-size="12" text-anchor="middle">{}</text>"#,
            y + HEAD_H - 6.0,
            esc(label)
        );
    }
    for (r, label) in m.rows.iter().enumerate() {
        let ry = y + HEAD_H + CELL_H * r as f64;
        let _ = writeln!(
            out,
            r#"<text x="{}" y="{}" font-size="12" text-anchor="end">{}</text>"#,
            x + ROW_LABEL_W - 8.0,
            ry + CELL_H / 2.0 + 4.0,
            esc(label)
        );
        for c in 0..m.cols.len() {
            let cx = x + ROW_LABEL_W + CELL_W * c as f64;
            let v = m
                .values
                .get(r)
                .and_then(|row| row.get(c))
                .copied()
                .flatten();
            let fill = v.map_or_else(
                || "#eee".to_string(),
                |s| colour(goodness(m, s.median, best)),
            );
            let _ = writeln!(
                out,
                r##"<rect x="{cx}" y="{ry}" width="{CELL_W}" height="{CELL_H}" fill="{fill}" stroke="#fff" stroke-width="2"/>"##
            );
            let Some(s) = v else { continue };
            let mid = cx + CELL_W / 2.0;
            let _ = writeln!(
                out,
                r#"<text x="{mid}" y="{}" font-size="15" font-weight="bold" text-anchor="middle">{:.d$}</text>"#,
                ry + 19.0,
                s.median,
                d = m.decimals
            );
            let _ = writeln!(
                out,
                r#"<text x="{mid}" y="{}" font-size="11" text-anchor="middle">[{:.d$}–{:.d$}]</text>"#,
                ry + 35.0,
                s.min,
                s.max,
                d = m.decimals
            );
        }
    }
}

/// The SVG document for `report`.
pub fn render_svg(report: &impl Matrices) -> String {
    let ms = report.matrices();
    // Panels of the same position in their row share a column width, so rows line up.
    let mut col_w = [0.0f64; PER_ROW];
    for row in ms.chunks(PER_ROW) {
        for (j, m) in row.iter().enumerate() {
            col_w[j] = col_w[j].max(panel_size(m).0);
        }
    }
    let mut body = String::new();
    let (mut y, mut width) = (PAD + 34.0, 0.0f64);
    for row in ms.chunks(PER_ROW) {
        let mut x = PAD;
        let mut h = 0.0f64;
        for (j, m) in row.iter().enumerate() {
            let vals = ms
                .iter()
                .filter(|o| group(o) == group(m) && o.better == m.better)
                .flat_map(medians);
            let best = match m.better {
                Better::Lower => vals.fold(f64::INFINITY, f64::min),
                _ => vals.fold(f64::NEG_INFINITY, f64::max),
            };
            panel(&mut body, m, x, y, best);
            x += col_w[j];
            h = h.max(panel_size(m).1);
        }
        width = width.max(x);
        y += h;
    }
    let width = width.max(text_w(&report.heading(), 16.0) + PAD) + PAD;
    let height = y + PAD;
    format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" \
         viewBox=\"0 0 {width} {height}\" font-family=\"sans-serif\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"#fff\"/>\n\
         <text x=\"{PAD}\" y=\"{}\" font-size=\"16\" font-weight=\"bold\">{}</text>\n{body}</svg>\n",
        PAD + 10.0,
        esc(&report.heading())
    )
}

/// Writes the heatmaps of `report` (a [`crate::BenchReport`] or [`crate::HostReport`]) to
/// `path` as one SVG file.
pub fn write_svg(report: &impl Matrices, path: &Path) -> Result<(), BenchError> {
    std::fs::write(path, render_svg(report)).map_err(|source| BenchError::WriteSvg {
        path: path.to_path_buf(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::Spread;

    struct Two(Vec<Matrix>);

    impl Matrices for Two {
        fn heading(&self) -> String {
            "a & b".into()
        }
        fn matrices(&self) -> Vec<Matrix> {
            self.0.clone()
        }
    }

    fn m(title: &str, better: Better, v: &[f64]) -> Matrix {
        Matrix {
            title: title.into(),
            short: "guest".into(),
            rows: (0..v.len()).map(|i| format!("vcpu{i}")).collect(),
            cols: vec!["cell0 <bind:0>".into()],
            values: v
                .iter()
                .map(|x| vec![Some(Spread::of(&[*x, x + 1.0]))])
                .collect(),
            decimals: 1,
            better,
        }
    }

    #[test]
    fn one_rect_per_cell_labelled_and_escaped() {
        let r = Two(vec![
            m(
                "pinned: latency, guest (ns)",
                Better::Lower,
                &[200.0, 300.0],
            ),
            m("pinned: latency, host (ns)", Better::Lower, &[250.0, 250.0]),
            m("pinned: latency, ratio", Better::Ratio, &[1.0, 0.3]),
        ]);
        let svg = render_svg(&r);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<rect").count(), 1 + 6, "background + 6 cells");
        assert!(svg.contains("a &amp; b") && svg.contains("cell0 &lt;bind:0&gt;"));
        assert!(svg.contains(">200.5<") && svg.contains("[200.0–201.0]"));
        assert!(svg.contains("n=2 runs"));
        // Shared scale for guest and host latency: 200.5 is the best (green); 300.5 is 1.5×
        // the best (between yellow and red); the 0.8 ratio (median of 0.3 and 1.3) is red.
        assert!(svg.contains(&colour(1.0)));
        assert!(svg.contains(&colour((200.5 / 300.5 - 0.5) / 0.5)));
        assert!(svg.contains(&colour(0.0)));
    }

    #[test]
    fn colours_run_red_to_green() {
        assert_eq!(colour(0.0), "rgb(230,124,115)");
        assert_eq!(colour(0.5), "rgb(255,214,102)");
        assert_eq!(colour(1.0), "rgb(87,187,138)");
        assert_eq!(colour(f64::NAN), colour(0.5));
        let ratio = m("x", Better::Ratio, &[1.0]);
        assert!(goodness(&ratio, 1.0, 0.0) >= 1.0);
        assert!(goodness(&ratio, 0.85, 0.0).abs() < 1e-12);
        let lat = m("x", Better::Lower, &[1.0]);
        assert_eq!(goodness(&lat, 100.0, 100.0), 1.0);
        assert_eq!(goodness(&lat, 200.0, 100.0), 0.0);
        let bw = m("x", Better::Higher, &[1.0]);
        assert_eq!(goodness(&bw, 15.0, 20.0), 0.5);
    }
}
