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
    choices: layout::Choices,
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
        idle_class: true,
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
        choices: layout::Choices::default(),
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
        gpu_memory_mib: Default::default(),
    }
}

fn writes(h: &Host, p: &Plan) -> HostWrites {
    layout::layout(p, &h.facts, &h.choices, &specs(), &BTreeSet::new()).unwrap()
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
    h.choices.unmanaged_cache = layout::UnmanagedCache::Pool;
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
    h.choices.unmanaged_cache = layout::UnmanagedCache::Pool;
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
        gpu_memory_mib: Default::default(),
    };
    let w = |p: &Plan| layout::layout(p, &h.facts, &h.choices, &specs, &BTreeSet::new()).unwrap();
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
        gpu_memory_mib: Default::default(),
    };
    let layout_of =
        |p: &Plan| layout::layout(p, &h.facts, &h.choices, &specs, &BTreeSet::new()).unwrap();
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
