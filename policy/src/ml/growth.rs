//! A growth the fallback made is judged by the readings after it, as PARTIES judges an
//! upsize: one that did not lower the p99 is undone, and the service is not grown past what
//! it had while its load stays where it was.
//!
//! Problem: the fallback grows a service that reads over its target where the model cannot
//! vouch for a candidate. The step assumes more cores lower the p99, as they do for a
//! service queueing on its cores. Where they do not (on the project's VM the second CPU was
//! the batch job's, and memcached read worse on two CPUs than on one), the fallback's
//! give-back waits for calm readings that never come, and the batch job loses the core for
//! the rest of the run (docs/EXPERIMENTS.md, "A growth that does not lower the p99 is
//! undone").
//!
//! Approach: remember the last [`JUDGED_AFTER`] readings at the allocation in force. When
//! the fallback asks for more cores and the next tick has at least [`JUDGED_GROWTH`] times
//! them, compare the median of the
//! readings before (the one that asked included) with the median of the first
//! [`JUDGED_AFTER`] after. Where the one after is no lower and the load did not rise by
//! more than [`LOAD_RISE`], the growth is undone, and a ceiling keeps the fallback from
//! growing the service past the cores it came back to while its load stays within
//! [`LOAD_RISE`] of the load then. The ceiling lapses after [`CEILING_LAPSE`] ticks,
//! doubling with each ceiling the service has had, so one unlucky verdict does not hold a
//! service down for good and a true one costs a doubling interval.
//!
//! Properties:
//! - only growths the fallback asked for are judged: a model-path growth rests on a
//!   prediction of its gain, which the posterior checks;
//! - only from readings under the clip ([`LOG_QOS_CLIP`]): a saturated service reads 20
//!   times its target whatever a growth did, and the overload rule, not this one, decides
//!   what it gets;
//! - a reading taken while the load rose never condemns a growth;
//! - the selection bias runs toward keeping a growth: the reading that asked for it was a
//!   high one, and the readings after regress toward the mean.

use cohabit_models::LOG_QOS_CLIP;

use super::state::{Lapse, Reading};

/// Readings after a growth before it is judged, and readings before it remembered.
pub(super) const JUDGED_AFTER: usize = 3;

/// Growths of at least this factor in cores are judged: a smaller one can lower the p99 of
/// a service that needs it by less than three readings' noise, so its readings cannot tell
/// a gain from none.
pub(super) const JUDGED_GROWTH: f64 = 1.25;

/// A load this much higher than before a growth (or its ceiling) lets the growth stand and
/// lifts the ceiling.
pub(super) const LOAD_RISE: f64 = 1.1;

/// Ticks a ceiling holds, doubling with each ceiling of the service.
pub(super) const CEILING_LAPSE: u32 = 60;

/// A growth being judged.
#[derive(Debug, Clone, PartialEq)]
struct Judging {
    from: (u32, u32),
    to: (u32, u32),
    /// Median ln(p99/target) of the readings before it.
    before: f64,
    /// Mean load before it, when measured.
    rps: Option<f64>,
    after: Vec<Reading>,
}

/// The most cores the fallback may grow the service to while its load stays within
/// [`LOAD_RISE`] of `rps`.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Ceiling {
    cores: u32,
    rps: Option<f64>,
}

/// A growth judged not to have lowered the p99: back to `back_to`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Undo {
    /// (cores, ways) to go back to.
    pub(super) back_to: (u32, u32),
    /// (cores, ways) the growth gave.
    pub(super) grown: (u32, u32),
    /// Median p99/target before and after the growth.
    pub(super) before: f64,
    pub(super) after: f64,
    /// Ticks the ceiling holds.
    pub(super) ceiling_ticks: u32,
}

/// What one service's growths have shown ([`GrowthCheck::note`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub(super) struct GrowthCheck {
    /// (cores, ways) the recent readings were taken at, and the newest [`JUDGED_AFTER`].
    at: Option<(u32, u32)>,
    recent: Vec<Reading>,
    /// The fallback asked last tick to grow from this (cores, ways).
    asked: Option<(u32, u32)>,
    judging: Option<Judging>,
    ceiling: Option<Ceiling>,
    /// When the ceiling lapses.
    lapse: Lapse,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn mean_rps(v: &[Reading]) -> Option<f64> {
    let known: Vec<f64> = v.iter().filter_map(|r| r.rps).collect();
    (!known.is_empty()).then(|| known.iter().sum::<f64>() / known.len() as f64)
}

/// Whether load `now` is within [`LOAD_RISE`] of `then` (true where either is unknown).
fn same_load(now: Option<f64>, then: Option<f64>) -> bool {
    match (now, then) {
        (Some(n), Some(t)) => n <= LOAD_RISE * t,
        _ => true,
    }
}

impl GrowthCheck {
    /// One tick: `current` (cores, ways) in force and its reading. Returns the undo when
    /// this reading completes the judgement of a growth the fallback asked for and it did
    /// not lower the p99.
    pub(super) fn note(&mut self, current: (u32, u32), reading: Option<Reading>) -> Option<Undo> {
        if self.lapse.tick() {
            self.ceiling = None;
        }
        let asked = self.asked.take();
        if self.at != Some(current) {
            let before = std::mem::take(&mut self.recent);
            let from = self.at.replace(current);
            self.judging = match (asked, from) {
                (Some(a), Some(f))
                    if a == f
                        && f64::from(current.0) >= JUDGED_GROWTH * f64::from(f.0)
                        && current.1 >= f.1
                        && !before.is_empty()
                        && before.iter().all(|r| r.log_q < LOG_QOS_CLIP) =>
                {
                    Some(Judging {
                        from: f,
                        to: current,
                        before: median(before.iter().map(|r| r.log_q).collect()),
                        rps: mean_rps(&before),
                        after: Vec::new(),
                    })
                }
                _ => None,
            };
        }
        let r = reading?;
        self.recent.push(r);
        if self.recent.len() > JUDGED_AFTER {
            self.recent.remove(0);
        }
        let j = self.judging.as_mut()?;
        j.after.push(r);
        if j.after.len() < JUDGED_AFTER {
            return None;
        }
        let j = self.judging.take()?;
        let after = median(j.after.iter().map(|r| r.log_q).collect());
        if after < j.before || !same_load(mean_rps(&j.after), j.rps) {
            return None;
        }
        let ticks = self.lapse.start(CEILING_LAPSE);
        self.ceiling = Some(Ceiling {
            cores: j.from.0,
            rps: j.rps,
        });
        Some(Undo {
            back_to: j.from,
            grown: j.to,
            before: j.before.exp(),
            after: after.exp(),
            ceiling_ticks: ticks,
        })
    }

    /// The fallback asks this tick to grow the service from `from` (cores, ways).
    pub(super) fn ask(&mut self, from: (u32, u32)) {
        self.asked = Some(from);
    }

    /// The most cores the fallback may grow the service to at load `rps`, while a ceiling
    /// binds.
    pub(super) fn ceiling(&self, rps: Option<f64>) -> Option<u32> {
        self.ceiling
            .filter(|c| same_load(rps, c.rps))
            .map(|c| c.cores)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(q: f64) -> Option<Reading> {
        Some(Reading {
            log_q: q.ln(),
            rps: Some(1000.0),
        })
    }

    /// Readings `before` at (1, 1), a growth the fallback asks for to (2, 1), then `after`:
    /// the undo, if any.
    fn grow(before: &[f64], after: &[f64]) -> (GrowthCheck, Option<Undo>) {
        let mut g = GrowthCheck::default();
        for &q in before {
            assert_eq!(g.note((1, 1), at(q)), None);
        }
        g.ask((1, 1));
        let mut undo = None;
        for &q in after {
            assert_eq!(undo, None, "judged after {JUDGED_AFTER} readings");
            undo = g.note((2, 1), at(q));
        }
        (g, undo)
    }

    #[test]
    fn a_growth_that_did_not_lower_the_p99_is_undone_and_caps_the_fallback_at_that_load() {
        let (g, undo) = grow(&[0.85, 0.93, 1.33], &[0.96, 1.3, 0.99]);
        let u = undo.expect("no gain: undone");
        assert_eq!((u.back_to, u.grown), ((1, 1), (2, 1)));
        assert!((u.before - 0.93).abs() < 1e-9 && (u.after - 0.99).abs() < 1e-9);
        assert_eq!(u.ceiling_ticks, CEILING_LAPSE);
        assert_eq!(g.ceiling(Some(1000.0)), Some(1));
        assert_eq!(g.ceiling(Some(1099.0)), Some(1));
        assert_eq!(g.ceiling(Some(1101.0)), None, "a higher load lifts it");
    }

    #[test]
    fn a_growth_that_lowered_the_p99_stands() {
        let (g, undo) = grow(&[0.85, 0.93, 1.33], &[0.7, 0.95, 0.8]);
        assert_eq!(undo, None);
        assert_eq!(g.ceiling(Some(1000.0)), None);
    }

    #[test]
    fn a_growth_the_fallback_did_not_ask_for_too_small_or_under_a_rising_load_is_not_judged() {
        let mut g = GrowthCheck::default();
        for q in [0.9, 1.2, 1.3] {
            g.note((1, 1), at(q));
        }
        for q in [1.4, 1.4, 1.4] {
            assert_eq!(g.note((2, 1), at(q)), None, "not asked");
        }
        let mut g = GrowthCheck::default();
        g.note((1, 1), at(1.2));
        g.ask((1, 1));
        for _ in 0..3 {
            let r = Some(Reading {
                log_q: 1.4f64.ln(),
                rps: Some(1200.0),
            });
            assert_eq!(g.note((2, 1), r), None, "the load rose");
        }
        // A core more of eight: too small a step for three readings to judge.
        let mut g = GrowthCheck::default();
        g.note((8, 1), at(1.2));
        g.ask((8, 1));
        for _ in 0..3 {
            assert_eq!(g.note((9, 1), at(1.4)), None, "under a quarter more");
        }
        // Asked, but the packer granted nothing that tick: the ask does not carry over.
        let mut g = GrowthCheck::default();
        g.note((1, 1), at(1.2));
        g.ask((1, 1));
        g.note((1, 1), at(1.2));
        for _ in 0..3 {
            assert_eq!(g.note((2, 1), at(1.4)), None);
        }
    }

    #[test]
    fn the_ceiling_lapses_later_each_time() {
        let (mut g, undo) = grow(&[1.2], &[1.3, 1.3, 1.3]);
        assert!(undo.is_some());
        for _ in 0..CEILING_LAPSE {
            assert_eq!(g.ceiling(None), Some(1));
            g.note((1, 1), at(1.2));
        }
        g.note((1, 1), at(1.2));
        assert_eq!(g.ceiling(None), None, "lapsed");
        g.ask((1, 1));
        let mut undo = None;
        for _ in 0..JUDGED_AFTER {
            undo = g.note((2, 1), at(1.3));
        }
        assert_eq!(undo.map(|u| u.ceiling_ticks), Some(2 * CEILING_LAPSE));
    }
}
