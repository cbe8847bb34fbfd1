//! cgroups, v1 and v2: cores (cpuset), CPU quota, task placement and statistics. This
//! module owns the interface, read and write side.
//!
//! Kernel doc: `Documentation/admin-guide/cgroup-v1/cpusets.rst`, `…/cgroup-v2.rst`.
//! Facts this module relies on:
//! - mounts come from `/proc/self/mountinfo`: v1 hierarchies have type `cgroup` with their
//!   controllers among the super options, the unified one has type `cgroup2`;
//! - v1 cpuset groups need `cpuset.cpus` and `cpuset.mems` set before a task may join;
//! - a process joins by writing its pid to `cgroup.procs` (all its threads move);
//! - quota: v1 `cpu.cfs_quota_us` over `cpu.cfs_period_us` (-1 = none), v2 `cpu.max`
//!   (`max 100000` = none); usage: v1 `cpuacct.usage` (ns), v2 `cpu.stat` `usage_usec`;
//!   memory: v1 `memory.usage_in_bytes`, v2 `memory.current`;
//! - a group can be removed (rmdir) only when no process is left in it.
//!
//! cohabit's groups live under one parent, [`PARENT`], in every hierarchy it uses, so it
//! can find and clean what a crashed run left.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::Serialize;

use crate::{HostPaths, IoError};

/// The directory under each hierarchy that holds cohabit's groups.
pub const PARENT: &str = "cohabit";

/// Default CFS period.
const PERIOD_US: u64 = 100_000;

/// Why a cgroup operation failed.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// A file could not be read or written.
    #[error(transparent)]
    Io(#[from] IoError),
    /// A group name that could escape the hierarchy.
    #[error(
        "invalid cgroup name {0:?}: use 1-64 characters of [A-Za-z0-9._-] not starting with '.'"
    )]
    BadName(String),
    /// A CPU list that does not parse.
    #[error("invalid CPU list {0:?}: expected e.g. 0-3,8")]
    BadCpuList(String),
    /// A CPU bandwidth limit that does not parse.
    #[error("unexpected CPU limit {text:?} in {path}")]
    BadCpuMax {
        /// The file.
        path: PathBuf,
        /// What it held.
        text: String,
    },
}

/// A set of logical CPUs in cpuset syntax (`0-3,8`).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct CpuList(pub Vec<u32>);

impl FromStr for CpuList {
    type Err = CgroupError;

    fn from_str(s: &str) -> Result<Self, CgroupError> {
        let mut out = Vec::new();
        for part in s.trim().split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let bad = || CgroupError::BadCpuList(s.to_string());
            match part.split_once('-') {
                Some((a, b)) => {
                    let (a, b): (u32, u32) =
                        (a.parse().map_err(|_| bad())?, b.parse().map_err(|_| bad())?);
                    if a > b {
                        return Err(bad());
                    }
                    out.extend(a..=b);
                }
                None => out.push(part.parse().map_err(|_| bad())?),
            }
        }
        out.sort_unstable();
        out.dedup();
        Ok(CpuList(out))
    }
}

impl fmt::Display for CpuList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        let mut i = 0;
        while i < self.0.len() {
            let start = self.0[i];
            let mut end = start;
            while i + 1 < self.0.len() && self.0[i + 1] == end + 1 {
                i += 1;
                end = self.0[i];
            }
            parts.push(if start == end {
                start.to_string()
            } else {
                format!("{start}-{end}")
            });
            i += 1;
        }
        f.write_str(&parts.join(","))
    }
}

/// A CPU bandwidth limit: `quota_us` of CPU time per `period_us` (`None`: unlimited).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct CpuMax {
    /// CPU time per period, in microseconds; `None` for no limit.
    pub quota_us: Option<u64>,
    /// The period, in microseconds.
    pub period_us: u64,
}

impl CpuMax {
    /// The limit that gives `cores` worth of CPU time over cohabit's period (at least 1 ms
    /// per period, the kernel's floor); `None`: no limit.
    pub fn for_cores(cores: Option<f64>) -> Self {
        Self {
            quota_us: cores.map(|c| cohabit_core::whole((c * PERIOD_US as f64).max(1000.0))),
            period_us: PERIOD_US,
        }
    }

    /// Parses `QUOTA PERIOD` as v2's `cpu.max` holds it (`max` or v1's `-1` for no limit).
    pub fn parse(text: &str) -> Option<Self> {
        let mut it = text.split_whitespace();
        let quota = it.next()?;
        let period_us = it.next()?.parse().ok()?;
        let quota_us = match quota {
            "max" | "-1" => None,
            q => Some(q.parse().ok()?),
        };
        Some(Self {
            quota_us,
            period_us,
        })
    }
}

/// Which cgroup interface the host offers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Version {
    /// Separate hierarchies per controller.
    V1,
    /// The unified hierarchy.
    V2,
}

/// The cgroup hierarchies cohabit uses on one host.
#[derive(Debug, Clone, Serialize)]
pub struct Cgroups {
    /// v1 or v2.
    pub version: Version,
    /// v1: controller → mount point (`cpuset`, `cpu`, `cpuacct`, `memory`); v2: `unified`.
    pub mounts: BTreeMap<String, PathBuf>,
    /// v2: controllers the root offers (`cgroup.controllers`).
    pub v2_controllers: Vec<String>,
}

const V1_CONTROLLERS: [&str; 5] = ["cpuset", "cpu", "cpuacct", "memory", "perf_event"];

/// Finds cgroup mounts in mountinfo text (parsed by [`crate::mountinfo`]): v1 controller →
/// mount (the first mount of a controller wins), and the cgroup2 mount.
pub fn find_mounts(mountinfo: &str) -> (BTreeMap<String, PathBuf>, Option<PathBuf>) {
    let mut v1 = BTreeMap::new();
    let mut v2 = None;
    for m in crate::mountinfo::parse(mountinfo) {
        match m.fs_type.as_str() {
            "cgroup2" => v2 = Some(m.mount_point),
            "cgroup" => {
                for c in &m.super_options {
                    if V1_CONTROLLERS.contains(&c.as_str()) {
                        v1.entry(c.clone()).or_insert_with(|| m.mount_point.clone());
                    }
                }
            }
            _ => {}
        }
    }
    (v1, v2)
}

fn validate(name: &str) -> Result<(), CgroupError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if ok {
        Ok(())
    } else {
        Err(CgroupError::BadName(name.to_string()))
    }
}

fn read(path: &Path) -> Result<String, IoError> {
    std::fs::read_to_string(path).map_err(|e| IoError::new("reading", path, e))
}

fn write(path: &Path, value: &str) -> Result<(), IoError> {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(path)
        .map_err(|e| IoError::new("opening for writing", path, e))?;
    f.write_all(value.as_bytes())
        .map_err(|e| IoError::new("writing", path, e))
}

impl Cgroups {
    /// Finds the hierarchies from `<proc>/self/mountinfo` that lie under `paths.cgroup`.
    /// Prefers v1 when it has a cpuset
    /// hierarchy (the unified one then usually has no controllers); `None` when neither is
    /// usable.
    pub fn detect(paths: &HostPaths) -> Result<Option<Self>, IoError> {
        let mountinfo = read(&paths.proc.join("self/mountinfo"))?;
        let (mut v1, mut v2) = find_mounts(&mountinfo);
        // Only hierarchies under the configured cgroup root are ours to use.
        v1.retain(|_, m| m.starts_with(&paths.cgroup));
        v2 = v2.filter(|m| m.starts_with(&paths.cgroup));
        if v1.contains_key("cpuset") || v1.contains_key("cpu") {
            return Ok(Some(Self {
                version: Version::V1,
                mounts: v1,
                v2_controllers: vec![],
            }));
        }
        if let Some(root) = v2 {
            let controllers = std::fs::read_to_string(root.join("cgroup.controllers"))
                .unwrap_or_default()
                .split_whitespace()
                .map(str::to_string)
                .collect();
            let mounts = [("unified".to_string(), root)].into();
            return Ok(Some(Self {
                version: Version::V2,
                mounts,
                v2_controllers: controllers,
            }));
        }
        Ok(None)
    }

    /// Whether cores (cpuset) can be controlled.
    pub fn has_cpuset(&self) -> bool {
        match self.version {
            Version::V1 => self.mounts.contains_key("cpuset"),
            Version::V2 => self.v2_controllers.iter().any(|c| c == "cpuset"),
        }
    }

    /// Whether CPU quota can be controlled.
    pub fn has_quota(&self) -> bool {
        match self.version {
            Version::V1 => self.mounts.contains_key("cpu"),
            Version::V2 => self.v2_controllers.iter().any(|c| c == "cpu"),
        }
    }

    /// Controllers whose hierarchy this process can create groups in (tried with a
    /// short-lived probe directory).
    pub fn writable_controllers(&self) -> Vec<String> {
        let probe = format!("{PARENT}-probe-{}", std::process::id());
        let mut out = Vec::new();
        for (ctrl, mount) in &self.mounts {
            let dir = mount.join(&probe);
            if std::fs::create_dir(&dir).is_ok() {
                if let Err(e) = std::fs::remove_dir(&dir) {
                    tracing::warn!(dir = %dir.display(), error = %e, "could not remove the writability probe");
                }
                match self.version {
                    Version::V1 => out.push(ctrl.clone()),
                    Version::V2 => out.extend(self.v2_controllers.iter().cloned()),
                }
            }
        }
        out
    }

    /// The directory of a group in each hierarchy used (`None`: the parent itself).
    fn dirs(&self, group: Option<&str>) -> Vec<(&str, PathBuf)> {
        self.mounts
            .iter()
            .map(|(c, m)| {
                let parent = m.join(PARENT);
                (
                    c.as_str(),
                    group.map_or_else(|| parent.clone(), |g| parent.join(g)),
                )
            })
            .collect()
    }

    /// The directory of cohabit's group `group` in the hierarchy that holds `controller`
    /// (`cpuset`, `cpu`, `perf_event`, …; v2: the unified one), if that hierarchy is used.
    /// The one place that knows where a group lives: perf counters open this too.
    pub fn dir(&self, controller: &str, group: &str) -> Option<PathBuf> {
        let key = if self.version == Version::V2 {
            "unified"
        } else {
            controller
        };
        self.mounts.get(key).map(|m| m.join(PARENT).join(group))
    }

    /// Creates group `group` under [`PARENT`] in every hierarchy (and the parent itself),
    /// with v1 cpusets initialised from their parent so tasks can join.
    pub fn create(&self, group: &str) -> Result<(), CgroupError> {
        validate(group)?;
        for (ctrl, dir) in self.dirs(None).into_iter().chain(self.dirs(Some(group))) {
            if !dir.exists() {
                std::fs::create_dir(&dir).map_err(|e| IoError::new("creating cgroup", &dir, e))?;
            }
            if self.version == Version::V1 && ctrl == "cpuset" {
                let parent = dir.parent().unwrap_or(&dir);
                for file in ["cpuset.mems", "cpuset.cpus"] {
                    let mine = read(&dir.join(file))?;
                    if mine.trim().is_empty() {
                        write(&dir.join(file), read(&parent.join(file))?.trim())?;
                    }
                }
            }
            if self.version == Version::V2 && dir.parent().is_some_and(|p| p.ends_with(PARENT)) {
                // Children of the parent need the controllers delegated down to them.
                let root = dir.parent().and_then(Path::parent).unwrap_or(&dir);
                for (at, ctl) in [
                    (root, "+cpuset +cpu"),
                    (dir.parent().unwrap_or(&dir), "+cpuset +cpu"),
                ] {
                    let path = at.join("cgroup.subtree_control");
                    if path.exists() {
                        // Refused when the controller is not offered above; the CPU
                        // writes that follow then fail with the path that matters.
                        if let Err(e) = write(&path, ctl) {
                            tracing::debug!(error = %e, "controllers not delegated");
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Sets the CPUs a group may run on.
    pub fn set_cpus(&self, group: &str, cpus: &CpuList) -> Result<(), CgroupError> {
        validate(group)?;
        if let Some(dir) = self.dir("cpuset", group) {
            write(&dir.join("cpuset.cpus"), &cpus.to_string())?;
        }
        Ok(())
    }

    /// The CPUs a group may run on (`None`: no cpuset hierarchy). On v2 an empty list means
    /// "the parent's".
    pub fn cpus(&self, group: &str) -> Result<Option<CpuList>, CgroupError> {
        validate(group)?;
        let Some(dir) = self.dir("cpuset", group) else {
            return Ok(None);
        };
        let path = dir.join("cpuset.cpus");
        let text = read(&path)?;
        text.parse().map(Some)
    }

    /// Limits a group to `cores` worth of CPU time per period (`None`: no limit).
    pub fn set_quota(&self, group: &str, cores: Option<f64>) -> Result<(), CgroupError> {
        self.set_cpu_max(group, CpuMax::for_cores(cores))
    }

    /// Writes a group's CPU bandwidth limit (v1: period, then quota; v2: `cpu.max`).
    pub fn set_cpu_max(&self, group: &str, max: CpuMax) -> Result<(), CgroupError> {
        validate(group)?;
        let Some(dir) = self.dir("cpu", group) else {
            return Ok(());
        };
        let period = max.period_us;
        match self.version {
            Version::V1 => {
                write(&dir.join("cpu.cfs_period_us"), &period.to_string())?;
                write(
                    &dir.join("cpu.cfs_quota_us"),
                    &max.quota_us.map_or_else(|| "-1".into(), |q| q.to_string()),
                )?;
            }
            Version::V2 => {
                let v = max
                    .quota_us
                    .map_or_else(|| format!("max {period}"), |q| format!("{q} {period}"));
                write(&dir.join("cpu.max"), &v)?;
            }
        }
        Ok(())
    }

    /// A group's CPU bandwidth limit as the kernel holds it (`None`: no cpu hierarchy).
    pub fn cpu_max(&self, group: &str) -> Result<Option<CpuMax>, CgroupError> {
        validate(group)?;
        let Some(dir) = self.dir("cpu", group) else {
            return Ok(None);
        };
        let (text, path) = match self.version {
            Version::V1 => {
                let q = dir.join("cpu.cfs_quota_us");
                let p = dir.join("cpu.cfs_period_us");
                (format!("{} {}", read(&q)?.trim(), read(&p)?.trim()), q)
            }
            Version::V2 => {
                let p = dir.join("cpu.max");
                (read(&p)?, p)
            }
        };
        CpuMax::parse(&text)
            .map(Some)
            .ok_or_else(|| CgroupError::BadCpuMax {
                path,
                text: text.trim().to_string(),
            })
    }

    /// Moves a process (all its threads) into a group in every hierarchy. `Ok(false)` if
    /// the process is gone.
    pub fn add_process(&self, group: &str, pid: u32) -> Result<bool, CgroupError> {
        validate(group)?;
        for (_, dir) in self.dirs(Some(group)) {
            let path = dir.join("cgroup.procs");
            if let Err(e) = write(&path, &pid.to_string()) {
                if e.is_absent() {
                    return Ok(false);
                }
                return Err(e.into());
            }
        }
        Ok(true)
    }

    /// Puts a process back where `/proc/PID/cgroup` said it was (lines from
    /// [`crate::procfs::Procfs::cgroups`]). Hierarchies without a matching line are left.
    pub fn restore_process(
        &self,
        pid: u32,
        original: &[(u32, String, String)],
    ) -> Result<bool, CgroupError> {
        for (ctrl, mount) in &self.mounts {
            let path = original.iter().find_map(|(_, ctrls, path)| {
                let matches = match self.version {
                    Version::V1 => ctrls.split(',').any(|c| c == ctrl),
                    Version::V2 => ctrls.is_empty(),
                };
                matches.then_some(path)
            });
            let Some(path) = path else { continue };
            let target = mount
                .join(path.trim_start_matches('/'))
                .join("cgroup.procs");
            if let Err(e) = write(&target, &pid.to_string()) {
                if e.is_absent() {
                    return Ok(false);
                }
                return Err(e.into());
            }
        }
        Ok(true)
    }

    /// Processes in a group (from its cpuset or cpu hierarchy).
    pub fn processes(&self, group: &str) -> Result<Vec<u32>, CgroupError> {
        validate(group)?;
        let dir = self.dir("cpuset", group).or_else(|| self.dir("cpu", group));
        let Some(dir) = dir else { return Ok(vec![]) };
        let text = read(&dir.join("cgroup.procs"))?;
        Ok(text.lines().filter_map(|l| l.trim().parse().ok()).collect())
    }

    /// Processes in an arbitrary cgroup path (e.g. `/system.slice/nginx.service`), looked
    /// up in every hierarchy; empty if the path exists nowhere.
    pub fn processes_at(&self, cgroup_path: &str) -> Vec<u32> {
        let rel = cgroup_path.trim_start_matches('/');
        let mut out: Vec<u32> = self
            .mounts
            .values()
            .filter_map(|m| std::fs::read_to_string(m.join(rel).join("cgroup.procs")).ok())
            .flat_map(|t| {
                t.lines()
                    .filter_map(|l| l.trim().parse().ok())
                    .collect::<Vec<u32>>()
            })
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    /// Removes a group from every hierarchy (it must be empty); missing is fine.
    pub fn remove(&self, group: &str) -> Result<(), CgroupError> {
        validate(group)?;
        for (_, dir) in self.dirs(Some(group)) {
            match std::fs::remove_dir(&dir) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(IoError::new("removing cgroup", &dir, e).into()),
            }
        }
        Ok(())
    }

    /// Removes the parent directories if empty.
    pub fn remove_parent(&self) {
        for (_, dir) in self.dirs(None) {
            match std::fs::remove_dir(&dir) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!(dir = %dir.display(), error = %e, "could not remove cohabit's cgroup parent");
                }
            }
        }
    }

    /// Groups under the parent (what a previous run may have left).
    pub fn leftovers(&self) -> Vec<String> {
        let mut out: Vec<String> = self
            .dirs(None)
            .into_iter()
            .filter_map(|(_, d)| std::fs::read_dir(d).ok())
            .flat_map(|it| {
                it.filter_map(Result::ok)
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect::<Vec<_>>()
            })
            .collect();
        out.sort();
        out.dedup();
        out
    }

    /// Moves every process of a group to the root of each hierarchy (used when cleaning
    /// what a crashed run left, whose original placement is unknown).
    pub fn evacuate(&self, group: &str) -> Result<usize, CgroupError> {
        validate(group)?;
        let mut moved = 0;
        for (ctrl, dir) in self.dirs(Some(group)) {
            let Ok(text) = std::fs::read_to_string(dir.join("cgroup.procs")) else {
                continue;
            };
            let root = match self.version {
                Version::V1 => self.mounts.get(ctrl).cloned(),
                Version::V2 => self.mounts.get("unified").cloned(),
            };
            let Some(root) = root else { continue };
            for pid in text.lines().filter_map(|l| l.trim().parse::<u32>().ok()) {
                if write(&root.join("cgroup.procs"), &pid.to_string()).is_ok() {
                    moved += 1;
                }
            }
        }
        Ok(moved)
    }

    /// Cumulative CPU time of a group in nanoseconds.
    pub fn cpu_usage_ns(&self, group: &str) -> Option<u64> {
        match self.version {
            Version::V1 => {
                let dir = self.dir("cpuacct", group)?;
                read(&dir.join("cpuacct.usage")).ok()?.trim().parse().ok()
            }
            Version::V2 => {
                let dir = self.dir("cpu", group)?;
                let text = read(&dir.join("cpu.stat")).ok()?;
                let usec: u64 = text
                    .lines()
                    .find_map(|l| l.strip_prefix("usage_usec ")?.trim().parse().ok())?;
                Some(usec * 1000)
            }
        }
    }

    /// Memory charged to a group.
    pub fn memory_bytes(&self, group: &str) -> Option<u64> {
        let (dir, file) = match self.version {
            Version::V1 => (self.dir("memory", group)?, "memory.usage_in_bytes"),
            Version::V2 => (self.dir("memory", group)?, "memory.current"),
        };
        read(&dir.join(file)).ok()?.trim().parse().ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse_and_compress() {
        let l: CpuList = "0-3, 8,10-11,2".parse().unwrap();
        assert_eq!(l.0, vec![0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(l.to_string(), "0-3,8,10-11");
        assert!("3-1".parse::<CpuList>().is_err());
        assert!("a".parse::<CpuList>().is_err());
        assert_eq!("".parse::<CpuList>().unwrap().to_string(), "");
    }

    #[test]
    fn mounts_are_found_for_v1_and_v2() {
        let mi =
            "30 25 0:26 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid - cgroup cgroup rw,cpu,cpuacct\n\
                  31 25 0:27 / /sys/fs/cgroup/cpuset rw - cgroup cgroup rw,cpuset\n\
                  32 25 0:28 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n";
        let (v1, v2) = find_mounts(mi);
        assert_eq!(v1["cpu"], PathBuf::from("/sys/fs/cgroup/cpu,cpuacct"));
        assert_eq!(v1["cpuacct"], v1["cpu"]);
        assert_eq!(v1["cpuset"], PathBuf::from("/sys/fs/cgroup/cpuset"));
        assert_eq!(v2, Some(PathBuf::from("/sys/fs/cgroup/unified")));
    }

    #[test]
    fn cpu_limits_read_back_as_written_in_both_versions() {
        assert_eq!(CpuMax::for_cores(Some(1.5)).quota_us, Some(150_000));
        assert_eq!(
            CpuMax::for_cores(Some(0.001)).quota_us,
            Some(1000),
            "the kernel's floor"
        );
        assert_eq!(CpuMax::for_cores(None).quota_us, None);
        for (text, quota) in [
            ("max 100000", None),
            ("-1 100000", None),
            ("5000 100000\n", Some(5000)),
        ] {
            assert_eq!(CpuMax::parse(text).unwrap().quota_us, quota, "{text}");
        }
        assert!(CpuMax::parse("5000").is_none());
        let dir = tempfile::tempdir().unwrap();
        let g = dir.path().join("cpu").join(PARENT).join("be");
        std::fs::create_dir_all(&g).unwrap();
        std::fs::write(g.join("cpu.cfs_quota_us"), "-1\n").unwrap();
        std::fs::write(g.join("cpu.cfs_period_us"), "100000\n").unwrap();
        let cg = Cgroups {
            version: Version::V1,
            mounts: [("cpu".to_string(), dir.path().join("cpu"))].into(),
            v2_controllers: vec![],
        };
        assert_eq!(cg.cpus("be").unwrap(), None, "no cpuset hierarchy");
        cg.set_quota("be", Some(2.0)).unwrap();
        assert_eq!(
            cg.cpu_max("be").unwrap(),
            Some(CpuMax {
                quota_us: Some(200_000),
                period_us: 100_000
            })
        );
        assert_eq!(cg.dir("perf_event", "be"), None);
        assert_eq!(cg.dir("cpu", "be"), Some(g));
    }

    #[test]
    fn names_cannot_escape_the_hierarchy() {
        for bad in ["", "..", "../etc", "a/b", ".x", "sp ace"] {
            assert!(validate(bad).is_err(), "{bad:?}");
        }
        validate("lc-memcached_1").unwrap();
    }

    #[test]
    fn v2_writes_land_in_fixture_files() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("unified");
        let g = root.join(PARENT).join("lc");
        std::fs::create_dir_all(&g).unwrap();
        for f in ["cpuset.cpus", "cpu.max", "cgroup.procs"] {
            std::fs::write(g.join(f), "").unwrap();
        }
        std::fs::write(g.join("cpu.stat"), "usage_usec 1500\nuser_usec 1000\n").unwrap();
        std::fs::write(g.join("memory.current"), "4096\n").unwrap();
        let cg = Cgroups {
            version: Version::V2,
            mounts: [("unified".to_string(), root)].into(),
            v2_controllers: vec!["cpuset".into(), "cpu".into(), "memory".into()],
        };
        cg.set_cpus("lc", &"2-3".parse().unwrap()).unwrap();
        cg.set_quota("lc", Some(1.5)).unwrap();
        assert_eq!(
            std::fs::read_to_string(g.join("cpuset.cpus")).unwrap(),
            "2-3"
        );
        assert_eq!(
            std::fs::read_to_string(g.join("cpu.max")).unwrap(),
            "150000 100000"
        );
        cg.set_quota("lc", None).unwrap();
        assert_eq!(
            std::fs::read_to_string(g.join("cpu.max")).unwrap(),
            "max 100000"
        );
        assert_eq!(cg.cpus("lc").unwrap(), Some(CpuList(vec![2, 3])));
        assert_eq!(
            cg.cpu_max("lc").unwrap(),
            Some(CpuMax {
                quota_us: None,
                period_us: 100_000
            })
        );
        cg.set_cpu_max("lc", CpuMax::for_cores(Some(0.05))).unwrap();
        assert_eq!(cg.cpu_max("lc").unwrap().unwrap().quota_us, Some(5000));
        assert_eq!(cg.cpu_usage_ns("lc"), Some(1_500_000));
        assert_eq!(cg.memory_bytes("lc"), Some(4096));
        assert_eq!(cg.leftovers(), vec!["lc"]);
        assert!(cg.set_cpus("../x", &CpuList::default()).is_err());
    }
}
