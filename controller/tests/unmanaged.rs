//! Issue 48's case on this machine's real cgroups: a process started from a shell sits in
//! the root cgroup of every hierarchy; matched by `process_name` (with `match.user`) and the
//! default in-place placement, nothing cohabit writes can reach it. `cohabit check` says
//! so, `cohabit run` refuses to start, and with `allow_unmanaged = true` it starts and its
//! decision log marks the group unmanaged instead of claiming its plans happened.
//!
//! The process is `sleep`, copied under a name of its own so that no other `sleep` on the
//! machine is matched. Needs root and writable cpuset and cpu controllers (as on the CI
//! machine); otherwise it prints why it skipped (a failure under
//! `COHABIT_REQUIRE_ROOT_TESTS=1`).

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};

use cohabit_collectors::cgroup::testing;
use cohabit_collectors::cgroup::{Cgroups, Controller};

struct Kill(Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn cohabit(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cohabit"))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("cohabit runs")
}

fn config(d: &Path, name: &str, allow: bool) -> std::path::PathBuf {
    let port = std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let path = d.join("cohabit.toml");
    std::fs::write(
        &path,
        format!(
            r#"
interval_ms = 200
metrics_addr = ""
log = "{d}/decisions.jsonl"
[paths]
state_dir = "{d}/state"
[[service]]
name = "memcached"
p99_target_ms = 1.0
match = {{ process_name = "{name}", user = {uid} }}
latency = {{ push = "127.0.0.1:{port}", unauthenticated = true }}
{allow}
"#,
            d = d.display(),
            uid = nix::unistd::geteuid().as_raw(),
            allow = if allow { "allow_unmanaged = true" } else { "" },
        ),
    )
    .unwrap();
    path
}

/// `sleep` copied into `d` under a name of its own (returned), started and put where a
/// shell's process is: the root of the cpuset and cpu hierarchies.
fn bare_process(cg: &Cgroups, d: &Path) -> (String, Kill) {
    // `comm` is at most 15 characters.
    let name = format!("sl{}", std::process::id() % 1_000_000_000);
    let exe = d.join(&name);
    let sleep = ["/bin/sleep", "/usr/bin/sleep"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .expect("sleep is installed");
    std::fs::copy(sleep, &exe).unwrap();
    let bare = Kill(Command::new(&exe).arg("600").spawn().unwrap());
    let pid = bare.0.id();
    for c in [Controller::Cpuset, Controller::Cpu] {
        let root = cg.mount(c).expect("mounted");
        std::fs::write(root.join("cgroup.procs"), pid.to_string()).unwrap();
    }
    (name, bare)
}

#[test]
fn a_bare_process_in_place_is_reported_unmanaged_refused_by_run_and_logged_as_such_when_allowed() {
    let Some(cg) = testing::real_cgroups() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (name, bare) = bare_process(&cg, d);
    let pid = bare.0.id();
    let root_cpus =
        std::fs::read_to_string(cg.mount(Controller::Cpuset).unwrap().join("cpuset.cpus"))
            .unwrap_or_default();

    let cfg = config(d, &name, false);
    let o = cohabit(&[
        "check",
        "--config",
        cfg.to_str().unwrap(),
        "--format",
        "json",
        "--wait-ms",
        "300",
    ]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success(),
        "check fails when run would refuse: {stderr}"
    );
    let v: serde_json::Value =
        serde_json::from_slice(&o.stdout).expect("stdout is the JSON document alone");
    let svc = &v["services"][0];
    assert_eq!(svc["processes"][0]["pid"], pid, "{svc}");
    assert_eq!(
        svc["processes"][0]["cgroups"][0]["action"], "leave",
        "{svc}"
    );
    for r in ["cores", "llc_ways", "mba"] {
        let c = &svc["control"]["resources"][r];
        if r == "cores" {
            assert_eq!(c["control"], "unmanaged", "{svc}");
            assert!(
                c["why"].as_str().unwrap().contains("hierarchy's root"),
                "{c}"
            );
        } else if c["control"] != "unmanaged" {
            // A host with RDT reaches the process through resctrl: then run starts.
            cohabit_testkit::skip(
                cohabit_testkit::Need::Machine,
                &format!("this host allocates {r} through resctrl, so run would not refuse"),
            );
            return;
        }
    }
    assert!(svc["refused"].as_str().is_some(), "{svc}");
    assert!(
        v["refusals"][0]
            .as_str()
            .unwrap()
            .contains("service memcached would run unmanaged"),
        "{v}"
    );

    let o = cohabit(&["run", "--config", cfg.to_str().unwrap(), "--ticks", "2"]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "run refuses: {stderr}");
    assert!(
        stderr.contains(
            "refusing to start: service memcached would run unmanaged for every resource"
        ) && stderr.contains("hierarchy's root")
            && stderr.contains("allow_unmanaged = true"),
        "{stderr}"
    );

    let cfg = config(d, &name, true);
    let o = cohabit(&["check", "--config", cfg.to_str().unwrap(), "--wait-ms", "0"]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        text.contains("cores      UNMANAGED") && text.contains("cohabit run would start"),
        "{text}"
    );
    let o = cohabit(&["run", "--config", cfg.to_str().unwrap(), "--ticks", "3"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let log = std::fs::read_to_string(d.join("decisions.jsonl")).unwrap();
    let last: serde_json::Value = serde_json::from_str(log.lines().last().unwrap()).unwrap();
    let group = &last["control"]["memcached"];
    assert_eq!(group["pids"], serde_json::json!([pid]), "{last}");
    assert_eq!(
        group["resources"]["cores"]["control"], "unmanaged",
        "{last}"
    );
    let now = std::fs::read_to_string(cg.mount(Controller::Cpuset).unwrap().join("cpuset.cpus"))
        .unwrap_or_default();
    assert_eq!(now, root_cpus, "nothing was written to the root");
    drop(bare);
}
