//! The MPS control interface against a fake `nvidia-cuda-mps-control` that reads commands on
//! standard input like the real one (tests/fixtures/fake-mps-control).

use std::path::PathBuf;

use cohabit_collectors::mps::{MpsControl, MpsError, Protocol};

fn fake() -> (tempfile::TempDir, MpsControl) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("servers"), "4100\n4200\n").unwrap();
    std::fs::write(dir.path().join("clients.4100"), "5001\n5002\n").unwrap();
    std::fs::write(dir.path().join("clients.4200"), "6001\n").unwrap();
    let bin = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/fake-mps-control");
    let ctl = MpsControl::new(bin, Some(dir.path().to_path_buf()));
    (dir, ctl)
}

fn log(dir: &tempfile::TempDir) -> Vec<String> {
    std::fs::read_to_string(dir.path().join("commands.log"))
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

#[test]
fn lists_are_read_and_servers_found_by_client() {
    let (dir, ctl) = fake();
    assert_eq!(ctl.server_list().unwrap(), vec![4100, 4200]);
    assert_eq!(ctl.client_list(4100).unwrap(), vec![5001, 5002]);
    assert_eq!(ctl.server_of(&[6001]).unwrap(), Some((4200, vec![6001])));
    assert_eq!(ctl.server_of(&[7]).unwrap(), None);
    assert_eq!(ctl.default_active_thread_percentage().unwrap(), 100.0);
    assert_eq!(log(&dir)[0], "get_server_list");
}

#[test]
fn settings_are_sent_as_the_documented_commands() {
    let (dir, ctl) = fake();
    ctl.set_default_active_thread_percentage(40).unwrap();
    assert_eq!(ctl.default_active_thread_percentage().unwrap(), 40.0);
    ctl.set_active_thread_percentage(4200, 30).unwrap();
    assert_eq!(
        std::fs::read_to_string(dir.path().join("server_pct.4200"))
            .unwrap()
            .trim(),
        "30"
    );
    ctl.set_default_device_pinned_mem_limit(0, "8G").unwrap();
    let l = log(&dir);
    assert!(
        l.contains(&"set_default_active_thread_percentage 40".to_string()),
        "{l:?}"
    );
    assert!(l.contains(&"set_active_thread_percentage 4200 30".to_string()));
    assert!(l.contains(&"set_default_device_pinned_mem_limit 0 8G".to_string()));
}

#[test]
fn refusals_and_a_missing_daemon_are_errors_with_the_answer() {
    let (dir, ctl) = fake();
    let err = ctl.set_active_thread_percentage(9999, 30).unwrap_err();
    assert!(
        matches!(&err, MpsError::Refused { answer, .. } if answer.contains("9999")),
        "{err}"
    );
    assert!(
        ctl.set_default_device_pinned_mem_limit(0, "8G; quit")
            .is_err(),
        "no command injection"
    );
    std::fs::write(dir.path().join("down"), "").unwrap();
    let err = ctl.server_list().unwrap_err().to_string();
    assert!(
        err.contains("Cannot find MPS control daemon process"),
        "{err}"
    );
    let missing = MpsControl::new("/nonexistent/nvidia-cuda-mps-control", None);
    assert!(matches!(missing.server_list(), Err(MpsError::Spawn { .. })));
}

#[test]
fn an_answer_larger_than_a_pipe_buffer_does_not_block_the_program() {
    let (dir, mut ctl) = fake();
    // About 160 KB: more than the 64 KiB a pipe holds before its writer blocks.
    let many: Vec<u32> = (100_000..120_000).collect();
    let text: String = many.iter().map(|p| format!("{p}\n")).collect();
    std::fs::write(dir.path().join("servers"), text).unwrap();
    ctl.timeout = std::time::Duration::from_secs(3);
    let started = std::time::Instant::now();
    assert_eq!(ctl.server_list().unwrap(), many);
    assert!(started.elapsed() < std::time::Duration::from_secs(2));
}

#[test]
fn a_v2_daemon_is_probed_as_percentages_only_with_the_refusals_in_its_words() {
    let (dir, ctl) = fake();
    std::fs::write(dir.path().join("version"), "13.1\n").unwrap();
    let caps = ctl.probe();
    assert_eq!(caps.version.as_deref(), Some("13.1"));
    assert!(caps.daemon_running && caps.thread_percentage);
    assert_eq!(caps.protocol, Protocol::V2);
    assert!(!caps.dynamic_adjustment && !caps.namespaces && !caps.static_partitions);
    let said = caps.refusals.join("\n");
    assert!(said.contains("Usage: nvidia-cuda-mps-control"), "{said}");
    assert!(
        said.contains("Static partitioning is not enabled"),
        "{said}"
    );
    // v3 adjustment on a v2 daemon: unsupported on this version, refused in its words.
    let err = ctl.update_server_share("llm", 40).unwrap_err().to_string();
    assert!(err.contains("Usage:"), "{err}");
}

#[test]
fn a_v3_daemon_offers_dynamic_adjustment_of_named_servers() {
    let (dir, ctl) = fake();
    std::fs::write(dir.path().join("protocol"), "3\n").unwrap();
    std::fs::write(dir.path().join("named_servers"), "llm\nresnet\n").unwrap();
    std::fs::write(dir.path().join("namespaces"), "inference\n").unwrap();
    let caps = ctl.probe();
    assert_eq!(caps.protocol, Protocol::V3);
    assert!(caps.daemon_running && caps.dynamic_adjustment && caps.namespaces);
    ctl.update_server_share("llm", 45).unwrap();
    assert_eq!(
        std::fs::read_to_string(dir.path().join("live_pct.llm"))
            .unwrap()
            .trim(),
        "45"
    );
    assert!(
        log(&dir).contains(&"server update --name=llm --active-thread-percentage=45".to_string())
    );
    // Refusals: an unknown server, a share out of range (cohabit refuses before sending),
    // a name that could smuggle options.
    let err = ctl.update_server_share("bert", 45).unwrap_err();
    assert!(
        matches!(&err, MpsError::Refused { answer, .. } if answer.contains("Server bert not found")),
        "{err}"
    );
    assert!(ctl.update_server_share("llm", 0).is_err());
    assert!(ctl.update_server_share("llm", 101).is_err());
    assert!(ctl.update_server_share("--name=resnet", 10).is_err());
    assert!(!dir.path().join("live_pct.resnet").exists());
}

#[test]
fn static_partitions_are_probed_created_and_their_refusals_kept() {
    let (dir, ctl) = fake();
    std::fs::write(dir.path().join("static"), "8\n").unwrap();
    assert!(ctl.probe().static_partitions);
    let id = ctl.add_partition("GPU-1234-abcd", 3).unwrap();
    assert_eq!(id, "GPU-1234-abcd/p1");
    assert_eq!(ctl.list_partitions().unwrap(), vec!["GPU-1234-abcd/p1 3"]);
    let err = ctl
        .add_partition("GPU-1234-abcd", 6)
        .unwrap_err()
        .to_string();
    assert!(err.contains("Invalid chunk count 6 (5 free)"), "{err}");
    assert!(ctl.add_partition("GPU-1; quit", 1).is_err());
}

#[test]
fn without_a_daemon_the_probe_reports_nothing_offered_and_why() {
    let (dir, ctl) = fake();
    std::fs::write(dir.path().join("down"), "").unwrap();
    let caps = ctl.probe();
    assert!(!caps.daemon_running && !caps.thread_percentage && !caps.dynamic_adjustment);
    assert!(
        caps.refusals
            .iter()
            .any(|r| r.contains("Cannot find MPS control daemon process")),
        "{:?}",
        caps.refusals
    );
}
