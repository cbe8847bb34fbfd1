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
//! GPU memory: each client's pinned device-memory limit is part of the plan (planned by the
//! control loop, `cohabit_policy::gpu_memory`, latency-critical clients first, so a
//! best-effort job cannot push a latency-critical one out of memory). The actuator keeps the
//! plan's limits ([`GpuActuator::set_pinned`]) and writes each into the client's
//! environment file with its next share; it applies from the client's next start.

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

mod envfile;
mod mechanism;
#[cfg(test)]
mod tests;

use self::envfile::*;
pub use self::envfile::{check_env_files, restore_file, MANAGED};
use self::mechanism::*;
pub use self::mechanism::{mechanism_for, RestartHook, ShareMechanism, V3Dynamic};

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
    /// Its pinned device-memory limit in the plan in force (`<gpu>=<MiB>M`).
    pinned: Option<String>,
}

/// Why the host's record of changes could not note a file (its error, boxed: the record
/// belongs to the host, above this module).
pub type NoteFailed = Box<dyn std::error::Error + Send + Sync>;

/// The GPU side of the real host's actuator.
#[derive(Debug)]
pub struct GpuActuator {
    mps: Option<MpsControl>,
    mechanism: Box<dyn ShareMechanism>,
    clients: BTreeMap<String, Client>,
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

    /// Keeps the plan's pinned device-memory limits, MiB by client (see [`Plan`]'s
    /// `gpu_memory_mib`): each goes into the client's environment file with its next share,
    /// as `<gpu>=<MiB>M`, and applies from its next start. A client without one keeps the
    /// configured default (`mps.pinned_mem_limit`), if any.
    ///
    /// [`Plan`]: cohabit_core::Plan
    pub fn set_pinned(&mut self, limits_mib: &BTreeMap<String, u64>) {
        for (name, c) in &mut self.clients {
            c.pinned = limits_mib
                .get(name)
                .map(|mib| format!("{}={mib}M", c.cfg.index));
        }
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
