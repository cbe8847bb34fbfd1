//! The informative safe step around `ml`'s plan (issue 45, item 3): which one step, if any,
//! the explorer takes this tick.
//!
//! **Problem.** `ml`'s posterior learns only where the host is measured, and `ml` measures
//! only where it settles: an allocation it wrongly thinks too small is never tried, so the
//! error that keeps it there is never corrected. A random walk tries allocations the model
//! already knows, and allocations it rightly fears.
//!
//! **Approach** (SafeOpt, Sui et al. ICML 2015, and its expanders; the constraint kept
//! separate from the objective as in Berkenkamp et al. 2021). The objective needs no model:
//! a step that frees a core or a way for best effort gains exactly that. What is unknown is
//! safety, so only the constraint is modelled, by `ml`'s own forecast with its posterior.
//! A step is *safe* when the upper confidence bound of ln(p99/target) is at most
//! ln(1 - margin): `mean + beta * sigma <= ln(1 - margin)`, the same margin the explorer's
//! gate asks every service to keep; `sigma` is the spread of the value (the posterior's and
//! the model's calibrated spread), not of one reading of it: SafeOpt bounds the function,
//! and the measurement's noise is what the margin is for. Among the safe steps the one taken is the one whose
//! reading would teach the posterior most about where best effort can grow: SafeOpt's
//! expander idea, made quantitative with the posterior's covariance (a Bayesian last
//! layer, so the variance reduction at any point is exact and costs O(d²), no fake
//! observation and refit as in the reference code).
//!
//! **Rule.** For a safe step `x` of service `s` and each *growth point* `p` of `s` (cuts of
//! up to `max_cores` cores and `max_ways` ways from the base plan, `x` itself included) that
//! is `x` or not yet certified safe but plausibly so (lower bound under the limit), the
//! share of `p`'s posterior variance one reading at `x` removes is
//! `rho²(x, p) = (z_pᵀ Σ z_x)² / ((n_x + z_xᵀ Σ z_x) · z_pᵀ Σ z_p)` (`z` the posterior's
//! regressors, `Σ` its covariance, `n_x` the reading's noise). The step's score is
//! `sum_p gain(p) · rho²(x, p)`, `gain` the share of the host it frees (cores over the host's
//! cores plus ways over its ways): expected best-effort gain times information. The step
//! with the highest score is taken when some `rho²(x, p)` reaches `min_information`. Why
//! this rule rather than SafeOpt's "widest interval among expanders": the widest interval
//! is that of a step the noise dominates (a reading there teaches little about the
//! boundary); weighting by gain prefers the steps that tell whether *more* can go to best
//! effort, and a step whose reading would barely move any growth point's variance is not
//! worth a move of a core.
//!
//! **Properties.** Never a step whose upper bound exceeds the limit; no step when none is
//! safe, when `ml` has no forecast for a service (no reading, saturated, inputs out of
//! range) or no posterior (nothing a reading would teach); one step of one service a tick.
//! Measured (docs/RESULTS.md, "Safe exploration (issue 45, item 3)"): it rarely steps, and
//! never on a 2-core host shaped like the project's VM, because most of `ml`'s spread is
//! the part its posterior counts as noise no reading removes, so the safe set cannot grow.

use cohabit_core::{Allocation, Observation, Plan, WayRange};
use ndarray::{Array1, Array2};

use crate::ml::{Forecast, MlPolicy};
use crate::{layout, shares_of, HostContext};

use super::ExploreConfig;

/// A move that frees a resource for the best-effort pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Move {
    /// One core fewer.
    Core,
    /// One LLC way fewer.
    Way,
    /// Its own ways given up for the pool's, shared.
    PoolWays,
}

impl Move {
    fn words(self) -> &'static str {
        match self {
            Move::Core => "one core fewer",
            Move::Way => "one LLC way fewer",
            Move::PoolWays => "the pool's LLC ways, shared, for its own",
        }
    }
}

/// A step chosen.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Choice {
    /// The base plan with the step taken.
    pub(super) plan: Plan,
    /// The service it moved.
    pub(super) service: String,
    /// What it did and why, in words.
    pub(super) text: String,
}

/// A safe step scored.
#[derive(Debug, Clone)]
struct Scored {
    step: Step,
    /// Expected best-effort gain times information.
    score: f64,
    /// The largest share of a growth point's variance its reading removes.
    most_informed: f64,
    /// Growth points not yet certified safe.
    growth_points: usize,
}

/// The base plan with `step` taken for `name`, or `None` when it does not fit the host or
/// the bounds.
pub(super) fn stepped(
    ctx: &HostContext,
    cfg: &ExploreConfig,
    base: &Plan,
    name: &str,
    step: Move,
) -> Option<Plan> {
    let a = base.services.get(name)?;
    let own_ways = !ctx.shares_pool_group(name) && a.llc_ways != base.best_effort.llc_ways;
    let plan = match step {
        Move::Core => {
            if cfg.max_cores == 0 || a.cores <= cfg.min_cores {
                return None;
            }
            let mut plan = base.clone();
            plan.services.get_mut(name)?.cores -= 1;
            plan.best_effort.cores += 1;
            plan
        }
        Move::Way | Move::PoolWays => {
            if cfg.max_ways == 0 || !own_ways || !ctx.host.partitions_llc() {
                return None;
            }
            if layout(ctx, &shares_of(base), base.best_effort.mba_pct) != *base {
                return None;
            }
            let mut shares = shares_of(base);
            let s = shares.get_mut(name)?;
            if step == Move::Way {
                if s.ways <= cfg.min_ways {
                    return None;
                }
                s.ways -= 1;
            } else {
                if !ctx.has_cpu_best_effort() {
                    return None;
                }
                s.ways = 0;
            }
            layout(ctx, &shares, base.best_effort.mba_pct)
        }
    };
    plan.validate(&ctx.host, &ctx.specs).ok()?;
    Some(plan)
}

/// `a` with `cores` and `ways` fewer.
fn cut(a: &Allocation, cores: u32, ways: u32) -> Allocation {
    Allocation {
        cores: a.cores - cores,
        llc_ways: WayRange::new(a.llc_ways.first, a.llc_ways.count - ways),
        ..*a
    }
}

/// The share of `p`'s posterior variance one reading at `x` (noise `n_x`) removes, with
/// `sx = Σ z_x`; 0 without regressors.
fn informed(cov: &Array2<f64>, sx: &Array1<f64>, x: &Forecast, p: &Forecast) -> f64 {
    let (Some(zx), Some(zp)) = (&x.regressor, &p.regressor) else {
        return 0.0;
    };
    if zx.len() != cov.nrows() || zp.len() != cov.nrows() {
        return 0.0;
    }
    let zp = Array1::from(zp.clone());
    let zx = Array1::from(zx.clone());
    let vx = zx.dot(sx);
    let vp = zp.dot(&cov.dot(&zp));
    let c = zp.dot(sx);
    let denom = (x.noise_var + vx) * vp;
    if denom > 1e-12 {
        (c * c / denom).clamp(0.0, 1.0)
    } else {
        0.0
    }
}

/// A step considered: the plan it makes, and `ml`'s forecast of the service it moves.
#[derive(Debug, Clone)]
struct Step {
    plan: Plan,
    service: String,
    step: Move,
    forecast: Forecast,
    /// The share of the host it frees.
    gain: f64,
}

/// The safe `steps` scored against the growth points `points` (forecast, share of the host
/// each frees) with the posterior's covariance `cov`; unsafe steps are dropped.
fn score_steps(
    steps: Vec<Step>,
    points: &[(Forecast, f64)],
    cov: &Array2<f64>,
    cfg: &ExploreConfig,
) -> Vec<Scored> {
    let limit = (1.0 - cfg.margin).ln();
    // Points not yet certified safe but plausibly so: where best effort could grow.
    let open: Vec<&(Forecast, f64)> = points
        .iter()
        .filter(|(f, _)| {
            f.mean + cfg.beta * f.latent_sigma > limit
                && f.mean - cfg.beta * f.latent_sigma <= limit
        })
        .collect();
    steps
        .into_iter()
        .filter(|s| s.forecast.mean + cfg.beta * s.forecast.latent_sigma <= limit)
        .map(|s| {
            let x = &s.forecast;
            let sx = x
                .regressor
                .as_ref()
                .filter(|z| z.len() == cov.nrows())
                .map_or_else(
                    || Array1::zeros(cov.nrows()),
                    |z| cov.dot(&Array1::from(z.clone())),
                );
            let own = informed(cov, &sx, x, x);
            let mut score = s.gain * own;
            let mut most = own;
            for (p, g) in &open {
                let r = informed(cov, &sx, x, p);
                score += g * r;
                most = most.max(r);
            }
            Scored {
                score,
                most_informed: most,
                growth_points: open.len(),
                step: s,
            }
        })
        .collect()
}

/// The best of `scored` that teaches enough, if any.
fn pick(scored: Vec<Scored>, cfg: &ExploreConfig) -> Option<Scored> {
    scored
        .into_iter()
        .filter(|s| s.most_informed >= cfg.min_information)
        .max_by(|a, b| {
            a.score
                .total_cmp(&b.score)
                .then(a.step.gain.total_cmp(&b.step.gain))
        })
}

/// The steps of one service, scored.
fn score_service(
    ml: &MlPolicy,
    ctx: &HostContext,
    cfg: &ExploreConfig,
    obs: &Observation,
    base: &Plan,
    name: &str,
) -> Vec<Scored> {
    let Some(a) = base.services.get(name).copied() else {
        return Vec::new();
    };
    let share = |cores: u32, ways: u32| {
        f64::from(cores) / f64::from(ctx.host.cores.max(1))
            + f64::from(ways) / f64::from(ctx.host.llc_ways.max(1))
    };
    let moves: Vec<(Move, Plan, Allocation, f64)> = [Move::Core, Move::Way, Move::PoolWays]
        .into_iter()
        .filter_map(|m| {
            let plan = stepped(ctx, cfg, base, name, m)?;
            // The model is asked about a service on the pool's ways as if it had one.
            let (alloc, gain) = match m {
                Move::PoolWays => (
                    cut(&a, 0, a.llc_ways.count.saturating_sub(1)),
                    share(0, a.llc_ways.count),
                ),
                Move::Core => (*plan.services.get(name)?, share(1, 0)),
                Move::Way => (*plan.services.get(name)?, share(0, 1)),
            };
            Some((m, plan, alloc, gain))
        })
        .collect();
    if moves.is_empty() {
        return Vec::new();
    }
    // Growth points: every cut within the bounds, the steps' own allocations aside.
    let own_ways = stepped(ctx, cfg, base, name, Move::PoolWays).is_some();
    let max_w = if own_ways { cfg.max_ways } else { 0 };
    let mut points: Vec<(Allocation, f64)> = Vec::new();
    for dc in 0..=cfg.max_cores.min(a.cores.saturating_sub(cfg.min_cores)) {
        for dw in 0..=max_w.min(a.llc_ways.count.saturating_sub(cfg.min_ways)) {
            let p = cut(&a, dc, dw);
            if (dc, dw) != (0, 0) && moves.iter().all(|m| m.2 != p) {
                points.push((p, share(dc, dw)));
            }
        }
    }
    let cands: Vec<Allocation> = moves
        .iter()
        .map(|m| m.2)
        .chain(points.iter().map(|p| p.0))
        .collect();
    let (Some(f), Some(cov)) = (
        ml.forecast(obs, name, &cands),
        ml.posterior_covariance(name),
    ) else {
        return Vec::new();
    };
    let (fs, fp) = f.split_at(moves.len());
    for ((m, _, al, _), x) in moves.iter().zip(fs) {
        tracing::trace!(
            "explore {name} {m:?} to {} cores, {} ways: ln(p99/target) {:.3}, latent sigma {:.3}, bound {:.3} against {:.3}",
            al.cores,
            al.llc_ways.count,
            x.mean,
            x.latent_sigma,
            x.mean + cfg.beta * x.latent_sigma,
            (1.0 - cfg.margin).ln()
        );
    }
    let steps = moves
        .into_iter()
        .zip(fs)
        .map(|((step, plan, _, gain), x)| Step {
            plan,
            service: name.to_string(),
            step,
            forecast: x.clone(),
            gain,
        })
        .collect();
    let points: Vec<(Forecast, f64)> = fp.iter().cloned().zip(points.iter().map(|p| p.1)).collect();
    score_steps(steps, &points, &cov, cfg)
}

/// The informative safe step this tick around `base`, if one is safe and teaches enough.
pub(super) fn choose(
    ml: &MlPolicy,
    ctx: &HostContext,
    cfg: &ExploreConfig,
    obs: &Observation,
    base: &Plan,
    services: &[String],
) -> Option<Choice> {
    let scored = services
        .iter()
        .flat_map(|name| score_service(ml, ctx, cfg, obs, base, name))
        .collect();
    let best = pick(scored, cfg)?;
    let s = &best.step;
    let ucb = (s.forecast.mean + cfg.beta * s.forecast.latent_sigma).exp();
    let text = format!(
        "{}: {} (safe step: p99/target at most {ucb:.2} at beta {} against {:.2}; \
         its reading removes up to {:.0} % of the posterior's variance at {} growth points \
         not yet certified; score {:.4})",
        s.service,
        s.step.words(),
        cfg.beta,
        1.0 - cfg.margin,
        100.0 * best.most_informed,
        best.growth_points,
        best.score
    );
    Some(Choice {
        plan: best.step.plan,
        service: best.step.service,
        text,
    })
}

#[cfg(test)]
mod tests {
    use cohabit_models::posterior::Blr;

    use super::*;
    use crate::fair_shares;

    /// A forecast of `mean` ± `sigma` at regressor `z`, read with noise variance 0.01.
    fn forecast(mean: f64, sigma: f64, z: &[f64]) -> Forecast {
        Forecast {
            mean,
            latent_sigma: sigma,
            noise_var: 0.01,
            regressor: Some(z.to_vec()),
        }
    }

    /// A step of lc0 by `step` with forecast `f`, freeing `gain` of the host.
    fn step(step: Move, f: Forecast, gain: f64) -> Step {
        let ctx = crate::tests::ctx(1, true, false, 0);
        Step {
            plan: layout(&ctx, &fair_shares(&ctx), 100),
            service: "lc0".into(),
            step,
            forecast: f,
            gain,
        }
    }

    /// A posterior over `[core direction, way direction, constant]` that has seen twenty
    /// readings of one core fewer (`[1, 0, 1]`) and none of a way fewer.
    fn evidence_on_cores() -> Blr {
        let mut blr = Blr::new(&[1.0, 1.0, 0.0025]).unwrap();
        for _ in 0..20 {
            blr.observe(&[1.0, 0.0, 1.0], 0.1, 0.01, 1.0).unwrap();
        }
        blr
    }

    #[test]
    fn a_step_whose_upper_bound_exceeds_the_margin_is_never_chosen_however_informative() {
        let cfg = ExploreConfig::default();
        let limit = (1.0 - cfg.margin).ln();
        let cov = Blr::new(&[1.0, 1.0, 0.0025]).unwrap().covariance();
        // The way step would teach everything (nothing is known of its direction) but its
        // upper bound is just over the limit; the core step is just under it.
        let unsafe_way = forecast(limit - 2.0 * 0.1 + 0.001, 0.1, &[0.0, 1.0, 1.0]);
        let safe_core = forecast(limit - 2.0 * 0.1 - 0.001, 0.1, &[0.1, 0.0, 1.0]);
        let scored = score_steps(
            vec![
                step(Move::Way, unsafe_way.clone(), 0.5),
                step(Move::Core, safe_core, 0.01),
            ],
            &[],
            &cov,
            &cfg,
        );
        assert_eq!(scored.len(), 1, "the unsafe step is not even scored");
        let best = pick(scored, &cfg).expect("the safe step teaches enough");
        assert_eq!(best.step.step, Move::Core);
        let ucb = best.step.forecast.mean + cfg.beta * best.step.forecast.latent_sigma;
        assert!(ucb <= limit, "{ucb} > {limit}");
        // Alone, the unsafe step is not taken.
        let alone = score_steps(vec![step(Move::Way, unsafe_way, 0.5)], &[], &cov, &cfg);
        assert!(pick(alone, &cfg).is_none());
    }

    #[test]
    fn among_safe_steps_the_one_whose_reading_teaches_more_about_the_growth_points_wins() {
        let cfg = ExploreConfig::default();
        let cov = evidence_on_cores().covariance();
        // Both steps equally safe and freeing as much; beyond each, a deeper cut not yet
        // certified (its bound straddles the limit).
        let (safe, open) = ((-1.2, 0.2), (-0.4, 0.2));
        let core = forecast(safe.0, safe.1, &[1.0, 0.0, 1.0]);
        let way = forecast(safe.0, safe.1, &[0.0, 1.0, 1.0]);
        let points = [
            (forecast(open.0, open.1, &[2.0, 0.0, 1.0]), 0.1),
            (forecast(open.0, open.1, &[0.0, 2.0, 1.0]), 0.1),
        ];
        let scored = score_steps(
            vec![step(Move::Core, core, 0.05), step(Move::Way, way, 0.05)],
            &points,
            &cov,
            &cfg,
        );
        assert_eq!(scored.len(), 2);
        assert!(scored.iter().all(|s| s.growth_points == 2));
        let (c, w) = (&scored[0], &scored[1]);
        assert!(
            w.score > 2.0 * c.score,
            "way {} vs core {}",
            w.score,
            c.score
        );
        assert!(w.most_informed > 0.5, "{}", w.most_informed);
        assert!(c.most_informed < 0.2, "{}", c.most_informed);
        assert_eq!(pick(scored, &cfg).unwrap().step.step, Move::Way);
        // With the evidence on ways instead, the core step wins.
        let mut blr = Blr::new(&[1.0, 1.0, 0.0025]).unwrap();
        for _ in 0..20 {
            blr.observe(&[0.0, 1.0, 1.0], 0.1, 0.01, 1.0).unwrap();
        }
        let scored = score_steps(
            vec![
                step(Move::Core, forecast(safe.0, safe.1, &[1.0, 0.0, 1.0]), 0.05),
                step(Move::Way, forecast(safe.0, safe.1, &[0.0, 1.0, 1.0]), 0.05),
            ],
            &points,
            &blr.covariance(),
            &cfg,
        );
        assert_eq!(pick(scored, &cfg).unwrap().step.step, Move::Core);
    }

    #[test]
    fn no_step_is_taken_when_nothing_is_predicted_safe_or_a_reading_would_teach_nothing() {
        let cfg = ExploreConfig::default();
        let cov = Blr::new(&[1.0, 1.0, 0.0025]).unwrap().covariance();
        // Every step's upper bound over ln 0.7 = -0.36.
        let steps = vec![
            step(Move::Core, forecast(-0.5, 0.1, &[1.0, 0.0, 1.0]), 0.05),
            step(Move::Way, forecast(0.2, 0.5, &[0.0, 1.0, 1.0]), 0.05),
            step(Move::PoolWays, forecast(-0.3, 0.0, &[0.0, 3.0, 1.0]), 0.3),
        ];
        assert!(pick(score_steps(steps, &[], &cov, &cfg), &cfg).is_none());
        // Safe, but the posterior already knows its direction: nothing worth a move.
        let cov = evidence_on_cores().covariance();
        let known = step(Move::Core, forecast(-2.0, 0.1, &[1.0, 0.0, 1.0]), 0.05);
        assert!(pick(score_steps(vec![known], &[], &cov, &cfg), &cfg).is_none());
        // Without a regressor (no posterior) a reading teaches nothing either.
        let mut blind = forecast(-2.0, 0.1, &[]);
        blind.regressor = None;
        let blind = step(Move::Core, blind, 0.05);
        assert!(pick(score_steps(vec![blind], &[], &cov, &cfg), &cfg).is_none());
    }

    #[test]
    fn a_step_fits_the_host_and_the_bounds_or_is_not_offered() {
        let ctx = crate::tests::ctx(2, true, false, 0);
        let cfg = ExploreConfig::default();
        let base = layout(&ctx, &fair_shares(&ctx), 100);
        let a = base.services["lc0"];
        let core = stepped(&ctx, &cfg, &base, "lc0", Move::Core).unwrap();
        assert_eq!(core.services["lc0"].cores, a.cores - 1);
        assert_eq!(core.best_effort.cores, base.best_effort.cores + 1);
        let way = stepped(&ctx, &cfg, &base, "lc0", Move::Way).unwrap();
        assert_eq!(way.services["lc0"].llc_ways.count, a.llc_ways.count - 1);
        assert!(way.best_effort.llc_ways.count > base.best_effort.llc_ways.count);
        let pool = stepped(&ctx, &cfg, &base, "lc0", Move::PoolWays).unwrap();
        assert_eq!(pool.services["lc0"].llc_ways, pool.best_effort.llc_ways);
        // At the floor: no core step; on the pool's ways already: no way steps.
        let floor = ExploreConfig {
            min_cores: a.cores,
            ..cfg.clone()
        };
        assert!(stepped(&ctx, &floor, &base, "lc0", Move::Core).is_none());
        assert!(stepped(&ctx, &cfg, &pool, "lc0", Move::Way).is_none());
        assert!(stepped(&ctx, &cfg, &pool, "lc0", Move::PoolWays).is_none());
    }
}
