//! Tests of the kubepods layout: pure paths, look-ups on the typed v2 fake, the CPU manager
//! checkpoint, and (as root, on cgroup v1) look-ups on this machine's real tree.

use std::path::Path;

use super::*;
use crate::cgroup::fake::FakeCgroup2;
use crate::cgroup::testing;
use crate::kubepods::testing::KubepodsTree;

const UID: &str = "6f0e2b1a-3c4d-4e5f-8a9b-0c1d2e3f4a5b";

#[test]
fn pod_paths_follow_the_kubelets_layout_for_each_driver_and_qos_class() {
    let cases = [
        (Driver::Cgroupfs, Qos::Guaranteed, format!("kubepods/pod{UID}")),
        (
            Driver::Cgroupfs,
            Qos::Burstable,
            format!("kubepods/burstable/pod{UID}"),
        ),
        (
            Driver::Cgroupfs,
            Qos::BestEffort,
            format!("kubepods/besteffort/pod{UID}"),
        ),
        (
            Driver::Systemd,
            Qos::Guaranteed,
            "kubepods.slice/kubepods-pod6f0e2b1a_3c4d_4e5f_8a9b_0c1d2e3f4a5b.slice".into(),
        ),
        (
            Driver::Systemd,
            Qos::Burstable,
            "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod6f0e2b1a_3c4d_4e5f_8a9b_0c1d2e3f4a5b.slice".into(),
        ),
        (
            Driver::Systemd,
            Qos::BestEffort,
            "kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod6f0e2b1a_3c4d_4e5f_8a9b_0c1d2e3f4a5b.slice".into(),
        ),
    ];
    for (driver, qos, want) in cases {
        assert_eq!(
            pod_path(driver, qos, UID).unwrap(),
            want,
            "{driver} {qos:?}"
        );
    }
}

#[test]
fn container_names_follow_each_runtimes_convention() {
    let name = |d, r| container_names(d, r, "ab12").unwrap();
    assert_eq!(name(Driver::Cgroupfs, Runtime::Containerd), vec!["ab12"]);
    assert_eq!(name(Driver::Cgroupfs, Runtime::Docker), vec!["ab12"]);
    assert_eq!(
        name(Driver::Cgroupfs, Runtime::CriO),
        vec!["crio-ab12", "ab12"]
    );
    assert_eq!(
        name(Driver::Systemd, Runtime::Containerd),
        vec!["cri-containerd-ab12.scope"]
    );
    assert_eq!(
        name(Driver::Systemd, Runtime::CriO),
        vec!["crio-ab12.scope"]
    );
    assert_eq!(
        name(Driver::Systemd, Runtime::Docker),
        vec!["docker-ab12.scope"]
    );
    assert_eq!(
        container_path(Driver::Systemd, Qos::Guaranteed, "1-2", Runtime::CriO, "ff").unwrap(),
        "kubepods.slice/kubepods-pod1_2.slice/crio-ff.scope"
    );
    for r in ["containerd", "cri-o", "crio", "docker"] {
        r.parse::<Runtime>().unwrap();
    }
    let e = "rkt".parse::<Runtime>().unwrap_err();
    assert!(e.to_string().contains("\"rkt\""), "{e}");
}

#[test]
fn uids_and_ids_that_could_leave_the_pods_cgroup_are_refused() {
    for uid in ["", "../etc", "a/b", "x y", "pod*", &"a".repeat(65)] {
        assert!(
            matches!(
                pod_path(Driver::Cgroupfs, Qos::Burstable, uid),
                Err(KubepodsError::BadUid(_))
            ),
            "{uid:?}"
        );
    }
    for id in ["", "..", "ab/cd", "abc.scope", "ABCG"] {
        assert!(
            matches!(
                container_names(Driver::Systemd, Runtime::Containerd, id),
                Err(KubepodsError::BadContainerId(_))
            ),
            "{id:?}"
        );
    }
    for root in ["kubepods", "/a/../b", "/./x"] {
        assert!(
            matches!(clean_root(root), Err(KubepodsError::BadRoot(_))),
            "{root}"
        );
    }
    assert_eq!(clean_root("/").unwrap(), "");
    assert_eq!(clean_root("//a//b/").unwrap(), "a/b");
}

/// A fake v2 host with a systemd-driver kubepods tree: a guaranteed pod (containerd),
/// a burstable pod (CRI-O) and a best-effort pod (containerd), one process each.
fn systemd_tree(f: &FakeCgroup2) -> Vec<(Qos, Runtime, &'static str, u32)> {
    let pods = vec![
        (Qos::Guaranteed, Runtime::Containerd, "11111111-aaaa", 40),
        (Qos::Burstable, Runtime::CriO, "22222222-bbbb", 41),
        (Qos::BestEffort, Runtime::Containerd, "33333333-cccc", 42),
    ];
    f.mkdir_owner("/kubepods.slice", &["cpuset", "cpu"])
        .unwrap();
    for q in ["burstable", "besteffort"] {
        f.mkdir_owner(
            &format!("/kubepods.slice/kubepods-{q}.slice"),
            &["cpuset", "cpu"],
        )
        .unwrap();
    }
    for (qos, runtime, uid, pid) in &pods {
        let pod = pod_path(Driver::Systemd, *qos, uid).unwrap();
        f.mkdir_owner(&pod, &["cpuset", "cpu"]).unwrap();
        let c = container_path(Driver::Systemd, *qos, uid, *runtime, &format!("{pid:x}")).unwrap();
        f.mkdir_owner(&c, &[]).unwrap();
        f.add_process(*pid, 1000, &c).unwrap();
    }
    pods
}

#[test]
fn a_systemd_tree_on_cgroup_v2_is_detected_and_every_container_found() {
    let f = FakeCgroup2::builder().build().unwrap();
    let pods = systemd_tree(&f);
    let k = Kubepods::new(f.cgroups().unwrap(), None, "/").unwrap();
    assert_eq!(k.driver(), Driver::Systemd);
    for (qos, runtime, uid, pid) in pods {
        let found = k
            .container(qos, uid, runtime, &format!("{pid:x}"))
            .unwrap()
            .unwrap_or_else(|| panic!("{uid} not found"));
        assert_eq!(Some(found.path.clone()), f.cgroup_of(pid), "{uid}");
        assert_eq!(k.cgroups().processes_at_cgroup_path(&found.path), vec![pid]);
        let dir = k.pod_dir(Controller::Cpu, qos, uid).unwrap().unwrap();
        assert!(dir.ends_with(pod_path(Driver::Systemd, qos, uid).unwrap()));
        // Another runtime's name, or a QoS class the pod is not in, finds nothing.
        assert_eq!(
            k.container(qos, uid, Runtime::Docker, &format!("{pid:x}"))
                .unwrap(),
            None
        );
    }
    assert_eq!(
        k.container(Qos::Burstable, "11111111-aaaa", Runtime::Containerd, "28")
            .unwrap(),
        None,
        "a guaranteed pod is not under burstable"
    );
    // In-place: the container's cgroup takes the CPU values; the process stays.
    let c = k
        .container(Qos::Burstable, "22222222-bbbb", Runtime::CriO, "29")
        .unwrap()
        .unwrap();
    let dir = k.cgroups().dir_at(Controller::Cpuset, &c.path).unwrap();
    let moves = |f: &FakeCgroup2| {
        f.writes()
            .iter()
            .filter(|(p, _)| p.ends_with("cgroup.procs"))
            .count()
    };
    let before = moves(&f);
    k.cgroups()
        .write_control(&dir, "cpuset.cpus", "2-3")
        .unwrap();
    assert_eq!(
        std::fs::read_to_string(dir.join("cpuset.cpus.effective")).unwrap(),
        "2-3"
    );
    assert_eq!(f.cgroup_of(41).as_deref(), Some(c.path.as_str()));
    assert_eq!(moves(&f), before, "no process moved");
}

#[test]
fn a_cgroupfs_tree_is_detected_and_cri_o_containers_found_by_either_name() {
    let f = FakeCgroup2::builder().build().unwrap();
    f.mkdir_owner("/kubepods", &["cpuset", "cpu"]).unwrap();
    f.mkdir_owner("/kubepods/burstable", &["cpuset", "cpu"])
        .unwrap();
    f.mkdir_owner("/kubepods/besteffort", &["cpuset", "cpu"])
        .unwrap();
    f.mkdir_owner("/kubepods/burstable/podab-cd", &["cpuset", "cpu"])
        .unwrap();
    f.mkdir_owner("/kubepods/burstable/podab-cd/crio-aa", &[])
        .unwrap();
    f.mkdir_owner("/kubepods/burstable/podab-cd/bb", &[])
        .unwrap();
    f.mkdir_owner("/kubepods/podee", &["cpuset", "cpu"])
        .unwrap();
    f.mkdir_owner("/kubepods/podee/cc", &[]).unwrap();
    f.add_process(50, 1, "/kubepods/burstable/podab-cd/crio-aa")
        .unwrap();
    let k = Kubepods::new(f.cgroups().unwrap(), None, "/").unwrap();
    assert_eq!(k.driver(), Driver::Cgroupfs);
    let path = |q, uid, r, id| k.container(q, uid, r, id).unwrap().map(|c| c.path);
    assert_eq!(
        path(Qos::Burstable, "ab-cd", Runtime::CriO, "aa").as_deref(),
        Some("/kubepods/burstable/podab-cd/crio-aa")
    );
    assert_eq!(
        path(Qos::Burstable, "ab-cd", Runtime::CriO, "bb").as_deref(),
        Some("/kubepods/burstable/podab-cd/bb"),
        "the bare ID is CRI-O's second name"
    );
    assert_eq!(
        path(Qos::Guaranteed, "ee", Runtime::Containerd, "cc").as_deref(),
        Some("/kubepods/podee/cc")
    );
    assert_eq!(path(Qos::BestEffort, "ee", Runtime::Containerd, "cc"), None);
    // The driver can be given; a wrong one finds nothing.
    let wrong = Kubepods::new(f.cgroups().unwrap(), Some(Driver::Systemd), "/").unwrap();
    assert_eq!(
        wrong
            .container(Qos::Guaranteed, "ee", Runtime::Containerd, "cc")
            .unwrap(),
        None
    );
}

#[test]
fn detection_needs_exactly_one_tree() {
    let f = FakeCgroup2::builder().build().unwrap();
    let e = Kubepods::new(f.cgroups().unwrap(), None, "/").unwrap_err();
    assert!(
        matches!(&e, KubepodsError::NoTree { looked, .. } if looked == &["/kubepods", "/kubepods.slice"]),
        "{e}"
    );
    assert!(e.to_string().contains("cgroup_driver"), "{e}");
    f.mkdir_owner("/kubepods", &[]).unwrap();
    f.mkdir_owner("/kubepods.slice", &[]).unwrap();
    let e = Kubepods::new(f.cgroups().unwrap(), None, "/").unwrap_err();
    assert!(matches!(e, KubepodsError::BothTrees { .. }), "{e}");
    // Under a kubelet cgroup root.
    f.mkdir_owner("/custom/kubepods.slice", &[]).unwrap();
    let k = Kubepods::new(f.cgroups().unwrap(), None, "/custom").unwrap();
    assert_eq!(k.driver(), Driver::Systemd);
    assert_eq!(
        k.pod_path(Qos::Guaranteed, "ab").unwrap(),
        "/custom/kubepods.slice/kubepods-podab.slice"
    );
}

#[test]
fn the_cpu_manager_checkpoint_lists_exclusive_cpus() {
    let text = r#"{"policyName":"static","defaultCpuSet":"0,5-7","entries":{"aaaa-1":{"app":"1-2","sidecar":""},"bbbb-2":{"db":"3-4"}},"checksum":3047418396}"#;
    let s = CpuManagerState::parse(text, Path::new("cpu_manager_state")).unwrap();
    assert_eq!(s.policy_name, "static");
    assert_eq!(s.default_cpu_set.to_string(), "0,5-7");
    assert_eq!(s.exclusive("aaaa-1", "app").unwrap().to_string(), "1-2");
    assert_eq!(
        s.exclusive("aaaa-1", "sidecar"),
        None,
        "an empty set is none"
    );
    assert_eq!(s.exclusive("aaaa-1", "other"), None);
    assert_eq!(s.exclusive("cccc", "app"), None);
    assert_eq!(s.exclusive_cpus().to_string(), "1-4");
    let none = CpuManagerState::parse(
        r#"{"policyName":"none","defaultCpuSet":"","checksum":1353318690}"#,
        Path::new("x"),
    )
    .unwrap();
    assert!(none.exclusive_cpus().0.is_empty());
    for (bad, why) in [
        ("not json", "expected"),
        (r#"{"defaultCpuSet":""}"#, "policyName"),
        (
            r#"{"policyName":"static","defaultCpuSet":"3-1"}"#,
            "defaultCpuSet",
        ),
        (
            r#"{"policyName":"static","entries":{"u":{"c":"x"}}}"#,
            "entries.u.c",
        ),
    ] {
        let e = CpuManagerState::parse(bad, Path::new("/var/lib/kubelet/cpu_manager_state"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(why) && e.contains("cpu_manager_state"),
            "{bad}: {e}"
        );
    }
    let dir = tempfile::tempdir().unwrap();
    assert_eq!(CpuManagerState::read(dir.path()).unwrap(), None);
    std::fs::write(dir.path().join(CPU_MANAGER_STATE), text).unwrap();
    assert_eq!(CpuManagerState::read(dir.path()).unwrap(), Some(s));
}

/// This machine's real v1 tree: a cgroupfs kubepods tree made under a test cgroup root in
/// the cpuset and cpu hierarchies, a real process in a container's cgroup; the tree is
/// detected and the container found, a CPU set written there in place, and the process not
/// moved.
#[test]
fn on_the_real_v1_tree_a_cgroupfs_kubepods_tree_is_found_and_written_in_place() {
    let Some(cg) = testing::real_cgroups() else {
        return;
    };
    if cg.version != crate::cgroup::Version::V1 {
        cohabit_testkit::skip(
            cohabit_testkit::Need::Root,
            "this machine's cgroups are not v1",
        );
        return;
    }
    let root = format!("cohabit-test-kubepods-{}", std::process::id());
    let tree = KubepodsTree::create(&cg, &root).unwrap();
    let uid = "0a1b2c3d-4e5f-6a7b-8c9d-0e1f2a3b4c5d";
    let container = tree
        .container(&format!("kubepods/burstable/pod{uid}"), "abc123")
        .unwrap();
    let child = Kill(
        std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap(),
    );
    let pid = child.0.id();
    {
        container.add(pid).unwrap();
        let k = Kubepods::new(cg.clone(), None, &format!("/{root}")).unwrap();
        assert_eq!(k.driver(), Driver::Cgroupfs);
        let found = k
            .container(Qos::Burstable, uid, Runtime::Containerd, "abc123")
            .unwrap()
            .expect("the container's cgroup");
        assert_eq!(
            found.path,
            format!("/{root}/kubepods/burstable/pod{uid}/abc123")
        );
        assert_eq!(cg.processes_at_cgroup_path(&found.path), vec![pid]);
        let before = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
        let dir = cg.dir_at(Controller::Cpuset, &found.path).unwrap();
        let cpus = cg.cpus_at(&dir).unwrap();
        let one = CpuList(vec![*cpus.0.last().unwrap()]);
        cg.write_control(&dir, "cpuset.cpus", &one.to_string())
            .unwrap();
        assert_eq!(cg.cpus_at(&dir).unwrap(), one);
        let after = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
        assert_eq!(before, after, "the process was not moved");
    }
}

/// Kills and reaps the child when dropped (before the tree it is in is removed).
struct Kill(std::process::Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
