//! What a controller that knows the physics but not the future can reach (issue 14, item 4).
//!
//! The oracle plans each interval for that interval's own loads: it knows the future. Any
//! real controller decides from what the interval that just ended measured. This runs, on
//! each built-in CPU scenario (or those named as arguments) on the E5 and the Gold platform
//! with the scenario's seed, the oracle, the same oracle without foresight (it plans for the
//! last interval's loads, still on the true, noise-free physics) aiming at several fractions
//! of each target, and `ml`; it prints each run's QoS (share of intervals with every target
//! met) and best-effort throughput against the oracle, and the *causal reference*: the most
//! best effort an aim without foresight reaches with QoS met in at least 99 % of intervals.
//!
//! The causal reference is not a bound (a controller could aim per service, or lean on
//! the scenario's load pattern), but it shows how much of `ml`'s gap to the oracle is the
//! price of not knowing the next interval's load, which no controller avoids, rather than
//! of `ml`'s model and noisy measurements.
//!
//! `cargo run --release -p cohabit-lab --example causal_bound [SCENARIO…]` (simulated;
//! about 12 minutes for the five CPU scenarios on both platforms on a 2-CPU machine).

use anyhow::{Context, Result};
use cohabit_lab::metrics::be_vs_oracle;
use cohabit_lab::oracle::OracleConfig;
use cohabit_lab::simulate::{self, LabPolicy, SimRun};

/// Fractions of each target the oracle without foresight aims at.
const AIMS: [f64; 6] = [0.97, 0.93, 0.9, 0.85, 0.8, 0.7];

fn main() -> Result<()> {
    let names = simulate::names_or_builtin(std::env::args().skip(1).collect());
    println!("SIMULATION: every figure below comes from cohabit's simulated host.");
    println!(
        "QoS / best effort against the oracle; `causal` is the most best effort an aim without \
         foresight reaches at QoS >= 0.99"
    );
    print!("{:<13} {:<15} {:>13} ", "scenario", "platform", "ml");
    for aim in AIMS {
        print!("{:>13} ", format!("no-fs@{aim:.2}"));
    }
    println!("{:>7} {:>9}", "causal", "ml/causal");
    for name in &names {
        let platforms =
            simulate::on_lab_platforms_or_skip(name).with_context(|| format!("scenario {name}"))?;
        for sc in platforms {
            let full = simulate::run_oracle(&sc, OracleConfig::default(), "oracle")?;
            let vs = |r: &SimRun| be_vs_oracle(r.summary.be_throughput, full.summary.be_throughput);
            let cell = |r: &SimRun| {
                format!(
                    "{:.3}/{}",
                    r.summary.qos_met_fraction,
                    vs(r).map_or_else(|| "-".to_string(), |v| format!("{v:.2}"))
                )
            };
            let ml = simulate::run_policy(&sc, LabPolicy::Ml, None, None, |_| Ok(()))?;
            print!("{:<13} {:<15} {:>13} ", name, sc.host.preset, cell(&ml));
            let mut causal: Option<f64> = None;
            for aim in AIMS {
                let run = simulate::run_oracle(
                    &sc,
                    OracleConfig {
                        target_fraction: aim,
                        foresight: false,
                        ..OracleConfig::default()
                    },
                    "oracle without foresight",
                )?;
                print!("{:>13} ", cell(&run));
                if run.summary.qos_met_fraction >= 0.99 {
                    if let Some(v) = vs(&run) {
                        causal = Some(causal.map_or(v, |c| c.max(v)));
                    }
                }
            }
            let ml_vs = vs(&ml);
            println!(
                "{:>7} {:>9}",
                causal.map_or_else(|| "none".to_string(), |c| format!("{c:.2}")),
                match (ml_vs, causal) {
                    (Some(m), Some(c)) if c > 0.0 => format!("{:.2}", m / c),
                    _ => "-".to_string(),
                }
            );
        }
    }
    Ok(())
}
