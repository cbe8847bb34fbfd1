//! The `cohabit` command line. `main.rs` only parses and calls [`run`].

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Result;
use clap::{CommandFactory, Parser, Subcommand, ValueEnum};
use cohabit_lab::commands::{self, SimOptions};
use cohabit_lab::report::plot::PlotFormat;
use cohabit_lab::LabPolicy;

/// `cohabit --version`: the version, and whether this build has the Kubernetes node agent
/// (the cargo feature `kubernetes`; the Debian package and the image have it).
pub const VERSION: &str = if cfg!(feature = "kubernetes") {
    concat!(
        env!("CARGO_PKG_VERSION"),
        " (with the Kubernetes node agent)"
    )
} else {
    concat!(
        env!("CARGO_PKG_VERSION"),
        " (without the Kubernetes node agent: cargo feature `kubernetes`)"
    )
};

/// cohabit: keep latency-critical services on target while best-effort jobs use the rest.
#[derive(Debug, Parser)]
#[command(
    name = "cohabit",
    version = VERSION,
    about = "Keep latency-critical services on target while best-effort jobs use the rest of the host"
)]
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

impl From<Format> for cohabit_lab::Format {
    fn from(f: Format) -> Self {
        match f {
            Format::Table => cohabit_lab::Format::Table,
            Format::Json => cohabit_lab::Format::Json,
        }
    }
}

/// Image format of the plots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ImageFormat {
    /// Raster.
    Png,
    /// Vector.
    Svg,
}

impl From<ImageFormat> for PlotFormat {
    fn from(f: ImageFormat) -> Self {
        match f {
            ImageFormat::Png => PlotFormat::Png,
            ImageFormat::Svg => PlotFormat::Svg,
        }
    }
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
        /// Policy: static, parties, clite, ml or oracle.
        #[arg(long, default_value = "parties")]
        policy: LabPolicy,
        /// Directory for decisions.jsonl and summary.json (created if missing).
        #[arg(long)]
        out: PathBuf,
        /// Seed of the measurement noise (default: the scenario's).
        #[arg(long)]
        seed: Option<u64>,
        /// Explore safely around the policy's plans, as `cohabit run --explore` does
        /// (decision path `explore`; the log trains a model with cohabit-train).
        #[arg(long)]
        explore: bool,
        /// Margin under every target that exploration keeps (with --explore).
        #[arg(long, default_value_t = 0.3, requires = "explore")]
        explore_margin: f64,
        #[command(flatten)]
        sim: SimArgs,
    },
    /// Print a shell completion script for this command (bash, zsh, fish, elvish, powershell).
    Completions {
        /// The shell.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print this command's manual page (roff, for `man -l -`); the Debian package installs it.
    Man,
    /// Report what this host can do: RDT, cgroups, hardware counters, GPUs, MPS.
    Probe {
        /// Output format.
        #[arg(long, value_enum, default_value_t = Format::Table)]
        format: Format,
    },
    /// Show what `run` would do on this host, changing nothing: per service the matched
    /// processes, their cgroups, what would be controlled (in place, moved, unmanaged and
    /// why) and the latency source's first reading. Exits non-zero when `run` would refuse
    /// to start.
    Check {
        /// Configuration file (TOML; see examples/cohabit.toml).
        #[arg(long)]
        config: PathBuf,
        /// How long to gather the latency sources' first reading, in milliseconds.
        #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u64).range(0..=60_000))]
        wait_ms: u64,
        /// Output format.
        #[arg(long, value_enum, default_value_t = Format::Table)]
        format: Format,
    },
    /// Run the daemon on this host until SIGTERM, SIGINT, SIGHUP or SIGQUIT, then restore it.
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
        /// Move the state file (STATE_DIR/changes.json) aside unread instead of restoring
        /// the host from it (without it, what cannot be restored goes to quarantine and the
        /// daemon starts). Also set by COHABIT_DISCARD_STATE (1/true/yes/on, or
        /// 0/false/no/off), for a DaemonSet.
        #[arg(
            long,
            env = "COHABIT_DISCARD_STATE",
            value_parser = clap::builder::BoolishValueParser::new()
        )]
        discard_state: bool,
        /// Explore safely around the policy's plans to collect training logs: vary
        /// allocations a little while every service keeps its margin under its target,
        /// stop at the first violation (settings: `explore = { … }` in the configuration).
        #[arg(long)]
        explore: bool,
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
            default_value = "static,parties,clite,ml,oracle"
        )]
        policies: Vec<LabPolicy>,
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
    /// The whole benchmark: every built-in scenario × static, parties, clite, ml and oracle on its
    /// own platform, and the CPU scenarios again on a Xeon Gold 6338 with that platform's
    /// warm-started model; then ml's targets, checked side by side.
    Bench {
        /// Second platform for the CPU scenarios.
        #[arg(long, default_value = "xeon-gold-6338")]
        platform: String,
        /// Seed of the measurement noise (default: each scenario's).
        #[arg(long)]
        seed: Option<u64>,
        /// Only these scenarios (comma-separated built-in or crowded names; default: all).
        #[arg(long, value_delimiter = ',')]
        scenarios: Option<Vec<String>>,
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
        #[arg(long, value_enum, default_value_t = ImageFormat::Png)]
        format: ImageFormat,
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
    /// One of `ml`'s tunables, as the daemon's `ml = { … }` table has them (repeatable):
    /// `--ml margin=0.95 --ml shrink_after=3`. Each trades QoS for best effort
    /// (docs/CONFIGURATION.md, "Tuning ml").
    #[arg(long = "ml", value_name = "KEY=VALUE")]
    pub ml: Vec<String>,
}

impl SimArgs {
    fn options(&self) -> Result<SimOptions> {
        Ok(SimOptions {
            platform: self.platform.clone(),
            model: self.model.clone(),
            explore: None,
            ml: if self.ml.is_empty() {
                None
            } else {
                Some(crate::daemon::config::ml_settings(&self.ml).map_err(anyhow::Error::msg)?)
            },
        })
    }
}

/// Runs a parsed command, writing its report to `out`.
pub fn run(cli: Cli, out: &mut dyn Write) -> Result<()> {
    match cli.command {
        Command::Scenarios { models, format } => {
            commands::scenarios_cmd(models, format.into(), out)
        }
        Command::Simulate {
            scenario,
            policy,
            out: dir,
            seed,
            explore,
            explore_margin,
            sim,
        } => {
            let mut options = sim.options()?;
            if explore {
                options.explore = Some(explore_config(explore_margin)?);
            }
            commands::simulate_cmd(&scenario, policy, &dir, seed, &options, out)
        }
        Command::Compare {
            scenario,
            policies,
            seed,
            format,
            out: dir,
            sim,
        } => commands::compare_cmd(
            &scenario,
            &policies,
            seed,
            format.into(),
            dir.as_deref(),
            &sim.options()?,
            out,
        ),
        Command::Bench {
            platform,
            seed,
            scenarios,
            format,
        } => {
            cohabit_lab::bench::bench_cmd(&platform, seed, scenarios.as_deref(), format.into(), out)
        }
        Command::Plot {
            run_dir,
            out: dir,
            format,
        } => {
            let dest = dir.unwrap_or_else(|| run_dir.join("plots"));
            commands::plot_cmd(&run_dir, &dest, format.into(), out)
        }
        Command::Report { run_dir, out: dir } => {
            commands::report_cmd(&run_dir, dir.as_deref(), out)
        }
        Command::Completions { shell } => {
            // Into memory first: clap_complete panics on a failed write (a closed pipe).
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut Cli::command(), "cohabit", &mut script);
            Ok(out.write_all(&script)?)
        }
        Command::Man => Ok(clap_mangen::Man::new(Cli::command()).render(out)?),
        Command::Probe { format } => probe_cmd(format, out),
        Command::Check {
            config,
            wait_ms,
            format,
        } => check_cmd(config, wait_ms, format, out),
        Command::Run {
            config,
            dry_run,
            ticks,
            discard_state,
            explore,
        } => {
            let opts = crate::daemon::RunOptions {
                dry_run,
                max_ticks: ticks,
                discard_state,
                explore,
            };
            run_cmd(&config, opts, out)
        }
    }
}

/// `cohabit simulate --explore`'s settings, with the boundary margin `margin`.
fn explore_config(margin: f64) -> Result<cohabit_policy::ExploreConfig> {
    let cfg = cohabit_policy::ExploreConfig {
        margin,
        ..cohabit_policy::ExploreConfig::default()
    };
    cfg.validate().map_err(anyhow::Error::msg)?;
    Ok(cfg)
}

/// `cohabit probe`: what this host offers, in `format`.
fn probe_cmd(format: Format, out: &mut dyn Write) -> Result<()> {
    // The pipe directory the MPS control program would use when run from this shell.
    let pipe = std::env::var_os("CUDA_MPS_PIPE_DIRECTORY").map(PathBuf::from);
    let report = crate::daemon::probe::probe(
        &cohabit_collectors::HostPaths::standard(),
        Path::new(crate::daemon::config::DEFAULT_MPS_CONTROL),
        pipe,
    );
    match format {
        Format::Json => writeln!(out, "{}", serde_json::to_string_pretty(&report)?)?,
        Format::Table => write!(out, "{}", report.render())?,
    }
    Ok(())
}

/// `cohabit check`: the configuration at `config` against this host, in `format`; an error
/// when `cohabit run` would refuse to start with it.
fn check_cmd(config: PathBuf, wait_ms: u64, format: Format, out: &mut dyn Write) -> Result<()> {
    let cfg = crate::daemon::config::DaemonConfig::load(&config)?;
    let report =
        crate::daemon::check::check(cfg, config, std::time::Duration::from_millis(wait_ms))?;
    match format {
        Format::Json => writeln!(out, "{}", serde_json::to_string_pretty(&report)?)?,
        Format::Table => write!(out, "{}", report.render())?,
    }
    anyhow::ensure!(
        report.would_start(),
        "cohabit run would refuse to start with this configuration (see above)"
    );
    Ok(())
}

/// `cohabit run`: the daemon with the configuration at `config`, until it stops.
fn run_cmd(config: &Path, opts: crate::daemon::RunOptions, out: &mut dyn Write) -> Result<()> {
    let cfg = crate::daemon::config::DaemonConfig::load(config)?;
    let n = crate::daemon::run_blocking(cfg, opts)?;
    writeln!(out, "cohabit stopped after {n} ticks; host restored")?;
    Ok(())
}
