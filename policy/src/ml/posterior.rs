//! The per-host posterior of the `ml` policy (issue 45): each latency-critical CPU
//! service's correction of the shipped model, learnt from this host's readings.
//!
//! **Problem.** The anchored prediction (step 2) trusts the model's predicted *change* from
//! the allocation in force, within the members' spread on it. On a host the model was not
//! trained for, the change is off in ways a single bias cannot fix (a core worth half what
//! the model thinks), and the spread never shrinks with evidence: a service whose members
//! disagree stays on the fallback ("model unsure") however long it runs.
//!
//! **Approach.** Bayesian linear regression on the model's basis
//! ([`cohabit_models::posterior`]): the anchored prediction's error, read one tick later,
//! is regressed on `z = [Δφ, 1]`: `Δφ`, the change of the members' mean last hidden layer
//! from the allocation in force to the allocation chosen, is a correction of the output
//! layer (a change the model over- or under-rates); the constant is what the per-service
//! bias has not caught up with yet. The bias itself stays as before, quick (the constant
//! alone in its place, forgotten as slowly as the rest, followed load changes too late),
//! and the constant keeps a drift from being read as a correction of the directions the
//! allocation happened to move in (without it fewer built-in runs met QoS; docs/RESULTS.md,
//! "Per-host posterior (issue 45)", has today's figures). The model's calibrated spread of
//! a change `s` is split in two:
//! the members' raw disagreement `s / scale` ([`cohabit_models::ModelMetadata::change_sigma_scale`]),
//! what the model does not know and a host's readings can teach, is the posterior's prior
//! (its variance per basis unit fitted once per service so that the prior spread of a
//! change is the raw disagreement on average over probe steps around the first allocation
//! read, [`PROBE_STEPS`]); the rest, `s² (1 - 1/scale²)`, is what no reading removes
//! (noise the calibration covers) and is each reading's noise, with the measurement's
//! (with the whole calibrated spread as the prior, far fewer runs met QoS). So
//! with no data the posterior predicts the model with its spread, and where the members
//! disagree (a host unlike the training data) the evidence narrows the spread; where they
//! agree (in distribution) there is little to learn and the posterior moves little.
//!
//! **Algorithm.** Per tick and service: learn the last anchored prediction's error (its
//! regressor kept with it, [`super::state::LastPrediction::regressor`]; a held allocation
//! teaches the constant alone), clipped to ±[`RESIDUAL_CLIP`] (a cliff is not a
//! slope; the measured cliffs, step 4, hold those), forgetting [`FORGET`] per reading; then
//! every candidate's prediction is `measured + Δmodel + bias + mean · z` with variance
//! `factor² (s² (1 - 1/scale²) + Δφᵀ Σ Δφ) + noise²` (`factor`, the service's spread
//! factor, as before) — the search's pessimistic bound and the fallback's "model unsure"
//! test read that spread instead of the members'.
//!
//! **Properties.** O(d²) per candidate (one matrix product per batch) and O(d³) per reading,
//! d = width ≤ 64 (32 for the shipped models); a service's posterior is bounded in size
//! whatever the run's length. Readings past saturation, or of a prediction made from the
//! model's level (no anchor), teach it nothing, as they teach the bias nothing.

use cohabit_models::posterior::{Blr, MAX_BASIS_WIDTH, MAX_DIM};
use ndarray::ArrayView1;

/// Weight kept by the evidence so far at each new reading: old readings fade (half in 69
/// readings) so the posterior follows a host that changes, and the posterior never rests
/// on more than 100 readings' worth.
pub(super) const FORGET: f64 = 0.99;

/// Prior spread (ln units) of the constant: what is left of a change's error after the
/// per-service bias (a drift the bias has not caught up with yet). Kept in the regression so
/// that a drift is not read as a correction of the directions the allocation moved in.
pub(super) const CONSTANT_PRIOR_SIGMA: f64 = 0.05;

/// Largest error (ln units) a reading teaches the posterior.
pub(super) const RESIDUAL_CLIP: f64 = 1.0;

/// Bounds on the prior variance per basis unit (a model whose spread or basis is
/// degenerate must not make the prior either certain or infinite).
const PRIOR_SCALE_RANGE: (f64, f64) = (1e-8, 1e4);

/// Steps around the allocation in force the prior's scale is fitted on: (cores × this,
/// ways + this).
pub(super) const PROBE_STEPS: [(f64, i32); 8] = [
    (0.5, 0),
    (0.75, 0),
    (1.25, 0),
    (1.5, 0),
    (1.0, -2),
    (1.0, -1),
    (1.0, 1),
    (1.0, 2),
];

/// One candidate's regressor: the change of the model's basis from the allocation in force
/// to it. Inline (no allocation per candidate scored).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Regressor {
    z: [f32; MAX_DIM],
    len: u8,
}

impl Regressor {
    /// `[delta, 1]`, when it fits ([`MAX_BASIS_WIDTH`]).
    pub(super) fn of_change(delta: ArrayView1<'_, f32>) -> Option<Self> {
        if delta.len() > MAX_BASIS_WIDTH {
            return None;
        }
        let mut z = [0.0; MAX_DIM];
        for (o, d) in z.iter_mut().zip(delta.iter()) {
            *o = *d;
        }
        z[delta.len()] = 1.0;
        Some(Self {
            z,
            len: u8::try_from(delta.len() + 1).ok()?,
        })
    }

    /// The regressor of the allocation in force itself (no change: the constant alone) for
    /// a posterior of `dim` coefficients.
    pub(super) fn constant(dim: usize) -> Option<Self> {
        let zeros = vec![0.0f32; dim.checked_sub(1)?];
        Self::of_change(ArrayView1::from(&zeros[..]))
    }

    /// Width.
    pub(super) fn len(&self) -> usize {
        usize::from(self.len)
    }

    /// Coefficient `j`'s value (0 past the end).
    pub(super) fn get(&self, j: usize) -> f64 {
        if j < self.len() {
            f64::from(self.z[j])
        } else {
            0.0
        }
    }

    /// The values.
    pub(super) fn to_vec(self) -> Vec<f64> {
        (0..self.len()).map(|j| self.get(j)).collect()
    }
}

/// A posterior of a basis `width` wide whose prior variance per basis unit is `scale`
/// (clamped to a sane range), and a constant ([`CONSTANT_PRIOR_SIGMA`]); `None` past
/// [`MAX_BASIS_WIDTH`].
pub(super) fn prior(width: usize, scale: f64) -> Option<Blr> {
    if width == 0 || width > MAX_BASIS_WIDTH || !scale.is_finite() {
        return None;
    }
    let s = scale.clamp(PRIOR_SCALE_RANGE.0, PRIOR_SCALE_RANGE.1);
    let mut var = vec![s; width];
    var.push(CONSTANT_PRIOR_SIGMA * CONSTANT_PRIOR_SIGMA);
    Blr::new(&var).ok()
}

/// The share of a model's calibrated spread of a change that is the members' own
/// disagreement, `1 / scale²` (at most 1): what a host's readings can teach.
pub(super) fn learnable_share(change_sigma_scale: f32) -> f64 {
    let s = f64::from(change_sigma_scale);
    if s.is_finite() && s > 1.0 {
        1.0 / (s * s)
    } else {
        1.0
    }
}

/// Learns one reading: `error` (measured less the prediction without the posterior's
/// correction) at `regressor`, with `noise_var` what of it no reading removes. A regressor
/// of another width (a model replaced since) teaches nothing. False when nothing was
/// learnt.
pub(super) fn learn(blr: &mut Blr, regressor: &Regressor, error: f64, noise_var: f64) -> bool {
    if regressor.len() != blr.dim() {
        return false;
    }
    let y = error.clamp(-RESIDUAL_CLIP, RESIDUAL_CLIP);
    blr.observe(&regressor.to_vec(), y, noise_var, FORGET)
        .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_regressor_is_the_basis_change_and_a_constant() {
        let d = [0.5f32, -0.25];
        let r = Regressor::of_change(ArrayView1::from(&d[..])).unwrap();
        assert_eq!(r.to_vec(), vec![0.5, -0.25, 1.0]);
        assert_eq!(
            Regressor::constant(3).unwrap().to_vec(),
            vec![0.0, 0.0, 1.0]
        );
        let wide = vec![1.0f32; MAX_BASIS_WIDTH + 1];
        assert!(Regressor::of_change(ArrayView1::from(&wide[..])).is_none());
    }

    #[test]
    fn the_prior_is_centred_on_the_model_with_the_fitted_spread() {
        let blr = prior(2, 0.04).unwrap();
        let z = Regressor::of_change(ArrayView1::from(&[1.0f32, 1.0][..])).unwrap();
        let (m, v) = blr.predict(&z.to_vec());
        assert_eq!(m, 0.0);
        let c2 = CONSTANT_PRIOR_SIGMA * CONSTANT_PRIOR_SIGMA;
        assert!((v - (0.08 + c2)).abs() < 1e-12);
        assert!(prior(MAX_BASIS_WIDTH + 1, 0.04).is_none());
        assert!(prior(2, f64::NAN).is_none());
        // The members' disagreement is the calibrated spread over its scale.
        assert!((learnable_share(4.0) - 1.0 / 16.0).abs() < 1e-12);
        assert_eq!(learnable_share(0.5), 1.0);
    }

    #[test]
    fn a_large_error_teaches_no_more_than_the_clip() {
        let mut a = prior(1, 1.0).unwrap();
        let mut b = a.clone();
        let r = Regressor::of_change(ArrayView1::from(&[1.0f32][..])).unwrap();
        assert!(learn(&mut a, &r, 5.0, 0.01));
        assert!(learn(&mut b, &r, RESIDUAL_CLIP, 0.01));
        assert_eq!(a.mean(), b.mean());
        // Another width: nothing learnt.
        let other = Regressor::constant(3).unwrap();
        assert!(!learn(&mut a, &other, 0.1, 0.01));
    }
}

#[cfg(test)]
mod learning {
    use cohabit_core::{Allocation, Sample};
    use cohabit_models::{Model, Neighbours, FEATURE_NAMES};

    use super::super::cpu::fit_prior;
    use super::super::predict::{at_full_mba, Basis, Pred, Predictor};
    use super::super::state::{LastPrediction, Measurement, ServiceState};
    use super::super::tests::{host, linear_model};
    use super::super::MlConfig;

    /// Two members that say a core more is worth +1.8 and -7.2 per unit of `cores_cand`
    /// (a share of the host's 36 cores): the model's change is their mean, -2.7, its spread
    /// 4.5 per unit (they disagree, as on a host unlike the training data).
    fn model() -> Model {
        let c = FEATURE_NAMES
            .iter()
            .position(|n| *n == "cores_cand")
            .unwrap();
        linear_model(&[(0.0, &[(c, 1.8)]), (0.0, &[(c, -7.2)])])
    }

    /// On this host a core is worth half what the model says: the truth's change from 18
    /// cores to `cores`.
    fn truth(cores: u32) -> f64 {
        -1.35 * (f64::from(cores) - 18.0) / 36.0
    }

    /// The prediction for `cand` from 18 cores measured at half the target, with the
    /// service's posterior.
    fn predict(model: &Model, st: &ServiceState, cand: Allocation) -> Pred {
        let (h, nb) = (host(), Neighbours::default());
        let sample = Sample {
            p99_ms: Some(0.5),
            requests_per_s: Some(100.0),
            cpu_busy_cores: Some(2.0),
            ..Sample::default()
        };
        let current = at_full_mba(18, 10);
        let p = Predictor {
            model,
            host: &h,
            target_ms: 1.0,
            sample: &sample,
            current: &current,
            neighbours: &nb,
            cand_neighbours: &nb,
            basis: Basis {
                anchor: Some(0.5f64.ln()),
                ..Basis::default()
            },
            reference_out: None,
            posterior: st.posterior.as_ref(),
        };
        p.predict_many(&[cand])[0]
    }

    #[test]
    fn the_posterior_learns_that_a_core_is_worth_half_and_grows_sure_enough_for_the_model_path() {
        let model = model();
        // The prior, fitted on the probes around 18 cores.
        let posterior = {
            let (h, nb, s) = (host(), Neighbours::default(), Sample::default());
            let current = at_full_mba(18, 10);
            let p = Predictor {
                model: &model,
                host: &h,
                target_ms: 1.0,
                sample: &s,
                current: &current,
                neighbours: &nb,
                cand_neighbours: &nb,
                basis: Basis {
                    anchor: Some(0.5f64.ln()),
                    ..Basis::default()
                },
                reference_out: None,
                posterior: None,
            };
            fit_prior(&p, &model, 100)
        };
        assert!(posterior.is_some());
        let mut st = ServiceState {
            posterior,
            ..ServiceState::default()
        };
        let probe = at_full_mba(12, 10);
        let before = predict(&model, &st, probe);
        // With no data the posterior predicts the model.
        assert!((before.mean - before.prior.0).abs() < 1e-9, "{before:?}");
        let want = 0.5f64.ln() + truth(12);
        assert!((before.mean - want).abs() > 0.2, "{before:?}");
        let cfg = MlConfig::default();
        for i in 0..60u32 {
            let cores = [9, 14, 22, 27, 16, 20][i as usize % 6];
            let cand = at_full_mba(cores, 10);
            let p = predict(&model, &st, cand);
            let noise = 0.02 * f64::from(i % 5) - 0.04;
            let measured = 0.5f64.ln() + truth(cores) + noise;
            let m = Measurement {
                last: LastPrediction {
                    alloc: cand,
                    base: p.prior.0,
                    corrected: p.mean,
                    sigma: p.sigma,
                    model_sigma: p.model_sigma,
                    moved: true,
                    shrank: cores < 18,
                    anchored: true,
                    regressor: p.regressor,
                    prior_mean: p.prior.0,
                    irreducible: p.irreducible,
                },
                measured,
                windows: (1, 1),
                rps: Some(100.0),
            };
            st.learn(&m, &cfg);
        }
        let after = predict(&model, &st, probe);
        assert!((after.mean - want).abs() < 0.05, "{after:?}, want {want}");
        // The model's own prediction is kept as the prior, unchanged.
        assert!((after.prior.0 - before.prior.0).abs() < 1e-9);
        // Surer where it has seen the host: the model was too unsure of 12 cores for the
        // search (`unsure_sigma`), and is sure enough now.
        assert!(before.sigma > cfg.unsure_sigma, "{before:?}");
        assert!(after.sigma < 0.5 * cfg.unsure_sigma, "{after:?}");
    }
}
