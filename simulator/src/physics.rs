//! The closed-form pieces of the simulated host, each a pure function.
//!
//! Problem: predict, for one interval, the tail latency of latency-critical services and the
//! progress of best-effort jobs that share cores, LLC ways, memory bandwidth and GPUs.
//!
//! Approach: a small analytical model, deliberately simple and documented, that keeps the
//! shapes that matter to a controller (cliffs, saturation, interference), not cycle accuracy.
//!
//! - Miss-ratio curve ([`MissRatioCurve`]): `m(c) = m_inf + (1 - m_inf) / (1 + (c / wss)^s)`,
//!   non-increasing in the cache `c` a service holds; a large steepness `s` gives a cache
//!   cliff near the working-set size `wss`.
//! - CPI ([`cpi`]): `CPI = CPI_base + APKI/1000 * m(c) * L_mem * f / MLP` (docs/DESIGN.md 4).
//! - Memory latency ([`memory_latency_ns`]): `L = L0 * (1 + k * u / (1 - u))` with `u` the
//!   total bandwidth demand over the peak, clipped below 1 (a queueing term).
//! - MBA ([`mba_cpi`]): Intel MBA throttles each core of a group by delaying its memory
//!   requests. We model the throttle as a queue in front of memory with a per-core rate of
//!   `mba% * per-core peak` bytes/s: a core whose demand is a fraction `u` of that rate
//!   sees `L0 * u / (1 - u)` of extra latency per miss (solved to a fixed point, since the
//!   slower core demands less), and can never exceed the rate (the CPI at which its demand
//!   fits). A cache-resident service needs almost no bandwidth and is not slowed.
//! - Queueing ([`mgc_p99_s`]): each latency-critical service is an M/G/c queue. The waiting
//!   probability comes from Erlang C; the waiting-time tail of M/M/c, `P(W > t) = C e^{-(cμ-λ)t}`,
//!   is stretched by the Allen–Cunneen factor `(1 + cv²)/2` for general service times; the
//!   service time itself is lognormal with the service's coefficient of variation. The p99
//!   is the sum of the waiting and service-time 99th percentiles (an upper bound, exact when
//!   one of them dominates). It is infinite at or beyond saturation.
//! - GPU ([`gpu_time_scale`]): per-request GPU time scales as `(1/share)^α` with `α < 1`:
//!   kernels of small inference batches cannot fill the SMs they are given, so more share
//!   helps less than linearly.

/// Bytes moved from memory per LLC miss (one cache line).
pub const LINE_BYTES: f64 = 64.0;

/// The standard normal 99th percentile.
const Z99: f64 = 2.326_347_874;

/// A parametric miss-ratio curve over the LLC capacity a service holds.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MissRatioCurve {
    /// Working-set size: the capacity at which half of the reducible misses are gone.
    pub wss_bytes: f64,
    /// Miss ratio with unlimited cache (compulsory and streaming misses).
    pub m_inf: f64,
    /// How sharp the knee is; above ~3 the curve has a cliff.
    pub steepness: f64,
}

impl MissRatioCurve {
    /// Fraction of LLC accesses that miss when the service holds `cache_bytes`.
    pub fn miss_ratio(&self, cache_bytes: f64) -> f64 {
        let c = cache_bytes.max(0.0);
        let x = (c / self.wss_bytes).powf(self.steepness);
        self.m_inf + (1.0 - self.m_inf) / (1.0 + x)
    }
}

/// Cycles per instruction with the given miss ratio and memory latency (before MBA).
pub fn cpi(
    cpi_base: f64,
    apki: f64,
    miss_ratio: f64,
    mem_latency_ns: f64,
    freq_ghz: f64,
    mlp: f64,
) -> f64 {
    cpi_base + apki / 1000.0 * miss_ratio * mem_latency_ns * freq_ghz / mlp
}

/// CPI under an MBA throttle of `core_cap_bytes_per_s` per core: the throttle's queueing
/// delay is added to every miss, and the result never lets the core exceed the cap.
#[allow(clippy::too_many_arguments)]
pub fn mba_cpi(
    cpi_base: f64,
    apki: f64,
    miss_ratio: f64,
    mem_latency_ns: f64,
    idle_latency_ns: f64,
    freq_ghz: f64,
    mlp: f64,
    core_cap_bytes_per_s: f64,
) -> f64 {
    let bpi = apki / 1000.0 * miss_ratio * LINE_BYTES;
    let mut c = cpi(cpi_base, apki, miss_ratio, mem_latency_ns, freq_ghz, mlp);
    if bpi <= 0.0 || core_cap_bytes_per_s <= 0.0 || core_cap_bytes_per_s.is_infinite() {
        return c;
    }
    for _ in 0..30 {
        let demand = freq_ghz * 1e9 / c * bpi;
        let u = (demand / core_cap_bytes_per_s).min(0.97);
        let extra = idle_latency_ns * u / (1.0 - u);
        let next = cpi(
            cpi_base,
            apki,
            miss_ratio,
            mem_latency_ns + extra,
            freq_ghz,
            mlp,
        );
        c = 0.5 * c + 0.5 * next;
    }
    mba_limited_cpi(c, bpi, freq_ghz, core_cap_bytes_per_s)
}

/// CPI once Intel MBA caps each core at `core_cap_bytes_per_s`: a core that would move
/// more runs slower until its demand fits.
pub fn mba_limited_cpi(
    cpi: f64,
    bytes_per_instruction: f64,
    freq_ghz: f64,
    core_cap_bytes_per_s: f64,
) -> f64 {
    let demand = freq_ghz * 1e9 / cpi * bytes_per_instruction;
    if demand > core_cap_bytes_per_s && core_cap_bytes_per_s > 0.0 {
        freq_ghz * 1e9 * bytes_per_instruction / core_cap_bytes_per_s
    } else {
        cpi
    }
}

/// Loaded memory latency for a total bandwidth demand (queueing at the memory controller).
pub fn memory_latency_ns(
    idle_ns: f64,
    demand_bytes_per_s: f64,
    peak_bytes_per_s: f64,
    queue_factor: f64,
) -> f64 {
    let u = (demand_bytes_per_s / peak_bytes_per_s).clamp(0.0, 0.97);
    idle_ns * (1.0 + queue_factor * u / (1.0 - u))
}

/// Erlang C: probability that an arrival to an M/M/c queue with offered load `a = λ/μ`
/// waits. Uses the stable Erlang B recursion. Returns 1 at or beyond saturation.
pub fn erlang_c(c: u32, a: f64) -> f64 {
    let cf = f64::from(c);
    if c == 0 || a >= cf {
        return 1.0;
    }
    let mut b = 1.0;
    for k in 1..=c {
        b = a * b / (f64::from(k) + a * b);
    }
    let rho = a / cf;
    b / (1.0 - rho * (1.0 - b))
}

/// 99th percentile of a lognormal service time with the given mean and coefficient of variation.
pub fn service_time_p99_s(mean_s: f64, cv: f64) -> f64 {
    if cv <= 0.0 {
        return mean_s;
    }
    let sigma2 = (1.0 + cv * cv).ln();
    let sigma = sigma2.sqrt();
    mean_s * (Z99 * sigma - sigma2 / 2.0).exp()
}

/// p99 response time (seconds) of an M/G/c queue: arrival rate `lambda`, per-server service
/// rate `mu`, `c` servers, service-time coefficient of variation `cv`. Infinite when
/// `lambda >= c * mu` (the queue grows without bound).
pub fn mgc_p99_s(lambda: f64, mu: f64, c: u32, cv: f64) -> f64 {
    if c == 0 || mu <= 0.0 {
        return f64::INFINITY;
    }
    let service = service_time_p99_s(1.0 / mu, cv);
    if lambda <= 0.0 {
        return service;
    }
    let capacity = f64::from(c) * mu;
    if lambda >= capacity {
        return f64::INFINITY;
    }
    let p_wait = erlang_c(c, lambda / mu);
    let wait = if p_wait > 0.01 {
        (p_wait / 0.01).ln() / (capacity - lambda) * (1.0 + cv * cv) / 2.0
    } else {
        0.0
    };
    wait + service
}

/// How much longer a GPU request takes with an MPS share `share` (0–1] than with the whole GPU.
pub fn gpu_time_scale(share: f64, exponent: f64) -> f64 {
    let s = share.clamp(0.01, 1.0);
    s.powf(-exponent)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const MB: f64 = 1024.0 * 1024.0;

    #[test]
    fn erlang_c_matches_known_values() {
        // M/M/1: P(wait) = rho.
        assert!((erlang_c(1, 0.7) - 0.7).abs() < 1e-12);
        // M/M/2 with a = 1: C = 1/3.
        assert!((erlang_c(2, 1.0) - 1.0 / 3.0).abs() < 1e-12);
        assert_eq!(erlang_c(4, 4.0), 1.0);
    }

    #[test]
    fn mm1_p99_matches_the_closed_form_when_waiting_dominates() {
        // M/M/1 response time is exponential with rate mu - lambda: p99 = ln(100)/(mu-lambda).
        let (lambda, mu) = (0.95, 1.0);
        let exact = 100f64.ln() / (mu - lambda);
        let ours = mgc_p99_s(lambda, mu, 1, 1.0);
        // Sum of quantiles over-estimates, by at most the service-time p99.
        assert!(
            ours >= exact * 0.95 && ours <= exact + service_time_p99_s(1.0, 1.0),
            "{ours} vs {exact}"
        );
    }

    #[test]
    fn p99_grows_without_bound_as_load_approaches_capacity() {
        let mut last = 0.0;
        for rho in [0.5, 0.9, 0.99, 0.999, 0.9999] {
            let p = mgc_p99_s(rho * 8.0, 1.0, 8, 1.0);
            assert!(p > last, "p99 must grow with load: {p} at rho {rho}");
            last = p;
        }
        assert!(
            last > 1000.0,
            "near capacity the p99 must be huge, got {last}"
        );
        assert!(mgc_p99_s(8.0, 1.0, 8, 1.0).is_infinite());
    }

    #[test]
    fn more_variable_service_times_have_longer_tails() {
        assert!(mgc_p99_s(6.0, 1.0, 8, 2.0) > mgc_p99_s(6.0, 1.0, 8, 1.0));
        assert!(mgc_p99_s(6.0, 1.0, 8, 1.0) > mgc_p99_s(6.0, 1.0, 8, 0.3));
    }

    #[test]
    fn mba_cap_slows_bandwidth_heavy_code_and_not_cache_resident_code() {
        let f = 2.3;
        let cap = 0.2 * 12e9;
        // 1.5 bytes per instruction at CPI 1.2: ~2.9 GB/s per core, over the cap.
        assert!(mba_limited_cpi(1.2, 1.5, f, cap) > 1.2 * 1.1);
        // 0.001 bytes per instruction: nowhere near it.
        assert_eq!(mba_limited_cpi(1.0, 0.001, f, cap), 1.0);
    }

    #[test]
    fn an_mba_throttle_delays_every_miss_of_a_bandwidth_user() {
        // ~1.3 GB/s per core under a 2.4 GB/s throttle: not capped, but delayed.
        let free = mba_cpi(0.3, 29.0, 0.95, 90.0, 90.0, 2.3, 2.0, 12e9);
        let throttled = mba_cpi(0.3, 29.0, 0.95, 90.0, 90.0, 2.3, 2.0, 2.4e9);
        assert!(throttled > free * 1.2, "{free} -> {throttled}");
        let resident_free = mba_cpi(0.9, 4.0, 0.001, 90.0, 90.0, 2.3, 2.0, 12e9);
        let resident = mba_cpi(0.9, 4.0, 0.001, 90.0, 90.0, 2.3, 2.0, 2.4e9);
        assert!((resident / resident_free - 1.0).abs() < 0.01);
    }

    #[test]
    fn memory_latency_rises_with_bandwidth_demand_and_stays_finite() {
        let l0 = memory_latency_ns(90.0, 0.0, 76.8e9, 0.5);
        let l5 = memory_latency_ns(90.0, 38.4e9, 76.8e9, 0.5);
        let l_over = memory_latency_ns(90.0, 200e9, 76.8e9, 0.5);
        assert_eq!(l0, 90.0);
        assert!(l5 > l0 && l_over > l5 && l_over.is_finite());
    }

    #[test]
    fn gpu_speed_scales_sub_linearly_with_share() {
        let t30 = gpu_time_scale(0.3, 0.6);
        assert!(t30 > 1.0 && t30 < 1.0 / 0.3, "{t30}");
        assert_eq!(gpu_time_scale(1.0, 0.6), 1.0);
    }

    proptest! {
        #[test]
        fn more_cache_never_raises_the_miss_ratio(
            wss in 0.5f64..200.0, m_inf in 0.0f64..0.9, s in 0.5f64..8.0,
            c1 in 0.0f64..100.0, extra in 0.0f64..100.0,
        ) {
            let mrc = MissRatioCurve { wss_bytes: wss * MB, m_inf, steepness: s };
            let a = mrc.miss_ratio(c1 * MB);
            let b = mrc.miss_ratio((c1 + extra) * MB);
            prop_assert!(b <= a + 1e-12);
            prop_assert!((0.0..=1.0).contains(&a));
        }

        #[test]
        fn more_servers_never_raise_the_p99(lambda in 0.1f64..30.0, c in 1u32..40, cv in 0.1f64..2.5) {
            let a = mgc_p99_s(lambda, 1.0, c, cv);
            let b = mgc_p99_s(lambda, 1.0, c + 1, cv);
            prop_assert!(b <= a || a.is_infinite());
        }
    }
}
