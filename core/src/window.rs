//! The latency window's rule, shared by the simulator and the real host's collectors.
//!
//! A measured p99 rests on the requests of the last few control intervals together (a
//! window of them), as long as they ran under the same conditions. A window starts over
//! when an interval ran under something else than the window's intervals did
//! ([`RunsUnder`]: what the controller set that the service's latency depends on) or when
//! its request count moved ([`load_moved`]). Both sides apply this one rule, so policies
//! see the same kind of p99 in the simulator and on a real host.

use crate::{Allocation, Plan, WayRange};

/// Most control intervals one measured p99 may span.
pub const MAX_LATENCY_WINDOW: u32 = 60;

/// Relative change of an interval's request count, against the mean count of the intervals
/// a window holds, that restarts the window.
pub const LATENCY_WINDOW_LOAD_CHANGE: f64 = 0.1;

/// What one service's latency during an interval depends on that the controller sets: its
/// own cores, cache ways and bandwidth (the best-effort pool's, for a best-effort job), the
/// pool's cache ways and bandwidth (its neighbours' interference), the GPU share in effect
/// during the interval (an MPS share takes effect only when the client restarts, so the
/// planned one does not count) and whether the client was restarting in it (intervals with
/// downtime are kept apart from those before and after them: merged with the next, one made
/// a recovered LLM service read 17 times its target in the simulator).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunsUnder {
    /// The service's own allocation, as planned, without its GPU share (which counts as
    /// in effect: `gpu_effective_pct`).
    pub own: Allocation,
    /// The best-effort pool's cache ways.
    pub pool_ways: WayRange,
    /// The best-effort pool's bandwidth throttle.
    pub pool_mba_pct: u8,
    /// The GPU share in effect (not necessarily the planned one).
    pub gpu_effective_pct: Option<u8>,
    /// Whether the service's GPU client was restarting during the interval.
    pub gpu_restarting: bool,
}

impl RunsUnder {
    /// What service `name` runs under while `plan` is in force, with GPU share
    /// `gpu_effective_pct` in effect; `gpu_restarting` when its client restarted in the
    /// interval. A name that is not one of the plan's latency-critical services is a
    /// best-effort job: it runs under the pool's allocation.
    pub fn new(
        plan: &Plan,
        name: &str,
        gpu_effective_pct: Option<u8>,
        gpu_restarting: bool,
    ) -> Self {
        let pool = &plan.best_effort;
        Self {
            own: Allocation {
                gpu_mps_pct: None,
                ..plan.services.get(name).copied().unwrap_or(*pool)
            },
            pool_ways: pool.llc_ways,
            pool_mba_pct: pool.mba_pct,
            gpu_effective_pct,
            gpu_restarting,
        }
    }
}

/// Whether an interval of `count` requests moved the load against a window whose held
/// intervals served `held` requests each: it differs from their mean by more than
/// [`LATENCY_WINDOW_LOAD_CHANGE`] of that mean (floored at one request). An empty window
/// never moves.
pub fn load_moved<I: IntoIterator<Item = f64>>(held: I, count: f64) -> bool {
    let (sum, n) = held
        .into_iter()
        .fold((0.0, 0usize), |(s, n), c| (s + c, n + 1));
    if n == 0 {
        return false;
    }
    let mean = sum / n as f64;
    (count - mean).abs() > LATENCY_WINDOW_LOAD_CHANGE * mean.max(1.0)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn a(cores: u32, first: u32, ways: u32, mba_pct: u8) -> Allocation {
        Allocation {
            cores,
            llc_ways: WayRange::new(first, ways),
            mba_pct,
            gpu_mps_pct: None,
        }
    }

    #[test]
    fn what_a_service_runs_under_is_its_allocation_and_the_pools_ways_and_bandwidth() {
        let old = Plan {
            services: BTreeMap::from([
                ("kv".to_string(), a(4, 0, 4, 100)),
                ("web".to_string(), a(2, 4, 2, 100)),
            ]),
            best_effort: a(2, 6, 6, 100),
            gpu_memory_mib: Default::default(),
        };
        let changed = |f: &dyn Fn(&mut Plan)| -> Vec<&str> {
            let mut new = old.clone();
            f(&mut new);
            ["kv", "web", "batch"]
                .into_iter()
                .filter(|n| {
                    RunsUnder::new(&old, n, None, false) != RunsUnder::new(&new, n, None, false)
                })
                .collect()
        };
        assert!(changed(&|_| {}).is_empty());
        fn kv(p: &mut Plan) -> &mut Allocation {
            p.services.get_mut("kv").unwrap()
        }
        assert_eq!(changed(&|p| kv(p).cores = 5), ["kv"]);
        assert_eq!(changed(&|p| kv(p).mba_pct = 50), ["kv"]);
        assert_eq!(changed(&|p| kv(p).llc_ways.first = 1), ["kv"]);
        // A GPU share planned is not yet one in effect (the client restarts first).
        assert!(changed(&|p| kv(p).gpu_mps_pct = Some(40)).is_empty());
        assert_eq!(
            changed(&|p| {
                p.services.remove("web");
            }),
            ["web"]
        );
        // The pool's cache and bandwidth touch everyone; its cores only its jobs.
        assert_eq!(
            changed(&|p| p.best_effort.mba_pct = 50),
            ["kv", "web", "batch"]
        );
        assert_eq!(
            changed(&|p| p.best_effort.llc_ways.count = 5),
            ["kv", "web", "batch"]
        );
        assert_eq!(changed(&|p| p.best_effort.cores = 1), ["batch"]);
        // The GPU share in effect and a restart are part of it, whatever the plan says.
        let kv = |eff, restarting| RunsUnder::new(&old, "kv", eff, restarting);
        assert_ne!(kv(Some(40), false), kv(Some(60), false));
        assert_ne!(kv(Some(40), false), kv(Some(40), true));
    }

    #[test]
    fn the_load_moves_beyond_a_tenth_of_the_windows_mean() {
        assert!(!load_moved([], 5000.0));
        assert!(!load_moved([1000.0, 1050.0, 960.0], 1090.0));
        assert!(load_moved([1000.0, 1050.0, 960.0], 1200.0));
        assert!(load_moved([1000.0, 1050.0, 960.0], 850.0));
        // A near-idle window is judged against one request, not a fraction of one.
        assert!(!load_moved([0.0, 0.0], 0.05));
        assert!(load_moved([0.0, 0.0], 2.0));
    }
}
