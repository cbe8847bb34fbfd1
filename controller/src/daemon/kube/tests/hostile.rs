//! A hostile pod set against the daemon's own loop (security review 2026-12b, N2 and N4):
//! a probe endpoint that accepts and never answers, with the largest time-out an annotation
//! may ask for; a `/metrics` that accepts and never answers; and both pods' annotations
//! changed every tick, so that their sources are dropped and bound again inside each tick.
//! Every tick must still end within its interval and `/healthz` must answer 200 throughout.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tokio::time::MissedTickBehavior;

use super::*;
use crate::daemon::exporter::{self, Exporter, UNHEALTHY_AFTER_TICKS};
use crate::daemon::{Loop, Ticker};
use cohabit_host::testing::mute_endpoint;

/// The control interval: a tick that waited on a pod would overrun it many times over.
const INTERVAL: Duration = Duration::from_millis(200);
/// Ticks run (about 5 s).
const TICKS: usize = 25;
/// The daemon's `collect_timeout_ms`: the largest `timeout_ms` a pod's probe may ask for
/// (a larger one is refused: `config::pod_latency`).
const LARGEST_TIMEOUT_MS: u64 = 50;

/// The pods of tick `i`: the probe and the scrape that never answer, their annotations
/// changed from one tick to the next, and a best-effort job.
fn hostile_pods(i: usize, probe_port: u16, metrics_port: u16) -> Vec<ManagedPod> {
    let probe = format!(
        "{{ probe = \"http://127.0.0.1:{probe_port}/\", rate_hz = {}, timeout_ms = {LARGEST_TIMEOUT_MS} }}",
        10 + i % 2
    );
    let metrics = format!(
        "{{ prometheus = \"http://127.0.0.1:{metrics_port}/metrics\", metric = \"lat\", unit_seconds = {} }}",
        if i.is_multiple_of(2) { "1.0" } else { "0.001" }
    );
    let mut pods = vec![
        pod(
            ("a", "metrics"),
            BAD,
            QosClass::Burstable,
            lc(2.0, Some(&metrics)),
            &[("main", "dd")],
        ),
        pod(
            ("a", "probe"),
            KV,
            QosClass::Burstable,
            lc(1.0, Some(&probe)),
            &[("main", "aa")],
        ),
        pod(
            ("batch", "job"),
            JOB,
            QosClass::BestEffort,
            PodClass::BestEffort,
            &[("main", "bb")],
        ),
    ];
    pods.sort_by(|a, b| a.key.cmp(&b.key));
    pods
}

/// The status line of `GET /healthz` at `addr` (empty when there was no answer).
fn healthz(addr: SocketAddr) -> String {
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(2)) else {
        return String::new();
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    let _ = s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    let mut got = Vec::new();
    let _ = s.read_to_end(&mut got);
    String::from_utf8_lossy(&got)
        .lines()
        .next()
        .unwrap_or_default()
        .to_string()
}

/// `TICKS` ticks of `ticker` at `INTERVAL`, the pods scripted in `script` changed every
/// tick, while a thread asks `/healthz` every 50 ms: each tick's end and time, and the
/// health check's status lines. A tick stuck on a pod is not waited for.
fn tick_while_polling_health(
    ticker: &Ticker,
    script: &Script,
    probe_port: u16,
    metrics_port: u16,
) -> (Vec<(String, Duration)>, Vec<String>) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let done = Arc::new(AtomicBool::new(false));
    let (ends, answers) = rt.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(exporter::serve(listener, Arc::clone(&ticker.exporter)));
        let stop = Arc::clone(&done);
        let checker = std::thread::spawn(move || {
            let mut answers = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                answers.push(healthz(addr));
                std::thread::sleep(Duration::from_millis(50));
            }
            answers
        });
        let mut interval = tokio::time::interval(INTERVAL);
        interval.set_missed_tick_behavior(MissedTickBehavior::Skip);
        let mut ends = Vec::new();
        for i in 0..TICKS {
            interval.tick().await;
            // The annotations change every tick: each tick drops and binds the sources.
            script.set(hostile_pods(i, probe_port, metrics_port), true);
            let t = Instant::now();
            let end = ticker.tick().await;
            ticker.report(&end);
            ends.push((format!("{end:?}"), t.elapsed()));
        }
        done.store(true, Ordering::Relaxed);
        (ends, checker.join().unwrap())
    });
    // A tick stuck on a pod (before the fix) is not waited for.
    rt.shutdown_background();
    (ends, answers)
}

#[test]
fn hostile_pods_neither_stall_a_tick_nor_fail_the_health_check() {
    let f = FakeCgroup2::builder().cpus(8).build().unwrap();
    let resctrl = FakeResctrl::builder().ways(12).build().unwrap();
    fake_node(&f);
    for pid in [40, 50, 60, 70] {
        resctrl.add_task(pid).unwrap();
    }
    let kubelet = tempfile::tempdir().unwrap();
    let text = node_config(
        &f,
        &resctrl,
        kubelet.path(),
        &format!(
            "interval_ms = {}\ncollect_timeout_ms = {LARGEST_TIMEOUT_MS}\n",
            INTERVAL.as_millis()
        ),
        "0-7",
        "latency_critical_namespaces = [\"a\"]\n",
    );
    let cfg = DaemonConfig::parse(&text, "t.toml").unwrap();
    let (probe_port, metrics_port) = (mute_endpoint(), mute_endpoint());
    let script = Script::default();
    let Daemon {
        mut host,
        policy,
        fair_share,
        pods,
    } = Daemon::open(&cfg, Some(&resctrl), &script);
    host.launch(&fair_share).unwrap();
    let posterior_dir = tempfile::tempdir().unwrap();
    let posterior = crate::daemon::posterior::PosteriorStore::new(
        posterior_dir.path(),
        host.host().capacity(),
        &[],
    );
    let looped = Loop {
        host,
        policy,
        log: None,
        dry_run: false,
        fair_share,
        model_watch: None,
        pods: Some(pods),
        posterior,
    };
    // As `run_with` sets them up.
    let timeout = Duration::from_millis(cfg.collect_timeout_ms).max(INTERVAL);
    let mut ex = Exporter::default();
    ex.set_health(timeout, UNHEALTHY_AFTER_TICKS);
    let ticker = Ticker {
        state: Arc::new(Mutex::new(looped)),
        exporter: Arc::new(Mutex::new(ex)),
        stopping: Arc::new(AtomicBool::new(false)),
        timeout,
    };
    let (ends, answers) = tick_while_polling_health(&ticker, &script, probe_port, metrics_port);
    let slowest = ends.iter().map(|(_, d)| *d).max().unwrap_or_default();
    let late: Vec<_> = ends
        .iter()
        .filter(|(e, _)| !e.starts_with("Done"))
        .collect();
    assert!(
        late.is_empty(),
        "{} of {TICKS} ticks did not complete within {} ms (slowest {slowest:?}): {late:?}",
        late.len(),
        timeout.as_millis()
    );
    println!("slowest of {TICKS} ticks: {slowest:?}");
    assert!(answers.len() >= 20, "{answers:?}");
    assert!(
        answers.iter().all(|a| a.starts_with("HTTP/1.1 200")),
        "/healthz: {answers:?}"
    );
    let Ok(mut st) = ticker.state.try_lock() else {
        panic!("a tick still holds the loop's state");
    };
    // Both hostile pods were taken (not refused), and every tick saw a new view.
    let status = st.pods.as_ref().unwrap().status().clone();
    assert_eq!((status.managed, status.skipped), (3, 0), "{status:?}");
    assert_eq!(script.view().generation, TICKS as u64);
    st.host.host_mut().restore();
}
