//! `static`: a fair share fixed at start, never changed. The unmanaged baseline.

use std::collections::BTreeMap;

use cohabit_core::{DecisionPath, Observation, Reason, MBA_MAX_PCT};

use super::{fair_shares, layout, Decision, HostContext, Policy};

/// Every group (each latency-critical service, the best-effort pool) gets an equal share of
/// cores, LLC ways and GPU, once.
#[derive(Debug, Clone)]
pub struct StaticPolicy {
    ctx: HostContext,
}

impl StaticPolicy {
    /// A static fair share of the host in `ctx`.
    pub fn new(ctx: HostContext) -> Self {
        Self { ctx }
    }

    fn decision(&self) -> Decision {
        let plan = layout(&self.ctx, &fair_shares(&self.ctx), MBA_MAX_PCT);
        let reasons = plan
            .groups()
            .map(|(g, _)| {
                (
                    g.to_string(),
                    Reason::new(DecisionPath::Static, "fair share"),
                )
            })
            .collect::<BTreeMap<_, _>>();
        Decision::new(plan, reasons)
    }
}

impl Policy for StaticPolicy {
    fn name(&self) -> &'static str {
        "static"
    }

    fn initial(&mut self) -> Decision {
        self.decision()
    }

    fn decide(&mut self, _obs: &Observation, _now_ms: u64) -> Decision {
        self.decision()
    }
}
