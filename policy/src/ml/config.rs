//! Tunables of the `ml` policy.
//!
//! Every tunable has a default that the simulated results (docs/RESULTS.md) were measured
//! with. An operator may move the ones [`MlConfig::validate`] checks (the daemon's `[ml]`
//! table): each trades runs meeting QoS for best-effort throughput, as `cargo run --release
//! -p cohabit-lab --example tradeoff` measures.

/// Tunables of the `ml` policy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MlConfig {
    /// The pessimistic prediction must be at most this fraction of the target.
    pub margin: f64,
    /// Spreads added to the mean for the pessimistic prediction.
    pub k_sigma: f64,
    /// The same for a service that is within its margin and could only give back: a spread
    /// that keeps give-backs off cliffs the model does not see, smaller than it would need
    /// to be alone because `give_back_headroom` already keeps give-backs short of
    /// saturation (docs/EXPERIMENTS.md, "A give-back stops short of saturation").
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
    /// exploration off, the default: in simulation it trades runs meeting QoS and
    /// actuations for a little best-effort throughput on a few scenarios (docs/LIMITS.md),
    /// so it stays opt-in until it is surer.
    /// A cut is this share of the cores rounded down: a service with fewer than
    /// `1 / explore_step` cores is not probed.
    pub explore_step: f64,
    /// A cache-insensitive service (its frontier needs no more cores with one way than with
    /// any other count) may run on the best-effort pool's ways instead of a range of its
    /// own, so that the ways go to the services that need them (`ml` module docs, step 5).
    pub pool_ways_for_insensitive: bool,
    /// Keep a per-host posterior per service on the model's output layer
    /// (`policy/src/ml/posterior.rs`): its mean corrects the anchored predictions and its spread
    /// replaces the ensemble's in the search and the fallback's "model unsure" test. Off:
    /// the ensemble's spread, a bias and a spread factor per service.
    pub posterior: bool,
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
            posterior: true,
        }
    }
}

/// `(name, value, least, most)`: a tunable an operator may move and the closed range it
/// must lie in.
type Tunable = (&'static str, f64, f64, f64);

impl MlConfig {
    /// The tunables an operator may move (the daemon's `ml = { … }`, `cohabit simulate
    /// --ml`), each with its value and the range where `ml` stays meaningful.
    fn tunables(&self) -> [Tunable; 11] {
        [
            ("margin", self.margin, 0.5, 0.99),
            ("k_sigma", self.k_sigma, 0.0, 3.0),
            ("k_sigma_give_back", self.k_sigma_give_back, 0.0, 3.0),
            // Negative turns the headroom off; more than 3 roots of the busy cores is
            // more than any queue needs.
            ("give_back_headroom", self.give_back_headroom, -1.0, 3.0),
            ("unsure_sigma", self.unsure_sigma, 0.1, 5.0),
            ("shrink_after", f64::from(self.shrink_after), 1.0, 60.0),
            ("way_cost", self.way_cost, 0.0, 1.0),
            ("explore_step", self.explore_step, 0.0, 0.5),
            ("explore_below", self.explore_below, 0.1, 0.99),
            (
                "gpu_hysteresis_pct",
                f64::from(self.gpu_hysteresis_pct),
                1.0,
                50.0,
            ),
            (
                "gpu_shrink_after_ms",
                self.gpu_shrink_after_ms as f64,
                0.0,
                3_600_000.0,
            ),
        ]
    }

    /// The defaults with the tunables `settings` (name, value) set in order, a later one
    /// over an earlier one, then checked ([`MlConfig::validate`]): the one reading of the
    /// daemon's `ml = { … }` table and of `cohabit simulate --ml`. A name that is not an
    /// operator's tunable, or a fraction where a whole number goes, is refused by name.
    pub fn with_tunables<'a>(
        settings: impl IntoIterator<Item = (&'a str, f64)>,
    ) -> Result<MlConfig, String> {
        let mut cfg = MlConfig::default();
        for (name, v) in settings {
            cfg.set(name, v)?;
        }
        cfg.validate()?;
        Ok(cfg)
    }

    /// Sets the tunable `name` to `v` (see [`MlConfig::with_tunables`]).
    fn set(&mut self, name: &str, v: f64) -> Result<(), String> {
        let Some((_, _, lo, hi)) = self.tunables().into_iter().find(|t| t.0 == name) else {
            let names: Vec<&str> = self.tunables().iter().map(|t| t.0).collect();
            return Err(format!(
                "ml.{name} is not a tunable an operator may set; choose from {}",
                names.join(", ")
            ));
        };
        if !(v.is_finite() && (lo..=hi).contains(&v)) {
            return Err(format!("ml.{name} must be between {lo} and {hi}, got {v}"));
        }
        // In range and whole, so the conversions below are exact (and cannot fail).
        let whole = || {
            if v.fract() == 0.0 {
                Ok(cohabit_core::whole(v))
            } else {
                Err(format!("ml.{name} must be a whole number, got {v}"))
            }
        };
        let narrow = |n: u64| u32::try_from(n).unwrap_or(u32::MAX);
        match name {
            "margin" => self.margin = v,
            "k_sigma" => self.k_sigma = v,
            "k_sigma_give_back" => self.k_sigma_give_back = v,
            "give_back_headroom" => self.give_back_headroom = v,
            "unsure_sigma" => self.unsure_sigma = v,
            "shrink_after" => self.shrink_after = narrow(whole()?),
            "way_cost" => self.way_cost = v,
            "explore_step" => self.explore_step = v,
            "explore_below" => self.explore_below = v,
            "gpu_hysteresis_pct" => {
                self.gpu_hysteresis_pct = u8::try_from(whole()?).unwrap_or(u8::MAX)
            }
            "gpu_shrink_after_ms" => self.gpu_shrink_after_ms = whole()?,
            _ => unreachable!("every tunable is listed in MlConfig::tunables"),
        }
        Ok(())
    }

    /// Checks the tunables an operator may move, each against its range; the error names
    /// the first one out of range (as `ml.NAME`, the daemon's configuration key). With the
    /// cut exploration on, its calm bound must also lie under the margin (a service is
    /// probed only while measured well within it).
    pub fn validate(&self) -> Result<(), String> {
        for (name, v, lo, hi) in self.tunables() {
            if !(v.is_finite() && (lo..=hi).contains(&v)) {
                return Err(format!("ml.{name} must be between {lo} and {hi}, got {v}"));
            }
        }
        if self.explore_step > 0.0 && self.explore_below >= self.margin {
            return Err(format!(
                "ml.explore_below ({}) must be under ml.margin ({}): a service is probed only while measured well within its margin",
                self.explore_below, self.margin
            ));
        }
        Ok(())
    }

    /// The operator's tunables that differ from the defaults, with their values (empty
    /// when none do), for logs and reports to say what ran.
    pub fn moved_tunables(&self) -> Vec<(&'static str, f64)> {
        let d = Self::default().tunables();
        self.tunables()
            .iter()
            .zip(d.iter())
            .filter(|(a, b)| a.1 != b.1)
            .map(|(a, _)| (a.0, a.1))
            .collect()
    }

    /// [`MlConfig::moved_tunables`] as `name value` words.
    pub fn moved_from_default(&self) -> Vec<String> {
        self.moved_tunables()
            .iter()
            .map(|(name, v)| format!("{name} {v}"))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_are_valid() {
        assert_eq!(MlConfig::default().validate(), Ok(()));
    }

    #[test]
    fn a_tunable_out_of_range_is_refused_by_name() {
        let d = MlConfig::default();
        let cases = [
            (MlConfig { margin: 1.0, ..d }, "ml.margin"),
            (
                MlConfig {
                    margin: f64::NAN,
                    ..d
                },
                "ml.margin",
            ),
            (MlConfig { k_sigma: -0.1, ..d }, "ml.k_sigma"),
            (
                MlConfig {
                    k_sigma_give_back: 4.0,
                    ..d
                },
                "ml.k_sigma_give_back",
            ),
            (
                MlConfig {
                    give_back_headroom: -2.0,
                    ..d
                },
                "ml.give_back_headroom",
            ),
            (
                MlConfig {
                    unsure_sigma: 0.0,
                    ..d
                },
                "ml.unsure_sigma",
            ),
            (
                MlConfig {
                    shrink_after: 0,
                    ..d
                },
                "ml.shrink_after",
            ),
            (MlConfig { way_cost: 1.5, ..d }, "ml.way_cost"),
            (
                MlConfig {
                    explore_step: 0.6,
                    ..d
                },
                "ml.explore_step",
            ),
            (
                MlConfig {
                    gpu_hysteresis_pct: 0,
                    ..d
                },
                "ml.gpu_hysteresis_pct",
            ),
            (
                MlConfig {
                    gpu_shrink_after_ms: 4_000_000,
                    ..d
                },
                "ml.gpu_shrink_after_ms",
            ),
        ];
        for (cfg, name) in cases {
            let e = cfg.validate().unwrap_err();
            assert!(e.starts_with(&format!("{name} must be between")), "{e}");
        }
        // Negative headroom is the documented way to turn it off.
        assert_eq!(
            MlConfig {
                give_back_headroom: -1.0,
                ..d
            }
            .validate(),
            Ok(())
        );
    }

    #[test]
    fn every_tunable_is_set_by_name_and_checked() {
        let all = [
            ("margin", 0.8),
            ("k_sigma", 0.4),
            ("k_sigma_give_back", 0.6),
            ("give_back_headroom", 0.25),
            ("unsure_sigma", 1.5),
            ("shrink_after", 7.0),
            ("way_cost", 0.2),
            ("explore_step", 0.1),
            ("explore_below", 0.7),
            ("gpu_hysteresis_pct", 20.0),
            ("gpu_shrink_after_ms", 60_000.0),
        ];
        let cfg = MlConfig::with_tunables(all).unwrap();
        let want = MlConfig {
            margin: 0.8,
            k_sigma: 0.4,
            k_sigma_give_back: 0.6,
            give_back_headroom: 0.25,
            unsure_sigma: 1.5,
            shrink_after: 7,
            way_cost: 0.2,
            explore_step: 0.1,
            explore_below: 0.7,
            gpu_hysteresis_pct: 20,
            gpu_shrink_after_ms: 60_000,
            ..MlConfig::default()
        };
        assert_eq!(cfg, want);
        // Every one was moved, and each reads back under its own name.
        let moved: Vec<(&str, f64)> = cfg.moved_tunables();
        assert_eq!(moved, all);
        // A later setting wins.
        let cfg = MlConfig::with_tunables([("margin", 0.8), ("margin", 0.95)]).unwrap();
        assert_eq!(cfg.margin, 0.95);
        let refused = |name: &str, v: f64| MlConfig::with_tunables([(name, v)]).unwrap_err();
        let e = refused("z_limit", 9.0);
        assert!(
            e.contains("ml.z_limit is not a tunable") && e.contains("margin, k_sigma"),
            "{e}"
        );
        let e = refused("shrink_after", 2.5);
        assert_eq!(e, "ml.shrink_after must be a whole number, got 2.5");
        let e = refused("gpu_hysteresis_pct", 300.0);
        assert_eq!(e, "ml.gpu_hysteresis_pct must be between 1 and 50, got 300");
        let e = refused("margin", f64::NAN);
        assert!(e.starts_with("ml.margin must be between"), "{e}");
        assert_eq!(
            MlConfig::with_tunables([("shrink_after", 3.0)])
                .unwrap()
                .shrink_after,
            3
        );
    }

    #[test]
    fn what_was_moved_from_the_defaults_is_listed() {
        assert!(MlConfig::default().moved_from_default().is_empty());
        let cfg = MlConfig {
            margin: 0.95,
            shrink_after: 3,
            ..MlConfig::default()
        };
        assert_eq!(cfg.moved_from_default(), ["margin 0.95", "shrink_after 3"]);
    }

    #[test]
    fn the_exploration_bound_must_lie_under_the_margin() {
        let cfg = MlConfig {
            margin: 0.8,
            explore_below: 0.85,
            explore_step: 0.1,
            ..MlConfig::default()
        };
        let e = cfg.validate().unwrap_err();
        assert!(
            e.contains("ml.explore_below") && e.contains("ml.margin"),
            "{e}"
        );
        // With the exploration off the bound binds nothing.
        let off = MlConfig {
            explore_step: 0.0,
            ..cfg
        };
        assert_eq!(off.validate(), Ok(()));
    }
}
