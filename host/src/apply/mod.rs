//! Host writes → the kernel, in a safe order, undone when a later write fails; processes
//! moved where the configuration asks; everything put back on exit, from the record of
//! changes alone.
//!
//! Order of [`apply`] (firecracker's jailer: every value first, processes last):
//! 1. resctrl: create the control groups that are missing, then write each group's
//!    schemata (only the lines that differ from the kernel's). At the CLOSID budget, groups
//!    no longer used go first, as many as the new ones need ([`make_room`]); their tasks
//!    wait in the root group until their new group holds its values, in the same apply;
//! 2. cgroups, into every target of each plan group (`crate::placement`: the cgroups the
//!    processes are in, and cohabit's own groups for processes it moves): create the own
//!    groups that are missing; CPU sets in the order of [`layout::cpu_steps`] (shrink before
//!    grow; two latency-critical groups never share a CPU in between); then CPU limits and
//!    weights; values are compared with what the kernel holds and only the differences
//!    written;
//! 3. GPU shares (environment files);
//! 4. commit: the writes become the [`Record`]; resctrl groups no longer used are removed
//!    (their threads fall back to the root group until [`attach_resctrl`] moves them).
//!
//! Processes are moved afterwards ([`move_processes`]), when the values are in place.
//!
//! The record of changes ([`HostChanges`]) is write-ahead: before cohabit first writes a
//! control file of a cgroup it did not create, the file's content is noted; before it
//! creates a cgroup or a resctrl group, or moves a process, that is noted; each time the
//! record grows it is saved through the [`ChangeLog`] before the write it describes. A
//! control file of a group cohabit created is not noted: the group goes on restore. When
//! the layout asks for no CPU limit, an owner's cgroup gets its own limit back (the noted
//! original) rather than "none": cohabit only lifts what it imposed.
//!
//! A cgroup that stops being a target (the service's processes left it) gets its noted
//! originals back at once.
//!
//! Rollback: before each write the value it replaces is noted in a journal (read from the
//! kernel), or "remove" for a group created in this apply. When a write fails, the journal
//! is played back in reverse order (the forward order reversed, so still safe) and the
//! error is returned: the host is as it was, the record and the plan the loop keeps are
//! unchanged. Unused groups are removed only after every write succeeded, because a
//! removal cannot be undone (the kernel moves the group's threads). An undo that fails is
//! logged; since every apply compares with the kernel, the next one rewrites whatever was
//! left.
//!
//! Restore ([`restore_changes`]) needs nothing but a [`HostChanges`] record, so the same
//! function serves the exit path and the start after a crash: processes moved go back
//! where they were (if the same process, by start time, still exists); cohabit's groups
//! are emptied (a process forked inside goes where the moved processes came from) and
//! removed; owners' control files get their original content back, newest first; resctrl
//! groups are removed; GPU environment files are put back. What could not be restored is
//! returned, to be kept and retried.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use cohabit_collectors::cgroup::{Cgroups, Controller, CpuList, IDLE_FILE};
use cohabit_collectors::procfs::Procfs;
use cohabit_collectors::resctrl::{Resctrl, Schemata};
use cohabit_core::BEST_EFFORT_GROUP;

use super::changes::{Change, ChangeLog, HostChanges, InMemory};
use super::layout::{self, HostWrites};
use super::placement::{Move, Target, Targets};
use super::{HostError, WarnLimit};
use crate::gpu::{self, GpuActuator, GpuError, NoteFailed};

mod cgroup;
mod members;
mod resctrl;
mod restore;
#[cfg(test)]
mod tests;

use self::cgroup::*;
pub(crate) use self::members::{
    attach_resctrl, forget_vanished, move_processes, prune_mon_groups, Members,
};
use self::resctrl::*;
pub use self::restore::restore_changes;
use self::restore::*;
pub(crate) use self::restore::{clean_leftovers, restore};

/// The kernel interfaces cohabit writes to (each absent when the host lacks it or it is not
/// writable).
#[derive(Debug)]
pub struct Kernel {
    /// cgroups, when CPU sets or limits can be written.
    pub cgroups: Option<Cgroups>,
    /// resctrl, when mounted.
    pub resctrl: Option<Resctrl>,
}

/// What cohabit has put in force on the host, and what it must undo on exit.
#[derive(Debug)]
pub(super) struct Record {
    /// The writes of the last apply that succeeded.
    pub writes: HostWrites,
    /// The cgroups they went to.
    pub targets: Targets,
    /// Every change in force, with the originals (write-ahead, see the module doc).
    pub changes: HostChanges,
    /// Where `changes` is kept.
    log: Box<dyn ChangeLog>,
}

impl Default for Record {
    fn default() -> Self {
        Self {
            writes: HostWrites::default(),
            targets: Targets::default(),
            changes: HostChanges::default(),
            log: Box::new(InMemory),
        }
    }
}

impl Record {
    /// Keeps the record through `log` from now on (saved at once).
    pub fn set_log(&mut self, log: Box<dyn ChangeLog>) -> Result<(), HostError> {
        self.log = log;
        self.save()
    }

    fn save(&mut self) -> Result<(), HostError> {
        self.log.save(&self.changes).map_err(HostError::ChangeLog)
    }

    /// Notes `change` and, when the record grew, saves it: call before the write it
    /// describes, and do not write when this fails.
    pub fn note(&mut self, change: Change) -> Result<(), HostError> {
        if self.changes.note(change) {
            self.save()?;
        }
        Ok(())
    }

    /// Drops the changes `done` selects and saves the record if it shrank (a failed save
    /// only leaves extra notes, which restore treats as already done).
    pub fn forget(&mut self, done: impl FnMut(&Change) -> bool) {
        if self.changes.forget(done) {
            if let Err(e) = self.save() {
                tracing::warn!(error = %e, "could not save the record of changes");
            }
        }
    }

    /// The original content of control file `file` of the owner's cgroup `dir`, if noted.
    fn original(&self, dir: &Path, file: &str) -> Option<&str> {
        self.changes.changes.iter().find_map(|c| match c {
            Change::CgroupFile {
                dir: d,
                file: f,
                original,
            } if d == dir && f == file => Some(original.as_str()),
            _ => None,
        })
    }

    /// The resctrl group in force for plan group `group`.
    pub fn resctrl_group_of(&self, group: &str) -> Option<&str> {
        self.writes.resctrl_group_of(group)
    }
}

/// How to take one write back.
#[derive(Debug)]
enum Undo {
    RemoveResctrlGroup(String),
    /// A group removed early to make room ([`make_room`]): created again with its values
    /// and tasks.
    RecreateResctrlGroup {
        name: String,
        schemata: Schemata,
        tasks: Vec<u32>,
    },
    Schemata {
        group: String,
        previous: Schemata,
    },
    /// The root group's cache lines as they were before this apply.
    RootCache(Schemata),
    RemoveCgroup(PathBuf),
    File {
        dir: PathBuf,
        file: String,
        previous: String,
    },
    Gpu {
        service: String,
        previous: Option<u8>,
    },
}

/// The writes of one apply so far, newest last.
#[derive(Debug, Default)]
struct Journal(Vec<Undo>);

impl Journal {
    /// Plays the notes back, newest first; failures are logged and counted. Groups it
    /// removes leave the record too.
    fn roll_back(
        self,
        k: &Kernel,
        record: &mut Record,
        gpu: &mut GpuActuator,
        pinned: Option<&str>,
    ) -> usize {
        let mut failed = 0;
        for undo in self.0.into_iter().rev() {
            let what = format!("{undo:?}");
            if let Err(e) = undo.play(k, record, gpu, pinned) {
                failed += 1;
                tracing::error!(undo = %what, error = %e, "could not undo a write; the next apply rewrites it");
            }
        }
        failed
    }
}

/// Why one write could not be undone (a rollback), or one recorded change restored.
#[derive(Debug, thiserror::Error)]
enum UndoError {
    /// The interface the note is for is not in use (cannot happen: the journal holds a
    /// note for an interface only after writing through it).
    #[error("{0} is not in use")]
    NotInUse(&'static str),
    /// resctrl refused or failed.
    #[error(transparent)]
    Resctrl(#[from] cohabit_collectors::resctrl::ResctrlError),
    /// A cgroup write or removal failed.
    #[error(transparent)]
    Cgroup(#[from] cohabit_collectors::cgroup::CgroupError),
    /// The recreated group could not be noted in the record of changes first.
    #[error("noting the recreated group: {0}")]
    Record(Box<HostError>),
    /// The GPU share could not be taken back.
    #[error(transparent)]
    Gpu(#[from] GpuError),
    /// A recorded root cache line that does not parse.
    #[error("the recorded root cache lines: {0}")]
    Schemata(#[from] cohabit_collectors::resctrl::SchemataError),
    /// An environment file could not be put back.
    #[error(transparent)]
    File(#[from] crate::files::FileError),
    /// A recorded cgroup outside cohabit's parent: left alone.
    #[error("{} is not under cohabit's parent; left alone", .0.display())]
    NotOwn(PathBuf),
    /// A recorded cgroup in no hierarchy in use.
    #[error("{} is in no hierarchy in use", .0.display())]
    NoHierarchy(PathBuf),
}

impl Undo {
    /// Puts back what this note describes.
    fn play(
        self,
        k: &Kernel,
        record: &mut Record,
        gpu: &mut GpuActuator,
        pinned: Option<&str>,
    ) -> Result<(), UndoError> {
        match self {
            Undo::RemoveResctrlGroup(g) => {
                resctrl(k)?.remove_group(&g)?;
                record.forget(|c| matches!(c, Change::ResctrlGroup { name } if *name == g));
            }
            Undo::RecreateResctrlGroup {
                name,
                schemata,
                tasks,
            } => {
                let r = resctrl(k)?;
                record
                    .note(Change::ResctrlGroup { name: name.clone() })
                    .map_err(|e| UndoError::Record(Box::new(e)))?;
                r.ensure_group(&name)?;
                r.apply(&name, &schemata)?;
                r.move_tasks(Some(&name), &tasks)?;
            }
            Undo::Schemata { group, previous } => {
                resctrl(k)?.apply(&group, &previous)?;
            }
            Undo::RootCache(previous) => {
                resctrl(k)?.apply_root_undoable(&previous)?;
            }
            Undo::RemoveCgroup(d) => {
                cgroups(k)?.remove_dir(&d)?;
                record.forget(|c| matches!(c, Change::CreatedCgroup { dir } if *dir == d));
            }
            Undo::File {
                dir,
                file,
                previous,
            } => cgroups(k)?.write_control(&dir, &file, &previous)?,
            Undo::Gpu { service, previous } => gpu.revert(&service, previous, pinned)?,
        }
        Ok(())
    }
}

// The journal holds a note for an interface only after writing through it, so these are
// always present when asked.
fn resctrl(k: &Kernel) -> Result<&Resctrl, UndoError> {
    k.resctrl.as_ref().ok_or(UndoError::NotInUse("resctrl"))
}

fn cgroups(k: &Kernel) -> Result<&Cgroups, UndoError> {
    k.cgroups.as_ref().ok_or(UndoError::NotInUse("cgroups"))
}

/// Writes `next` to `targets` on the host (see the module doc for the order, the record
/// and the rollback rule).
pub(super) fn apply(
    k: &Kernel,
    record: &mut Record,
    next: HostWrites,
    targets: &Targets,
    gpu: &mut GpuActuator,
    pinned: Option<&str>,
) -> Result<(), HostError> {
    let mut journal = Journal::default();
    let written = write_resctrl(k, record, &next, &mut journal)
        .and_then(|()| write_cgroups(k, record, &next, targets, &mut journal))
        .and_then(|()| write_gpu(record, &next, gpu, pinned, &mut journal));
    if let Err(e) = written {
        let notes = journal.0.len();
        let failed = journal.roll_back(k, record, gpu, pinned);
        tracing::info!(
            undone = notes - failed,
            failed,
            "a write failed; earlier writes of this apply undone"
        );
        return Err(e);
    }
    let unused: Vec<String> = record
        .writes
        .resctrl
        .iter()
        .filter(|old| !next.resctrl.iter().any(|g| g.name == old.name))
        .map(|g| g.name.clone())
        .collect();
    let dropped = dropped_owner_cgroups(&record.targets, targets);
    record.writes = next;
    record.targets = targets.clone();
    give_back(k, record, &dropped);
    if let Some(r) = &k.resctrl {
        for g in unused {
            match r.remove_group(&g) {
                Ok(()) => {
                    record.forget(|c| matches!(c, Change::ResctrlGroup { name } if *name == g))
                }
                Err(e) => {
                    tracing::warn!(group = %g, error = %e, "could not remove a resctrl group no longer used");
                }
            }
        }
    }
    Ok(())
}

/// Owners' cgroups that were targets and are no longer (the service's processes left
/// them): their values go back to the owner.
fn dropped_owner_cgroups(before: &Targets, after: &Targets) -> BTreeSet<PathBuf> {
    let dirs = |t: &Targets| -> BTreeSet<PathBuf> {
        t.values()
            .flatten()
            .filter(|t| !t.own)
            .map(|t| t.dir.clone())
            .collect()
    };
    dirs(before).difference(&dirs(after)).cloned().collect()
}

/// Puts the noted originals of the cgroups `dirs` back (newest first) and forgets them.
fn give_back(k: &Kernel, record: &mut Record, dirs: &BTreeSet<PathBuf>) {
    let notes: Vec<Change> = record
        .changes
        .changes
        .iter()
        .rev()
        .filter(|c| matches!(c, Change::CgroupFile { dir, .. } if dirs.contains(dir)))
        .cloned()
        .collect();
    for c in notes {
        let Change::CgroupFile {
            dir,
            file,
            original,
        } = &c
        else {
            continue;
        };
        match restore_file(k, dir, file, original) {
            Ok(()) => record.forget(|x| *x == c),
            Err(e) => {
                tracing::warn!(cgroup = %dir.display(), file = %file, error = %e, "could not give a cgroup its value back; kept for the restore on exit");
            }
        }
    }
}

/// Writes `value` to control file `file` of cgroup `dir` unless the kernel already holds
/// it; the original is noted first for a cgroup cohabit did not create.
fn write_file(
    cg: &Cgroups,
    record: &mut Record,
    journal: &mut Journal,
    t: &Target,
    file: &str,
    value: &str,
) -> Result<(), HostError> {
    let current = cg.read_control(&t.dir, file)?;
    let same = if file == "cpuset.cpus" {
        current.parse::<CpuList>().ok() == value.parse::<CpuList>().ok()
    } else {
        current.trim() == value.trim()
    };
    if same {
        return Ok(());
    }
    note_original(record, t, file, &current)?;
    cg.write_control(&t.dir, file, value)?;
    journal.0.push(Undo::File {
        dir: t.dir.clone(),
        file: file.to_string(),
        previous: current,
    });
    Ok(())
}

/// Notes `current`, the content of `file` before cohabit's first write, for an owner's
/// cgroup (a group cohabit created goes on restore, its files with it).
fn note_original(
    record: &mut Record,
    t: &Target,
    file: &str,
    current: &str,
) -> Result<(), HostError> {
    if !t.own {
        record.note(Change::CgroupFile {
            dir: t.dir.clone(),
            file: file.to_string(),
            original: current.to_string(),
        })?;
    }
    Ok(())
}

fn write_gpu(
    record: &mut Record,
    next: &HostWrites,
    gpu: &mut GpuActuator,
    pinned: Option<&str>,
    journal: &mut Journal,
) -> Result<(), HostError> {
    for share in &next.gpu {
        let previous = gpu.published(&share.service);
        if previous == Some(share.pct) {
            continue;
        }
        gpu.publish_noted(&share.service, share.pct, pinned, &mut |c| {
            record.note(c).map_err(|e| Box::new(e) as NoteFailed)
        })?;
        journal.0.push(Undo::Gpu {
            service: share.service.clone(),
            previous,
        });
    }
    Ok(())
}
