//! What the host is asked to manage, typed: the host's own settings ([`HostSpec`]) and
//! each service's ([`ManagedService`]). The daemon's configuration builds these (parsing
//! and validation are its job); the host never sees the configuration file.

use std::path::PathBuf;

use cohabit_collectors::cgroup::CpuList;
use cohabit_collectors::latency::{PushAddr, DEFAULT_MODE};
use cohabit_collectors::probe::ProbeUrl;
use cohabit_collectors::users::{GroupRef, UserRef};
use cohabit_collectors::HostPaths;
use serde::{Deserialize, Serialize};

/// Everything the real host needs to open: where the kernel's interfaces are, what it
/// manages and how, and the services.
#[derive(Debug, Clone, PartialEq)]
pub struct HostSpec {
    /// Host name for logs.
    pub host_name: String,
    /// Kernel interface roots (procfs, sysfs, cgroups, resctrl).
    pub paths: HostPaths,
    /// CPUs managed (`None`: all online).
    pub cpus: Option<CpuList>,
    /// Peak memory bandwidth, if known.
    pub mem_bw_gbps: Option<f64>,
    /// GPUs to plan for when NVML cannot list them.
    pub gpus: Option<u32>,
    /// Which cache processes cohabit does not manage may use.
    pub unmanaged_cache: UnmanagedCache,
    /// Where the best-effort pool may run.
    pub best_effort_cpus: BestEffortCpus,
    /// MPS control.
    pub mps: MpsSpec,
    /// Services also come from a kubelet's pods, whose cgroups the kubelet writes.
    pub pods: bool,
    /// Longest a collection may take.
    pub collect_timeout_ms: u64,
    /// Control intervals whose requests one p99 rests on, at most.
    pub latency_window: u32,
    /// Latency-critical services, then best-effort jobs.
    pub services: Vec<ManagedService>,
}

/// How a service's processes are found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Matcher {
    /// Processes whose `comm` is exactly this.
    ProcessName(String),
    /// Processes in this cgroup path (in any hierarchy).
    Cgroup(String),
    /// Processes of a systemd unit (`/system.slice/<unit>`).
    SystemdUnit(String),
    /// The pid written in this file.
    PidFile(PathBuf),
    /// The processes of a Kubernetes pod's containers (services made from pods, never
    /// written in a file; see `daemon::kube`).
    Pod {
        /// The pod's UID.
        uid: String,
        /// Its containers' cgroup paths (`/kubepods/burstable/pod<uid>/<id>`).
        cgroups: Vec<String>,
    },
}

/// How cohabit applies a service's CPU controls (`placement`; see `crate::placement`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Placement {
    /// Write the CPU set, limit and weight into the cgroup each process is in (its owner's:
    /// a systemd unit, a container); a process where that is impossible (a bare process in
    /// a hierarchy's root) is left alone, with one log line.
    #[default]
    InPlace,
    /// As `InPlace`, but a process whose cgroup cannot be controlled in place is moved into
    /// cohabit's own group (v1: in the cpuset and cpu hierarchies only) and back on exit.
    Move,
}

/// What a matched process must also be (`match.user`, `match.exe`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProcessConstraint {
    /// The user it runs as (effective uid); also a pid file's allowed owner besides root.
    pub user: Option<UserRef>,
    /// Its executable.
    pub exe: Option<PathBuf>,
}

/// One managed service or job.
#[derive(Debug, Clone, PartialEq)]
pub struct ManagedService {
    /// Name (also its group name).
    pub name: String,
    /// Target, for latency-critical services.
    pub p99_target_ms: Option<f64>,
    /// How to find its processes.
    pub matcher: Matcher,
    /// What its processes must also be.
    pub constraint: ProcessConstraint,
    /// How its CPU controls are applied.
    pub placement: Placement,
    /// `allow_unmanaged = true`: `cohabit run` may start while no resource it is allocated
    /// reaches its processes (it is then only watched); otherwise such a service stops the
    /// start (see `crate::reach`).
    pub allow_unmanaged: bool,
    /// Latency source, for latency-critical services.
    pub latency: Option<LatencySource>,
    /// GPU share handling, for GPU services.
    pub gpu: Option<GpuClient>,
    /// Overload priority (higher wins; 0 unless a pod's `cohabit.io/priority` says).
    pub priority: i32,
}

/// A matcher any local user could satisfy, given without `match.user` to say whose
/// processes are the service's (security review 2026-12, row 2). Refused outside
/// `--dry-run` ([`ManagedService::unbound_matcher`]; `crate::find::require_users`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("service {service}: match.{key} without match.user: {}; set match.user to the user the service runs as (a name or uid), or run with --dry-run to only watch", .key.risk())]
pub struct UnboundMatcher {
    /// The service.
    pub service: String,
    /// Its matcher.
    pub key: MatcherKey,
}

/// The matchers that need `match.user`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatcherKey {
    /// `match.process_name`.
    ProcessName,
    /// `match.pid_file`.
    PidFile,
}

impl MatcherKey {
    /// What could go wrong without `match.user`.
    fn risk(self) -> &'static str {
        match self {
            MatcherKey::ProcessName => "any user can give a process that name and have it managed as the service (its cgroup given the service's CPUs, its latency believed)",
            MatcherKey::PidFile => "only a root-owned file naming a root process would be believed, so a service that runs as another user is never found",
        }
    }
}

impl std::fmt::Display for MatcherKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            MatcherKey::ProcessName => "process_name",
            MatcherKey::PidFile => "pid_file",
        })
    }
}

impl ManagedService {
    /// The service's matcher, if it is found by process name or pid file without
    /// `match.user`.
    pub fn unbound_matcher(&self) -> Option<UnboundMatcher> {
        let key = match self.matcher {
            Matcher::ProcessName(_) => MatcherKey::ProcessName,
            Matcher::PidFile(_) => MatcherKey::PidFile,
            _ => return None,
        };
        self.constraint.user.is_none().then(|| UnboundMatcher {
            service: self.name.clone(),
            key,
        })
    }
}

/// How a GPU service's MPS share is published and applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuClient {
    /// GPU index.
    pub index: u32,
    /// Environment file the service's client reads at start.
    pub env_file: PathBuf,
    /// Shell command that restarts the client (e.g. `systemctl restart llm.service`).
    pub restart: String,
    /// Least time between two restarts.
    pub min_restart_interval_ms: u64,
    /// Longest the restart command may run before its process group is killed.
    pub hook_timeout_ms: u64,
    /// The MPS v3 named server that serves only this client: where the host offers
    /// dynamic adjustment, its share changes there without a restart.
    pub mps_server: Option<String>,
}

/// The MPS control daemon.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpsSpec {
    /// Path of `nvidia-cuda-mps-control`.
    pub control: PathBuf,
    /// `CUDA_MPS_PIPE_DIRECTORY`, if not the default.
    pub pipe_dir: Option<PathBuf>,
    /// Pinned device memory limit for clients, e.g. `0=8G` (written to the env files).
    pub pinned_mem_limit: Option<String>,
}

/// Which cache the processes cohabit does not manage may use: everything in the root
/// resctrl group (system daemons, the services' own clients, anything no control group
/// claims).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum UnmanagedCache {
    /// The root group keeps the cache it had (every way, unless another tool set it): the
    /// latency-critical ways are isolated from best-effort jobs, not from the rest of the
    /// host. The default: cohabit changes nothing it does not manage.
    #[default]
    Shared,
    /// The root group's cache masks become the pool's: unmanaged processes are treated as
    /// best effort and stay out of the latency-critical ways (as Heracles treats every
    /// other task). For hosts dedicated to co-location.
    Pool,
}

/// Where the best-effort pool may run (`[host] best_effort_cpus`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BestEffortCpus {
    /// The CPUs no latency-critical service holds (when none is left, the last one in the
    /// idle class). The default: a service's CPUs are its own, as in Heracles and PARTIES.
    #[default]
    Spare,
    /// Every managed CPU, the services' included, in the kernel's idle class: the pool
    /// only takes cycles the services leave idle and yields to them at once. Needs the
    /// idle class (`cpu.idle`, Linux 5.15); without it the pool keeps to `Spare`. For
    /// hosts whose idle CPUs wake slowly (virtual machines whose idle vCPUs halt, see
    /// README "Real services"), where a service's own idle CPU costs it more than sharing.
    All,
}

/// Where a service's latency comes from.
#[derive(Debug, Clone, PartialEq)]
pub enum LatencySource {
    /// Pushed samples on a socket.
    Push {
        /// The socket.
        addr: PushAddr,
        /// Who may send (Unix sockets).
        access: PushAccess,
    },
    /// A scraped Prometheus histogram.
    Prometheus {
        /// Metrics URL (http).
        url: String,
        /// Histogram name (without `_bucket`).
        metric: String,
        /// Its unit in seconds.
        unit_seconds: f64,
    },
    /// Requests timed by cohabit itself on a dedicated thread
    /// ([`cohabit_collectors::probe`]).
    Probe {
        /// The service's address and protocol; the only place the probe contacts.
        url: ProbeUrl,
        /// Requests per second, 1 to 10000.
        rate_hz: u32,
        /// Per-request time-out; a request not answered by then is a violation.
        timeout_ms: u64,
    },
}

/// Who may reach a Unix push socket and whose datagrams count (names resolved at start).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushAccess {
    /// Owner of the socket file (`None`: root, the daemon).
    pub owner: Option<UserRef>,
    /// Group of the socket file (`None`: the daemon's).
    pub group: Option<GroupRef>,
    /// Permission bits of the socket file.
    pub mode: u32,
    /// Senders accepted by user, besides the service's own processes.
    pub allowed_users: Vec<UserRef>,
    /// Senders accepted by group.
    pub allowed_groups: Vec<GroupRef>,
}

impl Default for PushAccess {
    fn default() -> Self {
        Self {
            owner: None,
            group: None,
            mode: DEFAULT_MODE,
            allowed_users: vec![],
            allowed_groups: vec![],
        }
    }
}
