//! `[kubernetes]`: services also come from this node's annotated pods; how the daemon
//! reaches the kubelet's cgroups and the API server, and what pods may claim.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use cohabit_kube::ApiAccess;
use serde::Deserialize;

use super::error::ConfigError;

/// `[kubernetes]` as written (its presence turns pod discovery on).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct KubernetesFile {
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
    pub api: ApiAccess,
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
/// `collect_timeout_ms` bounds pods' probe time-outs. Errors name fields within
/// `[kubernetes]`.
pub(super) fn kubernetes(
    k: &KubernetesFile,
    env: &dyn Fn(&str) -> Option<String>,
    collect_timeout_ms: u64,
) -> Result<KubernetesConfig, ConfigError> {
    use cohabit_collectors::kubepods::Driver;
    let cgroup_driver = match k.cgroup_driver.as_str() {
        "auto" => None,
        "cgroupfs" => Some(Driver::Cgroupfs),
        "systemd" => Some(Driver::Systemd),
        other => {
            return Err(ConfigError::invalid(
                "cgroup_driver",
                format!("{other:?} must be auto, cgroupfs or systemd"),
            ))
        }
    };
    let cgroup_root = k.cgroup_root.clone().unwrap_or_else(|| "/".into());
    if !cgroup_root.starts_with('/') || cgroup_root.split('/').any(|p| p == "." || p == "..") {
        return Err(ConfigError::invalid(
            "cgroup_root",
            format!("{cgroup_root:?} must be an absolute cgroup path without . or .. (the kubelet's --cgroup-root)"),
        ));
    }
    let kubelet_dir = k.kubelet_dir.as_deref();
    let socket_dir = k.socket_dir.as_deref();
    Ok(KubernetesConfig {
        node_name: node_name(k, env)?,
        cgroup_driver,
        cgroup_root,
        kubelet_dir: absolute(
            "kubelet_dir",
            kubelet_dir.unwrap_or(Path::new(DEFAULT_KUBELET_DIR)),
        )?,
        api: kube_api(k)?,
        socket_dir: absolute(
            "socket_dir",
            socket_dir.unwrap_or(Path::new(DEFAULT_POD_SOCKET_DIR)),
        )?,
        trust: pod_trust(k)?,
        max_pod_probe_timeout_ms: collect_timeout_ms,
    })
}

/// `node_name`, else the environment's `NODE_NAME`: a node name.
fn node_name(
    k: &KubernetesFile,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<String, ConfigError> {
    let node_name = match (&k.node_name, env("NODE_NAME")) {
        (Some(n), _) => n.clone(),
        (None, Some(n)) if !n.is_empty() => n,
        _ => {
            return Err(ConfigError::missing(
                "node_name",
                "is not set and neither is the environment variable NODE_NAME (the DaemonSet sets it from spec.nodeName)",
            ))
        }
    };
    let dns = !node_name.is_empty()
        && node_name.len() <= 253
        && node_name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.');
    if !dns {
        return Err(ConfigError::invalid(
            "node_name",
            format!("{node_name:?} is not a node name (lowercase letters, digits, - and ., at most 253)"),
        ));
    }
    Ok(node_name)
}

/// `p`, which must be absolute, at `field`.
fn absolute(field: &str, p: &Path) -> Result<PathBuf, ConfigError> {
    if p.is_absolute() {
        Ok(p.to_path_buf())
    } else {
        Err(ConfigError::invalid(
            field,
            format!("{} must be an absolute path", p.display()),
        ))
    }
}

/// `api_url`, `token_file`, `ca_file` and `insecure_http`, checked: the API server.
fn kube_api(k: &KubernetesFile) -> Result<ApiAccess, ConfigError> {
    if k.insecure_http && k.api_url.is_none() {
        return Err(ConfigError::conflict(
            "insecure_http",
            "goes with an http:// api_url",
        ));
    }
    let Some(url) = &k.api_url else {
        if let Some(key) = [("token_file", &k.token_file), ("ca_file", &k.ca_file)]
            .iter()
            .find_map(|(key, v)| v.is_some().then_some(*key))
        {
            return Err(ConfigError::conflict(
                key,
                "goes with api_url (in the cluster the service account's is used)",
            ));
        }
        return Ok(ApiAccess::InCluster);
    };
    let ok = ["https://", "http://"].iter().any(|scheme| {
        url.strip_prefix(scheme)
            .is_some_and(|r| !r.is_empty() && !r.contains(char::is_whitespace))
    });
    if !ok {
        return Err(ConfigError::invalid(
            "api_url",
            format!("{url:?} must be an https:// (or http://) URL"),
        ));
    }
    if url.starts_with("http://") && k.token_file.is_some() && !k.insecure_http {
        return Err(ConfigError::conflict(
            "api_url",
            format!("{url:?} would send the bearer token (token_file) in clear: use https://, or set insecure_http = true for a test server on a trusted path"),
        ));
    }
    Ok(ApiAccess::Url {
        insecure_http: k.insecure_http,
        url: url.clone(),
        token_file: (k.token_file.as_deref())
            .map(|p| absolute("token_file", p))
            .transpose()?,
        ca_file: (k.ca_file.as_deref())
            .map(|p| absolute("ca_file", p))
            .transpose()?,
    })
}

/// `latency_critical_namespaces`, `max_pod_priority` and `min_pod_p99_target_ms`, checked.
fn pod_trust(k: &KubernetesFile) -> Result<cohabit_kube::trust::PodTrust, ConfigError> {
    use cohabit_kube::annotations::MAX_P99_TARGET_MS;
    use cohabit_kube::trust::{MAX_PRIORITY, MIN_POD_P99_TARGET_FLOOR_MS, MIN_PRIORITY};
    let mut namespaces = BTreeSet::new();
    for (i, ns) in k.latency_critical_namespaces.iter().enumerate() {
        let field = format!("latency_critical_namespaces[{i}]");
        // A namespace name is an RFC 1123 label.
        let label = !ns.is_empty()
            && ns.len() <= 63
            && ns
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !ns.starts_with('-')
            && !ns.ends_with('-');
        if !label {
            return Err(ConfigError::invalid(
                field,
                format!(
                    "{ns:?} is not a namespace name (lowercase letters, digits and -, at most 63)"
                ),
            ));
        }
        if !namespaces.insert(ns.clone()) {
            return Err(ConfigError::conflict(
                field,
                format!("{ns:?} is listed twice"),
            ));
        }
    }
    let max_priority = i32::try_from(k.max_pod_priority)
        .ok()
        .filter(|p| (MIN_PRIORITY..=MAX_PRIORITY).contains(p))
        .ok_or_else(|| {
            ConfigError::range(
                "max_pod_priority",
                Some(f64::from(MIN_PRIORITY)),
                Some(f64::from(MAX_PRIORITY)),
                k.max_pod_priority as f64,
            )
            .noted(" (the bounds of configured services)")
        })?;
    let floor = k.min_pod_p99_target_ms;
    if !(MIN_POD_P99_TARGET_FLOOR_MS..=MAX_P99_TARGET_MS).contains(&floor) {
        return Err(ConfigError::range(
            "min_pod_p99_target_ms",
            Some(MIN_POD_P99_TARGET_FLOOR_MS),
            Some(MAX_P99_TARGET_MS),
            floor,
        )
        .noted(" milliseconds"));
    }
    Ok(cohabit_kube::trust::PodTrust {
        latency_critical_namespaces: namespaces,
        max_priority,
        min_p99_target_ms: floor,
    })
}

#[cfg(test)]
mod tests {
    use super::super::tests::MIN;
    use super::super::*;
    use super::*;

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
        assert_eq!(k.api, ApiAccess::InCluster);
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
            ApiAccess::Url {
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
                "kubernetes.token_file goes with api_url",
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
            ("max_pod_priority = 2147483647", "between -1000 and 1000"),
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
            ApiAccess::Url {
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
}
