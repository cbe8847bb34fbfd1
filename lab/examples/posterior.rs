//! `ml` with and without its per-host posterior (issue 45, item 2).
//!
//! Two parts. `builtin`: every built-in CPU scenario (or those named after it) on the E5 and
//! the Gold, ten seeds each, with `ml` as before (the ensemble's spread, a bias and a
//! spread factor per service) and with the posterior; per setting the runs meeting QoS in
//! at least 99 % of intervals, the mean QoS, the mean best effort against the oracle's, the
//! worst scenario's mean and the decision time. `foreign`: a host no built-in model was
//! trained for (an E5 cut to 20 cores and 16 ways, at 3 GHz with 50 GB/s of memory
//! bandwidth: the training generator draws only the presets), with memcached (a load
//! step), moses and img-dnn beside two best-effort jobs, ten seeds; per simulated minute,
//! with and without the posterior: the share of services' decisions on the model's path,
//! the median |error| of the prediction for the allocation chosen against the next
//! reading, QoS met, and best effort (absolute, and against the oracle's in that minute).
//! A second foreign host, `slow-memory` (24 cores, 12 ways of a 20 MB LLC, 160 ns memory),
//! is overloaded after its load step: the oracle meets QoS in none of its intervals either.
//!
//! `timing`: the decision time (p50, p99) of eight services on the E5 and the Gold, loaded
//! and crowded, with and without the posterior, timed as `cohabit bench` times `ml`
//! (`cohabit_lab::bench::retime`: every decision re-made on the run's observations, the
//! least of its timings over copies and replays, so that a preemption or a slow spell of
//! the machine does not count as the policy's cost), beside the times measured in the run.
//!
//! `cargo run --release -p cohabit-lab --example posterior [builtin|foreign|timing]
//! [SCENARIO…]` (simulated; a few minutes for each part on a 2-CPU machine).

use std::collections::BTreeMap;
use std::sync::Arc;

use anyhow::{Context, Result};
use cohabit_core::{DecisionPath, DecisionRecord};
use cohabit_lab::batch::{median, parallel};
use cohabit_lab::bench::retime;
use cohabit_lab::metrics::quantile;
use cohabit_lab::simulate;
use cohabit_models::Model;
use cohabit_policy::MlConfig;
use cohabit_sim::Scenario;

/// Seeds each setting is run with.
const SEEDS: [u64; 10] = [0, 101, 202, 303, 404, 505, 606, 707, 808, 909];

/// The foreign host: not a preset the training generator draws from.
const FOREIGN: &str = r#"
name = "foreign-20c16w"
description = "an E5 cut to 20 cores and 16 ways, 3 GHz, 50 GB/s: memcached (load step), moses, img-dnn, two batch jobs"
duration_s = 900
tick_ms = 1000
seed = 11
[host]
preset = "xeon-e5-2697v4"
cores = 20
llc_ways = 16
freq_ghz = 3.0
mem_bw_gbps = 50.0
[[service]]
name = "memcached"
model = "memcached"
load = { kind = "steps", steps = [{ at_s = 0, fraction = 0.08 }, { at_s = 450, fraction = 0.12 }, { at_s = 700, fraction = 0.08 }] }
[[service]]
name = "moses"
model = "moses"
load = { kind = "constant", fraction = 0.05 }
[[service]]
name = "img-dnn"
model = "img-dnn"
load = { kind = "diurnal", mean = 0.06, amplitude = 0.02, period_s = 900 }
[[best_effort]]
name = "stream"
model = "stream"
[[best_effort]]
name = "graph"
model = "graph"
"#;

/// A host whose memory is slower and LLC smaller than any preset's.
const SLOW_MEMORY: &str = r#"
name = "slow-memory"
description = "an E5 with 24 cores, 12 ways of a 20 MB LLC and 160 ns memory: xapian, memcached (load step), img-dnn beside a streaming job"
duration_s = 900
tick_ms = 1000
seed = 5
[host]
preset = "xeon-e5-2697v4"
cores = 24
llc_ways = 12
llc_mb = 20.0
mem_latency_ns = 160.0
[[service]]
name = "xapian"
model = "xapian"
load = { kind = "constant", fraction = 0.06 }
[[service]]
name = "memcached"
model = "memcached"
load = { kind = "steps", steps = [{ at_s = 0, fraction = 0.04 }, { at_s = 300, fraction = 0.06 }] }
[[service]]
name = "img-dnn"
model = "img-dnn"
load = { kind = "constant", fraction = 0.03 }
[[best_effort]]
name = "stream"
model = "stream"
"#;

/// The two settings compared: `ml` as before issue 45, and with the posterior.
fn settings() -> [(&'static str, MlConfig); 2] {
    let d = MlConfig::default();
    [
        (
            "ensemble spread (no posterior)",
            MlConfig {
                posterior: false,
                ..d
            },
        ),
        (
            "per-host posterior",
            MlConfig {
                posterior: true,
                ..d
            },
        ),
    ]
}

fn main() -> Result<()> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let part = if args
        .first()
        .is_some_and(|a| a == "builtin" || a == "foreign" || a == "timing")
    {
        args.remove(0)
    } else {
        "all".to_string()
    };
    println!("SIMULATION: every figure below comes from cohabit's simulated host.");
    if part == "timing" {
        return timing();
    }
    if part != "foreign" {
        builtin(args)?;
    }
    if part != "builtin" {
        foreign()?;
    }
    Ok(())
}

/// Eight latency-critical services and a streaming job (`cargo bench --bench ml_decide`'s
/// host), every load times `scale`, on `preset`.
fn eight(preset: &str, scale: f64) -> Result<Arc<Scenario>> {
    let mut text = format!(
        "name = \"eight\"\ndescription = \"8 LC + 1 BE\"\nduration_s = 300\ntick_ms = 1000\nseed = 3\n[host]\npreset = \"{preset}\"\n"
    );
    for (name, f) in [
        ("memcached", 0.05),
        ("xapian", 0.04),
        ("moses", 0.06),
        ("nginx", 0.04),
        ("img-dnn", 0.05),
        ("masstree", 0.05),
        ("specjbb", 0.05),
        ("silo", 0.05),
    ] {
        text += &format!(
            "[[service]]\nname = \"{name}\"\nmodel = \"{name}\"\nload = {{ kind = \"constant\", fraction = {:.3} }}\n",
            f * scale
        );
    }
    text += "[[best_effort]]\nname = \"stream\"\nmodel = \"stream\"\n";
    Ok(Arc::new(Scenario::from_toml(
        &text,
        "eight",
        std::path::Path::new("."),
    )?))
}

/// Decision time of `ml` for eight services with and without the posterior, one run after
/// the other on one thread (the runs interleaved three times, the median of their p99s).
fn timing() -> Result<()> {
    {
        use cohabit_models::posterior::Blr;
        let mut blr = Blr::new(&[0.01; 33]).map_err(|e| anyhow::anyhow!("{e}"))?;
        let z: Vec<f64> = (0..33).map(|i| f64::from(i) / 33.0).collect();
        let t = std::time::Instant::now();
        for i in 0..2000 {
            blr.observe(&z, f64::from(i % 7) * 0.01, 0.01, 0.99)
                .map_err(|e| anyhow::anyhow!("{e}"))?;
        }
        let per = t.elapsed().as_secs_f64() * 1e6 / 2000.0;
        let rows = ndarray::Array2::from_shape_fn((60, 32), |(i, j)| (i * j % 5) as f32 * 0.1);
        let t = std::time::Instant::now();
        for _ in 0..2000 {
            std::hint::black_box(blr.predict_changes(rows.view()));
        }
        let pr = t.elapsed().as_secs_f64() * 1e6 / 2000.0;
        println!("posterior, d = 33: one reading {per:.1} µs; 60 candidates {pr:.1} µs");
    }
    println!(
        "{:<56} {:>7} {:>7} {:>7} {:>7}",
        "case (decision µs)", "p50", "p99", "run_p50", "run_p99"
    );
    for preset in simulate::LAB_PLATFORMS {
        for (case, scale) in [("", 1.0), (" crowded", 3.0)] {
            let sc = eight(preset, scale)?;
            let model = Arc::new(simulate::builtin_model(preset)?);
            for (name, cfg) in settings() {
                let policy = simulate::build_ml_with(&sc, Arc::clone(&model), cfg)?;
                let run =
                    simulate::run_built(&sc, Box::new(policy.clone()), "ml", None, |_| Ok(()))?;
                let mut t = retime(policy, &run.records)
                    .context("the replay did not reproduce the run's plans")?;
                t.sort_by(f64::total_cmp);
                let q = |p| quantile(&t, p).unwrap_or(f64::NAN);
                let s = run.summary;
                println!(
                    "{:<56} {:>7.0} {:>7.0} {:>7.0} {:>7.0}",
                    format!("{preset}{case}, {name}"),
                    q(0.5),
                    q(0.99),
                    s.decision_us_p50,
                    s.decision_us_p99
                );
            }
        }
    }
    Ok(())
}

/// One run's figures: QoS met fraction, best effort against the oracle, decision p99 (µs).
type RunFigures = (f64, f64, f64);

/// The built-in part.
fn builtin(names: Vec<String>) -> Result<()> {
    let mut hosts = Vec::new();
    for name in &simulate::names_or_builtin(names) {
        if let Some(p) = simulate::on_lab_platforms(name).with_context(|| name.clone())? {
            hosts.extend(p);
        }
    }
    let oracle: Vec<f64> = parallel(&hosts, |sc| {
        Ok(simulate::run_oracle(sc, Default::default(), "oracle")?
            .summary
            .be_throughput)
    })?;
    let models: Vec<Arc<Model>> = hosts
        .iter()
        .map(|sc| Ok(Arc::new(simulate::builtin_model(sc.host.preset)?)))
        .collect::<Result<_>>()?;
    println!(
        "{:<32} {:>9} {:>7} {:>7} {:>30} {:>10}",
        "setting", "qos_runs", "qos", "be/or", "worst be/or", "p99 us"
    );
    for (name, cfg) in settings() {
        let work: Vec<(usize, u64)> = (0..hosts.len())
            .flat_map(|h| SEEDS.iter().map(move |s| (h, *s)))
            .collect();
        let figures = parallel(&work, |&(h, seed)| {
            let sc = &hosts[h];
            let policy = simulate::build_ml_with(sc, Arc::clone(&models[h]), cfg)?;
            let run = simulate::run_built(sc, Box::new(policy), "ml", Some(seed), |_| Ok(()))?;
            let s = run.summary;
            Ok((
                s.qos_met_fraction,
                s.be_throughput / oracle[h].max(1e-12),
                s.decision_us_p99,
            ))
        })?;
        let mut per: BTreeMap<String, Vec<RunFigures>> = BTreeMap::new();
        for (&(h, _), f) in work.iter().zip(&figures) {
            let key = format!("{} {}", hosts[h].name, hosts[h].host.preset);
            per.entry(key).or_default().push(*f);
        }
        print_row(name, &figures, &per);
    }
    println!(
        "qos_runs: runs with QoS met in >= 99 % of intervals (of {}); be/or: mean best effort \
         against the oracle's; worst: the scenario and platform with the lowest mean; p99 us: \
         the mean over runs of each run's decision p99.",
        hosts.len() * SEEDS.len()
    );
    Ok(())
}

fn print_row(name: &str, all: &[RunFigures], per: &BTreeMap<String, Vec<RunFigures>>) {
    let n = all.len().max(1) as f64;
    let met = all.iter().filter(|r| r.0 >= 0.99).count();
    let qos = all.iter().map(|r| r.0).sum::<f64>() / n;
    let be = all.iter().map(|r| r.1).sum::<f64>() / n;
    let p99 = all.iter().map(|r| r.2).sum::<f64>() / n;
    let worst = per
        .iter()
        .map(|(k, v)| {
            (
                k,
                v.iter().map(|r| r.1).sum::<f64>() / v.len().max(1) as f64,
            )
        })
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .map_or(String::new(), |(k, m)| format!("{m:.3} {k}"));
    println!("{name:<32} {met:>9} {qos:>7.3} {be:>7.3} {worst:>30} {p99:>10.0}");
    for (k, v) in per {
        let met = v.iter().filter(|r| r.0 >= 0.99).count();
        let be = v.iter().map(|r| r.1).sum::<f64>() / v.len().max(1) as f64;
        println!("    {k:<40} qos_runs {met:>2}/{}  be/or {be:.3}", v.len());
    }
}

/// Per simulated minute of a run: (model-path decisions, decisions, |errors|, intervals
/// meeting QoS, intervals, best effort).
#[derive(Debug, Clone, Default)]
struct Minute {
    model: usize,
    decisions: usize,
    errors: Vec<f64>,
    met: usize,
    intervals: usize,
    be: f64,
}

/// The foreign part: each foreign host.
fn foreign() -> Result<()> {
    for text in [FOREIGN, SLOW_MEMORY] {
        foreign_host(text)?;
    }
    Ok(())
}

/// One foreign host.
fn foreign_host(text: &str) -> Result<()> {
    let sc = Arc::new(Scenario::from_toml(
        text,
        "foreign",
        std::path::Path::new("."),
    )?);
    let oracle = simulate::run_oracle(&sc, Default::default(), "oracle")?;
    let oracle_be = per_minute(&oracle.records, &sc);
    println!(
        "\noracle on {}: QoS {:.3}, best effort {:.3}",
        sc.name, oracle.summary.qos_met_fraction, oracle.summary.be_throughput
    );
    let model = Arc::new(simulate::builtin_model(sc.host.preset)?);
    println!(
        "\nforeign host {} ({} cores, {} ways): per simulated minute, ten seeds",
        sc.name,
        sc.capacity().cores,
        sc.capacity().llc_ways
    );
    println!(
        "{:<32} {:>4} {:>8} {:>9} {:>7} {:>7} {:>7}",
        "setting", "min", "model %", "med |err|", "qos", "be", "be/or"
    );
    for (name, cfg) in settings() {
        let runs = parallel(&SEEDS, |&seed| {
            let policy = simulate::build_ml_with(&sc, Arc::clone(&model), cfg)?;
            let run = simulate::run_built(&sc, Box::new(policy), "ml", Some(seed), |_| Ok(()))?;
            Ok((per_minute(&run.records, &sc), run.summary.qos_met_fraction))
        })?;
        // Whole minutes only (a run of 900 s ends with the first tick of a 16th).
        let minutes = runs
            .iter()
            .map(|r| r.0.iter().take_while(|m| m.intervals >= 30).count())
            .min()
            .unwrap_or(0);
        for m in 0..minutes {
            let mut all = Minute::default();
            for (r, _) in &runs {
                let x = &r[m];
                all.model += x.model;
                all.decisions += x.decisions;
                all.errors.extend(&x.errors);
                all.met += x.met;
                all.intervals += x.intervals;
                all.be += x.be;
            }
            let be_or = all.be / runs.len() as f64 / oracle_be[m].be.max(1e-12);
            println!(
                "{name:<32} {:>4} {:>8.1} {:>9.3} {:>7.3} {:>7.3} {:>7.3}",
                m + 1,
                100.0 * all.model as f64 / all.decisions.max(1) as f64,
                median(&mut all.errors),
                all.met as f64 / all.intervals.max(1) as f64,
                all.be / all.intervals.max(1) as f64,
                be_or
            );
        }
        let qos = runs.iter().map(|r| r.1).sum::<f64>() / runs.len() as f64;
        let half = minutes / 2;
        let be2: f64 = runs
            .iter()
            .map(|(r, _)| r[half..minutes].iter().map(|x| x.be).sum::<f64>())
            .sum::<f64>()
            / runs.len() as f64;
        let or2: f64 = oracle_be[half..minutes].iter().map(|x| x.be).sum();
        println!(
            "{name:<32} whole run: QoS {qos:.3}; best effort in the second half {:.3} of the oracle's",
            be2 / or2.max(1e-12)
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
    let mut out: Vec<Minute> = Vec::new();
    for (i, r) in records.iter().enumerate() {
        let m = usize::try_from(r.observation.t_ms / 60_000).unwrap_or(0);
        if out.len() <= m {
            out.resize(m + 1, Minute::default());
        }
        let x = &mut out[m];
        x.intervals += 1;
        x.met += usize::from(
            targets
                .iter()
                .all(|(s, t)| r.judged_p99_ms(s).is_some_and(|p| p <= *t)),
        );
        x.be += r.truth.as_ref().map_or(0.0, |t| t.be_throughput);
        for (s, t) in &targets {
            if let Some(why) = r.reasons.get(s) {
                x.decisions += 1;
                x.model += usize::from(why.path == DecisionPath::Model);
            }
            let next = records.get(i + 1).and_then(|n| {
                n.observation
                    .services
                    .iter()
                    .find(|o| &o.spec.name == s)
                    .and_then(|o| o.sample.p99_ms)
            });
            if let (Some(p), Some(obs)) = (r.predictions.get(s), next) {
                x.errors.push((p.log_qos_ratio - (obs / t).ln()).abs());
            }
        }
    }
    out
}
