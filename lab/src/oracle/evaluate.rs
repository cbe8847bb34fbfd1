//! The oracle's closed-form evaluations of one round: a latency-critical service's outcome
//! under the frozen memory latency and GPU interference, its fewest cores for its target
//! (binary searches on cores), the LLC split of a shared way range, every range and pool
//! option, and best-effort progress per pool core.

use std::collections::HashMap;
use std::sync::Arc;

use cohabit_core::{WayRange, MBA_MAX_PCT};
use cohabit_sim::world::{self, Tenant};

use super::{Answers, Frozen, OraclePolicy, Place, Placement};

/// The closed-form evaluations of one round.
pub(super) struct Evaluator<'a> {
    pub(super) oracle: &'a OraclePolicy,
    pub(super) tenants: &'a [Tenant<'a>],
    pub(super) lc: &'a [usize],
    pub(super) frozen: &'a Frozen,
    pub(super) be_mba: u8,
}

impl Evaluator<'_> {
    fn host(&self) -> &cohabit_sim::catalogue::SimHost {
        &self.oracle.truth.scenario().host
    }

    fn outcome(&self, k: usize, cores: u32, cache: f64, mba: u8) -> world::Outcome {
        let t = Tenant {
            cores: f64::from(cores),
            mba_pct: f64::from(mba),
            ..self.tenants[self.lc[k]].clone()
        };
        self.isolated(k, &t, cache)
    }

    /// LLC misses per second of service `k` with `cores` holding `cache` bytes at full
    /// bandwidth: its outcome without the p99 (a tenant without a target skips the queue
    /// model, most of an outcome's cost; the misses do not depend on it).
    fn misses(&self, k: usize, cores: u32, cache: f64) -> f64 {
        let t = Tenant {
            cores: f64::from(cores),
            mba_pct: f64::from(MBA_MAX_PCT),
            p99_target_ms: None,
            ..self.tenants[self.lc[k]].clone()
        };
        self.isolated(k, &t, cache).llc_misses_per_s
    }

    /// Service `k` run as tenant `t` holding `cache` bytes, under the round's frozen memory
    /// latency and its interference.
    fn isolated(&self, k: usize, t: &Tenant, cache: f64) -> world::Outcome {
        world::isolated(
            self.host(),
            t,
            cache,
            self.frozen.latency,
            self.frozen.interference[k],
        )
    }

    pub(super) fn target(&self, k: usize) -> f64 {
        self.oracle.ctx.specs[self.lc[k]]
            .p99_target_ms()
            .unwrap_or(f64::INFINITY)
    }

    /// The fewest cores with which service `k` meets its target (with the margin) holding
    /// `cache` bytes at MBA `mba`, or `None`.
    fn fewest(&self, k: usize, cache: f64, mba: u8) -> Option<u32> {
        self.fewest_near(k, cache, mba, None)
    }

    /// [`Self::fewest`], starting the binary search from `hint` (e.g. the answer with a way
    /// less): one evaluation at the hint halves the range. The answer is the same, since the
    /// p99 does not rise with cores; only the evaluations spent differ.
    fn fewest_near(&self, k: usize, cache: f64, mba: u8, hint: Option<u32>) -> Option<u32> {
        let c_total = self.oracle.ctx.host.cores;
        let target = self.target(k) * self.frozen.margin;
        let meets = |c: u32| {
            self.outcome(k, c, cache, mba)
                .p99_ms
                .is_some_and(|p| p <= target)
        };
        first_meeting(1, c_total, hint, meets)
    }

    /// [`Self::fewest_near`] where at least `lo` cores are known to be needed ([`Answers`]):
    /// `lo` is tried first (most rounds need what the one before did), then the cores above.
    fn fewest_from(
        &self,
        k: usize,
        cache: f64,
        mba: u8,
        lo: u32,
        hint: Option<u32>,
    ) -> Option<u32> {
        let c_total = self.oracle.ctx.host.cores;
        let target = self.target(k) * self.frozen.margin;
        let meets = |c: u32| {
            self.outcome(k, c, cache, mba)
                .p99_ms
                .is_some_and(|p| p <= target)
        };
        if lo > c_total {
            return None;
        }
        if meets(lo.max(1)) {
            return Some(lo.max(1));
        }
        first_meeting(lo.max(1) + 1, c_total, hint, meets)
    }

    /// The p99 of service `k` in the pool's range with `cores` at MBA `mba`.
    pub(super) fn p99_in_pool_at(&self, k: usize, cores: u32, mba: u8) -> f64 {
        self.outcome(k, cores, self.frozen.pool_cache[k], mba)
            .p99_ms
            .unwrap_or(f64::INFINITY)
    }

    /// The LLC each member of `members` holds in a shared range of `ways`: the LRU split
    /// by miss rate (which, at a fixed load, does not depend on cores).
    fn split(&self, members: &[usize], ways: u32) -> Vec<f64> {
        let bytes = f64::from(ways) * self.oracle.ctx.host.llc_way_bytes as f64;
        let c_total = self.oracle.ctx.host.cores;
        let mut cache = vec![bytes / members.len() as f64; members.len()];
        if members.len() < 2 {
            return cache;
        }
        for _ in 0..8 {
            let misses: Vec<f64> = members
                .iter()
                .zip(&cache)
                .map(|(&k, &c)| self.misses(k, c_total, c))
                .collect();
            let total: f64 = misses.iter().sum();
            if total <= 0.0 {
                break;
            }
            for (c, m) in cache.iter_mut().zip(&misses) {
                *c = 0.5 * *c + 0.5 * bytes * m / total;
            }
        }
        cache
    }

    /// Every option: each service alone in 1..=W ways, each pair (and all services together)
    /// in a shared range (with `share_ways`), each service in the pool's range.
    pub(super) fn options(&self, share_ways: bool) -> Vec<Placement> {
        let n = self.lc.len();
        let frozen = (
            self.frozen.latency.to_bits(),
            self.frozen.margin.to_bits(),
            self.frozen
                .interference
                .iter()
                .map(|x| x.to_bits())
                .collect::<Vec<_>>(),
        );
        // A search without shared ranges takes the single-service options of a search with
        // them under the same frozen values, when there is one.
        let share = share_ways && self.oracle.cfg.share_ways;
        let found = {
            let memo = self.oracle.memo.borrow();
            memo.get(&(true, frozen.clone()))
                .or_else(|| memo.get(&(share, frozen.clone())))
                .cloned()
        };
        let ranges = found.unwrap_or_else(|| {
            let r: Arc<[Placement]> = self.range_options(share).into();
            self.oracle
                .memo
                .borrow_mut()
                .insert((share, frozen), Arc::clone(&r));
            r
        });
        let mut out: Vec<Placement> = ranges
            .iter()
            .filter(|o| share || o.members.count_ones() == 1)
            .cloned()
            .collect();
        self.pool_options(n, &mut out);
        out
    }

    /// Every range option: each service alone in 1..=W ways and, with `share`, each pair
    /// and all services together in a shared range.
    pub(super) fn range_options(&self, share: bool) -> Vec<Placement> {
        let n = self.lc.len();
        let w_max = self.oracle.ctx.host.llc_ways;
        let mut groups: Vec<Vec<usize>> = (0..n).map(|k| vec![k]).collect();
        if share && n >= 2 {
            for a in 0..n {
                for b in a + 1..n {
                    groups.push(vec![a, b]);
                }
            }
            if n >= 3 {
                groups.push((0..n).collect());
            }
        }
        let mut out = Vec::new();
        // The answers of the tightest state already searched that bounds these from below.
        let answers = self.oracle.answers.borrow();
        let base = answers
            .iter()
            .filter(|a| a.below(self.frozen))
            .max_by(|a, b| {
                a.latency
                    .total_cmp(&b.latency)
                    .then(b.margin.total_cmp(&a.margin))
            });
        let mut mine = HashMap::new();
        for members in groups {
            let mask = members.iter().fold(0u32, |m, k| m | (1 << k));
            // Each member's answer with a way less: the search's starting point.
            let mut hints: Vec<Option<u32>> = vec![None; members.len()];
            for w in 1..=w_max {
                let cache = self.split(&members, w);
                let known = base.and_then(|b| b.fewest.get(&(mask, w)));
                let found: Vec<Option<u32>> = members
                    .iter()
                    .zip(&cache)
                    .zip(&hints)
                    .enumerate()
                    .map(|(j, ((&k, &c), &h))| {
                        match known.and_then(|v| v.get(j)).filter(|v| v.0 == c.to_bits()) {
                            Some((_, None)) => None,
                            Some((_, Some(lo))) => self.fewest_from(k, c, MBA_MAX_PCT, *lo, h),
                            None => self.fewest_near(k, c, MBA_MAX_PCT, h),
                        }
                    })
                    .collect();
                mine.insert(
                    (mask, w),
                    cache
                        .iter()
                        .map(|c| c.to_bits())
                        .zip(found.clone())
                        .collect(),
                );
                let cores: Option<Vec<(usize, u32)>> = members
                    .iter()
                    .zip(&found)
                    .map(|(&k, n)| n.map(|n| (k, n)))
                    .collect();
                for (h, f) in hints.iter_mut().zip(&found) {
                    *h = f.or(*h);
                }
                if let Some(cores) = cores {
                    out.push(Placement {
                        members: mask,
                        place: Place::Range {
                            members: mask,
                            ways: w,
                        },
                        cores,
                    });
                }
            }
        }
        drop(answers);
        self.oracle.answers.borrow_mut().push(Answers {
            latency: self.frozen.latency,
            margin: self.frozen.margin,
            interference: self.frozen.interference.clone(),
            fewest: mine,
        });
        out
    }

    /// Each service's options in the pool's ways: in its group, and beside a throttled pool
    /// in a group of its own at full bandwidth.
    fn pool_options(&self, n: usize, out: &mut Vec<Placement>) {
        for k in 0..n {
            if let Some(c) = self.fewest(k, self.frozen.pool_cache[k], self.be_mba) {
                out.push(Placement {
                    members: 1 << k,
                    place: Place::Pool,
                    cores: vec![(k, c)],
                });
            }
            // Beside a throttled pool, on its ways at full bandwidth (as `ml` places a
            // cache-insensitive service).
            if self.be_mba < MBA_MAX_PCT {
                if let Some(c) = self.fewest(k, self.frozen.pool_cache[k], MBA_MAX_PCT) {
                    out.push(Placement {
                        members: 1 << k,
                        place: Place::PoolWays,
                        cores: vec![(k, c)],
                    });
                }
            }
        }
    }

    /// Best-effort progress per pool core, by the pool's way count, at the pool's MBA.
    pub(super) fn be_per_core(&self) -> Vec<f64> {
        let sc = self.oracle.truth.scenario();
        let cap = &self.oracle.ctx.host;
        let be_cpu: Vec<usize> = (0..sc.services.len())
            .filter(|&i| {
                !sc.services[i].spec.is_latency_critical() && sc.services[i].model.cpu.is_some()
            })
            .collect();
        (0..=cap.llc_ways)
            .map(|w| {
                be_cpu
                    .iter()
                    .map(|&j| {
                        let t = Tenant {
                            cores: 1.0,
                            ways: WayRange::new(0, w.max(1)),
                            mba_pct: f64::from(self.be_mba),
                            ..self.tenants[j].clone()
                        };
                        let cache =
                            f64::from(w.max(1)) * cap.llc_way_bytes as f64 / be_cpu.len() as f64;
                        let o = world::isolated(self.host(), &t, cache, self.frozen.latency, 1.0);
                        self.oracle.truth.be_progress(j, &o) / be_cpu.len() as f64
                    })
                    .sum()
            })
            .collect()
    }
}

/// The fewest cores in `lo..=c_total` for which `meets` holds (it holds from some count
/// on: the p99 does not rise with cores), or `None`: a binary search that first splits at
/// `hint` when it lies in `lo..c_total` (one evaluation there halves the range).
fn first_meeting(
    lo: u32,
    c_total: u32,
    hint: Option<u32>,
    meets: impl Fn(u32) -> bool,
) -> Option<u32> {
    let (mut lo, mut hi) = match hint.filter(|h| (lo..c_total).contains(h)) {
        Some(h) if meets(h) => (lo, h),
        Some(h) if meets(c_total) => (h + 1, c_total),
        Some(_) => return None,
        None if lo <= c_total && meets(c_total) => (lo, c_total),
        None => return None,
    };
    while lo < hi {
        let mid = (lo + hi) / 2;
        if meets(mid) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    Some(lo)
}
