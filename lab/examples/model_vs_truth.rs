//! The learned model's predicted change against the simulator's truth, for one service
//! (issue 14: where `ml`'s per-service sizing comes from).
//!
//! Runs `ml` on a built-in scenario (E5 platform), takes the observation at a few ticks
//! (a fifth, half and four fifths of the run, or the intervals listed), and for every core
//! count down to four under the allocation in force, at five way counts around it, prints the
//! model's predicted change of ln(p99/target) with its calibrated spread (what `ml`'s
//! search sees before the online correction) beside the true change (the same plan with
//! only that service's allocation changed, laid out as the policies lay out, evaluated
//! noise-free). A candidate is admissible to a service that could only give back when
//! measured + change + 1.0 × spread ≤ ln(0.9).
//!
//! With `--levels` it prints instead, over a grid of cores and ways up to twice and four
//! times those in force (at least [`LEVEL_CORES`] and [`LEVEL_WAYS`]), the model's level
//! prediction of ln(p99/target) with its spread, the same with the reading left out (as if
//! the service had none: the latency features at 0 and their flag off), and the true
//! level. This is what `ml` has to go on for a saturated service, whose change is not
//! anchored (issue 49: whether a service left saturated on a crowded host could be sized
//! from the model).
//!
//! `cargo run --release -p cohabit-lab --example model_vs_truth [--levels] [SCENARIO [SERVICE [INTERVAL,…]]]`
//! (default `parties-mix moses`; simulated, a few seconds).

use std::sync::Arc;

use anyhow::{bail, Context, Result};
use cohabit_core::{Allocation, WayRange};
use cohabit_lab::simulate::{self, LabPolicy};
use cohabit_models::{features, log_qos_ratio, Model, Neighbours, FEATURE_NAMES, N_FEATURES};
use cohabit_policy::{layout, shares_of, HostContext};
use cohabit_sim::{Scenario, TruthModel};
use ndarray::{Array2, ArrayView1};

/// The fewest cores and ways the `--levels` grid reaches.
const LEVEL_CORES: u32 = 8;
const LEVEL_WAYS: u32 = 12;

fn main() -> Result<()> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let levels = args.first().is_some_and(|a| a == "--levels");
    if levels {
        args.remove(0);
    }
    let name = args.first().map_or("parties-mix", String::as_str);
    let svc = args.get(1).map_or("moses", String::as_str);
    let sc = Arc::new(Scenario::load(name).with_context(|| format!("scenario {name}"))?);
    if !sc.services.iter().any(|s| s.spec.name == svc) {
        bail!("scenario {name} has no service {svc}");
    }
    let model = simulate::builtin_model(sc.host.preset)?;
    let run = simulate::run_policy(&sc, LabPolicy::Ml, None, None, |_| Ok(()))?;
    let truth = TruthModel::new(Arc::clone(&sc));
    let ctx = HostContext {
        host: sc.capacity().clone(),
        specs: sc.specs(),
    };
    let host = &ctx.host;
    let n = sc.services.len();
    println!("SIMULATION: every figure below comes from cohabit's simulated host.");
    for idx in intervals(args.get(2), run.records.len())? {
        let obs = &run.records[idx].observation;
        let o = obs
            .services
            .iter()
            .find(|o| o.spec.name == svc)
            .context("service not observed")?;
        let target = o.spec.p99_target_ms().context("not latency-critical")?;
        let Some(&cur) = obs.current.services.get(svc) else {
            continue;
        };
        let Some(measured) = log_qos_ratio(&o.sample, target) else {
            continue;
        };
        let nb = Neighbours::observed(obs, svc, host);
        let loads = truth.loads_at(obs.t_ms as f64 / 1000.0 - 0.5);
        // ln(p99/target) of the service, noise-free, with its allocation at (c, w).
        let true_at = |c: u32, w: u32| -> Option<f64> {
            let mut shares = shares_of(&obs.current);
            let s = shares.get_mut(svc)?;
            (s.cores, s.ways) = (c, w);
            let plan = layout(&ctx, &shares, obs.current.best_effort.mba_pct);
            let (_, g) = truth.evaluate(&plan, &loads, &vec![None; n], &vec![0.0; n]);
            Some((g.p99_ms.get(svc)? / target).ln())
        };
        let base = true_at(cur.cores, cur.llc_ways.count).context("no truth")?;
        println!(
            "\n{name} t={} s: {svc} at {} cores / {} ways, measured p99/target {:.2} (true {:.2})",
            obs.t_ms / 1000,
            cur.cores,
            cur.llc_ways.count,
            measured.exp(),
            base.exp()
        );
        let rows_for = |cands: &[(u32, u32)], blind: bool| {
            let mut rows = Array2::<f32>::zeros((cands.len(), N_FEATURES));
            for (i, &(c, w)) in cands.iter().enumerate() {
                let mut a = cur;
                a.cores = c;
                a.llc_ways = WayRange::new(0, w);
                let mut f = features(host, target, &o.sample, &cur, &a, &nb);
                if blind {
                    f[feature("log_qos_now")] = 0.0;
                    f[feature("has_qos_now")] = 0.0;
                }
                rows.row_mut(i).assign(&ArrayView1::from(&f[..]));
            }
            rows
        };
        if levels {
            print_levels(&model, &level_grid(&cur, host.llc_ways), rows_for, true_at);
            continue;
        }
        println!(
            "{:>6} {:>5} {:>9} {:>7} {:>8} {:>10}",
            "cores", "ways", "model_d", "spread", "true_d", "admissible"
        );
        let cands = candidates(&cur, host.llc_ways);
        let reference = features(host, target, &o.sample, &cur, &cur, &nb);
        let rows = rows_for(&cands, false);
        let (d, s) = model.score_change(ArrayView1::from(&reference[..]), rows.view());
        for (i, &(c, w)) in cands.iter().enumerate() {
            let t = true_at(c, w).map_or(f64::NAN, |v| v - base);
            let pess = measured + f64::from(d[i]) + f64::from(s[i]);
            println!(
                "{c:>6} {w:>5} {:>+9.2} {:>7.2} {t:>+8.2} {:>10}",
                d[i],
                s[i],
                if pess <= 0.9f64.ln() { "yes" } else { "no" }
            );
        }
    }
    Ok(())
}

/// The intervals to look at in a run of `len`: those listed in `list` (comma-separated,
/// past the end taken as the last), or a fifth, half and four fifths of the run.
fn intervals(list: Option<&String>, len: usize) -> Result<Vec<usize>> {
    Ok(match list {
        Some(list) => list
            .split(',')
            .map(|t| {
                t.trim()
                    .parse::<usize>()
                    .map(|t| t.min(len.saturating_sub(1)))
            })
            .collect::<Result<_, _>>()
            .context("intervals: a comma-separated list of interval numbers")?,
        None => vec![len / 5, len / 2, len * 4 / 5],
    })
}

/// The `--levels` table for the candidates `cands`: the model's level and spread on the
/// rows `rows_for` makes (with the reading, and without it when its flag is set) beside
/// `true_at`'s true level.
fn print_levels(
    model: &Model,
    cands: &[(u32, u32)],
    rows_for: impl Fn(&[(u32, u32)], bool) -> Array2<f32>,
    true_at: impl Fn(u32, u32) -> Option<f64>,
) {
    println!(
        "{:>6} {:>5} {:>8} {:>7} {:>10} {:>7} {:>7}",
        "cores", "ways", "model", "spread", "no_reading", "spread", "true"
    );
    let (m, s) = model.score(rows_for(cands, false).view());
    let (mb, sb) = model.score(rows_for(cands, true).view());
    for (i, &(c, w)) in cands.iter().enumerate() {
        let t = true_at(c, w).unwrap_or(f64::NAN);
        println!(
            "{c:>6} {w:>5} {:>+8.2} {:>7.2} {:>+10.2} {:>7.2} {t:>+7.2}",
            m[i], s[i], mb[i], sb[i]
        );
    }
}

/// Index of the feature `name` in the model's input.
fn feature(name: &str) -> usize {
    FEATURE_NAMES
        .iter()
        .position(|f| *f == name)
        .unwrap_or_else(|| panic!("no feature {name}"))
}

/// The `--levels` grid: six core counts from 1 to twice those in force (at least
/// [`LEVEL_CORES`]) at six way counts from 1 to four times those in force (at least
/// [`LEVEL_WAYS`]), at most `llc_ways`; distinct, ways first.
fn level_grid(cur: &Allocation, llc_ways: u32) -> Vec<(u32, u32)> {
    let spread = |top: u32| -> Vec<u32> {
        let mut v: Vec<u32> = (0..6u32).map(|k| 1 + (top - 1) * k / 5).collect();
        v.dedup();
        v
    };
    let cores = spread((2 * cur.cores).max(LEVEL_CORES));
    let ways = spread((4 * cur.llc_ways.count).max(LEVEL_WAYS).min(llc_ways));
    ways.iter()
        .flat_map(|&w| cores.iter().map(move |&c| (c, w)))
        .collect()
}

/// (cores, ways) to compare with `cur`: every core count down to four under it, at five
/// way counts around it (at most `llc_ways`).
fn candidates(cur: &Allocation, llc_ways: u32) -> Vec<(u32, u32)> {
    let w0 = cur.llc_ways.count;
    let mut cands = Vec::new();
    let mut ways: Vec<u32> = [w0.saturating_sub(4).max(1), w0, w0 + 2, w0 + 4, w0 + 6]
        .iter()
        .map(|w| (*w).min(llc_ways))
        .collect();
    ways.dedup();
    for w in ways {
        for c in cur.cores.saturating_sub(4).max(1)..=cur.cores {
            cands.push((c, w));
        }
    }
    cands
}
