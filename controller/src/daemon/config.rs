//! `cohabit run` configuration: TOML, every table `deny_unknown_fields`, validated into a
//! [`DaemonConfig`] with errors that name the field.
//!
//! ```toml
//! interval_ms = 1000
//! policy = "parties"                 # static | parties | clite | ml
//! model = "/etc/cohabit/qos-v1.json" # ml only: the model (cohabit-train fit writes one)
//! gpu_model = "/etc/cohabit/qos-gpu-v1.json" # ml only, optional: the GPU services' share
//!                                    # model (schema qos-gpu; cohabit-train fit --gpu)
//! log = "/var/log/cohabit/decisions.jsonl"
//! log_max_bytes = 100000000          # rotate the log at this size (decisions.jsonl.1 …)
//! log_keep = 5                       # rotated logs kept
//! collect_timeout_ms = 500
//! metrics_addr = "127.0.0.1:9464"    # Prometheus metrics; "" disables
//! metrics_public = false             # must be true for a non-loopback metrics_addr
//! fail_safe_after_ticks = 20         # consecutive failed ticks before the fair share is applied
//! latency_window = 3                 # a p99 merges the requests of up to this many intervals
//!                                    # (1-60), since the allocation or the load last changed
//! model_check_every_ticks = 10       # ml: reload the model when its file changes (0: never)
//! explore = { margin = 0.3 }         # safe exploration around the policy's plans (or --explore);
//!                                    # also max_cores, max_ways, max_mba_steps, min_cores,
//!                                    # min_ways, seed, rule ("informative": around ml the
//!                                    # safe step that teaches its posterior most; "walk"),
//!                                    # beta, min_information, settle_ticks
//!                                    # (docs: cohabit_policy::ExploreConfig)
//! ml = { margin = 0.9 }              # ml only: its tunables (defaults as measured); also
//!                                    # k_sigma, k_sigma_give_back, give_back_headroom,
//!                                    # unsure_sigma, shrink_after, way_cost, explore_step,
//!                                    # explore_below, gpu_hysteresis_pct, gpu_shrink_after_ms
//!                                    # (docs: cohabit_policy::MlConfig; each trades QoS for
//!                                    # best effort: docs/CONFIGURATION.md, "Tuning ml")
//!
//! [paths]
//! state_dir = "/run/cohabit"         # lock and record of changes (root-owned, 0700)
//!
//! [host]
//! cpus = "0-35"                      # CPUs cohabit manages (online ones); default: all online
//! mem_bw_gbps = 76.8                 # peak memory bandwidth (MBA in MBps mode, telemetry sanity)
//! unmanaged_cache = "shared"         # or "pool": processes cohabit does not manage (the root
//!                                    # resctrl group) get the pool's cache ways, not every way
//! best_effort_cpus = "spare"         # or "all": best-effort jobs may also run on the services'
//!                                    # CPUs, in the kernel's idle class (cpu.idle)
//!
//! [[service]]                        # latency-critical
//! name = "memcached"
//! p99_target_ms = 0.6
//! match = { process_name = "memcached",   # or cgroup / systemd_unit / pid_file
//!           user = "memcache",             # only processes running as this user (name or uid;
//!                                          # needed by process_name and pid_file)
//!           exe = "/usr/bin/memcached" }   # … and this executable
//! latency = { unix = "/run/cohabit/memcached.sock",  # datagrams of one latency (µs) per line
//!             group = "memcache", mode = "0660",     # socket owner/group/mode (owner: root)
//!             allowed_users = ["loadgen"] }          # besides the service's own processes
//!                                          # or { push = "127.0.0.1:9400", unauthenticated = true }
//!                                          # or { prometheus = "http://127.0.0.1:9150/metrics",
//!                                          #      metric = "request_duration_seconds" }
//!                                          # or { probe = "memcached://127.0.0.1:11211",
//!                                          #      rate_hz = 100, timeout_ms = 1000 }
//!
//! placement = "in_place"            # default: control the cgroup the processes are in;
//!                                    # "move": bare processes (in a hierarchy's root) go
//!                                    # into cohabit's own group, and back on exit
//! allow_unmanaged = false            # true: `run` starts even when no resource reaches its
//!                                    # processes (then only watched; `cohabit check` says)
//!
//! [[best_effort]]
//! name = "batch"
//! match = { systemd_unit = "batch.service" }
//!
//! [kubernetes]                       # services also come from this node's annotated pods
//! node_name = "worker-1"             # default: the environment variable NODE_NAME
//! cgroup_driver = "auto"             # or cgroupfs | systemd (the kubelet's cgroupDriver)
//! kubelet_dir = "/var/lib/kubelet"   # its cpu_manager_state is read
//! cgroup_root = "/"                  # the kubelet's --cgroup-root
//! socket_dir = "/run/cohabit/pods"   # a pod's unix latency socket: only
//!                                    # <socket_dir>/<namespace>.<name>.sock
//! latency_critical_namespaces = ["shop"] # only these namespaces' pods may be latency-
//!                                    # critical (default: none; others are best effort)
//! max_pod_priority = 0               # highest cohabit.io/priority honoured (-1000 to 1000)
//! min_pod_p99_target_ms = 0.05       # lower cohabit.io/p99-target-ms are raised to this
//! # api_url = "https://10.0.0.1:6443" # out of the cluster (in it: the service account),
//! # token_file = "/etc/cohabit/token", ca_file = "/etc/cohabit/ca.pem"
//! # insecure_http = false            # true: token_file may go to an http:// api_url
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use cohabit_collectors::cgroup::CpuList;
use cohabit_collectors::latency::{PushAddr, DEFAULT_MODE};
use cohabit_collectors::probe::{ProbeSettings, ProbeUrl};
use cohabit_collectors::users::{GroupRef, UserRef};
use cohabit_collectors::HostPaths;
use cohabit_core::window::MAX_LATENCY_WINDOW;
use serde::Deserialize;

use cohabit_policy::{ExploreConfig, ExploreRule, MlConfig, PolicyKind};

pub use super::host::layout::{BestEffortCpus, UnmanagedCache};

/// A configuration that failed to load; the message names the file and field.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {message}")]
pub struct ConfigError {
    /// The file.
    pub path: String,
    /// What is wrong.
    pub message: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default = "default_interval")]
    interval_ms: i64,
    #[serde(default = "default_policy")]
    policy: String,
    model: Option<PathBuf>,
    gpu_model: Option<PathBuf>,
    log: Option<PathBuf>,
    #[serde(default = "default_log_max_bytes")]
    log_max_bytes: i64,
    #[serde(default = "default_log_keep")]
    log_keep: i64,
    #[serde(default = "default_timeout")]
    collect_timeout_ms: i64,
    #[serde(default = "default_metrics")]
    metrics_addr: String,
    #[serde(default)]
    metrics_public: bool,
    #[serde(default = "default_fail_safe")]
    fail_safe_after_ticks: i64,
    #[serde(default = "default_latency_window")]
    latency_window: i64,
    #[serde(default = "default_model_check")]
    model_check_every_ticks: i64,
    explore: Option<ExploreFile>,
    /// `ml = { … }`: names checked by [`MlConfig::with_tunables`], not by serde, so that
    /// the table and `--ml` refuse the same things with the same words.
    ml: Option<BTreeMap<String, f64>>,
    #[serde(default)]
    host: HostFile,
    #[serde(default)]
    paths: PathsFile,
    #[serde(default)]
    mps: MpsFile,
    #[serde(default)]
    service: Vec<ServiceFile>,
    #[serde(default)]
    best_effort: Vec<BestEffortFile>,
    kubernetes: Option<KubernetesFile>,
}

fn default_interval() -> i64 {
    1000
}
fn default_policy() -> String {
    "parties".into()
}
fn default_timeout() -> i64 {
    500
}
fn default_fail_safe() -> i64 {
    20
}
fn default_latency_window() -> i64 {
    3
}
fn default_log_max_bytes() -> i64 {
    100_000_000
}
fn default_log_keep() -> i64 {
    5
}
fn default_metrics() -> String {
    "127.0.0.1:9464".into()
}
fn default_model_check() -> i64 {
    10
}

/// `explore = { … }`: every field optional, defaults from [`ExploreConfig::default`].
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ExploreFile {
    margin: Option<f64>,
    max_cores: Option<u32>,
    max_ways: Option<u32>,
    max_mba_steps: Option<u32>,
    min_cores: Option<u32>,
    min_ways: Option<u32>,
    seed: Option<u64>,
    /// `"informative"` (default) or `"walk"`.
    rule: Option<String>,
    beta: Option<f64>,
    min_information: Option<f64>,
    settle_ticks: Option<u32>,
}

impl ExploreFile {
    fn config(&self) -> Result<ExploreConfig, String> {
        let d = ExploreConfig::default();
        let rule = match self.rule.as_deref() {
            None => d.rule,
            Some("informative") => ExploreRule::Informative,
            Some("walk") => ExploreRule::Walk,
            Some(other) => {
                return Err(format!(
                    "explore.rule must be \"informative\" or \"walk\", not {other:?}"
                ))
            }
        };
        let cfg = ExploreConfig {
            margin: self.margin.unwrap_or(d.margin),
            max_cores: self.max_cores.unwrap_or(d.max_cores),
            max_ways: self.max_ways.unwrap_or(d.max_ways),
            max_mba_steps: self.max_mba_steps.unwrap_or(d.max_mba_steps),
            min_cores: self.min_cores.unwrap_or(d.min_cores),
            min_ways: self.min_ways.unwrap_or(d.min_ways),
            seed: self.seed.unwrap_or(d.seed),
            rule,
            beta: self.beta.unwrap_or(d.beta),
            min_information: self.min_information.unwrap_or(d.min_information),
            settle_ticks: self.settle_ticks.unwrap_or(d.settle_ticks),
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

/// `cohabit simulate --ml KEY=VALUE`: `ml`'s tunables from `KEY=VALUE` pairs, read as the
/// daemon reads its `ml = { … }` table ([`MlConfig::with_tunables`]: the same names,
/// defaults and checks; a later pair over an earlier one).
pub fn ml_settings(pairs: &[String]) -> Result<MlConfig, String> {
    let mut settings = Vec::with_capacity(pairs.len());
    for pair in pairs {
        let (key, value) = pair
            .split_once('=')
            .ok_or_else(|| format!("--ml {pair:?}: expected KEY=VALUE, like margin=0.95"))?;
        let value: f64 = value
            .trim()
            .parse()
            .map_err(|_| format!("--ml {pair:?}: {:?} is not a number", value.trim()))?;
        settings.push((key.trim(), value));
    }
    MlConfig::with_tunables(settings).map_err(|e| format!("--ml: {e}"))
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct HostFile {
    cpus: Option<String>,
    gpus: Option<i64>,
    mem_bw_gbps: Option<f64>,
    name: Option<String>,
    #[serde(default)]
    unmanaged_cache: UnmanagedCache,
    #[serde(default)]
    best_effort_cpus: BestEffortCpus,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct PathsFile {
    proc: Option<PathBuf>,
    sys: Option<PathBuf>,
    cgroup: Option<PathBuf>,
    resctrl: Option<PathBuf>,
    state_dir: Option<PathBuf>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ServiceFile {
    name: String,
    p99_target_ms: f64,
    #[serde(rename = "match")]
    matcher: MatchFile,
    #[serde(default)]
    placement: Placement,
    #[serde(default)]
    allow_unmanaged: bool,
    latency: LatencyFile,
    gpu: Option<GpuFile>,
    #[serde(default)]
    priority: i64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct GpuFile {
    #[serde(default)]
    index: i64,
    env_file: PathBuf,
    restart: String,
    #[serde(default = "default_restart_interval")]
    min_restart_interval_ms: i64,
    #[serde(default = "default_hook_timeout")]
    hook_timeout_ms: i64,
    #[serde(default)]
    mps_server: Option<String>,
}

fn default_hook_timeout() -> i64 {
    60_000
}

fn default_restart_interval() -> i64 {
    30_000
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct MpsFile {
    control: Option<PathBuf>,
    pipe_dir: Option<PathBuf>,
    pinned_mem_limit: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct BestEffortFile {
    name: String,
    #[serde(rename = "match")]
    matcher: MatchFile,
    #[serde(default)]
    placement: Placement,
    #[serde(default)]
    allow_unmanaged: bool,
    gpu: Option<GpuFile>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct MatchFile {
    process_name: Option<String>,
    cgroup: Option<String>,
    systemd_unit: Option<String>,
    pid_file: Option<PathBuf>,
    user: Option<IdFile>,
    exe: Option<PathBuf>,
}

/// A user or group as written: a name or a number.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
enum IdFile {
    Id(i64),
    Name(String),
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct LatencyFile {
    push: Option<String>,
    unix: Option<PathBuf>,
    prometheus: Option<String>,
    metric: Option<String>,
    unit_seconds: Option<f64>,
    #[serde(default)]
    unauthenticated: bool,
    owner: Option<IdFile>,
    group: Option<IdFile>,
    mode: Option<String>,
    #[serde(default)]
    allowed_users: Vec<IdFile>,
    #[serde(default)]
    allowed_groups: Vec<IdFile>,
    probe: Option<String>,
    rate_hz: Option<i64>,
    timeout_ms: Option<i64>,
}

/// Probe requests per second when `rate_hz` is not given.
pub const DEFAULT_PROBE_RATE_HZ: u32 = 100;
/// Probe time-out when `timeout_ms` is not given.
pub const DEFAULT_PROBE_TIMEOUT_MS: u64 = 1000;

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

/// How cohabit applies a service's CPU controls (`placement`; see `host::placement`).
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

/// How a GPU service's MPS share is published and applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuConfig {
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
pub struct MpsConfig {
    /// Path of `nvidia-cuda-mps-control`.
    pub control: PathBuf,
    /// `CUDA_MPS_PIPE_DIRECTORY`, if not the default.
    pub pipe_dir: Option<PathBuf>,
    /// Pinned device memory limit for clients, e.g. `0=8G` (written to the env files).
    pub pinned_mem_limit: Option<String>,
}

/// One managed service or job.
#[derive(Debug, Clone, PartialEq)]
pub struct ServiceConfig {
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
    /// start (see `host::reach`).
    pub allow_unmanaged: bool,
    /// Latency source, for latency-critical services.
    pub latency: Option<LatencySource>,
    /// GPU share handling, for GPU services.
    pub gpu: Option<GpuConfig>,
    /// Overload priority (higher wins; 0 unless a pod's `cohabit.io/priority` says).
    pub priority: i32,
}

/// A matcher any local user could satisfy, given without `match.user` to say whose
/// processes are the service's (security review 2026-12, row 2). Refused outside
/// `--dry-run` ([`ServiceConfig::unbound_matcher`]; `host::find::require_users`).
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

impl ServiceConfig {
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

/// A validated daemon configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct DaemonConfig {
    /// Control interval.
    pub interval_ms: u64,
    /// Control intervals whose requests one p99 rests on, at most: each service's latency
    /// histograms are merged over the intervals since what it runs under or its load last
    /// changed, up to this many (1 to [`MAX_LATENCY_WINDOW`]; 1: each interval's alone).
    pub latency_window: u32,
    /// Policy.
    pub policy: PolicyKind,
    /// The model `ml` uses.
    pub model: Option<PathBuf>,
    /// The model `ml` uses for the GPU services' shares (schema `qos-gpu`); without one
    /// they come from the online share model.
    pub gpu_model: Option<PathBuf>,
    /// Decision log, if any.
    pub log: Option<PathBuf>,
    /// Size at which the decision log is rotated.
    pub log_max_bytes: u64,
    /// Rotated decision logs kept (`decisions.jsonl.1` … `.N`).
    pub log_keep: u32,
    /// Longest a collection may take before the tick is skipped.
    pub collect_timeout_ms: u64,
    /// Where Prometheus metrics are served (`None`: not served).
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// CPUs managed (`None`: all online).
    pub cpus: Option<CpuList>,
    /// Peak memory bandwidth, if known.
    pub mem_bw_gbps: Option<f64>,
    /// Which cache processes cohabit does not manage may use (`[host] unmanaged_cache`).
    pub unmanaged_cache: UnmanagedCache,
    /// Where the best-effort pool may run (`[host] best_effort_cpus`).
    pub best_effort_cpus: BestEffortCpus,
    /// GPUs to plan for when NVML cannot list them.
    pub gpus: Option<u32>,
    /// MPS control.
    pub mps: MpsConfig,
    /// Host name for logs.
    pub host_name: String,
    /// Kernel interface roots.
    pub paths: HostPaths,
    /// The state directory: the single-instance lock and the record of every change in
    /// force (`[paths] state_dir`, default [`DEFAULT_STATE_DIR`](super::state::DEFAULT_STATE_DIR)).
    pub state_dir: PathBuf,
    /// Consecutive failed ticks after which the policy's fair-share initial plan is applied.
    pub fail_safe_after_ticks: u32,
    /// Every how many ticks `ml`'s model file is checked for a new version (0: never).
    pub model_check_every_ticks: u32,
    /// Safe exploration around the policy's plans (`explore = { … }` or `--explore`).
    pub explore: Option<ExploreConfig>,
    /// `ml`'s tunables (`ml = { … }`; the defaults otherwise).
    pub ml: MlConfig,
    /// Latency-critical services, then best-effort jobs.
    pub services: Vec<ServiceConfig>,
    /// `[kubernetes]`: more services come from this node's pods.
    pub kubernetes: Option<KubernetesConfig>,
}

impl DaemonConfig {
    /// Reads and validates a configuration file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            path: path.display().to_string(),
            message: format!("cannot read: {e}"),
        })?;
        Self::parse(&text, &path.display().to_string())
    }

    /// Parses and validates configuration text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Self, ConfigError> {
        Self::parse_with_env(text, origin, &|k| std::env::var(k).ok())
    }

    /// [`Self::parse`] with the environment read through `env` (`NODE_NAME`).
    // TODO(issue 47): split with the config rewrite
    #[allow(clippy::too_many_lines)]
    pub fn parse_with_env(
        text: &str,
        origin: &str,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Self, ConfigError> {
        let err = |message: String| ConfigError {
            path: origin.to_string(),
            message,
        };
        let f: File = toml::from_str(text).map_err(|e| err(e.to_string()))?;
        if !(10..=3_600_000).contains(&f.interval_ms) {
            return Err(err(format!(
                "interval_ms must be between 10 and 3600000, got {}",
                f.interval_ms
            )));
        }
        if !(1..=i64::from(MAX_LATENCY_WINDOW)).contains(&f.latency_window) {
            return Err(err(format!(
                "latency_window must be between 1 and {MAX_LATENCY_WINDOW} control intervals, got {}",
                f.latency_window
            )));
        }
        if !(1..=600_000).contains(&f.collect_timeout_ms) {
            return Err(err(format!(
                "collect_timeout_ms must be between 1 and 600000, got {}",
                f.collect_timeout_ms
            )));
        }
        if f.log_max_bytes < 65_536 {
            return Err(err(format!(
                "log_max_bytes must be at least 65536 (a record is a few KB), got {}",
                f.log_max_bytes
            )));
        }
        if !(0..=1000).contains(&f.log_keep) {
            return Err(err(format!(
                "log_keep must be between 0 and 1000, got {}",
                f.log_keep
            )));
        }
        if !(1..=1_000_000).contains(&f.fail_safe_after_ticks) {
            return Err(err(format!(
                "fail_safe_after_ticks must be between 1 and 1000000, got {}",
                f.fail_safe_after_ticks
            )));
        }
        let state_dir = f
            .paths
            .state_dir
            .clone()
            .unwrap_or_else(|| super::state::DEFAULT_STATE_DIR.into());
        if !state_dir.is_absolute() {
            return Err(err(format!(
                "paths.state_dir must be an absolute path, got {}",
                state_dir.display()
            )));
        }
        if f.policy == "oracle" {
            return Err(err("policy: oracle needs the simulator's ground truth; use static or parties on a real host".into()));
        }
        let policy: PolicyKind = f
            .policy
            .parse()
            .map_err(|e: String| err(format!("policy: {e}")))?;
        if policy == PolicyKind::Ml && f.model.is_none() {
            return Err(err(
                "policy: ml needs model = \"path/to/model.json\" (see cohabit-train fit)".into(),
            ));
        }
        // A table that would do nothing is a mistake, not a setting: say so.
        if f.ml.is_some() && policy != PolicyKind::Ml {
            return Err(err(format!(
                "ml: these are the tunables of policy = \"ml\", but the policy is {policy:?}; remove the ml table or set policy = \"ml\"",
                policy = policy.name()
            )));
        }
        let ml = match &f.ml {
            Some(table) => {
                MlConfig::with_tunables(table.iter().map(|(k, v)| (k.as_str(), *v))).map_err(err)?
            }
            None => MlConfig::default(),
        };
        let metrics_addr = if f.metrics_addr.trim().is_empty() {
            None
        } else {
            Some(f.metrics_addr.parse::<std::net::SocketAddr>().map_err(|e| {
                err(format!("metrics_addr {:?} is not an address like 127.0.0.1:9464 ({e}); use \"\" to disable", f.metrics_addr))
            })?)
        };
        if let Some(addr) = metrics_addr.filter(|a| !a.ip().is_loopback() && !f.metrics_public) {
            return Err(err(format!(
                "metrics_addr {addr} is not a loopback address; the endpoint has no authentication and shows service names, targets and allocations, so set metrics_public = true to serve it there"
            )));
        }
        check_host(&f.host, &f.mps).map_err(err)?;
        let cpus = f
            .host
            .cpus
            .as_deref()
            .map(|c| {
                c.parse::<CpuList>()
                    .map_err(|e| err(format!("host.cpus: {e}")))
            })
            .transpose()?;
        if cpus.as_ref().is_some_and(|c| c.0.is_empty()) {
            return Err(err("host.cpus must list at least one CPU".into()));
        }
        if let Some(bw) = f.host.mem_bw_gbps {
            if !(bw.is_finite() && bw > 0.0) {
                return Err(err(format!(
                    "host.mem_bw_gbps must be a positive number, got {bw}"
                )));
            }
        }
        let std_paths = HostPaths::standard();
        let paths = HostPaths {
            proc: f.paths.proc.unwrap_or(std_paths.proc),
            sys: f.paths.sys.unwrap_or(std_paths.sys),
            cgroup: f.paths.cgroup.unwrap_or(std_paths.cgroup),
            resctrl: f.paths.resctrl,
        };
        let mut services = Vec::new();
        for s in f.service {
            let who = format!("service {}", s.name);
            if !(s.p99_target_ms.is_finite() && s.p99_target_ms > 0.0) {
                return Err(err(format!(
                    "{who}: p99_target_ms must be a positive number, got {}",
                    s.p99_target_ms
                )));
            }
            services.push(ServiceConfig {
                gpu: s
                    .gpu
                    .as_ref()
                    .map(|g| gpu(g).map_err(|m| err(format!("{who}: {m}"))))
                    .transpose()?,
                matcher: matcher(&s.matcher).map_err(|m| err(format!("{who}: {m}")))?,
                constraint: constraint(&s.matcher).map_err(|m| err(format!("{who}: {m}")))?,
                placement: s.placement,
                allow_unmanaged: s.allow_unmanaged,
                latency: Some(latency(&s.latency).map_err(|m| err(format!("{who}: {m}")))?),
                p99_target_ms: Some(s.p99_target_ms),
                priority: i32::try_from(s.priority)
                    .ok()
                    .filter(|p| (-1000..=1000).contains(p))
                    .ok_or_else(|| {
                        err(format!(
                            "{who}: priority must be a whole number from -1000 to 1000, got {}",
                            s.priority
                        ))
                    })?,
                name: s.name,
            });
        }
        let kubernetes = f
            .kubernetes
            .as_ref()
            .map(|k| kubernetes(k, env, f.collect_timeout_ms.unsigned_abs()))
            .transpose()
            .map_err(err)?;
        if services.is_empty() && kubernetes.is_none() {
            return Err(err(
                "needs at least one [[service]] (latency-critical), or a [kubernetes] section to take services from pods".into()
            ));
        }
        for b in f.best_effort {
            let who = format!("best_effort {}", b.name);
            services.push(ServiceConfig {
                gpu: b
                    .gpu
                    .as_ref()
                    .map(|g| gpu(g).map_err(|m| err(format!("{who}: {m}"))))
                    .transpose()?,
                matcher: matcher(&b.matcher).map_err(|m| err(format!("{who}: {m}")))?,
                constraint: constraint(&b.matcher).map_err(|m| err(format!("{who}: {m}")))?,
                placement: b.placement,
                allow_unmanaged: b.allow_unmanaged,
                latency: None,
                p99_target_ms: None,
                priority: 0,
                name: b.name,
            });
        }
        let mut seen = BTreeSet::new();
        for s in &services {
            cohabit_core::name::check_service_name(&s.name).map_err(|e| {
                err(format!(
                    "service name: {e} (a name is 1-{} characters of [A-Za-z0-9._-])",
                    cohabit_core::name::SERVICE_NAME_MAX
                ))
            })?;
            if s.name == cohabit_core::BEST_EFFORT_GROUP {
                return Err(err(format!(
                    "service name {:?} is reserved for the best-effort pool",
                    s.name
                )));
            }
            if !seen.insert(s.name.clone()) {
                return Err(err(format!("service name {:?} is used twice", s.name)));
            }
        }
        check_shared(&services, f.interval_ms.unsigned_abs()).map_err(err)?;
        let model_check_every_ticks = u32::try_from(f.model_check_every_ticks).map_err(|_| {
            err(format!(
                "model_check_every_ticks must be a whole number >= 0, got {}",
                f.model_check_every_ticks
            ))
        })?;
        let explore = f
            .explore
            .as_ref()
            .map(ExploreFile::config)
            .transpose()
            .map_err(err)?;
        Ok(Self {
            interval_ms: f.interval_ms.unsigned_abs(),
            latency_window: u32::try_from(f.latency_window).unwrap_or(MAX_LATENCY_WINDOW),
            policy,
            model: f.model,
            gpu_model: f.gpu_model,
            log: f.log,
            log_max_bytes: f.log_max_bytes.unsigned_abs(),
            log_keep: u32::try_from(f.log_keep).unwrap_or(0),
            collect_timeout_ms: f.collect_timeout_ms.unsigned_abs(),
            metrics_addr,
            cpus,
            mem_bw_gbps: f.host.mem_bw_gbps,
            unmanaged_cache: f.host.unmanaged_cache,
            best_effort_cpus: f.host.best_effort_cpus,
            gpus: f
                .host
                .gpus
                .map(|g| {
                    u32::try_from(g)
                        .map_err(|_| err(format!("host.gpus must be a whole number >= 0, got {g}")))
                })
                .transpose()?,
            mps: MpsConfig {
                control: f
                    .mps
                    .control
                    .unwrap_or_else(|| "/usr/bin/nvidia-cuda-mps-control".into()),
                pipe_dir: f.mps.pipe_dir,
                pinned_mem_limit: f.mps.pinned_mem_limit,
            },
            // A node agent's logs are told apart by node when fleets retrain from them.
            host_name: f.host.name.unwrap_or_else(|| {
                kubernetes
                    .as_ref()
                    .map_or_else(|| "this host".into(), |k| k.node_name.clone())
            }),
            paths,
            state_dir,
            fail_safe_after_ticks: u32::try_from(f.fail_safe_after_ticks).unwrap_or(u32::MAX),
            model_check_every_ticks,
            explore,
            ml,
            services,
            kubernetes,
        })
    }
}

fn matcher(m: &MatchFile) -> Result<Matcher, String> {
    let mut found = Vec::new();
    if let Some(n) = &m.process_name {
        found.push(Matcher::ProcessName(n.clone()));
    }
    if let Some(c) = &m.cgroup {
        found.push(Matcher::Cgroup(c.clone()));
    }
    if let Some(u) = &m.systemd_unit {
        if u.contains('/') {
            return Err(format!(
                "match.systemd_unit {u:?} must be a unit name, not a path"
            ));
        }
        found.push(Matcher::SystemdUnit(u.clone()));
    }
    if let Some(p) = &m.pid_file {
        found.push(Matcher::PidFile(p.clone()));
    }
    match found.len() {
        1 => Ok(found.remove(0)),
        0 => Err("match needs one of process_name, cgroup, systemd_unit, pid_file".into()),
        _ => Err(
            "match must have exactly one of process_name, cgroup, systemd_unit, pid_file".into(),
        ),
    }
}

fn user_ref(key: &str, v: &IdFile) -> Result<UserRef, String> {
    match v {
        IdFile::Id(id) => u32::try_from(*id)
            .map(UserRef::Id)
            .map_err(|_| format!("{key} must be a user name or a uid >= 0, got {id}")),
        IdFile::Name(n) if !n.is_empty() => Ok(UserRef::Name(n.clone())),
        IdFile::Name(_) => Err(format!("{key} must not be empty")),
    }
}

fn group_ref(key: &str, v: &IdFile) -> Result<GroupRef, String> {
    match v {
        IdFile::Id(id) => u32::try_from(*id)
            .map(GroupRef::Id)
            .map_err(|_| format!("{key} must be a group name or a gid >= 0, got {id}")),
        IdFile::Name(n) if !n.is_empty() => Ok(GroupRef::Name(n.clone())),
        IdFile::Name(_) => Err(format!("{key} must not be empty")),
    }
}

/// `match.user` and `match.exe`.
fn constraint(m: &MatchFile) -> Result<ProcessConstraint, String> {
    if let Some(exe) = m.exe.as_ref().filter(|e| !e.is_absolute()) {
        return Err(format!(
            "match.exe {} must be an absolute path",
            exe.display()
        ));
    }
    Ok(ProcessConstraint {
        user: m
            .user
            .as_ref()
            .map(|u| user_ref("match.user", u))
            .transpose()?,
        exe: m.exe.clone(),
    })
}

/// The longest `comm`: the kernel keeps 15 bytes of a process's name (`TASK_COMM_LEN`).
const COMM_MAX: usize = 15;
/// Most CPUs `host.cpus` may list.
const MAX_CPUS: u64 = 4096;
/// Most GPUs `host.gpus` may declare.
const MAX_GPUS: i64 = 64;

/// Checks a matcher's value alone (what `matcher` could not).
fn check_matcher(m: &Matcher) -> Result<(), String> {
    match m {
        Matcher::ProcessName(n) if n.is_empty() || n.len() > COMM_MAX => Err(format!(
            "match.process_name {n:?} is {} bytes; the kernel keeps at most {COMM_MAX} bytes of a process name, so it would never match (use the first {COMM_MAX})",
            n.len()
        )),
        Matcher::Pod { cgroups, .. } => cgroups
            .iter()
            .try_for_each(|c| check_matcher(&Matcher::Cgroup(c.clone()))),
        Matcher::Cgroup(c) => {
            let parts: Vec<&str> = c.split('/').filter(|p| !p.is_empty()).collect();
            if !c.starts_with('/') || parts.is_empty() {
                Err(format!(
                    "match.cgroup {c:?} must be a cgroup path below the root, such as /system.slice/x.service (the root holds every process)"
                ))
            } else if parts.iter().any(|p| *p == ".." || *p == ".") {
                Err(format!("match.cgroup {c:?} must not contain . or .."))
            } else {
                Ok(())
            }
        }
        _ => Ok(()),
    }
}

/// A Unix push socket path: absolute, not a directory.
fn unix_path(p: &Path) -> Result<PathBuf, String> {
    if !p.is_absolute() || p.file_name().is_none() {
        return Err(format!(
            "latency.unix {} must be an absolute path to a socket file",
            p.display()
        ));
    }
    Ok(p.to_path_buf())
}

/// `owner`, `group`, `mode`, `allowed_users` and `allowed_groups` of a Unix push socket.
fn push_access(l: &LatencyFile) -> Result<PushAccess, String> {
    let mode = match &l.mode {
        None => DEFAULT_MODE,
        Some(m) => u32::from_str_radix(m, 8)
            .ok()
            .filter(|v| *v <= 0o777 && !m.is_empty() && m.len() <= 4)
            .ok_or_else(|| {
                format!("latency.mode {m:?} must be octal permission bits such as \"0660\"")
            })?,
    };
    Ok(PushAccess {
        owner: l
            .owner
            .as_ref()
            .map(|o| user_ref("latency.owner", o))
            .transpose()?,
        group: l
            .group
            .as_ref()
            .map(|g| group_ref("latency.group", g))
            .transpose()?,
        mode,
        allowed_users: l
            .allowed_users
            .iter()
            .map(|u| user_ref("latency.allowed_users", u))
            .collect::<Result<_, _>>()?,
        allowed_groups: l
            .allowed_groups
            .iter()
            .map(|g| group_ref("latency.allowed_groups", g))
            .collect::<Result<_, _>>()?,
    })
}

/// How many CPUs a CPU list names, counted without expanding it (`0-4294967295` must not
/// allocate 16 GiB before it is refused); `None` if it is not a list of numbers and ranges.
fn cpu_list_len(text: &str) -> Option<u64> {
    let mut n = 0u64;
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        let (a, b) = (a.trim().parse::<u64>().ok()?, b.trim().parse::<u64>().ok()?);
        n = n.saturating_add(b.checked_sub(a)?.saturating_add(1));
    }
    Some(n)
}

/// Whether a pinned device memory limit is `DEVICE=AMOUNT[KMG]`, such as `0=8G`: it is
/// written into environment files, so nothing else may pass.
fn pinned_limit_ok(v: &str) -> bool {
    let Some((dev, amount)) = v.split_once('=') else {
        return false;
    };
    let Some(num) = amount.strip_suffix(['K', 'M', 'G']) else {
        return false;
    };
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    digits(dev) && digits(num)
}

/// `[host]` sizes and the MPS pinned limit.
fn check_host(h: &HostFile, mps: &MpsFile) -> Result<(), String> {
    if let Some(c) = &h.cpus {
        if cpu_list_len(c).is_some_and(|n| n > MAX_CPUS) {
            return Err(format!("host.cpus {c:?} lists more than {MAX_CPUS} CPUs"));
        }
    }
    if let Some(g) = h.gpus.filter(|g| *g > MAX_GPUS) {
        return Err(format!("host.gpus must be at most {MAX_GPUS}, got {g}"));
    }
    if let Some(p) = mps
        .pinned_mem_limit
        .as_deref()
        .filter(|p| !pinned_limit_ok(p))
    {
        return Err(format!(
            "mps.pinned_mem_limit {p:?} must look like 0=8G (a device, =, a number and K, M or G)"
        ));
    }
    Ok(())
}

/// Checks across services: each matcher on its own, then nothing that two services would
/// fight over (a matcher, a push address or socket path, an environment file), and hooks
/// spaced at least a tick apart.
fn check_shared(services: &[ServiceConfig], interval_ms: u64) -> Result<(), String> {
    let mut seen: std::collections::BTreeMap<String, String> = std::collections::BTreeMap::new();
    for s in services {
        check_matcher(&s.matcher).map_err(|m| format!("{}: {m}", s.name))?;
        let mut keys = vec![match &s.matcher {
            Matcher::ProcessName(n) => format!("match.process_name {n:?}"),
            Matcher::Cgroup(c) => format!("match.cgroup {c:?}"),
            Matcher::SystemdUnit(u) => format!("match.systemd_unit {u:?}"),
            Matcher::PidFile(p) => format!("match.pid_file {:?}", p.display().to_string()),
            Matcher::Pod { uid, .. } => format!("pod {uid}"),
        }];
        match &s.latency {
            Some(LatencySource::Push {
                addr: PushAddr::Udp(a),
                ..
            }) if a.port() != 0 => keys.push(format!("latency.push \"{a}\"")),
            Some(LatencySource::Push {
                addr: PushAddr::Unix(p),
                ..
            }) => keys.push(format!("latency.unix {:?}", p.display().to_string())),
            _ => {}
        }
        if let Some(g) = &s.gpu {
            keys.push(format!(
                "gpu.env_file {:?}",
                g.env_file.display().to_string()
            ));
            if g.min_restart_interval_ms < interval_ms {
                return Err(format!(
                    "{}: gpu.min_restart_interval_ms ({}) must be at least interval_ms ({interval_ms}), or a failing hook reruns every tick",
                    s.name, g.min_restart_interval_ms
                ));
            }
        }
        for key in keys {
            if let Some(first) = seen.insert(key.clone(), s.name.clone()) {
                return Err(format!(
                    "{key} is used by both {first} and {}; each service needs its own",
                    s.name
                ));
            }
        }
    }
    Ok(())
}

fn gpu(g: &GpuFile) -> Result<GpuConfig, String> {
    let index =
        u32::try_from(g.index).map_err(|_| format!("gpu.index must be >= 0, got {}", g.index))?;
    if g.restart.trim().is_empty() {
        return Err("gpu.restart must be a command that restarts the service's MPS client".into());
    }
    if g.min_restart_interval_ms < 0 {
        return Err(format!(
            "gpu.min_restart_interval_ms must be >= 0, got {}",
            g.min_restart_interval_ms
        ));
    }
    if !(1..=3_600_000).contains(&g.hook_timeout_ms) {
        return Err(format!(
            "gpu.hook_timeout_ms must be between 1 and 3600000, got {}",
            g.hook_timeout_ms
        ));
    }
    if let Some(name) = g.mps_server.as_deref().filter(|n| {
        n.is_empty()
            || !n
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    }) {
        return Err(format!(
            "gpu.mps_server {name:?} must be a name of letters, digits, -, _ and ."
        ));
    }
    Ok(GpuConfig {
        index,
        env_file: g.env_file.clone(),
        restart: g.restart.clone(),
        min_restart_interval_ms: g.min_restart_interval_ms.unsigned_abs(),
        hook_timeout_ms: g.hook_timeout_ms.unsigned_abs(),
        mps_server: g.mps_server.clone(),
    })
}

fn latency(l: &LatencyFile) -> Result<LatencySource, String> {
    if l.probe.is_none() && (l.rate_hz.is_some() || l.timeout_ms.is_some()) {
        return Err("latency.rate_hz and latency.timeout_ms go with probe".into());
    }
    if l.prometheus.is_none() && (l.metric.is_some() || l.unit_seconds.is_some()) {
        return Err("latency.metric and latency.unit_seconds go with prometheus".into());
    }
    if l.push.is_none() && l.unauthenticated {
        return Err("latency.unauthenticated goes with push (UDP)".into());
    }
    let unix_keys = l.owner.is_some()
        || l.group.is_some()
        || l.mode.is_some()
        || !l.allowed_users.is_empty()
        || !l.allowed_groups.is_empty();
    if l.unix.is_none() && unix_keys {
        return Err(
            "latency.owner, group, mode, allowed_users and allowed_groups go with unix".into(),
        );
    }
    match (&l.push, &l.unix, &l.prometheus, &l.probe) {
        (None, None, None, Some(url)) => probe(url, l),
        (Some(addr), None, None, None) => {
            let a: std::net::SocketAddr = addr.parse().map_err(|e| {
                format!("latency.push {addr:?} is not an address like 127.0.0.1:9400 ({e})")
            })?;
            if !a.ip().is_loopback() {
                return Err(format!("latency.push {addr:?} must be a loopback address"));
            }
            if !l.unauthenticated {
                return Err(format!(
                    "latency.push {addr:?} needs unauthenticated = true: any local user or container on the host network can send to a UDP port and steer the allocation; use unix = \"/run/cohabit/NAME.sock\" to accept only the service's processes"
                ));
            }
            Ok(LatencySource::Push {
                addr: PushAddr::Udp(a),
                access: PushAccess::default(),
            })
        }
        (None, Some(p), None, None) => Ok(LatencySource::Push {
            addr: PushAddr::Unix(unix_path(p)?),
            access: push_access(l)?,
        }),
        (None, None, Some(url), None) => {
            if !url.starts_with("http://") {
                return Err(format!("latency.prometheus {url:?} must be an http:// URL"));
            }
            if url.chars().any(|c| c.is_whitespace() || c.is_control()) {
                return Err(format!(
                    "latency.prometheus {url:?} contains white space or control characters"
                ));
            }
            let metric = l
                .metric
                .clone()
                .ok_or("latency.metric is required with prometheus")?;
            let unit_seconds = l.unit_seconds.unwrap_or(1.0);
            if !(unit_seconds.is_finite() && unit_seconds > 0.0) {
                return Err(format!(
                    "latency.unit_seconds must be positive, got {unit_seconds}"
                ));
            }
            Ok(LatencySource::Prometheus {
                url: url.clone(),
                metric,
                unit_seconds,
            })
        }
        _ => Err("latency needs exactly one of push, unix, prometheus, probe".into()),
    }
}

fn probe(url: &str, l: &LatencyFile) -> Result<LatencySource, String> {
    let parsed: ProbeUrl = url.parse().map_err(|e| format!("latency.probe: {e}"))?;
    let rate_hz = match l.rate_hz {
        None => DEFAULT_PROBE_RATE_HZ,
        Some(r) => u32::try_from(r)
            .ok()
            .filter(|r| (1..=cohabit_collectors::probe::MAX_RATE_HZ).contains(r))
            .ok_or_else(|| {
                format!(
                    "latency.rate_hz must be from 1 to {}, got {r}",
                    cohabit_collectors::probe::MAX_RATE_HZ
                )
            })?,
    };
    let timeout_ms = match l.timeout_ms {
        None => DEFAULT_PROBE_TIMEOUT_MS,
        Some(t) if t > 0 && t <= 600_000 => t.unsigned_abs(),
        Some(t) => {
            return Err(format!(
                "latency.timeout_ms must be from 1 to 600000, got {t}"
            ))
        }
    };
    ProbeSettings {
        rate_hz,
        timeout: std::time::Duration::from_millis(timeout_ms),
    }
    .validate(url)
    .map_err(|e| format!("latency: {e}"))?;
    Ok(LatencySource::Probe {
        url: parsed,
        rate_hz,
        timeout_ms,
    })
}

// ---- [kubernetes] ----------------------------------------------------------------------

/// `[kubernetes]` as written (its presence turns pod discovery on).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct KubernetesFile {
    node_name: Option<String>,
    #[serde(default = "default_driver")]
    cgroup_driver: String,
    cgroup_root: Option<String>,
    kubelet_dir: Option<PathBuf>,
    api_url: Option<String>,
    token_file: Option<PathBuf>,
    ca_file: Option<PathBuf>,
    #[serde(default)]
    insecure_http: bool,
    socket_dir: Option<PathBuf>,
    #[serde(default)]
    latency_critical_namespaces: Vec<String>,
    #[serde(default = "default_max_pod_priority")]
    max_pod_priority: i64,
    #[serde(default = "default_min_pod_target")]
    min_pod_p99_target_ms: f64,
}

fn default_max_pod_priority() -> i64 {
    i64::from(cohabit_kube::trust::DEFAULT_MAX_POD_PRIORITY)
}

fn default_min_pod_target() -> f64 {
    cohabit_kube::trust::DEFAULT_MIN_POD_P99_TARGET_MS
}

fn default_driver() -> String {
    "auto".into()
}

/// The kubelet's directory when `kubelet_dir` is not given.
pub const DEFAULT_KUBELET_DIR: &str = "/var/lib/kubelet";
/// Where pods' Unix push sockets may be, when `socket_dir` is not given.
pub const DEFAULT_POD_SOCKET_DIR: &str = "/run/cohabit/pods";

/// How the daemon reaches the API server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KubeApi {
    /// The pod's service account (the DaemonSet).
    InCluster,
    /// An explicit server (`api_url`), for out-of-cluster use and tests.
    Url {
        /// `https://host:port`, or `http://host:port` (with a token only when
        /// `insecure_http` is set).
        url: String,
        /// A file holding the bearer token.
        token_file: Option<PathBuf>,
        /// The CA bundle (PEM) to trust.
        ca_file: Option<PathBuf>,
        /// `insecure_http = true`: a bearer token may go over plain http.
        insecure_http: bool,
    },
}

/// The highest rate a pod's probe may ask for.
pub const MAX_POD_PROBE_RATE_HZ: u32 = 200;
/// The longest request path (or Prometheus URL) a pod's annotation may give, in bytes.
pub const MAX_POD_URL_BYTES: usize = 2048;

/// `[kubernetes]`, validated: services also come from the pods of this node.
#[derive(Debug, Clone, PartialEq)]
pub struct KubernetesConfig {
    /// This node's name (`node_name`, else the environment variable `NODE_NAME`).
    pub node_name: String,
    /// The kubelet's cgroup driver; `None`: detected from which kubepods tree exists.
    pub cgroup_driver: Option<cohabit_collectors::kubepods::Driver>,
    /// The kubelet's `--cgroup-root` (`/` by default).
    pub cgroup_root: String,
    /// The kubelet's directory (`cpu_manager_state` is read there).
    pub kubelet_dir: PathBuf,
    /// The API server.
    pub api: KubeApi,
    /// The directory of pods' Unix sockets: a pod's `cohabit.io/latency` may name only
    /// `<socket_dir>/<namespace>.<name>.sock`.
    pub socket_dir: PathBuf,
    /// What pods may claim: which namespaces may be latency-critical, the highest
    /// priority, the lowest target (`latency_critical_namespaces`, `max_pod_priority`,
    /// `min_pod_p99_target_ms`).
    pub trust: cohabit_kube::trust::PodTrust,
    /// The longest time-out a pod's probe may ask for: the daemon's `collect_timeout_ms`.
    pub max_pod_probe_timeout_ms: u64,
}

/// Validates `[kubernetes]`; `env` reads the environment (`NODE_NAME`);
/// `collect_timeout_ms` bounds pods' probe time-outs.
fn kubernetes(
    k: &KubernetesFile,
    env: &dyn Fn(&str) -> Option<String>,
    collect_timeout_ms: u64,
) -> Result<KubernetesConfig, String> {
    let node_name = match (&k.node_name, env("NODE_NAME")) {
        (Some(n), _) => n.clone(),
        (None, Some(n)) if !n.is_empty() => n,
        _ => {
            return Err("kubernetes.node_name is not set and neither is the environment variable NODE_NAME (the DaemonSet sets it from spec.nodeName)".into())
        }
    };
    let dns = !node_name.is_empty()
        && node_name.len() <= 253
        && node_name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.');
    if !dns {
        return Err(format!(
            "kubernetes.node_name {node_name:?} is not a node name (lowercase letters, digits, - and ., at most 253)"
        ));
    }
    use cohabit_collectors::kubepods::Driver;
    let cgroup_driver = match k.cgroup_driver.as_str() {
        "auto" => None,
        "cgroupfs" => Some(Driver::Cgroupfs),
        "systemd" => Some(Driver::Systemd),
        other => {
            return Err(format!(
                "kubernetes.cgroup_driver {other:?} must be auto, cgroupfs or systemd"
            ))
        }
    };
    let cgroup_root = k.cgroup_root.clone().unwrap_or_else(|| "/".into());
    if !cgroup_root.starts_with('/') || cgroup_root.split('/').any(|p| p == "." || p == "..") {
        return Err(format!(
            "kubernetes.cgroup_root {cgroup_root:?} must be an absolute cgroup path without . or .. (the kubelet's --cgroup-root)"
        ));
    }
    let absolute = |key: &str, p: &Path| {
        if p.is_absolute() {
            Ok(p.to_path_buf())
        } else {
            Err(format!(
                "kubernetes.{key} {} must be an absolute path",
                p.display()
            ))
        }
    };
    let kubelet_dir = absolute(
        "kubelet_dir",
        k.kubelet_dir
            .as_deref()
            .unwrap_or(Path::new(DEFAULT_KUBELET_DIR)),
    )?;
    let socket_dir = absolute(
        "socket_dir",
        k.socket_dir
            .as_deref()
            .unwrap_or(Path::new(DEFAULT_POD_SOCKET_DIR)),
    )?;
    let api = kube_api(k)?;
    Ok(KubernetesConfig {
        node_name,
        cgroup_driver,
        cgroup_root,
        kubelet_dir,
        api,
        socket_dir,
        trust: pod_trust(k)?,
        max_pod_probe_timeout_ms: collect_timeout_ms,
    })
}

/// `api_url`, `token_file`, `ca_file` and `insecure_http`, checked: the API server.
fn kube_api(k: &KubernetesFile) -> Result<KubeApi, String> {
    let absolute = |key: &str, p: &Path| {
        if p.is_absolute() {
            Ok(p.to_path_buf())
        } else {
            Err(format!(
                "kubernetes.{key} {} must be an absolute path",
                p.display()
            ))
        }
    };
    if k.insecure_http && k.api_url.is_none() {
        return Err("kubernetes.insecure_http goes with an http:// api_url".into());
    }
    Ok(match &k.api_url {
        None if k.token_file.is_some() || k.ca_file.is_some() => {
            return Err("kubernetes.token_file and ca_file go with api_url (in the cluster the service account's are used)".into())
        }
        None => KubeApi::InCluster,
        Some(url) => {
            let ok = ["https://", "http://"].iter().any(|scheme| {
                url.strip_prefix(scheme)
                    .is_some_and(|r| !r.is_empty() && !r.contains(char::is_whitespace))
            });
            if !ok {
                return Err(format!(
                    "kubernetes.api_url {url:?} must be an https:// (or http://) URL"
                ));
            }
            if url.starts_with("http://") && k.token_file.is_some() && !k.insecure_http {
                return Err(format!(
                    "kubernetes.api_url {url:?} would send the bearer token (token_file) in clear: use https://, or set insecure_http = true for a test server on a trusted path"
                ));
            }
            KubeApi::Url {
                insecure_http: k.insecure_http,
                url: url.clone(),
                token_file: k
                    .token_file
                    .as_deref()
                    .map(|p| absolute("token_file", p))
                    .transpose()?,
                ca_file: k
                    .ca_file
                    .as_deref()
                    .map(|p| absolute("ca_file", p))
                    .transpose()?,
            }
        }
    })
}

/// `latency_critical_namespaces`, `max_pod_priority` and `min_pod_p99_target_ms`, checked.
fn pod_trust(k: &KubernetesFile) -> Result<cohabit_kube::trust::PodTrust, String> {
    use cohabit_kube::trust::{MAX_PRIORITY, MIN_POD_P99_TARGET_FLOOR_MS, MIN_PRIORITY};
    let mut namespaces = BTreeSet::new();
    for ns in &k.latency_critical_namespaces {
        // A namespace name is an RFC 1123 label.
        let label = !ns.is_empty()
            && ns.len() <= 63
            && ns
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !ns.starts_with('-')
            && !ns.ends_with('-');
        if !label {
            return Err(format!(
                "kubernetes.latency_critical_namespaces: {ns:?} is not a namespace name (lowercase letters, digits and -, at most 63)"
            ));
        }
        if !namespaces.insert(ns.clone()) {
            return Err(format!(
                "kubernetes.latency_critical_namespaces: {ns:?} is listed twice"
            ));
        }
    }
    let max_priority = i32::try_from(k.max_pod_priority)
        .ok()
        .filter(|p| (MIN_PRIORITY..=MAX_PRIORITY).contains(p))
        .ok_or_else(|| {
            format!(
                "kubernetes.max_pod_priority must be a whole number from {MIN_PRIORITY} to {MAX_PRIORITY} (the bounds of configured services), got {}",
                k.max_pod_priority
            )
        })?;
    let floor = k.min_pod_p99_target_ms;
    if !(MIN_POD_P99_TARGET_FLOOR_MS..=cohabit_kube::annotations::MAX_P99_TARGET_MS)
        .contains(&floor)
    {
        return Err(format!(
            "kubernetes.min_pod_p99_target_ms must be from {MIN_POD_P99_TARGET_FLOOR_MS} to {} milliseconds, got {floor}",
            cohabit_kube::annotations::MAX_P99_TARGET_MS
        ));
    }
    Ok(cohabit_kube::trust::PodTrust {
        latency_critical_namespaces: namespaces,
        max_priority,
        min_p99_target_ms: floor,
    })
}

/// A pod's `cohabit.io/latency` annotation as a latency source: a probe URL
/// (`memcached://`, `redis://`, `http://`, with the default rate and a time-out of at most
/// `collect_timeout_ms`), or an inline table with the keys of a `[[service]]`'s `latency`,
/// checked the same way, e.g.
/// `{ prometheus = "http://10.0.0.5:9150/metrics", metric = "request_duration_seconds" }`.
///
/// The annotation comes from whoever may create pods, and cohabit acts on it as root, so
/// more is refused than in a `[[service]]`:
/// - UDP `push` (the root daemon would bind whatever loopback port the pod names, and every
///   local user could send to it);
/// - a Unix socket anywhere but `<socket_dir>/<namespace>.<name>.sock` (one pod must not
///   take another's path);
/// - a probe's `rate_hz` above [`MAX_POD_PROBE_RATE_HZ`] or `timeout_ms` above the daemon's
///   `collect_timeout_ms`, and a request path or Prometheus URL longer than
///   [`MAX_POD_URL_BYTES`];
/// - any address but the pod's own (`ips`).
pub fn pod_latency(
    text: &str,
    pod: &cohabit_kube::PodKey,
    ips: &[std::net::IpAddr],
    k: &KubernetesConfig,
) -> Result<LatencySource, String> {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Wrapper {
        latency: LatencyFile,
    }
    let t = text.trim();
    let mut file = if t.starts_with('{') {
        toml::from_str::<Wrapper>(&format!("latency = {t}"))
            .map_err(|e| format!("not a latency table: {}", e.message()))?
            .latency
    } else {
        LatencyFile {
            probe: Some(t.to_string()),
            ..LatencyFile::default()
        }
    };
    if file.push.is_some() {
        return Err(format!(
            "latency.push: a pod cannot push over UDP (any local user could send to the port); use unix = \"{}\"",
            pod_socket(pod, k).display()
        ));
    }
    pod_probe_limits(&mut file, k.max_pod_probe_timeout_ms)?;
    let source = latency(&file)?;
    match &source {
        LatencySource::Push {
            addr: PushAddr::Unix(p),
            ..
        } => {
            let only = pod_socket(pod, k);
            if *p != only {
                return Err(format!(
                    "latency.unix {} must be {} (kubernetes.socket_dir, then the pod's namespace and name)",
                    p.display(),
                    only.display()
                ));
            }
        }
        LatencySource::Probe { url, .. } if url.path.len() > MAX_POD_URL_BYTES => {
            return Err(format!(
                "latency.probe: the request path is {} bytes, more than the {MAX_POD_URL_BYTES} a pod may ask for",
                url.path.len()
            ));
        }
        LatencySource::Prometheus { url, .. } if url.len() > MAX_POD_URL_BYTES => {
            return Err(format!(
                "latency.prometheus: the URL is {} bytes, more than the {MAX_POD_URL_BYTES} a pod may ask for",
                url.len()
            ));
        }
        _ => {}
    }
    only_the_pods_addresses(&source, ips)?;
    Ok(source)
}

/// The root daemon contacts only the pod's own addresses (`ips`), never one an annotation
/// picks elsewhere on the network.
fn only_the_pods_addresses(source: &LatencySource, ips: &[std::net::IpAddr]) -> Result<(), String> {
    let contacted = match source {
        LatencySource::Probe { url, .. } => Some((url.addr.ip(), url.to_string())),
        LatencySource::Prometheus { url, .. } => Some((
            url_ip(url).ok_or_else(|| {
                format!("latency.prometheus {url:?}: the host must be the pod's IP address")
            })?,
            url.clone(),
        )),
        LatencySource::Push { .. } => None,
    };
    if let Some((ip, url)) = contacted {
        if !ips.contains(&ip) {
            let ips: Vec<String> = ips.iter().map(ToString::to_string).collect();
            return Err(format!(
                "{url:?}: {ip} is not one of the pod's addresses ({})",
                if ips.is_empty() {
                    "none reported yet".to_string()
                } else {
                    ips.join(", ")
                }
            ));
        }
    }
    Ok(())
}

/// The only Unix socket a pod may name: `<socket_dir>/<namespace>.<name>.sock`.
pub fn pod_socket(pod: &cohabit_kube::PodKey, k: &KubernetesConfig) -> PathBuf {
    k.socket_dir
        .join(format!("{}.{}.sock", pod.namespace, pod.name))
}

/// A pod's probe may ask for at most [`MAX_POD_PROBE_RATE_HZ`] and a time-out of at most
/// `max_timeout_ms` (refused beyond, so that the pod's owner sees an Event rather than a
/// probe that silently differs from the annotation); without a time-out it gets the
/// default, cut to `max_timeout_ms`.
fn pod_probe_limits(file: &mut LatencyFile, max_timeout_ms: u64) -> Result<(), String> {
    if file.probe.is_none() {
        return Ok(());
    }
    if let Some(r) = file
        .rate_hz
        .filter(|r| *r > i64::from(MAX_POD_PROBE_RATE_HZ))
    {
        return Err(format!(
            "latency.rate_hz {r} is above {MAX_POD_PROBE_RATE_HZ}, the most a pod's probe may ask for"
        ));
    }
    match file.timeout_ms {
        Some(t) if t.unsigned_abs() > max_timeout_ms => Err(format!(
            "latency.timeout_ms {t} is above {max_timeout_ms}, the daemon's collect_timeout_ms (the most a pod's probe may wait)"
        )),
        Some(_) => Ok(()),
        None => {
            let t = DEFAULT_PROBE_TIMEOUT_MS.min(max_timeout_ms);
            file.timeout_ms = Some(i64::try_from(t).unwrap_or(i64::MAX));
            Ok(())
        }
    }
}

/// The IP address literal an `http://` URL names (`None` for a host name, user info or
/// anything unparsable).
fn url_ip(url: &str) -> Option<std::net::IpAddr> {
    let rest = url
        .get(..7)
        .filter(|s| s.eq_ignore_ascii_case("http://"))
        .map(|_| &url[7..])?;
    let authority = rest.split(['/', '?', '#']).next()?;
    if authority.contains('@') {
        return None;
    }
    if let Ok(sa) = authority.parse::<std::net::SocketAddr>() {
        return Some(sa.ip());
    }
    authority
        .strip_prefix('[')
        .and_then(|a| a.strip_suffix(']'))
        .unwrap_or(authority)
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = include_str!("../../../examples/cohabit.toml");

    #[test]
    fn the_example_config_in_the_repo_parses() {
        let c = DaemonConfig::parse(EXAMPLE, "examples/cohabit.toml").unwrap();
        assert_eq!(c.policy, PolicyKind::Parties);
        assert!(c.services.iter().any(|s| s.p99_target_ms.is_some()));
        assert!(c.services.iter().any(|s| s.p99_target_ms.is_none()));
        assert!(c
            .services
            .iter()
            .any(|s| matches!(s.latency, Some(LatencySource::Probe { .. }))));
    }

    #[test]
    fn the_commented_latency_sources_in_the_example_parse_too() {
        let active = EXAMPLE
            .lines()
            .find(|l| l.starts_with("latency = { probe"))
            .unwrap();
        let alternatives: Vec<&str> = EXAMPLE
            .lines()
            .filter_map(|l| l.strip_prefix("# latency = "))
            .collect();
        assert_eq!(alternatives.len(), 2, "{alternatives:?}");
        for alt in alternatives {
            let text = EXAMPLE.replace(active, &format!("latency = {alt}"));
            let c = DaemonConfig::parse(&text, "examples/cohabit.toml").unwrap();
            assert!(matches!(
                c.services[0].latency,
                Some(LatencySource::Push { .. })
            ));
        }
    }

    fn err(text: &str) -> String {
        DaemonConfig::parse(text, "t.toml").unwrap_err().to_string()
    }

    const MIN: &str = "[[service]]\nname = \"kv\"\np99_target_ms = 1\nmatch = { process_name = \"kv\" }\nlatency = { push = \"127.0.0.1:9400\", unauthenticated = true }\n";

    #[test]
    fn unmanaged_cache_is_shared_unless_the_pool_is_asked_for() {
        let c = DaemonConfig::parse(MIN, "t.toml").unwrap();
        assert_eq!(c.unmanaged_cache, UnmanagedCache::Shared, "default");
        let pool = format!("[host]\nunmanaged_cache = \"pool\"\n{MIN}");
        let c = DaemonConfig::parse(&pool, "t.toml").unwrap();
        assert_eq!(c.unmanaged_cache, UnmanagedCache::Pool);
        let e = err(&format!("[host]\nunmanaged_cache = \"lc\"\n{MIN}"));
        assert!(e.contains("unmanaged_cache") && e.contains("lc"), "{e}");
    }

    #[test]
    fn best_effort_cpus_are_the_spare_ones_unless_all_are_asked_for() {
        let c = DaemonConfig::parse(MIN, "t.toml").unwrap();
        assert_eq!(c.best_effort_cpus, BestEffortCpus::Spare, "default");
        let all = format!("[host]\nbest_effort_cpus = \"all\"\n{MIN}");
        let c = DaemonConfig::parse(&all, "t.toml").unwrap();
        assert_eq!(c.best_effort_cpus, BestEffortCpus::All);
        let e = err(&format!("[host]\nbest_effort_cpus = \"every\"\n{MIN}"));
        assert!(e.contains("best_effort_cpus") && e.contains("every"), "{e}");
    }

    #[test]
    fn a_service_priority_is_read_and_bounded() {
        let c = DaemonConfig::parse(MIN, "t.toml").unwrap();
        assert_eq!(c.services[0].priority, 0, "default");
        let c = DaemonConfig::parse(&MIN.replace("match =", "priority = 5\nmatch ="), "t.toml")
            .unwrap();
        assert_eq!(c.services[0].priority, 5);
        let e = err(&MIN.replace("match =", "priority = 5000\nmatch ="));
        assert!(
            e.contains("service kv: priority") && e.contains("5000"),
            "{e}"
        );
    }

    #[test]
    fn ml_takes_an_optional_gpu_model_beside_its_model() {
        let ml = "policy = \"ml\"\nmodel = \"/etc/cohabit/qos.json\"\n";
        let c = DaemonConfig::parse(&format!("{ml}{MIN}"), "t.toml").unwrap();
        assert_eq!(c.gpu_model, None, "optional");
        let c = DaemonConfig::parse(
            &format!("{ml}gpu_model = \"/etc/cohabit/qos-gpu.json\"\n{MIN}"),
            "t.toml",
        )
        .unwrap();
        assert_eq!(
            c.gpu_model.as_deref(),
            Some(Path::new("/etc/cohabit/qos-gpu.json"))
        );
        assert_eq!(c.model.as_deref(), Some(Path::new("/etc/cohabit/qos.json")));
        // A GPU model is no CPU model: ml still needs `model`.
        let e = err(&format!(
            "policy = \"ml\"\ngpu_model = \"/etc/cohabit/qos-gpu.json\"\n{MIN}"
        ));
        assert!(e.contains("needs model"), "{e}");
        // Misspelt: refused, naming the key.
        let e = err(&format!(
            "{ml}gpu-model = \"/etc/cohabit/qos-gpu.json\"\n{MIN}"
        ));
        assert!(e.contains("gpu-model"), "{e}");
    }

    #[test]
    fn placement_is_in_place_unless_move_is_asked_for() {
        let c = DaemonConfig::parse(MIN, "t.toml").unwrap();
        assert_eq!(c.services[0].placement, Placement::InPlace);
        let text = MIN.replace("match =", "placement = \"move\"\nmatch =");
        let c = DaemonConfig::parse(&text, "t.toml").unwrap();
        assert_eq!(c.services[0].placement, Placement::Move);
        let e = err(&MIN.replace("match =", "placement = \"elsewhere\"\nmatch ="));
        assert!(e.contains("elsewhere") && e.contains("in_place"), "{e}");
    }

    #[test]
    fn bad_configs_name_what_is_wrong() {
        DaemonConfig::parse(MIN, "t.toml").unwrap();
        assert!(err(&format!("speed = 3\n{MIN}")).contains("speed"));
        assert!(
            err(&MIN.replace("p99_target_ms = 1", "p99_target_ms = 0")).contains("p99_target_ms")
        );
        assert!(err(&MIN.replace("{ process_name = \"kv\" }", "{}")).contains("match needs one"));
        assert!(err(&MIN.replace(
            "{ process_name = \"kv\" }",
            "{ process_name = \"kv\", pid_file = \"/x\" }"
        ))
        .contains("exactly one"));
        assert!(err(&MIN.replace("127.0.0.1:9400", "10.0.0.1:9400")).contains("loopback"));
        assert!(err(&MIN.replace(
            "{ push = \"127.0.0.1:9400\", unauthenticated = true }",
            "{ prometheus = \"http://x/m\" }"
        ))
        .contains("metric"));
        assert!(err(&format!("policy = \"oracle\"\n{MIN}")).contains("ground truth"));
        assert!(err(&format!("policy = \"ml\"\n{MIN}")).contains("needs model"));
        let ml = DaemonConfig::parse(
            &format!("policy = \"ml\"\nmodel = \"/etc/cohabit/qos.json\"\n{MIN}"),
            "t.toml",
        )
        .unwrap();
        assert_eq!(ml.policy, PolicyKind::Ml);
        assert_eq!(
            ml.model.as_deref(),
            Some(Path::new("/etc/cohabit/qos.json"))
        );
        assert!(err(&format!("[host]\ncpus = \"3-1\"\n{MIN}")).contains("host.cpus"));
        assert!(err(&MIN.replace("name = \"kv\"", "name = \"../kv\"")).contains("[A-Za-z0-9._-]"));
        let gpu = "gpu = { env_file = \"/run/x.env\", restart = \"\" }\n";
        assert!(err(&format!("{MIN}{gpu}")).contains("gpu.restart"));
        let gpu = "gpu = { env_file = \"/run/x.env\", restart = \"true\", index = -1 }\n";
        assert!(err(&format!("{MIN}{gpu}")).contains("gpu.index"));
        assert!(err("interval_ms = 5\n").contains("interval_ms"));
        assert!(err(&format!("metrics_addr = \"localhost\"\n{MIN}")).contains("metrics_addr"));
        let off = DaemonConfig::parse(&format!("metrics_addr = \"\"\n{MIN}"), "t.toml").unwrap();
        assert_eq!(off.metrics_addr, None);
        let default = DaemonConfig::parse(MIN, "t.toml").unwrap();
        assert!(
            default.metrics_addr.unwrap().ip().is_loopback(),
            "loopback by default"
        );
        assert!(err("").contains("at least one [[service]]"));
        bad_latency_keys_are_named();
        bad_matchers_are_named();
        shared_and_oversized_values_are_named();
    }

    /// Latency-source cases of `bad_configs_name_what_is_wrong`.
    fn bad_latency_keys_are_named() {
        let latency =
            |l: &str| MIN.replace("{ push = \"127.0.0.1:9400\", unauthenticated = true }", l);
        for (l, why) in [
            (
                "{ push = \"127.0.0.1:9400\" }",
                "service kv: latency.push \"127.0.0.1:9400\" needs unauthenticated = true",
            ),
            (
                "{ unix = \"/run/kv.sock\", unauthenticated = true }",
                "unauthenticated goes with push",
            ),
            (
                "{ push = \"127.0.0.1:9400\", unauthenticated = true, metric = \"m\" }",
                "latency.metric and latency.unit_seconds go with prometheus",
            ),
            (
                "{ unix = \"/run/kv.sock\", unit_seconds = 0.001 }",
                "go with prometheus",
            ),
            (
                "{ push = \"127.0.0.1:9400\", unauthenticated = true, mode = \"0600\" }",
                "go with unix",
            ),
            ("{ unix = \"/run/kv.sock\", mode = \"660\" }", ""),
            (
                "{ unix = \"/run/kv.sock\", mode = \"0669\" }",
                "latency.mode",
            ),
            (
                "{ unix = \"/run/kv.sock\", mode = \"1777\" }",
                "latency.mode",
            ),
            ("{ unix = \"/run/kv.sock\", owner = -1 }", "latency.owner"),
            (
                "{ unix = \"/run/kv.sock\", allowed_users = [\"\"] }",
                "allowed_users",
            ),
            ("{ unix = \"kv.sock\" }", "absolute path"),
        ] {
            let text = latency(l);
            if why.is_empty() {
                DaemonConfig::parse(&text, "t.toml").unwrap();
                continue;
            }
            let e = err(&text);
            assert!(e.contains(why) && e.contains("service kv"), "{l}: {e}");
        }
        let c = DaemonConfig::parse(
            &latency("{ unix = \"/run/kv.sock\", owner = \"memcache\", group = 0, mode = \"0620\", allowed_users = [\"loadgen\", 1000], allowed_groups = [\"adm\"] }"),
            "t.toml",
        )
        .unwrap();
        assert_eq!(
            c.services[0].latency,
            Some(LatencySource::Push {
                addr: PushAddr::Unix("/run/kv.sock".into()),
                access: PushAccess {
                    owner: Some(UserRef::Name("memcache".into())),
                    group: Some(GroupRef::Id(0)),
                    mode: 0o620,
                    allowed_users: vec![UserRef::Name("loadgen".into()), UserRef::Id(1000)],
                    allowed_groups: vec![GroupRef::Name("adm".into())],
                },
            })
        );
        let c = DaemonConfig::parse(&latency("{ unix = \"/run/kv.sock\" }"), "t.toml").unwrap();
        assert!(matches!(
            &c.services[0].latency,
            Some(LatencySource::Push { access, .. }) if access.mode == 0o660
        ));
    }

    /// Matcher cases of `bad_configs_name_what_is_wrong`.
    fn bad_matchers_are_named() {
        let matcher = |m: &str| MIN.replace("{ process_name = \"kv\" }", m);
        for (m, why) in [
            ("{ cgroup = \"/\" }", "below the root"),
            ("{ cgroup = \"\" }", "below the root"),
            ("{ cgroup = \"//\" }", "below the root"),
            ("{ cgroup = \"system.slice/x\" }", "below the root"),
            (
                "{ cgroup = \"/system.slice/../x\" }",
                "must not contain . or ..",
            ),
            (
                "{ process_name = \"nvidia-cuda-mps-control\" }",
                "is 23 bytes; the kernel keeps at most 15",
            ),
            ("{ process_name = \"\" }", "process_name"),
            ("{ process_name = \"kv\", user = -3 }", "match.user"),
            ("{ process_name = \"kv\", exe = \"bin/kv\" }", "match.exe"),
        ] {
            let e = err(&matcher(m));
            assert!(e.contains(why) && e.contains("kv"), "{m}: {e}");
        }
        let c = DaemonConfig::parse(
            &matcher("{ process_name = \"memcached\", user = \"memcache\", exe = \"/usr/bin/memcached\" }"),
            "t.toml",
        )
        .unwrap();
        assert_eq!(
            c.services[0].constraint,
            ProcessConstraint {
                user: Some(UserRef::Name("memcache".into())),
                exe: Some("/usr/bin/memcached".into()),
            }
        );
        let c = DaemonConfig::parse(
            &matcher("{ pid_file = \"/run/kv.pid\", user = 999 }"),
            "t.toml",
        )
        .unwrap();
        assert_eq!(c.services[0].constraint.user, Some(UserRef::Id(999)));
    }

    /// Sharing and size cases of `bad_configs_name_what_is_wrong`.
    fn shared_and_oversized_values_are_named() {
        let two = |a: &str, b: &str| {
            format!(
                "{MIN}[[best_effort]]\nname = \"batch\"\nmatch = {a}\n[[service]]\nname = \"web\"\np99_target_ms = 5\nmatch = {{ process_name = \"web\" }}\nlatency = {b}\n"
            )
        };
        let push = "{ push = \"127.0.0.1:9401\", unauthenticated = true }";
        for (text, why) in [
            (
                two("{ process_name = \"kv\" }", push),
                "match.process_name \"kv\" is used by both kv and batch",
            ),
            (
                two("{ process_name = \"b\" }", "{ push = \"127.0.0.1:9400\", unauthenticated = true }"),
                "latency.push \"127.0.0.1:9400\" is used by both kv and web",
            ),
            (
                two("{ pid_file = \"/run/a.pid\" }", push).replace("process_name = \"web\"", "pid_file = \"/run/a.pid\""),
                "match.pid_file \"/run/a.pid\" is used by both web and batch",
            ),
            (
                two("{ cgroup = \"/a\" }", push).replace("process_name = \"web\"", "cgroup = \"/a\""),
                "match.cgroup",
            ),
            (
                MIN.replace("127.0.0.1:9400\", unauthenticated = true", "/run/kv.sock\"")
                    .replace("push =", "unix =")
                    + &MIN
                        .replace("name = \"kv\"", "name = \"kv2\"")
                        .replace("process_name = \"kv\"", "process_name = \"kv2\"")
                        .replace("push = \"127.0.0.1:9400\", unauthenticated = true", "unix = \"/run/kv.sock\""),
                "latency.unix \"/run/kv.sock\" is used by both kv and kv2",
            ),
            (
                format!("{MIN}gpu = {{ env_file = \"/run/x.env\", restart = \"true\" }}\n[[best_effort]]\nname = \"b\"\nmatch = {{ process_name = \"b\" }}\ngpu = {{ env_file = \"/run/x.env\", restart = \"true\" }}\n"),
                "gpu.env_file \"/run/x.env\" is used by both kv and b",
            ),
            (
                format!("interval_ms = 2000\n{MIN}gpu = {{ env_file = \"/run/x.env\", restart = \"true\", min_restart_interval_ms = 1000 }}\n"),
                "kv: gpu.min_restart_interval_ms (1000) must be at least interval_ms (2000)",
            ),
            (
                format!("[host]\ncpus = \"0-4294967295\"\n{MIN}"),
                "host.cpus \"0-4294967295\" lists more than 4096 CPUs",
            ),
            (
                format!("[host]\ncpus = \"0-2047,4096-6143,8000\"\n{MIN}"),
                "more than 4096",
            ),
            (format!("[host]\ngpus = 65\n{MIN}"), "host.gpus must be at most 64, got 65"),
            (
                format!("[mps]\npinned_mem_limit = \"0=8G\\nLD_PRELOAD=/tmp/x.so\"\n{MIN}"),
                "mps.pinned_mem_limit",
            ),
        ] {
            let e = err(&text);
            assert!(e.contains(why), "{why}: {e}");
        }
        for limit in ["0=8G", "1=512M", "12=1024K"] {
            DaemonConfig::parse(
                &format!("[mps]\npinned_mem_limit = \"{limit}\"\n{MIN}"),
                "t.toml",
            )
            .unwrap();
        }
        for limit in ["0=8", "=8G", "0=G", "a=8G", "0=8T", "0=8G ", "0=8g"] {
            assert!(!pinned_limit_ok(limit), "{limit}");
        }
        DaemonConfig::parse(
            &format!("[host]\ncpus = \"0-4095\"\ngpus = 64\n{MIN}"),
            "t.toml",
        )
        .unwrap();
        // Ephemeral ports may repeat (tests bind several services on port 0).
        let zero = "{ push = \"127.0.0.1:0\", unauthenticated = true }";
        DaemonConfig::parse(
            &two("{ process_name = \"b\" }", zero).replace("127.0.0.1:9400", "127.0.0.1:0"),
            "t.toml",
        )
        .unwrap();
    }

    #[test]
    fn a_probe_source_is_parsed_with_defaults_and_validated() {
        let probe =
            |l: &str| MIN.replace("{ push = \"127.0.0.1:9400\", unauthenticated = true }", l);
        let c = DaemonConfig::parse(
            &probe("{ probe = \"memcached://127.0.0.1:11211\" }"),
            "t.toml",
        )
        .unwrap();
        let Some(LatencySource::Probe {
            url,
            rate_hz,
            timeout_ms,
        }) = &c.services[0].latency
        else {
            panic!("{:?}", c.services[0].latency)
        };
        assert_eq!(url.addr, "127.0.0.1:11211".parse().unwrap());
        assert_eq!(
            (*rate_hz, *timeout_ms),
            (DEFAULT_PROBE_RATE_HZ, DEFAULT_PROBE_TIMEOUT_MS)
        );
        let c = DaemonConfig::parse(
            &probe("{ probe = \"http://127.0.0.1:8080/health\", rate_hz = 10000, timeout_ms = 5 }"),
            "t.toml",
        )
        .unwrap();
        assert!(matches!(
            &c.services[0].latency,
            Some(LatencySource::Probe { rate_hz: 10000, timeout_ms: 5, url }) if url.path == "/health"
        ));
        for (l, why) in [
            (
                "{ probe = \"redis://127.0.0.1\", rate_hz = 0 }",
                "rate_hz must be from 1 to 10000, got 0",
            ),
            (
                "{ probe = \"redis://127.0.0.1\", rate_hz = 10001 }",
                "rate_hz",
            ),
            (
                "{ probe = \"redis://127.0.0.1\", timeout_ms = 0 }",
                "timeout_ms",
            ),
            (
                "{ probe = \"redis://127.0.0.1\", timeout_ms = -3 }",
                "timeout_ms",
            ),
            (
                "{ probe = \"redis://cache.internal\" }",
                "redis://cache.internal",
            ),
            ("{ probe = \"https://127.0.0.1/\" }", "TLS"),
            (
                "{ probe = \"redis://127.0.0.1\", metric = \"x\" }",
                "go with prometheus",
            ),
            (
                "{ push = \"127.0.0.1:9400\", rate_hz = 5 }",
                "go with probe",
            ),
            (
                "{ push = \"127.0.0.1:9400\", probe = \"redis://127.0.0.1\" }",
                "exactly one",
            ),
            (
                "{ probe = \"redis://127.0.0.1\", rate = 5 }",
                "unknown field",
            ),
        ] {
            let e = err(&probe(l));
            assert!(e.contains(why), "{l}: {e}");
            assert!(
                e.contains("service kv") || e.contains("unknown field"),
                "{l}: {e}"
            );
        }
    }

    #[test]
    fn a_metrics_address_off_loopback_needs_metrics_public() {
        for addr in ["0.0.0.0:9464", "10.0.0.1:9464", "[::]:9464"] {
            let text = format!("metrics_addr = \"{addr}\"\n{MIN}");
            let e = err(&text);
            assert!(
                e.contains("metrics_addr") && e.contains("metrics_public = true"),
                "{e}"
            );
            let public =
                DaemonConfig::parse(&format!("metrics_public = true\n{text}"), "t.toml").unwrap();
            assert_eq!(public.metrics_addr, Some(addr.parse().unwrap()));
        }
        let v6 = DaemonConfig::parse(&format!("metrics_addr = \"[::1]:9464\"\n{MIN}"), "t.toml");
        assert!(v6.is_ok(), "::1 is loopback");
    }

    #[test]
    fn the_latency_window_defaults_to_three_intervals_and_is_checked() {
        assert_eq!(
            DaemonConfig::parse(MIN, "t.toml").unwrap().latency_window,
            3
        );
        for n in [1, 60] {
            let c = DaemonConfig::parse(&format!("latency_window = {n}\n{MIN}"), "t.toml");
            assert_eq!(c.unwrap().latency_window, n);
        }
        for n in [0, 61, -1] {
            let e = err(&format!("latency_window = {n}\n{MIN}"));
            assert!(
                e.contains("latency_window must be between 1 and 60")
                    && e.contains(&format!("got {n}")),
                "{e}"
            );
        }
    }

    #[test]
    fn the_state_directory_and_the_fail_safe_have_defaults_and_are_checked() {
        let c = DaemonConfig::parse(MIN, "t.toml").unwrap();
        assert_eq!(c.state_dir, PathBuf::from("/run/cohabit"));
        assert_eq!(c.fail_safe_after_ticks, 20);
        let c = DaemonConfig::parse(
            &format!("fail_safe_after_ticks = 5\n[paths]\nstate_dir = \"/var/lib/cohabit\"\n{MIN}"),
            "t.toml",
        )
        .unwrap();
        assert_eq!(c.state_dir, PathBuf::from("/var/lib/cohabit"));
        assert_eq!(c.fail_safe_after_ticks, 5);
        let e = err(&format!("[paths]\nstate_dir = \"run/cohabit\"\n{MIN}"));
        assert!(
            e.contains("paths.state_dir must be an absolute path"),
            "{e}"
        );
        let e = err(&format!("fail_safe_after_ticks = 0\n{MIN}"));
        assert!(e.contains("fail_safe_after_ticks"), "{e}");
    }

    #[test]
    fn exploration_and_the_model_check_have_defaults_and_are_checked() {
        let d = DaemonConfig::parse(MIN, "t.toml").unwrap();
        assert_eq!((d.explore.clone(), d.model_check_every_ticks), (None, 10));
        let c = DaemonConfig::parse(
            &format!(
                "model_check_every_ticks = 0\nexplore = {{ margin = 0.4, max_ways = 0, seed = 9 }}\n{MIN}"
            ),
            "t.toml",
        )
        .unwrap();
        assert_eq!(c.model_check_every_ticks, 0);
        assert_eq!(
            c.explore,
            Some(ExploreConfig {
                margin: 0.4,
                max_ways: 0,
                seed: 9,
                ..ExploreConfig::default()
            })
        );
        let e = err(&format!("explore = {{ margin = 1.5 }}\n{MIN}"));
        assert!(e.contains("explore.margin"), "{e}");
        let e = err(&format!("explore = {{ margins = 0.3 }}\n{MIN}"));
        assert!(e.contains("margins"), "{e}");
        let c = DaemonConfig::parse(
            &format!("explore = {{ rule = \"walk\", beta = 1.5 }}\n{MIN}"),
            "t.toml",
        )
        .unwrap();
        let e = c.explore.unwrap();
        assert_eq!((e.rule, e.beta), (ExploreRule::Walk, 1.5));
        let e = err(&format!("explore = {{ rule = \"random\" }}\n{MIN}"));
        assert!(e.contains("explore.rule") && e.contains("random"), "{e}");
        let e = err(&format!("explore = {{ beta = -1 }}\n{MIN}"));
        assert!(e.contains("explore.beta"), "{e}");
        let e = err(&format!("model_check_every_ticks = -1\n{MIN}"));
        assert!(e.contains("model_check_every_ticks"), "{e}");
    }

    #[test]
    fn mls_tunables_from_key_value_pairs_are_read_as_the_table_is() {
        let pairs = |p: &[&str]| ml_settings(&p.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert_eq!(pairs(&[]), Ok(MlConfig::default()));
        assert_eq!(
            pairs(&["margin=0.95", " shrink_after = 3", "margin=.9"]),
            Ok(MlConfig {
                margin: 0.9,
                shrink_after: 3,
                ..MlConfig::default()
            }),
            "the later margin wins"
        );
        let refused = |p: &[&str], want: &str| {
            let e = pairs(p).unwrap_err();
            assert!(e.contains(want), "{p:?}: {e}");
        };
        refused(&["margin"], "expected KEY=VALUE");
        refused(&["margin=high"], "\"high\" is not a number");
        refused(&["margin = 0.9, z_limit=9.0"], "is not a number");
        refused(&["margins=0.95"], "--ml: ml.margins is not a tunable");
        refused(&["z_limit=9"], "--ml: ml.z_limit is not a tunable");
        refused(
            &["margin=1.5"],
            "--ml: ml.margin must be between 0.5 and 0.99, got 1.5",
        );
        refused(&["margin=NaN"], "--ml: ml.margin must be between");
        refused(
            &["shrink_after=2.5"],
            "--ml: ml.shrink_after must be a whole number, got 2.5",
        );
        refused(
            &["gpu_hysteresis_pct=300"],
            "--ml: ml.gpu_hysteresis_pct must be between 1 and 50, got 300",
        );
    }

    #[test]
    fn mls_tunables_default_as_measured_and_are_checked_by_name() {
        let ml = "policy = \"ml\"\nmodel = \"/etc/cohabit/qos.json\"\n";
        let d = DaemonConfig::parse(&format!("{ml}{MIN}"), "t.toml").unwrap();
        assert_eq!(d.ml, MlConfig::default());
        // Every tunable, inline or as a table, reaches its own field; the same through --ml.
        let all = "margin = 0.8, k_sigma = 0.4, k_sigma_give_back = 0.6, give_back_headroom = 0.25, unsure_sigma = 1.5, shrink_after = 7, way_cost = 0.2, explore_step = 0.1, explore_below = 0.7, gpu_hysteresis_pct = 20, gpu_shrink_after_ms = 60000";
        // Which field each name sets is pinned by the policy's own test; here, that the
        // table hands every name and value on (all moved from the defaults).
        let want = MlConfig::with_tunables(all.split(", ").map(|p| {
            let (k, v) = p.split_once(" = ").unwrap();
            (k, v.parse::<f64>().unwrap())
        }))
        .unwrap();
        assert_eq!(want.moved_tunables().len(), 11);
        let table = all.replace(", ", "\n");
        for text in [
            format!("{ml}ml = {{ {all} }}\n{MIN}"),
            format!("{ml}{MIN}\n[ml]\n{table}\n"),
        ] {
            assert_eq!(
                DaemonConfig::parse(&text, "t.toml").unwrap().ml,
                want,
                "{text}"
            );
        }
        let pairs: Vec<String> = all.split(", ").map(|p| p.replace(' ', "")).collect();
        assert_eq!(ml_settings(&pairs), Ok(want));
        // Refused by name, with the words --ml uses.
        let e = err(&format!("{ml}ml = {{ margin = 1.2 }}\n{MIN}"));
        assert!(
            e.contains("ml.margin must be between 0.5 and 0.99, got 1.2"),
            "{e}"
        );
        let e = err(&format!(
            "{ml}ml = {{ margin = 0.7, explore_step = 0.1 }}\n{MIN}"
        ));
        assert!(e.contains("ml.explore_below"), "{e}");
        let e = err(&format!("{ml}ml = {{ margins = 0.95 }}\n{MIN}"));
        assert!(e.contains("ml.margins is not a tunable"), "{e}");
        let e = err(&format!("{ml}ml = {{ z_limit = 9.0 }}\n{MIN}"));
        assert!(e.contains("ml.z_limit is not a tunable"), "{e}");
        let e = err(&format!("{ml}ml = {{ shrink_after = 2.5 }}\n{MIN}"));
        assert!(e.contains("ml.shrink_after must be a whole number"), "{e}");
        let e = err(&format!("{ml}ml = {{ margin = \"high\" }}\n{MIN}"));
        assert!(e.contains("high"), "{e}");
        // Beside another policy the table would do nothing: refused.
        let e = err(&format!(
            "policy = \"parties\"\nml = {{ margin = 0.95 }}\n{MIN}"
        ));
        assert!(
            e.contains("ml: these are the tunables of policy = \"ml\"")
                && e.contains("\"parties\""),
            "{e}"
        );
    }

    #[test]
    fn log_rotation_and_the_hook_time_out_have_defaults_and_bounds() {
        let d = DaemonConfig::parse(MIN, "t.toml").unwrap();
        assert_eq!((d.log_max_bytes, d.log_keep), (100_000_000, 5));
        let c = DaemonConfig::parse(
            &format!(
                "log_max_bytes = 1000000
log_keep = 0
{MIN}"
            ),
            "t.toml",
        )
        .unwrap();
        assert_eq!((c.log_max_bytes, c.log_keep), (1_000_000, 0));
        assert!(err(&format!(
            "log_max_bytes = 100
{MIN}"
        ))
        .contains("log_max_bytes"));
        assert!(err(&format!(
            "log_keep = -1
{MIN}"
        ))
        .contains("log_keep"));
        let gpu = "gpu = { env_file = \"/run/x.env\", restart = \"true\" }\n";
        let g = DaemonConfig::parse(&format!("{MIN}{gpu}"), "t.toml").unwrap();
        assert_eq!(g.services[0].gpu.as_ref().unwrap().hook_timeout_ms, 60_000);
        let gpu = "gpu = { env_file = \"/run/x.env\", restart = \"true\", hook_timeout_ms = 0 }\n";
        assert!(err(&format!("{MIN}{gpu}")).contains("gpu.hook_timeout_ms"));
    }

    #[test]
    fn a_kubernetes_section_takes_services_from_pods_and_is_checked() {
        use cohabit_collectors::kubepods::Driver;
        let node = |k: &str| (k == "NODE_NAME").then(|| "node-7".to_string());
        let nothing = |_: &str| None;
        let parse = |t: &str, env: &dyn Fn(&str) -> Option<String>| {
            DaemonConfig::parse_with_env(t, "t.toml", env)
        };
        let c = parse("[kubernetes]\n", &node).unwrap();
        assert!(c.services.is_empty(), "services may all come from pods");
        assert_eq!(c.host_name, "node-7", "logs are named after the node");
        let k = c.kubernetes.unwrap();
        assert_eq!(k.node_name, "node-7", "from NODE_NAME");
        assert_eq!(k.cgroup_driver, None, "auto");
        assert_eq!(k.cgroup_root, "/");
        assert_eq!(k.kubelet_dir, PathBuf::from(DEFAULT_KUBELET_DIR));
        assert_eq!(k.socket_dir, PathBuf::from(DEFAULT_POD_SOCKET_DIR));
        assert_eq!(k.api, KubeApi::InCluster);
        let e = parse("[kubernetes]\n", &nothing).unwrap_err().to_string();
        assert!(
            e.contains("kubernetes.node_name") && e.contains("NODE_NAME"),
            "{e}"
        );
        let c = parse(
            "[kubernetes]\nnode_name = \"worker-1.example\"\ncgroup_driver = \"systemd\"\ncgroup_root = \"/custom\"\nkubelet_dir = \"/data/kubelet\"\napi_url = \"https://10.0.0.1:6443\"\ntoken_file = \"/etc/cohabit/token\"\nca_file = \"/etc/cohabit/ca.pem\"\n",
            &nothing,
        )
        .unwrap();
        let k = c.kubernetes.unwrap();
        assert_eq!(
            k.node_name, "worker-1.example",
            "the file wins over NODE_NAME"
        );
        assert_eq!(k.cgroup_driver, Some(Driver::Systemd));
        assert_eq!(k.cgroup_root, "/custom");
        assert_eq!(k.kubelet_dir, PathBuf::from("/data/kubelet"));
        assert_eq!(
            k.api,
            KubeApi::Url {
                url: "https://10.0.0.1:6443".into(),
                token_file: Some("/etc/cohabit/token".into()),
                ca_file: Some("/etc/cohabit/ca.pem".into()),
                insecure_http: false,
            }
        );
        for (section, why) in [
            (
                "cgroup_driver = \"cgroupv2\"",
                "kubernetes.cgroup_driver \"cgroupv2\" must be auto, cgroupfs or systemd",
            ),
            (
                "kubelet_dir = \"var/lib/kubelet\"",
                "kubernetes.kubelet_dir var/lib/kubelet must be an absolute path",
            ),
            ("socket_dir = \"pods\"", "kubernetes.socket_dir"),
            (
                "token_file = \"/t\"",
                "token_file and ca_file go with api_url",
            ),
            ("api_url = \"ftp://10.0.0.1\"", "kubernetes.api_url"),
            ("api_url = \"https://\"", "kubernetes.api_url"),
            (
                "node_name = \"Node_1\"",
                "kubernetes.node_name \"Node_1\" is not a node name",
            ),
            ("cgroup_root = \"kubepods\"", "kubernetes.cgroup_root"),
            ("cgroup_root = \"/a/../b\"", "kubernetes.cgroup_root"),
            ("nodename = \"x\"", "unknown field"),
        ] {
            let e = parse(&format!("[kubernetes]\n{section}\n"), &node)
                .unwrap_err()
                .to_string();
            assert!(e.contains(why), "{section}: {e}");
        }
        let e = parse("", &node).unwrap_err().to_string();
        assert!(e.contains("[kubernetes]"), "{e}");
        // Configured services stay next to the pods.
        let c = parse(&format!("{MIN}[kubernetes]\n"), &node).unwrap();
        assert_eq!(c.services.len(), 1);
    }

    #[test]
    fn what_pods_may_claim_defaults_to_nothing_latency_critical_and_is_checked() {
        use cohabit_kube::trust::{DEFAULT_MAX_POD_PRIORITY, DEFAULT_MIN_POD_P99_TARGET_MS};
        let node = |k: &str| (k == "NODE_NAME").then(|| "node-7".to_string());
        let parse = |t: &str| DaemonConfig::parse_with_env(t, "t.toml", &node);
        let k = parse("[kubernetes]\n").unwrap().kubernetes.unwrap();
        assert!(k.trust.latency_critical_namespaces.is_empty());
        assert_eq!(k.trust.max_priority, DEFAULT_MAX_POD_PRIORITY);
        assert_eq!(k.trust.min_p99_target_ms, DEFAULT_MIN_POD_P99_TARGET_MS);
        assert_eq!(k.max_pod_probe_timeout_ms, 500, "collect_timeout_ms");
        let k = parse("collect_timeout_ms = 200\n[kubernetes]\nlatency_critical_namespaces = [\"shop\", \"kv-1\"]\nmax_pod_priority = 1000\nmin_pod_p99_target_ms = 0.2\n")
            .unwrap()
            .kubernetes
            .unwrap();
        assert_eq!(
            k.trust.latency_critical_namespaces,
            ["kv-1", "shop"].map(String::from).into()
        );
        assert_eq!(
            (k.trust.max_priority, k.trust.min_p99_target_ms),
            (1000, 0.2)
        );
        assert_eq!(k.max_pod_probe_timeout_ms, 200);
        for (section, why) in [
            ("max_pod_priority = 1001", "kubernetes.max_pod_priority"),
            ("max_pod_priority = 2147483647", "from -1000 to 1000"),
            ("max_pod_priority = -1001", "kubernetes.max_pod_priority"),
            (
                "min_pod_p99_target_ms = 0.0",
                "kubernetes.min_pod_p99_target_ms",
            ),
            (
                "min_pod_p99_target_ms = 5e-324",
                "kubernetes.min_pod_p99_target_ms",
            ),
            (
                "min_pod_p99_target_ms = nan",
                "kubernetes.min_pod_p99_target_ms",
            ),
            (
                "min_pod_p99_target_ms = inf",
                "kubernetes.min_pod_p99_target_ms",
            ),
            (
                "latency_critical_namespaces = [\"Shop\"]",
                "\"Shop\" is not a namespace name",
            ),
            (
                "latency_critical_namespaces = [\"\"]",
                "not a namespace name",
            ),
            (
                "latency_critical_namespaces = [\"a\", \"a\"]",
                "listed twice",
            ),
        ] {
            let e = parse(&format!("[kubernetes]\n{section}\n"))
                .unwrap_err()
                .to_string();
            assert!(e.contains(why), "{section}: {e}");
        }
    }

    #[test]
    fn a_bearer_token_over_plain_http_is_refused_unless_insecure_http_is_set() {
        let node = |k: &str| (k == "NODE_NAME").then(|| "node-7".to_string());
        let parse = |t: &str| DaemonConfig::parse_with_env(t, "t.toml", &node);
        let http = "[kubernetes]\napi_url = \"http://10.0.0.1:8080\"\ntoken_file = \"/etc/cohabit/token\"\n";
        let e = parse(http).unwrap_err().to_string();
        assert!(
            e.contains("kubernetes.api_url")
                && e.contains("in clear")
                && e.contains("insecure_http"),
            "{e}"
        );
        let k = parse(&format!("{http}insecure_http = true\n"))
            .unwrap()
            .kubernetes
            .unwrap();
        assert!(matches!(
            k.api,
            KubeApi::Url {
                insecure_http: true,
                ..
            }
        ));
        // No token, nothing to leak; https needs no waiver.
        parse("[kubernetes]\napi_url = \"http://10.0.0.1:8080\"\n").unwrap();
        parse("[kubernetes]\napi_url = \"https://10.0.0.1:6443\"\ntoken_file = \"/t\"\n").unwrap();
        let e = parse("[kubernetes]\ninsecure_http = true\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("insecure_http goes with"), "{e}");
    }

    #[test]
    fn a_pods_latency_annotation_is_a_probe_url_or_a_latency_table() {
        let k = kube_section("");
        let pod = pod_key("shop", "kv");
        let ips: Vec<std::net::IpAddr> = vec!["10.1.2.3".parse().unwrap()];
        let pod_latency = |text: &str| super::pod_latency(text, &pod, &ips, &k);
        assert!(matches!(
            pod_latency("memcached://10.1.2.3:11211"),
            Ok(LatencySource::Probe {
                rate_hz: DEFAULT_PROBE_RATE_HZ,
                ..
            })
        ));
        assert!(matches!(
            pod_latency(" { probe = \"http://10.1.2.3:8080/health\", rate_hz = 10 } "),
            Ok(LatencySource::Probe { rate_hz: 10, .. })
        ));
        assert!(matches!(
            pod_latency(
                "{ prometheus = \"http://10.1.2.3:9150/metrics\", metric = \"rpc_seconds\" }"
            ),
            Ok(LatencySource::Prometheus { .. })
        ));
        assert!(matches!(
            pod_latency("{ unix = \"/run/cohabit/pods/shop.kv.sock\" }"),
            Ok(LatencySource::Push { .. })
        ));
        for (bad, why) in [
            ("", "needs a scheme"),
            (
                "{ probe = \"redis://10.0.0.1\" } x = 1",
                "not a latency table",
            ),
            (
                "{ probe = \"redis://10.0.0.1\", other = 1 }",
                "unknown field",
            ),
            (
                "{ unix = \"/run/kv.sock\" }",
                "must be /run/cohabit/pods/shop.kv.sock",
            ),
            (
                "{ unix = \"/run/cohabit/pods/../../etc/x\" }",
                "must be /run/cohabit/pods/shop.kv.sock",
            ),
            ("redis://cache.internal", "names are not resolved"),
            (
                "redis://10.9.9.9:6379",
                "not one of the pod's addresses (10.1.2.3)",
            ),
            (
                "http://127.0.0.1:8080/",
                "127.0.0.1 is not one of the pod's addresses",
            ),
            (
                "{ prometheus = \"http://10.9.9.9:9150/metrics\", metric = \"m\" }",
                "not one of the pod's addresses",
            ),
            (
                "{ prometheus = \"http://metrics.internal:9150/\", metric = \"m\" }",
                "the host must be the pod's IP address",
            ),
        ] {
            let e = pod_latency(bad).unwrap_err();
            assert!(e.contains(why), "{bad:?}: {e}");
        }
    }

    fn kube_section(extra: &str) -> KubernetesConfig {
        let node = |k: &str| (k == "NODE_NAME").then(|| "node-7".to_string());
        DaemonConfig::parse_with_env(&format!("[kubernetes]\n{extra}"), "t.toml", &node)
            .unwrap()
            .kubernetes
            .unwrap()
    }

    fn pod_key(ns: &str, name: &str) -> cohabit_kube::PodKey {
        cohabit_kube::PodKey {
            namespace: ns.into(),
            name: name.into(),
            uid: "u".into(),
        }
    }

    #[test]
    fn a_pod_cannot_push_over_udp_even_on_loopback() {
        let k = kube_section("");
        let ips: Vec<std::net::IpAddr> = vec!["10.1.2.3".parse().unwrap()];
        for addr in ["127.0.0.1:9", "127.0.0.1:0", "[::1]:9400", "10.1.2.3:9400"] {
            let text = format!("{{ push = \"{addr}\", unauthenticated = true }}");
            let e = pod_latency(&text, &pod_key("shop", "kv"), &ips, &k).unwrap_err();
            assert!(
                e.contains("cannot push over UDP") && e.contains("/run/cohabit/pods/shop.kv.sock"),
                "{addr}: {e}"
            );
        }
    }

    #[test]
    fn a_pods_unix_socket_is_only_its_own_path_in_the_socket_dir() {
        let k = kube_section("socket_dir = \"/run/cohabit/pods\"\n");
        let unix = |path: &str, ns: &str, name: &str| {
            pod_latency(
                &format!("{{ unix = \"{path}\" }}"),
                &pod_key(ns, name),
                &[],
                &k,
            )
        };
        let Ok(LatencySource::Push {
            addr: PushAddr::Unix(p),
            ..
        }) = unix("/run/cohabit/pods/shop.kv.sock", "shop", "kv")
        else {
            panic!("its own path is refused");
        };
        assert_eq!(p, PathBuf::from("/run/cohabit/pods/shop.kv.sock"));
        // Another pod's path, a path of its own choosing, or one that walks out: refused.
        for (path, ns, name) in [
            ("/run/cohabit/pods/shop.kv.sock", "other", "kv"),
            ("/run/cohabit/pods/shop.kv.sock", "shop", "kv2"),
            ("/run/cohabit/pods/kv.sock", "shop", "kv"),
            ("/run/cohabit/pods/sub/shop.kv.sock", "shop", "kv"),
            ("/run/cohabit/pods/../pods/shop.kv.sock", "shop", "kv"),
        ] {
            let e = unix(path, ns, name).unwrap_err();
            assert!(
                e.contains(&format!("must be /run/cohabit/pods/{ns}.{name}.sock")),
                "{path} for {ns}/{name}: {e}"
            );
        }
    }

    #[test]
    fn a_pods_probe_is_held_to_the_daemons_limits() {
        let k = kube_section("");
        let ips: Vec<std::net::IpAddr> = vec!["10.1.2.3".parse().unwrap()];
        let pod = pod_key("shop", "kv");
        let probe = |text: &str| pod_latency(text, &pod, &ips, &k);
        // Without a time-out a pod's probe gets the default cut to collect_timeout_ms.
        assert!(matches!(
            probe("memcached://10.1.2.3:11211"),
            Ok(LatencySource::Probe {
                timeout_ms: 500,
                ..
            })
        ));
        assert!(matches!(
            probe("{ probe = \"http://10.1.2.3:80/\", rate_hz = 200, timeout_ms = 500 }"),
            Ok(LatencySource::Probe {
                rate_hz: 200,
                timeout_ms: 500,
                ..
            })
        ));
        let long_path = format!("http://10.1.2.3:80/{}", "a".repeat(MAX_POD_URL_BYTES));
        let long_scrape = format!(
            "{{ prometheus = \"http://10.1.2.3:80/{}\", metric = \"m\" }}",
            "a".repeat(MAX_POD_URL_BYTES)
        );
        for (bad, why) in [
            (
                "{ probe = \"http://10.1.2.3:80/\", rate_hz = 201 }".to_string(),
                "latency.rate_hz 201 is above 200",
            ),
            (
                "{ probe = \"http://10.1.2.3:80/\", rate_hz = 10000 }".to_string(),
                "latency.rate_hz 10000 is above 200",
            ),
            (
                "{ probe = \"http://10.1.2.3:80/\", timeout_ms = 600000 }".to_string(),
                "latency.timeout_ms 600000 is above 500",
            ),
            (long_path, "more than the 2048"),
            (long_scrape, "more than the 2048"),
        ] {
            let e = probe(&bad).unwrap_err();
            assert!(e.contains(why), "{}: {e}", &bad[..bad.len().min(80)]);
        }
    }
}
