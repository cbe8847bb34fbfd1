//! Writing resctrl: control groups and their schemata, the root group's cache lines, and
//! room at the CLOSID budget.

use super::*;

pub(super) fn write_resctrl(
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
pub(super) fn write_root_cache(
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
pub(super) fn make_room(
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
