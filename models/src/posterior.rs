//! A per-host posterior on the model's output layer: Bayesian linear regression on the
//! ensemble's last hidden layer (issue 45, "a per-host posterior").
//!
//! **Problem.** The shipped model was trained on simulated hosts. On a host unlike them its
//! predictions are off in ways that depend on the candidate (on the project's VM several
//! times its error in distribution; docs/EXPERIMENTS.md), and the ensemble's spread says how much
//! the *members* disagree, not how wrong they all are here; it never shrinks with what the
//! host shows, so a model unsure of a host stays unsure of it.
//!
//! **Approach.** Keep the network's hidden layers (the features it learnt) and learn, per
//! host and service, a correction `δ` of its output layer from the host's own readings:
//! adding `δ` to every member's output weights adds `δ · φ(x)` to the ensemble's mean, where
//! `φ(x)` is the members' mean last hidden layer ([`crate::mlp::Ensemble::basis_width`]).
//! `δ` has a Gaussian prior centred on 0 (the shipped output layer: with no data the
//! posterior predicts exactly what the model does) and is updated with every reading, so
//! its predictive variance shrinks where the host has shown something and stays wide where
//! it has not (DNGO, Snoek et al. 2015; the "neural-linear" bandit).
//!
//! **Algorithm.** [`Blr`]: `y = θ · z + ε`, `θ ~ N(0, diag(prior_var))`, `ε ~ N(0, σ²)`
//! with `σ²` known per observation. The precision `A` and `A·mean` are kept; each
//! observation first forgets (`A ← γA + (1 - γ)A₀`, `A·mean ← γ A·mean`: stabilised
//! forgetting, so old evidence fades toward the prior, never below it, and the posterior
//! tracks a host that changes), then adds `z zᵀ / σ²` and `z y / σ²` (a rank-1 update of
//! the precision). The Cholesky factor `A = L Lᵀ` and `L⁻¹` are recomputed after each
//! update (O(d³/3), d ≤ [`MAX_DIM`]: microseconds); a prediction is `mean · z` and its
//! variance `|L⁻¹ z|²`, for a batch one matrix product.
//!
//! **Properties.** Numerically safe: the precision is symmetric positive definite by
//! construction (a positive diagonal prior plus outer products), an update that would
//! break that (non-finite input) is refused and leaves the posterior as it was, and a
//! snapshot is checked (dimensions, finite, symmetric, positive definite) before it is
//! used. Bounded: `d ≤` [`MAX_DIM`] (a basis of at most [`MAX_BASIS_WIDTH`] hidden units
//! and a constant), so a service's posterior is at most `d² + 2d` numbers (about 90 KB of
//! JSON at d = 65, 23 KB at the shipped models' d = 33), whatever the time it runs.
//!
//! [`fold`] writes a fleet's posteriors back into the shared model's output layer.

use std::collections::BTreeMap;

use ndarray::{Array1, Array2, ArrayView2};
use serde::{Deserialize, Serialize};

use crate::Model;

/// Version of the [`PosteriorSnapshot`] layout; a snapshot of another version is dropped.
pub const POSTERIOR_SCHEMA_VERSION: u32 = 1;

/// Widest last hidden layer a posterior is kept for: a model with a wider one runs without
/// one (its cost per candidate and its size grow with the square of the width).
pub const MAX_BASIS_WIDTH: usize = 64;

/// Most coefficients of one posterior: one per unit of the basis, and a constant.
pub const MAX_DIM: usize = MAX_BASIS_WIDTH + 1;

/// Smallest noise variance an observation is given (ln units squared).
const MIN_NOISE_VAR: f64 = 1e-6;

/// Largest relative asymmetry of a snapshot's precision accepted (rounding in JSON).
const SYMMETRY_TOLERANCE: f64 = 1e-6;

/// Why a posterior could not be built, updated, read back or folded.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PosteriorError {
    /// A vector or matrix had the wrong size.
    #[error("{what}: expected {expected} values, found {found}")]
    Dimension {
        /// Which one.
        what: &'static str,
        /// How many it needs.
        expected: usize,
        /// How many it had.
        found: usize,
    },
    /// A value was not finite, or not positive where it must be.
    #[error("{what}: {message}")]
    Value {
        /// Which one.
        what: &'static str,
        /// What is wrong.
        message: String,
    },
    /// The precision is not symmetric positive definite.
    #[error("{what}: the precision is not symmetric positive definite")]
    NotPositiveDefinite {
        /// Which one.
        what: &'static str,
    },
}

/// The Cholesky factor of a posterior's precision and what follows from it.
#[derive(Debug, Clone, PartialEq)]
struct Factor {
    /// `L⁻¹` (lower triangular), d × d: the variance of `z` is `|L⁻¹ z|²`.
    inv_chol: Array2<f64>,
    /// The posterior mean.
    mean: Array1<f64>,
    /// `(L⁻¹)ᵀ` without its last row, in f32: [`Blr::predict_changes`]'s one product.
    inv_chol_head_t: Array2<f32>,
}

/// Bayesian linear regression with a diagonal Gaussian prior centred on 0, a known noise
/// variance per observation and forgetting toward the prior: one service's correction of
/// the model's output layer on one host (module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct Blr {
    prior_var: Array1<f64>,
    /// `A`, d × d, symmetric positive definite.
    precision: Array2<f64>,
    /// `A · mean`.
    shift: Array1<f64>,
    /// Observations, each weighted by what forgetting left of it.
    samples: f64,
    factor: Factor,
}

/// A [`Blr`] as written to disk.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BlrSnapshot {
    /// Prior variance of each coefficient.
    pub prior_var: Vec<f64>,
    /// The precision, row-major, d × d.
    pub precision: Vec<f64>,
    /// The precision times the mean.
    pub shift: Vec<f64>,
    /// Observations, each weighted by what forgetting left of it.
    pub samples: f64,
}

/// One service's posterior with the model it belongs to: a correction is one of a given
/// output layer on given hidden layers, meaningless on another model's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PosteriorSnapshot {
    /// [`model_digest`] of the model whose basis it regresses on.
    pub model: String,
    /// The regression.
    pub blr: BlrSnapshot,
}

/// What a policy learnt of its host: a posterior per latency-critical service, by name.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PosteriorSet {
    /// Per service.
    pub services: BTreeMap<String, PosteriorSnapshot>,
}

/// `sha256:<hex>` of a model's normalisation and weights: what a posterior is keyed by.
pub fn model_digest(model: &Model) -> String {
    let e = &model.ensemble;
    let mut bytes: Vec<u8> = Vec::new();
    let mut put = |xs: &mut dyn Iterator<Item = &f32>| {
        for x in xs {
            bytes.extend_from_slice(&x.to_le_bytes());
        }
    };
    put(&mut e.mean.iter());
    put(&mut e.std.iter());
    for m in &e.members {
        for l in &m.layers {
            put(&mut l.weight.iter());
            put(&mut l.bias.iter());
        }
    }
    crate::artifact::digest(&bytes)
}

/// The Cholesky factor `L` of a symmetric positive definite `a`, `None` when it is not.
fn cholesky(a: &Array2<f64>) -> Option<Array2<f64>> {
    let n = a.nrows();
    let a = a.as_standard_layout();
    let a = a.as_slice()?;
    let mut l = vec![0.0; n * n];
    for i in 0..n {
        for j in 0..=i {
            let (ri, rj) = (&l[i * n..i * n + j], &l[j * n..j * n + j]);
            let s = a[i * n + j] - ri.iter().zip(rj).map(|(x, y)| x * y).sum::<f64>();
            if i == j {
                if !(s.is_finite() && s > 0.0) {
                    return None;
                }
                l[i * n + i] = s.sqrt();
            } else {
                l[i * n + j] = s / l[j * n + j];
            }
        }
    }
    Array2::from_shape_vec((n, n), l).ok()
}

/// `L⁻¹` of a lower-triangular `l` with a positive diagonal (forward substitution, row by
/// row: row `i` of `L⁻¹` from the rows above it); `None` when `l` is not square.
fn invert_lower(l: &Array2<f64>) -> Option<Array2<f64>> {
    let n = l.nrows();
    if l.ncols() != n {
        return None;
    }
    let mut inv = vec![0.0; n * n];
    for i in 0..n {
        // (L⁻¹)[i, ..i] = -(Σ_{k<i} L[i, k] (L⁻¹)[k, ..i]) / L[i, i]; (L⁻¹)[i, i] = 1 / L[i, i].
        let d = 1.0 / l[[i, i]];
        let (above, rest) = inv.split_at_mut(i * n);
        let row = &mut rest[..n];
        for k in 0..i {
            let f = -l[[i, k]] * d;
            if f != 0.0 {
                for (r, x) in row[..=k].iter_mut().zip(&above[k * n..=k * n + k]) {
                    *r += f * x;
                }
            }
        }
        row[i] = d;
    }
    Array2::from_shape_vec((n, n), inv).ok()
}

/// The factor of `precision` and the mean it gives with `shift`.
fn factor(precision: &Array2<f64>, shift: &Array1<f64>) -> Option<Factor> {
    let l = cholesky(precision)?;
    let inv_chol = invert_lower(&l)?;
    // mean = A⁻¹ shift = L⁻ᵀ L⁻¹ shift.
    let mean = inv_chol.t().dot(&inv_chol.dot(shift));
    let d = inv_chol.nrows();
    #[allow(clippy::cast_possible_truncation)] // a variance's factor: f32 is enough
    let inv_chol_head_t =
        Array2::from_shape_fn((d.saturating_sub(1), d), |(j, i)| inv_chol[[i, j]] as f32);
    mean.iter().all(|v| v.is_finite()).then_some(Factor {
        inv_chol,
        mean,
        inv_chol_head_t,
    })
}

/// Checks that `v` has `n` finite values.
fn check(what: &'static str, v: &[f64], n: usize) -> Result<(), PosteriorError> {
    if v.len() != n {
        return Err(PosteriorError::Dimension {
            what,
            expected: n,
            found: v.len(),
        });
    }
    if v.iter().any(|x| !x.is_finite()) {
        return Err(PosteriorError::Value {
            what,
            message: "holds a non-finite value".into(),
        });
    }
    Ok(())
}

impl Blr {
    /// The prior: every coefficient 0 with variance `prior_var` (each positive), at most
    /// [`MAX_DIM`] of them.
    pub fn new(prior_var: &[f64]) -> Result<Blr, PosteriorError> {
        let d = prior_var.len();
        if d == 0 || d > MAX_DIM {
            return Err(PosteriorError::Dimension {
                what: "prior variance",
                expected: MAX_DIM.min(d.max(1)),
                found: d,
            });
        }
        check("prior variance", prior_var, d)?;
        if prior_var.iter().any(|v| *v <= 0.0) {
            return Err(PosteriorError::Value {
                what: "prior variance",
                message: "must be positive".into(),
            });
        }
        let prior_var = Array1::from(prior_var.to_vec());
        let precision = Array2::from_diag(&prior_var.mapv(|v| 1.0 / v));
        let shift = Array1::zeros(d);
        let factor = factor(&precision, &shift)
            .ok_or(PosteriorError::NotPositiveDefinite { what: "prior" })?;
        Ok(Blr {
            prior_var,
            precision,
            shift,
            samples: 0.0,
            factor,
        })
    }

    /// Number of coefficients.
    pub fn dim(&self) -> usize {
        self.prior_var.len()
    }

    /// Observations so far, each weighted by what forgetting left of it.
    pub fn samples(&self) -> f64 {
        self.samples
    }

    /// The posterior mean of the coefficients.
    pub fn mean(&self) -> &Array1<f64> {
        &self.factor.mean
    }

    /// The prior variance of each coefficient.
    pub fn prior_var(&self) -> &Array1<f64> {
        &self.prior_var
    }

    /// The posterior covariance of the coefficients (`A⁻¹`).
    pub fn covariance(&self) -> Array2<f64> {
        let inv = &self.factor.inv_chol;
        inv.t().dot(inv)
    }

    /// Learns `y` observed at `z` with noise variance `noise_var`, after forgetting the
    /// evidence so far by `forget` (1: none; 0.99: an observation's weight halves in 69
    /// more). Refused (the posterior unchanged) when an input is not finite, `z` has the
    /// wrong length or `forget` is outside (0, 1].
    pub fn observe(
        &mut self,
        z: &[f64],
        y: f64,
        noise_var: f64,
        forget: f64,
    ) -> Result<(), PosteriorError> {
        let d = self.dim();
        check("observation", z, d)?;
        if !(y.is_finite() && noise_var.is_finite() && noise_var >= 0.0) {
            return Err(PosteriorError::Value {
                what: "observation",
                message: format!("target {y} or noise variance {noise_var} is not finite"),
            });
        }
        if !(forget > 0.0 && forget <= 1.0) {
            return Err(PosteriorError::Value {
                what: "forgetting factor",
                message: format!("{forget} is outside (0, 1]"),
            });
        }
        let w = 1.0 / noise_var.max(MIN_NOISE_VAR);
        let mut precision = self.precision.mapv(|v| v * forget);
        for i in 0..d {
            precision[[i, i]] += (1.0 - forget) / self.prior_var[i];
        }
        let z = Array1::from(z.to_vec());
        for (mut row, zi) in precision.rows_mut().into_iter().zip(&z) {
            row.scaled_add(w * zi, &z);
        }
        let shift = self.shift.mapv(|v| v * forget) + &(z * (w * y));
        let factor = factor(&precision, &shift)
            .ok_or(PosteriorError::NotPositiveDefinite { what: "update" })?;
        self.precision = precision;
        self.shift = shift;
        self.factor = factor;
        self.samples = self.samples * forget + 1.0;
        Ok(())
    }

    /// Posterior mean and variance of `θ · z` for one `z`.
    pub fn predict(&self, z: &[f64]) -> (f64, f64) {
        let z = Array1::from(z.to_vec());
        let u = self.factor.inv_chol.dot(&z);
        (self.factor.mean.dot(&z), u.dot(&u))
    }

    /// [`Blr::predict`] for each row of `z` (n × d): one matrix product.
    pub fn predict_rows(&self, z: ArrayView2<'_, f64>) -> Vec<(f64, f64)> {
        let mean = z.dot(&self.factor.mean);
        let u = z.dot(&self.factor.inv_chol.t());
        mean.iter()
            .zip(u.rows())
            .map(|(m, r)| (*m, r.dot(&r)))
            .collect()
    }

    /// For regressors `[delta, 1]` (the last coefficient a constant), one per row of `delta`
    /// (n × (d - 1)): the mean of `θ · [delta, 1]` and the variance of `θ · [delta, 0]` (the
    /// constant's left out). One f32 matrix product; what `ml` asks of every candidate.
    pub fn predict_changes(&self, delta: ArrayView2<'_, f32>) -> Vec<(f64, f64)> {
        let d = self.dim();
        if d == 0 || delta.ncols() + 1 != d {
            return vec![(0.0, 0.0); delta.nrows()];
        }
        let u = delta.dot(&self.factor.inv_chol_head_t);
        let mean = &self.factor.mean;
        delta
            .rows()
            .into_iter()
            .zip(u.rows())
            .map(|(z, u)| {
                let m = z
                    .iter()
                    .zip(mean.iter())
                    .map(|(a, b)| f64::from(*a) * b)
                    .sum::<f64>()
                    + mean[d - 1];
                let v = u.iter().map(|x| f64::from(*x) * f64::from(*x)).sum();
                (m, v)
            })
            .collect()
    }

    /// The posterior as written to disk.
    pub fn snapshot(&self) -> BlrSnapshot {
        BlrSnapshot {
            prior_var: self.prior_var.to_vec(),
            precision: self.precision.iter().copied().collect(),
            shift: self.shift.to_vec(),
            samples: self.samples,
        }
    }

    /// A posterior read back, checked: dimensions, finite values, a positive prior, a
    /// symmetric positive definite precision.
    pub fn from_snapshot(s: &BlrSnapshot) -> Result<Blr, PosteriorError> {
        let mut blr = Blr::new(&s.prior_var)?;
        let d = blr.dim();
        check("precision", &s.precision, d * d)?;
        check("shift", &s.shift, d)?;
        if !(s.samples.is_finite() && s.samples >= 0.0) {
            return Err(PosteriorError::Value {
                what: "samples",
                message: format!("{} is not a count", s.samples),
            });
        }
        let precision = Array2::from_shape_vec((d, d), s.precision.clone()).map_err(|_| {
            PosteriorError::Dimension {
                what: "precision",
                expected: d * d,
                found: s.precision.len(),
            }
        })?;
        for i in 0..d {
            for j in 0..i {
                let (a, b) = (precision[[i, j]], precision[[j, i]]);
                if (a - b).abs() > SYMMETRY_TOLERANCE * a.abs().max(b.abs()).max(1.0) {
                    return Err(PosteriorError::NotPositiveDefinite { what: "snapshot" });
                }
            }
        }
        let shift = Array1::from(s.shift.clone());
        blr.factor = factor(&precision, &shift)
            .ok_or(PosteriorError::NotPositiveDefinite { what: "snapshot" })?;
        blr.precision = precision;
        blr.shift = shift;
        blr.samples = s.samples;
        Ok(blr)
    }
}

/// What [`fold`] did.
#[derive(Debug, Clone, PartialEq)]
pub struct FoldReport {
    /// Posteriors folded in.
    pub folded: usize,
    /// Posteriors skipped: another model's, or a basis of another width.
    pub skipped: usize,
    /// Their observations, summed.
    pub samples: f64,
    /// The correction written into every member's output weights.
    pub correction: Vec<f64>,
}

/// Folds a fleet's posteriors (of `model`, [`model_digest`]: one coefficient per unit of
/// its basis, and a constant) into `model`'s output layer: the precision-weighted average
/// of their mean corrections of the basis's coefficients (the constant, a drift of one
/// host's readings, is not the model's and is marginalised out) is added to every member's
/// output weights. A host with little evidence has a precision near its prior's and pulls
/// the average toward the shipped layer; one with much pulls it toward its own. Posteriors
/// of another model or width are skipped and counted. The model's metadata records the
/// fold (`metrics`).
pub fn fold(
    model: &Model,
    posteriors: &[PosteriorSnapshot],
) -> Result<(Model, FoldReport), PosteriorError> {
    let width = model
        .ensemble
        .basis_width()
        .ok_or(PosteriorError::Dimension {
            what: "model basis",
            expected: 1,
            found: 0,
        })?;
    let digest = model_digest(model);
    let mut precision = Array2::<f64>::zeros((width, width));
    let mut weighted = Array1::<f64>::zeros(width);
    let (mut folded, mut skipped, mut samples) = (0, 0, 0.0);
    for p in posteriors {
        if p.model != digest || p.blr.prior_var.len() != width + 1 {
            skipped += 1;
            continue;
        }
        let blr = Blr::from_snapshot(&p.blr)?;
        // The marginal of the basis's coefficients: their block of the covariance.
        let cov = blr.covariance();
        let block = cov.slice(ndarray::s![..width, ..width]).to_owned();
        let inv = cholesky(&block).and_then(|l| invert_lower(&l)).ok_or(
            PosteriorError::NotPositiveDefinite {
                what: "a posterior's marginal",
            },
        )?;
        let marginal = inv.t().dot(&inv);
        let mean = blr.mean().slice(ndarray::s![..width]).to_owned();
        weighted = weighted + marginal.dot(&mean);
        precision = precision + marginal;
        samples += blr.samples();
        folded += 1;
    }
    let correction = if folded == 0 {
        Array1::zeros(width)
    } else {
        let f = factor(&precision, &weighted).ok_or(PosteriorError::NotPositiveDefinite {
            what: "the fleet's precision",
        })?;
        f.mean
    };
    let mut out = model.clone();
    for m in &mut out.ensemble.members {
        if let Some(last) = m.layers.last_mut() {
            for (w, c) in last.weight.row_mut(0).iter_mut().zip(&correction) {
                #[allow(clippy::cast_possible_truncation)] // weights are f32
                {
                    *w += *c as f32;
                }
            }
        }
    }
    #[allow(clippy::cast_precision_loss)] // counts
    {
        out.meta
            .metrics
            .insert("posterior_fold_sites".into(), folded as f64);
    }
    out.meta
        .metrics
        .insert("posterior_fold_samples".into(), samples);
    Ok((
        out,
        FoldReport {
            folded,
            skipped,
            samples,
            correction: correction.to_vec(),
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic pseudo-random sequence in [-1, 1).
    fn lcg(seed: u64) -> impl FnMut() -> f64 {
        let mut s = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        move || {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((s >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
        }
    }

    #[test]
    fn the_factor_and_its_inverse_reproduce_the_matrix_and_a_non_definite_one_is_refused() {
        let mut r = lcg(7);
        for n in [1, 2, 5, 33] {
            // B Bᵀ + n I: symmetric positive definite.
            let b = Array2::from_shape_fn((n, n), |_| r());
            let a = b.dot(&b.t()) + Array2::<f64>::eye(n) * n as f64;
            let l = cholesky(&a).expect("positive definite");
            assert!(
                (0..n).all(|i| (i + 1..n).all(|j| l[[i, j]] == 0.0)),
                "not lower"
            );
            let err = (&l.dot(&l.t()) - &a)
                .iter()
                .fold(0.0f64, |m, v| m.max(v.abs()));
            assert!(err < 1e-9, "n = {n}: L Lᵀ off by {err}");
            let inv = invert_lower(&l).expect("square");
            let err = (&inv.dot(&l) - &Array2::<f64>::eye(n))
                .iter()
                .fold(0.0f64, |m, v| m.max(v.abs()));
            assert!(err < 1e-9, "n = {n}: L⁻¹ L off by {err}");
        }
        // Symmetric, one negative eigenvalue.
        let a = ndarray::array![[1.0, 2.0], [2.0, 1.0]];
        assert!(cholesky(&a).is_none());
        assert!(cholesky(&ndarray::array![[f64::NAN]]).is_none());
        assert!(invert_lower(&Array2::zeros((2, 3))).is_none());
    }

    #[test]
    fn with_no_data_the_posterior_predicts_the_prior() {
        let blr = Blr::new(&[0.5, 2.0, 0.1]).unwrap();
        let (m, v) = blr.predict(&[1.0, 1.0, 1.0]);
        assert_eq!(m, 0.0);
        assert!((v - 2.6).abs() < 1e-12, "{v}");
    }

    #[test]
    fn the_posterior_converges_to_a_shifted_truth_and_its_variance_shrinks() {
        // Truth: y = 0.3 z0 - 0.2 z1 + 0.1 (a constant), noise 0.05.
        let truth = [0.3, -0.2, 0.1];
        let mut blr = Blr::new(&[1.0, 1.0, 1.0]).unwrap();
        let mut r = lcg(7);
        let probe = [0.5, 0.5, 1.0];
        let mut vars = vec![blr.predict(&probe).1];
        for i in 0..400 {
            let z = [r(), r(), 1.0];
            let y: f64 = z.iter().zip(&truth).map(|(a, b)| a * b).sum::<f64>() + 0.05 * r();
            blr.observe(&z, y, 0.05 * 0.05, 1.0).unwrap();
            if i % 100 == 99 {
                vars.push(blr.predict(&probe).1);
            }
        }
        for (got, want) in blr.mean().iter().zip(&truth) {
            assert!((got - want).abs() < 0.02, "{:?}", blr.mean());
        }
        assert!(vars.windows(2).all(|w| w[1] < w[0]), "{vars:?}");
        assert!(vars[vars.len() - 1] < vars[0] / 100.0, "{vars:?}");
    }

    #[test]
    fn forgetting_tracks_a_truth_that_moves_and_keeps_the_variance_above_a_floor() {
        let mut blr = Blr::new(&[1.0, 1.0]).unwrap();
        let mut r = lcg(3);
        for _ in 0..300 {
            let z = [r(), 1.0];
            blr.observe(&z, 0.5 * z[0], 1e-4, 0.98).unwrap();
        }
        assert!((blr.mean()[0] - 0.5).abs() < 0.01);
        // The host changes: the slope is now -0.5. Within a few windows it follows.
        for _ in 0..300 {
            let z = [r(), 1.0];
            blr.observe(&z, -0.5 * z[0], 1e-4, 0.98).unwrap();
        }
        assert!((blr.mean()[0] + 0.5).abs() < 0.01, "{:?}", blr.mean());
        // Effective samples stay bounded by 1 / (1 - forget).
        assert!(blr.samples() < 51.0, "{}", blr.samples());
        // A direction never observed keeps its prior variance.
        let mut one = Blr::new(&[1.0, 1.0]).unwrap();
        for _ in 0..500 {
            one.observe(&[1.0, 0.0], 0.0, 1e-4, 0.98).unwrap();
        }
        assert!((one.predict(&[0.0, 1.0]).1 - 1.0).abs() < 1e-9);
    }

    #[test]
    fn a_bad_observation_is_refused_and_changes_nothing() {
        let mut blr = Blr::new(&[1.0, 1.0]).unwrap();
        blr.observe(&[1.0, 0.5], 0.3, 0.01, 0.99).unwrap();
        let before = blr.clone();
        assert!(blr.observe(&[f64::NAN, 0.0], 0.3, 0.01, 0.99).is_err());
        assert!(blr.observe(&[1.0], 0.3, 0.01, 0.99).is_err());
        assert!(blr.observe(&[1.0, 0.0], f64::INFINITY, 0.01, 0.99).is_err());
        assert!(blr.observe(&[1.0, 0.0], 0.3, 0.01, 0.0).is_err());
        assert_eq!(blr, before);
        // A zero noise variance is floored, not a division by zero.
        blr.observe(&[1.0, 0.0], 0.3, 0.0, 1.0).unwrap();
        assert!(blr.mean().iter().all(|v| v.is_finite()));
    }

    #[test]
    fn a_batch_predicts_as_one_at_a_time() {
        let mut blr = Blr::new(&[0.3, 0.7, 1.0]).unwrap();
        let mut r = lcg(11);
        for _ in 0..20 {
            let z = [r(), r(), 1.0];
            blr.observe(&z, r(), 0.1, 0.99).unwrap();
        }
        let rows = Array2::from_shape_fn((5, 3), |(i, j)| (i as f64 - 2.0) * 0.3 + j as f64);
        let batch = blr.predict_rows(rows.view());
        for (i, (m, v)) in batch.iter().enumerate() {
            let (m1, v1) = blr.predict(rows.row(i).as_slice().unwrap());
            assert!((m - m1).abs() < 1e-12 && (v - v1).abs() < 1e-12);
        }
    }

    #[test]
    fn changes_predict_as_regressors_with_a_constant_whose_variance_is_left_out() {
        let mut blr = Blr::new(&[0.3, 0.7, 0.05]).unwrap();
        let mut r = lcg(5);
        for _ in 0..20 {
            blr.observe(&[r(), r(), 1.0], r(), 0.1, 0.99).unwrap();
        }
        let delta = Array2::from_shape_fn((4, 2), |(i, j)| (i as f32 - 1.5) * 0.2 + j as f32);
        for (i, (m, v)) in blr.predict_changes(delta.view()).into_iter().enumerate() {
            let (a, b) = (f64::from(delta[[i, 0]]), f64::from(delta[[i, 1]]));
            let (m1, _) = blr.predict(&[a, b, 1.0]);
            let (_, v1) = blr.predict(&[a, b, 0.0]);
            assert!((m - m1).abs() < 1e-9 && (v - v1).abs() < 1e-5 * v1.max(1e-3));
        }
    }

    #[test]
    fn a_snapshot_round_trips_and_a_corrupt_one_is_refused() {
        let mut blr = Blr::new(&[0.5, 1.0]).unwrap();
        blr.observe(&[0.3, 1.0], 0.2, 0.01, 0.99).unwrap();
        let json = serde_json::to_string(&blr.snapshot()).unwrap();
        let back = Blr::from_snapshot(&serde_json::from_str(&json).unwrap()).unwrap();
        assert_eq!(back.predict(&[1.0, 1.0]), blr.predict(&[1.0, 1.0]));
        let mut s = blr.snapshot();
        s.precision[1] += 1.0;
        assert_eq!(
            Blr::from_snapshot(&s),
            Err(PosteriorError::NotPositiveDefinite { what: "snapshot" })
        );
        let mut s = blr.snapshot();
        s.precision = vec![-1.0, 0.0, 0.0, 1.0];
        assert!(Blr::from_snapshot(&s).is_err());
        let mut s = blr.snapshot();
        s.shift.pop();
        assert!(matches!(
            Blr::from_snapshot(&s),
            Err(PosteriorError::Dimension { what: "shift", .. })
        ));
        let too_wide = vec![1.0; MAX_DIM + 1];
        assert!(Blr::new(&too_wide).is_err());
    }

    /// A posterior of `model` that saw `y = truth · basis` at `n` points of its basis.
    fn learnt(model: &Model, truth: &[f64], n: usize, seed: u64) -> PosteriorSnapshot {
        let w = model.ensemble.basis_width().unwrap();
        let mut prior = vec![1.0; w];
        prior.push(0.01);
        let mut blr = Blr::new(&prior).unwrap();
        let mut r = lcg(seed);
        for _ in 0..n {
            let mut z: Vec<f64> = (0..w).map(|_| r()).collect();
            z.push(1.0);
            let y: f64 = z.iter().zip(truth).map(|(a, b)| a * b).sum();
            blr.observe(&z, y, 1e-4, 1.0).unwrap();
        }
        PosteriorSnapshot {
            model: model_digest(model),
            blr: blr.snapshot(),
        }
    }

    #[test]
    fn a_fleets_posteriors_fold_into_the_output_layer_weighted_by_their_evidence() {
        let model = Model::synthetic(3, &[4], 5);
        let x = Array2::from_shape_fn((6, crate::N_FEATURES), |(i, j)| {
            ((i * 7 + j * 3) % 11) as f32 / 11.0
        });
        // Two hosts agree on the correction; a third saw one point and says little.
        let truth = [0.2, -0.1, 0.0, 0.3, 0.05];
        let far = [-1.0, 1.0, 1.0, -1.0, 0.0];
        let fleet = vec![
            learnt(&model, &truth, 200, 1),
            learnt(&model, &truth, 200, 2),
            learnt(&model, &far, 1, 3),
            // Another model's posterior: skipped.
            PosteriorSnapshot {
                model: "sha256:other".into(),
                ..learnt(&model, &far, 200, 4)
            },
        ];
        let (folded, report) = fold(&model, &fleet).unwrap();
        assert_eq!((report.folded, report.skipped), (3, 1));
        for (c, t) in report.correction.iter().zip(&truth) {
            assert!((c - t).abs() < 0.02, "{:?}", report.correction);
        }
        // The folded model predicts the shipped one plus the correction on its basis.
        let (before, basis) = model.ensemble.members_predict_basis(x.view());
        let after = folded.ensemble.members_predict(x.view());
        let basis = basis.unwrap();
        let k = before.nrows() as f64;
        for i in 0..x.nrows() {
            let shift: f64 = basis
                .row(i)
                .iter()
                .zip(&report.correction)
                .map(|(h, c)| f64::from(*h) * c)
                .sum();
            let b: f64 = before.column(i).iter().map(|v| f64::from(*v)).sum::<f64>() / k;
            let a: f64 = after.column(i).iter().map(|v| f64::from(*v)).sum::<f64>() / k;
            assert!((a - (b + shift)).abs() < 1e-4, "{a} {b} {shift}");
        }
        assert_eq!(folded.meta.metrics["posterior_fold_sites"], 3.0);
        // Nothing to fold: the model as it was.
        let (same, r) = fold(&model, &[]).unwrap();
        assert_eq!(r.folded, 0);
        assert_eq!(same.ensemble, model.ensemble);
    }
}
