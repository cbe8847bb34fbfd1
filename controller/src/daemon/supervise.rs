//! What keeps the control loop safe when the policy or a tick misbehaves (security review
//! row 14):
//!
//! - [`Checked`]: every plan is checked against the host ([`Plan::validate`]) before it
//!   reaches the kernel; a plan that does not fit is refused like any other refusal
//!   ([`ApplyOutcome::Refused`](cohabit_core::ApplyOutcome) in the record) and the last good
//!   one stays in force.
//! - [`FailSafe`]: after N consecutive ticks that did not put their plan in force (collection
//!   failed, the tick overran or found the previous one still running, or the plan was
//!   refused), the policy's fair-share initial plan is applied, once per N.
//! - [`panic_message`]: what a tick that panicked said, for the log line before the daemon
//!   restores the host and exits non-zero.

use cohabit_core::{
    Actuator, Change, Collector, CoreError, GroundTruth, HostCapacity, Observation, Plan,
    ServiceSpec,
};

use cohabit_host::{HostError, RealHost};

/// Why the loop's host did not apply a plan.
#[derive(Debug, thiserror::Error)]
pub enum ApplyError<E: std::error::Error + 'static> {
    /// The plan does not fit the host; nothing was written.
    #[error("plan refused before applying: {0}")]
    Invalid(CoreError),
    /// The host refused it (and kept its state).
    #[error(transparent)]
    Host(E),
}

/// A host as the loop drives it: plans are validated against its capacity and its services
/// before they are applied.
#[derive(Debug)]
pub struct Checked<H> {
    host: H,
    capacity: HostCapacity,
    specs: Vec<ServiceSpec>,
}

impl<H> Checked<H> {
    /// Wraps `host`, which has `capacity` and runs `specs`.
    pub fn new(host: H, capacity: HostCapacity, specs: Vec<ServiceSpec>) -> Self {
        Self {
            host,
            capacity,
            specs,
        }
    }

    /// The host inside.
    pub fn host(&self) -> &H {
        &self.host
    }

    /// The host inside, to restore it.
    pub fn host_mut(&mut self) -> &mut H {
        &mut self.host
    }

    /// Checks `plan` against the host.
    pub fn validate(&self, plan: &Plan) -> Result<(), CoreError> {
        plan.validate(&self.capacity, &self.specs)
    }
}

impl Checked<RealHost> {
    /// Wraps the real host, checking plans against what it offers now.
    pub fn real(host: RealHost) -> Self {
        let (capacity, specs) = (host.capacity().clone(), host.specs());
        Self::new(host, capacity, specs)
    }

    /// Checks plans against what the host offers from now on (after its services or CPUs
    /// changed: pods came or went).
    pub fn refresh(&mut self) {
        self.capacity = self.host.capacity().clone();
        self.specs = self.host.specs();
    }

    /// Applies the first plan (checked) and starts managing processes.
    pub fn launch(&mut self, plan: &Plan) -> Result<(), ApplyError<HostError>> {
        self.validate(plan).map_err(ApplyError::Invalid)?;
        self.host.launch(plan).map_err(ApplyError::Host)
    }
}

impl<H: Collector> Collector for Checked<H> {
    type Error = H::Error;

    fn collect(&mut self) -> Result<Observation, H::Error> {
        self.host.collect()
    }

    fn simulated(&self) -> bool {
        self.host.simulated()
    }

    fn ground_truth(&self) -> Option<GroundTruth> {
        self.host.ground_truth()
    }
}

impl<H: Actuator> Actuator for Checked<H> {
    type Error = ApplyError<H::Error>;

    fn apply(&mut self, plan: &Plan, changes: &[Change]) -> Result<(), Self::Error> {
        self.validate(plan).map_err(ApplyError::Invalid)?;
        self.host.apply(plan, changes).map_err(ApplyError::Host)
    }
}

/// Counts consecutive failed ticks and says when the fair-share plan is due.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailSafe {
    after: u32,
    failed: u32,
}

impl FailSafe {
    /// A fail-safe that fires after `after` consecutive failures (at least 1).
    pub fn new(after: u32) -> Self {
        Self {
            after: after.max(1),
            failed: 0,
        }
    }

    /// Notes one tick; returns true when the fair-share plan is due (every `after`
    /// consecutive failures; a success starts the count again).
    pub fn note(&mut self, ok: bool) -> bool {
        if ok {
            self.failed = 0;
            return false;
        }
        self.failed += 1;
        self.failed.is_multiple_of(self.after)
    }

    /// Consecutive failures so far.
    pub fn failed(&self) -> u32 {
        self.failed
    }
}

/// The text a panic carried (`panic!("...")` gives a `&str` or a `String`).
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

#[cfg(test)]
mod tests {
    use cohabit_core::{ApplyOutcome, Sample, ServiceClass, ServiceObservation};
    use cohabit_policy::{control, Decision, HostContext, Policy, StaticPolicy};

    use super::*;

    /// A host that takes any plan it is given (as a buggy kernel interface might) and counts
    /// the plans that reached it.
    struct Lax {
        specs: Vec<ServiceSpec>,
        plan: Plan,
        applied: usize,
    }

    impl Collector for Lax {
        type Error = CoreError;
        fn collect(&mut self) -> Result<Observation, CoreError> {
            Ok(Observation {
                t_ms: 0,
                services: self
                    .specs
                    .iter()
                    .map(|spec| ServiceObservation {
                        spec: spec.clone(),
                        sample: Sample::default(),
                        gpu_mps_effective_pct: None,
                    })
                    .collect(),
                current: self.plan.clone(),
            })
        }
    }

    impl Actuator for Lax {
        type Error = CoreError;
        fn apply(&mut self, plan: &Plan, _: &[Change]) -> Result<(), CoreError> {
            self.plan = plan.clone();
            self.applied += 1;
            Ok(())
        }
    }

    /// Gives the latency-critical service no core at all.
    struct Starve(StaticPolicy);

    impl Policy for Starve {
        fn name(&self) -> &'static str {
            "starve"
        }
        fn initial(&mut self) -> Decision {
            self.0.initial()
        }
        fn decide(&mut self, obs: &Observation, now_ms: u64) -> Decision {
            let mut d = self.0.decide(obs, now_ms);
            for a in d.plan.services.values_mut() {
                a.cores = 0;
            }
            d
        }
    }

    fn ctx() -> HostContext {
        HostContext {
            host: HostCapacity {
                name: "t".into(),
                cores: 4,
                freq_ghz: 2.0,
                llc_ways: 12,
                llc_way_bytes: 1 << 20,
                mem_bw_bytes_per_s: 20e9,
                gpus: vec![],
                closids: 16,
                mba_min_pct: 10,
                mba_gran_pct: 10,
                min_cbm_bits: 1,
                shareable_bits: 0,
            },
            specs: vec![
                ServiceSpec {
                    name: "kv".into(),
                    class: ServiceClass::LatencyCritical { p99_target_ms: 1.0 },
                    gpu: None,
                    priority: 0,
                },
                ServiceSpec {
                    name: "batch".into(),
                    class: ServiceClass::BestEffort,
                    gpu: None,
                    priority: 0,
                },
            ],
        }
    }

    #[test]
    fn a_plan_giving_a_latency_critical_service_no_core_is_refused_before_the_host_sees_it() {
        let ctx = ctx();
        let mut policy = Starve(StaticPolicy::new(ctx.clone()));
        let fair = policy.initial().plan;
        let lax = Lax {
            specs: ctx.specs.clone(),
            plan: fair.clone(),
            applied: 0,
        };
        let mut host = Checked::new(lax, ctx.host.clone(), ctx.specs.clone());
        let rec = control::step(&mut host, &mut policy, false).unwrap();
        let Some(ApplyOutcome::Refused { error }) = &rec.apply else {
            panic!("applied: {:?}", rec.apply);
        };
        assert_eq!(rec.plan, fair, "the last good plan stays in force");
        assert_eq!(host.host().applied, 0, "nothing reached the host");
        // The refusal is the check's, for the starved service's cores, and the record
        // carries its message.
        let starved = policy.decide(&rec.observation, rec.observation.t_ms).plan;
        let Err(refusal) = host.apply(&starved, &[]) else {
            panic!("a plan with no core for kv was applied");
        };
        let ApplyError::Invalid(CoreError::Invalid { field, problem }) = &refusal else {
            panic!("refused by the host, not by the check: {refusal}");
        };
        assert_eq!(field, "plan.kv.cores");
        assert!(problem.contains("at least one core"), "{problem}");
        assert_eq!(error, &refusal.to_string());
        assert_eq!(host.host().applied, 0, "nothing reached the host");
        // A plan that fits goes through.
        let mut fine = StaticPolicy::new(ctx.clone());
        let mut next = fine.initial().plan;
        next.best_effort.cores -= 1;
        host.apply(&next, &[]).unwrap();
        assert_eq!(host.host().applied, 1);
    }

    #[test]
    fn the_fail_safe_fires_after_n_consecutive_failures_and_again_every_n() {
        let mut f = FailSafe::new(3);
        assert!(!f.note(false) && !f.note(false));
        assert!(!f.note(true), "a success starts the count again");
        assert_eq!(f.failed(), 0);
        assert!(!f.note(false) && !f.note(false));
        assert!(f.note(false), "third in a row");
        assert!(!f.note(false) && !f.note(false));
        assert!(f.note(false), "and again after three more");
        assert_eq!(f.failed(), 6);
    }

    #[test]
    fn a_fail_safe_of_zero_fires_on_every_failure() {
        let mut f = FailSafe::new(0);
        assert!(f.note(false) && f.note(false));
    }

    #[test]
    fn panic_messages_are_read_from_either_payload() {
        let s = std::panic::catch_unwind(|| panic!("static text")).unwrap_err();
        assert_eq!(panic_message(s.as_ref()), "static text");
        let n = 7;
        let s = std::panic::catch_unwind(|| panic!("formatted {n}")).unwrap_err();
        assert_eq!(panic_message(s.as_ref()), "formatted 7");
    }
}
