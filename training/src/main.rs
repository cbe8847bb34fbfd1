//! `cohabit-train`: generate datasets, fit and evaluate the QoS-impact model.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::{CommandFactory, Parser, Subcommand};
use cohabit_models::{Model, Schema, CPU_SCHEMA, GPU_SCHEMA};
use cohabit_sim::catalogue::Platform;
use cohabit_training::dataset::Dataset;
use cohabit_training::eval::{self, Report};
use cohabit_training::fit::{self, FitConfig};
use cohabit_training::gen::{self, GenConfig};
use cohabit_training::gen_gpu::{self, GpuGenConfig};

/// Train cohabit's QoS-impact model offline.
#[derive(Debug, Parser)]
#[command(
    name = "cohabit-train",
    version,
    about = "Train, calibrate and evaluate cohabit's QoS models offline"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print a shell completion script for this command (bash, zsh, fish, elvish, powershell).
    Completions {
        /// The shell.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print this command's manual page (roff, for `man -l -`); the Debian package installs it.
    Man,
    /// Generate a dataset from the simulator (features from simulated telemetry only).
    Gen(GenArgs),
    /// Turn decision logs (from `cohabit simulate` or `cohabit run`, one host or a fleet)
    /// into a dataset; prints the rows per host and what each file lost.
    Logs(LogsArgs),
    /// Write decision logs (one host's or a fleet's) as one Parquet file for DuckDB,
    /// Spark, pandas or polars: a row per decision and service, the host's capacity as
    /// columns (docs/FLEETS.md lists them). A bad line is skipped and reported with its
    /// file and line; the rest is written.
    Export {
        /// Decision logs: files, directories and glob patterns, as `logs` takes them
        /// (Parquet from an earlier export too).
        #[arg(value_name = "LOG", required = true)]
        sources: Vec<String>,
        /// The Parquet file to write (replaced once the export is complete).
        #[arg(long, value_name = "OUT")]
        parquet: PathBuf,
    },
    /// Train the ensemble (and the baseline), evaluate, and write the model artifact.
    Fit(FitArgs),
    /// Calibrate the spread of predicted changes between candidates on a dataset from
    /// `gen` (not the training data) and write it into the artifact.
    Calibrate {
        /// A GPU model and dataset.
        #[arg(long)]
        gpu: bool,
        /// The artifact's .json (rewritten in place).
        #[arg(long)]
        model: PathBuf,
        /// Dataset (JSON Lines) from `cohabit-train gen`.
        #[arg(long)]
        data: PathBuf,
    },
    /// Fold a fleet's per-host posteriors (each host's `state_dir/posterior.json`) into the
    /// model's output layer: the precision-weighted average of their corrections, written
    /// as a new artifact.
    Fold {
        /// The model the posteriors were learnt on (its .json).
        #[arg(long)]
        model: PathBuf,
        /// Posterior files, one or more per host.
        #[arg(value_name = "POSTERIOR", required = true)]
        posteriors: Vec<PathBuf>,
        /// Output directory.
        #[arg(long)]
        out: PathBuf,
        /// Artifact name.
        #[arg(long, default_value = "qos-folded")]
        name: String,
    },
    /// Evaluate an artifact on a dataset.
    Eval {
        /// A GPU model and dataset.
        #[arg(long)]
        gpu: bool,
        /// The artifact's .json.
        #[arg(long)]
        model: PathBuf,
        /// Dataset (JSON Lines).
        #[arg(long)]
        data: PathBuf,
    },
}

// `cohabit-train gen`'s options. (No doc comment: the subcommand's help is the variant's.)
#[derive(Debug, clap::Args)]
struct GenArgs {
    /// GPU-model rows (schema `qos-gpu`): GPU services' MPS shares on a GPU platform.
    #[arg(long)]
    gpu: bool,
    /// Random host situations.
    #[arg(long, default_value_t = 12000)]
    scenes: usize,
    /// Candidate allocations per service and scene.
    #[arg(long, default_value_t = 4)]
    candidates: usize,
    /// Seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Platform preset (default xeon-e5-2697v4; xeon-e5-2697v4-a100 with --gpu).
    #[arg(long)]
    platform: Option<String>,
    /// Output (JSON Lines).
    #[arg(long)]
    out: PathBuf,
}

// `cohabit-train logs`' options. (No doc comment: the subcommand's help is the variant's.)
#[derive(Debug, clap::Args)]
struct LogsArgs {
    /// Decision logs: files, directories (searched recursively for *.jsonl and rotated
    /// *.jsonl.N, gzip or zstd compressed too, and *.parquet from `export`) and glob
    /// patterns (quote them).
    #[arg(value_name = "LOG")]
    sources: Vec<String>,
    /// More decision logs (the same as the positional ones).
    #[arg(long = "log", value_name = "LOG")]
    logs: Vec<String>,
    /// Platform preset of the host, for version-1 logs only: they do not record their
    /// host (newer logs do in their header, which is used instead).
    #[arg(long)]
    platform: Option<String>,
    /// Output (JSON Lines).
    #[arg(long)]
    out: PathBuf,
}

// `cohabit-train fit`'s options. (No doc comment: the subcommand's help is the variant's.)
#[derive(Debug, clap::Args)]
struct FitArgs {
    /// The dataset and the model are of the GPU schema (`gen --gpu`).
    #[arg(long)]
    gpu: bool,
    /// Dataset (JSON Lines).
    #[arg(long)]
    data: PathBuf,
    /// Output directory.
    #[arg(long)]
    out: PathBuf,
    /// Artifact name.
    #[arg(long, default_value = "qos")]
    name: String,
    /// Warm-start from this artifact (its .json).
    #[arg(long)]
    init: Option<PathBuf>,
    /// Ensemble members.
    #[arg(long, default_value_t = 5)]
    members: usize,
    /// Most epochs per member.
    #[arg(long, default_value_t = 100)]
    epochs: usize,
    /// Hidden layer widths, comma-separated (a warm start needs the artifact's own).
    #[arg(long, value_delimiter = ',', default_value = "32,32")]
    hidden: Vec<usize>,
    /// Seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Skip leave-one-service-out evaluation (faster).
    #[arg(long)]
    no_held_out: bool,
}

fn platform(name: &str) -> Result<Platform> {
    Platform::by_name(name).with_context(|| format!("unknown platform {name:?}"))
}

fn schema(gpu: bool) -> &'static Schema {
    if gpu {
        &GPU_SCHEMA
    } else {
        &CPU_SCHEMA
    }
}

fn bar(len: u64, what: &str) -> indicatif::ProgressBar {
    indicatif::ProgressBar::new(len).with_style(
        indicatif::ProgressStyle::with_template(&format!(
            "{what} [{{bar:30}}] {{pos}}/{{len}} {{elapsed}}"
        ))
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    )
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Completions { shell } => {
            // Into memory first: clap_complete panics on a failed write (a closed pipe).
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut Cli::command(), "cohabit-train", &mut script);
            std::io::Write::write_all(&mut std::io::stdout(), &script)?;
        }
        Command::Man => clap_mangen::Man::new(Cli::command()).render(&mut std::io::stdout())?,
        Command::Gen(args) => gen_cmd(args)?,
        Command::Logs(args) => logs_cmd(args)?,
        Command::Export { sources, parquet } => export_cmd(&sources, &parquet)?,
        Command::Fit(args) => fit_cmd(args)?,
        Command::Calibrate { gpu, model, data } => calibrate_cmd(gpu, &model, &data)?,
        Command::Eval { gpu, model, data } => eval_cmd(gpu, &model, &data)?,
        Command::Fold {
            model,
            posteriors,
            out,
            name,
        } => fold_cmd(&model, &posteriors, &out, &name)?,
    }
    Ok(())
}

/// `cohabit-train gen`: a dataset from the simulator.
fn gen_cmd(args: GenArgs) -> Result<()> {
    let GenArgs {
        gpu,
        scenes,
        candidates,
        seed,
        platform: p,
        out,
    } = args;
    let default = if gpu {
        "xeon-e5-2697v4-a100"
    } else {
        "xeon-e5-2697v4"
    };
    let p = platform(p.as_deref().unwrap_or(default))?;
    let pb = bar(scenes as u64, "scenes");
    let data = if gpu {
        gen_gpu::generate_gpu(
            &GpuGenConfig {
                scenes,
                candidates,
                seed,
                platform: p,
            },
            |d, _| pb.set_position(d as u64),
        )?
    } else {
        gen::generate(
            &GenConfig {
                scenes,
                candidates,
                seed,
                platform: p,
                services: None,
            },
            |d, _| pb.set_position(d as u64),
        )
    };
    pb.finish_and_clear();
    data.write(&out)?;
    println!(
        "wrote {} rows from {} simulated scenes to {} ({})",
        data.rows.len(),
        scenes,
        out.display(),
        data.digest()
    );
    Ok(())
}

/// `cohabit-train logs`: a dataset from decision logs.
fn logs_cmd(args: LogsArgs) -> Result<()> {
    let LogsArgs {
        mut sources,
        logs,
        platform: p,
        out,
    } = args;
    sources.extend(logs);
    anyhow::ensure!(
        !sources.is_empty(),
        "name at least one decision log, directory or glob pattern"
    );
    let fallback = p
        .map(|p| platform(&p))
        .transpose()?
        .map(|p| p.host().capacity);
    let mut fleet = cohabit_training::logs::Fleet::new(fallback);
    fleet.add_sources(&sources)?;
    let (all, report) = fleet.finish();
    print!("{}", report.render());
    anyhow::ensure!(
        !all.rows.is_empty(),
        "no training rows in {} file(s) (see above)",
        report.files.len()
    );
    all.write(&out)?;
    println!(
        "wrote {} rows from {} host(s) in {} file(s) to {}",
        all.rows.len(),
        report.hosts.len(),
        report.files.len(),
        out.display()
    );
    Ok(())
}

/// `cohabit-train export`: the decision logs in `sources` as one Parquet file; refused (and
/// no file left) when they hold no decision record.
fn export_cmd(sources: &[String], parquet: &Path) -> Result<()> {
    let paths = cohabit_training::logs::expand_sources(sources)?;
    let report = cohabit_training::columnar::export(&paths, parquet)?;
    print!("{}", report.render());
    if report.records == 0 {
        let _ = std::fs::remove_file(parquet);
        anyhow::bail!(
            "no decision records in {} file(s) (see above); nothing written",
            report.files.len()
        );
    }
    Ok(())
}

/// `cohabit-train fit`: trains, evaluates and writes the model artifact.
fn fit_cmd(args: FitArgs) -> Result<()> {
    let FitArgs {
        gpu,
        data,
        out,
        name,
        init,
        members,
        epochs,
        hidden,
        seed,
        no_held_out,
    } = args;
    let ds = Dataset::read_for(&data, schema(gpu))?;
    let init = init
        .map(|p| Model::load_schema(&p, schema(gpu)))
        .transpose()
        .context("loading the warm-start model")?;
    let cfg = FitConfig {
        members,
        epochs,
        hidden,
        seed,
        schema: schema(gpu),
        ..FitConfig::default()
    };
    let (train_val, test) = eval::split(&ds, 0.15, seed ^ 0xA5A5);
    let (train, val) = eval::split_rows(&train_val, cfg.val_frac, seed);
    let (tr, va) = (train, val);
    let pb = bar((members * epochs) as u64, "training");
    let started = std::time::Instant::now();
    let mut model = fit::fit(&tr, &va, &cfg, init.as_ref(), |k, e| {
        pb.set_position((k * epochs + e) as u64)
    })?;
    pb.finish_and_clear();
    let train_s = started.elapsed().as_secs_f64();
    let ridge = fit::Ridge::fit(&tr)?;
    let mut report = Report {
        mlp_in_distribution: eval::model_errors(&model, &test),
        ridge_in_distribution: eval::ridge_errors(&ridge, &test),
        ..Report::default()
    };
    for s in ds.services() {
        let rows: Vec<_> = test.iter().copied().filter(|r| r.service == s).collect();
        report
            .mlp_per_service
            .insert(s, eval::model_errors(&model, &rows));
    }
    if !no_held_out {
        let small = FitConfig {
            members: 2,
            epochs: epochs.min(30),
            ..cfg.clone()
        };
        let pb = bar(ds.services().len() as u64, "held-out services");
        let (m, r, per) = eval::held_out(&ds, &small, |_| pb.inc(1))?;
        pb.finish_and_clear();
        report.mlp_held_out = m;
        report.ridge_held_out = r;
        report.mlp_held_out_per_service = per;
    }
    record_metrics(&mut model.meta.metrics, &report, !no_held_out);
    let metrics = &mut model.meta.metrics;
    metrics.insert("training_seconds".into(), train_s);
    metrics.insert("rows".into(), ds.rows.len() as f64);
    model.meta.training_data_digest = ds.digest();
    std::fs::create_dir_all(&out)?;
    let path = model.save(&out, &name)?;
    println!("{}", serde_json::to_string_pretty(&report)?);
    println!(
        "{} model: in-distribution median |error| {:.3} on {} test rows{}",
        cfg.schema,
        report.mlp_in_distribution.median_abs_error,
        report.mlp_in_distribution.rows,
        if no_held_out {
            String::new()
        } else {
            format!(
                ", held-out (leave one service out) median |error| {:.3} on {} rows",
                report.mlp_held_out.median_abs_error, report.mlp_held_out.rows
            )
        }
    );
    println!("wrote {} (trained in {train_s:.1} s)", path.display());
    Ok(())
}

/// `cohabit-train calibrate`: the spread of predicted changes, written into the artifact.
/// The errors in `report` that an artifact's metrics record (the held-out ones when they
/// were measured, `held_out`).
fn record_metrics(metrics: &mut BTreeMap<String, f64>, report: &Report, held_out: bool) {
    metrics.insert(
        "in_distribution_median_abs_error".into(),
        report.mlp_in_distribution.median_abs_error,
    );
    metrics.insert(
        "in_distribution_coverage_2sigma".into(),
        report.mlp_in_distribution.coverage_2sigma.unwrap_or(0.0),
    );
    metrics.insert(
        "ridge_in_distribution_median_abs_error".into(),
        report.ridge_in_distribution.median_abs_error,
    );
    if held_out {
        metrics.insert(
            "held_out_median_abs_error".into(),
            report.mlp_held_out.median_abs_error,
        );
        metrics.insert(
            "held_out_coverage_2sigma".into(),
            report.mlp_held_out.coverage_2sigma.unwrap_or(0.0),
        );
        metrics.insert(
            "ridge_held_out_median_abs_error".into(),
            report.ridge_held_out.median_abs_error,
        );
    }
}

fn calibrate_cmd(gpu: bool, model: &Path, data: &Path) -> Result<()> {
    let mut m = Model::load_schema(model, schema(gpu))?;
    let ds = Dataset::read_for(data, schema(gpu))?;
    let c = eval::change_calibration(&m, &ds.rows).with_context(|| {
        format!(
            "{} has no groups of candidates of one service in one situation (make it with cohabit-train gen)",
            data.display()
        )
    })?;
    m.meta.change_sigma_scale = Some(c.change_sigma_scale);
    m.meta.metrics.insert("change_pairs".into(), c.pairs as f64);
    m.meta
        .metrics
        .insert("change_median_abs_error".into(), c.median_abs_error);
    m.meta.metrics.insert(
        "change_coverage_2sigma_with_level_scale".into(),
        c.coverage_with_level_scale,
    );
    let dir = model.parent().unwrap_or(std::path::Path::new("."));
    let name = model
        .file_stem()
        .and_then(|s| s.to_str())
        .context("the model path has no file name")?;
    m.save(dir, name)?;
    println!("{}", serde_json::to_string_pretty(&c)?);
    Ok(())
}

/// `cohabit-train eval`: an artifact's errors on a dataset.
fn eval_cmd(gpu: bool, model: &Path, data: &Path) -> Result<()> {
    let m = Model::load_schema(model, schema(gpu))?;
    let ds = Dataset::read_for(data, schema(gpu))?;
    let rows: Vec<_> = ds.rows.iter().collect();
    let mut report = Report {
        mlp_in_distribution: eval::model_errors(&m, &rows),
        ..Report::default()
    };
    for s in ds.services() {
        let r: Vec<_> = rows.iter().copied().filter(|x| x.service == s).collect();
        report.mlp_per_service.insert(s, eval::model_errors(&m, &r));
    }
    report.ridge_held_out = eval::ridge_held_out(&ds)?;
    if report.ridge_held_out.rows == 0 {
        eprintln!(
            "note: ridge_held_out is over 0 rows: the data hold one service, so no \
             service can be held out against the others"
        );
    }
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}

/// `cohabit-train fold`: a fleet's posteriors folded into a new artifact.
fn fold_cmd(model: &Path, posteriors: &[PathBuf], out: &Path, name: &str) -> Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let (report, path) = cohabit_training::fold::fold_files(model, posteriors, out, name)?;
    println!(
        "folded {} posteriors ({:.0} readings; {} of another model skipped) into {}",
        report.folded,
        report.samples,
        report.skipped,
        path.display()
    );
    Ok(())
}
