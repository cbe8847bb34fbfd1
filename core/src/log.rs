//! The decision log (`decisions.jsonl`): its one reader and its one writer.
//!
//! Every program that writes or reads decision logs (the simulator's run directories, the
//! daemon, training, the plots) goes through this module, so the format is defined once.
//! It works over [`std::io::Write`] and [`std::io::BufRead`]; opening files is the caller's.
//!
//! # Format (version 2)
//!
//! JSON Lines. The first line is a [`LogHeader`], told apart from a record by its key
//! `cohabit_decision_log`, the log's version:
//!
//! ```text
//! {"cohabit_decision_log":2,"policy":"parties","simulated":false,"host":{"name":"Xeon Gold 6338",...}}
//! {"schema_version":2,"policy":"parties","simulated":false,"observation":{...},...}
//! ```
//!
//! Every further line is one [`DecisionRecord`]. A header may appear again further down (a
//! daemon restarted on a different host or with another policy appends a new header to
//! its log); it describes the records after it. Blank lines are skipped.
//!
//! A last line cut short (no newline at its end, and not a whole record or header: the
//! writer stopped mid-line, or the disk filled) is skipped, not an error; the reader tells
//! which line it was ([`DecisionLogReader::cut_last_line`]) so the caller can warn. A bad
//! line anywhere else is an error.
//!
//! # Older and newer logs
//!
//! - Version 1 had no header: records only (`schema_version` 1 or 2). Such a log, or its
//!   headerless beginning, still loads; its records are brought up to date with
//!   [`DecisionRecord::upgrade`] and its host is unknown ([`DecisionLogReader::header`] is
//!   `None`).
//! - A header or a record from a newer version than this build knows is an error that names
//!   both versions ([`LogError::NewerLog`], [`LogError::NewerRecord`]).

use std::collections::BTreeMap;
use std::io::{self, BufRead, Write};

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::{DecisionRecord, HostCapacity, DECISION_SCHEMA_VERSION};

/// Version of the log layout this build writes and the newest it reads. Version 1 was
/// records only; version 2 put a [`LogHeader`] first.
pub const DECISION_LOG_VERSION: u32 = 2;

/// The key that marks a header line; its value is the log's version.
const HEADER_KEY: &str = "cohabit_decision_log";

/// The first line of a decision log: who wrote the records below it, and on what host.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LogHeader {
    /// Log layout version ([`DECISION_LOG_VERSION`]), written as `cohabit_decision_log`.
    #[serde(rename = "cohabit_decision_log")]
    pub version: u32,
    /// Name of the policy that made the decisions.
    pub policy: String,
    /// True when the host was the simulator.
    pub simulated: bool,
    /// What the host offered; training scales its features by it.
    pub host: HostCapacity,
    /// The policy's tunables an operator moved from their defaults (`ml`'s `margin`, …),
    /// so that whoever reads the log knows what decided; absent when none were.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tunables: BTreeMap<String, f64>,
}

impl LogHeader {
    /// A header of the current version.
    pub fn new(policy: impl Into<String>, simulated: bool, host: HostCapacity) -> Self {
        Self {
            version: DECISION_LOG_VERSION,
            policy: policy.into(),
            simulated,
            host,
            tunables: BTreeMap::new(),
        }
    }

    /// The header with the policy's moved tunables `tunables`.
    pub fn with_tunables<'a>(mut self, tunables: impl IntoIterator<Item = (&'a str, f64)>) -> Self {
        self.tunables = tunables
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        self
    }
}

/// Why a decision log could not be read. Every variant names the line (from 1); the
/// caller adds the file.
#[derive(Debug, Error)]
pub enum LogError {
    /// The input could not be read (or was not UTF-8).
    #[error("line {line}: cannot read")]
    Read {
        /// The line being read.
        line: usize,
        /// What failed.
        #[source]
        source: io::Error,
    },
    /// A line is neither a header nor a decision record.
    #[error("line {line}: not a decision record")]
    Record {
        /// The bad line.
        line: usize,
        /// Why it does not parse.
        #[source]
        source: serde_json::Error,
    },
    /// A line marked as a header does not parse as one.
    #[error("line {line}: not a valid decision log header")]
    Header {
        /// The bad line.
        line: usize,
        /// Why it does not parse.
        #[source]
        source: serde_json::Error,
    },
    /// The header is from a newer version of cohabit.
    #[error(
        "line {line}: decision log version {found} is newer than this build reads \
         (version {supported} and older); read it with a newer cohabit"
    )]
    NewerLog {
        /// The header's line.
        line: usize,
        /// The version in the header.
        found: u32,
        /// The newest version this build reads ([`DECISION_LOG_VERSION`]).
        supported: u32,
    },
    /// A record is from a newer version of cohabit.
    #[error(
        "line {line}: decision record schema_version {found} is newer than this build reads \
         (schema_version {supported} and older); read it with a newer cohabit"
    )]
    NewerRecord {
        /// The record's line.
        line: usize,
        /// The record's `schema_version`.
        found: u32,
        /// The newest schema this build reads ([`DECISION_SCHEMA_VERSION`]).
        supported: u32,
    },
}

impl LogError {
    /// The line (from 1) the error is about.
    pub fn line(&self) -> usize {
        match self {
            LogError::Read { line, .. }
            | LogError::Record { line, .. }
            | LogError::Header { line, .. }
            | LogError::NewerLog { line, .. }
            | LogError::NewerRecord { line, .. } => *line,
        }
    }
}

/// Writes a decision log: a header line, then one record per line.
///
/// Each line goes to `W` in one `write_all`, so a log opened in append mode gets whole
/// lines. Nothing is flushed until [`DecisionLogWriter::flush`].
#[derive(Debug)]
pub struct DecisionLogWriter<W: Write> {
    out: W,
    line: Vec<u8>,
    records: usize,
}

impl<W: Write> DecisionLogWriter<W> {
    /// Starts a log on `out` by writing `header`.
    pub fn new(out: W, header: &LogHeader) -> io::Result<Self> {
        let mut w = Self::continuing(out);
        w.write_header(header)?;
        Ok(w)
    }

    /// Continues a log whose last header (already in `out`) describes the records to come.
    pub fn continuing(out: W) -> Self {
        Self {
            out,
            line: Vec::new(),
            records: 0,
        }
    }

    /// Writes a header: the records after it are described by it.
    pub fn write_header(&mut self, header: &LogHeader) -> io::Result<()> {
        self.write_line(header)
    }

    /// Writes one record.
    pub fn write(&mut self, record: &DecisionRecord) -> io::Result<()> {
        self.write_line(record)?;
        self.records += 1;
        Ok(())
    }

    /// Records written by this writer.
    pub fn records(&self) -> usize {
        self.records
    }

    /// Flushes `W`.
    pub fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }

    /// The output, e.g. to sync it.
    pub fn get_mut(&mut self) -> &mut W {
        &mut self.out
    }

    /// Gives the output back (not flushed).
    pub fn into_inner(self) -> W {
        self.out
    }

    fn write_line(&mut self, value: &impl Serialize) -> io::Result<()> {
        self.line.clear();
        serde_json::to_writer(&mut self.line, value)?;
        self.line.push(b'\n');
        self.out.write_all(&self.line)
    }
}

/// One line of a log, parsed.
enum Line {
    Header(LogHeader),
    Record(Box<DecisionRecord>),
}

/// Reads a decision log: an iterator over its records, in order, upgraded to the current
/// layout. Headers are taken in as they come; [`DecisionLogReader::header`] is the one in
/// force for the record last returned.
///
/// A line that does not parse yields an error naming it, and reading may go on after it;
/// after a read error the iterator ends. A last line cut short is skipped (see
/// [`Self::cut_last_line`]).
#[derive(Debug)]
pub struct DecisionLogReader<R: BufRead> {
    input: R,
    buf: String,
    line: usize,
    header: Option<LogHeader>,
    headers: usize,
    failed: bool,
    cut: Option<usize>,
}

impl<R: BufRead> DecisionLogReader<R> {
    /// A reader at the start of `input`.
    pub fn new(input: R) -> Self {
        Self {
            input,
            buf: String::new(),
            line: 0,
            header: None,
            headers: 0,
            failed: false,
            cut: None,
        }
    }

    /// How many headers the iterator has taken in so far. It grows when a new part of the
    /// log begins (a daemon restarted), even under a header equal to the last one, so a
    /// caller iterating records can tell parts apart without [`Self::segments`], which
    /// stops at the first bad line.
    pub fn headers_read(&self) -> usize {
        self.headers
    }

    /// The number (from 1) of the last line, when it was cut short and skipped: it had no
    /// newline at its end and was neither a record nor a header. Known once the reader has
    /// reached the end; worth a warning, since a record was lost there.
    pub fn cut_last_line(&self) -> Option<usize> {
        self.cut
    }

    /// The latest header read: the one describing the record last returned. `None` before
    /// any header, which for a version-1 log (no header) means the host is unknown.
    pub fn header(&self) -> Option<&LogHeader> {
        self.header.as_ref()
    }

    /// The host of the record last returned, where the log records it.
    pub fn host(&self) -> Option<&HostCapacity> {
        self.header.as_ref().map(|h| &h.host)
    }

    /// The number (from 1) of the line last read.
    pub fn line(&self) -> usize {
        self.line
    }

    /// Reads the whole log, split where a header starts a new part.
    pub fn segments(&mut self) -> Result<Vec<LogSegment>, LogError> {
        let mut out = vec![LogSegment {
            first_line: 1,
            header: None,
            records: Vec::new(),
        }];
        while let Some(line) = self.next_line() {
            match line? {
                Line::Header(header) => out.push(LogSegment {
                    first_line: self.line,
                    header: Some(header),
                    records: Vec::new(),
                }),
                Line::Record(r) => out
                    .last_mut()
                    .expect("there is always a segment")
                    .records
                    .push(*r),
            }
        }
        // The headerless start of a log that begins with a header is no part of it.
        if out.len() > 1 && out[0].records.is_empty() {
            out.remove(0);
        }
        Ok(out)
    }

    /// Reads the next non-blank line.
    fn next_line(&mut self) -> Option<Result<Line, LogError>> {
        loop {
            if self.failed {
                return None;
            }
            self.buf.clear();
            self.line += 1;
            match self.input.read_line(&mut self.buf) {
                Ok(0) => return None,
                Ok(_) => {}
                Err(source) => {
                    self.failed = true;
                    return Some(Err(LogError::Read {
                        line: self.line,
                        source,
                    }));
                }
            }
            let text = self.buf.trim();
            if text.is_empty() {
                continue;
            }
            let parsed = parse_line(text, self.line);
            let at_end = !self.buf.ends_with('\n');
            if at_end
                && matches!(
                    parsed,
                    Err(LogError::Record { .. } | LogError::Header { .. })
                )
            {
                self.cut = Some(self.line);
                self.failed = true;
                return None;
            }
            return Some(parsed);
        }
    }
}

impl<R: BufRead> Iterator for DecisionLogReader<R> {
    type Item = Result<DecisionRecord, LogError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            match self.next_line()? {
                Ok(Line::Header(h)) => {
                    self.header = Some(h);
                    self.headers += 1;
                }
                Ok(Line::Record(r)) => return Some(Ok(*r)),
                Err(e) => return Some(Err(e)),
            }
        }
    }
}

/// A stretch of a log under one header: the whole of a log written in one go, or what a
/// daemon appended between two headers.
#[derive(Debug, Clone, PartialEq)]
pub struct LogSegment {
    /// The line (from 1) the segment starts at: its header, or the log's first line.
    pub first_line: usize,
    /// The header, or `None` for the headerless beginning of a version-1 log.
    pub header: Option<LogHeader>,
    /// Its records, in order, upgraded.
    pub records: Vec<DecisionRecord>,
}

/// The last header of a log, reading only the header lines: what a writer appending to
/// the log continues from. `None` when the log has none (empty, or version 1).
pub fn last_header(input: impl BufRead) -> Result<Option<LogHeader>, LogError> {
    let mut last = None;
    for (i, line) in input.lines().enumerate() {
        let line = line.map_err(|source| LogError::Read {
            line: i + 1,
            source,
        })?;
        if let Some(version) = header_version(&line) {
            last = Some(parse_header(&line, i + 1, version)?);
        }
    }
    Ok(last)
}

/// The version of a header line, or `None` when the line is not a header. Cheap for
/// records: only a line mentioning the key is parsed.
fn header_version(line: &str) -> Option<Result<u32, serde_json::Error>> {
    #[derive(Deserialize)]
    struct Probe {
        cohabit_decision_log: Option<serde_json::Value>,
    }
    if !line.contains(HEADER_KEY) {
        return None;
    }
    // A record whose text merely mentions the key has no such top-level field.
    let value = serde_json::from_str::<Probe>(line)
        .ok()?
        .cohabit_decision_log?;
    Some(serde_json::from_value(value))
}

fn parse_header(
    text: &str,
    line: usize,
    version: Result<u32, serde_json::Error>,
) -> Result<LogHeader, LogError> {
    let found = version.map_err(|source| LogError::Header { line, source })?;
    if found > DECISION_LOG_VERSION {
        return Err(LogError::NewerLog {
            line,
            found,
            supported: DECISION_LOG_VERSION,
        });
    }
    serde_json::from_str(text).map_err(|source| LogError::Header { line, source })
}

fn parse_line(text: &str, line: usize) -> Result<Line, LogError> {
    if let Some(version) = header_version(text) {
        return parse_header(text, line, version).map(Line::Header);
    }
    let newer = |found: u32| LogError::NewerRecord {
        line,
        found,
        supported: DECISION_SCHEMA_VERSION,
    };
    match serde_json::from_str::<DecisionRecord>(text) {
        Ok(mut r) => {
            if r.schema_version > DECISION_SCHEMA_VERSION {
                return Err(newer(r.schema_version));
            }
            r.upgrade();
            Ok(Line::Record(Box::new(r)))
        }
        Err(source) => {
            // A newer record may not parse at all; say so rather than what broke.
            #[derive(Deserialize)]
            struct Probe {
                schema_version: u32,
            }
            match serde_json::from_str::<Probe>(text) {
                Ok(p) if p.schema_version > DECISION_SCHEMA_VERSION => Err(newer(p.schema_version)),
                _ => Err(LogError::Record { line, source }),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;
    use crate::{
        Allocation, ApplyOutcome, DecisionPath, GroundTruth, Observation, Plan, Reason, Sample,
        ServiceClass, ServiceObservation, ServiceSpec, WayRange,
    };

    fn host(cores: u32) -> HostCapacity {
        HostCapacity {
            name: "test host".into(),
            cores,
            freq_ghz: 2.3,
            llc_ways: 11,
            llc_way_bytes: 2_883_584,
            mem_bw_bytes_per_s: 76.8e9,
            gpus: vec![],
            closids: 8,
            mba_min_pct: 20,
            mba_gran_pct: 5,
            min_cbm_bits: 1,
            shareable_bits: 0,
        }
    }

    fn record(t_ms: u64, p99_ms: Option<f64>, reason: &str) -> DecisionRecord {
        let a = Allocation {
            cores: 2,
            llc_ways: WayRange::new(0, 3),
            mba_pct: 100,
            gpu_mps_pct: None,
        };
        let plan = Plan {
            services: BTreeMap::from([("kv".to_string(), a)]),
            best_effort: a,
            gpu_memory_mib: Default::default(),
        };
        DecisionRecord {
            schema_version: DECISION_SCHEMA_VERSION,
            policy: "parties".into(),
            simulated: false,
            observation: Observation {
                t_ms,
                services: vec![ServiceObservation {
                    spec: ServiceSpec {
                        name: "kv".into(),
                        class: ServiceClass::LatencyCritical { p99_target_ms: 1.5 },
                        gpu: None,
                        priority: 0,
                    },
                    sample: Sample {
                        p99_ms,
                        ..Sample::default()
                    },
                    gpu_mps_effective_pct: None,
                }],
                current: plan.clone(),
            },
            plan,
            changes: vec![],
            reasons: BTreeMap::from([(
                "kv".to_string(),
                Reason::new(DecisionPath::Feedback, reason),
            )]),
            apply: None,
            decision_us: 12.5,
            predictions: BTreeMap::new(),
            truth: None,
            from_pods: Default::default(),
            control: Default::default(),
        }
    }

    fn write(header: &LogHeader, records: &[DecisionRecord]) -> Vec<u8> {
        let mut w = DecisionLogWriter::new(Vec::new(), header).unwrap();
        for r in records {
            w.write(r).unwrap();
        }
        assert_eq!(w.records(), records.len());
        w.into_inner()
    }

    fn read(bytes: &[u8]) -> Result<Vec<DecisionRecord>, LogError> {
        DecisionLogReader::new(bytes).collect()
    }

    #[test]
    fn a_header_and_records_read_back_equal() {
        let header = LogHeader::new("parties", false, host(36));
        let records = vec![record(0, Some(0.9), "hold"), record(1000, None, "grow")];
        let bytes = write(&header, &records);
        let mut reader = DecisionLogReader::new(&bytes[..]);
        assert_eq!(reader.header(), None);
        let back: Vec<_> = reader.by_ref().collect::<Result<_, _>>().unwrap();
        assert_eq!(back, records);
        assert_eq!(reader.header(), Some(&header));
        assert_eq!(reader.host(), Some(&host(36)));
        let segments = DecisionLogReader::new(&bytes[..]).segments().unwrap();
        assert_eq!(
            segments,
            vec![LogSegment {
                first_line: 1,
                header: Some(header),
                records
            }]
        );
    }

    #[test]
    fn the_header_is_the_first_line_and_names_the_version_first() {
        let bytes = write(&LogHeader::new("static", true, host(4)), &[]);
        let text = String::from_utf8(bytes).unwrap();
        assert!(
            text.starts_with(r#"{"cohabit_decision_log":2,"policy":"static","simulated":true,"host":{"name":"test host","cores":4,"#),
            "{text}"
        );
        assert!(
            text.contains(r#""closids":8,"mba_min_pct":20,"mba_gran_pct":5}"#),
            "{text}"
        );
        assert_eq!(text.lines().count(), 1);
        assert!(
            !text.contains("tunables"),
            "none moved, none written: {text}"
        );
    }

    #[test]
    fn moved_tunables_ride_in_the_header_and_a_header_without_them_reads() {
        let tuned = LogHeader::new("ml", true, host(4))
            .with_tunables([("margin", 0.95), ("shrink_after", 3.0)]);
        let bytes = write(&tuned, &[]);
        let text = String::from_utf8(bytes.clone()).unwrap();
        assert!(
            text.contains(r#""tunables":{"margin":0.95,"shrink_after":3.0}"#),
            "{text}"
        );
        assert_eq!(last_header(&bytes[..]).unwrap(), Some(tuned));
        // A header written before the field existed reads with none.
        let old = write(&LogHeader::new("ml", true, host(4)), &[]);
        let h = last_header(&old[..]).unwrap().unwrap();
        assert!(h.tunables.is_empty());
    }

    #[test]
    fn a_version_1_log_loads_upgraded_and_without_a_host() {
        let line = |t: u64, reasons: &str| {
            format!(
                r#"{{"schema_version":1,"policy":"parties","simulated":false,"observation":{{"t_ms":{t},"services":[],"current":{{"services":{{}},"best_effort":{{"cores":1,"llc_ways":{{"first":0,"count":1}},"mba_pct":100}}}}}},"plan":{{"services":{{}},"best_effort":{{"cores":1,"llc_ways":{{"first":0,"count":1}},"mba_pct":100}}}},"changes":[],"reasons":{reasons},"decision_us":1.0}}"#
            )
        };
        let text = [
            line(0, r#"{"best-effort":"initial fair share"}"#),
            String::new(),
            line(
                1000,
                r#"{"kv":"feedback: grow cores","apply":"not applied: resctrl: out of CLOSIDs"}"#,
            ),
        ]
        .join("\n");
        let mut reader = DecisionLogReader::new(text.as_bytes());
        let records: Vec<_> = reader.by_ref().collect::<Result<_, _>>().unwrap();
        assert_eq!(reader.header(), None);
        assert_eq!(reader.host(), None);
        assert_eq!(records.len(), 2);
        assert_eq!(
            records[0].reasons["best-effort"],
            Reason::new(DecisionPath::Static, "initial fair share")
        );
        assert_eq!(
            records[1].reasons,
            BTreeMap::from([(
                "kv".to_string(),
                Reason::new(DecisionPath::Feedback, "grow cores")
            )])
        );
        assert_eq!(
            records[1].apply,
            Some(ApplyOutcome::Refused {
                error: "resctrl: out of CLOSIDs".into()
            })
        );
        let segments = DecisionLogReader::new(text.as_bytes()).segments().unwrap();
        assert_eq!(segments.len(), 1);
        assert_eq!(segments[0].header, None);
        assert_eq!(segments[0].records, records);
        assert_eq!(last_header(text.as_bytes()).unwrap(), None);
    }

    #[test]
    fn a_log_from_a_newer_version_names_both_versions() {
        let text = concat!(
            r#"{"cohabit_decision_log":3,"policy":"ml","simulated":false,"host":{"something":"new"}}"#,
            "\n"
        );
        let e = read(text.as_bytes()).unwrap_err();
        assert!(matches!(
            e,
            LogError::NewerLog {
                line: 1,
                found: 3,
                supported: DECISION_LOG_VERSION
            }
        ));
        let msg = e.to_string();
        assert!(
            msg.contains("version 3") && msg.contains(&format!("version {DECISION_LOG_VERSION}")),
            "{msg}"
        );
        assert!(matches!(
            last_header(text.as_bytes()),
            Err(LogError::NewerLog { found: 3, .. })
        ));
    }

    #[test]
    fn a_record_from_a_newer_schema_names_both_versions_even_if_it_does_not_parse() {
        let mut v = serde_json::to_value(record(0, Some(1.0), "hold")).unwrap();
        v["schema_version"] = (DECISION_SCHEMA_VERSION + 1).into();
        let parses = serde_json::to_string(&v).unwrap();
        v["plan"] = "a shape this build does not know".into();
        let broken = serde_json::to_string(&v).unwrap();
        for text in [parses, broken] {
            let e = read(text.as_bytes()).unwrap_err();
            let msg = e.to_string();
            assert!(
                msg.contains(&format!("schema_version {}", DECISION_SCHEMA_VERSION + 1))
                    && msg.contains(&format!("schema_version {DECISION_SCHEMA_VERSION}")),
                "{msg}"
            );
        }
    }

    #[test]
    fn a_bad_line_names_its_number_and_reading_goes_on() {
        let mut bytes = write(
            &LogHeader::new("parties", false, host(8)),
            &[record(0, Some(1.0), "a")],
        );
        bytes.extend_from_slice(b"\n{\"schema_version\": 2, truncated\n");
        let after = write(
            &LogHeader::new("parties", false, host(8)),
            &[record(9, None, "b")],
        );
        bytes.extend_from_slice(&after);
        let e = read(&bytes).unwrap_err();
        assert_eq!(e.line(), 4);
        assert!(matches!(e, LogError::Record { line: 4, .. }));
        assert!(e.to_string().starts_with("line 4:"), "{e}");
        let results: Vec<_> = DecisionLogReader::new(&bytes[..]).collect();
        assert_eq!(results.len(), 3);
        assert_eq!(results[2].as_ref().unwrap().observation.t_ms, 9);
        let e = DecisionLogReader::new(&bytes[..]).segments().unwrap_err();
        assert_eq!(e.line(), 4);
        // A line marked as a header but not one.
        let e = read(b"{\"cohabit_decision_log\": \"two\"}\n").unwrap_err();
        assert!(matches!(e, LogError::Header { line: 1, .. }), "{e}");
    }

    #[test]
    fn a_last_line_cut_short_is_skipped_and_reported_but_not_one_in_the_middle() {
        let header = LogHeader::new("parties", false, host(8));
        let whole = write(&header, &[record(0, Some(1.0), "a"), record(1, None, "b")]);
        let full = serde_json::to_string(&record(2, None, "c")).unwrap();
        let mut cut = whole.clone();
        cut.extend_from_slice(&full.as_bytes()[..full.len() / 2]);
        let mut reader = DecisionLogReader::new(&cut[..]);
        let records: Vec<_> = reader.by_ref().collect::<Result<_, _>>().unwrap();
        assert_eq!(records.len(), 2);
        assert_eq!(reader.cut_last_line(), Some(4));
        let mut reader = DecisionLogReader::new(&cut[..]);
        let segments = reader.segments().unwrap();
        assert_eq!(segments[0].records.len(), 2);
        assert_eq!(reader.cut_last_line(), Some(4));
        assert_eq!(last_header(&cut[..]).unwrap(), Some(header.clone()));
        // A whole last record without its newline is a record.
        let mut unended = whole.clone();
        unended.extend_from_slice(full.as_bytes());
        let mut reader = DecisionLogReader::new(&unended[..]);
        assert_eq!(reader.by_ref().count(), 3);
        assert_eq!(reader.cut_last_line(), None);
        // The same cut line followed by more is an error.
        let mut middle = cut.clone();
        middle.push(b'\n');
        middle.extend(write(&header, &[]));
        let e = read(&middle).unwrap_err();
        assert!(matches!(e, LogError::Record { line: 4, .. }), "{e}");
    }

    #[test]
    fn a_header_again_mid_file_describes_the_records_after_it() {
        let first = LogHeader::new("parties", false, host(8));
        let second = LogHeader::new("ml", false, host(16));
        let mut bytes = write(&first, &[record(0, Some(1.0), "a"), record(1, None, "b")]);
        let mut w = DecisionLogWriter::continuing(&mut bytes);
        w.write_header(&second).unwrap();
        w.write(&record(2, Some(2.0), "c")).unwrap();
        assert_eq!(w.records(), 1);

        let mut reader = DecisionLogReader::new(&bytes[..]);
        let mut hosts = Vec::new();
        while let Some(r) = reader.next() {
            hosts.push((
                r.unwrap().observation.t_ms,
                reader.host().unwrap().cores,
                reader.headers_read(),
            ));
        }
        assert_eq!(hosts, vec![(0, 8, 1), (1, 8, 1), (2, 16, 2)]);
        assert_eq!(reader.header(), Some(&second));
        let segments = DecisionLogReader::new(&bytes[..]).segments().unwrap();
        assert_eq!(segments.len(), 2);
        assert_eq!((segments[0].first_line, segments[0].records.len()), (1, 2));
        assert_eq!((segments[1].first_line, segments[1].records.len()), (4, 1));
        assert_eq!(segments[1].header.as_ref(), Some(&second));
        assert_eq!(last_header(&bytes[..]).unwrap(), Some(second));
    }

    #[test]
    fn a_version_1_beginning_then_a_header_makes_two_segments() {
        let v1 = serde_json::to_string(&record(0, Some(1.0), "old")).unwrap() + "\n";
        let mut bytes = v1.into_bytes();
        let header = LogHeader::new("parties", false, host(8));
        bytes.extend(write(&header, &[record(1, Some(1.0), "new")]));
        let segments = DecisionLogReader::new(&bytes[..]).segments().unwrap();
        assert_eq!(segments.len(), 2);
        assert_eq!(segments[0].header, None);
        assert_eq!(segments[1].header, Some(header));
        assert_eq!(segments[1].first_line, 2);
    }

    #[test]
    fn judged_p99_prefers_the_truth_and_targets_lists_the_latency_critical() {
        let mut r = record(0, Some(1.2), "hold");
        assert_eq!(r.judged_p99_ms("kv"), Some(1.2));
        assert_eq!(r.judged_p99_ms("other"), None);
        r.truth = Some(GroundTruth {
            p99_ms: BTreeMap::from([("kv".to_string(), 0.7)]),
            load_rps: BTreeMap::new(),
            be_throughput: 1.0,
        });
        assert_eq!(r.judged_p99_ms("kv"), Some(0.7));
        r.observation.services.push(ServiceObservation {
            spec: ServiceSpec {
                name: "batch".into(),
                class: ServiceClass::BestEffort,
                gpu: None,
                priority: 0,
            },
            sample: Sample::default(),
            gpu_mps_effective_pct: None,
        });
        assert_eq!(r.targets(), BTreeMap::from([("kv".to_string(), 1.5)]));
    }

    proptest! {
        #[test]
        fn any_records_round_trip(
            cores in 1u32..512,
            ticks in proptest::collection::vec(
                (any::<u64>(), proptest::option::of(0.0f64..1e6), ".*", any::<bool>()),
                0..8,
            ),
        ) {
            let header = LogHeader::new("ml", true, host(cores));
            let records: Vec<_> = ticks
                .iter()
                .map(|(t, p, text, refused)| {
                    let mut r = record(*t, *p, text);
                    if *refused {
                        r.apply = Some(ApplyOutcome::Refused { error: text.clone() });
                    }
                    r
                })
                .collect();
            let bytes = write(&header, &records);
            let mut reader = DecisionLogReader::new(&bytes[..]);
            let back: Vec<_> = reader.by_ref().collect::<Result<_, _>>().unwrap();
            prop_assert_eq!(back, records);
            prop_assert_eq!(reader.header(), Some(&header));
        }

        #[test]
        fn a_reason_mentioning_the_header_key_is_still_a_record(prefix in ".*") {
            let text = format!("{prefix}\"cohabit_decision_log\":3");
            let records = vec![record(0, None, &text)];
            let bytes = write(&LogHeader::new("ml", true, host(4)), &records);
            prop_assert_eq!(read(&bytes).unwrap(), records);
        }
    }
}
