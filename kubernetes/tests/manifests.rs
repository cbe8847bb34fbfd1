//! deploy/kubernetes/: every manifest parses into its typed Kubernetes object with no
//! unknown field, and the objects fit together the way the daemon needs (mounts,
//! privileges, selectors, RBAC, config paths, probes, dashboard metric names).
//!
//! k8s-openapi's types ignore unknown fields when deserialising, so "no unknown field" is
//! checked by re-serialising the typed object and comparing it with the YAML as written:
//! a misspelt or misplaced key is dropped by the typed parse and the two differ.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Secret, Service, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes")
}

fn repo_file(rel: &str) -> String {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(rel);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// The file that holds two objects: the admission policy and its binding.
const ADMISSION: &str = "validating-admission-policy.yaml";

/// Every YAML document under deploy/kubernetes/, by file name (one object per file but
/// [`ADMISSION`]'s two).
fn yaml_docs() -> BTreeMap<String, Vec<Value>> {
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(deploy_dir()).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("yaml") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let docs: Vec<Value> = serde_saphyr::from_multiple(&text)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let expected = if name == ADMISSION { 2 } else { 1 };
        assert_eq!(
            docs.len(),
            expected,
            "{}: objects in the file",
            path.display()
        );
        out.insert(name, docs);
    }
    out
}

/// The first YAML document of every file under deploy/kubernetes/, by file name.
fn yaml_files() -> BTreeMap<String, Value> {
    yaml_docs()
        .into_iter()
        .map(|(name, docs)| (name, docs.into_iter().next().unwrap()))
        .collect()
}

/// Parses `doc` as `T` and fails if any field of `doc` is not a field of `T`.
fn typed<T: DeserializeOwned + Serialize>(file: &str, doc: &Value) -> T {
    let t: T = serde_json::from_value(doc.clone()).unwrap_or_else(|e| panic!("{file}: {e}"));
    let back = serde_json::to_value(&t).unwrap();
    if let Some(path) = first_difference(doc, &back, String::new()) {
        panic!(
            "{file}: field {path} is unknown or malformed (the typed object reads it differently)"
        );
    }
    t
}

/// The first path where `a` and `b` differ; numbers compare by value, and `b` may add
/// nothing (k8s-openapi writes no defaults).
fn first_difference(a: &Value, b: &Value, at: String) -> Option<String> {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            for k in x.keys().chain(y.keys()) {
                let (va, vb) = (
                    x.get(k).unwrap_or(&Value::Null),
                    y.get(k).unwrap_or(&Value::Null),
                );
                if let Some(p) = first_difference(va, vb, format!("{at}.{k}")) {
                    return Some(p);
                }
            }
            None
        }
        (Value::Array(x), Value::Array(y)) => {
            if x.len() != y.len() {
                return Some(at);
            }
            x.iter()
                .zip(y)
                .enumerate()
                .find_map(|(i, (va, vb))| first_difference(va, vb, format!("{at}[{i}]")))
        }
        (Value::Number(x), Value::Number(y)) => (x.as_f64() != y.as_f64()).then_some(at),
        _ => (a != b).then_some(at),
    }
}

#[test]
fn the_difference_check_catches_unknown_and_misplaced_fields() {
    let good: Value = serde_json::json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "x"}});
    let _: ServiceAccount = typed("good", &good);
    for bad in [
        serde_json::json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "x", "labelz": {"a": "b"}}}),
        serde_json::json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "x"}, "spec": {}}),
    ] {
        let r = std::panic::catch_unwind(|| {
            let _: ServiceAccount = typed("bad", &bad);
        });
        assert!(r.is_err(), "{bad} passed");
    }
}

/// The Prometheus Operator's PodMonitor, the fields used here (monitoring.coreos.com/v1).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct PodMonitor {
    api_version: String,
    kind: String,
    metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    spec: PodMonitorSpec,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct PodMonitorSpec {
    selector: k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector,
    namespace_selector: NamespaceSelector,
    pod_metrics_endpoints: Vec<PodMetricsEndpoint>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct NamespaceSelector {
    match_names: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct PodMetricsEndpoint {
    port: String,
    scheme: String,
    path: String,
    interval: String,
    scrape_timeout: String,
    tls_config: TlsConfig,
    authorization: Authorization,
    #[serde(default)]
    relabelings: Vec<Relabeling>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct TlsConfig {
    insecure_skip_verify: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Authorization {
    #[serde(rename = "type")]
    kind: String,
    credentials: SecretRef,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct SecretRef {
    name: String,
    key: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Relabeling {
    source_labels: Vec<String>,
    target_label: String,
    action: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Kustomization {
    api_version: String,
    kind: String,
    resources: Vec<String>,
}

/// The objects, typed.
struct Manifests {
    namespace: Namespace,
    service_account: ServiceAccount,
    role: ClusterRole,
    binding: ClusterRoleBinding,
    config: ConfigMap,
    daemonset: DaemonSet,
    service: Service,
    monitor: PodMonitor,
    reader: ServiceAccount,
    reader_token: Secret,
    reader_role: ClusterRole,
    reader_binding: ClusterRoleBinding,
    admission: ValidatingAdmissionPolicy,
    admission_binding: ValidatingAdmissionPolicyBinding,
}

fn manifests() -> Manifests {
    let f = yaml_files();
    let kinds: BTreeMap<&str, &str> = [
        ("namespace.yaml", "Namespace"),
        ("serviceaccount.yaml", "ServiceAccount"),
        ("clusterrole.yaml", "ClusterRole"),
        ("clusterrolebinding.yaml", "ClusterRoleBinding"),
        ("configmap.yaml", "ConfigMap"),
        ("daemonset.yaml", "DaemonSet"),
        ("service.yaml", "Service"),
        ("podmonitor.yaml", "PodMonitor"),
        ("kustomization.yaml", "Kustomization"),
        ("metrics-reader-serviceaccount.yaml", "ServiceAccount"),
        ("metrics-reader-token.yaml", "Secret"),
        ("metrics-reader-clusterrole.yaml", "ClusterRole"),
        (
            "metrics-reader-clusterrolebinding.yaml",
            "ClusterRoleBinding",
        ),
        (ADMISSION, "ValidatingAdmissionPolicy"),
    ]
    .into();
    assert_eq!(
        f.keys().map(String::as_str).collect::<BTreeSet<_>>(),
        kinds.keys().copied().collect::<BTreeSet<_>>()
    );
    for (file, kind) in &kinds {
        assert_eq!(f[*file]["kind"], *kind, "{file}");
    }
    let monitor: PodMonitor = serde_json::from_value(f["podmonitor.yaml"].clone())
        .unwrap_or_else(|e| panic!("podmonitor.yaml: {e}"));
    assert_eq!(
        (monitor.api_version.as_str(), monitor.kind.as_str()),
        ("monitoring.coreos.com/v1", "PodMonitor")
    );
    Manifests {
        namespace: typed("namespace.yaml", &f["namespace.yaml"]),
        service_account: typed("serviceaccount.yaml", &f["serviceaccount.yaml"]),
        role: typed("clusterrole.yaml", &f["clusterrole.yaml"]),
        binding: typed("clusterrolebinding.yaml", &f["clusterrolebinding.yaml"]),
        config: typed("configmap.yaml", &f["configmap.yaml"]),
        daemonset: typed("daemonset.yaml", &f["daemonset.yaml"]),
        service: typed("service.yaml", &f["service.yaml"]),
        monitor,
        reader: typed(
            "metrics-reader-serviceaccount.yaml",
            &f["metrics-reader-serviceaccount.yaml"],
        ),
        reader_token: typed("metrics-reader-token.yaml", &f["metrics-reader-token.yaml"]),
        reader_role: typed(
            "metrics-reader-clusterrole.yaml",
            &f["metrics-reader-clusterrole.yaml"],
        ),
        reader_binding: typed(
            "metrics-reader-clusterrolebinding.yaml",
            &f["metrics-reader-clusterrolebinding.yaml"],
        ),
        admission: typed(ADMISSION, &f[ADMISSION]),
        admission_binding: typed(ADMISSION, &yaml_docs()[ADMISSION][1]),
    }
}

#[test]
fn the_kustomization_lists_every_manifest() {
    let f = yaml_files();
    let k: Kustomization = serde_json::from_value(f["kustomization.yaml"].clone()).unwrap();
    assert_eq!(k.api_version, "kustomize.config.k8s.io/v1beta1");
    assert_eq!(k.kind, "Kustomization");
    let listed: BTreeSet<String> = k.resources.into_iter().collect();
    let files: BTreeSet<String> = f
        .keys()
        .filter(|n| *n != "kustomization.yaml")
        .cloned()
        .collect();
    assert_eq!(listed, files);
}

#[test]
fn every_namespaced_object_is_in_the_agents_namespace() {
    let m = manifests();
    let ns = m.namespace.metadata.name.clone().unwrap();
    for (what, got) in [
        ("ServiceAccount", &m.service_account.metadata.namespace),
        ("ConfigMap", &m.config.metadata.namespace),
        ("DaemonSet", &m.daemonset.metadata.namespace),
        ("Service", &m.service.metadata.namespace),
        ("PodMonitor", &m.monitor.metadata.namespace),
        ("reader ServiceAccount", &m.reader.metadata.namespace),
        ("reader token Secret", &m.reader_token.metadata.namespace),
    ] {
        assert_eq!(got.as_deref(), Some(ns.as_str()), "{what}");
    }
    assert_eq!(m.monitor.spec.namespace_selector.match_names, [ns]);
}

#[test]
fn rbac_is_least_privilege_and_bound_to_the_agents_account() {
    let m = manifests();
    let mut rules: BTreeMap<(String, String), BTreeSet<String>> = BTreeMap::new();
    for r in m.role.rules.iter().flatten() {
        assert!(r.resource_names.is_none() && r.non_resource_urls.is_none());
        for g in r.api_groups.iter().flatten() {
            for res in r.resources.iter().flatten() {
                rules
                    .entry((g.clone(), res.clone()))
                    .or_default()
                    .extend(r.verbs.iter().cloned());
            }
        }
    }
    let want: BTreeMap<(String, String), BTreeSet<String>> = [
        (
            ("".to_string(), "pods".to_string()),
            ["get", "list", "watch"].map(String::from).into(),
        ),
        (
            ("".to_string(), "events".to_string()),
            ["create"].map(String::from).into(),
        ),
        // The kube-rbac-proxy sidecar checks scrapers' tokens and rights.
        (
            (
                "authentication.k8s.io".to_string(),
                "tokenreviews".to_string(),
            ),
            ["create"].map(String::from).into(),
        ),
        (
            (
                "authorization.k8s.io".to_string(),
                "subjectaccessreviews".to_string(),
            ),
            ["create"].map(String::from).into(),
        ),
    ]
    .into();
    assert_eq!(rules, want);
    assert_eq!(m.binding.role_ref.kind, "ClusterRole");
    assert_eq!(
        Some(&m.binding.role_ref.name),
        m.role.metadata.name.as_ref()
    );
    let subjects = m.binding.subjects.unwrap();
    assert_eq!(subjects.len(), 1);
    assert_eq!(subjects[0].kind, "ServiceAccount");
    assert_eq!(
        Some(&subjects[0].name),
        m.service_account.metadata.name.as_ref()
    );
    assert_eq!(subjects[0].namespace, m.service_account.metadata.namespace);
    let pod = m.daemonset.spec.unwrap().template.spec.unwrap();
    assert_eq!(pod.service_account_name, m.service_account.metadata.name);
}

#[test]
fn the_daemonset_has_the_privileges_mounts_and_env_the_daemon_needs() {
    let m = manifests();
    let spec = m.daemonset.spec.clone().unwrap();
    let pod = spec.template.spec.clone().unwrap();
    assert_eq!(pod.host_pid, Some(true), "hostPID: pods' tasks in /proc");
    assert_eq!(pod.containers.len(), 2, "the agent and its metrics proxy");
    let c = &pod.containers[0];
    assert_eq!(c.name, "cohabit");
    let sc = c.security_context.clone().unwrap();
    assert_eq!(sc.privileged, Some(true));
    assert_eq!(sc.run_as_user, Some(0));
    // NODE_NAME from the downward API.
    let env = c.env.clone().unwrap();
    let node = env
        .iter()
        .find(|e| e.name == "NODE_NAME")
        .expect("NODE_NAME");
    let field = node
        .value_from
        .as_ref()
        .unwrap()
        .field_ref
        .as_ref()
        .unwrap();
    assert_eq!(field.field_path, "spec.nodeName");
    // Host paths and where they are mounted.
    let volumes = pod.volumes.clone().unwrap();
    let host: BTreeMap<String, String> = volumes
        .iter()
        .filter_map(|v| Some((v.name.clone(), v.host_path.as_ref()?.path.clone())))
        .collect();
    let mounts: BTreeMap<String, (String, bool)> = c
        .volume_mounts
        .iter()
        .flatten()
        .map(|m| {
            (
                m.name.clone(),
                (m.mount_path.clone(), m.read_only.unwrap_or(false)),
            )
        })
        .collect();
    let declared: BTreeSet<&String> = volumes.iter().map(|v| &v.name).collect();
    assert_eq!(
        declared,
        mounts.keys().collect(),
        "every volume mounted, every mount declared"
    );
    let mount_of = |host_path: &str| -> (String, bool) {
        let (name, _) = host
            .iter()
            .find(|(_, p)| *p == host_path)
            .unwrap_or_else(|| panic!("no hostPath {host_path}"));
        mounts[name].clone()
    };
    assert!(!mount_of("/sys/fs/cgroup").1, "cgroup is written");
    assert!(!mount_of("/sys/fs/resctrl").1, "resctrl is written");
    assert!(mount_of("/var/lib/kubelet").1, "kubelet state is read-only");
    assert!(!mount_of("/run/cohabit").1);
    assert!(!mount_of("/run/nvidia-mps").1);
    assert!(!mount_of("/var/log/cohabit").1);
    // Selectors: the DaemonSet's, the Service's and the PodMonitor's pick the agent's pods.
    let labels = spec.template.metadata.clone().unwrap().labels.unwrap();
    let subset = |sel: &BTreeMap<String, String>| sel.iter().all(|(k, v)| labels.get(k) == Some(v));
    let ds_sel = spec.selector.match_labels.clone().unwrap();
    assert!(!ds_sel.is_empty() && subset(&ds_sel));
    assert!(subset(&m.service.spec.clone().unwrap().selector.unwrap()));
    assert!(subset(
        m.monitor.spec.selector.match_labels.as_ref().unwrap()
    ));
    // An opt-in node selector on Linux nodes.
    let ns = pod.node_selector.clone().unwrap();
    assert_eq!(
        ns.get("kubernetes.io/os").map(String::as_str),
        Some("linux")
    );
    assert_eq!(
        ns.get("cohabit.io/enabled").map(String::as_str),
        Some("true")
    );
    // Resource requests and limits.
    let res = c.resources.clone().unwrap();
    for key in ["cpu", "memory"] {
        assert!(
            res.requests.as_ref().unwrap().contains_key(key),
            "request {key}"
        );
        assert!(
            res.limits.as_ref().unwrap().contains_key(key),
            "limit {key}"
        );
    }
}

/// The PodMonitor's endpoint `ep` authenticates with the reader account's token, which
/// RBAC lets GET /metrics, nothing else.
fn the_scraper_may_get_metrics_and_nothing_else(m: &Manifests, ep: &PodMetricsEndpoint) {
    assert_eq!(ep.authorization.kind, "Bearer");
    assert_eq!(
        Some(&ep.authorization.credentials.name),
        m.reader_token.metadata.name.as_ref()
    );
    assert_eq!(ep.authorization.credentials.key, "token");
    assert_eq!(
        m.reader_token.type_.as_deref(),
        Some("kubernetes.io/service-account-token")
    );
    assert_eq!(
        m.reader_token
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get("kubernetes.io/service-account.name")),
        m.reader.metadata.name.as_ref()
    );
    let rules = m.reader_role.rules.clone().unwrap();
    assert_eq!(rules.len(), 1);
    assert_eq!(
        rules[0].non_resource_urls.as_deref(),
        Some(&["/metrics".to_string()][..])
    );
    assert_eq!(rules[0].verbs, ["get"]);
    assert!(rules[0].resources.is_none() && rules[0].api_groups.is_none());
    assert_eq!(
        Some(&m.reader_binding.role_ref.name),
        m.reader_role.metadata.name.as_ref()
    );
    let subjects = m.reader_binding.subjects.clone().unwrap();
    assert_eq!(subjects.len(), 1);
    assert_eq!(
        (Some(&subjects[0].name), subjects[0].namespace.as_ref()),
        (
            m.reader.metadata.name.as_ref(),
            m.reader.metadata.namespace.as_ref()
        )
    );
}

/// The port on which `proxy`, the authenticating proxy in front of the exporter at
/// `addr`, listens on the node, unprivileged, for /metrics alone.
fn the_proxy_port(
    proxy: &k8s_openapi::api::core::v1::Container,
    addr: std::net::SocketAddr,
) -> i32 {
    assert!(proxy.image.as_deref().unwrap().contains("kube-rbac-proxy"));
    let args = proxy.args.clone().unwrap();
    assert!(
        args.contains(&format!("--upstream=http://{addr}/")),
        "{args:?}"
    );
    assert!(
        args.contains(&"--allow-paths=/metrics".to_string()),
        "{args:?}"
    );
    let port = proxy
        .ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref() == Some("https-metrics"))
        .unwrap();
    assert!(
        args.contains(&format!(
            "--secure-listen-address=0.0.0.0:{}",
            port.container_port
        )),
        "{args:?}"
    );
    assert_eq!(port.host_port, Some(port.container_port));
    let sc = proxy.security_context.clone().unwrap();
    assert_eq!(
        (
            sc.privileged,
            sc.run_as_non_root,
            sc.allow_privilege_escalation
        ),
        (None, Some(true), Some(false))
    );
    port.container_port
}

#[test]
fn probes_and_scrapes_hit_the_metrics_port_on_a_path_the_exporter_serves() {
    let m = manifests();
    let pod = m.daemonset.spec.clone().unwrap().template.spec.unwrap();
    let c = &pod.containers[0];
    let cfg = daemon_config(&m.config);
    // The exporter has no authentication: loopback only, never metrics_public.
    let addr: std::net::SocketAddr = cfg["metrics_addr"].as_str().unwrap().parse().unwrap();
    assert_eq!(addr.ip(), std::net::IpAddr::from([127, 0, 0, 1]), "{addr}");
    assert_ne!(
        cfg.get("metrics_public").and_then(toml::Value::as_bool),
        Some(true),
        "metrics_public"
    );
    assert!(
        c.ports.iter().flatten().all(|p| p.host_port.is_none()),
        "the agent's own port is not opened on the node"
    );
    let exporter = repo_file("controller/src/daemon/exporter/http.rs");
    for probe in [
        c.liveness_probe.as_ref().unwrap(),
        c.readiness_probe.as_ref().unwrap(),
    ] {
        // The kubelet reaches the node's loopback: the pod has the node's network.
        let get = probe.http_get.as_ref().unwrap();
        assert_eq!(get.host.as_deref(), Some("127.0.0.1"));
        assert_eq!(
            serde_json::to_value(&get.port).unwrap(),
            serde_json::json!(addr.port())
        );
        let path = get.path.as_deref().unwrap();
        assert!(
            exporter.contains(&format!("\"{path}\"")),
            "the exporter does not serve {path}"
        );
    }
    // Liveness is the tick health (a hung loop behind a live metrics server is restarted);
    // readiness is only whether metrics are served.
    let path = |p: Option<&k8s_openapi::api::core::v1::Probe>| {
        p.and_then(|p| p.http_get.as_ref()?.path.clone())
    };
    assert_eq!(path(c.liveness_probe.as_ref()).as_deref(), Some("/healthz"));
    assert_eq!(
        path(c.readiness_probe.as_ref()).as_deref(),
        Some("/metrics")
    );
    // From off the node, only through the authenticating proxy, to the loopback exporter.
    let proxy_port = the_proxy_port(&pod.containers[1], addr);
    let svc = m.service.spec.clone().unwrap();
    let sp = &svc.ports.unwrap()[0];
    assert_eq!(sp.port, proxy_port);
    assert_eq!(
        serde_json::to_value(&sp.target_port).unwrap(),
        "https-metrics"
    );
    let ep = &m.monitor.spec.pod_metrics_endpoints[0];
    assert_eq!(ep.port, "https-metrics");
    assert_eq!(ep.scheme, "https");
    assert!(
        ep.tls_config.insecure_skip_verify,
        "the proxy's certificate is self-signed"
    );
    let secs = |d: &str| {
        d.strip_suffix('s')
            .and_then(|n| n.parse::<u32>().ok())
            .unwrap_or_else(|| panic!("{d}: not N s"))
    };
    assert!(
        secs(&ep.scrape_timeout) <= secs(&ep.interval),
        "scrapeTimeout within interval"
    );
    assert!(exporter.contains(&format!("\"{}\"", ep.path)));
    assert!(ep.relabelings.iter().any(|r| r.target_label == "node"
        && r.source_labels == ["__meta_kubernetes_pod_node_name"]
        && r.action == "replace"));
    assert_eq!(pod.host_network, Some(true));
    the_scraper_may_get_metrics_and_nothing_else(&m, ep);
}

/// The admission policy enforces what the agent does: the same annotation keys, and the
/// same allowed namespaces, priority cap and target floor as the ConfigMap's
/// `[kubernetes]` (which, where it is silent, means the agent's defaults).
#[test]
fn the_admission_policy_checks_the_keys_and_limits_the_agent_uses() {
    use cohabit_kube::annotations::{
        CLASS, DEFAULT_PREFIX, LATENCY_CRITICAL, P99_TARGET_MS, PRIORITY,
    };
    use cohabit_kube::trust::{
        DEFAULT_MAX_POD_PRIORITY, DEFAULT_MIN_POD_P99_TARGET_MS, MIN_PRIORITY,
    };
    let m = manifests();
    let spec = m.admission.spec.clone().unwrap();
    assert_eq!(spec.failure_policy.as_deref(), Some("Fail"));
    let rules = spec.match_constraints.unwrap().resource_rules.unwrap();
    assert_eq!(rules.len(), 1);
    assert_eq!(
        rules[0].resources.as_deref(),
        Some(&["pods".to_string()][..])
    );
    assert_eq!(
        rules[0].operations.clone().unwrap(),
        ["CREATE", "UPDATE"].map(String::from)
    );
    let vars: BTreeMap<String, String> = spec
        .variables
        .unwrap()
        .into_iter()
        .map(|v| (v.name, v.expression))
        .collect();
    let cel: String = vars
        .values()
        .cloned()
        .chain(spec.validations.unwrap().into_iter().map(|v| v.expression))
        .collect::<Vec<_>>()
        .join("\n");
    for name in [CLASS, PRIORITY, P99_TARGET_MS] {
        let key = format!("'{DEFAULT_PREFIX}/{name}'");
        assert!(cel.contains(&key), "the policy does not read {key}");
    }
    assert!(cel.contains(&format!("'{LATENCY_CRITICAL}'")));
    assert!(
        cel.contains(&format!(">= {MIN_PRIORITY}")),
        "the lower bound"
    );
    // The limits: the ConfigMap's where it sets them, else the agent's defaults.
    let cfg = daemon_config(&m.config);
    let k = cfg["kubernetes"].as_table().unwrap();
    let namespaces: Vec<String> = k
        .get("latency_critical_namespaces")
        .map(|v| {
            v.as_array()
                .unwrap()
                .iter()
                .map(|n| format!("'{}'", n.as_str().unwrap()))
                .collect()
        })
        .unwrap_or_default();
    assert_eq!(
        vars["latencyCriticalNamespaces"],
        format!("[{}]", namespaces.join(", "))
    );
    let max = k
        .get("max_pod_priority")
        .map_or(i64::from(DEFAULT_MAX_POD_PRIORITY), |v| {
            v.as_integer().unwrap()
        });
    assert_eq!(vars["maxPodPriority"].parse::<i64>().unwrap(), max);
    let floor = k
        .get("min_pod_p99_target_ms")
        .map_or(DEFAULT_MIN_POD_P99_TARGET_MS, |v| v.as_float().unwrap());
    assert_eq!(vars["minPodP99TargetMs"].parse::<f64>().unwrap(), floor);
    // The shipped ConfigMap keeps the agent's defaults (and so does the policy).
    assert!(namespaces.is_empty());
    assert_eq!(max, i64::from(DEFAULT_MAX_POD_PRIORITY));
    assert_eq!(floor, DEFAULT_MIN_POD_P99_TARGET_MS);
    // Bound, and denying.
    let binding = m.admission_binding.spec.clone().unwrap();
    assert_eq!(
        binding.policy_name.as_ref(),
        m.admission.metadata.name.as_ref()
    );
    assert_eq!(binding.validation_actions.unwrap(), ["Deny"]);
}

/// The daemon's config parser: every module of controller/src/daemon/config/, one after
/// another.
fn config_sources() -> String {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../controller/src/daemon/config");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "rs"))
        .collect();
    files.sort();
    files
        .iter()
        .map(|p| std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display())))
        .collect()
}

fn daemon_config(cm: &ConfigMap) -> toml::Table {
    let text = &cm.data.as_ref().unwrap()["cohabit.toml"];
    toml::from_str(text).unwrap_or_else(|e| panic!("configmap.yaml cohabit.toml: {e}"))
}

/// The field names of `struct <name> { … }` in the daemon's config parser.
fn parser_fields(src: &str, name: &str) -> BTreeSet<String> {
    let start = src
        .find(&format!("struct {name} {{"))
        .unwrap_or_else(|| panic!("no struct {name} in the config parser"));
    let body = &src[start..];
    let body = &body[body.find('{').unwrap() + 1..body.find("\n}").unwrap()];
    body.lines()
        .map(str::trim)
        .filter(|l| !l.starts_with("//") && !l.starts_with("#["))
        .filter_map(|l| {
            l.split_once(':')
                .map(|(k, _)| k.trim().trim_start_matches("pub ").to_string())
        })
        .filter(|k| {
            !k.is_empty()
                && k.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        })
        .collect()
}

#[test]
fn the_daemon_config_uses_keys_the_daemon_knows_and_paths_the_pod_mounts() {
    // The daemon's own parser (cohabit-controller) would be a dependency cycle once the
    // daemon depends on this crate, and pulls in libtorch; so the TOML's keys are checked
    // against the field names of the parser's structs (one module per section under
    // controller/src/daemon/config/), which all deny unknown fields.
    let src = config_sources();
    let m = manifests();
    let cfg = daemon_config(&m.config);
    let sections: BTreeMap<&str, &str> = [
        ("paths", "PathsFile"),
        ("kubernetes", "KubernetesFile"),
        ("host", "HostFile"),
        ("mps", "MpsFile"),
    ]
    .into();
    let top = parser_fields(&src, "File");
    for (key, value) in &cfg {
        assert!(
            top.contains(key),
            "unknown top-level key {key} (the parser's File has {top:?})"
        );
        if let Some(table) = value.as_table() {
            let known = parser_fields(&src, sections[key.as_str()]);
            for k in table.keys() {
                assert!(
                    known.contains(k),
                    "unknown key {key}.{k} (the parser has {known:?})"
                );
            }
        }
    }
    assert!(cfg.contains_key("kubernetes"), "services come from pods");
    // Every path the daemon uses is inside a mount (or the host's /proc and /sys).
    let pod = m.daemonset.spec.unwrap().template.spec.unwrap();
    let c = &pod.containers[0];
    let mounts: Vec<String> = c
        .volume_mounts
        .iter()
        .flatten()
        .map(|m| m.mount_path.clone())
        .collect();
    let mounted = |p: &str| {
        mounts
            .iter()
            .any(|m| p == m || p.starts_with(&format!("{m}/")))
    };
    let paths = cfg["paths"].as_table().unwrap();
    for key in ["cgroup", "resctrl", "state_dir"] {
        let p = paths[key].as_str().unwrap();
        assert!(mounted(p), "paths.{key} = {p} is not mounted");
    }
    assert_eq!(paths["proc"].as_str(), Some("/proc"));
    let log = cfg["log"].as_str().unwrap();
    assert!(
        mounted(Path::new(log).parent().unwrap().to_str().unwrap()),
        "log {log}"
    );
    let kubelet = cfg["kubernetes"]["kubelet_dir"].as_str().unwrap();
    assert!(mounted(kubelet), "kubelet_dir {kubelet}");
    assert!(
        cfg["kubernetes"].get("node_name").is_none(),
        "node_name comes from NODE_NAME"
    );
    // The command reads this ConfigMap's key where the ConfigMap is mounted.
    let cm_volume = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| {
            v.config_map.as_ref().map(|c| c.name.as_str()) == m.config.metadata.name.as_deref()
        })
        .unwrap();
    let mount = c
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.name == cm_volume.name)
        .unwrap();
    let command = c.command.clone().unwrap();
    let at = command.iter().position(|a| a == "--config").unwrap();
    assert_eq!(
        command[at + 1],
        format!("{}/cohabit.toml", mount.mount_path)
    );
    assert_eq!(command[1], "run");
}

#[test]
fn the_dashboard_plots_metrics_the_exporter_exports() {
    let text = std::fs::read_to_string(deploy_dir().join("grafana-dashboard.json")).unwrap();
    let dash: Value = serde_json::from_str(&text).unwrap();
    let exporter = repo_file("controller/src/daemon/exporter/metrics.rs");
    let mut exprs = Vec::new();
    for p in dash["panels"].as_array().unwrap() {
        assert!(p["title"].as_str().is_some_and(|t| !t.is_empty()));
        for t in p["targets"].as_array().unwrap() {
            exprs.push(t["expr"].as_str().unwrap().to_string());
        }
    }
    for v in dash["templating"]["list"].as_array().unwrap() {
        if let Some(q) = v["query"]["query"].as_str() {
            exprs.push(q.to_string());
        }
    }
    let mut used = BTreeSet::new();
    for e in &exprs {
        let mut rest = e.as_str();
        while let Some(i) = rest.find("cohabit_") {
            let name: String = rest[i..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            rest = &rest[i + name.len()..];
            used.insert(name);
        }
    }
    for name in &used {
        assert!(
            exporter.contains(&format!("\"{name}\"")),
            "{name} is not a metric of exporter/metrics.rs"
        );
    }
    for needed in [
        "cohabit_service_p99_ms",
        "cohabit_service_target_ms",
        "cohabit_allocation",
        "cohabit_fallbacks_total",
    ] {
        assert!(used.contains(needed), "the dashboard lacks {needed}");
    }
    // Labels the exporter sets, plus `node` from the PodMonitor's relabeling.
    for label in ["service", "group", "resource", "kind"] {
        assert!(
            exporter.contains(&format!("    {label}: ")),
            "exporter has no label {label}"
        );
    }
}
