//! The independent load generator whose latencies judge every policy.
//!
//! Problem: the latencies that decide whether a policy met its targets must come from a
//! client, not from cohabit (whose probe could be wrong in the same way as its decisions),
//! at a fixed request rate however the service behaves, with a p99 per one-second window.
//! Debian's tools do not give that: memcaslap (libmemcached-tools) is closed-loop (its
//! `--tps` does not hold a rate), and its periodic report has min/avg/max/std-dev but no
//! percentile (only a log2 histogram at the very end); wrk is closed-loop too (a slow
//! response delays the next request of its connection, hiding the tail: coordinated
//! omission), and prints percentiles only for a whole run. So this is a small client of its
//! own, sharing no code with cohabit.
//!
//! Approach: open loop over a few keep-alive connections. Request `i` of a service is due
//! at `t0 + i / rate`; connection `c` sends requests `c, c + n, c + 2n, …`. On each
//! connection a writer thread sends every request when it is due (at once if it is late),
//! pipelined without waiting for earlier answers, and a reader thread matches answers in
//! order. Latency is measured from the due time, and filed under the second the request
//! was due in.
//!
//! Algorithm: a request whose connection fails, or which is still unanswered
//! [`DRAIN`] after the run, counts as failed and is recorded at [`FAILED_US`] (so a window
//! with more than 1 % failures misses any target). A failed connection is replaced at the
//! next due request.
//!
//! Properties: the rate is held whatever the latency; a stalled server shows up as the
//! latency of every request due while it stalled; each connection records into its own
//! histograms (no lock shared between connections), merged at the end.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

/// Value a failed request is recorded at: 10 seconds, in microseconds.
pub const FAILED_US: u64 = 10_000_000;
/// Largest latency the histograms hold: one minute.
const MAX_US: u64 = 60_000_000;
/// How long answers are awaited after the last request was due.
pub const DRAIN: Duration = Duration::from_secs(2);

/// The protocol spoken.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Proto {
    /// memcached text protocol: `get` and `set`.
    Memcached,
    /// redis RESP: `GET` and `SET`.
    Redis,
    /// HTTP/1.1 `GET` of one path.
    Http {
        /// The path requested.
        path: String,
    },
}

/// What to send to one service.
#[derive(Debug, Clone)]
pub struct LoadSpec {
    /// Protocol.
    pub proto: Proto,
    /// The service.
    pub addr: SocketAddr,
    /// Requests per second, all connections together.
    pub rate_rps: f64,
    /// Connections.
    pub conns: usize,
    /// Keys `rb:000000` … used by gets and sets.
    pub keys: u32,
    /// Size of the values set.
    pub value_bytes: usize,
    /// One request in this many is a set (memcached and redis); 0: gets only.
    pub set_every: u32,
    /// Seed of the key choice.
    pub seed: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Get,
    Set,
}

/// How much of a buffer one answer takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framed {
    /// Not all of it has arrived.
    Incomplete,
    /// An answer of this many bytes; `true` if it is a success.
    Done(usize, bool),
    /// Not an answer of this protocol.
    Bad,
}

fn key(i: u32) -> String {
    format!("rb:{i:06}")
}

fn encode(proto: &Proto, op: Op, k: &str, value: &[u8], host: &SocketAddr, out: &mut Vec<u8>) {
    match (proto, op) {
        (Proto::Memcached, Op::Get) => out.extend_from_slice(format!("get {k}\r\n").as_bytes()),
        (Proto::Memcached, Op::Set) => {
            out.extend_from_slice(format!("set {k} 0 0 {}\r\n", value.len()).as_bytes());
            out.extend_from_slice(value);
            out.extend_from_slice(b"\r\n");
        }
        (Proto::Redis, Op::Get) => {
            out.extend_from_slice(format!("*2\r\n$3\r\nGET\r\n${}\r\n{k}\r\n", k.len()).as_bytes());
        }
        (Proto::Redis, Op::Set) => {
            out.extend_from_slice(
                format!(
                    "*3\r\n$3\r\nSET\r\n${}\r\n{k}\r\n${}\r\n",
                    k.len(),
                    value.len()
                )
                .as_bytes(),
            );
            out.extend_from_slice(value);
            out.extend_from_slice(b"\r\n");
        }
        (Proto::Http { path }, _) => out.extend_from_slice(
            format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: cohabit-realbench\r\n\r\n")
                .as_bytes(),
        ),
    }
}

fn crlf(buf: &[u8], from: usize) -> Option<usize> {
    buf.get(from..)?
        .windows(2)
        .position(|w| w == b"\r\n")
        .map(|p| p + from)
}

/// Frames one memcached answer (`VALUE … END`, `END`, `STORED`, or an error line).
pub fn frame_memcached(buf: &[u8]) -> Framed {
    let mut at = 0;
    loop {
        let Some(e) = crlf(buf, at) else {
            return Framed::Incomplete;
        };
        let line = &buf[at..e];
        if line == b"END" || line == b"STORED" {
            return Framed::Done(e + 2, true);
        }
        if line == b"ERROR"
            || line.starts_with(b"CLIENT_ERROR")
            || line.starts_with(b"SERVER_ERROR")
        {
            return Framed::Done(e + 2, false);
        }
        let Some(n) = line
            .strip_prefix(b"VALUE ")
            .and_then(|r| std::str::from_utf8(r).ok())
            .and_then(|r| r.split(' ').nth(2))
            .and_then(|n| n.parse::<usize>().ok())
        else {
            return Framed::Bad;
        };
        at = e + 2 + n + 2;
        if buf.len() < at {
            return Framed::Incomplete;
        }
    }
}

/// Frames one redis answer (`+OK`, `$-1`, `$N` bulk, or `-ERR`).
pub fn frame_redis(buf: &[u8]) -> Framed {
    let Some(e) = crlf(buf, 0) else {
        return Framed::Incomplete;
    };
    match buf[0] {
        b'+' => Framed::Done(e + 2, true),
        b'-' => Framed::Done(e + 2, false),
        b'$' => match std::str::from_utf8(&buf[1..e])
            .ok()
            .and_then(|n| n.parse::<i64>().ok())
        {
            Some(-1) => Framed::Done(e + 2, true),
            Some(n) if n >= 0 => {
                let end = e + 2 + usize::try_from(n).unwrap_or(usize::MAX - 8) + 2;
                if buf.len() < end {
                    Framed::Incomplete
                } else {
                    Framed::Done(end, true)
                }
            }
            _ => Framed::Bad,
        },
        _ => Framed::Bad,
    }
}

/// Frames one HTTP/1.1 answer with a `Content-Length`; a status other than 2xx is a
/// failure.
pub fn frame_http(buf: &[u8]) -> Framed {
    let Some(head) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
        return Framed::Incomplete;
    };
    let Ok(text) = std::str::from_utf8(&buf[..head]) else {
        return Framed::Bad;
    };
    let mut lines = text.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|c| c.parse::<u16>().ok());
    let Some(status) = status else {
        return Framed::Bad;
    };
    let length = lines.find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim()
            .eq_ignore_ascii_case("content-length")
            .then(|| v.trim().parse::<usize>().ok())?
    });
    let Some(length) = length else {
        return Framed::Bad;
    };
    let end = head + 4 + length;
    if buf.len() < end {
        Framed::Incomplete
    } else {
        Framed::Done(end, (200..300).contains(&status))
    }
}

fn frame(proto: &Proto, buf: &[u8]) -> Framed {
    match proto {
        Proto::Memcached => frame_memcached(buf),
        Proto::Redis => frame_redis(buf),
        Proto::Http { .. } => frame_http(buf),
    }
}

/// One answer to one request, synchronously (readiness checks and preloading).
fn exchange(s: &mut TcpStream, proto: &Proto, req: &[u8]) -> Result<bool, String> {
    s.write_all(req).map_err(|e| e.to_string())?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    loop {
        match frame(proto, &buf) {
            Framed::Done(_, ok) => return Ok(ok),
            Framed::Bad => {
                return Err(format!(
                    "unexpected answer {:?}",
                    String::from_utf8_lossy(&buf[..buf.len().min(60)])
                ))
            }
            Framed::Incomplete => {}
        }
        match s.read(&mut chunk) {
            Ok(0) => return Err("connection closed".into()),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) => return Err(e.to_string()),
        }
    }
}

fn connect(addr: &SocketAddr, timeout: Duration) -> Result<TcpStream, String> {
    let s = TcpStream::connect_timeout(addr, timeout).map_err(|e| e.to_string())?;
    let _ = s.set_nodelay(true);
    s.set_read_timeout(Some(timeout))
        .map_err(|e| e.to_string())?;
    Ok(s)
}

/// Whether the service answers one get within `timeout`.
pub fn check(proto: &Proto, addr: &SocketAddr, timeout: Duration) -> Result<(), String> {
    let mut s = connect(addr, timeout)?;
    let mut req = Vec::new();
    encode(proto, Op::Get, &key(0), b"", addr, &mut req);
    match exchange(&mut s, proto, &req)? {
        true => Ok(()),
        false => Err("answered with an error".into()),
    }
}

/// Sets every key once (memcached and redis), so gets hit.
pub fn preload(spec: &LoadSpec) -> Result<(), String> {
    if matches!(spec.proto, Proto::Http { .. }) || spec.set_every == 0 {
        return Ok(());
    }
    let mut s = connect(&spec.addr, Duration::from_secs(2))?;
    let value = vec![b'v'; spec.value_bytes];
    let mut req = Vec::new();
    for i in 0..spec.keys {
        req.clear();
        encode(&spec.proto, Op::Set, &key(i), &value, &spec.addr, &mut req);
        if !exchange(&mut s, &spec.proto, &req)? {
            return Err(format!("set {} was refused", key(i)));
        }
    }
    Ok(())
}

/// Latencies of one connection, per window of one second.
#[derive(Debug)]
struct Recorder {
    t0: Instant,
    windows: Vec<Histogram<u64>>,
    failed: Vec<u64>,
}

fn new_hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, MAX_US, 3).expect("static histogram bounds are valid")
}

impl Recorder {
    fn new(t0: Instant, seconds: usize) -> Self {
        Self {
            t0,
            windows: (0..seconds).map(|_| new_hist()).collect(),
            failed: vec![0; seconds],
        }
    }

    fn window(&self, due: Instant) -> Option<usize> {
        let i = usize::try_from(due.saturating_duration_since(self.t0).as_secs()).ok()?;
        (i < self.windows.len()).then_some(i)
    }

    fn answered(&mut self, due: Instant, at: Instant) {
        if let Some(i) = self.window(due) {
            let us = u64::try_from(at.saturating_duration_since(due).as_micros()).unwrap_or(MAX_US);
            let _ = self.windows[i].record(us.clamp(1, MAX_US));
        }
    }

    fn failed(&mut self, due: Instant) {
        if let Some(i) = self.window(due) {
            let _ = self.windows[i].record(FAILED_US);
            self.failed[i] += 1;
        }
    }
}

/// Requests sent on a connection and not yet answered.
#[derive(Debug, Default)]
struct Pending {
    queue: VecDeque<Instant>,
    /// The connection failed; nothing more is queued.
    dead: bool,
    /// The writer is done; the reader ends once the queue is empty.
    closed: bool,
}

type Shared<T> = Arc<Mutex<T>>;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Marks the connection dead and every request waiting on it failed.
fn fail_all(p: &mut Pending, rec: &Mutex<Recorder>) {
    p.dead = true;
    let mut r = lock(rec);
    for due in p.queue.drain(..) {
        r.failed(due);
    }
}

fn reader(mut s: TcpStream, proto: Proto, pending: Shared<Pending>, rec: Shared<Recorder>) {
    let mut buf: Vec<u8> = Vec::with_capacity(16384);
    let mut chunk = vec![0u8; 65536];
    let _ = s.set_read_timeout(Some(Duration::from_millis(100)));
    loop {
        {
            let mut p = lock(&pending);
            if p.dead {
                return;
            }
            let now = Instant::now();
            while let Some(&due) = p.queue.front() {
                match frame(&proto, &buf) {
                    Framed::Done(n, ok) => {
                        buf.drain(..n);
                        p.queue.pop_front();
                        let mut r = lock(&rec);
                        if ok {
                            r.answered(due, now);
                        } else {
                            r.failed(due);
                        }
                    }
                    Framed::Incomplete => break,
                    Framed::Bad => {
                        fail_all(&mut p, &rec);
                        return;
                    }
                }
            }
            if p.closed && p.queue.is_empty() {
                return;
            }
        }
        match s.read(&mut chunk) {
            Ok(0) => {
                fail_all(&mut lock(&pending), &rec);
                return;
            }
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock
                        | std::io::ErrorKind::TimedOut
                        | std::io::ErrorKind::Interrupted
                ) => {}
            Err(_) => {
                fail_all(&mut lock(&pending), &rec);
                return;
            }
        }
    }
}

/// One live connection: its socket for writing and its reader thread.
struct Session {
    stream: TcpStream,
    pending: Shared<Pending>,
    reader: JoinHandle<()>,
}

impl Session {
    fn open(spec: &LoadSpec, rec: &Shared<Recorder>) -> Result<Self, String> {
        let stream = connect(&spec.addr, Duration::from_secs(1))?;
        let pending: Shared<Pending> = Arc::default();
        let read_side = stream.try_clone().map_err(|e| e.to_string())?;
        let (p, r, proto) = (Arc::clone(&pending), Arc::clone(rec), spec.proto.clone());
        let reader = std::thread::Builder::new()
            .name("realbench-read".into())
            .spawn(move || reader(read_side, proto, p, r))
            .map_err(|e| e.to_string())?;
        Ok(Self {
            stream,
            pending,
            reader,
        })
    }

    /// Ends the session: waits up to `drain` for the outstanding answers, then fails what is
    /// left and closes the socket.
    fn close(self, drain: Duration, rec: &Shared<Recorder>) {
        lock(&self.pending).closed = true;
        let t = Instant::now();
        while !self.reader.is_finished() && t.elapsed() < drain {
            std::thread::sleep(Duration::from_millis(10));
        }
        fail_all(&mut lock(&self.pending), rec);
        let _ = self.stream.shutdown(Shutdown::Both);
        let _ = self.reader.join();
    }
}

/// A small xorshift generator for the key choice (no need for a cryptographic one).
#[derive(Debug, Clone)]
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
}

/// Longest a writer sleeps before looking at the interrupt flag.
const POLL: Duration = Duration::from_millis(50);

fn writer(spec: Arc<LoadSpec>, c: usize, t0: Instant, end: Instant, rec: Shared<Recorder>) {
    let n = spec.conns.max(1) as u64;
    let period = 1.0 / spec.rate_rps;
    let mut rng = Rng(spec.seed ^ (c as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let value = vec![b'v'; spec.value_bytes];
    let mut session: Option<Session> = None;
    let mut retry_at = t0;
    let mut req = Vec::with_capacity(256);
    let mut k: u64 = 0;
    loop {
        let i = k * n + c as u64;
        let due = t0 + Duration::from_secs_f64(i as f64 * period);
        if due >= end || crate::interrupt::requested() {
            break;
        }
        let now = Instant::now();
        if now < due {
            std::thread::sleep((due - now).min(POLL));
            continue;
        }
        k += 1;
        let r = rng.next();
        let op = if spec.set_every > 0 && r.is_multiple_of(u64::from(spec.set_every)) {
            Op::Set
        } else {
            Op::Get
        };
        let key_index = u32::try_from((r >> 16) % u64::from(spec.keys.max(1))).unwrap_or(0);
        if session.as_ref().is_some_and(|s| lock(&s.pending).dead) {
            if let Some(s) = session.take() {
                s.close(Duration::ZERO, &rec);
            }
        }
        if session.is_none() {
            if now < retry_at {
                lock(&rec).failed(due);
                continue;
            }
            match Session::open(&spec, &rec) {
                Ok(s) => session = Some(s),
                Err(_) => {
                    retry_at = now + Duration::from_millis(100);
                    lock(&rec).failed(due);
                    continue;
                }
            }
        }
        let Some(s) = session.as_mut() else { continue };
        req.clear();
        encode(
            &spec.proto,
            op,
            &key(key_index),
            &value,
            &spec.addr,
            &mut req,
        );
        {
            let mut p = lock(&s.pending);
            if p.dead {
                drop(p);
                lock(&rec).failed(due);
                continue;
            }
            p.queue.push_back(due);
        }
        if s.stream.write_all(&req).is_err() {
            fail_all(&mut lock(&s.pending), &rec);
        }
    }
    if let Some(s) = session.take() {
        let drain = if crate::interrupt::requested() {
            Duration::ZERO
        } else {
            DRAIN
        };
        s.close(drain, &rec);
    }
}

/// Statistics of one window (or of a whole run).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct WindowStat {
    /// Requests due in it.
    pub requests: u64,
    /// Of which failed (counted at [`FAILED_US`]).
    pub failed: u64,
    /// Median latency, µs.
    pub p50_us: u64,
    /// 99th percentile, µs.
    pub p99_us: u64,
    /// Largest, µs.
    pub max_us: u64,
}

fn stat(h: &Histogram<u64>, failed: u64) -> WindowStat {
    WindowStat {
        requests: h.len(),
        failed,
        p50_us: h.value_at_quantile(0.5),
        p99_us: h.value_at_quantile(0.99),
        max_us: h.max(),
    }
}

/// What the client measured on one service.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Measured {
    /// One entry per second of the run.
    pub windows: Vec<WindowStat>,
}

/// A load running against one service.
#[derive(Debug)]
pub struct Load {
    threads: Vec<JoinHandle<()>>,
    recorders: Vec<Shared<Recorder>>,
}

impl Load {
    /// Starts sending at `t0` for `seconds` seconds.
    pub fn start(spec: &LoadSpec, t0: Instant, seconds: u32) -> Result<Self, String> {
        if !(spec.rate_rps.is_finite() && spec.rate_rps > 0.0) {
            return Err(format!("rate must be positive, got {}", spec.rate_rps));
        }
        let spec = Arc::new(spec.clone());
        let end = t0 + Duration::from_secs(u64::from(seconds));
        let mut threads = Vec::new();
        let mut recorders = Vec::new();
        for c in 0..spec.conns.max(1) {
            let rec = Arc::new(Mutex::new(Recorder::new(t0, seconds as usize)));
            recorders.push(Arc::clone(&rec));
            let s = Arc::clone(&spec);
            let t = std::thread::Builder::new()
                .name("realbench-write".into())
                .spawn(move || writer(s, c, t0, end, rec))
                .map_err(|e| e.to_string())?;
            threads.push(t);
        }
        Ok(Self { threads, recorders })
    }

    /// Waits for the load to end and merges what every connection recorded: the windows, and
    /// the distribution of all requests due from window `from` on.
    pub fn finish(self, from: usize) -> (Measured, WindowStat) {
        for t in self.threads {
            let _ = t.join();
        }
        let recs: Vec<Recorder> = self
            .recorders
            .into_iter()
            .map(|r| match Arc::try_unwrap(r) {
                Ok(m) => m.into_inner().unwrap_or_else(PoisonError::into_inner),
                Err(shared) => {
                    let r = lock(&shared);
                    Recorder {
                        t0: r.t0,
                        windows: r.windows.clone(),
                        failed: r.failed.clone(),
                    }
                }
            })
            .collect();
        let n = recs.first().map_or(0, |r| r.windows.len());
        let mut windows = Vec::with_capacity(n);
        let mut all = new_hist();
        let mut all_failed = 0;
        for i in 0..n {
            let mut h = new_hist();
            let mut failed = 0;
            for r in &recs {
                let _ = h.add(&r.windows[i]);
                failed += r.failed[i];
            }
            if i >= from {
                let _ = all.add(&h);
                all_failed += failed;
            }
            windows.push(stat(&h, failed));
        }
        (Measured { windows }, stat(&all, all_failed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    #[test]
    fn memcached_answers_are_framed_by_their_lengths() {
        assert_eq!(frame_memcached(b"END\r\n"), Framed::Done(5, true));
        assert_eq!(frame_memcached(b"STORED\r\n"), Framed::Done(8, true));
        let v = b"VALUE rb:000001 0 3\r\nEND\r\nEND\r\n";
        assert_eq!(frame_memcached(v), Framed::Done(v.len(), true));
        assert_eq!(frame_memcached(&v[..20]), Framed::Incomplete);
        assert_eq!(
            frame_memcached(b"SERVER_ERROR oom\r\n"),
            Framed::Done(18, false)
        );
        assert_eq!(frame_memcached(b"HELLO\r\n"), Framed::Bad);
    }

    #[test]
    fn redis_and_http_answers_are_framed() {
        assert_eq!(frame_redis(b"+OK\r\n"), Framed::Done(5, true));
        assert_eq!(frame_redis(b"$-1\r\n"), Framed::Done(5, true));
        assert_eq!(frame_redis(b"$3\r\nabc\r\n"), Framed::Done(9, true));
        assert_eq!(frame_redis(b"$3\r\nab"), Framed::Incomplete);
        assert_eq!(frame_redis(b"-ERR x\r\n"), Framed::Done(8, false));
        assert_eq!(frame_redis(b"*1\r\n"), Framed::Bad);
        let ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi";
        assert_eq!(frame_http(ok), Framed::Done(ok.len(), true));
        assert_eq!(frame_http(&ok[..ok.len() - 1]), Framed::Incomplete);
        let nf = b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n";
        assert_eq!(frame_http(nf), Framed::Done(nf.len(), false));
        assert_eq!(
            frame_http(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"),
            Framed::Bad
        );
    }

    /// A fake redis that answers `+OK` to every request after `delay`, pipelined.
    fn fake_redis(delay: Duration) -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || {
            for s in l.incoming().flatten() {
                std::thread::spawn(move || {
                    let mut s = s;
                    let mut buf = [0u8; 4096];
                    let mut carry = Vec::new();
                    while let Ok(n) = s.read(&mut buf) {
                        if n == 0 {
                            return;
                        }
                        carry.extend_from_slice(&buf[..n]);
                        // Each request here is a GET: "*2\r\n$3\r\nGET\r\n$9\r\nrb:xxxxxx\r\n".
                        while carry.len() >= 28 {
                            carry.drain(..28);
                            std::thread::sleep(delay);
                            if s.write_all(b"+OK\r\n").is_err() {
                                return;
                            }
                        }
                    }
                });
            }
        });
        addr
    }

    fn spec(addr: SocketAddr, rate: f64) -> LoadSpec {
        LoadSpec {
            proto: Proto::Redis,
            addr,
            rate_rps: rate,
            conns: 2,
            keys: 100,
            value_bytes: 10,
            set_every: 0,
            seed: 7,
        }
    }

    #[test]
    fn the_rate_is_held_and_every_second_gets_a_window() {
        let addr = fake_redis(Duration::ZERO);
        let load = Load::start(&spec(addr, 400.0), Instant::now(), 2).unwrap();
        let (m, total) = load.finish(0);
        assert_eq!(m.windows.len(), 2);
        for w in &m.windows {
            assert!((380..=420).contains(&w.requests), "{w:?}");
            assert_eq!(w.failed, 0, "{w:?}");
            assert!(w.p99_us < 200_000, "{w:?}");
        }
        assert_eq!(
            total.requests,
            m.windows.iter().map(|w| w.requests).sum::<u64>()
        );
    }

    #[test]
    fn a_slow_server_is_charged_to_every_request_due_while_it_was_slow() {
        // 8 ms per answer, one at a time per connection, 400 requests/s over 2 connections:
        // each connection gets 200/s but is answered at 125/s at most, so a queue builds and
        // latency measured from the due time grows; a closed-loop client would report 8 ms.
        let addr = fake_redis(Duration::from_millis(8));
        let load = Load::start(&spec(addr, 400.0), Instant::now(), 2).unwrap();
        let (m, _) = load.finish(0);
        let last = m.windows[1];
        assert!(last.requests >= 380, "the rate held: {last:?}");
        assert!(last.p99_us > 20_000, "queueing shows: {last:?}");
    }

    #[test]
    fn a_server_that_is_gone_makes_every_request_fail() {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        assert!(check(&Proto::Redis, &addr, Duration::from_millis(200)).is_err());
        let load = Load::start(&spec(addr, 100.0), Instant::now(), 1).unwrap();
        let (m, total) = load.finish(0);
        assert!(m.windows[0].requests >= 90, "{:?}", m.windows[0]);
        assert_eq!(m.windows[0].failed, m.windows[0].requests);
        assert!(total.p99_us >= FAILED_US * 99 / 100, "{total:?}");
    }
}
