//! `cohabit bench`: the whole comparison behind README's results, in one command.
//!
//! Every built-in scenario, the crowded (overload) ones included, runs `static`, `parties`,
//! `ml` and `oracle` on its own platform (same seed for all four); then every scenario that
//! runs on the second platform (those without GPU services, and not already on it) runs
//! again there, `ml` using that platform's built-in model. The output is, per platform, the table of every scenario
//! × policy (with the MBA in use), per-service QoS beside the all-services figure, the
//! oracle's search time, and the check of `ml`'s targets against `parties` and the oracle,
//! side by side from the same runs. The crowded scenarios are not checked against the 99 %
//! QoS target (not every target can be met there); their per-service rows show the overload
//! order at work.

use std::io::Write;
use std::sync::Arc;

use anyhow::{Context, Result};
use cohabit_sim::scenario::{builtin_names, crowded_names};
use cohabit_sim::Scenario;
use serde::Serialize;

use crate::metrics::{search_time_table, service_table, table, RunSummary};
use crate::simulate::{self, LabPolicy};
use crate::{Format, BANNER};

/// The runs of one platform.
#[derive(Debug, Clone, Serialize)]
pub struct PlatformRuns {
    /// Platform preset.
    pub platform: String,
    /// Every scenario × policy.
    pub runs: Vec<RunSummary>,
    /// Scenarios that cannot run on this platform, and why.
    pub skipped: Vec<String>,
}

/// One of `ml`'s targets on one scenario.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    /// Platform preset.
    pub platform: String,
    /// Scenario.
    pub scenario: String,
    /// What is checked.
    pub target: &'static str,
    /// `ml`'s figure.
    pub ml: f64,
    /// The figure it is held against (the bound, or `parties`' figure).
    pub against: f64,
    /// Met or not.
    pub met: bool,
}

/// Runs the benchmark: each scenario on its own platform, then on `second`.
pub fn run(second: &str, seed: Option<u64>) -> Result<Vec<PlatformRuns>> {
    let scenarios: Vec<Scenario> = builtin_names()
        .chain(crowded_names())
        .map(Scenario::load)
        .collect::<Result<_, _>>()?;
    let mut own: Vec<PlatformRuns> = Vec::new();
    let mut other = PlatformRuns {
        platform: second.to_string(),
        runs: vec![],
        skipped: vec![],
    };
    for sc in &scenarios {
        let preset = sc.host.preset.to_string();
        let sc = Arc::new(sc.clone());
        let runs = summaries(simulate::compare(&sc, &LabPolicy::ALL, seed, None))
            .with_context(|| format!("comparing policies on {}", sc.name))?;
        match own.iter_mut().find(|p| p.platform == preset) {
            Some(p) => p.runs.extend(runs),
            None => own.push(PlatformRuns {
                platform: preset,
                runs,
                skipped: vec![],
            }),
        }
    }
    for sc in scenarios.iter().filter(|sc| sc.host.preset != second) {
        match sc.on_platform(second) {
            Ok(moved) => {
                let moved = Arc::new(moved);
                let runs = summaries(simulate::compare(&moved, &LabPolicy::ALL, seed, None))
                    .with_context(|| format!("comparing policies on {} on {second}", sc.name))?;
                other.runs.extend(runs);
            }
            Err(e) => other.skipped.push(e.to_string()),
        }
    }
    // Scenarios whose own platform is the second one ran there already: one table.
    match own.iter_mut().find(|p| p.platform == other.platform) {
        Some(p) => {
            p.runs.extend(other.runs);
            p.skipped.extend(other.skipped);
        }
        None => own.push(other),
    }
    Ok(own)
}

fn summaries(
    runs: Result<Vec<simulate::SimRun>, simulate::RunError>,
) -> Result<Vec<RunSummary>, simulate::RunError> {
    Ok(runs?.into_iter().map(|r| r.summary).collect())
}

/// `ml`'s targets, per platform and scenario: QoS in at least 99 % of intervals and no
/// worse than `parties`; median convergence of at most 3 intervals; best-effort throughput
/// at least 0.9 of the oracle's; fewer actuations than `parties`.
pub fn checks(platforms: &[PlatformRuns]) -> Vec<Check> {
    let mut out = Vec::new();
    for p in platforms {
        let mut names: Vec<&str> = p.runs.iter().map(|r| r.scenario.as_str()).collect();
        names.dedup();
        for name in names
            .into_iter()
            .filter(|n| !crowded_names().any(|c| c == *n))
        {
            let get = |policy: &str| {
                p.runs
                    .iter()
                    .find(|r| r.scenario == name && r.policy == policy)
            };
            let (Some(ml), Some(parties)) = (get("ml"), get("parties")) else {
                continue;
            };
            let mut check = |target, ml: f64, against: f64, met: bool| {
                out.push(Check {
                    platform: p.platform.clone(),
                    scenario: name.to_string(),
                    target,
                    ml,
                    against,
                    met,
                });
            };
            check(
                "qos_met >= 0.99",
                ml.qos_met_fraction,
                0.99,
                ml.qos_met_fraction >= 0.99,
            );
            check(
                "qos_met >= parties",
                ml.qos_met_fraction,
                parties.qos_met_fraction,
                ml.qos_met_fraction >= parties.qos_met_fraction,
            );
            if let Some(c) = ml.convergence_intervals_p50 {
                check(
                    "convergence p50 <= 3 (against: parties)",
                    c,
                    parties.convergence_intervals_p50.unwrap_or(f64::NAN),
                    c <= 3.0,
                );
            }
            if let Some(b) = ml.be_throughput_vs_oracle {
                check("be_vs_oracle >= 0.9", b, 0.9, b >= 0.9);
            }
            #[allow(clippy::cast_precision_loss)] // counts far below 2^52
            check(
                "actuations < parties",
                ml.actuations as f64,
                parties.actuations as f64,
                ml.actuations < parties.actuations,
            );
        }
    }
    out
}

/// `cohabit bench`.
pub fn bench_cmd(
    second: &str,
    seed: Option<u64>,
    format: Format,
    out: &mut dyn Write,
) -> Result<()> {
    let platforms = run(second, seed)?;
    let checks = checks(&platforms);
    if format == Format::Json {
        let v = serde_json::json!({ "simulated": true, "platforms": platforms, "checks": checks });
        writeln!(out, "{}", serde_json::to_string_pretty(&v)?)?;
        return Ok(());
    }
    writeln!(out, "{BANNER}")?;
    for p in &platforms {
        writeln!(out, "\nplatform {}", p.platform)?;
        write!(out, "{}", table(&p.runs, true))?;
        for s in &p.skipped {
            writeln!(out, "skipped: {s}")?;
        }
        writeln!(
            out,
            "\nper-service QoS on {} (share of intervals under target; met/n: mean services \
             meeting theirs per interval):",
            p.platform
        )?;
        write!(out, "{}", service_table(&p.runs, true))?;
        writeln!(out, "\noracle search time on {}:", p.platform)?;
        write!(out, "{}", search_time_table(&p.runs))?;
    }
    writeln!(out, "\nml targets (same runs):")?;
    writeln!(
        out,
        "{:<20} {:<14} {:<40} {:>9} {:>9}  met",
        "platform", "scenario", "target", "ml", "against"
    )?;
    for c in &checks {
        writeln!(
            out,
            "{:<20} {:<14} {:<40} {:>9.3} {:>9.3}  {}",
            c.platform,
            c.scenario,
            c.target,
            c.ml,
            c.against,
            if c.met { "yes" } else { "NO" }
        )?;
    }
    let met = checks.iter().filter(|c| c.met).count();
    writeln!(out, "{met} of {} checks met", checks.len())?;
    Ok(())
}
