//! The learned GPU model in `ml` on the simulator: GPU shares from the model where its inputs
//! are in range (path `model`, reason "gpu model: …"), the online share model as the
//! fallback with the reason (path `fallback`), targets met with the model's shares, and
//! the overload rule on an oversubscribed GPU.

use std::sync::Arc;

use cohabit_core::{DecisionPath, DecisionRecord};
use cohabit_lab::simulate::{self, LabPolicy};
use cohabit_models::Model;
use cohabit_policy::{control, HostContext, MlConfig, MlPolicy, Policy};
use cohabit_sim::{Scenario, SimulatedHost};

fn run(sc: &Arc<Scenario>, policy: &mut dyn Policy) -> Vec<DecisionRecord> {
    let initial = policy.initial().plan;
    let mut host = SimulatedHost::launch(Arc::clone(sc), &initial, None).unwrap();
    let mut records = Vec::new();
    control::run(&mut host, policy, sc.ticks(), |r| {
        records.push(r);
        Ok(())
    })
    .unwrap();
    records
}

fn gpu_services(sc: &Scenario) -> Vec<String> {
    sc.services
        .iter()
        .filter(|s| s.spec.gpu.is_some() && s.spec.is_latency_critical())
        .map(|s| s.spec.name.clone())
        .collect()
}

/// Fraction of intervals in which `name` met its target (ground truth).
fn met(sc: &Scenario, records: &[DecisionRecord], name: &str) -> f64 {
    let t = sc
        .services
        .iter()
        .find(|s| s.spec.name == name)
        .and_then(|s| s.spec.p99_target_ms())
        .unwrap();
    let ok = records
        .iter()
        .filter(|r| r.truth.as_ref().unwrap().p99_ms[name] <= t)
        .count();
    ok as f64 / records.len() as f64
}

#[test]
fn on_the_gpu_scenario_the_models_shares_meet_the_targets() {
    let sc = Arc::new(Scenario::load("gpu-inference").unwrap());
    let mut ml = simulate::build_policy(LabPolicy::Ml, &sc, None).unwrap();
    let records = run(&sc, ml.as_mut());
    for name in gpu_services(&sc) {
        let paths: Vec<&cohabit_core::Reason> = records
            .iter()
            .filter_map(|r| r.reasons.get(&name))
            .collect();
        let by_model = paths
            .iter()
            .filter(|r| r.path == DecisionPath::Model && r.text.starts_with("gpu model:"))
            .count();
        // The model sizes the share wherever its inputs are in range: most intervals.
        assert!(
            by_model * 2 > paths.len(),
            "{name}: {by_model} of {} by the GPU model",
            paths.len()
        );
        let q = met(&sc, &records, &name);
        assert!(q >= 0.97, "{name}: target met in {q} of the intervals");
    }
}

#[test]
fn a_gpu_model_whose_inputs_are_out_of_range_falls_back_to_the_online_model_with_the_reason() {
    let sc = Arc::new(Scenario::load("gpu-inference").unwrap());
    let cpu = Arc::new(simulate::builtin_model(sc.host.preset).unwrap());
    // The shipped GPU model, told its training data had almost no spread in the load: every
    // real load is then far outside its training range.
    let mut gpu: Model = cohabit_models::builtin_gpu(sc.host.preset)
        .unwrap()
        .unwrap();
    gpu.meta.norm_std[0] = 1e-3;
    let ctx = HostContext {
        host: sc.capacity().clone(),
        specs: sc.specs(),
    };
    let mut ml = MlPolicy::new(ctx, cpu, MlConfig::default())
        .with_gpu_model(Arc::new(gpu))
        .unwrap();
    let records = run(&sc, &mut ml);
    for name in gpu_services(&sc) {
        let reasons: Vec<&cohabit_core::Reason> = records
            .iter()
            .filter_map(|r| r.reasons.get(&name))
            .collect();
        assert!(
            reasons.iter().all(|r| !r.text.starts_with("gpu model:")),
            "{name}: never the model's path"
        );
        let fallbacks: Vec<_> = reasons
            .iter()
            .filter(|r| r.path == DecisionPath::Fallback)
            .collect();
        assert!(!fallbacks.is_empty(), "{name}");
        for r in fallbacks {
            assert!(
                r.text
                    .starts_with("gpu model not used: input log_rps out of its training range")
                    && r.text.contains("online model: gpu share for p99/target"),
                "{name}: {}",
                r.text
            );
        }
        // The online model still keeps the service within its target most of the time.
        let q = met(&sc, &records, &name);
        assert!(q >= 0.9, "{name}: target met in {q} of the intervals");
    }
}

#[test]
fn on_an_oversubscribed_gpu_ml_serves_the_services_that_can_meet_their_targets_before_best_effort()
{
    let sc = Arc::new(Scenario::load("gpu-llm-crowd").unwrap());
    let runs = simulate::compare(&sc, &[LabPolicy::Ml, LabPolicy::Oracle], None, None).unwrap();
    let met = |policy: &str| -> f64 {
        let run = runs.iter().find(|r| r.summary.policy == policy).unwrap();
        run.summary
            .services
            .values()
            .map(|s| s.qos_met_fraction)
            .sum()
    };
    let (ml, oracle) = (met("ml"), met("oracle"));
    // Spreading the GPU thin met no target in any interval (0.00 services per interval);
    // a service far over its target yields so that others meet theirs, and only one over
    // its target for a while: when one outlier reading of llm-chat (46 times its target,
    // the truth 0.93) could make it yield, `ml` met 1.02 services per interval. The oracle
    // held GPU shares fixed for the run until issue 49 (1.38 there); it now moves them too.
    assert!(
        ml >= 1.3,
        "ml meets {ml:.2} services per interval (oracle {oracle:.2})"
    );
    let run = runs.iter().find(|r| r.summary.policy == "ml").unwrap();
    assert!(run
        .records
        .iter()
        .flat_map(|r| r.reasons.values())
        .any(|r| r.text.contains("far over its target, yields")));
    // Best effort keeps only its floor while a service misses its target.
    for r in &run.records {
        let pool = r.plan.best_effort.gpu_mps_pct.unwrap();
        assert!(
            pool <= 5,
            "t {} ms: the training job keeps {pool} %",
            r.observation.t_ms
        );
    }
}
