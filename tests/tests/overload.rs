//! End to end: the crowded (overload) scenarios, where not every target can be met.
//!
//! What must hold whatever the physics' figures (docs/DESIGN.md 5, "Overload"): the oracle
//! is a bound on how many services meet their targets, within a tolerance for the noise
//! the other policies react to (the oracle plans on the truth); every plan of
//! every policy fits the CLOSIDs and uses MBA steps of the platform; and on an oversubscribed
//! GPU no policy gives best effort a larger GPU share than the oracle while a
//! latency-critical service misses.

use std::sync::Arc;

use cohabit_lab::oracle::mba_steps;
use cohabit_lab::simulate::{self, LabPolicy};
use cohabit_sim::scenario::crowded_names;
use cohabit_sim::Scenario;

/// Mean number of latency-critical services meeting their targets per interval.
fn services_met(summary: &cohabit_lab::metrics::RunSummary) -> f64 {
    summary.services.values().map(|s| s.qos_met_fraction).sum()
}

#[test]
fn on_crowded_hosts_the_oracle_meets_at_least_as_many_targets_as_any_policy() {
    for name in crowded_names() {
        let sc = Arc::new(Scenario::load(name).unwrap());
        let cap = sc.capacity();
        let steps = mba_steps(cap.mba_min_pct, cap.mba_gran_pct);
        let runs = simulate::compare(
            &sc,
            &[LabPolicy::Static, LabPolicy::Parties, LabPolicy::Oracle],
            None,
            None,
        )
        .unwrap();
        let oracle = runs.iter().find(|r| r.summary.policy == "oracle").unwrap();
        let bound = services_met(&oracle.summary);
        for run in &runs {
            let met = services_met(&run.summary);
            // A tenth of a service per interval: the measurement noise the other policies
            // react to is not in the truth. (Until issue 49 the oracle also held GPU shares
            // fixed for the run; lab/src/oracle.rs checks every policy with no tolerance.)
            assert!(
                bound + 0.1 >= met,
                "{name}: {} meets {met:.2} services per interval, the oracle {bound:.2}",
                run.summary.policy
            );
            for r in &run.records {
                r.plan
                    .validate(cap, &sc.specs())
                    .unwrap_or_else(|e| panic!("{name}: {}: {e}", run.summary.policy));
                for (g, a) in r.plan.groups() {
                    assert!(
                        steps.contains(&a.mba_pct),
                        "{name}: {}: {g} at MBA {}%",
                        run.summary.policy,
                        a.mba_pct
                    );
                }
            }
        }
    }
}

#[test]
fn on_an_oversubscribed_gpu_best_effort_gets_only_the_floor_while_llm_services_miss() {
    let sc = Arc::new(Scenario::load("gpu-llm-crowd").unwrap());
    let run = simulate::run_policy(&sc, LabPolicy::Oracle, None, None, |_| Ok(())).unwrap();
    let lc: u32 = run.records[0]
        .plan
        .services
        .values()
        .filter_map(|a| a.gpu_mps_pct)
        .map(u32::from)
        .sum();
    let some_miss = run
        .summary
        .services
        .values()
        .any(|s| s.qos_met_fraction < 1.0);
    let pool = u32::from(run.records[0].plan.best_effort.gpu_mps_pct.unwrap());
    assert!(lc + pool <= 100, "{lc} + {pool}");
    if some_miss {
        // LC before BE: the services take all but the job's floor (a few percent at most,
        // 5 % steps).
        assert!(pool <= 5, "training keeps {pool}% while a service misses");
    }
}

#[test]
fn on_crowded_cpu_hosts_ml_meets_most_of_the_targets_the_oracle_meets() {
    // The triage of the degrade rule (policy/src/ml/pack.rs): a service that misses whatever
    // it gets gives way to one that then meets its target. Before it, `ml` met 3.2 services
    // per interval on the crowded E5 against the oracle's 7.0 (it held cores and ways for
    // moses, which nothing within the host's reach serves). On a crowded host one run is
    // chaotic (which service yields first decides the rest: 4.9 to 5.7 on the E5 over
    // seeds), so `ml` is judged on the mean over four noise seeds; the oracle plans on the
    // truth, which the seed does not touch.
    const SEEDS: [Option<u64>; 4] = [None, Some(0), Some(101), Some(202)];
    for name in crowded_names().filter(|n| n.starts_with("crowded")) {
        let sc = Arc::new(Scenario::load(name).unwrap());
        let oracle = simulate::run_policy(&sc, LabPolicy::Oracle, None, None, |_| Ok(())).unwrap();
        let oracle = services_met(&oracle.summary);
        let per_seed: Vec<f64> = SEEDS
            .iter()
            .map(|&seed| {
                let run = simulate::run_policy(&sc, LabPolicy::Ml, seed, None, |_| Ok(())).unwrap();
                assert_eq!(run.summary.policy, "ml");
                services_met(&run.summary)
            })
            .collect();
        let ml = per_seed.iter().sum::<f64>() / per_seed.len() as f64;
        assert!(
            ml >= 0.75 * oracle,
            "{name}: ml meets {ml:.2} services per interval ({per_seed:.2?}), the oracle {oracle:.2}"
        );
        // The oracle bounds `ml` within its search space on the scenario's seed; on other
        // seeds `ml` can land above it (the Gold `crowded-gold`, seed 101: 5.71 against
        // 5.36, docs/EXPERIMENTS.md, "A latency window"), so the bound is checked on that
        // seed alone.
        let on_scenario_seed = per_seed[0];
        assert!(
            oracle + 0.1 >= on_scenario_seed,
            "{name}: ml {on_scenario_seed:.2} oracle {oracle:.2}"
        );
    }
}
