//! `cohabit run` configuration: TOML, every table `deny_unknown_fields`, validated into a
//! [`DaemonConfig`] with errors that name the field and the problem ([`ConfigError`]: the
//! field's TOML path, such as `service[2].latency.push`, and a [`Problem`] of a kind).
//!
//! One module per section, each with its file struct, its defaults and a `TryFrom` into its
//! typed config: `host` (`[host]`, `[paths]`), `service` (`[[service]]`, `[[best_effort]]`,
//! `match`, and the checks across services), `latency`, `gpu` (a service's `gpu`, `[mps]`),
//! `kubernetes`, `pod` (a pod's `cohabit.io/latency`) and `ml` (`policy`, `ml`, `explore`).
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

mod error;
mod gpu;
mod host;
mod kubernetes;
mod latency;
mod ml;
mod pod;
mod service;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use cohabit_collectors::cgroup::CpuList;
use cohabit_collectors::HostPaths;
use cohabit_core::window::MAX_LATENCY_WINDOW;
use cohabit_host::spec::HostSpec;
use cohabit_policy::{ExploreConfig, MlConfig, PolicyKind};
use serde::Deserialize;

pub use self::error::{ConfigError, Problem};
pub use self::gpu::DEFAULT_MPS_CONTROL;
pub use self::kubernetes::{KubernetesConfig, DEFAULT_KUBELET_DIR, DEFAULT_POD_SOCKET_DIR};
pub use self::latency::{DEFAULT_PROBE_RATE_HZ, DEFAULT_PROBE_TIMEOUT_MS};
pub use self::ml::ml_settings;
pub use self::pod::{pod_latency, pod_socket, MAX_POD_PROBE_RATE_HZ, MAX_POD_URL_BYTES};
/// The typed values the configuration builds for the host, which owns them.
pub use cohabit_host::spec::{
    BestEffortCpus, GpuClient, LatencySource, ManagedService, Matcher, MatcherKey, MpsSpec,
    Placement, ProcessConstraint, PushAccess, UnboundMatcher, UnmanagedCache,
};

use self::gpu::MpsFile;
use self::host::{HostConfig, HostFile, PathsConfig, PathsFile};
use self::kubernetes::KubernetesFile;
use self::ml::ExploreFile;
use self::service::{BestEffortFile, ServiceFile};

/// The file as written: the top-level keys and every section.
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
    /// `[[service]]`s, each read on its own so that errors name its index.
    #[serde(default)]
    service: Vec<toml::Value>,
    /// `[[best_effort]]`s, likewise.
    #[serde(default)]
    best_effort: Vec<toml::Value>,
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
    pub mps: MpsSpec,
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
    pub services: Vec<ManagedService>,
    /// `[kubernetes]`: more services come from this node's pods.
    pub kubernetes: Option<KubernetesConfig>,
}

impl DaemonConfig {
    /// What the host is asked to manage, as this configuration says.
    pub fn host_spec(&self) -> HostSpec {
        HostSpec {
            host_name: self.host_name.clone(),
            paths: self.paths.clone(),
            cpus: self.cpus.clone(),
            mem_bw_gbps: self.mem_bw_gbps,
            gpus: self.gpus,
            unmanaged_cache: self.unmanaged_cache,
            best_effort_cpus: self.best_effort_cpus,
            mps: self.mps.clone(),
            pods: self.kubernetes.is_some(),
            collect_timeout_ms: self.collect_timeout_ms,
            latency_window: self.latency_window,
            services: self.services.clone(),
        }
    }

    /// Reads and validates a configuration file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let origin = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| {
            ConfigError::new("", Problem::Unreadable(format!("cannot read: {e}"))).in_file(&origin)
        })?;
        Self::parse(&text, &origin)
    }

    /// Parses and validates configuration text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Self, ConfigError> {
        Self::parse_with_env(text, origin, &|k| std::env::var(k).ok())
    }

    /// [`Self::parse`] with the environment read through `env` (`NODE_NAME`).
    pub fn parse_with_env(
        text: &str,
        origin: &str,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Self, ConfigError> {
        let table: toml::Table = toml::from_str(text).map_err(|e| {
            ConfigError::new("", Problem::Unreadable(e.to_string())).in_file(origin)
        })?;
        let f = File::deserialize(toml::Value::Table(table))
            .map_err(|e| ConfigError::from_toml("", &e).in_file(origin))?;
        Self::from_file(f, env).map_err(|e| e.in_file(origin))
    }

    /// Validates each section in turn, then what spans sections.
    fn from_file(f: File, env: &dyn Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let runtime = Runtime::try_from(&f)?;
        let paths = PathsConfig::try_from(f.paths).map_err(|e| e.within("paths"))?;
        let (policy, ml) = ml::policy(&f.policy, f.model.is_some(), f.ml.as_ref())?;
        let host = HostConfig::try_from(f.host).map_err(|e| e.within("host"))?;
        let mps = MpsSpec::try_from(f.mps).map_err(|e| e.within("mps"))?;
        let kubernetes = f
            .kubernetes
            .as_ref()
            .map(|k| kubernetes::kubernetes(k, env, runtime.collect_timeout_ms))
            .transpose()
            .map_err(|e| e.within("kubernetes"))?;
        let services = services(
            f.service,
            f.best_effort,
            kubernetes.is_some(),
            runtime.interval_ms,
        )?;
        let explore = f
            .explore
            .as_ref()
            .map(ExploreConfig::try_from)
            .transpose()
            .map_err(|e| e.within("explore"))?;
        // A node agent's logs are told apart by node when fleets retrain from them.
        let host_name = host.name.unwrap_or_else(|| {
            kubernetes
                .as_ref()
                .map_or_else(|| "this host".into(), |k| k.node_name.clone())
        });
        Ok(Self {
            interval_ms: runtime.interval_ms,
            latency_window: runtime.latency_window,
            policy,
            model: f.model,
            gpu_model: f.gpu_model,
            log: f.log,
            log_max_bytes: runtime.log_max_bytes,
            log_keep: runtime.log_keep,
            collect_timeout_ms: runtime.collect_timeout_ms,
            metrics_addr: runtime.metrics_addr,
            cpus: host.cpus,
            mem_bw_gbps: host.mem_bw_gbps,
            unmanaged_cache: host.unmanaged_cache,
            best_effort_cpus: host.best_effort_cpus,
            gpus: host.gpus,
            mps,
            host_name,
            paths: paths.host,
            state_dir: paths.state_dir,
            fail_safe_after_ticks: runtime.fail_safe_after_ticks,
            model_check_every_ticks: runtime.model_check_every_ticks,
            explore,
            ml,
            services,
            kubernetes,
        })
    }
}

/// The `[[service]]`s then the `[[best_effort]]`s, each validated, then checked together:
/// at least one service unless pods bring them, distinct names, nothing two would fight
/// over.
fn services(
    latency_critical: Vec<toml::Value>,
    best_effort: Vec<toml::Value>,
    from_pods: bool,
    interval_ms: u64,
) -> Result<Vec<ManagedService>, ConfigError> {
    let n = latency_critical.len();
    if n == 0 && !from_pods {
        return Err(ConfigError::missing(
            "service",
            "needs at least one [[service]] (latency-critical), or a [kubernetes] section to take services from pods",
        ));
    }
    let mut services = Vec::with_capacity(n + best_effort.len());
    for (i, s) in items::<ServiceFile>("service", latency_critical)? {
        services.push(ManagedService::try_from(s).map_err(|e| e.within(&i))?);
    }
    for (i, b) in items::<BestEffortFile>("best_effort", best_effort)? {
        services.push(ManagedService::try_from(b).map_err(|e| e.within(&i))?);
    }
    service::check_names(&services, n)?;
    service::check_shared(&services, n, interval_ms)?;
    Ok(services)
}

/// The items of `[[list]]`, each read into `T` with its TOML path (`list[i]`); serde's
/// errors are named by the item's `name`, when it has one.
fn items<T: serde::de::DeserializeOwned>(
    list: &str,
    values: Vec<toml::Value>,
) -> Result<Vec<(String, T)>, ConfigError> {
    values
        .into_iter()
        .enumerate()
        .map(|(i, v)| {
            let field = format!("{list}[{i}]");
            let name = v
                .get("name")
                .and_then(toml::Value::as_str)
                .map(str::to_string);
            match T::deserialize(v) {
                Ok(item) => Ok((field, item)),
                Err(e) => {
                    let e = ConfigError::from_toml(&field, &e);
                    Err(match name {
                        Some(n) => e.in_item(&n),
                        None => e,
                    })
                }
            }
        })
        .collect()
}

/// The top-level keys of the loop, its log and its metrics, validated.
struct Runtime {
    interval_ms: u64,
    latency_window: u32,
    collect_timeout_ms: u64,
    log_max_bytes: u64,
    log_keep: u32,
    fail_safe_after_ticks: u32,
    model_check_every_ticks: u32,
    metrics_addr: Option<std::net::SocketAddr>,
}

impl TryFrom<&File> for Runtime {
    type Error = ConfigError;

    fn try_from(f: &File) -> Result<Self, ConfigError> {
        let within = |field: &'static str, v: i64, lo: i64, hi: i64| {
            if (lo..=hi).contains(&v) {
                Ok(())
            } else {
                Err(ConfigError::range(
                    field,
                    Some(lo as f64),
                    Some(hi as f64),
                    v as f64,
                ))
            }
        };
        within("interval_ms", f.interval_ms, 10, 3_600_000)?;
        within(
            "latency_window",
            f.latency_window,
            1,
            i64::from(MAX_LATENCY_WINDOW),
        )
        .map_err(|e| e.noted(" control intervals"))?;
        within("collect_timeout_ms", f.collect_timeout_ms, 1, 600_000)?;
        if f.log_max_bytes < 65_536 {
            return Err(ConfigError::range(
                "log_max_bytes",
                Some(65_536.0),
                None,
                f.log_max_bytes as f64,
            )
            .noted(" (a record is a few KB)"));
        }
        within("log_keep", f.log_keep, 0, 1000)?;
        within(
            "fail_safe_after_ticks",
            f.fail_safe_after_ticks,
            1,
            1_000_000,
        )?;
        let model_check_every_ticks = u32::try_from(f.model_check_every_ticks).map_err(|_| {
            ConfigError::range(
                "model_check_every_ticks",
                Some(0.0),
                Some(f64::from(u32::MAX)),
                f.model_check_every_ticks as f64,
            )
        })?;
        Ok(Self {
            interval_ms: f.interval_ms.unsigned_abs(),
            latency_window: u32::try_from(f.latency_window).unwrap_or(MAX_LATENCY_WINDOW),
            collect_timeout_ms: f.collect_timeout_ms.unsigned_abs(),
            log_max_bytes: f.log_max_bytes.unsigned_abs(),
            log_keep: u32::try_from(f.log_keep).unwrap_or(0),
            fail_safe_after_ticks: u32::try_from(f.fail_safe_after_ticks).unwrap_or(u32::MAX),
            model_check_every_ticks,
            metrics_addr: metrics_addr(&f.metrics_addr, f.metrics_public)?,
        })
    }
}

/// `metrics_addr` (`""`: not served), on loopback unless `metrics_public`.
fn metrics_addr(text: &str, public: bool) -> Result<Option<std::net::SocketAddr>, ConfigError> {
    if text.trim().is_empty() {
        return Ok(None);
    }
    let addr = text.parse::<std::net::SocketAddr>().map_err(|e| {
        ConfigError::new(
            "metrics_addr",
            Problem::WrongType(format!(
                "{text:?} is not an address like 127.0.0.1:9464 ({e}); use \"\" to disable"
            )),
        )
    })?;
    if !addr.ip().is_loopback() && !public {
        return Err(ConfigError::conflict(
            "metrics_addr",
            format!("{addr} is not a loopback address; the endpoint has no authentication and shows service names, targets and allocations, so set metrics_public = true to serve it there"),
        ));
    }
    Ok(Some(addr))
}

#[cfg(test)]
mod tests;
