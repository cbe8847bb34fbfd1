//! The `cohabit` binary as a user runs it.

use std::process::{Command, Output};

fn cohabit(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cohabit"))
        .args(args)
        .output()
        .expect("cohabit runs")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn scenarios_lists_every_builtin_one() {
    let o = cohabit(&["scenarios"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    for name in [
        "demo",
        "parties-mix",
        "gpu-inference",
        "load-spike",
        "few-closids",
    ] {
        assert!(text.contains(name), "{name} missing from:\n{text}");
    }
    let o = cohabit(&["scenarios", "--models"]);
    let text = stdout(&o);
    assert!(
        text.contains("memcached") && text.contains("knee_rps") && text.contains("xeon-gold-6338"),
        "{text}"
    );
    let o = cohabit(&["scenarios", "--format", "json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    // 6 built-in scenarios and 3 crowded (overload) ones.
    assert_eq!(v.as_array().unwrap().len(), 9);
}

#[test]
fn compare_json_prints_one_record_per_policy_with_every_metric() {
    let o = cohabit(&["compare", "--scenario", "demo", "--format", "json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("stdout is JSON");
    let rows = v.as_array().unwrap();
    let policies: Vec<&str> = rows.iter().map(|r| r["policy"].as_str().unwrap()).collect();
    assert_eq!(policies, ["static", "parties", "clite", "ml", "oracle"]);
    for r in rows {
        assert_eq!(r["simulated"], true);
        assert_eq!(r["scenario"], "demo");
        for field in [
            "qos_met_fraction",
            "violation_severity_mean",
            "violation_severity_max",
            "convergence_intervals_p50",
            "convergence_intervals_max",
            "be_throughput",
            "be_throughput_vs_oracle",
            "actuations",
            "decision_us_p50",
            "decision_us_p99",
        ] {
            assert!(r.get(field).is_some(), "{field} missing in {r}");
        }
        let q = r["qos_met_fraction"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&q));
    }
    assert_eq!(rows[4]["be_throughput_vs_oracle"], 1.0);
}

#[test]
fn compare_table_says_it_is_a_simulation_and_honours_the_seed() {
    let a = cohabit(&[
        "compare",
        "--scenario",
        "demo",
        "--policies",
        "static",
        "--seed",
        "5",
    ]);
    assert!(a.status.success(), "{}", stderr(&a));
    let text = stdout(&a);
    assert!(text.starts_with("SIMULATION"), "{text}");
    assert!(text.contains("seed 5"));
    assert!(
        !text.contains("\noracle "),
        "oracle ran only as the reference:\n{text}"
    );
}

#[test]
fn simulate_writes_the_decision_log_and_summary() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let o = cohabit(&[
        "simulate",
        "--scenario",
        "demo",
        "--policy",
        "parties",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("SIMULATION"));
    let log = std::fs::read_to_string(out.join("decisions.jsonl")).unwrap();
    let lines: Vec<&str> = log.lines().collect();
    assert_eq!(lines.len(), 1 + 600, "a header, then a record per tick");
    let header: serde_json::Value = serde_json::from_str(lines[0]).unwrap();
    assert_eq!(header["cohabit_decision_log"], 2);
    assert_eq!(header["policy"], "parties");
    assert_eq!(header["simulated"], true);
    assert!(header["host"]["cores"].is_number());
    let first: serde_json::Value = serde_json::from_str(lines[1]).unwrap();
    assert_eq!(first["simulated"], true);
    assert_eq!(first["policy"], "parties");
    assert!(first["truth"]["p99_ms"]["memcached"].is_number());
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["intervals"], 600);
    assert!(summary["be_throughput_vs_oracle"].as_f64().unwrap() > 0.0);
}

#[test]
fn a_bad_scenario_file_fails_with_a_message_naming_the_problem() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.toml");
    std::fs::write(
        &path,
        "name = \"bad\"\nduration_s = 10\nturbo = true\n[host]\n[[service]]\nname = \"m\"\nmodel = \"memcached\"\nload = { kind = \"constant\", fraction = 0.1 }\n",
    )
    .unwrap();
    let o = cohabit(&["compare", "--scenario", path.to_str().unwrap()]);
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(err.contains("turbo") && err.contains("bad.toml"), "{err}");
}

#[test]
fn unknown_policies_and_scenarios_are_refused_with_the_choices() {
    let o = cohabit(&[
        "compare",
        "--scenario",
        "demo",
        "--policies",
        "static,magic",
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("parties"), "{}", stderr(&o));
    let o = cohabit(&["simulate", "--scenario", "nope", "--out", "/tmp/never"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("demo"), "{}", stderr(&o));
}

#[test]
fn bench_prints_each_chosen_scenario_and_policy_on_both_platforms_and_the_ml_checks() {
    // Three of the scenarios, for time (the whole bench takes minutes; README's results
    // come from it): a CPU one (on its own platform and the Gold), a GPU one (skipped on
    // the Gold, which has no GPU) and a crowded one (judged on decision time only).
    let o = cohabit(&[
        "bench",
        "--format",
        "json",
        "--scenarios",
        "crowded-gold,demo,gpu-inference",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("stdout is JSON");
    assert_eq!(v["simulated"], true);
    let platforms = v["platforms"].as_array().unwrap();
    let mut runs: Vec<(&str, &str, &str)> = platforms
        .iter()
        .flat_map(|p| {
            let name = p["platform"].as_str().unwrap();
            p["runs"].as_array().unwrap().iter().map(move |r| {
                (
                    name,
                    r["scenario"].as_str().unwrap(),
                    r["policy"].as_str().unwrap(),
                )
            })
        })
        .collect();
    runs.sort_unstable();
    let mut want = vec![];
    for (platform, scenario) in [
        ("xeon-e5-2697v4", "demo"),
        ("xeon-e5-2697v4-a100", "gpu-inference"),
        ("xeon-gold-6338", "crowded-gold"),
        ("xeon-gold-6338", "demo"),
    ] {
        for policy in ["clite", "ml", "oracle", "parties", "static"] {
            want.push((platform, scenario, policy));
        }
    }
    assert_eq!(runs, want);
    let gold = platforms
        .iter()
        .find(|p| p["platform"] == "xeon-gold-6338")
        .unwrap();
    assert!(gold["skipped"][0].as_str().unwrap().contains("needs a GPU"));
    let checks = v["checks"].as_array().unwrap();
    let judged = |platform: &str, scenario: &str| -> Vec<&str> {
        checks
            .iter()
            .filter(|c| c["platform"] == platform && c["scenario"] == scenario)
            .map(|c| c["target"].as_str().unwrap())
            .collect()
    };
    // A crowded scenario is judged on decision time only; the others on QoS, best effort
    // and actuations too (and convergence where parties converges).
    assert_eq!(
        judged("xeon-gold-6338", "crowded-gold"),
        ["dec_p99_us < 1000"]
    );
    for (platform, scenario) in [
        ("xeon-e5-2697v4", "demo"),
        ("xeon-e5-2697v4-a100", "gpu-inference"),
        ("xeon-gold-6338", "demo"),
    ] {
        let targets = judged(platform, scenario);
        for t in [
            "dec_p99_us < 1000",
            "qos_met >= 0.99",
            "qos_met >= parties",
            "actuations < parties",
        ] {
            assert!(targets.contains(&t), "{platform} {scenario}: {targets:?}");
        }
    }
    assert!(checks.iter().all(|c| c["met"].is_boolean()));
    // A name that is not a built-in scenario is refused, naming the ones that are.
    let o = cohabit(&["bench", "--scenarios", "demo,nope"]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("\"nope\"") && stderr(&o).contains("crowded-e5"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn simulate_on_another_platform_and_with_a_model_file() {
    let dir = tempfile::tempdir().unwrap();
    let model = concat!(env!("CARGO_MANIFEST_DIR"), "/../models/default/qos-v1.json");
    let o = cohabit(&[
        "simulate",
        "--scenario",
        "demo",
        "--policy",
        "ml",
        "--platform",
        "xeon-gold-6338",
        "--model",
        model,
        "--out",
        dir.path().to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("Xeon Gold 6338"), "{}", stdout(&o));
    let o = cohabit(&[
        "simulate",
        "--scenario",
        "gpu-inference",
        "--platform",
        "xeon-gold-6338",
        "--out",
        dir.path().to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("needs a GPU"), "{}", stderr(&o));
    let o = cohabit(&[
        "simulate",
        "--scenario",
        "demo",
        "--policy",
        "ml",
        "--model",
        "/nonexistent/model.json",
        "--out",
        dir.path().to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("/nonexistent/model.json"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn simulate_runs_ml_with_the_tunables_asked_for_and_refuses_them_without_ml() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().to_str().unwrap();
    let base = ["simulate", "--scenario", "demo", "--out", out];
    let refused = |args: &[&str], want: &str| {
        let o = cohabit(&[&base[..], args].concat());
        assert!(!o.status.success(), "{args:?}");
        assert!(stderr(&o).contains(want), "{}", stderr(&o));
    };
    // Refused beside another policy even at a default value: it would change nothing.
    refused(
        &["--policy", "parties", "--ml", "margin=0.9"],
        "--ml sets ml's tunables, but ml is not among the policies run",
    );
    refused(
        &["--policy", "ml", "--ml", "margin=1.5"],
        "ml.margin must be between 0.5 and 0.99, got 1.5",
    );
    let o = cohabit(
        &[
            &base[..],
            &[
                "--policy",
                "ml",
                "--ml",
                "margin=0.95",
                "--ml",
                "shrink_after=3",
            ],
        ]
        .concat(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("ml tunables moved from the defaults: margin 0.95, shrink_after 3"),
        "{}",
        stdout(&o)
    );
    // The decision log's header says what ran.
    let log = std::fs::read_to_string(dir.path().join("decisions.jsonl")).unwrap();
    let header: serde_json::Value = serde_json::from_str(log.lines().next().unwrap()).unwrap();
    assert_eq!(
        header["tunables"],
        serde_json::json!({ "margin": 0.95, "shrink_after": 3.0 })
    );
    // Without --ml nothing is said of them.
    let o = cohabit(&[&base[..], &["--policy", "ml"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!stdout(&o).contains("ml tunables"), "{}", stdout(&o));
    let log = std::fs::read_to_string(dir.path().join("decisions.jsonl")).unwrap();
    assert!(!log.lines().next().unwrap().contains("tunables"));
}

#[test]
fn man_page_and_completions_cover_every_subcommand() {
    let o = cohabit(&["man"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let page = stdout(&o);
    assert!(
        page.starts_with(".ie") || page.contains(".TH cohabit 1"),
        "{page}"
    );
    assert!(page.contains(".TH cohabit 1"), "{page}");
    for sub in ["simulate", "compare", "probe", "run", "completions"] {
        assert!(page.contains(sub), "the man page misses {sub}");
    }
    for (shell, marker) in [
        ("bash", "complete -F _cohabit"),
        ("zsh", "#compdef cohabit"),
        ("fish", "complete -c cohabit"),
    ] {
        let o = cohabit(&["completions", shell]);
        assert!(o.status.success(), "{shell}: {}", stderr(&o));
        let script = stdout(&o);
        assert!(
            script.contains(marker),
            "{shell} completion lacks {marker:?}"
        );
        // `run --config`: fish names long options without the dashes.
        assert!(
            script.contains("simulate") && script.contains("config"),
            "{shell}"
        );
    }
    let o = cohabit(&["completions", "tcsh"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("tcsh"), "{}", stderr(&o));
}

/// Issue 48, item 5: with `--format json`, stdout is the JSON document and nothing else,
/// for every command that has the option; status lines go to stderr.
#[test]
fn every_command_with_format_json_prints_only_the_json_document_on_stdout() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let runs = d.join("runs");
    let cfg = d.join("c.toml");
    std::fs::write(
        &cfg,
        format!(
            "interval_ms = 100\nmetrics_addr = \"\"\n[paths]\nstate_dir = \"{}\"\n[[service]]\nname = \"kv\"\np99_target_ms = 1\nmatch = {{ process_name = \"no-such-proc\", user = 0 }}\nlatency = {{ push = \"127.0.0.1:0\", unauthenticated = true }}\n",
            d.join("state").display()
        ),
    )
    .unwrap();
    let commands: [Vec<&str>; 5] = [
        vec!["scenarios", "--models"],
        vec![
            "compare",
            "--scenario",
            "demo",
            "--policies",
            "static",
            "--out",
            runs.to_str().unwrap(),
        ],
        vec!["bench", "--scenarios", "demo"],
        vec!["probe"],
        vec!["check", "--config", cfg.to_str().unwrap(), "--wait-ms", "0"],
    ];
    for args in commands {
        let mut args = args.clone();
        args.extend(["--format", "json"]);
        let o = cohabit(&args);
        assert!(o.status.success(), "{args:?}: {}", stderr(&o));
        let text = stdout(&o);
        let v: Result<serde_json::Value, _> = serde_json::from_str(&text);
        assert!(
            v.is_ok(),
            "{args:?}: stdout is not one JSON document ({v:?}):\n{text}"
        );
        if args[0] == "compare" {
            assert!(
                stderr(&o).contains("wrote the runs and summary.json under"),
                "the status line goes to stderr: {}",
                stderr(&o)
            );
        }
    }
}

/// The node agent is the cargo feature `kubernetes`: `--version` says whether this build
/// has it, and `check` of a `[kubernetes]` configuration names the feature as the reason
/// `run` would refuse exactly when it is missing.
#[test]
fn version_and_check_say_whether_the_node_agent_is_built_in() {
    let built_in = cfg!(feature = "kubernetes");
    let o = cohabit(&["--version"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        stdout(&o).contains("with the Kubernetes node agent"),
        built_in,
        "{}",
        stdout(&o)
    );
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("c.toml");
    std::fs::write(
        &cfg,
        format!(
            "metrics_addr = \"\"\n[paths]\nstate_dir = \"{}\"\n[kubernetes]\nnode_name = \"node-1\"\nkubelet_dir = \"{}\"\n",
            dir.path().join("state").display(),
            dir.path().display()
        ),
    )
    .unwrap();
    let args = ["check", "--config", cfg.to_str().unwrap(), "--wait-ms", "0"];
    let o = cohabit(&[&args[..], &["--format", "json"]].concat());
    let v: serde_json::Value = serde_json::from_str(&stdout(&o))
        .unwrap_or_else(|e| panic!("{e}: {} {}", stdout(&o), stderr(&o)));
    let refused = v["refusals"]
        .as_array()
        .unwrap()
        .iter()
        .any(|r| r.as_str().unwrap().contains("cargo feature `kubernetes`"));
    assert_eq!(refused, !built_in, "{v}");
    assert!(!dir.path().join("state").exists());
}
