//! Fleet retraining end to end: many hosts' decision logs (directories, rotated and
//! compressed files, globs, a copy collected twice, a bad line) become one dataset with
//! rows per host; and logs explored on the simulator (`simulate --explore`) train a model
//! warm-started from the shipped one through the `cohabit-train` binary.

use std::io::Write;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use cohabit_core::{DecisionLogWriter, DecisionPath, DecisionRecord, HostCapacity, LogHeader};
use cohabit_lab::LabPolicy;
use cohabit_models::Model;
use cohabit_training::dataset::Dataset;
use cohabit_training::logs::{expand_sources, rows_from_log, Fleet};

const TRAIN: &str = env!("CARGO_BIN_EXE_cohabit-train");

fn demo_records(ticks: usize) -> (Vec<DecisionRecord>, HostCapacity) {
    let sc = Arc::new(cohabit_sim::Scenario::load("demo").unwrap());
    let run =
        cohabit_lab::simulate::run_policy(&sc, LabPolicy::Parties, None, None, |_| Ok(())).unwrap();
    (run.records[..ticks].to_vec(), sc.capacity().clone())
}

fn log_bytes(host: &HostCapacity, records: &[DecisionRecord]) -> Vec<u8> {
    let mut w =
        DecisionLogWriter::new(Vec::new(), &LogHeader::new("parties", true, host.clone())).unwrap();
    for r in records {
        w.write(r).unwrap();
    }
    w.into_inner()
}

fn write(path: &Path, bytes: &[u8]) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, bytes).unwrap();
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

#[test]
fn a_fleets_logs_give_rows_per_host_once_each_whatever_the_files() {
    let (records, e5) = demo_records(60);
    let mut a = e5.clone();
    a.name = "node-a".into();
    // Another host: more cores and ways, so its rows are featurised differently.
    let mut b = e5.clone();
    b.name = "node-b".into();
    b.cores += 12;
    b.llc_ways += 5;
    b.validate().unwrap();

    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    // node-a: the live log and a rotated one, each with its header, as the daemon writes.
    let live_a = log_bytes(&a, &records[..30]);
    let rotated_a = log_bytes(&a, &records[30..50]);
    write(&root.join("node-a/decisions.jsonl"), &live_a);
    write(&root.join("node-a/decisions.jsonl.1"), &rotated_a);
    // … its rotated log again, compressed by logrotate (zstd), and the whole live log
    // collected a second time elsewhere.
    write(
        &root.join("node-a/decisions.jsonl.1.zst"),
        &zstd::encode_all(&rotated_a[..], 3).unwrap(),
    );
    write(&root.join("again/node-a-decisions.jsonl"), &live_a);
    // node-b: gzip, and a rotated log with a bad line in the middle.
    write(
        &root.join("node-b/decisions.jsonl.gz"),
        &gzip(&log_bytes(&b, &records[..40])),
    );
    let mut broken = log_bytes(&b, &records[40..45]);
    broken.extend_from_slice(b"{\"schema_version\": 2, this is not json\n");
    broken.extend(
        records[45..50]
            .iter()
            .flat_map(|r| serde_json::to_vec(r).unwrap().into_iter().chain([b'\n'])),
    );
    write(&root.join("node-b/decisions.jsonl.2"), &broken);
    // Not logs: ignored in directories.
    write(&root.join("node-b/notes.txt"), b"hello");
    write(
        &root.join("node-b/decisions.jsonl.old"),
        b"not a rotated log name",
    );

    let mut fleet = Fleet::new(None);
    fleet.add_sources(&[root.display().to_string()]).unwrap();
    let (rows, report) = fleet.finish();
    let text = report.render();

    // Two services per pair; a-live 29 pairs, a-rotated 19; b-gz 39, b-rotated 4 + 4.
    let want_a = 2 * (29 + 19);
    let want_b = 2 * (39 + 4 + 4);
    let hosts: Vec<(&str, u32, usize, usize, usize)> = report
        .hosts
        .iter()
        .map(|h| {
            (
                h.name.as_str(),
                h.cores,
                h.rows,
                h.records,
                h.duplicate_records,
            )
        })
        .collect();
    assert_eq!(
        hosts,
        [
            ("node-a", a.cores, want_a, 100, 50),
            ("node-b", b.cores, want_b, 50, 0)
        ],
        "{text}"
    );
    assert_eq!(rows.rows.len(), want_a + want_b);
    assert_eq!(report.files.len(), 6, "{:?}", report.files);
    // The rows are the ones each host's own capacity gives.
    let mut expected = rows_from_log(&records[..30], &a).rows;
    expected.extend(rows_from_log(&records[30..50], &a).rows);
    for r in &expected {
        assert!(rows.rows.contains(r));
    }
    let as_a = rows_from_log(&records[..40], &a).rows;
    let as_b = rows_from_log(&records[..40], &b).rows;
    assert_ne!(as_a, as_b);
    assert!(as_b.iter().all(|r| rows.rows.contains(r)));
    // What each file lost is reported.
    let bad = report
        .files
        .iter()
        .find(|f| f.path.ends_with("node-b/decisions.jsonl.2"))
        .unwrap();
    assert_eq!((bad.lost.bad_lines, bad.records, bad.rows), (1, 10, 16));
    assert!(
        bad.lost.errors[0].contains("line 7"),
        "{:?}",
        bad.lost.errors
    );
    assert!(text.contains("1 bad line(s) skipped"), "{text}");
    assert!(text.contains("every record already seen"), "{text}");
    assert!(text.contains("host \"node-a\" (36 cores"), "{text}");

    // A glob finds the same logs but the copy; reading a copy twice adds nothing.
    let pattern = format!("{}/node-*/decisions.jsonl*", root.display());
    let found = expand_sources(std::slice::from_ref(&pattern)).unwrap();
    assert_eq!(found.len(), 6, "{found:?}");
    let mut fleet = Fleet::new(None);
    fleet.add_sources(&[pattern.as_str()]).unwrap();
    fleet.add_sources(&[pattern.as_str()]).unwrap();
    let (again, report) = fleet.finish();
    assert_eq!(again.rows.len(), want_a + want_b);
    assert_eq!(report.rows(), want_a + want_b);

    // Names that match nothing are errors naming them.
    let e = expand_sources(&[format!("{}/nowhere/*.jsonl", root.display())]).unwrap_err();
    assert!(e.to_string().contains("matches no decision log"), "{e}");
    let e = expand_sources(&[root.join("missing.jsonl").display().to_string()]).unwrap_err();
    assert!(e.to_string().contains("missing.jsonl"), "{e}");
}

/// A lightly loaded host, so that the services sit well inside the exploration margin.
const LIGHT: &str = r#"
name = "light"
description = "two services at low load and a batch job: room to explore"
duration_s = 300
tick_ms = 1000
seed = 11

[host]
preset = "xeon-e5-2697v4"

[[service]]
name = "memcached"
model = "memcached"
load = { kind = "constant", fraction = 0.15 }

[[service]]
name = "xapian"
model = "xapian"
load = { kind = "constant", fraction = 0.15 }

[[best_effort]]
name = "stream"
model = "stream"
"#;

#[test]
fn explored_logs_on_the_simulator_train_a_host_model_from_the_shipped_one() {
    let dir = tempfile::tempdir().unwrap();
    let scenario_file = dir.path().join("light.toml");
    std::fs::write(&scenario_file, LIGHT).unwrap();
    let sc = Arc::new(cohabit_sim::Scenario::load(scenario_file.to_str().unwrap()).unwrap());
    // Around the static policy, whose fair share leaves these light services far under
    // their targets. (`ml` sizes services to about 0.75 of their target, inside the default
    // margin, so around it the walk moves rarely.)
    let cfg = cohabit_policy::ExploreConfig::default();
    let log = dir.path().join("host/decisions.jsonl");
    std::fs::create_dir_all(log.parent().unwrap()).unwrap();
    let mut w = DecisionLogWriter::new(
        std::fs::File::create(&log).unwrap(),
        &LogHeader::new("static", true, sc.capacity().clone()),
    )
    .unwrap();
    let options = cohabit_lab::simulate::PolicyOptions {
        explore: Some(cfg.clone()),
        ..Default::default()
    };
    let run =
        cohabit_lab::simulate::run_policy_with(&sc, LabPolicy::Static, None, None, &options, |r| {
            w.write(r)
        })
        .unwrap();
    w.flush().unwrap();
    drop(w);

    // It explored, and only from ticks where every service kept the margin.
    let explored: Vec<&DecisionRecord> = run
        .records
        .iter()
        .filter(|r| r.reasons.values().any(|x| x.path == DecisionPath::Explore))
        .collect();
    assert!(explored.len() > 50, "{} explored ticks", explored.len());
    for r in &explored {
        for s in r.observation.latency_critical() {
            let q = r.observation.qos_ratio(&s.spec.name).unwrap();
            assert!(q <= 1.0 - cfg.margin, "explored at {q} of target: {r:?}");
        }
        r.plan
            .validate(sc.capacity(), &sc.specs())
            .expect("explored plans are valid");
    }
    // The walk tried allocations the static policy never would: several core counts.
    let cores: std::collections::BTreeSet<u32> = explored
        .iter()
        .map(|r| r.plan.services["memcached"].cores)
        .collect();
    assert!(cores.len() >= 3, "{cores:?}");

    // cohabit-train logs, then fit --init from the shipped model.
    let shipped_dir = dir.path().join("shipped");
    std::fs::create_dir_all(&shipped_dir).unwrap();
    let shipped = cohabit_models::builtin("xeon-e5-2697v4").unwrap().unwrap();
    let shipped_path = shipped.save(&shipped_dir, "qos").unwrap();
    let rows = dir.path().join("rows.jsonl");
    let out = Command::new(TRAIN)
        .arg("logs")
        .arg(dir.path().join("host"))
        .arg("--out")
        .arg(&rows)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(said.contains("host \"Xeon E5-2697 v4"), "{said}");
    let data = Dataset::read(&rows).unwrap();
    assert!(data.rows.len() > 400, "{}", data.rows.len());
    let trained = dir.path().join("trained");
    let out = Command::new(TRAIN)
        .args(["fit", "--data"])
        .arg(&rows)
        .arg("--init")
        .arg(&shipped_path)
        .args(["--members", "2", "--epochs", "4", "--no-held-out", "--out"])
        .arg(&trained)
        .args(["--name", "host"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let model = Model::load(&trained.join("host.json")).unwrap();
    assert_eq!(model.meta.training_data_digest, data.digest());
    assert_ne!(model.meta.weights_digest, shipped.meta.weights_digest);
    // It scores the rows it learned from.
    let x =
        ndarray::Array2::from_shape_fn((data.rows.len(), cohabit_models::N_FEATURES), |(i, j)| {
            data.rows[i].features[j]
        });
    let (mean, spread) = model.score(x.view());
    assert!(mean.iter().chain(spread.iter()).all(|v| v.is_finite()));
}
