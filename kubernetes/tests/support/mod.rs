//! A scripted stand-in for the Kubernetes API server: a local HTTP/1.1 server (hyper, on
//! 127.0.0.1, no network) that answers in the API server's wire format and records every
//! request.
//!
//! What it replays, as a real API server (v1.3x) sends it:
//! - `GET /api/v1/pods?…` (no `watch`): a `PodList` with `metadata.resourceVersion`, or a
//!   `Status` error with its HTTP code (429 with `Retry-After` and `details.retryAfterSeconds`,
//!   500, 410 `Expired`).
//! - `GET /api/v1/pods?watch=true&…`: HTTP 200, `Transfer-Encoding: chunked`, one JSON
//!   `WatchEvent` per line (`ADDED`, `MODIFIED`, `DELETED`, `BOOKMARK`, `ERROR` with a
//!   `Status`), each line its own chunk; the stream then ends or stays open. Or an error
//!   `Status` for the watch request itself.
//! - `POST /api/v1/namespaces/<ns>/events`: 201 with the Event echoed back.
//!
//! Where it differs from a real server: it does not filter by the field selector (the
//! scripts hold only this node's pods) and it answers from scripts, not from a store.

#![allow(dead_code)]

use std::collections::{BTreeMap, VecDeque};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use http_body_util::{combinators::BoxBody, BodyExt, Full, StreamBody};
use hyper::body::{Bytes, Frame, Incoming};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};

/// One request the client made.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub method: String,
    pub path: String,
    /// The query string as sent (still percent-encoded).
    pub raw_query: String,
    /// The query, decoded.
    pub query: BTreeMap<String, String>,
    pub authorization: Option<String>,
    pub body: String,
    pub at: Instant,
}

impl Recorded {
    pub fn is_watch(&self) -> bool {
        self.query.get("watch").map(String::as_str) == Some("true")
    }
    pub fn is_pod_list(&self) -> bool {
        self.method == "GET" && self.path == "/api/v1/pods" && !self.is_watch()
    }
    pub fn is_pod_watch(&self) -> bool {
        self.method == "GET" && self.path == "/api/v1/pods" && self.is_watch()
    }
    pub fn rv(&self) -> Option<&str> {
        self.query.get("resourceVersion").map(String::as_str)
    }
}

/// A scripted answer.
#[derive(Debug, Clone)]
pub enum Reply {
    /// A whole JSON body with a status code and extra headers.
    Json {
        code: u16,
        body: Value,
        headers: Vec<(String, String)>,
    },
    /// A watch stream: these events, one per chunk, then end (`hold: None`) or stay open
    /// for `hold`.
    Watch {
        events: Vec<Value>,
        hold: Option<Duration>,
    },
    /// Nothing at all for this long (a hung server: the connection is accepted and the
    /// request read, no response), then a 503.
    Hang(Duration),
}

/// The scripts: list answers and watch answers, consumed in order. When the list script
/// is empty, lists get a 503; when the watch script is empty, a watch stays open silently.
#[derive(Debug, Default)]
pub struct Script {
    pub lists: VecDeque<Reply>,
    pub watches: VecDeque<Reply>,
}

#[derive(Debug, Default)]
struct State {
    script: Script,
    log: Vec<Recorded>,
}

/// The running fake API server.
pub struct FakeApi {
    pub addr: SocketAddr,
    state: Arc<Mutex<State>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FakeApi {
    pub fn start(script: Script) -> FakeApi {
        let state = Arc::new(Mutex::new(State {
            script,
            log: Vec::new(),
        }));
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let st = state.clone();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                addr_tx.send(listener.local_addr().unwrap()).unwrap();
                let accept = async {
                    loop {
                        let (sock, _) = listener.accept().await.unwrap();
                        let st = st.clone();
                        tokio::spawn(async move {
                            let svc =
                                hyper::service::service_fn(move |req| handle(st.clone(), req));
                            let _ = hyper::server::conn::http1::Builder::new()
                                .serve_connection(TokioIo::new(sock), svc)
                                .await;
                        });
                    }
                };
                tokio::select! {
                    _ = stop_rx => {}
                    () = accept => {}
                }
            });
            // Dropping the runtime here closes every open connection.
        });
        let addr = addr_rx.recv().unwrap();
        FakeApi {
            addr,
            state,
            stop: Some(stop_tx),
            thread: Some(thread),
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn requests(&self) -> Vec<Recorded> {
        self.state.lock().unwrap().log.clone()
    }

    pub fn pod_requests(&self) -> Vec<Recorded> {
        self.requests()
            .into_iter()
            .filter(|r| r.path == "/api/v1/pods")
            .collect()
    }

    pub fn event_posts(&self) -> Vec<Recorded> {
        self.requests()
            .into_iter()
            .filter(|r| r.method == "POST")
            .collect()
    }

    /// Adds answers to the scripts while running.
    pub fn push_list(&self, r: Reply) {
        self.state.lock().unwrap().script.lists.push_back(r);
    }
    pub fn push_watch(&self, r: Reply) {
        self.state.lock().unwrap().script.watches.push_back(r);
    }

    /// Stops the server and closes its connections (the port is then refused).
    pub fn stop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
    }
}

impl Drop for FakeApi {
    fn drop(&mut self) {
        self.stop();
    }
}

type Body = BoxBody<Bytes, Infallible>;

async fn handle(
    state: Arc<Mutex<State>>,
    req: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    let method = req.method().to_string();
    let path = req.uri().path().to_string();
    let raw_query = req.uri().query().unwrap_or("").to_string();
    let query = decode_query(&raw_query);
    let authorization = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let body = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let rec = Recorded {
        method,
        path,
        raw_query,
        query,
        authorization,
        body: String::from_utf8_lossy(&body).into_owned(),
        at: Instant::now(),
    };
    let reply = {
        let mut st = state.lock().unwrap();
        st.log.push(rec.clone());
        if rec.is_pod_watch() {
            st.script.watches.pop_front().unwrap_or(Reply::Watch {
                events: vec![],
                hold: Some(Duration::from_secs(60)),
            })
        } else if rec.is_pod_list() {
            st.script.lists.pop_front().unwrap_or_else(|| {
                status_reply(503, "ServiceUnavailable", "script exhausted", None)
            })
        } else if rec.method == "POST" && rec.path.ends_with("/events") {
            let mut ev: Value = serde_json::from_str(&rec.body).unwrap_or(Value::Null);
            ev["metadata"]["uid"] = json!("ev-uid");
            ev["metadata"]["resourceVersion"] = json!("1");
            Reply::Json {
                code: 201,
                body: ev,
                headers: vec![],
            }
        } else {
            status_reply(404, "NotFound", "not scripted", None)
        }
    };
    if let Reply::Hang(d) = reply {
        tokio::time::sleep(d).await;
        return Ok(respond(status_reply(
            503,
            "ServiceUnavailable",
            "hung",
            None,
        )));
    }
    Ok(respond(reply))
}

fn respond(reply: Reply) -> Response<Body> {
    match reply {
        Reply::Hang(_) => respond(status_reply(503, "ServiceUnavailable", "hung", None)),
        Reply::Json {
            code,
            body,
            headers,
        } => {
            let mut b = Response::builder()
                .status(StatusCode::from_u16(code).unwrap())
                .header("content-type", "application/json");
            for (k, v) in headers {
                b = b.header(k, v);
            }
            b.body(Full::new(Bytes::from(body.to_string())).boxed())
                .unwrap()
        }
        Reply::Watch { events, hold } => {
            let lines = futures::stream::iter(events).then(|e| async move {
                tokio::time::sleep(Duration::from_millis(10)).await;
                Ok::<_, Infallible>(Frame::data(Bytes::from(format!("{e}\n"))))
            });
            let tail = futures::stream::once(async move {
                if let Some(h) = hold {
                    tokio::time::sleep(h).await;
                }
            })
            .filter_map(|()| async { None::<Result<Frame<Bytes>, Infallible>> });
            let body = StreamBody::new(lines.chain(tail));
            Response::builder()
                .status(200)
                .header("content-type", "application/json")
                .header("transfer-encoding", "chunked")
                .body(BodyExt::boxed(body))
                .unwrap()
        }
    }
}

fn decode_query(q: &str) -> BTreeMap<String, String> {
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let Ok(v) = u8::from_str_radix(&s[i + 1..i + 3], 16) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(if b[i] == b'+' { b' ' } else { b[i] });
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

// ---- wire-format builders ----

/// A `Status` error reply as the API server sends it.
pub fn status_reply(code: u16, reason: &str, message: &str, retry_after_s: Option<u32>) -> Reply {
    let mut body = status(code, reason, message);
    let mut headers = vec![];
    if let Some(r) = retry_after_s {
        body["details"] = json!({"retryAfterSeconds": r});
        headers.push(("retry-after".to_string(), r.to_string()));
    }
    Reply::Json {
        code,
        body,
        headers,
    }
}

pub fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": message, "reason": reason, "code": code})
}

/// A `PodList` at `rv` (items carry no kind/apiVersion, as in real lists).
pub fn pod_list(rv: &str, items: Vec<Value>) -> Reply {
    let items: Vec<Value> = items
        .into_iter()
        .map(|mut p| {
            p.as_object_mut().unwrap().remove("kind");
            p.as_object_mut().unwrap().remove("apiVersion");
            p
        })
        .collect();
    Reply::Json {
        code: 200,
        body: json!({"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": rv}, "items": items}),
        headers: vec![],
    }
}

pub fn watch_event(kind: &str, object: Value) -> Value {
    json!({"type": kind, "object": object})
}

pub fn bookmark(rv: &str) -> Value {
    watch_event(
        "BOOKMARK",
        json!({"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": rv}}),
    )
}

pub fn gone_event(rv: &str) -> Value {
    watch_event(
        "ERROR",
        status(
            410,
            "Expired",
            &format!("too old resource version: {rv} (999)"),
        ),
    )
}

/// A pod on `node-1` as the API server returns it.
pub fn pod(name: &str, uid: &str, rv: &str, phase: &str, annotations: Value) -> Value {
    json!({
        "kind": "Pod", "apiVersion": "v1",
        "metadata": {"name": name, "namespace": "shop", "uid": uid, "resourceVersion": rv,
                     "creationTimestamp": "2026-11-30T10:00:00Z", "annotations": annotations},
        "spec": {"nodeName": "node-1", "containers": [{"name": "main", "image": "registry.example/app:1"}]},
        "status": {"phase": phase, "qosClass": "Burstable", "hostIP": "10.0.0.5",
            "containerStatuses": [{"name": "main", "ready": true, "restartCount": 0,
                "image": "registry.example/app:1", "imageID": "registry.example/app@sha256:00",
                "containerID": format!("containerd://{uid}-c"), "started": true,
                "state": {"running": {"startedAt": "2026-11-30T10:00:01Z"}}}]}
    })
}

pub fn lc(target: &str) -> Value {
    json!({"cohabit.io/class": "latency-critical", "cohabit.io/p99-target-ms": target})
}

pub fn be() -> Value {
    json!({"cohabit.io/class": "best-effort"})
}

/// Polls `f` every 10 ms for up to `secs`; panics with `what` if it never holds.
pub fn wait_until(secs: u64, what: &str, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < end {
        if f() {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("timed out waiting for: {what}");
}
