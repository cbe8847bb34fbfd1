//! The benchmark's own cgroups: `cohabit-realbench/<group>` in the cpu and cpuset
//! hierarchies (cgroup v1) or in the unified hierarchy (v2). Services and antagonists start
//! inside them (so every process the benchmark starts can be found and killed), the `cap`
//! and `idle` policies write their settings there, and everything is removed at the end.
//!
//! This is deliberately not cohabit's cgroup code: the benchmark judges cohabit and must
//! not share its mistakes.

use std::path::{Path, PathBuf};

use crate::Error;

/// Name of the benchmark's parent group in every hierarchy.
pub const PARENT: &str = "cohabit-realbench";

/// Where the hierarchies the benchmark uses are mounted.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub enum Layout {
    /// cgroup v1: the cpu (quota, shares) and cpuset hierarchies.
    V1 {
        /// Mount of the hierarchy with the cpu controller.
        cpu: PathBuf,
        /// Mount of the hierarchy with the cpuset controller.
        cpuset: PathBuf,
    },
    /// cgroup v2: the unified hierarchy.
    V2 {
        /// Its mount.
        root: PathBuf,
    },
}

/// Every cgroup (v1 or v2) mount in `/proc/self/mountinfo` text.
pub fn all_mounts(mountinfo: &str) -> Vec<PathBuf> {
    mountinfo
        .lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let fstype = right.split_whitespace().next()?;
            let mount = left.split_whitespace().nth(4)?;
            matches!(fstype, "cgroup" | "cgroup2").then(|| PathBuf::from(unescape(mount)))
        })
        .collect()
}

/// Finds the cpu and cpuset hierarchies in `/proc/self/mountinfo` text.
pub fn find_layout(mountinfo: &str) -> Option<Layout> {
    let mut cpu = None;
    let mut cpuset = None;
    let mut unified = None;
    for line in mountinfo.lines() {
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let left: Vec<&str> = left.split_whitespace().collect();
        let right: Vec<&str> = right.split_whitespace().collect();
        let (Some(root), Some(mount), Some(fstype)) = (left.get(3), left.get(4), right.first())
        else {
            continue;
        };
        if *root != "/" {
            continue;
        }
        let mount = PathBuf::from(unescape(mount));
        match *fstype {
            "cgroup" => {
                let opts = right.get(2).copied().unwrap_or_default();
                for o in opts.split(',') {
                    match o {
                        "cpu" => cpu = Some(mount.clone()),
                        "cpuset" => cpuset = Some(mount.clone()),
                        _ => {}
                    }
                }
            }
            "cgroup2" => unified = Some(mount),
            _ => {}
        }
    }
    match (cpu, cpuset, unified) {
        (Some(cpu), Some(cpuset), _) => Some(Layout::V1 { cpu, cpuset }),
        (_, _, Some(root)) => Some(Layout::V2 { root }),
        _ => None,
    }
}

/// mountinfo escapes spaces and a few other bytes as `\ooo`.
fn unescape(s: &str) -> String {
    let mut out = String::new();
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\\' {
            let oct: String = chars.clone().take(3).collect();
            if let Ok(v) = u8::from_str_radix(&oct, 8) {
                out.push(char::from(v));
                for _ in 0..3 {
                    chars.next();
                }
                continue;
            }
        }
        out.push(c);
    }
    out
}

/// The benchmark's cgroup tree.
#[derive(Debug, Clone)]
pub struct Tree {
    layout: Layout,
    mounts: Vec<PathBuf>,
}

fn write(path: &Path, value: &str) -> Result<(), Error> {
    std::fs::write(path, value).map_err(crate::io_err("writing", path))
}

fn read(path: &Path) -> Result<String, Error> {
    std::fs::read_to_string(path).map_err(crate::io_err("reading", path))
}

impl Tree {
    /// The tree on this host (`proc` is normally `/proc`).
    pub fn detect(proc: &Path) -> Result<Self, Error> {
        let mountinfo = read(&proc.join("self/mountinfo"))?;
        let layout = find_layout(&mountinfo).ok_or_else(|| {
            Error::Host("a cgroup v1 cpu and cpuset hierarchy or a cgroup v2 mount".into())
        })?;
        Ok(Self {
            layout,
            mounts: all_mounts(&mountinfo),
        })
    }

    /// Every cgroup mount of the host (cohabit creates its groups in all of them).
    pub fn mounts(&self) -> &[PathBuf] {
        &self.mounts
    }

    /// The layout found.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// `"v1"` or `"v2"`.
    pub fn version(&self) -> &'static str {
        match self.layout {
            Layout::V1 { .. } => "v1",
            Layout::V2 { .. } => "v2",
        }
    }

    fn parents(&self) -> Vec<PathBuf> {
        match &self.layout {
            Layout::V1 { cpu, cpuset } if cpu == cpuset => vec![cpu.join(PARENT)],
            Layout::V1 { cpu, cpuset } => vec![cpu.join(PARENT), cpuset.join(PARENT)],
            Layout::V2 { root } => vec![root.join(PARENT)],
        }
    }

    /// The directories of `group` (one per hierarchy).
    pub fn dirs(&self, group: &str) -> Vec<PathBuf> {
        self.parents().into_iter().map(|p| p.join(group)).collect()
    }

    fn cpuset_dir(&self, group: &str) -> PathBuf {
        match &self.layout {
            Layout::V1 { cpuset, .. } => cpuset.join(PARENT).join(group),
            Layout::V2 { root } => root.join(PARENT).join(group),
        }
    }

    fn cpu_dir(&self, group: &str) -> PathBuf {
        match &self.layout {
            Layout::V1 { cpu, .. } => cpu.join(PARENT).join(group),
            Layout::V2 { root } => root.join(PARENT).join(group),
        }
    }

    /// Whether the parent exists in any hierarchy (a run in progress, or one that was killed).
    pub fn parent_exists(&self) -> bool {
        self.parents().iter().any(|p| p.exists())
    }

    /// Creates the parent group, ready for children with the cpu and cpuset controllers.
    pub fn create_parent(&self) -> Result<(), Error> {
        for p in self.parents() {
            std::fs::create_dir_all(&p).map_err(crate::io_err("creating cgroup", &p))?;
        }
        match &self.layout {
            Layout::V1 { cpuset, .. } => inherit_cpuset(&cpuset.join(PARENT)),
            Layout::V2 { root } => {
                let want = ["cpu", "cpuset"];
                let have = read(&root.join("cgroup.subtree_control")).unwrap_or_default();
                for c in want {
                    if !have.split_whitespace().any(|h| h == c) {
                        return Err(Error::Host(format!(
                            "the {c} controller enabled in {}/cgroup.subtree_control (echo +{c} > …)",
                            root.display()
                        )));
                    }
                }
                write(
                    &root.join(PARENT).join("cgroup.subtree_control"),
                    "+cpu +cpuset",
                )
            }
        }
    }

    /// Creates `group` under the parent.
    pub fn create(&self, group: &str) -> Result<(), Error> {
        for d in self.dirs(group) {
            std::fs::create_dir_all(&d).map_err(crate::io_err("creating cgroup", &d))?;
        }
        if let Layout::V1 { .. } = self.layout {
            inherit_cpuset(&self.cpuset_dir(group))?;
        }
        Ok(())
    }

    /// A shell command that moves the shell itself into `group` in every hierarchy (used
    /// before `exec`, so the program starts inside the group and so do its children).
    pub fn join_command(&self, group: &str) -> String {
        self.dirs(group)
            .iter()
            .map(|d| format!("echo $$ > '{}'", d.join("cgroup.procs").display()))
            .collect::<Vec<_>>()
            .join(" && ")
    }

    /// Restricts `group` to `cpus` (a cpuset list such as `1` or `2-3`).
    pub fn set_cpus(&self, group: &str, cpus: &str) -> Result<(), Error> {
        write(&self.cpuset_dir(group).join("cpuset.cpus"), cpus)
    }

    /// Gives `group` the lowest CPU weight (v1 `cpu.shares` 2, v2 `cpu.weight` 1): it runs
    /// only on what the others leave.
    pub fn set_lowest_weight(&self, group: &str) -> Result<(), Error> {
        match self.layout {
            Layout::V1 { .. } => write(&self.cpu_dir(group).join("cpu.shares"), "2"),
            Layout::V2 { .. } => write(&self.cpu_dir(group).join("cpu.weight"), "1"),
        }
    }

    /// Puts `group` in the kernel's idle scheduling class (`cpu.idle` = 1, in the cpu
    /// hierarchy on v1, the unified one on v2): its tasks run only when a CPU has nothing
    /// else to run. Linux 5.15 added the file; without it this is an error naming it. The
    /// kernel then refuses writes of `cpu.shares`/`cpu.weight` to the group (EINVAL), so
    /// this is not combined with [`Tree::set_lowest_weight`].
    pub fn set_idle(&self, group: &str) -> Result<(), Error> {
        let path = self.cpu_dir(group).join("cpu.idle");
        if !path.exists() {
            return Err(Error::Host(format!(
                "{} for the idle policy: without it the kernel has no idle scheduling class for cgroups (Linux 5.15 or later)",
                path.display()
            )));
        }
        write(&path, "1")
    }

    /// Caps `group` at `cpus` CPUs' worth of time per 100 ms period.
    pub fn set_quota(&self, group: &str, cpus: f64) -> Result<(), Error> {
        let period = 100_000u64;
        let quota = crate::whole(cpus * period as f64).max(1000);
        match self.layout {
            Layout::V1 { .. } => {
                write(
                    &self.cpu_dir(group).join("cpu.cfs_period_us"),
                    &period.to_string(),
                )?;
                write(
                    &self.cpu_dir(group).join("cpu.cfs_quota_us"),
                    &quota.to_string(),
                )
            }
            Layout::V2 { .. } => write(
                &self.cpu_dir(group).join("cpu.max"),
                &format!("{quota} {period}"),
            ),
        }
    }

    /// Pids in `group`, in any hierarchy.
    pub fn procs(&self, group: &str) -> Vec<u32> {
        let mut out: Vec<u32> = self
            .dirs(group)
            .iter()
            .filter_map(|d| std::fs::read_to_string(d.join("cgroup.procs")).ok())
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

    /// Every pid anywhere under the parent.
    pub fn all_procs(&self) -> Vec<u32> {
        let mut out = Vec::new();
        for p in self.parents() {
            collect_procs(&p, &mut out);
        }
        out.sort_unstable();
        out.dedup();
        out
    }

    /// The groups under the parent (any hierarchy).
    pub fn groups(&self) -> Vec<String> {
        let mut out: Vec<String> = self
            .parents()
            .iter()
            .filter_map(|p| std::fs::read_dir(p).ok())
            .flat_map(|it| {
                it.filter_map(Result::ok)
                    .filter(|e| e.path().is_dir())
                    .filter_map(|e| e.file_name().to_str().map(str::to_string))
                    .collect::<Vec<_>>()
            })
            .collect();
        out.sort();
        out.dedup();
        out
    }

    /// Removes `group` (it must be empty); absent is fine.
    pub fn remove(&self, group: &str) -> Result<(), Error> {
        for d in self.dirs(group) {
            remove_dir(&d)?;
        }
        Ok(())
    }

    /// Removes the parent and any group left under it (all must be empty).
    pub fn remove_all(&self) -> Result<(), Error> {
        for g in self.groups() {
            self.remove(&g)?;
        }
        for p in self.parents() {
            remove_dir(&p)?;
        }
        Ok(())
    }
}

fn remove_dir(d: &Path) -> Result<(), Error> {
    match std::fs::remove_dir(d) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::Io {
            what: "removing cgroup",
            path: d.to_path_buf(),
            source: e,
        }),
    }
}

fn collect_procs(dir: &Path, out: &mut Vec<u32>) {
    if let Ok(t) = std::fs::read_to_string(dir.join("cgroup.procs")) {
        out.extend(t.lines().filter_map(|l| l.trim().parse::<u32>().ok()));
    }
    if let Ok(it) = std::fs::read_dir(dir) {
        for e in it.filter_map(Result::ok) {
            if e.path().is_dir() {
                collect_procs(&e.path(), out);
            }
        }
    }
}

/// A new v1 cpuset group starts with empty `cpus` and `mems`; copy its parent's.
fn inherit_cpuset(dir: &Path) -> Result<(), Error> {
    let parent = dir.parent().unwrap_or(dir);
    for f in ["cpuset.cpus", "cpuset.mems"] {
        let mine = read(&dir.join(f))?;
        if mine.trim().is_empty() {
            let theirs = read(&parent.join(f))?;
            write(&dir.join(f), theirs.trim())?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const V1: &str = "\
30 23 0:26 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755
35 30 0:31 / /sys/fs/cgroup/cpu,cpuacct rw,relatime shared:12 - cgroup cgroup rw,cpu,cpuacct
36 30 0:32 / /sys/fs/cgroup/cpuset rw,relatime shared:13 - cgroup cgroup rw,cpuset
37 30 0:33 /nested /sys/fs/cgroup/other rw - cgroup cgroup rw,cpuset
";
    const V2: &str =
        "29 23 0:26 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n";

    #[test]
    fn v1_needs_cpu_and_cpuset_mounted_at_their_root() {
        assert_eq!(
            find_layout(V1),
            Some(Layout::V1 {
                cpu: "/sys/fs/cgroup/cpu,cpuacct".into(),
                cpuset: "/sys/fs/cgroup/cpuset".into()
            })
        );
        assert_eq!(
            find_layout(V2),
            Some(Layout::V2 {
                root: "/sys/fs/cgroup".into()
            })
        );
        assert_eq!(find_layout("garbage\n"), None);
        assert_eq!(
            unescape("/mnt/with\\040space"),
            "/mnt/with space".to_string()
        );
    }

    #[test]
    fn the_join_command_writes_the_shell_into_every_hierarchy() {
        let t = Tree {
            layout: find_layout(V1).unwrap(),
            mounts: all_mounts(V1),
        };
        assert_eq!(t.mounts().len(), 3);
        let c = t.join_command("svc-memcached");
        assert_eq!(
            c,
            "echo $$ > '/sys/fs/cgroup/cpu,cpuacct/cohabit-realbench/svc-memcached/cgroup.procs' && echo $$ > '/sys/fs/cgroup/cpuset/cohabit-realbench/svc-memcached/cgroup.procs'"
        );
        assert_eq!(t.version(), "v1");
    }

    /// A tree over `layout` with `group`'s directories made and, if `idle`, a `cpu.idle`
    /// reading 0 in every one (as the kernel has it in the cpu hierarchy only; the cpuset
    /// one gets it here too, to show it is left alone).
    fn fake(layout: Layout, group: &str, idle: bool) -> Tree {
        let t = Tree {
            layout,
            mounts: vec![],
        };
        for d in t.dirs(group) {
            std::fs::create_dir_all(&d).unwrap();
            if idle {
                std::fs::write(d.join("cpu.idle"), "0\n").unwrap();
            }
        }
        t
    }

    fn idle_of(dir: &Path) -> String {
        std::fs::read_to_string(dir.join("cpu.idle")).unwrap()
    }

    #[test]
    fn the_idle_class_is_written_in_the_cpu_hierarchy() {
        let tmp = tempfile::tempdir().unwrap();
        let (cpu, cpuset) = (tmp.path().join("cpu,cpuacct"), tmp.path().join("cpuset"));
        let t = fake(
            Layout::V1 {
                cpu: cpu.clone(),
                cpuset: cpuset.clone(),
            },
            "batch",
            true,
        );
        t.set_idle("batch").unwrap();
        assert_eq!(idle_of(&cpu.join(PARENT).join("batch")), "1");
        assert_eq!(idle_of(&cpuset.join(PARENT).join("batch")), "0\n");

        let tmp = tempfile::tempdir().unwrap();
        let t = fake(
            Layout::V2 {
                root: tmp.path().to_path_buf(),
            },
            "batch",
            true,
        );
        t.set_idle("batch").unwrap();
        assert_eq!(idle_of(&tmp.path().join(PARENT).join("batch")), "1");
    }

    #[test]
    fn a_kernel_without_the_idle_class_is_named() {
        let tmp = tempfile::tempdir().unwrap();
        let t = fake(
            Layout::V2 {
                root: tmp.path().to_path_buf(),
            },
            "batch",
            false,
        );
        let want = tmp.path().join(PARENT).join("batch").join("cpu.idle");
        let e = t.set_idle("batch").unwrap_err().to_string();
        assert!(e.contains(&want.display().to_string()), "{e}");
        assert!(e.contains("no idle scheduling class"), "{e}");
        assert!(e.contains("Linux 5.15"), "{e}");
        // Nothing was created in its place.
        assert!(!want.exists());
    }
}
