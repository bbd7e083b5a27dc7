//! Charts of bench reports (`--plot DIR`, `picchio bench plot REPORT.json --out DIR`), drawn with
//! `plotters` into SVG files: text is emitted as SVG `<text>`, so no font files or system libraries
//! are needed and the charts diff well in git.
//!
//! Each renderer reads the report's `results` as JSON, so a chart can be redrawn from a saved report
//! as well as straight after a run. Charts per experiment:
//! - `trace`: `trace-hit-rate.svg` (LRU and Belady hit rate vs cache capacity) and
//!   `trace-popularity.svg` (each layer's experts ranked by use: share of the layer's uses).
//! - `cache`: `cache-tok-s.svg` (decode tok/s vs cache budget, one line per read mode) and
//!   `cache-bytes.svg` (MB per decode token vs budget: store reads per mode, and device bytes).
//! - `layout`: `layout-N-pieces.svg` per split (experts read per second vs queue depth: one
//!   contiguous read per expert, solid, beside N scattered per-tensor reads of the same bytes,
//!   dashed, one colour per engine and thread count).
//! - `qd-sweep`: `qd-sweep-throughput.svg` (MB/s vs queue depth, one line per engine and thread
//!   count, fio's figures as dashed lines) and `qd-sweep-latency.svg` (latency percentiles at each
//!   engine's deepest queue: the CDF through min, p50, p90, p99, p99.9 and max).
//! - `decode`: `decode-tok-s.svg` (decode tok/s vs cache budget, with the I/O floor the same run
//!   measured, dashed) and `decode-split.svg` (ms per decode token vs cache budget: attention,
//!   router, expert compute, exposed I/O wait, lm_head, the rest, and the whole step).

use std::path::{Path, PathBuf};

use plotters::prelude::*;
use serde_json::Value;

use super::Report;
use crate::error::{Error, Result};

/// Experiments [`render`] draws charts for.
pub const PLOTTED: &[&str] = &["trace", "cache", "qd-sweep", "layout", "decode"];

/// Draws `report`'s charts into `dir` (created if missing; its parent must exist, see
/// [`super::output::create_plot_dir`]) and returns the files written.
///
/// # Errors
/// [`Error::NoCharts`] when the experiment has no charts; [`Error::ReportField`], [`Error::ReportShape`] or
/// [`Error::NoDataPoints`] when its results lack what a chart needs (naming it); [`Error::Io`] for the directory or a file.
pub fn render(report: &Report<Value>, dir: &Path) -> Result<Vec<PathBuf>> {
    if !PLOTTED.contains(&report.experiment.as_str()) {
        return Err(Error::NoCharts { experiment: report.experiment.clone() });
    }
    super::output::create_plot_dir(dir)?;
    let r = &report.results;
    let subtitle = subtitle(report);
    match report.experiment.as_str() {
        "trace" => trace_charts(r, dir, &subtitle),
        "cache" => cache_charts(r, dir, &subtitle),
        "layout" => layout_charts(r, dir, &subtitle),
        "decode" => decode_charts(r, dir, &subtitle),
        _ => qd_sweep_charts(r, dir, &subtitle),
    }
}

/// Where a chart came from, for its caption: experiment, date, and the store/model.
fn subtitle(report: &Report<Value>) -> String {
    let date = report.started_at.get(..10).unwrap_or(&report.started_at);
    format!("picchio bench {} · {date}", report.experiment)
}

/// How an axis maps values.
#[derive(Clone, Copy, PartialEq)]
enum Scale {
    Linear,
    /// Values are drawn at log2(v); tick labels show v.
    Log2,
    /// Values are drawn at log10(v); tick labels show v.
    Log10,
}

impl Scale {
    fn to_axis(self, v: f64) -> f64 {
        match self {
            Scale::Linear => v,
            Scale::Log2 => v.max(f64::MIN_POSITIVE).log2(),
            Scale::Log10 => v.max(f64::MIN_POSITIVE).log10(),
        }
    }

    /// Tick labels wanted for an axis spanning `span` axis units: log axes get ticks every 0.2 of
    /// a unit so that every whole power is among them (the others are left unlabelled).
    fn ticks(self, span: f64) -> usize {
        match self {
            Scale::Linear => 10,
            _ => ((span * 5.0).ceil() as usize).clamp(5, 80),
        }
    }

    fn label(self, a: f64) -> String {
        if self != Scale::Linear && (a - a.round()).abs() > 1e-6 {
            return String::new();
        }
        let a = if self == Scale::Linear { a } else { a.round() };
        let v = match self {
            Scale::Linear => a,
            Scale::Log2 => a.exp2(),
            Scale::Log10 => 10f64.powf(a),
        };
        if v != 0.0 && (v.abs() >= 1e5 || v.abs() < 1e-2) {
            format!("{v:.0e}")
        } else if (v - v.round()).abs() < 1e-9 {
            format!("{}", v.round())
        } else {
            format!("{v:.2}")
        }
    }
}

/// One line of a chart.
struct Series {
    name: String,
    points: Vec<(f64, f64)>,
    dashed: bool,
    /// Palette index; `None`: the series' own position.
    color: Option<usize>,
}

impl Series {
    fn new(name: impl Into<String>, points: Vec<(f64, f64)>, dashed: bool) -> Self {
        Series { name: name.into(), points, dashed, color: None }
    }

    /// The same colour as another series (fio beside ours, scattered beside contiguous).
    fn with_color(mut self, c: usize) -> Self {
        self.color = Some(c);
        self
    }
}

/// A line chart: axes, titles and its series (each also marked at its points).
struct LineChart<'a> {
    title: String,
    subtitle: &'a str,
    x_label: &'a str,
    y_label: &'a str,
    x_scale: Scale,
    y_scale: Scale,
    /// Fixed y range (before scaling), else from the data with 5% headroom and 0 at the bottom for
    /// a linear axis.
    y_range: Option<(f64, f64)>,
    /// Where the legend goes (a corner the data leaves free).
    legend: SeriesLabelPosition,
    /// A labelled vertical line at this x (before scaling).
    marker: Option<(f64, String)>,
    series: Vec<Series>,
}

impl<'a> LineChart<'a> {
    /// A chart of `series` over the x axis `(label, scale)`, on a linear y axis ranged from the
    /// data, with the legend at the upper left and no marker.
    fn new(
        title: impl Into<String>,
        subtitle: &'a str,
        (x_label, x_scale): (&'a str, Scale),
        y_label: &'a str,
        series: Vec<Series>,
    ) -> Self {
        let (y_scale, y_range, legend, marker) = (Scale::Linear, None, SeriesLabelPosition::UpperLeft, None);
        LineChart { title: title.into(), subtitle, x_label, y_label, x_scale, y_scale, y_range, legend, marker, series }
    }

    /// The legend in another corner.
    fn legend(mut self, legend: SeriesLabelPosition) -> Self {
        self.legend = legend;
        self
    }

    /// A fixed y range (before scaling).
    fn y_range(mut self, range: (f64, f64)) -> Self {
        self.y_range = Some(range);
        self
    }

    /// A labelled vertical line at an x (before scaling), if any.
    fn marker(mut self, marker: Option<(f64, String)>) -> Self {
        self.marker = marker;
        self
    }
}

/// The x axis of the cache-budget charts.
const CACHE_AXIS: (&str, Scale) = ("expert cache, % of all routed experts", Scale::Linear);

/// The x axis of the queue-depth charts.
const QD_AXIS: (&str, Scale) = ("queue depth (log scale)", Scale::Log2);

/// The model directory's name in a report (`model`), or empty.
fn model_name(r: &Value) -> String {
    let model = r.get("model").and_then(Value::as_str).unwrap_or("");
    Path::new(model).file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
}

const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
];

fn plot_err(path: &Path) -> impl Fn(String) -> Error + '_ {
    move |e| Error::io(path, "draw the chart")(std::io::Error::other(e))
}

impl LineChart<'_> {
    /// Palette index of series `i`.
    fn color_of(&self, i: usize) -> usize {
        self.series[i].color.unwrap_or(i)
    }

    fn draw(&self, path: &Path) -> Result<()> {
        let err = plot_err(path);
        let pts: Vec<(f64, f64)> = self
            .series
            .iter()
            .flat_map(|s| s.points.iter())
            .filter(|(x, y)| x.is_finite() && y.is_finite())
            .map(|&(x, y)| (self.x_scale.to_axis(x), self.y_scale.to_axis(y)))
            .collect();
        if pts.is_empty() {
            return Err(Error::NoDataPoints { path: path.into(), title: self.title.clone() });
        }
        let (mut x0, mut x1) = min_max(pts.iter().map(|p| p.0));
        if x1 - x0 < 1e-9 {
            (x0, x1) = (x0 - 0.5, x1 + 0.5);
        }
        let (y0, y1) = match self.y_range {
            Some((a, b)) => (self.y_scale.to_axis(a), self.y_scale.to_axis(b)),
            None => {
                let (lo, hi) = min_max(pts.iter().map(|p| p.1));
                let lo = if self.y_scale == Scale::Linear { lo.min(0.0) } else { lo.floor() };
                let hi = if self.y_scale == Scale::Linear { hi + 0.05 * (hi - lo).max(1e-9) } else { hi.ceil() };
                (lo, if hi > lo { hi } else { lo + 1.0 })
            }
        };
        let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
        let root = root.titled(&self.title, ("sans-serif", 22)).map_err(|e| err(e.to_string()))?;
        let (body, foot) = root.split_vertically(root.dim_in_pixel().1.saturating_sub(24));
        foot.draw_text(self.subtitle, &("sans-serif", 13).into_text_style(&foot).color(&BLACK.mix(0.6)), (10, 2))
            .map_err(|e| err(e.to_string()))?;
        let mut chart = ChartBuilder::on(&body)
            .margin(12)
            .x_label_area_size(44)
            .y_label_area_size(70)
            .build_cartesian_2d(x0..x1, y0..y1)
            .map_err(|e| err(e.to_string()))?;
        let (xs, ys) = (self.x_scale, self.y_scale);
        let x_fmt = move |v: &f64| xs.label(*v);
        let y_fmt = move |v: &f64| ys.label(*v);
        chart
            .configure_mesh()
            .x_desc(self.x_label)
            .y_desc(self.y_label)
            .x_labels(xs.ticks(x1 - x0))
            .y_labels(ys.ticks(y1 - y0).min(12))
            .x_label_formatter(&x_fmt)
            .y_label_formatter(&y_fmt)
            .light_line_style(BLACK.mix(0.06))
            .draw()
            .map_err(|e| err(e.to_string()))?;
        if let Some((x, label)) = &self.marker {
            let x = xs.to_axis(*x);
            if (x0..=x1).contains(&x) {
                let grey = BLACK.mix(0.45);
                chart
                    .draw_series(DashedLineSeries::new([(x, y0), (x, y1)], 4, 4, grey.stroke_width(1)))
                    .map_err(|e| err(e.to_string()))?;
                let style = ("sans-serif", 13).into_font().color(&grey);
                chart
                    .draw_series(std::iter::once(Text::new(format!(" {label}"), (x, y1 - 0.04 * (y1 - y0)), style)))
                    .map_err(|e| err(e.to_string()))?;
            }
        }
        for (i, s) in self.series.iter().enumerate() {
            let color = COLORS[self.color_of(i) % COLORS.len()];
            let line: Vec<(f64, f64)> = s
                .points
                .iter()
                .filter(|(x, y)| x.is_finite() && y.is_finite())
                .map(|&(x, y)| (xs.to_axis(x), ys.to_axis(y)))
                .collect();
            let style = color.stroke_width(2);
            let anno = if s.dashed {
                chart
                    .draw_series(DashedLineSeries::new(line.iter().copied(), 8, 5, style))
                    .map_err(|e| err(e.to_string()))?
            } else {
                chart.draw_series(LineSeries::new(line.iter().copied(), style)).map_err(|e| err(e.to_string()))?
            };
            // The legend sample is drawn in the series' style: two segments that meet for a solid
            // line, with a gap for a dashed one (fio, Belady), so the two can be told apart.
            let gap = if s.dashed { 5 } else { 0 };
            anno.label(s.name.clone()).legend(move |(x, y)| {
                EmptyElement::at((x, y))
                    + PathElement::new(vec![(0, 0), (9 - gap / 2 - gap % 2, 0)], style)
                    + PathElement::new(vec![(9 + gap / 2, 0), (18, 0)], style)
            });
            // Points are marked where there are few enough to tell apart.
            if line.len() <= 40 {
                chart
                    .draw_series(line.iter().map(|&p| Circle::new(p, 3, color.filled())))
                    .map_err(|e| err(e.to_string()))?;
            }
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.3))
            .position(self.legend.clone())
            .draw()
            .map_err(|e| err(e.to_string()))?;
        root.present().map_err(|e| err(e.to_string()))?;
        Ok(())
    }
}

fn min_max(v: impl Iterator<Item = f64>) -> (f64, f64) {
    v.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), x| (a.min(x), b.max(x)))
}

/// `v[key]` as f64, or an error naming the field.
fn num(v: &Value, key: &str) -> Result<f64> {
    v.get(key).and_then(Value::as_f64).ok_or_else(|| Error::ReportField {
        kind: "number",
        key: key.into(),
        found: short(v),
    })
}

fn arr<'a>(v: &'a Value, key: &str) -> Result<&'a Vec<Value>> {
    v.get(key).and_then(Value::as_array).ok_or_else(|| Error::ReportField {
        kind: "array",
        key: key.into(),
        found: short(v),
    })
}

fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.chars().count() > 120 {
        format!("{}…", s.chars().take(120).collect::<String>())
    } else {
        s
    }
}

fn trace_charts(r: &Value, dir: &Path, sub: &str) -> Result<Vec<PathBuf>> {
    let caps = arr(r, "capacities")?;
    let mut lru = Vec::new();
    let mut opt = Vec::new();
    for c in caps {
        let pct = num(c, "capacity_percent")?;
        lru.push((pct, 100.0 * num(c, "lru_hit_rate")?));
        opt.push((pct, 100.0 * num(c, "belady_hit_rate")?));
    }
    let header = r.get("header").unwrap_or(&Value::Null);
    let shape = format!(
        "{} MoE layers × {} experts, top-{}, {} tokens",
        header.get("moe_layers").and_then(Value::as_array).map_or(0, Vec::len),
        header.get("num_experts").and_then(Value::as_u64).unwrap_or(0),
        header.get("top_k").and_then(Value::as_u64).unwrap_or(0),
        r.get("tokens").and_then(Value::as_u64).unwrap_or(0)
    );
    let total = header.get("moe_layers").and_then(Value::as_array).map_or(0, Vec::len) as f64
        * header.get("num_experts").and_then(Value::as_f64).unwrap_or(0.0);
    let marker = r
        .get("working_set")
        .and_then(Value::as_f64)
        .filter(|_| total > 0.0)
        .map(|ws| (100.0 * ws / total, format!("one token's experts ({ws} = layers × k)")));
    let hit = dir.join("trace-hit-rate.svg");
    LineChart::new(
        format!("Expert-cache hit rate: LRU vs Belady (MIN) — {shape}"),
        sub,
        ("cache capacity, % of all routed experts (log scale)", Scale::Log2),
        "hit rate, %",
        vec![Series::new("LRU (the runtime's policy)", lru, false), Series::new("Belady (optimal)", opt, true)],
    )
    .legend(SeriesLabelPosition::LowerRight)
    .y_range((0.0, 100.0))
    .marker(marker)
    .draw(&hit)?;
    let mut series = Vec::new();
    for l in arr(r, "layers")? {
        let mut counts: Vec<f64> = arr(l, "counts")?.iter().map(|c| c.as_f64().unwrap_or(0.0)).collect::<Vec<_>>();
        let total: f64 = counts.iter().sum();
        counts.sort_by(|a, b| b.total_cmp(a));
        let pts = counts.iter().enumerate().map(|(i, &c)| ((i + 1) as f64, 100.0 * c / total.max(1.0))).collect();
        series.push(Series::new(format!("layer {}", num(l, "layer")?), pts, false));
    }
    // At most 8 layers drawn (first, last and evenly between) so the chart stays readable.
    if series.len() > 8 {
        let n = series.len();
        let keep: Vec<usize> = (0..8).map(|i| i * (n - 1) / 7).collect();
        series = series.into_iter().enumerate().filter(|(i, _)| keep.contains(i)).map(|(_, s)| s).collect();
    }
    let pop = dir.join("trace-popularity.svg");
    LineChart::new(
        "Expert popularity per layer (experts ranked by use)",
        sub,
        ("expert rank in its layer", Scale::Linear),
        "share of the layer's expert uses, %",
        series,
    )
    .legend(SeriesLabelPosition::UpperRight)
    .draw(&pop)?;
    Ok(vec![hit, pop])
}

fn cache_charts(r: &Value, dir: &Path, sub: &str) -> Result<Vec<PathBuf>> {
    let points = arr(r, "points")?;
    let mut modes: Vec<String> = Vec::new();
    for p in points {
        let m = p.get("mode").and_then(Value::as_str).unwrap_or("?").to_string();
        if !modes.contains(&m) {
            modes.push(m);
        }
    }
    let mut tok = Vec::new();
    let mut store: Vec<(String, Xy)> = Vec::new();
    let mut device = Vec::new();
    for m in &modes {
        let of_mode: Vec<&Value> = points.iter().filter(|p| p.get("mode").and_then(Value::as_str) == Some(m)).collect();
        let mut t = Vec::new();
        let mut b = Vec::new();
        let mut d = Vec::new();
        for p in &of_mode {
            let pct = num(p, "cache_percent")?;
            t.push((pct, num(p, "decode_tok_s")?));
            b.push((pct, num(p, "bytes_per_token")? / 1e6));
            if let Some(dev) = p.get("device_bytes_per_token").and_then(Value::as_f64) {
                d.push((pct, dev / 1e6));
            }
        }
        tok.push(Series::new(m.clone(), t, false));
        store.push((m.clone(), b));
        if !d.is_empty() {
            device.push(Series::new(format!("{m}: from the device (/proc/self/io)"), d, true));
        }
    }
    // The runtime's misses do not depend on the read mode: one line when the modes agree.
    let mut bytes = Vec::new();
    if store.windows(2).all(|w| w[0].1 == w[1].1) && !store.is_empty() {
        let points = store.swap_remove(0).1;
        bytes.push(Series::new("read by the store (misses x slot), every mode", points, false));
    } else {
        for (m, points) in store {
            bytes.push(Series::new(format!("{m}: read by the store"), points, false));
        }
    }
    bytes.extend(device);
    let name = model_name(r);
    let t = dir.join("cache-tok-s.svg");
    LineChart::new(
        format!("Decode throughput vs expert-cache budget ({name})"),
        sub,
        CACHE_AXIS,
        "decode tokens / s",
        tok,
    )
    .legend(SeriesLabelPosition::LowerRight)
    .draw(&t)?;
    let b = dir.join("cache-bytes.svg");
    LineChart::new(
        format!("Expert bytes per decode token vs cache budget ({name})"),
        sub,
        CACHE_AXIS,
        "MB per token",
        bytes,
    )
    .legend(SeriesLabelPosition::UpperRight)
    .draw(&b)?;
    Ok(vec![t, b])
}

/// Points of one line.
type Xy = Vec<(f64, f64)>;

/// The decode report's points: `results.points[]` with `cache_percent`, `decode_tok_s`,
/// `floor_tok_s` (null without reads) and `split.{attention_ms, router_ms, experts_ms,
/// dense_mlp_ms, io_wait_ms, lm_head_ms, other_ms, total_ms}`.
fn decode_charts(r: &Value, dir: &Path, sub: &str) -> Result<Vec<PathBuf>> {
    let points = arr(r, "points")?;
    let mut tok = Vec::new();
    let mut floor = Vec::new();
    let parts = [
        ("attention_ms", "attention"),
        ("router_ms", "router"),
        ("experts_ms", "expert compute"),
        ("dense_mlp_ms", "dense MLP"),
        ("io_wait_ms", "exposed I/O wait"),
        ("lm_head_ms", "lm_head"),
        ("other_ms", "other"),
        ("total_ms", "whole step"),
    ];
    let mut split: Vec<Xy> = vec![Vec::new(); parts.len()];
    for p in points {
        let pct = num(p, "cache_percent")?;
        tok.push((pct, num(p, "decode_tok_s")?));
        if let Some(f) = p.get("floor_tok_s").and_then(Value::as_f64) {
            floor.push((pct, f));
        }
        let sp = p.get("split").ok_or(Error::ReportShape { report: "decode", what: "a point has no `split`" })?;
        for (xy, (key, _)) in split.iter_mut().zip(parts) {
            xy.push((pct, num(sp, key)?));
        }
    }
    let name = model_name(r);
    let mut series = vec![Series::new("decode, measured", tok, false)];
    if !floor.is_empty() {
        series.push(Series::new("I/O floor (bytes per token at this run's device rate)", floor, true));
    }
    let t = dir.join("decode-tok-s.svg");
    LineChart::new(
        format!("Decode throughput and its I/O floor vs expert-cache budget ({name})"),
        sub,
        CACHE_AXIS,
        "decode tokens / s",
        series,
    )
    .draw(&t)?;
    let s = dir.join("decode-split.svg");
    LineChart::new(
        format!("Where a decode token's time goes ({name})"),
        sub,
        CACHE_AXIS,
        "ms per decode token",
        split.into_iter().zip(parts).map(|(xy, (_, label))| Series::new(label, xy, label == "whole step")).collect(),
    )
    .legend(SeriesLabelPosition::UpperRight)
    .draw(&s)?;
    Ok(vec![t, s])
}

/// The qd-sweep report's points: `results.points[]` with `engine`, `threads`, `qd`, `mb_s`, the
/// latency percentiles `latency_us.{p50,p90,p99,p99_9,max}`, and optionally `fio.mb_s`.
fn qd_sweep_charts(r: &Value, dir: &Path, sub: &str) -> Result<Vec<PathBuf>> {
    let points = arr(r, "points")?;
    // One line per (engine, threads).
    let mut lines: Vec<(String, Xy, Xy)> = Vec::new();
    let mut deepest: Vec<(String, f64, &Value)> = Vec::new();
    for p in points {
        let engine = p.get("engine").and_then(Value::as_str).unwrap_or("?");
        let threads = p.get("threads").and_then(Value::as_u64).unwrap_or(1);
        let name = if threads > 1 { format!("{engine} ×{threads} threads") } else { engine.to_string() };
        let qd = num(p, "qd")?;
        let mbs = num(p, "mb_s")?;
        let fio = p.get("fio").and_then(|f| f.get("mb_s")).and_then(Value::as_f64);
        match lines.iter_mut().find(|l| l.0 == name) {
            Some(l) => {
                l.1.push((qd, mbs));
                l.2.extend(fio.map(|f| (qd, f)));
            }
            None => lines.push((name.clone(), vec![(qd, mbs)], fio.map(|f| vec![(qd, f)]).unwrap_or_default())),
        }
        if let Some(lat) = p.get("latency_us") {
            match deepest.iter_mut().find(|d| d.0 == name) {
                Some(d) if d.1 < qd => *d = (name.clone(), qd, lat),
                Some(_) => {}
                None => deepest.push((name.clone(), qd, lat)),
            }
        }
    }
    let mut series = Vec::new();
    for (i, (name, ours, fio)) in lines.into_iter().enumerate() {
        series.push(Series::new(name.clone(), ours, false).with_color(i));
        if !fio.is_empty() {
            series.push(Series::new(format!("fio, as {name}"), fio, true).with_color(i));
        }
    }
    let thr = dir.join("qd-sweep-throughput.svg");
    LineChart::new("Random expert-sized reads: throughput vs queue depth", sub, QD_AXIS, "MB/s", series).draw(&thr)?;
    let mut out = vec![thr];
    let mut cdf = Vec::new();
    for (name, qd, lat) in deepest {
        let mut pts = Vec::new();
        for (key, frac) in [("min", 0.0), ("p50", 50.0), ("p90", 90.0), ("p99", 99.0), ("p99_9", 99.9), ("max", 100.0)]
        {
            if let Some(v) = lat.get(key).and_then(Value::as_f64) {
                pts.push((v, frac));
            }
        }
        if !pts.is_empty() {
            cdf.push(Series::new(format!("{name}, QD {qd}"), pts, false));
        }
    }
    if !cdf.is_empty() {
        let lat = dir.join("qd-sweep-latency.svg");
        LineChart::new(
            "Read latency distribution at each engine's deepest queue",
            sub,
            ("latency, µs (log scale)", Scale::Log10),
            "reads completed within, %",
            cdf,
        )
        .legend(SeriesLabelPosition::LowerRight)
        .y_range((0.0, 100.0))
        .draw(&lat)?;
        out.push(lat);
    }
    Ok(out)
}

/// The layout report's points: `results.points[]` with `engine`, `threads`, `qd`, `units_per_s`
/// (experts per second), `pieces` and `variant` (`contiguous` or `scattered`).
fn layout_charts(r: &Value, dir: &Path, sub: &str) -> Result<Vec<PathBuf>> {
    let points = arr(r, "points")?;
    let mut pieces: Vec<u64> = points.iter().filter_map(|p| p.get("pieces").and_then(Value::as_u64)).collect();
    pieces.sort_unstable();
    pieces.dedup();
    let mut out = Vec::new();
    for n in pieces {
        // (engine label, contiguous line, scattered line)
        let mut lines: Vec<(String, Xy, Xy)> = Vec::new();
        for p in points.iter().filter(|p| p.get("pieces").and_then(Value::as_u64) == Some(n)) {
            let engine = p.get("engine").and_then(Value::as_str).unwrap_or("?");
            let threads = p.get("threads").and_then(Value::as_u64).unwrap_or(1);
            let name = if threads > 1 { format!("{engine} ×{threads} threads") } else { engine.to_string() };
            let xy = (num(p, "qd")?, num(p, "units_per_s")?);
            let scattered = p.get("variant").and_then(Value::as_str) == Some("scattered");
            let line = match lines.iter_mut().position(|l| l.0 == name) {
                Some(i) => &mut lines[i],
                None => {
                    lines.push((name, Vec::new(), Vec::new()));
                    lines.last_mut().expect("just pushed")
                }
            };
            if scattered {
                line.2.push(xy);
            } else {
                line.1.push(xy);
            }
        }
        let mut series = Vec::new();
        for (i, (name, contiguous, scattered)) in lines.into_iter().enumerate() {
            series.push(Series::new(format!("{name}: 1 contiguous read"), contiguous, false).with_color(i));
            series.push(Series::new(format!("{name}: {n} scattered reads"), scattered, true).with_color(i));
        }
        let path = dir.join(format!("layout-{n}-pieces.svg"));
        LineChart::new(
            format!("Expert reads: one contiguous read vs {n} scattered per-tensor reads"),
            sub,
            QD_AXIS,
            "experts read / s",
            series,
        )
        .draw(&path)?;
        out.push(path);
    }
    if out.is_empty() {
        return Err(Error::ReportShape { report: "layout", what: "no points with `pieces` to draw" });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_labels_round_trip() {
        assert_eq!(Scale::Log2.label(Scale::Log2.to_axis(8.0)), "8");
        assert_eq!(Scale::Log10.label(Scale::Log10.to_axis(1000.0)), "1000");
        assert_eq!(Scale::Linear.label(0.25), "0.25");
    }

    #[test]
    fn a_chart_is_well_formed_svg() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.svg");
        LineChart::new(
            "t",
            "s",
            ("x", Scale::Log2),
            "y",
            vec![
                Series::new("a", vec![(1.0, 1.0), (2.0, 3.0), (4.0, 2.0)], false),
                Series::new("b", vec![(1.0, 2.0), (4.0, 2.5)], true),
            ],
        )
        .draw(&p)
        .unwrap();
        let svg = std::fs::read_to_string(&p).unwrap();
        let doc = roxmltree::Document::parse(&svg).unwrap();
        assert_eq!(doc.root_element().tag_name().name(), "svg");
        assert!(doc.descendants().filter(|n| n.tag_name().name() == "circle").count() >= 5);
        let empty = LineChart::new("e", "", ("", Scale::Linear), "", vec![]);
        assert!(empty.draw(&dir.path().join("e.svg")).is_err());
    }

    fn report(experiment: &str, results: impl serde::Serialize) -> Report<Value> {
        let run = crate::Run::start(experiment, &serde_json::json!({}), None).unwrap();
        run.finish(serde_json::to_value(results).unwrap())
    }

    fn svg_texts(path: &Path) -> Vec<String> {
        let svg = std::fs::read_to_string(path).unwrap();
        let doc = roxmltree::Document::parse(&svg).unwrap();
        doc.descendants()
            .filter(|n| n.tag_name().name() == "text")
            .filter_map(|n| n.text())
            .map(|t| t.trim().to_string())
            .collect()
    }

    /// Horizontal two-point `polyline`s of an SVG: (y, x0, x1) with x0 < x1.
    fn svg_segments(path: &Path) -> Vec<(i64, i64, i64)> {
        let svg = std::fs::read_to_string(path).unwrap();
        let doc = roxmltree::Document::parse(&svg).unwrap();
        doc.descendants()
            .filter(|n| n.tag_name().name() == "polyline")
            .filter_map(|n| {
                let pts: Vec<(i64, i64)> = n
                    .attribute("points")?
                    .split_whitespace()
                    .filter_map(|p| p.split_once(',').and_then(|(x, y)| Some((x.parse().ok()?, y.parse().ok()?))))
                    .collect();
                match pts[..] {
                    [(x0, y0), (x1, y1)] if y0 == y1 && x0 < x1 => Some((y0, x0, x1)),
                    _ => None,
                }
            })
            .collect()
    }

    #[test]
    fn legend_samples_are_drawn_in_the_series_style() {
        let results = serde_json::json!({"points": [
            {"engine": "uring", "threads": 1, "qd": 1, "mb_s": 900.0, "latency_us": {"p50": 1.0, "p99": 2.0},
             "fio": {"mb_s": 950.0}},
            {"engine": "uring", "threads": 1, "qd": 4, "mb_s": 1800.0, "latency_us": {"p50": 1.0, "p99": 2.0},
             "fio": {"mb_s": 1850.0}}
        ]});
        let dir = tempfile::tempdir().unwrap();
        let files = render(&report("qd-sweep", results), dir.path()).unwrap();
        let segs = svg_segments(&files[0]);
        // The legend sample of a series is two 18-px-wide pieces on one line: touching for a solid
        // series (ours), 5 px apart for a dashed one (fio).
        let pair = |gap: i64| {
            segs.iter().any(|&(y, a0, a1)| segs.iter().any(|&(y2, b0, b1)| y2 == y && b0 == a1 + gap && b1 - a0 == 18))
        };
        assert!(pair(0), "a solid legend sample: {segs:?}");
        assert!(pair(5), "a dashed legend sample: {segs:?}");
    }

    #[test]
    fn qd_sweep_and_layout_charts_read_their_result_types() {
        use crate::fio::FioResult;
        use crate::layout::{LayoutPoint, LayoutResults};
        use crate::measure::{LatencyUs, PointResult};
        use crate::qd_sweep::{QdPoint, QdSweepResults};
        let point = |engine: &str, threads, qd, mb_s| PointResult {
            engine: engine.into(),
            threads,
            qd,
            mb_s,
            units_per_s: mb_s / 2.654,
            latency_us: LatencyUs {
                min: 100.0,
                p50: 900.0,
                p90: 1500.0,
                p99: 3000.0,
                p99_9: 4000.0,
                max: 5000.0,
                ..Default::default()
            },
            ..Default::default()
        };
        let mut qd = QdSweepResults::default();
        for (q, mbs) in [(1, 900.0), (4, 1800.0), (32, 2100.0)] {
            let fio = FioResult { mb_s: mbs * 1.02, ..Default::default() };
            qd.points.push(QdPoint { ours: point("uring", 1, q, mbs), fio: Some(fio), ..Default::default() });
            qd.points.push(QdPoint { ours: point("psync-direct", 2, q, mbs * 0.9), ..Default::default() });
        }
        let dir = tempfile::tempdir().unwrap();
        let files = render(&report("qd-sweep", &qd), dir.path()).unwrap();
        let names: Vec<_> = files.iter().map(|f| f.file_name().unwrap().to_string_lossy().into_owned()).collect();
        assert_eq!(names, ["qd-sweep-throughput.svg", "qd-sweep-latency.svg"]);
        let legend = svg_texts(&files[0]);
        for want in ["uring", "fio, as uring", "psync-direct ×2 threads"] {
            assert!(legend.iter().any(|t| t == want), "{want} not in {legend:?}");
        }
        assert!(svg_texts(&files[1]).iter().any(|t| t == "uring, QD 32"));

        let mut layout = LayoutResults::default();
        for pieces in [3, 9] {
            for (variant, f) in [("contiguous", 1.0), ("scattered", 0.6)] {
                for q in [1, 8] {
                    let ours = point("uring", 1, q, 1000.0 * f);
                    layout.points.push(LayoutPoint { ours, pieces, variant: variant.into(), ..Default::default() });
                }
            }
        }
        let files = render(&report("layout", &layout), dir.path()).unwrap();
        assert_eq!(files.len(), 2);
        assert!(svg_texts(&files[1]).iter().any(|t| t == "uring: 9 scattered reads"));
        // A report of an experiment without charts, or missing fields, is refused by name.
        let e = render(&report("overhead", serde_json::json!({})), dir.path()).unwrap_err().to_string();
        assert!(e.contains("`overhead`"), "{e}");
        let e = render(&report("qd-sweep", serde_json::json!({"points": [{"qd": 1}]})), dir.path()).unwrap_err();
        assert!(e.to_string().contains("mb_s"), "{e}");
    }
}
