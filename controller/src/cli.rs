//! The `cohabit` command line. `main.rs` only parses and calls [`run`].

use std::fmt::Write as _;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use cohabit_sim::catalogue::{self, Platform};
use cohabit_sim::scenario::builtin_names;
use cohabit_sim::Scenario;

use crate::metrics::RunSummary;
use crate::simulate::{self, PolicyKind};

/// cohabit: keep latency-critical services on target while best-effort jobs use the rest.
#[derive(Debug, Parser)]
#[command(name = "cohabit", version, about)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// Aligned text for people.
    Table,
    /// JSON for programs.
    Json,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// List the built-in simulated scenarios (with --models: the service catalogue and platforms).
    Scenarios {
        /// Also list the calibrated service models and platforms.
        #[arg(long)]
        models: bool,
        /// Output format.
        #[arg(long, value_enum, default_value_t = Format::Table)]
        format: Format,
    },
    /// Run one policy on a simulated scenario; write decisions.jsonl and summary.json.
    Simulate {
        /// A built-in scenario name or a scenario TOML file.
        #[arg(long)]
        scenario: String,
        /// Policy: static, parties, ml or oracle.
        #[arg(long, default_value = "parties")]
        policy: PolicyKind,
        /// Directory for decisions.jsonl and summary.json (created if missing).
        #[arg(long)]
        out: PathBuf,
        /// Seed of the measurement noise (default: the scenario's).
        #[arg(long)]
        seed: Option<u64>,
        #[command(flatten)]
        sim: SimArgs,
    },
    /// Report what this host can do: RDT, cgroups, hardware counters, GPUs, MPS.
    Probe {
        /// Output format.
        #[arg(long, value_enum, default_value_t = Format::Table)]
        format: Format,
    },
    /// Run the daemon on this host until SIGTERM or SIGINT, then restore it.
    Run {
        /// Configuration file (TOML; see examples/cohabit.toml).
        #[arg(long)]
        config: PathBuf,
        /// Collect, decide and log, but change nothing on the host.
        #[arg(long)]
        dry_run: bool,
        /// Stop after this many ticks (then restore, as on SIGTERM).
        #[arg(long)]
        ticks: Option<u64>,
    },
    /// Run several policies side by side on the same simulated scenario and seed.
    Compare {
        /// A built-in scenario name, a scenario TOML file, or `all` for every built-in one.
        #[arg(long)]
        scenario: String,
        /// Comma-separated policies.
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "static,parties,ml,oracle"
        )]
        policies: Vec<PolicyKind>,
        /// Seed of the measurement noise (default: each scenario's).
        #[arg(long)]
        seed: Option<u64>,
        /// Output format.
        #[arg(long, value_enum, default_value_t = Format::Table)]
        format: Format,
        /// Also write every run's decisions and the summaries here (for `plot` and `report`).
        #[arg(long)]
        out: Option<PathBuf>,
        #[command(flatten)]
        sim: SimArgs,
    },
    /// The whole benchmark: every built-in scenario × static, parties, ml and oracle on its
    /// own platform, and the CPU scenarios again on a Xeon Gold 6338 with that platform's
    /// warm-started model; then ml's targets, checked side by side.
    Bench {
        /// Second platform for the CPU scenarios.
        #[arg(long, default_value = "xeon-gold-6338")]
        platform: String,
        /// Seed of the measurement noise (default: each scenario's).
        #[arg(long)]
        seed: Option<u64>,
        /// Output format.
        #[arg(long, value_enum, default_value_t = Format::Table)]
        format: Format,
    },
    /// Draw the decision plots of a run or comparison directory.
    Plot {
        /// A directory written by `simulate --out`, `compare --out` or holding a daemon log.
        run_dir: PathBuf,
        /// Where to write the plots (default: RUN_DIR/plots).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Image format.
        #[arg(long, value_enum, default_value_t = crate::report::plot::PlotFormat::Png)]
        format: crate::report::plot::PlotFormat,
    },
    /// Write one self-contained HTML report (plots, summary, decisions) for a run or comparison.
    Report {
        /// A directory written by `simulate --out` or `compare --out`.
        run_dir: PathBuf,
        /// Where to write report.html (default: RUN_DIR).
        #[arg(long)]
        out: Option<PathBuf>,
    },
}

/// Where a simulation runs and which model `ml` uses.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct SimArgs {
    /// Run on another built-in platform (see `cohabit scenarios --models`).
    #[arg(long)]
    pub platform: Option<String>,
    /// Model for `ml` (a .json written by cohabit-train fit; default: the platform's
    /// built-in model).
    #[arg(long)]
    pub model: Option<PathBuf>,
}

impl SimArgs {
    /// The scenario `name`, moved to the platform if one was asked for.
    fn scenario(&self, name: &str) -> Result<Arc<Scenario>> {
        let sc = Scenario::load(name)?;
        Ok(Arc::new(match &self.platform {
            Some(p) => sc.on_platform(p)?,
            None => sc,
        }))
    }

    /// The model asked for, loaded.
    fn model(&self) -> Result<Option<Arc<cohabit_models::Model>>> {
        self.model
            .as_deref()
            .map(|p| {
                cohabit_models::Model::load(p)
                    .map(Arc::new)
                    .with_context(|| format!("loading the model for ml from {}", p.display()))
            })
            .transpose()
    }
}

/// Runs a parsed command, writing its report to `out`.
pub fn run(cli: Cli, out: &mut dyn Write) -> Result<()> {
    match cli.command {
        Command::Scenarios { models, format } => scenarios(models, format, out),
        Command::Simulate {
            scenario,
            policy,
            out: dir,
            seed,
            sim,
        } => simulate_cmd(&scenario, policy, &dir, seed, &sim, out),
        Command::Compare {
            scenario,
            policies,
            seed,
            format,
            out: dir,
            sim,
        } => compare_cmd(
            &scenario,
            &policies,
            seed,
            format,
            dir.as_deref(),
            &sim,
            out,
        ),
        Command::Bench {
            platform,
            seed,
            format,
        } => crate::bench::bench_cmd(&platform, seed, format, out),
        Command::Plot {
            run_dir,
            out: dir,
            format,
        } => {
            let dest = dir.unwrap_or_else(|| run_dir.join("plots"));
            let files = match crate::report::data::load(&run_dir)? {
                crate::report::data::RunDir::Single(run) => {
                    crate::report::plot::plot_run(&run, &dest, format)?
                }
                crate::report::data::RunDir::Comparison(runs) => {
                    crate::report::plot::plot_comparison(&runs, &dest, format)?
                }
            };
            for f in files {
                writeln!(out, "wrote {}", f.display())?;
            }
            Ok(())
        }
        Command::Report { run_dir, out: dir } => {
            let page = crate::report::html::write_report(&run_dir, dir.as_deref())?;
            writeln!(
                out,
                "wrote {} (self-contained; open it in a browser)",
                page.display()
            )?;
            Ok(())
        }
        Command::Probe { format } => {
            let report = crate::daemon::probe::probe(&cohabit_collectors::HostPaths::standard());
            match format {
                Format::Json => writeln!(out, "{}", serde_json::to_string_pretty(&report)?)?,
                Format::Table => write!(out, "{}", report.render())?,
            }
            Ok(())
        }
        Command::Run {
            config,
            dry_run,
            ticks,
        } => {
            let cfg = crate::daemon::config::DaemonConfig::load(&config)?;
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .context("starting the async runtime")?;
            let n = rt.block_on(crate::daemon::run(cfg, dry_run, ticks))?;
            writeln!(out, "cohabit stopped after {n} ticks; host restored")?;
            Ok(())
        }
    }
}

fn load(name: &str) -> Result<Arc<Scenario>> {
    Ok(Arc::new(Scenario::load(name)?))
}

pub(crate) const BANNER: &str =
    "SIMULATION: every figure below comes from cohabit's simulated host, not from hardware.";

fn scenarios(models: bool, format: Format, out: &mut dyn Write) -> Result<()> {
    let list: Vec<Arc<Scenario>> = builtin_names().map(load).collect::<Result<_>>()?;
    if format == Format::Json {
        let v: Vec<serde_json::Value> = list
            .iter()
            .map(|s| {
                serde_json::json!({
                    "name": s.name,
                    "description": s.description,
                    "simulated": true,
                    "host": s.capacity().name,
                    "duration_s": s.duration_s,
                    "tick_ms": s.tick_ms,
                    "services": s.services.iter().map(|x| serde_json::json!({
                        "name": x.spec.name, "model": x.model.name,
                        "latency_critical": x.spec.is_latency_critical(),
                        "p99_target_ms": x.spec.p99_target_ms(),
                    })).collect::<Vec<_>>(),
                })
            })
            .collect();
        writeln!(out, "{}", serde_json::to_string_pretty(&v)?)?;
        return Ok(());
    }
    writeln!(
        out,
        "Built-in simulated scenarios (use a name with --scenario, or a TOML file):"
    )?;
    for s in &list {
        let lc: Vec<&str> = s
            .services
            .iter()
            .filter(|x| x.spec.is_latency_critical())
            .map(|x| x.spec.name.as_str())
            .collect();
        let be: Vec<&str> = s
            .services
            .iter()
            .filter(|x| !x.spec.is_latency_critical())
            .map(|x| x.spec.name.as_str())
            .collect();
        writeln!(out, "  {:<14} {}", s.name, s.description)?;
        writeln!(
            out,
            "  {:<14} {} s at {} ms ticks on {}; LC: {}; BE: {}",
            "",
            s.duration_s,
            s.tick_ms,
            s.capacity().name,
            lc.join(", "),
            be.join(", ")
        )?;
    }
    if models {
        writeln!(
            out,
            "\nService models (calibrated on the simulated Xeon E5-2697 v4):"
        )?;
        writeln!(
            out,
            "  {:<13} {:>10} {:>12} {:>12}  source",
            "model", "target_ms", "max_load_rps", "knee_rps"
        )?;
        for m in catalogue::catalogue() {
            match m.latency {
                Some(l) => writeln!(
                    out,
                    "  {:<13} {:>10} {:>12.0} {:>12.0}  {}",
                    m.name, l.p99_target_ms, l.max_load_rps, l.knee_rps, m.source
                )?,
                None => writeln!(
                    out,
                    "  {:<13} {:>10} {:>12} {:>12}  {} ({})",
                    m.name, "-", "-", "-", m.source, m.about
                )?,
            }
        }
        writeln!(out, "\nPlatforms (host.preset):")?;
        for (name, p) in Platform::ALL {
            let h = p.host().capacity;
            writeln!(
                out,
                "  {:<20} {} cores, {:.1} GHz, {} x {:.2} MB LLC ways, {:.1} GB/s, {} GPU(s)",
                name,
                h.cores,
                h.freq_ghz,
                h.llc_ways,
                h.llc_way_bytes as f64 / 1048576.0,
                h.mem_bw_bytes_per_s / 1e9,
                h.gpus.len()
            )?;
        }
    }
    Ok(())
}

fn simulate_cmd(
    name: &str,
    policy: PolicyKind,
    dir: &PathBuf,
    seed: Option<u64>,
    sim: &SimArgs,
    out: &mut dyn Write,
) -> Result<()> {
    let scenario = sim.scenario(name)?;
    let model = sim.model()?;
    std::fs::create_dir_all(dir)
        .with_context(|| format!("creating output directory {}", dir.display()))?;
    let log_path = dir.join("decisions.jsonl");
    let file =
        File::create(&log_path).with_context(|| format!("creating {}", log_path.display()))?;
    let mut log = BufWriter::new(file);
    let run = simulate::run_policy_with(&scenario, policy, seed, model.as_ref(), |r| {
        serde_json::to_writer(&mut log, r)?;
        log.write_all(b"\n")
    })
    .with_context(|| format!("simulating {} with {policy}", scenario.name))?;
    log.flush()
        .with_context(|| format!("writing {}", log_path.display()))?;
    let mut summary = run.summary;
    summary.be_throughput_vs_oracle = if policy == PolicyKind::Oracle {
        Some(1.0)
    } else {
        let oracle = simulate::run_policy(&scenario, PolicyKind::Oracle, seed, |_| Ok(()))?;
        Some(summary.be_throughput / oracle.summary.be_throughput.max(1e-12))
    };
    let summary_path = dir.join("summary.json");
    std::fs::write(
        &summary_path,
        serde_json::to_string_pretty(&summary)? + "\n",
    )
    .with_context(|| format!("writing {}", summary_path.display()))?;
    writeln!(out, "{BANNER}")?;
    writeln!(
        out,
        "scenario {} on {} for {} s, policy {policy}, seed {}",
        scenario.name,
        scenario.capacity().name,
        scenario.duration_s,
        summary.seed
    )?;
    write!(out, "{}", table(std::slice::from_ref(&summary), false))?;
    writeln!(
        out,
        "wrote {} ({} records) and {}",
        log_path.display(),
        run.records.len(),
        summary_path.display()
    )?;
    Ok(())
}

fn compare_cmd(
    name: &str,
    policies: &[PolicyKind],
    seed: Option<u64>,
    format: Format,
    dir: Option<&std::path::Path>,
    sim: &SimArgs,
    out: &mut dyn Write,
) -> Result<()> {
    let model = sim.model()?;
    if policies.is_empty() {
        bail!("--policies needs at least one policy");
    }
    let names: Vec<String> = if name == "all" {
        builtin_names().map(str::to_string).collect()
    } else {
        vec![name.to_string()]
    };
    // Progress on a terminal only; silent when stderr is a pipe or a file.
    let progress = indicatif::ProgressBar::new(names.len() as u64).with_style(
        indicatif::ProgressStyle::with_template(
            "{msg:>16} [{bar:30}] {pos}/{len} scenarios, {elapsed}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let mut all = Vec::new();
    for n in &names {
        progress.set_message(n.clone());
        let scenario = sim.scenario(n)?;
        let runs = simulate::compare_runs_with(&scenario, policies, seed, model.as_ref())
            .with_context(|| format!("comparing policies on {n}"))?;
        if let Some(dir) = dir {
            for r in &runs {
                let d = dir.join(&r.summary.scenario).join(&r.summary.policy);
                std::fs::create_dir_all(&d).with_context(|| format!("creating {}", d.display()))?;
                let mut text = String::new();
                for rec in &r.records {
                    text.push_str(&serde_json::to_string(rec)?);
                    text.push('\n');
                }
                std::fs::write(d.join("decisions.jsonl"), text)
                    .with_context(|| format!("writing into {}", d.display()))?;
            }
        }
        if format == Format::Table && names.len() == 1 {
            writeln!(out, "{BANNER}")?;
            writeln!(
                out,
                "scenario {} on {} for {} s, seed {}",
                scenario.name,
                scenario.capacity().name,
                scenario.duration_s,
                seed.unwrap_or(scenario.seed)
            )?;
        }
        all.extend(runs.into_iter().map(|r| r.summary));
        progress.inc(1);
    }
    progress.finish_and_clear();
    if let Some(dir) = dir {
        std::fs::write(
            dir.join("summary.json"),
            serde_json::to_string_pretty(&all)? + "\n",
        )
        .with_context(|| format!("writing {}", dir.join("summary.json").display()))?;
    }
    match format {
        Format::Json => writeln!(out, "{}", serde_json::to_string_pretty(&all)?)?,
        Format::Table => {
            if names.len() > 1 {
                writeln!(out, "{BANNER}")?;
            }
            write!(out, "{}", table(&all, names.len() > 1))?;
            writeln!(out, "qos_met: share of intervals with every LC service under target (ground truth); conv: intervals to settle after a load change; be_vs_oracle: best-effort throughput over the oracle's.")?;
        }
    }
    if let Some(dir) = dir {
        writeln!(
            out,
            "wrote the runs and summary.json under {}",
            dir.display()
        )?;
    }
    Ok(())
}

/// The comparison table.
pub fn table(rows: &[RunSummary], with_scenario: bool) -> String {
    let mut s = String::new();
    let opt = |v: Option<f64>, p: usize| v.map_or_else(|| "-".to_string(), |x| format!("{x:.p$}"));
    if with_scenario {
        let _ = write!(s, "{:<14} ", "scenario");
    }
    let _ = writeln!(
        s,
        "{:<8} {:>8} {:>9} {:>8} {:>9} {:>8} {:>8} {:>12} {:>10} {:>10} {:>10}",
        "policy",
        "qos_met",
        "sev_mean",
        "sev_max",
        "conv_p50",
        "conv_max",
        "be_tput",
        "be_vs_oracle",
        "actuations",
        "dec_p50_us",
        "dec_p99_us"
    );
    for r in rows {
        if with_scenario {
            let _ = write!(s, "{:<14} ", r.scenario);
        }
        let _ = writeln!(
            s,
            "{:<8} {:>8.4} {:>9.3} {:>8.2} {:>9} {:>8} {:>8.3} {:>12} {:>10} {:>10.1} {:>10.1}",
            r.policy,
            r.qos_met_fraction,
            r.violation_severity_mean,
            r.violation_severity_max,
            opt(r.convergence_intervals_p50, 1),
            r.convergence_intervals_max
                .map_or_else(|| "-".into(), |v| v.to_string()),
            r.be_throughput,
            opt(r.be_throughput_vs_oracle, 3),
            r.actuations,
            r.decision_us_p50,
            r.decision_us_p99
        );
    }
    s
}
