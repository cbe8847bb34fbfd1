//! The GPU feature schema (`qos-gpu`, version [`GPU_FEATURE_SCHEMA_VERSION`]): what the GPU
//! model sees of a latency-critical GPU service (an MPS client) and a candidate MPS share,
//! built only from what a host can measure under the share in force.
//!
//! It is a schema of its own, beside the CPU one ([`mod@crate::features`]): a GPU service's
//! tail is governed by its share of the SMs and by its co-runners on the same GPU, which the
//! CPU schema cannot express. A model artifact names its schema, and a GPU artifact is
//! refused where a CPU model is expected and the other way round
//! ([`crate::schema::Schema`]).
//!
//! | feature | meaning |
//! |---|---|
//! | `log_rps` | ln(1 + requests per second) of the service |
//! | `log_qos_now`, `has_qos_now` | ln(measured p99 / target), clipped to ±3; 0 and flag 0 when not measured |
//! | `gpu_util`, `has_gpu_util` | busy fraction of the service's GPU work (NVML utilisation / 100) |
//! | `sm_util`, `has_sm_util` | SM utilisation of its processes (NVML process or GPM samples) / 100 |
//! | `gpu_mem_bw`, `has_gpu_mem_bw` | GPU memory-bandwidth utilisation of its processes / 100 |
//! | `core_util` | busy cores / allocated cores of its CPU side (0 when unknown) |
//! | `share_now` | MPS share in force (effective: what the running client has), 0–1 |
//! | `corunner_share` | the shares of everything else on the same GPU, summed, 0–1 each |
//! | `corunner_util`, `has_corunner_util` | the measured busy fractions of the others on the GPU, summed |
//! | `share_cand` | candidate share, 0–1 |
//! | `log_share_ratio` | ln(candidate / in force) |
//! | `util_cand` | `gpu_util × share_now / share_cand`: the load the candidate must carry (0 when `gpu_util` is absent) |
//!
//! Absent is absent, as in the CPU schema: a reading the host cannot take or that is
//! implausible (a utilisation outside 0–100 %) is 0 with its flag 0 ([`GPU_PRESENCE_FLAGS`]).
//! The controller's `Sample` carries a service's GPU utilisation only, so `sm_util` and
//! `gpu_mem_bw` are absent today in the simulator and on real hosts alike; the shipped model
//! has seen their flags at 0 only, and a host that reports them puts the inputs outside the
//! training range (the policy then falls back to its online share model) until a model
//! trained with them ships.

use cohabit_core::{Observation, Sample};

use crate::features::log_qos_ratio;
use crate::schema::{flag, plausible, GPU_SCHEMA};

/// Name of the schema, written into every GPU artifact's metadata.
pub const GPU_SCHEMA_NAME: &str = "qos-gpu";

/// Version of the schema below.
pub const GPU_FEATURE_SCHEMA_VERSION: u32 = 1;

/// Feature names, in input order.
pub const GPU_FEATURE_NAMES: [&str; 17] = [
    "log_rps",
    "log_qos_now",
    "has_qos_now",
    "gpu_util",
    "has_gpu_util",
    "sm_util",
    "has_sm_util",
    "gpu_mem_bw",
    "has_gpu_mem_bw",
    "core_util",
    "share_now",
    "corunner_share",
    "corunner_util",
    "has_corunner_util",
    "share_cand",
    "log_share_ratio",
    "util_cand",
];

/// Number of GPU features.
pub const N_GPU_FEATURES: usize = GPU_FEATURE_NAMES.len();

/// Input columns that depend on the candidate share.
pub const GPU_CANDIDATE_FEATURES: [usize; 3] = [14, 15, 16];

/// The readings that may be absent, each with its presence flag: (value, flag).
pub const GPU_PRESENCE_FLAGS: [(&str, &str); 5] = [
    ("log_qos_now", "has_qos_now"),
    ("gpu_util", "has_gpu_util"),
    ("sm_util", "has_sm_util"),
    ("gpu_mem_bw", "has_gpu_mem_bw"),
    ("corunner_util", "has_corunner_util"),
];

/// True if feature `i` of `f` carries a measured value: false for a presence flag itself
/// and for a reading whose flag is 0; true for everything else
/// ([`crate::schema::Schema::present`] of [`GPU_SCHEMA`]).
pub fn gpu_present(f: &[f32; N_GPU_FEATURES], i: usize) -> bool {
    GPU_SCHEMA.present(f, i)
}

/// GPU readings of a service that its `Sample` does not carry (absent: `None`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GpuReadings {
    /// SM utilisation of its processes, percent.
    pub sm_util_pct: Option<f64>,
    /// GPU memory-bandwidth utilisation of its processes, percent.
    pub mem_bw_util_pct: Option<f64>,
}

/// Everything else on a GPU service's GPU, as the controller measured it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GpuCoRunners {
    /// Their MPS shares, summed, percent (the best-effort pool counted once).
    pub share_pct: f64,
    /// Their measured GPU utilisation, summed, percent; `None` when none was measured.
    pub util_pct: Option<f64>,
}

impl GpuCoRunners {
    /// The co-runners of service `name` on GPU `gpu` in an observation: every other
    /// latency-critical service on that GPU with the share its client has (the published
    /// one where the effective one is unknown), the best-effort pool's share once if a
    /// best-effort job runs there (100 % when the plan leaves it unset, as MPS does), and
    /// the measured utilisation of all of them (implausible readings dropped). Training
    /// rows and the `ml` policy both use this.
    pub fn observed(obs: &Observation, name: &str, gpu: u32) -> Self {
        let mut share = 0.0;
        let mut util: Option<f64> = None;
        let mut pool = false;
        for o in obs.services.iter().filter(|o| o.spec.name != name) {
            if o.spec.gpu != Some(gpu) {
                continue;
            }
            if o.spec.is_latency_critical() {
                let s = o.gpu_mps_effective_pct.or_else(|| {
                    obs.current
                        .services
                        .get(&o.spec.name)
                        .and_then(|a| a.gpu_mps_pct)
                });
                share += f64::from(s.unwrap_or(100));
            } else {
                pool = true;
            }
            if let Some(u) = plausible_pct(o.sample.gpu_util_pct) {
                util = Some(util.unwrap_or(0.0) + u);
            }
        }
        if pool {
            share += f64::from(obs.current.best_effort.gpu_mps_pct.unwrap_or(100));
        }
        Self {
            share_pct: share,
            util_pct: util,
        }
    }
}

/// A utilisation reading, percent: plausible from 0 to 100.
fn plausible_pct(v: Option<f64>) -> Option<f64> {
    plausible(v, 100.0)
}

/// The GPU feature vector of one service under one candidate share.
///
/// `target_ms` is its p99 target; `sample` and `readings` were measured with share
/// `share_now_pct` in force (the effective one) and `cores_now` cores on its CPU side;
/// `share_cand_pct` is the candidate; `co` its co-runners on the GPU.
// Features are bounded, O(1) values; f32 is the model's precision.
#[allow(clippy::cast_possible_truncation)]
pub fn gpu_features(
    target_ms: f64,
    sample: &Sample,
    readings: &GpuReadings,
    cores_now: u32,
    share_now_pct: f64,
    share_cand_pct: f64,
    co: &GpuCoRunners,
) -> [f32; N_GPU_FEATURES] {
    let rps = plausible(sample.requests_per_s, 1e12).unwrap_or(0.0);
    let (q, hq) = flag(log_qos_ratio(sample, target_ms));
    let util = plausible_pct(sample.gpu_util_pct).map(|u| u / 100.0);
    let (u, hu) = flag(util);
    let (sm, hsm) = flag(plausible_pct(readings.sm_util_pct).map(|u| u / 100.0));
    let (bw, hbw) = flag(plausible_pct(readings.mem_bw_util_pct).map(|u| u / 100.0));
    let cores = f64::from(cores_now.max(1));
    let busy = plausible(sample.cpu_busy_cores, cores * 2.0).unwrap_or(0.0);
    let now = share_now_pct.clamp(1.0, 100.0) / 100.0;
    let cand = share_cand_pct.clamp(1.0, 100.0) / 100.0;
    // A sum over the co-runners: no upper bound.
    let (cu, hcu) = flag(plausible(co.util_pct, f64::INFINITY).map(|u| u / 100.0));
    [
        rps.ln_1p() as f32,
        q,
        hq,
        u,
        hu,
        sm,
        hsm,
        bw,
        hbw,
        (busy / cores) as f32,
        now as f32,
        (co.share_pct.max(0.0) / 100.0) as f32,
        cu,
        hcu,
        cand as f32,
        (cand / now).ln() as f32,
        util.map_or(0.0, |u| u * now / cand) as f32,
    ]
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use cohabit_core::{Allocation, Plan, ServiceClass, ServiceObservation, ServiceSpec, WayRange};

    use super::*;

    fn index(name: &str) -> Option<usize> {
        GPU_SCHEMA.index(name)
    }

    fn get(f: &[f32; N_GPU_FEATURES], n: &str) -> f32 {
        f[index(n).unwrap()]
    }

    #[test]
    fn the_candidate_columns_are_the_shares() {
        let cand: Vec<&str> = GPU_CANDIDATE_FEATURES
            .iter()
            .map(|&i| GPU_FEATURE_NAMES[i])
            .collect();
        assert_eq!(cand, ["share_cand", "log_share_ratio", "util_cand"]);
    }

    #[test]
    fn absent_and_implausible_gpu_readings_are_absent_not_out_of_range_values() {
        let s = Sample {
            p99_ms: Some(30.0),
            requests_per_s: Some(100.0),
            gpu_util_pct: Some(250.0),
            ..Sample::default()
        };
        let r = GpuReadings {
            sm_util_pct: None,
            mem_bw_util_pct: Some(-3.0),
        };
        let f = gpu_features(25.0, &s, &r, 2, 40.0, 60.0, &GpuCoRunners::default());
        for (v, fl) in GPU_PRESENCE_FLAGS.iter().skip(1) {
            assert_eq!((get(&f, v), get(&f, fl)), (0.0, 0.0), "{v}");
            assert!(!gpu_present(&f, index(v).unwrap()), "{v}");
        }
        assert!(gpu_present(&f, index("log_qos_now").unwrap()));
        assert!((get(&f, "log_qos_now") - 1.2f32.ln()).abs() < 1e-6);
        // No utilisation: the candidate's load is unknown, not huge.
        assert_eq!(get(&f, "util_cand"), 0.0);
        assert!(f.iter().all(|v| v.is_finite()));
    }

    #[test]
    fn measured_values_are_scaled_and_the_candidate_carries_the_load() {
        let s = Sample {
            gpu_util_pct: Some(60.0),
            cpu_busy_cores: Some(1.0),
            ..Sample::default()
        };
        let r = GpuReadings {
            sm_util_pct: Some(45.0),
            mem_bw_util_pct: Some(20.0),
        };
        let co = GpuCoRunners {
            share_pct: 70.0,
            util_pct: Some(90.0),
        };
        let f = gpu_features(25.0, &s, &r, 2, 40.0, 80.0, &co);
        assert!((get(&f, "gpu_util") - 0.6).abs() < 1e-6);
        assert!((get(&f, "sm_util") - 0.45).abs() < 1e-6);
        assert!((get(&f, "gpu_mem_bw") - 0.2).abs() < 1e-6);
        assert!((get(&f, "core_util") - 0.5).abs() < 1e-6);
        assert!((get(&f, "share_now") - 0.4).abs() < 1e-6);
        assert!((get(&f, "share_cand") - 0.8).abs() < 1e-6);
        assert!((get(&f, "log_share_ratio") - 2f32.ln()).abs() < 1e-6);
        // Twice the share: half the busy fraction.
        assert!((get(&f, "util_cand") - 0.3).abs() < 1e-6);
        assert!((get(&f, "corunner_share") - 0.7).abs() < 1e-6);
        assert!((get(&f, "corunner_util") - 0.9).abs() < 1e-6);
        assert_eq!(get(&f, "has_qos_now"), 0.0);
    }

    fn obs_of(services: Vec<(&str, bool, Option<u32>, Option<f64>)>, plan: Plan) -> Observation {
        Observation {
            t_ms: 0,
            services: services
                .into_iter()
                .map(|(name, lc, gpu, util)| ServiceObservation {
                    spec: ServiceSpec {
                        name: name.into(),
                        class: if lc {
                            ServiceClass::LatencyCritical { p99_target_ms: 1.0 }
                        } else {
                            ServiceClass::BestEffort
                        },
                        gpu,
                        priority: 0,
                    },
                    sample: Sample {
                        gpu_util_pct: util,
                        ..Sample::default()
                    },
                    gpu_mps_effective_pct: None,
                })
                .collect(),
            current: plan,
        }
    }

    #[test]
    fn co_runners_are_the_others_on_the_same_gpu_with_the_pool_counted_once() {
        let a = |pct: u8| Allocation {
            cores: 1,
            llc_ways: WayRange::new(0, 1),
            mba_pct: 100,
            gpu_mps_pct: Some(pct),
        };
        let plan = Plan {
            services: BTreeMap::from([
                ("me".to_string(), a(30)),
                ("other".to_string(), a(40)),
                ("elsewhere".to_string(), a(50)),
            ]),
            best_effort: a(20),
            gpu_memory_mib: Default::default(),
        };
        let obs = obs_of(
            vec![
                ("me", true, Some(0), Some(50.0)),
                ("other", true, Some(0), Some(70.0)),
                ("elsewhere", true, Some(1), Some(10.0)),
                ("train", false, Some(0), Some(400.0)),
                ("train2", false, Some(0), Some(10.0)),
                ("cpu-job", false, None, None),
            ],
            plan,
        );
        let co = GpuCoRunners::observed(&obs, "me", 0);
        // other 40 + the pool 20 (once for two jobs); the 400 % reading is dropped.
        assert!((co.share_pct - 60.0).abs() < 1e-9);
        assert_eq!(co.util_pct, Some(80.0));
        let alone = obs_of(
            vec![("me", true, Some(0), Some(50.0))],
            Plan {
                services: BTreeMap::new(),
                best_effort: a(100),
                gpu_memory_mib: Default::default(),
            },
        );
        assert_eq!(
            GpuCoRunners::observed(&alone, "me", 0),
            GpuCoRunners::default()
        );
    }
}
