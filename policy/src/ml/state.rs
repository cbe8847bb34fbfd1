//! Step 1 of the `ml` policy and the rules that look back in time: what it remembers of each
//! latency-critical service between ticks, the online correction of its predictions, the
//! misses that send it to the fallback, the glitch check, and the hysteresis that keeps a
//! safe allocation until a cheaper one has lasted.

use cohabit_core::Allocation;
use cohabit_models::posterior::Blr;

use super::gpu::GpuModel;
use super::growth::GrowthCheck;
use super::posterior::{self, Regressor};
use super::predict::{Basis, Pred, MEASUREMENT_SIGMA, SATURATED};
use super::MlConfig;

/// Smallest measurement noise assumed (ln units).
const NOISE_FLOOR: f64 = 0.02;

/// Sampling variance of ln p99 times the requests it rests on: for an exponential tail,
/// the p99 of `n` requests has a standard error in ln units of about
/// `sqrt(0.99 / (0.01 n)) / ln 100`, so `SAMPLING_VAR / n` is its variance (0.15² for 200
/// requests, 0.05² for about 1,900).
const SAMPLING_VAR: f64 = 0.99 / 0.01 / (4.605_170_185_988_091 * 4.605_170_185_988_091);

/// Busy fraction of its cores above which a service counts as saturated.
const SATURATED_UTIL: f64 = 0.9;

/// Relative load change under which a sudden saturated reading waits for confirmation.
const GLITCH_LOAD_CHANGE: f64 = 0.2;

/// What a reading of the allocation a prediction was made for says: step 1's input.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Measurement {
    pub(super) last: LastPrediction,
    /// Measured ln(p99/target).
    pub(super) measured: f64,
    /// The intervals the anchor's reading and this one rest on ([`pair_variance`]).
    pub(super) windows: (u32, u32),
    /// Requests per second then.
    pub(super) rps: Option<f64>,
}

/// The last prediction made for a service: for which allocation, and what.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct LastPrediction {
    pub(super) alloc: Allocation,
    /// Anchored model mean, before the bias.
    pub(super) base: f64,
    /// Bias-corrected mean.
    pub(super) corrected: f64,
    pub(super) sigma: f64,
    /// The model's own spread (before the service's factor and the measurement noise).
    pub(super) model_sigma: f64,
    /// Whether the allocation differed from the one in force when predicted.
    pub(super) moved: bool,
    /// Whether it gave back (no more cores nor ways than the one in force, fewer of one).
    pub(super) shrank: bool,
    /// Whether it was anchored on a reading (see [`super::predict::Predictor::predict_many`]):
    /// only an anchored prediction's error is the model's error on a *change*, which the
    /// bias and the spread factor learn; a level predicted past saturation is off by
    /// whatever the queue did.
    pub(super) anchored: bool,
    /// What the service's posterior regressed the prediction on, where it made it: the
    /// reading of the allocation teaches the posterior its error there.
    pub(super) regressor: Option<Regressor>,
    /// The prediction without the posterior's correction (the model's, anchored, and the
    /// bias): what the posterior learns the error of.
    pub(super) prior_mean: f64,
    /// The variance of the prediction's error that no reading removes
    /// ([`super::predict::Pred::irreducible`]).
    pub(super) irreducible: f64,
}

/// One interval's reading of a service: measured ln(p99/target) and requests per second.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Reading {
    pub(super) log_q: f64,
    pub(super) rps: Option<f64>,
}

/// What the policy remembers of one latency-critical service between ticks.
#[derive(Debug, Clone)]
pub(super) struct ServiceState {
    /// How this tick's predictions are made.
    pub(super) basis: Basis,
    /// This tick's scored candidates (cores, ways) at MBA `scored_mba`, for reuse.
    pub(super) scored: Vec<((u32, u32), Pred)>,
    /// The MBA of the scored candidates.
    pub(super) scored_mba: u8,
    /// Last tick's reading.
    pub(super) prev_reading: Option<Reading>,
    /// Exponentially weighted error of the anchored predictions.
    pub(super) bias: f64,
    /// Errors the bias has averaged so far (see [`ServiceState::correct`]).
    pub(super) bias_samples: u32,
    /// Exponentially weighted squared standardised error of predictions for a *changed*
    /// allocation: the model's spread is scaled by its square root for this service
    /// (online recalibration; starts at 1).
    pub(super) z2: f64,
    /// Exponentially weighted squared error of predictions for an unchanged allocation:
    /// the measurement's own noise.
    pub(super) noise2: f64,
    /// Intervals the last reading's p99 rested on (its latency window, at least 1).
    pub(super) window: u32,
    pub(super) misses: u32,
    pub(super) last: Option<LastPrediction>,
    /// A reading the glitch check held on, with the prediction it would correct: learnt
    /// from when the next reading confirms it ([`ServiceState::learn`]).
    pub(super) unconfirmed: Option<Measurement>,
    pub(super) fallback_until_ms: Option<u64>,
    /// Why the service is on the fallback (words for people).
    pub(super) fallback_why: String,
    pub(super) surplus_ticks: u32,
    pub(super) seen: bool,
    pub(super) gpu: GpuModel,
    /// Intervals in a row the service was held measured under `explore_below`.
    pub(super) calm_ticks: u32,
    /// The exploring cut made last tick, if any.
    pub(super) probe: Option<Probe>,
    /// The allocation an exploring cut found past the margin: the service's cliff.
    pub(super) cliff: Option<Cliff>,
    /// When a cliff found by the fallback's give-back lapses ([`FALLBACK_CLIFF_LAPSE`]).
    pub(super) cliff_lapse: Lapse,
    /// Allocations measured not enough (a give-back past the margin, or any allocation
    /// over the target): no candidate at or under one goes while it binds
    /// ([`ServiceState::measured_floor`]). The newest [`MAX_MEASURED_CLIFFS`]; a weak one
    /// (read within the target) is forgotten when two readings in a row within the margin
    /// contradict it ([`ServiceState::note_safe`]).
    pub(super) measured_cliffs: Vec<MeasuredCliff>,
    /// Intervals in a row measured over the target.
    pub(super) over_ticks: u32,
    /// Until when it may not take in the packer's triage, having given in one.
    pub(super) yielded_until_ms: Option<u64>,
    /// The most cores and the most ways it has been measured saturated on (p99 at
    /// [`SATURATED`] times its target or more) since a reading last said it was not
    /// ([`ServiceState::note_saturation`]).
    pub(super) saturated_at: Option<(u32, u32)>,
    /// Allocations measured within the margin for two intervals in a row, with the load
    /// and the neighbours' bandwidth then ([`ServiceState::certified`]). The newest
    /// [`MAX_MEASURED_SAFE`].
    pub(super) measured_safe: Vec<Safe>,
    /// (cores, ways) in force last tick and the reading then, for [`ServiceState::note_safe`].
    pub(super) last_in_force: Option<((u32, u32), f64)>,
    /// Requests per second at which the pool's ways were measured not enough for the
    /// service: it is not put on them again while its load is at least [`CLIFF_LOAD`] of
    /// this (0 when the load was not measured: never again).
    pub(super) pool_ways_cliff: Option<f64>,
    /// The last plausible busy-cores reading and the ticks since it was taken
    /// ([`ServiceState::busy_cores`]).
    pub(super) busy: Option<(f64, u32)>,
    /// The service's posterior on this host ([`super::posterior`]): `None` until its prior
    /// is fitted (the first tick with an anchor), or when `ml` keeps none.
    pub(super) posterior: Option<Blr>,
    /// What the fallback's growths showed ([`super::growth`]).
    pub(super) growth: GrowthCheck,
}

/// An exploring cut: from the allocation that was safe to the one being tried, both
/// (cores, ways), and whether it is the fallback's give-back ([`ExploreInput::fallback`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Probe {
    pub(super) from: (u32, u32),
    pub(super) to: (u32, u32),
    pub(super) fallback: bool,
}

/// Where a cut (exploring, or a give-back) went past the margin: (cores, ways) at `rps`
/// requests per second.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Cliff {
    pub(super) cores: u32,
    pub(super) ways: u32,
    pub(super) rps: f64,
}

/// A cliff measured from a reading ([`ServiceState::note_outcome`]), and whether it is weak:
/// a give-back read past the margin but within the target, which does not bind while a
/// neighbour is over its target ([`ServiceState::measured_floor`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct MeasuredCliff {
    pub(super) at: Cliff,
    pub(super) weak: bool,
}

/// An allocation measured within the margin: (cores, ways) at `rps` requests per second
/// with the neighbours' bandwidth `neighbour_bw` (bytes/s).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Safe {
    pub(super) cores: u32,
    pub(super) ways: u32,
    pub(super) rps: f64,
    pub(super) neighbour_bw: f64,
}

/// Allocations measured safe remembered per service.
const MAX_MEASURED_SAFE: usize = 8;

/// A safe measurement vouches for neighbours streaming up to this much more.
const SAFE_NEIGHBOUR_SLACK: f64 = 1.05;

/// Measured cliffs remembered per service.
const MAX_MEASURED_CLIFFS: usize = 4;

/// What the exploration rule is given at one tick.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct ExploreInput {
    /// (cores, ways) in force.
    pub(super) current: (u32, u32),
    /// Measured ln(p99/target).
    pub(super) measured: Option<f64>,
    pub(super) rps: Option<f64>,
    /// Busy cores measured.
    pub(super) busy_cores: Option<f64>,
    /// This tick's plan keeps the allocation in force.
    pub(super) held: bool,
    /// ln(margin): past it a cut is undone.
    pub(super) limit: f64,
    /// ln(explore_below): under it an interval is calm.
    pub(super) calm: f64,
    /// Calm intervals in a row before a cut.
    pub(super) after: u32,
    /// Fraction of the cores a cut takes.
    pub(super) step: f64,
    /// The model vouches for no candidate and the fallback holds what is in force: the cut
    /// is the fallback's measured give-back, at least one core whatever `step`.
    pub(super) fallback: bool,
}

/// What the exploration rule says.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum ExploreStep {
    /// Nothing to do: the plan stands.
    Stay,
    /// Last tick's cut went past the margin: back to (cores, ways).
    Revert((u32, u32)),
    /// Try (cores, ways).
    Cut((u32, u32)),
}

/// Ticks in a row a missing reading is replaced by the last one: a service's busy cores
/// ([`ServiceState::busy_cores`]) and the pool's bandwidth (`MlPolicy::plan_pool_levels`).
pub(super) const MAX_STALE_TICKS: u32 = 2;

/// Load at or above this fraction of a cliff's makes the cliff bind.
pub(super) const CLIFF_LOAD: f64 = 0.9;

/// Ticks after which the cliff a fallback give-back found lapses, doubling with each such
/// cliff of the service ([`ServiceState::explore`]): a cliff read once, on a host whose
/// readings are noisy enough that the model is unsure, is retried after a while, so that
/// one noisy reading does not end the give-backs for a whole run, while a true cliff costs
/// a violation a doubling interval (docs/EXPERIMENTS.md, "The fallback gives back,
/// measured").
pub(super) const FALLBACK_CLIFF_LAPSE: u32 = 60;

/// A hold that lapses after a number of ticks that doubles each time one is started: a
/// verdict read once on a noisy host is retried, later each time it is read again.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct Lapse {
    /// Ticks left, while a hold runs.
    left: Option<u32>,
    /// Holds started so far.
    started: u32,
}

impl Lapse {
    /// Starts a hold of `base` ticks, doubled for each hold started before (up to 2¹⁰
    /// times); returns its length.
    pub(super) fn start(&mut self, base: u32) -> u32 {
        let ticks = base.saturating_mul(1 << self.started.min(10));
        self.started += 1;
        self.left = Some(ticks);
        ticks
    }

    /// Ends the running hold, if any, without it counting as lapsed.
    pub(super) fn stop(&mut self) {
        self.left = None;
    }

    /// One tick: true at the tick the running hold lapses (`base` ticks after the one that
    /// started it, doubled as [`Lapse::start`] says).
    pub(super) fn tick(&mut self) -> bool {
        match self.left {
            Some(0) => {
                self.left = None;
                true
            }
            Some(n) => {
                self.left = Some(n - 1);
                false
            }
            None => false,
        }
    }
}

/// A cut never leaves the service's busy cores more than this fraction of its cores:
/// queueing delay explodes toward saturation, so a cliff lies there whatever the service.
const EXPLORE_MAX_UTIL: f64 = 0.8;

impl Default for ServiceState {
    fn default() -> Self {
        Self {
            basis: Basis::default(),
            prev_reading: None,
            scored: Vec::new(),
            scored_mba: cohabit_core::MBA_MAX_PCT,
            bias: 0.0,
            bias_samples: 0,
            z2: 1.0,
            noise2: MEASUREMENT_SIGMA * MEASUREMENT_SIGMA,
            window: 1,
            misses: 0,
            last: None,
            unconfirmed: None,
            fallback_until_ms: None,
            fallback_why: String::new(),
            surplus_ticks: 0,
            seen: false,
            gpu: GpuModel::default(),
            calm_ticks: 0,
            probe: None,
            cliff: None,
            cliff_lapse: Lapse::default(),
            measured_cliffs: Vec::new(),
            over_ticks: 0,
            yielded_until_ms: None,
            saturated_at: None,
            measured_safe: Vec::new(),
            last_in_force: None,
            pool_ways_cliff: None,
            busy: None,
            posterior: None,
            growth: GrowthCheck::default(),
        }
    }
}

/// A CPU service's tick as [`ServiceState::begin_tick`] starts it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Tick {
    /// First tick of the service: it is placed from the model at once.
    pub(super) new_service: bool,
    /// How this tick's candidates are predicted.
    pub(super) basis: Basis,
    /// Last tick's reading.
    pub(super) prev: Option<Reading>,
    /// This tick's reading.
    pub(super) reading: Option<Reading>,
}

/// What the hysteresis rule says about the allocation in force.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Hysteresis {
    /// The allocation in force is kept.
    pub(super) keep: bool,
    /// Intervals a cheaper admissible allocation has existed, this one included.
    pub(super) surplus_ticks: u32,
}

/// Variance of the difference of two readings of one allocation at one load, resting on
/// `prev` and then `cur` intervals of a latency window (each interval's reading of
/// variance v, the windows' readings their means), in units of 2v: that of two readings of
/// one interval each. A window that grew by the newest interval shares all of the older
/// reading's intervals (1/(n(n-1)) v); one that slid at its cap shares all but one at each
/// end (2/n² v); a restarted one shares none (1 + 1/prev).
pub(super) fn pair_variance(prev: u32, cur: u32) -> f64 {
    let (p, c) = (f64::from(prev.max(1)), f64::from(cur.max(1)));
    let v = if cur <= 1 {
        1.0 + 1.0 / p
    } else if cur == prev + 1 {
        1.0 / (c * (c - 1.0))
    } else if cur == prev {
        2.0 / (c * c)
    } else {
        1.0 / p + 1.0 / c
    };
    v / 2.0
}

impl ServiceState {
    /// Whether the pool's ways may be offered to the service this tick: only while it is
    /// measured within its margin (`safe`), and not at a load near one at which it was
    /// measured past its margin on them (`on_pool` and not `safe`: remembered here, at `rps`).
    pub(super) fn pool_ways_allowed(
        &mut self,
        on_pool: bool,
        safe: bool,
        rps: Option<f64>,
    ) -> bool {
        if on_pool && !safe {
            self.pool_ways_cliff = Some(rps.unwrap_or(0.0));
        }
        safe && self
            .pool_ways_cliff
            .is_none_or(|c| rps.is_some_and(|r| r < CLIFF_LOAD * c))
    }

    /// This tick's busy cores for the give-back floor: the reading when it is plausible
    /// (finite, not negative, and not zero while the service serves requests, which is a
    /// counter glitch), else the last plausible one for up to [`MAX_STALE_TICKS`] ticks,
    /// so that one missing reading does not open the floor for a tick. Never read, none.
    pub(super) fn busy_cores(&mut self, busy: Option<f64>, rps: Option<f64>) -> Option<f64> {
        let serving = rps.is_some_and(|r| r > 0.0);
        let plausible = busy.filter(|b| b.is_finite() && *b >= 0.0 && !(*b == 0.0 && serving));
        match (plausible, self.busy) {
            (Some(b), _) => {
                self.busy = Some((b, 0));
                Some(b)
            }
            (None, Some((b, stale))) if stale < MAX_STALE_TICKS => {
                self.busy = Some((b, stale + 1));
                Some(b)
            }
            _ => None,
        }
    }

    /// Factor on the model's spread for this service.
    pub(super) fn sigma_factor(&self) -> f64 {
        self.z2.sqrt().clamp(0.3, 3.0)
    }

    /// A basis of prediction anchored on `anchor`, when there is one. Its noise is that of
    /// the difference between the anchor (resting on [`Self::window`] intervals) and the
    /// next reading of a changed allocation (one interval: a change restarts the window).
    fn basis_for(&self, anchor: Option<f64>) -> Basis {
        Basis {
            anchor,
            bias: self.bias,
            factor: self.sigma_factor(),
            noise: (self.noise2 * pair_variance(self.window, 1)).sqrt(),
        }
    }

    /// Starts a CPU service's tick with its reading (`measured` ln(p99/target) at `rps`
    /// requests per second): forgets last tick's scored candidates, sets the basis of
    /// prediction (anchored on the reading, except past saturation: queues growing,
    /// timeouts, where the model's differences mean little and its levels are used) and
    /// remembers the reading for the next tick.
    pub(super) fn begin_tick(
        &mut self,
        measured: Option<f64>,
        rps: Option<f64>,
        requests: Option<f64>,
    ) -> Tick {
        self.scored.clear();
        let new_service = !self.seen;
        self.seen = true;
        // The first reading sets the prior noise no lower than its own sampling error: the
        // p99 of `requests` requests (see [`SAMPLING_VAR`]).
        if let (true, Some(n)) = (new_service, requests) {
            self.noise2 = self.noise2.max((SAMPLING_VAR / n).min(1.0));
        }
        self.basis = self.basis_for(measured.filter(|q| *q <= SATURATED.ln()));
        let prev = self.prev_reading;
        let reading = measured.map(|q| Reading { log_q: q, rps });
        self.prev_reading = reading;
        Tick {
            new_service,
            basis: self.basis,
            prev,
            reading,
        }
    }

    /// Step 1 for one reading of the allocation its prediction was made for: corrects the
    /// bias, noise and spread factor ([`ServiceState::correct`]) and notes what it says of
    /// the service's cliff ([`ServiceState::note_outcome`]).
    pub(super) fn learn(&mut self, o: &Measurement, cfg: &MlConfig) {
        self.teach_posterior(o);
        self.correct(&o.last, o.measured, o.windows, cfg);
        self.note_outcome(&o.last, o.measured, o.rps, cfg.margin.ln());
    }

    /// Step 1 for the posterior: the anchored prediction's error, measured less the
    /// prediction without the posterior's correction, at the regressor it was made with,
    /// with what of it no reading removes as its noise. As for the bias, only an anchored
    /// prediction, read short of saturation, teaches.
    fn teach_posterior(&mut self, o: &Measurement) {
        let (Some(blr), Some(z)) = (&mut self.posterior, &o.last.regressor) else {
            return;
        };
        if !o.last.anchored || o.measured >= SATURATED.ln() {
            return;
        }
        posterior::learn(blr, z, o.measured - o.last.prior_mean, o.last.irreducible);
    }

    /// Step 1: `measured` (ln(p99/target)) was read under the allocation `last` predicted
    /// for. Its error updates the bias; an unchanged allocation's surprise the measurement
    /// noise, a changed one's the model's spread factor; a violation more than the
    /// tolerance (or two spreads) above the prediction is a miss, a reading within the
    /// target ends a run of misses.
    ///
    /// `windows`: the intervals the anchor's reading and this one rested on
    /// ([`pair_variance`]); `noise2` is kept as the noise of two one-interval readings.
    pub(super) fn correct(
        &mut self,
        last: &LastPrediction,
        measured: f64,
        windows: (u32, u32),
        cfg: &MlConfig,
    ) {
        let pair = pair_variance(windows.0, windows.1);
        let alpha = cfg.correction_weight;
        let tol = cfg.miss_tolerance;
        let err = measured - last.base;
        let surprise = measured - last.corrected;
        // Only an anchored prediction's error teaches the bias, the noise and the spread
        // factor (see `LastPrediction::anchored`): before this rule the first error at
        // start-up, a level predicted for a saturated service, set moses's bias to -0.7 and
        // left it under-provisioned for three or four intervals.
        if last.anchored {
            // The bias starts with no evidence, not with evidence of none: until it has
            // seen 1/alpha errors it is their plain mean (the n-th weighs 1/n). A saturated
            // reading is not a sample of the error (its size is the clipping's): it weighs
            // alpha and does not count.
            let w = if measured < SATURATED.ln() {
                self.bias_samples = self.bias_samples.saturating_add(1);
                alpha.max(1.0 / f64::from(self.bias_samples))
            } else {
                alpha
            };
            self.bias = ((1.0 - w) * self.bias + w * err).clamp(-2.0, 2.0);
            // An unchanged allocation measures the noise; a changed one the model's spread.
            if !last.moved {
                self.noise2 = ((1.0 - alpha) * self.noise2 + alpha * surprise * surprise / pair)
                    .clamp(NOISE_FLOOR * NOISE_FLOOR, 1.0);
            } else if last.model_sigma > 0.01 {
                let excess = (surprise * surprise - self.noise2 * pair).max(0.0);
                let z2 = excess / (last.model_sigma * last.model_sigma);
                self.z2 = ((1.0 - alpha) * self.z2 + alpha * z2).clamp(0.0, 100.0);
            }
        }
        if measured > 0.0 && surprise > tol.max(2.0 * last.sigma) {
            self.misses += 1;
        } else if measured <= 0.0 {
            self.misses = 0;
        }
    }

    /// What `last`'s allocation measured (`measured` at `rps` requests per second) says of
    /// the service's cliff. Latency only grows as cores or ways shrink (or load rises), so an
    /// allocation that was not enough rules out every allocation under it at that load or
    /// more: it is remembered as a cliff (replacing those it covers, the oldest dropped past
    /// [`MAX_MEASURED_CLIFFS`]) when it was a give-back measured past the margin `limit`,
    /// or any allocation measured over the target but short of saturation (past it, a
    /// reading may be a counter glitch, and the model's levels take over anyway).
    pub(super) fn note_outcome(
        &mut self,
        last: &LastPrediction,
        measured: f64,
        rps: Option<f64>,
        limit: f64,
    ) {
        let gave_back_too_much = last.shrank && measured > limit;
        let over_target = measured > 0.0 && measured <= SATURATED.ln();
        if !gave_back_too_much && !over_target {
            return;
        }
        let c = Cliff {
            cores: last.alloc.cores,
            ways: last.alloc.llc_ways.count,
            rps: rps.unwrap_or(0.0),
        };
        self.measured_cliffs
            .retain(|o| !(o.at.cores <= c.cores && o.at.ways <= c.ways));
        self.measured_cliffs.push(MeasuredCliff {
            at: c,
            weak: !over_target,
        });
        if self.measured_cliffs.len() > MAX_MEASURED_CLIFFS {
            self.measured_cliffs.remove(0);
        }
    }

    /// Notes a reading `measured` (ln(p99/target); `None` without one, or where the ways in
    /// force are not the service's own) of `in_force` (cores, ways): past saturation, the
    /// most cores and ways measured saturated grow to cover it; under it, they are
    /// forgotten. Returns them.
    pub(super) fn note_saturation(
        &mut self,
        in_force: (u32, u32),
        measured: Option<f64>,
    ) -> Option<(u32, u32)> {
        match measured {
            Some(q) if q >= SATURATED.ln() => {
                let (c, w) = self.saturated_at.unwrap_or(in_force);
                self.saturated_at = Some((c.max(in_force.0), w.max(in_force.1)));
            }
            Some(_) => self.saturated_at = None,
            None => {}
        }
        self.saturated_at
    }

    /// Notes this tick's reading `measured` of the allocation in force `current` (cores,
    /// ways) at `rps` requests per second beside `neighbour_bw`: the second reading in a row
    /// of one allocation within the margin `limit` makes it a safe measurement (replacing
    /// those it vouches for; past [`MAX_MEASURED_SAFE`] the oldest of the allocation with the
    /// most measurements is dropped; not kept when one already kept vouches for it), and
    /// forgets the weak cliffs it contradicts.
    pub(super) fn note_safe(
        &mut self,
        current: (u32, u32),
        measured: Option<f64>,
        rps: Option<f64>,
        neighbour_bw: f64,
        limit: f64,
    ) {
        let before = self.last_in_force.take();
        let Some(q) = measured else { return };
        self.last_in_force = Some((current, q));
        let (Some(rps), Some((was, q0))) = (rps, before) else {
            return;
        };
        if was != current || q > limit || q0 > limit {
            return;
        }
        let new = Safe {
            cores: current.0,
            ways: current.1,
            rps,
            neighbour_bw,
        };
        // Two readings in a row within the margin say more than the one a weak cliff rests
        // on (a give-back read past the margin, within the target): one at no fewer
        // resources, at a load this one carries at least CLIFF_LOAD of, was noise (on the
        // Gold `mba-stream` seed 0 a weak cliff from one reading of moses on 29 cores, 0.94
        // of its target, held it there for 270 s, read at 0.68–0.75 all along). A cliff
        // read over the target is a violation: it stays (forgetting those too gave the same
        // best effort over 200 runs, one run fewer meeting QoS).
        self.measured_cliffs.retain(|m| {
            !(m.weak
                && m.at.cores >= new.cores
                && m.at.ways >= new.ways
                && new.rps >= CLIFF_LOAD * m.at.rps)
        });
        // One already kept at no more resources, no less load and no quieter neighbours
        // says more than this one: it is not added (else a run of readings at a steady
        // allocation, each a little under the load of the best, pushes the best out).
        if self.measured_safe.iter().any(|o| {
            o.cores <= new.cores
                && o.ways <= new.ways
                && o.rps >= new.rps
                && o.neighbour_bw >= new.neighbour_bw
        }) {
            return;
        }
        // An older one at no fewer resources, no more load and no busier neighbours says
        // less than this one.
        self.measured_safe.retain(|o| {
            !(o.cores >= new.cores
                && o.ways >= new.ways
                && o.rps <= new.rps
                && o.neighbour_bw <= new.neighbour_bw)
        });
        self.measured_safe.push(new);
        if self.measured_safe.len() > MAX_MEASURED_SAFE {
            self.forget_one_safe();
        }
    }

    /// Drops the oldest measurement of the allocation the memory holds most measurements
    /// of. A service held at one allocation through a load swing reads it at many (load,
    /// neighbour traffic) pairs none of which says more than another, and dropping the
    /// oldest overall let them push out every other allocation: on the E5 `demo` memcached,
    /// measured safe on 12 cores before its load step, stayed on 18 for the 200 s after
    /// the load came back down (with this rule it went back to 13).
    fn forget_one_safe(&mut self) {
        let held = |a: &Safe| {
            self.measured_safe
                .iter()
                .filter(|o| (o.cores, o.ways) == (a.cores, a.ways))
                .count()
        };
        let most = self.measured_safe.iter().map(held).max().unwrap_or(0);
        if let Some(i) = self.measured_safe.iter().position(|o| held(o) == most) {
            self.measured_safe.remove(i);
        }
    }

    /// The allocations (cores, ways) measured safe at `rps` or more requests per second
    /// beside neighbours streaming no less than `neighbour_bw` (within
    /// [`SAFE_NEIGHBOUR_SLACK`]): latency only falls as the load does, so they are safe now
    /// whatever the model's spread says. No load reading, none.
    pub(super) fn certified(&self, rps: Option<f64>, neighbour_bw: f64) -> Vec<(u32, u32)> {
        let Some(rps) = rps else { return Vec::new() };
        self.measured_safe
            .iter()
            .filter(|s| rps <= s.rps && neighbour_bw <= s.neighbour_bw * SAFE_NEIGHBOUR_SLACK)
            .map(|s| (s.cores, s.ways))
            .collect()
    }

    /// The frontier `points` (cores, ways) with every point at or under a binding measured
    /// cliff lifted to one core more than the cliff's. A cliff binds while the load is at
    /// least [`CLIFF_LOAD`] of its own (an unknown load binds): where the model predicted
    /// an allocation enough and the host measured it not, the measurement wins. (Cores are
    /// lifted, not ways: a frontier point's way count is what it was searched for.)
    pub(super) fn measured_floor(
        &self,
        points: Vec<(u32, u32)>,
        rps: Option<f64>,
        skip_weak: bool,
    ) -> Vec<(u32, u32)> {
        let binding: Vec<&Cliff> = self
            .measured_cliffs
            .iter()
            .filter(|m| rps.is_none_or(|r| r >= CLIFF_LOAD * m.at.rps) && !(skip_weak && m.weak))
            .map(|m| &m.at)
            .collect();
        if binding.is_empty() {
            return points;
        }
        let mut out: Vec<(u32, u32)> = Vec::with_capacity(points.len());
        for (c, w) in points {
            let floor = binding
                .iter()
                .filter(|k| w <= k.ways)
                .map(|k| k.cores + 1)
                .max()
                .unwrap_or(0);
            let p = (c.max(floor), w);
            if !out.contains(&p) {
                out.push(p);
            }
        }
        out
    }

    /// The fallback trigger on misses: `misses_to_fallback` misses in a row put the service
    /// on the fallback for `fallback_hold_ms`. Returns why while it is there.
    pub(super) fn on_fallback(&mut self, now_ms: u64, cfg: &MlConfig) -> Option<String> {
        if self.misses >= cfg.misses_to_fallback {
            self.fallback_until_ms = Some(now_ms + cfg.fallback_hold_ms);
            self.fallback_why = format!("predictions missed {} times in a row", self.misses);
            self.misses = 0;
        }
        if let Some(until) = self.fallback_until_ms {
            if now_ms < until {
                return Some(self.fallback_why.clone());
            }
            self.fallback_until_ms = None;
        }
        None
    }

    /// Hysteresis: a `safe` allocation in force is kept until something `cheaper` has been
    /// admissible for `shrink_after` intervals in a row measured `within_margin` (a new
    /// service is placed at once). The count restarts whenever the allocation is not kept,
    /// and at a reading past the margin that is still safe (one between the margin and the
    /// target): a service is never given back from the edge, where its frontier is searched
    /// with the growth's spread (counted there, fewer runs met QoS, with more actuations;
    /// docs/EXPERIMENTS.md, "Results history").
    pub(super) fn hysteresis(
        &mut self,
        safe: bool,
        within_margin: bool,
        cheaper: bool,
        new_service: bool,
        shrink_after: u32,
    ) -> Hysteresis {
        self.surplus_ticks = if safe && within_margin && cheaper {
            self.surplus_ticks + 1
        } else {
            0
        };
        let out = Hysteresis {
            keep: safe && !new_service && self.surplus_ticks < shrink_after,
            surplus_ticks: self.surplus_ticks,
        };
        if !out.keep {
            self.surplus_ticks = 0;
        }
        out
    }
}

impl ServiceState {
    /// Safe exploration of the service's cliff, guarded by its measured margin: a service
    /// held for `after` intervals in a row measured under `calm` loses `step` of its cores,
    /// rounded down (a service with fewer than `1 / step` cores is not probed, except by
    /// the fallback's give-back, which takes at least one core); if the next
    /// reading under the cut is past `limit` (or missing), the cut is undone at once and
    /// remembered as the service's cliff, under which no cut goes again while the load is at
    /// least [`CLIFF_LOAD`] of the cliff's (with no more ways than then), nor where its
    /// measured busy cores would exceed [`EXPLORE_MAX_UTIL`] of what is left (no busy
    /// reading, no cut). The model's spread near a cliff is what keeps it from cutting
    /// there; this learns the cliff of this service on this host instead.
    pub(super) fn explore(&mut self, x: &ExploreInput) -> ExploreStep {
        if self.cliff_lapse.tick() {
            self.cliff = None;
        }
        if let Some(p) = self.probe.take() {
            if x.current == p.to && x.measured.is_none_or(|q| q > x.limit) {
                self.cliff = Some(Cliff {
                    cores: p.to.0,
                    ways: p.to.1,
                    rps: x.rps.unwrap_or(0.0),
                });
                // A cliff the fallback's give-back found lapses, later each time: where
                // the model is unsure, readings are often noisy, and one of them must not
                // end the give-backs for good.
                if p.fallback {
                    self.cliff_lapse.start(FALLBACK_CLIFF_LAPSE);
                } else {
                    self.cliff_lapse.stop();
                }
                self.calm_ticks = 0;
                return ExploreStep::Revert(p.from);
            }
        }
        let calm = x.held && x.measured.is_some_and(|q| q <= x.calm);
        self.calm_ticks = if calm { self.calm_ticks + 1 } else { 0 };
        if self.calm_ticks < x.after || (x.step <= 0.0 && !x.fallback) {
            return ExploreStep::Stay;
        }
        let (cores, ways) = x.current;
        let floor = self
            .cliff
            .filter(|c| x.rps.unwrap_or(f64::MAX) >= CLIFF_LOAD * c.rps && ways <= c.ways)
            .map_or(0, |c| c.cores);
        // At most `step` of the cores: a service too small for one core to be that little
        // is not probed (one core of four is a quarter of its capacity, and such cuts were
        // most of the exploration's violations: 10 of 10 E5 `few-closids` runs kept QoS
        // without them, 0 with).
        let cut = u32::try_from(cohabit_core::whole((f64::from(cores) * x.step).floor()))
            .unwrap_or(0)
            .max(u32::from(x.fallback));
        if cut == 0 {
            return ExploreStep::Stay;
        }
        let Some(busy) = x.busy_cores else {
            return ExploreStep::Stay;
        };
        let busy_floor = u32::try_from(cohabit_core::whole((busy / EXPLORE_MAX_UTIL).ceil()))
            .unwrap_or(u32::MAX);
        let to = cores
            .saturating_sub(cut)
            .max(floor + 1)
            .max(busy_floor)
            .max(1);
        if to >= cores {
            return ExploreStep::Stay;
        }
        self.calm_ticks = 0;
        self.probe = Some(Probe {
            from: x.current,
            to: (to, ways),
            fallback: x.fallback,
        });
        ExploreStep::Cut((to, ways))
    }
}

/// The glitch check: a sudden saturated reading (p99 past [`SATURATED`] times the target
/// right after one within the target) with the load as it was a tick ago (within
/// [`GLITCH_LOAD_CHANGE`]) and idle cores (a saturated service serves no more than it can:
/// its busy cores tell) is most likely a counter glitch, and waits one tick.
pub(super) fn unconfirmed_saturation(
    now: Reading,
    prev: Reading,
    busy_cores: Option<f64>,
    cores: u32,
) -> bool {
    let same_load = match (now.rps, prev.rps) {
        (Some(a), Some(b)) if b > 0.0 => (a / b - 1.0).abs() < GLITCH_LOAD_CHANGE,
        _ => false,
    };
    let busy = busy_cores.map_or(0.0, |b| b / f64::from(cores.max(1)));
    now.log_q > SATURATED.ln() && prev.log_q <= 0.0 && same_load && busy < SATURATED_UTIL
}

/// Whether the allocation in force is safe to keep, given its reading `measured` and the
/// one before (`prev`), both ln(p99/target), and `limit` = ln(margin). The allocation in
/// force was just measured: that beats any prediction for it. One reading between the
/// margin and the target (noise, mostly) does not make it unsafe; two in a row, or one
/// over the target, do.
pub(super) fn safe_to_keep(measured: Option<f64>, prev: Option<Reading>, limit: f64) -> bool {
    measured.is_some_and(|q| q <= limit || (q <= 0.0 && prev.is_some_and(|r| r.log_q <= limit)))
}

#[cfg(test)]
mod tests {
    use super::super::predict::at_full_mba;
    use super::*;

    /// The exploration rule's input for `current` measured at `q` (ln p99/target) at 1000
    /// requests per second, held, with the defaults (margin 0.9, calm under 0.75, 5
    /// intervals, 15 % of the cores).
    fn explore_at(current: (u32, u32), q: f64) -> ExploreInput {
        ExploreInput {
            current,
            measured: Some(q),
            rps: Some(1000.0),
            busy_cores: Some(4.0),
            held: true,
            limit: 0.9f64.ln(),
            calm: 0.75f64.ln(),
            after: 5,
            step: 0.15,
            fallback: false,
        }
    }

    #[test]
    fn the_most_a_service_read_saturated_on_grows_until_a_reading_under_saturation() {
        let mut st = ServiceState::default();
        let sat = SATURATED.ln() + 1.0;
        assert_eq!(st.note_saturation((2, 2), Some(sat)), Some((2, 2)));
        // No reading: nothing learnt.
        assert_eq!(st.note_saturation((1, 1), None), Some((2, 2)));
        // Saturated on more cores and fewer ways: the most of each.
        assert_eq!(st.note_saturation((4, 1), Some(sat)), Some((4, 2)));
        // Under saturation (still over the target): forgotten.
        assert_eq!(st.note_saturation((4, 6), Some(0.5)), None);
        assert_eq!(st.note_saturation((1, 1), Some(sat)), Some((1, 1)));
    }

    #[test]
    fn a_service_held_calm_for_shrink_after_intervals_is_probed_with_a_cut() {
        let mut st = ServiceState::default();
        for _ in 0..4 {
            assert_eq!(
                st.explore(&explore_at((20, 6), 0.5f64.ln())),
                ExploreStep::Stay
            );
        }
        // The 5th calm interval: 15 % of 20 cores, 3.
        assert_eq!(
            st.explore(&explore_at((20, 6), 0.5f64.ln())),
            ExploreStep::Cut((17, 6))
        );
        // A reading within the margin under the cut keeps it, and the count starts again.
        assert_eq!(
            st.explore(&explore_at((17, 6), 0.8f64.ln())),
            ExploreStep::Stay
        );
        assert_eq!(st.cliff, None);
    }

    #[test]
    fn a_cut_past_the_margin_is_undone_and_remembered_as_the_cliff() {
        let mut st = ServiceState::default();
        for _ in 0..5 {
            st.explore(&explore_at((20, 6), 0.5f64.ln()));
        }
        // Under the cut (17 cores): 0.95 of the target > 0.9. Back to 20.
        assert_eq!(
            st.explore(&explore_at((17, 6), 0.95f64.ln())),
            ExploreStep::Revert((20, 6))
        );
        assert_eq!(
            st.cliff,
            Some(Cliff {
                cores: 17,
                ways: 6,
                rps: 1000.0
            })
        );
        // Calm again: the next cut stops just above the cliff (18, not 17).
        for _ in 0..4 {
            assert_eq!(
                st.explore(&explore_at((20, 6), 0.5f64.ln())),
                ExploreStep::Stay
            );
        }
        assert_eq!(
            st.explore(&explore_at((20, 6), 0.5f64.ln())),
            ExploreStep::Cut((18, 6))
        );
        // At 18 cores the cliff leaves no room: no further cut.
        st.probe = None;
        for _ in 0..10 {
            assert_eq!(
                st.explore(&explore_at((18, 6), 0.5f64.ln())),
                ExploreStep::Stay
            );
        }
        // Under a lower load (80 % of the cliff's) the cliff does not bind.
        let lighter = ExploreInput {
            rps: Some(800.0),
            ..explore_at((18, 6), 0.5f64.ln())
        };
        assert_eq!(st.explore(&lighter), ExploreStep::Cut((16, 6)));
    }

    #[test]
    fn a_service_not_held_or_not_calm_is_never_probed() {
        let mut st = ServiceState::default();
        for _ in 0..10 {
            // 0.8 of the target is within the margin but not calm.
            assert_eq!(
                st.explore(&explore_at((20, 6), 0.8f64.ln())),
                ExploreStep::Stay
            );
            let resizing = ExploreInput {
                held: false,
                ..explore_at((20, 6), 0.5f64.ln())
            };
            assert_eq!(st.explore(&resizing), ExploreStep::Stay);
        }
        // A single core is never cut.
        let mut st = ServiceState::default();
        for _ in 0..10 {
            let one = ExploreInput {
                busy_cores: Some(0.1),
                ..explore_at((1, 2), 0.3f64.ln())
            };
            assert_eq!(st.explore(&one), ExploreStep::Stay);
        }
    }

    #[test]
    fn the_fallbacks_give_back_takes_at_least_a_core_is_undone_past_the_margin_and_retried_later() {
        // On 2 cores with 0.3 busy, a quarter is half a core: exploration cuts none, the
        // fallback's give-back (the model vouching for nothing) one.
        let at = |current: (u32, u32), q: f64, fallback: bool| ExploreInput {
            busy_cores: Some(0.3),
            step: 0.25,
            fallback,
            ..explore_at(current, q.ln())
        };
        let mut st = ServiceState::default();
        for _ in 0..10 {
            assert_eq!(st.explore(&at((2, 1), 0.5, false)), ExploreStep::Stay);
        }
        let mut st = ServiceState::default();
        for _ in 0..4 {
            assert_eq!(st.explore(&at((2, 1), 0.5, true)), ExploreStep::Stay);
        }
        assert_eq!(st.explore(&at((2, 1), 0.5, true)), ExploreStep::Cut((1, 1)));
        assert!(st.probe.is_some_and(|p| p.fallback));
        // Read past the margin on one core: back to two, and not tried again at this load
        // until the cliff lapses, a minute later; then twice as long after the next.
        for lapse in [FALLBACK_CLIFF_LAPSE, 2 * FALLBACK_CLIFF_LAPSE] {
            assert_eq!(
                st.explore(&at((1, 1), 0.95, true)),
                ExploreStep::Revert((2, 1))
            );
            for _ in 0..lapse {
                assert_eq!(st.explore(&at((2, 1), 0.5, true)), ExploreStep::Stay);
            }
            assert_eq!(st.explore(&at((2, 1), 0.5, true)), ExploreStep::Cut((1, 1)));
        }
        // An exploring cut's cliff does not lapse.
        let mut st = ServiceState::default();
        let explore = |current: (u32, u32), q: f64| ExploreInput {
            busy_cores: Some(0.3),
            ..explore_at(current, q.ln())
        };
        for _ in 0..4 {
            assert_eq!(st.explore(&explore((8, 1), 0.5)), ExploreStep::Stay);
        }
        assert_eq!(st.explore(&explore((8, 1), 0.5)), ExploreStep::Cut((7, 1)));
        assert_eq!(
            st.explore(&explore((7, 1), 0.95)),
            ExploreStep::Revert((8, 1))
        );
        for _ in 0..1000 {
            assert_eq!(st.explore(&explore((8, 1), 0.5)), ExploreStep::Stay);
        }
    }

    #[test]
    fn a_cut_takes_at_most_step_of_the_cores_so_a_small_service_is_never_probed() {
        // 15 % of 6 cores is 0.9: a one-core cut would take 17 %, so none; of 7, one.
        let mut st = ServiceState::default();
        let at = |cores: u32| ExploreInput {
            busy_cores: Some(1.0),
            ..explore_at((cores, 4), 0.3f64.ln())
        };
        for _ in 0..10 {
            assert_eq!(st.explore(&at(6)), ExploreStep::Stay);
        }
        let mut st = ServiceState::default();
        for _ in 0..4 {
            assert_eq!(st.explore(&at(7)), ExploreStep::Stay);
        }
        assert_eq!(st.explore(&at(7)), ExploreStep::Cut((6, 4)));
    }

    #[test]
    fn a_cut_never_leaves_the_busy_cores_over_eight_tenths_of_the_cores() {
        // 15 busy cores of 20: a cut to 17 would be 0.88 busy; 19 (0.79) is as far as it
        // goes. With 16 busy, 20 is already the floor: no cut.
        let mut st = ServiceState::default();
        let busy = |b: f64| ExploreInput {
            busy_cores: Some(b),
            ..explore_at((20, 6), 0.5f64.ln())
        };
        for _ in 0..4 {
            assert_eq!(st.explore(&busy(15.0)), ExploreStep::Stay);
        }
        assert_eq!(st.explore(&busy(15.0)), ExploreStep::Cut((19, 6)));
        let mut st = ServiceState::default();
        for _ in 0..10 {
            assert_eq!(st.explore(&busy(16.0)), ExploreStep::Stay);
        }
        // Without a busy reading nothing is cut.
        let mut st = ServiceState::default();
        for _ in 0..10 {
            let blind = ExploreInput {
                busy_cores: None,
                ..explore_at((20, 6), 0.5f64.ln())
            };
            assert_eq!(st.explore(&blind), ExploreStep::Stay);
        }
    }

    fn reading(p99_over_target: f64, rps: f64) -> Reading {
        Reading {
            log_q: p99_over_target.ln(),
            rps: Some(rps),
        }
    }

    /// A give-back to `cores` and `ways` (anchored, predicted -0.3 ± 0.1).
    fn gave(cores: u32, ways: u32) -> LastPrediction {
        LastPrediction {
            alloc: at_full_mba(cores, ways),
            shrank: true,
            ..last(-0.3, 0.1, true)
        }
    }

    fn last(corrected: f64, sigma: f64, moved: bool) -> LastPrediction {
        LastPrediction {
            alloc: at_full_mba(4, 2),
            base: corrected,
            corrected,
            sigma,
            model_sigma: 0.2,
            moved,
            shrank: false,
            anchored: true,
            regressor: None,
            prior_mean: corrected,
            irreducible: sigma * sigma,
        }
    }

    #[test]
    fn two_readings_in_a_row_within_the_margin_vouch_for_an_allocation_at_that_load() {
        let limit = 0.9f64.ln();
        let ok = 0.8f64.ln();
        let mut st = ServiceState::default();
        // One reading is not enough; nor is a second of another allocation.
        st.note_safe((8, 4), Some(ok), Some(1000.0), 1e9, limit);
        st.note_safe((9, 4), Some(ok), Some(1000.0), 1e9, limit);
        assert!(st.measured_safe.is_empty());
        // Nor two where one was past the margin.
        st.note_safe((9, 4), Some(0.95f64.ln()), Some(1000.0), 1e9, limit);
        assert!(st.measured_safe.is_empty());
        st.note_safe((9, 4), Some(ok), Some(1000.0), 1e9, limit);
        st.note_safe((9, 4), Some(ok), Some(1000.0), 1e9, limit);
        assert_eq!(st.certified(Some(1000.0), 1e9), vec![(9, 4)]);
        // At more load, beside busier neighbours, or with no load reading: not vouched for.
        assert!(st.certified(Some(1100.0), 1e9).is_empty());
        assert!(st.certified(Some(900.0), 2e9).is_empty());
        assert!(st.certified(None, 1e9).is_empty());
        // At less load and 5 % more neighbour traffic it is.
        assert_eq!(st.certified(Some(900.0), 1.04e9), vec![(9, 4)]);
        // A reading missing in between restarts the pair.
        let mut st = ServiceState::default();
        st.note_safe((9, 4), Some(ok), Some(1000.0), 1e9, limit);
        st.note_safe((9, 4), None, Some(1000.0), 1e9, limit);
        st.note_safe((9, 4), Some(ok), Some(1000.0), 1e9, limit);
        assert!(st.measured_safe.is_empty());
        // A smaller allocation safe at more load makes the larger one redundant.
        let mut st = ServiceState::default();
        for _ in 0..2 {
            st.note_safe((9, 4), Some(ok), Some(1000.0), 1e9, limit);
        }
        for _ in 0..2 {
            st.note_safe((7, 4), Some(ok), Some(1200.0), 1e9, limit);
        }
        assert_eq!(st.certified(Some(1000.0), 1e9), vec![(7, 4)]);
    }

    #[test]
    fn readings_that_say_less_than_one_kept_do_not_push_it_out() {
        // (9, 4) measured safe at 1000 requests/s, then held through a run of readings
        // each a little under that load (what a steady allocation reads under noise):
        // each says less than the first, and more of them than the memory holds must not
        // push it out. Before the rule they were added, and the ninth dropped the first.
        let limit = 0.9f64.ln();
        let ok = 0.5f64.ln();
        let mut st = ServiceState::default();
        for _ in 0..2 {
            st.note_safe((9, 4), Some(ok), Some(1000.0), 1e9, limit);
        }
        for i in 0..2 * MAX_MEASURED_SAFE {
            let rps = 999.0 - i as f64;
            st.note_safe((9, 4), Some(ok), Some(rps), 1e9, limit);
        }
        assert_eq!(st.measured_safe.len(), 1, "{:?}", st.measured_safe);
        assert_eq!(st.certified(Some(1000.0), 1e9), vec![(9, 4)]);
        // One that says something new (busier neighbours) is still added.
        st.note_safe((9, 4), Some(ok), Some(990.0), 2e9, limit);
        assert_eq!(st.measured_safe.len(), 2);
        assert_eq!(st.certified(Some(980.0), 2e9), vec![(9, 4)]);
    }

    #[test]
    fn a_full_memory_forgets_a_reading_of_the_allocation_it_holds_most_of() {
        // (12, 6) measured safe at 1000 requests/s, then (18, 6) through a load swing: each
        // reading at more load beside quieter neighbours than the one before, so none says
        // more than another and all are kept. The memory fills with (18, 6); before the
        // rule the ninth pushed out (12, 6), which then was no longer admissible when the
        // load came back to 1000.
        let limit = 0.9f64.ln();
        let ok = 0.5f64.ln();
        let mut st = ServiceState::default();
        for _ in 0..2 {
            st.note_safe((12, 6), Some(ok), Some(1000.0), 1e9, limit);
        }
        for i in 0..=2 * MAX_MEASURED_SAFE {
            let step = i as f64;
            st.note_safe(
                (18, 6),
                Some(ok),
                Some(1500.0 + step),
                1e9 - step * 1e6,
                limit,
            );
        }
        assert_eq!(st.measured_safe.len(), MAX_MEASURED_SAFE);
        assert!(
            st.certified(Some(1000.0), 0.9e9).contains(&(12, 6)),
            "{:?}",
            st.measured_safe
        );
        // The newest of (18, 6) is kept: it is the one at the most load.
        assert!(st
            .certified(Some(1500.0 + 2.0 * MAX_MEASURED_SAFE as f64), 0.9e9)
            .contains(&(18, 6)));
    }

    #[test]
    fn an_allocation_measured_not_enough_is_a_floor_while_the_load_stays() {
        let limit = 0.9f64.ln();
        let mut st = ServiceState::default();
        // Within the margin; between the margin and the target without a give-back; past
        // saturation without one (a glitch, maybe): nothing learnt.
        st.note_outcome(&gave(8, 4), 0.85f64.ln(), Some(1000.0), limit);
        st.note_outcome(&last(-0.3, 0.1, true), 0.95f64.ln(), Some(1000.0), limit);
        st.note_outcome(&last(-0.3, 0.1, true), 2.5f64.ln(), Some(1000.0), limit);
        assert!(st.measured_cliffs.is_empty());
        assert_eq!(
            st.measured_floor(vec![(6, 4), (4, 8)], Some(1000.0), false),
            vec![(6, 4), (4, 8)]
        );
        // 8 cores / 4 ways measured 1.05 of the target after a give-back.
        st.note_outcome(&gave(8, 4), 1.05f64.ln(), Some(1000.0), limit);
        // Points with at most 4 ways need 9 cores; 8 ways are untouched.
        assert_eq!(
            st.measured_floor(vec![(6, 2), (7, 4), (4, 8)], Some(1000.0), false),
            vec![(9, 2), (9, 4), (4, 8)]
        );
        // Under 90 % of the load it does not bind; an unknown load does.
        assert_eq!(
            st.measured_floor(vec![(7, 4)], Some(850.0), false),
            vec![(7, 4)]
        );
        assert_eq!(st.measured_floor(vec![(7, 4)], None, false), vec![(9, 4)]);
        // A cliff above replaces the one it covers; at most four are kept.
        st.note_outcome(&gave(10, 6), 1.1f64.ln(), Some(1000.0), limit);
        assert_eq!(st.measured_cliffs.len(), 1);
        for w in 7..12 {
            st.note_outcome(&gave(16 - w, w), 1.1f64.ln(), Some(1000.0), limit);
        }
        assert_eq!(st.measured_cliffs.len(), 4);
        assert_eq!(st.measured_cliffs[0].at.ways, 8);
        // Over the target without a give-back counts; so does a give-back into saturation.
        let mut st = ServiceState::default();
        st.note_outcome(&last(-0.3, 0.1, true), 1.2f64.ln(), Some(1000.0), limit);
        assert_eq!(st.measured_cliffs.len(), 1);
        st.note_outcome(&gave(2, 1), 5.0f64.ln(), Some(1000.0), limit);
        assert_eq!(st.measured_cliffs.len(), 2);
    }

    #[test]
    fn a_cliff_measured_within_the_target_gives_way_while_a_neighbour_is_over_its_own() {
        let limit = 0.9f64.ln();
        let mut st = ServiceState::default();
        // A give-back to (8, 4) read 0.95 of the target: past the margin, within the target.
        st.note_outcome(&gave(8, 4), 0.95f64.ln(), Some(1000.0), limit);
        assert!(st.measured_cliffs[0].weak);
        assert_eq!(
            st.measured_floor(vec![(6, 4)], Some(1000.0), false),
            vec![(9, 4)]
        );
        assert_eq!(
            st.measured_floor(vec![(6, 4)], Some(1000.0), true),
            vec![(6, 4)]
        );
        // One read over the target binds whatever the neighbours do.
        st.note_outcome(&gave(8, 4), 1.1f64.ln(), Some(1000.0), limit);
        assert!(!st.measured_cliffs[0].weak);
        assert_eq!(
            st.measured_floor(vec![(6, 4)], Some(1000.0), true),
            vec![(9, 4)]
        );
    }

    #[test]
    fn a_weak_cliff_two_readings_within_the_margin_contradict_is_forgotten() {
        let limit = 0.9f64.ln();
        let within = Some(0.7f64.ln());
        // A give-back to (29, 8) read once past the margin at 2,770 requests per second.
        let mut st = ServiceState::default();
        st.note_outcome(&gave(29, 8), 0.94f64.ln(), Some(2770.0), limit);
        assert_eq!(
            st.measured_floor(vec![(25, 8)], Some(2740.0), false),
            vec![(30, 8)]
        );
        // One reading within the margin there is not enough; two in a row at 2,740
        // (at least 0.9 of the cliff's load) say the cliff was noise.
        st.note_safe((29, 8), within, Some(2740.0), 0.0, limit);
        assert_eq!(st.measured_cliffs.len(), 1);
        st.note_safe((29, 8), within, Some(2740.0), 0.0, limit);
        assert!(st.measured_cliffs.is_empty());
        assert_eq!(
            st.measured_floor(vec![(25, 8)], Some(2740.0), false),
            vec![(25, 8)]
        );
        // Measured at a load under 0.9 of the cliff's, or at fewer ways than the cliff's
        // allocation, it stands.
        let noted = |at: (u32, u32), rps: f64| {
            let mut st = ServiceState::default();
            st.note_outcome(&gave(29, 8), 0.94f64.ln(), Some(2770.0), limit);
            st.note_safe(at, within, Some(rps), 0.0, limit);
            st.note_safe(at, within, Some(rps), 0.0, limit);
            st.measured_cliffs.len()
        };
        assert_eq!(noted((29, 8), 2400.0), 1);
        assert_eq!(noted((29, 9), 2740.0), 1);
        // Under it (a certified safe allocation with fewer cores) it goes too.
        assert_eq!(noted((27, 8), 2740.0), 0);
        // A cliff read over the target stays whatever comes.
        let mut st = ServiceState::default();
        st.note_outcome(&gave(29, 8), 1.05f64.ln(), Some(2770.0), limit);
        st.note_safe((29, 8), within, Some(2740.0), 0.0, limit);
        st.note_safe((29, 8), within, Some(2740.0), 0.0, limit);
        assert_eq!(st.measured_cliffs.len(), 1);
    }

    #[test]
    fn hysteresis_holds_a_safe_allocation_until_a_cheaper_one_lasted_shrink_after_intervals() {
        let mut st = ServiceState::default();
        // shrink_after 5: intervals 1..=4 with a cheaper admissible allocation hold.
        for tick in 1..=4 {
            let h = st.hysteresis(true, true, true, false, 5);
            assert_eq!(
                h,
                Hysteresis {
                    keep: true,
                    surplus_ticks: tick
                }
            );
        }
        // The fifth gives back, and the count starts over.
        assert_eq!(
            st.hysteresis(true, true, true, false, 5),
            Hysteresis {
                keep: false,
                surplus_ticks: 5
            }
        );
        assert_eq!(st.surplus_ticks, 0);
        assert!(st.hysteresis(true, true, true, false, 5).keep);
    }

    #[test]
    fn hysteresis_restarts_the_count_when_nothing_cheaper_was_admissible() {
        let mut st = ServiceState::default();
        for _ in 0..4 {
            assert!(st.hysteresis(true, true, true, false, 5).keep);
        }
        // One interval without a cheaper allocation: 4 -> 0, so 4 more hold again.
        assert!(st.hysteresis(true, true, false, false, 5).keep);
        for _ in 0..4 {
            assert!(st.hysteresis(true, true, true, false, 5).keep);
        }
        assert!(!st.hysteresis(true, true, true, false, 5).keep);
    }

    #[test]
    fn a_safe_reading_past_the_margin_restarts_the_count() {
        // Four intervals within the margin with something cheaper, then one between the
        // margin and the target (safe, not within it): kept, and the count starts over.
        let mut st = ServiceState::default();
        for _ in 0..4 {
            assert!(st.hysteresis(true, true, true, false, 5).keep);
        }
        let h = st.hysteresis(true, false, true, false, 5);
        assert!(h.keep);
        assert_eq!(h.surplus_ticks, 0);
        for _ in 0..4 {
            assert!(st.hysteresis(true, true, true, false, 5).keep);
        }
        assert!(!st.hysteresis(true, true, true, false, 5).keep);
    }

    #[test]
    fn hysteresis_never_keeps_an_unsafe_allocation_or_a_new_service() {
        let mut st = ServiceState::default();
        assert!(!st.hysteresis(false, true, true, false, 5).keep);
        assert!(!st.hysteresis(true, true, false, true, 5).keep);
    }

    #[test]
    fn a_tick_anchors_on_the_reading_unless_it_is_past_saturation() {
        let mut st = ServiceState::default();
        let t = st.begin_tick(Some(0.5), Some(10.0), None);
        assert!(t.new_service);
        assert_eq!(t.basis.anchor, Some(0.5));
        assert_eq!(t.prev, None);
        // p99 at 2.5 × the target (ln 2.5 > ln 2): the model's level is used.
        let q = 2.5f64.ln();
        let t = st.begin_tick(Some(q), Some(10.0), None);
        assert!(!t.new_service);
        assert_eq!(t.basis.anchor, None);
        assert_eq!(t.prev.map(|r| r.log_q), Some(0.5));
        assert_eq!(st.prev_reading.map(|r| r.log_q), Some(q));
    }

    #[test]
    fn a_violation_beyond_the_tolerance_is_a_miss_and_a_met_target_clears_them() {
        let cfg = MlConfig::default();
        let mut st = ServiceState::default();
        // Predicted -0.2 ± 0.1, measured +0.2: surprise 0.4 > max(0.3, 0.2).
        st.correct(&last(-0.2, 0.1, true), 0.2, (1, 1), &cfg);
        assert_eq!(st.misses, 1);
        // Surprise 0.25 < 0.3: over the target but not a miss; the count stays.
        st.correct(&last(-0.05, 0.1, true), 0.2, (1, 1), &cfg);
        assert_eq!(st.misses, 1);
        // A wide spread excuses it: 0.4 < 2 * 0.25.
        st.correct(&last(-0.2, 0.25, true), 0.2, (1, 1), &cfg);
        assert_eq!(st.misses, 1);
        // A reading within the target ends the run.
        st.correct(&last(-0.2, 0.1, true), -0.1, (1, 1), &cfg);
        assert_eq!(st.misses, 0);
    }

    #[test]
    fn the_first_reading_sets_the_prior_noise_no_lower_than_its_sampling_error() {
        // The p99 of 200 requests: about 0.15 in ln units, three times the prior's 0.05.
        let mut st = ServiceState::default();
        st.begin_tick(Some(-1.0), Some(200.0), Some(200.0));
        assert!(
            (st.noise2.sqrt() - 0.153).abs() < 0.002,
            "{}",
            st.noise2.sqrt()
        );
        // Only the first reading sets it: later ones are the noise estimate's to learn.
        st.begin_tick(Some(-1.0), Some(20.0), Some(20.0));
        assert!(
            (st.noise2.sqrt() - 0.153).abs() < 0.002,
            "{}",
            st.noise2.sqrt()
        );
        // 100,000 requests sample the p99 finer than the prior noise: the prior stays.
        let mut busy = ServiceState::default();
        busy.begin_tick(Some(-1.0), Some(1e5), Some(1e5));
        assert_eq!(busy.noise2, ServiceState::default().noise2);
        // Without a request count nothing is assumed.
        let mut unknown = ServiceState::default();
        unknown.begin_tick(Some(-1.0), None, None);
        assert_eq!(unknown.noise2, ServiceState::default().noise2);
    }

    #[test]
    fn the_bias_is_the_mean_error_until_it_has_seen_enough_then_follows_the_weight() {
        let cfg = MlConfig::default();
        let mut st = ServiceState::default();
        // The first error is taken whole: 0.1 - -0.4 = 0.5.
        st.correct(&last(-0.4, 0.5, true), 0.1, (1, 1), &cfg);
        assert!((st.bias - 0.5).abs() < 1e-12, "{}", st.bias);
        // The second weighs a half: (0.5 + 0.1) / 2 = 0.3. An unchanged allocation updates
        // the noise with the correction weight, from its surprise 0.1:
        // 0.7 * 0.0025 + 0.3 * 0.01 = 0.00475.
        st.correct(&last(0.0, 0.5, false), 0.1, (1, 1), &cfg);
        assert!((st.bias - 0.3).abs() < 1e-12, "{}", st.bias);
        assert!((st.noise2 - 0.004_75).abs() < 1e-12, "{}", st.noise2);
        // The third a third (1/3 > 0.3): 0.3 + (0.0 - 0.3) / 3 = 0.2; the fourth and on
        // weigh 0.3: 0.7 * 0.2 + 0.3 * 1.0 = 0.44.
        st.correct(&last(0.1, 0.5, true), 0.1, (1, 1), &cfg);
        assert!((st.bias - 0.2).abs() < 1e-12, "{}", st.bias);
        st.correct(&last(-0.9, 0.5, true), 0.1, (1, 1), &cfg);
        assert!((st.bias - 0.44).abs() < 1e-12, "{}", st.bias);
    }

    #[test]
    fn only_an_anchored_predictions_error_teaches_the_bias_noise_and_spread() {
        let cfg = MlConfig::default();
        let mut st = ServiceState::default();
        // A level predicted past saturation (p99/target 11.7), measured 1.1: a miss, but
        // not the model's error on a change.
        let level = LastPrediction {
            anchored: false,
            ..last(11.7f64.ln(), 0.5, true)
        };
        st.correct(&level, 1.1f64.ln(), (1, 1), &cfg);
        assert_eq!((st.bias, st.bias_samples, st.z2), (0.0, 0, 1.0));
        let still = LastPrediction {
            moved: false,
            ..level
        };
        st.correct(&still, 1.1f64.ln(), (1, 1), &cfg);
        let fresh = ServiceState::default();
        assert_eq!((st.bias, st.noise2), (0.0, fresh.noise2));
        // A saturated reading weighs the correction weight and is not counted.
        st.correct(&last(0.0, 0.5, true), 3.0, (1, 1), &cfg);
        assert!((st.bias - 0.9).abs() < 1e-12, "{}", st.bias);
        assert_eq!(st.bias_samples, 0);
    }

    #[test]
    fn misses_to_fallback_misses_send_a_service_to_the_fallback_for_fallback_hold_ms() {
        let cfg = MlConfig::default();
        let mut st = ServiceState {
            misses: 2,
            ..ServiceState::default()
        };
        assert_eq!(st.on_fallback(10_000, &cfg), None);
        st.misses = 3;
        assert_eq!(
            st.on_fallback(10_000, &cfg).as_deref(),
            Some("predictions missed 3 times in a row")
        );
        assert_eq!(st.misses, 0);
        // Held for 30 s: still there at 39.999 s, back on the model at 40 s.
        assert!(st.on_fallback(39_999, &cfg).is_some());
        assert_eq!(st.on_fallback(40_000, &cfg), None);
        assert_eq!(st.fallback_until_ms, None);
    }

    #[test]
    fn a_sudden_saturated_reading_with_unchanged_load_and_idle_cores_waits_a_tick() {
        // 3x the target after 0.8x, load +10 %, 4 of 10 cores busy: a glitch.
        let (now, prev) = (reading(3.0, 1100.0), reading(0.8, 1000.0));
        assert!(unconfirmed_saturation(now, prev, Some(4.0), 10));
        // Busy cores confirm it: 9.5 of 10.
        assert!(!unconfirmed_saturation(now, prev, Some(9.5), 10));
        // So does a load that moved: +50 %.
        assert!(!unconfirmed_saturation(
            reading(3.0, 1500.0),
            prev,
            Some(4.0),
            10
        ));
        // So does a bad reading before it.
        assert!(!unconfirmed_saturation(
            now,
            reading(1.2, 1000.0),
            Some(4.0),
            10
        ));
        // And a reading short of saturation is used at once.
        assert!(!unconfirmed_saturation(
            reading(1.9, 1000.0),
            prev,
            Some(4.0),
            10
        ));
    }

    #[test]
    fn one_reading_between_margin_and_target_is_still_safe_two_are_not() {
        let limit = 0.9f64.ln();
        let good = Some(reading(0.8, 1.0));
        let near = Some(reading(0.95, 1.0));
        assert!(safe_to_keep(Some(0.8f64.ln()), None, limit));
        assert!(safe_to_keep(Some(0.95f64.ln()), good, limit));
        assert!(!safe_to_keep(Some(0.95f64.ln()), near, limit));
        assert!(!safe_to_keep(Some(1.05f64.ln()), good, limit));
        assert!(!safe_to_keep(None, good, limit));
    }

    #[test]
    fn a_missing_or_glitched_busy_reading_is_bridged_for_two_ticks() {
        let mut st = ServiceState::default();
        assert_eq!(st.busy_cores(None, Some(100.0)), None);
        assert_eq!(st.busy_cores(Some(6.0), Some(100.0)), Some(6.0));
        // Missing, then zero while serving (a glitch): the last reading, twice.
        assert_eq!(st.busy_cores(None, Some(100.0)), Some(6.0));
        assert_eq!(st.busy_cores(Some(0.0), Some(100.0)), Some(6.0));
        assert_eq!(st.busy_cores(Some(f64::NAN), Some(100.0)), None);
        // Zero with no requests is a real reading.
        assert_eq!(st.busy_cores(Some(0.0), Some(0.0)), Some(0.0));
    }
}
