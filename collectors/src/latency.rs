//! Per-service tail latency: scraped from a Prometheus histogram, or pushed by the service.
//!
//! - [`PromHistogram`]: parses the text exposition format, keeps the cumulative buckets of
//!   one histogram as read, and computes the p99 of the requests *between two scrapes* from
//!   the bucket differences (linear interpolation inside the bucket, as Prometheus'
//!   `histogram_quantile` does). A counter reset (any bucket going down) makes the current
//!   buckets the difference; buckets present in only one scrape are ignored.
//! - [`PushListener`]: a loopback UDP or Unix datagram socket on which a service sends
//!   latencies, one per line, in microseconds. A thread records them in an HDR histogram;
//!   each tick takes the p99, the count and the histogram, and starts afresh.
//!
//! Both hand out each interval's requests as a histogram too ([`PromInterval`],
//! [`PushWindow::hist`]), which a [`crate::window::MergedWindow`] merges over several
//! intervals.
//!
//! What a scrape or a sender can do to the daemon is bounded:
//!
//! - **Scrapes.** One line is read in O(1) apart from a map of at most [`MAX_BOUNDS`]
//!   bounds; two scrapes are compared by one merge over their sorted bounds. A line that
//!   cannot be read is skipped and counted; a value that can be read but cannot be a count
//!   or a bound (NaN, infinite, negative) fails the histogram, as does a p99 ≤ 0. Redirects
//!   are not followed, and each scrape ends by a deadline the caller gives (the tick's
//!   collection budget; the daemon scrapes every endpoint at once, each with that whole
//!   budget, so one that hangs costs no other its scrape). [`PromHistogram`] is `Sync`:
//!   [`PromHistogram::fetch`] may run on another thread than the ingestion.
//! - **Unix push sockets** are authenticated: the kernel attaches the sender's pid, uid and
//!   gid to each datagram (`SO_PASSCRED`, `SCM_CREDENTIALS`), and a datagram is accepted
//!   only from one of the service's processes (the set the daemon passes each tick,
//!   [`PushListener::set_pids`]) or from a configured uid or gid ([`UnixAccess`]). The
//!   socket file gets its owner, group and mode ([`DEFAULT_MODE`]) right after bind, in a
//!   directory no other user can write, so nobody can swap it in between. A path that
//!   already exists is removed only when it is a stale socket (one that refuses a
//!   connection); a live socket or any other file is an error. On drop the file is removed
//!   only if it is still the socket this listener bound, and the socket is shut down first,
//!   which wakes the thread at once: dropping a listener (as the daemon does inside its
//!   tick when a pod's source changes) does not wait for the thread's read time-out.
//! - **UDP** cannot tell senders apart: any local user (or container sharing the host's
//!   network) can send. The configuration must say `unauthenticated = true` to use it.
//! - **Floods.** A datagram cut by the kernel (`MSG_TRUNC`) is dropped whole, not read as a
//!   shorter number. A window keeps at most [`MAX_SAMPLES_PER_WINDOW`] samples, and the
//!   thread reads at most [`MAX_DATAGRAMS_PER_S`] datagrams a second (more wait in the
//!   socket buffer, which the kernel bounds). Every refusal is counted by reason
//!   ([`PushRejections`]).

use std::collections::btree_map::Entry;
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::io::{self, IoSliceMut};
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use nix::errno::Errno;
use nix::sys::socket::{
    recvmsg, setsockopt, sockopt, ControlMessageOwned, MsgFlags, UnixCredentials,
};

/// Why a latency source could not be read.
#[derive(Debug, thiserror::Error)]
pub enum LatencyError {
    /// The endpoint did not answer, or answered with an error.
    #[error("scraping {url}: {detail}")]
    Scrape {
        /// Where.
        url: String,
        /// What happened.
        detail: String,
    },
    /// The exposition text did not hold the histogram.
    #[error("histogram {metric} not found in the scrape of {url}")]
    Missing {
        /// Metric name.
        metric: String,
        /// Where.
        url: String,
    },
    /// The histogram was there but cannot be a latency distribution.
    #[error("histogram {metric} in the scrape of {url}: {detail}")]
    Invalid {
        /// Metric name.
        metric: String,
        /// Where.
        url: String,
        /// What is wrong with it.
        detail: String,
    },
    /// The socket could not be bound.
    #[error("binding latency socket {addr}: {source}")]
    Bind {
        /// Address or path.
        addr: String,
        /// OS error.
        source: io::Error,
    },
}

/// Cumulative buckets of one histogram at one scrape: upper bound → count, in increasing
/// bound order. The `+Inf` bucket is stored under `f64::INFINITY`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Buckets(pub Vec<(f64, f64)>);

/// Most distinct bucket bounds a histogram may have (Prometheus clients use tens).
pub const MAX_BOUNDS: usize = 1024;

/// One histogram as a scrape held it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Parsed {
    /// Its buckets, summed over the series that differ in other labels.
    pub buckets: Buckets,
    /// `_bucket` lines of the metric that could not be read, skipped.
    pub bad_lines: u64,
}

/// Why a scrape's histogram cannot be used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum HistogramError {
    /// No readable `_bucket` line.
    #[error("no bucket found")]
    Missing,
    /// More distinct bounds than [`MAX_BOUNDS`].
    #[error("more than {MAX_BOUNDS} distinct bucket bounds")]
    TooManyBounds,
    /// A bound or a count that is NaN, infinite or negative.
    #[error("line {line}: {what}")]
    BadValue {
        /// 1-based line number in the scrape.
        line: usize,
        /// What is wrong.
        what: String,
    },
}

/// The `le` label and the value of one `<metric>_bucket{…} value [timestamp]` line (`rest`
/// starts at `{`); `None` when the line cannot be read. Label values are quoted and may
/// hold `,`, `}`, `=`, `{` and the escapes `\\`, `\"`, `\n`.
fn bucket_line(rest: &str) -> Option<(String, &str)> {
    let s = rest.strip_prefix('{')?;
    let b = s.as_bytes();
    let skip_ws = |i: &mut usize| {
        while b.get(*i).is_some_and(u8::is_ascii_whitespace) {
            *i += 1;
        }
    };
    let mut i = 0;
    let mut le = None;
    loop {
        skip_ws(&mut i);
        if b.get(i) == Some(&b'}') {
            break;
        }
        let start = i;
        while b
            .get(i)
            .is_some_and(|c| c.is_ascii_alphanumeric() || *c == b'_')
        {
            i += 1;
        }
        if i == start {
            return None;
        }
        let is_le = &s[start..i] == "le";
        skip_ws(&mut i);
        if b.get(i) != Some(&b'=') {
            return None;
        }
        i += 1;
        skip_ws(&mut i);
        if b.get(i) != Some(&b'"') {
            return None;
        }
        i += 1;
        // The value, up to the closing quote; every byte compared is ASCII, so each slice
        // ends on a character boundary.
        let mut value = String::new();
        let mut seg = i;
        loop {
            match *b.get(i)? {
                b'"' => {
                    if is_le {
                        value.push_str(&s[seg..i]);
                    }
                    i += 1;
                    break;
                }
                b'\\' => {
                    let unescaped = match *b.get(i + 1)? {
                        b'n' => '\n',
                        b'\\' => '\\',
                        b'"' => '"',
                        _ => return None,
                    };
                    if is_le {
                        value.push_str(&s[seg..i]);
                        value.push(unescaped);
                    }
                    i += 2;
                    seg = i;
                }
                _ => i += 1,
            }
        }
        if is_le {
            le = Some(value);
        }
        skip_ws(&mut i);
        match *b.get(i)? {
            b',' => i += 1,
            b'}' => break,
            _ => return None,
        }
    }
    let value = s[i + 1..].split_whitespace().next()?;
    Some((le?, value))
}

/// Extracts the buckets of histogram `metric` from exposition text, summing series that
/// differ in other labels. Lines that cannot be read are skipped and counted; a bound or
/// count that is not a finite number ≥ 0 (`+Inf` as a bound aside) is an error, since the
/// histogram it belongs to is then wrong, not just incomplete.
pub fn parse_buckets(text: &str, metric: &str) -> Result<Parsed, HistogramError> {
    // Non-negative doubles order like their bit patterns, +Inf last: the map is sorted
    // by bound.
    let mut by_le: BTreeMap<u64, f64> = BTreeMap::new();
    let mut bad_lines = 0u64;
    for (i, line) in text.lines().map(str::trim).enumerate() {
        let Some(rest) = line
            .strip_prefix(metric)
            .and_then(|r| r.strip_prefix("_bucket"))
        else {
            continue;
        };
        if !(rest.starts_with('{') || rest.starts_with(char::is_whitespace)) {
            continue; // another metric with a longer name
        }
        let Some((le, value)) = bucket_line(rest) else {
            bad_lines += 1;
            continue;
        };
        let bad = |what: String| HistogramError::BadValue { line: i + 1, what };
        let bound = if le == "+Inf" {
            f64::INFINITY
        } else {
            match le.parse::<f64>() {
                Ok(b) if b.is_finite() && b >= 0.0 => b + 0.0, // -0 → +0
                Ok(b) => {
                    return Err(bad(format!(
                        "bucket bound le={b} is not a finite number >= 0"
                    )))
                }
                Err(_) => {
                    bad_lines += 1;
                    continue;
                }
            }
        };
        let count = match value.parse::<f64>() {
            Ok(c) if c.is_finite() && c >= 0.0 => c,
            Ok(c) => return Err(bad(format!("bucket count {c} is not a finite number >= 0"))),
            Err(_) => {
                bad_lines += 1;
                continue;
            }
        };
        let full = by_le.len() >= MAX_BOUNDS;
        match by_le.entry(bound.to_bits()) {
            Entry::Occupied(mut sum) => *sum.get_mut() += count,
            Entry::Vacant(_) if full => return Err(HistogramError::TooManyBounds),
            Entry::Vacant(e) => {
                e.insert(count);
            }
        }
    }
    if by_le.is_empty() {
        return Err(HistogramError::Missing);
    }
    let buckets = by_le
        .into_iter()
        .map(|(bits, count)| (f64::from_bits(bits), count))
        .collect();
    Ok(Parsed {
        buckets: Buckets(buckets),
        bad_lines,
    })
}

/// The requests per bucket between two scrapes, both in increasing bound order: one merge
/// over the two lists, so each bucket is looked at once. Bounds present in only one scrape
/// are left out. `None` when a counter went down (a reset).
fn difference<'a>(
    prev: impl IntoIterator<Item = &'a (f64, f64)>,
    cur: impl IntoIterator<Item = &'a (f64, f64)>,
) -> Option<Vec<(f64, f64)>> {
    let mut prev = prev.into_iter().peekable();
    let mut out = Vec::new();
    for &(bound, count) in cur {
        while prev.next_if(|(pb, _)| *pb < bound).is_some() {}
        if let Some(&(_, pc)) = prev.next_if(|(pb, _)| *pb == bound) {
            if count < pc {
                return None;
            }
            out.push((bound, count - pc));
        }
    }
    Some(out)
}

/// The requests counted between scrapes `prev` and `cur`, as cumulative buckets: the
/// difference bound by bound (bounds present in only one scrape are left out), or `cur`
/// whole when there is no `prev` or a counter went down (a reset: the service started
/// counting afresh, so its current counts are the requests since).
pub fn interval_between(prev: Option<&Buckets>, cur: &Buckets) -> Buckets {
    Buckets(
        prev.and_then(|p| difference(&p.0, &cur.0))
            .unwrap_or_else(|| cur.0.clone()),
    )
}

/// The `q` quantile of the requests counted between `prev` and `cur`, in the histogram's
/// unit, and how many requests that was. `None` when no request arrived.
pub fn quantile_between(prev: Option<&Buckets>, cur: &Buckets, q: f64) -> Option<(f64, f64)> {
    let delta = interval_between(prev, cur).0;
    let total = delta.last().map_or(0.0, |(_, c)| *c);
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let mut lower = (0.0, 0.0);
    for &(bound, count) in &delta {
        if count >= rank {
            if bound.is_infinite() {
                // Prometheus' convention: the highest finite bound.
                return Some((lower.0, total));
            }
            let in_bucket = count - lower.1;
            let frac = if in_bucket > 0.0 {
                (rank - lower.1) / in_bucket
            } else {
                1.0
            };
            return Some((lower.0 + (bound - lower.0) * frac, total));
        }
        lower = (bound, count);
    }
    Some((lower.0, total))
}

/// The requests one scrape of a Prometheus histogram counted since the previous scrape.
#[derive(Debug, Clone, PartialEq)]
pub struct PromInterval {
    /// Their cumulative buckets, in the histogram's unit ([`interval_between`]).
    pub buckets: Buckets,
    /// How many requests there were (the last bucket's count; 0 when none).
    pub count: f64,
}

/// A Prometheus histogram scraped over HTTP.
#[derive(Debug)]
pub struct PromHistogram {
    url: String,
    metric: String,
    to_ms: f64,
    timeout: Duration,
    agent: ureq::Agent,
    last: Option<Buckets>,
    bad_lines: u64,
}

impl PromHistogram {
    /// Scrapes `url` for histogram `metric` whose unit is `unit_seconds` seconds (1.0 for a
    /// `_seconds` histogram, 0.001 for milliseconds), each scrape taking at most `timeout`.
    pub fn new(url: &str, metric: &str, unit_seconds: f64, timeout: Duration) -> Self {
        Self {
            url: url.into(),
            metric: metric.into(),
            to_ms: unit_seconds * 1000.0,
            timeout,
            // A redirect could point the root daemon anywhere: answer it with an error.
            agent: ureq::AgentBuilder::new().redirects(0).build(),
            last: None,
            bad_lines: 0,
        }
    }

    fn scrape_error(&self, detail: String) -> LatencyError {
        LatencyError::Scrape {
            url: self.url.clone(),
            detail,
        }
    }

    /// Milliseconds per unit of the histogram's bounds (what a window over its intervals
    /// multiplies by).
    pub fn ms_per_unit(&self) -> f64 {
        self.to_ms
    }

    /// Scrapes once, finishing by `deadline` at the latest (the tick's collection budget),
    /// and returns the p99 (ms) and the requests since the previous scrape.
    /// The first scrape only sets the baseline (`Ok(None)`).
    pub fn poll(&mut self, deadline: Instant) -> Result<Option<(f64, f64)>, LatencyError> {
        let text = self.fetch(deadline)?;
        self.ingest(&text)
    }

    /// Like [`Self::poll`], but returns the requests since the previous scrape as buckets
    /// ([`Self::ingest_interval`]), to be merged with other intervals'.
    pub fn poll_interval(
        &mut self,
        deadline: Instant,
    ) -> Result<Option<PromInterval>, LatencyError> {
        let text = self.fetch(deadline)?;
        self.ingest_interval(&text)
    }

    /// The exposition text at the URL, fetched by `deadline` (and within the time-out),
    /// for [`Self::ingest_interval`]: the network half of [`Self::poll_interval`], which
    /// needs only `&self`, so that several endpoints can be fetched at once.
    pub fn fetch(&self, deadline: Instant) -> Result<String, LatencyError> {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(self.scrape_error("no time left in this tick's collection budget".into()));
        }
        let resp = self
            .agent
            .get(&self.url)
            .timeout(self.timeout.min(left))
            .call()
            .map_err(|e| self.scrape_error(e.to_string()))?;
        if resp.status() != 200 {
            return Err(self.scrape_error(format!(
                "answered {} {} (redirects are not followed)",
                resp.status(),
                resp.status_text()
            )));
        }
        resp.into_string()
            .map_err(|e| self.scrape_error(e.to_string()))
    }

    /// Like [`Self::poll`] with exposition text already fetched.
    pub fn ingest(&mut self, text: &str) -> Result<Option<(f64, f64)>, LatencyError> {
        Ok(self.ingest_interval(text)?.and_then(|i| {
            quantile_between(None, &i.buckets, 0.99).map(|(p99, n)| (p99 * self.to_ms, n))
        }))
    }

    /// Reads one scrape's text and returns the requests since the previous scrape (see
    /// [`interval_between`]; after a counter reset, those since the reset), with no
    /// request as a count of 0. The first scrape only sets the baseline (`Ok(None)`). An
    /// interval whose own p99 is not a positive latency is an error.
    pub fn ingest_interval(&mut self, text: &str) -> Result<Option<PromInterval>, LatencyError> {
        let invalid = |detail: String| LatencyError::Invalid {
            metric: self.metric.clone(),
            url: self.url.clone(),
            detail,
        };
        let parsed = match parse_buckets(text, &self.metric) {
            Ok(p) => p,
            Err(HistogramError::Missing) => {
                return Err(LatencyError::Missing {
                    metric: self.metric.clone(),
                    url: self.url.clone(),
                })
            }
            Err(e) => return Err(invalid(e.to_string())),
        };
        self.bad_lines = parsed.bad_lines;
        let cur = parsed.buckets;
        let out = self.last.as_ref().map(|prev| {
            let buckets = interval_between(Some(prev), &cur);
            let count = buckets.0.last().map_or(0.0, |(_, c)| *c);
            PromInterval { buckets, count }
        });
        self.last = Some(cur);
        let p99 = out
            .as_ref()
            .and_then(|i| quantile_between(None, &i.buckets, 0.99))
            .map(|(p99, _)| p99 * self.to_ms);
        match p99 {
            Some(p99) if p99.is_nan() || p99 <= 0.0 => Err(invalid(format!(
                "the p99 came out as {p99} ms; a latency must be positive"
            ))),
            _ => Ok(out),
        }
    }

    /// Lines of the metric the last scrape held but that could not be read.
    pub fn bad_lines(&self) -> u64 {
        self.bad_lines
    }
}

/// Where a push listener receives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PushAddr {
    /// A UDP address; only loopback is accepted, and no sender is authenticated.
    Udp(SocketAddr),
    /// A Unix datagram socket path; senders are authenticated ([`UnixAccess`]).
    Unix(PathBuf),
}

/// The default permission bits of a Unix push socket: owner and group may send.
pub const DEFAULT_MODE: u32 = 0o660;

/// Who may reach a Unix push socket and whose datagrams count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnixAccess {
    /// Owner of the socket file (`None`: the daemon's uid).
    pub owner: Option<u32>,
    /// Group of the socket file (`None`: the daemon's gid).
    pub group: Option<u32>,
    /// Permission bits of the socket file; sending needs write permission.
    pub mode: u32,
    /// Senders accepted whatever their pid, by uid (a sidecar, a load generator).
    pub allowed_uids: BTreeSet<u32>,
    /// Senders accepted whatever their pid, by gid.
    pub allowed_gids: BTreeSet<u32>,
}

impl Default for UnixAccess {
    fn default() -> Self {
        Self {
            owner: None,
            group: None,
            mode: DEFAULT_MODE,
            allowed_uids: BTreeSet::new(),
            allowed_gids: BTreeSet::new(),
        }
    }
}

/// Most samples one window keeps; later ones are refused as over the cap.
pub const MAX_SAMPLES_PER_WINDOW: u64 = 100_000;
/// Most datagrams read per second; later ones wait in the socket buffer.
pub const MAX_DATAGRAMS_PER_S: u32 = 20_000;
/// Receive buffer: a datagram longer than this is cut by the kernel and dropped.
const BUF_BYTES: usize = 64 * 1024;

/// Pushed latencies refused in one window, by reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PushRejections {
    /// Datagrams whose sender is neither one of the service's processes nor an allowed uid
    /// or gid (Unix sockets only).
    pub credentials: u64,
    /// Lines that were not a latency.
    pub malformed: u64,
    /// Datagrams longer than the receive buffer, dropped whole.
    pub truncated: u64,
    /// Samples beyond [`MAX_SAMPLES_PER_WINDOW`].
    pub over_cap: u64,
}

impl PushRejections {
    /// All refusals together.
    pub fn total(&self) -> u64 {
        self.credentials + self.malformed + self.truncated + self.over_cap
    }
}

impl std::ops::AddAssign for PushRejections {
    fn add_assign(&mut self, o: Self) {
        self.credentials += o.credentials;
        self.malformed += o.malformed;
        self.truncated += o.truncated;
        self.over_cap += o.over_cap;
    }
}

/// One tick of pushed latencies.
#[derive(Debug, Clone, PartialEq)]
pub struct PushWindow {
    /// p99 in milliseconds, if any sample arrived.
    pub p99_ms: Option<f64>,
    /// Samples received.
    pub count: u64,
    /// The samples themselves, in µs, sized to the slowest ([`crate::window::compact`]):
    /// what a [`crate::window::HdrWindow`] merges with other ticks'.
    pub hist: Histogram<u64>,
    /// What was refused, by reason.
    pub rejected: PushRejections,
}

/// The sender of a Unix datagram as the kernel reported it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Sender {
    pid: u32,
    uid: u32,
    gid: u32,
}

/// Whom a listener believes.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Auth {
    /// UDP: anyone who can reach the port (the configuration said so).
    Unauthenticated,
    /// Unix: the service's processes and these uids and gids.
    Credentials {
        uids: BTreeSet<u32>,
        gids: BTreeSet<u32>,
    },
}

impl Auth {
    /// Whether a datagram from `sender` (`None`: the kernel attached no credentials) is
    /// accepted while the service's processes are `pids`.
    fn admits(&self, sender: Option<Sender>, pids: &HashSet<u32>) -> bool {
        match self {
            Auth::Unauthenticated => true,
            Auth::Credentials { uids, gids } => sender.is_some_and(|s| {
                pids.contains(&s.pid) || uids.contains(&s.uid) || gids.contains(&s.gid)
            }),
        }
    }
}

#[derive(Debug)]
struct Shared {
    hist: Histogram<u64>,
    rejected: PushRejections,
    /// The service's processes, as the daemon last found them.
    pids: HashSet<u32>,
}

/// Largest latency recorded: one hour in microseconds.
const MAX_US: u64 = 3_600_000_000;

/// Records the latencies of one accepted datagram, up to the window's cap.
fn record(s: &mut Shared, datagram: &[u8]) {
    let lines = datagram
        .split(|b| *b == b'\n')
        .map(<[u8]>::trim_ascii)
        .filter(|l| !l.is_empty());
    for line in lines {
        if s.hist.len() >= MAX_SAMPLES_PER_WINDOW {
            s.rejected.over_cap += 1;
            continue;
        }
        let us = std::str::from_utf8(line)
            .ok()
            .and_then(|l| l.parse::<f64>().ok());
        match us {
            Some(us) if us.is_finite() && us >= 0.0 => {
                let v = cohabit_core::whole(us).clamp(1, MAX_US);
                if s.hist.record(v).is_err() {
                    s.rejected.malformed += 1;
                }
            }
            _ => s.rejected.malformed += 1,
        }
    }
}

/// Paces the receive loop: at most `per_s` datagrams in each one-second window.
#[derive(Debug)]
struct Pacer {
    per_s: u32,
    window_start: Instant,
    seen: u32,
}

impl Pacer {
    fn new(per_s: u32, now: Instant) -> Self {
        Self {
            per_s,
            window_start: now,
            seen: 0,
        }
    }

    /// Counts one datagram about to be read at `now`; `Some(wait)` instead when this
    /// second's budget is spent.
    fn admit(&mut self, now: Instant) -> Option<Duration> {
        let second = Duration::from_secs(1);
        if now.duration_since(self.window_start) >= second {
            self.window_start = now;
            self.seen = 0;
        }
        if self.seen >= self.per_s {
            return Some((self.window_start + second).saturating_duration_since(now));
        }
        self.seen += 1;
        None
    }
}

/// The bound socket the thread reads (shared with the listener, which shuts it down to wake
/// the thread).
#[derive(Debug)]
enum Socket {
    Udp(UdpSocket),
    Unix(UnixDatagram),
}

impl Socket {
    fn raw_fd(&self) -> std::os::fd::RawFd {
        match self {
            Socket::Udp(s) => s.as_raw_fd(),
            Socket::Unix(s) => s.as_raw_fd(),
        }
    }

    /// Shuts both directions down: a thread blocked receiving returns at once (Linux wakes
    /// the readers of a datagram socket shut down, connected or not), and every later
    /// receive returns at once.
    fn shut_down(&self) {
        let _ = nix::sys::socket::shutdown(self.raw_fd(), nix::sys::socket::Shutdown::Both);
    }
}

/// One datagram as received: its length, whether the kernel cut it, and its sender.
fn receive(
    sock: &Socket,
    buf: &mut [u8],
    cmsg: &mut Vec<u8>,
) -> nix::Result<(usize, bool, Option<Sender>)> {
    let mut iov = [IoSliceMut::new(buf)];
    let want_creds = matches!(sock, Socket::Unix(_));
    let msg = recvmsg::<()>(
        sock.raw_fd(),
        &mut iov,
        want_creds.then_some(cmsg.as_mut_slice()),
        MsgFlags::empty(),
    )?;
    let truncated = msg.flags.contains(MsgFlags::MSG_TRUNC);
    let sender = msg.cmsgs().ok().and_then(|mut c| {
        c.find_map(|m| match m {
            ControlMessageOwned::ScmCredentials(cred) => Some(cred),
            _ => None,
        })
    });
    let sender = sender.and_then(|c: UnixCredentials| {
        Some(Sender {
            pid: u32::try_from(c.pid()).ok()?,
            uid: c.uid(),
            gid: c.gid(),
        })
    });
    Ok((msg.bytes, truncated, sender))
}

/// The receive loop: until `stop`, one datagram at a time, paced.
fn serve(sock: &Socket, auth: &Auth, shared: &Mutex<Shared>, stop: &AtomicBool) {
    let mut buf = vec![0u8; BUF_BYTES];
    let mut cmsg = nix::cmsg_space!(UnixCredentials);
    let mut pacer = Pacer::new(MAX_DATAGRAMS_PER_S, Instant::now());
    while !stop.load(Ordering::Relaxed) {
        if let Some(wait) = pacer.admit(Instant::now()) {
            std::thread::sleep(wait.min(Duration::from_millis(100)));
            continue;
        }
        match receive(sock, &mut buf, &mut cmsg) {
            // Shut down by the listener's drop.
            Ok((0, ..)) if stop.load(Ordering::Relaxed) => break,
            Ok((n, truncated, sender)) => {
                let mut s = shared
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                if !auth.admits(sender, &s.pids) {
                    s.rejected.credentials += 1;
                } else if truncated {
                    s.rejected.truncated += 1;
                } else {
                    record(&mut s, &buf[..n.min(buf.len())]);
                }
            }
            // The read time-out (so that `stop` is seen) or a signal.
            Err(Errno::EAGAIN | Errno::EINTR) => {}
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// Receives latency samples (µs, one per line) pushed by a service.
#[derive(Debug)]
pub struct PushListener {
    shared: Arc<Mutex<Shared>>,
    stop: Arc<AtomicBool>,
    /// The socket the thread reads, shut down on drop to wake it.
    sock: Arc<Socket>,
    thread: Option<JoinHandle<()>>,
    /// The socket file and its identity (device, inode), for Unix sockets.
    file: Option<(PathBuf, (u64, u64))>,
    /// Where it listens (the bound port for `127.0.0.1:0`).
    pub local: PushAddr,
}

fn bind_error(addr: &PushAddr) -> impl Fn(io::Error) -> LatencyError + '_ {
    move |source| LatencyError::Bind {
        addr: match addr {
            PushAddr::Udp(a) => a.to_string(),
            PushAddr::Unix(p) => p.display().to_string(),
        },
        source,
    }
}

/// Refuses a socket directory another user could write: they could swap the socket for a
/// symbolic link between bind and chmod, and have root change the mode of any file. A
/// directory with the sticky bit (such as `/tmp`) is safe: only the owner of an entry may
/// rename or remove it.
fn check_dir(path: &Path) -> io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let meta = std::fs::metadata(dir)?;
    let me = nix::unistd::geteuid().as_raw();
    let writable_by_others = meta.mode() & 0o022 != 0 && meta.mode() & 0o1000 == 0;
    if (meta.uid() != 0 && meta.uid() != me) || writable_by_others {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "the directory {} can be written by users other than root (owner uid {}, mode {:o}); use a directory only root can write, such as /run/cohabit",
                dir.display(),
                meta.uid(),
                meta.mode() & 0o7777
            ),
        ));
    }
    Ok(())
}

/// Makes way for binding `path`: nothing there is fine, and a stale socket (one that
/// refuses a connection: its listener is gone) is removed. A live socket (another
/// listener, perhaps another cohabit) or anything that is not a socket is left alone and
/// is an error.
fn clear_stale(path: &Path) -> io::Result<()> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    if !meta.file_type().is_socket() {
        return Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            "the path exists and is not a socket; not removing it",
        ));
    }
    match UnixDatagram::unbound()?.connect(path) {
        Ok(()) => Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            "the socket is in use by a live listener",
        )),
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => std::fs::remove_file(path),
        Err(e) => Err(io::Error::new(
            e.kind(),
            format!("a socket is there and cannot be probed ({e}); not removing it"),
        )),
    }
}

/// The identity (device, inode) of the socket file at `path`, if a socket is there.
fn socket_identity(path: &Path) -> Option<(u64, u64)> {
    std::fs::symlink_metadata(path)
        .ok()
        .filter(|m| m.file_type().is_socket())
        .map(|m| (m.dev(), m.ino()))
}

/// Binds a Unix datagram socket at `path` with the owner, group and mode of `access`,
/// receiving its senders' credentials. Returns it with the file's identity.
fn bind_unix(path: &Path, access: &UnixAccess) -> io::Result<(UnixDatagram, (u64, u64))> {
    if access.mode > 0o777 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("mode {:o} has bits beyond 0777", access.mode),
        ));
    }
    check_dir(path)?;
    clear_stale(path)?;
    let sock = UnixDatagram::bind(path)?;
    let ours = socket_identity(path);
    let set_up = || -> io::Result<(u64, u64)> {
        let id = ours.ok_or_else(|| io::Error::other("the socket file vanished after bind"))?;
        std::os::unix::fs::lchown(path, access.owner, access.group)?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(access.mode))?;
        if socket_identity(path) != Some(id) {
            return Err(io::Error::other("the socket file was replaced after bind"));
        }
        setsockopt(&sock, sockopt::PassCred, &true).map_err(io::Error::from)?;
        sock.set_read_timeout(Some(Duration::from_millis(100)))?;
        Ok(id)
    };
    match set_up() {
        Ok(id) => Ok((sock, id)),
        Err(e) => {
            if ours.is_some() && socket_identity(path) == ours {
                let _ = std::fs::remove_file(path);
            }
            Err(e)
        }
    }
}

impl PushListener {
    /// Binds and starts receiving. `access` applies to Unix sockets: the file's owner,
    /// group and mode, and whose datagrams count besides the service's processes.
    pub fn bind(addr: &PushAddr, access: &UnixAccess) -> Result<Self, LatencyError> {
        let bind_err = bind_error(addr);
        let hist = Histogram::new_with_bounds(1, MAX_US, 3)
            .map_err(|e| bind_err(io::Error::other(e.to_string())))?;
        let (sock, auth, file, local) = match addr {
            PushAddr::Udp(a) => {
                if !a.ip().is_loopback() {
                    return Err(bind_err(io::Error::new(
                        io::ErrorKind::InvalidInput,
                        "only loopback addresses are allowed",
                    )));
                }
                let sock = UdpSocket::bind(a).map_err(&bind_err)?;
                sock.set_read_timeout(Some(Duration::from_millis(100)))
                    .map_err(&bind_err)?;
                let local = PushAddr::Udp(sock.local_addr().map_err(&bind_err)?);
                (Socket::Udp(sock), Auth::Unauthenticated, None, local)
            }
            PushAddr::Unix(p) => {
                let (sock, id) = bind_unix(p, access).map_err(&bind_err)?;
                let auth = Auth::Credentials {
                    uids: access.allowed_uids.clone(),
                    gids: access.allowed_gids.clone(),
                };
                (
                    Socket::Unix(sock),
                    auth,
                    Some((p.clone(), id)),
                    addr.clone(),
                )
            }
        };
        let shared = Arc::new(Mutex::new(Shared {
            hist,
            rejected: PushRejections::default(),
            pids: HashSet::new(),
        }));
        let stop = Arc::new(AtomicBool::new(false));
        let sock = Arc::new(sock);
        let (sh, st, so) = (Arc::clone(&shared), Arc::clone(&stop), Arc::clone(&sock));
        let spawned = std::thread::Builder::new()
            .name("cohabit-latency".into())
            .spawn(move || serve(&so, &auth, &sh, &st));
        let mut listener = Self {
            shared,
            stop,
            sock,
            thread: None,
            file,
            local,
        };
        // On failure, dropping `listener` removes the socket file.
        listener.thread = Some(spawned.map_err(&bind_err)?);
        Ok(listener)
    }

    /// Sets the service's processes, whose datagrams a Unix socket accepts (the daemon
    /// passes them each tick).
    pub fn set_pids(&self, pids: impl IntoIterator<Item = u32>) {
        let mut s = self
            .shared
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        s.pids.clear();
        s.pids.extend(pids);
    }

    /// The samples since the last call; starts a new window.
    pub fn take(&self) -> PushWindow {
        let mut s = self
            .shared
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let count = s.hist.len();
        let p99_ms = (count > 0).then(|| s.hist.value_at_quantile(0.99) as f64 / 1000.0);
        let w = PushWindow {
            p99_ms,
            count,
            hist: crate::window::compact(&s.hist),
            rejected: s.rejected,
        };
        s.hist.reset();
        s.rejected = PushRejections::default();
        w
    }
}

impl Drop for PushListener {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wakes the thread now rather than at its read time-out; the join is then short,
        // and a UDP port is free again when the drop returns.
        self.sock.shut_down();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        // Only the socket this listener bound: a file put there since is not ours.
        if let Some((path, id)) = &self.file {
            if socket_identity(path) == Some(*id) {
                let _ = std::fs::remove_file(path);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::os::unix::process::CommandExt;

    use super::*;

    const SCRAPE: &str = r#"
# HELP http_request_duration_seconds latency
# TYPE http_request_duration_seconds histogram
http_request_duration_seconds_bucket{handler="a",le="0.001"} 50
http_request_duration_seconds_bucket{handler="a",le="0.01"} 90
http_request_duration_seconds_bucket{handler="a",le="0.1"} 100
http_request_duration_seconds_bucket{handler="a",le="+Inf"} 100
http_request_duration_seconds_bucket{handler="b",le="0.001"} 0
http_request_duration_seconds_bucket{handler="b",le="0.01"} 0
http_request_duration_seconds_bucket{handler="b",le="0.1"} 0
http_request_duration_seconds_bucket{handler="b",le="+Inf"} 0
http_request_duration_seconds_count{handler="a"} 100
"#;

    const METRIC: &str = "http_request_duration_seconds";

    #[test]
    fn buckets_sum_across_label_sets_in_bound_order() {
        let p = parse_buckets(SCRAPE, METRIC).unwrap();
        assert_eq!(
            p.buckets.0,
            vec![
                (0.001, 50.0),
                (0.01, 90.0),
                (0.1, 100.0),
                (f64::INFINITY, 100.0)
            ]
        );
        assert_eq!(p.bad_lines, 0);
        assert_eq!(parse_buckets(SCRAPE, "other"), Err(HistogramError::Missing));
        assert_eq!(
            parse_buckets(SCRAPE, "http_request_duration"),
            Err(HistogramError::Missing),
            "a longer metric name is another metric"
        );
    }

    #[test]
    fn label_values_may_hold_braces_commas_and_escapes() {
        let text = concat!(
            "m_bucket{uri=\"/api/{id}\",le=\"0.5\"} 3\n",
            "m_bucket{q=\"a,b=c}\", le = \"0.5\" , } 4 1700000000000\n",
            "m_bucket{msg=\"say \\\"hi\\\" \\\\ \\n\",le=\"+Inf\"} 9 # {trace_id=\"x\"} 0.1\n",
        );
        let p = parse_buckets(text, "m").unwrap();
        assert_eq!(p.buckets.0, vec![(0.5, 7.0), (f64::INFINITY, 9.0)]);
        assert_eq!(p.bad_lines, 0);
        assert_eq!(bucket_line("{le=\"1\"} 2"), Some(("1".to_string(), "2")));
    }

    #[test]
    fn unreadable_lines_are_skipped_and_counted() {
        let text = concat!(
            "m_bucket{le=\"0.5\"} 3\n",
            "m_bucket{le=\"0.5\" 4\n",            // no closing brace
            "m_bucket{le=\"1\"} lots\n",          // not a number
            "m_bucket{handler=\"a\"} 1\n",        // no le
            "m_bucket{le=\"+Inf\",x=\"open} 1\n", // unterminated quote
            "m_bucket 1\n",                       // no labels
            "m_bucket{le=\"+Inf\"} 3\n",
        );
        let p = parse_buckets(text, "m").unwrap();
        assert_eq!(p.buckets.0, vec![(0.5, 3.0), (f64::INFINITY, 3.0)]);
        assert_eq!(p.bad_lines, 5);
    }

    #[test]
    fn non_finite_or_negative_values_fail_the_histogram() {
        for (line, why) in [
            ("m_bucket{le=\"0.5\"} NaN", "count NaN"),
            ("m_bucket{le=\"0.5\"} -1", "count -1"),
            ("m_bucket{le=\"0.5\"} +Inf", "count inf"),
            ("m_bucket{le=\"NaN\"} 1", "le=NaN"),
            ("m_bucket{le=\"-0.5\"} 1", "le=-0.5"),
            ("m_bucket{le=\"-Inf\"} 1", "le=-inf"),
        ] {
            let text = format!("m_bucket{{le=\"+Inf\"}} 1\n{line}\n");
            match parse_buckets(&text, "m") {
                Err(HistogramError::BadValue { line: 2, what }) => {
                    assert!(what.contains(why), "{line}: {what}");
                }
                other => panic!("{line}: {other:?}"),
            }
        }
        let mut h = PromHistogram::new("http://127.0.0.1:1/m", "m", 1.0, Duration::from_secs(1));
        let e = h
            .ingest("m_bucket{le=\"1\"} NaN\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("not a finite number") && e.contains("line 1"),
            "{e}"
        );
    }

    #[test]
    fn more_bounds_than_the_cap_are_refused() {
        let text: String = (0..100_000)
            .map(|i| format!("m_bucket{{le=\"{i}\"}} {i}\n"))
            .collect();
        assert_eq!(
            parse_buckets(&text, "m"),
            Err(HistogramError::TooManyBounds)
        );
        let at_cap: String = (0..MAX_BOUNDS)
            .map(|i| format!("m_bucket{{le=\"{i}\"}} {i}\n"))
            .collect();
        assert_eq!(
            parse_buckets(&at_cap, "m").unwrap().buckets.0.len(),
            MAX_BOUNDS
        );
    }

    #[test]
    fn a_hundred_thousand_bucket_lines_are_compared_in_one_pass() {
        // 100 series of 1000 bounds each: 100 000 lines, 1000 distinct bounds.
        let scrape = |scale: f64| -> String {
            (0..100)
                .flat_map(|series| {
                    (1..=1000).map(move |b| {
                        format!(
                            "m_bucket{{pod=\"p{series}\",le=\"{b}\"}} {}\n",
                            f64::from(b) * scale
                        )
                    })
                })
                .collect()
        };
        let a = parse_buckets(&scrape(1.0), "m").unwrap().buckets;
        let b = parse_buckets(&scrape(2.0), "m").unwrap().buckets;
        assert_eq!((a.0.len(), b.0.len()), (1000, 1000));
        // The comparison looks at each bucket of each scrape at most once.
        let pulled = Cell::new(0usize);
        let count = |x| {
            pulled.set(pulled.get() + 1);
            x
        };
        let d = difference(a.0.iter().map(count), b.0.iter().map(count)).unwrap();
        assert_eq!(d.len(), 1000);
        assert!(
            pulled.get() <= a.0.len() + b.0.len(),
            "{} items",
            pulled.get()
        );
        assert_eq!(d[999], (1000.0, 100.0 * 1000.0));
    }

    #[test]
    fn the_p99_interpolates_inside_the_bucket() {
        let b = parse_buckets(SCRAPE, METRIC).unwrap().buckets;
        let (p99, n) = quantile_between(None, &b, 0.99).unwrap();
        assert_eq!(n, 100.0);
        assert!((p99 - (0.01 + 0.09 * 0.9)).abs() < 1e-12, "{p99}");
    }

    #[test]
    fn differences_between_scrapes_resets_and_missing_buckets() {
        let a = Buckets(vec![(0.001, 50.0), (0.01, 90.0), (f64::INFINITY, 100.0)]);
        let b = Buckets(vec![(0.001, 150.0), (0.01, 190.0), (f64::INFINITY, 200.0)]);
        let (p, n) = quantile_between(Some(&a), &b, 0.5).unwrap();
        assert_eq!(n, 100.0);
        assert!(p <= 0.001);
        // Reset: the new buckets are the difference.
        let after_reset = Buckets(vec![(0.001, 1.0), (0.01, 10.0), (f64::INFINITY, 10.0)]);
        assert_eq!(
            quantile_between(Some(&b), &after_reset, 0.99).unwrap().1,
            10.0
        );
        // A bucket missing from one scrape is ignored.
        let partial = Buckets(vec![(0.01, 290.0), (f64::INFINITY, 300.0)]);
        assert_eq!(quantile_between(Some(&b), &partial, 0.5).unwrap().1, 100.0);
        // Nothing happened: no p99.
        assert!(quantile_between(Some(&b), &b, 0.99).is_none());
        // All in +Inf: the highest finite bound.
        let slow = Buckets(vec![(0.01, 200.0), (f64::INFINITY, 300.0)]);
        assert_eq!(
            quantile_between(
                Some(&Buckets(vec![(0.01, 200.0), (f64::INFINITY, 200.0)])),
                &slow,
                0.99
            )
            .unwrap()
            .0,
            0.01
        );
    }

    fn later_scrape() -> String {
        SCRAPE
            .replace("} 50", "} 100")
            .replace("} 90", "} 190")
            .replace("\"0.1\"} 100", "\"0.1\"} 200")
            .replace("\"+Inf\"} 100", "\"+Inf\"} 200")
    }

    #[test]
    fn a_prometheus_source_needs_a_baseline_then_reports_milliseconds() {
        let mut h = PromHistogram::new(
            "http://127.0.0.1:1/metrics",
            METRIC,
            1.0,
            Duration::from_millis(100),
        );
        assert_eq!(h.ingest(SCRAPE).unwrap(), None);
        let (p99, n) = h.ingest(&later_scrape()).unwrap().unwrap();
        assert_eq!(n, 100.0);
        // 50 new requests under 1 ms, 50 in (1, 10] ms: the 99th sits near 10 ms.
        assert!((p99 - 9.82).abs() < 1e-9, "{p99} ms");
        assert!(matches!(
            h.ingest("nothing"),
            Err(LatencyError::Missing { .. })
        ));
        let soon = Instant::now() + Duration::from_secs(5);
        let err = h.poll(soon).unwrap_err().to_string();
        assert!(err.contains("127.0.0.1:1"), "{err}");
        let err = h.poll(Instant::now()).unwrap_err().to_string();
        assert!(err.contains("no time left"), "{err}");
    }

    #[test]
    fn a_prometheus_source_hands_out_each_intervals_buckets() {
        let mut h = PromHistogram::new("http://x/m", METRIC, 1.0, Duration::from_secs(1));
        assert_eq!(h.ms_per_unit(), 1000.0);
        assert_eq!(h.ingest_interval(SCRAPE).unwrap(), None, "the baseline");
        let i = h.ingest_interval(&later_scrape()).unwrap().unwrap();
        assert_eq!(i.count, 100.0);
        assert_eq!(
            i.buckets.0,
            vec![
                (0.001, 50.0),
                (0.01, 100.0),
                (0.1, 100.0),
                (f64::INFINITY, 100.0)
            ]
        );
        // Nothing new: an interval of no request, which `ingest` reports as no p99.
        let same = h.ingest_interval(&later_scrape()).unwrap().unwrap();
        assert_eq!(same.count, 0.0);
        assert_eq!(h.ingest(&later_scrape()).unwrap(), None);
        // A counter reset: the interval is what was counted since.
        let reset = h.ingest_interval(SCRAPE).unwrap().unwrap();
        assert_eq!(
            reset.buckets,
            parse_buckets(SCRAPE, METRIC).unwrap().buckets
        );
        assert_eq!(reset.count, 100.0);
    }

    #[test]
    fn a_p99_of_zero_or_less_is_refused() {
        let mut h = PromHistogram::new("http://x/m", "m", 1.0, Duration::from_secs(1));
        h.ingest("m_bucket{le=\"0\"} 10\nm_bucket{le=\"+Inf\"} 10\n")
            .unwrap();
        let e = h
            .ingest("m_bucket{le=\"0\"} 20\nm_bucket{le=\"+Inf\"} 20\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("must be positive"), "{e}");
    }

    #[test]
    fn redirects_are_not_followed() {
        let server = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = server.local_addr().unwrap();
        let answer = std::thread::spawn(move || {
            use std::io::{Read, Write};
            let (mut conn, _) = server.accept().unwrap();
            let mut req = [0u8; 1024];
            let _ = conn.read(&mut req).unwrap();
            conn.write_all(b"HTTP/1.1 302 Found\r\nLocation: http://127.0.0.1:1/elsewhere\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                .unwrap();
        });
        let mut h = PromHistogram::new(
            &format!("http://{addr}/metrics"),
            "m",
            1.0,
            Duration::from_secs(5),
        );
        let e = h
            .poll(Instant::now() + Duration::from_secs(5))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("302") && e.contains("redirects are not followed"),
            "{e}"
        );
        answer.join().unwrap();
    }

    /// Takes windows until `enough` says so (the listener's thread is asynchronous), for
    /// at most about a second; returns them summed.
    fn collect(l: &PushListener, enough: impl Fn(&PushWindow) -> bool) -> PushWindow {
        let mut w = l.take();
        for _ in 0..50 {
            if enough(&w) {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
            let more = l.take();
            w.rejected += more.rejected;
            w.count += more.count;
            w.p99_ms = more.p99_ms.or(w.p99_ms);
        }
        w
    }

    #[test]
    fn pushed_samples_give_a_p99_per_window() {
        let any = UnixAccess::default();
        let l = PushListener::bind(&PushAddr::Udp("127.0.0.1:0".parse().unwrap()), &any).unwrap();
        let PushAddr::Udp(addr) = l.local.clone() else {
            unreachable!()
        };
        let tx = UdpSocket::bind("127.0.0.1:0").unwrap();
        let lines: String = (1..=100).map(|i| format!("{}\n", i * 100)).collect();
        tx.send_to(lines.as_bytes(), addr).unwrap();
        tx.send_to(b"not-a-number\n", addr).unwrap();
        let w = collect(&l, |w| w.count >= 100 && w.rejected.malformed >= 1);
        assert_eq!(w.count, 100);
        assert_eq!(w.rejected.malformed, 1);
        let p99 = w.p99_ms.unwrap();
        assert!((9.8..=10.0).contains(&p99), "{p99}");
        assert_eq!(l.take().count, 0, "a new window starts empty");
        assert!(
            PushListener::bind(&PushAddr::Udp("8.8.8.8:9".parse().unwrap()), &any).is_err(),
            "loopback only"
        );
    }

    fn unix_listener(dir: &Path) -> (PushListener, PathBuf) {
        let path = dir.join("lat.sock");
        let l = PushListener::bind(&PushAddr::Unix(path.clone()), &UnixAccess::default()).unwrap();
        (l, path)
    }

    #[test]
    fn a_unix_socket_counts_only_the_services_processes() {
        let dir = tempfile::tempdir().unwrap();
        let (l, path) = unix_listener(dir.path());
        let tx = UnixDatagram::unbound().unwrap();
        // Not (yet) one of the service's processes: refused.
        tx.send_to(b"1500\n2500\n", &path).unwrap();
        let w = collect(&l, |w| w.rejected.credentials >= 1);
        assert_eq!((w.count, w.rejected.credentials), (0, 1));
        l.set_pids([std::process::id()]);
        tx.send_to(b"1500\n2500\n", &path).unwrap();
        let w = collect(&l, |w| w.count >= 2);
        assert_eq!((w.count, w.rejected.total()), (2, 0));
        let mode = std::fs::metadata(&path).unwrap().mode() & 0o7777;
        assert_eq!(mode, 0o660, "{mode:o}");
    }

    #[test]
    fn a_datagram_cut_by_the_kernel_is_dropped_whole() {
        let dir = tempfile::tempdir().unwrap();
        let (l, path) = unix_listener(dir.path());
        l.set_pids([std::process::id()]);
        let tx = UnixDatagram::unbound().unwrap();
        let big: Vec<u8> = b"1\n".iter().copied().cycle().take(100 * 1024).collect();
        tx.send_to(&big, &path).unwrap();
        let w = collect(&l, |w| w.rejected.truncated >= 1);
        assert_eq!((w.count, w.rejected.truncated), (0, 1));
        assert_eq!(w.rejected.total(), 1);
    }

    #[test]
    fn a_live_socket_is_in_use_and_keeps_receiving() {
        let dir = tempfile::tempdir().unwrap();
        let (first, path) = unix_listener(dir.path());
        first.set_pids([std::process::id()]);
        let e = PushListener::bind(&PushAddr::Unix(path.clone()), &UnixAccess::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("in use"), "{e}");
        UnixDatagram::unbound()
            .unwrap()
            .send_to(b"700\n", &path)
            .unwrap();
        assert_eq!(collect(&first, |w| w.count >= 1).count, 1);
    }

    #[test]
    fn a_stale_socket_is_replaced_and_a_regular_file_is_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let stale = dir.path().join("stale.sock");
        drop(UnixDatagram::bind(&stale).unwrap());
        let l = PushListener::bind(&PushAddr::Unix(stale.clone()), &UnixAccess::default());
        assert!(l.is_ok(), "{:?}", l.err());
        drop(l);
        assert!(!stale.exists(), "its socket is removed on drop");

        let file = dir.path().join("file.sock");
        std::fs::write(&file, "precious").unwrap();
        let e = PushListener::bind(&PushAddr::Unix(file.clone()), &UnixAccess::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a socket"), "{e}");
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "precious");
    }

    #[test]
    fn dropping_a_listener_wakes_its_thread_at_once_and_frees_its_address() {
        // Each drop used to wait for the thread's 100 ms read time-out (50 ms on average).
        let dir = tempfile::tempdir().unwrap();
        let any = UnixAccess::default();
        let udp = PushListener::bind(&PushAddr::Udp("127.0.0.1:0".parse().unwrap()), &any).unwrap();
        let port = udp.local.clone();
        drop(udp);
        let t = Instant::now();
        for i in 0..20 {
            // The same UDP port at once: the old socket is closed when the drop returns.
            let l = PushListener::bind(&port, &any).unwrap_or_else(|e| panic!("{i}: {e}"));
            std::thread::sleep(Duration::from_millis(2));
            drop(l);
            let l = PushListener::bind(&PushAddr::Unix(dir.path().join("s.sock")), &any).unwrap();
            std::thread::sleep(Duration::from_millis(2));
            drop(l);
        }
        // 40 drops: about 2 s before; well under a second now, even on a loaded machine.
        assert!(
            t.elapsed() < Duration::from_millis(1200),
            "{:?}",
            t.elapsed()
        );
    }

    #[test]
    fn drop_removes_the_socket_only_if_it_is_still_ours() {
        let dir = tempfile::tempdir().unwrap();
        let (l, path) = unix_listener(dir.path());
        std::fs::remove_file(&path).unwrap();
        std::fs::write(&path, "someone else's").unwrap();
        drop(l);
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "someone else's");
    }

    #[test]
    fn a_directory_others_can_write_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = PushListener::bind(
            &PushAddr::Unix(dir.path().join("lat.sock")),
            &UnixAccess::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("only root can write"), "{e}");
        // The sticky bit (as on /tmp) keeps others from replacing the entry.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o1777)).unwrap();
        assert!(PushListener::bind(
            &PushAddr::Unix(dir.path().join("lat.sock")),
            &UnixAccess::default()
        )
        .is_ok());
    }

    #[test]
    fn a_window_keeps_at_most_the_cap() {
        let mut s = Shared {
            hist: Histogram::new_with_bounds(1, MAX_US, 3).unwrap(),
            rejected: PushRejections::default(),
            pids: HashSet::new(),
        };
        let lines = "5\n".repeat(60_000);
        record(&mut s, lines.as_bytes());
        record(&mut s, lines.as_bytes());
        assert_eq!(s.hist.len(), MAX_SAMPLES_PER_WINDOW);
        assert_eq!(s.rejected.over_cap, 120_000 - MAX_SAMPLES_PER_WINDOW);
        record(&mut s, b"x\n-1\nNaN\ninf\n\n  \n");
        assert_eq!(
            s.rejected.malformed, 0,
            "over the cap, lines are not even read"
        );
        s.hist.reset();
        record(&mut s, b"x\n-1\nNaN\ninf\n\n  \n7\n");
        assert_eq!((s.rejected.malformed, s.hist.len()), (4, 1));
    }

    #[test]
    fn the_pacer_allows_so_many_datagrams_a_second() {
        let t0 = Instant::now();
        let mut p = Pacer::new(3, t0);
        assert_eq!(p.admit(t0), None);
        assert_eq!(p.admit(t0), None);
        assert_eq!(p.admit(t0 + Duration::from_millis(100)), None);
        assert_eq!(
            p.admit(t0 + Duration::from_millis(400)),
            Some(Duration::from_millis(600))
        );
        assert_eq!(
            p.admit(t0 + Duration::from_millis(1000)),
            None,
            "a new second"
        );
    }

    #[test]
    fn credentials_admit_the_services_pids_and_allowed_ids() {
        let auth = Auth::Credentials {
            uids: BTreeSet::from([1000]),
            gids: BTreeSet::from([50]),
        };
        let pids = HashSet::from([42]);
        let from = |pid, uid, gid| Some(Sender { pid, uid, gid });
        assert!(auth.admits(from(42, 7, 7), &pids));
        assert!(auth.admits(from(9, 1000, 7), &pids));
        assert!(auth.admits(from(9, 7, 50), &pids));
        assert!(!auth.admits(from(9, 7, 7), &pids));
        assert!(!auth.admits(None, &pids), "no credentials, no entry");
        assert!(Auth::Unauthenticated.admits(None, &pids));
    }

    /// Not a check on its own: the body of the child that
    /// `only_allowed_users_are_counted_as_root` starts under another uid. Without its
    /// environment variable it does nothing.
    #[test]
    fn push_sender_child() {
        if let Some(path) = std::env::var_os("COHABIT_TEST_PUSH_TO") {
            UnixDatagram::unbound()
                .unwrap()
                .send_to(b"1\n", path)
                .unwrap();
        }
    }

    /// Runs `push_sender_child` as `uid`:`gid`, sending `1\n` to `path`.
    fn send_as(uid: u32, gid: u32, path: &Path) {
        let status = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "latency::tests::push_sender_child",
                "--test-threads=1",
            ])
            .env("COHABIT_TEST_PUSH_TO", path)
            .uid(uid)
            .gid(gid)
            .stdout(std::process::Stdio::null())
            .status()
            .unwrap();
        assert!(status.success(), "sender as uid {uid}: {status}");
    }

    #[test]
    fn only_allowed_users_are_counted_as_root() {
        if !nix::unistd::geteuid().is_root() {
            cohabit_testkit::skip(
                cohabit_testkit::Need::Root,
                "needs root to start senders under other uids",
            );
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let path = dir.path().join("lat.sock");
        // uid 1000 owns the socket and may send; gid 65534 (nogroup) can reach it too.
        let access = UnixAccess {
            owner: Some(1000),
            group: Some(65534),
            allowed_uids: BTreeSet::from([1000]),
            ..UnixAccess::default()
        };
        let l = PushListener::bind(&PushAddr::Unix(path.clone()), &access).unwrap();
        let meta = std::fs::metadata(&path).unwrap();
        assert_eq!(
            (meta.mode() & 0o7777, meta.uid(), meta.gid()),
            (0o660, 1000, 65534)
        );
        send_as(65534, 65534, &path);
        let w = collect(&l, |w| w.rejected.credentials >= 1);
        assert_eq!((w.count, w.rejected.credentials), (0, 1));
        send_as(1000, 1000, &path);
        let w = collect(&l, |w| w.count >= 1);
        assert_eq!((w.count, w.rejected.total()), (1, 0));
    }
}
