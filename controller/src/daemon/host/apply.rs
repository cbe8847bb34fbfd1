//! Host writes → the kernel, in a safe order, undone when a later write fails; processes
//! into their groups; everything back on exit.
//!
//! Order of [`apply`] (firecracker's jailer: every value first, processes last):
//! 1. resctrl: create the control groups that are missing, then write each group's
//!    schemata (only the lines that differ from the kernel's);
//! 2. cgroups: create the groups that are missing; CPU sets in the order of
//!    [`layout::cpu_steps`] (shrink before grow, so groups do not hold the same CPU in
//!    between); then CPU limits; values are compared with what the kernel holds and only
//!    the differences written;
//! 3. GPU shares (environment files);
//! 4. commit: the writes become the [`Record`]; resctrl groups no longer used are removed
//!    (their threads fall back to the root group until [`attach`] moves them).
//!
//! Processes join their groups afterwards ([`attach`]), when the values are in place.
//!
//! Rollback: before each write the value it replaces is noted (read from the kernel), or
//! "remove" for a group created in this apply. When a write fails, the notes are played
//! back in reverse order (the forward order reversed, so still safe) and the error is
//! returned: the host is as it was, the record and the plan the loop keeps are unchanged.
//! Unused groups are removed only after every write succeeded, because a removal cannot be
//! undone (the kernel moves the group's threads). An undo that fails is logged; since every
//! apply compares with the kernel, the next one rewrites whatever was left.

use std::collections::{BTreeMap, BTreeSet};

use cohabit_collectors::cgroup::{Cgroups, CpuList, CpuMax};
use cohabit_collectors::procfs::Procfs;
use cohabit_collectors::resctrl::{Resctrl, Schemata};

use super::layout::{self, HostWrites};
use super::{HostError, Throttle};
use crate::daemon::gpu::GpuActuator;

/// The kernel interfaces cohabit writes to (each absent when the host lacks it or it is not
/// writable).
#[derive(Debug)]
pub(super) struct Kernel {
    pub cgroups: Option<Cgroups>,
    pub resctrl: Option<Resctrl>,
}

/// What cohabit has put in force on the host, and what it must undo on exit.
#[derive(Debug, Default)]
pub(super) struct Record {
    /// The writes of the last apply that succeeded.
    pub writes: HostWrites,
    /// Where each process cohabit moved was before (`/proc/PID/cgroup` lines).
    originals: BTreeMap<u32, Vec<(u32, String, String)>>,
}

/// How to take one write back.
#[derive(Debug)]
enum Undo {
    RemoveResctrlGroup(String),
    Schemata {
        group: String,
        previous: Schemata,
    },
    RemoveCgroup(String),
    Cpus {
        group: String,
        previous: CpuList,
    },
    CpuMax {
        group: String,
        previous: CpuMax,
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
    /// Plays the notes back, newest first; failures are logged and counted.
    fn roll_back(self, k: &Kernel, gpu: &mut GpuActuator, pinned: Option<&str>) -> usize {
        let mut failed = 0;
        for undo in self.0.into_iter().rev() {
            let what = format!("{undo:?}");
            let result: Result<(), String> = match undo {
                Undo::RemoveResctrlGroup(g) => {
                    resctrl(k).and_then(|r| r.remove_group(&g).map_err(|e| e.to_string()))
                }
                Undo::Schemata { group, previous } => resctrl(k).and_then(|r| {
                    r.apply(&group, &previous)
                        .map(drop)
                        .map_err(|e| e.to_string())
                }),
                Undo::RemoveCgroup(g) => {
                    cgroups(k).and_then(|c| c.remove(&g).map_err(|e| e.to_string()))
                }
                Undo::Cpus { group, previous } => cgroups(k)
                    .and_then(|c| c.set_cpus(&group, &previous).map_err(|e| e.to_string())),
                Undo::CpuMax { group, previous } => cgroups(k)
                    .and_then(|c| c.set_cpu_max(&group, previous).map_err(|e| e.to_string())),
                Undo::Gpu { service, previous } => gpu.revert(&service, previous, pinned),
            };
            if let Err(e) = result {
                failed += 1;
                tracing::error!(undo = %what, error = %e, "could not undo a write; the next apply rewrites it");
            }
        }
        failed
    }
}

// The journal holds a note for an interface only after writing through it, so these are
// always present when asked.
fn resctrl(k: &Kernel) -> Result<&Resctrl, String> {
    k.resctrl
        .as_ref()
        .ok_or_else(|| "resctrl is not in use".to_string())
}

fn cgroups(k: &Kernel) -> Result<&Cgroups, String> {
    k.cgroups
        .as_ref()
        .ok_or_else(|| "cgroups are not in use".to_string())
}

/// Writes `next` to the host (see the module doc for the order and the rollback rule).
pub(super) fn apply(
    k: &Kernel,
    record: &mut Record,
    next: HostWrites,
    gpu: &mut GpuActuator,
    pinned: Option<&str>,
) -> Result<(), HostError> {
    let mut journal = Journal::default();
    let written = write_resctrl(k, &next, &mut journal)
        .and_then(|()| write_cgroups(k, &next, &mut journal))
        .and_then(|()| write_gpu(&next, gpu, pinned, &mut journal));
    if let Err(e) = written {
        let notes = journal.0.len();
        let failed = journal.roll_back(k, gpu, pinned);
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
    record.writes = next;
    if let Some(r) = &k.resctrl {
        for g in unused {
            if let Err(e) = r.remove_group(&g) {
                tracing::warn!(group = %g, error = %e, "could not remove a resctrl group no longer used");
            }
        }
    }
    Ok(())
}

fn write_resctrl(k: &Kernel, next: &HostWrites, journal: &mut Journal) -> Result<(), HostError> {
    let Some(r) = &k.resctrl else { return Ok(()) };
    let existing: BTreeSet<String> = r.groups()?.into_iter().collect();
    for g in &next.resctrl {
        if !existing.contains(&g.name) {
            r.ensure_group(&g.name)?;
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
    Ok(())
}

fn write_cgroups(k: &Kernel, next: &HostWrites, journal: &mut Journal) -> Result<(), HostError> {
    let Some(cg) = &k.cgroups else { return Ok(()) };
    let existing: BTreeSet<String> = cg.leftovers().into_iter().collect();
    for c in &next.cgroups {
        if !existing.contains(&c.name) {
            cg.create(&c.name)?;
            journal.0.push(Undo::RemoveCgroup(c.name.clone()));
        }
    }
    // CPU sets: what the kernel holds (groups just created hold their parent's and are
    // simply set), then the writes in a safe order.
    let mut current = BTreeMap::new();
    let mut desired = BTreeMap::new();
    for c in &next.cgroups {
        let Some(want) = &c.cpus else { continue };
        desired.insert(c.name.clone(), want.clone());
        if existing.contains(&c.name) {
            if let Some(have) = cg.cpus(&c.name)? {
                current.insert(c.name.clone(), have);
            }
        }
    }
    let mut now = current.clone();
    for (name, cpus) in layout::cpu_steps(&current, &desired) {
        cg.set_cpus(&name, &cpus)?;
        if let Some(previous) = now.insert(name.clone(), cpus) {
            journal.0.push(Undo::Cpus {
                group: name,
                previous,
            });
        }
    }
    for c in &next.cgroups {
        let Some(want) = c.cpu_max else { continue };
        let previous = if existing.contains(&c.name) {
            cg.cpu_max(&c.name)?
        } else {
            None
        };
        if previous == Some(want) {
            continue;
        }
        cg.set_cpu_max(&c.name, want)?;
        if let Some(previous) = previous {
            journal.0.push(Undo::CpuMax {
                group: c.name.clone(),
                previous,
            });
        }
    }
    Ok(())
}

fn write_gpu(
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
        gpu.publish(&share.service, share.pct, pinned)
            .map_err(HostError::Gpu)?;
        journal.0.push(Undo::Gpu {
            service: share.service.clone(),
            previous,
        });
    }
    Ok(())
}

impl Record {
    /// The resctrl group in force for plan group `group`.
    pub fn resctrl_group_of(&self, group: &str) -> Option<&str> {
        self.writes.resctrl_group_of(group)
    }
}

/// One service's processes, to be placed in its groups.
#[derive(Debug)]
pub(super) struct Members<'a> {
    /// Service name (for logs).
    pub service: &'a str,
    /// Its plan group.
    pub group: &'a str,
    /// Every process it has now.
    pub found: &'a BTreeSet<u32>,
    /// Those that appeared since the last look.
    pub new: &'a [u32],
}

/// Puts a service's new processes in its cgroup (remembering where they were) and every
/// thread of its processes in its resctrl group.
pub(super) fn attach(
    k: &Kernel,
    record: &mut Record,
    procfs: &Procfs,
    m: &Members<'_>,
    warn: &mut Throttle,
) {
    if let Some(cg) = &k.cgroups {
        let name = layout::cgroup_name(m.group);
        for &pid in m.new {
            let Some(orig) = procfs.cgroups(pid) else {
                continue;
            };
            match cg.add_process(&name, pid) {
                Ok(true) => {
                    record.originals.entry(pid).or_insert(orig);
                }
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(service = %m.service, pid, error = %e, "could not move process into its cgroup");
                }
            }
        }
    }
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
}

/// Removes what a crashed run left behind (its processes go to each hierarchy's root).
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
    }
    if let Some(r) = &k.resctrl {
        for g in own_groups(r) {
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

fn own_groups(r: &Resctrl) -> Vec<String> {
    r.own_groups().unwrap_or_else(|e| {
        tracing::warn!(error = %e, "could not list resctrl groups; none removed");
        vec![]
    })
}

/// Puts every process back where it was, removes every group cohabit created and restores
/// the GPU clients' environment files.
pub(super) fn restore(k: &Kernel, record: &mut Record, gpu: &mut GpuActuator) {
    let mut restored = 0;
    if let Some(cg) = &k.cgroups {
        for (pid, orig) in std::mem::take(&mut record.originals) {
            match cg.restore_process(pid, &orig) {
                Ok(true) => restored += 1,
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(pid, error = %e, "could not put a process back in its cgroup");
                }
            }
        }
        for g in cg.leftovers() {
            if let Err(e) = cg.evacuate(&g) {
                tracing::warn!(group = %g, error = %e, "could not move the last processes out of a cgroup");
            }
            if let Err(e) = cg.remove(&g) {
                tracing::warn!(group = %g, error = %e, "could not remove cgroup");
            }
        }
        cg.remove_parent();
    }
    if let Some(r) = &k.resctrl {
        for g in own_groups(r) {
            if let Err(e) = r.remove_group(&g) {
                tracing::warn!(group = %g, error = %e, "could not remove resctrl group");
            }
        }
    }
    record.writes = HostWrites::default();
    gpu.restore();
    tracing::info!(restored, "host restored");
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};
    use std::sync::Arc;

    use cohabit_collectors::cgroup::{Version, PARENT};
    use cohabit_collectors::perf::PerfSupport;
    use cohabit_collectors::resctrl::fake::FakeResctrl;
    use cohabit_core::{Allocation, Plan, ServiceClass, ServiceSpec, WayRange};

    use super::*;
    use crate::daemon::host::discover::{self, CapacityInput, HostFacts};

    /// A fake resctrl (12 ways, MBA) and a v2 cgroup tree in a temporary directory.
    struct Host {
        fake: FakeResctrl,
        _cg: tempfile::TempDir,
        unified: PathBuf,
        kernel: Kernel,
        facts: HostFacts,
        gpu: GpuActuator,
    }

    fn host() -> Host {
        let fake = FakeResctrl::builder().ways(12).build().unwrap();
        let resctrl = Resctrl::discover(&fake.paths(), Arc::new(fake.clone()))
            .unwrap()
            .unwrap();
        let cg = tempfile::tempdir().unwrap();
        let unified = cg.path().join("unified");
        std::fs::create_dir_all(&unified).unwrap();
        let cgroups = Cgroups {
            version: Version::V2,
            mounts: [("unified".to_string(), unified.clone())].into(),
            v2_controllers: vec!["cpuset".into(), "cpu".into()],
        };
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
        };
        Host {
            fake,
            _cg: cg,
            unified,
            kernel: Kernel {
                cgroups: Some(cgroups),
                resctrl: Some(resctrl),
            },
            facts,
            gpu: GpuActuator::new(&[], None),
        }
    }

    /// Lays out a group as the kernel would on mkdir (v2: empty `cpuset.cpus`, no limit).
    fn cgroup(unified: &Path, name: &str) -> PathBuf {
        let dir = unified.join(PARENT).join(name);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("cpuset.cpus"), "").unwrap();
        std::fs::write(dir.join("cpu.max"), "max 100000\n").unwrap();
        std::fs::write(dir.join("cgroup.procs"), "").unwrap();
        dir
    }

    fn specs() -> Vec<ServiceSpec> {
        vec![
            ServiceSpec {
                name: "kv".into(),
                class: ServiceClass::LatencyCritical { p99_target_ms: 1.0 },
                gpu: None,
            },
            ServiceSpec {
                name: "batch".into(),
                class: ServiceClass::BestEffort,
                gpu: None,
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

    fn read(path: PathBuf) -> String {
        std::fs::read_to_string(path).unwrap()
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

    #[test]
    fn a_plan_is_written_whole_and_recorded() {
        let mut h = host();
        let (kv, be) = (
            cgroup(&h.unified, "lc-kv"),
            cgroup(&h.unified, "best-effort"),
        );
        let mut record = Record::default();
        let w = writes(&h, &plan(2, 6, 6));
        apply(&h.kernel, &mut record, w.clone(), &mut h.gpu, None).unwrap();
        assert_eq!(record.writes, w);
        assert_eq!(
            resctrl_state(&h),
            vec![
                ("cohabit-best-effort".into(), "L3:0=fc0\nMB:0=100\n".into()),
                ("cohabit-kv".into(), "L3:0=3f\nMB:0=100\n".into()),
            ]
        );
        assert_eq!(
            (read(kv.join("cpuset.cpus")), read(be.join("cpuset.cpus"))),
            ("0-1".into(), "2-7".into())
        );
        assert_eq!(
            read(kv.join("cpu.max")),
            "max 100000\n",
            "unchanged, so not written"
        );
        // kv takes two CPUs and the pool's ways, the pool pauses.
        let w2 = writes(&h, &plan(4, 8, 0));
        apply(&h.kernel, &mut record, w2, &mut h.gpu, None).unwrap();
        assert_eq!(
            (read(kv.join("cpuset.cpus")), read(be.join("cpuset.cpus"))),
            ("0-3".into(), "4-7".into())
        );
        assert_eq!(read(be.join("cpu.max")), "5000 100000");
        assert!(read(h.fake.root().join("cohabit-kv/schemata")).contains("L3:0=ff"));
    }

    #[test]
    fn a_failure_at_the_cgroup_step_leaves_resctrl_and_the_cpu_sets_as_before() {
        let mut h = host();
        let (kv, be) = (
            cgroup(&h.unified, "lc-kv"),
            cgroup(&h.unified, "best-effort"),
        );
        let mut record = Record::default();
        let first = writes(&h, &plan(2, 6, 6));
        apply(&h.kernel, &mut record, first.clone(), &mut h.gpu, None).unwrap();
        let resctrl_before = resctrl_state(&h);
        // The pool's CPU limit cannot be read or written (the kernel would say EIO or
        // EACCES; a directory in place of the file fails the same way).
        std::fs::remove_file(be.join("cpu.max")).unwrap();
        std::fs::create_dir(be.join("cpu.max")).unwrap();
        let next = writes(&h, &plan(4, 8, 0));
        let e = apply(&h.kernel, &mut record, next, &mut h.gpu, None).unwrap_err();
        assert!(e.to_string().contains("cpu.max"), "{e}");
        assert_eq!(
            resctrl_state(&h),
            resctrl_before,
            "the masks written first are undone"
        );
        assert_eq!(
            (read(kv.join("cpuset.cpus")), read(be.join("cpuset.cpus"))),
            ("0-1".into(), "2-7".into()),
            "so are the CPU sets"
        );
        assert_eq!(
            record.writes, first,
            "the record still holds the plan in force"
        );
    }

    #[test]
    fn groups_created_by_a_failed_apply_are_removed() {
        let mut h = host();
        // No cgroup exists yet; the unified tree creates directories but, unlike the
        // kernel, no files in them, so the first CPU write fails.
        let mut record = Record::default();
        let e = apply(
            &h.kernel,
            &mut record,
            writes(&h, &plan(2, 6, 6)),
            &mut h.gpu,
            None,
        )
        .unwrap_err();
        assert!(e.to_string().contains("cpuset.cpus"), "{e}");
        assert!(
            resctrl_state(&h).is_empty(),
            "resctrl groups created for it are gone"
        );
        assert!(
            h.kernel.cgroups.as_ref().unwrap().leftovers().is_empty(),
            "and the cgroups"
        );
        assert_eq!(record.writes, HostWrites::default());
    }

    #[test]
    fn groups_no_longer_used_are_removed_after_the_writes_succeed() {
        let mut h = host();
        cgroup(&h.unified, "lc-kv");
        cgroup(&h.unified, "best-effort");
        let mut record = Record::default();
        apply(
            &h.kernel,
            &mut record,
            writes(&h, &plan(2, 6, 6)),
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
            &mut h.gpu,
            None,
        )
        .unwrap();
        assert_eq!(
            resctrl_state(&h),
            vec![("cohabit-kv".into(), "L3:0=3f\nMB:0=100\n".into())]
        );
        assert_eq!(record.resctrl_group_of("best-effort"), Some("cohabit-kv"));
    }

    #[test]
    fn restore_removes_every_group_and_forgets_the_record() {
        let mut h = host();
        cgroup(&h.unified, "lc-kv");
        cgroup(&h.unified, "best-effort");
        let mut record = Record::default();
        apply(
            &h.kernel,
            &mut record,
            writes(&h, &plan(2, 6, 6)),
            &mut h.gpu,
            None,
        )
        .unwrap();
        // A plain directory keeps its files, so rmdir fails where the kernel's would not:
        // remove them as the kernel would once the group is empty.
        for g in ["lc-kv", "best-effort"] {
            let d = h.unified.join(PARENT).join(g);
            for f in ["cpuset.cpus", "cpu.max", "cgroup.procs"] {
                std::fs::remove_file(d.join(f)).unwrap();
            }
        }
        restore(&h.kernel, &mut record, &mut h.gpu);
        assert!(resctrl_state(&h).is_empty());
        assert!(!h.unified.join(PARENT).exists());
        assert_eq!(record.writes, HostWrites::default());
    }
}
