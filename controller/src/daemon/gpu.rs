//! GPU shares on a real host: publish a service's MPS share and apply it by restarting its
//! client.
//!
//! A running MPS client keeps the share it started with. So a new share is *published*: the
//! service's environment file gets `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=<pct>` (and the
//! pinned-memory limit, if configured), and where the service has an MPS server of its own
//! the server's limit is set too (`set_active_thread_percentage <server> <pct>`). The share
//! becomes *effective* when the service's configured restart command has restarted the
//! client, at most once per `min_restart_interval_ms`. The decision log shows both: the plan
//! holds the published share, the observation the effective one.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use cohabit_collectors::mps::MpsControl;

use super::config::{GpuConfig, ServiceConfig};

#[derive(Debug)]
struct Client {
    cfg: GpuConfig,
    published: Option<u8>,
    effective: Option<u8>,
    pending: bool,
    last_restart: Option<Instant>,
    /// The environment file as it was before cohabit first wrote it (`None`: absent).
    original: Option<Option<String>>,
}

/// The GPU side of the real host's actuator.
#[derive(Debug)]
pub struct GpuActuator {
    mps: Option<MpsControl>,
    clients: BTreeMap<String, Client>,
}

const VAR: &str = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE";

fn share_in(text: &str) -> Option<u8> {
    text.lines().find_map(|l| {
        l.trim()
            .strip_prefix(VAR)?
            .strip_prefix('=')?
            .trim()
            .parse()
            .ok()
    })
}

impl GpuActuator {
    /// One client per configured GPU service; `mps` talks to the control daemon, if any.
    pub fn new(services: &[ServiceConfig], mps: Option<MpsControl>) -> Self {
        let clients = services
            .iter()
            .filter_map(|s| {
                let cfg = s.gpu.clone()?;
                // A client started with the share already in its file has that share.
                let existing = std::fs::read_to_string(&cfg.env_file)
                    .ok()
                    .and_then(|t| share_in(&t));
                Some((
                    s.name.clone(),
                    Client {
                        cfg,
                        published: existing,
                        effective: existing,
                        pending: false,
                        last_restart: None,
                        original: None,
                    },
                ))
            })
            .collect();
        Self { mps, clients }
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

    /// The share published for a service.
    pub fn published(&self, service: &str) -> Option<u8> {
        self.clients.get(service).and_then(|c| c.published)
    }

    /// Publishes `pct` for `service`: its environment file gets the share. A change marks the
    /// client for restart; nothing happens if the share is already published.
    pub fn publish(
        &mut self,
        service: &str,
        pct: u8,
        pinned_limit: Option<&str>,
    ) -> Result<(), String> {
        let Some(c) = self.clients.get_mut(service) else {
            return Ok(());
        };
        if c.published == Some(pct) {
            return Ok(());
        }
        let path = &c.cfg.env_file;
        if c.original.is_none() {
            c.original = Some(std::fs::read_to_string(path).ok());
        }
        let mut text = format!("{VAR}={pct}\n");
        if let Some(limit) = pinned_limit {
            text.push_str(&format!("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={limit}\n"));
        }
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        }
        std::fs::write(path, text).map_err(|e| format!("writing {}: {e}", path.display()))?;
        c.published = Some(pct);
        c.pending = c.effective != Some(pct);
        Ok(())
    }

    /// Takes back a [`Self::publish`]: publishes `previous` again, or, when nothing had been
    /// published, puts the environment file back as it was and drops the pending restart.
    pub fn revert(
        &mut self,
        service: &str,
        previous: Option<u8>,
        pinned_limit: Option<&str>,
    ) -> Result<(), String> {
        if let Some(pct) = previous {
            return self.publish(service, pct, pinned_limit);
        }
        let Some(c) = self.clients.get_mut(service) else {
            return Ok(());
        };
        let path = &c.cfg.env_file;
        match c.original.take() {
            Some(Some(text)) => {
                std::fs::write(path, text)
                    .map_err(|e| format!("writing {}: {e}", path.display()))?;
            }
            Some(None) => match std::fs::remove_file(path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(format!("removing {}: {e}", path.display())),
            },
            None => {}
        }
        c.published = None;
        c.pending = false;
        Ok(())
    }

    /// Restarts clients whose published share is not yet effective, if their minimum
    /// interval since the last restart has passed. Before a restart, an MPS server that
    /// serves only that service (its clients all among `pids[service]`) gets the share as its
    /// limit too. Returns the services restarted.
    pub fn restart_due(&mut self, now: Instant, pids: &BTreeMap<String, Vec<u32>>) -> Vec<String> {
        let mut done = Vec::new();
        for (name, c) in &mut self.clients {
            if !c.pending {
                continue;
            }
            let wait = Duration::from_millis(c.cfg.min_restart_interval_ms);
            if c.last_restart.is_some_and(|t| now.duration_since(t) < wait) {
                continue;
            }
            c.last_restart = Some(now);
            let mine = pids.get(name).map(Vec::as_slice).unwrap_or_default();
            if let (Some(mps), Some(pct)) = (&self.mps, c.published) {
                match mps.server_of(mine) {
                    Ok(Some((server, clients))) if clients.iter().all(|p| mine.contains(p)) => {
                        if let Err(e) = mps.set_active_thread_percentage(server, pct) {
                            tracing::warn!(service = %name, error = %e, "MPS server limit not set");
                        }
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!(service = %name, error = %e, "MPS server list unavailable; the environment file carries the share")
                    }
                }
            }
            match Command::new("sh").arg("-c").arg(&c.cfg.restart).status() {
                Ok(s) if s.success() => {
                    c.effective = c.published;
                    c.pending = false;
                    tracing::info!(service = %name, share = ?c.effective, "client restarted with its new MPS share");
                    done.push(name.clone());
                }
                Ok(s) => {
                    tracing::warn!(service = %name, status = %s, command = %c.cfg.restart, "restart hook failed; the new share stays pending")
                }
                Err(e) => {
                    tracing::warn!(service = %name, error = %e, "restart hook could not run; the new share stays pending")
                }
            }
        }
        done
    }

    /// Puts every environment file back as it was (running clients keep their share until
    /// they next restart).
    pub fn restore(&mut self) {
        for c in self.clients.values_mut() {
            let path = &c.cfg.env_file;
            let done = match c.original.take() {
                Some(Some(text)) => std::fs::write(path, text),
                Some(None) => std::fs::remove_file(path),
                None => Ok(()),
            };
            if let Err(e) = done {
                tracing::warn!(file = %path.display(), error = %e, "could not restore a GPU client's environment file");
            }
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::daemon::config::Matcher;

    fn service(dir: &Path, restart: &str, interval_ms: u64) -> ServiceConfig {
        ServiceConfig {
            name: "llm".into(),
            p99_target_ms: Some(100.0),
            matcher: Matcher::ProcessName("llm".into()),
            latency: None,
            gpu: Some(GpuConfig {
                index: 0,
                env_file: dir.join("llm.env"),
                restart: restart.into(),
                min_restart_interval_ms: interval_ms,
            }),
        }
    }

    #[test]
    fn a_new_share_is_pending_until_the_restart_and_restarts_are_spaced() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("llm.env"), "OTHER=1\n").unwrap();
        let log = dir.path().join("restarts");
        let cmd = format!("echo x >> {}", log.display());
        let mut g = GpuActuator::new(&[service(dir.path(), &cmd, 60_000)], None);
        assert_eq!(g.effective("llm"), None, "unknown until a restart");
        g.publish("llm", 50, Some("0=8G")).unwrap();
        let env = std::fs::read_to_string(dir.path().join("llm.env")).unwrap();
        assert_eq!(
            env,
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50\nCUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8G\n"
        );
        assert_eq!((g.published("llm"), g.effective("llm")), (Some(50), None));
        let t0 = Instant::now();
        assert_eq!(g.restart_due(t0, &BTreeMap::new()), vec!["llm"]);
        assert_eq!(g.effective("llm"), Some(50));
        g.publish("llm", 70, None).unwrap();
        assert!(
            g.restart_due(t0 + Duration::from_secs(10), &BTreeMap::new())
                .is_empty(),
            "too soon after the last restart"
        );
        assert_eq!(
            (g.published("llm"), g.effective("llm")),
            (Some(70), Some(50))
        );
        assert_eq!(
            g.restart_due(t0 + Duration::from_secs(61), &BTreeMap::new()),
            vec!["llm"]
        );
        assert_eq!(g.effective("llm"), Some(70));
        assert_eq!(std::fs::read_to_string(&log).unwrap().lines().count(), 2);
        g.restore();
        assert_eq!(
            std::fs::read_to_string(dir.path().join("llm.env")).unwrap(),
            "OTHER=1\n"
        );
    }

    #[test]
    fn a_failing_restart_hook_keeps_the_share_pending_and_a_known_share_needs_none() {
        let dir = tempfile::tempdir().unwrap();
        let mut g = GpuActuator::new(&[service(dir.path(), "exit 3", 0)], None);
        g.publish("llm", 40, None).unwrap();
        assert!(g.restart_due(Instant::now(), &BTreeMap::new()).is_empty());
        assert_eq!((g.published("llm"), g.effective("llm")), (Some(40), None));
        // A client started from a file that already holds the share has it.
        let again = GpuActuator::new(&[service(dir.path(), "exit 3", 0)], None);
        assert_eq!(again.effective("llm"), Some(40));
        g.restore();
        assert!(
            !dir.path().join("llm.env").exists(),
            "a file cohabit created is removed"
        );
    }
}
