//! The real host behind the controller's [`Collector`] and [`Actuator`] traits.
//!
//! Plan, then apply: a plan becomes CPU sets and quotas (cgroups) and, where the host has
//! RDT, control groups with masks and MBA values (resctrl), written only where they
//! differ. Everything changed is remembered: on [`RealHost::restore`] every process goes
//! back to the cgroups it came from and every group cohabit created is removed. On start,
//! groups a crashed run left behind are cleaned first. A resource the host lacks is skipped
//! with one log line.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Instant;

use cohabit_collectors::cgroup::{Cgroups, CpuList, Version};
use cohabit_collectors::kfs::{KernelFs, RealFs};
use cohabit_collectors::latency::{PromHistogram, PushListener};
use cohabit_collectors::perf::{self, CgroupCounters, PerfSupport, PerfTotals};
use cohabit_collectors::procfs::Procfs;
use cohabit_collectors::resctrl::{BandwidthRate, MonReading, Resctrl, GROUP_PREFIX};
use cohabit_core::{
    Actuator, Allocation, Change, Collector, HostCapacity, Observation, Plan, Sample, ServiceClass,
    ServiceObservation, ServiceSpec, BEST_EFFORT_GROUP,
};

use super::config::{DaemonConfig, LatencySource, Matcher, ServiceConfig};

/// Why the real host could not start or apply a plan.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    /// A cgroup operation failed.
    #[error("cgroup: {0}")]
    Cgroup(#[from] cohabit_collectors::cgroup::CgroupError),
    /// resctrl refused or failed.
    #[error("resctrl: {0}")]
    Resctrl(#[from] cohabit_collectors::resctrl::ResctrlError),
    /// The host could not be read.
    #[error(transparent)]
    Io(#[from] cohabit_collectors::IoError),
    /// A latency source could not be set up.
    #[error("latency source of {service}: {source}")]
    Latency {
        /// Service.
        service: String,
        /// Why.
        source: cohabit_collectors::latency::LatencyError,
    },
    /// A GPU share could not be published.
    #[error("GPU share: {0}")]
    Gpu(String),
    /// The plan needs more resctrl groups than the host has CLOSIDs.
    #[error(
        "the plan needs {needed} resctrl groups but the host has {available} CLOSIDs for cohabit"
    )]
    TooManyGroups {
        /// Distinct allocations.
        needed: usize,
        /// CLOSIDs left after the root group.
        available: u32,
    },
}

enum LatencyReader {
    Push(PushListener),
    Prom(PromHistogram),
}

impl std::fmt::Debug for LatencyReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LatencyReader::Push(_) => "Push",
            LatencyReader::Prom(_) => "Prometheus",
        })
    }
}

#[derive(Debug)]
struct Service {
    spec: ServiceSpec,
    cfg: ServiceConfig,
    latency: Option<LatencyReader>,
    pids: BTreeSet<u32>,
    cpu_ticks: BTreeMap<u32, u64>,
    perf: Option<(CgroupCounters, PerfTotals)>,
    mon: Option<MonReading>,
    missing_logged: bool,
}

/// What this host offers, found once at start.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Capabilities {
    /// cgroup hierarchies, if any are usable for writing.
    pub cgroups: Option<Cgroups>,
    /// Controllers cohabit may write.
    pub writable: Vec<String>,
    /// resctrl, if mounted.
    pub resctrl: Option<cohabit_collectors::resctrl::ResctrlInfo>,
    /// Hardware counters.
    pub perf: PerfSupport,
}

/// A real Linux host driven by cohabit.
#[derive(Debug)]
pub struct RealHost {
    cfg: DaemonConfig,
    procfs: Procfs,
    cgroups: Option<Cgroups>,
    can_cpuset: bool,
    can_quota: bool,
    resctrl: Option<Resctrl>,
    perf: PerfSupport,
    gpus: Option<cohabit_collectors::nvml::Gpus>,
    gpu: super::gpu::GpuActuator,
    cpus: Vec<u32>,
    capacity: HostCapacity,
    services: Vec<Service>,
    originals: BTreeMap<u32, Vec<(u32, String, String)>>,
    plan: Plan,
    resctrl_groups: BTreeMap<String, String>,
    dry_run: bool,
    start: Instant,
    last_collect: Instant,
    bw: BandwidthRate,
    clk_tck: f64,
}

fn cgroup_name(group: &str) -> String {
    if group == BEST_EFFORT_GROUP {
        BEST_EFFORT_GROUP.to_string()
    } else {
        format!("lc-{group}")
    }
}

impl RealHost {
    /// Opens the host: finds what it offers (logging each missing resource once), binds the
    /// latency sources, and unless `dry_run` cleans what a crashed run left behind.
    pub fn open(cfg: DaemonConfig, dry_run: bool) -> Result<Self, HostError> {
        Self::open_with(cfg, dry_run, Arc::new(RealFs))
    }

    /// [`Self::open`] with resctrl reached through `resctrl_fs` (the kernel's, or a fake
    /// that validates like it in tests).
    pub fn open_with(
        cfg: DaemonConfig,
        dry_run: bool,
        resctrl_fs: Arc<dyn KernelFs>,
    ) -> Result<Self, HostError> {
        let procfs = Procfs::new(&cfg.paths.proc);
        let cgroups = Cgroups::detect(&cfg.paths)?;
        let writable = cgroups
            .as_ref()
            .map(Cgroups::writable_controllers)
            .unwrap_or_default();
        let can_cpuset = cgroups.as_ref().is_some_and(Cgroups::has_cpuset)
            && writable.iter().any(|c| c == "cpuset");
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
        let resctrl = match Resctrl::discover(&cfg.paths, resctrl_fs) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "resctrl unreadable; LLC ways and MBA will not be applied");
                None
            }
        };
        if resctrl.is_none() {
            tracing::warn!("resctrl is not mounted; LLC ways, MBA and RDT monitoring are skipped");
        }
        let perf = perf::probe();
        if let PerfSupport::Unsupported(why) = &perf {
            tracing::warn!("{why}; IPC and LLC misses will be reported as absent");
        }
        let gpus = match cohabit_collectors::nvml::Gpus::open() {
            Ok(g) => Some(g),
            Err(e) => {
                tracing::warn!("{e}; GPU telemetry is absent");
                None
            }
        };
        let wants_gpu = cfg.services.iter().any(|s| s.gpu.is_some());
        let mps = if cfg.mps.control.exists() {
            Some(cohabit_collectors::mps::MpsControl::new(
                &cfg.mps.control,
                cfg.mps.pipe_dir.clone(),
            ))
        } else {
            if wants_gpu {
                tracing::warn!(control = %cfg.mps.control.display(), "no MPS control program; GPU shares go to environment files only");
            }
            None
        };
        let gpu = super::gpu::GpuActuator::new(&cfg.services, mps);
        if let (false, Some(limit)) = (dry_run, &cfg.mps.pinned_mem_limit) {
            gpu.apply_pinned_default(limit);
        }
        let gpu_caps: Vec<cohabit_core::GpuCapacity> = match (&gpus, cfg.gpus) {
            (Some(g), _) => g
                .info()
                .iter()
                .map(|i| cohabit_core::GpuCapacity {
                    name: i.name.clone(),
                    sms: 1,
                })
                .collect(),
            (None, Some(n)) => (0..n)
                .map(|i| cohabit_core::GpuCapacity {
                    name: format!("GPU {i} (configured)"),
                    sms: 1,
                })
                .collect(),
            (None, None) => vec![],
        };
        let cpus = match &cfg.cpus {
            Some(c) => c.0.clone(),
            None => online_cpus(&cfg.paths.sys),
        };
        let ways = resctrl
            .as_ref()
            .and_then(|r| r.info().l3.as_ref().map(|l| l.ways()))
            .unwrap_or(1);
        let capacity = HostCapacity {
            name: cfg.host_name.clone(),
            cores: u32::try_from(cpus.len()).unwrap_or(u32::MAX).max(1),
            freq_ghz: cpu_freq_ghz(&cfg.paths.sys),
            llc_ways: ways,
            llc_way_bytes: llc_bytes(&cfg.paths.sys) / u64::from(ways),
            mem_bw_bytes_per_s: cfg.mem_bw_gbps.unwrap_or(100.0) * 1e9,
            gpus: gpu_caps,
            closids: 16,
            mba_min_pct: 10,
            mba_gran_pct: 10,
        };
        let mut services = Vec::new();
        for s in &cfg.services {
            let latency = match &s.latency {
                Some(LatencySource::Push(addr)) => Some(LatencyReader::Push(
                    PushListener::bind(addr).map_err(|e| HostError::Latency {
                        service: s.name.clone(),
                        source: e,
                    })?,
                )),
                Some(LatencySource::Prometheus {
                    url,
                    metric,
                    unit_seconds,
                }) => Some(LatencyReader::Prom(PromHistogram::new(
                    url,
                    metric,
                    *unit_seconds,
                    std::time::Duration::from_millis(cfg.collect_timeout_ms),
                ))),
                None => None,
            };
            let class = match s.p99_target_ms {
                Some(t) => ServiceClass::LatencyCritical { p99_target_ms: t },
                None => ServiceClass::BestEffort,
            };
            services.push(Service {
                spec: ServiceSpec {
                    name: s.name.clone(),
                    class,
                    gpu: s.gpu.as_ref().map(|g| g.index),
                },
                cfg: s.clone(),
                latency,
                pids: BTreeSet::new(),
                cpu_ticks: BTreeMap::new(),
                perf: None,
                mon: None,
                missing_logged: false,
            });
        }
        let placeholder = Allocation {
            cores: 0,
            llc_ways: cohabit_core::WayRange::new(0, ways),
            mba_pct: 100,
            gpu_mps_pct: None,
        };
        let now = Instant::now();
        let host = Self {
            clk_tck: clock_ticks(),
            cfg,
            procfs,
            cgroups: cgroups.filter(|_| can_cpuset || can_quota),
            can_cpuset,
            can_quota,
            resctrl,
            perf,
            gpus,
            gpu,
            cpus,
            capacity,
            services,
            originals: BTreeMap::new(),
            plan: Plan {
                services: BTreeMap::new(),
                best_effort: placeholder,
            },
            resctrl_groups: BTreeMap::new(),
            dry_run,
            start: now,
            last_collect: now,
            bw: BandwidthRate {
                dropped: 0,
                max_bytes_per_s: 0.0,
            },
        };
        let mut host = host;
        host.bw.max_bytes_per_s = host.capacity.mem_bw_bytes_per_s * 4.0;
        if !dry_run {
            host.clean_leftovers();
        }
        Ok(host)
    }

    /// What the host offers.
    pub fn capabilities(&self) -> Capabilities {
        Capabilities {
            writable: self
                .cgroups
                .as_ref()
                .map(Cgroups::writable_controllers)
                .unwrap_or_default(),
            cgroups: self.cgroups.clone(),
            resctrl: self.resctrl.as_ref().map(|r| r.info().clone()),
            perf: self.perf.clone(),
        }
    }

    /// The capacity policies plan for.
    pub fn capacity(&self) -> &HostCapacity {
        &self.capacity
    }

    /// The services and jobs, latency-critical first.
    pub fn specs(&self) -> Vec<ServiceSpec> {
        self.services.iter().map(|s| s.spec.clone()).collect()
    }

    fn clean_leftovers(&mut self) {
        if let Some(cg) = &self.cgroups {
            for g in cg.leftovers() {
                let moved = cg.evacuate(&g).unwrap_or(0);
                match cg.remove(&g) {
                    Ok(()) => {
                        tracing::warn!(group = %g, moved, "removed a cgroup a previous run left behind")
                    }
                    Err(e) => {
                        tracing::warn!(group = %g, error = %e, "could not remove a cgroup a previous run left behind")
                    }
                }
            }
        }
        if let Some(r) = &self.resctrl {
            for g in r.own_groups().unwrap_or_default() {
                match r.remove_group(&g) {
                    Ok(()) => {
                        tracing::warn!(group = %g, "removed a resctrl group a previous run left behind")
                    }
                    Err(e) => {
                        tracing::warn!(group = %g, error = %e, "could not remove a resctrl group a previous run left behind")
                    }
                }
            }
        }
    }

    /// Applies the first plan and starts managing processes.
    pub fn launch(&mut self, plan: &Plan) -> Result<(), HostError> {
        let changes = self.plan.diff(plan);
        self.apply_plan(plan, &changes)?;
        self.refresh_processes();
        Ok(())
    }

    fn find_pids(&self, m: &Matcher) -> Vec<u32> {
        match m {
            Matcher::ProcessName(n) => self.procfs.pids_named(n).unwrap_or_default(),
            Matcher::PidFile(p) => std::fs::read_to_string(p)
                .ok()
                .and_then(|t| t.trim().parse::<u32>().ok())
                .filter(|pid| self.procfs.alive(*pid))
                .into_iter()
                .collect(),
            Matcher::Cgroup(path) => self
                .cgroups_any()
                .map(|c| c.processes_at(path))
                .unwrap_or_default(),
            Matcher::SystemdUnit(unit) => self
                .cgroups_any()
                .map(|c| {
                    let mut v = c.processes_at(&format!("/system.slice/{unit}"));
                    if v.is_empty() {
                        v = c.processes_at(&format!("/systemd/system.slice/{unit}"));
                    }
                    v
                })
                .unwrap_or_default(),
        }
    }

    fn cgroups_any(&self) -> Option<Cgroups> {
        self.cgroups
            .clone()
            .or_else(|| Cgroups::detect(&self.cfg.paths).ok().flatten())
    }

    /// Finds each service's processes; puts new ones in its cgroup (remembering where they
    /// were) and its resctrl group; forgets vanished ones.
    fn refresh_processes(&mut self) {
        for i in 0..self.services.len() {
            let found: BTreeSet<u32> = self
                .find_pids(&self.services[i].cfg.matcher)
                .into_iter()
                .collect();
            let svc = &self.services[i];
            let name = svc.spec.name.clone();
            let group = if svc.spec.is_latency_critical() {
                name.clone()
            } else {
                BEST_EFFORT_GROUP.to_string()
            };
            if found.is_empty() && !svc.missing_logged {
                tracing::warn!(service = %name, "no process found; its telemetry is absent until one appears");
            }
            for gone in svc.pids.difference(&found) {
                tracing::info!(service = %name, pid = gone, "process vanished");
            }
            let new: Vec<u32> = found.difference(&svc.pids).copied().collect();
            if !self.dry_run {
                for &pid in &new {
                    if let (Some(cg), Some(orig)) = (&self.cgroups, self.procfs.cgroups(pid)) {
                        match cg.add_process(&cgroup_name(&group), pid) {
                            Ok(true) => {
                                self.originals.entry(pid).or_insert(orig);
                            }
                            Ok(false) => {}
                            Err(e) => {
                                tracing::warn!(service = %name, pid, error = %e, "could not move process into its cgroup")
                            }
                        }
                    }
                }
                if let (Some(r), Some(rg)) = (&self.resctrl, self.resctrl_groups.get(&group)) {
                    let tids: Vec<u32> =
                        found.iter().flat_map(|p| self.procfs.threads(*p)).collect();
                    let present: BTreeSet<u32> =
                        r.tasks(Some(rg)).unwrap_or_default().into_iter().collect();
                    let missing: Vec<u32> =
                        tids.into_iter().filter(|t| !present.contains(t)).collect();
                    if let Err(e) = r.move_tasks(Some(rg), &missing) {
                        tracing::warn!(service = %name, error = %e, "could not move threads into the resctrl group");
                    }
                }
            }
            let svc = &mut self.services[i];
            svc.missing_logged = found.is_empty();
            svc.cpu_ticks.retain(|p, _| found.contains(p));
            svc.pids = found;
        }
    }

    /// The CPU list of each group: latency-critical services get consecutive blocks in
    /// configuration order, the pool the rest. A pool with no cores shares the last CPU.
    fn cpu_layout(&self, plan: &Plan) -> BTreeMap<String, CpuList> {
        let mut out = BTreeMap::new();
        let mut next = 0usize;
        for s in self
            .services
            .iter()
            .filter(|s| s.spec.is_latency_critical())
        {
            let n = plan
                .services
                .get(&s.spec.name)
                .map_or(0, |a| a.cores as usize);
            let end = (next + n.max(1)).min(self.cpus.len());
            out.insert(
                s.spec.name.clone(),
                CpuList(self.cpus[next.min(end.saturating_sub(1))..end].to_vec()),
            );
            next = end;
        }
        let rest: Vec<u32> = if next < self.cpus.len() {
            self.cpus[next..].to_vec()
        } else {
            self.cpus.last().copied().into_iter().collect()
        };
        out.insert(BEST_EFFORT_GROUP.to_string(), CpuList(rest));
        out
    }

    fn apply_plan(&mut self, plan: &Plan, changes: &[Change]) -> Result<(), HostError> {
        if self.dry_run {
            return Ok(());
        }
        let touched: BTreeSet<&str> = changes.iter().map(|c| c.group.as_str()).collect();
        // resctrl first: the write most likely to be refused, before anything else moves.
        if let Some(r) = &self.resctrl {
            let mut by_alloc: BTreeMap<(u32, u32, u8), Vec<&str>> = BTreeMap::new();
            for (g, a) in plan.groups() {
                by_alloc
                    .entry((a.llc_ways.first, a.llc_ways.count, a.mba_pct))
                    .or_default()
                    .push(g);
            }
            let available = r.info().num_closids().saturating_sub(1);
            if by_alloc.len() > available as usize {
                return Err(HostError::TooManyGroups {
                    needed: by_alloc.len(),
                    available,
                });
            }
            let mut groups = BTreeMap::new();
            for members in by_alloc.values() {
                // Groups with equal allocations share one CLOSID, named after the first.
                let name = format!("{GROUP_PREFIX}{}", members[0]);
                r.ensure_group(&name)?;
                if let Some(a) = plan.get(members[0]) {
                    r.apply(&name, &r.schemata_for(a))?;
                }
                for m in members {
                    groups.insert((*m).to_string(), name.clone());
                }
            }
            let unused: Vec<String> = self
                .resctrl_groups
                .values()
                .filter(|g| !groups.values().any(|n| n == *g))
                .cloned()
                .collect();
            self.resctrl_groups = groups;
            for g in unused {
                let _ = r.remove_group(&g);
            }
        }
        if let Some(cg) = &self.cgroups {
            let layout = self.cpu_layout(plan);
            let existing = cg.leftovers();
            for (group, alloc) in plan.groups() {
                let name = cgroup_name(group);
                let fresh = !existing.contains(&name);
                if fresh {
                    cg.create(&name)?;
                }
                if !(fresh || touched.contains(group)) {
                    continue;
                }
                if self.can_cpuset {
                    if let Some(cpus) = layout.get(group) {
                        cg.set_cpus(&name, cpus)?;
                    }
                }
                if self.can_quota {
                    // With CPU sets the set is the limit, except a pool with no cores,
                    // which is throttled hard; without them the quota is the allocation.
                    let quota = match (self.can_cpuset, alloc.cores) {
                        (true, 0) => Some(0.05),
                        (true, _) => None,
                        (false, 0) => Some(0.05),
                        (false, c) => Some(f64::from(c)),
                    };
                    cg.set_quota(&name, quota)?;
                }
            }
        }
        let pinned = self.cfg.mps.pinned_mem_limit.clone();
        for s in &self.services {
            if !self.gpu.manages(&s.spec.name) {
                continue;
            }
            let alloc = if s.spec.is_latency_critical() {
                plan.services.get(&s.spec.name)
            } else {
                Some(&plan.best_effort)
            };
            if let Some(pct) = alloc.and_then(|a| a.gpu_mps_pct) {
                self.gpu
                    .publish(&s.spec.name, pct, pinned.as_deref())
                    .map_err(HostError::Gpu)?;
            }
        }
        self.plan = plan.clone();
        Ok(())
    }

    /// Puts every process back where it was and removes every group cohabit created.
    pub fn restore(&mut self) {
        if self.dry_run {
            return;
        }
        let mut restored = 0;
        if let Some(cg) = &self.cgroups {
            for (pid, orig) in std::mem::take(&mut self.originals) {
                match cg.restore_process(pid, &orig) {
                    Ok(true) => restored += 1,
                    Ok(false) => {}
                    Err(e) => {
                        tracing::warn!(pid, error = %e, "could not put a process back in its cgroup")
                    }
                }
            }
            for g in cg.leftovers() {
                let _ = cg.evacuate(&g);
                if let Err(e) = cg.remove(&g) {
                    tracing::warn!(group = %g, error = %e, "could not remove cgroup");
                }
            }
            cg.remove_parent();
        }
        if let Some(r) = &self.resctrl {
            for g in r.own_groups().unwrap_or_default() {
                if let Err(e) = r.remove_group(&g) {
                    tracing::warn!(group = %g, error = %e, "could not remove resctrl group");
                }
            }
        }
        self.gpu.restore();
        tracing::info!(restored, "host restored");
    }

    fn sample(&mut self, i: usize, dt_s: f64) -> Sample {
        let mut s = Sample::default();
        let svc = &mut self.services[i];
        if !svc.pids.is_empty() {
            let mut ticks_delta = 0u64;
            let mut have_prev = false;
            let mut rss = 0u64;
            for &pid in &svc.pids {
                if let Some(st) = self.procfs.stat(pid) {
                    if let Some(prev) = svc.cpu_ticks.insert(pid, st.cpu_ticks) {
                        ticks_delta += st.cpu_ticks.saturating_sub(prev);
                        have_prev = true;
                    }
                    rss += st.rss_bytes;
                }
            }
            if have_prev && dt_s > 0.0 {
                s.cpu_busy_cores = Some(ticks_delta as f64 / self.clk_tck / dt_s);
            }
            s.memory_bytes = Some(rss as f64);
        }
        let group = if svc.spec.is_latency_critical() {
            svc.spec.name.clone()
        } else {
            BEST_EFFORT_GROUP.to_string()
        };
        if let (PerfSupport::Supported, Some(cg), false) = (&self.perf, &self.cgroups, self.dry_run)
        {
            if svc.perf.is_none() {
                let dir = match cg.version {
                    Version::V1 => cg
                        .mounts
                        .get("perf_event")
                        .map(|m| m.join("cohabit").join(cgroup_name(&group))),
                    Version::V2 => cg
                        .mounts
                        .get("unified")
                        .map(|m| m.join("cohabit").join(cgroup_name(&group))),
                };
                let cpus: Vec<usize> = self.cpus.iter().map(|c| *c as usize).collect();
                if let Some(Ok(mut c)) = dir.map(|d| CgroupCounters::open(&d, &cpus)) {
                    if let Ok(t) = c.read() {
                        svc.perf = Some((c, t));
                    }
                }
            } else if let Some((c, prev)) = &mut svc.perf {
                if let Ok(t) = c.read() {
                    let (ipc, mps) = PerfTotals::rates(prev, &t, dt_s);
                    s.ipc = ipc;
                    s.llc_misses_per_s = mps;
                    *prev = t;
                }
            }
        }
        if let (Some(r), Some(rg)) = (&self.resctrl, self.resctrl_groups.get(&group)) {
            if let Ok(cur) = r.read_mon(Some(rg)) {
                s.llc_occupancy_bytes = cur.llc_occupancy_bytes.map(|v| v as f64);
                if let Some(prev) = &svc.mon {
                    s.mem_bw_bytes_per_s = self.bw.rate(prev, &cur, dt_s);
                }
                svc.mon = Some(cur);
            }
        }
        match &mut svc.latency {
            Some(LatencyReader::Push(l)) => {
                let w = l.take();
                s.p99_ms = w.p99_ms;
                s.requests_per_s = (dt_s > 0.0).then(|| w.count as f64 / dt_s);
            }
            Some(LatencyReader::Prom(p)) => match p.poll() {
                Ok(Some((p99, n))) => {
                    s.p99_ms = Some(p99);
                    s.requests_per_s = (dt_s > 0.0).then(|| n / dt_s);
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(service = %svc.spec.name, error = %e, "latency unavailable this tick")
                }
            },
            None => {}
        }
        s
    }
}

impl Collector for RealHost {
    type Error = HostError;

    fn collect(&mut self) -> Result<Observation, HostError> {
        let now = Instant::now();
        let dt_s = now.duration_since(self.last_collect).as_secs_f64();
        self.last_collect = now;
        self.refresh_processes();
        if !self.dry_run {
            let pids: BTreeMap<String, Vec<u32>> = self
                .services
                .iter()
                .map(|s| (s.spec.name.clone(), s.pids.iter().copied().collect()))
                .collect();
            self.gpu.restart_due(now, &pids);
        }
        let readings = self.gpus.as_mut().map(cohabit_collectors::nvml::Gpus::read);
        let services = (0..self.services.len())
            .map(|i| {
                let mut sample = self.sample(i, dt_s);
                let svc = &self.services[i];
                if let (Some(r), Some(g)) = (&readings, svc.spec.gpu) {
                    let util: Vec<f64> = r
                        .get(g as usize)
                        .map(|r| {
                            svc.pids
                                .iter()
                                .filter_map(|p| r.process_sm_util_pct.get(p).copied())
                                .collect()
                        })
                        .unwrap_or_default();
                    sample.gpu_util_pct =
                        (!util.is_empty()).then(|| util.iter().sum::<f64>().min(100.0));
                }
                ServiceObservation {
                    sample,
                    spec: svc.spec.clone(),
                    gpu_mps_effective_pct: self.gpu.effective(&svc.spec.name),
                }
            })
            .collect();
        let t_ms = u64::try_from(now.duration_since(self.start).as_millis()).unwrap_or(u64::MAX);
        Ok(Observation {
            t_ms,
            services,
            current: self.plan.clone(),
        })
    }
}

impl Actuator for RealHost {
    type Error = HostError;

    fn apply(&mut self, plan: &Plan, changes: &[Change]) -> Result<(), HostError> {
        self.apply_plan(plan, changes)
    }
}

/// Online CPUs from `<sys>/devices/system/cpu/online`, or CPU 0 alone.
pub fn online_cpus(sys: &std::path::Path) -> Vec<u32> {
    std::fs::read_to_string(sys.join("devices/system/cpu/online"))
        .ok()
        .and_then(|t| t.parse::<CpuList>().ok())
        .map(|c| c.0)
        .filter(|c| !c.is_empty())
        .unwrap_or_else(|| vec![0])
}

fn cpu_freq_ghz(sys: &std::path::Path) -> f64 {
    std::fs::read_to_string(sys.join("devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq"))
        .ok()
        .and_then(|t| t.trim().parse::<f64>().ok())
        .map_or(2.0, |khz| khz / 1e6)
}

fn llc_bytes(sys: &std::path::Path) -> u64 {
    let text = std::fs::read_to_string(sys.join("devices/system/cpu/cpu0/cache/index3/size"))
        .unwrap_or_default();
    let t = text.trim();
    let (num, mult) = match t.strip_suffix('K') {
        Some(n) => (n, 1024),
        None => t.strip_suffix('M').map_or((t, 1), |n| (n, 1024 * 1024)),
    };
    num.parse::<u64>().map_or(32 << 20, |v| v * mult)
}

#[allow(unsafe_code)]
fn clock_ticks() -> f64 {
    // SAFETY: sysconf has no preconditions and only reads a configuration value.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

#[cfg(test)]
mod tests {
    use cohabit_collectors::resctrl::fake::FakeResctrl;

    use super::*;
    use cohabit_core::ApplyOutcome;
    use cohabit_policy::control;
    use cohabit_policy::{HostContext, Policy, StaticPolicy};

    /// The fixture's proc tree has no cgroup mounts and no processes: only resctrl (the fake)
    /// is touched, never this machine's cgroups.
    fn config(fake: &FakeResctrl, pid_file: &std::path::Path) -> DaemonConfig {
        let text = format!(
            "interval_ms = 100\n[paths]\nresctrl = \"{}\"\nproc = \"{}\"\n[[service]]\nname = \"kv\"\np99_target_ms = 1\nmatch = {{ pid_file = \"{}\" }}\nlatency = {{ push = \"127.0.0.1:0\" }}\n[[best_effort]]\nname = \"batch\"\nmatch = {{ process_name = \"no-such-process\" }}\n",
            fake.root().display(),
            fake.base().join("proc").display(),
            pid_file.display()
        );
        DaemonConfig::parse(&text, "test.toml").unwrap()
    }

    #[test]
    fn allocations_become_resctrl_groups_and_a_rejected_write_keeps_the_daemon_going() {
        // The fake kernel needs 3 ways per mask but tells us 1: every narrow mask is refused.
        let fake = FakeResctrl::builder()
            .ways(12)
            .min_cbm_bits(3)
            .build()
            .unwrap();
        std::fs::write(fake.root().join("info/L3/min_cbm_bits"), "1\n").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let pid_file = dir.path().join("kv.pid");
        std::fs::write(&pid_file, std::process::id().to_string()).unwrap();
        let mut host =
            RealHost::open_with(config(&fake, &pid_file), false, Arc::new(fake.clone())).unwrap();
        assert_eq!(host.capacity().llc_ways, 12);
        let ctx = HostContext {
            host: host.capacity().clone(),
            specs: host.specs(),
        };
        let mut policy = StaticPolicy::new(ctx);
        let plan = policy.initial().plan;
        // Fair share: 6 ways each; wide enough for the fake.
        host.launch(&plan).unwrap();
        let groups: Vec<String> = std::fs::read_dir(fake.root())
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().to_str().map(str::to_string))
            .filter(|n| n.starts_with(GROUP_PREFIX))
            .collect();
        assert_eq!(groups.len(), 2, "{groups:?}");
        let kv = std::fs::read_to_string(fake.root().join("cohabit-kv/schemata")).unwrap();
        assert!(kv.contains("L3:0=3f"), "{kv}");

        // A plan with a one-way mask: the kernel refuses, the host keeps its state.
        struct Narrow(StaticPolicy);
        impl Policy for Narrow {
            fn name(&self) -> &'static str {
                "narrow"
            }
            fn initial(&mut self) -> cohabit_policy::Decision {
                self.0.initial()
            }
            fn decide(
                &mut self,
                obs: &cohabit_core::Observation,
                now: u64,
            ) -> cohabit_policy::Decision {
                let mut d = self.0.decide(obs, now);
                if let Some(a) = d.plan.services.get_mut("kv") {
                    a.llc_ways.count = 1;
                }
                d
            }
        }
        let ctx = HostContext {
            host: host.capacity().clone(),
            specs: host.specs(),
        };
        let mut narrow = Narrow(StaticPolicy::new(ctx));
        let rec = control::step(&mut host, &mut narrow, false).unwrap();
        let Some(ApplyOutcome::Refused { error }) = &rec.apply else {
            panic!("the narrow plan was applied: {:?}", rec.apply);
        };
        assert!(error.contains("Need at least 3 bits"), "{error}");
        assert_eq!(rec.plan, plan, "the last good plan stays in force");
        assert!(
            std::fs::read_to_string(fake.root().join("cohabit-kv/schemata"))
                .unwrap()
                .contains("L3:0=3f")
        );
        // The loop goes on.
        let again = control::step(&mut host, &mut narrow, false).unwrap();
        assert!(matches!(again.apply, Some(ApplyOutcome::Refused { .. })));
        host.restore();
        assert!(!fake.root().join("cohabit-kv").exists());
    }
}
