//! Platforms and services the simulator knows, calibrated from published tables.
//!
//! Sources (numbers only, cited per paper below; the tables were transcribed from the papers
//! and the OSML repository):
//! - PARTIES (Chen, Delimitrou, Martínez, ASPLOS 2019), Table 2: QoS target (p99 at the
//!   knee), max load, IPC and LLC MPKI at max load for memcached, xapian, nginx, moses,
//!   mongodb and sphinx, and their L1i MPKI and kernel (`sys`) share of CPU time, which size
//!   the kernel path a neighbour's LLC churn hurts ([`KERNEL_LLC_FRACTION`]).
//! - OSML (Liu et al., FAST 2023), `configs.py` of the AI4System-OSML repository: QoS targets
//!   and max loads of img-dnn, masstree, specjbb and silo on a Xeon E5-2697 v4, and the
//!   Xeon E5-2697 v4 and Gold 6338 platforms.
//! - BigHouse (Meisner et al.) empirical service-time distributions: coefficient of
//!   variation 1.13 for search, 2.1 for web, 1.0 for DNS; used for xapian, nginx, memcached.
//!
//! Calibration: a table gives the knee of each service (target p99 at max load). We take the
//! knee on the simulator's reference host ([`Platform::XeonE5_2697V4`], the whole machine to
//! the one service) and solve for the instructions per request that put the simulated p99
//! exactly on the target at max load, unless that would leave the service's own service
//! time too close to its target (then its knee lies beyond the published max load); see
//! `world::calibrate`. Scenario loads are fractions of that simulated knee. The IPC and MPKI from the table fix the
//! base CPI and the LLC access rate; the miss-ratio curve's shape (working-set size,
//! steepness), memory-level parallelism and service-time variability are our assumptions,
//! marked as such below. Those assumptions are checked against published interference
//! measurements in [`crate::sensitivity`] (xapian's streaming share `m_inf` was raised from
//! 0.005 to 0.3 there, and [`KERNEL_LLC_FRACTION`] set). PARTIES measured its knees on a
//! two-socket E5-2699 v4; we reinterpret
//! them on one socket, so a service here is heavier per request than there, not lighter.
//!
//! GPU inference services and the best-effort jobs are not in those tables: their parameters
//! are assumptions chosen to exhibit the behaviour the literature reports (sub-linear
//! MPS scaling of small batches, streaming jobs that saturate memory bandwidth, cache-hungry
//! jobs that pollute the LLC).
//!
//! Every model is built from a row of named parameters ([`Physics`], [`crate::params`]) by
//! [`ServiceModel::build`]; a scenario may change any parameter of a row or state rows of its
//! own (`physics = { … }`, `[[catalogue]]`: [`crate::scenario`]), and the model is rebuilt
//! and recalibrated the same way.

use std::sync::Arc;

use cohabit_core::{GpuCapacity, HostCapacity};

use crate::params::{Param, Physics, PhysicsError, RowKind};
use crate::physics::MissRatioCurve;

const MB: f64 = 1024.0 * 1024.0;

/// A simulated server platform: what the controller sees ([`HostCapacity`]) plus the
/// physical constants only the simulator needs.
#[derive(Debug, Clone, PartialEq)]
pub struct SimHost {
    /// The preset this host was built from (`xeon-e5-2697v4`, …); overrides in a scenario
    /// keep it.
    pub preset: &'static str,
    /// Capacities shared with the controller.
    pub capacity: HostCapacity,
    /// Unloaded memory latency.
    pub mem_latency_ns: f64,
    /// Memory bandwidth one core can pull on its own (the base of the MBA per-core cap).
    pub core_peak_bw_bytes_per_s: f64,
    /// Strength of the memory-controller queueing term.
    pub mem_queue_factor: f64,
}

/// Built-in platforms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Platform {
    /// Intel Xeon E5-2697 v4 (18 cores / 36 threads, 2.3 GHz, 45 MB 20-way LLC, 76.8 GB/s),
    /// the platform of OSML's configs and the simulator's calibration reference.
    XeonE5_2697V4,
    /// Intel Xeon Gold 6338 (32 cores / 64 threads, 2.0 GHz, 48 MB 12-way LLC, ~94 GB/s
    /// per socket), OSML+'s second platform.
    XeonGold6338,
    /// The E5-2697 v4 with one NVIDIA A100 shared through MPS.
    XeonE5_2697V4A100,
    /// Intel Xeon E5-2658 v3 (Haswell-EP, 12 cores / 24 threads, 2.2 GHz, 30 MB 20-way LLC,
    /// 68 GB/s): one of the few Haswell servers with CAT, and only 4 CLOSIDs. It exists to
    /// show a host where the CLOSIDs, not the ways or cores, limit isolation: the root, the
    /// pool and two services of their own. No built-in `ml` model (pass `--model`).
    XeonE5_2658V3,
}

impl Platform {
    /// Every built-in platform with its preset name.
    pub const ALL: [(&'static str, Platform); 4] = [
        ("xeon-e5-2697v4", Platform::XeonE5_2697V4),
        ("xeon-gold-6338", Platform::XeonGold6338),
        ("xeon-e5-2697v4-a100", Platform::XeonE5_2697V4A100),
        ("xeon-e5-2658v3", Platform::XeonE5_2658V3),
    ];

    /// Looks a platform up by preset name.
    pub fn by_name(name: &str) -> Option<Platform> {
        Self::ALL.iter().find(|(n, _)| *n == name).map(|(_, p)| *p)
    }

    /// The platform's physical description.
    pub fn host(self) -> SimHost {
        let e5 = SimHost {
            preset: "xeon-e5-2697v4",
            capacity: HostCapacity {
                name: "Xeon E5-2697 v4 (simulated)".into(),
                cores: 36,
                freq_ghz: 2.3,
                llc_ways: 20,
                llc_way_bytes: 2_359_296, // 2.25 MiB
                mem_bw_bytes_per_s: 76.8e9,
                gpus: vec![],
                // Broadwell-EP offers 16 L3 CAT classes of service (CPUID leaf 0x10). It has
                // no MBA (RDT on the E5 v4 is CAT, CDP, CMT and MBM; MBA came with Xeon
                // Scalable): 100 % is its only level, as the daemon reports a host whose
                // resctrl has no MB resource, and the simulator refuses any other.
                closids: 16,
                mba_min_pct: cohabit_core::MBA_MAX_PCT,
                mba_gran_pct: cohabit_core::MBA_MAX_PCT,
                min_cbm_bits: 1,
                shareable_bits: 0,
            },
            mem_latency_ns: 90.0,
            core_peak_bw_bytes_per_s: 12e9,
            mem_queue_factor: 0.5,
        };
        match self {
            Platform::XeonE5_2697V4 => e5,
            Platform::XeonGold6338 => SimHost {
                preset: "xeon-gold-6338",
                capacity: HostCapacity {
                    name: "Xeon Gold 6338 (simulated)".into(),
                    cores: 64,
                    freq_ghz: 2.0,
                    llc_ways: 12,
                    llc_way_bytes: 4 << 20,
                    mem_bw_bytes_per_s: 94e9,
                    gpus: vec![],
                    // 16 L3 CAT CLOSIDs, the common value on Xeon Scalable (not checked on
                    // this SKU). With MBA in use a host offers the smaller of the L3 and MB
                    // counts, which can be 8 (docs/DESIGN.md 3). MBA 10 % minimum and step.
                    closids: 16,
                    mba_min_pct: 10,
                    mba_gran_pct: 10,
                    min_cbm_bits: 1,
                    shareable_bits: 0,
                },
                mem_latency_ns: 95.0,
                core_peak_bw_bytes_per_s: 14e9,
                mem_queue_factor: 0.5,
            },
            Platform::XeonE5_2697V4A100 => {
                let mut h = e5;
                h.preset = "xeon-e5-2697v4-a100";
                h.capacity.name = "Xeon E5-2697 v4 + A100 (simulated)".into();
                h.capacity.gpus = vec![GpuCapacity {
                    name: "A100-SXM4-40GB (simulated)".into(),
                    sms: 108,
                    share_change: cohabit_core::ShareChange::Restart,
                }];
                h
            }
            Platform::XeonE5_2658V3 => SimHost {
                preset: "xeon-e5-2658v3",
                capacity: HostCapacity {
                    name: "Xeon E5-2658 v3 (simulated)".into(),
                    cores: 24,
                    freq_ghz: 2.2,
                    llc_ways: 20,
                    llc_way_bytes: 1_572_864,   // 30 MiB / 20 ways
                    mem_bw_bytes_per_s: 68.3e9, // 4 channels of DDR4-2133
                    gpus: vec![],
                    // Linux's `cache_alloc_hsw_probe()` (arch/x86/kernel/cpu/resctrl/core.c):
                    // Haswell servers with CAT (E5-2658 v3 among them) always have 4 CLOSIDs
                    // and a 20-bit mask with at least 2 bits set. The simulator does not
                    // enforce that 2-bit minimum. No MBA on Haswell (see the E5-2697 v4).
                    closids: 4,
                    mba_min_pct: cohabit_core::MBA_MAX_PCT,
                    mba_gran_pct: cohabit_core::MBA_MAX_PCT,
                    min_cbm_bits: 1,
                    shareable_bits: 0,
                },
                // Assumed, like the E5-2697 v4's: the same memory system a generation older.
                mem_latency_ns: 90.0,
                core_peak_bw_bytes_per_s: 11e9,
                mem_queue_factor: 0.5,
            },
        }
    }
}

/// How a service uses the CPU side of the host.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CpuWork {
    /// CPI with every access hitting the LLC.
    pub cpi_base: f64,
    /// LLC accesses per thousand instructions.
    pub apki: f64,
    /// Miss ratio as a function of the LLC it holds.
    pub mrc: MissRatioCurve,
    /// Memory-level parallelism: misses overlapped on average.
    pub mlp: f64,
    /// Instructions per request (latency-critical only; calibrated).
    pub instructions_per_request: f64,
    /// Kernel-path LLC fetches per thousand instructions that a neighbour churning the LLC
    /// turns into memory accesses (see [`KERNEL_LLC_FRACTION`]); 0 without a kernel
    /// network path.
    pub kernel_llc_pki: f64,
}

/// Share of a service's kernel-mode L1i misses that are served by the LLC (the rest hit
/// in L2). Such lines (the network stack's code, socket and packet state, the packet data
/// the NIC writes into the LLC through DDIO, which CAT does not partition) stay in the
/// LLC while the host is quiet and are evicted before their next use when a neighbour
/// churns it; each then costs a memory access the front end cannot overlap. Assumed (no
/// published figure): chosen so that memcached, whose own LLC footprint is tiny (0.55 MPKI),
/// keeps less than half its load beside a streaming job, as Heracles (ISCA'15) reports for
/// memkeyval beside a DRAM antagonist (see `sensitivity`).
pub const KERNEL_LLC_FRACTION: f64 = 0.2;

/// How a service uses a GPU.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GpuWork {
    /// GPU time per request with the whole GPU (latency-critical only; calibrated).
    pub ms_per_request_full: f64,
    /// Exponent α of the share scaling: time ∝ share^-α (α < 1 is sub-linear).
    pub share_exponent: f64,
    /// Share of the GPU's memory bandwidth it uses while running (interference it causes).
    pub mem_intensity: f64,
    /// Concurrent requests it runs (batch slots), the servers of its GPU queue.
    pub streams: u32,
    /// Time to restart its MPS client so a new share takes effect.
    pub restart_ms: f64,
}

/// Latency-critical facts of a service.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LatencyTarget {
    /// p99 target.
    pub p99_target_ms: f64,
    /// Load at the knee on the reference platform.
    pub max_load_rps: f64,
    /// Coefficient of variation of the service time.
    pub service_cv: f64,
    /// Load at which the simulated service, alone on the reference host, reaches its target
    /// (calibrated; at least the published max load). Scenario load fractions are of this.
    pub knee_rps: f64,
}

/// A service or job the simulator can run.
#[derive(Debug, Clone, PartialEq)]
pub struct ServiceModel {
    /// Catalogue name (`model = "..."` in scenarios).
    pub name: String,
    /// One line on what it stands for.
    pub about: String,
    /// Where its numbers come from.
    pub source: String,
    /// The row it was built from.
    pub physics: Physics,
    /// Present for latency-critical services.
    pub latency: Option<LatencyTarget>,
    /// CPU behaviour, if it runs on the CPU.
    pub cpu: Option<CpuWork>,
    /// GPU behaviour, if it runs on a GPU.
    pub gpu: Option<GpuWork>,
}

/// The lowest knee a latency-critical model may have: a service that meets its target at no
/// higher load alone on the reference host meets it at none (the knee search's floor).
const MIN_KNEE_RPS: f64 = 2e-3;

impl ServiceModel {
    /// The model the row `physics` describes, calibrated on the reference platform (the
    /// E5-2697 v4, with its A100 for GPU services; see `world::calibrate`). Refused when a
    /// latency-critical service meets its target at no load there.
    pub fn build(
        name: impl Into<String>,
        about: impl Into<String>,
        source: impl Into<String>,
        physics: Physics,
    ) -> Result<ServiceModel, PhysicsError> {
        let mut m = match physics.kind() {
            RowKind::Service => lc_model(&physics),
            RowKind::GpuService => gpu_lc(&physics),
            RowKind::BestEffort => be_cpu(&physics),
            RowKind::GpuBestEffort => gpu_be(&physics),
        };
        m.name = name.into();
        m.about = about.into();
        m.source = source.into();
        m.physics = physics;
        let reference = Platform::XeonE5_2697V4A100.host();
        if let Some(knee) = crate::world::calibrate(&mut m, &reference) {
            if !(knee.is_finite() && knee >= MIN_KNEE_RPS) {
                return Err(PhysicsError::NoKnee { knee_rps: knee });
            }
            if let Some(l) = m.latency.as_mut() {
                l.knee_rps = knee;
            }
        }
        Ok(m)
    }

    /// This model with `changes` to its row, rebuilt and recalibrated; its name and what it
    /// stands for are kept, its source says what changed. Refused by the first change the
    /// row's kind lacks or its range refuses, or when the result has no knee.
    pub fn with_changes(&self, changes: &[(Param, f64)]) -> Result<ServiceModel, PhysicsError> {
        if changes.is_empty() {
            return Ok(self.clone());
        }
        let mut physics = self.physics.clone();
        for &(p, v) in changes {
            physics.set(p, v)?;
        }
        let names: Vec<String> = changes
            .iter()
            .map(|(p, v)| format!("{} = {v}", p.name()))
            .collect();
        ServiceModel::build(
            self.name.clone(),
            self.about.clone(),
            format!(
                "{}; changed by the scenario: {}",
                self.source,
                names.join(", ")
            ),
            physics,
        )
    }

    /// The kind of row it was built from.
    pub fn kind(&self) -> RowKind {
        self.physics.kind()
    }
}

struct Row {
    name: &'static str,
    about: &'static str,
    source: &'static str,
    target_ms: f64,
    max_load: f64,
    ipc: f64,
    llc_mpki: f64,
    wss_mb: f64,
    m_inf: f64,
    steepness: f64,
    cv: f64,
    /// L1i misses per thousand instructions (PARTIES Table 2; 0 where unpublished).
    icache_mpki: f64,
    /// Kernel time: the `sys` column of PARTIES Table 2's user/sys/io CPU split as a fraction
    /// (0.78 for memcached's 13/78/0; 0 where unpublished).
    sys_share: f64,
}

const PARTIES: &str =
    "PARTIES ASPLOS'19 Table 2 (target, max load, IPC, LLC MPKI); MRC shape assumed";
const OSML: &str = "OSML FAST'23 configs.py, E5-2697 v4 (target, max load); counters assumed";

#[allow(clippy::approx_constant)] // sphinx's 6.28 MPKI is a measurement, not 2π
const LC_ROWS: [Row; 10] = [
    Row {
        name: "memcached",
        about: "key-value store",
        source: PARTIES,
        target_ms: 0.6,
        max_load: 1_280_000.0,
        ipc: 0.74,
        llc_mpki: 0.55,
        wss_mb: 6.0,
        m_inf: 0.05,
        steepness: 2.0,
        cv: 1.0,
        icache_mpki: 23.25,
        sys_share: 0.78,
    },
    Row {
        name: "xapian",
        about: "web search",
        source: PARTIES,
        target_ms: 5.0,
        max_load: 8_000.0,
        ipc: 1.16,
        llc_mpki: 0.03,
        wss_mb: 4.0,
        // Posting lists are streamed: most of its few LLC accesses miss whatever the cache
        // (it was 0.005, which made xapian's 0.03 MPKI come from ~4 LLC accesses per
        // kilo-instruction and xapian cache-sensitive, unlike PARTIES' measurements).
        m_inf: 0.3,
        steepness: 2.5,
        cv: 1.13,
        icache_mpki: 2.34,
        sys_share: 0.23,
    },
    Row {
        name: "nginx",
        about: "web server",
        source: PARTIES,
        target_ms: 10.0,
        max_load: 560_000.0,
        ipc: 0.67,
        llc_mpki: 0.06,
        wss_mb: 5.0,
        m_inf: 0.01,
        steepness: 2.0,
        cv: 2.1,
        icache_mpki: 27.18,
        sys_share: 0.5,
    },
    Row {
        name: "moses",
        about: "real-time translation",
        source: PARTIES,
        target_ms: 15.0,
        max_load: 2_800.0,
        ipc: 0.74,
        llc_mpki: 10.48,
        wss_mb: 20.0,
        m_inf: 0.3,
        steepness: 3.0,
        cv: 0.6,
        icache_mpki: 6.25,
        sys_share: 0.14,
    },
    Row {
        name: "mongodb",
        about: "persistent database",
        source: PARTIES,
        target_ms: 300.0,
        max_load: 240.0,
        ipc: 0.40,
        llc_mpki: 0.01,
        wss_mb: 8.0,
        m_inf: 0.002,
        steepness: 2.0,
        cv: 1.5,
        icache_mpki: 33.07,
        sys_share: 0.002,
    },
    Row {
        name: "sphinx",
        about: "speech recognition",
        source: PARTIES,
        target_ms: 2500.0,
        max_load: 14.0,
        ipc: 0.79,
        llc_mpki: 6.28,
        wss_mb: 16.0,
        m_inf: 0.3,
        steepness: 3.0,
        cv: 0.4,
        icache_mpki: 7.32,
        sys_share: 0.006,
    },
    Row {
        name: "img-dnn",
        about: "image recognition (CPU)",
        source: OSML,
        target_ms: 10.0,
        max_load: 5_500.0,
        ipc: 1.2,
        llc_mpki: 2.0,
        wss_mb: 12.0,
        m_inf: 0.1,
        steepness: 2.5,
        cv: 0.8,
        icache_mpki: 0.0,
        sys_share: 0.0,
    },
    Row {
        name: "masstree",
        about: "in-memory key-value store",
        source: OSML,
        target_ms: 10.0,
        max_load: 1_200.0,
        ipc: 0.9,
        llc_mpki: 4.0,
        wss_mb: 30.0,
        m_inf: 0.2,
        steepness: 2.0,
        cv: 1.0,
        icache_mpki: 0.0,
        sys_share: 0.0,
    },
    Row {
        name: "specjbb",
        about: "Java middleware",
        source: OSML,
        target_ms: 10.0,
        max_load: 18_000.0,
        ipc: 1.0,
        llc_mpki: 1.5,
        wss_mb: 10.0,
        m_inf: 0.1,
        steepness: 2.0,
        cv: 1.2,
        icache_mpki: 0.0,
        sys_share: 0.0,
    },
    Row {
        name: "silo",
        about: "in-memory OLTP database",
        source: OSML,
        target_ms: 10.0,
        max_load: 2_400.0,
        ipc: 1.1,
        llc_mpki: 1.0,
        wss_mb: 8.0,
        m_inf: 0.08,
        steepness: 2.5,
        cv: 0.9,
        icache_mpki: 0.0,
        sys_share: 0.0,
    },
];

impl Row {
    /// The row's parameters.
    fn physics(&self) -> Result<Physics, PhysicsError> {
        Physics::new(
            RowKind::Service,
            [
                (Param::TargetMs, self.target_ms),
                (Param::MaxLoad, self.max_load),
                (Param::Cv, self.cv),
                (Param::Ipc, self.ipc),
                (Param::LlcMpki, self.llc_mpki),
                (Param::WssMb, self.wss_mb),
                (Param::MInf, self.m_inf),
                (Param::Steepness, self.steepness),
                (Param::IcacheMpki, self.icache_mpki),
                (Param::SysShare, self.sys_share),
            ],
        )
    }
}

/// Memory-level parallelism assumed for the CPU services above.
const LC_MLP: f64 = 2.0;

/// A model with nothing but its work; [`ServiceModel::build`] names and calibrates it.
fn unnamed(
    physics: &Physics,
    latency: Option<LatencyTarget>,
    cpu: Option<CpuWork>,
    gpu: Option<GpuWork>,
) -> ServiceModel {
    ServiceModel {
        name: String::new(),
        about: String::new(),
        source: String::new(),
        physics: physics.clone(),
        latency,
        cpu,
        gpu,
    }
}

fn miss_ratio_curve(p: &Physics) -> MissRatioCurve {
    MissRatioCurve {
        wss_bytes: p.at(Param::WssMb) * MB,
        m_inf: p.at(Param::MInf),
        steepness: p.at(Param::Steepness),
    }
}

fn latency_target(p: &Physics) -> LatencyTarget {
    LatencyTarget {
        p99_target_ms: p.at(Param::TargetMs),
        max_load_rps: p.at(Param::MaxLoad),
        service_cv: p.at(Param::Cv),
        knee_rps: f64::NAN,
    }
}

/// A latency-critical CPU service: the IPC and LLC MPKI at max load on the whole reference
/// LLC fix its LLC access rate (through the miss-ratio curve) and its base CPI.
fn lc_model(p: &Physics) -> ServiceModel {
    let reference = Platform::XeonE5_2697V4.host();
    let mrc = miss_ratio_curve(p);
    let full_cache = reference.capacity.llc_bytes() as f64;
    let llc_mpki = p.at(Param::LlcMpki);
    let apki = llc_mpki / mrc.miss_ratio(full_cache);
    let miss_cycles = reference.mem_latency_ns * reference.capacity.freq_ghz / LC_MLP;
    let cpi_base = (1.0 / p.at(Param::Ipc) - llc_mpki / 1000.0 * miss_cycles).max(0.25);
    let cpu = CpuWork {
        cpi_base,
        apki,
        mrc,
        mlp: LC_MLP,
        instructions_per_request: f64::NAN,
        kernel_llc_pki: p.at(Param::IcacheMpki) * p.at(Param::SysShare) * KERNEL_LLC_FRACTION,
    };
    unnamed(p, Some(latency_target(p)), Some(cpu), None)
}

/// A latency-critical GPU inference service: its host side is a fixed small CPU profile.
fn gpu_lc(p: &Physics) -> ServiceModel {
    let cpu = CpuWork {
        cpi_base: 0.8,
        apki: 4.0,
        mrc: MissRatioCurve {
            wss_bytes: 4.0 * MB,
            m_inf: 0.05,
            steepness: 2.0,
        },
        mlp: 2.0,
        // Pre- and post-processing on the host: ~0.4 ms at 2.3 GHz.
        instructions_per_request: 1.0e6,
        kernel_llc_pki: 0.0,
    };
    let gpu = GpuWork {
        ms_per_request_full: f64::NAN,
        share_exponent: p.at(Param::ShareExponent),
        mem_intensity: p.at(Param::MemIntensity),
        streams: whole_u32(p.at(Param::Streams)),
        restart_ms: p.at(Param::RestartMs),
    };
    unnamed(p, Some(latency_target(p)), Some(cpu), Some(gpu))
}

/// A best-effort CPU job.
fn be_cpu(p: &Physics) -> ServiceModel {
    let cpu = CpuWork {
        cpi_base: p.at(Param::CpiBase),
        apki: p.at(Param::Apki),
        mrc: miss_ratio_curve(p),
        mlp: p.at(Param::Mlp),
        instructions_per_request: 0.0,
        kernel_llc_pki: 0.0,
    };
    unnamed(p, None, Some(cpu), None)
}

/// A best-effort GPU job.
fn gpu_be(p: &Physics) -> ServiceModel {
    let gpu = GpuWork {
        ms_per_request_full: 0.0,
        share_exponent: p.at(Param::ShareExponent),
        mem_intensity: p.at(Param::MemIntensity),
        streams: 1,
        restart_ms: p.at(Param::RestartMs),
    };
    unnamed(p, None, None, Some(gpu))
}

/// `v`, a whole number in `u32`'s range ([`Param::Streams`]' range guarantees it).
fn whole_u32(v: f64) -> u32 {
    u32::try_from(crate::whole(v)).unwrap_or(u32::MAX)
}

/// A catalogue entry before it is built: name, what it stands for, source, row.
type Entry = (&'static str, &'static str, &'static str, Physics);

fn gpu_service_row(
    target_ms: f64,
    max_load: f64,
    exponent: f64,
    intensity: f64,
    streams: f64,
) -> Result<Physics, PhysicsError> {
    Physics::new(
        RowKind::GpuService,
        [
            (Param::TargetMs, target_ms),
            (Param::MaxLoad, max_load),
            (Param::Cv, 0.5),
            (Param::ShareExponent, exponent),
            (Param::MemIntensity, intensity),
            (Param::Streams, streams),
            (Param::RestartMs, 3000.0),
        ],
    )
}

fn best_effort_row(
    cpi_base: f64,
    apki: f64,
    wss_mb: f64,
    m_inf: f64,
    steepness: f64,
    mlp: f64,
) -> Result<Physics, PhysicsError> {
    Physics::new(
        RowKind::BestEffort,
        [
            (Param::CpiBase, cpi_base),
            (Param::Apki, apki),
            (Param::WssMb, wss_mb),
            (Param::MInf, m_inf),
            (Param::Steepness, steepness),
            (Param::Mlp, mlp),
        ],
    )
}

const GPU_LC: &str = "assumed: small-batch GPU inference behind MPS (sub-linear SM scaling)";
const BE: &str = "assumed best-effort profile";

/// Every row of the built-in catalogue, in catalogue order.
fn entries() -> Result<Vec<Entry>, PhysicsError> {
    let mut out = Vec::new();
    for row in &LC_ROWS {
        out.push((row.name, row.about, row.source, row.physics()?));
    }
    out.push((
        "resnet-infer",
        "ResNet-50 image classification on a GPU (MPS client)",
        GPU_LC,
        gpu_service_row(25.0, 900.0, 0.45, 0.3, 4.0)?,
    ));
    out.push((
        "llm-infer",
        "LLM generation requests on a GPU (MPS client)",
        GPU_LC,
        gpu_service_row(1500.0, 24.0, 0.7, 0.6, 16.0)?,
    ));
    out.push((
        "stream",
        "memory-bandwidth streaming kernel (STREAM-like)",
        BE,
        best_effort_row(0.6, 60.0, 2048.0, 0.9, 1.0, 6.0)?,
    ));
    out.push((
        "graph",
        "graph analytics with a cache-sized working set (PageRank-like)",
        BE,
        best_effort_row(0.9, 25.0, 24.0, 0.15, 3.0, 2.0)?,
    ));
    out.push((
        "compute",
        "compute-bound batch job (compression, encoding)",
        BE,
        best_effort_row(0.7, 0.5, 0.5, 0.01, 2.0, 2.0)?,
    ));
    out.push((
        "gpu-train",
        "GPU training job (best effort, memory-bandwidth heavy)",
        BE,
        Physics::new(
            RowKind::GpuBestEffort,
            [
                (Param::ShareExponent, 0.9),
                (Param::MemIntensity, 0.8),
                (Param::RestartMs, 3000.0),
            ],
        )?,
    ));
    Ok(out)
}

/// Every service model, calibrated on the reference platform (once per process).
pub fn catalogue() -> &'static [Arc<ServiceModel>] {
    static CATALOGUE: std::sync::OnceLock<Vec<Arc<ServiceModel>>> = std::sync::OnceLock::new();
    CATALOGUE.get_or_init(|| {
        build_catalogue().unwrap_or_else(|e| unreachable!("the built-in catalogue builds: {e}"))
    })
}

fn build_catalogue() -> Result<Vec<Arc<ServiceModel>>, PhysicsError> {
    entries()?
        .into_iter()
        .map(|(name, about, source, physics)| {
            ServiceModel::build(name, about, source, physics).map(Arc::new)
        })
        .collect()
}

/// Looks a calibrated model up by name.
pub fn model(name: &str) -> Option<&'static Arc<ServiceModel>> {
    catalogue().iter().find(|m| m.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_built_in_catalogue_builds_and_each_model_keeps_its_row() {
        let models = build_catalogue().unwrap();
        assert_eq!(models.len(), LC_ROWS.len() + 6);
        for m in &models {
            if m.latency.is_some() {
                let knee = m.latency.map_or(f64::NAN, |l| l.knee_rps);
                assert!(knee.is_finite() && knee > 0.0, "{}: {knee}", m.name);
            }
            assert_eq!(
                m.kind().is_latency_critical(),
                m.latency.is_some(),
                "{}",
                m.name
            );
            // Rebuilt from its own row, a model is the same model.
            let again = ServiceModel::build(
                m.name.clone(),
                m.about.clone(),
                m.source.clone(),
                m.physics.clone(),
            )
            .unwrap();
            assert_eq!(&again, &**m);
        }
        let moses = model("moses").unwrap();
        assert_eq!(moses.physics.get(Param::LlcMpki), Some(10.48));
        assert_eq!(model("gpu-train").unwrap().kind(), RowKind::GpuBestEffort);
    }

    /// LLC misses per thousand instructions of `m` holding `ways` ways of the reference LLC.
    fn mpki(m: &ServiceModel, ways: f64) -> f64 {
        let way = Platform::XeonE5_2697V4.host().capacity.llc_way_bytes as f64;
        let c = m.cpu.unwrap();
        c.apki * c.mrc.miss_ratio(ways * way)
    }

    #[test]
    fn a_changed_row_keeps_its_published_point_and_moves_the_rest() {
        let moses = model("moses").unwrap();
        // More misses at the published point: more at every way count.
        let missy = moses.with_changes(&[(Param::LlcMpki, 20.0)]).unwrap();
        assert_eq!(missy.name, "moses");
        assert!(missy.source.contains("llc_mpki = 20"), "{}", missy.source);
        for ways in [1.0, 2.0, 4.0, 8.0, 20.0] {
            let ratio = mpki(&missy, ways) / mpki(moses, ways);
            assert!((ratio - 20.0 / 10.48).abs() < 1e-9, "{ways} ways: {ratio}");
        }
        // A working set of another size at the same published MPKI (measured on the whole
        // reference LLC): the same misses there, other misses in fewer ways.
        let big = moses.with_changes(&[(Param::WssMb, 60.0)]).unwrap();
        assert!((mpki(&big, 20.0) - 10.48).abs() < 1e-9);
        assert!((mpki(moses, 20.0) - 10.48).abs() < 1e-9);
        assert!((mpki(&big, 4.0) / mpki(moses, 4.0) - 1.0).abs() > 0.3);
        // A best-effort job states its LLC accesses outright: a larger working set misses
        // more in the same ways.
        let graph = model("graph").unwrap();
        let huge = graph.with_changes(&[(Param::WssMb, 64.0)]).unwrap();
        for ways in [8.0, 12.0, 16.0] {
            assert!(mpki(&huge, ways) > 1.2 * mpki(graph, ways), "{ways} ways");
        }
    }

    #[test]
    fn a_change_the_row_lacks_or_its_range_refuses_is_named() {
        let stream = model("stream").unwrap();
        let err = stream
            .with_changes(&[(Param::Ipc, 1.0)])
            .unwrap_err()
            .to_string();
        assert!(err.contains("ipc") && err.contains("best-effort"), "{err}");
        let err = stream
            .with_changes(&[(Param::MInf, 1.2)])
            .unwrap_err()
            .to_string();
        assert!(err.contains("m_inf") && err.contains("1.2"), "{err}");
    }

    #[test]
    fn a_service_that_meets_its_target_at_no_load_is_refused() {
        // A GPU service's host side alone takes ~0.4 ms a request: a 0.1 ms target is met
        // at no load.
        let resnet = model("resnet-infer").unwrap();
        let err = resnet.with_changes(&[(Param::TargetMs, 0.1)]).unwrap_err();
        assert!(matches!(err, PhysicsError::NoKnee { .. }), "{err}");
        assert!(resnet.with_changes(&[(Param::TargetMs, 5.0)]).is_ok());
    }
}
