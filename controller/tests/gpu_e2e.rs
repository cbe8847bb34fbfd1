//! `cohabit run` with GPU inference behind MPS, against a fake `nvidia-cuda-mps-control`
//! that reads commands on stdin like the real one. No GPU, driver or root needed: NVML is
//! reported absent, cgroups are pointed away, and the GPU count comes from the config.

use cohabit_host::testing::running;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

struct Kill(Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The configuration (written in `d`, its path returned) of a GPU service, llm, and a
/// best-effort GPU job, train, under `static`, behind the fake MPS control whose pipe
/// directory is `mps`, logging decisions to `log`: llm's restart hook records what it saw
/// in `d`, train's always fails.
fn published_share_config(d: &Path, mps: &Path, log: &Path) -> PathBuf {
    let fake = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../collectors/tests/fixtures/fake-mps-control");
    let cfg = d.join("gpu.toml");
    std::fs::write(
        &cfg,
        format!(
            r#"
interval_ms = 100
policy = "static"
log = "{log}"
metrics_addr = ""
[host]
cpus = "0-1"
gpus = 1
[paths]
cgroup = "/nonexistent-cgroup-root"
state_dir = "{d}/state"
[mps]
control = "{fake}"
pipe_dir = "{mps}"
pinned_mem_limit = "0=8G"
[[service]]
name = "llm"
p99_target_ms = 500
match = {{ pid_file = "{d}/llm.pid", user = {uid} }}
latency = {{ push = "127.0.0.1:0", unauthenticated = true }}
gpu = {{ index = 0, env_file = "{d}/llm.env", restart = "cp {d}/llm.env {d}/seen.env; env > {d}/hook.env; echo llm >> {d}/restarts.log", min_restart_interval_ms = 60000 }}
[[best_effort]]
name = "train"
match = {{ pid_file = "{d}/train.pid", user = {uid} }}
gpu = {{ index = 0, env_file = "{d}/train.env", restart = "echo refused >&2; exit 1", min_restart_interval_ms = 100 }}
"#,
            log = log.display(),
            fake = fake.display(),
            mps = mps.display(),
            d = d.display(),
            uid = nix::unistd::geteuid().as_raw(),
        ),
    )
    .unwrap();
    cfg
}

/// The decision records in the log at `log`.
fn records(log: &Path) -> Vec<cohabit_core::DecisionRecord> {
    let text = std::fs::read_to_string(log).unwrap();
    cohabit_core::DecisionLogReader::new(text.as_bytes())
        .collect::<Result<_, _>>()
        .unwrap()
}

/// The GPU share in effect for service `name` in record `r`.
fn effective(r: &cohabit_core::DecisionRecord, name: &str) -> Option<u8> {
    r.observation
        .services
        .iter()
        .find(|s| s.spec.name == name)
        .unwrap()
        .gpu_mps_effective_pct
}

#[test]
fn a_gpu_service_gets_its_share_published_and_applied_through_the_restart_hook() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let llm = Kill(Command::new("sleep").arg("60").spawn().unwrap());
    let train = Kill(Command::new("sleep").arg("60").spawn().unwrap());
    std::fs::write(d.join("llm.pid"), llm.0.id().to_string()).unwrap();
    std::fs::write(d.join("train.pid"), train.0.id().to_string()).unwrap();
    let mps = d.join("mps");
    std::fs::create_dir_all(&mps).unwrap();
    std::fs::write(mps.join("servers"), "4100\n").unwrap();
    std::fs::write(mps.join("clients.4100"), format!("{}\n", llm.0.id())).unwrap();
    std::fs::write(d.join("llm.env"), "MODEL=small\nOTHER=1\n").unwrap();
    let log = d.join("decisions.jsonl");
    let cfg = published_share_config(d, &mps, &log);
    let out = Command::new(env!("CARGO_BIN_EXE_cohabit"))
        .args(["run", "--config", cfg.to_str().unwrap(), "--ticks", "6"])
        .env("RUST_LOG", "info")
        .env("COHABIT_TEST_SECRET", "hunter2")
        .env("CUDA_VISIBLE_DEVICES", "0")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("no NVIDIA driver"),
        "one line about the missing driver:\n{stderr}"
    );
    assert!(stderr.contains("restart hook failed"), "{stderr}");

    // The share went to the dedicated MPS server and the client was restarted once.
    let commands = std::fs::read_to_string(mps.join("commands.log")).unwrap();
    assert!(
        commands
            .lines()
            .any(|l| l == "set_active_thread_percentage 4100 50"),
        "{commands}"
    );
    let restarts = std::fs::read_to_string(d.join("restarts.log")).unwrap();
    assert_eq!(
        restarts.lines().count(),
        1,
        "restarted once, not every tick"
    );
    // The client restarted with its share beside every other line of its file, and the hook
    // saw only PATH and CUDA_* (what the shell sets itself aside).
    assert_eq!(
        std::fs::read_to_string(d.join("seen.env")).unwrap(),
        "MODEL=small\nOTHER=1\nCUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50\nCUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8G\n"
    );
    let hook_env = std::fs::read_to_string(d.join("hook.env")).unwrap();
    let others: Vec<&str> = hook_env
        .lines()
        .filter_map(|l| l.split_once('=').map(|(k, _)| k))
        .filter(|k| !k.starts_with("CUDA_") && !["PWD", "SHLVL", "_", "OLDPWD"].contains(k))
        .collect();
    assert_eq!(others, ["PATH"], "{hook_env}");
    for var in [
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50",
        "CUDA_VISIBLE_DEVICES=0",
    ] {
        assert!(hook_env.lines().any(|l| l == var), "{var}: {hook_env}");
    }

    // The log shows published against effective: llm's share took effect, train's is pending.
    let records = records(&log);
    assert_eq!(records.len(), 6);
    // The hook runs off the tick: its share is pending until a later tick sees it done.
    let llm_effective: Vec<Option<u8>> = records.iter().map(|r| effective(r, "llm")).collect();
    let first = llm_effective.iter().position(Option::is_some).unwrap();
    assert!(
        llm_effective[..first].iter().all(Option::is_none)
            && llm_effective[first..].iter().all(|e| *e == Some(50)),
        "{llm_effective:?}"
    );
    for r in &records {
        assert_eq!(r.observation.current.services["llm"].gpu_mps_pct, Some(50));
        assert_eq!(
            r.observation.current.best_effort.gpu_mps_pct,
            Some(50),
            "published for training"
        );
        assert_eq!(
            effective(r, "train"),
            None,
            "not effective: its restart hook keeps failing"
        );
    }

    // On exit the environment files are as they were.
    assert_eq!(
        std::fs::read_to_string(d.join("llm.env")).unwrap(),
        "MODEL=small\nOTHER=1\n"
    );
    assert!(!d.join("train.env").exists());
}

/// Processes of group `pgid` still running after up to two seconds (zombies waiting for a
/// reaper do not count): SIGKILL is delivered asynchronously, and a killed process may show
/// its run state for a moment after `killpg` returns on a loaded machine.
fn live_members(pgid: u32) -> Vec<u32> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    loop {
        let left = running(pgid);
        if left.is_empty() || std::time::Instant::now() >= deadline {
            return left;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

#[test]
fn a_hanging_restart_hook_is_killed_with_its_group_and_never_stops_the_ticks() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let llm = Kill(Command::new("sleep").arg("60").spawn().unwrap());
    std::fs::write(d.join("llm.pid"), llm.0.id().to_string()).unwrap();
    let log = d.join("decisions.jsonl");
    let cfg = d.join("gpu.toml");
    std::fs::write(
        &cfg,
        format!(
            r#"
interval_ms = 100
policy = "static"
log = "{log}"
metrics_addr = ""
[host]
cpus = "0-1"
gpus = 1
[paths]
cgroup = "/nonexistent-cgroup-root"
state_dir = "{d}/state"
[mps]
control = "/nonexistent/nvidia-cuda-mps-control"
[[service]]
name = "llm"
p99_target_ms = 500
match = {{ pid_file = "{d}/llm.pid", user = {uid} }}
latency = {{ push = "127.0.0.1:0", unauthenticated = true }}
gpu = {{ index = 0, env_file = "{d}/llm.env", restart = "echo $$ >> {d}/pgids; sleep 3600", min_restart_interval_ms = 100, hook_timeout_ms = 500 }}
"#,
            log = log.display(),
            d = d.display(),
            uid = nix::unistd::geteuid().as_raw(),
        ),
    )
    .unwrap();
    let started = std::time::Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_cohabit"))
        .args(["run", "--config", cfg.to_str().unwrap(), "--ticks", "15"])
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let took = started.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    // 15 ticks of 100 ms, then shutdown waits at most about a second for the running hook.
    assert!(
        took < std::time::Duration::from_secs(6),
        "{took:?}\n{stderr}"
    );
    assert!(stderr.contains("restart hook timed out"), "{stderr}");

    let records = records(&log);
    // A hook held inside the tick would stop every tick after the first; a loaded test
    // machine may still skip one or two.
    assert!(
        records.len() >= 10,
        "{} of 15 ticks ran:\n{stderr}",
        records.len()
    );
    for r in &records {
        assert!(r.observation.current.services["llm"].gpu_mps_pct.is_some());
        let llm = &r.observation.services[0];
        assert_eq!(llm.gpu_mps_effective_pct, None, "the share stays pending");
    }
    let pgids = std::fs::read_to_string(d.join("pgids")).unwrap();
    assert!(
        pgids.lines().count() >= 2,
        "the hook ran again after its time-out: {pgids}"
    );
    for pgid in pgids.lines() {
        assert_eq!(
            live_members(pgid.parse().unwrap()),
            Vec::<u32>::new(),
            "group {pgid}"
        );
    }
    assert!(!d.join("llm.env").exists(), "restored on exit");
}

/// `cohabit run` with `ml` and the shipped GPU model as `gpu_model`: the start says which
/// GPU model is in force; a CPU artifact given as the GPU model stops the start, naming the
/// file, before the host is touched.
#[test]
fn ml_runs_with_the_gpu_model_it_names_and_refuses_a_cpu_artifact_in_its_place() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let llm = Kill(Command::new("sleep").arg("60").spawn().unwrap());
    std::fs::write(d.join("llm.pid"), llm.0.id().to_string()).unwrap();
    let models = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models");
    let cpu = models.join("default/qos-v1.json");
    let gpu = models.join("gpu/qos-gpu-v1.json");
    let run = |gpu_model: &std::path::Path| {
        let cfg = d.join("gpu.toml");
        std::fs::write(
            &cfg,
            format!(
                r#"
interval_ms = 100
policy = "ml"
model = "{cpu}"
gpu_model = "{gpu_model}"
metrics_addr = ""
[host]
cpus = "0-1"
gpus = 1
[paths]
cgroup = "/nonexistent-cgroup-root"
state_dir = "{d}/state"
[mps]
control = "/nonexistent/nvidia-cuda-mps-control"
[[service]]
name = "llm"
p99_target_ms = 500
match = {{ pid_file = "{d}/llm.pid", user = {uid} }}
latency = {{ push = "127.0.0.1:0", unauthenticated = true }}
gpu = {{ index = 0, env_file = "{d}/llm.env", restart = "true", min_restart_interval_ms = 60000 }}
"#,
                cpu = cpu.display(),
                gpu_model = gpu_model.display(),
                d = d.display(),
                uid = nix::unistd::geteuid().as_raw(),
            ),
        )
        .unwrap();
        Command::new(env!("CARGO_BIN_EXE_cohabit"))
            .args(["run", "--config", cfg.to_str().unwrap(), "--ticks", "3"])
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .output()
            .unwrap()
    };

    let out = run(&gpu);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let line = stderr
        .lines()
        .find(|l| l.contains("GPU model in force"))
        .unwrap_or_else(|| panic!("no line on the GPU model:\n{stderr}"));
    assert!(
        line.contains("qos-gpu-v1.json") && line.contains("schema=qos-gpu-v1"),
        "{line}"
    );

    // The CPU model where the GPU one belongs: refused, naming the file and the schemas.
    let out = run(&cpu);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("loading the GPU model (gpu_model) for policy ml")
            && stderr.contains("qos-v1.json")
            && stderr.contains("expected a model of feature schema qos-gpu-v1"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("cohabit running"),
        "stopped before the host was opened:\n{stderr}"
    );
    assert!(!d.join("llm.env").exists(), "no share published");
}
