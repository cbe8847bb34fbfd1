//! Reading run directories back: a single run (`decisions.jsonl`, `summary.json`) or a
//! comparison (`summary.json` holding every policy's summary, and one
//! `<scenario>/<policy>/decisions.jsonl` per run).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use cohabit_core::DecisionRecord;

use crate::metrics::RunSummary;

/// One run's decision log and summary.
#[derive(Debug, Clone)]
pub struct Run {
    /// Scenario (or host) name.
    pub scenario: String,
    /// Policy name.
    pub policy: String,
    /// Every decision, in order.
    pub records: Vec<DecisionRecord>,
    /// Its summary, if one was written.
    pub summary: Option<RunSummary>,
}

/// What a run directory holds.
#[derive(Debug, Clone)]
pub enum RunDir {
    /// One policy on one scenario (or a daemon's log).
    Single(Box<Run>),
    /// Several policies side by side.
    Comparison(Vec<Run>),
}

/// Reads a JSON Lines decision log; a bad line is an error naming its number.
pub fn read_log(path: &Path) -> Result<Vec<DecisionRecord>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l).with_context(|| {
                format!("{} line {}: not a decision record", path.display(), i + 1)
            })
        })
        .collect()
}

fn run_from(
    records: Vec<DecisionRecord>,
    summary: Option<RunSummary>,
    fallback_scenario: &str,
) -> Run {
    let policy = summary
        .as_ref()
        .map(|s| s.policy.clone())
        .or_else(|| records.first().map(|r| r.policy.clone()))
        .unwrap_or_default();
    let scenario = summary
        .as_ref()
        .map_or_else(|| fallback_scenario.to_string(), |s| s.scenario.clone());
    Run {
        scenario,
        policy,
        records,
        summary,
    }
}

/// Loads a run or comparison directory.
pub fn load(dir: &Path) -> Result<RunDir> {
    let log = dir.join("decisions.jsonl");
    let summary_path = dir.join("summary.json");
    if log.exists() {
        let summary = match std::fs::read_to_string(&summary_path) {
            Ok(t) => Some(
                serde_json::from_str(&t)
                    .with_context(|| format!("parsing {}", summary_path.display()))?,
            ),
            Err(_) => None,
        };
        let name = dir
            .file_name()
            .map_or_else(|| "run".into(), |n| n.to_string_lossy().into_owned());
        return Ok(RunDir::Single(Box::new(run_from(
            read_log(&log)?,
            summary,
            &name,
        ))));
    }
    let text = std::fs::read_to_string(&summary_path).with_context(|| {
        format!(
            "{} holds neither decisions.jsonl (a run) nor summary.json (a comparison)",
            dir.display()
        )
    })?;
    let summaries: Vec<RunSummary> = serde_json::from_str(&text)
        .with_context(|| format!("parsing {} as a comparison", summary_path.display()))?;
    if summaries.is_empty() {
        bail!("{} lists no runs", summary_path.display());
    }
    let mut runs = Vec::new();
    for s in summaries {
        let path: PathBuf = dir
            .join(&s.scenario)
            .join(&s.policy)
            .join("decisions.jsonl");
        let records = if path.exists() {
            read_log(&path)?
        } else {
            Vec::new()
        };
        let scenario = s.scenario.clone();
        runs.push(run_from(records, Some(s), &scenario));
    }
    Ok(RunDir::Comparison(runs))
}

/// The p99 target of every latency-critical service seen in a log.
pub fn targets(records: &[DecisionRecord]) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for r in records.iter().take(1) {
        for s in &r.observation.services {
            if let Some(t) = s.spec.p99_target_ms() {
                out.insert(s.spec.name.clone(), t);
            }
        }
    }
    out
}

/// The p99 a record is judged by: the simulator's truth where there is one, else the
/// measurement.
pub fn judged_p99_ms(r: &DecisionRecord, service: &str) -> Option<f64> {
    r.truth
        .as_ref()
        .and_then(|t| t.p99_ms.get(service).copied())
        .or_else(|| {
            r.observation
                .services
                .iter()
                .find(|s| s.spec.name == service)
                .and_then(|s| s.sample.p99_ms)
        })
}

/// What kind of decision a reason describes, for actuation markers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum ReasonKind {
    /// A learned model chose it.
    Model,
    /// The model was unsure; a feedback step was taken instead.
    Fallback,
    /// A feedback controller's step.
    Feedback,
    /// The oracle's search.
    Oracle,
    /// Anything else (static share, initial plan, rejected plan).
    Other,
}

impl ReasonKind {
    /// Classifies a reason by its leading word.
    pub fn of(reason: &str) -> Self {
        let r = reason.trim_start().to_ascii_lowercase();
        if r.starts_with("model") {
            ReasonKind::Model
        } else if r.starts_with("fallback") {
            ReasonKind::Fallback
        } else if r.starts_with("feedback") {
            ReasonKind::Feedback
        } else if r.starts_with("oracle") {
            ReasonKind::Oracle
        } else {
            ReasonKind::Other
        }
    }

    /// Legend label.
    pub fn label(self) -> &'static str {
        match self {
            ReasonKind::Model => "model",
            ReasonKind::Fallback => "fallback",
            ReasonKind::Feedback => "feedback step",
            ReasonKind::Oracle => "oracle",
            ReasonKind::Other => "other",
        }
    }
}
