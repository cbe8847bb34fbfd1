//! The flat row: one per (decision, service or group), with the decision's and the host's
//! columns repeated on each. [`flatten`] makes a decision's rows, [`unflatten`] the
//! decision back from them. docs/FLEETS.md ("Decision logs as Parquet") documents every
//! column; the list below is the one place the columns are defined.

use std::collections::{BTreeMap, BTreeSet};

use arrow_array::RecordBatch;
use arrow_schema::ArrowError;
use cohabit_core::{
    Allocation, ApplyOutcome, Control, DecisionPath, DecisionRecord, Estimate, GroundTruth,
    GroupControl, HostCapacity, LogHeader, Observation, Plan, PosteriorEstimate, Prediction,
    Reason, Resource, Sample, ServiceClass, ServiceObservation, ServiceSpec, WayRange,
    BEST_EFFORT_GROUP, DECISION_LOG_VERSION,
};

use super::columns::{
    Flag, Kind, OptF64, OptText, OptU32, OptU64, OptU8, Pids, Text, F64, I32, U32, U64,
};
use super::LoggedRecord;

/// The struct of one row and its conversions from and to Arrow, from one list of fields:
/// the column name is the field's, its kind says its Arrow type and nullability.
macro_rules! flat_columns {
    ($($field:ident : $kind:ty),* $(,)?) => {
        /// One row of the Parquet layout.
        #[derive(Debug, Clone, Default, PartialEq)]
        pub(super) struct Flat {
            $(pub(super) $field: <$kind as Kind>::Value,)*
        }

        /// The rows as one Arrow batch (an empty slice gives the schema).
        pub(super) fn to_batch(rows: &[Flat]) -> Result<RecordBatch, ArrowError> {
            RecordBatch::try_from_iter_with_nullable([
                $((stringify!($field), <$kind>::array(rows.iter().map(|r| &r.$field)), <$kind>::NULLABLE),)*
            ])
        }

        /// The rows of an Arrow batch; the error names the column that is missing or of
        /// another type.
        pub(super) fn from_batch(batch: &RecordBatch) -> Result<Vec<Flat>, (&'static str, String)> {
            $(let mut $field = <$kind>::get(batch, stringify!($field))
                .map_err(|e| (stringify!($field), e))?
                .into_iter();)*
            Ok((0..batch.num_rows())
                .map(|_| Flat { $($field: $field.next().unwrap_or_default(),)* })
                .collect())
        }
    };
}

flat_columns! {
    source: Text,
    part: U32,
    line: U64,
    host: OptText,
    host_cores: OptU32,
    host_freq_ghz: OptF64,
    host_llc_ways: OptU32,
    host_llc_way_bytes: OptU64,
    host_llc_bytes: OptU64,
    host_mem_bw_bytes_per_s: OptF64,
    host_closids: OptU32,
    host_mba_min_pct: OptU8,
    host_mba_gran_pct: OptU8,
    host_min_cbm_bits: OptU32,
    host_shareable_bits: OptU64,
    host_gpus: OptU32,
    host_gpus_json: OptText,
    tunables_json: OptText,
    policy: Text,
    simulated: Flag,
    schema_version: U32,
    t_ms: U64,
    decision_us: F64,
    apply: OptText,
    apply_error: OptText,
    truth_be_throughput: OptF64,
    service: Text,
    group: Text,
    class: Text,
    target_ms: OptF64,
    gpu: OptU32,
    priority: I32,
    from_pod: Flag,
    ipc: OptF64,
    llc_misses_per_s: OptF64,
    llc_occupancy_bytes: OptF64,
    mem_bw_bytes_per_s: OptF64,
    cpu_busy_cores: OptF64,
    memory_bytes: OptF64,
    gpu_util_pct: OptF64,
    gpu_memory_bytes: OptF64,
    gpu_memory_total_bytes: OptF64,
    p99_ms: OptF64,
    requests_per_s: OptF64,
    p99_intervals: OptU32,
    gpu_mps_effective_pct: OptU8,
    truth_p99_ms: OptF64,
    truth_load_rps: OptF64,
    current_cores: OptU32,
    current_llc_first: OptU32,
    current_llc_ways: OptU32,
    current_mba_pct: OptU8,
    current_gpu_mps_pct: OptU8,
    current_gpu_memory_mib: OptU64,
    plan_cores: OptU32,
    plan_llc_first: OptU32,
    plan_llc_ways: OptU32,
    plan_mba_pct: OptU8,
    plan_gpu_mps_pct: OptU8,
    plan_gpu_memory_mib: OptU64,
    reason_path: OptText,
    reason_text: OptText,
    pred_log_qos_ratio: OptF64,
    pred_log_qos_sigma: OptF64,
    prior_log_qos_ratio: OptF64,
    prior_log_qos_sigma: OptF64,
    posterior_log_qos_ratio: OptF64,
    posterior_log_qos_sigma: OptF64,
    posterior_samples: OptF64,
    control_pids: Pids,
    control_cores: OptText,
    control_cores_why: OptText,
    control_llc_ways: OptText,
    control_llc_ways_why: OptText,
    control_mba: OptText,
    control_mba_why: OptText,
    control_gpu_share: OptText,
    control_gpu_share_why: OptText,
}

/// The `class` of a row.
const LATENCY_CRITICAL: &str = "latency-critical";
const BEST_EFFORT: &str = "best-effort";
/// The best-effort pool's own row (its allocation, reason and control).
const POOL: &str = "pool";
/// A group the plan or the allocation in force names but the observation does not.
const UNOBSERVED: &str = "unobserved";

/// The decision's and the host's columns, the same on each of its rows.
fn base(r: &LoggedRecord) -> Flat {
    let rec = &r.record;
    let h = r.header.as_ref().map(|h| &h.host);
    let (apply, apply_error) = match &rec.apply {
        None => (None, None),
        Some(ApplyOutcome::DryRun) => (Some("dry_run".to_string()), None),
        Some(ApplyOutcome::Refused { error }) => (Some("refused".to_string()), Some(error.clone())),
    };
    Flat {
        source: r.source.clone(),
        part: r.part,
        line: r.line,
        host: h.map(|h| h.name.clone()),
        host_cores: h.map(|h| h.cores),
        host_freq_ghz: h.map(|h| h.freq_ghz),
        host_llc_ways: h.map(|h| h.llc_ways),
        host_llc_way_bytes: h.map(|h| h.llc_way_bytes),
        host_llc_bytes: h.map(HostCapacity::llc_bytes),
        host_mem_bw_bytes_per_s: h.map(|h| h.mem_bw_bytes_per_s),
        host_closids: h.map(|h| h.closids),
        host_mba_min_pct: h.map(|h| h.mba_min_pct),
        host_mba_gran_pct: h.map(|h| h.mba_gran_pct),
        host_min_cbm_bits: h.map(|h| h.min_cbm_bits),
        host_shareable_bits: h.map(|h| h.shareable_bits),
        host_gpus: h.map(|h| u32::try_from(h.gpus.len()).unwrap_or(u32::MAX)),
        host_gpus_json: h.map(|h| serde_json::to_string(&h.gpus).unwrap_or_default()),
        tunables_json: r
            .header
            .as_ref()
            .filter(|h| !h.tunables.is_empty())
            .map(|h| serde_json::to_string(&h.tunables).unwrap_or_default()),
        policy: rec.policy.clone(),
        simulated: rec.simulated,
        schema_version: rec.schema_version,
        t_ms: rec.observation.t_ms,
        decision_us: rec.decision_us,
        apply,
        apply_error,
        truth_be_throughput: rec.truth.as_ref().map(|t| t.be_throughput),
        ..Flat::default()
    }
}

/// The rows of one decision: each observed service in order, then the best-effort pool,
/// then each group the allocations name but the observation does not.
pub(super) fn flatten(r: &LoggedRecord) -> Vec<Flat> {
    let rec = &r.record;
    let base = base(r);
    let mut rows = Vec::with_capacity(rec.observation.services.len() + 1);
    let mut observed = BTreeSet::new();
    for s in &rec.observation.services {
        let lc = s.spec.is_latency_critical();
        if lc {
            observed.insert(s.spec.name.as_str());
        }
        let group = if lc {
            s.spec.name.as_str()
        } else {
            BEST_EFFORT_GROUP
        };
        let mut row = service_row(
            &base,
            rec,
            &s.spec.name,
            group,
            if lc { LATENCY_CRITICAL } else { BEST_EFFORT },
        );
        observation_columns(&mut row, s);
        rows.push(row);
    }
    rows.push(service_row(
        &base,
        rec,
        BEST_EFFORT_GROUP,
        BEST_EFFORT_GROUP,
        POOL,
    ));
    let plan = &rec.plan.services;
    let current = &rec.observation.current.services;
    let unobserved: BTreeSet<&str> = current
        .keys()
        .chain(plan.keys())
        .map(String::as_str)
        .filter(|n| !observed.contains(n))
        .collect();
    for name in unobserved {
        rows.push(service_row(&base, rec, name, name, UNOBSERVED));
    }
    rows
}

/// A row of `service` in `group`, with the group's allocations, reason and control and the
/// service's prediction and ground truth; the telemetry is the caller's.
fn service_row(base: &Flat, rec: &DecisionRecord, service: &str, group: &str, class: &str) -> Flat {
    let mut row = base.clone();
    row.service = service.to_string();
    row.group = group.to_string();
    row.class = class.to_string();
    row.from_pod = rec.from_pod(service);
    let (current, plan) = if group == BEST_EFFORT_GROUP {
        (
            Some(&rec.observation.current.best_effort),
            Some(&rec.plan.best_effort),
        )
    } else {
        (
            rec.observation.current.services.get(group),
            rec.plan.services.get(group),
        )
    };
    if let Some(a) = current {
        (
            row.current_cores,
            row.current_llc_first,
            row.current_llc_ways,
            row.current_mba_pct,
        ) = (
            Some(a.cores),
            Some(a.llc_ways.first),
            Some(a.llc_ways.count),
            Some(a.mba_pct),
        );
        row.current_gpu_mps_pct = a.gpu_mps_pct;
    }
    if let Some(a) = plan {
        (
            row.plan_cores,
            row.plan_llc_first,
            row.plan_llc_ways,
            row.plan_mba_pct,
        ) = (
            Some(a.cores),
            Some(a.llc_ways.first),
            Some(a.llc_ways.count),
            Some(a.mba_pct),
        );
        row.plan_gpu_mps_pct = a.gpu_mps_pct;
    }
    row.current_gpu_memory_mib = rec.observation.current.gpu_memory_mib.get(service).copied();
    row.plan_gpu_memory_mib = rec.plan.gpu_memory_mib.get(service).copied();
    if let Some(reason) = rec.reasons.get(group) {
        row.reason_path = Some(reason.path.name().to_string());
        row.reason_text = Some(reason.text.clone());
    }
    if class != POOL {
        if let Some(p) = rec.predictions.get(service) {
            row.pred_log_qos_ratio = Some(p.log_qos_ratio);
            row.pred_log_qos_sigma = Some(p.log_qos_sigma);
            row.prior_log_qos_ratio = p.prior.map(|e| e.log_qos_ratio);
            row.prior_log_qos_sigma = p.prior.map(|e| e.log_qos_sigma);
            row.posterior_log_qos_ratio = p.posterior.map(|e| e.log_qos_ratio);
            row.posterior_log_qos_sigma = p.posterior.map(|e| e.log_qos_sigma);
            row.posterior_samples = p.posterior.map(|e| e.samples);
        }
        if let Some(t) = &rec.truth {
            row.truth_p99_ms = t.p99_ms.get(service).copied();
            row.truth_load_rps = t.load_rps.get(service).copied();
        }
    }
    if let Some(c) = rec.control.get(group) {
        row.control_pids = Some(c.pids.iter().copied().collect());
        for (resource, control) in &c.resources {
            let (kind, why) = match control {
                Control::InPlace => ("in_place", None),
                Control::Moved => ("moved", None),
                Control::Partial { why } => ("partial", Some(why.clone())),
                Control::Unmanaged { why } => ("unmanaged", Some(why.clone())),
            };
            let (k, w) = row.control_mut(*resource);
            (*k, *w) = (Some(kind.to_string()), why);
        }
    }
    row
}

/// The service's own columns: what it is and its telemetry.
fn observation_columns(row: &mut Flat, s: &ServiceObservation) {
    row.target_ms = s.spec.p99_target_ms();
    row.gpu = s.spec.gpu;
    row.priority = s.spec.priority;
    let m = &s.sample;
    row.ipc = m.ipc;
    row.llc_misses_per_s = m.llc_misses_per_s;
    row.llc_occupancy_bytes = m.llc_occupancy_bytes;
    row.mem_bw_bytes_per_s = m.mem_bw_bytes_per_s;
    row.cpu_busy_cores = m.cpu_busy_cores;
    row.memory_bytes = m.memory_bytes;
    row.gpu_util_pct = m.gpu_util_pct;
    row.gpu_memory_bytes = m.gpu_memory_bytes;
    row.gpu_memory_total_bytes = m.gpu_memory_total_bytes;
    row.p99_ms = m.p99_ms;
    row.requests_per_s = m.requests_per_s;
    row.p99_intervals = m.p99_intervals;
    row.gpu_mps_effective_pct = s.gpu_mps_effective_pct;
}

impl Flat {
    /// The control columns of `resource`: how, and why not all.
    fn control_mut(&mut self, resource: Resource) -> (&mut Option<String>, &mut Option<String>) {
        match resource {
            Resource::Cores => (&mut self.control_cores, &mut self.control_cores_why),
            Resource::LlcWays => (&mut self.control_llc_ways, &mut self.control_llc_ways_why),
            Resource::Mba => (&mut self.control_mba, &mut self.control_mba_why),
            Resource::GpuShare => (&mut self.control_gpu_share, &mut self.control_gpu_share_why),
        }
    }

    fn control(&self, resource: Resource) -> (Option<&str>, Option<&str>) {
        let (k, w) = match resource {
            Resource::Cores => (&self.control_cores, &self.control_cores_why),
            Resource::LlcWays => (&self.control_llc_ways, &self.control_llc_ways_why),
            Resource::Mba => (&self.control_mba, &self.control_mba_why),
            Resource::GpuShare => (&self.control_gpu_share, &self.control_gpu_share_why),
        };
        (k.as_deref(), w.as_deref())
    }

    fn current(&self) -> Option<Allocation> {
        Some(Allocation {
            cores: self.current_cores?,
            llc_ways: WayRange::new(self.current_llc_first?, self.current_llc_ways?),
            mba_pct: self.current_mba_pct?,
            gpu_mps_pct: self.current_gpu_mps_pct,
        })
    }

    fn planned(&self) -> Option<Allocation> {
        Some(Allocation {
            cores: self.plan_cores?,
            llc_ways: WayRange::new(self.plan_llc_first?, self.plan_llc_ways?),
            mba_pct: self.plan_mba_pct?,
            gpu_mps_pct: self.plan_gpu_mps_pct,
        })
    }
}

/// A value of a row that this build cannot take back: the column and what is wrong.
pub(super) type Bad = (&'static str, String);

/// The decision whose rows are `rows` (all of one source and line, as [`flatten`] made
/// them). The changes are not stored: they are the difference between the allocation in
/// force and the plan, as the controller computes them.
pub(super) fn unflatten(rows: &[Flat]) -> Result<LoggedRecord, Bad> {
    let first = rows
        .first()
        .ok_or(("line", "a decision without rows".to_string()))?;
    let mut parts = Parts::default();
    for row in rows {
        parts.take(row)?;
    }
    let (current_pool, plan_pool) = parts.pool.ok_or((
        "class",
        "the decision has no row of the best-effort pool".to_string(),
    ))?;
    let current = Plan {
        services: parts.current,
        best_effort: current_pool,
        gpu_memory_mib: parts.current_gpu_memory_mib,
    };
    let plan = Plan {
        services: parts.plan,
        best_effort: plan_pool,
        gpu_memory_mib: parts.plan_gpu_memory_mib,
    };
    let truth = first.truth_be_throughput.map(|be_throughput| GroundTruth {
        p99_ms: parts.truth_p99_ms,
        load_rps: parts.truth_load_rps,
        be_throughput,
    });
    let record = DecisionRecord {
        schema_version: first.schema_version,
        policy: first.policy.clone(),
        simulated: first.simulated,
        changes: current.diff(&plan),
        observation: Observation {
            t_ms: first.t_ms,
            services: parts.services,
            current,
        },
        plan,
        reasons: parts.reasons,
        apply: apply(first)?,
        decision_us: first.decision_us,
        predictions: parts.predictions,
        truth,
        from_pods: parts.from_pods,
        control: parts.control,
    };
    Ok(LoggedRecord {
        source: first.source.clone(),
        part: first.part,
        line: first.line,
        header: header(first)?,
        record,
    })
}

/// What a decision's rows give, gathered row by row.
#[derive(Default)]
struct Parts {
    services: Vec<ServiceObservation>,
    current: BTreeMap<String, Allocation>,
    plan: BTreeMap<String, Allocation>,
    /// Pinned GPU-memory limits in force and planned, by client.
    current_gpu_memory_mib: BTreeMap<String, u64>,
    plan_gpu_memory_mib: BTreeMap<String, u64>,
    /// The pool's allocation in force and planned.
    pool: Option<(Allocation, Allocation)>,
    reasons: BTreeMap<String, Reason>,
    predictions: BTreeMap<String, Prediction>,
    control: BTreeMap<String, GroupControl>,
    from_pods: BTreeSet<String>,
    truth_p99_ms: BTreeMap<String, f64>,
    truth_load_rps: BTreeMap<String, f64>,
}

impl Parts {
    fn take(&mut self, row: &Flat) -> Result<(), Bad> {
        let class = row.class.as_str();
        match class {
            LATENCY_CRITICAL | BEST_EFFORT => self.services.push(observed(row)?),
            POOL => {
                let missing = |c| (c, "null in the best-effort pool's row".to_string());
                let now = row.current().ok_or_else(|| missing("current_cores"))?;
                let next = row.planned().ok_or_else(|| missing("plan_cores"))?;
                self.pool = Some((now, next));
            }
            UNOBSERVED => {}
            other => return Err(("class", format!("unknown class {other:?}"))),
        }
        if class == LATENCY_CRITICAL || class == UNOBSERVED {
            if let Some(a) = row.current() {
                self.current.insert(row.group.clone(), a);
            }
            if let Some(a) = row.planned() {
                self.plan.insert(row.group.clone(), a);
            }
        }
        if row.from_pod {
            self.from_pods.insert(row.service.clone());
        }
        if let Some(m) = row.current_gpu_memory_mib {
            self.current_gpu_memory_mib.insert(row.service.clone(), m);
        }
        if let Some(m) = row.plan_gpu_memory_mib {
            self.plan_gpu_memory_mib.insert(row.service.clone(), m);
        }
        if class != POOL {
            if let Some(p) = prediction(row) {
                self.predictions.insert(row.service.clone(), p);
            }
            if let Some(v) = row.truth_p99_ms {
                self.truth_p99_ms.insert(row.service.clone(), v);
            }
            if let Some(v) = row.truth_load_rps {
                self.truth_load_rps.insert(row.service.clone(), v);
            }
        }
        // A best-effort job's row repeats its pool's reason and control.
        if class != BEST_EFFORT {
            if let Some(r) = reason(row)? {
                self.reasons.insert(row.group.clone(), r);
            }
            if let Some(c) = group_control(row)? {
                self.control.insert(row.group.clone(), c);
            }
        }
        Ok(())
    }
}

/// The header of the log part the row came from; `None` for a version-1 part.
fn header(row: &Flat) -> Result<Option<LogHeader>, Bad> {
    let Some(name) = &row.host else {
        return Ok(None);
    };
    fn need<T: Copy>(v: Option<T>, column: &'static str) -> Result<T, Bad> {
        v.ok_or((column, "null although the host is named".to_string()))
    }
    let gpus = match &row.host_gpus_json {
        Some(j) => serde_json::from_str(j).map_err(|e| ("host_gpus_json", e.to_string()))?,
        None => Vec::new(),
    };
    let tunables = match &row.tunables_json {
        Some(j) => serde_json::from_str(j).map_err(|e| ("tunables_json", e.to_string()))?,
        None => BTreeMap::new(),
    };
    let host = HostCapacity {
        name: name.clone(),
        cores: need(row.host_cores, "host_cores")?,
        freq_ghz: need(row.host_freq_ghz, "host_freq_ghz")?,
        llc_ways: need(row.host_llc_ways, "host_llc_ways")?,
        llc_way_bytes: need(row.host_llc_way_bytes, "host_llc_way_bytes")?,
        mem_bw_bytes_per_s: need(row.host_mem_bw_bytes_per_s, "host_mem_bw_bytes_per_s")?,
        gpus,
        closids: need(row.host_closids, "host_closids")?,
        mba_min_pct: need(row.host_mba_min_pct, "host_mba_min_pct")?,
        mba_gran_pct: need(row.host_mba_gran_pct, "host_mba_gran_pct")?,
        min_cbm_bits: need(row.host_min_cbm_bits, "host_min_cbm_bits")?,
        shareable_bits: need(row.host_shareable_bits, "host_shareable_bits")?,
    };
    Ok(Some(LogHeader {
        version: DECISION_LOG_VERSION,
        policy: row.policy.clone(),
        simulated: row.simulated,
        host,
        tunables,
    }))
}

fn observed(row: &Flat) -> Result<ServiceObservation, Bad> {
    let class = match (row.class.as_str(), row.target_ms) {
        (LATENCY_CRITICAL, Some(p99_target_ms)) => ServiceClass::LatencyCritical { p99_target_ms },
        (LATENCY_CRITICAL, None) => {
            return Err((
                "target_ms",
                "null for a latency-critical service".to_string(),
            ))
        }
        _ => ServiceClass::BestEffort,
    };
    Ok(ServiceObservation {
        spec: ServiceSpec {
            name: row.service.clone(),
            class,
            gpu: row.gpu,
            priority: row.priority,
        },
        sample: Sample {
            ipc: row.ipc,
            llc_misses_per_s: row.llc_misses_per_s,
            llc_occupancy_bytes: row.llc_occupancy_bytes,
            mem_bw_bytes_per_s: row.mem_bw_bytes_per_s,
            cpu_busy_cores: row.cpu_busy_cores,
            memory_bytes: row.memory_bytes,
            gpu_util_pct: row.gpu_util_pct,
            gpu_memory_bytes: row.gpu_memory_bytes,
            gpu_memory_total_bytes: row.gpu_memory_total_bytes,
            p99_ms: row.p99_ms,
            requests_per_s: row.requests_per_s,
            p99_intervals: row.p99_intervals,
        },
        gpu_mps_effective_pct: row.gpu_mps_effective_pct,
    })
}

fn prediction(row: &Flat) -> Option<Prediction> {
    let prior = match (row.prior_log_qos_ratio, row.prior_log_qos_sigma) {
        (Some(log_qos_ratio), Some(log_qos_sigma)) => Some(Estimate {
            log_qos_ratio,
            log_qos_sigma,
        }),
        _ => None,
    };
    let posterior = match (
        row.posterior_log_qos_ratio,
        row.posterior_log_qos_sigma,
        row.posterior_samples,
    ) {
        (Some(log_qos_ratio), Some(log_qos_sigma), Some(samples)) => Some(PosteriorEstimate {
            log_qos_ratio,
            log_qos_sigma,
            samples,
        }),
        _ => None,
    };
    Some(Prediction {
        log_qos_ratio: row.pred_log_qos_ratio?,
        log_qos_sigma: row.pred_log_qos_sigma?,
        prior,
        posterior,
    })
}

fn reason(row: &Flat) -> Result<Option<Reason>, Bad> {
    let Some(path) = &row.reason_path else {
        return Ok(None);
    };
    let path = DecisionPath::ALL
        .into_iter()
        .find(|p| p.name() == path)
        .ok_or(("reason_path", format!("unknown decision path {path:?}")))?;
    Ok(Some(Reason::new(
        path,
        row.reason_text.clone().unwrap_or_default(),
    )))
}

fn group_control(row: &Flat) -> Result<Option<GroupControl>, Bad> {
    let Some(pids) = &row.control_pids else {
        return Ok(None);
    };
    let mut resources = BTreeMap::new();
    for r in Resource::ALL {
        let (kind, why) = row.control(r);
        let why = || why.unwrap_or_default().to_string();
        let c = match kind {
            None => continue,
            Some("in_place") => Control::InPlace,
            Some("moved") => Control::Moved,
            Some("partial") => Control::Partial { why: why() },
            Some("unmanaged") => Control::Unmanaged { why: why() },
            Some(other) => return Err(("control_*", format!("unknown control {other:?} for {r}"))),
        };
        resources.insert(r, c);
    }
    Ok(Some(GroupControl {
        pids: pids.iter().copied().collect(),
        resources,
    }))
}

fn apply(row: &Flat) -> Result<Option<ApplyOutcome>, Bad> {
    Ok(match row.apply.as_deref() {
        None => None,
        Some("dry_run") => Some(ApplyOutcome::DryRun),
        Some("refused") => Some(ApplyOutcome::Refused {
            error: row.apply_error.clone().unwrap_or_default(),
        }),
        Some(other) => return Err(("apply", format!("unknown outcome {other:?}"))),
    })
}
