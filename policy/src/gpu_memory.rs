//! Pinned device memory: each GPU client's limit, latency-critical clients first.
//!
//! MPS lets each client be started with a cap on the device memory it may pin
//! (`CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`). Without caps, a best-effort training job that grows
//! can take the memory a latency-critical service needs and make its next allocation fail.
//! The rule ([`plan_pinned_limits`]) is the same for every policy, so the control loop
//! applies it to whatever plan a policy chose ([`pinned_plan`], from the observation alone),
//! and the limits are part of the plan: the decision log records them and the host only
//! writes them.

use std::collections::BTreeMap;

use cohabit_core::{Observation, Plan};

/// Headroom over a client's measured peak in its pinned device-memory limit.
pub const MEM_HEADROOM: f64 = 0.25;
/// Least headroom, MiB.
pub const MEM_HEADROOM_MIN_MIB: u64 = 512;
/// Device memory kept for the driver and MPS servers, fraction of the GPU.
pub const MEM_DRIVER_RESERVE: f64 = 0.03;
/// Least limit a best-effort client gets, MiB (it still starts, and fails its own
/// allocations rather than a latency-critical client's).
pub const MEM_BE_MIN_MIB: u64 = 256;

const MIB: f64 = 1024.0 * 1024.0;

/// One GPU client's memory for [`plan_pinned_limits`].
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryUse {
    /// Service or job name.
    pub service: String,
    /// Latency-critical (served first) or best effort.
    pub latency_critical: bool,
    /// Device memory it was seen using, bytes (absent: not measured).
    pub used_bytes: Option<u64>,
    /// The limit in force for it, MiB: a latency-critical client's limit was planned from
    /// a peak seen earlier, so it never falls below this.
    pub in_force_mib: Option<u64>,
}

/// Pinned device-memory limits, MiB, for the clients of one GPU of `total_bytes`.
///
/// Latency-critical clients first: each gets its measured use plus [`MEM_HEADROOM`] (at
/// least [`MEM_HEADROOM_MIN_MIB`]), and never less than its limit in force (so the limit
/// follows the peak); one never measured gets no limit of its own (absent). Best-effort
/// clients share what is left after the driver's reserve, in proportion to their use
/// (equally when unmeasured), at least [`MEM_BE_MIN_MIB`] each. So the sum of best-effort
/// limits never reaches into what latency-critical clients were measured to need, unless
/// that alone overfills the GPU (then best effort gets the minimum).
pub fn plan_pinned_limits(clients: &[MemoryUse], total_bytes: u64) -> BTreeMap<String, u64> {
    let total_mib = total_bytes as f64 / MIB;
    let mut out = BTreeMap::new();
    let mut lc_mib = 0.0;
    for c in clients.iter().filter(|c| c.latency_critical) {
        let measured = c.used_bytes.map(|b| {
            let used = b as f64 / MIB;
            (used * (1.0 + MEM_HEADROOM)).max(used + MEM_HEADROOM_MIN_MIB as f64)
        });
        let kept = c.in_force_mib.map(|m| m as f64);
        let Some(limit) = measured.into_iter().chain(kept).reduce(f64::max) else {
            continue;
        };
        let limit = limit.min(total_mib).ceil();
        lc_mib += limit;
        out.insert(c.service.clone(), cohabit_core::whole(limit));
    }
    let be: Vec<&MemoryUse> = clients.iter().filter(|c| !c.latency_critical).collect();
    let room = (total_mib * (1.0 - MEM_DRIVER_RESERVE) - lc_mib).max(0.0);
    let weight = |c: &MemoryUse| c.used_bytes.map_or(1.0, |b| (b as f64).max(1.0));
    let weights: f64 = be.iter().map(|c| weight(c)).sum();
    for c in be {
        let share = room * weight(c) / weights;
        let limit = share.floor().max(MEM_BE_MIN_MIB as f64);
        out.insert(c.service.clone(), cohabit_core::whole(limit));
    }
    out
}

/// Every GPU client's pinned limit, MiB, planned per GPU from what `obs` measured: each
/// client's device memory and its GPU's total (a GPU whose total was not read gets no
/// limits), with the limits of `obs.current`, the plan in force, as each latency-critical
/// client's floor. Empty when no GPU memory was measured (the simulator models none).
pub fn pinned_plan(obs: &Observation) -> BTreeMap<String, u64> {
    let mut per_gpu: BTreeMap<u32, (Option<u64>, Vec<MemoryUse>)> = BTreeMap::new();
    for s in &obs.services {
        let Some(gpu) = s.spec.gpu else { continue };
        let (total, uses) = per_gpu.entry(gpu).or_default();
        if let Some(t) = s.sample.gpu_memory_total_bytes {
            *total = Some(total.unwrap_or(0).max(cohabit_core::whole(t)));
        }
        uses.push(MemoryUse {
            service: s.spec.name.clone(),
            latency_critical: s.spec.is_latency_critical(),
            used_bytes: s.sample.gpu_memory_bytes.map(cohabit_core::whole),
            in_force_mib: obs.current.gpu_memory_mib.get(&s.spec.name).copied(),
        });
    }
    let mut out = BTreeMap::new();
    for (total, uses) in per_gpu.into_values() {
        if let Some(total) = total.filter(|&t| t > 0) {
            out.extend(plan_pinned_limits(&uses, total));
        }
    }
    out
}

/// `plan` with the pinned limits [`pinned_plan`] gives for `obs`.
pub fn with_pinned_plan(mut plan: Plan, obs: &Observation) -> Plan {
    plan.gpu_memory_mib = pinned_plan(obs);
    plan
}

#[cfg(test)]
mod tests {
    use cohabit_core::{
        Allocation, Sample, ServiceClass, ServiceObservation, ServiceSpec, WayRange,
    };

    use super::*;

    const GIB: u64 = 1 << 30;

    fn lc(service: &str, used: Option<u64>) -> MemoryUse {
        MemoryUse {
            service: service.into(),
            latency_critical: true,
            used_bytes: used,
            in_force_mib: None,
        }
    }

    fn be(service: &str, used: Option<u64>) -> MemoryUse {
        MemoryUse {
            latency_critical: false,
            ..lc(service, used)
        }
    }

    #[test]
    fn pinned_limits_reserve_what_latency_critical_clients_use_before_best_effort() {
        let uses = [
            lc("llm", Some(20 * GIB)),
            lc("resnet", Some(GIB)),
            be("train", Some(30 * GIB)),
        ];
        let l = plan_pinned_limits(&uses, 40 * GIB);
        // llm: 20 GiB + 25 % = 25600 MiB; resnet: 1 GiB + 512 MiB (more than 25 %).
        assert_eq!(l["llm"], 25_600);
        assert_eq!(l["resnet"], 1_536);
        // train: 40 GiB less 3 % less both = 39731.2 - 27136 -> 12595 MiB, far below the
        // 30 GiB it has used: it cannot push the others out.
        assert_eq!(l["train"], 12_595);
        assert!(l.values().sum::<u64>() <= 40 * 1024);
        // A latency-critical client not measured yet gets no limit; best effort still
        // gets at least the minimum when latency-critical use fills the GPU.
        let full = [
            lc("llm", Some(39 * GIB)),
            lc("new", None),
            be("train", None),
        ];
        let l = plan_pinned_limits(&full, 40 * GIB);
        assert!(!l.contains_key("new"));
        assert_eq!(l["train"], MEM_BE_MIN_MIB);
        assert_eq!(l["llm"], 40 * 1024, "never above the GPU");
    }

    #[test]
    fn a_latency_critical_limit_follows_the_peak_and_best_effort_the_room_left() {
        // In force: 10240 MiB (planned from an 8 GiB peak). Now it uses 1 GiB.
        let mut llm = lc("llm", Some(GIB));
        llm.in_force_mib = Some(10_240);
        let l = plan_pinned_limits(&[llm.clone(), be("train", None)], 40 * GIB);
        assert_eq!(
            l["llm"], 10_240,
            "a smaller reading does not shrink the limit"
        );
        // Not measured this interval: the limit in force stays.
        llm.used_bytes = None;
        assert_eq!(plan_pinned_limits(&[llm.clone()], 40 * GIB)["llm"], 10_240);
        // A larger reading raises it.
        llm.used_bytes = Some(16 * GIB);
        assert_eq!(plan_pinned_limits(&[llm], 40 * GIB)["llm"], 20_480);
        // Best effort is not floored: its share follows the room latency-critical use left.
        let mut train = be("train", Some(30 * GIB));
        train.in_force_mib = Some(30_000);
        let l = plan_pinned_limits(&[lc("llm", Some(20 * GIB)), train], 40 * GIB);
        assert_eq!(l["train"], 39_731 - 25_600);
    }

    fn client(
        name: &str,
        gpu: Option<u32>,
        target: Option<f64>,
        used: Option<u64>,
    ) -> ServiceObservation {
        ServiceObservation {
            spec: ServiceSpec {
                name: name.into(),
                class: target.map_or(ServiceClass::BestEffort, |t| {
                    ServiceClass::LatencyCritical { p99_target_ms: t }
                }),
                gpu,
                priority: 0,
            },
            sample: Sample {
                gpu_memory_bytes: used.map(|b| b as f64),
                gpu_memory_total_bytes: gpu.map(|_| (40 * GIB) as f64),
                ..Sample::default()
            },
            gpu_mps_effective_pct: None,
        }
    }

    #[test]
    fn the_loops_plan_is_made_per_gpu_from_the_observation_alone() {
        let a = Allocation {
            cores: 1,
            llc_ways: WayRange::new(0, 1),
            mba_pct: 100,
            gpu_mps_pct: None,
        };
        let mut obs = Observation {
            t_ms: 0,
            services: vec![
                client("llm", Some(0), Some(50.0), Some(8 * GIB)),
                client("train", Some(0), None, Some(30 * GIB)),
                client("resnet", Some(1), Some(5.0), Some(GIB)),
                client("cpu-only", None, Some(1.0), None),
            ],
            current: Plan {
                services: Default::default(),
                best_effort: a,
                gpu_memory_mib: BTreeMap::from([("llm".to_string(), 20_480)]),
            },
        };
        let p = pinned_plan(&obs);
        assert_eq!(p["llm"], 20_480, "the limit in force is the floor");
        assert_eq!(
            p["train"],
            39_731 - 20_480,
            "best effort gets its GPU's room"
        );
        assert_eq!(p["resnet"], 1_536, "GPU 1 is planned on its own");
        assert!(!p.contains_key("cpu-only"));
        // A GPU whose total was not read gets no limits.
        for s in &mut obs.services {
            s.sample.gpu_memory_total_bytes = None;
        }
        assert!(pinned_plan(&obs).is_empty());
    }
}
