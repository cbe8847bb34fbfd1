//! A fake cgroup v2 tree for tests: directories and files in a `TempDir` plus a
//! [`KernelFs`] that refuses what the kernel refuses (the CI machine's cgroup v2 mount has no
//! controllers, so v2 is tested here; v1 is tested on the real tree).
//!
//! Like the kernel (`Documentation/admin-guide/cgroup-v2.rst`):
//! - a controller's files (`cpuset.*`, `cpu.*`, `memory.*`, `pids.*`) exist in a cgroup only
//!   when its parent has the controller in `cgroup.subtree_control` (writing one that does
//!   not exist fails with ENOENT); the root has none of `cpuset.cpus`, `cpu.max`,
//!   `cpu.weight`; `cgroup.controllers` lists what the parent delegates;
//! - `cgroup.subtree_control`: `+name`/`-name` tokens, all or nothing; an unknown name is
//!   EINVAL, a controller the cgroup is not offered is ENOENT, enabling any in a non-root
//!   cgroup that has processes is EBUSY (no internal process rule), disabling one a child
//!   still delegates is EBUSY; enabling creates the files in the children, disabling
//!   removes them;
//! - `cgroup.procs`: an unknown pid is ESRCH, a non-root cgroup with controllers enabled in
//!   its `cgroup.subtree_control` takes no process (EBUSY); a move leaves the old cgroup
//!   and rewrites the process's `/proc/PID/cgroup` (`0::/path`);
//! - `cpuset.cpus`: a list that does not parse, or CPUs the host lacks, is EINVAL; any other
//!   list is accepted (v2 does not require a subset of the parent's) and
//!   `cpuset.cpus.effective` becomes the requested CPUs the parent has, or all of the
//!   parent's when that is empty, recomputed down the subtree; `cpuset.mems` likewise with
//!   one memory node, 0;
//! - `cpu.weight`: not a number is EINVAL, outside 1..=10000 is ERANGE, and any write while
//!   `cpu.idle` is 1 is EINVAL; `cpu.idle` (the idle scheduling class, Linux 5.15; absent
//!   when built with [`FakeCgroup2Builder::idle_class`] false): only `0` or `1`, else
//!   EINVAL; setting it to 1 makes `cpu.weight` read 1, back to 0 resets it to the default
//!   100 (the weight before is lost, as in `sched_group_set_idle`); `cpu.max`: `max` or a
//!   quota of at least 1000 µs, then an optional period of 1000..=1000000 µs, else EINVAL;
//! - read-only files (`cgroup.controllers`, `*.effective`, `*.current`, `*.stat`) are
//!   EACCES; `mkdir` needs an existing parent cgroup (ENOENT) and a new name (EEXIST);
//!   `rmdir` of a cgroup with processes or child groups is EBUSY, of the root EBUSY.
//!
//! Unlike the kernel: there are no threads (`cgroup.threads`, threaded mode), cpuset
//! partitions, `cgroup.events` notifications, hotplug, delegation by file ownership or
//! cgroup namespaces; a process exists only once registered with
//! [`FakeCgroup2::add_process`] and never exits or forks; no file but the ones above is
//! validated; resource use is never accounted.

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use super::{Cgroups, CpuList};
use crate::kfs::{KernelFs, LockGuard, RealFs};
use crate::procfs::fake::FakeProcess;

/// Controllers in the order the kernel lists them.
const ORDER: [&str; 6] = ["cpuset", "cpu", "io", "memory", "hugetlb", "pids"];

/// Shape of the fake host.
#[derive(Debug, Clone)]
pub struct FakeCgroup2Builder {
    cpus: u32,
    controllers: Vec<String>,
    root_subtree: Vec<String>,
    idle_class: bool,
}

impl Default for FakeCgroup2Builder {
    fn default() -> Self {
        let all: Vec<String> = ["cpuset", "cpu", "io", "memory", "pids"]
            .iter()
            .map(|s| (*s).to_string())
            .collect();
        Self {
            cpus: 8,
            controllers: all.clone(),
            root_subtree: all,
            idle_class: true,
        }
    }
}

impl FakeCgroup2Builder {
    /// Online CPUs (0..n).
    pub fn cpus(mut self, n: u32) -> Self {
        self.cpus = n;
        self
    }

    /// Controllers the root offers (`cgroup.controllers`).
    pub fn controllers(mut self, c: &[&str]) -> Self {
        self.controllers = c.iter().map(|s| (*s).to_string()).collect();
        self
    }

    /// Controllers the root delegates to its children (`cgroup.subtree_control`, which
    /// systemd sets on a real host).
    pub fn root_subtree(mut self, c: &[&str]) -> Self {
        self.root_subtree = c.iter().map(|s| (*s).to_string()).collect();
        self
    }

    /// Whether the cpu controller has `cpu.idle` (Linux 5.15 and later; default true).
    pub fn idle_class(mut self, yes: bool) -> Self {
        self.idle_class = yes;
        self
    }

    /// Lays the tree out and returns the fake.
    pub fn build(self) -> io::Result<FakeCgroup2> {
        let dir = tempfile::tempdir()?;
        let root = dir.path().join("sys/fs/cgroup");
        std::fs::create_dir_all(&root)?;
        let all = CpuList((0..self.cpus).collect()).to_string();
        for (file, text) in [
            ("cgroup.controllers", ordered(&self.controllers)),
            ("cgroup.subtree_control", ordered(&self.root_subtree)),
            ("cgroup.procs", String::new()),
            ("cpuset.cpus.effective", all),
            ("cpuset.mems.effective", "0".into()),
            (
                "cpu.stat",
                "usage_usec 0\nuser_usec 0\nsystem_usec 0\n".into(),
            ),
        ] {
            std::fs::write(root.join(file), text)?;
        }
        // The host's online CPUs, as sysfs lists them (`[host] cpus` is checked against it).
        let cpu = dir.path().join("sys/devices/system/cpu");
        std::fs::create_dir_all(&cpu)?;
        std::fs::write(
            cpu.join("online"),
            CpuList((0..self.cpus).collect()).to_string(),
        )?;
        let proc_self = dir.path().join("proc/self");
        std::fs::create_dir_all(&proc_self)?;
        std::fs::write(
            proc_self.join("mountinfo"),
            format!(
                "35 25 0:30 / {} rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw\n",
                root.display()
            ),
        )?;
        Ok(FakeCgroup2 {
            dir: Arc::new(dir),
            root,
            cpus: (0..self.cpus).collect(),
            idle_class: self.idle_class,
            state: Arc::new(Mutex::new(State::default())),
        })
    }
}

#[derive(Debug, Default)]
struct State {
    /// Registered processes and their start times.
    processes: BTreeMap<u32, u64>,
    /// Every write the fake accepted, in order.
    writes: Vec<(PathBuf, String)>,
}

/// A fake cgroup v2 mount (see the module docs for how it differs from the kernel).
#[derive(Debug, Clone)]
pub struct FakeCgroup2 {
    dir: Arc<tempfile::TempDir>,
    root: PathBuf,
    cpus: Vec<u32>,
    idle_class: bool,
    state: Arc<Mutex<State>>,
}

fn err(code: i32) -> io::Error {
    io::Error::from_raw_os_error(code)
}

fn ordered(names: &[String]) -> String {
    ORDER
        .iter()
        .filter(|c| names.iter().any(|n| n == *c))
        .copied()
        .collect::<Vec<_>>()
        .join(" ")
}

fn words(text: &str) -> Vec<String> {
    text.split_whitespace().map(str::to_string).collect()
}

/// The files a controller gives a non-root cgroup, with their initial content.
fn files_of(controller: &str) -> &'static [(&'static str, &'static str)] {
    match controller {
        "cpuset" => &[
            ("cpuset.cpus", ""),
            ("cpuset.cpus.effective", ""),
            ("cpuset.mems", ""),
            ("cpuset.mems.effective", "0"),
            ("cpuset.cpus.partition", "member"),
        ],
        "cpu" => &[
            ("cpu.max", "max 100000"),
            ("cpu.weight", "100"),
            ("cpu.weight.nice", "0"),
            ("cpu.idle", "0"),
            ("cpu.stat", "usage_usec 0\nuser_usec 0\nsystem_usec 0"),
        ],
        "io" => &[("io.max", ""), ("io.stat", "")],
        "memory" => &[("memory.max", "max"), ("memory.current", "0")],
        "pids" => &[("pids.max", "max"), ("pids.current", "0")],
        _ => &[],
    }
}

fn read_only(file: &str) -> bool {
    file == "cgroup.controllers"
        || file == "cgroup.events"
        || file.ends_with(".effective")
        || file.ends_with(".current")
        || file.ends_with(".stat")
}

impl FakeCgroup2 {
    /// A builder: 8 CPUs, the root offering and delegating cpuset, cpu, io, memory, pids.
    pub fn builder() -> FakeCgroup2Builder {
        FakeCgroup2Builder::default()
    }

    /// The fixture root (holds `proc/` and `sys/fs/cgroup`).
    pub fn base(&self) -> &Path {
        self.dir.path()
    }

    /// The cgroup2 mount.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Host paths pointing at this fixture.
    pub fn paths(&self) -> crate::HostPaths {
        crate::HostPaths::under(self.base())
    }

    /// The hierarchy as cohabit finds it, every file operation going through this fake.
    pub fn cgroups(&self) -> io::Result<Cgroups> {
        Cgroups::detect_with(&self.paths(), Arc::new(self.clone()))
            .map_err(|e| io::Error::other(e.to_string()))?
            .ok_or_else(|| io::Error::other("the fake has no cgroup2 mount"))
    }

    /// The directory of cgroup path `rel` (`/system.slice/kv.service`).
    pub fn dir(&self, rel: &str) -> PathBuf {
        self.root.join(rel.trim_start_matches('/'))
    }

    /// Creates cgroup `rel` and any missing parent the way its owner would (systemd, a
    /// container runtime), every step validated, then enables `subtree` in it.
    pub fn mkdir_owner(&self, rel: &str, subtree: &[&str]) -> io::Result<PathBuf> {
        let mut dir = self.root.clone();
        for part in rel
            .trim_start_matches('/')
            .split('/')
            .filter(|p| !p.is_empty())
        {
            dir.push(part);
            if !dir.exists() {
                self.create_dir(&dir)?;
            }
        }
        if !subtree.is_empty() {
            let ops: Vec<String> = subtree.iter().map(|c| format!("+{c}")).collect();
            self.write(&dir.join("cgroup.subtree_control"), &ops.join(" "))?;
        }
        Ok(dir)
    }

    /// Makes process `pid` exist (in `<proc>/<pid>`, started at `start_ticks`) and puts it
    /// in cgroup `rel`, as its owner started it there.
    pub fn add_process(&self, pid: u32, start_ticks: u64, rel: &str) -> io::Result<()> {
        let proc_root = self.base().join("proc");
        let mut p = FakeProcess::new(pid, "worker");
        p.start_ticks = start_ticks;
        p.write(&proc_root)?;
        let exe = proc_root.join(pid.to_string()).join("exe");
        if std::fs::symlink_metadata(&exe).is_err() {
            std::os::unix::fs::symlink("/usr/bin/worker", exe)?;
        }
        self.lock().processes.insert(pid, start_ticks);
        let mut root_procs = std::fs::read_to_string(self.root.join("cgroup.procs"))?;
        root_procs.push_str(&format!("{pid}\n"));
        std::fs::write(self.root.join("cgroup.procs"), root_procs)?;
        self.write(&self.dir(rel).join("cgroup.procs"), &pid.to_string())
    }

    /// The cgroup path process `pid` is in (`/` for the root).
    pub fn cgroup_of(&self, pid: u32) -> Option<String> {
        let text = std::fs::read_to_string(
            self.base()
                .join("proc")
                .join(pid.to_string())
                .join("cgroup"),
        )
        .ok()?;
        text.trim().strip_prefix("0::").map(str::to_string)
    }

    /// Every write the fake accepted, oldest first.
    pub fn writes(&self) -> Vec<(PathBuf, String)> {
        self.lock().writes.clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn is_cgroup(&self, dir: &Path) -> bool {
        dir.starts_with(&self.root) && dir.join("cgroup.procs").is_file()
    }

    fn read(&self, dir: &Path, file: &str) -> io::Result<String> {
        std::fs::read_to_string(dir.join(file))
    }

    fn children(&self, dir: &Path) -> io::Result<Vec<PathBuf>> {
        Ok(RealFs
            .subdirs(dir)?
            .into_iter()
            .map(|n| dir.join(n))
            .collect())
    }

    fn rel(&self, dir: &Path) -> String {
        let rel = dir.strip_prefix(&self.root).unwrap_or(dir);
        format!("/{}", rel.display())
    }

    fn write_subtree(&self, dir: &Path, data: &str) -> io::Result<()> {
        let offered = words(&self.read(dir, "cgroup.controllers")?);
        let known = words(&self.read(&self.root, "cgroup.controllers")?);
        let mut enabled = words(&self.read(dir, "cgroup.subtree_control")?);
        let mut enable = Vec::new();
        let mut disable = Vec::new();
        for op in data.split_whitespace() {
            let (on, name) = match op.split_at(1) {
                ("+", n) => (true, n),
                ("-", n) => (false, n),
                _ => return Err(err(libc::EINVAL)),
            };
            if !known.iter().any(|k| k == name) {
                return Err(err(libc::EINVAL));
            }
            if on {
                enable.push(name.to_string());
            } else {
                disable.push(name.to_string());
            }
        }
        if enable.iter().any(|c| !offered.contains(c)) {
            return Err(err(libc::ENOENT));
        }
        let populated = !self.read(dir, "cgroup.procs")?.trim().is_empty();
        if dir != self.root && populated && enable.iter().any(|c| !enabled.contains(c)) {
            return Err(err(libc::EBUSY));
        }
        for child in self.children(dir)? {
            let delegated = words(&self.read(&child, "cgroup.subtree_control")?);
            if disable.iter().any(|c| delegated.contains(c)) {
                return Err(err(libc::EBUSY));
            }
        }
        for c in &enable {
            if !enabled.contains(c) {
                enabled.push(c.clone());
            }
        }
        enabled.retain(|c| !disable.contains(c));
        std::fs::write(dir.join("cgroup.subtree_control"), ordered(&enabled))?;
        for child in self.children(dir)? {
            self.set_controllers(&child, &enabled)?;
        }
        Ok(())
    }

    /// Gives `dir` exactly the files of `controllers` (what its parent delegates).
    fn set_controllers(&self, dir: &Path, controllers: &[String]) -> io::Result<()> {
        let had = words(&self.read(dir, "cgroup.controllers").unwrap_or_default());
        for c in ORDER {
            let want = controllers.iter().any(|x| x == c);
            let have = had.iter().any(|x| x == c);
            for (file, init) in files_of(c) {
                if *file == "cpu.idle" && !self.idle_class {
                    continue;
                }
                let path = dir.join(file);
                if want && !have {
                    std::fs::write(&path, init)?;
                } else if !want && have && path.exists() {
                    std::fs::remove_file(&path)?;
                }
            }
        }
        std::fs::write(dir.join("cgroup.controllers"), ordered(controllers))?;
        self.refresh_effective(dir)
    }

    /// Recomputes `cpuset.cpus.effective` of `dir` and below.
    fn refresh_effective(&self, dir: &Path) -> io::Result<()> {
        let eff = dir.join("cpuset.cpus.effective");
        if dir != self.root && eff.exists() {
            let parent = dir.parent().unwrap_or(&self.root);
            let from_parent: CpuList = self
                .read(parent, "cpuset.cpus.effective")?
                .parse()
                .map_err(|_| err(libc::EIO))?;
            let requested: CpuList = self
                .read(dir, "cpuset.cpus")?
                .parse()
                .map_err(|_| err(libc::EIO))?;
            let granted: Vec<u32> = requested
                .0
                .iter()
                .copied()
                .filter(|c| from_parent.0.contains(c))
                .collect();
            let effective = if granted.is_empty() {
                from_parent
            } else {
                CpuList(granted)
            };
            std::fs::write(&eff, effective.to_string())?;
        }
        for child in self.children(dir)? {
            self.refresh_effective(&child)?;
        }
        Ok(())
    }

    fn write_procs(&self, dir: &Path, data: &str) -> io::Result<()> {
        let pid: u32 = data.trim().parse().map_err(|_| err(libc::EINVAL))?;
        if !self.lock().processes.contains_key(&pid) {
            return Err(err(libc::ESRCH));
        }
        if dir != self.root && !self.read(dir, "cgroup.subtree_control")?.trim().is_empty() {
            return Err(err(libc::EBUSY));
        }
        let from = self.dir(&self.cgroup_of(pid).unwrap_or_else(|| "/".into()));
        let kept: String = self
            .read(&from, "cgroup.procs")?
            .lines()
            .filter(|l| l.trim() != pid.to_string())
            .map(|l| format!("{l}\n"))
            .collect();
        std::fs::write(from.join("cgroup.procs"), kept)?;
        let mut list = self.read(dir, "cgroup.procs")?;
        list.push_str(&format!("{pid}\n"));
        std::fs::write(dir.join("cgroup.procs"), list)?;
        let cgroup_file = self
            .base()
            .join("proc")
            .join(pid.to_string())
            .join("cgroup");
        std::fs::write(cgroup_file, format!("0::{}\n", self.rel(dir)))
    }

    fn write_cpus(&self, dir: &Path, data: &str) -> io::Result<()> {
        let list: CpuList = data.parse().map_err(|_| err(libc::EINVAL))?;
        if list.0.iter().any(|c| !self.cpus.contains(c)) {
            return Err(err(libc::EINVAL));
        }
        std::fs::write(dir.join("cpuset.cpus"), list.to_string())?;
        self.refresh_effective(dir)
    }

    fn write_mems(&self, dir: &Path, data: &str) -> io::Result<()> {
        let list: CpuList = data.parse().map_err(|_| err(libc::EINVAL))?;
        if list.0.iter().any(|n| *n != 0) {
            return Err(err(libc::EINVAL));
        }
        std::fs::write(dir.join("cpuset.mems"), list.to_string())
    }

    fn write_weight(&self, dir: &Path, data: &str) -> io::Result<()> {
        let w: u64 = data.trim().parse().map_err(|_| err(libc::EINVAL))?;
        if !(1..=10_000).contains(&w) {
            return Err(err(libc::ERANGE));
        }
        if self.read(dir, "cpu.idle").is_ok_and(|i| i == "1") {
            return Err(err(libc::EINVAL));
        }
        std::fs::write(dir.join("cpu.weight"), w.to_string())
    }

    fn write_idle(&self, dir: &Path, data: &str) -> io::Result<()> {
        let idle = match data.trim() {
            "0" => false,
            "1" => true,
            _ => return Err(err(libc::EINVAL)),
        };
        if self.read(dir, "cpu.idle")? == data.trim() {
            return Ok(());
        }
        std::fs::write(dir.join("cpu.idle"), data.trim())?;
        std::fs::write(dir.join("cpu.weight"), if idle { "1" } else { "100" })
    }

    fn write_cpu_max(&self, dir: &Path, data: &str) -> io::Result<()> {
        let mut it = data.split_whitespace();
        let quota = match it.next() {
            Some("max") => None,
            Some(q) => Some(q.parse::<u64>().map_err(|_| err(libc::EINVAL))?),
            None => return Err(err(libc::EINVAL)),
        };
        let old = self.read(dir, "cpu.max")?;
        let period: u64 = match it.next() {
            Some(p) => p.parse().map_err(|_| err(libc::EINVAL))?,
            None => old
                .split_whitespace()
                .nth(1)
                .and_then(|p| p.parse().ok())
                .unwrap_or(100_000),
        };
        if it.next().is_some()
            || quota.is_some_and(|q| q < 1000)
            || !(1000..=1_000_000).contains(&period)
        {
            return Err(err(libc::EINVAL));
        }
        let quota = quota.map_or_else(|| "max".to_string(), |q| q.to_string());
        std::fs::write(dir.join("cpu.max"), format!("{quota} {period}"))
    }
}

impl KernelFs for FakeCgroup2 {
    fn read_to_string(&self, path: &Path) -> io::Result<String> {
        std::fs::read_to_string(path)
    }

    fn write(&self, path: &Path, data: &str) -> io::Result<()> {
        if !path.starts_with(&self.root) {
            // The fake only stands for the cgroup mount (mountinfo and /proc are fixtures).
            return RealFs.write(path, data);
        }
        let (Some(dir), Some(file)) = (path.parent(), path.file_name().and_then(|n| n.to_str()))
        else {
            return Err(err(libc::EINVAL));
        };
        if !self.is_cgroup(dir) || !path.is_file() {
            return Err(err(libc::ENOENT));
        }
        if read_only(file) {
            return Err(err(libc::EACCES));
        }
        match file {
            "cgroup.subtree_control" => self.write_subtree(dir, data),
            "cgroup.procs" => self.write_procs(dir, data),
            "cpuset.cpus" => self.write_cpus(dir, data),
            "cpuset.mems" => self.write_mems(dir, data),
            "cpu.weight" => self.write_weight(dir, data),
            "cpu.idle" => self.write_idle(dir, data),
            "cpu.max" => self.write_cpu_max(dir, data),
            _ => std::fs::write(path, data),
        }?;
        self.lock()
            .writes
            .push((path.to_path_buf(), data.to_string()));
        Ok(())
    }

    fn create_dir(&self, path: &Path) -> io::Result<()> {
        let Some(parent) = path.parent().filter(|p| p.starts_with(&self.root)) else {
            return Err(err(libc::EPERM));
        };
        if !self.is_cgroup(parent) {
            return Err(err(libc::ENOENT));
        }
        if path.exists() {
            return Err(err(libc::EEXIST));
        }
        std::fs::create_dir(path)?;
        for (file, text) in [
            ("cgroup.procs", ""),
            ("cgroup.subtree_control", ""),
            ("cgroup.type", "domain"),
            ("cgroup.events", "populated 0\nfrozen 0"),
        ] {
            std::fs::write(path.join(file), text)?;
        }
        let delegated = words(&self.read(parent, "cgroup.subtree_control")?);
        self.set_controllers(path, &delegated)
    }

    fn remove_dir(&self, path: &Path) -> io::Result<()> {
        if path == self.root {
            return Err(err(libc::EBUSY));
        }
        if !self.is_cgroup(path) {
            return Err(err(libc::ENOENT));
        }
        if !self.children(path)?.is_empty() || !self.read(path, "cgroup.procs")?.trim().is_empty() {
            return Err(err(libc::EBUSY));
        }
        std::fs::remove_dir_all(path)
    }

    fn subdirs(&self, path: &Path) -> io::Result<Vec<String>> {
        RealFs.subdirs(path)
    }

    fn identity(&self, path: &Path) -> io::Result<u64> {
        RealFs.identity(path)
    }

    fn lock_exclusive(&self, path: &Path) -> io::Result<Box<dyn LockGuard>> {
        RealFs.lock_exclusive(path)
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Controller, CpuMax, CpuWeight, InPlace};
    use super::*;

    fn code(e: &io::Error) -> Option<i32> {
        e.raw_os_error()
    }

    #[test]
    fn controller_files_follow_the_parents_subtree_control() {
        let f = FakeCgroup2::builder()
            .root_subtree(&["cpu", "memory"])
            .build()
            .unwrap();
        let slice = f.mkdir_owner("/system.slice", &[]).unwrap();
        assert!(slice.join("cpu.max").exists() && slice.join("memory.max").exists());
        assert!(
            !slice.join("cpuset.cpus").exists(),
            "cpuset is not delegated"
        );
        let e = f.write(&slice.join("cpuset.cpus"), "0").unwrap_err();
        assert_eq!(code(&e), Some(libc::ENOENT));
        // The slice was not given cpuset, so it cannot pass it on.
        let e = f
            .write(&slice.join("cgroup.subtree_control"), "+cpuset")
            .unwrap_err();
        assert_eq!(code(&e), Some(libc::ENOENT));
        let e = f
            .write(&slice.join("cgroup.subtree_control"), "+bogus")
            .unwrap_err();
        assert_eq!(code(&e), Some(libc::EINVAL));
        f.write(&slice.join("cgroup.subtree_control"), "+cpu")
            .unwrap();
        let unit = f.mkdir_owner("/system.slice/kv.service", &[]).unwrap();
        assert!(unit.join("cpu.weight").exists() && !unit.join("memory.max").exists());
        // Disabling what a child still delegates is refused; then it goes with its files.
        f.write(&unit.join("cgroup.subtree_control"), "+cpu")
            .unwrap();
        let e = f
            .write(&slice.join("cgroup.subtree_control"), "-cpu")
            .unwrap_err();
        assert_eq!(code(&e), Some(libc::EBUSY));
        f.write(&unit.join("cgroup.subtree_control"), "-cpu")
            .unwrap();
        f.write(&slice.join("cgroup.subtree_control"), "-cpu")
            .unwrap();
        assert!(!unit.join("cpu.weight").exists());
        assert!(!f.root().join("cpu.max").exists(), "the root has no limit");
    }

    #[test]
    fn processes_and_controllers_do_not_mix_below_the_root() {
        let f = FakeCgroup2::builder().build().unwrap();
        f.mkdir_owner("/system.slice", &["cpu", "memory"]).unwrap();
        f.mkdir_owner("/system.slice/kv.service", &[]).unwrap();
        f.add_process(40, 1000, "/system.slice/kv.service").unwrap();
        assert_eq!(f.cgroup_of(40).as_deref(), Some("/system.slice/kv.service"));
        let unit = f.dir("/system.slice/kv.service");
        let e = f
            .write(&unit.join("cgroup.subtree_control"), "+cpu")
            .unwrap_err();
        assert_eq!(code(&e), Some(libc::EBUSY), "no internal process");
        let slice = f.dir("/system.slice");
        let e = f.write(&slice.join("cgroup.procs"), "40").unwrap_err();
        assert_eq!(
            code(&e),
            Some(libc::EBUSY),
            "the slice delegates controllers"
        );
        let e = f.write(&unit.join("cgroup.procs"), "41").unwrap_err();
        assert_eq!(code(&e), Some(libc::ESRCH));
        f.write(&f.root().join("cgroup.subtree_control"), "-io")
            .unwrap();
        let e = f.remove_dir(&unit).unwrap_err();
        assert_eq!(code(&e), Some(libc::EBUSY), "it has a process");
        assert_eq!(code(&f.remove_dir(&slice).unwrap_err()), Some(libc::EBUSY));
        f.write(&f.root().join("cgroup.procs"), "40").unwrap();
        assert_eq!(f.cgroup_of(40).as_deref(), Some("/"));
        f.remove_dir(&unit).unwrap();
        assert_eq!(
            code(&f.remove_dir(f.root()).unwrap_err()),
            Some(libc::EBUSY)
        );
    }

    #[test]
    fn cpu_values_are_checked_like_the_kernel() {
        let f = FakeCgroup2::builder().cpus(4).build().unwrap();
        let a = f.mkdir_owner("/a", &["cpuset"]).unwrap();
        let b = f.mkdir_owner("/a/b", &[]).unwrap();
        for (file, bad, errno) in [
            ("cpu.weight", "0", libc::ERANGE),
            ("cpu.weight", "10001", libc::ERANGE),
            ("cpu.weight", "x", libc::EINVAL),
            ("cpu.max", "500 100000", libc::EINVAL),
            ("cpu.max", "5000 100", libc::EINVAL),
            ("cpu.max", "lots", libc::EINVAL),
            ("cpu.max", "", libc::EINVAL),
            ("cpuset.cpus", "0-9", libc::EINVAL),
            ("cpuset.cpus", "3-1", libc::EINVAL),
            ("cpuset.mems", "1", libc::EINVAL),
            ("cpuset.cpus.effective", "0", libc::EACCES),
            ("cpu.idle", "2", libc::EINVAL),
            ("cpu.idle", "-1", libc::EINVAL),
        ] {
            let e = f.write(&a.join(file), bad).unwrap_err();
            assert_eq!(code(&e), Some(errno), "{file} = {bad:?}");
        }
        // The idle class: the weight reads 1 and cannot be written; leaving it resets it.
        f.write(&a.join("cpu.weight"), "500").unwrap();
        f.write(&a.join("cpu.idle"), "1").unwrap();
        assert_eq!(f.read(&a, "cpu.weight").unwrap(), "1");
        let e = f.write(&a.join("cpu.weight"), "10000").unwrap_err();
        assert_eq!(code(&e), Some(libc::EINVAL), "weight of an idle group");
        f.write(&a.join("cpu.idle"), "0").unwrap();
        assert_eq!(f.read(&a, "cpu.weight").unwrap(), "100", "500 is lost");
        f.write(&a.join("cpu.weight"), "10000").unwrap();
        f.write(&a.join("cpu.max"), "5000").unwrap();
        assert_eq!(
            f.read(&a, "cpu.max").unwrap(),
            "5000 100000",
            "the period stays"
        );
        // Effective CPUs: the requested ones the parent has, or all of the parent's.
        f.write(&a.join("cpuset.cpus"), "0-1").unwrap();
        assert_eq!(f.read(&b, "cpuset.cpus.effective").unwrap(), "0-1");
        f.write(&b.join("cpuset.cpus"), "1-3").unwrap();
        assert_eq!(f.read(&b, "cpuset.cpus.effective").unwrap(), "1");
        f.write(&b.join("cpuset.cpus"), "3").unwrap();
        assert_eq!(f.read(&b, "cpuset.cpus.effective").unwrap(), "0-1");
        f.write(&a.join("cpuset.cpus"), "").unwrap();
        assert_eq!(f.read(&b, "cpuset.cpus.effective").unwrap(), "3");
    }

    #[test]
    fn a_kernel_before_5_15_has_no_idle_class() {
        for (idle, has) in [(true, true), (false, false)] {
            let f = FakeCgroup2::builder().idle_class(idle).build().unwrap();
            let a = f.mkdir_owner("/a", &[]).unwrap();
            assert_eq!(a.join("cpu.idle").exists(), has);
            assert_eq!(f.cgroups().unwrap().has_idle_class(), has);
        }
    }

    #[test]
    fn cohabit_reads_and_writes_through_the_fake() {
        let f = FakeCgroup2::builder()
            .root_subtree(&["cpu", "memory"])
            .build()
            .unwrap();
        f.mkdir_owner("/system.slice", &["cpu", "memory"]).unwrap();
        f.mkdir_owner("/system.slice/kv.service", &[]).unwrap();
        f.add_process(40, 1000, "/system.slice/kv.service").unwrap();
        let cg = f.cgroups().unwrap();
        assert_eq!(
            cg.v2_controllers,
            vec!["cpuset", "cpu", "io", "memory", "pids"]
        );
        let lines = crate::procfs::Procfs::new(f.base().join("proc"))
            .cgroups(40)
            .unwrap();
        let home = cg.home("cpu", &lines).unwrap();
        assert_eq!(home, f.dir("/system.slice/kv.service"));
        assert_eq!(cg.in_place(Controller::Cpu, &home), InPlace::Writable);
        assert_eq!(
            cg.in_place(Controller::Cpuset, &home),
            InPlace::NotDelegated
        );
        assert_eq!(
            cg.in_place(Controller::Cpu, f.root()),
            InPlace::HierarchyRoot
        );
        let (file, value) = cg.weight_file(CpuWeight::Highest);
        cg.write_control(&home, file, &value).unwrap();
        for (file, value) in cg.cpu_max_files(CpuMax::for_cores(Some(0.5))) {
            cg.write_control(&home, file, &value).unwrap();
        }
        assert_eq!(cg.cpu_max_at(&home).unwrap().quota_us, Some(50_000));
        assert!(cg.write_control(&home, "cpuset.cpus", "0").is_err());
        // cohabit's own group: its parent delegates, the mount root is never written.
        let own = cg.own_dir(Controller::Cpu, "best-effort").unwrap().unwrap();
        cg.make_dir(own.parent().unwrap()).unwrap();
        cg.make_dir(&own).unwrap();
        assert!(own.join("cpu.max").exists());
        assert!(
            !own.join("cpuset.cpus").exists(),
            "the root does not delegate cpuset"
        );
        assert!(f
            .writes()
            .iter()
            .all(|(p, _)| p != &f.root().join("cgroup.subtree_control")));
        assert!(cg.move_process(&own, 40).unwrap());
        assert!(
            !cg.move_process(&own, 99).unwrap(),
            "an unknown pid is absence"
        );
        assert_eq!(cg.processes_in_dir(&own).unwrap(), vec![40]);
        assert!(cg.remove_dir(&own).is_err(), "not empty");
        assert!(cg.move_process(&home, 40).unwrap());
        cg.remove_dir(&own).unwrap();
        cg.remove_dir(own.parent().unwrap()).unwrap();
        assert_eq!(
            cg.processes_at_cgroup_path("/system.slice/kv.service"),
            vec![40]
        );
    }
}
