//! Memory bandwidth in the `ml` policy: the best-effort pool's MBA limit.
//!
//! Problem: a streaming best-effort job can push a latency-critical service over its
//! target through memory bandwidth alone; throttling the pool (Intel MBA) may then be the
//! cheapest way to meet the target, cheaper than more cores or ways. Throttling costs the
//! pool throughput, so it is worth it only when the model says what it buys.
//!
//! Approach: each tick a few pool levels are candidates ([`pool_levels`]): the level in
//! force; under pressure (a CPU service measured over its margin, or last tick's needs not
//! fitting) a step down and the host's minimum; with no pressure and a throttled pool, a
//! step up. Every level is planned in full (searches and packing) with each service's
//! neighbour bandwidth as the pool would have it ([`pool_bw_at`]: as the pool's own
//! readings at the levels it ran under say a limit moves it, [`ThrottleCurve`], in
//! proportion before there are two; services sharing the pool's resctrl group are
//! searched at that MBA, through the model's `mba_cand`), and the level whose packing
//! costs least, with [`throttle_cost`] added, wins. Planning a level
//! costs about as much as an ordinary tick, so a third level is planned only where it is
//! likely to be chosen. When every service fits at the level in force, the step down comes
//! next and the minimum only while the descent helps ([`descend_further`]: a step down
//! that fits everyone and costs more ends it). When a service is short there (overload),
//! the minimum comes next and the step down only where the minimum does not settle it
//! ([`step_could_win`]). Both rules are heuristics: they assume what a throttle costs grows
//! faster with each step than what it buys, and that no service does better with more
//! neighbour bandwidth, which the model and the packer do not guarantee (whole cores, a
//! fixed charge per change). On the Gold `few-closids` (then with 16 CLOSIDs; it keeps its
//! 4 there since) they left 9 of 600 ticks planning three levels instead of 143, and 8
//! services all over their targets plan two instead of three; the level chosen is the same
//! as with every level planned in every tick of every run of the bench (the simulated
//! figures are unchanged). Levels are the platform's MBA steps ([`round_mba`]: multiples
//! of `mba_gran_pct`, at least `mba_min_pct`).
//!
//! A step up that would win or tie but for the charge of changing the limit is taken once
//! it has done so for `shrink_after` ticks in a row with no pressure
//! (`MlPolicy::lift_after_a_while`): a measured throttle can cost the pool less per tick
//! than the charge, or nothing at all as the pool's readings have it, and would then stay
//! for good however little it buys.
//!
//! A raise that hurt is remembered ([`MbaCliff`]): when the pool's limit went up and a CPU
//! service was measured past its margin under the new limit, that limit is the pool's
//! cliff, and no step up reaches it again while the services it hurt carry at least
//! [`CLIFF_LOAD`] of their loads then and the pool streams at least that fraction of its
//! bandwidth per MBA point then. Without it the pool climbs back to the same limit as soon
//! as the pressure is gone, and the service misses its target again: a sawtooth (seen on
//! the E5 `mba-stream`). A cliff must
//! be confirmed by the next reading ([`MbaCliff::settle`]): when the pool is still at the
//! limit and every service it hurt is back within its margin, the reading that found it was
//! noise, and it is forgotten. Without that, one noisy reading right after a raise can cap
//! the pool's limit for the rest of a run.
//!
//! Properties: without a bandwidth reading for the pool (no RDT monitoring, or a reading
//! missing more than [`super::state::MAX_STALE_TICKS`] ticks in a row) or without CPU
//! best-effort jobs the pool is not throttled (a throttled one is released): nothing is
//! guessed. A level other than the one in force is taken only when the model vouches for
//! at least as many services there (fallbacks count against it), so a model unsure of
//! throttled neighbours falls back to not throttling.

use std::collections::BTreeMap;

use cohabit_core::{HostCapacity, Observation, MBA_MAX_PCT};

use super::state::CLIFF_LOAD;

/// Cost weight of the pool's lost throughput, relative to its share of the cores: a pool
/// whose bandwidth falls by a fraction `f` loses about `f` of a bandwidth-bound job's
/// throughput.
const LOSS_WEIGHT: f64 = 1.0;

/// A pool MBA limit under which some CPU service was measured past its margin right after
/// the pool was raised to it.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct MbaCliff {
    /// The limit that hurt.
    pub(super) level: u8,
    /// Each service measured past its margin there, with its requests per second (`None`:
    /// not measured, the cliff binds whatever its load).
    pub(super) hurt: Vec<(String, Option<f64>)>,
    /// The pool's bandwidth per MBA point then (bytes/s).
    pub(super) bw_per_pct: Option<f64>,
    /// Whether a later reading confirmed it ([`MbaCliff::settle`]).
    pub(super) confirmed: bool,
}

impl MbaCliff {
    /// The cliff found this tick, if any: the pool's limit in force `now` was raised from
    /// `before` (last tick's) and `over_margin` lists the CPU services measured past their
    /// margin with their loads.
    pub(super) fn found(
        before: u8,
        pool: &PoolBw,
        over_margin: Vec<(String, Option<f64>)>,
    ) -> Option<Self> {
        (pool.mba_now > before && !over_margin.is_empty()).then(|| Self {
            level: pool.mba_now,
            hurt: over_margin,
            bw_per_pct: pool.bw_now.map(|bw| bw / f64::from(pool.mba_now.max(1))),
            confirmed: false,
        })
    }

    /// The cliff as the reading after the one that found it leaves it: forgotten when the
    /// pool is still at the limit (`pool`) and no service it hurt is past its margin now
    /// (`over_margin`: the reading that found it was noise, or the service was grown past
    /// it), confirmed otherwise (still hurt, or the pool was throttled below the limit and
    /// the limit cannot be judged again). A confirmed cliff stays as it is.
    pub(super) fn settle(
        self,
        pool: &PoolBw,
        over_margin: &[(String, Option<f64>)],
    ) -> Option<Self> {
        if self.confirmed {
            return Some(self);
        }
        let still_hurt = self
            .hurt
            .iter()
            .any(|(name, _)| over_margin.iter().any(|(n, _)| n == name));
        (still_hurt || pool.mba_now != self.level).then_some(Self {
            confirmed: true,
            ..self
        })
    }

    /// Whether the cliff binds: every service it hurt that is still measured carries at
    /// least [`CLIFF_LOAD`] of its load then (or either load is unknown), and so does the
    /// pool's bandwidth per MBA point. `load` gives a service's requests per second now.
    pub(super) fn binds(&self, pool: &PoolBw, load: impl Fn(&str) -> Option<f64>) -> bool {
        let heavy = |now: Option<f64>, then: Option<f64>| match (now, then) {
            (Some(n), Some(t)) => n >= CLIFF_LOAD * t,
            _ => true,
        };
        let pool_now = pool.bw_now.map(|bw| bw / f64::from(pool.mba_now.max(1)));
        self.hurt
            .iter()
            .any(|(name, then)| heavy(load(name), *then))
            && heavy(pool_now, self.bw_per_pct)
    }
}

/// `pct` rounded down to the host's MBA steps (multiples of `mba_gran_pct`), at least
/// `mba_min_pct` and at most 100.
pub(super) fn round_mba(host: &HostCapacity, pct: f64) -> u8 {
    let gran = f64::from(host.mba_gran_pct.max(1));
    let min = f64::from(host.mba_min_pct.clamp(1, MBA_MAX_PCT));
    let stepped = (pct / gran).floor() * gran;
    let v = stepped.clamp(min, f64::from(MBA_MAX_PCT));
    // Within 1..=100 by the clamp.
    u8::try_from(cohabit_core::whole(v)).unwrap_or(MBA_MAX_PCT)
}

/// What the pool's bandwidth is as far as the policy can tell.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct PoolBw {
    /// The pool's MBA limit in force.
    pub(super) mba_now: u8,
    /// The best-effort jobs' measured bandwidth (bytes/s), summed; `None` when some CPU
    /// job has no reading.
    pub(super) bw_now: Option<f64>,
    /// The host's peak bandwidth (bytes/s).
    pub(super) peak: f64,
    /// The pool's share of the host's cores in force.
    pub(super) cores_frac: f64,
}

impl PoolBw {
    /// The pool as observed in `obs` on `host`.
    pub(super) fn observed(obs: &Observation, host: &HostCapacity) -> Self {
        let cpu_jobs: Vec<Option<f64>> = obs
            .best_effort()
            .filter(|o| o.spec.gpu.is_none())
            .map(|o| o.sample.mem_bw_bytes_per_s)
            .collect();
        let bw_now = if cpu_jobs.is_empty() {
            None
        } else {
            cpu_jobs.into_iter().sum::<Option<f64>>()
        };
        Self {
            mba_now: obs.current.best_effort.mba_pct,
            bw_now,
            peak: host.mem_bw_bytes_per_s.max(1.0),
            cores_frac: f64::from(obs.current.best_effort.cores) / f64::from(host.cores.max(1)),
        }
    }
}

/// How the pool's bandwidth answered each MBA limit it ran under, learnt online: the
/// bandwidth per pool core last measured at each level (smoothed), so that a level's
/// effect is read from the host rather than assumed.
///
/// Why: a limit caps each core's memory rate at a share of its peak, so the bandwidth a
/// limit leaves is proportional to the limit only for a job at the cap; a job that asks
/// for less, or that a saturated memory system already slows, loses less to a throttle
/// and gains less from a release (the kernel's `mba_MBps` controller exists because the
/// percentage is not a bandwidth). On the Gold `demo` the pool streamed 40 GB/s on 40
/// cores at 10 %, against 63 GB/s at 100 %: not a tenth. Scaled in proportion, 30 % looked
/// like the host's peak beside the services, the model was unsure of both there, and the
/// pool stayed at 10 % for the last 330 s of the run.
///
/// A level never measured is read off the two levels measured around it (on a delay
/// curve, [`between`]), and in proportion beyond the last one measured (the prior, and all there is before the
/// pool ran under a second level). Whatever was measured, a cut is predicted to leave at
/// least its share of the bandwidth and at most all of it, and a raise to add at most its
/// share: what a per-core cap allows.
#[derive(Debug, Clone, Default, PartialEq)]
pub(super) struct ThrottleCurve {
    /// Bandwidth per pool core (bytes/s) at each level measured.
    per_core: BTreeMap<u8, f64>,
}

/// The bandwidth per core at `level` between two levels measured, `(l0, v0)` and
/// `(l1, v1)`, on a throttle that delays memory requests (as MBA does): the time a core
/// spends per byte is its own (`a`) plus the throttle's delay, which grows as the limit
/// falls (`b / level`), so `1 / bw = a + b / level` through both points. A job at the cap
/// (`a = 0`) gets its share in proportion; one that asks for little gets about the same at
/// every level. Fitted on the E5 `mba-stream` pool's readings at 10 % and 100 % (0.93 and
/// 2.44 GB/s per core) it gives 1.72 at 30 %, where 1.77 was measured; a straight line
/// gives 1.26. Readings that do not fit the form (a faster core at a lower limit) give a
/// straight line between them.
fn between((l0, v0): (u8, f64), (l1, v1): (u8, f64), level: u8) -> f64 {
    if l1 <= l0 {
        return v0;
    }
    let (x0, x1, x) = (f64::from(l0), f64::from(l1), f64::from(level));
    let line = v0 + (v1 - v0) * (x - x0) / (x1 - x0);
    if v0 <= 0.0 || v1 <= 0.0 || v1 < v0 {
        return line;
    }
    let b = (1.0 / v0 - 1.0 / v1) / (1.0 / x0 - 1.0 / x1);
    let a = 1.0 / v0 - b / x0;
    let inv = a + b / x;
    if a < 0.0 || inv <= 0.0 {
        line
    } else {
        1.0 / inv
    }
}

/// Weight of a new reading in [`ThrottleCurve`]'s per-level average.
const CURVE_WEIGHT: f64 = 0.5;

impl ThrottleCurve {
    /// Learns the pool's reading `bw` (bytes/s) on `cores` cores at its limit `level`.
    pub(super) fn record(&mut self, level: u8, bw: f64, cores: u32) {
        if cores == 0 || !bw.is_finite() || bw <= 0.0 {
            return;
        }
        let now = bw / f64::from(cores);
        self.per_core
            .entry(level)
            .and_modify(|v| *v += CURVE_WEIGHT * (now - *v))
            .or_insert(now);
    }

    /// The curve at `level`: measured, between two levels measured ([`between`]), or in
    /// proportion beyond the nearest one; `None` before any reading.
    fn at(&self, level: u8) -> Option<f64> {
        let below = self.per_core.range(..=level).next_back();
        let above = self.per_core.range(level..).next();
        match (below, above) {
            (Some((&l0, &v0)), Some((&l1, &v1))) => Some(between((l0, v0), (l1, v1), level)),
            (Some((&l, &v)), None) | (None, Some((&l, &v))) => {
                Some(v * f64::from(level) / f64::from(l.max(1)))
            }
            (None, None) => None,
        }
    }

    /// The factor the pool's bandwidth at `now` is multiplied by at `level`, cores held.
    pub(super) fn ratio(&self, now: u8, level: u8) -> f64 {
        let share = f64::from(level) / f64::from(now.max(1));
        let learnt = match (self.at(now), self.at(level)) {
            (Some(a), Some(b)) if a > 0.0 => b / a,
            _ => share,
        };
        if level >= now {
            learnt.clamp(1.0, share)
        } else {
            learnt.clamp(share, 1.0)
        }
    }
}

/// The pool's bandwidth (bytes/s) at MBA `level`, from `bw` measured at `now`, as `curve`
/// says the limit moves it ([`ThrottleCurve::ratio`]; in proportion before anything was
/// learnt), capped at the host's `peak` when raised.
pub(super) fn pool_bw_at(curve: &ThrottleCurve, bw: f64, now: u8, level: u8, peak: f64) -> f64 {
    let scaled = bw * curve.ratio(now, level);
    if level >= now {
        scaled.min(peak.max(bw))
    } else {
        scaled
    }
}

/// Smallest growth of the pool's cores that the services are planned again for: a core
/// more for a pool of twenty streams 5 % more, within what the model tells apart.
const MIN_GROWTH: f64 = 1.1;

/// How many times its bandwidth at MBA `level` the pool would stream on the cores
/// `planned` rather than on its cores in force `now`, when the pool has a bandwidth reading
/// and that grows by at least [`MIN_GROWTH`]; 1 otherwise (without a reading nothing is
/// guessed). With cores now, the cores' ratio (a streaming job's bandwidth is per core).
/// Without cores now there is no rate of its own to scale: the planned cores at the rate
/// per core `curve` learnt at `level`, over what it streams now at `level`; 1 before any
/// rate was learnt. (Before this, a pool without cores was never planned for: on the Gold
/// `mba-stream` memcached gave 15 cores back to a pool that had none at 50 %, which then
/// streamed 29 GB/s, and timed out the next interval.)
pub(super) fn growth(
    pool: &PoolBw,
    curve: &ThrottleCurve,
    level: u8,
    now: u32,
    planned: u32,
) -> f64 {
    let Some(bw) = pool.bw_now.filter(|bw| *bw > 0.0) else {
        return 1.0;
    };
    let g = if now > 0 {
        f64::from(planned) / f64::from(now)
    } else {
        let at = pool_bw_at(curve, bw, pool.mba_now, level, pool.peak);
        match curve.at(level) {
            Some(rate) if at > 0.0 => f64::from(planned) * rate / at,
            _ => 1.0,
        }
    };
    if g >= MIN_GROWTH {
        g
    } else {
        1.0
    }
}

/// The pool's bandwidth `bw` with its cores grown `growth` times: in proportion (a
/// streaming job's bandwidth is per core), at most the host's `peak`.
pub(super) fn pool_bw_grown(bw: f64, growth: f64, peak: f64) -> f64 {
    if growth <= 1.0 {
        return bw;
    }
    (bw * growth).min(peak.max(bw))
}

/// What a pool level costs the best-effort jobs beyond no throttle, in the packer's units
/// (share of the host's cores): the pool's share of the cores times the fraction of its
/// bandwidth, measured or estimated at 100 % (`curve`), that `level` takes away (a job's
/// bytes per instruction do not change with the limit, so its throughput falls with its
/// bandwidth).
pub(super) fn throttle_cost(pool: &PoolBw, curve: &ThrottleCurve, level: u8) -> f64 {
    let Some(bw) = pool.bw_now else {
        return 0.0;
    };
    let full = pool_bw_at(curve, bw, pool.mba_now, MBA_MAX_PCT, pool.peak);
    if full <= 0.0 {
        return 0.0;
    }
    let at = pool_bw_at(curve, bw, pool.mba_now, level, pool.peak);
    LOSS_WEIGHT * pool.cores_frac * ((full - at) / full).clamp(0.0, 1.0)
}

/// The pool levels planned this tick, the one in force first (see the module docs).
/// `pressure`: some service is over its margin or last tick's needs did not fit.
/// `ceiling`: a binding cliff's limit; no step up reaches it.
pub(super) fn pool_levels(
    host: &HostCapacity,
    pool: &PoolBw,
    pressure: bool,
    ceiling: Option<u8>,
) -> Vec<u8> {
    let now = pool.mba_now;
    if pool.bw_now.is_none() {
        // Nothing measured: never guess; a throttled pool is released.
        return vec![MBA_MAX_PCT];
    }
    let mut out = vec![now];
    if pressure {
        out.push(round_mba(host, f64::from(now) * 0.6));
        out.push(round_mba(host, f64::from(host.mba_min_pct)));
    } else if now < MBA_MAX_PCT {
        let gran = f64::from(host.mba_gran_pct.max(1));
        let mut up = round_mba(host, f64::from(now) + 2.0 * gran);
        if let Some(c) = ceiling.filter(|c| up >= *c) {
            up = round_mba(host, f64::from(c) - gran);
        }
        if up > now {
            out.push(up);
        }
    }
    let mut seen = Vec::with_capacity(out.len());
    for l in out {
        if !seen.contains(&l) {
            seen.push(l);
        }
    }
    seen
}

/// What one pool level came to, planned in full.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Outcome {
    /// Services short of their needs.
    pub(super) unmet: usize,
    /// Services on the fallback (a level where more are than at the level in force is not
    /// eligible).
    pub(super) fallbacks: usize,
    /// What the packing and the throttle cost the best-effort jobs.
    pub(super) cost: f64,
}

/// When every service fits at the level in force (`above`): whether the pool's bandwidth
/// is planned a step further down, below `last`, a step down from it. Yes when a service is
/// short at `last` (latency-critical before best effort: the pool may go down to the
/// minimum), or when the step cost less; no when it bought nothing and cost more, as a
/// further throttle then mostly does (the throttle's cost grows with every step, and what
/// the services gain from it shrinks: a heuristic, see the module docs).
pub(super) fn descend_further(above: Outcome, last: Outcome) -> bool {
    last.unmet > 0 || last.cost < above.cost
}

/// When a service is short of its needs at the level in force (overload), with the
/// minimum planned after it: whether the step down between them is planned too. Yes when
/// every service fits at the minimum (the step down may fit them for less) or the minimum
/// costs a service its model (more fallbacks than at the level in force: not eligible). No
/// when a service is still short at the minimum and it is eligible: the pool then gets the
/// minimum (latency-critical before best effort), and a step down, which leaves the
/// services less bandwidth, is assumed to leave no fewer of them short (no service does
/// better with more neighbour bandwidth; a heuristic, see the module docs).
pub(super) fn step_could_win(in_force: Outcome, minimum: Outcome) -> bool {
    minimum.unmet == 0 || minimum.fallbacks > in_force.fallbacks
}

#[cfg(test)]
mod tests {
    use super::super::tests::host;
    use super::*;

    fn pool(mba_now: u8, bw_now: Option<f64>) -> PoolBw {
        PoolBw {
            mba_now,
            bw_now,
            peak: 7e10,
            cores_frac: 0.5,
        }
    }

    #[test]
    fn levels_are_rounded_down_to_the_hosts_steps_and_never_below_its_minimum() {
        let h = HostCapacity {
            mba_min_pct: 10,
            mba_gran_pct: 10,
            ..host()
        };
        assert_eq!(round_mba(&h, 67.0), 60);
        assert_eq!(round_mba(&h, 3.0), 10);
        assert_eq!(round_mba(&h, 140.0), 100);
        // A coarser platform: 20 % steps from 20.
        let coarse = HostCapacity {
            mba_min_pct: 20,
            mba_gran_pct: 20,
            ..host()
        };
        assert_eq!(round_mba(&coarse, 59.0), 40);
        assert_eq!(round_mba(&coarse, 10.0), 20);
    }

    #[test]
    fn a_pool_without_a_bandwidth_reading_is_never_throttled() {
        // Throttled to 50 with no reading: released to 100, even under pressure.
        assert_eq!(pool_levels(&host(), &pool(50, None), true, None), vec![100]);
        assert_eq!(
            throttle_cost(&pool(50, None), &ThrottleCurve::default(), 10),
            0.0
        );
    }

    #[test]
    fn under_pressure_a_step_down_and_the_minimum_are_tried_beside_the_level_in_force() {
        assert_eq!(
            pool_levels(&host(), &pool(100, Some(3e10)), true, None),
            vec![100, 60, 10]
        );
        // Without pressure an unthrottled pool stays; a throttled one may step up 2 steps.
        assert_eq!(
            pool_levels(&host(), &pool(100, Some(3e10)), false, None),
            vec![100]
        );
        assert_eq!(
            pool_levels(&host(), &pool(60, Some(3e10)), false, None),
            vec![60, 80]
        );
    }

    fn outcome(unmet: usize, fallbacks: usize, cost: f64) -> Outcome {
        Outcome {
            unmet,
            fallbacks,
            cost,
        }
    }

    #[test]
    fn the_descent_goes_on_while_a_service_is_short_or_the_last_step_helped() {
        // Everyone fits at both, and the step down cost more (or as much): stop.
        assert!(!descend_further(outcome(0, 0, 0.65), outcome(0, 0, 0.84)));
        assert!(!descend_further(outcome(0, 0, 0.65), outcome(0, 0, 0.65)));
        // It cost less: go on.
        assert!(descend_further(outcome(0, 0, 0.84), outcome(0, 0, 0.65)));
        // Someone is short at the step, whatever the cost: go on (down to the minimum).
        assert!(descend_further(outcome(0, 0, 0.65), outcome(1, 0, 0.84)));
    }

    #[test]
    fn in_overload_the_step_down_is_planned_only_where_it_could_be_chosen() {
        let in_force = outcome(1, 0, 0.65);
        // Still short at the minimum, as many fallbacks as in force: the minimum it is.
        assert!(!step_could_win(in_force, outcome(1, 0, 1.1)));
        assert!(!step_could_win(outcome(3, 2, 0.6), outcome(2, 1, 1.1)));
        // Everyone fits at the minimum: a step down may fit them for less.
        assert!(step_could_win(in_force, outcome(0, 0, 1.1)));
        // The minimum costs a service its model: not eligible, so the step down is needed.
        assert!(step_could_win(in_force, outcome(1, 1, 1.1)));
    }

    #[test]
    fn a_step_up_stops_below_a_binding_cliff() {
        // At 30 the step up is 50; a cliff at 50 caps it at 40, one at 40 at 30: none.
        let p = pool(30, Some(1e10));
        assert_eq!(pool_levels(&host(), &p, false, Some(50)), vec![30, 40]);
        assert_eq!(pool_levels(&host(), &p, false, Some(40)), vec![30]);
        assert_eq!(pool_levels(&host(), &p, false, Some(90)), vec![30, 50]);
        // Under pressure the steps down are unchanged.
        assert_eq!(pool_levels(&host(), &p, true, Some(40)), vec![30, 10]);
    }

    #[test]
    fn a_raise_followed_by_a_service_past_its_margin_is_a_cliff_that_binds_under_load() {
        let raised = pool(50, Some(1e10));
        let hurt = vec![("memcached".to_string(), Some(1000.0))];
        // Not raised (30 → 50 is; 50 → 50 is not), or nobody hurt: no cliff.
        assert_eq!(MbaCliff::found(50, &raised, hurt.clone()), None);
        assert_eq!(MbaCliff::found(30, &raised, vec![]), None);
        let c = MbaCliff::found(30, &raised, hurt).expect("a cliff");
        assert_eq!(c.level, 50);
        // 2e8 bytes/s per point then.
        assert!((c.bw_per_pct.unwrap() - 2e8).abs() < 1.0);
        // At 95 % of memcached's load it binds; at 85 % not; unmeasured it does.
        assert!(c.binds(&raised, |_| Some(950.0)));
        assert!(!c.binds(&raised, |_| Some(850.0)));
        assert!(c.binds(&raised, |_| None));
        // A pool streaming less per point (a job that stopped streaming): it does not.
        let calm = pool(50, Some(5e9));
        assert!(!c.binds(&calm, |_| Some(1000.0)));
    }

    #[test]
    fn a_cliff_the_next_reading_does_not_confirm_is_forgotten() {
        let at_50 = pool(50, Some(1e10));
        let hurt = vec![("memcached".to_string(), Some(1000.0))];
        let found = MbaCliff::found(30, &at_50, hurt.clone()).expect("a cliff");
        assert!(!found.confirmed);
        // Still at 50 and memcached back within its margin (another service past its own
        // is not the one hurt): noise, forgotten.
        let other = vec![("moses".to_string(), Some(10.0))];
        assert_eq!(found.clone().settle(&at_50, &other), None);
        assert_eq!(found.clone().settle(&at_50, &[]), None);
        // Still past its margin there: confirmed, and then kept whatever comes.
        let kept = found.clone().settle(&at_50, &hurt).expect("confirmed");
        assert!(kept.confirmed);
        assert_eq!(kept.level, 50);
        assert_eq!(kept.clone().settle(&at_50, &[]), Some(kept.clone()));
        // Throttled below 50 since: the limit was not read again, so it stays.
        let below = pool(30, Some(6e9));
        assert!(found.settle(&below, &[]).is_some_and(|c| c.confirmed));
    }

    #[test]
    fn the_pools_bandwidth_scales_with_its_limit_up_to_the_hosts_peak() {
        // 2e10 at 50 %: 1e10 at 25 %, 4e10 at 100 %; 6e10 at 50 % cannot reach 1.2e11.
        let none = ThrottleCurve::default();
        assert!((pool_bw_at(&none, 2e10, 50, 25, 7e10) - 1e10).abs() < 1.0);
        assert!((pool_bw_at(&none, 2e10, 50, 100, 7e10) - 4e10).abs() < 1.0);
        assert!((pool_bw_at(&none, 6e10, 50, 100, 7e10) - 7e10).abs() < 1.0);
    }

    #[test]
    fn throttling_costs_the_pools_share_of_cores_times_the_bandwidth_taken() {
        // Half the cores, at 100 % now: 60 % takes 40 % of its bandwidth: 0.5 × 0.4.
        let p = pool(100, Some(3e10));
        let none = ThrottleCurve::default();
        assert!((throttle_cost(&p, &none, 60) - 0.2).abs() < 1e-9);
        assert_eq!(throttle_cost(&p, &none, 100), 0.0);
        // A pool that uses no bandwidth loses nothing.
        assert_eq!(throttle_cost(&pool(100, Some(0.0)), &none, 10), 0.0);
        // A pool measured to lose only a third of its bandwidth per core at 60 %.
        let mut learnt = ThrottleCurve::default();
        learnt.record(100, 3e10, 10);
        learnt.record(60, 2e10, 10);
        assert!((throttle_cost(&p, &learnt, 60) - 0.5 / 3.0).abs() < 1e-9);
    }

    #[test]
    fn a_limit_moves_the_pools_bandwidth_as_measured_at_the_levels_around_it() {
        // Gold `demo`: 32 GB/s on 12 cores at 100 %, 40 GB/s on 40 cores at 10 %.
        let mut c = ThrottleCurve::default();
        c.record(100, 32e9, 12);
        c.record(10, 40e9, 40);
        // 30 % from 10 %: 1.86 GB/s per core on the delay curve through 1.0 and 2.67, so
        // 74 GB/s on the 40 cores, not 3 times the reading.
        let at30 = pool_bw_at(&c, 40e9, 10, 30, 9.4e10);
        assert!((at30 / 40.0 - 1.862e9).abs() < 1e6, "{at30}");
        // In proportion that was 120 GB/s, over the host's peak.
        let none = ThrottleCurve::default();
        assert!((pool_bw_at(&none, 40e9, 10, 30, 9.4e10) - 9.4e10).abs() < 1.0);
        // A cut from 100 % to 10 % leaves 0.37 of the bandwidth, not a tenth.
        assert!((c.ratio(100, 10) - 1e9 / (32e9 / 12.0)).abs() < 1e-9);
        // Beyond the levels measured: in proportion from the nearest one.
        assert!((c.ratio(10, 5) - 0.5).abs() < 1e-9);
        // Readings are averaged per level: a second one at 10 % moves it halfway.
        c.record(10, 60e9, 40);
        assert!((c.at(10).unwrap() - 1.25e9).abs() < 1.0);
    }

    #[test]
    fn between_two_levels_the_curve_is_a_delay_added_to_the_cores_own_time_per_byte() {
        // E5 `mba-stream`: 0.93 GB/s per core at 10 %, 2.44 at 100 %; 1.77 measured at 30 %.
        let v = between((10, 0.93e9), (100, 2.44e9), 30);
        assert!((v - 1.72e9).abs() < 0.01e9, "{v}");
        // A job at the cap: in proportion.
        assert!((between((10, 1e9), (100, 10e9), 40) - 4e9).abs() < 1.0);
        // A job that asks for little: the same everywhere.
        assert!((between((10, 1e9), (100, 1e9), 40) - 1e9).abs() < 1.0);
        // Readings the form cannot take (less per core at the higher level): a line.
        assert!((between((10, 2e9), (100, 1e9), 55) - 1.5e9).abs() < 1.0);
    }

    #[test]
    fn whatever_was_measured_a_cut_never_adds_bandwidth_and_a_raise_adds_at_most_its_share() {
        // Readings taken at different core counts (a saturated memory system) can put
        // more per core at a lower level: a raise is then predicted to add nothing.
        let mut c = ThrottleCurve::default();
        c.record(30, 3e9, 5);
        c.record(100, 1.5e9, 40);
        assert_eq!(c.ratio(30, 100), 1.0);
        assert_eq!(c.ratio(100, 30), 1.0);
        // And a raise never adds more than its share, a cut never leaves less.
        let mut steep = ThrottleCurve::default();
        steep.record(50, 1e8, 10);
        steep.record(100, 1e10, 10);
        assert!((steep.ratio(50, 100) - 2.0).abs() < 1e-12);
        assert!((steep.ratio(100, 50) - 0.5).abs() < 1e-12);
        // Nothing learnt, or nothing sensible at the level in force: in proportion.
        assert!((ThrottleCurve::default().ratio(50, 20) - 0.4).abs() < 1e-12);
        let mut zero = ThrottleCurve::default();
        zero.record(50, 0.0, 10);
        assert!((zero.ratio(50, 100) - 2.0).abs() < 1e-12);
    }
}
