//! SVG line charts of benchmark results (throughput against length, one line per JSON file), so
//! README results are pictures drawn from the committed JSON rather than hand-made.

use std::fmt::Write;
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::Value;

const COLORS: [&str; 6] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
];

struct Series {
    label: String,
    points: Vec<(f64, f64)>,
}

fn read_series(path: &Path) -> Result<Series> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let v: Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", path.display()))?;
    let results = v["results"]
        .as_array()
        .with_context(|| format!("{} has no \"results\" list", path.display()))?;
    let points: Vec<(f64, f64)> = results
        .iter()
        .filter_map(|r| Some((r["tokens"].as_f64()?, r["tokens_per_s"].as_f64()?)))
        .collect();
    if points.is_empty() {
        bail!("{} has no {{tokens, tokens_per_s}} results", path.display());
    }
    let label = format!(
        "{} {} ({})",
        v["kind"].as_str().unwrap_or("bench"),
        v["backend"].as_str().unwrap_or(""),
        v["device"].as_str().unwrap_or("")
    );
    Ok(Series { label, points })
}

/// Writes a chart of `inputs` (benchmark JSON files) to `out`; the x axis is log2 of the length.
pub fn write_chart(
    inputs: &[std::path::PathBuf],
    labels: &[String],
    title: &str,
    out: &Path,
) -> Result<()> {
    if inputs.is_empty() {
        bail!("give at least one --input");
    }
    let mut series = inputs
        .iter()
        .map(|p| read_series(p))
        .collect::<Result<Vec<_>>>()?;
    for (s, l) in series.iter_mut().zip(labels) {
        s.label = l.clone();
    }
    // the plot keeps its size; the space below it grows with the legend (one line per series)
    let (w, left, right, top, plot_height) = (760.0, 70.0, 20.0, 40.0, 270.0);
    let bottom = 70.0 + 16.0 * series.len() as f64;
    let h = top + plot_height + bottom;
    let xs: Vec<f64> = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.0.log2()))
        .collect();
    let (x0, x1) = (
        xs.iter().copied().fold(f64::MAX, f64::min),
        xs.iter().copied().fold(f64::MIN, f64::max),
    );
    // y axis up to a round number: steps of 1, 2 or 5 × 10^n, about five of them
    let top_value = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .fold(0.0, f64::max)
        * 1.05;
    let raw_step = (top_value / 5.0).max(1e-9);
    let magnitude = 10f64.powf(raw_step.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * magnitude)
        .find(|s| *s >= raw_step)
        .unwrap_or(10.0 * magnitude);
    let ymax = step * (top_value / step).ceil();
    let px = |x: f64| left + (x.log2() - x0) / (x1 - x0).max(1e-9) * (w - left - right);
    let py = |y: f64| top + (1.0 - y / ymax) * (h - top - bottom);
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="22" font-size="15" text-anchor="middle">{}</text>"#,
        w / 2.0,
        escape(title)
    );
    let steps = (ymax / step).round() as usize;
    for i in 0..=steps {
        let y = step * i as f64;
        let (gy, x2, tx, ty) = (py(y), w - right, left - 6.0, py(y) + 4.0);
        let _ = writeln!(
            svg,
            r##"<line x1="{left}" x2="{x2}" y1="{gy:.1}" y2="{gy:.1}" stroke="#ddd"/><text x="{tx}" y="{ty:.1}" text-anchor="end">{y:.0}</text>"##
        );
    }
    let mut ticks: Vec<f64> = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.0))
        .collect();
    ticks.sort_by(|a, b| a.total_cmp(b));
    ticks.dedup();
    for t in &ticks {
        let label = if *t >= 1024.0 {
            format!("{}K", t / 1024.0)
        } else {
            format!("{t}")
        };
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{}" text-anchor="middle">{label}</text>"#,
            px(*t),
            h - bottom + 18.0
        );
    }
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="{}" text-anchor="middle">tokens (prompt or context length)</text>"#,
        (left + w - right) / 2.0,
        h - bottom + 38.0
    );
    let _ = writeln!(
        svg,
        r#"<text x="16" y="{}" transform="rotate(-90 16 {0})" text-anchor="middle">tokens / s</text>"#,
        (top + h - bottom) / 2.0
    );
    for (i, s) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let pts: Vec<String> = s
            .points
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
            .collect();
        let _ = writeln!(
            svg,
            r#"<polyline fill="none" stroke="{color}" stroke-width="2" points="{}"/>"#,
            pts.join(" ")
        );
        for &(x, y) in &s.points {
            let _ = writeln!(
                svg,
                r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{color}"/>"#,
                px(x),
                py(y)
            );
        }
        let ly = h - bottom + 58.0 + 16.0 * i as f64;
        let _ = writeln!(
            svg,
            r#"<line x1="{left}" x2="{}" y1="{ly}" y2="{ly}" stroke="{color}" stroke-width="2"/><text x="{}" y="{}">{}</text>"#,
            left + 24.0,
            left + 30.0,
            ly + 4.0,
            escape(&s.label)
        );
    }
    svg.push_str("</svg>\n");
    std::fs::write(out, svg).with_context(|| format!("cannot write {}", out.display()))
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chart_has_one_line_per_input() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a.json");
        std::fs::write(&a, r#"{"kind":"decode","backend":"cuda","device":"H200","results":[{"tokens":256,"tokens_per_s":300},{"tokens":4096,"tokens_per_s":280}]}"#).unwrap();
        let b = dir.path().join("b.json");
        std::fs::write(&b, r#"{"kind":"decode","backend":"cpu","device":"x","results":[{"tokens":256,"tokens_per_s":20}]}"#).unwrap();
        let out = dir.path().join("c.svg");
        write_chart(&[a.clone(), b], &["osprey <gpu>".into()], "Decode", &out).unwrap();
        let svg = std::fs::read_to_string(&out).unwrap();
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains("osprey &lt;gpu&gt;") && svg.contains("4K"));
        let bad = dir.path().join("bad.json");
        std::fs::write(&bad, "{}").unwrap();
        assert!(write_chart(&[bad], &[], "x", &out).is_err());
    }
}
