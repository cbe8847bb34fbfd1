//! A latency window: the p99 of the requests of the last few control intervals together.
//!
//! **Problem.** One interval's p99 rests on that interval's requests alone: at a few hundred
//! requests a second the 99th percentile is a handful of requests, and it jumps from tick to
//! tick although nothing changed.
//!
//! **Approach.** Keep each interval's latency histogram, not its p99, and merge them: the
//! p99 of merged histograms is the p99 of all their requests, which a mean of p99s is not.
//! A window holds the intervals since what the service runs under last changed (the caller
//! says so with [`MergedWindow::restart`]) or since its load moved, up to a cap.
//!
//! **Algorithm.** [`MergedWindow::push`] drops every held interval first when the new
//! interval's request count moved the load (it differs from their mean count by more than
//! a tenth of that mean, floored at 1 request: [`cohabit_core::window::load_moved`]), then keeps the new interval and drops the
//! oldest beyond the cap. [`MergedWindow::p99_ms`] merges the held intervals into one
//! histogram ([`IntervalHistogram`]) and takes its 99th percentile:
//! - HDR histograms (pushed or probed latencies, in µs) are added bucket by bucket
//!   (`Histogram::add`);
//! - Prometheus buckets (the requests between two scrapes, [`Buckets`]) are summed at the
//!   bounds *every* held interval has. A cumulative count at a bound is exact only where
//!   each interval counted at that bound, so a bound missing from one interval (the
//!   service's bucket layout changed, or a scrape lacked it) is left out of the merged
//!   histogram: the p99 is then interpolated over coarser buckets, never over counts that
//!   mix "up to this bound" with "up to another".
//!
//! **Properties.** A window of one interval gives that interval's p99 exactly. The window
//! never holds more than [`MAX_LATENCY_WINDOW`] intervals, and each histogram is bounded already
//! ([`crate::latency::MAX_BOUNDS`] buckets; an HDR histogram covers at most an hour at 3
//! significant digits, and [`compact`] sizes it to its largest value), so a p99 costs at
//! most 60 merges of bounded size. The rule and its constants are [`cohabit_core::window`]'s,
//! which the simulator applies too, so policies see the same kind of p99 in both.

use std::collections::VecDeque;

use hdrhistogram::Histogram;

pub use crate::histogram::compact;
use crate::histogram::{quantile_between, Buckets};

/// Most control intervals one window may hold.
pub use cohabit_core::window::MAX_LATENCY_WINDOW;

/// Milliseconds per unit of an HDR latency histogram's values (they are microseconds).
pub const MS_PER_US: f64 = 0.001;

/// One control interval's latency histogram, which a window can merge with others of its
/// kind.
pub trait IntervalHistogram {
    /// The `q` quantile of the requests of `intervals` together, in the histograms' own
    /// unit; `None` when they hold no request.
    fn merged_quantile<'a, I>(intervals: I, q: f64) -> Option<f64>
    where
        I: IntoIterator<Item = &'a Self>,
        Self: 'a;
}

impl IntervalHistogram for Histogram<u64> {
    fn merged_quantile<'a, I>(intervals: I, q: f64) -> Option<f64>
    where
        I: IntoIterator<Item = &'a Self>,
        Self: 'a,
    {
        let mut iter = intervals.into_iter();
        let mut merged = iter.next()?.clone();
        // Grows to the largest value of any interval; `add` fails only if it cannot.
        merged.auto(true);
        for h in iter {
            merged.add(h).ok()?;
        }
        (!merged.is_empty()).then(|| merged.value_at_quantile(q) as f64)
    }
}

impl IntervalHistogram for Buckets {
    fn merged_quantile<'a, I>(intervals: I, q: f64) -> Option<f64>
    where
        I: IntoIterator<Item = &'a Self>,
        Self: 'a,
    {
        let mut iter = intervals.into_iter();
        let mut merged = iter.next()?.0.clone();
        for b in iter {
            merged = sum_common_bounds(&merged, &b.0);
        }
        quantile_between(None, &Buckets(merged), q).map(|(value, _)| value)
    }
}

/// The cumulative counts of `a` and `b` summed at the bounds both have, in increasing bound
/// order: one merge over the two sorted lists.
fn sum_common_bounds(a: &[(f64, f64)], b: &[(f64, f64)]) -> Vec<(f64, f64)> {
    let mut b = b.iter().peekable();
    let mut out = Vec::with_capacity(a.len().min(b.len()));
    for &(bound, count) in a {
        while b.next_if(|(bb, _)| *bb < bound).is_some() {}
        if let Some(&(_, other)) = b.next_if(|(bb, _)| *bb == bound) {
            out.push((bound, count + other));
        }
    }
    out
}

/// The intervals one latency p99 rests on: the last few control intervals' histograms of
/// one service, each with its request count.
#[derive(Debug, Clone)]
pub struct MergedWindow<H> {
    cap: usize,
    ms_per_unit: f64,
    intervals: VecDeque<(H, f64)>,
}

/// A window over pushed or probed latencies (HDR histograms in µs).
pub type HdrWindow = MergedWindow<Histogram<u64>>;

/// A window over the requests between Prometheus scrapes.
pub type PromWindow = MergedWindow<Buckets>;

impl<H: IntervalHistogram> MergedWindow<H> {
    /// An empty window of at most `cap` intervals (clamped to 1..=[`MAX_LATENCY_WINDOW`]) over
    /// histograms whose values are `ms_per_unit` milliseconds each ([`MS_PER_US`] for HDR
    /// histograms in µs; `PromHistogram::ms_per_unit` for a scrape).
    pub fn new(cap: u32, ms_per_unit: f64) -> Self {
        let cap = cap.clamp(1, MAX_LATENCY_WINDOW) as usize;
        Self {
            cap,
            ms_per_unit,
            intervals: VecDeque::with_capacity(cap),
        }
    }

    /// Most intervals it holds.
    pub fn cap(&self) -> usize {
        self.cap
    }

    /// Intervals it holds now.
    pub fn len(&self) -> usize {
        self.intervals.len()
    }

    /// Whether it holds no interval.
    pub fn is_empty(&self) -> bool {
        self.intervals.is_empty()
    }

    /// Drops every interval: what the service runs under changed.
    pub fn restart(&mut self) {
        self.intervals.clear();
    }

    /// Whether an interval of `count` requests moved the load against the held intervals
    /// ([`cohabit_core::window::load_moved`]).
    pub fn load_moved(&self, count: f64) -> bool {
        cohabit_core::window::load_moved(self.intervals.iter().map(|(_, n)| *n), count)
    }

    /// Adds one interval's histogram `h` of `count` requests; restarts first if the load
    /// moved ([`Self::load_moved`]), and drops the oldest interval beyond the cap.
    pub fn push(&mut self, h: H, count: f64) {
        if self.load_moved(count) {
            self.restart();
        }
        self.intervals.push_back((h, count));
        while self.intervals.len() > self.cap {
            self.intervals.pop_front();
        }
    }

    /// The p99 (ms) of the requests of every held interval together; `None` when they hold
    /// none, or when the merged value is not a positive latency.
    pub fn p99_ms(&self) -> Option<f64> {
        H::merged_quantile(self.intervals.iter().map(|(h, _)| h), 0.99)
            .map(|v| v * self.ms_per_unit)
            .filter(|p| p.is_finite() && *p > 0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hdr(values: impl IntoIterator<Item = u64>) -> Histogram<u64> {
        let mut h = Histogram::new_with_bounds(1, 3_600_000_000, 3).unwrap();
        for v in values {
            h.record(v).unwrap();
        }
        h
    }

    /// Deterministic, spread-out latencies (µs): `n` values from a linear congruence.
    fn latencies(seed: u64, n: usize) -> Vec<u64> {
        let mut x = seed;
        (0..n)
            .map(|_| {
                x = x
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695);
                100 + (x >> 33) % 50_000
            })
            .collect()
    }

    #[test]
    fn merged_hdr_intervals_give_the_p99_of_all_their_requests() {
        let parts: Vec<Vec<u64>> = (1..=4).map(|s| latencies(s, 500)).collect();
        let mut w = HdrWindow::new(10, MS_PER_US);
        for p in &parts {
            w.push(compact(&hdr(p.iter().copied())), 500.0);
        }
        assert_eq!(w.len(), 4);
        let all = hdr(parts.concat());
        let want = all.value_at_quantile(0.99) as f64 * MS_PER_US;
        assert_eq!(w.p99_ms(), Some(want));
        // Not the mean of the intervals' p99s, which a slow interval would not move as much.
        let mut slow = parts[0].clone();
        slow.iter_mut().for_each(|v| *v *= 20);
        let mut w = HdrWindow::new(10, MS_PER_US);
        w.push(hdr(parts[1].iter().copied()), 500.0);
        w.push(hdr(slow.iter().copied()), 500.0);
        let both = hdr(parts[1].iter().chain(&slow).copied());
        assert_eq!(
            w.p99_ms(),
            Some(both.value_at_quantile(0.99) as f64 * MS_PER_US)
        );
    }

    #[test]
    fn one_interval_gives_its_own_p99_and_an_empty_window_none() {
        let h = hdr(latencies(7, 300));
        let mut w = HdrWindow::new(3, MS_PER_US);
        assert_eq!(w.p99_ms(), None);
        w.push(h.clone(), 300.0);
        assert_eq!(
            w.p99_ms(),
            Some(h.value_at_quantile(0.99) as f64 * MS_PER_US)
        );
        w.restart();
        assert!(w.is_empty());
        assert_eq!(w.p99_ms(), None);
        // Intervals without a request give no p99.
        w.push(hdr([]), 0.0);
        w.push(hdr([]), 0.0);
        assert_eq!((w.len(), w.p99_ms()), (2, None));
    }

    #[test]
    fn the_oldest_interval_goes_beyond_the_cap() {
        let mut w = HdrWindow::new(3, MS_PER_US);
        // A slow first interval, then three fast ones: the slow one leaves the window.
        w.push(hdr([900_000; 100]), 100.0);
        for _ in 0..2 {
            w.push(hdr([1_000; 100]), 100.0);
        }
        assert_eq!(w.len(), 3);
        assert!(w.p99_ms().unwrap() > 800.0, "{:?}", w.p99_ms());
        w.push(hdr([1_000; 100]), 100.0);
        assert_eq!(w.len(), 3);
        assert!((w.p99_ms().unwrap() - 1.0).abs() < 0.01, "{:?}", w.p99_ms());
    }

    #[test]
    fn the_cap_is_clamped_to_one_to_sixty() {
        assert_eq!(HdrWindow::new(0, MS_PER_US).cap(), 1);
        assert_eq!(HdrWindow::new(61, MS_PER_US).cap(), 60);
        assert_eq!(PromWindow::new(5, 1.0).cap(), 5);
    }

    #[test]
    fn a_load_change_over_ten_percent_restarts_the_window() {
        let mut w = HdrWindow::new(10, MS_PER_US);
        w.push(hdr([1_000; 10]), 1000.0);
        w.push(hdr([1_000; 10]), 1000.0);
        // 5 % off the mean: kept.
        w.push(hdr([1_000; 10]), 1050.0);
        assert_eq!(w.len(), 3);
        w.push(hdr([1_000; 10]), 960.0);
        assert_eq!(w.len(), 4);
        // Mean 1002.5; 1120 is 11.7 % above: only the new interval is left.
        w.push(hdr([5_000; 10]), 1120.0);
        assert_eq!(w.len(), 1);
        assert_eq!(
            w.p99_ms(),
            Some(hdr([5_000]).value_at_quantile(0.99) as f64 * MS_PER_US)
        );
        // Down counts too.
        w.push(hdr([1_000; 10]), 1000.0);
        assert_eq!(w.len(), 1);
        // The mean is floored at one request: 0 → 0.1 of a request is no change.
        let mut idle = HdrWindow::new(10, MS_PER_US);
        idle.push(hdr([]), 0.0);
        assert!(!idle.load_moved(0.1));
        assert!(idle.load_moved(1.0));
    }

    /// Cumulative buckets at the bounds 1, 10, 100, +Inf (seconds) from per-bucket counts.
    fn cumulative(per_bucket: [f64; 4]) -> Buckets {
        let bounds = [1.0, 10.0, 100.0, f64::INFINITY];
        let mut sum = 0.0;
        Buckets(
            bounds
                .iter()
                .zip(per_bucket)
                .map(|(b, c)| {
                    sum += c;
                    (*b, sum)
                })
                .collect(),
        )
    }

    /// `a` + `b` bound by bound (same bounds).
    fn add(a: &Buckets, b: &Buckets) -> Buckets {
        Buckets(
            a.0.iter()
                .zip(&b.0)
                .map(|(x, y)| (x.0, x.1 + y.1))
                .collect(),
        )
    }

    #[test]
    fn merged_scrape_intervals_give_the_p99_between_the_first_and_the_last_scrape() {
        // Four scrapes; three intervals between them.
        let s0 = cumulative([100.0, 10.0, 1.0, 0.0]);
        let s1 = add(&s0, &cumulative([90.0, 8.0, 2.0, 0.0]));
        let s2 = add(&s1, &cumulative([50.0, 40.0, 10.0, 0.0]));
        let s3 = add(&s2, &cumulative([95.0, 4.0, 0.0, 1.0]));
        let mut w = PromWindow::new(5, 1000.0);
        for (prev, cur) in [(&s0, &s1), (&s1, &s2), (&s2, &s3)] {
            let d = crate::histogram::interval_between(Some(prev), cur);
            let n = d.0.last().unwrap().1;
            w.push(d, n);
        }
        // 100 requests each interval: no restart.
        assert_eq!(w.len(), 3);
        let (want, n) = quantile_between(Some(&s0), &s3, 0.99).unwrap();
        assert_eq!(n, 300.0);
        let got = w.p99_ms().unwrap();
        assert!(
            (got - want * 1000.0).abs() < 1e-9,
            "{got} vs {}",
            want * 1000.0
        );
    }

    #[test]
    fn a_counter_reset_in_the_middle_counts_the_requests_since_the_reset() {
        let s0 = cumulative([100.0, 10.0, 0.0, 0.0]);
        let s1 = add(&s0, &cumulative([80.0, 20.0, 0.0, 0.0]));
        // The service restarted: its counters start from zero.
        let s2 = cumulative([70.0, 25.0, 5.0, 0.0]);
        let s3 = add(&s2, &cumulative([75.0, 20.0, 5.0, 0.0]));
        let mut w = PromWindow::new(5, 1.0);
        for (prev, cur) in [(&s0, &s1), (&s1, &s2), (&s2, &s3)] {
            let d = crate::histogram::interval_between(Some(prev), cur);
            let n = d.0.last().unwrap().1;
            assert_eq!(n, 100.0, "each interval counts its own requests");
            w.push(d, n);
        }
        let all = add(
            &add(&cumulative([80.0, 20.0, 0.0, 0.0]), &s2),
            &cumulative([75.0, 20.0, 5.0, 0.0]),
        );
        let (want, _) = quantile_between(None, &all, 0.99).unwrap();
        assert_eq!(w.p99_ms(), Some(want));
        assert!(
            want > 10.0,
            "the slow requests after the reset count: {want}"
        );
    }

    #[test]
    fn scrape_intervals_merge_only_at_the_bounds_every_interval_has() {
        let a = Buckets(vec![
            (1.0, 50.0),
            (5.0, 90.0),
            (10.0, 100.0),
            (f64::INFINITY, 100.0),
        ]);
        let b = Buckets(vec![(1.0, 40.0), (10.0, 99.0), (f64::INFINITY, 100.0)]);
        assert_eq!(
            sum_common_bounds(&a.0, &b.0),
            vec![(1.0, 90.0), (10.0, 199.0), (f64::INFINITY, 200.0)]
        );
        let mut w = PromWindow::new(3, 1.0);
        w.push(a, 100.0);
        w.push(b, 100.0);
        // Rank 198 of 200 lies in (1, 10]: interpolated there, not at bound 5.
        let p = w.p99_ms().unwrap();
        assert!(
            (p - (1.0 + 9.0 * (198.0 - 90.0) / 109.0)).abs() < 1e-12,
            "{p}"
        );
    }

    #[test]
    fn a_compact_copy_keeps_every_quantile_and_is_smaller() {
        let h = hdr(latencies(3, 2000));
        let c = compact(&h);
        for q in [0.0, 0.5, 0.9, 0.99, 0.999, 1.0] {
            assert_eq!(c.value_at_quantile(q), h.value_at_quantile(q), "q {q}");
        }
        assert_eq!(c.len(), h.len());
        assert!(
            c.distinct_values() * 2 < h.distinct_values(),
            "{} vs {}",
            c.distinct_values(),
            h.distinct_values()
        );
        assert_eq!(compact(&hdr([])).len(), 0);
    }
}
