//! Prometheus metrics of the daemon, and the HTTP endpoint that serves them.
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
//!
//! **Endpoint.** hyper's HTTP/1 server on the daemon's tokio runtime, with tower's limits.
//! It answers `GET /metrics` and `GET /`, and `GET /healthz` for a liveness probe: 200 while
//! the last successful tick (or, before the first, the start) is at most
//! [`Health::periods`] tick periods old, 503 after that, each with a line saying how old
//! (404 for other paths, 405 for other methods). It is
//! built so that no client can pin the daemon's file descriptors or its thread (security
//! review row 4). [`Limits`] holds the numbers:
//!
//! - at most `max_connections` sockets are open; when full, the oldest connection that has not
//!   yet sent a complete request head is closed to make room, and if every connection is in a
//!   request the new one is closed instead;
//! - a request head must arrive within `header_read_timeout`, and is at most
//!   `max_header_bytes` and `max_headers` (431 beyond);
//! - one request per connection (no keep-alive), and a connection lives at most
//!   `connection_timeout`, whatever it does;
//! - at most `max_in_flight` requests are handled at once, each within `request_timeout`
//!   (408), with a body of at most `max_body_bytes` (413);
//! - a failed `accept` (EMFILE, ENFILE, ENOBUFS) waits `accept_backoff` before the next one,
//!   and is logged at most once a minute.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use cohabit_core::{ApplyOutcome, DecisionPath, DecisionRecord, Resource};
use http_body_util::Full;
use hyper::body::Bytes;
use hyper::header::{HeaderMap, HeaderValue, ACCEPT, ALLOW, CONTENT_TYPE};
use hyper::server::conn::http1;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::TypedMetric;
use prometheus_client::registry::{Metric, Registry};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tower::{ServiceBuilder, ServiceExt as _};
use tower_http::limit::RequestBodyLimitLayer;
use tower_http::timeout::TimeoutLayer;

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

/// The limits of the metrics endpoint (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Sockets open at once.
    pub max_connections: usize,
    /// Requests handled at once.
    pub max_in_flight: usize,
    /// Time for a client to send its request head, from the moment it is accepted.
    pub header_read_timeout: Duration,
    /// Time to answer a request once its head is read.
    pub request_timeout: Duration,
    /// Longest a connection stays open, whatever it does.
    pub connection_timeout: Duration,
    /// Size of a request head (request line and headers).
    pub max_header_bytes: usize,
    /// Number of request headers.
    pub max_headers: usize,
    /// Size of a request body.
    pub max_body_bytes: usize,
    /// Wait after a failed `accept`.
    pub accept_backoff: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: 64,
            max_in_flight: 32,
            header_read_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_secs(2),
            connection_timeout: Duration::from_secs(5),
            max_header_bytes: 8 * 1024,
            max_headers: 64,
            max_body_bytes: 1024,
            accept_backoff: Duration::from_millis(100),
        }
    }
}

/// `Content-Type` of the Prometheus text format.
pub const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";
/// `Content-Type` of the OpenMetrics text format.
pub const OPENMETRICS_TEXT: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

fn wants_openmetrics(headers: &HeaderMap) -> bool {
    headers
        .get_all(ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains("application/openmetrics-text"))
}

fn plain(status: StatusCode, text: &'static str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from_static(text.as_bytes())));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    r
}

/// The answer to `GET /healthz`: 200 while ticks succeed, 503 when the last successful one
/// is older than the health limit.
fn healthz(health: Health, now: Instant) -> Response<Full<Bytes>> {
    let (alive, age) = health.at(now);
    let text = format!(
        "{}: last successful tick {:.1} s ago (limit {:.1} s: {} tick periods of {} ms)\n",
        if alive { "ok" } else { "unhealthy" },
        age.as_secs_f64(),
        health.limit().as_secs_f64(),
        health.periods,
        health.interval.as_millis(),
    );
    let mut r = Response::new(Full::new(Bytes::from(text)));
    if !alive {
        *r.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
    }
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    r
}

/// Answers one request: the exposition for `GET /metrics` and `GET /`, the tick health for
/// `GET /healthz`.
fn respond<B>(exporter: &Mutex<Exporter>, req: &Request<B>) -> Response<Full<Bytes>> {
    if !matches!(req.uri().path(), "/metrics" | "/" | "/healthz") {
        return plain(
            StatusCode::NOT_FOUND,
            "only /metrics and /healthz are served\n",
        );
    }
    if req.method() != Method::GET {
        let mut r = plain(StatusCode::METHOD_NOT_ALLOWED, "only GET is served\n");
        r.headers_mut()
            .insert(ALLOW, HeaderValue::from_static("GET"));
        return r;
    }
    // A tick that panicked while holding the lock left counters that are still true.
    let ex = exporter.lock().unwrap_or_else(PoisonError::into_inner);
    if req.uri().path() == "/healthz" {
        let health = ex.health();
        drop(ex);
        return healthz(health, Instant::now());
    }
    let (content_type, body) = if wants_openmetrics(req.headers()) {
        (OPENMETRICS_TEXT, ex.render_openmetrics())
    } else {
        (PROMETHEUS_TEXT, ex.render())
    };
    drop(ex);
    let mut r = Response::new(Full::new(Bytes::from(body)));
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

/// The open connections of the endpoint, oldest first, for the connection cap.
#[derive(Debug)]
struct Connections {
    max: usize,
    next_id: u64,
    live: Arc<Mutex<BTreeMap<u64, Slot>>>,
}

/// One open connection as [`Connections`] sees it.
#[derive(Debug)]
struct Slot {
    /// Set once the connection's request head has been read.
    started: Arc<AtomicBool>,
    /// Dropped to tell the connection to close.
    _evict: oneshot::Sender<()>,
}

/// What an admitted connection holds: its flag, the eviction notice, and its place.
#[derive(Debug)]
struct Admitted {
    started: Arc<AtomicBool>,
    evicted: oneshot::Receiver<()>,
    release: Release,
}

/// Frees a connection's place when the connection ends.
#[derive(Debug)]
struct Release {
    id: u64,
    live: Arc<Mutex<BTreeMap<u64, Slot>>>,
}

impl Drop for Release {
    fn drop(&mut self) {
        self.live
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.id);
    }
}

impl Connections {
    fn new(max: usize) -> Self {
        Connections {
            max: max.max(1),
            next_id: 0,
            live: Arc::default(),
        }
    }

    /// Makes room for a new connection: when full, the oldest connection that has not sent
    /// its request head yet is told to close. `None` (refuse the new one) when every open
    /// connection is in a request.
    fn admit(&mut self) -> Option<Admitted> {
        let mut live = self.live.lock().unwrap_or_else(PoisonError::into_inner);
        if live.len() >= self.max {
            let idle = live
                .iter()
                .find(|(_, s)| !s.started.load(Ordering::Relaxed))
                .map(|(id, _)| *id)?;
            live.remove(&idle);
        }
        let id = self.next_id;
        self.next_id += 1;
        let started = Arc::new(AtomicBool::new(false));
        let (tx, evicted) = oneshot::channel();
        live.insert(
            id,
            Slot {
                started: Arc::clone(&started),
                _evict: tx,
            },
        );
        Some(Admitted {
            started,
            evicted,
            release: Release {
                id,
                live: Arc::clone(&self.live),
            },
        })
    }

    #[cfg(test)]
    fn open(&self) -> usize {
        self.live
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

/// Accept errors, logged at most once a minute with a count of those not logged.
#[derive(Debug, Default)]
struct AcceptErrors {
    last_logged: Option<Instant>,
    suppressed: u64,
}

impl AcceptErrors {
    const EVERY: Duration = Duration::from_secs(60);

    fn record(&mut self, e: &io::Error, now: Instant) {
        if self
            .last_logged
            .is_some_and(|t| now.duration_since(t) < Self::EVERY)
        {
            self.suppressed += 1;
            return;
        }
        tracing::warn!(error = %e, suppressed = self.suppressed, "metrics endpoint: accept failed; backing off");
        self.last_logged = Some(now);
        self.suppressed = 0;
    }
}

/// Whether an accept error concerns only the connection being accepted (the next accept
/// can follow at once), rather than the process (EMFILE, ENFILE, ENOBUFS, ENOMEM).
fn connection_error(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionRefused
    )
}

/// Calls `accept` until it succeeds, waiting `backoff` after each failure that is not about
/// one connection only, so that a process out of file descriptors does not spin.
async fn accept_with_backoff<T, F, Fut>(
    mut accept: F,
    backoff: Duration,
    errors: &mut AcceptErrors,
) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = io::Result<T>>,
{
    loop {
        match accept().await {
            Ok(t) => return t,
            Err(e) if connection_error(&e) => {}
            Err(e) => {
                errors.record(&e, Instant::now());
                tokio::time::sleep(backoff).await;
            }
        }
    }
}

/// Serves the metrics on `listener` with the default [`Limits`] until the task is dropped.
pub async fn serve(listener: TcpListener, exporter: Arc<Mutex<Exporter>>) {
    serve_with(listener, exporter, Limits::default()).await;
}

/// Serves the metrics on `listener` within `limits` until the task is dropped.
pub async fn serve_with(listener: TcpListener, exporter: Arc<Mutex<Exporter>>, limits: Limits) {
    let service = ServiceBuilder::new()
        .concurrency_limit(limits.max_in_flight.max(1))
        .layer(TimeoutLayer::with_status_code(
            StatusCode::REQUEST_TIMEOUT,
            limits.request_timeout,
        ))
        .layer(RequestBodyLimitLayer::new(limits.max_body_bytes))
        .service_fn(move |req: Request<_>| {
            std::future::ready(Ok::<_, Infallible>(respond(&exporter, &req)))
        });
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .keep_alive(false)
        .max_header_size(limits.max_header_bytes)
        .max_headers(limits.max_headers);
    let mut connections = Connections::new(limits.max_connections);
    let mut errors = AcceptErrors::default();
    loop {
        let (socket, _) =
            accept_with_backoff(|| listener.accept(), limits.accept_backoff, &mut errors).await;
        let Some(admitted) = connections.admit() else {
            drop(socket);
            continue;
        };
        let Admitted {
            started,
            evicted,
            release,
        } = admitted;
        let service = service.clone();
        let conn = http.serve_connection(
            TokioIo::new(socket),
            hyper::service::service_fn(move |req| {
                started.store(true, Ordering::Relaxed);
                service.clone().oneshot(req)
            }),
        );
        let lifetime = limits.connection_timeout;
        tokio::spawn(async move {
            let _release = release;
            tokio::select! {
                r = conn => if let Err(e) = r {
                    tracing::debug!(error = %e, "metrics connection ended with an error");
                },
                _ = evicted => tracing::debug!("metrics connection closed to make room"),
                () = tokio::time::sleep(lifetime) => {
                    tracing::debug!("metrics connection closed at its time limit");
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::net::SocketAddr;

    use cohabit_core::{
        Allocation, Change, Observation, Plan, Prediction, Sample, ServiceClass,
        ServiceObservation, ServiceSpec, WayRange,
    };
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    use super::*;

    fn record() -> DecisionRecord {
        let a = Allocation {
            cores: 2,
            llc_ways: WayRange::new(0, 2),
            mba_pct: 80,
            gpu_mps_pct: Some(40),
        };
        let plan = Plan {
            services: [("kv".to_string(), a)].into(),
            best_effort: a,
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
    fn exercised() -> Exporter {
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
    fn when_full_the_oldest_connection_without_a_request_makes_room() {
        let mut c = Connections::new(3);
        let a = c.admit().unwrap();
        let mut b = c.admit().unwrap();
        let mut d = c.admit().unwrap();
        a.started.store(true, Ordering::Relaxed);
        let e = c.admit().unwrap();
        assert_eq!(c.open(), 3);
        assert!(
            b.evicted.try_recv().is_err(),
            "b, the oldest idle one, was told"
        );
        assert!(matches!(
            d.evicted.try_recv(),
            Err(oneshot::error::TryRecvError::Empty)
        ));
        drop(a);
        assert_eq!(c.open(), 2, "a closed connection frees its place");
        d.started.store(true, Ordering::Relaxed);
        let f = c.admit().unwrap();
        f.started.store(true, Ordering::Relaxed);
        e.started.store(true, Ordering::Relaxed);
        assert!(
            c.admit().is_none(),
            "all in a request: the new one is refused"
        );
        assert_eq!(c.open(), 3);
    }

    #[tokio::test]
    async fn accept_errors_back_off_instead_of_spinning() {
        // Three failures, then a connection: the loop waits out the backoff after each
        // failure. A timer never fires early, so this holds however loaded the machine is;
        // a loop that spun would be done at once.
        let backoff = Duration::from_millis(50);
        let mut calls = 0u32;
        let mut errors = AcceptErrors::default();
        let start = Instant::now();
        let got = accept_with_backoff(
            || {
                calls += 1;
                std::future::ready(if calls <= 3 {
                    Err(io::Error::from_raw_os_error(libc::EMFILE))
                } else {
                    Ok(calls)
                })
            },
            backoff,
            &mut errors,
        )
        .await;
        let took = start.elapsed();
        assert_eq!(got, 4, "it keeps accepting after failures");
        assert!(took >= 3 * backoff, "{took:?} for 3 failures");
        assert!(errors.suppressed >= 1, "logged once, not every time");
        let mut n = 0;
        let got = accept_with_backoff(
            || {
                n += 1;
                std::future::ready(if n < 3 {
                    Err(io::Error::from(io::ErrorKind::ConnectionAborted))
                } else {
                    Ok(n)
                })
            },
            Duration::from_secs(60),
            &mut errors,
        )
        .await;
        assert_eq!(got, 3, "an aborted connection is skipped without waiting");
    }

    async fn start(limits: Limits) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let exporter = Arc::new(Mutex::new(exercised()));
        tokio::spawn(serve_with(listener, exporter, limits));
        addr
    }

    /// Sends `request` and reads until the server closes, within `within`.
    async fn exchange(addr: SocketAddr, request: &[u8], within: Duration) -> io::Result<String> {
        let talk = async {
            let mut s = TcpStream::connect(addr).await?;
            s.write_all(request).await?;
            let mut out = Vec::new();
            s.read_to_end(&mut out).await?;
            Ok(String::from_utf8_lossy(&out).into_owned())
        };
        tokio::time::timeout(within, talk)
            .await
            .unwrap_or_else(|_| panic!("no answer within {within:?}"))
    }

    async fn get(addr: SocketAddr, path: &str, extra: &str) -> String {
        let req = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\n{extra}\r\n");
        exchange(addr, req.as_bytes(), Duration::from_secs(5))
            .await
            .unwrap()
    }

    fn header<'a>(response: &'a str, name: &str) -> Option<&'a str> {
        let head = response.split("\r\n\r\n").next()?;
        head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }

    #[tokio::test]
    async fn get_metrics_serves_every_declared_metric() {
        let addr = start(Limits::default()).await;
        let r = get(addr, "/metrics", "").await;
        assert!(r.starts_with("HTTP/1.1 200"), "{r}");
        assert_eq!(header(&r, "content-type"), Some(PROMETHEUS_TEXT));
        for m in METRICS {
            assert!(
                r.contains(&format!("\n# HELP {} {}\n", m.name, m.help)),
                "{r}"
            );
            assert!(r.contains(&format!("\n# TYPE {} {}\n", m.name, m.kind.as_str())));
        }
        let root = get(addr, "/", "").await;
        assert!(root.starts_with("HTTP/1.1 200"), "{root}");
        let om = get(
            addr,
            "/metrics",
            "Accept: application/openmetrics-text;version=1.0.0;q=0.5,text/plain;q=0.3\r\n",
        )
        .await;
        assert_eq!(header(&om, "content-type"), Some(OPENMETRICS_TEXT));
        assert!(om.ends_with("# EOF\n"), "{om}");
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

    #[tokio::test]
    async fn healthz_answers_200_while_ticks_succeed_and_503_when_they_stop() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut ex = exercised();
        ex.set_health(Duration::from_millis(50), 4);
        let exporter = Arc::new(Mutex::new(ex));
        tokio::spawn(serve_with(
            listener,
            Arc::clone(&exporter),
            Limits::default(),
        ));
        let r = get(addr, "/healthz", "").await;
        assert!(r.starts_with("HTTP/1.1 200"), "{r}");
        assert!(r.contains("ok: last successful tick"), "{r}");
        // No successful tick for longer than 4 periods of 50 ms.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let r = get(addr, "/healthz", "").await;
        assert!(r.starts_with("HTTP/1.1 503"), "{r}");
        assert!(
            r.contains("unhealthy") && r.contains("4 tick periods of 50 ms"),
            "{r}"
        );
        // /metrics stays served meanwhile (the readiness probe).
        assert!(get(addr, "/metrics", "").await.starts_with("HTTP/1.1 200"));
        exporter.lock().unwrap().tick_succeeded(SystemTime::now());
        let r = get(addr, "/healthz", "").await;
        assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    }

    #[tokio::test]
    async fn other_paths_are_404_and_other_methods_405() {
        let addr = start(Limits::default()).await;
        let r = get(addr, "/debug", "").await;
        assert!(r.starts_with("HTTP/1.1 404"), "{r}");
        let r = exchange(
            addr,
            b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi",
            Duration::from_secs(5),
        )
        .await
        .unwrap();
        assert!(r.starts_with("HTTP/1.1 405"), "{r}");
        assert_eq!(header(&r, "allow"), Some("GET"));
    }

    /// A refused request is either answered with a 4xx or closed; it never hangs.
    fn refused(r: &io::Result<String>) -> bool {
        match r {
            Ok(text) => text.is_empty() || text.starts_with("HTTP/1.1 4"),
            Err(_) => true,
        }
    }

    #[tokio::test]
    async fn huge_headers_and_bodies_are_refused_not_waited_for() {
        let addr = start(Limits::default()).await;
        let big = "a".repeat(1 << 20);
        let req = format!("GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: {big}\r\n\r\n");
        let r = exchange(addr, req.as_bytes(), Duration::from_secs(5)).await;
        assert!(refused(&r), "{r:?}");
        let many: String = (0..200).map(|i| format!("X-{i}: 1\r\n")).collect();
        let req = format!("GET /metrics HTTP/1.1\r\nHost: x\r\n{many}\r\n");
        let r = exchange(addr, req.as_bytes(), Duration::from_secs(5)).await;
        assert!(refused(&r), "{r:?}");
        let req = "GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n\r\nxxxx";
        let r = exchange(addr, req.as_bytes(), Duration::from_secs(5)).await;
        assert!(
            r.as_ref().is_ok_and(|t| t.starts_with("HTTP/1.1 413")),
            "{r:?}"
        );
    }

    #[tokio::test]
    async fn a_silent_client_is_disconnected_after_the_header_timeout() {
        let limits = Limits {
            header_read_timeout: Duration::from_millis(300),
            ..Limits::default()
        };
        let addr = start(limits).await;
        let t = Instant::now();
        let r = exchange(addr, b"", Duration::from_secs(5)).await;
        let waited = t.elapsed();
        assert!(refused(&r), "{r:?}");
        assert!(waited >= Duration::from_millis(250), "{waited:?}");
        // A client that starts a request head and never ends it fares the same.
        let r = exchange(addr, b"GET /metrics HTTP/1.1\r\n", Duration::from_secs(5)).await;
        assert!(refused(&r), "{r:?}");
    }

    #[tokio::test]
    async fn idle_connections_do_not_lock_out_a_scrape() {
        // Timeouts far longer than the test: only the connection cap can free places.
        let limits = Limits {
            max_connections: 16,
            header_read_timeout: Duration::from_secs(60),
            connection_timeout: Duration::from_secs(60),
            ..Limits::default()
        };
        let addr = start(limits).await;
        let mut idle = Vec::new();
        for _ in 0..200 {
            idle.push(TcpStream::connect(addr).await.unwrap());
        }
        let t = Instant::now();
        let r = get(addr, "/metrics", "").await;
        assert!(r.starts_with("HTTP/1.1 200"), "{r}");
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        // The server holds at most `max_connections` of them: the rest were closed.
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let mut open = 0;
            for s in &mut idle {
                let mut b = [0u8; 1];
                match tokio::time::timeout(Duration::from_millis(1), s.read(&mut b)).await {
                    Err(_) => open += 1,
                    Ok(Ok(0) | Err(_)) => {}
                    Ok(Ok(_)) => panic!("an idle connection got data"),
                }
            }
            if open <= limits.max_connections {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{open} idle connections still open"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}
