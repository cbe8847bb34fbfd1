//! Read-only forecasts of `ml`'s model with its posterior, for a wrapper that explores
//! around `ml`'s plan ([`crate::explore`], issue 45 item 3), and the hook that lets the
//! posterior learn from the allocation the wrapper put in force instead of `ml`'s own.
//!
//! Nothing here changes what `ml` decides: [`MlPolicy::forecast`] reads the state the last
//! `decide` left (this tick's basis, the posterior, the pool level decided), and
//! [`MlPolicy::record_explored`] replaces the prediction `decide` remembered for a service
//! by the one for the allocation actually put in force, so that step 1 of the next tick
//! learns the error where the host was really measured.

use std::collections::BTreeMap;

use cohabit_core::{Allocation, Observation, Plan, Prediction};
use cohabit_models::Neighbours;
use ndarray::Array2;

use super::predict::{out_of_range, Predictor};
use super::{as_modelled, on_pool_ways, MlPolicy};

/// `ml`'s forecast of ln(p99/target) for one candidate allocation of one service.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Forecast {
    /// The prediction, with the posterior's correction where the service has one.
    pub(crate) mean: f64,
    /// The spread of the value itself, not of one reading of it: the prediction's whole
    /// spread (the posterior's and the part no reading removes) without the measurement's
    /// noise (what a safety bound on the service's p99 rests on).
    pub(crate) latent_sigma: f64,
    /// The variance of a reading's error that no reading removes: the noise the posterior
    /// learns a reading with.
    pub(crate) noise_var: f64,
    /// What the posterior regresses this candidate on (`None` without a posterior).
    pub(crate) regressor: Option<Vec<f64>>,
}

impl MlPolicy {
    /// The forecasts for `cands` of the CPU service `name`, anchored on what `obs` measured
    /// under the allocation in force, as the last [`crate::Policy::decide`] on `obs` scores
    /// them (its basis, posterior and pool level). `None` when the model is not to be asked
    /// about the service: no anchor (no reading, or saturated), an input outside the
    /// training range, or no state.
    pub(crate) fn forecast(
        &self,
        obs: &Observation,
        name: &str,
        cands: &[Allocation],
    ) -> Option<Vec<Forecast>> {
        let st = self.state.get(name)?;
        st.basis.anchor?;
        let o = obs.services.iter().find(|o| o.spec.name == name)?;
        let target_ms = o.spec.p99_target_ms()?;
        let on_pool = on_pool_ways(&self.ctx, &obs.current);
        let current = *as_modelled(&obs.current, &on_pool).services.get(name)?;
        let neighbours = Neighbours::observed(obs, name, &self.ctx.host);
        let cand_neighbours = self.planned_neighbours(neighbours);
        let predictor = Predictor {
            model: &self.model,
            host: &self.ctx.host,
            target_ms,
            sample: &o.sample,
            current: &current,
            neighbours: &neighbours,
            cand_neighbours: &cand_neighbours,
            basis: st.basis,
            reference_out: self.references.get(name),
            posterior: st.posterior.as_ref(),
        };
        if out_of_range(
            &self.model.meta,
            &predictor.features(&current),
            self.cfg.z_limit,
        )
        .is_some()
        {
            return None;
        }
        let preds = predictor.predict_many(cands);
        let noise2 = st.basis.noise * st.basis.noise;
        Some(
            preds
                .iter()
                .map(|p| Forecast {
                    mean: p.mean,
                    latent_sigma: (p.sigma * p.sigma - noise2).max(0.0).sqrt(),
                    noise_var: p.irreducible,
                    regressor: p.regressor.map(|z| z.to_vec()),
                })
                .collect(),
        )
    }

    /// The covariance of the coefficients of service `name`'s posterior, when it has one.
    pub(crate) fn posterior_covariance(&self, name: &str) -> Option<Array2<f64>> {
        self.state
            .get(name)?
            .posterior
            .as_ref()
            .map(cohabit_models::posterior::Blr::covariance)
    }

    /// `plan` replaces the one the last `decide` on `obs` returned for `services`: their
    /// predictions for it are remembered as their last (step 1 learns from the next
    /// reading under it) and returned for the decision log.
    pub(crate) fn record_explored(
        &mut self,
        obs: &Observation,
        plan: &Plan,
        services: &[String],
    ) -> BTreeMap<String, Prediction> {
        let on_pool = on_pool_ways(&self.ctx, &obs.current);
        let modelled = Observation {
            current: as_modelled(&obs.current, &on_pool),
            ..obs.clone()
        };
        let placed = on_pool_ways(&self.ctx, plan);
        let plan = as_modelled(plan, &placed);
        services
            .iter()
            .filter_map(|name| {
                let p = self.record_prediction(&modelled, name, &plan)?;
                Some((name.clone(), p))
            })
            .collect()
    }
}
