//! The control loop: collect, decide, apply the difference, record.
//!
//! The loop is the same for the simulator and (later) a real host: it only sees the
//! [`Collector`] and [`Actuator`] traits. A rejected plan is logged in the record's reasons
//! and the host keeps its last good state; the loop goes on.

use std::time::Instant;

use cohabit_core::{Actuator, Collector, DecisionRecord, GroundTruth, DECISION_SCHEMA_VERSION};
use cohabit_sim::SimulatedHost;

use crate::policy::Policy;

/// A host the loop can drive.
pub trait ControlledHost: Collector + Actuator {
    /// True for the simulator; copied into every record.
    fn simulated(&self) -> bool;
    /// The truth of the interval last collected, where the host knows it.
    fn ground_truth(&self) -> Option<GroundTruth>;
}

impl ControlledHost for SimulatedHost {
    fn simulated(&self) -> bool {
        true
    }

    fn ground_truth(&self) -> Option<GroundTruth> {
        self.last_truth().cloned()
    }
}

/// Why the loop stopped early.
#[derive(Debug, thiserror::Error)]
pub enum LoopError {
    /// Telemetry could not be collected at all.
    #[error("collecting telemetry: {0}")]
    Collect(Box<dyn std::error::Error + Send + Sync>),
    /// The record could not be written.
    #[error("writing the decision log: {0}")]
    Sink(#[from] std::io::Error),
}

/// Runs `ticks` control intervals. Each record is handed to `sink` as soon as it exists.
pub fn run<H: ControlledHost>(
    host: &mut H,
    policy: &mut dyn Policy,
    ticks: u64,
    mut sink: impl FnMut(DecisionRecord) -> std::io::Result<()>,
) -> Result<(), LoopError> {
    for _ in 0..ticks {
        let observation = host
            .collect()
            .map_err(|e| LoopError::Collect(Box::new(e)))?;
        let started = Instant::now();
        let decision = policy.decide(&observation, observation.t_ms);
        let decision_us = started.elapsed().as_secs_f64() * 1e6;
        let mut changes = observation.current.diff(&decision.plan);
        let mut reasons = decision.reasons;
        let mut plan = decision.plan;
        if !changes.is_empty() {
            if let Err(e) = host.apply(&plan, &changes) {
                tracing::warn!(policy = policy.name(), error = %e, "plan not applied; keeping the last good state");
                reasons.insert("apply".into(), format!("not applied: {e}"));
                plan = observation.current.clone();
                changes.clear();
            }
        }
        let record = DecisionRecord {
            schema_version: DECISION_SCHEMA_VERSION,
            policy: policy.name().to_string(),
            simulated: host.simulated(),
            truth: host.ground_truth(),
            observation,
            plan,
            changes,
            reasons,
            decision_us,
            predictions: decision.predictions,
        };
        sink(record)?;
    }
    Ok(())
}
