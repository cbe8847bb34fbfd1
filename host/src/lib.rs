//! The real host behind the controller's [`Collector`] and [`Actuator`] traits.
//!
//! It is opened from a [`HostSpec`] (what to manage, where the kernel's interfaces are, the
//! services), never from the daemon's configuration, which only builds one. The daemon keeps
//! the runtime around it: the loop, signals, the state file, the decision log, metrics and
//! pods.
//!
//! Plan, then apply: a plan becomes CPU sets and quotas (cgroups) and, where the host has
//! RDT, control groups with masks and MBA values (resctrl), written only where they
//! differ from what the kernel holds. CPU values go into the cgroups the services'
//! processes already are in (their owners'), and processes stay there unless configured
//! otherwise (`placement`). Everything changed is recorded, write-ahead, in a
//! [`changes::HostChanges`] kept through a [`changes::ChangeLog`]: on [`RealHost::restore`]
//! (or, after a crash, from the saved record alone, [`RealHost::restore_changes`]) every
//! original value comes back, every moved process goes back and every group cohabit
//! created is removed. On launch, groups a run left without a record are cleaned first. A
//! resource the host lacks is skipped with one log line.
//!
//! This module only composes; each job has its own:
//! - [`spec`]: what the host is asked to manage, typed;
//! - [`discover`]: what the host offers, once at start ([`HostFacts`]);
//! - [`layout`]: plan + facts → every value to write ([`HostWrites`]), pure;
//! - `placement`: which cgroups each plan group's values go to, and which processes move;
//! - `apply`: those writes → the kernel in a safe order, rolled back when a later write
//!   fails, so the host and the plan in force never disagree; processes join afterwards.
//!   One journal drives a module per interface (resctrl, cgroups, GPU shares); the
//!   processes' moves and the restore from the record alone have modules of their own;
//! - `sample`: raw readings → [`Sample`](cohabit_core::Sample), rates from two readings;
//!   each p99 merges the requests of the last `latency_window` intervals, a window that
//!   starts afresh when an interval ran under something else than the window's did
//!   ([`RunsUnder`]: the plan in force, the GPU share in effect, a client's restart), when
//!   its load moves (both [`cohabit_core::window`]'s rule, the simulator's too), and after
//!   the fail-safe's plan and a restore;
//! - [`gpu`]: GPU shares (environment files, MPS mechanisms, pinned memory) and, through
//!   `hook`, the restart hooks that apply them; [`files`]: files root writes outside the
//!   kernel's trees; [`fds`]: descriptors kept for restoring at the open-files limit.

pub mod changes;
pub mod discover;
pub mod fds;
pub mod files;
pub mod gpu;
pub mod layout;
mod placement;
pub mod reach;
#[cfg(test)]
mod real_tests;
pub mod spec;
#[cfg(any(test, feature = "testutils"))]
pub mod testing;

mod apply;
mod find;
mod hook;
mod sample;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cohabit_collectors::cgroup::Cgroups;
use cohabit_collectors::kfs::{KernelFs, RealFs};
use cohabit_collectors::latency::PushRejections;
use cohabit_collectors::nvml::Gpus;
use cohabit_collectors::perf::PerfSupport;
use cohabit_collectors::procfs::{ProcIndex, Procfs};
use cohabit_collectors::resctrl::BandwidthRate;
use cohabit_collectors::HostPaths;
use cohabit_core::{
    Actuator, Allocation, Change, Collector, GroupControl, HostCapacity, Observation, Plan,
    RunsUnder, ServiceClass, ServiceObservation, ServiceSpec,
};

pub use self::apply::{restore_changes, Kernel};
use self::apply::{Members, Record};
use self::changes::{ChangeLog, HostChanges};
pub use self::discover::HostFacts;
pub use self::layout::{HostWrites, TooManyGroups};
use self::placement::{ServicePlacement, Targets};
use self::sample::{PerfAccess, Sources, Telemetry};
use crate::spec::{HostSpec, ManagedService, Matcher};

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
    /// A configured user or group does not exist.
    #[error("{service}: {source}")]
    User {
        /// Service.
        service: String,
        /// Why.
        source: cohabit_collectors::users::UserError,
    },
    /// A latency probe could not be started (its service did not answer, or the thread).
    /// The probe's error is part of the message, not a `source`, so a printed error chain
    /// says it once.
    #[error("latency probe of {service}: {error}")]
    Probe {
        /// Service.
        service: String,
        /// Why (it names the URL).
        error: cohabit_collectors::probe::ProbeError,
    },
    /// A GPU share could not be published.
    #[error("GPU share: {0}")]
    Gpu(#[from] crate::gpu::GpuError),
    /// The plan needs more resctrl groups than the host has CLOSIDs.
    #[error(transparent)]
    TooManyGroups(#[from] TooManyGroups),
    /// The record of changes could not be saved, so the write it describes was not made.
    #[error("saving the record of changes: {0}")]
    ChangeLog(std::io::Error),
    /// A service is found by process name or pid file without `match.user` (not a dry run).
    #[error(transparent)]
    Unbound(#[from] crate::spec::UnboundMatcher),
    /// `[host] cpus` or the services do not fit the host's CPUs.
    #[error(transparent)]
    Cpus(#[from] discover::CpuError),
    /// A service would be controlled in no way, and its table does not allow it.
    #[error(transparent)]
    Uncontrolled(#[from] reach::Uncontrolled),
}

/// How often a warning that could fire every tick is repeated.
const WARN_EVERY: Duration = Duration::from_secs(60);

/// Rate-limits warnings that could fire every tick (STYLE 10): each key at most once per
/// [`WARN_EVERY`].
#[derive(Debug, Default)]
struct WarnLimit {
    last: HashMap<String, Instant>,
}

impl WarnLimit {
    /// True if a warning under `key` may be logged now.
    fn allow(&mut self, key: &str) -> bool {
        let now = Instant::now();
        match self.last.get(key) {
            Some(t) if now.duration_since(*t) < WARN_EVERY => false,
            _ => {
                self.last.insert(key.to_string(), now);
                true
            }
        }
    }
}

/// One configured service or best-effort job.
#[derive(Debug)]
struct Service {
    spec: ServiceSpec,
    cfg: ManagedService,
    pids: BTreeSet<u32>,
    telemetry: Telemetry,
    missing_logged: bool,
    /// Controllers for which a process of it was left alone, already logged.
    unplaced_logged: BTreeSet<cohabit_collectors::cgroup::Controller>,
    vetting: find::Vetting,
    /// What the intervals in its latency window ran under (`None`: no plan was in force).
    runs_under: Option<RunsUnder>,
    /// The last interval's plan changed within it: the next starts a window of its own.
    after_mixed: bool,
}

impl Service {
    /// A service as configured, its latency source bound with a window of `window`
    /// intervals, no process found yet.
    fn bind(s: &ManagedService, timeout: Duration, window: u32) -> Result<Self, HostError> {
        Ok(Service {
            spec: spec_of(s),
            cfg: s.clone(),
            pids: BTreeSet::new(),
            telemetry: Telemetry::bind(s, timeout, window)?,
            missing_logged: false,
            unplaced_logged: BTreeSet::new(),
            vetting: find::Vetting::new(&s.constraint).map_err(|source| HostError::User {
                service: s.name.clone(),
                source,
            })?,
            runs_under: None,
            after_mixed: false,
        })
    }
}

/// A real Linux host driven by cohabit.
#[derive(Debug)]
pub struct RealHost {
    spec: HostSpec,
    facts: HostFacts,
    procfs: Procfs,
    kernel: Kernel,
    gpus: Option<Gpus>,
    gpu: crate::gpu::GpuActuator,
    services: Vec<Service>,
    record: Record,
    /// A plan has been applied (until then no value is in force, and nothing moves).
    applied: bool,
    plan: Plan,
    /// The plan the interval since the last collect opened under: the first applied after
    /// that collect, else the one in force then (`None`: none). A plan applied later in the
    /// interval (the Kubernetes agent's, for new pods, just before the next collect) makes
    /// it a mixed interval.
    opening_plan: Option<Plan>,
    /// A plan was applied since the last collect (`opening_plan` is it).
    opened: bool,
    dry_run: bool,
    start: Instant,
    last_collect: Instant,
    bw: BandwidthRate,
    warn: WarnLimit,
    /// The last tick's process index (name matchers), and when /proc was last read whole.
    proc_index: ProcIndex,
    last_full_scan: Option<Instant>,
    /// How counters are opened and the file descriptors they may take.
    perf: PerfAccess,
}

/// How often name matchers read every process's `stat` again (between, only new pids are
/// read: a process that renames itself or `exec`s is seen within this time).
const FULL_SCAN_EVERY: Duration = Duration::from_secs(1);

impl RealHost {
    /// Opens the host: finds what it offers (logging each missing resource once) and binds
    /// the latency sources (a probe must answer its first request). Nothing is written
    /// before [`Self::launch`], so a record a crashed run left can be restored first
    /// ([`Self::restore_changes`]).
    pub fn open(spec: HostSpec, dry_run: bool) -> Result<Self, HostError> {
        Self::open_with(spec, dry_run, Arc::new(RealFs))
    }

    /// [`Self::open`] with resctrl reached through `resctrl_fs` (the kernel's, or a fake
    /// that validates like it in tests).
    pub fn open_with(
        spec: HostSpec,
        dry_run: bool,
        resctrl_fs: Arc<dyn KernelFs>,
    ) -> Result<Self, HostError> {
        find::require_users(&spec.services, dry_run)?;
        let mut found = discover::discover(&spec, resctrl_fs)?;
        let gpu = crate::gpu::GpuActuator::with_probe(&spec.services, found.mps);
        // Policies weigh what a share change costs on this host.
        for g in &mut found.facts.capacity.gpus {
            g.share_change = gpu.share_change();
        }
        if let (false, Some(limit)) = (dry_run, &spec.mps.pinned_mem_limit) {
            gpu.apply_pinned_default(limit);
        }
        let timeout = Duration::from_millis(spec.collect_timeout_ms);
        let services = spec
            .services
            .iter()
            .map(|s| Service::bind(s, timeout, spec.latency_window))
            .collect::<Result<Vec<_>, HostError>>()?;
        // The configuration file's services answer their probes before the daemon starts
        // (a wrong port or a service that is down is an error the operator sees now). The
        // probes run at once, so this waits at most the longest time-out; pods' probes,
        // bound inside the tick, are never waited for.
        for s in &services {
            s.telemetry
                .first_probe_answer()
                .map_err(|error| HostError::Probe {
                    service: s.spec.name.clone(),
                    error,
                })?;
        }
        let ways = found.facts.capacity.llc_ways;
        let now = Instant::now();
        let host = Self {
            procfs: Procfs::new(&spec.paths.proc),
            bw: BandwidthRate {
                dropped: 0,
                max_bytes_per_s: found.facts.capacity.mem_bw_bytes_per_s * 4.0,
            },
            spec,
            facts: found.facts,
            kernel: Kernel {
                cgroups: found.cgroups,
                resctrl: found.resctrl,
            },
            gpus: found.gpus,
            gpu,
            services,
            record: Record::default(),
            applied: false,
            // Until the first plan is applied, nothing is in force.
            plan: Plan {
                services: BTreeMap::new(),
                best_effort: Allocation {
                    cores: 0,
                    llc_ways: cohabit_core::WayRange::new(0, ways),
                    mba_pct: 100,
                    gpu_mps_pct: None,
                },
                gpu_memory_mib: Default::default(),
            },
            opening_plan: None,
            opened: false,
            dry_run,
            start: now,
            last_collect: now,
            warn: WarnLimit::default(),
            proc_index: ProcIndex::default(),
            last_full_scan: None,
            perf: PerfAccess::kernel(),
        };
        if matches!(host.facts.perf, PerfSupport::Supported) {
            let left = host.perf.budget.lock().map_or(0, |b| b.left());
            tracing::info!(
                fds = left,
                "file descriptors hardware counters may take (3 per CPU per group)"
            );
        }
        Ok(host)
    }

    /// What the host offers, found at open.
    pub fn facts(&self) -> &HostFacts {
        &self.facts
    }

    /// The capacity policies plan for.
    pub fn capacity(&self) -> &HostCapacity {
        &self.facts.capacity
    }

    /// The services and jobs, latency-critical first.
    pub fn specs(&self) -> Vec<ServiceSpec> {
        self.services.iter().map(|s| s.spec.clone()).collect()
    }

    /// The CPUs cohabit hands out.
    pub fn cpus(&self) -> &[u32] {
        &self.facts.cpus
    }

    /// Replaces the services and jobs, and the CPUs handed out (`[kubernetes]`: pods come
    /// and go; the kubelet gives some CPUs to single containers). A service configured as
    /// before keeps its telemetry and processes; a new one binds its latency source, and
    /// one that cannot is left out and returned with why. Binding never waits on a
    /// workload (this runs inside the control tick): a push socket is bound, a probe's
    /// thread started (it connects on its own), a scrape only set up. Nothing is written here: the next
    /// apply writes the new set's values, and the cgroups of services that left get their
    /// original values back then (see `apply`). The capacity follows the CPUs (and, without
    /// RDT allocation, the CLOSIDs the number of latency-critical services).
    pub fn reconfigure(
        &mut self,
        services: Vec<ManagedService>,
        cpus: Vec<u32>,
    ) -> Vec<(String, HostError)> {
        let timeout = Duration::from_millis(self.spec.collect_timeout_ms);
        let mut old = std::mem::take(&mut self.services);
        let mut failed = Vec::new();
        for s in services {
            if let Some(i) = old.iter().position(|o| o.cfg == s) {
                self.services.push(old.swap_remove(i));
                continue;
            }
            match Service::bind(&s, timeout, self.spec.latency_window) {
                Ok(svc) => self.services.push(svc),
                Err(e) => failed.push((s.name.clone(), e)),
            }
        }
        self.spec.services = self.services.iter().map(|s| s.cfg.clone()).collect();
        let latency_critical = self
            .services
            .iter()
            .filter(|s| s.spec.is_latency_critical())
            .count();
        self.facts.capacity.cores = u32::try_from(cpus.len()).unwrap_or(u32::MAX).max(1);
        self.facts.capacity.closids =
            discover::closids(self.facts.resctrl.as_ref(), latency_critical);
        self.facts.cpus = cpus;
        failed
    }

    /// The plan in force, once one has been applied.
    pub fn plan_in_force(&self) -> Option<&Plan> {
        self.applied.then_some(&self.plan)
    }

    /// Cleans what a run left without a record, finds the processes, applies the first
    /// plan and starts managing them. Refuses (before writing anything) a service whose
    /// processes no resource would reach, unless it allows that ([`reach::uncontrolled`]).
    pub fn launch(&mut self, plan: &Plan) -> Result<(), HostError> {
        if !self.dry_run {
            apply::clean_leftovers(&self.kernel);
        }
        self.refresh_processes();
        if !self.dry_run {
            self.uncontrolled()?;
        }
        self.apply_plan(plan)?;
        self.refresh_processes();
        Ok(())
    }

    /// Keeps the record of changes through `log` from now on (the state file), saving it
    /// at once.
    pub fn set_change_log(&mut self, log: Box<dyn ChangeLog>) -> Result<(), HostError> {
        self.record.set_log(log)
    }

    /// Every change cohabit has in force, with what was there before.
    pub fn changes(&self) -> &HostChanges {
        &self.record.changes
    }

    /// Puts the host back from `changes` alone (a crashed run's record); returns what could
    /// not be restored. See [`restore_changes`].
    pub fn restore_changes(&self, changes: &HostChanges) -> HostChanges {
        restore_changes(&self.kernel, changes, &self.procfs)
    }

    /// The controllers whose values cohabit writes on this host.
    fn controllers(&self) -> Vec<cohabit_collectors::cgroup::Controller> {
        use cohabit_collectors::cgroup::Controller;
        let mut out = Vec::new();
        if self.facts.can_cpuset {
            out.push(Controller::Cpuset);
        }
        if self.facts.can_quota {
            out.push(Controller::Cpu);
        }
        out
    }

    /// Where each service's processes get their values (in configuration order), and the
    /// cgroups of each plan group; logs each new reason a process is left alone once.
    fn targets(&mut self) -> (Targets, Vec<ServicePlacement>) {
        let Some(cg) = &self.kernel.cgroups else {
            return (Targets::new(), vec![]);
        };
        let placements = self.placements(cg);
        for (svc, p) in self.services.iter_mut().zip(&placements) {
            for (c, why) in &p.left {
                if svc.unplaced_logged.insert(*c) {
                    tracing::warn!(service = %svc.spec.name, controller = c.name(), "a process is left unmanaged for this controller: {why}");
                }
            }
        }
        let (targets, conflicts) = placement::group_targets(
            self.services
                .iter()
                .map(|s| layout::plan_group(&s.spec))
                .zip(&placements),
        );
        for (dir, kept, wanted) in conflicts {
            if self.warn.allow(&format!("claimed:{}", dir.display())) {
                tracing::warn!(cgroup = %dir.display(), kept = %kept, wanted = %wanted, "two groups' processes share a cgroup; it keeps the first group's values (logged once a minute)");
            }
        }
        (targets, placements)
    }

    /// Where each service's processes get their values now, in configuration order (read
    /// only: nothing logged, nothing written).
    fn placements(&self, cg: &Cgroups) -> Vec<ServicePlacement> {
        let controllers = self.controllers();
        self.services
            .iter()
            .map(|s| {
                let own = layout::cgroup_name(layout::plan_group(&s.spec));
                placement::place(
                    cg,
                    &self.procfs,
                    &s.pids,
                    &own,
                    s.cfg.placement,
                    &controllers,
                )
            })
            .collect()
    }

    /// Each service's processes and how each resource it is allocated reaches them, in
    /// configuration order ([`reach::service_control`]).
    fn service_controls(&self) -> Vec<GroupControl> {
        let placements = self
            .kernel
            .cgroups
            .as_ref()
            .map(|cg| self.placements(cg))
            .unwrap_or_default();
        let host = reach::HostControls::of(&self.facts, self.kernel.cgroups.is_some());
        self.services
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let p = placements.get(i).cloned().unwrap_or_default();
                let gpu = s.cfg.gpu.as_ref().map(|_| self.gpu.manages(&s.spec.name));
                GroupControl {
                    resources: reach::service_control(&s.pids, &p, host, gpu),
                    pids: s.pids.clone(),
                }
            })
            .collect()
    }

    /// Per plan group, the processes its allocation reaches and how, resource by resource:
    /// the decision log's `control` ([`reach::merge`] folds the jobs into the pool).
    pub fn control(&self) -> BTreeMap<String, GroupControl> {
        let each = self.service_controls();
        let mut groups: BTreeMap<&str, Vec<(&str, &GroupControl)>> = BTreeMap::new();
        for (s, c) in self.services.iter().zip(&each) {
            groups
                .entry(layout::plan_group(&s.spec))
                .or_default()
                .push((s.spec.name.as_str(), c));
        }
        groups
            .into_iter()
            .map(|(g, members)| (g.to_string(), reach::merge(members)))
            .collect()
    }

    /// The services whose processes no resource would reach, and why, unless their table
    /// says `allow_unmanaged = true` ([`reach::uncontrolled`]).
    fn uncontrolled(&self) -> Result<(), reach::Uncontrolled> {
        let services: Vec<(String, String)> = self
            .services
            .iter()
            .zip(self.service_controls())
            .filter(|(s, _)| !s.cfg.allow_unmanaged)
            .filter_map(|(s, c)| Some((s.spec.name.clone(), reach::uncontrolled(&c)?)))
            .collect();
        if services.is_empty() {
            Ok(())
        } else {
            Err(reach::Uncontrolled { services })
        }
    }

    /// What `cohabit check` shows of each service: finds the processes, then for each one
    /// its cgroup per controller and what would be done there, and how each resource would
    /// reach the service (read only: nothing is written, whatever `dry_run` says).
    pub fn survey(&mut self) -> Vec<reach::Survey> {
        self.refresh_processes();
        let controls = self.service_controls();
        let controllers = self.controllers();
        let mut out = Vec::with_capacity(self.services.len());
        for (s, control) in self.services.iter().zip(controls) {
            let own = layout::cgroup_name(layout::plan_group(&s.spec));
            let processes = s
                .pids
                .iter()
                .map(|&pid| {
                    let cgroups = self
                        .kernel
                        .cgroups
                        .as_ref()
                        .and_then(|cg| {
                            placement::explain(
                                cg,
                                &self.procfs,
                                pid,
                                &own,
                                s.cfg.placement,
                                &controllers,
                            )
                        })
                        .unwrap_or_default();
                    reach::SurveyedProcess::new(pid, self.procfs.comm(pid), cgroups)
                })
                .collect();
            let refused = (!s.cfg.allow_unmanaged)
                .then(|| reach::uncontrolled(&control))
                .flatten();
            out.push(reach::Survey {
                name: s.spec.name.clone(),
                group: layout::plan_group(&s.spec).to_string(),
                latency_critical: s.spec.is_latency_critical(),
                allow_unmanaged: s.cfg.allow_unmanaged,
                processes,
                control,
                refused,
            });
        }
        out
    }

    /// After the processes were found: where a service's processes moved to new cgroups,
    /// the values in force are written there; processes are moved where configured;
    /// notes of vanished processes go; threads join their resctrl groups.
    fn place_and_attach(&mut self) {
        if self.dry_run || !self.applied {
            return;
        }
        let (targets, placements) = self.targets();
        if targets != self.record.targets {
            let writes = self.record.writes.clone();
            if let Err(e) = self.write(writes, &targets) {
                if self.warn.allow("reapply") {
                    tracing::warn!(error = %e, "the values in force could not be written to a service's new cgroups (logged once a minute)");
                }
            }
        }
        for (svc, p) in self.services.iter().zip(&placements) {
            apply::move_processes(
                &self.kernel,
                &mut self.record,
                &self.procfs,
                &svc.spec.name,
                &p.moves,
            );
        }
        apply::forget_vanished(&mut self.record, &self.procfs);
        let mons = self.mon_groups();
        for (svc, mon) in self.services.iter().zip(&mons) {
            let members = Members {
                service: &svc.spec.name,
                group: layout::plan_group(&svc.spec),
                found: &svc.pids,
                mon: mon.as_deref(),
            };
            apply::attach_resctrl(
                &self.kernel,
                &self.record,
                &self.procfs,
                &members,
                &mut self.warn,
            );
        }
        for g in &self.record.writes.resctrl {
            let wanted: BTreeSet<&str> = self
                .services
                .iter()
                .zip(&mons)
                .filter(|(s, _)| {
                    self.record.resctrl_group_of(layout::plan_group(&s.spec)) == Some(&g.name)
                })
                .filter_map(|(_, m)| m.as_deref())
                .collect();
            apply::prune_mon_groups(&self.kernel, &g.name, &wanted, &mut self.warn);
        }
    }

    /// Each service's monitoring group (its own RMID) under its resctrl control group, when
    /// that control group holds more than one service (equal allocations, or several
    /// best-effort jobs in the pool); `None` where it holds the service alone.
    fn mon_groups(&self) -> Vec<Option<String>> {
        let ctrl: Vec<Option<&str>> = self
            .services
            .iter()
            .map(|s| self.record.resctrl_group_of(layout::plan_group(&s.spec)))
            .collect();
        self.services
            .iter()
            .zip(&ctrl)
            .map(|(s, c)| {
                let shared = c.is_some() && ctrl.iter().filter(|o| *o == c).count() > 1;
                shared.then(|| s.spec.name.clone())
            })
            .collect()
    }

    /// The cgroup whose hardware counters stand for a service: its first process's cgroup
    /// in the perf_event hierarchy (v2: its cgroup), unless that is a hierarchy's root.
    fn perf_dir(&self, svc: &Service) -> Option<std::path::PathBuf> {
        let cg = self.kernel.cgroups.as_ref()?;
        let lines = self.procfs.cgroups(*svc.pids.first()?)?;
        let dir = cg.home("perf_event", &lines)?;
        (!cg.mounts.values().any(|m| *m == dir)).then_some(dir)
    }

    /// Every write for `plan` (pure; nothing is touched).
    fn layout(&self, plan: &Plan) -> Result<HostWrites, TooManyGroups> {
        let gpu_clients: BTreeSet<String> = self
            .services
            .iter()
            .filter(|s| self.gpu.manages(&s.spec.name))
            .map(|s| s.spec.name.clone())
            .collect();
        let choices = layout::Choices::of(&self.spec);
        layout::layout(plan, &self.facts, &choices, &self.specs(), &gpu_clients)
    }

    /// Writes `writes` for `targets` through the journal (see [`apply::apply`]); a GPU
    /// client without a planned pinned-memory limit gets the configured default.
    fn write(&mut self, writes: HostWrites, targets: &Targets) -> Result<(), HostError> {
        let pinned = self.spec.mps.pinned_mem_limit.clone();
        apply::apply(
            &self.kernel,
            &mut self.record,
            writes,
            targets,
            &mut self.gpu,
            pinned.as_deref(),
        )
    }

    fn apply_plan(&mut self, plan: &Plan) -> Result<(), HostError> {
        if self.dry_run {
            return Ok(());
        }
        let writes = self.layout(plan)?;
        for o in &writes.overlaps {
            if self.warn.allow(&format!("overlap:{o}")) {
                tracing::warn!("{o} (logged once a minute)");
            }
        }
        let (targets, _) = self.targets();
        self.gpu.set_pinned(&plan.gpu_memory_mib);
        if let Err(e) = self.write(writes, &targets) {
            self.gpu.set_pinned(&self.plan.gpu_memory_mib);
            return Err(e);
        }
        self.plan = plan.clone();
        self.applied = true;
        if !self.opened {
            self.opening_plan = Some(plan.clone());
            self.opened = true;
        }
        Ok(())
    }

    /// Starts every service's latency window afresh (the fail-safe put the fair share in
    /// force, or the host was restored: what came before says nothing of what follows).
    pub fn restart_latency_windows(&mut self) {
        for svc in &mut self.services {
            svc.telemetry.restart_latency_window();
        }
    }

    /// Puts every value back, every moved process back where it was, and removes every
    /// group cohabit created; what could not be restored stays in the record.
    pub fn restore(&mut self) {
        if self.dry_run {
            return;
        }
        apply::restore(&self.kernel, &mut self.record, &mut self.gpu, &self.procfs);
        self.applied = false;
        self.restart_latency_windows();
    }

    /// Service `i`'s processes now: its matcher's candidates (names looked up in this
    /// tick's scan `index`), each vetted ([`find`]).
    fn find_pids(&mut self, i: usize, index: &ProcIndex) -> BTreeSet<u32> {
        let m = self.services[i].cfg.matcher.clone();
        let tick = find::Tick {
            procfs: &self.procfs,
            index,
            cohabit_pid: std::process::id(),
            clk_tck: cohabit_collectors::procfs::clock_ticks_per_second(),
        };
        let found: Result<Vec<u32>, String> = match &m {
            Matcher::ProcessName(n) => Ok(index.named(n).map(|p| p.pid).collect()),
            Matcher::PidFile(p) => Ok(self.services[i].vetting.pid_file(p, &tick)),
            Matcher::Cgroup(path) => Ok(self
                .cgroups_any()
                .map(|c| c.processes_at_cgroup_path(path))
                .unwrap_or_default()),
            Matcher::Pod { cgroups, .. } => Ok(self
                .cgroups_any()
                .map(|c| {
                    cgroups
                        .iter()
                        .flat_map(|p| c.processes_at_cgroup_path(p))
                        .collect()
                })
                .unwrap_or_default()),
            Matcher::SystemdUnit(unit) => Ok(self
                .cgroups_any()
                .map(|c| {
                    let mut v = c.processes_at_cgroup_path(&format!("/system.slice/{unit}"));
                    if v.is_empty() {
                        v = c.processes_at_cgroup_path(&format!("/systemd/system.slice/{unit}"));
                    }
                    v
                })
                .unwrap_or_default()),
        };
        let candidates = found.unwrap_or_else(|e| {
            if self.warn.allow("find_pids") {
                tracing::warn!(error = %e, "processes could not be listed (logged once a minute)");
            }
            vec![]
        });
        let svc = &mut self.services[i];
        let kept = svc.vetting.keep(candidates, &tick);
        let pid_file = match &m {
            Matcher::PidFile(p) => Some(p.as_path()),
            _ => None,
        };
        svc.vetting.log(&svc.spec.name, pid_file);
        kept
    }

    /// The pushed latencies each push socket refused since the last call, by service.
    pub fn take_push_rejections(&mut self) -> Vec<(String, PushRejections)> {
        self.services
            .iter_mut()
            .filter_map(|s| Some((s.spec.name.clone(), s.telemetry.take_rejections()?)))
            .collect()
    }

    fn cgroups_any(&self) -> Option<Cgroups> {
        self.kernel
            .cgroups
            .clone()
            .or_else(|| Cgroups::detect(&self.spec.paths).ok().flatten())
    }

    /// Finds each service's processes; puts new ones in its groups; forgets vanished ones.
    fn refresh_processes(&mut self) {
        // One pass over /proc serves every matcher of this tick; only name matchers need
        // it, and between full scans (once a second) only new pids are read.
        let by_name = self
            .services
            .iter()
            .any(|s| matches!(s.cfg.matcher, Matcher::ProcessName(_)));
        let index = if by_name {
            let full = self
                .last_full_scan
                .is_none_or(|t| t.elapsed() >= FULL_SCAN_EVERY);
            let scanned = if full {
                self.last_full_scan = Some(Instant::now());
                self.procfs.scan()
            } else {
                self.procfs.scan_since(&self.proc_index)
            };
            scanned.unwrap_or_else(|e| {
                if self.warn.allow("scan") {
                    tracing::warn!(error = %e, "processes could not be listed (logged once a minute)");
                }
                ProcIndex::default()
            })
        } else {
            ProcIndex::default()
        };
        for i in 0..self.services.len() {
            let found = self.find_pids(i, &index);
            let svc = &self.services[i];
            let name = svc.spec.name.clone();
            if found.is_empty() && !svc.missing_logged {
                tracing::warn!(service = %name, "no process found; its telemetry is absent until one appears");
            }
            for gone in svc.pids.difference(&found) {
                tracing::info!(service = %name, pid = gone, "process vanished");
            }
            let svc = &mut self.services[i];
            svc.missing_logged = found.is_empty();
            svc.pids = found;
        }
        self.proc_index = index;
        self.place_and_attach();
    }
}

/// The kernel interfaces under `paths`, found without opening the host (no latency source
/// bound, nothing written): what restoring a record and cleaning leftovers need.
fn kernel_of(paths: &HostPaths) -> Result<Kernel, HostError> {
    let resctrl = cohabit_collectors::resctrl::Resctrl::discover(paths, Arc::new(RealFs))
        .unwrap_or_else(|e| {
            tracing::warn!(error = %e, "resctrl unreadable; its groups are not restored");
            None
        });
    Ok(Kernel {
        cgroups: Cgroups::detect(paths)?,
        resctrl,
    })
}

/// Puts the host under `paths` back from `recorded` alone (a run that did not end
/// cleanly), before anything else is opened; returns what could not be restored. See
/// [`restore_changes`].
pub fn restore_recorded(
    paths: &HostPaths,
    recorded: &HostChanges,
) -> Result<HostChanges, HostError> {
    let kernel = kernel_of(paths)?;
    Ok(restore_changes(
        &kernel,
        recorded,
        &Procfs::new(&paths.proc),
    ))
}

/// Removes cohabit's groups that no record knows of (a run older than the record, or one
/// whose record was discarded): their processes go to each hierarchy's root.
pub fn clean_leftovers(paths: &HostPaths) -> Result<(), HostError> {
    apply::clean_leftovers(&kernel_of(paths)?);
    Ok(())
}

fn spec_of(s: &ManagedService) -> ServiceSpec {
    let class = match s.p99_target_ms {
        Some(t) => ServiceClass::LatencyCritical { p99_target_ms: t },
        None => ServiceClass::BestEffort,
    };
    ServiceSpec {
        name: s.name.clone(),
        class,
        gpu: s.gpu.as_ref().map(|g| g.index),
        priority: s.priority,
    }
}

impl Collector for RealHost {
    type Error = HostError;

    fn collect(&mut self) -> Result<Observation, HostError> {
        let now = Instant::now();
        let dt_s = now.duration_since(self.last_collect).as_secs_f64();
        self.last_collect = now;
        self.refresh_processes();
        // What each GPU client ran under during the interval that just ended: its share in
        // effect and whether its restart was under way (both before this tick's hooks).
        let gpu_during: Vec<(Option<u8>, bool)> = self
            .services
            .iter()
            .map(|s| {
                let n = &s.spec.name;
                (self.gpu.effective(n), self.gpu.restarting(n))
            })
            .collect();
        if !self.dry_run {
            let pids: BTreeMap<String, Vec<u32>> = self
                .services
                .iter()
                .map(|s| (s.spec.name.clone(), s.pids.iter().copied().collect()))
                .collect();
            self.gpu.restart_due(now, &pids);
        }
        let readings = self.gpus.as_mut().map(Gpus::read);
        // Every Prometheus endpoint at once, each ending by then (no scrape waits for
        // another's).
        let deadline = now + Duration::from_millis(self.spec.collect_timeout_ms);
        let endpoints: Vec<_> = self
            .services
            .iter()
            .map(|s| s.telemetry.prometheus())
            .collect();
        let scraped = sample::scrape_all(&endpoints, deadline);
        let counters = matches!(self.facts.perf, PerfSupport::Supported) && !self.dry_run;
        let perf_dirs: Vec<Option<std::path::PathBuf>> = self
            .services
            .iter()
            .map(|s| self.perf_dir(s).filter(|_| counters))
            .collect();
        let mons = self.mon_groups();
        let mut services = Vec::with_capacity(self.services.len());
        for ((((svc, perf_dir), mon), (gpu_pct, restarting)), scraped) in self
            .services
            .iter_mut()
            .zip(perf_dirs)
            .zip(&mons)
            .zip(gpu_during)
            .zip(&scraped)
        {
            // An interval that ran under something else than the window's starts a new one;
            // one whose plan changed within it is kept apart from both sides.
            let at = |p: Option<&Plan>| {
                p.map(|p| RunsUnder::new(p, &svc.spec.name, gpu_pct, restarting))
            };
            let under = at(self.applied.then_some(&self.plan));
            let mixed = at(self.opening_plan.as_ref()) != under;
            if mixed || svc.after_mixed || under != svc.runs_under {
                svc.telemetry.restart_latency_window();
            }
            svc.runs_under = under;
            svc.after_mixed = mixed;
            let group = layout::plan_group(&svc.spec);
            let src = Sources {
                procfs: &self.procfs,
                perf_dir,
                perf: &self.perf,
                cpus: &self.facts.cpus,
                resctrl: self
                    .kernel
                    .resctrl
                    .as_ref()
                    .zip(self.record.resctrl_group_of(group))
                    .map(|(r, g)| (r, g, mon.as_deref())),
                gpu: readings
                    .as_ref()
                    .zip(svc.spec.gpu)
                    .and_then(|(r, g)| r.get(g as usize)),
                scraped: scraped.as_ref(),
            };
            let sample = svc.telemetry.sample(
                &src,
                &svc.spec.name,
                &svc.pids,
                dt_s,
                self.facts.clk_tck,
                &mut self.bw,
                &mut self.warn,
            );
            services.push(ServiceObservation {
                sample,
                spec: svc.spec.clone(),
                gpu_mps_effective_pct: self.gpu.effective(&svc.spec.name),
            });
        }
        // The next interval opens under the plan in force now, unless one is applied first.
        self.opening_plan = self.applied.then(|| self.plan.clone());
        self.opened = false;
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

    /// Applies `plan` whole (the changes are recomputed against the kernel, so they are
    /// not needed here).
    fn apply(&mut self, plan: &Plan, _changes: &[Change]) -> Result<(), HostError> {
        self.apply_plan(plan)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use cohabit_collectors::resctrl::fake::FakeResctrl;
    use cohabit_collectors::resctrl::GROUP_PREFIX;

    use super::*;
    use crate::spec::{GpuClient, LatencySource, Matcher};
    use crate::testing::{self, best_effort, latency_critical, mute_endpoint, udp_push};
    use cohabit_core::ApplyOutcome;
    use cohabit_policy::control;
    use cohabit_policy::{HostContext, Policy, StaticPolicy};

    /// The fixture's proc tree has no cgroup mounts and no processes: only resctrl (the fake)
    /// is touched, never this machine's cgroups.
    fn config(fake: &FakeResctrl, pid_file: &std::path::Path) -> HostSpec {
        let kv = Matcher::PidFile(pid_file.into());
        let batch = Matcher::ProcessName("no-such-process".into());
        testing::host(
            testing::paths(fake.root(), &fake.base().join("proc")),
            vec![
                latency_critical("kv", 1.0, kv, udp_push()),
                best_effort("batch", batch),
            ],
        )
    }

    #[test]
    fn services_sharing_a_resctrl_group_each_get_their_own_monitoring_group() {
        use cohabit_collectors::procfs::fake::FakeProcess;
        use std::os::unix::fs::PermissionsExt;
        let fake = FakeResctrl::builder().ways(12).build().unwrap();
        let proc_root = fake.base().join("proc");
        let dir = tempfile::tempdir().unwrap();
        let mut pid_files = BTreeMap::new();
        for (pid, name) in [(40, "kv"), (50, "batch"), (60, "etl")] {
            let mut p = FakeProcess::new(pid, name);
            p.threads = vec![pid + 1];
            p.write(&proc_root).unwrap();
            fake.add_task(pid).unwrap();
            fake.add_task(pid + 1).unwrap();
            let f = dir.path().join(format!("{name}.pid"));
            std::fs::write(&f, format!("{pid}\n")).unwrap();
            std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
            pid_files.insert(name, Matcher::PidFile(f));
        }
        let cfg = testing::host(
            testing::paths(fake.root(), &proc_root),
            vec![
                latency_critical("kv", 1.0, pid_files["kv"].clone(), udp_push()),
                best_effort("batch", pid_files["batch"].clone()),
                best_effort("etl", pid_files["etl"].clone()),
            ],
        );
        let mut host = RealHost::open_with(cfg, false, Arc::new(fake.clone())).unwrap();
        let ctx = HostContext {
            host: host.capacity().clone(),
            specs: host.specs(),
        };
        host.launch(&StaticPolicy::new(ctx).initial().plan).unwrap();
        // Both jobs are in the pool's control group; each has a monitoring group of its own
        // with its threads; kv has its control group to itself and needs none.
        let pool = fake.root().join("cohabit-best-effort");
        let tasks = |rel: &str| std::fs::read_to_string(pool.join(rel)).unwrap();
        assert_eq!(tasks("mon_groups/batch/tasks"), "50\n51\n");
        assert_eq!(tasks("mon_groups/etl/tasks"), "60\n61\n");
        assert_eq!(tasks("tasks").lines().count(), 4);
        let kv_mons = std::fs::read_dir(fake.root().join("cohabit-kv/mon_groups")).unwrap();
        assert_eq!(kv_mons.count(), 0);
        // Each job reads its own RMID, not the group's total.
        for (mon, mib) in [("batch", 1u64), ("etl", 3)] {
            let g = format!("cohabit-best-effort/mon_groups/{mon}");
            fake.set_counter(Some(&g), 0, "llc_occupancy", Some(mib << 20))
                .unwrap();
        }
        let obs = host.collect().unwrap();
        let occupancy = |name: &str| {
            obs.services
                .iter()
                .find(|s| s.spec.name == name)
                .and_then(|s| s.sample.llc_occupancy_bytes)
        };
        assert_eq!(occupancy("batch"), Some(f64::from(1u32 << 20)));
        assert_eq!(occupancy("etl"), Some(f64::from(3u32 << 20)));
        assert_ne!(occupancy("batch"), occupancy("etl"));
        host.restore();
        assert!(!pool.exists());
        let mut root: Vec<String> = std::fs::read_to_string(fake.root().join("tasks"))
            .unwrap()
            .lines()
            .map(str::to_string)
            .collect();
        root.sort();
        assert_eq!(root, ["40", "41", "50", "51", "60", "61"]);
    }

    /// A Prometheus endpoint whose histogram `lat` (seconds) counts 100 more requests, all
    /// under 5 ms, at each scrape.
    fn growing_metrics() -> u16 {
        use std::io::{Read, Write};
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        std::thread::spawn(move || {
            let mut n = 0u64;
            for s in l.incoming() {
                let Ok(mut s) = s else { return };
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(k) => head.extend_from_slice(&buf[..k]),
                    }
                }
                n += 100;
                let body =
                    format!("lat_bucket{{le=\"0.005\"}} {n}\nlat_bucket{{le=\"+Inf\"}} {n}\n");
                let _ = write!(
                    s,
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
            }
        });
        port
    }

    /// Two latency-critical services over a fake resctrl, `a` then `z`, with these
    /// latency sources.
    fn two_services(
        fake: &FakeResctrl,
        a: LatencySource,
        z: LatencySource,
        timeout_ms: u64,
    ) -> HostSpec {
        let proc_root = fake.base().join("proc");
        std::fs::create_dir_all(&proc_root).unwrap();
        HostSpec {
            collect_timeout_ms: timeout_ms,
            ..testing::host(
                testing::paths(fake.root(), &proc_root),
                vec![no_such("a", a), no_such("z", z)],
            )
        }
    }

    /// A latency-critical service with a target of 1 ms whose process never exists.
    fn no_such(name: &str, latency: LatencySource) -> ManagedService {
        let matcher = Matcher::ProcessName(format!("no-such-{name}"));
        latency_critical(name, 1.0, matcher, latency)
    }

    /// Requests timed by cohabit on `redis://127.0.0.1:{port}`.
    fn probe(port: u16, rate_hz: u32, timeout_ms: u64) -> LatencySource {
        LatencySource::Probe {
            url: format!("redis://127.0.0.1:{port}").parse().unwrap(),
            rate_hz,
            timeout_ms,
        }
    }

    #[test]
    fn a_hanging_metrics_endpoint_does_not_starve_a_later_services_scrape() {
        // Security review 2026-12b, N4: `a`'s /metrics never answers and comes first.
        let fake = FakeResctrl::builder().ways(12).build().unwrap();
        let scrape = |port: u16| LatencySource::Prometheus {
            url: format!("http://127.0.0.1:{port}/metrics"),
            metric: "lat".into(),
            unit_seconds: 1.0,
        };
        let budget = Duration::from_millis(300);
        let cfg = two_services(
            &fake,
            scrape(mute_endpoint()),
            scrape(growing_metrics()),
            300,
        );
        let mut host = RealHost::open_with(cfg, false, Arc::new(fake.clone())).unwrap();
        let ctx = HostContext {
            host: host.capacity().clone(),
            specs: host.specs(),
        };
        host.launch(&StaticPolicy::new(ctx).initial().plan).unwrap();
        // The first scrape only sets the baseline.
        host.collect().unwrap();
        for i in 0..4 {
            let t = Instant::now();
            let obs = host.collect().unwrap();
            let took = t.elapsed();
            let p99 = |name: &str| {
                obs.services
                    .iter()
                    .find(|s| s.spec.name == name)
                    .and_then(|s| s.sample.p99_ms)
            };
            assert_eq!(p99("a"), None, "collect {i}");
            let z = p99("z").unwrap_or_else(|| panic!("collect {i}: z has no p99"));
            assert!(z > 0.0 && z <= 5.0, "collect {i}: {z}");
            // Each scrape has the whole budget, and they run together.
            assert!(took < budget * 3, "collect {i} took {took:?}");
        }
        host.restore();
    }

    #[test]
    fn binding_a_probe_to_a_service_that_never_answers_does_not_wait() {
        // Security review 2026-12b, N2: `reconfigure` runs inside the control tick.
        let fake = FakeResctrl::builder().ways(12).build().unwrap();
        let mute = mute_endpoint();
        let refused = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let cfg = two_services(&fake, udp_push(), udp_push(), 100);
        let mut host = RealHost::open_with(cfg, false, Arc::new(fake.clone())).unwrap();
        // Probes that are refused, and that are never answered with a time-out of 5 s: the
        // first request alone would take that long, and the reconfiguration would wait for it.
        let cfgs =
            two_services(&fake, probe(refused, 20, 100), probe(mute, 20, 5000), 100).services;
        let cpus = host.cpus().to_vec();
        let t = Instant::now();
        let failed = host.reconfigure(cfgs, cpus);
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
        assert!(failed.is_empty(), "{failed:?}");
        assert_eq!(host.specs().len(), 2);
        // The probes report what they meet as violations, in the windows.
        std::thread::sleep(Duration::from_millis(600));
        let obs = host.collect().unwrap();
        let a = &obs.services[0].sample;
        assert!(
            a.p99_ms.is_some_and(|p| (99.0..=101.0).contains(&p)),
            "refused: {a:?}"
        );
        host.restore();
    }

    #[test]
    fn a_configured_probe_that_does_not_answer_stops_the_start_naming_it() {
        let fake = FakeResctrl::builder().ways(12).build().unwrap();
        let refused = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mute = mute_endpoint();
        for (port, why) in [(refused, "refused"), (mute, "no answer within 200 ms")] {
            let cfg = two_services(&fake, udp_push(), probe(port, 100, 200), 100);
            let e = RealHost::open_with(cfg, false, Arc::new(fake.clone()))
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("latency probe of z")
                    && e.contains(&format!("redis://127.0.0.1:{port}"))
                    && e.contains("does not answer")
                    && e.contains(why),
                "{e}"
            );
        }
    }

    /// Moves an MBA limit to another of 50 and 60 %.
    fn other_mba(pct: &mut u8) {
        *pct = if *pct == 50 { 60 } else { 50 };
    }

    #[test]
    fn a_plan_change_restarts_the_latency_windows_of_the_services_it_touches() {
        let fake = FakeResctrl::builder().ways(12).build().unwrap();
        let proc_root = fake.base().join("proc");
        std::fs::create_dir_all(&proc_root).unwrap();
        let batch = Matcher::ProcessName("no-such-batch".into());
        let services = vec![
            no_such("kv", udp_push()),
            no_such("web", udp_push()),
            best_effort("batch", batch),
        ];
        let cfg = HostSpec {
            latency_window: 5,
            ..testing::host(testing::paths(fake.root(), &proc_root), services)
        };
        let mut host = RealHost::open_with(cfg, false, Arc::new(fake.clone())).unwrap();
        let held = |host: &RealHost| -> Vec<(String, Option<usize>)> {
            host.services
                .iter()
                .map(|s| (s.spec.name.clone(), s.telemetry.latency_intervals()))
                .collect()
        };
        let want = |kv: usize, web: usize| {
            vec![
                ("kv".to_string(), Some(kv)),
                ("web".to_string(), Some(web)),
                ("batch".to_string(), None),
            ]
        };
        let ctx = HostContext {
            host: host.capacity().clone(),
            specs: host.specs(),
        };
        let plan = StaticPolicy::new(ctx).initial().plan;
        host.launch(&plan).unwrap();
        // Two intervals (without requests: nobody sends) in each window.
        host.collect().unwrap();
        host.collect().unwrap();
        assert_eq!(held(&host), want(2, 2));
        // kv's bandwidth changes: the interval under the new plan starts kv's window
        // afresh, web's is kept.
        let mut kv_mba = plan.clone();
        other_mba(&mut kv_mba.services.get_mut("kv").unwrap().mba_pct);
        host.apply(&kv_mba, &[]).unwrap();
        host.collect().unwrap();
        assert_eq!(held(&host), want(1, 3));
        // The same plan again changes nothing.
        host.apply(&kv_mba, &[]).unwrap();
        host.collect().unwrap();
        assert_eq!(held(&host), want(2, 4));
        // The pool's bandwidth is every service's neighbourhood.
        let mut pool_mba = kv_mba.clone();
        other_mba(&mut pool_mba.best_effort.mba_pct);
        host.apply(&pool_mba, &[]).unwrap();
        host.collect().unwrap();
        assert_eq!(held(&host), want(1, 1));
        host.collect().unwrap();
        assert_eq!(held(&host), want(2, 2));
        // A plan applied late in an interval (the Kubernetes agent's for new pods, just
        // before the collect) makes a mixed interval: kept apart from both sides.
        let mut late = pool_mba.clone();
        other_mba(&mut late.services.get_mut("kv").unwrap().mba_pct);
        host.apply(&pool_mba, &[]).unwrap();
        host.apply(&late, &[]).unwrap();
        host.collect().unwrap();
        assert_eq!(held(&host), want(1, 3));
        host.collect().unwrap();
        assert_eq!(held(&host), want(1, 4));
        host.collect().unwrap();
        assert_eq!(held(&host), want(2, 5));
        // The fail-safe's plan and a restore start every window afresh.
        host.restart_latency_windows();
        assert_eq!(held(&host), want(0, 0));
        host.collect().unwrap();
        host.collect().unwrap();
        host.restore();
        assert_eq!(held(&host), want(0, 0));
        // Unmanaged again, the host's own state is what the next window runs under.
        host.collect().unwrap();
        assert_eq!(held(&host), want(1, 1));
    }

    #[test]
    fn a_gpu_clients_restart_and_its_new_share_each_start_a_latency_window() {
        let fake = FakeResctrl::builder().ways(12).build().unwrap();
        let proc_root = fake.base().join("proc");
        std::fs::create_dir_all(&proc_root).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let llm = ManagedService {
            gpu: Some(GpuClient {
                index: 0,
                env_file: dir.path().join("llm.env"),
                restart: "true".into(),
                min_restart_interval_ms: 100,
                hook_timeout_ms: 60_000,
                mps_server: None,
            }),
            ..latency_critical(
                "llm",
                50.0,
                Matcher::ProcessName("no-such-llm".into()),
                udp_push(),
            )
        };
        let cfg = HostSpec {
            latency_window: 5,
            ..testing::host(testing::paths(fake.root(), &proc_root), vec![llm])
        };
        let mut host = RealHost::open_with(cfg, false, Arc::new(fake.clone())).unwrap();
        let ctx = HostContext {
            host: host.capacity().clone(),
            specs: host.specs(),
        };
        let mut plan = StaticPolicy::new(ctx).initial().plan;
        plan.services.get_mut("llm").unwrap().gpu_mps_pct = Some(50);
        host.launch(&plan).unwrap();
        let mut held = Vec::new();
        for _ in 0..4 {
            host.collect().unwrap();
            held.push(host.services[0].telemetry.latency_intervals().unwrap());
            // The hook (`true`) ends well within this.
            std::thread::sleep(Duration::from_millis(300));
        }
        // The first interval under the plan; the one with the restart (the share still the
        // old one); the first with the new share in effect; then the window grows.
        assert_eq!(held, [1, 1, 1, 2]);
        assert_eq!(host.gpu.effective("llm"), Some(50));
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
        // The fake gives MB 8 CLOSIDs, L3 16: MB binds. MBA steps come from info/MB.
        let c = host.capacity();
        assert_eq!((c.closids, c.mba_min_pct, c.mba_gran_pct), (8, 10, 10));
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
