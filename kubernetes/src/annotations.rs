//! The `cohabit.io/*` pod annotations: how an operator classes a pod for cohabit.
//!
//! Problem: a pod's annotations are free-form strings written by people; cohabit must turn
//! them into a class and a target, and a typo must neither crash the agent nor silently put
//! a pod under control with a wrong target.
//!
//! Approach: one pure function, [`classify`], from the annotation map to
//! `Ok(None)` (not ours: no `<prefix>/class`), `Ok(Some(..))` (a valid class) or
//! `Err(AnnotationError)` naming the annotation and the value that is wrong. The caller turns
//! an error into a Warning Event on the pod and leaves the pod out of the view.
//!
//! The annotations (prefix `cohabit.io` by default):
//! - `class`: `latency-critical` or `best-effort` (exact, surrounding blanks ignored).
//! - `p99-target-ms`: required for latency-critical; a finite number > 0 (milliseconds).
//!   Ignored on best-effort pods.
//! - `latency`: optional; where the pod's latency comes from (a probe URL, a Prometheus
//!   endpoint and metric, a push socket), passed on raw: the daemon validates it.
//! - `priority`: optional; a 32-bit integer, for either class.
//!
//! What is parsed here is what the pod claims; how much of it cohabit grants (which
//! namespaces may be latency-critical, the highest priority, the lowest target) is
//! [`crate::trust`]'s.

use std::collections::BTreeMap;

use crate::PodClass;

/// The default annotation prefix.
pub const DEFAULT_PREFIX: &str = "cohabit.io";

/// `<prefix>/class`: the pod's class.
pub const CLASS: &str = "class";
/// `<prefix>/p99-target-ms`: a latency-critical pod's target.
pub const P99_TARGET_MS: &str = "p99-target-ms";
/// `<prefix>/latency`: where a latency-critical pod's latency comes from.
pub const LATENCY: &str = "latency";
/// `<prefix>/priority`: the pod's priority.
pub const PRIORITY: &str = "priority";
/// The value of `<prefix>/class` for a latency-critical pod.
pub const LATENCY_CRITICAL: &str = "latency-critical";
/// The value of `<prefix>/class` for a best-effort pod.
pub const BEST_EFFORT: &str = "best-effort";

/// Largest p99 target accepted, in milliseconds (one hour): anything larger is a unit
/// mistake (microseconds or nanoseconds written as milliseconds), not a target.
pub const MAX_P99_TARGET_MS: f64 = 3_600_000.0;

/// A pod's cohabit class and priority, as its annotations give them.
#[derive(Debug, Clone, PartialEq)]
pub struct Classification {
    /// Latency-critical with its target, or best-effort.
    pub class: PodClass,
    /// `<prefix>/priority`, when given.
    pub priority: Option<i32>,
}

/// What is wrong with a pod's cohabit annotations.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AnnotationError {
    /// `<prefix>/class` is neither `latency-critical` nor `best-effort`.
    #[error("annotation {key}={value:?}: unknown class (expected \"latency-critical\" or \"best-effort\")")]
    UnknownClass {
        /// The annotation's key.
        key: String,
        /// Its value.
        value: String,
    },
    /// A latency-critical pod without `<prefix>/p99-target-ms`.
    #[error(
        "annotation {key} is missing: a latency-critical pod needs a p99 target in milliseconds"
    )]
    MissingTarget {
        /// The missing annotation's key.
        key: String,
    },
    /// `<prefix>/p99-target-ms` is not a number in (0, MAX_P99_TARGET_MS].
    #[error("annotation {key}={value:?}: {why}")]
    BadTarget {
        /// The annotation's key.
        key: String,
        /// Its value.
        value: String,
        /// Why it was refused.
        why: String,
    },
    /// `<prefix>/priority` is not a 32-bit integer.
    #[error("annotation {key}={value:?}: not a 32-bit integer")]
    BadPriority {
        /// The annotation's key.
        key: String,
        /// Its value.
        value: String,
    },
}

/// The Event reason for invalid annotations (CamelCase, as Kubernetes reasons are).
pub const REASON: &str = "InvalidCohabitAnnotation";

impl AnnotationError {
    /// The Event reason for this error.
    pub fn reason(&self) -> &'static str {
        REASON
    }
}

/// Classes a pod from its annotations. Pure: no I/O, no logging.
///
/// `Ok(None)` when the pod has no `<prefix>/class` annotation (not cohabit's to manage).
pub fn classify(
    annotations: &BTreeMap<String, String>,
    prefix: &str,
) -> Result<Option<Classification>, AnnotationError> {
    let key = |name: &str| format!("{prefix}/{name}");
    let Some(class) = annotations.get(&key(CLASS)) else {
        return Ok(None);
    };
    let priority = match annotations.get(&key(PRIORITY)) {
        None => None,
        Some(v) => Some(
            v.trim()
                .parse::<i32>()
                .map_err(|_| AnnotationError::BadPriority {
                    key: key(PRIORITY),
                    value: v.clone(),
                })?,
        ),
    };
    let class = match class.trim() {
        LATENCY_CRITICAL => {
            let target_key = key(P99_TARGET_MS);
            let raw = annotations
                .get(&target_key)
                .ok_or(AnnotationError::MissingTarget {
                    key: target_key.clone(),
                })?;
            let p99_target_ms = parse_target(raw).map_err(|why| AnnotationError::BadTarget {
                key: target_key,
                value: raw.clone(),
                why,
            })?;
            let latency = annotations
                .get(&key(LATENCY))
                .map(|l| l.trim().to_string())
                .filter(|l| !l.is_empty());
            PodClass::LatencyCritical {
                p99_target_ms,
                latency,
            }
        }
        BEST_EFFORT => PodClass::BestEffort,
        _ => {
            return Err(AnnotationError::UnknownClass {
                key: key(CLASS),
                value: class.clone(),
            })
        }
    };
    Ok(Some(Classification { class, priority }))
}

/// Parses a p99 target in milliseconds: a finite number in (0, MAX_P99_TARGET_MS].
fn parse_target(raw: &str) -> Result<f64, String> {
    let v: f64 = raw
        .trim()
        .parse()
        .map_err(|_| "not a number of milliseconds".to_string())?;
    if !v.is_finite() || v <= 0.0 {
        return Err("must be a finite number of milliseconds above 0".into());
    }
    if v > MAX_P99_TARGET_MS {
        return Err(format!(
            "above {MAX_P99_TARGET_MS} ms (one hour): is the unit milliseconds?"
        ));
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ann(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn lc(target: f64, latency: Option<&str>) -> PodClass {
        PodClass::LatencyCritical {
            p99_target_ms: target,
            latency: latency.map(str::to_string),
        }
    }

    #[test]
    fn a_pod_without_the_class_annotation_is_not_ours() {
        let a = ann(&[("cohabit.io/p99-target-ms", "5"), ("app", "web")]);
        assert_eq!(classify(&a, DEFAULT_PREFIX), Ok(None));
    }

    #[test]
    fn a_latency_critical_pod_gets_its_target_latency_and_priority() {
        let a = ann(&[
            ("cohabit.io/class", "latency-critical"),
            ("cohabit.io/p99-target-ms", " 2.5 "),
            ("cohabit.io/latency", " probe=http://127.0.0.1:8080/health "),
            ("cohabit.io/priority", "-3"),
        ]);
        let c = classify(&a, DEFAULT_PREFIX).unwrap().unwrap();
        assert_eq!(c.class, lc(2.5, Some("probe=http://127.0.0.1:8080/health")));
        assert_eq!(c.priority, Some(-3));
    }

    #[test]
    fn an_empty_latency_annotation_counts_as_absent() {
        let a = ann(&[
            ("cohabit.io/class", "latency-critical"),
            ("cohabit.io/p99-target-ms", "10"),
            ("cohabit.io/latency", "  "),
        ]);
        assert_eq!(
            classify(&a, DEFAULT_PREFIX).unwrap().unwrap().class,
            lc(10.0, None)
        );
    }

    #[test]
    fn a_best_effort_pod_needs_no_target_and_ignores_one() {
        let a = ann(&[
            ("cohabit.io/class", "best-effort"),
            ("cohabit.io/p99-target-ms", "x"),
        ]);
        let c = classify(&a, DEFAULT_PREFIX).unwrap().unwrap();
        assert_eq!(c.class, PodClass::BestEffort);
        assert_eq!(c.priority, None);
    }

    #[test]
    fn an_unknown_class_is_an_error_naming_key_and_value() {
        let a = ann(&[("cohabit.io/class", "Latency-Critical")]);
        let e = classify(&a, DEFAULT_PREFIX).unwrap_err();
        assert!(matches!(e, AnnotationError::UnknownClass { .. }));
        let text = e.to_string();
        assert!(
            text.contains("cohabit.io/class") && text.contains("Latency-Critical"),
            "{text}"
        );
    }

    #[test]
    fn a_latency_critical_pod_without_target_is_an_error() {
        let a = ann(&[("cohabit.io/class", "latency-critical")]);
        assert_eq!(
            classify(&a, DEFAULT_PREFIX),
            Err(AnnotationError::MissingTarget {
                key: "cohabit.io/p99-target-ms".into()
            })
        );
    }

    #[test]
    fn bad_targets_are_refused() {
        for bad in ["", "abc", "0", "-1", "NaN", "inf", "1e9", "5ms"] {
            let a = ann(&[
                ("cohabit.io/class", "latency-critical"),
                ("cohabit.io/p99-target-ms", bad),
            ]);
            match classify(&a, DEFAULT_PREFIX) {
                Err(AnnotationError::BadTarget { value, .. }) => assert_eq!(value, bad),
                other => panic!("{bad:?} gave {other:?}"),
            }
        }
    }

    #[test]
    fn bad_priorities_are_refused_for_either_class() {
        for class in ["best-effort", "latency-critical"] {
            for bad in ["high", "1.5", "99999999999"] {
                let a = ann(&[
                    ("cohabit.io/class", class),
                    ("cohabit.io/p99-target-ms", "1"),
                    ("cohabit.io/priority", bad),
                ]);
                assert!(
                    matches!(
                        classify(&a, DEFAULT_PREFIX),
                        Err(AnnotationError::BadPriority { .. })
                    ),
                    "{class} {bad}"
                );
            }
        }
    }

    #[test]
    fn the_prefix_is_configurable() {
        let a = ann(&[
            ("cohabit.io/class", "best-effort"),
            ("example.com/class", "latency-critical"),
            ("example.com/p99-target-ms", "7"),
        ]);
        let c = classify(&a, "example.com").unwrap().unwrap();
        assert_eq!(c.class, lc(7.0, None));
    }

    #[test]
    fn every_kind_of_bad_annotation_gives_its_error_and_the_one_event_reason() {
        let lc = ("cohabit.io/class", "latency-critical");
        let cases: [(&[(&str, &str)], &str); 4] = [
            (&[("cohabit.io/class", "gold")], "UnknownClass"),
            (&[lc], "MissingTarget"),
            (&[lc, ("cohabit.io/p99-target-ms", "-1")], "BadTarget"),
            (
                &[
                    lc,
                    ("cohabit.io/p99-target-ms", "5"),
                    ("cohabit.io/priority", "high"),
                ],
                "BadPriority",
            ),
        ];
        for (pairs, variant) in cases {
            let e = classify(&ann(pairs), "cohabit.io").expect_err(variant);
            let got = match &e {
                AnnotationError::UnknownClass { .. } => "UnknownClass",
                AnnotationError::MissingTarget { .. } => "MissingTarget",
                AnnotationError::BadTarget { .. } => "BadTarget",
                AnnotationError::BadPriority { .. } => "BadPriority",
            };
            assert_eq!(got, variant, "{pairs:?}: {e}");
            assert_eq!(e.reason(), "InvalidCohabitAnnotation", "{variant}");
        }
    }
}
