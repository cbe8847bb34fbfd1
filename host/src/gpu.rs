//! GPU shares on a real host: publish a service's MPS share and apply it by restarting its
//! client.
//!
//! A running MPS client keeps the share it started with. So a new share is *published*: the
//! service's environment file gets `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=<pct>` (and the
//! pinned-memory limit, if configured), and where the service has an MPS server of its own
//! the server's limit is set too (`set_active_thread_percentage <server> <pct>`). The share
//! becomes *effective* when the service's configured restart hook has restarted the
//! client, at most once per `min_restart_interval_ms`. The decision log shows both: the plan
//! holds the published share, the observation the effective one.
//!
//! Environment files belong to the service, and root writes them (security review row 3):
//! - only the lines of the variables cohabit sets ([`MANAGED`]) are rewritten; every other
//!   line, comments included, stays as it is, in place;
//! - the file is opened without following a symlink, its directory must be root's and
//!   writable by nobody else, and it is replaced atomically (see [`crate::files`]);
//! - its content before cohabit's first write is noted, write-ahead, in the host's record
//!   of changes ([`GpuActuator::publish_noted`]); [`restore_file`] puts it back from such a
//!   note, again touching only the managed lines (an edit made meanwhile survives).
//!
//! Restart hooks run on a thread of their own, never inside a tick (row 7; see
//! [`crate::hook`]): [`GpuActuator::restart_due`] only starts hooks that are due and
//! collects the ones that ended. While a hook runs, its share stays pending. With an MPS
//! control daemon, a restarted client's share is in force only once one of its processes is
//! an MPS client again; one that does not reconnect within its `hook_timeout_ms` is logged
//! and its previous share stays the effective one (the restart is tried again later).
//!
//! Mechanisms ([`ShareMechanism`], chosen per host from the probe by [`mechanism_for`]):
//! - [`RestartHook`]: MPS v2 active-thread percentages, the path above; a change costs the
//!   client's restart.
//! - [`V3Dynamic`]: MPS v3 dynamic resource adjustment of the client's named server
//!   (`gpu.mps_server`): the share is in force at once, no restart (the environment file
//!   is still written, so a later restart keeps it). A client without a named server falls
//!   back to the restart path.
//!   Static SM partitions (`-S`) are fixed at a client's start like v2 percentages: they are
//!   probed and reported, not used as a mechanism of their own.
//!
//! A refusal of the control program is logged with its words and the previous share stays
//! in force (the apply fails and is undone).
//!
//! GPU memory ([`plan_pinned_limits`]): each client's pinned device-memory limit is planned
//! from its measured use with headroom, latency-critical clients first, so a best-effort
//! job cannot push a latency-critical one out of memory.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cohabit_collectors::mps::{MpsCapabilities, MpsControl, MpsError};
use cohabit_core::ShareChange;

use crate::changes::Change as HostChange;
use crate::files::{self, FileError};
use crate::hook::{self, Hook, Outcome};
use crate::spec::{GpuClient, ManagedService};

/// The variable that carries a client's share.
const VAR: &str = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE";
/// The variable that carries the pinned device-memory limit.
const PINNED_VAR: &str = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT";
/// The variables cohabit writes in environment files; no other line is touched.
pub const MANAGED: [&str; 2] = [VAR, PINNED_VAR];

/// Why a GPU share could not be published or taken back.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// The MPS control program refused the share (its words are in the source); the
    /// previous share stays in force.
    #[error("MPS control refused a share of {pct}% for {service}: {source}")]
    Refused {
        /// The service.
        service: String,
        /// The share asked for.
        pct: u8,
        /// The control program's answer.
        source: MpsError,
    },
    /// The environment file or its directory could not be checked, read or written.
    #[error("{service}'s environment file: {source}")]
    File {
        /// The service.
        service: String,
        /// What went wrong, naming the path.
        source: FileError,
    },
    /// A pinned-memory limit that would add lines to the environment file.
    #[error("the pinned-memory limit {limit:?} would add lines to the environment file")]
    PinnedLimit {
        /// The limit as given.
        limit: String,
    },
    /// The file's original could not be noted in the host's record of changes, so nothing
    /// was written.
    #[error("noting {} before writing it: {source}", path.display())]
    Note {
        /// The environment file.
        path: PathBuf,
        /// Why the record could not be saved.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// How long shutdown waits for a running hook before killing it.
const SHUTDOWN_WAIT: Duration = Duration::from_secs(1);
/// How long shutdown then waits for a killed hook's thread to report.
const KILL_WAIT: Duration = Duration::from_millis(500);

/// A restart hook in flight.
#[derive(Debug)]
struct Running {
    thread: JoinHandle<Outcome>,
    cancel: Arc<AtomicBool>,
    /// The share published when it started: effective once it succeeds.
    share: Option<u8>,
}

/// One GPU client cohabit manages.
#[derive(Debug)]
struct Client {
    cfg: GpuClient,
    published: Option<u8>,
    effective: Option<u8>,
    pending: bool,
    last_restart: Option<Instant>,
    /// The environment file as it was before cohabit first wrote it (`Some(None)`: absent).
    original: Option<Option<String>>,
    hook: Option<Running>,
    /// A restarted client not yet seen back among MPS clients: its share and since when.
    awaiting: Option<(Option<u8>, Instant)>,
    /// Most device memory its processes were seen using, bytes.
    peak_bytes: Option<u64>,
    /// Its planned pinned device-memory limit (`<gpu>=<MiB>M`), from [`plan_pinned_limits`].
    pinned: Option<String>,
}

/// Headroom over a client's measured peak in its pinned device-memory limit.
pub const MEM_HEADROOM: f64 = 0.25;
/// Least headroom, MiB.
const MEM_HEADROOM_MIN_MIB: u64 = 512;
/// Device memory kept for the driver and MPS servers, fraction of the GPU.
const MEM_DRIVER_RESERVE: f64 = 0.03;
/// Least limit a best-effort client gets, MiB (it still starts, and fails its own
/// allocations rather than a latency-critical client's).
const MEM_BE_MIN_MIB: u64 = 256;

/// One GPU client's memory for [`plan_pinned_limits`].
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryUse {
    /// Service or job name.
    pub service: String,
    /// Latency-critical (served first) or best effort.
    pub latency_critical: bool,
    /// Most device memory it was seen using, bytes (absent: not measured yet).
    pub peak_bytes: Option<u64>,
}

/// Pinned device-memory limits, MiB, for the clients of one GPU of `total_bytes`.
///
/// Latency-critical clients first: each gets its measured peak plus [`MEM_HEADROOM`] (at
/// least [`MEM_HEADROOM_MIN_MIB`]); one not measured yet gets no limit of its own (absent).
/// Best-effort clients share what is left after the driver's reserve, in proportion to
/// their peaks (equally when unmeasured), at least [`MEM_BE_MIN_MIB`] each. So the sum of
/// best-effort limits never reaches into what latency-critical clients were measured to
/// need, unless that alone overfills the GPU (then best effort gets the minimum).
pub fn plan_pinned_limits(clients: &[MemoryUse], total_bytes: u64) -> BTreeMap<String, u64> {
    const MIB: f64 = 1024.0 * 1024.0;
    let total_mib = total_bytes as f64 / MIB;
    let mut out = BTreeMap::new();
    let mut lc_mib = 0.0;
    for c in clients.iter().filter(|c| c.latency_critical) {
        let Some(peak) = c.peak_bytes else { continue };
        let peak = peak as f64 / MIB;
        let limit = (peak * (1.0 + MEM_HEADROOM)).max(peak + MEM_HEADROOM_MIN_MIB as f64);
        let limit = limit.min(total_mib).ceil();
        lc_mib += limit;
        out.insert(c.service.clone(), cohabit_core::whole(limit));
    }
    let be: Vec<&MemoryUse> = clients.iter().filter(|c| !c.latency_critical).collect();
    let room = (total_mib * (1.0 - MEM_DRIVER_RESERVE) - lc_mib).max(0.0);
    let weight = |c: &MemoryUse| c.peak_bytes.map_or(1.0, |b| (b as f64).max(1.0));
    let weights: f64 = be.iter().map(|c| weight(c)).sum();
    for c in be {
        let share = room * weight(c) / weights;
        let limit = share.floor().max(MEM_BE_MIN_MIB as f64);
        out.insert(c.service.clone(), cohabit_core::whole(limit));
    }
    out
}

/// Why the host's record of changes could not note a file (its error, boxed: the record
/// belongs to the host, above this module).
pub type NoteFailed = Box<dyn std::error::Error + Send + Sync>;

/// Applies a published share to a service's running client: one implementation per
/// mechanism the host offers.
pub trait ShareMechanism: std::fmt::Debug + Send {
    /// What a change costs: a restart, or nothing.
    fn change(&self) -> ShareChange;
    /// Applies `pct` at once where this mechanism can: `Ok(true)` when it is in force,
    /// `Ok(false)` when it waits for the client's restart. `Err` is the control program's
    /// refusal.
    fn apply_now(&self, cfg: &GpuClient, pct: u8) -> Result<bool, MpsError>;
}

/// MPS v2 percentages: a running client keeps its share; the restart hook applies it.
#[derive(Debug, Clone, Copy, Default)]
pub struct RestartHook;

impl ShareMechanism for RestartHook {
    fn change(&self) -> ShareChange {
        ShareChange::Restart
    }
    fn apply_now(&self, _cfg: &GpuClient, _pct: u8) -> Result<bool, MpsError> {
        Ok(false)
    }
}

/// MPS v3 dynamic resource adjustment of each client's named server.
#[derive(Debug, Clone)]
pub struct V3Dynamic {
    /// The control program.
    pub mps: MpsControl,
}

impl ShareMechanism for V3Dynamic {
    fn change(&self) -> ShareChange {
        ShareChange::Live
    }
    fn apply_now(&self, cfg: &GpuClient, pct: u8) -> Result<bool, MpsError> {
        let Some(server) = cfg.mps_server.as_deref() else {
            return Ok(false);
        };
        self.mps.update_server_share(server, pct).map(|()| true)
    }
}

/// The mechanism for this host, from its MPS probe: v3 dynamic adjustment where the daemon
/// offers it, the restart path otherwise (no daemon, v2, an unknown answer).
pub fn mechanism_for(
    mps: Option<&MpsControl>,
    caps: Option<&MpsCapabilities>,
) -> Box<dyn ShareMechanism> {
    match (mps, caps) {
        (Some(mps), Some(c)) if c.daemon_running && c.dynamic_adjustment => {
            Box::new(V3Dynamic { mps: mps.clone() })
        }
        _ => Box::new(RestartHook),
    }
}

/// The GPU side of the real host's actuator.
#[derive(Debug)]
pub struct GpuActuator {
    mps: Option<MpsControl>,
    mechanism: Box<dyn ShareMechanism>,
    clients: BTreeMap<String, Client>,
}

/// The variable a line of an environment file sets (`KEY=…` or `export KEY=…`), if any.
fn key_of(line: &str) -> Option<&str> {
    let l = line.trim_start();
    let l = l.strip_prefix("export ").unwrap_or(l);
    let (key, _) = l.split_once('=')?;
    let key = key.trim();
    (!key.is_empty() && !key.starts_with('#')).then_some(key)
}

fn share_in(text: &str) -> Option<u8> {
    text.lines()
        .filter(|l| key_of(l) == Some(VAR))
        .find_map(|l| l.split_once('=')?.1.trim().parse().ok())
}

/// `text` with the line of each variable of `set` replaced by the given line (`Some`) or
/// removed (`None`): the first line setting it is replaced in place, later ones dropped; a
/// missing one is appended. Every other line stays as it is.
fn with_lines(text: &str, set: &[(&str, Option<String>)]) -> String {
    let mut done = vec![false; set.len()];
    let mut out = String::with_capacity(text.len() + 64);
    let mut put = |line: &str| {
        out.push_str(line);
        out.push('\n');
    };
    for line in text.lines() {
        match key_of(line).and_then(|k| set.iter().position(|(name, _)| *name == k)) {
            None => put(line),
            Some(i) => {
                if let (false, Some(new)) = (done[i], &set[i].1) {
                    put(new);
                }
                done[i] = true;
            }
        }
    }
    for (i, (_, line)) in set.iter().enumerate() {
        if let (false, Some(new)) = (done[i], line) {
            put(new);
        }
    }
    out
}

/// The environment file `current` with the share `pct` (and the pinned limit, when
/// given; an existing limit line is kept otherwise). Refuses a limit that would add lines.
fn env_with_share(current: &str, pct: u8, pinned: Option<&str>) -> Result<String, GpuError> {
    let mut set = vec![(VAR, Some(format!("{VAR}={pct}")))];
    if let Some(limit) = pinned {
        if limit.contains(['\n', '\r', '\0']) {
            return Err(GpuError::PinnedLimit {
                limit: limit.to_string(),
            });
        }
        set.push((PINNED_VAR, Some(format!("{PINNED_VAR}={limit}"))));
    }
    Ok(with_lines(current, &set))
}

/// The environment file `current` with cohabit's variables as in `original` (the file
/// before cohabit's first write, whose lines come back verbatim; `None`: it did not exist).
/// `None` when the file should go: cohabit created it and nothing but its lines is in it.
fn env_restored(current: &str, original: Option<&str>) -> Option<String> {
    let set: Vec<(&str, Option<String>)> = MANAGED
        .iter()
        .map(|name| {
            let line = original
                .and_then(|o| o.lines().find(|l| key_of(l) == Some(*name)))
                .map(str::to_string);
            (*name, line)
        })
        .collect();
    let text = with_lines(current, &set);
    if original.is_none() && text.trim().is_empty() {
        return None;
    }
    Some(text)
}

/// Puts a GPU client's environment file back from a note of its original (`None`: cohabit
/// created it): cohabit's variables get their old lines back, or go; other lines stay; a
/// file cohabit created and that holds nothing else is removed. For
/// [`HostChange::File`] notes, on exit and after a crash.
pub fn restore_file(path: &Path, original: Option<&str>) -> Result<(), FileError> {
    let Some((current, meta)) = files::read_regular(path)? else {
        return match original {
            // Gone meanwhile: put the original back whole.
            Some(text) => files::replace(path, text.as_bytes(), None),
            None => Ok(()),
        };
    };
    match env_restored(&current, original) {
        Some(text) if text == current => Ok(()),
        Some(text) => files::replace(path, text.as_bytes(), Some(&meta)),
        None => files::remove(path),
    }
}

/// Checks, at start, every GPU service's environment file: its directory must be owned by
/// root and writable by nobody else (created `0755` when missing, unless `dry_run`), and the
/// file, if there, must be a regular file and not a symlink. The error names the path.
pub fn check_env_files(services: &[ManagedService], dry_run: bool) -> Result<(), FileError> {
    for g in services.iter().filter_map(|s| s.gpu.as_ref()) {
        let dir = files::parent_dir(&g.env_file);
        if dry_run && !dir.exists() {
            continue;
        }
        files::ensure_private_dir(dir, 0o755)?;
        files::read_regular(&g.env_file)?;
    }
    Ok(())
}

/// Sets the limit of the MPS server that serves only `mine` (the service's pids) to `pct`.
fn set_server_limit(mps: &MpsControl, service: &str, mine: &[u32], pct: u8) {
    match mps.server_of(mine) {
        Ok(Some((server, clients))) if clients.iter().all(|p| mine.contains(p)) => {
            if let Err(e) = mps.set_active_thread_percentage(server, pct) {
                tracing::warn!(service, error = %e, "MPS server limit not set");
            }
        }
        Ok(_) => {}
        Err(e) => {
            tracing::warn!(service, error = %e, "MPS server list unavailable; the environment file carries the share")
        }
    }
}

impl GpuActuator {
    /// One client per configured GPU service; `mps` talks to the control daemon, if any.
    pub fn new(services: &[ManagedService], mps: Option<MpsControl>) -> Self {
        let clients = services
            .iter()
            .filter_map(|s| {
                let cfg = s.gpu.clone()?;
                // A client started with the share already in its file has that share.
                let existing = files::read_regular(&cfg.env_file)
                    .ok()
                    .flatten()
                    .and_then(|(t, _)| share_in(&t));
                Some((
                    s.name.clone(),
                    Client {
                        cfg,
                        published: existing,
                        effective: existing,
                        pending: false,
                        last_restart: None,
                        original: None,
                        hook: None,
                        awaiting: None,
                        peak_bytes: None,
                        pinned: None,
                    },
                ))
            })
            .collect();
        Self {
            mps,
            mechanism: Box::new(RestartHook),
            clients,
        }
    }

    /// [`Self::new`] applying shares by the mechanism the host's MPS offers: probes it
    /// (one line in the log says what was found) and picks by [`mechanism_for`].
    pub fn with_probe(services: &[ManagedService], mps: Option<MpsControl>) -> Self {
        let caps = mps.as_ref().map(MpsControl::probe);
        if let Some(c) = &caps {
            tracing::info!(version = ?c.version, protocol = ?c.protocol, dynamic_adjustment = c.dynamic_adjustment, static_partitions = c.static_partitions, refused = ?c.refusals, "MPS probed");
        }
        let mechanism = mechanism_for(mps.as_ref(), caps.as_ref());
        Self::new(services, mps).with_mechanism(mechanism)
    }

    /// The same, applying shares by `mechanism` (see [`mechanism_for`]).
    pub fn with_mechanism(mut self, mechanism: Box<dyn ShareMechanism>) -> Self {
        self.mechanism = mechanism;
        self
    }

    /// Notes each client's device memory (`used_bytes`: the sum over its processes, from
    /// NVML) and plans every client's pinned limit per GPU by [`plan_pinned_limits`]
    /// (`totals[i]`: GPU `i`'s memory; `latency_critical`: which services are). The limits
    /// go into each client's environment file with its next share, and apply from its next
    /// start. Returns the limits planned, `<gpu>=<MiB>M` by service.
    pub fn guard_memory(
        &mut self,
        used_bytes: &BTreeMap<String, u64>,
        totals: &[Option<u64>],
        latency_critical: &dyn Fn(&str) -> bool,
    ) -> BTreeMap<String, String> {
        for (name, c) in &mut self.clients {
            if let Some(&u) = used_bytes.get(name) {
                c.peak_bytes = Some(c.peak_bytes.map_or(u, |p| p.max(u)));
            }
        }
        let mut planned = BTreeMap::new();
        for (gpu, total) in totals.iter().enumerate() {
            let Some(total) = *total else { continue };
            let uses: Vec<MemoryUse> = self
                .clients
                .iter()
                .filter(|(_, c)| c.cfg.index as usize == gpu)
                .map(|(name, c)| MemoryUse {
                    service: name.clone(),
                    latency_critical: latency_critical(name),
                    peak_bytes: c.peak_bytes,
                })
                .collect();
            for (name, mib) in plan_pinned_limits(&uses, total) {
                planned.insert(name, format!("{gpu}={mib}M"));
            }
        }
        for (name, c) in &mut self.clients {
            c.pinned = planned.get(name).cloned();
        }
        planned
    }

    /// What a share change costs on this host.
    pub fn share_change(&self) -> ShareChange {
        self.mechanism.change()
    }

    /// Sets the control daemon's default pinned-memory limit from `device=limit` (e.g.
    /// `0=8G`), for servers started from now on. Logged, not fatal, when refused.
    pub fn apply_pinned_default(&self, spec: &str) {
        let Some(mps) = &self.mps else { return };
        let parsed = spec
            .split_once('=')
            .and_then(|(d, l)| Some((d.trim().parse::<u32>().ok()?, l.trim())));
        match parsed {
            Some((device, limit)) => {
                if let Err(e) = mps.set_default_device_pinned_mem_limit(device, limit) {
                    tracing::warn!(error = %e, "MPS pinned-memory limit not set");
                }
            }
            None => tracing::warn!(spec, "mps.pinned_mem_limit must look like 0=8G; ignored"),
        }
    }

    /// The share a service's running client has, if known.
    pub fn effective(&self, service: &str) -> Option<u8> {
        self.clients.get(service).and_then(|c| c.effective)
    }

    /// Whether a service's client is being restarted: its hook runs, or the restarted
    /// client is not yet back among MPS clients.
    pub fn restarting(&self, service: &str) -> bool {
        self.clients
            .get(service)
            .is_some_and(|c| c.hook.is_some() || c.awaiting.is_some())
    }

    /// The share published for a service.
    pub fn published(&self, service: &str) -> Option<u8> {
        self.clients.get(service).and_then(|c| c.published)
    }

    /// [`Self::publish_noted`] without a record of changes (the original is kept in memory
    /// only).
    pub fn publish(
        &mut self,
        service: &str,
        pct: u8,
        pinned_limit: Option<&str>,
    ) -> Result<(), GpuError> {
        self.publish_noted(service, pct, pinned_limit, &mut |_| Ok(()))
    }

    /// Publishes `pct` for `service`: the share's line (and the pinned limit's, when given)
    /// in its environment file is set, every other line kept. A change marks the client for
    /// restart; nothing happens if the share is already published.
    ///
    /// Before cohabit's first write to the file, `note` gets a [`HostChange::File`] with the
    /// file's content (write-ahead: note it in the host's record and save the record before
    /// returning `Ok`). When `note` fails, nothing is written.
    pub fn publish_noted(
        &mut self,
        service: &str,
        pct: u8,
        pinned_limit: Option<&str>,
        note: &mut dyn FnMut(HostChange) -> Result<(), NoteFailed>,
    ) -> Result<(), GpuError> {
        let Self {
            mechanism, clients, ..
        } = self;
        let Some(c) = clients.get_mut(service) else {
            return Ok(());
        };
        if c.published == Some(pct) {
            return Ok(());
        }
        let path = c.cfg.env_file.clone();
        let file = |source| GpuError::File {
            service: service.to_string(),
            source,
        };
        // Refused before anything is noted or written.
        files::check_private_dir(files::parent_dir(&path)).map_err(file)?;
        let live = mechanism.apply_now(&c.cfg, pct).map_err(|source| {
            tracing::warn!(service, share = pct, error = %source, "MPS control refused the share; the previous one stays in force");
            GpuError::Refused {
                service: service.to_string(),
                pct,
                source,
            }
        })?;
        let current = files::read_regular(&path).map_err(file)?;
        let (text, meta) = current.map_or((None, None), |(t, m)| (Some(t), Some(m)));
        let pinned_limit = c.pinned.as_deref().or(pinned_limit);
        let new = env_with_share(text.as_deref().unwrap_or(""), pct, pinned_limit)?;
        if c.original.is_none() {
            note(HostChange::File {
                path: path.clone(),
                original: text.clone(),
            })
            .map_err(|source| GpuError::Note {
                path: path.clone(),
                source,
            })?;
            c.original = Some(text);
        }
        files::replace(&path, new.as_bytes(), meta.as_ref()).map_err(file)?;
        c.published = Some(pct);
        if live {
            c.effective = Some(pct);
        }
        c.pending = c.effective != Some(pct);
        Ok(())
    }

    /// Takes back a [`Self::publish`]: publishes `previous` again, or, when nothing had been
    /// published, puts cohabit's lines of the environment file back as they were and drops
    /// the pending restart.
    pub fn revert(
        &mut self,
        service: &str,
        previous: Option<u8>,
        pinned_limit: Option<&str>,
    ) -> Result<(), GpuError> {
        if let Some(pct) = previous {
            return self.publish(service, pct, pinned_limit);
        }
        let Some(c) = self.clients.get_mut(service) else {
            return Ok(());
        };
        if let Some(original) = &c.original {
            restore_file(&c.cfg.env_file, original.as_deref()).map_err(|source| {
                GpuError::File {
                    service: service.to_string(),
                    source,
                }
            })?;
            c.original = None;
        }
        c.published = None;
        c.pending = false;
        Ok(())
    }

    /// Collects the restart hooks that ended (a success makes their share effective), then
    /// starts the hook of each client whose published share is not yet effective, if none
    /// of its is running and its minimum interval since the last restart has passed. Never
    /// waits for a hook. Returns the services whose restart completed since the last call.
    ///
    /// Each hook runs on a thread of its own: first, an MPS server that serves only that
    /// service (its clients all among `pids[service]`) gets the share as its limit; then the
    /// hook, with its time-out.
    pub fn restart_due(&mut self, now: Instant, pids: &BTreeMap<String, Vec<u32>>) -> Vec<String> {
        let mut done = self.poll_hooks();
        done.extend(self.check_reconnected(now, pids));
        for (name, c) in &mut self.clients {
            if !c.pending || c.hook.is_some() {
                continue;
            }
            let wait = Duration::from_millis(c.cfg.min_restart_interval_ms);
            if c.last_restart.is_some_and(|t| now.duration_since(t) < wait) {
                continue;
            }
            c.last_restart = Some(now);
            let mine = pids.get(name).cloned().unwrap_or_default();
            match start_hook(name, c, self.mps.clone(), mine) {
                Ok(running) => c.hook = Some(running),
                Err(e) => {
                    tracing::warn!(service = %name, error = %e, "restart hook could not run; the new share stays pending")
                }
            }
        }
        done
    }

    /// Restarted clients seen back among MPS clients get their share in force; one not
    /// back within its `hook_timeout_ms` is logged, keeps its previous share, and is
    /// restarted again when due. Returns the services whose share came into force.
    fn check_reconnected(
        &mut self,
        now: Instant,
        pids: &BTreeMap<String, Vec<u32>>,
    ) -> Vec<String> {
        let Some(mps) = self.mps.as_ref() else {
            return Vec::new();
        };
        let mut done = Vec::new();
        for (name, c) in &mut self.clients {
            let Some((share, since)) = c.awaiting else {
                continue;
            };
            let mine = pids.get(name).map(Vec::as_slice).unwrap_or_default();
            let seen = if mine.is_empty() {
                Ok(None)
            } else {
                mps.server_of(mine)
            };
            match seen {
                Ok(Some(_)) => {
                    c.awaiting = None;
                    c.effective = share;
                    c.pending = c.published != c.effective;
                    tracing::info!(service = %name, share = ?c.effective, "client restarted with its new MPS share");
                    done.push(name.clone());
                }
                answer
                    if now.saturating_duration_since(since)
                        >= Duration::from_millis(c.cfg.hook_timeout_ms) =>
                {
                    let said = match answer {
                        Err(e) => e.to_string(),
                        _ => format!("none of pids {mine:?} is an MPS client"),
                    };
                    tracing::warn!(service = %name, share = ?share, answer = %said, "the restarted client did not reconnect to MPS within hook_timeout_ms; its previous share stays in force");
                    c.awaiting = None;
                    c.pending = c.published != c.effective;
                }
                _ => {}
            }
        }
        done
    }

    /// True while a restart hook runs.
    pub fn hooks_running(&self) -> bool {
        self.clients.values().any(|c| c.hook.is_some())
    }

    /// Collects the hooks that ended, logging how; returns the services restarted.
    fn poll_hooks(&mut self) -> Vec<String> {
        let mut done = Vec::new();
        for (name, c) in &mut self.clients {
            if !c.hook.as_ref().is_some_and(|h| h.thread.is_finished()) {
                continue;
            }
            let Some(run) = c.hook.take() else { continue };
            let outcome = run.thread.join();
            let restarted = matches!(&outcome, Ok(o) if o.succeeded());
            match outcome {
                Ok(o) => log_outcome(name, &c.cfg, &o),
                Err(_) => tracing::error!(service = %name, "the restart hook's thread panicked"),
            }
            if restarted && self.mps.is_some() {
                // In force once the new client is seen among MPS clients.
                c.awaiting = Some((run.share, Instant::now()));
            } else if restarted {
                c.effective = run.share;
                c.pending = c.published != c.effective;
                tracing::info!(service = %name, share = ?c.effective, "client restarted with its new MPS share");
                done.push(name.clone());
            }
        }
        done
    }

    /// Waits up to [`SHUTDOWN_WAIT`] for running hooks, then kills the rest (their process
    /// groups) and waits up to [`KILL_WAIT`] for them to report.
    fn stop_hooks(&mut self) {
        let until = |c: &Self, deadline: Instant| {
            while c
                .clients
                .values()
                .any(|c| c.hook.as_ref().is_some_and(|h| !h.thread.is_finished()))
                && Instant::now() < deadline
            {
                std::thread::sleep(Duration::from_millis(10));
            }
        };
        if !self.hooks_running() {
            return;
        }
        until(self, Instant::now() + SHUTDOWN_WAIT);
        for (name, c) in &self.clients {
            if let Some(h) = c.hook.as_ref().filter(|h| !h.thread.is_finished()) {
                tracing::warn!(service = %name, "shutting down: killing the running restart hook");
                h.cancel.store(true, std::sync::atomic::Ordering::Relaxed);
            }
        }
        until(self, Instant::now() + KILL_WAIT);
        self.poll_hooks();
        for (name, c) in &mut self.clients {
            if c.hook.take().is_some() {
                tracing::error!(service = %name, "a restart hook did not end after SIGKILL; not waited for");
            }
        }
    }

    /// Stops running hooks (see [`Self::stop_hooks`]) and puts cohabit's lines of every
    /// environment file back as they were (running clients keep their share until they next
    /// restart). Returns the files restored, whose [`HostChange::File`] notes can go.
    pub fn restore(&mut self) -> Vec<PathBuf> {
        self.stop_hooks();
        let mut restored = Vec::new();
        for c in self.clients.values_mut() {
            let Some(original) = c.original.take() else {
                continue;
            };
            let path = &c.cfg.env_file;
            match restore_file(path, original.as_deref()) {
                Ok(()) => restored.push(path.clone()),
                Err(e) => {
                    tracing::warn!(file = %path.display(), error = %e, "could not restore a GPU client's environment file");
                }
            }
        }
        restored
    }

    /// Whether a service is a GPU client cohabit manages.
    pub fn manages(&self, service: &str) -> bool {
        self.clients.contains_key(service)
    }

    /// The environment file of a service.
    pub fn env_file(&self, service: &str) -> Option<&Path> {
        self.clients.get(service).map(|c| c.cfg.env_file.as_path())
    }
}

/// Starts `c`'s restart hook on a thread: the MPS server's limit first, then the hook.
fn start_hook(
    name: &str,
    c: &Client,
    mps: Option<MpsControl>,
    mine: Vec<u32>,
) -> std::io::Result<Running> {
    let share = c.published;
    let extra: Vec<(&str, String)> = share.map(|p| (VAR, p.to_string())).into_iter().collect();
    let h = Hook {
        command: c.cfg.restart.clone(),
        env: hook::environment(std::env::vars_os(), &extra),
        timeout: Duration::from_millis(c.cfg.hook_timeout_ms),
    };
    let cancel = Arc::new(AtomicBool::new(false));
    let stop = Arc::clone(&cancel);
    let service = name.to_string();
    let thread = std::thread::Builder::new()
        .name(format!("hook-{name}"))
        .spawn(move || {
            if let (Some(mps), Some(pct)) = (&mps, share) {
                set_server_limit(mps, &service, &mine, pct);
            }
            hook::run(&h, &stop)
        })?;
    Ok(Running {
        thread,
        cancel,
        share,
    })
}

/// Logs how a restart hook ended, with what it printed.
fn log_outcome(service: &str, cfg: &GpuClient, o: &Outcome) {
    let command = &cfg.restart;
    match o {
        Outcome::Exited { status, output } if status.success() => {
            if !(output.stdout.is_empty() && output.stderr.is_empty()) {
                tracing::info!(service, stdout = %output.stdout, stderr = %output.stderr, truncated = output.truncated, "restart hook output");
            }
        }
        Outcome::Exited { status, output } => {
            tracing::warn!(service, %status, %command, stdout = %output.stdout, stderr = %output.stderr, truncated = output.truncated, "restart hook failed; the new share stays pending");
        }
        Outcome::Killed {
            cancelled: false,
            after,
            output,
        } => {
            tracing::warn!(service, %command, after_ms = after.as_millis(), stdout = %output.stdout, stderr = %output.stderr, "restart hook timed out (hook_timeout_ms) and its process group was killed; the new share stays pending");
        }
        Outcome::Killed {
            cancelled: true, ..
        } => {
            tracing::warn!(service, %command, "restart hook killed at shutdown");
        }
        Outcome::NotStarted(e) => {
            tracing::warn!(service, error = %e, "restart hook could not run; the new share stays pending");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;
    use crate::hook::tests::live_members;
    use crate::spec::Matcher;

    fn service(
        dir: &Path,
        restart: &str,
        interval_ms: u64,
        hook_timeout_ms: u64,
    ) -> ManagedService {
        ManagedService {
            name: "llm".into(),
            p99_target_ms: Some(100.0),
            matcher: Matcher::ProcessName("llm".into()),
            constraint: Default::default(),
            placement: Default::default(),
            allow_unmanaged: false,
            latency: None,
            priority: 0,
            gpu: Some(GpuClient {
                index: 0,
                env_file: dir.join("llm.env"),
                restart: restart.into(),
                min_restart_interval_ms: interval_ms,
                hook_timeout_ms,
                mps_server: None,
            }),
        }
    }

    /// Waits for running hooks to end and collects them.
    fn settle(g: &mut GpuActuator) -> Vec<String> {
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut done = Vec::new();
        while g.hooks_running() {
            assert!(Instant::now() < deadline, "a hook did not end");
            std::thread::sleep(Duration::from_millis(10));
            done.extend(g.poll_hooks());
        }
        done
    }

    #[test]
    fn only_cohabits_lines_are_rewritten_in_place_and_restored() {
        let text = "# the model\nMODEL=small\nexport CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30\nCUDA_MPS_PIPE_DIRECTORY=/run/mps\nCUDA_MPS_ACTIVE_THREAD_PERCENTAGE=31\nTAIL=1";
        let new = env_with_share(text, 50, Some("0=8G")).unwrap();
        assert_eq!(
            new,
            "# the model\nMODEL=small\nCUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50\nCUDA_MPS_PIPE_DIRECTORY=/run/mps\nTAIL=1\nCUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8G\n"
        );
        assert_eq!(share_in(&new), Some(50));
        // An edit made while cohabit ran survives the restore; cohabit's lines go back.
        let edited = new.replace("MODEL=small", "MODEL=large");
        assert_eq!(
            env_restored(&edited, Some(text)).unwrap(),
            "# the model\nMODEL=large\nexport CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30\nCUDA_MPS_PIPE_DIRECTORY=/run/mps\nTAIL=1\n"
        );
        // A file cohabit created goes, unless someone added to it.
        assert_eq!(
            env_restored("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50\n", None),
            None
        );
        assert_eq!(
            env_restored("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50\nX=1\n", None).as_deref(),
            Some("X=1\n")
        );
        // Without a limit, an existing limit line is left alone.
        assert_eq!(
            env_with_share("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=4G\n", 20, None).unwrap(),
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=4G\nCUDA_MPS_ACTIVE_THREAD_PERCENTAGE=20\n"
        );
        let e = env_with_share("", 20, Some("0=8G\nLD_PRELOAD=/tmp/x.so")).unwrap_err();
        assert!(
            matches!(&e, GpuError::PinnedLimit { limit } if limit.contains("LD_PRELOAD")),
            "{e}"
        );
    }

    #[test]
    fn a_new_share_is_pending_until_the_restart_and_restarts_are_spaced() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("llm.env"), "OTHER=1\n").unwrap();
        let log = dir.path().join("restarts");
        let cmd = format!(
            "echo $CUDA_MPS_ACTIVE_THREAD_PERCENTAGE >> {}",
            log.display()
        );
        let mut g = GpuActuator::new(&[service(dir.path(), &cmd, 60_000, 10_000)], None);
        assert_eq!(g.effective("llm"), None, "unknown until a restart");
        let mut notes = Vec::new();
        g.publish_noted("llm", 50, Some("0=8G"), &mut |c| {
            notes.push(c);
            Ok(())
        })
        .unwrap();
        assert_eq!(
            notes,
            vec![HostChange::File {
                path: dir.path().join("llm.env"),
                original: Some("OTHER=1\n".into())
            }],
            "the original is noted before the first write"
        );
        let env = std::fs::read_to_string(dir.path().join("llm.env")).unwrap();
        assert_eq!(
            env,
            "OTHER=1\nCUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50\nCUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8G\n"
        );
        assert_eq!((g.published("llm"), g.effective("llm")), (Some(50), None));
        let t0 = Instant::now();
        assert!(
            g.restart_due(t0, &BTreeMap::new()).is_empty(),
            "started, not waited for"
        );
        assert_eq!(g.effective("llm"), None, "pending while the hook runs");
        assert_eq!(settle(&mut g), vec!["llm"]);
        assert_eq!(g.effective("llm"), Some(50));
        g.publish_noted("llm", 70, None, &mut |c| panic!("noted again: {c:?}"))
            .unwrap();
        assert!(
            g.restart_due(t0 + Duration::from_secs(10), &BTreeMap::new())
                .is_empty()
                && !g.hooks_running(),
            "too soon after the last restart"
        );
        assert_eq!(
            (g.published("llm"), g.effective("llm")),
            (Some(70), Some(50))
        );
        g.restart_due(t0 + Duration::from_secs(61), &BTreeMap::new());
        assert_eq!(settle(&mut g), vec!["llm"]);
        assert_eq!(g.effective("llm"), Some(70));
        assert_eq!(
            std::fs::read_to_string(&log).unwrap(),
            "50\n70\n",
            "the hook sees the share"
        );
        assert_eq!(g.restore(), vec![dir.path().join("llm.env")]);
        assert_eq!(
            std::fs::read_to_string(dir.path().join("llm.env")).unwrap(),
            "OTHER=1\n"
        );
    }

    #[test]
    fn a_failing_restart_hook_keeps_the_share_pending_and_a_known_share_needs_none() {
        let dir = tempfile::tempdir().unwrap();
        let mut g = GpuActuator::new(&[service(dir.path(), "exit 3", 0, 10_000)], None);
        g.publish("llm", 40, None).unwrap();
        g.restart_due(Instant::now(), &BTreeMap::new());
        assert!(settle(&mut g).is_empty());
        assert_eq!((g.published("llm"), g.effective("llm")), (Some(40), None));
        // A client started from a file that already holds the share has it.
        let again = GpuActuator::new(&[service(dir.path(), "exit 3", 0, 10_000)], None);
        assert_eq!(again.effective("llm"), Some(40));
        g.restore();
        assert!(
            !dir.path().join("llm.env").exists(),
            "a file cohabit created is removed"
        );
    }

    #[test]
    fn a_hanging_hook_never_holds_a_tick_and_is_killed_with_its_group() {
        let dir = tempfile::tempdir().unwrap();
        let pgids = dir.path().join("pgids");
        let cmd = format!("echo $$ >> {}; sleep 3600", pgids.display());
        let mut g = GpuActuator::new(&[service(dir.path(), &cmd, 100, 500)], None);
        g.publish("llm", 40, None).unwrap();
        // Ticks every 100 ms for 1.5 s: none waits for the hook.
        let start = Instant::now();
        let mut ticks = 0;
        while start.elapsed() < Duration::from_millis(1500) {
            let t = Instant::now();
            g.restart_due(t, &BTreeMap::new());
            assert!(
                t.elapsed() < Duration::from_millis(250),
                "a tick waited for the hook"
            );
            ticks += 1;
            std::thread::sleep(Duration::from_millis(100));
        }
        assert!(ticks >= 8, "{ticks}");
        assert_eq!((g.published("llm"), g.effective("llm")), (Some(40), None));
        let first: u32 = std::fs::read_to_string(&pgids)
            .unwrap()
            .lines()
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(
            live_members(first),
            Vec::<u32>::new(),
            "the first hook's group is gone"
        );
        // Shutdown does not wait for the one running now beyond a bounded time.
        let t = Instant::now();
        g.restore();
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        for pgid in std::fs::read_to_string(&pgids).unwrap().lines() {
            assert_eq!(live_members(pgid.parse().unwrap()), Vec::<u32>::new());
        }
        assert!(!g.hooks_running());
    }

    #[test]
    fn a_symlinked_env_file_is_refused_and_its_target_untouched() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("shadow");
        std::fs::write(&target, "root:x:0:0\n").unwrap();
        std::os::unix::fs::symlink(&target, dir.path().join("llm.env")).unwrap();
        let services = [service(dir.path(), "true", 0, 1000)];
        let e = check_env_files(&services, false).unwrap_err();
        assert!(e.to_string().contains("symbolic link"), "{e}");
        let mut g = GpuActuator::new(&services, None);
        let e = g.publish("llm", 40, None).unwrap_err();
        assert!(
            matches!(&e, GpuError::File { service, .. } if service == "llm"),
            "{e}"
        );
        assert!(e.to_string().contains("symbolic link"), "{e}");
        assert_eq!(g.published("llm"), None);
        g.restore();
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "root:x:0:0\n");
    }

    #[test]
    fn an_env_file_in_a_directory_others_can_write_is_refused_at_start() {
        let dir = tempfile::tempdir().unwrap();
        let shared = dir.path().join("shared");
        std::fs::create_dir(&shared).unwrap();
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).unwrap();
        let services = [service(&shared, "true", 0, 1000)];
        let e = check_env_files(&services, false).unwrap_err().to_string();
        assert!(
            e.contains(&shared.display().to_string()) && e.contains("0777"),
            "{e}"
        );
        let mut g = GpuActuator::new(&services, None);
        assert!(g.publish("llm", 40, None).is_err());
        assert!(!shared.join("llm.env").exists());
        // A missing directory is created private; in a dry run nothing is created.
        let fresh = [service(&dir.path().join("new"), "true", 0, 1000)];
        check_env_files(&fresh, true).unwrap();
        assert!(!dir.path().join("new").exists());
        check_env_files(&fresh, false).unwrap();
        let mode = std::fs::metadata(dir.path().join("new"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o755);
    }

    #[test]
    fn a_failed_note_writes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("llm.env"), "OTHER=1\n").unwrap();
        let mut g = GpuActuator::new(&[service(dir.path(), "true", 0, 1000)], None);
        let e = g
            .publish_noted("llm", 40, None, &mut |_| Err("disk full".into()))
            .unwrap_err();
        assert!(
            matches!(&e, GpuError::Note { path, source } if path.ends_with("llm.env") && source.to_string() == "disk full"),
            "{e}"
        );
        assert_eq!(
            std::fs::read_to_string(dir.path().join("llm.env")).unwrap(),
            "OTHER=1\n"
        );
        assert_eq!(g.published("llm"), None);
    }

    #[test]
    fn restore_file_puts_back_a_noted_original_after_a_crash() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("llm.env");
        std::fs::write(&path, "MODEL=small\nCUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50\n").unwrap();
        restore_file(&path, Some("MODEL=small\n")).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "MODEL=small\n");
        std::fs::write(&path, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50\n").unwrap();
        restore_file(&path, None).unwrap();
        assert!(!path.exists());
        restore_file(&path, None).unwrap();
        restore_file(&path, Some("A=1\n")).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "A=1\n");
    }

    fn fake_mps(dir: &Path) -> MpsControl {
        let bin = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../collectors/tests/fixtures/fake-mps-control");
        MpsControl::new(bin, Some(dir.to_path_buf()))
    }

    fn named(dir: &Path, server: &str) -> ManagedService {
        let mut s = service(dir, "exit 7", 0, 1000);
        if let Some(g) = s.gpu.as_mut() {
            g.mps_server = Some(server.into());
        }
        s
    }

    #[test]
    fn on_a_v3_host_a_share_is_in_force_at_once_without_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let pipe = tempfile::tempdir().unwrap();
        std::fs::write(pipe.path().join("protocol"), "3\n").unwrap();
        std::fs::write(pipe.path().join("named_servers"), "llm\n").unwrap();
        let mps = fake_mps(pipe.path());
        let mut g = GpuActuator::with_probe(&[named(dir.path(), "llm")], Some(mps));
        assert_eq!(g.share_change(), ShareChange::Live);
        g.publish("llm", 45, None).unwrap();
        assert_eq!(
            (g.published("llm"), g.effective("llm")),
            (Some(45), Some(45))
        );
        assert_eq!(
            std::fs::read_to_string(pipe.path().join("live_pct.llm"))
                .unwrap()
                .trim(),
            "45"
        );
        // The environment file follows, so a later restart keeps the share; no hook runs
        // (it would fail: `exit 7`).
        let env = std::fs::read_to_string(dir.path().join("llm.env")).unwrap();
        assert!(
            env.contains("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=45"),
            "{env}"
        );
        g.restart_due(Instant::now(), &BTreeMap::new());
        assert!(!g.hooks_running());
    }

    #[test]
    fn a_refused_live_change_keeps_the_previous_share_and_says_why() {
        let dir = tempfile::tempdir().unwrap();
        let pipe = tempfile::tempdir().unwrap();
        std::fs::write(pipe.path().join("protocol"), "3\n").unwrap();
        std::fs::write(pipe.path().join("named_servers"), "llm\n").unwrap();
        let mps = fake_mps(pipe.path());
        // The configured server is not one the daemon knows.
        let mut g = GpuActuator::with_probe(&[named(dir.path(), "bert")], Some(mps.clone()));
        let e = g.publish("llm", 45, None).unwrap_err();
        assert!(
            matches!(&e, GpuError::Refused { service, pct: 45, source } if service == "llm" && source.to_string().contains("Server bert not found")),
            "{e}"
        );
        assert_eq!((g.published("llm"), g.effective("llm")), (None, None));
        assert!(!dir.path().join("llm.env").exists(), "nothing written");
        // A v2 daemon (protocol file gone) is probed as restart-only: no live command sent.
        std::fs::remove_file(pipe.path().join("protocol")).unwrap();
        let g2 = GpuActuator::with_probe(&[named(dir.path(), "llm")], Some(mps));
        assert_eq!(g2.share_change(), ShareChange::Restart);
        // An unknown answer to the probe (no daemon) is the restart path too.
        std::fs::write(pipe.path().join("down"), "").unwrap();
        let g3 = GpuActuator::with_probe(&[named(dir.path(), "llm")], Some(fake_mps(pipe.path())));
        assert_eq!(g3.share_change(), ShareChange::Restart);
    }

    #[test]
    fn a_client_that_never_reconnects_keeps_its_previous_share() {
        let dir = tempfile::tempdir().unwrap();
        let pipe = tempfile::tempdir().unwrap();
        std::fs::write(pipe.path().join("servers"), "4100\n").unwrap();
        std::fs::write(pipe.path().join("clients.4100"), "5001\n").unwrap();
        let mps = fake_mps(pipe.path());
        let mut g = GpuActuator::new(&[service(dir.path(), "true", 0, 300)], Some(mps));
        g.publish("llm", 40, None).unwrap();
        let pids = BTreeMap::from([("llm".to_string(), vec![5001])]);
        g.restart_due(Instant::now(), &pids);
        settle(&mut g);
        // Back among MPS clients: in force.
        assert_eq!(g.restart_due(Instant::now(), &pids), vec!["llm"]);
        assert_eq!(g.effective("llm"), Some(40));
        // The next restart's client never comes back (pid 6001 is nobody's client).
        g.publish("llm", 60, None).unwrap();
        let gone = BTreeMap::from([("llm".to_string(), vec![6001])]);
        let t0 = Instant::now();
        g.restart_due(t0, &gone);
        settle(&mut g);
        assert!(g.restart_due(Instant::now(), &gone).is_empty());
        assert_eq!(g.effective("llm"), Some(40), "waits for the client");
        std::thread::sleep(Duration::from_millis(350));
        assert!(g.restart_due(Instant::now(), &gone).is_empty());
        assert_eq!(
            (g.published("llm"), g.effective("llm")),
            (Some(60), Some(40)),
            "given up on: the previous share stays the effective one"
        );
        g.restore();
    }

    #[test]
    fn pinned_limits_reserve_what_latency_critical_clients_use_before_best_effort() {
        const GIB: u64 = 1 << 30;
        let uses = [
            MemoryUse {
                service: "llm".into(),
                latency_critical: true,
                peak_bytes: Some(20 * GIB),
            },
            MemoryUse {
                service: "resnet".into(),
                latency_critical: true,
                peak_bytes: Some(GIB),
            },
            MemoryUse {
                service: "train".into(),
                latency_critical: false,
                peak_bytes: Some(30 * GIB),
            },
        ];
        let l = plan_pinned_limits(&uses, 40 * GIB);
        // llm: 20 GiB + 25 % = 25600 MiB; resnet: 1 GiB + 512 MiB (more than 25 %).
        assert_eq!(l["llm"], 25_600);
        assert_eq!(l["resnet"], 1_536);
        // train: 40 GiB less 3 % less both = 39731.2 - 27136 -> 12595 MiB, far below the
        // 30 GiB it has used: it cannot push the others out.
        assert_eq!(l["train"], 12_595);
        assert!(l.values().sum::<u64>() <= 40 * 1024);
        // A latency-critical client not measured yet gets no limit; best effort still
        // gets at least the minimum when latency-critical use fills the GPU.
        let full = [
            MemoryUse {
                service: "llm".into(),
                latency_critical: true,
                peak_bytes: Some(39 * GIB),
            },
            MemoryUse {
                service: "new".into(),
                latency_critical: true,
                peak_bytes: None,
            },
            MemoryUse {
                service: "train".into(),
                latency_critical: false,
                peak_bytes: None,
            },
        ];
        let l = plan_pinned_limits(&full, 40 * GIB);
        assert!(!l.contains_key("new"));
        assert_eq!(l["train"], MEM_BE_MIN_MIB);
        assert_eq!(l["llm"], 40 * 1024, "never above the GPU");
    }

    #[test]
    fn measured_memory_sets_each_clients_pinned_limit_in_its_env_file() {
        const GIB: u64 = 1 << 30;
        let dir = tempfile::tempdir().unwrap();
        let mut g = GpuActuator::new(&[service(dir.path(), "true", 0, 1000)], None);
        let used = BTreeMap::from([("llm".to_string(), 8 * GIB)]);
        let planned = g.guard_memory(&used, &[Some(40 * GIB)], &|_| true);
        assert_eq!(planned["llm"], "0=10240M");
        // A smaller reading later does not shrink the limit (the peak is kept).
        let used = BTreeMap::from([("llm".to_string(), GIB)]);
        g.guard_memory(&used, &[Some(40 * GIB)], &|_| true);
        g.publish("llm", 30, Some("0=8G")).unwrap();
        let env = std::fs::read_to_string(dir.path().join("llm.env")).unwrap();
        assert!(
            env.contains("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10240M"),
            "the planned limit wins over the configured default: {env}"
        );
        g.restore();
    }
}
