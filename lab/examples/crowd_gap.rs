//! Why `ml` meets fewer targets than the oracle on crowded CPU hosts (issue 49).
//!
//! For each scenario (default: `crowded-gold`, `crowded-e5`,
//! `lab/scenarios/crowded-gold-diurnal.toml`, `lab/scenarios/foreign/20c16w.toml`) this runs
//! the oracle, the oracle without shared way ranges (`OracleConfig::share_ways` off: each
//! service has a range of its own or the pool's), `ml`, and `ml` with exact readings
//! (`ml-exact`: no measurement noise and the model's calibrated spread off,
//! [`simulate::exact_readings`]), each with the scenario's seed, and prints:
//! - latency-critical services meeting their targets per interval (`met/n`), QoS (every
//!   target met), best effort against the full oracle, and the share of ticks at which
//!   `ml`'s needs did not fit the host (`degraded`: the degrade rule decided). If the
//!   oracle without sharing is as far ahead of `ml` as the full one, shared ranges are not
//!   what `ml` lacks; if `ml-exact` is no closer than `ml`, noise and caution are not either,
//!   and what is left is the model's mean and what the degrade rule does with it;
//! - per service: the share of intervals under target and the mean cores, ways and p99 over
//!   target (median) under each policy, so that a service `ml` starves or overfeeds shows;
//! - for each service `ml` leaves over its target in some interval: how its decisions split
//!   over the paths (model, fallback, ...) in those intervals, and the commonest reasons
//!   (their leading words, numbers dropped), which name the step that decided.
//!
//! `cargo run --release -p cohabit-lab --example crowd_gap [SCENARIO…]` (simulated; under a
//! minute for the four on a 2-CPU machine).

use std::collections::BTreeMap;
use std::sync::Arc;

use anyhow::{Context, Result};
use cohabit_core::{DecisionRecord, BEST_EFFORT_GROUP};
use cohabit_lab::metrics::be_vs_oracle;
use cohabit_lab::oracle::OracleConfig;
use cohabit_lab::simulate::{self, LabPolicy, SimRun};
use cohabit_sim::Scenario;

/// The scenarios run when none is named.
const DEFAULT: [&str; 4] = [
    "crowded-gold",
    "crowded-e5",
    "lab/scenarios/crowded-gold-diurnal.toml",
    "lab/scenarios/foreign/20c16w.toml",
];

/// Reasons shown per missing service.
const TOP_REASONS: usize = 4;

/// Mean latency-critical services under target per interval (on the truth).
fn met_per_interval(records: &[DecisionRecord]) -> f64 {
    let mut met = 0usize;
    for r in records {
        let Some(truth) = &r.truth else { continue };
        met += r
            .targets()
            .iter()
            .filter(|(s, t)| truth.p99_ms.get(*s).is_some_and(|p| p <= *t))
            .count();
    }
    met as f64 / records.len().max(1) as f64
}

/// `ml`'s phrase for a tick whose needs did not all fit (the degrade rule decided).
const DEGRADED: &str = "needs exceed the host";

/// Share of the ticks at which `ml`'s needs did not fit the host (its reasons say so);
/// `None` for a policy that gives no such reason.
fn degraded_share(records: &[DecisionRecord]) -> Option<f64> {
    if records
        .first()
        .is_some_and(|r| r.policy != LabPolicy::Ml.name())
    {
        return None;
    }
    let n = records
        .iter()
        .filter(|r| r.reasons.values().any(|x| x.text.contains(DEGRADED)))
        .count();
    Some(n as f64 / records.len().max(1) as f64)
}

/// One service's figures over a run.
#[derive(Default)]
struct ServiceStats {
    met: usize,
    n: usize,
    cores: f64,
    ways: f64,
    ratios: Vec<f64>,
}

impl ServiceStats {
    fn cell(&self) -> String {
        let n = self.n.max(1) as f64;
        let mut r = self.ratios.clone();
        r.sort_by(f64::total_cmp);
        // The pool has no target: no ratio, a dash.
        let med = r
            .get(r.len() / 2)
            .filter(|m| m.is_finite())
            .map_or_else(|| "-".to_string(), |m| format!("{m:.2}"));
        format!(
            "{:.2} {:>4.1}c {:>4.1}w x{:<5}",
            self.met as f64 / n,
            self.cores / n,
            self.ways / n,
            med
        )
    }
}

/// Per service (and the pool, as `best-effort`): intervals met, mean allocation in force
/// during the interval the truth describes, and p99 over target.
fn per_service(records: &[DecisionRecord]) -> BTreeMap<String, ServiceStats> {
    let mut out: BTreeMap<String, ServiceStats> = BTreeMap::new();
    for r in records {
        let Some(truth) = &r.truth else { continue };
        let targets = r.targets();
        for (name, a) in r.observation.current.groups() {
            let s = out.entry(name.to_string()).or_default();
            s.n += 1;
            s.cores += f64::from(a.cores);
            s.ways += f64::from(a.llc_ways.count);
            if let (Some(p), Some(t)) = (truth.p99_ms.get(name), targets.get(name)) {
                s.met += usize::from(p <= t);
                s.ratios.push(p / t);
            }
        }
    }
    out
}

/// A reason's text without its figures, so that the same rule reads the same.
fn shape(text: &str) -> String {
    let words: Vec<String> = text
        .split_whitespace()
        .take(9)
        .map(|w| {
            if w.chars().any(|c| c.is_ascii_digit()) {
                "#".to_string()
            } else {
                w.to_string()
            }
        })
        .collect();
    words.join(" ")
}

/// For each service `ml` leaves over its target: its decisions' paths and commonest reasons
/// at the ticks that ended an interval it missed (the plan then decided is the answer to
/// the miss).
fn misses(records: &[DecisionRecord]) {
    let mut paths: BTreeMap<String, BTreeMap<String, usize>> = BTreeMap::new();
    let mut reasons: BTreeMap<String, BTreeMap<String, usize>> = BTreeMap::new();
    for r in records {
        let Some(truth) = &r.truth else { continue };
        for (name, t) in r.targets() {
            if truth.p99_ms.get(&name).is_none_or(|p| *p <= t) {
                continue;
            }
            if let Some(reason) = r.reasons.get(&name) {
                *paths
                    .entry(name.clone())
                    .or_default()
                    .entry(reason.path.name().to_string())
                    .or_default() += 1;
                *reasons
                    .entry(name.clone())
                    .or_default()
                    .entry(shape(&reason.text))
                    .or_default() += 1;
            }
        }
    }
    for (name, p) in &paths {
        let total: usize = p.values().sum();
        let split: Vec<String> = p.iter().map(|(k, v)| format!("{k} {v}")).collect();
        println!(
            "  ml misses {name}: {total} intervals ({})",
            split.join(", ")
        );
        let mut top: Vec<(&String, &usize)> = reasons[name].iter().collect();
        top.sort_by(|a, b| b.1.cmp(a.1));
        for (text, n) in top.into_iter().take(TOP_REASONS) {
            println!("    {n:>4}  {text}");
        }
    }
}

fn run_scenario(name: &str) -> Result<()> {
    let sc = Arc::new(Scenario::load(name).with_context(|| format!("scenario {name}"))?);
    let full = simulate::run_oracle(&sc, OracleConfig::default(), "oracle")?;
    let disjoint = simulate::run_oracle(
        &sc,
        OracleConfig {
            share_ways: false,
            ..OracleConfig::default()
        },
        "oracle-disjoint",
    )?;
    let ml = simulate::run_policy(&sc, LabPolicy::Ml, None, None, |_| Ok(()))?;
    let (world, model) = simulate::exact_readings(&sc)?;
    let exact = simulate::run_policy(&world, LabPolicy::Ml, None, Some(&model), |_| Ok(()))?;
    let runs: [(&str, &SimRun); 4] = [
        ("oracle", &full),
        ("no-share", &disjoint),
        ("ml", &ml),
        ("ml-exact", &exact),
    ];
    println!(
        "\n{} ({} cores, {} ways), seed {}",
        sc.name,
        sc.capacity().cores,
        sc.capacity().llc_ways,
        sc.seed
    );
    println!(
        "{:<9} {:>6} {:>7} {:>6} {:>9}",
        "policy", "met/n", "qos", "be/or", "degraded"
    );
    for (label, run) in runs {
        println!(
            "{label:<9} {:>6.2} {:>7.4} {:>6} {:>9}",
            met_per_interval(&run.records),
            run.summary.qos_met_fraction,
            be_vs_oracle(run.summary.be_throughput, full.summary.be_throughput)
                .map_or_else(|| "-".to_string(), |v| format!("{v:.3}")),
            degraded_share(&run.records).map_or_else(|| "-".to_string(), |v| format!("{v:.2}"))
        );
    }
    let stats: Vec<BTreeMap<String, ServiceStats>> =
        runs.iter().map(|(_, r)| per_service(&r.records)).collect();
    println!(
        "{:<12} {:>24} {:>24} {:>24} {:>24}   (met, cores, ways, median p99/target)",
        "group", "oracle", "no-share", "ml", "ml-exact"
    );
    for name in stats[0].keys() {
        let cells: Vec<String> = stats
            .iter()
            .map(|s| {
                s.get(name)
                    .map_or_else(|| "-".to_string(), ServiceStats::cell)
            })
            .collect();
        let label = if name == BEST_EFFORT_GROUP {
            "pool"
        } else {
            name.as_str()
        };
        println!(
            "{label:<12} {:>24} {:>24} {:>24} {:>24}",
            cells[0], cells[1], cells[2], cells[3]
        );
    }
    misses(&ml.records);
    Ok(())
}

fn main() -> Result<()> {
    let asked: Vec<String> = std::env::args().skip(1).collect();
    let names: Vec<String> = if asked.is_empty() {
        DEFAULT.iter().map(|s| (*s).to_string()).collect()
    } else {
        asked
    };
    println!("SIMULATION: every figure below comes from cohabit's simulated host.");
    for name in &names {
        run_scenario(name)?;
    }
    Ok(())
}
