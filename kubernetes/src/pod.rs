//! From a Kubernetes `Pod` object to what cohabit manages of it. Pure: no I/O.
//!
//! A pod is in the view when it is running (`status.phase == "Running"` and no
//! `metadata.deletionTimestamp`), has a UID, and has valid cohabit annotations. Its QoS class
//! is `status.qosClass` (the kubelet sets it); when absent it is derived from the containers'
//! requests and limits with the kubelet's rules. Its containers are the running ones in
//! `status.containerStatuses` (and running restartable init containers, i.e. native
//! sidecars) with a `containerID` of the form `<runtime>://<id>`.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, ContainerStatus, Pod};

use crate::annotations::{classify, AnnotationError};
use crate::{ContainerRef, ManagedPod, PodKey, QosClass};

/// What the agent makes of one pod object.
#[derive(Debug, Clone, PartialEq)]
pub enum PodOutcome {
    /// Running, annotated, valid: in the view.
    Managed(ManagedPod),
    /// Not cohabit's (no class annotation) or not running (pending, finished, terminating).
    Ignored,
    /// Annotated but invalid: left out of the view; the agent posts a Warning Event.
    Invalid {
        /// The pod.
        key: PodKey,
        /// What is wrong.
        error: AnnotationError,
    },
}

/// The pod's namespace, name and UID; `None` when any is missing (never from a real server).
pub fn pod_key(pod: &Pod) -> Option<PodKey> {
    let m = &pod.metadata;
    Some(PodKey {
        namespace: m.namespace.clone()?,
        name: m.name.clone()?,
        uid: m.uid.clone()?,
    })
}

/// Classes one pod object.
pub fn outcome(pod: &Pod, prefix: &str) -> PodOutcome {
    let Some(key) = pod_key(pod) else {
        return PodOutcome::Ignored;
    };
    let empty = BTreeMap::new();
    let annotations = pod.metadata.annotations.as_ref().unwrap_or(&empty);
    let classification = match classify(annotations, prefix) {
        Ok(None) => return PodOutcome::Ignored,
        Ok(Some(c)) => c,
        Err(error) => {
            // A terminating or finished pod's bad annotation is not worth an Event.
            return if is_running(pod) {
                PodOutcome::Invalid { key, error }
            } else {
                PodOutcome::Ignored
            };
        }
    };
    if !is_running(pod) {
        return PodOutcome::Ignored;
    }
    PodOutcome::Managed(ManagedPod {
        key,
        qos: qos_class(pod),
        class: classification.class,
        priority: classification.priority,
        containers: containers(pod),
        ips: pod_ips(pod),
    })
}

/// The pod's addresses from `status.podIPs` (or `status.podIP` on API servers that only
/// fill that), parsed, de-duplicated and sorted; unparsable entries are left out.
pub fn pod_ips(pod: &Pod) -> Vec<std::net::IpAddr> {
    let Some(status) = &pod.status else {
        return Vec::new();
    };
    let mut out: Vec<std::net::IpAddr> = status
        .pod_ips
        .iter()
        .flatten()
        .map(|p| p.ip.as_str())
        .chain(status.pod_ip.as_deref())
        .filter_map(|s| s.parse().ok())
        .collect();
    out.sort();
    out.dedup();
    out
}

/// Running and not being deleted.
pub fn is_running(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_none()
        && pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
}

/// `status.qosClass`, or the kubelet's rule on the containers' resources when it is absent
/// or unknown.
pub fn qos_class(pod: &Pod) -> QosClass {
    match pod.status.as_ref().and_then(|s| s.qos_class.as_deref()) {
        Some("Guaranteed") => QosClass::Guaranteed,
        Some("Burstable") => QosClass::Burstable,
        Some("BestEffort") => QosClass::BestEffort,
        _ => derived_qos(pod),
    }
}

/// The kubelet's QoS rule (pkg/apis/core/v1/helper/qos): BestEffort when no container
/// requests or limits CPU or memory; Guaranteed when every container has CPU and memory
/// limits and its requests (when given) equal them; Burstable otherwise.
fn derived_qos(pod: &Pod) -> QosClass {
    let Some(spec) = &pod.spec else {
        return QosClass::BestEffort;
    };
    let all: Vec<&Container> = spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .collect();
    let tracked = ["cpu", "memory"];
    let mut any = false;
    let mut guaranteed = true;
    for c in &all {
        let res = c.resources.as_ref();
        let requests = res.and_then(|r| r.requests.as_ref());
        let limits = res.and_then(|r| r.limits.as_ref());
        for name in tracked {
            let req = requests.and_then(|r| r.get(name));
            let lim = limits.and_then(|l| l.get(name));
            any |= req.is_some() || lim.is_some();
            match (req, lim) {
                (_, None) => guaranteed = false,
                (Some(r), Some(l)) if r != l => guaranteed = false,
                _ => {}
            }
        }
    }
    if !any {
        QosClass::BestEffort
    } else if guaranteed {
        QosClass::Guaranteed
    } else {
        QosClass::Burstable
    }
}

/// The running containers with a container id, sorted by name.
pub fn containers(pod: &Pod) -> Vec<ContainerRef> {
    let Some(status) = &pod.status else {
        return Vec::new();
    };
    let mut out: Vec<ContainerRef> = status
        .container_statuses
        .iter()
        .flatten()
        .chain(status.init_container_statuses.iter().flatten())
        .filter(|s| s.state.as_ref().is_some_and(|st| st.running.is_some()))
        .filter_map(container_ref)
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

fn container_ref(s: &ContainerStatus) -> Option<ContainerRef> {
    let (runtime, id) = parse_container_id(s.container_id.as_deref()?)?;
    Some(ContainerRef {
        name: s.name.clone(),
        runtime,
        id,
    })
}

/// Splits `containerd://abc…` into `("containerd", "abc…")`; `None` when there is no
/// scheme or either part is empty.
pub fn parse_container_id(raw: &str) -> Option<(String, String)> {
    let (scheme, id) = raw.split_once("://")?;
    if scheme.is_empty() || id.is_empty() {
        return None;
    }
    Some((scheme.to_string(), id.to_string()))
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{PodSpec, PodStatus, ResourceRequirements};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use serde_json::json;

    use super::*;
    use crate::PodClass;

    fn pod(v: serde_json::Value) -> Pod {
        serde_json::from_value(v).unwrap()
    }

    fn running_lc() -> serde_json::Value {
        json!({
            "metadata": {"name": "web-0", "namespace": "shop", "uid": "u-1",
                "annotations": {"cohabit.io/class": "latency-critical", "cohabit.io/p99-target-ms": "5"}},
            "spec": {"nodeName": "n1", "containers": [{"name": "web"}, {"name": "proxy"}]},
            "status": {"phase": "Running", "qosClass": "Burstable", "containerStatuses": [
                {"name": "web", "ready": true, "restartCount": 0, "image": "i", "imageID": "",
                 "containerID": "containerd://aaa", "state": {"running": {}}},
                {"name": "proxy", "ready": true, "restartCount": 0, "image": "i", "imageID": "",
                 "containerID": "cri-o://bbb", "state": {"running": {}}}
            ]}
        })
    }

    #[test]
    fn pod_ips_come_from_pod_ips_then_pod_ip_deduplicated_and_bad_ones_dropped() {
        let mut v = running_lc();
        v["status"]["podIP"] = json!("10.1.2.3");
        v["status"]["podIPs"] = json!([{"ip": "fd00::3"}, {"ip": "10.1.2.3"}, {"ip": "nope"}]);
        let PodOutcome::Managed(m) = outcome(&pod(v), "cohabit.io") else {
            panic!("not managed")
        };
        let want: Vec<std::net::IpAddr> =
            vec!["10.1.2.3".parse().unwrap(), "fd00::3".parse().unwrap()];
        assert_eq!(m.ips, want);
        let PodOutcome::Managed(m) = outcome(&pod(running_lc()), "cohabit.io") else {
            panic!("not managed")
        };
        assert!(m.ips.is_empty(), "no address reported: none allowed");
    }

    #[test]
    fn a_running_annotated_pod_is_managed_with_its_containers_sorted() {
        let PodOutcome::Managed(m) = outcome(&pod(running_lc()), "cohabit.io") else {
            panic!("not managed")
        };
        assert_eq!(
            m.key,
            PodKey {
                namespace: "shop".into(),
                name: "web-0".into(),
                uid: "u-1".into()
            }
        );
        assert_eq!(m.qos, QosClass::Burstable);
        assert_eq!(
            m.class,
            PodClass::LatencyCritical {
                p99_target_ms: 5.0,
                latency: None
            }
        );
        let names: Vec<_> = m
            .containers
            .iter()
            .map(|c| (c.name.as_str(), c.runtime.as_str(), c.id.as_str()))
            .collect();
        assert_eq!(
            names,
            [("proxy", "cri-o", "bbb"), ("web", "containerd", "aaa")]
        );
    }

    #[test]
    fn pending_finished_and_terminating_pods_are_ignored() {
        for phase in ["Pending", "Succeeded", "Failed", "Unknown"] {
            let mut v = running_lc();
            v["status"]["phase"] = json!(phase);
            assert_eq!(
                outcome(&pod(v), "cohabit.io"),
                PodOutcome::Ignored,
                "{phase}"
            );
        }
        let mut v = running_lc();
        v["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
        assert_eq!(outcome(&pod(v), "cohabit.io"), PodOutcome::Ignored);
    }

    #[test]
    fn a_bad_annotation_on_a_running_pod_is_invalid_not_ignored() {
        let mut v = running_lc();
        v["metadata"]["annotations"]["cohabit.io/p99-target-ms"] = json!("fast");
        match outcome(&pod(v), "cohabit.io") {
            PodOutcome::Invalid { key, error } => {
                assert_eq!(key.name, "web-0");
                assert!(matches!(error, AnnotationError::BadTarget { .. }));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn containers_without_id_or_not_running_are_left_out_and_sidecars_kept() {
        let mut v = running_lc();
        v["status"]["containerStatuses"][0]["containerID"] = json!("");
        v["status"]["containerStatuses"][1]["state"] =
            json!({"waiting": {"reason": "CrashLoopBackOff"}});
        v["status"]["initContainerStatuses"] = json!([
            {"name": "mesh", "ready": true, "restartCount": 0, "image": "i", "imageID": "",
             "containerID": "docker://ccc", "state": {"running": {}}},
            {"name": "init", "ready": false, "restartCount": 0, "image": "i", "imageID": "",
             "containerID": "docker://ddd", "state": {"terminated": {"exitCode": 0}}}
        ]);
        let PodOutcome::Managed(m) = outcome(&pod(v), "cohabit.io") else {
            panic!()
        };
        assert_eq!(
            m.containers,
            vec![ContainerRef {
                name: "mesh".into(),
                runtime: "docker".into(),
                id: "ccc".into()
            }]
        );
    }

    #[test]
    fn container_ids_split_at_the_scheme() {
        assert_eq!(
            parse_container_id("containerd://0123abcd"),
            Some(("containerd".into(), "0123abcd".into()))
        );
        assert_eq!(
            parse_container_id("cri-o://x"),
            Some(("cri-o".into(), "x".into()))
        );
        for bad in ["", "abc", "://abc", "docker://"] {
            assert_eq!(parse_container_id(bad), None, "{bad}");
        }
    }

    fn with_resources(requests: &[(&str, &str)], limits: &[(&str, &str)]) -> Container {
        let q = |p: &[(&str, &str)]| {
            (!p.is_empty()).then(|| {
                p.iter()
                    .map(|(k, v)| (k.to_string(), Quantity(v.to_string())))
                    .collect()
            })
        };
        Container {
            name: "c".into(),
            resources: Some(ResourceRequirements {
                requests: q(requests),
                limits: q(limits),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn qos_of(containers: Vec<Container>) -> QosClass {
        qos_class(&Pod {
            spec: Some(PodSpec {
                containers,
                ..Default::default()
            }),
            status: Some(PodStatus::default()),
            ..Default::default()
        })
    }

    #[test]
    fn qos_is_derived_with_the_kubelet_rules_when_status_lacks_it() {
        assert_eq!(qos_of(vec![with_resources(&[], &[])]), QosClass::BestEffort);
        let full = [("cpu", "2"), ("memory", "1Gi")];
        assert_eq!(
            qos_of(vec![with_resources(&full, &full)]),
            QosClass::Guaranteed
        );
        assert_eq!(
            qos_of(vec![with_resources(&[], &full)]),
            QosClass::Guaranteed
        );
        assert_eq!(
            qos_of(vec![with_resources(&[("cpu", "1")], &[])]),
            QosClass::Burstable
        );
        assert_eq!(
            qos_of(vec![with_resources(
                &[("cpu", "1"), ("memory", "1Gi")],
                &full
            )]),
            QosClass::Burstable
        );
        assert_eq!(
            qos_of(vec![with_resources(&full, &full), with_resources(&[], &[])]),
            QosClass::Burstable
        );
    }

    #[test]
    fn the_status_qos_class_wins_over_the_derivation() {
        let mut v = running_lc();
        v["status"]["qosClass"] = json!("Guaranteed");
        assert_eq!(qos_class(&pod(v)), QosClass::Guaranteed);
    }
}
