//! The `ml` policy end to end on the simulator: every figure is deterministic for a seed,
//! so the bounds below are regression guards, not statistics.

use std::sync::Arc;

use cohabit_core::{DecisionPath, DecisionRecord, WayRange};
use cohabit_lab::metrics;
use cohabit_lab::simulate::{self, LabPolicy};
use cohabit_models::Model;
use cohabit_policy::control;
use cohabit_policy::{HostContext, MlConfig, MlPolicy, Policy};
use cohabit_sim::scenario::{builtin_names, Telemetry};
use cohabit_sim::{Scenario, SimulatedHost};

fn ctx(sc: &Scenario) -> HostContext {
    HostContext {
        host: sc.capacity().clone(),
        specs: sc.specs(),
    }
}

/// Runs `policy` on `sc` and returns every record.
fn run(sc: &Arc<Scenario>, policy: &mut dyn Policy, ticks: u64) -> Vec<DecisionRecord> {
    let initial = policy.initial().plan;
    let mut host = SimulatedHost::launch(Arc::clone(sc), &initial, None).unwrap();
    let mut records = Vec::new();
    control::run(&mut host, policy, ticks, |r| {
        records.push(r);
        Ok(())
    })
    .unwrap();
    records
}

/// True when every latency-critical service met its target in the record's interval.
fn met(sc: &Scenario, r: &DecisionRecord) -> bool {
    let truth = r.truth.as_ref().unwrap();
    sc.services
        .iter()
        .filter_map(|s| s.spec.p99_target_ms().map(|t| (&s.spec.name, t)))
        .all(|(n, t)| truth.p99_ms[n] <= t)
}

#[test]
fn ml_keeps_qos_on_every_scenario_with_fewer_actuations_than_parties() {
    for name in builtin_names() {
        let sc = Arc::new(Scenario::load(name).unwrap());
        let rows = simulate::compare(&sc, &[LabPolicy::Parties, LabPolicy::Ml], None, None)
            .unwrap()
            .into_iter()
            .map(|r| r.summary)
            .collect::<Vec<_>>();
        let (parties, ml) = (&rows[0], &rows[1]);
        assert_eq!(ml.policy, "ml");
        assert!(ml.qos_met_fraction >= 0.97, "{name}: {ml:?}");
        assert!(
            ml.qos_met_fraction >= parties.qos_met_fraction,
            "{name}: ml {} parties {}",
            ml.qos_met_fraction,
            parties.qos_met_fraction
        );
        assert!(
            ml.actuations < parties.actuations,
            "{name}: ml {} parties {}",
            ml.actuations,
            parties.actuations
        );
        if let Some(c) = ml.convergence_intervals_p50 {
            assert!(c <= 3.0, "{name}: convergence {c}");
        }
    }
}

#[test]
fn every_ml_plan_is_valid_with_disjoint_way_ranges_and_says_why() {
    for name in builtin_names() {
        let sc = Arc::new(Scenario::load(name).unwrap());
        let model = Arc::new(simulate::builtin_model(sc.host.preset).unwrap());
        let c = ctx(&sc);
        let mut ml = MlPolicy::new(c.clone(), model, MlConfig::default());
        for r in run(&sc, &mut ml, 120) {
            r.plan.validate(sc.capacity(), &sc.specs()).unwrap();
            // Services beyond the CLOSIDs have exactly the pool's range; the others have
            // ranges of their own, disjoint from each other's (and from the pool's when CPU
            // jobs run there), or exactly the pool's (a cache-insensitive service there).
            let pool = r.plan.best_effort.llc_ways;
            let (sharing, isolated): (Vec<_>, Vec<_>) = r
                .plan
                .services
                .iter()
                .partition(|(n, a)| c.shares_pool_group(n) || a.llc_ways == pool);
            for (n, a) in &sharing {
                assert_eq!(a.llc_ways, pool, "{name}: {n} shares the pool's group");
                if c.shares_pool_group(n) {
                    assert_eq!(a.mba_pct, r.plan.best_effort.mba_pct, "{name}: {n}");
                }
            }
            let mut ranges: Vec<WayRange> = isolated.iter().map(|(_, a)| a.llc_ways).collect();
            // Overload rule (DESIGN §5): the pool yields first. It keeps at least one way
            // (CAT refuses an empty mask), so it may overlap latency-critical ranges only
            // when those leave it no way of its own.
            let lc_ways: u32 = ranges.iter().map(|r| r.count).sum();
            let pool_yields = lc_ways + pool.count > sc.capacity().llc_ways;
            if c.has_cpu_best_effort() && !pool_yields {
                ranges.push(pool);
            }
            for (i, a) in ranges.iter().enumerate() {
                for b in &ranges[i + 1..] {
                    assert!(!a.overlaps(b), "{name}: {a:?} overlaps {b:?}");
                }
            }
            for s in sc.specs().iter().filter(|s| s.is_latency_critical()) {
                let why = &r.reasons[&s.name];
                assert!(
                    matches!(why.path, DecisionPath::Model | DecisionPath::Fallback),
                    "{name}: {why}"
                );
            }
        }
    }
}

#[test]
fn on_a_12_way_host_cache_insensitive_services_run_on_the_pools_ways_at_full_bandwidth() {
    // Five services and a graph job on the Gold's 12 ways. The services to which ways do
    // not matter go to the pool's ways (in groups of their own, so at full bandwidth
    // however the pool is throttled), and the graph job gains. The same runs without the
    // option are the reference, over four seeds of the measurement noise: one run's
    // trajectory (who held which ways when the host first filled) can decide its best effort
    // either way, the mean over seeds is what the option does. `few-closids` on the Gold,
    // with the Gold's 16 CLOSIDs instead of the scenario's 4 (under which three of the
    // services share the pool's group whatever the option says).
    let base = {
        let mut sc = Scenario::load("few-closids")
            .unwrap()
            .on_platform("xeon-gold-6338")
            .unwrap();
        sc.host.capacity.closids = 16;
        sc
    };
    let c = ctx(&base);
    let model = Arc::new(simulate::builtin_model(base.host.preset).unwrap());
    let mut on_pool = 0;
    let (mut be_on, mut be_off, mut qos_on, mut qos_off) = (0.0, 0.0, 0.0, 0.0);
    let seeds = [13, 114, 215, 316];
    for seed in seeds {
        let sc = Arc::new(Scenario {
            seed,
            ..base.clone()
        });
        let run_with = |cfg: MlConfig| {
            run(
                &sc,
                &mut MlPolicy::new(c.clone(), Arc::clone(&model), cfg),
                600,
            )
        };
        let on = run_with(MlConfig::default());
        let off = run_with(MlConfig {
            pool_ways_for_insensitive: false,
            ..MlConfig::default()
        });
        for r in &on {
            r.plan.validate(sc.capacity(), &sc.specs()).unwrap();
            let pool = r.plan.best_effort;
            for (n, a) in &r.plan.services {
                if a.llc_ways == pool.llc_ways && !c.shares_pool_group(n) {
                    on_pool += 1;
                    assert_eq!(a.mba_pct, 100, "{n}");
                }
            }
        }
        let mean = |records: &[DecisionRecord], f: &dyn Fn(&DecisionRecord) -> f64| {
            records.iter().map(f).sum::<f64>() / records.len() as f64
        };
        let be = |r: &DecisionRecord| r.truth.as_ref().unwrap().be_throughput;
        let qos = |r: &DecisionRecord| f64::from(u8::from(met(&sc, r)));
        be_on += mean(&on, &be);
        be_off += mean(&off, &be);
        qos_on += mean(&on, &qos);
        qos_off += mean(&off, &qos);
    }
    assert!(
        on_pool >= 600 * seeds.len(),
        "{on_pool} service-intervals on the pool's ways"
    );
    assert!(
        be_on > 1.05 * be_off,
        "best effort {be_on:.3} with, {be_off:.3} without (sums over the seeds)"
    );
    let n = seeds.len() as f64;
    assert!(qos_on / n >= qos_off / n - 0.01, "{qos_on} {qos_off}");
}

#[test]
fn services_are_placed_from_the_model_at_the_first_measurement() {
    let sc = Arc::new(Scenario::load("parties-mix").unwrap());
    let model = Arc::new(simulate::builtin_model(sc.host.preset).unwrap());
    let mut ml = MlPolicy::new(ctx(&sc), model, MlConfig::default());
    let records = run(&sc, &mut ml, 3);
    let first = &records[0];
    let placed: Vec<&String> = first
        .reasons
        .iter()
        .filter(|(_, why)| why.path == DecisionPath::Model && why.text.starts_with("placed"))
        .map(|(n, _)| n)
        .collect();
    assert!(placed.len() >= 2, "{:?}", first.reasons);
    // Placement moves straight off the fair share, several units at once (no ramp of one
    // unit per interval), and records what the model expects.
    let mut moved = 0;
    for n in placed {
        let (before, after) = (
            first.observation.current.services[n],
            first.plan.services[n],
        );
        moved += before.cores.abs_diff(after.cores)
            + before.llc_ways.count.abs_diff(after.llc_ways.count);
        assert!(
            first.predictions.contains_key(n),
            "a placement records its prediction"
        );
    }
    assert!(moved >= 4, "placement moved only {moved} units in all");
}

#[test]
fn a_gpu_share_changes_rarely_and_never_oversubscribes_the_gpu() {
    let sc = Arc::new(Scenario::load("gpu-inference").unwrap());
    let model = Arc::new(simulate::builtin_model(sc.host.preset).unwrap());
    let mut ml = MlPolicy::new(ctx(&sc), model, MlConfig::default());
    let records = run(&sc, &mut ml, sc.ticks());
    let mut restarts = 0;
    for r in &records {
        let sum: u32 = r
            .plan
            .services
            .values()
            .filter_map(|a| a.gpu_mps_pct)
            .map(u32::from)
            .sum();
        assert!(sum <= 99, "LC shares {sum} leave the pool less than 1 %");
        restarts += r
            .changes
            .iter()
            .filter(|c| c.group != cohabit_core::BEST_EFFORT_GROUP)
            .filter(|c| c.resource == cohabit_core::Resource::GpuShare)
            .count();
        // While a client restarts its published share stays put.
        for o in r.observation.latency_critical() {
            let published = r.observation.current.services[&o.spec.name].gpu_mps_pct;
            if o.gpu_mps_effective_pct != published {
                assert_eq!(r.plan.services[&o.spec.name].gpu_mps_pct, published);
            }
        }
    }
    assert!(restarts <= 6, "{restarts} GPU client restarts in 600 s");
    let met = records.iter().filter(|r| met(&sc, r)).count();
    assert!(
        met * 100 >= records.len() * 98,
        "{met} of {}",
        records.len()
    );
}

#[test]
fn a_wrong_model_is_caught_and_the_fallback_restores_qos_within_bounded_intervals() {
    // Random weights: predictions that have nothing to do with the services. The policy
    // must notice (misses, spreads, ranges), fall back to feedback, and get QoS back.
    let sc = Arc::new(Scenario::load("demo").unwrap());
    let wrong = Arc::new(Model::synthetic(5, &[32, 32], 7));
    let mut ml = MlPolicy::new(ctx(&sc), wrong, MlConfig::default());
    let records = run(&sc, &mut ml, sc.ticks());
    let fallbacks = records
        .iter()
        .flat_map(|r| r.reasons.values())
        .filter(|why| why.path == DecisionPath::Fallback)
        .count();
    assert!(fallbacks > 0, "the wrong model was never distrusted");
    // QoS holds for good within a bounded number of intervals after the start and after
    // memcached's load step at 200 s.
    let first_good_run = |from: usize| {
        (from..records.len()).find(|&i| {
            records[i..(i + 10).min(records.len())]
                .iter()
                .all(|r| met(&sc, r))
        })
    };
    let start = first_good_run(0).expect("QoS never held for 10 intervals");
    assert!(start <= 30, "QoS back only after {start} intervals");
    let after_step = first_good_run(200).expect("QoS never held after the step");
    assert!(
        after_step - 200 <= 30,
        "QoS back {} intervals after the step",
        after_step - 200
    );
    let summary = metrics::summarize(
        "demo",
        "ml",
        sc.seed,
        &sc.services
            .iter()
            .filter_map(|s| s.spec.p99_target_ms().map(|t| (s.spec.name.clone(), t)))
            .collect(),
        &records,
    );
    assert!(summary.qos_met_fraction >= 0.85, "{summary:?}");
}

#[test]
fn a_confidently_biased_model_is_corrected_online() {
    // The shipped model with its output shifted down by ln(4): it believes every p99 is a
    // quarter of what it is. The anchor on measurements and the learned bias undo that.
    let sc = Arc::new(Scenario::load("load-spike").unwrap());
    let mut m = simulate::builtin_model(sc.host.preset).unwrap();
    for member in &mut m.ensemble.members {
        if let Some(last) = member.layers.last_mut() {
            last.bias -= 4f32.ln();
        }
    }
    let mut ml = MlPolicy::new(ctx(&sc), Arc::new(m), MlConfig::default());
    let records = run(&sc, &mut ml, sc.ticks());
    let met = records.iter().filter(|r| met(&sc, r)).count();
    assert!(
        met * 100 >= records.len() * 95,
        "{met} of {}",
        records.len()
    );
}

/// `ml` with the built-in model on scenario `name` run on a VM-like host: no hardware
/// counters, no RDT monitoring and, unless `allocation`, no CAT or MBA either (one shared
/// way, no throttling). Checks that absent readings stay absent and no decision falls back
/// for an input out of the training range; returns the share of latency-critical decisions
/// on the model path and the share of intervals meeting every target.
fn on_a_vm(name: &str, allocation: bool) -> (f64, f64) {
    let mut sc = Scenario::load(name).unwrap();
    sc.telemetry = Telemetry {
        counters: false,
        rdt_monitoring: false,
    };
    if !allocation {
        sc.host.capacity = sc.host.capacity.without_allocation();
    }
    let sc = Arc::new(sc);
    let model = Arc::new(simulate::builtin_model(sc.host.preset).unwrap());
    let mut ml = MlPolicy::new(ctx(&sc), model, MlConfig::default());
    let records = run(&sc, &mut ml, sc.ticks());
    assert!(records.iter().all(|r| r
        .observation
        .services
        .iter()
        .all(|o| o.sample.ipc.is_none() && o.sample.mem_bw_bytes_per_s.is_none())));
    let paths: Vec<DecisionPath> = records
        .iter()
        .flat_map(|r| {
            sc.specs()
                .into_iter()
                .filter(|s| s.is_latency_critical())
                .map(|s| r.reasons[&s.name].path)
                .collect::<Vec<_>>()
        })
        .collect();
    for r in &records {
        if !allocation {
            assert!(
                r.plan
                    .groups()
                    .all(|(_, a)| a.llc_ways == WayRange::new(0, 1) && a.mba_pct == 100),
                "{name}: {:?}",
                r.plan
            );
        }
        for why in r.reasons.values() {
            assert!(
                !why.text.contains("outside the training range"),
                "{name}: {why}"
            );
        }
    }
    let model_path = paths.iter().filter(|p| **p == DecisionPath::Model).count();
    let met = records.iter().filter(|r| met(&sc, r)).count();
    #[allow(clippy::cast_precision_loss)]
    (
        model_path as f64 / paths.len() as f64,
        met as f64 / records.len() as f64,
    )
}

#[test]
fn on_a_host_without_counters_or_rdt_ml_takes_the_model_path_and_keeps_qos() {
    // A VM: no hardware counters, no RDT monitoring; latency, load and CPU time only. The
    // absent readings are absent (flags at 0), not values out of the training range, so
    // the model decides.
    // Measured: 0.925 / 0.988 / 0.955 of the decisions on the model path (demo,
    // parties-mix, load-spike); demo's was 0.95 before the bare-target rule (a service
    // meeting its target with no cushion under it within reach takes the fallback's step
    // up) and 0.94 before the safe-memory rule moved its run (the rest hold where the
    // model is unsure, a decision the absent readings have no part in). What this guards
    // against is the absent readings sending decisions to the fallback: under 1 % took the
    // model path then.
    for name in ["demo", "parties-mix", "load-spike"] {
        let (model_path, met) = on_a_vm(name, true);
        assert!(model_path >= 0.9, "{name}: {model_path} on the model path");
        assert!(met >= 0.97, "{name}: QoS met in {met}");
    }
}

#[test]
fn on_a_host_without_any_rdt_ml_takes_the_model_path_on_the_shared_llc() {
    // Most cloud VMs: no resctrl at all, so every group has the whole LLC (`ways_now` = 1,
    // which a model trained only on partitioned hosts had never seen: z = 4.1 on the
    // project's VM, every decision on the fallback) and MBA is 100 %. Cores are the knob.
    // Measured: 0.98 / 0.99 / 0.95 of decisions on the model path and QoS met in 0.99 /
    // 0.99 / 0.96 of intervals (demo, parties-mix, load-spike). Before such a host isolated
    // no service, `ml` scored candidates with no ways of their own and took the model path
    // in under 1 % of demo's decisions.
    for name in ["demo", "parties-mix", "load-spike"] {
        let (model_path, met) = on_a_vm(name, false);
        assert!(model_path >= 0.9, "{name}: {model_path} on the model path");
        assert!(met >= 0.95, "{name}: QoS met in {met}");
    }
}

#[test]
fn opt_in_exploration_cuts_calm_services_and_gains_best_effort() {
    // `explore_step` (off by default) cuts a calm service's cores to learn its cliff, but
    // only where the model's mean stays within the margin, and never more than that share
    // of its cores. Its gain is small and one seed's noise can hide it, so it is judged on
    // the sum over four seeds of the measurement noise on the Gold `parties-mix`, with QoS
    // held in each run (figures: docs/EXPERIMENTS.md, "The start-up reading"; over ten
    // seeds of every CPU scenario it trades runs meeting QoS for best effort,
    // docs/RESULTS.md).
    let sc = Scenario::load("parties-mix")
        .and_then(|s| s.on_platform("xeon-gold-6338"))
        .unwrap();
    let targets = sc
        .services
        .iter()
        .filter_map(|s| s.spec.p99_target_ms().map(|t| (s.spec.name.clone(), t)))
        .collect();
    let model = Arc::new(simulate::builtin_model(sc.host.preset).unwrap());
    let summary = |seed: u64, explore_step: f64| {
        let sc = Arc::new(Scenario { seed, ..sc.clone() });
        let cfg = MlConfig {
            explore_step,
            ..MlConfig::default()
        };
        let mut ml = MlPolicy::new(ctx(&sc), Arc::clone(&model), cfg);
        let records = run(&sc, &mut ml, sc.ticks());
        let cuts = records
            .iter()
            .flat_map(|r| r.reasons.values())
            .filter(|w| w.path == DecisionPath::Explore && w.text.contains("->"))
            .count();
        let s = metrics::summarize(sc.name.as_str(), "ml", sc.seed, &targets, &records);
        (s, cuts)
    };
    let (mut be_off, mut be_on) = (0.0, 0.0);
    for seed in [0, 101, 202, 303] {
        let (off, no_cuts) = summary(seed, 0.0);
        let (on, cuts) = summary(seed, 0.15);
        assert_eq!(no_cuts, 0, "seed {seed}");
        assert!(cuts > 0, "seed {seed}: no cut explored");
        assert!(on.qos_met_fraction >= 0.99, "seed {seed}: {on:?}");
        be_off += off.be_throughput;
        be_on += on.be_throughput;
    }
    assert!(
        be_on > be_off * 1.01,
        "best effort {be_on} with exploration, {be_off} without (sums over four seeds)"
    );
}

#[test]
fn exploration_reaches_services_on_the_pools_ways() {
    // A cache-insensitive service may run on the best-effort pool's ways (`pool_point`),
    // planned as (cores, 0). The exploration rule asks whether the plan holds what is in
    // force, so it must count the ways in force the same way (not as the pool's count
    // read back), or such a service is never probed (nor given back on the fallback). On
    // the Gold `parties-mix` with exploration on, services run there.
    let sc = Arc::new(
        Scenario::load("parties-mix")
            .and_then(|s| s.on_platform("xeon-gold-6338"))
            .unwrap(),
    );
    let model = Arc::new(simulate::builtin_model(sc.host.preset).unwrap());
    let cfg = MlConfig {
        explore_step: 0.15,
        ..MlConfig::default()
    };
    let mut ml = MlPolicy::new(ctx(&sc), model, cfg);
    let records = run(&sc, &mut ml, sc.ticks());
    let on_pool = |r: &DecisionRecord, name: &str| {
        let pool = r.observation.current.best_effort.llc_ways;
        r.observation.current.services[name].llc_ways == pool
    };
    let mut probed = 0;
    for (r, next) in records.iter().zip(records.iter().skip(1)) {
        for (name, why) in &r.reasons {
            if why.path != DecisionPath::Explore || !why.text.contains("->") || !on_pool(r, name) {
                continue;
            }
            probed += 1;
            let (held, cut) = (
                r.observation.current.services[name].cores,
                r.plan.services[name].cores,
            );
            assert!(cut < held, "{name}: {held} -> {cut}: {}", why.text);
            // The cut keeps it on the pool's ways.
            assert!(
                on_pool(next, name),
                "{name} left the pool's ways: {}",
                why.text
            );
        }
    }
    assert!(probed > 0, "no service on the pool's ways was probed");
}

#[test]
fn a_service_the_model_is_unsure_of_gives_back_measured_and_keeps_qos() {
    // On the E5 `demo`, memcached's load steps down at 200 s; the model then vouches for
    // none of its candidates ("model unsure") and the fallback holds. Held calm for
    // `shrink_after` intervals, it gives back a quarter of its cores, read back at the next
    // interval (before this rule the fallback only grew, and memcached kept its peak's
    // cores for as long as the model stayed unsure).
    let sc = Arc::new(Scenario {
        seed: 0,
        ..Scenario::load("demo").unwrap()
    });
    let model = Arc::new(simulate::builtin_model(sc.host.preset).unwrap());
    let mut ml = MlPolicy::new(ctx(&sc), model, MlConfig::default());
    let records = run(&sc, &mut ml, sc.ticks());
    let mut gave = 0;
    for (r, next) in records.iter().zip(records.iter().skip(1)) {
        for (name, why) in &r.reasons {
            if why.path != DecisionPath::Fallback || !why.text.contains("; give back") {
                continue;
            }
            gave += 1;
            let held = r.observation.current.services[name].cores;
            let given = r.plan.services[name].cores;
            assert!(given < held, "{name}: {held} -> {given}: {}", why.text);
            // The next interval reads the give-back, within the target.
            let t = sc
                .services
                .iter()
                .find(|s| &s.spec.name == name)
                .and_then(|s| s.spec.p99_target_ms())
                .unwrap();
            let truth = next.truth.as_ref().unwrap().p99_ms[name];
            assert!(truth <= t, "{name}: {truth} ms after {}", why.text);
        }
    }
    assert!(gave > 0, "no give-back on the fallback");
    let met = records.iter().filter(|r| met(&sc, r)).count();
    assert!(
        met * 100 >= records.len() * 99,
        "QoS met in {met} of {} intervals",
        records.len()
    );
}
