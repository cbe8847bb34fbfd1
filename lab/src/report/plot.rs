//! Decision plots with plotters, rendered without system font libraries: the DejaVu Sans
//! font is embedded and drawn through plotters' `ab_glyph` backend.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Once;

use anyhow::{anyhow, Result};
use cohabit_core::{DecisionPath, Resource, BEST_EFFORT_GROUP};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::FontStyle;

use crate::outdir::OutDir;
use crate::rundir::Run;

/// Image format of the plots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlotFormat {
    /// Raster.
    Png,
    /// Vector.
    Svg,
}

impl PlotFormat {
    fn ext(self) -> &'static str {
        match self {
            PlotFormat::Png => "png",
            PlotFormat::Svg => "svg",
        }
    }
}

const FONT: &str = "sans-serif";
const WIDTH: u32 = 1200;
const PALETTE: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

fn color(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

fn register_font() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // The only failure is a malformed font; DejaVu is not one.
        let _ = plotters::style::register_font(FONT, FontStyle::Normal, dejavu::sans::regular());
        let _ = plotters::style::register_font(FONT, FontStyle::Bold, dejavu::sans::bold());
    });
}

type DrawResult = std::result::Result<(), String>;

fn e<E: std::fmt::Display>(err: E) -> String {
    err.to_string()
}

macro_rules! render {
    ($path:expr, $fmt:expr, $size:expr, $draw:ident, $($arg:expr),*) => {{
        register_font();
        match $fmt {
            PlotFormat::Png => {
                let root = BitMapBackend::new($path, $size).into_drawing_area();
                root.fill(&WHITE).map_err(e).and_then(|()| $draw(&root, $($arg),*)).map_err(|m| anyhow!("{}: {m}", $path.display()))?;
                root.present().map_err(|m| anyhow!("{}: {m}", $path.display()))?;
            }
            PlotFormat::Svg => {
                let root = SVGBackend::new($path, $size).into_drawing_area();
                root.fill(&WHITE).map_err(e).and_then(|()| $draw(&root, $($arg),*)).map_err(|m| anyhow!("{}: {m}", $path.display()))?;
                root.present().map_err(|m| anyhow!("{}: {m}", $path.display()))?;
            }
        }
    }};
}

/// Draws a chart's legend in the house style.
fn legend<'a, DB, CT>(
    chart: &mut ChartContext<'a, DB, CT>,
    position: SeriesLabelPosition,
) -> DrawResult
where
    DB: DrawingBackend + 'a,
    CT: plotters::coord::CoordTranslate,
{
    chart
        .configure_series_labels()
        .position(position)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font((FONT, 13))
        .draw()
        .map_err(e)
}

/// Tick label of a value axis: at most three significant digits, without the float noise
/// of computed tick positions (`0.30000000000000004` prints as `0.3`).
fn tick_label(v: f64) -> String {
    if v == 0.0 || !v.is_finite() {
        return format!("{v}");
    }
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // 0..=9 after clamp
    let decimals = (2.0 - v.abs().log10().floor()).clamp(0.0, 9.0) as usize;
    let s = format!("{v:.decimals$}");
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

fn t_s(r: &cohabit_core::DecisionRecord) -> f64 {
    r.observation.t_ms as f64 / 1000.0
}

/// One service's p99 / target over time, as (seconds, ratio) points.
struct QosSeries {
    measured: Vec<(f64, f64)>,
    /// Where simulated.
    truth: Vec<(f64, f64)>,
    /// Where a model predicted.
    predicted: Vec<(f64, f64)>,
}

/// The p99 / target series of service `name` (p99 target `target` ms) in `run`.
fn qos_series(run: &Run, name: &str, target: f64) -> QosSeries {
    let measured: Vec<(f64, f64)> = run
        .records
        .iter()
        .filter_map(|r| {
            let s = r
                .observation
                .services
                .iter()
                .find(|s| s.spec.name == name)?;
            Some((t_s(r), s.sample.p99_ms? / target))
        })
        .collect();
    // Truth and predictions describe the interval after a decision; the truth in a record
    // is for the interval its observation covers.
    let truth: Vec<(f64, f64)> = run
        .records
        .iter()
        .filter_map(|r| Some((t_s(r), r.truth.as_ref()?.p99_ms.get(name)? / target)))
        .collect();
    let predicted: Vec<(f64, f64)> = run
        .records
        .iter()
        .filter_map(|r| Some((t_s(r), r.predictions.get(name)?.log_qos_ratio.exp())))
        .collect();
    QosSeries {
        measured,
        truth,
        predicted,
    }
}

/// Per latency-critical service: p99 / target over time (measured, true where simulated,
/// predicted where a model predicted), the target line, and violations shaded.
fn qos<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, run: &Run) -> DrawResult {
    let targets = run.targets();
    let panels = root.split_evenly((targets.len().max(1), 1));
    let t_max = run.records.last().map_or(1.0, t_s).max(1.0);
    for ((name, target), area) in targets.iter().zip(panels.iter()) {
        let QosSeries {
            measured,
            truth,
            predicted,
        } = qos_series(run, name, *target);
        let judged = if truth.is_empty() { &measured } else { &truth };
        let all = measured
            .iter()
            .chain(&truth)
            .chain(&predicted)
            .map(|p| p.1)
            .filter(|v| v.is_finite() && *v > 0.0);
        let (lo, hi) = all.fold((1.0f64, 1.0f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
        let (lo, hi) = ((lo * 0.8).max(1e-3), (hi * 1.25).max(1.5));
        let mut chart = ChartBuilder::on(area)
            .caption(
                format!("{name}: p99 / target (target {target} ms)"),
                (FONT, 20),
            )
            .margin(10)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(0.0..t_max, (lo..hi).log_scale())
            .map_err(e)?;
        chart
            .configure_mesh()
            .x_desc("time (s)")
            .y_desc("p99 / target (log)")
            .y_label_formatter(&|v| tick_label(*v))
            .label_style((FONT, 14))
            .axis_desc_style((FONT, 15))
            .draw()
            .map_err(e)?;
        let step = measured
            .windows(2)
            .map(|w| w[1].0 - w[0].0)
            .next()
            .unwrap_or(1.0);
        chart
            .draw_series(
                judged.iter().filter(|(_, v)| *v > 1.0).map(|&(t, _)| {
                    Rectangle::new([(t - step, lo), (t, hi)], RED.mix(0.15).filled())
                }),
            )
            .map_err(e)?
            .label(if truth.is_empty() {
                "violation (measured)"
            } else {
                "violation (true)"
            })
            .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 15, y + 5)], RED.mix(0.3).filled()));
        chart
            .draw_series(LineSeries::new(
                [(0.0, 1.0), (t_max, 1.0)],
                RED.stroke_width(2),
            ))
            .map_err(e)?
            .label("target")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED.stroke_width(2)));
        chart
            .draw_series(LineSeries::new(measured.iter().copied(), color(0)))
            .map_err(e)?
            .label("measured")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color(0)));
        if !truth.is_empty() {
            chart
                .draw_series(LineSeries::new(truth.iter().copied(), BLACK.mix(0.7)))
                .map_err(e)?
                .label("true (simulator)")
                .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK.mix(0.7)));
        }
        if !predicted.is_empty() {
            chart
                .draw_series(LineSeries::new(
                    predicted.iter().copied(),
                    color(1).stroke_width(2),
                ))
                .map_err(e)?
                .label("predicted (model)")
                .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color(1)));
        }
        legend(&mut chart, SeriesLabelPosition::UpperRight)?;
    }
    Ok(())
}

fn resources_in(run: &Run) -> Vec<Resource> {
    let mut out = vec![Resource::Cores, Resource::LlcWays];
    if run
        .records
        .iter()
        .any(|r| r.plan.groups().any(|(_, a)| a.mba_pct < 100))
    {
        out.push(Resource::Mba);
    }
    if run
        .records
        .iter()
        .any(|r| r.plan.groups().any(|(_, a)| a.gpu_mps_pct.is_some()))
    {
        out.push(Resource::GpuShare);
    }
    out
}

/// Legend label of the actuation markers of one decision path.
fn path_label(p: DecisionPath) -> &'static str {
    match p {
        DecisionPath::Model => "model",
        DecisionPath::Fallback => "fallback",
        DecisionPath::Feedback => "feedback step",
        DecisionPath::Oracle => "oracle",
        DecisionPath::Static => "fixed share",
        DecisionPath::Explore => "exploration",
        DecisionPath::Search => "search sample",
        DecisionPath::Hold => "held plan",
    }
}

fn axis_name(r: Resource) -> &'static str {
    match r {
        Resource::Cores => "cores",
        Resource::LlcWays => "LLC ways",
        Resource::Mba => "memory bandwidth (MBA %)",
        Resource::GpuShare => "GPU share (MPS %)",
    }
}

/// (seconds, value) points of a series.
type Points = Vec<(f64, f64)>;

/// Each group's allocation of `res` over time in `run`, as (seconds, amount) points.
fn group_series(run: &Run, groups: &[String], res: Resource) -> Vec<(String, Points)> {
    groups
        .iter()
        .map(|g| {
            let pts = run
                .records
                .iter()
                .filter_map(|r| Some((t_s(r), f64::from(r.plan.get(g)?.amount(res)))))
                .collect();
            (g.clone(), pts)
        })
        .collect()
}

/// The actuations of `res` in `run` as (seconds, amount) points: by the path that decided
/// them, and apart those that reached no process (unmanaged).
fn actuation_marks(run: &Run, res: Resource) -> (BTreeMap<DecisionPath, Points>, Points) {
    let mut marks: BTreeMap<DecisionPath, Points> = BTreeMap::new();
    let mut not_applied: Points = Vec::new();
    for r in &run.records {
        for c in r.changes.iter().filter(|c| c.resource == res) {
            let Some(a) = r.plan.get(&c.group) else {
                continue;
            };
            if r.unmanaged(&c.group, res).is_some() {
                not_applied.push((t_s(r), f64::from(a.amount(res))));
                continue;
            }
            // The pool changes because a service moved: take that service's reason.
            let path = r
                .reasons
                .get(&c.group)
                .or_else(|| r.changes.iter().find_map(|o| r.reasons.get(&o.group)))
                .map_or(DecisionPath::Static, |why| why.path);
            marks
                .entry(path)
                .or_default()
                .push((t_s(r), f64::from(a.amount(res))));
        }
    }
    (marks, not_applied)
}

/// Allocations over time, one panel per resource, a line per group, and a marker at every
/// actuation coloured by why it happened.
fn allocations<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, run: &Run) -> DrawResult {
    let resources = resources_in(run);
    let panels = root.split_evenly((resources.len(), 1));
    let t_max = run.records.last().map_or(1.0, t_s).max(1.0);
    let groups: Vec<String> = run
        .records
        .first()
        .map(|r| r.plan.groups().map(|(g, _)| g.to_string()).collect())
        .unwrap_or_default();
    for (res, area) in resources.iter().zip(panels.iter()) {
        let series = group_series(run, &groups, *res);
        let y_max = series
            .iter()
            .flat_map(|(_, p)| p.iter().map(|v| v.1))
            .fold(1.0f64, f64::max)
            * 1.15;
        let mut chart = ChartBuilder::on(area)
            .caption(format!("{} per group", axis_name(*res)), (FONT, 20))
            .margin(10)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(0.0..t_max, 0.0..y_max)
            .map_err(e)?;
        chart
            .configure_mesh()
            .x_desc("time (s)")
            .y_desc(axis_name(*res))
            .label_style((FONT, 14))
            .axis_desc_style((FONT, 15))
            .draw()
            .map_err(e)?;
        let unmanaged = unmanaged_groups(run, *res);
        for (i, (g, pts)) in series.iter().enumerate() {
            let c = if g == BEST_EFFORT_GROUP {
                RGBColor(120, 120, 120)
            } else {
                color(i)
            };
            // A group its allocation never reached is drawn thin and says so: its line is
            // the plan, not what its processes got.
            let (label, width) = if unmanaged.contains(g) {
                (format!("{g} (unmanaged: planned, not applied)"), 1)
            } else {
                (g.clone(), 2)
            };
            chart
                .draw_series(LineSeries::new(pts.iter().copied(), c.stroke_width(width)))
                .map_err(e)?
                .label(label)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2))
                });
        }
        let (marks, not_applied) = actuation_marks(run, *res);
        let shapes = [
            (DecisionPath::Model, color(2)),
            (DecisionPath::Fallback, color(3)),
            (DecisionPath::Feedback, color(4)),
            (DecisionPath::Oracle, color(5)),
            (DecisionPath::Static, color(7)),
            (DecisionPath::Explore, color(6)),
            // Two more of the same family, kept out of the palette the lines cycle through.
            (DecisionPath::Search, RGBColor(23, 190, 207)),
            (DecisionPath::Hold, RGBColor(188, 189, 34)),
        ];
        for (kind, c) in shapes {
            let Some(pts) = marks.get(&kind) else {
                continue;
            };
            chart
                .draw_series(pts.iter().map(|&p| TriangleMarker::new(p, 5, c.filled())))
                .map_err(e)?
                .label(format!("actuation: {}", path_label(kind)))
                .legend(move |(x, y)| TriangleMarker::new((x + 10, y), 5, c.filled()));
        }
        if !not_applied.is_empty() {
            let c = RGBColor(200, 0, 0);
            chart
                .draw_series(
                    not_applied
                        .iter()
                        .map(|&p| TriangleMarker::new(p, 5, c.stroke_width(1))),
                )
                .map_err(e)?
                .label("planned, not applied (unmanaged)")
                .legend(move |(x, y)| TriangleMarker::new((x + 10, y), 5, c.stroke_width(1)));
        }
        legend(&mut chart, SeriesLabelPosition::UpperRight)?;
    }
    Ok(())
}

/// The groups whose allocation of `res` reached none of their processes in some record of
/// `run` (a real host's log says so per group; simulated runs never do).
pub fn unmanaged_groups(run: &Run, res: Resource) -> BTreeSet<String> {
    run.records
        .iter()
        .flat_map(|r| {
            r.control
                .iter()
                .filter(move |(_, c)| {
                    c.resources
                        .get(&res)
                        .is_some_and(|c| c.unmanaged().is_some())
                })
                .map(|(g, _)| g.clone())
        })
        .collect()
}

/// Comparison: bars per policy for the headline metrics, one group of bars per scenario.
fn compare_metrics<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, runs: &[Run]) -> DrawResult {
    let scenarios: Vec<String> = dedup(runs.iter().map(|r| r.scenario.clone()));
    let policies: Vec<String> = dedup(runs.iter().map(|r| r.policy.clone()));
    type Getter = fn(&crate::metrics::RunSummary) -> f64;
    let metrics: [(&str, Getter); 4] = [
        ("QoS met (fraction of intervals)", |s| s.qos_met_fraction),
        ("best-effort throughput / oracle", |s| {
            s.be_throughput_vs_oracle.unwrap_or(0.0)
        }),
        ("actuations (count)", |s| s.actuations as f64),
        ("convergence after a load change (median intervals)", |s| {
            s.convergence_intervals_p50.unwrap_or(0.0)
        }),
    ];
    let panels = root.split_evenly((2, 2));
    let n_pol = policies.len().max(1) as f64;
    for ((title, get), area) in metrics.iter().zip(panels.iter()) {
        let value = |sc: &str, p: &str| {
            runs.iter()
                .find(|r| r.scenario == sc && r.policy == p)
                .and_then(|r| r.summary.as_ref())
                .map_or(0.0, get)
        };
        let y_max = scenarios
            .iter()
            .flat_map(|sc| policies.iter().map(move |p| (sc, p)))
            .map(|(sc, p)| value(sc, p))
            .fold(0.0f64, f64::max)
            .max(1e-9)
            * 1.45; // room for the legend above the bars
        let mut chart = ChartBuilder::on(area)
            .caption(*title, (FONT, 18))
            .margin(10)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(0.0..scenarios.len() as f64, 0.0..y_max)
            .map_err(e)?;
        let names = scenarios.clone();
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(scenarios.len() * 2 + 1)
            .x_label_formatter(&move |x| {
                let i = x.floor();
                if (x - i - 0.5).abs() < 0.01 {
                    usize::try_from(cohabit_sim::whole(i))
                        .ok()
                        .and_then(|i| names.get(i))
                        .cloned()
                        .unwrap_or_default()
                } else {
                    String::new()
                }
            })
            .x_desc("scenario")
            .label_style((FONT, 13))
            .axis_desc_style((FONT, 14))
            .draw()
            .map_err(e)?;
        for (pi, p) in policies.iter().enumerate() {
            let c = color(pi);
            let width = 0.8 / n_pol;
            chart
                .draw_series(scenarios.iter().enumerate().map(|(si, sc)| {
                    let x0 = si as f64 + 0.1 + pi as f64 * width;
                    Rectangle::new([(x0, 0.0), (x0 + width * 0.9, value(sc, p))], c.filled())
                }))
                .map_err(e)?
                .label(p.as_str())
                .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 15, y + 5)], c.filled()));
        }
        legend(&mut chart, SeriesLabelPosition::UpperRight)?;
    }
    Ok(())
}

/// Comparison: the distribution (CDF) of p99 / target per policy, over every latency-critical
/// service and interval (true values where simulated).
fn cdf<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, runs: &[Run]) -> DrawResult {
    let policies: Vec<String> = dedup(runs.iter().map(|r| r.policy.clone()));
    let mut curves = Vec::new();
    for p in &policies {
        let mut v: Vec<f64> = Vec::new();
        for run in runs.iter().filter(|r| &r.policy == p) {
            let t = run.targets();
            for r in &run.records {
                for (name, target) in &t {
                    if let Some(x) = r.judged_p99_ms(name) {
                        v.push((x / target).max(1e-3));
                    }
                }
            }
        }
        v.sort_by(f64::total_cmp);
        curves.push((p.clone(), v));
    }
    let (lo, hi) = curves
        .iter()
        .flat_map(|(_, v)| v.first().into_iter().chain(v.last()))
        .fold((1.0f64, 1.0f64), |(lo, hi), x| (lo.min(*x), hi.max(*x)));
    let mut chart = ChartBuilder::on(root)
        .caption("Distribution of p99 / target per policy", (FONT, 20))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d((lo * 0.8..hi * 1.25).log_scale(), 0.0..1.0)
        .map_err(e)?;
    chart
        .configure_mesh()
        .x_desc("p99 / target (log; right of 1 is a violation)")
        .x_label_formatter(&|v| tick_label(*v))
        .y_desc("fraction of service-intervals")
        .label_style((FONT, 14))
        .axis_desc_style((FONT, 15))
        .draw()
        .map_err(e)?;
    chart
        .draw_series(LineSeries::new(
            [(1.0, 0.0), (1.0, 1.0)],
            RED.stroke_width(2),
        ))
        .map_err(e)?
        .label("target")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED.stroke_width(2)));
    for (i, (p, v)) in curves.iter().enumerate() {
        let n = v.len().max(1) as f64;
        let c = color(i);
        chart
            .draw_series(LineSeries::new(
                v.iter().enumerate().map(|(k, x)| (*x, (k + 1) as f64 / n)),
                c.stroke_width(2),
            ))
            .map_err(e)?
            .label(p.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
    }
    legend(&mut chart, SeriesLabelPosition::LowerRight)?;
    Ok(())
}

fn dedup(it: impl Iterator<Item = String>) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for s in it {
        if !out.contains(&s) {
            out.push(s);
        }
    }
    out
}

/// Draws the plots of one run into `out` (made through no other user's symbolic link; plotters then
/// creates the images by path); returns the files written.
pub fn plot_run(run: &Run, out: &Path, fmt: PlotFormat) -> Result<Vec<PathBuf>> {
    OutDir::create(out)?;
    let n = run.targets().len().max(1);
    let qos_path = out.join(format!("qos.{}", fmt.ext()));
    let qos_size = (WIDTH, 300 * u32::try_from(n).unwrap_or(1).min(12));
    render!(&qos_path, fmt, qos_size, qos, run);
    let alloc_path = out.join(format!("allocations.{}", fmt.ext()));
    let rows = u32::try_from(resources_in(run).len()).unwrap_or(2);
    render!(&alloc_path, fmt, (WIDTH, 280 * rows), allocations, run);
    Ok(vec![qos_path, alloc_path])
}

/// Draws the plots of a comparison into `out` (as [`plot_run`]); returns the files written.
pub fn plot_comparison(runs: &[Run], out: &Path, fmt: PlotFormat) -> Result<Vec<PathBuf>> {
    OutDir::create(out)?;
    let m = out.join(format!("compare_metrics.{}", fmt.ext()));
    render!(&m, fmt, (WIDTH, 800), compare_metrics, runs);
    let c = out.join(format!("cdf.{}", fmt.ext()));
    render!(&c, fmt, (WIDTH, 600), cdf, runs);
    Ok(vec![m, c])
}

#[cfg(test)]
mod tests {
    use cohabit_core::{
        Allocation, DecisionRecord, Observation, Plan, Sample, ServiceClass, ServiceObservation,
        ServiceSpec, WayRange, DECISION_SCHEMA_VERSION,
    };

    use super::*;

    /// A run of one service whose p99 / target stays between 0.1 and 0.9: one decade.
    fn one_decade_run() -> Run {
        let a = Allocation {
            cores: 2,
            llc_ways: WayRange::new(0, 2),
            mba_pct: 100,
            gpu_mps_pct: None,
        };
        let plan = Plan {
            services: [("kv".to_string(), a)].into(),
            best_effort: a,
            gpu_memory_mib: Default::default(),
        };
        let records = (0..40u32)
            .map(|k| DecisionRecord {
                schema_version: DECISION_SCHEMA_VERSION,
                policy: "static".into(),
                simulated: false,
                observation: Observation {
                    t_ms: u64::from(k) * 1000,
                    services: vec![ServiceObservation {
                        spec: ServiceSpec {
                            name: "kv".into(),
                            class: ServiceClass::LatencyCritical { p99_target_ms: 1.0 },
                            gpu: None,
                            priority: 0,
                        },
                        sample: Sample {
                            p99_ms: Some(0.1 + 0.8 * f64::from(k % 10) / 9.0),
                            ..Sample::default()
                        },
                        gpu_mps_effective_pct: None,
                    }],
                    current: plan.clone(),
                },
                plan: plan.clone(),
                changes: vec![],
                reasons: Default::default(),
                apply: None,
                decision_us: 1.0,
                predictions: Default::default(),
                truth: None,
                from_pods: Default::default(),
                control: Default::default(),
            })
            .collect();
        Run {
            scenario: "t".into(),
            policy: "static".into(),
            records,
            summary: None,
        }
    }

    /// Every `<text>` element's content in an SVG document.
    fn texts(svg: &str) -> Vec<String> {
        svg.split("<text")
            .skip(1)
            .filter_map(|t| {
                let body = &t[t.find('>')? + 1..];
                Some(body[..body.find("</text>")?].trim().to_string())
            })
            .collect()
    }

    #[test]
    fn tick_labels_have_at_most_three_significant_digits() {
        assert_eq!(tick_label(0.300_000_000_000_000_04), "0.3");
        assert_eq!(tick_label(1.5), "1.5");
        assert_eq!(tick_label(20.0), "20");
        assert_eq!(tick_label(0.001), "0.001");
        assert_eq!(tick_label(0.123_456), "0.123");
        assert_eq!(tick_label(0.0), "0");
    }

    #[test]
    fn a_one_decade_qos_panel_prints_short_tick_labels() {
        register_font();
        let mut svg = String::new();
        {
            let root = SVGBackend::with_string(&mut svg, (WIDTH, 300)).into_drawing_area();
            root.fill(&WHITE).unwrap();
            qos(&root, &one_decade_run()).unwrap();
            root.present().unwrap();
        }
        let labels = texts(&svg);
        let numbers: Vec<&String> = labels.iter().filter(|t| t.parse::<f64>().is_ok()).collect();
        assert!(numbers.len() >= 4, "no tick labels found in {labels:?}");
        for n in numbers {
            assert!(n.len() <= 5, "long tick label {n:?} in {labels:?}");
        }
        assert!(labels.iter().any(|t| t == "0.3"), "{labels:?}");
    }
}
