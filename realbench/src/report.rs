//! Results: per run and service, the windows the client measured and what they add up to
//! (share of windows meeting the target, the distribution of window p99s); per batch job,
//! throughput relative to running alone; the table people read and the JSON programs read.

use std::fmt::Write as _;
use std::path::PathBuf;

use crate::antagonists::Throughput;
use crate::client::WindowStat;

/// What kind of run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum RunKind {
    /// The services under load, nothing else: what they can do on this host.
    ServicesAlone,
    /// The batch job alone: the throughput the others are compared with.
    BatchAlone,
    /// Services under load and the batch job together, under a policy.
    Colocated,
    /// Like `Colocated`, with `cohabit run --explore` around `ml`: the logs that train the
    /// host model.
    Explore,
}

/// A distribution of per-window p99s, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Spread {
    /// Median window.
    pub p50_ms: f64,
    /// 90th percentile window.
    pub p90_ms: f64,
    /// Worst window.
    pub max_ms: f64,
}

/// What the client measured on one service in one run, summed up.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Summary {
    /// Windows counted (after the warm-up).
    pub windows: usize,
    /// Of which met the target: p99 at most the target (a failed request counts as 10 s).
    pub met: usize,
    /// `met / windows`.
    pub met_share: f64,
    /// The window p99s.
    pub window_p99: Spread,
    /// p99 of every request counted, ms.
    pub overall_p99_ms: f64,
    /// Median of every request counted, ms.
    pub overall_p50_ms: f64,
    /// Requests counted.
    pub requests: u64,
    /// Of which failed (no answer, an error, a broken connection).
    pub failed: u64,
    /// Requests per second achieved.
    pub achieved_rps: f64,
}

/// One service in one run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ServiceResult {
    /// Its name.
    pub service: String,
    /// Its p99 target, ms.
    pub p99_target_ms: f64,
    /// Offered requests per second.
    pub rate_rps: f64,
    /// Leading windows left out of the summary.
    pub warmup_windows: usize,
    /// The summary of the other windows.
    pub summary: Summary,
    /// Every window, warm-up included.
    pub windows: Vec<WindowStat>,
}

fn ms(us: u64) -> f64 {
    us as f64 / 1000.0
}

/// Nearest-rank quantile of sorted values.
fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (q * sorted.len() as f64).ceil();
    let i = crate::whole(rank).saturating_sub(1);
    sorted[usize::try_from(i).unwrap_or(0).min(sorted.len() - 1)]
}

/// Sums up the windows after `warmup` against `target_ms`; `total` is the merged
/// distribution of those windows' requests.
pub fn summarize(
    windows: &[WindowStat],
    warmup: usize,
    target_ms: f64,
    total: &WindowStat,
) -> Summary {
    let counted = &windows[warmup.min(windows.len())..];
    let mut p99s: Vec<f64> = counted
        .iter()
        .filter(|w| w.requests > 0)
        .map(|w| ms(w.p99_us))
        .collect();
    p99s.sort_by(f64::total_cmp);
    let met = counted
        .iter()
        .filter(|w| w.requests > 0 && ms(w.p99_us) <= target_ms)
        .count();
    let n = counted.len();
    Summary {
        windows: n,
        met,
        met_share: if n == 0 { 0.0 } else { met as f64 / n as f64 },
        window_p99: Spread {
            p50_ms: quantile(&p99s, 0.5),
            p90_ms: quantile(&p99s, 0.9),
            max_ms: p99s.last().copied().unwrap_or(f64::NAN),
        },
        overall_p99_ms: ms(total.p99_us),
        overall_p50_ms: ms(total.p50_us),
        requests: total.requests,
        failed: total.failed,
        achieved_rps: if n == 0 {
            0.0
        } else {
            total.requests as f64 / n as f64
        },
    }
}

/// One batch job's throughput in one run.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct BatchResult {
    /// What stress-ng reported.
    pub throughput: Throughput,
    /// The same stressor alone, bogo-ops/s.
    pub alone_ops_per_s: Option<f64>,
    /// `ops_per_s / alone_ops_per_s`.
    pub relative: Option<f64>,
}

/// How the daemon behaved in one run.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct CohabitResult {
    /// Its exit code after `SIGTERM` (`None`: it had to be killed).
    pub exit_code: Option<i32>,
    /// It said it restored the host and left none of its cgroups behind.
    pub restored: bool,
    /// CPU seconds it used (probes included).
    pub cpu_s: Option<f64>,
    /// Decisions it logged.
    pub decisions: usize,
    /// Its configuration.
    pub config: PathBuf,
    /// Its decision log.
    pub log: PathBuf,
    /// Its stderr and stdout.
    pub output: PathBuf,
}

/// One run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RunResult {
    /// What kind.
    pub kind: RunKind,
    /// The batch job, if one ran.
    pub scenario: Option<String>,
    /// The policy.
    pub policy: String,
    /// Where its files are.
    pub dir: PathBuf,
    /// The services.
    pub services: Vec<ServiceResult>,
    /// The batch jobs.
    pub batch: Vec<BatchResult>,
    /// The daemon, if it ran.
    pub cohabit: Option<CohabitResult>,
    /// The round, when the co-located runs were repeated (`--rounds`).
    pub round: Option<u32>,
}

impl RunResult {
    /// Mean relative throughput of the batch jobs.
    pub fn batch_relative(&self) -> Option<f64> {
        let r: Vec<f64> = self.batch.iter().filter_map(|b| b.relative).collect();
        (!r.is_empty()).then(|| r.iter().sum::<f64>() / r.len() as f64)
    }
}

/// The machine the runs were on.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Machine {
    /// CPU model.
    pub cpu_model: String,
    /// Online CPUs.
    pub cpus: usize,
    /// Memory, GiB.
    pub memory_gib: f64,
    /// Kernel release.
    pub kernel: String,
    /// cgroup version.
    pub cgroup: String,
    /// Versions of the programs.
    pub tools: Vec<(String, String)>,
    /// How late a thread woke from 1 ms sleeps on the idle host before the runs, µs
    /// (p50, p99): milliseconds mean idle CPUs wake slowly (a VM whose idle vCPUs halt),
    /// which a service on CPUs of its own pays per request.
    pub wake_late_us: (u64, u64),
}

/// Below this share of windows met by a service running alone, the host cannot hold the
/// target even without a batch job, and the report says so.
pub const NOISY_ALONE: f64 = 0.9;

/// Everything one benchmark produced.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Report {
    /// The machine.
    pub machine: Machine,
    /// The settings, as given.
    pub settings: serde_json::Value,
    /// Every run, in the order run.
    pub runs: Vec<RunResult>,
    /// The host-trained model of the `ml-host` column, when it was asked for.
    pub host_model: Option<crate::host_model::HostModel>,
}

fn two_decimals(x: f64) -> String {
    if x.is_finite() {
        format!("{x:.2}")
    } else {
        "-".into()
    }
}

impl Report {
    /// The table people read.
    pub fn table(&self) -> String {
        let mut t = String::new();
        let m = &self.machine;
        let _ = writeln!(
            t,
            "machine: {} × {}, {:.0} GiB, Linux {}, cgroup {}",
            m.cpus, m.cpu_model, m.memory_gib, m.kernel, m.cgroup
        );
        let _ = writeln!(
            t,
            "idle wake-up: 1 ms sleeps end p50 {} µs, p99 {} µs late",
            m.wake_late_us.0, m.wake_late_us.1
        );
        if let Some(b) = self
            .settings
            .get("best_effort_cpus")
            .and_then(serde_json::Value::as_str)
        {
            let _ = writeln!(t, "cohabit: [host] best_effort_cpus = \"{b}\"");
        }
        let _ = writeln!(
            t,
            "{:<8} {:<14} {:<10} {:>7} {:>11} {:>22} {:>8} {:>7} {:>9}",
            "batch",
            "policy",
            "service",
            "target",
            "met",
            "window p99 p50/p90/max",
            "all p99",
            "failed",
            "batch thr"
        );
        for r in &self.runs {
            let scenario = r.scenario.as_deref().unwrap_or("-");
            let policy = match (r.kind, r.round) {
                (RunKind::ServicesAlone, _) => "services-alone".to_string(),
                (RunKind::BatchAlone, _) => "batch-alone".to_string(),
                (RunKind::Colocated | RunKind::Explore, None) => r.policy.clone(),
                (RunKind::Colocated | RunKind::Explore, Some(n)) => format!("{} r{n}", r.policy),
            };
            let thr = match r.kind {
                RunKind::BatchAlone => r
                    .batch
                    .iter()
                    .map(|b| format!("{:.0}/s", b.throughput.ops_per_s))
                    .collect::<Vec<_>>()
                    .join(","),
                _ => r.batch_relative().map_or("-".into(), two_decimals),
            };
            if r.services.is_empty() {
                let _ = writeln!(
                    t,
                    "{scenario:<8} {policy:<14} {:<10} {:>7} {:>11} {:>22} {:>8} {:>7} {thr:>9}",
                    "-", "-", "-", "-", "-", "-"
                );
            }
            for s in &r.services {
                let u = &s.summary;
                let met = format!("{}/{} {:>3.0}%", u.met, u.windows, u.met_share * 100.0);
                let spread = format!(
                    "{}/{}/{}",
                    two_decimals(u.window_p99.p50_ms),
                    two_decimals(u.window_p99.p90_ms),
                    two_decimals(u.window_p99.max_ms)
                );
                let _ = writeln!(
                    t,
                    "{scenario:<8} {policy:<14} {:<10} {:>7} {met:>11} {spread:>22} {:>8} {:>7} {thr:>9}",
                    s.service,
                    format!("{}ms", s.p99_target_ms),
                    two_decimals(u.overall_p99_ms),
                    u.failed,
                );
            }
        }
        let _ = writeln!(
            t,
            "met: 1-second windows whose client-side p99 is within the target; window p99 and all p99 in ms;\nbatch thr: stress-ng bogo-ops/s relative to the batch job alone."
        );
        t.push_str(&self.over_rounds());
        for note in self.noise_notes() {
            let _ = writeln!(t, "{note}");
        }
        t.push_str(&self.side_by_side());
        t
    }

    /// Each batch job, policy and service summed over the rounds, when there were several:
    /// windows met of all windows, the median of the runs' median window p99, and the
    /// batch jobs' mean relative throughput.
    pub fn over_rounds(&self) -> String {
        let mut t = String::new();
        let repeated: Vec<&RunResult> = self
            .runs
            .iter()
            .filter(|r| r.kind == RunKind::Colocated && r.round.is_some())
            .collect();
        if repeated.is_empty() {
            return t;
        }
        let rounds = repeated.iter().filter_map(|r| r.round).max().unwrap_or(1);
        let _ = writeln!(t, "\nover {rounds} rounds:");
        let _ = writeln!(
            t,
            "{:<8} {:<14} {:<10} {:>13} {:>16} {:>9}",
            "batch", "policy", "service", "met", "median p99 (ms)", "batch thr"
        );
        let mut keys: Vec<(String, String, String)> = Vec::new();
        for r in &repeated {
            for s in &r.services {
                let k = (
                    r.scenario.clone().unwrap_or_default(),
                    r.policy.clone(),
                    s.service.clone(),
                );
                if !keys.contains(&k) {
                    keys.push(k);
                }
            }
        }
        for (scenario, policy, service) in keys {
            let runs: Vec<&&RunResult> = repeated
                .iter()
                .filter(|r| r.scenario.as_deref() == Some(&scenario) && r.policy == policy)
                .collect();
            let of: Vec<&ServiceResult> = runs
                .iter()
                .flat_map(|r| &r.services)
                .filter(|s| s.service == service)
                .collect();
            let met: usize = of.iter().map(|s| s.summary.met).sum();
            let windows: usize = of.iter().map(|s| s.summary.windows).sum();
            let mut p50s: Vec<f64> = of.iter().map(|s| s.summary.window_p99.p50_ms).collect();
            p50s.sort_by(f64::total_cmp);
            let batch: Vec<f64> = runs.iter().filter_map(|r| r.batch_relative()).collect();
            let thr = if batch.is_empty() {
                "-".to_string()
            } else {
                two_decimals(batch.iter().sum::<f64>() / batch.len() as f64)
            };
            let _ = writeln!(
                t,
                "{scenario:<8} {policy:<14} {service:<10} {:>13} {:>16} {thr:>9}",
                format!("{met}/{windows}"),
                two_decimals(quantile(&p50s, 0.5)),
            );
        }
        t
    }

    /// One line per service that met its target in fewer than [`NOISY_ALONE`] of its
    /// windows with nothing beside it: there the policies' rows differ within the host's
    /// own noise.
    pub fn noise_notes(&self) -> Vec<String> {
        self.runs
            .iter()
            .filter(|r| r.kind == RunKind::ServicesAlone)
            .flat_map(|r| &r.services)
            .filter(|s| s.summary.windows > 0 && s.summary.met_share < NOISY_ALONE)
            .map(|s| {
                format!(
                    "note: {} alone met its {} ms target in only {:.0}% of windows: this host cannot hold it without a batch job, so the rows above differ partly by its noise",
                    s.service,
                    s.p99_target_ms,
                    s.summary.met_share * 100.0
                )
            })
            .collect()
    }

    /// `ml` with the simulator-trained model beside `ml-host` with the host-trained one,
    /// per batch job and service, and how the host model was made.
    pub fn side_by_side(&self) -> String {
        let mut t = String::new();
        let Some(m) = &self.host_model else {
            return t;
        };
        match (&m.model, &m.error) {
            (Some(p), _) => {
                let _ = writeln!(
                    t,
                    "\nhost model: {} rows from {} explore run(s), trained in {:.1} s ({})",
                    m.rows,
                    m.logs.len(),
                    m.train_s,
                    p.display()
                );
            }
            (None, e) => {
                let _ = writeln!(
                    t,
                    "\nhost model: none, the ml-host runs were skipped: {}",
                    e.as_deref().unwrap_or("unknown")
                );
                return t;
            }
        }
        let _ = writeln!(
            t,
            "{:<8} {:<10} {:>16} {:>16} {:>10} {:>10}",
            "batch", "service", "ml (sim) met", "ml-host met", "ml thr", "host thr"
        );
        let find = |scenario: &str, policy: &str| {
            self.runs.iter().find(|r| {
                r.kind == RunKind::Colocated
                    && r.scenario.as_deref() == Some(scenario)
                    && r.policy == policy
            })
        };
        // Each batch job once, in the order its first run came (explore runs come first,
        // so the same names recur further on).
        let mut scenarios: Vec<&str> = Vec::new();
        for sc in self.runs.iter().filter_map(|r| r.scenario.as_deref()) {
            if !scenarios.contains(&sc) {
                scenarios.push(sc);
            }
        }
        for sc in scenarios {
            let (Some(sim), Some(host)) = (find(sc, "ml"), find(sc, "ml-host")) else {
                continue;
            };
            for s in &sim.services {
                let Some(h) = host.services.iter().find(|x| x.service == s.service) else {
                    continue;
                };
                let pct =
                    |u: &Summary| format!("{}/{} {:>3.0}%", u.met, u.windows, u.met_share * 100.0);
                let thr = |r: &RunResult| r.batch_relative().map_or("-".into(), two_decimals);
                let _ = writeln!(
                    t,
                    "{sc:<8} {:<10} {:>16} {:>16} {:>10} {:>10}",
                    s.service,
                    pct(&s.summary),
                    pct(&h.summary),
                    thr(sim),
                    thr(host)
                );
            }
        }
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(requests: u64, p99_us: u64) -> WindowStat {
        WindowStat {
            requests,
            failed: 0,
            p50_us: p99_us / 2,
            p99_us,
            max_us: p99_us * 2,
        }
    }

    #[test]
    fn windows_after_the_warmup_are_judged_against_the_target() {
        let windows = [
            w(100, 9000),
            w(100, 500),
            w(100, 900),
            w(100, 1500),
            w(0, 0),
        ];
        let total = w(300, 1200);
        let s = summarize(&windows, 1, 1.0, &total);
        assert_eq!(s.windows, 4);
        assert_eq!(
            s.met, 2,
            "0.5 and 0.9 ms meet 1 ms; 1.5 ms and the empty window do not"
        );
        assert_eq!(s.met_share, 0.5);
        assert_eq!(s.window_p99.max_ms, 1.5);
        assert_eq!(s.window_p99.p50_ms, 0.9);
        assert_eq!(s.overall_p99_ms, 1.2);
        assert_eq!(s.achieved_rps, 75.0);
    }

    #[test]
    fn the_header_names_best_effort_cpus_only_when_set() {
        let report = |settings| Report {
            machine: machine(),
            settings,
            runs: vec![],
            host_model: None,
        };
        let mut o = crate::bench::Options::quick("/tmp/x".into());
        let t = report(serde_json::to_value(&o).unwrap()).table();
        assert!(!t.contains("best_effort_cpus"), "{t}");
        o.best_effort_cpus = Some(crate::policies::BestEffortCpus::All);
        let v = serde_json::to_value(&o).unwrap();
        assert_eq!(v["best_effort_cpus"], "all");
        let t = report(v).table();
        assert_eq!(
            t.lines().nth(2),
            Some("cohabit: [host] best_effort_cpus = \"all\"")
        );
        assert!(
            t.contains("1 ms sleeps end p50 80 µs, p99 1200 µs late"),
            "{t}"
        );
    }

    fn machine() -> Machine {
        Machine {
            cpu_model: "x".into(),
            cpus: 2,
            memory_gib: 1.0,
            kernel: "6.18".into(),
            cgroup: "v1".into(),
            tools: vec![],
            wake_late_us: (80, 1200),
        }
    }

    /// A run of memcached (1 ms target) whose windows had these p99s, µs.
    fn run_of(kind: RunKind, policy: &str, round: Option<u32>, p99_us: &[u64]) -> RunResult {
        let windows: Vec<WindowStat> = p99_us
            .iter()
            .map(|&us| WindowStat {
                requests: 100,
                failed: 0,
                p50_us: us / 2,
                p99_us: us,
                max_us: us,
            })
            .collect();
        let total = windows[0];
        RunResult {
            kind,
            scenario: (kind == RunKind::Colocated).then(|| "cpu".to_string()),
            policy: policy.into(),
            dir: "/tmp/x".into(),
            services: vec![ServiceResult {
                service: "memcached".into(),
                p99_target_ms: 1.0,
                rate_rps: 100.0,
                warmup_windows: 0,
                summary: summarize(&windows, 0, 1.0, &total),
                windows,
            }],
            batch: vec![],
            cohabit: None,
            round,
        }
    }

    fn report_of(runs: Vec<RunResult>) -> Report {
        Report {
            machine: machine(),
            settings: serde_json::Value::Null,
            runs,
            host_model: None,
        }
    }

    #[test]
    fn a_service_that_misses_alone_is_called_out_as_the_hosts_noise() {
        let alone = |p99: &[u64]| run_of(RunKind::ServicesAlone, "-", None, p99);
        // 9 of 10 windows met: a quiet enough host.
        let quiet = report_of(vec![alone(&[
            500, 500, 500, 500, 500, 500, 500, 500, 500, 3000,
        ])]);
        assert!(quiet.noise_notes().is_empty());
        // 8 of 10: said, with the share.
        let noisy = report_of(vec![alone(&[
            500, 500, 500, 500, 500, 500, 500, 500, 3000, 3000,
        ])]);
        let notes = noisy.noise_notes();
        assert_eq!(notes.len(), 1);
        assert!(
            notes[0].contains("memcached alone met its 1 ms target in only 80%"),
            "{notes:?}"
        );
        assert!(noisy.table().contains(&notes[0]));
    }

    #[test]
    fn repeated_rounds_are_summed_per_policy() {
        let with_batch = |mut r: RunResult, rel: f64| {
            r.batch = vec![BatchResult {
                throughput: Throughput {
                    stressor: "cpu".into(),
                    bogo_ops: 1.0,
                    ops_per_s: rel,
                },
                alone_ops_per_s: Some(1.0),
                relative: Some(rel),
            }];
            r
        };
        let col = |policy, round, p99: &[u64]| run_of(RunKind::Colocated, policy, Some(round), p99);
        let r = report_of(vec![
            with_batch(col("ml", 1, &[500, 500, 500, 3000]), 0.5),
            with_batch(col("none", 1, &[500, 3000, 3000, 3000]), 0.9),
            with_batch(col("ml", 2, &[500, 3000, 3000, 3000]), 0.7),
            with_batch(col("none", 2, &[500, 500, 3000, 3000]), 0.9),
        ]);
        let t = r.over_rounds();
        assert!(t.contains("over 2 rounds:"), "{t}");
        let line = |p: &str| {
            t.lines()
                .find(|l| l.split_whitespace().nth(1) == Some(p))
                .unwrap_or_else(|| panic!("no {p} line in {t}"))
                .split_whitespace()
                .map(str::to_string)
                .collect::<Vec<_>>()
        };
        // ml: 3 + 1 of 8 windows met, batch (0.5 + 0.7) / 2.
        let ml = line("ml");
        assert_eq!((ml[3].as_str(), ml[5].as_str()), ("4/8", "0.60"), "{t}");
        assert_eq!(line("none")[3], "3/8", "{t}");
        // The per-run rows name their round; one round alone adds no summary.
        assert!(r.table().contains("ml r2"), "{}", r.table());
        let once = report_of(vec![run_of(RunKind::Colocated, "ml", None, &[500])]);
        assert!(once.over_rounds().is_empty());
    }

    #[test]
    fn nearest_rank_quantiles() {
        let v = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0];
        assert_eq!(quantile(&v, 0.5), 5.0);
        assert_eq!(quantile(&v, 0.9), 9.0);
        assert_eq!(quantile(&v, 1.0), 10.0);
        assert!(quantile(&[], 0.5).is_nan());
    }
}
