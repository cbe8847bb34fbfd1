//! Intel RDT through Linux resctrl: cache allocation (CAT), memory-bandwidth allocation
//! (MBA) and monitoring (CMT, MBM). This module owns the interface, read and write side.
//!
//! Kernel doc: `Documentation/arch/x86/resctrl.rst`. Facts this module relies on:
//! - the mount is found in `/proc/self/mountinfo` (type `resctrl`, parsed by
//!   [`crate::mountinfo`]); `mba_MBps` and `cdp` show in its options;
//! - `info/<res>/` describes each resource: `cbm_mask` (all ways), `min_cbm_bits`,
//!   `shareable_bits`, `num_closids`; `info/MB/` has `min_bandwidth`, `bandwidth_gran`,
//!   `delay_linear`; `info/L3_MON/` has `num_rmids` and `mon_features`;
//! - every directory at the top of the mount other than `info` is a control group using one
//!   CLOSID (the root uses one too); `mkdir` fails with ENOSPC when they run out;
//! - a rejected `schemata` write returns EINVAL and explains itself in
//!   `info/last_cmd_status`;
//! - `tasks` takes one TID per write; a task belongs to exactly one control group;
//! - `mon_data/mon_L3_XX/{llc_occupancy,mbm_total_bytes,mbm_local_bytes}` are per-domain
//!   byte counters (occupancy is a level); they may read `Unavailable`;
//! - every control group (the root too) has a `mon_groups` directory; `mkdir` there makes a
//!   monitoring group with an RMID of its own (ENOSPC when they run out), its own `tasks`
//!   and `mon_data`. A task may join a monitoring group only from its parent control group
//!   (EINVAL otherwise) and leaves any other monitoring group then; writing it to the
//!   control group's `tasks` takes it out of its monitoring group. The control group's
//!   `tasks` lists its monitoring groups' tasks too, and its `mon_data` counts them too.
//!   `rmdir` of a monitoring group returns its tasks to the parent control group; `rmdir`
//!   of a control group removes its monitoring groups.
//!
//! Read-modify-write of a group takes `flock(LOCK_EX)` on the mount. Groups cohabit creates
//! carry the prefix [`GROUP_PREFIX`], so it can find and remove what a crashed run left.

pub mod schemata;

#[cfg(feature = "testutils")]
pub mod fake;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use cohabit_core::Allocation;
use serde::Serialize;

use crate::kfs::KernelFs;
use crate::{HostPaths, IoError};
pub use schemata::{check_cbm, contiguous_mask, MbaUnits, Schemata, SchemataError};

/// Prefix of every control group cohabit creates.
pub const GROUP_PREFIX: &str = "cohabit-";

/// How errors name the root (default) resctrl group.
pub const ROOT_GROUP_LABEL: &str = "the root group";

/// Longest group name accepted: the group-name limit of `cohabit_core::name`. The
/// characters are checked more loosely than there ([`validate_name`]): the groups read here
/// include other tools' groups, whose names cohabit did not choose.
pub const MAX_GROUP_NAME: usize = cohabit_core::name::GROUP_NAME_MAX;

/// What went wrong with resctrl.
#[derive(Debug, thiserror::Error)]
pub enum ResctrlError {
    /// A file could not be read or written.
    #[error(transparent)]
    Io(#[from] IoError),
    /// The kernel refused a write; `status` is `info/last_cmd_status`.
    #[error("resctrl rejected {written:?} for group {group}: {status}")]
    Rejected {
        /// Group name (`/` for the root).
        group: String,
        /// What was written.
        written: String,
        /// The kernel's explanation.
        status: String,
    },
    /// No CLOSID left for another control group.
    #[error("out of CLOSIDs: the host has {num_closids} and all are in use ({groups} groups)")]
    OutOfClosids {
        /// CLOSIDs the host has.
        num_closids: u32,
        /// Control groups that exist, the root included.
        groups: u32,
    },
    /// A group name that could escape the mount or confuse tools.
    #[error("invalid resctrl group name {0:?}: use 1-64 characters without '/', control characters or a leading '.'")]
    BadName(String),
    /// A file had unexpected contents.
    #[error("unexpected contents in {path}: {detail}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What was wrong.
        detail: String,
    },
}

/// A cache resource (`info/L3`, or `info/L3CODE` with CDP).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CacheInfo {
    /// All ways.
    pub cbm_mask: u64,
    /// Fewest ways a mask may have.
    pub min_cbm_bits: u32,
    /// Ways other agents (I/O, GPU) may also use.
    pub shareable_bits: u64,
    /// CLOSIDs for this resource.
    pub num_closids: u32,
    /// Code/data prioritisation is on (`L3CODE`/`L3DATA`).
    pub cdp: bool,
}

impl CacheInfo {
    /// Number of ways.
    pub fn ways(&self) -> u32 {
        self.cbm_mask.count_ones()
    }
}

/// Memory-bandwidth allocation (`info/MB`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MbaInfo {
    /// Units of `MB` values.
    pub units: MbaUnits,
    /// CLOSIDs for MBA.
    pub num_closids: u32,
    /// Whether the throttle is linear in the delay value.
    pub delay_linear: bool,
    /// `info/MB/min_bandwidth`: the smallest value (percent on Intel, whatever the mount
    /// option; 0 on AMD).
    pub min_bandwidth: u32,
    /// `info/MB/bandwidth_gran`: the step between values.
    pub bandwidth_gran: u32,
}

/// Monitoring (`info/L3_MON`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MonInfo {
    /// RMIDs.
    pub num_rmids: u32,
    /// Events, e.g. `llc_occupancy`, `mbm_total_bytes`.
    pub features: Vec<String>,
}

/// What resctrl on this host offers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ResctrlInfo {
    /// The mount.
    pub root: PathBuf,
    /// L3 allocation, if available.
    pub l3: Option<CacheInfo>,
    /// MBA, if available.
    pub mba: Option<MbaInfo>,
    /// Monitoring, if available.
    pub mon: Option<MonInfo>,
    /// Cache domains (ids in the root schemata).
    pub l3_domains: Vec<u32>,
    /// MBA domains.
    pub mb_domains: Vec<u32>,
}

impl ResctrlInfo {
    /// CLOSIDs usable by control groups, the root's included: the smallest over the
    /// allocation resources cohabit writes (L3, and MB when MBA is present, since every
    /// group's schemata then carries an `MB` line). 0 when neither is present.
    pub fn num_closids(&self) -> u32 {
        let l3 = self.l3.as_ref().map(|c| c.num_closids);
        let mb = self.mba.as_ref().map(|m| m.num_closids);
        l3.into_iter().chain(mb).min().unwrap_or(0)
    }

    /// Whether the host can allocate anything (L3 ways or memory bandwidth); monitoring
    /// alone does not count.
    pub fn allocates(&self) -> bool {
        self.l3.is_some() || self.mba.is_some()
    }

    /// The smallest MBA percentage (`info/MB/min_bandwidth`, at least 1), if MBA is present.
    pub fn mba_min_pct(&self) -> Option<u8> {
        self.mba.as_ref().map(|m| pct(m.min_bandwidth))
    }

    /// The MBA step in percent (`info/MB/bandwidth_gran`, at least 1), if MBA is present.
    pub fn mba_gran_pct(&self) -> Option<u8> {
        self.mba.as_ref().map(|m| pct(m.bandwidth_gran))
    }

    /// The schemata lines an allocation asks for: its way range as a contiguous mask on
    /// every cache domain (both halves with CDP) and its MBA value on every MB domain.
    pub fn schemata_for(&self, alloc: &Allocation) -> Schemata {
        let mask = self.l3.as_ref().map_or(0, |l3| {
            contiguous_mask(
                alloc.llc_ways.first,
                alloc.llc_ways.count,
                l3.min_cbm_bits,
                l3.cbm_mask,
            )
        });
        self.schemata_for_mask(mask, alloc.mba_pct)
    }

    /// The schemata lines of a cache `mask` (on every cache domain, both halves with CDP;
    /// ignored without L3 allocation) and an MBA percentage (on every MB domain).
    pub fn schemata_for_mask(&self, mask: u64, mba_pct: u8) -> Schemata {
        let mut s = Schemata::default();
        if let Some(l3) = &self.l3 {
            let resources: &[&str] = if l3.cdp {
                &["L3CODE", "L3DATA"]
            } else {
                &["L3"]
            };
            for res in resources {
                for d in &self.l3_domains {
                    s.set(res, *d, mask);
                }
            }
        }
        if let Some(mb) = &self.mba {
            for d in &self.mb_domains {
                s.set("MB", *d, mb.units.value(mba_pct));
            }
        }
        s
    }
}

/// A percentage file value clamped to 1..=100.
fn pct(v: u32) -> u8 {
    u8::try_from(v.clamp(1, 100)).unwrap_or(100)
}

/// What [`Resctrl::apply_undoable`] wrote, and how to take it back.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Applied {
    /// The lines and domains written (empty: the group already held the values).
    pub written: Schemata,
    /// What those lines and domains held before; applying it restores the group.
    pub previous: Schemata,
}

/// One counter set of a group at one instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MonReading {
    /// LLC occupancy, summed over domains (a level, not a counter).
    pub llc_occupancy_bytes: Option<u64>,
    /// Cumulative bytes to memory, summed over domains.
    pub mbm_total_bytes: Option<u64>,
    /// Cumulative bytes to local memory.
    pub mbm_local_bytes: Option<u64>,
    /// Identity of the group directory; a different one means the group was recreated.
    pub identity: u64,
}

/// The resctrl interface of one host.
#[derive(Debug, Clone)]
pub struct Resctrl {
    fs: Arc<dyn KernelFs>,
    info: ResctrlInfo,
}

/// Finds the resctrl mount point in mountinfo text (parsed by [`crate::mountinfo`]);
/// returns it and its options (per-mount and per-superblock).
pub fn find_mount(mountinfo: &str) -> Option<(PathBuf, Vec<String>)> {
    crate::mountinfo::parse(mountinfo)
        .into_iter()
        .find(|m| m.fs_type == "resctrl")
        .map(|m| {
            let opts = m.mount_options.into_iter().chain(m.super_options).collect();
            (m.mount_point, opts)
        })
}

impl Resctrl {
    /// Opens resctrl on this host: `paths.resctrl` if set, else the mount in mountinfo.
    /// `Ok(None)` when the host has no resctrl mounted (absent, not broken).
    pub fn discover(
        paths: &HostPaths,
        fs: Arc<dyn KernelFs>,
    ) -> Result<Option<Self>, ResctrlError> {
        let mountinfo_path = paths.proc.join("self/mountinfo");
        let (root, opts) = match &paths.resctrl {
            Some(r) => {
                let opts = fs
                    .read_to_string(&mountinfo_path)
                    .ok()
                    .and_then(|m| find_mount(&m))
                    .map(|(_, o)| o)
                    .unwrap_or_default();
                (r.clone(), opts)
            }
            None => {
                let text = fs
                    .read_to_string(&mountinfo_path)
                    .map_err(|e| IoError::new("reading", &mountinfo_path, e))?;
                match find_mount(&text) {
                    Some(m) => m,
                    None => return Ok(None),
                }
            }
        };
        if fs.subdirs(&root.join("info")).is_err() {
            return Ok(None);
        }
        // AMD's MB values are absolute; the vendor says which units apply.
        let vendor_amd =
            <procfs::CpuInfo as procfs::FromRead>::from_file(paths.proc.join("cpuinfo"))
                .is_ok_and(|c| c.get_field(0, "vendor_id") == Some("AuthenticAMD"));
        let info = read_info(fs.as_ref(), &root, &opts, vendor_amd)?;
        Ok(Some(Self { fs, info }))
    }

    /// What the host offers.
    pub fn info(&self) -> &ResctrlInfo {
        &self.info
    }

    fn read(&self, path: &Path) -> Result<String, IoError> {
        self.fs
            .read_to_string(path)
            .map_err(|e| IoError::new("reading", path, e))
    }

    fn group_dir(&self, name: &str) -> Result<PathBuf, ResctrlError> {
        validate_name(name)?;
        Ok(self.info.root.join(name))
    }

    /// Control groups that exist (not the root), sorted.
    pub fn groups(&self) -> Result<Vec<String>, ResctrlError> {
        let root = &self.info.root;
        let names = self
            .fs
            .subdirs(root)
            .map_err(|e| IoError::new("listing", root, e))?;
        Ok(names
            .into_iter()
            .filter(|n| !matches!(n.as_str(), "info" | "mon_groups" | "mon_data"))
            .collect())
    }

    /// Groups a previous cohabit run left behind.
    pub fn own_groups(&self) -> Result<Vec<String>, ResctrlError> {
        Ok(self
            .groups()?
            .into_iter()
            .filter(|g| g.starts_with(GROUP_PREFIX))
            .collect())
    }

    /// Creates group `name` (which must carry [`GROUP_PREFIX`]) unless it exists.
    pub fn ensure_group(&self, name: &str) -> Result<PathBuf, ResctrlError> {
        let dir = self.group_dir(name)?;
        if !name.starts_with(GROUP_PREFIX) {
            return Err(ResctrlError::BadName(name.to_string()));
        }
        let groups = self.groups()?;
        if groups.iter().any(|g| g == name) {
            return Ok(dir);
        }
        let used = u32::try_from(groups.len()).unwrap_or(u32::MAX) + 1;
        let num_closids = self.info.num_closids();
        if used >= num_closids {
            return Err(ResctrlError::OutOfClosids {
                num_closids,
                groups: used,
            });
        }
        match self.fs.create_dir(&dir) {
            Ok(()) => Ok(dir),
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => Err(ResctrlError::OutOfClosids {
                num_closids,
                groups: used,
            }),
            Err(e) => Err(IoError::new("creating resctrl group", &dir, e).into()),
        }
    }

    /// Removes one of cohabit's groups; its tasks return to the root group.
    pub fn remove_group(&self, name: &str) -> Result<(), ResctrlError> {
        let dir = self.group_dir(name)?;
        if !name.starts_with(GROUP_PREFIX) {
            return Err(ResctrlError::BadName(name.to_string()));
        }
        match self.fs.remove_dir(&dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(IoError::new("removing resctrl group", &dir, e).into()),
        }
    }

    /// The schemata lines an allocation asks for ([`ResctrlInfo::schemata_for`]).
    pub fn schemata_for(&self, alloc: &Allocation) -> Schemata {
        self.info.schemata_for(alloc)
    }

    /// The schemata of a group (`None` for the root group).
    pub fn schemata(&self, group: Option<&str>) -> Result<Schemata, ResctrlError> {
        let dir = match group {
            Some(g) => self.group_dir(g)?,
            None => self.info.root.clone(),
        };
        let path = dir.join("schemata");
        let text = self.read(&path)?;
        Schemata::parse(&text).map_err(|e| ResctrlError::Parse {
            path,
            detail: e.to_string(),
        })
    }

    /// Makes group `name` hold `desired`, writing only the lines and domains that differ,
    /// under the mount's lock. Returns what was written (empty if nothing changed).
    pub fn apply(&self, name: &str, desired: &Schemata) -> Result<Schemata, ResctrlError> {
        self.apply_undoable(name, desired).map(|a| a.written)
    }

    /// [`Self::apply`], also returning what the changed lines held before (read under the
    /// same lock), so a caller can restore the group if a later step fails.
    pub fn apply_undoable(&self, name: &str, desired: &Schemata) -> Result<Applied, ResctrlError> {
        self.apply_at(Some(name), desired)
    }

    /// [`Self::apply_undoable`] for the root (default) group, which holds every task no
    /// control group claims: what it holds is the cache that processes cohabit does not
    /// manage may use.
    pub fn apply_root_undoable(&self, desired: &Schemata) -> Result<Applied, ResctrlError> {
        self.apply_at(None, desired)
    }

    fn apply_at(&self, group: Option<&str>, desired: &Schemata) -> Result<Applied, ResctrlError> {
        let dir = match group {
            Some(g) => self.group_dir(g)?,
            None => self.info.root.clone(),
        };
        let root = &self.info.root;
        let _lock = self
            .fs
            .lock_exclusive(root)
            .map_err(|e| IoError::new("locking", root, e))?;
        let current = self.schemata(group)?;
        let changes = desired.changes_from(&current);
        if changes.is_empty() {
            return Ok(Applied::default());
        }
        let previous = current.values_at(&changes);
        let text = changes.to_string();
        let path = dir.join("schemata");
        if let Err(e) = self.fs.write(&path, &text) {
            let status_path = root.join("info/last_cmd_status");
            let status = self
                .fs
                .read_to_string(&status_path)
                .map(|s| s.trim().to_string())
                .unwrap_or_else(|_| e.to_string());
            return Err(ResctrlError::Rejected {
                group: group.unwrap_or(ROOT_GROUP_LABEL).to_string(),
                written: text,
                status,
            });
        }
        Ok(Applied {
            written: changes,
            previous,
        })
    }

    /// Task ids in a group (`None`: the root group).
    pub fn tasks(&self, group: Option<&str>) -> Result<Vec<u32>, ResctrlError> {
        let dir = match group {
            Some(g) => self.group_dir(g)?,
            None => self.info.root.clone(),
        };
        let path = dir.join("tasks");
        parse_tasks(&self.read(&path)?).map_err(|detail| ResctrlError::Parse { path, detail })
    }

    /// Moves tasks into a group (`None`: back to the root group). Tasks that no longer
    /// exist are skipped; returns how many were moved.
    pub fn move_tasks(&self, group: Option<&str>, tids: &[u32]) -> Result<usize, ResctrlError> {
        let dir = match group {
            Some(g) => self.group_dir(g)?,
            None => self.info.root.clone(),
        };
        let path = dir.join("tasks");
        let mut moved = 0;
        for tid in tids {
            match self.fs.write(&path, &format!("{tid}\n")) {
                Ok(()) => moved += 1,
                Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
                Err(e) => return Err(IoError::new("moving a task into", &path, e).into()),
            }
        }
        Ok(moved)
    }

    /// The directory of monitoring group `mon` under control group `ctrl`.
    fn mon_dir(&self, ctrl: &str, mon: &str) -> Result<PathBuf, ResctrlError> {
        validate_name(mon)?;
        Ok(self.group_dir(ctrl)?.join("mon_groups").join(mon))
    }

    /// Monitoring groups under control group `ctrl`, sorted.
    pub fn mon_groups(&self, ctrl: &str) -> Result<Vec<String>, ResctrlError> {
        let dir = self.group_dir(ctrl)?.join("mon_groups");
        let mut names = self
            .fs
            .subdirs(&dir)
            .map_err(|e| IoError::new("listing", &dir, e))?;
        names.sort();
        Ok(names)
    }

    /// Creates monitoring group `mon` (its own RMID) under control group `ctrl` unless it
    /// exists.
    pub fn ensure_mon_group(&self, ctrl: &str, mon: &str) -> Result<PathBuf, ResctrlError> {
        let dir = self.mon_dir(ctrl, mon)?;
        if self.mon_groups(ctrl)?.iter().any(|m| m == mon) {
            return Ok(dir);
        }
        match self.fs.create_dir(&dir) {
            Ok(()) => Ok(dir),
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => {
                Err(
                    IoError::new("creating resctrl monitoring group (out of RMIDs)", &dir, e)
                        .into(),
                )
            }
            Err(e) => Err(IoError::new("creating resctrl monitoring group", &dir, e).into()),
        }
    }

    /// Removes monitoring group `mon` of control group `ctrl`; its tasks stay in `ctrl`.
    pub fn remove_mon_group(&self, ctrl: &str, mon: &str) -> Result<(), ResctrlError> {
        let dir = self.mon_dir(ctrl, mon)?;
        match self.fs.remove_dir(&dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(IoError::new("removing resctrl monitoring group", &dir, e).into()),
        }
    }

    /// Task ids in monitoring group `mon` of control group `ctrl`.
    pub fn mon_tasks(&self, ctrl: &str, mon: &str) -> Result<Vec<u32>, ResctrlError> {
        let path = self.mon_dir(ctrl, mon)?.join("tasks");
        parse_tasks(&self.read(&path)?).map_err(|detail| ResctrlError::Parse { path, detail })
    }

    /// Moves tasks of control group `ctrl` into its monitoring group `mon` (a task not in
    /// `ctrl` is refused by the kernel). Tasks that no longer exist are skipped; returns
    /// how many were moved.
    pub fn move_tasks_to_mon(
        &self,
        ctrl: &str,
        mon: &str,
        tids: &[u32],
    ) -> Result<usize, ResctrlError> {
        let path = self.mon_dir(ctrl, mon)?.join("tasks");
        let mut moved = 0;
        for tid in tids {
            match self.fs.write(&path, &format!("{tid}\n")) {
                Ok(()) => moved += 1,
                Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
                Err(e) => {
                    return Err(IoError::new("moving a task into", &path, e).into());
                }
            }
        }
        Ok(moved)
    }

    /// Monitoring counters of monitoring group `mon` under control group `ctrl` (its own
    /// RMID: only its tasks), summed over L3 domains.
    pub fn read_mon_group(&self, ctrl: &str, mon: &str) -> Result<MonReading, ResctrlError> {
        let dir = self.mon_dir(ctrl, mon)?;
        self.read_mon_dir(&dir)
    }

    /// Monitoring counters of a group, summed over its L3 domains (a control group's count
    /// its monitoring groups' tasks too).
    pub fn read_mon(&self, group: Option<&str>) -> Result<MonReading, ResctrlError> {
        let dir = match group {
            Some(g) => self.group_dir(g)?,
            None => self.info.root.clone(),
        };
        self.read_mon_dir(&dir)
    }

    fn read_mon_dir(&self, dir: &Path) -> Result<MonReading, ResctrlError> {
        let dir = dir.to_path_buf();
        let identity = self
            .fs
            .identity(&dir)
            .map_err(|e| IoError::new("reading", &dir, e))?;
        let mon = dir.join("mon_data");
        let domains = self
            .fs
            .subdirs(&mon)
            .map_err(|e| IoError::new("listing", &mon, e))?;
        let mut r = MonReading {
            identity,
            ..MonReading::default()
        };
        let sum = |file: &str| -> Result<Option<u64>, ResctrlError> {
            let mut total = Some(0u64);
            let mut any = false;
            for d in domains.iter().filter(|d| d.starts_with("mon_L3_")) {
                let path = mon.join(d).join(file);
                let text = match self.fs.read_to_string(&path) {
                    Ok(t) => t,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
                    Err(e) => return Err(IoError::new("reading", &path, e).into()),
                };
                any = true;
                let v = parse_counter(&text).map_err(|detail| ResctrlError::Parse {
                    path: path.clone(),
                    detail,
                })?;
                total = match (total, v) {
                    (Some(t), Some(v)) => Some(t.saturating_add(v)),
                    _ => None,
                };
            }
            Ok(if any { total } else { None })
        };
        r.llc_occupancy_bytes = sum("llc_occupancy")?;
        r.mbm_total_bytes = sum("mbm_total_bytes")?;
        r.mbm_local_bytes = sum("mbm_local_bytes")?;
        Ok(r)
    }
}

/// Turns two monitoring readings into a bandwidth, or nothing when it cannot be trusted.
#[derive(Debug, Clone, Default)]
pub struct BandwidthRate {
    /// Readings dropped as implausible so far.
    pub dropped: u64,
    /// Largest believable rate (e.g. a few times the host's peak).
    pub max_bytes_per_s: f64,
}

impl BandwidthRate {
    /// Rate from `prev` to `cur` over `dt_s`: `None` when either is unavailable, the group
    /// was recreated, the counter went backwards, or the rate is implausible (counted).
    pub fn rate(&mut self, prev: &MonReading, cur: &MonReading, dt_s: f64) -> Option<f64> {
        let (a, b) = (prev.mbm_total_bytes?, cur.mbm_total_bytes?);
        if prev.identity != cur.identity || b < a || dt_s <= 0.0 {
            return None;
        }
        let rate = (b - a) as f64 / dt_s;
        if rate > self.max_bytes_per_s {
            self.dropped += 1;
            return None;
        }
        Some(rate)
    }
}

/// Checks a group name: our prefix is checked by the callers that create or remove.
pub fn validate_name(name: &str) -> Result<(), ResctrlError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_GROUP_NAME
        && !name.starts_with('.')
        && !name.contains('/')
        && !name.chars().any(|c| c.is_control() || c.is_whitespace())
        && !matches!(name, "info" | "mon_groups" | "mon_data");
    if ok {
        Ok(())
    } else {
        Err(ResctrlError::BadName(name.to_string()))
    }
}

/// Parses a `tasks` file: one id per line.
pub fn parse_tasks(text: &str) -> Result<Vec<u32>, String> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(|l| {
            l.parse::<u32>()
                .map_err(|_| format!("task id {l:?} is not a number"))
        })
        .collect()
}

/// Parses a monitoring counter: a number, or `Unavailable`.
pub fn parse_counter(text: &str) -> Result<Option<u64>, String> {
    let t = text.trim();
    if t == "Unavailable" {
        return Ok(None);
    }
    t.parse::<u64>()
        .map(Some)
        .map_err(|_| format!("counter {t:?} is neither a number nor Unavailable"))
}

/// Reads the files under a resctrl root: a missing file is `None`, a number that does not
/// parse is an error naming the file.
struct InfoFiles<'a> {
    fs: &'a dyn KernelFs,
}

impl InfoFiles<'_> {
    fn read(&self, p: PathBuf) -> Result<Option<String>, ResctrlError> {
        match self.fs.read_to_string(&p) {
            Ok(s) => Ok(Some(s.trim().to_string())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(IoError::new("reading", &p, e).into()),
        }
    }

    fn num(&self, p: PathBuf) -> Result<Option<u64>, ResctrlError> {
        self.read(p.clone())?
            .map(|s| {
                s.parse::<u64>().map_err(|_| ResctrlError::Parse {
                    path: p,
                    detail: format!("{s:?} is not a number"),
                })
            })
            .transpose()
    }

    fn hex(&self, p: PathBuf) -> Result<Option<u64>, ResctrlError> {
        self.read(p.clone())?
            .map(|s| {
                u64::from_str_radix(&s, 16).map_err(|_| ResctrlError::Parse {
                    path: p,
                    detail: format!("{s:?} is not hex"),
                })
            })
            .transpose()
    }

    /// A number of `p` that fits a `u32`.
    fn num_u32(&self, p: PathBuf) -> Result<Option<u32>, ResctrlError> {
        Ok(self.num(p)?.and_then(|v| u32::try_from(v).ok()))
    }

    /// The L3 cache's allocation (`info/L3CODE` under CDP, else `info/L3`), when there is one.
    fn l3(&self, info: &Path) -> Result<Option<CacheInfo>, ResctrlError> {
        let subdirs = self.fs.subdirs(info).unwrap_or_default();
        let (d, cdp) = if subdirs.iter().any(|d| d == "L3CODE") {
            ("L3CODE", true)
        } else if subdirs.iter().any(|d| d == "L3") {
            ("L3", false)
        } else {
            return Ok(None);
        };
        let dir = info.join(d);
        self.hex(dir.join("cbm_mask"))?
            .map(|cbm_mask| -> Result<CacheInfo, ResctrlError> {
                Ok(CacheInfo {
                    cbm_mask,
                    min_cbm_bits: self.num_u32(dir.join("min_cbm_bits"))?.unwrap_or(1),
                    shareable_bits: self.hex(dir.join("shareable_bits"))?.unwrap_or(0),
                    num_closids: self.num_u32(dir.join("num_closids"))?.unwrap_or(0),
                    cdp,
                })
            })
            .transpose()
    }

    /// Memory bandwidth allocation (`info/MB`), when there is one, in the units the mount
    /// options (`opts`) and the vendor (`amd`) give it.
    fn mba(
        &self,
        root: &Path,
        info: &Path,
        opts: &[String],
        amd: bool,
    ) -> Result<Option<MbaInfo>, ResctrlError> {
        let mb_dir = info.join("MB");
        let Some(n) = self.num(mb_dir.join("num_closids"))? else {
            return Ok(None);
        };
        let min = self.num_u32(mb_dir.join("min_bandwidth"))?.unwrap_or(10);
        let gran = self.num_u32(mb_dir.join("bandwidth_gran"))?.unwrap_or(10);
        let units = if opts.iter().any(|o| o == "mba_MBps") {
            // The root group starts unthrottled: its value is the host's ceiling.
            let root_mb = self
                .read(root.join("schemata"))?
                .and_then(|t| Schemata::parse(&t).ok())
                .and_then(|s| s.domains("MB").first().and_then(|d| s.get("MB", *d)));
            MbaUnits::Mbps {
                max_mbps: root_mb
                    .and_then(|v| u32::try_from(v).ok())
                    .unwrap_or(u32::MAX),
            }
        } else if amd {
            MbaUnits::AmdEighthsGbps
        } else {
            MbaUnits::Percent { min, gran }
        };
        Ok(Some(MbaInfo {
            units,
            num_closids: u32::try_from(n).unwrap_or(0),
            delay_linear: self.read(mb_dir.join("delay_linear"))?.as_deref() == Some("1"),
            min_bandwidth: min,
            bandwidth_gran: gran,
        }))
    }

    /// Cache and bandwidth monitoring (`info/L3_MON`), when there is one.
    fn mon(&self, info: &Path) -> Result<Option<MonInfo>, ResctrlError> {
        let mon_dir = info.join("L3_MON");
        Ok(self.num(mon_dir.join("num_rmids"))?.map(|n| MonInfo {
            num_rmids: u32::try_from(n).unwrap_or(0),
            features: self
                .read(mon_dir.join("mon_features"))
                .ok()
                .flatten()
                .unwrap_or_default()
                .lines()
                .map(str::to_string)
                .collect(),
        }))
    }
}

fn read_info(
    fs: &dyn KernelFs,
    root: &Path,
    opts: &[String],
    amd: bool,
) -> Result<ResctrlInfo, ResctrlError> {
    let files = InfoFiles { fs };
    let info = root.join("info");
    let l3 = files.l3(&info)?;
    let mba = files.mba(root, &info, opts, amd)?;
    let mon = files.mon(&info)?;
    let root_schemata_path = root.join("schemata");
    let root_schemata = match files.read(root_schemata_path.clone())? {
        Some(t) => Schemata::parse(&t).map_err(|e| ResctrlError::Parse {
            path: root_schemata_path,
            detail: e.to_string(),
        })?,
        None => Schemata::default(),
    };
    let l3_res = if l3.as_ref().is_some_and(|c| c.cdp) {
        "L3CODE"
    } else {
        "L3"
    };
    Ok(ResctrlInfo {
        root: root.to_path_buf(),
        l3_domains: root_schemata.domains(l3_res),
        mb_domains: root_schemata.domains("MB"),
        l3,
        mba,
        mon,
    })
}
