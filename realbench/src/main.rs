//! `cohabit-realbench`: parses arguments and calls [`cohabit_realbench::bench::run`].

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use cohabit_realbench::antagonists::Scenario;
use cohabit_realbench::bench::{self, Options, ServiceSetup};
use cohabit_realbench::policies::{BestEffortCpus, Policy};

/// cohabit on real services (memcached, nginx, redis) under stress-ng batch jobs, judged by
/// an independent open-loop client. Needs root and the Debian packages memcached,
/// nginx-light, stress-ng (and redis-server for redis).
#[derive(Debug, Parser)]
#[command(name = "cohabit-realbench", version)]
struct Cli {
    #[command(subcommand)]
    command: Option<Cmd>,
    /// Where results.json, results.txt and each run's configurations and logs go.
    #[arg(long, default_value = "realbench-out")]
    out: PathBuf,
    /// The short version CI runs (the CPU batch job; none and parties; 6 s runs).
    #[arg(long)]
    quick: bool,
    /// Batch jobs, comma-separated: cpu, membw, cache.
    #[arg(long, value_delimiter = ',')]
    scenarios: Option<Vec<Scenario>>,
    /// Policies, comma-separated: none, cap, idle (the batch job's cgroup in the kernel's
    /// idle class, Linux 5.15 or later), static, parties, clite (not in the full run: one
    /// search takes up to 90 intervals), ml, ml-host (ml with a model trained on this host's
    /// own logs from an explore phase first).
    #[arg(long, value_delimiter = ',')]
    policies: Option<Vec<Policy>>,
    /// A service as KIND[:RPS[:P99_MS]] (repeat; default memcached:2000:1 and nginx:500:2).
    #[arg(long = "service")]
    services: Vec<ServiceSetup>,
    /// Seconds measured per run.
    #[arg(long)]
    duration_s: Option<u32>,
    /// Seconds at the start of each run left out of the summary.
    #[arg(long)]
    warmup_s: Option<u32>,
    /// cohabit's control interval.
    #[arg(long)]
    interval_ms: Option<u64>,
    /// cohabit's probe requests per second per service.
    #[arg(long)]
    probe_rate_hz: Option<u32>,
    /// cohabit's probe time-out.
    #[arg(long)]
    probe_timeout_ms: Option<u64>,
    /// cohabit's `[host] best_effort_cpus`: spare or all (default: not written, cohabit's
    /// own default).
    #[arg(long)]
    best_effort_cpus: Option<BestEffortCpus>,
    /// One of cohabit's `ml` tunables for the ml and ml-host runs, as `cohabit simulate
    /// --ml` takes them (repeatable): `--ml margin=0.95` (docs/CONFIGURATION.md, "Tuning ml").
    #[arg(long = "ml", value_name = "KEY=VALUE", value_parser = cohabit_realbench::policies::ml_pair)]
    ml: Vec<String>,
    /// The cohabit binary (default: beside this one, then PATH).
    #[arg(long)]
    cohabit: Option<PathBuf>,
    /// The model for ml (default: cohabit's built-in one); ml-host starts from it.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Seconds of each explore run (`cohabit run --explore`, per batch job) for ml-host.
    #[arg(long)]
    explore_s: Option<u32>,
    /// The cohabit-train binary, for ml-host (default: beside this one, then PATH).
    #[arg(long)]
    cohabit_train: Option<PathBuf>,
    /// Epochs per ensemble member when training the host model.
    #[arg(long)]
    train_epochs: Option<usize>,
    /// Skip the runs of the services alone and of each batch job alone.
    #[arg(long)]
    no_baselines: bool,
    /// Run each policy with the services alone, no batch job, instead of beside each
    /// batch job (the batch jobs alone still run as baselines unless --no-baselines).
    #[arg(long)]
    alone: bool,
    /// Rounds of the co-located runs, interleaved (the table adds each policy's sums).
    #[arg(long)]
    rounds: Option<u32>,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Stop what a killed run left (processes in its cgroups) and remove its cgroups.
    Cleanup,
}

fn options(cli: Cli) -> Options {
    let mut o = if cli.quick {
        Options::quick(cli.out)
    } else {
        Options::full(cli.out)
    };
    if let Some(s) = cli.scenarios {
        o.scenarios = s;
    }
    if let Some(p) = cli.policies {
        o.policies = p;
    }
    if !cli.services.is_empty() {
        o.services = cli.services;
    }
    o.duration_s = cli.duration_s.unwrap_or(o.duration_s);
    o.warmup_s = cli.warmup_s.unwrap_or(o.warmup_s);
    o.interval_ms = cli.interval_ms.unwrap_or(o.interval_ms);
    o.probe_rate_hz = cli.probe_rate_hz.unwrap_or(o.probe_rate_hz);
    o.probe_timeout_ms = cli.probe_timeout_ms.unwrap_or(o.probe_timeout_ms);
    o.best_effort_cpus = cli.best_effort_cpus;
    o.ml = cli.ml;
    o.cohabit = cli.cohabit;
    o.model = cli.model;
    o.explore_s = cli.explore_s.unwrap_or(o.explore_s);
    o.cohabit_train = cli.cohabit_train;
    o.train.epochs = cli.train_epochs.unwrap_or(o.train.epochs).max(1);
    o.baselines = !cli.no_baselines;
    o.alone = cli.alone;
    o.rounds = cli.rounds.unwrap_or(o.rounds);
    o
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Some(Cmd::Cleanup) = cli.command {
        let done = cohabit_realbench::cgroups::Tree::detect(std::path::Path::new("/proc"))
            .and_then(|t| {
                cohabit_realbench::procs::cleanup_leftovers(
                    &t,
                    std::path::Path::new(cohabit_realbench::procs::STATE_DIR),
                )
            });
        return match done {
            Ok(n) => {
                println!("stopped {n} leftover processes; the benchmark's cgroups are gone");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let opts = options(cli);
    let mut err = std::io::stderr();
    match bench::run(&opts, &mut err) {
        Ok(report) => {
            print!("{}", report.table());
            println!("results: {}", opts.out.join("results.json").display());
            ExitCode::SUCCESS
        }
        Err(e @ cohabit_realbench::Error::Interrupted) => {
            eprintln!("{e}");
            ExitCode::from(130)
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
