//! Decision time of the `ml` policy for 8 latency-critical services and a best-effort job
//! on the simulated Xeon E5-2697 v4 and Xeon Gold 6338 (target: p99 under 1 ms per tick),
//! with PARTIES beside it (on the same observation) for the ratio. Every `ml` decision here
//! runs the full search for every service. The `crowded` cases load every service 3×
//! higher, so services are over their margins and `ml` also plans the pool's throttled MBA
//! levels (on the Gold all 8 are short of their needs: two levels, the level in force and
//! the minimum).
//!
//! Run with `cargo bench -p cohabit-lab --bench ml_decide`.

use std::sync::Arc;

use cohabit_core::{Collector, Observation};
use cohabit_policy::control;
use cohabit_policy::{HostContext, MlConfig, MlPolicy, PartiesConfig, PartiesPolicy, Policy};
use cohabit_sim::{Scenario, SimulatedHost};
use criterion::{black_box, criterion_group, criterion_main, BatchSize, Criterion};

const EIGHT: &str = r#"
name = "bench-eight"
description = "8 LC + 1 BE"
duration_s = 60
tick_ms = 1000
seed = 3
[host]
preset = "xeon-e5-2697v4"
[[service]]
name = "memcached"
model = "memcached"
load = { kind = "constant", fraction = 0.05 }
[[service]]
name = "xapian"
model = "xapian"
load = { kind = "constant", fraction = 0.04 }
[[service]]
name = "moses"
model = "moses"
load = { kind = "constant", fraction = 0.06 }
[[service]]
name = "nginx"
model = "nginx"
load = { kind = "constant", fraction = 0.04 }
[[service]]
name = "img-dnn"
model = "img-dnn"
load = { kind = "constant", fraction = 0.05 }
[[service]]
name = "masstree"
model = "masstree"
load = { kind = "constant", fraction = 0.05 }
[[service]]
name = "specjbb"
model = "specjbb"
load = { kind = "constant", fraction = 0.05 }
[[service]]
name = "silo"
model = "silo"
load = { kind = "constant", fraction = 0.05 }
[[best_effort]]
name = "stream"
model = "stream"
"#;

/// The eight-service scenario on `preset`, every load times `scale`.
fn scenario(preset: &str, scale: f64) -> Arc<Scenario> {
    let mut text = EIGHT.replace("xeon-e5-2697v4", preset);
    for f in ["0.04", "0.05", "0.06"] {
        let v: f64 = f.parse().expect("fraction");
        text = text.replace(
            &format!("fraction = {f} "),
            &format!("fraction = {:.3} ", v * scale),
        );
    }
    Arc::new(Scenario::from_toml(&text, "bench", std::path::Path::new(".")).expect("scenario"))
}

/// `ml` after a few ticks of `sc` (so it has history: bias, spreads, as in a run), the
/// observation it decides on next, and the host context.
fn warmed(sc: &Arc<Scenario>, model_name: &str) -> (MlPolicy, Observation, HostContext) {
    let ctx = HostContext {
        host: sc.capacity().clone(),
        specs: sc.specs(),
    };
    let model = Arc::new(cohabit_models::builtin(model_name).unwrap().unwrap());
    let mut ml = MlPolicy::new(ctx.clone(), model, MlConfig::default());
    let initial = ml.initial().plan;
    let mut host = SimulatedHost::launch(Arc::clone(sc), &initial, None).expect("launch");
    for _ in 0..5 {
        control::step(&mut host, &mut ml, false).expect("tick");
    }
    let obs = host.collect().expect("collect");
    (ml, obs, ctx)
}

fn decide(c: &mut Criterion) {
    for (platform, model) in [
        ("xeon-e5-2697v4", "xeon-e5-2697v4"),
        ("xeon-gold-6338", "xeon-gold-6338"),
    ] {
        for (case, scale) in [("", 1.0), (" crowded", 3.0)] {
            let sc = scenario(platform, scale);
            let (ml, obs, ctx) = warmed(&sc, model);
            c.bench_function(
                &format!("ml decide, 8 LC services, {platform}{case}"),
                |b| {
                    b.iter_batched(
                        || ml.clone(),
                        |mut p| black_box(p.decide(black_box(&obs), obs.t_ms)),
                        BatchSize::SmallInput,
                    )
                },
            );
            {
                let mut parties = PartiesPolicy::new(ctx, PartiesConfig::default());
                parties.initial();
                let name = format!("parties decide, 8 LC services, {platform}{case}");
                c.bench_function(&name, |b| {
                    b.iter_batched(
                        || parties.clone(),
                        |mut p| black_box(p.decide(black_box(&obs), obs.t_ms)),
                        BatchSize::SmallInput,
                    )
                });
            }
        }
    }
}

criterion_group!(benches, decide);
criterion_main!(benches);
