//! `cohabit run` configuration: TOML, every table `deny_unknown_fields`, validated into a
//! [`DaemonConfig`] with errors that name the field.
//!
//! ```toml
//! interval_ms = 1000
//! policy = "parties"                 # static | parties | ml
//! model = "/etc/cohabit/qos-v1.json" # ml only: the model (cohabit-train fit writes one)
//! log = "/var/log/cohabit/decisions.jsonl"
//! collect_timeout_ms = 500
//! metrics_addr = "127.0.0.1:9464"    # Prometheus metrics; "" disables
//! metrics_public = false             # must be true for a non-loopback metrics_addr
//!
//! [host]
//! cpus = "0-35"                      # CPUs cohabit manages; default: all online
//! mem_bw_gbps = 76.8                 # peak memory bandwidth (MBA in MBps mode, telemetry sanity)
//!
//! [[service]]                        # latency-critical
//! name = "memcached"
//! p99_target_ms = 0.6
//! match = { process_name = "memcached" }   # or cgroup / systemd_unit / pid_file
//! latency = { push = "127.0.0.1:9400" }    # or { unix = "/run/cohabit/memcached.sock" }
//!                                          # or { prometheus = "http://127.0.0.1:9150/metrics",
//!                                          #      metric = "request_duration_seconds" }
//!                                          # or { probe = "memcached://127.0.0.1:11211",
//!                                          #      rate_hz = 100, timeout_ms = 1000 }
//!
//! [[best_effort]]
//! name = "batch"
//! match = { systemd_unit = "batch.service" }
//! ```

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use cohabit_collectors::cgroup::CpuList;
use cohabit_collectors::latency::PushAddr;
use cohabit_collectors::probe::{ProbeSettings, ProbeUrl};
use cohabit_collectors::HostPaths;
use serde::Deserialize;

use cohabit_policy::PolicyKind;

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
    log: Option<PathBuf>,
    #[serde(default = "default_timeout")]
    collect_timeout_ms: i64,
    #[serde(default = "default_metrics")]
    metrics_addr: String,
    #[serde(default)]
    metrics_public: bool,
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
fn default_metrics() -> String {
    "127.0.0.1:9464".into()
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct HostFile {
    cpus: Option<String>,
    gpus: Option<i64>,
    mem_bw_gbps: Option<f64>,
    name: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct PathsFile {
    proc: Option<PathBuf>,
    sys: Option<PathBuf>,
    cgroup: Option<PathBuf>,
    resctrl: Option<PathBuf>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ServiceFile {
    name: String,
    p99_target_ms: f64,
    #[serde(rename = "match")]
    matcher: MatchFile,
    latency: LatencyFile,
    gpu: Option<GpuFile>,
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
    gpu: Option<GpuFile>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct MatchFile {
    process_name: Option<String>,
    cgroup: Option<String>,
    systemd_unit: Option<String>,
    pid_file: Option<PathBuf>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LatencyFile {
    push: Option<String>,
    unix: Option<PathBuf>,
    prometheus: Option<String>,
    metric: Option<String>,
    #[serde(default = "one")]
    unit_seconds: f64,
    probe: Option<String>,
    rate_hz: Option<i64>,
    timeout_ms: Option<i64>,
}

/// Probe requests per second when `rate_hz` is not given.
pub const DEFAULT_PROBE_RATE_HZ: u32 = 100;
/// Probe time-out when `timeout_ms` is not given.
pub const DEFAULT_PROBE_TIMEOUT_MS: u64 = 1000;

fn one() -> f64 {
    1.0
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
}

/// Where a service's latency comes from.
#[derive(Debug, Clone, PartialEq)]
pub enum LatencySource {
    /// Pushed samples on a socket.
    Push(PushAddr),
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
    /// Latency source, for latency-critical services.
    pub latency: Option<LatencySource>,
    /// GPU share handling, for GPU services.
    pub gpu: Option<GpuConfig>,
}

/// A validated daemon configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct DaemonConfig {
    /// Control interval.
    pub interval_ms: u64,
    /// Policy.
    pub policy: PolicyKind,
    /// The model `ml` uses.
    pub model: Option<PathBuf>,
    /// Decision log, if any.
    pub log: Option<PathBuf>,
    /// Longest a collection may take before the tick is skipped.
    pub collect_timeout_ms: u64,
    /// Where Prometheus metrics are served (`None`: not served).
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// CPUs managed (`None`: all online).
    pub cpus: Option<CpuList>,
    /// Peak memory bandwidth, if known.
    pub mem_bw_gbps: Option<f64>,
    /// GPUs to plan for when NVML cannot list them.
    pub gpus: Option<u32>,
    /// MPS control.
    pub mps: MpsConfig,
    /// Host name for logs.
    pub host_name: String,
    /// Kernel interface roots.
    pub paths: HostPaths,
    /// Latency-critical services, then best-effort jobs.
    pub services: Vec<ServiceConfig>,
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
        if !(1..=600_000).contains(&f.collect_timeout_ms) {
            return Err(err(format!(
                "collect_timeout_ms must be between 1 and 600000, got {}",
                f.collect_timeout_ms
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
                latency: Some(latency(&s.latency).map_err(|m| err(format!("{who}: {m}")))?),
                p99_target_ms: Some(s.p99_target_ms),
                name: s.name,
            });
        }
        if services.is_empty() {
            return Err(err(
                "needs at least one [[service]] (latency-critical)".into()
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
                latency: None,
                p99_target_ms: None,
                name: b.name,
            });
        }
        let mut seen = BTreeSet::new();
        for s in &services {
            let valid = !s.name.is_empty()
                && s.name.len() <= 48
                && !s.name.starts_with('.')
                && s.name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
            if !valid {
                return Err(err(format!(
                    "service name {:?}: use 1-48 characters of [A-Za-z0-9._-]",
                    s.name
                )));
            }
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
        Ok(Self {
            interval_ms: f.interval_ms.unsigned_abs(),
            policy,
            model: f.model,
            log: f.log,
            collect_timeout_ms: f.collect_timeout_ms.unsigned_abs(),
            metrics_addr,
            cpus,
            mem_bw_gbps: f.host.mem_bw_gbps,
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
            host_name: f.host.name.unwrap_or_else(|| "this host".into()),
            paths,
            services,
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
    Ok(GpuConfig {
        index,
        env_file: g.env_file.clone(),
        restart: g.restart.clone(),
        min_restart_interval_ms: g.min_restart_interval_ms.unsigned_abs(),
    })
}

fn latency(l: &LatencyFile) -> Result<LatencySource, String> {
    if l.probe.is_none() && (l.rate_hz.is_some() || l.timeout_ms.is_some()) {
        return Err("latency.rate_hz and latency.timeout_ms go with probe".into());
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
            Ok(LatencySource::Push(PushAddr::Udp(a)))
        }
        (None, Some(p), None, None) => Ok(LatencySource::Push(PushAddr::Unix(p.clone()))),
        (None, None, Some(url), None) => {
            if !url.starts_with("http://") {
                return Err(format!("latency.prometheus {url:?} must be an http:// URL"));
            }
            let metric = l
                .metric
                .clone()
                .ok_or("latency.metric is required with prometheus")?;
            if !(l.unit_seconds.is_finite() && l.unit_seconds > 0.0) {
                return Err(format!(
                    "latency.unit_seconds must be positive, got {}",
                    l.unit_seconds
                ));
            }
            Ok(LatencySource::Prometheus {
                url: url.clone(),
                metric,
                unit_seconds: l.unit_seconds,
            })
        }
        _ => Err("latency needs exactly one of push, unix, prometheus, probe".into()),
    }
}

fn probe(url: &str, l: &LatencyFile) -> Result<LatencySource, String> {
    if l.metric.is_some() {
        return Err("latency.metric goes with prometheus, not probe".into());
    }
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

    fn err(text: &str) -> String {
        DaemonConfig::parse(text, "t.toml").unwrap_err().to_string()
    }

    const MIN: &str = "[[service]]\nname = \"kv\"\np99_target_ms = 1\nmatch = { process_name = \"kv\" }\nlatency = { push = \"127.0.0.1:9400\" }\n";

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
            "{ push = \"127.0.0.1:9400\" }",
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
    }

    #[test]
    fn a_probe_source_is_parsed_with_defaults_and_validated() {
        let probe = |l: &str| MIN.replace("{ push = \"127.0.0.1:9400\" }", l);
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
                "metric goes with prometheus",
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
}
