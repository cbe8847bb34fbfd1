//! `ml`: model-predictive allocation with online correction and a feedback fallback.
//!
//! Problem: jump to an allocation that meets every latency target with little to spare,
//! instead of stepping toward it one unit per interval as feedback controllers do, without
//! ever trusting a model further than its record on this host.
//!
//! Approach, each tick, per latency-critical CPU service:
//! 1. **Correct.** If the last prediction was for the allocation now in force, its error
//!    against the measured ln(p99/target) updates a per-service bias (exponentially
//!    weighted); errors for an unchanged allocation estimate the measurement noise, errors
//!    after a change recalibrate the model's spread for this service. A measured violation
//!    more than the tolerance above the prediction is a miss.
//! 2. **Predict, anchored.** A candidate is predicted as the measured value of the
//!    allocation in force plus the ensemble's predicted *change* to the candidate (and the
//!    bias); its spread is the members' disagreement on that change, calibrated
//!    ([`cohabit_models::ModelMetadata::change_sigma_scale`]), and the measurement noise.
//!    Past saturation or without a reading the model's level is used instead.
//! 3. **Choose a path.** *Fallback* (grow-only feedback steps) when an input is more than
//!    `z_limit` training standard deviations from the training mean, when no candidate is
//!    admissible and certain (spread ≤ `unsure_sigma`), or for `fallback_hold_ms` after
//!    `misses_to_fallback` misses in a row. A sudden saturated reading with unchanged load
//!    and idle cores waits a tick for confirmation (counter glitches).
//! 4. **Search.** For each way count on a grid, the fewest cores whose pessimistic
//!    prediction `mean + k_sigma * sigma` (`k_sigma_give_back` for a service within its
//!    margin, which could only give back) is at most ln(`margin`), among core counts in a
//!    trust region (up to twice the cores in force, as in the training data): a core grid
//!    for every way count in one batch, then one batch closing the gap below each way
//!    count's first admissible grid point. This gives each service a frontier. If nothing
//!    is admissible, the bare target among the candidates already scored.
//! 5. **Pack** jointly: a dynamic programme over services picks one frontier point each so
//!    that cores and ways fit (the pool keeps one way when CPU jobs run) at least cost
//!    (share of cores plus `way_cost` times share of ways, plus a little per changed
//!    resource). A service measured under `margin` of its target keeps its allocation until
//!    a cheaper admissible one has existed for `shrink_after` intervals; a service that needs
//!    more never loses ways in the same step. Way ranges are contiguous and disjoint, from
//!    way 0 in configuration order; services beyond the host's CLOSIDs share the pool's ways.
//! 6. **Degrade** (documented rule) when the needs cannot all fit: nobody is cut to make
//!    room. Each service keeps what it has (or its need, when that is smaller in every
//!    resource); then, in configuration order, services that want more take their cheapest
//!    point within reach of what is free, or grow toward it as far as what is free allows
//!    (a service over its target by a quarter more cores, up to twice its need's); a service
//!    over its target still short of ways takes one step's worth from the service with the
//!    most measured slack whose frontier has a point with fewer ways. The rule
//!    depends only on the needs and what is in force, so it does not oscillate while the
//!    loads hold.
//!
//! GPU services: the shipped model was trained on CPU services, and its `gpu_cand` input
//! puts any GPU service outside its range. Their MPS share is sized from an online model
//! instead: `ln(p99/target)` falls by `e * ln(s'/s)` when the share goes from `s` to `s'`,
//! with `e` learned from the service's own share changes (prior
//! [`MlConfig::gpu_exponent_prior`]) and anchored on the smoothed measured p99 at the share in
//! force. A share change restarts the MPS client (seconds of downtime), so a share grows
//! (in 5-point steps) when the pessimistic prediction needs it and the smoothed tail is past
//! the margin, shrinks only after `gpu_shrink_after_ms` of surplus larger than
//! `gpu_hysteresis_pct`, and never changes while a restart is pending or on fewer than
//! three samples since the last change. When the services on a GPU want more than 99 %,
//! those that want less take it and the others grow into what is free in proportion to how
//! much more they want; the pool keeps 1 %.
//!
//! Reasons start with `model:` or `fallback:` so logs and plots can tell the paths apart.
//!
//! Cost: about 9 way counts × 6 core counts plus the gaps per service per tick, scored in
//! two batches; the DP is `services × ways²`. Eight services on a 36-core, 20-way host take
//! about 0.7 ms (`cargo bench -p cohabit-controller --bench ml_decide`).

use std::collections::BTreeMap;
use std::sync::Arc;

use cohabit_core::{
    Allocation, DecisionPath, Observation, Prediction, Reason, Sample, WayRange, MBA_MAX_PCT,
};
use cohabit_models::{features, log_qos_ratio, Model, Neighbours, FEATURE_NAMES, N_FEATURES};
use ndarray::{Array2, ArrayView1};

use super::{fair_shares, layout, slack, Decision, HostContext, Policy, Share};

/// Tunables of the `ml` policy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MlConfig {
    /// The pessimistic prediction must be at most this fraction of the target.
    pub margin: f64,
    /// Spreads added to the mean for the pessimistic prediction.
    pub k_sigma: f64,
    /// The same for a service that is within its margin and could only give back.
    pub k_sigma_give_back: f64,
    /// A spread (ln units) above which the model is considered unsure.
    pub unsure_sigma: f64,
    /// Features further than this many training standard deviations from the training
    /// mean are out of range.
    pub z_limit: f32,
    /// Weight of the newest error in the per-service bias.
    pub correction_weight: f64,
    /// A measured violation more than this (ln units) above the prediction is a miss.
    pub miss_tolerance: f64,
    /// Misses in a row that send a service to the fallback.
    pub misses_to_fallback: u32,
    /// How long a service stays on the fallback before the model is tried again.
    pub fallback_hold_ms: u64,
    /// Intervals a cheaper allocation must stay available before resources are given back.
    pub shrink_after: u32,
    /// Prior of the GPU share exponent (p99 ∝ share^-e).
    pub gpu_exponent_prior: f64,
    /// Smallest surplus (percentage points) worth a GPU client restart to give back.
    pub gpu_hysteresis_pct: u8,
    /// How long a GPU surplus must last before the share shrinks.
    pub gpu_shrink_after_ms: u64,
    /// Worth of the whole LLC relative to all cores, for the packer's cost (best-effort
    /// jobs usually gain more from cores than from ways).
    pub way_cost: f64,
}

impl Default for MlConfig {
    fn default() -> Self {
        Self {
            margin: 0.9,
            k_sigma: 0.5,
            k_sigma_give_back: 1.0,
            unsure_sigma: 0.7,
            z_limit: 5.0,
            correction_weight: 0.3,
            miss_tolerance: 0.3,
            misses_to_fallback: 3,
            fallback_hold_ms: 30_000,
            shrink_after: 5,
            gpu_exponent_prior: 0.5,
            gpu_hysteresis_pct: 15,
            gpu_shrink_after_ms: 120_000,
            way_cost: 0.1,
        }
    }
}

/// The last prediction made for a service: for which allocation, and what.
#[derive(Debug, Clone, Copy, PartialEq)]
struct LastPrediction {
    alloc: Allocation,
    /// Anchored model mean, before the bias.
    base: f64,
    /// Bias-corrected mean.
    corrected: f64,
    sigma: f64,
    /// The model's own spread (before the service's factor and the measurement noise).
    model_sigma: f64,
    /// Whether the allocation differed from the one in force when predicted.
    moved: bool,
}

/// One prediction of ln(p99/target).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Pred {
    mean: f64,
    /// Total spread: the model's, times the service's factor, and the measurement noise.
    sigma: f64,
    /// The model's own spread.
    model_sigma: f64,
}

/// Online state of a GPU service's share model.
#[derive(Debug, Clone, Default)]
struct GpuModel {
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
}

/// GPU shares move in steps of this many percentage points.
const GPU_STEP_PCT: f64 = 5.0;

/// Smoothed samples a GPU share must have been measured for before it is changed again.
const GPU_MIN_SAMPLES: u32 = 3;

#[derive(Debug, Clone)]
struct ServiceState {
    /// How this tick's predictions are made.
    basis: Basis,
    /// This tick's scored candidates (cores, ways) at full MBA, for reuse.
    scored: Vec<((u32, u32), Pred)>,
    /// Last tick's measured ln(p99/target) and requests per second.
    prev_reading: Option<(f64, Option<f64>)>,
    /// Exponentially weighted error of the anchored predictions.
    bias: f64,
    /// Exponentially weighted squared standardised error of predictions for a *changed*
    /// allocation: the model's spread is scaled by its square root for this service
    /// (online recalibration; starts at 1).
    z2: f64,
    /// Exponentially weighted squared error of predictions for an unchanged allocation:
    /// the measurement's own noise.
    noise2: f64,
    misses: u32,
    last: Option<LastPrediction>,
    fallback_until_ms: Option<u64>,
    fallback_why: String,
    surplus_ticks: u32,
    seen: bool,
    gpu: GpuModel,
}

impl Default for ServiceState {
    fn default() -> Self {
        Self {
            basis: Basis::default(),
            prev_reading: None,
            scored: Vec::new(),
            bias: 0.0,
            z2: 1.0,
            noise2: MEASUREMENT_SIGMA * MEASUREMENT_SIGMA,
            misses: 0,
            last: None,
            fallback_until_ms: None,
            fallback_why: String::new(),
            surplus_ticks: 0,
            seen: false,
            gpu: GpuModel::default(),
        }
    }
}

impl ServiceState {
    /// Factor on the model's spread for this service.
    fn sigma_factor(&self) -> f64 {
        self.z2.sqrt().clamp(0.3, 3.0)
    }
}

/// What one service needs, as the packer sees it.
#[derive(Debug, Clone)]
enum Need {
    /// Frontier from the model: (fewest cores, ways) for each way count that has one.
    Frontier { points: Vec<(u32, u32)> },
    /// A fixed demand (fallback step, hysteresis, GPU service).
    Fixed { cores: u32, ways: u32 },
}

/// Per-service outcome of the search before packing.
#[derive(Debug, Clone)]
struct Plan1 {
    name: String,
    need: Need,
    /// Whether the current allocation may be kept (safe and not yet due to shrink).
    keep: Option<(u32, u32)>,
    reason: String,
    gpu_pct: Option<u8>,
    /// Shares the pool's ways instead of a range of its own (beyond the CLOSIDs).
    shares_pool_ways: bool,
    /// The model's inputs were in range: its prediction for the final allocation is
    /// recorded (on the fallback too, so that its errors keep being measured).
    predictable: bool,
    /// Measured over its target in the last interval.
    violating: bool,
    /// Measured slack `1 - p99/target` in the last interval.
    slack: Option<f64>,
}

impl Plan1 {
    fn fixed(name: &str, cores: u32, ways: u32, reason: String, predictable: bool) -> Self {
        Self {
            name: name.to_string(),
            need: Need::Fixed { cores, ways },
            keep: None,
            reason,
            gpu_pct: None,
            shares_pool_ways: false,
            predictable,
            violating: false,
            slack: None,
        }
    }
}

/// How one service's candidates are predicted this tick.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Basis {
    /// Measured ln(p99/target) of the allocation in force, when usable as an anchor.
    anchor: Option<f64>,
    bias: f64,
    factor: f64,
    /// Spread of one measurement.
    noise: f64,
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

/// What the model needs to predict one service's candidates.
struct Input<'a> {
    target_ms: f64,
    sample: &'a Sample,
    current: &'a Allocation,
    neighbours: &'a Neighbours,
    basis: Basis,
}

/// Prior noise of one measured p99 (ln units), before the service's own is measured.
const MEASUREMENT_SIGMA: f64 = 0.05;

/// Cost of changing one resource of one service in the packer (a fraction of the host).
const CHANGE_COST: f64 = 0.01;

/// Busy fraction of its cores above which a service counts as saturated.
const SATURATED_UTIL: f64 = 0.9;

/// Relative load change under which a sudden saturated reading waits for confirmation.
const GLITCH_LOAD_CHANGE: f64 = 0.2;

/// Smallest measurement noise assumed (ln units).
const NOISE_FLOOR: f64 = 0.02;

/// Core counts scored first, as multiples of the cores in force (up to twice them: the
/// trust region of the training data).
const CORE_GRID: [f64; 6] = [0.4, 0.6, 0.8, 1.0, 1.4, 2.0];

/// p99 over target beyond which a measurement is not used as an anchor.
const SATURATED: f64 = 2.0;

/// A partial packing in the dynamic programme: (cost, cores used, (cores, ways) so far).
type Packing = (f64, u32, Vec<(u32, u32)>);

/// The model-predictive policy.
#[derive(Debug, Clone)]
pub struct MlPolicy {
    ctx: HostContext,
    cfg: MlConfig,
    model: Arc<Model>,
    state: BTreeMap<String, ServiceState>,
}

impl MlPolicy {
    /// The `ml` policy managing the host in `ctx` with `model`.
    pub fn new(ctx: HostContext, model: Arc<Model>, cfg: MlConfig) -> Self {
        let state = ctx
            .latency_critical()
            .map(|s| (s.name.clone(), ServiceState::default()))
            .collect();
        Self {
            ctx,
            cfg,
            model,
            state,
        }
    }

    /// Way counts searched: a way more or less matters less the more a service has, so
    /// the grid thins out, and ends at the most a service can have.
    fn way_grid(&self) -> Vec<u32> {
        let max = self.lc_ways();
        let mut g: Vec<u32> = [1, 2, 3, 4, 6, 8, 11, 14]
            .into_iter()
            .filter(|w| *w < max)
            .collect();
        g.push(max);
        g
    }

    /// Ways the latency-critical services may use in total.
    fn lc_ways(&self) -> u32 {
        self.ctx.host.llc_ways - u32::from(self.ctx.has_cpu_best_effort())
    }

    /// The first feature further than `z_limit` from the training data, if any (flags
    /// excluded: missing counters are part of the training data).
    fn out_of_range(&self, f: &[f32; N_FEATURES]) -> Option<(&'static str, f32)> {
        let meta = &self.model.meta;
        f.iter()
            .zip(FEATURE_NAMES)
            .zip(meta.norm_mean.iter().zip(&meta.norm_std))
            .filter(|((_, name), _)| !name.starts_with("has_"))
            .map(|((x, name), (m, s))| (name, (x - m) / s))
            .find(|(_, z)| z.abs() > self.cfg.z_limit)
    }

    /// Predictions (mean, spread) of ln(p99/target) for candidates of one service.
    ///
    /// Anchored (the allocation in force was measured and is not saturated): the measured
    /// value plus the model's predicted *change* from the allocation in force, whose spread is
    /// the members' disagreement on that change plus the measurement's own noise. Otherwise
    /// the model's level. Both plus the learned bias; spreads times the service's factor.
    fn predict_many(&self, input: &Input<'_>, cands: &[Allocation]) -> Vec<Pred> {
        let b = input.basis;
        // Anchored, the allocation in force is predicted as measured: no model needed.
        let same = |c: &Allocation| {
            c.cores == input.current.cores
                && c.llc_ways.count == input.current.llc_ways.count
                && c.mba_pct == input.current.mba_pct
        };
        if let (Some(q), true) = (b.anchor, cands.iter().all(same)) {
            let p = Pred {
                mean: q + b.bias,
                sigma: b.noise,
                model_sigma: 0.0,
            };
            return vec![p; cands.len()];
        }
        let host = &self.ctx.host;
        let f = |c: &Allocation| {
            features(
                host,
                input.target_ms,
                input.sample,
                input.current,
                c,
                input.neighbours,
            )
        };
        let mut rows = Array2::<f32>::zeros((cands.len(), N_FEATURES));
        for (r, c) in cands.iter().enumerate() {
            rows.row_mut(r).assign(&ArrayView1::from(&f(c)[..]));
        }
        match b.anchor {
            Some(q) => {
                let reference = f(input.current);
                let (d, s) = self
                    .model
                    .score_change(ArrayView1::from(&reference[..]), rows.view());
                d.iter()
                    .zip(s.iter())
                    .map(|(d, s)| {
                        let model_sigma = f64::from(*s);
                        let scaled = model_sigma * b.factor;
                        Pred {
                            mean: q + f64::from(*d) + b.bias,
                            sigma: (scaled * scaled + b.noise * b.noise).sqrt(),
                            model_sigma,
                        }
                    })
                    .collect()
            }
            None => {
                let (m, s) = self.model.score(rows.view());
                m.iter()
                    .zip(s.iter())
                    .map(|(m, s)| Pred {
                        mean: f64::from(*m) + b.bias,
                        sigma: f64::from(*s) * b.factor,
                        model_sigma: f64::from(*s),
                    })
                    .collect()
            }
        }
    }

    /// The per-way frontier of one service: for each way count the fewest cores whose
    /// prediction is admissible (pessimistic value at most ln(`limit`), spread at most
    /// `unsure_sigma`). A grid of core counts around the allocation in force is scored for
    /// every way count in one batch, then the gap below each way count's first admissible
    /// grid point in a second. Returns (cores, mean, spread) per way.
    fn frontier(
        &self,
        input: &Input<'_>,
        ways: &[u32],
        max_cores: u32,
        limit: f64,
        k: f64,
        scored: &mut Vec<((u32, u32), Pred)>,
    ) -> Vec<Option<(u32, f64, f64)>> {
        let limit = limit.ln();
        let unsure = self.cfg.unsure_sigma;
        let ok = |(m, s): (f64, f64)| m + k * s <= limit && s <= unsure;
        let mut score = |points: &[(u32, u32)]| -> Vec<(f64, f64)> {
            let cands: Vec<Allocation> = points
                .iter()
                .map(|&(cores, w)| Allocation {
                    cores,
                    llc_ways: WayRange::new(0, w),
                    mba_pct: MBA_MAX_PCT,
                    gpu_mps_pct: None,
                })
                .collect();
            let preds = self.predict_many(input, &cands);
            scored.extend(points.iter().copied().zip(preds.iter().copied()));
            preds.into_iter().map(|p| (p.mean, p.sigma)).collect()
        };
        let cur = f64::from(input.current.cores.max(1));
        let mut grid: Vec<u32> = CORE_GRID
            .iter()
            .map(|f| u32::try_from(cohabit_core::whole((cur * f).max(1.0))).unwrap_or(1))
            .map(|c| c.clamp(1, max_cores))
            .collect();
        grid.sort_unstable();
        grid.dedup();
        let points: Vec<(u32, u32)> = ways
            .iter()
            .flat_map(|&w| grid.iter().map(move |&c| (c, w)))
            .collect();
        let scored = score(&points);
        // Per way: the first admissible grid point and the grid point below it.
        let mut lo = vec![0u32; ways.len()];
        let mut hi = vec![0u32; ways.len()];
        let mut at: Vec<Option<(f64, f64)>> = vec![None; ways.len()];
        for k in 0..ways.len() {
            let row = &scored[k * grid.len()..(k + 1) * grid.len()];
            if let Some(i) = row.iter().position(|p| ok(*p)) {
                hi[k] = grid[i];
                lo[k] = if i == 0 { grid[0] } else { grid[i - 1] + 1 };
                at[k] = Some(row[i]);
            }
        }
        // Close every gap in one batch: each core count between the grid point below and
        // the first admissible one (one batch is cheaper than a bisection's several).
        let gaps: Vec<(usize, u32)> = (0..ways.len())
            .filter(|&k| at[k].is_some())
            .flat_map(|k| (lo[k]..hi[k]).map(move |c| (k, c)))
            .collect();
        if !gaps.is_empty() {
            let points: Vec<(u32, u32)> = gaps.iter().map(|&(k, c)| (c, ways[k])).collect();
            for (&(k, c), p) in gaps.iter().zip(score(&points)) {
                if c < hi[k] && ok(p) {
                    hi[k] = c;
                    at[k] = Some(p);
                }
            }
        }
        (0..ways.len())
            .map(|k| at[k].map(|(m, s)| (hi[k], m, s)))
            .collect()
    }

    /// Step 1: the measured error of the last prediction updates the bias and the misses.
    fn correct(&mut self, obs: &Observation) {
        let alpha = self.cfg.correction_weight;
        let tol = self.cfg.miss_tolerance;
        for o in obs.latency_critical() {
            let (Some(st), Some(target)) =
                (self.state.get_mut(&o.spec.name), o.spec.p99_target_ms())
            else {
                continue;
            };
            let Some(last) = st.last.take() else { continue };
            let in_force = obs.current.services.get(&o.spec.name) == Some(&last.alloc);
            let Some(measured) = log_qos_ratio(&o.sample, target).filter(|_| in_force) else {
                continue;
            };
            let err = measured - last.base;
            let surprise = measured - last.corrected;
            st.bias = ((1.0 - alpha) * st.bias + alpha * err).clamp(-2.0, 2.0);
            // An unchanged allocation measures the noise; a changed one the model's spread.
            if !last.moved {
                st.noise2 = ((1.0 - alpha) * st.noise2 + alpha * surprise * surprise)
                    .clamp(NOISE_FLOOR * NOISE_FLOOR, 1.0);
            } else if last.model_sigma > 0.01 {
                let excess = (surprise * surprise - st.noise2).max(0.0);
                let z2 = excess / (last.model_sigma * last.model_sigma);
                st.z2 = ((1.0 - alpha) * st.z2 + alpha * z2).clamp(0.0, 100.0);
            }
            if measured > 0.0 && surprise > tol.max(2.0 * last.sigma) {
                st.misses += 1;
            } else if measured <= 0.0 {
                st.misses = 0;
            }
        }
    }

    /// A feedback step for a service the model cannot be trusted with.
    fn fallback_step(&mut self, obs: &Observation, name: &str, why: &str) -> (u32, u32, String) {
        let cur = obs
            .current
            .services
            .get(name)
            .map_or((1, 1), |a| (a.cores, a.llc_ways.count));
        let s = slack(obs, name);
        // Grow-only: cuts are the model's job once it can be trusted again, so a service on
        // the fallback never walks into a latency cliff.
        let (cores, ways, what) = match s {
            Some(v) if v < 0.05 => {
                // Violating: a step proportional to how far off, a quarter of the current
                // cores at most; past saturation (p99 at twice the target or more, a
                // reading the glitch check let through) the cores double. One more way.
                let frac = if v <= 1.0 - SATURATED {
                    1.0
                } else {
                    (-v).clamp(0.1, 0.25)
                };
                let step = (f64::from(cur.0) * frac).ceil();
                let step = u32::try_from(cohabit_core::whole(step)).unwrap_or(1).max(1);
                (
                    cur.0 + step,
                    cur.1 + 1,
                    format!("+{step} cores +1 way (slack {v:.2})"),
                )
            }
            Some(v) => (cur.0, cur.1, format!("hold (slack {v:.2})")),
            None => (cur.0, cur.1, "hold (no latency reading)".into()),
        };
        let why = why.strip_prefix("model: ").map_or_else(
            || format!("fallback: {why}; {what}"),
            |w| format!("fallback: {w}; {what}"),
        );
        (cores, ways, why)
    }

    /// Step 2–3 for one CPU service.
    fn plan_cpu_service(&mut self, obs: &Observation, name: &str, now_ms: u64) -> Plan1 {
        let cfg = self.cfg;
        let spec_obs = obs.services.iter().find(|o| o.spec.name == name);
        let target = spec_obs.and_then(|o| o.spec.p99_target_ms()).unwrap_or(1.0);
        let sample = spec_obs.map(|o| o.sample.clone()).unwrap_or_default();
        let current = obs.current.services.get(name).copied().unwrap_or_else(|| {
            // Not yet placed (a new service): features as if it had a fair share.
            let s = fair_shares(&self.ctx).get(name).copied().unwrap_or(Share {
                cores: 1,
                ways: 1,
                mba_pct: MBA_MAX_PCT,
                gpu_pct: None,
            });
            Allocation {
                cores: s.cores,
                llc_ways: WayRange::new(0, s.ways),
                mba_pct: s.mba_pct,
                gpu_mps_pct: None,
            }
        });
        let neighbours = Neighbours::observed(obs, name, &self.ctx.host);
        let measured = log_qos_ratio(&sample, target);
        let st = self.state.entry(name.to_string()).or_default();
        st.scored.clear();
        let new_service = !st.seen;
        st.seen = true;
        // Past saturation (queues growing, timeouts) the model's differences mean little:
        // predict levels there.
        let anchor = measured.filter(|q| *q <= SATURATED.ln());
        st.basis = Basis {
            anchor,
            bias: st.bias,
            factor: st.sigma_factor(),
            noise: st.noise2.sqrt(),
        };
        let basis = st.basis;
        let prev = st.prev_reading;
        st.prev_reading = measured.map(|q| (q, sample.requests_per_s));
        // A sudden huge p99 with the load as it was a tick ago, right after a good reading,
        // is most likely a glitch: wait one tick for it to be confirmed.
        if let (Some(q), Some((q0, rps0))) = (measured, prev) {
            let same_load = match (sample.requests_per_s, rps0) {
                (Some(a), Some(b)) if b > 0.0 => (a / b - 1.0).abs() < GLITCH_LOAD_CHANGE,
                _ => false,
            };
            // A saturated service serves no more than it can: its busy cores tell.
            let busy = sample
                .cpu_busy_cores
                .map_or(0.0, |b| b / f64::from(current.cores.max(1)));
            if q > SATURATED.ln() && q0 <= 0.0 && same_load && busy < SATURATED_UTIL {
                return Plan1::fixed(
                    name,
                    current.cores,
                    current.llc_ways.count,
                    format!(
                        "model: hold (p99/target {:.1} with unchanged load after {:.2}: unconfirmed)",
                        q.exp(),
                        q0.exp()
                    ),
                    false,
                );
            }
        }
        if measured.is_none() && !new_service {
            return Plan1::fixed(
                name,
                current.cores,
                current.llc_ways.count,
                "model: hold (no latency reading)".into(),
                false,
            );
        }
        if st.misses >= cfg.misses_to_fallback {
            st.fallback_until_ms = Some(now_ms + cfg.fallback_hold_ms);
            st.fallback_why = format!("predictions missed {} times in a row", st.misses);
            st.misses = 0;
        }
        if let Some(until) = st.fallback_until_ms {
            if now_ms < until {
                let why = st.fallback_why.clone();
                return self.fixed(obs, name, &why, true);
            }
            st.fallback_until_ms = None;
        }
        let probe = features(
            &self.ctx.host,
            target,
            &sample,
            &current,
            &current,
            &neighbours,
        );
        if let Some((feature, z)) = self.out_of_range(&probe) {
            let why = format!("input {feature} outside the training range (z = {z:.1})");
            return self.fixed(obs, name, &why, false);
        }
        let input = Input {
            target_ms: target,
            sample: &sample,
            current: &current,
            neighbours: &neighbours,
            basis,
        };
        let ways = self.way_grid();
        // The trust region: training candidates had at most twice the cores in force, so a
        // single step at most doubles them. A service measured under its margin only looks
        // for cheaper allocations, so a quarter more cores is as far as it needs to look.
        let held = measured.is_some_and(|q| q <= cfg.margin.ln());
        let reach = if held {
            current.cores + current.cores / 4
        } else {
            current.cores * 2
        };
        let max_cores = self.ctx.host.cores.min(reach.max(2));
        let mut scored = Vec::new();
        let mut frontier = self.frontier(
            &input,
            &ways,
            max_cores,
            cfg.margin,
            // Risk is not symmetric: a service in trouble takes an uncertain step up, a
            // service that is fine gives back only what the model is sure of.
            if held {
                cfg.k_sigma_give_back
            } else {
                cfg.k_sigma
            },
            &mut scored,
        );
        let mut relaxed = false;
        if frontier.iter().all(Option::is_none) {
            // Nothing meets the target with the margin: settle for the bare target, among
            // the candidates already scored (no second search).
            let unsure = cfg.unsure_sigma;
            frontier = ways
                .iter()
                .map(|&w| {
                    scored
                        .iter()
                        .filter(|((_, sw), p)| *sw == w && p.mean <= 0.0 && p.sigma <= unsure)
                        .min_by_key(|((c, _), _)| *c)
                        .map(|((c, _), p)| (*c, p.mean, p.sigma))
                })
                .collect();
            relaxed = true;
            if frontier.iter().all(Option::is_none) {
                let best = self
                    .predict_many(
                        &input,
                        &[Allocation {
                            cores: max_cores,
                            llc_ways: WayRange::new(0, self.lc_ways()),
                            ..current
                        }],
                    )
                    .first()
                    .map_or((0.0, 0.0), |p| (p.mean, p.sigma));
                let why = if best.1 > cfg.unsure_sigma {
                    format!("model unsure (sigma {:.2})", best.1)
                } else {
                    format!(
                        "model: no allocation within reach meets the target (best p99/target {:.2})",
                        best.0.exp()
                    )
                };
                return self.fixed(obs, name, &why, true);
            }
        }
        if let Some(st) = self.state.get_mut(name) {
            st.scored = scored;
        }
        let (cur_mean, cur_sigma) = self
            .predict_many(&input, std::slice::from_ref(&current))
            .first()
            .map_or((0.0, 0.0), |p| (p.mean, p.sigma));
        // The allocation in force was just measured: that beats any prediction for it. One
        // reading between the margin and the target (noise, mostly) does not make it
        // unsafe; two in a row, or one over the target, do.
        let limit = cfg.margin.ln();
        let cur_safe = measured
            .is_some_and(|q| q <= limit || (q <= 0.0 && prev.is_some_and(|(q0, _)| q0 <= limit)));
        let cheaper = frontier
            .iter()
            .zip(&ways)
            .filter_map(|(p, w)| p.map(|(c, _, _)| (c, *w)))
            .any(|(c, w)| self.cost(c, w) < self.cost(current.cores, current.llc_ways.count));
        let st = self.state.entry(name.to_string()).or_default();
        st.surplus_ticks = if cur_safe && cheaper {
            st.surplus_ticks + 1
        } else {
            0
        };
        // Hysteresis: a safe allocation is kept until something cheaper has been available
        // for a while.
        let keep = (cur_safe && !new_service && st.surplus_ticks < cfg.shrink_after)
            .then_some((current.cores, current.llc_ways.count));
        let now = format!("p99/target {:.2} ± {:.2}", cur_mean.exp(), cur_sigma);
        let reason = if new_service {
            "model: placed from the model".to_string()
        } else if keep.is_some() {
            format!("model: hold ({now})")
        } else if cur_safe {
            format!(
                "model: give back (cheaper allocation safe for {} intervals)",
                st.surplus_ticks
            )
        } else if relaxed {
            format!("model: resize to the bare target, no margin left ({now} now)")
        } else {
            format!("model: resize ({now} now)")
        };
        if keep.is_none() {
            st.surplus_ticks = 0;
        }
        let mut points: Vec<(u32, u32)> = frontier
            .iter()
            .zip(&ways)
            .filter_map(|(p, w)| p.map(|(c, _, _)| (c, *w)))
            .collect();
        if !cur_safe && !new_service {
            // A service that needs more never loses ways in the same step: trading its
            // cache for cores on a prediction alone can land on a cache cliff. (Cores may
            // go, so that cores piled on by earlier steps do not block the ways it needs.)
            let w0 = current.llc_ways.count;
            points = points.into_iter().map(|(c, w)| (c, w.max(w0))).collect();
            points.sort_unstable();
            points.dedup();
        }
        Plan1 {
            name: name.to_string(),
            need: Need::Frontier { points },
            keep,
            reason,
            gpu_pct: None,
            shares_pool_ways: false,
            predictable: true,
            violating: false,
            slack: None,
        }
    }

    fn fixed(&mut self, obs: &Observation, name: &str, why: &str, predictable: bool) -> Plan1 {
        let (cores, ways, reason) = self.fallback_step(obs, name, why);
        Plan1::fixed(name, cores, ways, reason, predictable)
    }

    /// A GPU service: its share from the online queueing model, its CPU side from its
    /// measured CPU use.
    fn plan_gpu_service(&mut self, obs: &Observation, name: &str, now_ms: u64) -> Plan1 {
        let cfg = self.cfg;
        let o = obs.services.iter().find(|o| o.spec.name == name);
        let target = o.and_then(|o| o.spec.p99_target_ms()).unwrap_or(1.0);
        let sample = o.map(|o| o.sample.clone()).unwrap_or_default();
        let current = obs.current.services.get(name).copied();
        let published = current.and_then(|a| a.gpu_mps_pct);
        let effective = o.and_then(|o| o.gpu_mps_effective_pct).or(published);
        let st = self.state.entry(name.to_string()).or_default();
        st.seen = true;
        let g = &mut st.gpu;
        // A restart just completed: the interval held downtime; its sample says nothing of
        // the new share.
        if g.share != effective {
            if let (Some(s), Some(q)) = (g.share, g.log_q.filter(|_| g.samples >= 3)) {
                g.before = Some((s, q));
            }
            if g.share.is_some() {
                g.skip = 1;
            }
            g.share = effective;
            g.log_q = None;
            g.samples = 0;
            g.util = None;
            g.surplus_since_ms = None;
        }
        let pending = published != effective;
        if g.skip > 0 {
            g.skip -= 1;
        } else if !pending {
            if let Some(q) = log_qos_ratio(&sample, target) {
                // Few requests per interval make the p99 noisy; smooth it.
                g.log_q = Some(g.log_q.map_or(q, |old| 0.7 * old + 0.3 * q));
                g.samples += 1;
            }
            if let Some(u) = sample.gpu_util_pct {
                let u = u / 100.0;
                g.util = Some(g.util.map_or(u, |old| 0.7 * old + 0.3 * u));
            }
            // Learn the exponent from the change: the smoothed tail before and after.
            if let (Some((s0, q0)), Some(s1), Some(q1)) = (g.before, g.share, g.log_q) {
                if g.samples >= 3 && s0 != s1 {
                    let e = ((q0 - q1) / (f64::from(s1) / f64::from(s0)).ln()).clamp(0.2, 1.2);
                    g.exponent = Some(g.exponent.map_or(e, |old| 0.5 * old + 0.5 * e));
                    g.before = None;
                }
            }
        }
        let e = g.exponent.unwrap_or(cfg.gpu_exponent_prior);
        // The spread of the smoothed tail shrinks with samples.
        let sigma = 0.1 + 0.3 / f64::from(g.samples.max(1)).sqrt();
        let share_now = f64::from(effective.unwrap_or(100).max(1));
        let need = |q: f64, limit: f64, k: f64| -> f64 {
            // Smallest share with q - e*ln(s'/s) + k*sigma <= ln(limit), and the busy
            // fraction of its streams under 0.8.
            let by_tail = share_now * ((q + k * sigma - limit.ln()) / e).exp();
            let by_util = g.util.map_or(1.0, |u| share_now * (u / 0.8).powf(1.0 / e));
            by_tail.max(by_util).clamp(1.0, 100.0)
        };
        let (want, why) = match g.log_q {
            _ if pending => (
                published.map_or(share_now, f64::from),
                "model: gpu share waits for the client restart".to_string(),
            ),
            None => (
                share_now,
                "model: gpu hold (no latency reading at this share yet)".to_string(),
            ),
            Some(q) => {
                let want = need(q, cfg.margin, cfg.k_sigma);
                (
                    want,
                    format!(
                        "model: gpu share for p99/target {:.2} at {share_now:.0} % (exponent {e:.2}, {} samples)",
                        q.exp(),
                        g.samples
                    ),
                )
            }
        };
        // Hysteresis: grow at once, shrink only after a lasting, sizeable surplus.
        let step = |x: f64| {
            let x = (x / GPU_STEP_PCT).ceil() * GPU_STEP_PCT;
            u8::try_from(cohabit_core::whole(x.clamp(GPU_STEP_PCT, 100.0))).unwrap_or(100)
        };
        let now_pct = u8::try_from(cohabit_core::whole(share_now)).unwrap_or(100);
        let mut chosen = now_pct;
        let enough = g.samples >= GPU_MIN_SAMPLES || !g.placed;
        if let (false, true, Some(q)) = (pending, enough, g.log_q) {
            let first = !g.placed;
            g.placed = true;
            // Grow when the pessimistic need is a step above the share and the smoothed
            // tail is past the margin (or at the first placement).
            if want > share_now + GPU_STEP_PCT - 0.5 && (first || q > cfg.margin.ln()) {
                chosen = step(want);
                g.surplus_since_ms = None;
            } else if want + f64::from(cfg.gpu_hysteresis_pct) < share_now {
                let since = *g.surplus_since_ms.get_or_insert(now_ms);
                if now_ms >= since + cfg.gpu_shrink_after_ms {
                    chosen = step(want);
                    g.surplus_since_ms = None;
                }
            } else {
                g.surplus_since_ms = None;
            }
        }
        if pending {
            chosen = published.unwrap_or(now_pct);
        }
        // The CPU side: pre- and post-processing, sized from the measured busy cores.
        let busy = sample.cpu_busy_cores.unwrap_or(0.0);
        let cur_cores = current.map_or(1, |a| a.cores);
        let cores = u32::try_from(cohabit_core::whole((busy / 0.5).ceil().max(1.0)))
            .unwrap_or(1)
            .max(
                if slack(obs, name).is_some_and(|s| s < 0.0) && g.log_q.is_none() {
                    cur_cores
                } else {
                    1
                },
            );
        Plan1 {
            name: name.to_string(),
            need: Need::Fixed { cores, ways: 1 },
            keep: None,
            reason: why,
            gpu_pct: Some(chosen),
            shares_pool_ways: false,
            predictable: false,
            violating: false,
            slack: None,
        }
    }

    /// Keeps the GPU services on each GPU within 99 % (the pool keeps 1 %). Degrade rule:
    /// at the first placement the wanted shares are scaled to fit; later, services that
    /// want less take what they want, and those that want more grow only into what is
    /// free, in proportion to how much more they want, so no share is taken from a service
    /// that still needs it and nothing oscillates.
    fn fit_gpu(&self, plans: &mut [Plan1], obs: &Observation) {
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
            if want.iter().sum::<f64>() <= room {
                continue;
            }
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
            let fixed: f64 = want
                .iter()
                .zip(&cur)
                .filter(|(w, c)| w <= c)
                .map(|(w, _)| w)
                .sum();
            let growing: f64 = want
                .iter()
                .zip(&cur)
                .filter(|(w, c)| w > c)
                .map(|(_, c)| c)
                .sum();
            let free = room - fixed - growing;
            let extra: f64 = want.iter().zip(&cur).map(|(w, c)| (w - c).max(0.0)).sum();
            let shares: Vec<f64> = if free >= 0.0 && extra > 0.0 {
                want.iter()
                    .zip(&cur)
                    .map(|(w, c)| {
                        if w > c {
                            c + free * (w - c) / extra
                        } else {
                            *w
                        }
                    })
                    .collect()
            } else {
                let total: f64 = want.iter().sum();
                want.iter().map(|w| w * room / total).collect()
            };
            for (k, &i) in idx.iter().enumerate() {
                // A restart for less than a step is not worth it.
                let s = if (shares[k] - cur[k]).abs() < GPU_STEP_PCT {
                    cur[k]
                } else {
                    shares[k].floor().max(1.0)
                };
                plans[i].gpu_pct = u8::try_from(cohabit_core::whole(s)).ok();
                plans[i]
                    .reason
                    .push_str("; GPU full: growth limited to what is free");
            }
        }
    }

    /// What an allocation costs the best-effort jobs: its share of the cores plus
    /// `way_cost` times its share of the ways.
    fn cost(&self, cores: u32, ways: u32) -> f64 {
        f64::from(cores) / f64::from(self.ctx.host.cores)
            + self.cfg.way_cost * f64::from(ways) / f64::from(self.ctx.host.llc_ways)
    }

    /// Step 4–5: joint packing. Returns (cores, ways) per plan, in order.
    fn pack(&self, plans: &[Plan1], current: &[(u32, u32)]) -> (Vec<(u32, u32)>, bool) {
        let c_total = self.ctx.host.cores;
        let w_total = self.lc_ways() as usize;
        let cost = |c: u32, w: u32| self.cost(c, w);
        // Options per service: (cores, ways-in-DP, ways).
        let options = |p: &Plan1, allow_keep: bool| -> Vec<(u32, u32)> {
            if let (true, Some(k)) = (allow_keep, p.keep) {
                return vec![k];
            }
            match &p.need {
                Need::Fixed { cores, ways } => vec![(*cores, *ways)],
                Need::Frontier { points } => points.clone(),
            }
        };
        for allow_keep in [true, false] {
            // dp[u] = (cost, cores, choices) using u ways.
            let mut dp: Vec<Option<Packing>> = vec![None; w_total + 1];
            dp[0] = Some((0.0, 0, vec![]));
            for (p, cur) in plans.iter().zip(current) {
                let opts = options(p, allow_keep);
                let mut next: Vec<Option<Packing>> = vec![None; w_total + 1];
                for (u, e) in dp.iter().enumerate() {
                    let Some((cst, cores, ch)) = e else { continue };
                    for &(c, w) in &opts {
                        let dw = if p.shares_pool_ways { 0 } else { w as usize };
                        let u2 = u + dw;
                        if u2 > w_total || cores + c > c_total {
                            continue;
                        }
                        // Changing costs a little, so near-ties keep what is in force.
                        let changes = u32::from(c != cur.0) + u32::from(w != cur.1);
                        let c2 = cst + cost(c, w) + CHANGE_COST * f64::from(changes);
                        if next[u2].as_ref().is_none_or(|(b, _, _)| c2 < *b) {
                            let mut ch2 = ch.clone();
                            ch2.push((c, w));
                            next[u2] = Some((c2, cores + c, ch2));
                        }
                    }
                }
                dp = next;
            }
            if let Some((_, _, ch)) = dp.into_iter().flatten().min_by(|a, b| a.0.total_cmp(&b.0)) {
                return (ch, false);
            }
        }
        // Degrade: nobody is cut to make room. A service keeps what it has (or its cheaper
        // need, when all of that need is below what it has); then, in configuration order,
        // each service that wants more takes its cheapest point within reach of what is
        // free, or else grows toward its need as far as what is free allows (cores by a
        // quarter, up to twice its need's, when it is over its target); one still short of
        // ways takes them from the service with most slack that the model says can spare
        // them.
        let w_cap = u32::try_from(w_total).unwrap_or(1);
        let cheapest: Vec<(u32, u32)> = plans
            .iter()
            .zip(current)
            .map(|(p, cur)| {
                options(p, true)
                    .into_iter()
                    .min_by(|a, b| cost(a.0, a.1).total_cmp(&cost(b.0, b.1)))
                    .unwrap_or(*cur)
            })
            .collect();
        let below = |a: (u32, u32), b: (u32, u32)| a.0 <= b.0 && a.1 <= b.1;
        let mut out: Vec<(u32, u32)> = cheapest
            .iter()
            .zip(current)
            .map(|(n, c)| if below(*n, *c) { *n } else { *c })
            .collect();
        let lc_ways = |out: &[(u32, u32)]| -> u32 {
            out.iter()
                .zip(plans)
                .filter(|(_, p)| !p.shares_pool_ways)
                .map(|(x, _)| x.1)
                .sum()
        };
        let mut free_c = c_total.saturating_sub(out.iter().map(|x| x.0).sum());
        let mut free_w = w_cap.saturating_sub(lc_ways(&out));
        for i in 0..plans.len() {
            if below(cheapest[i], out[i]) {
                continue;
            }
            let base = out[i];
            let pool = plans[i].shares_pool_ways;
            let reach =
                |&(c, w): &(u32, u32)| c <= base.0 + free_c && (pool || w <= base.1 + free_w);
            let pick = options(&plans[i], false)
                .into_iter()
                .filter(reach)
                .min_by(|a, b| cost(a.0, a.1).total_cmp(&cost(b.0, b.1)))
                .unwrap_or_else(|| {
                    // Nothing within reach: grow toward the need as far as what is free
                    // allows; a service over its target also gets a quarter more cores
                    // (the ways it wants are taken), up to twice what its need has.
                    let want = if plans[i].violating {
                        cheapest[i]
                            .0
                            .max((base.0 + (base.0 / 4).max(1)).min(cheapest[i].0 * 2))
                    } else {
                        cheapest[i].0
                    };
                    (
                        want.max(base.0).min(base.0 + free_c),
                        if pool {
                            base.1
                        } else {
                            cheapest[i].1.max(base.1).min(base.1 + free_w)
                        },
                    )
                });
            free_c = (free_c + base.0).saturating_sub(pick.0);
            if !pool {
                free_w = (free_w + base.1).saturating_sub(pick.1);
            }
            out[i] = pick;
        }
        // A service over its target that still lacks the ways it wants takes one from the
        // service with the most measured slack whose model-backed options include one with
        // a way less (and the cores it then needs are free): one way per interval.
        for i in 0..plans.len() {
            if !plans[i].violating || plans[i].shares_pool_ways || out[i].1 >= cheapest[i].1 {
                continue;
            }
            let donor = (0..plans.len())
                .filter(|&j| j != i && !plans[j].violating && !plans[j].shares_pool_ways)
                .filter_map(|j| {
                    let fewer = options(&plans[j], false)
                        .into_iter()
                        .filter(|&(c, w)| w < out[j].1 && c <= out[j].0 + free_c)
                        .max_by_key(|&(_, w)| w)?;
                    Some((j, fewer, plans[j].slack.unwrap_or(0.0)))
                })
                .max_by(|a, b| a.2.total_cmp(&b.2));
            if let Some((j, (c, w), _)) = donor {
                free_c = (free_c + out[j].0).saturating_sub(c);
                let freed = out[j].1 - w;
                out[j] = (c, w);
                out[i].1 += freed.min(cheapest[i].1 - out[i].1);
            }
        }
        (out, true)
    }
}

impl Policy for MlPolicy {
    fn name(&self) -> &'static str {
        "ml"
    }

    fn initial(&mut self) -> Decision {
        // Nothing measured yet: start from a fair share; the first observation places every
        // service from the model.
        let plan = layout(&self.ctx, &fair_shares(&self.ctx), MBA_MAX_PCT);
        let reasons = plan
            .groups()
            .map(|(g, _)| {
                (
                    g.to_string(),
                    Reason::new(
                        DecisionPath::Static,
                        "fair share until the first measurement",
                    ),
                )
            })
            .collect();
        Decision::new(plan, reasons)
    }

    fn decide(&mut self, obs: &Observation, now_ms: u64) -> Decision {
        self.correct(obs);
        let names: Vec<(String, bool)> = self
            .ctx
            .latency_critical()
            .map(|s| (s.name.clone(), s.gpu.is_some()))
            .collect();
        // The pool has a group of its own; every other group may isolate one service.
        let isolated = usize::try_from(self.ctx.host.groups_available().saturating_sub(1))
            .unwrap_or(usize::MAX);
        let mut plans: Vec<Plan1> = names
            .iter()
            .enumerate()
            .map(|(i, (name, gpu))| {
                let mut p = if *gpu {
                    self.plan_gpu_service(obs, name, now_ms)
                } else {
                    self.plan_cpu_service(obs, name, now_ms)
                };
                p.shares_pool_ways = i >= isolated;
                p.slack = slack(obs, name);
                p.violating = p.slack.is_some_and(|s| s < 0.0);
                p
            })
            .collect();
        self.fit_gpu(&mut plans, obs);
        let current: Vec<(u32, u32)> = plans
            .iter()
            .map(|p| {
                obs.current
                    .services
                    .get(&p.name)
                    .map_or((1, 1), |a| (a.cores, a.llc_ways.count))
            })
            .collect();
        let (packed, degraded) = self.pack(&plans, &current);
        let mut shares: BTreeMap<String, Share> = BTreeMap::new();
        let mut reasons = BTreeMap::new();
        for (p, (c, w)) in plans.iter().zip(&packed) {
            shares.insert(
                p.name.clone(),
                Share {
                    cores: *c,
                    ways: *w,
                    mba_pct: MBA_MAX_PCT,
                    gpu_pct: p.gpu_pct,
                },
            );
            let mut why = p.reason.clone();
            if degraded {
                why.push_str("; needs exceed the host: growth limited to what is free");
            }
            reasons.insert(p.name.clone(), typed(why));
        }
        let mut plan = layout(&self.ctx, &shares, MBA_MAX_PCT);
        // Services beyond the CLOSIDs share the pool's ways (and so its resctrl group).
        let pool = plan.best_effort;
        for p in plans.iter().filter(|p| p.shares_pool_ways) {
            if let Some(a) = plan.services.get_mut(&p.name) {
                a.llc_ways = pool.llc_ways;
                a.mba_pct = pool.mba_pct;
            }
        }
        // Predictions for the CPU services whose inputs are in range (model path or
        // fallback) under the plan, for the log and the next tick's correction.
        let mut predictions = BTreeMap::new();
        for p in plans.iter().filter(|p| p.predictable) {
            let Some(o) = obs.services.iter().find(|o| o.spec.name == p.name) else {
                continue;
            };
            let (Some(target), Some(cand)) =
                (o.spec.p99_target_ms(), plan.services.get(&p.name).copied())
            else {
                continue;
            };
            let current = obs.current.services.get(&p.name).copied().unwrap_or(cand);
            let neighbours = Neighbours::observed(obs, &p.name, &self.ctx.host);
            let basis = self.state.get(&p.name).map(|s| s.basis).unwrap_or_default();
            let input = Input {
                target_ms: target,
                sample: &o.sample,
                current: &current,
                neighbours: &neighbours,
                basis,
            };
            let known = self.state.get_mut(&p.name).and_then(|st| {
                let key = (cand.cores, cand.llc_ways.count);
                let hit = (cand.mba_pct == MBA_MAX_PCT)
                    .then(|| st.scored.iter().find(|(k, _)| *k == key).map(|(_, p)| *p))
                    .flatten();
                st.scored.clear();
                hit
            });
            let Some(Pred {
                mean,
                sigma,
                model_sigma,
            }) = known.or_else(|| self.predict_many(&input, &[cand]).first().copied())
            else {
                continue;
            };
            let bias = basis.bias;
            predictions.insert(
                p.name.clone(),
                Prediction {
                    log_qos_ratio: mean,
                    log_qos_sigma: sigma,
                },
            );
            if let Some(st) = self.state.get_mut(&p.name) {
                st.last = Some(LastPrediction {
                    alloc: cand,
                    base: mean - bias,
                    corrected: mean,
                    sigma,
                    model_sigma,
                    moved: cand != current,
                });
            }
        }
        reasons.insert(
            cohabit_core::BEST_EFFORT_GROUP.to_string(),
            Reason::new(
                DecisionPath::Model,
                "what the latency-critical services leave",
            ),
        );
        let mut d = Decision::new(plan, reasons);
        d.predictions = predictions;
        d
    }
}

/// The typed reason of a service's plan, whose text starts with the path that decided it.
fn typed(why: String) -> Reason {
    match why.strip_prefix("fallback: ") {
        Some(rest) => Reason::new(DecisionPath::Fallback, rest),
        None => Reason::new(
            DecisionPath::Model,
            why.strip_prefix("model: ").unwrap_or(&why),
        ),
    }
}
