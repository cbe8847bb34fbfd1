//! Run directories, written and read here only: a single run (`decisions.jsonl`,
//! `summary.json`) or a comparison (`summary.json` holding every policy's summary, and one
//! `<scenario>/<policy>/decisions.jsonl` per run). A daemon's log directory reads as a
//! single run.

use std::collections::BTreeMap;
use std::io::Write as _;
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

/// The decision log of a single run.
pub const LOG: &str = "decisions.jsonl";
/// The summary of a run, or the list of summaries of a comparison.
pub const SUMMARY: &str = "summary.json";

/// Streams one run's decision log into `dir/decisions.jsonl` as records are made.
#[derive(Debug)]
pub struct SingleRunWriter {
    dir: PathBuf,
    log: std::io::BufWriter<std::fs::File>,
    records: usize,
}

impl SingleRunWriter {
    /// Creates `dir` (if missing) and an empty decision log in it.
    pub fn create(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("creating output directory {}", dir.display()))?;
        let path = dir.join(LOG);
        let file =
            std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(Self {
            dir: dir.to_path_buf(),
            log: std::io::BufWriter::new(file),
            records: 0,
        })
    }

    /// Appends one record.
    pub fn record(&mut self, rec: &DecisionRecord) -> std::io::Result<()> {
        serde_json::to_writer(&mut self.log, rec)?;
        self.log.write_all(b"\n")?;
        self.records += 1;
        Ok(())
    }

    /// Flushes the log, writes `summary.json` beside it and returns the paths written and
    /// the number of records.
    pub fn finish(mut self, summary: &RunSummary) -> Result<(PathBuf, PathBuf, usize)> {
        let log = self.dir.join(LOG);
        self.log
            .flush()
            .with_context(|| format!("writing {}", log.display()))?;
        let path = self.dir.join(SUMMARY);
        std::fs::write(&path, serde_json::to_string_pretty(summary)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
        Ok((log, path, self.records))
    }
}

/// Writes one comparison's run into `dir/<scenario>/<policy>/decisions.jsonl`.
pub fn write_comparison_run(
    dir: &Path,
    summary: &RunSummary,
    records: &[DecisionRecord],
) -> Result<()> {
    let d = dir.join(&summary.scenario).join(&summary.policy);
    std::fs::create_dir_all(&d).with_context(|| format!("creating {}", d.display()))?;
    let mut text = String::new();
    for rec in records {
        text.push_str(&serde_json::to_string(rec)?);
        text.push('\n');
    }
    std::fs::write(d.join(LOG), text).with_context(|| format!("writing into {}", d.display()))
}

/// Writes a comparison's `summary.json` (every run's summary).
pub fn write_comparison_summary(dir: &Path, summaries: &[RunSummary]) -> Result<()> {
    let path = dir.join(SUMMARY);
    std::fs::write(&path, serde_json::to_string_pretty(summaries)? + "\n")
        .with_context(|| format!("writing {}", path.display()))
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
    let log = dir.join(LOG);
    let summary_path = dir.join(SUMMARY);
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
        let path: PathBuf = dir.join(&s.scenario).join(&s.policy).join(LOG);
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
