//! Step 7's driver in the `ml` policy: steps 2–6 planned in full at each of the pool's MBA
//! levels this tick considers ([`super::mba::pool_levels`]), and the pick among them.
//!
//! Problem: whether throttling the best-effort pool is worth it depends on what every
//! service would need beside the pool at that level and how those needs pack, which only a
//! whole plan says.
//!
//! Approach: each level is planned from the same starting state (the services' state as
//! this tick found it), a second time beside the bandwidth a grown pool would stream when
//! the plan gives it cores back ([`MlPolicy::plan_level`]); the level with the fewest
//! services short of their needs, then the least cost, wins, among those where the model
//! vouches for as many services as at the level in force ([`MlPolicy::plan_pool_levels`]).
//! The rules for which levels are planned and what a throttle costs are [`super::mba`]'s.

use std::collections::BTreeMap;

use cohabit_core::{DecisionPath, Observation, MBA_MAX_PCT};
use cohabit_models::log_qos_ratio;

use super::pack::{self, Packing, Room};
use super::state::{self, ServiceState};
use super::{mba, MlPolicy, PoolBw, ServicePlan, TIE};

/// One pool MBA level planned in full: what every service wanted there and how it packed.
#[derive(Debug, Clone)]
pub(super) struct LevelPlan {
    pub(super) level: u8,
    pub(super) plans: Vec<ServicePlan>,
    pub(super) packing: Packing,
    /// Services whose packed allocation meets none of their needs.
    pub(super) unmet: usize,
    /// Services on the fallback.
    pub(super) fallbacks: usize,
    /// What the packing and the throttle cost the best-effort jobs.
    pub(super) cost: f64,
    /// The services' state after planning at this level.
    pub(super) state: BTreeMap<String, ServiceState>,
    /// Every pool level planned this tick, in the order planned (set on the one chosen).
    pub(super) planned: Vec<u8>,
    /// The growth of the pool's cores its services were predicted beside (1: none).
    pub(super) growth: f64,
}

impl LevelPlan {
    /// What this level came to, for the rules that decide which levels are planned.
    fn outcome(&self) -> mba::Outcome {
        mba::Outcome {
            unmet: self.unmet,
            fallbacks: self.fallbacks,
            cost: self.cost,
        }
    }
}

impl MlPolicy {
    /// The CPU services measured over their margin, with their requests per second.
    fn over_margin(&self, obs: &Observation) -> Vec<(String, Option<f64>)> {
        let limit = self.cfg.margin.ln();
        obs.latency_critical()
            .filter(|o| o.spec.gpu.is_none())
            .filter(|o| {
                o.spec
                    .p99_target_ms()
                    .and_then(|t| log_qos_ratio(&o.sample, t))
                    .is_some_and(|q| q > limit)
            })
            .map(|o| (o.spec.name.clone(), o.sample.requests_per_s))
            .collect()
    }

    /// The pool's MBA cliff as this tick leaves it: last tick's new one is confirmed or
    /// forgotten ([`mba::MbaCliff::settle`]), one found now replaces the one remembered; the
    /// limit returned is the ceiling on steps up while the cliff binds.
    fn mba_ceiling(
        &mut self,
        obs: &Observation,
        before: u8,
        over: Vec<(String, Option<f64>)>,
    ) -> Option<u8> {
        self.mba_cliff = self
            .mba_cliff
            .take()
            .and_then(|c| c.settle(&self.pool, &over));
        if let Some(c) = mba::MbaCliff::found(before, &self.pool, over) {
            self.mba_cliff = Some(c);
        }
        let load = |name: &str| {
            obs.latency_critical()
                .find(|o| o.spec.name == name)
                .and_then(|o| o.sample.requests_per_s)
        };
        self.mba_cliff
            .as_ref()
            .filter(|c| c.binds(&self.pool, load))
            .map(|c| c.level)
    }

    /// Steps 2–6 with the pool at MBA `level`, planned again beside the bandwidth the pool
    /// would stream when the plan gives it more cores ([`mba::growth`]): a service's
    /// give-back grows a streaming pool, and its neighbours' latency with it (docs/EXPERIMENTS.md,
    /// "A give-back beside a streaming pool"). The services' state is as it was before the
    /// first plan. The second plan is taken unless it leaves more services short of their
    /// needs.
    fn plan_level(&mut self, obs: &Observation, now_ms: u64, level: u8) -> LevelPlan {
        self.pool_growth = 1.0;
        let start = self.state.clone();
        let first = self.plan_level_once(obs, now_ms, level);
        let growth = mba::growth(
            &self.pool,
            &self.throttle,
            level,
            obs.current.best_effort.cores,
            self.ctx
                .host
                .cores
                .saturating_sub(first.packing.alloc.iter().map(|a| a.0).sum()),
        );
        // (Without a CPU best-effort job the pool has no bandwidth reading: no growth.)
        if growth <= 1.0 {
            return first;
        }
        let first_state = std::mem::replace(&mut self.state, start);
        self.pool_growth = growth;
        let second = self.plan_level_once(obs, now_ms, level);
        if second.unmet > first.unmet {
            // Beside the grown pool more services are short than the host can serve: the
            // first plan stands (taking the second sends the pool's level down under the
            // pressure of needs that do not fit, and it stays there; docs/EXPERIMENTS.md,
            // "A give-back beside a streaming pool").
            self.state = first_state;
            self.pool_growth = 1.0;
            return first;
        }
        second
    }

    /// Steps 2–6 with the pool at MBA `level`, its bandwidth grown by `self.pool_growth`.
    fn plan_level_once(&mut self, obs: &Observation, now_ms: u64, level: u8) -> LevelPlan {
        self.pool_level = level;
        let plans = self.plan_services(obs, now_ms);
        let demands = self.demands(obs, &plans, now_ms);
        let costs = self.costs();
        let mut packing = pack::pack(self.room(), &costs, &demands);
        let mut unmet = pack::unmet(&demands, &packing.alloc);
        if unmet > 0 && self.ctx.has_cpu_best_effort() {
            // Latency-critical before best effort: the pool may share its top way.
            let room = Room {
                ways: self.ctx.host.llc_ways,
                ..self.room()
            };
            let all_ways = pack::pack(room, &costs, &demands);
            let u = pack::unmet(&demands, &all_ways.alloc);
            if u < unmet {
                packing = all_ways;
                unmet = u;
            }
        }
        let fallbacks = plans
            .iter()
            .filter(|p| p.reason.path == DecisionPath::Fallback)
            .count();
        let change = if level == self.pool.mba_now {
            0.0
        } else {
            pack::CHANGE_COST
        };
        let cost = pack::total_cost(&costs, &demands, &packing.alloc)
            + mba::throttle_cost(&self.pool, &self.throttle, level)
            + change;
        LevelPlan {
            level,
            plans,
            packing,
            unmet,
            fallbacks,
            cost,
            state: BTreeMap::new(),
            planned: vec![level],
            growth: self.pool_growth,
        }
    }

    /// [`MlPolicy::plan_level`] from the services' state `start` (this tick's, before any
    /// level was planned), the state it leaves kept with the plan.
    fn plan_from(
        &mut self,
        start: &BTreeMap<String, ServiceState>,
        obs: &Observation,
        now_ms: u64,
        level: u8,
    ) -> LevelPlan {
        self.state = start.clone();
        let mut lp = self.plan_level(obs, now_ms, level);
        lp.state = std::mem::take(&mut self.state);
        lp
    }

    /// Plans the pool levels of this tick ([`mba::pool_levels`]), the third only where
    /// [`mba::descend_further`] or [`mba::step_could_win`] say it is likely to be chosen,
    /// and keeps the best: the fewest services short of their needs, then the least cost; a
    /// level other than the one in force only where the model vouches for as many services
    /// as there. When some service is short of its needs at every level, the pool gets the
    /// least bandwidth tried (latency-critical services before best effort).
    pub(super) fn plan_pool_levels(&mut self, obs: &Observation, now_ms: u64) -> LevelPlan {
        let before = self.pool;
        self.pool = PoolBw::observed(obs, &self.ctx.host);
        // A reading missing for a tick or two (a counter read that failed) is not a host
        // without RDT monitoring: the last one stands in, so a throttled pool is not
        // released on a gap (on the E5 `mba-stream` that cost memcached an interval at
        // 3.9 times its target).
        match (self.pool.bw_now, before.bw_now) {
            (None, Some(bw)) if self.pool_bw_stale < state::MAX_STALE_TICKS => {
                self.pool.bw_now = Some(mba::pool_bw_at(
                    &self.throttle,
                    bw,
                    before.mba_now,
                    self.pool.mba_now,
                    self.pool.peak,
                ));
                self.pool_bw_stale += 1;
            }
            (Some(bw), _) => {
                self.pool_bw_stale = 0;
                self.throttle
                    .record(self.pool.mba_now, bw, obs.current.best_effort.cores);
            }
            _ => self.pool_bw_stale = 0,
        }
        let before = before.mba_now;
        let over = self.over_margin(obs);
        // Pressure on the pool's bandwidth: a CPU service over its margin, or last tick's
        // needs did not fit.
        let pressure = self.last_degraded || !over.is_empty();
        let ceiling = self.mba_ceiling(obs, before, over);
        let levels = if self.ctx.has_cpu_best_effort() {
            mba::pool_levels(&self.ctx.host, &self.pool, pressure, ceiling)
        } else {
            vec![MBA_MAX_PCT]
        };
        if levels.len() == 1 {
            self.raise_ticks = 0;
            return self.plan_level(obs, now_ms, levels[0]);
        }
        let start = self.state.clone();
        let mut tried = vec![self.plan_from(&start, obs, now_ms, levels[0])];
        // A service short of its needs at the level in force (overload): the minimum next,
        // and the step down only where it could be chosen. Otherwise the step down next, and
        // the minimum only while the descent helps.
        let overload = levels.len() == 3 && tried[0].unmet > 0;
        let (second, third) = if overload {
            (levels[2], Some(levels[1]))
        } else {
            (levels[1], levels.get(2).copied())
        };
        tried.push(self.plan_from(&start, obs, now_ms, second));
        if let Some(third) = third {
            let (first, second) = (tried[0].outcome(), tried[1].outcome());
            let go_on = if overload {
                mba::step_could_win(first, second)
            } else {
                mba::descend_further(first, second)
            };
            if go_on {
                tried.push(self.plan_from(&start, obs, now_ms, third));
            }
        }
        let planned = tried.iter().map(|lp| lp.level).collect();
        // Chosen as if planned in `levels`' order (in force, step down, minimum): a tie on
        // cost goes to the earlier, as when every level was planned in that order.
        tried.sort_by_key(|lp| levels.iter().position(|l| *l == lp.level));
        let in_force = tried[0].fallbacks;
        let eligible = |lp: &&LevelPlan| lp.fallbacks <= in_force;
        let best_unmet = tried.iter().filter(eligible).map(|lp| lp.unmet).min();
        let pick = if best_unmet.is_some_and(|u| u > 0) {
            tried
                .iter()
                .enumerate()
                .filter(|(_, lp)| eligible(lp) && Some(lp.unmet) == best_unmet)
                .min_by_key(|(_, lp)| lp.level)
                .map(|(i, _)| i)
        } else {
            tried
                .iter()
                .enumerate()
                .filter(|(_, lp)| eligible(lp) && Some(lp.unmet) == best_unmet)
                .min_by(|a, b| a.1.cost.total_cmp(&b.1.cost))
                .map(|(i, _)| i)
        };
        let pick = self.lift_after_a_while(&tried, pick, pressure, in_force);
        let mut best = tried.swap_remove(pick.unwrap_or(0));
        self.state = std::mem::take(&mut best.state);
        self.pool_level = best.level;
        self.pool_growth = best.growth;
        best.planned = planned;
        best
    }

    /// The level picked among `tried` (the one in force first), or the step up planned
    /// beside it once it has won or tied but for the charge of changing the limit
    /// ([`pack::CHANGE_COST`]) for `shrink_after` ticks in a row with no pressure, as a
    /// service's give-back waits for a cheaper allocation to last. The charge keeps
    /// near-ties on what is in force; but a throttle that costs the pool less than a
    /// change per tick and buys the services nothing is paid for every tick it stays, and
    /// it would stay for good. A tie counts: a throttle the pool's readings say costs it
    /// nothing (its bandwidth per core as at the step up) buys the services nothing either
    /// when the step up packs them for as little, and the readings may be wrong where the
    /// pool has not run lately (docs/EXPERIMENTS.md, "A throttle that buys nothing is lifted on
    /// a tie").
    fn lift_after_a_while(
        &mut self,
        tried: &[LevelPlan],
        pick: Option<usize>,
        pressure: bool,
        in_force_fallbacks: usize,
    ) -> Option<usize> {
        let now = self.pool.mba_now;
        let up = tried
            .iter()
            .position(|lp| lp.level > now && lp.fallbacks <= in_force_fallbacks);
        let would = up.is_some_and(|u| {
            !pressure
                && tried[u].unmet <= tried[0].unmet
                && tried[u].cost - pack::CHANGE_COST <= tried[0].cost + TIE
        });
        if !would || pick.is_some_and(|p| tried[p].level > now) {
            self.raise_ticks = 0;
            return pick;
        }
        self.raise_ticks += 1;
        if self.raise_ticks < self.cfg.shrink_after {
            return pick;
        }
        self.raise_ticks = 0;
        up
    }
}
