//! `cohabit report`: one self-contained HTML page (plots inline as PNG data, the summary and
//! the decision table), readable offline.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use base64::Engine;

use super::plot::{self, PlotFormat};
use crate::metrics::RunSummary;
use crate::outdir::OutDir;
use crate::rundir::{self as data, Run, RunDir};

/// Most decision rows the table shows (the log has them all).
pub const MAX_ROWS: usize = 2000;

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn img(path: &Path, alt: &str) -> Result<String> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let b64 = base64::engine::general_purpose::STANDARD.encode(bytes);
    Ok(format!("<figure><img class=\"plot\" alt=\"{}\" src=\"data:image/png;base64,{b64}\"><figcaption>{}</figcaption></figure>\n", esc(alt), esc(alt)))
}

fn summary_table(rows: &[&RunSummary]) -> String {
    let mut s = String::from("<table class=\"summary\"><thead><tr><th>scenario</th><th>policy</th><th>QoS met</th><th>violation severity (mean / max p99/target)</th><th>convergence p50 / max (intervals)</th><th>BE throughput</th><th>BE vs oracle</th><th>actuations</th><th>decision p50 / p99 (µs)</th></tr></thead><tbody>\n");
    for r in rows {
        let opt = |v: Option<f64>| v.map_or_else(|| "–".to_string(), |x| format!("{x:.3}"));
        let _ = writeln!(
            s,
            "<tr><td>{}</td><td>{}</td><td>{:.4}</td><td>{:.3} / {:.2}</td><td>{} / {}</td><td>{:.3}</td><td>{}</td><td>{}</td><td>{:.1} / {:.1}</td></tr>",
            esc(&r.scenario),
            esc(&r.policy),
            r.qos_met_fraction,
            r.violation_severity_mean,
            r.violation_severity_max,
            r.convergence_intervals_p50.map_or_else(|| "–".into(), |v| format!("{v:.1}")),
            r.convergence_intervals_max.map_or_else(|| "–".into(), |v| v.to_string()),
            r.be_throughput,
            opt(r.be_throughput_vs_oracle),
            r.actuations,
            r.decision_us_p50,
            r.decision_us_p99
        );
    }
    s.push_str("</tbody></table>\n");
    s
}

fn decision_table(run: &Run) -> String {
    let targets = run.targets();
    let interesting: Vec<&cohabit_core::DecisionRecord> = run
        .records
        .iter()
        .filter(|r| {
            !r.changes.is_empty()
                || r.apply.is_some()
                || targets
                    .iter()
                    .any(|(n, t)| r.judged_p99_ms(n).is_some_and(|p| p > *t))
        })
        .collect();
    let mut s = format!(
        "<p>{} of {} decisions changed something or saw a violation; {} shown.</p>\n<table class=\"decisions\"><thead><tr><th>t (s)</th>",
        interesting.len(),
        run.records.len(),
        interesting.len().min(MAX_ROWS)
    );
    for n in targets.keys() {
        let _ = write!(s, "<th>{} p99/target</th>", esc(n));
    }
    s.push_str("<th>changes</th><th>why</th><th>decision (µs)</th></tr></thead><tbody>\n");
    for r in interesting.iter().take(MAX_ROWS) {
        let _ = write!(s, "<tr><td>{:.1}</td>", r.observation.t_ms as f64 / 1000.0);
        for (n, t) in &targets {
            match r.judged_p99_ms(n) {
                Some(p) if p > *t => {
                    let _ = write!(s, "<td class=\"bad\">{:.2}</td>", p / t);
                }
                Some(p) => {
                    let _ = write!(s, "<td>{:.2}</td>", p / t);
                }
                None => s.push_str("<td>–</td>"),
            }
        }
        let changes: Vec<String> = r.changes.iter().map(|c| change_text(r, c)).collect();
        let mut why = why_changed(&r.changes, &r.reasons);
        match &r.apply {
            Some(cohabit_core::ApplyOutcome::Refused { error }) => {
                why.push(format!("not applied: {error}"));
            }
            Some(cohabit_core::ApplyOutcome::DryRun) => why.push("dry run".into()),
            None => {}
        }
        let _ = writeln!(
            s,
            "<td>{}</td><td>{}</td><td>{:.1}</td></tr>",
            esc(&changes.join("; ")),
            esc(&why.join("; ")),
            r.decision_us
        );
    }
    s.push_str("</tbody></table>\n");
    s
}

/// A change as the table shows it: on a group its allocation did not reach (the log's
/// `control` says unmanaged), marked as planned only, never as if it happened.
fn change_text(r: &cohabit_core::DecisionRecord, c: &cohabit_core::Change) -> String {
    match r.unmanaged(&c.group, c.resource) {
        Some(why) => format!(
            "{} {}: {} → {} planned, NOT APPLIED (unmanaged: {why})",
            c.group, c.resource, c.from, c.to
        ),
        None => format!("{} {}: {} → {}", c.group, c.resource, c.from, c.to),
    }
}

/// A paragraph naming the groups some resource of which reached none of their processes.
fn unmanaged_note(run: &Run) -> String {
    let mut lines = Vec::new();
    for res in cohabit_core::Resource::ALL {
        for g in plot::unmanaged_groups(run, res) {
            lines.push(format!("{g} {res}"));
        }
    }
    if lines.is_empty() {
        return String::new();
    }
    format!(
        "<p class=\"banner\">Unmanaged on this host (planned, never applied to their processes; see each change's reason): {}.</p>\n",
        esc(&lines.join(", "))
    )
}

/// The reasons of the groups that changed, `group: path: text`, in group order with
/// repeats dropped: a group that kept its allocation has nothing to explain in this row,
/// whatever its policy called its decision (a hold, a fallback that kept the plan).
fn why_changed(
    changes: &[cohabit_core::Change],
    reasons: &std::collections::BTreeMap<String, cohabit_core::Reason>,
) -> Vec<String> {
    let mut why: Vec<String> = reasons
        .iter()
        .filter(|(group, _)| changes.iter().any(|c| &c.group == *group))
        .map(|(k, v)| format!("{k}: {v}"))
        .collect();
    why.dedup();
    why
}

const STYLE: &str = "body{font-family:sans-serif;margin:2em;max-width:1300px;color:#222}\
h1{font-size:1.6em}.banner{background:#fff3cd;border:1px solid #e0c060;padding:.6em 1em;font-weight:bold}\
table{border-collapse:collapse;margin:1em 0;font-size:.9em}th,td{border:1px solid #ccc;padding:.25em .5em;text-align:right}\
th{background:#f0f0f0}td:nth-last-child(2),td:nth-last-child(3){text-align:left}.bad{background:#f8d0d0}\
figure{margin:1em 0}img.plot{max-width:100%;border:1px solid #ddd}figcaption{color:#555;font-size:.9em}";

/// A script that records, once the page has loaded, how many plots decoded and how many
/// table rows exist (`data-plots`, `data-rows` on `<body>`), so a headless browser test can
/// tell the page rendered.
const CHECK: &str = "<script>window.addEventListener('load',function(){var n=0;\
document.querySelectorAll('img.plot').forEach(function(i){if(i.complete&&i.naturalWidth>0)n++;});\
document.body.dataset.plots=n;document.body.dataset.rows=document.querySelectorAll('tbody tr').length;});</script>";

/// Writes `report.html` (and its plots under `plots/`) for the run or comparison in `dir`
/// into `out` (default: `dir`). Returns the page's path.
pub fn write_report(dir: &Path, out: Option<&Path>) -> Result<PathBuf> {
    let out = out.unwrap_or(dir);
    let out_dir = OutDir::create(out)?;
    let plots_dir = out.join("plots");
    let loaded = data::load(dir)?;
    let mut body = String::new();
    let (title, simulated) = match &loaded {
        RunDir::Single(run) => {
            let simulated = run.records.iter().any(|r| r.simulated);
            let files = plot::plot_run(run, &plots_dir, PlotFormat::Png)?;
            body.push_str("<h2>Summary</h2>\n");
            match &run.summary {
                Some(s) => body.push_str(&summary_table(&[s])),
                None => body.push_str(
                    "<p>No summary.json: a daemon log; figures below come from the log alone.</p>",
                ),
            }
            body.push_str(&unmanaged_note(run));
            body.push_str("<h2>Latency against target</h2>\n");
            body.push_str(&img(&files[0], "p99 / target per latency-critical service over time; shaded: intervals over target")?);
            body.push_str("<h2>Allocations</h2>\n");
            body.push_str(&img(
                &files[1],
                "allocation of each group over time; triangles mark actuations, coloured by reason",
            )?);
            body.push_str("<h2>Decisions</h2>\n");
            body.push_str(&decision_table(run));
            (
                format!("cohabit run: {} with {}", run.scenario, run.policy),
                simulated,
            )
        }
        RunDir::Comparison(runs) => {
            let simulated = runs
                .iter()
                .all(|r| r.summary.as_ref().is_none_or(|s| s.simulated));
            let files = plot::plot_comparison(runs, &plots_dir, PlotFormat::Png)?;
            body.push_str("<h2>Summary</h2>\n");
            let rows: Vec<&RunSummary> = runs.iter().filter_map(|r| r.summary.as_ref()).collect();
            body.push_str(&summary_table(&rows));
            body.push_str("<h2>Metrics side by side</h2>\n");
            body.push_str(&img(&files[0], "headline metrics per policy and scenario")?);
            body.push_str("<h2>Distribution of p99 / target</h2>\n");
            body.push_str(&img(
                &files[1],
                "CDF of p99 / target per policy over every service and interval",
            )?);
            (
                format!(
                    "cohabit comparison: {}",
                    dedup_join(runs.iter().map(|r| r.scenario.as_str()))
                ),
                simulated,
            )
        }
    };
    let banner = if simulated {
        "<p class=\"banner\">SIMULATION: every figure on this page comes from cohabit's simulated host, not from hardware.</p>"
    } else {
        "<p class=\"banner\">Recorded on a real host.</p>"
    };
    let page = format!(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{t}</title><style>{STYLE}</style></head>\n<body><h1>{t}</h1>\n{banner}\n{body}{CHECK}</body></html>\n",
        t = esc(&title)
    );
    Ok(out_dir.write("report.html", page.as_bytes())?)
}

fn dedup_join<'a>(it: impl Iterator<Item = &'a str>) -> String {
    let mut v: Vec<&str> = Vec::new();
    for s in it {
        if !v.contains(&s) {
            v.push(s);
        }
    }
    v.join(", ")
}

#[cfg(test)]
mod tests {
    use cohabit_core::{Change, DecisionPath, Reason, Resource};

    use super::*;

    /// A real host's record: memcached's cores go 1 → 2 and the pool's 1 → 0, but memcached
    /// is a bare process its allocation never reached.
    fn run_with_unmanaged() -> Run {
        let line = r#"{"schema_version":2,"policy":"parties","simulated":false,
            "observation":{"t_ms":1000,"services":[],"current":{"services":{"memcached":
            {"cores":1,"llc_ways":{"first":0,"count":1},"mba_pct":100}},"best_effort":
            {"cores":1,"llc_ways":{"first":1,"count":1},"mba_pct":100}}},
            "plan":{"services":{"memcached":{"cores":2,"llc_ways":{"first":0,"count":1},"mba_pct":100}},
            "best_effort":{"cores":0,"llc_ways":{"first":1,"count":1},"mba_pct":100}},
            "changes":[{"group":"memcached","resource":"cores","from":"1","to":"2"},
                       {"group":"best-effort","resource":"cores","from":"1","to":"0"}],
            "decision_us":1.0,
            "control":{"memcached":{"pids":[42],"resources":{"cores":
                {"control":"unmanaged","why":"it is in the hierarchy's root"}}},
                "best-effort":{"pids":[43],"resources":{"cores":{"control":"in_place"}}}}}"#;
        Run {
            scenario: "host".into(),
            policy: "parties".into(),
            records: vec![serde_json::from_str(line).unwrap()],
            summary: None,
        }
    }

    #[test]
    fn a_change_to_an_unmanaged_group_is_shown_as_planned_not_applied() {
        let run = run_with_unmanaged();
        let table = decision_table(&run);
        assert!(
            table.contains("memcached cores: 1 → 2 planned, NOT APPLIED (unmanaged: it is in the hierarchy's root)"),
            "{table}"
        );
        assert!(
            table.contains("best-effort cores: 1 → 0;")
                || table.contains("best-effort cores: 1 → 0<"),
            "{table}"
        );
        assert!(
            !table.contains("best-effort cores: 1 → 0 planned"),
            "{table}"
        );
        let note = unmanaged_note(&run);
        assert!(
            note.contains("memcached cores") && !note.contains("best-effort"),
            "{note}"
        );
        assert_eq!(
            plot::unmanaged_groups(&run, cohabit_core::Resource::Cores),
            ["memcached".to_string()].into()
        );
    }

    #[test]
    fn a_log_without_control_shows_changes_as_before_and_no_note() {
        let mut run = run_with_unmanaged();
        run.records[0].control.clear();
        assert!(decision_table(&run).contains("memcached cores: 1 → 2;"));
        assert_eq!(unmanaged_note(&run), "");
    }

    #[test]
    fn a_row_explains_the_groups_that_changed_and_not_those_that_held() {
        let reasons = [
            (
                "kv",
                Reason::new(DecisionPath::Feedback, "grow (p99 over target)"),
            ),
            (
                "web",
                Reason::new(DecisionPath::Fallback, "model unsure; hold"),
            ),
            (
                "db",
                Reason::new(DecisionPath::Hold, "hold the best of 9 samples"),
            ),
        ]
        .map(|(g, r)| (g.to_string(), r))
        .into();
        let change = Change {
            group: "kv".into(),
            resource: Resource::Cores,
            from: "2".into(),
            to: "3".into(),
        };
        assert_eq!(
            why_changed(&[change], &reasons),
            [format!("kv: {}", reasons["kv"])]
        );
        assert!(why_changed(&[], &reasons).is_empty());
    }
}
