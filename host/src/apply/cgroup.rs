//! Writing cgroups: cohabit's own groups, CPU sets in a safe order, limits, weights and
//! the idle class.

use super::*;

/// Creates cohabit's own group `dir` (and its parent) where missing, noting each first.
pub(super) fn ensure_own(
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

pub(super) fn write_cgroups(
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
pub(super) fn write_class(
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
pub(super) fn keep_for_restore(
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
