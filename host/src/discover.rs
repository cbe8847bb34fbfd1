//! What the host offers, found once at start: [`HostFacts`] (the capacity policies plan for,
//! CLOSIDs and MBA steps included; the CPUs cohabit hands out; what it may write) and the
//! handles to the kernel interfaces it will use.
//!
//! Every root comes from the configuration's [`cohabit_collectors::HostPaths`]; the files
//! themselves are read by `collectors` (sysfs, cgroup, resctrl, perf, NVML, procfs). A
//! resource the host lacks is logged once here and skipped from then on. Where the host
//! does not say, the daemon assumes the defaults below; [`capacity`] is the one place that
//! decides.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use cohabit_collectors::cgroup::{Cgroups, CpuList};
use cohabit_collectors::kfs::KernelFs;
use cohabit_collectors::mps::MpsControl;
use cohabit_collectors::nvml::Gpus;
use cohabit_collectors::perf::{self, PerfSupport};
use cohabit_collectors::resctrl::{Resctrl, ResctrlInfo};
use cohabit_collectors::sysfs::Sysfs;
use cohabit_core::{GpuCapacity, HostCapacity};

use super::HostError;
use crate::spec::HostSpec;

/// Frequency assumed when sysfs has no `cpuinfo_max_freq` (common in VMs).
pub const DEFAULT_FREQ_GHZ: f64 = 2.0;
/// LLC size assumed when sysfs has no L3 entry.
pub const DEFAULT_LLC_BYTES: u64 = 32 << 20;
/// Memory bandwidth assumed when the configuration has no `mem_bw_gbps`.
pub const DEFAULT_MEM_BW_GBPS: f64 = 100.0;
/// MBA minimum and step on a host without MBA (no resctrl, or no `info/MB`): 100 %, the
/// only level such a host can hold, so no policy plans a throttle that nothing applies
/// (plans below it are refused by `Allocation::validate`).
pub const NO_MBA_PCT: u8 = cohabit_core::MBA_MAX_PCT;
/// Clock tick rate assumed if the kernel reports none (Linux's `USER_HZ` on every arch
/// cohabit runs on).
pub const DEFAULT_CLK_TCK: f64 = 100.0;

/// What this host offers, found once at start.
#[derive(Debug, Clone, serde::Serialize)]
pub struct HostFacts {
    /// The capacity policies plan for.
    pub capacity: HostCapacity,
    /// The CPUs cohabit hands out, in order (configured, or every online CPU).
    pub cpus: Vec<u32>,
    /// cgroup controllers cohabit may write.
    pub writable: Vec<String>,
    /// CPU sets are written.
    pub can_cpuset: bool,
    /// CPU quotas are written.
    pub can_quota: bool,
    /// resctrl, if mounted.
    pub resctrl: Option<ResctrlInfo>,
    /// Hardware counters.
    pub perf: PerfSupport,
    /// The unit of process CPU time (ticks per second).
    pub clk_tck: f64,
    /// The kernel offers the idle class for groups (`cpu.idle`).
    pub idle_class: bool,
}

impl HostFacts {
    /// Whether the pool runs on every managed CPU in the idle class: `asked` for it
    /// (`[host] best_effort_cpus`), and the kernel has the class and cohabit writes the cpu
    /// controller.
    pub fn pool_on_every_cpu(&self, asked: super::layout::BestEffortCpus) -> bool {
        asked == super::layout::BestEffortCpus::All && self.idle_class && self.can_quota
    }
}

/// Why the CPUs cohabit was told to manage cannot be managed (refused at start).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CpuError {
    /// `[host] cpus` names CPUs that are not online: plans would count cores that do not
    /// run anything.
    #[error("host.cpus {configured} names CPUs that are not online: {offline} (online: {online}, from {path})")]
    NotOnline {
        /// As configured.
        configured: CpuList,
        /// Those of them not online.
        offline: CpuList,
        /// The online CPUs.
        online: CpuList,
        /// Where the online CPUs were read.
        path: PathBuf,
    },
    /// The online CPUs could not be read, so `[host] cpus` cannot be checked.
    #[error("host.cpus {configured} cannot be checked against the online CPUs: {path} is missing or not a CPU list")]
    OnlineUnknown {
        /// As configured.
        configured: CpuList,
        /// Where the online CPUs were looked for.
        path: PathBuf,
    },
    /// More latency-critical services than managed CPUs: each needs one of its own, so no
    /// plan (the fail-safe's fair share included) would be valid.
    #[error("more latency-critical services ({services}) than CPUs to manage ({cpus}): each service needs a CPU of its own; list more CPUs in [host] cpus, or configure fewer services")]
    TooManyServices {
        /// Latency-critical services configured.
        services: usize,
        /// CPUs managed.
        cpus: usize,
    },
}

/// The CPUs cohabit hands out: the configured ones, if every one is online (read at
/// `path`); else every online CPU (CPU 0 alone, with a warning, if that is unknown).
pub fn managed_cpus(
    configured: Option<&CpuList>,
    online: Option<Vec<u32>>,
    path: &Path,
) -> Result<Vec<u32>, CpuError> {
    match (configured, online) {
        (Some(c), Some(online)) => {
            let offline: Vec<u32> =
                c.0.iter()
                    .filter(|x| !online.contains(x))
                    .copied()
                    .collect();
            if offline.is_empty() {
                Ok(c.0.clone())
            } else {
                Err(CpuError::NotOnline {
                    configured: c.clone(),
                    offline: CpuList(offline),
                    online: CpuList(online),
                    path: path.to_path_buf(),
                })
            }
        }
        (Some(c), None) => Err(CpuError::OnlineUnknown {
            configured: c.clone(),
            path: path.to_path_buf(),
        }),
        (None, Some(online)) => Ok(online),
        (None, None) => {
            tracing::warn!(path = %path.display(), "online CPUs unknown; managing CPU 0 only");
            Ok(vec![0])
        }
    }
}

/// Refuses more latency-critical services than CPUs (each needs at least one).
pub fn services_fit(latency_critical: usize, cpus: usize) -> Result<(), CpuError> {
    if latency_critical > cpus {
        return Err(CpuError::TooManyServices {
            services: latency_critical,
            cpus,
        });
    }
    Ok(())
}

/// The facts and the handles cohabit will read and write through.
#[derive(Debug)]
pub(super) struct Discovered {
    pub facts: HostFacts,
    /// Only when CPU sets or quotas can be written.
    pub cgroups: Option<Cgroups>,
    pub resctrl: Option<Resctrl>,
    pub gpus: Option<Gpus>,
    pub mps: Option<MpsControl>,
}

/// Looks at the host `spec` describes, logging each missing resource once.
pub(super) fn discover(
    spec: &HostSpec,
    resctrl_fs: Arc<dyn KernelFs>,
) -> Result<Discovered, HostError> {
    // The CPUs first: a configuration that does not fit them is refused before anything
    // else is looked at.
    let sysfs = Sysfs::new(&spec.paths.sys);
    let cpus = managed_cpus(
        spec.cpus.as_ref(),
        sysfs.online_cpus(),
        &sysfs.online_path(),
    )?;
    let latency_critical = spec
        .services
        .iter()
        .filter(|s| s.p99_target_ms.is_some())
        .count();
    services_fit(latency_critical, cpus.len())?;
    let cg = cgroups(spec)?;
    let resctrl = resctrl(spec, resctrl_fs);
    let perf = perf::probe();
    if let PerfSupport::Unsupported(why) = &perf {
        tracing::warn!("{why}; IPC and LLC misses will be reported as absent");
    }
    let (gpus, mps) = gpus(spec);
    let info = resctrl.as_ref().map(Resctrl::info);
    let capacity = capacity(&CapacityInput {
        name: spec.host_name.clone(),
        cpus: cpus.len(),
        freq_ghz: sysfs.max_freq_ghz(),
        llc_bytes: sysfs.llc_bytes(),
        mem_bw_gbps: spec.mem_bw_gbps,
        resctrl: info,
        latency_critical,
        gpus: gpu_capacity(gpus.as_ref(), spec.gpus),
    });
    let clk_tck = match cohabit_collectors::procfs::clock_ticks_per_second() {
        0 => DEFAULT_CLK_TCK,
        t => t as f64,
    };
    let facts = HostFacts {
        capacity,
        cpus,
        writable: cg.writable,
        can_cpuset: cg.can_cpuset,
        can_quota: cg.can_quota,
        resctrl: info.cloned(),
        perf,
        clk_tck,
        // Pods' cgroups are the kubelet's: it writes their weights (at start, on an
        // in-place resize), and the kernel refuses a weight for a group in the idle class.
        idle_class: cg.idle_class && !spec.pods,
    };
    if cg.idle_class && spec.pods {
        tracing::info!("with [kubernetes] the best-effort pool gets the lowest CPU weight, not the idle class: the kubelet writes pods' weights, which the kernel refuses for a group in the class");
    }
    if spec.best_effort_cpus == super::layout::BestEffortCpus::All
        && !facts.pool_on_every_cpu(spec.best_effort_cpus)
    {
        tracing::warn!("best_effort_cpus = \"all\" needs the kernel's idle class for groups (cpu.idle, Linux 5.15) and a writable cpu controller; the pool keeps to the CPUs no service holds");
    }
    Ok(Discovered {
        cgroups: cg.cgroups.filter(|_| facts.can_cpuset || facts.can_quota),
        facts,
        resctrl,
        gpus,
        mps,
    })
}

/// The cgroup hierarchies and what cohabit may write in them.
struct CgroupFacts {
    cgroups: Option<Cgroups>,
    writable: Vec<String>,
    can_cpuset: bool,
    can_quota: bool,
    idle_class: bool,
}

fn cgroups(spec: &HostSpec) -> Result<CgroupFacts, HostError> {
    let cgroups = Cgroups::detect(&spec.paths)?;
    let writable = cgroups
        .as_ref()
        .map(Cgroups::writable_controllers)
        .unwrap_or_default();
    let can_cpuset =
        cgroups.as_ref().is_some_and(Cgroups::has_cpuset) && writable.iter().any(|c| c == "cpuset");
    let can_quota =
        cgroups.as_ref().is_some_and(Cgroups::has_quota) && writable.iter().any(|c| c == "cpu");
    if !can_cpuset {
        tracing::warn!("cores: no writable cpuset controller; CPU sets will not be applied");
    }
    if !can_quota && !can_cpuset {
        tracing::warn!(
            "cores: no writable cpu controller either; core allocations will not be applied"
        );
    }
    let idle_class = can_quota && cgroups.as_ref().is_some_and(Cgroups::has_idle_class);
    if can_quota && !idle_class {
        tracing::warn!("the kernel has no idle class for groups (cpu.idle, Linux 5.15); the best-effort pool gets the lowest CPU weight instead");
    }
    Ok(CgroupFacts {
        cgroups,
        writable,
        can_cpuset,
        can_quota,
        idle_class,
    })
}

fn resctrl(spec: &HostSpec, fs: Arc<dyn KernelFs>) -> Option<Resctrl> {
    let resctrl = match Resctrl::discover(&spec.paths, fs) {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(error = %e, "resctrl unreadable; LLC ways and MBA will not be applied");
            return None;
        }
    };
    match &resctrl {
        None => {
            tracing::warn!("resctrl is not mounted; LLC ways, MBA and RDT monitoring are skipped");
        }
        Some(r) if !r.info().allocates() => {
            tracing::warn!(
                "resctrl offers no allocation (no L3 CAT, no MBA); LLC ways and MBA are skipped"
            );
        }
        Some(_) => {}
    }
    resctrl
}

fn gpus(spec: &HostSpec) -> (Option<Gpus>, Option<MpsControl>) {
    let gpus = match Gpus::open() {
        Ok(g) => Some(g),
        Err(e) => {
            tracing::warn!("{e}; GPU telemetry is absent");
            None
        }
    };
    let mps = if spec.mps.control.exists() {
        Some(MpsControl::new(
            &spec.mps.control,
            spec.mps.pipe_dir.clone(),
        ))
    } else {
        if spec.services.iter().any(|s| s.gpu.is_some()) {
            tracing::warn!(control = %spec.mps.control.display(), "no MPS control program; GPU shares go to environment files only");
        }
        None
    };
    (gpus, mps)
}

/// GPUs as NVML lists them, else as many as configured, else none. Their SM count is not
/// read (shares are percentages), so it is 1.
fn gpu_capacity(gpus: Option<&Gpus>, configured: Option<u32>) -> Vec<GpuCapacity> {
    match (gpus, configured) {
        (Some(g), _) => g
            .info()
            .iter()
            .map(|i| GpuCapacity {
                name: i.name.clone(),
                sms: 1,
                share_change: cohabit_core::ShareChange::Restart,
            })
            .collect(),
        (None, Some(n)) => (0..n)
            .map(|i| GpuCapacity {
                name: format!("GPU {i} (configured)"),
                sms: 1,
                share_change: cohabit_core::ShareChange::Restart,
            })
            .collect(),
        (None, None) => vec![],
    }
}

/// What [`capacity`] is computed from: the host's answers, `None` where it gave none.
#[derive(Debug, Clone)]
pub struct CapacityInput<'a> {
    /// The host's name (configuration).
    pub name: String,
    /// CPUs cohabit hands out.
    pub cpus: usize,
    /// Top frequency (sysfs).
    pub freq_ghz: Option<f64>,
    /// L3 size (sysfs).
    pub llc_bytes: Option<u64>,
    /// Memory bandwidth (configuration).
    pub mem_bw_gbps: Option<f64>,
    /// resctrl, if mounted.
    pub resctrl: Option<&'a ResctrlInfo>,
    /// Latency-critical services configured.
    pub latency_critical: usize,
    /// GPUs.
    pub gpus: Vec<GpuCapacity>,
}

/// The capacity policies plan for. Pure: the defaults above apply where the host is silent.
pub fn capacity(h: &CapacityInput<'_>) -> HostCapacity {
    let ways = h
        .resctrl
        .and_then(|r| r.l3.as_ref().map(|l| l.ways()))
        .filter(|w| *w > 0)
        .unwrap_or(1);
    let l3 = h.resctrl.and_then(|r| r.l3.as_ref());
    let all_ways = if ways >= 64 {
        u64::MAX
    } else {
        (1u64 << ways) - 1
    };
    HostCapacity {
        name: h.name.clone(),
        cores: u32::try_from(h.cpus).unwrap_or(u32::MAX).max(1),
        freq_ghz: h.freq_ghz.filter(|f| *f > 0.0).unwrap_or(DEFAULT_FREQ_GHZ),
        llc_ways: ways,
        llc_way_bytes: (h.llc_bytes.unwrap_or(DEFAULT_LLC_BYTES) / u64::from(ways)).max(1),
        mem_bw_bytes_per_s: h.mem_bw_gbps.unwrap_or(DEFAULT_MEM_BW_GBPS) * 1e9,
        gpus: h.gpus.clone(),
        closids: closids(h.resctrl, h.latency_critical),
        // Without MBA (no resctrl, or resctrl without MB) the only level is 100 %: a policy
        // that planned a throttle here would log a change that no knob carries out.
        mba_min_pct: h
            .resctrl
            .and_then(ResctrlInfo::mba_min_pct)
            .unwrap_or(NO_MBA_PCT),
        mba_gran_pct: h
            .resctrl
            .and_then(ResctrlInfo::mba_gran_pct)
            .unwrap_or(NO_MBA_PCT),
        min_cbm_bits: l3.map_or(1, |l| l.min_cbm_bits.clamp(1, ways)),
        shareable_bits: l3.map_or(0, |l| l.shareable_bits & all_ways),
    }
}

/// CLOSIDs the plan may count on, the root group's included.
///
/// With RDT allocation: the smallest `num_closids` among the resources cohabit writes (L3,
/// and MB when MBA is present), at least 2 (the capacity's floor; a host with 1 CLOSID
/// refuses every group at apply time). Without it (no resctrl, or monitoring only) cohabit
/// creates no resctrl group, so the number must not bind: one per latency-critical service,
/// one for the pool and the root's, which is the most any plan can use, and stays a small,
/// honest number in logs (unlike `u32::MAX`) that arithmetic on it cannot overflow.
pub fn closids(resctrl: Option<&ResctrlInfo>, latency_critical: usize) -> u32 {
    match resctrl.filter(|r| r.allocates()) {
        Some(r) => r.num_closids().max(2),
        None => u32::try_from(latency_critical)
            .unwrap_or(u32::MAX)
            .saturating_add(2),
    }
}

#[cfg(test)]
mod tests {
    use cohabit_collectors::resctrl::{CacheInfo, MbaInfo, MbaUnits, MonInfo};
    use cohabit_collectors::HostPaths;

    use super::*;
    use crate::spec::Matcher;
    use crate::testing::{self, latency_critical, udp_push};

    fn rdt(l3_closids: u32, mba: Option<(u32, u32, u32)>) -> ResctrlInfo {
        ResctrlInfo {
            root: "/sys/fs/resctrl".into(),
            l3: Some(CacheInfo {
                cbm_mask: 0x7ff,
                min_cbm_bits: 1,
                shareable_bits: 0,
                num_closids: l3_closids,
                cdp: false,
            }),
            mba: mba.map(|(n, min, gran)| MbaInfo {
                units: MbaUnits::Percent { min, gran },
                num_closids: n,
                delay_linear: true,
                min_bandwidth: min,
                bandwidth_gran: gran,
            }),
            mon: None,
            l3_domains: vec![0],
            mb_domains: vec![0],
        }
    }

    fn input(resctrl: Option<&ResctrlInfo>) -> CapacityInput<'_> {
        CapacityInput {
            name: "h".into(),
            cpus: 8,
            freq_ghz: None,
            llc_bytes: Some(22 << 20),
            mem_bw_gbps: None,
            resctrl,
            latency_critical: 3,
            gpus: vec![],
        }
    }

    #[test]
    fn closids_are_the_smallest_of_l3_and_mb() {
        let xeon = rdt(16, Some((8, 10, 10)));
        assert_eq!(closids(Some(&xeon), 3), 8, "MBA in use: MB's 8 bind");
        assert_eq!(closids(Some(&rdt(16, None)), 3), 16, "only L3");
        assert_eq!(closids(Some(&rdt(4, Some((8, 10, 10)))), 3), 4);
        assert_eq!(
            closids(Some(&rdt(1, None)), 3),
            2,
            "never below the capacity's floor"
        );
    }

    #[test]
    fn without_rdt_allocation_closids_do_not_bind() {
        // 3 latency-critical services + the pool + the root group.
        assert_eq!(closids(None, 3), 5);
        assert_eq!(closids(None, 0), 2);
        let monitoring_only = ResctrlInfo {
            l3: None,
            mba: None,
            mon: Some(MonInfo {
                num_rmids: 128,
                features: vec!["llc_occupancy".into()],
            }),
            ..rdt(16, None)
        };
        assert_eq!(closids(Some(&monitoring_only), 3), 5);
    }

    #[test]
    fn capacity_takes_the_hosts_answers_and_defaults_where_it_is_silent() {
        let xeon = rdt(16, Some((8, 20, 5)));
        let c = capacity(&input(Some(&xeon)));
        assert_eq!((c.cores, c.llc_ways, c.llc_way_bytes), (8, 11, 2 << 20));
        assert_eq!((c.closids, c.mba_min_pct, c.mba_gran_pct), (8, 20, 5));
        assert!((c.freq_ghz - DEFAULT_FREQ_GHZ).abs() < 1e-12);
        assert!((c.mem_bw_bytes_per_s - 100e9).abs() < 1.0);
        c.validate().unwrap();
        let bare = capacity(&input(None));
        assert_eq!((bare.llc_ways, bare.llc_way_bytes), (1, 22 << 20));
        assert_eq!(
            (bare.closids, bare.mba_min_pct, bare.mba_gran_pct),
            (5, 100, 100),
            "no MBA: 100 % is the only level"
        );
        // The training data's hosts without RDT are this one: what a model saw is what the
        // daemon feeds it.
        assert_eq!(
            bare,
            HostCapacity {
                closids: bare.closids,
                ..c.without_allocation()
            }
        );
        let cat_only = capacity(&input(Some(&rdt(16, None))));
        assert_eq!((cat_only.mba_min_pct, cat_only.mba_gran_pct), (100, 100));
        cat_only.validate().unwrap();
        bare.validate().unwrap();
        let mut silent = input(None);
        silent.llc_bytes = None;
        silent.cpus = 0;
        let s = capacity(&silent);
        assert_eq!((s.cores, s.llc_way_bytes), (1, DEFAULT_LLC_BYTES));
    }

    /// A sysfs root whose online CPUs are `online`.
    fn sys_with_online(online: &str) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let cpu = dir.path().join("devices/system/cpu");
        std::fs::create_dir_all(&cpu).unwrap();
        std::fs::write(cpu.join("online"), format!("{online}\n")).unwrap();
        dir
    }

    /// `services` latency-critical services on `[host] cpus` (if given), with sysfs at `sys`.
    fn config(sys: &Path, cpus: Option<&str>, services: usize) -> HostSpec {
        let paths = HostPaths {
            sys: sys.into(),
            cgroup: "/nonexistent-cgroup-root".into(),
            ..HostPaths::standard()
        };
        let services = (0..services)
            .map(|i| {
                let unit = Matcher::SystemdUnit(format!("s{i}.service"));
                latency_critical(&format!("s{i}"), 1.0, unit, udp_push())
            })
            .collect();
        HostSpec {
            cpus: cpus.map(|c| c.parse().unwrap()),
            ..testing::host(paths, services)
        }
    }

    fn discover_err(cfg: &HostSpec) -> String {
        discover(cfg, Arc::new(cohabit_collectors::kfs::RealFs))
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn configured_cpus_that_are_not_online_are_refused_by_name() {
        let sys = sys_with_online("0-1");
        let e = discover_err(&config(sys.path(), Some("0-35"), 1));
        assert!(
            e.contains("host.cpus 0-35 names CPUs that are not online: 2-35 (online: 0-1"),
            "{e}"
        );
        let sys = sys_with_online("0-3,8");
        let path = sys.path().join("devices/system/cpu/online");
        let list = |t: &str| t.parse::<CpuList>().unwrap();
        assert_eq!(
            managed_cpus(Some(&list("2-3,8")), Some(vec![0, 1, 2, 3, 8]), &path),
            Ok(vec![2, 3, 8])
        );
        assert_eq!(
            managed_cpus(Some(&list("3-5")), Some(vec![0, 1, 2, 3, 8]), &path),
            Err(CpuError::NotOnline {
                configured: list("3-5"),
                offline: list("4-5"),
                online: list("0-3,8"),
                path: path.clone(),
            })
        );
        // Unknown online CPUs: a configured list cannot be checked, so it is refused;
        // without one, CPU 0 alone.
        assert!(matches!(
            managed_cpus(Some(&list("0")), None, &path),
            Err(CpuError::OnlineUnknown { .. })
        ));
        assert_eq!(managed_cpus(None, None, &path), Ok(vec![0]));
        assert_eq!(managed_cpus(None, Some(vec![0, 1]), &path), Ok(vec![0, 1]));
    }

    #[test]
    fn more_latency_critical_services_than_cpus_are_refused() {
        let sys = sys_with_online("0-1");
        let e = discover_err(&config(sys.path(), None, 3));
        assert!(
            e.contains("more latency-critical services (3) than CPUs to manage (2)"),
            "{e}"
        );
        let sys = sys_with_online("0-7");
        let e = discover_err(&config(sys.path(), Some("4"), 2));
        assert!(e.contains("services (2) than CPUs to manage (1)"), "{e}");
        // As many as CPUs is fine (the pool then shares the last one, idle class).
        assert_eq!(services_fit(2, 2), Ok(()));
    }
}
