//! Host apply and restore on this machine's real cgroups: "owner" cgroups made the way a
//! container runtime makes them, real processes in them. Needs root and writable cpuset and
//! cpu controllers; otherwise each test prints why it skipped (a failure under
//! `COHABIT_REQUIRE_ROOT_TESTS=1`, as in CI). Every cgroup a test makes is removed when it
//! ends, also when it fails.

use std::collections::BTreeSet;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::{Arc, Mutex};

use cohabit_collectors::cgroup::testing::{self, OwnerCgroup};
use cohabit_collectors::cgroup::{Cgroups, Controller, CpuList, CpuWeight};
use cohabit_collectors::kfs::{KernelFs, LockGuard, RealFs};
use cohabit_collectors::perf::PerfSupport;
use cohabit_collectors::procfs::Procfs;
use cohabit_collectors::HostPaths;
use cohabit_core::{Allocation, Plan, ServiceClass, ServiceSpec, WayRange, BEST_EFFORT_GROUP};

use super::apply::{self, Kernel, Record};
use super::discover::{self, CapacityInput, HostFacts};
use super::layout;
use super::placement::{self, Targets};
use crate::gpu::GpuActuator;
use crate::spec::Placement;

/// The real cgroups are one tree: these tests take turns.
static TREE: Mutex<()> = Mutex::new(());

struct Kill(Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn sleeper() -> Kill {
    Kill(Command::new("sleep").arg("120").spawn().unwrap())
}

/// The real kernel, watched: after every `cpuset.cpus` write the CPU sets of `watched`
/// are read back, and a pair that starts sharing a CPU is recorded.
#[derive(Debug, Default)]
struct Watch {
    watched: Mutex<Vec<PathBuf>>,
    sharing: Mutex<BTreeSet<(usize, usize)>>,
    writes: Mutex<Vec<(PathBuf, String)>>,
    violations: Mutex<Vec<String>>,
}

impl Watch {
    fn sets(&self) -> Vec<CpuList> {
        self.watched
            .lock()
            .unwrap()
            .iter()
            .map(|d| {
                let v1 = std::fs::read_to_string(d.join("cpuset.cpus"));
                let text = v1
                    .ok()
                    .filter(|t| !t.trim().is_empty())
                    .or_else(|| std::fs::read_to_string(d.join("cpuset.cpus.effective")).ok())
                    .unwrap_or_default();
                text.parse().unwrap()
            })
            .collect()
    }

    /// Reads the watched sets; returns the pairs that share a CPU now and did not before.
    fn observe(&self) -> Vec<(usize, usize)> {
        let sets = self.sets();
        let mut now = BTreeSet::new();
        for (i, a) in sets.iter().enumerate() {
            for (j, b) in sets.iter().enumerate().skip(i + 1) {
                if a.overlaps(b) {
                    now.insert((i, j));
                }
            }
        }
        let mut sharing = self.sharing.lock().unwrap();
        let new = now.difference(&sharing).copied().collect();
        *sharing = now;
        new
    }
}

impl KernelFs for Watch {
    fn read_to_string(&self, path: &Path) -> io::Result<String> {
        RealFs.read_to_string(path)
    }

    fn write(&self, path: &Path, data: &str) -> io::Result<()> {
        RealFs.write(path, data)?;
        self.writes
            .lock()
            .unwrap()
            .push((path.to_path_buf(), data.to_string()));
        if path.ends_with("cpuset.cpus") {
            let new = self.observe();
            if !new.is_empty() {
                let sets = self.sets();
                self.violations.lock().unwrap().push(format!(
                    "after {} = {data}: {new:?} share a CPU ({sets:?})",
                    path.display()
                ));
            }
        }
        Ok(())
    }

    fn create_dir(&self, path: &Path) -> io::Result<()> {
        RealFs.create_dir(path)
    }

    fn remove_dir(&self, path: &Path) -> io::Result<()> {
        RealFs.remove_dir(path)
    }

    fn subdirs(&self, path: &Path) -> io::Result<Vec<String>> {
        RealFs.subdirs(path)
    }

    fn identity(&self, path: &Path) -> io::Result<u64> {
        RealFs.identity(path)
    }

    fn lock_exclusive(&self, path: &Path) -> io::Result<Box<dyn LockGuard>> {
        RealFs.lock_exclusive(path)
    }
}

fn facts(cpus: Vec<u32>) -> HostFacts {
    HostFacts {
        capacity: discover::capacity(&CapacityInput {
            name: "test".into(),
            cpus: cpus.len(),
            freq_ghz: None,
            llc_bytes: None,
            mem_bw_gbps: None,
            resctrl: None,
            latency_critical: 1,
            gpus: vec![],
        }),
        cpus,
        writable: vec!["cpuset".into(), "cpu".into()],
        can_cpuset: true,
        can_quota: true,
        resctrl: None,
        perf: PerfSupport::Unsupported("test".into()),
        clk_tck: 100.0,
        idle_class: true,
    }
}

fn lc(name: &str) -> ServiceSpec {
    ServiceSpec {
        name: name.into(),
        class: ServiceClass::LatencyCritical { p99_target_ms: 1.0 },
        gpu: None,
        priority: 0,
    }
}

fn batch() -> ServiceSpec {
    ServiceSpec {
        name: "batch".into(),
        class: ServiceClass::BestEffort,
        gpu: None,
        priority: 0,
    }
}

fn alloc(cores: u32) -> Allocation {
    Allocation {
        cores,
        llc_ways: WayRange::new(0, 1),
        mba_pct: 100,
        gpu_mps_pct: None,
    }
}

/// Where the values of the LC services in `lcs` (name, pid) go, in place.
fn targets(cg: &Cgroups, procfs: &Procfs, lcs: &[(&str, u32)]) -> Targets {
    let placements: Vec<(String, placement::ServicePlacement)> = lcs
        .iter()
        .map(|(n, pid)| {
            let p = placement::place(
                cg,
                procfs,
                &[*pid].into(),
                &layout::cgroup_name(n),
                Placement::InPlace,
                &Controller::ALL,
            );
            ((*n).to_string(), p)
        })
        .collect();
    let (t, conflicts) = placement::group_targets(placements.iter().map(|(n, p)| (n.as_str(), p)));
    assert!(conflicts.is_empty(), "{conflicts:?}");
    t
}

/// The CPUs this machine's cgroups hand out (the root cpuset's).
fn online(cg: &Cgroups) -> Vec<u32> {
    let root = cg.mount(Controller::Cpuset).unwrap();
    let text = std::fs::read_to_string(root.join("cpuset.cpus"))
        .or_else(|_| std::fs::read_to_string(root.join("cpuset.cpus.effective")))
        .unwrap();
    text.parse::<CpuList>().unwrap().0
}

#[test]
fn an_owners_cgroup_is_written_in_place_its_process_stays_and_restore_puts_it_back() {
    let _tree = TREE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let Some(cg) = testing::real_cgroups() else {
        return;
    };
    let owner = OwnerCgroup::create(&cg, &format!("test-owner-{}", std::process::id())).unwrap();
    let child = sleeper();
    let pid = child.0.id();
    owner.add(pid).unwrap();
    let procfs = Procfs::new("/proc");
    let before = procfs.cgroups(pid).unwrap();
    let (cpuset, cpu) = (owner.dir(Controller::Cpuset), owner.dir(Controller::Cpu));
    let (weight_file, highest) = cg.weight_file(CpuWeight::Highest);
    let original = |dir: &Path, file: &str| cg.read_control(dir, file).unwrap();
    let originals = (original(cpuset, "cpuset.cpus"), original(cpu, weight_file));

    let cpus = online(&cg);
    let facts = facts(cpus.clone());
    let kernel = Kernel {
        cgroups: Some(cg.clone()),
        resctrl: None,
    };
    let specs = vec![lc("kv"), batch()];
    let n = u32::try_from(cpus.len()).unwrap();
    let plan = Plan {
        services: [("kv".to_string(), alloc(1))].into(),
        best_effort: alloc(n - 1),
        gpu_memory_mib: Default::default(),
    };
    let writes = layout::layout(
        &plan,
        &facts,
        &layout::Choices::default(),
        &specs,
        &BTreeSet::new(),
    )
    .unwrap();
    let t = targets(&cg, &procfs, &[("kv", pid)]);
    let mut record = Record::default();
    let mut gpu = GpuActuator::new(&[], None);
    apply::apply(&kernel, &mut record, writes, &t, &mut gpu, None).unwrap();

    assert_eq!(
        cg.read_control(cpuset, "cpuset.cpus").unwrap(),
        cpus[0].to_string()
    );
    assert_eq!(cg.read_control(cpu, weight_file).unwrap(), highest);
    assert_eq!(
        procfs.cgroups(pid).unwrap(),
        before,
        "the process stays where its owner put it"
    );
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    assert!(
        status.contains(&format!("Cpus_allowed_list:\t{}\n", cpus[0])),
        "the kernel narrowed it:\n{status}"
    );
    assert_eq!(record.changes.changes.len(), 2, "{:?}", record.changes);

    apply::restore(&kernel, &mut record, &mut gpu, &procfs);
    assert_eq!(
        (original(cpuset, "cpuset.cpus"), original(cpu, weight_file)),
        originals,
        "the owner's values are back"
    );
    assert!(record.changes.is_empty(), "{:?}", record.changes);
    assert_eq!(procfs.cgroups(pid).unwrap(), before);
    drop(child);
}

#[test]
fn a_batch_owners_cgroup_joins_the_real_idle_class_and_gets_its_weight_back() {
    let _tree = TREE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let Some(cg) = testing::real_cgroups() else {
        return;
    };
    if !cg.has_idle_class() {
        cohabit_testkit::skip(
            cohabit_testkit::Need::Machine,
            "this kernel has no idle class for groups (cpu.idle, Linux 5.15)",
        );
        return;
    }
    let owner = OwnerCgroup::create(&cg, &format!("test-batch-{}", std::process::id())).unwrap();
    let child = sleeper();
    let pid = child.0.id();
    owner.add(pid).unwrap();
    let procfs = Procfs::new("/proc");
    let cpu = owner.dir(Controller::Cpu);
    let (weight_file, _) = cg.weight_file(CpuWeight::Lowest);
    // The owner's own weight, which leaving the class would reset to the default.
    cg.write_control(cpu, weight_file, "300").unwrap();

    let cpus = online(&cg);
    let n = u32::try_from(cpus.len()).unwrap();
    let facts = facts(cpus);
    let kernel = Kernel {
        cgroups: Some(cg.clone()),
        resctrl: None,
    };
    let plan = Plan {
        services: [("kv".to_string(), alloc(1))].into(),
        best_effort: alloc(n.saturating_sub(1)),
        gpu_memory_mib: Default::default(),
    };
    let writes = layout::layout(
        &plan,
        &facts,
        &layout::Choices::default(),
        &[lc("kv"), batch()],
        &BTreeSet::new(),
    )
    .unwrap();
    let be = placement::place(
        &cg,
        &procfs,
        &[pid].into(),
        BEST_EFFORT_GROUP,
        Placement::InPlace,
        &Controller::ALL,
    );
    let (t, conflicts) = placement::group_targets([(BEST_EFFORT_GROUP, &be)]);
    assert!(conflicts.is_empty(), "{conflicts:?}");
    let mut record = Record::default();
    let mut gpu = GpuActuator::new(&[], None);
    apply::apply(&kernel, &mut record, writes.clone(), &t, &mut gpu, None).unwrap();
    assert_eq!(cg.read_control(cpu, "cpu.idle").unwrap(), "1");
    assert!(
        cg.write_control(cpu, weight_file, "300").is_err(),
        "the kernel refuses a weight for a group in the idle class"
    );
    // Applied again: nothing differs, so nothing fails on the refused weight.
    apply::apply(&kernel, &mut record, writes, &t, &mut gpu, None).unwrap();

    apply::restore(&kernel, &mut record, &mut gpu, &procfs);
    assert_eq!(cg.read_control(cpu, "cpu.idle").unwrap(), "0");
    assert_eq!(
        cg.read_control(cpu, weight_file).unwrap(),
        "300",
        "the owner's weight, not the kernel's default"
    );
    assert!(record.changes.is_empty(), "{:?}", record.changes);
    drop(child);
}

/// An owner cgroup per name in `names`, a sleeping process in each.
fn owners_with_sleepers(plain: &Cgroups, names: &[&str]) -> (Vec<OwnerCgroup>, Vec<Kill>) {
    let tag = std::process::id();
    let owners: Vec<OwnerCgroup> = names
        .iter()
        .map(|s| OwnerCgroup::create(plain, &format!("test-owner-{s}-{tag}")).unwrap())
        .collect();
    let children: Vec<Kill> = owners
        .iter()
        .map(|o| {
            let k = sleeper();
            o.add(k.0.id()).unwrap();
            k
        })
        .collect();
    (owners, children)
}

#[test]
fn growing_a_service_between_two_others_never_makes_two_share_a_cpu_on_the_real_tree() {
    let _tree = TREE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let Some(plain) = testing::real_cgroups() else {
        return;
    };
    let watch = Arc::new(Watch::default());
    let cg = Cgroups::detect_with(&HostPaths::standard(), watch.clone())
        .unwrap()
        .unwrap();
    let cpus = online(&plain);
    let n = u32::try_from(cpus.len()).unwrap();
    // Three services in consecutive blocks and one that grows between the others needs 4
    // CPUs; with fewer, two services go from their owners' full sets to one CPU each,
    // which still steps through the ordering on the real tree.
    let names: Vec<&str> = if n >= 4 {
        vec!["a", "b", "c"]
    } else {
        println!("note: {n} CPUs; the growth between two others needs 4, so two services only");
        vec!["a", "b"]
    };
    let (owners, children) = owners_with_sleepers(&plain, &names);
    *watch.watched.lock().unwrap() = owners
        .iter()
        .map(|o| o.dir(Controller::Cpuset).to_path_buf())
        .collect();
    let procfs = Procfs::new("/proc");
    let lcs: Vec<(&str, u32)> = names
        .iter()
        .zip(&children)
        .map(|(s, k)| (*s, k.0.id()))
        .collect();
    let t = targets(&cg, &procfs, &lcs);
    let kernel = Kernel {
        cgroups: Some(cg.clone()),
        resctrl: None,
    };
    let facts = facts(cpus.clone());
    let mut specs: Vec<ServiceSpec> = names.iter().map(|s| lc(s)).collect();
    specs.push(batch());
    let plan = |grown: u32| {
        let mut p = Plan {
            services: names.iter().map(|s| ((*s).to_string(), alloc(1))).collect(),
            best_effort: alloc(0),
            gpu_memory_mib: Default::default(),
        };
        if let Some(b) = p.services.get_mut("b").filter(|_| names.len() == 3) {
            b.cores = grown;
        }
        let used: u32 = p.services.values().map(|a| a.cores).sum();
        p.best_effort.cores = n.saturating_sub(used);
        p
    };
    let writes = |p: &Plan| {
        layout::layout(
            p,
            &facts,
            &layout::Choices::default(),
            &specs,
            &BTreeSet::new(),
        )
        .unwrap()
    };
    let mut record = Record::default();
    let mut gpu = GpuActuator::new(&[], None);
    assert!(watch.observe().len() <= names.len() * (names.len() - 1) / 2);

    apply::apply(&kernel, &mut record, writes(&plan(1)), &t, &mut gpu, None).unwrap();
    if names.len() == 3 {
        apply::apply(&kernel, &mut record, writes(&plan(2)), &t, &mut gpu, None).unwrap();
    }
    let violations = watch.violations.lock().unwrap().clone();
    let sets = watch.sets();
    let steps = watch
        .writes
        .lock()
        .unwrap()
        .iter()
        .filter(|(p, _)| p.ends_with("cpuset.cpus"))
        .count();
    apply::restore(&kernel, &mut record, &mut gpu, &procfs);
    assert!(violations.is_empty(), "{violations:#?}");
    assert!(steps >= names.len(), "every step was watched ({steps})");
    let expected: Vec<CpuList> = if names.len() == 3 {
        vec![
            CpuList(vec![cpus[0]]),
            CpuList(vec![cpus[1], cpus[2]]),
            CpuList(vec![cpus[3]]),
        ]
    } else {
        vec![CpuList(vec![cpus[0]]), CpuList(vec![cpus[1]])]
    };
    assert_eq!(sets, expected, "the final layout");
    assert!(record.changes.is_empty(), "{:?}", record.changes);
    for o in &owners {
        assert_eq!(
            plain.cpus_at(o.dir(Controller::Cpuset)).unwrap().0,
            cpus,
            "restored"
        );
    }
    assert!(!t.contains_key(BEST_EFFORT_GROUP));
    drop(children);
}
