//! The daemon's metrics: every one declared once, registered in a `prometheus-client`
//! registry, rendered in both text formats.
//!
//! **Metrics.** Every metric is declared once in [`METRICS`] (name, type, help) and
//! registered from that declaration in a `prometheus-client` [`Registry`] as a typed family
//! whose labels are an `EncodeLabelSet` struct. A test fails if a declared metric is never
//! produced, or if something produced is not declared (firecracker's `test_unused_metrics`
//! habit).
//!
//! **Format.** `prometheus-client` encodes OpenMetrics 1.0, where a counter family is named
//! without its `_total` suffix (`# TYPE cohabit_ticks counter`, sample `cohabit_ticks_total`).
//! A scraper that asks for it (`Accept: application/openmetrics-text`, which Prometheus sends)
//! gets that text unchanged. Anyone else (curl, older scrapers) gets the Prometheus text format
//! 0.0.4, converted by [`to_prometheus_text`]: counter families are named with their `_total`
//! suffix and the `# EOF` line is dropped. The sample lines, and so the series Prometheus
//! stores, are the same in both.

use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant, SystemTime};

use cohabit_core::{ApplyOutcome, DecisionPath, DecisionRecord, Resource};
use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::TypedMetric;
use prometheus_client::registry::{Metric, Registry};

/// The type of a metric, as the exposition's `# TYPE` line says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    /// A value that goes up and down.
    Gauge,
    /// A value that only goes up; its name ends in `_total`.
    Counter,
}

impl MetricKind {
    /// The word in the `# TYPE` line.
    pub fn as_str(self) -> &'static str {
        match self {
            MetricKind::Gauge => "gauge",
            MetricKind::Counter => "counter",
        }
    }
}

/// One declared metric.
#[derive(Debug, Clone, Copy)]
pub struct MetricDef {
    /// Name of its samples, as scraped (counters end in `_total`).
    pub name: &'static str,
    /// Gauge or counter.
    pub kind: MetricKind,
    /// Help text.
    pub help: &'static str,
}

const fn gauge(name: &'static str, help: &'static str) -> MetricDef {
    MetricDef {
        name,
        kind: MetricKind::Gauge,
        help,
    }
}

const fn counter(name: &'static str, help: &'static str) -> MetricDef {
    MetricDef {
        name,
        kind: MetricKind::Counter,
        help,
    }
}

const SERVICE_P99_MS: MetricDef = gauge(
    "cohabit_service_p99_ms",
    "Measured p99 latency of a latency-critical service over the last interval, in milliseconds.",
);
const SERVICE_TARGET_MS: MetricDef = gauge(
    "cohabit_service_target_ms",
    "p99 target of a latency-critical service, in milliseconds.",
);
const ALLOCATION: MetricDef = gauge(
    "cohabit_allocation",
    "Allocation in force per group and resource (cores, LLC ways, MBA percent, GPU MPS percent).",
);
const PREDICTED_P99_MS: MetricDef = gauge(
    "cohabit_predicted_p99_ms",
    "p99 the model predicted for a service under the chosen plan, in milliseconds.",
);
const FALLBACKS: MetricDef = counter(
    "cohabit_fallbacks_total",
    "Decisions for a service that fell back from the model to feedback steps.",
);
const ACTUATIONS: MetricDef = counter(
    "cohabit_actuations_total",
    "Resource changes applied, per group and resource.",
);
const ERRORS: MetricDef = counter(
    "cohabit_errors_total",
    "Errors by kind: apply (plan refused), tick (collection failed or overran), log (decision log not written).",
);
const TICK_DURATION: MetricDef = gauge(
    "cohabit_tick_duration_seconds",
    "Wall-clock time of the last tick: collect, decide, apply and log.",
);
const TICKS: MetricDef = counter("cohabit_ticks_total", "Control intervals run.");
const PUSH_REJECTED: MetricDef = counter(
    "cohabit_push_rejected_total",
    "Latency samples or datagrams refused, per service and reason: credentials (sender not allowed), malformed (not a number), truncated (datagram cut short), over_cap (beyond the per-window cap).",
);
const BANDWIDTH_DROPPED: MetricDef = counter(
    "cohabit_bandwidth_dropped_total",
    "Memory-bandwidth (MBM) readings dropped as implausible, per group.",
);
const LAST_SUCCESSFUL_TICK: MetricDef = gauge(
    "cohabit_last_successful_tick_timestamp_seconds",
    "Unix time of the last tick that collected, decided and applied its plan or kept the last good state; 0 until the first.",
);
const PROBE_CPU_SECONDS: MetricDef = counter(
    "cohabit_probe_cpu_seconds_total",
    "CPU time the built-in latency probes spent, per service, in seconds.",
);
const MODEL_RELOADS: MetricDef = counter(
    "cohabit_model_reloads_total",
    "New versions of the model file loaded and put in use.",
);
const MODEL_RELOAD_FAILURES: MetricDef = counter(
    "cohabit_model_reload_failures_total",
    "New versions of the model file that did not load (the previous model kept running).",
);
const KUBERNETES_PODS: MetricDef = gauge(
    "cohabit_kubernetes_pods",
    "Annotated pods on this node, by state: managed, or skipped (a bad annotation, CPUs of their own from the kubelet, a name in use).",
);
const KUBERNETES_API_REACHABLE: MetricDef = gauge(
    "cohabit_kubernetes_api_reachable",
    "1 when the last request to the Kubernetes API server succeeded, else 0 (the pods known stay controlled meanwhile).",
);
const STATE_QUARANTINED_ENTRIES: MetricDef = gauge(
    "cohabit_state_quarantined_entries",
    "Entries of the state file this start could not restore and moved to quarantine (quarantine.json in the state directory; an unreadable state file, moved aside whole, counts as one); 0 when the start restored everything.",
);

/// Every metric the daemon exports.
pub const METRICS: [MetricDef; 18] = [
    SERVICE_P99_MS,
    SERVICE_TARGET_MS,
    ALLOCATION,
    PREDICTED_P99_MS,
    FALLBACKS,
    ACTUATIONS,
    ERRORS,
    TICK_DURATION,
    TICKS,
    PUSH_REJECTED,
    BANDWIDTH_DROPPED,
    LAST_SUCCESSFUL_TICK,
    PROBE_CPU_SECONDS,
    MODEL_RELOADS,
    MODEL_RELOAD_FAILURES,
    KUBERNETES_PODS,
    KUBERNETES_API_REACHABLE,
    STATE_QUARANTINED_ENTRIES,
];

/// Kinds of errors counted in `cohabit_errors_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// A plan the host refused.
    Apply,
    /// A tick whose collection failed or overran.
    Tick,
    /// The decision log could not be written.
    Log,
}

impl ErrorKind {
    /// Every kind, in label order.
    pub const ALL: [ErrorKind; 3] = [ErrorKind::Apply, ErrorKind::Tick, ErrorKind::Log];

    /// The `kind` label.
    pub fn label(self) -> &'static str {
        match self {
            ErrorKind::Apply => "apply",
            ErrorKind::Tick => "tick",
            ErrorKind::Log => "log",
        }
    }
}

impl EncodeLabelValue for ErrorKind {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> std::fmt::Result {
        std::fmt::Write::write_str(encoder, self.label())
    }
}

/// Why a latency sample or datagram pushed by a service was refused
/// (`cohabit_push_rejected_total{reason}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PushRejectReason {
    /// The sender is not allowed to report for the service.
    Credentials,
    /// A line that is not a latency.
    Malformed,
    /// A datagram cut short by the socket buffer.
    Truncated,
    /// Beyond the per-window cap on samples.
    OverCap,
}

impl PushRejectReason {
    /// Every reason, in label order.
    pub const ALL: [PushRejectReason; 4] = [
        PushRejectReason::Credentials,
        PushRejectReason::Malformed,
        PushRejectReason::Truncated,
        PushRejectReason::OverCap,
    ];

    /// The `reason` label.
    pub fn label(self) -> &'static str {
        match self {
            PushRejectReason::Credentials => "credentials",
            PushRejectReason::Malformed => "malformed",
            PushRejectReason::Truncated => "truncated",
            PushRejectReason::OverCap => "over_cap",
        }
    }
}

impl EncodeLabelValue for PushRejectReason {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> std::fmt::Result {
        std::fmt::Write::write_str(encoder, self.label())
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ServiceLabels {
    service: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GroupLabels {
    group: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PodStateLabels {
    state: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GroupResourceLabels {
    group: String,
    resource: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    kind: ErrorKind,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PushRejectedLabels {
    service: String,
    reason: PushRejectReason,
}

type GaugeF64 = Gauge<f64, AtomicU64>;
type CounterF64 = Counter<f64, AtomicU64>;

fn service(name: &str) -> ServiceLabels {
    ServiceLabels {
        service: name.to_string(),
    }
}

fn group_resource(group: &str, resource: Resource) -> GroupResourceLabels {
    GroupResourceLabels {
        group: group.to_string(),
        resource: resource.to_string(),
    }
}

/// Registers `metric` under its declaration. `prometheus-client` appends `_total` to a
/// counter's samples and a full stop to the help text, so both are taken off here.
fn register<M: Metric + TypedMetric>(registry: &mut Registry, def: &MetricDef, metric: M) {
    let name = match def.kind {
        MetricKind::Counter => def.name.strip_suffix("_total").unwrap_or(def.name),
        MetricKind::Gauge => def.name,
    };
    registry.register(name, def.help.trim_end_matches('.'), metric);
}

/// The daemon's metrics: a registry and a handle on each family in it.
#[derive(Debug)]
pub struct Exporter {
    registry: Registry,
    service_p99_ms: Family<ServiceLabels, GaugeF64>,
    service_target_ms: Family<ServiceLabels, GaugeF64>,
    allocation: Family<GroupResourceLabels, Gauge>,
    predicted_p99_ms: Family<ServiceLabels, GaugeF64>,
    fallbacks: Family<ServiceLabels, Counter>,
    actuations: Family<GroupResourceLabels, Counter>,
    errors: Family<ErrorLabels, Counter>,
    tick_duration_seconds: GaugeF64,
    ticks: Counter,
    push_rejected: Family<PushRejectedLabels, Counter>,
    bandwidth_dropped: Family<GroupLabels, Counter>,
    last_successful_tick: GaugeF64,
    probe_cpu_seconds: Family<ServiceLabels, CounterF64>,
    model_reloads: Counter,
    model_reload_failures: Counter,
    kubernetes_pods: Family<PodStateLabels, Gauge>,
    kubernetes_api_reachable: Gauge,
    state_quarantined_entries: Gauge,
    health: Health,
}

/// How old the last successful tick may be while the daemon counts as alive.
#[derive(Debug, Clone, Copy)]
pub struct Health {
    /// The tick period.
    pub interval: Duration,
    /// Tick periods without a successful tick before `/healthz` answers 503.
    pub periods: u32,
    /// The start, or the last successful tick.
    last: Instant,
}

/// Tick periods without a successful tick before the daemon counts as hung (`/healthz`).
pub const UNHEALTHY_AFTER_TICKS: u32 = 10;

impl Health {
    /// Health counted from now, with a tick every `interval`.
    pub fn new(interval: Duration, periods: u32) -> Self {
        Self {
            interval,
            periods: periods.max(1),
            last: Instant::now(),
        }
    }

    /// How long ticks may fail before `/healthz` says 503.
    pub fn limit(&self) -> Duration {
        self.interval.saturating_mul(self.periods)
    }

    /// Whether the daemon is alive at `now`, and how long ago the last successful tick was.
    pub fn at(&self, now: Instant) -> (bool, Duration) {
        let age = now.saturating_duration_since(self.last);
        (age <= self.limit(), age)
    }
}

impl Default for Exporter {
    fn default() -> Self {
        Self::new()
    }
}

impl Exporter {
    /// Every declared metric, registered; label-less ones start at 0, and so does every
    /// error kind, so that `increase()` sees the first error.
    pub fn new() -> Self {
        let e = Exporter {
            registry: Registry::default(),
            service_p99_ms: Family::default(),
            service_target_ms: Family::default(),
            allocation: Family::default(),
            predicted_p99_ms: Family::default(),
            fallbacks: Family::default(),
            actuations: Family::default(),
            errors: Family::default(),
            tick_duration_seconds: GaugeF64::default(),
            ticks: Counter::default(),
            push_rejected: Family::default(),
            bandwidth_dropped: Family::default(),
            last_successful_tick: GaugeF64::default(),
            probe_cpu_seconds: Family::default(),
            model_reloads: Counter::default(),
            model_reload_failures: Counter::default(),
            kubernetes_pods: Family::default(),
            kubernetes_api_reachable: Gauge::default(),
            state_quarantined_entries: Gauge::default(),
            health: Health::new(Duration::from_secs(1), UNHEALTHY_AFTER_TICKS),
        };
        let mut r = Registry::default();
        register(&mut r, &SERVICE_P99_MS, e.service_p99_ms.clone());
        register(&mut r, &SERVICE_TARGET_MS, e.service_target_ms.clone());
        register(&mut r, &ALLOCATION, e.allocation.clone());
        register(&mut r, &PREDICTED_P99_MS, e.predicted_p99_ms.clone());
        register(&mut r, &FALLBACKS, e.fallbacks.clone());
        register(&mut r, &ACTUATIONS, e.actuations.clone());
        register(&mut r, &ERRORS, e.errors.clone());
        register(&mut r, &TICK_DURATION, e.tick_duration_seconds.clone());
        register(&mut r, &TICKS, e.ticks.clone());
        register(&mut r, &PUSH_REJECTED, e.push_rejected.clone());
        register(&mut r, &BANDWIDTH_DROPPED, e.bandwidth_dropped.clone());
        register(
            &mut r,
            &LAST_SUCCESSFUL_TICK,
            e.last_successful_tick.clone(),
        );
        register(&mut r, &PROBE_CPU_SECONDS, e.probe_cpu_seconds.clone());
        register(&mut r, &MODEL_RELOADS, e.model_reloads.clone());
        register(
            &mut r,
            &MODEL_RELOAD_FAILURES,
            e.model_reload_failures.clone(),
        );
        register(&mut r, &KUBERNETES_PODS, e.kubernetes_pods.clone());
        register(
            &mut r,
            &KUBERNETES_API_REACHABLE,
            e.kubernetes_api_reachable.clone(),
        );
        register(
            &mut r,
            &STATE_QUARANTINED_ENTRIES,
            e.state_quarantined_entries.clone(),
        );
        for kind in ErrorKind::ALL {
            e.errors.get_or_create(&ErrorLabels { kind }).inc_by(0);
        }
        Exporter { registry: r, ..e }
    }

    /// Takes in one tick's record and how long the tick took.
    pub fn observe(&mut self, rec: &DecisionRecord, tick_s: f64) {
        self.ticks.inc();
        self.tick_duration_seconds.set(tick_s);
        for s in &rec.observation.services {
            let Some(target) = s.spec.p99_target_ms() else {
                continue;
            };
            let l = service(&s.spec.name);
            self.service_target_ms.get_or_create(&l).set(target);
            if let Some(p) = s.sample.p99_ms {
                self.service_p99_ms.get_or_create(&l).set(p);
            }
            if let Some(pred) = rec.predictions.get(&s.spec.name) {
                self.predicted_p99_ms
                    .get_or_create(&l)
                    .set(pred.log_qos_ratio.exp() * target);
            }
            if rec
                .reasons
                .get(&s.spec.name)
                .is_some_and(|r| r.path == DecisionPath::Fallback)
            {
                self.fallbacks.get_or_create(&l).inc();
            }
        }
        for (group, a) in rec.plan.groups() {
            for r in Resource::ALL {
                if r == Resource::GpuShare && a.gpu_mps_pct.is_none() {
                    continue;
                }
                self.allocation
                    .get_or_create(&group_resource(group, r))
                    .set(i64::from(a.amount(r)));
            }
        }
        for c in &rec.changes {
            self.actuations
                .get_or_create(&group_resource(&c.group, c.resource))
                .inc();
        }
        if matches!(rec.apply, Some(ApplyOutcome::Refused { .. })) {
            self.error(ErrorKind::Apply);
        }
    }

    /// Sets how many entries of the state file this start moved to quarantine.
    pub fn state_quarantined(&mut self, entries: u64) {
        self.state_quarantined_entries
            .set(i64::try_from(entries).unwrap_or(i64::MAX));
    }

    /// Counts a model reload: `loaded`, or it failed and the previous model stayed.
    pub fn model_reload(&mut self, loaded: bool) {
        if loaded {
            self.model_reloads.inc();
        } else {
            self.model_reload_failures.inc();
        }
    }

    /// The pods of this node (`[kubernetes]`): how many are managed and skipped, and
    /// whether the API server answered last time.
    pub fn kubernetes(&mut self, managed: usize, skipped: usize, api_reachable: bool) {
        for (state, n) in [("managed", managed), ("skipped", skipped)] {
            let l = PodStateLabels {
                state: state.to_string(),
            };
            self.kubernetes_pods
                .get_or_create(&l)
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
        self.kubernetes_api_reachable.set(i64::from(api_reachable));
    }

    /// Counts an error.
    pub fn error(&mut self, kind: ErrorKind) {
        self.errors.get_or_create(&ErrorLabels { kind }).inc();
    }

    /// Counts `count` latency samples or datagrams of `service` refused for `reason`
    /// (`count` 0 makes the series exist at 0).
    pub fn push_rejected(&mut self, service: &str, reason: PushRejectReason, count: u64) {
        let l = PushRejectedLabels {
            service: service.to_string(),
            reason,
        };
        self.push_rejected.get_or_create(&l).inc_by(count);
    }

    /// Counts `count` memory-bandwidth readings of `group` dropped as implausible.
    pub fn bandwidth_dropped(&mut self, group: &str, count: u64) {
        let l = GroupLabels {
            group: group.to_string(),
        };
        self.bandwidth_dropped.get_or_create(&l).inc_by(count);
    }

    /// Records that the tick at `at` collected, decided and applied its plan (or kept the
    /// last good state).
    pub fn tick_succeeded(&mut self, at: SystemTime) {
        self.health.last = Instant::now();
        let unix_s = at
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        self.last_successful_tick.set(unix_s);
    }

    /// Adds `seconds` of CPU time spent by `service`'s latency probe since the last call.
    /// A negative or non-finite amount (a clock or counter that went backwards) is ignored:
    /// a counter never goes down.
    pub fn probe_cpu(&mut self, service_name: &str, seconds: f64) {
        if seconds.is_finite() && seconds >= 0.0 {
            self.probe_cpu_seconds
                .get_or_create(&service(service_name))
                .inc_by(seconds);
        }
    }

    /// Counts health from now on with a tick every `interval`: `/healthz` answers 503 once
    /// no tick has succeeded for `periods` of them.
    pub fn set_health(&mut self, interval: Duration, periods: u32) {
        self.health = Health::new(interval, periods);
    }

    /// The liveness state `/healthz` reports.
    pub fn health(&self) -> Health {
        self.health
    }

    /// The OpenMetrics 1.0 text exposition, ending in `# EOF`.
    pub fn render_openmetrics(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail, and no label value of ours refuses to encode.
        let encoded = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        debug_assert!(encoded.is_ok());
        out
    }

    /// The Prometheus text exposition format, version 0.0.4.
    pub fn render(&self) -> String {
        to_prometheus_text(&self.render_openmetrics())
    }
}

/// Converts an OpenMetrics text exposition of gauges and counters to the Prometheus text
/// format 0.0.4: a counter family's `# HELP` and `# TYPE` lines take the `_total` name of
/// its samples, and the `# EOF` line goes. Sample lines are the same in both formats.
pub fn to_prometheus_text(openmetrics: &str) -> String {
    let counters: Vec<&str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(openmetrics.len() + 16 * counters.len());
    for line in openmetrics.lines() {
        if line == "# EOF" {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "]
            .into_iter()
            .find_map(|p| Some((p, line.strip_prefix(p)?)));
        match meta {
            Some((prefix, rest)) => {
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                out.push_str(prefix);
                out.push_str(name);
                if counters.contains(&name) {
                    out.push_str("_total");
                }
                out.push(' ');
                out.push_str(tail);
            }
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
pub(super) mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use cohabit_core::{
        Allocation, Change, Observation, Plan, Prediction, Sample, ServiceClass,
        ServiceObservation, ServiceSpec, WayRange,
    };

    use super::*;

    pub(crate) fn record() -> DecisionRecord {
        let a = Allocation {
            cores: 2,
            llc_ways: WayRange::new(0, 2),
            mba_pct: 80,
            gpu_mps_pct: Some(40),
        };
        let plan = Plan {
            services: [("kv".to_string(), a)].into(),
            best_effort: a,
            gpu_memory_mib: Default::default(),
        };
        DecisionRecord {
            schema_version: 1,
            policy: "ml".into(),
            simulated: false,
            observation: Observation {
                t_ms: 1000,
                services: vec![ServiceObservation {
                    spec: ServiceSpec {
                        name: "kv".into(),
                        class: ServiceClass::LatencyCritical { p99_target_ms: 1.0 },
                        gpu: Some(0),
                        priority: 0,
                    },
                    sample: Sample {
                        p99_ms: Some(0.8),
                        ..Sample::default()
                    },
                    gpu_mps_effective_pct: Some(40),
                }],
                current: plan.clone(),
            },
            plan,
            changes: vec![Change {
                group: "kv".into(),
                resource: Resource::Cores,
                from: "1".into(),
                to: "2".into(),
            }],
            reasons: [(
                "kv".to_string(),
                cohabit_core::Reason::new(DecisionPath::Fallback, "model unsure"),
            )]
            .into(),
            apply: None,
            decision_us: 10.0,
            predictions: [("kv".to_string(), Prediction::new(-0.2, 0.1))].into(),
            truth: None,
            from_pods: Default::default(),
            control: Default::default(),
        }
    }

    /// An exporter after every recording method has been called once.
    pub(crate) fn exercised() -> Exporter {
        let mut e = Exporter::new();
        e.observe(&record(), 0.01);
        e.error(ErrorKind::Tick);
        e.push_rejected("kv", PushRejectReason::Credentials, 1);
        e.bandwidth_dropped("kv", 2);
        e.tick_succeeded(SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000));
        e.probe_cpu("kv", 0.25);
        e.model_reload(true);
        e.model_reload(false);
        e.kubernetes(2, 1, true);
        e.state_quarantined(1);
        e
    }

    /// What a 0.0.4 exposition says: `# HELP` names, `# TYPE` by name, and the names of
    /// samples with a value other than 0.
    #[derive(Debug, Default)]
    struct Exposition {
        help: BTreeSet<String>,
        types: BTreeMap<String, String>,
        nonzero: BTreeSet<String>,
    }

    fn parse(text: &str) -> Exposition {
        let mut x = Exposition::default();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# HELP ") {
                let (name, help) = rest.split_once(' ').unwrap();
                assert!(!help.trim().is_empty(), "{name} has no help");
                assert!(x.help.insert(name.to_string()), "{name} described twice");
            } else if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').unwrap();
                x.types.insert(name.to_string(), kind.to_string());
            } else if !line.starts_with('#') && !line.is_empty() {
                let name_end = line.find(['{', ' ']).unwrap();
                let value: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
                if value != 0.0 {
                    x.nonzero.insert(line[..name_end].to_string());
                }
            }
        }
        x
    }

    #[test]
    fn every_declared_metric_is_produced_and_described() {
        let declared: BTreeSet<String> = METRICS.iter().map(|m| m.name.to_string()).collect();
        assert_eq!(declared.len(), METRICS.len(), "a metric is declared twice");
        let x = parse(&exercised().render());
        assert_eq!(x.help, declared, "described = declared");
        for m in METRICS {
            assert_eq!(
                x.types.get(m.name).map(String::as_str),
                Some(m.kind.as_str())
            );
            assert!(
                x.nonzero.contains(m.name),
                "{} is declared but never produced",
                m.name
            );
            assert!(
                m.help.ends_with('.') && !m.help.ends_with(".."),
                "{}",
                m.name
            );
            assert_eq!(
                m.kind == MetricKind::Counter,
                m.name.ends_with("_total"),
                "{}: counters, and only counters, end in _total",
                m.name
            );
        }
        for name in &x.nonzero {
            assert!(
                declared.contains(name),
                "{name} is produced but not declared"
            );
        }
    }

    #[test]
    fn samples_carry_their_labels_and_values() {
        let text = exercised().render();
        for line in [
            "# HELP cohabit_ticks_total Control intervals run.\n",
            "# TYPE cohabit_ticks_total counter\n",
            "cohabit_service_p99_ms{service=\"kv\"} 0.8\n",
            "cohabit_service_target_ms{service=\"kv\"} 1.0\n",
            "cohabit_allocation{group=\"best-effort\",resource=\"mba\"} 80\n",
            "cohabit_allocation{group=\"kv\",resource=\"cores\"} 2\n",
            "cohabit_actuations_total{group=\"kv\",resource=\"cores\"} 1\n",
            "cohabit_errors_total{kind=\"tick\"} 1\n",
            "cohabit_errors_total{kind=\"apply\"} 0\n",
            "cohabit_push_rejected_total{service=\"kv\",reason=\"credentials\"} 1\n",
            "cohabit_bandwidth_dropped_total{group=\"kv\"} 2\n",
            "cohabit_last_successful_tick_timestamp_seconds 1700000000.0\n",
            "cohabit_probe_cpu_seconds_total{service=\"kv\"} 0.25\n",
        ] {
            assert!(text.contains(line), "{line:?} missing from:\n{text}");
        }
        assert!(!text.contains("# EOF"));
        assert!(!text.contains("_total_total"));
    }

    #[test]
    fn counters_accumulate_and_gauges_replace() {
        let mut e = Exporter::new();
        e.observe(&record(), 0.01);
        e.observe(&record(), 0.02);
        e.probe_cpu("kv", 0.5);
        e.probe_cpu("kv", -3.0);
        e.probe_cpu("kv", f64::NAN);
        e.push_rejected("kv", PushRejectReason::OverCap, 3);
        e.push_rejected("kv", PushRejectReason::OverCap, 4);
        let text = e.render();
        assert!(text.contains("cohabit_ticks_total 2\n"), "{text}");
        assert!(text.contains("cohabit_tick_duration_seconds 0.02\n"));
        assert!(text.contains("cohabit_fallbacks_total{service=\"kv\"} 2\n"));
        assert!(text.contains("cohabit_probe_cpu_seconds_total{service=\"kv\"} 0.5\n"));
        assert!(text.contains("reason=\"over_cap\"} 7\n"));
    }

    #[test]
    fn label_values_are_escaped() {
        let mut e = Exporter::new();
        e.bandwidth_dropped("a\"b\\c\nd", 1);
        let text = e.render();
        assert!(
            text.contains(r#"cohabit_bandwidth_dropped_total{group="a\"b\\c\nd"} 1"#),
            "{text}"
        );
    }

    #[test]
    fn openmetrics_names_counter_families_without_total_and_ends_with_eof() {
        let om = exercised().render_openmetrics();
        assert!(om.contains("# TYPE cohabit_ticks counter\n"), "{om}");
        assert!(om.contains("\ncohabit_ticks_total 1\n"));
        assert!(om.ends_with("# EOF\n"));
        let prom = to_prometheus_text(&om);
        let samples = |t: &str| -> Vec<String> {
            t.lines()
                .filter(|l| !l.starts_with('#'))
                .map(str::to_string)
                .collect()
        };
        assert_eq!(samples(&om), samples(&prom), "same samples in both formats");
        assert!(prom.contains("# TYPE cohabit_service_p99_ms gauge\n"));
    }

    #[test]
    fn health_is_the_age_of_the_last_successful_tick_in_tick_periods() {
        let mut ex = Exporter::new();
        ex.set_health(Duration::from_millis(100), 3);
        let h = ex.health();
        assert_eq!(h.limit(), Duration::from_millis(300));
        let t = h.last;
        assert!(h.at(t + Duration::from_millis(300)).0);
        let (alive, age) = h.at(t + Duration::from_millis(301));
        assert!(!alive);
        assert_eq!(age, Duration::from_millis(301));
        ex.tick_succeeded(SystemTime::now());
        assert!(
            ex.health().last >= t,
            "a successful tick starts the count again"
        );
    }
}
