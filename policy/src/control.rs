//! The control loop: collect, decide, apply the difference, record.
//!
//! The loop is the same for the simulator and a real host: it only sees the
//! [`Collector`] and [`Actuator`] traits. A rejected plan is recorded as the record's
//! [`ApplyOutcome`] and the host keeps its last good state; the loop goes on.

use std::time::Instant;

use cohabit_core::{Actuator, ApplyOutcome, Collector, DecisionRecord, DECISION_SCHEMA_VERSION};

use crate::Policy;

/// A host the loop can drive: anything that collects and applies.
pub trait ControlledHost: Collector + Actuator {}

impl<H: Collector + Actuator> ControlledHost for H {}

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
/// A plan the host rejects is noted in the record's `apply` outcome and the host keeps its
/// last good state.
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
    let mut plan = decision.plan;
    let mut apply = None;
    if changes.is_empty() {
        // Nothing to write.
    } else if dry_run {
        apply = Some(ApplyOutcome::DryRun);
    } else if let Err(e) = host.apply(&plan, &changes) {
        tracing::warn!(policy = policy.name(), error = %e, "plan not applied; keeping the last good state");
        apply = Some(ApplyOutcome::Refused {
            error: e.to_string(),
        });
        plan = observation.current.clone();
        changes.clear();
    }
    Ok(DecisionRecord {
        schema_version: DECISION_SCHEMA_VERSION,
        policy: policy.name().to_string(),
        simulated: host.simulated(),
        truth: host.ground_truth(),
        observation,
        plan,
        changes,
        reasons: decision.reasons,
        apply,
        decision_us,
        predictions: decision.predictions,
        from_pods: Default::default(),
        control: Default::default(),
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
    use cohabit_core::{
        CoreError, HostCapacity, Observation, Plan, Sample, ServiceClass, ServiceObservation,
        ServiceSpec,
    };

    use super::*;
    use crate::{Decision, StaticPolicy};

    /// A host that refuses plans beyond its capacity, as a real one does.
    struct Host {
        cap: HostCapacity,
        spec: ServiceSpec,
        plan: Plan,
        t_ms: u64,
    }

    impl Collector for Host {
        type Error = CoreError;
        fn collect(&mut self) -> Result<Observation, CoreError> {
            self.t_ms += 1000;
            Ok(Observation {
                t_ms: self.t_ms,
                services: vec![ServiceObservation {
                    spec: self.spec.clone(),
                    sample: Sample {
                        p99_ms: Some(0.5),
                        ..Sample::default()
                    },
                    gpu_mps_effective_pct: None,
                }],
                current: self.plan.clone(),
            })
        }
    }

    impl Actuator for Host {
        type Error = CoreError;
        fn apply(&mut self, plan: &Plan, _: &[cohabit_core::Change]) -> Result<(), CoreError> {
            plan.validate(&self.cap, std::slice::from_ref(&self.spec))?;
            self.plan = plan.clone();
            Ok(())
        }
    }

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
        let ctx = crate::tests::ctx(1, true, false, 0);
        let mut policy = Greedy(StaticPolicy::new(ctx.clone()), 0);
        let initial = policy.initial().plan;
        let mut host = Host {
            cap: ctx.host.clone(),
            spec: ctx.specs[0].clone(),
            plan: initial.clone(),
            t_ms: 0,
        };
        assert!(matches!(
            host.spec.class,
            ServiceClass::LatencyCritical { .. }
        ));
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
            assert!(!r.simulated && r.truth.is_none());
            let rejected = matches!(&r.apply, Some(ApplyOutcome::Refused { error }) if error.contains("cores"));
            assert_eq!(rejected, k % 2 == 1, "tick {k}: {:?}", r.apply);
        }
    }
}
