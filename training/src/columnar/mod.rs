//! Decision logs as Parquet, for the tools a fleet's logs are analysed with (DuckDB,
//! Spark, pandas/polars, anything that reads Arrow).
//!
//! # Layout
//!
//! A decision record is nested (services, two plans, maps of reasons and predictions);
//! those tools want flat columns. A record becomes one row per observed service (in the
//! log's order), one for the best-effort pool and one per group its allocations name but
//! the observation does not, each row carrying the decision's columns (time, policy,
//! decision time, apply outcome) and the capacity of the host its log's header names
//! (null for a version-1 log, which has none). A best-effort job's row carries its pool's
//! allocation, reason and control, so `GROUP BY service` needs no join. docs/FLEETS.md
//! ("Decision logs as Parquet") lists every column; [`flat`] defines them.
//!
//! `source`, `part` and `line` name where each record came from: the log file, the part
//! of it under one header, and the line. Reading a Parquet file back ([`ParquetLog`])
//! gives the records again, equal to the ones read from their JSON lines on every field
//! the layout keeps: everything but reasons, predictions, ground truth and control of
//! names that are neither a service nor a group, a header's own policy and `simulated`
//! (its records' are kept, and the daemon writes the same in both), and the `changes`,
//! which are rebuilt as the difference between the allocation in force and the plan (as
//! the controller computes them).
//!
//! Files carry [`LAYOUT_KEY`] in their key-value metadata; a file without it, or from a
//! newer layout, is refused with a message that says so.

mod columns;
mod flat;

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use arrow_schema::{ArrowError, SchemaRef};
use cohabit_core::{DecisionLogReader, DecisionRecord, LogError, LogHeader};
use parquet::arrow::arrow_reader::{ParquetRecordBatchReader, ParquetRecordBatchReaderBuilder};
use parquet::arrow::ArrowWriter;
use parquet::basic::Compression;
use parquet::errors::ParquetError;
use parquet::file::metadata::KeyValue;
use parquet::file::properties::WriterProperties;
use serde::Serialize;
use thiserror::Error;

use self::flat::Flat;
use crate::logs::ReadLosses;

/// The key-value metadata key of cohabit's layout; its value is [`LAYOUT_VERSION`].
pub const LAYOUT_KEY: &str = "cohabit_decision_log_parquet";
/// Version of the flat layout this build writes and the newest it reads. Layout 2 added
/// the nullable columns of GPU memory (`gpu_memory_bytes`, `gpu_memory_total_bytes`,
/// `current_gpu_memory_mib`, `plan_gpu_memory_mib`); a layout-1 file reads them as nulls.
pub const LAYOUT_VERSION: u32 = 2;

/// Rows per Arrow batch, written and read.
const BATCH_ROWS: usize = 8192;

/// Parquet files start (and end) with these four bytes.
const MAGIC: &[u8; 4] = b"PAR1";

/// One decision record and where it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct LoggedRecord {
    /// The log file it was read from (as named when exported).
    pub source: String,
    /// Headers read in that file before it: 0 for a headerless (version-1) start, then 1,
    /// 2… for each part a daemon started.
    pub part: u32,
    /// Its line in that file (from 1).
    pub line: u64,
    /// The header it was written under (`None`: a version-1 log, whose host is unknown).
    pub header: Option<LogHeader>,
    /// The record.
    pub record: DecisionRecord,
}

/// Why a Parquet decision log could not be written or read.
#[derive(Debug, Error)]
pub enum ColumnarError {
    /// A file could not be opened, created or renamed.
    #[error("{}: {what}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// What was being done.
        what: &'static str,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
    /// The Parquet library refused to read or write.
    #[error("{}: {what}", path.display())]
    Parquet {
        /// The file.
        path: PathBuf,
        /// What was being done.
        what: &'static str,
        /// What failed.
        #[source]
        source: ParquetError,
    },
    /// Rows could not be made into an Arrow batch.
    #[error("{}: building a batch of rows", path.display())]
    Arrow {
        /// The file being written.
        path: PathBuf,
        /// What failed.
        #[source]
        source: ArrowError,
    },
    /// The file is Parquet but not a decision log written by cohabit.
    #[error("{}: not a cohabit decision log (no {LAYOUT_KEY} in its metadata)", path.display())]
    NotALog {
        /// The file.
        path: PathBuf,
    },
    /// The file is from a newer layout than this build reads.
    #[error(
        "{}: Parquet layout {found} is newer than this build reads (layout {LAYOUT_VERSION} \
         and older); read it with a newer cohabit-train", path.display()
    )]
    NewerLayout {
        /// The file.
        path: PathBuf,
        /// Its layout version.
        found: String,
    },
    /// A column is missing or of another type than this build writes.
    #[error("{}: column {column} is {problem}", path.display())]
    Column {
        /// The file.
        path: PathBuf,
        /// The column.
        column: &'static str,
        /// What is wrong.
        problem: String,
    },
    /// A row holds a value this build cannot take back.
    #[error("{}: row {row}: column {column}: {problem}", path.display())]
    Value {
        /// The file.
        path: PathBuf,
        /// The row (from 0, over the whole file).
        row: u64,
        /// The column.
        column: &'static str,
        /// What is wrong.
        problem: String,
    },
}

/// True when the file at `path` starts as Parquet does. A file that cannot be read is not.
pub fn is_parquet(path: &Path) -> bool {
    let mut head = [0u8; 4];
    File::open(path)
        .and_then(|mut f| f.read_exact(&mut head))
        .is_ok_and(|()| &head == MAGIC)
}

/// The Arrow schema of the layout.
pub fn schema() -> SchemaRef {
    flat::to_batch(&[])
        .expect("an empty batch of the layout's own columns always builds")
        .schema()
}

/// Writes decision records as Parquet, a batch of rows at a time.
pub struct ParquetSink {
    path: PathBuf,
    writer: ArrowWriter<File>,
    rows: Vec<Flat>,
    written: u64,
}

impl std::fmt::Debug for ParquetSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParquetSink")
            .field("path", &self.path)
            .field("written", &self.written)
            .finish_non_exhaustive()
    }
}

impl ParquetSink {
    /// Creates (or truncates) `path`.
    pub fn create(path: &Path) -> Result<Self, ColumnarError> {
        let file = File::create(path).map_err(|source| ColumnarError::Io {
            path: path.to_path_buf(),
            what: "creating the Parquet file",
            source,
        })?;
        let props = WriterProperties::builder()
            .set_compression(Compression::SNAPPY)
            .set_key_value_metadata(Some(vec![KeyValue::new(
                LAYOUT_KEY.to_string(),
                LAYOUT_VERSION.to_string(),
            )]))
            .build();
        let writer = ArrowWriter::try_new(file, schema(), Some(props)).map_err(|source| {
            ColumnarError::Parquet {
                path: path.to_path_buf(),
                what: "starting the Parquet file",
                source,
            }
        })?;
        Ok(Self {
            path: path.to_path_buf(),
            writer,
            rows: Vec::new(),
            written: 0,
        })
    }

    /// Adds one record's rows.
    pub fn push(&mut self, record: &LoggedRecord) -> Result<(), ColumnarError> {
        self.rows.extend(flat::flatten(record));
        if self.rows.len() >= BATCH_ROWS {
            self.write_batch()?;
        }
        Ok(())
    }

    /// Rows added so far.
    pub fn rows(&self) -> u64 {
        self.written + self.rows.len() as u64
    }

    /// Writes what is left and the file's footer.
    pub fn finish(mut self) -> Result<u64, ColumnarError> {
        self.write_batch()?;
        self.writer
            .close()
            .map_err(|source| ColumnarError::Parquet {
                path: self.path.clone(),
                what: "writing the Parquet footer",
                source,
            })?;
        Ok(self.written)
    }

    fn write_batch(&mut self) -> Result<(), ColumnarError> {
        if self.rows.is_empty() {
            return Ok(());
        }
        let batch = flat::to_batch(&self.rows).map_err(|source| ColumnarError::Arrow {
            path: self.path.clone(),
            source,
        })?;
        self.writer
            .write(&batch)
            .map_err(|source| ColumnarError::Parquet {
                path: self.path.clone(),
                what: "writing rows",
                source,
            })?;
        self.written += self.rows.len() as u64;
        self.rows.clear();
        Ok(())
    }
}

/// Reads a Parquet decision log: an iterator over its records, in the order written.
///
/// A row whose values cannot be taken back yields [`ColumnarError::Value`] and reading
/// goes on with the next record; any other error ends the iteration.
pub struct ParquetLog {
    path: PathBuf,
    batches: ParquetRecordBatchReader,
    rows: std::vec::IntoIter<Flat>,
    /// The rows of the record being gathered.
    pending: Vec<Flat>,
    /// Rows read so far, for errors.
    row: u64,
    done: bool,
}

impl std::fmt::Debug for ParquetLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParquetLog")
            .field("path", &self.path)
            .field("row", &self.row)
            .finish_non_exhaustive()
    }
}

impl ParquetLog {
    /// Opens `path` and checks that it is a decision log of a layout this build reads.
    pub fn open(path: &Path) -> Result<Self, ColumnarError> {
        let file = File::open(path).map_err(|source| ColumnarError::Io {
            path: path.to_path_buf(),
            what: "opening",
            source,
        })?;
        let parquet = |what| {
            let path = path.to_path_buf();
            move |source| ColumnarError::Parquet { path, what, source }
        };
        let builder = ParquetRecordBatchReaderBuilder::try_new(file)
            .map_err(parquet("reading the Parquet footer"))?;
        let layout = builder
            .metadata()
            .file_metadata()
            .key_value_metadata()
            .and_then(|kv| kv.iter().find(|kv| kv.key == LAYOUT_KEY))
            .and_then(|kv| kv.value.clone())
            .ok_or_else(|| ColumnarError::NotALog {
                path: path.to_path_buf(),
            })?;
        if layout.parse::<u32>().map_or(true, |v| v > LAYOUT_VERSION) {
            return Err(ColumnarError::NewerLayout {
                path: path.to_path_buf(),
                found: layout,
            });
        }
        let batches = builder
            .with_batch_size(BATCH_ROWS)
            .build()
            .map_err(parquet("starting to read rows"))?;
        Ok(Self {
            path: path.to_path_buf(),
            batches,
            rows: Vec::new().into_iter(),
            pending: Vec::new(),
            row: 0,
            done: false,
        })
    }

    /// The record of the rows gathered, if any.
    fn emit(&mut self) -> Option<Result<LoggedRecord, ColumnarError>> {
        if self.pending.is_empty() {
            return None;
        }
        let rows = std::mem::take(&mut self.pending);
        let first_row = self.row - rows.len() as u64;
        Some(
            flat::unflatten(&rows).map_err(|(column, problem)| ColumnarError::Value {
                path: self.path.clone(),
                row: first_row,
                column,
                problem,
            }),
        )
    }

    /// Reads the next batch into `rows`; false at the end.
    fn next_batch(&mut self) -> Result<bool, ColumnarError> {
        let batch = match self.batches.next() {
            None => return Ok(false),
            Some(Ok(b)) => b,
            Some(Err(e)) => {
                return Err(ColumnarError::Parquet {
                    path: self.path.clone(),
                    what: "reading rows",
                    source: ParquetError::from(e),
                })
            }
        };
        let rows = flat::from_batch(&batch).map_err(|(column, problem)| ColumnarError::Column {
            path: self.path.clone(),
            column,
            problem,
        })?;
        self.rows = rows.into_iter();
        Ok(true)
    }
}

impl Iterator for ParquetLog {
    type Item = Result<LoggedRecord, ColumnarError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if let Some(row) = self.rows.next() {
                let same = self
                    .pending
                    .first()
                    .is_none_or(|p| p.source == row.source && p.line == row.line);
                let out = if same { None } else { self.emit() };
                self.pending.push(row);
                self.row += 1;
                if out.is_some() {
                    return out;
                }
                continue;
            }
            if self.done {
                return self.emit();
            }
            match self.next_batch() {
                Ok(true) => {}
                Ok(false) => self.done = true,
                Err(e) => {
                    self.done = true;
                    self.pending.clear();
                    return Some(Err(e));
                }
            }
        }
    }
}

/// What one log gave to an export.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ExportedFile {
    /// The log.
    pub path: PathBuf,
    /// Records written.
    pub records: usize,
    /// What reading it lost.
    #[serde(flatten)]
    pub lost: ReadLosses,
}

/// What an export wrote and what it skipped, per file.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ExportReport {
    /// The Parquet file written.
    pub out: PathBuf,
    /// Records written.
    pub records: usize,
    /// Rows written.
    pub rows: u64,
    /// Per log, in the order read.
    pub files: Vec<ExportedFile>,
    /// Sources left out because they are the output itself (an earlier export into the
    /// directory being exported).
    pub skipped_output: Vec<PathBuf>,
}

impl ExportReport {
    /// A line per log that lost something, then the total.
    pub fn render(&self) -> String {
        use std::fmt::Write as _;
        let mut t = String::new();
        for f in &self.files {
            let lost = f.lost.describe();
            if !lost.is_empty() {
                let _ = writeln!(t, "file {}: {}", f.path.display(), lost.join("; "));
            }
        }
        for p in &self.skipped_output {
            let _ = writeln!(t, "file {}: the output itself, left out", p.display());
        }
        let _ = writeln!(
            t,
            "wrote {} records as {} rows from {} file(s) to {}",
            self.records,
            self.rows,
            self.files.len(),
            self.out.display()
        );
        t
    }
}

/// Writes the decision logs `paths` (JSON lines, compressed or not, or Parquet from an
/// earlier export) into one Parquet file `out`. A bad line is skipped and counted against
/// its file; the rest of the file is still written. The file appears under its name only
/// once it is complete; an earlier `out` among `paths` is left out, not read.
pub fn export(paths: &[PathBuf], out: &Path) -> Result<ExportReport, ColumnarError> {
    let partial = out.with_extension("parquet.partial");
    let mut report = ExportReport {
        out: out.to_path_buf(),
        ..ExportReport::default()
    };
    let out_id = std::fs::canonicalize(out).ok();
    let (skipped, paths): (Vec<&PathBuf>, Vec<&PathBuf>) = paths
        .iter()
        .partition(|p| out_id.is_some() && std::fs::canonicalize(p).ok() == out_id);
    report.skipped_output = skipped.into_iter().cloned().collect();
    let mut sink = ParquetSink::create(&partial)?;
    for path in paths {
        let file = export_one(path, &mut sink);
        report.records += file.records;
        report.files.push(file);
    }
    report.rows = sink.finish()?;
    std::fs::rename(&partial, out).map_err(|source| ColumnarError::Io {
        path: out.to_path_buf(),
        what: "moving the finished export into place",
        source,
    })?;
    Ok(report)
}

/// Adds one log's records to `sink`; what goes wrong is in its report.
fn export_one(path: &Path, sink: &mut ParquetSink) -> ExportedFile {
    let mut report = ExportedFile {
        path: path.to_path_buf(),
        ..ExportedFile::default()
    };
    let result = if is_parquet(path) {
        export_parquet(path, sink, &mut report)
    } else {
        export_jsonl(path, sink, &mut report)
    };
    if let Err(e) = result {
        report.lost.failed = Some(e);
    }
    report
}

fn export_jsonl(
    path: &Path,
    sink: &mut ParquetSink,
    report: &mut ExportedFile,
) -> Result<(), String> {
    let input = crate::logs::open_log(path).map_err(|e| format!("{e:#}"))?;
    let mut reader = DecisionLogReader::new(input);
    let source = path.display().to_string();
    while let Some(item) = reader.next() {
        let record = match item {
            Ok(r) => r,
            Err(e @ LogError::Read { .. }) => return Err(error_chain(&e)),
            Err(e) => {
                report.lost.note_bad(error_chain(&e));
                continue;
            }
        };
        let logged = LoggedRecord {
            source: source.clone(),
            part: u32::try_from(reader.headers_read()).unwrap_or(u32::MAX),
            line: reader.line() as u64,
            header: reader.header().cloned(),
            record,
        };
        sink.push(&logged).map_err(|e| error_chain(&e))?;
        report.records += 1;
    }
    report.lost.cut_last_line = reader.cut_last_line();
    Ok(())
}

fn export_parquet(
    path: &Path,
    sink: &mut ParquetSink,
    report: &mut ExportedFile,
) -> Result<(), String> {
    for item in ParquetLog::open(path).map_err(|e| error_chain(&e))? {
        match item {
            Ok(r) => {
                sink.push(&r).map_err(|e| error_chain(&e))?;
                report.records += 1;
            }
            Err(e @ ColumnarError::Value { .. }) => report.lost.note_bad(e.to_string()),
            Err(e) => return Err(error_chain(&e)),
        }
    }
    Ok(())
}

/// An error and its causes, on one line.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut t = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        t.push_str(": ");
        t.push_str(&c.to_string());
        cause = c.source();
    }
    t
}

/// Reads every record of a Parquet decision log (see [`ParquetLog`]); the first error
/// ends it.
pub fn read_parquet(path: &Path) -> Result<Vec<LoggedRecord>, ColumnarError> {
    ParquetLog::open(path)?.collect()
}

/// Each column of the layout: its name, Arrow type and whether it may be null.
pub fn schema_fields() -> Vec<(String, String, bool)> {
    schema()
        .fields()
        .iter()
        .map(|f| (f.name().clone(), f.data_type().to_string(), f.is_nullable()))
        .collect()
}
