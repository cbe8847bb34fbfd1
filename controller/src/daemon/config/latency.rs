//! A service's `latency = { … }`: where its latency comes from (pushed samples on a Unix
//! or UDP socket, a scraped Prometheus histogram, or cohabit's own probe) and who may push.

use std::path::{Path, PathBuf};

use cohabit_collectors::latency::{PushAddr, DEFAULT_MODE};
use cohabit_collectors::probe::{ProbeError, ProbeSettings, ProbeUrl, MAX_RATE_HZ};
use cohabit_host::spec::{LatencySource, PushAccess};
use serde::Deserialize;

use super::error::{ConfigError, Problem};
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

/// A Unix push socket path: absolute, not a directory.
fn unix_path(p: &Path) -> Result<PathBuf, ConfigError> {
    if !p.is_absolute() || p.file_name().is_none() {
        return Err(ConfigError::invalid(
            "unix",
            format!("{} must be an absolute path to a socket file", p.display()),
        ));
    }
    Ok(p.to_path_buf())
}

/// `owner`, `group`, `mode`, `allowed_users` and `allowed_groups` of a Unix push socket.
fn push_access(l: &LatencyFile) -> Result<PushAccess, ConfigError> {
    let mode = match &l.mode {
        None => DEFAULT_MODE,
        Some(m) => u32::from_str_radix(m, 8)
            .ok()
            .filter(|v| *v <= 0o777 && !m.is_empty() && m.len() <= 4)
            .ok_or_else(|| {
                ConfigError::invalid(
                    "mode",
                    format!("{m:?} must be octal permission bits such as \"0660\""),
                )
            })?,
    };
    Ok(PushAccess {
        owner: l.owner.as_ref().map(|o| user_ref("owner", o)).transpose()?,
        group: l
            .group
            .as_ref()
            .map(|g| group_ref("group", g))
            .transpose()?,
        mode,
        allowed_users: (l.allowed_users.iter().enumerate())
            .map(|(i, u)| user_ref(&format!("allowed_users[{i}]"), u))
            .collect::<Result<_, _>>()?,
        allowed_groups: (l.allowed_groups.iter().enumerate())
            .map(|(i, g)| group_ref(&format!("allowed_groups[{i}]"), g))
            .collect::<Result<_, _>>()?,
    })
}

impl TryFrom<&LatencyFile> for LatencySource {
    type Error = ConfigError;

    /// Errors name fields within the `latency` table.
    fn try_from(l: &LatencyFile) -> Result<Self, ConfigError> {
        stray_keys(l)?;
        match (&l.push, &l.unix, &l.prometheus, &l.probe) {
            (None, None, None, Some(url)) => probe(url, l),
            (Some(addr), None, None, None) => udp(addr, l),
            (None, Some(p), None, None) => Ok(LatencySource::Push {
                addr: PushAddr::Unix(unix_path(p)?),
                access: push_access(l)?,
            }),
            (None, None, Some(url), None) => prometheus(url, l),
            _ => Err(ConfigError::conflict(
                "",
                "needs exactly one of push, unix, prometheus, probe",
            )),
        }
    }
}

/// Keys given without the source they belong to: the first one, and its source.
fn stray_keys(l: &LatencyFile) -> Result<(), ConfigError> {
    let given = |key: &'static str, set: bool| set.then_some(key);
    let stray = [
        (
            l.probe.is_none(),
            "probe",
            given("rate_hz", l.rate_hz.is_some()),
        ),
        (
            l.probe.is_none(),
            "probe",
            given("timeout_ms", l.timeout_ms.is_some()),
        ),
        (
            l.prometheus.is_none(),
            "prometheus",
            given("metric", l.metric.is_some()),
        ),
        (
            l.prometheus.is_none(),
            "prometheus",
            given("unit_seconds", l.unit_seconds.is_some()),
        ),
        (
            l.push.is_none(),
            "push (UDP)",
            given("unauthenticated", l.unauthenticated),
        ),
        (l.unix.is_none(), "unix", given("owner", l.owner.is_some())),
        (l.unix.is_none(), "unix", given("group", l.group.is_some())),
        (l.unix.is_none(), "unix", given("mode", l.mode.is_some())),
        (
            l.unix.is_none(),
            "unix",
            given("allowed_users", !l.allowed_users.is_empty()),
        ),
        (
            l.unix.is_none(),
            "unix",
            given("allowed_groups", !l.allowed_groups.is_empty()),
        ),
    ];
    match stray
        .into_iter()
        .find_map(|(absent, source, key)| key.filter(|_| absent).map(|k| (k, source)))
    {
        Some((key, source)) => Err(ConfigError::conflict(key, format!("goes with {source}"))),
        None => Ok(()),
    }
}

/// `push = "ADDR"`: a UDP socket on loopback, taken only when said to be unauthenticated.
fn udp(addr: &str, l: &LatencyFile) -> Result<LatencySource, ConfigError> {
    let a: std::net::SocketAddr = addr.parse().map_err(|e| {
        ConfigError::new(
            "push",
            Problem::WrongType(format!(
                "{addr:?} is not an address like 127.0.0.1:9400 ({e})"
            )),
        )
    })?;
    if !a.ip().is_loopback() {
        return Err(ConfigError::invalid(
            "push",
            format!("{addr:?} must be a loopback address"),
        ));
    }
    if !l.unauthenticated {
        return Err(ConfigError::invalid(
            "push",
            format!("{addr:?} needs unauthenticated = true: any local user or container on the host network can send to a UDP port and steer the allocation; use unix = \"/run/cohabit/NAME.sock\" to accept only the service's processes"),
        ));
    }
    Ok(LatencySource::Push {
        addr: PushAddr::Udp(a),
        access: PushAccess::default(),
    })
}

/// `prometheus = "URL"` with its `metric` and `unit_seconds`.
fn prometheus(url: &str, l: &LatencyFile) -> Result<LatencySource, ConfigError> {
    if !url.starts_with("http://") {
        return Err(ConfigError::invalid(
            "prometheus",
            format!("{url:?} must be an http:// URL"),
        ));
    }
    if url.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(ConfigError::invalid(
            "prometheus",
            format!("{url:?} contains white space or control characters"),
        ));
    }
    let metric = l
        .metric
        .clone()
        .ok_or_else(|| ConfigError::missing("metric", "is required with prometheus"))?;
    let unit_seconds = l.unit_seconds.unwrap_or(1.0);
    if !(unit_seconds.is_finite() && unit_seconds > 0.0) {
        return Err(ConfigError::invalid(
            "unit_seconds",
            format!("must be positive, got {unit_seconds}"),
        ));
    }
    Ok(LatencySource::Prometheus {
        url: url.to_string(),
        metric,
        unit_seconds,
    })
}

/// `probe = "URL"` with its `rate_hz` and `timeout_ms`.
fn probe(url: &str, l: &LatencyFile) -> Result<LatencySource, ConfigError> {
    let parsed: ProbeUrl = url
        .parse()
        .map_err(|e: ProbeError| ConfigError::new("probe", Problem::WrongType(e.to_string())))?;
    let rate_hz = match l.rate_hz {
        None => DEFAULT_PROBE_RATE_HZ,
        Some(r) => u32::try_from(r)
            .ok()
            .filter(|r| (1..=MAX_RATE_HZ).contains(r))
            .ok_or_else(|| {
                ConfigError::range("rate_hz", Some(1.0), Some(f64::from(MAX_RATE_HZ)), r as f64)
            })?,
    };
    let timeout_ms = match l.timeout_ms {
        None => DEFAULT_PROBE_TIMEOUT_MS,
        Some(t) if t > 0 && t <= 600_000 => t.unsigned_abs(),
        Some(t) => {
            return Err(ConfigError::range(
                "timeout_ms",
                Some(1.0),
                Some(600_000.0),
                t as f64,
            ))
        }
    };
    ProbeSettings {
        rate_hz,
        timeout: std::time::Duration::from_millis(timeout_ms),
    }
    .validate(url)
    .map_err(|e| ConfigError::new("", Problem::WrongType(e.to_string())))?;
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
    use cohabit_collectors::users::{GroupRef, UserRef};

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
                "latency.metric goes with prometheus",
            ),
            (
                "{ unix = \"/run/kv.sock\", unit_seconds = 0.001 }",
                "latency.unit_seconds goes with prometheus",
            ),
            (
                "{ push = \"127.0.0.1:9400\", unauthenticated = true, mode = \"0600\" }",
                "latency.mode goes with unix",
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
                "rate_hz must be between 1 and 10000, got 0",
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
                "latency.metric goes with prometheus",
            ),
            (
                "{ push = \"127.0.0.1:9400\", rate_hz = 5 }",
                "latency.rate_hz goes with probe",
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
