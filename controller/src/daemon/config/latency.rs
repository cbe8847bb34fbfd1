//! A service's `latency = { … }`: where its latency comes from (pushed samples on a Unix
//! or UDP socket, a scraped Prometheus histogram, or cohabit's own probe) and who may push.

use std::path::{Path, PathBuf};

use cohabit_collectors::latency::{PushAddr, DEFAULT_MODE};
use cohabit_collectors::probe::{ProbeSettings, ProbeUrl};
use cohabit_collectors::users::{GroupRef, UserRef};
use serde::Deserialize;

use super::service::{group_ref, user_ref, IdFile};

/// `latency = { … }` as written (a `[[service]]`'s, or a pod's `cohabit.io/latency` table).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct LatencyFile {
    pub(super) push: Option<String>,
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
    pub(super) probe: Option<String>,
    pub(super) rate_hz: Option<i64>,
    pub(super) timeout_ms: Option<i64>,
}

impl LatencyFile {
    /// `{ probe = "URL" }`.
    pub(super) fn probe(url: &str) -> Self {
        Self {
            probe: Some(url.to_string()),
            ..Self::default()
        }
    }
}

/// Probe requests per second when `rate_hz` is not given.
pub const DEFAULT_PROBE_RATE_HZ: u32 = 100;
/// Probe time-out when `timeout_ms` is not given.
pub const DEFAULT_PROBE_TIMEOUT_MS: u64 = 1000;

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

impl TryFrom<&LatencyFile> for LatencySource {
    type Error = String;

    fn try_from(l: &LatencyFile) -> Result<Self, String> {
        stray_keys(l)?;
        match (&l.push, &l.unix, &l.prometheus, &l.probe) {
            (None, None, None, Some(url)) => probe(url, l),
            (Some(addr), None, None, None) => udp(addr, l),
            (None, Some(p), None, None) => Ok(LatencySource::Push {
                addr: PushAddr::Unix(unix_path(p)?),
                access: push_access(l)?,
            }),
            (None, None, Some(url), None) => prometheus(url, l),
            _ => Err("latency needs exactly one of push, unix, prometheus, probe".into()),
        }
    }
}

/// Keys given without the source they belong to.
fn stray_keys(l: &LatencyFile) -> Result<(), String> {
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
    Ok(())
}

/// `push = "ADDR"`: a UDP socket on loopback, taken only when said to be unauthenticated.
fn udp(addr: &str, l: &LatencyFile) -> Result<LatencySource, String> {
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

/// `prometheus = "URL"` with its `metric` and `unit_seconds`.
fn prometheus(url: &str, l: &LatencyFile) -> Result<LatencySource, String> {
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
        url: url.to_string(),
        metric,
        unit_seconds,
    })
}

/// `probe = "URL"` with its `rate_hz` and `timeout_ms`.
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

#[cfg(test)]
mod tests {
    use super::super::tests::{err, MIN};
    use super::super::*;
    use super::*;

    #[test]
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
}
