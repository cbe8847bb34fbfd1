//! Raw readings → [`Sample`]: what one service did over one interval.
//!
//! Each tick a service's counters are read as they are ([`Readings`]: cumulative CPU ticks
//! per process, perf totals, MBM bytes; levels such as RSS and LLC occupancy; the requests
//! its latency source saw, whose histogram joins the service's latency window, so that the
//! p99 rests on up to `latency_window` intervals' requests while the request rate stays this
//! interval's ([`MergedWindow`]). Rates come from two readings and the time between them,
//! in one place, [`derive`], which does no I/O. A rate is absent, never zero, when there is
//! no earlier reading, no time passed, a counter went backwards or the object behind it was
//! recreated: a process is its pid *and* start time (a reused pid starts afresh), a resctrl
//! group its directory's identity ([`BandwidthRate`]), and perf totals that could not be
//! read leave a gap rather than a rate over two intervals.
//!
//! Hardware counters are opened once per service, on first use, with descriptors taken from
//! the host's [`FdBudget`]; if the budget has too few left or the kernel refuses, that is
//! logged once and the service's counters are absent from then on (never retried each tick:
//! each try costs 3 `perf_event_open` calls per CPU).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use cohabit_collectors::latency::{
    LatencyError, PromHistogram, PushListener, PushRejections, UnixAccess,
};
use cohabit_collectors::nvml::GpuReading;
use cohabit_collectors::perf::{
    fds_needed, CounterOpener, CounterSet, FdBudget, KernelCounters, PerfTotals,
};
use cohabit_collectors::probe::{Probe, ProbeError, ProbeSettings};
use cohabit_collectors::procfs::Procfs;
use cohabit_collectors::resctrl::{BandwidthRate, MonReading, Resctrl};
use cohabit_collectors::window::{
    HdrWindow, IntervalHistogram, MergedWindow, PromWindow, MS_PER_US,
};
use cohabit_core::Sample;

use super::{HostError, WarnLimit};
use crate::spec::{LatencySource, ManagedService, PushAccess};

/// Where a service's latency comes from, with the window of its last intervals' requests.
enum LatencyReader {
    Push(PushListener, HdrWindow),
    Prom(PromHistogram, PromWindow),
    Probe(Probe, HdrWindow),
}

impl std::fmt::Debug for LatencyReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LatencyReader::Push(..) => "Push",
            LatencyReader::Prom(..) => "Prometheus",
            LatencyReader::Probe(..) => "Probe",
        })
    }
}

/// Requests seen by a latency source since the previous tick, and the p99 of the window
/// they closed.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub(super) struct LatencyWindow {
    /// The p99 of the requests of the last `intervals` intervals together (this one's
    /// included), in milliseconds.
    pub p99_ms: Option<f64>,
    /// How many requests this interval saw.
    pub count: Option<f64>,
    /// Control intervals `p99_ms` rests on.
    pub intervals: Option<u32>,
}

impl LatencyWindow {
    /// Adds this interval's histogram `h` of `count` requests to `window`; the p99 is the
    /// window's, and absent when this interval saw no request (nothing new to report).
    fn pushed<H: IntervalHistogram>(window: &mut MergedWindow<H>, h: H, count: f64) -> Self {
        window.push(h, count);
        let p99_ms = if count > 0.0 { window.p99_ms() } else { None };
        Self {
            p99_ms,
            count: Some(count),
            intervals: p99_ms.and(u32::try_from(window.len()).ok()),
        }
    }
}

/// One service's readings at one instant, counters as read.
#[derive(Debug, Clone, PartialEq, Default)]
pub(super) struct Readings {
    /// Per process: (start time, cumulative user + system time), in clock ticks.
    pub cpu_ticks: BTreeMap<u32, (u64, u64)>,
    /// Resident memory of its processes (`None` when it has none).
    pub rss_bytes: Option<u64>,
    /// Hardware counter totals of its cgroup.
    pub perf: Option<PerfTotals>,
    /// RDT monitoring of its resctrl group.
    pub mon: Option<MonReading>,
    /// Its latency window.
    pub latency: LatencyWindow,
    /// GPU SM utilisation of its processes, summed (a level).
    pub gpu_util_pct: Option<f64>,
    /// Device memory its processes use, bytes, summed (`None`: NVML lists none of them).
    pub gpu_memory_bytes: Option<u64>,
    /// Device memory of its GPU, bytes.
    pub gpu_memory_total_bytes: Option<u64>,
}

/// The sample of one interval from the readings at its start (`prev`) and end (`cur`),
/// `dt_s` seconds apart; `clk_tck` is the unit of CPU ticks.
pub(super) fn derive(
    prev: Option<&Readings>,
    cur: &Readings,
    dt_s: f64,
    clk_tck: f64,
    bw: &mut BandwidthRate,
) -> Sample {
    let mut s = Sample {
        memory_bytes: cur.rss_bytes.map(|b| b as f64),
        llc_occupancy_bytes: cur
            .mon
            .and_then(|m| m.llc_occupancy_bytes)
            .map(|b| b as f64),
        p99_ms: cur.latency.p99_ms,
        p99_intervals: cur.latency.p99_ms.and(cur.latency.intervals),
        gpu_util_pct: cur.gpu_util_pct,
        gpu_memory_bytes: cur.gpu_memory_bytes.map(|b| b as f64),
        gpu_memory_total_bytes: cur.gpu_memory_total_bytes.map(|b| b as f64),
        ..Sample::default()
    };
    if dt_s <= 0.0 {
        return s;
    }
    s.requests_per_s = cur.latency.count.map(|n| n / dt_s);
    let Some(prev) = prev else { return s };
    s.cpu_busy_cores =
        cpu_ticks_delta(&prev.cpu_ticks, &cur.cpu_ticks).map(|ticks| ticks as f64 / clk_tck / dt_s);
    if let (Some(a), Some(b)) = (&prev.perf, &cur.perf) {
        (s.ipc, s.llc_misses_per_s) = PerfTotals::rates(a, b, dt_s);
    }
    if let (Some(a), Some(b)) = (&prev.mon, &cur.mon) {
        s.mem_bw_bytes_per_s = bw.rate(a, b, dt_s);
    }
    s
}

/// CPU ticks used between two readings by the processes present in both (same pid, same
/// start time, counter not gone backwards); `None` when no process is.
fn cpu_ticks_delta(
    prev: &BTreeMap<u32, (u64, u64)>,
    cur: &BTreeMap<u32, (u64, u64)>,
) -> Option<u64> {
    let mut total = None;
    for (pid, (start, ticks)) in cur {
        match prev.get(pid) {
            Some((s, t)) if s == start && t <= ticks => {
                total = Some(total.unwrap_or(0) + (ticks - t));
            }
            _ => {}
        }
    }
    total
}

/// How hardware counters are opened, and the file descriptors they may take: one for the
/// whole host, shared by every service.
#[derive(Debug, Clone)]
pub(super) struct PerfAccess {
    /// Opens a group's counters.
    pub opener: Arc<dyn CounterOpener>,
    /// The descriptors counters may still take.
    pub budget: Arc<Mutex<FdBudget>>,
}

impl PerfAccess {
    /// The kernel's counters under this process's open-files limit.
    pub fn kernel() -> Self {
        Self::new(Arc::new(KernelCounters), FdBudget::from_rlimit())
    }

    /// Counters from `opener` within `budget`.
    pub fn new(opener: Arc<dyn CounterOpener>, budget: FdBudget) -> Self {
        Self {
            opener,
            budget: Arc::new(Mutex::new(budget)),
        }
    }

    /// Opens the counters of `dir` on `cpus` if the budget has their descriptors; says why
    /// not otherwise (the descriptors are given back then).
    fn open(&self, dir: &Path, cpus: &[u32]) -> Result<Budgeted, String> {
        let fds = fds_needed(cpus.len());
        self.budget
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take(fds)
            .map_err(|e| e.to_string())?;
        let cpus: Vec<usize> = cpus.iter().map(|c| *c as usize).collect();
        match self.opener.open(dir, &cpus) {
            Ok(set) => Ok(Budgeted {
                set,
                fds,
                budget: Arc::clone(&self.budget),
            }),
            Err(e) => {
                give_back(&self.budget, fds);
                Err(e.to_string())
            }
        }
    }
}

fn give_back(budget: &Mutex<FdBudget>, fds: usize) {
    budget
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .give_back(fds);
}

/// Open counters and the descriptors they hold, given back when they close.
#[derive(Debug)]
struct Budgeted {
    set: Box<dyn CounterSet>,
    fds: usize,
    budget: Arc<Mutex<FdBudget>>,
}

impl Drop for Budgeted {
    fn drop(&mut self) {
        give_back(&self.budget, self.fds);
    }
}

/// A service's hardware counters.
#[derive(Debug, Default)]
enum PerfState {
    /// Not opened yet.
    #[default]
    Untried,
    /// Open.
    Open(Budgeted),
    /// Opening failed once (logged then): absent from now on.
    GaveUp,
}

/// Where one service's readings come from this tick.
#[derive(Debug)]
pub(super) struct Sources<'a> {
    /// Its processes.
    pub procfs: &'a Procfs,
    /// Its cgroup directory for hardware counters, when they are to be read.
    pub perf_dir: Option<PathBuf>,
    /// How counters are opened, within which budget.
    pub perf: &'a PerfAccess,
    /// CPUs the counters watch.
    pub cpus: &'a [u32],
    /// resctrl, its control group, and its monitoring group under it where the control
    /// group is shared, if it has one.
    pub resctrl: Option<(&'a Resctrl, &'a str, Option<&'a str>)>,
    /// The reading of its GPU, if it uses one and NVML answered.
    pub gpu: Option<&'a GpuReading>,
    /// This tick's scrape of its Prometheus endpoint, if its latency comes from one
    /// ([`scrape_all`]).
    pub scraped: Option<&'a Scraped>,
}

/// What one scrape of a Prometheus endpoint returned: the exposition text, or why not.
pub(super) type Scraped = Result<String, LatencyError>;

/// Most scrapes one tick runs at once (a thread each).
pub(super) const MAX_PARALLEL_SCRAPES: usize = 16;

/// Scrapes every endpoint of `endpoints` (`None`: a service without one) at once, each
/// ending by `deadline`, the tick's collection budget, which each has whole: an endpoint
/// that hangs costs its own scrape only, never a later service's. At most
/// [`MAX_PARALLEL_SCRAPES`] run together (threads that end take the next endpoint), so
/// only more hanging endpoints than that could leave others short. The results come back
/// in the order of `endpoints`.
pub(super) fn scrape_all(
    endpoints: &[Option<&PromHistogram>],
    deadline: Instant,
) -> Vec<Option<Scraped>> {
    let jobs: Vec<(usize, &PromHistogram)> = endpoints
        .iter()
        .enumerate()
        .filter_map(|(i, e)| Some((i, (*e)?)))
        .collect();
    let mut out: Vec<Option<Scraped>> = endpoints.iter().map(|_| None).collect();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results = Mutex::new(Vec::with_capacity(jobs.len()));
    let work = || loop {
        let k = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let Some((i, prom)) = jobs.get(k) else {
            return;
        };
        let got = prom.fetch(deadline);
        results
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((*i, got));
    };
    std::thread::scope(|s| {
        // The calling thread works too; a thread that cannot be started leaves its share
        // to the others.
        for _ in 1..jobs.len().min(MAX_PARALLEL_SCRAPES) {
            let spawned = std::thread::Builder::new()
                .name("cohabit-scrape".into())
                .spawn_scoped(s, work);
            if spawned.is_err() {
                break;
            }
        }
        work();
    });
    for (i, got) in results.into_inner().unwrap_or_else(PoisonError::into_inner) {
        out[i] = Some(got);
    }
    out
}

/// The telemetry state of one service: its latency source, its counters, its last readings.
#[derive(Debug)]
pub(super) struct Telemetry {
    latency: Option<LatencyReader>,
    counters: PerfState,
    last: Option<Readings>,
    /// Pushed latencies refused since [`Self::take_rejections`].
    rejected: PushRejections,
}

/// A Unix push socket's access with every user and group name resolved.
fn resolve_access(a: &PushAccess) -> Result<UnixAccess, cohabit_collectors::users::UserError> {
    Ok(UnixAccess {
        owner: a.owner.as_ref().map(|u| u.resolve()).transpose()?,
        group: a.group.as_ref().map(|g| g.resolve()).transpose()?,
        mode: a.mode,
        allowed_uids: a
            .allowed_users
            .iter()
            .map(|u| u.resolve())
            .collect::<Result<_, _>>()?,
        allowed_gids: a
            .allowed_groups
            .iter()
            .map(|g| g.resolve())
            .collect::<Result<_, _>>()?,
    })
}

impl Telemetry {
    /// Binds the service's latency source (a push socket is bound now, a probe's thread
    /// started, which connects on its own: nothing here waits on the service); its p99
    /// rests on the requests of up to `window` intervals ([`MergedWindow`]).
    pub fn bind(s: &ManagedService, timeout: Duration, window: u32) -> Result<Self, HostError> {
        let latency = match &s.latency {
            Some(LatencySource::Push { addr, access }) => {
                let access = resolve_access(access).map_err(|source| HostError::User {
                    service: s.name.clone(),
                    source,
                })?;
                Some(LatencyReader::Push(
                    PushListener::bind(addr, &access).map_err(|e| HostError::Latency {
                        service: s.name.clone(),
                        source: e,
                    })?,
                    HdrWindow::new(window, MS_PER_US),
                ))
            }
            Some(LatencySource::Prometheus {
                url,
                metric,
                unit_seconds,
            }) => {
                let prom = PromHistogram::new(url, metric, *unit_seconds, timeout);
                let ms_per_unit = prom.ms_per_unit();
                Some(LatencyReader::Prom(
                    prom,
                    PromWindow::new(window, ms_per_unit),
                ))
            }
            Some(LatencySource::Probe {
                url,
                rate_hz,
                timeout_ms,
            }) => {
                let settings = ProbeSettings {
                    rate_hz: *rate_hz,
                    timeout: Duration::from_millis(*timeout_ms),
                };
                let probe = Probe::start(url, &settings).map_err(|error| HostError::Probe {
                    service: s.name.clone(),
                    error,
                })?;
                Some(LatencyReader::Probe(
                    probe,
                    HdrWindow::new(window, MS_PER_US),
                ))
            }
            None => None,
        };
        Ok(Self {
            latency,
            counters: PerfState::Untried,
            last: None,
            rejected: PushRejections::default(),
        })
    }

    /// Reads the service now and returns the sample of the interval since the last call.
    #[allow(clippy::too_many_arguments)]
    pub fn sample(
        &mut self,
        src: &Sources<'_>,
        service: &str,
        pids: &BTreeSet<u32>,
        dt_s: f64,
        clk_tck: f64,
        bw: &mut BandwidthRate,
        warn: &mut WarnLimit,
    ) -> Sample {
        let cur = self.read(src, service, pids, warn);
        let s = derive(self.last.as_ref(), &cur, dt_s, clk_tck, bw);
        self.last = Some(cur);
        s
    }

    fn read(
        &mut self,
        src: &Sources<'_>,
        service: &str,
        pids: &BTreeSet<u32>,
        warn: &mut WarnLimit,
    ) -> Readings {
        let mut r = Readings::default();
        if !pids.is_empty() {
            let mut rss = 0u64;
            for &pid in pids {
                if let Some(st) = src.procfs.stat(pid) {
                    r.cpu_ticks.insert(pid, (st.start_ticks, st.cpu_ticks));
                    rss += st.rss_bytes;
                }
            }
            r.rss_bytes = Some(rss);
        }
        if let Some(dir) = &src.perf_dir {
            r.perf = self.read_perf(dir, src, service, warn);
        }
        if let Some((resctrl, group, mon)) = src.resctrl {
            let read = match mon {
                Some(m) => resctrl.read_mon_group(group, m),
                None => resctrl.read_mon(Some(group)),
            };
            match read {
                Ok(m) => r.mon = Some(m),
                Err(e) => {
                    if warn.allow(&format!("mon:{group}")) {
                        tracing::warn!(group, error = %e, "RDT monitoring unreadable (logged once a minute)");
                    }
                }
            }
        }
        r.latency = self.read_latency(service, pids, src.scraped, warn);
        if let Some(g) = src.gpu {
            let util: Vec<f64> = pids
                .iter()
                .filter_map(|p| g.process_sm_util_pct.get(p).copied())
                .collect();
            r.gpu_util_pct = (!util.is_empty()).then(|| util.iter().sum::<f64>().min(100.0));
            let used: Vec<u64> = pids
                .iter()
                .filter_map(|p| g.process_memory_bytes.get(p).copied())
                .collect();
            r.gpu_memory_bytes = (!used.is_empty()).then(|| used.iter().sum());
            r.gpu_memory_total_bytes = g.memory_total_bytes;
        }
        r
    }

    /// The counters' totals, opening them on first use; a service whose counters could not
    /// be opened once has none from then on (logged that once).
    fn read_perf(
        &mut self,
        dir: &Path,
        src: &Sources<'_>,
        service: &str,
        warn: &mut WarnLimit,
    ) -> Option<PerfTotals> {
        if matches!(self.counters, PerfState::Untried) {
            self.counters = match src.perf.open(dir, src.cpus) {
                Ok(c) => PerfState::Open(c),
                Err(e) => {
                    tracing::warn!(service, dir = %dir.display(), error = %e, "hardware counters could not be opened; IPC and LLC misses are absent for this service from now on (not retried)");
                    PerfState::GaveUp
                }
            };
        }
        let PerfState::Open(counters) = &mut self.counters else {
            return None;
        };
        match counters.set.read() {
            Ok(t) => Some(t),
            Err(e) => {
                if warn.allow(&format!("perf-read:{service}")) {
                    tracing::warn!(service, error = %e, "hardware counters unreadable (logged once a minute)");
                }
                None
            }
        }
    }

    /// Pushed latencies refused since the last call, by reason (`None`: not a push source).
    pub fn take_rejections(&mut self) -> Option<PushRejections> {
        matches!(self.latency, Some(LatencyReader::Push(..)))
            .then(|| std::mem::take(&mut self.rejected))
    }

    /// Forgets the intervals the service's p99 rests on: what it runs under changed, and
    /// the next interval starts a new window.
    pub fn restart_latency_window(&mut self) {
        match &mut self.latency {
            Some(LatencyReader::Push(_, w) | LatencyReader::Probe(_, w)) => w.restart(),
            Some(LatencyReader::Prom(_, w)) => w.restart(),
            None => {}
        }
    }

    /// Intervals the latency window holds (`None`: no latency source).
    #[cfg(test)]
    pub fn latency_intervals(&self) -> Option<usize> {
        match &self.latency {
            Some(LatencyReader::Push(_, w) | LatencyReader::Probe(_, w)) => Some(w.len()),
            Some(LatencyReader::Prom(_, w)) => Some(w.len()),
            None => None,
        }
    }

    /// Waits for a probe's first answer ([`Probe::first_answer`]: at most its time-out and
    /// a second); `Ok` at once for any other source. Only for the services of the
    /// configuration file, at start: nothing waits on a pod's probe.
    pub fn first_probe_answer(&self) -> Result<(), ProbeError> {
        match &self.latency {
            Some(LatencyReader::Probe(p, _)) => p.first_answer(),
            _ => Ok(()),
        }
    }

    /// The Prometheus endpoint its latency comes from, if it does: what [`scrape_all`]
    /// fetches before the services are read.
    pub fn prometheus(&self) -> Option<&PromHistogram> {
        match &self.latency {
            Some(LatencyReader::Prom(p, _)) => Some(p),
            _ => None,
        }
    }

    /// What the latency source saw since the last tick, added to the service's latency
    /// window. A push socket learns the service's processes (`pids`), whose datagrams it
    /// accepts from now on; a Prometheus source reads this tick's `scraped` text. A scrape
    /// that fails adds nothing (its requests count in the next scrape's difference).
    fn read_latency(
        &mut self,
        service: &str,
        pids: &BTreeSet<u32>,
        scraped: Option<&Scraped>,
        warn: &mut WarnLimit,
    ) -> LatencyWindow {
        match &mut self.latency {
            Some(LatencyReader::Push(l, window)) => {
                l.set_pids(pids.iter().copied());
                let w = l.take();
                self.rejected += w.rejected;
                if w.rejected.total() > 0 && warn.allow(&format!("push-rejected:{service}")) {
                    let x = w.rejected;
                    tracing::warn!(service, credentials = x.credentials, malformed = x.malformed, truncated = x.truncated, over_cap = x.over_cap, "pushed latencies refused (logged once a minute; counted in cohabit_push_rejected_total)");
                }
                LatencyWindow::pushed(window, w.hist, w.count as f64)
            }
            Some(LatencyReader::Prom(p, window)) => {
                let Some(scraped) = scraped else {
                    return LatencyWindow::default();
                };
                let polled = match scraped {
                    Ok(text) => p.ingest_interval(text).map_err(|e| e.to_string()),
                    Err(e) => Err(e.to_string()),
                };
                if p.bad_lines() > 0 && warn.allow(&format!("prom-lines:{service}")) {
                    tracing::warn!(service, lines = p.bad_lines(), "lines of the histogram in the scrape could not be read and were skipped (logged once a minute)");
                }
                match polled {
                    Ok(Some(i)) => LatencyWindow::pushed(window, i.buckets, i.count),
                    Ok(None) => LatencyWindow::default(),
                    Err(e) => {
                        if warn.allow(&format!("latency:{service}")) {
                            tracing::warn!(service, error = %e, "latency unavailable (logged once a minute)");
                        }
                        LatencyWindow::default()
                    }
                }
            }
            Some(LatencyReader::Probe(p, window)) => {
                let w = p.take();
                if (w.timeouts > 0 || w.last_error.is_some())
                    && warn.allow(&format!("probe:{service}"))
                {
                    let error = w.last_error.as_deref().unwrap_or("none");
                    tracing::warn!(service, timeouts = w.timeouts, errors = w.errors, error, "latency probe requests timed out or failed; each counts at the time-out (logged once a minute)");
                }
                if warn.allow(&format!("probe-cpu:{service}")) {
                    tracing::info!(service, url = %p.url(), requests = w.count, cpu_ms = w.cpu_s * 1000.0, "the latency probe's own CPU time in the last interval (logged once a minute)");
                }
                LatencyWindow::pushed(window, w.hist, w.count as f64)
            }
            None => LatencyWindow::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use cohabit_collectors::latency::Buckets;

    use super::*;

    /// A counter opener without hardware: counts its calls, fails when told to, and gives
    /// totals that grow by a fixed step per read.
    #[derive(Debug, Default)]
    struct FakeOpener {
        fail: bool,
        calls: std::sync::atomic::AtomicUsize,
    }

    #[derive(Debug)]
    struct FakeSet {
        reads: f64,
    }

    impl CounterSet for FakeSet {
        fn read(&mut self) -> std::io::Result<PerfTotals> {
            self.reads += 1.0;
            Ok(PerfTotals {
                instructions: 2e9 * self.reads,
                cycles: 1e9 * self.reads,
                llc_misses: 1e6 * self.reads,
            })
        }
    }

    impl CounterOpener for FakeOpener {
        fn open(&self, _: &Path, _: &[usize]) -> std::io::Result<Box<dyn CounterSet>> {
            self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            if self.fail {
                return Err(std::io::Error::from_raw_os_error(libc::EMFILE));
            }
            Ok(Box::new(FakeSet { reads: 0.0 }))
        }
    }

    /// The warnings logged while `f` runs, one line each.
    fn warnings_of(f: impl FnOnce()) -> Vec<String> {
        #[derive(Clone, Default)]
        struct Buf(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Buf {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buf = Buf::default();
        let out = buf.clone();
        let sub = tracing_subscriber::fmt()
            .with_writer(move || out.clone())
            .with_ansi(false)
            .with_max_level(tracing::Level::WARN)
            .finish();
        tracing::subscriber::with_default(sub, f);
        let text = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        text.lines().map(str::to_string).collect()
    }

    fn silent() -> Telemetry {
        Telemetry {
            latency: None,
            counters: PerfState::Untried,
            last: None,
            rejected: PushRejections::default(),
        }
    }

    /// `n` ticks of one service counted on `cpus`, its samples.
    fn ticks(t: &mut Telemetry, perf: &PerfAccess, cpus: &[u32], n: usize) -> Vec<Sample> {
        let dir = tempfile::tempdir().unwrap();
        let procfs = Procfs::new(dir.path());
        let src = Sources {
            procfs: &procfs,
            perf_dir: Some(dir.path().to_path_buf()),
            perf,
            cpus,
            resctrl: None,
            gpu: None,
            scraped: None,
        };
        let mut warn = WarnLimit::default();
        (0..n)
            .map(|_| {
                t.sample(
                    &src,
                    "kv",
                    &BTreeSet::new(),
                    1.0,
                    100.0,
                    &mut bw(),
                    &mut warn,
                )
            })
            .collect()
    }

    #[test]
    fn a_gpu_clients_memory_is_its_processes_sum_beside_its_gpus_total() {
        const GIB: u64 = 1 << 30;
        let dir = tempfile::tempdir().unwrap();
        let procfs = Procfs::new(dir.path());
        let perf = PerfAccess::new(Arc::new(FakeOpener::default()), FdBudget::for_limit(1024));
        let reading = GpuReading {
            memory_total_bytes: Some(40 * GIB),
            process_memory_bytes: BTreeMap::from([(10, 3 * GIB), (11, GIB), (99, 20 * GIB)]),
            process_sm_util_pct: BTreeMap::from([(10, 30.0)]),
            ..GpuReading::default()
        };
        let src = Sources {
            procfs: &procfs,
            perf_dir: None,
            perf: &perf,
            cpus: &[0],
            resctrl: None,
            gpu: Some(&reading),
            scraped: None,
        };
        let mut t = silent();
        let mut warn = WarnLimit::default();
        let mut sample = |pids: &[u32]| {
            let pids: BTreeSet<u32> = pids.iter().copied().collect();
            t.sample(&src, "llm", &pids, 1.0, 100.0, &mut bw(), &mut warn)
        };
        let s = sample(&[10, 11, 12]);
        assert_eq!(
            s.gpu_memory_bytes,
            Some((4 * GIB) as f64),
            "pid 99 is another's"
        );
        assert_eq!(s.gpu_memory_total_bytes, Some((40 * GIB) as f64));
        assert_eq!(s.gpu_util_pct, Some(30.0));
        // None of its processes on the GPU: no reading of its memory, not zero.
        let s = sample(&[12]);
        assert_eq!((s.gpu_memory_bytes, s.gpu_util_pct), (None, None));
    }

    #[test]
    fn counters_over_the_fd_budget_are_absent_with_one_warning_and_never_retried() {
        // A soft limit of 128 leaves no descriptors for counters.
        let opener = Arc::new(FakeOpener::default());
        let perf = PerfAccess::new(opener.clone(), FdBudget::for_limit(128));
        let mut t = silent();
        let mut samples = vec![];
        let logged = warnings_of(|| samples = ticks(&mut t, &perf, &[0, 1, 2, 3], 5));
        assert_eq!(samples.len(), 5, "every tick gives a sample");
        assert!(samples
            .iter()
            .all(|s| s.ipc.is_none() && s.llc_misses_per_s.is_none()));
        let perf_lines: Vec<_> = logged
            .iter()
            .filter(|l| l.contains("hardware counters"))
            .collect();
        assert_eq!(perf_lines.len(), 1, "{logged:?}");
        assert!(
            perf_lines[0].contains("12 file descriptors"),
            "{}",
            perf_lines[0]
        );
        assert_eq!(
            opener.calls.load(std::sync::atomic::Ordering::SeqCst),
            0,
            "nothing opened beyond the budget"
        );
        assert_eq!(perf.budget.lock().unwrap().used(), 0);
    }

    #[test]
    fn counters_that_fail_to_open_are_tried_once_and_give_their_fds_back() {
        let opener = Arc::new(FakeOpener {
            fail: true,
            ..FakeOpener::default()
        });
        let perf = PerfAccess::new(opener.clone(), FdBudget::with_available(100));
        let mut t = silent();
        let mut samples = vec![];
        let logged = warnings_of(|| samples = ticks(&mut t, &perf, &[0, 1], 6));
        assert_eq!(opener.calls.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert!(samples.iter().all(|s| s.ipc.is_none()));
        let perf_lines: Vec<_> = logged
            .iter()
            .filter(|l| l.contains("hardware counters"))
            .collect();
        assert_eq!(perf_lines.len(), 1, "{logged:?}");
        assert_eq!(perf.budget.lock().unwrap().used(), 0);
    }

    #[test]
    fn the_budget_is_shared_and_counters_give_it_back_when_they_go() {
        // Room for one two-CPU group (6 fds), not two.
        let opener = Arc::new(FakeOpener::default());
        let perf = PerfAccess::new(opener.clone(), FdBudget::with_available(8));
        let (mut a, mut b) = (silent(), silent());
        let sa = ticks(&mut a, &perf, &[0, 1], 2);
        assert_eq!(sa[1].ipc, Some(2.0), "the first group is counted");
        assert_eq!(perf.budget.lock().unwrap().used(), 6);
        let sb = ticks(&mut b, &perf, &[0, 1], 2);
        assert_eq!(sb[1].ipc, None, "the second does not fit");
        drop(a);
        assert_eq!(
            perf.budget.lock().unwrap().used(),
            0,
            "closed counters give their fds back"
        );
        let mut c = silent();
        assert_eq!(ticks(&mut c, &perf, &[0, 1], 2)[1].ipc, Some(2.0));
        assert_eq!(opener.calls.load(std::sync::atomic::Ordering::SeqCst), 2);
    }

    fn bw() -> BandwidthRate {
        BandwidthRate {
            dropped: 0,
            max_bytes_per_s: 1e12,
        }
    }

    fn cpu(v: &[(u32, u64, u64)]) -> Readings {
        Readings {
            cpu_ticks: v.iter().map(|(p, s, t)| (*p, (*s, *t))).collect(),
            rss_bytes: Some(4096),
            ..Readings::default()
        }
    }

    #[test]
    fn the_first_reading_gives_levels_but_no_rates() {
        let mut cur = cpu(&[(10, 1, 500)]);
        cur.latency = LatencyWindow {
            p99_ms: Some(2.5),
            count: Some(300.0),
            intervals: Some(3),
        };
        let s = derive(None, &cur, 2.0, 100.0, &mut bw());
        assert_eq!(s.memory_bytes, Some(4096.0));
        assert_eq!(s.p99_ms, Some(2.5));
        assert_eq!(s.p99_intervals, Some(3));
        assert_eq!(s.requests_per_s, Some(150.0), "a window is a count already");
        assert_eq!(s.cpu_busy_cores, None);
        assert_eq!(s.mem_bw_bytes_per_s, None);
    }

    /// One interval's requests between two scrapes: `fast` under 1 ms, `slow` in
    /// (1, 100] ms (bounds in seconds).
    fn scraped(fast: f64, slow: f64) -> Buckets {
        let n = fast + slow;
        Buckets(vec![(0.001, fast), (0.1, n), (f64::INFINITY, n)])
    }

    #[test]
    fn the_p99_rests_on_the_window_and_the_rate_on_this_interval() {
        let mut w = PromWindow::new(3, 1000.0);
        let first = LatencyWindow::pushed(&mut w, scraped(100.0, 0.0), 100.0);
        assert_eq!(first.intervals, Some(1));
        // 2 slow of this interval's 100 are 2 %, but 1 % of the window's 200.
        let second = LatencyWindow::pushed(&mut w, scraped(98.0, 2.0), 100.0);
        assert_eq!((second.count, second.intervals), (Some(100.0), Some(2)));
        let p99 = second.p99_ms.unwrap();
        assert!((p99 - 1.0).abs() < 1e-9, "{p99}");
        let mut alone = PromWindow::new(1, 1000.0);
        let own = LatencyWindow::pushed(&mut alone, scraped(98.0, 2.0), 100.0);
        assert!(own.p99_ms.unwrap() > 50.0, "{:?}", own.p99_ms);
        let cur = Readings {
            latency: second,
            ..Readings::default()
        };
        let s = derive(None, &cur, 2.0, 100.0, &mut bw());
        assert_eq!(s.requests_per_s, Some(50.0), "this interval's requests");
        assert_eq!((s.p99_ms, s.p99_intervals), (Some(p99), Some(2)));
        // Two more: the first interval leaves the window (cap 3).
        LatencyWindow::pushed(&mut w, scraped(100.0, 0.0), 100.0);
        let fourth = LatencyWindow::pushed(&mut w, scraped(100.0, 0.0), 100.0);
        assert_eq!(fourth.intervals, Some(3));
        // No request this interval: no p99, and nothing for it to rest on.
        let idle = LatencyWindow::pushed(&mut w, scraped(0.0, 0.0), 0.0);
        assert_eq!(
            (idle.p99_ms, idle.intervals, idle.count),
            (None, None, Some(0.0))
        );
        let cur = Readings {
            latency: idle,
            ..Readings::default()
        };
        let s = derive(None, &cur, 1.0, 100.0, &mut bw());
        assert_eq!((s.p99_intervals, s.requests_per_s), (None, Some(0.0)));
    }

    #[test]
    fn cpu_time_counts_only_processes_seen_twice_as_the_same_process() {
        // 100 ticks/s, 2 s: pid 10 used 300 ticks (1.5 cores); pid 11 is new; pid 12 was
        // reused (another start time); pid 13's counter went backwards.
        let prev = cpu(&[(10, 1, 500), (12, 5, 900), (13, 7, 800)]);
        let cur = cpu(&[(10, 1, 800), (11, 2, 50), (12, 6, 10), (13, 7, 700)]);
        let s = derive(Some(&prev), &cur, 2.0, 100.0, &mut bw());
        assert_eq!(s.cpu_busy_cores, Some(1.5));
        // Nobody seen twice: absent, not zero.
        let s = derive(
            Some(&cpu(&[(12, 5, 900)])),
            &cpu(&[(12, 6, 10)]),
            2.0,
            100.0,
            &mut bw(),
        );
        assert_eq!(s.cpu_busy_cores, None);
        // An idle process seen twice is a real zero.
        let s = derive(
            Some(&cpu(&[(10, 1, 5)])),
            &cpu(&[(10, 1, 5)]),
            2.0,
            100.0,
            &mut bw(),
        );
        assert_eq!(s.cpu_busy_cores, Some(0.0));
    }

    #[test]
    fn no_time_passed_means_no_rates() {
        let prev = cpu(&[(10, 1, 500)]);
        let mut cur = cpu(&[(10, 1, 800)]);
        cur.latency.count = Some(10.0);
        let s = derive(Some(&prev), &cur, 0.0, 100.0, &mut bw());
        assert_eq!((s.cpu_busy_cores, s.requests_per_s), (None, None));
        assert_eq!(s.memory_bytes, Some(4096.0));
    }

    #[test]
    fn perf_and_mbm_rates_need_both_readings_and_the_same_group() {
        let totals = |i: f64, c: f64, m: f64| PerfTotals {
            instructions: i,
            cycles: c,
            llc_misses: m,
        };
        let mon = |bytes: u64, identity: u64| MonReading {
            llc_occupancy_bytes: Some(1 << 20),
            mbm_total_bytes: Some(bytes),
            mbm_local_bytes: None,
            identity,
        };
        let prev = Readings {
            perf: Some(totals(1e9, 2e9, 1e6)),
            mon: Some(mon(1_000, 7)),
            ..Readings::default()
        };
        let cur = Readings {
            perf: Some(totals(3e9, 3e9, 3e6)),
            mon: Some(mon(5_000, 7)),
            ..Readings::default()
        };
        let s = derive(Some(&prev), &cur, 2.0, 100.0, &mut bw());
        assert_eq!((s.ipc, s.llc_misses_per_s), (Some(2.0), Some(1e6)));
        assert_eq!(s.mem_bw_bytes_per_s, Some(2_000.0));
        assert_eq!(s.llc_occupancy_bytes, Some(f64::from(1u32 << 20)));
        // The group was recreated: no bandwidth; counters unreadable last time: no IPC.
        let recreated = Readings {
            mon: Some(mon(6_000, 8)),
            ..cur.clone()
        };
        assert_eq!(
            derive(Some(&cur), &recreated, 2.0, 100.0, &mut bw()).mem_bw_bytes_per_s,
            None
        );
        let gap = Readings {
            perf: None,
            ..prev.clone()
        };
        assert_eq!(derive(Some(&gap), &cur, 2.0, 100.0, &mut bw()).ipc, None);
    }
}
