//! Simulation speed: one hour of 1 s ticks with 6 services (4 latency-critical, 2 best
//! effort) per policy, and a full comparison on every built-in scenario.
//!
//! Run with `cargo bench -p cohabit-lab --bench sim_speed`. Prints a table; the
//! numbers to compare are ratios within one run (machines here are noisy).

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use cohabit_lab::simulate::{self, LabPolicy};
use cohabit_sim::scenario::builtin_names;
use cohabit_sim::Scenario;

const HOUR: &str = r#"
name = "bench-hour"
description = "one hour, 4 LC + 2 BE"
duration_s = 3600
tick_ms = 1000
seed = 1
[host]
preset = "xeon-e5-2697v4"
[[service]]
name = "memcached"
model = "memcached"
load = { kind = "diurnal", mean = 0.1, amplitude = 0.04, period_s = 900 }
[[service]]
name = "xapian"
model = "xapian"
load = { kind = "spikes", base = 0.06, peak = 0.12, every_s = 300, duration_s = 30 }
[[service]]
name = "moses"
model = "moses"
load = { kind = "steps", steps = [{ at_s = 0, fraction = 0.12 }, { at_s = 1800, fraction = 0.18 }] }
[[service]]
name = "nginx"
model = "nginx"
load = { kind = "constant", fraction = 0.08 }
[[best_effort]]
name = "stream"
model = "stream"
[[best_effort]]
name = "graph"
model = "graph"
"#;

fn main() {
    let hour =
        Arc::new(Scenario::from_toml(HOUR, "bench-hour", Path::new(".")).expect("bench scenario"));
    println!("Simulated hour, 6 services, 3600 ticks of 1 s (simulation, not hardware):");
    println!(
        "{:<8} {:>10} {:>12} {:>14} {:>9}",
        "policy", "wall_s", "ticks_per_s", "sim_s_per_wall_s", "qos_met"
    );
    for kind in LabPolicy::ALL {
        let t = Instant::now();
        let run = simulate::run_policy(&hour, kind, None, None, |_| Ok(())).expect("run");
        let wall = t.elapsed().as_secs_f64();
        println!(
            "{:<8} {:>10.3} {:>12.0} {:>14.0} {:>9.4}",
            kind.name(),
            wall,
            run.records.len() as f64 / wall,
            hour.duration_s / wall,
            run.summary.qos_met_fraction
        );
    }
    let t = Instant::now();
    for name in builtin_names() {
        let s = Arc::new(Scenario::load(name).expect("built-in"));
        simulate::compare(&s, &LabPolicy::ALL, None, None).expect("compare");
    }
    println!(
        "\n`cohabit compare --scenario all` equivalent (4 policies x 4 scenarios): {:.2} s",
        t.elapsed().as_secs_f64()
    );
}
