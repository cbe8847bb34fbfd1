//! The benchmark: the services alone, each batch job alone, then each batch job with the
//! services under every policy; one run at a time, each from a clean start.
//!
//! A co-located run: start the services and preload them; start `cohabit run` (for
//! cohabit's policies) and wait for its first decision; start the batch job; after half a
//! second start the clients, which run `warmup + duration` seconds; then stop the daemon
//! (`SIGTERM`: it restores the host), collect the batch job's metrics and stop the
//! services. The batch job runs `warmup + duration + 1` seconds in every run, alone or not,
//! so its throughputs compare.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::antagonists::{self, Scenario, Throughput};
use crate::client::{Load, LoadSpec};
use crate::host_model::{self, FitSettings, HostModel};
use crate::policies::{self, BestEffortCpus, CohabitConfig, LcEntry, Policy};
use crate::procs::Lab;
use crate::report::{
    summarize, BatchResult, CohabitResult, Machine, Report, RunKind, RunResult, ServiceResult,
};
use crate::services::{self, Kind};
use crate::{sys, tools, Error};

/// One service's load and target.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ServiceSetup {
    /// Which service.
    pub kind: Kind,
    /// Offered requests per second.
    pub rate_rps: f64,
    /// p99 target, ms (client-side, and cohabit's target).
    pub p99_target_ms: f64,
    /// Client connections.
    pub conns: usize,
}

impl ServiceSetup {
    /// The defaults for a service.
    pub fn default_for(kind: Kind) -> Self {
        match kind {
            Kind::Memcached => Self {
                kind,
                rate_rps: 2000.0,
                p99_target_ms: 1.0,
                conns: 4,
            },
            Kind::Nginx => Self {
                kind,
                rate_rps: 500.0,
                p99_target_ms: 2.0,
                conns: 2,
            },
            Kind::Redis => Self {
                kind,
                rate_rps: 1000.0,
                p99_target_ms: 1.0,
                conns: 2,
            },
        }
    }
}

impl std::str::FromStr for ServiceSetup {
    type Err = String;

    /// `KIND[:RPS[:P99_MS]]`, e.g. `memcached:2000:1.0`.
    fn from_str(s: &str) -> Result<Self, String> {
        let mut parts = s.split(':');
        let kind: Kind = parts.next().unwrap_or_default().parse()?;
        let mut out = Self::default_for(kind);
        if let Some(r) = parts.next() {
            out.rate_rps = r
                .parse::<f64>()
                .ok()
                .filter(|r| r.is_finite() && *r > 0.0 && *r <= 1e6)
                .ok_or_else(|| {
                    format!(
                        "{s:?}: the rate {r:?} must be a number of requests per second (0, 1e6]"
                    )
                })?;
        }
        if let Some(t) = parts.next() {
            out.p99_target_ms = t
                .parse::<f64>()
                .ok()
                .filter(|t| t.is_finite() && *t > 0.0)
                .ok_or_else(|| {
                    format!("{s:?}: the p99 target {t:?} must be a positive number of ms")
                })?;
        }
        if parts.next().is_some() {
            return Err(format!("{s:?}: expected KIND[:RPS[:P99_MS]]"));
        }
        Ok(out)
    }
}

/// What to run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Options {
    /// Where results, configurations, logs and decision logs go.
    pub out: PathBuf,
    /// The batch jobs, one scenario each.
    pub scenarios: Vec<Scenario>,
    /// The policies.
    pub policies: Vec<Policy>,
    /// The services.
    pub services: Vec<ServiceSetup>,
    /// Seconds measured per run.
    pub duration_s: u32,
    /// Seconds at the start of each run left out of the summary.
    pub warmup_s: u32,
    /// cohabit's control interval.
    pub interval_ms: u64,
    /// cohabit's probe rate per service.
    pub probe_rate_hz: u32,
    /// cohabit's probe time-out.
    pub probe_timeout_ms: u64,
    /// cohabit's `[host] best_effort_cpus` (`None`: not written, cohabit's default).
    pub best_effort_cpus: Option<BestEffortCpus>,
    /// `ml`'s tunables as `KEY=VALUE` pairs, written into `ml = { … }` for the `ml` and
    /// `ml-host` runs (cohabit checks them and refuses a bad one by name at start).
    pub ml: Vec<String>,
    /// The cohabit binary (default: beside this one, then `PATH`).
    pub cohabit: Option<PathBuf>,
    /// The model for `ml` (default: the built-in one, written into `out`); `ml-host` is
    /// warm-started from it.
    pub model: Option<PathBuf>,
    /// Seconds of each explore run (`cohabit run --explore` around `ml`, per batch job)
    /// whose logs train the `ml-host` model; only when `ml-host` is asked for.
    pub explore_s: u32,
    /// `cohabit-train` (default: beside this binary, then `PATH`), for `ml-host`.
    pub cohabit_train: Option<PathBuf>,
    /// How the host model is fitted.
    pub train: FitSettings,
    /// Also run the services alone and each batch job alone (without them the batch
    /// job's relative throughput is unknown).
    pub baselines: bool,
    /// The policies' runs without a batch job: each policy controls the services alone
    /// (issue 45's "memcached alone"), instead of beside each batch job.
    pub alone: bool,
    /// Rounds of the co-located runs: every batch job under every policy once per round,
    /// interleaved, so that a host whose noise drifts over minutes weighs on every policy
    /// alike; the table then adds each policy's sums over the rounds.
    pub rounds: u32,
}

impl Options {
    /// The full benchmark's settings.
    pub fn full(out: PathBuf) -> Self {
        Self {
            out,
            scenarios: vec![Scenario::Cpu, Scenario::Membw, Scenario::Cache],
            policies: vec![
                Policy::None,
                Policy::Cap,
                Policy::Idle,
                Policy::Static,
                Policy::Parties,
                Policy::Ml,
            ],
            services: vec![
                ServiceSetup::default_for(Kind::Memcached),
                ServiceSetup::default_for(Kind::Nginx),
            ],
            duration_s: 60,
            warmup_s: 5,
            interval_ms: 1000,
            probe_rate_hz: 200,
            probe_timeout_ms: 100,
            best_effort_cpus: None,
            ml: Vec::new(),
            cohabit: None,
            model: None,
            explore_s: 60,
            cohabit_train: None,
            train: FitSettings {
                members: 5,
                epochs: 60,
            },
            baselines: true,
            alone: false,
            rounds: 1,
        }
    }

    /// The short version CI runs: the CPU batch job, two policies, short runs.
    pub fn quick(out: PathBuf) -> Self {
        Self {
            scenarios: vec![Scenario::Cpu],
            policies: vec![Policy::None, Policy::Parties],
            duration_s: 6,
            warmup_s: 2,
            interval_ms: 500,
            explore_s: 10,
            train: FitSettings {
                members: 2,
                epochs: 10,
            },
            ..Self::full(out)
        }
    }

    fn tools(&self) -> Vec<tools::Tool> {
        let mut t = vec![tools::SH, tools::STRESS_NG];
        t.extend(self.services.iter().map(|s| s.kind.tool()));
        t
    }

    fn validate(&self) -> Result<(), Error> {
        let bad = |m: String| Err(Error::Host(m));
        if self.duration_s == 0 || self.duration_s > 3600 {
            return bad(format!(
                "a duration from 1 to 3600 s, not {}",
                self.duration_s
            ));
        }
        if self.warmup_s > 600 {
            return bad(format!("a warm-up of at most 600 s, not {}", self.warmup_s));
        }
        if self.services.is_empty() {
            return bad("at least one service".into());
        }
        let mut kinds: Vec<Kind> = self.services.iter().map(|s| s.kind).collect();
        kinds.sort();
        kinds.dedup();
        if kinds.len() != self.services.len() {
            return bad("each service at most once".into());
        }
        if self.policies.is_empty() {
            return bad("at least one policy".into());
        }
        if !(1..=100).contains(&self.rounds) {
            return bad(format!("from 1 to 100 rounds, not {}", self.rounds));
        }
        if self.policies.contains(&Policy::MlHost) && !(2..=3600).contains(&self.explore_s) {
            return bad(format!(
                "an explore run from 2 to 3600 s for ml-host, not {}",
                self.explore_s
            ));
        }
        Ok(())
    }
}

/// Writes the built-in model for `ml` into `dir`.
fn write_model(dir: &Path) -> Result<PathBuf, Error> {
    let model = cohabit_models::builtin::builtin("xeon-e5-2697v4")
        .ok_or_else(|| Error::Host("cohabit's built-in model (not compiled in)".into()))?
        .map_err(|e| Error::Host(format!("cohabit's built-in model to load ({e})")))?;
    model
        .save(dir, "qos-v1")
        .map_err(|e| Error::Host(format!("the built-in model written out ({e})")))
}

/// Processes that would be mistaken for the benchmark's, or a daemon already running. Other
/// `cohabit` commands (a simulation, a report) touch no cgroup and are left out.
fn foreign_processes(services: &[ServiceSetup]) -> Vec<String> {
    let mine = std::process::id();
    sys::all_pids()
        .into_iter()
        .filter(|p| *p != mine)
        .filter_map(|p| sys::comm(p).map(|c| (p, c)))
        .filter(|(p, c)| {
            ((c == "cohabit" && sys::first_arg(*p).as_deref() == Some("run"))
                || c.starts_with("stress-ng")
                || services.iter().any(|s| s.kind.comm() == c))
                && sys::alive(*p)
        })
        .map(|(p, c)| format!("{c} (pid {p})"))
        .collect()
}

fn machine(cgroup: &str) -> Machine {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu_model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .and_then(|l| l.split_once(':'))
        .map_or("unknown".into(), |(_, v)| v.trim().to_string());
    let memory_gib = std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0 / 1024.0);
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .unwrap_or_default()
        .trim()
        .to_string();
    let version = |prog: &str, arg: &str| -> Option<(String, String)> {
        let path = tools::find(prog)?;
        let out = std::process::Command::new(path).arg(arg).output().ok()?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        Some((prog.to_string(), text.lines().next()?.trim().to_string()))
    };
    let tools = [
        ("memcached", "-V"),
        ("nginx", "-v"),
        ("redis-server", "--version"),
        ("stress-ng", "--version"),
    ]
    .iter()
    .filter_map(|(p, a)| version(p, a))
    .collect();
    Machine {
        cpu_model,
        cpus: policies::online_cpus().len(),
        memory_gib,
        kernel,
        cgroup: cgroup.to_string(),
        tools,
        wake_late_us: wake_late_us(500),
    }
}

/// How late `samples` sleeps of 1 ms end, µs (p50, p99), measured here and now.
fn wake_late_us(samples: usize) -> (u64, u64) {
    let nap = Duration::from_millis(1);
    let mut late: Vec<u64> = (0..samples.max(1))
        .map(|_| {
            let t = Instant::now();
            std::thread::sleep(nap);
            crate::whole(t.elapsed().saturating_sub(nap).as_secs_f64() * 1e6)
        })
        .collect();
    late.sort_unstable();
    let at = |pct: usize| late[(late.len() * pct).div_ceil(100).saturating_sub(1)];
    (at(50), at(99))
}

/// Everything one run needs that does not change between runs.
struct Ctx<'a> {
    opts: &'a Options,
    cohabit: Option<PathBuf>,
    /// The built-in (simulator-trained) model, for `ml` and the explore runs.
    model: Option<PathBuf>,
    cohabit_train: Option<PathBuf>,
    /// The host-trained model, once trained.
    host_model: Option<PathBuf>,
    stress_ng: PathBuf,
    programs: Vec<(Kind, PathBuf)>,
    cpus: Vec<u32>,
    /// The round of the co-located runs under way, when there are several.
    round: Option<u32>,
    log: &'a mut dyn Write,
}

/// Runs the benchmark; progress lines go to `log`. Every process it started is stopped and
/// every cgroup removed before it returns, whatever happened.
pub fn run(opts: &Options, log: &mut dyn Write) -> Result<Report, Error> {
    opts.validate()?;
    // Every path handed to a service or the daemon is absolute: nginx reads a relative
    // `-c`/`-e` under its `-p` prefix, so `--out realbench-out` (README) failed to start it.
    let absolute = Options {
        out: std::path::absolute(&opts.out).map_err(crate::io_err("resolving", &opts.out))?,
        ..opts.clone()
    };
    let opts = &absolute;
    if !sys::is_root() {
        return Err(Error::Host(
            "root (it creates cgroups and runs the cohabit daemon)".into(),
        ));
    }
    let found = tools::require(&opts.tools())?;
    let stress_ng = found[1].clone();
    let programs = opts
        .services
        .iter()
        .zip(&found[2..])
        .map(|(s, p)| (s.kind, p.clone()))
        .collect();
    let uses_cohabit = opts.policies.iter().any(|p| p.cohabit().is_some());
    let cohabit = if uses_cohabit {
        Some(tools::cohabit(opts.cohabit.as_deref())?)
    } else {
        None
    };
    let host_column = opts.policies.contains(&Policy::MlHost);
    let cohabit_train = if host_column {
        Some(tools::cohabit_train(opts.cohabit_train.as_deref())?)
    } else {
        None
    };
    let foreign = foreign_processes(&opts.services);
    if !foreign.is_empty() {
        return Err(Error::Host(format!(
            "the host to itself: {} would be matched like the benchmark's processes or would fight its daemon; stop them first",
            foreign.join(", ")
        )));
    }
    let tree = crate::cgroups::Tree::detect(Path::new("/proc"))?;
    std::fs::create_dir_all(&opts.out).map_err(|source| Error::Io {
        what: "creating",
        path: opts.out.clone(),
        source,
    })?;
    let needs_model = opts.policies.contains(&Policy::Ml) || host_column;
    let model = match (&opts.model, needs_model) {
        (Some(m), true) => Some(m.clone()),
        (None, true) => Some(write_model(&opts.out)?),
        _ => None,
    };
    crate::interrupt::install()?;
    let machine = machine(tree.version());
    let mut lab = Lab::open(tree, Path::new(crate::procs::STATE_DIR))?;
    let mut ctx = Ctx {
        opts,
        cohabit,
        model,
        cohabit_train,
        host_model: None,
        stress_ng,
        programs,
        cpus: policies::online_cpus(),
        round: None,
        log,
    };
    let runs = all_runs(&mut ctx, &mut lab);
    let problems = lab.cleanup();
    let (runs, host_model) = runs?;
    if !problems.is_empty() {
        return Err(Error::Host(format!(
            "a clean host after the runs, but: {}",
            problems.join("; ")
        )));
    }
    let report = Report {
        machine,
        settings: serde_json::to_value(opts).unwrap_or_default(),
        runs,
        host_model,
    };
    let json = opts.out.join("results.json");
    let text = serde_json::to_string_pretty(&report).unwrap_or_default();
    std::fs::write(&json, text).map_err(|source| Error::Io {
        what: "writing",
        path: json.clone(),
        source,
    })?;
    let table = opts.out.join("results.txt");
    std::fs::write(&table, report.table()).map_err(|source| Error::Io {
        what: "writing",
        path: table,
        source,
    })?;
    Ok(report)
}

fn all_runs(
    ctx: &mut Ctx<'_>,
    lab: &mut Lab,
) -> Result<(Vec<RunResult>, Option<HostModel>), Error> {
    let mut runs = Vec::new();
    if ctx.opts.baselines {
        runs.push(one_run(
            ctx,
            lab,
            RunKind::ServicesAlone,
            None,
            Policy::None,
            &[],
        )?);
    }
    let mut baselines = Vec::new();
    for &scenario in &ctx.opts.scenarios {
        let mut baseline = Vec::new();
        if ctx.opts.baselines {
            let alone = one_run(
                ctx,
                lab,
                RunKind::BatchAlone,
                Some(scenario),
                Policy::None,
                &[],
            )?;
            baseline = alone.batch.iter().map(|b| b.throughput.clone()).collect();
            runs.push(alone);
        }
        baselines.push(baseline);
    }
    let host_model = if ctx.opts.policies.contains(&Policy::MlHost) {
        Some(explore_and_train(ctx, lab, &baselines, &mut runs)?)
    } else {
        None
    };
    let rounds = ctx.opts.rounds.max(1);
    for round in 1..=rounds {
        ctx.round = (rounds > 1).then_some(round);
        let co_located: Vec<(Option<Scenario>, &[Throughput])> = if ctx.opts.alone {
            vec![(None, &[])]
        } else {
            ctx.opts
                .scenarios
                .iter()
                .zip(&baselines)
                .map(|(&s, b)| (Some(s), b.as_slice()))
                .collect()
        };
        for (scenario, baseline) in co_located {
            for &policy in &ctx.opts.policies {
                if policy == Policy::MlHost && ctx.host_model.is_none() {
                    continue;
                }
                runs.push(one_run(
                    ctx,
                    lab,
                    RunKind::Colocated,
                    scenario,
                    policy,
                    baseline,
                )?);
            }
        }
    }
    ctx.round = None;
    Ok((runs, host_model))
}

/// The explore phase: one `cohabit run --explore` run around `ml` per batch job, then the
/// host model trained from their logs (kept in `ctx.host_model` when it trained).
fn explore_and_train(
    ctx: &mut Ctx<'_>,
    lab: &mut Lab,
    baselines: &[Vec<Throughput>],
    runs: &mut Vec<RunResult>,
) -> Result<HostModel, Error> {
    let mut logs = Vec::new();
    for (&scenario, baseline) in ctx.opts.scenarios.iter().zip(baselines) {
        let r = one_run(
            ctx,
            lab,
            RunKind::Explore,
            Some(scenario),
            Policy::Ml,
            baseline,
        )?;
        logs.extend(r.cohabit.as_ref().map(|c| c.log.clone()));
        runs.push(r);
    }
    let (Some(train), Some(init)) = (ctx.cohabit_train.clone(), ctx.model.clone()) else {
        return Err(Error::Host(
            "cohabit-train and the built-in model for ml-host".into(),
        ));
    };
    progress(
        ctx,
        "training the host model (cohabit-train logs, fit --init)",
    );
    let dir = ctx.opts.out.join("host-model");
    let m = host_model::train(&train, &logs, &init, &dir, ctx.opts.train)?;
    let line = match (&m.model, &m.error) {
        (Some(p), _) => format!(
            "  {} rows, trained in {:.1} s: {}",
            m.rows,
            m.train_s,
            p.display()
        ),
        (None, e) => format!(
            "  no host model, the ml-host runs are skipped: {}",
            e.as_deref().unwrap_or("unknown")
        ),
    };
    progress(ctx, &line);
    ctx.host_model.clone_from(&m.model);
    Ok(m)
}

fn progress(ctx: &mut Ctx<'_>, line: &str) {
    let _ = writeln!(ctx.log, "{line}");
    let _ = ctx.log.flush();
}

/// What the daemon was started with.
struct Daemon {
    proc: crate::procs::ProcId,
    config: PathBuf,
    log: PathBuf,
    output: PathBuf,
}

fn start_daemon(
    ctx: &mut Ctx<'_>,
    lab: &mut Lab,
    dir: &Path,
    (policy, explore): (Policy, bool),
    running: &[services::Running],
    batch_names: &[String],
) -> Result<Option<Daemon>, Error> {
    let (Some(name), Some(bin)) = (policy.cohabit(), ctx.cohabit.clone()) else {
        return Ok(None);
    };
    let entries: Vec<LcEntry> = running
        .iter()
        .map(|r| LcEntry {
            kind: r.kind,
            port: r.addr.port(),
            p99_target_ms: setup(ctx.opts, r.kind).p99_target_ms,
            user: r.kind.runs_as(),
        })
        .collect();
    let log = dir.join("decisions.jsonl");
    let config = dir.join("cohabit.toml");
    let state_dir = dir.join("cohabit-state");
    let text = policies::cohabit_toml(&CohabitConfig {
        policy: name,
        interval_ms: ctx.opts.interval_ms,
        model: match policy {
            Policy::Ml => ctx.model.as_deref(),
            Policy::MlHost => ctx.host_model.as_deref(),
            _ => None,
        },
        log: &log,
        state_dir: &state_dir,
        services: &entries,
        batch_names,
        batch_user: services::RunAs::benchmark(),
        probe_rate_hz: ctx.opts.probe_rate_hz,
        probe_timeout_ms: ctx.opts.probe_timeout_ms,
        best_effort_cpus: ctx.opts.best_effort_cpus,
        ml: if name == "ml" { &ctx.opts.ml } else { &[] },
        explore_walk: explore,
    });
    std::fs::write(&config, text).map_err(crate::io_err("writing", &config))?;
    let output = dir.join("cohabit.log");
    let mut args = vec![
        "run".to_string(),
        "--config".into(),
        config.display().to_string(),
    ];
    if explore {
        args.push("--explore".into());
    }
    // Started through a link named `cohabit`, so it runs under that name whatever the
    // binary is called (`cohabit-realbench cleanup` recognises it by it).
    let link = dir.join("cohabit");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&bin, &link).map_err(crate::io_err("linking", &link))?;
    let proc = lab.spawn(
        "cohabit",
        "ctl",
        &link,
        &args,
        &[("RUST_LOG", "info")],
        &output,
    )?;
    let t = Instant::now();
    loop {
        if decisions(&log) > 0 {
            break;
        }
        if !lab.get(proc).running() || t.elapsed() > Duration::from_secs(15) {
            return Err(Error::Cohabit {
                policy: name.into(),
                detail: format!(
                    "no decision within 15 s; its output ({}) ends with:\n{}",
                    output.display(),
                    lab.get(proc).log_tail(15)
                ),
            });
        }
        crate::interrupt::sleep(Duration::from_millis(50))?;
    }
    Ok(Some(Daemon {
        proc,
        config,
        log,
        output,
    }))
}

fn decisions(log: &Path) -> usize {
    std::fs::read_to_string(log).map_or(0, |t| t.lines().count())
}

fn stop_daemon(lab: &mut Lab, d: Daemon) -> CohabitResult {
    let pid = lab.get(d.proc).pid();
    let cpu_s = sys::cpu_seconds(pid);
    let exit_code = lab.terminate(d.proc, Duration::from_secs(20));
    let said = std::fs::read_to_string(&d.output)
        .unwrap_or_default()
        .contains("host restored");
    let left = lab
        .tree()
        .mounts()
        .iter()
        .any(|m| m.join("cohabit").exists());
    CohabitResult {
        exit_code,
        restored: exit_code == Some(0) && said && !left,
        cpu_s,
        decisions: decisions(&d.log),
        config: d.config,
        log: d.log,
        output: d.output,
    }
}

fn setup(opts: &Options, kind: Kind) -> &ServiceSetup {
    opts.services
        .iter()
        .find(|s| s.kind == kind)
        .expect("every running service comes from the options")
}

fn label(kind: RunKind, scenario: Option<Scenario>, policy: Policy) -> String {
    match (kind, scenario) {
        (RunKind::ServicesAlone, _) => "services-alone".into(),
        (RunKind::BatchAlone, Some(s)) => format!("{}-batch-alone", s.name()),
        (RunKind::Explore, Some(s)) => format!("{}-explore", s.name()),
        (_, Some(s)) => format!("{}-{}", s.name(), policy.name()),
        (_, None) => policy.name().into(),
    }
}

fn one_run(
    ctx: &mut Ctx<'_>,
    lab: &mut Lab,
    kind: RunKind,
    scenario: Option<Scenario>,
    policy: Policy,
    baseline: &[Throughput],
) -> Result<RunResult, Error> {
    crate::interrupt::check()?;
    let name = match ctx.round {
        Some(r) => format!("{}-r{r}", label(kind, scenario, policy)),
        None => label(kind, scenario, policy),
    };
    let dir = ctx.opts.out.join(&name);
    std::fs::create_dir_all(&dir).map_err(crate::io_err("creating", &dir))?;
    progress(ctx, &format!("run {name}"));
    let running = if kind == RunKind::BatchAlone {
        vec![]
    } else {
        start_services(ctx, lab, &dir)?
    };
    // The batch job's cgroup, capped (or made idle) before anything runs in it.
    lab.tree().create(antagonists::GROUP)?;
    match policy {
        Policy::Cap => policies::apply_cap(lab.tree(), antagonists::GROUP, &ctx.cpus)?,
        Policy::Idle => policies::apply_idle(lab.tree(), antagonists::GROUP)?,
        _ => {}
    }
    let batch_names: Vec<String> = scenario
        .map(|s| vec![s.worker_name().to_string()])
        .unwrap_or_default();
    let explore = kind == RunKind::Explore;
    let daemon = if matches!(kind, RunKind::Colocated | RunKind::Explore) {
        start_daemon(ctx, lab, &dir, (policy, explore), &running, &batch_names)?
    } else {
        None
    };
    let duration_s = if explore {
        ctx.opts.explore_s
    } else {
        ctx.opts.duration_s
    };
    let batch = match scenario {
        Some(s) if kind != RunKind::ServicesAlone => {
            Some(start_batch(ctx, lab, &dir, s, &batch_names, duration_s)?)
        }
        _ => None,
    };
    crate::interrupt::sleep(Duration::from_millis(500))?;
    let services = measure(ctx, lab, &running, daemon.as_ref(), policy, duration_s)?;
    let cohabit = daemon.map(|d| stop_daemon(lab, d));
    let batch = match &batch {
        Some(b) => relative(
            antagonists::finish(lab, b, Duration::from_secs(30))?,
            baseline,
        ),
        None => vec![],
    };
    for r in &running {
        lab.stop_group_and_remove(&r.group)?;
    }
    lab.stop_group_and_remove(antagonists::GROUP)?;
    lab.stop_group_and_remove("ctl")?;
    let result = RunResult {
        kind,
        scenario: scenario.map(|s| s.name().to_string()),
        policy: if explore { "explore" } else { policy.name() }.into(),
        dir,
        services,
        batch,
        cohabit,
        round: ctx.round,
    };
    let line = one_line(&result);
    progress(ctx, &line);
    Ok(result)
}

/// Starts every service and preloads its keys.
fn start_services(
    ctx: &Ctx<'_>,
    lab: &mut Lab,
    dir: &Path,
) -> Result<Vec<services::Running>, Error> {
    let mut running = Vec::new();
    for (k, program) in &ctx.programs {
        let r = services::start(lab, *k, program, &dir.join(k.name()))?;
        let s = setup(ctx.opts, *k);
        crate::client::preload(&spec(s, &r, 0)).map_err(|e| Error::Start {
            what: k.name().into(),
            detail: format!("preloading its keys: {e}"),
        })?;
        running.push(r);
    }
    Ok(running)
}

/// Starts the batch job and checks its workers have the names cohabit will look for.
fn start_batch(
    ctx: &Ctx<'_>,
    lab: &mut Lab,
    dir: &Path,
    scenario: Scenario,
    expected: &[String],
    duration_s: u32,
) -> Result<antagonists::Batch, Error> {
    let seconds = ctx.opts.warmup_s + duration_s + 1;
    let b = antagonists::start(lab, scenario, &ctx.stress_ng, dir, ctx.cpus.len(), seconds)?;
    let names = antagonists::worker_names(lab, &b)?;
    if !names.iter().any(|n| expected.contains(n)) {
        return Err(Error::Start {
            what: "stress-ng".into(),
            detail: format!(
                "its workers are named {names:?}, not {expected:?} as cohabit's configuration expects"
            ),
        });
    }
    Ok(b)
}

/// Runs the clients for the warm-up and the measured seconds, watching the daemon, and
/// sums up what they measured.
fn measure(
    ctx: &Ctx<'_>,
    lab: &mut Lab,
    running: &[services::Running],
    daemon: Option<&Daemon>,
    policy: Policy,
    duration_s: u32,
) -> Result<Vec<ServiceResult>, Error> {
    let seconds = ctx.opts.warmup_s + duration_s;
    let t0 = Instant::now();
    let mut loads = Vec::new();
    for (i, r) in running.iter().enumerate() {
        let s = setup(ctx.opts, r.kind);
        let load = Load::start(&spec(s, r, i as u64), t0, seconds).map_err(|e| Error::Start {
            what: format!("the client of {}", r.kind.name()),
            detail: e,
        })?;
        loads.push((r.kind, load));
    }
    let end = t0 + Duration::from_secs(u64::from(seconds));
    while Instant::now() < end {
        crate::interrupt::sleep(Duration::from_millis(200).min(end - Instant::now()))?;
        if let Some(d) = daemon {
            if !lab.get(d.proc).running() {
                return Err(Error::Cohabit {
                    policy: policy.name().into(),
                    detail: format!(
                        "the daemon stopped during the run; its output ends with:\n{}",
                        lab.get(d.proc).log_tail(15)
                    ),
                });
            }
        }
    }
    let warmup = ctx.opts.warmup_s as usize;
    let mut out = Vec::new();
    for (k, load) in loads {
        let (measured, total) = load.finish(warmup);
        let s = setup(ctx.opts, k);
        out.push(ServiceResult {
            service: k.name().into(),
            p99_target_ms: s.p99_target_ms,
            rate_rps: s.rate_rps,
            warmup_windows: warmup,
            summary: summarize(&measured.windows, warmup, s.p99_target_ms, &total),
            windows: measured.windows,
        });
    }
    crate::interrupt::check()?;
    Ok(out)
}

/// Each stressor's throughput against the same stressor alone.
fn relative(measured: Vec<Throughput>, baseline: &[Throughput]) -> Vec<BatchResult> {
    measured
        .into_iter()
        .map(|t| {
            let alone = baseline
                .iter()
                .find(|a| a.stressor == t.stressor)
                .map(|a| a.ops_per_s);
            BatchResult {
                relative: alone.filter(|a| *a > 0.0).map(|a| t.ops_per_s / a),
                alone_ops_per_s: alone,
                throughput: t,
            }
        })
        .collect()
}

fn one_line(r: &RunResult) -> String {
    let mut parts: Vec<String> = r
        .services
        .iter()
        .map(|s| {
            format!(
                "{} met {}/{} (window p99 median {:.2} ms)",
                s.service, s.summary.met, s.summary.windows, s.summary.window_p99.p50_ms
            )
        })
        .collect();
    for b in &r.batch {
        parts.push(match b.relative {
            Some(x) => format!("{} at {:.2} of alone", b.throughput.stressor, x),
            None => format!(
                "{} {:.0} bogo-ops/s",
                b.throughput.stressor, b.throughput.ops_per_s
            ),
        });
    }
    if let Some(c) = &r.cohabit {
        parts.push(format!(
            "cohabit: {} decisions, {} CPU s, {}",
            c.decisions,
            c.cpu_s.map_or("?".into(), |s| format!("{s:.1}")),
            if c.restored {
                "host restored"
            } else {
                "host NOT restored"
            }
        ));
    }
    format!("  {}", parts.join("; "))
}

fn spec(s: &ServiceSetup, r: &services::Running, seed: u64) -> LoadSpec {
    LoadSpec {
        proto: r.kind.proto(),
        addr: r.addr,
        rate_rps: s.rate_rps,
        conns: s.conns,
        keys: 10_000,
        value_bytes: 100,
        set_every: 10,
        seed: 0x5EED_0000 + seed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_setups_parse_with_defaults() {
        let s: ServiceSetup = "memcached".parse().unwrap();
        assert_eq!(s, ServiceSetup::default_for(Kind::Memcached));
        let s: ServiceSetup = "nginx:800:3.5".parse().unwrap();
        assert_eq!((s.rate_rps, s.p99_target_ms), (800.0, 3.5));
        assert!("nginx:0".parse::<ServiceSetup>().is_err());
        assert!("nginx:10:-1".parse::<ServiceSetup>().is_err());
        assert!("nginx:10:1:2".parse::<ServiceSetup>().is_err());
        assert!("apache".parse::<ServiceSetup>().is_err());
    }

    #[test]
    fn options_are_checked() {
        let mut o = Options::quick("/tmp/x".into());
        assert!(o.validate().is_ok());
        o.services.push(ServiceSetup::default_for(Kind::Memcached));
        assert!(o
            .validate()
            .unwrap_err()
            .to_string()
            .contains("at most once"));
        let mut o = Options::quick("/tmp/x".into());
        o.duration_s = 0;
        assert!(o.validate().is_err());
        let mut o = Options::quick("/tmp/x".into());
        o.policies.push(Policy::MlHost);
        assert!(o.validate().is_ok());
        o.explore_s = 1;
        assert!(o
            .validate()
            .unwrap_err()
            .to_string()
            .contains("explore run"));
        let mut o = Options::quick("/tmp/x".into());
        o.rounds = 0;
        assert!(o.validate().unwrap_err().to_string().contains("rounds"));
        o.rounds = 3;
        assert!(o.validate().is_ok());
    }

    #[test]
    fn idle_runs_in_full_after_cap_but_not_in_quick() {
        let full = Options::full("/tmp/x".into()).policies;
        let cap = full.iter().position(|p| *p == Policy::Cap).unwrap();
        assert_eq!(full.get(cap + 1), Some(&Policy::Idle));
        let quick = Options::quick("/tmp/x".into());
        assert_eq!(quick.policies, vec![Policy::None, Policy::Parties]);
        assert_eq!(quick.best_effort_cpus, None);
    }

    #[test]
    fn runs_are_labelled() {
        assert_eq!(
            label(RunKind::Colocated, Some(Scenario::Cpu), Policy::Parties),
            "cpu-parties"
        );
        assert_eq!(
            label(RunKind::BatchAlone, Some(Scenario::Cache), Policy::None),
            "cache-batch-alone"
        );
        assert_eq!(
            label(RunKind::ServicesAlone, None, Policy::None),
            "services-alone"
        );
        assert_eq!(label(RunKind::Colocated, None, Policy::Ml), "ml", "--alone");
        assert_eq!(
            label(RunKind::Explore, Some(Scenario::Cpu), Policy::Ml),
            "cpu-explore"
        );
    }
}
