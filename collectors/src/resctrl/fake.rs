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
//! Unlike the kernel: only ids registered with [`FakeResctrl::add_task`] exist; there are
//! no monitoring groups, no RMID limbo, no `cpus` files, and monitoring counters change
//! only when a test sets them ([`FakeResctrl::set_counter`]).

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
}

impl Default for FakeResctrlBuilder {
    fn default() -> Self {
        Self {
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
        write(root.join("info/L3_MON/num_rmids"), "128\n".into())?;
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
        std::fs::create_dir_all(dir)?;
        std::fs::write(dir.join("schemata"), self.default.to_string())?;
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
        if path.parent() != Some(self.root.as_path()) {
            return Err(io::Error::from_raw_os_error(libc::EPERM));
        }
        if path.exists() {
            return Err(io::Error::from_raw_os_error(libc::EEXIST));
        }
        let used = u32::try_from(self.groups()?.len()).unwrap_or(u32::MAX);
        if used >= self.shape.num_closids {
            self.set_status("out of CLOSIDs");
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        self.lay_group(path)
    }

    fn remove_dir(&self, path: &Path) -> io::Result<()> {
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
