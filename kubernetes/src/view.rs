//! The agent's pod store and the view it publishes. Pure: fed watcher events, no I/O.
//!
//! A (re-)list is staged: `Init` opens an empty staging map, `InitApply` fills it, and
//! `InitDone` swaps it in whole, so a re-list after `410 Gone` drops the pods that went away
//! while the watch was broken, and the view never shows a half-listed node.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::Pod;

use crate::annotations::AnnotationError;
use crate::pod::{outcome, pod_key, PodOutcome};
use crate::{ManagedPod, PodKey, PodView};

/// A pod whose cohabit annotations are invalid, to be warned about.
#[derive(Debug, Clone, PartialEq)]
pub struct InvalidPod {
    /// The pod.
    pub key: PodKey,
    /// What is wrong.
    pub error: AnnotationError,
}

/// What applying one watcher event changed, for the caller's side effects.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Applied {
    /// Pods with invalid annotations seen in this event.
    pub invalid: Vec<InvalidPod>,
    /// UIDs whose annotations are valid now: a warning about them can be forgotten.
    pub valid: Vec<String>,
    /// UIDs no longer of interest (deleted, finished, unannotated, or gone in a re-list):
    /// every warning about them can be forgotten.
    pub gone: Vec<String>,
}

/// The managed pods by UID, a staging map during a (re-)list, and the published view.
#[derive(Debug)]
pub struct Store {
    prefix: String,
    live: BTreeMap<String, ManagedPod>,
    staging: Option<BTreeMap<String, ManagedPod>>,
    /// UIDs of present pods with invalid annotations (and of those in the re-list).
    invalid: BTreeSet<String>,
    staging_invalid: BTreeSet<String>,
    view: PodView,
}

impl Store {
    /// An empty store for annotations under `prefix`.
    pub fn new(prefix: &str) -> Store {
        Store {
            prefix: prefix.to_string(),
            live: BTreeMap::new(),
            staging: None,
            invalid: BTreeSet::new(),
            staging_invalid: BTreeSet::new(),
            view: PodView::default(),
        }
    }

    /// The published view.
    pub fn view(&self) -> &PodView {
        &self.view
    }

    /// A (re-)list starts.
    pub fn init(&mut self) {
        self.staging = Some(BTreeMap::new());
        self.staging_invalid.clear();
    }

    /// One pod of a (re-)list.
    pub fn init_apply(&mut self, pod: &Pod) -> Applied {
        let prefix = self.prefix.clone();
        let staging = self.staging.get_or_insert_with(BTreeMap::new);
        upsert(staging, &mut self.staging_invalid, pod, &prefix)
    }

    /// The (re-)list is complete: its pods replace the live ones.
    pub fn init_done(&mut self) -> Applied {
        let staged = self.staging.take().unwrap_or_default();
        let staged_invalid = std::mem::take(&mut self.staging_invalid);
        let gone = self
            .live
            .keys()
            .chain(&self.invalid)
            .filter(|uid| !staged.contains_key(*uid) && !staged_invalid.contains(*uid))
            .cloned()
            .collect();
        self.live = staged;
        self.invalid = staged_invalid;
        self.view.synced = true;
        self.publish();
        Applied {
            gone,
            ..Applied::default()
        }
    }

    /// A pod was added or modified during the watch.
    pub fn apply(&mut self, pod: &Pod) -> Applied {
        let applied = upsert(&mut self.live, &mut self.invalid, pod, &self.prefix);
        self.publish();
        applied
    }

    /// A pod was deleted.
    pub fn delete(&mut self, pod: &Pod) -> Applied {
        let Some(key) = pod_key(pod) else {
            return Applied::default();
        };
        self.live.remove(&key.uid);
        self.invalid.remove(&key.uid);
        self.publish();
        Applied {
            gone: vec![key.uid],
            ..Applied::default()
        }
    }

    /// The last request to the API server succeeded.
    pub fn reachable(&mut self) {
        self.view.api_reachable = true;
        self.view.last_error = None;
    }

    /// The last request to the API server failed; the pods stay as they were.
    pub fn unreachable(&mut self, error: String) {
        self.view.api_reachable = false;
        self.view.last_error = Some(error);
    }

    /// Recomputes `pods` and bumps the generation when it changed.
    fn publish(&mut self) {
        let mut pods: Vec<ManagedPod> = self.live.values().cloned().collect();
        pods.sort_by(|a, b| (&a.key.namespace, &a.key.name).cmp(&(&b.key.namespace, &b.key.name)));
        if pods != self.view.pods {
            self.view.pods = pods;
            self.view.generation += 1;
        }
    }
}

fn upsert(
    map: &mut BTreeMap<String, ManagedPod>,
    invalid: &mut BTreeSet<String>,
    pod: &Pod,
    prefix: &str,
) -> Applied {
    match outcome(pod, prefix) {
        PodOutcome::Managed(m) => {
            let uid = m.key.uid.clone();
            invalid.remove(&uid);
            map.insert(uid.clone(), m);
            Applied {
                valid: vec![uid],
                ..Applied::default()
            }
        }
        PodOutcome::Ignored => {
            let Some(key) = pod_key(pod) else {
                return Applied::default();
            };
            map.remove(&key.uid);
            invalid.remove(&key.uid);
            Applied {
                gone: vec![key.uid],
                ..Applied::default()
            }
        }
        PodOutcome::Invalid { key, error } => {
            map.remove(&key.uid);
            invalid.insert(key.uid.clone());
            Applied {
                invalid: vec![InvalidPod { key, error }],
                ..Applied::default()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn pod(name: &str, uid: &str, phase: &str, class: &str) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "ns", "uid": uid,
                "annotations": {"cohabit.io/class": class, "cohabit.io/p99-target-ms": "3"}},
            "status": {"phase": phase, "qosClass": "BestEffort"}
        }))
        .unwrap()
    }

    fn names(s: &Store) -> Vec<String> {
        s.view().pods.iter().map(|p| p.key.name.clone()).collect()
    }

    #[test]
    fn the_view_is_sorted_and_the_generation_bumps_only_on_change() {
        let mut s = Store::new("cohabit.io");
        s.init();
        s.init_apply(&pod("b", "2", "Running", "best-effort"));
        s.init_apply(&pod("a", "1", "Running", "latency-critical"));
        assert!(
            s.view().pods.is_empty() && !s.view().synced,
            "nothing before InitDone"
        );
        s.init_done();
        assert_eq!(names(&s), ["a", "b"]);
        assert!(s.view().synced);
        let g = s.view().generation;
        s.apply(&pod("a", "1", "Running", "latency-critical"));
        assert_eq!(s.view().generation, g, "same pod again: no change");
        s.apply(&pod("c", "3", "Running", "best-effort"));
        assert_eq!(s.view().generation, g + 1);
    }

    #[test]
    fn a_relist_drops_pods_that_went_away_and_reports_them_gone() {
        let mut s = Store::new("cohabit.io");
        s.init();
        s.init_apply(&pod("a", "1", "Running", "best-effort"));
        s.init_apply(&pod("b", "2", "Running", "best-effort"));
        s.init_apply(&pod("x", "9", "Running", "gold"));
        s.init_apply(&pod("y", "8", "Running", "gold"));
        s.init_done();
        s.init();
        s.init_apply(&pod("b", "2", "Running", "best-effort"));
        s.init_apply(&pod("y", "8", "Running", "gold"));
        assert_eq!(
            names(&s),
            ["a", "b"],
            "the old view holds during the re-list"
        );
        let done = s.init_done();
        assert_eq!(names(&s), ["b"]);
        assert_eq!(
            done.gone,
            ["1", "9"],
            "a valid and an invalid pod went away"
        );
    }

    #[test]
    fn deleted_finished_and_invalid_pods_leave_the_view() {
        let mut s = Store::new("cohabit.io");
        s.init();
        for (n, u) in [("a", "1"), ("b", "2"), ("c", "3")] {
            s.init_apply(&pod(n, u, "Running", "best-effort"));
        }
        s.init_done();
        s.delete(&pod("a", "1", "Running", "best-effort"));
        s.apply(&pod("b", "2", "Succeeded", "best-effort"));
        let applied = s.apply(&pod("c", "3", "Running", "gold"));
        assert!(s.view().pods.is_empty());
        assert_eq!(applied.invalid.len(), 1);
        assert_eq!(applied.invalid[0].key.name, "c");
    }

    #[test]
    fn reachability_keeps_the_pods() {
        let mut s = Store::new("cohabit.io");
        s.init();
        s.init_apply(&pod("a", "1", "Running", "best-effort"));
        s.init_done();
        s.unreachable("connection refused".into());
        assert!(!s.view().api_reachable);
        assert_eq!(s.view().last_error.as_deref(), Some("connection refused"));
        assert_eq!(names(&s), ["a"]);
        s.reachable();
        assert!(s.view().api_reachable && s.view().last_error.is_none());
    }
}
