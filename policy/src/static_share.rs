//! `static`: a fair share fixed at start, never changed. The unmanaged baseline.
//!
//! Overload (docs/DESIGN.md 5): it has no feedback, so the rule shows only in how the split
//! is made: the remainders of the fair split (a core or a way more for some services) go to
//! higher-`priority` services first (configuration order among equals), and every
//! latency-critical service keeps at least one core while the best-effort pool may be left
//! with none.

use std::collections::BTreeMap;

use cohabit_core::{DecisionPath, Observation, Reason, MBA_MAX_PCT};

use super::{fair_shares, layout, Decision, HostContext, Policy, Share};

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

    /// Fair shares with the remainders moved to higher-priority services: the same amounts,
    /// dealt out largest first in overload order. Ways are dealt only among the services
    /// with a range of their own (the others take the pool's).
    pub fn shares(&self) -> BTreeMap<String, Share> {
        let mut shares = fair_shares(&self.ctx);
        let mut order: Vec<(&str, i32)> = self
            .ctx
            .latency_critical()
            .map(|s| (s.name.as_str(), s.priority))
            .collect();
        order.sort_by_key(|p| std::cmp::Reverse(p.1));
        let mut cores: Vec<u32> = shares.values().map(|s| s.cores).collect();
        cores.sort_unstable_by_key(|c| std::cmp::Reverse(*c));
        for ((name, _), c) in order.iter().zip(cores) {
            if let Some(s) = shares.get_mut(*name) {
                s.cores = c;
            }
        }
        let own: Vec<&str> = order
            .iter()
            .map(|(n, _)| *n)
            .filter(|n| !self.ctx.shares_pool_group(n))
            .collect();
        let mut ways: Vec<u32> = own
            .iter()
            .filter_map(|n| shares.get(*n))
            .map(|s| s.ways)
            .collect();
        ways.sort_unstable_by_key(|w| std::cmp::Reverse(*w));
        for (name, w) in own.iter().zip(ways) {
            if let Some(s) = shares.get_mut(*name) {
                s.ways = w;
            }
        }
        shares
    }

    fn decision(&self) -> Decision {
        let plan = layout(&self.ctx, &self.shares(), MBA_MAX_PCT);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::ctx;

    #[test]
    fn remainders_go_to_higher_priority_services_first() {
        // 40 cores over 5 LC services and the pool: 7, 7, 7, 7, 6 (and 6 for the pool);
        // 17 of the 20 ways for the services: 4, 4, 3, 3, 3, in configuration order.
        let mut c = ctx(5, true, false, 0);
        c.host.cores = 40;
        let plain = StaticPolicy::new(c.clone()).shares();
        assert_eq!(plain["lc0"].cores, 7);
        assert_eq!(plain["lc4"].cores, 6);
        assert_eq!(plain["lc4"].ways, 3);
        c.specs[4].priority = 2;
        c.specs[3].priority = 1;
        let s = StaticPolicy::new(c.clone()).shares();
        assert_eq!((s["lc4"].cores, s["lc4"].ways), (7, 4), "{s:?}");
        assert_eq!(s["lc3"].ways, 4, "{s:?}");
        // Same amounts in total: only who gets the remainder changed.
        let total = |m: &BTreeMap<String, Share>| -> (u32, u32) {
            m.values()
                .fold((0, 0), |(c, w), s| (c + s.cores, w + s.ways))
        };
        assert_eq!(total(&s), total(&plain));
        let plan = StaticPolicy::new(c.clone()).initial().plan;
        plan.validate(&c.host, &c.specs).unwrap();
        assert_eq!(plan.best_effort.mba_pct, MBA_MAX_PCT);
    }

    #[test]
    fn every_service_keeps_a_core_and_the_pool_is_left_with_none_first() {
        let mut c = ctx(4, true, false, 0);
        c.host.cores = 4;
        let plan = StaticPolicy::new(c.clone()).initial().plan;
        assert!(plan.services.values().all(|a| a.cores >= 1));
        assert_eq!(plan.best_effort.cores, 0);
        plan.validate(&c.host, &c.specs).unwrap();
    }
}
