//! Training rows from decision logs (`cohabit simulate` or `cohabit run`): what a host
//! recorded is enough to retrain the model.
//!
//! For two consecutive records t and t+1 of the same run, and each latency-critical
//! service: the features come from record t's observation (telemetry under the allocation
//! then in force, `observation.current`) with record t's plan as the candidate; the target
//! is the p99 measured in record t+1's observation (the simulator's ground truth where the
//! log has one), over the service's target.

use cohabit_core::{DecisionRecord, HostCapacity};
use cohabit_models::{features, target, Neighbours};

use crate::dataset::{Dataset, Row};

/// Rows from one run's records, in order. `host` is the host the log came from.
pub fn rows_from_log(records: &[DecisionRecord], host: &HostCapacity) -> Dataset {
    let mut rows = Vec::new();
    for pair in records.windows(2) {
        let (now, next) = (&pair[0], &pair[1]);
        for s in now
            .observation
            .services
            .iter()
            .filter(|s| s.spec.is_latency_critical())
        {
            let Some(t) = s.spec.p99_target_ms() else {
                continue;
            };
            let (Some(current), Some(candidate)) = (
                now.observation.current.services.get(&s.spec.name),
                now.plan.services.get(&s.spec.name),
            ) else {
                continue;
            };
            let outcome = next
                .truth
                .as_ref()
                .and_then(|tr| tr.p99_ms.get(&s.spec.name).copied())
                .or_else(|| {
                    next.observation
                        .services
                        .iter()
                        .find(|x| x.spec.name == s.spec.name)
                        .and_then(|x| x.sample.p99_ms)
                });
            let Some(y) = outcome.and_then(|p| target(p, t)) else {
                continue;
            };
            let neighbours = Neighbours::observed(&now.observation, &s.spec.name, host);
            let f = features(host, t, &s.sample, current, candidate, &neighbours);
            #[allow(clippy::cast_possible_truncation)]
            rows.push(Row {
                service: s.spec.name.clone(),
                features: f.to_vec(),
                target: y as f32,
            });
        }
    }
    Dataset { rows }
}
