//! A fake resctrl mount for tests: a directory tree in a `TempDir` plus a [`KernelFs`] that
//! validates writes where the kernel would.
//!
//! Like the kernel: `schemata` writes are parsed and every mask checked (contiguous, at
//! least `min_cbm_bits`, within `cbm_mask`), MB values must lie in `[min_bandwidth, 100]`
//! and are rounded up to the granularity; a rejected write fails with EINVAL and leaves the
//! kernel's explanation in `info/last_cmd_status`; partial writes change only the listed
//! domains. `mkdir` of a control group fails with ENOSPC once every CLOSID is used (the
//! root holds one). A task id written to `tasks` leaves every other group; an unknown id
//! fails with ESRCH. `rmdir` returns the group's tasks to the root.
//!
//! Monitoring groups as the kernel has them: every control group (the root too) has
//! `mon_groups`; `mkdir` there makes a group with its own `tasks` and `mon_data` and takes
//! an RMID (ENOSPC once `info/L3_MON/num_rmids` are used, control groups included). A task
//! joins a monitoring group only from its parent control group (EINVAL, "Can't move task
//! to different control group", otherwise) and leaves its other monitoring groups then;
//! writing it to a control group's `tasks` takes it out of every monitoring group. A
//! control group's `tasks` lists its monitoring groups' tasks too, and each counter in its
//! `mon_data` reads as its own value plus its monitoring groups' (`Unavailable` if any
//! is). `rmdir` of a monitoring group leaves its tasks in the control group; `rmdir` of a
//! control group removes its monitoring groups.
//!
//! Unlike the kernel: only ids registered with [`FakeResctrl::add_task`] exist; there is no
//! RMID limbo, no `cpus` files, and monitoring counters change only when a test sets them
//! ([`FakeResctrl::set_counter`]; a monitoring group is `"<group>/mon_groups/<name>"`).

use std::collections::HashMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use super::schemata::{check_cbm, Schemata};
use crate::kfs::{KernelFs, LockGuard, RealFs};

/// Shape of the fake host.
#[derive(Debug, Clone)]
pub struct FakeResctrlBuilder {
    ways: u32,
    min_cbm_bits: u32,
    num_closids: u32,
    domains: Vec<u32>,
    mba: Option<(u32, u32)>,
    cdp: bool,
    num_rmids: u32,
}

impl Default for FakeResctrlBuilder {
    fn default() -> Self {
        Self {
            num_rmids: 128,
            ways: 20,
            min_cbm_bits: 1,
            num_closids: 16,
            domains: vec![0],
            mba: Some((10, 10)),
            cdp: false,
        }
    }
}

impl FakeResctrlBuilder {
    /// LLC ways (bits of `cbm_mask`).
    pub fn ways(mut self, ways: u32) -> Self {
        self.ways = ways;
        self
    }
    /// `min_cbm_bits`.
    pub fn min_cbm_bits(mut self, bits: u32) -> Self {
        self.min_cbm_bits = bits;
        self
    }
    /// CLOSIDs, the root's included.
    pub fn num_closids(mut self, n: u32) -> Self {
        self.num_closids = n;
        self
    }
    /// Cache/MBA domain ids.
    pub fn domains(mut self, d: &[u32]) -> Self {
        self.domains = d.to_vec();
        self
    }
    /// MBA with `min_bandwidth` and `bandwidth_gran`, or none.
    pub fn mba(mut self, mba: Option<(u32, u32)>) -> Self {
        self.mba = mba;
        self
    }
    /// Code/data prioritisation.
    pub fn cdp(mut self, cdp: bool) -> Self {
        self.cdp = cdp;
        self
    }
    /// RMIDs (`info/L3_MON/num_rmids`): control and monitoring groups, the root's included.
    pub fn num_rmids(mut self, n: u32) -> Self {
        self.num_rmids = n;
        self
    }

    /// Lays the tree out and returns the fake.
    pub fn build(self) -> io::Result<FakeResctrl> {
        let dir = tempfile::tempdir()?;
        let root = dir.path().join("sys/fs/resctrl");
        let cbm_mask = (1u64 << self.ways) - 1;
        let write = |p: PathBuf, s: String| -> io::Result<()> {
            std::fs::create_dir_all(p.parent().unwrap_or(Path::new("/")))?;
            std::fs::write(p, s)
        };
        let l3 = if self.cdp {
            ["L3CODE", "L3DATA"].as_slice()
        } else {
            ["L3"].as_slice()
        };
        for res in l3 {
            let d = root.join("info").join(res);
            write(d.join("cbm_mask"), format!("{cbm_mask:x}\n"))?;
            write(d.join("min_cbm_bits"), format!("{}\n", self.min_cbm_bits))?;
            write(d.join("shareable_bits"), "0\n".into())?;
            let closids = if self.cdp {
                self.num_closids / 2
            } else {
                self.num_closids
            };
            write(d.join("num_closids"), format!("{closids}\n"))?;
        }
        if let Some((min, gran)) = self.mba {
            let d = root.join("info/MB");
            write(d.join("min_bandwidth"), format!("{min}\n"))?;
            write(d.join("bandwidth_gran"), format!("{gran}\n"))?;
            write(d.join("delay_linear"), "1\n".into())?;
            write(
                d.join("num_closids"),
                format!("{}\n", self.num_closids.min(8)),
            )?;
        }
        write(
            root.join("info/L3_MON/num_rmids"),
            format!("{}\n", self.num_rmids),
        )?;
        write(
            root.join("info/L3_MON/mon_features"),
            "llc_occupancy\nmbm_total_bytes\nmbm_local_bytes\n".into(),
        )?;
        write(root.join("info/last_cmd_status"), "ok\n".into())?;
        let mut default = Schemata::default();
        for res in l3 {
            for d in &self.domains {
                default.set(res, *d, cbm_mask);
            }
        }
        if self.mba.is_some() {
            for d in &self.domains {
                default.set("MB", *d, 100);
            }
        }
        let proc_dir = dir.path().join("proc/self");
        std::fs::create_dir_all(&proc_dir)?;
        std::fs::write(
            proc_dir.join("mountinfo"),
            format!(
                "40 25 0:35 / {} rw,relatime shared:14 - resctrl resctrl rw\n",
                root.display()
            ),
        )?;
        let fake = FakeResctrl {
            dir: Arc::new(dir),
            root,
            shape: self,
            default,
            state: Arc::new(Mutex::new(State::default())),
        };
        fake.lay_group(&fake.root)?;
        Ok(fake)
    }
}

#[derive(Debug, Default)]
struct State {
    known_tasks: Vec<u32>,
    generation: HashMap<PathBuf, u64>,
    next_generation: u64,
}

/// A fake resctrl mount (see the module docs for how it differs from the kernel).
#[derive(Debug, Clone)]
pub struct FakeResctrl {
    dir: Arc<tempfile::TempDir>,
    root: PathBuf,
    shape: FakeResctrlBuilder,
    default: Schemata,
    state: Arc<Mutex<State>>,
}

fn einval() -> io::Error {
    io::Error::from_raw_os_error(libc::EINVAL)
}

impl FakeResctrl {
    /// A builder with 20 ways, one domain, MBA, 16 CLOSIDs.
    pub fn builder() -> FakeResctrlBuilder {
        FakeResctrlBuilder::default()
    }

    /// The fixture root (holds `proc/self/mountinfo` and `sys/fs/resctrl`).
    pub fn base(&self) -> &Path {
        self.dir.path()
    }

    /// The mount point.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Host paths pointing at this fixture.
    pub fn paths(&self) -> crate::HostPaths {
        crate::HostPaths::under(self.base())
    }

    /// Makes a task id exist (in the root group).
    pub fn add_task(&self, tid: u32) -> io::Result<()> {
        self.lock().known_tasks.push(tid);
        let path = self.root.join("tasks");
        let mut t = std::fs::read_to_string(&path)?;
        t.push_str(&format!("{tid}\n"));
        std::fs::write(path, t)
    }

    /// Sets a monitoring counter of a group (`None`: root) on a domain; `None` writes
    /// `Unavailable`.
    pub fn set_counter(
        &self,
        group: Option<&str>,
        domain: u32,
        file: &str,
        value: Option<u64>,
    ) -> io::Result<()> {
        let dir = group.map_or_else(|| self.root.clone(), |g| self.root.join(g));
        let path = dir.join(format!("mon_data/mon_L3_{domain:02}/{file}"));
        std::fs::write(
            path,
            value.map_or_else(|| "Unavailable\n".to_string(), |v| format!("{v}\n")),
        )
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn set_status(&self, msg: &str) {
        let _ = std::fs::write(self.root.join("info/last_cmd_status"), format!("{msg}\n"));
    }

    fn lay_group(&self, dir: &Path) -> io::Result<()> {
        std::fs::create_dir_all(dir.join("mon_groups"))?;
        std::fs::write(dir.join("schemata"), self.default.to_string())?;
        self.lay_mon(dir)
    }

    /// `tasks` and `mon_data` of a control or monitoring group.
    fn lay_mon(&self, dir: &Path) -> io::Result<()> {
        std::fs::create_dir_all(dir)?;
        if !dir.join("tasks").exists() {
            std::fs::write(dir.join("tasks"), "")?;
        }
        for d in &self.shape.domains {
            let m = dir.join(format!("mon_data/mon_L3_{d:02}"));
            std::fs::create_dir_all(&m)?;
            for f in ["llc_occupancy", "mbm_total_bytes", "mbm_local_bytes"] {
                std::fs::write(m.join(f), "0\n")?;
            }
        }
        let mut st = self.lock();
        st.next_generation += 1;
        let g = st.next_generation;
        st.generation.insert(dir.to_path_buf(), g);
        Ok(())
    }

    /// The monitoring groups of control group `ctrl`.
    fn mon_groups_of(ctrl: &Path) -> io::Result<Vec<PathBuf>> {
        let dir = ctrl.join("mon_groups");
        if !dir.is_dir() {
            return Ok(vec![]);
        }
        Ok(RealFs
            .subdirs(&dir)?
            .into_iter()
            .map(|n| dir.join(n))
            .collect())
    }

    /// The control group of a monitoring group's directory, if `dir` is one.
    fn parent_ctrl(&self, dir: &Path) -> Option<PathBuf> {
        let mon_groups = dir.parent()?;
        if mon_groups.file_name()? != "mon_groups" {
            return None;
        }
        let ctrl = mon_groups.parent()?;
        (ctrl == self.root || ctrl.parent() == Some(self.root.as_path()))
            .then(|| ctrl.to_path_buf())
    }

    /// RMIDs in use: every control group's and every monitoring group's.
    fn rmids_used(&self) -> io::Result<u32> {
        let mut n = 0u32;
        for g in self.groups()? {
            n += 1 + u32::try_from(Self::mon_groups_of(&g)?.len()).unwrap_or(u32::MAX);
        }
        Ok(n)
    }

    fn tasks_of(dir: &Path) -> io::Result<Vec<String>> {
        Ok(std::fs::read_to_string(dir.join("tasks"))?
            .lines()
            .map(|l| l.trim().to_string())
            .filter(|l| !l.is_empty())
            .collect())
    }

    fn set_tasks(dir: &Path, tasks: &[String]) -> io::Result<()> {
        let text: String = tasks.iter().map(|t| format!("{t}\n")).collect();
        std::fs::write(dir.join("tasks"), text)
    }

    /// A control group's counter: its own value plus its monitoring groups'.
    fn read_ctrl_counter(&self, path: &Path) -> Option<io::Result<String>> {
        // <ctrl>/mon_data/mon_L3_XX/<file>
        let file = path.file_name()?;
        let domain = path.parent()?.file_name()?;
        let mon_data = path.parent()?.parent()?;
        if mon_data.file_name()? != "mon_data" {
            return None;
        }
        let ctrl = mon_data.parent()?;
        if ctrl != self.root && ctrl.parent() != Some(self.root.as_path()) {
            return None;
        }
        let children = match Self::mon_groups_of(ctrl) {
            Ok(c) if !c.is_empty() => c,
            Ok(_) => return None,
            Err(e) => return Some(Err(e)),
        };
        let mut total = 0u64;
        let own = std::iter::once(path.to_path_buf());
        let others = children
            .iter()
            .map(|c| c.join("mon_data").join(domain).join(file));
        for p in own.chain(others) {
            let text = match std::fs::read_to_string(&p) {
                Ok(t) => t,
                Err(e) => return Some(Err(e)),
            };
            match text.trim().parse::<u64>() {
                Ok(v) => total = total.saturating_add(v),
                Err(_) => return Some(Ok("Unavailable\n".into())),
            }
        }
        Some(Ok(format!("{total}\n")))
    }

    fn groups(&self) -> io::Result<Vec<PathBuf>> {
        let mut out = vec![self.root.clone()];
        for name in RealFs.subdirs(&self.root)? {
            if !matches!(name.as_str(), "info" | "mon_data" | "mon_groups") {
                out.push(self.root.join(name));
            }
        }
        Ok(out)
    }

    fn write_schemata(&self, path: &Path, data: &str) -> io::Result<()> {
        let new = match Schemata::parse(data) {
            Ok(s) => s,
            Err(e) => {
                self.set_status(&e.to_string());
                return Err(einval());
            }
        };
        let cbm_mask = (1u64 << self.shape.ways) - 1;
        let mut current = Schemata::parse(&std::fs::read_to_string(path)?).map_err(|_| einval())?;
        for res in ["L3", "L3CODE", "L3DATA", "MB"] {
            for d in new.domains(res) {
                let v = new.get(res, d).unwrap_or(0);
                if self.default.get(res, d).is_none() {
                    self.set_status(&format!("Unknown domain or resource {res}:{d}"));
                    return Err(einval());
                }
                let checked = if res == "MB" {
                    let (min, gran) = self.shape.mba.unwrap_or((10, 10));
                    if v < u64::from(min) || v > 100 {
                        Err(format!("MB value {v} out of range [{min},100]"))
                    } else {
                        let (min, gran) = (u64::from(min), u64::from(gran));
                        Ok(min + (v - min).div_ceil(gran) * gran)
                    }
                } else {
                    check_cbm(v, cbm_mask, self.shape.min_cbm_bits).map(|()| v)
                };
                match checked {
                    Ok(v) => current.set(res, d, v),
                    Err(msg) => {
                        self.set_status(&msg);
                        return Err(einval());
                    }
                }
            }
        }
        std::fs::write(path, current.to_string())?;
        self.set_status("ok");
        Ok(())
    }

    fn write_task(&self, path: &Path, data: &str) -> io::Result<()> {
        let Ok(tid) = data.trim().parse::<u32>() else {
            self.set_status(&format!("Task list parsing error pid {}", data.trim()));
            return Err(einval());
        };
        if !self.lock().known_tasks.contains(&tid) {
            self.set_status(&format!("No task {tid}"));
            return Err(io::Error::from_raw_os_error(libc::ESRCH));
        }
        let dir = path.parent().unwrap_or(Path::new("/"));
        let id = tid.to_string();
        if let Some(ctrl) = self.parent_ctrl(dir) {
            // Into a monitoring group: only from its control group; out of its siblings.
            if !Self::tasks_of(&ctrl)?.contains(&id) {
                self.set_status("Can't move task to different control group");
                return Err(einval());
            }
            for m in Self::mon_groups_of(&ctrl)? {
                let kept: Vec<String> = Self::tasks_of(&m)?
                    .into_iter()
                    .filter(|t| *t != id)
                    .collect();
                Self::set_tasks(&m, &kept)?;
            }
            let mut list = Self::tasks_of(dir)?;
            list.push(id);
            Self::set_tasks(dir, &list)?;
            self.set_status("ok");
            return Ok(());
        }
        // Into a control group: out of every other group and every monitoring group.
        for g in self.groups()? {
            for m in Self::mon_groups_of(&g)? {
                let kept: Vec<String> = Self::tasks_of(&m)?
                    .into_iter()
                    .filter(|t| *t != id)
                    .collect();
                Self::set_tasks(&m, &kept)?;
            }
        }
        for g in self.groups()? {
            let t = g.join("tasks");
            let list = std::fs::read_to_string(&t)?;
            let kept: String = list
                .lines()
                .filter(|l| l.trim() != tid.to_string())
                .map(|l| format!("{l}\n"))
                .collect();
            std::fs::write(&t, kept)?;
        }
        let mut list = std::fs::read_to_string(path)?;
        list.push_str(&format!("{tid}\n"));
        std::fs::write(path, list)?;
        self.set_status("ok");
        Ok(())
    }
}

impl KernelFs for FakeResctrl {
    fn read_to_string(&self, path: &Path) -> io::Result<String> {
        if let Some(summed) = self.read_ctrl_counter(path) {
            return summed;
        }
        std::fs::read_to_string(path)
    }

    fn write(&self, path: &Path, data: &str) -> io::Result<()> {
        match path.file_name().and_then(|n| n.to_str()) {
            Some("schemata") => self.write_schemata(path, data),
            Some("tasks") => self.write_task(path, data),
            _ => RealFs.write(path, data),
        }
    }

    fn create_dir(&self, path: &Path) -> io::Result<()> {
        if path.exists() {
            return Err(io::Error::from_raw_os_error(libc::EEXIST));
        }
        if let Some(ctrl) = self.parent_ctrl(path) {
            if !ctrl.is_dir() || path.file_name().is_some_and(|n| n == "mon_groups") {
                return Err(io::Error::from_raw_os_error(libc::EPERM));
            }
            if self.rmids_used()? >= self.shape.num_rmids {
                self.set_status("out of RMIDs");
                return Err(io::Error::from_raw_os_error(libc::ENOSPC));
            }
            return self.lay_mon(path);
        }
        if path.parent() != Some(self.root.as_path()) {
            return Err(io::Error::from_raw_os_error(libc::EPERM));
        }
        let used = u32::try_from(self.groups()?.len()).unwrap_or(u32::MAX);
        if used >= self.shape.num_closids {
            self.set_status("out of CLOSIDs");
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        self.lay_group(path)
    }

    fn remove_dir(&self, path: &Path) -> io::Result<()> {
        if self.parent_ctrl(path).is_some() && path.is_dir() {
            // A monitoring group's tasks are its control group's already.
            std::fs::remove_dir_all(path)?;
            self.lock().generation.remove(path);
            return Ok(());
        }
        if path.parent() != Some(self.root.as_path()) || !path.is_dir() {
            return Err(io::Error::from(io::ErrorKind::NotFound));
        }
        let tasks = std::fs::read_to_string(path.join("tasks"))?;
        let root_tasks = self.root.join("tasks");
        let mut list = std::fs::read_to_string(&root_tasks)?;
        list.push_str(&tasks);
        std::fs::write(root_tasks, list)?;
        std::fs::remove_dir_all(path)?;
        self.lock().generation.remove(path);
        Ok(())
    }

    fn subdirs(&self, path: &Path) -> io::Result<Vec<String>> {
        RealFs.subdirs(path)
    }

    fn identity(&self, path: &Path) -> io::Result<u64> {
        self.lock()
            .generation
            .get(path)
            .copied()
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))
    }

    fn lock_exclusive(&self, path: &Path) -> io::Result<Box<dyn LockGuard>> {
        RealFs.lock_exclusive(path)
    }
}
