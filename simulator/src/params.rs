//! The parameters of a catalogue row: what a service's physics is built from.
//!
//! Every model of the [catalogue](crate::catalogue) is built from a row of named parameters
//! ([`Physics`]): for a latency-critical CPU service PARTIES' or OSML's published target, max
//! load, IPC and LLC MPKI plus the assumed miss-ratio curve, for the other kinds the assumed
//! profile. A scenario changes any of them by name (`physics = { wss_mb = 40 }` under a
//! `[[service]]` or `[[best_effort]]`) and may state a row of its own (`[[catalogue]]`); the
//! model is then rebuilt and recalibrated from the row ([`crate::catalogue::ServiceModel::build`]).
//! Each parameter has one range a scenario may give it ([`Param::range`]), wide enough for
//! hosts and services far from the built-in ones and narrow enough that the physics stays
//! meaningful (a miss ratio within 0 and 1, a positive working set).

use std::collections::BTreeMap;
use std::fmt;

/// One parameter of a catalogue row, named as in scenario files.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Param {
    /// `target_ms`: the p99 target at the knee, in milliseconds.
    TargetMs,
    /// `max_load`: the load at the knee on the reference host, in requests per second.
    MaxLoad,
    /// `cv`: coefficient of variation of the service time.
    Cv,
    /// `ipc`: instructions per cycle at max load on the reference host (the whole LLC).
    Ipc,
    /// `llc_mpki`: LLC misses per thousand instructions at max load on the reference host.
    LlcMpki,
    /// `wss_mb`: working-set size of the miss-ratio curve (half of the reducible misses gone).
    WssMb,
    /// `m_inf`: miss ratio with unlimited cache (compulsory and streaming misses).
    MInf,
    /// `steepness`: how sharp the miss-ratio curve's knee is (above ~3 a cliff).
    Steepness,
    /// `icache_mpki`: L1i misses per thousand instructions (the kernel path's exposure).
    IcacheMpki,
    /// `sys_share`: share of CPU time in the kernel.
    SysShare,
    /// `cpi_base`: cycles per instruction with every LLC access hitting (best-effort jobs).
    CpiBase,
    /// `apki`: LLC accesses per thousand instructions (best-effort jobs).
    Apki,
    /// `mlp`: memory-level parallelism, misses overlapped on average (best-effort jobs).
    Mlp,
    /// `share_exponent`: α of the GPU share scaling, time ∝ share^-α.
    ShareExponent,
    /// `mem_intensity`: share of the GPU's memory bandwidth it uses while running.
    MemIntensity,
    /// `streams`: concurrent requests on the GPU (a whole number).
    Streams,
    /// `restart_ms`: time to restart its MPS client so a new share takes effect.
    RestartMs,
}

/// The values a scenario may give a parameter: `lo..=hi`, whole numbers only where `whole`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Range {
    /// Smallest value accepted.
    pub lo: f64,
    /// Largest value accepted.
    pub hi: f64,
    /// Whether only whole numbers are accepted.
    pub whole: bool,
}

impl Range {
    const fn of(lo: f64, hi: f64) -> Range {
        Range {
            lo,
            hi,
            whole: false,
        }
    }

    /// Whether `v` is accepted.
    pub fn contains(&self, v: f64) -> bool {
        v.is_finite() && (self.lo..=self.hi).contains(&v) && (!self.whole || v.fract() == 0.0)
    }
}

impl Param {
    /// Every parameter.
    pub const ALL: [Param; 17] = [
        Param::TargetMs,
        Param::MaxLoad,
        Param::Cv,
        Param::Ipc,
        Param::LlcMpki,
        Param::WssMb,
        Param::MInf,
        Param::Steepness,
        Param::IcacheMpki,
        Param::SysShare,
        Param::CpiBase,
        Param::Apki,
        Param::Mlp,
        Param::ShareExponent,
        Param::MemIntensity,
        Param::Streams,
        Param::RestartMs,
    ];

    /// Its name in scenario files.
    pub fn name(self) -> &'static str {
        match self {
            Param::TargetMs => "target_ms",
            Param::MaxLoad => "max_load",
            Param::Cv => "cv",
            Param::Ipc => "ipc",
            Param::LlcMpki => "llc_mpki",
            Param::WssMb => "wss_mb",
            Param::MInf => "m_inf",
            Param::Steepness => "steepness",
            Param::IcacheMpki => "icache_mpki",
            Param::SysShare => "sys_share",
            Param::CpiBase => "cpi_base",
            Param::Apki => "apki",
            Param::Mlp => "mlp",
            Param::ShareExponent => "share_exponent",
            Param::MemIntensity => "mem_intensity",
            Param::Streams => "streams",
            Param::RestartMs => "restart_ms",
        }
    }

    /// The parameter named `name` in scenario files.
    pub fn by_name(name: &str) -> Option<Param> {
        Param::ALL.into_iter().find(|p| p.name() == name)
    }

    /// The values a scenario may give it. Counts and times are positive; shares, miss ratios
    /// and the kernel share lie within 0 and 1; the rest are bounded an order of magnitude or
    /// more beyond any published server service (an IPC of 8, 100 LLC MPKI, a terabyte of
    /// working set).
    pub fn range(self) -> Range {
        match self {
            Param::TargetMs => Range::of(0.01, 600_000.0),
            Param::MaxLoad => Range::of(0.01, 1e8),
            Param::Cv => Range::of(0.05, 10.0),
            Param::Ipc => Range::of(0.05, 8.0),
            Param::LlcMpki => Range::of(0.0, 100.0),
            Param::WssMb => Range::of(0.01, 1e6),
            Param::MInf | Param::SysShare | Param::MemIntensity => Range::of(0.0, 1.0),
            Param::Steepness => Range::of(0.2, 20.0),
            Param::IcacheMpki => Range::of(0.0, 200.0),
            Param::CpiBase => Range::of(0.1, 20.0),
            Param::Apki => Range::of(0.0, 500.0),
            Param::Mlp => Range::of(1.0, 32.0),
            Param::ShareExponent => Range::of(0.05, 1.5),
            Param::Streams => Range {
                lo: 1.0,
                hi: 1024.0,
                whole: true,
            },
            Param::RestartMs => Range::of(0.0, 600_000.0),
        }
    }
}

impl fmt::Display for Param {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What a catalogue row describes, which decides its parameters ([`RowKind::params`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RowKind {
    /// A latency-critical service on the CPU (`service`).
    Service,
    /// A latency-critical inference service on a GPU behind MPS (`gpu-service`).
    GpuService,
    /// A best-effort CPU job (`best-effort`).
    BestEffort,
    /// A best-effort GPU job (`gpu-best-effort`).
    GpuBestEffort,
}

impl RowKind {
    /// Every kind.
    pub const ALL: [RowKind; 4] = [
        RowKind::Service,
        RowKind::GpuService,
        RowKind::BestEffort,
        RowKind::GpuBestEffort,
    ];

    /// Its name in scenario files (`kind = "…"` of a `[[catalogue]]` row).
    pub fn name(self) -> &'static str {
        match self {
            RowKind::Service => "service",
            RowKind::GpuService => "gpu-service",
            RowKind::BestEffort => "best-effort",
            RowKind::GpuBestEffort => "gpu-best-effort",
        }
    }

    /// The parameters a row of this kind has, every one required.
    pub fn params(self) -> &'static [Param] {
        use Param::*;
        match self {
            RowKind::Service => &[
                TargetMs, MaxLoad, Cv, Ipc, LlcMpki, WssMb, MInf, Steepness, IcacheMpki, SysShare,
            ],
            RowKind::GpuService => &[
                TargetMs,
                MaxLoad,
                Cv,
                ShareExponent,
                MemIntensity,
                Streams,
                RestartMs,
            ],
            RowKind::BestEffort => &[CpiBase, Apki, WssMb, MInf, Steepness, Mlp],
            RowKind::GpuBestEffort => &[ShareExponent, MemIntensity, RestartMs],
        }
    }

    /// Whether its services are latency-critical.
    pub fn is_latency_critical(self) -> bool {
        matches!(self, RowKind::Service | RowKind::GpuService)
    }

    fn param_list(self) -> String {
        let names: Vec<&str> = self.params().iter().map(|p| p.name()).collect();
        names.join(", ")
    }
}

impl fmt::Display for RowKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a row's parameters were refused. Each names the parameter by its file name.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PhysicsError {
    /// A name that is no parameter of this kind of row.
    #[error("{key} is not a parameter of a {kind} row; its parameters are {list}", list = kind.param_list())]
    Unknown {
        /// The name given.
        key: String,
        /// The row's kind.
        kind: RowKind,
    },
    /// A parameter outside [`Param::range`].
    #[error(
        "{param} must be {whole}between {lo} and {hi}, got {value}",
        lo = param.range().lo,
        hi = param.range().hi,
        whole = if param.range().whole { "a whole number " } else { "" }
    )]
    OutOfRange {
        /// The parameter.
        param: Param,
        /// The value given.
        value: f64,
    },
    /// A row of its own that lacks a parameter.
    #[error("{param} is missing; a {kind} row needs {list}", list = kind.param_list())]
    Missing {
        /// The parameter.
        param: Param,
        /// The row's kind.
        kind: RowKind,
    },
    /// The row builds a latency-critical service that cannot meet its target at any load
    /// on the reference host (its work per request could not be calibrated).
    #[error(
        "a service with these parameters meets its target at no load on the reference host \
         (knee {knee_rps} requests/s)"
    )]
    NoKnee {
        /// The knee found.
        knee_rps: f64,
    },
}

/// A catalogue row's parameters: every parameter of its kind, each within its range.
#[derive(Debug, Clone, PartialEq)]
pub struct Physics {
    kind: RowKind,
    values: BTreeMap<Param, f64>,
}

impl Physics {
    /// A row of `kind` with `values`, which must give every parameter of the kind once and
    /// nothing else, each within its range.
    pub fn new(
        kind: RowKind,
        values: impl IntoIterator<Item = (Param, f64)>,
    ) -> Result<Physics, PhysicsError> {
        let mut out = Physics {
            kind,
            values: BTreeMap::new(),
        };
        for (p, v) in values {
            out.set(p, v)?;
        }
        if let Some(&param) = kind.params().iter().find(|p| !out.values.contains_key(p)) {
            return Err(PhysicsError::Missing { param, kind });
        }
        Ok(out)
    }

    /// The kind of row.
    pub fn kind(&self) -> RowKind {
        self.kind
    }

    /// The value of `p`, `None` where the kind has no such parameter.
    pub fn get(&self, p: Param) -> Option<f64> {
        self.values.get(&p).copied()
    }

    /// Every parameter and its value, in [`Param`] order.
    pub fn iter(&self) -> impl Iterator<Item = (Param, f64)> + '_ {
        self.values.iter().map(|(p, v)| (*p, *v))
    }

    /// Sets `p` to `v`; refused where the kind has no such parameter or `v` is out of range
    /// (and then nothing changes).
    pub fn set(&mut self, p: Param, v: f64) -> Result<(), PhysicsError> {
        if !self.kind.params().contains(&p) {
            return Err(PhysicsError::Unknown {
                key: p.name().to_string(),
                kind: self.kind,
            });
        }
        if !p.range().contains(v) {
            return Err(PhysicsError::OutOfRange { param: p, value: v });
        }
        self.values.insert(p, v);
        Ok(())
    }

    /// The value of `p`, which [`Physics::new`] guarantees for the parameters of the kind
    /// (NaN for another, which the model builders never ask for).
    pub(crate) fn at(&self, p: Param) -> f64 {
        self.get(p).unwrap_or(f64::NAN)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_parameter_is_found_by_its_name_and_has_a_sane_range() {
        for p in Param::ALL {
            assert_eq!(Param::by_name(p.name()), Some(p));
            let r = p.range();
            assert!(r.lo.is_finite() && r.hi > r.lo && r.lo >= 0.0, "{p}");
        }
        assert_eq!(Param::by_name("wss"), None);
        // Each parameter belongs to some kind of row.
        for p in Param::ALL {
            assert!(RowKind::ALL.iter().any(|k| k.params().contains(&p)), "{p}");
        }
    }

    #[test]
    fn a_row_needs_every_parameter_of_its_kind_and_refuses_others() {
        let gpu_be = [
            (Param::ShareExponent, 0.9),
            (Param::MemIntensity, 0.8),
            (Param::RestartMs, 3000.0),
        ];
        let row = Physics::new(RowKind::GpuBestEffort, gpu_be).unwrap();
        assert_eq!(row.get(Param::MemIntensity), Some(0.8));
        assert_eq!(row.get(Param::Ipc), None);
        let err = Physics::new(RowKind::GpuBestEffort, gpu_be[..2].iter().copied()).unwrap_err();
        assert_eq!(
            err,
            PhysicsError::Missing {
                param: Param::RestartMs,
                kind: RowKind::GpuBestEffort
            }
        );
        let err = Physics::new(
            RowKind::GpuBestEffort,
            gpu_be.iter().copied().chain([(Param::Ipc, 1.0)]),
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("ipc") && err.contains("gpu-best-effort") && err.contains("restart_ms"),
            "{err}"
        );
    }

    #[test]
    fn values_out_of_range_are_refused_by_name() {
        let mut row = Physics::new(
            RowKind::GpuBestEffort,
            [
                (Param::ShareExponent, 0.9),
                (Param::MemIntensity, 0.8),
                (Param::RestartMs, 3000.0),
            ],
        )
        .unwrap();
        for (p, v) in [
            (Param::MemIntensity, 1.5),
            (Param::MemIntensity, f64::NAN),
            (Param::ShareExponent, 0.0),
            (Param::RestartMs, f64::INFINITY),
        ] {
            let err = row.set(p, v).unwrap_err().to_string();
            assert!(err.contains(p.name()), "{err}");
        }
        assert_eq!(row.get(Param::MemIntensity), Some(0.8), "unchanged");
        assert!(!Param::Streams.range().contains(2.5));
        assert!(Param::Streams.range().contains(2.0));
        let err = PhysicsError::OutOfRange {
            param: Param::Streams,
            value: 2.5,
        }
        .to_string();
        assert!(
            err.contains("whole number") && err.contains("streams"),
            "{err}"
        );
    }
}
