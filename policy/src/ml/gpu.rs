//! GPU services in the `ml` policy: MPS shares from the learned GPU model where it can be
//! trusted, else from an online model of the service's own tail latency against its share,
//! changed rarely (every change restarts the MPS client).
//!
//! Learned GPU model ([`model_share`], schema `qos-gpu`): every share from 5 % to 100 % in
//! 5-point steps is scored, anchored on the smoothed measured tail at the share in force
//! (the model predicts the *change*; past saturation, its level), and the smallest share
//! whose pessimistic prediction (`mean + k_sigma * sigma`) is within the margin is wanted.
//! The service falls back to the online model (decision path `fallback`, the reason names
//! the cause) when an input lies outside the model's training range (more than `z_limit`
//! training standard deviations; absent readings are not compared), when no share is
//! predicted to meet the target, or when the model is unsure (spread above
//! `unsure_sigma`) of the share it would pick. Restart spacing and hysteresis below apply
//! to either.
//!
//! Online model: `ln(p99/target)` falls by `e * ln(s'/s)` when the share goes from `s` to `s'`,
//! anchored on the smoothed measured value at the share in force, with `e` learned from the
//! service's own share changes (prior [`MlConfig::gpu_exponent_prior`]).
//!
//! Predictions: the decision records, for a GPU service measured at its share in force, the
//! predicted ln(p99/target) and spread at the share laid out (after the GPU's services are
//! fitted): the learned model's when it chose the share, else the online model's
//! ([`MlPolicy::record_gpu_predictions`]).
//!
//! The cost of a change is the host's (`GpuCapacity::share_change`): where the driver changes
//! running clients' shares (MPS v3), a change costs nothing, so no interval is skipped and
//! a surplus of one step is given back once measured; otherwise every change costs a
//! restart, and:
//!
//! Restart spacing: the interval that held a restart is skipped; a share never changes
//! while a restart is pending or on fewer than [`GPU_MIN_SAMPLES`] samples since the last
//! change (the first placement needs one); it grows (in [`GPU_STEP_PCT`]-point steps) when
//! the pessimistic need is a step above it and the smoothed tail is past the margin, and
//! shrinks only after `gpu_shrink_after_ms` of a surplus larger than `gpu_hysteresis_pct`.
//!
//! Degrade ([`fit_shares`]): when the services on a GPU want more than is there, those that
//! want less take it and the others grow into what is free, higher priority first, and
//! within a priority in proportion to how much more they want. Overload (docs/DESIGN.md
//! §5): the best-effort pool keeps only 1 % of a GPU its jobs share with latency-critical
//! services; when those together want more than the rest and none can grow, a service
//! measured far over its target (more than twice, at its settled share, and over it for
//! `shrink_after` intervals in a row) yields down to one step to services of the same or
//! higher priority that miss theirs by less, so that they can meet them (the fewest
//! violations); no other service far over its target grows into what it gave up, and what
//! is left after rounding goes to a service that can still meet its target and whose share
//! changes anyway (no extra restart), not to the pool. Tried and not kept (issue 49): a
//! triage that gives shares by priority and then the smallest want first whenever that
//! serves more services by their wants than the shares in force; `ml`'s wants are
//! pessimistic, so it committed the GPU to one service where two at the edge of their
//! targets each met theirs half the time (fewer services met on `gpu-llm-crowd`;
//! docs/RESULTS.md, "GPU overload and the oracle as a bound").

use std::collections::BTreeMap;
use std::sync::Arc;

use cohabit_core::{DecisionPath, Observation, Plan, Prediction, Reason, Sample, ShareChange};
use cohabit_models::{
    gpu_features, gpu_present, log_qos_ratio, GpuCoRunners, GpuReadings, Model, ModelMetadata,
    GPU_FEATURE_NAMES, GPU_SCHEMA, N_GPU_FEATURES,
};
use ndarray::{Array2, ArrayView1};

use super::predict::SATURATED;
use super::{MlConfig, MlPolicy, ServicePlan};
use crate::slack;

/// GPU shares move in steps of this many percentage points.
pub(super) const GPU_STEP_PCT: f64 = 5.0;

/// Smoothed samples a GPU share must have been measured for before it is changed again.
pub(super) const GPU_MIN_SAMPLES: u32 = 3;

/// Online state of a GPU service's share model.
#[derive(Debug, Clone, Default)]
pub(super) struct GpuModel {
    /// Effective share the samples below were taken at.
    share: Option<u8>,
    /// Exponentially weighted ln(p99/target) at that share, and how many samples it holds.
    log_q: Option<f64>,
    samples: u32,
    /// Busy GPU fraction of its streams, smoothed.
    util: Option<f64>,
    /// Share and smoothed ln(p99/target) before the last change, for learning the exponent.
    before: Option<(u8, f64)>,
    /// Learned exponent.
    exponent: Option<f64>,
    /// Samples to skip after a restart (the interval that held the downtime).
    skip: u32,
    /// Since when the share has had a surplus worth giving back.
    surplus_since_ms: Option<u64>,
    /// Whether the share has been chosen from a measurement once (the first choice needs
    /// only one sample; later ones need [`GPU_MIN_SAMPLES`]).
    placed: bool,
    /// What this tick's share was planned from (`None`: a restart pending, or no reading at
    /// the share in force), for the prediction at the share laid out.
    basis: Option<ShareBasis>,
}

/// What a GPU service's share was planned from at one tick: the prediction at the share
/// finally laid out ([`MlPolicy::record_gpu_predictions`]) is made from it.
#[derive(Debug, Clone, Copy, PartialEq)]
struct ShareBasis {
    /// Effective share in force, percent.
    share_now: f64,
    /// Smoothed measured ln(p99/target) at that share, and its spread.
    anchor: f64,
    anchor_sigma: f64,
    /// The online model's exponent.
    exponent: f64,
    /// Cores of its CPU side in force.
    cores_now: u32,
    /// The learned GPU model chose the share (else the online model did).
    by_model: bool,
}

impl ShareBasis {
    /// The online model's prediction of ln(p99/target) at `share` (percent), and its spread.
    fn online(&self, share: f64) -> (f64, f64) {
        (
            self.anchor - self.exponent * (share / self.share_now).ln(),
            self.anchor_sigma,
        )
    }
}

/// The share a GPU service is given this tick, before the GPU's services are fitted.
#[derive(Debug, Clone, Copy, PartialEq)]
struct ShareAsk {
    /// Share in force (effective), percent.
    now: f64,
    /// Share wanted, percent (not yet in steps).
    want: f64,
    /// Share published in the plan in force.
    published: Option<u8>,
    /// The published share differs from the effective one: a restart is pending.
    pending: bool,
}

impl GpuModel {
    /// Follows the effective share: after a change (a restart completed) the interval that
    /// held the downtime says nothing of the new share and is skipped, and the smoothed
    /// tail starts over (the old one is kept for learning the exponent).
    fn follow(&mut self, effective: Option<u8>, live: bool) {
        if self.share == effective {
            return;
        }
        if let (Some(s), Some(q)) = (self.share, self.log_q.filter(|_| self.samples >= 3)) {
            self.before = Some((s, q));
        }
        // A live change (MPS v3) has no downtime to skip.
        if self.share.is_some() && !live {
            self.skip = 1;
        }
        self.share = effective;
        self.log_q = None;
        self.samples = 0;
        self.util = None;
        self.surplus_since_ms = None;
    }

    /// Adds one interval's readings (unless skipped or a restart is pending) and learns the
    /// exponent once the new share has [`GPU_MIN_SAMPLES`] samples.
    fn observe(&mut self, pending: bool, log_q: Option<f64>, gpu_util_pct: Option<f64>) {
        if self.skip > 0 {
            self.skip -= 1;
            return;
        }
        if pending {
            return;
        }
        if let Some(q) = log_q {
            // Few requests per interval make the p99 noisy; smooth it.
            self.log_q = Some(self.log_q.map_or(q, |old| 0.7 * old + 0.3 * q));
            self.samples += 1;
        }
        if let Some(u) = gpu_util_pct {
            let u = u / 100.0;
            self.util = Some(self.util.map_or(u, |old| 0.7 * old + 0.3 * u));
        }
        // Learn the exponent from the change: the smoothed tail before and after.
        if let (Some((s0, q0)), Some(s1), Some(q1)) = (self.before, self.share, self.log_q) {
            if self.samples >= 3 && s0 != s1 {
                let e = ((q0 - q1) / (f64::from(s1) / f64::from(s0)).ln()).clamp(0.2, 1.2);
                self.exponent = Some(self.exponent.map_or(e, |old| 0.5 * old + 0.5 * e));
                self.before = None;
            }
        }
    }

    /// Spread of the smoothed tail: it shrinks with samples.
    fn sigma(&self) -> f64 {
        0.1 + 0.3 / f64::from(self.samples.max(1)).sqrt()
    }

    /// Smallest share with `q - e*ln(s'/s) + k*sigma <= ln(limit)` and the busy fraction of
    /// its streams under 0.8, from the share in force `share_now`.
    fn need(&self, q: f64, share_now: f64, e: f64, limit: f64, k: f64) -> f64 {
        let sigma = self.sigma();
        let by_tail = share_now * ((q + k * sigma - limit.ln()) / e).exp();
        let by_util = self
            .util
            .map_or(1.0, |u| share_now * (u / 0.8).powf(1.0 / e));
        by_tail.max(by_util).clamp(1.0, 100.0)
    }

    /// The share to publish: restart spacing and hysteresis over what is wanted. Grows at
    /// once, shrinks only after a lasting, sizeable surplus, holds while a restart is
    /// pending or on too few samples. Where a change costs nothing (`live`: no restart),
    /// a surplus of one step is given back as soon as it has been measured.
    fn choose(&mut self, ask: ShareAsk, cfg: &MlConfig, now_ms: u64, live: bool) -> u8 {
        let step = |x: f64| {
            let x = (x / GPU_STEP_PCT).ceil() * GPU_STEP_PCT;
            u8::try_from(cohabit_core::whole(x.clamp(GPU_STEP_PCT, 100.0))).unwrap_or(100)
        };
        let (want, share_now) = (ask.want, ask.now);
        let now_pct = u8::try_from(cohabit_core::whole(share_now)).unwrap_or(100);
        let mut chosen = now_pct;
        let (hysteresis, shrink_after_ms) = if live {
            (GPU_STEP_PCT, 0)
        } else {
            (f64::from(cfg.gpu_hysteresis_pct), cfg.gpu_shrink_after_ms)
        };
        let enough = self.samples >= GPU_MIN_SAMPLES || !self.placed;
        if let (false, true, Some(q)) = (ask.pending, enough, self.log_q) {
            let first = !self.placed;
            self.placed = true;
            // Grow when the pessimistic need is a step above the share and the smoothed
            // tail is past the margin (or at the first placement).
            if want > share_now + GPU_STEP_PCT - 0.5 && (first || q > cfg.margin.ln()) {
                chosen = step(want);
                self.surplus_since_ms = None;
            } else if want + hysteresis < share_now {
                let since = *self.surplus_since_ms.get_or_insert(now_ms);
                if now_ms >= since + shrink_after_ms {
                    chosen = step(want);
                    self.surplus_since_ms = None;
                }
            } else {
                self.surplus_since_ms = None;
            }
        }
        if ask.pending {
            chosen = ask.published.unwrap_or(now_pct);
        }
        chosen
    }
}

/// What the learned GPU model is asked for one service at one tick.
#[derive(Debug, Clone, Copy)]
pub(super) struct ShareQuery<'a> {
    pub(super) target_ms: f64,
    pub(super) sample: &'a Sample,
    /// Cores of its CPU side in force.
    pub(super) cores_now: u32,
    /// Effective share in force, percent.
    pub(super) share_now: f64,
    pub(super) co: &'a GpuCoRunners,
    /// Smoothed measured ln(p99/target) at the share in force, and its spread.
    pub(super) anchor: f64,
    pub(super) anchor_sigma: f64,
}

/// The first measured GPU feature further than `z_limit` training standard deviations from
/// the training mean, with its z-score, if any (absent readings and flags are not compared).
pub(super) fn gpu_out_of_range(
    meta: &ModelMetadata,
    f: &[f32; N_GPU_FEATURES],
    z_limit: f32,
) -> Option<(&'static str, f32)> {
    f.iter()
        .zip(GPU_FEATURE_NAMES)
        .zip(meta.norm_mean.iter().zip(&meta.norm_std))
        .enumerate()
        .filter(|(i, _)| gpu_present(f, *i))
        .map(|(_, ((x, name), (m, s)))| (name, (x - m) / s))
        .find(|(_, z)| z.abs() > z_limit)
}

/// The GPU features of the service `q` describes with `cand` (percent) as the candidate share.
fn features_at(q: &ShareQuery<'_>, cand: f64) -> [f32; N_GPU_FEATURES] {
    gpu_features(
        q.target_ms,
        q.sample,
        &GpuReadings::default(),
        q.cores_now,
        q.share_now,
        cand,
        q.co,
    )
}

/// The learned GPU model's predictions (mean, spread) of ln(p99/target) at those of
/// `candidates` (percent) whose inputs are in its training range, with those shares; empty
/// when none is. Anchored on the measured tail (the model's change), unless saturated (its
/// level).
fn score_shares(
    model: &Model,
    cfg: &MlConfig,
    q: &ShareQuery<'_>,
    candidates: impl IntoIterator<Item = f64>,
) -> (Vec<f64>, Vec<(f64, f64)>) {
    let reference = features_at(q, q.share_now);
    let mut shares = Vec::new();
    let mut rows = Vec::new();
    for share in candidates {
        let f = features_at(q, share);
        if gpu_out_of_range(&model.meta, &f, cfg.z_limit).is_none() {
            shares.push(share);
            rows.extend_from_slice(&f);
        }
    }
    let rows = match Array2::from_shape_vec((shares.len(), N_GPU_FEATURES), rows) {
        Ok(rows) if !shares.is_empty() => rows,
        _ => return (Vec::new(), Vec::new()),
    };
    let saturated = q.anchor > SATURATED.ln();
    let preds: Vec<(f64, f64)> = if saturated {
        let (m, s) = model.score(rows.view());
        m.iter()
            .zip(s.iter())
            .map(|(m, s)| (f64::from(*m), f64::from(*s)))
            .collect()
    } else {
        let (d, s) = model.score_change(ArrayView1::from(&reference[..]), rows.view());
        d.iter()
            .zip(s.iter())
            .map(|(d, s)| {
                let s = f64::from(*s);
                (
                    q.anchor + f64::from(*d),
                    (s * s + q.anchor_sigma * q.anchor_sigma).sqrt(),
                )
            })
            .collect()
    };
    (shares, preds)
}

/// The share the learned GPU model wants for a service (percent, not yet in steps) and why,
/// or why it cannot be used (the caller falls back to the online model): an input out of
/// range, no share predicted to meet the target, or the model unsure of the share it picks.
pub(super) fn model_share(
    model: &Model,
    cfg: &MlConfig,
    q: &ShareQuery<'_>,
) -> Result<(f64, String), String> {
    let reference = features_at(q, q.share_now);
    if let Some((name, z)) = gpu_out_of_range(&model.meta, &reference, cfg.z_limit) {
        return Err(format!(
            "gpu model not used: input {name} out of its training range (z {z:.1})"
        ));
    }
    let (shares, preds) = score_shares(model, cfg, q, (1..=20u32).map(|k| f64::from(k * 5)));
    if shares.is_empty() {
        return Err("gpu model not used: no candidate share in range".into());
    }
    let limit = cfg.margin.ln();
    let pick = shares
        .iter()
        .zip(&preds)
        .find(|(_, (m, s))| m + cfg.k_sigma * s <= limit);
    match pick {
        Some((share, (m, s))) if *s <= cfg.unsure_sigma => Ok((
            *share,
            format!(
                "gpu model: p99/target {:.2} predicted at {share:.0} % (sigma {s:.2}; measured {:.2} at {:.0} %)",
                m.exp(),
                q.anchor.exp(),
                q.share_now
            ),
        )),
        Some((share, (_, s))) => Err(format!(
            "gpu model unsure at {share:.0} % (sigma {s:.2})"
        )),
        None => {
            let (m, s) = preds.last().copied().unwrap_or((f64::NAN, 0.0));
            Err(format!(
                "gpu model not used: no share meets the target (pessimistic p99/target {:.2} at {:.0} %)",
                (m + cfg.k_sigma * s).exp(),
                shares.last().copied().unwrap_or(100.0)
            ))
        }
    }
}

impl MlPolicy {
    /// This policy with `model` for the GPU services' shares (see the module docs); a model
    /// of another schema is refused, naming both.
    pub fn with_gpu_model(mut self, model: Arc<Model>) -> Result<Self, crate::BuildError> {
        if model.schema() != &GPU_SCHEMA {
            let id = |s: &cohabit_models::Schema| format!("{}-v{}", s.name, s.version);
            return Err(crate::BuildError::GpuModelSchema {
                expected: id(&GPU_SCHEMA),
                got: id(model.schema()),
            });
        }
        self.gpu_model = Some(model);
        Ok(self)
    }

    /// Whether a GPU model is in use.
    pub fn has_gpu_model(&self) -> bool {
        self.gpu_model.is_some()
    }

    /// A GPU service: its share from the learned GPU model or the online queueing model,
    /// its CPU side from its measured CPU use.
    pub(super) fn plan_gpu_service(
        &mut self,
        obs: &Observation,
        name: &str,
        now_ms: u64,
    ) -> ServicePlan {
        let cfg = self.cfg;
        let o = obs.services.iter().find(|o| o.spec.name == name);
        let target = o.and_then(|o| o.spec.p99_target_ms()).unwrap_or(1.0);
        let sample = o.map(|o| o.sample.clone()).unwrap_or_default();
        let current = obs.current.services.get(name).copied();
        let published = current.and_then(|a| a.gpu_mps_pct);
        let effective = o.and_then(|o| o.gpu_mps_effective_pct).or(published);
        let gpu = o.and_then(|o| o.spec.gpu);
        let live = gpu.is_some_and(|i| self.live(i));
        let gpu_model = self.gpu_model.clone();
        let cores_now = current.map_or(1, |a| a.cores);
        let st = self.state.entry(name.to_string()).or_default();
        st.seen = true;
        let g = &mut st.gpu;
        g.follow(effective, live);
        let pending = published != effective;
        g.observe(pending, log_qos_ratio(&sample, target), sample.gpu_util_pct);
        let e = g.exponent.unwrap_or(cfg.gpu_exponent_prior);
        let share_now = f64::from(effective.unwrap_or(100).max(1));
        g.basis = None;
        let (want, why, path) = match g.log_q {
            _ if pending => (
                published.map_or(share_now, f64::from),
                "gpu share waits for the client restart".to_string(),
                DecisionPath::Model,
            ),
            None => (
                share_now,
                "gpu hold (no latency reading at this share yet)".to_string(),
                DecisionPath::Model,
            ),
            Some(q) => {
                let online = g.need(q, share_now, e, cfg.margin, cfg.k_sigma);
                let online_why = format!(
                    "gpu share for p99/target {:.2} at {share_now:.0} % (exponent {e:.2}, {} samples)",
                    q.exp(),
                    g.samples
                );
                let mut basis = ShareBasis {
                    share_now,
                    anchor: q,
                    anchor_sigma: g.sigma(),
                    exponent: e,
                    cores_now,
                    by_model: false,
                };
                let planned = match (gpu_model.as_deref(), gpu) {
                    (Some(m), Some(gi)) => {
                        let co = GpuCoRunners::observed(obs, name, gi);
                        let query = ShareQuery {
                            target_ms: target,
                            sample: &sample,
                            cores_now,
                            share_now,
                            co: &co,
                            anchor: q,
                            anchor_sigma: g.sigma(),
                        };
                        match model_share(m, &cfg, &query) {
                            Ok((w, text)) => {
                                basis.by_model = true;
                                (w, text, DecisionPath::Model)
                            }
                            Err(reason) => (
                                online,
                                format!("{reason}; online model: {online_why}"),
                                DecisionPath::Fallback,
                            ),
                        }
                    }
                    _ => (online, online_why, DecisionPath::Model),
                };
                g.basis = Some(basis);
                planned
            }
        };
        let ask = ShareAsk {
            now: share_now,
            want,
            published,
            pending,
        };
        let chosen = g.choose(ask, &cfg, now_ms, live);
        let over_target = slack(obs, name).is_some_and(|s| s < 0.0);
        let cores = cpu_side_cores(&sample, current.map_or(1, |a| a.cores), over_target, g);
        ServicePlan {
            gpu_pct: Some(chosen),
            ..ServicePlan::fixed(name, cores, 1, Reason::new(path, why), false)
        }
    }

    /// Whether a share change on `gpu` reaches running clients without a restart.
    fn live(&self, gpu: u32) -> bool {
        self.ctx
            .host
            .gpus
            .get(gpu as usize)
            .is_some_and(|g| g.share_change == ShareChange::Live)
    }

    /// Predictions of ln(p99/target) for the GPU services at the shares laid out in `plan`,
    /// added to `predictions` (the decision log's and the metrics'): the learned GPU
    /// model's where it chose the share and its inputs at the share laid out are in range,
    /// else the online model's (the same units). None for a service waiting for a restart
    /// or without a latency reading at its share in force.
    pub(super) fn record_gpu_predictions(
        &self,
        obs: &Observation,
        plans: &[ServicePlan],
        plan: &Plan,
        predictions: &mut BTreeMap<String, Prediction>,
    ) {
        for p in plans.iter().filter(|p| p.gpu_pct.is_some()) {
            let Some(share) = plan.services.get(&p.name).and_then(|a| a.gpu_mps_pct) else {
                continue;
            };
            if let Some(pred) = self.gpu_prediction(obs, &p.name, f64::from(share.max(1))) {
                predictions.insert(p.name.clone(), pred);
            }
        }
    }

    /// [`MlPolicy::record_gpu_predictions`] for one service at `share` (percent).
    fn gpu_prediction(&self, obs: &Observation, name: &str, share: f64) -> Option<Prediction> {
        let b = self.state.get(name)?.gpu.basis?;
        let learned = || {
            let model = self.gpu_model.as_deref().filter(|_| b.by_model)?;
            let o = obs.services.iter().find(|o| o.spec.name == name)?;
            let co = GpuCoRunners::observed(obs, name, o.spec.gpu?);
            let query = ShareQuery {
                target_ms: o.spec.p99_target_ms()?,
                sample: &o.sample,
                cores_now: b.cores_now,
                share_now: b.share_now,
                co: &co,
                anchor: b.anchor,
                anchor_sigma: b.anchor_sigma,
            };
            score_shares(model, &self.cfg, &query, [share])
                .1
                .first()
                .copied()
        };
        let (mean, sigma) = learned().unwrap_or_else(|| b.online(share));
        (mean.is_finite() && sigma.is_finite()).then_some(Prediction::new(mean, sigma))
    }

    /// Keeps the GPU services on each GPU within 99 % (the pool keeps 1 %), by
    /// [`fit_shares`].
    pub(super) fn fit_gpu(&self, plans: &mut [ServicePlan], obs: &Observation) {
        let keep_for_pool = u32::from(self.ctx.has_gpu_best_effort());
        let room = f64::from(100 - keep_for_pool);
        for gpu in 0..u32::try_from(self.ctx.host.gpus.len()).unwrap_or(0) {
            let idx: Vec<usize> = (0..plans.len())
                .filter(|&i| {
                    plans[i].gpu_pct.is_some()
                        && self
                            .ctx
                            .specs
                            .iter()
                            .any(|s| s.name == plans[i].name && s.gpu == Some(gpu))
                })
                .collect();
            let want: Vec<f64> = idx
                .iter()
                .map(|&i| f64::from(plans[i].gpu_pct.unwrap_or(0)))
                .collect();
            let cur: Vec<f64> = idx
                .iter()
                .zip(&want)
                .map(|(&i, w)| {
                    obs.current
                        .services
                        .get(&plans[i].name)
                        .and_then(|a| a.gpu_mps_pct)
                        .map_or(*w, f64::from)
                })
                .collect();
            let standing: Vec<Standing> = idx
                .iter()
                .map(|&i| Standing {
                    priority: self
                        .ctx
                        .specs
                        .iter()
                        .find(|s| s.name == plans[i].name)
                        .map_or(0, |s| s.priority),
                    tail: self.state.get(&plans[i].name).and_then(|st| st.gpu.log_q),
                    persistent: self.persistently_over(&plans[i].name),
                })
                .collect();
            // Every service measured at its share in force, none waiting for a restart.
            let settled = idx.iter().all(|&i| {
                let name = &plans[i].name;
                let published = obs.current.services.get(name).and_then(|a| a.gpu_mps_pct);
                let effective = obs
                    .services
                    .iter()
                    .find(|o| &o.spec.name == name)
                    .and_then(|o| o.gpu_mps_effective_pct)
                    .or(published);
                published == effective
                    && self
                        .state
                        .get(name)
                        .is_some_and(|st| st.gpu.samples >= GPU_MIN_SAMPLES)
            });
            let Some(shares) = fit_shares(&want, &cur, &standing, settled, room) else {
                continue;
            };
            for (&i, (s, fit)) in idx.iter().zip(shares) {
                plans[i].gpu_pct = s;
                plans[i].reason.text.push_str(fit.note());
            }
        }
    }
}

/// The CPU side of a GPU service (pre- and post-processing), sized from its measured busy
/// cores; one over its target with no latency reading at its share yet keeps what it has.
fn cpu_side_cores(sample: &Sample, cur_cores: u32, over_target: bool, g: &GpuModel) -> u32 {
    let busy = sample.cpu_busy_cores.unwrap_or(0.0);
    u32::try_from(cohabit_core::whole((busy / 0.5).ceil().max(1.0)))
        .unwrap_or(1)
        .max(if over_target && g.log_q.is_none() {
            cur_cores
        } else {
            1
        })
}

/// How one GPU's share of a service was fitted when its services wanted more than is there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Fit {
    /// It kept what it has or grew into what is free.
    Spread,
    /// Far over its target at the share in force: it yields to services that can still meet
    /// theirs.
    Yields,
}

impl Fit {
    fn note(self) -> &'static str {
        match self {
            Fit::Spread => "; GPU full: growth limited to what is free",
            Fit::Yields => {
                "; GPU full: far over its target, yields to services that can still meet theirs"
            }
        }
    }
}

/// What [`fit_shares`] knows of each service on one GPU besides its want and share.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Standing {
    /// Overload priority (higher wins).
    pub(super) priority: i32,
    /// Smoothed measured ln(p99/target) at the share in force, when there is one.
    pub(super) tail: Option<f64>,
    /// Measured over its target in each of the last `shrink_after` intervals: only such a
    /// service yields. A single outlier (on `gpu-llm-crowd`, one llm-chat reading of 46
    /// times its target, the truth 0.93) lifts the smoothed tail past [`HOPELESS`], and a
    /// yield costs a restart and minutes of a service that was meeting its target.
    pub(super) persistent: bool,
}

/// Services whose tail is more than this many times their target at the share in force
/// are past helping by the small growth a full GPU allows.
const HOPELESS: f64 = 2.0;

/// The degrade rule of one GPU: `want` and `cur` are the shares wanted and in force (%) of
/// its services, `standing` their priorities and measured tails, `settled` whether every one
/// was measured at its share in force (no restart pending), `room` what they may have
/// together. `None` when the wants fit.
///
/// Otherwise, at the first placement (or when even the services that want less overfill it)
/// the wants are scaled to fit; later, services that want less take what they want, and
/// those that want more grow only into what is free, in proportion to how much more they
/// want, so no share is taken from a service that still needs it and nothing oscillates.
///
/// Overload (latency-critical services together want more than the GPU, and no one can grow
/// by a step): a service measured far over its target ([`HOPELESS`] × at its share) yields
/// down to one step when another service of the same or higher priority misses its target
/// by less and wants more: that one grows into what was given up (the fewest violations;
/// a lower-priority service never takes from a higher one). A change of less than a step is
/// not worth a restart.
pub(super) fn fit_shares(
    want: &[f64],
    cur: &[f64],
    standing: &[Standing],
    settled: bool,
    room: f64,
) -> Option<Vec<(Option<u8>, Fit)>> {
    if want.iter().sum::<f64>() <= room {
        return None;
    }
    let n = want.len();
    let priority: Vec<i32> = standing.iter().map(|s| s.priority).collect();
    let spread = spread_shares(want, cur, &priority, room);
    let stuck = spread.iter().zip(cur).all(|(s, c)| *s < c + GPU_STEP_PCT);
    let far =
        |i: usize| standing[i].persistent && standing[i].tail.is_some_and(|q| q > HOPELESS.ln());
    let missing = |i: usize| standing[i].tail.is_some_and(|q| q > 0.0);
    // Who can still be helped: over its target by less, wanting more than it has.
    let helped: Vec<usize> = (0..n)
        .filter(|&i| missing(i) && !far(i) && want[i] > cur[i])
        .collect();
    let yields: Vec<bool> = (0..n)
        .map(|i| {
            far(i)
                && cur[i] > GPU_STEP_PCT
                && helped
                    .iter()
                    .any(|&j| standing[j].priority >= standing[i].priority)
        })
        .collect();
    let overload = settled && stuck && yields.iter().any(|y| *y);
    let shares = if overload {
        let mut w = want.to_vec();
        let mut c = cur.to_vec();
        for i in (0..n).filter(|&i| yields[i]) {
            w[i] = want[i].min(GPU_STEP_PCT);
            c[i] = w[i];
        }
        // Nor does another far over its target grow into what was given up: two LLM
        // services far over theirs on `gpu-llm-overload` (lab/scenarios) traded a quarter
        // of the GPU back and forth, a restart each time, while the classifier that could
        // use it met its target in 81 % of intervals (94 % now).
        for i in (0..n).filter(|&i| far(i) && !yields[i]) {
            w[i] = want[i].min(cur[i]);
        }
        spread_shares(&w, &c, &priority, room)
    } else {
        spread
    };
    // A restart for less than a step is not worth it.
    let mut s: Vec<f64> = (0..n)
        .map(|i| {
            if (shares[i] - cur[i]).abs() < GPU_STEP_PCT {
                cur[i]
            } else {
                shares[i].floor().max(1.0)
            }
        })
        .collect();
    // In overload, what rounding and the restart rule left over goes to a service that can
    // still meet its target, whose share changes anyway (no extra restart) and that wants
    // more, not to best effort.
    let mut slack = if overload {
        (room - s.iter().sum::<f64>()).floor()
    } else {
        0.0
    };
    for i in 0..n {
        if slack >= 1.0 && s[i] != cur[i] && want[i] > s[i] && !yields[i] {
            let add = (want[i] - s[i]).floor().min(slack);
            s[i] += add;
            slack -= add;
        }
    }
    // Then, beyond its want, to a service that can still meet its target and whose share
    // changes anyway: LC before BE.
    if let Some(i) = (0..n).find(|&i| s[i] != cur[i] && !far(i) && !yields[i]) {
        s[i] += slack.max(0.0);
    }
    let out = (0..n)
        .map(|i| {
            let fit = if yields[i] && s[i] < cur[i] {
                Fit::Yields
            } else {
                Fit::Spread
            };
            (u8::try_from(cohabit_core::whole(s[i])).ok(), fit)
        })
        .collect();
    Some(out)
}

/// The spread fit of [`fit_shares`] (wants scaled at the first placement; otherwise growth
/// into what is free, by priority, highest first (docs/DESIGN.md 5), and within a priority
/// in proportion to how much more each wants).
fn spread_shares(want: &[f64], cur: &[f64], priority: &[i32], room: f64) -> Vec<f64> {
    let fixed: f64 = want
        .iter()
        .zip(cur)
        .filter(|(w, c)| w <= c)
        .map(|(w, _)| w)
        .sum();
    let growing: f64 = want
        .iter()
        .zip(cur)
        .filter(|(w, c)| w > c)
        .map(|(_, c)| c)
        .sum();
    let mut free = room - fixed - growing;
    let extra: f64 = want.iter().zip(cur).map(|(w, c)| (w - c).max(0.0)).sum();
    if free < 0.0 || extra <= 0.0 {
        let total: f64 = want.iter().sum();
        return want.iter().map(|w| w * room / total).collect();
    }
    let mut out: Vec<f64> = want
        .iter()
        .zip(cur)
        .map(|(w, c)| if w > c { *c } else { *w })
        .collect();
    let mut levels: Vec<i32> = priority.to_vec();
    levels.sort_unstable_by(|a, b| b.cmp(a));
    levels.dedup();
    for level in levels {
        let members: Vec<usize> = (0..want.len())
            .filter(|&i| priority[i] == level && want[i] > cur[i])
            .collect();
        let more: f64 = members.iter().map(|&i| want[i] - cur[i]).sum();
        if more <= 0.0 {
            continue;
        }
        let given = free.min(more);
        for &i in &members {
            out[i] += given * (want[i] - cur[i]) / more;
        }
        free -= given;
    }
    out
}

#[cfg(test)]
mod tests {
    use cohabit_models::mlp::Dense;
    use ndarray::Array1;

    use super::*;

    fn gcol(name: &str) -> usize {
        GPU_FEATURE_NAMES.iter().position(|n| *n == name).unwrap()
    }

    /// A GPU model whose members are linear in raw features (identity normalisation, so
    /// the training range is 0 ± 1 per feature and z-scores are the raw values).
    fn linear_gpu_model(members: &[(f32, &[(usize, f32)])]) -> Model {
        let mut m = Model::synthetic_schema(&GPU_SCHEMA, members.len(), &[], 0);
        for (mlp, (bias, weights)) in m.ensemble.members.iter_mut().zip(members) {
            let mut w = Array2::zeros((1, N_GPU_FEATURES));
            for &(j, x) in *weights {
                w[[0, j]] = x;
            }
            mlp.layers = vec![Dense {
                weight: w,
                bias: Array1::from_elem(1, *bias),
            }];
        }
        m
    }

    fn query<'a>(sample: &'a Sample, co: &'a GpuCoRunners, anchor: f64) -> ShareQuery<'a> {
        ShareQuery {
            target_ms: 25.0,
            sample,
            cores_now: 2,
            share_now: 40.0,
            co,
            anchor,
            anchor_sigma: 0.1,
        }
    }

    #[test]
    fn a_gpu_service_in_range_gets_the_smallest_share_the_model_says_meets_the_target() {
        // ln(p99/target) falls by 0.7 per unit of ln(share ratio), in both members.
        let r = gcol("log_share_ratio");
        let model = linear_gpu_model(&[(0.0, &[(r, -0.7)]), (0.0, &[(r, -0.7)])]);
        let s = Sample {
            p99_ms: Some(33.7),
            requests_per_s: Some(20.0),
            gpu_util_pct: Some(70.0),
            ..Sample::default()
        };
        let co = GpuCoRunners {
            share_pct: 50.0,
            util_pct: Some(40.0),
        };
        // Measured 0.3 at 40 %: 0.3 - 0.7 ln(c/40) + 0.5 * 0.1 <= ln 0.9 from c = 76.6 %,
        // so 80 %.
        let cfg = MlConfig::default();
        let (share, why) = model_share(&model, &cfg, &query(&s, &co, 0.3)).unwrap();
        assert_eq!(share, 80.0);
        assert!(why.starts_with("gpu model: p99/target"), "{why}");
        // Within the margin already: the smallest share that stays there
        // (-0.3 - 0.7 ln(c/40) + 0.05 <= ln 0.9 from c = 32.5 %, so 35 %): it gives back.
        let (share, _) = model_share(&model, &cfg, &query(&s, &co, -0.3)).unwrap();
        assert_eq!(share, 35.0);
    }

    #[test]
    fn an_input_out_of_range_or_no_share_meeting_the_target_falls_back_with_the_reason() {
        let r = gcol("log_share_ratio");
        let model = linear_gpu_model(&[(0.0, &[(r, -0.7)]), (0.0, &[(r, -0.7)])]);
        let co = GpuCoRunners::default();
        let cfg = MlConfig::default();
        // 100 000 requests per second: log_rps 11.5, far outside 0 ± 5.
        let busy = Sample {
            requests_per_s: Some(1e5),
            ..Sample::default()
        };
        let e = model_share(&model, &cfg, &query(&busy, &co, 0.3)).unwrap_err();
        assert!(e.contains("input log_rps out of its training range"), "{e}");
        // Saturated (measured 5.4 × the target): the model's level is used, and it says
        // 2.0 - 0.7 ln(c/40), over ln 0.9 even at 100 %.
        let s = Sample::default();
        let high = linear_gpu_model(&[(2.0, &[(r, -0.7)]), (2.0, &[(r, -0.7)])]);
        let e = model_share(&high, &cfg, &query(&s, &co, 2.0f64.ln() + 1.0)).unwrap_err();
        assert!(e.contains("no share meets the target"), "{e}");
        // Members that disagree on the change: unsure.
        let unsure = linear_gpu_model(&[(0.0, &[(r, -0.2)]), (0.0, &[(r, -6.0)])]);
        let e = model_share(&unsure, &cfg, &query(&s, &co, 0.3)).unwrap_err();
        assert!(e.contains("gpu model unsure"), "{e}");
    }

    #[test]
    fn a_cpu_model_is_refused_as_the_gpu_model() {
        let ctx = crate::HostContext {
            host: super::super::tests::host(),
            specs: vec![],
        };
        let cpu = Arc::new(Model::synthetic(1, &[], 0));
        let ml = MlPolicy::new(ctx, Arc::clone(&cpu), MlConfig::default());
        let e = ml.with_gpu_model(cpu).unwrap_err();
        assert_eq!(
            e,
            crate::BuildError::GpuModelSchema {
                expected: "qos-gpu-v1".into(),
                got: "qos-v1".into()
            }
        );
    }

    /// A model placed at `share` with `samples` smoothed readings of `log_q`.
    fn placed(share: u8, log_q: f64, samples: u32) -> GpuModel {
        GpuModel {
            share: Some(share),
            log_q: Some(log_q),
            samples,
            placed: true,
            ..GpuModel::default()
        }
    }

    fn ask(now: f64, want: f64) -> ShareAsk {
        ShareAsk {
            now,
            want,
            published: Some(40),
            pending: false,
        }
    }

    #[test]
    fn a_share_never_changes_while_a_restart_is_pending() {
        let cfg = MlConfig::default();
        // Far over the target, wanting 80 % at 40 %: but 60 % was published and the client
        // has not restarted yet. The published share stays.
        let mut g = placed(40, 1.0, 10);
        let pending = ShareAsk {
            published: Some(60),
            pending: true,
            ..ask(40.0, 80.0)
        };
        assert_eq!(g.choose(pending, &cfg, 1_000, false), 60);
        // And the interval's readings are not taken as the new share's.
        g.observe(true, Some(2.0), Some(90.0));
        assert_eq!((g.log_q, g.samples, g.util), (Some(1.0), 10, None));
    }

    #[test]
    fn a_share_never_changes_on_fewer_than_three_samples_after_the_first_placement() {
        let cfg = MlConfig::default();
        // Over the target, wanting 80 % at 40 %, with 2 samples: hold.
        let mut g = placed(40, 0.5, 2);
        assert_eq!(g.choose(ask(40.0, 80.0), &cfg, 1_000, false), 40);
        // With 3 it grows, in steps of 5: 80 -> 80.
        g.samples = 3;
        assert_eq!(g.choose(ask(40.0, 78.0), &cfg, 1_000, false), 80);
        // The very first placement needs one sample only.
        let mut first = GpuModel {
            placed: false,
            ..placed(40, -1.0, 1)
        };
        assert_eq!(first.choose(ask(40.0, 52.0), &cfg, 1_000, false), 55);
    }

    #[test]
    fn a_restart_skips_the_interval_that_held_it_and_starts_the_count_over() {
        let mut g = placed(40, 0.5, 5);
        g.follow(Some(60), false);
        assert_eq!(
            (g.share, g.log_q, g.samples, g.skip),
            (Some(60), None, 0, 1)
        );
        // The tail at 40 % is kept for learning the exponent.
        assert_eq!(g.before, Some((40, 0.5)));
        g.observe(false, Some(0.9), None);
        assert_eq!((g.log_q, g.samples), (None, 0));
        g.observe(false, Some(0.1), None);
        assert_eq!((g.log_q, g.samples), (Some(0.1), 1));
    }

    #[test]
    fn a_share_shrinks_only_after_gpu_shrink_after_ms_of_surplus_beyond_the_hysteresis() {
        let cfg = MlConfig::default();
        // Within the target at 60 %, needing 40 %: a surplus of 20 > 15 points.
        let mut g = placed(60, -0.5, 5);
        assert_eq!(g.choose(ask(60.0, 40.0), &cfg, 10_000, false), 60);
        assert_eq!(g.choose(ask(60.0, 40.0), &cfg, 129_999, false), 60);
        // 120 s after it started, the share shrinks to the need (in steps: 40).
        assert_eq!(g.choose(ask(60.0, 40.0), &cfg, 130_000, false), 40);
        // A surplus of 10 points (< 15) never shrinks it, however long it lasts.
        let mut g = placed(60, -0.5, 5);
        assert_eq!(g.choose(ask(60.0, 50.0), &cfg, 0, false), 60);
        assert_eq!(g.choose(ask(60.0, 50.0), &cfg, 1_000_000, false), 60);
    }

    #[test]
    fn a_surplus_that_pauses_restarts_the_shrink_clock() {
        let cfg = MlConfig::default();
        let mut g = placed(60, -0.5, 5);
        assert_eq!(g.choose(ask(60.0, 40.0), &cfg, 0, false), 60);
        // The need comes back near the share at 100 s: the surplus ends.
        assert_eq!(g.choose(ask(60.0, 55.0), &cfg, 100_000, false), 60);
        assert_eq!(g.choose(ask(60.0, 40.0), &cfg, 110_000, false), 60);
        assert_eq!(g.choose(ask(60.0, 40.0), &cfg, 229_999, false), 60);
        assert_eq!(g.choose(ask(60.0, 40.0), &cfg, 230_000, false), 40);
    }

    #[test]
    fn a_share_within_the_margin_does_not_grow_on_a_pessimistic_need_alone() {
        let cfg = MlConfig::default();
        // ln(0.8) < ln(0.9): the smoothed tail is within the margin.
        let mut g = placed(40, 0.8f64.ln(), 5);
        assert_eq!(g.choose(ask(40.0, 60.0), &cfg, 0, false), 40);
    }

    #[test]
    fn the_exponent_is_learned_from_the_tail_before_and_after_a_change() {
        // 40 % -> 80 % moved the smoothed tail from 0.5 to 0.5 - 0.6 ln 2: e = 0.6.
        let mut g = placed(40, 0.5, 3);
        g.follow(Some(80), false);
        g.skip = 0;
        let q1 = 0.5 - 0.6 * 2f64.ln();
        for _ in 0..3 {
            g.observe(false, Some(q1), None);
        }
        let e = g.exponent.unwrap();
        assert!((e - 0.6).abs() < 1e-9, "{e}");
        assert_eq!(g.before, None);
    }

    #[test]
    fn a_live_share_change_skips_nothing_and_gives_a_surplus_back_at_once() {
        let cfg = MlConfig::default();
        // No restart, no downtime: the next interval already measures the new share.
        let mut g = placed(40, 0.5, 5);
        g.follow(Some(60), true);
        assert_eq!((g.share, g.skip), (Some(60), 0));
        // A surplus of 10 points: given back at once where a change is free, kept (under
        // the 15-point hysteresis) where it costs a restart.
        let mut live = placed(60, -0.5, 5);
        assert_eq!(live.choose(ask(60.0, 50.0), &cfg, 0, true), 50);
        let mut restart = placed(60, -0.5, 5);
        assert_eq!(restart.choose(ask(60.0, 50.0), &cfg, 0, false), 60);
    }

    /// [`fit_shares`] for services with no measured tail, settled, priority 0.
    fn fit(want: &[f64], cur: &[f64], room: f64) -> Option<Vec<Option<u8>>> {
        let standing = vec![
            Standing {
                priority: 0,
                tail: None,
                persistent: false,
            };
            want.len()
        ];
        fit_shares(want, cur, &standing, true, room).map(|v| v.into_iter().map(|x| x.0).collect())
    }

    fn standing(priority: i32, ratio: f64) -> Standing {
        Standing {
            priority,
            tail: Some(ratio.ln()),
            persistent: ratio > 1.0,
        }
    }

    #[test]
    fn shares_that_fit_are_left_alone() {
        assert_eq!(fit(&[50.0, 49.0], &[30.0, 30.0], 99.0), None);
    }

    #[test]
    fn on_a_full_gpu_growers_share_what_is_free_in_proportion_and_nobody_is_cut() {
        // Room 99. a wants 30 (has 40): takes 30. b wants 60 (has 30), c wants 50 (has 20):
        // free = 99 - 30 - (30 + 20) = 19; extra = 30 + 30 = 60;
        // b = 30 + 19 * 30 / 60 = 39.5 -> 39; c = 20 + 9.5 = 29.5 -> 29.
        let got = fit(&[30.0, 60.0, 50.0], &[40.0, 30.0, 20.0], 99.0).unwrap();
        assert_eq!(got, vec![Some(30), Some(39), Some(29)]);
    }

    #[test]
    fn on_a_full_gpu_a_change_of_less_than_a_step_is_not_made() {
        // Room 99; a wants 60 (has 58), b wants 45 (has 40): free = 99 - 98 = 1;
        // a = 58 + 1 * 2 / 7 ≈ 58.3 and b = 40 + 1 * 5 / 7 ≈ 40.7: each less than 5 from what
        // it has, so both stay.
        let got = fit(&[60.0, 45.0], &[58.0, 40.0], 99.0).unwrap();
        assert_eq!(got, vec![Some(58), Some(40)]);
    }

    #[test]
    fn at_the_first_placement_an_overfull_gpu_scales_every_want() {
        // Nothing in force yet (cur = want): free = 99 - 120 < 0, so scale: 60 * 99 / 120 =
        // 49.5 -> 49 each.
        let got = fit(&[60.0, 60.0], &[60.0, 60.0], 99.0).unwrap();
        assert_eq!(got, vec![Some(49), Some(49)]);
    }

    #[test]
    fn in_overload_a_service_far_over_its_target_yields_to_those_that_can_still_meet_theirs() {
        // Everyone wants the whole GPU; a and c are 1.4 × their targets, b 19 ×. b yields to
        // one step; a and c grow into the 30 points freed: free = 99 - 5 - (33 + 31) = 30,
        // extra = 67 + 69: a = 33 + 30 * 67 / 136 = 47.8, c = 31 + 30 * 69 / 136 = 46.2, and
        // the point rounding left over goes to a, not to best effort.
        let want = [100.0, 100.0, 100.0];
        let cur = [33.0, 33.0, 31.0];
        let st = [standing(0, 1.4), standing(0, 19.0), standing(0, 1.4)];
        let got = fit_shares(&want, &cur, &st, true, 99.0).unwrap();
        assert_eq!(
            got,
            vec![
                (Some(48), Fit::Spread),
                (Some(5), Fit::Yields),
                (Some(46), Fit::Spread)
            ]
        );
        // Not while a share is still to be measured (a restart pending): spread as before,
        // nobody cut.
        let spread = fit_shares(&want, &cur, &st, false, 99.0).unwrap();
        assert!(spread.iter().all(|(s, f)| *f == Fit::Spread && s.is_some()));
        assert_eq!(spread[1].0, Some(33));
        // A service far over its target of higher priority does not yield to lower ones.
        let st = [standing(0, 1.4), standing(1, 19.0), standing(0, 1.4)];
        let got = fit_shares(&want, &cur, &st, true, 99.0).unwrap();
        assert_eq!(got[1], (Some(33), Fit::Spread));
        // Nor on a tail lifted by readings not yet persistently over the target (an outlier).
        let outlier = Standing {
            persistent: false,
            ..standing(0, 19.0)
        };
        let st = [standing(0, 1.4), outlier, standing(0, 1.4)];
        let got = fit_shares(&want, &cur, &st, true, 99.0).unwrap();
        assert_eq!(got[1].1, Fit::Spread);
        // Nor when nobody near its target wants more (nothing to gain from the cut).
        let st = [standing(0, 0.8), standing(0, 19.0), standing(0, 0.9)];
        let got = fit_shares(&[30.0, 100.0, 30.0], &cur, &st, true, 99.0).unwrap();
        assert_eq!(got[1].1, Fit::Spread);
    }

    /// One GPU service `a` (target 25 ms, share 40 % in force, `effective` as the client
    /// runs) beside a best-effort job on the same GPU, measured at p99 33.7 ms
    /// (ln(p99/target) 0.3): the context and the observation.
    fn one_gpu_service(effective: u8) -> (crate::HostContext, Observation) {
        use cohabit_core::{
            Allocation, GpuCapacity, Plan, ServiceClass, ServiceObservation, ServiceSpec, WayRange,
        };

        let mut host = super::super::tests::host();
        host.gpus = vec![GpuCapacity {
            name: "g".into(),
            sms: 108,
            share_change: ShareChange::Restart,
        }];
        let specs = vec![
            ServiceSpec {
                name: "a".into(),
                class: ServiceClass::LatencyCritical {
                    p99_target_ms: 25.0,
                },
                gpu: Some(0),
                priority: 0,
            },
            ServiceSpec {
                name: "train".into(),
                class: ServiceClass::BestEffort,
                gpu: Some(0),
                priority: 0,
            },
        ];
        let alloc = |cores: u32, first: u32, pct: u8| Allocation {
            cores,
            llc_ways: WayRange::new(first, 1),
            mba_pct: 100,
            gpu_mps_pct: Some(pct),
        };
        let current = Plan {
            services: BTreeMap::from([("a".into(), alloc(2, 0, 40))]),
            best_effort: alloc(32, 1, 60),
            gpu_memory_mib: Default::default(),
        };
        let services = specs
            .iter()
            .map(|spec| ServiceObservation {
                spec: spec.clone(),
                sample: if spec.is_latency_critical() {
                    Sample {
                        p99_ms: Some(33.7),
                        requests_per_s: Some(20.0),
                        gpu_util_pct: Some(70.0),
                        cpu_busy_cores: Some(0.5),
                        ..Sample::default()
                    }
                } else {
                    Sample::default()
                },
                gpu_mps_effective_pct: spec.is_latency_critical().then_some(effective),
            })
            .collect();
        let obs = Observation {
            t_ms: 1_000,
            services,
            current,
        };
        (crate::HostContext { host, specs }, obs)
    }

    #[test]
    fn a_gpu_service_decided_by_the_gpu_model_records_its_prediction_at_the_share_laid_out() {
        use crate::Policy as _;

        let measured = (33.7f64 / 25.0).ln();
        // The learned model: ln(p99/target) falls by 0.7 per unit of ln(share ratio); the
        // online model's prior exponent is 0.5, so the two predictions differ.
        let r = gcol("log_share_ratio");
        let gpu = Arc::new(linear_gpu_model(&[
            (0.0, &[(r, -0.7)]),
            (0.0, &[(r, -0.7)]),
        ]));
        let cpu = Arc::new(Model::synthetic(1, &[], 0));
        let (ctx, obs) = one_gpu_service(40);
        let mut ml = MlPolicy::new(ctx.clone(), Arc::clone(&cpu), MlConfig::default())
            .with_gpu_model(gpu)
            .unwrap();
        let _ = ml.initial();
        let d = ml.decide(&obs, 1_000);
        let why = &d.reasons["a"];
        assert_eq!(why.path, DecisionPath::Model, "{why:?}");
        assert!(why.text.starts_with("gpu model:"), "{why:?}");
        let share = f64::from(d.plan.services["a"].gpu_mps_pct.unwrap());
        assert!(share > 40.0, "grows from 40 %: {share}");
        let p = d
            .predictions
            .get("a")
            .expect("the GPU service's prediction");
        assert!(
            p.log_qos_ratio.is_finite() && p.log_qos_sigma.is_finite(),
            "{p:?}"
        );
        // The model's change from the measured tail at the share laid out; the spread is
        // the measured tail's (one sample: 0.1 + 0.3), the members agreeing.
        let expected = measured - 0.7 * (share / 40.0).ln();
        assert!(
            (p.log_qos_ratio - expected).abs() < 1e-4,
            "{p:?} vs {expected}"
        );
        assert!((p.log_qos_sigma - 0.4).abs() < 1e-6, "{p:?}");
        // Within the margin at the chosen share, pessimistically.
        assert!(p.log_qos_ratio + 0.5 * p.log_qos_sigma <= 0.9f64.ln() + 1e-9);

        // Without the learned model: the online model's prediction, in the same units.
        let mut ml = MlPolicy::new(ctx.clone(), Arc::clone(&cpu), MlConfig::default());
        let _ = ml.initial();
        let d = ml.decide(&obs, 1_000);
        let share = f64::from(d.plan.services["a"].gpu_mps_pct.unwrap());
        let p = d
            .predictions
            .get("a")
            .expect("the online model's prediction");
        let expected = measured - 0.5 * (share / 40.0).ln();
        assert!(
            (p.log_qos_ratio - expected).abs() < 1e-9,
            "{p:?} vs {expected}"
        );

        // A restart pending (published 40 %, the client still at 30 %): no prediction.
        let (ctx, obs) = one_gpu_service(30);
        let mut ml = MlPolicy::new(ctx, cpu, MlConfig::default());
        let _ = ml.initial();
        let d = ml.decide(&obs, 1_000);
        assert!(!d.predictions.contains_key("a"), "{:?}", d.predictions);
    }

    #[test]
    fn the_best_effort_share_shrinks_before_any_latency_critical_share_when_they_miss() {
        use cohabit_core::{
            Allocation, GpuCapacity, Plan, ServiceClass, ServiceObservation, ServiceSpec, WayRange,
        };
        use std::collections::BTreeMap;

        use crate::Policy as _;

        let mut host = super::super::tests::host();
        host.gpus = vec![GpuCapacity {
            name: "g".into(),
            sms: 108,
            share_change: ShareChange::Restart,
        }];
        let lc = |name: &str| ServiceSpec {
            name: name.into(),
            class: ServiceClass::LatencyCritical {
                p99_target_ms: 25.0,
            },
            gpu: Some(0),
            priority: 0,
        };
        let specs = vec![
            lc("a"),
            lc("b"),
            ServiceSpec {
                name: "train".into(),
                class: ServiceClass::BestEffort,
                gpu: Some(0),
                priority: 0,
            },
        ];
        let ctx = crate::HostContext { host, specs };
        let alloc = |cores: u32, first: u32, pct: u8| Allocation {
            cores,
            llc_ways: WayRange::new(first, 1),
            mba_pct: 100,
            gpu_mps_pct: Some(pct),
        };
        let current = Plan {
            services: BTreeMap::from([
                ("a".into(), alloc(2, 0, 30)),
                ("b".into(), alloc(2, 1, 30)),
            ]),
            best_effort: alloc(32, 2, 40),
            gpu_memory_mib: Default::default(),
        };
        let over = Sample {
            p99_ms: Some(40.0),
            requests_per_s: Some(100.0),
            gpu_util_pct: Some(90.0),
            cpu_busy_cores: Some(0.5),
            ..Sample::default()
        };
        let obs = Observation {
            t_ms: 1_000,
            services: ctx
                .specs
                .iter()
                .map(|spec| ServiceObservation {
                    spec: spec.clone(),
                    sample: if spec.is_latency_critical() {
                        over.clone()
                    } else {
                        Sample::default()
                    },
                    gpu_mps_effective_pct: current
                        .services
                        .get(&spec.name)
                        .and_then(|a| a.gpu_mps_pct),
                })
                .collect(),
            current: current.clone(),
        };
        let cpu = Arc::new(Model::synthetic(1, &[], 0));
        let mut ml = MlPolicy::new(ctx, cpu, MlConfig::default());
        let _ = ml.initial();
        let d = ml.decide(&obs, 1_000);
        let be = d.plan.best_effort.gpu_mps_pct.unwrap();
        assert!(be < 40, "the pool keeps {be} %");
        for name in ["a", "b"] {
            let s = d.plan.services[name].gpu_mps_pct.unwrap();
            assert!(s >= 30, "{name} cut to {s} %");
        }
        // The pool gives up first: the services take what it had.
        let lc: u32 = ["a", "b"]
            .iter()
            .map(|n| u32::from(d.plan.services[*n].gpu_mps_pct.unwrap()))
            .sum();
        assert!(lc > 60 && lc + u32::from(be) <= 100, "{lc} + {be}");
    }

    #[test]
    fn in_overload_a_service_far_over_its_target_does_not_grow_into_what_another_gave_up() {
        // Two LLM services 20 times over their targets and a classifier a little over its
        // own: the one holding a quarter of the GPU yields to a step, and what it gives up
        // goes to the classifier, not to the other LLM service (which took it, and gave it
        // back at the next settled tick, a restart each time) nor to the GPU job.
        let want = [100.0, 100.0, 80.0];
        let cur = [26.0, 5.0, 68.0];
        let st = [standing(0, 20.0), standing(0, 20.0), standing(0, 1.1)];
        let got = fit_shares(&want, &cur, &st, true, 99.0).unwrap();
        assert_eq!(got[0], (Some(5), Fit::Yields));
        assert_eq!(got[1].0, Some(5), "{got:?}");
        let lc: u32 = got.iter().map(|(s, _)| u32::from(s.unwrap())).sum();
        assert_eq!(lc, 99, "the GPU job keeps only its floor: {got:?}");
        assert_eq!(got[2].0, Some(89));
    }

    #[test]
    fn on_a_full_gpu_growth_goes_to_the_higher_priority_first() {
        // Room 99, both want 60 and have 40: 19 points are free. The higher priority takes
        // them all (59); the other keeps what it has.
        let st = [standing(1, 1.3), standing(0, 1.3)];
        let got = fit_shares(&[60.0, 60.0], &[40.0, 40.0], &st, true, 99.0).unwrap();
        assert_eq!(got[0].0, Some(59));
        assert_eq!(got[1].0, Some(40));
        // At one priority, in proportion to how much more each wants (as before).
        let st = [standing(0, 1.3), standing(0, 1.3)];
        let got = fit_shares(&[60.0, 60.0], &[40.0, 40.0], &st, true, 99.0).unwrap();
        assert_eq!((got[0].0, got[1].0), (Some(49), Some(49)));
    }
}
