//! cohabit's Kubernetes node agent client: which pods on this node cohabit manages.
//!
//! [`NodeAgent::start`] spawns a thread with its own tokio runtime that lists, then watches,
//! the pods bound to this node (`fieldSelector=spec.nodeName=<node>`) with kube's runtime
//! watcher: the list is served from the API server's watch cache (`resourceVersion=0`, as
//! the kubelet lists), the watch resumes from the last resource version with bookmarks,
//! and a `410 Gone` starts a fresh list. Failures back off exponentially with jitter,
//! honouring a 429's `retryAfterSeconds`; meanwhile the last view stays as it was, with
//! `api_reachable = false` and the error in `last_error`. The daemon reads the view with
//! [`NodeAgent::view`] (a copy, never waits on the network).
//!
//! Pods are classed by their annotations ([`annotations`]); invalid ones are left out and
//! get one Warning Event (de-duplicated per pod and reason) and a log line.
//!
//! Modules: [`annotations`] and [`pod`] are pure (pod object → [`ManagedPod`]); [`trust`]
//! is what of a pod's claim the daemon grants (pure); [`view`]
//! is the store fed by watcher events; [`backoff`] and [`events`] are pure helpers; the
//! I/O lives in `agent` (the watch loop) and `client` (credentials).
//!
//! The API client (kube, k8s-openapi, rustls: most of this crate's build time) is the
//! `client` feature, on by default. Without it the crate keeps only what a daemon built
//! without Kubernetes support still reads: the pod types, [`annotations`], [`trust`],
//! [`backoff`] and [`events::escape_control`]; `NodeAgent`, `pod` and `view` are left out.

#![warn(missing_docs)]

pub mod annotations;
pub mod backoff;
pub mod events;
#[cfg(feature = "client")]
pub mod pod;
pub mod trust;
#[cfg(feature = "client")]
pub mod view;

#[cfg(feature = "client")]
mod agent;
#[cfg(feature = "client")]
mod client;

use std::path::PathBuf;
use std::time::Duration;

#[cfg(feature = "client")]
pub use agent::NodeAgent;

/// How the agent is set up: its node, the API server, the annotation prefix and timings.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeAgentConfig {
    /// The daemon's node (from the config, or the environment variable `NODE_NAME`).
    pub node_name: String,
    /// How to reach the API server.
    pub api: ApiAccess,
    /// Annotation prefix, `cohabit.io` by default.
    pub annotation_prefix: String,
    /// Back-off and time-outs; [`AgentTiming::default`] in production.
    pub timing: AgentTiming,
}

impl NodeAgentConfig {
    /// A config with the default prefix and timings.
    pub fn new(node_name: impl Into<String>, api: ApiAccess) -> NodeAgentConfig {
        NodeAgentConfig {
            node_name: node_name.into(),
            api,
            annotation_prefix: annotations::DEFAULT_PREFIX.to_string(),
            timing: AgentTiming::default(),
        }
    }
}

/// How to reach the API server.
#[derive(Debug, Clone, PartialEq)]
pub enum ApiAccess {
    /// In a pod: the service account's token and CA under
    /// `/var/run/secrets/kubernetes.io/serviceaccount`, and the API server at
    /// `KUBERNETES_SERVICE_HOST:KUBERNETES_SERVICE_PORT`.
    InCluster,
    /// An explicit URL (tests, out-of-cluster use), with an optional bearer-token file
    /// (re-read when it changes, as projected tokens are rotated) and CA bundle (PEM).
    Url {
        /// `https://host:port`, or `http://host:port` (with a token only when
        /// `insecure_http` is set).
        url: String,
        /// A file holding the bearer token.
        token_file: Option<PathBuf>,
        /// A PEM file of the CA certificates to trust.
        ca_file: Option<PathBuf>,
        /// Lets a bearer token go over plain `http://` (a local test server): anyone on
        /// the path can read it and act as the agent.
        insecure_http: bool,
    },
}

/// Back-off and time-outs of the agent's requests.
#[derive(Debug, Clone, PartialEq)]
pub struct AgentTiming {
    /// First delay after a failed request.
    pub backoff_initial: Duration,
    /// Longest delay between tries (a 429's Retry-After may ask for more, up to 5 minutes).
    pub backoff_max: Duration,
    /// `timeoutSeconds` of each watch request; the server ends the watch then and the agent
    /// resumes from the last resource version.
    pub watch_timeout_s: u32,
    /// Time-out to open a connection to the API server.
    pub connect_timeout: Duration,
    /// How much longer than `watch_timeout_s` the API server may stay silent (no response,
    /// no chunk of a list or watch, bookmarks included) before the agent takes it for hung:
    /// it drops the connection, marks the server unreachable, backs off and lists afresh.
    /// A server that works answers sooner: it ends every watch at `watch_timeout_s`.
    pub idle_slack: Duration,
}

impl AgentTiming {
    /// How long the API server may stay silent: `watch_timeout_s` + `idle_slack`.
    pub fn idle_limit(&self) -> Duration {
        Duration::from_secs(u64::from(self.watch_timeout_s)) + self.idle_slack
    }
}

impl Default for AgentTiming {
    fn default() -> Self {
        AgentTiming {
            backoff_initial: Duration::from_millis(500),
            backoff_max: Duration::from_secs(30),
            watch_timeout_s: 290,
            connect_timeout: Duration::from_secs(10),
            idle_slack: Duration::from_secs(5),
        }
    }
}

/// A pod's QoS class (`status.qosClass`), which decides its kubepods cgroup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QosClass {
    /// Requests equal limits for CPU and memory in every container.
    Guaranteed,
    /// Some requests or limits, not Guaranteed.
    Burstable,
    /// No requests or limits.
    BestEffort,
}

/// How cohabit treats a pod, from its `cohabit.io/class` annotation.
#[derive(Debug, Clone, PartialEq)]
pub enum PodClass {
    /// A latency-critical service with its p99 target.
    LatencyCritical {
        /// `cohabit.io/p99-target-ms`.
        p99_target_ms: f64,
        /// The raw `cohabit.io/latency` annotation; the daemon validates it.
        latency: Option<String>,
    },
    /// A best-effort job.
    BestEffort,
}

/// One container of a pod, as the container runtime knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerRef {
    /// The container's name in the pod spec.
    pub name: String,
    /// The runtime scheme of its id: "containerd", "cri-o", "docker" or another.
    pub runtime: String,
    /// The container id without the scheme.
    pub id: String,
}

/// Which pod: namespace, name and UID.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PodKey {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub name: String,
    /// The pod's UID (its kubepods cgroup is named after it).
    pub uid: String,
}

/// A running pod on this node that cohabit manages.
#[derive(Debug, Clone, PartialEq)]
pub struct ManagedPod {
    /// Which pod.
    pub key: PodKey,
    /// Its QoS class.
    pub qos: QosClass,
    /// Latency-critical (with target) or best-effort.
    pub class: PodClass,
    /// `cohabit.io/priority`, when given.
    pub priority: Option<i32>,
    /// Its running containers, sorted by name.
    pub containers: Vec<ContainerRef>,
    /// Its IP addresses (`status.podIPs`, else `status.podIP`): the only addresses a
    /// latency probe or scrape named by its annotations may contact.
    pub ips: Vec<std::net::IpAddr>,
}

/// What the agent knows of the node's pods.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PodView {
    /// Running, annotated, valid pods on this node, sorted by namespace/name.
    pub pods: Vec<ManagedPod>,
    /// Bumps whenever `pods` changes.
    pub generation: u64,
    /// The first list has completed.
    pub synced: bool,
    /// The last request to the API server succeeded (a retried watch counts as succeeded
    /// when no error came back within `connect_timeout` + 1 s: kube reports no event for a
    /// quiet watch). False until the first list.
    pub api_reachable: bool,
    /// The last request's error, while `api_reachable` is false.
    pub last_error: Option<String>,
}

/// Why the agent could not start.
#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    /// The config is unusable (empty node name, bad URL, unreadable token or CA file).
    #[error("kubernetes config: {0}")]
    Config(String),
    /// In-cluster credentials are missing or unreadable.
    #[error("in-cluster credentials: {0}")]
    InCluster(String),
    /// The client or its runtime could not be built.
    #[error("kubernetes client: {0}")]
    Client(String),
}
