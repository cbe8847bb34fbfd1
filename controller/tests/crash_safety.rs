//! Crash safety of `cohabit run` on this machine's real cgroups (docs/DESIGN.md 7, security
//! review rows 9, 13 and 15): the daemon killed with SIGKILL mid-run and started again puts
//! every process back in its cgroup with its original CPU settings; a second instance is
//! refused while the first keeps its changes; SIGHUP, SIGINT and SIGQUIT restore and exit 0
//! like SIGTERM; a change the kernel refuses to undo goes to quarantine and the daemon
//! starts, as it does over a state file it cannot read.
//!
//! The processes live in cgroups the test makes the way a workload's owner would
//! (`/crashtest-*` in the cpuset and cpu hierarchies) and are matched by cgroup path. The
//! tests that touch cgroups need root and writable cpuset and cpu controllers; otherwise
//! they print why they skipped (a failure under `COHABIT_REQUIRE_ROOT_TESTS=1`, as in CI).
//! The lock test needs neither: both instances run `--dry-run`.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use cohabit_collectors::cgroup::testing::{self, OwnerCgroup};
use cohabit_collectors::cgroup::{Cgroups, Controller, CONTROL_FILES, PARENT};

/// The daemon tests share the host's cgroup tree: one at a time.
static HOST: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn host_lock() -> std::sync::MutexGuard<'static, ()> {
    HOST.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A child killed (SIGKILL) and reaped when dropped.
struct Kill(Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn sleeper() -> Kill {
    Kill(
        Command::new("sleep")
            .arg("600")
            .stdin(Stdio::null())
            .spawn()
            .expect("sleep runs"),
    )
}

fn free_udp_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn free_tcp_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The value of the metric `name` the daemon serves on `port`, if it answers.
fn metric(port: u16, name: &str) -> Option<f64> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .and_then(|v| v.trim().parse().ok())
}

fn wait_for(what: &str, timeout: Duration, mut ok: impl FnMut() -> bool) {
    let t = Instant::now();
    while !ok() {
        assert!(t.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn signal(pid: u32, sig: &str) {
    let status = Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill -{sig} {pid}");
}

/// A running daemon whose stderr lines are collected (with when they arrived) on a thread.
struct Daemon {
    child: Kill,
    lines: mpsc::Receiver<(Instant, String)>,
    seen: Vec<(Instant, String)>,
    started: Instant,
}

impl Daemon {
    fn start(cfg: &Path, extra: &[&str]) -> Self {
        let started = Instant::now();
        let mut child = Command::new(env!("CARGO_BIN_EXE_cohabit"))
            .args(["run", "--config", cfg.to_str().unwrap()])
            .args(extra)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if tx.send((Instant::now(), line)).is_err() {
                    break;
                }
            }
        });
        Self {
            child: Kill(child),
            lines,
            seen: vec![],
            started,
        }
    }

    fn pid(&self) -> u32 {
        self.child.0.id()
    }

    fn drain(&mut self) {
        while let Ok(l) = self.lines.try_recv() {
            self.seen.push(l);
        }
    }

    /// Waits for the exit (at most `timeout`) and every line of stderr.
    fn wait(&mut self, timeout: Duration) -> (ExitStatus, String) {
        let t = Instant::now();
        let status = loop {
            if let Some(s) = self.child.0.try_wait().unwrap() {
                break s;
            }
            self.drain();
            assert!(
                t.elapsed() < timeout,
                "the daemon did not stop within {timeout:?}:\n{}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        // The reader thread ends at EOF, which follows the exit.
        while let Ok(l) = self.lines.recv_timeout(Duration::from_secs(2)) {
            self.seen.push(l);
        }
        (status, self.stderr())
    }

    fn stderr(&self) -> String {
        self.seen
            .iter()
            .map(|(_, l)| l.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// When the first line containing `text` arrived, after the start.
    fn when(&self, text: &str) -> Option<Duration> {
        self.seen
            .iter()
            .find(|(_, l)| l.contains(text))
            .map(|(t, _)| t.duration_since(self.started))
    }
}

/// Where the processes and their cgroups stand: for comparing before and after.
#[derive(Debug, PartialEq, Eq)]
struct Snapshot {
    /// `/proc/PID/cgroup` of each process.
    membership: Vec<String>,
    /// Every control file cohabit may write, in each owner cgroup.
    values: BTreeMap<PathBuf, String>,
}

/// Two processes in cgroups of their own, and a configuration that manages them.
struct Fixture {
    cg: Cgroups,
    dir: tempfile::TempDir,
    // Dropped in order: the processes first, then their cgroups.
    procs: Vec<Kill>,
    owners: Vec<OwnerCgroup>,
    cfg: PathBuf,
}

impl Fixture {
    /// The processes and a configuration for `policy`.
    fn new(tag: &str, policy: &str) -> Option<Self> {
        let cg = testing::real_cgroups()?;
        let dir = tempfile::tempdir().unwrap();
        let me = std::process::id();
        let mut owners = vec![];
        let mut procs = vec![];
        for name in ["kv", "batch"] {
            let owner = OwnerCgroup::create(&cg, &format!("crashtest-{tag}-{me}-{name}")).unwrap();
            let p = sleeper();
            owner.add(p.0.id()).unwrap();
            owners.push(owner);
            procs.push(p);
        }
        let cfg = dir.path().join("cohabit.toml");
        std::fs::write(
            &cfg,
            format!(
                r#"interval_ms = 100
policy = "{policy}"
metrics_addr = ""
[paths]
state_dir = "{state}"
[[service]]
name = "kv"
p99_target_ms = 1.0
match = {{ cgroup = "{kv}" }}
latency = {{ push = "127.0.0.1:{port}", unauthenticated = true }}
[[best_effort]]
name = "batch"
match = {{ cgroup = "{batch}" }}
"#,
                state = dir.path().join("state").display(),
                kv = owners[0].path(),
                batch = owners[1].path(),
                port = free_udp_port(),
            ),
        )
        .unwrap();
        Some(Self {
            cg,
            dir,
            procs,
            owners,
            cfg,
        })
    }

    fn state_file(&self) -> PathBuf {
        self.dir.path().join("state/changes.json")
    }

    /// The changes the state file lists (`None` when there is no file yet).
    fn recorded(&self) -> Option<Vec<serde_json::Value>> {
        let text = std::fs::read_to_string(self.state_file()).ok()?;
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["cohabit_state"], 1, "{text}");
        Some(v["changes"].as_array().unwrap().clone())
    }

    fn snapshot(&self) -> Snapshot {
        let membership = self
            .procs
            .iter()
            .map(|p| std::fs::read_to_string(format!("/proc/{}/cgroup", p.0.id())).unwrap())
            .collect();
        let mut values = BTreeMap::new();
        for owner in &self.owners {
            for c in Controller::ALL {
                for file in CONTROL_FILES {
                    let path = owner.dir(c).join(file);
                    if let Ok(v) = std::fs::read_to_string(&path) {
                        values.insert(path, v);
                    }
                }
            }
        }
        Snapshot { membership, values }
    }

    /// cohabit's groups still on the host: its parent under each hierarchy, and any group
    /// inside the owners' cgroups (the test made them without children).
    fn cohabit_groups(&self) -> Vec<PathBuf> {
        let mut left = vec![];
        for c in Controller::ALL {
            if let Some(mount) = self.cg.mount(c) {
                let parent = mount.join(PARENT);
                if parent.exists() {
                    left.push(parent);
                }
            }
            for owner in &self.owners {
                let children = std::fs::read_dir(owner.dir(c)).unwrap();
                left.extend(
                    children
                        .filter_map(Result::ok)
                        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                        .map(|e| e.path()),
                );
            }
        }
        left.sort();
        left.dedup();
        left
    }

    /// Waits until the daemon has recorded changes (it applied its first plan).
    fn wait_recorded(&self, daemon: &mut Daemon) {
        let t = Instant::now();
        while self.recorded().is_none_or(|c| c.is_empty()) {
            daemon.drain();
            assert!(
                daemon.child.0.try_wait().unwrap().is_none(),
                "the daemon exited:\n{}",
                daemon.stderr()
            );
            assert!(
                t.elapsed() < Duration::from_secs(15),
                "the daemon never recorded a change in {}:\n{}",
                self.state_file().display(),
                daemon.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Everything is as before the first daemon started.
    fn assert_restored(&self, before: &Snapshot, stderr: &str) {
        let after = self.snapshot();
        assert_eq!(
            after.membership, before.membership,
            "every process is back in its cgroup\n{stderr}"
        );
        assert_eq!(
            after.values, before.values,
            "every cgroup has its original settings\n{stderr}"
        );
        assert_eq!(
            self.cohabit_groups(),
            Vec::<PathBuf>::new(),
            "no cohabit group is left\n{stderr}"
        );
        assert_eq!(
            self.recorded(),
            Some(vec![]),
            "the state file records nothing in force\n{stderr}"
        );
    }
}

#[test]
fn after_sigkill_the_next_start_puts_every_process_and_setting_back() {
    let _host = host_lock();
    let Some(fx) = Fixture::new("kill", "parties") else {
        return;
    };
    let before = fx.snapshot();
    let mut first = Daemon::start(&fx.cfg, &[]);
    fx.wait_recorded(&mut first);
    // A few ticks on top of the initial plan.
    std::thread::sleep(Duration::from_millis(500));
    first.child.0.kill().unwrap();
    let (status, stderr) = first.wait(Duration::from_secs(10));
    assert!(!status.success(), "killed: {status:?}");
    let recorded = fx.recorded().expect("the killed run left its state file");
    assert!(
        !recorded.is_empty(),
        "the state file lists the changes in force\n{stderr}"
    );
    assert_ne!(
        fx.snapshot(),
        before,
        "the killed run left its changes on the host"
    );

    let mut second = Daemon::start(&fx.cfg, &["--ticks", "3"]);
    let (status, stderr) = second.wait(Duration::from_secs(30));
    assert!(status.success(), "second run: {status:?}\n{stderr}");
    let reconciled = second
        .when("host reconciled")
        .unwrap_or_else(|| panic!("no reconcile line:\n{stderr}"));
    let reconcile_ms = stderr
        .split("reconcile_ms=")
        .nth(1)
        .and_then(|t| t.split_whitespace().next())
        .and_then(|t| t.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("reconcile_ms not logged:\n{stderr}"));
    println!(
        "restart-to-reconciled after SIGKILL: {:.1} ms from exec (reconcile itself {reconcile_ms:.2} ms, {} changes)",
        reconciled.as_secs_f64() * 1e3,
        recorded.len()
    );
    assert!(
        stderr.contains(&format!("restored={}", recorded.len())),
        "every recorded change was restored at the start:\n{stderr}"
    );
    fx.assert_restored(&before, &stderr);
}

#[test]
fn a_second_instance_is_refused_and_the_first_keeps_its_changes_until_sighup() {
    let _host = host_lock();
    // The static policy keeps its first plan, so what A has in force stays put.
    let Some(fx) = Fixture::new("lock", "static") else {
        return;
    };
    let before = fx.snapshot();
    let mut first = Daemon::start(&fx.cfg, &[]);
    fx.wait_recorded(&mut first);
    // The record grows before each write: let the first plan's writes finish.
    std::thread::sleep(Duration::from_millis(500));
    let in_force = fx.snapshot();
    assert_ne!(in_force, before, "A changed the host");
    let recorded = fx.recorded();

    for extra in [&[][..], &["--dry-run"][..]] {
        let out = Command::new(env!("CARGO_BIN_EXE_cohabit"))
            .args(["run", "--config", fx.cfg.to_str().unwrap(), "--ticks", "1"])
            .args(extra)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "second instance {extra:?} ran:\n{err}"
        );
        assert!(
            err.contains(&format!("another cohabit is running (pid {})", first.pid())),
            "{err}"
        );
    }
    assert!(first.child.0.try_wait().unwrap().is_none(), "A runs on");
    assert_eq!(fx.snapshot(), in_force, "A's changes are intact");
    assert_eq!(fx.recorded(), recorded, "and so is its record");

    signal(first.pid(), "HUP");
    let (status, stderr) = first.wait(Duration::from_secs(10));
    assert!(status.success(), "SIGHUP: exit 0, got {status:?}\n{stderr}");
    assert!(stderr.contains("SIGHUP"), "{stderr}");
    fx.assert_restored(&before, &stderr);
}

#[test]
fn sigint_and_sigquit_restore_and_exit_zero() {
    let _host = host_lock();
    let Some(fx) = Fixture::new("signals", "parties") else {
        return;
    };
    let before = fx.snapshot();
    for sig in ["INT", "QUIT"] {
        let mut d = Daemon::start(&fx.cfg, &[]);
        fx.wait_recorded(&mut d);
        signal(d.pid(), sig);
        let (status, stderr) = d.wait(Duration::from_secs(10));
        assert!(
            status.success(),
            "SIG{sig}: exit 0, got {status:?}\n{stderr}"
        );
        assert!(stderr.contains(&format!("SIG{sig}")), "{stderr}");
        fx.assert_restored(&before, &stderr);
    }
}

#[test]
fn a_second_dry_run_is_refused_while_the_first_holds_the_lock() {
    // Needs no root: nothing is changed on the host.
    let _host = host_lock();
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("c.toml");
    std::fs::write(
        &cfg,
        format!(
            "interval_ms = 100\nmetrics_addr = \"\"\n[paths]\nstate_dir = \"{}\"\n[[service]]\nname = \"kv\"\np99_target_ms = 1\nmatch = {{ process_name = \"no-such-proc\" }}\nlatency = {{ push = \"127.0.0.1:0\", unauthenticated = true }}\n",
            dir.path().join("state").display()
        ),
    )
    .unwrap();
    let mut first = Daemon::start(&cfg, &["--dry-run"]);
    let lock = dir.path().join("state/lock");
    wait_for("the first instance's lock", Duration::from_secs(10), || {
        std::fs::read_to_string(&lock).is_ok_and(|t| t.trim() == first.pid().to_string())
    });
    let out = Command::new(env!("CARGO_BIN_EXE_cohabit"))
        .args(["run", "--config", cfg.to_str().unwrap(), "--dry-run"])
        .args(["--ticks", "1"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains(&format!("another cohabit is running (pid {})", first.pid())),
        "{err}"
    );
    signal(first.pid(), "TERM");
    let (status, stderr) = first.wait(Duration::from_secs(10));
    assert!(status.success(), "{status:?}\n{stderr}");
    // The lock went with the first instance.
    let out = Command::new(env!("CARGO_BIN_EXE_cohabit"))
        .args(["run", "--config", cfg.to_str().unwrap(), "--dry-run"])
        .args(["--ticks", "1"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_change_the_kernel_refuses_to_undo_is_quarantined_and_the_daemon_starts() {
    let _host = host_lock();
    let Some(fx) = Fixture::new("quarantine", "static") else {
        return;
    };
    let port = free_tcp_port();
    let text = std::fs::read_to_string(&fx.cfg).unwrap();
    std::fs::write(
        &fx.cfg,
        text.replace(
            "metrics_addr = \"\"",
            &format!("metrics_addr = \"127.0.0.1:{port}\""),
        ),
    )
    .unwrap();
    let before = fx.snapshot();
    // What a killed run left: kv's cpuset.cpus as it was before cohabit narrowed it, a value
    // the kernel no longer takes (the kubelet narrowed the pod's parent since, say; here,
    // CPUs this host does not have).
    let kv = fx.owners[0].dir(Controller::Cpuset);
    let state_dir = fx.dir.path().join("state");
    std::fs::create_dir(&state_dir).unwrap();
    std::fs::set_permissions(
        &state_dir,
        std::os::unix::fs::PermissionsExt::from_mode(0o700),
    )
    .unwrap();
    let entry = serde_json::json!({
        "kind": "cgroup_file",
        "dir": kv,
        "file": "cpuset.cpus",
        "original": "0-4095",
    });
    let record = serde_json::json!({"cohabit_state": 1, "pid": 4242, "changes": [entry]});
    std::fs::write(fx.state_file(), record.to_string()).unwrap();

    let mut d = Daemon::start(&fx.cfg, &[]);
    wait_for("the quarantine metric", Duration::from_secs(15), || {
        d.drain();
        assert!(
            d.child.0.try_wait().unwrap().is_none(),
            "the daemon exited:\n{}",
            d.stderr()
        );
        metric(port, "cohabit_state_quarantined_entries") == Some(1.0)
    });
    let q: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(state_dir.join("quarantine.json")).unwrap())
            .unwrap();
    let entries = q["entries"].as_array().unwrap();
    assert_eq!(entries.len(), 1, "{q}");
    assert_eq!(entries[0]["change"], entry);
    assert_eq!(entries[0]["recorded_by_pid"], 4242);
    signal(d.pid(), "TERM");
    let (status, stderr) = d.wait(Duration::from_secs(10));
    assert!(status.success(), "{status:?}\n{stderr}");
    assert!(
        stderr.contains("moved to quarantine") && stderr.contains("quarantined=1"),
        "{stderr}"
    );
    fx.assert_restored(&before, &stderr);

    // A state file this build cannot read: moved aside unread, and the daemon starts.
    std::fs::write(fx.state_file(), "{\"cohabit_state\": 1, \"pid\": 1, \"chan").unwrap();
    let mut d = Daemon::start(&fx.cfg, &[]);
    wait_for("the quarantine metric", Duration::from_secs(15), || {
        d.drain();
        assert!(
            d.child.0.try_wait().unwrap().is_none(),
            "exited:\n{}",
            d.stderr()
        );
        metric(port, "cohabit_state_quarantined_entries") == Some(1.0)
    });
    signal(d.pid(), "TERM");
    let (status, stderr) = d.wait(Duration::from_secs(10));
    assert!(status.success(), "{status:?}\n{stderr}");
    assert!(stderr.contains("cannot be read"), "{stderr}");
    let aside = std::fs::read_dir(&state_dir)
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with("changes.json.unreadable.")
        })
        .count();
    assert_eq!(aside, 1);
    fx.assert_restored(&before, &stderr);
}

#[test]
fn the_discard_switch_is_read_from_the_environment() {
    // Needs no root: a dry run changes nothing.
    let _host = host_lock();
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("c.toml");
    std::fs::write(
        &cfg,
        format!(
            "interval_ms = 100\nmetrics_addr = \"\"\n[paths]\nstate_dir = \"{}\"\n[[service]]\nname = \"kv\"\np99_target_ms = 1\nmatch = {{ process_name = \"no-such-proc\" }}\nlatency = {{ push = \"127.0.0.1:0\", unauthenticated = true }}\n",
            dir.path().join("state").display()
        ),
    )
    .unwrap();
    let state = dir.path().join("state");
    std::fs::create_dir(&state).unwrap();
    std::fs::set_permissions(&state, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    std::fs::write(state.join("changes.json"), "{").unwrap();
    let run = |value: Option<&str>| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_cohabit"));
        c.args(["run", "--config", cfg.to_str().unwrap(), "--dry-run"])
            .args(["--ticks", "1"])
            .env("RUST_LOG", "info")
            .env_remove("COHABIT_DISCARD_STATE");
        if let Some(v) = value {
            c.env("COHABIT_DISCARD_STATE", v);
        }
        let out = c.output().unwrap();
        (
            out.status,
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    for v in ["1", "true", "yes"] {
        let (status, err) = run(Some(v));
        assert!(status.success(), "{v}: {err}");
        assert!(err.contains("would be moved aside"), "{v}: {err}");
    }
    for v in [None, Some("0"), Some("false")] {
        let (status, err) = run(v);
        assert!(status.success(), "{v:?}: {err}");
        assert!(
            err.contains("would move the state file to quarantine"),
            "{v:?}: {err}"
        );
    }
    let (status, err) = run(Some("maybe"));
    assert!(!status.success(), "{err}");
    assert!(
        err.contains("COHABIT_DISCARD_STATE") || err.contains("discard"),
        "{err}"
    );
}
