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
    /// The kernel offers the idle class for groups (`cpu.idle`, Linux 5.15).
    pub cpu_idle_class: bool,
    /// How late a thread wakes from a 1 ms sleep on this host as it is now.
    pub wake_latency: WakeLatency,
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
    /// What the host's MPS offers (absent without a control program).
    pub mps: Option<cohabit_collectors::mps::MpsCapabilities>,
}

/// How late a sleeping thread wakes: the overshoot of [`WAKE_SAMPLES`] sleeps of 1 ms, on
/// the host as it is when probed (run it on a quiet host to see its idle CPUs). On bare
/// metal the p99 is tens of µs; a VM whose idle vCPUs halt (no guest halt-polling) can take
/// milliseconds to wake one, which a latency-critical service on its own idle CPUs pays on
/// every request (README "Real services").
#[derive(Debug, Clone, Copy, Serialize)]
pub struct WakeLatency {
    /// Median overshoot, µs.
    pub p50_us: u64,
    /// 99th percentile, µs.
    pub p99_us: u64,
}

/// Sleeps measured by [`wake_latency`] (about 0.6 s in all).
pub const WAKE_SAMPLES: usize = 500;

/// Above this p99 overshoot the probe says idle CPUs wake slowly.
pub const SLOW_WAKE_US: u64 = 500;

/// Measures [`WakeLatency`] with `samples` sleeps of 1 ms.
pub fn wake_latency(samples: usize) -> WakeLatency {
    let nap = std::time::Duration::from_millis(1);
    let mut late: Vec<u64> = (0..samples.max(1))
        .map(|_| {
            let t = std::time::Instant::now();
            std::thread::sleep(nap);
            u64::try_from(t.elapsed().saturating_sub(nap).as_micros()).unwrap_or(u64::MAX)
        })
        .collect();
    late.sort_unstable();
    // Nearest rank: the sample at or above the quantile.
    let at = |pct: usize| late[(late.len() * pct).div_ceil(100).saturating_sub(1)];
    WakeLatency {
        p50_us: at(50),
        p99_us: at(99),
    }
}

/// Looks at the host under `paths`, with the MPS control program at `control` and the
/// control daemon's pipe directory `pipe` (`None`: the program's default), as the caller
/// found them (`cohabit probe`: [`DEFAULT_MPS_CONTROL`](super::config::DEFAULT_MPS_CONTROL)
/// and `CUDA_MPS_PIPE_DIRECTORY`; tests: a fake).
pub fn probe(
    paths: &HostPaths,
    control: &std::path::Path,
    pipe: Option<std::path::PathBuf>,
) -> ProbeReport {
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
    let (mps_state, mps) = if control.exists() {
        let ctl = cohabit_collectors::mps::MpsControl::new(control, pipe);
        let state = match ctl.server_list() {
            Ok(servers) => format!("control daemon running; servers: {servers:?}"),
            Err(e) => format!("control daemon not reachable: {e}"),
        };
        (state, Some(ctl.probe()))
    } else {
        ("nvidia-cuda-mps-control is not installed".to_string(), None)
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
        cpu_idle_class: cg.as_ref().is_some_and(Cgroups::has_idle_class),
        wake_latency: wake_latency(WAKE_SAMPLES),
        perf: perf::probe(),
        nvidia_driver,
        nvidia_absent,
        gpus,
        mps_daemon,
        mps_state,
        mps,
    }
}

/// The mechanisms a probe found, as an operator reads them.
fn mechanisms(c: &cohabit_collectors::mps::MpsCapabilities) -> String {
    let mut m = Vec::new();
    if c.thread_percentage {
        m.push("v2 active-thread percentages (a change restarts the client)");
    }
    if c.namespaces {
        m.push("v3 named servers and namespaces");
    }
    if c.dynamic_adjustment {
        m.push("v3 dynamic adjustment (changes without restart)");
    }
    if c.static_partitions {
        m.push("static SM partitions (fixed at a client's start)");
    }
    if m.is_empty() {
        "none".into()
    } else {
        m.join("; ")
    }
}

impl ProbeReport {
    /// The report as an operator reads it.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let mut line = |k: &str, v: String| out.push_str(&format!("{k:<22} {v}\n"));
        line("cpus", self.cpus.to_string());
        self.render_rdt(&mut line);
        self.render_cgroup_and_cpu(&mut line);
        self.render_gpu(&mut line);
        out
    }

    /// The report's resctrl lines: cache and bandwidth allocation, monitoring.
    fn render_rdt(&self, line: &mut impl FnMut(&str, String)) {
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
    }

    /// The report's cgroup, CPU scheduling, wake-up latency and perf counter lines.
    fn render_cgroup_and_cpu(&self, line: &mut impl FnMut(&str, String)) {
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
            "cpu idle class",
            if self.cpu_idle_class {
                "yes (cpu.idle): the best-effort pool yields at once".to_string()
            } else {
                "no (cpu.idle needs Linux 5.15): the pool gets the lowest weight".to_string()
            },
        );
        let w = self.wake_latency;
        line(
            "wake from 1 ms sleep",
            format!(
                "p50 {} µs, p99 {} µs late{}",
                w.p50_us,
                w.p99_us,
                if w.p99_us > SLOW_WAKE_US && self.cpu_idle_class {
                    "; idle CPUs wake slowly here (a VM whose idle vCPUs halt?): consider [host] best_effort_cpus = \"all\""
                } else if w.p99_us > SLOW_WAKE_US {
                    "; idle CPUs wake slowly here (a VM whose idle vCPUs halt?)"
                } else {
                    ""
                }
            ),
        );
        line(
            "hardware counters",
            match &self.perf {
                PerfSupport::Supported => "supported".to_string(),
                PerfSupport::Unsupported(why) => format!("absent: {why}"),
            },
        );
    }

    /// The report's NVIDIA lines: driver, GPUs, MPS.
    fn render_gpu(&self, line: &mut impl FnMut(&str, String)) {
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
                    "{}{}{}",
                    g.name,
                    if g.gpm { ", GPM supported" } else { ", no GPM" },
                    match (g.mig_enabled, g.mig_instances) {
                        (Some(true), Some(n)) => format!(", MIG on ({n} instances)"),
                        (Some(true), None) => ", MIG on".to_string(),
                        (Some(false), _) => ", MIG off".to_string(),
                        (None, _) => ", no MIG".to_string(),
                    }
                ),
            );
        }
        line("mps control", self.mps_state.clone());
        if let Some(c) = &self.mps {
            line(
                "mps version",
                format!(
                    "{} (protocol {})",
                    c.version.clone().unwrap_or_else(|| "unknown".into()),
                    match c.protocol {
                        cohabit_collectors::mps::Protocol::V2 => "v2",
                        cohabit_collectors::mps::Protocol::V3 => "v3",
                    }
                ),
            );
            line("mps mechanisms", mechanisms(c));
            for r in &c.refusals {
                line("mps refused", r.clone());
            }
        }
        line(
            "mps daemon",
            if self.mps_daemon {
                "running".into()
            } else {
                "not running".into()
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_control() -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../collectors/tests/fixtures/fake-mps-control")
    }

    #[test]
    fn the_probe_reports_the_mps_version_and_each_mechanism_offered() {
        let root = tempfile::tempdir().unwrap();
        let pipe = tempfile::tempdir().unwrap();
        std::fs::write(pipe.path().join("servers"), "4100\n").unwrap();
        std::fs::write(pipe.path().join("version"), "13.2\n").unwrap();
        std::fs::write(pipe.path().join("protocol"), "3\n").unwrap();
        std::fs::write(pipe.path().join("named_servers"), "llm\n").unwrap();
        std::fs::write(pipe.path().join("static"), "8\n").unwrap();
        let paths = HostPaths::under(root.path());
        let r = probe(&paths, &fake_control(), Some(pipe.path().to_path_buf()));
        let text = r.render();
        assert!(text.contains("13.2 (protocol v3)"), "{text}");
        assert!(
            text.contains("v3 dynamic adjustment (changes without restart)")
                && text.contains("static SM partitions")
                && text.contains("v2 active-thread percentages"),
            "{text}"
        );
        // A v2 daemon: percentages only, and the refused v3 command in the program's words.
        std::fs::remove_file(pipe.path().join("protocol")).unwrap();
        std::fs::remove_file(pipe.path().join("static")).unwrap();
        let text = probe(&paths, &fake_control(), Some(pipe.path().to_path_buf())).render();
        assert!(text.contains("(protocol v2)"), "{text}");
        assert!(!text.contains("dynamic adjustment"), "{text}");
        assert!(
            text.contains("mps refused") && text.contains("Usage:"),
            "{text}"
        );
        // No control program: said so, nothing probed.
        let r = probe(&paths, &root.path().join("none"), None);
        assert!(r.mps.is_none());
        assert!(r.render().contains("is not installed"));
        // No cgroup mount under the fixture root: no idle class, and said so.
        assert!(!r.cpu_idle_class);
        assert!(
            r.render().contains("cpu.idle needs Linux 5.15"),
            "{}",
            r.render()
        );
    }

    #[test]
    fn wake_latency_is_ordered_and_at_least_the_timer_slack_is_measured() {
        let w = wake_latency(20);
        assert!(w.p50_us <= w.p99_us, "{w:?}");
        // A 1 ms sleep never returns early, and a thread is never woken 1 s late on CI.
        assert!(w.p99_us < 1_000_000, "{w:?}");
    }
}
