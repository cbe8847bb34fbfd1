//! Kubernetes pods' cgroups: where the kubelet and the container runtime put a pod and its
//! containers, and which CPUs the kubelet's static CPU manager has given away. No
//! Kubernetes client here: the pod's UID, QoS class and container IDs come from the caller
//! (the daemon's pod source); this module turns them into cgroup paths and looks them up
//! through [`Cgroups`] (so through the injected cgroup root, and the fake in tests).
//!
//! Problem: cohabit controls a pod's CPUs in place, in the cgroups the kubelet and the
//! runtime made, and must find them from what the API server says about the pod. Two
//! kubelet cgroup drivers lay the tree out differently, three runtimes name container
//! cgroups differently, and the kubelet's static CPU manager pins some containers to CPUs
//! nobody else may use.
//!
//! Approach: pure functions from (driver, QoS class, pod UID, runtime, container ID) to the
//! cgroup path relative to a hierarchy's root ([`pod_path`], [`container_names`]); the same
//! path holds in every v1 hierarchy and in the v2 one. [`Kubepods`] adds the look-ups: the
//! driver detected from which tree exists (`auto`), and the container's cgroup as the first
//! of its runtime's names that exists. [`CpuManagerState`] parses the kubelet's
//! `cpu_manager_state` checkpoint.
//!
//! Layout (kubelet `pkg/kubelet/cm`: the QoS container manager and the pod container
//! manager; containerd, CRI-O and cri-dockerd name the container's cgroup under the pod's):
//!
//! | driver | guaranteed pod | burstable pod | best-effort pod | container |
//! |---|---|---|---|---|
//! | cgroupfs | `kubepods/pod<uid>` | `kubepods/burstable/pod<uid>` | `kubepods/besteffort/pod<uid>` | containerd, docker: `<id>`; CRI-O: `crio-<id>` |
//! | systemd | `kubepods.slice/kubepods-pod<uid_>.slice` | `kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid_>.slice` | same with `besteffort` | `cri-containerd-<id>.scope`, `crio-<id>.scope`, `docker-<id>.scope` |
//!
//! `<uid_>` is the UID with `-` replaced by `_` (a `-` in a systemd unit name means
//! nesting). The kubelet's `--cgroup-root` puts the whole tree under another cgroup
//! ([`Kubepods::new`]'s `cgroup_root`).
//!
//! `cpu_manager_state` (`<kubelet dir>/cpu_manager_state`, JSON): `policyName` (`none` or
//! `static`), `defaultCpuSet` (the shared pool), `entries` (pod UID → container name →
//! CPU set given exclusively), `checksum`. A container listed there runs on CPUs the
//! kubelet took out of the shared pool for it alone: cohabit never touches it and hands
//! out none of its CPUs.
//!
//! Properties: paths are built only from validated UIDs and IDs (lowercase hex, digits and
//! `-`; no `/`, no `..`), so a pod object cannot name a cgroup outside its pod's; look-ups
//! only read.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::Deserialize;

use crate::cgroup::{Cgroups, Controller, CpuList};
use crate::IoError;

/// Why a pod's cgroups could not be named or found.
#[derive(Debug, thiserror::Error)]
pub enum KubepodsError {
    /// A pod UID that is not a UUID-like string of hex digits and dashes.
    #[error("pod UID {0:?} is not a UID (hex digits and '-', 1-64 characters)")]
    BadUid(String),
    /// A container ID that is not the runtime's hex ID.
    #[error("container ID {0:?} is not a runtime ID (hex digits, 1-128 characters)")]
    BadContainerId(String),
    /// A runtime this module does not know the cgroup names of.
    #[error("container runtime {0:?} is not one of containerd, cri-o, docker")]
    UnknownRuntime(String),
    /// A kubelet cgroup root that is not an absolute cgroup path.
    #[error("kubelet cgroup root {0:?} must be an absolute cgroup path without . or ..")]
    BadRoot(String),
    /// `auto` found no kubepods tree.
    #[error("no kubepods tree found (looked for {looked:?} in {hierarchy}); is the kubelet running on this host, with this cgroup root? Set cgroup_driver to skip the detection")]
    NoTree {
        /// The hierarchy looked in.
        hierarchy: String,
        /// The paths looked for.
        looked: Vec<String>,
    },
    /// `auto` found both trees.
    #[error("both {cgroupfs:?} (cgroupfs driver) and {systemd:?} (systemd driver) exist; set cgroup_driver to the kubelet's")]
    BothTrees {
        /// The cgroupfs tree's path.
        cgroupfs: String,
        /// The systemd tree's path.
        systemd: String,
    },
    /// The host has no cpu or cpuset hierarchy to look in.
    #[error("no cpu or cpuset cgroup hierarchy to find pods in")]
    NoHierarchy,
    /// `cpu_manager_state` could not be read.
    #[error(transparent)]
    Io(#[from] IoError),
    /// `cpu_manager_state` is not what the kubelet writes.
    #[error("{path}: not a kubelet CPU manager checkpoint: {reason}")]
    BadState {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
}

/// The kubelet's cgroup driver (its `cgroupDriver` setting).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Driver {
    /// Plain directories: `kubepods/burstable/pod<uid>/<id>`.
    Cgroupfs,
    /// systemd slices and scopes: `kubepods.slice/…/cri-containerd-<id>.scope`.
    Systemd,
}

impl Driver {
    /// The kubelet's name for it.
    pub fn name(self) -> &'static str {
        match self {
            Driver::Cgroupfs => "cgroupfs",
            Driver::Systemd => "systemd",
        }
    }

    /// The top of the kubepods tree (below the kubelet's cgroup root).
    pub fn root_name(self) -> &'static str {
        match self {
            Driver::Cgroupfs => "kubepods",
            Driver::Systemd => "kubepods.slice",
        }
    }
}

impl fmt::Display for Driver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A pod's QoS class (`status.qosClass`), which picks its parent cgroup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Qos {
    /// Requests equal limits for every resource: directly under `kubepods`.
    Guaranteed,
    /// Some request or limit: under `kubepods/burstable`.
    Burstable,
    /// No request or limit: under `kubepods/besteffort`.
    BestEffort,
}

impl Qos {
    fn cgroupfs_dir(self) -> Option<&'static str> {
        match self {
            Qos::Guaranteed => None,
            Qos::Burstable => Some("burstable"),
            Qos::BestEffort => Some("besteffort"),
        }
    }
}

/// A container runtime, as the scheme of `status.containerStatuses[].containerID` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Runtime {
    /// `containerd://`.
    Containerd,
    /// `cri-o://`.
    CriO,
    /// `docker://` (dockershim, cri-dockerd).
    Docker,
}

impl FromStr for Runtime {
    type Err = KubepodsError;

    fn from_str(s: &str) -> Result<Self, KubepodsError> {
        match s {
            "containerd" => Ok(Runtime::Containerd),
            "cri-o" | "crio" => Ok(Runtime::CriO),
            "docker" => Ok(Runtime::Docker),
            other => Err(KubepodsError::UnknownRuntime(other.to_string())),
        }
    }
}

fn check_uid(uid: &str) -> Result<(), KubepodsError> {
    let ok = !uid.is_empty()
        && uid.len() <= 64
        && uid.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-');
    ok.then_some(())
        .ok_or_else(|| KubepodsError::BadUid(uid.to_string()))
}

fn check_id(id: &str) -> Result<(), KubepodsError> {
    let ok = !id.is_empty() && id.len() <= 128 && id.bytes().all(|b| b.is_ascii_hexdigit());
    ok.then_some(())
        .ok_or_else(|| KubepodsError::BadContainerId(id.to_string()))
}

/// The pod's cgroup path below the kubelet's cgroup root, e.g.
/// `kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1234_5678.slice`
/// (no leading `/`).
pub fn pod_path(driver: Driver, qos: Qos, uid: &str) -> Result<String, KubepodsError> {
    check_uid(uid)?;
    Ok(match driver {
        Driver::Cgroupfs => match qos.cgroupfs_dir() {
            Some(q) => format!("kubepods/{q}/pod{uid}"),
            None => format!("kubepods/pod{uid}"),
        },
        Driver::Systemd => {
            let escaped = uid.replace('-', "_");
            match qos.cgroupfs_dir() {
                Some(q) => {
                    format!("kubepods.slice/kubepods-{q}.slice/kubepods-{q}-pod{escaped}.slice")
                }
                None => format!("kubepods.slice/kubepods-pod{escaped}.slice"),
            }
        }
    })
}

/// The names a container's cgroup may have under its pod's, the runtime's convention
/// first. cgroupfs: containerd and docker use the bare ID, CRI-O `crio-<id>` (some
/// integrations put the bare ID, tried second). systemd: `<prefix>-<id>.scope`.
pub fn container_names(
    driver: Driver,
    runtime: Runtime,
    id: &str,
) -> Result<Vec<String>, KubepodsError> {
    check_id(id)?;
    Ok(match (driver, runtime) {
        (Driver::Cgroupfs, Runtime::Containerd | Runtime::Docker) => vec![id.to_string()],
        (Driver::Cgroupfs, Runtime::CriO) => vec![format!("crio-{id}"), id.to_string()],
        (Driver::Systemd, Runtime::Containerd) => vec![format!("cri-containerd-{id}.scope")],
        (Driver::Systemd, Runtime::CriO) => vec![format!("crio-{id}.scope")],
        (Driver::Systemd, Runtime::Docker) => vec![format!("docker-{id}.scope")],
    })
}

/// The container's cgroup path below the kubelet's cgroup root, by the runtime's
/// convention.
pub fn container_path(
    driver: Driver,
    qos: Qos,
    uid: &str,
    runtime: Runtime,
    id: &str,
) -> Result<String, KubepodsError> {
    let pod = pod_path(driver, qos, uid)?;
    let names = container_names(driver, runtime, id)?;
    Ok(format!("{pod}/{}", names[0]))
}

/// A kubelet cgroup root (`--cgroup-root`, default `/`) as a clean prefix: `""` or
/// `a/b` (no leading or trailing `/`).
fn clean_root(root: &str) -> Result<String, KubepodsError> {
    let bad = || KubepodsError::BadRoot(root.to_string());
    if !root.starts_with('/') {
        return Err(bad());
    }
    let parts: Vec<&str> = root.split('/').filter(|p| !p.is_empty()).collect();
    if parts.iter().any(|p| *p == "." || *p == "..") {
        return Err(bad());
    }
    Ok(parts.join("/"))
}

/// One container's cgroup as found on the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FoundContainer {
    /// The cgroup path from the hierarchy's root, with a leading `/` (as
    /// `/proc/PID/cgroup` and [`Cgroups::processes_at_cgroup_path`] write it).
    pub path: String,
}

/// The kubepods tree on one host: its driver and where it lies.
#[derive(Debug, Clone)]
pub struct Kubepods {
    cg: Cgroups,
    driver: Driver,
    root: String,
}

impl Kubepods {
    /// The tree under the kubelet's `cgroup_root` (`/` by default) in the hierarchies of
    /// `cg`, laid out by `driver`, or (`None`, `auto`) by the driver whose tree exists.
    pub fn new(
        cg: Cgroups,
        driver: Option<Driver>,
        cgroup_root: &str,
    ) -> Result<Self, KubepodsError> {
        let root = clean_root(cgroup_root)?;
        let driver = match driver {
            Some(d) => d,
            None => detect(&cg, &root)?,
        };
        Ok(Self { cg, driver, root })
    }

    /// The driver in use.
    pub fn driver(&self) -> Driver {
        self.driver
    }

    /// The hierarchies.
    pub fn cgroups(&self) -> &Cgroups {
        &self.cg
    }

    fn under_root(&self, rel: &str) -> String {
        if self.root.is_empty() {
            format!("/{rel}")
        } else {
            format!("/{}/{rel}", self.root)
        }
    }

    /// The pod's cgroup path (with a leading `/`), whether or not it exists.
    pub fn pod_path(&self, qos: Qos, uid: &str) -> Result<String, KubepodsError> {
        Ok(self.under_root(&pod_path(self.driver, qos, uid)?))
    }

    /// Every path the container's cgroup may have (its runtime's names under the pod's
    /// cgroup, the convention first), whether or not it exists yet.
    pub fn container_paths(
        &self,
        qos: Qos,
        uid: &str,
        runtime: Runtime,
        id: &str,
    ) -> Result<Vec<String>, KubepodsError> {
        let pod = self.pod_path(qos, uid)?;
        Ok(container_names(self.driver, runtime, id)?
            .into_iter()
            .map(|n| format!("{pod}/{n}"))
            .collect())
    }

    /// The pod's cgroup directory in the hierarchy of `controller`, if it exists.
    pub fn pod_dir(
        &self,
        controller: Controller,
        qos: Qos,
        uid: &str,
    ) -> Result<Option<PathBuf>, KubepodsError> {
        Ok(self.cg.dir_at(controller, &self.pod_path(qos, uid)?))
    }

    /// The container's cgroup: the first of its runtime's names that exists under the
    /// pod's cgroup; `None` while none does (not started yet, or already gone).
    pub fn container(
        &self,
        qos: Qos,
        uid: &str,
        runtime: Runtime,
        id: &str,
    ) -> Result<Option<FoundContainer>, KubepodsError> {
        for path in self.container_paths(qos, uid, runtime, id)? {
            if exists(&self.cg, &path) {
                return Ok(Some(FoundContainer { path }));
            }
        }
        Ok(None)
    }
}

/// Whether cgroup path `path` exists in the cpuset or cpu hierarchy.
fn exists(cg: &Cgroups, path: &str) -> bool {
    Controller::ALL
        .iter()
        .any(|c| cg.dir_at(*c, path).is_some())
}

/// The driver whose tree exists under `root` (`auto`).
fn detect(cg: &Cgroups, root: &str) -> Result<Driver, KubepodsError> {
    if !Controller::ALL.iter().any(|c| cg.mount(*c).is_some()) {
        return Err(KubepodsError::NoHierarchy);
    }
    let path = |d: Driver| {
        if root.is_empty() {
            format!("/{}", d.root_name())
        } else {
            format!("/{root}/{}", d.root_name())
        }
    };
    let (fs, sd) = (path(Driver::Cgroupfs), path(Driver::Systemd));
    match (exists(cg, &fs), exists(cg, &sd)) {
        (true, false) => Ok(Driver::Cgroupfs),
        (false, true) => Ok(Driver::Systemd),
        (true, true) => Err(KubepodsError::BothTrees {
            cgroupfs: fs,
            systemd: sd,
        }),
        (false, false) => Err(KubepodsError::NoTree {
            hierarchy: Controller::ALL
                .iter()
                .find_map(|c| cg.mount(*c))
                .map(|m| m.display().to_string())
                .unwrap_or_default(),
            looked: vec![fs, sd],
        }),
    }
}

/// The kubelet's CPU manager checkpoint (`cpu_manager_state`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CpuManagerState {
    /// `none` or `static`.
    pub policy_name: String,
    /// The shared pool.
    pub default_cpu_set: CpuList,
    /// Pod UID → container name → CPUs given to it alone.
    pub entries: BTreeMap<String, BTreeMap<String, CpuList>>,
}

/// The checkpoint as the kubelet writes it (unknown fields, such as `checksum`, ignored).
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct StateFile {
    policy_name: String,
    #[serde(default)]
    default_cpu_set: String,
    #[serde(default)]
    entries: Option<BTreeMap<String, BTreeMap<String, String>>>,
}

/// The checkpoint's file name in the kubelet's directory.
pub const CPU_MANAGER_STATE: &str = "cpu_manager_state";

impl CpuManagerState {
    /// Parses checkpoint text; `path` names it in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Self, KubepodsError> {
        let bad = |reason: String| KubepodsError::BadState {
            path: path.to_path_buf(),
            reason,
        };
        let f: StateFile = serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
        let cpus = |what: &str, t: &str| {
            t.parse::<CpuList>()
                .map_err(|e| bad(format!("{what}: {e}")))
        };
        let default_cpu_set = cpus("defaultCpuSet", &f.default_cpu_set)?;
        let mut entries = BTreeMap::new();
        for (uid, containers) in f.entries.unwrap_or_default() {
            let mut out = BTreeMap::new();
            for (name, set) in containers {
                out.insert(name.clone(), cpus(&format!("entries.{uid}.{name}"), &set)?);
            }
            entries.insert(uid, out);
        }
        Ok(Self {
            policy_name: f.policy_name,
            default_cpu_set,
            entries,
        })
    }

    /// Reads `<kubelet_dir>/cpu_manager_state`; `None` when the kubelet has not written one
    /// (its CPU manager never ran here), which means no CPU is exclusive.
    pub fn read(kubelet_dir: &Path) -> Result<Option<Self>, KubepodsError> {
        let path = kubelet_dir.join(CPU_MANAGER_STATE);
        match std::fs::read_to_string(&path) {
            Ok(text) => Self::parse(&text, &path).map(Some),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(IoError::new("reading", &path, e).into()),
        }
    }

    /// The CPUs container `container` of pod `uid` has to itself, if any.
    pub fn exclusive(&self, uid: &str, container: &str) -> Option<&CpuList> {
        self.entries
            .get(uid)?
            .get(container)
            .filter(|c| !c.0.is_empty())
    }

    /// Every CPU some container has to itself.
    pub fn exclusive_cpus(&self) -> CpuList {
        let mut all: Vec<u32> = self
            .entries
            .values()
            .flat_map(BTreeMap::values)
            .flat_map(|c| c.0.iter().copied())
            .collect();
        all.sort_unstable();
        all.dedup();
        CpuList(all)
    }
}

#[cfg(feature = "testutils")]
pub mod testing;
#[cfg(test)]
mod tests;
