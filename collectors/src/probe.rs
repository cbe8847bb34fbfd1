//! Built-in latency probes: cohabit times requests to a service itself, for services that
//! export no latency histogram.
//!
//! Problem: most services (memcached, redis, a plain nginx) report no latency distribution,
//! and a policy needs a p99 per tick. The service may be slow, silent or hostile (a pod's
//! annotation names it): nothing it does may hold up whoever starts, reads or drops a probe
//! (the daemon does all three inside its control tick).
//!
//! Approach: one dedicated thread per service makes the connection, sends small requests on
//! a fixed schedule (`rate_hz`) over one keep-alive TCP connection and records each latency
//! in an HDR histogram; each tick the daemon drains the window ([`Probe::take`]) into a p99,
//! a request rate and the histogram itself (to merge over ticks, [`crate::window`]), as it
//! does for pushed latencies ([`crate::latency::PushListener`]). [`Probe::start`] only
//! spawns that thread: a service that does not answer shows as time-outs and errors in the
//! windows (violations), never as a start that waits. Whoever wants the service to answer
//! before going on asks for the first request's outcome ([`Probe::first_answer`]); the
//! daemon does so only for the services of its configuration file, at start.
//!
//! Algorithm: request `k` is due at `start + k / rate_hz` (the first at once). A request is
//! charged what the service cost it: from when it was sent to when its answer arrived
//! (the kernel's receive time of the answer's last segment, `SO_TIMESTAMPNS`, where the
//! socket gives one), plus the time it was due while the thread still waited for the
//! previous answer. So a slow response that delays the next requests is charged to them as
//! well (no coordinated omission), while the probe thread's own scheduling (waking late
//! from its sleep, or reading an answer late on a busy host) is not charged to the service;
//! a late thread sends the requests it owes at once. A request not answered by
//! `due + timeout` is a violation recorded as the time-out value, and the connection is
//! replaced (a late answer would be taken for the next one). A request already past its
//! deadline when its turn comes, and a connection that cannot be made (refused, or not
//! made by the deadline), are violations too; the next due request connects again. Every
//! wait of the thread (connect, send, read, sleep) lasts at most [`STOP_POLL`] before it
//! looks at the stop flag again.
//!
//! Properties: only the host and port named by the [`ProbeUrl`] are contacted (IP
//! literals or `localhost`; names are never resolved); starting a probe does no network
//! I/O; the thread's own CPU time is measured and reported per window (asking for receive
//! times makes the kernel stamp every packet it receives, one clock read each, while any
//! socket asks); dropping a [`Probe`] never waits for the network: its thread sees the
//! stop flag within [`STOP_POLL`], closes its connection and ends. Protocols: memcached
//! text (`set` of the probe key once per connection, then `get`), redis RESP (`PING`) and
//! HTTP/1.1 `GET` on plain TCP (no TLS).

use std::fmt;
use std::io::{self, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream};
use std::os::fd::{AsFd, AsRawFd};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

/// Largest latency recorded: one hour in microseconds.
const MAX_US: u64 = 3_600_000_000;
/// Largest response read (a probe reads small answers; a bigger one is an error).
const MAX_RESPONSE: usize = 1 << 20;
/// The memcached key the probe sets and reads.
pub const MEMCACHED_KEY: &str = "cohabit-probe";
/// Highest request rate a probe accepts.
pub const MAX_RATE_HZ: u32 = 10_000;

/// Why a probe could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// The URL is not one a probe accepts.
    #[error("probe URL {url:?}: {reason}")]
    Url {
        /// The URL as given.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The rate or time-out is out of range.
    #[error("probe {url}: {reason}")]
    Settings {
        /// The URL.
        url: String,
        /// What is wrong.
        reason: String,
    },
    /// The service did not answer the first request ([`Probe::first_answer`]).
    #[error("probe {url} does not answer: {detail}")]
    Unreachable {
        /// The URL.
        url: String,
        /// What happened.
        detail: String,
    },
    /// The probe thread could not be started.
    #[error("starting the probe thread for {url}: {source}")]
    Thread {
        /// The URL.
        url: String,
        /// OS error.
        source: io::Error,
    },
}

/// The protocol a probe speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheme {
    /// memcached text protocol.
    Memcached,
    /// redis RESP.
    Redis,
    /// HTTP/1.1 on plain TCP.
    Http,
}

impl Scheme {
    fn name(self) -> &'static str {
        match self {
            Scheme::Memcached => "memcached",
            Scheme::Redis => "redis",
            Scheme::Http => "http",
        }
    }

    fn default_port(self) -> u16 {
        match self {
            Scheme::Memcached => 11211,
            Scheme::Redis => 6379,
            Scheme::Http => 80,
        }
    }
}

/// A probe target: `memcached://HOST:PORT`, `redis://HOST:PORT` or `http://HOST:PORT/PATH`.
///
/// HOST is an IPv4 literal, a bracketed IPv6 literal or `localhost` (127.0.0.1); names are
/// not resolved, so nothing but the named address is ever contacted. The port defaults to
/// the protocol's (11211, 6379, 80). No user info, no fragment; a query only for http.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeUrl {
    /// Protocol.
    pub scheme: Scheme,
    /// The host as written (`127.0.0.1`, `[::1]`, `localhost`), for the `Host` header.
    pub host: String,
    /// The address contacted.
    pub addr: SocketAddr,
    /// Request target for http (`/` by default, query included); empty otherwise.
    pub path: String,
}

impl fmt::Display for ProbeUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}://{}:{}{}",
            self.scheme.name(),
            self.host,
            self.addr.port(),
            self.path
        )
    }
}

impl FromStr for ProbeUrl {
    type Err = ProbeError;

    fn from_str(url: &str) -> Result<Self, ProbeError> {
        let bad = |reason: &str| ProbeError::Url {
            url: url.to_string(),
            reason: reason.to_string(),
        };
        if url.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(bad("contains white space or control characters"));
        }
        let (scheme, rest) = url
            .split_once("://")
            .ok_or_else(|| bad("needs a scheme: memcached://, redis:// or http://"))?;
        let scheme = match scheme {
            "memcached" => Scheme::Memcached,
            "redis" => Scheme::Redis,
            "http" => Scheme::Http,
            "https" | "rediss" => return Err(bad("TLS is not supported; use plain TCP")),
            _ => return Err(bad("the scheme must be memcached, redis or http")),
        };
        if rest.contains('#') {
            return Err(bad("a fragment (#...) has no meaning here"));
        }
        let split = rest.find(['/', '?']).unwrap_or(rest.len());
        let (authority, target) = rest.split_at(split);
        if authority.contains('@') {
            return Err(bad("user information (user@host) is not supported"));
        }
        let (host, port) = split_host_port(authority).map_err(|r| bad(&r))?;
        let ip: IpAddr = if host == "localhost" {
            IpAddr::V4(Ipv4Addr::LOCALHOST)
        } else if let Some(v6) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
            v6.parse().map_err(|_| bad("not an IPv6 address"))?
        } else {
            host.parse().map_err(|_| {
                bad("the host must be an IP address or localhost (names are not resolved)")
            })?
        };
        let port = port.unwrap_or_else(|| scheme.default_port());
        let path = match scheme {
            Scheme::Http if target.is_empty() => "/".to_string(),
            Scheme::Http if target.starts_with('?') => format!("/{target}"),
            Scheme::Http => target.to_string(),
            _ if target.is_empty() || target == "/" => String::new(),
            _ => return Err(bad("memcached and redis probes take no path or query")),
        };
        Ok(Self {
            scheme,
            host: host.to_string(),
            addr: SocketAddr::new(ip, port),
            path,
        })
    }
}

/// `host[:port]` → host and the port if given.
fn split_host_port(authority: &str) -> Result<(&str, Option<u16>), String> {
    if authority.is_empty() {
        return Err("needs a host".into());
    }
    let (host, port) = if authority.starts_with('[') {
        let end = authority
            .find(']')
            .ok_or("an IPv6 address needs its closing ]")?;
        let (h, rest) = authority.split_at(end + 1);
        match rest {
            "" => (h, None),
            r => (
                h,
                Some(
                    r.strip_prefix(':')
                        .ok_or("expected :PORT after the IPv6 address")?,
                ),
            ),
        }
    } else {
        match authority.split_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (authority, None),
        }
    };
    let port = port
        .map(|p| match p.parse::<u16>() {
            Ok(n) if n > 0 && p.bytes().all(|b| b.is_ascii_digit()) => Ok(n),
            _ => Err(format!("port {p:?} must be a number from 1 to 65535")),
        })
        .transpose()?;
    if host.is_empty() {
        return Err("needs a host".into());
    }
    Ok((host, port))
}

/// How a response ended, as parsed from the bytes read so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parse {
    /// More bytes are needed.
    Incomplete,
    /// A whole response of this many bytes that answers the request.
    Ok(usize),
    /// A whole response of this many bytes that reports an error (`SERVER_ERROR`, `-ERR`,
    /// an HTTP 5xx).
    Failed(usize),
    /// Not this protocol: the connection cannot be trusted any more.
    Garbled,
}

fn line_end(buf: &[u8], from: usize) -> Option<usize> {
    buf.get(from..)?
        .windows(2)
        .position(|w| w == b"\r\n")
        .map(|p| from + p)
}

/// A memcached text-protocol reply to `get` (`VALUE … END`, or `END` on a miss) or to `set`
/// (`STORED`).
pub fn parse_memcached(buf: &[u8]) -> Parse {
    let mut at = 0;
    loop {
        let Some(end) = line_end(buf, at) else {
            return Parse::Incomplete;
        };
        let line = &buf[at..end];
        let next = end + 2;
        if line == b"END" || line == b"STORED" {
            return Parse::Ok(next);
        }
        if line.starts_with(b"SERVER_ERROR")
            || line.starts_with(b"CLIENT_ERROR")
            || line == b"ERROR"
            || line == b"NOT_STORED"
        {
            return Parse::Failed(next);
        }
        let Some(rest) = line.strip_prefix(b"VALUE ") else {
            return Parse::Garbled;
        };
        let bytes = std::str::from_utf8(rest)
            .ok()
            .and_then(|r| r.split_whitespace().nth(2))
            .and_then(|n| n.parse::<usize>().ok());
        let Some(bytes) = bytes else {
            return Parse::Garbled;
        };
        let data_end = next + bytes;
        if buf.len() < data_end + 2 {
            return Parse::Incomplete;
        }
        if &buf[data_end..data_end + 2] != b"\r\n" {
            return Parse::Garbled;
        }
        at = data_end + 2;
    }
}

/// A redis reply to `PING`: a simple string (`+PONG`) or an error (`-ERR …`).
pub fn parse_redis(buf: &[u8]) -> Parse {
    let Some(end) = line_end(buf, 0) else {
        return Parse::Incomplete;
    };
    match buf.first() {
        Some(b'+') => Parse::Ok(end + 2),
        Some(b'-') => Parse::Failed(end + 2),
        _ => Parse::Garbled,
    }
}

/// An HTTP/1.1 response with a `Content-Length` or chunked body; a 5xx status is a failure.
/// A response delimited by the connection closing is reported `Incomplete` until then
/// (see [`http_close_delimited`]).
pub fn parse_http(buf: &[u8]) -> Parse {
    let Some(head_end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
        return Parse::Incomplete;
    };
    let Ok(head) = std::str::from_utf8(&buf[..head_end]) else {
        return Parse::Garbled;
    };
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let mut parts = status_line.split(' ');
    let (Some(version), Some(code)) = (parts.next(), parts.next()) else {
        return Parse::Garbled;
    };
    let Ok(code) = code.parse::<u16>() else {
        return Parse::Garbled;
    };
    if !version.starts_with("HTTP/1.") {
        return Parse::Garbled;
    }
    let mut length = None;
    let mut chunked = false;
    for l in lines {
        let Some((k, v)) = l.split_once(':') else {
            return Parse::Garbled;
        };
        let (k, v) = (k.trim(), v.trim());
        if k.eq_ignore_ascii_case("content-length") {
            match v.parse::<usize>() {
                Ok(n) => length = Some(n),
                Err(_) => return Parse::Garbled,
            }
        } else if k.eq_ignore_ascii_case("transfer-encoding") {
            chunked = v.to_ascii_lowercase().contains("chunked");
        }
    }
    let body_start = head_end + 4;
    let no_body = (100..200).contains(&code) || code == 204 || code == 304;
    let end = if no_body {
        Some(body_start)
    } else if chunked {
        match chunked_end(buf, body_start) {
            Ok(e) => e,
            Err(()) => return Parse::Garbled,
        }
    } else {
        match length {
            Some(n) => (buf.len() >= body_start + n).then_some(body_start + n),
            None => None,
        }
    };
    match end {
        None => Parse::Incomplete,
        Some(e) if code >= 500 => Parse::Failed(e),
        Some(e) => Parse::Ok(e),
    }
}

/// Whether a response's length is only known when the server closes the connection.
pub fn http_close_delimited(buf: &[u8]) -> bool {
    let Some(head_end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
        return false;
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
    !head.contains("\r\ncontent-length:") && !head.contains("\r\ntransfer-encoding:")
}

/// End of a chunked body starting at `at`: `Ok(None)` while incomplete.
fn chunked_end(buf: &[u8], mut at: usize) -> Result<Option<usize>, ()> {
    loop {
        let Some(end) = line_end(buf, at) else {
            return Ok(None);
        };
        let size_text = std::str::from_utf8(&buf[at..end]).map_err(|_| ())?;
        let size_text = size_text.split(';').next().unwrap_or_default().trim();
        let size = usize::from_str_radix(size_text, 16).map_err(|_| ())?;
        at = end + 2;
        if size == 0 {
            // Trailers, then an empty line.
            loop {
                let Some(e) = line_end(buf, at) else {
                    return Ok(None);
                };
                let empty = e == at;
                at = e + 2;
                if empty {
                    return Ok(Some(at));
                }
            }
        }
        if buf.len() < at + size + 2 {
            return Ok(None);
        }
        at += size + 2;
    }
}

/// The bytes of one probe request.
fn request(url: &ProbeUrl) -> Vec<u8> {
    match url.scheme {
        Scheme::Memcached => format!("get {MEMCACHED_KEY}\r\n").into_bytes(),
        Scheme::Redis => b"*1\r\n$4\r\nPING\r\n".to_vec(),
        Scheme::Http => format!(
            "GET {} HTTP/1.1\r\nHost: {}:{}\r\nUser-Agent: cohabit-probe\r\nAccept: */*\r\n\r\n",
            url.path,
            url.host,
            url.addr.port()
        )
        .into_bytes(),
    }
}

fn parser(scheme: Scheme) -> fn(&[u8]) -> Parse {
    match scheme {
        Scheme::Memcached => parse_memcached,
        Scheme::Redis => parse_redis,
        Scheme::Http => parse_http,
    }
}

/// Why one request did not give a latency.
#[derive(Debug)]
enum Miss {
    /// No answer by the deadline.
    TimedOut,
    /// The connection failed or the answer was an error.
    Failed(String),
    /// The probe was dropped while the request was under way: nothing to record.
    Stopped,
}

/// How long the thread may wait now: at most [`STOP_POLL`], and not past `deadline`.
fn slice(deadline: Instant, stop: &AtomicBool) -> Result<Duration, Miss> {
    if stop.load(Ordering::Relaxed) {
        return Err(Miss::Stopped);
    }
    Ok(remaining(deadline)?.min(STOP_POLL))
}

/// True for the errors of a wait that merely ran out ([`slice`]) or was interrupted.
fn waited(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
    )
}

/// Connects to `addr` by `deadline` without blocking past [`STOP_POLL`] at a time (a
/// non-blocking connect, then `poll`), so that a drop is seen while an address does not
/// answer.
fn connect(addr: SocketAddr, deadline: Instant, stop: &AtomicBool) -> Result<TcpStream, Miss> {
    use nix::errno::Errno;
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    use nix::sys::socket::{self, sockopt, AddressFamily, SockFlag, SockType, SockaddrStorage};
    let errno = |e: Errno| io_miss(&io::Error::from(e));
    let family = match addr {
        SocketAddr::V4(_) => AddressFamily::Inet,
        SocketAddr::V6(_) => AddressFamily::Inet6,
    };
    let flags = SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC;
    let fd = socket::socket(family, SockType::Stream, flags, None).map_err(errno)?;
    match socket::connect(fd.as_raw_fd(), &SockaddrStorage::from(addr)) {
        Ok(()) => {}
        Err(Errno::EINPROGRESS) => loop {
            // Rounded up, so that a wait short of a millisecond does not spin.
            let ms = slice(deadline, stop)?.as_millis().saturating_add(1);
            let mut fds = [PollFd::new(fd.as_fd(), PollFlags::POLLOUT)];
            match poll(
                &mut fds,
                PollTimeout::from(u16::try_from(ms).unwrap_or(u16::MAX)),
            ) {
                Ok(0) | Err(Errno::EINTR) => {}
                Ok(_) => break,
                Err(e) => return Err(errno(e)),
            }
        },
        Err(e) => return Err(errno(e)),
    }
    match socket::getsockopt(&fd, sockopt::SocketError) {
        Ok(0) => {}
        Ok(code) => return Err(io_miss(&io::Error::from_raw_os_error(code))),
        Err(e) => return Err(errno(e)),
    }
    let stream = TcpStream::from(fd);
    stream.set_nonblocking(false).map_err(|e| io_miss(&e))?;
    Ok(stream)
}

/// One keep-alive connection to the target.
struct Conn {
    stream: TcpStream,
    buf: Vec<u8>,
    /// Room for one control message: the kernel's receive time of a segment.
    cmsg: Vec<u8>,
}

impl Conn {
    fn open(url: &ProbeUrl, deadline: Instant, stop: &AtomicBool) -> Result<Self, Miss> {
        use nix::sys::socket::{setsockopt, sockopt};
        let stream = connect(url.addr, deadline, stop)?;
        let _ = stream.set_nodelay(true);
        // Without receive times the answer is timed when the thread reads it.
        let _ = setsockopt(&stream, sockopt::ReceiveTimestampns, &true);
        let mut c = Self {
            stream,
            buf: Vec::with_capacity(4096),
            cmsg: nix::cmsg_space!(nix::sys::time::TimeSpec),
        };
        if url.scheme == Scheme::Memcached {
            let set = format!("set {MEMCACHED_KEY} 0 0 1\r\nx\r\n");
            c.exchange(set.as_bytes(), parse_memcached, deadline, stop)?;
        }
        Ok(c)
    }

    /// Reads what has arrived into `chunk`: the byte count and the kernel's receive time
    /// (`CLOCK_REALTIME`) of the segment, where the socket gives one.
    fn recv(&mut self, chunk: &mut [u8]) -> io::Result<(usize, Option<Duration>)> {
        use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
        let mut iov = [io::IoSliceMut::new(chunk)];
        let msg = recvmsg::<()>(
            self.stream.as_raw_fd(),
            &mut iov,
            Some(&mut self.cmsg),
            MsgFlags::MSG_CMSG_CLOEXEC,
        )
        .map_err(io::Error::from)?;
        let stamp = msg.cmsgs().ok().and_then(|mut c| {
            c.find_map(|m| match m {
                ControlMessageOwned::ScmTimestampns(ts) => Some(Duration::from(ts)),
                _ => None,
            })
        });
        Ok((msg.bytes, stamp))
    }

    /// Sends all of `req` by `deadline`.
    fn send(&mut self, mut req: &[u8], deadline: Instant, stop: &AtomicBool) -> Result<(), Miss> {
        while !req.is_empty() {
            self.stream
                .set_write_timeout(Some(slice(deadline, stop)?))
                .map_err(|e| io_miss(&e))?;
            match self.stream.write(req) {
                Ok(0) => return Err(Miss::Failed("the connection takes no more bytes".into())),
                Ok(n) => req = &req[n..],
                Err(e) if waited(&e) => {}
                Err(e) => return Err(io_miss(&e)),
            }
        }
        Ok(())
    }

    /// Sends a request and reads its whole response by `deadline`; returns the kernel's
    /// receive time of the response's last segment, where the socket gave one.
    fn exchange(
        &mut self,
        req: &[u8],
        parse: fn(&[u8]) -> Parse,
        deadline: Instant,
        stop: &AtomicBool,
    ) -> Result<Option<Duration>, Miss> {
        self.send(req, deadline, stop)?;
        let mut chunk = [0u8; 4096];
        let mut stamp = None;
        loop {
            match parse(&self.buf) {
                Parse::Ok(n) => {
                    self.buf.drain(..n);
                    return if self.buf.is_empty() {
                        Ok(stamp)
                    } else {
                        Err(Miss::Failed("more bytes than one response".into()))
                    };
                }
                Parse::Failed(n) => {
                    let text = String::from_utf8_lossy(&self.buf[..n.min(120)]).into_owned();
                    self.buf.drain(..n);
                    return Err(Miss::Failed(format!("error reply: {}", text.trim())));
                }
                Parse::Garbled => return Err(Miss::Failed("unexpected reply".into())),
                Parse::Incomplete if self.buf.len() > MAX_RESPONSE => {
                    return Err(Miss::Failed("reply larger than 1 MiB".into()))
                }
                Parse::Incomplete => {}
            }
            self.stream
                .set_read_timeout(Some(slice(deadline, stop)?))
                .map_err(|e| io_miss(&e))?;
            match self.recv(&mut chunk) {
                Ok((0, _)) if http_close_delimited(&self.buf) => {
                    self.buf.clear();
                    return Err(Miss::Failed(
                        "the server closes after each response (no keep-alive)".into(),
                    ));
                }
                Ok((0, _)) => return Err(Miss::Failed("connection closed by the server".into())),
                Ok((n, at)) => {
                    self.buf.extend_from_slice(&chunk[..n]);
                    stamp = at;
                }
                // The slice ran out: look at the deadline and the stop flag again.
                Err(e) if waited(&e) => {}
                Err(e) => return Err(io_miss(&e)),
            }
        }
    }
}

fn remaining(deadline: Instant) -> Result<Duration, Miss> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        Err(Miss::TimedOut)
    } else {
        Ok(left)
    }
}

fn io_miss(e: &io::Error) -> Miss {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => Miss::TimedOut,
        _ => Miss::Failed(e.to_string()),
    }
}

/// One tick of probe results.
#[derive(Debug, Clone, PartialEq)]
pub struct ProbeWindow {
    /// p99 in milliseconds over answered and violated requests, if any was due.
    pub p99_ms: Option<f64>,
    /// Requests due in the window (answered, timed out or failed).
    pub count: u64,
    /// Requests not answered within the time-out (counted at the time-out value).
    pub timeouts: u64,
    /// Requests that failed: no connection, an error reply (counted at the time-out value).
    pub errors: u64,
    /// The most recent failure, if any.
    pub last_error: Option<String>,
    /// CPU time the probe thread used in the window, in seconds.
    pub cpu_s: f64,
    /// The requests' latencies in µs (violations at the time-out), sized to the slowest
    /// ([`crate::window::compact`]): what a [`crate::window::HdrWindow`] merges with other
    /// ticks'.
    pub hist: Histogram<u64>,
}

/// The outcome of the first request (`None` until it has one), and its waiters.
#[derive(Debug, Default)]
struct First {
    outcome: Mutex<Option<Result<(), String>>>,
    known: Condvar,
}

/// How much longer than its time-out [`Probe::first_answer`] waits for the first outcome
/// (the thread records a time-out at the deadline; this covers its scheduling).
pub const FIRST_ANSWER_GRACE: Duration = Duration::from_secs(1);

#[derive(Debug)]
struct Window {
    hist: Histogram<u64>,
    timeouts: u64,
    errors: u64,
    last_error: Option<String>,
}

/// A running probe: a thread timing requests to one service.
#[derive(Debug)]
pub struct Probe {
    url: ProbeUrl,
    timeout: Duration,
    window: Arc<Mutex<Window>>,
    first: Arc<First>,
    cpu_ns: Arc<AtomicU64>,
    cpu_taken_ns: u64,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// Probe settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeSettings {
    /// Requests per second, 1 to [`MAX_RATE_HZ`].
    pub rate_hz: u32,
    /// Per-request time-out; also the first request's.
    pub timeout: Duration,
}

impl ProbeSettings {
    /// Checks the ranges; errors name the URL.
    pub fn validate(&self, url: &str) -> Result<(), ProbeError> {
        let bad = |reason: String| ProbeError::Settings {
            url: url.to_string(),
            reason,
        };
        if !(1..=MAX_RATE_HZ).contains(&self.rate_hz) {
            return Err(bad(format!(
                "rate_hz must be from 1 to {MAX_RATE_HZ}, got {}",
                self.rate_hz
            )));
        }
        if self.timeout.is_zero() {
            return Err(bad("the time-out must be positive".into()));
        }
        Ok(())
    }
}

impl Probe {
    /// Starts the probe thread, which connects and sends the first request itself: this
    /// does no network I/O and never waits on the service (one that does not answer shows
    /// as time-outs or errors in the windows). Errors name the URL: settings out of range,
    /// or no thread.
    pub fn start(url: &ProbeUrl, settings: &ProbeSettings) -> Result<Self, ProbeError> {
        settings.validate(&url.to_string())?;
        let hist = Histogram::new_with_bounds(1, MAX_US, 3).map_err(|e| ProbeError::Thread {
            url: url.to_string(),
            source: io::Error::other(e.to_string()),
        })?;
        let window = Arc::new(Mutex::new(Window {
            hist,
            timeouts: 0,
            errors: 0,
            last_error: None,
        }));
        let cpu_ns = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let first = Arc::new(First::default());
        let worker = Worker {
            url: url.clone(),
            period: Duration::from_secs(1) / settings.rate_hz,
            timeout: settings.timeout,
            window: Arc::clone(&window),
            first: Arc::clone(&first),
            cpu_ns: Arc::clone(&cpu_ns),
            stop: Arc::clone(&stop),
        };
        let thread = std::thread::Builder::new()
            .name("cohabit-probe".into())
            .spawn(move || worker.run())
            .map_err(|source| ProbeError::Thread {
                url: url.to_string(),
                source,
            })?;
        Ok(Self {
            url: url.clone(),
            timeout: settings.timeout,
            window,
            first,
            cpu_ns,
            cpu_taken_ns: 0,
            stop,
            thread: Some(thread),
        })
    }

    /// The target.
    pub fn url(&self) -> &ProbeUrl {
        &self.url
    }

    /// Waits for the outcome of the first request, at most the time-out and
    /// [`FIRST_ANSWER_GRACE`]: `Ok` when it was answered, why not otherwise (errors name
    /// the URL). For whoever wants a service to answer before going on (the daemon, for
    /// the services of its configuration file, at start); nothing else waits on a probe.
    pub fn first_answer(&self) -> Result<(), ProbeError> {
        let guard = self
            .first
            .outcome
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let (guard, _) = self
            .first
            .known
            .wait_timeout_while(guard, self.timeout + FIRST_ANSWER_GRACE, |o| o.is_none())
            .unwrap_or_else(PoisonError::into_inner);
        let detail = match &*guard {
            Some(Ok(())) => return Ok(()),
            Some(Err(detail)) => detail.clone(),
            None => format!("no outcome within {} ms", self.timeout.as_millis()),
        };
        Err(ProbeError::Unreachable {
            url: self.url.to_string(),
            detail,
        })
    }

    /// The requests due since the last call, and the thread's CPU time in that span;
    /// starts a new window.
    pub fn take(&mut self) -> ProbeWindow {
        let mut w = self.window.lock().unwrap_or_else(PoisonError::into_inner);
        let count = w.hist.len();
        let p99_ms = (count > 0).then(|| w.hist.value_at_quantile(0.99) as f64 / 1000.0);
        let out = ProbeWindow {
            p99_ms,
            count,
            timeouts: w.timeouts,
            errors: w.errors,
            last_error: w.last_error.take(),
            cpu_s: 0.0,
            hist: crate::window::compact(&w.hist),
        };
        w.hist.reset();
        w.timeouts = 0;
        w.errors = 0;
        drop(w);
        let cpu = self.cpu_ns.load(Ordering::Relaxed);
        let used = cpu.saturating_sub(self.cpu_taken_ns);
        self.cpu_taken_ns = cpu;
        ProbeWindow {
            cpu_s: used as f64 / 1e9,
            ..out
        }
    }
}

impl Drop for Probe {
    /// Tells the thread to stop and does not wait for it: it sees the flag within
    /// [`STOP_POLL`] (whatever the service does), closes its connection and ends. A thread
    /// already ended is joined.
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            if t.is_finished() {
                let _ = t.join();
            }
        }
    }
}

/// The probe thread's state.
struct Worker {
    url: ProbeUrl,
    period: Duration,
    timeout: Duration,
    window: Arc<Mutex<Window>>,
    first: Arc<First>,
    cpu_ns: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
}

/// Longest a probe thread waits (sleeping, connecting, sending or reading) before it looks
/// at its stop flag again.
pub const STOP_POLL: Duration = Duration::from_millis(50);

impl Worker {
    fn run(self) {
        let mut conn: Option<Conn> = None;
        let req = request(&self.url);
        let parse = parser(self.url.scheme);
        let start = Instant::now();
        let period_ns = u64::try_from(self.period.as_nanos()).unwrap_or(u64::MAX);
        let mut k: u64 = 0;
        // When the service last let the thread go: its last answer, or the miss's end.
        let mut held_until = start;
        while !self.stop.load(Ordering::Relaxed) {
            let due = start + Duration::from_nanos(period_ns.saturating_mul(k));
            let now = Instant::now();
            if now < due {
                std::thread::sleep((due - now).min(STOP_POLL));
                continue;
            }
            k += 1;
            let deadline = due + self.timeout;
            let sent = Clocks::now();
            let result = match conn.take() {
                Some(c) => Ok(c),
                None => Conn::open(&self.url, deadline, &self.stop),
            }
            .and_then(|mut c| {
                c.exchange(&req, parse, deadline, &self.stop)
                    .map(|stamp| (c, stamp))
            });
            match result {
                Ok((c, stamp)) => {
                    conn = Some(c);
                    let answered = sent.answer_time(stamp);
                    self.record(Ok(charged(due, held_until, sent.mono, answered)));
                    held_until = answered;
                }
                Err(Miss::Stopped) => break,
                Err(m) => {
                    held_until = Instant::now();
                    self.record(Err(m));
                }
            }
            self.cpu_ns.store(thread_cpu_ns(), Ordering::Relaxed);
        }
    }

    fn record(&self, outcome: Result<Duration, Miss>) {
        self.note_first(&outcome);
        let mut w = self.window.lock().unwrap_or_else(PoisonError::into_inner);
        let latency = match outcome {
            Ok(d) => d,
            Err(Miss::TimedOut) => {
                w.timeouts += 1;
                self.timeout
            }
            Err(Miss::Failed(e)) => {
                w.errors += 1;
                w.last_error = Some(e);
                self.timeout
            }
            Err(Miss::Stopped) => return,
        };
        let us = u64::try_from(latency.as_micros()).unwrap_or(MAX_US);
        let _ = w.hist.record(us.clamp(1, MAX_US));
    }

    /// Keeps the first request's outcome for [`Probe::first_answer`].
    fn note_first(&self, outcome: &Result<Duration, Miss>) {
        let mut first = self
            .first
            .outcome
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if first.is_some() {
            return;
        }
        *first = Some(match outcome {
            Ok(_) => Ok(()),
            Err(Miss::TimedOut) => Err(format!("no answer within {} ms", self.timeout.as_millis())),
            Err(Miss::Failed(e)) => Err(e.clone()),
            Err(Miss::Stopped) => return,
        });
        self.first.known.notify_all();
    }
}

/// What a request due at `due`, sent at `sent` and answered at `answered` cost, when the
/// service last let the thread go at `held_until`: its exchange, plus the time it was due
/// while the service held the thread. The thread's own lateness past both is not charged.
fn charged(due: Instant, held_until: Instant, sent: Instant, answered: Instant) -> Duration {
    answered.saturating_duration_since(sent) + held_until.saturating_duration_since(due)
}

/// One moment read on the monotonic clock and on the wall clock (which the kernel's
/// receive times are on).
#[derive(Debug, Clone, Copy)]
struct Clocks {
    mono: Instant,
    real: Option<Duration>,
}

impl Clocks {
    fn now() -> Self {
        let real = nix::time::clock_gettime(nix::time::ClockId::CLOCK_REALTIME)
            .ok()
            .map(Duration::from);
        Self {
            mono: Instant::now(),
            real,
        }
    }

    /// When the answer that ends an exchange begun at `self` arrived: the kernel's receive
    /// time where there is one that falls between the start and now (a wall-clock step
    /// makes it fall outside), else now.
    fn answer_time(&self, stamp: Option<Duration>) -> Instant {
        let now = Instant::now();
        self.real
            .zip(stamp)
            .and_then(|(real, rx)| rx.checked_sub(real))
            .map(|d| self.mono + d)
            .filter(|&t| t <= now)
            .unwrap_or(now)
    }
}

/// CPU time of the calling thread in nanoseconds (0 if the clock cannot be read).
fn thread_cpu_ns() -> u64 {
    let Ok(ts) = nix::time::clock_gettime(nix::time::ClockId::CLOCK_THREAD_CPUTIME_ID) else {
        return 0;
    };
    u64::try_from(ts.tv_sec())
        .unwrap_or(0)
        .saturating_mul(1_000_000_000)
        .saturating_add(u64::try_from(ts.tv_nsec()).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::net::TcpListener;

    fn url(s: &str) -> ProbeUrl {
        s.parse().unwrap()
    }

    fn url_err(s: &str) -> String {
        s.parse::<ProbeUrl>().unwrap_err().to_string()
    }

    #[test]
    fn urls_parse_with_default_ports_and_paths() {
        let m = url("memcached://127.0.0.1:11311");
        assert_eq!(m.scheme, Scheme::Memcached);
        assert_eq!(m.addr, "127.0.0.1:11311".parse().unwrap());
        assert_eq!(m.path, "");
        assert_eq!(url("memcached://127.0.0.1/").addr.port(), 11211);
        assert_eq!(
            url("redis://localhost").addr,
            "127.0.0.1:6379".parse().unwrap()
        );
        let h = url("http://[::1]:8080/healthz?full=1");
        assert_eq!(h.addr, "[::1]:8080".parse().unwrap());
        assert_eq!(h.path, "/healthz?full=1");
        assert_eq!(h.host, "[::1]");
        assert_eq!(url("http://10.0.0.5").path, "/");
        assert_eq!(url("http://10.0.0.5?x").path, "/?x");
        assert_eq!(h.to_string(), "http://[::1]:8080/healthz?full=1");
    }

    #[test]
    fn bad_urls_say_what_is_wrong_and_name_the_url() {
        for (u, why) in [
            ("127.0.0.1:11211", "needs a scheme"),
            ("https://127.0.0.1/", "TLS"),
            ("gopher://127.0.0.1/", "scheme must be"),
            ("memcached://cache.internal:11211", "names are not resolved"),
            ("memcached://127.0.0.1:0", "port"),
            ("memcached://127.0.0.1:99999", "port"),
            ("memcached://127.0.0.1:+80", "port"),
            ("memcached://127.0.0.1:11211/db", "no path"),
            ("redis://127.0.0.1?x=1", "no path"),
            ("http://user@127.0.0.1/", "user information"),
            ("http://127.0.0.1/#top", "fragment"),
            ("http://127.0.0.1/a b", "white space"),
            ("http://:80/", "needs a host"),
            ("http://[::1/", "closing ]"),
            ("http://[::1]x/", ":PORT"),
            ("http://[zz]/", "IPv6"),
        ] {
            let e = url_err(u);
            assert!(e.contains(why), "{u}: {e}");
            assert!(e.contains(u), "{u}: {e}");
        }
    }

    proptest::proptest! {
        #[test]
        fn a_url_prints_back_to_itself(
            scheme in 0..3usize,
            ip in proptest::prelude::any::<[u8; 4]>(),
            port in 1..=65535u16,
            path in "(/[a-z0-9._~-]{0,8}){0,3}(\\?[a-z0-9=&]{0,8})?",
        ) {
            let scheme = ["memcached", "redis", "http"][scheme];
            let ip = std::net::Ipv4Addr::from(ip);
            let path = if scheme == "http" { path } else { String::new() };
            let u: ProbeUrl = format!("{scheme}://{ip}:{port}{path}").parse().unwrap();
            let again: ProbeUrl = u.to_string().parse().unwrap();
            proptest::prop_assert_eq!(&again, &u);
            proptest::prop_assert_eq!(u.addr, SocketAddr::new(ip.into(), port));
        }
    }

    #[test]
    fn memcached_replies_are_framed_exactly() {
        assert_eq!(parse_memcached(b"END\r\n"), Parse::Ok(5));
        assert_eq!(parse_memcached(b"STORED\r\n"), Parse::Ok(8));
        let hit = b"VALUE cohabit-probe 0 1\r\nx\r\nEND\r\n";
        assert_eq!(parse_memcached(hit), Parse::Ok(hit.len()));
        for cut in 0..hit.len() {
            assert_eq!(parse_memcached(&hit[..cut]), Parse::Incomplete, "{cut}");
        }
        // A value that itself contains "END\r\n" is skipped by its length.
        let tricky = b"VALUE k 0 5\r\nEND\r\n\r\nEND\r\n";
        assert_eq!(parse_memcached(tricky), Parse::Ok(tricky.len()));
        assert_eq!(
            parse_memcached(b"SERVER_ERROR out of memory\r\n"),
            Parse::Failed(28)
        );
        assert_eq!(parse_memcached(b"HTTP/1.1 400\r\n"), Parse::Garbled);
        assert_eq!(parse_memcached(b"VALUE k 0 1\r\nxy\r\n"), Parse::Garbled);
    }

    #[test]
    fn redis_replies_are_one_line() {
        assert_eq!(parse_redis(b"+PONG\r\n"), Parse::Ok(7));
        assert_eq!(parse_redis(b"+PONG\r"), Parse::Incomplete);
        assert_eq!(
            parse_redis(b"-NOAUTH Authentication required.\r\n"),
            Parse::Failed(34)
        );
        assert_eq!(parse_redis(b"$4\r\nPONG\r\n"), Parse::Garbled);
    }

    #[test]
    fn http_responses_end_by_length_or_chunks_and_5xx_fails() {
        let r = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello";
        assert_eq!(parse_http(r), Parse::Ok(r.len()));
        assert_eq!(parse_http(&r[..r.len() - 1]), Parse::Incomplete);
        let c = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;x=1\r\nhello\r\n0\r\n\r\n";
        assert_eq!(parse_http(c), Parse::Ok(c.len()));
        for cut in 0..c.len() {
            assert_eq!(parse_http(&c[..cut]), Parse::Incomplete, "{cut}");
        }
        let e = b"HTTP/1.1 503 Busy\r\ncontent-length: 0\r\n\r\n";
        assert_eq!(parse_http(e), Parse::Failed(e.len()));
        let nc = b"HTTP/1.1 304 Not Modified\r\nETag: x\r\n\r\n";
        assert_eq!(parse_http(nc), Parse::Ok(nc.len()));
        let close = b"HTTP/1.0 200 OK\r\nServer: x\r\n\r\nbody";
        assert_eq!(parse_http(close), Parse::Incomplete);
        assert!(http_close_delimited(close));
        assert!(!http_close_delimited(r));
        assert_eq!(parse_http(b"SSH-2.0-OpenSSH\r\n\r\n"), Parse::Garbled);
        assert_eq!(
            parse_http(b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n"),
            Parse::Garbled
        );
    }

    #[test]
    fn settings_are_range_checked() {
        let ok = ProbeSettings {
            rate_hz: 100,
            timeout: Duration::from_millis(50),
        };
        ok.validate("memcached://127.0.0.1").unwrap();
        let e = ProbeSettings {
            rate_hz: 0,
            ..ok.clone()
        }
        .validate("memcached://127.0.0.1")
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("rate_hz") && e.contains("memcached://127.0.0.1"),
            "{e}"
        );
        assert!(ProbeSettings {
            rate_hz: MAX_RATE_HZ + 1,
            ..ok.clone()
        }
        .validate("x")
        .is_err());
        assert!(ProbeSettings {
            timeout: Duration::ZERO,
            ..ok
        }
        .validate("x")
        .is_err());
    }

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    /// A server that accepts every connection and never answers (nor closes): each
    /// connection's end is reported on the channel when the probe closes it.
    fn mute_server() -> (u16, std::sync::mpsc::Receiver<Instant>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let (closed, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for s in l.incoming().take(100) {
                let Ok(mut s) = s else { return };
                let closed = closed.clone();
                std::thread::spawn(move || {
                    let mut buf = [0u8; 4096];
                    while matches!(s.read(&mut buf), Ok(n) if n > 0) {}
                    let _ = closed.send(Instant::now());
                });
            }
        });
        (port, rx)
    }

    #[test]
    fn starting_a_probe_never_waits_for_the_service() {
        let (port, _closed) = mute_server();
        let slow = ProbeSettings {
            rate_hz: 10,
            timeout: Duration::from_secs(5),
        };
        for u in [
            format!("redis://127.0.0.1:{port}"),
            format!("http://127.0.0.1:{port}/"),
            format!("memcached://127.0.0.1:{port}"),
            format!("redis://127.0.0.1:{}", free_port()),
        ] {
            let t = Instant::now();
            let p = Probe::start(&url(&u), &slow).unwrap_or_else(|e| panic!("{u}: {e}"));
            // The first request alone would take the 5 s time-out.
            assert!(
                t.elapsed() < Duration::from_secs(1),
                "{u}: {:?}",
                t.elapsed()
            );
            let t = Instant::now();
            drop(p);
            assert!(
                t.elapsed() < Duration::from_secs(1),
                "{u}: {:?}",
                t.elapsed()
            );
        }
    }

    #[test]
    fn a_service_that_never_answers_or_refuses_shows_as_misses_in_the_windows() {
        let (port, _closed) = mute_server();
        let settings = ProbeSettings {
            rate_hz: 20,
            timeout: Duration::from_millis(100),
        };
        let mut mute = Probe::start(&url(&format!("redis://127.0.0.1:{port}")), &settings).unwrap();
        let refused = free_port();
        let u = format!("redis://127.0.0.1:{refused}");
        let mut gone = Probe::start(&url(&u), &settings).unwrap();
        std::thread::sleep(Duration::from_millis(700));
        let w = mute.take();
        assert!(w.timeouts >= 3 && w.errors == 0, "{w:?}");
        let p99 = w.p99_ms.unwrap();
        assert!((99.0..=101.0).contains(&p99), "at the time-out: {w:?}");
        // Asked for, the first outcome says why.
        let e = gone.first_answer().unwrap_err().to_string();
        assert!(
            e.contains(&u) && e.contains("does not answer") && e.contains("refused"),
            "{e}"
        );
        let e = mute.first_answer().unwrap_err().to_string();
        assert!(e.contains("no answer within 100 ms"), "{e}");
        let w = gone.take();
        assert!(w.errors >= 3, "{w:?}");
        assert!(
            w.last_error.as_deref().unwrap().contains("refused"),
            "{w:?}"
        );
        assert!((99.0..=101.0).contains(&w.p99_ms.unwrap()), "{w:?}");
    }

    #[test]
    fn a_dropped_probe_closes_its_connection_without_waiting_for_the_time_out() {
        let (port, closed) = mute_server();
        let settings = ProbeSettings {
            rate_hz: 1,
            timeout: Duration::from_secs(30),
        };
        let p = Probe::start(&url(&format!("http://127.0.0.1:{port}/")), &settings).unwrap();
        // The first request is sent and waits for its answer.
        std::thread::sleep(Duration::from_millis(300));
        let dropped = Instant::now();
        drop(p);
        assert!(dropped.elapsed() < Duration::from_millis(500));
        let at = closed
            .recv_timeout(Duration::from_secs(5))
            .expect("the connection is closed well before the 30 s time-out");
        assert!(at.duration_since(dropped) < Duration::from_secs(5));
    }

    /// A redis server that reads PINGs and answers the `n`-th (from 1) after `answer(n)`,
    /// or never where that is `None`.
    fn redis_server(
        answer: impl Fn(usize) -> Option<Duration> + Send + 'static,
    ) -> (u16, std::thread::JoinHandle<()>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let h = std::thread::spawn(move || {
            let mut seen = 0;
            // Serve connections until the test ends (the listener dies with the process).
            for s in l.incoming().take(50) {
                let Ok(mut s) = s else { return };
                let mut buf = [0u8; 256];
                while let Ok(n) = s.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    seen += 1;
                    if let Some(after) = answer(seen) {
                        std::thread::sleep(after);
                        let _ = s.write_all(b"+PONG\r\n");
                    }
                }
            }
        });
        (port, h)
    }

    /// A server that answers the first `answered` PINGs, then reads but never answers.
    fn silent_redis(answered: usize) -> (u16, std::thread::JoinHandle<()>) {
        redis_server(move |n| (n <= answered).then_some(Duration::ZERO))
    }

    #[test]
    fn a_server_that_stops_answering_gives_timeouts_counted_at_the_timeout() {
        let (port, _server) = silent_redis(1);
        let u = url(&format!("redis://127.0.0.1:{port}"));
        let settings = ProbeSettings {
            rate_hz: 50,
            timeout: Duration::from_millis(30),
        };
        let mut p = Probe::start(&u, &settings).unwrap();
        std::thread::sleep(Duration::from_millis(400));
        let w = p.take();
        assert!(w.count >= 10, "{w:?}");
        assert!(w.timeouts >= 5, "{w:?}");
        let p99 = w.p99_ms.unwrap();
        assert!((29.0..=31.0).contains(&p99), "{w:?}");
        assert!(w.cpu_s >= 0.0 && w.cpu_s < 0.4, "{w:?}");
        drop(p);
    }

    #[test]
    fn the_schedule_holds_the_rate_and_a_window_starts_empty() {
        let (port, _server) = silent_redis(usize::MAX);
        let u = url(&format!("redis://127.0.0.1:{port}"));
        let settings = ProbeSettings {
            rate_hz: 200,
            timeout: Duration::from_millis(500),
        };
        let mut p = Probe::start(&u, &settings).unwrap();
        p.first_answer().unwrap();
        let _ = p.take();
        let t = Instant::now();
        std::thread::sleep(Duration::from_millis(500));
        let w = p.take();
        let expected = t.elapsed().as_secs_f64() * 200.0;
        let got = w.count as f64;
        assert!(
            (got - expected).abs() <= expected * 0.25 + 3.0,
            "{got} vs {expected}"
        );
        assert_eq!(w.timeouts + w.errors, 0, "{w:?}");
        assert!(w.p99_ms.unwrap() < 500.0);
        assert_eq!(p.url().addr.port(), port);
    }

    /// A redis server that answers at once, except the `slow`-th PING (from 1), which it
    /// answers after `stall`.
    fn stalling_redis(slow: usize, stall: Duration) -> u16 {
        redis_server(move |n| Some(if n == slow { stall } else { Duration::ZERO })).0
    }

    #[test]
    fn requests_due_while_the_service_stalls_are_charged_from_their_due_time() {
        let port = stalling_redis(20, Duration::from_millis(300));
        let settings = ProbeSettings {
            rate_hz: 100,
            timeout: Duration::from_secs(2),
        };
        let mut p = Probe::start(&url(&format!("redis://127.0.0.1:{port}")), &settings).unwrap();
        std::thread::sleep(Duration::from_millis(900));
        let w = p.take();
        assert_eq!(w.timeouts + w.errors, 0, "{w:?}");
        // The stalled request took 300 ms; about 30 more fell due behind it, each charged
        // what it waited: 290, 280, … ms. Charged from when they were sent instead, only
        // the stalled one would exceed a few milliseconds.
        let slow = w.hist.count_between(50_000, 400_000);
        assert!((20..=34).contains(&slow), "{slow} slow requests: {w:?}");
        assert!(w.hist.max() >= 290_000 && w.hist.max() <= 400_000, "{w:?}");
        let mid = w.hist.count_between(120_000, 200_000);
        assert!((5..=11).contains(&mid), "{mid} requests waited 120–200 ms");
    }

    #[test]
    fn an_answer_is_timed_when_it_arrived_not_when_the_thread_read_it() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut buf = [0u8; 64];
            let _ = s.read(&mut buf).unwrap();
            s.write_all(b"+PONG\r\n").unwrap();
            // Holds the connection open until the probe side is done.
            let _ = s.read(&mut buf);
        });
        let stop = AtomicBool::new(false);
        let u = url(&format!("redis://{addr}"));
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut c = Conn::open(&u, deadline, &stop).unwrap();
        let sent = Clocks::now();
        c.send(b"PING\r\n", deadline, &stop).unwrap();
        // The thread is busy elsewhere while the answer arrives.
        std::thread::sleep(Duration::from_millis(200));
        let mut chunk = [0u8; 64];
        let (n, stamp) = c.recv(&mut chunk).unwrap();
        assert_eq!(&chunk[..n], b"+PONG\r\n");
        assert!(stamp.is_some(), "loopback sockets give receive times");
        let took = sent.answer_time(stamp).duration_since(sent.mono);
        assert!(took < Duration::from_millis(100), "{took:?}");
        drop(c);
        server.join().unwrap();
    }

    #[test]
    fn a_receive_time_outside_the_exchange_is_not_believed() {
        let sent = Clocks::now();
        let real = sent.real.unwrap();
        std::thread::sleep(Duration::from_millis(20));
        let before = Instant::now();
        // Before the exchange began (the wall clock stepped back), or after now (stepped
        // forward), or none at all: the answer is timed now.
        for stamp in [
            Some(real - Duration::from_secs(1)),
            Some(real + Duration::from_secs(3600)),
            None,
        ] {
            assert!(sent.answer_time(stamp) >= before, "{stamp:?}");
        }
        let t = sent.answer_time(Some(real + Duration::from_millis(5)));
        assert_eq!(t.duration_since(sent.mono), Duration::from_millis(5));
    }

    #[test]
    fn a_request_is_charged_the_services_time_and_not_the_threads_own() {
        let ms = Duration::from_millis;
        let due = Instant::now();
        // The thread was free at the due time and woke 5 ms late: the 2 ms exchange only.
        assert_eq!(charged(due, due - ms(10), due + ms(5), due + ms(7)), ms(2));
        // The service held the thread 3 ms past the due time, and the thread then took
        // 1 ms more to send: the 3 ms and the exchange, not the thread's 1 ms.
        assert_eq!(charged(due, due + ms(3), due + ms(4), due + ms(6)), ms(5));
    }
}
