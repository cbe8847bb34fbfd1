//! The lab's subcommands of `cohabit`: `scenarios`, `simulate`, `compare`, `plot` and
//! `report`. The command line parses arguments and calls these.

use std::io::Write;
use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use cohabit_core::LogHeader;
use cohabit_sim::catalogue::{self, Platform};
use cohabit_sim::scenario::{builtin_names, crowded_names};
use cohabit_sim::Scenario;

use crate::metrics::{self, search_time_table, service_table, table};
use crate::report::plot::{self, PlotFormat};
use crate::rundir::{self, RunDir, SingleRunWriter};
use crate::simulate::{self, LabPolicy};
use crate::{Format, BANNER};

/// Where a simulation runs and which model `ml` uses.
#[derive(Debug, Clone, Default)]
pub struct SimOptions {
    /// Run on another built-in platform instead of the scenario's.
    pub platform: Option<String>,
    /// Model for `ml` instead of the platform's built-in one.
    pub model: Option<std::path::PathBuf>,
    /// Explore safely around the policy's plans (`simulate --explore`).
    pub explore: Option<cohabit_policy::ExploreConfig>,
    /// `ml`'s tunables (`--ml KEY=VALUE`; `None`: none given, the defaults).
    pub ml: Option<cohabit_policy::MlConfig>,
}

impl SimOptions {
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

    /// How the policies run: exploration and `ml`'s tunables as asked. Tunables given for
    /// a run without `ml` are refused (they would change nothing, silently), as the
    /// daemon refuses an `ml` table beside another policy.
    fn policy_options(&self, policies: &[LabPolicy]) -> Result<simulate::PolicyOptions> {
        if self.ml.is_some() && !policies.contains(&LabPolicy::Ml) {
            bail!("--ml sets ml's tunables, but ml is not among the policies run");
        }
        Ok(simulate::PolicyOptions {
            explore: self.explore.clone(),
            ml: self.ml.unwrap_or_default(),
        })
    }

    /// The decision log's header for a run of `policy` on `scenario`, with the tunables
    /// moved for it ([`cohabit_policy::PolicyKind::moved_tunables`]; the oracle has none).
    fn header(&self, policy: LabPolicy, scenario: &Scenario) -> LogHeader {
        let moved = match (policy.deployable(), &self.ml) {
            (Some(kind), Some(ml)) => kind.moved_tunables(ml),
            _ => Vec::new(),
        };
        LogHeader::new(policy.name(), true, scenario.capacity().clone()).with_tunables(moved)
    }

    /// A line saying which of `ml`'s tunables were moved from the defaults, if any.
    fn ml_line(&self, out: &mut dyn Write) -> Result<()> {
        let moved = self.ml.map(|m| m.moved_from_default()).unwrap_or_default();
        if !moved.is_empty() {
            writeln!(
                out,
                "ml tunables moved from the defaults: {}",
                moved.join(", ")
            )?;
        }
        Ok(())
    }
}

fn load(name: &str) -> Result<Arc<Scenario>> {
    Ok(Arc::new(Scenario::load(name)?))
}

/// `cohabit scenarios`.
pub fn scenarios_cmd(models: bool, format: Format, out: &mut dyn Write) -> Result<()> {
    let list: Vec<Arc<Scenario>> = builtin_names()
        .chain(crowded_names())
        .map(load)
        .collect::<Result<_>>()?;
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

/// `cohabit simulate`.
pub fn simulate_cmd(
    name: &str,
    policy: LabPolicy,
    dir: &Path,
    seed: Option<u64>,
    sim: &SimOptions,
    out: &mut dyn Write,
) -> Result<()> {
    let options = sim.policy_options(&[policy])?;
    let scenario = sim.scenario(name)?;
    let model = sim.model()?;
    let header = sim.header(policy, &scenario);
    let mut writer = SingleRunWriter::create(dir, &header)?;
    let run = simulate::run_policy_with(&scenario, policy, seed, model.as_ref(), &options, |r| {
        writer.record(r)
    })
    .with_context(|| format!("simulating {} with {policy}", scenario.name))?;
    let explored = run
        .records
        .iter()
        .filter(|r| {
            r.reasons
                .values()
                .any(|w| w.path == cohabit_core::DecisionPath::Explore)
        })
        .count();
    let mut summary = run.summary;
    summary.be_throughput_vs_oracle = if policy == LabPolicy::Oracle {
        Some(1.0)
    } else {
        let oracle = simulate::run_policy(&scenario, LabPolicy::Oracle, seed, None, |_| Ok(()))?;
        metrics::be_vs_oracle(summary.be_throughput, oracle.summary.be_throughput)
    };
    let (log_path, summary_path, n_records) = writer.finish(&summary)?;
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
    sim.ml_line(out)?;
    if sim.explore.is_some() {
        writeln!(
            out,
            "explored {explored} of {} ticks (decision path `explore` in the log)",
            run.records.len()
        )?;
    }
    writeln!(
        out,
        "wrote {} ({} records) and {}",
        log_path.display(),
        n_records,
        summary_path.display()
    )?;
    Ok(())
}

/// `cohabit compare`.
pub fn compare_cmd(
    name: &str,
    policies: &[LabPolicy],
    seed: Option<u64>,
    format: Format,
    dir: Option<&Path>,
    sim: &SimOptions,
    out: &mut dyn Write,
) -> Result<()> {
    let model = sim.model()?;
    if policies.is_empty() {
        bail!("--policies needs at least one policy");
    }
    let options = sim.policy_options(policies)?;
    let names: Vec<String> = if name == "all" {
        builtin_names()
            .chain(crowded_names())
            .map(str::to_string)
            .collect()
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
        let runs = simulate::compare_with(&scenario, policies, seed, model.as_ref(), &options)
            .with_context(|| format!("comparing policies on {n}"))?;
        if let Some(dir) = dir {
            for r in &runs {
                let policy: LabPolicy = r.summary.policy.parse().map_err(anyhow::Error::msg)?;
                let header = sim.header(policy, &scenario);
                rundir::write_comparison_run(dir, &r.summary, &header, &r.records)?;
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
        rundir::write_comparison_summary(dir, &all)?;
    }
    match format {
        Format::Json => writeln!(out, "{}", serde_json::to_string_pretty(&all)?)?,
        Format::Table => {
            if names.len() > 1 {
                writeln!(out, "{BANNER}")?;
            }
            write!(out, "{}", table(&all, names.len() > 1))?;
            sim.ml_line(out)?;
            writeln!(out, "qos_met: share of intervals with every LC service under target (ground truth); conv: intervals to settle after a load change; be_vs_oracle: best-effort throughput over the oracle's; be_mba: mean MBA % of the best-effort pool; mba<100: share of intervals with some group throttled.")?;
            writeln!(out, "\nper-service QoS (share of intervals under target):")?;
            write!(out, "{}", service_table(&all, names.len() > 1))?;
            if all.iter().any(|r| r.policy == "oracle") {
                writeln!(out, "\noracle search time:")?;
                write!(out, "{}", search_time_table(&all))?;
            }
        }
    }
    if let Some(dir) = dir {
        // A status line, not part of the report: stdout holds only the document (with
        // `--format json`, one JSON value a program parses).
        eprintln!("wrote the runs and summary.json under {}", dir.display());
    }
    Ok(())
}

/// `cohabit plot`: draws the plots of a run or comparison directory into `dest`.
pub fn plot_cmd(
    run_dir: &Path,
    dest: &Path,
    format: PlotFormat,
    out: &mut dyn Write,
) -> Result<()> {
    let files = match rundir::load(run_dir)? {
        RunDir::Single(run) => plot::plot_run(&run, dest, format)?,
        RunDir::Comparison(runs) => plot::plot_comparison(&runs, dest, format)?,
    };
    for f in files {
        writeln!(out, "wrote {}", f.display())?;
    }
    Ok(())
}

/// `cohabit report`: one self-contained HTML page for a run or comparison directory.
pub fn report_cmd(run_dir: &Path, dest: Option<&Path>, out: &mut dyn Write) -> Result<()> {
    let page = crate::report::html::write_report(run_dir, dest)?;
    writeln!(
        out,
        "wrote {} (self-contained; open it in a browser)",
        page.display()
    )?;
    Ok(())
}
