//! CPU services in the `ml` policy: steps 2–4 for one service, from its reading to its
//! frontier, or to a fixed demand when it holds (a reading to confirm, none at all) or the
//! model cannot be trusted with it (the fallback's feedback step).
//!
//! A service beyond the CLOSIDs shares the pool's ways with the best-effort jobs: it cannot
//! have ways of its own, so it is predicted with the ways it really gets, pool sizes up to
//! the pool's range in force (what it measured under, shared), and the fallback grows its
//! cores alone.

use std::slice;

use cohabit_core::{Allocation, DecisionPath, Observation, Reason, Sample, WayRange, MBA_MAX_PCT};
use cohabit_models::posterior::Blr;
use cohabit_models::{log_qos_ratio, Model, Neighbours};

use super::pack::Need;
use super::predict::{at_mba, out_of_range, Pred, Predictor, SATURATED};
use super::search::{self, Search};
use super::state::{
    safe_to_keep, unconfirmed_saturation, ExploreInput, ExploreStep, Hysteresis, Reading,
    ServiceState, Tick,
};
use super::{MlPolicy, ServicePlan};
use crate::{fair_shares, slack, Share};

/// Why the search found no admissible candidate: the fallback's reason, and whether the
/// model was unsure ([`ServicePlan::unsure`]).
#[derive(Debug, Clone, Copy, PartialEq)]
enum NoCandidate {
    /// The best candidate within reach had a spread wider than `unsure_sigma`.
    Unsure { sigma: f64 },
    /// The model is sure enough, but nothing within reach meets the target: the best
    /// predicted p99/target.
    Unmet { best: f64 },
}

impl NoCandidate {
    /// The model was unsure ([`ServicePlan::unsure`]).
    fn unsure(self) -> bool {
        matches!(self, Self::Unsure { .. })
    }

    /// The fallback's plan for service `name` ([`fallback`]), this the reason, marked
    /// unsure where the model was.
    fn fallback(
        self,
        obs: &Observation,
        name: &str,
        shares_pool: bool,
        evidence: Evidence,
    ) -> ServicePlan {
        let plan = fallback(obs, name, &self.to_string(), true, shares_pool, evidence);
        ServicePlan {
            unsure: self.unsure(),
            ..plan
        }
    }
}

impl std::fmt::Display for NoCandidate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Unsure { sigma } => write!(f, "model unsure (sigma {sigma:.2})"),
            Self::Unmet { best } => write!(
                f,
                "no allocation within reach meets the target (best p99/target {best:.2})"
            ),
        }
    }
}

/// Share of its cores (at least one) that a service the model is unsure of gives back,
/// measured, once it has been held calm (under `explore_below` of its target for
/// `shrink_after` intervals): the exploration rule's cut, undone at once when the next
/// reading is past the margin, whose cliff then holds at that load
/// ([`super::state::ServiceState::explore`]). A quarter, as the fallback's step up.
///
/// Why: the fallback's steps only grow, so without this a service that the model cannot
/// vouch for would keep whatever it was once given for as long as the model stays unsure
/// (docs/EXPERIMENTS.md, "The fallback gives back, measured").
const FALLBACK_GIVE_BACK: f64 = 0.25;

/// What the planner knows of one CPU service at this tick.
#[derive(Debug, Clone)]
struct CpuView {
    target_ms: f64,
    sample: Sample,
    /// The allocation in force (a fair share for a service not yet placed).
    current: Allocation,
    /// The neighbours as measured.
    neighbours: Neighbours,
    /// The neighbours with the pool at the MBA level planned.
    cand_neighbours: Neighbours,
    /// The MBA of every candidate: 100, or the pool's level planned for a service sharing
    /// the pool's group.
    cand_mba: u8,
    /// Measured ln(p99/target).
    measured: Option<f64>,
    /// Shares the pool's ways (beyond the CLOSIDs).
    shares_pool: bool,
    /// Runs on the pool's ways in a group of its own (its range is the pool's; `current`
    /// then says one way, as the model is asked about it).
    on_pool: bool,
    /// May be put on the pool's ways ([`super::MlConfig::pool_ways_for_insensitive`]).
    pool_option: bool,
}

/// What the frontier search found for one service.
#[derive(Debug, Clone)]
struct Found {
    /// (cores, ways) per way count that has an admissible point, in way order.
    points: Vec<(u32, u32)>,
    /// Only the bare target (no margin) could be met.
    relaxed: bool,
    /// Every candidate scored, for reuse.
    scored: Vec<((u32, u32), Pred)>,
    /// The prediction for the allocation in force, when it was scored with the first batch.
    current: Option<Pred>,
}

/// What one CPU service's readings this tick taught its state ([`MlPolicy::note_tick`]).
#[derive(Debug, Clone, Copy)]
struct Noted {
    tick: Tick,
    /// Busy cores for the give-back floor (step 4).
    busy: Option<f64>,
    /// The allocation in force, (cores, ways of its own).
    in_force: (u32, u32),
    /// What the fallback goes by besides the reading.
    evidence: Evidence,
}

/// What the fallback knows of a service from its past readings.
#[derive(Debug, Clone, Copy)]
struct Evidence {
    /// The way back to an allocation measured safe ([`known_good`]).
    known_good: Option<(u32, u32)>,
    /// The most cores and ways it has been measured saturated on since it last was not
    /// ([`super::state::ServiceState::saturated_at`]).
    saturated_at: Option<(u32, u32)>,
}

/// Where one CPU service stands this tick, for the points it may be given
/// ([`MlPolicy::admissible_points`]).
#[derive(Debug, Clone, Copy)]
struct Standing {
    in_force: (u32, u32),
    busy: Option<f64>,
    /// Measured within its margin.
    held: bool,
    /// Safe to keep ([`safe_to_keep`]).
    safe: bool,
    /// Another service has been over its target for `shrink_after` intervals in a row: the
    /// host is crowded, not merely slow to resize after a load step.
    crowded: bool,
}

impl MlPolicy {
    fn view_cpu(&self, obs: &Observation, name: &str) -> CpuView {
        let spec_obs = obs.services.iter().find(|o| o.spec.name == name);
        let target_ms = spec_obs.and_then(|o| o.spec.p99_target_ms()).unwrap_or(1.0);
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
        let measured = log_qos_ratio(&sample, target_ms);
        let neighbours = Neighbours::observed(obs, name, &self.ctx.host);
        let level = self.pool_level;
        let cand_neighbours = self.planned_neighbours(neighbours);
        let shares_pool = self.ctx.shares_pool_group(name);
        let pool_option = self.cfg.pool_ways_for_insensitive
            && !shares_pool
            && self.ctx.host.partitions_llc()
            && self.ctx.has_cpu_best_effort();
        CpuView {
            on_pool: self.on_pool.contains(name),
            pool_option,
            target_ms,
            neighbours,
            cand_neighbours,
            cand_mba: if shares_pool { level } else { MBA_MAX_PCT },
            sample,
            current,
            measured,
            shares_pool,
        }
    }

    /// Steps 2–4 for one CPU service, then the safe exploration of its cliff
    /// ([`super::state::ServiceState::explore`]) when the plan holds what is in force: by
    /// `explore_step` where it is on, and by the fallback's measured give-back
    /// ([`FALLBACK_GIVE_BACK`]) where the model vouches for no candidate.
    pub(super) fn plan_cpu_service(
        &mut self,
        obs: &Observation,
        name: &str,
        now_ms: u64,
    ) -> ServicePlan {
        let plan = self.plan_cpu_model(obs, name, now_ms);
        let Some(a) = obs.current.services.get(name) else {
            return plan;
        };
        let Some(o) = obs.services.iter().find(|o| o.spec.name == name) else {
            return plan;
        };
        // As the plan names it: (cores, 0) on the pool's ways (`search::pool_point`).
        let current = self.counted(name, a);
        let held = plan.keep == Some(current)
            || plan.need
                == (Need::Fixed {
                    cores: current.0,
                    ways: current.1,
                });
        let unsure = plan.unsure;
        let x = ExploreInput {
            current,
            measured: o
                .spec
                .p99_target_ms()
                .and_then(|t| log_qos_ratio(&o.sample, t)),
            rps: o.sample.requests_per_s,
            busy_cores: o.sample.cpu_busy_cores,
            held: held && plan.reason.path != DecisionPath::Explore,
            limit: self.cfg.margin.ln(),
            // `validate` keeps `explore_below` under the margin only while exploring; the
            // fallback's give-back reads it always.
            calm: self.cfg.explore_below.min(self.cfg.margin).ln(),
            after: self.cfg.shrink_after,
            step: if unsure {
                self.cfg.explore_step.max(FALLBACK_GIVE_BACK)
            } else {
                self.cfg.explore_step
            },
            fallback: unsure,
        };
        let Some(st) = self.state.get_mut(name) else {
            return plan;
        };
        if let Some(plan) = judge_growth(st, name, &plan, &x) {
            return plan;
        }
        let by_fallback = st.probe.is_some_and(|p| p.fallback);
        let (to, path, text) = match st.explore(&x) {
            ExploreStep::Stay => return plan,
            ExploreStep::Revert(to) => {
                let (path, cut) = if by_fallback {
                    (DecisionPath::Fallback, "the give-back")
                } else {
                    (DecisionPath::Explore, "explore: the cut")
                };
                (
                    to,
                    path,
                    format!(
                        "{cut} to {} cores went past the margin (p99/target {:.2}); back to \
                         {}, cliff remembered",
                        current.0,
                        x.measured.map_or(f64::NAN, f64::exp),
                        to.0
                    ),
                )
            }
            // The model's mean already puts the cut past the margin: not worth a violation
            // to learn (the calm count restarts). Not asked where the model vouches for no
            // candidate: its mean is what it is unsure of, and the reading judges the cut.
            // A cut on the pool's ways is judged by the one-way point it was offered from.
            ExploreStep::Cut(to)
                if !unsure && !predicted_within(&st.scored, (to.0, to.1.max(1)), x.limit) =>
            {
                st.probe = None;
                return plan;
            }
            ExploreStep::Cut(to) if unsure => (
                to,
                DecisionPath::Fallback,
                format!(
                    "{}; give back {} -> {} cores, measured (p99/target under {:.2} for {} \
                     intervals)",
                    plan.reason.text.split("; ").next().unwrap_or_default(),
                    current.0,
                    to.0,
                    x.calm.exp(),
                    self.cfg.shrink_after
                ),
            ),
            ExploreStep::Cut(to) => (
                to,
                DecisionPath::Explore,
                format!(
                    "explore: {} -> {} cores (p99/target under {:.2} for {} intervals)",
                    current.0, to.0, self.cfg.explore_below, self.cfg.shrink_after
                ),
            ),
        };
        let reason = Reason::new(path, text);
        ServicePlan::fixed(name, to.0, to.1, reason, plan.predictable)
    }

    /// Steps 2–4 for one CPU service.
    fn plan_cpu_model(&mut self, obs: &Observation, name: &str, now_ms: u64) -> ServicePlan {
        let cfg = self.cfg;
        let v = self.view_cpu(obs, name);
        let costs = self.costs();
        let noted = self.note_tick(&v, name);
        if let Some(plan) = self.hold_or_fall_back(obs, name, &v, &noted, now_ms) {
            return plan;
        }
        let Noted {
            tick:
                Tick {
                    new_service,
                    basis,
                    prev,
                    ..
                },
            busy,
            in_force,
            evidence,
        } = noted;
        let predictor = Predictor {
            model: &self.model,
            host: &self.ctx.host,
            target_ms: v.target_ms,
            sample: &v.sample,
            current: &v.current,
            neighbours: &v.neighbours,
            cand_neighbours: &v.cand_neighbours,
            basis,
            reference_out: self.references.get(name),
            posterior: None,
        };
        let probe = predictor.features(&v.current);
        if let Some((feature, z)) = out_of_range(&self.model.meta, &probe, cfg.z_limit) {
            let why = format!("input {feature} outside the training range (z = {z:.1})");
            return fallback(obs, name, &why, false, v.shares_pool, evidence);
        }
        if self.posterior_model.is_some() {
            if let Some(st) = self.state.get_mut(name).filter(|st| st.posterior.is_none()) {
                st.posterior = fit_prior(&predictor, &self.model, v.cand_mba);
            }
        }
        let predictor = Predictor {
            posterior: self.state.get(name).and_then(|st| st.posterior.as_ref()),
            ..predictor
        };
        let held = v.measured.is_some_and(|q| q <= cfg.margin.ln());
        let ways = self.way_grid_for(&v);
        let meeting = v.measured.is_some_and(|q| q <= 0.0);
        let found = match self.search(&predictor, held, meeting, &ways, v.cand_mba) {
            Ok(found) => found,
            Err(none) => return none.fallback(obs, name, v.shares_pool, evidence),
        };
        let (cur_mean, cur_sigma) = Self::in_force_prediction(&found, &predictor, &v);
        // Measured safe; and when the plan grows a streaming pool, predicted safe beside
        // the bandwidth it would then stream (a throttle as planned is not checked here:
        // checked, every pool level that raised the limit made the services resize, and
        // best effort fell with no more runs meeting QoS; docs/EXPERIMENTS.md, "Results history").
        let safe = safe_to_keep(v.measured, prev, cfg.margin.ln())
            && (self.pool_growth <= 1.0 || cur_mean + cfg.k_sigma * cur_sigma <= cfg.margin.ln());
        // The allocation in force as the packer counts it.
        let current = self.counted(name, &v.current);
        let neighbour_over = Self::neighbour_over_target(obs, name);
        let crowded = self.crowded_beside(name);
        let st = self.state.entry(name.to_string()).or_default();
        let standing = Standing {
            in_force,
            busy,
            held,
            safe,
            crowded,
        };
        let mut points = Self::admissible_points(
            st,
            &v,
            found.points,
            found.relaxed,
            standing,
            cfg.give_back_headroom,
            neighbour_over,
        );
        let cost = |c: u32, w: u32| costs.of(c, w, v.shares_pool);
        let cur_cost = cost(current.0, current.1);
        let cheaper = points.iter().any(|&(c, w)| cost(c, w) < cur_cost);
        st.scored = found.scored;
        st.scored_mba = v.cand_mba;
        let h = st.hysteresis(safe, held, cheaper, new_service, cfg.shrink_after);
        let now = format!("p99/target {:.2} ± {:.2}", cur_mean.exp(), cur_sigma);
        let text = model_reason(new_service, h, safe, found.relaxed, &now);
        if !safe && !new_service {
            points = search::never_fewer_ways(points, current.1);
        }
        let climb = search::climb_floor(v.measured, prev, in_force.0, busy, cfg.give_back_headroom);
        let (points, text) = search::sized_for_climb(points, text, climb, in_force.1);
        ServicePlan {
            name: name.to_string(),
            need: Need::Frontier { points },
            keep: (h.keep && climb.is_none()).then_some(current),
            stay: (safe && !h.keep && !new_service && climb.is_none()).then_some(current),
            reason: Reason::new(DecisionPath::Model, text),
            gpu_pct: None,
            predictable: true,
            unsure: false,
        }
    }

    /// Step 1's bookkeeping for CPU service `name` seen as `v`: starts its tick, reads its
    /// busy cores, counts a reading of the allocation in force toward a safe measurement,
    /// and finds the fallback's way back to an allocation measured safe.
    fn note_tick(&mut self, v: &CpuView, name: &str) -> Noted {
        let costs = self.costs();
        let margin = self.cfg.margin;
        let requests = v
            .sample
            .requests_per_s
            .map(|r| r * self.interval_s)
            .filter(|n| *n > 0.0);
        let st = self.state.entry(name.to_string()).or_default();
        let tick = st.begin_tick(v.measured, v.sample.requests_per_s, requests);
        // Busy cores for the give-back floor (step 4), read every tick so a bridged reading
        // is never older than the ticks it bridges.
        let busy = st.busy_cores(v.sample.cpu_busy_cores, v.sample.requests_per_s);
        // Every reading of the allocation in force counts toward a safe measurement (on
        // the pool's ways, or sharing them, the ways are not the service's own: none).
        let in_force = (v.current.cores, v.current.llc_ways.count);
        let measured = v.measured.filter(|_| !v.on_pool && !v.shares_pool);
        st.note_safe(
            in_force,
            measured,
            v.sample.requests_per_s,
            v.neighbours.mem_bw_bytes_per_s,
            margin.ln(),
        );
        // The last allocation measured safe, for the fallback: at this load and beside no
        // busier neighbours it is surer than a feedback step from what is in force.
        let known_good = known_good(
            &st.certified(v.sample.requests_per_s, v.neighbours.mem_bw_bytes_per_s),
            in_force,
            |c, w| costs.of(c, w, v.shares_pool),
        );
        let saturated_at = st.note_saturation(in_force, measured);
        Noted {
            tick,
            busy,
            in_force,
            evidence: Evidence {
                known_good,
                saturated_at,
            },
        }
    }

    /// Before the model is asked about CPU service `name` (step 3): a hold for an unconfirmed
    /// saturated reading or a missing one, or the fallback while a run of misses holds it
    /// there.
    fn hold_or_fall_back(
        &mut self,
        obs: &Observation,
        name: &str,
        v: &CpuView,
        noted: &Noted,
        now_ms: u64,
    ) -> Option<ServicePlan> {
        let Tick {
            new_service,
            prev,
            reading,
            ..
        } = noted.tick;
        if let (Some(now), Some(prev)) = (reading, prev) {
            if unconfirmed_saturation(now, prev, v.sample.cpu_busy_cores, v.current.cores) {
                let why = format!(
                    "hold (p99/target {:.1} with unchanged load after {:.2}: unconfirmed)",
                    now.log_q.exp(),
                    prev.log_q.exp()
                );
                return Some(hold(name, self.counted(name, &v.current), why));
            }
        }
        if v.measured.is_none() && !new_service {
            return Some(hold(
                name,
                self.counted(name, &v.current),
                "hold (no latency reading)".into(),
            ));
        }
        let cfg = self.cfg;
        let st = self.state.entry(name.to_string()).or_default();
        st.on_fallback(now_ms, &cfg)
            .map(|why| fallback(obs, name, &why, true, v.shares_pool, noted.evidence))
    }

    /// The way counts step 4 searches for CPU service `v`. A sharer's ways are the pool's:
    /// sizes up to the range it measured under.
    fn way_grid_for(&self, v: &CpuView) -> Vec<u32> {
        if v.shares_pool {
            search::way_grid(v.current.llc_ways.count)
        } else {
            search::way_grid(self.lc_ways())
        }
    }

    /// The prediction (mean, spread) for the allocation in force of CPU service `v`: the
    /// search's when it scored it, else asked now; (0, 0) when there is none.
    fn in_force_prediction(found: &Found, predictor: &Predictor<'_>, v: &CpuView) -> (f64, f64) {
        found
            .current
            .or_else(|| {
                predictor
                    .predict_many(slice::from_ref(&v.current))
                    .first()
                    .copied()
            })
            .map_or((0.0, 0.0), |p| (p.mean, p.sigma))
    }

    /// Whether another latency-critical service than `name` has been over its target for
    /// `shrink_after` intervals in a row ([`Standing::crowded`]).
    fn crowded_beside(&self, name: &str) -> bool {
        self.ctx
            .latency_critical()
            .any(|s| s.name != name && self.persistently_over(&s.name))
    }

    /// Whether a latency-critical service other than `name` is measured over its target.
    fn neighbour_over_target(obs: &Observation, name: &str) -> bool {
        obs.latency_critical().any(|o| {
            o.spec.name != name
                && o.spec
                    .p99_target_ms()
                    .and_then(|t| log_qos_ratio(&o.sample, t))
                    .is_some_and(|q| q > 0.0)
        })
    }

    /// Step 4's frontier `points` for CPU service `v` (its state `st`) as measurements
    /// bound it: give-backs short of saturation, the pool's ways where it may run there,
    /// the allocations measured safe, and its measured cliffs.
    fn admissible_points(
        st: &mut super::state::ServiceState,
        v: &CpuView,
        points: Vec<(u32, u32)>,
        relaxed: bool,
        standing: Standing,
        give_back_headroom: f64,
        neighbour_over: bool,
    ) -> Vec<(u32, u32)> {
        let Standing {
            in_force,
            busy,
            held,
            safe,
            crowded,
        } = standing;
        // A give-back stops short of saturation, whatever the model says, wherever one may
        // happen (measured within the margin, or safe to keep). The pool point is read off
        // the lifted frontier: at the floor's cores the model says the service needs no more
        // than one way, and the pool's ways are at least one (read off it before the lift
        // and lifted with the rest, fewer runs met QoS; docs/EXPERIMENTS.md, "Results history").
        let mut points = if held || safe {
            search::short_of_saturation(points, in_force, busy, give_back_headroom)
        } else {
            points
        };
        if v.pool_option
            && st.pool_ways_allowed(v.on_pool, safe, v.sample.requests_per_s)
            && !relaxed
        {
            points.extend(search::pool_point(&points, crowded));
        }
        // What this service was measured safe at, at this load or more and beside no busier
        // neighbours, is admissible whatever the model's spread says.
        if !v.on_pool && !v.shares_pool {
            for p in st.certified(
                v.sample.requests_per_s,
                v.cand_neighbours.mem_bw_bytes_per_s,
            ) {
                if !points.contains(&p) {
                    points.push(p);
                }
            }
        }
        // A neighbour over its target outranks a weak cliff (one this service met its target
        // at): its frontier goes under it while the neighbour needs the room.
        st.measured_floor(points, v.sample.requests_per_s, neighbour_over)
    }

    /// Step 4 for one service over the way counts `ways` (ascending): its frontier within
    /// the trust region, or the bare target among the candidates already scored (with a
    /// cushion when the service is `meeting` its target now); `Err` with why (for the
    /// fallback) when not even that is admissible.
    fn search(
        &self,
        p: &Predictor<'_>,
        held: bool,
        meeting: bool,
        ways: &[u32],
        mba: u8,
    ) -> Result<Found, NoCandidate> {
        let cfg = &self.cfg;
        let max_cores = search::max_cores(p.current.cores, self.ctx.host.cores, held);
        let query = Search {
            ways,
            cores_now: p.current.cores,
            max_cores,
            margin: cfg.margin,
            // Risk is not symmetric: a service in trouble takes an uncertain step up, a
            // service that is fine gives back only what the model is sure of.
            k_sigma: if held {
                cfg.k_sigma_give_back
            } else {
                cfg.k_sigma
            },
            unsure_sigma: cfg.unsure_sigma,
        };
        let mut scored = Vec::new();
        // With the neighbours as planned differing from those measured, the allocation in
        // force is not predicted as measured: it rides with the first batch (one model pass
        // fewer per pool level).
        let mut current = None;
        let mut with_current = p.neighbours != p.cand_neighbours;
        let mut points = search::frontier(&query, |batch| {
            let mut cands: Vec<Allocation> =
                batch.iter().map(|&(c, w)| at_mba(c, w, mba)).collect();
            let extra = std::mem::take(&mut with_current);
            if extra {
                cands.push(*p.current);
            }
            let mut preds = p.predict_many(&cands);
            if extra {
                current = preds.pop();
            }
            scored.extend(batch.iter().copied().zip(preds.iter().copied()));
            preds
        });
        let mut relaxed = false;
        if points.is_empty() {
            // Nothing meets the target with the margin: settle for the bare target, among
            // the candidates already scored (no second search).
            // A service meeting its target keeps `k_sigma` spreads of cushion under it (at
            // its mean's bare target it would sit on the edge until the load tips it over);
            // one already over it, on a host that cannot give it its margin, takes the
            // mean's (a cushion for each of them is what a crowded host cannot fit).
            // Without a cushion within reach, a service meeting its target takes the
            // fallback's step up rather than the edge (with the mean's bare target instead,
            // fewer runs met QoS; docs/EXPERIMENTS.md, "Results history").
            let k = if meeting { cfg.k_sigma } else { 0.0 };
            points = search::bare_target(ways, &scored, cfg.unsure_sigma, k);
            relaxed = true;
            if points.is_empty() {
                // The most within reach: usually scored already (the core grid reaches the
                // trust region's edge), else one more pass.
                let last = ways.last().copied().unwrap_or(1);
                let best = match scored.iter().find(|(k, _)| *k == (max_cores, last)) {
                    Some((_, q)) => (q.mean, q.sigma),
                    None => {
                        let most = Allocation {
                            cores: max_cores,
                            llc_ways: WayRange::new(0, last),
                            mba_pct: mba,
                            ..*p.current
                        };
                        p.predict_many(&[most])
                            .first()
                            .map_or((0.0, 0.0), |q| (q.mean, q.sigma))
                    }
                };
                return Err(no_candidate(best, cfg.unsure_sigma));
            }
        }
        Ok(Found {
            points,
            relaxed,
            scored,
            current,
        })
    }
}

/// A service's posterior prior ([`super::posterior::prior`]), its spread per basis unit
/// fitted to the model's own on the probe steps around the allocation in force
/// ([`super::posterior::PROBE_STEPS`], at MBA `mba`); `None` before the service has an
/// anchor (its first reading) or on a model without a basis.
pub(super) fn fit_prior(p: &Predictor<'_>, model: &Model, mba: u8) -> Option<Blr> {
    let (cores, ways) = (p.current.cores, p.current.llc_ways.count);
    let probes: Vec<Allocation> = super::posterior::PROBE_STEPS
        .iter()
        .map(|&(k, dw)| {
            let c = u32::try_from(cohabit_core::whole(f64::from(cores) * k)).unwrap_or(1);
            let w = u32::try_from(i64::from(ways) + i64::from(dw)).unwrap_or(1);
            at_mba(
                c.clamp(1, p.host.cores.max(1)),
                w.clamp(1, p.host.llc_ways.max(1)),
                mba,
            )
        })
        .filter(|a| (a.cores, a.llc_ways.count) != (cores, ways))
        .collect();
    let scale = p.prior_scale(&probes)?;
    super::posterior::prior(model.ensemble.basis_width()?, scale)
}

/// The words for a plan on the model path: placed, held (by the hysteresis), given back,
/// or resized (to the bare target when no margin was left); `now` is the prediction for
/// the allocation in force.
fn model_reason(new_service: bool, h: Hysteresis, safe: bool, relaxed: bool, now: &str) -> String {
    if new_service {
        "placed from the model".to_string()
    } else if h.keep {
        format!("hold ({now})")
    } else if safe {
        format!(
            "give back (cheaper allocation safe for {} intervals)",
            h.surplus_ticks
        )
    } else if relaxed {
        format!("resize to the bare target, no margin left ({now} now)")
    } else {
        format!("resize ({now} now)")
    }
}

/// Why no candidate is admissible, from the `best` (mean, spread) prediction within reach:
/// the model is unsure, or nothing meets the target.
fn no_candidate(best: (f64, f64), unsure_sigma: f64) -> NoCandidate {
    if best.1 > unsure_sigma {
        NoCandidate::Unsure { sigma: best.1 }
    } else {
        NoCandidate::Unmet { best: best.0.exp() }
    }
}

/// The fallback's growths judged by their readings ([`super::growth`]): the undo of a
/// growth whose readings after it were no lower than before, or a hold where the fallback
/// would grow a service past the ceiling such an undo set; otherwise `None`, noting a
/// growth the fallback asks for so that the next ticks judge it.
fn judge_growth(
    st: &mut ServiceState,
    name: &str,
    plan: &ServicePlan,
    x: &ExploreInput,
) -> Option<ServicePlan> {
    let current = x.current;
    let reading = x.measured.map(|log_q| Reading { log_q, rps: x.rps });
    if let Some(u) = st.growth.note(current, reading) {
        st.probe = None;
        st.calm_ticks = 0;
        let text = format!(
            "the fallback's growth {} -> {} cores did not lower the p99 (p99/target {:.2} \
             before, {:.2} after, at the same load); back to {} cores, grown no further at \
             this load for {} intervals",
            u.back_to.0, u.grown.0, u.before, u.after, u.back_to.0, u.ceiling_ticks
        );
        let reason = Reason::new(DecisionPath::Fallback, text);
        return Some(ServicePlan::fixed(
            name,
            u.back_to.0,
            u.back_to.1,
            reason,
            plan.predictable,
        ));
    }
    if plan.reason.path != DecisionPath::Fallback {
        return None;
    }
    let Need::Fixed { cores, .. } = plan.need else {
        return None;
    };
    if cores <= current.0 {
        return None;
    }
    if let Some(cap) = st.growth.ceiling(x.rps).filter(|&c| current.0 >= c) {
        let text = format!(
            "{}; hold: a growth past {cap} cores did not lower the p99 at this load",
            plan.reason.text.split("; ").next().unwrap_or_default()
        );
        let reason = Reason::new(DecisionPath::Fallback, text);
        return Some(ServicePlan::fixed(
            name,
            current.0,
            current.1,
            reason,
            plan.predictable,
        ));
    }
    st.growth.ask(current);
    None
}

/// Holds the allocation in force, `current` (cores, ways) as the packer counts it, on the
/// model path (not predicted: the reading is not to be trusted or missing).
fn hold(name: &str, current: (u32, u32), text: String) -> ServicePlan {
    let reason = Reason::new(DecisionPath::Model, text);
    ServicePlan::fixed(name, current.0, current.1, reason, false)
}

/// The fallback for a service the model cannot be trusted with, `why` saying why: back to
/// `known_good` (see [`known_good`]) when the service is over its target and there is one,
/// else a feedback step from what is in force (cores alone for a service sharing the
/// pool's ways).
fn fallback(
    obs: &Observation,
    name: &str,
    why: &str,
    predictable: bool,
    shares_pool: bool,
    evidence: Evidence,
) -> ServicePlan {
    let cur = obs
        .current
        .services
        .get(name)
        .map_or((1, 1), |a| (a.cores, a.llc_ways.count));
    let slack = slack(obs, name);
    if let (Some((cores, ways)), Some(v)) = (evidence.known_good, slack) {
        if v < 0.0 {
            let what = format!(
                "back to {cores} cores / {ways} ways, measured safe at this load (slack {v:.2})"
            );
            let reason = Reason::new(DecisionPath::Fallback, format!("{why}; {what}"));
            return ServicePlan::fixed(name, cores, ways, reason, predictable);
        }
    }
    let (cores, ways, what) = fallback_step(cur, slack, !shares_pool, evidence.saturated_at);
    let reason = Reason::new(DecisionPath::Fallback, format!("{why}; {what}"));
    ServicePlan::fixed(name, cores, ways, reason, predictable)
}

/// The cheapest of the allocations `certified` (measured safe at this load, see
/// [`super::state::ServiceState::certified`]) that the allocation in force, `in_force`,
/// does not cover: one it covers in cores and ways was enough then and is not now, so the
/// host changed and it proves nothing. `cost` prices (cores, ways).
///
/// Why: a service cut below what it needs (its ways taken by a neighbour's give-back, say)
/// and measured far over its target is outside what the model knows, and the fallback's
/// step (more cores, one more way) may never reach the ways it lost while the cores it adds
/// leave no room for the neighbour to give them back; the measured-safe allocation says in
/// one step what the service needs.
fn known_good(
    certified: &[(u32, u32)],
    in_force: (u32, u32),
    cost: impl Fn(u32, u32) -> f64,
) -> Option<(u32, u32)> {
    certified
        .iter()
        .copied()
        .filter(|&(c, w)| !(in_force.0 >= c && in_force.1 >= w))
        .min_by(|a, b| cost(a.0, a.1).total_cmp(&cost(b.0, b.1)))
}

/// The fallback's feedback step from `cur` (cores, ways) given the measured slack:
/// (cores, ways, what was done).
///
/// The step only grows or holds: a cut on the fallback is measured instead, one at a time,
/// from an allocation held calm, and undone at the first reading past the margin
/// ([`FALLBACK_GIVE_BACK`]), so a service on the fallback never walks into a latency cliff
/// on a guess. A violating service (slack under 0.05) gets a
/// step proportional to how far off, a quarter of the current cores at most; past
/// saturation (p99 at twice the target or more, a reading the glitch check let through)
/// the cores double. One more way when it has `own_ways`; a service sharing the pool's
/// ways cannot have more, so its step is cores alone (and its pool keeps its size).
///
/// A saturated service with ways of its own that holds less than the most it has been
/// measured saturated on (`saturated_at`: it was cut, or given up by the overload rule)
/// steps to twice that in cores and in ways instead: a saturated queue reads the time-out
/// however far short it is, so a step from what it was left would try again what already
/// failed, and one way a step never reaches what it lacks (docs/EXPERIMENTS.md, "A
/// saturated service steps from what it read saturated on").
fn fallback_step(
    cur: (u32, u32),
    slack: Option<f64>,
    own_ways: bool,
    saturated_at: Option<(u32, u32)>,
) -> (u32, u32, String) {
    let failed = saturated_at.filter(|s| own_ways && (s.0 > cur.0 || s.1 > cur.1));
    match (slack, failed) {
        (Some(v), Some(s)) if v <= 1.0 - SATURATED => {
            let (cores, ways) = (2 * s.0.max(cur.0), 2 * s.1.max(cur.1));
            (
                cores,
                ways,
                format!(
                    "+{} cores +{} ways, twice the most it read saturated on, {} cores / {} \
                     ways (slack {v:.2})",
                    cores - cur.0,
                    ways - cur.1,
                    s.0,
                    s.1
                ),
            )
        }
        (Some(v), _) if v < 0.05 => {
            let frac = if v <= 1.0 - SATURATED {
                1.0
            } else {
                (-v).clamp(0.1, 0.25)
            };
            let step = (f64::from(cur.0) * frac).ceil();
            let step = u32::try_from(cohabit_core::whole(step)).unwrap_or(1).max(1);
            if own_ways {
                (
                    cur.0 + step,
                    cur.1 + 1,
                    format!("+{step} cores +1 way (slack {v:.2})"),
                )
            } else {
                (
                    cur.0 + step,
                    cur.1,
                    format!("+{step} cores, the pool's ways (slack {v:.2})"),
                )
            }
        }
        (Some(v), _) => (cur.0, cur.1, format!("hold (slack {v:.2})")),
        (None, _) => (cur.0, cur.1, "hold (no latency reading)".into()),
    }
}

/// Whether the model's mean, without its spread, puts the cut `to` (cores, ways) within
/// `limit` (ln of the margin), judged by this tick's scored candidates: the one with the
/// most cores and ways among those with no more of either than the cut (fewer never help,
/// so it is a pessimistic stand-in). False when none was scored (the service was not
/// searched this tick). Exploring a cut the spread forbids is the point; one the mean
/// forbids would only cost a violation.
fn predicted_within(scored: &[((u32, u32), Pred)], to: (u32, u32), limit: f64) -> bool {
    scored
        .iter()
        .filter(|((c, w), _)| *c <= to.0 && *w <= to.1)
        .max_by_key(|((c, w), _)| (*c, *w))
        .is_some_and(|(_, p)| p.mean <= limit)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fallback_growth_that_did_not_help_is_undone_and_the_fallback_then_holds() {
        let plan = |path, cores, text: &str| {
            ServicePlan::fixed("m", cores, 1, Reason::new(path, text), true)
        };
        let step = "model unsure (sigma 0.90); +1 cores, the pool's ways (slack -0.30)";
        let grow = plan(DecisionPath::Fallback, 2, step);
        let held = plan(DecisionPath::Fallback, 1, "model unsure (sigma 0.90); hold");
        let at = |cores, q: f64| ExploreInput {
            current: (cores, 1),
            measured: Some(q.ln()),
            rps: Some(200.0),
            busy_cores: None,
            held: false,
            limit: 0.9f64.ln(),
            calm: 0.75f64.ln(),
            after: 5,
            step: 0.0,
            fallback: true,
        };
        let mut st = ServiceState::default();
        assert!(judge_growth(&mut st, "m", &held, &at(1, 0.8)).is_none());
        assert!(judge_growth(&mut st, "m", &held, &at(1, 0.9)).is_none());
        assert!(
            judge_growth(&mut st, "m", &grow, &at(1, 1.3)).is_none(),
            "asks"
        );
        assert!(judge_growth(&mut st, "m", &held, &at(2, 1.2)).is_none());
        assert!(judge_growth(&mut st, "m", &held, &at(2, 1.4)).is_none());
        let undo = judge_growth(&mut st, "m", &held, &at(2, 1.1)).expect("judged: no gain");
        assert_eq!(undo.need, Need::Fixed { cores: 1, ways: 1 });
        assert_eq!(undo.reason.path, DecisionPath::Fallback);
        assert!(
            undo.reason.text.contains("did not lower the p99"),
            "{}",
            undo.reason.text
        );
        // Back on one core and over the target: the fallback holds instead of growing.
        let capped = judge_growth(&mut st, "m", &grow, &at(1, 1.3)).expect("capped");
        assert_eq!(capped.need, Need::Fixed { cores: 1, ways: 1 });
        assert!(capped
            .reason
            .text
            .starts_with("model unsure (sigma 0.90); hold: a growth"));
        // A growth on the model path is the model's to judge.
        let model = plan(DecisionPath::Model, 2, "resize");
        assert!(judge_growth(&mut st, "m", &model, &at(1, 1.3)).is_none());
    }

    #[test]
    fn a_cut_is_explored_only_where_the_models_mean_stays_within_the_margin() {
        let pred = |mean: f64| Pred::plain(mean, 0.5, 0.1);
        let limit = 0.9f64.ln();
        // Scored at 6 and 8 cores with 4 ways; the cut to 7 cores and 5 ways is judged by
        // (6, 4), the nearest with no more of either.
        let scored = vec![
            ((6, 4), pred(-0.3)),
            ((8, 4), pred(-0.5)),
            ((6, 8), pred(0.4)),
        ];
        assert!(predicted_within(&scored, (7, 5), limit));
        let worse = vec![((6, 4), pred(0.0)), ((8, 4), pred(-0.5))];
        assert!(!predicted_within(&worse, (7, 5), limit));
        // Nothing scored at or under the cut: no cut.
        assert!(!predicted_within(&scored, (5, 4), limit));
        assert!(!predicted_within(&[], (7, 5), limit));
    }

    #[test]
    fn the_fallback_goes_back_to_the_cheapest_measured_safe_allocation_not_in_force() {
        let cost = |c: u32, w: u32| f64::from(c) / 36.0 + 0.1 * f64::from(w) / 20.0;
        let certified = [(21, 6), (14, 13)];
        // On one way with 24 cores neither is covered: the cheaper, (14, 13).
        assert_eq!(known_good(&certified, (24, 1), cost), Some((14, 13)));
        // (22, 7) covers (21, 6): that one was enough then and is not now, so it proves
        // nothing; (14, 13) is still evidence.
        assert_eq!(known_good(&[(21, 6)], (22, 7), cost), None);
        assert_eq!(known_good(&certified, (22, 7), cost), Some((14, 13)));
        // Nothing measured safe: the feedback step.
        assert_eq!(known_good(&[], (24, 1), cost), None);
    }

    #[test]
    fn the_fallback_grows_a_violating_service_in_proportion_to_how_far_off() {
        // 12 % over the target: 12 % of 10 cores, rounded up: +2, and one way.
        assert_eq!(
            fallback_step((10, 4), Some(-0.12), true, None),
            (12, 5, "+2 cores +1 way (slack -0.12)".to_string())
        );
        // Far over (p99 1.6 × the target): a quarter at most, +3.
        assert_eq!(fallback_step((10, 4), Some(-0.6), true, None).0, 13);
        // Just inside the target but within 5 %: the smallest step, 10 %: +1.
        assert_eq!(fallback_step((10, 4), Some(0.02), true, None).0, 11);
    }

    #[test]
    fn the_fallback_doubles_the_cores_of_a_saturated_service() {
        // p99 at twice the target: slack -1.
        assert_eq!(fallback_step((10, 4), Some(-1.0), true, None).0, 20);
    }

    #[test]
    fn a_saturated_service_left_less_than_it_read_saturated_on_steps_to_twice_that() {
        // Saturated on (4, 6) before, given up to (1, 1) since: twice (4, 6).
        assert_eq!(
            fallback_step((1, 1), Some(-19.0), true, Some((4, 6))),
            (
                8,
                12,
                "+7 cores +11 ways, twice the most it read saturated on, 4 cores / 6 ways \
                 (slack -19.00)"
                    .to_string()
            )
        );
        // Short in ways only: twice the most of each.
        assert_eq!(fallback_step((5, 2), Some(-3.0), true, Some((3, 6))).0, 10);
        assert_eq!(fallback_step((5, 2), Some(-3.0), true, Some((3, 6))).1, 12);
        // Holding all it read saturated on: the usual step (double the cores, one way).
        assert_eq!(
            fallback_step((4, 6), Some(-19.0), true, Some((4, 6))),
            (8, 7, "+4 cores +1 way (slack -19.00)".to_string())
        );
        // Over its target but not saturated, or sharing the pool's ways: the usual step.
        assert_eq!(
            fallback_step((1, 1), Some(-0.5), true, Some((4, 6))),
            (2, 2, "+1 cores +1 way (slack -0.50)".to_string())
        );
        assert_eq!(fallback_step((1, 3), Some(-19.0), false, Some((4, 3))).1, 3);
    }

    #[test]
    fn the_fallback_grows_a_service_sharing_the_pools_ways_by_cores_alone() {
        // 12 % over the target with the pool's 3 ways: +2 cores, the ways stay the pool's.
        assert_eq!(
            fallback_step((10, 3), Some(-0.12), false, None),
            (12, 3, "+2 cores, the pool's ways (slack -0.12)".to_string())
        );
        assert_eq!(fallback_step((10, 3), Some(-1.0), false, None).0, 20);
    }

    #[test]
    fn the_fallback_never_cuts() {
        assert_eq!(
            fallback_step((10, 4), Some(0.6), true, None),
            (10, 4, "hold (slack 0.60)".to_string())
        );
        assert_eq!(
            fallback_step((10, 4), None, true, None),
            (10, 4, "hold (no latency reading)".to_string())
        );
    }

    #[test]
    fn no_candidate_says_whether_the_model_was_unsure_or_nothing_met_the_target() {
        // A spread of 0.8 > 0.7; then a best mean of 0.5: p99/target exp(0.5) = 1.6487.
        let unsure = no_candidate((-1.0, 0.8), 0.7);
        assert_eq!(unsure, NoCandidate::Unsure { sigma: 0.8 });
        assert_eq!(unsure.to_string(), "model unsure (sigma 0.80)");
        let unmet = no_candidate((0.5, 0.1), 0.7);
        assert!(!unmet.unsure() && unsure.unsure());
        assert_eq!(
            unmet.to_string(),
            "no allocation within reach meets the target (best p99/target 1.65)"
        );
    }
}
