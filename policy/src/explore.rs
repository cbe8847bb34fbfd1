//! Safe exploration: a [`Policy`] wrapper that varies the base policy's plan a little, so
//! that the host teaches a model what nearby allocations do there (`cohabit run
//! --explore`): `ml`'s per-host posterior online, any policy's decision logs offline.
//!
//! Problem: a model learned from a host's own readings only sees the allocations its policy
//! chose, which sit where that policy settles: a policy whose model is pessimistic about a
//! smaller allocation never tries it, so it never learns otherwise (issue 45;
//! docs/EXPERIMENTS.md has the runs on the project's VM). Learning what one core or one
//! way less does needs those allocations tried, and trying them must never cost a service
//! its target.
//!
//! Approach: around `ml` (with its posterior), the informative safe step of SafeOpt (Sui et
//! al., ICML 2015): among the steps that free a core or a way for best effort, those `ml`'s
//! model with its posterior predicts safe with high confidence (upper confidence bound of
//! ln(p99/target) at most ln(1 - margin)), the one whose reading teaches the posterior
//! most about where best effort can grow ([`informative`] says which rule and why).
//! Around a policy without a model (`static`, `parties`, `clite`: nothing predicts safety
//! or information there), or when asked for ([`ExploreRule::Walk`]), a bounded random walk
//! around the plan. Either only while every latency-critical service is measured well
//! under its target, and abandoned for good at the first violation it may have caused.
//!
//! Algorithm, each tick:
//! 1. The base policy decides as if alone (it sees every observation; its state stays its
//!    own).
//! 2. **Stop.** If the plan in force still holds an allocation exploration set (returned as
//!    explored, or kept since by a base policy that holds what is in force, as `ml`'s
//!    fallback and hysteresis do), and any latency-critical service measured a p99 over its
//!    target, exploration ends for the rest of the run: the base plan is returned from now
//!    on, and the reason is logged once.
//! 3. **Gate.** Unless every latency-critical service has a p99 reading at most
//!    `(1 - margin) × target`, the walk is reset and the base plan is returned unchanged.
//! 4. **Informative step** (around `ml`): at most one every `settle_ticks + 1` ticks, one
//!    CPU service one core fewer, one way fewer, or on the pool's ways (shared) instead of
//!    its own, from `ml`'s plan, chosen as [`informative`] says; `ml` then remembers its
//!    prediction for the allocation put in force, so the next reading teaches its
//!    posterior there. No step when none is predicted safe or would teach enough. `ml`'s
//!    hysteresis keeps a step measured within its margin, so steps add up while they
//!    stay safe; `ml` takes back one it would not have taken.
//! 4. **Walk step** (otherwise): one random step: a random CPU service, a random resource
//!    (cores; LLC ways where the host has more than one and the service has a way range of
//!    its own; MBA steps when enabled), one unit up or down. The walk's offset from the base
//!    plan stays within `max_*` units per service and resource, and never takes a service
//!    below `min_cores`, `min_ways` or the host's MBA minimum; cores come from and go to
//!    the best-effort pool, ways are laid out again with [`crate::layout`]. A step that
//!    does not fit (no free core, no way to spare) is not taken.
//! 5. The explored plan is checked against the host; the groups it changed carry a
//!    [`DecisionPath::Explore`] reason naming the step and the base policy's reason, and
//!    lose the base policy's prediction (it was for another allocation; an informative
//!    step's service carries `ml`'s prediction for the step instead).
//!
//! Properties (tested below): it never explores while a service is inside the margin or
//! unmeasured; it stops at the first violation under an allocation it set, also one a
//! holding base policy kept, and never explores again; every plan it returns is valid for
//! the host; with the gate closed it returns exactly the base policy's decision; an
//! informative step is never one whose upper bound exceeds the margin, and none is taken
//! when nothing is predicted safe. The walk's randomness comes from a seeded generator, so
//! a run is reproducible (the informative rule draws nothing).

use std::collections::BTreeMap;
use std::sync::Arc;

use cohabit_core::{
    Allocation, DecisionPath, Observation, Plan, Reason, BEST_EFFORT_GROUP, MBA_MAX_PCT,
};
use cohabit_models::posterior::PosteriorSet;
use cohabit_models::Model;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::{
    downcast, is, layout, shares_of, unchanged_services, Adopted, AsAny, Decision, HostContext,
    MlPolicy, Policy,
};

mod informative;

/// How far and when exploration may go.
#[derive(Debug, Clone, PartialEq)]
pub struct ExploreConfig {
    /// Explore only while every latency-critical service's p99 is at most
    /// `(1 - margin) × target` (0.3: 30 % under its target).
    pub margin: f64,
    /// Most cores the walk moves a service from the base plan, either way.
    pub max_cores: u32,
    /// Most LLC ways the walk moves a service from the base plan, either way.
    pub max_ways: u32,
    /// Most MBA steps (of the host's granularity) the walk moves a service; 0 leaves MBA
    /// alone (a host without MBA ignores it, and its rows would teach nothing).
    pub max_mba_steps: u32,
    /// Fewest cores the walk leaves a service.
    pub min_cores: u32,
    /// Fewest LLC ways the walk leaves a service.
    pub min_ways: u32,
    /// Seed of the walk.
    pub seed: u64,
    /// How steps are chosen around a base policy that has a model with a posterior (`ml`).
    pub rule: ExploreRule,
    /// Confidence of the informative step's safety test: a step is safe when
    /// `mean + beta * sigma` of ln(p99/target) is at most ln(1 - margin) (`sigma` the
    /// spread of the value, not of one noisy reading of it).
    pub beta: f64,
    /// Least share of some growth point's posterior variance a step's reading must remove
    /// for the informative step to be taken.
    pub min_information: f64,
    /// Ticks the informative rule waits after a step before the next (the step's reading
    /// arrives a tick later, and the base policy answers it).
    pub settle_ticks: u32,
}

/// How [`Explore`] chooses its steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExploreRule {
    /// Around `ml` (with its posterior): the safe step that teaches the posterior most
    /// about where best effort can grow ([`informative`]). Around a policy without a model
    /// (`static`, `parties`, `clite`) there is nothing to predict safety or information
    /// with: the random walk.
    #[default]
    Informative,
    /// The bounded random walk, whatever the base policy.
    Walk,
}

impl Default for ExploreConfig {
    fn default() -> Self {
        Self {
            margin: 0.3,
            max_cores: 2,
            max_ways: 2,
            max_mba_steps: 0,
            min_cores: 1,
            min_ways: 1,
            seed: 1,
            rule: ExploreRule::Informative,
            beta: 2.0,
            min_information: 0.1,
            settle_ticks: 2,
        }
    }
}

impl ExploreConfig {
    /// Checks the settings; the error names the field.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.margin > 0.0 && self.margin < 1.0) {
            return Err(format!(
                "explore.margin must be between 0 and 1 (exclusive), not {}",
                self.margin
            ));
        }
        if self.min_cores == 0 {
            return Err("explore.min_cores must be at least 1".into());
        }
        if self.min_ways == 0 {
            return Err("explore.min_ways must be at least 1".into());
        }
        if !(self.beta.is_finite() && self.beta > 0.0) {
            return Err(format!(
                "explore.beta must be a positive number, not {}",
                self.beta
            ));
        }
        if !(0.0..=1.0).contains(&self.min_information) {
            return Err(format!(
                "explore.min_information must be between 0 and 1, not {}",
                self.min_information
            ));
        }
        if self.max_cores == 0 && self.max_ways == 0 && self.max_mba_steps == 0 {
            return Err("explore: max_cores, max_ways and max_mba_steps are all 0".into());
        }
        Ok(())
    }
}

/// A resource the walk moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Knob {
    Cores,
    Ways,
    Mba,
}

/// The walk's offset of one service from the base plan.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Offset {
    cores: i64,
    ways: i64,
    mba_steps: i64,
}

/// The base policy, explored around.
pub struct Explore {
    base: Box<dyn Policy>,
    ctx: HostContext,
    cfg: ExploreConfig,
    rng: ChaCha8Rng,
    offsets: BTreeMap<String, Offset>,
    /// Allocations the walk set, per latency-critical service, while they stay in force
    /// (whether returned as explored or kept since by a base policy that holds them).
    walk_set: BTreeMap<String, Allocation>,
    /// Why exploration ended, once it has.
    stopped: Option<String>,
    explored_ticks: u64,
    /// Ticks since the informative rule's last step.
    since_step: u32,
}

impl std::fmt::Debug for Explore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Explore")
            .field("base", &self.base.name())
            .field("cfg", &self.cfg)
            .field("offsets", &self.offsets)
            .field("stopped", &self.stopped)
            .finish_non_exhaustive()
    }
}

impl Explore {
    /// Explores around `base` on the host in `ctx`. `cfg` must be valid
    /// ([`ExploreConfig::validate`]).
    pub fn new(base: Box<dyn Policy>, ctx: HostContext, cfg: ExploreConfig) -> Self {
        let rng = ChaCha8Rng::seed_from_u64(cfg.seed);
        Self {
            base,
            ctx,
            cfg,
            rng,
            offsets: BTreeMap::new(),
            walk_set: BTreeMap::new(),
            stopped: None,
            explored_ticks: 0,
            since_step: u32::MAX,
        }
    }

    /// Whether steps are chosen by the informative rule: asked for, around `ml`.
    pub fn informative(&self) -> bool {
        self.cfg.rule == ExploreRule::Informative && is::<MlPolicy>(&*self.base)
    }

    /// The informative safe step around `base` ([`informative`]), or `base` itself.
    fn informative_step(&mut self, obs: &Observation, base: Decision) -> Decision {
        self.since_step = self.since_step.saturating_add(1);
        if self.since_step <= self.cfg.settle_ticks {
            return base;
        }
        let names = self.candidates();
        let Some(ml) = AsAny::as_any_mut(&mut *self.base).downcast_mut::<MlPolicy>() else {
            return base;
        };
        let Some(choice) = informative::choose(ml, &self.ctx, &self.cfg, obs, &base.plan, &names)
        else {
            return base;
        };
        // The posterior learns from the reading of what is really in force.
        let predictions =
            ml.record_explored(obs, &choice.plan, std::slice::from_ref(&choice.service));
        self.since_step = 0;
        self.explored_ticks += 1;
        for (name, a) in &choice.plan.services {
            if base.plan.services.get(name) != Some(a) {
                self.walk_set.insert(name.clone(), *a);
            }
        }
        let mut d = self.explored(&base, choice.plan, &choice.text);
        d.predictions.extend(predictions);
        d
    }

    /// Why exploration ended, once it has.
    pub fn stopped(&self) -> Option<&str> {
        self.stopped.as_deref()
    }

    /// Ticks whose plan was an explored one.
    pub fn explored_ticks(&self) -> u64 {
        self.explored_ticks
    }

    /// The first latency-critical service over its target, in words.
    fn violation(obs: &Observation) -> Option<String> {
        obs.latency_critical().find_map(|s| {
            let q = obs.qos_ratio(&s.spec.name)?;
            (q > 1.0).then(|| format!("{} measured p99 at {q:.2} of its target", s.spec.name))
        })
    }

    /// Why the gate is closed, or `None` when every service keeps its margin.
    fn gate(&self, obs: &Observation) -> Option<String> {
        let limit = 1.0 - self.cfg.margin;
        for s in obs.latency_critical() {
            match obs.qos_ratio(&s.spec.name) {
                None => return Some(format!("{} has no p99 reading", s.spec.name)),
                Some(q) if q > limit => {
                    return Some(format!(
                        "{} at {q:.2} of its target, inside the margin (over {limit:.2})",
                        s.spec.name
                    ))
                }
                Some(_) => {}
            }
        }
        None
    }

    /// The CPU latency-critical services the walk may move.
    fn candidates(&self) -> Vec<String> {
        self.ctx
            .latency_critical()
            .filter(|s| s.gpu.is_none())
            .map(|s| s.name.clone())
            .collect()
    }

    /// The knobs that can move `name` on this host.
    fn knobs(&self, name: &str) -> Vec<Knob> {
        let mut k = Vec::new();
        if self.cfg.max_cores > 0 {
            k.push(Knob::Cores);
        }
        let own_ways = !self.ctx.shares_pool_group(name);
        if self.cfg.max_ways > 0 && self.ctx.host.llc_ways > 1 && own_ways {
            k.push(Knob::Ways);
        }
        // A host without MBA offers 100 % only (`mba_min_pct` 100): no knob to walk.
        if self.cfg.max_mba_steps > 0 && self.ctx.host.mba_min_pct < MBA_MAX_PCT && own_ways {
            k.push(Knob::Mba);
        }
        k
    }

    /// `base` moved by every offset, or `None` when the offsets do not fit the host.
    fn walked(&self, base: &Plan) -> Option<Plan> {
        let mut plan = base.clone();
        let ways_moved = self.offsets.values().any(|o| o.ways != 0);
        if ways_moved {
            // Ways are laid out again; only a base plan in the canonical layout can be.
            let mut shares = shares_of(base);
            for (name, o) in &self.offsets {
                let s = shares.get_mut(name)?;
                s.ways = u32::try_from(i64::from(s.ways) + o.ways).ok()?;
                if s.ways < self.cfg.min_ways {
                    return None;
                }
            }
            let canonical = layout(&self.ctx, &shares_of(base), base.best_effort.mba_pct);
            if canonical != *base {
                return None;
            }
            let lc_ways: u32 = self
                .ctx
                .latency_critical()
                .enumerate()
                .filter(|(i, _)| *i < self.ctx.isolated_services())
                .filter_map(|(_, s)| shares.get(&s.name).map(|x| x.ways))
                .sum();
            let pool_ways = u32::from(self.ctx.has_cpu_best_effort());
            if lc_ways + pool_ways > self.ctx.host.llc_ways {
                return None;
            }
            plan = layout(&self.ctx, &shares, base.best_effort.mba_pct);
        }
        for (name, o) in &self.offsets {
            let a = plan.services.get_mut(name)?;
            let cores = i64::from(a.cores) + o.cores;
            let be = i64::from(plan.best_effort.cores) - o.cores;
            if cores < i64::from(self.cfg.min_cores) || be < 0 {
                return None;
            }
            a.cores = u32::try_from(cores).ok()?;
            plan.best_effort.cores = u32::try_from(be).ok()?;
            if o.mba_steps != 0 {
                let step = i64::from(self.ctx.host.mba_gran_pct);
                let mba = i64::from(a.mba_pct) + o.mba_steps * step;
                let lo = i64::from(self.ctx.host.mba_min_pct.max(10));
                if !(lo..=100).contains(&mba) {
                    return None;
                }
                a.mba_pct = u8::try_from(mba).ok()?;
            }
        }
        plan.validate(&self.ctx.host, &self.ctx.specs).ok()?;
        Some(plan)
    }

    /// One random step of the walk that fits: returns what it did, in words.
    fn step(&mut self, base: &Plan) -> Option<String> {
        let names = self.candidates();
        for _ in 0..8 {
            let name = names
                .get(self.rng.gen_range(0..names.len().max(1)))?
                .clone();
            let knobs = self.knobs(&name);
            let Some(&knob) = knobs.get(self.rng.gen_range(0..knobs.len().max(1))) else {
                continue;
            };
            let dir: i64 = if self.rng.gen_bool(0.5) { 1 } else { -1 };
            let before = self.offsets.get(&name).copied().unwrap_or_default();
            let mut after = before;
            let (field, bound, what) = match knob {
                Knob::Cores => (&mut after.cores, self.cfg.max_cores, "cores"),
                Knob::Ways => (&mut after.ways, self.cfg.max_ways, "LLC ways"),
                Knob::Mba => (&mut after.mba_steps, self.cfg.max_mba_steps, "MBA steps"),
            };
            let moved = *field + dir;
            if moved.abs() > i64::from(bound) {
                continue;
            }
            *field = moved;
            let offset_now = *field;
            self.offsets.insert(name.clone(), after);
            if self.walked(base).is_some() {
                return Some(format!(
                    "{name}: {what} {} one (walk offset {offset_now:+})",
                    if dir > 0 { "up" } else { "down" }
                ));
            }
            self.offsets.insert(name, before);
        }
        None
    }

    /// The base decision with the walk applied and the changed groups marked.
    fn explored(&self, base: &Decision, plan: Plan, step: &str) -> Decision {
        let mut reasons = base.reasons.clone();
        let mut predictions = base.predictions.clone();
        for (group, a) in plan.groups() {
            let base_alloc: Option<&Allocation> = base.plan.get(group);
            if base_alloc == Some(a) {
                continue;
            }
            let was = reasons
                .get(group)
                .map_or_else(|| "none".to_string(), ToString::to_string);
            let text = if group == BEST_EFFORT_GROUP {
                format!("{step}; the pool gives or takes it (base {was})")
            } else {
                format!("{step}; base {was}")
            };
            reasons.insert(group.to_string(), Reason::new(DecisionPath::Explore, text));
            predictions.remove(group);
        }
        Decision {
            plan,
            reasons,
            predictions,
        }
    }
}

impl Policy for Explore {
    fn name(&self) -> &'static str {
        self.base.name()
    }

    fn initial(&mut self) -> Decision {
        self.base.initial()
    }

    fn decide(&mut self, obs: &Observation, now_ms: u64) -> Decision {
        let base = self.base.decide(obs, now_ms);
        if self.stopped.is_some() {
            return base;
        }
        // What the walk set and is still in force; anything changed since is forgotten.
        self.walk_set
            .retain(|name, a| obs.current.services.get(name) == Some(&*a));
        if !self.walk_set.is_empty() {
            if let Some(why) = Self::violation(obs) {
                tracing::warn!(
                    explored_ticks = self.explored_ticks,
                    "exploration stopped for good: {why} under an allocation the walk set; back to the base policy's plans"
                );
                self.stopped = Some(why);
                self.offsets.clear();
                self.walk_set.clear();
                return base;
            }
        }
        if let Some(why) = self.gate(obs) {
            tracing::debug!("not exploring: {why}");
            self.offsets.clear();
            return base;
        }
        if self.informative() {
            return self.informative_step(obs, base);
        }
        let Some(step) = self.step(&base.plan) else {
            return base;
        };
        let Some(plan) = self.walked(&base.plan) else {
            self.offsets.clear();
            return base;
        };
        if plan == base.plan {
            return base;
        }
        self.explored_ticks += 1;
        for (name, a) in &plan.services {
            if base.plan.services.get(name) != Some(a) {
                self.walk_set.insert(name.clone(), *a);
            }
        }
        self.explored(&base, plan, &step)
    }

    fn replace_model(&mut self, model: Arc<Model>) -> bool {
        self.base.replace_model(model)
    }

    /// From another `Explore`: the base policy adopts its base; a walk stopped by a
    /// violation stays stopped (new pods must not restart it); the random draws, the walk's
    /// offsets of the unchanged services and the allocations it set for the services still
    /// here carry over. From a policy without exploration, the base adopts it.
    fn adopt(&mut self, previous: Box<dyn Policy>) -> Adopted {
        if !is::<Self>(&*previous) {
            return self.base.adopt(previous);
        }
        let Some(previous) = downcast::<Self>(previous) else {
            return Adopted::default();
        };
        let previous = *previous;
        let kept = unchanged_services(&previous.ctx, &self.ctx);
        let here = |name: &String| self.ctx.latency_critical().any(|s| &s.name == name);
        self.walk_set = previous
            .walk_set
            .into_iter()
            .filter(|(name, _)| here(name))
            .collect();
        self.offsets = previous
            .offsets
            .into_iter()
            .filter(|(name, _)| kept.contains(name))
            .collect();
        self.rng = previous.rng;
        self.stopped = previous.stopped;
        self.explored_ticks = previous.explored_ticks;
        self.since_step = previous.since_step;
        self.base.adopt(previous.base)
    }

    fn learned(&self) -> Option<PosteriorSet> {
        self.base.learned()
    }

    fn resume(&mut self, learned: &PosteriorSet) -> Vec<String> {
        self.base.resume(learned)
    }
}

#[cfg(test)]
mod tests {
    use cohabit_core::{Sample, ServiceObservation};

    use super::*;
    use crate::StaticPolicy;

    /// Two latency-critical services (target 1 ms) and a CPU batch job on 16 cores and 12
    /// ways, around the static policy's plan.
    fn explorer(cfg: ExploreConfig) -> (Explore, HostContext) {
        let mut ctx = crate::tests::ctx(2, true, false, 0);
        ctx.host.cores = 16;
        ctx.host.llc_ways = 12;
        let base = Box::new(StaticPolicy::new(ctx.clone()));
        (Explore::new(base, ctx.clone(), cfg), ctx)
    }

    /// An observation with these p99s (ms; target 1 ms) under `current`.
    fn obs(ctx: &HostContext, p99: &[Option<f64>], current: &Plan, t_ms: u64) -> Observation {
        Observation {
            t_ms,
            services: ctx
                .specs
                .iter()
                .enumerate()
                .map(|(i, spec)| ServiceObservation {
                    spec: spec.clone(),
                    sample: Sample {
                        p99_ms: p99.get(i).copied().flatten(),
                        ..Sample::default()
                    },
                    gpu_mps_effective_pct: None,
                })
                .collect(),
            current: current.clone(),
        }
    }

    #[test]
    fn the_config_is_checked() {
        assert!(ExploreConfig::default().validate().is_ok());
        for bad in [0.0, 1.0, -0.1, f64::NAN] {
            let cfg = ExploreConfig {
                margin: bad,
                ..ExploreConfig::default()
            };
            assert!(cfg.validate().unwrap_err().contains("margin"), "{bad}");
        }
        let cfg = ExploreConfig {
            min_cores: 0,
            ..ExploreConfig::default()
        };
        assert!(cfg.validate().unwrap_err().contains("min_cores"));
    }

    #[test]
    fn it_never_explores_while_a_service_is_inside_the_margin_or_unmeasured() {
        let (mut e, ctx) = explorer(ExploreConfig::default());
        let mut base = StaticPolicy::new(ctx.clone());
        let plan = e.initial().plan;
        // 0.75 of target is inside a 0.3 margin; a missing reading closes the gate too.
        let cases: [&[Option<f64>]; 4] = [
            &[Some(0.75), Some(0.2)],
            &[Some(0.2), Some(0.71)],
            &[Some(0.2), None],
            &[Some(1.5), Some(0.2)],
        ];
        for (k, p99) in cases.iter().cycle().take(40).enumerate() {
            let o = obs(&ctx, p99, &plan, k as u64 * 1000);
            let d = e.decide(&o, o.t_ms);
            assert_eq!(d, base.decide(&o, o.t_ms), "tick {k}: {p99:?}");
            assert!(d.reasons.values().all(|r| r.path != DecisionPath::Explore));
        }
        assert_eq!(e.explored_ticks(), 0);
        assert_eq!(
            e.stopped(),
            None,
            "violations under the base plan do not stop it"
        );
    }

    #[test]
    fn it_explores_within_bounds_with_valid_plans_while_every_service_keeps_its_margin() {
        let (mut e, ctx) = explorer(ExploreConfig::default());
        let base_plan = e.initial().plan;
        let mut current = base_plan.clone();
        let mut moved = std::collections::BTreeSet::new();
        for k in 0..300u64 {
            let o = obs(&ctx, &[Some(0.5), Some(0.6)], &current, k * 1000);
            let d = e.decide(&o, o.t_ms);
            d.plan.validate(&ctx.host, &ctx.specs).unwrap();
            for name in ["lc0", "lc1"] {
                let (a, b) = (&d.plan.services[name], &base_plan.services[name]);
                assert!(a.cores.abs_diff(b.cores) <= 2, "tick {k}: {a:?} vs {b:?}");
                assert!(a.llc_ways.count.abs_diff(b.llc_ways.count) <= 2, "tick {k}");
                assert!(a.cores >= 1 && a.llc_ways.count >= 1);
                assert_eq!(a.mba_pct, b.mba_pct, "MBA is left alone by default");
                if a != b {
                    moved.insert((name, a.cores != b.cores, a.llc_ways != b.llc_ways));
                    assert_eq!(d.reasons[name].path, DecisionPath::Explore, "tick {k}");
                    assert!(
                        d.reasons[name].text.contains("base static"),
                        "{}",
                        d.reasons[name]
                    );
                }
            }
            current = d.plan;
        }
        assert!(e.explored_ticks() > 250, "{}", e.explored_ticks());
        assert_eq!(e.stopped(), None);
        // Both services, cores and ways both, were tried.
        for name in ["lc0", "lc1"] {
            assert!(
                moved.iter().any(|m| m.0 == name && m.1),
                "{name} cores: {moved:?}"
            );
            assert!(
                moved.iter().any(|m| m.0 == name && m.2),
                "{name} ways: {moved:?}"
            );
        }
    }

    #[test]
    fn it_stops_for_good_at_the_first_violation_under_an_explored_plan() {
        let (mut e, ctx) = explorer(ExploreConfig::default());
        let mut base = StaticPolicy::new(ctx.clone());
        let base_plan = e.initial().plan;
        let o = obs(&ctx, &[Some(0.3), Some(0.3)], &base_plan, 0);
        let explored = e.decide(&o, 0);
        assert_ne!(explored.plan, base_plan, "it explored");
        // The interval under the explored plan violated lc1's target.
        let o = obs(&ctx, &[Some(0.3), Some(1.2)], &explored.plan, 1000);
        let d = e.decide(&o, 1000);
        assert_eq!(d, base.decide(&o, 1000), "back to the base plan");
        assert!(e.stopped().unwrap().contains("lc1"), "{:?}", e.stopped());
        // Never again, however comfortable the services are.
        for k in 2..50u64 {
            let o = obs(&ctx, &[Some(0.1), Some(0.1)], &d.plan, k * 1000);
            assert_eq!(e.decide(&o, k * 1000).plan, base_plan);
        }
        assert_eq!(e.explored_ticks(), 1);
    }

    /// `Explore` around a fresh `parties` on `ctx`.
    fn around_parties(ctx: &HostContext) -> Explore {
        let base = crate::PartiesPolicy::new(ctx.clone(), crate::PartiesConfig::default());
        Explore::new(Box::new(base), ctx.clone(), ExploreConfig::default())
    }

    #[test]
    fn a_rebuilt_explorer_walks_on_as_before_and_a_stopped_one_stays_stopped() {
        let (_, ctx) = explorer(ExploreConfig::default());
        // Two explorers given the same ticks are in the same state.
        let (mut old, mut twin) = (around_parties(&ctx), around_parties(&ctx));
        let mut plan = old.initial().plan;
        for k in 1..6u64 {
            let o = obs(&ctx, &[Some(0.3), Some(0.5)], &plan, k * 1000);
            plan = old.decide(&o, k * 1000).plan;
            assert_eq!(twin.decide(&o, k * 1000).plan, plan);
        }
        assert!(old.explored_ticks() > 0 && old.stopped().is_none());

        // The twin rebuilt for the same services: walk and base go on as the old one does.
        let mut rebuilt = around_parties(&ctx);
        let adopted = rebuilt.adopt(Box::new(twin));
        assert_eq!(adopted.services, ["lc0", "lc1"].map(String::from).into());
        assert_eq!(rebuilt.explored_ticks(), old.explored_ticks());
        for k in 6..12u64 {
            let o = obs(&ctx, &[Some(0.3), Some(0.5)], &plan, k * 1000);
            let d = rebuilt.decide(&o, k * 1000);
            assert_eq!(d, old.decide(&o, k * 1000), "tick {k}");
            plan = d.plan;
        }

        // A violation under the walk stops it; a rebuild does not start it again.
        let mut k = 12;
        while rebuilt.walk_set.is_empty() {
            assert!(k < 100, "the walk never stepped");
            let o = obs(&ctx, &[Some(0.3), Some(0.3)], &plan, k * 1000);
            plan = rebuilt.decide(&o, k * 1000).plan;
            k += 1;
        }
        let explored = plan.clone();
        let o = obs(&ctx, &[Some(0.3), Some(1.2)], &explored, k * 1000);
        plan = rebuilt.decide(&o, k * 1000).plan;
        assert!(rebuilt.stopped().is_some());
        let mut again = around_parties(&ctx);
        again.adopt(Box::new(rebuilt));
        assert!(again.stopped().is_some(), "stays stopped");
        let explored_before = again.explored_ticks();
        for k in k + 1..k + 20 {
            let o = obs(&ctx, &[Some(0.1), Some(0.1)], &plan, k * 1000);
            plan = again.decide(&o, k * 1000).plan;
        }
        assert_eq!(
            again.explored_ticks(),
            explored_before,
            "never explores again"
        );

        // From a policy without exploration, the base takes over what it can.
        let mut parties = crate::PartiesPolicy::new(ctx.clone(), crate::PartiesConfig::default());
        let start = parties.initial().plan;
        parties.decide(&obs(&ctx, &[Some(1.5), Some(0.5)], &start, 1000), 1000);
        let mut wrapped = around_parties(&ctx);
        let adopted = wrapped.adopt(Box::new(parties));
        assert_eq!(adopted.services, ["lc0", "lc1"].map(String::from).into());
        assert_ne!(
            wrapped.initial().plan,
            start,
            "the base took parties' shares"
        );
    }

    /// A base policy that keeps whatever is in force, as `ml`'s fallback does when it holds.
    struct Hold(Plan);

    impl Policy for Hold {
        fn name(&self) -> &'static str {
            "hold"
        }
        fn initial(&mut self) -> Decision {
            Decision {
                plan: self.0.clone(),
                reasons: BTreeMap::new(),
                predictions: BTreeMap::new(),
            }
        }
        fn decide(&mut self, obs: &Observation, _now_ms: u64) -> Decision {
            Decision {
                plan: obs.current.clone(),
                reasons: BTreeMap::new(),
                predictions: BTreeMap::new(),
            }
        }
    }

    #[test]
    fn a_violation_under_a_step_the_base_policy_adopted_still_stops_it() {
        let ctx = {
            let (_, mut ctx) = explorer(ExploreConfig::default());
            ctx.host.cores = 16;
            ctx
        };
        let start = StaticPolicy::new(ctx.clone()).initial().plan;
        let mut e = Explore::new(
            Box::new(Hold(start.clone())),
            ctx.clone(),
            ExploreConfig::default(),
        );
        let o = obs(&ctx, &[Some(0.3), Some(0.3)], &start, 0);
        let explored = e.decide(&o, 0);
        assert_ne!(explored.plan, start, "it explored");
        // Inside the margin but under the target: the gate closes, the base holds the
        // explored allocation, and that plan is the base's own.
        let o = obs(&ctx, &[Some(0.8), Some(0.8)], &explored.plan, 1000);
        let held = e.decide(&o, 1000);
        assert_eq!(held.plan, explored.plan, "the base adopted the walk's step");
        assert!(held
            .reasons
            .values()
            .all(|r| r.path != DecisionPath::Explore));
        assert_eq!(e.stopped(), None);
        // The violation comes an interval later, under the adopted step: it stops.
        let o = obs(&ctx, &[Some(1.3), Some(0.3)], &held.plan, 2000);
        e.decide(&o, 2000);
        assert!(e.stopped().unwrap().contains("lc0"), "{:?}", e.stopped());
        // Once the base has moved off every allocation the walk set, a violation is the
        // base's own and does not stop a fresh explorer.
        let mut e = Explore::new(
            Box::new(Hold(start.clone())),
            ctx.clone(),
            ExploreConfig::default(),
        );
        let explored = e.decide(&obs(&ctx, &[Some(0.3), Some(0.3)], &start, 0), 0);
        assert_ne!(explored.plan, start);
        e.decide(&obs(&ctx, &[Some(0.8), Some(0.8)], &start, 1000), 1000);
        e.decide(&obs(&ctx, &[Some(1.3), Some(0.3)], &start, 2000), 2000);
        assert_eq!(e.stopped(), None);
    }

    #[test]
    fn it_keeps_the_floor_and_mba_moves_only_when_asked() {
        let cfg = ExploreConfig {
            max_cores: 8,
            max_ways: 0,
            max_mba_steps: 3,
            min_cores: 3,
            seed: 7,
            ..ExploreConfig::default()
        };
        let (mut e, ctx) = explorer(cfg);
        let base_plan = e.initial().plan;
        let mut current = base_plan.clone();
        let mut mba_moved = false;
        for k in 0..300u64 {
            let o = obs(&ctx, &[Some(0.2), Some(0.2)], &current, k * 1000);
            let d = e.decide(&o, o.t_ms);
            d.plan.validate(&ctx.host, &ctx.specs).unwrap();
            for name in ["lc0", "lc1"] {
                let a = &d.plan.services[name];
                assert!(a.cores >= 3, "tick {k}: {a:?}");
                assert_eq!(a.llc_ways, base_plan.services[name].llc_ways);
                mba_moved |= a.mba_pct != base_plan.services[name].mba_pct;
                assert!(a.mba_pct >= ctx.host.mba_min_pct);
            }
            current = d.plan;
        }
        assert!(mba_moved);
    }

    #[test]
    fn on_a_host_without_mba_the_walk_has_no_mba_knob() {
        let cfg = ExploreConfig {
            max_mba_steps: 3,
            ..ExploreConfig::default()
        };
        let (e, mut ctx) = explorer(cfg.clone());
        assert!(e.knobs("lc0").contains(&Knob::Mba));
        // A host whose only level is 100 % (no MBA): every step there would be refused.
        ctx.host.mba_min_pct = MBA_MAX_PCT;
        ctx.host.mba_gran_pct = MBA_MAX_PCT;
        let bare = Explore::new(Box::new(StaticPolicy::new(ctx.clone())), ctx, cfg);
        assert_eq!(bare.knobs("lc0"), vec![Knob::Cores, Knob::Ways]);
    }

    /// `ml` whose two members disagree on what a core is worth (-0.9 and -4.5 per unit of
    /// `cores_cand`: its posterior has something to learn) on the explorer's host, explored
    /// around with `cfg`.
    fn around_ml(cfg: ExploreConfig) -> (Explore, HostContext) {
        let (_, ctx) = explorer(ExploreConfig::default());
        let c = cohabit_models::FEATURE_NAMES
            .iter()
            .position(|n| *n == "cores_cand")
            .unwrap();
        let model = crate::ml::tests::linear_model(&[(0.0, &[(c, -0.9)]), (0.0, &[(c, -4.5)])]);
        let ml = MlPolicy::new(ctx.clone(), Arc::new(model), crate::MlConfig::default());
        (Explore::new(Box::new(ml), ctx.clone(), cfg), ctx)
    }

    /// [`obs`] with a load and busy cores, as `ml` reads them.
    fn loaded(ctx: &HostContext, p99: &[Option<f64>], current: &Plan, t_ms: u64) -> Observation {
        let mut o = obs(ctx, p99, current, t_ms);
        for s in &mut o.services {
            s.sample.requests_per_s = Some(50.0);
            s.sample.cpu_busy_cores = Some(1.0);
        }
        o
    }

    /// The explored service of `d`, if it explored.
    fn explored_service(d: &Decision) -> Option<String> {
        d.reasons
            .iter()
            .find(|(g, r)| r.path == DecisionPath::Explore && g.as_str() != BEST_EFFORT_GROUP)
            .map(|(g, _)| g.clone())
    }

    #[test]
    fn around_ml_it_steps_only_where_the_posterior_predicts_safe_and_the_reading_teaches_it() {
        let cfg = ExploreConfig::default();
        let (mut e, ctx) = around_ml(cfg.clone());
        assert!(e.informative());
        let limit = (1.0 - cfg.margin).ln();
        let mut plan = e.initial().plan;
        let readings = [0.3, 0.5, 0.2, 0.4];
        let mut steps = 0;
        for k in 1..80u64 {
            let q = readings[usize::try_from(k).unwrap() % readings.len()];
            let o = loaded(&ctx, &[Some(q), Some(q * 0.8)], &plan, k * 1000);
            let d = e.decide(&o, k * 1000);
            d.plan.validate(&ctx.host, &ctx.specs).unwrap();
            if let Some(name) = explored_service(&d) {
                steps += 1;
                let ml = AsAny::as_any(&*e.base).downcast_ref::<MlPolicy>().unwrap();
                let a = d.plan.services[&name];
                let modelled = if a.llc_ways == d.plan.best_effort.llc_ways {
                    Allocation {
                        llc_ways: cohabit_core::WayRange::new(a.llc_ways.first, 1),
                        ..a
                    }
                } else {
                    a
                };
                let f = &ml.forecast(&o, &name, &[modelled]).unwrap()[0];
                assert!(
                    f.mean + cfg.beta * f.latent_sigma <= limit + 1e-9,
                    "tick {k}: {name} {a:?}: {f:?}"
                );
                // The posterior's prediction for the step is logged and learnt from.
                let p = &d.predictions[&name];
                assert!(p.posterior.is_some(), "{p:?}");
                assert!(
                    d.reasons[&name].text.contains("safe step"),
                    "{}",
                    d.reasons[&name]
                );
            }
            plan = d.plan;
        }
        assert!(steps > 0, "it never stepped");
        assert_eq!(u64::try_from(steps).unwrap(), e.explored_ticks());
        assert_eq!(e.stopped(), None);
    }

    #[test]
    fn around_ml_it_stops_for_good_and_restores_the_base_plan_after_a_violation_under_its_step() {
        let (mut e, ctx) = around_ml(ExploreConfig::default());
        let mut plan = e.initial().plan;
        let mut k = 1;
        let name = loop {
            assert!(k < 100, "it never stepped");
            let o = loaded(&ctx, &[Some(0.2), Some(0.2)], &plan, k * 1000);
            let d = e.decide(&o, k * 1000);
            let stepped = explored_service(&d);
            plan = d.plan;
            k += 1;
            if let Some(name) = stepped {
                break name;
            }
        };
        // The interval under the step violated its target.
        let p99: Vec<Option<f64>> = ["lc0", "lc1"]
            .iter()
            .map(|s| Some(if *s == name { 1.3 } else { 0.2 }))
            .collect();
        let o = loaded(&ctx, &p99, &plan, k * 1000);
        // What `ml` alone decides on this reading, in the same state.
        let mut twin = AsAny::as_any(&*e.base)
            .downcast_ref::<MlPolicy>()
            .unwrap()
            .clone();
        let d = e.decide(&o, k * 1000);
        assert!(e.stopped().unwrap().contains(&name), "{:?}", e.stopped());
        assert_eq!(d, twin.decide(&o, k * 1000), "the base plan, as decided");
        assert!(explored_service(&d).is_none());
        let explored_ticks = e.explored_ticks();
        plan = d.plan;
        for k in k + 1..k + 30 {
            let o = loaded(&ctx, &[Some(0.2), Some(0.2)], &plan, k * 1000);
            let d = e.decide(&o, k * 1000);
            assert!(explored_service(&d).is_none(), "tick {k}");
            plan = d.plan;
        }
        assert_eq!(e.explored_ticks(), explored_ticks, "never again");
    }

    #[test]
    fn around_ml_it_makes_no_step_when_nothing_is_predicted_safe() {
        // At 1000 spreads of confidence no step is safe.
        let cfg = ExploreConfig {
            beta: 1000.0,
            ..ExploreConfig::default()
        };
        let (mut e, ctx) = around_ml(cfg);
        let mut plan = e.initial().plan;
        for k in 1..40u64 {
            let o = loaded(&ctx, &[Some(0.2), Some(0.2)], &plan, k * 1000);
            let d = e.decide(&o, k * 1000);
            assert!(explored_service(&d).is_none(), "tick {k}");
            plan = d.plan;
        }
        assert_eq!(e.explored_ticks(), 0);
    }

    #[test]
    fn the_informative_rule_applies_around_ml_and_the_walk_around_policies_without_a_model() {
        let (_, ctx) = explorer(ExploreConfig::default());
        assert!(!around_parties(&ctx).informative());
        let (e, _) = explorer(ExploreConfig::default());
        assert!(!e.informative(), "static");
        let (e, _) = around_ml(ExploreConfig {
            rule: ExploreRule::Walk,
            ..ExploreConfig::default()
        });
        assert!(!e.informative(), "the walk when asked for");
        let cfg = ExploreConfig {
            beta: 0.0,
            ..ExploreConfig::default()
        };
        assert!(cfg.validate().unwrap_err().contains("explore.beta"));
        let cfg = ExploreConfig {
            min_information: 1.5,
            ..ExploreConfig::default()
        };
        assert!(cfg.validate().unwrap_err().contains("min_information"));
    }

    #[test]
    fn the_same_seed_walks_the_same_way() {
        let run = |seed| {
            let (mut e, ctx) = explorer(ExploreConfig {
                seed,
                ..ExploreConfig::default()
            });
            let mut current = e.initial().plan;
            let mut plans = Vec::new();
            for k in 0..20u64 {
                let o = obs(&ctx, &[Some(0.2), Some(0.2)], &current, k * 1000);
                current = e.decide(&o, o.t_ms).plan;
                plans.push(current.clone());
            }
            plans
        };
        assert_eq!(run(3), run(3));
        assert_ne!(run(3), run(4));
    }
}
