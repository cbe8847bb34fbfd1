//! The node agent against a scripted API server (tests/support): what it asks for, and
//! what its view shows, across list, watch, bookmarks, 410 Gone, 429, 5xx, an outage and
//! invalid annotations.

mod support;

use std::time::Duration;

use cohabit_kube::{
    AgentTiming, ApiAccess, KubeError, NodeAgent, NodeAgentConfig, PodClass, PodKey, QosClass,
};
use serde_json::{json, Value};
use support::*;

const TOKEN: &str = "test-token-0123";

struct Agent {
    agent: NodeAgent,
    _dir: tempfile::TempDir,
}

fn start(api: &FakeApi) -> Agent {
    start_with(
        api,
        AgentTiming {
            backoff_initial: Duration::from_millis(20),
            backoff_max: Duration::from_millis(100),
            watch_timeout_s: 5,
            connect_timeout: Duration::from_secs(1),
            idle_slack: Duration::from_secs(5),
        },
    )
}

fn start_with(api: &FakeApi, timing: AgentTiming) -> Agent {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, TOKEN).unwrap();
    let mut cfg = NodeAgentConfig::new(
        "node-1",
        ApiAccess::Url {
            url: api.url(),
            token_file: Some(token),
            ca_file: None,
            // The fake API server speaks plain http on loopback.
            insecure_http: true,
        },
    );
    cfg.timing = timing;
    Agent {
        agent: NodeAgent::start(cfg).unwrap(),
        _dir: dir,
    }
}

fn names(a: &NodeAgent) -> Vec<String> {
    a.view().pods.iter().map(|p| p.key.name.clone()).collect()
}

fn script(lists: Vec<Reply>, watches: Vec<Reply>) -> Script {
    Script {
        lists: lists.into(),
        watches: watches.into(),
    }
}

fn end(events: Vec<Value>) -> Reply {
    Reply::Watch { events, hold: None }
}

#[test]
fn lists_then_watches_this_nodes_pods_resuming_from_bookmarks() {
    let api = FakeApi::start(script(
        vec![pod_list(
            "100",
            vec![
                pod("web", "u-web", "90", "Running", lc("2.5")),
                pod("plain", "u-plain", "91", "Running", json!({})),
                pod("batch-pending", "u-bp", "92", "Pending", be()),
            ],
        )],
        vec![
            end(vec![
                watch_event("ADDED", pod("batch", "u-batch", "101", "Running", be())),
                bookmark("150"),
            ]),
            Reply::Watch {
                events: vec![watch_event(
                    "MODIFIED",
                    pod("batch-pending", "u-bp", "151", "Running", be()),
                )],
                hold: Some(Duration::from_secs(30)),
            },
        ],
    ));
    let a = start(&api);
    wait_until(5, "three pods in the view", || {
        names(&a.agent) == ["batch", "batch-pending", "web"]
    });
    let v = a.agent.view();
    assert!(v.synced && v.api_reachable && v.last_error.is_none());
    let web = v.pods.iter().find(|p| p.key.name == "web").unwrap();
    assert_eq!(
        web.key,
        PodKey {
            namespace: "shop".into(),
            name: "web".into(),
            uid: "u-web".into()
        }
    );
    assert_eq!(
        web.class,
        PodClass::LatencyCritical {
            p99_target_ms: 2.5,
            latency: None
        }
    );
    assert_eq!(web.qos, QosClass::Burstable);
    assert_eq!(web.containers[0].runtime, "containerd");
    assert_eq!(web.containers[0].id, "u-web-c");

    let reqs = api.pod_requests();
    assert!(reqs.len() >= 3, "{reqs:#?}");
    let (list, w1, w2) = (&reqs[0], &reqs[1], &reqs[2]);
    // The list: every pod of this node, from the watch cache, not a watch.
    assert!(list.is_pod_list(), "{list:?}");
    assert!(
        list.raw_query
            .contains("fieldSelector=spec.nodeName%3Dnode-1"),
        "{}",
        list.raw_query
    );
    assert_eq!(list.rv(), Some("0"));
    assert_eq!(
        list.query.get("limit"),
        None,
        "unpaged, or kube drops resourceVersion=0"
    );
    // The watch resumes at the list's version, with bookmarks, and after the stream ends,
    // at the bookmark's version (not the last object's 101).
    for w in [w1, w2] {
        assert!(w.is_pod_watch(), "{w:?}");
        assert_eq!(
            w.query.get("allowWatchBookmarks").map(String::as_str),
            Some("true")
        );
        assert_eq!(
            w.query.get("fieldSelector").map(String::as_str),
            Some("spec.nodeName=node-1")
        );
        assert_eq!(w.query.get("timeoutSeconds").map(String::as_str), Some("5"));
    }
    assert_eq!(w1.rv(), Some("100"));
    assert_eq!(w2.rv(), Some("150"));
    for r in &reqs {
        assert_eq!(
            r.authorization.as_deref(),
            Some(&*format!("Bearer {TOKEN}")),
            "{r:?}"
        );
    }
    a.agent.shutdown();
}

#[test]
fn a_410_in_the_watch_lists_afresh_and_drops_pods_that_went_away() {
    let api = FakeApi::start(script(
        vec![
            pod_list(
                "100",
                vec![
                    pod("a", "u-a", "90", "Running", be()),
                    pod("b", "u-b", "91", "Running", be()),
                ],
            ),
            pod_list("300", vec![pod("b", "u-b", "91", "Running", be())]),
        ],
        vec![end(vec![gone_event("100")])],
    ));
    let a = start(&api);
    wait_until(5, "the re-list's view", || {
        let r = api.pod_requests();
        r.len() >= 4 && names(&a.agent) == ["b"]
    });
    let r = api.pod_requests();
    let kinds: Vec<(bool, Option<&str>)> =
        r.iter().take(4).map(|q| (q.is_watch(), q.rv())).collect();
    assert_eq!(
        kinds,
        [
            (false, Some("0")),
            (true, Some("100")),
            (false, Some("0")),
            (true, Some("300"))
        ]
    );
    assert!(a.agent.view().api_reachable, "410 is not an outage");
}

#[test]
fn a_watch_answered_with_http_410_also_lists_afresh() {
    let api = FakeApi::start(script(
        vec![
            pod_list("100", vec![pod("a", "u-a", "90", "Running", be())]),
            pod_list("200", vec![pod("c", "u-c", "95", "Running", be())]),
        ],
        vec![status_reply(
            410,
            "Expired",
            "too old resource version: 100 (180)",
            None,
        )],
    ));
    let a = start(&api);
    wait_until(5, "the re-list after HTTP 410", || names(&a.agent) == ["c"]);
    let r = api.pod_requests();
    let kinds: Vec<(bool, Option<&str>)> =
        r.iter().take(4).map(|q| (q.is_watch(), q.rv())).collect();
    assert_eq!(
        kinds[..3],
        [(false, Some("0")), (true, Some("100")), (false, Some("0"))]
    );
    wait_until(5, "a watch from the new list", || {
        api.pod_requests()
            .iter()
            .any(|q| q.is_watch() && q.rv() == Some("200"))
    });
}

#[test]
fn throttling_and_server_errors_back_off_honouring_retry_after() {
    let api = FakeApi::start(script(
        vec![
            status_reply(
                429,
                "TooManyRequests",
                "Too many requests, please try again later.",
                Some(1),
            ),
            status_reply(
                500,
                "InternalError",
                "Internal error occurred: etcdserver: request timed out",
                None,
            ),
            pod_list("100", vec![pod("a", "u-a", "90", "Running", be())]),
        ],
        vec![],
    ));
    let a = start(&api);
    // While failing, the view says so.
    wait_until(3, "the 429 in the view", || {
        let v = a.agent.view();
        !v.api_reachable
            && v.last_error
                .as_deref()
                .is_some_and(|e| e.contains("Too many requests"))
    });
    assert!(!a.agent.view().synced);
    wait_until(5, "the view after the errors", || names(&a.agent) == ["a"]);
    let v = a.agent.view();
    assert!(v.api_reachable && v.last_error.is_none());
    let lists: Vec<_> = api
        .pod_requests()
        .into_iter()
        .filter(|r| r.is_pod_list())
        .collect();
    assert_eq!(lists.len(), 3);
    let after_429 = lists[1].at - lists[0].at;
    let after_500 = lists[2].at - lists[1].at;
    assert!(
        after_429 >= Duration::from_millis(990),
        "Retry-After: 1 honoured, got {after_429:?}"
    );
    // The 500 backs off by the configured back-off (20..100 ms with jitter), not a second.
    assert!(
        after_500 >= Duration::from_millis(10) && after_500 < Duration::from_millis(900),
        "{after_500:?}"
    );
}

#[test]
fn the_view_survives_an_unreachable_server() {
    let mut api = FakeApi::start(script(
        vec![pod_list(
            "100",
            vec![pod("web", "u-web", "90", "Running", lc("5"))],
        )],
        vec![],
    ));
    let a = start(&api);
    wait_until(5, "synced", || a.agent.view().synced);
    let before = a.agent.view();
    api.stop();
    wait_until(5, "unreachable", || !a.agent.view().api_reachable);
    let after = a.agent.view();
    assert_eq!(after.pods, before.pods, "the last view is kept");
    assert_eq!(after.generation, before.generation);
    assert!(after.last_error.is_some());
    // Still there after more failed tries.
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(a.agent.view().pods, before.pods);
}

#[test]
fn pods_that_are_deleted_or_terminating_leave_the_view() {
    let mut terminating = pod("b", "u-b", "102", "Running", be());
    terminating["metadata"]["deletionTimestamp"] = json!("2026-11-30T11:00:00Z");
    let api = FakeApi::start(script(
        vec![pod_list(
            "100",
            vec![
                pod("a", "u-a", "90", "Running", be()),
                pod("b", "u-b", "91", "Running", be()),
                pod("c", "u-c", "92", "Running", lc("1")),
            ],
        )],
        vec![Reply::Watch {
            events: vec![
                watch_event("DELETED", pod("a", "u-a", "101", "Running", be())),
                watch_event("MODIFIED", terminating),
                watch_event("MODIFIED", pod("c", "u-c", "103", "Succeeded", lc("1"))),
            ],
            hold: Some(Duration::from_secs(30)),
        }],
    ));
    let a = start(&api);
    wait_until(5, "synced", || a.agent.view().synced);
    wait_until(5, "all gone", || a.agent.view().pods.is_empty());
    assert!(a.agent.view().generation >= 2);
}

#[test]
fn a_bad_annotation_yields_one_warning_event_and_no_crash() {
    let bad = json!({"cohabit.io/class": "latency-critical", "cohabit.io/p99-target-ms": "fast"});
    let api = FakeApi::start(script(
        vec![pod_list(
            "100",
            vec![pod("bad", "u-bad", "90", "Running", bad.clone())],
        )],
        vec![Reply::Watch {
            events: vec![
                watch_event("MODIFIED", pod("bad", "u-bad", "101", "Running", bad)),
                watch_event("ADDED", pod("good", "u-good", "102", "Running", be())),
            ],
            hold: Some(Duration::from_secs(30)),
        }],
    ));
    let a = start(&api);
    wait_until(5, "the good pod after the bad one", || {
        names(&a.agent) == ["good"]
    });
    wait_until(5, "the Event", || !api.event_posts().is_empty());
    std::thread::sleep(Duration::from_millis(200));
    let posts = api.event_posts();
    assert_eq!(posts.len(), 1, "seen twice, posted once: {posts:#?}");
    let p = &posts[0];
    assert_eq!(p.path, "/api/v1/namespaces/shop/events");
    assert_eq!(
        p.authorization.as_deref(),
        Some(&*format!("Bearer {TOKEN}"))
    );
    let ev: Value = serde_json::from_str(&p.body).unwrap();
    assert_eq!(ev["kind"], "Event");
    assert_eq!(ev["type"], "Warning");
    assert_eq!(ev["reason"], "InvalidCohabitAnnotation");
    assert_eq!(
        ev["involvedObject"],
        json!({"apiVersion": "v1", "kind": "Pod", "name": "bad", "namespace": "shop", "uid": "u-bad"})
    );
    let msg = ev["message"].as_str().unwrap();
    assert!(
        msg.contains("cohabit.io/p99-target-ms") && msg.contains("fast"),
        "{msg}"
    );
    assert_eq!(ev["source"]["host"], "node-1");
}

#[test]
fn warn_posts_once_per_pod_and_reason() {
    let api = FakeApi::start(script(vec![pod_list("100", vec![])], vec![]));
    let a = start(&api);
    wait_until(5, "synced", || a.agent.view().synced);
    let key = PodKey {
        namespace: "ml".into(),
        name: "trainer".into(),
        uid: "u-t".into(),
    };
    a.agent
        .warn(&key, "CgroupNotFound", "no cgroup for pod u-t");
    a.agent
        .warn(&key, "CgroupNotFound", "no cgroup for pod u-t (again)");
    a.agent
        .warn(&key, "ExclusiveCpus", "pod has exclusive CPUs");
    wait_until(5, "two Events", || api.event_posts().len() >= 2);
    std::thread::sleep(Duration::from_millis(200));
    let posts = api.event_posts();
    assert_eq!(posts.len(), 2);
    // Each Event is posted on its own, so they may reach the API server in either order.
    let mut reasons: Vec<String> = posts
        .iter()
        .map(|p| {
            serde_json::from_str::<Value>(&p.body).unwrap()["reason"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    reasons.sort();
    assert_eq!(reasons, ["CgroupNotFound", "ExclusiveCpus"]);
    assert!(posts
        .iter()
        .all(|p| p.path == "/api/v1/namespaces/ml/events"));
}

#[test]
fn start_refuses_unusable_configs_without_touching_the_network() {
    let url = ApiAccess::Url {
        url: "http://127.0.0.1:9".into(),
        token_file: None,
        ca_file: None,
        insecure_http: false,
    };
    let e = NodeAgent::start(NodeAgentConfig::new(" ", url.clone())).unwrap_err();
    assert!(
        matches!(e, KubeError::Config(_)) && e.to_string().contains("node_name"),
        "{e}"
    );
    let mut cfg = NodeAgentConfig::new("n", url);
    cfg.annotation_prefix = "cohabit.io/".into();
    assert!(matches!(NodeAgent::start(cfg), Err(KubeError::Config(_))));
    let bad = ApiAccess::Url {
        url: "localhost".into(),
        token_file: None,
        ca_file: None,
        insecure_http: false,
    };
    assert!(matches!(
        NodeAgent::start(NodeAgentConfig::new("n", bad)),
        Err(KubeError::Config(_))
    ));
}

#[test]
fn in_cluster_without_service_account_is_a_clear_error() {
    if std::path::Path::new("/var/run/secrets/kubernetes.io/serviceaccount/token").exists() {
        cohabit_testkit::skip(
            cohabit_testkit::Need::Machine,
            "this machine has a service-account token",
        );
        return;
    }
    let e = NodeAgent::start(NodeAgentConfig::new("n", ApiAccess::InCluster)).unwrap_err();
    assert!(matches!(e, KubeError::InCluster(_)), "{e}");
}

#[test]
fn start_and_shutdown_work_from_inside_a_tokio_runtime() {
    // The daemon starts the agent from its own (current-thread) runtime.
    let api = FakeApi::start(script(
        vec![pod_list("1", vec![pod("a", "u-a", "1", "Running", be())])],
        vec![],
    ));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let a = rt.block_on(async { start(&api) });
    wait_until(5, "synced", || names(&a.agent) == ["a"]);
    rt.block_on(async move { a.agent.shutdown() });
}

#[test]
fn an_annotation_warning_comes_again_only_after_the_pod_was_fixed() {
    let bad = json!({"cohabit.io/class": "gold"});
    let api = FakeApi::start(script(
        vec![pod_list(
            "100",
            vec![pod("x", "u-x", "90", "Running", bad.clone())],
        )],
        vec![Reply::Watch {
            events: vec![
                watch_event("MODIFIED", pod("x", "u-x", "101", "Running", bad.clone())),
                watch_event("MODIFIED", pod("x", "u-x", "102", "Running", be())),
                watch_event("MODIFIED", pod("x", "u-x", "103", "Running", bad)),
            ],
            hold: Some(Duration::from_secs(30)),
        }],
    ));
    let a = start(&api);
    wait_until(5, "two Events", || api.event_posts().len() >= 2);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        api.event_posts().len(),
        2,
        "bad, bad again (no Event), fixed, bad: two Events"
    );
    assert!(a.agent.view().pods.is_empty());
}

#[test]
fn a_daemon_warning_is_not_repeated_when_the_pod_changes() {
    let api = FakeApi::start(script(
        vec![pod_list(
            "100",
            vec![pod("a", "u-a", "90", "Running", be())],
        )],
        vec![Reply::Watch {
            events: vec![],
            hold: Some(Duration::from_millis(300)),
        }],
    ));
    let a = start(&api);
    wait_until(5, "synced", || names(&a.agent) == ["a"]);
    let key = a.agent.view().pods[0].key.clone();
    a.agent.warn(&key, "CgroupNotFound", "no cgroup");
    api.push_watch(Reply::Watch {
        events: vec![watch_event(
            "MODIFIED",
            pod("a", "u-a", "101", "Running", be()),
        )],
        hold: Some(Duration::from_secs(30)),
    });
    wait_until(5, "the second watch", || {
        api.pod_requests().iter().filter(|r| r.is_watch()).count() >= 2
    });
    std::thread::sleep(Duration::from_millis(200));
    a.agent.warn(&key, "CgroupNotFound", "no cgroup");
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(api.event_posts().len(), 1);
}

#[test]
fn repeated_failures_back_off_longer_each_time() {
    let err = || status_reply(500, "InternalError", "Internal error occurred", None);
    let api = FakeApi::start(script(
        vec![err(), err(), err(), err(), err(), pod_list("100", vec![])],
        vec![],
    ));
    let a = start(&api);
    wait_until(5, "synced", || a.agent.view().synced);
    let at: Vec<_> = api
        .pod_requests()
        .iter()
        .filter(|r| r.is_pod_list())
        .map(|r| r.at)
        .collect();
    assert_eq!(at.len(), 6);
    let gaps: Vec<Duration> = at.windows(2).map(|w| w[1] - w[0]).collect();
    // Back-off 20 ms doubling to 100 ms, each drawn in [d/2, d]: 10-20, 20-40, 40-80, 50-100, 50-100.
    assert!(
        gaps[3] >= Duration::from_millis(45) && gaps[4] >= Duration::from_millis(45),
        "{gaps:?}"
    );
    assert!(a.agent.view().api_reachable);
}

#[test]
fn a_watch_that_reconnects_quietly_marks_the_server_reachable_again() {
    let api = FakeApi::start(script(
        vec![pod_list(
            "100",
            vec![pod("a", "u-a", "90", "Running", be())],
        )],
        vec![status_reply(
            503,
            "ServiceUnavailable",
            "the server is shutting down",
            None,
        )],
    ));
    let a = start(&api);
    wait_until(5, "the failed watch in the view", || {
        a.agent
            .view()
            .last_error
            .as_deref()
            .is_some_and(|e| e.contains("shutting down"))
    });
    assert!(!a.agent.view().api_reachable);
    // The next watch is established and stays silent: reachable again after the settle time
    // (connect time-out 1 s + 1 s), with the pods unchanged.
    wait_until(5, "reachable again", || a.agent.view().api_reachable);
    assert_eq!(names(&a.agent), ["a"]);
    let watches: Vec<_> = api
        .pod_requests()
        .into_iter()
        .filter(|r| r.is_watch())
        .collect();
    assert!(
        watches.len() >= 2 && watches.iter().all(|w| w.rv() == Some("100")),
        "{watches:#?}"
    );
}

#[test]
fn a_server_that_accepts_and_then_says_nothing_is_dropped_and_listed_afresh() {
    // The first watch is accepted and never answered; a working server ends each watch at
    // timeoutSeconds (1 s here), so after 1 s + 0.5 s of silence the agent gives up on it.
    let healthy = || Reply::Watch {
        events: vec![bookmark("200")],
        hold: Some(Duration::from_millis(900)),
    };
    let mut watches = vec![Reply::Hang(Duration::from_secs(60))];
    watches.extend((0..20).map(|_| healthy()));
    let api = FakeApi::start(script(
        vec![
            pod_list("100", vec![pod("a", "u-a", "90", "Running", be())]),
            pod_list(
                "200",
                vec![
                    pod("a", "u-a", "90", "Running", be()),
                    pod("b", "u-b", "95", "Running", be()),
                ],
            ),
        ],
        watches,
    ));
    let a = start_with(
        &api,
        AgentTiming {
            backoff_initial: Duration::from_millis(20),
            backoff_max: Duration::from_millis(100),
            watch_timeout_s: 1,
            connect_timeout: Duration::from_secs(1),
            idle_slack: Duration::from_millis(500),
        },
    );
    wait_until(5, "synced", || names(&a.agent) == ["a"]);
    let t0 = std::time::Instant::now();
    wait_until(5, "the silence in the view", || {
        let v = a.agent.view();
        !v.api_reachable
            && v.last_error
                .as_deref()
                .is_some_and(|e| e.contains("sent nothing"))
    });
    assert!(
        t0.elapsed() >= Duration::from_millis(1000),
        "not before the watch's timeoutSeconds: {:?}",
        t0.elapsed()
    );
    assert_eq!(names(&a.agent), ["a"], "the last view is kept meanwhile");
    wait_until(5, "the fresh list's view", || names(&a.agent) == ["a", "b"]);
    let v = a.agent.view();
    assert!(v.api_reachable && v.last_error.is_none(), "{v:?}");
    // The view comes from the fresh list; the watch that follows it may reach the fake
    // server a little later on a loaded machine.
    wait_until(5, "the watch after the fresh list", || {
        api.pod_requests().len() >= 4
    });
    let kinds: Vec<(bool, Option<String>)> = api
        .pod_requests()
        .iter()
        .take(4)
        .map(|q| (q.is_watch(), q.rv().map(str::to_string)))
        .collect();
    let s = |v: &str| Some(v.to_string());
    assert_eq!(
        kinds,
        [
            (false, s("0")),
            (true, s("100")),
            (false, s("0")),
            (true, s("200"))
        ],
        "a fresh list, not a retried watch"
    );
    // A working server's quiet watches (ended at timeoutSeconds) are never taken for hung.
    std::thread::sleep(Duration::from_secs(3));
    let v = a.agent.view();
    assert!(v.api_reachable, "{v:?}");
    assert_eq!(
        api.pod_requests()
            .iter()
            .filter(|q| q.is_pod_list())
            .count(),
        2
    );
    a.agent.shutdown();
}
