//! Step 2 of the `ml` policy: predictions of ln(p99/target) for one service's candidate
//! allocations, anchored on what the allocation in force measured, and the check that the
//! model's inputs lie within its training range.
//!
//! Candidates may also change the neighbours' bandwidth (a throttled best-effort pool,
//! [`super::mba`]): the change is then predicted from the allocation in force with the
//! neighbours as measured to the candidate with the neighbours as planned.
//!
//! The prediction for the allocation each service is then given is recorded
//! ([`MlPolicy::record_predictions`]): written into the decision log, and remembered as the
//! service's last for step 1's correction at the next tick.

use std::cell::OnceCell;
use std::collections::BTreeMap;

use cohabit_core::{
    Allocation, Estimate, HostCapacity, Observation, Plan, PosteriorEstimate, Prediction, Sample,
    WayRange,
};
use cohabit_models::features::CANDIDATE_FEATURES;
use cohabit_models::posterior::Blr;
use cohabit_models::{
    features, present, Model, ModelMetadata, Neighbours, FEATURE_NAMES, N_FEATURES,
};
use ndarray::{Array2, ArrayView1, ArrayView2};

use super::posterior::{learnable_share, Regressor};
use super::state::LastPrediction;
use super::{MlPolicy, ServicePlan};

/// Prior noise of one measured p99 (ln units), before the service's own is measured.
pub(super) const MEASUREMENT_SIGMA: f64 = 0.05;

/// p99 over target beyond which a measurement is not used as an anchor.
pub(super) const SATURATED: f64 = 2.0;

/// One prediction of ln(p99/target).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Pred {
    pub(super) mean: f64,
    /// Total spread: the posterior's where one predicted, else the model's times the
    /// service's factor; and the measurement noise.
    pub(super) sigma: f64,
    /// The model's own spread.
    pub(super) model_sigma: f64,
    /// The shipped model's prediction (mean, spread) before the posterior: `(mean, sigma)`
    /// where no posterior predicted.
    pub(super) prior: (f64, f64),
    /// What the posterior regressed this candidate on, where it predicted it: learnt from
    /// when the candidate is chosen and read back ([`super::state::ServiceState::learn`]).
    pub(super) regressor: Option<Regressor>,
    /// The variance of this prediction's error that no reading removes (the calibrated
    /// spread beyond the members' disagreement, and the measurement's noise): a reading's
    /// noise for the posterior. `sigma²` without one.
    pub(super) irreducible: f64,
}

impl Pred {
    /// A prediction without a posterior.
    pub(super) fn plain(mean: f64, sigma: f64, model_sigma: f64) -> Self {
        Self {
            mean,
            sigma,
            model_sigma,
            prior: (mean, sigma),
            regressor: None,
            irreducible: sigma * sigma,
        }
    }
}

/// The reference's outputs (the allocation in force with the neighbours as measured): each
/// member's, and the members' mean basis ([`cohabit_models::mlp::Ensemble::basis_width`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub(super) struct Reference {
    pub(super) out: Vec<f32>,
    pub(super) basis: Option<Vec<f32>>,
}

/// The model's predicted change from the reference to each candidate: mean, calibrated
/// spread, and the change of the basis (candidates × width) where the model has one.
type Change = (Vec<f64>, Vec<f64>, Option<Array2<f32>>);

/// How one service's candidates are predicted this tick.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Basis {
    /// Measured ln(p99/target) of the allocation in force, when usable as an anchor.
    pub(super) anchor: Option<f64>,
    pub(super) bias: f64,
    pub(super) factor: f64,
    /// Spread of one measurement.
    pub(super) noise: f64,
}

impl Default for Basis {
    fn default() -> Self {
        Self {
            anchor: None,
            bias: 0.0,
            factor: 1.0,
            noise: MEASUREMENT_SIGMA,
        }
    }
}

/// Everything needed to predict one service's candidates at one tick: the model, the host,
/// what the service measured under the allocation in force, and its [`Basis`].
#[derive(Debug, Clone, Copy)]
pub(super) struct Predictor<'a> {
    pub(super) model: &'a Model,
    pub(super) host: &'a HostCapacity,
    pub(super) target_ms: f64,
    pub(super) sample: &'a Sample,
    pub(super) current: &'a Allocation,
    /// The neighbours as measured under the allocation in force.
    pub(super) neighbours: &'a Neighbours,
    /// The neighbours as the candidates would have them (the pool's MBA level planned).
    pub(super) cand_neighbours: &'a Neighbours,
    pub(super) basis: Basis,
    /// Every member's output for the reference (the allocation in force with the neighbours
    /// as measured), computed once per tick and shared by every pool level planned
    /// (`None`: computed on each use).
    pub(super) reference_out: Option<&'a OnceCell<Reference>>,
    /// The service's posterior on this host, when it keeps one ([`super::posterior`]): its
    /// mean corrects an anchored prediction's change and its variance replaces the
    /// members' spread.
    pub(super) posterior: Option<&'a Blr>,
}

impl Predictor<'_> {
    /// The model's inputs for `candidate`, with the neighbours as planned.
    pub(super) fn features(&self, candidate: &Allocation) -> [f32; N_FEATURES] {
        features(
            self.host,
            self.target_ms,
            self.sample,
            self.current,
            candidate,
            self.cand_neighbours,
        )
    }

    /// The model's inputs for the allocation in force with the neighbours as measured:
    /// what the anchor was measured under.
    fn reference(&self) -> [f32; N_FEATURES] {
        features(
            self.host,
            self.target_ms,
            self.sample,
            self.current,
            self.current,
            self.neighbours,
        )
    }

    /// The change from the reference to each of `rows` (raw features), its spread and the
    /// basis's change, per member as [`Model::score_change_basis`] does, when the
    /// neighbours differ: the rows share every feature outside the candidate's with
    /// `features(current)` at the planned neighbours, not with the reference.
    fn change_with_neighbours(&self, rows: &Array2<f32>) -> Change {
        let n = rows.nrows();
        let mut all = Array2::<f32>::zeros((n + 1, N_FEATURES));
        all.row_mut(0)
            .assign(&ArrayView1::from(&self.features(self.current)[..]));
        all.slice_mut(ndarray::s![1.., ..]).assign(rows);
        let ens = &self.model.ensemble;
        let (out, basis) = ens.members_predict_shared_basis(all.view(), &CANDIDATE_FEATURES);
        let reference = || {
            let r = self.reference();
            match ArrayView2::from_shape((1, N_FEATURES), &r[..]) {
                Ok(r) => {
                    let (out, basis) = ens.members_predict_basis(r);
                    Reference {
                        out: out.column(0).to_vec(),
                        basis: basis.map(|b| b.row(0).to_vec()),
                    }
                }
                Err(_) => Reference {
                    out: vec![0.0; ens.members.len()],
                    basis: None,
                },
            }
        };
        let fresh;
        let base: &Reference = match self.reference_out {
            Some(cell) => cell.get_or_init(reference),
            None => {
                fresh = reference();
                &fresh
            }
        };
        let k = out.nrows().max(1) as f64;
        let scale = f64::from(
            self.model
                .meta
                .change_sigma_scale
                .unwrap_or(self.model.meta.sigma_scale),
        );
        let mut mean = vec![0.0; n];
        let mut var = vec![0.0; n];
        for (m, member) in out.rows().into_iter().enumerate() {
            let b = f64::from(base.out.get(m).copied().unwrap_or(0.0));
            for i in 0..n {
                let d = f64::from(member[i + 1]) - b;
                mean[i] += d;
                var[i] += d * d;
            }
        }
        let spread = mean
            .iter_mut()
            .zip(&var)
            .map(|(m, v)| {
                *m /= k;
                (v / k - *m * *m).max(0.0).sqrt() * scale
            })
            .collect();
        let delta = basis.zip(base.basis.as_ref()).and_then(|(b, r)| {
            (b.ncols() == r.len()).then(|| {
                let r = ndarray::Array1::from(r.clone());
                b.slice(ndarray::s![1.., ..]).to_owned() - &r
            })
        });
        (mean, spread, delta)
    }

    /// The model's change from the allocation in force to each candidate (`rows`, raw
    /// features), its calibrated spread and the basis's change.
    fn change(&self, rows: &Array2<f32>) -> Change {
        if self.neighbours == self.cand_neighbours {
            let reference = self.reference();
            let (d, s, delta) = self
                .model
                .score_change_basis(ArrayView1::from(&reference[..]), rows.view());
            (
                d.iter().map(|v| f64::from(*v)).collect(),
                s.iter().map(|v| f64::from(*v)).collect(),
                delta,
            )
        } else {
            self.change_with_neighbours(rows)
        }
    }

    /// The posterior's (mean, variance) of the correction for each change of the basis in
    /// `delta`, with its regressor (none for no change: no correction), where there is a
    /// posterior of the basis's width.
    #[allow(clippy::type_complexity)]
    fn posterior_rows(
        &self,
        delta: Option<&Array2<f32>>,
        n: usize,
    ) -> Option<Vec<Option<((f64, f64), Regressor)>>> {
        let blr = self.posterior?;
        let delta = delta?;
        if delta.nrows() != n || delta.ncols() + 1 != blr.dim() {
            return None;
        }
        let regressors = delta.rows().into_iter().map(Regressor::of_change);
        let fit = blr.predict_changes(delta.view());
        Some(
            regressors
                .zip(fit)
                .map(|(r, f)| r.map(|r| (f, r)))
                .collect(),
        )
    }

    /// The prior variance per basis unit that makes the posterior's prior spread of these
    /// candidates' changes the members' raw disagreement on them, on average (the sum of
    /// their squared raw spreads over the sum of their squared basis changes); `None`
    /// without an anchor, a basis, or a change.
    pub(super) fn prior_scale(&self, cands: &[Allocation]) -> Option<f64> {
        self.basis.anchor?;
        let rows = self.rows(cands);
        let (_, spread, delta) = self.change(&rows);
        let delta = delta?;
        let raw = learnable_share(self.change_sigma_scale());
        let s2: f64 = spread.iter().map(|s| s * s * raw).sum();
        let d2: f64 = delta.iter().map(|v| f64::from(*v) * f64::from(*v)).sum();
        (d2 > 1e-9 && s2 > 0.0).then(|| s2 / d2)
    }

    /// The factor the members' disagreement on a change is calibrated by.
    fn change_sigma_scale(&self) -> f32 {
        self.model
            .meta
            .change_sigma_scale
            .unwrap_or(self.model.meta.sigma_scale)
    }

    /// The model's inputs for each candidate.
    fn rows(&self, cands: &[Allocation]) -> Array2<f32> {
        let mut rows = Array2::<f32>::zeros((cands.len(), N_FEATURES));
        for (r, c) in cands.iter().enumerate() {
            rows.row_mut(r)
                .assign(&ArrayView1::from(&self.features(c)[..]));
        }
        rows
    }

    /// Predictions (mean, spread) of ln(p99/target) for candidates of one service.
    ///
    /// Anchored (the allocation in force was measured and is not saturated): the measured
    /// value plus the model's predicted *change* from the allocation in force, whose spread is
    /// the members' disagreement on that change plus the measurement's own noise. Otherwise
    /// the model's level. Both plus the learned bias; spreads times the service's factor.
    /// With a posterior ([`super::posterior`]), an anchored prediction's change is
    /// corrected by the posterior's mean on the basis's change, and the members' part of
    /// its spread is the posterior's; the model's own prediction is kept as the prior.
    pub(super) fn predict_many(&self, cands: &[Allocation]) -> Vec<Pred> {
        let b = self.basis;
        // Anchored, the allocation in force is predicted as measured: no model needed.
        let same = |c: &Allocation| {
            c.cores == self.current.cores
                && c.llc_ways.count == self.current.llc_ways.count
                && c.mba_pct == self.current.mba_pct
        };
        let same_neighbours = self.neighbours == self.cand_neighbours;
        if let (Some(q), true) = (b.anchor, same_neighbours && cands.iter().all(same)) {
            let mut p = Pred::plain(q + b.bias, b.noise, 0.0);
            if let Some((blr, z)) = self
                .posterior
                .and_then(|blr| Some((blr, Regressor::constant(blr.dim())?)))
            {
                p.mean += blr.predict(&z.to_vec()).0;
                p.regressor = Some(z);
            }
            return vec![p; cands.len()];
        }
        let rows = self.rows(cands);
        match b.anchor {
            Some(q) => {
                let (d, s, delta) = self.change(&rows);
                let post = self.posterior_rows(delta.as_ref(), cands.len());
                let fixed = 1.0 - learnable_share(self.change_sigma_scale());
                d.iter()
                    .zip(s.iter())
                    .enumerate()
                    .map(|(i, (d, s))| {
                        let model_sigma = *s;
                        let scaled = model_sigma * b.factor;
                        let mut p = Pred::plain(
                            q + *d + b.bias,
                            (scaled * scaled + b.noise * b.noise).sqrt(),
                            model_sigma,
                        );
                        if let Some(Some(((m, v), z))) = post.as_ref().map(|p| p[i]) {
                            // What no reading removes, and what the posterior has left.
                            let unlearnable = s * s * fixed;
                            let model_sigma = (unlearnable + v).sqrt();
                            let f2 = b.factor * b.factor;
                            p.mean += m;
                            p.sigma = (f2 * (unlearnable + v) + b.noise * b.noise).sqrt();
                            p.model_sigma = model_sigma;
                            p.irreducible = f2 * unlearnable + b.noise * b.noise;
                            p.regressor = Some(z);
                        }
                        p
                    })
                    .collect()
            }
            None => {
                let (m, s) = self.model.score(rows.view());
                m.iter()
                    .zip(s.iter())
                    .map(|(m, s)| {
                        Pred::plain(
                            f64::from(*m) + b.bias,
                            f64::from(*s) * b.factor,
                            f64::from(*s),
                        )
                    })
                    .collect()
            }
        }
    }
}

impl MlPolicy {
    /// Predictions for the CPU services whose inputs are in range (model path or fallback)
    /// under `plan`, for the log and the next tick's correction.
    pub(super) fn record_predictions(
        &mut self,
        obs: &Observation,
        plans: &[ServicePlan],
        plan: &Plan,
    ) -> BTreeMap<String, Prediction> {
        let mut predictions = BTreeMap::new();
        for p in plans.iter().filter(|p| p.predictable) {
            if let Some(pred) = self.record_prediction(obs, &p.name, plan) {
                predictions.insert(p.name.clone(), pred);
            }
        }
        predictions
    }

    /// The prediction for service `name` under `plan` (reused from the search when it was
    /// scored there), remembered as its last.
    pub(super) fn record_prediction(
        &mut self,
        obs: &Observation,
        name: &str,
        plan: &Plan,
    ) -> Option<Prediction> {
        let o = obs.services.iter().find(|o| o.spec.name == name)?;
        let (Some(target), Some(cand)) = (o.spec.p99_target_ms(), plan.services.get(name).copied())
        else {
            return None;
        };
        let current = obs.current.services.get(name).copied().unwrap_or(cand);
        let neighbours = Neighbours::observed(obs, name, &self.ctx.host);
        let cand_neighbours = self.planned_neighbours(neighbours);
        let basis = self.state.get(name).map(|s| s.basis).unwrap_or_default();
        let known = self.state.get_mut(name).and_then(|st| {
            let key = (cand.cores, cand.llc_ways.count);
            let hit = (cand.mba_pct == st.scored_mba)
                .then(|| st.scored.iter().find(|(k, _)| *k == key).map(|(_, p)| *p))
                .flatten();
            st.scored.clear();
            hit
        });
        let posterior = self.state.get(name).and_then(|s| s.posterior.as_ref());
        let samples = posterior.map(Blr::samples);
        let predictor = Predictor {
            model: &self.model,
            host: &self.ctx.host,
            target_ms: target,
            sample: &o.sample,
            current: &current,
            neighbours: &neighbours,
            cand_neighbours: &cand_neighbours,
            basis,
            // The planners' reference is the allocation in force: shared only when there is one.
            reference_out: obs
                .current
                .services
                .get(name)
                .and(self.references.get(name)),
            posterior,
        };
        let Pred {
            mean,
            sigma,
            model_sigma,
            prior,
            regressor,
            irreducible,
        } = known.or_else(|| predictor.predict_many(&[cand]).first().copied())?;
        let bias = basis.bias;
        if let Some(st) = self.state.get_mut(name) {
            st.last = Some(LastPrediction {
                alloc: cand,
                base: prior.0 - bias,
                corrected: mean,
                sigma,
                model_sigma,
                moved: cand != current,
                shrank: cand.cores <= current.cores
                    && cand.llc_ways.count <= current.llc_ways.count
                    && (cand.cores, cand.llc_ways.count) != (current.cores, current.llc_ways.count),
                anchored: basis.anchor.is_some(),
                regressor,
                prior_mean: prior.0,
                irreducible,
            });
        }
        let mut p = Prediction::new(mean, sigma);
        if let (Some(samples), Some(_)) = (samples, regressor) {
            p.prior = Some(Estimate {
                log_qos_ratio: prior.0,
                log_qos_sigma: prior.1,
            });
            p.posterior = Some(PosteriorEstimate {
                log_qos_ratio: mean,
                log_qos_sigma: sigma,
                samples,
            });
        }
        Some(p)
    }
}

/// A candidate of `cores` cores and `ways` ways at full memory bandwidth, as the search
/// scores them.
#[cfg(test)]
pub(super) fn at_full_mba(cores: u32, ways: u32) -> Allocation {
    at_mba(cores, ways, cohabit_core::MBA_MAX_PCT)
}

/// A candidate of `cores` cores and `ways` ways at MBA `mba_pct`.
pub(super) fn at_mba(cores: u32, ways: u32, mba_pct: u8) -> Allocation {
    Allocation {
        cores,
        llc_ways: WayRange::new(0, ways),
        mba_pct,
        gpu_mps_pct: None,
    }
}

/// The first measured feature further than `z_limit` training standard deviations from the
/// training mean, with its z-score, if any. Only readings count
/// ([`cohabit_models::present`]): a presence flag is not one, and a value whose flag is 0
/// (no counters, no RDT monitoring, no latency reading) is absent, not 0; the training data
/// has hosts and ticks without them.
pub(super) fn out_of_range(
    meta: &ModelMetadata,
    f: &[f32; N_FEATURES],
    z_limit: f32,
) -> Option<(&'static str, f32)> {
    f.iter()
        .zip(FEATURE_NAMES)
        .zip(meta.norm_mean.iter().zip(&meta.norm_std))
        .enumerate()
        .filter(|(i, _)| present(f, *i))
        .map(|(_, ((x, name), (m, s)))| (name, (x - m) / s))
        .find(|(_, z)| z.abs() > z_limit)
}

#[cfg(test)]
mod tests {
    use cohabit_core::HostCapacity;

    use super::super::tests::{host, linear_model};
    use super::*;

    /// Index of a feature by name.
    fn col(name: &str) -> usize {
        FEATURE_NAMES.iter().position(|n| *n == name).unwrap()
    }

    fn predictor<'a>(
        model: &'a Model,
        host: &'a HostCapacity,
        sample: &'a Sample,
        current: &'a Allocation,
        neighbours: &'a Neighbours,
        basis: Basis,
    ) -> Predictor<'a> {
        Predictor {
            model,
            host,
            target_ms: 1.0,
            sample,
            current,
            neighbours,
            cand_neighbours: neighbours,
            basis,
            reference_out: None,
            posterior: None,
        }
    }

    #[test]
    fn the_allocation_in_force_is_predicted_as_measured_plus_bias() {
        // A model that would say +3 for anything: it is not asked.
        let model = linear_model(&[(3.0, &[]), (3.0, &[])]);
        let (host, sample, nb) = (host(), Sample::default(), Neighbours::default());
        let current = at_full_mba(8, 4);
        let basis = Basis {
            anchor: Some(-0.5),
            bias: 0.1,
            factor: 1.0,
            noise: 0.04,
        };
        let p = predictor(&model, &host, &sample, &current, &nb, basis);
        let preds = p.predict_many(&[current, current]);
        // -0.5 measured + 0.1 bias; the spread is the measurement's alone.
        let want = Pred::plain(-0.5 + 0.1, 0.04, 0.0);
        assert_eq!(preds, vec![want, want]);
    }

    #[test]
    fn an_anchored_prediction_is_the_measured_value_plus_the_models_change() {
        // Members: -1.8 and -3.6 per unit of cores_cand (cores / 36). From 9 to 18 cores
        // cores_cand moves by 0.25: changes -0.45 and -0.9, mean -0.675, spread 0.225.
        let c = col("cores_cand");
        let model = linear_model(&[(0.7, &[(c, -1.8)]), (-0.2, &[(c, -3.6)])]);
        let (host, sample, nb) = (host(), Sample::default(), Neighbours::default());
        let current = at_full_mba(9, 4);
        let basis = Basis {
            anchor: Some(0.2),
            bias: 0.05,
            factor: 2.0,
            noise: 0.1,
        };
        let p = predictor(&model, &host, &sample, &current, &nb, basis);
        let got = p.predict_many(&[at_full_mba(18, 4)])[0];
        // 0.2 + (-0.675) + 0.05 = -0.425; sigma sqrt((0.225 * 2)² + 0.1²) = sqrt(0.2125).
        assert!((got.mean - -0.425).abs() < 1e-5, "{got:?}");
        assert!((got.model_sigma - 0.225).abs() < 1e-5, "{got:?}");
        assert!((got.sigma - 0.2125f64.sqrt()).abs() < 1e-5, "{got:?}");
    }

    #[test]
    fn the_reference_shared_by_the_pool_levels_is_computed_once_and_used() {
        // Neighbours planned at less bandwidth than measured: the change is predicted from
        // the reference (the allocation in force, neighbours as measured), whose members'
        // outputs are kept in the shared cell.
        let w = [(col("cores_cand"), -1.8), (col("neighbour_bw_frac"), 2.0)];
        let model = linear_model(&[(0.1, &w), (0.3, &w)]);
        let (host, sample) = (host(), Sample::default());
        let measured = Neighbours {
            mem_bw_bytes_per_s: 3e10,
            cores: 10,
        };
        let planned = Neighbours {
            mem_bw_bytes_per_s: 1e10,
            ..measured
        };
        let current = at_full_mba(9, 4);
        let basis = Basis {
            anchor: Some(-0.2),
            ..Basis::default()
        };
        let mut p = predictor(&model, &host, &sample, &current, &measured, basis);
        p.cand_neighbours = &planned;
        let cands = [at_full_mba(6, 4), at_full_mba(12, 4)];
        let fresh = p.predict_many(&cands);
        let cell = OnceCell::new();
        let shared = Predictor {
            reference_out: Some(&cell),
            ..p
        };
        assert_eq!(shared.predict_many(&cands), fresh);
        let kept = cell.get().cloned().expect("filled by the first use");
        assert_eq!(kept.out.len(), 2);
        assert_eq!(shared.predict_many(&cands), fresh);
        // What the cell holds is what is used: a reference 1 higher is a change 1 lower.
        let bumped = OnceCell::from(Reference {
            out: kept.out.iter().map(|v| v + 1.0).collect(),
            ..kept
        });
        let from_bumped = Predictor {
            reference_out: Some(&bumped),
            ..p
        }
        .predict_many(&cands);
        for (a, b) in from_bumped.iter().zip(&fresh) {
            assert!((a.mean - (b.mean - 1.0)).abs() < 1e-5, "{a:?} {b:?}");
        }
    }

    #[test]
    fn without_an_anchor_the_prediction_is_the_models_level() {
        // Members say 0.5 and 1.5: level 1.0, spread 0.5; bias -0.25; factor 1.5.
        let model = linear_model(&[(0.5, &[]), (1.5, &[])]);
        let (host, sample, nb) = (host(), Sample::default(), Neighbours::default());
        let current = at_full_mba(9, 4);
        let basis = Basis {
            anchor: None,
            bias: -0.25,
            factor: 1.5,
            noise: 0.1,
        };
        let p = predictor(&model, &host, &sample, &current, &nb, basis);
        let got = p.predict_many(&[current])[0];
        assert!((got.mean - 0.75).abs() < 1e-6, "{got:?}");
        assert!((got.sigma - 0.75).abs() < 1e-6, "{got:?}");
        assert!((got.model_sigma - 0.5).abs() < 1e-6, "{got:?}");
    }

    #[test]
    fn an_input_more_than_z_limit_sds_from_the_training_mean_is_out_of_range() {
        let mut meta = linear_model(&[(0.0, &[])]).meta;
        let c = col("core_util");
        meta.norm_mean[c] = 0.5;
        meta.norm_std[c] = 0.1;
        let mut f = [0.0f32; N_FEATURES];
        // (0.95 - 0.5) / 0.1 = 4.5: within 5.
        f[c] = 0.95;
        assert_eq!(out_of_range(&meta, &f, 5.0), None);
        // (1.1 - 0.5) / 0.1 = 6: out, and named.
        f[c] = 1.1;
        let (name, z) = out_of_range(&meta, &f, 5.0).unwrap();
        assert_eq!(name, "core_util");
        assert!((z - 6.0).abs() < 1e-4);
        // Below the mean counts too.
        f[c] = -0.1;
        assert_eq!(
            out_of_range(&meta, &f, 5.0).map(|(n, _)| n),
            Some("core_util")
        );
    }

    #[test]
    fn missing_counter_flags_are_never_out_of_range() {
        let meta = linear_model(&[(0.0, &[])]).meta;
        let mut f = [0.0f32; N_FEATURES];
        f[col("has_ipc")] = 100.0;
        assert_eq!(out_of_range(&meta, &f, 5.0), None);
    }

    #[test]
    fn a_reading_whose_flag_is_0_is_absent_and_never_out_of_range() {
        // Training range of log_miss_rate as in the shipped model: 16.7 ± 2.2. Absent (flag
        // 0, value 0): not checked. Present with the same 0: z = -7.6, out.
        let mut meta = linear_model(&[(0.0, &[])]).meta;
        let c = col("log_miss_rate");
        meta.norm_mean[c] = 16.7;
        meta.norm_std[c] = 2.2;
        let mut f = [0.0f32; N_FEATURES];
        assert_eq!(out_of_range(&meta, &f, 5.0), None);
        f[col("has_miss_rate")] = 1.0;
        assert_eq!(
            out_of_range(&meta, &f, 5.0).map(|(n, _)| n),
            Some("log_miss_rate")
        );
    }

    #[test]
    fn an_observation_without_counters_or_rdt_is_within_the_shipped_models_range() {
        // What a VM reports: latency, load and CPU time; no IPC, misses, occupancy or
        // bandwidth, so every neighbour's bandwidth is unknown too.
        let model = cohabit_models::builtin("xeon-e5-2697v4").unwrap().unwrap();
        let host = host();
        let sample = Sample {
            p99_ms: Some(0.7),
            requests_per_s: Some(20_000.0),
            cpu_busy_cores: Some(3.0),
            ..Sample::default()
        };
        let nb = Neighbours {
            mem_bw_bytes_per_s: 0.0,
            cores: 20,
        };
        let current = at_full_mba(6, 4);
        let p = predictor(&model, &host, &sample, &current, &nb, Basis::default());
        let f = p.features(&current);
        for flag in ["has_ipc", "has_miss_rate", "has_occupancy", "has_bw"] {
            assert_eq!(f[col(flag)], 0.0, "{flag}");
        }
        assert_eq!(out_of_range(&model.meta, &f, 5.0), None);
    }
}
