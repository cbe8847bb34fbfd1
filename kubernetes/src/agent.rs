//! The agent's thread: kube's watcher over this node's pods feeding the [`Store`], and the
//! Warning Events it posts.
//!
//! A hung API server (connected, but answering nothing) is caught by an idle deadline: the
//! client notes every response and every chunk of a body ([`Activity`], bookmarks included,
//! which kube's watcher does not surface), and when the server has been silent for longer
//! than the watch's `timeoutSeconds` plus a slack ([`crate::AgentTiming::idle_limit`]) the
//! watch is dropped, the server marked unreachable, and after a back-off the pods are
//! listed afresh. A server that works is never that silent: it ends each watch at
//! `timeoutSeconds`, and the next request's answer counts.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Event, Pod};
use kube::api::{Api, PostParams};
use kube::runtime::watcher;
use kube::Client;
use tokio::sync::{mpsc, watch};

use crate::backoff::Backoff;
use crate::client::kube_config;
use crate::events::{warning_event, Deduper};
use crate::view::{Applied, Store};
use crate::{KubeError, NodeAgentConfig, PodKey, PodView};

/// A warning to post on a pod.
#[derive(Debug)]
struct Warning {
    pod: PodKey,
    reason: String,
    message: String,
}

/// When the API server last sent anything: response headers, or a chunk of a body.
#[derive(Debug)]
struct Activity {
    base: Instant,
    last_ms: AtomicU64,
}

impl Activity {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            base: Instant::now(),
            last_ms: AtomicU64::new(0),
        })
    }

    /// Milliseconds since the agent started.
    fn now_ms(&self) -> u64 {
        u64::try_from(self.base.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Something arrived now.
    fn touch(&self) {
        self.last_ms.fetch_max(self.now_ms(), Ordering::Relaxed);
    }

    /// Whether something arrived at or after `since_ms` ([`Self::now_ms`]).
    fn since(&self, since_ms: u64) -> bool {
        self.last_ms.load(Ordering::Relaxed) >= since_ms
    }

    /// When something last arrived.
    fn last(&self) -> Instant {
        self.base + Duration::from_millis(self.last_ms.load(Ordering::Relaxed))
    }
}

/// The kube client for `kcfg`, noting in `activity` every response and every chunk of a
/// body it receives.
fn watched_client(kcfg: kube::Config, activity: &Arc<Activity>) -> Result<Client, KubeError> {
    use http_body_util::BodyExt as _;
    let builder = kube::client::ClientBuilder::try_from(kcfg)
        .map_err(|e| KubeError::Client(e.to_string()))?;
    let act = Arc::clone(activity);
    let note = tower::util::MapResponseLayer::new(
        move |resp: http::Response<Box<kube::client::DynBody>>| {
            act.touch();
            let each = Arc::clone(&act);
            resp.map(move |body| {
                body.map_frame(move |frame| {
                    each.touch();
                    frame
                })
            })
        },
    );
    Ok(builder.with_layer(&note).build())
}

/// State shared between the agent's thread and its handle.
#[derive(Debug)]
struct Shared {
    store: Mutex<Store>,
    dedup: Mutex<Deduper>,
}

impl Shared {
    fn store(&self) -> MutexGuard<'_, Store> {
        // A panic while holding the lock cannot leave the store half-updated in a way
        // that matters more than losing the view, so a poisoned lock is taken as it is.
        self.store.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn dedup(&self) -> MutexGuard<'_, Deduper> {
        self.dedup.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The running node agent: a handle on its thread and its latest view.
#[derive(Debug)]
pub struct NodeAgent {
    shared: Arc<Shared>,
    warn_tx: mpsc::UnboundedSender<Warning>,
    stop_tx: watch::Sender<bool>,
    thread: Option<JoinHandle<()>>,
}

impl NodeAgent {
    /// Spawns its own thread with its own tokio runtime that lists then watches the pods
    /// with `fieldSelector spec.nodeName=<node>`; returns at once. Fails when the config or
    /// the credentials are unusable; never waits on the API server.
    pub fn start(cfg: NodeAgentConfig) -> Result<NodeAgent, KubeError> {
        if cfg.node_name.trim().is_empty() {
            return Err(KubeError::Config(
                "node_name is empty (set it or NODE_NAME)".into(),
            ));
        }
        if cfg.annotation_prefix.is_empty() || cfg.annotation_prefix.contains('/') {
            return Err(KubeError::Config(format!(
                "annotation_prefix {:?}: expected a DNS name such as cohabit.io",
                cfg.annotation_prefix
            )));
        }
        let kcfg = kube_config(&cfg.api, &cfg.timing)?;
        let shared = Arc::new(Shared {
            store: Mutex::new(Store::new(&cfg.annotation_prefix)),
            dedup: Mutex::new(Deduper::default()),
        });
        let (warn_tx, warn_rx) = mpsc::unbounded_channel();
        let (stop_tx, stop_rx) = watch::channel(false);
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (sh, wt) = (shared.clone(), warn_tx.clone());
        let activity = Activity::new();
        // The runtime and the client are built on the agent's own thread, so that `start`
        // may be called from inside another tokio runtime (the daemon's).
        let thread = std::thread::Builder::new()
            .name("cohabit-kube".into())
            .spawn(move || {
                let built = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(|e| KubeError::Client(format!("tokio runtime: {e}")))
                    .and_then(|rt| {
                        // The client spawns its request buffer on the runtime it is built in.
                        let client = rt.block_on(async { watched_client(kcfg, &activity) })?;
                        Ok((rt, client))
                    });
                match built {
                    Ok((rt, client)) => {
                        let _ = ready_tx.send(Ok(()));
                        let task = Loop {
                            cfg,
                            client,
                            shared: sh,
                            warn_tx: wt,
                            activity,
                        };
                        rt.block_on(task.run(warn_rx, stop_rx));
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                    }
                }
            })
            .map_err(|e| KubeError::Client(format!("spawning the agent thread: {e}")))?;
        match ready_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                let _ = thread.join();
                return Err(e);
            }
            Err(_) => {
                let _ = thread.join();
                return Err(KubeError::Client(
                    "the agent thread ended while starting".into(),
                ));
            }
        }
        Ok(NodeAgent {
            shared,
            warn_tx,
            stop_tx,
            thread: Some(thread),
        })
    }

    /// The latest view (a copy; never blocks on the network).
    pub fn view(&self) -> PodView {
        self.shared.store().view().clone()
    }

    /// Posts a Warning Event on the pod (non-blocking, de-duplicated per pod and reason)
    /// and logs it.
    pub fn warn(&self, pod: &PodKey, reason: &str, message: &str) {
        queue_warning(&self.shared, &self.warn_tx, pod, reason, message);
    }

    /// Stops the watch and joins the thread.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        let _ = self.stop_tx.send(true);
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                tracing::error!("the kubernetes agent thread panicked");
            }
        }
    }
}

impl Drop for NodeAgent {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Logs the warning and queues its Event unless (pod, reason) was already posted.
fn queue_warning(
    shared: &Shared,
    tx: &mpsc::UnboundedSender<Warning>,
    pod: &PodKey,
    reason: &str,
    message: &str,
) {
    if !shared.dedup().first(&pod.uid, reason) {
        return;
    }
    // The message may quote annotations: one line in the log, whatever they hold.
    let message = crate::events::escape_control(message);
    tracing::warn!(namespace = %pod.namespace, pod = %pod.name, reason, "{message}");
    let _ = tx.send(Warning {
        pod: pod.clone(),
        reason: reason.to_string(),
        message: message.to_string(),
    });
}

/// What one watcher error means for the loop.
#[derive(Debug, PartialEq)]
enum Failure {
    /// 410 Gone: list afresh at once; the server is fine. `restart` when kube's watcher
    /// would not re-list by itself (a watch request answered with HTTP 410 leaves it
    /// retrying the same expired resource version), so the loop starts a new watcher.
    Gone { restart: bool },
    /// Anything else: back off, honouring a 429's Retry-After.
    Retry { retry_after: Option<Duration> },
}

fn failure(e: &watcher::Error) -> Failure {
    let (status, restart) = match e {
        watcher::Error::WatchError(s) => (Some(&**s), false),
        watcher::Error::InitialListFailed(kube::Error::Api(s)) => (Some(&**s), false),
        watcher::Error::WatchStartFailed(kube::Error::Api(s))
        | watcher::Error::WatchFailed(kube::Error::Api(s)) => (Some(&**s), true),
        _ => (None, false),
    };
    match status {
        Some(s) if s.code == 410 => Failure::Gone { restart },
        Some(s) if s.code == 429 => Failure::Retry {
            retry_after: s
                .details
                .as_ref()
                .map(|d| d.retry_after_seconds)
                .filter(|&r| r > 0)
                .map(|r| Duration::from_secs(u64::from(r))),
        },
        _ => Failure::Retry { retry_after: None },
    }
}

/// The agent's loop and what it needs.
struct Loop {
    cfg: NodeAgentConfig,
    client: Client,
    shared: Arc<Shared>,
    warn_tx: mpsc::UnboundedSender<Warning>,
    activity: Arc<Activity>,
}

impl Loop {
    async fn run(
        self,
        mut warn_rx: mpsc::UnboundedReceiver<Warning>,
        mut stop: watch::Receiver<bool>,
    ) {
        let node = self.cfg.node_name.clone();
        let pods: Api<Pod> = Api::all(self.client.clone());
        let mut wc = watcher::Config::default()
            .fields(&format!("spec.nodeName={node}"))
            .timeout(self.cfg.timing.watch_timeout_s)
            .any_semantic();
        // One node's pods (the kubelet caps them at about a hundred) need no pages, and an
        // unpaged list at resourceVersion=0 is served from the API server's watch cache, as
        // the kubelet lists; kube drops resourceVersion=0 from a paged list, which would make
        // every node's agent a quorum read of all pods through etcd.
        wc.page_size = None;
        let mut stream = Box::pin(watcher(pods.clone(), wc.clone()));
        let t = &self.cfg.timing;
        let mut backoff = Backoff::new(t.backoff_initial, t.backoff_max, &node);
        // A second 410 with no success in between backs off like any error, so a server
        // that keeps answering 410 cannot make the agent list in a tight loop.
        let mut gone_before = false;
        tracing::info!(node = %node, "watching this node's pods");
        // After a failed request, the retried one succeeded if no error comes back within
        // the connect time-out and a second: a re-established watch yields no event until a
        // pod changes, and kube does not surface bookmarks.
        let settle = t.connect_timeout + Duration::from_secs(1);
        // When the retried request started: it succeeded only if the server answered since.
        let mut recovering: Option<(tokio::time::Instant, u64)> = None;
        let idle_limit = t.idle_limit();
        self.activity.touch();
        loop {
            let deadline = recovering.map_or_else(tokio::time::Instant::now, |r| r.0);
            let idle_deadline = tokio::time::Instant::from_std(self.activity.last() + idle_limit);
            tokio::select! {
                _ = stop.changed() => break,
                Some(w) = warn_rx.recv() => self.post(w),
                () = tokio::time::sleep_until(deadline), if recovering.is_some() => {
                    let since = recovering.take().map(|r| r.1);
                    if since.is_some_and(|s| self.activity.since(s)) {
                        self.recovered(&mut backoff);
                    }
                }
                () = tokio::time::sleep_until(idle_deadline) => {
                    // Woken early by a late touch: the deadline moves on.
                    if self.activity.last().elapsed() < idle_limit {
                        continue;
                    }
                    let delay = self.on_silence(idle_limit, &mut backoff);
                    recovering = None;
                    // Dropping the stream drops its connection; the new watcher lists first.
                    stream = Box::pin(watcher(pods.clone(), wc.clone()));
                    tokio::select! {
                        _ = stop.changed() => break,
                        () = tokio::time::sleep(delay) => {}
                    }
                    self.activity.touch();
                }
                item = stream.next() => match item {
                    // `Init` opens a (re-)list before any request is made: no news.
                    Some(Ok(watcher::Event::Init)) => self.on_event(watcher::Event::Init),
                    Some(Ok(ev)) => {
                        recovering = None;
                        self.recovered(&mut backoff);
                        gone_before = false;
                        self.on_event(ev);
                    }
                    Some(Err(e)) => {
                        let (delay, restart) = self.on_error(&e, &mut backoff, &mut gone_before);
                        if restart {
                            stream = Box::pin(watcher(pods.clone(), wc.clone()));
                        }
                        tokio::select! {
                            _ = stop.changed() => break,
                            () = tokio::time::sleep(delay) => {}
                        }
                        recovering =
                            Some((tokio::time::Instant::now() + settle, self.activity.now_ms()));
                    }
                    None => break,
                },
            }
        }
        tracing::info!("stopped watching pods");
    }

    /// A request succeeded: the view says so and the back-off starts over.
    fn recovered(&self, backoff: &mut Backoff) {
        if backoff.attempts() > 0 {
            tracing::info!(failures = backoff.attempts(), "API server reachable again");
        }
        backoff.reset();
        self.shared.store().reachable();
    }

    fn on_event(&self, ev: watcher::Event<Pod>) {
        let applied = {
            let mut store = self.shared.store();
            match &ev {
                watcher::Event::Init => {
                    store.init();
                    Applied::default()
                }
                watcher::Event::InitApply(p) => store.init_apply(p),
                watcher::Event::InitDone => {
                    let a = store.init_done();
                    tracing::info!(pods = store.view().pods.len(), "pod list synced");
                    a
                }
                watcher::Event::Apply(p) => store.apply(p),
                watcher::Event::Delete(p) => store.delete(p),
            }
        };
        {
            let mut dedup = self.shared.dedup();
            for uid in &applied.gone {
                dedup.forget_pod(uid);
            }
            for uid in &applied.valid {
                dedup.forget(uid, crate::annotations::REASON);
            }
        }
        for bad in applied.invalid {
            queue_warning(
                &self.shared,
                &self.warn_tx,
                &bad.key,
                bad.error.reason(),
                &bad.error.to_string(),
            );
        }
    }

    /// The server said nothing for `idle_limit`: the view says so; returns how long to wait
    /// before listing afresh.
    fn on_silence(&self, idle_limit: Duration, backoff: &mut Backoff) -> Duration {
        let text = format!(
            "the API server sent nothing for {} s (watch timeoutSeconds + slack); dropped the connection, listing afresh",
            idle_limit.as_secs_f64()
        );
        let delay = backoff.next_delay(None);
        if backoff.attempts() == 1 {
            tracing::warn!(retry_in_ms = delay.as_millis(), "{text}");
        } else {
            tracing::debug!(
                attempt = backoff.attempts(),
                retry_in_ms = delay.as_millis(),
                "{text}"
            );
        }
        self.shared.store().unreachable(text);
        delay
    }

    /// Records the failure in the view; returns how long to wait and whether to start a
    /// new watcher (which lists afresh).
    fn on_error(
        &self,
        e: &watcher::Error,
        backoff: &mut Backoff,
        gone_before: &mut bool,
    ) -> (Duration, bool) {
        let f = match failure(e) {
            Failure::Gone { .. } if *gone_before => Failure::Retry { retry_after: None },
            f => f,
        };
        match f {
            Failure::Gone { restart } => {
                *gone_before = true;
                tracing::info!("watch expired (410 Gone): listing pods afresh");
                (Duration::ZERO, restart)
            }
            Failure::Retry { retry_after } => {
                let text = e.to_string();
                let delay = backoff.next_delay(retry_after);
                // At most one line per back-off step, so a long outage logs sparsely.
                if backoff.attempts() == 1 {
                    tracing::warn!(
                        retry_in_ms = delay.as_millis(),
                        "API server request failed, keeping the last pod view: {text}"
                    );
                } else {
                    tracing::debug!(
                        attempt = backoff.attempts(),
                        retry_in_ms = delay.as_millis(),
                        "API server request failed: {text}"
                    );
                }
                self.shared.store().unreachable(text);
                // After a repeated 410 the watcher may be stuck on an expired version.
                (delay, *gone_before)
            }
        }
    }

    /// Posts one Event in the background; a failure is logged and the pair forgotten so a
    /// later warning tries again.
    fn post(&self, w: Warning) {
        let events: Api<Event> = Api::namespaced(self.client.clone(), &w.pod.namespace);
        let ev = warning_event(
            &w.pod,
            &w.reason,
            &w.message,
            &self.cfg.node_name,
            SystemTime::now(),
        );
        let shared = self.shared.clone();
        tokio::spawn(async move {
            if let Err(e) = events.create(&PostParams::default(), &ev).await {
                tracing::warn!(namespace = %w.pod.namespace, pod = %w.pod.name, reason = %w.reason, "posting the Event failed: {e}");
                shared.dedup().forget(&w.pod.uid, &w.reason);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use kube::core::response::StatusDetails;
    use kube::core::Status;

    use super::*;

    fn status(code: u16, retry: u32) -> Box<Status> {
        let mut s = Status::failure("x", "y");
        s.code = code;
        let details: StatusDetails =
            serde_json::from_value(serde_json::json!({ "retryAfterSeconds": retry })).unwrap();
        s.details = Some(details);
        Box::new(s)
    }

    #[test]
    fn gone_in_a_watch_event_or_a_list_means_relist() {
        assert_eq!(
            failure(&watcher::Error::WatchError(status(410, 0))),
            Failure::Gone { restart: false }
        );
        assert_eq!(
            failure(&watcher::Error::InitialListFailed(kube::Error::Api(
                status(410, 0)
            ))),
            Failure::Gone { restart: false }
        );
        assert_eq!(
            failure(&watcher::Error::WatchStartFailed(kube::Error::Api(status(
                410, 0
            )))),
            Failure::Gone { restart: true }
        );
    }

    #[test]
    fn throttling_carries_the_servers_retry_after() {
        let e = watcher::Error::InitialListFailed(kube::Error::Api(status(429, 3)));
        assert_eq!(
            failure(&e),
            Failure::Retry {
                retry_after: Some(Duration::from_secs(3))
            }
        );
        let e = watcher::Error::WatchStartFailed(kube::Error::Api(status(429, 0)));
        assert_eq!(failure(&e), Failure::Retry { retry_after: None });
        let e = watcher::Error::InitialListFailed(kube::Error::Api(status(500, 0)));
        assert_eq!(failure(&e), Failure::Retry { retry_after: None });
    }
}
