//! cgroups on the real kernel of this machine. Needs root and a writable cpuset or cpu
//! hierarchy; otherwise it prints why it skipped.

use std::process::{Child, Command};

use cohabit_collectors::cgroup::{Cgroups, CpuList};
use cohabit_collectors::procfs::Procfs;
use cohabit_collectors::HostPaths;

struct Kill(Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn usable() -> Option<Cgroups> {
    let cg = match Cgroups::detect(&HostPaths::standard()) {
        Ok(Some(cg)) => cg,
        other => {
            println!("skipped: no cgroup hierarchy found ({other:?})");
            return None;
        }
    };
    let writable = cg.writable_controllers();
    if !(writable.iter().any(|c| c == "cpuset") && writable.iter().any(|c| c == "cpu")) {
        println!("skipped: cpuset and cpu are not both writable here (writable: {writable:?}; root needed)");
        return None;
    }
    Some(cg)
}

#[test]
fn a_process_moves_in_gets_cpus_and_quota_and_goes_back() {
    let Some(cg) = usable() else { return };
    let group = format!("test-{}", std::process::id());
    let child = Kill(Command::new("sleep").arg("30").spawn().unwrap());
    let pid = child.0.id();
    let procfs = Procfs::new("/proc");
    let original = procfs.cgroups(pid).unwrap();

    cg.create(&group).unwrap();
    cg.set_cpus(&group, &CpuList(vec![0])).unwrap();
    cg.set_quota(&group, Some(0.5)).unwrap();
    assert!(cg.add_process(&group, pid).unwrap());
    assert_eq!(cg.processes(&group).unwrap(), vec![pid]);
    let now = procfs.cgroups(pid).unwrap();
    assert!(
        now.iter()
            .any(|(_, c, p)| c.split(',').any(|c| c == "cpuset")
                && p.ends_with(&format!("cohabit/{group}"))),
        "{now:?}"
    );
    assert!(cg.cpu_usage_ns(&group).is_some());
    assert!(cg.leftovers().contains(&group));

    assert!(cg.restore_process(pid, &original).unwrap());
    assert_eq!(procfs.cgroups(pid).unwrap(), original, "back where it was");
    cg.remove(&group).unwrap();
    cg.remove_parent();
    assert!(!cg.leftovers().contains(&group));
    // A vanished process is absence, not an error.
    cg.create(&group).unwrap();
    assert!(!cg.add_process(&group, 4_000_000).unwrap());
    cg.remove(&group).unwrap();
    cg.remove_parent();
}
