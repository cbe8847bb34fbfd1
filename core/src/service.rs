use serde::{Deserialize, Serialize};

use crate::CoreError;

/// Whether a service has a tail-latency target or takes what is left.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "class", rename_all = "kebab-case")]
pub enum ServiceClass {
    /// A latency-critical (LC) service with a p99 target.
    LatencyCritical {
        /// The 99th-percentile latency the service must stay under.
        p99_target_ms: f64,
    },
    /// A best-effort (BE) batch job: no target, runs on the leftovers.
    BestEffort,
}

/// One managed service or job, as the controller knows it. (Not `deny_unknown_fields`:
/// serde cannot combine it with the flattened class; configuration files have their own
/// strict structs.)
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServiceSpec {
    /// Unique name; also the key of its allocation in a [`crate::Plan`].
    pub name: String,
    /// Latency-critical or best-effort.
    #[serde(flatten)]
    pub class: ServiceClass,
    /// Index of the GPU it runs on, if it is a GPU service.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<u32>,
    /// Overload priority of a latency-critical service: when not every target can be met,
    /// the lower priority yields first (higher wins; default 0). See docs/DESIGN.md 5
    /// ("Overload") for the rule every policy follows. Ignored for best effort, which
    /// always yields to every latency-critical service.
    #[serde(default, skip_serializing_if = "is_default_priority")]
    pub priority: i32,
}

fn is_default_priority(p: &i32) -> bool {
    *p == 0
}

impl ServiceSpec {
    /// The p99 target in milliseconds of a latency-critical service, `None` for best effort.
    pub fn p99_target_ms(&self) -> Option<f64> {
        match self.class {
            ServiceClass::LatencyCritical { p99_target_ms } => Some(p99_target_ms),
            ServiceClass::BestEffort => None,
        }
    }

    /// True for latency-critical services.
    pub fn is_latency_critical(&self) -> bool {
        matches!(self.class, ServiceClass::LatencyCritical { .. })
    }

    /// Checks the name and the target; the error names the service.
    pub fn validate(&self) -> Result<(), CoreError> {
        if self.name.is_empty() {
            return Err(CoreError::invalid("service.name", "must not be empty"));
        }
        if let Some(t) = self.p99_target_ms() {
            if !(t.is_finite() && t > 0.0) {
                return Err(CoreError::invalid(
                    format!("service {}: p99_target_ms", self.name),
                    format!("must be a positive number of milliseconds, got {t}"),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_target_is_rejected_with_the_service_name() {
        let s = ServiceSpec {
            name: "memcached".into(),
            class: ServiceClass::LatencyCritical { p99_target_ms: 0.0 },
            gpu: None,
            priority: 0,
        };
        let err = s.validate().unwrap_err().to_string();
        assert!(
            err.contains("memcached") && err.contains("p99_target_ms"),
            "{err}"
        );
    }

    #[test]
    fn class_serialises_as_a_flat_tag() {
        let s = ServiceSpec {
            name: "x".into(),
            class: ServiceClass::LatencyCritical { p99_target_ms: 5.0 },
            gpu: None,
            priority: 0,
        };
        let json = serde_json::to_string(&s).unwrap();
        assert_eq!(
            json,
            r#"{"name":"x","class":"latency-critical","p99_target_ms":5.0}"#
        );
        let back: ServiceSpec = serde_json::from_str(&json).unwrap();
        assert_eq!(back, s);
    }

    #[test]
    fn priority_defaults_to_zero_and_is_written_only_when_set() {
        let old: ServiceSpec =
            serde_json::from_str(r#"{"name":"x","class":"latency-critical","p99_target_ms":5.0}"#)
                .unwrap();
        assert_eq!(old.priority, 0);
        let mut s = old.clone();
        s.priority = 2;
        let json = serde_json::to_string(&s).unwrap();
        assert!(json.contains(r#""priority":2"#), "{json}");
        assert_eq!(serde_json::from_str::<ServiceSpec>(&json).unwrap(), s);
        assert!(!serde_json::to_string(&old).unwrap().contains("priority"));
    }
}
