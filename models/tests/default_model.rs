//! The default model shipped in the repository: it loads, its recorded metrics meet the
//! targets, and it scores.

use std::path::PathBuf;

use cohabit_models::{Model, N_FEATURES};
use ndarray::Array2;

fn shipped() -> Model {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("default/qos-v1.json");
    Model::load(&path).unwrap_or_else(|e| panic!("the shipped model must load: {e}"))
}

#[test]
fn the_shipped_model_loads_and_its_recorded_metrics_meet_the_targets() {
    let m = shipped();
    let get = |k: &str| {
        *m.meta
            .metrics
            .get(k)
            .unwrap_or_else(|| panic!("metric {k} missing"))
    };
    // 0.13, not 0.10: since the training data have hosts without hardware counters or RDT
    // monitoring (40 % of scenes) and intervals without a latency reading (5 %), the same
    // 24→32→32→1 ensemble trades a little accuracy where everything is measured (0.097 →
    // 0.106 on fresh rows of such hosts) for predictions on hosts that measure less (3.6 →
    // 0.129 where neither is there; docs/EXPERIMENTS.md, "The learned model"): 0.117. Since the
    // data also cover every MBA step from 10 % (the pool's too) and the simulator's kernel
    // path and CFS sharing (issue 14 item 6), it is 0.125 (held out 0.210 → 0.214); with
    // hosts without any RDT (a fifth of scenes, every group on the whole LLC) 0.105 (held
    // out 0.193).
    assert!(
        get("in_distribution_median_abs_error") <= 0.13,
        "{:?}",
        m.meta.metrics
    );
    assert!(
        get("held_out_median_abs_error") <= 0.25,
        "{:?}",
        m.meta.metrics
    );
    assert!(
        get("held_out_coverage_2sigma") >= 0.85,
        "{:?}",
        m.meta.metrics
    );
    assert!(
        get("in_distribution_median_abs_error") < get("ridge_in_distribution_median_abs_error")
    );
    assert!(get("held_out_median_abs_error") < get("ridge_held_out_median_abs_error"));
    assert!(get("training_seconds") < 300.0);
    assert!(m.meta.training_data_digest.starts_with("fnv1a64:"));
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("default");
    let size: u64 = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum();
    assert!(
        size < 1 << 20,
        "the shipped model stays under 1 MB ({size} bytes)"
    );
}

#[test]
fn the_shipped_model_scores_with_a_spread() {
    let m = shipped();
    let x = Array2::from_shape_fn((10, N_FEATURES), |(i, j)| ((i + j) % 5) as f32 / 5.0);
    let (mean, sigma) = m.score(x.view());
    assert!(mean.iter().all(|v| v.is_finite()));
    assert!(sigma.iter().all(|s| *s > 0.0));
}
