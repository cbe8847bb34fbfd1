//! The HTTP endpoint that serves the metrics.
//!
//! **Endpoint.** hyper's HTTP/1 server on the daemon's tokio runtime, with tower's limits.
//! It answers `GET /metrics` and `GET /`, and `GET /healthz` for a liveness probe: 200 while
//! the last successful tick (or, before the first, the start) is at most
//! [`Health::periods`] tick periods old, 503 after that, each with a line saying how old
//! (404 for other paths, 405 for other methods). It is
//! built so that no client can pin the daemon's file descriptors or its thread (security
//! review row 4). [`Limits`] holds the numbers:
//!
//! - at most `max_connections` sockets are open; when full, the oldest connection that has not
//!   yet sent a complete request head is closed to make room, and if every connection is in a
//!   request the new one is closed instead;
//! - a request head must arrive within `header_read_timeout`, and is at most
//!   `max_header_bytes` and `max_headers` (431 beyond);
//! - one request per connection (no keep-alive), and a connection lives at most
//!   `connection_timeout`, whatever it does;
//! - at most `max_in_flight` requests are handled at once, each within `request_timeout`
//!   (408), with a body of at most `max_body_bytes` (413);
//! - a failed `accept` (EMFILE, ENFILE, ENOBUFS) waits `accept_backoff` before the next one,
//!   and is logged at most once a minute.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::header::{HeaderMap, HeaderValue, ACCEPT, ALLOW, CONTENT_TYPE};
use hyper::server::conn::http1;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tower::{ServiceBuilder, ServiceExt as _};
use tower_http::limit::RequestBodyLimitLayer;
use tower_http::timeout::TimeoutLayer;

use super::metrics::{Exporter, Health};

/// The limits of the metrics endpoint (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Sockets open at once.
    pub max_connections: usize,
    /// Requests handled at once.
    pub max_in_flight: usize,
    /// Time for a client to send its request head, from the moment it is accepted.
    pub header_read_timeout: Duration,
    /// Time to answer a request once its head is read.
    pub request_timeout: Duration,
    /// Longest a connection stays open, whatever it does.
    pub connection_timeout: Duration,
    /// Size of a request head (request line and headers).
    pub max_header_bytes: usize,
    /// Number of request headers.
    pub max_headers: usize,
    /// Size of a request body.
    pub max_body_bytes: usize,
    /// Wait after a failed `accept`.
    pub accept_backoff: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: 64,
            max_in_flight: 32,
            header_read_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_secs(2),
            connection_timeout: Duration::from_secs(5),
            max_header_bytes: 8 * 1024,
            max_headers: 64,
            max_body_bytes: 1024,
            accept_backoff: Duration::from_millis(100),
        }
    }
}

/// `Content-Type` of the Prometheus text format.
pub const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";
/// `Content-Type` of the OpenMetrics text format.
pub const OPENMETRICS_TEXT: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

fn wants_openmetrics(headers: &HeaderMap) -> bool {
    headers
        .get_all(ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains("application/openmetrics-text"))
}

fn plain(status: StatusCode, text: &'static str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from_static(text.as_bytes())));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    r
}

/// The answer to `GET /healthz`: 200 while ticks succeed, 503 when the last successful one
/// is older than the health limit.
fn healthz(health: Health, now: Instant) -> Response<Full<Bytes>> {
    let (alive, age) = health.at(now);
    let text = format!(
        "{}: last successful tick {:.1} s ago (limit {:.1} s: {} tick periods of {} ms)\n",
        if alive { "ok" } else { "unhealthy" },
        age.as_secs_f64(),
        health.limit().as_secs_f64(),
        health.periods,
        health.interval.as_millis(),
    );
    let mut r = Response::new(Full::new(Bytes::from(text)));
    if !alive {
        *r.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
    }
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    r
}

/// Answers one request: the exposition for `GET /metrics` and `GET /`, the tick health for
/// `GET /healthz`.
fn respond<B>(exporter: &Mutex<Exporter>, req: &Request<B>) -> Response<Full<Bytes>> {
    if !matches!(req.uri().path(), "/metrics" | "/" | "/healthz") {
        return plain(
            StatusCode::NOT_FOUND,
            "only /metrics and /healthz are served\n",
        );
    }
    if req.method() != Method::GET {
        let mut r = plain(StatusCode::METHOD_NOT_ALLOWED, "only GET is served\n");
        r.headers_mut()
            .insert(ALLOW, HeaderValue::from_static("GET"));
        return r;
    }
    // A tick that panicked while holding the lock left counters that are still true.
    let ex = exporter.lock().unwrap_or_else(PoisonError::into_inner);
    if req.uri().path() == "/healthz" {
        let health = ex.health();
        drop(ex);
        return healthz(health, Instant::now());
    }
    let (content_type, body) = if wants_openmetrics(req.headers()) {
        (OPENMETRICS_TEXT, ex.render_openmetrics())
    } else {
        (PROMETHEUS_TEXT, ex.render())
    };
    drop(ex);
    let mut r = Response::new(Full::new(Bytes::from(body)));
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

/// The open connections of the endpoint, oldest first, for the connection cap.
#[derive(Debug)]
struct Connections {
    max: usize,
    next_id: u64,
    live: Arc<Mutex<BTreeMap<u64, Slot>>>,
}

/// One open connection as [`Connections`] sees it.
#[derive(Debug)]
struct Slot {
    /// Set once the connection's request head has been read.
    started: Arc<AtomicBool>,
    /// Dropped to tell the connection to close.
    _evict: oneshot::Sender<()>,
}

/// What an admitted connection holds: its flag, the eviction notice, and its place.
#[derive(Debug)]
struct Admitted {
    started: Arc<AtomicBool>,
    evicted: oneshot::Receiver<()>,
    release: Release,
}

/// Frees a connection's place when the connection ends.
#[derive(Debug)]
struct Release {
    id: u64,
    live: Arc<Mutex<BTreeMap<u64, Slot>>>,
}

impl Drop for Release {
    fn drop(&mut self) {
        self.live
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.id);
    }
}

impl Connections {
    fn new(max: usize) -> Self {
        Connections {
            max: max.max(1),
            next_id: 0,
            live: Arc::default(),
        }
    }

    /// Makes room for a new connection: when full, the oldest connection that has not sent
    /// its request head yet is told to close. `None` (refuse the new one) when every open
    /// connection is in a request.
    fn admit(&mut self) -> Option<Admitted> {
        let mut live = self.live.lock().unwrap_or_else(PoisonError::into_inner);
        if live.len() >= self.max {
            let idle = live
                .iter()
                .find(|(_, s)| !s.started.load(Ordering::Relaxed))
                .map(|(id, _)| *id)?;
            live.remove(&idle);
        }
        let id = self.next_id;
        self.next_id += 1;
        let started = Arc::new(AtomicBool::new(false));
        let (tx, evicted) = oneshot::channel();
        live.insert(
            id,
            Slot {
                started: Arc::clone(&started),
                _evict: tx,
            },
        );
        Some(Admitted {
            started,
            evicted,
            release: Release {
                id,
                live: Arc::clone(&self.live),
            },
        })
    }

    #[cfg(test)]
    fn open(&self) -> usize {
        self.live
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

/// Accept errors, logged at most once a minute with a count of those not logged.
#[derive(Debug, Default)]
struct AcceptErrors {
    last_logged: Option<Instant>,
    suppressed: u64,
}

impl AcceptErrors {
    const EVERY: Duration = Duration::from_secs(60);

    fn record(&mut self, e: &io::Error, now: Instant) {
        if self
            .last_logged
            .is_some_and(|t| now.duration_since(t) < Self::EVERY)
        {
            self.suppressed += 1;
            return;
        }
        tracing::warn!(error = %e, suppressed = self.suppressed, "metrics endpoint: accept failed; backing off");
        self.last_logged = Some(now);
        self.suppressed = 0;
    }
}

/// Whether an accept error concerns only the connection being accepted (the next accept
/// can follow at once), rather than the process (EMFILE, ENFILE, ENOBUFS, ENOMEM).
fn connection_error(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionRefused
    )
}

/// Calls `accept` until it succeeds, waiting `backoff` after each failure that is not about
/// one connection only, so that a process out of file descriptors does not spin.
async fn accept_with_backoff<T, F, Fut>(
    mut accept: F,
    backoff: Duration,
    errors: &mut AcceptErrors,
) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = io::Result<T>>,
{
    loop {
        match accept().await {
            Ok(t) => return t,
            Err(e) if connection_error(&e) => {}
            Err(e) => {
                errors.record(&e, Instant::now());
                tokio::time::sleep(backoff).await;
            }
        }
    }
}

/// Serves the metrics on `listener` with the default [`Limits`] until the task is dropped.
pub async fn serve(listener: TcpListener, exporter: Arc<Mutex<Exporter>>) {
    serve_with(listener, exporter, Limits::default()).await;
}

/// Serves the metrics on `listener` within `limits` until the task is dropped.
pub async fn serve_with(listener: TcpListener, exporter: Arc<Mutex<Exporter>>, limits: Limits) {
    let service = ServiceBuilder::new()
        .concurrency_limit(limits.max_in_flight.max(1))
        .layer(TimeoutLayer::with_status_code(
            StatusCode::REQUEST_TIMEOUT,
            limits.request_timeout,
        ))
        .layer(RequestBodyLimitLayer::new(limits.max_body_bytes))
        .service_fn(move |req: Request<_>| {
            std::future::ready(Ok::<_, Infallible>(respond(&exporter, &req)))
        });
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .keep_alive(false)
        .max_header_size(limits.max_header_bytes)
        .max_headers(limits.max_headers);
    let mut connections = Connections::new(limits.max_connections);
    let mut errors = AcceptErrors::default();
    loop {
        let (socket, _) =
            accept_with_backoff(|| listener.accept(), limits.accept_backoff, &mut errors).await;
        let Some(admitted) = connections.admit() else {
            drop(socket);
            continue;
        };
        let Admitted {
            started,
            evicted,
            release,
        } = admitted;
        let service = service.clone();
        let conn = http.serve_connection(
            TokioIo::new(socket),
            hyper::service::service_fn(move |req| {
                started.store(true, Ordering::Relaxed);
                service.clone().oneshot(req)
            }),
        );
        let lifetime = limits.connection_timeout;
        tokio::spawn(async move {
            let _release = release;
            tokio::select! {
                r = conn => if let Err(e) = r {
                    tracing::debug!(error = %e, "metrics connection ended with an error");
                },
                _ = evicted => tracing::debug!("metrics connection closed to make room"),
                () = tokio::time::sleep(lifetime) => {
                    tracing::debug!("metrics connection closed at its time limit");
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;
    use std::time::SystemTime;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    use super::super::metrics::tests::exercised;
    use super::super::metrics::METRICS;
    use super::*;

    #[test]
    fn when_full_the_oldest_connection_without_a_request_makes_room() {
        let mut c = Connections::new(3);
        let a = c.admit().unwrap();
        let mut b = c.admit().unwrap();
        let mut d = c.admit().unwrap();
        a.started.store(true, Ordering::Relaxed);
        let e = c.admit().unwrap();
        assert_eq!(c.open(), 3);
        assert!(
            b.evicted.try_recv().is_err(),
            "b, the oldest idle one, was told"
        );
        assert!(matches!(
            d.evicted.try_recv(),
            Err(oneshot::error::TryRecvError::Empty)
        ));
        drop(a);
        assert_eq!(c.open(), 2, "a closed connection frees its place");
        d.started.store(true, Ordering::Relaxed);
        let f = c.admit().unwrap();
        f.started.store(true, Ordering::Relaxed);
        e.started.store(true, Ordering::Relaxed);
        assert!(
            c.admit().is_none(),
            "all in a request: the new one is refused"
        );
        assert_eq!(c.open(), 3);
    }

    #[tokio::test]
    async fn accept_errors_back_off_instead_of_spinning() {
        // Three failures, then a connection: the loop waits out the backoff after each
        // failure. A timer never fires early, so this holds however loaded the machine is;
        // a loop that spun would be done at once.
        let backoff = Duration::from_millis(50);
        let mut calls = 0u32;
        let mut errors = AcceptErrors::default();
        let start = Instant::now();
        let got = accept_with_backoff(
            || {
                calls += 1;
                std::future::ready(if calls <= 3 {
                    Err(io::Error::from_raw_os_error(libc::EMFILE))
                } else {
                    Ok(calls)
                })
            },
            backoff,
            &mut errors,
        )
        .await;
        let took = start.elapsed();
        assert_eq!(got, 4, "it keeps accepting after failures");
        assert!(took >= 3 * backoff, "{took:?} for 3 failures");
        assert!(errors.suppressed >= 1, "logged once, not every time");
        let mut n = 0;
        let got = accept_with_backoff(
            || {
                n += 1;
                std::future::ready(if n < 3 {
                    Err(io::Error::from(io::ErrorKind::ConnectionAborted))
                } else {
                    Ok(n)
                })
            },
            Duration::from_secs(60),
            &mut errors,
        )
        .await;
        assert_eq!(got, 3, "an aborted connection is skipped without waiting");
    }

    async fn start(limits: Limits) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let exporter = Arc::new(Mutex::new(exercised()));
        tokio::spawn(serve_with(listener, exporter, limits));
        addr
    }

    /// Sends `request` and reads until the server closes, within `within`.
    async fn exchange(addr: SocketAddr, request: &[u8], within: Duration) -> io::Result<String> {
        let talk = async {
            let mut s = TcpStream::connect(addr).await?;
            s.write_all(request).await?;
            let mut out = Vec::new();
            s.read_to_end(&mut out).await?;
            Ok(String::from_utf8_lossy(&out).into_owned())
        };
        tokio::time::timeout(within, talk)
            .await
            .unwrap_or_else(|_| panic!("no answer within {within:?}"))
    }

    async fn get(addr: SocketAddr, path: &str, extra: &str) -> String {
        let req = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\n{extra}\r\n");
        exchange(addr, req.as_bytes(), Duration::from_secs(5))
            .await
            .unwrap()
    }

    fn header<'a>(response: &'a str, name: &str) -> Option<&'a str> {
        let head = response.split("\r\n\r\n").next()?;
        head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }

    #[tokio::test]
    async fn get_metrics_serves_every_declared_metric() {
        let addr = start(Limits::default()).await;
        let r = get(addr, "/metrics", "").await;
        assert!(r.starts_with("HTTP/1.1 200"), "{r}");
        assert_eq!(header(&r, "content-type"), Some(PROMETHEUS_TEXT));
        for m in METRICS {
            assert!(
                r.contains(&format!("\n# HELP {} {}\n", m.name, m.help)),
                "{r}"
            );
            assert!(r.contains(&format!("\n# TYPE {} {}\n", m.name, m.kind.as_str())));
        }
        let root = get(addr, "/", "").await;
        assert!(root.starts_with("HTTP/1.1 200"), "{root}");
        let om = get(
            addr,
            "/metrics",
            "Accept: application/openmetrics-text;version=1.0.0;q=0.5,text/plain;q=0.3\r\n",
        )
        .await;
        assert_eq!(header(&om, "content-type"), Some(OPENMETRICS_TEXT));
        assert!(om.ends_with("# EOF\n"), "{om}");
    }

    #[tokio::test]
    async fn healthz_answers_200_while_ticks_succeed_and_503_when_they_stop() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut ex = exercised();
        ex.set_health(Duration::from_millis(50), 4);
        let exporter = Arc::new(Mutex::new(ex));
        tokio::spawn(serve_with(
            listener,
            Arc::clone(&exporter),
            Limits::default(),
        ));
        let r = get(addr, "/healthz", "").await;
        assert!(r.starts_with("HTTP/1.1 200"), "{r}");
        assert!(r.contains("ok: last successful tick"), "{r}");
        // No successful tick for longer than 4 periods of 50 ms.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let r = get(addr, "/healthz", "").await;
        assert!(r.starts_with("HTTP/1.1 503"), "{r}");
        assert!(
            r.contains("unhealthy") && r.contains("4 tick periods of 50 ms"),
            "{r}"
        );
        // /metrics stays served meanwhile (the readiness probe).
        assert!(get(addr, "/metrics", "").await.starts_with("HTTP/1.1 200"));
        exporter.lock().unwrap().tick_succeeded(SystemTime::now());
        let r = get(addr, "/healthz", "").await;
        assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    }

    #[tokio::test]
    async fn other_paths_are_404_and_other_methods_405() {
        let addr = start(Limits::default()).await;
        let r = get(addr, "/debug", "").await;
        assert!(r.starts_with("HTTP/1.1 404"), "{r}");
        let r = exchange(
            addr,
            b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi",
            Duration::from_secs(5),
        )
        .await
        .unwrap();
        assert!(r.starts_with("HTTP/1.1 405"), "{r}");
        assert_eq!(header(&r, "allow"), Some("GET"));
    }

    /// A refused request is either answered with a 4xx or closed; it never hangs.
    fn refused(r: &io::Result<String>) -> bool {
        match r {
            Ok(text) => text.is_empty() || text.starts_with("HTTP/1.1 4"),
            Err(_) => true,
        }
    }

    #[tokio::test]
    async fn huge_headers_and_bodies_are_refused_not_waited_for() {
        let addr = start(Limits::default()).await;
        let big = "a".repeat(1 << 20);
        let req = format!("GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: {big}\r\n\r\n");
        let r = exchange(addr, req.as_bytes(), Duration::from_secs(5)).await;
        assert!(refused(&r), "{r:?}");
        let many: String = (0..200).map(|i| format!("X-{i}: 1\r\n")).collect();
        let req = format!("GET /metrics HTTP/1.1\r\nHost: x\r\n{many}\r\n");
        let r = exchange(addr, req.as_bytes(), Duration::from_secs(5)).await;
        assert!(refused(&r), "{r:?}");
        let req = "GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n\r\nxxxx";
        let r = exchange(addr, req.as_bytes(), Duration::from_secs(5)).await;
        assert!(
            r.as_ref().is_ok_and(|t| t.starts_with("HTTP/1.1 413")),
            "{r:?}"
        );
    }

    #[tokio::test]
    async fn a_silent_client_is_disconnected_after_the_header_timeout() {
        let limits = Limits {
            header_read_timeout: Duration::from_millis(300),
            ..Limits::default()
        };
        let addr = start(limits).await;
        let t = Instant::now();
        let r = exchange(addr, b"", Duration::from_secs(5)).await;
        let waited = t.elapsed();
        assert!(refused(&r), "{r:?}");
        assert!(waited >= Duration::from_millis(250), "{waited:?}");
        // A client that starts a request head and never ends it fares the same.
        let r = exchange(addr, b"GET /metrics HTTP/1.1\r\n", Duration::from_secs(5)).await;
        assert!(refused(&r), "{r:?}");
    }

    #[tokio::test]
    async fn idle_connections_do_not_lock_out_a_scrape() {
        // Timeouts far longer than the test: only the connection cap can free places.
        let limits = Limits {
            max_connections: 16,
            header_read_timeout: Duration::from_secs(60),
            connection_timeout: Duration::from_secs(60),
            ..Limits::default()
        };
        let addr = start(limits).await;
        let mut idle = Vec::new();
        for _ in 0..200 {
            idle.push(TcpStream::connect(addr).await.unwrap());
        }
        let t = Instant::now();
        let r = get(addr, "/metrics", "").await;
        assert!(r.starts_with("HTTP/1.1 200"), "{r}");
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        // The server holds at most `max_connections` of them: the rest were closed.
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let mut open = 0;
            for s in &mut idle {
                let mut b = [0u8; 1];
                match tokio::time::timeout(Duration::from_millis(1), s.read(&mut b)).await {
                    Err(_) => open += 1,
                    Ok(Ok(0) | Err(_)) => {}
                    Ok(Ok(_)) => panic!("an idle connection got data"),
                }
            }
            if open <= limits.max_connections {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{open} idle connections still open"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}
