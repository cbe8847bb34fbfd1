//! `cohabit run`: the daemon that drives a real host, and `cohabit probe`.
//!
//! The loop is the simulator's ([`cohabit_policy::control::step`]) on a tokio interval: ticks are
//! scheduled from the start time, so they do not drift; a tick whose collection is still
//! running when the next is due is skipped with a log line. SIGTERM and SIGINT end the
//! loop, after which every change is undone.

pub mod config;
pub mod exporter;
pub mod gpu;
pub mod host;
pub mod probe;

use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom, Write};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use cohabit_core::{log::last_header, Collector as _, DecisionLogWriter, LogHeader};
use tokio::time::MissedTickBehavior;

use self::config::DaemonConfig;
use self::exporter::{ErrorKind, Exporter};
use self::host::RealHost;
use cohabit_policy::control;
use cohabit_policy::{HostContext, Policy, PolicyKind};

struct Loop {
    host: RealHost,
    policy: Box<dyn Policy>,
    log: Option<DecisionLogWriter<File>>,
    dry_run: bool,
}

/// Continues the decision log at `path`, already opened for appending as `file`, with
/// records described by `header`:
///
/// - a new (empty) log starts with `header`;
/// - a log whose last header is `header` (the daemon restarted on the same host with the
///   same policy) is continued without a second one;
/// - any other log (another host, policy or version, or a version-1 log without a header)
///   gets `header` appended: the reader takes a header to describe the records after it,
///   so one file holds the runs one after the other, each with its own host.
///
/// A last line cut short (the daemon killed mid-write) is ended first, so that it stays
/// one bad line instead of swallowing the next record. A log this build cannot read (a
/// newer version, a broken header) is an error: move it aside to start a new one.
fn continue_log(file: File, path: &Path, header: &LogHeader) -> Result<DecisionLogWriter<File>> {
    let mut existing = File::open(path).with_context(|| format!("reading {}", path.display()))?;
    let len = existing
        .metadata()
        .with_context(|| format!("reading {}", path.display()))?
        .len();
    if len == 0 {
        return DecisionLogWriter::new(file, header)
            .with_context(|| format!("writing the decision log {}", path.display()));
    }
    let mut last_byte = [0u8];
    existing
        .seek(SeekFrom::End(-1))
        .and_then(|_| existing.read_exact(&mut last_byte))
        .and_then(|()| existing.rewind())
        .with_context(|| format!("reading {}", path.display()))?;
    let last = last_header(BufReader::new(existing)).with_context(|| {
        format!(
            "cannot continue the decision log {}; move it aside to start a new one",
            path.display()
        )
    })?;
    let new_header = last.as_ref() != Some(header);
    let mut log = DecisionLogWriter::continuing(file);
    let mut write = || -> std::io::Result<()> {
        if last_byte[0] != b'\n' {
            log.get_mut().write_all(b"\n")?;
        }
        if new_header {
            log.write_header(header)?;
        }
        Ok(())
    };
    write().with_context(|| format!("writing the decision log {}", path.display()))?;
    if new_header {
        tracing::info!(
            log = %path.display(),
            "the decision log was written by another policy, host or version; continuing it under a new header"
        );
    }
    Ok(log)
}

/// Runs the daemon until `shutdown` resolves (or SIGTERM/SIGINT when `None`), then
/// restores the host. Returns the number of ticks run.
pub async fn run(cfg: DaemonConfig, dry_run: bool, max_ticks: Option<u64>) -> Result<u64> {
    let interval_ms = cfg.interval_ms;
    let timeout = Duration::from_millis(cfg.collect_timeout_ms.max(interval_ms));
    let log = match &cfg.log {
        Some(path) => {
            if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("creating {}", dir.display()))?;
            }
            let f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .with_context(|| format!("opening decision log {}", path.display()))?;
            Some((path.clone(), f))
        }
        None => None,
    };
    let policy_kind = cfg.policy;
    // A model that does not load stops the start, naming the file: an operator who asked
    // for ml should not silently get something else.
    let model = match (&cfg.model, policy_kind) {
        (Some(path), PolicyKind::Ml) => Some(Arc::new(
            cohabit_models::Model::load(path).context("loading the model for policy ml")?,
        )),
        _ => None,
    };
    let metrics_addr = cfg.metrics_addr;
    let mut host = RealHost::open(cfg, dry_run).context("opening the host")?;
    let ctx = HostContext {
        host: host.capacity().clone(),
        specs: host.specs(),
    };
    let mut policy: Box<dyn Policy> = policy_kind.build(ctx, model)?;
    let log = match log {
        Some((path, file)) => {
            let header = LogHeader::new(policy.name(), host.simulated(), host.capacity().clone());
            Some(continue_log(file, &path, &header)?)
        }
        None => None,
    };
    let initial = policy.initial();
    if let Err(e) = host.launch(&initial.plan) {
        host.restore();
        return Err(anyhow::Error::new(e).context("applying the initial plan"));
    }
    tracing::info!(
        policy = policy.name(),
        dry_run,
        interval_ms,
        "cohabit running"
    );
    let state = Arc::new(Mutex::new(Loop {
        host,
        policy,
        log,
        dry_run,
    }));
    let exporter = Arc::new(Mutex::new(Exporter::default()));
    let _metrics = match metrics_addr {
        Some(addr) => match tokio::net::TcpListener::bind(addr).await {
            Ok(l) => {
                let bound = l.local_addr().map_or(addr, |a| a);
                tracing::info!(addr = %bound, "serving Prometheus metrics on /metrics");
                Some(tokio::spawn(exporter::serve(l, Arc::clone(&exporter))))
            }
            Err(e) => {
                tracing::warn!(%addr, error = %e, "cannot serve metrics; running without them");
                None
            }
        },
        None => None,
    };
    let mut interval = tokio::time::interval(Duration::from_millis(interval_ms));
    interval.set_missed_tick_behavior(MissedTickBehavior::Skip);
    interval.tick().await;
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut ticks = 0u64;
    loop {
        tokio::select! {
            _ = interval.tick() => {}
            _ = term.recv() => { tracing::info!("SIGTERM: restoring the host"); break; }
            _ = tokio::signal::ctrl_c() => { tracing::info!("SIGINT: restoring the host"); break; }
        }
        let st = Arc::clone(&state);
        let ex = Arc::clone(&exporter);
        let work = tokio::task::spawn_blocking(move || {
            let started = std::time::Instant::now();
            let Ok(mut guard) = st.try_lock() else {
                return Err("the previous tick is still running".to_string());
            };
            let Loop {
                host,
                policy,
                log,
                dry_run,
            } = &mut *guard;
            let record =
                control::step(host, policy.as_mut(), *dry_run).map_err(|e| e.to_string())?;
            let mut logged = Ok(());
            if let Some(log) = log {
                logged = log.write(&record).and_then(|()| log.flush());
            }
            if let Ok(mut ex) = ex.lock() {
                ex.observe(&record, started.elapsed().as_secs_f64());
                if logged.is_err() {
                    ex.error(ErrorKind::Log);
                }
            }
            logged.map_err(|e| format!("writing the decision log: {e}"))?;
            if *dry_run && !record.changes.is_empty() {
                tracing::info!(changes = ?record.changes, "dry run: would apply");
            }
            Ok(())
        });
        let failed = match tokio::time::timeout(timeout, work).await {
            Ok(Ok(Ok(()))) => false,
            Ok(Ok(Err(e))) => {
                tracing::warn!(error = %e, "tick skipped");
                !e.starts_with("writing the decision log")
            }
            Ok(Err(e)) => {
                tracing::error!(error = %e, "tick failed");
                true
            }
            Err(_) => {
                tracing::warn!("tick took longer than {} ms; skipped", timeout.as_millis());
                true
            }
        };
        if failed {
            if let Ok(mut ex) = exporter.lock() {
                ex.error(ErrorKind::Tick);
            }
        }
        ticks += 1;
        if max_ticks.is_some_and(|m| ticks >= m) {
            break;
        }
    }
    // Wait for a tick still in flight, then undo everything.
    let st = Arc::clone(&state);
    tokio::task::spawn_blocking(move || {
        let mut guard = st.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(log) = &mut guard.log {
            let _ = log.flush();
        }
        guard.host.restore();
    })
    .await?;
    Ok(ticks)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(cores: u32) -> cohabit_core::HostCapacity {
        cohabit_core::HostCapacity {
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
        }
    }

    /// Opens `path` as the daemon does and continues it under `header`.
    fn start(path: &Path, header: &LogHeader) {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .unwrap();
        continue_log(file, path, header).unwrap();
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
    fn a_restart_on_the_same_host_continues_the_log_and_another_host_adds_a_header() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("decisions.jsonl");
        let parties = LogHeader::new("parties", false, host(8));
        start(&path, &parties);
        assert_eq!(headers(&path), vec![(1, parties.clone())]);
        start(&path, &parties);
        assert_eq!(headers(&path).len(), 1, "no second header for the same run");
        let bigger = LogHeader::new("parties", false, host(16));
        start(&path, &bigger);
        let ml = LogHeader::new("ml", false, host(16));
        start(&path, &ml);
        assert_eq!(
            headers(&path),
            vec![(1, parties), (2, bigger), (3, ml.clone())]
        );
        // The reader takes the latest.
        let last = last_header(BufReader::new(File::open(&path).unwrap())).unwrap();
        assert_eq!(last, Some(ml));
    }

    #[test]
    fn a_version_1_log_or_a_cut_line_gets_a_header_on_a_line_of_its_own() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("decisions.jsonl");
        std::fs::write(&path, "{\"schema_version\":1,\"policy\":\"par").unwrap();
        let header = LogHeader::new("parties", false, host(8));
        start(&path, &header);
        assert_eq!(headers(&path), vec![(2, header)]);
    }

    #[test]
    fn a_log_from_a_newer_version_is_not_continued() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("decisions.jsonl");
        std::fs::write(&path, "{\"cohabit_decision_log\":99}\n").unwrap();
        let file = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        let e = continue_log(file, &path, &LogHeader::new("parties", false, host(8))).unwrap_err();
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
    fn ml_with_a_model_that_does_not_load_stops_before_touching_the_host() {
        let dir = tempfile::tempdir().unwrap();
        let bad = dir.path().join("qos.json");
        std::fs::write(&bad, "{\"format\": \"something else\"}").unwrap();
        let text = format!(
            "policy = \"ml\"\nmodel = \"{}\"\n[paths]\ncgroup = \"{}\"\n[[service]]\nname = \"kv\"\np99_target_ms = 1\nmatch = {{ process_name = \"kv\" }}\nlatency = {{ push = \"127.0.0.1:9400\" }}\n",
            bad.display(),
            dir.path().join("no-cgroups").display()
        );
        let cfg = DaemonConfig::parse(&text, "t.toml").unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let e = rt.block_on(run(cfg, true, Some(1))).unwrap_err();
        let msg = format!("{e:#}");
        assert!(msg.contains("loading the model for policy ml"), "{msg}");
        assert!(msg.contains("qos.json"), "{msg}");
        assert!(!dir.path().join("no-cgroups").exists());
    }
}
