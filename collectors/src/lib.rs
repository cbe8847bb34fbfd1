//! cohabit's interfaces to a real Linux host.
//!
//! One module owns each kernel interface, read side and write side (docs/DESIGN.md 2):
//! - [`resctrl`]: Intel RDT allocation (CAT, MBA) and monitoring (CMT, MBM);
//! - [`cgroup`]: cgroup v1 and v2: a process's cgroup, CPU sets, limits and weights written in
//!   place, cohabit's own groups and moves (a fake v2 tree behind `testutils`);
//! - [`perf`]: hardware counters per cgroup;
//! - [`procfs`]: processes and their statistics, the clock tick rate;
//! - [`sysfs`]: online CPUs, their top frequency, the LLC size;
//! - [`kubepods`]: Kubernetes pods' and containers' cgroups (kubelet drivers, runtimes) and
//!   the kubelet's CPU manager checkpoint;
//! - [`mountinfo`]: the one mountinfo parser (cgroup and resctrl mounts);
//! - [`latency`]: per-service latency from a Prometheus histogram or a push socket;
//! - [`probe`]: per-service latency measured by cohabit itself (memcached, redis, HTTP);
//! - [`window`]: the p99 of the last few intervals' requests, their histograms merged;
//! - [`mps`]: NVIDIA MPS through `nvidia-cuda-mps-control`;
//! - [`nvml`]: GPU telemetry through NVML, loaded at run time;
//! - [`users`]: user and group names to uids and gids.
//!
//! Every root (`/proc`, `/sys`, the cgroup and resctrl mounts) comes in through
//! [`HostPaths`], so tests run against fixture trees and real hosts alike.

use std::path::{Path, PathBuf};

pub mod cgroup;
mod histogram;
pub mod kfs;
pub mod kubepods;
pub mod latency;
pub mod mountinfo;
pub mod mps;
pub mod nvml;
pub mod perf;
pub mod probe;
pub mod procfs;
pub mod resctrl;
pub mod sysfs;
pub mod users;
pub mod window;

/// Where the host's kernel interfaces live.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct HostPaths {
    /// procfs mount, normally `/proc`.
    pub proc: PathBuf,
    /// sysfs mount, normally `/sys`.
    pub sys: PathBuf,
    /// Root of the cgroup mounts, normally `/sys/fs/cgroup`.
    pub cgroup: PathBuf,
    /// resctrl mount, if known; otherwise found in `<proc>/self/mountinfo`.
    pub resctrl: Option<PathBuf>,
}

impl HostPaths {
    /// The standard Linux locations.
    pub fn standard() -> Self {
        Self {
            proc: "/proc".into(),
            sys: "/sys".into(),
            cgroup: "/sys/fs/cgroup".into(),
            resctrl: None,
        }
    }

    /// All roots below one directory (fixture trees).
    pub fn under(root: &Path) -> Self {
        Self {
            proc: root.join("proc"),
            sys: root.join("sys"),
            cgroup: root.join("sys/fs/cgroup"),
            resctrl: Some(root.join("sys/fs/resctrl")),
        }
    }
}

/// An I/O failure with the path and what was being done (docs/STYLE.md 8).
#[derive(Debug, thiserror::Error)]
#[error("{what} {path}: {source}")]
pub struct IoError {
    /// What was being done.
    pub what: &'static str,
    /// The file.
    pub path: PathBuf,
    /// The OS error.
    pub source: std::io::Error,
}

impl IoError {
    /// Wraps an I/O error.
    pub fn new(what: &'static str, path: &Path, source: std::io::Error) -> Self {
        Self {
            what,
            path: path.to_path_buf(),
            source,
        }
    }

    /// True when the object is simply not there (absent), as opposed to broken.
    pub fn is_absent(&self) -> bool {
        matches!(self.source.kind(), std::io::ErrorKind::NotFound)
            || self.source.raw_os_error() == Some(libc::ESRCH)
    }
}
