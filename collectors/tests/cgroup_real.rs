//! cgroups on the real kernel of this machine. Needs root and writable cpuset and cpu
//! controllers; otherwise each test prints why it skipped (a failure under
//! `COHABIT_REQUIRE_ROOT_TESTS=1`, as in CI).

use std::process::{Child, Command};

use cohabit_collectors::cgroup::testing::{self, OwnerCgroup};
use cohabit_collectors::cgroup::{Controller, CpuList, CpuWeight, InPlace, Version};
use cohabit_collectors::procfs::Procfs;

struct Kill(Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn sleeper() -> Kill {
    Kill(Command::new("sleep").arg("60").spawn().unwrap())
}

/// The CPU set of `dir` as the kernel holds it.
fn cpus(dir: &std::path::Path) -> CpuList {
    std::fs::read_to_string(dir.join("cpuset.cpus"))
        .unwrap()
        .parse()
        .unwrap()
}

#[test]
fn an_owners_cgroup_is_controlled_in_place_and_its_process_stays() {
    let Some(cg) = testing::real_cgroups() else {
        return;
    };
    let owner = OwnerCgroup::create(&cg, &format!("test-owner-{}", std::process::id())).unwrap();
    let child = sleeper();
    let pid = child.0.id();
    owner.add(pid).unwrap();
    let procfs = Procfs::new("/proc");
    let before = procfs.cgroups(pid).unwrap();

    for c in Controller::ALL {
        let home = cg.home(c.name(), &before).unwrap();
        assert_eq!(home, owner.dir(c), "{c:?}");
        assert_eq!(cg.in_place(c, &home), InPlace::Writable, "{c:?}");
    }
    let cpuset = owner.dir(Controller::Cpuset);
    let cpu = owner.dir(Controller::Cpu);
    let original_cpus = cg.read_control(cpuset, "cpuset.cpus").unwrap();
    let (weight_file, weight) = cg.weight_file(CpuWeight::Highest);
    let original_weight = cg.read_control(cpu, weight_file).unwrap();
    let first = cpus(cpuset).0[0];
    cg.write_control(cpuset, "cpuset.cpus", &first.to_string())
        .unwrap();
    cg.write_control(cpu, weight_file, &weight).unwrap();
    let half = cohabit_collectors::cgroup::CpuMax::for_cores(Some(0.5));
    for (file, value) in cg.cpu_max_files(half) {
        cg.write_control(cpu, file, &value).unwrap();
    }
    assert_eq!(cpus(cpuset), CpuList(vec![first]));
    assert_eq!(cg.cpus_at(cpuset).unwrap(), CpuList(vec![first]));
    assert_eq!(cg.read_control(cpu, weight_file).unwrap(), weight);
    assert_eq!(cg.cpu_max_at(cpu).unwrap(), half);
    assert_eq!(
        procfs.cgroups(pid).unwrap(),
        before,
        "the process is where its owner put it"
    );
    // The kernel narrows the process's affinity to the set.
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let allowed = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .unwrap();
    assert_eq!(allowed.trim(), first.to_string());

    cg.write_control(cpuset, "cpuset.cpus", &original_cpus)
        .unwrap();
    cg.write_control(cpu, weight_file, &original_weight)
        .unwrap();
    for (file, value) in cg.cpu_max_files(cohabit_collectors::cgroup::CpuMax::for_cores(None)) {
        cg.write_control(cpu, file, &value).unwrap();
    }
    assert_eq!(
        cg.read_control(cpuset, "cpuset.cpus").unwrap(),
        original_cpus
    );
    drop(child);
}

#[test]
fn a_bare_process_moves_into_cohabits_group_in_the_cpu_hierarchies_only_and_back() {
    let Some(cg) = testing::real_cgroups() else {
        return;
    };
    if cg.version != Version::V1 {
        // A shape of host, not a missing privilege: not a failure under the CI switch.
        cohabit_testkit::skip(
            cohabit_testkit::Need::Machine,
            "this test moves a process out of the v1 hierarchy roots; v2 moves are tested on the fake tree",
        );
        return;
    }
    let group = format!("test-{}", std::process::id());
    let dirs: Vec<_> = Controller::ALL
        .iter()
        .map(|c| cg.own_dir(*c, &group).unwrap().unwrap())
        .collect();
    // Removes the test's groups whatever happens (the parent only if nothing else is in it).
    struct Cleanup(Vec<std::path::PathBuf>);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            for d in &self.0 {
                let _ = testing::remove_tree(d);
                if let Some(p) = d.parent() {
                    let _ = std::fs::remove_dir(p);
                }
            }
        }
    }
    let _cleanup = Cleanup(dirs.clone());
    let child = sleeper();
    let pid = child.0.id();
    let procfs = Procfs::new("/proc");
    let before = procfs.cgroups(pid).unwrap();
    for d in &dirs {
        cg.make_dir(d.parent().unwrap()).unwrap();
        cg.make_dir(d).unwrap();
        assert!(cg.move_process(d, pid).unwrap());
        assert_eq!(cg.processes_in_dir(d).unwrap(), vec![pid]);
    }
    let now = procfs.cgroups(pid).unwrap();
    for (id, ctrls, path) in &now {
        let moved = path.ends_with(&format!("cohabit/{group}"));
        let cpu_hierarchy = ctrls.split(',').any(|c| c == "cpuset" || c == "cpu");
        assert_eq!(moved, cpu_hierarchy, "{id}:{ctrls}:{path}");
        if !cpu_hierarchy {
            assert!(
                before.contains(&(*id, ctrls.clone(), path.clone())),
                "{now:?}"
            );
        }
    }
    for c in Controller::ALL {
        let root = cg.mount(c).unwrap().to_path_buf();
        assert!(cg.move_process(&root, pid).unwrap());
    }
    assert_eq!(procfs.cgroups(pid).unwrap(), before, "back where it was");
    for d in &dirs {
        cg.remove_dir(d).unwrap();
    }
    // A vanished process is absence, not an error.
    let root = cg.mount(Controller::Cpuset).unwrap().to_path_buf();
    assert!(!cg.move_process(&root, 4_000_000).unwrap());
    drop(child);
}
