//! Training rows from decision logs (`cohabit simulate` or `cohabit run`): what a host
//! recorded is enough to retrain the model.
//!
//! For two consecutive records t and t+1 of the same run, and each latency-critical
//! service: the features come from record t's observation (telemetry under the allocation
//! then in force, `observation.current`) with record t's plan as the candidate; the target
//! is the p99 measured in record t+1's observation (the simulator's ground truth where the
//! log has one), over the service's target.
//!
//! The host's capacity scales the features; a log records it in its header. A version-1
//! log (no header) does not, and needs the host named by the caller (`--platform`).
//! Pairs never span two headers: a new header means the daemon restarted.

use std::io::BufRead;
use std::path::Path;

use anyhow::{bail, Context, Result};
use cohabit_core::{DecisionLogReader, DecisionRecord, HostCapacity};
use cohabit_models::{features, target, Neighbours};

use crate::dataset::{Dataset, Row};

/// Rows from a decision log read from `input`. Each part of the log is featurised with the
/// host its header records; `fallback` is the host of a version-1 log, which records none,
/// and is not used for a log that has a header.
pub fn rows_from_reader(input: impl BufRead, fallback: Option<&HostCapacity>) -> Result<Dataset> {
    let mut out = Dataset::default();
    let mut reader = DecisionLogReader::new(input);
    let segments = reader.segments()?;
    if let Some(line) = reader.cut_last_line() {
        tracing::warn!(
            line,
            "the last line of the decision log was cut off mid-write (a crash?); it was skipped"
        );
    }
    for segment in segments {
        let host = match (&segment.header, fallback) {
            (Some(h), _) => &h.host,
            (None, Some(host)) => host,
            (None, None) if segment.records.is_empty() => continue,
            (None, None) => bail!(
                "from line {}: a version-1 decision log (no header) does not record the host it \
                 came from, and training needs it; name it with --platform <preset>",
                segment.first_line
            ),
        };
        out.rows.extend(rows_from_log(&segment.records, host).rows);
    }
    Ok(out)
}

/// Rows from the decision log at `path` (see [`rows_from_reader`]).
pub fn rows_from_file(path: &Path, fallback: Option<&HostCapacity>) -> Result<Dataset> {
    let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    rows_from_reader(std::io::BufReader::new(file), fallback)
        .with_context(|| format!("reading the decision log {}", path.display()))
}

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
            let outcome = next.judged_p99_ms(&s.spec.name);
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
