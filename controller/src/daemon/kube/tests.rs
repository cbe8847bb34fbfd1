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
use cohabit_core::{Actuator as _, ServiceClass};
use cohabit_kube::trust::PodTrust;
use cohabit_kube::{ContainerRef, ManagedPod, PodClass, PodKey, PodView, QosClass};
use cohabit_policy::control;

use super::*;

mod hostile;

/// The daemon's configuration for a fake node: `head` (top-level keys), `cpus`, the fixture
/// trees' roots, the kubelet's directory and `kube_extra` (more `[kubernetes]` keys).
fn node_config(
    f: &FakeCgroup2,
    resctrl: &FakeResctrl,
    kubelet: &Path,
    head: &str,
    cpus: &str,
    kube_extra: &str,
) -> String {
    format!(
        "{head}metrics_addr = \"\"\n[host]\ncpus = \"{cpus}\"\n[paths]\nproc = \"{}\"\nsys = \"{}\"\ncgroup = \"{}\"\nresctrl = \"{}\"\nstate_dir = \"{}\"\n[kubernetes]\nnode_name = \"node-1\"\nkubelet_dir = \"{}\"\n{kube_extra}",
        f.base().join("proc").display(),
        f.base().join("sys").display(),
        f.base().join("sys/fs/cgroup").display(),
        resctrl.root().display(),
        kubelet.join("state").display(),
        kubelet.display(),
    )
}

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

/// `[kubernetes]` for the pure tests: pods in `shop` and `a` may be latency-critical.
fn kube_cfg(kubelet_dir: &Path, root: &str) -> KubernetesConfig {
    KubernetesConfig {
        node_name: "node-1".into(),
        cgroup_driver: None,
        cgroup_root: root.into(),
        kubelet_dir: kubelet_dir.to_path_buf(),
        api: cohabit_kube::ApiAccess::InCluster,
        socket_dir: "/run/cohabit/pods".into(),
        trust: PodTrust {
            latency_critical_namespaces: ["shop", "a"].map(String::from).into(),
            max_priority: 10,
            ..PodTrust::default()
        },
        max_pod_probe_timeout_ms: 500,
    }
}

/// A minimal daemon configuration, with `[kubernetes]` or without.
fn minimal_config(kubernetes: bool) -> DaemonConfig {
    let section = if kubernetes {
        "[kubernetes]\nnode_name = \"node-1\"\n"
    } else {
        "[[service]]\nname = \"kv\"\np99_target_ms = 1\nmatch = { process_name = \"kv\" }\nlatency = { push = \"127.0.0.1:9400\", unauthenticated = true }\n"
    };
    DaemonConfig::parse(&format!("metrics_addr = \"\"\n{section}"), "t.toml").unwrap()
}

#[test]
fn a_build_without_the_agent_refuses_kubernetes_and_names_the_feature() {
    let e = require_agent(&minimal_config(true), false).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("[kubernetes]"), "{msg}");
    assert!(msg.contains("--features kubernetes"), "{msg}");
    assert!(msg.contains("cargo feature `kubernetes`"), "{msg}");
}

#[test]
fn kubernetes_is_accepted_with_the_agent_and_other_configurations_without_it() {
    assert_eq!(require_agent(&minimal_config(true), true), Ok(()));
    assert_eq!(require_agent(&minimal_config(false), false), Ok(()));
    assert_eq!(require_agent(&minimal_config(false), true), Ok(()));
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
    let made = pod_service(&p, &tree, None, &cfg).unwrap();
    assert!(made.adjusted.is_empty(), "{:?}", made.adjusted);
    let s = made.service;
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
    let s = pod_service(&p, &tree, Some(&state), &cfg).unwrap().service;
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
    let s = pod_service(&be, &tree, None, &cfg).unwrap().service;
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
        ("{ push = \"127.0.0.1:9400\" }", "cannot push over UDP"),
        (
            "{ unix = \"/etc/cohabit.sock\" }",
            "must be /run/cohabit/pods/a.b.sock",
        ),
        (
            "{ unix = \"/run/cohabit/pods/../x.sock\" }",
            "must be /run/cohabit/pods/a.b.sock",
        ),
        (
            "{ unix = \"/run/cohabit/pods/other.pod.sock\" }",
            "must be /run/cohabit/pods/a.b.sock",
        ),
        (
            "{ probe = \"http://127.0.0.1:80/\", timeout_ms = 600000 }",
            "above 500, the daemon's collect_timeout_ms",
        ),
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
            Some("{ unix = \"/run/cohabit/pods/a.b.sock\", mode = \"0666\" }"),
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
fn a_pods_udp_push_is_refused_so_no_port_is_bound_for_it() {
    let f = FakeCgroup2::builder().build().unwrap();
    f.mkdir_owner("/kubepods", &[]).unwrap();
    let tree = Kubepods::new(f.cgroups().unwrap(), None, "/").unwrap();
    let cfg = kube_cfg(Path::new("/var/lib/kubelet"), "/");
    // Loopback (even a privileged port), wildcards, the pod's own address: the pod is
    // skipped with an Event before any source is bound.
    for addr in [
        "127.0.0.1:9",
        "127.0.0.1:0",
        "[::1]:9400",
        "0.0.0.0:9400",
        "10.1.2.3:9400",
    ] {
        let text = format!("{{ push = \"{addr}\", unauthenticated = true }}");
        let mut p = pod(
            ("a", "b"),
            "12",
            QosClass::Burstable,
            lc(1.0, Some(&text)),
            &[("c", "aa")],
        );
        p.ips = vec!["10.1.2.3".parse().unwrap()];
        let Err(Skip::Warn { reason, message }) = pod_service(&p, &tree, None, &cfg) else {
            panic!("{addr} was accepted");
        };
        assert_eq!(reason, "BadLatencyAnnotation");
        assert!(
            message.contains("cannot push over UDP")
                && message.contains("/run/cohabit/pods/a.b.sock"),
            "{addr}: {message}"
        );
    }
    // Below the configuration too: the listener refuses a wildcard outright.
    use cohabit_collectors::latency::{PushAddr, PushListener, UnixAccess};
    let wild = PushAddr::Udp("0.0.0.0:0".parse().unwrap());
    let e = PushListener::bind(&wild, &UnixAccess::default()).unwrap_err();
    assert!(e.to_string().contains("only loopback"), "{e}");
}

#[test]
fn outside_the_allowed_namespaces_a_pod_is_best_effort_whatever_it_claims() {
    let f = FakeCgroup2::builder().build().unwrap();
    f.mkdir_owner("/kubepods", &[]).unwrap();
    let tree = Kubepods::new(f.cgroups().unwrap(), None, "/").unwrap();
    let mut cfg = kube_cfg(Path::new("/var/lib/kubelet"), "/");
    cfg.trust = PodTrust::default();
    let mut p = pod(
        ("shop", "thief"),
        "12",
        QosClass::Burstable,
        lc(
            0.001,
            Some("{ push = \"127.0.0.1:9\", unauthenticated = true }"),
        ),
        &[("c", "aa")],
    );
    p.priority = Some(i32::MAX);
    let made = pod_service(&p, &tree, None, &cfg).unwrap();
    assert_eq!(made.service.p99_target_ms, None, "not latency-critical");
    assert_eq!(made.service.priority, 0);
    assert_eq!(made.service.latency, None, "nothing bound for it either");
    let reasons: Vec<&str> = made.adjusted.iter().map(|a| a.reason()).collect();
    assert_eq!(reasons, ["LatencyCriticalNotAllowed"], "exactly one Event");
}

#[test]
fn in_an_allowed_namespace_priority_is_clamped_and_a_tiny_target_raised() {
    let f = FakeCgroup2::builder().build().unwrap();
    f.mkdir_owner("/kubepods", &[]).unwrap();
    let tree = Kubepods::new(f.cgroups().unwrap(), None, "/").unwrap();
    let cfg = kube_cfg(Path::new("/var/lib/kubelet"), "/");
    for target in [0.001, 5e-324] {
        let mut p = pod(
            ("shop", "thief"),
            "12",
            QosClass::Burstable,
            lc(target, None),
            &[("c", "aa")],
        );
        p.priority = Some(i32::MAX);
        let made = pod_service(&p, &tree, None, &cfg).unwrap();
        assert_eq!(made.service.priority, 10, "kubernetes.max_pod_priority");
        assert_eq!(
            made.service.p99_target_ms,
            Some(cohabit_kube::trust::DEFAULT_MIN_POD_P99_TARGET_MS)
        );
        let reasons: Vec<&str> = made.adjusted.iter().map(|a| a.reason()).collect();
        assert_eq!(reasons, ["PriorityClamped", "P99TargetRaised"]);
    }
}

/// The service specs the daemon hands a policy for `services` (as `cohabit_host::spec_of`).
fn specs_of(services: &[ManagedService]) -> Vec<cohabit_core::ServiceSpec> {
    services
        .iter()
        .map(|s| cohabit_core::ServiceSpec {
            name: s.name.clone(),
            class: match s.p99_target_ms {
                Some(t) => ServiceClass::LatencyCritical { p99_target_ms: t },
                None => ServiceClass::BestEffort,
            },
            gpu: None,
            priority: s.priority,
        })
        .collect()
}

/// Runs parties for `ticks` intervals on 12 cores with every latency-critical service
/// at `ratio` × its target, and returns each one's cores at the end.
fn parties_cores(services: &[ManagedService], ticks: u64, ratio: f64) -> BTreeMap<String, u32> {
    use cohabit_core::{Observation, Sample, ServiceObservation};
    use cohabit_policy::{PartiesConfig, PartiesPolicy};
    let ctx = HostContext {
        host: cohabit_core::HostCapacity {
            name: "t".into(),
            cores: 12,
            freq_ghz: 2.0,
            llc_ways: 12,
            llc_way_bytes: 1 << 20,
            mem_bw_bytes_per_s: 1e10,
            gpus: vec![],
            closids: 16,
            mba_min_pct: 10,
            mba_gran_pct: 10,
            min_cbm_bits: 1,
            shareable_bits: 0,
        },
        specs: specs_of(services),
    };
    let mut p = PartiesPolicy::new(ctx.clone(), PartiesConfig::default());
    let mut plan = p.initial().plan;
    for t in 1..=ticks {
        let obs = Observation {
            t_ms: t * 1000,
            services: ctx
                .specs
                .iter()
                .map(|s| ServiceObservation {
                    spec: s.clone(),
                    sample: Sample {
                        p99_ms: s.p99_target_ms().map(|target| target * ratio),
                        ..Sample::default()
                    },
                    gpu_mps_effective_pct: None,
                })
                .collect(),
            current: plan.clone(),
        };
        plan = p.decide(&obs, t * 1000).plan;
        plan.validate(&ctx.host, &ctx.specs).unwrap();
    }
    plan.services
        .iter()
        .map(|(n, a)| (n.clone(), a.cores))
        .collect()
}

#[test]
fn under_parties_the_victims_keep_their_cores_against_a_pod_claiming_top_priority() {
    let f = FakeCgroup2::builder().build().unwrap();
    f.mkdir_owner("/kubepods", &[]).unwrap();
    let tree = Kubepods::new(f.cgroups().unwrap(), None, "/").unwrap();
    let mut cfg = kube_cfg(Path::new("/var/lib/kubelet"), "/");
    cfg.trust.max_priority = cohabit_kube::trust::DEFAULT_MAX_POD_PRIORITY;
    let mut pods: Vec<ManagedPod> = ["thief", "victim-1", "victim-2"]
        .iter()
        .enumerate()
        .map(|(i, name)| {
            pod(
                ("shop", name),
                &format!("{i}"),
                QosClass::Burstable,
                lc(1.0, None),
                &[("c", &format!("a{i}"))],
            )
        })
        .collect();
    pods[0].priority = Some(i32::MAX);
    pods[0].class = lc(0.001, None);
    let granted: Vec<ManagedService> = pods
        .iter()
        .map(|p| pod_service(p, &tree, None, &cfg).unwrap().service)
        .collect();
    // Everyone misses (the thief's target cannot be met): as granted, nobody may take
    // from an equal, so the fair split stays.
    let cores = parties_cores(&granted, 10, 1.5);
    assert_eq!(cores["shop.victim-1"], 4, "{cores:?}");
    assert_eq!(cores["shop.victim-2"], 4, "{cores:?}");
    // The same pods taken at their word: the thief strips the victims (what the trust
    // rules prevent).
    let mut as_claimed = granted.clone();
    as_claimed[0].priority = i32::MAX;
    let cores = parties_cores(&as_claimed, 10, 1.5);
    assert!(
        cores["shop.victim-1"] < 4 && cores["shop.victim-2"] < 4,
        "{cores:?}"
    );
}

#[test]
fn latency_critical_services_beyond_the_cpus_are_the_lowest_ranked_pods() {
    let svc = |name: &str, priority: i32, lc: bool| ManagedService {
        name: name.into(),
        p99_target_ms: lc.then_some(1.0),
        matcher: Matcher::ProcessName("x".into()),
        constraint: config::ProcessConstraint::default(),
        placement: Placement::InPlace,
        allow_unmanaged: false,
        latency: None,
        gpu: None,
        priority,
    };
    let fixed = [svc("memcached", -5, true), svc("batch", 0, false)];
    let pods = [
        svc("a.high", 5, true),
        svc("b.low", 0, true),
        svc("a.low", 0, true),
        svc("z.job", 9, false),
    ];
    let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
    assert_eq!(beyond_cores(&fixed, &pods, 4), names(&[]));
    // Configured first whatever its priority; then by priority; ties by name.
    assert_eq!(beyond_cores(&fixed, &pods, 3), names(&["b.low"]));
    assert_eq!(beyond_cores(&fixed, &pods, 2), names(&["a.low", "b.low"]));
    assert_eq!(
        beyond_cores(&fixed, &pods, 1),
        names(&["a.high", "a.low", "b.low"])
    );
    // Configured services beyond the CPUs too, lowest priority last.
    let more = [svc("kv", 1, true), svc("memcached", -5, true)];
    assert_eq!(
        beyond_cores(&more, &pods, 1),
        names(&["memcached", "a.high", "a.low", "b.low"])
    );
    // The order of the input does not matter.
    let mut shuffled = pods.clone();
    shuffled.reverse();
    assert_eq!(
        beyond_cores(&fixed, &shuffled, 2),
        names(&["a.low", "b.low"])
    );
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
        Self::open_with(cfg, resctrl, script, static_factory())
    }

    /// [`Daemon::open`] building the policy with `factory` whenever the pods change.
    fn open_with(
        cfg: &DaemonConfig,
        resctrl: Option<&FakeResctrl>,
        script: &Script,
        factory: PolicyFactory,
    ) -> Self {
        let host = match resctrl {
            Some(r) => RealHost::open_with(cfg.host_spec(), false, Arc::new(r.clone())),
            None => RealHost::open(cfg.host_spec(), false),
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
            factory,
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
            lc(2.0, None),
            &[("main", "aa")],
        ));
    }
    pods.sort_by(|a, b| a.key.cmp(&b.key));
    pods
}

/// The fake node of [`fake_node`] with the pinned container's CPUs exclusive, and a
/// daemon configuration for it ticking every `interval_ms`: the fixtures (kept alive with
/// it), the containers' cgroup paths by pod, and the configuration.
struct Node {
    cgroups: FakeCgroup2,
    resctrl: FakeResctrl,
    kubelet: tempfile::TempDir,
    dirs: BTreeMap<&'static str, String>,
    cfg: DaemonConfig,
}

impl Node {
    fn new(interval_ms: u64) -> Self {
        let f = FakeCgroup2::builder().cpus(8).build().unwrap();
        let resctrl = FakeResctrl::builder().ways(12).build().unwrap();
        let dirs = fake_node(&f);
        for pid in [40, 50, 60, 70] {
            resctrl.add_task(pid).unwrap();
        }
        let kubelet = tempfile::tempdir().unwrap();
        std::fs::write(
            kubelet.path().join("cpu_manager_state"),
            format!(r#"{{"policyName":"static","defaultCpuSet":"0-5","entries":{{"{PINNED}":{{"main":"6-7"}}}},"checksum":1}}"#),
        )
        .unwrap();
        let text = node_config(
            &f,
            &resctrl,
            kubelet.path(),
            &format!("interval_ms = {interval_ms}\n"),
            "0-7",
            "latency_critical_namespaces = [\"default\"]\n",
        );
        let cfg = DaemonConfig::parse(&text, "t.toml").unwrap();
        Self {
            cgroups: f,
            resctrl,
            kubelet,
            dirs,
            cfg,
        }
    }
}

/// The single Warning Event posted, as (pod, reason, message).
fn the_one_warning(script: &Script) -> (String, String, String) {
    let warned = script.warned();
    assert_eq!(warned.len(), 1, "{warned:?}");
    warned[0].clone()
}

/// The tasks of cohabit's resctrl groups on `resctrl`, one a line.
fn cohabit_resctrl_tasks(resctrl: &FakeResctrl) -> String {
    std::fs::read_dir(resctrl.root())
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("cohabit-"))
        .map(|e| std::fs::read_to_string(e.path().join("tasks")).unwrap_or_default())
        .collect()
}

#[test]
fn the_daemon_follows_the_pods_writing_in_place_and_restoring_those_that_leave() {
    let node = Node::new(100);
    let f = &node.cgroups;
    let dir = |name: &str| f.dir(&node.dirs[name]);
    let script = Script::default();
    let mut d = Daemon::open(&node.cfg, Some(&node.resctrl), &script);
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
    let (pod, reason, message) = the_one_warning(&script);
    assert_eq!(
        (pod.as_str(), reason.as_str()),
        ("default/bad", "BadLatencyAnnotation")
    );
    assert!(message.contains("unknown field"), "{message}");
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
    let kv_tasks = cohabit_resctrl_tasks(&node.resctrl);
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
        node.kubelet.path().join("cpu_manager_state"),
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

/// kv (latency-critical, target 2 ms, no latency source: the test measures it) and the
/// batch job, whose `cohabit.io/priority` annotation is `job_priority`.
fn kv_and_job(job_priority: Option<i32>) -> Vec<ManagedPod> {
    let mut job = pod(
        ("batch", "job"),
        JOB,
        QosClass::BestEffort,
        PodClass::BestEffort,
        &[("main", "bb")],
    );
    job.priority = job_priority;
    let kv = pod(
        ("default", "kv"),
        KV,
        QosClass::Burstable,
        lc(2.0, None),
        &[("main", "aa")],
    );
    vec![job, kv]
}

/// What the daemon decided for kv at one tick.
type KvDecision = (
    cohabit_core::Allocation,
    cohabit_core::Reason,
    Option<cohabit_core::Prediction>,
);

/// `ticks` one-second ticks of the daemon on the fake node with the policy `factory`
/// builds, kv measured at a p99 that moves around half its target (every other service
/// unmeasured), and, when `churn`, the batch job's priority annotation added and removed
/// every tick: kv's decision at each tick and how many times the services followed the
/// pods.
fn kv_under_churn(factory: PolicyFactory, churn: bool, ticks: u64) -> (Vec<KvDecision>, usize) {
    let node = Node::new(1000);
    let script = Script::default();
    let mut d = Daemon::open_with(&node.cfg, Some(&node.resctrl), &script, factory);
    let (mut seen, mut rebuilds) = (Vec::new(), 0);
    for t in 1..=ticks {
        let annotated = churn && t % 2 == 0;
        script.set(kv_and_job(annotated.then_some(0)), true);
        if d.pods
            .tick(&mut d.host, &mut d.policy, &mut d.fair_share, false)
        {
            rebuilds += 1;
        }
        let current = d.host.host().plan_in_force().unwrap().clone();
        let p99_ms = [1.0, 1.2, 0.9, 1.1][usize::try_from(t % 4).unwrap()];
        let obs = cohabit_core::Observation {
            t_ms: t * 1000,
            services: d
                .host
                .host()
                .specs()
                .into_iter()
                .map(|spec| cohabit_core::ServiceObservation {
                    sample: cohabit_core::Sample {
                        p99_ms: (spec.name == "default.kv").then_some(p99_ms),
                        requests_per_s: Some(50.0),
                        cpu_busy_cores: Some(1.0),
                        ..cohabit_core::Sample::default()
                    },
                    spec,
                    gpu_mps_effective_pct: None,
                })
                .collect(),
            current,
        };
        let decision = d.policy.decide(&obs, t * 1000);
        d.host.apply(&decision.plan, &[]).unwrap();
        seen.push((
            decision.plan.services["default.kv"],
            decision.reasons["default.kv"].clone(),
            decision.predictions.get("default.kv").cloned(),
        ));
    }
    d.host.host_mut().restore();
    drop(node);
    (seen, rebuilds)
}

fn parties_factory() -> PolicyFactory {
    Box::new(|ctx| {
        let p = cohabit_policy::PartiesPolicy::new(ctx, cohabit_policy::PartiesConfig::default());
        Ok(Box::new(p) as Box<dyn Policy>)
    })
}

/// `ml` with a model whose members are linear in the candidate's cores (a core more is
/// -0.05 in ln(p99/target)), as in the policy crate's tests.
fn ml_factory() -> PolicyFactory {
    let mut model = cohabit_models::Model::synthetic(2, &[], 0);
    let cores = cohabit_models::FEATURE_NAMES
        .iter()
        .position(|n| *n == "cores_cand")
        .unwrap();
    for member in &mut model.ensemble.members {
        member.layers.truncate(1);
        let layer = &mut member.layers[0];
        layer.weight.fill(0.0);
        layer.weight[[0, cores]] = -1.8;
        layer.bias.fill(0.0);
    }
    let model = Arc::new(model);
    Box::new(move |ctx| {
        let ml = cohabit_policy::MlPolicy::new(
            ctx,
            Arc::clone(&model),
            cohabit_policy::MlConfig::default(),
        );
        Ok(Box::new(ml) as Box<dyn Policy>)
    })
}

#[test]
fn annotation_churn_on_one_pod_leaves_an_unchanged_services_parties_state_as_without_it() {
    let (quiet, once) = kv_under_churn(parties_factory(), false, 30);
    let (churned, rebuilds) = kv_under_churn(parties_factory(), true, 30);
    assert_eq!(once, 1, "without churn the services follow the pods once");
    assert!(
        rebuilds >= 4,
        "the churn rebuilt the policy {rebuilds} times"
    );
    // kv's allocation moved (parties cut it and rotated its resource: the state mattered) ...
    let mut allocs: Vec<_> = quiet.iter().map(|d| d.0).collect();
    allocs.dedup();
    assert!(allocs.len() > 2, "{quiet:?}");
    // ... and every decision for it is the one it got without the churn.
    for (t, (q, c)) in quiet.iter().zip(&churned).enumerate() {
        assert_eq!(q, c, "tick {}", t + 1);
    }
}

#[test]
fn annotation_churn_on_one_pod_leaves_an_unchanged_services_ml_corrections_as_without_it() {
    let (quiet, _) = kv_under_churn(ml_factory(), false, 30);
    let (churned, rebuilds) = kv_under_churn(ml_factory(), true, 30);
    assert!(
        rebuilds >= 4,
        "the churn rebuilt the policy {rebuilds} times"
    );
    // kv is decided by the model, whose corrected predictions differ from tick to tick.
    let predicted: Vec<f64> = quiet
        .iter()
        .filter_map(|d| d.2.as_ref().map(|p| p.log_qos_ratio))
        .collect();
    assert!(predicted.len() > 20, "{quiet:?}");
    assert!(predicted.windows(2).any(|w| w[0] != w[1]), "{predicted:?}");
    for (t, (q, c)) in quiet.iter().zip(&churned).enumerate() {
        assert_eq!(q, c, "tick {}", t + 1);
    }
}

#[test]
fn the_services_follow_churning_pods_at_most_once_per_hold_off_and_a_new_pod_at_once() {
    let node = Node::new(1000);
    let hold_off = hold_off_ticks(1000);
    assert_eq!(hold_off, 10);
    let script = Script::default();
    let mut d = Daemon::open(&node.cfg, Some(&node.resctrl), &script);
    // The job's annotation changes every tick for 45 ticks.
    let mut at = Vec::new();
    for t in 1..=45u64 {
        script.set(kv_and_job((t % 2 == 0).then_some(0)), true);
        if d.tick() {
            at.push(t);
        }
    }
    // The first changes at once (the burst), then one per hold-off.
    assert_eq!(at, vec![1, 2, 3, 11, 21, 31, 41], "rebuilt at ticks {at:?}");
    // The view changed at tick 44 and 45 too: it is in force once the hold-off ends,
    // although nothing changes any more.
    let last = script.view().generation;
    let mut t = 45;
    while d.pods.in_force.as_ref().map(|(g, _)| *g) != Some(last) {
        t += 1;
        assert!(t <= 45 + hold_off, "the last view was lost");
        d.tick();
    }
    assert_eq!(t, 51, "at the end of the hold-off");
    // A quiet node: a new pod is followed at the next tick.
    for _ in 0..3 * hold_off {
        assert!(!d.tick());
    }
    let mut with_web = kv_and_job(None);
    with_web.push(pod(
        ("default", "web"),
        BAD,
        QosClass::Burstable,
        lc(1.0, None),
        &[("main", "dd")],
    ));
    script.set(with_web, true);
    assert!(d.tick(), "a new pod on a quiet node is followed at once");
    assert!(d.services().contains_key("default.web"));
    d.host.host_mut().restore();
}

#[test]
fn the_rebuild_limit_is_a_bucket_of_three_refilled_once_per_hold_off() {
    let mut l = RebuildLimit::new(3, 10);
    let allowed: Vec<u64> = (1..=40).filter(|t| l.allow(*t, false)).collect();
    assert_eq!(allowed, vec![1, 2, 3, 11, 21, 31]);
    // Urgent changes go through with the bucket empty.
    assert!(!l.allow(32, false));
    assert!(l.allow(33, true));
    // Quiet for long enough, the bucket is full again: three at once.
    let allowed: Vec<u64> = (100..=103).filter(|t| l.allow(*t, false)).collect();
    assert_eq!(allowed, vec![100, 101, 102]);
    // A hold-off shorter than a tick is one tick.
    assert_eq!(hold_off_ticks(60_000), 1);
    assert_eq!(hold_off_ticks(100), 100);
}

/// Kills and reaps a child when dropped.
struct Kill(std::process::Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// This machine's cgroups when they are v1, writable and have 2 CPUs to share; otherwise
/// `None`, after a skip that says why.
fn real_v1_cgroups() -> Option<cohabit_collectors::cgroup::Cgroups> {
    let cg = testing::real_cgroups()?;
    if cg.version != cohabit_collectors::cgroup::Version::V1 {
        cohabit_testkit::skip(
            cohabit_testkit::Need::Root,
            "this machine's cgroups are not v1",
        );
        return None;
    }
    let online = cohabit_collectors::sysfs::Sysfs::new(Path::new("/sys"))
        .online_cpus()
        .unwrap_or_default();
    if online.len() < 2 {
        cohabit_testkit::skip(cohabit_testkit::Need::Root, "needs 2 CPUs");
        return None;
    }
    Some(cg)
}

/// A process that sleeps for a minute, killed when dropped.
fn sleeper() -> Kill {
    Kill(
        std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap(),
    )
}

/// The daemon's configuration for the kubepods tree under cgroup root `root`, its kubelet
/// directory (and state, sockets, no resctrl) in `kubelet`.
fn real_tree_config(kubelet: &Path, root: &str) -> String {
    format!(
        "interval_ms = 100\nmetrics_addr = \"\"\n[paths]\nresctrl = \"{}\"\nstate_dir = \"{}\"\n[kubernetes]\nnode_name = \"node-1\"\nkubelet_dir = \"{}\"\ncgroup_root = \"/{root}\"\nlatency_critical_namespaces = [\"default\"]\nsocket_dir = \"{}\"\n",
        kubelet.join("no-resctrl").display(),
        kubelet.join("state").display(),
        kubelet.display(),
        kubelet.display(),
    )
}

/// This machine's real v1 tree (as root): a cgroupfs kubepods tree under a test cgroup
/// root, real processes in a latency-critical and a best-effort pod's containers; the
/// values land in the containers' cgroups, no process moves, and a pod that leaves gets
/// its values back.
#[test]
fn on_the_real_v1_tree_pods_are_controlled_in_place_and_restored() {
    let Some(cg) = real_v1_cgroups() else {
        return;
    };
    let root = format!("cohabit-test-kubepods-{}", std::process::id());
    let tree = KubepodsTree::create(&cg, &root).unwrap();
    let kv_c = tree
        .container(&format!("kubepods/burstable/pod{KV}"), "aa11")
        .unwrap();
    let job_c = tree
        .container(&format!("kubepods/besteffort/pod{JOB}"), "bb22")
        .unwrap();
    let (kv_p, job_p) = (sleeper(), sleeper());
    kv_c.add(kv_p.0.id()).unwrap();
    job_c.add(job_p.0.id()).unwrap();
    let cgroup_of = |pid: u32| std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    let before = (cgroup_of(kv_p.0.id()), cgroup_of(job_p.0.id()));
    let kubelet = tempfile::tempdir().unwrap();
    let text = real_tree_config(kubelet.path(), &root);
    // The pod's push socket: its own path in socket_dir, bound by the daemon as root.
    let kv_socket = kubelet.path().join("default.kv.sock");
    let kv_latency = format!("{{ unix = \"{}\" }}", kv_socket.display());
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
                lc(2.0, Some(&kv_latency)),
                &[("main", "aa11")],
            ));
        }
        v
    };
    script.set(pods(true), true);
    assert!(d.tick());
    d.tick();
    assert!(script.warned().is_empty(), "{:?}", script.warned());
    assert!(
        std::fs::symlink_metadata(&kv_socket).is_ok_and(|m| {
            use std::os::unix::fs::FileTypeExt as _;
            m.file_type().is_socket()
        }),
        "the pod's socket is bound at its own path"
    );
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

/// The daemon over [`fake_node`] on `cpus` of a fake with `n_cpus` CPUs, with `extra` in
/// `[kubernetes]`; no CPU manager checkpoint (so no container is pinned).
fn fake_daemon(
    n_cpus: u32,
    cpus: &str,
    extra: &str,
) -> (FakeCgroup2, FakeResctrl, tempfile::TempDir, Script, Daemon) {
    let f = FakeCgroup2::builder().cpus(n_cpus).build().unwrap();
    let resctrl = FakeResctrl::builder().ways(12).build().unwrap();
    fake_node(&f);
    for pid in [40, 50, 60, 70] {
        resctrl.add_task(pid).unwrap();
    }
    let kubelet = tempfile::tempdir().unwrap();
    let text = node_config(
        &f,
        &resctrl,
        kubelet.path(),
        "interval_ms = 100\n",
        cpus,
        extra,
    );
    let cfg = DaemonConfig::parse(&text, "t.toml").unwrap();
    let script = Script::default();
    let d = Daemon::open(&cfg, Some(&resctrl), &script);
    (f, resctrl, kubelet, script, d)
}

/// kv, bad and pinned as latency-critical pods (no latency source), priorities as given.
fn three_lc_pods(priorities: [i32; 3]) -> Vec<ManagedPod> {
    let mut pods: Vec<ManagedPod> = [
        ("kv", KV, "aa"),
        ("bad", BAD, "dd"),
        ("pinned", PINNED, "cc"),
    ]
    .into_iter()
    .zip(priorities)
    .map(|((name, uid, id), prio)| {
        let mut p = pod(
            ("default", name),
            uid,
            if name == "pinned" {
                QosClass::Guaranteed
            } else {
                QosClass::Burstable
            },
            lc(1.0, None),
            &[("main", id)],
        );
        p.priority = Some(prio);
        p
    })
    .collect();
    pods.sort_by(|a, b| a.key.cmp(&b.key));
    pods
}

#[test]
fn with_no_allowed_namespace_a_pod_claiming_everything_is_best_effort_with_one_event() {
    let (_f, _r, _k, script, mut d) = fake_daemon(8, "0-7", "");
    let mut thief = pod(
        ("default", "kv"),
        KV,
        QosClass::Burstable,
        lc(
            0.001,
            Some("{ push = \"127.0.0.1:9\", unauthenticated = true }"),
        ),
        &[("main", "aa")],
    );
    thief.priority = Some(i32::MAX);
    script.set(vec![thief.clone()], true);
    assert!(d.tick());
    d.tick();
    assert_eq!(
        d.services(),
        BTreeMap::from([("default.kv".to_string(), false)]),
        "best effort, not latency-critical"
    );
    let warned = script.warned();
    assert_eq!(warned.len(), 1, "{warned:?}");
    assert_eq!(
        (warned[0].0.as_str(), warned[0].1.as_str()),
        ("default/kv", "LatencyCriticalNotAllowed")
    );
    // Its priority is a best-effort job's: 0.
    let spec = d.host.host().specs();
    assert!(spec.iter().all(|s| s.priority == 0), "{spec:?}");
    assert_eq!(
        d.pods.from_pods(),
        &BTreeSet::from(["default.kv".to_string()])
    );
    // Nothing changed: nothing more is posted.
    script.set(vec![thief], true);
    assert!(!d.tick());
    assert_eq!(script.warned().len(), 1);
}

#[test]
fn more_latency_critical_pods_than_cpus_give_a_valid_plan_with_the_lowest_in_the_pool() {
    let (_f, _r, _k, script, mut d) = fake_daemon(
        2,
        "0-1",
        "latency_critical_namespaces = [\"default\"]\nmax_pod_priority = 10\n",
    );
    // pinned ranks first (priority 5); kv and bad tie at 0 and bad comes first by name.
    script.set(three_lc_pods([0, 0, 5]), true);
    assert!(d.tick());
    d.tick();
    assert_eq!(
        d.services(),
        BTreeMap::from([
            ("default.bad".to_string(), true),
            ("default.kv".to_string(), false),
            ("default.pinned".to_string(), true),
        ])
    );
    let warned = script.warned();
    assert_eq!(warned.len(), 1, "{warned:?}");
    assert_eq!(
        (warned[0].0.as_str(), warned[0].1.as_str()),
        ("default/kv", TOO_MANY_LATENCY_CRITICAL)
    );
    assert!(
        warned[0]
            .2
            .contains("3 latency-critical services for 2 CPUs"),
        "{warned:?}"
    );
    // The plan in force and the fail-safe's both fit the host.
    let host = d.host.host();
    let (capacity, specs) = (host.capacity().clone(), host.specs());
    assert_eq!(capacity.cores, 2);
    host.plan_in_force()
        .expect("a plan was applied")
        .validate(&capacity, &specs)
        .unwrap();
    d.fair_share.validate(&capacity, &specs).unwrap();
    // A higher priority for kv moves it in and bad out.
    script.set(three_lc_pods([7, 0, 5]), true);
    assert!(d.tick());
    let lc: Vec<String> = d
        .services()
        .into_iter()
        .filter(|(_, lc)| *lc)
        .map(|(n, _)| n)
        .collect();
    assert_eq!(lc, ["default.kv", "default.pinned"]);
}

#[test]
fn a_newline_in_an_annotation_does_not_reach_the_warning_raw() {
    let (_f, _r, _k, script, mut d) =
        fake_daemon(8, "0-7", "latency_critical_namespaces = [\"default\"]\n");
    let scrape = pod(
        ("default", "kv"),
        KV,
        QosClass::Burstable,
        lc(
            1.0,
            Some("{ prometheus = \"http://127.0.0.1:9150/m\\nFORGED LOG LINE\", metric = \"m\" }"),
        ),
        &[("main", "aa")],
    );
    let mut odd = pod(
        ("default", "bad"),
        BAD,
        QosClass::Burstable,
        PodClass::BestEffort,
        &[("main\nFORGED LOG LINE", "dd")],
    );
    odd.containers[0].runtime = "rkt".into();
    let mut pods = vec![scrape, odd];
    pods.sort_by(|a, b| a.key.cmp(&b.key));
    script.set(pods, true);
    d.tick();
    let warned = script.warned();
    assert_eq!(warned.len(), 2, "{warned:?}");
    for (pod, reason, message) in &warned {
        assert!(
            message.contains("FORGED LOG LINE"),
            "{pod} {reason}: {message}"
        );
        assert!(
            !message.chars().any(char::is_control),
            "{pod} {reason}: {message:?}"
        );
    }
}
