//! A service's `gpu = { … }` (how its MPS share is published and applied) and `[mps]` (the
//! MPS control daemon).

use std::path::PathBuf;

use cohabit_host::spec::{GpuClient, MpsSpec};
use serde::Deserialize;

use super::error::ConfigError;

/// A service's `gpu = { … }` as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct GpuFile {
    #[serde(default)]
    index: i64,
    env_file: PathBuf,
    restart: String,
    #[serde(default = "default_restart_interval")]
    min_restart_interval_ms: i64,
    #[serde(default = "default_hook_timeout")]
    hook_timeout_ms: i64,
    #[serde(default)]
    mps_server: Option<String>,
}

fn default_hook_timeout() -> i64 {
    60_000
}

fn default_restart_interval() -> i64 {
    30_000
}

/// `[mps]` as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct MpsFile {
    control: Option<PathBuf>,
    pipe_dir: Option<PathBuf>,
    pinned_mem_limit: Option<String>,
}

/// `nvidia-cuda-mps-control` when `[mps] control` is not given (and where `cohabit probe`
/// looks for it).
pub const DEFAULT_MPS_CONTROL: &str = "/usr/bin/nvidia-cuda-mps-control";

impl TryFrom<MpsFile> for MpsSpec {
    type Error = ConfigError;

    /// Errors name fields within `[mps]`.
    fn try_from(m: MpsFile) -> Result<Self, ConfigError> {
        if let Some(p) = m
            .pinned_mem_limit
            .as_deref()
            .filter(|p| !pinned_limit_ok(p))
        {
            return Err(ConfigError::invalid(
                "pinned_mem_limit",
                format!("{p:?} must look like 0=8G (a device, =, a number and K, M or G)"),
            ));
        }
        Ok(Self {
            control: m.control.unwrap_or_else(|| DEFAULT_MPS_CONTROL.into()),
            pipe_dir: m.pipe_dir,
            pinned_mem_limit: m.pinned_mem_limit,
        })
    }
}

/// Whether a pinned device memory limit is `DEVICE=AMOUNT[KMG]`, such as `0=8G`: it is
/// written into environment files, so nothing else may pass.
fn pinned_limit_ok(v: &str) -> bool {
    let Some((dev, amount)) = v.split_once('=') else {
        return false;
    };
    let Some(num) = amount.strip_suffix(['K', 'M', 'G']) else {
        return false;
    };
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    digits(dev) && digits(num)
}

impl TryFrom<&GpuFile> for GpuClient {
    type Error = ConfigError;

    /// Errors name fields within the service's `gpu`.
    fn try_from(g: &GpuFile) -> Result<Self, ConfigError> {
        let index = u32::try_from(g.index)
            .map_err(|_| ConfigError::range("index", Some(0.0), None, g.index as f64))?;
        if g.restart.trim().is_empty() {
            return Err(ConfigError::invalid(
                "restart",
                "must be a command that restarts the service's MPS client",
            ));
        }
        if g.min_restart_interval_ms < 0 {
            return Err(ConfigError::range(
                "min_restart_interval_ms",
                Some(0.0),
                None,
                g.min_restart_interval_ms as f64,
            ));
        }
        if !(1..=3_600_000).contains(&g.hook_timeout_ms) {
            return Err(ConfigError::range(
                "hook_timeout_ms",
                Some(1.0),
                Some(3_600_000.0),
                g.hook_timeout_ms as f64,
            ));
        }
        if let Some(name) = g.mps_server.as_deref().filter(|n| {
            n.is_empty()
                || !n
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        }) {
            return Err(ConfigError::invalid(
                "mps_server",
                format!("{name:?} must be a name of letters, digits, -, _ and ."),
            ));
        }
        Ok(GpuClient {
            index,
            env_file: g.env_file.clone(),
            restart: g.restart.clone(),
            min_restart_interval_ms: g.min_restart_interval_ms.unsigned_abs(),
            hook_timeout_ms: g.hook_timeout_ms.unsigned_abs(),
            mps_server: g.mps_server.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{err, MIN};
    use super::super::*;
    use super::*;

    #[test]
    fn log_rotation_and_the_hook_time_out_have_defaults_and_bounds() {
        let d = DaemonConfig::parse(MIN, "t.toml").unwrap();
        assert_eq!((d.log_max_bytes, d.log_keep), (100_000_000, 5));
        let c = DaemonConfig::parse(
            &format!(
                "log_max_bytes = 1000000
    log_keep = 0
    {MIN}"
            ),
            "t.toml",
        )
        .unwrap();
        assert_eq!((c.log_max_bytes, c.log_keep), (1_000_000, 0));
        assert!(err(&format!(
            "log_max_bytes = 100
    {MIN}"
        ))
        .contains("log_max_bytes"));
        assert!(err(&format!(
            "log_keep = -1
    {MIN}"
        ))
        .contains("log_keep"));
        let gpu = "gpu = { env_file = \"/run/x.env\", restart = \"true\" }\n";
        let g = DaemonConfig::parse(&format!("{MIN}{gpu}"), "t.toml").unwrap();
        assert_eq!(g.services[0].gpu.as_ref().unwrap().hook_timeout_ms, 60_000);
        let gpu = "gpu = { env_file = \"/run/x.env\", restart = \"true\", hook_timeout_ms = 0 }\n";
        assert!(err(&format!("{MIN}{gpu}")).contains("gpu.hook_timeout_ms"));
    }

    #[test]
    fn a_pinned_limit_is_a_device_an_equals_sign_and_an_amount() {
        for limit in ["0=8G", "1=512M", "12=1024K"] {
            assert!(pinned_limit_ok(limit), "{limit}");
        }
        for limit in ["0=8", "=8G", "0=G", "a=8G", "0=8T", "0=8G ", "0=8g"] {
            assert!(!pinned_limit_ok(limit), "{limit}");
        }
    }
}
