//! Pinned device memory: each client's limit, latency-critical clients first.

use super::*;

/// Headroom over a client's measured peak in its pinned device-memory limit.
pub const MEM_HEADROOM: f64 = 0.25;
/// Least headroom, MiB.
pub(super) const MEM_HEADROOM_MIN_MIB: u64 = 512;
/// Device memory kept for the driver and MPS servers, fraction of the GPU.
pub(super) const MEM_DRIVER_RESERVE: f64 = 0.03;
/// Least limit a best-effort client gets, MiB (it still starts, and fails its own
/// allocations rather than a latency-critical client's).
pub(super) const MEM_BE_MIN_MIB: u64 = 256;

/// One GPU client's memory for [`plan_pinned_limits`].
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryUse {
    /// Service or job name.
    pub service: String,
    /// Latency-critical (served first) or best effort.
    pub latency_critical: bool,
    /// Most device memory it was seen using, bytes (absent: not measured yet).
    pub peak_bytes: Option<u64>,
}

/// Pinned device-memory limits, MiB, for the clients of one GPU of `total_bytes`.
///
/// Latency-critical clients first: each gets its measured peak plus [`MEM_HEADROOM`] (at
/// least [`MEM_HEADROOM_MIN_MIB`]); one not measured yet gets no limit of its own (absent).
/// Best-effort clients share what is left after the driver's reserve, in proportion to
/// their peaks (equally when unmeasured), at least [`MEM_BE_MIN_MIB`] each. So the sum of
/// best-effort limits never reaches into what latency-critical clients were measured to
/// need, unless that alone overfills the GPU (then best effort gets the minimum).
pub fn plan_pinned_limits(clients: &[MemoryUse], total_bytes: u64) -> BTreeMap<String, u64> {
    const MIB: f64 = 1024.0 * 1024.0;
    let total_mib = total_bytes as f64 / MIB;
    let mut out = BTreeMap::new();
    let mut lc_mib = 0.0;
    for c in clients.iter().filter(|c| c.latency_critical) {
        let Some(peak) = c.peak_bytes else { continue };
        let peak = peak as f64 / MIB;
        let limit = (peak * (1.0 + MEM_HEADROOM)).max(peak + MEM_HEADROOM_MIN_MIB as f64);
        let limit = limit.min(total_mib).ceil();
        lc_mib += limit;
        out.insert(c.service.clone(), cohabit_core::whole(limit));
    }
    let be: Vec<&MemoryUse> = clients.iter().filter(|c| !c.latency_critical).collect();
    let room = (total_mib * (1.0 - MEM_DRIVER_RESERVE) - lc_mib).max(0.0);
    let weight = |c: &MemoryUse| c.peak_bytes.map_or(1.0, |b| (b as f64).max(1.0));
    let weights: f64 = be.iter().map(|c| weight(c)).sum();
    for c in be {
        let share = room * weight(c) / weights;
        let limit = share.floor().max(MEM_BE_MIN_MIB as f64);
        out.insert(c.service.clone(), cohabit_core::whole(limit));
    }
    out
}
