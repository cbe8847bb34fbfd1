//! Training: parity of the pure-Rust inference with tch, datasets from the simulator and
//! from decision logs, and a small end-to-end fit.

use cohabit_models::mlp::Ensemble;
use cohabit_models::{Model, FEATURE_NAMES, N_FEATURES, PRESENCE_FLAGS};
use cohabit_sim::catalogue::Platform;
use cohabit_training::dataset::Dataset;
use cohabit_training::fit::{self, FitConfig};
use cohabit_training::gen::{generate, GenConfig};
use ndarray::{Array1, Array2};
use tch::nn::{self, Module};

#[test]
fn rust_inference_matches_the_tch_forward_pass_within_1e_4() {
    tch::manual_seed(3);
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let hidden = [32, 32];
    let net = fit::mlp(vs.root(), N_FEATURES, &hidden);
    let member = fit::export(&vs, hidden.len() + 1).unwrap();
    let x = Array2::from_shape_fn((257, N_FEATURES), |(i, j)| {
        (((i * 13 + j * 7) % 29) as f32 - 14.0) / 7.0
    });
    let torch: Vec<f32> =
        Vec::<f32>::try_from(&net.forward(&fit::to_tensor(&x)).flatten(0, -1)).unwrap();
    let ours = member.forward(x.view());
    let worst = torch
        .iter()
        .zip(ours.iter())
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(worst <= 1e-4, "largest difference {worst}");
    // Through the ensemble wrapper with identity normalisation, too.
    let e = Ensemble {
        members: vec![member],
        mean: Array1::zeros(N_FEATURES),
        std: Array1::ones(N_FEATURES),
    };
    assert!((e.predict(x.view()).0[0] - torch[0]).abs() <= 1e-4);
}

fn small(seed: u64) -> Dataset {
    generate(
        &GenConfig {
            scenes: 200,
            candidates: 3,
            seed,
            platform: Platform::XeonE5_2697V4,
            services: None,
        },
        |_, _| {},
    )
}

#[test]
fn generated_rows_are_finite_deterministic_and_cover_many_services() {
    let a = small(5);
    assert_eq!(a, small(5));
    assert_ne!(a, small(6));
    assert!(a.rows.len() > 400, "{}", a.rows.len());
    assert!(a.rows.iter().all(|r| r.features.len() == N_FEATURES
        && r.features.iter().all(|v| v.is_finite())
        && r.target.is_finite()));
    assert!(a.services().len() >= 8, "{:?}", a.services());
    // Targets span meeting and missing the target.
    assert!(a.rows.iter().any(|r| r.target < 0.0) && a.rows.iter().any(|r| r.target > 0.0));
}

#[test]
fn generated_rows_include_hosts_without_counters_or_rdt_and_ticks_without_latency() {
    let a = small(5);
    let col = |n: &str| FEATURE_NAMES.iter().position(|x| *x == n).unwrap();
    let share = |flag: &str| {
        let absent = a
            .rows
            .iter()
            .filter(|r| r.features[col(flag)] == 0.0)
            .count();
        absent as f64 / a.rows.len() as f64
    };
    // 35 % of scenes without counters, 40 % without RDT monitoring (25 % without both),
    // 5 % of readings without latency; besides the rare missing reading.
    for flag in ["has_ipc", "has_miss_rate", "has_occupancy", "has_bw"] {
        let s = share(flag);
        assert!((0.15..0.5).contains(&s), "{flag} absent in {s:.2} of rows");
    }
    let s = share("has_qos_now");
    assert!(
        (0.01..0.15).contains(&s),
        "has_qos_now absent in {s:.2} of rows"
    );
    // An absent reading is 0, never another value.
    for (value, flag) in PRESENCE_FLAGS {
        assert!(a
            .rows
            .iter()
            .filter(|r| r.features[col(flag)] == 0.0)
            .all(|r| r.features[col(value)] == 0.0));
    }
}

#[test]
fn a_small_fit_beats_predicting_the_mean_and_round_trips_through_the_artifact() {
    let data = small(7);
    let (train, test) = cohabit_training::eval::split(&data, 0.2, 1);
    let (tr, va) = train.split_at(train.len() * 85 / 100);
    let cfg = FitConfig {
        members: 2,
        epochs: 15,
        ..FitConfig::default()
    };
    let model = fit::fit(tr, va, &cfg, None, |_, _| {}).unwrap();
    let err = cohabit_training::eval::model_errors(&model, &test);
    let mean = tr.iter().map(|r| r.target).sum::<f32>() / tr.len() as f32;
    let mut naive: Vec<f32> = test.iter().map(|r| (r.target - mean).abs()).collect();
    naive.sort_by(f32::total_cmp);
    assert!(
        err.mean_abs_error < f64::from(naive.iter().sum::<f32>() / naive.len() as f32),
        "{err:?}"
    );
    let dir = tempfile::tempdir().unwrap();
    let path = model.save(dir.path(), "m").unwrap();
    let back = Model::load(&path).unwrap();
    assert_eq!(back.meta.sigma_scale, model.meta.sigma_scale);
    // Warm start from it: the same shape is accepted, a different one refused.
    assert!(fit::fit(
        tr,
        va,
        &FitConfig {
            members: 1,
            epochs: 1,
            ..cfg.clone()
        },
        Some(&back),
        |_, _| {}
    )
    .is_ok());
    assert!(fit::fit(
        tr,
        va,
        &FitConfig {
            hidden: vec![8],
            ..cfg
        },
        Some(&back),
        |_, _| {}
    )
    .is_err());
}

#[test]
fn decision_logs_become_rows() {
    use std::sync::Arc;
    let sc = Arc::new(cohabit_sim::Scenario::load("demo").unwrap());
    let run =
        cohabit_lab::simulate::run_policy(&sc, cohabit_lab::LabPolicy::Parties, None, None, |_| {
            Ok(())
        })
        .unwrap();
    let host = sc.capacity().clone();
    let rows = cohabit_training::logs::rows_from_log(&run.records[..50], &host);
    // Two latency-critical services, 49 consecutive pairs.
    assert_eq!(rows.rows.len(), 2 * 49);
    assert!(rows
        .rows
        .iter()
        .all(|r| r.features.iter().all(|v| v.is_finite())));
    assert_eq!(
        rows.services(),
        vec!["memcached".to_string(), "xapian".to_string()]
    );
}

#[test]
fn a_logs_header_supplies_the_host_even_one_unlike_every_preset() {
    use std::sync::Arc;

    use cohabit_core::{DecisionLogWriter, LogHeader};
    use cohabit_training::logs::{rows_from_file, rows_from_log};

    let sc = Arc::new(cohabit_sim::Scenario::load("demo").unwrap());
    let run =
        cohabit_lab::simulate::run_policy(&sc, cohabit_lab::LabPolicy::Parties, None, None, |_| {
            Ok(())
        })
        .unwrap();
    let records = &run.records[..40];
    // A host no preset describes: more cores and ways, less bandwidth, fewer CLOSIDs.
    let mut host = sc.capacity().clone();
    host.name = "custom test host".into();
    host.cores += 12;
    host.llc_ways += 5;
    host.mem_bw_bytes_per_s *= 0.6;
    host.closids = 7;
    host.mba_min_pct = 20;
    host.mba_gran_pct = 5;
    host.validate().unwrap();
    assert!(Platform::ALL.iter().all(|(_, p)| p.host().capacity != host));

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("decisions.jsonl");
    let file = std::fs::File::create(&path).unwrap();
    let mut log =
        DecisionLogWriter::new(file, &LogHeader::new("parties", true, host.clone())).unwrap();
    for r in records {
        log.write(r).unwrap();
    }
    drop(log);

    // No preset is needed, and the header's host is the one used.
    let rows = rows_from_file(&path, None).unwrap();
    assert_eq!(rows.rows.len(), 2 * 39);
    assert_eq!(rows, rows_from_log(records, &host));
    for (name, p) in Platform::ALL {
        assert_ne!(rows, rows_from_log(records, &p.host().capacity), "{name}");
        // A preset given for old logs does not override a header.
        assert_eq!(
            rows_from_file(&path, Some(&p.host().capacity)).unwrap(),
            rows
        );
    }
    // The rows train.
    let all: Vec<_> = rows.rows.iter().collect();
    let ridge = fit::Ridge::fit(&all).unwrap();
    assert!(ridge.predict(&all).iter().all(|y| y.is_finite()));
}

#[test]
fn a_version_1_log_needs_the_platform_named() {
    use std::sync::Arc;

    use cohabit_training::logs::rows_from_file;

    let sc = Arc::new(cohabit_sim::Scenario::load("demo").unwrap());
    let run =
        cohabit_lab::simulate::run_policy(&sc, cohabit_lab::LabPolicy::Static, None, None, |_| {
            Ok(())
        })
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("old.jsonl");
    let text: String = run.records[..10]
        .iter()
        .map(|r| serde_json::to_string(r).unwrap() + "\n")
        .collect();
    std::fs::write(&path, text).unwrap();
    let e = format!("{:#}", rows_from_file(&path, None).unwrap_err());
    assert!(
        e.contains("old.jsonl") && e.contains("version-1") && e.contains("--platform"),
        "{e}"
    );
    let rows = rows_from_file(&path, Some(sc.capacity())).unwrap();
    assert_eq!(rows.rows.len(), 2 * 9);
}

#[test]
fn a_small_gpu_fit_beats_the_mean_and_is_a_gpu_artifact_refused_as_a_cpu_one() {
    use cohabit_models::{CPU_SCHEMA, GPU_SCHEMA};
    use cohabit_training::gen_gpu::{generate_gpu, GpuGenConfig};

    let data = generate_gpu(
        &GpuGenConfig {
            scenes: 300,
            candidates: 4,
            seed: 9,
            platform: Platform::XeonE5_2697V4A100,
        },
        |_, _| {},
    )
    .unwrap();
    let (train, test) = cohabit_training::eval::split(&data, 0.2, 1);
    let (tr, va) = train.split_at(train.len() * 85 / 100);
    let cfg = FitConfig {
        members: 2,
        epochs: 15,
        schema: &GPU_SCHEMA,
        ..FitConfig::default()
    };
    let model = fit::fit(tr, va, &cfg, None, |_, _| {}).unwrap();
    assert_eq!(model.schema(), &GPU_SCHEMA);
    let err = cohabit_training::eval::model_errors(&model, &test);
    let mean = tr.iter().map(|r| r.target).sum::<f32>() / tr.len() as f32;
    let naive = test.iter().map(|r| (r.target - mean).abs()).sum::<f32>() / test.len() as f32;
    assert!(err.mean_abs_error < f64::from(naive), "{err:?} vs {naive}");
    let dir = tempfile::tempdir().unwrap();
    let path = model.save(dir.path(), "g").unwrap();
    assert!(Model::load_gpu(&path).is_ok());
    let e = Model::load(&path).unwrap_err().to_string();
    assert!(e.contains("qos-gpu-v1") && e.contains("qos-v1"), "{e}");
    // CPU rows are refused by a GPU fit, naming both widths.
    let cpu = small(3);
    let rows: Vec<_> = cpu.rows.iter().collect();
    let e = fit::fit(&rows, &rows, &cfg, None, |_, _| {})
        .unwrap_err()
        .to_string();
    assert!(e.contains("24 features") && e.contains("has 17"), "{e}");
    // And a GPU model cannot warm-start a CPU fit.
    let e = fit::fit(
        &rows,
        &rows,
        &FitConfig {
            schema: &CPU_SCHEMA,
            ..cfg
        },
        Some(&model),
        |_, _| {},
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("warm start from a model of schema qos-gpu-v1"),
        "{e}"
    );
}

#[test]
fn a_dataset_of_one_service_has_nothing_to_hold_out_and_says_so_instead_of_panicking() {
    // The logs of one host running one service (realbench's memcached alone): `eval`'s
    // leave-one-service-out baseline has no other service to fit on.
    let mut one = small(7);
    let first = one.rows[0].service.clone();
    one.rows.retain(|r| r.service == first);
    assert!(!one.rows.is_empty());
    let held = cohabit_training::eval::ridge_held_out(&one).unwrap();
    assert_eq!(held.rows, 0);
    let err = fit::Ridge::fit(&[]).unwrap_err().to_string();
    assert!(err.contains("ridge baseline needs rows"), "{err}");
    // With two services each is held out against the other.
    let two = small(7);
    assert!(two.services().len() > 1);
    assert_eq!(
        cohabit_training::eval::ridge_held_out(&two).unwrap().rows,
        two.rows.len()
    );
}

#[test]
fn fit_takes_the_hidden_widths_and_a_warm_start_must_name_the_same() {
    const TRAIN: &str = env!("CARGO_BIN_EXE_cohabit-train");
    let dir = tempfile::tempdir().unwrap();
    let run = |args: &[&str]| {
        let out = std::process::Command::new(TRAIN)
            .args(args)
            .current_dir(dir.path())
            .output()
            .unwrap();
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), said)
    };
    let (ok, said) = run(&[
        "gen",
        "--scenes",
        "60",
        "--seed",
        "3",
        "--out",
        "rows.jsonl",
    ]);
    assert!(ok, "{said}");
    let fit = [
        "fit",
        "--data",
        "rows.jsonl",
        "--members",
        "1",
        "--epochs",
        "2",
    ];
    let (ok, said) = run(&[
        &fit[..],
        &["--no-held-out", "--hidden", "8,4", "--out", "m"],
    ]
    .concat());
    assert!(ok, "{said}");
    let model = Model::load(&dir.path().join("m/qos.json")).unwrap();
    assert_eq!(model.meta.hidden, vec![8, 4]);
    // A warm start keeps the widths it starts from: the default (32, 32) is refused.
    let (ok, said) = run(&[
        &fit[..],
        &["--no-held-out", "--init", "m/qos.json", "--out", "w"],
    ]
    .concat());
    assert!(!ok);
    assert!(said.contains("hidden [8, 4] into [32, 32]"), "{said}");
}
