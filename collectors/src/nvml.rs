//! GPU telemetry through NVML (`nvml-wrapper`, which loads `libnvidia-ml.so.1` at run time,
//! so builds and tests need no GPU or driver).
//!
//! Per GPU: utilisation and memory; per process: NVML's utilisation samples since the last
//! read; the compute processes, MPS-aware (under MPS the ordinary list shows the MPS server,
//! so the clients come from `nvmlDeviceGetMPSComputeRunningProcesses_v3`); and, on GPUs with
//! GPM (Hopper and later), SM utilisation and occupancy between two GPM samples. The MPS and
//! GPM calls are not in nvml-wrapper's safe API and go through its `-sys` bindings.
//!
//! Without a driver [`Gpus::open`] returns [`NvmlAbsent`] once with the reason; callers
//! report GPU telemetry as absent and do not retry every tick.
//!
//! This is the one module of the workspace allowed `unsafe`: the MPS and GPM calls into
//! NVML's C API. Every block says why it is sound.
#![allow(unsafe_code)]

use std::collections::BTreeMap;

use nvml_wrapper::Nvml;
use nvml_wrapper_sys::bindings as sys;

/// No usable NVML on this host, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("no NVIDIA driver: {0}")]
pub struct NvmlAbsent(pub String);

/// One GPU as NVML describes it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct GpuInfo {
    /// Index.
    pub index: u32,
    /// Model name.
    pub name: String,
    /// Whether GPM metrics are supported.
    pub gpm: bool,
    /// MIG mode in force (absent where the GPU has no MIG).
    pub mig_enabled: Option<bool>,
    /// MIG instances (GPU instances' devices) present, when MIG is enabled.
    pub mig_instances: Option<u32>,
}

/// One reading of one GPU.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct GpuReading {
    /// Busy time, percent.
    pub util_pct: Option<f64>,
    /// Memory used and total.
    pub memory_used_bytes: Option<u64>,
    /// Memory total.
    pub memory_total_bytes: Option<u64>,
    /// SM utilisation per process since the last reading, percent.
    pub process_sm_util_pct: BTreeMap<u32, f64>,
    /// Compute processes (MPS clients where MPS runs).
    pub processes: Vec<u32>,
    /// Device memory each compute process uses, bytes (where NVML reports it).
    pub process_memory_bytes: BTreeMap<u32, u64>,
    /// GPM SM utilisation since the last reading, percent (Hopper and later).
    pub gpm_sm_util_pct: Option<f64>,
    /// GPM SM occupancy since the last reading, percent.
    pub gpm_sm_occupancy_pct: Option<f64>,
}

struct GpmSamples {
    last: sys::nvmlGpmSample_t,
    next: sys::nvmlGpmSample_t,
    primed: bool,
}

// SAFETY: GPM samples are opaque buffers owned by this value and only touched through
// `&mut self`; NVML's API is thread-safe, so using them from another thread is sound.
unsafe impl Send for GpmSamples {}

/// The GPUs of this host.
pub struct Gpus {
    nvml: Nvml,
    raw: Option<sys::NvmlLib>,
    info: Vec<GpuInfo>,
    last_seen_us: Vec<u64>,
    gpm: Vec<Option<GpmSamples>>,
}

impl std::fmt::Debug for Gpus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpus")
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}

const NVML_SUCCESS: sys::nvmlReturn_t = 0;
const NVML_ERROR_INSUFFICIENT_SIZE: sys::nvmlReturn_t = 7;

impl Gpus {
    /// Loads NVML and lists the GPUs.
    pub fn open() -> Result<Self, NvmlAbsent> {
        let nvml = Nvml::init().map_err(|e| NvmlAbsent(e.to_string()))?;
        let count = nvml.device_count().map_err(|e| NvmlAbsent(e.to_string()))?;
        let raw = load_raw();
        let mut info = Vec::new();
        let mut gpm = Vec::new();
        for index in 0..count {
            let dev = nvml
                .device_by_index(index)
                .map_err(|e| NvmlAbsent(e.to_string()))?;
            let name = dev.name().unwrap_or_else(|_| "unknown".into());
            // SAFETY: the handle comes from a live `Device` of the same loaded library.
            let handle = unsafe { dev.handle() };
            let supported = raw.as_ref().is_some_and(|lib| gpm_supported(lib, handle));
            gpm.push(if supported {
                raw.as_ref().and_then(GpmSamples::alloc)
            } else {
                None
            });
            let mig_enabled = dev.mig_mode().ok().map(|m| m.current == 1);
            let mig_instances = match (mig_enabled, raw.as_ref()) {
                (Some(true), Some(lib)) => mig_instances(lib, handle),
                _ => None,
            };
            info.push(GpuInfo {
                index,
                name,
                gpm: supported,
                mig_enabled,
                mig_instances,
            });
        }
        Ok(Self {
            nvml,
            raw,
            last_seen_us: vec![0; info.len()],
            info,
            gpm,
        })
    }

    /// The driver version.
    pub fn driver_version(&self) -> Option<String> {
        self.nvml.sys_driver_version().ok()
    }

    /// The GPUs.
    pub fn info(&self) -> &[GpuInfo] {
        &self.info
    }

    /// Reads every GPU. A reading NVML refuses is absent, not zero.
    pub fn read(&mut self) -> Vec<GpuReading> {
        let mut out = Vec::with_capacity(self.info.len());
        for i in 0..self.info.len() {
            let Ok(dev) = self.nvml.device_by_index(self.info[i].index) else {
                out.push(GpuReading::default());
                continue;
            };
            let mut r = GpuReading {
                util_pct: dev.utilization_rates().ok().map(|u| f64::from(u.gpu)),
                ..GpuReading::default()
            };
            if let Ok(m) = dev.memory_info() {
                r.memory_used_bytes = Some(m.used);
                r.memory_total_bytes = Some(m.total);
            }
            if let Ok(samples) = dev.process_utilization_stats(self.last_seen_us[i]) {
                for s in samples {
                    self.last_seen_us[i] = self.last_seen_us[i].max(s.timestamp);
                    *r.process_sm_util_pct.entry(s.pid).or_insert(0.0) += f64::from(s.sm_util);
                }
            }
            // SAFETY: the handle comes from a live `Device` of the same loaded library.
            let handle = unsafe { dev.handle() };
            let mps = self.raw.as_ref().and_then(|lib| mps_processes(lib, handle));
            let listed: Vec<(u32, Option<u64>)> = match mps {
                Some(p) if !p.is_empty() => p,
                _ => dev
                    .running_compute_processes()
                    .map(|v| {
                        v.into_iter()
                            .map(|p| {
                                let used = match p.used_gpu_memory {
                                    nvml_wrapper::enums::device::UsedGpuMemory::Used(b) => Some(b),
                                    nvml_wrapper::enums::device::UsedGpuMemory::Unavailable => None,
                                };
                                (p.pid, used)
                            })
                            .collect()
                    })
                    .unwrap_or_default(),
            };
            r.processes = listed.iter().map(|(p, _)| *p).collect();
            r.process_memory_bytes = listed
                .iter()
                .filter_map(|(p, used)| Some((*p, (*used)?)))
                .collect();
            if let (Some(lib), Some(g)) = (self.raw.as_ref(), self.gpm[i].as_mut()) {
                if let Some((util, occ)) = g.step(lib, handle) {
                    r.gpm_sm_util_pct = Some(util);
                    r.gpm_sm_occupancy_pct = Some(occ);
                }
            }
            out.push(r);
        }
        out
    }
}

fn load_raw() -> Option<sys::NvmlLib> {
    // SAFETY: loading the NVML library runs no initialisers beyond the driver's own; NVML is
    // already initialised by `Nvml::init` in this process, and the library stays loaded
    // (the safe wrapper holds it) for as long as `Gpus` lives.
    unsafe { sys::NvmlLib::new("libnvidia-ml.so.1").ok() }
}

fn gpm_supported(lib: &sys::NvmlLib, dev: sys::nvmlDevice_t) -> bool {
    let mut s = sys::nvmlGpmSupport_t {
        version: sys::NVML_GPM_SUPPORT_VERSION,
        isSupportedDevice: 0,
    };
    // SAFETY: `dev` is a valid handle and `s` a properly versioned out-parameter.
    let rc = unsafe { lib.nvmlGpmQueryDeviceSupport(dev, &mut s) };
    rc == NVML_SUCCESS && s.isSupportedDevice != 0
}

/// MIG devices present on a GPU with MIG enabled.
fn mig_instances(lib: &sys::NvmlLib, dev: sys::nvmlDevice_t) -> Option<u32> {
    let mut max: u32 = 0;
    // SAFETY: `dev` is a valid handle and `max` a plain out-parameter.
    if unsafe { lib.nvmlDeviceGetMaxMigDeviceCount(dev, &mut max) } != NVML_SUCCESS {
        return None;
    }
    let mut present = 0;
    for i in 0..max {
        let mut mig: sys::nvmlDevice_t = std::ptr::null_mut();
        // SAFETY: `dev` is valid, `i` is below the count NVML gave, `mig` an out-parameter.
        if unsafe { lib.nvmlDeviceGetMigDeviceHandleByIndex(dev, i, &mut mig) } == NVML_SUCCESS {
            present += 1;
        }
    }
    Some(present)
}

/// MPS clients and the device memory each uses (NVML's "not available" value is absent).
fn mps_processes(lib: &sys::NvmlLib, dev: sys::nvmlDevice_t) -> Option<Vec<(u32, Option<u64>)>> {
    let mut count: u32 = 0;
    // SAFETY: a null buffer with count 0 asks NVML for the needed size.
    let rc = unsafe {
        lib.nvmlDeviceGetMPSComputeRunningProcesses_v3(dev, &mut count, std::ptr::null_mut())
    };
    if rc == NVML_SUCCESS {
        return Some(vec![]);
    }
    if rc != NVML_ERROR_INSUFFICIENT_SIZE {
        return None;
    }
    let mut buf: Vec<sys::nvmlProcessInfo_t> = Vec::with_capacity(count as usize + 4);
    let mut n = count + 4;
    // SAFETY: `buf` has room for `n` entries; NVML writes at most `n` and sets `n` to the
    // number written, and the entries are plain data.
    unsafe {
        let rc = lib.nvmlDeviceGetMPSComputeRunningProcesses_v3(dev, &mut n, buf.as_mut_ptr());
        if rc != NVML_SUCCESS {
            return None;
        }
        buf.set_len((n as usize).min(buf.capacity()));
    }
    // NVML_VALUE_NOT_AVAILABLE is the all-ones value.
    Some(
        buf.iter()
            .map(|p| {
                (
                    p.pid,
                    (p.usedGpuMemory != u64::MAX).then_some(p.usedGpuMemory),
                )
            })
            .collect(),
    )
}

impl GpmSamples {
    fn alloc(lib: &sys::NvmlLib) -> Option<Self> {
        let mut a: sys::nvmlGpmSample_t = std::ptr::null_mut();
        let mut b: sys::nvmlGpmSample_t = std::ptr::null_mut();
        // SAFETY: out-parameters for two sample buffers, freed in `Drop`.
        let ok = unsafe {
            lib.nvmlGpmSampleAlloc(&mut a) == NVML_SUCCESS
                && lib.nvmlGpmSampleAlloc(&mut b) == NVML_SUCCESS
        };
        ok.then_some(Self {
            last: a,
            next: b,
            primed: false,
        })
    }

    /// Takes a sample; with a previous one, returns SM utilisation and occupancy between them.
    fn step(&mut self, lib: &sys::NvmlLib, dev: sys::nvmlDevice_t) -> Option<(f64, f64)> {
        // SAFETY: `next` was allocated by nvmlGpmSampleAlloc and `dev` is valid.
        if unsafe { lib.nvmlGpmSampleGet(dev, self.next) } != NVML_SUCCESS {
            return None;
        }
        let result = if self.primed {
            // SAFETY: zeroed is a valid bit pattern for this plain C struct; the fields NVML
            // reads (version, count, samples, metric ids) are set before the call.
            let mut get: sys::nvmlGpmMetricsGet_t = unsafe { std::mem::zeroed() };
            get.version = sys::NVML_GPM_METRICS_GET_VERSION;
            get.numMetrics = 2;
            get.sample1 = self.last;
            get.sample2 = self.next;
            get.metrics[0].metricId = sys::nvmlGpmMetricId_t_NVML_GPM_METRIC_SM_UTIL;
            get.metrics[1].metricId = sys::nvmlGpmMetricId_t_NVML_GPM_METRIC_SM_OCCUPANCY;
            // SAFETY: `get` is fully set up as documented for nvmlGpmMetricsGet.
            let rc = unsafe { lib.nvmlGpmMetricsGet(&mut get) };
            (rc == NVML_SUCCESS
                && get.metrics[0].nvmlReturn == NVML_SUCCESS
                && get.metrics[1].nvmlReturn == NVML_SUCCESS)
                .then(|| (get.metrics[0].value, get.metrics[1].value))
        } else {
            None
        };
        std::mem::swap(&mut self.last, &mut self.next);
        self.primed = true;
        result
    }
}

impl Drop for Gpus {
    fn drop(&mut self) {
        if let Some(lib) = &self.raw {
            for g in self.gpm.iter().flatten() {
                // SAFETY: both samples were allocated by nvmlGpmSampleAlloc and are freed once.
                unsafe {
                    lib.nvmlGpmSampleFree(g.last);
                    lib.nvmlGpmSampleFree(g.next);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_driver_nvml_is_absent_with_a_reason() {
        match Gpus::open() {
            Err(NvmlAbsent(why)) => {
                println!("no NVIDIA driver here: {why}");
                assert!(!why.is_empty());
                assert!(NvmlAbsent(why).to_string().starts_with("no NVIDIA driver"));
            }
            Ok(mut g) => {
                // A real GPU: every GPU reads without panicking and lists its name.
                assert!(g.info().iter().all(|i| !i.name.is_empty()));
                assert_eq!(g.read().len(), g.info().len());
            }
        }
    }
}
