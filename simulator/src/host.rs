//! The simulated host as the controller sees it: a [`Collector`] and an [`Actuator`].
//!
//! [`SimulatedHost`] keeps the state a real host would have (the plan in force, GPU clients
//! whose MPS share changes only after a restart), advances one control interval per
//! [`Collector::collect`], and reports telemetry with the dirt of real counters: lognormal
//! noise, rare glitches and missing readings; on a host without counters or RDT monitoring
//! ([`crate::scenario::Telemetry`]) those readings are always absent. [`TruthModel`] is the
//! same physics without noise or state, for metrics and for the oracle policy.

use std::sync::Arc;

use cohabit_core::{
    Actuator, Change, Collector, GroundTruth, Observation, Plan, RunsUnder, Sample,
    ServiceObservation,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::StandardNormal;

use crate::scenario::{Noise, Scenario};
use crate::world::{self, Evaluation, Outcome, Tenant};
use crate::SimError;

/// The noise-free physics of a scenario: evaluates any plan at any time.
#[derive(Debug, Clone)]
pub struct TruthModel {
    scenario: Arc<Scenario>,
    /// Solo progress rate of each best-effort job (0 for latency-critical services).
    be_solo: Vec<f64>,
}

impl TruthModel {
    /// The physics of `scenario`.
    pub fn new(scenario: Arc<Scenario>) -> Self {
        let be_solo = scenario
            .services
            .iter()
            .map(|s| {
                if s.model.latency.is_some() {
                    0.0
                } else {
                    world::solo_rate(&scenario.host, &s.model)
                }
            })
            .collect();
        Self { scenario, be_solo }
    }

    /// The scenario.
    pub fn scenario(&self) -> &Scenario {
        &self.scenario
    }

    /// Offered load of every service at `t_s` (0 for best-effort jobs), in scenario order.
    pub fn loads_at(&self, t_s: f64) -> Vec<f64> {
        (0..self.scenario.services.len())
            .map(|i| self.scenario.load_rps(i, t_s))
            .collect()
    }

    /// The tenants of the host under `plan` with the given loads (see [`Self::loads_at`]),
    /// the GPU shares in effect and the restart downtime of each service in the interval.
    pub fn tenants(
        &self,
        plan: &Plan,
        loads: &[f64],
        gpu_effective: &[Option<u8>],
        downtime_ms: &[f64],
    ) -> Vec<Tenant<'_>> {
        let sc = &self.scenario;
        let cpu_be = sc
            .services
            .iter()
            .filter(|s| s.model.latency.is_none() && s.model.cpu.is_some())
            .count()
            .max(1) as f64;
        sc.services
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let lc = s.spec.is_latency_critical();
                let alloc = if lc {
                    plan.services
                        .get(&s.spec.name)
                        .copied()
                        .unwrap_or(plan.best_effort)
                } else {
                    plan.best_effort
                };
                let cores = if lc {
                    f64::from(alloc.cores)
                } else {
                    f64::from(alloc.cores) / cpu_be
                };
                Tenant {
                    model: &s.model,
                    p99_target_ms: s.spec.p99_target_ms(),
                    cores,
                    ways: alloc.llc_ways,
                    mba_pct: f64::from(alloc.mba_pct),
                    load_rps: loads.get(i).copied().unwrap_or(0.0),
                    gpu: s.spec.gpu.map(|g| {
                        let pct = gpu_effective.get(i).copied().flatten().unwrap_or(100);
                        (g, f64::from(pct) / 100.0)
                    }),
                    downtime_ms: downtime_ms.get(i).copied().unwrap_or(0.0),
                }
            })
            .collect()
    }

    /// Ground truth of one interval under `plan` with the given loads.
    pub fn evaluate(
        &self,
        plan: &Plan,
        loads: &[f64],
        gpu_effective: &[Option<u8>],
        downtime_ms: &[f64],
    ) -> (Evaluation, GroundTruth) {
        let tenants = self.tenants(plan, loads, gpu_effective, downtime_ms);
        let sharing = cpu_sharing(plan, &tenants);
        let eval = world::evaluate_shared(
            &self.scenario.host,
            &tenants,
            self.scenario.tick_ms as f64,
            &sharing,
        );
        let truth = self.truth(&eval.outcomes, &tenants);
        (eval, truth)
    }

    /// Summarises outcomes as ground truth.
    pub fn truth(&self, outcomes: &[Outcome], tenants: &[Tenant<'_>]) -> GroundTruth {
        let mut truth = GroundTruth {
            p99_ms: Default::default(),
            load_rps: Default::default(),
            be_throughput: 0.0,
        };
        for (i, (s, o)) in self.scenario.services.iter().zip(outcomes).enumerate() {
            if let Some(p) = o.p99_ms {
                truth.p99_ms.insert(s.spec.name.clone(), p);
                truth
                    .load_rps
                    .insert(s.spec.name.clone(), tenants[i].load_rps);
            } else {
                truth.be_throughput += self.be_progress(i, o);
            }
        }
        truth
    }

    /// Progress of best-effort job `i` relative to running alone on the whole host.
    pub fn be_progress(&self, i: usize, o: &Outcome) -> f64 {
        let solo = self.be_solo[i];
        if solo > 0.0 {
            o.progress / solo
        } else {
            0.0
        }
    }

    /// The GPU shares each service's client starts with under `plan`.
    pub fn gpu_shares(&self, plan: &Plan) -> Vec<Option<u8>> {
        self.scenario
            .services
            .iter()
            .map(|s| {
                s.spec.gpu?;
                let alloc = if s.spec.is_latency_critical() {
                    plan.services.get(&s.spec.name)
                } else {
                    Some(&plan.best_effort)
                };
                Some(alloc.and_then(|a| a.gpu_mps_pct).unwrap_or(100))
            })
            .collect()
    }
}

/// An MPS client's share: the one published for it and the one its running process has.
#[derive(Debug, Clone, Copy, PartialEq)]
struct GpuClient {
    published: Option<u8>,
    effective: Option<u8>,
    restart_left_ms: f64,
}

/// A simulated co-located host that a controller drives like a real one.
#[derive(Debug)]
pub struct SimulatedHost {
    truth: TruthModel,
    rng: ChaCha8Rng,
    tick: u64,
    plan: Plan,
    gpu: Vec<GpuClient>,
    last_truth: Option<GroundTruth>,
    /// Each service's latency window ([`Noise::latency_window`]).
    windows: Vec<LatencyWindow>,
}

impl SimulatedHost {
    /// Starts every service of `scenario` under `plan` (GPU clients start with their
    /// shares, no restart needed). `seed` overrides the scenario's seed.
    pub fn launch(
        scenario: Arc<Scenario>,
        plan: &Plan,
        seed: Option<u64>,
    ) -> Result<Self, SimError> {
        admit(&scenario, plan)?;
        let rng = ChaCha8Rng::seed_from_u64(seed.unwrap_or(scenario.seed));
        let truth = TruthModel::new(scenario);
        let gpu = truth
            .gpu_shares(plan)
            .into_iter()
            .map(|s| GpuClient {
                published: s,
                effective: s,
                restart_left_ms: 0.0,
            })
            .collect();
        Ok(Self {
            truth,
            rng,
            tick: 0,
            plan: plan.clone(),
            gpu,
            last_truth: None,
            windows: Vec::new(),
        })
    }

    /// The noise-free physics, for metrics and the oracle.
    pub fn truth_model(&self) -> &TruthModel {
        &self.truth
    }

    /// Ground truth of the interval the last [`Collector::collect`] reported.
    pub fn last_truth(&self) -> Option<&GroundTruth> {
        self.last_truth.as_ref()
    }

    /// Control intervals simulated so far.
    pub fn ticks_done(&self) -> u64 {
        self.tick
    }

    /// The GPU share each service's running client has (`None` for CPU services).
    pub fn gpu_effective(&self) -> Vec<Option<u8>> {
        self.gpu.iter().map(|g| g.effective).collect()
    }
}

impl Collector for SimulatedHost {
    type Error = SimError;

    fn simulated(&self) -> bool {
        true
    }

    fn ground_truth(&self) -> Option<GroundTruth> {
        self.last_truth.clone()
    }

    fn collect(&mut self) -> Result<Observation, SimError> {
        let sc = Arc::clone(&self.truth.scenario);
        let tick_ms = sc.tick_ms as f64;
        let t_mid_s = (self.tick as f64 + 0.5) * tick_ms / 1000.0;
        let downtime: Vec<f64> = self
            .gpu
            .iter()
            .map(|g| g.restart_left_ms.clamp(0.0, tick_ms))
            .collect();
        let effective = self.gpu_effective();
        let tenants = self.truth.tenants(
            &self.plan,
            &self.truth.loads_at(t_mid_s),
            &effective,
            &downtime,
        );
        let sharing = cpu_sharing(&self.plan, &tenants);
        let eval = world::evaluate_shared(&sc.host, &tenants, tick_ms, &sharing);
        self.last_truth = Some(self.truth.truth(&eval.outcomes, &tenants));
        for g in &mut self.gpu {
            if g.restart_left_ms > 0.0 {
                g.restart_left_ms -= tick_ms;
                if g.restart_left_ms <= 0.0 {
                    g.restart_left_ms = 0.0;
                    g.effective = g.published;
                }
            }
        }
        let cap = sc.noise.latency_window as usize;
        self.windows
            .resize_with(sc.services.len(), LatencyWindow::default);
        let interval_s = tick_ms / 1000.0;
        let mut services = Vec::with_capacity(sc.services.len());
        for (i, ((s, o), t)) in sc
            .services
            .iter()
            .zip(&eval.outcomes)
            .zip(&tenants)
            .enumerate()
        {
            let g = &self.gpu[i];
            let restarting = downtime.get(i).is_some_and(|d| *d > 0.0);
            let window = if cap > 1 && o.p99_ms.is_some() {
                let w = &mut self.windows[i];
                w.restart_if_changed(
                    RunsUnder::new(&self.plan, &s.spec.name, effective[i], restarting),
                    o.served_rps * interval_s,
                );
                Some((w, cap))
            } else {
                None
            };
            services.push(ServiceObservation {
                spec: s.spec.clone(),
                sample: sc.telemetry.strip(measure_windowed(
                    &mut self.rng,
                    o,
                    t.load_rps,
                    &sc.noise,
                    interval_s,
                    window,
                )),
                gpu_mps_effective_pct: g.effective,
            });
        }
        self.tick += 1;
        Ok(Observation {
            t_ms: self.tick * sc.tick_ms,
            services,
            current: self.plan.clone(),
        })
    }
}

impl Actuator for SimulatedHost {
    type Error = SimError;

    fn apply(&mut self, plan: &Plan, _changes: &[Change]) -> Result<(), SimError> {
        let sc = &self.truth.scenario;
        admit(sc, plan)?;
        let wanted = self.truth.gpu_shares(plan);
        for ((client, want), s) in self.gpu.iter_mut().zip(wanted).zip(&sc.services) {
            if want != client.published {
                // Publishing a share restarts the MPS client; it takes effect when the
                // restart completes. A second change during a restart starts it over. On a
                // GPU whose driver changes running clients' shares (MPS v3), it is at once.
                let live = s
                    .spec
                    .gpu
                    .and_then(|g| sc.host.capacity.gpus.get(g as usize))
                    .is_some_and(|g| g.share_change == cohabit_core::ShareChange::Live);
                client.published = want;
                client.restart_left_ms = match s.model.gpu {
                    Some(g) if !live => g.restart_ms,
                    _ => 0.0,
                };
                if client.restart_left_ms <= 0.0 {
                    client.effective = want;
                }
            }
        }
        self.plan = plan.clone();
        Ok(())
    }
}

/// How best-effort jobs share CPUs with a latency-critical service under `plan`. Plans
/// give groups whole CPUs of their own; a pool with none runs, as the daemon lays it out
/// (`cohabit_host::layout`), as an idle class on the last CPU of the last
/// latency-critical service (scenario order) with a CPU: it takes only the time that
/// service leaves idle there and costs it nothing else but the cache and bandwidth it uses
/// ([`crate::physics::cfs_shared`]). Several CPU jobs split that CPU.
pub fn cpu_sharing(plan: &Plan, tenants: &[Tenant<'_>]) -> Vec<world::CpuSharing> {
    if plan.best_effort.cores > 0 {
        return Vec::new();
    }
    let jobs: Vec<usize> = (0..tenants.len())
        .filter(|&i| tenants[i].model.latency.is_none() && tenants[i].model.cpu.is_some())
        .collect();
    let host_service = (0..tenants.len()).rev().find(|&i| {
        let t = &tenants[i];
        t.model.latency.is_some()
            && t.model.cpu.is_some()
            && t.model.gpu.is_none()
            && t.cores >= 1.0
    });
    let Some(service) = host_service else {
        return Vec::new();
    };
    let share = 1.0 / jobs.len().max(1) as f64;
    jobs.into_iter()
        .map(|pool| world::CpuSharing {
            service,
            pool,
            cpu: crate::physics::SharedCpu {
                cpus: share,
                quota_ms: None,
                period_ms: crate::physics::CFS_PERIOD_MS,
                idle_class: true,
            },
        })
        .collect()
}

/// What the kernel and the simulator accept: first the resctrl groups, as the kernel would
/// refuse a `mkdir` beyond the host's CLOSIDs, then the rest of the plan.
///
/// Where it differs from the kernel: a real host refuses the first group too many after
/// the ones before it were created; here the whole plan is refused before anything
/// changes, as the daemon does when it counts the groups before writing.
fn admit(sc: &Scenario, plan: &Plan) -> Result<(), SimError> {
    let cap = sc.capacity();
    let needed = plan.resctrl_groups();
    if needed > cap.groups_available() as usize {
        return Err(SimError::OutOfClosids {
            needed,
            closids: cap.closids,
        });
    }
    plan.validate(cap, &sc.specs())?;
    Ok(())
}

/// Most control intervals one measured p99 may span ([`Noise::latency_window`]).
pub use cohabit_core::window::MAX_LATENCY_WINDOW;

/// One interval in a service's latency window.
#[derive(Debug, Clone, Copy, PartialEq)]
struct WindowInterval {
    /// True p99 of the interval's requests (ms).
    p99_ms: f64,
    /// Requests served.
    requests: f64,
    /// Spread of the interval's own p99 measurement (ln units).
    sigma: f64,
    /// Its standard normal draw.
    z: f64,
}

/// The requests one measured p99 rests on ([`Noise::latency_window`]): the intervals since
/// what the service runs under ([`RunsUnder`]) or its load last changed, up to the window
/// (the rule of [`cohabit_core::window`]). A real host does the same with the difference of
/// two cumulative histograms, or by merging pushed ones.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LatencyWindow {
    key: Option<RunsUnder>,
    intervals: std::collections::VecDeque<WindowInterval>,
}

impl LatencyWindow {
    /// Starts over when `key` differs from the window's, or when `requests` moved the load
    /// ([`cohabit_core::window::load_moved`]).
    fn restart_if_changed(&mut self, key: RunsUnder, requests: f64) {
        let load_moved =
            cohabit_core::window::load_moved(self.intervals.iter().map(|i| i.requests), requests);
        if self.key != Some(key) || load_moved {
            self.intervals.clear();
            self.key = Some(key);
        }
    }

    /// The intervals the window holds.
    pub fn len(&self) -> usize {
        self.intervals.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.intervals.is_empty()
    }
}

/// The p99 of the requests of several intervals together, each interval's latency tail
/// taken as exponential past its p99 with the scale an exponential distribution of that
/// p99 has (p99 / ln 100): the x at which the request-weighted share of requests slower
/// than x is 1 %. One interval gives its own p99; a slow interval among fast ones pulls
/// the merged p99 toward its own, by how many of the requests it holds.
fn merged_p99(intervals: &[(f64, f64)]) -> f64 {
    let total: f64 = intervals.iter().map(|(_, n)| n.max(1e-9)).sum();
    let over = |x: f64| -> f64 {
        intervals
            .iter()
            .map(|&(p, n)| {
                let scale = p.max(1e-9) / 100f64.ln();
                n.max(1e-9) / total * (-(x - p) / scale).exp().min(100.0)
            })
            .sum::<f64>()
    };
    let (mut lo, mut hi) = intervals
        .iter()
        .fold((f64::INFINITY, 0.0_f64), |(lo, hi), &(p, _)| {
            (lo.min(p), hi.max(p))
        });
    if !(lo.is_finite() && hi > lo) {
        return hi;
    }
    for _ in 0..40 {
        let mid = 0.5 * (lo + hi);
        if over(mid) > 1.0 {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    0.5 * (lo + hi)
}

/// A counter reading with measurement dirt. Every call draws the same number of random
/// numbers whatever the values, so runs of different policies on one seed see the same
/// noise. Public so training data sees exactly the dirt the controller sees.
pub fn measure(
    rng: &mut ChaCha8Rng,
    o: &Outcome,
    load_rps: f64,
    noise: &Noise,
    interval_s: f64,
) -> Sample {
    measure_windowed(rng, o, load_rps, noise, interval_s, None)
}

/// [`measure`], with the p99 taken over `window`'s intervals and this one when given (the
/// window is updated; its restarts are the caller's, who knows what changed).
fn measure_windowed(
    rng: &mut ChaCha8Rng,
    o: &Outcome,
    load_rps: f64,
    noise: &Noise,
    interval_s: f64,
    window: Option<(&mut LatencyWindow, usize)>,
) -> Sample {
    let read = |rng: &mut ChaCha8Rng, value: Option<f64>, sigma: f64, glitch: f64| -> Option<f64> {
        let z: f64 = rng.sample(StandardNormal);
        let g: f64 = rng.gen();
        let m: f64 = rng.gen();
        let v = value?;
        if m < noise.missing_prob {
            None
        } else if g < noise.glitch_prob {
            Some(glitch)
        } else {
            Some(v * (sigma * z - sigma * sigma / 2.0).exp())
        }
    };
    let c = noise.counter_sigma;
    let has_cpu = o.instructions_per_s > 0.0;
    let cpu = |v: f64| has_cpu.then_some(v);
    // The p99 of a short window is noisier when it rests on few requests.
    let requests = load_rps * interval_s;
    let p99_sigma = noise.p99_sigma + 0.2 / (1.0 + 0.01 * requests).sqrt();
    // Glitch values like those in public counter data: a bandwidth counter reading near
    // 1.8e14 B/s and an IPC above 1000 (OSML's training-set maxima).
    let ipc = read(rng, cpu(o.ipc), c, 1046.2);
    let llc_misses_per_s = read(rng, cpu(o.llc_misses_per_s), c, 0.0);
    let llc_occupancy_bytes = read(rng, cpu(o.llc_bytes), c, 0.0);
    let mem_bw_bytes_per_s = read(rng, cpu(o.mem_bw_bytes_per_s), c, 1.759_218_6e14);
    let cpu_busy_cores = read(rng, cpu(o.cpu_busy_cores), c, 0.0);
    let gpu_util_pct = read(rng, o.gpu_util_pct, c, 0.0).map(|u| u.min(100.0));
    let mut p99_intervals = None;
    let p99_ms = match (window, o.p99_ms) {
        (Some((w, cap)), Some(p99)) => {
            // This interval's error, drawn as `read` draws it, then the window's: the
            // request-weighted mean of its intervals' errors, on their merged p99.
            let z: f64 = rng.sample(StandardNormal);
            let g: f64 = rng.gen();
            let m: f64 = rng.gen();
            w.intervals.push_back(WindowInterval {
                p99_ms: p99,
                requests: (o.served_rps * interval_s).max(0.0),
                sigma: p99_sigma,
                z,
            });
            while w.intervals.len() > cap.max(1) {
                w.intervals.pop_front();
            }
            let total: f64 = w.intervals.iter().map(|i| i.requests.max(1e-9)).sum();
            let (mut error, mut sigma2) = (0.0, 0.0);
            for i in &w.intervals {
                let share = i.requests.max(1e-9) / total;
                error += share * i.sigma * i.z;
                sigma2 += (share * i.sigma).powi(2);
            }
            let parts: Vec<(f64, f64)> =
                w.intervals.iter().map(|i| (i.p99_ms, i.requests)).collect();
            p99_intervals = u32::try_from(parts.len()).ok();
            if m < noise.missing_prob {
                None
            } else if g < noise.glitch_prob {
                Some(p99 * 50.0)
            } else {
                Some(merged_p99(&parts) * (error - sigma2 / 2.0).exp())
            }
        }
        (_, p99) => read(rng, p99, p99_sigma, p99.unwrap_or(0.0) * 50.0),
    };
    Sample {
        ipc,
        llc_misses_per_s,
        llc_occupancy_bytes,
        mem_bw_bytes_per_s,
        cpu_busy_cores,
        // The simulator does not model memory footprints, on the host or on a GPU.
        memory_bytes: None,
        gpu_util_pct,
        gpu_memory_bytes: None,
        gpu_memory_total_bytes: None,
        p99_ms,
        p99_intervals: p99_ms.and(p99_intervals),
        requests_per_s: read(
            rng,
            o.p99_ms.map(|_| o.served_rps),
            1.0 / (1.0 + requests).sqrt(),
            0.0,
        ),
    }
}

#[cfg(test)]
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
mod tests {
    use cohabit_core::{Allocation, WayRange};

    use super::*;

    fn plan(sc: &Scenario, gpu_pct: u8) -> Plan {
        let lc: Vec<_> = sc
            .services
            .iter()
            .filter(|s| s.spec.is_latency_critical())
            .collect();
        let mut services = std::collections::BTreeMap::new();
        for (i, s) in lc.iter().enumerate() {
            services.insert(
                s.spec.name.clone(),
                Allocation {
                    cores: 8,
                    llc_ways: WayRange::new(4 * i as u32, 4),
                    mba_pct: 100,
                    gpu_mps_pct: s.spec.gpu.map(|_| gpu_pct),
                },
            );
        }
        Plan {
            services,
            best_effort: Allocation {
                cores: sc.capacity().cores - 8 * lc.len() as u32,
                llc_ways: WayRange::new(
                    4 * lc.len() as u32,
                    sc.capacity().llc_ways - 4 * lc.len() as u32,
                ),
                mba_pct: 100,
                gpu_mps_pct: Some(
                    100 - gpu_pct * lc.iter().filter(|s| s.spec.gpu.is_some()).count() as u8,
                )
                .filter(|p| *p > 0),
            },
            gpu_memory_mib: Default::default(),
        }
    }

    fn run(seed: u64, ticks: usize) -> Vec<Observation> {
        let sc = Arc::new(Scenario::load("demo").unwrap());
        let p = plan(&sc, 50);
        let mut host = SimulatedHost::launch(sc, &p, Some(seed)).unwrap();
        (0..ticks).map(|_| host.collect().unwrap()).collect()
    }

    #[test]
    fn same_seed_same_telemetry_other_seed_other_noise() {
        let a = run(1, 20);
        assert_eq!(a, run(1, 20));
        assert_ne!(a, run(2, 20));
        assert_eq!(a[0].t_ms, 1000);
        assert_eq!(a[19].t_ms, 20_000);
    }

    #[test]
    fn noise_is_a_few_percent_and_dirt_shows_up() {
        let obs = run(3, 600);
        let ipcs: Vec<f64> = obs
            .iter()
            .filter_map(|o| o.services[1].sample.ipc)
            .collect();
        let mean = ipcs.iter().filter(|v| **v < 100.0).sum::<f64>() / ipcs.len() as f64;
        let spread = ipcs
            .iter()
            .filter(|v| **v < 100.0)
            .map(|v| (v / mean - 1.0).abs())
            .fold(0.0, f64::max);
        assert!(spread > 0.01 && spread < 0.25, "noise {spread}");
        let missing = obs
            .iter()
            .flat_map(|o| &o.services)
            .filter(|s| s.sample.ipc.is_none())
            .count();
        assert!(missing > 0, "some readings go missing");
        // A best-effort job has no latency.
        assert!(obs.iter().all(|o| o.services[2].sample.p99_ms.is_none()));
    }

    #[test]
    fn merged_p99_weighs_each_interval_by_its_requests() {
        assert!((merged_p99(&[(4.0, 100.0)]) - 4.0).abs() < 1e-9);
        assert!((merged_p99(&[(4.0, 100.0), (4.0, 300.0)]) - 4.0).abs() < 1e-6);
        // A slow interval among fast ones pulls the merged p99 toward its own, the more
        // the more requests it holds.
        let few = merged_p99(&[(2.0, 900.0), (8.0, 100.0)]);
        let many = merged_p99(&[(2.0, 500.0), (8.0, 500.0)]);
        assert!(2.0 < few && few < many && many < 8.0, "{few} {many}");
        // Half the requests 4x slower: a whole exponential tail's worth above the fast p99.
        assert!(many > 6.0, "{many}");
    }

    /// Two services at constant load beside a streaming job, `window` intervals per p99.
    fn steady(window: u32) -> Arc<Scenario> {
        let text = format!(
            r#"
name = "steady"
description = "constant load"
duration_s = 400
tick_ms = 1000
seed = 5
[host]
preset = "xeon-e5-2697v4"
[noise]
latency_window = {window}
[[service]]
name = "memcached"
model = "memcached"
load = {{ kind = "constant", fraction = 0.5 }}
[[service]]
name = "xapian"
model = "xapian"
load = {{ kind = "constant", fraction = 0.4 }}
[[best_effort]]
name = "stream"
model = "stream"
"#
        );
        Arc::new(Scenario::from_toml(&text, "steady", std::path::Path::new(".")).unwrap())
    }

    /// ln(measured p99 / true p99) of service `i` over `ticks` intervals of `plan`.
    fn p99_errors(host: &mut SimulatedHost, i: usize, ticks: usize) -> Vec<f64> {
        (0..ticks)
            .filter_map(|_| {
                let o = host.collect().unwrap();
                let truth = host.last_truth().unwrap().p99_ms[&o.services[i].spec.name];
                let m = o.services[i].sample.p99_ms?;
                // Glitches are 50 times the truth.
                (m < 10.0 * truth).then(|| (m / truth).ln())
            })
            .collect()
    }

    fn mean_sd(v: &[f64]) -> (f64, f64) {
        let n = v.len() as f64;
        let mean = v.iter().sum::<f64>() / n;
        let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n;
        (mean, var.sqrt())
    }

    #[test]
    fn a_latency_window_quiets_the_p99_of_a_steady_allocation_and_restarts_on_a_change() {
        let one = steady(1);
        let p = plan(&one, 50);
        let mut host = SimulatedHost::launch(one, &p, Some(3)).unwrap();
        let (m1, sd1) = mean_sd(&p99_errors(&mut host, 1, 400));
        // The E5 has no MBA; the bandwidth step below needs a host that offers it (the
        // simulator refuses a throttle the platform lacks, as resctrl without MB would).
        let four = {
            let mut sc = (*steady(4)).clone();
            sc.host.capacity.mba_min_pct = 10;
            sc.host.capacity.mba_gran_pct = 10;
            Arc::new(sc)
        };
        let mut host = SimulatedHost::launch(Arc::clone(&four), &p, Some(3)).unwrap();
        let errors = p99_errors(&mut host, 1, 400);
        // The first three readings rest on fewer intervals.
        let (m4, sd4) = mean_sd(&errors[3..]);
        assert!(m1.abs() < 0.03 && m4.abs() < 0.03, "{m1} {m4}");
        // Four intervals: half the spread of one (the sampling part and the rest alike).
        assert!(sd4 < 0.6 * sd1 && sd4 > 0.4 * sd1, "{sd1} {sd4}");
        assert_eq!(host.windows[1].len(), 4);
        // A change of the service's allocation restarts its window, and only its own.
        let mut moved = p.clone();
        moved.services.get_mut("xapian").unwrap().cores -= 1;
        moved.best_effort.cores += 1;
        host.apply(&moved, &[]).unwrap();
        host.collect().unwrap();
        assert_eq!((host.windows[0].len(), host.windows[1].len()), (4, 1));
        // A change of the pool's bandwidth restarts every window.
        moved.best_effort.mba_pct = 50;
        host.apply(&moved, &[]).unwrap();
        host.collect().unwrap();
        assert_eq!((host.windows[0].len(), host.windows[1].len()), (1, 1));
    }

    #[test]
    fn a_throttle_on_a_platform_without_mba_is_refused() {
        // The E5-2697 v4 has no MBA: resctrl there has no MB resource to write, and the
        // simulated host refuses the plan rather than pretend to throttle.
        let sc = steady(1);
        let mut p = plan(&sc, 50);
        let mut host = SimulatedHost::launch(Arc::clone(&sc), &p, Some(3)).unwrap();
        p.best_effort.mba_pct = 50;
        let e = host.apply(&p, &[]).unwrap_err().to_string();
        assert!(
            e.contains("mba_pct") && e.contains("no memory bandwidth allocation"),
            "{e}"
        );
        // The plan in force is untouched: the next interval runs unthrottled.
        host.collect().unwrap();
        assert_eq!(host.plan.best_effort.mba_pct, 100);
    }

    #[test]
    fn a_latency_window_restarts_when_the_load_moves() {
        let mut w = LatencyWindow::default();
        let plan = Plan {
            services: [(
                "kv".to_string(),
                Allocation {
                    cores: 2,
                    llc_ways: WayRange::new(0, 2),
                    mba_pct: 100,
                    gpu_mps_pct: None,
                },
            )]
            .into(),
            best_effort: Allocation {
                cores: 2,
                llc_ways: WayRange::new(2, 2),
                mba_pct: 100,
                gpu_mps_pct: None,
            },
            gpu_memory_mib: Default::default(),
        };
        let key = RunsUnder::new(&plan, "kv", None, false);
        for requests in [1000.0, 1050.0, 960.0] {
            w.restart_if_changed(key, requests);
            w.intervals.push_back(WindowInterval {
                p99_ms: 1.0,
                requests,
                sigma: 0.1,
                z: 0.0,
            });
        }
        assert_eq!(w.len(), 3);
        w.restart_if_changed(key, 1200.0);
        assert!(w.is_empty());
    }

    #[test]
    fn a_host_without_counters_or_rdt_monitoring_never_reports_them() {
        let mut sc = Scenario::load("demo").unwrap();
        sc.telemetry = crate::scenario::Telemetry {
            counters: false,
            rdt_monitoring: false,
        };
        let sc = Arc::new(sc);
        let p = plan(&sc, 50);
        let mut host = SimulatedHost::launch(sc, &p, Some(1)).unwrap();
        let obs: Vec<Observation> = (0..50).map(|_| host.collect().unwrap()).collect();
        let samples = || obs.iter().flat_map(|o| &o.services).map(|s| &s.sample);
        assert!(samples().all(|s| s.ipc.is_none()
            && s.llc_misses_per_s.is_none()
            && s.llc_occupancy_bytes.is_none()
            && s.mem_bw_bytes_per_s.is_none()));
        // Latency, load and CPU time are still measured.
        assert!(samples().filter(|s| s.p99_ms.is_some()).count() > 90);
        assert!(samples().filter(|s| s.cpu_busy_cores.is_some()).count() > 140);
    }

    #[test]
    fn a_gpu_share_change_waits_for_the_client_restart() {
        let sc = Arc::new(Scenario::load("gpu-inference").unwrap());
        let restart_ms = sc.services[0].model.gpu.unwrap().restart_ms;
        let before = plan(&sc, 30);
        let mut host = SimulatedHost::launch(Arc::clone(&sc), &before, Some(1)).unwrap();
        let obs = host.collect().unwrap();
        assert_eq!(obs.services[0].gpu_mps_effective_pct, Some(30));
        let after = plan(&sc, 45);
        host.apply(&after, &before.diff(&after)).unwrap();
        let restart_ticks = (restart_ms / sc.tick_ms as f64).ceil() as usize;
        let mut during = 0.0;
        for k in 0..restart_ticks {
            let obs = host.collect().unwrap();
            let p = host.last_truth().unwrap().p99_ms["llm-infer"];
            // While the client restarts, requests wait for it.
            assert!(p >= sc.tick_ms as f64, "tick {k}: {p}");
            during = p;
            let expect = if k + 1 < restart_ticks { 30 } else { 45 };
            assert_eq!(
                obs.services[0].gpu_mps_effective_pct,
                Some(expect),
                "tick {k}"
            );
            assert_eq!(
                obs.current.services["llm-infer"].gpu_mps_pct,
                Some(45),
                "published at once"
            );
        }
        host.collect().unwrap();
        let settled = host.last_truth().unwrap().p99_ms["llm-infer"];
        assert!(settled < during, "{settled} vs {during}");
    }

    #[test]
    fn a_plan_beyond_the_closids_is_refused_like_mkdir_and_the_old_one_kept() {
        let mut sc = Scenario::load("demo").unwrap();
        // Two services and the pool in three groups: 4 CLOSIDs hold them, 3 do not.
        sc.host.capacity.closids = 4;
        let sc = Arc::new(sc);
        let good = plan(&sc, 50);
        assert_eq!(good.resctrl_groups(), 3);
        let mut host = SimulatedHost::launch(Arc::clone(&sc), &good, Some(1)).unwrap();
        let mut merged = good.clone();
        let pool = merged.best_effort;
        merged.services.get_mut("xapian").unwrap().llc_ways = pool.llc_ways;
        host.apply(&merged, &good.diff(&merged)).unwrap();
        let mut tight = (*sc).clone();
        tight.host.capacity.closids = 3;
        let tight = Arc::new(tight);
        let err = SimulatedHost::launch(Arc::clone(&tight), &good, Some(1))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("ENOSPC") && err.contains("needs 3 groups") && err.contains("3 CLOSIDs"),
            "{err}"
        );
        let mut host = SimulatedHost::launch(tight, &merged, Some(1)).unwrap();
        let err = host.apply(&good, &merged.diff(&good)).unwrap_err();
        assert!(
            matches!(
                err,
                SimError::OutOfClosids {
                    needed: 3,
                    closids: 3
                }
            ),
            "{err}"
        );
        assert_eq!(host.collect().unwrap().current, merged);
    }

    #[test]
    fn a_pool_without_cores_runs_as_an_idle_class_on_the_last_service_cpu() {
        let sc = Arc::new(Scenario::load("demo").unwrap());
        let tm = TruthModel::new(Arc::clone(&sc));
        let mut p = plan(&sc, 50);
        let loads = tm.loads_at(1.0);
        let zeros = vec![0.0; loads.len()];
        let gpu = tm.gpu_shares(&p);
        let (_, with_cores) = tm.evaluate(&p, &loads, &gpu, &zeros);
        let (name, _) = p.services.iter().next_back().unwrap();
        let name = name.clone();
        // The pool's cores go to the last service: the pool is left with none.
        let freed = p.best_effort.cores;
        p.services.get_mut(&name).unwrap().cores += freed;
        p.best_effort.cores = 0;
        let tenants = tm.tenants(&p, &loads, &gpu, &zeros);
        let sharing = cpu_sharing(&p, &tenants);
        assert!(!sharing.is_empty() && sharing.iter().all(|s| s.cpu.idle_class));
        let (_, idle) = tm.evaluate(&p, &loads, &gpu, &zeros);
        assert!(
            idle.be_throughput > 0.0 && idle.be_throughput < with_cores.be_throughput,
            "the jobs get the idle time of one CPU: {} vs {}",
            idle.be_throughput,
            with_cores.be_throughput
        );
        // An idle class adds no delay: with the pool's cores gone to a service and the jobs
        // on a sliver of one CPU, no service is worse off.
        for (n, p99) in &idle.p99_ms {
            let before = with_cores.p99_ms[n];
            assert!(*p99 <= before * 1.01, "{n}: {before} -> {p99}");
        }
    }

    #[test]
    fn an_invalid_plan_is_rejected_and_the_old_one_kept() {
        let sc = Arc::new(Scenario::load("demo").unwrap());
        let good = plan(&sc, 50);
        let mut host = SimulatedHost::launch(Arc::clone(&sc), &good, Some(1)).unwrap();
        let mut bad = good.clone();
        bad.best_effort.cores += 1;
        let err = host.apply(&bad, &good.diff(&bad)).unwrap_err().to_string();
        assert!(err.contains("cores"), "{err}");
        assert_eq!(host.collect().unwrap().current, good);
    }
}
