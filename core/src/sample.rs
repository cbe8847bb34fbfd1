use serde::{Deserialize, Serialize};

use crate::{Plan, ServiceSpec};

/// Telemetry of one service over one control interval.
///
/// Every field is optional: a host may lack the counter (no RDT, no perf events in a VM,
/// no GPU), a reading may be missing or have been dropped as implausible. Absence is never
/// encoded as zero.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// Instructions per cycle.
    #[serde(default)]
    pub ipc: Option<f64>,
    /// Last-level-cache misses per second.
    #[serde(default)]
    pub llc_misses_per_s: Option<f64>,
    /// LLC occupancy (resctrl `llc_occupancy`).
    #[serde(default)]
    pub llc_occupancy_bytes: Option<f64>,
    /// Memory bandwidth (resctrl MBM total).
    #[serde(default)]
    pub mem_bw_bytes_per_s: Option<f64>,
    /// Average number of busy logical cores.
    #[serde(default)]
    pub cpu_busy_cores: Option<f64>,
    /// Resident memory of its processes.
    #[serde(default)]
    pub memory_bytes: Option<f64>,
    /// GPU utilisation of the service's GPU work, 0–100.
    #[serde(default)]
    pub gpu_util_pct: Option<f64>,
    /// Device memory its processes use on its GPU (NVML, summed over its processes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_memory_bytes: Option<f64>,
    /// Device memory of the GPU it runs on (NVML), so that a decision log alone shows what
    /// the pinned-memory plan was made from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_memory_total_bytes: Option<f64>,
    /// Measured 99th-percentile request latency.
    #[serde(default)]
    pub p99_ms: Option<f64>,
    /// Requests served per second.
    #[serde(default)]
    pub requests_per_s: Option<f64>,
    /// Control intervals `p99_ms` rests on: the collector's latency window merges the
    /// requests of the intervals since the service's allocation or load last changed
    /// (`None`: this interval's alone).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub p99_intervals: Option<u32>,
}

/// What the controller knows of one service at a tick.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServiceObservation {
    /// The service.
    pub spec: ServiceSpec,
    /// Its telemetry over the last interval.
    pub sample: Sample,
    /// The GPU share its running client actually has; may lag the published share in the
    /// plan until the client restarts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_mps_effective_pct: Option<u8>,
}

/// Everything a policy is given at one tick.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Observation {
    /// Time since the start of the run.
    pub t_ms: u64,
    /// Latency-critical services and best-effort jobs, in configuration order.
    pub services: Vec<ServiceObservation>,
    /// The allocation in force during the interval the samples describe.
    pub current: Plan,
}

impl Observation {
    /// The latency-critical services.
    pub fn latency_critical(&self) -> impl Iterator<Item = &ServiceObservation> {
        self.services
            .iter()
            .filter(|s| s.spec.is_latency_critical())
    }

    /// The best-effort jobs.
    pub fn best_effort(&self) -> impl Iterator<Item = &ServiceObservation> {
        self.services
            .iter()
            .filter(|s| !s.spec.is_latency_critical())
    }

    /// Measured p99 over target for a latency-critical service, if both are known.
    pub fn qos_ratio(&self, name: &str) -> Option<f64> {
        let s = self.services.iter().find(|s| s.spec.name == name)?;
        Some(s.sample.p99_ms? / s.spec.p99_target_ms()?)
    }
}
