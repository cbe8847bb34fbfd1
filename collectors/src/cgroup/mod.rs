//! cgroups, v1 and v2: where a process's cgroup is, the CPU controls of a cgroup (CPU set,
//! bandwidth limit, weight), cohabit's own groups, and moving a process. This module owns
//! the interface, read and write side; every file operation goes through the
//! [`KernelFs`] seam, so a fake tree ([`fake`]) can refuse what the kernel refuses.
//!
//! Kernel docs: `Documentation/admin-guide/cgroup-v1/cpusets.rst`, `…/cgroup-v1/cgroups.rst`,
//! `…/cgroup-v2.rst`. Facts this module relies on:
//! - mounts come from `/proc/self/mountinfo`: v1 hierarchies have type `cgroup` with their
//!   controllers among the super options, the unified one has type `cgroup2`;
//! - `/proc/PID/cgroup` has one `ID:CONTROLLERS:PATH` line per v1 hierarchy and `0::PATH`
//!   for v2; a path is relative to the hierarchy's root (the mount, outside a cgroup
//!   namespace);
//! - v1: a cpuset's `cpuset.cpus` must stay a subset of its parent's (EACCES) and a superset
//!   of its children's (EBUSY); the root's cannot be changed, so a process in the root of
//!   the cpuset hierarchy can only be narrowed by moving it; a new cpuset has empty
//!   `cpuset.cpus` and `cpuset.mems`, and no task may join until both are set;
//! - v2: a controller's files in a cgroup exist only when the parent has the controller in
//!   its `cgroup.subtree_control` (they are "owned by the parent"), which is what the
//!   cgroup's `cgroup.controllers` lists; the root has no `cpuset.cpus`, `cpu.max` or
//!   `cpu.weight`; a non-root cgroup with processes cannot enable controllers for its
//!   children, and one with controllers enabled cannot take processes (EBUSY, the "no
//!   internal process" rule); an empty `cpuset.cpus` means "the parent's";
//! - a process joins by writing its pid to `cgroup.procs` (all its threads move);
//! - limit: v1 `cpu.cfs_quota_us` over `cpu.cfs_period_us` (-1 = none), v2 `cpu.max`
//!   (`max 100000` = none); weight: v1 `cpu.shares` (2..=262144, default 1024), v2
//!   `cpu.weight` (1..=10000, default 100);
//! - a group can be removed (rmdir) only when no process and no child group is left in it.
//!
//! cohabit's own groups live under one parent, [`PARENT`], in the cpuset and cpu
//! hierarchies only (v1), so it can find what a crashed run left; it never creates groups
//! in, or moves processes into, the memory or pids hierarchies, and it never writes the
//! mount root's `cgroup.subtree_control` (systemd owns it).

#[cfg(feature = "testutils")]
pub mod fake;
#[cfg(feature = "testutils")]
pub mod testing;

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Component, Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;

use serde::Serialize;

use crate::kfs::{KernelFs, RealFs};
use crate::{HostPaths, IoError};

/// The directory under each hierarchy that holds cohabit's groups.
pub const PARENT: &str = "cohabit";

/// Default CFS period.
const PERIOD_US: u64 = 100_000;

/// The control files cohabit writes (and so restores); nothing else is written through
/// [`Cgroups::write_control`].
pub const CONTROL_FILES: [&str; 8] = [
    "cpuset.cpus",
    "cpuset.mems",
    "cpu.max",
    "cpu.weight",
    "cpu.cfs_quota_us",
    "cpu.cfs_period_us",
    "cpu.shares",
    IDLE_FILE,
];

/// The idle scheduling class of a group (v1 and v2): `1` puts it in, `0` takes it out.
/// The kernel refuses a weight (`cpu.shares`, `cpu.weight`) for a group in it (EINVAL),
/// and taking a group out resets its weight to the default, so the weight must be put
/// back after it, never before.
pub const IDLE_FILE: &str = "cpu.idle";

/// Why a cgroup operation failed.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// A file could not be read or written.
    #[error(transparent)]
    Io(#[from] IoError),
    /// A group name that could escape the hierarchy.
    #[error("invalid cgroup name: {0}")]
    BadName(cohabit_core::name::NameError),
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
    /// A directory that is not a cgroup below one of the mounts in use (or the root where a
    /// group is needed).
    #[error("{0} is not a cgroup cohabit may touch (outside the hierarchies in use, or a root)")]
    NotACgroup(PathBuf),
    /// A file cohabit never writes.
    #[error("{0:?} is not one of the control files cohabit writes")]
    NotAControlFile(String),
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

impl CpuList {
    /// True when the two lists have a CPU in common.
    pub fn overlaps(&self, other: &CpuList) -> bool {
        self.0.iter().any(|c| other.0.contains(c))
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

/// The CPU weight cohabit gives a cgroup against its siblings (and, in the root, against
/// every process the root holds).
///
/// Latency-critical groups get the highest weight the kernel takes, so a busy unmanaged
/// process on one of their CPUs gets about 1 % of it (v2: 100 against 10000; v1: 1024
/// against 262144, 0.4 %); the best-effort pool gets the lowest, so it yields to everything
/// unmanaged on its CPUs. A weight only matters where CPUs are contended; the CPU sets do
/// the main separation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CpuWeight {
    /// v2 `cpu.weight` 10000, v1 `cpu.shares` 262144.
    Highest,
    /// v2 `cpu.weight` 1, v1 `cpu.shares` 2.
    Lowest,
}

impl CpuWeight {
    /// The file and the value written for this weight on `version`.
    pub fn file_value(self, version: Version) -> (&'static str, String) {
        let value = match (version, self) {
            (Version::V1, CpuWeight::Highest) => 262_144,
            (Version::V1, CpuWeight::Lowest) => 2,
            (Version::V2, CpuWeight::Highest) => 10_000,
            (Version::V2, CpuWeight::Lowest) => 1,
        };
        let file = match version {
            Version::V1 => "cpu.shares",
            Version::V2 => "cpu.weight",
        };
        (file, value.to_string())
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

/// A controller whose files cohabit writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Controller {
    /// CPU sets (`cpuset.cpus`).
    Cpuset,
    /// CPU bandwidth limit and weight.
    Cpu,
}

impl Controller {
    /// Both, in the order cohabit writes them.
    pub const ALL: [Controller; 2] = [Controller::Cpuset, Controller::Cpu];

    /// The kernel's name for it.
    pub fn name(self) -> &'static str {
        match self {
            Controller::Cpuset => "cpuset",
            Controller::Cpu => "cpu",
        }
    }
}

/// Whether cohabit may write a controller's files in the cgroup a process is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum InPlace {
    /// The owner's cgroup has the controller's files: write them there.
    Writable,
    /// The cgroup is one of cohabit's own groups (the process was moved there).
    OwnGroup,
    /// The root of the hierarchy: its CPU controls cannot be narrowed (v1) or do not exist
    /// (v2).
    HierarchyRoot,
    /// v2: the parent does not delegate the controller (it is not in the parent's
    /// `cgroup.subtree_control`), so the files do not exist; cohabit does not enable it
    /// there, because that cgroup belongs to its owner.
    NotDelegated,
}

/// The cgroup hierarchies cohabit uses on one host.
#[derive(Debug, Clone, Serialize)]
pub struct Cgroups {
    /// v1 or v2.
    pub version: Version,
    /// v1: controller → mount point (`cpuset`, `cpu`, `cpuacct`, `memory`, `perf_event`,
    /// `name=systemd`); v2: `unified`.
    pub mounts: BTreeMap<String, PathBuf>,
    /// v2: controllers the root offers (`cgroup.controllers`).
    pub v2_controllers: Vec<String>,
    #[serde(skip)]
    fs: Arc<dyn KernelFs>,
}

/// The v1 hierarchies cohabit looks at: the CPU controllers it writes, the ones it reads,
/// and systemd's own (on v1 a unit's cgroup often exists only there; the matchers look for
/// processes in it, nothing is ever written to it).
const V1_CONTROLLERS: [&str; 6] = [
    "cpuset",
    "cpu",
    "cpuacct",
    "memory",
    "perf_event",
    "name=systemd",
];

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

/// Each component of a group path cohabit makes follows the group-name rule
/// (`cohabit_core::name`).
fn validate(name: &str) -> Result<(), CgroupError> {
    cohabit_core::name::check_group_name(name).map_err(CgroupError::BadName)
}

fn pids(text: &str) -> Vec<u32> {
    text.lines().filter_map(|l| l.trim().parse().ok()).collect()
}

impl Cgroups {
    /// Hierarchies as given, reached through `fs` (fixtures and fakes).
    pub fn new(
        version: Version,
        mounts: BTreeMap<String, PathBuf>,
        v2_controllers: Vec<String>,
        fs: Arc<dyn KernelFs>,
    ) -> Self {
        Self {
            version,
            mounts,
            v2_controllers,
            fs,
        }
    }

    /// Finds the hierarchies from `<proc>/self/mountinfo` that lie under `paths.cgroup`, on
    /// the real kernel.
    pub fn detect(paths: &HostPaths) -> Result<Option<Self>, IoError> {
        Self::detect_with(paths, Arc::new(RealFs))
    }

    /// [`Self::detect`] through `fs`. Prefers v1 when it has a cpuset or cpu hierarchy (the
    /// unified one then usually has no controllers); `None` when neither is usable.
    pub fn detect_with(paths: &HostPaths, fs: Arc<dyn KernelFs>) -> Result<Option<Self>, IoError> {
        let path = paths.proc.join("self/mountinfo");
        let mountinfo = fs
            .read_to_string(&path)
            .map_err(|e| IoError::new("reading", &path, e))?;
        let (mut v1, mut v2) = find_mounts(&mountinfo);
        // Only hierarchies under the configured cgroup root are ours to use.
        v1.retain(|_, m| m.starts_with(&paths.cgroup));
        v2 = v2.filter(|m| m.starts_with(&paths.cgroup));
        if v1.contains_key("cpuset") || v1.contains_key("cpu") {
            return Ok(Some(Self::new(Version::V1, v1, vec![], fs)));
        }
        if let Some(root) = v2 {
            let controllers = fs
                .read_to_string(&root.join("cgroup.controllers"))
                .unwrap_or_default()
                .split_whitespace()
                .map(str::to_string)
                .collect();
            let mounts = [("unified".to_string(), root)].into();
            return Ok(Some(Self::new(Version::V2, mounts, controllers, fs)));
        }
        Ok(None)
    }

    /// Whether cores (cpuset) can be controlled.
    pub fn has_cpuset(&self) -> bool {
        self.mount(Controller::Cpuset).is_some()
    }

    /// Whether CPU quota can be controlled.
    pub fn has_quota(&self) -> bool {
        self.mount(Controller::Cpu).is_some()
    }

    /// The root of the hierarchy that holds `controller` (v2: the unified mount, when the
    /// root offers the controller).
    pub fn mount(&self, controller: Controller) -> Option<&Path> {
        self.mount_named(controller.name())
    }

    fn mount_named(&self, controller: &str) -> Option<&Path> {
        match self.version {
            Version::V1 => self.mounts.get(controller).map(PathBuf::as_path),
            Version::V2 => self
                .mounts
                .get("unified")
                .filter(|_| self.v2_controllers.iter().any(|c| c == controller))
                .map(PathBuf::as_path),
        }
    }

    /// A name for a short-lived probe directory, unique per call (two threads of one
    /// process may probe at once).
    fn probe_name() -> String {
        static PROBES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = PROBES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        format!("{PARENT}-probe-{}-{n}", std::process::id())
    }

    fn remove_probe(&self, dir: &Path) {
        if let Err(e) = self.fs.remove_dir(dir) {
            tracing::warn!(dir = %dir.display(), error = %e, "could not remove the cgroup probe");
        }
    }

    /// Whether the cpu controller offers the kernel's idle scheduling class for groups
    /// (`cpu.idle`, Linux 5.15 and later, v1 and v2): a group whose `cpu.idle` is 1 runs
    /// only when its siblings leave a CPU idle and is preempted at once by any of them
    /// waking up, and its CPUs count as idle when the kernel places a waking thread. v1:
    /// the cpu hierarchy's root has the file; v2, whose root has none: a short-lived probe
    /// group below the root has it (the mount must delegate `cpu`). [`IDLE_FILE`].
    pub fn has_idle_class(&self) -> bool {
        let Some(mount) = self.mount(Controller::Cpu) else {
            return false;
        };
        match self.version {
            Version::V1 => self.fs.read_to_string(&mount.join(IDLE_FILE)).is_ok(),
            Version::V2 => {
                let dir = mount.join(Self::probe_name());
                if self.fs.create_dir(&dir).is_err() {
                    return false;
                }
                let has = self.fs.read_to_string(&dir.join(IDLE_FILE)).is_ok();
                self.remove_probe(&dir);
                has
            }
        }
    }

    /// Controllers whose hierarchy this process can create groups in (tried with a
    /// short-lived probe directory).
    pub fn writable_controllers(&self) -> Vec<String> {
        let probe = Self::probe_name();
        let mut out = Vec::new();
        for (ctrl, mount) in self.mounts.iter().filter(|(c, _)| *c != "name=systemd") {
            let dir = mount.join(&probe);
            if self.fs.create_dir(&dir).is_ok() {
                self.remove_probe(&dir);
                match self.version {
                    Version::V1 => out.push(ctrl.clone()),
                    Version::V2 => out.extend(self.v2_controllers.iter().cloned()),
                }
            }
        }
        out
    }

    /// The cgroup directory a process is in, in the hierarchy of `controller` (`cpuset`,
    /// `cpu`, `perf_event`, …), from its `/proc/PID/cgroup` lines
    /// ([`crate::procfs::Procfs::cgroups`]). `None` when that hierarchy is not in use, the
    /// process has no line for it, or the path is not one cohabit can follow (outside the
    /// caller's cgroup namespace, or a cgroup already removed).
    pub fn home(&self, controller: &str, lines: &[(u32, String, String)]) -> Option<PathBuf> {
        let mount = match self.version {
            Version::V1 => self.mounts.get(controller)?,
            Version::V2 => self.mounts.get("unified")?,
        };
        let path = lines.iter().find_map(|(id, ctrls, path)| {
            let matches = match self.version {
                Version::V1 => ctrls.split(',').any(|c| c == controller),
                Version::V2 => *id == 0 && ctrls.is_empty(),
            };
            matches.then_some(path)
        })?;
        if path.ends_with(" (deleted)") {
            return None;
        }
        let rel = Path::new(path.trim_start_matches('/'));
        if rel.components().any(|c| !matches!(c, Component::Normal(_))) {
            return None;
        }
        Some(mount.join(rel))
    }

    /// The directory of cgroup path `cgroup_path` (e.g. `/system.slice/nginx.service`) in
    /// the hierarchy of `controller`, if it exists there.
    pub fn dir_at(&self, controller: Controller, cgroup_path: &str) -> Option<PathBuf> {
        let rel = Path::new(cgroup_path.trim_start_matches('/'));
        if rel.components().any(|c| !matches!(c, Component::Normal(_))) {
            return None;
        }
        let dir = self.mount(controller)?.join(rel);
        self.fs
            .read_to_string(&dir.join("cgroup.procs"))
            .is_ok()
            .then_some(dir)
    }

    /// Whether `dir` is a cgroup of a hierarchy in use (it has a `cgroup.procs`).
    pub fn exists(&self, dir: &Path) -> bool {
        self.mount_of(dir).is_ok() && self.fs.read_to_string(&dir.join("cgroup.procs")).is_ok()
    }

    /// Whether `controller`'s files may be written in `dir`, the cgroup a process is in
    /// (see [`InPlace`]). On v2 this reads `dir`'s `cgroup.controllers`; one that cannot be
    /// read counts as not delegated.
    pub fn in_place(&self, controller: Controller, dir: &Path) -> InPlace {
        let Some(mount) = self.mount(controller) else {
            return InPlace::NotDelegated;
        };
        if dir == mount {
            return InPlace::HierarchyRoot;
        }
        if dir.starts_with(mount.join(PARENT)) {
            return InPlace::OwnGroup;
        }
        match self.version {
            Version::V1 => InPlace::Writable,
            Version::V2 => {
                let offered = self
                    .fs
                    .read_to_string(&dir.join("cgroup.controllers"))
                    .unwrap_or_default();
                if offered.split_whitespace().any(|c| c == controller.name()) {
                    InPlace::Writable
                } else {
                    InPlace::NotDelegated
                }
            }
        }
    }

    /// The directory of cohabit's group `group` in the hierarchy of `controller`.
    pub fn own_dir(
        &self,
        controller: Controller,
        group: &str,
    ) -> Result<Option<PathBuf>, CgroupError> {
        validate(group)?;
        Ok(self.own_parent(controller).map(|p| p.join(group)))
    }

    /// The directory that holds cohabit's groups in the hierarchy of `controller`.
    pub fn own_parent(&self, controller: Controller) -> Option<PathBuf> {
        self.mount(controller).map(|m| m.join(PARENT))
    }

    /// True when `dir` is, or lies under, cohabit's parent directory in some hierarchy.
    pub fn is_own(&self, dir: &Path) -> bool {
        self.mounts
            .values()
            .any(|m| dir.starts_with(m.join(PARENT)))
    }

    /// The mount `dir` lies under, if `dir` is a path cohabit may touch: below a mount in
    /// use, with no `..`.
    fn mount_of(&self, dir: &Path) -> Result<&Path, CgroupError> {
        let clean = dir
            .components()
            .all(|c| matches!(c, Component::RootDir | Component::Normal(_)));
        self.mounts
            .values()
            .filter(|_| clean)
            .find(|m| dir.starts_with(m))
            .map(PathBuf::as_path)
            .ok_or_else(|| CgroupError::NotACgroup(dir.to_path_buf()))
    }

    /// The cgroup `dir` with the mount root refused (groups are created and removed only
    /// below it).
    fn below_root(&self, dir: &Path) -> Result<(), CgroupError> {
        if self.mount_of(dir)? == dir {
            return Err(CgroupError::NotACgroup(dir.to_path_buf()));
        }
        Ok(())
    }

    /// Reads control file `file` of the cgroup `dir` (trailing newline removed).
    pub fn read_control(&self, dir: &Path, file: &str) -> Result<String, CgroupError> {
        self.mount_of(dir)?;
        let path = dir.join(file);
        let text = self
            .fs
            .read_to_string(&path)
            .map_err(|e| IoError::new("reading", &path, e))?;
        Ok(text.trim_end().to_string())
    }

    /// Writes `value` to control file `file` (one of [`CONTROL_FILES`]) of the cgroup `dir`.
    pub fn write_control(&self, dir: &Path, file: &str, value: &str) -> Result<(), CgroupError> {
        if !CONTROL_FILES.contains(&file) {
            return Err(CgroupError::NotAControlFile(file.to_string()));
        }
        self.mount_of(dir)?;
        let path = dir.join(file);
        self.fs
            .write(&path, value)
            .map_err(|e| IoError::new("writing", &path, e).into())
    }

    /// The CPUs the cgroup `dir` may run on: its `cpuset.cpus`, or on v2, where an empty
    /// list means "the parent's", its `cpuset.cpus.effective`.
    pub fn cpus_at(&self, dir: &Path) -> Result<CpuList, CgroupError> {
        let cpus: CpuList = self.read_control(dir, "cpuset.cpus")?.parse()?;
        if cpus.0.is_empty() && self.version == Version::V2 {
            return self.read_control(dir, "cpuset.cpus.effective")?.parse();
        }
        Ok(cpus)
    }

    /// The cgroup `dir`'s CPU bandwidth limit as the kernel holds it.
    pub fn cpu_max_at(&self, dir: &Path) -> Result<CpuMax, CgroupError> {
        let (text, path) = match self.version {
            Version::V1 => {
                let q = self.read_control(dir, "cpu.cfs_quota_us")?;
                let p = self.read_control(dir, "cpu.cfs_period_us")?;
                (format!("{q} {p}"), dir.join("cpu.cfs_quota_us"))
            }
            Version::V2 => (self.read_control(dir, "cpu.max")?, dir.join("cpu.max")),
        };
        CpuMax::parse(&text).ok_or(CgroupError::BadCpuMax { path, text })
    }

    /// The files and values that set limit `max`, in the order they are written (v1: the
    /// period first, so the quota is checked against the right one).
    pub fn cpu_max_files(&self, max: CpuMax) -> Vec<(&'static str, String)> {
        let period = max.period_us;
        match self.version {
            Version::V1 => vec![
                ("cpu.cfs_period_us", period.to_string()),
                (
                    "cpu.cfs_quota_us",
                    max.quota_us.map_or_else(|| "-1".into(), |q| q.to_string()),
                ),
            ],
            Version::V2 => vec![(
                "cpu.max",
                max.quota_us
                    .map_or_else(|| format!("max {period}"), |q| format!("{q} {period}")),
            )],
        }
    }

    /// The file and value that set weight `w`.
    pub fn weight_file(&self, w: CpuWeight) -> (&'static str, String) {
        w.file_value(self.version)
    }

    /// Creates the cgroup `dir` (below a mount, never the mount itself) and makes it usable:
    /// on v1 a new cpuset gets its parent's `cpuset.mems` and `cpuset.cpus` (tasks cannot
    /// join an empty one); on v2 cohabit's parent directory delegates the CPU controllers
    /// it has to its children (its own `cgroup.subtree_control`; the mount root's is never
    /// written). An existing directory is left as it is.
    pub fn make_dir(&self, dir: &Path) -> Result<(), CgroupError> {
        self.below_root(dir)?;
        if self.fs.read_to_string(&dir.join("cgroup.procs")).is_ok() {
            return Ok(());
        }
        self.fs
            .create_dir(dir)
            .map_err(|e| IoError::new("creating cgroup", dir, e))?;
        let parent = dir.parent().unwrap_or(dir);
        match self.version {
            Version::V1 => {
                if self.fs.read_to_string(&dir.join("cpuset.mems")).is_ok() {
                    for file in ["cpuset.mems", "cpuset.cpus"] {
                        if self.read_control(dir, file)?.is_empty() {
                            let inherited = self.read_control(parent, file)?;
                            self.write_control(dir, file, &inherited)?;
                        }
                    }
                }
            }
            Version::V2 => {
                if dir.file_name().is_some_and(|n| n == PARENT) {
                    let offered = self.read_control(dir, "cgroup.controllers")?;
                    let enable: Vec<String> = offered
                        .split_whitespace()
                        .filter(|c| Controller::ALL.iter().any(|k| k.name() == *c))
                        .map(|c| format!("+{c}"))
                        .collect();
                    if !enable.is_empty() {
                        let path = dir.join("cgroup.subtree_control");
                        self.fs
                            .write(&path, &enable.join(" "))
                            .map_err(|e| IoError::new("writing", &path, e))?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Removes the cgroup `dir` (it must hold no process and no group); missing is fine.
    pub fn remove_dir(&self, dir: &Path) -> Result<(), CgroupError> {
        self.below_root(dir)?;
        match self.fs.remove_dir(dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(IoError::new("removing cgroup", dir, e).into()),
        }
    }

    /// Moves a process (all its threads) into the cgroup `dir` of one hierarchy. `Ok(false)`
    /// when the process or the cgroup is gone.
    pub fn move_process(&self, dir: &Path, pid: u32) -> Result<bool, CgroupError> {
        self.mount_of(dir)?;
        let path = dir.join("cgroup.procs");
        match self.fs.write(&path, &pid.to_string()) {
            Ok(()) => Ok(true),
            Err(e) => {
                let e = IoError::new("moving a process into", &path, e);
                if e.is_absent() {
                    Ok(false)
                } else {
                    Err(e.into())
                }
            }
        }
    }

    /// Processes in the cgroup `dir` (not its children).
    pub fn processes_in_dir(&self, dir: &Path) -> Result<Vec<u32>, CgroupError> {
        self.mount_of(dir)?;
        let path = dir.join("cgroup.procs");
        let text = self
            .fs
            .read_to_string(&path)
            .map_err(|e| IoError::new("reading", &path, e))?;
        Ok(pids(&text))
    }

    /// Processes in an arbitrary cgroup path (e.g. `/system.slice/nginx.service`), looked
    /// up in every hierarchy; empty if the path exists nowhere.
    pub fn processes_at_cgroup_path(&self, cgroup_path: &str) -> Vec<u32> {
        let rel = Path::new(cgroup_path.trim_start_matches('/'));
        if rel.components().any(|c| !matches!(c, Component::Normal(_))) {
            return vec![];
        }
        let mut out: Vec<u32> = self
            .mounts
            .values()
            .filter_map(|m| {
                self.fs
                    .read_to_string(&m.join(rel).join("cgroup.procs"))
                    .ok()
            })
            .flat_map(|t| pids(&t))
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    /// Every hierarchy's directory for cohabit's parent (`None`) or group `group`; several
    /// controllers may share one mount; systemd's hierarchy is never touched.
    fn dirs(&self, group: Option<&str>) -> Vec<(&str, PathBuf)> {
        let mut seen = Vec::new();
        let mut out = Vec::new();
        for (c, m) in self.mounts.iter().filter(|(c, _)| *c != "name=systemd") {
            if seen.contains(&m) {
                continue;
            }
            seen.push(m);
            let parent = m.join(PARENT);
            out.push((
                c.as_str(),
                group.map_or_else(|| parent.clone(), |g| parent.join(g)),
            ));
        }
        out
    }

    /// Groups under cohabit's parent in any hierarchy (what a previous run may have left).
    pub fn leftovers(&self) -> Vec<String> {
        let mut out: Vec<String> = self
            .dirs(None)
            .into_iter()
            .filter_map(|(_, d)| self.fs.subdirs(&d).ok())
            .flatten()
            .collect();
        out.sort();
        out.dedup();
        out
    }

    /// Moves every process of cohabit's group `group` to the root of each hierarchy (used
    /// when cleaning what a run left without a record, whose original placement is unknown:
    /// cohabit only ever moved processes out of a hierarchy's root).
    pub fn evacuate(&self, group: &str) -> Result<usize, CgroupError> {
        validate(group)?;
        let mut moved = 0;
        for (ctrl, dir) in self.dirs(Some(group)) {
            let Ok(text) = self.fs.read_to_string(&dir.join("cgroup.procs")) else {
                continue;
            };
            let root = match self.version {
                Version::V1 => self.mounts.get(ctrl),
                Version::V2 => self.mounts.get("unified"),
            };
            let Some(root) = root else { continue };
            for pid in pids(&text) {
                if self
                    .fs
                    .write(&root.join("cgroup.procs"), &pid.to_string())
                    .is_ok()
                {
                    moved += 1;
                }
            }
        }
        Ok(moved)
    }

    /// Removes cohabit's group `group` from every hierarchy (it must be empty); missing is
    /// fine.
    pub fn remove(&self, group: &str) -> Result<(), CgroupError> {
        validate(group)?;
        for (_, dir) in self.dirs(Some(group)) {
            self.remove_dir(&dir)?;
        }
        Ok(())
    }

    /// Removes cohabit's parent directories where they are empty.
    pub fn remove_parent(&self) {
        for (_, dir) in self.dirs(None) {
            if let Err(e) = self.remove_dir(&dir) {
                tracing::warn!(dir = %dir.display(), error = %e, "could not remove cohabit's cgroup parent");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(version: Version, mounts: &[(&str, PathBuf)]) -> Cgroups {
        let mounts = mounts
            .iter()
            .map(|(c, p)| ((*c).to_string(), p.clone()))
            .collect();
        let ctrls = vec!["cpuset".into(), "cpu".into()];
        Cgroups::new(version, mounts, ctrls, Arc::new(RealFs))
    }

    #[test]
    fn cpu_lists_parse_and_compress() {
        let l: CpuList = "0-3, 8,10-11,2".parse().unwrap();
        assert_eq!(l.0, vec![0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(l.to_string(), "0-3,8,10-11");
        assert!("3-1".parse::<CpuList>().is_err());
        assert!("a".parse::<CpuList>().is_err());
        assert_eq!("".parse::<CpuList>().unwrap().to_string(), "");
        assert!(l.overlaps(&CpuList(vec![11, 12])));
        assert!(!l.overlaps(&CpuList(vec![4, 5])));
    }

    #[test]
    fn mounts_are_found_for_v1_and_v2() {
        let mi =
            "30 25 0:26 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid - cgroup cgroup rw,cpu,cpuacct\n\
                  31 25 0:27 / /sys/fs/cgroup/cpuset rw - cgroup cgroup rw,cpuset\n\
                  32 25 0:28 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n\
                  33 25 0:29 / /sys/fs/cgroup/systemd rw - cgroup cgroup rw,xattr,name=systemd\n\
                  34 25 0:30 / /sys/fs/cgroup/pids rw - cgroup cgroup rw,pids\n";
        let (v1, v2) = find_mounts(mi);
        assert_eq!(v1["name=systemd"], PathBuf::from("/sys/fs/cgroup/systemd"));
        assert!(!v1.contains_key("pids"), "never used");
        assert_eq!(v1["cpu"], PathBuf::from("/sys/fs/cgroup/cpu,cpuacct"));
        assert_eq!(v1["cpuacct"], v1["cpu"]);
        assert_eq!(v1["cpuset"], PathBuf::from("/sys/fs/cgroup/cpuset"));
        assert_eq!(v2, Some(PathBuf::from("/sys/fs/cgroup/unified")));
    }

    #[test]
    fn cpu_limits_and_weights_have_the_files_of_each_version() {
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
        let v1 = fixture(Version::V1, &[("cpu", "/c".into())]);
        let v2 = fixture(Version::V2, &[("unified", "/u".into())]);
        let half = CpuMax::for_cores(Some(0.5));
        assert_eq!(
            v1.cpu_max_files(half),
            vec![
                ("cpu.cfs_period_us", "100000".to_string()),
                ("cpu.cfs_quota_us", "50000".to_string())
            ]
        );
        assert_eq!(
            v1.cpu_max_files(CpuMax::for_cores(None))[1].1,
            "-1",
            "v1's no limit"
        );
        assert_eq!(
            v2.cpu_max_files(half),
            vec![("cpu.max", "50000 100000".to_string())]
        );
        assert_eq!(
            v2.cpu_max_files(CpuMax::for_cores(None)),
            vec![("cpu.max", "max 100000".to_string())]
        );
        assert_eq!(
            v1.weight_file(CpuWeight::Highest),
            ("cpu.shares", "262144".into())
        );
        assert_eq!(
            v1.weight_file(CpuWeight::Lowest),
            ("cpu.shares", "2".into())
        );
        assert_eq!(
            v2.weight_file(CpuWeight::Highest),
            ("cpu.weight", "10000".into())
        );
        assert_eq!(
            v2.weight_file(CpuWeight::Lowest),
            ("cpu.weight", "1".into())
        );
    }

    #[test]
    fn names_and_paths_cannot_escape_the_hierarchy() {
        for bad in ["", "..", "../etc", "a/b", ".x", "sp ace"] {
            assert!(validate(bad).is_err(), "{bad:?}");
        }
        validate("lc-memcached_1").unwrap();
        let cg = fixture(Version::V1, &[("cpuset", "/sys/fs/cgroup/cpuset".into())]);
        for dir in [
            "/etc",
            "/sys/fs/cgroup/cpuset/../../../etc",
            "/sys/fs/cgroup/cpusetx",
        ] {
            assert!(
                matches!(
                    cg.write_control(Path::new(dir), "cpuset.cpus", "0"),
                    Err(CgroupError::NotACgroup(_))
                ),
                "{dir}"
            );
        }
        assert!(matches!(
            cg.write_control(Path::new("/sys/fs/cgroup/cpuset/x"), "release_agent", "/x"),
            Err(CgroupError::NotAControlFile(_))
        ));
        assert!(matches!(
            cg.remove_dir(Path::new("/sys/fs/cgroup/cpuset")),
            Err(CgroupError::NotACgroup(_))
        ));
        assert!(matches!(
            cg.own_dir(Controller::Cpuset, "../x"),
            Err(CgroupError::BadName(_))
        ));
        assert!(cg.processes_at_cgroup_path("/../etc").is_empty());
    }

    #[test]
    fn a_process_home_is_found_per_hierarchy_and_judged_for_in_place_writes() {
        let v1 = fixture(
            Version::V1,
            &[
                ("cpuset", "/sys/fs/cgroup/cpuset".into()),
                ("cpu", "/sys/fs/cgroup/cpu,cpuacct".into()),
                ("memory", "/sys/fs/cgroup/memory".into()),
            ],
        );
        let lines = crate::procfs::parse_cgroup_file(
            "9:memory:/system.slice/kv.service\n4:cpu,cpuacct:/system.slice/kv.service\n3:cpuset:/\n1:name=systemd:/system.slice/kv.service\n0::/\n",
        );
        let cpu = v1.home("cpu", &lines).unwrap();
        assert_eq!(
            cpu,
            PathBuf::from("/sys/fs/cgroup/cpu,cpuacct/system.slice/kv.service")
        );
        let cpuset = v1.home("cpuset", &lines).unwrap();
        assert_eq!(cpuset, PathBuf::from("/sys/fs/cgroup/cpuset"));
        assert_eq!(v1.in_place(Controller::Cpu, &cpu), InPlace::Writable);
        assert_eq!(
            v1.in_place(Controller::Cpuset, &cpuset),
            InPlace::HierarchyRoot
        );
        let own = v1.own_dir(Controller::Cpuset, "lc-kv").unwrap().unwrap();
        assert_eq!(v1.in_place(Controller::Cpuset, &own), InPlace::OwnGroup);
        assert!(v1.is_own(&own) && !v1.is_own(&cpu));
        assert_eq!(v1.home("perf_event", &lines), None, "not mounted");
        // Paths cohabit cannot follow.
        for odd in ["3:cpuset:/../other\n", "3:cpuset:/gone (deleted)\n"] {
            assert_eq!(
                v1.home("cpuset", &crate::procfs::parse_cgroup_file(odd)),
                None,
                "{odd}"
            );
        }
        let v2 = fixture(Version::V2, &[("unified", "/sys/fs/cgroup".into())]);
        assert_eq!(
            v2.home("cpu", &lines),
            Some(PathBuf::from("/sys/fs/cgroup")),
            "the 0:: line"
        );
    }
}
