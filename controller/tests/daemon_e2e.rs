//! `cohabit run` end to end on this machine's real cgroups: real processes (a small service
//! in a cgroup the test makes the way a container runtime would, matched by its cgroup path;
//! a bare process and a CPU-bound best-effort job that forks, both matched by pid file with
//! `placement = "move"`) get CPU sets, limits and weights; the service stays in its owner's
//! cgroup the whole time and the two latency-critical CPU sets never share a CPU; on SIGTERM
//! the owner's values are back, every moved process (and every child forked after the move)
//! is back where it was and every group cohabit created is gone. Needs root and writable
//! cpuset and cpu controllers (as on the CI machine); otherwise it prints why it skipped (a
//! failure under `COHABIT_REQUIRE_ROOT_TESTS=1`).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cohabit_collectors::cgroup::testing::{self, OwnerCgroup};
use cohabit_collectors::cgroup::{Cgroups, Controller, CpuList, CpuWeight, PARENT};

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

/// The lines of `/proc/PID/cgroup` for hierarchies other than cpuset and cpu.
fn other_hierarchies(pid: u32) -> Vec<String> {
    cgroups_of(pid)
        .lines()
        .filter(|l| {
            let ctrls = l.split(':').nth(1).unwrap_or("");
            !ctrls.split(',').any(|c| c == "cpuset" || c == "cpu") && !ctrls.is_empty()
        })
        .map(str::to_string)
        .collect()
}

/// Children of `pid` (from `/proc/*/stat`).
fn children_of(pid: u32) -> Vec<u32> {
    let mut out = vec![];
    for e in std::fs::read_dir("/proc").unwrap().filter_map(Result::ok) {
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        let after = stat.rsplit_once(") ").map(|(_, r)| r).unwrap_or("");
        if after.split_whitespace().nth(1) == Some(&pid.to_string()) {
            out.extend(e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()));
        }
    }
    out
}

fn cpus(dir: &Path) -> CpuList {
    std::fs::read_to_string(dir.join("cpuset.cpus"))
        .unwrap_or_default()
        .parse()
        .unwrap_or_default()
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

/// A TCP port free on loopback now.
fn free_tcp_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Runs `look` every 50 ms for two seconds (more than ten times).
fn for_two_seconds(mut look: impl FnMut()) {
    let t = Instant::now();
    let mut looks = 0;
    while t.elapsed() < Duration::from_secs(2) {
        look();
        looks += 1;
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(looks > 10);
}

/// The end-to-end configuration, written in `d` (its path returned): kv in the owner's
/// cgroup `owner` pushing to `port`, web and the best-effort job spin by pid file and
/// moved, metrics on `metrics_port`, the decision log in `d`.
fn write_config(d: &Path, owner: &str, port: u16, metrics_port: u16) -> PathBuf {
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
[paths]
state_dir = "{d}/state"
[[service]]
name = "kv"
p99_target_ms = 1.0
match = {{ cgroup = "{owner}" }}
latency = {{ push = "127.0.0.1:{port}", unauthenticated = true }}
[[service]]
name = "web"
p99_target_ms = 10
match = {{ pid_file = "{d}/victim.pid", user = {uid} }}
placement = "move"
latency = {{ prometheus = "http://127.0.0.1:1/metrics", metric = "http_seconds" }}
[[best_effort]]
name = "spin"
match = {{ pid_file = "{d}/be.pid", user = {uid} }}
placement = "move"
"#,
            log = log.display(),
            d = d.display(),
            uid = nix::unistd::geteuid().as_raw(),
        ),
    )
    .unwrap();
    cfg
}

/// The metrics endpoint on `metrics_port` serves the allocations, ticks, targets and
/// errors once kv's latency is in.
fn assert_metrics_served(metrics_port: u16) {
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
}

/// The processes of the test: the service, put in its owner's cgroup (`cpuset` and `cpu`)
/// and pushing latencies of 0.8 and 1.5 ms to `port`; a CPU-bound job that forks a
/// short-lived child now and then; and a bare process.
fn start_processes(cpuset: &Path, cpu: &Path, port: u16) -> (Kill, Kill, Kill) {
    let lc = spawn(&format!(
        "echo $$ > {}/cgroup.procs; echo $$ > {}/cgroup.procs; exec bash -c 'while :; do echo 800 > /dev/udp/127.0.0.1/{port}; echo 1500 > /dev/udp/127.0.0.1/{port}; sleep 0.01; done'",
        cpuset.display(),
        cpu.display()
    ));
    let be = spawn(
        "while :; do sleep 0.3 & i=0; while [ $i -lt 30000 ]; do i=$((i+1)); done; wait; done",
    );
    let victim = spawn("exec sleep 600");
    (lc, be, victim)
}

/// Waits (at most 10 s) for `n` lines in the decision log at `log`.
fn wait_for_decisions(log: &Path, n: usize) {
    wait_for("several decisions", Duration::from_secs(10), || {
        std::fs::read_to_string(log)
            .map(|t| t.lines().count() >= n)
            .unwrap_or(false)
    });
}

/// `cohabit run` with the configuration at `cfg`, its output piped.
fn start_daemon(cfg: &Path) -> Kill {
    let daemon = Command::new(env!("CARGO_BIN_EXE_cohabit"))
        .args(["run", "--config", cfg.to_str().unwrap()])
        .env("RUST_LOG", "info")
        .stderr(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    Kill(daemon)
}

/// Every group cohabit made under `cg` is gone.
fn assert_cohabits_groups_gone(cg: &Cgroups) {
    for c in Controller::ALL {
        let parent: PathBuf = cg.own_parent(c).unwrap();
        assert!(
            !parent.exists(),
            "{} is still there after the daemon's exit",
            parent.display()
        );
    }
}

/// Sends SIGTERM to `daemon` and waits (at most 10 s) for it to exit successfully: what
/// it wrote to stderr.
fn stop(daemon: &mut Kill) -> String {
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
    stderr
}

/// The decision log at `log` has a header and records of the real host (not simulated,
/// no truth) with kv's pushed p99, spin's CPU use and no counters.
fn assert_log_of_the_real_host(log: &Path) {
    let text = std::fs::read_to_string(log).unwrap();
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
}

#[test]
fn the_daemon_manages_real_processes_and_restores_everything_on_sigterm() {
    let _host = HOST
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let Some(cg) = testing::real_cgroups() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let port = free_udp_port();
    let metrics_port = free_tcp_port();
    // The service's owner makes its cgroup and starts it there.
    let owner = OwnerCgroup::create(&cg, &format!("e2e-owner-{}", std::process::id())).unwrap();
    let owner_cpuset = owner.dir(Controller::Cpuset).to_path_buf();
    let owner_cpu = owner.dir(Controller::Cpu).to_path_buf();
    let (weight_file, highest) = cg.weight_file(CpuWeight::Highest);
    let owner_values = || {
        (
            std::fs::read_to_string(owner_cpuset.join("cpuset.cpus")).unwrap(),
            std::fs::read_to_string(owner_cpu.join(weight_file)).unwrap(),
        )
    };
    let originals = owner_values();
    let (lc, be, victim) = start_processes(&owner_cpuset, &owner_cpu, port);
    let (be_pid, lc_pid, victim_pid) = (be.0.id(), lc.0.id(), victim.0.id());
    wait_for(
        "the service in its owner's cgroup",
        Duration::from_secs(5),
        || cgroups_of(lc_pid).contains(&owner.path()),
    );
    std::fs::write(d.join("be.pid"), be_pid.to_string()).unwrap();
    std::fs::write(d.join("victim.pid"), victim_pid.to_string()).unwrap();
    let before: Vec<String> = [be_pid, lc_pid, victim_pid]
        .iter()
        .map(|p| cgroups_of(*p))
        .collect();
    let victim_others = other_hierarchies(victim_pid);
    let log = d.join("decisions.jsonl");
    let cfg = write_config(d, &owner.path(), port, metrics_port);
    let mut daemon = start_daemon(&cfg);

    // The service is controlled where it is; the bare processes move (cpuset and cpu only).
    let web_cpuset = cg.own_dir(Controller::Cpuset, "lc-web").unwrap().unwrap();
    wait_for("the values and the moves", Duration::from_secs(10), || {
        cpus(&owner_cpuset).0.len() < cpus(cg.mount(Controller::Cpuset).unwrap()).0.len()
            && cgroups_of(be_pid).contains(&format!("/{PARENT}/best-effort"))
            && cgroups_of(victim_pid).contains(&format!("/{PARENT}/lc-web"))
    });
    assert_eq!(
        std::fs::read_to_string(owner_cpu.join(weight_file))
            .unwrap()
            .trim(),
        highest,
        "the service's weight protects it from unmanaged processes"
    );
    assert_eq!(
        other_hierarchies(victim_pid),
        victim_others,
        "a moved process keeps its memory, pids and other cgroups"
    );
    // Every tick for two seconds: the service stays put, the LC sets are disjoint.
    for_two_seconds(|| {
        assert_eq!(
            cgroups_of(lc_pid),
            before[1],
            "the service stays where its owner put it"
        );
        let (kv, web) = (cpus(&owner_cpuset), cpus(&web_cpuset));
        assert!(!kv.overlaps(&web), "kv {kv} and web {web} share a CPU");
    });

    // The metrics endpoint answers on loopback.
    assert_metrics_served(metrics_port);

    // A process vanishes; the daemon keeps going.
    drop(victim);
    wait_for_decisions(&log, 6);
    assert!(daemon.0.try_wait().unwrap().is_none(), "still running");

    // SIGTERM: everything is undone.
    let stderr = stop(&mut daemon);
    assert!(
        stderr.contains("resctrl"),
        "one line about the missing resctrl:\n{stderr}"
    );
    assert!(stderr.contains("vanished"), "{stderr}");
    assert!(
        stderr.contains("127.0.0.1:1"),
        "the unreachable endpoint is named:\n{stderr}"
    );
    assert_cohabits_groups_gone(&cg);
    assert_eq!(owner_values(), originals, "the owner's values are back");
    assert_eq!(cgroups_of(lc_pid), before[1], "the service never left");
    assert_eq!(
        cgroups_of(be_pid),
        before[0],
        "best-effort job back where it was"
    );
    for child in children_of(be_pid) {
        let now = cgroups_of(child);
        assert!(
            now.is_empty() || !now.contains(&format!("/{PARENT}/")),
            "child {child} of the job is out of cohabit's groups: {now}"
        );
    }
    // The decision log holds the same records as the simulator's, from the real host.
    assert_log_of_the_real_host(&log);
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
        "interval_ms = 100\nmetrics_addr = \"\"\n[[service]]\nname = \"kv\"\np99_target_ms = 1\nmatch = { process_name = \"no-such-proc\" }\nlatency = { push = \"127.0.0.1:0\", unauthenticated = true }\n",
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
        stderr.contains("service kv: match.process_name without match.user")
            && stderr.contains("dry run: watching anyway"),
        "a dry run warns of a name matcher without a user: {stderr}"
    );
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
