use std::os::unix::fs::PermissionsExt;

use super::*;
use crate::hook::tests::live_members;
use crate::spec::Matcher;

fn service(dir: &Path, restart: &str, interval_ms: u64, hook_timeout_ms: u64) -> ManagedService {
    ManagedService {
        name: "llm".into(),
        p99_target_ms: Some(100.0),
        matcher: Matcher::ProcessName("llm".into()),
        constraint: Default::default(),
        placement: Default::default(),
        allow_unmanaged: false,
        latency: None,
        priority: 0,
        gpu: Some(GpuClient {
            index: 0,
            env_file: dir.join("llm.env"),
            restart: restart.into(),
            min_restart_interval_ms: interval_ms,
            hook_timeout_ms,
            mps_server: None,
        }),
    }
}

/// Waits for running hooks to end and collects them.
fn settle(g: &mut GpuActuator) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut done = Vec::new();
    while g.hooks_running() {
        assert!(Instant::now() < deadline, "a hook did not end");
        std::thread::sleep(Duration::from_millis(10));
        done.extend(g.poll_hooks());
    }
    done
}

#[test]
fn only_cohabits_lines_are_rewritten_in_place_and_restored() {
    let text = "# the model\nMODEL=small\nexport CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30\nCUDA_MPS_PIPE_DIRECTORY=/run/mps\nCUDA_MPS_ACTIVE_THREAD_PERCENTAGE=31\nTAIL=1";
    let new = env_with_share(text, 50, Some("0=8G")).unwrap();
    assert_eq!(
        new,
        "# the model\nMODEL=small\nCUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50\nCUDA_MPS_PIPE_DIRECTORY=/run/mps\nTAIL=1\nCUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8G\n"
    );
    assert_eq!(share_in(&new), Some(50));
    // An edit made while cohabit ran survives the restore; cohabit's lines go back.
    let edited = new.replace("MODEL=small", "MODEL=large");
    assert_eq!(
        env_restored(&edited, Some(text)).unwrap(),
        "# the model\nMODEL=large\nexport CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30\nCUDA_MPS_PIPE_DIRECTORY=/run/mps\nTAIL=1\n"
    );
    // A file cohabit created goes, unless someone added to it.
    assert_eq!(
        env_restored("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50\n", None),
        None
    );
    assert_eq!(
        env_restored("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50\nX=1\n", None).as_deref(),
        Some("X=1\n")
    );
    // Without a limit, an existing limit line is left alone.
    assert_eq!(
        env_with_share("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=4G\n", 20, None).unwrap(),
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=4G\nCUDA_MPS_ACTIVE_THREAD_PERCENTAGE=20\n"
    );
    let e = env_with_share("", 20, Some("0=8G\nLD_PRELOAD=/tmp/x.so")).unwrap_err();
    assert!(
        matches!(&e, GpuError::PinnedLimit { limit } if limit.contains("LD_PRELOAD")),
        "{e}"
    );
}

#[test]
fn a_new_share_is_pending_until_the_restart_and_restarts_are_spaced() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("llm.env"), "OTHER=1\n").unwrap();
    let log = dir.path().join("restarts");
    let cmd = format!(
        "echo $CUDA_MPS_ACTIVE_THREAD_PERCENTAGE >> {}",
        log.display()
    );
    let mut g = GpuActuator::new(&[service(dir.path(), &cmd, 60_000, 10_000)], None);
    assert_eq!(g.effective("llm"), None, "unknown until a restart");
    let mut notes = Vec::new();
    g.publish_noted("llm", 50, Some("0=8G"), &mut |c| {
        notes.push(c);
        Ok(())
    })
    .unwrap();
    assert_eq!(
        notes,
        vec![HostChange::File {
            path: dir.path().join("llm.env"),
            original: Some("OTHER=1\n".into())
        }],
        "the original is noted before the first write"
    );
    let env = std::fs::read_to_string(dir.path().join("llm.env")).unwrap();
    assert_eq!(
        env,
        "OTHER=1\nCUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50\nCUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8G\n"
    );
    assert_eq!((g.published("llm"), g.effective("llm")), (Some(50), None));
    let t0 = Instant::now();
    assert!(
        g.restart_due(t0, &BTreeMap::new()).is_empty(),
        "started, not waited for"
    );
    assert_eq!(g.effective("llm"), None, "pending while the hook runs");
    assert_eq!(settle(&mut g), vec!["llm"]);
    assert_eq!(g.effective("llm"), Some(50));
    g.publish_noted("llm", 70, None, &mut |c| panic!("noted again: {c:?}"))
        .unwrap();
    assert!(
        g.restart_due(t0 + Duration::from_secs(10), &BTreeMap::new())
            .is_empty()
            && !g.hooks_running(),
        "too soon after the last restart"
    );
    assert_eq!(
        (g.published("llm"), g.effective("llm")),
        (Some(70), Some(50))
    );
    g.restart_due(t0 + Duration::from_secs(61), &BTreeMap::new());
    assert_eq!(settle(&mut g), vec!["llm"]);
    assert_eq!(g.effective("llm"), Some(70));
    assert_eq!(
        std::fs::read_to_string(&log).unwrap(),
        "50\n70\n",
        "the hook sees the share"
    );
    assert_eq!(g.restore(), vec![dir.path().join("llm.env")]);
    assert_eq!(
        std::fs::read_to_string(dir.path().join("llm.env")).unwrap(),
        "OTHER=1\n"
    );
}

#[test]
fn a_failing_restart_hook_keeps_the_share_pending_and_a_known_share_needs_none() {
    let dir = tempfile::tempdir().unwrap();
    let mut g = GpuActuator::new(&[service(dir.path(), "exit 3", 0, 10_000)], None);
    g.publish("llm", 40, None).unwrap();
    g.restart_due(Instant::now(), &BTreeMap::new());
    assert!(settle(&mut g).is_empty());
    assert_eq!((g.published("llm"), g.effective("llm")), (Some(40), None));
    // A client started from a file that already holds the share has it.
    let again = GpuActuator::new(&[service(dir.path(), "exit 3", 0, 10_000)], None);
    assert_eq!(again.effective("llm"), Some(40));
    g.restore();
    assert!(
        !dir.path().join("llm.env").exists(),
        "a file cohabit created is removed"
    );
}

#[test]
fn a_hanging_hook_never_holds_a_tick_and_is_killed_with_its_group() {
    let dir = tempfile::tempdir().unwrap();
    let pgids = dir.path().join("pgids");
    let cmd = format!("echo $$ >> {}; sleep 3600", pgids.display());
    let mut g = GpuActuator::new(&[service(dir.path(), &cmd, 100, 500)], None);
    g.publish("llm", 40, None).unwrap();
    // Ticks every 100 ms for 1.5 s: none waits for the hook.
    let start = Instant::now();
    let mut ticks = 0;
    while start.elapsed() < Duration::from_millis(1500) {
        let t = Instant::now();
        g.restart_due(t, &BTreeMap::new());
        assert!(
            t.elapsed() < Duration::from_millis(250),
            "a tick waited for the hook"
        );
        ticks += 1;
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(ticks >= 8, "{ticks}");
    assert_eq!((g.published("llm"), g.effective("llm")), (Some(40), None));
    let first: u32 = std::fs::read_to_string(&pgids)
        .unwrap()
        .lines()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(
        live_members(first),
        Vec::<u32>::new(),
        "the first hook's group is gone"
    );
    // Shutdown does not wait for the one running now beyond a bounded time.
    let t = Instant::now();
    g.restore();
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    for pgid in std::fs::read_to_string(&pgids).unwrap().lines() {
        assert_eq!(live_members(pgid.parse().unwrap()), Vec::<u32>::new());
    }
    assert!(!g.hooks_running());
}

#[test]
fn a_symlinked_env_file_is_refused_and_its_target_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("shadow");
    std::fs::write(&target, "root:x:0:0\n").unwrap();
    std::os::unix::fs::symlink(&target, dir.path().join("llm.env")).unwrap();
    let services = [service(dir.path(), "true", 0, 1000)];
    let e = check_env_files(&services, false).unwrap_err();
    assert!(e.to_string().contains("symbolic link"), "{e}");
    let mut g = GpuActuator::new(&services, None);
    let e = g.publish("llm", 40, None).unwrap_err();
    assert!(
        matches!(&e, GpuError::File { service, .. } if service == "llm"),
        "{e}"
    );
    assert!(e.to_string().contains("symbolic link"), "{e}");
    assert_eq!(g.published("llm"), None);
    g.restore();
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "root:x:0:0\n");
}

#[test]
fn an_env_file_in_a_directory_others_can_write_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let shared = dir.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).unwrap();
    let services = [service(&shared, "true", 0, 1000)];
    let e = check_env_files(&services, false).unwrap_err().to_string();
    assert!(
        e.contains(&shared.display().to_string()) && e.contains("0777"),
        "{e}"
    );
    let mut g = GpuActuator::new(&services, None);
    assert!(g.publish("llm", 40, None).is_err());
    assert!(!shared.join("llm.env").exists());
    // A missing directory is created private; in a dry run nothing is created.
    let fresh = [service(&dir.path().join("new"), "true", 0, 1000)];
    check_env_files(&fresh, true).unwrap();
    assert!(!dir.path().join("new").exists());
    check_env_files(&fresh, false).unwrap();
    let mode = std::fs::metadata(dir.path().join("new"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o755);
}

#[test]
fn a_failed_note_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("llm.env"), "OTHER=1\n").unwrap();
    let mut g = GpuActuator::new(&[service(dir.path(), "true", 0, 1000)], None);
    let e = g
        .publish_noted("llm", 40, None, &mut |_| Err("disk full".into()))
        .unwrap_err();
    assert!(
        matches!(&e, GpuError::Note { path, source } if path.ends_with("llm.env") && source.to_string() == "disk full"),
        "{e}"
    );
    assert_eq!(
        std::fs::read_to_string(dir.path().join("llm.env")).unwrap(),
        "OTHER=1\n"
    );
    assert_eq!(g.published("llm"), None);
}

#[test]
fn restore_file_puts_back_a_noted_original_after_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("llm.env");
    std::fs::write(&path, "MODEL=small\nCUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50\n").unwrap();
    restore_file(&path, Some("MODEL=small\n")).unwrap();
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "MODEL=small\n");
    std::fs::write(&path, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50\n").unwrap();
    restore_file(&path, None).unwrap();
    assert!(!path.exists());
    restore_file(&path, None).unwrap();
    restore_file(&path, Some("A=1\n")).unwrap();
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "A=1\n");
}

fn fake_mps(dir: &Path) -> MpsControl {
    let bin =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../collectors/tests/fixtures/fake-mps-control");
    MpsControl::new(bin, Some(dir.to_path_buf()))
}

fn named(dir: &Path, server: &str) -> ManagedService {
    let mut s = service(dir, "exit 7", 0, 1000);
    if let Some(g) = s.gpu.as_mut() {
        g.mps_server = Some(server.into());
    }
    s
}

#[test]
fn on_a_v3_host_a_share_is_in_force_at_once_without_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let pipe = tempfile::tempdir().unwrap();
    std::fs::write(pipe.path().join("protocol"), "3\n").unwrap();
    std::fs::write(pipe.path().join("named_servers"), "llm\n").unwrap();
    let mps = fake_mps(pipe.path());
    let mut g = GpuActuator::with_probe(&[named(dir.path(), "llm")], Some(mps));
    assert_eq!(g.share_change(), ShareChange::Live);
    g.publish("llm", 45, None).unwrap();
    assert_eq!(
        (g.published("llm"), g.effective("llm")),
        (Some(45), Some(45))
    );
    assert_eq!(
        std::fs::read_to_string(pipe.path().join("live_pct.llm"))
            .unwrap()
            .trim(),
        "45"
    );
    // The environment file follows, so a later restart keeps the share; no hook runs
    // (it would fail: `exit 7`).
    let env = std::fs::read_to_string(dir.path().join("llm.env")).unwrap();
    assert!(
        env.contains("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=45"),
        "{env}"
    );
    g.restart_due(Instant::now(), &BTreeMap::new());
    assert!(!g.hooks_running());
}

#[test]
fn a_refused_live_change_keeps_the_previous_share_and_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let pipe = tempfile::tempdir().unwrap();
    std::fs::write(pipe.path().join("protocol"), "3\n").unwrap();
    std::fs::write(pipe.path().join("named_servers"), "llm\n").unwrap();
    let mps = fake_mps(pipe.path());
    // The configured server is not one the daemon knows.
    let mut g = GpuActuator::with_probe(&[named(dir.path(), "bert")], Some(mps.clone()));
    let e = g.publish("llm", 45, None).unwrap_err();
    assert!(
        matches!(&e, GpuError::Refused { service, pct: 45, source } if service == "llm" && source.to_string().contains("Server bert not found")),
        "{e}"
    );
    assert_eq!((g.published("llm"), g.effective("llm")), (None, None));
    assert!(!dir.path().join("llm.env").exists(), "nothing written");
    // A v2 daemon (protocol file gone) is probed as restart-only: no live command sent.
    std::fs::remove_file(pipe.path().join("protocol")).unwrap();
    let g2 = GpuActuator::with_probe(&[named(dir.path(), "llm")], Some(mps));
    assert_eq!(g2.share_change(), ShareChange::Restart);
    // An unknown answer to the probe (no daemon) is the restart path too.
    std::fs::write(pipe.path().join("down"), "").unwrap();
    let g3 = GpuActuator::with_probe(&[named(dir.path(), "llm")], Some(fake_mps(pipe.path())));
    assert_eq!(g3.share_change(), ShareChange::Restart);
}

#[test]
fn a_client_that_never_reconnects_keeps_its_previous_share() {
    let dir = tempfile::tempdir().unwrap();
    let pipe = tempfile::tempdir().unwrap();
    std::fs::write(pipe.path().join("servers"), "4100\n").unwrap();
    std::fs::write(pipe.path().join("clients.4100"), "5001\n").unwrap();
    let mps = fake_mps(pipe.path());
    let mut g = GpuActuator::new(&[service(dir.path(), "true", 0, 300)], Some(mps));
    g.publish("llm", 40, None).unwrap();
    let pids = BTreeMap::from([("llm".to_string(), vec![5001])]);
    g.restart_due(Instant::now(), &pids);
    settle(&mut g);
    // Back among MPS clients: in force.
    assert_eq!(g.restart_due(Instant::now(), &pids), vec!["llm"]);
    assert_eq!(g.effective("llm"), Some(40));
    // The next restart's client never comes back (pid 6001 is nobody's client).
    g.publish("llm", 60, None).unwrap();
    let gone = BTreeMap::from([("llm".to_string(), vec![6001])]);
    let t0 = Instant::now();
    g.restart_due(t0, &gone);
    settle(&mut g);
    assert!(g.restart_due(Instant::now(), &gone).is_empty());
    assert_eq!(g.effective("llm"), Some(40), "waits for the client");
    std::thread::sleep(Duration::from_millis(350));
    assert!(g.restart_due(Instant::now(), &gone).is_empty());
    assert_eq!(
        (g.published("llm"), g.effective("llm")),
        (Some(60), Some(40)),
        "given up on: the previous share stays the effective one"
    );
    g.restore();
}

#[test]
fn the_plans_pinned_limit_goes_into_the_clients_env_file() {
    let dir = tempfile::tempdir().unwrap();
    let mut g = GpuActuator::new(&[service(dir.path(), "true", 0, 1000)], None);
    g.set_pinned(&BTreeMap::from([
        ("llm".to_string(), 10_240),
        ("not-a-client".to_string(), 1),
    ]));
    g.publish("llm", 30, Some("0=8G")).unwrap();
    let env = std::fs::read_to_string(dir.path().join("llm.env")).unwrap();
    assert!(
        env.contains("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10240M"),
        "the planned limit wins over the configured default: {env}"
    );
    // A plan without a limit for it: the configured default is written with the next share.
    g.set_pinned(&BTreeMap::new());
    g.publish("llm", 40, Some("0=8G")).unwrap();
    let env = std::fs::read_to_string(dir.path().join("llm.env")).unwrap();
    assert!(
        env.contains("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8G"),
        "{env}"
    );
    g.restore();
}
