//! Helpers for tests on this machine's real cgroups (behind `testutils`): the gate that
//! decides whether such a test runs, and a guard for the "owner" cgroups a test creates in
//! the place of a container runtime or systemd.
//!
//! A real-kernel test that cannot run goes through `cohabit_testkit`'s gate (`Need::Root`):
//! it prints and records why it skipped, and fails where `COHABIT_REQUIRE_ROOT_TESTS=1`
//! (CI sets it: it runs as root on a host with writable cgroups), so a green run means the
//! kernel path was exercised.

use std::path::{Path, PathBuf};
use std::time::Duration;

use cohabit_testkit::{skip, Need};

use super::{Cgroups, Controller, Version};
use crate::HostPaths;

/// This machine's cgroups when the cpuset and cpu controllers can both be written (root,
/// a writable hierarchy); otherwise `None`, after a `Need::Root` skip.
pub fn real_cgroups() -> Option<Cgroups> {
    let cg = match Cgroups::detect(&HostPaths::standard()) {
        Ok(Some(cg)) => cg,
        other => {
            skip(
                Need::Root,
                &format!("no cgroup hierarchy found ({other:?})"),
            );
            return None;
        }
    };
    let writable = cg.writable_controllers();
    let both = ["cpuset", "cpu"]
        .iter()
        .all(|c| writable.iter().any(|w| w == c));
    if !both {
        skip(Need::Root, &format!(
            "cpuset and cpu are not both writable here (writable: {writable:?}; run as root on cgroup v1, or v2 with both controllers)"
        ));
        return None;
    }
    Some(cg)
}

/// A cgroup made the way a workload's owner makes one (a container runtime, systemd):
/// `/<name>` in the cpuset and cpu hierarchies (v1: with `cpuset.cpus` and `cpuset.mems`
/// copied from the root; v2: one directory, which needs the root to delegate both
/// controllers). Dropping it moves whatever is left in it to the hierarchy roots and
/// removes it, also when the test failed.
#[derive(Debug)]
pub struct OwnerCgroup {
    name: String,
    dirs: Vec<(Controller, PathBuf)>,
}

impl OwnerCgroup {
    /// Creates `/<name>` (an existing one from an aborted run is reused).
    pub fn create(cg: &Cgroups, name: &str) -> std::io::Result<Self> {
        let mut owner = Self {
            name: name.to_string(),
            dirs: vec![],
        };
        for c in Controller::ALL {
            let Some(mount) = cg.mount(c) else { continue };
            let dir = mount.join(name);
            if owner.dirs.iter().all(|(_, d)| d != &dir) && !dir.exists() {
                std::fs::create_dir(&dir)?;
            }
            if cg.version == Version::V1 && c == Controller::Cpuset {
                for file in ["cpuset.mems", "cpuset.cpus"] {
                    let root = std::fs::read_to_string(mount.join(file))?;
                    std::fs::write(dir.join(file), root.trim())?;
                }
            }
            owner.dirs.push((c, dir));
        }
        Ok(owner)
    }

    /// Its cgroup path, as a `cgroup` matcher names it (`/<name>`).
    pub fn path(&self) -> String {
        format!("/{}", self.name)
    }

    /// Its directory in the hierarchy of `c`.
    pub fn dir(&self, c: Controller) -> &Path {
        self.dirs
            .iter()
            .find(|(k, _)| *k == c)
            .map(|(_, d)| d.as_path())
            .expect("a hierarchy for each controller")
    }

    /// Puts process `pid` in it (every hierarchy).
    pub fn add(&self, pid: u32) -> std::io::Result<()> {
        for (_, dir) in &self.dirs {
            std::fs::write(dir.join("cgroup.procs"), pid.to_string())?;
        }
        Ok(())
    }
}

impl Drop for OwnerCgroup {
    fn drop(&mut self) {
        for (_, dir) in self.dirs.iter().rev() {
            if let Err(e) = remove_tree(dir) {
                eprintln!("could not remove test cgroup {}: {e}", dir.display());
            }
        }
    }
}

/// Removes the cgroup `dir` and every group below it, moving their processes to the root
/// of the hierarchy first (a few tries: a process that just exited lingers for a moment).
pub fn remove_tree(dir: &Path) -> std::io::Result<()> {
    if !dir.exists() {
        return Ok(());
    }
    let mut root = dir.to_path_buf();
    while root
        .parent()
        .is_some_and(|p| p.join("cgroup.procs").exists())
    {
        root = root.parent().map(Path::to_path_buf).unwrap_or(root);
    }
    let mut last = Ok(());
    for _ in 0..50 {
        last = remove_below(dir, &root);
        if last.is_ok() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    last
}

fn remove_below(dir: &Path, root: &Path) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        if entry.file_type()?.is_dir() {
            remove_below(&entry.path(), root)?;
        }
    }
    let procs = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
    for pid in procs.lines().map(str::trim).filter(|l| !l.is_empty()) {
        // A process that exited meanwhile cannot be moved; rmdir tells whether it matters.
        let _ = std::fs::write(root.join("cgroup.procs"), pid);
    }
    match std::fs::remove_dir(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}
