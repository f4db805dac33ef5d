//! Sweep and collective-benchmark plots, each written as SVG and PNG with `plotters`.
//!
//! Text is laid out with a TrueType font read at run time (`MESHTRAIN_FONT`, else DejaVu Sans or
//! Liberation Sans at their usual Linux paths; Debian: `fonts-dejavu-core`), so that neither the
//! build nor the plots depend on fontconfig. Rank and size axes are log2: x is `log2(value)` and the
//! tick labels show the value.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;

use super::{Mode, PointSummary};
use crate::error::{Error, Result};

/// Pixel size of every chart.
const SIZE: (u32, u32) = (900, 540);

/// Where a sans-serif TrueType font is looked for when `MESHTRAIN_FONT` is not set.
const FONT_PATHS: [&str; 5] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation-sans/LiberationSans-Regular.ttf",
];

/// Registers the font as plotters' `sans-serif` once per process; the error says what to install.
fn ensure_font() -> Result<()> {
    static FONT: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    FONT.get_or_init(|| {
        let candidates: Vec<PathBuf> = match crate::env::font() {
            Some(p) => vec![p],
            None => FONT_PATHS.iter().map(PathBuf::from).collect(),
        };
        let path = candidates.iter().find(|p| p.is_file()).ok_or_else(|| {
            format!("no TrueType font for the plots: install fonts-dejavu-core or set MESHTRAIN_FONT (looked at {candidates:?})")
        })?;
        let bytes = std::fs::read(path).map_err(|e| format!("read {}: {e}", path.display()))?;
        // plotters keeps fonts for the whole process; one font, registered once.
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
            .map_err(|_| format!("{} is not a TrueType font", path.display()))
    })
    .clone()
    .map_err(|msg| Error::file("MESHTRAIN_FONT", None, msg))
}

/// One line of a line chart.
#[derive(Debug, Clone)]
pub struct Series {
    /// Legend text.
    pub label: String,
    /// (x, y) points; x already log2 when the axis is.
    pub points: Vec<(f64, f64)>,
    /// Palette index (a measured series and its ideal line share it).
    pub color: usize,
    /// Dashed, no markers (an ideal line).
    pub ideal: bool,
}

/// How tick labels of an axis read.
#[derive(Debug, Clone, Copy)]
pub enum Ticks {
    /// x = log2(count): labels `1, 2, 4, ...`.
    Log2Count,
    /// x = log2(bytes): labels `4K, 1M, ...`.
    Log2Bytes,
    /// Plain numbers.
    Plain,
}

impl Ticks {
    fn label(self, v: f64) -> String {
        let integral = (v - v.round()).abs() < 1e-9;
        match self {
            Ticks::Log2Count if integral => format!("{}", 2f64.powi(v.round() as i32)),
            Ticks::Log2Bytes if integral => bytes_label(2f64.powi(v.round() as i32) as u64),
            Ticks::Log2Count | Ticks::Log2Bytes => String::new(),
            Ticks::Plain => number_label(v),
        }
    }
}

/// `4K`, `64M`, `1G`, `512`.
pub fn bytes_label(b: u64) -> String {
    match b {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{}G", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{}M", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{}K", b >> 10),
        b => b.to_string(),
    }
}

fn number_label(v: f64) -> String {
    match v.abs() {
        0.0 => "0".into(),
        a if a >= 10.0 => format!("{v:.0}"),
        a if a >= 1.0 => format!("{v:.2}"),
        _ => format!("{v:.3}"),
    }
}

/// A chart of lines over a shared x axis; y starts at 0.
#[derive(Debug, Clone)]
pub struct LineChart {
    /// Caption.
    pub title: String,
    /// x axis description.
    pub x_desc: String,
    /// y axis description.
    pub y_desc: String,
    /// x tick labels.
    pub x_ticks: Ticks,
    /// The lines.
    pub series: Vec<Series>,
}

/// Stacked bars, one bar per category, one layer per component.
#[derive(Debug, Clone)]
pub struct StackedBars {
    /// Caption.
    pub title: String,
    /// y axis description.
    pub y_desc: String,
    /// Bar names, left to right.
    pub categories: Vec<String>,
    /// (legend, value per category), bottom layer first.
    pub layers: Vec<(String, Vec<f64>)>,
}

type Plane<'a, DB> = ChartContext<'a, DB, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// A white chart with its caption over the given ranges.
fn frame<'a, DB: DrawingBackend>(
    root: &'a DrawingArea<DB, Shift>,
    title: &str,
    x: std::ops::Range<f64>,
    y: std::ops::Range<f64>,
) -> std::result::Result<Plane<'a, DB>, String> {
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    ChartBuilder::on(root)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(72)
        .build_cartesian_2d(x, y)
        .map_err(|e| e.to_string())
}

/// The legend of the labelled series, boxed, at `at`.
fn legend<'a, DB: DrawingBackend + 'a>(chart: &mut Plane<'a, DB>, at: SeriesLabelPosition) -> std::result::Result<(), String> {
    chart
        .configure_series_labels()
        .position(at)
        .label_font(("sans-serif", 15))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| e.to_string())
}

/// Something drawn to a plotters drawing area.
trait Chart {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> std::result::Result<(), String>;
}

fn range_with_margin(lo: f64, hi: f64) -> std::ops::Range<f64> {
    if hi - lo < 1e-9 {
        lo - 0.5..hi + 0.5
    } else {
        let pad = 0.06 * (hi - lo);
        lo - pad..hi + pad
    }
}

impl Chart for LineChart {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> std::result::Result<(), String> {
        let e = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
        let xs = self.series.iter().flat_map(|s| s.points.iter().map(|p| p.0));
        let (x0, x1) = xs.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), x| (a.min(x), b.max(x)));
        let y1 = self.series.iter().flat_map(|s| s.points.iter().map(|p| p.1)).fold(0.0, f64::max);
        if !x0.is_finite() {
            return Err("a chart without points".into());
        }
        let mut chart = frame(root, &self.title, range_with_margin(x0, x1), 0.0..(y1 * 1.15).max(1e-12))?;
        let ticks = self.x_ticks;
        let x_labels = match ticks {
            Ticks::Plain => 10,
            // One label per power of two, at most 12 (then plotters picks every other one).
            _ => ((x1 - x0).round() as usize + 1).min(12),
        };
        chart
            .configure_mesh()
            .x_desc(self.x_desc.as_str())
            .y_desc(self.y_desc.as_str())
            .x_labels(x_labels)
            .x_label_formatter(&|v| ticks.label(*v))
            .y_label_formatter(&|v| number_label(*v))
            .label_style(("sans-serif", 15))
            .draw()
            .map_err(e)?;
        for s in &self.series {
            let color = Palette99::pick(s.color).to_rgba();
            let style = color.stroke_width(2);
            let pts = s.points.clone();
            let drawn = if s.ideal {
                chart.draw_series(DashedLineSeries::new(pts, 8, 6, style)).map_err(e)?
            } else {
                chart
                    .draw_series(PointSeries::of_element(pts.clone(), 5, color.filled(), &|c, r, st| Circle::new(c, r, st)))
                    .map_err(e)?;
                chart.draw_series(LineSeries::new(pts, style)).map_err(e)?
            };
            drawn.label(s.label.as_str()).legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], style));
        }
        legend(&mut chart, SeriesLabelPosition::LowerRight)
    }
}

impl Chart for StackedBars {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> std::result::Result<(), String> {
        let e = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
        let n = self.categories.len();
        if n == 0 || self.layers.iter().any(|(_, v)| v.len() != n) {
            return Err("stacked bars need one value per category in every layer".into());
        }
        let top = (0..n).map(|i| self.layers.iter().map(|(_, v)| v[i]).sum::<f64>()).fold(0.0, f64::max);
        let mut chart = frame(root, &self.title, -0.5..n as f64 - 0.5, 0.0..(top * 1.3).max(1e-12))?;
        let names = &self.categories;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .y_desc(self.y_desc.as_str())
            .x_labels(n)
            .x_label_formatter(&|v| {
                let i = v.round();
                if (v - i).abs() < 1e-9 && i >= 0.0 { names.get(i as usize).cloned().unwrap_or_default() } else { String::new() }
            })
            .y_label_formatter(&|v| number_label(*v))
            .label_style(("sans-serif", 15))
            .draw()
            .map_err(e)?;
        let mut base = vec![0.0; n];
        for (layer, (name, values)) in self.layers.iter().enumerate() {
            let color = Palette99::pick(layer).to_rgba();
            let bars: Vec<Rectangle<(f64, f64)>> = (0..n)
                .map(|i| {
                    let (x, y0) = (i as f64, base[i]);
                    Rectangle::new([(x - 0.35, y0), (x + 0.35, y0 + values[i])], color.filled())
                })
                .collect();
            for (b, v) in base.iter_mut().zip(values) {
                *b += v;
            }
            chart
                .draw_series(bars)
                .map_err(e)?
                .label(name.as_str())
                .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 16, y + 6)], color.filled()));
        }
        legend(&mut chart, SeriesLabelPosition::UpperRight)
    }
}

/// Draws `chart` to `stem.svg` and `stem.png`.
fn render(chart: &impl Chart, stem: &Path) -> Result<Vec<PathBuf>> {
    ensure_font()?;
    let (svg, png) = (stem.with_extension("svg"), stem.with_extension("png"));
    let fail = |path: &Path, msg: String| Error::file(path, None, format!("plot: {msg}"));
    {
        let root = SVGBackend::new(&svg, SIZE).into_drawing_area();
        chart.draw(&root).map_err(|m| fail(&svg, m))?;
        root.present().map_err(|m| fail(&svg, m.to_string()))?;
    }
    {
        let root = BitMapBackend::new(&png, SIZE).into_drawing_area();
        chart.draw(&root).map_err(|m| fail(&png, m))?;
        root.present().map_err(|m| fail(&png, m.to_string()))?;
    }
    Ok(vec![svg, png])
}

fn mode_color(m: Mode) -> usize {
    match m {
        Mode::Strong => 0,
        Mode::Weak => 1,
    }
}

/// Per mode: the measured series of `value` over log2(ranks), and its ideal line at `ideal(base)`.
fn per_mode_series(points: &[PointSummary], value: impl Fn(&PointSummary) -> f64, ideal: impl Fn(&PointSummary) -> f64) -> Vec<Series> {
    let mut out = Vec::new();
    for mode in [Mode::Strong, Mode::Weak] {
        let pts: Vec<&PointSummary> = points.iter().filter(|p| p.meta.mode == mode).collect();
        let (Some(first), Some(last)) = (pts.first(), pts.last()) else { continue };
        let x = |p: &PointSummary| (p.meta.ranks as f64).log2();
        out.push(Series {
            label: format!("{} scaling", mode.name()),
            points: pts.iter().map(|p| (x(p), value(p))).collect(),
            color: mode_color(mode),
            ideal: false,
        });
        out.push(Series {
            label: format!("{} ideal", mode.name()),
            points: vec![(x(first), ideal(first)), (x(last), ideal(first))],
            color: mode_color(mode),
            ideal: true,
        });
    }
    out
}

/// The sweep's charts under `dir`: tokens/s per rank and efficiency over ranks (log2, with ideal
/// lines), and the step-time split per point. Returns the files written.
pub fn sweep_plots(points: &[PointSummary], dir: &Path) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(format!("create {}", dir.display()), e))?;
    let mut files = Vec::new();
    let per_rank = LineChart {
        title: "Throughput per rank".into(),
        x_desc: "ranks".into(),
        y_desc: "tokens/s per rank".into(),
        x_ticks: Ticks::Log2Count,
        series: per_mode_series(points, |p| p.tokens_per_s_per_rank, |b| b.tokens_per_s_per_rank),
    };
    files.extend(render(&per_rank, &dir.join("throughput_per_rank"))?);
    let efficiency = LineChart {
        title: "Scaling efficiency".into(),
        x_desc: "ranks".into(),
        y_desc: "efficiency %".into(),
        x_ticks: Ticks::Log2Count,
        series: per_mode_series(points, |p| 100.0 * p.efficiency, |_| 100.0),
    };
    files.extend(render(&efficiency, &dir.join("efficiency"))?);
    let ms = |f: fn(&PointSummary) -> f64| points.iter().map(|p| 1e3 * f(p)).collect::<Vec<f64>>();
    let split = StackedBars {
        title: "Step time split (mean per step)".into(),
        y_desc: "ms per step".into(),
        categories: points.iter().map(|p| format!("{} {}", p.meta.mode.name(), p.meta.ranks)).collect(),
        layers: vec![
            ("compute".into(), ms(|p| p.compute_s)),
            ("exposed communication".into(), ms(|p| p.comm_exposed_s)),
            ("pipeline bubble".into(), ms(|p| p.bubble_s)),
        ],
    };
    files.extend(render(&split, &dir.join("step_split"))?);
    Ok(files)
}

/// `value` over log2(ranks) of the `points` of `mode`, labelled `label` (dashed when `ideal`).
fn mode_series(points: &[PointSummary], mode: Mode, label: String, ideal: bool, value: impl Fn(&PointSummary) -> f64) -> Option<Series> {
    let pts: Vec<(f64, f64)> =
        points.iter().filter(|p| p.meta.mode == mode).map(|p| ((p.meta.ranks as f64).log2(), value(p))).collect();
    (!pts.is_empty()).then_some(Series { label, points: pts, color: mode_color(mode) + if ideal { 0 } else { 2 }, ideal })
}

/// A prediction (`meshtrain plan --scaling`) and a measured sweep on one chart each for scaling
/// efficiency and tokens/s per rank, per mode present in `predicted`: the measured series solid
/// with markers, the predicted one dashed. Both sets carry the sweep's own efficiency
/// definitions (each against its own first point). Writes `dir/predicted_vs_measured_*`.
pub fn overlay_plots(predicted: &[PointSummary], measured: &[PointSummary], dir: &Path) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(format!("create {}", dir.display()), e))?;
    type Metric = fn(&PointSummary) -> f64;
    let charts: [(&str, &str, &str, Metric); 2] = [
        ("efficiency", "Scaling efficiency: predicted vs measured", "efficiency %", |p| 100.0 * p.efficiency),
        ("throughput_per_rank", "Throughput per rank: predicted vs measured", "tokens/s per rank", |p| p.tokens_per_s_per_rank),
    ];
    let mut files = Vec::new();
    for (stem, title, y_desc, value) in charts {
        let mut series = Vec::new();
        for mode in [Mode::Strong, Mode::Weak] {
            if let Some(pred) = mode_series(predicted, mode, format!("{} predicted", mode.name()), true, value) {
                series.push(pred);
                series.extend(mode_series(measured, mode, format!("{} measured", mode.name()), false, value));
            }
        }
        let chart = LineChart { title: title.into(), x_desc: "ranks".into(), y_desc: y_desc.into(), x_ticks: Ticks::Log2Count, series };
        files.extend(render(&chart, &dir.join(format!("predicted_vs_measured_{stem}")))?);
    }
    Ok(files)
}

/// One row of a `meshtrain bench --csv` file: (collective, bytes, bus bandwidth GB/s).
fn bench_rows(path: &Path) -> Result<Vec<(String, u64, f64)>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(format!("read {}", path.display()), e))?;
    let mut lines = text.lines().filter(|l| !l.trim().is_empty());
    let header: Vec<&str> = lines.next().unwrap_or("").split(',').collect();
    let col = |name: &str| {
        header.iter().position(|h| *h == name).ok_or_else(|| {
            Error::file(path, None, format!("not `meshtrain bench --csv` output: no `{name}` column in the header"))
        })
    };
    let (c, b, bw) = (col("coll")?, col("bytes")?, col("busbw_gbs")?);
    lines
        .enumerate()
        .map(|(i, l)| {
            let cells: Vec<&str> = l.split(',').collect();
            let bad = |what: &str| Error::file(path, None, format!("line {}: {what}", i + 2));
            let cell = |k: usize| cells.get(k).copied().ok_or_else(|| bad("too few cells"));
            Ok((
                cell(c)?.to_string(),
                cell(b)?.parse().map_err(|_| bad("`bytes` is not an integer"))?,
                cell(bw)?.parse().map_err(|_| bad("`busbw_gbs` is not a number"))?,
            ))
        })
        .collect()
}

/// Bus bandwidth over message size (log2) for every collective found in `inputs`, one line per
/// `(label, csv)` input (e.g. one per node count): `dir/busbw_<collective>.{svg,png}`.
pub fn bench_plots(inputs: &[(String, PathBuf)], dir: &Path) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(format!("create {}", dir.display()), e))?;
    let mut tables = Vec::with_capacity(inputs.len());
    for (label, path) in inputs {
        tables.push((label, bench_rows(path)?));
    }
    let mut colls: Vec<&str> = tables.iter().flat_map(|(_, rows)| rows.iter().map(|r| r.0.as_str())).collect();
    colls.sort();
    colls.dedup();
    let mut files = Vec::new();
    for coll in colls {
        let series = tables
            .iter()
            .enumerate()
            .map(|(i, (label, rows))| Series {
                label: label.to_string(),
                points: rows.iter().filter(|r| r.0 == coll && r.1 > 0).map(|r| ((r.1 as f64).log2(), r.2)).collect(),
                color: i,
                ideal: false,
            })
            .filter(|s| !s.points.is_empty())
            .collect();
        let chart = LineChart {
            title: format!("{coll}: bus bandwidth"),
            x_desc: "message size (bytes)".into(),
            y_desc: "bus bandwidth GB/s".into(),
            x_ticks: Ticks::Log2Bytes,
            series,
        };
        files.extend(render(&chart, &dir.join(format!("busbw_{coll}")))?);
    }
    Ok(files)
}
