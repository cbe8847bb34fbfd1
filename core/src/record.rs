use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::{Change, Observation, Plan, Resource};

/// Version of the [`DecisionRecord`] layout. Changes are additive where they can be: new
/// fields carry `#[serde(default)]`. Version 2 typed the reasons ([`Reason`]) and moved the
/// outcome of applying a plan out of them ([`ApplyOutcome`]); version-1 records still load
/// (see [`DecisionRecord::upgrade`]).
pub const DECISION_SCHEMA_VERSION: u32 = 2;

/// Which way of deciding produced a group's allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DecisionPath {
    /// A learned model chose it.
    Model,
    /// The model could not be trusted; a feedback step was taken instead.
    Fallback,
    /// A feedback controller's step (PARTIES).
    Feedback,
    /// The simulator-only oracle's search.
    Oracle,
    /// A fixed share: the static policy, or an initial plan before any measurement.
    Static,
    /// Safe exploration (`cohabit run --explore`): a bounded step away from the base
    /// policy's plan, taken only while every service kept its margin under its target.
    Explore,
    /// One sample of a policy's search: a plan tried on the host to measure it, not one the
    /// policy expects to keep (CLITE's Bayesian optimisation).
    Search,
    /// A plan held on purpose: the policy keeps the plan it chose before (CLITE's best
    /// sample, between searches).
    Hold,
}

impl DecisionPath {
    /// Every path, in legend order.
    pub const ALL: [DecisionPath; 8] = [
        DecisionPath::Model,
        DecisionPath::Fallback,
        DecisionPath::Feedback,
        DecisionPath::Oracle,
        DecisionPath::Static,
        DecisionPath::Explore,
        DecisionPath::Search,
        DecisionPath::Hold,
    ];

    /// Short name, as written in logs and metrics labels.
    pub fn name(self) -> &'static str {
        match self {
            DecisionPath::Model => "model",
            DecisionPath::Fallback => "fallback",
            DecisionPath::Feedback => "feedback",
            DecisionPath::Oracle => "oracle",
            DecisionPath::Static => "static",
            DecisionPath::Explore => "explore",
            DecisionPath::Search => "search",
            DecisionPath::Hold => "hold",
        }
    }
}

impl std::fmt::Display for DecisionPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a group got its allocation: the path that decided it, and words for people.
/// Programs branch on `path`; `text` is never parsed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Reason {
    /// How the allocation was decided.
    pub path: DecisionPath,
    /// What an operator reads.
    pub text: String,
}

impl Reason {
    /// A reason on `path`.
    pub fn new(path: DecisionPath, text: impl Into<String>) -> Self {
        Self {
            path,
            text: text.into(),
        }
    }

    /// A version-1 reason: free text whose leading word named the path.
    fn from_v1(text: &str) -> Self {
        let lower = text.trim_start().to_ascii_lowercase();
        let path = DecisionPath::ALL
            .into_iter()
            .find(|p| lower.starts_with(p.name()))
            .unwrap_or(DecisionPath::Static);
        let rest = text
            .trim_start()
            .get(path.name().len()..)
            .filter(|_| lower.starts_with(path.name()))
            .map_or(text, |r| r.trim_start_matches([':', ' ']));
        Self::new(path, rest)
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path, self.text)
    }
}

impl<'de> Deserialize<'de> for Reason {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Wire {
            Typed { path: DecisionPath, text: String },
            V1(String),
        }
        Ok(match Wire::deserialize(d)? {
            Wire::Typed { path, text } => Reason { path, text },
            Wire::V1(text) => Reason::from_v1(&text),
        })
    }
}

/// What became of a plan that differed from the one in force, when it was not written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum ApplyOutcome {
    /// `--dry-run`: nothing was written.
    DryRun,
    /// The host refused it; the plan in force stayed.
    Refused {
        /// What refused it.
        error: String,
    },
}

/// What a model predicted for one service under the chosen plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    /// Predicted log(p99 / target).
    pub log_qos_ratio: f64,
    /// Spread of the prediction (standard deviation, same units).
    pub log_qos_sigma: f64,
    /// The shipped model's own prediction, before this host's posterior, where the policy
    /// keeps one (`ml`; absent in older logs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prior: Option<Estimate>,
    /// This host's posterior prediction (the model's corrected by what the host showed),
    /// where the policy keeps one (absent in older logs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub posterior: Option<PosteriorEstimate>,
}

impl Prediction {
    /// A prediction of `log_qos_ratio` with spread `log_qos_sigma`, without a posterior.
    pub fn new(log_qos_ratio: f64, log_qos_sigma: f64) -> Self {
        Self {
            log_qos_ratio,
            log_qos_sigma,
            prior: None,
            posterior: None,
        }
    }
}

/// One prediction of ln(p99 / target): its mean and spread.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Estimate {
    /// Predicted log(p99 / target).
    pub log_qos_ratio: f64,
    /// Spread (standard deviation, same units).
    pub log_qos_sigma: f64,
}

/// A posterior's prediction and the evidence it rests on.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PosteriorEstimate {
    /// Predicted log(p99 / target).
    pub log_qos_ratio: f64,
    /// Spread (standard deviation, same units).
    pub log_qos_sigma: f64,
    /// Readings the posterior has learnt from, each weighted by what forgetting left of it.
    pub samples: f64,
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

/// How one resource of a group's allocation reached the group's processes on a real host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "control", rename_all = "snake_case")]
pub enum Control {
    /// Written where its processes are: their owners' cgroups (or, for a GPU share, the
    /// service's MPS client).
    InPlace,
    /// Its processes were put into one of cohabit's own groups (a cgroup, with
    /// `placement = "move"`, or a resctrl control group), where the values are written.
    Moved,
    /// Some of its processes get the values; the others are left alone, for this reason.
    Partial {
        /// Why the others are left alone.
        why: String,
    },
    /// Nothing written for this resource reaches any of its processes.
    Unmanaged {
        /// Why.
        why: String,
    },
}

impl Control {
    /// Why the resource does not reach the group's processes (`None`: it does, or it
    /// reaches some of them).
    pub fn unmanaged(&self) -> Option<&str> {
        match self {
            Control::Unmanaged { why } => Some(why),
            _ => None,
        }
    }
}

/// Which processes one group's allocation reached at one tick, resource by resource (real
/// hosts; the simulator controls every group by construction).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupControl {
    /// The group's processes found this tick (pids).
    pub pids: BTreeSet<u32>,
    /// Each resource the group is allocated, and how it reached the processes.
    pub resources: BTreeMap<Resource, Control>,
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
    /// What changed between `observation.current` and `plan`, resource by resource; on a
    /// real host a change reached only the processes `control` says it did.
    pub changes: Vec<Change>,
    /// Per group, why the policy decided what it did.
    #[serde(default)]
    pub reasons: BTreeMap<String, Reason>,
    /// Set when the plan differed from the one in force but was not written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub apply: Option<ApplyOutcome>,
    /// Wall-clock time the policy took, in microseconds.
    pub decision_us: f64,
    /// Model predictions per service, where the policy used a model.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub predictions: BTreeMap<String, Prediction>,
    /// Simulator only: the ground truth of the interval the observation describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub truth: Option<GroundTruth>,
    /// The services made from Kubernetes pods' annotations (`[kubernetes]`): their targets
    /// and latencies are the word of whoever created the pod, not the operator's, so fleet
    /// retraining can leave them out ([`Self::from_pod`]). Empty (and absent from the line)
    /// when every service came from the configuration, and in logs older than this field.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub from_pods: BTreeSet<String>,
    /// Real hosts: per group, the processes its allocation reached and how, resource by
    /// resource (a group left unmanaged for a resource says so and why). Empty (and absent
    /// from the line) in simulated runs and in logs older than this field.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub control: BTreeMap<String, GroupControl>,
}

impl DecisionRecord {
    /// Why `resource` of `group` reached none of the group's processes, if the record says
    /// it did not.
    pub fn unmanaged(&self, group: &str, resource: Resource) -> Option<&str> {
        self.control
            .get(group)?
            .resources
            .get(&resource)?
            .unmanaged()
    }

    /// True when `service` was made from a pod's annotations rather than configured.
    pub fn from_pod(&self, service: &str) -> bool {
        self.from_pods.contains(service)
    }

    /// The p99 this record is judged by for `service`: the simulator's ground truth where
    /// the record has it, else the measurement. `None` when neither is known.
    pub fn judged_p99_ms(&self, service: &str) -> Option<f64> {
        self.truth
            .as_ref()
            .and_then(|t| t.p99_ms.get(service).copied())
            .or_else(|| {
                self.observation
                    .services
                    .iter()
                    .find(|s| s.spec.name == service)
                    .and_then(|s| s.sample.p99_ms)
            })
    }

    /// The p99 target of every latency-critical service observed in this record, by name.
    pub fn targets(&self) -> BTreeMap<String, f64> {
        self.observation
            .services
            .iter()
            .filter_map(|s| Some((s.spec.name.clone(), s.spec.p99_target_ms()?)))
            .collect()
    }

    /// Brings a record read from an older log to the current layout: a version-1 record
    /// kept the apply outcome as a reason under the key `apply`.
    pub fn upgrade(&mut self) {
        if self.schema_version < 2 {
            if let Some(r) = self.reasons.remove("apply") {
                let text = format!("{}: {}", r.path, r.text);
                self.apply = Some(match text.find("not applied:") {
                    Some(i) => ApplyOutcome::Refused {
                        error: text[i + "not applied:".len()..].trim().to_string(),
                    },
                    None => ApplyOutcome::DryRun,
                });
            }
        }
    }
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
                    gpu_memory_mib: Default::default(),
                },
            },
            plan: Plan {
                services: Default::default(),
                best_effort: a,
                gpu_memory_mib: Default::default(),
            },
            changes: vec![],
            reasons: Default::default(),
            apply: None,
            decision_us: 1.0,
            predictions: Default::default(),
            truth: None,
            from_pods: Default::default(),
            control: Default::default(),
        };
        let mut v = serde_json::to_value(&rec).unwrap();
        let obj = v.as_object_mut().unwrap();
        assert!(
            !obj.contains_key("truth")
                && !obj.contains_key("predictions")
                && !obj.contains_key("from_pods")
        );
        obj.remove("reasons");
        let back: DecisionRecord = serde_json::from_value(v).unwrap();
        assert_eq!(back, rec);
    }

    #[test]
    fn a_record_says_which_services_came_from_pods_and_older_ones_read_as_none() {
        let mut r = minimal_record();
        assert!(r.from_pods.is_empty() && !r.from_pod("shop.kv"));
        r.from_pods.insert("shop.kv".into());
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["from_pods"], serde_json::json!(["shop.kv"]));
        let back: DecisionRecord = serde_json::from_value(v).unwrap();
        assert!(back.from_pod("shop.kv") && !back.from_pod("memcached"));
    }

    /// A record of version 2 as logs before `from_pods` and `control` were written.
    fn minimal_record() -> DecisionRecord {
        let line = r#"{"schema_version":2,"policy":"parties","simulated":false,
            "observation":{"t_ms":0,"services":[],"current":{"services":{},"best_effort":
            {"cores":1,"llc_ways":{"first":0,"count":1},"mba_pct":100}}},
            "plan":{"services":{},"best_effort":{"cores":1,"llc_ways":{"first":0,"count":1},"mba_pct":100}},
            "changes":[],"decision_us":1.0}"#;
        serde_json::from_str(line).unwrap()
    }

    #[test]
    fn a_record_says_per_group_which_resources_reached_its_processes() {
        let mut r = minimal_record();
        assert!(r.control.is_empty(), "older logs have no control");
        assert_eq!(r.unmanaged("memcached", Resource::Cores), None);
        let why = "it is in the hierarchy's root";
        r.control.insert(
            "memcached".into(),
            GroupControl {
                pids: [42].into(),
                resources: [
                    (Resource::Cores, Control::Unmanaged { why: why.into() }),
                    (Resource::LlcWays, Control::Moved),
                ]
                .into(),
            },
        );
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(
            v["control"]["memcached"]["resources"]["cores"],
            serde_json::json!({"control": "unmanaged", "why": why})
        );
        assert_eq!(
            v["control"]["memcached"]["resources"]["llc_ways"],
            serde_json::json!({"control": "moved"})
        );
        let back: DecisionRecord = serde_json::from_value(v).unwrap();
        assert_eq!(back.unmanaged("memcached", Resource::Cores), Some(why));
        assert_eq!(back.unmanaged("memcached", Resource::LlcWays), None);
        assert_eq!(back, r);
    }
}

#[cfg(test)]
mod reason_tests {
    use super::*;

    #[test]
    fn typed_reasons_round_trip_and_version_1_text_is_classified_by_its_leading_word() {
        let r = Reason::new(DecisionPath::Fallback, "model unsure (sigma 0.40)");
        let json = serde_json::to_string(&r).unwrap();
        assert_eq!(
            json,
            r#"{"path":"fallback","text":"model unsure (sigma 0.40)"}"#
        );
        assert_eq!(serde_json::from_str::<Reason>(&json).unwrap(), r);
        let old: Reason = serde_json::from_str(r#""model: hold (p99/target 0.8)""#).unwrap();
        assert_eq!(
            old,
            Reason::new(DecisionPath::Model, "hold (p99/target 0.8)")
        );
        let old: Reason = serde_json::from_str(r#""initial fair share""#).unwrap();
        assert_eq!(old, Reason::new(DecisionPath::Static, "initial fair share"));
    }

    #[test]
    fn a_prediction_without_prior_or_posterior_parses_and_is_written_without_them() {
        let old = r#"{"log_qos_ratio":-0.2,"log_qos_sigma":0.1}"#;
        let p: Prediction = serde_json::from_str(old).unwrap();
        assert_eq!(p, Prediction::new(-0.2, 0.1));
        assert_eq!(serde_json::to_string(&p).unwrap(), old);
        let with = Prediction {
            prior: Some(Estimate {
                log_qos_ratio: -0.1,
                log_qos_sigma: 0.3,
            }),
            posterior: Some(PosteriorEstimate {
                log_qos_ratio: -0.2,
                log_qos_sigma: 0.1,
                samples: 12.5,
            }),
            ..p
        };
        let json = serde_json::to_string(&with).unwrap();
        assert!(json.contains(r#""prior":{"log_qos_ratio":-0.1"#), "{json}");
        assert_eq!(serde_json::from_str::<Prediction>(&json).unwrap(), with);
    }

    #[test]
    fn a_version_1_apply_reason_becomes_the_apply_outcome() {
        let line = r#"{"schema_version":1,"policy":"parties","simulated":false,
            "observation":{"t_ms":0,"services":[],"current":{"services":{},"best_effort":
            {"cores":1,"llc_ways":{"first":0,"count":1},"mba_pct":100}}},
            "plan":{"services":{},"best_effort":{"cores":1,"llc_ways":{"first":0,"count":1},"mba_pct":100}},
            "changes":[],"reasons":{"apply":"not applied: resctrl: out of CLOSIDs"},"decision_us":1.0}"#;
        let mut r: DecisionRecord = serde_json::from_str(line).unwrap();
        r.upgrade();
        assert!(r.reasons.is_empty());
        assert_eq!(
            r.apply,
            Some(ApplyOutcome::Refused {
                error: "resctrl: out of CLOSIDs".into()
            })
        );
    }
}
