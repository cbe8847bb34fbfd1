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

/// One control interval: collect, decide, apply the difference, and return the record.
/// A plan the host rejects is noted in the record's reasons (key `apply`) and the host
/// keeps its last good state.
pub fn step<H: ControlledHost>(
    host: &mut H,
    policy: &mut dyn Policy,
    dry_run: bool,
) -> Result<DecisionRecord, LoopError> {
    let observation = host
        .collect()
        .map_err(|e| LoopError::Collect(Box::new(e)))?;
    let started = Instant::now();
    let decision = policy.decide(&observation, observation.t_ms);
    let decision_us = started.elapsed().as_secs_f64() * 1e6;
    let mut changes = observation.current.diff(&decision.plan);
    let mut reasons = decision.reasons;
    let mut plan = decision.plan;
    if dry_run {
        if !changes.is_empty() {
            reasons.insert("apply".into(), "dry run: nothing written".into());
        }
    } else if !changes.is_empty() {
        if let Err(e) = host.apply(&plan, &changes) {
            tracing::warn!(policy = policy.name(), error = %e, "plan not applied; keeping the last good state");
            reasons.insert("apply".into(), format!("not applied: {e}"));
            plan = observation.current.clone();
            changes.clear();
        }
    }
    Ok(DecisionRecord {
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
    })
}

/// Runs `ticks` control intervals back to back (the simulator's pace). Each record is
/// handed to `sink` as soon as it exists.
pub fn run<H: ControlledHost>(
    host: &mut H,
    policy: &mut dyn Policy,
    ticks: u64,
    mut sink: impl FnMut(DecisionRecord) -> std::io::Result<()>,
) -> Result<(), LoopError> {
    for _ in 0..ticks {
        sink(step(host, policy, false)?)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use cohabit_core::Observation;
    use cohabit_sim::Scenario;

    use super::*;
    use crate::policy::{Decision, HostContext, StaticPolicy};

    /// Asks for one core too many every other tick.
    struct Greedy(StaticPolicy, u32);

    impl Policy for Greedy {
        fn name(&self) -> &'static str {
            "greedy"
        }
        fn initial(&mut self) -> Decision {
            self.0.initial()
        }
        fn decide(&mut self, obs: &Observation, now_ms: u64) -> Decision {
            self.1 += 1;
            let mut d = self.0.decide(obs, now_ms);
            if self.1.is_multiple_of(2) {
                d.plan.best_effort.cores += 1;
            }
            d
        }
    }

    #[test]
    fn a_rejected_plan_is_recorded_and_the_host_keeps_its_last_good_state() {
        let sc = Arc::new(Scenario::load("demo").unwrap());
        let ctx = HostContext {
            host: sc.capacity().clone(),
            specs: sc.specs(),
        };
        let mut policy = Greedy(StaticPolicy::new(ctx), 0);
        let initial = policy.initial().plan;
        let mut host = SimulatedHost::launch(Arc::clone(&sc), &initial, None).unwrap();
        let mut records = Vec::new();
        run(&mut host, &mut policy, 6, |r| {
            records.push(r);
            Ok(())
        })
        .unwrap();
        assert_eq!(records.len(), 6, "the loop went on");
        for (k, r) in records.iter().enumerate() {
            assert_eq!(
                r.observation.current, initial,
                "tick {k}: host kept the good plan"
            );
            assert_eq!(r.plan, initial);
            assert!(r.changes.is_empty());
            let rejected = r.reasons.get("apply").is_some_and(|m| m.contains("cores"));
            assert_eq!(rejected, k % 2 == 1, "tick {k}: {:?}", r.reasons);
        }
    }
}
