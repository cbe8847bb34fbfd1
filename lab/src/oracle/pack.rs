//! The oracle's packing: one option per service to satisfy within the ways, resctrl groups
//! and cores left, with the fewest cores for every number of ways used.

use super::{Packing, Placement};

/// Packings of the services in `met` (each in exactly one option) within `w_cap` ways,
/// `budget` resctrl groups besides the pool's and `c_cap` cores: for every number of ways
/// used, the one with the fewest cores. Empty when nothing fits.
///
/// A dynamic programme over subsets of `met` (in increasing order, since every option adds
/// members) × ways used (× groups used, only when the budget could bind), each option
/// covering the lowest member not yet placed, so every packing is found once.
pub(super) fn pack(
    options: &[Placement],
    met: u32,
    w_cap: u32,
    budget: usize,
    c_cap: u32,
) -> Vec<Packing> {
    let w_cap = w_cap as usize;
    let n_met = met.count_ones() as usize;
    let track_groups = budget < n_met;
    let g_dim = if track_groups { budget + 1 } else { 1 };
    let cells = (w_cap + 1) * g_dim;
    let at = |mask: u32, u: usize, g: usize| mask as usize * cells + u * g_dim + g;
    // (cores, option taken, previous ways, previous groups)
    let mut dp: Vec<Option<(u32, usize, usize, usize)>> = vec![None; (met as usize + 1) * cells];
    dp[at(0, 0, 0)] = Some((0, usize::MAX, 0, 0));
    // The options that place each member, in the given order (the same ties as a scan of
    // every option).
    let mut placing: Vec<Vec<usize>> = vec![Vec::new(); 32];
    for (oi, o) in options.iter().enumerate() {
        if o.members & !met == 0 {
            for (k, p) in placing.iter_mut().enumerate() {
                if o.members & (1 << k) != 0 {
                    p.push(oi);
                }
            }
        }
    }
    let mut mask = 0u32;
    loop {
        let remaining = met & !mask;
        if remaining != 0 {
            let lowest = remaining & remaining.wrapping_neg();
            for &oi in &placing[lowest.trailing_zeros() as usize] {
                let o = &options[oi];
                if o.members & !remaining != 0 {
                    continue;
                }
                let next = mask | o.members;
                let (ow, og, oc) = (o.ways() as usize, o.groups(), o.total_cores());
                if ow > w_cap {
                    continue;
                }
                for u in 0..=w_cap.saturating_sub(ow) {
                    for g in 0..g_dim {
                        let Some((cores, ..)) = dp[at(mask, u, g)] else {
                            continue;
                        };
                        let g2 = if track_groups { g + og } else { 0 };
                        let c2 = cores + oc;
                        if g2 >= g_dim || c2 > c_cap {
                            continue;
                        }
                        let cell = &mut dp[at(next, u + ow, g2)];
                        if cell.is_none_or(|(bc, ..)| c2 < bc) {
                            *cell = Some((c2, oi, u, g));
                        }
                    }
                }
            }
        }
        if mask == met {
            break;
        }
        // Next submask of `met` in increasing order.
        mask = (mask.wrapping_sub(met)) & met;
    }
    let mut out = Vec::new();
    for u in 0..=w_cap {
        let Some((cores, g)) = (0..g_dim)
            .filter_map(|g| dp[at(met, u, g)].map(|c| (c.0, g)))
            .min_by_key(|(c, _)| *c)
        else {
            continue;
        };
        let mut taken = Vec::new();
        let (mut m, mut uu, mut gg) = (met, u, g);
        while m != 0 {
            let Some((_, oi, pu, pg)) = dp[at(m, uu, gg)] else {
                break;
            };
            taken.push(options[oi].clone());
            m &= !options[oi].members;
            (uu, gg) = (pu, pg);
        }
        out.push(Packing {
            options: taken,
            ways: u32::try_from(u).unwrap_or(u32::MAX),
            cores,
        });
    }
    out
}
