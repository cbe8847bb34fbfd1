//! Tunables of the `ml` policy.

/// Tunables of the `ml` policy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MlConfig {
    /// The pessimistic prediction must be at most this fraction of the target.
    pub margin: f64,
    /// Spreads added to the mean for the pessimistic prediction.
    pub k_sigma: f64,
    /// The same for a service that is within its margin and could only give back (0.75:
    /// with give-backs kept short of saturation by `give_back_headroom`, 1.0 met QoS in
    /// fewer runs; docs/RESULTS.md).
    pub k_sigma_give_back: f64,
    /// Spare cores a give-back must leave a service, in square roots of its measured busy
    /// cores (square-root staffing): a point with fewer cores or ways than those in force
    /// needs at least `busy + give_back_headroom * sqrt(busy)` cores. The model draws a
    /// queueing cliff as a slope; this keeps give-backs off it. Negative turns it off.
    pub give_back_headroom: f64,
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
    /// A held service measured at most this fraction of its target for `shrink_after`
    /// intervals in a row is probed with a cut (safe exploration of its cliff).
    pub explore_below: f64,
    /// Fraction of the cores an exploring cut takes (at least one core); 0 turns the
    /// exploration off, the default: with 0.15 (and cuts only where the model's mean stays
    /// within the margin) it gained best-effort throughput on three E5 scenarios (which then
    /// had MBA) but cost QoS on `few-closids`, `mba-stream` and the Gold `load-spike`, and
    /// actuations everywhere (README, Limits), so it stays opt-in until it is surer; since the
    /// packer's fixes of a later round it gains only on the E5 `few-closids` and `demo`.
    /// A cut is this share of the cores rounded down: a service with fewer than
    /// `1 / explore_step` cores is not probed.
    pub explore_step: f64,
    /// A cache-insensitive service (its frontier needs no more cores with one way than with
    /// any other count) may run on the best-effort pool's ways instead of a range of its
    /// own, so that the ways go to the services that need them (`ml` module docs, step 5).
    pub pool_ways_for_insensitive: bool,
}

impl Default for MlConfig {
    fn default() -> Self {
        Self {
            margin: 0.9,
            k_sigma: 0.5,
            k_sigma_give_back: 0.75,
            give_back_headroom: 0.5,
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
            explore_below: 0.75,
            explore_step: 0.0,
            pool_ways_for_insensitive: true,
        }
    }
}
