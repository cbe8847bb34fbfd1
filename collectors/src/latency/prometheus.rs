//! Prometheus histograms: the text exposition format parsed, and one histogram scraped over
//! HTTP with the requests between two scrapes.

use std::collections::btree_map::Entry;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::LatencyError;
use crate::histogram::{interval_between, quantile_between, Buckets};

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
    fn the_p99_interpolates_inside_the_bucket() {
        let b = parse_buckets(SCRAPE, METRIC).unwrap().buckets;
        let (p99, n) = quantile_between(None, &b, 0.99).unwrap();
        assert_eq!(n, 100.0);
        assert!((p99 - (0.01 + 0.09 * 0.9)).abs() < 1e-12, "{p99}");
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
}
