//! The feature schema: what the model sees of a latency-critical service and a candidate
//! allocation, built only from what a real host can measure under the *current* allocation.
//!
//! Version [`FEATURE_SCHEMA_VERSION`]; the names in [`FEATURE_NAMES`] are written into every
//! model artifact and checked on load, so a model trained on another schema is refused.
//!
//! | feature | meaning |
//! |---|---|
//! | `log_rps` | ln(1 + requests per second) of the service |
//! | `log_qos_now`, `has_qos_now` | ln(measured p99 / target), clipped to ±3; 0 and flag 0 when not measured |
//! | `core_util` | busy cores / allocated cores (0 when unknown) |
//! | `ipc`, `has_ipc` | instructions per cycle (hardware counters may be absent) |
//! | `log_miss_rate`, `has_miss_rate` | ln(1 + LLC misses per second) |
//! | `occupancy_frac`, `has_occupancy` | LLC occupancy over the LLC size |
//! | `bw_frac`, `has_bw` | memory bandwidth over the host's peak |
//! | `cores_now`, `ways_now`, `mba_now` | current allocation as fractions of the host |
//! | `cores_cand`, `ways_cand`, `mba_cand`, `gpu_cand` | candidate allocation as fractions |
//! | `log_cores_ratio`, `log_ways_ratio` | ln(candidate / current) for cores and ways |
//! | `util_cand` | busy cores / candidate cores: the load the candidate must carry |
//! | `neighbour_bw_frac` | the other tenants' memory bandwidth over the host's peak |
//! | `neighbour_cores_frac` | the other tenants' cores over the host's cores |
//!
//! Glitched counters are not features: a value outside its plausible range (IPC above 10,
//! bandwidth above 4× the host's peak) is treated as missing.
//!
//! Absent is absent: a reading the host cannot take (no hardware counters in a VM, no RDT
//! monitoring, no latency reading this interval) or that was implausible is 0 with its flag
//! 0 ([`PRESENCE_FLAGS`] pairs each such value with its flag). A value whose flag is 0 means
//! nothing, so it is never compared with the training range ([`present`]); the training
//! data has hosts and ticks without counters, RDT monitoring or latency, so the model has
//! seen the flags at 0.

use cohabit_core::{Allocation, HostCapacity, Observation, Sample};

use crate::schema::{flag, plausible, CPU_SCHEMA};

/// Version of the schema below.
pub const FEATURE_SCHEMA_VERSION: u32 = 1;

/// Feature names, in input order.
pub const FEATURE_NAMES: [&str; 24] = [
    "log_rps",
    "log_qos_now",
    "has_qos_now",
    "core_util",
    "ipc",
    "has_ipc",
    "log_miss_rate",
    "has_miss_rate",
    "occupancy_frac",
    "has_occupancy",
    "bw_frac",
    "has_bw",
    "cores_now",
    "ways_now",
    "mba_now",
    "cores_cand",
    "ways_cand",
    "mba_cand",
    "gpu_cand",
    "log_cores_ratio",
    "log_ways_ratio",
    "util_cand",
    "neighbour_bw_frac",
    "neighbour_cores_frac",
];

/// Number of features.
pub const N_FEATURES: usize = FEATURE_NAMES.len();

/// Input columns that depend on the candidate allocation; the others describe the service
/// and host as measured, and are shared by every candidate of one service at one tick.
pub const CANDIDATE_FEATURES: [usize; 7] = [15, 16, 17, 18, 19, 20, 21];

/// The readings that may be absent, each with its presence flag: (value, flag). A value
/// whose flag is 0 was not measured (it is 0 in the vector).
pub const PRESENCE_FLAGS: [(&str, &str); 5] = [
    ("log_qos_now", "has_qos_now"),
    ("ipc", "has_ipc"),
    ("log_miss_rate", "has_miss_rate"),
    ("occupancy_frac", "has_occupancy"),
    ("bw_frac", "has_bw"),
];

/// True if feature `i` of `f` carries a measured value: false for a presence flag itself
/// and for a reading whose flag is 0 (see [`PRESENCE_FLAGS`]); true for everything else
/// ([`crate::schema::Schema::present`] of [`CPU_SCHEMA`]).
pub fn present(f: &[f32; N_FEATURES], i: usize) -> bool {
    CPU_SCHEMA.present(f, i)
}

/// The other tenants of the host, as the controller measured them.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Neighbours {
    /// Their memory bandwidth, summed, where measured.
    pub mem_bw_bytes_per_s: f64,
    /// Their cores, summed.
    pub cores: u32,
}

impl Neighbours {
    /// The other tenants of service `name` in an observation: the measured bandwidth of
    /// every other service and job (implausible readings dropped) and the cores of every
    /// other group in the allocation in force. Training rows from logs and the `ml` policy
    /// both use this, so the model is fed at run time what it was trained on.
    pub fn observed(obs: &Observation, name: &str, host: &HostCapacity) -> Self {
        Self {
            mem_bw_bytes_per_s: obs
                .services
                .iter()
                .filter(|o| o.spec.name != name)
                .filter_map(|o| o.sample.mem_bw_bytes_per_s)
                .filter(|b| *b < 4.0 * host.mem_bw_bytes_per_s)
                .sum(),
            cores: obs
                .current
                .groups()
                .filter(|(g, _)| *g != name)
                .map(|(_, a)| a.cores)
                .sum(),
        }
    }
}

/// Where [`log_qos_ratio`] clips ln(p99 / target), either way: a p99 past 20 times its
/// target reads as 20 times.
pub const LOG_QOS_CLIP: f64 = 3.0;

/// The measured ln(p99 / target) as the model sees it (`log_qos_now`): clipped to
/// ±[`LOG_QOS_CLIP`], `None` when the p99 or the target is missing or not positive.
pub fn log_qos_ratio(sample: &Sample, target_ms: f64) -> Option<f64> {
    sample
        .p99_ms
        .filter(|p| p.is_finite() && *p > 0.0 && target_ms > 0.0)
        .map(|p| (p / target_ms).ln().clamp(-LOG_QOS_CLIP, LOG_QOS_CLIP))
}

/// The feature vector of one service under one candidate allocation.
///
/// `target_ms` is the service's p99 target; `current` the allocation in force while `sample`
/// was measured.
// Features are bounded, O(1) values; f32 is the model's precision.
#[allow(clippy::cast_possible_truncation)]
pub fn features(
    host: &HostCapacity,
    target_ms: f64,
    sample: &Sample,
    current: &Allocation,
    candidate: &Allocation,
    neighbours: &Neighbours,
) -> [f32; N_FEATURES] {
    let cores = f64::from(host.cores.max(1));
    let ways = f64::from(host.llc_ways.max(1));
    let bw = host.mem_bw_bytes_per_s.max(1.0);
    let llc = (host.llc_bytes() as f64).max(1.0);
    let rps = plausible(sample.requests_per_s, 1e12).unwrap_or(0.0);
    let qos = log_qos_ratio(sample, target_ms);
    let busy = plausible(sample.cpu_busy_cores, cores * 2.0).unwrap_or(0.0);
    let cur_cores = f64::from(current.cores.max(1));
    let cand_cores = f64::from(candidate.cores.max(1));
    let (q, hq) = flag(qos);
    let (ipc, hipc) = flag(plausible(sample.ipc, 10.0));
    let (miss, hmiss) = flag(plausible(sample.llc_misses_per_s, 1e12).map(f64::ln_1p));
    let (occ, hocc) = flag(plausible(sample.llc_occupancy_bytes, llc * 1.5).map(|o| o / llc));
    let (b, hb) = flag(plausible(sample.mem_bw_bytes_per_s, bw * 4.0).map(|x| x / bw));
    [
        rps.ln_1p() as f32,
        q,
        hq,
        (busy / cur_cores) as f32,
        ipc,
        hipc,
        miss,
        hmiss,
        occ,
        hocc,
        b,
        hb,
        (cur_cores / cores) as f32,
        (f64::from(current.llc_ways.count) / ways) as f32,
        f32::from(current.mba_pct) / 100.0,
        (cand_cores / cores) as f32,
        (f64::from(candidate.llc_ways.count) / ways) as f32,
        f32::from(candidate.mba_pct) / 100.0,
        candidate.gpu_mps_pct.map_or(0.0, |g| f32::from(g) / 100.0),
        (cand_cores / cur_cores).ln() as f32,
        (f64::from(candidate.llc_ways.count.max(1)) / f64::from(current.llc_ways.count.max(1))).ln()
            as f32,
        (busy / cand_cores) as f32,
        (plausible(Some(neighbours.mem_bw_bytes_per_s), bw * 4.0).unwrap_or(0.0) / bw) as f32,
        (f64::from(neighbours.cores) / cores) as f32,
    ]
}

/// The regression target: ln(p99 / target) of the interval after the decision.
pub fn target(p99_ms: f64, target_ms: f64) -> Option<f64> {
    (p99_ms.is_finite() && p99_ms > 0.0 && target_ms > 0.0).then(|| (p99_ms / target_ms).ln())
}

#[cfg(test)]
mod tests {
    use cohabit_core::WayRange;

    use super::*;

    fn host() -> HostCapacity {
        HostCapacity {
            name: "t".into(),
            cores: 36,
            freq_ghz: 2.3,
            llc_ways: 20,
            llc_way_bytes: 2_359_296,
            mem_bw_bytes_per_s: 76.8e9,
            gpus: vec![],
            closids: 16,
            mba_min_pct: 10,
            mba_gran_pct: 10,
            min_cbm_bits: 1,
            shareable_bits: 0,
        }
    }

    fn alloc(cores: u32, ways: u32) -> Allocation {
        Allocation {
            cores,
            llc_ways: WayRange::new(0, ways),
            mba_pct: 100,
            gpu_mps_pct: None,
        }
    }

    /// The features of `sample` on [`host`] against a 1 ms target, with 4 cores and 4 ways
    /// in force and `candidate` proposed.
    fn from_4x4(sample: &Sample, candidate: &Allocation, n: &Neighbours) -> [f32; N_FEATURES] {
        features(&host(), 1.0, sample, &alloc(4, 4), candidate, n)
    }

    fn get(f: &[f32; N_FEATURES], name: &str) -> f32 {
        f[CPU_SCHEMA.index(name).unwrap()]
    }

    #[test]
    fn the_candidate_columns_are_the_candidate_allocation_and_its_ratios() {
        let cand: Vec<&str> = CANDIDATE_FEATURES
            .iter()
            .map(|&i| FEATURE_NAMES[i])
            .collect();
        assert_eq!(
            cand,
            [
                "cores_cand",
                "ways_cand",
                "mba_cand",
                "gpu_cand",
                "log_cores_ratio",
                "log_ways_ratio",
                "util_cand",
            ]
        );
    }

    #[test]
    fn missing_and_glitched_readings_become_absent_flags_not_zeros_or_garbage() {
        let glitchy = Sample {
            ipc: Some(1046.2),
            mem_bw_bytes_per_s: Some(1.76e14),
            p99_ms: None,
            ..Sample::default()
        };
        let f = from_4x4(&glitchy, &alloc(8, 4), &Neighbours::default());
        assert_eq!((get(&f, "ipc"), get(&f, "has_ipc")), (0.0, 0.0));
        assert_eq!((get(&f, "bw_frac"), get(&f, "has_bw")), (0.0, 0.0));
        assert_eq!((get(&f, "log_qos_now"), get(&f, "has_qos_now")), (0.0, 0.0));
        assert!((get(&f, "log_cores_ratio") - 2f32.ln()).abs() < 1e-6);
        assert!(f.iter().all(|v| v.is_finite()));
        assert_eq!(FEATURE_NAMES.len(), f.len());
    }

    #[test]
    fn a_counter_less_host_has_its_readings_absent_and_the_rest_present() {
        // No hardware counters, no RDT monitoring: latency, load and CPU time only.
        let s = Sample {
            p99_ms: Some(0.8),
            requests_per_s: Some(1000.0),
            cpu_busy_cores: Some(2.0),
            ..Sample::default()
        };
        let f = from_4x4(&s, &alloc(4, 4), &Neighbours::default());
        // The flags themselves are not readings either.
        let no_reading: Vec<&str> = (0..N_FEATURES)
            .filter(|&i| !present(&f, i))
            .map(|i| FEATURE_NAMES[i])
            .collect();
        assert_eq!(
            no_reading,
            [
                "has_qos_now",
                "ipc",
                "has_ipc",
                "log_miss_rate",
                "has_miss_rate",
                "occupancy_frac",
                "has_occupancy",
                "bw_frac",
                "has_bw"
            ]
        );
        // Without a latency reading, log_qos_now is absent too.
        let f = from_4x4(&Sample::default(), &alloc(4, 4), &Neighbours::default());
        assert!(!present(&f, CPU_SCHEMA.index("log_qos_now").unwrap()));
    }

    #[test]
    fn measured_values_are_scaled_to_the_host() {
        let s = Sample {
            ipc: Some(1.2),
            p99_ms: Some(2.0),
            cpu_busy_cores: Some(3.0),
            mem_bw_bytes_per_s: Some(7.68e9),
            ..Sample::default()
        };
        let f = from_4x4(
            &s,
            &alloc(6, 8),
            &Neighbours {
                mem_bw_bytes_per_s: 38.4e9,
                cores: 18,
            },
        );
        assert!((get(&f, "log_qos_now") - 2f32.ln()).abs() < 1e-6);
        assert!((get(&f, "core_util") - 0.75).abs() < 1e-6);
        assert!((get(&f, "util_cand") - 0.5).abs() < 1e-6);
        assert!((get(&f, "bw_frac") - 0.1).abs() < 1e-6);
        assert!((get(&f, "neighbour_bw_frac") - 0.5).abs() < 1e-6);
        assert!((get(&f, "neighbour_cores_frac") - 0.5).abs() < 1e-6);
        assert_eq!(target(2.0, 1.0), Some(2f64.ln()));
        assert_eq!(target(0.0, 1.0), None);
    }
}
