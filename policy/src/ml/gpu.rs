//! GPU services in the `ml` policy: MPS shares from an online model of the service's own
//! tail latency against its share, changed rarely (every change restarts the MPS client).
//!
//! Model: `ln(p99/target)` falls by `e * ln(s'/s)` when the share goes from `s` to `s'`,
//! anchored on the smoothed measured value at the share in force, with `e` learned from the
//! service's own share changes (prior [`MlConfig::gpu_exponent_prior`]).
//!
//! The cost of a change is the host's (`GpuCapacity::share_change`): where the driver changes
//! running clients' shares (MPS v3), a change costs nothing, so no interval is skipped and
//! a surplus of one step is given back once measured; otherwise every change costs a
//! restart, and:
//!
//! Restart spacing: the interval that held a restart is skipped; a share never changes
//! while a restart is pending or on fewer than [`GPU_MIN_SAMPLES`] samples since the last
//! change (the first placement needs one); it grows (in [`GPU_STEP_PCT`]-point steps) when
//! the pessimistic need is a step above it and the smoothed tail is past the margin, and
//! shrinks only after `gpu_shrink_after_ms` of a surplus larger than `gpu_hysteresis_pct`.
//!
//! Degrade ([`fit_shares`]): when the services on a GPU want more than is there, those that
//! want less take it and the others grow into what is free in proportion to how much more
//! they want.

use cohabit_core::{DecisionPath, Observation, Reason, Sample, ShareChange};
use cohabit_models::log_qos_ratio;

use super::{MlConfig, MlPolicy, ServicePlan};
use crate::slack;

/// GPU shares move in steps of this many percentage points.
pub(super) const GPU_STEP_PCT: f64 = 5.0;

/// Smoothed samples a GPU share must have been measured for before it is changed again.
pub(super) const GPU_MIN_SAMPLES: u32 = 3;

/// Online state of a GPU service's share model.
#[derive(Debug, Clone, Default)]
pub(super) struct GpuModel {
    /// Effective share the samples below were taken at.
    share: Option<u8>,
    /// Exponentially weighted ln(p99/target) at that share, and how many samples it holds.
    log_q: Option<f64>,
    samples: u32,
    /// Busy GPU fraction of its streams, smoothed.
    util: Option<f64>,
    /// Share and smoothed ln(p99/target) before the last change, for learning the exponent.
    before: Option<(u8, f64)>,
    /// Learned exponent.
    exponent: Option<f64>,
    /// Samples to skip after a restart (the interval that held the downtime).
    skip: u32,
    /// Since when the share has had a surplus worth giving back.
    surplus_since_ms: Option<u64>,
    /// Whether the share has been chosen from a measurement once (the first choice needs
    /// only one sample; later ones need [`GPU_MIN_SAMPLES`]).
    placed: bool,
}

/// The share a GPU service is given this tick, before the GPU's services are fitted.
#[derive(Debug, Clone, Copy, PartialEq)]
struct ShareAsk {
    /// Share in force (effective), percent.
    now: f64,
    /// Share wanted, percent (not yet in steps).
    want: f64,
    /// Share published in the plan in force.
    published: Option<u8>,
    /// The published share differs from the effective one: a restart is pending.
    pending: bool,
}

impl GpuModel {
    /// Follows the effective share: after a change (a restart completed) the interval that
    /// held the downtime says nothing of the new share and is skipped, and the smoothed
    /// tail starts over (the old one is kept for learning the exponent).
    fn follow(&mut self, effective: Option<u8>, live: bool) {
        if self.share == effective {
            return;
        }
        if let (Some(s), Some(q)) = (self.share, self.log_q.filter(|_| self.samples >= 3)) {
            self.before = Some((s, q));
        }
        // A live change (MPS v3) has no downtime to skip.
        if self.share.is_some() && !live {
            self.skip = 1;
        }
        self.share = effective;
        self.log_q = None;
        self.samples = 0;
        self.util = None;
        self.surplus_since_ms = None;
    }

    /// Adds one interval's readings (unless skipped or a restart is pending) and learns the
    /// exponent once the new share has [`GPU_MIN_SAMPLES`] samples.
    fn observe(&mut self, pending: bool, log_q: Option<f64>, gpu_util_pct: Option<f64>) {
        if self.skip > 0 {
            self.skip -= 1;
            return;
        }
        if pending {
            return;
        }
        if let Some(q) = log_q {
            // Few requests per interval make the p99 noisy; smooth it.
            self.log_q = Some(self.log_q.map_or(q, |old| 0.7 * old + 0.3 * q));
            self.samples += 1;
        }
        if let Some(u) = gpu_util_pct {
            let u = u / 100.0;
            self.util = Some(self.util.map_or(u, |old| 0.7 * old + 0.3 * u));
        }
        // Learn the exponent from the change: the smoothed tail before and after.
        if let (Some((s0, q0)), Some(s1), Some(q1)) = (self.before, self.share, self.log_q) {
            if self.samples >= 3 && s0 != s1 {
                let e = ((q0 - q1) / (f64::from(s1) / f64::from(s0)).ln()).clamp(0.2, 1.2);
                self.exponent = Some(self.exponent.map_or(e, |old| 0.5 * old + 0.5 * e));
                self.before = None;
            }
        }
    }

    /// Smallest share with `q - e*ln(s'/s) + k*sigma <= ln(limit)` and the busy fraction of
    /// its streams under 0.8, from the share in force `share_now`.
    fn need(&self, q: f64, share_now: f64, e: f64, limit: f64, k: f64) -> f64 {
        // The spread of the smoothed tail shrinks with samples.
        let sigma = 0.1 + 0.3 / f64::from(self.samples.max(1)).sqrt();
        let by_tail = share_now * ((q + k * sigma - limit.ln()) / e).exp();
        let by_util = self
            .util
            .map_or(1.0, |u| share_now * (u / 0.8).powf(1.0 / e));
        by_tail.max(by_util).clamp(1.0, 100.0)
    }

    /// The share to publish: restart spacing and hysteresis over what is wanted. Grows at
    /// once, shrinks only after a lasting, sizeable surplus, holds while a restart is
    /// pending or on too few samples. Where a change costs nothing (`live`: no restart),
    /// a surplus of one step is given back as soon as it has been measured.
    fn choose(&mut self, ask: ShareAsk, cfg: &MlConfig, now_ms: u64, live: bool) -> u8 {
        let step = |x: f64| {
            let x = (x / GPU_STEP_PCT).ceil() * GPU_STEP_PCT;
            u8::try_from(cohabit_core::whole(x.clamp(GPU_STEP_PCT, 100.0))).unwrap_or(100)
        };
        let (want, share_now) = (ask.want, ask.now);
        let now_pct = u8::try_from(cohabit_core::whole(share_now)).unwrap_or(100);
        let mut chosen = now_pct;
        let (hysteresis, shrink_after_ms) = if live {
            (GPU_STEP_PCT, 0)
        } else {
            (f64::from(cfg.gpu_hysteresis_pct), cfg.gpu_shrink_after_ms)
        };
        let enough = self.samples >= GPU_MIN_SAMPLES || !self.placed;
        if let (false, true, Some(q)) = (ask.pending, enough, self.log_q) {
            let first = !self.placed;
            self.placed = true;
            // Grow when the pessimistic need is a step above the share and the smoothed
            // tail is past the margin (or at the first placement).
            if want > share_now + GPU_STEP_PCT - 0.5 && (first || q > cfg.margin.ln()) {
                chosen = step(want);
                self.surplus_since_ms = None;
            } else if want + hysteresis < share_now {
                let since = *self.surplus_since_ms.get_or_insert(now_ms);
                if now_ms >= since + shrink_after_ms {
                    chosen = step(want);
                    self.surplus_since_ms = None;
                }
            } else {
                self.surplus_since_ms = None;
            }
        }
        if ask.pending {
            chosen = ask.published.unwrap_or(now_pct);
        }
        chosen
    }
}

impl MlPolicy {
    /// A GPU service: its share from the online queueing model, its CPU side from its
    /// measured CPU use.
    pub(super) fn plan_gpu_service(
        &mut self,
        obs: &Observation,
        name: &str,
        now_ms: u64,
    ) -> ServicePlan {
        let cfg = self.cfg;
        let o = obs.services.iter().find(|o| o.spec.name == name);
        let target = o.and_then(|o| o.spec.p99_target_ms()).unwrap_or(1.0);
        let sample = o.map(|o| o.sample.clone()).unwrap_or_default();
        let current = obs.current.services.get(name).copied();
        let published = current.and_then(|a| a.gpu_mps_pct);
        let effective = o.and_then(|o| o.gpu_mps_effective_pct).or(published);
        let live = o.and_then(|o| o.spec.gpu).is_some_and(|i| self.live(i));
        let st = self.state.entry(name.to_string()).or_default();
        st.seen = true;
        let g = &mut st.gpu;
        g.follow(effective, live);
        let pending = published != effective;
        g.observe(pending, log_qos_ratio(&sample, target), sample.gpu_util_pct);
        let e = g.exponent.unwrap_or(cfg.gpu_exponent_prior);
        let share_now = f64::from(effective.unwrap_or(100).max(1));
        let (want, why) = match g.log_q {
            _ if pending => (
                published.map_or(share_now, f64::from),
                "gpu share waits for the client restart".to_string(),
            ),
            None => (
                share_now,
                "gpu hold (no latency reading at this share yet)".to_string(),
            ),
            Some(q) => (
                g.need(q, share_now, e, cfg.margin, cfg.k_sigma),
                format!(
                    "gpu share for p99/target {:.2} at {share_now:.0} % (exponent {e:.2}, {} samples)",
                    q.exp(),
                    g.samples
                ),
            ),
        };
        let ask = ShareAsk {
            now: share_now,
            want,
            published,
            pending,
        };
        let chosen = g.choose(ask, &cfg, now_ms, live);
        let over_target = slack(obs, name).is_some_and(|s| s < 0.0);
        let cores = cpu_side_cores(&sample, current.map_or(1, |a| a.cores), over_target, g);
        ServicePlan {
            gpu_pct: Some(chosen),
            ..ServicePlan::fixed(name, cores, 1, Reason::new(DecisionPath::Model, why), false)
        }
    }

    /// Whether a share change on `gpu` reaches running clients without a restart.
    fn live(&self, gpu: u32) -> bool {
        self.ctx
            .host
            .gpus
            .get(gpu as usize)
            .is_some_and(|g| g.share_change == ShareChange::Live)
    }

    /// Keeps the GPU services on each GPU within 99 % (the pool keeps 1 %), by
    /// [`fit_shares`].
    pub(super) fn fit_gpu(&self, plans: &mut [ServicePlan], obs: &Observation) {
        let keep_for_pool = u32::from(self.ctx.has_gpu_best_effort());
        let room = f64::from(100 - keep_for_pool);
        for gpu in 0..u32::try_from(self.ctx.host.gpus.len()).unwrap_or(0) {
            let idx: Vec<usize> = (0..plans.len())
                .filter(|&i| {
                    plans[i].gpu_pct.is_some()
                        && self
                            .ctx
                            .specs
                            .iter()
                            .any(|s| s.name == plans[i].name && s.gpu == Some(gpu))
                })
                .collect();
            let want: Vec<f64> = idx
                .iter()
                .map(|&i| f64::from(plans[i].gpu_pct.unwrap_or(0)))
                .collect();
            let cur: Vec<f64> = idx
                .iter()
                .zip(&want)
                .map(|(&i, w)| {
                    obs.current
                        .services
                        .get(&plans[i].name)
                        .and_then(|a| a.gpu_mps_pct)
                        .map_or(*w, f64::from)
                })
                .collect();
            let Some(shares) = fit_shares(&want, &cur, room) else {
                continue;
            };
            for (&i, s) in idx.iter().zip(shares) {
                plans[i].gpu_pct = s;
                plans[i]
                    .reason
                    .text
                    .push_str("; GPU full: growth limited to what is free");
            }
        }
    }
}

/// The CPU side of a GPU service (pre- and post-processing), sized from its measured busy
/// cores; one over its target with no latency reading at its share yet keeps what it has.
fn cpu_side_cores(sample: &Sample, cur_cores: u32, over_target: bool, g: &GpuModel) -> u32 {
    let busy = sample.cpu_busy_cores.unwrap_or(0.0);
    u32::try_from(cohabit_core::whole((busy / 0.5).ceil().max(1.0)))
        .unwrap_or(1)
        .max(if over_target && g.log_q.is_none() {
            cur_cores
        } else {
            1
        })
}

/// The degrade rule of one GPU: `want` and `cur` are the shares wanted and in force (%) of
/// its services, `room` what they may have together. `None` when the wants fit. Otherwise,
/// at the first placement (or when even the services that want less overfill it) the wants
/// are scaled to fit; later, services that want less take what they want, and those that
/// want more grow only into what is free, in proportion to how much more they want, so no
/// share is taken from a service that still needs it and nothing oscillates. A change of
/// less than a step is not worth a restart.
pub(super) fn fit_shares(want: &[f64], cur: &[f64], room: f64) -> Option<Vec<Option<u8>>> {
    if want.iter().sum::<f64>() <= room {
        return None;
    }
    let fixed: f64 = want
        .iter()
        .zip(cur)
        .filter(|(w, c)| w <= c)
        .map(|(w, _)| w)
        .sum();
    let growing: f64 = want
        .iter()
        .zip(cur)
        .filter(|(w, c)| w > c)
        .map(|(_, c)| c)
        .sum();
    let free = room - fixed - growing;
    let extra: f64 = want.iter().zip(cur).map(|(w, c)| (w - c).max(0.0)).sum();
    let shares: Vec<f64> = if free >= 0.0 && extra > 0.0 {
        want.iter()
            .zip(cur)
            .map(|(w, c)| {
                if w > c {
                    c + free * (w - c) / extra
                } else {
                    *w
                }
            })
            .collect()
    } else {
        let total: f64 = want.iter().sum();
        want.iter().map(|w| w * room / total).collect()
    };
    let out = shares
        .iter()
        .zip(cur)
        .map(|(s, c)| {
            // A restart for less than a step is not worth it.
            let s = if (s - c).abs() < GPU_STEP_PCT {
                *c
            } else {
                s.floor().max(1.0)
            };
            u8::try_from(cohabit_core::whole(s)).ok()
        })
        .collect();
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A model placed at `share` with `samples` smoothed readings of `log_q`.
    fn placed(share: u8, log_q: f64, samples: u32) -> GpuModel {
        GpuModel {
            share: Some(share),
            log_q: Some(log_q),
            samples,
            placed: true,
            ..GpuModel::default()
        }
    }

    fn ask(now: f64, want: f64) -> ShareAsk {
        ShareAsk {
            now,
            want,
            published: Some(40),
            pending: false,
        }
    }

    #[test]
    fn a_share_never_changes_while_a_restart_is_pending() {
        let cfg = MlConfig::default();
        // Far over the target, wanting 80 % at 40 %: but 60 % was published and the client
        // has not restarted yet. The published share stays.
        let mut g = placed(40, 1.0, 10);
        let pending = ShareAsk {
            published: Some(60),
            pending: true,
            ..ask(40.0, 80.0)
        };
        assert_eq!(g.choose(pending, &cfg, 1_000, false), 60);
        // And the interval's readings are not taken as the new share's.
        g.observe(true, Some(2.0), Some(90.0));
        assert_eq!((g.log_q, g.samples, g.util), (Some(1.0), 10, None));
    }

    #[test]
    fn a_share_never_changes_on_fewer_than_three_samples_after_the_first_placement() {
        let cfg = MlConfig::default();
        // Over the target, wanting 80 % at 40 %, with 2 samples: hold.
        let mut g = placed(40, 0.5, 2);
        assert_eq!(g.choose(ask(40.0, 80.0), &cfg, 1_000, false), 40);
        // With 3 it grows, in steps of 5: 80 -> 80.
        g.samples = 3;
        assert_eq!(g.choose(ask(40.0, 78.0), &cfg, 1_000, false), 80);
        // The very first placement needs one sample only.
        let mut first = GpuModel {
            placed: false,
            ..placed(40, -1.0, 1)
        };
        assert_eq!(first.choose(ask(40.0, 52.0), &cfg, 1_000, false), 55);
    }

    #[test]
    fn a_restart_skips_the_interval_that_held_it_and_starts_the_count_over() {
        let mut g = placed(40, 0.5, 5);
        g.follow(Some(60), false);
        assert_eq!(
            (g.share, g.log_q, g.samples, g.skip),
            (Some(60), None, 0, 1)
        );
        // The tail at 40 % is kept for learning the exponent.
        assert_eq!(g.before, Some((40, 0.5)));
        g.observe(false, Some(0.9), None);
        assert_eq!((g.log_q, g.samples), (None, 0));
        g.observe(false, Some(0.1), None);
        assert_eq!((g.log_q, g.samples), (Some(0.1), 1));
    }

    #[test]
    fn a_share_shrinks_only_after_gpu_shrink_after_ms_of_surplus_beyond_the_hysteresis() {
        let cfg = MlConfig::default();
        // Within the target at 60 %, needing 40 %: a surplus of 20 > 15 points.
        let mut g = placed(60, -0.5, 5);
        assert_eq!(g.choose(ask(60.0, 40.0), &cfg, 10_000, false), 60);
        assert_eq!(g.choose(ask(60.0, 40.0), &cfg, 129_999, false), 60);
        // 120 s after it started, the share shrinks to the need (in steps: 40).
        assert_eq!(g.choose(ask(60.0, 40.0), &cfg, 130_000, false), 40);
        // A surplus of 10 points (< 15) never shrinks it, however long it lasts.
        let mut g = placed(60, -0.5, 5);
        assert_eq!(g.choose(ask(60.0, 50.0), &cfg, 0, false), 60);
        assert_eq!(g.choose(ask(60.0, 50.0), &cfg, 1_000_000, false), 60);
    }

    #[test]
    fn a_surplus_that_pauses_restarts_the_shrink_clock() {
        let cfg = MlConfig::default();
        let mut g = placed(60, -0.5, 5);
        assert_eq!(g.choose(ask(60.0, 40.0), &cfg, 0, false), 60);
        // The need comes back near the share at 100 s: the surplus ends.
        assert_eq!(g.choose(ask(60.0, 55.0), &cfg, 100_000, false), 60);
        assert_eq!(g.choose(ask(60.0, 40.0), &cfg, 110_000, false), 60);
        assert_eq!(g.choose(ask(60.0, 40.0), &cfg, 229_999, false), 60);
        assert_eq!(g.choose(ask(60.0, 40.0), &cfg, 230_000, false), 40);
    }

    #[test]
    fn a_share_within_the_margin_does_not_grow_on_a_pessimistic_need_alone() {
        let cfg = MlConfig::default();
        // ln(0.8) < ln(0.9): the smoothed tail is within the margin.
        let mut g = placed(40, 0.8f64.ln(), 5);
        assert_eq!(g.choose(ask(40.0, 60.0), &cfg, 0, false), 40);
    }

    #[test]
    fn the_exponent_is_learned_from_the_tail_before_and_after_a_change() {
        // 40 % -> 80 % moved the smoothed tail from 0.5 to 0.5 - 0.6 ln 2: e = 0.6.
        let mut g = placed(40, 0.5, 3);
        g.follow(Some(80), false);
        g.skip = 0;
        let q1 = 0.5 - 0.6 * 2f64.ln();
        for _ in 0..3 {
            g.observe(false, Some(q1), None);
        }
        let e = g.exponent.unwrap();
        assert!((e - 0.6).abs() < 1e-9, "{e}");
        assert_eq!(g.before, None);
    }

    #[test]
    fn a_live_share_change_skips_nothing_and_gives_a_surplus_back_at_once() {
        let cfg = MlConfig::default();
        // No restart, no downtime: the next interval already measures the new share.
        let mut g = placed(40, 0.5, 5);
        g.follow(Some(60), true);
        assert_eq!((g.share, g.skip), (Some(60), 0));
        // A surplus of 10 points: given back at once where a change is free, kept (under
        // the 15-point hysteresis) where it costs a restart.
        let mut live = placed(60, -0.5, 5);
        assert_eq!(live.choose(ask(60.0, 50.0), &cfg, 0, true), 50);
        let mut restart = placed(60, -0.5, 5);
        assert_eq!(restart.choose(ask(60.0, 50.0), &cfg, 0, false), 60);
    }

    #[test]
    fn shares_that_fit_are_left_alone() {
        assert_eq!(fit_shares(&[50.0, 49.0], &[30.0, 30.0], 99.0), None);
    }

    #[test]
    fn on_a_full_gpu_growers_share_what_is_free_in_proportion_and_nobody_is_cut() {
        // Room 99. a wants 30 (has 40): takes 30. b wants 60 (has 30), c wants 50 (has 20):
        // free = 99 - 30 - (30 + 20) = 19; extra = 30 + 30 = 60;
        // b = 30 + 19 * 30 / 60 = 39.5 -> 39; c = 20 + 9.5 = 29.5 -> 29.
        let got = fit_shares(&[30.0, 60.0, 50.0], &[40.0, 30.0, 20.0], 99.0).unwrap();
        assert_eq!(got, vec![Some(30), Some(39), Some(29)]);
    }

    #[test]
    fn on_a_full_gpu_a_change_of_less_than_a_step_is_not_made() {
        // Room 99; a wants 60 (has 58), b wants 45 (has 40): free = 99 - 98 = 1;
        // a = 58 + 1 * 2 / 7 ≈ 58.3 and b = 40 + 1 * 5 / 7 ≈ 40.7: each less than 5 from what
        // it has, so both stay.
        let got = fit_shares(&[60.0, 45.0], &[58.0, 40.0], 99.0).unwrap();
        assert_eq!(got, vec![Some(58), Some(40)]);
    }

    #[test]
    fn at_the_first_placement_an_overfull_gpu_scales_every_want() {
        // Nothing in force yet (cur = want): free = 99 - 120 < 0, so scale: 60 * 99 / 120 =
        // 49.5 -> 49 each.
        let got = fit_shares(&[60.0, 60.0], &[60.0, 60.0], 99.0).unwrap();
        assert_eq!(got, vec![Some(49), Some(49)]);
    }
}
