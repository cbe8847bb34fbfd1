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
use super::{HostError, Throttle};
use crate::gpu::{self, GpuActuator, GpuError, NoteFailed};

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

fn write_resctrl(
    k: &Kernel,
    record: &mut Record,
    next: &HostWrites,
    journal: &mut Journal,
) -> Result<(), HostError> {
    let Some(r) = &k.resctrl else { return Ok(()) };
    let mut existing: BTreeSet<String> = r.groups()?.into_iter().collect();
    let evicted = make_room(r, record, next, &mut existing, journal)?;
    for g in &next.resctrl {
        if !existing.contains(&g.name) {
            record.note(Change::ResctrlGroup {
                name: g.name.clone(),
            })?;
            if let Err(e) = r.ensure_group(&g.name) {
                record.forget(|c| matches!(c, Change::ResctrlGroup { name } if *name == g.name));
                return Err(e.into());
            }
            journal.0.push(Undo::RemoveResctrlGroup(g.name.clone()));
        }
    }
    for g in &next.resctrl {
        let applied = r.apply_undoable(&g.name, &g.schemata)?;
        if existing.contains(&g.name) && !applied.written.is_empty() {
            journal.0.push(Undo::Schemata {
                group: g.name.clone(),
                previous: applied.previous,
            });
        }
    }
    write_root_cache(r, record, next, journal)?;
    // The tasks of the groups removed early wait in the root group only until their new
    // group holds its values.
    for (to, tasks) in evicted {
        if let Err(e) = r.move_tasks(Some(&to), &tasks) {
            tracing::warn!(group = %to, error = %e, "could not move the tasks of a removed resctrl group into their new group; the next tick attaches them");
        }
    }
    Ok(())
}

/// The root group's cache lines: narrowed to the pool's when `next` asks for it (the
/// original noted first, once), given back when it no longer does.
fn write_root_cache(
    r: &Resctrl,
    record: &mut Record,
    next: &HostWrites,
    journal: &mut Journal,
) -> Result<(), HostError> {
    let noted = record.changes.changes.iter().find_map(|c| match c {
        Change::ResctrlRootCache { original } => Some(original.clone()),
        _ => None,
    });
    match (&next.root_cache, noted) {
        (Some(want), noted) => {
            if noted.is_none() {
                let original = r.schemata(None)?.cache_only().to_string();
                record.note(Change::ResctrlRootCache { original })?;
            }
            let applied = r.apply_root_undoable(want)?;
            if !applied.written.is_empty() {
                journal.0.push(Undo::RootCache(applied.previous));
            }
        }
        (None, Some(original)) => {
            let result = Schemata::parse(&original)
                .map_err(UndoError::from)
                .and_then(|o| Ok(r.apply_root_undoable(&o)?));
            match result {
                Ok(applied) => {
                    record.forget(|c| matches!(c, Change::ResctrlRootCache { .. }));
                    if !applied.written.is_empty() {
                        journal.0.push(Undo::RootCache(applied.previous));
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "could not give the root resctrl group its cache back; kept for the restore on exit");
                }
            }
        }
        (None, None) => {}
    }
    Ok(())
}

/// At the CLOSID budget, removes groups of the last apply that `next` does not keep before
/// `next`'s new groups are created, as many as the new ones need (a regrouping would
/// otherwise need one CLOSID more for a moment and fail). Each removed group's tasks go to
/// the root group when it is removed; returns, for each removed group whose members all
/// go to one group of `next`, that group and the tasks to move there once it holds its
/// values. The journal can recreate a removed group with its values and tasks.
fn make_room(
    r: &Resctrl,
    record: &mut Record,
    next: &HostWrites,
    existing: &mut BTreeSet<String>,
    journal: &mut Journal,
) -> Result<Vec<(String, Vec<u32>)>, HostError> {
    let new = next
        .resctrl
        .iter()
        .filter(|g| !existing.contains(&g.name))
        .count();
    // The root group holds a CLOSID too.
    let used = existing.len() + 1;
    let closids = r.info().num_closids() as usize;
    let short = (used + new).saturating_sub(closids);
    if short == 0 {
        return Ok(Vec::new());
    }
    let obsolete: Vec<(String, Option<String>)> = record
        .writes
        .resctrl
        .iter()
        .filter(|old| existing.contains(&old.name))
        .filter(|old| !next.resctrl.iter().any(|g| g.name == old.name))
        .map(|old| {
            let to: BTreeSet<Option<&str>> = old
                .members
                .iter()
                .map(|m| next.resctrl_group_of(m))
                .collect();
            let one = match to.into_iter().collect::<Vec<_>>().as_slice() {
                [Some(g)] => Some((*g).to_string()),
                _ => None,
            };
            (old.name.clone(), one)
        })
        .collect();
    let mut evicted = Vec::new();
    // Groups whose tasks can go straight to their new group first.
    let mut order: Vec<&(String, Option<String>)> = obsolete.iter().collect();
    order.sort_by_key(|(_, to)| to.is_none());
    for (name, to) in order.into_iter().take(short) {
        let schemata = r.schemata(Some(name))?;
        let tasks = r.tasks(Some(name))?;
        r.remove_group(name)?;
        tracing::info!(group = %name, "at the CLOSID budget: a resctrl group no longer used is removed before new ones are created");
        record.forget(|c| matches!(c, Change::ResctrlGroup { name: n } if n == name));
        existing.remove(name);
        journal.0.push(Undo::RecreateResctrlGroup {
            name: name.clone(),
            schemata,
            tasks: tasks.clone(),
        });
        if let Some(to) = to {
            evicted.push((to.clone(), tasks));
        }
    }
    Ok(evicted)
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

/// Creates cohabit's own group `dir` (and its parent) where missing, noting each first.
fn ensure_own(
    cg: &Cgroups,
    record: &mut Record,
    journal: &mut Journal,
    dir: &Path,
) -> Result<(), HostError> {
    for d in [dir.parent().unwrap_or(dir), dir] {
        if cg.exists(d) {
            continue;
        }
        record.note(Change::CreatedCgroup {
            dir: d.to_path_buf(),
        })?;
        cg.make_dir(d)?;
        journal.0.push(Undo::RemoveCgroup(d.to_path_buf()));
    }
    Ok(())
}

fn write_cgroups(
    k: &Kernel,
    record: &mut Record,
    next: &HostWrites,
    targets: &Targets,
    journal: &mut Journal,
) -> Result<(), HostError> {
    let Some(cg) = &k.cgroups else { return Ok(()) };
    let each = || {
        next.cgroups.iter().flat_map(|v| {
            targets
                .get(&v.group)
                .into_iter()
                .flatten()
                .map(move |t| (v, t))
        })
    };
    for (_, t) in each().filter(|(_, t)| t.own) {
        ensure_own(cg, record, journal, &t.dir)?;
    }
    // CPU sets: what the kernel holds, then the writes in a safe order.
    let mut current = BTreeMap::new();
    let mut desired = BTreeMap::new();
    let mut latency_critical = BTreeSet::new();
    let mut by_key = BTreeMap::new();
    for (v, t) in each().filter(|(_, t)| t.controller == Controller::Cpuset) {
        let Some(want) = &v.cpus else { continue };
        let key = t.dir.display().to_string();
        current.insert(key.clone(), cg.cpus_at(&t.dir)?);
        desired.insert(key.clone(), want.clone());
        if v.group != BEST_EFFORT_GROUP {
            latency_critical.insert(key.clone());
        }
        by_key.insert(key, t);
    }
    for (key, cpus) in layout::cpu_steps(&current, &desired, &latency_critical) {
        write_file(
            cg,
            record,
            journal,
            by_key[&key],
            "cpuset.cpus",
            &cpus.to_string(),
        )?;
    }
    for (v, t) in each().filter(|(_, t)| t.controller == Controller::Cpu) {
        if let Some(max) = v.cpu_max {
            for (file, value) in cg.cpu_max_files(max) {
                // No limit asked: an owner's cgroup keeps (or gets back) its own.
                let value = match (max.quota_us, t.own) {
                    (None, false) => match record.original(&t.dir, file) {
                        Some(original) => original.to_string(),
                        None => continue,
                    },
                    _ => value,
                };
                write_file(cg, record, journal, t, file, &value)?;
            }
        }
        write_class(cg, record, journal, t, v)?;
    }
    Ok(())
}

/// The weight and idle class of one cpu-controller target. The kernel refuses a weight for
/// a group in the idle class and resets it when the group leaves, so: into the class, the
/// weight is noted (for the restore and the undo, which both run newest first: the class
/// goes, then the weight comes back) and not written; out of it, the class goes before the
/// weight is written. A target without `cpu.idle` (a kernel before 5.15) gets the weight;
/// one its owner put in the class while cohabit does not manage the class (`idle` unset:
/// under `[kubernetes]`) is left as it is, since no weight can be written there.
fn write_class(
    cg: &Cgroups,
    record: &mut Record,
    journal: &mut Journal,
    t: &Target,
    v: &layout::CgroupValues,
) -> Result<(), HostError> {
    let idle_now = (v.weight.is_some() || v.idle.is_some())
        .then(|| cg.read_control(&t.dir, IDLE_FILE).ok())
        .flatten()
        .map(|text| text.trim() == "1");
    let weight = v.weight.map(|w| cg.weight_file(w));
    match (v.idle, idle_now) {
        (Some(true), Some(false)) => {
            if let Some((file, _)) = weight {
                keep_for_restore(cg, record, journal, t, file)?;
            }
            write_file(cg, record, journal, t, IDLE_FILE, "1")
        }
        (Some(true) | None, Some(true)) => Ok(()),
        (_, now) => {
            if now == Some(true) {
                write_file(cg, record, journal, t, IDLE_FILE, "0")?;
            }
            match weight {
                Some((file, value)) => write_file(cg, record, journal, t, file, &value),
                None => Ok(()),
            }
        }
    }
}

/// Notes the current content of `file` as if it were about to be written (the record and
/// the journal), for a write to another file that changes it as a side effect: the note
/// comes first, so it is put back after that write is undone.
fn keep_for_restore(
    cg: &Cgroups,
    record: &mut Record,
    journal: &mut Journal,
    t: &Target,
    file: &str,
) -> Result<(), HostError> {
    let current = cg.read_control(&t.dir, file)?;
    note_original(record, t, file, &current)?;
    journal.0.push(Undo::File {
        dir: t.dir.clone(),
        file: file.to_string(),
        previous: current,
    });
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

/// Moves processes into cohabit's groups (`placement = "move"`), each noted first with
/// its pid, start time and the cgroups it leaves. A process that exited meanwhile is
/// skipped (and its note dropped).
pub(super) fn move_processes(
    k: &Kernel,
    record: &mut Record,
    procfs: &Procfs,
    service: &str,
    moves: &[Move],
) {
    let Some(cg) = &k.cgroups else { return };
    for m in moves {
        if procfs.stat(m.pid).map(|s| s.start_ticks) != Some(m.start_time) {
            continue;
        }
        let note = Change::MovedProcess {
            pid: m.pid,
            start_time: m.start_time,
            from: m.hops.iter().map(|(from, _)| from.clone()).collect(),
        };
        if let Err(e) = record.note(note) {
            tracing::warn!(service, pid = m.pid, error = %e, "not moving a process whose origin could not be recorded");
            continue;
        }
        for (_, to) in &m.hops {
            match cg.move_process(to, m.pid) {
                Ok(true) => {}
                Ok(false) => {
                    let (pid, start) = (m.pid, m.start_time);
                    record.forget(|c| matches!(c, Change::MovedProcess { pid: p, start_time: s, .. } if *p == pid && *s == start));
                    break;
                }
                Err(e) => {
                    tracing::warn!(service, pid = m.pid, error = %e, "could not move a process into cohabit's group");
                }
            }
        }
        tracing::info!(
            service,
            pid = m.pid,
            "moved into cohabit's group (placement = \"move\")"
        );
    }
}

/// Drops the notes of moved processes that no longer exist (pid gone, or reused by a
/// process with another start time): there is nothing to put back.
pub(super) fn forget_vanished(record: &mut Record, procfs: &Procfs) {
    record.forget(|c| match c {
        Change::MovedProcess {
            pid, start_time, ..
        } => procfs.stat(*pid).map(|s| s.start_ticks) != Some(*start_time),
        _ => false,
    });
}

/// One service's processes, to be placed in its resctrl group.
#[derive(Debug)]
pub(super) struct Members<'a> {
    /// Service name (for logs).
    pub service: &'a str,
    /// Its plan group.
    pub group: &'a str,
    /// Every process it has now.
    pub found: &'a BTreeSet<u32>,
    /// Its monitoring group (own RMID) under the control group, when the control group
    /// holds other services too.
    pub mon: Option<&'a str>,
}

/// Puts every thread of a service's processes in its resctrl group, and, where the group is
/// shared, in the service's monitoring group under it (created here), so that its
/// occupancy and bandwidth are its own, not the group's.
pub(super) fn attach_resctrl(
    k: &Kernel,
    record: &Record,
    procfs: &Procfs,
    m: &Members<'_>,
    warn: &mut Throttle,
) {
    let (Some(r), Some(rg)) = (&k.resctrl, record.resctrl_group_of(m.group)) else {
        return;
    };
    let present: BTreeSet<u32> = match r.tasks(Some(rg)) {
        Ok(t) => t.into_iter().collect(),
        Err(e) => {
            if warn.allow(&format!("tasks:{rg}")) {
                tracing::warn!(group = %rg, error = %e, "resctrl group's tasks unreadable; moving every thread (logged once a minute)");
            }
            BTreeSet::new()
        }
    };
    let missing: Vec<u32> = m
        .found
        .iter()
        .flat_map(|p| procfs.threads(*p))
        .filter(|t| !present.contains(t))
        .collect();
    if let Err(e) = r.move_tasks(Some(rg), &missing) {
        if warn.allow(&format!("move:{rg}")) {
            tracing::warn!(service = %m.service, error = %e, "could not move threads into the resctrl group (logged once a minute)");
        }
    }
    let Some(mon) = m.mon else { return };
    let in_mon: BTreeSet<u32> = match r
        .ensure_mon_group(rg, mon)
        .and_then(|_| r.mon_tasks(rg, mon))
    {
        Ok(t) => t.into_iter().collect(),
        Err(e) => {
            if warn.allow(&format!("mon-group:{rg}/{mon}")) {
                tracing::warn!(service = %m.service, group = %rg, error = %e, "no monitoring group of its own in a shared resctrl group; its RDT monitoring is absent (logged once a minute)");
            }
            return;
        }
    };
    let missing: Vec<u32> = m
        .found
        .iter()
        .flat_map(|p| procfs.threads(*p))
        .filter(|t| !in_mon.contains(t))
        .collect();
    if let Err(e) = r.move_tasks_to_mon(rg, mon, &missing) {
        if warn.allow(&format!("move-mon:{rg}/{mon}")) {
            tracing::warn!(service = %m.service, error = %e, "could not move threads into the service's monitoring group (logged once a minute)");
        }
    }
}

/// Removes the monitoring groups under control group `ctrl` that no service uses any more
/// (`wanted`); their tasks stay in `ctrl`.
pub(super) fn prune_mon_groups(
    k: &Kernel,
    ctrl: &str,
    wanted: &BTreeSet<&str>,
    warn: &mut Throttle,
) {
    let Some(r) = &k.resctrl else { return };
    let Ok(present) = r.mon_groups(ctrl) else {
        return;
    };
    for m in present.iter().filter(|m| !wanted.contains(m.as_str())) {
        if let Err(e) = r.remove_mon_group(ctrl, m) {
            if warn.allow(&format!("prune-mon:{ctrl}/{m}")) {
                tracing::warn!(group = %ctrl, mon = %m, error = %e, "could not remove a monitoring group no longer used (logged once a minute)");
            }
        }
    }
}

/// Removes what a run left behind without a record (its processes go to each hierarchy's
/// root: cohabit only moves processes out of a root, or, on v2, out of a cgroup without
/// the controller, whose path only a record keeps).
pub(super) fn clean_leftovers(k: &Kernel) {
    if let Some(cg) = &k.cgroups {
        for g in cg.leftovers() {
            let moved = cg.evacuate(&g).unwrap_or_else(|e| {
                tracing::warn!(group = %g, error = %e, "could not move processes out of a leftover cgroup");
                0
            });
            match cg.remove(&g) {
                Ok(()) => {
                    tracing::warn!(group = %g, moved, "removed a cgroup a previous run left behind");
                }
                Err(e) => {
                    tracing::warn!(group = %g, error = %e, "could not remove a cgroup a previous run left behind");
                }
            }
        }
        cg.remove_parent();
    }
    if let Some(r) = &k.resctrl {
        let own = r.own_groups().unwrap_or_else(|e| {
            tracing::warn!(error = %e, "could not list resctrl groups; none removed");
            vec![]
        });
        for g in own {
            match r.remove_group(&g) {
                Ok(()) => {
                    tracing::warn!(group = %g, "removed a resctrl group a previous run left behind");
                }
                Err(e) => {
                    tracing::warn!(group = %g, error = %e, "could not remove a resctrl group a previous run left behind");
                }
            }
        }
    }
}

/// Puts the host back as `record` says (see [`restore_changes`]) after the GPU clients'
/// environment files, and keeps in the record only what could not be restored.
pub(super) fn restore(k: &Kernel, record: &mut Record, gpu: &mut GpuActuator, procfs: &Procfs) {
    let files = gpu.restore();
    record.forget(|c| matches!(c, Change::File { path, .. } if files.contains(path)));
    let before = record.changes.changes.len();
    let left = restore_changes(k, &record.changes, procfs);
    record.changes = left;
    if let Err(e) = record.save() {
        tracing::warn!(error = %e, "could not save the record of changes");
    }
    record.writes = HostWrites::default();
    record.targets = Targets::default();
    let kept = record.changes.changes.len();
    if kept == 0 {
        tracing::info!(restored = before, "host restored");
    } else {
        tracing::error!(restored = before - kept, left = ?record.changes.changes, "host partly restored; what is left stays in the record");
    }
}

/// Puts the host back from a record of changes alone (on exit, and on start after a
/// crash), in this order: moved processes go back where they were, if the same process
/// (pid and start time) still exists; cohabit's groups are emptied, newest first (a process
/// cohabit did not move, forked inside, goes where the moved processes of that hierarchy
/// came from when they all came from one place, else to the hierarchy's root) and removed;
/// owners' control files get their originals back, newest first; resctrl groups are
/// removed and the root group's cache lines put back; GPU environment files are put back. A change whose object is gone (process
/// exited, cgroup removed by its owner) is done. Returns the changes that could not be
/// restored, oldest first.
pub fn restore_changes(k: &Kernel, changes: &HostChanges, procfs: &Procfs) -> HostChanges {
    let mut left: Vec<Change> = Vec::new();
    let origins = origins(k, changes);
    let created: Vec<&PathBuf> = changes
        .changes
        .iter()
        .filter_map(|c| match c {
            Change::CreatedCgroup { dir } => Some(dir),
            _ => None,
        })
        .collect();
    let newest_first = || changes.changes.iter().rev();
    for c in newest_first() {
        if let Change::MovedProcess { .. } = c {
            if let Err(e) = restore_moved(k, c, procfs) {
                tracing::warn!(change = ?c, error = %e, "could not put a process back");
                left.push(c.clone());
            }
        }
    }
    for c in newest_first() {
        if let Change::CreatedCgroup { dir } = c {
            if let Err(e) = remove_created(k, dir, &origins) {
                tracing::warn!(dir = %dir.display(), error = %e, "could not remove a cgroup cohabit created");
                left.push(c.clone());
            }
        }
    }
    for c in newest_first() {
        let result = match c {
            Change::CgroupFile {
                dir,
                file,
                original,
            } if !created.iter().any(|d| dir.starts_with(d)) => {
                restore_file(k, dir, file, original)
            }
            Change::ResctrlGroup { name } => resctrl(k).and_then(|r| Ok(r.remove_group(name)?)),
            Change::ResctrlRootCache { original } => resctrl(k).and_then(|r| {
                r.apply_root_undoable(&Schemata::parse(original)?)?;
                Ok(())
            }),
            Change::File { path, original } => {
                gpu::restore_file(path, original.as_deref()).map_err(UndoError::from)
            }
            _ => Ok(()),
        };
        if let Err(e) = result {
            tracing::warn!(change = ?c, error = %e, "could not restore");
            left.push(c.clone());
        }
    }
    // Oldest first, as the record keeps them.
    let mut out = HostChanges::default();
    for c in changes.changes.iter().filter(|c| left.contains(c)) {
        out.note(c.clone());
    }
    out
}

/// Where a process found in a created group of a hierarchy goes: the one place the moved
/// processes of that hierarchy came from, if there is exactly one.
fn origins(k: &Kernel, changes: &HostChanges) -> BTreeMap<PathBuf, PathBuf> {
    let Some(cg) = &k.cgroups else {
        return BTreeMap::new();
    };
    let mut seen: BTreeMap<PathBuf, BTreeSet<PathBuf>> = BTreeMap::new();
    for c in &changes.changes {
        if let Change::MovedProcess { from, .. } = c {
            for f in from {
                if let Some(m) = cg.mounts.values().find(|m| f.starts_with(m)) {
                    seen.entry(m.clone()).or_default().insert(f.clone());
                }
            }
        }
    }
    seen.into_iter()
        .filter(|(_, from)| from.len() == 1)
        .filter_map(|(m, from)| Some((m, from.into_iter().next()?)))
        .collect()
}

fn restore_moved(k: &Kernel, c: &Change, procfs: &Procfs) -> Result<(), UndoError> {
    let Change::MovedProcess {
        pid,
        start_time,
        from,
    } = c
    else {
        return Ok(());
    };
    if procfs.stat(*pid).map(|s| s.start_ticks) != Some(*start_time) {
        return Ok(()); // exited, or the pid is another process's now
    }
    let cg = cgroups(k)?;
    for dir in from {
        if !cg.move_process(dir, *pid)? {
            return Ok(()); // exited meanwhile
        }
    }
    Ok(())
}

fn remove_created(
    k: &Kernel,
    dir: &Path,
    origins: &BTreeMap<PathBuf, PathBuf>,
) -> Result<(), UndoError> {
    let cg = cgroups(k)?;
    if !cg.is_own(dir) {
        return Err(UndoError::NotOwn(dir.to_path_buf()));
    }
    if !cg.exists(dir) {
        return Ok(());
    }
    let mount = cg
        .mounts
        .values()
        .find(|m| dir.starts_with(m))
        .ok_or_else(|| UndoError::NoHierarchy(dir.to_path_buf()))?;
    let to = origins.get(mount).unwrap_or(mount);
    let mut attempt = 1;
    loop {
        for pid in cg.processes_in(dir)? {
            tracing::info!(pid, to = %to.display(), "a process cohabit did not move leaves its group");
            cg.move_process(to, pid)?;
        }
        match cg.remove_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if attempt >= REMOVE_ATTEMPTS => return Err(e.into()),
            Err(e) => {
                tracing::debug!(dir = %dir.display(), error = %e, attempt, "the group is not empty yet");
                attempt += 1;
                std::thread::sleep(REMOVE_RETRY);
            }
        }
    }
}

/// Times a created group is emptied and removed before its removal counts as failed: a
/// process forking while its group is emptied leaves the child behind, and a child that
/// exited but is not yet reaped still holds a cgroup v1 group (`rmdir` says EBUSY) for a
/// moment; each attempt moves out what is there again. (Seen in the daemon's end-to-end
/// test: a batch job forking every 0.3 s left `cohabit/best-effort` behind once.)
const REMOVE_ATTEMPTS: u32 = 10;

/// The wait between two attempts (at most 0.2 s in all).
const REMOVE_RETRY: std::time::Duration = std::time::Duration::from_millis(20);

fn restore_file(k: &Kernel, dir: &Path, file: &str, original: &str) -> Result<(), UndoError> {
    let cg = cgroups(k)?;
    if !cg.exists(dir) {
        return Ok(()); // its owner removed it
    }
    let current = cg.read_control(dir, file)?;
    if current.trim() == original.trim() {
        return Ok(());
    }
    cg.write_control(dir, file, original)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use cohabit_collectors::cgroup::fake::FakeCgroup2;
    use cohabit_collectors::perf::PerfSupport;
    use cohabit_collectors::resctrl::fake::FakeResctrl;
    use cohabit_core::{Allocation, Plan, ServiceClass, ServiceSpec, WayRange};

    use super::*;
    use crate::discover::{self, CapacityInput, HostFacts};
    use crate::placement;
    use crate::spec::Placement;

    /// A fake resctrl (12 ways, MBA) and a fake cgroup v2 tree (8 CPUs) where systemd
    /// delegates cpuset, cpu and memory to `system.slice`; kv (pid 40) and batch (pid 50)
    /// run in their units.
    struct Host {
        resctrl_fake: FakeResctrl,
        cg: FakeCgroup2,
        kernel: Kernel,
        facts: HostFacts,
        gpu: GpuActuator,
        procfs: Procfs,
    }

    const KV: &str = "/system.slice/kv.service";
    const BATCH: &str = "/system.slice/batch.service";

    fn host() -> Host {
        host_with_closids(16)
    }

    fn host_with_closids(closids: u32) -> Host {
        let resctrl_fake = FakeResctrl::builder()
            .ways(12)
            .num_closids(closids)
            .build()
            .unwrap();
        let resctrl = Resctrl::discover(&resctrl_fake.paths(), Arc::new(resctrl_fake.clone()))
            .unwrap()
            .unwrap();
        let cg = FakeCgroup2::builder().build().unwrap();
        cg.mkdir_owner("/system.slice", &["cpuset", "cpu", "memory"])
            .unwrap();
        for (pid, unit) in [(40, KV), (50, BATCH)] {
            cg.mkdir_owner(unit, &[]).unwrap();
            cg.add_process(pid, 1000 + u64::from(pid), unit).unwrap();
        }
        let info = resctrl.info().clone();
        let facts = HostFacts {
            capacity: discover::capacity(&CapacityInput {
                name: "test".into(),
                cpus: 8,
                freq_ghz: None,
                llc_bytes: None,
                mem_bw_gbps: None,
                resctrl: Some(&info),
                latency_critical: 1,
                gpus: vec![],
            }),
            cpus: (0..8).collect(),
            writable: vec!["cpuset".into(), "cpu".into()],
            can_cpuset: true,
            can_quota: true,
            resctrl: Some(info),
            perf: PerfSupport::Unsupported("test".into()),
            clk_tck: 100.0,
            unmanaged_cache: Default::default(),
            idle_class: true,
            best_effort_cpus: Default::default(),
        };
        Host {
            procfs: Procfs::new(cg.base().join("proc")),
            kernel: Kernel {
                cgroups: Some(cg.cgroups().unwrap()),
                resctrl: Some(resctrl),
            },
            resctrl_fake,
            cg,
            facts,
            gpu: GpuActuator::new(&[], None),
        }
    }

    /// The host's kernel opened anew, as a daemon started after a crash would.
    fn fresh_kernel(h: &Host) -> Kernel {
        Kernel {
            cgroups: Some(h.cg.cgroups().unwrap()),
            resctrl: Resctrl::discover(&h.resctrl_fake.paths(), Arc::new(h.resctrl_fake.clone()))
                .unwrap(),
        }
    }

    fn specs() -> Vec<ServiceSpec> {
        vec![
            ServiceSpec {
                name: "kv".into(),
                class: ServiceClass::LatencyCritical { p99_target_ms: 1.0 },
                gpu: None,
                priority: 0,
            },
            ServiceSpec {
                name: "batch".into(),
                class: ServiceClass::BestEffort,
                gpu: None,
                priority: 0,
            },
        ]
    }

    fn plan(kv_cores: u32, kv_ways: u32, pool_cores: u32) -> Plan {
        let a = |cores, first, count| Allocation {
            cores,
            llc_ways: WayRange::new(first, count),
            mba_pct: 100,
            gpu_mps_pct: None,
        };
        Plan {
            services: [("kv".to_string(), a(kv_cores, 0, kv_ways))].into(),
            best_effort: a(pool_cores, kv_ways, 12 - kv_ways),
        }
    }

    fn writes(h: &Host, p: &Plan) -> HostWrites {
        layout::layout(p, &h.facts, &specs(), &BTreeSet::new()).unwrap()
    }

    /// Where kv's and batch's values go, with batch's placement.
    fn targets(h: &Host, batch: &[u32], placement: Placement) -> Targets {
        let cg = h.kernel.cgroups.as_ref().unwrap();
        let all = [Controller::Cpuset, Controller::Cpu];
        let kv = placement::place(
            cg,
            &h.procfs,
            &[40].into(),
            "lc-kv",
            Placement::InPlace,
            &all,
        );
        let be = placement::place(
            cg,
            &h.procfs,
            &batch.iter().copied().collect(),
            BEST_EFFORT_GROUP,
            placement,
            &all,
        );
        let (t, conflicts) = placement::group_targets([("kv", &kv), (BEST_EFFORT_GROUP, &be)]);
        assert!(conflicts.is_empty());
        t
    }

    fn read(h: &Host, rel: &str, file: &str) -> String {
        std::fs::read_to_string(h.cg.dir(rel).join(file)).unwrap()
    }

    fn resctrl_state(h: &Host) -> Vec<(String, String)> {
        let r = h.kernel.resctrl.as_ref().unwrap();
        r.groups()
            .unwrap()
            .into_iter()
            .map(|g| {
                let s = r.schemata(Some(&g)).unwrap().to_string();
                (g, s)
            })
            .collect()
    }

    /// A change log that remembers, for each save, how many cgroup writes the fake had
    /// accepted by then.
    #[derive(Debug, Clone)]
    struct Saves {
        cg: FakeCgroup2,
        saves: Arc<Mutex<Vec<(usize, HostChanges)>>>,
    }

    impl ChangeLog for Saves {
        fn save(&mut self, changes: &HostChanges) -> std::io::Result<()> {
            let n = self.cg.writes().len();
            self.saves.lock().unwrap().push((n, changes.clone()));
            Ok(())
        }
    }

    #[test]
    fn values_go_into_the_owners_cgroups_with_every_original_noted_first() {
        let mut h = host();
        let saves = Saves {
            cg: h.cg.clone(),
            saves: Arc::default(),
        };
        let mut record = Record::default();
        record.set_log(Box::new(saves.clone())).unwrap();
        let t = targets(&h, &[50], Placement::InPlace);
        let setup = h.cg.writes().len();
        let w = writes(&h, &plan(2, 6, 6));
        apply(&h.kernel, &mut record, w.clone(), &t, &mut h.gpu, None).unwrap();
        assert_eq!(record.writes, w);
        assert_eq!(
            resctrl_state(&h),
            vec![
                ("cohabit-best-effort".into(), "L3:0=fc0\nMB:0=100\n".into()),
                ("cohabit-kv".into(), "L3:0=3f\nMB:0=100\n".into()),
            ]
        );
        assert_eq!(
            (read(&h, KV, "cpuset.cpus"), read(&h, BATCH, "cpuset.cpus")),
            ("0-1".into(), "2-7".into())
        );
        assert_eq!(read(&h, KV, "cpu.weight"), "10000");
        assert_eq!(read(&h, BATCH, "cpu.weight"), "1");
        assert_eq!(
            read(&h, KV, "cpu.max"),
            "max 100000",
            "no limit asked, none written"
        );
        assert_eq!(h.cg.cgroup_of(40).as_deref(), Some(KV), "nobody moved");
        assert_eq!(h.cg.cgroup_of(50).as_deref(), Some(BATCH));
        // Write-ahead: each write to an owner's file comes after a save that holds it.
        let saves = saves.saves.lock().unwrap().clone();
        let written = h.cg.writes();
        assert!(written.len() > setup);
        for (i, (path, _)) in written.iter().enumerate().skip(setup) {
            let (dir, file) = (path.parent().unwrap(), path.file_name().unwrap());
            let noted = saves.iter().any(|(n, r)| {
                *n <= i
                    && r.changes.iter().any(|c| matches!(c, Change::CgroupFile { dir: d, file: f, .. } if d == dir && f.as_str() == file))
            });
            assert!(
                noted,
                "{} written before its original was saved",
                path.display()
            );
        }
        // kv grows, the pool has no cores of its own: an idle class on what is left, with
        // no quota (the lowest weight holds it back), and its owner's limit stays.
        let w2 = writes(&h, &plan(4, 8, 0));
        apply(&h.kernel, &mut record, w2, &t, &mut h.gpu, None).unwrap();
        assert_eq!(
            (read(&h, KV, "cpuset.cpus"), read(&h, BATCH, "cpuset.cpus")),
            ("0-3".into(), "4-7".into())
        );
        assert_eq!(read(&h, BATCH, "cpu.max"), "max 100000");
        apply(&h.kernel, &mut record, w.clone(), &t, &mut h.gpu, None).unwrap();
        assert_eq!(read(&h, BATCH, "cpu.max"), "max 100000");
        // Restore: every original back, nothing left in the record.
        restore(&h.kernel, &mut record, &mut h.gpu, &h.procfs);
        for unit in [KV, BATCH] {
            assert_eq!(read(&h, unit, "cpuset.cpus"), "");
            assert_eq!(read(&h, unit, "cpu.weight"), "100");
            assert_eq!(read(&h, unit, "cpu.max"), "max 100000");
        }
        assert!(resctrl_state(&h).is_empty());
        assert!(record.changes.is_empty(), "{:?}", record.changes);
        assert!(
            !h.cg.root().join("cohabit").exists(),
            "no group of cohabit's was needed"
        );
    }

    #[test]
    fn the_pool_joins_the_idle_class_and_its_owners_weight_comes_back_after_it() {
        let mut h = host();
        // The owners' values: the batch unit at weight 300; kv's unit (oddly) idle.
        std::fs::write(h.cg.dir(BATCH).join("cpu.weight"), "300").unwrap();
        std::fs::write(h.cg.dir(KV).join("cpu.idle"), "1").unwrap();
        std::fs::write(h.cg.dir(KV).join("cpu.weight"), "1").unwrap();
        let t = targets(&h, &[50], Placement::InPlace);
        let mut record = Record::default();
        let w = writes(&h, &plan(2, 6, 6));
        apply(&h.kernel, &mut record, w.clone(), &t, &mut h.gpu, None).unwrap();
        let class = |h: &Host, unit| (read(h, unit, "cpu.idle"), read(h, unit, "cpu.weight"));
        assert_eq!(class(&h, BATCH), ("1".into(), "1".into()), "in the class");
        assert_eq!(
            class(&h, KV),
            ("0".into(), "10000".into()),
            "out, then weighted"
        );
        let n = h.cg.writes().len();
        apply(&h.kernel, &mut record, w, &t, &mut h.gpu, None).unwrap();
        assert_eq!(h.cg.writes().len(), n, "nothing differs, nothing written");
        // Restore, newest first: the class goes, then the weight it reset comes back.
        restore(&h.kernel, &mut record, &mut h.gpu, &h.procfs);
        assert_eq!(class(&h, BATCH), ("0".into(), "300".into()));
        assert_eq!(read(&h, KV, "cpu.idle"), "1");
        assert!(record.changes.is_empty(), "{:?}", record.changes);
    }

    #[test]
    fn a_failed_apply_takes_the_pool_out_of_the_idle_class_with_its_weight_back() {
        let mut h = host();
        std::fs::write(h.cg.dir(BATCH).join("cpu.weight"), "300").unwrap();
        let t = targets(&h, &[50], Placement::InPlace);
        let mut record = Record::default();
        let mut w = writes(&h, &plan(2, 6, 6));
        // The pool's values first, then kv's, whose weight the kernel will not take.
        w.cgroups.reverse();
        assert_eq!(w.cgroups[0].group, BEST_EFFORT_GROUP);
        let weight = h.cg.dir(KV).join("cpu.weight");
        std::fs::remove_file(&weight).unwrap();
        std::fs::create_dir(&weight).unwrap();
        let e = apply(&h.kernel, &mut record, w, &t, &mut h.gpu, None).unwrap_err();
        assert!(e.to_string().contains("cpu.weight"), "{e}");
        assert_eq!(read(&h, BATCH, "cpu.idle"), "0");
        assert_eq!(
            read(&h, BATCH, "cpu.weight"),
            "300",
            "not the kernel's reset 100"
        );
    }

    #[test]
    fn a_group_its_owner_put_in_the_idle_class_is_left_there_when_cohabit_does_not_manage_it() {
        let mut h = host();
        // Under [kubernetes] cohabit does not manage the class; the batch pod is in it.
        h.facts.idle_class = false;
        std::fs::write(h.cg.dir(BATCH).join("cpu.idle"), "1").unwrap();
        std::fs::write(h.cg.dir(BATCH).join("cpu.weight"), "1").unwrap();
        let t = targets(&h, &[50], Placement::InPlace);
        let mut record = Record::default();
        let w = writes(&h, &plan(2, 6, 6));
        assert_eq!(w.cgroup(BEST_EFFORT_GROUP).unwrap().idle, None);
        apply(&h.kernel, &mut record, w, &t, &mut h.gpu, None).unwrap();
        assert_eq!(read(&h, BATCH, "cpu.idle"), "1", "the owner's class stays");
        assert_eq!(
            read(&h, KV, "cpu.weight"),
            "10000",
            "the others are written"
        );
    }

    #[test]
    fn without_the_idle_class_the_pool_gets_the_lowest_weight() {
        let mut h = host();
        // A kernel before 5.15: no cpu.idle in the batch unit.
        std::fs::remove_file(h.cg.dir(BATCH).join("cpu.idle")).unwrap();
        let t = targets(&h, &[50], Placement::InPlace);
        let mut record = Record::default();
        apply(
            &h.kernel,
            &mut record,
            writes(&h, &plan(2, 6, 6)),
            &t,
            &mut h.gpu,
            None,
        )
        .unwrap();
        assert_eq!(read(&h, BATCH, "cpu.weight"), "1");
        restore(&h.kernel, &mut record, &mut h.gpu, &h.procfs);
        assert_eq!(read(&h, BATCH, "cpu.weight"), "100");
    }

    #[test]
    fn a_cgroup_the_service_left_gets_its_values_back_at_once() {
        let mut h = host();
        let mut record = Record::default();
        let w = writes(&h, &plan(2, 6, 6));
        apply(
            &h.kernel,
            &mut record,
            w.clone(),
            &targets(&h, &[50], Placement::InPlace),
            &mut h.gpu,
            None,
        )
        .unwrap();
        assert_eq!(read(&h, BATCH, "cpu.weight"), "1");
        // The batch job is gone from its unit: only kv's cgroup is a target now.
        apply(
            &h.kernel,
            &mut record,
            w,
            &targets(&h, &[], Placement::InPlace),
            &mut h.gpu,
            None,
        )
        .unwrap();
        assert_eq!(read(&h, BATCH, "cpu.weight"), "100");
        assert_eq!(read(&h, BATCH, "cpuset.cpus"), "");
        assert!(record
            .changes
            .changes
            .iter()
            .all(|c| !matches!(c, Change::CgroupFile { dir, .. } if *dir == h.cg.dir(BATCH))));
        assert_eq!(read(&h, KV, "cpu.weight"), "10000", "kv's stay");
    }

    #[test]
    fn a_failure_at_the_cgroup_step_leaves_resctrl_and_the_cpu_sets_as_before() {
        let mut h = host();
        let mut record = Record::default();
        let t = targets(&h, &[50], Placement::InPlace);
        let first = writes(&h, &plan(2, 6, 6));
        apply(&h.kernel, &mut record, first.clone(), &t, &mut h.gpu, None).unwrap();
        let resctrl_before = resctrl_state(&h);
        let cpus = |h: &Host| (read(h, KV, "cpuset.cpus"), read(h, BATCH, "cpuset.cpus"));
        let cpus_before = cpus(&h);
        assert_eq!(cpus_before, ("0-1".into(), "2-7".into()));
        // kv's weight cannot be read or written (the kernel would say EIO; a directory in
        // place of the file fails the same way). The weight is written last, after the
        // masks and the CPU sets.
        let weight = h.cg.dir(KV).join("cpu.weight");
        std::fs::remove_file(&weight).unwrap();
        std::fs::create_dir(&weight).unwrap();
        let written = h.cg.writes().len();
        let next = writes(&h, &plan(4, 8, 0));
        let e = apply(&h.kernel, &mut record, next, &t, &mut h.gpu, None).unwrap_err();
        assert!(e.to_string().contains("cpu.weight"), "{e}");
        let kv_cpus = h.cg.dir(KV).join("cpuset.cpus");
        let kv_sets: Vec<String> = h.cg.writes()[written..]
            .iter()
            .filter(|(path, _)| *path == kv_cpus)
            .map(|(_, value)| value.clone())
            .collect();
        assert!(
            kv_sets.len() >= 2 && kv_sets[0] != cpus_before.0,
            "kv's CPU set was changed before the failure, then written back: {kv_sets:?}"
        );
        assert_eq!(
            resctrl_state(&h),
            resctrl_before,
            "the masks written first are undone"
        );
        assert_eq!(cpus(&h), cpus_before, "so are the CPU sets");
        assert_eq!(
            record.writes, first,
            "the record still holds the plan in force"
        );
    }

    #[test]
    fn a_bare_process_is_left_alone_unless_move_is_configured_then_moved_and_put_back() {
        let mut h = host();
        h.cg.add_process(60, 2000, "/").unwrap();
        let cg = h.kernel.cgroups.as_ref().unwrap();
        let all = [Controller::Cpuset, Controller::Cpu];
        let stay = placement::place(
            cg,
            &h.procfs,
            &[60].into(),
            BEST_EFFORT_GROUP,
            Placement::InPlace,
            &all,
        );
        assert!(stay.targets.is_empty() && stay.moves.is_empty());
        assert!(
            stay.left[&Controller::Cpuset].contains("root"),
            "{:?}",
            stay.left
        );

        let mut record = Record::default();
        let t = targets(&h, &[50, 60], Placement::Move);
        let own = h.cg.dir("/cohabit/best-effort");
        assert!(t[BEST_EFFORT_GROUP].iter().any(|t| t.dir == own && t.own));
        apply(
            &h.kernel,
            &mut record,
            writes(&h, &plan(2, 6, 6)),
            &t,
            &mut h.gpu,
            None,
        )
        .unwrap();
        assert_eq!(
            read(&h, "/cohabit/best-effort", "cpuset.cpus"),
            "2-7",
            "values first"
        );
        move_the_batch(&h, &mut record);
        assert_eq!(
            h.cg.cgroup_of(50).as_deref(),
            Some(BATCH),
            "the unit's process stays"
        );
        assert!(
            h.cg.writes()
                .iter()
                .all(|(p, _)| p != &h.cg.root().join("cgroup.subtree_control")),
            "the mount root's subtree_control is never written"
        );
        // A child forked in cohabit's group, and the record alone restores everything.
        h.cg.add_process(61, 2100, "/cohabit/best-effort").unwrap();
        let saved = record.changes.clone();
        let left = restore_changes(&fresh_kernel(&h), &saved, &h.procfs);
        assert!(left.is_empty(), "{left:?}");
        assert_eq!(
            h.cg.cgroup_of(60).as_deref(),
            Some("/"),
            "back where it was"
        );
        assert_eq!(
            h.cg.cgroup_of(61).as_deref(),
            Some("/"),
            "the child goes where its parent came from"
        );
        assert!(!h.cg.root().join("cohabit").exists());
        assert_eq!(read(&h, BATCH, "cpuset.cpus"), "");
        assert!(resctrl_state(&h).is_empty());
    }

    /// Applies `plan(2, 6, 6)` with the batch's processes 50 and 60 moved (pid 60, a bare
    /// process, into cohabit's best-effort group).
    fn apply_and_move_the_batch(h: &mut Host, record: &mut Record) {
        let t = targets(h, &[50, 60], Placement::Move);
        apply(
            &h.kernel,
            record,
            writes(h, &plan(2, 6, 6)),
            &t,
            &mut h.gpu,
            None,
        )
        .unwrap();
        move_the_batch(h, record);
    }

    /// Moves the batch's processes 50 and 60 as placed (pid 60, a bare process, into
    /// cohabit's best-effort group).
    fn move_the_batch(h: &Host, record: &mut Record) {
        let cg = h.kernel.cgroups.as_ref().unwrap();
        let all = [Controller::Cpuset, Controller::Cpu];
        let be = placement::place(
            cg,
            &h.procfs,
            &[50, 60].into(),
            BEST_EFFORT_GROUP,
            Placement::Move,
            &all,
        );
        move_processes(&h.kernel, record, &h.procfs, "batch", &be.moves);
        assert_eq!(h.cg.cgroup_of(60).as_deref(), Some("/cohabit/best-effort"));
    }

    /// The fake cgroup tree, except that the first `rmdir` of `racing` finds a child
    /// forked there a moment before (pid 70): EBUSY, as the kernel says.
    #[derive(Debug, Clone)]
    struct ForkOnRemove {
        fake: FakeCgroup2,
        racing: PathBuf,
        forked: Arc<Mutex<bool>>,
    }

    impl cohabit_collectors::kfs::KernelFs for ForkOnRemove {
        fn read_to_string(&self, path: &Path) -> std::io::Result<String> {
            self.fake.read_to_string(path)
        }
        fn write(&self, path: &Path, data: &str) -> std::io::Result<()> {
            self.fake.write(path, data)
        }
        fn create_dir(&self, path: &Path) -> std::io::Result<()> {
            self.fake.create_dir(path)
        }
        fn remove_dir(&self, path: &Path) -> std::io::Result<()> {
            let mut forked = self.forked.lock().unwrap();
            if path == self.racing && !*forked {
                *forked = true;
                let rel = path.strip_prefix(self.fake.root()).unwrap();
                self.fake
                    .add_process(70, 2070, &format!("/{}", rel.display()))?;
                return Err(std::io::Error::from_raw_os_error(libc::EBUSY));
            }
            self.fake.remove_dir(path)
        }
        fn subdirs(&self, path: &Path) -> std::io::Result<Vec<String>> {
            self.fake.subdirs(path)
        }
        fn identity(&self, path: &Path) -> std::io::Result<u64> {
            self.fake.identity(path)
        }
        fn lock_exclusive(
            &self,
            path: &Path,
        ) -> std::io::Result<Box<dyn cohabit_collectors::kfs::LockGuard>> {
            self.fake.lock_exclusive(path)
        }
    }

    #[test]
    fn a_child_forked_while_a_group_is_emptied_is_moved_out_and_the_group_removed() {
        let mut h = host();
        h.cg.add_process(60, 2000, "/").unwrap();
        let mut record = Record::default();
        apply_and_move_the_batch(&mut h, &mut record);
        let racing = ForkOnRemove {
            fake: h.cg.clone(),
            racing: h.cg.dir("/cohabit/best-effort"),
            forked: Arc::default(),
        };
        let kernel = Kernel {
            cgroups: Some(
                Cgroups::detect_with(&h.cg.paths(), Arc::new(racing.clone()))
                    .unwrap()
                    .unwrap(),
            ),
            resctrl: fresh_kernel(&h).resctrl,
        };
        let left = restore_changes(&kernel, &record.changes, &h.procfs);
        assert!(*racing.forked.lock().unwrap(), "the race happened");
        assert!(left.is_empty(), "{left:?}");
        assert!(!h.cg.root().join("cohabit").exists());
        assert_eq!(h.cg.cgroup_of(60).as_deref(), Some("/"));
        assert_eq!(
            h.cg.cgroup_of(70).as_deref(),
            Some("/"),
            "the late child goes where its parent came from"
        );
    }

    #[test]
    fn unmanaged_processes_get_the_pools_ways_when_asked_and_them_back_after() {
        let mut h = host();
        let root = h.resctrl_fake.root().join("schemata");
        let root_schemata = || std::fs::read_to_string(&root).unwrap();
        // Another tool had set the root group to ways 0-9 and 50 % bandwidth.
        std::fs::write(&root, "L3:0=3ff\nMB:0=50\n").unwrap();
        let t = targets(&h, &[50], Placement::InPlace);
        let mut record = Record::default();
        // By default the root group is left alone.
        apply(
            &h.kernel,
            &mut record,
            writes(&h, &plan(2, 6, 6)),
            &t,
            &mut h.gpu,
            None,
        )
        .unwrap();
        assert_eq!(root_schemata(), "L3:0=3ff\nMB:0=50\n");
        assert!(!record
            .changes
            .changes
            .iter()
            .any(|c| matches!(c, Change::ResctrlRootCache { .. })));
        // Asked for: the root group's cache is the pool's (ways 6-11), its bandwidth kept,
        // the original noted; kv's own ways are nobody else's.
        h.facts.unmanaged_cache = layout::UnmanagedCache::Pool;
        apply(
            &h.kernel,
            &mut record,
            writes(&h, &plan(2, 6, 6)),
            &t,
            &mut h.gpu,
            None,
        )
        .unwrap();
        assert_eq!(root_schemata(), "L3:0=fc0\nMB:0=50\n");
        assert!(record.changes.changes.contains(&Change::ResctrlRootCache {
            original: "L3:0=3ff\n".into()
        }));
        // It follows the pool; the original noted stays the first one.
        apply(
            &h.kernel,
            &mut record,
            writes(&h, &plan(2, 8, 6)),
            &t,
            &mut h.gpu,
            None,
        )
        .unwrap();
        assert_eq!(root_schemata(), "L3:0=f00\nMB:0=50\n");
        let noted: Vec<&Change> = record
            .changes
            .changes
            .iter()
            .filter(|c| matches!(c, Change::ResctrlRootCache { .. }))
            .collect();
        assert_eq!(
            noted,
            vec![&Change::ResctrlRootCache {
                original: "L3:0=3ff\n".into()
            }]
        );
        // After a crash, the record alone puts the root group back.
        let saved = record.changes.clone();
        let left = restore_changes(&fresh_kernel(&h), &saved, &h.procfs);
        assert!(left.is_empty(), "{left:?}");
        assert_eq!(root_schemata(), "L3:0=3ff\nMB:0=50\n");
        assert!(resctrl_state(&h).is_empty());
    }

    #[test]
    fn a_root_cache_the_kernel_refuses_is_rolled_back_with_the_rest_of_the_apply() {
        let mut h = host();
        h.facts.unmanaged_cache = layout::UnmanagedCache::Pool;
        let t = targets(&h, &[50], Placement::InPlace);
        let mut record = Record::default();
        let good = writes(&h, &plan(2, 6, 6));
        apply(&h.kernel, &mut record, good.clone(), &t, &mut h.gpu, None).unwrap();
        let root = h.resctrl_fake.root().join("schemata");
        assert_eq!(
            std::fs::read_to_string(&root).unwrap(),
            "L3:0=fc0\nMB:0=100\n"
        );
        // A plan whose root cache the kernel refuses (a non-contiguous mask): nothing of
        // this apply stays, the root group included, and the last good state is kept.
        let mut bad = writes(&h, &plan(3, 4, 5));
        bad.root_cache = Some(Schemata::parse("L3:0=a0a\n").unwrap());
        let e = apply(&h.kernel, &mut record, bad, &t, &mut h.gpu, None).unwrap_err();
        assert!(e.to_string().contains("the root group"), "{e}");
        assert_eq!(
            std::fs::read_to_string(&root).unwrap(),
            "L3:0=fc0\nMB:0=100\n"
        );
        assert_eq!(record.writes, good);
        assert_eq!(
            resctrl_state(&h),
            vec![
                ("cohabit-best-effort".into(), "L3:0=fc0\nMB:0=100\n".into()),
                ("cohabit-kv".into(), "L3:0=3f\nMB:0=100\n".into()),
            ]
        );
    }

    #[test]
    fn a_reused_pid_is_never_moved_back_and_a_failed_restore_is_kept() {
        let h = host();
        let mut changes = HostChanges::default();
        changes.note(Change::MovedProcess {
            pid: 40,
            start_time: 999, // pid 40 is another process now (it started at 1040)
            from: vec![h.cg.dir("/elsewhere")],
        });
        changes.note(Change::CgroupFile {
            dir: h.cg.dir(KV),
            file: "cpu.weight".into(),
            original: "0".into(), // the kernel refuses it
        });
        changes.note(Change::CgroupFile {
            dir: h.cg.dir("/system.slice/gone.service"),
            file: "cpu.weight".into(),
            original: "100".into(),
        });
        let left = restore_changes(&h.kernel, &changes, &h.procfs);
        assert_eq!(h.cg.cgroup_of(40).as_deref(), Some(KV));
        assert_eq!(left.changes, vec![changes.changes[1].clone()]);
    }

    #[test]
    fn groups_created_by_a_failed_apply_are_removed_and_forgotten() {
        let mut h = host();
        h.cg.add_process(60, 2000, "/").unwrap();
        let mut record = Record::default();
        let t = targets(&h, &[50, 60], Placement::Move);
        // kv's weight cannot be written: the apply fails after cohabit's groups were made.
        let weight = h.cg.dir(KV).join("cpu.weight");
        std::fs::remove_file(&weight).unwrap();
        std::fs::create_dir(&weight).unwrap();
        let e = apply(
            &h.kernel,
            &mut record,
            writes(&h, &plan(2, 6, 6)),
            &t,
            &mut h.gpu,
            None,
        )
        .unwrap_err();
        assert!(e.to_string().contains("cpu.weight"), "{e}");
        assert!(
            !h.cg.root().join("cohabit").exists(),
            "created groups are gone"
        );
        assert!(resctrl_state(&h).is_empty(), "and the resctrl groups");
        assert!(
            !record.changes.changes.iter().any(|c| matches!(
                c,
                Change::CreatedCgroup { .. } | Change::ResctrlGroup { .. }
            )),
            "{:?}",
            record.changes
        );
        assert_eq!(record.writes, HostWrites::default());
    }

    #[test]
    fn groups_no_longer_used_are_removed_after_the_writes_succeed() {
        let mut h = host();
        let mut record = Record::default();
        let t = targets(&h, &[50], Placement::InPlace);
        apply(
            &h.kernel,
            &mut record,
            writes(&h, &plan(2, 6, 6)),
            &t,
            &mut h.gpu,
            None,
        )
        .unwrap();
        // The pool gets kv's ways and MBA: one CLOSID for both, named after kv.
        let mut shared = plan(2, 6, 6);
        shared.best_effort.llc_ways = WayRange::new(0, 6);
        apply(
            &h.kernel,
            &mut record,
            writes(&h, &shared),
            &t,
            &mut h.gpu,
            None,
        )
        .unwrap();
        assert_eq!(
            resctrl_state(&h),
            vec![("cohabit-kv".into(), "L3:0=3f\nMB:0=100\n".into())]
        );
        assert_eq!(record.resctrl_group_of("best-effort"), Some("cohabit-kv"));
        assert!(!record
            .changes
            .changes
            .iter()
            .any(|c| matches!(c, Change::ResctrlGroup { name } if name == "cohabit-best-effort")));
    }

    /// Every latency-critical pair that shares an effective CPU, read from the fake.
    fn lc_sharing(cg: &FakeCgroup2, units: &[&str]) -> Vec<(String, String)> {
        let sets: Vec<(String, CpuList)> = units
            .iter()
            .map(|u| {
                let t = std::fs::read_to_string(cg.dir(u).join("cpuset.cpus.effective")).unwrap();
                ((*u).to_string(), t.parse().unwrap())
            })
            .collect();
        let mut out = vec![];
        for (i, (a, ca)) in sets.iter().enumerate() {
            for (b, cb) in &sets[i + 1..] {
                if ca.overlaps(cb) {
                    out.push((a.clone(), b.clone()));
                }
            }
        }
        out
    }

    #[test]
    fn growing_a_service_between_two_others_never_makes_them_share_a_cpu() {
        let mut h = host();
        let units = [
            "/system.slice/a.service",
            "/system.slice/b.service",
            "/system.slice/c.service",
        ];
        for (i, u) in units.iter().enumerate() {
            h.cg.mkdir_owner(u, &[]).unwrap();
            let pid = 70 + u32::try_from(i).unwrap();
            h.cg.add_process(pid, 3000, u).unwrap();
        }
        let lc = |n: &str| ServiceSpec {
            name: n.into(),
            class: ServiceClass::LatencyCritical { p99_target_ms: 1.0 },
            gpu: None,
            priority: 0,
        };
        let specs = vec![lc("a"), lc("b"), lc("c"), specs()[1].clone()];
        let cg = h.kernel.cgroups.as_ref().unwrap();
        let all = [Controller::Cpuset, Controller::Cpu];
        let placed: Vec<(String, placement::ServicePlacement)> = ["a", "b", "c"]
            .iter()
            .enumerate()
            .map(|(i, n)| {
                let pid = 70 + u32::try_from(i).unwrap();
                (
                    (*n).to_string(),
                    placement::place(
                        cg,
                        &h.procfs,
                        &[pid].into(),
                        &layout::cgroup_name(n),
                        Placement::InPlace,
                        &all,
                    ),
                )
            })
            .chain([(
                BEST_EFFORT_GROUP.to_string(),
                placement::place(
                    cg,
                    &h.procfs,
                    &[50].into(),
                    BEST_EFFORT_GROUP,
                    Placement::InPlace,
                    &all,
                ),
            )])
            .collect();
        let (t, _) = placement::group_targets(placed.iter().map(|(g, p)| (g.as_str(), p)));
        let a = |cores| Allocation {
            cores,
            llc_ways: WayRange::new(0, 12),
            mba_pct: 100,
            gpu_mps_pct: None,
        };
        let plan = |b| Plan {
            services: [("a".into(), a(1)), ("b".into(), a(b)), ("c".into(), a(1))].into(),
            best_effort: a(5 - (b - 1)),
        };
        let w = |p: &Plan| layout::layout(p, &h.facts, &specs, &BTreeSet::new()).unwrap();
        let mut record = Record::default();
        apply(&h.kernel, &mut record, w(&plan(1)), &t, &mut h.gpu, None).unwrap();
        assert_eq!(lc_sharing(&h.cg, &units), Vec::<(String, String)>::new());
        let before = h.cg.writes().len();
        apply(&h.kernel, &mut record, w(&plan(2)), &t, &mut h.gpu, None).unwrap();
        // Replay the CPU-set writes one at a time on a copy of the state.
        let mut state: BTreeMap<String, CpuList> = units
            .iter()
            .enumerate()
            .map(|(i, u)| ((*u).to_string(), CpuList(vec![u32::try_from(i).unwrap()])))
            .collect();
        let mut steps = 0;
        for (path, value) in &h.cg.writes()[before..] {
            let Some(u) = units
                .iter()
                .find(|u| path == &h.cg.dir(u).join("cpuset.cpus"))
            else {
                continue;
            };
            state.insert((*u).to_string(), value.parse().unwrap());
            steps += 1;
            let sets: Vec<&CpuList> = state.values().collect();
            for (i, x) in sets.iter().enumerate() {
                assert!(
                    sets[i + 1..].iter().all(|y| !x.overlaps(y)),
                    "after {u} = {value}: {state:?}"
                );
            }
        }
        assert_eq!(steps, 2, "b grows, c shifts; a stays");
        assert_eq!(read(&h, units[1], "cpuset.cpus"), "1-2");
        assert_eq!(read(&h, units[2], "cpuset.cpus"), "3");
        assert_eq!(read(&h, BATCH, "cpuset.cpus"), "4-7");
    }

    #[test]
    fn an_unwritable_record_stops_the_write_it_describes() {
        #[derive(Debug)]
        struct Full;
        impl ChangeLog for Full {
            fn save(&mut self, _: &HostChanges) -> std::io::Result<()> {
                Err(std::io::Error::from_raw_os_error(libc::ENOSPC))
            }
        }
        let mut h = host();
        let mut record = Record::default();
        assert!(record.set_log(Box::new(Full)).is_err());
        let t = targets(&h, &[50], Placement::InPlace);
        let e = apply(
            &h.kernel,
            &mut record,
            writes(&h, &plan(2, 6, 6)),
            &t,
            &mut h.gpu,
            None,
        )
        .unwrap_err();
        assert!(e.to_string().contains("record of changes"), "{e}");
        assert_eq!(read(&h, KV, "cpuset.cpus"), "", "nothing written");
        assert!(resctrl_state(&h).is_empty());
    }

    /// Set in the child process of the EMFILE test: only there is the limit lowered.
    const EMFILE_CHILD: &str = "COHABIT_TEST_EMFILE_CHILD";

    /// The restore on a stop signal works when the process has no descriptor left: the
    /// test runs itself again as a child process (the open-files limit is per process, so
    /// the shared test process keeps its own), which lowers its limit, uses every slot and
    /// restores once the reserve is released.
    #[test]
    fn at_the_open_files_limit_the_reserve_lets_the_host_be_restored() {
        if std::env::var_os(EMFILE_CHILD).is_some() {
            emfile_child();
            return;
        }
        let name = format!(
            "{}::at_the_open_files_limit_the_reserve_lets_the_host_be_restored",
            module_path!().split_once("::").unwrap().1
        );
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", &name, "--nocapture", "--test-threads=1"])
            .env(EMFILE_CHILD, "1")
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "{text}");
        assert!(
            text.contains("emfile child: restored at the limit"),
            "the child ran the test: {text}"
        );
    }

    /// A record saved as the daemon's state file is: written whole to a temporary file,
    /// then renamed over the last one (each save opens files, so it needs free slots too).
    #[derive(Debug)]
    struct FileLog(PathBuf);

    impl ChangeLog for FileLog {
        fn save(&mut self, changes: &HostChanges) -> std::io::Result<()> {
            let tmp = self.0.with_extension("tmp");
            std::fs::write(&tmp, serde_json::to_vec(changes)?)?;
            std::fs::File::open(&tmp)?.sync_all()?;
            std::fs::rename(&tmp, &self.0)
        }
    }

    fn emfile_child() {
        use crate::fds::{FdReserve, RESTORE_RESERVE};
        use nix::sys::resource::{setrlimit, Resource};

        let mut h = host();
        h.cg.add_process(60, 2000, "/").unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let saved_at = tmp.path().join("changes.json");
        let mut record = Record::default();
        record.set_log(Box::new(FileLog(saved_at.clone()))).unwrap();
        apply_and_move_the_batch(&mut h, &mut record);
        assert_eq!(read(&h, KV, "cpuset.cpus"), "0-1");
        assert!(!resctrl_state(&h).is_empty());

        let open_now = std::fs::read_dir("/proc/self/fd").unwrap().count() as u64;
        let limit = open_now + 2 * RESTORE_RESERVE as u64 + 8;
        setrlimit(Resource::RLIMIT_NOFILE, limit, limit).unwrap();
        let mut reserve = FdReserve::open(RESTORE_RESERVE).unwrap();
        let mut flood = Vec::new();
        let e = loop {
            match std::fs::File::open("/dev/null") {
                Ok(f) => flood.push(f),
                Err(e) => break e,
            }
        };
        assert_eq!(e.raw_os_error(), Some(libc::EMFILE), "{e}");
        assert!(!flood.is_empty());
        let e = std::fs::read_to_string(h.cg.dir(KV).join("cpuset.cpus")).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EMFILE), "no slot is left: {e}");

        assert_eq!(reserve.release(), RESTORE_RESERVE);
        restore(&h.kernel, &mut record, &mut h.gpu, &h.procfs);
        assert!(record.changes.is_empty(), "{:?}", record.changes);
        assert_eq!(h.cg.cgroup_of(60).as_deref(), Some("/"), "moved back");
        assert!(!h.cg.root().join("cohabit").exists(), "own groups removed");
        assert_eq!(read(&h, KV, "cpuset.cpus"), "", "original back");
        assert!(resctrl_state(&h).is_empty(), "resctrl groups removed");
        let saved: HostChanges =
            serde_json::from_str(&std::fs::read_to_string(&saved_at).unwrap()).unwrap();
        assert!(saved.is_empty(), "the saved record is empty");
        drop(flood);
        println!("emfile child: restored at the limit");
    }

    /// At exactly the CLOSID budget (the root and two groups), a regrouping that needs a
    /// new group while an old one goes applies in one call: the old group goes first and
    /// its tasks reach their new group within the same apply.
    #[test]
    fn a_regrouping_at_the_exact_closid_budget_applies_at_once() {
        let mut h = host_with_closids(3);
        h.cg.mkdir_owner("/system.slice/web.service", &[]).unwrap();
        h.cg.add_process(70, 1070, "/system.slice/web.service")
            .unwrap();
        for tid in [40, 50, 70] {
            h.resctrl_fake.add_task(tid).unwrap();
        }
        let mut specs = specs();
        specs.push(ServiceSpec {
            name: "web".into(),
            class: ServiceClass::LatencyCritical { p99_target_ms: 2.0 },
            gpu: None,
            priority: 0,
        });
        let a = |first, count| Allocation {
            cores: 2,
            llc_ways: WayRange::new(first, count),
            mba_pct: 100,
            gpu_mps_pct: None,
        };
        let plan_of = |web: Allocation| Plan {
            services: [("kv".to_string(), a(0, 4)), ("web".to_string(), web)].into(),
            best_effort: a(4, 8),
        };
        let layout_of = |p: &Plan| layout::layout(p, &h.facts, &specs, &BTreeSet::new()).unwrap();
        let t = targets(&h, &[50], Placement::InPlace);
        let mut record = Record::default();
        // kv and web share kv's group; the pool has its own: every CLOSID is used.
        let before = layout_of(&plan_of(a(0, 4)));
        assert_eq!(before.resctrl.len(), 2);
        apply(&h.kernel, &mut record, before, &t, &mut h.gpu, None).unwrap();
        let r = h.kernel.resctrl.as_ref().unwrap();
        r.move_tasks(Some("cohabit-best-effort"), &[50]).unwrap();
        assert_eq!(
            r.groups().unwrap(),
            vec!["cohabit-best-effort".to_string(), "cohabit-kv".to_string()]
        );
        // web joins the pool's allocation: the shared group is named after web now.
        let after = layout_of(&plan_of(a(4, 8)));
        let names: Vec<&str> = after.resctrl.iter().map(|g| g.name.as_str()).collect();
        assert_eq!(names, vec!["cohabit-kv", "cohabit-web"]);
        apply(&h.kernel, &mut record, after, &t, &mut h.gpu, None)
            .expect("the regrouping fits the budget in one apply");
        assert_eq!(
            r.groups().unwrap(),
            vec!["cohabit-kv".to_string(), "cohabit-web".to_string()]
        );
        assert_eq!(
            r.tasks(Some("cohabit-web")).unwrap(),
            vec![50],
            "the pool's task is in its new group, not left in the root group"
        );
        assert_eq!(record.resctrl_group_of("best-effort"), Some("cohabit-web"));
        let noted: Vec<&str> = record
            .changes
            .changes
            .iter()
            .filter_map(|c| match c {
                Change::ResctrlGroup { name } => Some(name.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(noted, vec!["cohabit-kv", "cohabit-web"]);
    }

    /// A regrouping that fails after the early removal puts the removed group back, with
    /// its values and tasks.
    #[test]
    fn a_failed_regrouping_at_the_budget_puts_the_removed_group_back() {
        let mut h = host_with_closids(3);
        h.resctrl_fake.add_task(50).unwrap();
        let t = targets(&h, &[50], Placement::InPlace);
        let mut record = Record::default();
        apply(
            &h.kernel,
            &mut record,
            writes(&h, &plan(2, 6, 6)),
            &t,
            &mut h.gpu,
            None,
        )
        .unwrap();
        let r = h.kernel.resctrl.as_ref().unwrap();
        r.move_tasks(Some("cohabit-best-effort"), &[50]).unwrap();
        let state = resctrl_state(&h);
        // Three new groups where the two old ones go: still one CLOSID short.
        let mut next = writes(&h, &plan(2, 6, 6));
        for g in &mut next.resctrl {
            g.name = format!("{}-new", g.name);
        }
        next.resctrl.push(layout::ResctrlGroup {
            name: "cohabit-extra".into(),
            ..next.resctrl[0].clone()
        });
        assert!(apply(&h.kernel, &mut record, next, &t, &mut h.gpu, None).is_err());
        assert_eq!(
            resctrl_state(&h),
            state,
            "the removed groups are back as they were"
        );
        assert_eq!(r.tasks(Some("cohabit-best-effort")).unwrap(), vec![50]);
        let noted = record
            .changes
            .changes
            .iter()
            .filter(|c| matches!(c, Change::ResctrlGroup { .. }))
            .count();
        assert_eq!(noted, 2, "{:?}", record.changes);
    }
}
