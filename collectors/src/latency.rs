//! Per-service tail latency: scraped from a Prometheus histogram, or pushed by the service.
//!
//! - [`PromHistogram`]: parses the text exposition format, keeps the cumulative buckets of
//!   one histogram as read, and computes the p99 of the requests *between two scrapes* from
//!   the bucket differences (linear interpolation inside the bucket, as Prometheus'
//!   `histogram_quantile` does). A counter reset (any bucket going down) makes the current
//!   buckets the difference; buckets present in only one scrape are ignored.
//! - [`PushListener`]: a loopback UDP or Unix datagram socket on which a service sends
//!   latencies, one per line, in microseconds. A thread records them in an HDR histogram;
//!   each tick takes the p99 and the count and starts afresh.

use std::collections::BTreeMap;
use std::io;
use std::net::{SocketAddr, UdpSocket};
use std::os::unix::net::UnixDatagram;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use hdrhistogram::Histogram;

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
    /// The socket could not be bound.
    #[error("binding latency socket {addr}: {source}")]
    Bind {
        /// Address or path.
        addr: String,
        /// OS error.
        source: io::Error,
    },
}

/// Cumulative buckets of one histogram at one scrape: upper bound → count. The `+Inf`
/// bucket is stored under `f64::INFINITY`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Buckets(pub Vec<(f64, f64)>);

/// Extracts the buckets of histogram `metric` from exposition text, summing series that
/// differ in other labels. `None` if the metric has no buckets.
pub fn parse_buckets(text: &str, metric: &str) -> Option<Buckets> {
    let prefix = format!("{metric}_bucket");
    let mut by_le: BTreeMap<u64, (f64, f64)> = BTreeMap::new();
    for line in text.lines().map(str::trim) {
        if line.starts_with('#') || !line.starts_with(&prefix) {
            continue;
        }
        let rest = &line[prefix.len()..];
        let (labels, value) = match rest.strip_prefix('{') {
            Some(r) => {
                let end = r.find('}')?;
                (&r[..end], r[end + 1..].trim())
            }
            None => continue,
        };
        let le = labels.split(',').find_map(|kv| {
            let (k, v) = kv.split_once('=')?;
            (k.trim() == "le").then(|| v.trim().trim_matches('"').to_string())
        })?;
        let bound = if le == "+Inf" {
            f64::INFINITY
        } else {
            le.parse::<f64>().ok()?
        };
        let count: f64 = value.split_whitespace().next()?.parse().ok()?;
        let e = by_le.entry(bound.to_bits()).or_insert((bound, 0.0));
        e.1 += count;
    }
    if by_le.is_empty() {
        return None;
    }
    let mut v: Vec<(f64, f64)> = by_le.into_values().collect();
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    Some(Buckets(v))
}

/// The `q` quantile of the requests counted between `prev` and `cur`, in the histogram's
/// unit, and how many requests that was. `None` when no request arrived.
pub fn quantile_between(prev: Option<&Buckets>, cur: &Buckets, q: f64) -> Option<(f64, f64)> {
    let reset = prev.is_some_and(|p| {
        p.0.iter()
            .any(|(b, c)| cur.0.iter().any(|(cb, cc)| cb == b && cc < c))
    });
    let delta: Vec<(f64, f64)> = match prev {
        Some(p) if !reset => cur
            .0
            .iter()
            .filter_map(|(b, c)| {
                p.0.iter()
                    .find(|(pb, _)| pb == b)
                    .map(|(_, pc)| (*b, c - pc))
            })
            .collect(),
        _ => cur.0.clone(),
    };
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

/// A Prometheus histogram scraped over HTTP.
#[derive(Debug)]
pub struct PromHistogram {
    url: String,
    metric: String,
    to_ms: f64,
    timeout: Duration,
    last: Option<Buckets>,
}

impl PromHistogram {
    /// Scrapes `url` for histogram `metric` whose unit is `unit_seconds` seconds (1.0 for a
    /// `_seconds` histogram, 0.001 for milliseconds).
    pub fn new(url: &str, metric: &str, unit_seconds: f64, timeout: Duration) -> Self {
        Self {
            url: url.into(),
            metric: metric.into(),
            to_ms: unit_seconds * 1000.0,
            timeout,
            last: None,
        }
    }

    /// Scrapes once and returns the p99 (ms) and the requests since the previous scrape.
    /// The first scrape only sets the baseline (`Ok(None)`).
    pub fn poll(&mut self) -> Result<Option<(f64, f64)>, LatencyError> {
        let text = ureq::get(&self.url)
            .timeout(self.timeout)
            .call()
            .map_err(|e| LatencyError::Scrape {
                url: self.url.clone(),
                detail: e.to_string(),
            })?
            .into_string()
            .map_err(|e| LatencyError::Scrape {
                url: self.url.clone(),
                detail: e.to_string(),
            })?;
        self.ingest(&text)
    }

    /// Like [`Self::poll`] with exposition text already fetched.
    pub fn ingest(&mut self, text: &str) -> Result<Option<(f64, f64)>, LatencyError> {
        let cur = parse_buckets(text, &self.metric).ok_or_else(|| LatencyError::Missing {
            metric: self.metric.clone(),
            url: self.url.clone(),
        })?;
        let out = self
            .last
            .as_ref()
            .and_then(|prev| quantile_between(Some(prev), &cur, 0.99))
            .map(|(p99, n)| (p99 * self.to_ms, n));
        self.last = Some(cur);
        Ok(out)
    }
}

/// Where a push listener receives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PushAddr {
    /// A UDP address; only loopback is accepted.
    Udp(SocketAddr),
    /// A Unix datagram socket path.
    Unix(PathBuf),
}

/// One tick of pushed latencies.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PushWindow {
    /// p99 in milliseconds, if any sample arrived.
    pub p99_ms: Option<f64>,
    /// Samples received.
    pub count: u64,
    /// Lines that were not a latency.
    pub rejected: u64,
}

#[derive(Debug)]
struct Shared {
    hist: Histogram<u64>,
    rejected: u64,
}

/// Receives latency samples (µs, one per line) pushed by a service.
#[derive(Debug)]
pub struct PushListener {
    shared: Arc<Mutex<Shared>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    /// Where it listens (the bound port for `127.0.0.1:0`).
    pub local: PushAddr,
}

/// Receives one datagram into a buffer.
type Receiver = Box<dyn FnMut(&mut [u8]) -> io::Result<usize> + Send>;

/// Largest latency recorded: one hour in microseconds.
const MAX_US: u64 = 3_600_000_000;

fn record(shared: &Mutex<Shared>, datagram: &[u8]) {
    let text = String::from_utf8_lossy(datagram);
    let mut s = shared
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        match line.parse::<f64>() {
            Ok(us) if us.is_finite() && us >= 0.0 => {
                let v = cohabit_core::whole(us).clamp(1, MAX_US);
                if s.hist.record(v).is_err() {
                    s.rejected += 1;
                }
            }
            _ => s.rejected += 1,
        }
    }
}

impl PushListener {
    /// Binds and starts receiving.
    pub fn bind(addr: &PushAddr) -> Result<Self, LatencyError> {
        let hist = Histogram::new_with_bounds(1, MAX_US, 3).map_err(|e| LatencyError::Bind {
            addr: format!("{addr:?}"),
            source: io::Error::other(e.to_string()),
        })?;
        let shared = Arc::new(Mutex::new(Shared { hist, rejected: 0 }));
        let stop = Arc::new(AtomicBool::new(false));
        let bind_err = |source: io::Error| LatencyError::Bind {
            addr: format!("{addr:?}"),
            source,
        };
        let (local, recv): (PushAddr, Receiver) = match addr {
            PushAddr::Udp(a) => {
                if !a.ip().is_loopback() {
                    return Err(bind_err(io::Error::new(
                        io::ErrorKind::InvalidInput,
                        "only loopback addresses are allowed",
                    )));
                }
                let sock = UdpSocket::bind(a).map_err(bind_err)?;
                sock.set_read_timeout(Some(Duration::from_millis(100)))
                    .map_err(bind_err)?;
                let local = PushAddr::Udp(sock.local_addr().map_err(bind_err)?);
                (local, Box::new(move |buf| sock.recv(buf)))
            }
            PushAddr::Unix(p) => {
                let _ = std::fs::remove_file(p);
                let sock = UnixDatagram::bind(p).map_err(bind_err)?;
                sock.set_read_timeout(Some(Duration::from_millis(100)))
                    .map_err(bind_err)?;
                (
                    PushAddr::Unix(p.clone()),
                    Box::new(move |buf| sock.recv(buf)),
                )
            }
        };
        let (sh, st) = (Arc::clone(&shared), Arc::clone(&stop));
        let mut recv = recv;
        let thread = std::thread::Builder::new()
            .name("cohabit-latency".into())
            .spawn(move || {
                let mut buf = vec![0u8; 65536];
                while !st.load(Ordering::Relaxed) {
                    match recv(&mut buf) {
                        Ok(n) => record(&sh, &buf[..n]),
                        Err(e)
                            if matches!(
                                e.kind(),
                                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                            ) => {}
                        Err(_) => std::thread::sleep(Duration::from_millis(50)),
                    }
                }
            })
            .map_err(bind_err)?;
        Ok(Self {
            shared,
            stop,
            thread: Some(thread),
            local,
        })
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
            rejected: s.rejected,
        };
        s.hist.reset();
        s.rejected = 0;
        w
    }
}

impl Drop for PushListener {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        if let PushAddr::Unix(p) = &self.local {
            let _ = std::fs::remove_file(p);
        }
    }
}

#[cfg(test)]
mod tests {
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

    #[test]
    fn buckets_sum_across_label_sets_in_bound_order() {
        let b = parse_buckets(SCRAPE, "http_request_duration_seconds").unwrap();
        assert_eq!(
            b.0,
            vec![
                (0.001, 50.0),
                (0.01, 90.0),
                (0.1, 100.0),
                (f64::INFINITY, 100.0)
            ]
        );
        assert!(parse_buckets(SCRAPE, "other").is_none());
    }

    #[test]
    fn the_p99_interpolates_inside_the_bucket() {
        let b = parse_buckets(SCRAPE, "http_request_duration_seconds").unwrap();
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

    #[test]
    fn a_prometheus_source_needs_a_baseline_then_reports_milliseconds() {
        let mut h = PromHistogram::new(
            "http://127.0.0.1:1/metrics",
            "http_request_duration_seconds",
            1.0,
            Duration::from_millis(100),
        );
        assert_eq!(h.ingest(SCRAPE).unwrap(), None);
        let later = SCRAPE
            .replace("} 50", "} 100")
            .replace("} 90", "} 190")
            .replace("\"0.1\"} 100", "\"0.1\"} 200")
            .replace("\"+Inf\"} 100", "\"+Inf\"} 200");
        let (p99, n) = h.ingest(&later).unwrap().unwrap();
        assert_eq!(n, 100.0);
        // 50 new requests under 1 ms, 50 in (1, 10] ms: the 99th sits near 10 ms.
        assert!((p99 - 9.82).abs() < 1e-9, "{p99} ms");
        assert!(matches!(
            h.ingest("nothing"),
            Err(LatencyError::Missing { .. })
        ));
        let err = h.poll().unwrap_err().to_string();
        assert!(err.contains("127.0.0.1:1"), "{err}");
    }

    #[test]
    fn pushed_samples_give_a_p99_per_window() {
        let l = PushListener::bind(&PushAddr::Udp("127.0.0.1:0".parse().unwrap())).unwrap();
        let PushAddr::Udp(addr) = l.local.clone() else {
            unreachable!()
        };
        let tx = UdpSocket::bind("127.0.0.1:0").unwrap();
        let lines: String = (1..=100).map(|i| format!("{}\n", i * 100)).collect();
        tx.send_to(lines.as_bytes(), addr).unwrap();
        tx.send_to(b"not-a-number\n", addr).unwrap();
        let mut w = l.take();
        for _ in 0..50 {
            if w.count >= 100 {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
            let more = l.take();
            w = PushWindow {
                count: w.count + more.count,
                p99_ms: more.p99_ms.or(w.p99_ms),
                rejected: w.rejected + more.rejected,
            };
        }
        assert_eq!(w.count, 100);
        let p99 = w.p99_ms.unwrap();
        assert!((9.8..=10.0).contains(&p99), "{p99}");
        assert_eq!(l.take().count, 0, "a new window starts empty");
        assert!(
            PushListener::bind(&PushAddr::Udp("8.8.8.8:9".parse().unwrap())).is_err(),
            "loopback only"
        );
    }

    #[test]
    fn a_unix_socket_works_too() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("lat.sock");
        let l = PushListener::bind(&PushAddr::Unix(path.clone())).unwrap();
        let tx = UnixDatagram::unbound().unwrap();
        tx.send_to(b"1500\n2500\n", &path).unwrap();
        let mut count = 0;
        for _ in 0..50 {
            count += l.take().count;
            if count == 2 {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(count, 2);
    }
}
