//! The whole file: the example parses, and the top-level keys.

use std::path::{Path, PathBuf};

use cohabit_policy::PolicyKind;

use super::*;

const EXAMPLE: &str = include_str!("../../../../examples/cohabit.toml");

#[test]
fn the_example_config_in_the_repo_parses() {
    let c = DaemonConfig::parse(EXAMPLE, "examples/cohabit.toml").unwrap();
    assert_eq!(c.policy, PolicyKind::Parties);
    assert!(c.services.iter().any(|s| s.p99_target_ms.is_some()));
    assert!(c.services.iter().any(|s| s.p99_target_ms.is_none()));
    assert!(c
        .services
        .iter()
        .any(|s| matches!(s.latency, Some(LatencySource::Probe { .. }))));
}

#[test]
fn the_commented_latency_sources_in_the_example_parse_too() {
    let active = EXAMPLE
        .lines()
        .find(|l| l.starts_with("latency = { probe"))
        .unwrap();
    let alternatives: Vec<&str> = EXAMPLE
        .lines()
        .filter_map(|l| l.strip_prefix("# latency = "))
        .collect();
    assert_eq!(alternatives.len(), 2, "{alternatives:?}");
    for alt in alternatives {
        let text = EXAMPLE.replace(active, &format!("latency = {alt}"));
        let c = DaemonConfig::parse(&text, "examples/cohabit.toml").unwrap();
        assert!(matches!(
            c.services[0].latency,
            Some(LatencySource::Push { .. })
        ));
    }
}

pub(super) fn err(text: &str) -> String {
    DaemonConfig::parse(text, "t.toml").unwrap_err().to_string()
}

pub(super) const MIN: &str = "[[service]]\nname = \"kv\"\np99_target_ms = 1\nmatch = { process_name = \"kv\" }\nlatency = { push = \"127.0.0.1:9400\", unauthenticated = true }\n";

/// The kind of a [`Problem`], without its details.
fn kind(p: &Problem) -> &'static str {
    match p {
        Problem::Unreadable(_) => "unreadable",
        Problem::UnknownKey { .. } => "unknown key",
        Problem::WrongType(_) => "wrong type",
        Problem::Missing(_) => "missing",
        Problem::OutOfRange { .. } => "out of range",
        Problem::Conflict(_) => "conflict",
        Problem::Invalid(_) => "invalid",
    }
}

/// Bad configurations: (config, the field named, the kind of problem, words the message
/// must carry).
fn bad_configs() -> Vec<(String, &'static str, &'static str, &'static str)> {
    let gpu_restart = "gpu = { env_file = \"/run/x.env\", restart = \"\" }\n";
    let gpu_index = "gpu = { env_file = \"/run/x.env\", restart = \"true\", index = -1 }\n";
    vec![
        (
            format!("speed = 3\n{MIN}"),
            "speed",
            "unknown key",
            "interval_ms",
        ),
        (
            MIN.replace("p99_target_ms = 1", "p99_target_ms = 0"),
            "service[0].p99_target_ms",
            "invalid",
            "positive",
        ),
        (
            MIN.replace("{ process_name = \"kv\" }", "{}"),
            "service[0].match",
            "missing",
            "needs one",
        ),
        (
            MIN.replace(
                "{ process_name = \"kv\" }",
                "{ process_name = \"kv\", pid_file = \"/x\" }",
            ),
            "service[0].match",
            "conflict",
            "exactly one",
        ),
        (
            MIN.replace("127.0.0.1:9400", "10.0.0.1:9400"),
            "service[0].latency.push",
            "invalid",
            "loopback",
        ),
        (
            MIN.replace(
                "{ push = \"127.0.0.1:9400\", unauthenticated = true }",
                "{ prometheus = \"http://x/m\" }",
            ),
            "service[0].latency.metric",
            "missing",
            "prometheus",
        ),
        (
            format!("policy = \"oracle\"\n{MIN}"),
            "policy",
            "invalid",
            "ground truth",
        ),
        (
            format!("policy = \"ml\"\n{MIN}"),
            "model",
            "missing",
            "needs model",
        ),
        (
            format!("[host]\ncpus = \"3-1\"\n{MIN}"),
            "host.cpus",
            "wrong type",
            "3-1",
        ),
        (
            MIN.replace("name = \"kv\"", "name = \"../kv\""),
            "service[0].name",
            "invalid",
            "[A-Za-z0-9._-]",
        ),
        (
            format!("{MIN}{gpu_restart}"),
            "service[0].gpu.restart",
            "invalid",
            "restarts",
        ),
        (
            format!("{MIN}{gpu_index}"),
            "service[0].gpu.index",
            "out of range",
            "at least 0",
        ),
        (
            "interval_ms = 5\n".to_string(),
            "interval_ms",
            "out of range",
            "between 10",
        ),
        (
            format!("metrics_addr = \"localhost\"\n{MIN}"),
            "metrics_addr",
            "wrong type",
            "localhost",
        ),
        (
            String::new(),
            "service",
            "missing",
            "at least one [[service]]",
        ),
    ]
}

#[test]
fn bad_configs_name_what_is_wrong() {
    for (text, field, problem, words) in bad_configs() {
        let e = typed(&text);
        assert_eq!(
            (e.field.as_str(), kind(&e.problem)),
            (field, problem),
            "{e}"
        );
        assert!(e.to_string().contains(words), "{e}");
    }
}

#[test]
fn good_configs_read_as_written() {
    DaemonConfig::parse(MIN, "t.toml").unwrap();
    let ml = DaemonConfig::parse(
        &format!("policy = \"ml\"\nmodel = \"/etc/cohabit/qos.json\"\n{MIN}"),
        "t.toml",
    )
    .unwrap();
    assert_eq!(ml.policy, PolicyKind::Ml);
    assert_eq!(
        ml.model.as_deref(),
        Some(Path::new("/etc/cohabit/qos.json"))
    );
    let off = DaemonConfig::parse(&format!("metrics_addr = \"\"\n{MIN}"), "t.toml").unwrap();
    assert_eq!(off.metrics_addr, None);
    let default = DaemonConfig::parse(MIN, "t.toml").unwrap();
    assert!(
        default.metrics_addr.unwrap().ip().is_loopback(),
        "loopback by default"
    );
}

#[test]
fn a_metrics_address_off_loopback_needs_metrics_public() {
    for addr in ["0.0.0.0:9464", "10.0.0.1:9464", "[::]:9464"] {
        let text = format!("metrics_addr = \"{addr}\"\n{MIN}");
        let e = err(&text);
        assert!(
            e.contains("metrics_addr") && e.contains("metrics_public = true"),
            "{e}"
        );
        let public =
            DaemonConfig::parse(&format!("metrics_public = true\n{text}"), "t.toml").unwrap();
        assert_eq!(public.metrics_addr, Some(addr.parse().unwrap()));
    }
    let v6 = DaemonConfig::parse(&format!("metrics_addr = \"[::1]:9464\"\n{MIN}"), "t.toml");
    assert!(v6.is_ok(), "::1 is loopback");
}

#[test]
fn the_latency_window_defaults_to_three_intervals_and_is_checked() {
    assert_eq!(
        DaemonConfig::parse(MIN, "t.toml").unwrap().latency_window,
        3
    );
    for n in [1, 60] {
        let c = DaemonConfig::parse(&format!("latency_window = {n}\n{MIN}"), "t.toml");
        assert_eq!(c.unwrap().latency_window, n);
    }
    for n in [0, 61, -1] {
        let e = err(&format!("latency_window = {n}\n{MIN}"));
        assert!(
            e.contains("latency_window must be between 1 and 60")
                && e.contains(&format!("got {n}")),
            "{e}"
        );
    }
}

#[test]
fn the_state_directory_and_the_fail_safe_have_defaults_and_are_checked() {
    let c = DaemonConfig::parse(MIN, "t.toml").unwrap();
    assert_eq!(c.state_dir, PathBuf::from("/run/cohabit"));
    assert_eq!(c.fail_safe_after_ticks, 20);
    let c = DaemonConfig::parse(
        &format!("fail_safe_after_ticks = 5\n[paths]\nstate_dir = \"/var/lib/cohabit\"\n{MIN}"),
        "t.toml",
    )
    .unwrap();
    assert_eq!(c.state_dir, PathBuf::from("/var/lib/cohabit"));
    assert_eq!(c.fail_safe_after_ticks, 5);
    let e = err(&format!("[paths]\nstate_dir = \"run/cohabit\"\n{MIN}"));
    assert!(
        e.contains("paths.state_dir must be an absolute path"),
        "{e}"
    );
    let e = err(&format!("fail_safe_after_ticks = 0\n{MIN}"));
    assert!(e.contains("fail_safe_after_ticks"), "{e}");
}

/// The error of parsing `text` (with `NODE_NAME=node-7`), as a value.
fn typed(text: &str) -> ConfigError {
    let node = |k: &str| (k == "NODE_NAME").then(|| "node-7".to_string());
    DaemonConfig::parse_with_env(text, "t.toml", &node).unwrap_err()
}

/// `MIN` and a second service, web, whose `extra` keys follow its latency.
fn two_services(extra: &str) -> String {
    format!("{MIN}[[service]]\nname = \"web\"\np99_target_ms = 5\nmatch = {{ process_name = \"web\" }}\nlatency = {{ push = \"127.0.0.1:9401\", unauthenticated = true{extra} }}\n")
}

#[test]
fn a_value_out_of_range_in_a_service_is_named_by_its_path_and_bounds() {
    let e =
        typed(&two_services("").replace("p99_target_ms = 5", "p99_target_ms = 5\npriority = 5000"));
    assert_eq!(e.path, "t.toml");
    assert_eq!(e.field, "service[1].priority");
    assert_eq!(e.item.as_deref(), Some("web"));
    assert_eq!(
        e.problem,
        Problem::OutOfRange {
            min: -1000.0,
            max: 1000.0,
            got: 5000.0,
            note: "",
        }
    );
    // People read the service by name.
    assert_eq!(
        e.to_string(),
        "t.toml: service web: priority must be between -1000 and 1000, got 5000"
    );
}

#[test]
fn an_unknown_key_is_named_by_its_whole_path() {
    let e = typed(&two_services(", rate = 5"));
    assert_eq!(e.field, "service[1].latency.rate");
    assert_eq!(
        e.item.as_deref(),
        Some("web"),
        "named though serde refused it"
    );
    assert!(
        matches!(&e.problem, Problem::UnknownKey { expected } if expected.contains("`rate_hz`")),
        "{e:?}"
    );
    let e = typed(&format!("speed = 3\n{MIN}"));
    assert_eq!((e.field.as_str(), e.item.as_ref()), ("speed", None));
    assert!(matches!(e.problem, Problem::UnknownKey { .. }), "{e:?}");
    let e = typed(&format!(
        "{MIN}[[best_effort]]\nname = \"b\"\nmatch = {{ process_name = \"b\", pid = 3 }}\n"
    ));
    assert_eq!(e.field, "best_effort[0].match.pid");
    assert_eq!(
        e.to_string()
            .lines()
            .next()
            .unwrap()
            .split(", expected")
            .next()
            .unwrap(),
        "t.toml: best_effort b: match.pid: unknown field"
    );
}

#[test]
fn a_bad_latency_url_is_named_by_its_path() {
    let latency =
        |l: &str| two_services("").replace("push = \"127.0.0.1:9401\", unauthenticated = true", l);
    let e = typed(&latency(
        "prometheus = \"ftp://10.0.0.1/metrics\", metric = \"m\"",
    ));
    assert_eq!(e.field, "service[1].latency.prometheus");
    assert_eq!(
        e.problem,
        Problem::Invalid("\"ftp://10.0.0.1/metrics\" must be an http:// URL".into())
    );
    let e = typed(&latency("probe = \"gopher://10.0.0.1\""));
    assert_eq!(e.field, "service[1].latency.probe");
    assert!(matches!(e.problem, Problem::WrongType(_)), "{e:?}");
    let e = typed(&latency(
        "push = \"localhost:9400\", unauthenticated = true",
    ));
    assert_eq!(e.field, "service[1].latency.push");
    assert!(matches!(e.problem, Problem::WrongType(_)), "{e:?}");
}

#[test]
fn conflicting_kubernetes_settings_are_named_as_a_conflict() {
    let e = typed(
        "[kubernetes]\napi_url = \"http://10.0.0.1:8080\"\ntoken_file = \"/etc/cohabit/token\"\n",
    );
    assert_eq!(e.field, "kubernetes.api_url");
    assert!(
        matches!(&e.problem, Problem::Conflict(why) if why.contains("in clear")),
        "{e:?}"
    );
    let e = typed("[kubernetes]\ninsecure_http = true\n");
    assert_eq!(e.field, "kubernetes.insecure_http");
    assert!(matches!(e.problem, Problem::Conflict(_)), "{e:?}");
    let e = typed("[kubernetes]\nca_file = \"/etc/cohabit/ca.pem\"\n");
    assert_eq!(e.field, "kubernetes.ca_file");
    assert!(matches!(e.problem, Problem::Conflict(_)), "{e:?}");
}

#[test]
fn wrong_types_missing_keys_and_bad_toml_are_told_apart() {
    let e = typed(&format!("interval_ms = \"fast\"\n{MIN}"));
    assert_eq!(e.field, "interval_ms");
    assert!(
        matches!(&e.problem, Problem::WrongType(why) if why.contains("invalid type")),
        "{e:?}"
    );
    let e = typed(&MIN.replace("p99_target_ms = 1\n", ""));
    assert_eq!(
        (e.field.as_str(), e.item.as_deref()),
        ("service[0].p99_target_ms", Some("kv"))
    );
    assert_eq!(e.problem, Problem::Missing(String::new()));
    assert_eq!(
        e.to_string(),
        "t.toml: service kv: p99_target_ms is missing"
    );
    let e = typed("interval_ms = \n");
    assert_eq!((e.field.as_str(), e.path.as_str()), ("", "t.toml"));
    assert!(matches!(e.problem, Problem::Unreadable(_)), "{e:?}");
    let e = typed(&format!(
        "{MIN}[[best_effort]]\nname = \"kv\"\nmatch = {{ cgroup = \"/b\" }}\n"
    ));
    assert_eq!(e.field, "best_effort[0].name");
    assert_eq!(e.problem, Problem::Conflict("\"kv\" is used twice".into()));
}

#[test]
fn the_host_spec_carries_what_the_host_is_asked_to_manage() {
    let text = EXAMPLE.replacen("[host]\n", "[host]\nbest_effort_cpus = \"all\"\n", 1);
    let c = DaemonConfig::parse(&text, "examples/cohabit.toml").unwrap();
    let spec = c.host_spec();
    assert_eq!(spec.services, c.services);
    assert_eq!(spec.paths, c.paths);
    assert_eq!(spec.mps, c.mps);
    assert_eq!(spec.best_effort_cpus, BestEffortCpus::All);
    assert_eq!(
        (spec.collect_timeout_ms, spec.latency_window),
        (c.collect_timeout_ms, c.latency_window)
    );
    assert!(!spec.pods, "no [kubernetes]: no pods");
}
