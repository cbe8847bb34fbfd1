//! Prometheus metrics of the daemon, served in the text exposition format.
//!
//! Every metric is declared once in [`METRICS`] with its help text; a test fails if a
//! declared metric is never produced (firecracker's `test_unused_metrics` habit).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};

use cohabit_core::{ApplyOutcome, DecisionPath, DecisionRecord, Resource};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// One declared metric.
#[derive(Debug, Clone, Copy)]
pub struct MetricDef {
    /// Name.
    pub name: &'static str,
    /// `gauge` or `counter`.
    pub kind: &'static str,
    /// Help text.
    pub help: &'static str,
}

/// Every metric the daemon exports.
pub const METRICS: [MetricDef; 9] = [
    MetricDef { name: "cohabit_service_p99_ms", kind: "gauge", help: "Measured p99 latency of a latency-critical service over the last interval, in milliseconds." },
    MetricDef { name: "cohabit_service_target_ms", kind: "gauge", help: "p99 target of a latency-critical service, in milliseconds." },
    MetricDef { name: "cohabit_allocation", kind: "gauge", help: "Allocation in force per group and resource (cores, LLC ways, MBA percent, GPU MPS percent)." },
    MetricDef { name: "cohabit_predicted_p99_ms", kind: "gauge", help: "p99 the model predicted for a service under the chosen plan, in milliseconds." },
    MetricDef { name: "cohabit_fallbacks_total", kind: "counter", help: "Decisions for a service that fell back from the model to feedback steps." },
    MetricDef { name: "cohabit_actuations_total", kind: "counter", help: "Resource changes applied, per group and resource." },
    MetricDef { name: "cohabit_errors_total", kind: "counter", help: "Errors by kind: apply (plan refused), tick (collection failed or overran), log (decision log not written)." },
    MetricDef { name: "cohabit_tick_duration_seconds", kind: "gauge", help: "Wall-clock time of the last tick: collect, decide, apply and log." },
    MetricDef { name: "cohabit_ticks_total", kind: "counter", help: "Control intervals run." },
];

/// Kinds of errors counted in `cohabit_errors_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// A plan the host refused.
    Apply,
    /// A tick whose collection failed or overran.
    Tick,
    /// The decision log could not be written.
    Log,
}

impl ErrorKind {
    fn label(self) -> &'static str {
        match self {
            ErrorKind::Apply => "apply",
            ErrorKind::Tick => "tick",
            ErrorKind::Log => "log",
        }
    }
}

/// The current values, by metric name and label set.
#[derive(Debug, Default)]
pub struct Exporter {
    values: BTreeMap<&'static str, BTreeMap<String, f64>>,
}

fn labels(pairs: &[(&str, &str)]) -> String {
    let inner: Vec<String> = pairs
        .iter()
        .map(|(k, v)| {
            format!(
                "{k}=\"{}\"",
                v.replace('\\', "\\\\")
                    .replace('"', "\\\"")
                    .replace('\n', "\\n")
            )
        })
        .collect();
    format!("{{{}}}", inner.join(","))
}

impl Exporter {
    fn set(&mut self, name: &'static str, l: String, v: f64) {
        self.values.entry(name).or_default().insert(l, v);
    }

    fn add(&mut self, name: &'static str, l: String, v: f64) {
        *self.values.entry(name).or_default().entry(l).or_insert(0.0) += v;
    }

    /// Takes in one tick's record and how long the tick took.
    pub fn observe(&mut self, rec: &DecisionRecord, tick_s: f64) {
        self.add("cohabit_ticks_total", String::new(), 1.0);
        self.set("cohabit_tick_duration_seconds", String::new(), tick_s);
        for s in &rec.observation.services {
            let Some(target) = s.spec.p99_target_ms() else {
                continue;
            };
            let l = labels(&[("service", &s.spec.name)]);
            self.set("cohabit_service_target_ms", l.clone(), target);
            if let Some(p) = s.sample.p99_ms {
                self.set("cohabit_service_p99_ms", l.clone(), p);
            }
            if let Some(pred) = rec.predictions.get(&s.spec.name) {
                self.set(
                    "cohabit_predicted_p99_ms",
                    l.clone(),
                    pred.log_qos_ratio.exp() * target,
                );
            }
            if rec
                .reasons
                .get(&s.spec.name)
                .is_some_and(|r| r.path == DecisionPath::Fallback)
            {
                self.add("cohabit_fallbacks_total", l, 1.0);
            }
        }
        for (group, a) in rec.plan.groups() {
            for r in Resource::ALL {
                if r == Resource::GpuShare && a.gpu_mps_pct.is_none() {
                    continue;
                }
                let l = labels(&[("group", group), ("resource", &r.to_string())]);
                self.set("cohabit_allocation", l, f64::from(a.amount(r)));
            }
        }
        for c in &rec.changes {
            let l = labels(&[("group", &c.group), ("resource", &c.resource.to_string())]);
            self.add("cohabit_actuations_total", l, 1.0);
        }
        if matches!(rec.apply, Some(ApplyOutcome::Refused { .. })) {
            self.error(ErrorKind::Apply);
        }
    }

    /// Counts an error.
    pub fn error(&mut self, kind: ErrorKind) {
        self.add(
            "cohabit_errors_total",
            labels(&[("kind", kind.label())]),
            1.0,
        );
    }

    /// Metrics that have at least one sample.
    pub fn produced(&self) -> BTreeSet<&'static str> {
        self.values
            .iter()
            .filter(|(_, v)| !v.is_empty())
            .map(|(k, _)| *k)
            .collect()
    }

    /// The text exposition format (version 0.0.4).
    pub fn render(&self) -> String {
        let mut out = String::new();
        for m in METRICS {
            let _ = writeln!(
                out,
                "# HELP {} {}\n# TYPE {} {}",
                m.name, m.help, m.name, m.kind
            );
            if let Some(v) = self.values.get(m.name) {
                for (l, x) in v {
                    let _ = writeln!(out, "{}{l} {x}", m.name);
                }
            }
        }
        out
    }
}

/// Serves `GET /metrics` on `listener` until the task is dropped.
pub async fn serve(listener: tokio::net::TcpListener, exporter: Arc<Mutex<Exporter>>) {
    loop {
        let Ok((mut sock, _)) = listener.accept().await else {
            continue;
        };
        let exporter = Arc::clone(&exporter);
        tokio::spawn(async move {
            let mut buf = vec![0u8; 8192];
            let mut n = 0;
            while n < buf.len() {
                match sock.read(&mut buf[n..]).await {
                    Ok(0) | Err(_) => break,
                    Ok(k) => {
                        n += k;
                        if buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
                            break;
                        }
                    }
                }
            }
            let request = String::from_utf8_lossy(&buf[..n]);
            let path = request.split_whitespace().nth(1).unwrap_or("");
            let (status, ctype, body) = if path == "/metrics" || path == "/" {
                let body = exporter.lock().map(|e| e.render()).unwrap_or_default();
                ("200 OK", "text/plain; version=0.0.4; charset=utf-8", body)
            } else {
                (
                    "404 Not Found",
                    "text/plain",
                    "only /metrics is served\n".to_string(),
                )
            };
            let head = format!("HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len());
            let _ = sock.write_all(head.as_bytes()).await;
            let _ = sock.write_all(body.as_bytes()).await;
            let _ = sock.shutdown().await;
        });
    }
}

#[cfg(test)]
mod tests {
    use cohabit_core::{
        Allocation, Change, Observation, Plan, Prediction, Sample, ServiceClass,
        ServiceObservation, ServiceSpec, WayRange,
    };

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
            predictions: [(
                "kv".to_string(),
                Prediction {
                    log_qos_ratio: -0.2,
                    log_qos_sigma: 0.1,
                },
            )]
            .into(),
            truth: None,
        }
    }

    #[test]
    fn every_declared_metric_is_produced_and_described() {
        let mut e = Exporter::default();
        e.observe(&record(), 0.01);
        e.error(ErrorKind::Tick);
        let produced = e.produced();
        for m in METRICS {
            assert!(
                produced.contains(m.name),
                "{} is declared but never produced",
                m.name
            );
            assert!(!m.help.is_empty());
        }
        for name in &produced {
            assert!(
                METRICS.iter().any(|m| m.name == *name),
                "{name} is produced but not declared"
            );
        }
        let text = e.render();
        assert!(
            text.contains("cohabit_service_p99_ms{service=\"kv\"} 0.8"),
            "{text}"
        );
        assert!(text.contains("cohabit_allocation{group=\"best-effort\",resource=\"mba\"} 80"));
        assert!(text.contains("# HELP cohabit_ticks_total"));
    }

    #[test]
    fn counters_accumulate_and_gauges_replace() {
        let mut e = Exporter::default();
        e.observe(&record(), 0.01);
        e.observe(&record(), 0.02);
        let text = e.render();
        assert!(text.contains("cohabit_ticks_total 2"), "{text}");
        assert!(text.contains("cohabit_tick_duration_seconds 0.02"));
        assert!(text.contains("cohabit_fallbacks_total{service=\"kv\"} 2"));
    }
}
