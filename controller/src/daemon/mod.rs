//! `cohabit run`: the daemon that drives a real host, and `cohabit probe`.
//!
//! The loop is the simulator's ([`cohabit_policy::control::step`]) on a tokio interval: ticks are
//! scheduled from the start time, so they do not drift; a tick whose collection is still
//! running when the next is due is skipped with a log line.
//!
//! Start-up, in this order (docs/DESIGN.md 7: a crash never leaves a host worse than before):
//! 1. listen for the stop signals ([`signals`]), so none is lost during the start;
//! 2. take the state directory's lock ([`state`]): a second instance, `--dry-run` included,
//!    exits with "another cohabit is running (pid N)";
//! 3. load the state file; if a previous run left changes in force, restore the host from
//!    it alone. What cannot be restored goes to quarantine and the start goes on: a state
//!    file this build cannot read is moved aside unread, changes the host refuses to undo
//!    are kept in `quarantine.json`, each with an error line, and
//!    `cohabit_state_quarantined_entries` says how many (`--discard-state`, or
//!    `COHABIT_DISCARD_STATE=1`, moves the file aside without trying; `--dry-run` only
//!    reports what it would do);
//! 4. remove leftover cohabit groups, then save an empty record;
//! 5. only then open the host, build the policy and apply its initial plan (checked against
//!    the host). From here every change is saved to the state file before it is made.
//!
//! Steps 3 to 5 run on a thread of their own while the daemon listens for the stop signals
//! ([`interruptible`]): a step that blocks cannot make it deaf to SIGTERM. On a signal the
//! start gives up at its next step, undoing what it did; if it is still blocked after
//! half a second, the host is restored from the state file and the daemon exits 0 without
//! it (a change such a thread makes after that is left in the state file for the next
//! start, as after a crash).
//!
//! Every plan is checked against the host before it is applied, and after
//! `fail_safe_after_ticks` consecutive failed ticks the fair-share plan is put back
//! ([`supervise`]). SIGTERM, SIGINT, SIGHUP and SIGQUIT end the loop; the host is restored
//! and the daemon exits 0. Shutdown waits a bounded time for a tick in flight, then restores
//! from the state file instead. A tick that panics ends the loop the same way, but the
//! daemon exits non-zero, so that the service manager restarts it.

pub mod check;
pub mod config;
pub mod exporter;
pub mod kube;
pub mod log;
pub mod model;
pub mod posterior;
pub mod probe;
pub mod signals;
pub mod state;
pub mod supervise;

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, TryLockError};
use std::time::{Duration, SystemTime};

use anyhow::{Context, Result};
use cohabit_core::{
    Actuator as _, ApplyOutcome, Collector as _, DecisionLogWriter, LogHeader, Plan,
};
use tokio::time::MissedTickBehavior;

use self::config::DaemonConfig;
use self::exporter::{ErrorKind, Exporter};
use self::log::{LogFile, LogLimits, RotatingLog};
use self::model::{ModelWatch, Models};
use self::signals::{Signals, Stop};
use self::state::{StateDir, StateError};
use self::supervise::{panic_message, Checked, FailSafe};
use cohabit_host::changes::{ChangeLog, HostChanges, InMemory};
use cohabit_host::{fds, RealHost};
use cohabit_policy::control;
use cohabit_policy::{Explore, ExploreConfig, HostContext, Policy, PolicyKind};

struct Loop {
    host: Checked<RealHost>,
    policy: Box<dyn Policy>,
    log: Option<DecisionLogWriter<RotatingLog>>,
    dry_run: bool,
    /// The policy's fair-share initial plan, which the fail-safe puts back.
    fair_share: Plan,
    /// `ml`'s model file, reloaded when it changes ([`model`]).
    model_watch: Option<ModelWatch>,
    /// `[kubernetes]`: services also come from this node's pods ([`kube`]).
    pods: Option<kube::Pods>,
    /// `state_dir/posterior.json`: what the policy learnt of this host ([`posterior`]).
    posterior: posterior::PosteriorStore,
}

/// How `cohabit run` was asked to run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RunOptions {
    /// Collect, decide and log, but change nothing on the host (nor restore a previous
    /// run's changes).
    pub dry_run: bool,
    /// Stop after this many ticks (then restore, as on SIGTERM).
    pub max_ticks: Option<u64>,
    /// Move the state file aside unread instead of restoring from it (or refusing to start
    /// over one this build cannot read).
    pub discard_state: bool,
    /// Explore around the policy's plans (`--explore`), with the configuration's
    /// `explore` settings or the defaults.
    pub explore: bool,
}

/// How long shutdown waits for a tick still in flight before it restores the host from the
/// state file instead.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// How long a stop signal during the start waits for the start to give up (it checks for
/// the signal between its steps) before the host is restored from the state file instead.
const START_STOP_GRACE: Duration = Duration::from_millis(500);

/// [`run_with`] on a runtime of its own, for the command line. When the daemon ends, a tick
/// stuck in the kernel is not waited for: the runtime is shut down in the background.
pub fn run_blocking(cfg: DaemonConfig, opts: RunOptions) -> Result<u64> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let result = rt.block_on(run_with(cfg, opts));
    rt.shutdown_background();
    result
}

/// [`run_with`] without `--discard-state`.
pub async fn run(cfg: DaemonConfig, dry_run: bool, max_ticks: Option<u64>) -> Result<u64> {
    let opts = RunOptions {
        dry_run,
        max_ticks,
        ..RunOptions::default()
    };
    run_with(cfg, opts).await
}

/// Runs the daemon until a stop signal (or `max_ticks`), then restores the host. Returns the
/// number of ticks run; an error when the start failed, a tick panicked (after the host was
/// restored) or the host could not be restored.
pub async fn run_with(mut cfg: DaemonConfig, opts: RunOptions) -> Result<u64> {
    // A configuration this build cannot run is refused before the lock or the host.
    kube::require_agent(&cfg, kube::BUILT_WITH_KUBERNETES)?;
    if opts.explore && cfg.explore.is_none() {
        cfg.explore = Some(ExploreConfig::default());
    }
    // Before anything else, so that a signal during the start is not lost.
    let mut signals = Signals::new().context("listening for signals")?;
    // Step 2: quick, and it never waits (the lock is tried, not waited for).
    let state = Arc::new(StateDir::open(&cfg.state_dir)?);
    // Slots kept for restoring, so that the restore on a stop signal does not meet EMFILE
    // when counters or connections have used every other one (see `fds`).
    let mut reserve = fds::FdReserve::open(fds::RESTORE_RESERVE).unwrap_or_else(|e| {
        tracing::warn!(error = %e, "no descriptors kept for restoring the host");
        fds::FdReserve::default()
    });
    let stopping = Arc::new(AtomicBool::new(false));
    let (c, st, flag) = (cfg.clone(), Arc::clone(&state), Arc::clone(&stopping));
    let started = interruptible(&mut signals, &stopping, START_STOP_GRACE, move || {
        let (change_log, quarantined) = take_over(&c, &st, opts)?;
        let looped = start(c, opts.dry_run, change_log, &flag)?;
        Ok((looped, quarantined))
    })
    .await?;
    let (looped, quarantined) = match started {
        Started::Done(r) => r?,
        Started::Stopped { stop, finished } => {
            reserve.release();
            return stopped_while_starting(stop, finished, &cfg, &state, opts.dry_run);
        }
    };
    let interval = Duration::from_millis(cfg.interval_ms);
    let timeout = Duration::from_millis(cfg.collect_timeout_ms.max(cfg.interval_ms));
    let (fail_safe_after, metrics_addr) = (cfg.fail_safe_after_ticks, cfg.metrics_addr);
    let mut ex = Exporter::default();
    // A tick may take up to the time-out, so a period is at least that long.
    ex.set_health(interval.max(timeout), exporter::UNHEALTHY_AFTER_TICKS);
    ex.state_quarantined(quarantined);
    let exporter = Arc::new(Mutex::new(ex));
    let metrics = serve_metrics(metrics_addr, &exporter).await;
    let ticker = Ticker {
        state: Arc::new(Mutex::new(looped)),
        exporter,
        stopping,
        timeout,
    };
    let (ticks, exit) = ticker
        .run(&mut signals, interval, opts.max_ticks, fail_safe_after)
        .await;
    // The listener would take the reserve's slots for new connections: it goes first.
    if let Some(m) = metrics {
        m.abort();
        let _ = m.await;
    }
    let restored = ticker.shutdown(&cfg, &state, opts.dry_run, reserve).await;
    match exit {
        Exit::Panic(msg) => Err(anyhow::anyhow!(
            "a tick panicked ({msg}); {}; exiting non-zero so that the service manager restarts cohabit",
            match &restored {
                Ok(()) => "the host was restored".to_string(),
                Err(e) => format!("{e:#}"),
            }
        )),
        Exit::Signal(stop) => {
            restored?;
            tracing::info!(signal = stop.name(), ticks, "host restored; exiting");
            Ok(ticks)
        }
        Exit::Ticks => restored.map(|()| ticks),
    }
}

/// How an [`interruptible`] start ended.
#[derive(Debug)]
enum Started<T> {
    /// It finished first: what it came to.
    Done(Result<T>),
    /// A stop signal came first; `finished` is what the start came to within the grace
    /// (`None`: it is still running, blocked in a step).
    Stopped {
        /// The signal.
        stop: Stop,
        /// The start's end, if it came within the grace.
        finished: Option<Result<T>>,
    },
}

/// Runs `start` on a thread of its own while listening for the stop signals, so that a step
/// that blocks (a file, the kernel, a slow endpoint) cannot make the daemon deaf to SIGTERM
/// (2026-12b review, N7). On a signal, `stopping` is set (the start checks it between its
/// steps and gives up, undoing what it did) and the start is waited for at most `grace`.
/// A thread still blocked then is left behind: the daemon is about to exit. Only a thread
/// that cannot be started is an error.
async fn interruptible<T: Send + 'static>(
    signals: &mut Signals,
    stopping: &AtomicBool,
    grace: Duration,
    start: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<Started<T>> {
    let (tx, mut rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("cohabit-start".into())
        .spawn(move || {
            let end = std::panic::catch_unwind(AssertUnwindSafe(start)).unwrap_or_else(|p| {
                Err(anyhow::anyhow!(
                    "the start panicked: {}",
                    panic_message(p.as_ref())
                ))
            });
            let _ = tx.send(end);
        })
        .context("starting the start's thread")?;
    let ended = |r: Result<Result<T>, _>| {
        r.unwrap_or_else(|_| Err(anyhow::anyhow!("the start ended without a word")))
    };
    tokio::select! {
        biased;
        r = &mut rx => Ok(Started::Done(ended(r))),
        stop = signals.recv() => {
            tracing::info!(signal = stop.name(), "stop signal during the start");
            stopping.store(true, Ordering::Release);
            let finished = tokio::time::timeout(grace, rx).await.ok().map(ended);
            Ok(Started::Stopped { stop, finished })
        }
    }
}

/// Ends a run stopped by a signal during its start, leaving the host as it was before: a
/// start that finished meanwhile is undone through its host; one that gave up has undone
/// itself; one still blocked in a step is left to the process's exit, after the host is
/// restored from the state file (write-ahead, so it lists every change the start made). A
/// change such a start makes after that restore is left in the state file for the next
/// start, like any change of a run that did not end cleanly.
fn stopped_while_starting(
    stop: Stop,
    finished: Option<Result<(Loop, u64)>>,
    cfg: &DaemonConfig,
    state: &StateDir,
    dry_run: bool,
) -> Result<u64> {
    match finished {
        Some(Ok((mut looped, _))) => looped.host.host_mut().restore(),
        Some(Err(e)) => tracing::info!(error = %format!("{e:#}"), "the start gave up"),
        None if dry_run => {}
        None => {
            tracing::warn!(
                grace_ms = START_STOP_GRACE.as_millis(),
                "a start step is still blocked; restoring the host from the state file and exiting without it"
            );
            restore_from_state(cfg, state)?;
        }
    }
    tracing::info!(
        signal = stop.name(),
        "stopped during the start; the host is as it was"
    );
    Ok(0)
}

/// Start-up steps 3 and 4 (see the module doc): the host put back as a previous run left
/// it, with the lock already held. Returns where the host keeps its record from now on, and
/// how many entries went to quarantine.
fn take_over(
    cfg: &DaemonConfig,
    state: &StateDir,
    opts: RunOptions,
) -> Result<(Box<dyn ChangeLog>, u64)> {
    if opts.dry_run {
        check_left_state(state, opts.discard_state);
        return Ok((Box::new(InMemory), 0));
    }
    let quarantined = reconcile(cfg, state, opts.discard_state)?;
    Ok((Box::new(state.change_log()), quarantined))
}

/// Start-up step 5, before the host: the decision log, the GPU clients' environment files
/// and the models.
struct Prepared {
    log: Option<LogFile>,
    model_watch: Option<ModelWatch>,
    models: Models,
}

fn prepare(cfg: &DaemonConfig, dry_run: bool) -> Result<Prepared> {
    let limits = LogLimits {
        max_bytes: cfg.log_max_bytes,
        keep: cfg.log_keep,
    };
    let log = cfg
        .log
        .as_deref()
        .map(|path| LogFile::open(path, limits))
        .transpose()?;
    cohabit_host::gpu::check_env_files(&cfg.services, dry_run)
        .context("a GPU client's environment file")?;
    // Before the model is loaded, so that a change in between is caught at the first check.
    let model_watch = match (&cfg.model, cfg.policy) {
        (Some(path), PolicyKind::Ml) if cfg.model_check_every_ticks > 0 => Some(
            ModelWatch::new(path, cfg.model_check_every_ticks)
                .context("starting the model watcher's thread")?,
        ),
        _ => None,
    };
    // A model that does not load stops the start, naming the file: an operator who asked
    // for ml should not silently get something else.
    let models = Models::load(cfg)?;
    Ok(Prepared {
        log,
        model_watch,
        models,
    })
}

/// Start-up step 5: the decision log, the model, the host, the policy and its initial plan
/// (checked against the host). Gives up, undoing what it did, when `stopping` is set
/// between its steps.
fn start(
    cfg: DaemonConfig,
    dry_run: bool,
    change_log: Box<dyn ChangeLog>,
    stopping: &AtomicBool,
) -> Result<Loop> {
    let interval_ms = cfg.interval_ms;
    let Prepared {
        log,
        model_watch,
        models,
    } = prepare(&cfg, dry_run)?;
    let policy_kind = cfg.policy;
    let explore = cfg.explore.clone();
    let ml_tunables = models.ml;
    let for_pods = cfg.kubernetes.is_some().then(|| cfg.clone());
    let (state_dir, services) = (cfg.state_dir.clone(), cfg.services.clone());
    raise_fd_limit();
    anyhow::ensure!(
        !stopping.load(Ordering::Acquire),
        "stopped during the start, before the host was opened"
    );
    let mut host = Checked::real(open_host(cfg, dry_run, change_log).context("opening the host")?);
    let ctx = HostContext {
        host: host.host().capacity().clone(),
        specs: host.host().specs(),
    };
    let mut policy: Box<dyn Policy> = models.build(policy_kind, ctx.clone())?;
    let pods = for_pods
        .map(|c| kube::start(&c, host.host(), policy_kind, models))
        .transpose()?;
    if let Some(e) = explore {
        tracing::info!(
            margin = e.margin,
            max_cores = e.max_cores,
            max_ways = e.max_ways,
            max_mba_steps = e.max_mba_steps,
            "exploring around the policy's plans while every service keeps its margin"
        );
        policy = Box::new(Explore::new(policy, ctx, e));
    }
    let posterior = posterior::PosteriorStore::new(&state_dir, host.host().capacity(), &services);
    posterior::resume_logged(&posterior, policy.as_mut());
    let log = match log {
        Some(file) => {
            let header = LogHeader::new(
                policy.name(),
                host.simulated(),
                host.host().capacity().clone(),
            )
            .with_tunables(policy_kind.moved_tunables(&ml_tunables));
            Some(file.start(&header)?)
        }
        None => None,
    };
    let initial = policy.initial();
    if stopping.load(Ordering::Acquire) {
        host.host_mut().restore();
        anyhow::bail!("stopped during the start, before the initial plan; the host was restored");
    }
    if let Err(e) = host.launch(&initial.plan) {
        host.host_mut().restore();
        let during = match e {
            supervise::ApplyError::Host(cohabit_host::HostError::Uncontrolled(_)) => {
                "refusing to start"
            }
            _ => "applying the initial plan",
        };
        return Err(anyhow::Error::new(e).context(during));
    }
    tracing::info!(
        policy = policy.name(),
        dry_run,
        interval_ms,
        "cohabit running"
    );
    Ok(Loop {
        host,
        policy,
        log,
        dry_run,
        fair_share: initial.plan,
        model_watch,
        pods,
        posterior,
    })
}

/// Hardware counters take 3 descriptors per CPU per group: before the host sizes their
/// budget from the limit, the soft limit goes up to the hard one.
fn raise_fd_limit() {
    match cohabit_collectors::perf::raise_fd_limit() {
        Ok((was, now)) if now > was => {
            tracing::info!(
                was,
                now,
                "raised the soft open-files limit to the hard limit"
            );
        }
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "the open-files limit could not be raised"),
    }
}

/// Serves the metrics on `addr`, if any (a port that cannot be bound is logged, not fatal).
async fn serve_metrics(
    addr: Option<std::net::SocketAddr>,
    exporter: &Arc<Mutex<Exporter>>,
) -> Option<tokio::task::JoinHandle<()>> {
    let addr = addr?;
    match tokio::net::TcpListener::bind(addr).await {
        Ok(l) => {
            let bound = l.local_addr().map_or(addr, |a| a);
            tracing::info!(addr = %bound, "serving Prometheus metrics on /metrics");
            Some(tokio::spawn(exporter::serve(l, Arc::clone(exporter))))
        }
        Err(e) => {
            tracing::warn!(%addr, error = %e, "cannot serve metrics; running without them");
            None
        }
    }
}

/// Why the loop ended.
#[derive(Debug)]
enum Exit {
    /// `--ticks` were run.
    Ticks,
    /// A stop signal arrived.
    Signal(Stop),
    /// A tick panicked.
    Panic(String),
}

/// What one tick came to.
#[derive(Debug)]
enum TickEnd {
    /// It collected and decided; its plan was applied, needed nothing, or was `refused`.
    Done {
        /// The host (or the check against it) refused the plan.
        refused: bool,
        /// The record could not be logged.
        log_error: Option<String>,
    },
    /// Collection failed.
    Failed(String),
    /// The previous tick still holds the loop's state.
    Busy,
    /// It ran past the time-out (it goes on in the background and holds the state).
    Overran,
    /// It panicked, or an earlier one did (the state is poisoned).
    Panicked(String),
}

impl TickEnd {
    /// True when the tick ended with its plan (or the last good one) in force.
    fn completed(&self) -> bool {
        matches!(self, TickEnd::Done { .. })
    }

    /// True when the tick put the policy's plan in force (what the fail-safe counts).
    fn in_force(&self) -> bool {
        matches!(self, TickEnd::Done { refused: false, .. })
    }
}

impl Loop {
    /// One control interval: collect, decide, apply (checked), log, export.
    fn tick(&mut self, exporter: &Mutex<Exporter>) -> TickEnd {
        let started = std::time::Instant::now();
        if let Some(watch) = &mut self.model_watch {
            watch.tick_and_swap(self.policy.as_mut(), exporter);
        }
        if let Some(pods) = &mut self.pods {
            let plan = &mut self.fair_share;
            let rebuilt = pods.tick(&mut self.host, &mut self.policy, plan, self.dry_run);
            // A policy built again for the new pods starts from the model given at start;
            // a version reloaded since then is the one in force.
            if let Some(latest) = rebuilt
                .then(|| self.model_watch.as_ref().and_then(ModelWatch::latest))
                .flatten()
            {
                self.policy.replace_model(latest);
            }
            let s = pods.status();
            if let Ok(mut ex) = exporter.lock() {
                ex.kubernetes(s.managed, s.skipped, s.api_reachable);
            }
        }
        let mut record = match control::step(&mut self.host, self.policy.as_mut(), self.dry_run) {
            Ok(r) => r,
            Err(e) => return TickEnd::Failed(e.to_string()),
        };
        if let Some(pods) = &self.pods {
            // Which services are the pods' word, so that fleet retraining can tell.
            record.from_pods = pods.from_pods().clone();
        }
        if !self.dry_run {
            // Which processes the plan reached, resource by resource: a group left
            // unmanaged says so, so the log never claims what was not applied.
            record.control = self.host.host().control();
        }
        posterior::tick_logged(&mut self.posterior, self.policy.as_ref());
        let mut logged = Ok(());
        if let Some(log) = &mut self.log {
            logged = log.write(&record).and_then(|()| log.flush());
        }
        if let Ok(mut ex) = exporter.lock() {
            ex.observe(&record, started.elapsed().as_secs_f64());
            for (service, r) in self.host.host_mut().take_push_rejections() {
                export_push_rejections(&mut ex, &service, r);
            }
            if logged.is_err() {
                ex.error(ErrorKind::Log);
            }
        }
        if self.dry_run && !record.changes.is_empty() {
            tracing::info!(changes = ?record.changes, "dry run: would apply");
        }
        TickEnd::Done {
            refused: matches!(record.apply, Some(ApplyOutcome::Refused { .. })),
            log_error: logged
                .err()
                .map(|e| format!("writing the decision log: {e}")),
        }
    }
}

/// Adds a push socket's refusals to `cohabit_push_rejected_total` (every reason, so each
/// series exists from the first tick).
fn export_push_rejections(
    ex: &mut Exporter,
    service: &str,
    r: cohabit_collectors::latency::PushRejections,
) {
    use self::exporter::PushRejectReason as Why;
    for (why, n) in [
        (Why::Credentials, r.credentials),
        (Why::Malformed, r.malformed),
        (Why::Truncated, r.truncated),
        (Why::OverCap, r.over_cap),
    ] {
        ex.push_rejected(service, why, n);
    }
}

/// The loop's shared state and how ticks reach it.
struct Ticker {
    state: Arc<Mutex<Loop>>,
    exporter: Arc<Mutex<Exporter>>,
    /// Set when the loop ends: a tick not yet started does not start.
    stopping: Arc<AtomicBool>,
    /// Longest a tick is waited for.
    timeout: Duration,
}

impl Ticker {
    /// Ticks every `interval` until a stop signal, `max_ticks` or a panic.
    async fn run(
        &self,
        signals: &mut Signals,
        interval: Duration,
        max_ticks: Option<u64>,
        fail_safe_after: u32,
    ) -> (u64, Exit) {
        let mut interval = tokio::time::interval(interval);
        interval.set_missed_tick_behavior(MissedTickBehavior::Skip);
        interval.tick().await;
        let mut fail_safe = FailSafe::new(fail_safe_after);
        let mut ticks = 0u64;
        loop {
            let end = tokio::select! {
                biased;
                stop = signals.recv() => return (ticks, self.stop(stop)),
                _ = interval.tick() => tokio::select! {
                    biased;
                    stop = signals.recv() => return (ticks, self.stop(stop)),
                    end = self.tick() => end,
                },
            };
            ticks += 1;
            if let TickEnd::Panicked(msg) = end {
                tracing::error!(panic = %msg, "a tick panicked; restoring the host and exiting");
                return (ticks, Exit::Panic(msg));
            }
            self.report(&end);
            if fail_safe.note(end.in_force()) {
                self.fail_safe(fail_safe.failed()).await;
            }
            if max_ticks.is_some_and(|m| ticks >= m) {
                return (ticks, Exit::Ticks);
            }
        }
    }

    fn stop(&self, stop: Stop) -> Exit {
        tracing::info!(signal = stop.name(), "stopping: restoring the host");
        Exit::Signal(stop)
    }

    /// Runs one tick on a blocking thread, waiting at most the time-out for it.
    async fn tick(&self) -> TickEnd {
        let st = Arc::clone(&self.state);
        let ex = Arc::clone(&self.exporter);
        let stopping = Arc::clone(&self.stopping);
        let work = tokio::task::spawn_blocking(move || {
            if stopping.load(Ordering::Acquire) {
                return TickEnd::Busy;
            }
            match st.try_lock() {
                Ok(mut guard) => guard.tick(&ex),
                Err(TryLockError::WouldBlock) => TickEnd::Busy,
                Err(TryLockError::Poisoned(_)) => {
                    TickEnd::Panicked("an earlier tick panicked while it held the host".into())
                }
            }
        });
        match tokio::time::timeout(self.timeout, work).await {
            Ok(Ok(end)) => end,
            Ok(Err(e)) if e.is_panic() => TickEnd::Panicked(panic_message(e.into_panic().as_ref())),
            Ok(Err(e)) => TickEnd::Failed(e.to_string()),
            Err(_) => TickEnd::Overran,
        }
    }

    /// Logs a tick's end and exports it.
    fn report(&self, end: &TickEnd) {
        match end {
            TickEnd::Done {
                log_error: Some(e), ..
            } => tracing::warn!(error = %e, "tick's record not logged"),
            TickEnd::Done { .. } | TickEnd::Panicked(_) => {}
            TickEnd::Failed(e) => tracing::warn!(error = %e, "tick failed"),
            TickEnd::Busy => tracing::warn!("the previous tick is still running; tick skipped"),
            TickEnd::Overran => tracing::warn!(
                "tick took longer than {} ms; skipped",
                self.timeout.as_millis()
            ),
        }
        if let Ok(mut ex) = self.exporter.lock() {
            if end.completed() {
                ex.tick_succeeded(SystemTime::now());
            } else {
                ex.error(ErrorKind::Tick);
            }
        }
    }

    /// Puts the policy's fair-share initial plan in force after `failed` consecutive failed
    /// ticks (unless a tick still holds the host; then the next failure tries again).
    async fn fail_safe(&self, failed: u32) {
        let st = Arc::clone(&self.state);
        let work = tokio::task::spawn_blocking(move || {
            let Ok(mut guard) = st.try_lock() else {
                return Err("a tick still holds the host".to_string());
            };
            let Loop {
                host,
                dry_run,
                fair_share,
                ..
            } = &mut *guard;
            if *dry_run {
                return Ok(());
            }
            host.apply(fair_share, &[]).map_err(|e| e.to_string())?;
            host.host_mut().restart_latency_windows();
            Ok(())
        });
        match tokio::time::timeout(self.timeout, work).await {
            Ok(Ok(Ok(()))) => tracing::error!(
                failed,
                "fail-safe: consecutive ticks failed or were refused; the policy's fair-share plan is in force"
            ),
            Ok(Ok(Err(e))) => {
                tracing::error!(failed, error = %e, "fail-safe: the fair-share plan could not be applied");
            }
            Ok(Err(e)) => {
                tracing::error!(failed, error = %e, "fail-safe: the fair-share plan could not be applied");
            }
            Err(_) => tracing::error!(failed, "fail-safe: applying the fair-share plan overran"),
        }
    }

    /// Ends the loop and undoes every change: waits (at most [`SHUTDOWN_GRACE`]) for a tick
    /// still in flight, then restores through the host; if the tick never lets go, restores
    /// from the state file instead (write-ahead, so it lists every change in force).
    /// The `reserve`'s descriptors are closed first, so that restoring has free slots.
    async fn shutdown(
        &self,
        cfg: &DaemonConfig,
        state: &StateDir,
        dry_run: bool,
        mut reserve: fds::FdReserve,
    ) -> Result<()> {
        self.stopping.store(true, Ordering::Release);
        reserve.release();
        let st = Arc::clone(&self.state);
        let work = tokio::task::spawn_blocking(move || {
            let mut guard = st.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(log) = &mut guard.log {
                let _ = log.flush();
            }
            posterior::save_logged(&guard.posterior, guard.policy.as_ref());
            let host = guard.host.host_mut();
            std::panic::catch_unwind(AssertUnwindSafe(|| host.restore()))
                .map_err(|p| panic_message(p.as_ref()))
        });
        let restored = match tokio::time::timeout(SHUTDOWN_GRACE, work).await {
            Ok(Ok(Ok(()))) => Ok(()),
            Ok(Ok(Err(msg))) => Err(anyhow::anyhow!(
                "restoring the host panicked ({msg}); {} keeps what is left for the next start",
                state.changes_path().display()
            )),
            Ok(Err(e)) => Err(anyhow::Error::new(e).context("restoring the host")),
            Err(_) if dry_run => Ok(()),
            Err(_) => {
                tracing::error!(
                    grace_s = SHUTDOWN_GRACE.as_secs(),
                    "a tick still holds the host; restoring it from the state file"
                );
                restore_from_state(cfg, state)
            }
        };
        if !dry_run {
            if let Ok(Some(left)) = state.load() {
                if !left.changes.is_empty() {
                    tracing::warn!(
                        changes = left.changes.changes.len(),
                        file = %state.changes_path().display(),
                        "some changes are still recorded; the next start restores them"
                    );
                }
            }
        }
        restored
    }
}

/// Restores every change the state file lists and saves what is left.
fn restore_from_state(cfg: &DaemonConfig, state: &StateDir) -> Result<()> {
    let Some(saved) = state.load()? else {
        return Ok(());
    };
    let left = restore_recorded(cfg, &saved.changes)?;
    state.save(&left)?;
    anyhow::ensure!(
        left.is_empty(),
        "{} changes could not be undone; {} keeps them",
        left.changes.len(),
        state.changes_path().display()
    );
    Ok(())
}

/// Start-up, before the host is opened: restores what a previous run left in force (the
/// state file, then any leftover cohabit groups), and starts a new, empty record. What
/// cannot be restored goes to quarantine and the start goes on (see [`state`]): a state
/// file this build cannot read is moved aside unread, and changes the host refuses to undo
/// are kept in the quarantine file. Returns how many entries went to quarantine (an
/// unreadable state file counts as one).
fn reconcile(cfg: &DaemonConfig, state: &StateDir, discard: bool) -> Result<u64> {
    let started = std::time::Instant::now();
    let mut quarantined = 0u64;
    let saved = if discard {
        if let Some(to) = state.discard()? {
            tracing::warn!(
                file = %to.display(),
                "--discard-state: the state file was moved aside unread; what it recorded is not restored"
            );
        }
        None
    } else {
        match state.load() {
            Ok(saved) => saved,
            Err(StateError::Unreadable { path, why }) => {
                let to = state.quarantine_file()?;
                tracing::error!(
                    file = %path.display(),
                    moved_to = %to.as_deref().unwrap_or(&path).display(),
                    why,
                    "the state file cannot be read; it was moved to quarantine unread and cohabit starts without it: a change it recorded may still be in force, put it back by hand from that file"
                );
                quarantined += 1;
                None
            }
            Err(e) => return Err(e.into()),
        }
    };
    let mut restored = 0;
    if let Some(saved) = saved.filter(|s| !s.changes.is_empty()) {
        let n = saved.changes.changes.len();
        tracing::warn!(
            pid = saved.pid,
            changes = n,
            file = %state.changes_path().display(),
            "a previous cohabit did not end cleanly; restoring what it changed"
        );
        let left = restore_recorded(cfg, &saved.changes)?;
        if !left.is_empty() {
            let k = left.changes.len();
            let file = state.quarantine(saved.pid, &left.changes)?;
            tracing::error!(
                quarantined = k,
                of = n,
                file = %file.display(),
                "changes recorded by a previous run could not be undone (see the warnings above); they were moved to quarantine and cohabit starts: put them back by hand"
            );
            quarantined += k as u64;
        }
        restored = n - left.changes.len();
    }
    clean_leftovers(cfg)?;
    state.save(&HostChanges::default())?;
    tracing::info!(
        restored,
        quarantined,
        reconcile_ms = started.elapsed().as_secs_f64() * 1e3,
        "host reconciled with the state file"
    );
    Ok(quarantined)
}

/// `--dry-run` changes nothing, so it restores nothing either: it only says what a real
/// start would restore, or move to quarantine.
fn check_left_state(state: &StateDir, discard: bool) {
    match state.load() {
        Ok(Some(saved)) if !saved.changes.is_empty() => tracing::warn!(
            changes = saved.changes.changes.len(),
            file = %state.changes_path().display(),
            "a previous cohabit left changes in force; a start without --dry-run restores them first"
        ),
        Ok(_) => {}
        Err(e) if discard => {
            tracing::warn!(error = %e, "dry run: the state file would be moved aside")
        }
        Err(e) => tracing::warn!(
            error = %e,
            "dry run: a start without --dry-run would move the state file to quarantine unread"
        ),
    }
}

// The host's side of crash safety (`host/`): the only places this module reaches into it.

/// Opens the host with `changes` as the place it keeps its record of every change (saved
/// before each write).
fn open_host(
    cfg: DaemonConfig,
    dry_run: bool,
    changes: Box<dyn ChangeLog>,
) -> Result<RealHost, cohabit_host::HostError> {
    let mut host = RealHost::open(cfg.host_spec(), dry_run)?;
    host.set_change_log(changes)?;
    Ok(host)
}

/// Restores the host from a record alone (the state file of a run that did not end
/// cleanly); returns the changes that could not be undone (a process or group that is gone
/// counts as undone).
fn restore_recorded(cfg: &DaemonConfig, recorded: &HostChanges) -> Result<HostChanges> {
    cohabit_host::restore_recorded(&cfg.paths, recorded)
        .context("restoring the host from the state file")
}

/// Removes cohabit groups no record knows of (a run older than the state file, or one whose
/// state was discarded).
fn clean_leftovers(cfg: &DaemonConfig) -> Result<()> {
    cohabit_host::clean_leftovers(&cfg.paths).context("removing groups a previous run left")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tests that listen for this process's signals (the loop's, the start's): some
    /// send SIGINT or SIGTERM to it, which every listener would see.
    fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
        static ONE: Mutex<()> = Mutex::new(());
        ONE.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Sends `sig` to this process (its listeners take it; see [`one_at_a_time`]).
    fn signal_self(sig: nix::sys::signal::Signal) {
        nix::sys::signal::kill(nix::unistd::Pid::this(), sig).unwrap();
    }

    /// `f` on a thread of its own, waited for at most `limit`: a start that blocks fails
    /// the test instead of hanging it.
    fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        rx.recv_timeout(limit)
            .unwrap_or_else(|_| panic!("still blocked after {limit:?}"))
    }

    #[test]
    fn a_fifo_as_the_model_stops_the_start_within_a_second_naming_it() {
        let _one = one_at_a_time();
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("qos.json");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .is_ok_and(|s| s.success());
        if !made {
            cohabit_testkit::skip(cohabit_testkit::Need::Machine, "mkfifo is not available");
            return;
        }
        let text = format!(
            "policy = \"ml\"\nmodel = \"{}\"\n[paths]\ncgroup = \"{}\"\nstate_dir = \"{}\"\n[[service]]\nname = \"kv\"\np99_target_ms = 1\nmatch = {{ process_name = \"kv\" }}\nlatency = {{ push = \"127.0.0.1:9400\", unauthenticated = true }}\n",
            fifo.display(),
            dir.path().join("no-cgroups").display(),
            dir.path().join("state").display()
        );
        let cfg = DaemonConfig::parse(&text, "t.toml").unwrap();
        let started = std::time::Instant::now();
        let e = within(Duration::from_secs(1), move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(run(cfg, true, Some(1)))
                .map_err(|e| format!("{e:#}"))
        })
        .unwrap_err();
        assert!(
            e.contains("not a regular file (a FIFO)") && e.contains("qos.json"),
            "{e}"
        );
        println!("FIFO model refused after {:?}", started.elapsed());
    }

    /// The error chain of a one-tick `run` of `cfg` (a dry run or not) that must refuse.
    fn refused(cfg: DaemonConfig, dry_run: bool) -> String {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let e = rt.block_on(run(cfg, dry_run, Some(1))).unwrap_err();
        format!("{e:#}")
    }

    /// A plain `cargo build` (no `kubernetes` feature) given `[kubernetes]`: `run` says
    /// which feature is missing before it takes the lock or opens the host.
    #[cfg(not(feature = "kubernetes"))]
    #[test]
    fn kubernetes_without_the_agent_built_in_stops_before_the_state_dir() {
        let dir = tempfile::tempdir().unwrap();
        let text = format!(
            "metrics_addr = \"\"\n[paths]\ncgroup = \"{}\"\nstate_dir = \"{}\"\n[kubernetes]\nnode_name = \"node-1\"\n",
            dir.path().join("no-cgroups").display(),
            dir.path().join("state").display()
        );
        let cfg = DaemonConfig::parse(&text, "t.toml").unwrap();
        let msg = refused(cfg, false);
        assert!(msg.contains("cargo feature `kubernetes`"), "{msg}");
        assert!(!dir.path().join("state").exists());
        assert!(!dir.path().join("no-cgroups").exists());
    }

    #[test]
    fn ml_with_a_model_that_does_not_load_stops_before_touching_the_host() {
        let _one = one_at_a_time();
        let dir = tempfile::tempdir().unwrap();
        let bad = dir.path().join("qos.json");
        std::fs::write(&bad, "{\"format\": \"something else\"}").unwrap();
        let text = format!(
            "policy = \"ml\"\nmodel = \"{}\"\n[paths]\ncgroup = \"{}\"\nstate_dir = \"{}\"\n[[service]]\nname = \"kv\"\np99_target_ms = 1\nmatch = {{ process_name = \"kv\" }}\nlatency = {{ push = \"127.0.0.1:9400\", unauthenticated = true }}\n",
            bad.display(),
            dir.path().join("no-cgroups").display(),
            dir.path().join("state").display()
        );
        let cfg = DaemonConfig::parse(&text, "t.toml").unwrap();
        let msg = refused(cfg, true);
        assert!(msg.contains("loading the model for policy ml"), "{msg}");
        assert!(msg.contains("qos.json"), "{msg}");
        assert!(!dir.path().join("no-cgroups").exists());
    }

    #[test]
    fn ml_with_a_gpu_model_that_does_not_load_stops_before_touching_the_host() {
        let _one = one_at_a_time();
        let dir = tempfile::tempdir().unwrap();
        let cpu = cohabit_models::Model::synthetic(1, &[], 0)
            .save(dir.path(), "qos")
            .unwrap();
        // A CPU artifact given as the GPU model, one of a schema this build does not know,
        // and a file that is no model at all.
        let mut unknown = cohabit_models::Model::synthetic(1, &[], 1);
        unknown.meta.schema = Some("qos-tpu".into());
        let unknown = unknown.save(dir.path(), "tpu").unwrap();
        let junk = dir.path().join("junk.json");
        std::fs::write(&junk, "{\"format\": \"something else\"}").unwrap();
        let cases = [
            (
                &cpu,
                "qos.json",
                "expected a model of feature schema qos-gpu-v1",
            ),
            (&unknown, "tpu.json", "\"qos-tpu\" (unknown to this build)"),
            (&junk, "junk.json", "model metadata"),
        ];
        for (gpu, file, says) in cases {
            let text = format!(
                "policy = \"ml\"\nmodel = \"{}\"\ngpu_model = \"{}\"\n[paths]\ncgroup = \"{}\"\nstate_dir = \"{}\"\n[[service]]\nname = \"kv\"\np99_target_ms = 1\nmatch = {{ process_name = \"kv\" }}\nlatency = {{ push = \"127.0.0.1:9400\", unauthenticated = true }}\n",
                cpu.display(),
                gpu.display(),
                dir.path().join("no-cgroups").display(),
                dir.path().join("state").display()
            );
            let cfg = DaemonConfig::parse(&text, "t.toml").unwrap();
            let msg = refused(cfg, true);
            assert!(
                msg.contains("loading the GPU model (gpu_model) for policy ml"),
                "{msg}"
            );
            assert!(msg.contains(file) && msg.contains(says), "{msg}");
            assert!(!dir.path().join("no-cgroups").exists());
        }
    }

    mod supervised {
        use std::os::unix::fs::MetadataExt;
        use std::path::Path;

        use cohabit_collectors::resctrl::fake::FakeResctrl;
        use cohabit_core::{Observation, WayRange};
        use cohabit_policy::{Decision, StaticPolicy};

        use super::*;

        /// A real host over a fake resctrl (12 ways) and a proc tree without cgroups: only
        /// the fake is written. One service (this test process) and one job.
        fn host(fake: &FakeResctrl, dir: &Path) -> (DaemonConfig, RealHost, StateDir) {
            let pid_file = dir.join("kv.pid");
            std::fs::write(&pid_file, std::process::id().to_string()).unwrap();
            let text = format!(
                "interval_ms = 100\nmetrics_addr = \"\"\n[paths]\nresctrl = \"{}\"\nproc = \"{}\"\nstate_dir = \"{}\"\n[[service]]\nname = \"kv\"\np99_target_ms = 1\nmatch = {{ pid_file = \"{}\", user = 0 }}\nlatency = {{ prometheus = \"http://127.0.0.1:1/metrics\", metric = \"x\" }}\n[[best_effort]]\nname = \"batch\"\nmatch = {{ process_name = \"no-such-process\", user = 0 }}\n",
                fake.root().display(),
                fake.base().join("proc").display(),
                dir.join("state").display(),
                pid_file.display()
            );
            let cfg = DaemonConfig::parse(&text, "test.toml").unwrap();
            let host = RealHost::open_with(cfg.host_spec(), false, Arc::new(fake.clone())).unwrap();
            let uid = std::fs::metadata(dir).unwrap().uid();
            let state = StateDir::open_owned_by(&cfg.state_dir, uid).unwrap();
            (cfg, host, state)
        }

        fn ticker(mut host: RealHost, policy: Box<dyn Policy>, fair_share: Plan) -> Ticker {
            host.launch(&fair_share).unwrap();
            let posterior = posterior::PosteriorStore::new(
                &std::env::temp_dir().join("cohabit-test-no-posterior"),
                host.capacity(),
                &[],
            );
            Ticker {
                state: Arc::new(Mutex::new(Loop {
                    host: Checked::real(host),
                    policy,
                    log: None,
                    dry_run: false,
                    fair_share,
                    model_watch: None,
                    pods: None,
                    posterior,
                })),
                exporter: Arc::new(Mutex::new(Exporter::default())),
                stopping: Arc::new(AtomicBool::new(false)),
                timeout: Duration::from_secs(5),
            }
        }

        fn fair(host: &RealHost) -> (StaticPolicy, Plan) {
            let mut p = StaticPolicy::new(HostContext {
                host: host.capacity().clone(),
                specs: host.specs(),
            });
            let plan = p.initial().plan;
            (p, plan)
        }

        fn kv_schemata(fake: &FakeResctrl) -> String {
            std::fs::read_to_string(fake.root().join("cohabit-kv/schemata")).unwrap_or_default()
        }

        fn block_on<T>(f: impl std::future::Future<Output = T>) -> T {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(f)
        }

        /// Panics in its first decision.
        struct Boom(StaticPolicy);

        impl Policy for Boom {
            fn name(&self) -> &'static str {
                "boom"
            }
            fn initial(&mut self) -> Decision {
                self.0.initial()
            }
            fn decide(&mut self, _: &Observation, _: u64) -> Decision {
                panic!("boom in decide");
            }
        }

        /// A GPU client's environment file in `dir` that a start changed after noting its
        /// original in the state file (write-ahead, as the host does).
        fn start_changed_a_file(state: &StateDir, dir: &Path) -> std::path::PathBuf {
            let env = dir.join("llm.env");
            std::fs::write(&env, "A=1\n").unwrap();
            let mut rec = HostChanges::default();
            rec.note(cohabit_host::changes::Change::File {
                path: env.clone(),
                original: Some("A=1\n".into()),
            });
            state.save(&rec).unwrap();
            std::fs::write(&env, "A=1\nCUDA_MPS_ACTIVE_THREAD_PERCENTAGE=40\n").unwrap();
            env
        }

        #[test]
        fn sigterm_during_a_blocked_start_exits_within_a_second_with_the_host_restored() {
            let _one = one_at_a_time();
            let fake = FakeResctrl::builder().ways(12).build().unwrap();
            let dir = tempfile::tempdir().unwrap();
            let (cfg, _host, state) = host(&fake, dir.path());
            let state = Arc::new(state);
            let (changed, blocked) = std::sync::mpsc::channel();
            // Never sent: the start's step blocks until the test ends.
            let (release, wait) = std::sync::mpsc::channel::<()>();
            let st = Arc::clone(&state);
            let path = dir.path().to_path_buf();
            let (stop, finished, after) = block_on(async move {
                let mut signals = Signals::new().unwrap();
                let stopping = AtomicBool::new(false);
                let start = move || -> Result<u64> {
                    changed.send(start_changed_a_file(&st, &path)).unwrap();
                    let _ = wait.recv();
                    anyhow::bail!("released")
                };
                let sender = tokio::task::spawn_blocking(move || {
                    let env = blocked.recv().unwrap();
                    signal_self(nix::sys::signal::Signal::SIGTERM);
                    (env, std::time::Instant::now())
                });
                let started = interruptible(&mut signals, &stopping, START_STOP_GRACE, start)
                    .await
                    .unwrap();
                let (env, sent) = sender.await.unwrap();
                assert!(
                    stopping.load(Ordering::Acquire),
                    "the start was told to stop"
                );
                let Started::Stopped { stop, finished } = started else {
                    panic!("the start ended before the signal: {started:?}");
                };
                (
                    stop,
                    finished.map(|r| r.map_err(|e| e.to_string())),
                    (env, sent),
                )
            });
            let (env, sent) = after;
            assert_eq!(stop, Stop::Term);
            assert!(
                finished.is_none(),
                "the start is still blocked: {finished:?}"
            );
            let ticks = stopped_while_starting(stop, None, &cfg, &state, false).unwrap();
            let took = sent.elapsed();
            assert_eq!(ticks, 0);
            assert!(
                took < Duration::from_secs(1),
                "stopped {took:?} after SIGTERM"
            );
            assert_eq!(std::fs::read_to_string(&env).unwrap(), "A=1\n", "restored");
            assert!(state.load().unwrap().unwrap().changes.is_empty());
            println!("stopped {took:?} after SIGTERM during a blocked start");
            drop(release);
        }

        #[test]
        fn a_start_told_to_stop_gives_up_at_its_next_step() {
            let _one = one_at_a_time();
            let stopping = Arc::new(AtomicBool::new(false));
            let flag = Arc::clone(&stopping);
            let started = block_on(async move {
                let mut signals = Signals::new().unwrap();
                let start = move || -> Result<()> {
                    signal_self(nix::sys::signal::Signal::SIGTERM);
                    // A slow step, then the check the start makes between its steps.
                    while !flag.load(Ordering::Acquire) {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    anyhow::bail!("stopped during the start, before the host was opened")
                };
                interruptible(&mut signals, &stopping, START_STOP_GRACE, start)
                    .await
                    .unwrap()
            });
            let Started::Stopped {
                stop: Stop::Term,
                finished: Some(Err(e)),
            } = started
            else {
                panic!("{started:?}");
            };
            assert!(e.to_string().contains("before the host was opened"), "{e}");
        }

        #[test]
        fn changes_the_host_cannot_undo_go_to_quarantine_and_the_start_goes_on() {
            let fake = FakeResctrl::builder().ways(12).build().unwrap();
            let dir = tempfile::tempdir().unwrap();
            let (cfg, _host, state) = host(&fake, dir.path());
            // A shared directory: root will not write an environment file there.
            let open = dir.path().join("open");
            std::fs::create_dir(&open).unwrap();
            std::fs::set_permissions(&open, std::os::unix::fs::PermissionsExt::from_mode(0o777))
                .unwrap();
            use cohabit_host::changes::Change;
            let refused = [
                // This host has no cgroups (the kubelet removed the pod's, say).
                Change::CgroupFile {
                    dir: "/sys/fs/cgroup/cpuset/kubepods/pod1".into(),
                    file: "cpuset.cpus".into(),
                    original: "0-4095".into(),
                },
                Change::File {
                    path: open.join("llm.env"),
                    original: Some("A=1\n".into()),
                },
            ];
            let mut rec = HostChanges::default();
            rec.note(Change::MovedProcess {
                pid: u32::MAX - 1,
                start_time: 1,
                from: vec!["/sys/fs/cgroup/cpu/user.slice".into()],
            });
            for c in &refused {
                rec.note(c.clone());
            }
            state.change_log().save(&rec).unwrap();
            let quarantined = reconcile(&cfg, &state, false).unwrap();
            assert_eq!(quarantined, 2);
            let q = state.quarantined().unwrap();
            let kept: Vec<Change> = q.iter().map(|e| e.change.clone()).collect();
            assert_eq!(kept, refused.to_vec());
            assert!(q.iter().all(|e| e.recorded_by_pid == std::process::id()));
            assert!(
                state.load().unwrap().unwrap().changes.is_empty(),
                "a new, empty record"
            );
            // An unreadable state file is moved aside unread, and counts as one.
            std::fs::write(state.changes_path(), "{ not a record").unwrap();
            assert_eq!(reconcile(&cfg, &state, false).unwrap(), 1);
            let aside: Vec<_> = std::fs::read_dir(state.path())
                .unwrap()
                .filter_map(|e| {
                    let n = e.ok()?.file_name().to_string_lossy().into_owned();
                    n.starts_with(state::UNREADABLE_PREFIX).then_some(n)
                })
                .collect();
            assert_eq!(aside.len(), 1, "{aside:?}");
            assert!(state.load().unwrap().unwrap().changes.is_empty());
            assert_eq!(state.quarantined().unwrap().len(), 2, "untouched");
        }

        #[test]
        fn a_tick_that_panics_ends_the_loop_and_the_host_is_restored() {
            let _one = one_at_a_time();
            let fake = FakeResctrl::builder().ways(12).build().unwrap();
            let dir = tempfile::tempdir().unwrap();
            let (cfg, host, state) = host(&fake, dir.path());
            let (inner, plan) = fair(&host);
            let t = ticker(host, Box::new(Boom(inner)), plan);
            assert!(kv_schemata(&fake).contains("L3:0=3f"), "launched");
            block_on(async {
                let mut signals = Signals::new().unwrap();
                let (ticks, exit) = t
                    .run(&mut signals, Duration::from_millis(10), Some(5), 20)
                    .await;
                assert_eq!(ticks, 1);
                let Exit::Panic(msg) = exit else {
                    panic!("{exit:?}");
                };
                assert_eq!(msg, "boom in decide");
                // The state is poisoned: no later tick runs on it, none loops silently.
                let TickEnd::Panicked(later) = t.tick().await else {
                    panic!("a tick ran on poisoned state");
                };
                assert!(later.contains("earlier tick panicked"), "{later}");
                t.shutdown(&cfg, &state, false, fds::FdReserve::default())
                    .await
                    .unwrap();
            });
            assert!(!fake.root().join("cohabit-kv").exists(), "restored");
        }

        /// Moves kv to 8 ways first, then asks for plans that give it no core.
        struct Flip {
            inner: StaticPolicy,
            decided: u32,
        }

        impl Policy for Flip {
            fn name(&self) -> &'static str {
                "flip"
            }
            fn initial(&mut self) -> Decision {
                self.inner.initial()
            }
            fn decide(&mut self, obs: &Observation, now_ms: u64) -> Decision {
                self.decided += 1;
                let mut d = self.inner.decide(obs, now_ms);
                let kv = d.plan.services.get_mut("kv").unwrap();
                if self.decided == 1 {
                    kv.llc_ways = WayRange::new(0, 8);
                    d.plan.best_effort.llc_ways = WayRange::new(8, 4);
                } else {
                    kv.cores = 0;
                }
                d
            }
        }

        #[test]
        fn after_n_failed_ticks_the_fair_share_plan_is_put_back() {
            let _one = one_at_a_time();
            let fake = FakeResctrl::builder().ways(12).build().unwrap();
            let dir = tempfile::tempdir().unwrap();
            let (cfg, host, state) = host(&fake, dir.path());
            let (inner, plan) = fair(&host);
            let policy = Flip { inner, decided: 0 };
            let t = ticker(host, Box::new(policy), plan);
            block_on(async {
                let mut signals = Signals::new().unwrap();
                let every = Duration::from_millis(10);
                t.run(&mut signals, every, Some(1), 3).await;
                assert!(kv_schemata(&fake).contains("L3:0=ff"), "moved");
                let text = t.exporter.lock().unwrap().render();
                let stamp: f64 = text
                    .lines()
                    .find_map(|l| l.strip_prefix("cohabit_last_successful_tick_timestamp_seconds "))
                    .and_then(|v| v.trim().parse().ok())
                    .unwrap_or_else(|| panic!("no timestamp in:\n{text}"));
                assert!(stamp > 1e9, "{stamp}");
                // Two refused plans: the last good one stays.
                t.run(&mut signals, every, Some(2), 3).await;
                assert!(kv_schemata(&fake).contains("L3:0=ff"), "kept");
                // Three in a row: the fair share is back.
                t.run(&mut signals, every, Some(3), 3).await;
                assert!(kv_schemata(&fake).contains("L3:0=3f"), "fair share");
                t.shutdown(&cfg, &state, false, fds::FdReserve::default())
                    .await
                    .unwrap();
            });
        }

        /// Takes 300 ms to decide.
        struct Slow(StaticPolicy);

        impl Policy for Slow {
            fn name(&self) -> &'static str {
                "slow"
            }
            fn initial(&mut self) -> Decision {
                self.0.initial()
            }
            fn decide(&mut self, obs: &Observation, now_ms: u64) -> Decision {
                std::thread::sleep(Duration::from_millis(300));
                self.0.decide(obs, now_ms)
            }
        }

        #[test]
        fn sigint_during_a_tick_stops_the_loop_and_the_host_is_restored() {
            let _one = one_at_a_time();
            let fake = FakeResctrl::builder().ways(12).build().unwrap();
            let dir = tempfile::tempdir().unwrap();
            let (cfg, host, state) = host(&fake, dir.path());
            let (inner, plan) = fair(&host);
            let t = ticker(host, Box::new(Slow(inner)), plan);
            let started = std::time::Instant::now();
            block_on(async {
                let mut signals = Signals::new().unwrap();
                let run = t.run(&mut signals, Duration::from_millis(100), None, 20);
                let interrupt = async {
                    // Inside the first tick (100 ms in, 300 ms long).
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    let pid = std::process::id().to_string();
                    let sent = std::process::Command::new("kill")
                        .args(["-INT", &pid])
                        .status()
                        .unwrap();
                    assert!(sent.success());
                    std::future::pending::<()>().await;
                };
                let (ticks, exit) = tokio::select! {
                    r = run => r,
                    () = interrupt => unreachable!(),
                };
                assert!(matches!(exit, Exit::Signal(Stop::Int)), "{exit:?}");
                assert_eq!(ticks, 0, "the tick in flight was not waited for");
                t.shutdown(&cfg, &state, false, fds::FdReserve::default())
                    .await
                    .unwrap();
            });
            assert!(
                started.elapsed() < Duration::from_millis(900),
                "stopped within an interval of the tick's end: {:?}",
                started.elapsed()
            );
            assert!(!fake.root().join("cohabit-kv").exists(), "restored");
        }
    }
}
