//! A pod's `cohabit.io/latency` annotation, read as a `[[service]]`'s `latency` and held to
//! tighter limits (it comes from whoever may create pods, and the daemon runs as root).

use std::path::PathBuf;

use cohabit_collectors::latency::PushAddr;
use serde::Deserialize;

use super::error::{ConfigError, Problem};
use super::kubernetes::KubernetesConfig;
use super::latency::{LatencyFile, DEFAULT_PROBE_TIMEOUT_MS};
use super::LatencySource;

/// The highest rate a pod's probe may ask for.
pub const MAX_POD_PROBE_RATE_HZ: u32 = 200;
/// The longest request path (or Prometheus URL) a pod's annotation may give, in bytes.
pub const MAX_POD_URL_BYTES: usize = 2048;

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
///
/// Errors name the field within the annotation (`latency.unix …`); the caller names the
/// annotation (their `path` is empty).
pub fn pod_latency(
    text: &str,
    pod: &cohabit_kube::PodKey,
    ips: &[std::net::IpAddr],
    k: &KubernetesConfig,
) -> Result<LatencySource, ConfigError> {
    let t = text.trim();
    let mut file = if t.starts_with('{') {
        latency_table(t)?
    } else {
        LatencyFile::probe(t)
    };
    if file.push.is_some() {
        return Err(ConfigError::invalid(
            "latency.push",
            format!(
                "is refused: a pod cannot push over UDP (any local user could send to the port); use unix = \"{}\"",
                pod_socket(pod, k).display()
            ),
        ));
    }
    pod_probe_limits(&mut file, k.max_pod_probe_timeout_ms).map_err(|e| e.within("latency"))?;
    let source = LatencySource::try_from(&file).map_err(|e| e.within("latency"))?;
    let too_long = |field: &str, what: &str, len: usize| {
        ConfigError::invalid(
            field,
            format!("is refused: the {what} is {len} bytes, more than the {MAX_POD_URL_BYTES} a pod may ask for"),
        )
    };
    match &source {
        LatencySource::Push {
            addr: PushAddr::Unix(p),
            ..
        } => {
            let only = pod_socket(pod, k);
            if *p != only {
                return Err(ConfigError::invalid(
                    "latency.unix",
                    format!(
                        "{} must be {} (kubernetes.socket_dir, then the pod's namespace and name)",
                        p.display(),
                        only.display()
                    ),
                ));
            }
        }
        LatencySource::Probe { url, .. } if url.path.len() > MAX_POD_URL_BYTES => {
            return Err(too_long("latency.probe", "request path", url.path.len()));
        }
        LatencySource::Prometheus { url, .. } if url.len() > MAX_POD_URL_BYTES => {
            return Err(too_long("latency.prometheus", "URL", url.len()));
        }
        _ => {}
    }
    only_the_pods_addresses(&source, ips)?;
    Ok(source)
}

/// `{ … }`: the keys of a `[[service]]`'s `latency`.
fn latency_table(t: &str) -> Result<LatencyFile, ConfigError> {
    let unreadable = |why: String| {
        ConfigError::new(
            "latency",
            Problem::Unreadable(format!("not a latency table: {why}")),
        )
    };
    let mut table: toml::Table =
        toml::from_str(&format!("latency = {t}")).map_err(|e| unreadable(e.message().into()))?;
    let value = table.remove("latency").filter(|_| table.is_empty());
    let value = value.ok_or_else(|| unreadable("more than one table".into()))?;
    LatencyFile::deserialize(value).map_err(|e| ConfigError::from_toml("latency", &e))
}

/// The root daemon contacts only the pod's own addresses (`ips`), never one an annotation
/// picks elsewhere on the network.
fn only_the_pods_addresses(
    source: &LatencySource,
    ips: &[std::net::IpAddr],
) -> Result<(), ConfigError> {
    let (field, ip, url) = match source {
        LatencySource::Probe { url, .. } => ("latency.probe", url.addr.ip(), url.to_string()),
        LatencySource::Prometheus { url, .. } => {
            let ip = url_ip(url).ok_or_else(|| {
                ConfigError::invalid(
                    "latency.prometheus",
                    format!("{url:?}: the host must be the pod's IP address"),
                )
            })?;
            ("latency.prometheus", ip, url.clone())
        }
        LatencySource::Push { .. } => return Ok(()),
    };
    if ips.contains(&ip) {
        return Ok(());
    }
    let ips: Vec<String> = ips.iter().map(ToString::to_string).collect();
    Err(ConfigError::invalid(
        field,
        format!(
            "{url:?}: {ip} is not one of the pod's addresses ({})",
            if ips.is_empty() {
                "none reported yet".to_string()
            } else {
                ips.join(", ")
            }
        ),
    ))
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
fn pod_probe_limits(file: &mut LatencyFile, max_timeout_ms: u64) -> Result<(), ConfigError> {
    if file.probe.is_none() {
        return Ok(());
    }
    if let Some(r) = file
        .rate_hz
        .filter(|r| *r > i64::from(MAX_POD_PROBE_RATE_HZ))
    {
        return Err(ConfigError::invalid(
            "rate_hz",
            format!("{r} is above {MAX_POD_PROBE_RATE_HZ}, the most a pod's probe may ask for"),
        ));
    }
    match file.timeout_ms {
        Some(t) if t.unsigned_abs() > max_timeout_ms => Err(ConfigError::invalid(
            "timeout_ms",
            format!("{t} is above {max_timeout_ms}, the daemon's collect_timeout_ms (the most a pod's probe may wait)"),
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
    use super::super::*;
    use super::*;

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
            let e = pod_latency(bad).unwrap_err().to_string();
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
    fn a_refused_annotation_names_the_field_within_it_and_leaves_the_annotation_to_the_caller() {
        let k = kube_section("");
        let ips: Vec<std::net::IpAddr> = vec!["10.1.2.3".parse().unwrap()];
        let pod = pod_key("shop", "kv");
        let e = pod_latency("{ unix = \"/run/kv.sock\" }", &pod, &ips, &k).unwrap_err();
        assert_eq!((e.path.as_str(), e.field.as_str()), ("", "latency.unix"));
        assert!(matches!(e.problem, Problem::Invalid(_)), "{e:?}");
        let e =
            pod_latency("{ probe = \"http://10.1.2.3/\", rate = 5 }", &pod, &ips, &k).unwrap_err();
        assert_eq!(e.field, "latency.rate");
        assert!(matches!(e.problem, Problem::UnknownKey { .. }), "{e:?}");
        let e = pod_latency(
            "{ probe = \"http://10.1.2.3/\", rate_hz = 0 }",
            &pod,
            &ips,
            &k,
        )
        .unwrap_err();
        assert_eq!(e.field, "latency.rate_hz");
        assert!(
            matches!(e.problem, Problem::OutOfRange { got, .. } if got == 0.0),
            "{e:?}"
        );
    }

    #[test]
    fn a_pod_cannot_push_over_udp_even_on_loopback() {
        let k = kube_section("");
        let ips: Vec<std::net::IpAddr> = vec!["10.1.2.3".parse().unwrap()];
        for addr in ["127.0.0.1:9", "127.0.0.1:0", "[::1]:9400", "10.1.2.3:9400"] {
            let text = format!("{{ push = \"{addr}\", unauthenticated = true }}");
            let e = pod_latency(&text, &pod_key("shop", "kv"), &ips, &k)
                .unwrap_err()
                .to_string();
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
            let e = unix(path, ns, name).unwrap_err().to_string();
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
            let e = probe(&bad).unwrap_err().to_string();
            assert!(e.contains(why), "{}: {e}", &bad[..bad.len().min(80)]);
        }
    }
}
