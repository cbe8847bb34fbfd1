//! Decision time of the `ml` policy for 8 latency-critical services and a best-effort job
//! on the simulated Xeon E5-2697 v4 (target: p99 under 1 ms per tick), with PARTIES beside
//! it for the ratio. Every `ml` decision here runs the full search for every service.
//!
//! Run with `cargo bench -p cohabit-lab --bench ml_decide`.

use std::sync::Arc;

use cohabit_core::Collector;
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

fn decide(c: &mut Criterion) {
    let sc =
        Arc::new(Scenario::from_toml(EIGHT, "bench", std::path::Path::new(".")).expect("scenario"));
    let ctx = HostContext {
        host: sc.capacity().clone(),
        specs: sc.specs(),
    };
    let model = Arc::new(cohabit_models::builtin("xeon-e5-2697v4").unwrap().unwrap());
    let mut ml = MlPolicy::new(ctx.clone(), model, MlConfig::default());
    let initial = ml.initial().plan;
    let mut host = SimulatedHost::launch(Arc::clone(&sc), &initial, None).expect("launch");
    // A few ticks so the policy has history (bias, spreads) as it would in a run.
    for _ in 0..5 {
        control::step(&mut host, &mut ml, false).expect("tick");
    }
    let obs = host.collect().expect("collect");
    c.bench_function("ml decide, 8 LC services", |b| {
        b.iter_batched(
            || ml.clone(),
            |mut p| black_box(p.decide(black_box(&obs), obs.t_ms)),
            BatchSize::SmallInput,
        )
    });
    let mut parties = PartiesPolicy::new(ctx, PartiesConfig::default());
    parties.initial();
    c.bench_function("parties decide, 8 LC services", |b| {
        b.iter_batched(
            || parties.clone(),
            |mut p| black_box(p.decide(black_box(&obs), obs.t_ms)),
            BatchSize::SmallInput,
        )
    });
}

criterion_group!(benches, decide);
criterion_main!(benches);
