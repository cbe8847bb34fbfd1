//! Latency histogram maths that `latency` and `window` share: a Prometheus histogram's
//! cumulative buckets, the requests between two scrapes and their quantiles, and an HDR
//! histogram's compact copy.

use hdrhistogram::Histogram;

/// Cumulative buckets of one histogram at one scrape: upper bound → count, in increasing
/// bound order. The `+Inf` bucket is stored under `f64::INFINITY`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Buckets(pub Vec<(f64, f64)>);

/// The requests per bucket between two scrapes, both in increasing bound order: one merge
/// over the two lists, so each bucket is looked at once. Bounds present in only one scrape
/// are left out. `None` when a counter went down (a reset).
fn difference<'a>(
    prev: impl IntoIterator<Item = &'a (f64, f64)>,
    cur: impl IntoIterator<Item = &'a (f64, f64)>,
) -> Option<Vec<(f64, f64)>> {
    let mut prev = prev.into_iter().peekable();
    let mut out = Vec::new();
    for &(bound, count) in cur {
        while prev.next_if(|(pb, _)| *pb < bound).is_some() {}
        if let Some(&(_, pc)) = prev.next_if(|(pb, _)| *pb == bound) {
            if count < pc {
                return None;
            }
            out.push((bound, count - pc));
        }
    }
    Some(out)
}

/// The requests counted between scrapes `prev` and `cur`, as cumulative buckets: the
/// difference bound by bound (bounds present in only one scrape are left out), or `cur`
/// whole when there is no `prev` or a counter went down (a reset: the service started
/// counting afresh, so its current counts are the requests since).
pub fn interval_between(prev: Option<&Buckets>, cur: &Buckets) -> Buckets {
    Buckets(
        prev.and_then(|p| difference(&p.0, &cur.0))
            .unwrap_or_else(|| cur.0.clone()),
    )
}

/// The `q` quantile of the requests counted between `prev` and `cur`, in the histogram's
/// unit, and how many requests that was. `None` when no request arrived.
pub fn quantile_between(prev: Option<&Buckets>, cur: &Buckets, q: f64) -> Option<(f64, f64)> {
    let delta = interval_between(prev, cur).0;
    let total = delta.last().map_or(0.0, |(_, c)| *c);
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let mut lower = (0.0, 0.0);
    for &(bound, count) in &delta {
        if count >= rank {
            if bound.is_infinite() {
                // Prometheus' convention: the highest finite bound.
                return Some((lower.0, total));
            }
            let in_bucket = count - lower.1;
            let frac = if in_bucket > 0.0 {
                (rank - lower.1) / in_bucket
            } else {
                1.0
            };
            return Some((lower.0 + (bound - lower.0) * frac, total));
        }
        lower = (bound, count);
    }
    Some((lower.0, total))
}

/// A copy of `h` sized to its largest value: what a window keeps of one interval. An HDR
/// histogram's counts grow with the largest value it can hold (about 8 KB per doubling,
/// 190 KB for an hour in µs), so a copy that only reaches the interval's slowest request
/// is usually several times smaller. Bucket boundaries stay the same, so every quantile
/// is the same.
pub fn compact(h: &Histogram<u64>) -> Histogram<u64> {
    let copy = Histogram::new_with_bounds(h.low(), h.max().max(2 * h.low()), h.sigfig())
        .ok()
        .and_then(|mut c| c.add(h).ok().map(|()| c));
    copy.unwrap_or_else(|| h.clone())
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;
    use crate::latency::parse_buckets;

    #[test]
    fn a_hundred_thousand_bucket_lines_are_compared_in_one_pass() {
        // 100 series of 1000 bounds each: 100 000 lines, 1000 distinct bounds.
        let scrape = |scale: f64| -> String {
            (0..100)
                .flat_map(|series| {
                    (1..=1000).map(move |b| {
                        format!(
                            "m_bucket{{pod=\"p{series}\",le=\"{b}\"}} {}\n",
                            f64::from(b) * scale
                        )
                    })
                })
                .collect()
        };
        let a = parse_buckets(&scrape(1.0), "m").unwrap().buckets;
        let b = parse_buckets(&scrape(2.0), "m").unwrap().buckets;
        assert_eq!((a.0.len(), b.0.len()), (1000, 1000));
        // The comparison looks at each bucket of each scrape at most once.
        let pulled = Cell::new(0usize);
        let count = |x| {
            pulled.set(pulled.get() + 1);
            x
        };
        let d = difference(a.0.iter().map(count), b.0.iter().map(count)).unwrap();
        assert_eq!(d.len(), 1000);
        assert!(
            pulled.get() <= a.0.len() + b.0.len(),
            "{} items",
            pulled.get()
        );
        assert_eq!(d[999], (1000.0, 100.0 * 1000.0));
    }

    #[test]
    fn differences_between_scrapes_resets_and_missing_buckets() {
        let a = Buckets(vec![(0.001, 50.0), (0.01, 90.0), (f64::INFINITY, 100.0)]);
        let b = Buckets(vec![(0.001, 150.0), (0.01, 190.0), (f64::INFINITY, 200.0)]);
        let (p, n) = quantile_between(Some(&a), &b, 0.5).unwrap();
        assert_eq!(n, 100.0);
        assert!(p <= 0.001);
        // Reset: the new buckets are the difference.
        let after_reset = Buckets(vec![(0.001, 1.0), (0.01, 10.0), (f64::INFINITY, 10.0)]);
        assert_eq!(
            quantile_between(Some(&b), &after_reset, 0.99).unwrap().1,
            10.0
        );
        // A bucket missing from one scrape is ignored.
        let partial = Buckets(vec![(0.01, 290.0), (f64::INFINITY, 300.0)]);
        assert_eq!(quantile_between(Some(&b), &partial, 0.5).unwrap().1, 100.0);
        // Nothing happened: no p99.
        assert!(quantile_between(Some(&b), &b, 0.99).is_none());
        // All in +Inf: the highest finite bound.
        let slow = Buckets(vec![(0.01, 200.0), (f64::INFINITY, 300.0)]);
        assert_eq!(
            quantile_between(
                Some(&Buckets(vec![(0.01, 200.0), (f64::INFINITY, 200.0)])),
                &slow,
                0.99
            )
            .unwrap()
            .0,
            0.01
        );
    }
}
