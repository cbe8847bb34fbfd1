//! A kubepods tree on this machine's real cgroups (behind `testutils`), made the way the
//! kubelet and the runtime make one, under a test cgroup root so that it never meets a real
//! kubelet's: `/<root>/kubepods/burstable/pod<uid>/<id>` in the cpuset and cpu hierarchies
//! (v1: every level gets its parent's `cpuset.cpus` and `cpuset.mems`, as the kubelet
//! gives them). Dropping it moves whatever is left in it to the hierarchy roots and removes
//! it, also when the test failed.

use std::path::{Path, PathBuf};

use crate::cgroup::{testing, Cgroups, Controller, Version};

/// The test tree: `/<root>` in the cpuset and cpu hierarchies.
#[derive(Debug)]
pub struct KubepodsTree {
    version: Version,
    roots: Vec<(Controller, PathBuf)>,
}

/// One container's cgroup in a [`KubepodsTree`].
#[derive(Debug, Clone)]
pub struct TreeCgroup {
    dirs: Vec<(Controller, PathBuf)>,
}

impl KubepodsTree {
    /// Creates `/<root>` (one an aborted run left is reused).
    pub fn create(cg: &Cgroups, root: &str) -> std::io::Result<Self> {
        let mut tree = Self {
            version: cg.version,
            roots: vec![],
        };
        for c in Controller::ALL {
            let Some(mount) = cg.mount(c) else { continue };
            let dir = mount.join(root);
            if tree.roots.iter().any(|(_, d)| *d == dir) {
                continue;
            }
            tree.make(c, &dir)?;
            tree.roots.push((c, dir));
        }
        Ok(tree)
    }

    fn make(&self, c: Controller, dir: &Path) -> std::io::Result<()> {
        if !dir.exists() {
            std::fs::create_dir(dir)?;
        }
        if self.version == Version::V1 && c == Controller::Cpuset {
            let parent = dir.parent().unwrap_or(dir);
            for file in ["cpuset.mems", "cpuset.cpus"] {
                let mine = std::fs::read_to_string(dir.join(file))?;
                if mine.trim().is_empty() {
                    let theirs = std::fs::read_to_string(parent.join(file))?;
                    std::fs::write(dir.join(file), theirs.trim())?;
                }
            }
        }
        Ok(())
    }

    /// Creates `<pod>/<name>` below the root (`pod` relative, e.g.
    /// `kubepods/burstable/pod<uid>`), every level as the kubelet makes it.
    pub fn container(&self, pod: &str, name: &str) -> std::io::Result<TreeCgroup> {
        let mut out = TreeCgroup { dirs: vec![] };
        for (c, root) in &self.roots {
            let mut dir = root.clone();
            for part in pod.split('/').chain([name]).filter(|p| !p.is_empty()) {
                dir.push(part);
                self.make(*c, &dir)?;
            }
            out.dirs.push((*c, dir));
        }
        Ok(out)
    }
}

impl TreeCgroup {
    /// Puts process `pid` in it (every hierarchy), as the runtime starts a container.
    pub fn add(&self, pid: u32) -> std::io::Result<()> {
        for (_, dir) in &self.dirs {
            std::fs::write(dir.join("cgroup.procs"), pid.to_string())?;
        }
        Ok(())
    }

    /// Its directory in the hierarchy of `c`.
    pub fn dir(&self, c: Controller) -> Option<&Path> {
        self.dirs
            .iter()
            .find(|(k, _)| *k == c)
            .map(|(_, d)| d.as_path())
    }
}

impl Drop for KubepodsTree {
    fn drop(&mut self) {
        for (_, dir) in self.roots.iter().rev() {
            if let Err(e) = testing::remove_tree(dir) {
                eprintln!("could not remove test cgroup {}: {e}", dir.display());
            }
        }
    }
}
