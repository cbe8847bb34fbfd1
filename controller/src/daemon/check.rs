//! `cohabit check --config FILE`: what `cohabit run` would do on this host, changing
//! nothing. Per configured service and job: the processes its matcher finds, their cgroup
//! in each hierarchy cohabit writes and what would be done there, how each resource it is
//! allocated would reach them (in place, moved, unmanaged and why: `cohabit_host::reach`), and its
//! latency source with a first reading over a bounded wait. It ends with whether `run`
//! would start, and if not, why.
//!
//! Nothing on the host changes: the host is opened as for `--dry-run` (no cgroup, resctrl
//! or GPU write, no state directory, no lock). Binding a push socket is the one visible
//! act, for the wait only; a socket a running daemon holds is reported as in use, never
//! taken over.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use cohabit_core::{Collector as _, Control};
use serde::Serialize;

use super::config::{DaemonConfig, LatencySource};
use cohabit_host::reach::{CgroupAction, Survey};
use cohabit_host::{HostError, RealHost};

/// What `cohabit check` found.
#[derive(Debug, Clone, Serialize)]
pub struct CheckReport {
    /// The configuration file.
    pub config: PathBuf,
    /// What the host lets cohabit write.
    pub host: CheckedHost,
    /// Each configured service and job, latency-critical first.
    pub services: Vec<CheckedService>,
    /// Why `cohabit run` (not `--dry-run`) would refuse to start; empty when it would start.
    pub refusals: Vec<String>,
}

impl CheckReport {
    /// `cohabit run` would start with this configuration.
    pub fn would_start(&self) -> bool {
        self.refusals.is_empty()
    }
}

/// What the host lets cohabit write.
#[derive(Debug, Clone, Serialize)]
pub struct CheckedHost {
    /// The CPUs cohabit would hand out.
    pub cpus: Vec<u32>,
    /// The cgroup controllers cohabit may write.
    pub writable_controllers: Vec<String>,
    /// resctrl allocates cache ways.
    pub llc_allocation: bool,
    /// resctrl allocates memory bandwidth.
    pub mba_allocation: bool,
}

/// One service or job: what `run` would do with it, and its latency source.
#[derive(Debug, Clone, Serialize)]
pub struct CheckedService {
    /// Its processes and how each resource would reach them.
    #[serde(flatten)]
    pub survey: Survey,
    /// Its latency source and first reading (latency-critical services).
    pub latency: Option<LatencyCheck>,
}

/// A latency source and what it gave over the wait.
#[derive(Debug, Clone, Serialize)]
pub struct LatencyCheck {
    /// The source, as configured.
    pub source: String,
    /// How long requests were gathered.
    pub waited_ms: u64,
    /// The p99 over the wait (`None`: no request was seen, or the source failed).
    pub p99_ms: Option<f64>,
    /// Requests per second over the wait.
    pub requests_per_s: Option<f64>,
    /// Why the source could not be read (bound, scraped, or its probe answered).
    pub error: Option<String>,
}

/// The source as an operator wrote it.
fn describe(l: &LatencySource) -> String {
    use cohabit_collectors::latency::PushAddr;
    match l {
        LatencySource::Push {
            addr: PushAddr::Udp(a),
            ..
        } => format!("push udp {a}"),
        LatencySource::Push {
            addr: PushAddr::Unix(p),
            ..
        } => format!("push unix {}", p.display()),
        LatencySource::Prometheus { url, metric, .. } => format!("prometheus {url} {metric}"),
        LatencySource::Probe { url, .. } => format!("probe {url}"),
    }
}

/// Opens the host as `--dry-run` does; a latency source that cannot be bound (or a probe
/// that does not answer) is noted for its service and left out, so the rest is still
/// shown. Returns the host and each such service's error.
fn open(mut cfg: DaemonConfig) -> Result<(RealHost, BTreeMap<String, String>), HostError> {
    let mut failed = BTreeMap::new();
    loop {
        let e = match RealHost::open(cfg.host_spec(), true) {
            Ok(host) => return Ok((host, failed)),
            Err(e) => e,
        };
        let (service, why) = match &e {
            HostError::Latency { service, source } => (service.clone(), source.to_string()),
            HostError::Probe { service, error } => (service.clone(), error.to_string()),
            _ => return Err(e),
        };
        // Each round leaves one source out, so this ends.
        match cfg
            .services
            .iter_mut()
            .find(|s| s.name == service && s.latency.is_some())
        {
            Some(s) => s.latency = None,
            None => return Err(e),
        }
        failed.insert(service, why);
    }
}

/// Looks at the host `cfg` describes as `run` would, waiting `wait` for the latency
/// sources' first reading; `config` names the file in the report.
pub fn check(cfg: DaemonConfig, config: PathBuf, wait: Duration) -> Result<CheckReport, HostError> {
    let sources: BTreeMap<String, String> = cfg
        .services
        .iter()
        .filter_map(|s| Some((s.name.clone(), describe(s.latency.as_ref()?))))
        .collect();
    let mut refusals: Vec<String> = cfg
        .services
        .iter()
        .filter_map(|s| s.unbound_matcher())
        .map(|u| u.to_string())
        .collect();
    if let Err(e) = super::kube::require_agent(&cfg, super::kube::BUILT_WITH_KUBERNETES) {
        refusals.push(e.to_string());
    }
    let (mut host, failed) = open(cfg)?;
    let surveys = host.survey();
    // The first collection is the baseline (a Prometheus histogram's counts so far); the
    // second holds what came during the wait.
    host.collect()?;
    std::thread::sleep(wait);
    let seen = host.collect()?;
    let waited_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX);
    let services = surveys
        .into_iter()
        .map(|survey| {
            let latency = sources.get(&survey.name).map(|source| {
                let sample = seen
                    .services
                    .iter()
                    .find(|o| o.spec.name == survey.name)
                    .map(|o| &o.sample);
                LatencyCheck {
                    source: source.clone(),
                    waited_ms,
                    p99_ms: sample.and_then(|s| s.p99_ms),
                    requests_per_s: sample.and_then(|s| s.requests_per_s),
                    error: failed.get(&survey.name).cloned(),
                }
            });
            CheckedService { survey, latency }
        })
        .collect::<Vec<_>>();
    let uncontrolled: Vec<(String, String)> = services
        .iter()
        .filter_map(|s| Some((s.survey.name.clone(), s.survey.refused.clone()?)))
        .collect();
    if !uncontrolled.is_empty() {
        let e = cohabit_host::reach::Uncontrolled {
            services: uncontrolled,
        };
        refusals.push(e.to_string());
    }
    refusals.extend(
        failed
            .iter()
            .map(|(s, why)| format!("latency source of {s}: {why}")),
    );
    let facts = host.facts();
    Ok(CheckReport {
        config,
        host: CheckedHost {
            cpus: facts.cpus.clone(),
            writable_controllers: facts.writable.clone(),
            llc_allocation: facts.resctrl.as_ref().is_some_and(|r| r.l3.is_some()),
            mba_allocation: facts.resctrl.as_ref().is_some_and(|r| r.mba.is_some()),
        },
        services,
        refusals,
    })
}

impl CheckReport {
    /// The report as text for people.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let yes_no = |b: bool| if b { "yes" } else { "no" };
        let _ = writeln!(
            s,
            "cohabit check {} (nothing on the host was changed)",
            self.config.display()
        );
        let _ = writeln!(
            s,
            "host: CPUs {}; cgroup controllers written: {}; resctrl cache ways: {}; memory bandwidth: {}",
            cohabit_collectors::cgroup::CpuList(self.host.cpus.clone()),
            if self.host.writable_controllers.is_empty() {
                "none".to_string()
            } else {
                self.host.writable_controllers.join(", ")
            },
            yes_no(self.host.llc_allocation),
            yes_no(self.host.mba_allocation),
        );
        for svc in &self.services {
            render_service(&mut s, svc);
        }
        if self.would_start() {
            s.push_str("\ncohabit run would start.\n");
        } else {
            s.push_str("\ncohabit run would refuse to start:\n");
            for r in &self.refusals {
                let _ = writeln!(s, "  - {r}");
            }
        }
        s
    }
}

fn render_service(s: &mut String, svc: &CheckedService) {
    let v = &svc.survey;
    let class = if v.latency_critical {
        "latency-critical"
    } else {
        "best effort"
    };
    let _ = writeln!(s, "\n{} ({class}, plan group {})", v.name, v.group);
    if v.processes.is_empty() {
        s.push_str("  processes: none found\n");
    }
    for p in &v.processes {
        let _ = writeln!(
            s,
            "  process {} {}",
            p.pid,
            p.comm.as_deref().unwrap_or("?")
        );
        for c in &p.cgroups {
            let at = c
                .cgroup
                .as_ref()
                .map_or_else(|| "?".to_string(), |d| d.display().to_string());
            let what = match &c.action {
                CgroupAction::Write { .. } => "written in place".to_string(),
                CgroupAction::Move { to } => format!("moved to {}", to.display()),
                CgroupAction::Leave { why } => format!("left alone: {why}"),
            };
            let _ = writeln!(s, "    {:<7} {at}: {what}", c.controller);
        }
    }
    for (r, c) in &v.control.resources {
        let what = match c {
            Control::InPlace => "controlled in place".to_string(),
            Control::Moved => "controlled in cohabit's own group".to_string(),
            Control::Partial { why } => format!("partly controlled: {why}"),
            Control::Unmanaged { why } => format!("UNMANAGED: {why}"),
        };
        let _ = writeln!(s, "  {:<10} {what}", r.to_string());
    }
    if let Some(l) = &svc.latency {
        let secs = l.waited_ms as f64 / 1000.0;
        let reading = match (&l.error, l.p99_ms) {
            (Some(e), _) => format!("error: {e}"),
            (None, Some(p)) => format!(
                "p99 {p:.3} ms over {secs:.1} s ({:.0} requests/s)",
                l.requests_per_s.unwrap_or(0.0)
            ),
            (None, None) => format!("no request seen in {secs:.1} s"),
        };
        let _ = writeln!(s, "  latency    {}: {reading}", l.source);
    }
    if v.allow_unmanaged
        && v.control
            .resources
            .values()
            .all(|c| c.unmanaged().is_some())
    {
        s.push_str("  allow_unmanaged = true: run starts and only watches it\n");
    }
}
