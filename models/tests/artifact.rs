//! The model artifact: save, load, score, and clear errors for bad artifacts.

use cohabit_models::{Model, ModelError, CPU_SCHEMA, GPU_SCHEMA, N_FEATURES, N_GPU_FEATURES};
use ndarray::Array2;

fn rows(n: usize) -> Array2<f32> {
    Array2::from_shape_fn((n, N_FEATURES), |(i, j)| {
        ((i * 7 + j * 3) % 11) as f32 / 11.0
    })
}

#[test]
fn a_saved_model_loads_back_and_scores_identically() {
    let dir = tempfile::tempdir().unwrap();
    let m = Model::synthetic(5, &[32, 32], 7);
    let path = m.save(dir.path(), "qos").unwrap();
    let back = Model::load(&path).unwrap();
    assert_eq!(back.ensemble, m.ensemble);
    let x = rows(100);
    let (a, sa) = m.score(x.view());
    let (b, sb) = back.score(x.view());
    assert_eq!(a, b);
    assert_eq!(sa, sb);
    assert!(sa.iter().all(|s| *s > 0.0), "different members disagree");
}

#[test]
fn batch_scoring_equals_scoring_one_at_a_time() {
    let m = Model::synthetic(3, &[16], 1);
    let x = rows(20);
    let (batch, _) = m.score(x.view());
    for i in 0..20 {
        let (one, _) = m.score(x.slice(ndarray::s![i..i + 1, ..]));
        assert!((one[0] - batch[i]).abs() < 1e-6);
    }
}

fn saved() -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = Model::synthetic(2, &[8], 3).save(dir.path(), "m").unwrap();
    (dir, path)
}

fn edit_meta(path: &std::path::Path, f: impl FnOnce(&mut serde_json::Value)) {
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(path, v.to_string()).unwrap();
}

fn load_err(path: &std::path::Path) -> String {
    match Model::load(path) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("a bad artifact loaded"),
    }
}

#[test]
fn a_wrong_schema_or_feature_list_is_refused_with_the_reason() {
    let (_d, path) = saved();
    edit_meta(&path, |v| v["schema_version"] = 99.into());
    let e = load_err(&path);
    assert!(e.contains("schema 99") && e.contains("m.json"), "{e}");
    let (_d, path) = saved();
    edit_meta(&path, |v| v["features"][3] = "something_else".into());
    assert!(load_err(&path).contains("position 3"));
    let (_d, path) = saved();
    edit_meta(&path, |v| v["norm_std"][0] = 0.0.into());
    assert!(load_err(&path).contains("non-positive scale"));
    let (_d, path) = saved();
    edit_meta(&path, |v| v["hidden"] = serde_json::json!([9]));
    let e = load_err(&path);
    assert!(e.contains("shape") && e.contains("m.safetensors"), "{e}");
    let (_d, path) = saved();
    std::fs::write(&path, "{ not json").unwrap();
    assert!(matches!(
        Model::load(&path),
        Err(ModelError::Metadata { .. })
    ));
}

#[test]
fn truncated_or_missing_weights_are_errors_not_panics() {
    let (d, path) = saved();
    let w = d.path().join("m.safetensors");
    let bytes = std::fs::read(&w).unwrap();
    for cut in [0, 7, 8, bytes.len() / 2, bytes.len() - 1] {
        std::fs::write(&w, &bytes[..cut]).unwrap();
        let e = load_err(&path);
        assert!(e.contains("m.safetensors"), "cut at {cut}: {e}");
    }
    std::fs::remove_file(&w).unwrap();
    assert!(matches!(Model::load(&path), Err(ModelError::Io { .. })));
    edit_meta(&path, |v| v["members"] = 3.into());
    std::fs::write(&w, &bytes).unwrap();
    assert!(
        load_err(&path).contains("m2.l0.weight"),
        "a missing member's tensors are named"
    );
}

#[test]
fn only_the_candidate_features_depend_on_the_candidate() {
    use cohabit_core::{Allocation, HostCapacity, Sample, WayRange};
    use cohabit_models::features::CANDIDATE_FEATURES;
    use cohabit_models::{features, Neighbours};
    let host = HostCapacity {
        name: "t".into(),
        cores: 36,
        freq_ghz: 2.3,
        llc_ways: 20,
        llc_way_bytes: 1 << 21,
        mem_bw_bytes_per_s: 7e10,
        gpus: vec![],
        closids: 16,
        mba_min_pct: 10,
        mba_gran_pct: 10,
        min_cbm_bits: 1,
        shareable_bits: 0,
    };
    let sample = Sample {
        ipc: Some(1.1),
        p99_ms: Some(0.4),
        cpu_busy_cores: Some(3.0),
        requests_per_s: Some(1e5),
        ..Sample::default()
    };
    let alloc = |c, w, m| Allocation {
        cores: c,
        llc_ways: WayRange::new(0, w),
        mba_pct: m,
        gpu_mps_pct: None,
    };
    let current = alloc(6, 4, 100);
    let n = Neighbours::default();
    let gpu = Allocation {
        gpu_mps_pct: Some(30),
        ..alloc(3, 2, 50)
    };
    let a = features(&host, 1.0, &sample, &current, &gpu, &n);
    let b = features(&host, 1.0, &sample, &current, &alloc(9, 7, 100), &n);
    for j in 0..N_FEATURES {
        assert_eq!(
            a[j] != b[j],
            CANDIDATE_FEATURES.contains(&j),
            "feature {j} ({})",
            cohabit_models::FEATURE_NAMES[j]
        );
    }
}

#[test]
fn scoring_shared_rows_equals_scoring_them_in_full() {
    use cohabit_models::features::CANDIDATE_FEATURES;
    let m = Model::synthetic(3, &[16, 8], 5);
    let mut x = rows(12);
    // Rows equal outside the candidate columns, as candidates of one service are.
    for i in 1..x.nrows() {
        for j in (0..N_FEATURES).filter(|j| !CANDIDATE_FEATURES.contains(j)) {
            x[[i, j]] = x[[0, j]];
        }
    }
    let full = m.ensemble.members_predict(x.view());
    let shared = m
        .ensemble
        .members_predict_shared(x.view(), &CANDIDATE_FEATURES);
    for (a, b) in full.iter().zip(shared.iter()) {
        assert!((a - b).abs() < 1e-4, "{a} vs {b}");
    }
    // The change from row 0 to row 0 is nothing, with no spread.
    let (d, s) = m.score_change(x.row(0), x.slice(ndarray::s![0..1, ..]));
    assert!(d[0].abs() < 1e-5 && s[0].abs() < 1e-3, "{} {}", d[0], s[0]);
}

#[test]
fn an_absurd_ensemble_size_is_refused_before_anything_is_allocated() {
    let (_d, path) = saved();
    edit_meta(&path, |v| {
        v["members"] = serde_json::json!(1_000_000_000_000_000u64)
    });
    assert!(load_err(&path).contains("members must be between 1 and 64"));
    let (_d, path) = saved();
    edit_meta(&path, |v| v["hidden"] = serde_json::json!([1_000_000]));
    assert!(load_err(&path).contains("hidden must be"));
}

#[test]
fn weights_outside_the_artifact_directory_or_not_regular_files_are_refused() {
    for bad in [
        "/dev/zero",
        "../m.safetensors",
        "sub/m.safetensors",
        ".hidden",
    ] {
        let (_d, path) = saved();
        edit_meta(&path, |v| v["weights"] = serde_json::json!(bad));
        let e = load_err(&path);
        assert!(e.contains("weights must be a file name"), "{bad}: {e}");
    }
    // A name that is a directory (or a FIFO, a device) is not read.
    let (d, path) = saved();
    std::fs::create_dir(d.path().join("dir.safetensors")).unwrap();
    edit_meta(&path, |v| {
        v["weights"] = serde_json::json!("dir.safetensors")
    });
    assert!(load_err(&path).contains("not a regular file"));
}

#[test]
fn weights_of_another_training_run_are_refused_by_their_digest() {
    let dir = tempfile::tempdir().unwrap();
    let path = Model::synthetic(2, &[8], 3).save(dir.path(), "m").unwrap();
    let meta = std::fs::read_to_string(&path).unwrap();
    assert!(meta.contains("\"weights_digest\": \"sha256:"), "{meta}");
    // Same shapes, other values: a retrain wrote new weights beside the old metadata.
    Model::synthetic(2, &[8], 4).save(dir.path(), "m").unwrap();
    std::fs::write(&path, meta).unwrap();
    assert!(load_err(&path).contains("differs from the metadata"));
}

#[test]
fn a_non_finite_weight_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut m = Model::synthetic(1, &[4], 3);
    m.ensemble.members[0].layers[0].weight[[0, 0]] = f32::NAN;
    let path = m.save(dir.path(), "m").unwrap();
    assert!(load_err(&path).contains("non-finite"));
}

#[test]
fn a_gpu_model_loads_as_a_gpu_model_and_scores_its_own_width() {
    let dir = tempfile::tempdir().unwrap();
    let m = Model::synthetic_schema(&GPU_SCHEMA, 3, &[8], 5);
    let path = m.save(dir.path(), "g").unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.contains("\"schema\": \"qos-gpu\""), "{text}");
    let back = Model::load_gpu(&path).unwrap();
    assert_eq!(back.schema(), &GPU_SCHEMA);
    assert_eq!(back.ensemble, m.ensemble);
    let x = Array2::from_shape_fn((4, N_GPU_FEATURES), |(i, j)| (i + j) as f32 / 10.0);
    let (a, _) = back.score(x.view());
    assert_eq!(a.len(), 4);
    // CPU artifacts carry no `schema` field: written and read as before.
    let cpu = Model::synthetic(2, &[8], 3).save(dir.path(), "c").unwrap();
    let text = std::fs::read_to_string(&cpu).unwrap();
    assert!(!text.contains("\"schema\":"), "{text}");
    assert_eq!(Model::load(&cpu).unwrap().schema(), &CPU_SCHEMA);
}

#[test]
fn a_model_of_the_other_schema_is_refused_naming_what_was_expected_and_found() {
    let dir = tempfile::tempdir().unwrap();
    let gpu = Model::synthetic_schema(&GPU_SCHEMA, 2, &[8], 5)
        .save(dir.path(), "g")
        .unwrap();
    let e = load_err(&gpu);
    assert!(
        e.contains("g.json")
            && e.contains("trained on feature schema qos-gpu-v1")
            && e.contains("expected a model of feature schema qos-v1 (CPU services)"),
        "{e}"
    );
    let cpu = Model::synthetic(2, &[8], 3).save(dir.path(), "c").unwrap();
    let e = Model::load_gpu(&cpu).unwrap_err().to_string();
    assert!(
        e.contains("c.json")
            && e.contains("trained on feature schema qos-v1 (CPU services)")
            && e.contains("expected a model of feature schema qos-gpu-v1"),
        "{e}"
    );
}

#[test]
fn a_gpu_model_of_an_older_or_unknown_schema_is_refused_with_both_named() {
    let dir = tempfile::tempdir().unwrap();
    let path = Model::synthetic_schema(&GPU_SCHEMA, 2, &[8], 5)
        .save(dir.path(), "g")
        .unwrap();
    edit_meta(&path, |v| v["schema_version"] = 0.into());
    let e = Model::load_gpu(&path).unwrap_err().to_string();
    assert!(
        e.contains("schema 0 of \"qos-gpu\"") && e.contains("this build speaks qos-gpu-v1"),
        "{e}"
    );
    edit_meta(&path, |v| v["schema"] = "qos-tpu".into());
    let e = Model::load_gpu(&path).unwrap_err().to_string();
    assert!(
        e.contains("\"qos-tpu\" (unknown to this build)") && e.contains("qos-gpu-v1"),
        "{e}"
    );
}

/// Makes a FIFO at `path`; false where `mkfifo` is missing.
fn mkfifo(path: &std::path::Path) -> bool {
    std::process::Command::new("mkfifo")
        .arg(path)
        .status()
        .is_ok_and(|s| s.success())
}

/// `f` run on a thread of its own, waited for at most `limit`: a load that blocks (a FIFO
/// opened without `O_NONBLOCK`) fails the test instead of hanging it.
fn within<T: Send + 'static>(
    limit: std::time::Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit)
        .unwrap_or_else(|_| panic!("still blocked after {limit:?}"))
}

#[test]
fn a_fifo_as_metadata_or_weights_is_refused_within_a_second_naming_it() {
    use cohabit_models::LoadRules;
    let second = std::time::Duration::from_secs(1);
    for rules in [LoadRules::default(), LoadRules::daemon(0)] {
        // The metadata itself.
        let dir = tempfile::tempdir().unwrap();
        let meta = dir.path().join("qos.json");
        if !mkfifo(&meta) {
            cohabit_testkit::skip(cohabit_testkit::Need::Machine, "mkfifo is not available");
            return;
        }
        let r = rules.clone();
        let e = within(second, move || {
            Model::load_files(&meta, &CPU_SCHEMA, &r)
                .map(|_| ())
                .unwrap_err()
                .to_string()
        });
        assert!(
            e.contains("not a regular file (a FIFO)") && e.contains("qos.json"),
            "{e}"
        );
        // The weights it names.
        let (d, path) = saved();
        let w = d.path().join("m.safetensors");
        std::fs::remove_file(&w).unwrap();
        assert!(mkfifo(&w));
        let r = rules.clone();
        let e = within(second, move || {
            Model::load_files(&path, &CPU_SCHEMA, &r)
                .map(|_| ())
                .unwrap_err()
                .to_string()
        });
        assert!(
            e.contains("not a regular file (a FIFO)") && e.contains("m.safetensors"),
            "{e}"
        );
    }
}

#[test]
fn the_daemon_refuses_a_model_others_can_write_or_another_user_owns() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    use cohabit_models::LoadRules;
    let (d, path) = saved();
    let me = std::fs::metadata(&path).unwrap().uid();
    let rules = LoadRules::daemon(me);
    Model::load_files(&path, &CPU_SCHEMA, &rules).expect("a private file of ours loads");
    for (file, mode) in [
        ("m.json", 0o666),
        ("m.safetensors", 0o620),
        ("m.json", 0o602),
    ] {
        let (d, path) = saved();
        let f = d.path().join(file);
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(mode)).unwrap();
        let e = Model::load_files(&path, &CPU_SCHEMA, &rules)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&format!("mode {mode:04o}: group or others can write it"))
                && e.contains(file),
            "{file} {mode:o}: {e}"
        );
        // The tools read a user's own files as they are.
        Model::load(&path).expect("the tools' rules do not look at the mode");
    }
    // Owned by someone else: only the owners listed are trusted.
    let other = LoadRules {
        owners: Some(vec![me.wrapping_add(1)]),
        require_weights_digest: true,
    };
    let e = Model::load_files(&path, &CPU_SCHEMA, &other)
        .unwrap_err()
        .to_string();
    assert!(e.contains(&format!("owned by uid {me}")), "{e}");
    drop(d);
}

#[test]
fn the_daemon_follows_only_its_own_users_links_and_needs_a_weights_digest() {
    use std::os::unix::fs::MetadataExt;

    use cohabit_models::LoadRules;
    let (d, path) = saved();
    let me = std::fs::metadata(&path).unwrap().uid();
    // A ConfigMap volume's layout: qos.json -> ..data/qos.json, ..data -> a version dir.
    let version = d.path().join("..2026_01_01");
    std::fs::create_dir(&version).unwrap();
    for f in ["m.json", "m.safetensors"] {
        std::fs::rename(d.path().join(f), version.join(f)).unwrap();
    }
    std::os::unix::fs::symlink("..2026_01_01", d.path().join("..data")).unwrap();
    for f in ["m.json", "m.safetensors"] {
        std::os::unix::fs::symlink(format!("..data/{f}"), d.path().join(f)).unwrap();
    }
    let loaded = Model::load_files(&path, &CPU_SCHEMA, &LoadRules::daemon(me)).unwrap();
    assert!(loaded.meta_digest.starts_with("sha256:"));
    // A link owned by anyone else is not followed.
    let stranger = LoadRules {
        owners: Some(vec![me.wrapping_add(1)]),
        require_weights_digest: false,
    };
    let e = Model::load_files(&path, &CPU_SCHEMA, &stranger)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&format!("a symbolic link owned by uid {me}")) && e.contains("m.json"),
        "{e}"
    );
    // Metadata without a digest loads in the tools, not in the daemon.
    let (_d, path) = saved();
    edit_meta(&path, |v| {
        v.as_object_mut().unwrap().remove("weights_digest");
    });
    Model::load(&path).expect("tools take an artifact without a digest");
    let e = Model::load_files(&path, &CPU_SCHEMA, &LoadRules::daemon(me))
        .unwrap_err()
        .to_string();
    assert!(e.contains("no weights_digest"), "{e}");
}

#[test]
fn weights_past_the_cap_are_refused_before_they_are_read() {
    let (d, path) = saved();
    let w = d.path().join("m.safetensors");
    let f = std::fs::OpenOptions::new().write(true).open(&w).unwrap();
    f.set_len(cohabit_models::artifact::MAX_WEIGHTS_BYTES + 1)
        .unwrap();
    let e = load_err(&path);
    assert!(
        e.contains("larger than 67108864") && e.contains("m.safetensors"),
        "{e}"
    );
}
