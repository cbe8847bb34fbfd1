//! Scenarios: a host, the services and jobs on it, their load, and how long to run.
//!
//! A scenario is a TOML file (every table is `deny_unknown_fields`; see
//! `simulator/scenarios/*.toml` for the built-in ones):
//!
//! ```toml
//! name = "demo"
//! description = "two latency-critical services and a streaming batch job"
//! duration_s = 600
//! tick_ms = 1000          # control interval; 100 ms works too
//! seed = 7                # noise and glitches; same seed, same run
//!
//! [host]
//! preset = "xeon-e5-2697v4"   # see `cohabit scenarios --platforms`; fields below override
//! # cores = 36, freq_ghz = 2.3, llc_ways = 20, llc_mb = 45, mem_bw_gbps = 76.8, mem_latency_ns = 90
//! # closids = 16             # resctrl CLOSIDs, the default group's included
//! # counters = false          # no hardware performance counters (most VMs): no IPC, no LLC misses
//! # rdt_monitoring = false    # no RDT monitoring (CMT/MBM): no LLC occupancy, no memory bandwidth
//! # rdt_allocation = false    # no CAT or MBA (no resctrl, most VMs): the LLC is one way every
//! #                           # group shares whole, memory bandwidth is never throttled
//! # gpu_share_change = "live" # MPS shares reach running clients (v3); default "restart"
//!
//! [[service]]                 # latency-critical
//! name = "memcached"
//! model = "memcached"         # from the catalogue
//! load = { kind = "steps", steps = [{ at_s = 0, fraction = 0.2 }, { at_s = 300, fraction = 0.3 }] }
//! # p99_target_ms = 0.6       # overrides the catalogue's target
//! # gpu = 0                   # GPU index, for GPU services
//! # physics = { wss_mb = 40, m_inf = 0.2 }  # changes to the catalogue row (below)
//!
//! [[best_effort]]
//! name = "stream"
//! model = "stream"
//! # physics = { apki = 90 }
//!
//! [[catalogue]]               # a service of the scenario's own, `model = "kv"`
//! name = "kv"
//! kind = "service"            # service, gpu-service, best-effort, gpu-best-effort
//! about = "our key-value store"
//! physics = { target_ms = 2, max_load = 50000, cv = 1.2, ipc = 0.9, llc_mpki = 3,
//!             wss_mb = 50, m_inf = 0.1, steepness = 2.5, icache_mpki = 10, sys_share = 0.4 }
//! ```
//!
//! `physics` names parameters of the model's catalogue row ([`crate::params::Param`], the
//! ones its [`RowKind`] has); a `[[catalogue]]` row gives every one of its kind. Each is
//! range-checked ([`Param::range`]) and an unknown or misplaced name is refused, with its
//! line. The model is then rebuilt and recalibrated from the row, so a service's load
//! fractions are of its changed knee, and `target_ms` is the row's knee target (the
//! controller's target unless `p99_target_ms` says otherwise).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use cohabit_core::{HostCapacity, Sample, ServiceClass, ServiceSpec, BEST_EFFORT_GROUP};
use serde::Deserialize;
use toml::Spanned;

use crate::catalogue::{self, Platform, ServiceModel, SimHost};
use crate::params::{Param, Physics, PhysicsError, RowKind};
use crate::trace::LoadTrace;
use crate::SimError;

/// A validated scenario, ready to simulate.
#[derive(Debug, Clone)]
pub struct Scenario {
    /// Scenario name.
    pub name: String,
    /// One line on what it exercises.
    pub description: String,
    /// Simulated time.
    pub duration_s: f64,
    /// Control interval.
    pub tick_ms: u64,
    /// Seed of the noise.
    pub seed: u64,
    /// The simulated platform.
    pub host: SimHost,
    /// The `[host]` section it was built from (a scenario made in code: the default, a
    /// preset with no changes). [`Scenario::on_platform`] rebuilds the host from it, so an
    /// edit made to `host` in code does not move to another platform.
    pub host_section: HostSection,
    /// Latency-critical services first, then best-effort jobs, in file order.
    pub services: Vec<SimService>,
    /// Measurement dirt.
    pub noise: Noise,
    /// What the host can measure at all.
    pub telemetry: Telemetry,
}

/// What a host can measure besides latency, load and CPU time: a kind of host, not noise.
/// A VM usually has neither hardware counters nor RDT monitoring; a host with CAT may lack
/// CMT/MBM. Readings the host cannot take are absent (`None`) in every sample; allocation
/// (cores, CAT ways, MBA) works as before.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Telemetry {
    /// Hardware performance counters (perf): IPC and LLC misses.
    pub counters: bool,
    /// RDT monitoring (CMT and MBM): LLC occupancy and memory bandwidth.
    pub rdt_monitoring: bool,
}

impl Default for Telemetry {
    /// A bare-metal host with everything.
    fn default() -> Self {
        Self {
            counters: true,
            rdt_monitoring: true,
        }
    }
}

impl Telemetry {
    /// `sample` as this host reports it: what it cannot measure is absent.
    pub fn strip(&self, sample: Sample) -> Sample {
        let mut s = sample;
        if !self.counters {
            s.ipc = None;
            s.llc_misses_per_s = None;
        }
        if !self.rdt_monitoring {
            s.llc_occupancy_bytes = None;
            s.mem_bw_bytes_per_s = None;
        }
        s
    }
}

/// One service or job of a scenario.
#[derive(Debug, Clone)]
pub struct SimService {
    /// What the controller is told.
    pub spec: ServiceSpec,
    /// Its physics: a catalogue model, the scenario's own (`[[catalogue]]`), or either with
    /// the changes of its `physics = { … }`.
    pub model: Arc<ServiceModel>,
    /// Offered load (latency-critical only).
    pub load: Option<LoadTrace>,
}

/// How dirty measurements are (DESIGN.md 4: a few percent of lognormal noise, rare glitches,
/// missing readings).
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Noise {
    /// Lognormal sigma of counter readings (IPC, misses, bandwidth, occupancy, CPU, GPU).
    #[serde(default = "default_counter_sigma")]
    pub counter_sigma: f64,
    /// Lognormal sigma of the measured p99 with many samples; fewer samples add more.
    #[serde(default = "default_p99_sigma")]
    pub p99_sigma: f64,
    /// Probability that a counter reading is a glitch (absurd value).
    #[serde(default = "default_glitch")]
    pub glitch_prob: f64,
    /// Probability that a reading is missing.
    #[serde(default = "default_missing")]
    pub missing_prob: f64,
    /// Control intervals one measured p99 may span: the p99 is that of every request since
    /// what the service runs under or its load last changed ([`cohabit_core::window`]), up
    /// to this many intervals
    /// (1: each interval's own requests). The default, 3, is the daemon's: its collectors
    /// merge the histograms of the intervals the same way.
    #[serde(default = "default_latency_window")]
    pub latency_window: u32,
}

fn default_counter_sigma() -> f64 {
    0.03
}
fn default_p99_sigma() -> f64 {
    0.05
}
fn default_glitch() -> f64 {
    0.001
}
fn default_missing() -> f64 {
    0.005
}
fn default_latency_window() -> u32 {
    3
}

impl Default for Noise {
    fn default() -> Self {
        Self {
            counter_sigma: default_counter_sigma(),
            p99_sigma: default_p99_sigma(),
            glitch_prob: default_glitch(),
            missing_prob: default_missing(),
            latency_window: default_latency_window(),
        }
    }
}

impl Noise {
    /// The measured p99 without noise of its own (the latency window stays as it is).
    pub fn quiet_p99(&mut self) {
        self.p99_sigma = 0.0;
    }

    /// Counter readings exact: no noise, no glitches, no missing readings.
    pub fn quiet_counters(&mut self) {
        self.counter_sigma = 0.0;
        self.glitch_prob = 0.0;
        self.missing_prob = 0.0;
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ScenarioFile {
    name: String,
    #[serde(default)]
    description: String,
    duration_s: f64,
    #[serde(default = "default_tick")]
    tick_ms: i64,
    #[serde(default)]
    seed: u64,
    host: HostSection,
    #[serde(default)]
    service: Vec<ServiceFile>,
    #[serde(default)]
    best_effort: Vec<BestEffortFile>,
    #[serde(default)]
    catalogue: Vec<CatalogueFile>,
    #[serde(default)]
    noise: Noise,
}

fn default_tick() -> i64 {
    1000
}

/// A scenario's `[host]` section as written: a preset and what the scenario changes of it
/// (the CLOSID budget of `few-closids`, no RDT allocation on a VM, …). Kept with the
/// scenario so that [`Scenario::on_platform`] applies the same changes to another preset.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostSection {
    /// The platform preset (default `xeon-e5-2697v4`).
    #[serde(default)]
    pub preset: Option<String>,
    /// Cores instead of the preset's.
    pub cores: Option<i64>,
    /// Clock instead of the preset's.
    pub freq_ghz: Option<f64>,
    /// LLC ways instead of the preset's (the LLC's size kept).
    pub llc_ways: Option<i64>,
    /// LLC size in MiB instead of the preset's.
    pub llc_mb: Option<f64>,
    /// Peak memory bandwidth instead of the preset's.
    pub mem_bw_gbps: Option<f64>,
    /// Unloaded memory latency instead of the preset's.
    pub mem_latency_ns: Option<f64>,
    /// CLOSIDs instead of the preset's.
    pub closids: Option<i64>,
    /// Whether the host has hardware counters (default: yes).
    pub counters: Option<bool>,
    /// Whether the host has RDT monitoring (default: yes).
    pub rdt_monitoring: Option<bool>,
    /// Whether the host has RDT allocation (default: yes; without it one shared way, no
    /// MBA).
    pub rdt_allocation: Option<bool>,
    /// How a GPU share change takes effect, instead of the preset's.
    pub gpu_share_change: Option<cohabit_core::ShareChange>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ServiceFile {
    name: Spanned<String>,
    model: String,
    load: LoadTrace,
    p99_target_ms: Option<f64>,
    gpu: Option<i64>,
    /// Overload priority (`ServiceSpec::priority`): higher wins, default 0.
    #[serde(default)]
    priority: i32,
    /// Changes to the model's row.
    physics: Option<PhysicsFile>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct BestEffortFile {
    name: Spanned<String>,
    model: String,
    gpu: Option<i64>,
    /// Changes to the model's row.
    physics: Option<PhysicsFile>,
}

/// A row of the scenario's own catalogue: a service or job of its own, usable as
/// `model = "its name"`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CatalogueFile {
    name: Spanned<String>,
    kind: RowKind,
    #[serde(default)]
    about: String,
    /// Every parameter of the kind.
    physics: PhysicsFile,
}

/// A `physics = { … }` table as written: parameter names and values, with where each is.
type PhysicsFile = BTreeMap<Spanned<String>, Spanned<f64>>;

/// The scenarios built into the binary: (name, TOML text).
const BUILTIN: [(&str, &str); 6] = [
    ("demo", include_str!("../scenarios/demo.toml")),
    ("parties-mix", include_str!("../scenarios/parties-mix.toml")),
    (
        "gpu-inference",
        include_str!("../scenarios/gpu-inference.toml"),
    ),
    ("load-spike", include_str!("../scenarios/load-spike.toml")),
    ("few-closids", include_str!("../scenarios/few-closids.toml")),
    ("mba-stream", include_str!("../scenarios/mba-stream.toml")),
];

/// Built-in overload scenarios, where not every target can always be met (more services
/// than ways, an oversubscribed GPU): judged by per-service QoS and the overload order
/// (docs/DESIGN.md 5), not by the 99 % QoS target of [`builtin_names`].
const CROWDED: [(&str, &str); 3] = [
    (
        "crowded-gold",
        include_str!("../scenarios/crowded-gold.toml"),
    ),
    ("crowded-e5", include_str!("../scenarios/crowded-e5.toml")),
    (
        "gpu-llm-crowd",
        include_str!("../scenarios/gpu-llm-crowd.toml"),
    ),
];

/// Trace files the built-in scenarios replay: (file name, CSV text).
const BUILTIN_TRACES: [(&str, &str); 1] = [(
    "traces/azure-llm-conv-rps.csv",
    include_str!("../scenarios/traces/azure-llm-conv-rps.csv"),
)];

/// Names of the built-in scenarios.
pub fn builtin_names() -> impl Iterator<Item = &'static str> {
    BUILTIN.iter().map(|(n, _)| *n)
}

/// Names of the built-in overload (crowded) scenarios; [`Scenario::load`] knows them too.
pub fn crowded_names() -> impl Iterator<Item = &'static str> {
    CROWDED.iter().map(|(n, _)| *n)
}

impl Scenario {
    /// A built-in scenario by name, or a scenario file by path.
    pub fn load(name_or_path: &str) -> Result<Scenario, SimError> {
        if let Some((_, text)) = BUILTIN
            .iter()
            .chain(&CROWDED)
            .find(|(n, _)| *n == name_or_path)
        {
            return Self::parse(text, name_or_path, TraceSource::Builtin);
        }
        let path = Path::new(name_or_path);
        if !path.exists() {
            let names: Vec<&str> = builtin_names().chain(crowded_names()).collect();
            return Err(SimError::UnknownScenario {
                name: name_or_path.to_string(),
                builtin: names.join(", "),
            });
        }
        let text = std::fs::read_to_string(path).map_err(|e| SimError::Io {
            path: path.display().to_string(),
            what: "reading a scenario",
            source: e,
        })?;
        let dir = path.parent().unwrap_or(Path::new("."));
        Self::parse(&text, &path.display().to_string(), TraceSource::Dir(dir))
    }

    /// Parses and validates scenario TOML; `origin` names it in errors.
    pub fn from_toml(text: &str, origin: &str, base_dir: &Path) -> Result<Scenario, SimError> {
        Self::parse(text, origin, TraceSource::Dir(base_dir))
    }

    fn parse(text: &str, origin: &str, traces: TraceSource<'_>) -> Result<Scenario, SimError> {
        let file: ScenarioFile = toml::from_str(text).map_err(|e| SimError::Toml {
            origin: origin.to_string(),
            message: e.to_string(),
        })?;
        let scenario_err = |msg: String| SimError::Scenario(format!("{origin}: {msg}"));
        let host = host_from(&file.host).map_err(&scenario_err)?;
        host.capacity
            .validate()
            .map_err(|e| scenario_err(e.to_string()))?;
        if !(file.duration_s.is_finite() && file.duration_s > 0.0) {
            return Err(scenario_err(format!(
                "duration_s must be a positive number of seconds, got {}",
                file.duration_s
            )));
        }
        if !(10..=60_000).contains(&file.tick_ms) {
            return Err(scenario_err(format!(
                "tick_ms must be between 10 and 60000, got {}",
                file.tick_ms
            )));
        }
        if file.service.is_empty() {
            return Err(scenario_err(
                "needs at least one [[service]] (latency-critical)".into(),
            ));
        }
        let lines = Lines(text);
        let models = Models {
            own: own_catalogue(&file.catalogue, &lines).map_err(&scenario_err)?,
            lines,
        };
        let gpus = host.capacity.gpus.len();
        let mut services = Vec::new();
        for mut s in file.service {
            match traces {
                TraceSource::Builtin => {
                    if let LoadTrace::Replay { file, .. } = &s.load {
                        let text = BUILTIN_TRACES
                            .iter()
                            .find(|(n, _)| n == file)
                            .map(|(_, t)| *t)
                            .ok_or_else(|| scenario_err(format!("no built-in trace {file}")))?;
                        s.load.load_text(text)?;
                    }
                }
                TraceSource::Dir(dir) => s.load.load_file(dir)?,
            }
            s.load
                .validate(s.name.get_ref())
                .map_err(|e| scenario_err(e.to_string()))?;
            services.push(latency_critical(s, &models, gpus).map_err(&scenario_err)?);
        }
        for b in file.best_effort {
            services.push(best_effort(b, &models, gpus).map_err(&scenario_err)?);
        }
        check_names(&services).map_err(&scenario_err)?;
        check_noise(&file.noise).map_err(&scenario_err)?;
        Ok(Scenario {
            name: file.name,
            description: file.description,
            duration_s: file.duration_s,
            tick_ms: file.tick_ms.unsigned_abs(),
            seed: file.seed,
            host,
            host_section: file.host.clone(),
            services,
            noise: file.noise,
            telemetry: Telemetry {
                counters: file.host.counters.unwrap_or(true),
                rdt_monitoring: file.host.rdt_monitoring.unwrap_or(true),
            },
        })
    }

    /// Number of control intervals in the run.
    pub fn ticks(&self) -> u64 {
        crate::whole(self.duration_s * 1000.0 / self.tick_ms as f64)
    }

    /// What the controller is told about every service and job.
    pub fn specs(&self) -> Vec<ServiceSpec> {
        self.services.iter().map(|s| s.spec.clone()).collect()
    }

    /// The same scenario on another built-in platform: the same request rates (loads are
    /// fractions of knees calibrated on the reference platform) and the same changes to the
    /// preset its `[host]` section makes (`few-closids` keeps its 4 CLOSIDs). The section's
    /// values are absolute: a line that restates one preset's own value (`llc_ways = 20` on
    /// the E5) sets it on the other platform too. Refused when a service needs a GPU the
    /// platform lacks.
    pub fn on_platform(&self, preset: &str) -> Result<Scenario, SimError> {
        let section = HostSection {
            preset: Some(preset.to_string()),
            ..self.host_section.clone()
        };
        let host = host_from(&section)
            .map_err(|e| SimError::Scenario(format!("scenario {}: {e}", self.name)))?;
        if let Some(s) = self.services.iter().find(|s| {
            s.spec
                .gpu
                .is_some_and(|g| g as usize >= host.capacity.gpus.len())
        }) {
            return Err(SimError::Scenario(format!(
                "scenario {}: service {} needs a GPU and platform {preset} has none",
                self.name, s.spec.name
            )));
        }
        Ok(Scenario {
            host,
            host_section: section,
            ..self.clone()
        })
    }

    /// The host capacity the controller sees.
    pub fn capacity(&self) -> &HostCapacity {
        &self.host.capacity
    }

    /// Offered load of service `i` at `t_s` (0 for best-effort jobs).
    pub fn load_rps(&self, i: usize, t_s: f64) -> f64 {
        let s = &self.services[i];
        match (&s.load, s.model.latency) {
            (Some(trace), Some(lat)) => trace.at(t_s) * lat.knee_rps,
            _ => 0.0,
        }
    }
}

#[derive(Clone, Copy)]
enum TraceSource<'a> {
    Builtin,
    Dir(&'a Path),
}

/// Line numbers in a scenario's text, for errors about what TOML accepted and the scenario
/// refuses.
struct Lines<'a>(&'a str);

impl Lines<'_> {
    /// The line (from 1) where `item` starts.
    fn of<T>(&self, item: &Spanned<T>) -> usize {
        self.0
            .get(..item.span().start)
            .map_or(0, |before| before.matches('\n').count())
            + 1
    }
}

/// The models a scenario's services may name: its own `[[catalogue]]` rows, then the
/// built-in catalogue.
struct Models<'a> {
    own: Vec<Arc<ServiceModel>>,
    lines: Lines<'a>,
}

impl Models<'_> {
    /// The model `model` of `who` (`service kv`), changed as its `physics` table says.
    fn resolve(
        &self,
        who: &str,
        at: &Spanned<String>,
        model: &str,
        physics: Option<&PhysicsFile>,
    ) -> Result<Arc<ServiceModel>, String> {
        let base = self
            .own
            .iter()
            .find(|m| m.name == model)
            .or_else(|| catalogue::model(model))
            .ok_or_else(|| {
                let names: Vec<&str> = catalogue::catalogue()
                    .iter()
                    .chain(&self.own)
                    .map(|m| m.name.as_str())
                    .collect();
                format!(
                    "{who}: unknown model {model:?}; the catalogue has {}",
                    names.join(", ")
                )
            })?;
        let Some(table) = physics else {
            return Ok(Arc::clone(base));
        };
        let changes = physics_changes(table, base.kind(), who, &self.lines)?;
        base.with_changes(&changes)
            .map(Arc::new)
            .map_err(|e| format!("line {}: {who}: {e}", self.lines.of(at)))
    }
}

/// The changes a `physics = { … }` table makes to a row of `kind`: each key a parameter of
/// the kind, each value within the parameter's range; `who` names the service in errors.
fn physics_changes(
    table: &PhysicsFile,
    kind: RowKind,
    who: &str,
    lines: &Lines<'_>,
) -> Result<Vec<(Param, f64)>, String> {
    table
        .iter()
        .map(|(key, value)| {
            let refused = |e: PhysicsError| format!("line {}: {who}: physics.{e}", lines.of(key));
            let param = Param::by_name(key.get_ref())
                .filter(|p| kind.params().contains(p))
                .ok_or_else(|| {
                    refused(PhysicsError::Unknown {
                        key: key.get_ref().clone(),
                        kind,
                    })
                })?;
            let value = *value.get_ref();
            if !param.range().contains(value) {
                return Err(refused(PhysicsError::OutOfRange { param, value }));
            }
            Ok((param, value))
        })
        .collect()
}

/// The scenario's own `[[catalogue]]` rows, built and calibrated like the built-in ones.
fn own_catalogue(
    rows: &[CatalogueFile],
    lines: &Lines<'_>,
) -> Result<Vec<Arc<ServiceModel>>, String> {
    let mut out: Vec<Arc<ServiceModel>> = Vec::new();
    for row in rows {
        let name = row.name.get_ref();
        let line = lines.of(&row.name);
        let who = format!("catalogue row {name:?}");
        if name.trim().is_empty() {
            return Err(format!("line {line}: a [[catalogue]] row needs a name"));
        }
        if catalogue::model(name).is_some() {
            return Err(format!(
                "line {line}: {who}: the built-in catalogue has a model of that name; name yours \
                 otherwise, or change the built-in one with `physics = {{ … }}` where it is used"
            ));
        }
        if out.iter().any(|m| m.name == *name) {
            return Err(format!("line {line}: {who} is defined twice"));
        }
        let values = physics_changes(&row.physics, row.kind, &who, lines)?;
        let physics = Physics::new(row.kind, values)
            .map_err(|e| format!("line {line}: {who}: physics.{e}"))?;
        let about = if row.about.is_empty() {
            "the scenario's own service"
        } else {
            &row.about
        };
        let model = ServiceModel::build(
            name.clone(),
            about,
            "a scenario's [[catalogue]] row",
            physics,
        )
        .map_err(|e| format!("line {line}: {who}: {e}"))?;
        out.push(Arc::new(model));
    }
    Ok(out)
}

/// The GPU a service runs on: none for a CPU model, else `gpu` (default 0), which the host
/// must have.
fn check_gpu(
    name: &str,
    model: &ServiceModel,
    gpu: Option<i64>,
    gpus: usize,
) -> Result<Option<u32>, String> {
    match (model.gpu.is_some(), gpu) {
        (false, None) => Ok(None),
        (false, Some(_)) => Err(format!(
            "service {name}: model {} does not use a GPU, remove `gpu`",
            model.name
        )),
        (true, g) => {
            let g = g.unwrap_or(0);
            u32::try_from(g)
                .ok()
                .filter(|i| usize::try_from(*i).is_ok_and(|i| i < gpus))
                .map(Some)
                .ok_or_else(|| format!("service {name}: gpu = {g} but the host has {gpus} GPU(s)"))
        }
    }
}

/// A `[[service]]` whose load trace is read and checked: its model and spec, checked.
fn latency_critical(
    s: ServiceFile,
    models: &Models<'_>,
    gpus: usize,
) -> Result<SimService, String> {
    let name = s.name.get_ref().clone();
    let model = models.resolve(
        &format!("service {name}"),
        &s.name,
        &s.model,
        s.physics.as_ref(),
    )?;
    let Some(lat) = model.latency else {
        return Err(format!(
            "service {name}: model {} is a best-effort job; put it under [[best_effort]]",
            s.model
        ));
    };
    let target = s.p99_target_ms.unwrap_or(lat.p99_target_ms);
    let gpu = check_gpu(&name, &model, s.gpu, gpus)?;
    let spec = ServiceSpec {
        name,
        class: ServiceClass::LatencyCritical {
            p99_target_ms: target,
        },
        gpu,
        priority: s.priority,
    };
    spec.validate().map_err(|e| e.to_string())?;
    Ok(SimService {
        spec,
        model,
        load: Some(s.load),
    })
}

/// A `[[best_effort]]` job: its model and spec, checked.
fn best_effort(b: BestEffortFile, models: &Models<'_>, gpus: usize) -> Result<SimService, String> {
    let name = b.name.get_ref().clone();
    let model = models.resolve(
        &format!("best-effort job {name}"),
        &b.name,
        &b.model,
        b.physics.as_ref(),
    )?;
    if model.latency.is_some() {
        return Err(format!(
            "best-effort job {name}: model {} is latency-critical; put it under [[service]]",
            b.model
        ));
    }
    let gpu = check_gpu(&name, &model, b.gpu, gpus)?;
    let spec = ServiceSpec {
        name,
        class: ServiceClass::BestEffort,
        gpu,
        priority: 0,
    };
    spec.validate().map_err(|e| e.to_string())?;
    Ok(SimService {
        spec,
        model,
        load: None,
    })
}

/// Names are unique and none is the pool's.
fn check_names(services: &[SimService]) -> Result<(), String> {
    for (i, s) in services.iter().enumerate() {
        if s.spec.name == BEST_EFFORT_GROUP {
            return Err(format!(
                "the name {BEST_EFFORT_GROUP} is reserved for the pool"
            ));
        }
        if services[..i].iter().any(|o| o.spec.name == s.spec.name) {
            return Err(format!("service name {} is used twice", s.spec.name));
        }
    }
    Ok(())
}

/// The noise section's values are within their ranges.
fn check_noise(n: &Noise) -> Result<(), String> {
    if !(1..=crate::host::MAX_LATENCY_WINDOW).contains(&n.latency_window) {
        return Err(format!(
            "noise.latency_window must be between 1 and {} intervals, got {}",
            crate::host::MAX_LATENCY_WINDOW,
            n.latency_window
        ));
    }
    for (what, v, max) in [
        ("noise.counter_sigma", n.counter_sigma, 2.0),
        ("noise.p99_sigma", n.p99_sigma, 2.0),
        ("noise.glitch_prob", n.glitch_prob, 1.0),
        ("noise.missing_prob", n.missing_prob, 1.0),
    ] {
        if !(v.is_finite() && (0.0..=max).contains(&v)) {
            return Err(format!("{what} must be between 0 and {max}, got {v}"));
        }
    }
    Ok(())
}

fn host_from(f: &HostSection) -> Result<SimHost, String> {
    let preset = f.preset.as_deref().unwrap_or("xeon-e5-2697v4");
    let platform = Platform::by_name(preset).ok_or_else(|| {
        let names: Vec<&str> = Platform::ALL.iter().map(|(n, _)| *n).collect();
        format!(
            "host.preset {preset:?} is unknown; presets: {}",
            names.join(", ")
        )
    })?;
    let mut h = platform.host();
    let positive = |what: &str, v: f64| -> Result<f64, String> {
        if v.is_finite() && v > 0.0 {
            Ok(v)
        } else {
            Err(format!("host.{what} must be a positive number, got {v}"))
        }
    };
    let count = |what: &str, v: i64| -> Result<u32, String> {
        u32::try_from(v)
            .ok()
            .filter(|c| *c > 0)
            .ok_or_else(|| format!("host.{what} must be a positive whole number, got {v}"))
    };
    if let Some(c) = f.cores {
        h.capacity.cores = count("cores", c)?;
    }
    if let Some(v) = f.freq_ghz {
        h.capacity.freq_ghz = positive("freq_ghz", v)?;
    }
    let llc_bytes = h.capacity.llc_bytes() as f64;
    if let Some(w) = f.llc_ways {
        h.capacity.llc_ways = count("llc_ways", w)?;
        h.capacity.llc_way_bytes = crate::whole(llc_bytes / f64::from(h.capacity.llc_ways));
    }
    if let Some(mb) = f.llc_mb {
        let bytes = positive("llc_mb", mb)? * 1024.0 * 1024.0;
        h.capacity.llc_way_bytes = crate::whole(bytes / f64::from(h.capacity.llc_ways));
    }
    if let Some(v) = f.mem_bw_gbps {
        h.capacity.mem_bw_bytes_per_s = positive("mem_bw_gbps", v)? * 1e9;
    }
    if let Some(v) = f.mem_latency_ns {
        h.mem_latency_ns = positive("mem_latency_ns", v)?;
    }
    if let Some(c) = f.closids {
        h.capacity.closids = count("closids", c)?;
    }
    if let Some(how) = f.gpu_share_change {
        for g in &mut h.capacity.gpus {
            g.share_change = how;
        }
    }
    if f.rdt_allocation == Some(false) {
        h.capacity = h.capacity.without_allocation();
    }
    Ok(h)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
name = "t"
duration_s = 60
[host]
preset = "xeon-e5-2697v4"
[[service]]
name = "mc"
model = "memcached"
load = { kind = "constant", fraction = 0.2 }
[[best_effort]]
name = "s"
model = "stream"
"#;

    fn parse(text: &str) -> Result<Scenario, SimError> {
        Scenario::from_toml(text, "test.toml", Path::new("."))
    }

    #[test]
    fn every_builtin_scenario_parses_and_validates() {
        for name in builtin_names().chain(crowded_names()) {
            let s = Scenario::load(name).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert!(s.ticks() > 0, "{name}");
            assert!(
                s.services.iter().any(|s| s.spec.is_latency_critical()),
                "{name}"
            );
        }
    }

    #[test]
    fn a_good_file_parses_with_defaults() {
        let s = parse(GOOD).unwrap();
        assert_eq!(s.tick_ms, 1000);
        assert_eq!(s.ticks(), 60);
        assert_eq!(s.services.len(), 2);
        assert_eq!(s.services[0].spec.p99_target_ms(), Some(0.6));
        assert!(s.load_rps(0, 0.0) > 0.0 && s.load_rps(1, 0.0) == 0.0);
    }

    #[test]
    fn an_unknown_key_is_named() {
        let err = parse(&GOOD.replace("duration_s = 60", "duration_s = 60\nspeed = 3"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("speed") && err.contains("test.toml"), "{err}");
        let err = parse(&GOOD.replace("preset =", "cpus = 4\npreset ="))
            .unwrap_err()
            .to_string();
        assert!(err.contains("cpus"), "{err}");
    }

    #[test]
    fn a_negative_capacity_is_named() {
        let err = parse(&GOOD.replace("preset = \"xeon-e5-2697v4\"", "cores = -4"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("host.cores") && err.contains("-4"), "{err}");
        let err = parse(&GOOD.replace("preset = \"xeon-e5-2697v4\"", "mem_bw_gbps = -1.5"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("host.mem_bw_gbps"), "{err}");
    }

    #[test]
    fn closids_can_be_overridden_and_too_few_are_named() {
        let s = parse(&GOOD.replace("[host]", "[host]\nclosids = 4")).unwrap();
        assert_eq!(s.capacity().closids, 4);
        assert_eq!(s.host.preset, "xeon-e5-2697v4");
        assert_eq!(parse(GOOD).unwrap().capacity().closids, 16);
        let err = parse(&GOOD.replace("[host]", "[host]\nclosids = 1"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("host.closids"), "{err}");
    }

    #[test]
    fn a_host_without_rdt_allocation_has_one_shared_way_and_no_mba() {
        let s = parse(&GOOD.replace("[host]", "[host]\nrdt_allocation = false")).unwrap();
        let c = s.capacity();
        assert_eq!((c.llc_ways, c.mba_min_pct), (1, 100));
        assert_eq!(c.llc_bytes(), parse(GOOD).unwrap().capacity().llc_bytes());
        assert_eq!(parse(GOOD).unwrap().capacity().llc_ways, 20);
    }

    #[test]
    fn only_the_xeon_scalable_preset_offers_mba() {
        // MBA came with Xeon Scalable (Skylake-SP on); the Broadwell-EP and Haswell-EP
        // parts have CAT and monitoring only, so 100 % is their one level.
        for (name, p) in Platform::ALL {
            let c = p.host().capacity;
            assert_eq!(
                (c.mba_min_pct, c.mba_gran_pct),
                if name == "xeon-gold-6338" {
                    (10, 10)
                } else {
                    (100, 100)
                },
                "{name}"
            );
        }
    }

    #[test]
    fn on_another_platform_a_scenario_keeps_what_its_host_section_changes() {
        // few-closids gives the E5 4 CLOSIDs: on the Gold it has 4 as well, and the Gold's
        // own cores and ways.
        let few = Scenario::load("few-closids").unwrap();
        let gold = few.on_platform("xeon-gold-6338").unwrap();
        let c = gold.capacity();
        assert_eq!((c.closids, c.cores, c.llc_ways), (4, 64, 12));
        assert_eq!(gold.host.preset, "xeon-gold-6338");
        // A host without RDT allocation has none on any platform.
        let vm = parse(&GOOD.replace("[host]", "[host]\nrdt_allocation = false"))
            .unwrap()
            .on_platform("xeon-gold-6338")
            .unwrap();
        assert_eq!(
            (vm.capacity().llc_ways, vm.capacity().mba_min_pct),
            (1, 100)
        );
        let e = few.on_platform("xeon-9999").unwrap_err().to_string();
        assert!(
            e.contains("xeon-9999") && e.contains("xeon-gold-6338"),
            "{e}"
        );
    }

    #[test]
    fn a_host_without_counters_or_rdt_monitoring_reports_those_readings_absent() {
        assert_eq!(parse(GOOD).unwrap().telemetry, Telemetry::default());
        let s = parse(&GOOD.replace("[host]", "[host]\ncounters = false\nrdt_monitoring = false"))
            .unwrap();
        assert_eq!(
            s.telemetry,
            Telemetry {
                counters: false,
                rdt_monitoring: false
            }
        );
        let full = Sample {
            ipc: Some(1.0),
            llc_misses_per_s: Some(1e6),
            llc_occupancy_bytes: Some(1e6),
            mem_bw_bytes_per_s: Some(1e9),
            cpu_busy_cores: Some(2.0),
            p99_ms: Some(0.5),
            requests_per_s: Some(100.0),
            ..Sample::default()
        };
        let bare = s.telemetry.strip(full.clone());
        assert_eq!(
            bare,
            Sample {
                cpu_busy_cores: Some(2.0),
                p99_ms: Some(0.5),
                requests_per_s: Some(100.0),
                ..Sample::default()
            }
        );
        let no_rdt = Telemetry {
            counters: true,
            rdt_monitoring: false,
        }
        .strip(full.clone());
        assert_eq!((no_rdt.ipc, no_rdt.mem_bw_bytes_per_s), (Some(1.0), None));
        assert_eq!(Telemetry::default().strip(full.clone()), full);
    }

    #[test]
    fn a_target_of_zero_is_named() {
        let err = parse(&GOOD.replace(
            "model = \"memcached\"",
            "model = \"memcached\"\np99_target_ms = 0",
        ))
        .unwrap_err()
        .to_string();
        assert!(err.contains("mc") && err.contains("p99_target_ms"), "{err}");
    }

    #[test]
    fn wrong_classes_models_and_names_are_explained() {
        let err = parse(&GOOD.replace("model = \"stream\"", "model = \"xapian\""))
            .unwrap_err()
            .to_string();
        assert!(err.contains("latency-critical"), "{err}");
        let err = parse(&GOOD.replace("model = \"memcached\"", "model = \"memcache\""))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("unknown model") && err.contains("memcached"),
            "{err}"
        );
        let err = parse(&GOOD.replace("name = \"s\"", "name = \"mc\""))
            .unwrap_err()
            .to_string();
        assert!(err.contains("used twice"), "{err}");
        let err = parse(&GOOD.replace("model = \"stream\"", "model = \"gpu-train\""))
            .unwrap_err()
            .to_string();
        assert!(err.contains("GPU"), "{err}");
    }

    #[test]
    fn a_replay_trace_is_read_relative_to_the_scenario_file() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("load.csv"), "t_s,fraction\n0,0.1\n10,0.3\n").unwrap();
        let text = GOOD.replace(
            r#"load = { kind = "constant", fraction = 0.2 }"#,
            r#"load = { kind = "replay", file = "load.csv" }"#,
        );
        let path = dir.path().join("s.toml");
        std::fs::write(&path, text).unwrap();
        let s = Scenario::load(path.to_str().unwrap()).unwrap();
        assert!(s.load_rps(0, 11.0) > 2.9 * s.load_rps(0, 1.0));
        std::fs::remove_file(dir.path().join("load.csv")).unwrap();
        let err = Scenario::load(path.to_str().unwrap())
            .unwrap_err()
            .to_string();
        assert!(err.contains("load.csv"), "{err}");
    }

    /// Moses with `physics` (a TOML inline table's inside, or none) beside stream.
    fn moses(physics: &str) -> String {
        let line = if physics.is_empty() {
            String::new()
        } else {
            format!("physics = {{ {physics} }}\n")
        };
        GOOD.replace(
            "model = \"memcached\"\n",
            &format!("model = \"moses\"\n{line}"),
        )
    }

    /// The first service on `cores` cores and `ways` ways, the pool on the rest.
    fn first_on(sc: &Scenario, cores: u32, ways: u32) -> cohabit_core::Plan {
        use cohabit_core::{Allocation, Plan, WayRange};
        let cap = sc.capacity();
        let lc = Allocation {
            cores,
            llc_ways: WayRange::new(0, ways),
            mba_pct: 100,
            gpu_mps_pct: None,
        };
        Plan {
            services: [(sc.services[0].spec.name.clone(), lc)].into(),
            best_effort: Allocation {
                cores: cap.cores - cores,
                llc_ways: WayRange::new(ways, cap.llc_ways - ways),
                ..lc
            },
            gpu_memory_mib: Default::default(),
        }
    }

    /// LLC misses per instruction of every service and job, and the first service's p99
    /// against its target, with 20 cores and 8 ways for it, the pool on the rest, at the
    /// scenario's load.
    fn misses_and_p99(sc: Scenario) -> (Vec<f64>, f64) {
        let plan = first_on(&sc, 20, 8);
        let n = sc.services.len();
        let target = sc.services[0].spec.p99_target_ms().unwrap();
        let truth = crate::TruthModel::new(Arc::new(sc));
        let loads = truth.loads_at(1.0);
        let (eval, _) = truth.evaluate(&plan, &loads, &vec![None; n], &vec![0.0; n]);
        let misses = eval
            .outcomes
            .iter()
            .map(|o| o.llc_misses_per_s / o.instructions_per_s)
            .collect();
        (misses, eval.outcomes[0].p99_ms.unwrap() / target)
    }

    #[test]
    fn physics_changes_the_simulated_service() {
        let base = parse(&moses("")).unwrap();
        let missy = parse(&moses("llc_mpki = 20")).unwrap();
        assert_eq!(
            missy.services[0].model.physics.get(Param::LlcMpki),
            Some(20.0)
        );
        assert!(missy.services[0].model.source.contains("llc_mpki = 20"));
        // More misses at the published point: more in the same 8 ways beside the same
        // pool, and the service further from its target there (neither saturated).
        let (m0, p0) = misses_and_p99(base);
        let (m1, p1) = misses_and_p99(missy);
        assert!(m1[0] > 1.5 * m0[0], "{m1:?} vs {m0:?}");
        assert!(p1 > 1.05 * p0 && p1 < 5.0, "{p1} vs {p0}");
        // A best-effort job with a larger working set misses more in the pool's ways.
        let big_job = parse(&GOOD.replace(
            "model = \"stream\"",
            "model = \"graph\"\nphysics = { wss_mb = 64 }",
        ))
        .unwrap();
        let graph = parse(&GOOD.replace("model = \"stream\"", "model = \"graph\"")).unwrap();
        let (mb, _) = misses_and_p99(big_job);
        let (mg, _) = misses_and_p99(graph);
        assert!(mb[1] > 1.2 * mg[1], "{mb:?} vs {mg:?}");
        // The row's target and max load are recalibrated on: a tighter target makes each
        // request lighter; a max load past moses' knee (11k requests/s: its own service time
        // sets it) moves the knee the loads are fractions of to it.
        let base = parse(&moses("")).unwrap();
        let work = |sc: &Scenario| sc.services[0].model.cpu.unwrap().instructions_per_request;
        let tight = parse(&moses("target_ms = 7.5")).unwrap();
        assert_eq!(tight.services[0].spec.p99_target_ms(), Some(7.5));
        assert!(
            work(&tight) < 0.9 * work(&base),
            "{} {}",
            work(&tight),
            work(&base)
        );
        let busy = parse(&moses("max_load = 28000")).unwrap();
        let knee = busy.services[0].model.latency.unwrap().knee_rps;
        assert!((28_000.0..28_500.0).contains(&knee), "{knee}");
        let ratio = busy.load_rps(0, 0.0) / base.load_rps(0, 0.0);
        assert!(ratio > 2.0, "{ratio}");
        // A best-effort job takes its own parameters.
        let heavy = parse(&GOOD.replace(
            "model = \"stream\"",
            "model = \"stream\"\nphysics = { apki = 120, mlp = 3 }",
        ))
        .unwrap();
        let cpu = heavy.services[1].model.cpu.unwrap();
        assert_eq!((cpu.apki, cpu.mlp), (120.0, 3.0));
    }

    #[test]
    fn a_bad_physics_key_or_value_is_named_with_its_line() {
        // GOOD's [[service]] starts on line 6; moses' physics is on line 9.
        for (physics, words) in [
            ("wss_mbb = 40", &["physics.wss_mbb", "wss_mb,"][..]),
            ("wss_mb = -3", &["physics.wss_mb", "-3"]),
            ("m_inf = 1.5", &["physics.m_inf", "between 0 and 1"]),
            ("ipc = inf", &["physics.ipc", "inf"]),
            (
                "cpi_base = 1",
                &["physics.cpi_base", "not a parameter of a service row"],
            ),
            ("streams = 2", &["physics.streams"]),
        ] {
            let err = parse(&moses(physics)).unwrap_err().to_string();
            assert!(
                err.contains("test.toml: line 9: service mc"),
                "{physics}: {err}"
            );
            for w in words {
                assert!(err.contains(w), "{physics}: {err}");
            }
        }
        let err = parse(&GOOD.replace(
            "model = \"stream\"",
            "model = \"stream\"\nphysics = { ipc = 1 }",
        ))
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("best-effort job s: physics.ipc") && err.contains("best-effort row"),
            "{err}"
        );
        // Not a number: TOML's own error, with its line.
        let err = parse(&moses("wss_mb = \"big\"")).unwrap_err().to_string();
        assert!(err.contains("line 9") && err.contains("wss_mb"), "{err}");
    }

    const OWN: &str = r#"
[[catalogue]]
name = "kv"
kind = "service"
about = "our key-value store, measured"
physics = { target_ms = 2, max_load = 50000, cv = 1.2, ipc = 0.9, llc_mpki = 3, wss_mb = 50, m_inf = 0.1, steepness = 2.5, icache_mpki = 10, sys_share = 0.4 }
"#;

    #[test]
    fn a_scenario_catalogue_service_runs() {
        let text = format!(
            "{}{OWN}",
            GOOD.replace("model = \"memcached\"", "model = \"kv\"")
        );
        let sc = Arc::new(parse(&text).unwrap());
        let kv = &sc.services[0].model;
        assert_eq!((kv.name.as_str(), kv.kind()), ("kv", RowKind::Service));
        assert_eq!(sc.services[0].spec.p99_target_ms(), Some(2.0));
        let knee = kv.latency.unwrap().knee_rps;
        assert!(knee >= 50_000.0 * 0.999 && knee.is_finite(), "{knee}");
        // It runs: the simulated host serves a fifth of its knee on 16 cores and 10 ways.
        use cohabit_core::Collector;
        let p = first_on(&sc, 16, 10);
        let mut host = crate::SimulatedHost::launch(Arc::clone(&sc), &p, Some(1)).unwrap();
        let obs: Vec<_> = (0..5).map(|_| host.collect().unwrap()).collect();
        let last = &obs[4].services[0].sample;
        assert!(last.requests_per_s.unwrap() > 0.15 * knee, "{last:?}");
        assert!(last.p99_ms.unwrap() < 2.0, "{last:?}");
    }

    #[test]
    fn a_scenario_catalogue_row_is_checked_by_name() {
        let with = |own: &str| {
            format!(
                "{}{own}",
                GOOD.replace("model = \"memcached\"", "model = \"kv\"")
            )
        };
        let err = parse(&with(&OWN.replace("ipc = 0.9, ", "")))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("line 15: catalogue row \"kv\": physics.ipc is missing"),
            "{err}"
        );
        let err = parse(&with(&OWN.replace("\"kv\"", "\"memcached\"")))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("built-in catalogue has a model of that name"),
            "{err}"
        );
        let err = parse(&with(
            &OWN.replace("kind = \"service\"", "kind = \"daemon\""),
        ))
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("daemon") && err.contains("best-effort"),
            "{err}"
        );
        let err = parse(&with(&format!("{OWN}{OWN}")))
            .unwrap_err()
            .to_string();
        assert!(err.contains("defined twice"), "{err}");
        // Its own parameters are range-checked too.
        let err = parse(&with(&OWN.replace("sys_share = 0.4", "sys_share = 4")))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("physics.sys_share") && err.contains("line 18"),
            "{err}"
        );
        // And a service may change a row of the scenario's own like a built-in one.
        let text = with(OWN).replace("model = \"kv\"", "model = \"kv\"\nphysics = { wss_mb = 5 }");
        let sc = parse(&text).unwrap();
        assert_eq!(sc.services[0].model.physics.get(Param::WssMb), Some(5.0));
    }

    #[test]
    fn an_unknown_scenario_lists_the_builtin_ones() {
        let err = Scenario::load("no-such-scenario").unwrap_err().to_string();
        assert!(
            err.contains("demo") && err.contains("no-such-scenario"),
            "{err}"
        );
    }
}
