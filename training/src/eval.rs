//! Evaluation: error of predicted vs measured ln(p99/target), overall, per service, on
//! services held out of training, and calibration of the spread; the same for the baseline.

use std::collections::BTreeMap;

use anyhow::Result;
use cohabit_models::Model;
use serde::Serialize;

use crate::dataset::{Dataset, Row};
use crate::fit::{fit, matrix, FitConfig, Ridge};

/// Errors of one predictor on some rows.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Errors {
    /// Median absolute error.
    pub median_abs_error: f64,
    /// Mean absolute error.
    pub mean_abs_error: f64,
    /// Share of truths inside the predicted ±2σ (models with a spread only).
    pub coverage_2sigma: Option<f64>,
    /// Rows.
    pub rows: usize,
}

fn errors(pred: &[f32], sigma: Option<&[f32]>, rows: &[&Row]) -> Errors {
    let mut abs: Vec<f64> = pred
        .iter()
        .zip(rows)
        .map(|(p, r)| f64::from((p - r.target).abs()))
        .collect();
    let coverage = sigma.map(|s| {
        let inside = pred
            .iter()
            .zip(s)
            .zip(rows)
            .filter(|((p, s), r)| (*p - r.target).abs() <= 2.0 * **s)
            .count();
        inside as f64 / rows.len().max(1) as f64
    });
    abs.sort_by(f64::total_cmp);
    Errors {
        median_abs_error: abs.get(abs.len() / 2).copied().unwrap_or(0.0),
        mean_abs_error: abs.iter().sum::<f64>() / abs.len().max(1) as f64,
        coverage_2sigma: coverage,
        rows: rows.len(),
    }
}

/// A model's errors on rows.
pub fn model_errors(model: &Model, rows: &[&Row]) -> Errors {
    let (x, _) = matrix(rows);
    let (m, s) = model.score(x.view());
    errors(
        m.as_slice().unwrap_or(&[]),
        Some(s.as_slice().unwrap_or(&[])),
        rows,
    )
}

/// The baseline's errors on rows.
pub fn ridge_errors(ridge: &Ridge, rows: &[&Row]) -> Errors {
    errors(ridge.predict(rows).as_slice().unwrap_or(&[]), None, rows)
}

/// Everything `cohabit-train eval` and `fit` report.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Report {
    /// The ensemble on in-distribution test rows.
    pub mlp_in_distribution: Errors,
    /// The baseline on the same rows.
    pub ridge_in_distribution: Errors,
    /// Per service (ensemble), in distribution.
    pub mlp_per_service: BTreeMap<String, Errors>,
    /// Leave-one-service-out: each service scored by models trained without it (pooled).
    pub mlp_held_out: Errors,
    /// The same for the baseline.
    pub ridge_held_out: Errors,
    /// Held-out errors per service (ensemble).
    pub mlp_held_out_per_service: BTreeMap<String, Errors>,
}

/// Splits rows deterministically into (train, test) by a hash of their position.
pub fn split(data: &Dataset, test_frac: f64, seed: u64) -> (Vec<&Row>, Vec<&Row>) {
    split_rows(&data.rows.iter().collect::<Vec<_>>(), test_frac, seed)
}

/// [`split`] on rows already selected.
pub fn split_rows<'a>(rows: &[&'a Row], test_frac: f64, seed: u64) -> (Vec<&'a Row>, Vec<&'a Row>) {
    let mut train = Vec::new();
    let mut test = Vec::new();
    for (i, r) in rows.iter().enumerate() {
        let h = (i as u64 ^ seed).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
        if (h as f64 / (1u64 << 24) as f64) < test_frac {
            test.push(*r);
        } else {
            train.push(*r);
        }
    }
    (train, test)
}

/// Leave-one-service-out errors of the baseline alone (no ensemble to train). A dataset of
/// one service (the logs of one host with one service) has nothing to hold out against:
/// its errors are over 0 rows.
pub fn ridge_held_out(data: &Dataset) -> Result<Errors> {
    let mut pred = Vec::new();
    let mut rows_all: Vec<&Row> = Vec::new();
    for s in data.services() {
        let (out, inn): (Vec<&Row>, Vec<&Row>) = data.rows.iter().partition(|r| r.service == s);
        if inn.is_empty() {
            continue;
        }
        pred.extend(Ridge::fit(&inn)?.predict(&out).iter().copied());
        rows_all.extend(out);
    }
    Ok(errors(&pred, None, &rows_all))
}

/// Leave-one-service-out errors for the ensemble (trained with `cfg`) and the baseline.
pub fn held_out(
    data: &Dataset,
    cfg: &FitConfig,
    mut progress: impl FnMut(&str),
) -> Result<(Errors, Errors, BTreeMap<String, Errors>)> {
    let mut mlp_pred = Vec::new();
    let mut mlp_sigma = Vec::new();
    let mut ridge_pred = Vec::new();
    let mut rows_all: Vec<&Row> = Vec::new();
    let mut per = BTreeMap::new();
    for s in data.services() {
        progress(&s);
        let (out, inn): (Vec<&Row>, Vec<&Row>) = data.rows.iter().partition(|r| r.service == s);
        if inn.is_empty() {
            continue;
        }
        let (train, val) = split_rows(&inn, cfg.val_frac, cfg.seed);
        let model = fit(&train, &val, cfg, None, |_, _| {})?;
        let ridge = Ridge::fit(&train)?;
        let (x, _) = matrix(&out);
        let (m, sg) = model.score(x.view());
        per.insert(
            s.clone(),
            errors(
                m.as_slice().unwrap_or(&[]),
                Some(sg.as_slice().unwrap_or(&[])),
                &out,
            ),
        );
        mlp_pred.extend(m.iter().copied());
        mlp_sigma.extend(sg.iter().copied());
        ridge_pred.extend(ridge.predict(&out).iter().copied());
        rows_all.extend(out);
    }
    Ok((
        errors(&mlp_pred, Some(&mlp_sigma), &rows_all),
        errors(&ridge_pred, None, &rows_all),
        per,
    ))
}

/// Calibration of the spread of predicted *changes* (what the `ml` policy uses once the
/// allocation in force has been measured).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChangeCalibration {
    /// Pairs of candidates of one service in one situation that were compared.
    pub pairs: usize,
    /// Median absolute error of the predicted change.
    pub median_abs_error: f64,
    /// Share of true changes inside ±2 spread with the level's `sigma_scale`.
    pub coverage_with_level_scale: f64,
    /// The factor that puts 95 % of them inside ±2 spread.
    pub change_sigma_scale: f32,
}

/// Groups consecutive rows of one service whose features agree outside the candidate
/// columns (the candidates `cohabit-train gen` scores per service and scene) and measures,
/// for every candidate against the group's first, the error of the predicted change
/// against its raw spread. `None` without such pairs.
pub fn change_calibration(model: &Model, rows: &[Row]) -> Option<ChangeCalibration> {
    let candidate = model.schema().candidate;
    let same_situation = |a: &Row, b: &Row| {
        a.service == b.service
            && a.features
                .iter()
                .zip(&b.features)
                .enumerate()
                .all(|(j, (x, y))| candidate.contains(&j) || x == y)
    };
    let raw = {
        let mut m = model.clone();
        m.meta.change_sigma_scale = Some(1.0);
        m
    };
    let mut z = Vec::new();
    let mut abs = Vec::new();
    let mut inside = 0usize;
    let level = f64::from(model.meta.sigma_scale);
    let mut start = 0;
    while start < rows.len() {
        let mut end = start + 1;
        while end < rows.len() && same_situation(&rows[start], &rows[end]) {
            end += 1;
        }
        if end - start >= 2 {
            let group = &rows[start..end];
            let reference = ndarray::Array1::from(group[0].features.clone());
            let others: Vec<&Row> = group[1..].iter().collect();
            let (x, y) = matrix(&others);
            let (d, s) = raw.score_change(reference.view(), x.view());
            for ((d, s), y) in d.iter().zip(&s).zip(&y) {
                let err = f64::from((y - group[0].target) - d).abs();
                abs.push(err);
                z.push(err / f64::from(s.max(1e-6)));
                if err <= 2.0 * level * f64::from(*s) {
                    inside += 1;
                }
            }
        }
        start = end;
    }
    if z.is_empty() {
        return None;
    }
    z.sort_by(f64::total_cmp);
    abs.sort_by(f64::total_cmp);
    let q = z[z.len() * 95 / 100];
    #[allow(clippy::cast_possible_truncation)] // a small positive factor
    Some(ChangeCalibration {
        pairs: z.len(),
        median_abs_error: abs[abs.len() / 2],
        coverage_with_level_scale: inside as f64 / z.len() as f64,
        change_sigma_scale: ((q / 2.0).max(1e-3)) as f32,
    })
}
