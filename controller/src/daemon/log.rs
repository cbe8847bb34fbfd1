//! The daemon's decision log on disk: core's codec ([`cohabit_core::log`]) over a file that
//! root opens safely and rotates by size.
//!
//! - **Opening** (security review row 22, and L4 of 2026-12b): the log's path is walked from
//!   `/` without following a link ([`files::Dir`]), so a symbolic link anywhere in it stops
//!   the start; its directory must be owned by root and writable by nobody else (it is
//!   created `0750` when missing); the file is opened with `O_NOFOLLOW`, so a symlink at the
//!   path stops the start too, and created `0640`.
//! - **Continuing** ([`LogFile::start`]): a last line cut short by a crash is cut off, so it
//!   never ends up in the middle of the file; a log whose last header is this run's is
//!   continued, any other gets this run's header appended (see [`cohabit_core::log`]).
//! - **Writing** (row 13): the codec hands each line to [`RotatingLog`] as one buffer, which
//!   goes to the file in one `write(2)`. A write that fails part-way (disk full) is cut back,
//!   so the file holds whole lines only.
//! - **Rotating**: when a line would take the file past `log_max_bytes`, `decisions.jsonl`
//!   becomes `decisions.jsonl.1`, `.1` becomes `.2`, … up to `log_keep` files (the oldest is
//!   dropped), and a new file starts with the header. Every file is a complete log.

use std::fs::File;
use std::io::{self, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use cohabit_core::log::{last_header, LogError};
use cohabit_core::{DecisionLogWriter, LogHeader};

use cohabit_host::files;

/// When the log is rotated and how many old ones are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogLimits {
    /// A line that would take the file past this size goes to a new file.
    pub max_bytes: u64,
    /// Rotated files kept (`decisions.jsonl.1` … `.N`); 0 keeps none.
    pub keep: u32,
}

/// The decision log file, opened and checked but not yet written.
#[derive(Debug)]
pub struct LogFile {
    path: PathBuf,
    file: File,
    limits: LogLimits,
}

impl LogFile {
    /// Opens (or creates) the log at `path`: see the module doc for what is refused. Nothing
    /// is written yet.
    pub fn open(path: &Path, limits: LogLimits) -> Result<Self> {
        let dir = files::parent_dir(path);
        files::ensure_private_dir(dir, 0o750)
            .with_context(|| format!("the decision log's directory {}", dir.display()))?;
        let file = files::open_log_file(path, false)
            .with_context(|| format!("opening the decision log {}", path.display()))?;
        Ok(Self {
            path: path.to_path_buf(),
            file,
            limits,
        })
    }

    /// Continues the log with records described by `header` (see the module doc). A log
    /// this build cannot read (a newer version, a broken header) is an error: move it aside
    /// to start a new one.
    pub fn start(self, header: &LogHeader) -> Result<DecisionLogWriter<RotatingLog>> {
        let path = self.path.clone();
        let header_line = DecisionLogWriter::new(Vec::new(), header)
            .context("serialising the log header")?
            .into_inner();
        let mut log = RotatingLog {
            path: self.path,
            file: self.file,
            len: 0,
            limits: self.limits,
            header: header_line,
        };
        log.continue_with(header)
            .with_context(|| format!("writing the decision log {}", path.display()))?;
        Ok(DecisionLogWriter::continuing(log))
    }
}

/// A decision log file that rotates by size; the codec writes through it.
///
/// Each [`Write::write`] call must be one whole line (the codec's writer does that); it is
/// written with one `write(2)`, after rotating if the line would not fit.
#[derive(Debug)]
pub struct RotatingLog {
    path: PathBuf,
    file: File,
    /// Bytes in `file`.
    len: u64,
    limits: LogLimits,
    /// The header line every new file starts with.
    header: Vec<u8>,
}

impl RotatingLog {
    /// Drops a cut last line, rotates a full log, and adds `header`: every start of the
    /// daemon begins a new segment, so training never pairs the last record of one run
    /// with the first of the next (the reader splits at each header).
    fn continue_with(&mut self, header: &LogHeader) -> Result<()> {
        let len = self.file.metadata()?.len();
        let whole = whole_lines_len(&self.file, len)?;
        if whole < len {
            tracing::warn!(
                log = %self.path.display(),
                bytes = len - whole,
                "the decision log ended in a line cut short (the daemon stopped mid-write); dropped it"
            );
            self.file.set_len(whole)?;
        }
        self.len = whole;
        if self.len >= self.limits.max_bytes {
            return Ok(self.rotate()?);
        }
        let last = last_header_from_end(&self.file, self.len).with_context(|| {
            format!(
                "cannot continue the decision log {}; move it aside to start a new one",
                self.path.display()
            )
        })?;
        if self.len > 0 && last.as_ref() != Some(header) {
            tracing::info!(
                log = %self.path.display(),
                "the decision log was written by another policy, its settings, host or version; continuing it under a new header"
            );
        }
        self.file.write_all(&self.header)?;
        self.len += self.header.len() as u64;
        Ok(())
    }

    /// Moves the files along (`.1` → `.2`, …, the file → `.1`), the oldest dropped, and
    /// starts a new file with the header. The directory is walked and checked again, and
    /// every rename goes through its descriptor ([`files::Dir`]).
    fn rotate(&mut self) -> io::Result<()> {
        let dir = files::Dir::open(files::parent_dir(&self.path)).map_err(io::Error::other)?;
        let name = self
            .path
            .file_name()
            .ok_or_else(|| io::Error::other("the decision log's path has no file name"))?;
        let numbered = |n: u32| {
            let mut p = name.to_os_string();
            p.push(format!(".{n}"));
            p
        };
        if self.limits.keep == 0 {
            ignore_absent(dir.remove(name))?;
        } else {
            for n in (1..self.limits.keep).rev() {
                ignore_absent(dir.rename(&numbered(n), &numbered(n + 1)))?;
            }
            ignore_absent(dir.rename(name, &numbered(1)))?;
        }
        let mut file = files::open_log_in(&dir, name, true).map_err(io::Error::other)?;
        file.write_all(&self.header)?;
        self.file = file;
        self.len = self.header.len() as u64;
        tracing::info!(log = %self.path.display(), keep = self.limits.keep, "decision log rotated");
        Ok(())
    }
}

impl Write for RotatingLog {
    fn write(&mut self, line: &[u8]) -> io::Result<usize> {
        let fits = self.len + line.len() as u64 <= self.limits.max_bytes;
        // A file holding only its header takes any line: never rotate in a loop.
        if !fits && self.len > self.header.len() as u64 {
            self.rotate()?;
        }
        if let Err(e) = self.file.write_all(line) {
            // Whole lines only: cut back what part of this one got in.
            if self.file.set_len(self.len).is_err() {
                self.len = self.file.metadata().map_or(self.len, |m| m.len());
            }
            return Err(e);
        }
        self.len += line.len() as u64;
        Ok(line.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.file.flush()
    }
}

fn ignore_absent(r: io::Result<()>) -> io::Result<()> {
    match r {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        other => other,
    }
}

/// The key every header line holds (see [`cohabit_core::log`]).
const HEADER_KEY_STR: &str = "cohabit_decision_log";
const HEADER_KEY: &[u8] = HEADER_KEY_STR.as_bytes();

/// How much of the log is read at a time from its end.
const BLOCK: u64 = 64 * 1024;

/// The last header of the first `len` bytes of `file` (whole lines), as
/// [`cohabit_core::log::last_header`] reads it, but from the end backwards, block by block,
/// until the last header line: a long log is not read whole at every start. An error names
/// the header's line number.
fn last_header_from_end(file: &File, len: u64) -> Result<Option<LogHeader>> {
    last_header_from_end_by(file, len, BLOCK)
}

/// [`last_header_from_end`], reading `block` bytes at a time.
fn last_header_from_end_by(file: &File, len: u64, block: u64) -> Result<Option<LogHeader>> {
    let mut pos = len;
    // The start of the line that ends the unread part, not yet whole (its start unseen).
    let mut rest: Vec<u8> = Vec::new();
    while pos > 0 {
        let start = pos.saturating_sub(block.max(1));
        let mut buf = vec![0u8; usize::try_from(pos - start)?];
        file.read_exact_at(&mut buf, start)?;
        buf.extend_from_slice(&rest);
        // The whole lines in `buf`: after its first newline (from the file's start, all).
        let whole_from = match buf.iter().position(|&b| b == b'\n') {
            Some(_) if start == 0 => 0,
            Some(i) => i + 1,
            None if start == 0 => 0,
            None => {
                rest = buf;
                pos = start;
                continue;
            }
        };
        // Only lines holding the key can be headers: jump from one to the one before.
        let mut end = buf.len();
        while let Some(at) = rfind_key(&buf[whole_from..end]) {
            let at = whole_from + at;
            let line_start = buf[..at]
                .iter()
                .rposition(|&b| b == b'\n')
                .map_or(0, |i| i + 1)
                .max(whole_from);
            let line_end = buf[at..end]
                .iter()
                .position(|&b| b == b'\n')
                .map_or(end, |i| at + i);
            match last_header(&buf[line_start..line_end]) {
                Ok(Some(h)) => return Ok(Some(h)),
                Ok(None) => {} // a record that mentions the key
                Err(e) => {
                    let at = start + line_start as u64;
                    return Err(with_line(e, line_number(file, at)?).into());
                }
            }
            end = line_start;
        }
        let end = whole_from.saturating_sub(1);
        rest = buf[..end].to_vec();
        pos = start;
    }
    Ok(None)
}

/// Where the last [`HEADER_KEY`] in `hay` starts (whole lines are UTF-8, where `str`'s
/// search is fast; bytes that are not are searched one window at a time).
fn rfind_key(hay: &[u8]) -> Option<usize> {
    match std::str::from_utf8(hay) {
        Ok(text) => text.rfind(HEADER_KEY_STR),
        Err(_) => hay.windows(HEADER_KEY.len()).rposition(|w| w == HEADER_KEY),
    }
}

/// The 1-based number of the line that starts at byte `at` of `file`.
fn line_number(file: &File, at: u64) -> io::Result<usize> {
    let mut buf = vec![0u8; usize::try_from(BLOCK).unwrap_or(65536)];
    let (mut pos, mut lines) = (0u64, 1usize);
    while pos < at {
        let n = usize::try_from((at - pos).min(BLOCK)).unwrap_or(0);
        file.read_exact_at(&mut buf[..n], pos)?;
        lines += buf[..n].iter().filter(|&&b| b == b'\n').count();
        pos += n as u64;
    }
    Ok(lines)
}

/// `e`, read from one line alone, with the line's number in the whole log.
fn with_line(e: LogError, line: usize) -> LogError {
    match e {
        LogError::Header { source, .. } => LogError::Header { line, source },
        LogError::NewerLog {
            found, supported, ..
        } => LogError::NewerLog {
            line,
            found,
            supported,
        },
        LogError::Read { source, .. } => LogError::Read { line, source },
        other => other,
    }
}

/// The length of `file`'s content up to and including its last newline.
fn whole_lines_len(file: &File, len: u64) -> io::Result<u64> {
    let mut buf = vec![0u8; 64 * 1024];
    let mut end = len;
    while end > 0 {
        let start = end.saturating_sub(buf.len() as u64);
        let chunk = &mut buf[..usize::try_from(end - start).unwrap_or(0)];
        file.read_exact_at(chunk, start)?;
        if let Some(i) = chunk.iter().rposition(|&b| b == b'\n') {
            return Ok(start + i as u64 + 1);
        }
        end = start;
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::io::BufReader;
    use std::os::unix::fs::PermissionsExt;

    use cohabit_core::{
        Allocation, DecisionLogReader, DecisionPath, DecisionRecord, HostCapacity, Observation,
        Plan, Reason, WayRange, DECISION_SCHEMA_VERSION,
    };

    use super::*;

    fn host(cores: u32) -> HostCapacity {
        HostCapacity {
            name: "test".into(),
            cores,
            freq_ghz: 2.0,
            llc_ways: 11,
            llc_way_bytes: 1 << 20,
            mem_bw_bytes_per_s: 20e9,
            gpus: vec![],
            closids: 16,
            mba_min_pct: 10,
            mba_gran_pct: 10,
            min_cbm_bits: 1,
            shareable_bits: 0,
        }
    }

    fn record(t_ms: u64) -> DecisionRecord {
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
                services: vec![],
                current: plan.clone(),
            },
            plan,
            changes: vec![],
            reasons: BTreeMap::from([(
                "kv".to_string(),
                Reason::new(DecisionPath::Feedback, "hold"),
            )]),
            apply: None,
            decision_us: 1.0,
            predictions: BTreeMap::new(),
            truth: None,
            from_pods: Default::default(),
            control: Default::default(),
        }
    }

    const BIG: LogLimits = LogLimits {
        max_bytes: 1 << 30,
        keep: 5,
    };

    /// Opens `path` as the daemon does and continues it under `header`.
    fn start(path: &Path, header: &LogHeader) -> DecisionLogWriter<RotatingLog> {
        LogFile::open(path, BIG).unwrap().start(header).unwrap()
    }

    fn headers(path: &Path) -> Vec<(usize, LogHeader)> {
        std::fs::read_to_string(path)
            .unwrap()
            .lines()
            .enumerate()
            .filter(|(_, l)| l.starts_with("{\"cohabit_decision_log\""))
            .map(|(i, l)| (i + 1, serde_json::from_str(l).unwrap()))
            .collect()
    }

    #[test]
    fn every_restart_starts_a_segment_with_its_header_so_runs_are_never_paired() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("decisions.jsonl");
        let parties = LogHeader::new("parties", false, host(8));
        start(&path, &parties);
        assert_eq!(headers(&path), vec![(1, parties.clone())]);
        start(&path, &parties);
        assert_eq!(
            headers(&path),
            vec![(1, parties.clone()), (2, parties.clone())],
            "a restart on the same host is a new run"
        );
        let bigger = LogHeader::new("parties", false, host(16));
        start(&path, &bigger);
        let ml = LogHeader::new("ml", false, host(16));
        start(&path, &ml);
        assert_eq!(
            headers(&path),
            vec![
                (1, parties.clone()),
                (2, parties),
                (3, bigger),
                (4, ml.clone())
            ]
        );
        // The reader takes the latest.
        let last = last_header(BufReader::new(File::open(&path).unwrap())).unwrap();
        assert_eq!(last, Some(ml));
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o640);
    }

    #[test]
    fn a_line_cut_short_by_a_crash_is_dropped_before_continuing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("decisions.jsonl");
        let header = LogHeader::new("parties", false, host(8));
        let mut log = start(&path, &header);
        log.write(&record(0)).unwrap();
        drop(log);
        let whole = std::fs::read_to_string(&path).unwrap();
        let mut cut = whole.clone();
        cut.push_str("{\"schema_version\":2,\"policy\":\"par");
        std::fs::write(&path, &cut).unwrap();
        let mut log = start(&path, &header);
        log.write(&record(1)).unwrap();
        drop(log);
        let records: Vec<_> =
            DecisionLogReader::new(File::open(&path).map(BufReader::new).unwrap())
                .collect::<Result<_, _>>()
                .unwrap();
        assert_eq!(records.len(), 2);
        assert_eq!(
            headers(&path).len(),
            2,
            "the restart's segment has its header"
        );
        // A version-1 line cut short: the whole file is that line, so a new log starts.
        std::fs::write(&path, "{\"schema_version\":1,\"policy\":\"par").unwrap();
        start(&path, &header);
        assert_eq!(headers(&path), vec![(1, header)]);
    }

    #[test]
    fn a_log_from_a_newer_version_is_not_continued() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("decisions.jsonl");
        std::fs::write(&path, "{\"cohabit_decision_log\":99}\n").unwrap();
        let e = LogFile::open(&path, BIG)
            .unwrap()
            .start(&LogHeader::new("parties", false, host(8)))
            .unwrap_err();
        let msg = format!("{e:#}");
        assert!(
            msg.contains("move it aside") && msg.contains("version 99"),
            "{msg}"
        );
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "{\"cohabit_decision_log\":99}\n"
        );
    }

    #[test]
    fn rotation_at_the_size_limit_keeps_n_files_each_with_its_header() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("decisions.jsonl");
        let header = LogHeader::new("parties", false, host(8));
        let line_len = serde_json::to_string(&record(0)).unwrap().len() as u64 + 1;
        let header_len = serde_json::to_string(&header).unwrap().len() as u64 + 1;
        // Room for the header and three records per file.
        let limits = LogLimits {
            max_bytes: header_len + 3 * line_len + 10,
            keep: 2,
        };
        let mut log = LogFile::open(&path, limits)
            .unwrap()
            .start(&header)
            .unwrap();
        for t in 0..20 {
            log.write(&record(t)).unwrap();
        }
        drop(log);
        let mut names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(
            names,
            ["decisions.jsonl", "decisions.jsonl.1", "decisions.jsonl.2"]
        );
        let read = |p: &Path| -> (Option<LogHeader>, Vec<u64>) {
            let mut r = DecisionLogReader::new(BufReader::new(File::open(p).unwrap()));
            let ts = r
                .by_ref()
                .map(|rec| rec.unwrap().observation.t_ms)
                .collect();
            (r.header().cloned(), ts)
        };
        assert_eq!(read(&path), (Some(header.clone()), vec![18, 19]));
        assert_eq!(
            read(&dir.path().join("decisions.jsonl.1")),
            (Some(header.clone()), vec![15, 16, 17])
        );
        assert_eq!(
            read(&dir.path().join("decisions.jsonl.2")),
            (Some(header.clone()), vec![12, 13, 14])
        );
        for n in ["decisions.jsonl", "decisions.jsonl.1", "decisions.jsonl.2"] {
            let len = std::fs::metadata(dir.path().join(n)).unwrap().len();
            assert!(len <= limits.max_bytes, "{n}: {len}");
        }
        // A full log at start is rotated before anything is written.
        let mut log = LogFile::open(
            &path,
            LogLimits {
                max_bytes: header_len,
                keep: 2,
            },
        )
        .unwrap()
        .start(&header)
        .unwrap();
        assert_eq!(read(&path), (Some(header.clone()), vec![]));
        assert_eq!(read(&dir.path().join("decisions.jsonl.1")).1, vec![18, 19]);
        // A line larger than the limit still goes in a file of its own.
        log.write(&record(30)).unwrap();
        log.write(&record(31)).unwrap();
        assert_eq!(read(&path).1, vec![31]);
        assert_eq!(read(&dir.path().join("decisions.jsonl.1")).1, vec![30]);
    }

    #[test]
    fn keep_zero_keeps_no_old_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("decisions.jsonl");
        let header = LogHeader::new("parties", false, host(8));
        let mut log = LogFile::open(
            &path,
            LogLimits {
                max_bytes: 1,
                keep: 0,
            },
        )
        .unwrap()
        .start(&header)
        .unwrap();
        log.write(&record(0)).unwrap();
        log.write(&record(1)).unwrap();
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
        assert_eq!(headers(&path).len(), 1);
    }

    #[test]
    fn a_symlink_at_the_log_path_stops_the_start() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("shadow");
        std::fs::write(&target, "root:x:0:0\n").unwrap();
        let path = dir.path().join("decisions.jsonl");
        std::os::unix::fs::symlink(&target, &path).unwrap();
        let e = LogFile::open(&path, BIG).unwrap_err();
        let msg = format!("{e:#}");
        assert!(
            msg.contains("symbolic link") && msg.contains("decisions.jsonl"),
            "{msg}"
        );
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "root:x:0:0\n");
    }

    #[test]
    fn a_log_whose_parent_or_an_ancestor_is_a_symlink_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        // Root's private directory, and a link to it where the log is configured.
        let real = dir.path().join("etc");
        std::fs::create_dir_all(real.join("sub")).unwrap();
        let link = dir.path().join("log");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        for path in [
            link.join("decisions.jsonl"),
            link.join("sub/decisions.jsonl"),
        ] {
            let e = LogFile::open(&path, BIG).unwrap_err();
            let msg = format!("{e:#}");
            assert!(
                msg.contains("a symbolic link in the path")
                    && msg.contains(&link.display().to_string()),
                "{msg}"
            );
        }
        assert!(!real.join("decisions.jsonl").exists());
        assert!(!real.join("sub/decisions.jsonl").exists());

        // A directory swapped for a link while the daemon runs: rotation refuses it.
        let logs = dir.path().join("logs");
        std::fs::create_dir(&logs).unwrap();
        let path = logs.join("decisions.jsonl");
        let tiny = LogLimits {
            max_bytes: 1,
            keep: 2,
        };
        let header = LogHeader::new("parties", false, host(8));
        let mut w = LogFile::open(&path, tiny).unwrap().start(&header).unwrap();
        w.write(&record(0)).unwrap();
        std::fs::rename(&logs, dir.path().join("logs.old")).unwrap();
        std::os::unix::fs::symlink(&real, &logs).unwrap();
        // The next line needs a new file: the walk meets the link.
        assert!(w.write(&record(1)).is_err());
        assert!(!real.join("decisions.jsonl").exists());
        assert!(!real.join("decisions.jsonl.1").exists());
    }

    #[test]
    fn a_log_directory_others_can_write_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let shared = dir.path().join("log");
        std::fs::create_dir(&shared).unwrap();
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let e = LogFile::open(&shared.join("decisions.jsonl"), BIG).unwrap_err();
        let msg = format!("{e:#}");
        assert!(
            msg.contains(&shared.display().to_string()) && msg.contains("1777"),
            "{msg}"
        );
        assert!(!shared.join("decisions.jsonl").exists());
        // A missing directory is created, private.
        let fresh = dir.path().join("new/decisions.jsonl");
        LogFile::open(&fresh, BIG).unwrap();
        let mode = std::fs::metadata(dir.path().join("new"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o750);
    }

    #[test]
    fn the_file_ends_in_whole_lines_only() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x");
        std::fs::write(&path, "a\nbc\nde").unwrap();
        let f = File::open(&path).unwrap();
        assert_eq!(whole_lines_len(&f, 7).unwrap(), 5);
        assert_eq!(whole_lines_len(&f, 5).unwrap(), 5);
        assert_eq!(whole_lines_len(&f, 1).unwrap(), 0);
        assert_eq!(whole_lines_len(&f, 0).unwrap(), 0);
    }

    fn header_line(h: &LogHeader) -> String {
        String::from_utf8(DecisionLogWriter::new(Vec::new(), h).unwrap().into_inner()).unwrap()
    }

    fn record_line(t_ms: u64, why: &str) -> String {
        let mut r = record(t_ms);
        r.reasons = BTreeMap::from([("kv".to_string(), Reason::new(DecisionPath::Feedback, why))]);
        format!("{}\n", serde_json::to_string(&r).unwrap())
    }

    /// A log of several megabytes, two runs, its last lines records that mention the
    /// header's key (one longer than a block): read from the end at any block size, the
    /// last header is the one reading the whole log finds.
    #[test]
    fn the_last_header_read_from_the_end_is_the_one_a_whole_read_finds() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("decisions.jsonl");
        let first = LogHeader::new("parties", false, host(8));
        let last = LogHeader::new("ml", false, host(16));
        let mut text = header_line(&first);
        for t in 0..8_000 {
            text.push_str(&record_line(t, "hold"));
        }
        text.push_str(&header_line(&last));
        for t in 0..8_000 {
            text.push_str(&record_line(t, "hold"));
        }
        text.push_str(&record_line(1, "\"cohabit_decision_log\":99 in a reason"));
        text.push_str(&record_line(2, &"cohabit_decision_log ".repeat(8_000)));
        assert!(text.len() > 4 << 20, "{}", text.len());
        std::fs::write(&path, &text).unwrap();
        let file = File::open(&path).unwrap();
        let len = text.len() as u64;
        let whole = last_header(BufReader::new(File::open(&path).unwrap())).unwrap();
        assert_eq!(whole, Some(last.clone()));
        assert_eq!(last_header_from_end(&file, len).unwrap(), whole);
        // Small logs at block sizes that cut every line somewhere.
        let small = format!(
            "{}{}{}{}",
            header_line(&first),
            record_line(1, "hold"),
            header_line(&last),
            record_line(2, "cohabit_decision_log")
        );
        std::fs::write(&path, &small).unwrap();
        let file = File::open(&path).unwrap();
        for block in [1, 2, 3, 7, 64, 100, 1000, 1 << 20] {
            assert_eq!(
                last_header_from_end_by(&file, small.len() as u64, block).unwrap(),
                Some(last.clone()),
                "block {block}"
            );
        }
        // Only the first run's header: found at the file's first byte.
        let one = format!("{}{}", header_line(&first), record_line(1, "hold"));
        std::fs::write(&path, &one).unwrap();
        let file = File::open(&path).unwrap();
        for block in [1, 5, 1 << 20] {
            assert_eq!(
                last_header_from_end_by(&file, one.len() as u64, block).unwrap(),
                Some(first.clone())
            );
        }
        // No header (a version-1 log) or nothing at all.
        let v1 = record_line(1, "hold");
        std::fs::write(&path, &v1).unwrap();
        let file = File::open(&path).unwrap();
        assert_eq!(
            last_header_from_end_by(&file, v1.len() as u64, 7).unwrap(),
            None
        );
        assert_eq!(last_header_from_end(&file, 0).unwrap(), None);
    }

    /// A last header from a newer version, or a broken one, stops the start as reading the
    /// whole log did, naming its line.
    #[test]
    fn a_last_header_of_another_version_is_handled_as_before() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("decisions.jsonl");
        let ours = LogHeader::new("parties", false, host(8));
        let mut text = header_line(&ours);
        for t in 0..3_000 {
            text.push_str(&record_line(t, "hold"));
        }
        text.push_str("{\"cohabit_decision_log\":99}\n");
        text.push_str(&record_line(1, "hold"));
        std::fs::write(&path, &text).unwrap();
        let whole = last_header(BufReader::new(File::open(&path).unwrap())).unwrap_err();
        let file = File::open(&path).unwrap();
        let e = last_header_from_end(&file, text.len() as u64).unwrap_err();
        assert_eq!(e.to_string(), whole.to_string());
        assert!(whole.to_string().contains("line 3002"), "{whole}");
        let Err(e) = LogFile::open(&path, BIG).unwrap().start(&ours) else {
            panic!("a newer last header stops the start");
        };
        let msg = format!("{e:#}");
        assert!(
            msg.contains("move it aside")
                && msg.contains("version 99")
                && msg.contains("line 3002"),
            "{msg}"
        );
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            text,
            "left as it was"
        );
        // A broken last header.
        let broken = format!(
            "{}{{\"cohabit_decision_log\":\"two\"}}\n",
            header_line(&ours)
        );
        std::fs::write(&path, &broken).unwrap();
        let whole = last_header(BufReader::new(File::open(&path).unwrap())).unwrap_err();
        let file = File::open(&path).unwrap();
        let e = last_header_from_end_by(&file, broken.len() as u64, 5).unwrap_err();
        assert_eq!(e.to_string(), whole.to_string());
        // An older run's header last (another policy): continued under a new header.
        let older = LogHeader::new("static", false, host(4));
        let text = format!("{}{}", header_line(&older), record_line(1, "hold"));
        std::fs::write(&path, &text).unwrap();
        start(&path, &ours);
        assert_eq!(headers(&path), vec![(1, older), (3, ours)]);
    }
}
