//! How far cohabit takes a pod's word: who may be latency-critical, at what priority, with
//! what target.
//!
//! Problem: whoever may create pods in some namespace writes their annotations. Taken as
//! written, `cohabit.io/class: latency-critical` with `cohabit.io/priority: 2147483647`
//! and a target no service meets (`0.001` ms) lets one pod take the cores of every other
//! latency-critical service on the node (a priority overload rule takes from any lower
//! priority whatever its slack), while the operator's own services are held to ±1000.
//!
//! Approach: the operator says what pods may claim ([`PodTrust`], the daemon's
//! `[kubernetes]` keys `latency_critical_namespaces`, `max_pod_priority` and
//! `min_pod_p99_target_ms`), and one pure function, [`trust`], turns a pod's claim into
//! what cohabit grants, with one [`Adjustment`] per thing it changed, which the daemon posts
//! as a Warning Event. The same rules are enforced at admission by
//! `deploy/kubernetes/validating-admission-policy.yaml` (its defaults are these constants;
//! `kubernetes/tests/manifests.rs` checks that).
//!
//! Rules:
//! - A latency-critical pod outside `latency_critical_namespaces` becomes best effort, and
//!   its priority and target are ignored: one adjustment, [`Adjustment::NotAllowed`].
//! - A latency-critical pod's priority is clamped to
//!   `[MIN_PRIORITY, max_priority]` (never above [`MAX_PRIORITY`], the bound of configured
//!   services): [`Adjustment::PriorityClamped`] when it changed.
//! - A latency-critical pod's target below `min_p99_target_ms` is raised to it:
//!   [`Adjustment::TargetRaised`].
//! - A best-effort pod's priority is 0, as a configured best-effort job's is (priorities
//!   rank latency-critical services only).

use std::collections::BTreeSet;

use crate::{ManagedPod, PodClass};

/// Highest priority anything may have: the bound of configured services.
pub const MAX_PRIORITY: i32 = 1000;
/// Lowest priority anything may have: the bound of configured services.
pub const MIN_PRIORITY: i32 = -1000;
/// `max_pod_priority` when not configured: pods cannot rank above configured services'
/// default.
pub const DEFAULT_MAX_POD_PRIORITY: i32 = 0;
/// `min_pod_p99_target_ms` when not configured (50 µs: below what a network service's
/// p99 can be, so a target under it always misses and always asks for more).
pub const DEFAULT_MIN_POD_P99_TARGET_MS: f64 = 0.05;
/// The lowest `min_pod_p99_target_ms` an operator may set (1 µs).
pub const MIN_POD_P99_TARGET_FLOOR_MS: f64 = 0.001;

/// What the operator lets pods claim.
#[derive(Debug, Clone, PartialEq)]
pub struct PodTrust {
    /// Namespaces whose pods may be latency-critical (none by default).
    pub latency_critical_namespaces: BTreeSet<String>,
    /// Highest priority a pod may claim, in `[MIN_PRIORITY, MAX_PRIORITY]`.
    pub max_priority: i32,
    /// Lowest p99 target a pod may claim, in milliseconds.
    pub min_p99_target_ms: f64,
}

impl Default for PodTrust {
    fn default() -> Self {
        PodTrust {
            latency_critical_namespaces: BTreeSet::new(),
            max_priority: DEFAULT_MAX_POD_PRIORITY,
            min_p99_target_ms: DEFAULT_MIN_POD_P99_TARGET_MS,
        }
    }
}

/// One thing cohabit did not take as the pod wrote it.
#[derive(Debug, Clone, PartialEq)]
pub enum Adjustment {
    /// Latency-critical asked for in a namespace not allowed to: best effort instead.
    NotAllowed {
        /// The pod's namespace.
        namespace: String,
    },
    /// The priority was outside what pods may claim.
    PriorityClamped {
        /// What the pod asked for.
        asked: i32,
        /// What it got.
        granted: i32,
    },
    /// The p99 target was below the floor.
    TargetRaised {
        /// What the pod asked for, in milliseconds.
        asked: f64,
        /// What it got.
        granted: f64,
    },
}

impl Adjustment {
    /// The Warning Event's reason (CamelCase).
    pub fn reason(&self) -> &'static str {
        match self {
            Adjustment::NotAllowed { .. } => "LatencyCriticalNotAllowed",
            Adjustment::PriorityClamped { .. } => "PriorityClamped",
            Adjustment::TargetRaised { .. } => "P99TargetRaised",
        }
    }
}

impl std::fmt::Display for Adjustment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Adjustment::NotAllowed { namespace } => write!(
                f,
                "namespace {namespace:?} is not in kubernetes.latency_critical_namespaces: the pod is managed as best effort (its priority and target are ignored)"
            ),
            Adjustment::PriorityClamped { asked, granted } => write!(
                f,
                "priority {asked} is outside what pods may claim (kubernetes.max_pod_priority and -1000): {granted} is used"
            ),
            Adjustment::TargetRaised { asked, granted } => write!(
                f,
                "p99 target {asked} ms is below kubernetes.min_pod_p99_target_ms: {granted} ms is used"
            ),
        }
    }
}

/// What cohabit grants a pod.
#[derive(Debug, Clone, PartialEq)]
pub struct Trusted {
    /// Its class (and target) as granted.
    pub class: PodClass,
    /// Its priority as granted.
    pub priority: i32,
    /// What was changed, one entry each (empty when the pod got what it asked for).
    pub adjustments: Vec<Adjustment>,
}

/// What `pod` is granted under `t` (pure; see the module doc for the rules).
pub fn trust(pod: &ManagedPod, t: &PodTrust) -> Trusted {
    let PodClass::LatencyCritical {
        p99_target_ms,
        latency,
    } = &pod.class
    else {
        return Trusted {
            class: PodClass::BestEffort,
            priority: 0,
            adjustments: Vec::new(),
        };
    };
    if !t.latency_critical_namespaces.contains(&pod.key.namespace) {
        return Trusted {
            class: PodClass::BestEffort,
            priority: 0,
            adjustments: vec![Adjustment::NotAllowed {
                namespace: pod.key.namespace.clone(),
            }],
        };
    }
    let mut adjustments = Vec::new();
    let asked = pod.priority.unwrap_or(0);
    let granted = asked.clamp(
        MIN_PRIORITY,
        t.max_priority.clamp(MIN_PRIORITY, MAX_PRIORITY),
    );
    if granted != asked {
        adjustments.push(Adjustment::PriorityClamped { asked, granted });
    }
    // `!(x >= floor)` also catches a NaN (the annotation parser refuses one already).
    let target = if *p99_target_ms >= t.min_p99_target_ms {
        *p99_target_ms
    } else {
        adjustments.push(Adjustment::TargetRaised {
            asked: *p99_target_ms,
            granted: t.min_p99_target_ms,
        });
        t.min_p99_target_ms
    };
    Trusted {
        class: PodClass::LatencyCritical {
            p99_target_ms: target,
            latency: latency.clone(),
        },
        priority: granted,
        adjustments,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{PodKey, QosClass};

    fn pod(ns: &str, class: PodClass, priority: Option<i32>) -> ManagedPod {
        ManagedPod {
            key: PodKey {
                namespace: ns.into(),
                name: "p".into(),
                uid: "u".into(),
            },
            qos: QosClass::Burstable,
            class,
            priority,
            containers: vec![],
            ips: vec![],
        }
    }

    fn lc(target: f64) -> PodClass {
        PodClass::LatencyCritical {
            p99_target_ms: target,
            latency: Some("memcached://10.0.0.1:11211".into()),
        }
    }

    fn allowing(ns: &[&str]) -> PodTrust {
        PodTrust {
            latency_critical_namespaces: ns.iter().map(|s| s.to_string()).collect(),
            ..PodTrust::default()
        }
    }

    #[test]
    fn by_default_no_pod_is_latency_critical_and_one_adjustment_says_why() {
        let t = trust(
            &pod("shop", lc(0.001), Some(i32::MAX)),
            &PodTrust::default(),
        );
        assert_eq!(t.class, PodClass::BestEffort);
        assert_eq!(t.priority, 0);
        assert_eq!(
            t.adjustments,
            [Adjustment::NotAllowed {
                namespace: "shop".into()
            }]
        );
        assert_eq!(t.adjustments[0].reason(), "LatencyCriticalNotAllowed");
        assert!(t.adjustments[0].to_string().contains("\"shop\""));
    }

    #[test]
    fn in_an_allowed_namespace_priority_is_clamped_and_the_target_raised() {
        let t = trust(
            &pod("shop", lc(5e-324), Some(i32::MAX)),
            &allowing(&["shop"]),
        );
        assert_eq!(t.priority, DEFAULT_MAX_POD_PRIORITY);
        assert_eq!(
            t.class,
            PodClass::LatencyCritical {
                p99_target_ms: DEFAULT_MIN_POD_P99_TARGET_MS,
                latency: Some("memcached://10.0.0.1:11211".into()),
            }
        );
        let reasons: Vec<_> = t.adjustments.iter().map(Adjustment::reason).collect();
        assert_eq!(reasons, ["PriorityClamped", "P99TargetRaised"]);
        // Never beyond the configured services' bounds, whatever the operator allows.
        let mut wide = allowing(&["shop"]);
        wide.max_priority = i32::MAX;
        assert_eq!(
            trust(&pod("shop", lc(1.0), Some(i32::MAX)), &wide).priority,
            MAX_PRIORITY
        );
        assert_eq!(
            trust(&pod("shop", lc(1.0), Some(i32::MIN)), &wide).priority,
            MIN_PRIORITY
        );
    }

    #[test]
    fn a_claim_within_the_rules_is_taken_as_written() {
        let mut t = allowing(&["shop"]);
        t.max_priority = 10;
        let got = trust(&pod("shop", lc(2.5), Some(7)), &t);
        assert_eq!((got.class, got.priority), (lc(2.5), 7));
        assert!(got.adjustments.is_empty());
        let got = trust(&pod("shop", lc(2.5), None), &t);
        assert_eq!(got.priority, 0);
    }

    #[test]
    fn a_best_effort_pod_has_priority_zero_and_no_adjustment() {
        let got = trust(
            &pod("batch", PodClass::BestEffort, Some(i32::MAX)),
            &PodTrust::default(),
        );
        assert_eq!((got.class, got.priority), (PodClass::BestEffort, 0));
        assert!(got.adjustments.is_empty());
    }
}
