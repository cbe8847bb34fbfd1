//! The control loop: collect, decide, apply the difference, record.
//!
//! Whatever the policy, the plan gets each GPU client's pinned device-memory limit by one
//! rule ([`crate::gpu_memory`]) before it is applied and recorded; a plan that changes only
//! those limits is still handed to the host (with no changes), which keeps them for the
//! clients' next start.
//!
//! The loop is the same for the simulator and a real host: it only sees the
//! [`Collector`] and [`Actuator`] traits. A rejected plan is recorded as the record's
//! [`ApplyOutcome`] and the host keeps its last good state; the loop goes on.

use std::time::Instant;

use cohabit_core::{Actuator, ApplyOutcome, Collector, DecisionRecord, DECISION_SCHEMA_VERSION};

use crate::{gpu_memory, Policy};

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
    // Every policy's plan gets the GPU clients' pinned-memory limits by one rule.
    let mut plan = gpu_memory::with_pinned_plan(decision.plan, &observation);
    let mut changes = observation.current.diff(&plan);
    let mut apply = None;
    if changes.is_empty() && plan.gpu_memory_mib == observation.current.gpu_memory_mib {
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

    const GIB: f64 = (1u64 << 30) as f64;

    /// A host that refuses plans beyond its capacity, as a real one does.
    struct Host {
        cap: HostCapacity,
        spec: ServiceSpec,
        plan: Plan,
        t_ms: u64,
        /// Device memory the service is measured using on a 40 GiB GPU.
        gpu_memory_bytes: Option<f64>,
        /// Plans applied.
        applies: u32,
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
                        gpu_memory_bytes: self.gpu_memory_bytes,
                        gpu_memory_total_bytes: self.gpu_memory_bytes.map(|_| 40.0 * GIB),
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
            self.applies += 1;
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
            gpu_memory_bytes: None,
            applies: 0,
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

    #[test]
    fn the_plan_carries_gpu_clients_pinned_limits_and_a_change_of_them_reaches_the_host() {
        let ctx = crate::tests::ctx(1, false, false, 1);
        let mut policy = StaticPolicy::new(ctx.clone());
        let initial = policy.initial().plan;
        let mut host = Host {
            cap: ctx.host.clone(),
            spec: ctx.specs[0].clone(),
            plan: initial,
            t_ms: 0,
            gpu_memory_bytes: Some(8.0 * GIB),
            applies: 0,
        };
        let first = step(&mut host, &mut policy, false).unwrap();
        // 8 GiB measured + 25 % headroom.
        assert_eq!(first.plan.gpu_memory_mib.get("lc0"), Some(&10_240));
        assert!(first.changes.is_empty(), "no allocation changed");
        assert_eq!(host.applies, 1, "a change of limits alone reaches the host");
        assert_eq!(host.plan.gpu_memory_mib, first.plan.gpu_memory_mib);
        // Less memory used now: the limit in force stays, and nothing is applied again.
        host.gpu_memory_bytes = Some(GIB);
        let second = step(&mut host, &mut policy, false).unwrap();
        assert_eq!(
            second.observation.current.gpu_memory_mib,
            first.plan.gpu_memory_mib
        );
        assert_eq!(second.plan.gpu_memory_mib, first.plan.gpu_memory_mib);
        assert_eq!((host.applies, second.apply.clone()), (1, None));
        // More: the new limit is planned; a dry run records it without applying.
        host.gpu_memory_bytes = Some(16.0 * GIB);
        let third = step(&mut host, &mut policy, true).unwrap();
        assert_eq!(third.plan.gpu_memory_mib.get("lc0"), Some(&20_480));
        assert_eq!((host.applies, third.apply), (1, Some(ApplyOutcome::DryRun)));
    }
}
