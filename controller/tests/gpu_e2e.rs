//! `cohabit run` with GPU inference behind MPS, against a fake `nvidia-cuda-mps-control`
//! that reads commands on stdin like the real one. No GPU, driver or root needed: NVML is
//! reported absent, cgroups are pointed away, and the GPU count comes from the config.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

struct Kill(Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
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
    std::fs::write(d.join("llm.env"), "MODEL=small\n").unwrap();
    let fake = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../collectors/tests/fixtures/fake-mps-control");
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
[mps]
control = "{fake}"
pipe_dir = "{mps}"
pinned_mem_limit = "0=8G"
[[service]]
name = "llm"
p99_target_ms = 500
match = {{ pid_file = "{d}/llm.pid" }}
latency = {{ push = "127.0.0.1:0" }}
gpu = {{ index = 0, env_file = "{d}/llm.env", restart = "echo llm >> {d}/restarts.log", min_restart_interval_ms = 60000 }}
[[best_effort]]
name = "train"
match = {{ pid_file = "{d}/train.pid" }}
gpu = {{ index = 0, env_file = "{d}/train.env", restart = "echo refused >&2; exit 1", min_restart_interval_ms = 0 }}
"#,
            log = log.display(),
            fake = fake.display(),
            mps = mps.display(),
            d = d.display()
        ),
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_cohabit"))
        .args(["run", "--config", cfg.to_str().unwrap(), "--ticks", "4"])
        .env("RUST_LOG", "info")
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

    // The log shows published against effective: llm's share took effect, train's is pending.
    let text = std::fs::read_to_string(&log).unwrap();
    let records: Vec<cohabit_core::DecisionRecord> =
        cohabit_core::DecisionLogReader::new(text.as_bytes())
            .collect::<Result<_, _>>()
            .unwrap();
    assert_eq!(records.len(), 4);
    for r in &records {
        let eff = |n: &str| {
            r.observation
                .services
                .iter()
                .find(|s| s.spec.name == n)
                .unwrap()
                .gpu_mps_effective_pct
        };
        assert_eq!(r.observation.current.services["llm"].gpu_mps_pct, Some(50));
        assert_eq!(eff("llm"), Some(50));
        assert_eq!(
            r.observation.current.best_effort.gpu_mps_pct,
            Some(50),
            "published for training"
        );
        assert_eq!(
            eff("train"),
            None,
            "not effective: its restart hook keeps failing"
        );
    }

    // On exit the environment files are as they were.
    assert_eq!(
        std::fs::read_to_string(d.join("llm.env")).unwrap(),
        "MODEL=small\n"
    );
    assert!(!d.join("train.env").exists());
}
