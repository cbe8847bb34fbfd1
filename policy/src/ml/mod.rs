//! `ml`: model-predictive allocation with online correction and a feedback fallback.
//!
//! Problem: jump to an allocation that meets every latency target with little to spare,
//! instead of stepping toward it one unit per interval as feedback controllers do, without
//! ever trusting a model further than its record on this host.
//!
//! Approach, each tick, per latency-critical CPU service:
//! 1. **Correct.** If the last prediction was for the allocation now in force and was
//!    anchored (step 2; a level predicted past saturation teaches nothing), its error
//!    against the measured ln(p99/target) updates a per-service bias (the plain mean of
//!    the first errors, then exponentially weighted); errors for an unchanged allocation
//!    estimate the measurement noise, errors after a change recalibrate the model's spread
//!    for this service. A measured violation more than the tolerance above the prediction
//!    is a miss. A service's first reading sets the measurement noise no lower than its own
//!    sampling error (the p99 of the requests it rests on).
//! 2. **Predict, anchored.** A candidate is predicted as the measured value of the
//!    allocation in force plus the ensemble's predicted *change* to the candidate (and the
//!    bias); its spread is the members' disagreement on that change, calibrated
//!    ([`cohabit_models::ModelMetadata::change_sigma_scale`]), and the measurement noise.
//!    Past saturation or without a reading the model's level is used instead. With a
//!    per-host posterior ([`posterior`], [`MlConfig::posterior`]), the change is corrected
//!    by the posterior's mean on the change of the members' last hidden layer, and the
//!    members' part of the spread is the posterior's, which narrows as the host shows how
//!    changes land (step 1 teaches it the anchored prediction's error).
//! 3. **Choose a path.** *Fallback* (feedback steps that grow or hold) when an input is more
//!    than `z_limit` training standard deviations from the training mean, when no candidate
//!    is admissible and certain (spread ≤ `unsure_sigma`), or for `fallback_hold_ms` after
//!    `misses_to_fallback` misses in a row; a service over its target with an allocation
//!    measured safe at this load that the one in force does not cover goes back to it
//!    instead of stepping. A service the model is unsure of, held calm for `shrink_after`
//!    intervals, gives back a quarter of its cores (at least one), measured: undone at the
//!    next reading past the margin, whose cliff then holds at that load for a while that
//!    doubles with each such cliff (`cpu`'s `FALLBACK_GIVE_BACK`, the exploration rule of
//!    step 8, [`state::FALLBACK_CLIFF_LAPSE`]). A growth the fallback made of a quarter
//!    of the cores or more whose readings after it are no lower than before, at the same
//!    load, is undone, and the fallback grows the service no further at that load for a
//!    while ([`growth`]). A sudden saturated reading with unchanged
//!    load and idle cores waits a tick for confirmation (counter glitches), and step 1
//!    learns from it only once the next reading confirms it.
//! 4. **Search.** For each way count on a grid, the fewest cores whose pessimistic
//!    prediction `mean + k_sigma * sigma` (`k_sigma_give_back` for a service within its
//!    margin, which could only give back) is at most ln(`margin`), among core counts in a
//!    trust region (up to twice the cores in force, as in the training data): a core grid
//!    for every way count in one batch, then one batch closing the gap below each way
//!    count's first admissible grid point. This gives each service a frontier. If nothing
//!    is admissible, the bare target among the candidates already scored, with `k_sigma`
//!    spreads on the mean for a service that meets its target now (at its mean's bare
//!    target it sits on the edge until the load tips it over) and
//!    none for one already over it. The service's
//!    measured cliffs then lift the frontier: an allocation that was measured not enough
//!    (a give-back past the margin, or anything over the target short of saturation) rules
//!    out every allocation under it while the load is at least 0.9 of its own, whatever
//!    the model predicts ([`state::ServiceState::measured_floor`]). A service that may give
//!    back (within its margin, or safe to keep) gives back cores or ways only while it
//!    keeps at least `busy + give_back_headroom * sqrt(busy)` cores, its measured busy
//!    cores and their root; a cut under that floor is lifted to it, or, when the floor is
//!    above the cores in force, to the allocation in force ([`search::short_of_saturation`]:
//!    the model draws a queueing cliff as a slope). Allocations measured safe are added after.
//! 5. **Pack** jointly: a dynamic programme over services picks one frontier point each so
//!    that cores and ways fit (the pool keeps one way when CPU jobs run) at least cost
//!    (share of cores plus `way_cost` times share of ways, plus a little per changed
//!    resource). A service measured under `margin` of its target keeps its allocation until
//!    a cheaper admissible one has existed for `shrink_after` intervals (one due to give back
//!    may stay, so that its give-back never moves a kept neighbour, and a service measured
//!    over its target releases every kept allocation); a service that needs more never
//!    loses ways in the same step. Way ranges are contiguous and disjoint, from
//!    way 0 in configuration order. A cache-insensitive service (its frontier needs no more
//!    cores with one way than with any other count) is also offered the point `(cores, 0)`:
//!    the pool's ways, shared, in a group of its own at full bandwidth; it costs only its
//!    cores, so the ways go to the services that need them (the oracle's shared ranges,
//!    within what `ml` can predict). The model is asked about such a service as if it had one
//!    way; measured past its margin there, it is not put there again at that load
//!    ([`MlConfig::pool_ways_for_insensitive`] turns this off). Services beyond the host's CLOSIDs
//!    ([`HostContext::shares_pool_group`]) share the pool's ways with the best-effort jobs:
//!    they are searched with the ways they really get (pool sizes up to the pool's range in
//!    force, never more ways than they measured under), pay only for their cores, and a
//!    point of theirs fits only where the isolated services leave the pool its ways; on the
//!    fallback they grow by cores alone.
//! 6. **Degrade** (the overload rule, [`pack`]) when the needs cannot all fit: the
//!    best-effort pool yields first (the services may take every way, the pool sharing the
//!    top one, and its memory bandwidth goes to the least level tried); nobody of the same
//!    or a higher `priority` is cut to make room, unless it misses its target whatever it
//!    gets (the triage). Each service keeps what it has (or its
//!    need, when that is smaller in every resource; while a service is saturated, at
//!    twice its target or more for `shrink_after` intervals, the hysteresis of those of no
//!    higher priority does not hold, so each takes that need at once); then services that
//!    want more are served higher priority first, then smallest growth first (the most services meeting
//!    their targets), then in configuration order: each takes its cheapest point within
//!    reach of what is free, or what it lacks from services of lower priority, or grows
//!    toward it as far as what is free allows. Triage, for the fewest violations: a service
//!    over its target for `shrink_after` intervals in a row and still short takes what it
//!    lacks from services of no higher priority in the same state (they miss either way),
//!    and a service that gave takes nothing back in a triage for `fallback_hold_ms`. Last, a
//!    service over its target still short of ways takes one step's worth from the service
//!    with the most measured slack whose frontier has a point with fewer ways; when no
//!    frontier has one, a service over its target by at most a quarter for `shrink_after`
//!    intervals takes one way a tick from a service of no higher priority measured at 0.7
//!    of its target or less (feedback where the model vouches for nothing). The rule
//!    depends only on the needs, what is in force and who gave recently, so it does not
//!    oscillate while the loads hold.
//! 7. **Memory bandwidth** ([`mba`]): steps 2–6 run for a few MBA levels of the pool (the
//!    one in force; under pressure a step down and the minimum, the third of them only
//!    where it is likely to be chosen; without it a step up), each service's neighbour
//!    bandwidth as the pool would have it (services sharing the pool's group are searched
//!    at that MBA through `mba_cand`); the level with the fewest services short, then the
//!    least cost (packing plus the throughput the throttle takes from the pool) wins. The
//!    pool's reason names the levels planned when there were several. The pool's bandwidth
//!    at a level is read off its own readings at the levels it ran under (a delay curve
//!    through the two around it, [`mba::ThrottleCurve`]; in proportion before there are
//!    two). A step up that would win or tie but for the charge of the change is taken after
//!    `shrink_after` ticks of that with no pressure, so a throttle that buys nothing does
//!    not stay for good. No bandwidth
//!    reading for the pool: no throttle (a reading missing for a tick or two is replaced
//!    by the last). A step up that put a service past its margin is the pool's MBA cliff:
//!    no step up reaches it again while the load holds. A plan that grows a streaming pool
//!    (cores given back) by a tenth or more is planned again with the pool's bandwidth
//!    grown in proportion (a pool with no cores: at the rate per core learnt at the level
//!    planned), and a service measured safe is kept only if it is predicted
//!    within its margin beside it; that plan is taken unless it leaves more services short
//!    ([`MlPolicy::plan_level`]).
//! 8. **Explore** ([`state::ServiceState::explore`], off by default: `explore_step` 0): a
//!    service held under
//!    `explore_below` of its target for `shrink_after` intervals loses `explore_step` of
//!    its cores rounded down (a service smaller than one core in that share is not probed;
//!    never past 0.8 busy); a reading past the margin under the cut undoes it
//!    at once and remembers the service's cliff, under which no cut goes again at that load.
//!    This learns each service's cliff online where the shared model is too unsure to cut.
//!
//! GPU services: the CPU model was trained on CPU services, and its `gpu_cand` input
//! puts any GPU service outside its range. Their MPS share comes from the GPU model (schema
//! `qos-gpu`, [`MlPolicy::with_gpu_model`]; built in for the `-a100` presets) where its
//! inputs are in range and it is sure of a share that meets the target, else (path
//! `fallback`, the reason says why) from an online model: `ln(p99/target)` falls by
//! `e * ln(s'/s)` when the share goes from `s` to `s'`,
//! with `e` learned from the service's own share changes (prior
//! [`MlConfig::gpu_exponent_prior`]) and anchored on the smoothed measured p99 at the share in
//! force. A share change restarts the MPS client (seconds of downtime), so a share grows
//! (in 5-point steps) when the pessimistic prediction needs it and the smoothed tail is past
//! the margin, shrinks only after `gpu_shrink_after_ms` of surplus larger than
//! `gpu_hysteresis_pct`, and never changes while a restart is pending or on fewer than
//! three samples since the last change. When the services on a GPU want more than 99 %,
//! those that want less take it and the others grow into what is free in proportion to how
//! much more they want; the pool keeps 1 %. When none can grow, a service more than twice
//! over its target (and over it for `shrink_after` intervals in a row: one outlier reading
//! is not a reason for a restart) yields down to one step to services of the same or higher
//! priority that miss by less (the fewest violations; [`gpu`] module docs).
//!
//! Every service's reason carries the path that decided it ([`DecisionPath::Model`] or
//! [`DecisionPath::Fallback`]) beside its words, so logs, metrics and plots tell the paths
//! apart without reading the text.
//!
//! Cost: about 9 way counts × 6 core counts plus the gaps per service per pool level, scored
//! in two batches; the DP is `services × ways²`. The model's outputs for each service's
//! reference (the allocation in force, neighbours as measured) are computed once per tick
//! and shared by the pool levels, and at a level other than the one in force the allocation
//! in force rides with the first batch, so a level costs two model passes per service. A
//! tick's time grows with the pool levels it plans, which is why a third level is planned
//! only where it is likely to be chosen ([`mba`]). Model inference is compute-bound, a fixed
//! cost per call plus a cost per candidate row, hence the batches. The timings
//! (`cargo bench -p cohabit-lab --bench ml_decide`) are in docs/RESULTS.md, "Decision time".
//!
//! Modules: [`config`] (the tunables), [`state`] (step 1, step 8 and what is
//! remembered between ticks), [`predict`] (step 2 and the training-range check), [`cpu`]
//! (steps 2–4 for one CPU service and the fallback step), [`posterior`] (the per-host
//! correction of the model), [`search`] (step 4's frontier),
//! [`pack`] (steps 5–6), [`mba`] (step 7's rules) and [`levels`] (steps 2–6 planned at each
//! pool level, and the pick), [`growth`] (the fallback's growths judged), [`gpu`] (GPU
//! services' MPS shares), [`forecast`] (read-only forecasts for the exploring wrapper).
//! `pack` and `search` are pure functions over plain data; this file runs the steps in
//! order.

use std::cell::OnceCell;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use cohabit_core::{DecisionPath, Observation, Plan, Reason, WayRange, MBA_MAX_PCT};
use cohabit_models::posterior::{
    model_digest, Blr, PosteriorSet, PosteriorSnapshot, MAX_BASIS_WIDTH,
};
use cohabit_models::{log_qos_ratio, Model, Neighbours};

use crate::{
    downcast, fair_shares, layout, same_pool, slack, unchanged_services, Adopted, Decision,
    HostContext, Policy, Share,
};

mod config;
mod cpu;
mod forecast;
mod gpu;
mod growth;
mod levels;
mod mba;
mod pack;
mod posterior;
mod predict;
mod search;
mod state;

pub use config::MlConfig;
pub(crate) use forecast::Forecast;
use levels::LevelPlan;
use mba::PoolBw;
use pack::{Costs, Demand, Need, Packing, Room};
use predict::Reference;
use state::{unconfirmed_saturation, Measurement, Reading, ServiceState};

/// Costs closer than this are equal (sums of the same terms in another order differ in the
/// last bits).
const TIE: f64 = 1e-9;

/// What the service planners decided for one latency-critical service, before packing.
#[derive(Debug, Clone)]
struct ServicePlan {
    name: String,
    need: Need,
    /// The allocation in force, when the hysteresis keeps it (safe and not yet due to
    /// shrink).
    keep: Option<(u32, u32)>,
    /// The allocation in force, when the service is due to give back (safe, its hysteresis
    /// run out): it may stay there rather than move a neighbour whose allocation is kept.
    stay: Option<(u32, u32)>,
    reason: Reason,
    gpu_pct: Option<u8>,
    /// The model's inputs were in range: its prediction for the final allocation is
    /// recorded (on the fallback too, so that its errors keep being measured).
    predictable: bool,
    /// On the fallback because the model vouched for no candidate, its spread too wide
    /// (not because nothing it predicts meets the target, nor for misses or inputs out of
    /// range): such a service gives back measured once held calm (`cpu`'s give-back).
    unsure: bool,
}

impl ServicePlan {
    /// A fixed demand of `cores` and `ways`.
    fn fixed(name: &str, cores: u32, ways: u32, reason: Reason, predictable: bool) -> Self {
        Self {
            name: name.to_string(),
            need: Need::Fixed { cores, ways },
            keep: None,
            stay: None,
            reason,
            gpu_pct: None,
            predictable,
            unsure: false,
        }
    }
}

/// The model-predictive policy.
#[derive(Debug, Clone)]
pub struct MlPolicy {
    ctx: HostContext,
    cfg: MlConfig,
    model: Arc<Model>,
    /// The GPU services' share model (schema `qos-gpu`), when one is given
    /// ([`MlPolicy::with_gpu_model`]).
    gpu_model: Option<Arc<Model>>,
    state: BTreeMap<String, ServiceState>,
    /// The best-effort pool as observed this tick.
    pool: PoolBw,
    /// The pool's MBA level being planned (during a tick) or decided (after it).
    pool_level: u8,
    /// How many times its bandwidth the pool would stream as planned ([`mba::growth`]),
    /// when the plan grows it and the services are predicted beside that (1: as measured).
    pool_growth: f64,
    /// Last tick's needs did not all fit.
    last_degraded: bool,
    /// This tick's reference outputs per CPU service ([`Predictor::reference_out`]), shared
    /// by every pool level planned.
    references: BTreeMap<String, OnceCell<Reference>>,
    /// [`model_digest`] of the model, when the services keep a posterior on it
    /// ([`MlConfig::posterior`], a basis at most [`MAX_BASIS_WIDTH`] wide).
    posterior_model: Option<String>,
    /// The CPU services running on the pool's ways in a group of their own this tick
    /// ([`on_pool_ways`]).
    on_pool: BTreeSet<String>,
    /// The pool MBA limit that last hurt a service right after a raise ([`mba::MbaCliff`]).
    mba_cliff: Option<mba::MbaCliff>,
    /// Ticks in a row the pool's bandwidth stood in for a missing reading.
    pool_bw_stale: u32,
    /// When the last tick was observed, and the interval since the one before, seconds
    /// (the first tick's: since the start): the requests behind a reading.
    last_t_ms: Option<u64>,
    interval_s: f64,
    /// How the pool's bandwidth answered each MBA limit it ran under.
    throttle: mba::ThrottleCurve,
    /// Ticks in a row a step up of the pool's limit would have won but for the charge of
    /// changing it ([`MlPolicy::lift_after_a_while`]).
    raise_ticks: u32,
}

/// The services within the CLOSID budget whose range in `plan` is the pool's (a
/// cache-insensitive service put there, or the one whose top way the pool shares when the
/// services take every way: either way, it has no way of its own).
fn on_pool_ways(ctx: &HostContext, plan: &Plan) -> BTreeSet<String> {
    if !ctx.host.partitions_llc() {
        return BTreeSet::new();
    }
    plan.services
        .iter()
        .filter(|(name, a)| a.llc_ways == plan.best_effort.llc_ways && !ctx.shares_pool_group(name))
        .map(|(name, _)| name.clone())
        .collect()
}

/// [`model_digest`] of `model` when `cfg` keeps posteriors and its basis is narrow enough.
fn posterior_model(model: &Model, cfg: &MlConfig) -> Option<String> {
    let width = model.ensemble.basis_width()?;
    (cfg.posterior && width <= MAX_BASIS_WIDTH).then(|| model_digest(model))
}

/// `plan` as the model is asked about it: a service on the pool's ways has one way (it
/// shares them; one is the most it may count on).
fn as_modelled(plan: &Plan, on_pool: &BTreeSet<String>) -> Plan {
    let mut plan = plan.clone();
    for name in on_pool {
        if let Some(a) = plan.services.get_mut(name) {
            a.llc_ways = WayRange::new(a.llc_ways.first, 1);
        }
    }
    plan
}

impl MlPolicy {
    /// The tunables in force.
    pub fn config(&self) -> &MlConfig {
        &self.cfg
    }

    /// The `ml` policy managing the host in `ctx` with `model`.
    pub fn new(ctx: HostContext, model: Arc<Model>, cfg: MlConfig) -> Self {
        let state = ctx
            .latency_critical()
            .map(|s| (s.name.clone(), ServiceState::default()))
            .collect();
        let posterior_model = posterior_model(&model, &cfg);
        let pool = PoolBw {
            mba_now: MBA_MAX_PCT,
            bw_now: None,
            peak: ctx.host.mem_bw_bytes_per_s.max(1.0),
            cores_frac: 0.0,
        };
        Self {
            ctx,
            cfg,
            model,
            gpu_model: None,
            state,
            pool,
            pool_level: MBA_MAX_PCT,
            pool_growth: 1.0,
            last_degraded: false,
            references: BTreeMap::new(),
            posterior_model,
            on_pool: BTreeSet::new(),
            mba_cliff: None,
            pool_bw_stale: 0,
            last_t_ms: None,
            interval_s: 0.0,
            throttle: mba::ThrottleCurve::default(),
            raise_ticks: 0,
        }
    }

    /// What [`Policy::adopt`] takes from the `ml` policy this one replaces: the model in
    /// force (a version reloaded since the start); each unchanged service's state (its
    /// online correction and spread, measurement noise, measured cliffs and safe
    /// allocations, fallback hold, hysteresis, GPU share model); and, where the host and
    /// the best-effort jobs are the same ([`same_pool`]), what was learnt of the pool (its
    /// bandwidth under each MBA limit, its MBA cliff for the services still here, the
    /// hysteresis of a raise).
    fn take_over(&mut self, mut previous: MlPolicy) -> Adopted {
        self.model = Arc::clone(&previous.model);
        let kept = unchanged_services(&previous.ctx, &self.ctx);
        for name in &kept {
            if let Some(st) = previous.state.remove(name) {
                self.state.insert(name.clone(), st);
            }
        }
        let host = same_pool(&previous.ctx, &self.ctx);
        if host {
            let here: BTreeSet<&str> = self.state.keys().map(String::as_str).collect();
            self.mba_cliff = previous.mba_cliff.take().and_then(|mut c| {
                c.hurt.retain(|(name, _)| here.contains(name.as_str()));
                (!c.hurt.is_empty()).then_some(c)
            });
            self.pool = previous.pool;
            self.pool_level = previous.pool_level;
            self.last_degraded = previous.last_degraded;
            self.pool_bw_stale = previous.pool_bw_stale;
            self.throttle = previous.throttle;
            self.raise_ticks = previous.raise_ticks;
        }
        Adopted {
            services: kept,
            host,
        }
    }

    /// `neighbours` as they would be with the pool at the level planned, its cores grown
    /// as planned ([`MlPolicy::plan_level`]).
    fn planned_neighbours(&self, neighbours: Neighbours) -> Neighbours {
        let mut n = neighbours;
        if let Some(bw) = self.pool.bw_now {
            let at = mba::pool_bw_at(
                &self.throttle,
                bw,
                self.pool.mba_now,
                self.pool_level,
                self.pool.peak,
            );
            let at = mba::pool_bw_grown(at, self.pool_growth, self.pool.peak);
            n.mem_bw_bytes_per_s = (n.mem_bw_bytes_per_s - bw + at).max(0.0);
        }
        n
    }

    /// Whether `name` was measured over its target in each of the last `shrink_after`
    /// intervals (who takes part in the overload rules' triage, CPU and GPU).
    fn persistently_over(&self, name: &str) -> bool {
        self.state
            .get(name)
            .is_some_and(|st| st.over_ticks >= self.cfg.shrink_after)
    }

    /// Ways the latency-critical services may use in total.
    fn lc_ways(&self) -> u32 {
        self.ctx.host.llc_ways - u32::from(self.ctx.has_cpu_best_effort())
    }

    /// What an allocation costs the best-effort jobs on this host.
    fn costs(&self) -> Costs {
        Costs {
            cores: self.ctx.host.cores,
            llc_ways: self.ctx.host.llc_ways,
            way_cost: self.cfg.way_cost,
        }
    }

    /// What the latency-critical services may use together.
    fn room(&self) -> Room {
        Room {
            cores: self.ctx.host.cores,
            ways: self.lc_ways(),
            llc_ways: self.ctx.host.llc_ways,
        }
    }

    /// Step 1: the measured error of each service's last prediction, when the allocation
    /// it was made for was in force, corrects its state.
    fn correct(&mut self, obs: &Observation) {
        for o in obs.latency_critical() {
            let (Some(st), Some(target)) =
                (self.state.get_mut(&o.spec.name), o.spec.p99_target_ms())
            else {
                continue;
            };
            // The intervals the anchor's reading and this one rest on.
            let windows = (st.window, o.sample.p99_intervals.unwrap_or(1).max(1));
            st.window = windows.1;
            let reading = log_qos_ratio(&o.sample, target);
            let in_force = |alloc: &cohabit_core::Allocation| {
                obs.current.services.get(&o.spec.name) == Some(alloc)
            };
            // A reading held as a possible glitch last tick (below) teaches now if this one,
            // of the same allocation, confirms it (over the target again), else never.
            if let Some(held) = st.unconfirmed.take() {
                if in_force(&held.last.alloc) && reading.is_some_and(|q| q > 0.0) {
                    st.learn(&held, &self.cfg);
                }
            }
            let Some(last) = st.last.take() else { continue };
            let Some(measured) = reading.filter(|_| in_force(&last.alloc)) else {
                continue;
            };
            let measurement = Measurement {
                last,
                measured,
                windows,
                rps: o.sample.requests_per_s,
            };
            // A reading the glitch check holds on (step 3) teaches nothing until the next
            // one confirms it: one such reading (15 times memcached's target at an
            // unchanged load, on the E5 `demo`), taken at once, set its noise to the
            // ceiling and its bias +1.1, and sent it to the fallback ("model unsure") for
            // seven intervals.
            let glitch = st.prev_reading.is_some_and(|prev| {
                let now = Reading {
                    log_q: measured,
                    rps: o.sample.requests_per_s,
                };
                unconfirmed_saturation(now, prev, o.sample.cpu_busy_cores, last.alloc.cores)
            });
            if glitch {
                st.unconfirmed = Some(measurement);
            } else {
                st.learn(&measurement, &self.cfg);
            }
        }
    }

    /// Steps 2–4 for every latency-critical service, in configuration order, then the GPU
    /// shares fitted to each GPU.
    fn plan_services(&mut self, obs: &Observation, now_ms: u64) -> Vec<ServicePlan> {
        let names: Vec<(String, bool)> = self
            .ctx
            .latency_critical()
            .map(|s| (s.name.clone(), s.gpu.is_some()))
            .collect();
        let mut plans: Vec<ServicePlan> = names
            .iter()
            .map(|(name, gpu)| {
                if *gpu {
                    self.plan_gpu_service(obs, name, now_ms)
                } else {
                    self.plan_cpu_service(obs, name, now_ms)
                }
            })
            .collect();
        self.fit_gpu(&mut plans, obs);
        plans
    }

    /// (cores, ways) of `a`, service `name`'s allocation in force, as the packer counts
    /// them: no ways of its own when it runs on the pool's ([`on_pool_ways`]).
    fn counted(&self, name: &str, a: &cohabit_core::Allocation) -> (u32, u32) {
        let ways = if self.on_pool.contains(name) {
            0
        } else {
            a.llc_ways.count
        };
        (a.cores, ways)
    }

    /// The packer's view of each plan. CLOSID budget: the services beyond it share the pool's
    /// ways ([`HostContext::shares_pool_group`]).
    fn demands(&self, obs: &Observation, plans: &[ServicePlan], now_ms: u64) -> Vec<Demand> {
        plans
            .iter()
            .map(|p| {
                let slack = slack(obs, &p.name);
                Demand {
                    priority: self
                        .ctx
                        .specs
                        .iter()
                        .find(|s| s.name == p.name)
                        .map_or(0, |s| s.priority),
                    current: obs
                        .current
                        .services
                        .get(&p.name)
                        .map_or((1, 1), |a| self.counted(&p.name, a)),
                    need: p.need.clone(),
                    keep: p.keep,
                    stay: p.stay,
                    shares_pool_ways: self.ctx.shares_pool_group(&p.name),
                    violating: slack.is_some_and(|s| s < 0.0),
                    persistent: self.persistently_over(&p.name),
                    yielded: self
                        .state
                        .get(&p.name)
                        .is_some_and(|st| st.yielded_until_ms.is_some_and(|t| now_ms < t)),
                    slack,
                }
            })
            .collect()
    }

    /// The packed shares laid out on the host (services beyond the CLOSIDs on the pool's
    /// ways and MBA, see [`layout`]), and each service's reason.
    fn lay_out(
        &self,
        plans: &[ServicePlan],
        packing: &Packing,
    ) -> (Plan, BTreeMap<String, Reason>) {
        let mut shares: BTreeMap<String, Share> = BTreeMap::new();
        let mut reasons = BTreeMap::new();
        for (i, (p, (c, w))) in plans.iter().zip(&packing.alloc).enumerate() {
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
            if packing.given_up.contains(&i) {
                why.text.push_str(
                    "; given up: needs exceed the host, and what it would take serves more \
                     of the others (overload rule)",
                );
            } else if packing.degraded {
                why.text
                    .push_str("; needs exceed the host: growth limited to what is free");
            }
            reasons.insert(p.name.clone(), why);
        }
        (layout(&self.ctx, &shares, self.pool_level), reasons)
    }

    /// The services' posteriors, for keeping across restarts ([`Policy::learned`]).
    fn posteriors(&self) -> Option<PosteriorSet> {
        let model = self.posterior_model.as_ref()?;
        let services = self
            .state
            .iter()
            .filter_map(|(name, st)| {
                let blr = st.posterior.as_ref()?;
                Some((
                    name.clone(),
                    PosteriorSnapshot {
                        model: model.clone(),
                        blr: blr.snapshot(),
                    },
                ))
            })
            .collect();
        Some(PosteriorSet { services })
    }

    /// Takes back the posteriors in `set` of this model and width for the services it
    /// manages; the others are left (a snapshot that does not check out is dropped).
    /// Returns the services resumed.
    fn resume_posteriors(&mut self, set: &PosteriorSet) -> Vec<String> {
        let (Some(model), Some(width)) = (
            self.posterior_model.as_ref(),
            self.model.ensemble.basis_width(),
        ) else {
            return Vec::new();
        };
        let mut resumed = Vec::new();
        for (name, snap) in &set.services {
            let Some(st) = self.state.get_mut(name) else {
                continue;
            };
            if &snap.model != model || snap.blr.prior_var.len() != width + 1 {
                continue;
            }
            if let Ok(blr) = Blr::from_snapshot(&snap.blr) {
                st.posterior = Some(blr);
                resumed.push(name.clone());
            }
        }
        resumed
    }
}

impl Policy for MlPolicy {
    fn name(&self) -> &'static str {
        "ml"
    }

    /// A reloaded model: its predictions start afresh (the online bias, the spread factors
    /// and the last prediction were the old model's errors); the measurement noise, the
    /// fallback holds and the hysteresis stay, they are the host's. The model already in
    /// force (the same `Arc`) changes nothing.
    fn replace_model(&mut self, model: Arc<Model>) -> bool {
        if Arc::ptr_eq(&self.model, &model) {
            // The model in force already (taken over from the policy this one replaced).
            return true;
        }
        self.posterior_model = posterior_model(&model, &self.cfg);
        self.model = model;
        for st in self.state.values_mut() {
            st.bias = 0.0;
            st.bias_samples = 0;
            st.z2 = 1.0;
            st.last = None;
            // A correction of the old model's output layer means nothing on the new one.
            st.posterior = None;
        }
        true
    }

    fn adopt(&mut self, previous: Box<dyn Policy>) -> Adopted {
        downcast::<Self>(previous).map_or_else(Adopted::default, |p| self.take_over(*p))
    }

    fn learned(&self) -> Option<PosteriorSet> {
        self.posteriors()
    }

    fn resume(&mut self, learned: &PosteriorSet) -> Vec<String> {
        self.resume_posteriors(learned)
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
        let since = obs.t_ms.saturating_sub(self.last_t_ms.unwrap_or(0));
        self.interval_s = since as f64 / 1000.0;
        self.last_t_ms = Some(obs.t_ms);
        self.on_pool = on_pool_ways(&self.ctx, &obs.current);
        let modelled;
        let obs = if self.on_pool.is_empty() {
            obs
        } else {
            modelled = Observation {
                current: as_modelled(&obs.current, &self.on_pool),
                ..obs.clone()
            };
            &modelled
        };
        self.references = self
            .ctx
            .latency_critical()
            .map(|s| (s.name.clone(), OnceCell::new()))
            .collect();
        self.correct(obs);
        for o in obs.latency_critical() {
            if let Some(st) = self.state.get_mut(&o.spec.name) {
                let over = slack(obs, &o.spec.name).is_some_and(|s| s < 0.0);
                st.over_ticks = if over { st.over_ticks + 1 } else { 0 };
            }
        }
        let LevelPlan {
            level,
            plans,
            packing,
            planned,
            ..
        } = self.plan_pool_levels(obs, now_ms);
        self.last_degraded = packing.degraded;
        for &i in &packing.yielded {
            if let Some(st) = plans.get(i).and_then(|p| self.state.get_mut(&p.name)) {
                st.yielded_until_ms = Some(now_ms + self.cfg.fallback_hold_ms);
            }
        }
        let (plan, mut reasons) = self.lay_out(&plans, &packing);
        let placed = on_pool_ways(&self.ctx, &plan);
        let mut predictions = self.record_predictions(obs, &plans, &as_modelled(&plan, &placed));
        self.record_gpu_predictions(obs, &plans, &plan, &mut predictions);
        let mut pool_why = "what the latency-critical services leave".to_string();
        if level < MBA_MAX_PCT {
            pool_why += &format!("; memory bandwidth {level} %");
        }
        if planned.len() > 1 {
            let levels: Vec<String> = planned.iter().map(u8::to_string).collect();
            pool_why += &format!(" (pool levels planned: {} %)", levels.join(", "));
        }
        reasons.insert(
            cohabit_core::BEST_EFFORT_GROUP.to_string(),
            Reason::new(DecisionPath::Model, pool_why),
        );
        let mut d = Decision::new(plan, reasons);
        d.predictions = predictions;
        d
    }
}

#[cfg(test)]
pub(super) mod tests {
    use cohabit_core::{
        HostCapacity, Sample, ServiceClass, ServiceObservation, ServiceSpec, WayRange,
    };
    use cohabit_models::mlp::Dense;
    use cohabit_models::N_FEATURES;
    use ndarray::{Array1, Array2};

    use super::*;

    /// A 36-core, 20-way host with 16 CLOSIDs and no GPU.
    pub(crate) fn host() -> HostCapacity {
        HostCapacity {
            name: "t".into(),
            cores: 36,
            freq_ghz: 2.3,
            llc_ways: 20,
            llc_way_bytes: 1 << 20,
            mem_bw_bytes_per_s: 7e10,
            gpus: vec![],
            closids: 16,
            mba_min_pct: 10,
            mba_gran_pct: 10,
            min_cbm_bits: 1,
            shareable_bits: 0,
        }
    }

    /// A model whose members are linear: each `(bias, [(feature, weight)])` predicts
    /// `bias + Σ weight × feature` on raw features (its normalisation is the identity, and
    /// its training range 0 ± 1 per feature, so z-scores are the raw values).
    pub(crate) fn linear_model(members: &[(f32, &[(usize, f32)])]) -> Model {
        let mut m = Model::synthetic(members.len(), &[], 0);
        for (mlp, (bias, weights)) in m.ensemble.members.iter_mut().zip(members) {
            let mut w = Array2::zeros((1, N_FEATURES));
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

    /// `n_lc` CPU services `lc0`… (p99 target 1 ms) and a CPU best-effort job, on a host
    /// with `closids` CLOSIDs.
    fn ctx(n_lc: usize, closids: u32) -> HostContext {
        let mut specs: Vec<ServiceSpec> = (0..n_lc)
            .map(|i| ServiceSpec {
                name: format!("lc{i}"),
                class: ServiceClass::LatencyCritical { p99_target_ms: 1.0 },
                gpu: None,
                priority: 0,
            })
            .collect();
        specs.push(ServiceSpec {
            name: "be".into(),
            class: ServiceClass::BestEffort,
            gpu: None,
            priority: 0,
        });
        HostContext {
            host: HostCapacity { closids, ..host() },
            specs,
        }
    }

    /// Every service measured `sample` under `current`.
    fn observe(ctx: &HostContext, current: &Plan, sample: &Sample) -> Observation {
        Observation {
            t_ms: 0,
            services: ctx
                .specs
                .iter()
                .map(|spec| ServiceObservation {
                    spec: spec.clone(),
                    sample: sample.clone(),
                    gpu_mps_effective_pct: None,
                })
                .collect(),
            current: current.clone(),
        }
    }

    /// p99 `p99_ms` (target 1 ms) at 50 requests per second on 2 busy cores.
    fn sample(p99_ms: Option<f64>) -> Sample {
        Sample {
            p99_ms,
            requests_per_s: Some(50.0),
            cpu_busy_cores: Some(2.0),
            ..Sample::default()
        }
    }

    /// One decision of a fresh `ml` policy on `ctx` with `model`, from its initial plan.
    fn first_decision(ctx: &HostContext, model: Model, sample: &Sample) -> (Plan, Decision) {
        let mut ml = MlPolicy::new(ctx.clone(), Arc::new(model), MlConfig::default());
        let initial = ml.initial().plan;
        let d = ml.decide(&observe(ctx, &initial, sample), 1_000);
        (initial, d)
    }

    fn col(name: &str) -> usize {
        cohabit_models::FEATURE_NAMES
            .iter()
            .position(|n| *n == name)
            .unwrap()
    }

    /// A model to which the neighbours' bandwidth matters: each member predicts
    /// -0.9 × cores_cand + 2 × neighbour_bw_frac (a core is -0.025 in ln(p99/target) on 36
    /// cores; all of the host's bandwidth +2).
    fn bandwidth_model() -> Model {
        let w = [(col("cores_cand"), -0.9), (col("neighbour_bw_frac"), 2.0)];
        linear_model(&[(0.0, &w), (0.0, &w)])
    }

    /// Every service measured at `p99_ms` (target 1 ms) under `current`, beside a pool
    /// streaming 3e10 of the host's 7e10 bytes/s; lc0's own bandwidth (1e9) is not its
    /// neighbours'.
    fn beside_a_stream(c: &HostContext, current: &Plan, p99_ms: f64) -> Observation {
        let s = Sample {
            mem_bw_bytes_per_s: Some(3e10),
            ..sample(Some(p99_ms))
        };
        let mut obs = observe(c, current, &s);
        obs.services[0].sample.mem_bw_bytes_per_s = Some(1e9);
        obs
    }

    /// The best-effort pool's reason in `d`.
    fn pool_reason(d: &Decision) -> &str {
        &d.reasons[cohabit_core::BEST_EFFORT_GROUP].text
    }

    #[test]
    fn a_decision_records_the_models_prediction_and_the_posteriors() {
        // Members that disagree on a core's worth (-0.9 and -4.5 per unit of cores_cand):
        // the service keeps a posterior, fitted at its first reading.
        let w1 = [(col("cores_cand"), -0.9)];
        let w2 = [(col("cores_cand"), -4.5)];
        let c = ctx(1, 16);
        let mut ml = MlPolicy::new(
            c.clone(),
            Arc::new(linear_model(&[(0.0, &w1), (0.0, &w2)])),
            MlConfig::default(),
        );
        let mut plan = ml.initial().plan;
        let mut last = None;
        for t in 1..=3 {
            let d = ml.decide(&observe(&c, &plan, &sample(Some(0.5))), t * 1_000);
            plan = d.plan.clone();
            last = Some(d);
        }
        let p = &last.unwrap().predictions["lc0"];
        let (prior, post) = (p.prior.unwrap(), p.posterior.unwrap());
        assert_eq!(post.log_qos_ratio, p.log_qos_ratio);
        assert!(post.samples > 0.0, "{post:?}");
        assert!(prior.log_qos_sigma > 0.0);
        // Kept across a restart: what it learnt is handed back whole.
        let learnt = ml.learned().unwrap();
        let mut fresh = MlPolicy::new(c.clone(), Arc::clone(&ml.model), MlConfig::default());
        assert_eq!(fresh.resume(&learnt), vec!["lc0".to_string()]);
        assert_eq!(fresh.learned(), Some(learnt));
        // Off, no posterior and nothing to keep.
        let off = MlConfig {
            posterior: false,
            ..MlConfig::default()
        };
        let mut ml = MlPolicy::new(c.clone(), Arc::clone(&ml.model), off);
        let initial = ml.initial().plan;
        let d = ml.decide(&observe(&c, &initial, &sample(Some(0.5))), 1_000);
        assert!(d.predictions["lc0"].posterior.is_none());
        assert_eq!(ml.learned(), None);
    }

    #[test]
    fn a_streaming_pool_is_throttled_when_that_is_cheaper_than_more_cores() {
        // lc0 at 1.2 × its target next to a pool using 3e10 of the host's 7e10 bytes/s.
        // More cores: ln 1.2 → ln 0.9 takes 13 more (cost 0.36). The pool at 60 % frees
        // 1.2e10: -2 × 0.17 = -0.34, enough with a core less, for 0.5 (the pool's share of
        // the cores) × 0.4 of its bandwidth = 0.2; at 10 % (the minimum) 11 cores less for
        // 0.45. Either is cheaper than the cores.
        let c = ctx(1, 16);
        let mut ml = MlPolicy::new(c.clone(), Arc::new(bandwidth_model()), MlConfig::default());
        let initial = ml.initial().plan;
        let d = ml.decide(&beside_a_stream(&c, &initial, 1.2), 1_000);
        let level = d.plan.best_effort.mba_pct;
        assert!([10, 60].contains(&level), "{level} {:?}", d.reasons);
        let why = pool_reason(&d);
        assert!(
            why.contains(&format!("memory bandwidth {level} %")),
            "{why}"
        );
        // The step down helped, so the minimum was planned too.
        assert!(
            why.contains("(pool levels planned: 100, 60, 10 %)"),
            "{why}"
        );
        let lc0 = d.plan.services["lc0"];
        assert!(lc0.cores < initial.services["lc0"].cores, "{lc0:?}");
        assert_eq!(lc0.mba_pct, 100);
        // The prediction recorded is for the neighbours as planned: within the margin.
        assert!(d.predictions["lc0"].log_qos_ratio <= 0.9f64.ln());
    }

    #[test]
    fn a_throttle_that_barely_slowed_the_pool_is_lifted_as_measured_not_in_proportion() {
        // The pool streamed 3e10 bytes/s at 100 % and, throttled to 10 % on as many
        // cores, still 2.7e10 (a job the throttle hardly slows); lc0 is well within its
        // target, so 30 % is planned beside 10 %. In proportion 30 % would stream 8.1e10,
        // past the host's 7e10 peak, and the model would want lc0 on more cores than the
        // host has there: the pool stays at 10 % for good (the Gold `demo` did, for the
        // last 330 s of its run). As measured, 30 % streams 2.9e10, which costs lc0
        // nothing and the pool less: the throttle is lifted.
        let c = ctx(1, 16);
        let beside = |plan: &Plan, pool_bw: f64| {
            let s = Sample {
                mem_bw_bytes_per_s: Some(pool_bw),
                ..sample(Some(0.5))
            };
            let mut obs = observe(&c, plan, &s);
            obs.services[0].sample.mem_bw_bytes_per_s = Some(1e9);
            obs
        };
        let level_after = |seen_unthrottled: bool| {
            let mut ml = MlPolicy::new(c.clone(), Arc::new(bandwidth_model()), MlConfig::default());
            let mut plan = ml.initial().plan;
            if seen_unthrottled {
                let d = ml.decide(&beside(&plan, 3e10), 1_000);
                assert_eq!(d.plan.best_effort.mba_pct, 100, "{:?}", d.reasons);
            }
            plan.best_effort.mba_pct = 10;
            let d = ml.decide(&beside(&plan, 2.7e10), 2_000);
            assert!(
                pool_reason(&d).contains("(pool levels planned: 10, 30 %)"),
                "{}",
                pool_reason(&d)
            );
            d.plan.best_effort.mba_pct
        };
        assert_eq!(level_after(true), 30);
        // Without the reading at 100 %, the proportional prior is all there is.
        assert_eq!(level_after(false), 10);
    }

    #[test]
    fn a_throttle_that_costs_less_than_a_change_is_lifted_after_shrink_after_ticks() {
        // The pool streams 1e9 bytes/s per core at 100 % and 0.99e9 at 50 %: the throttle
        // takes 1 % of its bandwidth, and to a model blind to bandwidth it buys lc0
        // nothing. A step up (70 %) gains the pool less than a change's charge, so it
        // loses each tick; after `shrink_after` ticks of that with no pressure it is taken.
        lifted_after_shrink_after_ticks(0.99e9);
    }

    #[test]
    fn a_throttle_the_pools_readings_say_costs_nothing_is_lifted_after_shrink_after_ticks() {
        // As above, but the pool streams 1e9 bytes/s per core at 50 % too: the step up
        // ties with the level in force but for the change's charge, and is taken.
        lifted_after_shrink_after_ticks(1e9);
    }

    /// A pool throttled to 50 % that streams `per_core_at_50` bytes/s per core there (1e9
    /// at 100 %) beside lc0, within its target, to a model blind to bandwidth: the step up
    /// is planned every tick and taken at the `shrink_after`-th.
    fn lifted_after_shrink_after_ticks(per_core_at_50: f64) {
        let c = ctx(1, 16);
        let w = [(col("cores_cand"), -0.9)];
        let model = linear_model(&[(0.0, &w), (0.0, &w)]);
        let cfg = MlConfig::default();
        let mut ml = MlPolicy::new(c.clone(), Arc::new(model), cfg);
        let beside = |plan: &Plan, per_core: f64| {
            let s = Sample {
                mem_bw_bytes_per_s: Some(per_core * f64::from(plan.best_effort.cores)),
                ..sample(Some(0.5))
            };
            let mut obs = observe(&c, plan, &s);
            obs.services[0].sample.mem_bw_bytes_per_s = Some(1e9);
            obs
        };
        let mut plan = ml.initial().plan;
        for tick in 1..=2 {
            plan = ml.decide(&beside(&plan, 1e9), tick * 1_000).plan;
            assert_eq!(plan.best_effort.mba_pct, 100);
        }
        plan.best_effort.mba_pct = 50;
        let mut levels = Vec::new();
        for tick in 3..=u64::from(cfg.shrink_after) + 2 {
            let d = ml.decide(&beside(&plan, per_core_at_50), tick * 1_000);
            assert!(
                pool_reason(&d).contains("(pool levels planned: 50, 70 %)"),
                "{}",
                pool_reason(&d)
            );
            plan = d.plan;
            levels.push(plan.best_effort.mba_pct);
        }
        let mut want = vec![50; cfg.shrink_after as usize - 1];
        want.push(70);
        assert_eq!(levels, want);
    }

    #[test]
    fn a_raise_past_the_margin_once_is_forgotten_and_twice_caps_the_pool() {
        // The pool raised from 10 to 30 % and lc0 read past its margin (0.95) right after:
        // a cliff at 30. When lc0's next reading at 30 % is within its margin that reading
        // was noise: the step up to 50 % is planned again. When it is past the margin
        // again, the cliff is confirmed and caps the pool at 30 % (after one tick of
        // pressure, which plans steps down) while lc0 carries the load it had then.
        let c = ctx(1, 16);
        let w = [(col("cores_cand"), -0.9)];
        let model = Arc::new(linear_model(&[(0.0, &w), (0.0, &w)]));
        let beside = |plan: &Plan, mba: u8, p99: f64| {
            let mut plan = plan.clone();
            plan.best_effort.mba_pct = mba;
            let s = Sample {
                mem_bw_bytes_per_s: Some(1e9 * f64::from(plan.best_effort.cores)),
                ..sample(Some(p99))
            };
            let mut obs = observe(&c, &plan, &s);
            obs.services[0].sample.mem_bw_bytes_per_s = Some(1e9);
            obs
        };
        let levels_planned = |readings: &[f64]| {
            let mut ml = MlPolicy::new(c.clone(), model.clone(), MlConfig::default());
            let mut plan = ml.initial().plan;
            plan = ml.decide(&beside(&plan, 10, 0.5), 1_000).plan;
            plan = ml.decide(&beside(&plan, 30, 0.95), 2_000).plan;
            let mut why = String::new();
            for (i, r) in (3..).zip(readings) {
                let d = ml.decide(&beside(&plan, 30, *r), i * 1_000);
                why = pool_reason(&d).to_string();
                plan = d.plan;
            }
            why
        };
        let noise = levels_planned(&[0.5]);
        assert!(noise.contains("(pool levels planned: 30, 50 %)"), "{noise}");
        let confirmed = levels_planned(&[0.95, 0.5]);
        assert!(!confirmed.contains("pool levels planned"), "{confirmed}");
    }

    #[test]
    fn a_step_down_that_buys_nothing_ends_the_descent_before_the_minimum() {
        // The same service and pool, but a model to which the neighbours' bandwidth does not
        // matter: at 60 % lc0 needs the same cores as at 100 % and the throttle costs the
        // pool, so the pool stays and the minimum is not planned.
        let c = ctx(1, 16);
        let w = [(col("cores_cand"), -0.9)];
        let model = linear_model(&[(0.0, &w), (0.0, &w)]);
        let mut ml = MlPolicy::new(c.clone(), Arc::new(model), MlConfig::default());
        let initial = ml.initial().plan;
        let d = ml.decide(&beside_a_stream(&c, &initial, 1.2), 1_000);
        assert_eq!(d.plan.best_effort.mba_pct, 100);
        let why = pool_reason(&d);
        assert!(why.ends_with("(pool levels planned: 100, 60 %)"), "{why}");
        assert!(
            d.plan.services["lc0"].cores > initial.services["lc0"].cores,
            "{:?}",
            d.plan.services["lc0"]
        );
    }

    #[test]
    fn in_overload_the_minimum_is_planned_second_and_a_useless_step_down_not_at_all() {
        // Two services at 2.5 × their target whatever they get (saturated, +0.5 everywhere)
        // want more cores than the host has, next to a streaming pool: short at the level
        // in force, so the minimum is planned next; still short there, so the step down is
        // not planned, and the pool gets the minimum.
        let c = ctx(2, 16);
        let model = linear_model(&[(0.5, &[]), (0.5, &[])]);
        let mut ml = MlPolicy::new(c.clone(), Arc::new(model), MlConfig::default());
        let initial = ml.initial().plan;
        let s = Sample {
            mem_bw_bytes_per_s: Some(3e10),
            ..sample(Some(2.5))
        };
        let d = ml.decide(&observe(&c, &initial, &s), 1_000);
        let why = pool_reason(&d);
        assert!(why.ends_with("(pool levels planned: 100, 10 %)"), "{why}");
        assert_eq!(d.plan.best_effort.mba_pct, 10);
    }

    #[test]
    fn a_pool_whose_bandwidth_is_not_measured_is_released() {
        // The same service over its target, but no bandwidth reading (no RDT monitoring):
        // the pool, throttled to 50 %, goes back to 100 % rather than be guessed about.
        let c = ctx(1, 16);
        let mut ml = MlPolicy::new(c.clone(), Arc::new(bandwidth_model()), MlConfig::default());
        let mut current = ml.initial().plan;
        current.best_effort.mba_pct = 50;
        let d = ml.decide(&observe(&c, &current, &sample(Some(1.2))), 1_000);
        assert_eq!(d.plan.best_effort.mba_pct, 100);
    }

    #[test]
    fn a_throttled_pool_rides_out_a_missing_bandwidth_reading_for_two_ticks() {
        // Throttled on a reading (as above), then the pool's reading goes missing: the last
        // one stands in for two ticks; a third without one releases the pool.
        let c = ctx(1, 16);
        let mut ml = MlPolicy::new(c.clone(), Arc::new(bandwidth_model()), MlConfig::default());
        let initial = ml.initial().plan;
        let mut plan = ml.decide(&beside_a_stream(&c, &initial, 1.2), 1_000).plan;
        assert!(plan.best_effort.mba_pct < 100);
        for tick in 2..=4u64 {
            let mut obs = observe(&c, &plan, &sample(Some(1.2)));
            obs.services[0].sample.mem_bw_bytes_per_s = Some(1e9);
            plan = ml.decide(&obs, tick * 1_000).plan;
            let level = plan.best_effort.mba_pct;
            if tick < 4 {
                assert!(level < 100, "tick {tick}: {level}");
            } else {
                assert_eq!(level, 100, "tick {tick}");
            }
        }
    }

    /// lc0 on 20 cores far under its target (it could give most back), lc1 on 8 at 0.85
    /// of its target, and a pool of 8 cores streaming 2e10 bytes/s: `ml`'s plan with
    /// `model` (its first, so each service is placed from the model at once).
    fn give_back_beside_a_stream(model: Model) -> Plan {
        let c = ctx(2, 16);
        let mut ml = MlPolicy::new(c.clone(), Arc::new(model), MlConfig::default());
        let mut plan = ml.initial().plan;
        plan.services.get_mut("lc0").unwrap().cores = 20;
        plan.services.get_mut("lc1").unwrap().cores = 8;
        plan.best_effort.cores = 8;
        let mut obs = observe(&c, &plan, &sample(Some(0.85)));
        obs.services[0].sample.p99_ms = Some(0.3);
        obs.services[0].sample.mem_bw_bytes_per_s = Some(1e9);
        obs.services[1].sample.mem_bw_bytes_per_s = Some(1e9);
        obs.services[2].sample.mem_bw_bytes_per_s = Some(2e10);
        ml.decide(&obs, 1_000).plan
    }

    #[test]
    fn cores_given_back_to_a_streaming_pool_are_planned_with_the_bandwidth_it_would_stream() {
        // To a model blind to bandwidth, lc0's give-back costs lc1 nothing: lc0 gives 12
        // cores back to the pool. To one where the neighbours' bandwidth matters (+2 per
        // host's worth), a pool grown from 8 cores streams more in proportion, which would
        // put lc1 past its margin: the services are planned beside that pool, so the pool
        // grows less, and lc1 gives back nothing.
        let blind = give_back_beside_a_stream(linear_model(&[
            (0.0, &[(col("cores_cand"), -0.9)]),
            (0.0, &[(col("cores_cand"), -0.9)]),
        ]));
        let aware = give_back_beside_a_stream(bandwidth_model());
        assert!(blind.best_effort.cores > 8, "{blind:?}");
        assert!(
            aware.best_effort.cores < blind.best_effort.cores,
            "{aware:?} {blind:?}"
        );
        assert!(aware.services["lc1"].cores >= 8, "{aware:?}");
        assert!(aware.best_effort.cores > 8, "{aware:?}");
    }

    #[test]
    fn growth_is_planned_for_only_when_the_pool_streams_and_grows_by_a_tenth() {
        let pool = PoolBw {
            mba_now: 100,
            bw_now: Some(2e10),
            peak: 7e10,
            cores_frac: 0.25,
        };
        let curve = mba::ThrottleCurve::default();
        let growth = |pool: &PoolBw, curve: &mba::ThrottleCurve, now, planned| {
            mba::growth(pool, curve, 100, now, planned)
        };
        assert_eq!(growth(&pool, &curve, 8, 12), 1.5);
        // A core more of twenty: within what the model tells apart.
        assert_eq!(growth(&pool, &curve, 20, 21), 1.0);
        // Shrinking, or no cores now and no rate per core learnt: nothing to plan for.
        assert_eq!(growth(&pool, &curve, 8, 4), 1.0);
        assert_eq!(growth(&pool, &curve, 0, 12), 1.0);
        // No cores now, 2e10 streamed (what a pool without cores still reads), and 2.5e9
        // per core learnt at 100 % on 8 cores: 12 cores stream 3e10, 1.5 times as much.
        let mut learnt = mba::ThrottleCurve::default();
        learnt.record(100, 2e10, 8);
        assert_eq!(growth(&pool, &learnt, 0, 12), 1.5);
        assert_eq!(growth(&pool, &learnt, 0, 0), 1.0);
        let blind = PoolBw {
            bw_now: None,
            ..pool
        };
        assert_eq!(growth(&blind, &learnt, 8, 12), 1.0);
        assert_eq!(growth(&blind, &learnt, 0, 12), 1.0);
        // The bandwidth grows in proportion, up to the host's peak.
        assert_eq!(mba::pool_bw_grown(2e10, 1.5, 7e10), 3e10);
        assert_eq!(mba::pool_bw_grown(2e10, 5.0, 7e10), 7e10);
        assert_eq!(mba::pool_bw_grown(2e10, 1.0, 7e10), 2e10);
    }

    #[test]
    fn a_service_of_higher_priority_is_served_first_when_not_every_target_can_be_met() {
        // Two services at 2.5 × their target (saturated: the model's level is used, +0.5
        // everywhere, so nothing is admissible) go to the fallback, which doubles their 12
        // cores: 48 > 36. lc1 has priority 1 and gets its doubling; lc0, first in
        // configuration order, which the rule used to serve first, keeps its 12.
        let mut c = ctx(2, 16);
        c.specs[1].priority = 1;
        let model = linear_model(&[(0.5, &[]), (0.5, &[])]);
        let mut ml = MlPolicy::new(c.clone(), Arc::new(model), MlConfig::default());
        let initial = ml.initial().plan;
        let (c0, c1) = (initial.services["lc0"].cores, initial.services["lc1"].cores);
        let d = ml.decide(&observe(&c, &initial, &sample(Some(2.5))), 1_000);
        let (n0, n1) = (d.plan.services["lc0"].cores, d.plan.services["lc1"].cores);
        assert_eq!(d.reasons["lc1"].path, DecisionPath::Fallback);
        assert_eq!(n1, 2 * c1, "{:?}", d.reasons);
        assert_eq!(n0, c0, "{:?}", d.reasons);
        assert!(d.reasons["lc0"].text.contains("needs exceed the host"));
    }

    #[test]
    fn services_beyond_the_closid_budget_share_the_pools_ways() {
        // 3 CLOSIDs: the root, the pool, and one service of its own. lc1 and lc2 share the
        // pool's ways (and MBA); lc0, to which ways matter, has a range the pool does not
        // overlap.
        let c = ctx(3, 3);
        let (_, d) = first_decision(&c, ways_model(), &sample(Some(0.5)));
        let pool = d.plan.best_effort;
        assert!(!d.plan.services["lc0"].llc_ways.overlaps(&pool.llc_ways));
        for name in ["lc1", "lc2"] {
            let a = d.plan.services[name];
            assert_eq!(
                (a.llc_ways, a.mba_pct),
                (pool.llc_ways, pool.mba_pct),
                "{name}"
            );
        }
        assert!(d.plan.resctrl_groups() <= 2);
        // With 16 CLOSIDs every service has a range of its own.
        let c = ctx(3, 16);
        let (_, d) = first_decision(&c, ways_model(), &sample(Some(0.5)));
        let ranges: Vec<WayRange> = d.plan.groups().map(|(_, a)| a.llc_ways).collect();
        for (i, a) in ranges.iter().enumerate() {
            assert!(ranges[i + 1..].iter().all(|b| !a.overlaps(b)), "{ranges:?}");
        }
    }

    /// A model to which ways matter: one way needs more cores than two (each member
    /// predicts -3 × ways_cand - 0.5 × cores_cand).
    fn ways_model() -> Model {
        let w = [(col("ways_cand"), -3.0), (col("cores_cand"), -0.5)];
        linear_model(&[(0.0, &w), (0.0, &w)])
    }

    #[test]
    fn cache_insensitive_services_run_on_the_pools_ways_in_groups_of_their_own() {
        // Ways do not matter to the model: every service's frontier needs as few cores with
        // one way as with any, so each runs on the pool's ways (in a group of its own, at
        // full bandwidth) and the ways stay the pool's.
        let c = ctx(3, 16);
        let flat = || linear_model(&[(-1.0, &[]), (-1.0, &[])]);
        let (_, d) = first_decision(&c, flat(), &sample(Some(0.5)));
        let pool = d.plan.best_effort;
        assert_eq!(pool.llc_ways, WayRange::new(0, 20), "{:?}", d.plan);
        for name in ["lc0", "lc1", "lc2"] {
            let a = d.plan.services[name];
            assert_eq!((a.llc_ways, a.mba_pct), (pool.llc_ways, 100), "{name}");
        }
        // Same range, same MBA: one resctrl group serves them all.
        assert_eq!(d.plan.resctrl_groups(), 1);
        // The prediction recorded is for one way (the most a sharer may count on), so the
        // next tick's correction compares like with like.
        assert!(d.predictions.contains_key("lc0"));
        // Switched off, each has a range of its own.
        let cfg = MlConfig {
            pool_ways_for_insensitive: false,
            ..MlConfig::default()
        };
        let mut ml = MlPolicy::new(c.clone(), Arc::new(flat()), cfg);
        let initial = ml.initial().plan;
        let off = ml.decide(&observe(&c, &initial, &sample(Some(0.5))), 1_000);
        assert!(!off.plan.services["lc0"]
            .llc_ways
            .overlaps(&off.plan.best_effort.llc_ways));
    }

    #[test]
    fn a_service_past_its_margin_on_the_pools_ways_gets_ways_of_its_own_again() {
        // On the pool's ways and measured at 0.95 of its target twice (past the 0.9
        // margin): the pool's ways are not offered, it gets a range of its own, and they
        // are not offered again at that load while it is calm.
        let c = ctx(1, 16);
        let flat = linear_model(&[(-1.0, &[]), (-1.0, &[])]);
        let mut ml = MlPolicy::new(c.clone(), Arc::new(flat), MlConfig::default());
        let initial = ml.initial().plan;
        let d = ml.decide(&observe(&c, &initial, &sample(Some(0.5))), 1_000);
        let on_pool = d.plan;
        assert_eq!(
            on_pool.services["lc0"].llc_ways,
            on_pool.best_effort.llc_ways
        );
        ml.decide(&observe(&c, &on_pool, &sample(Some(0.95))), 2_000);
        let d = ml.decide(&observe(&c, &on_pool, &sample(Some(0.95))), 3_000);
        let own = d.plan;
        assert!(
            !own.services["lc0"]
                .llc_ways
                .overlaps(&own.best_effort.llc_ways),
            "{own:?} {:?}",
            d.reasons
        );
        for t in 4..12 {
            let d = ml.decide(&observe(&c, &own, &sample(Some(0.5))), t * 1_000);
            assert!(!d.plan.services["lc0"]
                .llc_ways
                .overlaps(&d.plan.best_effort.llc_ways));
        }
    }

    #[test]
    fn the_services_beyond_the_closid_budget_are_packed_in_the_pools_ways() {
        // 3 CLOSIDs: the root's, the pool's, one for lc0. 4: lc0 and lc1 have their own.
        for (closids, sharing) in [(3, [false, true, true]), (4, [false, false, true])] {
            let c = ctx(3, closids);
            let ml = MlPolicy::new(
                c.clone(),
                Arc::new(linear_model(&[(0.0, &[])])),
                MlConfig::default(),
            );
            let initial = layout(&c, &fair_shares(&c), MBA_MAX_PCT);
            let obs = observe(&c, &initial, &sample(Some(0.5)));
            let plans: Vec<ServicePlan> = ["lc0", "lc1", "lc2"]
                .into_iter()
                .map(|n| ServicePlan::fixed(n, 4, 6, Reason::new(DecisionPath::Model, "t"), false))
                .collect();
            let got: Vec<bool> = ml
                .demands(&obs, &plans, 0)
                .iter()
                .map(|d| d.shares_pool_ways)
                .collect();
            assert_eq!(got, sharing, "{closids} CLOSIDs");
        }
    }

    #[test]
    fn a_service_sharing_the_pools_ways_is_sized_for_the_pool_it_really_gets() {
        // 3 CLOSIDs: lc0 has ways of its own, lc1 shares the pool's (fair share: 13 ways,
        // shared with the job). A model to which a way is worth two cores (-0.1 and -0.05
        // in ln(p99/target)); both at their target. lc0 would take every way it may; had
        // lc1 been sized with ways of its own, it would have few cores and, in a pool that
        // lc0's ways shrank, miss. Sized for the pool's ways (at most the 13 it measured
        // under, and only where lc0 leaves them), the prediction for what it really gets
        // meets the margin.
        let c = ctx(2, 3);
        let w = [(col("cores_cand"), -1.8), (col("ways_cand"), -2.0)];
        let model = linear_model(&[(0.0, &w), (0.0, &w)]);
        let (initial, d) = first_decision(&c, model, &sample(Some(1.0)));
        assert_eq!(initial.services["lc1"].llc_ways.count, 13);
        let pool = d.plan.best_effort.llc_ways;
        let lc1 = d.plan.services["lc1"];
        assert_eq!(lc1.llc_ways, pool);
        assert!(lc1.cores > initial.services["lc1"].cores, "{:?}", d.reasons);
        let p = &d.predictions["lc1"];
        assert!(p.log_qos_ratio <= 0.9f64.ln(), "{p:?} with {lc1:?}");
        assert_eq!(d.reasons["lc1"].path, DecisionPath::Model);
    }

    #[test]
    fn a_service_over_its_target_never_loses_ways_in_the_same_step() {
        // A model that sees cores only (a core more is -0.05 in ln(p99/target)), so the
        // cheapest point has one way. Tick 1: out of the training range (10⁶ requests per
        // second), the fallback holds the fair share, 18 cores and 10 ways. Tick 2: p99 at
        // 1.2 × the target (ln 1.2 = 0.182); c cores predict 0.182 - 0.05 (c - 18) + 0.5 ×
        // 0.05, at most ln 0.9 = -0.105 from 25 cores. Every way count has (25, w); the
        // service keeps its 10 ways rather than trading them for nothing.
        let c = ctx(1, 16);
        let w = [(col("cores_cand"), -1.8)];
        let model = linear_model(&[(0.0, &w), (0.0, &w)]);
        let mut ml = MlPolicy::new(c.clone(), Arc::new(model), MlConfig::default());
        let initial = ml.initial().plan;
        let busy = Sample {
            requests_per_s: Some(1e6),
            ..sample(Some(0.5))
        };
        let first = ml.decide(&observe(&c, &initial, &busy), 1_000);
        assert_eq!(first.reasons["lc0"].path, DecisionPath::Fallback);
        let held = first.plan.services["lc0"];
        assert_eq!((held.cores, held.llc_ways.count), (18, 10));
        let second = ml.decide(&observe(&c, &first.plan, &sample(Some(1.2))), 2_000);
        let a = second.plan.services["lc0"];
        assert_eq!(
            (a.cores, a.llc_ways.count),
            (25, 10),
            "{:?}",
            second.reasons
        );
    }

    #[test]
    fn an_input_out_of_the_training_range_sends_the_service_to_the_fallback() {
        // 10⁶ requests per second: log_rps = ln(1 + 10⁶) = 13.8 training SDs from 0 > 5.
        let c = ctx(1, 16);
        let model = linear_model(&[(-1.0, &[]), (-1.0, &[])]);
        let s = Sample {
            requests_per_s: Some(1e6),
            ..sample(Some(0.5))
        };
        let (initial, d) = first_decision(&c, model, &s);
        assert_eq!(
            d.reasons["lc0"],
            Reason::new(
                DecisionPath::Fallback,
                "input log_rps outside the training range (z = 13.8); hold (slack 0.50)"
            )
        );
        assert_eq!(d.plan.services["lc0"].cores, initial.services["lc0"].cores);
        // Out of range: not predicted.
        assert!(!d.predictions.contains_key("lc0"));
    }

    #[test]
    fn a_model_unsure_of_every_candidate_sends_the_service_to_the_fallback() {
        // Members at -5 and +5: a spread of 5 > unsure_sigma 0.7 everywhere. No reading yet,
        // so the model's level is used, and the fallback holds.
        let c = ctx(1, 16);
        let model = linear_model(&[(-5.0, &[]), (5.0, &[])]);
        let (initial, d) = first_decision(&c, model, &sample(None));
        assert_eq!(
            d.reasons["lc0"],
            Reason::new(
                DecisionPath::Fallback,
                "model unsure (sigma 5.00); hold (no latency reading)"
            )
        );
        assert_eq!(d.plan.services["lc0"], initial.services["lc0"]);
    }

    #[test]
    fn no_candidate_meeting_the_target_sends_the_service_to_the_fallback() {
        // A model that predicts no change anywhere, and p99 at 1.5 × the target: every
        // candidate is predicted at ln 1.5 > 0. The fallback grows the 18 fair-share cores by
        // a quarter (slack -0.5, capped at 0.25): ceil(4.5) = 5, and one way.
        let c = ctx(1, 16);
        let model = linear_model(&[(0.0, &[]), (0.0, &[])]);
        let (initial, d) = first_decision(&c, model, &sample(Some(1.5)));
        let before = initial.services["lc0"];
        assert_eq!(before.cores, 18);
        assert_eq!(
            d.reasons["lc0"],
            Reason::new(
                DecisionPath::Fallback,
                "no allocation within reach meets the target (best p99/target 1.50); \
                 +5 cores +1 way (slack -0.50)"
            )
        );
        let after = d.plan.services["lc0"];
        assert_eq!(
            (after.cores, after.llc_ways.count),
            (23, before.llc_ways.count + 1)
        );
        // The fallback's step is predicted, so the model's errors keep being measured.
        assert!(d.predictions.contains_key("lc0"));
    }

    #[test]
    fn a_sudden_saturated_reading_with_unchanged_load_waits_one_tick() {
        // A core more is -0.05 in ln(p99/target) (see the hysteresis test below).
        let c = ctx(1, 16);
        let w = [(col("cores_cand"), -1.8)];
        let model = linear_model(&[(0.0, &w), (0.0, &w)]);
        let mut ml = MlPolicy::new(c.clone(), Arc::new(model), MlConfig::default());
        let initial = ml.initial().plan;
        let first = ml.decide(&observe(&c, &initial, &sample(Some(0.5))), 1_000);
        let placed = first.plan.services["lc0"];
        // 3 × the target after 0.5, same load, 2 of its 8 cores busy: wait.
        let saturated = sample(Some(3.0));
        let second = ml.decide(&observe(&c, &first.plan, &saturated), 2_000);
        assert_eq!(
            second.reasons["lc0"],
            Reason::new(
                DecisionPath::Model,
                "hold (p99/target 3.0 with unchanged load after 0.50: unconfirmed)"
            )
        );
        assert_eq!(second.plan.services["lc0"], placed);
        // Confirmed a tick later: acted on (the model's level, corrected by the miss, wants
        // more cores).
        let third = ml.decide(&observe(&c, &second.plan, &saturated), 3_000);
        assert!(!third.reasons["lc0"].text.contains("unconfirmed"));
        assert!(third.plan.services["lc0"].cores > placed.cores);
    }

    #[test]
    fn a_reading_held_as_a_glitch_teaches_the_service_nothing() {
        // Two readings at half the target, then one at 15 times it with the load unchanged
        // and 2 of 8 cores busy: held (the test above). Its error against the anchored
        // prediction for the allocation in force (about ln 30) must not move the bias or
        // the noise; before the rule it moved both (the noise to its ceiling).
        let c = ctx(1, 16);
        let w = [(col("cores_cand"), -1.8)];
        let model = linear_model(&[(0.0, &w), (0.0, &w)]);
        let mut ml = MlPolicy::new(c.clone(), Arc::new(model), MlConfig::default());
        let mut plan = ml.initial().plan;
        for t in 1..=2 {
            plan = ml
                .decide(&observe(&c, &plan, &sample(Some(0.5))), t * 1_000)
                .plan;
        }
        let before = ml.state["lc0"].clone();
        assert!(before.last.is_some(), "an anchored prediction to correct");
        let glitch = ml.decide(&observe(&c, &plan, &sample(Some(15.0))), 3_000);
        assert!(glitch.reasons["lc0"].text.contains("unconfirmed"));
        let after = &ml.state["lc0"];
        assert_eq!(after.bias, before.bias);
        assert_eq!(after.noise2, before.noise2);
        assert_eq!(after.z2, before.z2);
        assert_eq!(after.misses, before.misses);
    }

    /// `ticks` decisions for one service whose model says a core more is -0.05 in
    /// ln(p99/target) (each member -1.8 × cores_cand), measured at half its target with
    /// `busy` cores busy throughout, give-backs on one spread: its cores and the reason's
    /// text each tick (every one on the model's path).
    fn held_at_half_the_target(busy: f64, ticks: u64) -> Vec<(u32, String)> {
        let c = ctx(1, 16);
        let w = [(col("cores_cand"), -1.8)];
        let model = linear_model(&[(0.0, &w), (0.0, &w)]);
        let cfg = MlConfig {
            k_sigma_give_back: 1.0,
            ..MlConfig::default()
        };
        let mut ml = MlPolicy::new(c.clone(), Arc::new(model), cfg);
        let mut plan = ml.initial().plan;
        let s = Sample {
            cpu_busy_cores: Some(busy),
            ..sample(Some(0.5))
        };
        let mut seen = Vec::new();
        for tick in 1..=ticks {
            let d = ml.decide(&observe(&c, &plan, &s), tick * 1_000);
            let r = &d.reasons["lc0"];
            assert_eq!(r.path, DecisionPath::Model);
            seen.push((d.plan.services["lc0"].cores, r.text.clone()));
            plan = d.plan;
        }
        seen
    }

    #[test]
    fn a_service_near_saturation_gives_back_only_down_to_its_busy_cores_and_their_root() {
        // As in the test below (placed from 18 cores, 3 cores would do by the model), but
        // 7 of the cores are busy: 7 + 0.5 * sqrt(7) = 8.3, so no give-back goes under 9
        // cores, where the same service with 2 busy goes down to 3.
        let cores: Vec<u32> = held_at_half_the_target(7.0, 8)
            .into_iter()
            .map(|(c, _)| c)
            .collect();
        assert_eq!(cores, vec![9; 8]);
    }

    #[test]
    fn a_safe_allocation_is_held_until_a_cheaper_one_lasted_shrink_after_intervals() {
        // A core more is -0.05 in ln(p99/target), p99 at half the target throughout (ln 0.5
        // = -0.693), 2 cores busy; held, so k_sigma is the give-back's (1 here) and the
        // search reaches a quarter more cores.
        // Tick 1 (placement, from 18 cores): c cores predict -0.693 - 0.05 (c - 18) + 0.05
        // (noise), at most ln 0.9 = -0.105 from 8 cores: placed on 8.
        // Then 3 cores would do (grid from 8: 3, 5, 6, 8, 10; 2 + 0.5 * sqrt(2) = 2.7
        // busy): cheaper, and safe; the 8 are held for 4 intervals, and given back on the
        // 5th (shrink_after = 5).
        let seen = held_at_half_the_target(2.0, 6);
        assert_eq!(seen[0], (8, "placed from the model".to_string()));
        for (cores, text) in &seen[1..5] {
            assert_eq!(*cores, 8);
            assert!(text.starts_with("hold (p99/target"), "{text}");
        }
        assert_eq!(
            seen[5],
            (
                3,
                "give back (cheaper allocation safe for 5 intervals)".to_string()
            )
        );
    }

    #[test]
    fn a_rebuilt_ml_keeps_an_unchanged_services_corrections_and_drops_a_changed_ones() {
        let c = ctx(2, 16);
        let w = [(col("cores_cand"), -1.8)];
        let model = Arc::new(linear_model(&[(0.0, &w), (0.0, &w)]));
        let mut ml = MlPolicy::new(c.clone(), Arc::clone(&model), MlConfig::default());
        let mut plan = ml.initial().plan;
        for (t, p99) in [0.5, 0.6, 0.45, 0.55, 0.5].into_iter().enumerate() {
            let t = u64::try_from(t).unwrap() + 1;
            plan = ml
                .decide(&observe(&c, &plan, &sample(Some(p99))), t * 1_000)
                .plan;
        }
        let learnt = ml.state["lc0"].clone();
        assert!(
            learnt.bias_samples > 0 && learnt.bias != 0.0,
            "lc0 has a correction: {learnt:?}"
        );

        // The same services, the policy built from the start's model (another Arc): it takes
        // the model in force and every service's state, and decides as the old one goes on to;
        // the daemon's handing it the model in force again restarts nothing.
        let start_model = Arc::new(linear_model(&[(0.0, &w), (0.0, &w)]));
        let mut rebuilt = MlPolicy::new(c.clone(), start_model, MlConfig::default());
        let adopted = rebuilt.adopt(Box::new(ml.clone()));
        assert_eq!(
            adopted,
            Adopted {
                services: ["lc0", "lc1"].map(String::from).into(),
                host: true
            }
        );
        assert!(Arc::ptr_eq(&rebuilt.model, &model));
        assert!(rebuilt.replace_model(Arc::clone(&model)));
        let mut old = ml.clone();
        for t in 6..9 {
            let o = observe(&c, &plan, &sample(Some(0.6)));
            let (a, b) = (rebuilt.decide(&o, t * 1_000), old.decide(&o, t * 1_000));
            assert_eq!(a, b, "tick {t}");
            plan = a.plan;
        }

        // lc1's target changed and a best-effort job came: lc1 and the pool start afresh,
        // lc0 keeps its correction.
        let mut changed = c.clone();
        changed.specs[1].class = ServiceClass::LatencyCritical { p99_target_ms: 2.0 };
        changed.specs.push(ServiceSpec {
            name: "be2".into(),
            ..c.specs[2].clone()
        });
        let mut rebuilt = MlPolicy::new(changed, Arc::clone(&model), MlConfig::default());
        let adopted = rebuilt.adopt(Box::new(old.clone()));
        assert_eq!(
            adopted,
            Adopted {
                services: ["lc0".to_string()].into(),
                host: false
            }
        );
        let (kept, was) = (&rebuilt.state["lc0"], &old.state["lc0"]);
        assert_eq!(
            (kept.bias, kept.bias_samples, kept.z2, kept.noise2),
            (was.bias, was.bias_samples, was.z2, was.noise2)
        );
        assert_eq!(rebuilt.state["lc1"].bias_samples, 0);
        assert!(rebuilt.state["lc1"].last.is_none());
        // A model reloaded for real (another Arc) still restarts the corrections.
        assert!(rebuilt.replace_model(Arc::new(linear_model(&[(0.0, &w)]))));
        assert_eq!(rebuilt.state["lc0"].bias_samples, 0);
    }
}
