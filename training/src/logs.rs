//! Training rows from decision logs (`cohabit simulate` or `cohabit run`): what a host
//! recorded is enough to retrain the model.
//!
//! For two consecutive records t and t+1 of the same run, and each latency-critical
//! service: the features come from record t's observation (telemetry under the allocation
//! then in force, `observation.current`) with record t's plan as the candidate; the target
//! is the p99 measured in record t+1's observation (the simulator's ground truth where the
//! log has one), over the service's target. A pair whose plan did not take effect (record
//! t+1 shows another allocation in force: a dry run, a refused plan) teaches nothing about
//! that plan and gives no row.
//!
//! The host's capacity scales the features; a log records it in its header. A version-1
//! log (no header) does not, and needs the host named by the caller (`--platform`).
//! Pairs never span two headers: a new header means the daemon restarted.
//!
//! # A fleet's logs
//!
//! [`Fleet`] reads many hosts' logs at once, as operators collect them: files, directories
//! (searched recursively for `*.jsonl`, rotated `*.jsonl.N`, either compressed, and
//! `*.parquet`), glob patterns ([`expand_sources`]), gzip or zstd compressed (told by
//! their first bytes, not their names), or Parquet from `cohabit-train export`
//! ([`crate::columnar`]; each log it holds keeps its own host and parts). Each log part is featurised with the host its own header records.
//! Identical records are counted once: a log collected twice, or a rotated file kept
//! beside its compressed copy, adds no rows (a pair of records already seen, on the same
//! host, is skipped). A bad line is counted against its file and breaks the run there
//! (no pair spans it); a file that cannot be read is reported, not fatal. The
//! [`FleetReport`] says how many rows each host gave and what each file lost.
use std::collections::{BTreeMap, HashSet};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use cohabit_core::{DecisionLogReader, DecisionRecord, HostCapacity};
use cohabit_models::{features, target, Neighbours};
use serde::Serialize;
use sha2::{Digest, Sha256};

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
    let rows = records
        .windows(2)
        .flat_map(|pair| rows_from_pair(&pair[0], &pair[1], host))
        .collect();
    Dataset { rows }
}

/// Rows from two consecutive records of one run: one per latency-critical service whose
/// plan took effect and whose outcome was measured.
pub fn rows_from_pair(
    now: &DecisionRecord,
    next: &DecisionRecord,
    host: &HostCapacity,
) -> Vec<Row> {
    let mut rows = Vec::new();
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
        if next
            .observation
            .current
            .services
            .get(&s.spec.name)
            .is_some_and(|in_force| in_force != candidate)
        {
            // The plan did not take effect; the outcome says nothing about it.
            continue;
        }
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
    rows
}

/// True for the names a decision log takes: `*.jsonl`, rotated `*.jsonl.N`, either with
/// `.gz` or `.zst` after it, and `*.parquet` (from `cohabit-train export`).
pub fn is_log_name(name: &str) -> bool {
    if name.ends_with(".parquet") {
        return true;
    }
    let base = name
        .strip_suffix(".gz")
        .or_else(|| name.strip_suffix(".zst"))
        .unwrap_or(name);
    if base.ends_with(".jsonl") {
        return true;
    }
    base.rsplit_once(".jsonl.")
        .is_some_and(|(_, n)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// The log files named by `sources`, sorted, each once: a file as it is (whatever its
/// name), a directory searched recursively for [`is_log_name`] files (symbolic links to
/// directories are not followed), a glob pattern (`*`, `?`, `[…]`, `**`) expanded the same
/// way. A source that names nothing is an error naming it.
pub fn expand_sources(sources: &[impl AsRef<str>]) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for source in sources {
        let source = source.as_ref();
        let path = Path::new(source);
        if path.exists() {
            collect(path, &mut out)?;
            continue;
        }
        if !source.contains(['*', '?', '[']) {
            bail!("{source}: no such file or directory");
        }
        let matches =
            glob::glob(source).with_context(|| format!("{source}: not a valid glob pattern"))?;
        let before = out.len();
        for m in matches {
            let m = m.with_context(|| format!("{source}: reading a match"))?;
            collect(&m, &mut out)?;
        }
        if out.len() == before {
            bail!("{source}: the pattern matches no decision log");
        }
    }
    out.sort();
    out.dedup();
    Ok(out)
}

/// Adds `path` (a file) or the log files under it (a directory) to `out`.
fn collect(path: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    let meta = std::fs::metadata(path).with_context(|| format!("reading {}", path.display()))?;
    if !meta.is_dir() {
        out.push(path.to_path_buf());
        return Ok(());
    }
    let mut entries: Vec<_> = std::fs::read_dir(path)
        .with_context(|| format!("listing {}", path.display()))?
        .collect::<std::io::Result<_>>()
        .with_context(|| format!("listing {}", path.display()))?;
    entries.sort_by_key(std::fs::DirEntry::file_name);
    for e in entries {
        let p = e.path();
        let kind = e
            .file_type()
            .with_context(|| format!("reading {}", p.display()))?;
        if kind.is_dir() {
            collect(&p, out)?;
        } else if e.file_name().to_str().is_some_and(is_log_name)
            && std::fs::metadata(&p).is_ok_and(|m| m.is_file())
        {
            out.push(p);
        }
    }
    Ok(())
}

/// Opens a decision log, decompressing it when its first bytes are gzip's or zstd's.
pub fn open_log(path: &Path) -> Result<Box<dyn BufRead>> {
    const GZIP: [u8; 2] = [0x1f, 0x8b];
    const ZSTD: [u8; 4] = [0x28, 0xb5, 0x2f, 0xfd];
    let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut raw = BufReader::new(file);
    let head = raw
        .fill_buf()
        .with_context(|| format!("reading {}", path.display()))?
        .to_vec();
    Ok(if head.starts_with(&GZIP) {
        Box::new(BufReader::new(flate2::bufread::MultiGzDecoder::new(raw)))
    } else if head.starts_with(&ZSTD) {
        let d = zstd::stream::read::Decoder::with_buffer(raw)
            .with_context(|| format!("starting to decompress {}", path.display()))?;
        Box::new(BufReader::new(d))
    } else {
        Box::new(raw)
    })
}

/// What one file gave and lost.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct FileReport {
    /// The file.
    pub path: PathBuf,
    /// Records read (duplicates included).
    pub records: usize,
    /// Of which already seen (in this file or another).
    pub duplicate_records: usize,
    /// Rows it gave.
    pub rows: usize,
    /// What reading it lost (lines that were neither a record nor a header each break the
    /// run there).
    #[serde(flatten)]
    pub lost: ReadLosses,
    /// Records skipped because no header says which host they came from (a version-1
    /// log; name the host with `--platform`).
    pub without_host: usize,
}

/// What reading one log lost, as `logs` and `export` report it.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ReadLosses {
    /// Lines (or Parquet rows) that were not a record, skipped.
    pub bad_lines: usize,
    /// The first few bad lines' errors, each naming its line.
    pub errors: Vec<String>,
    /// The last line, cut short mid-write and skipped.
    pub cut_last_line: Option<usize>,
    /// Why the log could not be read at all, or stopped being read.
    pub failed: Option<String>,
}

impl ReadLosses {
    /// Counts a bad line, keeping its error while fewer than [`ERRORS_KEPT`] are kept.
    pub fn note_bad(&mut self, error: String) {
        self.bad_lines += 1;
        if self.errors.len() < ERRORS_KEPT {
            self.errors.push(error);
        }
    }

    /// A phrase per loss, in the order a report gives them.
    pub fn describe(&self) -> Vec<String> {
        let mut lost = Vec::new();
        if let Some(why) = &self.failed {
            lost.push(format!("not read to the end: {why}"));
        }
        if self.bad_lines > 0 {
            lost.push(format!(
                "{} bad line(s) skipped ({})",
                self.bad_lines,
                self.errors.join("; ")
            ));
        }
        if let Some(l) = self.cut_last_line {
            lost.push(format!("last line {l} cut short, skipped"));
        }
        lost
    }
}

/// What one host's logs gave. A host is its header's name and capacity: two hosts that
/// share both (the daemon's default name is `this host`) count as one; give each node its
/// own `[host] name`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HostReport {
    /// The host's name.
    pub name: String,
    /// Its cores.
    pub cores: u32,
    /// Its LLC ways.
    pub llc_ways: u32,
    /// Files with records of it.
    pub files: usize,
    /// Records read (duplicates included).
    pub records: usize,
    /// Of which already seen.
    pub duplicate_records: usize,
    /// Rows.
    pub rows: usize,
}

/// What a fleet's logs gave: per host and per file.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct FleetReport {
    /// Per host, by name.
    pub hosts: Vec<HostReport>,
    /// Per file, in the order read.
    pub files: Vec<FileReport>,
}

impl FleetReport {
    /// Rows from every host.
    pub fn rows(&self) -> usize {
        self.hosts.iter().map(|h| h.rows).sum()
    }

    /// The report people read: a line per host, then a line per file that lost something.
    pub fn render(&self) -> String {
        use std::fmt::Write as _;
        let mut t = String::new();
        for h in &self.hosts {
            let _ = writeln!(
                t,
                "host {:?} ({} cores, {} LLC ways): {} rows from {} records in {} file(s), {} duplicate records skipped",
                h.name, h.cores, h.llc_ways, h.rows, h.records, h.files, h.duplicate_records
            );
        }
        for f in &self.files {
            let mut lost = f.lost.describe();
            if f.without_host > 0 {
                lost.push(format!(
                    "{} record(s) without a header naming their host skipped (name it with --platform)",
                    f.without_host
                ));
            }
            if f.records > 0 && f.duplicate_records == f.records {
                lost.push("every record already seen (a copy?)".into());
            }
            if !lost.is_empty() {
                let _ = writeln!(t, "file {}: {}", f.path.display(), lost.join("; "));
            }
        }
        t
    }
}

/// Bad lines whose errors a file report keeps.
const ERRORS_KEPT: usize = 3;

/// Reads many hosts' decision logs into one dataset, skipping what was already seen.
#[derive(Debug, Default)]
pub struct Fleet {
    fallback: Option<HostCapacity>,
    rows: Dataset,
    /// Digests of the records read, with their host.
    records: HashSet<[u8; 16]>,
    /// Digests of the pairs that gave rows.
    pairs: HashSet<[u8; 32]>,
    /// Per host (its capacity as JSON): what it gave.
    hosts: BTreeMap<String, HostReport>,
    files: Vec<FileReport>,
}

/// One item of a log file, as the fleet reader takes it.
enum Entry {
    /// A record, the host its part of the log names (`None`: a version-1 part) and which
    /// part of the file it is in (the log it came from, and the headers read in it).
    Record {
        record: Box<DecisionRecord>,
        host: Option<HostCapacity>,
        part: (String, usize),
    },
    /// A line (or Parquet row) that is not a record: counted, and it breaks the run there.
    Bad(String),
    /// Reading stopped here.
    Failed(String),
}

/// The previous record of a run being read, for pairing.
struct Prev {
    record: DecisionRecord,
    digest: [u8; 16],
}

impl Fleet {
    /// An empty reader; `fallback` is the host of version-1 logs (no header).
    pub fn new(fallback: Option<HostCapacity>) -> Self {
        Self {
            fallback,
            ..Self::default()
        }
    }

    /// Reads every log `sources` name ([`expand_sources`]).
    pub fn add_sources(&mut self, sources: &[impl AsRef<str>]) -> Result<()> {
        for path in expand_sources(sources)? {
            self.add_file(&path);
        }
        Ok(())
    }

    /// Reads one log file (JSON lines, or Parquet from `cohabit-train export`); what goes
    /// wrong is in its [`FileReport`].
    pub fn add_file(&mut self, path: &Path) {
        if crate::columnar::is_parquet(path) {
            return self.add_parquet(path);
        }
        match open_log(path) {
            Ok(input) => self.add_reader(path, input),
            Err(e) => self.files.push(FileReport {
                path: path.to_path_buf(),
                lost: ReadLosses {
                    failed: Some(format!("{e:#}")),
                    ..ReadLosses::default()
                },
                ..FileReport::default()
            }),
        }
    }

    /// Reads one log from `input`; `path` names it in the report.
    pub fn add_reader(&mut self, path: &Path, input: impl BufRead) {
        let mut reader = DecisionLogReader::new(input);
        let entries = std::iter::from_fn(|| {
            Some(match reader.next()? {
                Ok(record) => Entry::Record {
                    host: reader.host().cloned(),
                    part: (String::new(), reader.headers_read()),
                    record: Box::new(record),
                },
                Err(cohabit_core::LogError::Read { line, source }) => {
                    Entry::Failed(format!("line {line}: {source}"))
                }
                Err(e) => Entry::Bad(e.to_string()),
            })
        });
        let mut report = self.add_entries(path, entries);
        report.lost.cut_last_line = reader.cut_last_line();
        if let Some(line) = report.lost.cut_last_line {
            tracing::warn!(
                file = %path.display(),
                line,
                "the last line of the decision log was cut off mid-write; it was skipped"
            );
        }
        self.files.push(report);
    }

    /// Reads a Parquet log: each part of each log it holds is a run, with its own host.
    fn add_parquet(&mut self, path: &Path) {
        let log = match crate::columnar::ParquetLog::open(path) {
            Ok(log) => log,
            Err(e) => {
                return self.files.push(FileReport {
                    path: path.to_path_buf(),
                    lost: ReadLosses {
                        failed: Some(e.to_string()),
                        ..ReadLosses::default()
                    },
                    ..FileReport::default()
                })
            }
        };
        let entries = log.map(|item| match item {
            Ok(r) => Entry::Record {
                host: r.header.map(|h| h.host),
                part: (r.source, r.part as usize),
                record: Box::new(r.record),
            },
            Err(e @ crate::columnar::ColumnarError::Value { .. }) => Entry::Bad(e.to_string()),
            Err(e) => Entry::Failed(e.to_string()),
        });
        let report = self.add_entries(path, entries);
        self.files.push(report);
    }

    /// Pairs the records of one file's `entries` into rows.
    fn add_entries(&mut self, path: &Path, entries: impl Iterator<Item = Entry>) -> FileReport {
        let mut report = FileReport {
            path: path.to_path_buf(),
            ..FileReport::default()
        };
        let mut hosts_in_file: HashSet<String> = HashSet::new();
        let mut prev: Option<Prev> = None;
        let mut part = (String::new(), 0);
        for entry in entries {
            let (record, host, this_part) = match entry {
                Entry::Record { record, host, part } => (record, host, part),
                Entry::Failed(why) => {
                    report.lost.failed = Some(why);
                    break;
                }
                Entry::Bad(error) => {
                    report.lost.note_bad(error);
                    prev = None;
                    continue;
                }
            };
            if this_part != part {
                part = this_part;
                prev = None;
            }
            report.records += 1;
            let Some(host) = host.or_else(|| self.fallback.clone()) else {
                report.without_host += 1;
                prev = None;
                continue;
            };
            let key = serde_json::to_string(&host).unwrap_or_default();
            let digest = record_digest(&key, &record);
            let duplicate = !self.records.insert(digest);
            let entry = self.hosts.entry(key.clone()).or_insert_with(|| HostReport {
                name: host.name.clone(),
                cores: host.cores,
                llc_ways: host.llc_ways,
                files: 0,
                records: 0,
                duplicate_records: 0,
                rows: 0,
            });
            if hosts_in_file.insert(key) {
                entry.files += 1;
            }
            entry.records += 1;
            if duplicate {
                entry.duplicate_records += 1;
                report.duplicate_records += 1;
            }
            if let Some(p) = &prev {
                let mut pair = [0u8; 32];
                pair[..16].copy_from_slice(&p.digest);
                pair[16..].copy_from_slice(&digest);
                if self.pairs.insert(pair) {
                    let rows = rows_from_pair(&p.record, &record, &host);
                    entry.rows += rows.len();
                    report.rows += rows.len();
                    self.rows.rows.extend(rows);
                }
            }
            prev = Some(Prev {
                record: *record,
                digest,
            });
        }
        report
    }

    /// The rows read so far.
    pub fn rows(&self) -> &Dataset {
        &self.rows
    }

    /// The rows and what each host and file gave.
    pub fn finish(self) -> (Dataset, FleetReport) {
        let mut hosts: Vec<HostReport> = self.hosts.into_values().collect();
        hosts.sort_by(|a, b| (&a.name, a.cores, a.llc_ways).cmp(&(&b.name, b.cores, b.llc_ways)));
        (
            self.rows,
            FleetReport {
                hosts,
                files: self.files,
            },
        )
    }
}

/// A digest of a record and the host it came from (its capacity as JSON).
fn record_digest(host: &str, record: &DecisionRecord) -> [u8; 16] {
    let mut h = Sha256::new();
    h.update(host.as_bytes());
    h.update([0]);
    h.update(serde_json::to_vec(record).unwrap_or_default());
    let full = h.finalize();
    let mut out = [0u8; 16];
    out.copy_from_slice(&full[..16]);
    out
}
