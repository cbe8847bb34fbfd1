//! What the CPU dataset generator ([`crate::gen`]) draws hosts and services from, stated as
//! a table, so that a host or service it never drew can be told apart (issue 45: `ml` judged
//! on foreign hosts, [`foreign_parameters`]).
//!
//! `gen` draws each scene on the one platform preset it is given; the shipped CPU models
//! were generated on `xeon-e5-2697v4` and `xeon-gold-6338` ([`TRAINED_PLATFORMS`]), and a
//! share of scenes on a host without RDT allocation, whose LLC is one way ([`HOST_KINDS`]).
//! A host's shape is therefore one of a few points ([`DRAWN_HOST`]). Its services are
//! catalogue rows as they stand, never changed: each parameter of a row lies within the
//! smallest and largest value over the catalogue's rows of its kind ([`DRAWN_SERVICE`] for
//! the latency-critical CPU services, [`DRAWN_BEST_EFFORT`] for the CPU batch jobs), at a
//! constant load of [`DRAWN_LOAD`] of the knee. The tests check each table against the
//! catalogue and the platforms: every value drawn lies within it and each end is drawn.
//!
//! [`HOST_KINDS`]: crate::gen::HOST_KINDS

use cohabit_sim::catalogue::{Platform, SimHost};
use cohabit_sim::params::{Param, RowKind};
use cohabit_sim::scenario::Scenario;

/// The platform presets the shipped CPU models' datasets were generated on.
pub const TRAINED_PLATFORMS: [Platform; 2] = [Platform::XeonE5_2697V4, Platform::XeonGold6338];

/// A host parameter, named as in a scenario's `[host]` section.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum HostParam {
    /// `cores`: logical cores.
    Cores,
    /// `llc_ways`: LLC ways (CAT's; 1 on a host without RDT allocation).
    LlcWays,
    /// `llc_mb`: LLC size in MiB.
    LlcMb,
    /// `freq_ghz`: core clock.
    FreqGhz,
    /// `mem_bw_gbps`: peak memory bandwidth.
    MemBwGbps,
    /// `mem_latency_ns`: unloaded memory latency.
    MemLatencyNs,
}

impl HostParam {
    /// Every host parameter.
    pub const ALL: [HostParam; 6] = [
        HostParam::Cores,
        HostParam::LlcWays,
        HostParam::LlcMb,
        HostParam::FreqGhz,
        HostParam::MemBwGbps,
        HostParam::MemLatencyNs,
    ];

    /// Its name in a scenario's `[host]` section.
    pub fn name(self) -> &'static str {
        match self {
            HostParam::Cores => "cores",
            HostParam::LlcWays => "llc_ways",
            HostParam::LlcMb => "llc_mb",
            HostParam::FreqGhz => "freq_ghz",
            HostParam::MemBwGbps => "mem_bw_gbps",
            HostParam::MemLatencyNs => "mem_latency_ns",
        }
    }

    /// Its value on `host`.
    pub fn of(self, host: &SimHost) -> f64 {
        let c = &host.capacity;
        match self {
            HostParam::Cores => f64::from(c.cores),
            HostParam::LlcWays => f64::from(c.llc_ways),
            HostParam::LlcMb => c.llc_bytes() as f64 / (1024.0 * 1024.0),
            HostParam::FreqGhz => c.freq_ghz,
            HostParam::MemBwGbps => c.mem_bw_bytes_per_s / 1e9,
            HostParam::MemLatencyNs => host.mem_latency_ns,
        }
    }
}

/// The values the generator draws a host parameter from: the trained platforms' (and a
/// host without RDT allocation's one way). A value within 0.5 % of one of them counts as it.
pub const DRAWN_HOST: [(HostParam, &[f64]); 6] = [
    (HostParam::Cores, &[36.0, 64.0]),
    (HostParam::LlcWays, &[1.0, 12.0, 20.0]),
    (HostParam::LlcMb, &[45.0, 48.0]),
    (HostParam::FreqGhz, &[2.0, 2.3]),
    (HostParam::MemBwGbps, &[76.8, 94.0]),
    (HostParam::MemLatencyNs, &[90.0, 95.0]),
];

/// The smallest and largest value of each parameter of the latency-critical CPU services
/// the generator draws (the catalogue's rows: PARTIES' and OSML's services).
pub const DRAWN_SERVICE: [(Param, f64, f64); 10] = [
    (Param::TargetMs, 0.6, 2500.0),
    (Param::MaxLoad, 14.0, 1_280_000.0),
    (Param::Cv, 0.4, 2.1),
    (Param::Ipc, 0.4, 1.2),
    (Param::LlcMpki, 0.01, 10.48),
    (Param::WssMb, 4.0, 30.0),
    (Param::MInf, 0.002, 0.3),
    (Param::Steepness, 2.0, 3.0),
    (Param::IcacheMpki, 0.0, 33.07),
    (Param::SysShare, 0.0, 0.78),
];

/// The smallest and largest value of each parameter of the best-effort CPU jobs the
/// generator draws (`stream`, `graph`, `compute`).
pub const DRAWN_BEST_EFFORT: [(Param, f64, f64); 6] = [
    (Param::CpiBase, 0.6, 0.9),
    (Param::Apki, 0.5, 60.0),
    (Param::WssMb, 0.5, 2048.0),
    (Param::MInf, 0.01, 0.9),
    (Param::Steepness, 1.0, 3.0),
    (Param::Mlp, 2.0, 6.0),
];

/// The constant load of a latency-critical service in a scene, as a fraction of its knee
/// (`gen` draws it uniformly).
pub const DRAWN_LOAD: (f64, f64) = (0.03, 0.4);

/// Where a scenario leaves what the generator draws.
#[derive(Debug, Clone, PartialEq)]
pub enum Foreign {
    /// A host parameter none of the trained platforms has.
    Host {
        /// The parameter.
        param: HostParam,
        /// The scenario's value.
        value: f64,
    },
    /// A parameter of a service's or job's row outside the catalogue's range for its kind,
    /// or a kind of row the CPU generator never draws (a GPU one).
    Physics {
        /// The service or job.
        service: String,
        /// The parameter.
        param: Param,
        /// The scenario's value.
        value: f64,
    },
}

impl std::fmt::Display for Foreign {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Foreign::Host { param, value } => {
                let drawn = drawn_host(*param).unwrap_or(&[]);
                write!(f, "host.{} = {value} (drawn: {drawn:?})", param.name())
            }
            Foreign::Physics {
                service,
                param,
                value,
            } => write!(f, "{service}: {param} = {value}"),
        }
    }
}

/// The values the generator draws host parameter `p` from.
pub fn drawn_host(p: HostParam) -> Option<&'static [f64]> {
    DRAWN_HOST.iter().find(|(q, _)| *q == p).map(|(_, v)| *v)
}

/// The range the generator draws parameter `p` of a row of `kind` from; `None` for a
/// parameter or kind it never draws (a GPU row's).
pub fn drawn_physics(kind: RowKind, p: Param) -> Option<(f64, f64)> {
    let table: &[(Param, f64, f64)] = match kind {
        RowKind::Service => &DRAWN_SERVICE,
        RowKind::BestEffort => &DRAWN_BEST_EFFORT,
        RowKind::GpuService | RowKind::GpuBestEffort => &[],
    };
    table
        .iter()
        .find(|(q, ..)| *q == p)
        .map(|(_, lo, hi)| (*lo, *hi))
}

/// Whether `v` is one of `values` (within 0.5 %).
fn one_of(v: f64, values: &[f64]) -> bool {
    values.iter().any(|d| (v - d).abs() <= 0.005 * d.abs())
}

/// Every parameter of `sc`'s host and of its services' rows that the generator never draws:
/// empty for a scenario within what the shipped models were trained on.
pub fn foreign_parameters(sc: &Scenario) -> Vec<Foreign> {
    let mut out: Vec<Foreign> = HostParam::ALL
        .into_iter()
        .map(|param| (param, param.of(&sc.host)))
        .filter(|(param, value)| !drawn_host(*param).is_some_and(|d| one_of(*value, d)))
        .map(|(param, value)| Foreign::Host { param, value })
        .collect();
    for s in &sc.services {
        let kind = s.model.kind();
        for (param, value) in s.model.physics.iter() {
            let inside = drawn_physics(kind, param)
                .is_some_and(|(lo, hi)| (lo * (1.0 - 1e-9)..=hi * (1.0 + 1e-9)).contains(&value));
            if !inside {
                out.push(Foreign::Physics {
                    service: s.spec.name.clone(),
                    param,
                    value,
                });
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use cohabit_sim::catalogue;

    use super::*;
    use crate::gen::{cpu_services, HOST_KINDS};

    /// The smallest and largest value of `p` over the catalogue models named `names`.
    fn span(names: &[&str], p: Param) -> (f64, f64) {
        names
            .iter()
            .filter_map(|n| catalogue::model(n)?.physics.get(p))
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
                (lo.min(v), hi.max(v))
            })
    }

    #[test]
    fn the_service_tables_are_the_span_of_the_rows_the_generator_draws() {
        let lc = cpu_services();
        assert!(lc.len() >= 10, "{lc:?}");
        for (p, lo, hi) in DRAWN_SERVICE {
            assert_eq!(span(&lc, p), (lo, hi), "{p}");
        }
        assert_eq!(
            DRAWN_SERVICE.map(|r| r.0).as_slice(),
            RowKind::Service.params(),
            "every parameter of a service row"
        );
        for (p, lo, hi) in DRAWN_BEST_EFFORT {
            assert_eq!(span(&crate::gen::BEST_EFFORT, p), (lo, hi), "{p}");
        }
        assert_eq!(
            DRAWN_BEST_EFFORT.map(|r| r.0).as_slice(),
            RowKind::BestEffort.params()
        );
    }

    #[test]
    fn the_host_table_is_the_trained_platforms_and_a_host_without_allocation() {
        for p in HostParam::ALL {
            let mut values: Vec<f64> = TRAINED_PLATFORMS
                .iter()
                .map(|pl| p.of(&pl.host()))
                .collect();
            if p == HostParam::LlcWays && HOST_KINDS.iter().any(|(k, _)| !k.allocation) {
                values.push(1.0);
            }
            let drawn = drawn_host(p).unwrap();
            for v in &values {
                assert!(one_of(*v, drawn), "{}: {v} not in {drawn:?}", p.name());
            }
            for d in drawn {
                assert!(one_of(*d, &values), "{}: {d} never drawn", p.name());
            }
        }
    }

    #[test]
    fn the_built_in_cpu_scenarios_are_within_the_drawn_ranges_but_a_changed_host_is_not() {
        for name in cohabit_sim::scenario::builtin_names() {
            let sc = Scenario::load(name).unwrap();
            if sc.services.iter().any(|s| s.spec.gpu.is_some()) {
                continue;
            }
            for p in TRAINED_PLATFORMS {
                let name_p = Platform::ALL.iter().find(|(_, q)| *q == p).unwrap().0;
                let on = sc.on_platform(name_p).unwrap();
                let foreign: Vec<String> = foreign_parameters(&on)
                    .iter()
                    .map(ToString::to_string)
                    .collect();
                assert!(foreign.is_empty(), "{name} on {name_p}: {foreign:?}");
            }
        }
        let mut sc = Scenario::load("demo").unwrap();
        sc.host.capacity.cores = 20;
        let foreign = foreign_parameters(&sc);
        assert_eq!(
            foreign,
            vec![Foreign::Host {
                param: HostParam::Cores,
                value: 20.0
            }]
        );
        assert!(foreign[0].to_string().contains("host.cores = 20"));
    }
}
