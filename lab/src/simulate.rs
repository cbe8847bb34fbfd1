//! Running policies on simulated scenarios and comparing them.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use cohabit_core::DecisionRecord;
use cohabit_models::Model;
use cohabit_sim::{Scenario, SimError, SimulatedHost, TruthModel};

use cohabit_policy::control::{self, LoopError};
use cohabit_policy::{BuildError, HostContext, MlConfig, MlPolicy, Policy, PolicyKind};

use crate::metrics::{self, RunSummary};
use crate::oracle::{OracleConfig, OraclePolicy};

/// The policies the lab can run: every [`PolicyKind`], and the oracle, which needs the
/// simulator's ground truth.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LabPolicy {
    /// Fair share, never changed.
    Static,
    /// The PARTIES feedback controller.
    Parties,
    /// CLITE's Bayesian optimisation, sampled on the (simulated) host.
    Clite,
    /// Model-predictive allocation with the platform's built-in model.
    Ml,
    /// Ground-truth search (simulator only).
    Oracle,
}

impl LabPolicy {
    /// Every policy, in the order comparisons print them.
    pub const ALL: [LabPolicy; 5] = [
        LabPolicy::Static,
        LabPolicy::Parties,
        LabPolicy::Clite,
        LabPolicy::Ml,
        LabPolicy::Oracle,
    ];

    /// The policy's name.
    pub fn name(self) -> &'static str {
        match self.deployable() {
            Some(k) => k.name(),
            None => "oracle",
        }
    }

    /// The policy a real host can run, or `None` for the oracle.
    pub fn deployable(self) -> Option<PolicyKind> {
        match self {
            LabPolicy::Static => Some(PolicyKind::Static),
            LabPolicy::Parties => Some(PolicyKind::Parties),
            LabPolicy::Clite => Some(PolicyKind::Clite),
            LabPolicy::Ml => Some(PolicyKind::Ml),
            LabPolicy::Oracle => None,
        }
    }
}

impl From<PolicyKind> for LabPolicy {
    fn from(k: PolicyKind) -> Self {
        match k {
            PolicyKind::Static => LabPolicy::Static,
            PolicyKind::Parties => LabPolicy::Parties,
            PolicyKind::Clite => LabPolicy::Clite,
            PolicyKind::Ml => LabPolicy::Ml,
        }
    }
}

impl fmt::Display for LabPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for LabPolicy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        LabPolicy::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = LabPolicy::ALL.iter().map(|p| p.name()).collect();
                format!("unknown policy {s:?}; choose from {}", names.join(", "))
            })
    }
}

/// How a policy is run beyond its kind: safe exploration around its plans, and `ml`'s
/// tunables (`cohabit simulate --explore`, `--ml`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PolicyOptions {
    /// Explore safely around the policy's plans ([`cohabit_policy::Explore`]).
    pub explore: Option<cohabit_policy::ExploreConfig>,
    /// `ml`'s tunables (the other policies ignore them).
    pub ml: MlConfig,
}

/// Builds a policy for a scenario. `ml` uses `model`, or else the built-in model of the
/// scenario's platform, and on a platform with a GPU the built-in GPU model for the GPU
/// services' shares ([`cohabit_models::builtin_gpu`]).
pub fn build_policy(
    kind: LabPolicy,
    scenario: &Arc<Scenario>,
    model: Option<&Arc<Model>>,
) -> Result<Box<dyn Policy>, RunError> {
    build_policy_with(kind, scenario, model, MlConfig::default())
}

/// [`build_policy`], `ml` with the tunables `ml`.
pub fn build_policy_with(
    kind: LabPolicy,
    scenario: &Arc<Scenario>,
    model: Option<&Arc<Model>>,
    ml: MlConfig,
) -> Result<Box<dyn Policy>, RunError> {
    let ctx = HostContext {
        host: scenario.capacity().clone(),
        specs: scenario.specs(),
    };
    let Some(deployable) = kind.deployable() else {
        return Ok(Box::new(OraclePolicy::new(TruthModel::new(Arc::clone(
            scenario,
        )))));
    };
    let model = match (deployable, model) {
        (PolicyKind::Ml, Some(m)) => Some(Arc::clone(m)),
        (PolicyKind::Ml, None) => Some(Arc::new(builtin_model(scenario.host.preset)?)),
        _ => None,
    };
    if let (PolicyKind::Ml, Some(cpu)) = (deployable, &model) {
        return Ok(Box::new(build_ml_with(scenario, Arc::clone(cpu), ml)?));
    }
    Ok(deployable.build(ctx, model)?)
}

/// The `ml` policy for a scenario with the CPU model `cpu`, and on a platform with a GPU the
/// built-in GPU model for the GPU services' shares.
pub fn build_ml(scenario: &Arc<Scenario>, cpu: Arc<Model>) -> Result<MlPolicy, RunError> {
    build_ml_with(scenario, cpu, MlConfig::default())
}

/// [`build_ml`] with the tunables `cfg` instead of the defaults (the lab's examples compare
/// settings).
pub fn build_ml_with(
    scenario: &Arc<Scenario>,
    cpu: Arc<Model>,
    cfg: MlConfig,
) -> Result<MlPolicy, RunError> {
    let ctx = HostContext {
        host: scenario.capacity().clone(),
        specs: scenario.specs(),
    };
    let gpu = cohabit_models::builtin_gpu(scenario.host.preset)
        .transpose()?
        .map(Arc::new);
    Ok(PolicyKind::build_ml(ctx, Some(cpu), gpu, cfg)?)
}

/// The built-in model of a platform preset.
pub fn builtin_model(preset: &str) -> Result<Model, RunError> {
    cohabit_models::builtin(preset)
        .ok_or_else(|| RunError::NoModel(preset.to_string()))?
        .map_err(RunError::Model)
}

/// Why a simulated run failed.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The policy's initial plan did not fit the host, or the scenario was bad.
    #[error(transparent)]
    Sim(#[from] SimError),
    /// The loop stopped.
    #[error(transparent)]
    Loop(#[from] LoopError),
    /// `ml` was asked for on a platform without a built-in model and none was given.
    #[error("no built-in model for platform {0:?} (built in: {list}); pass --model", list = cohabit_models::builtin_platforms().collect::<Vec<_>>().join(", "))]
    NoModel(String),
    /// The model could not be loaded.
    #[error(transparent)]
    Model(#[from] cohabit_models::ModelError),
    /// The policy could not be built (no model, or a GPU model of another schema).
    #[error(transparent)]
    Build(#[from] BuildError),
}

/// One simulated run: every record and its summary.
#[derive(Debug, Clone)]
pub struct SimRun {
    /// The decision log.
    pub records: Vec<DecisionRecord>,
    /// Its metrics (without the oracle ratio).
    pub summary: RunSummary,
}

/// Runs the oracle searching as `cfg` says on `scenario`, named `name` in the summary (the
/// lab's examples compare its variants).
pub fn run_oracle(
    scenario: &Arc<Scenario>,
    cfg: OracleConfig,
    name: &str,
) -> Result<SimRun, RunError> {
    let policy = Box::new(OraclePolicy::with_config(
        TruthModel::new(Arc::clone(scenario)),
        cfg,
    ));
    run_built(scenario, policy, name, None, |_| Ok(()))
}

/// `ml`'s world with exact readings: `scenario` with the p99 and the counters quiet, and its
/// platform's built-in model with the calibrated spread off, so that a prediction anchored
/// on a reading is the model's mean (`ml`'s ceiling, which the lab's examples compare with).
pub fn exact_readings(scenario: &Scenario) -> Result<(Arc<Scenario>, Arc<Model>), RunError> {
    let mut world = scenario.clone();
    world.noise.quiet_p99();
    world.noise.quiet_counters();
    let mut model = builtin_model(scenario.host.preset)?;
    model.meta.change_sigma_scale = Some(0.0);
    Ok((Arc::new(world), Arc::new(model)))
}

/// The CPU platforms the lab's examples compare on: the Xeon E5-2697 v4 (CAT, no MBA) and
/// the Xeon Gold 6338 (CAT and MBA).
pub const LAB_PLATFORMS: [&str; 2] = ["xeon-e5-2697v4", "xeon-gold-6338"];

/// The scenario `name` on each of [`LAB_PLATFORMS`] whatever its own (a scenario built
/// around MBA, `mba-stream`, also runs where there is none), or `None` for a scenario with
/// GPU services (these platforms have no GPU).
pub fn on_lab_platforms(name: &str) -> Result<Option<Vec<Arc<Scenario>>>, RunError> {
    let own = Scenario::load(name)?;
    if own.services.iter().any(|s| s.spec.gpu.is_some()) {
        return Ok(None);
    }
    let on = LAB_PLATFORMS
        .iter()
        .map(|p| Ok(Arc::new(own.on_platform(p)?)))
        .collect::<Result<Vec<_>, RunError>>()?;
    Ok(Some(on))
}

/// [`on_lab_platforms`] for the lab's examples, which print a table: a GPU scenario prints
/// a line saying it is skipped and gives no platforms.
pub fn on_lab_platforms_or_skip(name: &str) -> Result<Vec<Arc<Scenario>>, RunError> {
    Ok(on_lab_platforms(name)?.unwrap_or_else(|| {
        println!("{name:<13} skipped: GPU scenario (the lab's CPU platforms have no GPU)");
        Vec::new()
    }))
}

/// Seeds `0, 101, 202, …`: as many as the environment variable `var` says (a positive
/// whole number), else `default`. The lab's examples that count runs meeting QoS take more
/// seeds this way: such a count moves by a few runs with any change, and a few seeds cannot
/// tell that from the seeds' own spread.
pub fn seeds_from_env(var: &str, default: u64) -> Vec<u64> {
    let n = std::env::var(var)
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|n| *n > 0)
        .unwrap_or(default);
    (0..n).map(|k| k * 101).collect()
}

/// The scenarios named on a command line, or every built-in (uncrowded) one when none is.
pub fn names_or_builtin(asked: Vec<String>) -> Vec<String> {
    if asked.is_empty() {
        cohabit_sim::scenario::builtin_names()
            .map(String::from)
            .collect()
    } else {
        asked
    }
}

/// Runs `kind` on `scenario`; `seed` overrides the scenario's; `model` replaces the
/// platform's built-in model for `ml`. `sink` sees every record as it is made (e.g. to
/// stream `decisions.jsonl`).
pub fn run_policy(
    scenario: &Arc<Scenario>,
    kind: LabPolicy,
    seed: Option<u64>,
    model: Option<&Arc<Model>>,
    sink: impl FnMut(&DecisionRecord) -> std::io::Result<()>,
) -> Result<SimRun, RunError> {
    run_policy_with(scenario, kind, seed, model, &PolicyOptions::default(), sink)
}

/// [`run_policy`] with `options`: exploring around the policy's plans when asked
/// ([`cohabit_policy::Explore`]), `ml` with the tunables given.
pub fn run_policy_with(
    scenario: &Arc<Scenario>,
    kind: LabPolicy,
    seed: Option<u64>,
    model: Option<&Arc<Model>>,
    options: &PolicyOptions,
    sink: impl FnMut(&DecisionRecord) -> std::io::Result<()>,
) -> Result<SimRun, RunError> {
    let mut policy = build_policy_with(kind, scenario, model, options.ml)?;
    if let Some(cfg) = &options.explore {
        let ctx = HostContext {
            host: scenario.capacity().clone(),
            specs: scenario.specs(),
        };
        policy = Box::new(cohabit_policy::Explore::new(policy, ctx, cfg.clone()));
    }
    run_built(scenario, policy, kind.name(), seed, sink)
}

/// Runs a policy already built (e.g. an oracle with a restricted search) on `scenario`,
/// summarised under the name `name`; `seed` overrides the scenario's.
pub fn run_built(
    scenario: &Arc<Scenario>,
    mut policy: Box<dyn Policy>,
    name: &str,
    seed: Option<u64>,
    mut sink: impl FnMut(&DecisionRecord) -> std::io::Result<()>,
) -> Result<SimRun, RunError> {
    let initial = policy.initial();
    let mut host = SimulatedHost::launch(Arc::clone(scenario), &initial.plan, seed)?;
    let mut records = Vec::with_capacity(usize::try_from(scenario.ticks()).unwrap_or(0));
    control::run(&mut host, policy.as_mut(), scenario.ticks(), |r| {
        sink(&r)?;
        records.push(r);
        Ok(())
    })?;
    let seed = seed.unwrap_or(scenario.seed);
    let targets: BTreeMap<String, f64> = scenario
        .services
        .iter()
        .filter_map(|s| s.spec.p99_target_ms().map(|t| (s.spec.name.clone(), t)))
        .collect();
    let summary = metrics::summarize(&scenario.name, name, seed, &targets, &records);
    Ok(SimRun { records, summary })
}

/// Runs every policy in `kinds` on the same scenario and seed, one thread each, keeping
/// every run's decision log, and fills in `be_throughput_vs_oracle` (running the oracle as
/// a reference if it was not asked for).
pub fn compare(
    scenario: &Arc<Scenario>,
    kinds: &[LabPolicy],
    seed: Option<u64>,
    model: Option<&Arc<Model>>,
) -> Result<Vec<SimRun>, RunError> {
    compare_with(scenario, kinds, seed, model, &PolicyOptions::default())
}

/// [`compare`] with `options` for every policy compared (the oracle runs as it is: it is
/// the reference).
pub fn compare_with(
    scenario: &Arc<Scenario>,
    kinds: &[LabPolicy],
    seed: Option<u64>,
    model: Option<&Arc<Model>>,
    options: &PolicyOptions,
) -> Result<Vec<SimRun>, RunError> {
    let mut wanted: Vec<LabPolicy> = kinds.to_vec();
    if !wanted.contains(&LabPolicy::Oracle) {
        wanted.push(LabPolicy::Oracle);
    }
    let results: Vec<Result<SimRun, RunError>> = std::thread::scope(|s| {
        let handles: Vec<_> = wanted
            .iter()
            .map(|&k| {
                s.spawn(move || {
                    let options = if k == LabPolicy::Oracle {
                        &PolicyOptions::default()
                    } else {
                        options
                    };
                    run_policy_with(scenario, k, seed, model, options, |_| Ok(()))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    let mut runs = results.into_iter().collect::<Result<Vec<_>, _>>()?;
    let oracle_be = runs
        .iter()
        .find(|r| r.summary.policy == LabPolicy::Oracle.name())
        .map(|r| r.summary.be_throughput);
    for r in &mut runs {
        r.summary.be_throughput_vs_oracle =
            oracle_be.and_then(|o| metrics::be_vs_oracle(r.summary.be_throughput, o));
    }
    runs.retain(|r| kinds.iter().any(|k| k.name() == r.summary.policy));
    Ok(runs)
}
