//! How a published share reaches a running client: the restart hook (MPS v2) or the
//! client's own server (MPS v3 dynamic adjustment).

use super::*;

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

/// Sets the limit of the MPS server that serves only `mine` (the service's pids) to `pct`.
pub(super) fn set_server_limit(mps: &MpsControl, service: &str, mine: &[u32], pct: u8) {
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
