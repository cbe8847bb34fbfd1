//! Run directories, written and read here only: a single run (`decisions.jsonl`,
//! `summary.json`) or a comparison (`summary.json` holding every policy's summary, and one
//! `<scenario>/<policy>/decisions.jsonl` per run). A daemon's log directory reads as a
//! single run.
//!
//! Directories and files are written through [`crate::outdir`]: no symbolic link another
//! user owns is followed anywhere in the path, so a link planted under `/tmp` cannot
//! redirect a run's files.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use cohabit_core::{DecisionLogReader, DecisionLogWriter, DecisionRecord, LogHeader};

use crate::metrics::RunSummary;
use crate::outdir::OutDir;

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

impl Run {
    /// The p99 target of every latency-critical service, as the first record saw them.
    pub fn targets(&self) -> BTreeMap<String, f64> {
        self.records
            .first()
            .map(DecisionRecord::targets)
            .unwrap_or_default()
    }
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
    dir: OutDir,
    log: DecisionLogWriter<std::io::BufWriter<std::fs::File>>,
}

impl SingleRunWriter {
    /// Creates `dir` (if missing, through no other user's symbolic link) and a decision log in it that
    /// starts with `header`.
    pub fn create(dir: &Path, header: &LogHeader) -> Result<Self> {
        let dir = OutDir::create(dir)
            .with_context(|| format!("creating output directory {}", dir.display()))?;
        let file = dir.create_file(LOG)?;
        let path = dir.path().join(LOG);
        let log = DecisionLogWriter::new(std::io::BufWriter::new(file), header)
            .with_context(|| format!("writing {}", path.display()))?;
        Ok(Self { dir, log })
    }

    /// Appends one record.
    pub fn record(&mut self, rec: &DecisionRecord) -> std::io::Result<()> {
        self.log.write(rec)
    }

    /// Flushes the log, writes `summary.json` beside it and returns the paths written and
    /// the number of records.
    pub fn finish(mut self, summary: &RunSummary) -> Result<(PathBuf, PathBuf, usize)> {
        let log = self.dir.path().join(LOG);
        self.log
            .flush()
            .with_context(|| format!("writing {}", log.display()))?;
        let text = serde_json::to_string_pretty(summary)? + "\n";
        let path = self.dir.write(SUMMARY, text.as_bytes())?;
        Ok((log, path, self.log.records()))
    }
}

/// Writes one comparison's run into `dir/<scenario>/<policy>/decisions.jsonl`, headed by
/// `header`; the directories are made through no other user's symbolic link.
pub fn write_comparison_run(
    dir: &Path,
    summary: &RunSummary,
    header: &LogHeader,
    records: &[DecisionRecord],
) -> Result<()> {
    let d = dir.join(&summary.scenario).join(&summary.policy);
    let d = OutDir::create(&d).with_context(|| format!("creating {}", d.display()))?;
    let file = d.create_file(LOG)?;
    let path = d.path().join(LOG);
    let write = || -> std::io::Result<()> {
        let mut log = DecisionLogWriter::new(std::io::BufWriter::new(file), header)?;
        for rec in records {
            log.write(rec)?;
        }
        log.flush()
    };
    write().with_context(|| format!("writing {}", path.display()))
}

/// Writes a comparison's `summary.json` (every run's summary).
pub fn write_comparison_summary(dir: &Path, summaries: &[RunSummary]) -> Result<()> {
    let text = serde_json::to_string_pretty(summaries)? + "\n";
    let d = OutDir::create(dir).with_context(|| format!("creating {}", dir.display()))?;
    d.write(SUMMARY, text.as_bytes())?;
    Ok(())
}

/// Reads a decision log (any version [`cohabit_core::log`] reads); a bad line is an error
/// naming the file and its line number.
pub fn read_log(path: &Path) -> Result<Vec<DecisionRecord>> {
    let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut reader = DecisionLogReader::new(std::io::BufReader::new(file));
    let records = reader
        .by_ref()
        .collect::<Result<_, _>>()
        .with_context(|| format!("reading the decision log {}", path.display()))?;
    if let Some(line) = reader.cut_last_line() {
        tracing::warn!(
            log = %path.display(),
            line,
            "the last line of the decision log was cut off mid-write (a crash?); it was skipped"
        );
    }
    Ok(records)
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use cohabit_sim::Scenario;

    use super::*;
    use crate::simulate::{run_policy, LabPolicy};

    fn demo() -> (Arc<Scenario>, crate::simulate::SimRun) {
        let sc = Arc::new(Scenario::load("demo").unwrap());
        let run = run_policy(&sc, LabPolicy::Static, None, None, |_| Ok(())).unwrap();
        (sc, run)
    }

    #[test]
    fn a_single_run_and_a_comparison_read_back_what_was_written() {
        let (sc, run) = demo();
        let header = LogHeader::new("static", true, sc.capacity().clone());
        let dir = tempfile::tempdir().unwrap();

        let single = dir.path().join("single");
        let mut w = SingleRunWriter::create(&single, &header).unwrap();
        for r in &run.records {
            w.record(r).unwrap();
        }
        let (log, _, n) = w.finish(&run.summary).unwrap();
        assert_eq!(n, run.records.len());
        let text = std::fs::read_to_string(&log).unwrap();
        assert!(
            text.starts_with("{\"cohabit_decision_log\":"),
            "header first"
        );
        let RunDir::Single(back) = load(&single).unwrap() else {
            panic!("a single run")
        };
        assert_eq!(back.records, run.records);
        assert_eq!(back.policy, "static");
        assert!(!back.targets().is_empty());

        let cmp = dir.path().join("cmp");
        write_comparison_run(&cmp, &run.summary, &header, &run.records).unwrap();
        write_comparison_summary(&cmp, std::slice::from_ref(&run.summary)).unwrap();
        let RunDir::Comparison(runs) = load(&cmp).unwrap() else {
            panic!("a comparison")
        };
        assert_eq!(runs.len(), 1);
        assert_eq!(runs[0].records, run.records);
    }

    #[test]
    fn a_nested_run_directory_is_created_as_before() {
        let (sc, run) = demo();
        let header = LogHeader::new("static", true, sc.capacity().clone());
        let dir = tempfile::tempdir().unwrap();
        let nested = dir.path().join("a").join("b").join("run");
        let mut w = SingleRunWriter::create(&nested, &header).unwrap();
        for r in &run.records {
            w.record(r).unwrap();
        }
        let (log, summary, _) = w.finish(&run.summary).unwrap();
        assert_eq!((log, summary), (nested.join(LOG), nested.join(SUMMARY)));
        let RunDir::Single(back) = load(&nested).unwrap() else {
            panic!("a single run")
        };
        assert_eq!(back.records, run.records);
        let cmp = dir.path().join("x").join("cmp");
        write_comparison_run(&cmp, &run.summary, &header, &run.records).unwrap();
        write_comparison_summary(&cmp, std::slice::from_ref(&run.summary)).unwrap();
        assert!(matches!(load(&cmp).unwrap(), RunDir::Comparison(r) if r.len() == 1));
    }

    /// Every run-directory writer, on `dir`.
    fn write_everything(dir: &Path) -> Vec<anyhow::Error> {
        let (sc, run) = demo();
        let header = LogHeader::new("static", true, sc.capacity().clone());
        let mut errors = Vec::new();
        match SingleRunWriter::create(dir, &header) {
            Ok(w) => {
                if let Err(e) = w.finish(&run.summary) {
                    errors.push(e);
                }
            }
            Err(e) => errors.push(e),
        }
        if let Err(e) = write_comparison_run(dir, &run.summary, &header, &run.records) {
            errors.push(e);
        }
        if let Err(e) = write_comparison_summary(dir, std::slice::from_ref(&run.summary)) {
            errors.push(e);
        }
        errors
    }

    fn assert_refused_naming(errors: &[anyhow::Error], link: &Path) {
        assert_eq!(errors.len(), 3, "every writer refuses: {errors:?}");
        for e in errors {
            let e = format!("{e:#}");
            assert!(
                e.contains(&format!("{}: it is a symbolic link", link.display())),
                "{e}"
            );
        }
    }

    #[test]
    fn another_users_link_as_the_run_directory_is_refused_and_nothing_is_written_through_it() {
        let tmp = tempfile::tempdir().unwrap();
        let target = tmp.path().join("elsewhere");
        std::fs::create_dir(&target).unwrap();
        let link = tmp.path().join("run");
        if !crate::outdir::foreign_symlink(&target, &link) {
            return;
        }
        assert_refused_naming(&write_everything(&link), &link);
        assert_eq!(std::fs::read_dir(&target).unwrap().count(), 0);
    }

    #[test]
    fn another_users_link_on_the_way_to_the_run_directory_is_refused_and_nothing_is_written_through_it(
    ) {
        let tmp = tempfile::tempdir().unwrap();
        let target = tmp.path().join("elsewhere");
        std::fs::create_dir(&target).unwrap();
        let link = tmp.path().join("shared");
        if !crate::outdir::foreign_symlink(&target, &link) {
            return;
        }
        assert_refused_naming(&write_everything(&link.join("runs").join("run")), &link);
        assert_eq!(std::fs::read_dir(&target).unwrap().count(), 0);
    }

    #[test]
    fn a_symlink_in_place_of_the_decision_log_is_refused_and_its_target_kept() {
        let (sc, _) = demo();
        let header = LogHeader::new("static", true, sc.capacity().clone());
        let tmp = tempfile::tempdir().unwrap();
        let victim = tmp.path().join("victim");
        std::fs::write(&victim, "keep").unwrap();
        let dir = tmp.path().join("run");
        std::fs::create_dir(&dir).unwrap();
        std::os::unix::fs::symlink(&victim, dir.join(LOG)).unwrap();
        let e = format!("{:#}", SingleRunWriter::create(&dir, &header).unwrap_err());
        assert!(e.contains("symbolic link"), "{e}");
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep");
    }

    #[test]
    fn a_run_directory_from_before_the_header_still_loads() {
        let (_, run) = demo();
        let dir = tempfile::tempdir().unwrap();
        let text: String = run
            .records
            .iter()
            .map(|r| serde_json::to_string(r).unwrap() + "\n")
            .collect();
        std::fs::write(dir.path().join(LOG), text).unwrap();
        let RunDir::Single(back) = load(dir.path()).unwrap() else {
            panic!("a single run")
        };
        assert_eq!(back.records, run.records);
    }

    #[test]
    fn a_bad_line_names_the_file_and_the_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(LOG);
        std::fs::write(&path, "\n\nnot json\n").unwrap();
        let e = format!("{:#}", read_log(&path).unwrap_err());
        assert!(
            e.contains(&path.display().to_string()) && e.contains("line 3"),
            "{e}"
        );
    }
}
