//! `cohabit probe`: what this host can do, read without changing anything (the cgroup
//! writability check creates and removes one empty directory).

use std::sync::Arc;

use cohabit_collectors::cgroup::{Cgroups, Version};
use cohabit_collectors::kfs::RealFs;
use cohabit_collectors::perf::{self, PerfSupport};
use cohabit_collectors::procfs::Procfs;
use cohabit_collectors::resctrl::{Resctrl, ResctrlInfo};
use cohabit_collectors::sysfs::Sysfs;
use cohabit_collectors::HostPaths;
use serde::Serialize;

/// The probe's findings.
#[derive(Debug, Clone, Serialize)]
pub struct ProbeReport {
    /// Online CPUs.
    pub cpus: usize,
    /// Intel RDT through resctrl, if mounted.
    pub resctrl: Option<ResctrlInfo>,
    /// Why resctrl is absent.
    pub resctrl_absent: Option<String>,
    /// cgroup version in use.
    pub cgroup_version: Option<Version>,
    /// Controllers cohabit could write.
    pub cgroup_writable: Vec<String>,
    /// Hardware counters.
    pub perf: PerfSupport,
    /// NVIDIA driver version, if NVML loaded.
    pub nvidia_driver: Option<String>,
    /// Why there is no driver.
    pub nvidia_absent: Option<String>,
    /// GPUs NVML lists, with GPM support.
    pub gpus: Vec<cohabit_collectors::nvml::GpuInfo>,
    /// Whether an MPS control daemon process runs.
    pub mps_daemon: bool,
    /// What the MPS control program said (server PIDs, or why not).
    pub mps_state: String,
}

/// Looks at the host under `paths`.
pub fn probe(paths: &HostPaths) -> ProbeReport {
    let (resctrl, resctrl_absent) = match Resctrl::discover(paths, Arc::new(RealFs)) {
        Ok(Some(r)) => (Some(r.info().clone()), None),
        Ok(None) => (
            None,
            Some("resctrl is not mounted (no Intel RDT / AMD PQoS, or not enabled)".to_string()),
        ),
        Err(e) => (None, Some(format!("resctrl unreadable: {e}"))),
    };
    let cg = Cgroups::detect(paths).ok().flatten();
    let (nvidia_driver, nvidia_absent, gpus) = match cohabit_collectors::nvml::Gpus::open() {
        Ok(g) => (g.driver_version(), None, g.info().to_vec()),
        Err(e) => (None, Some(e.to_string()), vec![]),
    };
    let control = std::path::Path::new("/usr/bin/nvidia-cuda-mps-control");
    let mps_state = if control.exists() {
        let pipe = std::env::var_os("CUDA_MPS_PIPE_DIRECTORY").map(std::path::PathBuf::from);
        match cohabit_collectors::mps::MpsControl::new(control, pipe).server_list() {
            Ok(servers) => format!("control daemon running; servers: {servers:?}"),
            Err(e) => format!("control daemon not reachable: {e}"),
        }
    } else {
        "nvidia-cuda-mps-control is not installed".to_string()
    };
    let procfs = Procfs::new(&paths.proc);
    let mps_daemon = procfs
        .pids_named("nvidia-cuda-mps")
        .map(|p| !p.is_empty())
        .unwrap_or(false)
        || procfs
            .pids_named("nvidia-cuda-mps-control")
            .map(|p| !p.is_empty())
            .unwrap_or(false);
    ProbeReport {
        // Unknown online CPUs count as CPU 0 alone, as the daemon assumes.
        cpus: Sysfs::new(&paths.sys).online_cpus().map_or(1, |c| c.len()),
        resctrl,
        resctrl_absent,
        cgroup_version: cg.as_ref().map(|c| c.version),
        cgroup_writable: cg
            .as_ref()
            .map(Cgroups::writable_controllers)
            .unwrap_or_default(),
        perf: perf::probe(),
        nvidia_driver,
        nvidia_absent,
        gpus,
        mps_daemon,
        mps_state,
    }
}

impl ProbeReport {
    /// The report as an operator reads it.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let mut line = |k: &str, v: String| out.push_str(&format!("{k:<22} {v}\n"));
        line("cpus", self.cpus.to_string());
        match &self.resctrl {
            Some(r) => {
                let l3 = r.l3.as_ref().map_or_else(
                    || "no L3 allocation".to_string(),
                    |l| {
                        format!(
                            "{} ways, min {} bits, {} CLOSIDs{}",
                            l.ways(),
                            l.min_cbm_bits,
                            l.num_closids,
                            if l.cdp { ", CDP on" } else { "" }
                        )
                    },
                );
                line("rdt allocation", l3);
                line(
                    "rdt mba",
                    r.mba.as_ref().map_or_else(
                        || "absent".to_string(),
                        |m| format!("{:?}, {} CLOSIDs", m.units, m.num_closids),
                    ),
                );
                line(
                    "rdt monitoring",
                    r.mon.as_ref().map_or_else(
                        || "absent".to_string(),
                        |m| format!("{} RMIDs: {}", m.num_rmids, m.features.join(", ")),
                    ),
                );
            }
            None => line("rdt", self.resctrl_absent.clone().unwrap_or_default()),
        }
        line(
            "cgroup",
            match self.cgroup_version {
                Some(Version::V1) => "v1".to_string(),
                Some(Version::V2) => "v2".to_string(),
                None => "none found".to_string(),
            },
        );
        line(
            "cgroup writable",
            if self.cgroup_writable.is_empty() {
                "none (not root?)".to_string()
            } else {
                self.cgroup_writable.join(", ")
            },
        );
        line(
            "hardware counters",
            match &self.perf {
                PerfSupport::Supported => "supported".to_string(),
                PerfSupport::Unsupported(why) => format!("absent: {why}"),
            },
        );
        line(
            "nvidia",
            self.nvidia_driver.clone().map_or_else(
                || {
                    self.nvidia_absent
                        .clone()
                        .unwrap_or_else(|| "no NVIDIA driver".into())
                },
                |v| format!("driver {v}"),
            ),
        );
        for g in &self.gpus {
            line(
                &format!("gpu {}", g.index),
                format!(
                    "{}{}",
                    g.name,
                    if g.gpm { ", GPM supported" } else { ", no GPM" }
                ),
            );
        }
        line("mps control", self.mps_state.clone());
        line(
            "mps daemon",
            if self.mps_daemon {
                "running".into()
            } else {
                "not running".into()
            },
        );
        out
    }
}
