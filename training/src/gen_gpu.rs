//! Datasets for the GPU model ([`mod@cohabit_models::gpu_features`]) from the simulator: random
//! mixes of latency-critical GPU services (the catalogue's MPS clients, one to three on one
//! GPU), with or without a GPU training job and a CPU batch job beside them, at random loads
//! and MPS shares, each scored under random candidate shares.
//!
//! As for the CPU model ([`crate::gen`]), features come only from simulated telemetry (the
//! noisy `Sample` the controller sees under the shares in force, and the co-runners as
//! [`GpuCoRunners::observed`] reads them from the same observation the `ml` policy gets);
//! the target is the true p99 under the candidate share once its client runs with it (the
//! restart's downtime is not part of the steady state the share is chosen for). Some
//! intervals have no latency reading ([`crate::gen::LATENCY_MISSING`]) and some no GPU
//! utilisation reading ([`GPU_UTIL_MISSING`]), so the model has seen those flags at 0.

use std::collections::BTreeMap;
use std::sync::Arc;

use cohabit_core::{
    Allocation, HostCapacity, Observation, Plan, Sample, ServiceClass, ServiceObservation,
    ServiceSpec, WayRange,
};
use cohabit_models::{gpu_features, GpuCoRunners, GpuReadings};
use cohabit_sim::catalogue::{self, Platform};
use cohabit_sim::scenario::{Scenario, SimService};
use cohabit_sim::trace::LoadTrace;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

use crate::dataset::{Dataset, Row};
use crate::scene::{generate_scenes, HostKind, Scene, SceneKind};

/// Probability that a GPU service has no GPU utilisation reading in a scene's interval.
pub const GPU_UTIL_MISSING: f64 = 0.05;

/// What to generate.
#[derive(Debug, Clone)]
pub struct GpuGenConfig {
    /// Random host situations.
    pub scenes: usize,
    /// Candidate shares scored per latency-critical service and scene.
    pub candidates: usize,
    /// Seed.
    pub seed: u64,
    /// Platform (must have a GPU).
    pub platform: Platform,
}

/// The latency-critical GPU models of the catalogue.
pub fn gpu_services() -> Vec<&'static str> {
    catalogue::catalogue()
        .iter()
        .filter(|m| m.latency.is_some() && m.gpu.is_some())
        .map(|m| m.name.as_str())
        .collect()
}

/// An MPS share in steps of 5 %, from 5 % to 100 %.
fn random_share(rng: &mut ChaCha8Rng) -> u8 {
    5 * rng.gen_range(1..=20u8)
}

/// A candidate share: half of the time near the share in force (the steps a policy takes),
/// otherwise anywhere.
fn candidate_share(rng: &mut ChaCha8Rng, now: u8) -> u8 {
    if rng.gen_bool(0.5) {
        let d = 5 * rng.gen_range(-5..=5i16);
        u8::try_from((i16::from(now) + d).clamp(5, 100)).unwrap_or(now)
    } else {
        random_share(rng)
    }
}

fn spec(name: String, class: ServiceClass, gpu: Option<u32>) -> ServiceSpec {
    ServiceSpec {
        name,
        class,
        gpu,
        priority: 0,
    }
}

/// Generates a GPU dataset; `progress` is called with (done, total) scenes. An error when
/// the platform has no GPU or the catalogue no GPU service.
pub fn generate_gpu(
    cfg: &GpuGenConfig,
    progress: impl FnMut(usize, usize),
) -> anyhow::Result<Dataset> {
    let host = cfg.platform.host();
    anyhow::ensure!(
        !host.capacity.gpus.is_empty(),
        "platform {} has no GPU; GPU training data needs one (e.g. xeon-e5-2697v4-a100)",
        host.capacity.name
    );
    let pool = gpu_services();
    anyhow::ensure!(
        !pool.is_empty(),
        "the catalogue has no latency-critical GPU service"
    );
    let kind = GpuScenes {
        cfg,
        cap: host.capacity.clone(),
        pool,
    };
    Ok(generate_scenes(
        &kind, &host, cfg.seed, cfg.scenes, progress,
    ))
}

/// GPU scenes: one to three latency-critical GPU services on GPU 0, often a GPU training job
/// and sometimes a CPU batch job beside them; each GPU service scored under random shares.
struct GpuScenes<'a> {
    cfg: &'a GpuGenConfig,
    cap: HostCapacity,
    /// The latency-critical GPU services to draw from (not empty).
    pool: Vec<&'static str>,
}

impl SceneKind for GpuScenes<'_> {
    const NAME: &'static str = "gen-gpu";

    fn services(&self, rng: &mut ChaCha8Rng) -> (Vec<SimService>, HostKind) {
        let pool = &self.pool;
        let n_lc = rng.gen_range(1..=3usize);
        let mut services = Vec::new();
        for i in 0..n_lc {
            let name = pool[rng.gen_range(0..pool.len())];
            let Some(model) = catalogue::model(name) else {
                continue;
            };
            let Some(lat) = model.latency else { continue };
            services.push(SimService {
                spec: spec(
                    format!("{name}#{i}"),
                    ServiceClass::LatencyCritical {
                        p99_target_ms: lat.p99_target_ms,
                    },
                    Some(0),
                ),
                model: Arc::clone(model),
                load: Some(LoadTrace::Constant {
                    fraction: rng.gen_range(0.03..0.7),
                }),
            });
        }
        if rng.gen_bool(0.7) {
            if let Some(model) = catalogue::model("gpu-train") {
                services.push(SimService {
                    spec: spec("gpu-train#be".into(), ServiceClass::BestEffort, Some(0)),
                    model: Arc::clone(model),
                    load: None,
                });
            }
        }
        if rng.gen_bool(0.5) {
            if let Some(model) = catalogue::model("compute") {
                services.push(SimService {
                    spec: spec("compute#be".into(), ServiceClass::BestEffort, None),
                    model: Arc::clone(model),
                    load: None,
                });
            }
        }
        (services, HostKind::BARE_METAL)
    }

    /// The CPU side: a few cores and a way each, the pool gets the rest; random shares.
    fn plan(&self, rng: &mut ChaCha8Rng, sc: &Scenario) -> Plan {
        let cap = &self.cap;
        let mut plan = Plan {
            services: BTreeMap::new(),
            best_effort: Allocation {
                cores: 0,
                llc_ways: WayRange::new(0, 1),
                mba_pct: 100,
                gpu_mps_pct: (!rng.gen_bool(0.2)).then(|| random_share(rng)),
            },
            gpu_memory_mib: Default::default(),
        };
        let mut cores = 0;
        for (k, s) in sc
            .services
            .iter()
            .filter(|s| s.spec.is_latency_critical())
            .enumerate()
        {
            let a = Allocation {
                cores: rng.gen_range(1..=4),
                llc_ways: WayRange::new(u32::try_from(k).unwrap_or(0), 1),
                mba_pct: 100,
                gpu_mps_pct: Some(random_share(rng)),
            };
            cores += a.cores;
            plan.services.insert(s.spec.name.clone(), a);
        }
        let used_ways = u32::try_from(plan.services.len()).unwrap_or(1);
        plan.best_effort.cores = cap.cores.saturating_sub(cores);
        plan.best_effort.llc_ways = WayRange::new(used_ways, cap.llc_ways - used_ways);
        plan
    }

    fn drop_readings(&self, rng: &mut ChaCha8Rng, spec: &ServiceSpec, sample: &mut Sample) {
        if spec.gpu.is_some() && rng.gen_bool(GPU_UTIL_MISSING) {
            sample.gpu_util_pct = None;
        }
    }

    fn rows(&self, rng: &mut ChaCha8Rng, scene: &Scene, rows: &mut Vec<Row>) {
        let plan = &scene.plan;
        let obs = Observation {
            t_ms: 0,
            services: scene
                .sc
                .services
                .iter()
                .zip(&scene.samples)
                .zip(&scene.shares)
                .map(|((s, sample), share)| ServiceObservation {
                    spec: s.spec.clone(),
                    sample: sample.clone(),
                    gpu_mps_effective_pct: if s.spec.is_latency_critical() {
                        *share
                    } else {
                        None
                    },
                })
                .collect(),
            current: plan.clone(),
        };
        for (i, s) in scene.sc.services.iter().enumerate() {
            let (Some(t), Some(gpu)) = (s.spec.p99_target_ms(), s.spec.gpu) else {
                continue;
            };
            let current = plan.services[&s.spec.name];
            let now_pct = current.gpu_mps_pct.unwrap_or(100);
            let co = GpuCoRunners::observed(&obs, &s.spec.name, gpu);
            scene.score(rng, i, t, self.cfg.candidates, rows, |rng, p2| {
                let cand = candidate_share(rng, now_pct);
                if let Some(a) = p2.services.get_mut(&s.spec.name) {
                    a.gpu_mps_pct = Some(cand);
                }
                gpu_features(
                    t,
                    &scene.samples[i],
                    &GpuReadings::default(),
                    current.cores,
                    f64::from(now_pct),
                    f64::from(cand),
                    &co,
                )
                .to_vec()
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use cohabit_models::{GPU_FEATURE_NAMES, N_GPU_FEATURES};

    use super::*;

    fn col(name: &str) -> usize {
        GPU_FEATURE_NAMES.iter().position(|n| *n == name).unwrap()
    }

    #[test]
    fn gpu_rows_cover_every_gpu_service_shares_and_absent_readings() {
        let data = generate_gpu(
            &GpuGenConfig {
                scenes: 120,
                candidates: 3,
                seed: 5,
                platform: Platform::XeonE5_2697V4A100,
            },
            |_, _| {},
        )
        .unwrap();
        assert_eq!(data.services(), ["llm-infer", "resnet-infer"]);
        assert!(data.rows.iter().all(|r| r.features.len() == N_GPU_FEATURES));
        let share = |r: &Row, n: &str| r.features[col(n)];
        // Shares from 5 % to 100 %, as in force and as candidates.
        for n in ["share_now", "share_cand"] {
            let lo = data.rows.iter().map(|r| share(r, n)).fold(1.0, f32::min);
            let hi = data.rows.iter().map(|r| share(r, n)).fold(0.0, f32::max);
            assert!(lo <= 0.05 + 1e-6 && hi >= 1.0 - 1e-6, "{n}: {lo}..{hi}");
        }
        // More share never hurts much on average: the targets fall with the share ratio.
        let (mut up, mut down) = (Vec::new(), Vec::new());
        for r in &data.rows {
            let d = r.features[col("log_share_ratio")];
            if d > 0.5 {
                up.push(r.target);
            } else if d < -0.5 {
                down.push(r.target);
            }
        }
        let mean = |v: &[f32]| v.iter().sum::<f32>() / v.len().max(1) as f32;
        assert!(mean(&up) < mean(&down), "{} vs {}", mean(&up), mean(&down));
        // Absent readings were seen, and no sample carries SM or memory-bandwidth readings.
        assert!(data.rows.iter().any(|r| share(r, "has_gpu_util") == 0.0));
        assert!(data.rows.iter().any(|r| share(r, "has_qos_now") == 0.0));
        assert!(data.rows.iter().all(|r| share(r, "has_sm_util") == 0.0));
    }

    #[test]
    fn a_platform_without_a_gpu_is_refused() {
        let e = generate_gpu(
            &GpuGenConfig {
                scenes: 1,
                candidates: 1,
                seed: 1,
                platform: Platform::XeonGold6338,
            },
            |_, _| {},
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("has no GPU"), "{e}");
    }
}
