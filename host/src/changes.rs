//! What cohabit changed on the host and what was there before: enough to put the host back
//! from this record alone, on exit and, after a crash, from the state file
//! (docs/DESIGN.md 7: "a crash must never leave a host worse than before").
//!
//! The record is write-ahead: an original value is noted, and the record saved through a
//! [`ChangeLog`], *before* the write that replaces it. A crash between the two leaves a
//! note whose write never happened; restoring it writes back the value that is already
//! there, which is harmless. The reverse order could lose an original.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// One thing cohabit changed, with what it takes to put it back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Change {
    /// A control file of a cgroup cohabit did not create (the workload owner's), with its
    /// content before cohabit first wrote it.
    CgroupFile {
        /// The cgroup directory (absolute, under the injected cgroup root).
        dir: PathBuf,
        /// The control file, e.g. `cpuset.cpus`, `cpu.max`, `cpu.weight`, `cpu.shares`.
        file: String,
        /// Its content before cohabit's first write.
        original: String,
    },
    /// A cgroup directory cohabit created; removed on restore once its processes are back.
    CreatedCgroup {
        /// The directory.
        dir: PathBuf,
    },
    /// A process cohabit moved between cgroups (only for bare processes, where the
    /// configuration asks for it). Identified by pid *and* start time, so a reused pid is
    /// never moved back.
    MovedProcess {
        /// The process.
        pid: u32,
        /// Field 22 of `/proc/PID/stat` (clock ticks since boot).
        start_time: u64,
        /// The cgroup directory it was in, per hierarchy it was moved in.
        from: Vec<PathBuf>,
    },
    /// A resctrl control group cohabit created.
    ResctrlGroup {
        /// The group's name under the resctrl mount.
        name: String,
    },
    /// The cache lines of the root resctrl group's schemata (the cache every process no
    /// control group claims may use), before cohabit first narrowed them to the pool's
    /// ways (`[host] unmanaged_cache = "pool"`).
    ResctrlRootCache {
        /// The cache lines as the kernel held them (schemata text).
        original: String,
    },
    /// A file cohabit rewrote (a GPU client's environment file).
    File {
        /// The file.
        path: PathBuf,
        /// Its content before, or `None` when cohabit created it.
        original: Option<String>,
    },
}

/// Every change in force, oldest first. An original is noted once, at the first write;
/// later writes to the same file keep it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostChanges {
    /// The changes, oldest first.
    pub changes: Vec<Change>,
}

impl HostChanges {
    /// Notes `change` unless the same object is already noted (then its first original
    /// stays). Returns true when the record grew (and so must be saved before the write).
    pub fn note(&mut self, change: Change) -> bool {
        if self.changes.iter().any(|c| same_object(c, &change)) {
            return false;
        }
        self.changes.push(change);
        true
    }

    /// Drops every change for which `done` returns true (restored, or its process gone).
    /// Returns true when the record shrank.
    pub fn forget(&mut self, mut done: impl FnMut(&Change) -> bool) -> bool {
        let before = self.changes.len();
        self.changes.retain(|c| !done(c));
        self.changes.len() != before
    }

    /// True when nothing is in force.
    pub fn is_empty(&self) -> bool {
        self.changes.is_empty()
    }
}

/// Two changes about the same kernel object.
fn same_object(a: &Change, b: &Change) -> bool {
    match (a, b) {
        (
            Change::CgroupFile {
                dir: d1, file: f1, ..
            },
            Change::CgroupFile {
                dir: d2, file: f2, ..
            },
        ) => d1 == d2 && f1 == f2,
        (Change::CreatedCgroup { dir: d1 }, Change::CreatedCgroup { dir: d2 }) => d1 == d2,
        (
            Change::MovedProcess {
                pid: p1,
                start_time: s1,
                ..
            },
            Change::MovedProcess {
                pid: p2,
                start_time: s2,
                ..
            },
        ) => p1 == p2 && s1 == s2,
        (Change::ResctrlGroup { name: n1 }, Change::ResctrlGroup { name: n2 }) => n1 == n2,
        (Change::File { path: p1, .. }, Change::File { path: p2, .. }) => p1 == p2,
        (Change::ResctrlRootCache { .. }, Change::ResctrlRootCache { .. }) => true,
        _ => false,
    }
}

/// Where the record is kept: saved after it grows and before the write it describes.
pub trait ChangeLog: Send + std::fmt::Debug {
    /// Persists the whole record (atomically: a reader sees the old one or the new one).
    fn save(&mut self, changes: &HostChanges) -> std::io::Result<()>;
}

/// A record kept in memory only (tests, and `--dry-run`, which changes nothing).
#[derive(Debug, Default)]
pub struct InMemory;

impl ChangeLog for InMemory {
    fn save(&mut self, _: &HostChanges) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_original_of_a_file_is_kept_and_later_writes_do_not_replace_it() {
        let mut r = HostChanges::default();
        let file = |original: &str| Change::CgroupFile {
            dir: "/sys/fs/cgroup/system.slice/kv.service".into(),
            file: "cpuset.cpus".into(),
            original: original.into(),
        };
        assert!(r.note(file("0-7")));
        assert!(!r.note(file("0-3")), "a second write is not a new original");
        assert_eq!(r.changes, vec![file("0-7")]);
        let json = serde_json::to_string(&r).unwrap();
        assert_eq!(serde_json::from_str::<HostChanges>(&json).unwrap(), r);
    }

    #[test]
    fn a_reused_pid_is_a_different_process() {
        let mut r = HostChanges::default();
        let moved = |start_time| Change::MovedProcess {
            pid: 42,
            start_time,
            from: vec!["/sys/fs/cgroup/cpuset".into()],
        };
        assert!(r.note(moved(100)));
        assert!(r.note(moved(200)));
        assert!(r.forget(|c| matches!(
            c,
            Change::MovedProcess {
                start_time: 100,
                ..
            }
        )));
        assert_eq!(r.changes, vec![moved(200)]);
    }
}
