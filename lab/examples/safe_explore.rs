//! `ml` with and without safe exploration (issue 45, item 3).
//!
//! Three settings on each host: `ml` (with its per-host posterior, no exploration), `ml`
//! with the old random walk around its plan (`ExploreRule::Walk`), and `ml` with the
//! informative safe step (`ExploreRule::Informative`, the default of `--explore`). Hosts: a
//! 2-core host shaped like the project's VM (no counters, no RDT, memcached beside a
//! CPU-bound batch job), the built-in `demo` on the E5, and foreign hosts from
//! `lab/scenarios/foreign/` (or the files named). Per simulated minute, over the seeds:
//! the share of services' decisions on the model path, the mean posterior variance of the
//! prediction for the allocation chosen, the median |error| of that prediction against
//! the next reading, QoS met (intervals every service met its target), best effort against
//! the oracle's in that minute, the decisions exploration changed, and the intervals under
//! an explored plan in which a service missed its target (violations exploration may have
//! caused).
//!
//! The VM-shaped host runs memcached at `VM_LOAD` of its catalogue load (default 0.02:
//! there the oracle gives it one of the two cores and `ml` holds both in some runs, as on
//! the real VM); `EXPLORE_BETA` and `EXPLORE_MIN_INFORMATION` change the informative rule's
//! settings (defaults [`ExploreConfig::default`]).
//!
//! `cargo run --release -p cohabit-lab --example safe_explore [vm|demo|FILE…]` (simulated;
//! about a minute on a 2-CPU machine).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use cohabit_core::{DecisionPath, DecisionRecord};
use cohabit_lab::batch::{mean, median, parallel};
use cohabit_lab::simulate::{self, LabPolicy, PolicyOptions};
use cohabit_policy::{ExploreConfig, ExploreRule};
use cohabit_sim::Scenario;

/// Seeds each setting is run with.
const SEEDS: [u64; 10] = [0, 101, 202, 303, 404, 505, 606, 707, 808, 909];

/// A 2-core host shaped like the project's VM: no counters, no RDT monitoring or
/// allocation; memcached beside a CPU-bound batch job.
const VM: &str = r#"
name = "vm-2cpu"
description = "2 cores, no counters, no RDT: memcached beside a CPU-bound batch job"
duration_s = 900
tick_ms = 1000
seed = 45
[host]
preset = "xeon-e5-2697v4"
cores = 2
counters = false
rdt_monitoring = false
rdt_allocation = false
[[service]]
name = "memcached"
model = "memcached"
load = { kind = "constant", fraction = VM_LOAD }
[[best_effort]]
name = "compute"
model = "compute"
"#;

/// The settings compared.
fn settings() -> [(&'static str, Option<ExploreConfig>); 3] {
    [
        ("ml (posterior)", None),
        (
            "ml --explore, random walk",
            Some(ExploreConfig {
                rule: ExploreRule::Walk,
                ..ExploreConfig::default()
            }),
        ),
        ("ml --explore, informative safe", Some(informative())),
    ]
}

/// The informative rule's settings: the defaults, or `EXPLORE_BETA` and
/// `EXPLORE_MIN_INFORMATION` from the environment.
fn informative() -> ExploreConfig {
    let d = ExploreConfig::default();
    let var = |k: &str, or: f64| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(or)
    };
    ExploreConfig {
        beta: var("EXPLORE_BETA", d.beta),
        min_information: var("EXPLORE_MIN_INFORMATION", d.min_information),
        ..d
    }
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    println!("SIMULATION: every figure below comes from cohabit's simulated host.");
    let load: f64 = std::env::var("VM_LOAD")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.02);
    let mut hosts: Vec<Arc<Scenario>> = Vec::new();
    let all = args.is_empty();
    if all || args.iter().any(|a| a == "vm") {
        let text = VM.replace("VM_LOAD", &format!("{load}"));
        hosts.push(Arc::new(Scenario::from_toml(
            &text,
            "vm-2cpu",
            std::path::Path::new("."),
        )?));
    }
    if all || args.iter().any(|a| a == "demo") {
        hosts.push(Arc::new(Scenario::load("demo")?));
    }
    let files: Vec<PathBuf> = if all {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scenarios/foreign");
        ["small-fast.toml", "20c16w.toml"]
            .iter()
            .map(|f| dir.join(f))
            .collect()
    } else {
        args.iter()
            .filter(|a| a.ends_with(".toml"))
            .map(PathBuf::from)
            .collect()
    };
    for f in files {
        let path = f.display().to_string();
        hosts.push(Arc::new(
            Scenario::load(&path).with_context(|| path.clone())?,
        ));
    }
    for sc in &hosts {
        host(sc)?;
    }
    Ok(())
}

/// Per simulated minute of a run.
#[derive(Debug, Clone, Default)]
struct Minute {
    model: usize,
    decisions: usize,
    variances: Vec<f64>,
    errors: Vec<f64>,
    met: usize,
    intervals: usize,
    be: f64,
    explored: usize,
    explore_violations: usize,
}

impl Minute {
    fn add(&mut self, x: &Minute) {
        self.model += x.model;
        self.decisions += x.decisions;
        self.variances.extend(&x.variances);
        self.errors.extend(&x.errors);
        self.met += x.met;
        self.intervals += x.intervals;
        self.be += x.be;
        self.explored += x.explored;
        self.explore_violations += x.explore_violations;
    }
}

/// One host: the oracle, then each setting over the seeds.
fn host(sc: &Arc<Scenario>) -> Result<()> {
    let oracle = simulate::run_oracle(sc, Default::default(), "oracle")?;
    let oracle_be = per_minute(&oracle.records, sc);
    let model = Arc::new(simulate::builtin_model(sc.host.preset)?);
    let i = informative();
    println!(
        "\ninformative rule: beta {}, min_information {}, settle_ticks {}",
        i.beta, i.min_information, i.settle_ticks
    );
    println!(
        "\n{} ({} cores, {} ways): {}; oracle QoS {:.3}, best effort {:.3}; {} seeds",
        sc.name,
        sc.capacity().cores,
        sc.capacity().llc_ways,
        sc.description,
        oracle.summary.qos_met_fraction,
        oracle.summary.be_throughput,
        SEEDS.len()
    );
    println!(
        "{:<32} {:>4} {:>7} {:>8} {:>8} {:>6} {:>6} {:>8} {:>9}",
        "setting", "min", "model%", "post.var", "med|err|", "qos", "be/or", "explored", "expl.viol"
    );
    for (name, explore) in settings() {
        let runs = parallel(&SEEDS, |&seed| {
            let options = PolicyOptions {
                explore: explore.clone(),
                ..PolicyOptions::default()
            };
            let run = simulate::run_policy_with(
                sc,
                LabPolicy::Ml,
                Some(seed),
                Some(&model),
                &options,
                |_| Ok(()),
            )?;
            Ok((per_minute(&run.records, sc), run.summary.qos_met_fraction))
        })?;
        let minutes = runs
            .iter()
            .map(|r| r.0.iter().take_while(|m| m.intervals >= 30).count())
            .min()
            .unwrap_or(0)
            .min(oracle_be.len());
        let mut whole = Minute::default();
        let mut second = (0.0, 0.0);
        for m in 0..minutes {
            let mut all = Minute::default();
            for (r, _) in &runs {
                all.add(&r[m]);
            }
            let be_or = all.be / runs.len() as f64 / oracle_be[m].be.max(1e-12);
            if m >= minutes / 2 {
                second.0 += all.be / runs.len() as f64;
                second.1 += oracle_be[m].be;
            }
            println!(
                "{name:<32} {:>4} {:>7.1} {:>8.4} {:>8.3} {:>6.3} {:>6.3} {:>8} {:>9}",
                m + 1,
                100.0 * all.model as f64 / all.decisions.max(1) as f64,
                mean(&all.variances),
                median(&mut all.errors),
                all.met as f64 / all.intervals.max(1) as f64,
                be_or,
                all.explored,
                all.explore_violations
            );
            whole.add(&all);
        }
        let qos = runs.iter().map(|r| r.1).sum::<f64>() / runs.len() as f64;
        println!(
            "{name:<32} whole run: QoS {qos:.3}, model path {:.1} %, best effort {:.3} of the \
             oracle's in the second half, {} explored decisions, {} intervals over a target \
             under an explored plan",
            100.0 * whole.model as f64 / whole.decisions.max(1) as f64,
            second.0 / second.1.max(1e-12),
            whole.explored,
            whole.explore_violations
        );
    }
    Ok(())
}

/// `records` cut into simulated minutes.
fn per_minute(records: &[DecisionRecord], sc: &Scenario) -> Vec<Minute> {
    let targets: BTreeMap<String, f64> = sc
        .services
        .iter()
        .filter_map(|s| Some((s.spec.name.clone(), s.spec.p99_target_ms()?)))
        .collect();
    let over = |r: &DecisionRecord| {
        targets
            .iter()
            .any(|(s, t)| r.judged_p99_ms(s).is_some_and(|p| p > *t))
    };
    let mut out: Vec<Minute> = Vec::new();
    for (i, r) in records.iter().enumerate() {
        let m = usize::try_from(r.observation.t_ms / 60_000).unwrap_or(0);
        if out.len() <= m {
            out.resize(m + 1, Minute::default());
        }
        let x = &mut out[m];
        x.intervals += 1;
        x.met += usize::from(!over(r));
        x.be += r.truth.as_ref().map_or(0.0, |t| t.be_throughput);
        let explored = r.reasons.values().any(|w| w.path == DecisionPath::Explore);
        if explored {
            x.explored += 1;
            // The interval under this plan is described by the next record.
            x.explore_violations += usize::from(records.get(i + 1).is_some_and(over));
        }
        for (s, t) in &targets {
            if let Some(why) = r.reasons.get(s) {
                x.decisions += 1;
                x.model += usize::from(why.path == DecisionPath::Model);
            }
            let Some(p) = r.predictions.get(s) else {
                continue;
            };
            if let Some(post) = p.posterior {
                x.variances.push(post.log_qos_sigma * post.log_qos_sigma);
            }
            let next = records.get(i + 1).and_then(|n| {
                n.observation
                    .services
                    .iter()
                    .find(|o| &o.spec.name == s)
                    .and_then(|o| o.sample.p99_ms)
            });
            if let Some(obs) = next {
                x.errors.push((p.log_qos_ratio - (obs / t).ln()).abs());
            }
        }
    }
    out
}
