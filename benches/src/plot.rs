//! PNG plots of benchmark results (plotters, drawn into a bitmap with the
//! DejaVu Sans font that the `dejavu` crate embeds, so that a machine with
//! no fonts installed draws the same labels).
//!
//! A [`Figure`] names what to draw from a result's rows: one line per
//! series (rows that agree on the `series` keys), `y` against `x`, either
//! axis logarithmic. An `x` of strings is drawn as categories in the order
//! the rows give them.

use std::path::Path;

use plotters::prelude::*;
use serde_json::Value;

use crate::transport::BoxError;

/// One figure of a benchmark.
#[derive(Debug, Clone)]
pub struct Figure {
    /// The PNG's file name (without directory).
    pub file: &'static str,
    /// Its title.
    pub title: &'static str,
    /// Only rows whose field has this value (`(key, value)` pairs).
    pub filter: &'static [(&'static str, &'static str)],
    /// The field along x.
    pub x: &'static str,
    /// The field along y.
    pub y: &'static str,
    /// Fields whose values name a series.
    pub series: &'static [&'static str],
    /// Axis captions.
    pub x_label: &'static str,
    /// Axis captions.
    pub y_label: &'static str,
    /// Logarithmic x.
    pub x_log: bool,
    /// Logarithmic y.
    pub y_log: bool,
}

/// Registers the embedded font once.
fn font() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let _ = plotters::style::register_font(
            "sans-serif",
            FontStyle::Normal,
            dejavu::sans::regular(),
        );
    });
}

fn text(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        other => other.to_string(),
    }
}

fn matches(row: &Value, filter: &[(&str, &str)]) -> bool {
    filter.iter().all(|(key, want)| text(&row[*key]) == *want)
}

/// The points of each series: (name, [(x, y)]), with the category names
/// when an x is a string (then every x is one).
#[allow(clippy::type_complexity)]
fn series_of(rows: &[Value], figure: &Figure) -> (Vec<(String, Vec<(f64, f64)>)>, Vec<String>) {
    let mut categories: Vec<String> = Vec::new();
    let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    // One string among the x values (a window of `none` beside byte
    // counts) makes every x a category, in the rows' order.
    let categorical = rows
        .iter()
        .filter(|r| matches(r, figure.filter))
        .any(|r| r[figure.x].is_string());
    for row in rows.iter().filter(|r| matches(r, figure.filter)) {
        let Some(y) = row[figure.y].as_f64() else {
            continue;
        };
        let x_value = match &row[figure.x] {
            Value::Number(n) if categorical => Value::String(n.to_string()),
            other => other.clone(),
        };
        let x = match &x_value {
            Value::String(name) => {
                let at = categories
                    .iter()
                    .position(|c| c == name)
                    .unwrap_or_else(|| {
                        categories.push(name.clone());
                        categories.len() - 1
                    });
                at as f64
            }
            other => match other.as_f64() {
                Some(x) => x,
                None => continue,
            },
        };
        // The first key's value alone, the others with their key:
        // "tcp, outstanding 8".
        let name = figure
            .series
            .iter()
            .enumerate()
            .map(|(i, key)| match i {
                0 => text(&row[*key]),
                _ => format!("{} {}", key.replace('_', " "), text(&row[*key])),
            })
            .collect::<Vec<_>>()
            .join(", ");
        match series.iter_mut().find(|(n, _)| *n == name) {
            Some((_, points)) => points.push((x, y)),
            None => series.push((name, vec![(x, y)])),
        }
    }
    for (_, points) in &mut series {
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    (series, categories)
}

/// Draws `figure` from `rows` into `dir`; `Ok(false)` when no row has
/// both fields (nothing drawn).
pub fn draw(dir: &Path, rows: &[Value], figure: &Figure) -> Result<bool, BoxError> {
    font();
    let (series, categories) = series_of(rows, figure);
    let points: Vec<(f64, f64)> = series.iter().flat_map(|(_, p)| p.iter().copied()).collect();
    if points.is_empty() {
        return Ok(false);
    }
    let span = |values: &mut dyn Iterator<Item = f64>, log: bool| {
        let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
        for v in values {
            if !log || v > 0.0 {
                lo = lo.min(v);
                hi = hi.max(v);
            }
        }
        if !lo.is_finite() {
            return (1.0, 10.0);
        }
        match log {
            true => (lo / 1.5, hi * 1.5),
            false => {
                let pad = ((hi - lo) * 0.08).max(hi.abs() * 0.05).max(1e-9);
                ((lo - pad).min(0.0_f64.max(lo - pad)), hi + pad)
            }
        }
    };
    let (x_lo, x_hi) = match categories.is_empty() {
        true => span(&mut points.iter().map(|p| p.0), figure.x_log),
        false => (-0.5, categories.len() as f64 - 0.5),
    };
    let (mut y_lo, y_hi) = span(&mut points.iter().map(|p| p.1), figure.y_log);
    let bars = !categories.is_empty();
    if bars && !figure.y_log {
        y_lo = 0.0;
    }
    let path = dir.join(figure.file);
    let root = BitMapBackend::new(&path, (900, 540)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root);
    chart
        .caption(figure.title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(48)
        .y_label_area_size(72);
    let x_log = figure.x_log && categories.is_empty();
    macro_rules! finish {
        ($chart:expr) => {{
            let mut chart = $chart;
            let categories = categories.clone();
            chart
                .configure_mesh()
                .x_desc(figure.x_label)
                .y_desc(figure.y_label)
                .x_labels(if categories.is_empty() {
                    10
                } else {
                    categories.len()
                })
                .x_label_formatter(&move |x: &f64| {
                    if categories.is_empty() {
                        compact(*x)
                    } else {
                        let at = x.round();
                        if (x - at).abs() < 1e-6 && at >= 0.0 {
                            categories.get(at as usize).cloned().unwrap_or_default()
                        } else {
                            String::new()
                        }
                    }
                })
                .y_label_formatter(&|y: &f64| compact(*y))
                .draw()?;
            let width = 0.8 / series.len().max(1) as f64;
            for (i, (name, points)) in series.iter().enumerate() {
                let color = Palette99::pick(i).to_rgba();
                let drawn = if bars {
                    // Categories: a bar per series side by side.
                    let left = -0.4 + i as f64 * width;
                    chart.draw_series(points.iter().map(|&(x, y)| {
                        Rectangle::new(
                            [(x + left, y_lo), (x + left + width * 0.9, y)],
                            color.filled(),
                        )
                    }))?
                } else {
                    chart.draw_series(
                        points
                            .iter()
                            .map(|&(x, y)| Circle::new((x, y), 3, color.filled())),
                    )?;
                    chart.draw_series(LineSeries::new(
                        points.iter().copied(),
                        color.stroke_width(2),
                    ))?
                };
                drawn.label(name.clone()).legend(move |(x, y)| {
                    Rectangle::new([(x, y - 4), (x + 14, y + 4)], color.filled())
                });
            }
            if series.len() > 1 || !series.first().is_some_and(|(n, _)| n.is_empty()) {
                chart
                    .configure_series_labels()
                    .background_style(WHITE.mix(0.85))
                    .border_style(BLACK)
                    .label_font(("sans-serif", 14))
                    .draw()?;
            }
        }};
    }
    match (x_log, figure.y_log) {
        (false, false) => finish!(chart.build_cartesian_2d(x_lo..x_hi, y_lo..y_hi)?),
        (true, false) => finish!(chart.build_cartesian_2d((x_lo..x_hi).log_scale(), y_lo..y_hi)?),
        (false, true) => finish!(chart.build_cartesian_2d(x_lo..x_hi, (y_lo..y_hi).log_scale())?),
        (true, true) => {
            finish!(chart.build_cartesian_2d((x_lo..x_hi).log_scale(), (y_lo..y_hi).log_scale())?)
        }
    }
    root.present()?;
    Ok(true)
}

/// A short label: 1.2k, 3.4M, 0.05.
fn compact(v: f64) -> String {
    let a = v.abs();
    if a >= 1e9 {
        format!("{:.1}G", v / 1e9)
    } else if a >= 1e6 {
        format!("{:.1}M", v / 1e6)
    } else if a >= 1e4 {
        format!("{:.0}k", v / 1e3)
    } else if a >= 100.0 || a == 0.0 {
        format!("{v:.0}")
    } else if a >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    const FIGURE: Figure = Figure {
        file: "unit.png",
        title: "unit",
        filter: &[("test", "latency")],
        x: "size",
        y: "p50_us",
        series: &["transport"],
        x_label: "bytes",
        y_label: "µs",
        x_log: true,
        y_log: false,
    };

    #[test]
    fn series_group_filtered_rows_by_their_keys() {
        let rows = vec![
            json!({"test": "latency", "transport": "tcp", "size": 1024, "p50_us": 30.0}),
            json!({"test": "latency", "transport": "tcp", "size": 32, "p50_us": 20.0}),
            json!({"test": "latency", "transport": "rdma", "size": 32, "p50_us": 5.0}),
            json!({"test": "throughput", "transport": "tcp", "size": 32, "p50_us": 99.0}),
        ];
        let (series, categories) = series_of(&rows, &FIGURE);
        assert!(categories.is_empty());
        assert_eq!(series.len(), 2);
        assert_eq!(series[0].0, "tcp");
        assert_eq!(series[0].1, vec![(32.0, 20.0), (1024.0, 30.0)]);
    }

    #[test]
    fn a_string_among_numbers_makes_every_x_a_category() {
        // fabric's windows: `none`, then byte counts (they once drew as
        // one bar, the numbers lost).
        let rows = vec![
            json!({"test": "latency", "transport": "rdma", "size": "none", "p50_us": 1.0}),
            json!({"test": "latency", "transport": "rdma", "size": 16384, "p50_us": 2.0}),
            json!({"test": "latency", "transport": "rdma", "size": 4096, "p50_us": 3.0}),
        ];
        let (series, categories) = series_of(&rows, &FIGURE);
        assert_eq!(categories, ["none", "16384", "4096"]);
        assert_eq!(series[0].1, vec![(0.0, 1.0), (1.0, 2.0), (2.0, 3.0)]);
    }

    #[test]
    fn a_png_is_drawn_with_labels_and_categories() {
        let dir = tempfile::tempdir().unwrap();
        let rows = vec![
            json!({"way": "floor", "call": "fetch", "p50_us": 40.0}),
            json!({"way": "grpc", "call": "fetch", "p50_us": 800.0}),
        ];
        let figure = Figure {
            filter: &[],
            x: "way",
            series: &["call"],
            ..FIGURE
        };
        assert!(draw(dir.path(), &rows, &figure).unwrap());
        if let Some(keep) = std::env::var_os("KEEP_PLOT") {
            std::fs::copy(dir.path().join("unit.png"), keep).unwrap();
        }
        let png = std::fs::read(dir.path().join("unit.png")).unwrap();
        assert_eq!(&png[1..4], b"PNG");
        assert!(!draw(dir.path(), &[], &figure).unwrap());
    }
}
