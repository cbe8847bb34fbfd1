//! `clite`: Bayesian optimisation of the whole host's allocation, after CLITE (Patel and
//! Tiwari, "CLITE: Efficient and QoS-Aware Co-location of Multiple Latency-Critical Jobs for
//! Warehouse Scale Computers", HPCA 2020). A published baseline beside `parties`: our own
//! implementation of the paper's idea, with our own constants where noted.
//!
//! Problem: find, by trying allocations on the host itself, the one that meets every
//! latency target and leaves the most to best effort, in few samples and with no model
//! trained beforehand.
//!
//! Approach:
//! - A *configuration* is the whole host's allocation: each latency-critical service's
//!   cores and, within the CLOSID budget, its LLC ways; the best-effort pool's MBA level
//!   where the host has MBA. The pool gets every core and way left (it keeps one way when
//!   CPU jobs run). GPU shares stay at the fair split: they are not searched.
//! - A configuration is *sampled*: put in force for `sample_ticks` intervals, so that the
//!   latency window holds only its own requests (the paper observes each sample for 2 s),
//!   and scored from the last reading. Every target met: `0.5 + 0.5 ×` the pool's progress
//!   (instructions per second, IPC × busy cores, against the best sampled; where a reading
//!   was dropped, its share of cores and ways times its MBA share, scaled by the progress per
//!   share of the other samples; that share alone on a host without counters). A target
//!   missed: under 0.5, the priority-weighted mean over services of 1 for one that met its
//!   target (or had no reading: no requests, nothing to miss) and `0.5 × target / p99` for
//!   one that did not, each priority rank weighing more than all the services of the ranks
//!   under it. So any configuration meeting every target beats any that does not, and among
//!   those the one that meets more (weighted) wins: the overload rule (docs/DESIGN.md 5),
//!   latency-critical before best effort.
//! - A Gaussian process ([`gp`]) over the configuration scaled to [0, 1] models the
//!   score; the next sample is the candidate of highest expected improvement among random
//!   configurations and neighbours of the best sampled ones with one to three of their
//!   dimensions moved and the rest kept (after the paper's dimension dropout, which
//!   searches a random subset of dimensions at a time).
//! - The search starts from the static fair split and from each service in turn given twice
//!   its share (the paper starts from extreme and equal configurations). It stops after
//!   `max_samples`, or after `min_samples` once no candidate's expected improvement
//!   reaches `ei_stop`; the best configuration sampled is then held.
//! - A held configuration is searched again (the paper re-invokes on a change of load or
//!   mix) when a service misses a target it met when sampled `restart_after` ticks in a
//!   row, or when a service's load stays more than `load_change` away from the load it was
//!   sampled at for `restart_after` ticks; the new search starts from the held
//!   configuration, the same with every service missing its target given a quarter more
//!   cores, and the fair split. A target the held sample missed too (a true overload, or a
//!   search that found no configuration meeting them all: the two look alike) starts a
//!   search after `retry_after` ticks, twice as long after each such search in a row (up
//!   to 16 times), so that a true overload settles on the best it found.
//!
//! Properties: every sample is a real allocation on the host, so a search pays for its
//! information in intervals under configurations that miss targets; that is the trade
//! this baseline shows against `ml` (which predicts instead) and `parties` (which steps).

mod gp;

use std::collections::{BTreeMap, HashSet};

use cohabit_core::{whole, DecisionPath, Observation, Plan, Reason, MBA_MAX_PCT};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::{downcast, layout, Adopted, Decision, HostContext, Policy, Share, StaticPolicy};
use gp::{expected_improvement, Gp};

/// `clite`'s sampling and search settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CliteConfig {
    /// Intervals each sampled configuration is held before it is scored: the daemon's
    /// default latency window (3), so that its reading is the configuration's own; with a
    /// longer `latency_window` set this to it.
    pub sample_ticks: u32,
    /// Most configurations one search samples.
    pub max_samples: usize,
    /// Fewest samples before the search may stop on a small expected improvement.
    pub min_samples: usize,
    /// The search stops when no candidate is expected to improve the best score by this.
    pub ei_stop: f64,
    /// Configurations drawn per step: half of this at random, and as many neighbours of
    /// each of the three best samples (fewer where a move does not fit).
    pub candidates: usize,
    /// Ticks in a row of a missed target, or of a moved load, before a held configuration
    /// is searched again.
    pub restart_after: u32,
    /// Ticks a held configuration that misses a target it was sampled missing is kept before
    /// a new search, doubled for each such search in a row (up to 16 times).
    pub retry_after: u32,
    /// Relative change of a service's load (requests per second) that counts as moved.
    pub load_change: f64,
    /// Seed of the candidate draws.
    pub seed: u64,
}

impl Default for CliteConfig {
    fn default() -> Self {
        Self {
            sample_ticks: 3,
            max_samples: 30,
            min_samples: 12,
            ei_stop: 0.002,
            candidates: 400,
            restart_after: 3,
            retry_after: 10,
            load_change: 0.2,
            seed: 7,
        }
    }
}

/// One configuration: cores per latency-critical service (configuration order), ways per
/// service within the CLOSID budget (the first ones), and the pool's MBA.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
struct Config {
    cores: Vec<u32>,
    ways: Vec<u32>,
    mba: u8,
}

/// What one sample measured.
#[derive(Debug, Clone)]
struct Sample {
    config: Config,
    /// Measured p99 over target, per service (`None`: no reading).
    ratios: Vec<Option<f64>>,
    /// The pool's instructions per second over the clock (IPC × busy cores), when every
    /// best-effort job had both counters.
    progress: Option<f64>,
    /// The pool's share of the host (cores, and a tenth as much for ways), times its MBA
    /// share.
    share: f64,
    /// Requests per second per service.
    rps: Vec<Option<f64>>,
}

/// A search under way: `queue` is sampled first, then by expected improvement.
#[derive(Debug, Clone, Default)]
struct Search {
    queue: Vec<Config>,
    samples: Vec<Sample>,
    /// The configuration being sampled, and the intervals it has been held.
    current: Config,
    held: u32,
}

/// The best configuration a search found, held.
#[derive(Debug, Clone)]
struct Held {
    best: Sample,
    score: f64,
    /// Samples the search took.
    samples: usize,
    /// Ticks in a row with a target missed that the held sample met.
    missed: u32,
    /// Ticks in a row with a load moved from the held sample's.
    moved: u32,
    /// Ticks in a row with a target missed that the held sample missed too.
    short: u32,
}

#[derive(Debug, Clone)]
enum Phase {
    Search(Search),
    Hold(Held),
}

/// The CLITE policy (module docs).
#[derive(Debug, Clone)]
pub struct ClitePolicy {
    ctx: HostContext,
    cfg: CliteConfig,
    names: Vec<String>,
    /// Weight of each service in a score that misses a target (by priority).
    weights: Vec<f64>,
    /// Services with ways of their own: the first `isolated`.
    isolated: usize,
    /// Ways the services may take in all.
    lc_ways: u32,
    /// MBA levels of the pool the host offers, lowest first.
    mba_levels: Vec<u8>,
    fair: BTreeMap<String, Share>,
    rng: ChaCha8Rng,
    phase: Phase,
    /// Searches in a row that ended with a target missed.
    retries: u32,
}

impl ClitePolicy {
    /// A CLITE search for the host in `ctx`.
    pub fn new(ctx: HostContext, cfg: CliteConfig) -> Self {
        let names: Vec<String> = ctx.latency_critical().map(|s| s.name.clone()).collect();
        let mut prios: Vec<i32> = ctx.latency_critical().map(|s| s.priority).collect();
        prios.sort_unstable();
        prios.dedup();
        // Each priority rank weighs more than every service of the ranks under it together.
        let base = names.len() as f64 + 1.0;
        let weights = ctx
            .latency_critical()
            .map(|s| {
                let rank = prios.iter().position(|p| *p == s.priority).unwrap_or(0);
                base.powi(i32::try_from(rank).unwrap_or(0))
            })
            .collect();
        let isolated = ctx.isolated_services().min(names.len());
        let lc_ways = ctx
            .host
            .llc_ways
            .saturating_sub(u32::from(ctx.has_cpu_best_effort()));
        let (min, gran) = (ctx.host.mba_min_pct, ctx.host.mba_gran_pct.max(1));
        let mut mba_levels: Vec<u8> = (min..=MBA_MAX_PCT).step_by(usize::from(gran)).collect();
        if mba_levels.last() != Some(&MBA_MAX_PCT) {
            mba_levels.push(MBA_MAX_PCT);
        }
        let fair = StaticPolicy::new(ctx.clone()).shares();
        let mut policy = Self {
            rng: ChaCha8Rng::seed_from_u64(cfg.seed),
            ctx,
            cfg,
            names,
            weights,
            isolated,
            lc_ways,
            mba_levels,
            fair,
            phase: Phase::Search(Search::default()),
            retries: 0,
        };
        let start = policy.fair_config();
        let mut queue = Vec::new();
        for i in 0..policy.names.len() {
            let c = policy.doubled(&start, i);
            if c != start && !queue.contains(&c) {
                queue.push(c);
            }
        }
        policy.phase = Phase::Search(Search {
            queue,
            current: start,
            ..Search::default()
        });
        policy
    }

    /// The static fair split as a configuration.
    fn fair_config(&self) -> Config {
        let cores = self.names.iter().map(|n| self.fair[n].cores).collect();
        let ways = self.names[..self.isolated]
            .iter()
            .map(|n| self.fair[n].ways.max(1))
            .collect();
        let mut c = Config {
            cores,
            ways,
            mba: MBA_MAX_PCT,
        };
        self.repair(&mut c);
        c
    }

    /// `base` with service `i` given twice its cores and ways, taken from the pool first and
    /// then from the largest of the others.
    fn doubled(&self, base: &Config, i: usize) -> Config {
        let mut c = base.clone();
        c.cores[i] *= 2;
        if i < self.isolated {
            c.ways[i] *= 2;
        }
        self.repair_keeping(&mut c, Some(i));
        c
    }

    /// Makes `c` fit the host (cores, ways; each at least one), cutting the largest first.
    fn repair(&self, c: &mut Config) {
        self.repair_keeping(c, None);
    }

    fn repair_keeping(&self, c: &mut Config, keep: Option<usize>) {
        fit(&mut c.cores, self.ctx.host.cores, keep);
        fit(&mut c.ways, self.lc_ways, keep);
    }

    /// `c` scaled to [0, 1] per dimension, the GP's input.
    fn features(&self, c: &Config) -> Vec<f64> {
        let cores = f64::from(self.ctx.host.cores.max(1));
        let ways = f64::from(self.ctx.host.llc_ways.max(1));
        let mut x: Vec<f64> = c.cores.iter().map(|v| f64::from(*v) / cores).collect();
        x.extend(c.ways.iter().map(|v| f64::from(*v) / ways));
        if self.mba_levels.len() > 1 {
            x.push(f64::from(c.mba) / f64::from(MBA_MAX_PCT));
        }
        x
    }

    /// A random configuration: cores and ways split at random between the services and the
    /// pool, a random MBA level.
    fn random_config(&mut self) -> Config {
        let n = self.names.len();
        let cores = random_split(&mut self.rng, self.ctx.host.cores, n);
        let ways = random_split(&mut self.rng, self.lc_ways, self.isolated);
        let mba = self.mba_levels[self.rng.gen_range(0..self.mba_levels.len())];
        let mut c = Config { cores, ways, mba };
        self.repair(&mut c);
        c
    }

    /// `base` with one to three dimensions moved by one or two units (an MBA level by one
    /// step); `None` when the move does not fit.
    fn neighbour(&mut self, base: &Config) -> Option<Config> {
        let mut c = base.clone();
        let dims = c.cores.len() + c.ways.len() + usize::from(self.mba_levels.len() > 1);
        if dims == 0 {
            return None;
        }
        let moves = self.rng.gen_range(1..=3usize.min(dims.max(1)));
        for _ in 0..moves {
            let d = self.rng.gen_range(0..dims);
            let step: i64 = if self.rng.gen_bool(0.5) { 1 } else { 2 };
            let step = if self.rng.gen_bool(0.5) { step } else { -step };
            if d < c.cores.len() {
                c.cores[d] = shift(c.cores[d], step)?;
            } else if d < c.cores.len() + c.ways.len() {
                let w = d - c.cores.len();
                c.ways[w] = shift(c.ways[w], step)?;
            } else {
                let at = self.mba_levels.iter().position(|m| *m == c.mba)?;
                let to = if step > 0 { at + 1 } else { at.checked_sub(1)? };
                c.mba = *self.mba_levels.get(to)?;
            }
        }
        let fits = c.cores.iter().sum::<u32>() <= self.ctx.host.cores
            && c.ways.iter().sum::<u32>() <= self.lc_ways;
        (fits && &c != base).then_some(c)
    }

    /// What the last interval measured under `config`.
    fn measure(&self, obs: &Observation, config: &Config) -> Sample {
        let ratios = self.names.iter().map(|n| obs.qos_ratio(n)).collect();
        let rps = self
            .names
            .iter()
            .map(|n| {
                obs.services
                    .iter()
                    .find(|s| &s.spec.name == n)
                    .and_then(|s| s.sample.requests_per_s)
            })
            .collect();
        let mut progress = Some(0.0);
        for be in obs.best_effort().filter(|s| s.spec.gpu.is_none()) {
            progress = match (progress, be.sample.ipc, be.sample.cpu_busy_cores) {
                (Some(p), Some(ipc), Some(busy)) if ipc.is_finite() && ipc < 100.0 => {
                    Some(p + ipc * busy)
                }
                _ => None,
            };
        }
        let pool = &obs.current.best_effort;
        let share = (f64::from(pool.cores) / f64::from(self.ctx.host.cores.max(1))
            + 0.1 * f64::from(pool.llc_ways.count) / f64::from(self.ctx.host.llc_ways.max(1)))
            * f64::from(pool.mba_pct)
            / f64::from(MBA_MAX_PCT);
        Sample {
            config: config.clone(),
            ratios,
            progress: progress.filter(|_| self.ctx.has_cpu_best_effort()),
            share,
            rps,
        }
    }

    /// The scores of `samples` (module docs): the pool's progress is taken against the best
    /// sampled. A sample whose counters were missing (a dropped reading) is given its share
    /// times the mean progress per share of the samples that have both; without any counters
    /// the share alone is the measure.
    fn scores(&self, samples: &[Sample]) -> Vec<f64> {
        let rates: Vec<f64> = samples
            .iter()
            .filter(|s| s.share > 0.0)
            .filter_map(|s| Some(s.progress? / s.share))
            .collect();
        let per_share = if rates.is_empty() {
            1.0
        } else {
            rates.iter().sum::<f64>() / rates.len() as f64
        };
        let be = |s: &Sample| s.progress.unwrap_or(s.share * per_share);
        let top = samples.iter().map(be).fold(0.0, f64::max);
        let total: f64 = self.weights.iter().sum::<f64>().max(1e-9);
        samples
            .iter()
            .map(|s| {
                // A service without a reading (no requests) has nothing to miss.
                let met = s.ratios.iter().all(|r| r.is_none_or(|r| r <= 1.0));
                if met {
                    0.5 + 0.5 * if top > 0.0 { be(s) / top } else { 0.0 }
                } else {
                    let near: f64 = s
                        .ratios
                        .iter()
                        .zip(&self.weights)
                        .map(|(r, w)| match r {
                            Some(r) if *r > 1.0 => w * 0.5 / r,
                            _ => *w,
                        })
                        .sum();
                    0.5 * near / total
                }
            })
            .collect()
    }

    /// The next configuration to sample, or `None` when the search is done.
    fn next_sample(&mut self, samples: &[Sample]) -> Option<Config> {
        if samples.len() >= self.cfg.max_samples {
            return None;
        }
        let scores = self.scores(samples);
        let x: Vec<Vec<f64>> = samples.iter().map(|s| self.features(&s.config)).collect();
        let gp = Gp::fit(&x, &scores)?;
        let best = scores.iter().copied().fold(f64::MIN, f64::max);
        let seen: HashSet<Config> = samples.iter().map(|s| s.config.clone()).collect();
        let mut order: Vec<usize> = (0..samples.len()).collect();
        order.sort_by(|a, b| scores[*b].total_cmp(&scores[*a]));
        let mut candidates: Vec<Config> = Vec::new();
        for &i in order.iter().take(3) {
            for _ in 0..self.cfg.candidates / 2 {
                if let Some(c) = self.neighbour(&samples[i].config) {
                    candidates.push(c);
                }
            }
        }
        for _ in 0..self.cfg.candidates / 2 {
            let c = self.random_config();
            candidates.push(c);
        }
        let pick = candidates
            .into_iter()
            .filter(|c| !seen.contains(c))
            .map(|c| {
                let (mu, sd) = gp.predict(&self.features(&c));
                (expected_improvement(mu, sd, best), c)
            })
            .max_by(|a, b| a.0.total_cmp(&b.0))?;
        let done = samples.len() >= self.cfg.min_samples && pick.0 < self.cfg.ei_stop;
        (!done).then_some(pick.1)
    }

    /// The plan of `c`.
    fn plan(&self, c: &Config) -> Plan {
        let shares: BTreeMap<String, Share> = self
            .names
            .iter()
            .enumerate()
            .map(|(i, n)| {
                let f = self.fair[n];
                (
                    n.clone(),
                    Share {
                        cores: c.cores[i],
                        ways: c.ways.get(i).copied().unwrap_or(f.ways),
                        mba_pct: MBA_MAX_PCT,
                        gpu_pct: f.gpu_pct,
                    },
                )
            })
            .collect();
        layout(&self.ctx, &shares, c.mba)
    }

    /// A new search from `held`: it, the same with each service that misses its target
    /// given a quarter more cores, and the fair split.
    fn restart(&mut self, held: &Sample) -> Config {
        let mut grown = held.config.clone();
        for (i, r) in held.ratios.iter().enumerate() {
            if r.is_some_and(|r| r > 1.0) {
                let more = u32::try_from(whole(f64::from(grown.cores[i]) * 0.25))
                    .unwrap_or(1)
                    .max(1);
                grown.cores[i] += more;
            }
        }
        self.repair(&mut grown);
        let mut queue = Vec::new();
        for c in [grown, self.fair_config()] {
            if c != held.config && !queue.contains(&c) {
                queue.push(c);
            }
        }
        let current = held.config.clone();
        self.phase = Phase::Search(Search {
            queue,
            current: current.clone(),
            ..Search::default()
        });
        current
    }

    /// Puts `search` in force: its configuration, with `text` as the reason.
    fn sampling(&mut self, search: Search, text: &str) -> Decision {
        let plan = self.plan(&search.current);
        self.phase = Phase::Search(search);
        Decision::new(plan, self.reasons(DecisionPath::Search, text))
    }

    /// Puts `held` in force: the best configuration its search found.
    fn holding(&mut self, held: Held) -> Decision {
        let plan = self.plan(&held.best.config);
        let text = format!(
            "hold the best of {} samples (score {:.2})",
            held.samples, held.score
        );
        self.phase = Phase::Hold(held);
        Decision::new(plan, self.reasons(DecisionPath::Hold, &text))
    }

    /// Whether a search of `other`'s can go on here: the same host, the same
    /// latency-critical services in the same order with the same specs, and the same room
    /// for them (the ways they may take, the fair split the configurations start from).
    fn same_space(&self, other: &Self) -> bool {
        self.ctx.host == other.ctx.host
            && self.ctx.latency_critical().eq(other.ctx.latency_critical())
            && self.lc_ways == other.lc_ways
            && self.fair == other.fair
    }

    fn reasons(&self, path: DecisionPath, text: &str) -> BTreeMap<String, Reason> {
        self.names
            .iter()
            .map(|n| (n.clone(), Reason::new(path, text)))
            .collect()
    }
}

/// Cuts `v` to sum at most `total` (each at least one), the largest first, never `keep`
/// while another can give.
fn fit(v: &mut [u32], total: u32, keep: Option<usize>) {
    for x in v.iter_mut() {
        *x = (*x).max(1);
    }
    while v.iter().sum::<u32>() > total {
        let donor = (0..v.len())
            .filter(|i| v[*i] > 1 && Some(*i) != keep)
            .max_by_key(|i| v[*i])
            .or_else(|| keep.filter(|k| v[*k] > 1));
        match donor {
            Some(i) => v[i] -= 1,
            None => break,
        }
    }
}

/// `total` units split at random between `n` parts and the pool (each part at least one
/// where it can be).
fn random_split(rng: &mut ChaCha8Rng, total: u32, n: usize) -> Vec<u32> {
    let w: Vec<f64> = (0..=n).map(|_| -rng.gen::<f64>().max(1e-12).ln()).collect();
    let sum: f64 = w.iter().sum();
    w[..n]
        .iter()
        .map(|x| {
            u32::try_from(whole(x / sum * f64::from(total)))
                .unwrap_or(1)
                .max(1)
        })
        .collect()
}

fn shift(v: u32, step: i64) -> Option<u32> {
    u32::try_from(i64::from(v) + step).ok().filter(|x| *x >= 1)
}

impl Policy for ClitePolicy {
    fn name(&self) -> &'static str {
        "clite"
    }

    /// From another `clite` over the same configuration space (`same_space`:
    /// only best-effort jobs came or went): the whole search or held configuration, its
    /// samples and its random draws, as if nothing had happened (samples scored earlier
    /// measured the pool's progress with the jobs then). Otherwise the search starts again
    /// from the fair split: a configuration has one dimension per service, and a sample's
    /// score is over every target, so samples of another set of services do not apply.
    fn adopt(&mut self, previous: Box<dyn Policy>) -> Adopted {
        let Some(previous) = downcast::<Self>(previous) else {
            return Adopted::default();
        };
        if !self.same_space(&previous) {
            return Adopted::default();
        }
        let previous = *previous;
        self.phase = previous.phase;
        self.rng = previous.rng;
        self.retries = previous.retries;
        Adopted {
            services: self.names.iter().cloned().collect(),
            host: true,
        }
    }

    fn initial(&mut self) -> Decision {
        let current = match &self.phase {
            Phase::Search(search) => &search.current,
            Phase::Hold(held) => &held.best.config,
        };
        let plan = self.plan(current);
        Decision::new(
            plan,
            self.reasons(DecisionPath::Search, "sample 1 (fair split)"),
        )
    }

    fn decide(&mut self, obs: &Observation, _now_ms: u64) -> Decision {
        match std::mem::replace(&mut self.phase, Phase::Search(Search::default())) {
            Phase::Search(mut search) => {
                search.held += 1;
                // A missing reading is waited for one more interval, once.
                let waiting = search.held < self.cfg.sample_ticks
                    || (search.held == self.cfg.sample_ticks
                        && self.names.iter().any(|n| obs.qos_ratio(n).is_none()));
                if waiting {
                    let text =
                        format!("sample {} (held {})", search.samples.len() + 1, search.held);
                    return self.sampling(search, &text);
                }
                let sample = self.measure(obs, &search.current);
                search.samples.push(sample);
                let next = if search.queue.is_empty() {
                    self.next_sample(&search.samples)
                } else {
                    Some(search.queue.remove(0))
                };
                if let Some(c) = next {
                    let text = format!("sample {}", search.samples.len() + 1);
                    search.current = c;
                    search.held = 0;
                    return self.sampling(search, &text);
                }
                let scores = self.scores(&search.samples);
                let (i, score) = scores
                    .iter()
                    .copied()
                    .enumerate()
                    .max_by(|a, b| a.1.total_cmp(&b.1))
                    .unwrap_or((0, 0.0));
                let samples = search.samples.len();
                let best = search.samples.swap_remove(i);
                let all_met = best.ratios.iter().all(|r| r.is_none_or(|r| r <= 1.0));
                self.retries = if all_met { 0 } else { self.retries + 1 };
                self.holding(Held {
                    best,
                    score,
                    samples,
                    missed: 0,
                    moved: 0,
                    short: 0,
                })
            }
            Phase::Hold(mut held) => {
                let now = self.measure(obs, &held.best.config);
                // A target the held sample met and now misses. One it already missed
                // (the best sampled did not meet every target: overload, or a search that
                // did not find a layout that meets them all) starts a search only after
                // `retry_after` ticks, twice as long after each such search in a row.
                let missing = now
                    .ratios
                    .iter()
                    .zip(&held.best.ratios)
                    .any(|(r, was)| r.is_some_and(|r| r > 1.0) && was.is_none_or(|w| w <= 1.0));
                let still = now.ratios.iter().any(|r| r.is_some_and(|r| r > 1.0));
                let shifted = now
                    .rps
                    .iter()
                    .zip(&held.best.rps)
                    .any(|(a, b)| match (a, b) {
                        (Some(a), Some(b)) if *b > 0.0 => {
                            (a / b - 1.0).abs() > self.cfg.load_change
                        }
                        _ => false,
                    });
                held.missed = if missing { held.missed + 1 } else { 0 };
                held.moved = if shifted { held.moved + 1 } else { 0 };
                held.short = if still && !missing { held.short + 1 } else { 0 };
                let patience = self.cfg.retry_after << self.retries.clamp(1, 5).saturating_sub(1);
                let why = if held.missed >= self.cfg.restart_after {
                    "a target missed"
                } else if held.short >= patience {
                    "targets still missed"
                } else if held.moved >= self.cfg.restart_after {
                    "a load moved"
                } else {
                    return self.holding(held);
                };
                let mut from = held.best;
                from.ratios = now.ratios;
                let c = self.restart(&from);
                let plan = self.plan(&c);
                let text = format!("search again ({why}): sample 1");
                Decision::new(plan, self.reasons(DecisionPath::Search, &text))
            }
        }
    }
}

#[cfg(test)]
mod tests;
