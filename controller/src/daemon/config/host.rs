//! `[host]` and `[paths]`: what cohabit manages on this host and where the kernel's
//! interfaces are.

use std::path::PathBuf;

use cohabit_collectors::cgroup::CpuList;
use cohabit_collectors::HostPaths;
use cohabit_host::spec::{BestEffortCpus, UnmanagedCache};
use serde::Deserialize;

use super::error::{ConfigError, Problem};

/// `[host]` as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct HostFile {
    cpus: Option<String>,
    gpus: Option<i64>,
    mem_bw_gbps: Option<f64>,
    name: Option<String>,
    #[serde(default)]
    unmanaged_cache: UnmanagedCache,
    #[serde(default)]
    best_effort_cpus: BestEffortCpus,
}

/// `[paths]` as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct PathsFile {
    proc: Option<PathBuf>,
    sys: Option<PathBuf>,
    cgroup: Option<PathBuf>,
    resctrl: Option<PathBuf>,
    state_dir: Option<PathBuf>,
}

/// `[host]`, validated.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct HostConfig {
    /// CPUs managed (`None`: all online).
    pub cpus: Option<CpuList>,
    /// GPUs to plan for when NVML cannot list them.
    pub gpus: Option<u32>,
    /// Peak memory bandwidth, if known.
    pub mem_bw_gbps: Option<f64>,
    /// Host name for logs, if given.
    pub name: Option<String>,
    /// `unmanaged_cache`.
    pub unmanaged_cache: UnmanagedCache,
    /// `best_effort_cpus`.
    pub best_effort_cpus: BestEffortCpus,
}

/// Most CPUs `host.cpus` may list.
const MAX_CPUS: u64 = 4096;
/// Most GPUs `host.gpus` may declare.
const MAX_GPUS: i64 = 64;

impl TryFrom<HostFile> for HostConfig {
    type Error = ConfigError;

    /// Errors name fields within `[host]`.
    fn try_from(h: HostFile) -> Result<Self, ConfigError> {
        let cpus = h.cpus.as_deref().map(cpus).transpose()?;
        if let Some(bw) = h.mem_bw_gbps.filter(|bw| !(bw.is_finite() && *bw > 0.0)) {
            return Err(ConfigError::invalid(
                "mem_bw_gbps",
                format!("must be a positive number, got {bw}"),
            ));
        }
        let gpus = h
            .gpus
            .map(|g| {
                u32::try_from(g)
                    .ok()
                    .filter(|g| i64::from(*g) <= MAX_GPUS)
                    .ok_or_else(|| {
                        ConfigError::range("gpus", Some(0.0), Some(MAX_GPUS as f64), g as f64)
                    })
            })
            .transpose()?;
        Ok(Self {
            cpus,
            gpus,
            mem_bw_gbps: h.mem_bw_gbps,
            name: h.name,
            unmanaged_cache: h.unmanaged_cache,
            best_effort_cpus: h.best_effort_cpus,
        })
    }
}

/// `cpus`: a CPU list of at least one and at most [`MAX_CPUS`] CPUs.
fn cpus(text: &str) -> Result<CpuList, ConfigError> {
    if cpu_list_len(text).is_some_and(|n| n > MAX_CPUS) {
        return Err(ConfigError::invalid(
            "cpus",
            format!("{text:?} lists more than {MAX_CPUS} CPUs"),
        ));
    }
    let cpus = text
        .parse::<CpuList>()
        .map_err(|e| ConfigError::new("cpus", Problem::WrongType(e.to_string())))?;
    if cpus.0.is_empty() {
        return Err(ConfigError::invalid("cpus", "must list at least one CPU"));
    }
    Ok(cpus)
}

/// `[paths]`, validated: the kernel interfaces' roots and the state directory.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct PathsConfig {
    /// Kernel interface roots.
    pub host: HostPaths,
    /// The state directory.
    pub state_dir: PathBuf,
}

impl TryFrom<PathsFile> for PathsConfig {
    type Error = ConfigError;

    /// Errors name fields within `[paths]`.
    fn try_from(p: PathsFile) -> Result<Self, ConfigError> {
        let state_dir = p
            .state_dir
            .unwrap_or_else(|| super::super::state::DEFAULT_STATE_DIR.into());
        if !state_dir.is_absolute() {
            return Err(ConfigError::invalid(
                "state_dir",
                format!("must be an absolute path, got {}", state_dir.display()),
            ));
        }
        let standard = HostPaths::standard();
        Ok(Self {
            host: HostPaths {
                proc: p.proc.unwrap_or(standard.proc),
                sys: p.sys.unwrap_or(standard.sys),
                cgroup: p.cgroup.unwrap_or(standard.cgroup),
                resctrl: p.resctrl,
            },
            state_dir,
        })
    }
}

/// How many CPUs a CPU list names, counted without expanding it (`0-4294967295` must not
/// allocate 16 GiB before it is refused); `None` if it is not a list of numbers and ranges.
fn cpu_list_len(text: &str) -> Option<u64> {
    let mut n = 0u64;
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        let (a, b) = (a.trim().parse::<u64>().ok()?, b.trim().parse::<u64>().ok()?);
        n = n.saturating_add(b.checked_sub(a)?.saturating_add(1));
    }
    Some(n)
}

#[cfg(test)]
mod tests {
    use super::super::tests::{err, MIN};
    use super::super::*;
    use super::*;

    #[test]
    fn unmanaged_cache_is_shared_unless_the_pool_is_asked_for() {
        let c = DaemonConfig::parse(MIN, "t.toml").unwrap();
        assert_eq!(c.unmanaged_cache, UnmanagedCache::Shared, "default");
        let pool = format!("[host]\nunmanaged_cache = \"pool\"\n{MIN}");
        let c = DaemonConfig::parse(&pool, "t.toml").unwrap();
        assert_eq!(c.unmanaged_cache, UnmanagedCache::Pool);
        let e = err(&format!("[host]\nunmanaged_cache = \"lc\"\n{MIN}"));
        assert!(e.contains("unmanaged_cache") && e.contains("lc"), "{e}");
    }

    #[test]
    fn best_effort_cpus_are_the_spare_ones_unless_all_are_asked_for() {
        let c = DaemonConfig::parse(MIN, "t.toml").unwrap();
        assert_eq!(c.best_effort_cpus, BestEffortCpus::Spare, "default");
        let all = format!("[host]\nbest_effort_cpus = \"all\"\n{MIN}");
        let c = DaemonConfig::parse(&all, "t.toml").unwrap();
        assert_eq!(c.best_effort_cpus, BestEffortCpus::All);
        let e = err(&format!("[host]\nbest_effort_cpus = \"every\"\n{MIN}"));
        assert!(e.contains("best_effort_cpus") && e.contains("every"), "{e}");
    }
}
