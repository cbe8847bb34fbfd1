//! The benchmark end to end, short: `cohabit-realbench --quick` with the real services,
//! stress-ng and the real `cohabit run` daemon, then the host-trained model's path (explore,
//! train with `cohabit-train`, run `ml-host` with it), then an interrupted run, then a probe
//! that does not answer. Each checks that the host is left as it was: no process the
//! benchmark started, no cgroup of its own or of cohabit's.
//!
//! Needs root, writable cgroups and the Debian packages memcached, nginx-light and
//! stress-ng (`.ci/run` installs them); otherwise each test skips through `cohabit_testkit`'s
//! gate, which fails it where `.ci/run` declares root and those programs present. The
//! daemon is built from the workspace first (`REALBENCH_COHABIT` names another binary).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use cohabit_testkit::{skip, Need};

/// The tests share the host's cgroups and process names: one at a time.
static HOST: std::sync::Mutex<()> = std::sync::Mutex::new(());

const BENCH: &str = env!("CARGO_BIN_EXE_cohabit-realbench");

fn cgroups_writable() -> bool {
    let probe = ["/sys/fs/cgroup/cpuset", "/sys/fs/cgroup"]
        .iter()
        .map(|m| Path::new(m).join("cohabit-realbench-writable"))
        .find(|d| std::fs::create_dir(d).is_ok());
    match probe {
        Some(d) => {
            let _ = std::fs::remove_dir(d);
            true
        }
        None => false,
    }
}

/// Whether the benchmark can run here (root, writable cgroups, its programs, a host free of
/// another run); when not, the test skips through the gate and returns.
fn usable() -> bool {
    if !root_with_cgroups() {
        return false;
    }
    for (binary, package) in [
        ("memcached", "memcached"),
        ("nginx", "nginx-light"),
        ("stress-ng", "stress-ng"),
    ] {
        if cohabit_testkit::program(binary, &[binary], package).is_none() {
            return false;
        }
    }
    host_free()
}

/// Root and writable cgroups, or a skip.
fn root_with_cgroups() -> bool {
    if !cohabit_testkit::root_or_skip("the benchmark runs its processes in cgroups of its own") {
        return false;
    }
    if !cgroups_writable() {
        skip(Need::Root, "cgroups are not writable");
        return false;
    }
    true
}

/// No process, cgroup or state of another run on the host, or a skip: a busy host is a
/// failure where root tests are required, since a previous test left it so.
fn host_free() -> bool {
    let before = leftovers();
    if !before.is_empty() {
        skip(Need::Root, &format!("the host is busy with {before:?}"));
        return false;
    }
    true
}

/// The cohabit daemon, built now so it matches the sources (a no-op when up to date);
/// `REALBENCH_COHABIT=/path/to/cohabit` uses that binary instead.
fn cohabit_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("REALBENCH_COHABIT") {
        return PathBuf::from(p);
    }
    let bench = Path::new(BENCH);
    let profile_dir = bench.parent().expect("target/<profile>");
    let profile = profile_dir
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("debug");
    let target = profile_dir.parent().expect("target");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let profile_arg = match profile {
        "debug" => "dev",
        p => p,
    };
    let status = Command::new(cargo)
        .args([
            "build",
            "--quiet",
            "-p",
            "cohabit-controller",
            "--bin",
            "cohabit",
        ])
        .args(["--profile", profile_arg])
        .arg("--target-dir")
        .arg(target)
        .status()
        .expect("cargo runs");
    assert!(status.success(), "building the cohabit daemon");
    profile_dir.join("cohabit")
}

/// `cohabit-train`, built now like the daemon (it links libtorch: `LIBTORCH` must be set);
/// `REALBENCH_COHABIT_TRAIN` names another binary. `None` when it cannot be built here.
fn cohabit_train_binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("REALBENCH_COHABIT_TRAIN") {
        return Some(PathBuf::from(p));
    }
    std::env::var_os("LIBTORCH")?;
    let daemon = cohabit_binary();
    let profile_dir = daemon.parent().expect("target/<profile>");
    let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") | None => "dev".to_string(),
        Some(p) => p.to_string(),
    };
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(cargo)
        .args([
            "build",
            "--quiet",
            "-p",
            "cohabit-training",
            "--bin",
            "cohabit-train",
        ])
        .args(["--profile", &profile])
        .arg("--target-dir")
        .arg(profile_dir.parent().expect("target"))
        .status()
        .expect("cargo runs");
    assert!(status.success(), "building cohabit-train");
    Some(profile_dir.join("cohabit-train"))
}

/// Processes that would show the benchmark left something running.
fn leftovers() -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
        let zombie = stat
            .rfind(')')
            .is_some_and(|i| stat[i + 1..].trim_start().starts_with('Z'));
        let comm = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
        let comm = comm.trim();
        // A `cohabit` process is the benchmark's only when it is a daemon (`cohabit run`):
        // another `cohabit` on the host (a simulation someone runs beside the tests) is not.
        let daemon = || cohabit_realbench::sys::first_arg(pid).as_deref() == Some("run");
        let ours = comm.starts_with("rb-")
            || comm.starts_with("stress-ng")
            || (comm == "cohabit" && daemon());
        if ours && !zombie {
            out.push(format!("{comm} ({pid})"));
        }
    }
    if Path::new("/run/cohabit-realbench").exists() {
        out.push("/run/cohabit-realbench".into());
    }
    for m in cgroup_mounts() {
        for g in ["cohabit-realbench", "cohabit"] {
            if m.join(g).exists() {
                out.push(m.join(g).display().to_string());
            }
        }
    }
    out
}

fn cgroup_mounts() -> Vec<PathBuf> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            let fs = right.split_whitespace().next()?;
            matches!(fs, "cgroup" | "cgroup2")
                .then(|| PathBuf::from(left.split_whitespace().nth(4).unwrap_or("/")))
        })
        .collect()
}

fn lock() -> std::sync::MutexGuard<'static, ()> {
    HOST.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[test]
fn the_quick_benchmark_measures_every_run_and_leaves_the_host_as_it_was() {
    let _host = lock();
    if !usable() {
        return;
    }
    let cohabit = cohabit_binary();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let daemon_state = Path::new("/run/cohabit");
    let had_daemon_state = daemon_state.exists();
    // `--out` relative to the working directory, as in README's command (nginx once
    // failed to start on one).
    let run = Command::new(BENCH)
        .current_dir(dir.path())
        .args(["--quick", "--out", "out"])
        .arg("--cohabit")
        .arg(&cohabit)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "{stderr}\n{stdout}");
    assert!(stdout.contains("window p99"), "the table: {stdout}");
    assert_eq!(leftovers(), Vec::<String>::new(), "left behind");
    assert_eq!(
        daemon_state.exists(),
        had_daemon_state,
        "the daemon keeps its state in the run directory"
    );

    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("results.json")).unwrap()).unwrap();
    assert!(r["machine"]["cpus"].as_u64().unwrap() >= 1);
    let runs = r["runs"].as_array().unwrap();
    let kinds: Vec<(&str, &str)> = runs
        .iter()
        .map(|x| (x["kind"].as_str().unwrap(), x["policy"].as_str().unwrap()))
        .collect();
    assert_eq!(
        kinds,
        [
            ("services-alone", "none"),
            ("batch-alone", "none"),
            ("colocated", "none"),
            ("colocated", "parties")
        ]
    );
    let warmup = r["settings"]["warmup_s"].as_u64().unwrap();
    let duration = r["settings"]["duration_s"].as_u64().unwrap();
    for run in runs {
        let kind = run["kind"].as_str().unwrap();
        let services = run["services"].as_array().unwrap();
        if kind == "batch-alone" {
            assert!(services.is_empty());
        } else {
            let names: Vec<&str> = services
                .iter()
                .map(|s| s["service"].as_str().unwrap())
                .collect();
            assert_eq!(names, ["memcached", "nginx"]);
        }
        for s in services {
            let windows = s["windows"].as_array().unwrap();
            assert_eq!(windows.len() as u64, warmup + duration);
            let sum = &s["summary"];
            assert_eq!(sum["windows"].as_u64().unwrap(), duration);
            assert!(sum["met"].as_u64().unwrap() <= duration);
            let share = sum["met_share"].as_f64().unwrap();
            assert!((0.0..=1.0).contains(&share));
            // The client held its rate: every counted window has requests.
            let rate = s["rate_rps"].as_f64().unwrap();
            assert!(sum["achieved_rps"].as_f64().unwrap() > rate * 0.5, "{s}");
            for k in ["p50_ms", "p90_ms", "max_ms"] {
                assert!(sum["window_p99"][k].as_f64().unwrap() > 0.0, "{k}: {s}");
            }
        }
        let batch = run["batch"].as_array().unwrap();
        match kind {
            "services-alone" => assert!(batch.is_empty()),
            "batch-alone" => assert!(batch[0]["throughput"]["ops_per_s"].as_f64().unwrap() > 0.0),
            _ => assert!(batch[0]["relative"].as_f64().unwrap() > 0.0, "{run}"),
        }
        let policy = run["policy"].as_str().unwrap();
        if policy == "parties" {
            let c = &run["cohabit"];
            assert_eq!(c["restored"], true, "{c}");
            assert!(c["decisions"].as_u64().unwrap() >= 3, "{c}");
            let log = std::fs::read_to_string(c["log"].as_str().unwrap()).unwrap();
            assert!(log.lines().count() >= 3, "the decision log is kept");
            let config = std::fs::read_to_string(c["config"].as_str().unwrap()).unwrap();
            assert!(
                config.contains("probe = \"memcached://127.0.0.1:"),
                "{config}"
            );
        } else {
            assert!(run["cohabit"].is_null());
        }
    }
}

#[test]
fn a_short_explore_run_trains_a_host_model_that_ml_host_runs_with() {
    let _host = lock();
    if !usable() {
        return;
    }
    let cohabit = cohabit_binary();
    let Some(train) = cohabit_train_binary() else {
        skip(
            Need::Machine,
            "LIBTORCH is not set, so cohabit-train cannot be built",
        );
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    // One service, so that a 2-CPU host leaves the walk a core to move.
    let run = Command::new(BENCH)
        .args([
            "--quick",
            "--no-baselines",
            "--policies",
            "ml,ml-host",
            "--service",
            "memcached:2000:1",
            "--duration-s",
            "4",
            "--explore-s",
            "12",
            "--out",
        ])
        .arg(&out)
        .arg("--cohabit")
        .arg(&cohabit)
        .arg("--cohabit-train")
        .arg(&train)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "{stderr}\n{stdout}");
    assert_eq!(leftovers(), Vec::<String>::new(), "left behind");
    assert!(
        stdout.contains("ml-host met"),
        "the side-by-side table: {stdout}"
    );

    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("results.json")).unwrap()).unwrap();
    let runs = r["runs"].as_array().unwrap();
    let kinds: Vec<(&str, &str)> = runs
        .iter()
        .map(|x| (x["kind"].as_str().unwrap(), x["policy"].as_str().unwrap()))
        .collect();
    assert_eq!(
        kinds,
        [
            ("explore", "explore"),
            ("colocated", "ml"),
            ("colocated", "ml-host")
        ]
    );
    // The explore run's daemon explored (or said why not) and logged its decisions.
    let explore = &runs[0]["cohabit"];
    assert_eq!(explore["restored"], true, "{explore}");
    let said = std::fs::read_to_string(explore["output"].as_str().unwrap()).unwrap();
    assert!(
        said.contains("exploring around the policy's plans"),
        "{said}"
    );
    // The host model was trained from that log, from the built-in one, and loads.
    let hm = &r["host_model"];
    assert!(hm["rows"].as_u64().unwrap() > 0, "{hm}");
    let model_path = hm["model"]
        .as_str()
        .unwrap_or_else(|| panic!("no model: {hm}"));
    let model = cohabit_models::Model::load(Path::new(model_path)).unwrap();
    assert_eq!(model.meta.metrics["rows"], hm["rows"].as_f64().unwrap());
    // ml-host ran with it; ml with the built-in one.
    let host_cfg = std::fs::read_to_string(runs[2]["cohabit"]["config"].as_str().unwrap()).unwrap();
    assert!(host_cfg.contains(model_path), "{host_cfg}");
    let sim_cfg = std::fs::read_to_string(runs[1]["cohabit"]["config"].as_str().unwrap()).unwrap();
    assert!(!sim_cfg.contains("qos-host"), "{sim_cfg}");
    for run in &runs[1..] {
        let c = &run["cohabit"];
        assert_eq!(c["restored"], true, "{c}");
        assert!(c["decisions"].as_u64().unwrap() >= 3, "{c}");
    }
}

#[test]
fn an_interrupted_benchmark_stops_everything_it_started() {
    let _host = lock();
    if !usable() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (mut child, lines) = start_and_wait_for_the_daemon(dir.path());
    let status = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let t = Instant::now();
    let code = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s.code();
        }
        assert!(t.elapsed() < Duration::from_secs(60), "it stopped");
        std::thread::sleep(Duration::from_millis(100));
    };
    let rest: Vec<String> = lines.collect();
    assert_eq!(code, Some(130), "{rest:?}");
    assert!(rest.iter().any(|l| l.contains("interrupted")), "{rest:?}");
    assert_eq!(leftovers(), Vec::<String>::new(), "left behind");
}

/// Starts a short benchmark with `static` and returns it once the daemon has decided.
fn start_and_wait_for_the_daemon(
    out: &Path,
) -> (std::process::Child, impl Iterator<Item = String>) {
    let cohabit = cohabit_binary();
    let mut child = Command::new(BENCH)
        .args([
            "--quick",
            "--no-baselines",
            "--policies",
            "static",
            "--duration-s",
            "60",
            "--out",
        ])
        .arg(out)
        .arg("--cohabit")
        .arg(&cohabit)
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let mut lines = BufReader::new(stderr).lines().map_while(Result::ok);
    assert!(
        lines.next().is_some_and(|l| l.contains("run cpu-static")),
        "the run started"
    );
    let decisions = out.join("cpu-static/decisions.jsonl");
    let t = Instant::now();
    while std::fs::read_to_string(&decisions).map_or(0, |t| t.lines().count()) < 3 {
        assert!(t.elapsed() < Duration::from_secs(30), "the daemon decided");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(!leftovers().is_empty(), "things run");
    (child, lines)
}

#[test]
fn a_killed_benchmark_is_cleaned_up_by_the_cleanup_command() {
    let _host = lock();
    if !usable() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (mut child, _lines) = start_and_wait_for_the_daemon(dir.path());
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(!leftovers().is_empty(), "SIGKILL leaves things behind");
    let out = Command::new(BENCH).arg("cleanup").output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let t = Instant::now();
    while !leftovers().is_empty() && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(leftovers(), Vec::<String>::new(), "left behind");
}

#[test]
fn a_probe_that_does_not_answer_stops_the_daemon_before_it_changes_anything() {
    let _host = lock();
    if !cohabit_testkit::root_or_skip("the daemon runs as root") || !host_free() {
        return;
    }
    let cohabit = cohabit_binary();
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let config = dir.path().join("cohabit.toml");
    std::fs::write(
        &config,
        format!(
            "metrics_addr = \"\"\n[paths]\nstate_dir = \"{}\"\n[[service]]\nname = \"kv\"\np99_target_ms = 1\nmatch = {{ process_name = \"rb-none\", user = 0 }}\nlatency = {{ probe = \"memcached://127.0.0.1:{port}\", timeout_ms = 200 }}\n",
            dir.path().join("state").display()
        ),
    )
    .unwrap();
    let out = Command::new(&cohabit)
        .args(["run", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains(&format!("memcached://127.0.0.1:{port}"))
            && stderr.contains("does not answer"),
        "{stderr}"
    );
    assert_eq!(leftovers(), Vec::<String>::new(), "nothing was created");
}

#[test]
fn a_panic_while_processes_run_still_stops_them_and_removes_the_cgroups() {
    use cohabit_realbench::cgroups::Tree;
    use cohabit_realbench::procs::Lab;
    let _host = lock();
    if !root_with_cgroups() || !host_free() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("sleepers.log");
    let dir_path = dir.path().to_path_buf();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::<u32>::new()));
    let dirs = std::sync::Arc::new(std::sync::Mutex::new(Vec::<PathBuf>::new()));
    let (seen2, dirs2) = (seen.clone(), dirs.clone());
    let result = std::panic::catch_unwind(move || {
        let state = dir_path.join("state");
        let mut lab = Lab::open(Tree::detect(Path::new("/proc")).unwrap(), &state).unwrap();
        // A process with a child of its own, both in the group.
        let args = ["-c".to_string(), "sleep 600 & sleep 600".to_string()];
        lab.spawn("sleepers", "g", Path::new("/bin/sh"), &args, &[], &log)
            .unwrap();
        let t = Instant::now();
        while lab.tree().procs("g").len() < 2 && t.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(20));
        }
        *seen2.lock().unwrap() = lab.tree().procs("g");
        *dirs2.lock().unwrap() = lab.tree().dirs("g");
        // Unwind as a panic does, without the panic hook's message and backtrace.
        std::panic::resume_unwind(Box::new("something went wrong mid-run"));
    });
    assert!(result.is_err());
    let pids = seen.lock().unwrap().clone();
    assert!(pids.len() >= 2, "{pids:?}");
    for pid in pids {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let gone_or_zombie = stat.is_empty()
            || stat
                .rsplit(')')
                .next()
                .is_some_and(|r| r.trim_start().starts_with('Z'));
        assert!(gone_or_zombie, "{pid} still runs: {stat}");
    }
    for d in dirs.lock().unwrap().iter() {
        assert!(!d.exists(), "{} is still there", d.display());
        assert!(!d.parent().unwrap().exists(), "the parent is still there");
    }
}
