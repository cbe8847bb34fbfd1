//! Prometheus metrics of the daemon ([`metrics`]), and the HTTP endpoint that serves them
//! ([`http`]). The metrics know nothing of sockets; the endpoint knows the metrics only as
//! an [`Exporter`] behind a lock, which it renders per request.

mod http;
mod metrics;

pub use self::http::{serve, serve_with, Limits, OPENMETRICS_TEXT, PROMETHEUS_TEXT};
pub use self::metrics::{
    to_prometheus_text, ErrorKind, Exporter, Health, MetricDef, MetricKind, PushRejectReason,
    METRICS, UNHEALTHY_AFTER_TICKS,
};
