//! How much of `ml`'s gap on the crowded hosts is measurement noise (issue 49).
//!
//! `crowd_gap` runs `ml` with every reading exact and its model's spread off, at each
//! scenario's own seed. This runs `ml` over seeds 1..=`CROWD_NOISE_SEEDS` (default 6) of
//! each crowded scenario in five worlds that take away one thing at a time: nothing (as
//! built), the measured p99's own noise, the counters' noise (and their glitches and
//! missing readings), the model's calibrated spread, and the latency window (one interval
//! instead of the scenario's). It prints, per seed and world, the latency-critical services
//! meeting their targets per interval (on the truth), then the mean over the seeds. A world
//! whose mean is well above as-built's names what holds `ml` back; seeds that move both
//! ways name a run whose course a single reading decides.
//!
//! `cargo run --release -p cohabit-lab --example crowd_noise [SCENARIO…]` (simulated; about
//! two minutes for the three default scenarios at six seeds on a 2-CPU machine).

use std::sync::Arc;

use anyhow::{Context, Result};
use cohabit_lab::simulate::{self, LabPolicy};
use cohabit_sim::Scenario;

/// The scenarios run when none is named.
const DEFAULT: [&str; 3] = [
    "crowded-gold",
    "crowded-e5",
    "lab/scenarios/crowded-gold-diurnal.toml",
];

/// The worlds, in column order.
const WORLDS: [&str; 5] = [
    "as built",
    "p99 quiet",
    "counters quiet",
    "spread 0",
    "window 1",
];

/// `ml`'s met/n on `base` in world `k` of [`WORLDS`].
fn run_world(base: &Scenario, k: usize) -> Result<f64> {
    let mut world = base.clone();
    let mut model = simulate::builtin_model(world.host.preset)?;
    match k {
        1 => world.noise.quiet_p99(),
        2 => world.noise.quiet_counters(),
        3 => model.meta.change_sigma_scale = Some(0.0),
        4 => world.noise.latency_window = 1,
        _ => {}
    }
    let run = simulate::run_policy(
        &Arc::new(world),
        LabPolicy::Ml,
        None,
        Some(&Arc::new(model)),
        |_| Ok(()),
    )?;
    // Latency-critical services meeting their targets per interval: the sum of each one's
    // share of intervals met (on the truth).
    Ok(run
        .summary
        .services
        .values()
        .map(|v| v.qos_met_fraction)
        .sum())
}

fn main() -> Result<()> {
    let seeds: u64 = match std::env::var("CROWD_NOISE_SEEDS") {
        Ok(v) => v
            .parse()
            .with_context(|| format!("CROWD_NOISE_SEEDS={v:?} is not a count"))?,
        Err(_) => 6,
    };
    let named: Vec<String> = std::env::args().skip(1).collect();
    let names: Vec<String> = if named.is_empty() {
        DEFAULT.iter().map(ToString::to_string).collect()
    } else {
        named
    };
    println!("SIMULATION: every figure below comes from cohabit's simulated host.");
    println!("ml's latency-critical services meeting their targets per interval, per world");
    let header: String = WORLDS.iter().map(|w| format!("{w:>15}")).collect();
    for name in &names {
        let sc = Scenario::load(name).with_context(|| format!("scenario {name}"))?;
        println!("\n{:<24} {header}", sc.name);
        let mut sums = [0.0; WORLDS.len()];
        for seed in 1..=seeds {
            let base = Scenario { seed, ..sc.clone() };
            let mut row = String::new();
            for (k, sum) in sums.iter_mut().enumerate() {
                let met = run_world(&base, k)?;
                *sum += met;
                row.push_str(&format!("{met:>15.2}"));
            }
            let label = format!("seed {seed}");
            println!("{label:<24} {row}");
        }
        let n = seeds.max(1) as f64;
        let mean: String = sums.iter().map(|s| format!("{:>15.2}", s / n)).collect();
        let label = format!("mean of {seeds}");
        println!("{label:<24} {mean}");
    }
    Ok(())
}
