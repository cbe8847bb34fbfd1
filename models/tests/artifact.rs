//! The model artifact: save, load, score, and clear errors for bad artifacts.

use cohabit_models::{Model, ModelError, N_FEATURES};
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
