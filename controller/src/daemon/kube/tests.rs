//! Tests of the pods' side of the loop: pure pod → service rules, then the daemon driven by
//! a scripted pod source over a fixture kubepods tree (the typed v2 fake, and as root this
//! machine's real v1 tree): pods appearing, changing and leaving, a bad annotation, the
//! API server going away; the writes and the restores are read back from the cgroups.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use cohabit_collectors::cgroup::fake::FakeCgroup2;
use cohabit_collectors::cgroup::{testing, CpuList};
use cohabit_collectors::kubepods::testing::KubepodsTree;
use cohabit_collectors::kubepods::Driver;
use cohabit_collectors::resctrl::fake::FakeResctrl;
use cohabit_core::ServiceClass;
use cohabit_kube::{ContainerRef, ManagedPod, PodClass, PodKey, PodView, QosClass};
use cohabit_policy::control;

use super::*;

fn key(ns: &str, name: &str, uid: &str) -> PodKey {
    PodKey {
        namespace: ns.into(),
        name: name.into(),
        uid: uid.into(),
    }
}

fn pod(
    ns_name: (&str, &str),
    uid: &str,
    qos: QosClass,
    class: PodClass,
    ids: &[(&str, &str)],
) -> ManagedPod {
    ManagedPod {
        key: key(ns_name.0, ns_name.1, uid),
        qos,
        class,
        priority: None,
        containers: ids
            .iter()
            .map(|(name, id)| ContainerRef {
                name: (*name).into(),
                runtime: "containerd".into(),
                id: (*id).into(),
            })
            .collect(),
        ips: vec!["127.0.0.1".parse().unwrap()],
    }
}

fn lc(target: f64, latency: Option<&str>) -> PodClass {
    PodClass::LatencyCritical {
        p99_target_ms: target,
        latency: latency.map(str::to_string),
    }
}

fn kube_cfg(kubelet_dir: &Path, root: &str) -> KubernetesConfig {
    KubernetesConfig {
        node_name: "node-1".into(),
        cgroup_driver: None,
        cgroup_root: root.into(),
        kubelet_dir: kubelet_dir.to_path_buf(),
        api: config::KubeApi::InCluster,
        socket_dir: "/run/cohabit/pods".into(),
    }
}

#[test]
fn long_pod_names_are_shortened_with_the_uid_and_stay_valid() {
    assert_eq!(service_name(&key("default", "kv", "1")), "default.kv");
    let long = key(
        "a-very-long-namespace-name",
        "and-a-very-long-pod-name-7f9c4-xk2p",
        "0a1b2c3d-4e5f",
    );
    let n = service_name(&long);
    assert!(n.len() <= 48, "{n}");
    assert!(n.ends_with("-0a1b2c3d"), "{n}");
    assert!(n.starts_with("a-very-long-namespace-name.and"), "{n}");
}

#[test]
fn a_pod_becomes_a_service_in_its_containers_cgroups_in_place() {
    let f = FakeCgroup2::builder().build().unwrap();
    f.mkdir_owner("/kubepods.slice", &[]).unwrap();
    let tree = Kubepods::new(f.cgroups().unwrap(), None, "/").unwrap();
    let cfg = kube_cfg(Path::new("/var/lib/kubelet"), "/");
    let mut p = pod(
        ("shop", "web"),
        "ab-cd",
        QosClass::Burstable,
        lc(5.0, Some("http://127.0.0.1:8080/health")),
        &[("app", "a1"), ("sidecar", "b2")],
    );
    p.priority = Some(7);
    let s = pod_service(&p, &tree, None, &cfg).unwrap();
    assert_eq!(s.name, "shop.web");
    assert_eq!(s.p99_target_ms, Some(5.0));
    assert_eq!(s.priority, 7);
    assert_eq!(s.placement, Placement::InPlace);
    assert!(matches!(
        s.latency,
        Some(config::LatencySource::Probe { .. })
    ));
    let Matcher::Pod { uid, cgroups } = &s.matcher else {
        panic!("{:?}", s.matcher);
    };
    assert_eq!(uid, "ab-cd");
    let base = "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-podab_cd.slice";
    assert_eq!(
        cgroups,
        &vec![
            format!("{base}/cri-containerd-a1.scope"),
            format!("{base}/cri-containerd-b2.scope")
        ]
    );
    // The static CPU manager pinned the app container: only the sidecar is managed.
    let state = CpuManagerState::parse(
        r#"{"policyName":"static","defaultCpuSet":"0-3","entries":{"ab-cd":{"app":"4-5"}}}"#,
        Path::new("cpu_manager_state"),
    )
    .unwrap();
    let s = pod_service(&p, &tree, Some(&state), &cfg).unwrap();
    assert!(
        matches!(&s.matcher, Matcher::Pod { cgroups, .. } if cgroups.len() == 1 && cgroups[0].ends_with("b2.scope"))
    );
    p.containers.truncate(1);
    assert_eq!(
        pod_service(&p, &tree, Some(&state), &cfg),
        Err(Skip::Exclusive)
    );
    // Best effort: no target, no latency.
    let be = pod(
        ("b", "j"),
        "ee",
        QosClass::BestEffort,
        PodClass::BestEffort,
        &[("c", "ff")],
    );
    let s = pod_service(&be, &tree, None, &cfg).unwrap();
    assert_eq!((s.p99_target_ms, s.latency), (None, None));
}

#[test]
fn unusable_annotations_and_containers_are_named_in_the_warning() {
    let f = FakeCgroup2::builder().build().unwrap();
    f.mkdir_owner("/kubepods", &[]).unwrap();
    let tree = Kubepods::new(f.cgroups().unwrap(), None, "/").unwrap();
    let cfg = kube_cfg(Path::new("/var/lib/kubelet"), "/");
    for (latency, why) in [
        ("{ bogus = 1 }", "unknown field"),
        ("ftp://10.0.0.1/", "scheme"),
        ("{ push = \"127.0.0.1:9400\" }", "unauthenticated = true"),
        (
            "{ unix = \"/etc/cohabit.sock\" }",
            "must lie in /run/cohabit/pods",
        ),
        ("{ unix = \"/run/cohabit/pods/../x.sock\" }", "must lie in"),
        (
            "{ prometheus = \"http://10.0.0.5:9150/metrics\" }",
            "latency.metric",
        ),
        // An address other than the pod's own: the daemon would probe it as root.
        (
            "memcached://10.0.0.5:11211",
            "not one of the pod's addresses",
        ),
    ] {
        let p = pod(
            ("a", "b"),
            "12",
            QosClass::Burstable,
            lc(1.0, Some(latency)),
            &[("c", "aa")],
        );
        let Err(Skip::Warn { reason, message }) = pod_service(&p, &tree, None, &cfg) else {
            panic!("{latency} was accepted");
        };
        assert_eq!(reason, "BadLatencyAnnotation");
        assert!(message.contains(why), "{latency}: {message}");
    }
    let ok = pod(
        ("a", "b"),
        "12",
        QosClass::Burstable,
        lc(
            1.0,
            Some("{ unix = \"/run/cohabit/pods/a.sock\", mode = \"0666\" }"),
        ),
        &[("c", "aa")],
    );
    pod_service(&ok, &tree, None, &cfg).unwrap();
    let mut odd = ok.clone();
    odd.containers[0].runtime = "rkt".into();
    assert!(matches!(
        pod_service(&odd, &tree, None, &cfg),
        Err(Skip::Warn {
            reason: "UnsupportedRuntime",
            ..
        })
    ));
    odd.containers[0] = ContainerRef {
        name: "c".into(),
        runtime: "docker".into(),
        id: "../../x".into(),
    };
    assert!(matches!(
        pod_service(&odd, &tree, None, &cfg),
        Err(Skip::Warn {
            reason: "BadContainerId",
            ..
        })
    ));
}

#[test]
fn a_pods_udp_push_source_binds_loopback_only() {
    use cohabit_collectors::latency::{PushAddr, PushListener, UnixAccess};
    let f = FakeCgroup2::builder().build().unwrap();
    f.mkdir_owner("/kubepods", &[]).unwrap();
    let tree = Kubepods::new(f.cgroups().unwrap(), None, "/").unwrap();
    let cfg = kube_cfg(Path::new("/var/lib/kubelet"), "/");
    let with = |latency: &str, ips: &[&str]| {
        let mut p = pod(
            ("a", "b"),
            "12",
            QosClass::Burstable,
            lc(1.0, Some(latency)),
            &[("c", "aa")],
        );
        p.ips = ips.iter().map(|ip| ip.parse().unwrap()).collect();
        pod_service(&p, &tree, None, &cfg)
    };
    // Wildcards and the pod's own (routable) address would take datagrams from the network.
    for addr in [
        "0.0.0.0:9400",
        "[::]:9400",
        "10.1.2.3:9400",
        "[fd00::3]:9400",
    ] {
        let text = format!("{{ push = \"{addr}\", unauthenticated = true }}");
        let Err(Skip::Warn { reason, message }) = with(&text, &["10.1.2.3", "fd00::3"]) else {
            panic!("{addr} was accepted");
        };
        assert_eq!(reason, "BadLatencyAnnotation");
        assert!(
            message.contains("must be a loopback address"),
            "{addr}: {message}"
        );
    }
    // Loopback is taken, and the socket the daemon binds for it is on loopback.
    for addr in ["127.0.0.1:0", "[::1]:0"] {
        let text = format!("{{ push = \"{addr}\", unauthenticated = true }}");
        let s = with(&text, &["10.1.2.3"]).unwrap();
        let Some(config::LatencySource::Push {
            addr: PushAddr::Udp(a),
            ..
        }) = &s.latency
        else {
            panic!("{addr}: {:?}", s.latency);
        };
        assert!(a.ip().is_loopback(), "{a}");
        match PushListener::bind(&PushAddr::Udp(*a), &UnixAccess::default()) {
            Ok(l) => {
                let PushAddr::Udp(bound) = l.local else {
                    panic!("{:?}", l.local)
                };
                assert!(bound.ip().is_loopback() && bound.port() != 0, "{bound}");
            }
            // A host without IPv6 cannot bind ::1; that is not a wildcard either.
            Err(e) if a.is_ipv6() => println!("{a}: {e}"),
            Err(e) => panic!("{a}: {e}"),
        }
    }
    // Below the configuration too: the listener refuses a wildcard outright.
    let wild = PushAddr::Udp("0.0.0.0:0".parse().unwrap());
    let e = PushListener::bind(&wild, &UnixAccess::default()).unwrap_err();
    assert!(e.to_string().contains("only loopback"), "{e}");
}

/// A pod source that plays back what the test sets, and keeps the warnings.
#[derive(Debug, Clone, Default)]
struct Script {
    view: Arc<Mutex<PodView>>,
    warnings: Arc<Mutex<Vec<(String, String, String)>>>,
}

impl Script {
    fn set(&self, pods: Vec<ManagedPod>, reachable: bool) {
        let mut v = self.view.lock().unwrap();
        if v.pods != pods {
            v.generation += 1;
        }
        v.pods = pods;
        v.synced = true;
        v.api_reachable = reachable;
        v.last_error = (!reachable).then(|| "connection refused".into());
    }

    fn warned(&self) -> Vec<(String, String, String)> {
        self.warnings.lock().unwrap().clone()
    }
}

impl PodSource for Script {
    fn view(&self) -> PodView {
        self.view.lock().unwrap().clone()
    }

    fn warn(&self, pod: &PodKey, reason: &str, message: &str) {
        self.warnings.lock().unwrap().push((
            format!("{}/{}", pod.namespace, pod.name),
            reason.into(),
            message.into(),
        ));
    }
}

fn static_factory() -> PolicyFactory {
    Box::new(|ctx| Ok(Box::new(StaticPolicy::new(ctx)) as Box<dyn Policy>))
}

/// The daemon's loop around the pods: the host, the policy, the fail-safe's plan.
struct Daemon {
    host: Checked<RealHost>,
    policy: Box<dyn Policy>,
    fair_share: Plan,
    pods: Pods,
}

impl Daemon {
    fn open(cfg: &DaemonConfig, resctrl: Option<&FakeResctrl>, script: &Script) -> Self {
        let host = match resctrl {
            Some(r) => RealHost::open_with(cfg.clone(), false, Arc::new(r.clone())),
            None => RealHost::open(cfg.clone(), false),
        };
        let host = Checked::real(host.unwrap());
        let mut policy: Box<dyn Policy> = Box::new(StaticPolicy::new(HostContext {
            host: host.host().capacity().clone(),
            specs: host.host().specs(),
        }));
        let fair_share = policy.initial().plan;
        let pods = Pods::new(
            Box::new(script.clone()),
            cfg,
            cfg.kubernetes.clone().unwrap(),
            host.host().cpus().to_vec(),
            static_factory(),
        );
        Self {
            host,
            policy,
            fair_share,
            pods,
        }
    }

    /// One tick as the daemon runs it: the pods, then collect, decide, apply.
    fn tick(&mut self) -> bool {
        let changed = self.pods.tick(
            &mut self.host,
            &mut self.policy,
            &mut self.fair_share,
            false,
        );
        control::step(&mut self.host, self.policy.as_mut(), false).unwrap();
        changed
    }

    fn services(&self) -> BTreeMap<String, bool> {
        self.host
            .host()
            .specs()
            .into_iter()
            .map(|s| {
                (
                    s.name.clone(),
                    matches!(s.class, ServiceClass::LatencyCritical { .. }),
                )
            })
            .collect()
    }
}

fn read(dir: &Path, file: &str) -> String {
    std::fs::read_to_string(dir.join(file))
        .unwrap_or_else(|e| panic!("{}: {e}", dir.join(file).display()))
        .trim()
        .to_string()
}

fn cpus(dir: &Path) -> CpuList {
    read(dir, "cpuset.cpus").parse().unwrap()
}

/// Every `cgroup.procs` under `root`, to show that no process moved.
fn procs(root: &Path) -> BTreeMap<PathBuf, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        if let Ok(t) = std::fs::read_to_string(d.join("cgroup.procs")) {
            let mut pids: Vec<&str> = t.lines().filter(|l| !l.trim().is_empty()).collect();
            pids.sort_unstable();
            out.insert(d.clone(), pids.join(","));
        }
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(e.path());
            }
        }
    }
    out
}

const KV: &str = "1a2b3c4d-0000-4000-8000-000000000001";
const JOB: &str = "1a2b3c4d-0000-4000-8000-000000000002";
const PINNED: &str = "1a2b3c4d-0000-4000-8000-000000000003";
const BAD: &str = "1a2b3c4d-0000-4000-8000-000000000004";

/// The systemd-driver tree on the fake: kv (burstable, pid 40), job (best effort, pid 50),
/// pinned (guaranteed, pid 60, CPUs 6-7 of its own); each container's cgroup path.
fn fake_node(f: &FakeCgroup2) -> BTreeMap<&'static str, String> {
    f.mkdir_owner("/kubepods.slice", &["cpuset", "cpu"])
        .unwrap();
    for q in ["burstable", "besteffort"] {
        f.mkdir_owner(
            &format!("/kubepods.slice/kubepods-{q}.slice"),
            &["cpuset", "cpu"],
        )
        .unwrap();
    }
    let mut out = BTreeMap::new();
    for (name, qos, uid, id, pid) in [
        ("kv", Qos::Burstable, KV, "aa", 40),
        ("job", Qos::BestEffort, JOB, "bb", 50),
        ("pinned", Qos::Guaranteed, PINNED, "cc", 60),
        ("bad", Qos::Burstable, BAD, "dd", 70),
    ] {
        let paths = cohabit_collectors::kubepods::container_path(
            Driver::Systemd,
            qos,
            uid,
            Runtime::Containerd,
            id,
        )
        .unwrap();
        let pod_dir = paths.rsplit_once('/').unwrap().0.to_string();
        f.mkdir_owner(&pod_dir, &["cpuset", "cpu"]).unwrap();
        f.mkdir_owner(&paths, &[]).unwrap();
        f.add_process(pid, 1000 + pid as u64, &paths).unwrap();
        out.insert(name, format!("/{paths}"));
    }
    // What the kubelet's static CPU manager did for the pinned container.
    std::fs::write(f.dir(&out["pinned"]).join("cpuset.cpus"), "6-7").unwrap();
    out
}

fn node_pods(with_kv: bool) -> Vec<ManagedPod> {
    let mut pods = vec![
        pod(
            ("batch", "job"),
            JOB,
            QosClass::BestEffort,
            PodClass::BestEffort,
            &[("main", "bb")],
        ),
        pod(
            ("default", "bad"),
            BAD,
            QosClass::Burstable,
            lc(1.0, Some("{ bogus = 1 }")),
            &[("main", "dd")],
        ),
        pod(
            ("default", "pinned"),
            PINNED,
            QosClass::Guaranteed,
            lc(1.0, None),
            &[("main", "cc")],
        ),
    ];
    if with_kv {
        pods.push(pod(
            ("default", "kv"),
            KV,
            QosClass::Burstable,
            lc(
                2.0,
                Some("{ push = \"127.0.0.1:0\", unauthenticated = true }"),
            ),
            &[("main", "aa")],
        ));
    }
    pods.sort_by(|a, b| a.key.cmp(&b.key));
    pods
}

#[test]
fn the_daemon_follows_the_pods_writing_in_place_and_restoring_those_that_leave() {
    let f = FakeCgroup2::builder().cpus(8).build().unwrap();
    let resctrl = FakeResctrl::builder().ways(12).build().unwrap();
    let dirs = fake_node(&f);
    for pid in [40, 50, 60, 70] {
        resctrl.add_task(pid).unwrap();
    }
    let dir = |name: &str| f.dir(&dirs[name]);
    let kubelet = tempfile::tempdir().unwrap();
    std::fs::write(
        kubelet.path().join("cpu_manager_state"),
        format!(r#"{{"policyName":"static","defaultCpuSet":"0-5","entries":{{"{PINNED}":{{"main":"6-7"}}}},"checksum":1}}"#),
    )
    .unwrap();
    let text = format!(
        "interval_ms = 100\nmetrics_addr = \"\"\n[host]\ncpus = \"0-7\"\n[paths]\nproc = \"{}\"\nsys = \"{}\"\ncgroup = \"{}\"\nresctrl = \"{}\"\nstate_dir = \"{}\"\n[kubernetes]\nnode_name = \"node-1\"\nkubelet_dir = \"{}\"\n",
        f.base().join("proc").display(),
        f.base().join("sys").display(),
        f.base().join("sys/fs/cgroup").display(),
        resctrl.root().display(),
        kubelet.path().join("state").display(),
        kubelet.path().display(),
    );
    let cfg = DaemonConfig::parse(&text, "t.toml").unwrap();
    let script = Script::default();
    let mut d = Daemon::open(&cfg, Some(&resctrl), &script);
    let placed = procs(f.root());

    // Before the first list completes, no pod is taken and nothing is written.
    assert!(!d.tick());
    assert!(d.services().is_empty());
    assert_eq!(read(&dir("kv"), "cpu.weight"), "100");

    // The pods arrive: kv is latency-critical, job joins the pool, pinned is left alone,
    // bad gets a Warning Event.
    script.set(node_pods(true), true);
    assert!(d.tick());
    d.tick();
    assert_eq!(
        d.services(),
        BTreeMap::from([
            ("batch.job".to_string(), false),
            ("default.kv".to_string(), true)
        ])
    );
    let warned = script.warned();
    assert_eq!(warned.len(), 1, "{warned:?}");
    assert_eq!(
        (warned[0].0.as_str(), warned[0].1.as_str()),
        ("default/bad", "BadLatencyAnnotation")
    );
    assert!(warned[0].2.contains("unknown field"), "{:?}", warned[0]);
    assert_eq!(
        d.pods.status(),
        &PodStatus {
            managed: 2,
            skipped: 2,
            api_reachable: true,
            synced: true,
        }
    );
    assert_eq!(
        d.host.host().capacity().cores,
        6,
        "CPUs 6-7 are the pinned container's"
    );
    let (kv, job) = (cpus(&dir("kv")), cpus(&dir("job")));
    assert!(!kv.0.is_empty() && !job.0.is_empty(), "{kv} {job}");
    assert!(!kv.overlaps(&job), "{kv} {job}");
    let managed = CpuList((0..6).collect());
    assert!(
        kv.0.iter().chain(&job.0).all(|c| managed.0.contains(c)),
        "{kv} {job}"
    );
    assert_eq!(read(&dir("kv"), "cpu.weight"), "10000");
    assert_eq!(read(&dir("job"), "cpu.weight"), "1");
    assert_eq!(read(&dir("pinned"), "cpuset.cpus"), "6-7", "never touched");
    assert_eq!(read(&dir("pinned"), "cpu.weight"), "100");
    assert_eq!(read(&dir("bad"), "cpu.weight"), "100");
    assert_eq!(procs(f.root()), placed, "no process moved");
    let kv_tasks: String = std::fs::read_dir(resctrl.root())
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("cohabit-"))
        .map(|e| std::fs::read_to_string(e.path().join("tasks")).unwrap_or_default())
        .collect();
    assert!(
        kv_tasks.lines().any(|l| l.trim() == "40"),
        "kv's task joined a resctrl group: {kv_tasks:?}"
    );

    // Nothing changed: nothing is rebuilt.
    assert!(!d.tick());

    // kv leaves: its container gets its values back, the pool takes the CPUs.
    script.set(node_pods(false), true);
    assert!(d.tick());
    d.tick();
    assert_eq!(
        d.services(),
        BTreeMap::from([("batch.job".to_string(), false)])
    );
    assert_eq!(read(&dir("kv"), "cpu.weight"), "100", "restored");
    assert_eq!(read(&dir("kv"), "cpuset.cpus"), "", "restored");
    assert_eq!(cpus(&dir("job")), managed);

    // The API server goes away: what is known stays in force.
    script.set(node_pods(false), false);
    assert!(!d.tick());
    assert!(!d.pods.status().api_reachable);
    assert_eq!(cpus(&dir("job")), managed);

    // The kubelet frees the pinned CPUs: cohabit manages all 8 again.
    std::fs::write(
        kubelet.path().join("cpu_manager_state"),
        r#"{"policyName":"static","defaultCpuSet":"0-7","checksum":1}"#,
    )
    .unwrap();
    assert!(d.tick());
    assert_eq!(d.host.host().capacity().cores, 8);
    assert!(
        d.services().contains_key("default.pinned"),
        "no longer exclusive"
    );

    // Exit: every original is back.
    d.host.host_mut().restore();
    for name in ["kv", "job", "pinned", "bad"] {
        assert_eq!(read(&dir(name), "cpu.weight"), "100", "{name}");
    }
    assert_eq!(read(&dir("job"), "cpuset.cpus"), "");
    assert_eq!(read(&dir("pinned"), "cpuset.cpus"), "6-7");
    assert_eq!(procs(f.root()), placed, "no process moved");
    assert!(
        d.host.host().changes().is_empty(),
        "{:?}",
        d.host.host().changes()
    );
}

/// Kills and reaps a child when dropped.
struct Kill(std::process::Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// This machine's real v1 tree (as root): a cgroupfs kubepods tree under a test cgroup
/// root, real processes in a latency-critical and a best-effort pod's containers; the
/// values land in the containers' cgroups, no process moves, and a pod that leaves gets
/// its values back.
#[test]
fn on_the_real_v1_tree_pods_are_controlled_in_place_and_restored() {
    let Some(cg) = testing::real_cgroups() else {
        return;
    };
    if cg.version != cohabit_collectors::cgroup::Version::V1 {
        testing::skip("this machine's cgroups are not v1");
        return;
    }
    let online = cohabit_collectors::sysfs::Sysfs::new(Path::new("/sys"))
        .online_cpus()
        .unwrap_or_default();
    if online.len() < 2 {
        testing::skip("needs 2 CPUs");
        return;
    }
    let root = format!("cohabit-test-kubepods-{}", std::process::id());
    let tree = KubepodsTree::create(&cg, &root).unwrap();
    let kv_c = tree
        .container(&format!("kubepods/burstable/pod{KV}"), "aa11")
        .unwrap();
    let job_c = tree
        .container(&format!("kubepods/besteffort/pod{JOB}"), "bb22")
        .unwrap();
    let kv_p = Kill(
        std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap(),
    );
    let job_p = Kill(
        std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap(),
    );
    kv_c.add(kv_p.0.id()).unwrap();
    job_c.add(job_p.0.id()).unwrap();
    let cgroup_of = |pid: u32| std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    let before = (cgroup_of(kv_p.0.id()), cgroup_of(job_p.0.id()));
    let kubelet = tempfile::tempdir().unwrap();
    let text = format!(
        "interval_ms = 100\nmetrics_addr = \"\"\n[paths]\nresctrl = \"{}\"\nstate_dir = \"{}\"\n[kubernetes]\nnode_name = \"node-1\"\nkubelet_dir = \"{}\"\ncgroup_root = \"/{root}\"\n",
        kubelet.path().join("no-resctrl").display(),
        kubelet.path().join("state").display(),
        kubelet.path().display(),
    );
    let cfg = DaemonConfig::parse(&text, "t.toml").unwrap();
    let script = Script::default();
    let mut d = Daemon::open(&cfg, None, &script);
    let kv_dir = kv_c
        .dir(cohabit_collectors::cgroup::Controller::Cpuset)
        .unwrap()
        .to_path_buf();
    let kv_cpu = kv_c
        .dir(cohabit_collectors::cgroup::Controller::Cpu)
        .unwrap()
        .to_path_buf();
    let job_dir = job_c
        .dir(cohabit_collectors::cgroup::Controller::Cpuset)
        .unwrap()
        .to_path_buf();
    let (kv_cpus0, kv_shares0) = (read(&kv_dir, "cpuset.cpus"), read(&kv_cpu, "cpu.shares"));
    let pods = |with_kv: bool| {
        let mut v = vec![pod(
            ("batch", "job"),
            JOB,
            QosClass::BestEffort,
            PodClass::BestEffort,
            &[("main", "bb22")],
        )];
        if with_kv {
            v.push(pod(
                ("default", "kv"),
                KV,
                QosClass::Burstable,
                lc(
                    2.0,
                    Some("{ push = \"127.0.0.1:0\", unauthenticated = true }"),
                ),
                &[("main", "aa11")],
            ));
        }
        v
    };
    script.set(pods(true), true);
    assert!(d.tick());
    d.tick();
    let (kv, job) = (cpus(&kv_dir), cpus(&job_dir));
    assert!(
        !kv.overlaps(&job) && !kv.0.is_empty() && !job.0.is_empty(),
        "{kv} {job}"
    );
    assert_eq!(read(&kv_cpu, "cpu.shares"), "262144");
    assert_eq!(
        (cgroup_of(kv_p.0.id()), cgroup_of(job_p.0.id())),
        before,
        "no process moved"
    );
    script.set(pods(false), true);
    assert!(d.tick());
    d.tick();
    assert_eq!(read(&kv_dir, "cpuset.cpus"), kv_cpus0, "restored");
    assert_eq!(read(&kv_cpu, "cpu.shares"), kv_shares0, "restored");
    d.host.host_mut().restore();
    assert!(
        d.host.host().changes().is_empty(),
        "{:?}",
        d.host.host().changes()
    );
    assert_eq!(
        (cgroup_of(kv_p.0.id()), cgroup_of(job_p.0.id())),
        before,
        "no process moved"
    );
    drop((kv_p, job_p));
    drop(tree);
}
