//! `cohabit run` end to end on this machine's real cgroups: real processes (a CPU-bound
//! best-effort job and a small service that reports its latency on a UDP socket) are moved
//! into cohabit's cgroups and given CPU sets and quotas; on SIGTERM every group is gone and
//! every process is back where it was. Needs root and writable cpuset and cpu controllers
//! (as on the CI machine); otherwise it prints why it skipped.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cohabit_collectors::cgroup::Cgroups;
use cohabit_collectors::HostPaths;

/// The daemon tests share the host's cgroup tree: one at a time.
static HOST: std::sync::Mutex<()> = std::sync::Mutex::new(());

struct Kill(Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn(script: &str) -> Kill {
    Kill(
        Command::new("bash")
            .arg("-c")
            .arg(script)
            .stdin(Stdio::null())
            .spawn()
            .expect("bash runs"),
    )
}

fn cgroups_of(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default()
}

fn usable() -> bool {
    let Ok(Some(cg)) = Cgroups::detect(&HostPaths::standard()) else {
        println!("skipped: no cgroup hierarchy");
        return false;
    };
    let w = cg.writable_controllers();
    let ok = w.iter().any(|c| c == "cpuset") && w.iter().any(|c| c == "cpu");
    if !ok {
        println!("skipped: cpuset and cpu are not both writable here ({w:?}); run as root on cgroup v1 or v2");
    }
    ok
}

fn http_get(port: u16, path: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    out.starts_with("HTTP/1.1 200").then_some(out)
}

fn free_udp_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn wait_for(what: &str, timeout: Duration, mut ok: impl FnMut() -> bool) {
    let t = Instant::now();
    while !ok() {
        assert!(t.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn the_daemon_manages_real_processes_and_restores_everything_on_sigterm() {
    let _host = HOST
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if !usable() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let port = free_udp_port();
    let metrics_port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let be = spawn("while :; do :; done");
    let lc = spawn(&format!(
        "while :; do echo 800 > /dev/udp/127.0.0.1/{port}; echo 1500 > /dev/udp/127.0.0.1/{port}; sleep 0.01; done"
    ));
    let victim = spawn("sleep 600");
    let (be_pid, lc_pid, victim_pid) = (be.0.id(), lc.0.id(), victim.0.id());
    std::fs::write(d.join("be.pid"), be_pid.to_string()).unwrap();
    std::fs::write(d.join("lc.pid"), lc_pid.to_string()).unwrap();
    std::fs::write(d.join("victim.pid"), victim_pid.to_string()).unwrap();
    let before: Vec<String> = [be_pid, lc_pid, victim_pid]
        .iter()
        .map(|p| cgroups_of(*p))
        .collect();
    let log = d.join("decisions.jsonl");
    let cfg = d.join("cohabit.toml");
    std::fs::write(
        &cfg,
        format!(
            r#"
interval_ms = 200
policy = "parties"
log = "{log}"
metrics_addr = "127.0.0.1:{metrics_port}"
[[service]]
name = "kv"
p99_target_ms = 1.0
match = {{ pid_file = "{d}/lc.pid" }}
latency = {{ push = "127.0.0.1:{port}" }}
[[service]]
name = "web"
p99_target_ms = 10
match = {{ pid_file = "{d}/victim.pid" }}
latency = {{ prometheus = "http://127.0.0.1:1/metrics", metric = "http_seconds" }}
[[best_effort]]
name = "spin"
match = {{ pid_file = "{d}/be.pid" }}
"#,
            log = log.display(),
            d = d.display()
        ),
    )
    .unwrap();
    let daemon = Command::new(env!("CARGO_BIN_EXE_cohabit"))
        .args(["run", "--config", cfg.to_str().unwrap()])
        .env("RUST_LOG", "info")
        .stderr(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut daemon = Kill(daemon);

    // The processes move into cohabit's cgroups.
    wait_for("the processes to be moved", Duration::from_secs(10), || {
        cgroups_of(be_pid).contains("/cohabit/best-effort")
            && cgroups_of(lc_pid).contains("/cohabit/lc-kv")
    });
    let cpuset = Path::new("/sys/fs/cgroup/cpuset/cohabit");
    let unified = Path::new("/sys/fs/cgroup/cohabit");
    let root = if cpuset.exists() { cpuset } else { unified };
    assert!(root.join("lc-kv").is_dir() && root.join("best-effort").is_dir());
    let kv_cpus = std::fs::read_to_string(root.join("lc-kv/cpuset.cpus")).unwrap();
    assert!(!kv_cpus.trim().is_empty(), "kv got CPUs");

    // The metrics endpoint answers on loopback.
    wait_for("metrics", Duration::from_secs(10), || {
        http_get(metrics_port, "/metrics")
            .is_some_and(|b| b.contains("cohabit_service_p99_ms{service=\"kv\"}"))
    });
    let body = http_get(metrics_port, "/metrics").unwrap();
    for m in [
        "cohabit_allocation{group=\"kv\",resource=\"cores\"}",
        "cohabit_ticks_total",
        "cohabit_service_target_ms{service=\"kv\"} 1",
        "# HELP cohabit_errors_total",
    ] {
        assert!(body.contains(m), "{m} missing from:\n{body}");
    }

    // A process vanishes; the daemon keeps going.
    drop(victim);
    wait_for("several decisions", Duration::from_secs(10), || {
        std::fs::read_to_string(&log)
            .map(|t| t.lines().count() >= 6)
            .unwrap_or(false)
    });
    assert!(daemon.0.try_wait().unwrap().is_none(), "still running");

    // SIGTERM: everything is undone.
    let status = Command::new("kill")
        .args(["-TERM", &daemon.0.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let t = Instant::now();
    let exit = loop {
        if let Some(s) = daemon.0.try_wait().unwrap() {
            break s;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "daemon did not stop");
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(daemon.0.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    assert!(exit.success(), "exit {exit:?}\n{stderr}");
    assert!(
        stderr.contains("resctrl"),
        "one line about the missing resctrl:\n{stderr}"
    );
    assert!(stderr.contains("vanished"), "{stderr}");
    assert!(
        stderr.contains("127.0.0.1:1"),
        "the unreachable endpoint is named:\n{stderr}"
    );
    assert!(!root.exists(), "every cgroup cohabit created is gone");
    assert_eq!(
        cgroups_of(be_pid),
        before[0],
        "best-effort job back where it was"
    );
    assert_eq!(cgroups_of(lc_pid), before[1], "service back where it was");

    // The decision log holds the same records as the simulator's, from the real host.
    let text = std::fs::read_to_string(&log).unwrap();
    let mut reader = cohabit_core::DecisionLogReader::new(text.as_bytes());
    let records: Vec<cohabit_core::DecisionRecord> =
        reader.by_ref().collect::<Result<_, _>>().unwrap();
    let header = reader.header().expect("the log starts with a header");
    assert!(header.policy == "parties" && !header.simulated);
    assert!(records.iter().all(|r| !r.simulated && r.truth.is_none()));
    let kv: Vec<f64> = records
        .iter()
        .filter_map(|r| {
            r.observation
                .services
                .iter()
                .find(|s| s.spec.name == "kv")?
                .sample
                .p99_ms
        })
        .collect();
    assert!(
        kv.iter().any(|p| (1.4..=1.6).contains(p)),
        "pushed p99 ~1.5 ms: {kv:?}"
    );
    let spin_cpu: Vec<f64> = records
        .iter()
        .filter_map(|r| {
            r.observation
                .services
                .iter()
                .find(|s| s.spec.name == "spin")?
                .sample
                .cpu_busy_cores
        })
        .collect();
    assert!(!spin_cpu.is_empty(), "CPU use of the batch job is measured");
    assert!(
        records.iter().all(|r| r
            .observation
            .services
            .iter()
            .all(|s| s.sample.ipc.is_none())),
        "no counters here: absent, not zero"
    );
    drop(be);
    drop(lc);
}

#[test]
fn dry_run_changes_nothing_and_bad_configs_are_refused() {
    let _host = HOST
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("c.toml");
    std::fs::write(
        &cfg,
        "interval_ms = 100\nmetrics_addr = \"\"\n[[service]]\nname = \"kv\"\np99_target_ms = 1\nmatch = { process_name = \"no-such-proc\" }\nlatency = { push = \"127.0.0.1:0\" }\n",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_cohabit"))
        .args([
            "run",
            "--config",
            cfg.to_str().unwrap(),
            "--dry-run",
            "--ticks",
            "3",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("after 3 ticks"));
    assert!(stderr.contains("no process found"), "{stderr}");
    assert!(
        !Path::new("/sys/fs/cgroup/cpuset/cohabit").exists()
            && !Path::new("/sys/fs/cgroup/cohabit").exists()
    );

    std::fs::write(&cfg, "interval_ms = 100\nturbo = 1\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_cohabit"))
        .args(["run", "--config", cfg.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("turbo") && err.contains("c.toml"), "{err}");
}

#[test]
fn probe_reports_this_host_and_exits_zero() {
    let out = Command::new(env!("CARGO_BIN_EXE_cohabit"))
        .args(["probe", "--format", "json"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for key in [
        "cpus",
        "resctrl",
        "cgroup_version",
        "cgroup_writable",
        "perf",
        "nvidia_driver",
        "gpus",
        "mps_daemon",
        "mps_state",
    ] {
        assert!(v.get(key).is_some(), "{key} missing: {v}");
    }
    // Whatever this host is, absence is reported with a reason, never as an error.
    if v["resctrl"].is_null() {
        assert!(v["resctrl_absent"].as_str().unwrap().contains("resctrl"));
    }
    if v["perf"]["state"] == "unsupported" {
        assert!(!v["perf"]["reason"].as_str().unwrap().is_empty());
    }
    if v["nvidia_driver"].is_null() {
        assert!(v["nvidia_absent"]
            .as_str()
            .unwrap()
            .starts_with("no NVIDIA driver"));
    }
    let table = Command::new(env!("CARGO_BIN_EXE_cohabit"))
        .arg("probe")
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&table.stdout).contains("hardware counters"));
}
