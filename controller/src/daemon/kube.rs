//! Pods as services (`[kubernetes]`): the daemon's side of the node agent.
//!
//! Problem: on a Kubernetes node the services come and go with the pods the scheduler puts
//! there, classed by their annotations; cohabit must control them in the cgroups the
//! kubelet and the runtime made, never move their processes, leave alone the containers
//! the kubelet's static CPU manager pinned, and keep the host as it is while the API server
//! cannot be reached.
//!
//! Approach: a [`PodSource`] (the node agent, `cohabit_kube::NodeAgent`, in production, a
//! script in tests) gives a view of the node's annotated pods with a generation. Each tick
//! [`Pods::tick`] compares the view's generation and the CPUs the kubelet gave away
//! (`cpu_manager_state`) with what is in force; when either changed it:
//! 1. turns each pod into a service ([`pod_service`], pure): what the pod claims is first
//!    cut to what `[kubernetes]` lets pods claim ([`cohabit_kube::trust`]: latency-critical
//!    only in `latency_critical_namespaces`, else best effort; priority at most
//!    `max_pod_priority`; target at least `min_pod_p99_target_ms`; a Warning Event for each
//!    thing cut); a latency-critical pod gets its target and its `cohabit.io/latency`
//!    source (parsed by the configuration's own latency parser, with the pods' stricter
//!    limits: [`config::pod_latency`]), a best-effort pod joins the pool; its processes are
//!    the ones in its containers' cgroups ([`Matcher::Pod`], paths from
//!    [`cohabit_collectors::kubepods`]); placement is always in place; containers with CPUs
//!    of their own are left out, and a pod with nothing else is skipped;
//!    latency-critical services beyond the CPUs (a plan gives each one core at least) are
//!    managed as best effort, the lowest-ranked first ([`beyond_cores`]: configured
//!    services before pods, then by priority, then by name), each pod with an Event;
//! 2. gives the host the configured services plus the pods' ([`RealHost::reconfigure`]),
//!    and the CPUs left once the exclusive ones are taken out;
//! 3. builds the policy again for the new set, which takes over the old one's state for
//!    the services that did not change ([`Policy::adopt`]), and applies its first plan: the
//!    cgroups of pods that left get their recorded original values back in that apply (the
//!    record of changes and its give-back, `cohabit_host::apply`).
//!
//! Churn: whoever can patch a pod changes the view at will, so neither the policy's
//! learning nor the host's configuration may hang on a quiet view. A service whose spec
//! (target, priority, GPU) is the same before and after a change keeps its online state
//! (`parties`' phase and share, `ml`'s corrections, measured cliffs and hysteresis; `clite`
//! keeps its search only while the latency-critical services are all the same, and starts
//! again otherwise; see each policy's `adopt`); a new or changed one starts afresh. And the
//! services follow the pods at once on a quiet node (up to three changes back to back), then
//! at most once per 10 s while the changes keep coming, with the latest view at the end of
//! each hold-off ([`RebuildLimit`]); a change of the exclusive CPUs is never held.
//!
//! A pod whose annotation cannot be used (a latency source that does not parse, or cannot
//! be bound) gets a Warning Event and a log line and is skipped; the other pods go on.
//! Messages are escaped ([`cohabit_kube::events::escape_control`]): they quote
//! annotations, which must not forge log lines. While
//! the API server is unreachable the agent's last view stays, so nothing changes. Until the
//! first list has completed, no pod is taken (a partial list would drop pods that are
//! there).
//!
//! The node agent is the cargo feature `kubernetes` (its API client is most of a fresh
//! build's time): a build without it refuses a `[kubernetes]` section before touching the
//! host ([`require_agent`]), and `cohabit check` says so.
//!
//! Properties: a pod's services are named `<namespace>.<name>` (shortened with a UID
//! prefix when too long); the services are ordered configured latency-critical, pods'
//! latency-critical (by namespace and name), configured best-effort, pods' best-effort; the
//! same view and checkpoint give the same services.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use anyhow::Context as _;

use cohabit_collectors::cgroup::{Cgroups, CpuList};
use cohabit_collectors::kubepods::{CpuManagerState, Kubepods, Qos, Runtime};
use cohabit_core::{Actuator as _, Plan, BEST_EFFORT_GROUP};
use cohabit_kube::trust::{trust, Adjustment};
use cohabit_kube::{ManagedPod, PodClass, PodKey, PodView, QosClass};
use cohabit_policy::{Explore, HostContext, Policy, PolicyKind, StaticPolicy};

use super::config::{self, DaemonConfig, KubernetesConfig, ManagedService, Matcher, Placement};
use super::supervise::Checked;
use cohabit_host::RealHost;

/// Where the pods come from: the node agent, or a script in tests.
pub trait PodSource: Send {
    /// The latest view (never blocks on the network).
    fn view(&self) -> PodView;
    /// Posts a Warning Event on the pod and logs it (de-duplicated per pod and reason).
    fn warn(&self, pod: &PodKey, reason: &str, message: &str);
}

#[cfg(feature = "kubernetes")]
impl PodSource for cohabit_kube::NodeAgent {
    fn view(&self) -> PodView {
        cohabit_kube::NodeAgent::view(self)
    }

    fn warn(&self, pod: &PodKey, reason: &str, message: &str) {
        cohabit_kube::NodeAgent::warn(self, pod, reason, message);
    }
}

/// This build has the node agent: the cargo feature `kubernetes` (kube, k8s-openapi and
/// rustls), on in the Debian package and the container image, off in a plain `cargo build`.
pub const BUILT_WITH_KUBERNETES: bool = cfg!(feature = "kubernetes");

/// A configuration with `[kubernetes]` given to a build without the node agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "the configuration has a [kubernetes] section, but this cohabit was built without the \
     Kubernetes node agent (cargo feature `kubernetes`): install the Debian package or the \
     container image, or build with `cargo build --release -p cohabit-controller --features \
     kubernetes`"
)]
pub struct AgentNotBuilt;

/// Refuses `cfg` when it has `[kubernetes]` and the build has no node agent (`built_with`:
/// [`BUILT_WITH_KUBERNETES`]), before anything on the host is touched.
pub fn require_agent(cfg: &DaemonConfig, built_with: bool) -> Result<(), AgentNotBuilt> {
    if cfg.kubernetes.is_some() && !built_with {
        return Err(AgentNotBuilt);
    }
    Ok(())
}

/// Starts the node agent `cfg` asks for.
#[cfg(not(feature = "kubernetes"))]
pub fn start_agent(_cfg: &KubernetesConfig) -> anyhow::Result<Box<dyn PodSource>> {
    Err(AgentNotBuilt.into())
}

/// Starts the node agent `cfg` asks for.
#[cfg(feature = "kubernetes")]
pub fn start_agent(cfg: &KubernetesConfig) -> anyhow::Result<Box<dyn PodSource>> {
    let agent = cohabit_kube::NodeAgent::start(cohabit_kube::NodeAgentConfig::new(
        &cfg.node_name,
        cfg.api.clone(),
    ))?;
    Ok(Box::new(agent))
}

/// Starts the node agent and the pods' side of the loop for the host `cfg` describes
/// (which has `[kubernetes]`), just opened as `host`; the policy is built again as `kind`
/// (with `models`, and `cfg.explore` around it) whenever the pods change.
pub fn start(
    cfg: &DaemonConfig,
    host: &RealHost,
    kind: PolicyKind,
    models: super::model::Models,
) -> anyhow::Result<Pods> {
    let kube = cfg
        .kubernetes
        .clone()
        .ok_or_else(|| anyhow::anyhow!("no [kubernetes] section"))?;
    let agent = start_agent(&kube).context("starting the Kubernetes node agent")?;
    tracing::info!(node = %kube.node_name, "watching this node's pods");
    let explore = cfg.explore.clone();
    let factory: PolicyFactory = Box::new(move |ctx: HostContext| {
        let mut policy = models.build(kind, ctx.clone())?;
        if let Some(e) = &explore {
            policy = Box::new(Explore::new(policy, ctx, e.clone()));
        }
        Ok(policy)
    });
    Ok(Pods::new(agent, cfg, kube, host.cpus().to_vec(), factory))
}

/// Builds the policy for a new set of services.
pub type PolicyFactory = Box<dyn Fn(HostContext) -> anyhow::Result<Box<dyn Policy>> + Send>;

/// Why a pod is not managed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Skip {
    /// Its annotations cannot be used: a Warning Event with this reason and message.
    Warn {
        /// The Event's reason (CamelCase).
        reason: &'static str,
        /// What is wrong.
        message: String,
    },
    /// Every container has CPUs of its own (the kubelet's static CPU manager): left alone.
    Exclusive,
}

/// The longest service name (the configuration's limit, one rule in `cohabit_core::name`).
const NAME_MAX: usize = cohabit_core::name::SERVICE_NAME_MAX;

/// The service name of a pod: `<namespace>.<name>`, or, when that is longer than the
/// configuration allows, its first 39 characters, `-` and the UID's first 8.
pub fn service_name(key: &PodKey) -> String {
    let full = format!("{}.{}", key.namespace, key.name);
    if full.len() <= NAME_MAX {
        return full;
    }
    let uid: String = key
        .uid
        .chars()
        .filter(char::is_ascii_hexdigit)
        .take(8)
        .collect();
    let head: String = full.chars().take(NAME_MAX - 1 - uid.len()).collect();
    format!("{}-{uid}", head.trim_end_matches(['.', '-']))
}

fn qos(q: QosClass) -> Qos {
    match q {
        QosClass::Guaranteed => Qos::Guaranteed,
        QosClass::Burstable => Qos::Burstable,
        QosClass::BestEffort => Qos::BestEffort,
    }
}

/// A pod as a service, and what of its claim was not granted.
#[derive(Debug, Clone, PartialEq)]
pub struct PodService {
    /// The service.
    pub service: ManagedService,
    /// What was changed from the pod's annotations (a Warning Event each).
    pub adjusted: Vec<Adjustment>,
}

/// What pod `pod` becomes on a host whose kubepods tree is `tree`, with the kubelet's CPU
/// manager checkpoint `state` (pure: paths are built, not looked up). Its class, priority
/// and target are what `cfg.trust` grants ([`cohabit_kube::trust::trust`]).
pub fn pod_service(
    pod: &ManagedPod,
    tree: &Kubepods,
    state: Option<&CpuManagerState>,
    cfg: &KubernetesConfig,
) -> Result<PodService, Skip> {
    let warn = |reason, message: String| Skip::Warn { reason, message };
    let mut cgroups = Vec::new();
    let mut exclusive = 0;
    for c in &pod.containers {
        if state.is_some_and(|s| s.exclusive(&pod.key.uid, &c.name).is_some()) {
            exclusive += 1;
            continue;
        }
        let runtime: Runtime = c
            .runtime
            .parse()
            .map_err(|e| warn("UnsupportedRuntime", format!("container {}: {e}", c.name)))?;
        let paths = tree
            .container_paths(qos(pod.qos), &pod.key.uid, runtime, &c.id)
            .map_err(|e| warn("BadContainerId", format!("container {}: {e}", c.name)))?;
        cgroups.extend(paths);
    }
    if cgroups.is_empty() && exclusive > 0 {
        return Err(Skip::Exclusive);
    }
    let granted = trust(pod, &cfg.trust);
    let (p99_target_ms, latency) = match &granted.class {
        PodClass::BestEffort => (None, None),
        PodClass::LatencyCritical {
            p99_target_ms,
            latency,
        } => {
            let source = latency
                .as_deref()
                .map(|l| config::pod_latency(l, &pod.key, &pod.ips, cfg))
                .transpose()
                .map_err(|m| warn("BadLatencyAnnotation", format!("cohabit.io/latency: {m}")))?;
            (Some(*p99_target_ms), source)
        }
    };
    Ok(PodService {
        service: ManagedService {
            name: service_name(&pod.key),
            p99_target_ms,
            matcher: Matcher::Pod {
                uid: pod.key.uid.clone(),
                cgroups,
            },
            constraint: config::ProcessConstraint::default(),
            placement: Placement::InPlace,
            allow_unmanaged: false,
            latency,
            gpu: None,
            priority: granted.priority,
        },
        adjusted: granted.adjustments,
    })
}

/// The Event reason of a latency-critical pod managed as best effort for want of cores.
pub const TOO_MANY_LATENCY_CRITICAL: &str = "TooManyLatencyCritical";

/// The latency-critical services that do not fit on `cores` CPUs, by name. A plan gives
/// each latency-critical service at least one core, so at most `cores` of them can be
/// planned for; the rest must wait in the best-effort pool. Ranked: configured services
/// first, then pods; within each, higher priority first, then by name (so the same set
/// always keeps the same ones).
pub fn beyond_cores(
    configured: &[ManagedService],
    pods: &[ManagedService],
    cores: usize,
) -> BTreeSet<String> {
    let lc = |s: &&ManagedService| s.p99_target_ms.is_some();
    let mut ranked: Vec<(bool, i32, &str)> = configured
        .iter()
        .filter(lc)
        .map(|s| (false, s.priority, s.name.as_str()))
        .chain(
            pods.iter()
                .filter(lc)
                .map(|s| (true, s.priority, s.name.as_str())),
        )
        .collect();
    ranked.sort_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)).then(a.2.cmp(b.2)));
    ranked
        .into_iter()
        .skip(cores)
        .map(|(_, _, name)| name.to_string())
        .collect()
}

/// `s` as a best-effort job: no target, no latency source, priority 0.
fn into_best_effort(mut s: ManagedService) -> ManagedService {
    s.p99_target_ms = None;
    s.latency = None;
    s.priority = 0;
    s
}

/// What the pods come to now.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PodStatus {
    /// Pods managed (a service each).
    pub managed: usize,
    /// Pods skipped (bad annotations, exclusive CPUs, a name already in use).
    pub skipped: usize,
    /// The last request to the API server succeeded.
    pub api_reachable: bool,
    /// The first list of pods has completed.
    pub synced: bool,
}

/// How often a failure that repeats every tick is logged.
const LOG_EVERY: Duration = Duration::from_secs(60);

/// The pods' side of the loop: when the pods or the exclusive CPUs change, the host's
/// services and the policy follow (see the module doc).
pub struct Pods {
    source: Box<dyn PodSource>,
    cfg: KubernetesConfig,
    cgroups: Option<Cgroups>,
    tree: Option<Kubepods>,
    /// The configured services (latency-critical first).
    fixed: Vec<ManagedService>,
    /// The CPUs configured (or online), before exclusive ones are taken out.
    base_cpus: Vec<u32>,
    factory: PolicyFactory,
    /// The view generation and exclusive CPUs in force.
    in_force: Option<(u64, CpuList)>,
    /// The last checkpoint read (kept while the file cannot be read).
    state: Option<CpuManagerState>,
    status: PodStatus,
    /// The services in force that were made from pods (the decision log says so).
    from_pods: BTreeSet<String>,
    last_logged: std::collections::HashMap<&'static str, Instant>,
    /// Ticks counted so far (the rebuild limit's clock).
    ticks: u64,
    /// How often the services may follow the pods while they keep changing.
    limit: RebuildLimit,
}

impl std::fmt::Debug for Pods {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pods")
            .field("cfg", &self.cfg)
            .field("in_force", &self.in_force)
            .field("status", &self.status)
            .finish_non_exhaustive()
    }
}

impl Pods {
    /// The pods of `source` on the host `cfg` describes (which has `[kubernetes]`), whose
    /// CPUs before exclusions are `base_cpus`; `factory` builds the policy for each new set.
    pub fn new(
        source: Box<dyn PodSource>,
        cfg: &DaemonConfig,
        kube: KubernetesConfig,
        base_cpus: Vec<u32>,
        factory: PolicyFactory,
    ) -> Self {
        let cgroups = Cgroups::detect(&cfg.paths).unwrap_or_else(|e| {
            tracing::warn!(error = %e, "cgroups unreadable; pods cannot be found");
            None
        });
        Self {
            source,
            cfg: kube,
            cgroups,
            tree: None,
            fixed: cfg.services.clone(),
            base_cpus,
            factory,
            in_force: None,
            state: None,
            status: PodStatus::default(),
            from_pods: BTreeSet::new(),
            last_logged: std::collections::HashMap::new(),
            ticks: 0,
            limit: RebuildLimit::new(REBUILD_BURST, hold_off_ticks(cfg.interval_ms)),
        }
    }

    /// What the pods come to now.
    pub fn status(&self) -> &PodStatus {
        &self.status
    }

    /// The services in force that were made from pods' annotations (their targets and
    /// latencies are the pod creator's word, not the operator's).
    pub fn from_pods(&self) -> &BTreeSet<String> {
        &self.from_pods
    }

    /// Posts a Warning Event on `pod`, its control characters escaped: the message may
    /// quote annotations, and must stay one line in logs and Events.
    fn warn(&self, pod: &PodKey, reason: &str, message: &str) {
        self.source
            .warn(pod, reason, &cohabit_kube::events::escape_control(message));
    }

    /// Logs under `key` at most once a minute.
    fn log_due(&mut self, key: &'static str) -> bool {
        let now = Instant::now();
        match self.last_logged.get(key) {
            Some(t) if now.duration_since(*t) < LOG_EVERY => false,
            _ => {
                self.last_logged.insert(key, now);
                true
            }
        }
    }

    /// The kubepods tree, found once (retried each tick until it is).
    fn tree(&mut self) -> Option<Kubepods> {
        if self.tree.is_none() {
            let cg = self.cgroups.clone()?;
            match Kubepods::new(cg, self.cfg.cgroup_driver, &self.cfg.cgroup_root) {
                Ok(t) => {
                    tracing::info!(driver = %t.driver(), "found the kubelet's pod cgroups");
                    self.tree = Some(t);
                }
                Err(e) => {
                    if self.log_due("tree") {
                        tracing::warn!(error = %e, "pods cannot be placed yet (logged once a minute)");
                    }
                }
            }
        }
        self.tree.clone()
    }

    /// Re-reads `cpu_manager_state`; keeps the last good one when it cannot be read.
    fn read_state(&mut self) {
        match CpuManagerState::read(&self.cfg.kubelet_dir) {
            Ok(s) => self.state = s,
            Err(e) => {
                if self.log_due("state") {
                    tracing::warn!(error = %e, "the kubelet's CPU manager state is unreadable; keeping the last one read (logged once a minute)");
                }
            }
        }
    }

    /// One tick: when the pods or the exclusive CPUs changed, gives `host` the new
    /// services and CPUs, builds `policy` again and applies its first plan (unless
    /// `dry_run`), which also becomes the fail-safe's `fair_share`. Returns true when it did.
    pub fn tick(
        &mut self,
        host: &mut Checked<RealHost>,
        policy: &mut Box<dyn Policy>,
        fair_share: &mut Plan,
        dry_run: bool,
    ) -> bool {
        self.ticks += 1;
        let view = self.source.view();
        self.status.api_reachable = view.api_reachable;
        self.status.synced = view.synced;
        if !view.api_reachable && self.log_due("api") {
            tracing::warn!(error = ?view.last_error, pods = self.status.managed, "the API server is unreachable; keeping the pods known (logged once a minute)");
        }
        if !view.synced {
            return false;
        }
        self.read_state();
        let exclusive = self
            .state
            .as_ref()
            .map(CpuManagerState::exclusive_cpus)
            .unwrap_or_default();
        let now = (view.generation, exclusive.clone());
        if self.in_force.as_ref() == Some(&now) {
            return false;
        }
        let Some(tree) = self.tree() else {
            return false;
        };
        if !self.rebuild_due(&exclusive) {
            return false;
        }
        let cpus: Vec<u32> = self
            .base_cpus
            .iter()
            .copied()
            .filter(|c| !exclusive.0.contains(c))
            .collect();
        let cpus = if cpus.is_empty() {
            tracing::error!(exclusive = %exclusive, "every CPU cohabit manages is exclusive to a container; keeping the CPUs in force");
            host.host().cpus().to_vec()
        } else {
            cpus
        };
        let services = self.services(&view, &tree, cpus.len());
        let failed = host.host_mut().reconfigure(services, cpus);
        for (name, e) in &failed {
            if let Some(pod) = view.pods.iter().find(|p| service_name(&p.key) == *name) {
                self.warn(
                    &pod.key,
                    "LatencySourceFailed",
                    &format!("cohabit.io/latency: {e}"),
                );
                self.from_pods.remove(name);
                self.status.managed = self.status.managed.saturating_sub(1);
                self.status.skipped += 1;
            }
        }
        host.refresh();
        self.rebuild(host, policy, fair_share, dry_run);
        tracing::info!(
            generation = view.generation,
            pods = self.status.managed,
            skipped = self.status.skipped,
            exclusive = %exclusive,
            "services follow the node's pods"
        );
        self.in_force = Some(now);
        true
    }

    /// The configured services and the pods', in the order of the module doc, for a host of
    /// `cores` CPUs; pods that cannot be managed are warned about and left out, and
    /// latency-critical services beyond `cores` ([`beyond_cores`]) join the pool.
    fn services(&mut self, view: &PodView, tree: &Kubepods, cores: usize) -> Vec<ManagedService> {
        let mut names: BTreeSet<String> = self.fixed.iter().map(|s| s.name.clone()).collect();
        names.insert(BEST_EFFORT_GROUP.to_string());
        let mut made: Vec<(&PodKey, ManagedService)> = Vec::new();
        self.status.managed = 0;
        self.status.skipped = 0;
        for pod in &view.pods {
            let service = pod_service(pod, tree, self.state.as_ref(), &self.cfg).and_then(|p| {
                if names.insert(p.service.name.clone()) {
                    Ok(p)
                } else {
                    Err(Skip::Warn {
                        reason: "NameInUse",
                        message: format!(
                            "cohabit already manages a service named {:?}; this pod is skipped",
                            p.service.name
                        ),
                    })
                }
            });
            match service {
                Ok(p) => {
                    for a in &p.adjusted {
                        self.warn(&pod.key, a.reason(), &a.to_string());
                    }
                    made.push((&pod.key, p.service));
                    self.status.managed += 1;
                }
                Err(Skip::Warn { reason, message }) => {
                    self.warn(&pod.key, reason, &message);
                    self.status.skipped += 1;
                }
                Err(Skip::Exclusive) => {
                    tracing::debug!(pod = %service_name(&pod.key), "every container has CPUs of its own; left alone");
                    self.status.skipped += 1;
                }
            }
        }
        self.fit_to_cores(made, cores)
    }

    /// The configured services and the pods' services `made`, in the order of the module
    /// doc, with the latency-critical ones beyond `cores` ([`beyond_cores`]) turned best
    /// effort: a Warning Event on each such pod, an error log for a configured service.
    fn fit_to_cores(
        &mut self,
        made: Vec<(&PodKey, ManagedService)>,
        cores: usize,
    ) -> Vec<ManagedService> {
        let pods: Vec<ManagedService> = made.iter().map(|(_, s)| s.clone()).collect();
        let beyond = beyond_cores(&self.fixed, &pods, cores);
        let n_lc = self
            .fixed
            .iter()
            .chain(&pods)
            .filter(|s| s.p99_target_ms.is_some())
            .count();
        let (mut lc, mut be) = (Vec::new(), Vec::new());
        for (key, s) in made {
            if beyond.contains(&s.name) {
                self.warn(
                    key,
                    TOO_MANY_LATENCY_CRITICAL,
                    &format!(
                        "{n_lc} latency-critical services for {cores} CPUs (each needs one): this pod (priority {}) is managed as best effort until one leaves",
                        s.priority
                    ),
                );
                be.push(into_best_effort(s));
            } else if s.p99_target_ms.is_some() {
                lc.push(s);
            } else {
                be.push(s);
            }
        }
        self.from_pods = lc.iter().chain(&be).map(|s| s.name.clone()).collect();
        let (mut fixed_lc, mut fixed_be) = (Vec::new(), Vec::new());
        for s in self.fixed.iter().cloned() {
            if beyond.contains(&s.name) {
                tracing::error!(service = %s.name, lc = n_lc, cpus = cores, "more configured latency-critical services than CPUs cohabit manages: this one is managed as best effort until CPUs come back");
                fixed_be.push(into_best_effort(s));
            } else if s.p99_target_ms.is_some() {
                fixed_lc.push(s);
            } else {
                fixed_be.push(s);
            }
        }
        fixed_lc.append(&mut lc);
        fixed_lc.append(&mut fixed_be);
        fixed_lc.append(&mut be);
        fixed_lc
    }

    /// Whether the services may follow a change now ([`RebuildLimit`]): a change of the
    /// exclusive CPUs (the kubelet's, and never to be handed out) always may.
    fn rebuild_due(&mut self, exclusive: &CpuList) -> bool {
        let cpus_moved = self.in_force.as_ref().is_none_or(|(_, e)| e != exclusive);
        if self.limit.allow(self.ticks, cpus_moved) {
            return true;
        }
        if self.log_due("held") {
            tracing::info!(
                every_ticks = self.limit.every_ticks,
                "the pods keep changing; the services follow them at most once per hold-off, the latest view at its end (logged once a minute)"
            );
        }
        false
    }

    /// Builds the policy for the host's services now, hands it the one it replaces to take
    /// over the state of the services that did not change ([`Policy::adopt`]), and applies
    /// the first plan: what is in force carried over to the new set of services
    /// ([`cohabit_policy::carry_over`]), or the policy's fair share when nothing is in
    /// force yet.
    fn rebuild(
        &mut self,
        host: &mut Checked<RealHost>,
        policy: &mut Box<dyn Policy>,
        fair_share: &mut Plan,
        dry_run: bool,
    ) {
        let ctx = HostContext {
            host: host.host().capacity().clone(),
            specs: host.host().specs(),
        };
        let mut built = (self.factory)(ctx.clone()).unwrap_or_else(|e| {
            tracing::error!(error = %e, "the policy could not be built for the new services; using static until the next change");
            Box::new(StaticPolicy::new(ctx.clone()))
        });
        // The fail-safe's fair share is the new policy's own start, taken before it adopts.
        let initial = built.initial();
        *fair_share = initial.plan.clone();
        let previous = std::mem::replace(policy, built);
        let adopted = policy.adopt(previous);
        tracing::info!(
            kept = adopted.services.len(),
            services = ctx.latency_critical().count(),
            host = adopted.host,
            "the policy's state carried over for the services that did not change"
        );
        // The services that stay keep what they have; only the new ones start fair.
        let first = match host.host().plan_in_force() {
            Some(in_force) => cohabit_policy::carry_over(&ctx, in_force),
            None => initial.plan,
        };
        if dry_run {
            return;
        }
        if let Err(e) = host.apply(&first, &[]) {
            tracing::warn!(error = %e, "the first plan for the new services was refused; the next tick tries again");
        }
    }
}

/// Rebuilds the services may follow back to back before the hold-off applies.
const REBUILD_BURST: u32 = 3;

/// While the pods keep changing, the services follow them at most once per this long.
const REBUILD_HOLD_OFF_MS: u64 = 10_000;

/// [`REBUILD_HOLD_OFF_MS`] in ticks of `interval_ms` (at least one).
fn hold_off_ticks(interval_ms: u64) -> u64 {
    REBUILD_HOLD_OFF_MS.div_ceil(interval_ms.max(1)).max(1)
}

/// How often the services follow the pods while the pods keep changing: a token bucket of
/// `burst` rebuilds, one more every `every_ticks` ticks.
///
/// Problem: whoever can patch a pod changes the view at will (an annotation every tick, a
/// crash-looping container), and each rebuild reconfigures the host and rebinds latency
/// sources. Rule: on a quiet node a change is followed at once (a new pod is managed at the
/// next tick, and so are the next two changes); while changes keep coming, at most one
/// rebuild per hold-off, and a change held back is followed when the hold-off ends, with
/// the view then (never lost: the generation in force stays behind). A change the limit
/// must not hold (the kubelet's exclusive CPUs) is followed at once, and spends a token if
/// one is left.
#[derive(Debug, Clone, PartialEq, Eq)]
struct RebuildLimit {
    burst: u32,
    every_ticks: u64,
    tokens: u32,
    /// The tick the bucket last gained a token (or was last seen full).
    since: u64,
}

impl RebuildLimit {
    fn new(burst: u32, every_ticks: u64) -> Self {
        Self {
            burst: burst.max(1),
            every_ticks: every_ticks.max(1),
            tokens: burst.max(1),
            since: 0,
        }
    }

    /// Whether a rebuild may happen at tick `now` (counted when it may); `urgent` always
    /// may.
    fn allow(&mut self, now: u64, urgent: bool) -> bool {
        if self.tokens >= self.burst {
            self.since = now;
        } else {
            let gained = now.saturating_sub(self.since) / self.every_ticks;
            if gained > 0 {
                let gained = u32::try_from(gained).unwrap_or(u32::MAX);
                self.tokens = self.tokens.saturating_add(gained).min(self.burst);
                self.since = if self.tokens >= self.burst {
                    now
                } else {
                    self.since + u64::from(gained) * self.every_ticks
                };
            }
        }
        if self.tokens > 0 {
            self.tokens -= 1;
            true
        } else {
            urgent
        }
    }
}

#[cfg(test)]
mod tests;
