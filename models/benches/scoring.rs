//! Scoring speed: 1,000 candidate allocations through a 5-member ensemble of
//! 24→32→32→1 MLPs (about 1.9 k parameters each; OSML's models have about 4 k) on one
//! core (target: under 1 ms), and the batch one `ml` decision scores per service (30
//! candidates of one service, levels and changes from its row in force), where a call's
//! fixed costs weigh most. Weights are synthetic; speed does not depend on their values.

use cohabit_models::features::CANDIDATE_FEATURES;
use cohabit_models::{Model, N_FEATURES};
use criterion::{black_box, criterion_group, criterion_main, Criterion};
use ndarray::Array2;

fn scoring(c: &mut Criterion) {
    let model = Model::synthetic(5, &[32, 32], 42);
    let x = Array2::from_shape_fn((1000, N_FEATURES), |(i, j)| {
        ((i * 31 + j * 7) % 101) as f32 / 101.0
    });
    c.bench_function("score 1000 candidates (5 x 24-32-32-1)", |b| {
        b.iter(|| model.score(black_box(x.view())))
    });
    // One service's candidates: the row in force with its candidate columns varied.
    let base = x.row(0).to_owned();
    let batch = Array2::from_shape_fn((30, N_FEATURES), |(i, j)| {
        if CANDIDATE_FEATURES.contains(&j) {
            x[[i, j]]
        } else {
            base[j]
        }
    });
    c.bench_function("score 30 candidates of one service", |b| {
        b.iter(|| model.score(black_box(batch.view())))
    });
    c.bench_function("score the change to 30 candidates of one service", |b| {
        b.iter(|| model.score_change_basis(black_box(base.view()), black_box(batch.view())))
    });
}

criterion_group!(benches, scoring);
criterion_main!(benches);
