//! How much of `ml`'s best-effort gap to the oracle is measurement noise and how much is
//! the model's spread (issue 14, item 4).
//!
//! `ml` sizes each service so that its pessimistic prediction (mean plus `k_sigma` spreads)
//! stays under the margin. The spread has two parts: the measurement noise of the reading
//! each prediction is anchored on, and the model's calibrated spread on a change
//! (`change_sigma_scale` times the ensemble's disagreement). This runs `ml` on each
//! built-in CPU scenario (or those named as arguments), on the E5 and the Gold platform,
//! over ten seeds, in seven worlds: as built (each p99 resting on up to three intervals'
//! requests, the latency window); with each p99 resting on one interval's requests (as
//! before the window); with the model's calibrated spread halved; with the measured p99's
//! own noise off (`p99_sigma` 0: the p99 of a window resting on few requests stays a
//! little noisy); with the counters quiet (no counter noise, no glitches, no missing
//! readings); with both quiet; and with both quiet and the model's calibrated spread off
//! (each prediction anchored on a reading is the model's mean, give or take the
//! measurement noise `ml` learns, which is then small): `ml`'s ceiling with perfect
//! readings and no caution, what its search, packer and layouts allow at best. It prints,
//! per world, the runs with QoS met in at least 99 % of intervals, the mean QoS and the
//! mean best-effort throughput against the oracle (same seed; the oracle plans on the
//! truth, so the noise does not touch it).
//!
//! `cargo run --release -p cohabit-lab --example noise_gap [SCENARIO…]` (simulated; about
//! five minutes for the five CPU scenarios on a 2-CPU machine).

use std::sync::Arc;

use anyhow::{Context, Result};
use cohabit_lab::simulate::{self, LabPolicy};
use cohabit_models::Model;
use cohabit_sim::Scenario;

/// Seeds each world is run with.
const SEEDS: [u64; 10] = [0, 101, 202, 303, 404, 505, 606, 707, 808, 909];

/// What a world quiets: the p99's own noise.
const P99: u8 = 1;
/// What a world quiets: counter noise, glitches and missing readings.
const COUNTERS: u8 = 2;

/// The worlds: (name, what is quiet, factor on the model's calibrated spread, intervals
/// one measured p99 may span; the built-in scenarios' window is 3).
const WORLDS: [(&str, u8, f32, u32); 7] = [
    ("as built", 0, 1.0, 3),
    ("window 1", 0, 1.0, 1),
    ("spread/2", 0, 0.5, 3),
    ("p99 quiet", P99, 1.0, 3),
    ("counters quiet", COUNTERS, 1.0, 3),
    ("no noise", P99 | COUNTERS, 1.0, 3),
    ("no noise, spread 0", P99 | COUNTERS, 0.0, 3),
];

/// Per world: (runs with QoS >= 0.99, QoS sum, best effort against the oracle sum).
type Tally = [(usize, f64, f64); WORLDS.len()];

/// Runs every world and seed on `sc`.
fn tally(sc: &Scenario) -> Result<Tally> {
    let model = simulate::builtin_model(sc.host.preset)?;
    let scale = model.meta.change_sigma_scale.unwrap_or(1.0);
    // Each world's scenario and model, built once for every seed.
    let worlds: Vec<(Arc<Scenario>, Arc<Model>)> = WORLDS
        .iter()
        .map(|&(_, quiet, factor, window)| {
            let mut world = sc.clone();
            world.noise.latency_window = window;
            if quiet & P99 != 0 {
                world.noise.quiet_p99();
            }
            if quiet & COUNTERS != 0 {
                world.noise.quiet_counters();
            }
            let mut m = model.clone();
            m.meta.change_sigma_scale = Some(scale * factor);
            (Arc::new(world), Arc::new(m))
        })
        .collect();
    let own = Arc::new(sc.clone());
    let mut out: Tally = [(0, 0.0, 0.0); WORLDS.len()];
    for seed in SEEDS {
        let oracle = simulate::run_policy(&own, LabPolicy::Oracle, Some(seed), None, |_| Ok(()))?;
        let obe = oracle.summary.be_throughput.max(1e-9);
        for (k, (world, m)) in worlds.iter().enumerate() {
            let run = simulate::run_policy(world, LabPolicy::Ml, Some(seed), Some(m), |_| Ok(()))?;
            let q = run.summary.qos_met_fraction;
            out[k].0 += usize::from(q >= 0.99);
            out[k].1 += q;
            out[k].2 += run.summary.be_throughput / obe;
        }
    }
    Ok(out)
}

fn main() -> Result<()> {
    let names = simulate::names_or_builtin(std::env::args().skip(1).collect());
    println!("SIMULATION: every figure below comes from cohabit's simulated host.");
    println!(
        "per world: runs with QoS >= 0.99 of {}, mean QoS, mean best effort / oracle",
        SEEDS.len()
    );
    print!("{:<13} {:<15}", "scenario", "platform");
    for (name, _, _, _) in WORLDS {
        print!(" {name:>20}");
    }
    println!();
    let mut jobs = Vec::new();
    for name in &names {
        if let Some(platforms) =
            simulate::on_lab_platforms(name).with_context(|| format!("scenario {name}"))?
        {
            jobs.extend(platforms.iter().map(|sc| (**sc).clone()));
        }
    }
    let n = jobs.len() as f64;
    let results: Vec<Result<Tally>> = std::thread::scope(|s| {
        let handles: Vec<_> = jobs
            .chunks(jobs.len().div_ceil(2).max(1))
            .map(|chunk| s.spawn(move || chunk.iter().map(tally).collect::<Vec<_>>()))
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("a worker panicked"))
            .collect()
    });
    let mut total: Tally = [(0, 0.0, 0.0); WORLDS.len()];
    for (sc, t) in jobs.iter().zip(results) {
        let t = t?;
        print!("{:<13} {:<15}", sc.name, sc.host.preset);
        for (k, (ok, q, be)) in t.iter().enumerate() {
            let runs = SEEDS.len() as f64;
            print!(" {:>20}", format!("{ok} {:.3} {:.3}", q / runs, be / runs));
            total[k].0 += ok;
            total[k].1 += q / runs;
            total[k].2 += be / runs;
        }
        println!();
    }
    print!("{:<29}", "all");
    for (ok, q, be) in total {
        print!(" {:>20}", format!("{ok} {:.3} {:.3}", q / n, be / n));
    }
    println!();
    Ok(())
}
