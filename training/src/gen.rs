//! Datasets from the simulator: many random service mixes, loads, co-runners, current and
//! candidate allocations. Features come only from simulated telemetry (the noisy `Sample`
//! the controller would see under the current allocation), never from the simulator's
//! hidden parameters; the target is the true p99 under the candidate.
//!
//! Allocations cover memory bandwidth: the current and candidate MBA levels of a service
//! and the best-effort pool's MBA level are drawn over the platform's steps
//! (`random_mba`), half of the time unthrottled.
//!
//! Hosts differ in what they can measure and partition: a share of the scenes is on a host
//! without hardware counters (a VM), without RDT monitoring, without both, or without any
//! RDT (no CAT, no MBA: every group on the whole LLC, as cohabit sees a VM) ([`HOST_KINDS`]),
//! and in some intervals a service has no latency reading ([`LATENCY_MISSING`]), so the model
//! has seen every presence flag at 0, and `ways_now = 1`, and `ml` can use it on such hosts.
//!
//! **What it draws from.** [`crate::drawn`] states these as tables ([`DRAWN_HOST`],
//! [`DRAWN_SERVICE`], [`DRAWN_BEST_EFFORT`], [`DRAWN_LOAD`]), checked against the catalogue
//! and the platforms; a host or service outside them is one the models never saw
//! ([`foreign_parameters`]).
//!
//! | | drawn |
//! |---|---|
//! | host | the one preset given (`--platform`); the shipped models: `xeon-e5-2697v4` (36 cores, 20 ways of 45 MiB, 2.3 GHz, 76.8 GB/s, 90 ns) and `xeon-gold-6338` (64 cores, 12 ways of 48 MiB, 2.0 GHz, 94 GB/s, 95 ns); 20 % of scenes without RDT allocation (one way) |
//! | latency-critical services | 1–3 of the catalogue's 10 CPU rows, unchanged: `target_ms` 0.6–2500, `max_load` 14–1.28 M, `cv` 0.4–2.1, `ipc` 0.4–1.2, `llc_mpki` 0.01–10.48, `wss_mb` 4–30, `m_inf` 0.002–0.3, `steepness` 2–3, `icache_mpki` 0–33.07, `sys_share` 0–0.78 |
//! | their load | constant, 0.03–0.4 of the knee |
//! | best-effort jobs | 0–2 of `stream`, `graph`, `compute`: `cpi_base` 0.6–0.9, `apki` 0.5–60, `wss_mb` 0.5–2048, `m_inf` 0.01–0.9, `steepness` 1–3, `mlp` 2–6 |
//! | allocations | current: 1 to cores/n cores and side-by-side ways per service, the pool the rest; candidates: 1 to 2× the cores in force, any ways from the service's first; MBA levels as above |
//!
//! [`DRAWN_HOST`]: crate::drawn::DRAWN_HOST
//! [`DRAWN_SERVICE`]: crate::drawn::DRAWN_SERVICE
//! [`DRAWN_BEST_EFFORT`]: crate::drawn::DRAWN_BEST_EFFORT
//! [`DRAWN_LOAD`]: crate::drawn::DRAWN_LOAD
//! [`foreign_parameters`]: crate::drawn::foreign_parameters

use std::collections::BTreeMap;
use std::sync::Arc;

use cohabit_core::{Allocation, HostCapacity, Plan, ServiceClass, ServiceSpec, WayRange};
use cohabit_models::{features, Neighbours};
use cohabit_sim::catalogue::{self, Platform};
use cohabit_sim::scenario::{Scenario, SimService, Telemetry};
use cohabit_sim::trace::LoadTrace;
use rand::seq::SliceRandom;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

use crate::dataset::{Dataset, Row};
use crate::drawn::DRAWN_LOAD;
use crate::scene::{generate_scenes, Scene, SceneKind};

// Where it has always been named; the scene loop of both generators applies it.
pub use crate::scene::{HostKind, LATENCY_MISSING};

/// The kinds of host scenes are drawn on, with their shares: everything measured and
/// partitioned; no hardware counters (no IPC, no LLC misses); no RDT monitoring (no
/// occupancy, no bandwidth, the neighbours' included); neither; and no RDT at all (no
/// resctrl: no monitoring, and no CAT or MBA, so every group shares the whole LLC and
/// bandwidth is never throttled), with or without counters, as on most cloud VMs.
pub const HOST_KINDS: [(HostKind, f64); 6] = [
    (HostKind::BARE_METAL, 0.5),
    (kind(false, true, true), 0.1),
    (kind(true, false, true), 0.1),
    (kind(false, false, true), 0.1),
    (kind(true, false, false), 0.05),
    (kind(false, false, false), 0.15),
];

const fn kind(counters: bool, rdt_monitoring: bool, allocation: bool) -> HostKind {
    HostKind {
        telemetry: Telemetry {
            counters,
            rdt_monitoring,
        },
        allocation,
    }
}

/// A host kind drawn with the shares of [`HOST_KINDS`].
fn host_kind(rng: &mut ChaCha8Rng) -> HostKind {
    let mut u: f64 = rng.gen();
    for (kind, share) in HOST_KINDS {
        if u < share {
            return kind;
        }
        u -= share;
    }
    HostKind::BARE_METAL
}

/// What to generate.
#[derive(Debug, Clone)]
pub struct GenConfig {
    /// Random host situations.
    pub scenes: usize,
    /// Candidate allocations scored per latency-critical service and scene.
    pub candidates: usize,
    /// Seed.
    pub seed: u64,
    /// Platform.
    pub platform: Platform,
    /// Services to draw from (`None`: every CPU latency-critical model).
    pub services: Option<Vec<String>>,
}

/// The CPU latency-critical models of the catalogue.
pub fn cpu_services() -> Vec<&'static str> {
    catalogue::catalogue()
        .iter()
        .filter(|m| m.latency.is_some() && m.gpu.is_none())
        .map(|m| m.name.as_str())
        .collect()
}

/// An MBA level of the platform: unthrottled half of the time, otherwise any of its steps
/// from the minimum up (`mba_min_pct`, `mba_min_pct + mba_gran_pct`, …, 100), so the model
/// sees `mba_now` and `mba_cand` over every level a policy can set.
fn random_mba(rng: &mut ChaCha8Rng, cap: &HostCapacity) -> u8 {
    if rng.gen_bool(0.5) {
        return 100;
    }
    let gran = cap.mba_gran_pct.max(1);
    let min = cap.mba_min_pct.clamp(1, 100);
    let steps: Vec<u8> = (min..=100).step_by(usize::from(gran)).collect();
    steps.choose(rng).copied().unwrap_or(100)
}

fn random_alloc(
    rng: &mut ChaCha8Rng,
    cap: &HostCapacity,
    cores_max: u32,
    first_way: u32,
    ways_max: u32,
) -> Allocation {
    let mba = random_mba(rng, cap);
    Allocation {
        cores: rng.gen_range(1..=cores_max.max(1)),
        llc_ways: WayRange::new(first_way, rng.gen_range(1..=ways_max.max(1))),
        mba_pct: mba,
        gpu_mps_pct: None,
    }
}

/// The best-effort jobs a CPU scene draws from.
pub const BEST_EFFORT: [&str; 3] = ["stream", "graph", "compute"];

/// Generates a dataset; `progress` is called with (done, total) scenes.
pub fn generate(cfg: &GenConfig, progress: impl FnMut(usize, usize)) -> Dataset {
    let host = cfg.platform.host();
    let kind = CpuScenes {
        cfg,
        pool: cfg
            .services
            .clone()
            .unwrap_or_else(|| cpu_services().into_iter().map(String::from).collect()),
    };
    generate_scenes(&kind, &host, cfg.seed, cfg.scenes, progress)
}

/// CPU scenes: one to three latency-critical services side by side in the ways, up to two
/// best-effort jobs in the pool, on a host of a random kind ([`HOST_KINDS`]); each service
/// scored under random allocations.
struct CpuScenes<'a> {
    cfg: &'a GenConfig,
    /// The latency-critical services to draw from.
    pool: Vec<String>,
}

impl SceneKind for CpuScenes<'_> {
    const NAME: &'static str = "gen";

    fn services(&self, rng: &mut ChaCha8Rng) -> (Vec<SimService>, HostKind) {
        let n_lc = rng.gen_range(1..=3usize);
        let mut names: Vec<&String> = self
            .pool
            .choose_multiple(rng, n_lc.min(self.pool.len()))
            .collect();
        names.sort();
        let n_be = rng.gen_range(0..=2usize);
        let mut services = Vec::new();
        for (i, n) in names.iter().enumerate() {
            let Some(model) = catalogue::model(n) else {
                continue;
            };
            let lat = model
                .latency
                .unwrap_or_else(|| unreachable!("latency-critical pool"));
            services.push(SimService {
                spec: ServiceSpec {
                    name: format!("{n}#{i}"),
                    class: ServiceClass::LatencyCritical {
                        p99_target_ms: lat.p99_target_ms,
                    },
                    gpu: None,
                    priority: 0,
                },
                model: Arc::clone(model),
                load: Some(LoadTrace::Constant {
                    fraction: rng.gen_range(DRAWN_LOAD.0..DRAWN_LOAD.1),
                }),
            });
        }
        for (j, b) in BEST_EFFORT.choose_multiple(rng, n_be).enumerate() {
            let Some(model) = catalogue::model(b) else {
                continue;
            };
            services.push(SimService {
                spec: ServiceSpec {
                    name: format!("{b}#be{j}"),
                    class: ServiceClass::BestEffort,
                    gpu: None,
                    priority: 0,
                },
                model: Arc::clone(model),
                load: None,
            });
        }
        (services, host_kind(rng))
    }

    /// LC services side by side in the ways, the pool gets the rest (on a host without
    /// allocation, the one way all of them share).
    fn plan(&self, rng: &mut ChaCha8Rng, sc: &Scenario) -> Plan {
        let cap = &sc.host.capacity;
        let n = u32::try_from(
            sc.services
                .iter()
                .filter(|s| s.spec.is_latency_critical())
                .count(),
        )
        .unwrap_or(1);
        let mut plan = Plan {
            services: BTreeMap::new(),
            best_effort: Allocation {
                cores: 0,
                llc_ways: WayRange::new(cap.llc_ways - 1, 1),
                mba_pct: 100,
                gpu_mps_pct: None,
            },
            gpu_memory_mib: Default::default(),
        };
        let mut way = 0;
        let mut cores = 0;
        for s in sc.services.iter().filter(|s| s.spec.is_latency_critical()) {
            let ways_left = cap.llc_ways.saturating_sub(way + 1).max(1);
            let a = random_alloc(
                rng,
                cap,
                (cap.cores / n).max(1),
                way.min(cap.llc_ways - 1),
                (ways_left / n).max(1),
            );
            way = (a.llc_ways.end()).min(cap.llc_ways - 1);
            cores += a.cores;
            plan.services.insert(s.spec.name.clone(), a);
        }
        plan.best_effort.cores = cap.cores.saturating_sub(cores);
        plan.best_effort.llc_ways = WayRange::new(way, cap.llc_ways - way);
        // The pool is throttled too, so a service's features see neighbours' bandwidth
        // under every MBA level of the pool.
        plan.best_effort.mba_pct = random_mba(rng, cap);
        plan
    }

    fn rows(&self, rng: &mut ChaCha8Rng, scene: &Scene, rows: &mut Vec<Row>) {
        let cap = &scene.sc.host.capacity;
        let plan = &scene.plan;
        for (i, s) in scene.sc.services.iter().enumerate() {
            let Some(t) = s.spec.p99_target_ms() else {
                continue;
            };
            let current = plan.services[&s.spec.name];
            let neighbours = Neighbours {
                mem_bw_bytes_per_s: scene
                    .samples
                    .iter()
                    .enumerate()
                    .filter(|(j, _)| *j != i)
                    .filter_map(|(_, x)| x.mem_bw_bytes_per_s)
                    .filter(|b| *b < 4.0 * cap.mem_bw_bytes_per_s)
                    .sum(),
                cores: plan
                    .groups()
                    .filter(|(g, _)| *g != s.spec.name)
                    .map(|(_, a)| a.cores)
                    .sum(),
            };
            scene.score(rng, i, t, self.cfg.candidates, rows, |rng, p2| {
                let cand = random_alloc(
                    rng,
                    cap,
                    (current.cores * 2).clamp(2, cap.cores),
                    current.llc_ways.first,
                    cap.llc_ways - current.llc_ways.first,
                );
                p2.services.insert(s.spec.name.clone(), cand);
                features(cap, t, &scene.samples[i], &current, &cand, &neighbours).to_vec()
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use cohabit_models::FEATURE_NAMES;

    use super::*;

    fn feature(name: &str) -> usize {
        FEATURE_NAMES
            .iter()
            .position(|n| *n == name)
            .unwrap_or_else(|| panic!("{name} is a feature"))
    }

    #[test]
    fn some_scenes_are_on_a_host_without_rdt_where_every_group_has_the_whole_llc() {
        let shares: f64 = HOST_KINDS.iter().map(|(_, s)| s).sum();
        assert!((shares - 1.0).abs() < 1e-9, "{shares}");
        // On the Gold, which has MBA: the rows without RDT are unthrottled because RDT is
        // off, not because the platform has no MBA (the E5 has none).
        let data = generate(
            &GenConfig {
                scenes: 300,
                candidates: 3,
                seed: 5,
                platform: Platform::XeonGold6338,
                services: None,
            },
            |_, _| {},
        );
        let [ways_now, ways_cand, mba_now, mba_cand, has_occ, has_bw] = [
            "ways_now",
            "ways_cand",
            "mba_now",
            "mba_cand",
            "has_occupancy",
            "has_bw",
        ]
        .map(feature);
        let whole = |r: &Row| r.features[ways_now] > 0.999 && r.features[ways_cand] > 0.999;
        let vm: Vec<&Row> = data.rows.iter().filter(|r| whole(r)).collect();
        #[allow(clippy::cast_precision_loss)]
        let share = vm.len() as f64 / data.rows.len() as f64;
        // 20 % of scenes have no RDT; a partitioned host rarely gives one service every way.
        assert!(
            (0.12..0.3).contains(&share),
            "{share} of rows on the whole LLC"
        );
        for r in vm {
            assert!(r.features[mba_now] > 0.999 && r.features[mba_cand] > 0.999);
            assert!(r.features[has_occ] < 0.5 && r.features[has_bw] < 0.5);
        }
        // The outcome still depends on the allocation: cores move the target there too.
        let spread = data
            .rows
            .iter()
            .filter(|r| whole(r))
            .map(|r| r.target)
            .fold((f32::MAX, f32::MIN), |(lo, hi), t| (lo.min(t), hi.max(t)));
        assert!(spread.1 - spread.0 > 1.0, "{spread:?}");
    }

    #[test]
    fn mba_levels_cover_every_step_of_the_platform_now_and_as_candidates() {
        let data = generate(
            &GenConfig {
                scenes: 150,
                candidates: 3,
                seed: 3,
                platform: Platform::XeonGold6338,
                services: None,
            },
            |_, _| {},
        );
        for name in ["mba_now", "mba_cand"] {
            let i = feature(name);
            let levels: BTreeSet<u64> = data
                .rows
                .iter()
                .map(|r| cohabit_core::whole((f64::from(r.features[i]) * 100.0).round()))
                .collect();
            // 10 %, 20 %, …, 100 %: every step of the Gold platform, its minimum included.
            let steps: BTreeSet<u64> = (1..=10).map(|k| k * 10).collect();
            assert_eq!(levels, steps, "{name}");
            let throttled = data.rows.iter().filter(|r| r.features[i] < 0.995).count();
            #[allow(clippy::cast_precision_loss)]
            let share = throttled as f64 / data.rows.len() as f64;
            assert!((0.3..0.7).contains(&share), "{name}: {share} throttled");
        }
    }
}
