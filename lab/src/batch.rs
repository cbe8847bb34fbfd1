//! Helpers for the lab examples that run many simulations and summarise them: a parallel
//! map over the machine's CPUs and the summary statistics they print.

/// `f` over `items` on every CPU the machine has, results in the order of `items`; the
/// first error (in that order) is returned.
pub fn parallel<T: Sync, R: Send>(
    items: &[T],
    f: impl Fn(&T) -> anyhow::Result<R> + Sync,
) -> anyhow::Result<Vec<R>> {
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let chunk = items.len().div_ceil(threads).max(1);
    std::thread::scope(|s| {
        let handles: Vec<_> = items
            .chunks(chunk)
            .map(|c| {
                let f = &f;
                s.spawn(move || c.iter().map(f).collect::<anyhow::Result<Vec<R>>>())
            })
            .collect();
        let mut out = Vec::with_capacity(items.len());
        for h in handles {
            out.extend(h.join().expect("a worker panicked")?);
        }
        Ok(out)
    })
}

/// The median of `v` (the upper one of an even count; sorts `v`), NaN when empty.
pub fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The mean of `v`, NaN when empty.
pub fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.iter().sum::<f64>() / v.len() as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parallel_keeps_the_order_and_returns_the_first_error() {
        let items: Vec<u32> = (0..50).collect();
        let doubled = parallel(&items, |x| Ok(x * 2)).unwrap();
        assert_eq!(doubled, items.iter().map(|x| x * 2).collect::<Vec<_>>());
        let failed = parallel(&items, |&x| {
            anyhow::ensure!(x < 7, "item {x}");
            Ok(x)
        });
        assert_eq!(failed.unwrap_err().to_string(), "item 7");
    }

    #[test]
    fn median_and_mean_of_a_few_values_and_of_none() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 3.0);
        assert!(median(&mut []).is_nan());
        assert_eq!(mean(&[1.0, 2.0, 6.0]), 3.0);
        assert!(mean(&[]).is_nan());
    }
}
