//! Decision logs as Parquet (`cohabit-train export --parquet`): JSON lines from several
//! hosts go into one file whose rows carry each host's capacity, read back as the same
//! records, and train the same rows; a bad line is named and the rest kept.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::types::{ArrowPrimitiveType, Float64Type, UInt32Type, UInt64Type};
use arrow_array::{Array, PrimitiveArray, RecordBatch};
use cohabit_core::{
    ApplyOutcome, Control, DecisionLogReader, DecisionLogWriter, DecisionRecord, Estimate,
    GpuCapacity, GroupControl, HostCapacity, LogHeader, PosteriorEstimate, Prediction, Resource,
    ShareChange, BEST_EFFORT_GROUP,
};
use cohabit_lab::LabPolicy;
use cohabit_training::columnar::{self, LoggedRecord};
use cohabit_training::logs::Fleet;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

const TRAIN: &str = env!("CARGO_BIN_EXE_cohabit-train");

/// Runs `cohabit-train` with `args`: whether it succeeded, and what it printed on stdout
/// (with stderr after it, for a failure's message).
fn train(args: &[&std::ffi::OsStr]) -> (bool, String) {
    let run = Command::new(TRAIN).args(args).output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    (run.status.success(), said)
}

fn demo_records(ticks: usize) -> (Vec<DecisionRecord>, HostCapacity) {
    let sc = Arc::new(cohabit_sim::Scenario::load("demo").unwrap());
    let run =
        cohabit_lab::simulate::run_policy(&sc, LabPolicy::Parties, None, None, |_| Ok(())).unwrap();
    (run.records[..ticks].to_vec(), sc.capacity().clone())
}

/// A record as a real host's `ml` writes it: predictions with prior and posterior, control
/// per group (one resource unmanaged), a refused plan, a service from a pod, a group only
/// the plan names, and no ground truth.
fn as_on_a_real_host(mut r: DecisionRecord) -> DecisionRecord {
    let lc: Vec<String> = r
        .observation
        .latency_critical()
        .map(|s| s.spec.name.clone())
        .collect();
    r.simulated = false;
    r.truth = None;
    let first = &lc[0];
    r.predictions.insert(
        first.clone(),
        Prediction {
            log_qos_ratio: -0.3,
            log_qos_sigma: 0.1,
            prior: Some(Estimate {
                log_qos_ratio: -0.2,
                log_qos_sigma: 0.15,
            }),
            posterior: Some(PosteriorEstimate {
                log_qos_ratio: -0.3,
                log_qos_sigma: 0.1,
                samples: 41.5,
            }),
        },
    );
    // A prediction without prior or posterior (an older log).
    r.predictions
        .insert(lc[1].clone(), Prediction::new(0.05, 0.2));
    r.control.insert(
        first.clone(),
        GroupControl {
            pids: [4242, 4243].into(),
            resources: BTreeMap::from([
                (Resource::Cores, Control::InPlace),
                (
                    Resource::LlcWays,
                    Control::Unmanaged {
                        why: "in the root resctrl group; set placement = \"move\"".into(),
                    },
                ),
                (
                    Resource::Mba,
                    Control::Partial {
                        why: "pid 4243 is in another group".into(),
                    },
                ),
            ]),
        },
    );
    r.control.insert(
        BEST_EFFORT_GROUP.into(),
        GroupControl {
            pids: [].into(),
            resources: BTreeMap::from([(Resource::Cores, Control::Moved)]),
        },
    );
    r.from_pods.insert(lc[1].clone());
    r.observation.services[0].sample.p99_intervals = Some(3);
    r.observation.services[0].sample.ipc = None;
    r.observation.services[0].gpu_mps_effective_pct = Some(40);
    // A GPU client's memory, and the pinned limits in force and planned.
    let gib = f64::from(1u32 << 30);
    r.observation.services[0].sample.gpu_memory_bytes = Some(8.0 * gib);
    r.observation.services[0].sample.gpu_memory_total_bytes = Some(40.0 * gib);
    r.observation
        .current
        .gpu_memory_mib
        .insert(first.clone(), 9_000);
    r.plan.gpu_memory_mib.insert(first.clone(), 10_240);
    let mut ghost = r.plan.best_effort;
    ghost.gpu_mps_pct = Some(25);
    r.plan.services.insert("ghost".into(), ghost);
    r.apply = Some(ApplyOutcome::Refused {
        error: "resctrl: out of CLOSIDs".into(),
    });
    r.changes = r.observation.current.diff(&r.plan);
    r
}

fn host(base: &HostCapacity, name: &str, more_cores: u32) -> HostCapacity {
    let mut h = base.clone();
    h.name = name.into();
    h.cores += more_cores;
    h
}

/// node-a: a version-1 start (no header), then a header with moved tunables. node-b: a
/// GPU host, a real host's records, then a restart on the same host.
fn fleet_logs(root: &Path) -> (Vec<PathBuf>, HostCapacity, HostCapacity) {
    let (records, e5) = demo_records(24);
    let a = host(&e5, "node-a", 0);
    let mut b = host(&e5, "node-b", 12);
    b.gpus = vec![GpuCapacity {
        name: "A100-SXM4-40GB".into(),
        sms: 108,
        share_change: ShareChange::Live,
    }];
    b.closids = 8;
    let mut log_a = Vec::new();
    for r in &records[..3] {
        log_a.extend(serde_json::to_vec(r).unwrap());
        log_a.push(b'\n');
    }
    let mut w = DecisionLogWriter::continuing(&mut log_a);
    w.write_header(&LogHeader::new("parties", true, a.clone()).with_tunables([("margin", 0.9)]))
        .unwrap();
    for r in &records[3..12] {
        w.write(r).unwrap();
    }
    let mut log_b = Vec::new();
    let mut w = DecisionLogWriter::continuing(&mut log_b);
    for records in [&records[12..18], &records[18..24]] {
        w.write_header(&LogHeader::new("parties", false, b.clone()))
            .unwrap();
        for r in records {
            w.write(&as_on_a_real_host(r.clone())).unwrap();
        }
    }
    let paths = vec![
        root.join("node-a/decisions.jsonl"),
        root.join("node-b/decisions.jsonl"),
    ];
    for (p, bytes) in paths.iter().zip([log_a, log_b]) {
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, bytes).unwrap();
    }
    (paths, a, b)
}

/// The records of the JSON-lines logs, read the usual way, with where each came from.
fn read_jsonl(paths: &[PathBuf]) -> Vec<LoggedRecord> {
    let mut out = Vec::new();
    for p in paths {
        let mut reader =
            DecisionLogReader::new(std::io::BufReader::new(std::fs::File::open(p).unwrap()));
        while let Some(r) = reader.next() {
            out.push(LoggedRecord {
                source: p.display().to_string(),
                part: u32::try_from(reader.headers_read()).unwrap(),
                line: reader.line() as u64,
                header: reader.header().cloned(),
                record: r.unwrap(),
            });
        }
    }
    out
}

/// Column `name` of `batch`, of Arrow type `T`.
fn column<'a, T: ArrowPrimitiveType>(batch: &'a RecordBatch, name: &str) -> &'a PrimitiveArray<T> {
    batch
        .column_by_name(name)
        .unwrap_or_else(|| panic!("no column {name}"))
        .as_primitive::<T>()
}

fn batches(path: &Path) -> Vec<RecordBatch> {
    ParquetRecordBatchReaderBuilder::try_new(std::fs::File::open(path).unwrap())
        .unwrap()
        .build()
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap()
}

#[test]
fn jsonl_logs_exported_to_parquet_read_back_as_the_same_records_nulls_included() {
    let dir = tempfile::tempdir().unwrap();
    let (paths, _, _) = fleet_logs(dir.path());
    let out = dir.path().join("fleet.parquet");
    let report = columnar::export(&paths, &out).unwrap();
    let expected = read_jsonl(&paths);
    assert_eq!(expected.len(), 24);
    assert_eq!(report.records, 24, "{}", report.render());
    let back = columnar::read_parquet(&out).unwrap();
    assert_eq!(back.len(), expected.len());
    for (got, want) in back.iter().zip(&expected) {
        assert_eq!(got, want, "{}:{}", want.source, want.line);
    }
    // What the real host's records hold made it through, not only defaults.
    let real = &back[12].record;
    assert!(real.predictions.values().any(|p| p.posterior.is_some()));
    assert!(real.predictions.values().any(|p| p.prior.is_none()));
    assert!(real
        .control
        .values()
        .any(|c| c.resources.values().any(|c| c.unmanaged().is_some())));
    assert!(real.plan.services.contains_key("ghost") && !real.from_pods.is_empty());
    assert!(
        !real.plan.gpu_memory_mib.is_empty() && !real.observation.current.gpu_memory_mib.is_empty()
    );
    assert!(real.observation.services[0]
        .sample
        .gpu_memory_bytes
        .is_some());
    assert!(back[0].header.is_none() && back[3].header.as_ref().unwrap().tunables["margin"] == 0.9);
    assert!(back[5].record.truth.is_some());
    // A Parquet export of the Parquet export is the same file's records again.
    let again = dir.path().join("again.parquet");
    columnar::export(std::slice::from_ref(&out), &again).unwrap();
    assert_eq!(columnar::read_parquet(&again).unwrap(), back);
}

/// The columns layout 2 added.
const LAYOUT_2_COLUMNS: [&str; 4] = [
    "gpu_memory_bytes",
    "gpu_memory_total_bytes",
    "current_gpu_memory_mib",
    "plan_gpu_memory_mib",
];

/// Writes `batches` to `path` as a file of Parquet layout `layout`.
fn write_layout(path: &Path, batches: &[RecordBatch], layout: &str) {
    let props = parquet::file::properties::WriterProperties::builder()
        .set_key_value_metadata(Some(vec![parquet::file::metadata::KeyValue::new(
            columnar::LAYOUT_KEY.to_string(),
            layout.to_string(),
        )]))
        .build();
    let file = std::fs::File::create(path).unwrap();
    let mut w =
        parquet::arrow::ArrowWriter::try_new(file, batches[0].schema(), Some(props)).unwrap();
    for b in batches {
        w.write(b).unwrap();
    }
    w.close().unwrap();
}

#[test]
fn a_layout_1_file_reads_with_the_columns_added_since_null() {
    let dir = tempfile::tempdir().unwrap();
    let (paths, _, _) = fleet_logs(dir.path());
    let out = dir.path().join("fleet.parquet");
    columnar::export(&paths, &out).unwrap();
    // The same rows as layout 1 wrote them: without the four columns, marked layout 1.
    let old = dir.path().join("layout-1.parquet");
    let layout_1: Vec<RecordBatch> = batches(&out)
        .iter()
        .map(|batch| {
            let keep: Vec<usize> = (0..batch.num_columns())
                .filter(|&i| !LAYOUT_2_COLUMNS.contains(&batch.schema().field(i).name().as_str()))
                .collect();
            batch.project(&keep).unwrap()
        })
        .collect();
    write_layout(&old, &layout_1, "1");
    let back = columnar::read_parquet(&old).unwrap();
    let mut expected = read_jsonl(&paths);
    for e in &mut expected {
        let r = &mut e.record;
        r.plan.gpu_memory_mib.clear();
        r.observation.current.gpu_memory_mib.clear();
        for s in &mut r.observation.services {
            (s.sample.gpu_memory_bytes, s.sample.gpu_memory_total_bytes) = (None, None);
        }
    }
    assert_eq!(back.len(), expected.len());
    for (got, want) in back.iter().zip(&expected) {
        assert_eq!(got, want, "{}:{}", want.source, want.line);
    }
    // A layout newer than this build's is refused, naming it.
    let newer = dir.path().join("layout-99.parquet");
    write_layout(&newer, &batches(&out), "99");
    let e = columnar::read_parquet(&newer).unwrap_err().to_string();
    assert!(e.contains("layout 99 is newer"), "{e}");
}

#[test]
fn every_row_carries_the_capacity_of_the_host_its_log_header_names() {
    let dir = tempfile::tempdir().unwrap();
    let (paths, a, b) = fleet_logs(dir.path());
    let out = dir.path().join("fleet.parquet");
    let report = columnar::export(&paths, &out).unwrap();
    let mut seen = std::collections::BTreeSet::new();
    let mut rows = 0;
    for batch in batches(&out) {
        let name = batch.column_by_name("host").unwrap().as_string::<i32>();
        let cores = column::<UInt32Type>(&batch, "host_cores");
        let ways = column::<UInt32Type>(&batch, "host_llc_ways");
        let closids = column::<UInt32Type>(&batch, "host_closids");
        let gpus = column::<UInt32Type>(&batch, "host_gpus");
        let llc = column::<UInt64Type>(&batch, "host_llc_bytes");
        let bw = column::<Float64Type>(&batch, "host_mem_bw_bytes_per_s");
        for i in 0..batch.num_rows() {
            rows += 1;
            let key = name.is_valid(i).then(|| name.value(i).to_string());
            let got = key.as_ref().map(|_| {
                (
                    cores.value(i),
                    ways.value(i),
                    closids.value(i),
                    gpus.value(i),
                    llc.value(i),
                    bw.value(i).to_bits(),
                )
            });
            assert_eq!(
                cores.is_valid(i),
                key.is_some(),
                "row {i}: capacity null only without a host"
            );
            seen.insert((key, got));
        }
    }
    assert_eq!(rows, report.rows);
    let capacity = |h: &HostCapacity| {
        (
            h.cores,
            h.llc_ways,
            h.closids,
            u32::try_from(h.gpus.len()).unwrap(),
            h.llc_bytes(),
            h.mem_bw_bytes_per_s.to_bits(),
        )
    };
    let keys: Vec<_> = seen.into_iter().collect();
    assert_eq!(
        keys,
        [
            (None, None),
            (Some("node-a".to_string()), Some(capacity(&a))),
            (Some("node-b".to_string()), Some(capacity(&b))),
        ]
    );
    assert_ne!(capacity(&a), capacity(&b));
    // docs/FLEETS.md documents each column of the file, in order, and no other.
    let doc =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/FLEETS.md")).unwrap();
    let section = doc.split("## Decision logs as Parquet").nth(1).unwrap();
    let section = section.split("\n## ").next().unwrap();
    let documented: Vec<&str> = section
        .lines()
        .filter_map(|l| l.strip_prefix("| `")?.split('`').next())
        .collect();
    let columns: Vec<String> = columnar::schema_fields().into_iter().map(|c| c.0).collect();
    assert_eq!(documented, columns);
}

#[test]
fn a_bad_line_is_named_with_its_file_and_the_rest_is_exported() {
    let dir = tempfile::tempdir().unwrap();
    let (paths, _, _) = fleet_logs(dir.path());
    let text = std::fs::read_to_string(&paths[1]).unwrap();
    let mut lines: Vec<&str> = text.lines().collect();
    lines[4] = "{\"schema_version\": 2, this is not json";
    std::fs::write(&paths[1], lines.join("\n") + "\n").unwrap();
    let out = dir.path().join("fleet.parquet");
    let report = columnar::export(&paths, &out).unwrap();
    let file = &report.files[1];
    assert_eq!((file.records, file.lost.bad_lines), (11, 1), "{file:?}");
    assert!(
        file.lost.errors[0].starts_with("line 5: not a decision record: "),
        "{:?}",
        file.lost.errors
    );
    let said = report.render();
    assert!(
        said.contains(&format!(
            "file {}: 1 bad line(s) skipped (line 5",
            paths[1].display()
        )),
        "{said}"
    );
    assert_eq!(columnar::read_parquet(&out).unwrap().len(), 23);

    // The binary says the same, exits 0 with the rest written, and fails when nothing is.
    let cli_out = dir.path().join("cli.parquet");
    let node_b_dir = dir.path().join("node-b");
    let (ok, said) = train(&[
        "export".as_ref(),
        node_b_dir.as_os_str(),
        "--parquet".as_ref(),
        cli_out.as_os_str(),
    ]);
    assert!(ok, "{said}");
    assert!(
        said.contains("line 5") && said.contains("wrote 11 records"),
        "{said}"
    );
    let garbage = dir.path().join("garbage.jsonl");
    std::fs::write(&garbage, "not a log\n").unwrap();
    let none = dir.path().join("none.parquet");
    let (ok, said) = train(&[
        "export".as_ref(),
        garbage.as_os_str(),
        "--parquet".as_ref(),
        none.as_os_str(),
    ]);
    assert!(!ok);
    assert!(
        said.contains("garbage.jsonl: 1 bad line(s) skipped (line 1"),
        "{said}"
    );
    assert!(!none.exists());
    // Exported again into the directory it reads, the earlier export is left out.
    let inside = dir.path().join("node-b/fleet.parquet");
    let first = columnar::export(std::slice::from_ref(&paths[1]), &inside).unwrap();
    let node_b = dir.path().join("node-b").display().to_string();
    let sources = cohabit_training::logs::expand_sources(&[node_b]).unwrap();
    assert_eq!(sources.len(), 2, "{sources:?}");
    let again = columnar::export(&sources, &inside).unwrap();
    assert_eq!(again.records, first.records);
    assert_eq!(again.skipped_output, std::slice::from_ref(&inside));
    assert!(again.render().contains("the output itself, left out"));
    assert_eq!(columnar::read_parquet(&inside).unwrap().len(), 11);
}

#[test]
fn a_fleets_parquet_trains_the_same_rows_per_host_as_its_json_lines() {
    let dir = tempfile::tempdir().unwrap();
    let (paths, _, _) = fleet_logs(dir.path());
    let out = dir.path().join("fleet.parquet");
    columnar::export(&paths, &out).unwrap();

    let mut from_jsonl = Fleet::new(None);
    for p in &paths {
        from_jsonl.add_file(p);
    }
    let (want, want_report) = from_jsonl.finish();
    let mut from_parquet = Fleet::new(None);
    from_parquet.add_file(&out);
    let (got, got_report) = from_parquet.finish();
    assert!(!want.rows.is_empty());
    assert_eq!(got.rows, want.rows);
    assert_eq!(
        got_report.hosts,
        want_report.hosts,
        "{}",
        got_report.render()
    );
    assert_eq!(got_report.hosts.len(), 2);
    // Node-a's version-1 start names no host: skipped in both, and said.
    assert_eq!(got_report.files[0].without_host, 3);

    // Both forms of one log are one log: the Parquet adds no rows to its JSON lines.
    let mut both = Fleet::new(None);
    both.add_sources(&[dir.path().display().to_string()])
        .unwrap();
    let (rows, report) = both.finish();
    assert_eq!(report.files.len(), 3, "{:?}", report.files);
    assert_eq!(rows.rows.len(), want.rows.len());

    // `cohabit-train logs` reads it.
    let data = dir.path().join("rows.jsonl");
    let (ok, said) = train(&[
        "logs".as_ref(),
        out.as_os_str(),
        "--out".as_ref(),
        data.as_os_str(),
    ]);
    assert!(ok, "{said}");
    assert!(said.contains("host \"node-b\""), "{said}");
    assert_eq!(
        cohabit_training::dataset::Dataset::read(&data)
            .unwrap()
            .rows,
        want.rows
    );
}

#[test]
fn a_parquet_file_that_is_not_a_decision_log_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("other.parquet");
    let batch = RecordBatch::try_from_iter([(
        "x",
        Arc::new(arrow_array::UInt32Array::from(vec![1, 2])) as arrow_array::ArrayRef,
    )])
    .unwrap();
    let mut w = parquet::arrow::ArrowWriter::try_new(
        std::fs::File::create(&path).unwrap(),
        batch.schema(),
        None,
    )
    .unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
    assert!(columnar::is_parquet(&path));
    let e = columnar::read_parquet(&path).unwrap_err().to_string();
    assert!(
        e.contains("other.parquet") && e.contains("not a cohabit decision log"),
        "{e}"
    );
    let mut fleet = Fleet::new(None);
    fleet.add_file(&path);
    let (_, report) = fleet.finish();
    assert!(report.files[0]
        .lost
        .failed
        .as_ref()
        .unwrap()
        .contains("not a cohabit decision log"));
}
