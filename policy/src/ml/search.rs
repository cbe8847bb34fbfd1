//! Step 4 of the `ml` policy: the frontier of one service, the fewest cores that meet its
//! target for each way count.
//!
//! Problem: find, for each way count, the smallest core count whose pessimistic prediction
//! `mean + k * sigma` is at most ln(`margin`) with a spread the model can vouch for
//! (`sigma <= unsure_sigma`), scoring as few candidates as possible.
//!
//! Approach: a grid of core counts around the cores in force ([`CORE_GRID`]) for every way
//! count of a thinning way grid ([`way_grid`]), scored in one batch; then, for each way count
//! with an admissible grid point, every core count between the grid point below it and that
//! point, in a second batch (one batch is cheaper than a bisection's several).
//!
//! Properties: no core count beyond the trust region ([`max_cores`]: twice the cores in
//! force, as in the training data; a quarter more for a service that could only give back)
//! and none below the grid's lowest point is scored; the search is monotone in what it
//! returns only as far as the predictions are.

use super::predict::Pred;
use super::state::Reading;

/// Core counts scored first, as multiples of the cores in force (up to twice them: the
/// trust region of the training data).
const CORE_GRID: [f64; 6] = [0.4, 0.6, 0.8, 1.0, 1.4, 2.0];

/// What one frontier search looks for.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Search<'a> {
    /// Way counts, ascending.
    pub(super) ways: &'a [u32],
    /// Cores in force.
    pub(super) cores_now: u32,
    /// The most cores a candidate may have ([`max_cores`]).
    pub(super) max_cores: u32,
    /// A candidate's pessimistic p99 must be at most this fraction of the target.
    pub(super) margin: f64,
    /// Spreads added to the mean for the pessimistic prediction.
    pub(super) k_sigma: f64,
    /// Largest admissible spread.
    pub(super) unsure_sigma: f64,
}

/// Way counts searched, for services that may have at most `max` ways in all: a way more or
/// less matters less the more a service has, so the grid thins out, and ends at `max`.
pub(super) fn way_grid(max: u32) -> Vec<u32> {
    let mut g: Vec<u32> = [1, 2, 3, 4, 6, 8, 11, 14]
        .into_iter()
        .filter(|w| *w < max)
        .collect();
    g.push(max);
    g
}

/// The point that puts a service on the pool's ways: `(cores, 0)` with the cores of its
/// frontier's one-way point, where `points` has one and either needs no more cores there
/// than with any other way count (a cache-insensitive service: the model says ways do not
/// help it) or the host is `crowded` (another service over its target for a while); `None`
/// otherwise.
///
/// Why the crowded case: on a crowded host the ways, not the cores, run out, and the
/// services that need few hold one each that a service short of ways lacks. The pool's
/// range is at least one way, so a service the model vouches for on one way may run there,
/// as the oracle puts such services there. One measured past its margin there is not put
/// there again at that load (`ServiceState::pool_ways_allowed`). Offered at a load step's
/// transient miss as well, it cost the uncrowded hosts best effort (docs/EXPERIMENTS.md, "A
/// service on the pool's ways when the host is crowded").
pub(super) fn pool_point(points: &[(u32, u32)], crowded: bool) -> Option<(u32, u32)> {
    let fewest = points.iter().map(|p| p.0).min()?;
    points
        .iter()
        .find(|p| p.1 == 1 && (crowded || p.0 == fewest))
        .map(|p| (p.0, 0))
}

/// The trust region: training candidates had at most twice the cores in force, so a single
/// step at most doubles them (at least 2, at most the host's). A service measured under its
/// margin (`held`) only looks for cheaper allocations, so a quarter more cores is as far as
/// it needs to look.
pub(super) fn max_cores(cores_now: u32, host_cores: u32, held: bool) -> u32 {
    let reach = if held {
        cores_now + cores_now / 4
    } else {
        cores_now * 2
    };
    host_cores.min(reach.max(2))
}

/// The core counts scored first: [`CORE_GRID`] times the cores in force, rounded, within
/// 1..=`max_cores`, ascending and distinct.
pub(super) fn core_grid(cores_now: u32, max_cores: u32) -> Vec<u32> {
    let cur = f64::from(cores_now.max(1));
    let mut grid: Vec<u32> = CORE_GRID
        .iter()
        .map(|f| u32::try_from(cohabit_core::whole((cur * f).max(1.0))).unwrap_or(1))
        .map(|c| c.clamp(1, max_cores))
        .collect();
    grid.sort_unstable();
    grid.dedup();
    grid
}

/// The per-way frontier: for each way count of `s.ways` that has one, (fewest admissible
/// cores, ways), in way order. `score` predicts (cores, ways) candidates in one batch; it is
/// called twice at most.
pub(super) fn frontier(
    s: &Search<'_>,
    mut score: impl FnMut(&[(u32, u32)]) -> Vec<Pred>,
) -> Vec<(u32, u32)> {
    let limit = s.margin.ln();
    let ok = |p: &Pred| p.mean + s.k_sigma * p.sigma <= limit && p.sigma <= s.unsure_sigma;
    let ways = s.ways;
    let grid = core_grid(s.cores_now, s.max_cores);
    let points: Vec<(u32, u32)> = ways
        .iter()
        .flat_map(|&w| grid.iter().map(move |&c| (c, w)))
        .collect();
    let scored = score(&points);
    // Per way: the first admissible grid point and the grid point below it.
    let mut lo = vec![0u32; ways.len()];
    let mut hi = vec![0u32; ways.len()];
    let mut found = vec![false; ways.len()];
    for k in 0..ways.len() {
        let row = &scored[k * grid.len()..(k + 1) * grid.len()];
        if let Some(i) = row.iter().position(ok) {
            hi[k] = grid[i];
            lo[k] = if i == 0 { grid[0] } else { grid[i - 1] + 1 };
            found[k] = true;
        }
    }
    // Close every gap in one batch: each core count between the grid point below and the
    // first admissible one.
    let gaps: Vec<(usize, u32)> = (0..ways.len())
        .filter(|&k| found[k])
        .flat_map(|k| (lo[k]..hi[k]).map(move |c| (k, c)))
        .collect();
    if !gaps.is_empty() {
        let points: Vec<(u32, u32)> = gaps.iter().map(|&(k, c)| (c, ways[k])).collect();
        for (&(k, c), p) in gaps.iter().zip(score(&points)) {
            if c < hi[k] && ok(&p) {
                hi[k] = c;
            }
        }
    }
    (0..ways.len())
        .filter(|&k| found[k])
        .map(|k| (hi[k], ways[k]))
        .collect()
}

/// When nothing meets the target with the margin: for each way count, the fewest cores
/// among the candidates already `scored` whose pessimistic prediction (mean plus `k_sigma`
/// spreads) meets the bare target with a spread of at most `unsure_sigma` (no second
/// search). The caller gives spreads to a service that meets its target now: held at its
/// mean's bare target it sits on the edge, and a quiet reading (a latency window) keeps it
/// there until the load tips it over (docs/EXPERIMENTS.md, "Results history").
pub(super) fn bare_target(
    ways: &[u32],
    scored: &[((u32, u32), Pred)],
    unsure_sigma: f64,
    k_sigma: f64,
) -> Vec<(u32, u32)> {
    ways.iter()
        .filter_map(|&w| {
            scored
                .iter()
                .filter(|((_, sw), p)| {
                    *sw == w && p.mean + k_sigma * p.sigma <= 0.0 && p.sigma <= unsure_sigma
                })
                .min_by_key(|((c, _), _)| *c)
                .map(|((c, _), _)| (*c, w))
        })
        .collect()
}

/// A service that needs more never loses ways in the same step: trading its cache for
/// cores on a prediction alone can land on a cache cliff. Every point is lifted to the `w0`
/// ways in force (cores may go, so that cores piled on by earlier steps do not block the
/// ways it needs); the result is sorted and distinct.
pub(super) fn never_fewer_ways(points: Vec<(u32, u32)>, w0: u32) -> Vec<(u32, u32)> {
    let mut points: Vec<(u32, u32)> = points.into_iter().map(|(c, w)| (c, w.max(w0))).collect();
    points.sort_unstable();
    points.dedup();
    points
}

/// A service that may give back (measured within its margin, or safe to keep) with `busy`
/// cores measured busy never gives back into the steep part of its queueing curve: a point
/// (cores, ways) with fewer cores or fewer ways than the `current` ones needs at least
/// `busy + headroom * sqrt(busy)` cores (square-root staffing: the spare cores a queue
/// needs to stay short of saturation grow as the square root of its load; a cut of ways
/// asks the same of the cores it keeps, since fewer ways only slow each request). A point
/// under that floor is lifted to it, and where the floor is above the cores in force, to
/// the allocation in force: the rule only takes give-backs away, it never sizes a service
/// up. Points at least as large as the current ones stay as they are. The result is sorted
/// and distinct. No busy reading (or a negative `headroom`: off), every point stays.
///
/// Why: the learned model, trained on allocations around a few loads, draws a service's
/// queueing cliff as a slope; near saturation it predicts a one-core cut as costing
/// nothing where the true p99 jumps (docs/EXPERIMENTS.md, "Results history").
pub(super) fn short_of_saturation(
    points: Vec<(u32, u32)>,
    current: (u32, u32),
    busy: Option<f64>,
    headroom: f64,
) -> Vec<(u32, u32)> {
    let Some(floor) = saturation_floor(busy, headroom) else {
        return points;
    };
    let mut out: Vec<(u32, u32)> = points
        .into_iter()
        .map(|(c, w)| {
            if (c >= current.0 && w >= current.1) || f64::from(c) >= floor {
                (c, w)
            } else if floor <= f64::from(current.0) {
                // Within the cores in force, so its whole cores are too.
                let lifted = u32::try_from(cohabit_core::whole(floor.ceil())).unwrap_or(current.0);
                (lifted, w)
            } else {
                current
            }
        })
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

/// The cores a queue with `busy` cores busy needs to stay short of saturation,
/// `busy + headroom * sqrt(busy)` (square-root staffing); `None` without a plausible busy
/// reading or with a negative `headroom` (off).
fn saturation_floor(busy: Option<f64>, headroom: f64) -> Option<f64> {
    let busy = busy.filter(|b| b.is_finite() && *b >= 0.0 && headroom >= 0.0)?;
    Some(busy + headroom * busy.sqrt())
}

/// p99/target past which a climbing p99 on cores nearly all busy is sized up before it
/// crosses its target ([`climb_floor`]).
const CLIMB_WATCH: f64 = 0.8;

/// The cores a service holding `cores` should have now, when its p99 is climbing toward
/// saturation: two readings in a row past [`CLIMB_WATCH`] of its target, the newer
/// (`measured`, ln(p99/target)) above the older (`prev`), with the cores in force under
/// the saturation floor `busy + headroom * sqrt(busy)` of [`short_of_saturation`]. Then
/// the floor's whole cores; else `None`.
///
/// Why: the floor keeps a give-back short of saturation, but a load that drifts up after
/// one finds the service on the steep part of its queueing curve, where the p99 climbs
/// fast and each reading (resting on the last few intervals) lags it.
/// Held there until a reading crosses the margin, the next reading is over the target, and
/// the model, which draws the cliff as a slope, predicts the allocation in force just under
/// it (docs/EXPERIMENTS.md, "A p99 climbing on busy cores is sized up before it crosses").
pub(super) fn climb_floor(
    measured: Option<f64>,
    prev: Option<Reading>,
    cores: u32,
    busy: Option<f64>,
    headroom: f64,
) -> Option<u32> {
    let (q, p) = (measured?, prev?.log_q);
    let floor = saturation_floor(busy, headroom)?;
    let watch = CLIMB_WATCH.ln();
    (p > watch && q > p && floor > f64::from(cores))
        .then(|| u32::try_from(cohabit_core::whole(floor.ceil())).unwrap_or(cores))
}

/// `points` with at least `cores` cores and `ways` ways each, sorted and distinct.
fn at_least(points: Vec<(u32, u32)>, cores: u32, ways: u32) -> Vec<(u32, u32)> {
    let mut out: Vec<(u32, u32)> = points
        .into_iter()
        .map(|(c, w)| (c.max(cores), w.max(ways)))
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

/// A frontier and its reason after [`climb_floor`]'s answer `climb` for a service holding
/// `ways`: with it, every point lifted to its cores and to the ways held (a climbing
/// service gives nothing back: lifted in cores alone, the cheapest point traded ways for
/// the core, docs/EXPERIMENTS.md, "A p99 climbing on busy cores is sized up before it
/// crosses"), and the reason saying so.
pub(super) fn sized_for_climb(
    points: Vec<(u32, u32)>,
    text: String,
    climb: Option<u32>,
    ways: u32,
) -> (Vec<(u32, u32)>, String) {
    match climb {
        Some(floor) => (
            at_least(points, floor, ways),
            format!("{text}; p99 climbing with its cores nearly all busy: at least {floor} cores"),
        ),
        None => (points, text),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_p99_climbing_on_busy_cores_is_sized_to_the_saturation_floor() {
        let ln = f64::ln;
        let reading = |q: f64| {
            Some(Reading {
                log_q: q.ln(),
                rps: None,
            })
        };
        // nginx on 4 cores, 3.9 busy (floor 4.89): 0.82 then 0.88 of its target.
        let climbing =
            |q: f64, p: f64, busy: f64| climb_floor(Some(ln(q)), reading(p), 4, Some(busy), 0.5);
        assert_eq!(climbing(0.88, 0.82, 3.9), Some(5));
        // Falling, or the older reading not yet past the watch: held.
        assert_eq!(climbing(0.82, 0.88, 3.9), None);
        assert_eq!(climbing(0.88, 0.78, 3.9), None);
        // Cores to spare (2.5 busy: floor 3.29 under 4): held.
        assert_eq!(climbing(0.88, 0.82, 2.5), None);
        // No busy reading, no reading, or the headroom off: held.
        assert_eq!(
            climb_floor(Some(ln(0.88)), reading(0.82), 4, None, 0.5),
            None
        );
        assert_eq!(climb_floor(None, reading(0.82), 4, Some(3.9), 0.5), None);
        assert_eq!(
            climb_floor(Some(ln(0.88)), reading(0.82), 4, Some(3.9), -1.0),
            None
        );
        assert_eq!(
            at_least(vec![(3, 4), (4, 2), (6, 1)], 5, 2),
            vec![(5, 2), (5, 4), (6, 2)]
        );
        // A climbing service's frontier gives no way back.
        let (points, text) = sized_for_climb(vec![(9, 3), (10, 1)], "hold".into(), Some(10), 3);
        assert_eq!(points, vec![(10, 3)]);
        assert!(text.contains("at least 10 cores"), "{text}");
        let (points, _) = sized_for_climb(vec![(9, 3), (10, 1)], "hold".into(), None, 3);
        assert_eq!(points, vec![(9, 3), (10, 1)]);
    }

    #[test]
    fn only_a_flat_frontier_offers_the_pools_ways_on_a_host_not_crowded() {
        // As few cores with one way as with any: the pool's ways, with those cores.
        assert_eq!(pool_point(&[(4, 1), (4, 2), (4, 8)], false), Some((4, 0)));
        // One way needs a core more than two: ways matter, no pool point.
        assert_eq!(pool_point(&[(5, 1), (4, 2), (4, 8)], false), None);
        // No one-way point (not admissible there): none either.
        assert_eq!(pool_point(&[(4, 2), (4, 8)], false), None);
        assert_eq!(pool_point(&[], false), None);
    }

    #[test]
    fn on_a_crowded_host_any_one_way_point_offers_the_pools_ways() {
        // Ways matter, but the host is crowded: the pool's ways with the one-way cores.
        assert_eq!(pool_point(&[(5, 1), (4, 2), (4, 8)], true), Some((5, 0)));
        // Still none without a one-way point.
        assert_eq!(pool_point(&[(4, 2), (4, 8)], true), None);
    }

    fn pred(mean: f64, sigma: f64) -> Pred {
        Pred::plain(mean, sigma, sigma)
    }

    /// A search from 10 cores, up to 20, with the default margin (0.9) and spreads.
    fn search(ways: &[u32]) -> Search<'_> {
        Search {
            ways,
            cores_now: 10,
            max_cores: 20,
            margin: 0.9,
            k_sigma: 0.5,
            unsure_sigma: 0.7,
        }
    }

    /// A service that meets its target with a margin when cores × ways ≥ 40: -0.5 ± 0.1
    /// there (pessimistic -0.45 < ln 0.9 = -0.105), +0.5 ± 0.1 elsewhere. Records every
    /// batch.
    fn scorer(batches: &mut Vec<Vec<(u32, u32)>>) -> impl FnMut(&[(u32, u32)]) -> Vec<Pred> + '_ {
        move |points| {
            batches.push(points.to_vec());
            points
                .iter()
                .map(|&(c, w)| pred(if c * w >= 40 { -0.5 } else { 0.5 }, 0.1))
                .collect()
        }
    }

    #[test]
    fn the_way_grid_thins_out_and_ends_at_the_most_a_service_can_have() {
        assert_eq!(way_grid(19), vec![1, 2, 3, 4, 6, 8, 11, 14, 19]);
        assert_eq!(way_grid(5), vec![1, 2, 3, 4, 5]);
        assert_eq!(way_grid(1), vec![1]);
    }

    #[test]
    fn the_trust_region_is_twice_the_cores_in_force() {
        assert_eq!(max_cores(10, 36, false), 20);
        // Never beyond the host, never under 2.
        assert_eq!(max_cores(30, 36, false), 36);
        assert_eq!(max_cores(1, 36, false), 2);
    }

    #[test]
    fn a_service_within_its_margin_searches_only_a_quarter_more_cores() {
        assert_eq!(max_cores(10, 36, true), 12);
        assert_eq!(max_cores(3, 36, true), 3);
    }

    #[test]
    fn the_core_grid_spans_four_tenths_to_twice_the_cores_in_force_within_the_trust_region() {
        // 10 × [0.4, 0.6, 0.8, 1.0, 1.4, 2.0].
        assert_eq!(core_grid(10, 20), vec![4, 6, 8, 10, 14, 20]);
        // Held: the trust region is 12, so 14 and 20 become 12.
        assert_eq!(core_grid(10, 12), vec![4, 6, 8, 10, 12]);
        // 2 cores: 0.8, 1.2, 1.6, 2, 2.8, 4 round to 1, 1, 2, 2, 3, 4.
        assert_eq!(core_grid(2, 4), vec![1, 2, 3, 4]);
    }

    #[test]
    fn the_frontier_is_the_fewest_admissible_cores_per_way_found_in_two_batches() {
        let mut batches = Vec::new();
        let ways = [2, 4, 8];
        let got = frontier(&search(&ways), scorer(&mut batches));
        // 2 ways need 20 cores: grid point 20 (14 is not enough); the gap 15..=19 fails.
        // 4 ways need 10: grid point 10; the gap is 9 (8 + 1), which fails.
        // 8 ways need 5: grid point 6; the gap is 5 (4 + 1), which is enough.
        assert_eq!(got, vec![(20, 2), (10, 4), (5, 8)]);
        assert_eq!(batches.len(), 2);
        assert_eq!(batches[0].len(), 3 * 6);
        assert_eq!(
            batches[1],
            vec![(15, 2), (16, 2), (17, 2), (18, 2), (19, 2), (9, 4), (5, 8)]
        );
    }

    #[test]
    fn the_frontier_never_scores_beyond_the_trust_region() {
        // 1 way would need 40 cores; the trust region from 10 is 20: no point for it, and
        // nothing above 20 was scored.
        let mut batches = Vec::new();
        let ways = [1, 4];
        let got = frontier(&search(&ways), scorer(&mut batches));
        assert_eq!(got, vec![(10, 4)]);
        let most = batches.iter().flatten().map(|(c, _)| *c).max();
        assert_eq!(most, Some(20));
    }

    #[test]
    fn the_frontier_does_not_search_below_the_lowest_grid_point() {
        // 16 ways need 3 cores, but the grid starts at 4: 4 it is, in one batch.
        let mut batches = Vec::new();
        let ways = [16];
        let got = frontier(&search(&ways), scorer(&mut batches));
        assert_eq!(got, vec![(4, 16)]);
        assert_eq!(batches.len(), 1);
    }

    #[test]
    fn an_unsure_prediction_is_never_admissible() {
        // Mean -2 everywhere, but a spread of 0.8 > 0.7.
        let ways = [4];
        let got = frontier(&search(&ways), |p| vec![pred(-2.0, 0.8); p.len()]);
        assert_eq!(got, vec![]);
    }

    #[test]
    fn the_pessimistic_prediction_uses_k_sigma() {
        // -0.5 ± 0.4: with k 0.5, -0.3 <= ln 0.9 (-0.105); with k 1, -0.1 is not.
        let ways = [4];
        let s = search(&ways);
        assert_eq!(
            frontier(&s, |p| vec![pred(-0.5, 0.4); p.len()]),
            vec![(4, 4)]
        );
        let give_back = Search { k_sigma: 1.0, ..s };
        assert_eq!(
            frontier(&give_back, |p| vec![pred(-0.5, 0.4); p.len()]),
            vec![]
        );
    }

    #[test]
    fn the_bare_target_takes_the_fewest_scored_cores_that_meet_it_per_way() {
        let scored = [
            ((8, 2), pred(-0.05, 0.2)),
            ((6, 2), pred(-0.01, 0.3)),
            ((4, 2), pred(0.1, 0.2)),
            ((4, 4), pred(-0.2, 0.9)),
            ((6, 4), pred(-0.2, 0.5)),
        ];
        // 2 ways: 6 (4 misses the target). 4 ways: 6 (4 is unsure). 8 ways: never scored.
        assert_eq!(
            bare_target(&[2, 4, 8], &scored, 0.7, 0.0),
            vec![(6, 2), (6, 4)]
        );
        // A fifth of a spread on top: with 2 ways 6 cores no longer meet it (-0.01 + 0.06),
        // 8 do (-0.05 + 0.04); with 4 ways 6 still do (-0.2 + 0.1).
        assert_eq!(
            bare_target(&[2, 4, 8], &scored, 0.7, 0.2),
            vec![(8, 2), (6, 4)]
        );
        // Half a spread: none of them.
        assert!(bare_target(&[2, 4, 8], &scored, 0.7, 0.5).is_empty());
    }

    #[test]
    fn a_service_that_needs_more_never_loses_ways_in_the_same_step() {
        // 4 ways in force: (4, 2) and (6, 3) keep 4 ways; (3, 8) keeps its 8.
        let got = never_fewer_ways(vec![(4, 2), (6, 3), (3, 8), (4, 4)], 4);
        assert_eq!(got, vec![(3, 8), (4, 4), (6, 4)]);
    }

    #[test]
    fn a_give_back_stops_short_of_saturation() {
        // 21 of 23 cores busy: 21 + 0.5 * sqrt(21) = 23.3 cores, more than are in force, so
        // no cut of cores or of ways: each becomes the allocation in force; a trade at 24
        // cores and points no smaller than the current one stay.
        let pts = vec![(21, 4), (22, 6), (23, 2), (24, 2), (23, 6)];
        assert_eq!(
            short_of_saturation(pts, (23, 4), Some(21.0), 0.5),
            vec![(23, 4), (23, 6), (24, 2)]
        );
        // 16 busy: 18 cores at least; a cut to 18 stays, one to 17 is lifted to 18; a cut of
        // ways at 23 cores stays.
        let pts = vec![(17, 4), (18, 3), (23, 2)];
        assert_eq!(
            short_of_saturation(pts, (23, 4), Some(16.0), 0.5),
            vec![(18, 3), (18, 4), (23, 2)]
        );
        // The floor is whole cores but never above those in force: 21.2 busy and no
        // headroom, 22 cores.
        assert_eq!(
            short_of_saturation(vec![(15, 4)], (23, 4), Some(21.2), 0.0),
            vec![(22, 4)]
        );
        // However large the reading, nothing grows past the allocation in force.
        assert_eq!(
            short_of_saturation(vec![(2, 1)], (8, 2), Some(1e12), 0.5),
            vec![(8, 2)]
        );
        // No busy reading, or the rule off: every point as it was.
        assert_eq!(
            short_of_saturation(vec![(20, 4)], (23, 4), None, 0.5),
            vec![(20, 4)]
        );
        assert_eq!(
            short_of_saturation(vec![(20, 4)], (23, 4), Some(21.0), -1.0),
            vec![(20, 4)]
        );
    }
}
