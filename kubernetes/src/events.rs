//! Warning Events on pods: the object posted and the de-duplication in front of it.
//!
//! The agent posts core/v1 Events (`POST /api/v1/namespaces/<ns>/events`), the kind
//! `kubectl describe pod` shows, with `involvedObject` the pod, `type: Warning`, and the
//! agent as `source`/`reportingComponent`. The same (pod UID, reason) is posted once; the
//! pair is forgotten when the pod leaves or its problem is fixed, so a later relapse is
//! posted again.

use std::collections::HashSet;
#[cfg(feature = "client")]
use std::time::{SystemTime, UNIX_EPOCH};

#[cfg(feature = "client")]
use k8s_openapi::api::core::v1::{Event, EventSource, ObjectReference};
#[cfg(feature = "client")]
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, Time};
#[cfg(feature = "client")]
use k8s_openapi::jiff::Timestamp;

#[cfg(feature = "client")]
use crate::PodKey;

/// The component name on the agent's Events.
pub const COMPONENT: &str = "cohabit-agent";

/// Longest Event message posted, in bytes (events.k8s.io/v1 caps its `note` at 1 KiB;
/// core/v1 takes more, but the same cap keeps `kubectl describe` readable).
pub const MAX_MESSAGE: usize = 1024;

/// The (pod UID, reason) pairs already posted.
#[derive(Debug, Default)]
pub struct Deduper {
    sent: HashSet<(String, String)>,
}

impl Deduper {
    /// True the first time (uid, reason) is seen since it was last forgotten.
    pub fn first(&mut self, uid: &str, reason: &str) -> bool {
        self.sent.insert((uid.to_string(), reason.to_string()))
    }

    /// Forgets one pair (its post failed, so a later warning may try again).
    pub fn forget(&mut self, uid: &str, reason: &str) {
        self.sent.remove(&(uid.to_string(), reason.to_string()));
    }

    /// Forgets every pair of a pod.
    pub fn forget_pod(&mut self, uid: &str) {
        self.sent.retain(|(u, _)| u != uid);
    }

    /// Pairs remembered.
    pub fn len(&self) -> usize {
        self.sent.len()
    }

    /// Nothing remembered.
    pub fn is_empty(&self) -> bool {
        self.sent.is_empty()
    }
}

/// `text` with its control characters (newlines, carriage returns, escapes, …) written as
/// Rust escapes (`\n`, `\u{1b}`), so that a message built from a pod's annotations stays one
/// line in the log and in `kubectl describe` and cannot forge another line. A backslash is
/// kept as it is; nothing else changes.
pub fn escape_control(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.chars().any(char::is_control) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

/// The Warning Event for `pod`, at `now`, reported by the agent on `node` (the message's
/// control characters escaped, [`escape_control`]).
#[cfg(feature = "client")]
pub fn warning_event(
    pod: &PodKey,
    reason: &str,
    message: &str,
    node: &str,
    now: SystemTime,
) -> Event {
    let nanos = now
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let ts = Timestamp::try_from(now).unwrap_or(Timestamp::UNIX_EPOCH);
    let mut msg = escape_control(message).into_owned();
    if msg.len() > MAX_MESSAGE {
        let mut cut = MAX_MESSAGE;
        while !msg.is_char_boundary(cut) {
            cut -= 1;
        }
        msg.truncate(cut);
    }
    Event {
        metadata: ObjectMeta {
            // As client-go's recorder names them: `<object>.<unique hex>`.
            name: Some(format!("{}.{nanos:x}", pod.name)),
            namespace: Some(pod.namespace.clone()),
            ..Default::default()
        },
        involved_object: ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            name: Some(pod.name.clone()),
            namespace: Some(pod.namespace.clone()),
            uid: Some(pod.uid.clone()),
            ..Default::default()
        },
        reason: Some(reason.to_string()),
        message: Some(msg),
        type_: Some("Warning".into()),
        source: Some(EventSource {
            component: Some(COMPONENT.into()),
            host: Some(node.to_string()),
        }),
        reporting_component: Some(format!("cohabit.io/{COMPONENT}")),
        reporting_instance: Some(node.to_string()),
        first_timestamp: Some(Time(ts)),
        last_timestamp: Some(Time(ts)),
        event_time: Some(MicroTime(ts)),
        action: Some("Classify".into()),
        count: Some(1),
        ..Default::default()
    }
}

#[cfg(all(test, feature = "client"))]
mod tests {
    use std::time::Duration;

    use super::*;

    fn key() -> PodKey {
        PodKey {
            namespace: "shop".into(),
            name: "web-0".into(),
            uid: "u-1".into(),
        }
    }

    #[test]
    fn the_event_names_the_pod_and_is_a_warning() {
        let now = UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let e = warning_event(&key(), "InvalidCohabitAnnotation", "bad", "node-1", now);
        let v = serde_json::to_value(&e).unwrap();
        assert_eq!(v["involvedObject"]["kind"], "Pod");
        assert_eq!(v["involvedObject"]["uid"], "u-1");
        assert_eq!(v["involvedObject"]["namespace"], "shop");
        assert_eq!(v["type"], "Warning");
        assert_eq!(v["reason"], "InvalidCohabitAnnotation");
        assert_eq!(v["source"]["host"], "node-1");
        assert_eq!(v["metadata"]["namespace"], "shop");
        assert!(v["metadata"]["name"]
            .as_str()
            .unwrap()
            .starts_with("web-0."));
        assert_eq!(v["firstTimestamp"], "2023-11-14T22:13:20Z");
    }

    #[test]
    fn control_characters_are_escaped_so_a_message_stays_one_line() {
        let forged = "http://10.0.0.1/\nFORGED LOG LINE\r\u{1b}[31m\t";
        let escaped = escape_control(forged);
        assert!(!escaped.chars().any(char::is_control), "{escaped}");
        assert!(
            escaped.contains("\\nFORGED LOG LINE\\r\\u{1b}[31m\\t"),
            "{escaped}"
        );
        assert!(matches!(
            escape_control("plain é"),
            std::borrow::Cow::Borrowed(_)
        ));
        let e = warning_event(&key(), "R", forged, "n", SystemTime::now());
        assert!(!e.message.unwrap().contains('\n'));
    }

    #[test]
    fn long_messages_are_cut_on_a_char_boundary() {
        let long = "é".repeat(MAX_MESSAGE);
        let e = warning_event(&key(), "R", &long, "n", SystemTime::now());
        let m = e.message.unwrap();
        assert!(m.len() <= MAX_MESSAGE && m.len() >= MAX_MESSAGE - 1);
    }

    #[test]
    fn the_deduper_posts_once_per_pod_and_reason_until_forgotten() {
        let mut d = Deduper::default();
        assert!(d.first("u1", "A"));
        assert!(!d.first("u1", "A"));
        assert!(d.first("u1", "B"));
        assert!(d.first("u2", "A"));
        d.forget_pod("u1");
        assert_eq!(d.len(), 1);
        assert!(d.first("u1", "A"));
        d.forget("u1", "A");
        assert!(d.first("u1", "A"));
    }
}
