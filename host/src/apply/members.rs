//! Processes after the values: moved into cohabit's groups where configured, threads put
//! in their resctrl and monitoring groups.

use super::*;

/// Moves processes into cohabit's groups (`placement = "move"`), each noted first with
/// its pid, start time and the cgroups it leaves. A process that exited meanwhile is
/// skipped (and its note dropped).
pub(crate) fn move_processes(
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
pub(crate) fn forget_vanished(record: &mut Record, procfs: &Procfs) {
    record.forget(|c| match c {
        Change::MovedProcess {
            pid, start_time, ..
        } => procfs.stat(*pid).map(|s| s.start_ticks) != Some(*start_time),
        _ => false,
    });
}

/// One service's processes, to be placed in its resctrl group.
#[derive(Debug)]
pub(crate) struct Members<'a> {
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
pub(crate) fn attach_resctrl(
    k: &Kernel,
    record: &Record,
    procfs: &Procfs,
    m: &Members<'_>,
    warn: &mut WarnLimit,
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
pub(crate) fn prune_mon_groups(
    k: &Kernel,
    ctrl: &str,
    wanted: &BTreeSet<&str>,
    warn: &mut WarnLimit,
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
