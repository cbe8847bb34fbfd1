//! The published Bayesian-optimisation baseline against `ml` and `parties` (issue 14, item 4).
//!
//! Item 4 cites CLITE (HPCA'20: 0.89 of an oracle's best-effort throughput on its mixes) as
//! the state of the art `ml` is measured against. `clite` is our implementation of its idea
//! (`cohabit_policy::ClitePolicy`). This runs, on each built-in CPU scenario (or those named
//! as arguments) on the E5 and the Gold platform, `parties`, `clite` and `ml` over three
//! seeds and the oracle, in two worlds: the scenario as built, whose loads step, swing and
//! spike, and the same scenario with every load held at its mean over the run (*steady*:
//! CLITE's paper evaluates fixed loads; a search then runs once). Per policy it prints the
//! mean QoS (share of intervals with every target met), the runs meeting QoS in at least 99 %
//! of intervals, and the mean best effort against the oracle's in the same world.
//!
//! `cargo run --release -p cohabit-lab --example clite_vs_ml [SCENARIO…]` (simulated; about
//! 20 s for the five CPU scenarios on a 2-CPU machine).

use std::sync::Arc;

use anyhow::{Context, Result};
use cohabit_lab::metrics::be_vs_oracle;
use cohabit_lab::oracle::OracleConfig;
use cohabit_lab::simulate::{self, LabPolicy};
use cohabit_sim::trace::LoadTrace;
use cohabit_sim::Scenario;

/// Seed offsets each policy runs with (added to the scenario's own seed).
const SEEDS: [u64; 3] = [0, 101, 202];

/// The policies compared with the oracle.
const POLICIES: [LabPolicy; 3] = [LabPolicy::Parties, LabPolicy::Clite, LabPolicy::Ml];

/// `sc` with every service's load held at its mean over the run (sampled each second).
fn steady(sc: &Scenario) -> Scenario {
    let mut out = sc.clone();
    let seconds = sc.duration_s.max(1.0);
    for s in &mut out.services {
        if let Some(trace) = &s.load {
            let n = seconds.ceil();
            let mut sum = 0.0;
            let mut t = 0.0;
            while t < n {
                sum += trace.at(t);
                t += 1.0;
            }
            s.load = Some(LoadTrace::Constant { fraction: sum / n });
        }
    }
    out.name = format!("{}-steady", sc.name);
    out
}

fn main() -> Result<()> {
    let names = simulate::names_or_builtin(std::env::args().skip(1).collect());
    println!("SIMULATION: every figure below comes from cohabit's simulated host.");
    println!(
        "per policy: mean QoS / runs with QoS >= 0.99 of {} / mean best effort against the \
         oracle in the same world",
        SEEDS.len()
    );
    print!("{:<13} {:<15} {:<7}", "scenario", "platform", "world");
    for p in POLICIES {
        print!(" {:>20}", p.name());
    }
    println!();
    let mut totals = vec![(0.0, 0usize, 0.0, 0usize); POLICIES.len() * 2];
    for name in &names {
        let platforms =
            simulate::on_lab_platforms_or_skip(name).with_context(|| format!("scenario {name}"))?;
        for sc in platforms {
            for (w, world) in [(0, Arc::clone(&sc)), (1, Arc::new(steady(&sc)))] {
                let oracle = simulate::run_oracle(&world, OracleConfig::default(), "oracle")?;
                print!(
                    "{:<13} {:<15} {:<7}",
                    name,
                    sc.host.preset,
                    if w == 0 { "as is" } else { "steady" }
                );
                for (i, p) in POLICIES.into_iter().enumerate() {
                    let (mut qos, mut met, mut be) = (0.0, 0, 0.0);
                    for off in SEEDS {
                        let run =
                            simulate::run_policy(&world, p, Some(sc.seed + off), None, |_| Ok(()))?;
                        let q = run.summary.qos_met_fraction;
                        qos += q;
                        met += usize::from(q >= 0.99);
                        be += be_vs_oracle(run.summary.be_throughput, oracle.summary.be_throughput)
                            .unwrap_or(0.0);
                    }
                    let n = SEEDS.len() as f64;
                    print!(" {:>20}", format!("{:.3} / {met} / {:.3}", qos / n, be / n));
                    let t = &mut totals[w * POLICIES.len() + i];
                    t.0 += qos;
                    t.1 += met;
                    t.2 += be;
                    t.3 += SEEDS.len();
                }
                println!();
            }
        }
    }
    for (w, world) in ["as is", "steady"].iter().enumerate() {
        print!("{:<29} {:<7}", "all", world);
        for i in 0..POLICIES.len() {
            let t = totals[w * POLICIES.len() + i];
            let n = t.3.max(1) as f64;
            print!(
                " {:>20}",
                format!("{:.3} / {}/{} / {:.3}", t.0 / n, t.1, t.3, t.2 / n)
            );
        }
        println!();
    }
    Ok(())
}
