//! Putting the host back from the record of changes alone: on exit, after a crash, and
//! for groups a run left without a record.

use super::*;

/// Removes what a run left behind without a record (its processes go to each hierarchy's
/// root: cohabit only moves processes out of a root, or, on v2, out of a cgroup without
/// the controller, whose path only a record keeps).
pub(crate) fn clean_leftovers(k: &Kernel) {
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
pub(crate) fn restore(k: &Kernel, record: &mut Record, gpu: &mut GpuActuator, procfs: &Procfs) {
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
pub(super) fn origins(k: &Kernel, changes: &HostChanges) -> BTreeMap<PathBuf, PathBuf> {
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

pub(super) fn restore_moved(k: &Kernel, c: &Change, procfs: &Procfs) -> Result<(), UndoError> {
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

pub(super) fn remove_created(
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
        for pid in cg.processes_in_dir(dir)? {
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
pub(super) const REMOVE_ATTEMPTS: u32 = 10;

/// The wait between two attempts (at most 0.2 s in all).
pub(super) const REMOVE_RETRY: std::time::Duration = std::time::Duration::from_millis(20);

pub(super) fn restore_file(
    k: &Kernel,
    dir: &Path,
    file: &str,
    original: &str,
) -> Result<(), UndoError> {
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
