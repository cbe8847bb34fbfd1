//! The metrics every comparison prints (docs/DESIGN.md 6), computed from decision records.
//!
//! All latency metrics use the simulator's ground truth (`DecisionRecord::truth`), not the
//! noisy measurements the policies saw, so a policy is judged by what really happened.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use cohabit_core::DecisionRecord;
use serde::{Deserialize, Serialize};

/// Relative change in a service's load between two intervals that counts as a load change.
pub const LOAD_CHANGE: f64 = 0.10;

/// Intervals QoS must hold after a load change to count as converged.
pub const SETTLE_INTERVALS: usize = 5;

/// Per-service figures of a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServiceSummary {
    /// Fraction of intervals this service met its target.
    pub qos_met_fraction: f64,
    /// Median of p99 / target.
    pub p99_over_target_p50: f64,
    /// Worst p99 / target.
    pub p99_over_target_max: f64,
}

/// The figures of one run of one policy on one scenario.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunSummary {
    /// Always true for runs the simulator produced; the numbers are not from real hardware.
    pub simulated: bool,
    /// Scenario name.
    pub scenario: String,
    /// Policy name.
    pub policy: String,
    /// Seed of the measurement noise.
    pub seed: u64,
    /// Control intervals.
    pub intervals: usize,
    /// Fraction of intervals in which every latency-critical service met its target.
    pub qos_met_fraction: f64,
    /// Mean of `p99/target - 1` over the (service, interval) pairs that missed.
    pub violation_severity_mean: f64,
    /// Worst `p99/target` seen.
    pub violation_severity_max: f64,
    /// Load changes (a service's load moving more than 10 % between intervals).
    pub load_changes: usize,
    /// Median intervals after a load change until QoS is met and holds for 5 intervals.
    pub convergence_intervals_p50: Option<f64>,
    /// Worst such convergence.
    pub convergence_intervals_max: Option<usize>,
    /// Mean best-effort throughput (sum of each job's progress relative to running alone).
    pub be_throughput: f64,
    /// `be_throughput` over the oracle's on the same scenario and seed.
    pub be_throughput_vs_oracle: Option<f64>,
    /// Resource changes applied (one per resource per group).
    pub actuations: usize,
    /// Median wall-clock time of one policy decision.
    pub decision_us_p50: f64,
    /// 99th percentile of it.
    pub decision_us_p99: f64,
    /// Slowest decision (for the oracle: its longest search).
    #[serde(default)]
    pub decision_us_max: f64,
    /// Wall-clock time of every decision of the run together (for the oracle: its search
    /// time over the run).
    #[serde(default)]
    pub decision_ms_total: f64,
    /// Mean MBA percentage of the best-effort pool over the run (100: never throttled).
    #[serde(default = "full_mba")]
    pub be_mba_pct_mean: f64,
    /// Fraction of intervals in which some group (the pool or a service) had MBA under 100 %.
    #[serde(default)]
    pub mba_throttled_fraction: f64,
    /// Per latency-critical service.
    pub services: BTreeMap<String, ServiceSummary>,
}

fn full_mba() -> f64 {
    100.0
}

/// Summarises the records of one run.
pub fn summarize(
    scenario: &str,
    policy: &str,
    seed: u64,
    targets: &BTreeMap<String, f64>,
    records: &[DecisionRecord],
) -> RunSummary {
    let n = records.len();
    let mut met_all = vec![true; n];
    let mut severity = Vec::new();
    let mut worst: f64 = 0.0;
    let mut ratios: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let mut be = 0.0;
    for (k, r) in records.iter().enumerate() {
        let Some(truth) = &r.truth else {
            met_all[k] = false;
            continue;
        };
        be += truth.be_throughput;
        for (name, target) in targets {
            let ratio = truth.p99_ms.get(name).map_or(f64::INFINITY, |p| p / target);
            ratios.entry(name.clone()).or_default().push(ratio);
            worst = worst.max(ratio);
            if ratio > 1.0 {
                met_all[k] = false;
                severity.push(ratio - 1.0);
            }
        }
    }
    let events = load_change_intervals(records);
    let conv: Vec<usize> = events
        .iter()
        .enumerate()
        .map(|(e, &k)| {
            let end = events.get(e + 1).copied().unwrap_or(n);
            convergence(&met_all, k, end)
        })
        .collect();
    let mut conv_sorted: Vec<f64> = conv.iter().map(|&c| c as f64).collect();
    conv_sorted.sort_by(f64::total_cmp);
    let mut times: Vec<f64> = records.iter().map(|r| r.decision_us).collect();
    times.sort_by(f64::total_cmp);
    RunSummary {
        simulated: records.iter().all(|r| r.simulated),
        scenario: scenario.to_string(),
        policy: policy.to_string(),
        seed,
        intervals: n,
        qos_met_fraction: fraction(met_all.iter().filter(|m| **m).count(), n),
        violation_severity_mean: if severity.is_empty() {
            0.0
        } else {
            severity.iter().sum::<f64>() / severity.len() as f64
        },
        violation_severity_max: worst,
        load_changes: events.len(),
        convergence_intervals_p50: quantile(&conv_sorted, 0.5),
        convergence_intervals_max: conv.iter().copied().max(),
        be_throughput: if n == 0 { 0.0 } else { be / n as f64 },
        be_throughput_vs_oracle: None,
        actuations: records.iter().map(|r| r.changes.len()).sum(),
        decision_us_p50: quantile(&times, 0.5).unwrap_or(0.0),
        decision_us_p99: quantile(&times, 0.99).unwrap_or(0.0),
        decision_us_max: times.last().copied().unwrap_or(0.0),
        decision_ms_total: times.iter().sum::<f64>() / 1000.0,
        be_mba_pct_mean: if n == 0 {
            full_mba()
        } else {
            records
                .iter()
                .map(|r| f64::from(r.plan.best_effort.mba_pct))
                .sum::<f64>()
                / n as f64
        },
        mba_throttled_fraction: fraction(
            records
                .iter()
                .filter(|r| r.plan.groups().any(|(_, a)| a.mba_pct < 100))
                .count(),
            n,
        ),
        services: ratios
            .into_iter()
            .map(|(name, mut v)| {
                let met = v.iter().filter(|r| **r <= 1.0).count();
                let len = v.len();
                v.sort_by(f64::total_cmp);
                (
                    name,
                    ServiceSummary {
                        qos_met_fraction: fraction(met, len),
                        p99_over_target_p50: quantile(&v, 0.5).unwrap_or(0.0),
                        p99_over_target_max: v.last().copied().unwrap_or(0.0),
                    },
                )
            })
            .collect(),
    }
}

/// Best-effort throughput relative to the oracle's on the same scenario and seed; `None`
/// when the oracle ran no best-effort work (the ratio would mean nothing). The one rule
/// for `be_vs_oracle`.
pub fn be_vs_oracle(be_throughput: f64, oracle_be_throughput: f64) -> Option<f64> {
    (oracle_be_throughput > 0.0).then(|| be_throughput / oracle_be_throughput)
}

/// The comparison table.
pub fn table(rows: &[RunSummary], with_scenario: bool) -> String {
    let mut s = String::new();
    let opt = |v: Option<f64>, p: usize| v.map_or_else(|| "-".to_string(), |x| format!("{x:.p$}"));
    if with_scenario {
        let _ = write!(s, "{:<14} ", "scenario");
    }
    let _ = writeln!(
        s,
        "{:<8} {:>8} {:>9} {:>8} {:>9} {:>8} {:>8} {:>12} {:>10} {:>10} {:>10} {:>7} {:>7}",
        "policy",
        "qos_met",
        "sev_mean",
        "sev_max",
        "conv_p50",
        "conv_max",
        "be_tput",
        "be_vs_oracle",
        "actuations",
        "dec_p50_us",
        "dec_p99_us",
        "be_mba",
        "mba<100"
    );
    for r in rows {
        if with_scenario {
            let _ = write!(s, "{:<14} ", r.scenario);
        }
        let _ = writeln!(
            s,
            "{:<8} {:>8.4} {:>9.3} {:>8.2} {:>9} {:>8} {:>8.3} {:>12} {:>10} {:>10.1} {:>10.1} {:>7.1} {:>7.3}",
            r.policy,
            r.qos_met_fraction,
            r.violation_severity_mean,
            r.violation_severity_max,
            opt(r.convergence_intervals_p50, 1),
            r.convergence_intervals_max
                .map_or_else(|| "-".into(), |v| v.to_string()),
            r.be_throughput,
            opt(r.be_throughput_vs_oracle, 3),
            r.actuations,
            r.decision_us_p50,
            r.decision_us_p99,
            r.be_mba_pct_mean,
            r.mba_throttled_fraction
        );
    }
    s
}

/// Per-service QoS beside the all-services figure: one row per run, each latency-critical
/// service's fraction of intervals at or under its target, and the mean number of services
/// meeting theirs per interval (`met/n`).
pub fn service_table(rows: &[RunSummary], with_scenario: bool) -> String {
    let mut s = String::new();
    for r in rows {
        if with_scenario {
            let _ = write!(s, "{:<14} ", r.scenario);
        }
        let met: f64 = r.services.values().map(|v| v.qos_met_fraction).sum();
        let _ = write!(
            s,
            "{:<8} all {:>6.4}  met/n {:>5.2}/{:<2}",
            r.policy,
            r.qos_met_fraction,
            met,
            r.services.len()
        );
        for (name, v) in &r.services {
            let _ = write!(s, "  {name} {:.3}", v.qos_met_fraction);
        }
        s.push('\n');
    }
    s
}

/// The oracle's search time per run: median, 99th percentile and longest search, and the
/// total over the run (searches reused while loads hold still cost one evaluation).
pub fn search_time_table(rows: &[RunSummary]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<14} {:>9} {:>9} {:>9} {:>9}",
        "scenario", "p50_ms", "p99_ms", "max_ms", "total_s"
    );
    for r in rows.iter().filter(|r| r.policy == "oracle") {
        let _ = writeln!(
            s,
            "{:<14} {:>9.2} {:>9.1} {:>9.1} {:>9.2}",
            r.scenario,
            r.decision_us_p50 / 1000.0,
            r.decision_us_p99 / 1000.0,
            r.decision_us_max / 1000.0,
            r.decision_ms_total / 1000.0
        );
    }
    s
}

fn fraction(a: usize, b: usize) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// Nearest-rank quantile of sorted values.
pub fn quantile(sorted: &[f64], q: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let idx = cohabit_sim::whole(q * (sorted.len() - 1) as f64);
    sorted
        .get(
            usize::try_from(idx)
                .unwrap_or(usize::MAX)
                .min(sorted.len() - 1),
        )
        .copied()
}

/// Intervals at which some service's true load moved by more than [`LOAD_CHANGE`].
pub fn load_change_intervals(records: &[DecisionRecord]) -> Vec<usize> {
    let mut out = Vec::new();
    for k in 1..records.len() {
        let (Some(a), Some(b)) = (&records[k - 1].truth, &records[k].truth) else {
            continue;
        };
        let changed = b.load_rps.iter().any(|(name, now)| {
            a.load_rps
                .get(name)
                .is_some_and(|before| (now - before).abs() > LOAD_CHANGE * before.max(1e-9))
        });
        if changed {
            out.push(k);
        }
    }
    out
}

/// Intervals from `start` until QoS is met and then holds for [`SETTLE_INTERVALS`] (or until
/// `end`, whichever is first). If it never settles before `end`, the whole span counts.
pub fn convergence(met: &[bool], start: usize, end: usize) -> usize {
    let end = end.min(met.len());
    for d in 0..end.saturating_sub(start) {
        let from = start + d;
        let to = (from + SETTLE_INTERVALS).min(end);
        if met[from..to].iter().all(|m| *m) {
            return d;
        }
    }
    end.saturating_sub(start)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn convergence_counts_intervals_until_qos_holds() {
        let met = [
            false, false, true, false, true, true, true, true, true, true,
        ];
        assert_eq!(convergence(&met, 0, 10), 4);
        assert_eq!(convergence(&met, 4, 10), 0);
        // Never settles before the next event: the whole span.
        assert_eq!(convergence(&[false, false, false], 0, 3), 3);
        // A short tail that holds until the end counts as settled.
        assert_eq!(convergence(&[false, true, true], 0, 3), 1);
    }

    #[test]
    fn quantiles_are_nearest_rank() {
        let v = [1.0, 2.0, 3.0, 4.0, 5.0];
        assert_eq!(quantile(&v, 0.5), Some(3.0));
        assert_eq!(quantile(&v, 0.99), Some(5.0));
        assert_eq!(quantile(&[], 0.5), None);
    }
}
