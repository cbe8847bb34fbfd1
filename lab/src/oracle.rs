//! `oracle`: the best allocation the simulator's ground truth allows. Simulator only.
//!
//! Problem: for the coming interval, find the allocation that meets the most latency
//! targets (in the overload order of docs/DESIGN.md 5: higher `priority` first, then the
//! most services) and, among those, leaves the most to best-effort jobs, knowing the true
//! loads and the true physics.
//!
//! Search space (what "bound" means here). Every plan the oracle considers:
//! - gives each latency-critical service a whole number of cores (at least one);
//! - places each service in one of four ways: in a *way range of its own*, in a range
//!   *shared with other latency-critical services* (any pair of services, or all of them
//!   together: identical contiguous CAT masks, one resctrl group), in the *best-effort
//!   pool's range and group* (taking the pool's MBA), or, beside a throttled pool, in the
//!   pool's range *in a group of its own at full bandwidth* (one group for all such
//!   services, as `ml` places a cache-insensitive service); ranges of their own or shared
//!   are contiguous, from way 0 up, and the pool keeps the ways above them (at least one
//!   when a CPU job runs, or, where no packing of the services to satisfy leaves it one, the
//!   top way, shared with the last range, as `layout` lays out any plan that takes every
//!   way);
//! - sets the best-effort pool's MBA to any step the platform allows (`mba_min_pct` up to
//!   100 in `mba_gran_pct` steps) when a best-effort CPU job moves enough memory traffic for
//!   MBA to matter (over 2 % of the socket's bandwidth at 100 %), 100 % otherwise;
//!   latency-critical groups stay at 100 % (within the simulator's physics a throttle on an
//!   LC group never lowers its own p99, and the memory latency it would relieve is cheaper
//!   to relieve by throttling the pool);
//! - uses at most the host's CLOSIDs (`HostCapacity::closids - 1` groups, the pool's
//!   included): every range of its own or shared is one group, services in the pool's group
//!   cost none;
//! - gives each GPU service a share in 5 % steps per interval, and a GPU job what they leave
//!   (chosen for the whole run at once, as below).
//!
//! Approach: with the memory latency, the GPU interference and the LLC a service would hold
//! in the pool's range frozen at their values under a reference plan, a service's p99
//! depends only on its own cores and the LLC it holds, and is non-increasing in both. The
//! LLC a range shared by several services gives each of them is their LRU split by miss rate
//! (a short fixed point); at a given load a latency-critical service's miss rate does not
//! depend on its cores, so a binary search on cores per member finds each option's fewest
//! cores. A dynamic programme over subsets of services × ways used (× groups used, when the
//! CLOSIDs bind) then packs one option per service at the fewest cores for every way count,
//! and the pool's value (cores left × best-effort progress per core at the pool's ways and
//! MBA) picks among them; the packings that leave the pool as many cores as the one it
//! picks are verified too (the value cannot see how the ways they split move the memory
//! latency the pool's jobs see), and the best verified is kept, while the picked one's
//! verification alone decides whether the search goes on (on the E5 `load-spike` the
//! picked packing fell short where a tie met both targets, and the search went on and
//! settled on a core less for the pool). When not every service can meet its target, the sets of services
//! to satisfy are tried in overload order (highest-priority counts first, then the most
//! services) and the first score any set reaches wins, the best-effort value deciding among
//! sets with the same score; services left out get, on the pool's ways (in its group, or at
//! full bandwidth in one of their own beside a throttled pool where a CLOSID is left), the
//! fewest cores that meet the bare target where some do, else that bring their p99 within
//! 5 % of what every free core would (LC before BE). A full evaluation verifies the result;
//! if the frozen latency was optimistic (fewer services meet than planned), the plan is
//! also *repaired*: cores move from the pool to the planned services that missed, as few as
//! reach the planned score (a binary search, each step verified), since a plan that gives
//! the pool fewer cores lowers the memory latency for everyone, which no later round, frozen
//! at the latency the failed plan measured, can see (on a diurnal crowded Gold the oracle
//! met five targets of six where `ml`, its pool on no cores of its own, met six). The
//! search then repeats with the measured latency and a tighter
//! margin (up to [`ROUNDS`] rounds), keeping the best verified plan. That raise is a guess
//! and often far more than needed (the latency measured under a plan that gave a streaming
//! pool many cores, so the next round gives the pool none): once a round verifies after one
//! that fell short, [`BISECT_STEPS`] bisection steps on the share of the raise (latency and
//! margin together) look for the plan in between, every verified one kept (without them,
//! on the E5 `mba-stream` an oracle aiming under the targets left best effort more than the
//! bound: no bound). This runs once per pool MBA step, and, when shared ranges are
//! allowed, once more per step without them; the best verified (score, best-effort
//! throughput) wins. The second search is there because the frozen-latency search is a
//! heuristic: on the E5 `mba-stream` the search with shared ranges preferred memcached and
//! moses in one range, which verified with less best effort than the layout without sharing
//! that the restricted search found and it never tried. A plan of the no-share oracle is
//! now never lost. When the best verified plan still misses a target, one more round runs
//! at the bare targets (margin 1): a service that can reach only between the first
//! margin and its target is out of every round at that margin (on `gpu-inference` the
//! classifier was left out and missed while `ml` met it).
//! Repair, the bare round and serving a left-out service up to its bare target belong to
//! the bound only: an oracle that aims further under the targets (`target_fraction` below
//! the default) promises that margin and keeps it.
//!
//! GPU shares are planned once for the whole run, interval by interval, by a dynamic
//! programme over the run's loads that pays the MPS restart of every share it changes
//! ([`gpu`] has the details); each interval's CPU search then plans with the shares in
//! effect and the restart downtime of that interval, as the simulated host will have them
//! (with one split held for the whole run, `ml`, moving shares, met more targets than the
//! oracle on `gpu-llm-crowd`: issue 49).
//!
//! Properties: within the search space and the frozen-latency model, the plan meets the most
//! targets in overload order and then leaves best effort the most; every plan fits the
//! host's cores, ways and CLOSIDs, and every MBA value is a platform step. The bound is not
//! exact outside the frozen-latency model (verification catches optimism, never pessimism)
//! nor for range layouts outside the space (overlapping unequal ranges other than the
//! pool's top way, shared ranges of three or more services short of all of them); a test
//! runs every policy against it on crowded scenarios. Search time (issue 49): the range
//! options, which depend only on the frozen latency, margin and GPU interference, are
//! computed once per search for every subspace that freezes the same values (the first
//! round of every MBA step and sharing mode: 20 subspaces on the Gold); every later round
//! freezes at least what an earlier one did, so the fewest cores found there bound its own
//! from below and each binary search starts at them (`Answers`); a shared range's cache
//! split asks for misses only (no queue model, most of an evaluation's cost); each binary
//! search on cores also starts from the answer with a way less; the packing looks only at
//! the options that place the lowest member still to place. Same plans, fewer evaluations
//! (docs/RESULTS.md, "GPU overload and the oracle as a bound"). Cost: per pool MBA step,
//! sharing mode and round (at most `ROUNDS + BISECT_STEPS`, and one at the bare targets),
//! O(B·W·log C) closed-form evaluations for the B = n + n(n−1)/2 + 1 range options, a
//! packing over subsets (2ⁿ·W per set tried), and one full evaluation per plan verified
//! (more for a repair); `cohabit bench`
//! prints the measured search time. Up to 12 latency-critical services (masks are 32 bits;
//! beyond 12, only the set of every service that can meet its target alone is tried). A
//! search is skipped (one full evaluation instead) while the loads stay within 2 % of those
//! of the last search, the GPU shares and clients are those it planned with, and its plan
//! still reaches the same score.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use cohabit_core::{
    Allocation, DecisionPath, GroundTruth, Observation, Plan, Reason, WayRange, MBA_MAX_PCT,
};
use cohabit_sim::world;
use cohabit_sim::TruthModel;

use cohabit_policy::{fair_shares, layout, Decision, HostContext, Policy, Share};

use evaluate::Evaluator;
use gpu::{GpuSchedule, GpuTick};
use pack::pack;

mod evaluate;
mod gpu;
mod pack;

/// Verification rounds per pool MBA step.
pub const ROUNDS: usize = 4;

/// Bisection steps between a round that fell short and the verified round after it.
pub const BISECT_STEPS: usize = 4;

/// Relative load drift under which a verified plan is kept without a new search.
const REUSE_TOLERANCE: f64 = 0.02;

/// Share of the socket's memory bandwidth the best-effort pool must move at 100 % MBA for
/// the search to try throttling it.
const MBA_WORTH_TRYING: f64 = 0.02;

/// How the oracle searches.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OracleConfig {
    /// Search the best-effort pool's MBA steps (else the pool stays at 100 %).
    pub search_mba: bool,
    /// Let latency-critical services share way ranges (else each has its own or the pool's).
    pub share_ways: bool,
    /// The fraction of each target the search aims under on the true p99 (its first
    /// round's margin; later rounds tighten it). 0.97 by default; a lower value shows what a
    /// controller's safety margin costs (`examples/be_gap.rs`).
    pub target_fraction: f64,
    /// Plan each interval for its own loads (the default: the bound). Without foresight the
    /// oracle plans for the loads of the interval that just ended, which is what any
    /// controller has measured when it decides (the first interval, with nothing measured
    /// yet, uses its own): the true physics without knowledge of the future, a reference for
    /// what a causal controller can reach (`examples/causal_bound.rs`).
    pub foresight: bool,
}

impl Default for OracleConfig {
    fn default() -> Self {
        Self {
            search_mba: true,
            share_ways: true,
            target_fraction: 0.97,
            foresight: true,
        }
    }
}

/// Services meeting their targets per priority level, highest priority first: compared
/// lexicographically, it is the overload order of docs/DESIGN.md 5.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Score(pub Vec<usize>);

/// The ground-truth oracle.
#[derive(Debug, Clone)]
pub struct OraclePolicy {
    ctx: HostContext,
    truth: TruthModel,
    cfg: OracleConfig,
    /// The GPU shares of every interval of the run ([`gpu`]).
    gpu: GpuSchedule,
    /// Those of the interval being planned.
    gpu_now: GpuTick,
    last: Option<Last>,
    /// The range options of the search under way, by what a round freezes ([`PlacementMemo`]).
    memo: RefCell<PlacementMemo>,
    /// The fewest cores of every range option found in the search under way ([`Answers`]).
    answers: RefCell<Vec<Answers>>,
}

/// Each member's fewest cores in every range (by members and ways) under one frozen state,
/// with the LLC the member holds there. The p99 does not fall as the memory latency, the GPU
/// interference or the aim (a tighter margin) rises, so under a state that freezes at least
/// this one's latency and interference and at most its margin, a member that holds the same
/// LLC needs at least as many cores (and none meets its target that did not here): the
/// binary search starts there. Every later round of a search freezes at least what its
/// first froze (the latency and interference only rise, the margin only tightens; the
/// bisection lies between two rounds), all but the round at the bare targets.
#[derive(Debug, Clone)]
struct Answers {
    latency: f64,
    margin: f64,
    interference: Vec<f64>,
    /// By (members, ways): each member's LLC (bits) and fewest cores.
    fewest: HashMap<(u32, u32), Vec<Answer>>,
}

/// A member's LLC (the bits of its bytes) and fewest cores in one range.
type Answer = (u64, Option<u32>);

impl Answers {
    /// Whether these answers bound those under `frozen` from below.
    fn below(&self, frozen: &Frozen) -> bool {
        self.latency <= frozen.latency
            && self.margin >= frozen.margin
            && self
                .interference
                .iter()
                .zip(&frozen.interference)
                .all(|(a, b)| a <= b)
    }
}

/// The range options of one search, by whether they include shared ranges and the frozen
/// memory latency, margin and GPU interference they were found under: they do not depend on the pool's MBA (a range's
/// group runs at full bandwidth) nor on the pool's cache, and a search without shared
/// ranges takes the single-service ones of the same set. The first round of every MBA
/// step and sharing mode freezes the same values (the quiet latency, the first margin):
/// on the Gold, 20 subspaces computed the same options 20 times.
type PlacementMemo = HashMap<(bool, (u64, u64, Vec<u64>)), Arc<[Placement]>>;

/// The last search: the loads it was for, and what it found.
#[derive(Debug, Clone)]
struct Last {
    loads: Vec<f64>,
    gpu: GpuTick,
    found: Found,
}

/// A verified plan.
#[derive(Debug, Clone)]
struct Found {
    plan: Plan,
    score: Score,
    be: f64,
    why: String,
}

impl Found {
    fn better_than(&self, other: &Found) -> bool {
        (&self.score, self.be) > (&other.score, other.be)
    }
}

/// What the search holds fixed in one round, per latency-critical service (index `k` in
/// configuration order among latency-critical services).
#[derive(Debug, Clone)]
struct Frozen {
    latency: f64,
    interference: Vec<f64>,
    pool_cache: Vec<f64>,
    margin: f64,
}

/// One round of a search: the plan the frozen model valued most with its evaluation, the
/// best plan the round verified, and the score the frozen model planned.
struct Round {
    chosen: Found,
    best: Found,
    planned: Score,
    check: world::Evaluation,
}

/// A plan that fell short of its round's score: the services it was to satisfy, what the
/// truth says of it, and the score planned.
struct Short<'a> {
    met: u32,
    truth: &'a GroundTruth,
    planned: &'a Score,
}

/// The part of the space one search covers: the pool's MBA, and whether latency-critical
/// services may share way ranges.
#[derive(Debug, Clone, Copy)]
struct Subspace {
    be_mba: u8,
    share_ways: bool,
}

/// Where a service is placed, and its cores.
#[derive(Debug, Clone, PartialEq)]
enum Place {
    /// A range of `ways` shared by the services of `members` (a bit mask; one bit: its own).
    Range { members: u32, ways: u32 },
    /// The pool's range and group.
    Pool,
    /// The pool's range in a group of its own at full bandwidth, when the pool is
    /// throttled (one group for every service placed so: one way range, one MBA).
    PoolWays,
}

/// One option of the packing: a placement of `members` with each member's cores.
#[derive(Debug, Clone)]
struct Placement {
    members: u32,
    place: Place,
    cores: Vec<(usize, u32)>,
}

impl Placement {
    fn total_cores(&self) -> u32 {
        self.cores.iter().map(|(_, c)| c).sum()
    }

    fn ways(&self) -> u32 {
        match self.place {
            Place::Range { ways, .. } => ways,
            Place::Pool | Place::PoolWays => 0,
        }
    }

    fn groups(&self) -> usize {
        usize::from(!matches!(self.place, Place::Pool))
    }
}

/// A packing of the services to satisfy: the options chosen, and the ways they use.
#[derive(Debug, Clone)]
struct Packing {
    options: Vec<Placement>,
    ways: u32,
    cores: u32,
}

impl OraclePolicy {
    /// An oracle over the physics of a scenario, searching its whole space.
    pub fn new(truth: TruthModel) -> Self {
        Self::with_config(truth, OracleConfig::default())
    }

    /// An oracle with a restricted search (to show what a dimension is worth).
    pub fn with_config(truth: TruthModel, cfg: OracleConfig) -> Self {
        let sc = truth.scenario();
        let ctx = HostContext {
            host: sc.capacity().clone(),
            specs: sc.specs(),
        };
        let mut me = Self {
            ctx,
            truth,
            cfg,
            gpu: GpuSchedule::default(),
            gpu_now: GpuTick::default(),
            last: None,
            memo: RefCell::new(PlacementMemo::new()),
            answers: RefCell::new(Vec::new()),
        };
        me.gpu = me.gpu_schedule();
        me.gpu_now = me.gpu_tick(0);
        me
    }

    /// The GPU shares of the run: the dynamic programme of [`gpu`] over the loads of every
    /// interval as the oracle plans for them, or else (too many splits) fixed greedy ones.
    fn gpu_schedule(&self) -> GpuSchedule {
        let loads = (0..self.truth.scenario().ticks())
            .map(|t| self.planned_loads(t * self.tick_ms()))
            .collect();
        gpu::plan(&self.truth, &self.ctx, &self.levels(), loads).unwrap_or_else(|| {
            GpuSchedule::fixed(&self.truth, &self.ctx, &self.greedy_gpu_shares())
        })
    }

    /// The GPU shares and clients of the interval that starts at `start_ms` (no GPU
    /// service: none, nobody restarting).
    fn gpu_tick(&self, start_ms: u64) -> GpuTick {
        let tick = usize::try_from(start_ms / self.tick_ms().max(1)).unwrap_or(usize::MAX);
        let n = self.truth.scenario().services.len();
        self.gpu.at(tick).cloned().unwrap_or_else(|| GpuTick {
            effective: vec![None; n],
            downtime_ms: vec![0.0; n],
            ..GpuTick::default()
        })
    }

    /// The loads the oracle plans the interval that starts at `start_ms` for: its own with
    /// foresight, else those of the interval just measured (before the first, its own).
    fn planned_loads(&self, start_ms: u64) -> Vec<f64> {
        let planned_ms = if self.cfg.foresight {
            start_ms
        } else {
            start_ms.saturating_sub(self.tick_ms())
        };
        let mid_s = (planned_ms as f64 + self.tick_ms() as f64 / 2.0) / 1000.0;
        self.truth.loads_at(mid_s)
    }

    /// Milliseconds each service's GPU client restarts in the interval being planned.
    fn downtime(&self) -> &[f64] {
        &self.gpu_now.downtime_ms
    }

    /// Whether the oracle is the bound (its plans are judged at the targets), not a search
    /// that promises a margin under them (`target_fraction` below the default, as
    /// `examples/be_gap.rs` runs it): only the bound repairs a plan that fell short, runs
    /// a round at the bare targets, and serves a service left out up to its bare target,
    /// all of which give plans without the margin.
    fn at_targets(&self) -> bool {
        self.cfg.target_fraction >= OracleConfig::default().target_fraction
    }

    fn tick_ms(&self) -> u64 {
        self.truth.scenario().tick_ms
    }

    /// Scenario indices of the latency-critical services, in configuration order.
    fn lc(&self) -> Vec<usize> {
        let sc = self.truth.scenario();
        (0..sc.services.len())
            .filter(|&i| sc.services[i].spec.is_latency_critical())
            .collect()
    }

    /// Distinct priorities of the latency-critical services, highest first.
    fn levels(&self) -> Vec<i32> {
        let mut p: Vec<i32> = self.ctx.latency_critical().map(|s| s.priority).collect();
        p.sort_unstable_by_key(|x| std::cmp::Reverse(*x));
        p.dedup();
        p
    }

    /// The score of a set of satisfied services (bit `k`: latency-critical service `k`).
    fn score_of_set(&self, met: u32) -> Score {
        let levels = self.levels();
        let mut counts = vec![0; levels.len()];
        for (k, s) in self.ctx.latency_critical().enumerate() {
            if met & (1 << k) != 0 {
                if let Some(l) = levels.iter().position(|p| *p == s.priority) {
                    counts[l] += 1;
                }
            }
        }
        Score(counts)
    }

    /// The score of a plan's ground truth.
    pub fn score_of(&self, truth: &GroundTruth) -> Score {
        let mut met = 0u32;
        for (k, s) in self.ctx.latency_critical().enumerate() {
            let target = s.p99_target_ms().unwrap_or(f64::INFINITY);
            if truth.p99_ms.get(&s.name).is_some_and(|p| *p <= target) {
                met |= 1 << k;
            }
        }
        self.score_of_set(met)
    }

    /// The GPU share each client runs at in the interval being planned.
    fn gpu_effective(&self) -> Vec<Option<u8>> {
        self.gpu_now.effective.clone()
    }

    /// The pool's published GPU share: what the latency-critical services on the busiest
    /// GPU leave.
    fn pool_gpu(&self) -> Option<u8> {
        self.gpu_now.pool
    }

    fn with_gpu(&self, mut shares: BTreeMap<String, Share>) -> BTreeMap<String, Share> {
        for (name, s) in &mut shares {
            if s.gpu_pct.is_some() {
                s.gpu_pct = self.gpu_now.published.get(name).copied().or(s.gpu_pct);
            }
        }
        shares
    }

    /// Smallest GPU share per GPU service (5 % steps) that meets 90 % of its target at the
    /// peak load of the run, with every other service at its own peak; services are served
    /// in overload order (priority, then the smallest need alone first), a GPU job last.
    fn greedy_gpu_shares(&self) -> BTreeMap<String, u8> {
        let sc = self.truth.scenario();
        let gpu_services: Vec<(String, i32)> = self
            .ctx
            .latency_critical()
            .filter(|s| s.gpu.is_some())
            .map(|s| (s.name.clone(), s.priority))
            .collect();
        if gpu_services.is_empty() {
            return BTreeMap::new();
        }
        let steps = cohabit_sim::whole(sc.duration_s);
        let peaks: Vec<f64> = (0..sc.services.len())
            .map(|i| {
                (0..steps)
                    .map(|t| sc.load_rps(i, t as f64 + 0.5))
                    .fold(0.0, f64::max)
            })
            .collect();
        let keep = u32::from(self.ctx.has_gpu_best_effort());
        let n = u32::try_from(gpu_services.len()).unwrap_or(1) + keep;
        let even = u8::try_from(100 / n.max(1)).unwrap_or(100);
        let mut shares: BTreeMap<String, u8> = gpu_services
            .iter()
            .map(|(s, _)| (s.clone(), even))
            .collect();
        // The smallest share meeting 90 % of the target at the peak, given the others.
        let need = |shares: &BTreeMap<String, u8>, name: &str, room: u8| -> Option<u8> {
            (5..=room.max(5)).step_by(5).find(|&pct| {
                let mut shares = shares.clone();
                shares.insert(name.to_string(), pct);
                let mut fair = fair_shares(&self.ctx);
                for (n, s) in &mut fair {
                    s.gpu_pct = shares.get(n).copied().or(s.gpu_pct);
                }
                let plan = layout(&self.ctx, &fair, MBA_MAX_PCT);
                let (_, truth) = self.truth.evaluate(
                    &plan,
                    &peaks,
                    &self.truth.gpu_shares(&plan),
                    &vec![0.0; peaks.len()],
                );
                let target = self
                    .ctx
                    .specs
                    .iter()
                    .find(|s| s.name == name)
                    .and_then(|s| s.p99_target_ms())
                    .unwrap_or(f64::INFINITY);
                truth.p99_ms.get(name).is_some_and(|p| *p <= 0.9 * target)
            })
        };
        // Overload order: priority, then the smallest need with the GPU to itself.
        let mut order: Vec<(String, i32, u8)> = gpu_services
            .iter()
            .map(|(name, prio)| {
                let mut alone: BTreeMap<String, u8> =
                    gpu_services.iter().map(|(s, _)| (s.clone(), 1)).collect();
                alone.insert(name.clone(), 100);
                (name.clone(), *prio, need(&alone, name, 100).unwrap_or(101))
            })
            .collect();
        order.sort_by(|a, b| b.1.cmp(&a.1).then(a.2.cmp(&b.2)));
        for _pass in 0..2 {
            for (name, _, _) in &order {
                // MPS shares are limits that can oversubscribe a GPU; the oracle keeps the
                // services' sum within it (and 1 % for training, if any).
                let others: u32 = shares
                    .iter()
                    .filter(|(n, _)| *n != name)
                    .map(|(_, p)| u32::from(*p))
                    .sum();
                let room = 100u32.saturating_sub(others + keep);
                let room = u8::try_from(room.max(5)).unwrap_or(100);
                let chosen = need(&shares, name, room).unwrap_or(room);
                shares.insert(name.clone(), chosen);
            }
        }
        shares
    }

    /// The pool's MBA values to try: every platform step when a CPU job moves enough
    /// memory traffic for a throttle to matter, else 100 % only.
    fn pool_mba_steps(&self, loads: &[f64], reference: &Plan) -> Vec<u8> {
        let cap = &self.ctx.host;
        if !self.cfg.search_mba || !self.ctx.has_cpu_best_effort() {
            return vec![MBA_MAX_PCT];
        }
        let mut full = reference.clone();
        full.best_effort.mba_pct = MBA_MAX_PCT;
        let (eval, _) = self
            .truth
            .evaluate(&full, loads, &self.gpu_effective(), self.downtime());
        let sc = self.truth.scenario();
        let be_bw: f64 = (0..sc.services.len())
            .filter(|&i| !sc.services[i].spec.is_latency_critical())
            .map(|i| eval.outcomes[i].mem_bw_bytes_per_s)
            .sum();
        if be_bw < MBA_WORTH_TRYING * cap.mem_bw_bytes_per_s {
            return vec![MBA_MAX_PCT];
        }
        mba_steps(cap.mba_min_pct, cap.mba_gran_pct)
    }

    /// The best verified plan over the pool's MBA steps, each searched with shared ranges
    /// and, when those are allowed, without them too: the search under a frozen latency is a
    /// heuristic, and a plan with shared ranges it prefers can verify with less best effort
    /// than one without that it then never tries (the E5 `mba-stream`: less best effort with
    /// shared ranges than with them turned off). Searching the restriction as
    /// well keeps the oracle at least as good as its no-share self.
    fn search(&self, loads: &[f64], reference: &Plan) -> Found {
        self.memo.borrow_mut().clear();
        self.answers.borrow_mut().clear();
        let start = self.start(loads, reference);
        let mut best: Option<Found> = None;
        let sharing: &[bool] = if self.cfg.share_ways {
            &[true, false]
        } else {
            &[false]
        };
        for be_mba in self.pool_mba_steps(loads, reference) {
            for &share_ways in sharing {
                let sub = Subspace { be_mba, share_ways };
                let found = self.search_at(loads, reference, &start, sub);
                if best.as_ref().is_none_or(|b| found.better_than(b)) {
                    best = Some(found);
                }
            }
        }
        best.expect("at least one MBA step")
    }

    /// What the first round freezes: the memory latency with the pool paused (a lower
    /// bound; verification raises it when the pool's bandwidth turns out to matter), the
    /// GPU interference, and the LLC each service holds when it alone moves into the
    /// reference plan's pool range (a full evaluation per service).
    fn start(&self, loads: &[f64], reference: &Plan) -> Frozen {
        let gpu_eff = self.gpu_effective();
        let zeros = self.downtime();
        let lc = self.lc();
        let mut quiet = reference.clone();
        quiet.best_effort.cores = 0;
        let (eval, _) = self.truth.evaluate(&quiet, loads, &gpu_eff, zeros);
        let pool_cache = lc
            .iter()
            .map(|&i| {
                let name = &self.ctx.specs[i].name;
                let mut moved = reference.clone();
                if let Some(a) = moved.services.get_mut(name) {
                    a.llc_ways = reference.best_effort.llc_ways;
                    a.mba_pct = reference.best_effort.mba_pct;
                }
                let (e, _) = self.truth.evaluate(&moved, loads, &gpu_eff, zeros);
                e.outcomes[i].llc_bytes
            })
            .collect();
        Frozen {
            latency: eval.mem_latency_ns,
            interference: lc
                .iter()
                .map(|&i| eval.outcomes[i].gpu_interference)
                .collect(),
            pool_cache,
            margin: self.cfg.target_fraction,
        }
    }

    /// The best verified plan within `sub`.
    fn search_at(&self, loads: &[f64], reference: &Plan, start: &Frozen, sub: Subspace) -> Found {
        let lc = self.lc();
        let mut frozen = start.clone();
        let mut best: Option<Found> = None;
        let mut keep = |found: &Found| {
            if best.as_ref().is_none_or(|b| found.better_than(b)) {
                best = Some(found.clone());
            }
        };
        // The last round whose plan fell short of what it planned.
        let mut failed: Option<Frozen> = None;
        for round in 0..ROUNDS {
            let Round {
                chosen,
                best: found,
                planned,
                check,
            } = self.try_round(loads, reference, &frozen, sub, round);
            keep(&found);
            if chosen.score >= planned {
                // Verified. The round before planned with less latency and a looser margin and
                // fell short; the raise that followed is a guess, often far more than needed
                // (a streaming pool's bandwidth moves the latency by a tenth, and the next
                // round gives the pool no cores at all). The best plan lies in between:
                // bisect on the share of the raise (every step, whatever the plans' best
                // effort suggests: pruning on it lost 15 % on the Gold `mba-stream`).
                if let Some(lo) = failed {
                    let (mut low, mut high) = (0.0, 1.0);
                    for step in 0..BISECT_STEPS {
                        let t = (low + high) / 2.0;
                        let mid = Frozen {
                            latency: lo.latency + t * (frozen.latency - lo.latency),
                            margin: lo.margin + t * (frozen.margin - lo.margin),
                            ..frozen.clone()
                        };
                        let r = self.try_round(loads, reference, &mid, sub, round + 1 + step);
                        keep(&r.best);
                        if r.chosen.score >= r.planned {
                            high = t;
                        } else {
                            low = t;
                        }
                    }
                }
                break;
            }
            failed = Some(frozen.clone());
            for (k, &i) in lc.iter().enumerate() {
                frozen.pool_cache[k] = frozen.pool_cache[k].min(check.outcomes[i].llc_bytes);
                frozen.interference[k] =
                    frozen.interference[k].max(check.outcomes[i].gpu_interference);
            }
            frozen.latency = frozen.latency.max(check.mem_latency_ns) * 1.02;
            frozen.margin *= 0.95;
        }
        // Some target missed: once more at the bare targets (the margin keeps a service
        // that only reaches 0.97 to 1.0 of its target out of every round that verifies:
        // on `gpu-inference` resnet-infer at 24.8 ms of 25 with two cores was left out and
        // missed with one, while `ml` met it). Verification catches what is optimistic.
        let all = self.score_of_set(u32::MAX);
        if self.at_targets() && best.as_ref().is_some_and(|b| b.score < all) {
            let bare = Frozen {
                margin: 1.0,
                ..frozen
            };
            let r = self.try_round(loads, reference, &bare, sub, ROUNDS + BISECT_STEPS);
            if best.as_ref().is_none_or(|b| r.best.better_than(b)) {
                best = Some(r.best);
            }
        }
        best.expect("at least one round")
    }

    /// One round under `frozen`, each of its plans verified by a full evaluation: the plan
    /// the frozen model values most (its verification decides what the search does next,
    /// with its evaluation), the best of all (kept, as every verified plan is), and the
    /// score the frozen model planned.
    fn try_round(
        &self,
        loads: &[f64],
        reference: &Plan,
        frozen: &Frozen,
        sub: Subspace,
        round: usize,
    ) -> Round {
        let gpu_eff = self.gpu_effective();
        let (plans, planned, met) = self.plan_round(loads, reference, frozen, sub);
        let mut checked = plans.into_iter().map(|plan| {
            let (check, truth) = self.truth.evaluate(&plan, loads, &gpu_eff, self.downtime());
            (self.verified(plan, &truth, sub.be_mba, round), check, truth)
        });
        let (chosen, check, truth) = checked.next().expect("a round plans at least one packing");
        let mut best = chosen.clone();
        for (found, ..) in checked {
            if found.better_than(&best) {
                best = found;
            }
        }
        if chosen.score < planned && self.at_targets() {
            let short = Short {
                met,
                truth: &truth,
                planned: &planned,
            };
            // Kept beside the round's plans; the search goes on as the chosen plan's
            // verification says (a later round may leave the pool more at the same score).
            if let Some(repaired) = self.repair(&chosen.plan, &short, loads, sub.be_mba, round) {
                if repaired.better_than(&best) {
                    best = repaired;
                }
            }
        }
        Round {
            chosen,
            best,
            planned,
            check,
        }
    }

    /// A plan that fell short of its round's score, with cores moved from the pool to the
    /// planned services that missed (round robin, the furthest over first), as few as
    /// reach the planned score (a binary search, each step verified), or all of them; the
    /// best verified, or `None` when nobody missed or the pool has no core.
    ///
    /// The frozen latency of a round is the pool's at the cores an earlier plan gave it:
    /// a plan that meets more targets by giving the pool fewer cores (so that the memory
    /// latency falls and every service needs fewer) is out of its sight. On a diurnal
    /// `crowded-gold` the oracle missed a target for the whole run that `ml`, the pool on
    /// no cores of its own, met in most intervals: the first round planned every target at
    /// the quiet latency and verified far fewer, and every later one planned one short.
    fn repair(
        &self,
        plan: &Plan,
        short: &Short<'_>,
        loads: &[f64],
        be_mba: u8,
        round: usize,
    ) -> Option<Found> {
        let mut failing: Vec<(f64, &str)> = self
            .ctx
            .latency_critical()
            .enumerate()
            .filter(|(k, _)| short.met & (1 << k) != 0)
            .filter_map(|(_, s)| {
                let ratio = short.truth.p99_ms.get(&s.name)? / s.p99_target_ms()?;
                (ratio > 1.0).then_some((ratio, s.name.as_str()))
            })
            .collect();
        let pool = plan.best_effort.cores;
        if failing.is_empty() || pool == 0 {
            return None;
        }
        failing.sort_by(|a, b| b.0.total_cmp(&a.0));
        let gpu_eff = self.gpu_effective();
        let check = |x: u32| -> Found {
            let mut p = plan.clone();
            for i in 0..x {
                let (_, name) = failing[i as usize % failing.len()];
                if let Some(a) = p.services.get_mut(name) {
                    a.cores += 1;
                }
            }
            p.best_effort.cores = pool - x;
            let (_, truth) = self.truth.evaluate(&p, loads, &gpu_eff, self.downtime());
            self.verified(p, &truth, be_mba, round)
        };
        let mut best = check(pool);
        if best.score < *short.planned {
            return Some(best);
        }
        let (mut lo, mut hi) = (0, pool);
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            let found = check(mid);
            if found.score >= *short.planned {
                hi = mid;
            } else {
                lo = mid;
            }
            if found.better_than(&best) {
                best = found;
            }
        }
        Some(best)
    }

    /// `plan` with what the truth says of it.
    fn verified(&self, plan: Plan, truth: &GroundTruth, be_mba: u8, round: usize) -> Found {
        let score = self.score_of(truth);
        let met = score.0.iter().sum::<usize>();
        let groups = plan.resctrl_groups();
        let shared = plan
            .services
            .values()
            .filter(|a| {
                plan.services
                    .values()
                    .filter(|b| b.llc_ways == a.llc_ways)
                    .count()
                    > 1
            })
            .count();
        let why = format!(
            "oracle: {met}/{} targets met, {} LC cores, pool MBA {be_mba}%, {groups} resctrl \
             groups, {shared} services in shared ranges, round {round}",
            self.lc().len(),
            plan.lc_cores(),
        );
        Found {
            plan,
            score,
            be: truth.be_throughput,
            why,
        }
    }

    /// One round: the options under `frozen`, the best packing in overload order, laid out,
    /// then the packings of the same set that leave the pool as many cores. Returns the
    /// plans (the best by the frozen value first) and the score the frozen model expects of
    /// them.
    fn plan_round(
        &self,
        loads: &[f64],
        reference: &Plan,
        frozen: &Frozen,
        sub: Subspace,
    ) -> (Vec<Plan>, Score, u32) {
        let be_mba = sub.be_mba;
        let lc = self.lc();
        let n = lc.len();
        let cap = &self.ctx.host;
        let gpu_eff = self.gpu_effective();
        let tenants = self
            .truth
            .tenants(reference, loads, &gpu_eff, self.downtime());
        let eval = Evaluator {
            oracle: self,
            tenants: &tenants,
            lc: &lc,
            frozen,
            be_mba,
        };
        let options = eval.options(sub.share_ways);
        let be_per_core = eval.be_per_core();
        let w_total = cap.llc_ways;
        // Ranges leave the pool a way of its own when CPU jobs run; where no packing of a set
        // of services does, they may take every way, the pool sharing the top one with the
        // last range (as `layout` lays out any policy's plan that does so: `ml`'s did on a
        // diurnal `crowded-gold`). Only then: as a choice beside the others, the frozen
        // value preferred such packings that verified worse (less best effort on
        // `crowded-e5` on the Gold than without them; docs/EXPERIMENTS.md, "Results history").
        let w_cap = if self.ctx.has_cpu_best_effort() {
            w_total - 1
        } else {
            w_total
        };
        let overlaps = |p: &Packing| self.ctx.has_cpu_best_effort() && p.ways >= w_total;
        // Alone, can a service meet its target at all (any option that is its alone)?
        let alone: u32 = (0..n)
            .filter(|&k| options.iter().any(|o| o.members == 1 << k))
            .fold(0, |m, k| m | (1 << k));
        // A packing that overlaps the pool ranks below one that leaves it a way of its own
        // with the same cores.
        let value = |p: &Packing| -> f64 {
            let pool_ways = w_total.saturating_sub(p.ways).max(1) as usize;
            let left = cap.cores.saturating_sub(p.cores);
            let tie = if overlaps(p) {
                -1e-6
            } else {
                f64::from(p.ways) * 1e-9
            };
            f64::from(left) * be_per_core[pool_ways] + tie
        };
        let (score, met, packings) = self.best_packings(&options, n, alone, w_cap, value);
        // The frozen value ranks packings that leave the pool the same cores by the pool's
        // ways alone, at the frozen memory latency; how the ways they split moves the LC
        // services' misses, and so the latency the pool's jobs see, it cannot tell. Those
        // ties go to verification with the best one (on the E5 `load-spike` at the start
        // the best fell short where a tie met both targets: see the module docs).
        // A packing that overlaps the pool is laid out with each of its ranges on top in
        // turn (the one that shares a way with the pool).
        let best_cores = packings[0].cores;
        let plans = packings
            .iter()
            .filter(|p| p.cores == best_cores)
            .flat_map(|p| {
                let tops: Vec<Option<u32>> = if overlaps(p) {
                    p.options
                        .iter()
                        .filter(|o| matches!(o.place, Place::Range { .. }))
                        .map(|o| Some(o.members))
                        .collect()
                } else {
                    vec![None]
                };
                tops.into_iter()
                    .map(|top| self.finish(p, top, met, &eval, be_mba))
                    .collect::<Vec<_>>()
            })
            .collect();
        (plans, score, met)
    }

    /// The set of services to satisfy first in overload order that some packing of
    /// `options` fits (`alone`: those that can meet their targets at all; `w_cap` the ways
    /// the ranges may take, every way where no packing leaves the pool one), with its
    /// packings, the best by `value` first.
    fn best_packings(
        &self,
        options: &[Placement],
        n: usize,
        alone: u32,
        w_cap: u32,
        value: impl Fn(&Packing) -> f64,
    ) -> (Score, u32, Vec<Packing>) {
        let cap = &self.ctx.host;
        let w_total = cap.llc_ways;
        let budget = self.ctx.isolated_services();
        // Sets of services to satisfy, in overload order.
        let mut sets: Vec<(Score, u32)> = if n <= MAX_SETS_LC {
            (0..(1u32 << n))
                .filter(|m| m & !alone == 0)
                .map(|m| (self.score_of_set(m), m))
                .collect()
        } else {
            vec![(self.score_of_set(alone), alone)]
        };
        sets.sort_by(|a, b| b.0.cmp(&a.0));
        // The chosen set's packings, the best by value first.
        let mut chosen: Option<(Score, u32, Vec<Packing>)> = None;
        for (score, met) in sets {
            if let Some((s, _, _)) = &chosen {
                if score < *s {
                    break;
                }
            }
            let left_out = u32::try_from(n)
                .unwrap_or(u32::MAX)
                .saturating_sub(met.count_ones());
            let c_cap = cap.cores.saturating_sub(left_out);
            let mut packings = pack(options, met, w_cap, budget, c_cap);
            if packings.is_empty() && w_cap < w_total {
                packings = pack(options, met, w_total, budget, c_cap);
            }
            packings.sort_by(|a, b| value(b).total_cmp(&value(a)));
            let Some(p) = packings.first() else {
                continue;
            };
            let better = chosen
                .as_ref()
                .is_none_or(|(_, _, q)| value(p) > value(&q[0]));
            if better {
                chosen = Some((score, met, packings));
            }
        }
        chosen.unwrap_or_else(|| {
            (
                self.score_of_set(0),
                0,
                vec![Packing {
                    options: vec![],
                    ways: 0,
                    cores: 0,
                }],
            )
        })
    }

    /// The plan of `packing`, with the latency-critical services not in `met` served from
    /// what is left.
    fn finish(
        &self,
        packing: &Packing,
        top: Option<u32>,
        met: u32,
        eval: &Evaluator<'_>,
        be_mba: u8,
    ) -> Plan {
        let lc = self.lc();
        let cap = &self.ctx.host;
        let mut plan = self.lay_out(packing, top, be_mba);
        // Services left out, before best effort gets any core: in the pool's group, the
        // fewest cores that meet the bare target where some do, else that bring their p99
        // within 5 % of what every free core would. (Adding
        // a core at a time while each lowered the p99 by 5 % stopped at one core on a
        // saturated queue, whose p99 is the time-out however many cores short it is: on
        // `crowded-e5` on the Gold moses got one core and sat at 20 times its target, where
        // thirteen held it at 1.8 times.)
        let left_out: Vec<usize> = self
            .overload_order()
            .into_iter()
            .filter(|k| met & (1 << k) == 0)
            .collect();
        for (i, &k) in left_out.iter().enumerate() {
            let name = &self.ctx.specs[lc[k]].name;
            let pool = plan.best_effort;
            // A core stays for each left-out service still to place (the packing kept them).
            let after = u32::try_from(left_out.len() - i - 1).unwrap_or(u32::MAX);
            let free = cap
                .cores
                .saturating_sub(plan.lc_cores())
                .saturating_sub(after)
                .max(1);
            // In the pool's group, or beside a throttled pool at full bandwidth where a
            // CLOSID is left for that (LC before BE on memory bandwidth too).
            let mut best: Option<(f64, u32, u8)> = None;
            for mba in [pool.mba_pct, MBA_MAX_PCT] {
                if best.is_some() && mba == pool.mba_pct {
                    continue;
                }
                let p99s: Vec<f64> = (1..=free).map(|c| eval.p99_in_pool_at(k, c, mba)).collect();
                let low = p99s.iter().copied().fold(f64::INFINITY, f64::min);
                // The fewest that meet its bare target where some do (a service left out
                // of the packing may still meet it with what is free), else near the best.
                let aim = if self.at_targets() && low <= eval.target(k) {
                    eval.target(k)
                } else {
                    1.05 * low
                };
                let enough = |p: f64| p <= aim;
                let cores = (1..=free)
                    .zip(&p99s)
                    .find(|(_, p)| enough(**p))
                    .map_or(1, |(c, _)| c);
                let mut trial = plan.clone();
                trial
                    .services
                    .insert(name.clone(), left_out_at(pool, cores, mba));
                let fits = trial.resctrl_groups() <= cap.groups_available() as usize;
                if fits && best.is_none_or(|(b, ..)| low < 0.95 * b) {
                    best = Some((low, cores, mba));
                }
            }
            let (_, cores, mba) = best.unwrap_or((f64::INFINITY, 1, pool.mba_pct));
            let mut a = left_out_at(pool, cores, mba);
            a.gpu_mps_pct = self.gpu_of(&self.ctx.specs[lc[k]]);
            plan.services.insert(name.clone(), a);
            plan.best_effort.cores = cap.cores.saturating_sub(plan.lc_cores());
        }
        plan
    }

    /// Latency-critical indices `k` in overload order: priority, then configuration order.
    fn overload_order(&self) -> Vec<usize> {
        let specs: Vec<_> = self.ctx.latency_critical().collect();
        let mut order: Vec<usize> = (0..specs.len()).collect();
        order.sort_by_key(|&k| std::cmp::Reverse(specs[k].priority));
        order
    }

    fn gpu_of(&self, spec: &cohabit_core::ServiceSpec) -> Option<u8> {
        spec.gpu.map(|_| {
            self.gpu_now
                .published
                .get(&spec.name)
                .copied()
                .unwrap_or(100)
        })
    }

    /// The plan of a packing: ranges from way 0 up (ordered by their first member, the
    /// range of members `top` last), the pool above them (on the top way when they take
    /// every way); services in the pool's range take its ways and MBA.
    fn lay_out(&self, packing: &Packing, top: Option<u32>, be_mba: u8) -> Plan {
        let cap = &self.ctx.host;
        let specs: Vec<_> = self.ctx.latency_critical().collect();
        let mut options = packing.options.clone();
        options.sort_by_key(|o| (Some(o.members) == top, o.members.trailing_zeros()));
        let mut next = 0;
        let mut ranges: Vec<(usize, u32, WayRange)> = Vec::new();
        let mut pooled: Vec<(usize, u32, u8)> = Vec::new();
        for o in &options {
            match o.place {
                Place::Range { ways, .. } => {
                    let r = WayRange::new(next, ways);
                    next += ways;
                    ranges.extend(o.cores.iter().map(|&(k, c)| (k, c, r)));
                }
                Place::Pool => pooled.extend(o.cores.iter().map(|&(k, c)| (k, c, be_mba))),
                Place::PoolWays => {
                    pooled.extend(o.cores.iter().map(|&(k, c)| (k, c, MBA_MAX_PCT)));
                }
            }
        }
        let pool_ways = if next < cap.llc_ways {
            WayRange::new(next, cap.llc_ways - next)
        } else {
            WayRange::new(cap.llc_ways - 1, 1)
        };
        let mut services = BTreeMap::new();
        for (k, cores, r) in ranges {
            services.insert(
                specs[k].name.clone(),
                Allocation {
                    cores,
                    llc_ways: r,
                    mba_pct: MBA_MAX_PCT,
                    gpu_mps_pct: self.gpu_of(specs[k]),
                },
            );
        }
        for (k, cores, mba_pct) in pooled {
            services.insert(
                specs[k].name.clone(),
                Allocation {
                    cores,
                    llc_ways: pool_ways,
                    mba_pct,
                    gpu_mps_pct: self.gpu_of(specs[k]),
                },
            );
        }
        let lc_cores: u32 = services.values().map(|a: &Allocation| a.cores).sum();
        Plan {
            services,
            best_effort: Allocation {
                cores: cap.cores.saturating_sub(lc_cores),
                llc_ways: pool_ways,
                mba_pct: be_mba,
                gpu_mps_pct: self.pool_gpu(),
            },
            gpu_memory_mib: Default::default(),
        }
    }

    fn plan_for(&mut self, start_ms: u64, reference: &Plan) -> Decision {
        let loads = self.planned_loads(start_ms);
        self.gpu_now = self.gpu_tick(start_ms);
        if let Some(last) = &self.last {
            // Loads within 2 % of those the plan was found for, the same GPU shares and
            // clients, and it still reaches the same score under the true physics: keep it
            // (one evaluation instead of a search).
            let close = last
                .loads
                .iter()
                .zip(&loads)
                .all(|(a, b)| (a - b).abs() <= REUSE_TOLERANCE * a.max(1e-9));
            if close && last.gpu == self.gpu_now {
                let (_, truth) = self.truth.evaluate(
                    &last.found.plan,
                    &loads,
                    &self.gpu_effective(),
                    self.downtime(),
                );
                if self.score_of(&truth) >= last.found.score {
                    let plan = last.found.plan.clone();
                    let why = format!("{} (still reaches its score)", last.found.why);
                    return Decision::new(plan.clone(), reasons_for(&plan, &why));
                }
            }
        }
        let found = self.search(&loads, reference);
        let decision = Decision::new(found.plan.clone(), reasons_for(&found.plan, &found.why));
        self.last = Some(Last {
            loads,
            gpu: self.gpu_now.clone(),
            found,
        });
        decision
    }
}

/// Most latency-critical services for which every set of services to satisfy is tried;
/// beyond, only the set of all that can meet their targets alone (no longer a bound).
const MAX_SETS_LC: usize = 12;

/// The pool MBA values a platform allows, from 100 % down to its minimum, in its steps.
pub fn mba_steps(min_pct: u8, gran_pct: u8) -> Vec<u8> {
    let gran = gran_pct.max(1);
    let mut out = vec![MBA_MAX_PCT];
    let mut v = MBA_MAX_PCT;
    while v >= min_pct.saturating_add(gran) {
        v -= gran;
        out.push(v);
    }
    out
}

/// A left-out service's allocation on the pool's ways: `cores` at MBA `mba` (the pool's:
/// its group; full: a group of its own beside a throttled pool).
fn left_out_at(pool: Allocation, cores: u32, mba: u8) -> Allocation {
    Allocation {
        cores,
        llc_ways: pool.llc_ways,
        mba_pct: mba,
        gpu_mps_pct: None,
    }
}

fn reasons_for(plan: &Plan, why: &str) -> BTreeMap<String, Reason> {
    plan.groups()
        .map(|(g, _)| {
            let text = why.strip_prefix("oracle: ").unwrap_or(why);
            (g.to_string(), Reason::new(DecisionPath::Oracle, text))
        })
        .collect()
}

impl Policy for OraclePolicy {
    fn name(&self) -> &'static str {
        "oracle"
    }

    fn initial(&mut self) -> Decision {
        let reference = layout(
            &self.ctx,
            &self.with_gpu(fair_shares(&self.ctx)),
            MBA_MAX_PCT,
        );
        self.plan_for(0, &reference)
    }

    fn decide(&mut self, obs: &Observation, now_ms: u64) -> Decision {
        let reference = obs.current.clone();
        self.plan_for(now_ms, &reference)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use cohabit_policy::StaticPolicy;
    use cohabit_sim::scenario::{builtin_names, crowded_names};
    use cohabit_sim::Scenario;

    use super::*;

    fn oracle(name: &str) -> (OraclePolicy, Arc<Scenario>) {
        let sc = Arc::new(Scenario::load(name).unwrap());
        (OraclePolicy::new(TruthModel::new(Arc::clone(&sc))), sc)
    }

    /// The scenario `name` on `platform`.
    fn on(name: &str, platform: &str) -> Scenario {
        Scenario::load(name).unwrap().on_platform(platform).unwrap()
    }

    /// The scenario `name` on the E5-2697 v4 as if it had MBA (a 10 % minimum and step, as
    /// on Xeon Scalable). The real part has none, and neither has its preset since this
    /// round; the cases these tests hold were found on it before then, and the oracle's
    /// search does not depend on which platform offers the steps.
    fn on_e5_with_mba(name: &str) -> Scenario {
        let mut sc = on(name, "xeon-e5-2697v4");
        sc.host.capacity.mba_min_pct = 10;
        sc.host.capacity.mba_gran_pct = 10;
        sc
    }

    /// The full oracle and one searching under `restricted`, on `sc`.
    fn full_and_restricted(
        sc: Scenario,
        restricted: OracleConfig,
    ) -> (OraclePolicy, OraclePolicy, Arc<Scenario>) {
        let sc = Arc::new(sc);
        let tm = TruthModel::new(Arc::clone(&sc));
        let full = OraclePolicy::new(tm.clone());
        (full, OraclePolicy::with_config(tm, restricted), sc)
    }

    /// Asserts that the oracle's `plan` meets at least the score `other` meets in the first
    /// interval of `sc` and, at the same score, leaves best effort at least as much; returns
    /// `other`'s score.
    fn no_worse(
        o: &OraclePolicy,
        sc: &Arc<Scenario>,
        plan: &Plan,
        other: &Plan,
        what: &str,
    ) -> Score {
        let ((a, _), (b, _)) = (first_truth(sc, plan), first_truth(sc, other));
        let (sa, sb) = (o.score_of(&a), o.score_of(&b));
        assert!(
            (&sa, a.be_throughput) >= (&sb, b.be_throughput),
            "oracle {sa:?} {} vs {what} {sb:?} {}\n{plan:?}\n{other:?}",
            a.be_throughput,
            b.be_throughput
        );
        sb
    }

    /// The ground truth of `plan` in the first interval of `sc`.
    fn first_truth(sc: &Arc<Scenario>, plan: &Plan) -> (GroundTruth, Vec<f64>) {
        let tm = TruthModel::new(Arc::clone(sc));
        let loads = tm.loads_at(sc.tick_ms as f64 / 2000.0);
        let zeros = vec![0.0; loads.len()];
        let (_, truth) = tm.evaluate(plan, &loads, &tm.gpu_shares(plan), &zeros);
        (truth, loads)
    }

    #[test]
    fn mba_steps_follow_the_platform_from_100_down_to_its_minimum() {
        assert_eq!(
            mba_steps(10, 10),
            vec![100, 90, 80, 70, 60, 50, 40, 30, 20, 10]
        );
        assert_eq!(mba_steps(20, 30), vec![100, 70, 40]);
        assert_eq!(mba_steps(100, 10), vec![100]);
    }

    #[test]
    fn gpu_splits_give_everyone_a_unit_and_never_exceed_the_gpu() {
        let s = gpu::unit_splits(3, 19);
        assert_eq!(s.len(), 969, "C(19, 3)");
        assert!(s.iter().all(|v| v.len() == 3 && v.iter().all(|u| *u >= 1)));
        assert!(s.iter().all(|v| v.iter().sum::<u32>() <= 19));
    }

    #[test]
    fn its_plan_meets_every_target_and_beats_static_on_best_effort() {
        for name in builtin_names() {
            let (mut o, sc) = oracle(name);
            let plan = o.initial().plan;
            plan.validate(sc.capacity(), &sc.specs()).unwrap();
            let (truth, _) = first_truth(&sc, &plan);
            for s in sc.services.iter().filter(|s| s.spec.is_latency_critical()) {
                let p = truth.p99_ms[&s.spec.name];
                assert!(
                    p <= s.spec.p99_target_ms().unwrap(),
                    "{name}: {} at {p}",
                    s.spec.name
                );
            }
            let ctx = HostContext {
                host: sc.capacity().clone(),
                specs: sc.specs(),
            };
            let fair = StaticPolicy::new(ctx).initial().plan;
            let (fair_truth, _) = first_truth(&sc, &fair);
            // Where static also meets every target the oracle must leave at least as much.
            if o.score_of(&fair_truth) >= o.score_of(&truth) {
                assert!(
                    truth.be_throughput >= fair_truth.be_throughput * 0.99,
                    "{name}"
                );
            }
        }
    }

    #[test]
    fn every_plan_fits_the_closids_and_uses_mba_steps_only() {
        for name in builtin_names().chain(crowded_names()) {
            let (mut o, sc) = oracle(name);
            let cap = sc.capacity();
            let steps = mba_steps(cap.mba_min_pct, cap.mba_gran_pct);
            let mut plan = o.initial().plan;
            for t_ms in [0, 100_000, 200_000] {
                plan = o
                    .decide(
                        &Observation {
                            t_ms,
                            services: vec![],
                            current: plan.clone(),
                        },
                        t_ms,
                    )
                    .plan;
                plan.validate(cap, &sc.specs())
                    .unwrap_or_else(|e| panic!("{name} at {t_ms} ms: {e}"));
                assert!(plan.resctrl_groups() <= cap.groups_available() as usize);
                for (g, a) in plan.groups() {
                    assert!(steps.contains(&a.mba_pct), "{name}: {g} at {}%", a.mba_pct);
                }
            }
        }
    }

    #[test]
    fn with_few_closids_services_share_ranges_and_the_budget_holds() {
        // 5 services, 4 CLOSIDs: at most 3 groups, the pool's included.
        let (mut o, sc) = oracle("few-closids");
        let plan = o.initial().plan;
        assert!(plan.resctrl_groups() <= 3, "{}", plan.resctrl_groups());
        let (truth, _) = first_truth(&sc, &plan);
        assert_eq!(o.score_of(&truth), Score(vec![5]), "{plan:?}");
    }

    #[test]
    fn sharing_ways_meets_at_least_as_many_targets_on_a_crowded_host() {
        for name in crowded_names().filter(|n| !n.starts_with("gpu")) {
            let sc = Arc::new(Scenario::load(name).unwrap());
            let tm = TruthModel::new(Arc::clone(&sc));
            let mut full = OraclePolicy::new(tm.clone());
            let mut apart = OraclePolicy::with_config(
                tm,
                OracleConfig {
                    share_ways: false,
                    ..OracleConfig::default()
                },
            );
            let (a, _) = first_truth(&sc, &full.initial().plan);
            let (b, _) = first_truth(&sc, &apart.initial().plan);
            let ctx = HostContext {
                host: sc.capacity().clone(),
                specs: sc.specs(),
            };
            let (f, _) = first_truth(&sc, &StaticPolicy::new(ctx).initial().plan);
            let (sa, sb, sf) = (full.score_of(&a), full.score_of(&b), full.score_of(&f));
            assert!(sa >= sb, "{name}: shared {sa:?} vs apart {sb:?}");
            assert!(sa > sf, "{name}: oracle {sa:?} vs static {sf:?}");
            let lc = sc
                .specs()
                .iter()
                .filter(|s| s.is_latency_critical())
                .count();
            assert!(
                sa.0.iter().sum::<usize>() + 2 >= lc,
                "{name}: {sa:?} of {lc}"
            );
        }
    }

    #[test]
    fn searching_with_shared_ranges_never_leaves_less_than_searching_without() {
        // Plans without shared ranges are part of the full space, so the full oracle must
        // do at least as well as its no-share self. On the E5 `mba-stream` the search with
        // shared ranges preferred memcached and moses in one 19-way range, which verified
        // with two pool cores at full bandwidth, where the search without them found three
        // at 90 % (and never tried it itself).
        for sc in [
            on_e5_with_mba("mba-stream"),
            on("mba-stream", "xeon-gold-6338"),
        ] {
            let platform = sc.host.preset;
            let (mut full, mut apart, sc) = full_and_restricted(
                sc,
                OracleConfig {
                    share_ways: false,
                    ..OracleConfig::default()
                },
            );
            let (p, q) = (full.initial().plan, apart.initial().plan);
            no_worse(
                &full,
                &sc,
                &p,
                &q,
                &format!("{platform}, without shared ranges"),
            );
        }
    }

    #[test]
    fn it_leaves_at_least_what_a_hand_built_plan_that_meets_every_target_leaves() {
        // On the E5 `load-spike` at the start: memcached on 8 cores with 6 ways and img-dnn
        // on 10 with 13 meet both targets and leave the pool 18 cores. The search's frozen
        // value ranked that layout level with one that gives the pool a second way instead
        // (same cores), verified only the other, which fell short, and settled a round later
        // on 19 LC cores. Packings that tie on cores are now all verified.
        let (mut o, sc) = oracle("load-spike");
        let plan = o.initial().plan;
        let mut hand = plan.clone();
        let total = sc.capacity().cores;
        for (name, cores, first, count) in [("memcached", 8, 0, 6), ("img-dnn", 10, 6, 13)] {
            let a = hand.services.get_mut(name).expect(name);
            a.cores = cores;
            a.llc_ways = WayRange::new(first, count);
            a.mba_pct = MBA_MAX_PCT;
        }
        hand.best_effort.cores = total - hand.lc_cores();
        hand.best_effort.llc_ways = WayRange::new(19, 1);
        hand.best_effort.mba_pct = MBA_MAX_PCT;
        let hand_score = no_worse(&o, &sc, &plan, &hand, "hand-built");
        assert_eq!(hand_score, Score(vec![2]), "the hand-built plan meets both");
    }

    #[test]
    fn aiming_further_under_the_targets_leaves_best_effort_less_and_keeps_the_margin() {
        // parties-mix: every target can be met with room to spare, so the aim decides.
        let sc = Arc::new(Scenario::load("parties-mix").unwrap());
        let tm = TruthModel::new(Arc::clone(&sc));
        let mut usual = OraclePolicy::new(tm.clone());
        let mut careful = OraclePolicy::with_config(
            tm,
            OracleConfig {
                target_fraction: 0.8,
                ..OracleConfig::default()
            },
        );
        let (p, q) = (usual.initial().plan, careful.initial().plan);
        let ((a, _), (b, _)) = (first_truth(&sc, &p), first_truth(&sc, &q));
        assert_eq!(usual.score_of(&a), usual.score_of(&b));
        assert!(q.lc_cores() > p.lc_cores(), "{p:?}\n{q:?}");
        assert!(b.be_throughput < a.be_throughput, "{b:?} vs {a:?}");
        for s in sc.specs().iter().filter(|s| s.is_latency_critical()) {
            let target = s.p99_target_ms().unwrap();
            assert!(b.p99_ms[&s.name] <= 0.8 * target, "{}: {b:?}", s.name);
        }
    }

    #[test]
    fn throttling_the_streaming_jobs_pays_where_the_pool_has_few_cores() {
        // mba-stream on the E5 as if it had MBA: beside memcached and moses the pool has two
        // or three cores, and three at 90 % leave best effort a quarter more than two at
        // full bandwidth. On the Gold (the scenario's platform) the pool has sixteen and
        // full bandwidth is best: until issue 49 the oracle throttled it to 80 % there and
        // left 0.485 of the host, where a plan it now finds leaves 0.503 unthrottled.
        // Either way the search over MBA steps never leaves less than the pool at 100 %.
        for (sc, throttled) in [
            (on_e5_with_mba("mba-stream"), true),
            (Scenario::load("mba-stream").unwrap(), false),
        ] {
            let (mut with, mut without, sc) = full_and_restricted(
                sc,
                OracleConfig {
                    search_mba: false,
                    ..OracleConfig::default()
                },
            );
            let (p, q) = (with.initial().plan, without.initial().plan);
            assert_eq!(q.best_effort.mba_pct, MBA_MAX_PCT);
            let sb = no_worse(&with, &sc, &p, &q, "the pool at full bandwidth");
            assert_eq!(sb, Score(vec![2]));
            let ((a, _), (b, _)) = (first_truth(&sc, &p), first_truth(&sc, &q));
            if throttled {
                assert!(p.best_effort.mba_pct < MBA_MAX_PCT, "{p:?}");
                assert!(
                    a.be_throughput > b.be_throughput * 1.05,
                    "MBA {}%: {} vs {}",
                    p.best_effort.mba_pct,
                    a.be_throughput,
                    b.be_throughput
                );
            }
        }
    }

    #[test]
    fn a_service_left_out_is_served_past_a_saturated_plateau_before_best_effort() {
        // `crowded-e5` on the Gold: at the start moses could not meet its target with the
        // margin beside the seven others and was left out. Short of its knee its p99 is the
        // time-out whatever its cores, so adding a core at a time while each lowered the p99
        // by 5 % stopped at one core and the pool took the rest: moses at 20 times its
        // target in every interval of the run, where the cores the pool took would have held
        // it at 1.8 times at the start. (Since the search also tries plans that leave the
        // pool fewer cores, it meets its target there.)
        for sc in [on("crowded-e5", "xeon-gold-6338")] {
            let sc = Arc::new(sc);
            let platform = sc.host.preset;
            let tm = TruthModel::new(Arc::clone(&sc));
            let mut o = OraclePolicy::new(tm.clone());
            let reference = o.initial().plan;
            let target = sc
                .specs()
                .into_iter()
                .find(|s| s.name == "moses")
                .and_then(|s| s.p99_target_ms())
                .unwrap();
            for t in [1.0, 31.0] {
                let loads = tm.loads_at(t);
                let found = o.search(&loads, &reference);
                let zeros = vec![0.0; loads.len()];
                let (_, truth) =
                    tm.evaluate(&found.plan, &loads, &tm.gpu_shares(&found.plan), &zeros);
                let q = truth.p99_ms["moses"] / target;
                let moses = found.plan.services["moses"];
                if q > 1.0 {
                    // Left out: in the pool's ways.
                    assert_eq!(moses.llc_ways, found.plan.best_effort.llc_ways, "at {t} s");
                }
                assert!(
                    q <= 2.0,
                    "{platform} at {t} s moses at {q} of its target: {:?}",
                    found.plan
                );
            }
        }
    }

    #[test]
    fn no_aim_further_under_the_targets_leaves_best_effort_more() {
        // A plan that meets every target at 0.8 of it also meets them at 0.97: the default
        // search must find one leaving at least as much. Before the bisection between a
        // round that fell short and the verified one, the E5 mba-stream oracle left 0.065
        // (four cores of the pool throttled to 10 %) where aiming at 0.8 left 0.103.
        let sc = Arc::new(on_e5_with_mba("mba-stream"));
        let tm = TruthModel::new(Arc::clone(&sc));
        let (a, _) = first_truth(&sc, &OraclePolicy::new(tm.clone()).initial().plan);
        for aim in [0.9, 0.8] {
            let mut aimed = OraclePolicy::with_config(
                tm.clone(),
                OracleConfig {
                    target_fraction: aim,
                    ..OracleConfig::default()
                },
            );
            let (b, _) = first_truth(&sc, &aimed.initial().plan);
            assert!(
                aimed.score_of(&a) >= aimed.score_of(&b),
                "aim {aim}: {a:?} vs {b:?}"
            );
            assert!(
                a.be_throughput >= b.be_throughput * 0.99,
                "aim {aim}: best effort {} vs {}",
                a.be_throughput,
                b.be_throughput
            );
        }
    }

    #[test]
    fn without_foresight_the_oracle_plans_for_the_interval_just_measured() {
        // load-spike: memcached's load steps up; the oracle without foresight meets the
        // first interval of the step with the plan for the load before it.
        let sc = Arc::new(Scenario::load("load-spike").unwrap());
        let tm = TruthModel::new(Arc::clone(&sc));
        let tick_s = sc.tick_ms as f64 / 1000.0;
        let i = sc
            .services
            .iter()
            .position(|s| s.spec.name == "memcached")
            .unwrap();
        // The first interval whose load is 20 % above the one before.
        let step = (1..sc.ticks())
            .find(|&t| {
                let at = |t: u64| tm.loads_at((t as f64 + 0.5) * tick_s)[i];
                at(t) > 1.2 * at(t - 1)
            })
            .expect("a load step");
        let cfg = |foresight| OracleConfig {
            foresight,
            ..OracleConfig::default()
        };
        let now_ms = step * sc.tick_ms;
        let reference = OraclePolicy::new(tm.clone()).initial().plan;
        let plan = |foresight| {
            let mut o = OraclePolicy::with_config(tm.clone(), cfg(foresight));
            o.plan_for(now_ms, &reference).plan
        };
        let before = {
            let mut o = OraclePolicy::new(tm.clone());
            o.plan_for(now_ms - sc.tick_ms, &reference).plan
        };
        let (seeing, blind) = (plan(true), plan(false));
        assert_eq!(blind.services["memcached"], before.services["memcached"]);
        assert!(
            seeing.services["memcached"].cores > before.services["memcached"].cores,
            "{seeing:?} vs {before:?}"
        );
    }

    #[test]
    fn a_service_left_out_is_served_first_once_it_has_the_higher_priority() {
        // crowded-gold at twice its loads: not every target can be met there.
        let text = include_str!("../../simulator/scenarios/crowded-gold.toml")
            .replace("fraction = 0.12", "fraction = 0.24")
            .replace("fraction = 0.08", "fraction = 0.16")
            .replace("fraction = 0.06", "fraction = 0.12")
            .replace(
                "mean = 0.08, amplitude = 0.02",
                "mean = 0.16, amplitude = 0.04",
            );
        let text = text.as_str();
        let base =
            Arc::new(Scenario::from_toml(text, "crowded-gold", std::path::Path::new(".")).unwrap());
        let mut o = OraclePolicy::new(TruthModel::new(Arc::clone(&base)));
        let (truth, _) = first_truth(&base, &o.initial().plan);
        let left_out = base
            .services
            .iter()
            .filter(|s| s.spec.is_latency_critical())
            .find(|s| truth.p99_ms[&s.spec.name] > s.spec.p99_target_ms().unwrap())
            .map(|s| s.spec.name.clone())
            .expect("crowded-gold is crowded: some target is missed");
        // Give it the highest priority: it must now meet its target, whoever yields.
        let raised = text.replace(
            &format!("name = \"{left_out}\"\n"),
            &format!("name = \"{left_out}\"\npriority = 5\n"),
        );
        let sc =
            Arc::new(Scenario::from_toml(&raised, "raised", std::path::Path::new(".")).unwrap());
        let mut o = OraclePolicy::new(TruthModel::new(Arc::clone(&sc)));
        let plan = o.initial().plan;
        let (truth, _) = first_truth(&sc, &plan);
        let target = sc
            .specs()
            .iter()
            .find(|s| s.name == left_out)
            .unwrap()
            .p99_target_ms()
            .unwrap();
        assert!(
            truth.p99_ms[&left_out] <= target,
            "{left_out} at priority 5: {} > {target}",
            truth.p99_ms[&left_out]
        );
        assert_eq!(o.score_of(&truth).0[0], 1);
    }

    #[test]
    fn more_load_never_gets_fewer_resources() {
        let (o, sc) = oracle("demo");
        let tm = TruthModel::new(Arc::clone(&sc));
        let reference = layout(&o.ctx, &fair_shares(&o.ctx), MBA_MAX_PCT);
        let base = tm.loads_at(0.5);
        let light = o.search(&base, &reference).plan;
        let heavy_loads: Vec<f64> = base.iter().map(|l| l * 1.5).collect();
        let heavy = o.search(&heavy_loads, &reference).plan;
        assert!(
            heavy.lc_cores() >= light.lc_cores(),
            "{} vs {}",
            heavy.lc_cores(),
            light.lc_cores()
        );
    }

    #[test]
    fn in_every_interval_the_gpu_job_gets_only_what_the_services_leave() {
        for name in ["gpu-inference", "gpu-llm-crowd"] {
            let (mut o, _) = oracle(name);
            let mut plan = o.initial().plan;
            for t_ms in (0..600_000).step_by(20_000) {
                plan = o
                    .decide(
                        &Observation {
                            t_ms,
                            services: vec![],
                            current: plan.clone(),
                        },
                        t_ms,
                    )
                    .plan;
                let lc_sum: u32 = plan
                    .services
                    .values()
                    .filter_map(|a| a.gpu_mps_pct)
                    .map(u32::from)
                    .sum();
                assert!(lc_sum < 100, "{name} at {t_ms} ms: {lc_sum}");
                assert_eq!(
                    u32::from(plan.best_effort.gpu_mps_pct.unwrap()),
                    100 - lc_sum,
                    "{name} at {t_ms} ms"
                );
            }
        }
    }

    #[test]
    fn the_oracle_plans_with_the_gpu_shares_the_simulated_host_runs_at() {
        // A share change restarts the client: the simulated host keeps the old share in
        // effect and the client down for 3 s. The oracle's CPU search must see each
        // interval as the host runs it, or its verification means nothing.
        // At 60 s the LLM's load falls and the classifier's rises: the schedule moves the
        // shares once, and pays a restart.
        let text = "name = \"crossing\"\nduration_s = 120\n[host]\npreset = \"xeon-e5-2697v4-a100\"\n\
            [[service]]\nname = \"llm-infer\"\nmodel = \"llm-infer\"\ngpu = 0\n\
            load = { kind = \"steps\", steps = [{ at_s = 0, fraction = 0.7 }, { at_s = 60, fraction = 0.1 }] }\n\
            [[service]]\nname = \"resnet-infer\"\nmodel = \"resnet-infer\"\ngpu = 0\n\
            load = { kind = \"steps\", steps = [{ at_s = 0, fraction = 0.1 }, { at_s = 60, fraction = 0.5 }] }\n\
            [[best_effort]]\nname = \"gpu-train\"\nmodel = \"gpu-train\"\ngpu = 0\n\
            [[best_effort]]\nname = \"compute\"\nmodel = \"compute\"\n";
        let sc =
            Arc::new(Scenario::from_toml(text, "crossing", std::path::Path::new(".")).unwrap());
        let mut o = OraclePolicy::new(TruthModel::new(Arc::clone(&sc)));
        assert!(o.gpu.changes() > 0, "the schedule moves shares");
        let mut plan = o.initial().plan;
        let mut host = cohabit_sim::SimulatedHost::launch(Arc::clone(&sc), &plan, None).unwrap();
        let mut restarting = 0;
        for tick in 0..sc.ticks() {
            use cohabit_core::{Actuator, Collector};
            let obs = host.collect().unwrap();
            let start_ms = tick * sc.tick_ms;
            let ran = o.gpu_tick(start_ms);
            let loads = o.planned_loads(start_ms);
            let (_, planned) = o
                .truth
                .evaluate(&plan, &loads, &ran.effective, &ran.downtime_ms);
            let truth = host.last_truth().unwrap();
            for (name, p) in &truth.p99_ms {
                let q = planned.p99_ms[name];
                assert!(
                    (p - q).abs() <= 1e-9 * p.max(1.0),
                    "{name} at {start_ms} ms: {p} vs {q}"
                );
            }
            restarting += usize::from(ran.downtime_ms.iter().any(|d| *d > 0.0));
            plan = o.decide(&obs, obs.t_ms).plan;
            host.apply(&plan, &[]).unwrap();
        }
        assert!(restarting > 0, "some interval holds a restart");
    }

    /// The oracle's ranking of a run: targets met per priority level summed over its
    /// intervals, then best-effort throughput summed.
    fn ranking(o: &OraclePolicy, run: &crate::simulate::SimRun) -> (Score, f64) {
        let mut met = Score(vec![0; o.levels().len()]);
        let mut be = 0.0;
        for truth in run.records.iter().filter_map(|r| r.truth.as_ref()) {
            for (m, c) in met.0.iter_mut().zip(o.score_of(truth).0) {
                *m += c;
            }
            be += truth.be_throughput;
        }
        (met, be)
    }

    #[test]
    fn no_policy_beats_the_oracle_on_its_ranking_on_crowded_hosts() {
        // Every policy against the oracle on the first minutes of crowded scenarios: the
        // oracle meets at least as many targets per priority level (summed over the run),
        // and where it meets as many, leaves best effort at least as much (within 1 %).
        // Until issue 49 `ml` met more on both of the first: 1.17 services per interval
        // against 1.08 on `gpu-llm-crowd` (the oracle held one GPU split for the run) and
        // 5.24 against 5.18 on the diurnal crowded Gold.
        use crate::simulate::{compare, LabPolicy};

        let mut gpu = Scenario::load("gpu-llm-crowd").unwrap();
        gpu.duration_s = 120.0;
        let mut diurnal = (*lab_scenario("crowded-gold-diurnal.toml")).clone();
        diurnal.duration_s = 120.0;
        let mut gold = Scenario::load("crowded-gold").unwrap();
        gold.duration_s = 30.0;
        let mut e5 = Scenario::load("crowded-e5").unwrap();
        e5.duration_s = 30.0;
        for sc in [gpu, diurnal, gold, e5] {
            let sc = Arc::new(sc);
            let name = &sc.name;
            let o = OraclePolicy::new(TruthModel::new(Arc::clone(&sc)));
            let runs = compare(&sc, &LabPolicy::ALL, None, None).unwrap();
            let oracle = runs.iter().find(|r| r.summary.policy == "oracle").unwrap();
            let (best, best_be) = ranking(&o, oracle);
            for run in &runs {
                let (met, be) = ranking(&o, run);
                let policy = &run.summary.policy;
                assert!(
                    met <= best,
                    "{name}: {policy} meets {met:?}, the oracle {best:?}"
                );
                if met == best {
                    assert!(
                        be <= best_be * 1.01,
                        "{name}: {policy} leaves best effort {be}, the oracle {best_be}"
                    );
                }
            }
        }
    }

    /// A lab scenario (lab/scenarios/) by file name.
    fn lab_scenario(file: &str) -> Arc<Scenario> {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios");
        Arc::new(Scenario::load(dir.join(file).to_str().unwrap()).unwrap())
    }

    /// The oracle on the diurnal crowded Gold, its fair-share layout and the loads at 101 s
    /// (where every target fits at the quiet memory latency but not at the one the pool's
    /// traffic raises).
    fn diurnal_gold_at_101_s() -> (OraclePolicy, Plan, Vec<f64>) {
        let sc = lab_scenario("crowded-gold-diurnal.toml");
        let o = OraclePolicy::new(TruthModel::new(sc));
        let reference = layout(&o.ctx, &fair_shares(&o.ctx), MBA_MAX_PCT);
        let loads = o.truth.loads_at(101.5);
        (o, reference, loads)
    }

    #[test]
    fn a_plan_that_leaves_the_pool_fewer_cores_meets_the_targets_the_quiet_latency_promised() {
        // The diurnal crowded Gold at 101 s: at the quiet memory latency every target fits,
        // but the plan that leaves the pool the most cores verifies with two met (the pool's
        // traffic raises the latency), and every later round, at the latency that plan
        // measured, planned five. `ml` met all six there with the pool on no cores of its
        // own; the oracle met five in every interval but a few.
        let (o, reference, loads) = diurnal_gold_at_101_s();
        let found = o.search(&loads, &reference);
        let (_, truth) = o
            .truth
            .evaluate(&found.plan, &loads, &o.gpu_effective(), o.downtime());
        assert_eq!(o.score_of(&truth), Score(vec![6]), "{:?}", found.plan);
        assert_eq!(found.score, Score(vec![6]));
    }

    #[test]
    fn a_service_that_only_reaches_its_bare_target_is_still_served() {
        // moses beside a streaming job with its target set so that the best it can do is
        // 0.985 of it: no round reaches the first margin (0.97), and a service left out
        // runs in the pool's ways, where it misses.
        let text = |target: f64| {
            format!(
                "name = \"tight\"\nduration_s = 10\n[host]\npreset = \"xeon-gold-6338\"\n\
                 [[service]]\nname = \"moses\"\nmodel = \"moses\"\np99_target_ms = {target}\n\
                 load = {{ kind = \"constant\", fraction = 0.3 }}\n\
                 [[best_effort]]\nname = \"stream\"\nmodel = \"stream\"\n"
            )
        };
        let here = std::path::Path::new(".");
        let loose = Arc::new(Scenario::from_toml(&text(1e6), "loose", here).unwrap());
        let tm = TruthModel::new(Arc::clone(&loose));
        let loads = tm.loads_at(0.5);
        // Its best: every core but the pool's one, every way but the pool's, the pool
        // throttled to the platform's minimum.
        let cap = loose.capacity();
        let best = Plan {
            services: BTreeMap::from([(
                "moses".to_string(),
                Allocation {
                    cores: cap.cores - 1,
                    llc_ways: WayRange::new(0, cap.llc_ways - 1),
                    mba_pct: MBA_MAX_PCT,
                    gpu_mps_pct: None,
                },
            )]),
            best_effort: Allocation {
                cores: 1,
                llc_ways: WayRange::new(cap.llc_ways - 1, 1),
                mba_pct: cap.mba_min_pct,
                gpu_mps_pct: None,
            },
            gpu_memory_mib: Default::default(),
        };
        let n = loads.len();
        let (_, t) = tm.evaluate(&best, &loads, &vec![None; n], &vec![0.0; n]);
        let target = t.p99_ms["moses"] / 0.985;
        let tight = Arc::new(Scenario::from_toml(&text(target), "tight", here).unwrap());
        let mut o = OraclePolicy::new(TruthModel::new(Arc::clone(&tight)));
        let plan = o.initial().plan;
        let (truth, _) = first_truth(&tight, &plan);
        assert!(
            truth.p99_ms["moses"] <= target,
            "moses at {} of its target: {plan:?}",
            truth.p99_ms["moses"] / target
        );
    }

    #[test]
    fn an_earlier_rounds_fewest_cores_start_a_later_search_and_change_no_option() {
        // The diurnal crowded Gold: the range options under a raised latency and a tighter
        // margin, searched from the answers of the first round, are those searched from
        // nothing; and the raise moves some answer, so the bound was put to use.
        let (o, reference, loads) = diurnal_gold_at_101_s();
        let start = o.start(&loads, &reference);
        let tenants = o
            .truth
            .tenants(&reference, &loads, &o.gpu_effective(), o.downtime());
        let lc = o.lc();
        type Listed = (u32, Place, Vec<(usize, u32)>);
        let options = |frozen: &Frozen| -> Vec<Listed> {
            let eval = Evaluator {
                oracle: &o,
                tenants: &tenants,
                lc: &lc,
                frozen,
                be_mba: MBA_MAX_PCT,
            };
            eval.range_options(true)
                .into_iter()
                .map(|x| (x.members, x.place, x.cores))
                .collect()
        };
        let first = options(&start);
        let raised = Frozen {
            latency: start.latency * 1.3,
            margin: start.margin * 0.9,
            ..start.clone()
        };
        let bounded = options(&raised);
        assert_eq!(o.answers.borrow().len(), 2, "both states' answers kept");
        o.answers.borrow_mut().clear();
        let fresh = options(&raised);
        assert_eq!(bounded, fresh);
        assert_ne!(first, fresh, "the raise needs more cores somewhere");
    }
}
