use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{Change, Observation, Plan};

/// Version of the [`DecisionRecord`] layout. Changes are additive only: new fields carry
/// `#[serde(default)]`, so every older log still parses.
pub const DECISION_SCHEMA_VERSION: u32 = 1;

/// What a model predicted for one service under the chosen plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    /// Predicted log(p99 / target).
    pub log_qos_ratio: f64,
    /// Spread of the prediction (standard deviation, same units).
    pub log_qos_sigma: f64,
}

/// Ground truth of the simulator for one interval. Absent on real
/// hosts. Used for metrics, never shown to policies other than the oracle.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroundTruth {
    /// True p99 latency per latency-critical service.
    pub p99_ms: BTreeMap<String, f64>,
    /// Offered load per latency-critical service.
    pub load_rps: BTreeMap<String, f64>,
    /// Best-effort throughput: the sum over jobs of each job's progress relative to running
    /// alone on the whole host.
    pub be_throughput: f64,
}

/// One line of `decisions.jsonl`: what the controller saw, decided and why, at one tick.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DecisionRecord {
    /// Layout version ([`DECISION_SCHEMA_VERSION`]).
    pub schema_version: u32,
    /// Policy name.
    pub policy: String,
    /// True when the host was the simulator.
    pub simulated: bool,
    /// The telemetry and the allocation in force (time is `observation.t_ms`).
    pub observation: Observation,
    /// The plan decided at this tick.
    pub plan: Plan,
    /// What was actually changed on the host to get from `observation.current` to `plan`.
    pub changes: Vec<Change>,
    /// Per group, why the policy decided what it did.
    #[serde(default)]
    pub reasons: BTreeMap<String, String>,
    /// Wall-clock time the policy took, in microseconds.
    pub decision_us: f64,
    /// Model predictions per service, where the policy used a model.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub predictions: BTreeMap<String, Prediction>,
    /// Simulator only: the ground truth of the interval the observation describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub truth: Option<GroundTruth>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Allocation, WayRange};

    #[test]
    fn an_older_record_without_optional_fields_still_parses() {
        let a = Allocation {
            cores: 1,
            llc_ways: WayRange::new(0, 1),
            mba_pct: 100,
            gpu_mps_pct: None,
        };
        let rec = DecisionRecord {
            schema_version: DECISION_SCHEMA_VERSION,
            policy: "static".into(),
            simulated: true,
            observation: Observation {
                t_ms: 0,
                services: vec![],
                current: Plan {
                    services: Default::default(),
                    best_effort: a,
                },
            },
            plan: Plan {
                services: Default::default(),
                best_effort: a,
            },
            changes: vec![],
            reasons: Default::default(),
            decision_us: 1.0,
            predictions: Default::default(),
            truth: None,
        };
        let mut v = serde_json::to_value(&rec).unwrap();
        let obj = v.as_object_mut().unwrap();
        assert!(!obj.contains_key("truth") && !obj.contains_key("predictions"));
        obj.remove("reasons");
        let back: DecisionRecord = serde_json::from_value(v).unwrap();
        assert_eq!(back, rec);
    }
}
