//! Back-off between failed requests to the API server. Pure: the caller sleeps.
//!
//! Exponential from `initial` to `max`, with "equal jitter" (each delay drawn in
//! [d/2, d]) so that the agents of a whole fleet, cut off together, do not come back in
//! lockstep. The jitter is a hash of a seed (the node name) and the attempt number, so it is
//! deterministic per node and needs no random source. A server's `Retry-After` (429) is a
//! floor on the delay, up to [`MAX_RETRY_AFTER`].

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::time::Duration;

/// The longest `Retry-After` honoured; a larger one is taken as this.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(300);

/// Exponential back-off state.
#[derive(Debug, Clone)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    seed: u64,
    attempt: u32,
}

impl Backoff {
    /// A back-off from `initial` doubling up to `max`, jittered by `seed`.
    pub fn new(initial: Duration, max: Duration, seed: &str) -> Backoff {
        let mut h = DefaultHasher::new();
        seed.hash(&mut h);
        Backoff {
            initial,
            max: max.max(initial),
            seed: h.finish(),
            attempt: 0,
        }
    }

    /// A request succeeded: the next failure starts from `initial` again.
    pub fn reset(&mut self) {
        self.attempt = 0;
    }

    /// Failures in a row so far.
    pub fn attempts(&self) -> u32 {
        self.attempt
    }

    /// The delay before the next try after one more failure.
    pub fn next_delay(&mut self, retry_after: Option<Duration>) -> Duration {
        let base = self
            .initial
            .saturating_mul(1u32 << self.attempt.min(20))
            .min(self.max);
        let mut h = DefaultHasher::new();
        (self.seed, self.attempt).hash(&mut h);
        // A fraction in [0.5, 1.0] from the hash's top 16 bits.
        let top = u16::try_from(h.finish() >> 48).unwrap_or(u16::MAX);
        let frac = 0.5 + f64::from(top) / f64::from(u16::MAX) / 2.0;
        self.attempt = self.attempt.saturating_add(1);
        let jittered = base.mul_f64(frac);
        match retry_after {
            Some(r) => jittered.max(r.min(MAX_RETRY_AFTER)),
            None => jittered,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn delays_double_within_jitter_and_stop_at_max() {
        let mut b = Backoff::new(100 * MS, 1000 * MS, "node-a");
        let d: Vec<Duration> = (0..8).map(|_| b.next_delay(None)).collect();
        for (i, bound) in [100, 200, 400, 800, 1000, 1000, 1000, 1000]
            .iter()
            .enumerate()
        {
            let hi = *bound * MS;
            assert!(
                d[i] <= hi && d[i] >= hi / 2,
                "attempt {i}: {:?} not in [{:?}, {hi:?}]",
                d[i],
                hi / 2
            );
        }
        assert_eq!(b.attempts(), 8);
    }

    #[test]
    fn reset_starts_over() {
        let mut b = Backoff::new(100 * MS, 10_000 * MS, "n");
        for _ in 0..5 {
            b.next_delay(None);
        }
        b.reset();
        assert!(b.next_delay(None) <= 100 * MS);
    }

    #[test]
    fn retry_after_is_a_floor_but_capped() {
        let mut b = Backoff::new(10 * MS, 20 * MS, "n");
        assert_eq!(
            b.next_delay(Some(Duration::from_secs(2))),
            Duration::from_secs(2)
        );
        assert_eq!(
            b.next_delay(Some(Duration::from_secs(100_000))),
            MAX_RETRY_AFTER
        );
        assert!(b.next_delay(Some(MS)) >= 10 * MS);
    }

    #[test]
    fn nodes_get_different_jitter() {
        let delays: std::collections::BTreeSet<Duration> = (0..20)
            .map(|i| Backoff::new(1000 * MS, 1000 * MS, &format!("node-{i}")).next_delay(None))
            .collect();
        assert!(delays.len() > 10, "jitter spreads nodes: {delays:?}");
    }
}
