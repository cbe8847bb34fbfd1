//! Interference sensitivity of the catalogue's services, set beside published measurements.
//!
//! Problem: the simulator's physics is only worth training a model on if a service suffers
//! from a neighbour about as much as the real service does. Papers measured that by running
//! each service next to an antagonist that stresses one resource, without partitioning, and
//! reporting how much load it still sustains at its QoS target.
//!
//! Approach: the same experiment in the simulator. On the reference platform
//! ([`Platform::XeonE5_2697V4`]) a service gets half of the cores and every LLC way, and
//! [`sustainable_load`] bisects the largest load at which its p99 meets its target:
//! - alone;
//! - `membw`: beside `stream` on the other half of the cores, sharing every way and the
//!   memory controllers (no CAT, no MBA);
//! - `cache`: beside `graph` (a 24 MB working set) the same way;
//! - `cpu`: beside `compute` on the *same* CPUs under CFS with equal weights and no quota
//!   (no cpuset partitioning; [`crate::world::evaluate_shared`]).
//!
//! Each antagonist's figure is the load sustained beside it over the load sustained alone.
//! [`table`] compares it, as a sensitivity class ([`Sensitivity`]), with what the literature
//! reports ([`published`]). `cargo run -p cohabit-sim --example sensitivity` prints it.
//!
//! What is published, and how sure we are of it (provenance as in the project's anchors):
//! - PARTIES (Chen, Delimitrou, Martínez, ASPLOS'19) Table 2 [read in the paper's text]:
//!   per service at max load, LLC MPKI and memory bandwidth: moses 10.48 MPKI and 26 GB/s,
//!   sphinx 6.28 and 3.1 GB/s, memcached 0.55 and 0.6 GB/s, nginx 0.06 and 0.6 GB/s, xapian
//!   0.03 and 0.01 GB/s, mongodb 0.01 and 0.03 GB/s; memcached and nginx spend 78 % and
//!   50 % of their CPU time in the kernel and move 3.0 and 6.2 Gb/s of network traffic.
//!   A service that itself moves a third of a socket's bandwidth (moses) or misses the LLC
//!   often (sphinx) is memory-bound and must be hurt by `membw` and `cache`; services with
//!   almost no LLC misses (xapian, mongodb) must not be.
//! - Heracles (Lo et al., ISCA'15) Table 1 [recalled from the paper, not re-read in stored
//!   text]: memkeyval (Google's memcached-like store) violates its SLO beside a DRAM
//!   bandwidth antagonist at every load measured, and beside a large LLC antagonist at
//!   moderate and high loads. So memcached is *highly* sensitive to `membw` although its own
//!   LLC footprint is small: its kernel network path (78 % of its CPU time) depends on data
//!   the NIC places in the LLC and on code and socket state a streaming neighbour evicts.
//! - Leverich and Kozyrakis (EuroSys'14) [abstract read]: co-location under Linux CFS
//!   violates memcached's sub-millisecond QoS through scheduling delay and queueing, which
//!   they remove by replacing CFS's policy. A target of 600 µs does not survive a
//!   CPU-bound neighbour's scheduler slices on the same CPUs.
//! - For mongodb, PARTIES' Table 2 shows an I/O-bound service (57 % of its time waiting on
//!   disk) with no CPU-side footprint: low on every antagonist here (the simulator has no
//!   disk antagonist). The OSML services (img-dnn, masstree, specjbb, silo) have no
//!   published counters: no row.
//!
//! Properties: deterministic (noise-free physics); each figure in `[0, 1]`-ish (a neighbour
//! may leave a service marginally faster only through rounding); tested against the
//! published classes in this module's tests.

use cohabit_core::WayRange;

use crate::catalogue::{self, Platform, ServiceModel, SimHost};
use crate::physics::{SharedCpu, CFS_PERIOD_MS};
use crate::world::{self, CpuSharing, Tenant};

/// A resource an antagonist stresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Antagonist {
    /// Memory bandwidth: `stream` beside the service, sharing ways and memory.
    MemBw,
    /// LLC capacity: `graph` beside the service, sharing ways.
    Cache,
    /// CPU time: `compute` on the service's own CPUs (CFS, equal weights, no quota).
    Cpu,
}

impl Antagonist {
    /// Every antagonist, in table order.
    pub const ALL: [Antagonist; 3] = [Antagonist::MemBw, Antagonist::Cache, Antagonist::Cpu];

    /// Short name (a table column).
    pub fn name(self) -> &'static str {
        match self {
            Antagonist::MemBw => "membw",
            Antagonist::Cache => "cache",
            Antagonist::Cpu => "cpu",
        }
    }

    fn model(self) -> &'static str {
        match self {
            Antagonist::MemBw => "stream",
            Antagonist::Cache => "graph",
            Antagonist::Cpu => "compute",
        }
    }
}

/// How much a service suffers from an antagonist: the share of its load it loses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Sensitivity {
    /// Keeps at least 85 % of the load it sustains alone.
    Low,
    /// Keeps 50–85 %.
    Moderate,
    /// Keeps less than half.
    High,
}

impl Sensitivity {
    /// The class of a sustained-load ratio (beside the antagonist over alone).
    pub fn of(ratio: f64) -> Sensitivity {
        if ratio >= 0.85 {
            Sensitivity::Low
        } else if ratio >= 0.5 {
            Sensitivity::Moderate
        } else {
            Sensitivity::High
        }
    }

    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Sensitivity::Low => "low",
            Sensitivity::Moderate => "moderate",
            Sensitivity::High => "high",
        }
    }
}

/// What the literature reports for one service and antagonist: the classes consistent with
/// it (a range where the source is qualitative) and where it comes from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Published {
    /// Lowest class consistent with the source.
    pub at_least: Sensitivity,
    /// Highest class consistent with the source.
    pub at_most: Sensitivity,
    /// Source, short.
    pub source: &'static str,
}

const T2: &str = "PARTIES T2";
const HERACLES: &str = "Heracles T1 (recalled)";
const LEVERICH: &str = "Leverich'14";

fn p(at_least: Sensitivity, at_most: Sensitivity, source: &'static str) -> Option<Published> {
    Some(Published {
        at_least,
        at_most,
        source,
    })
}

/// The published expectation for `service` beside `antagonist`, if any (see the module docs).
pub fn published(service: &str, antagonist: Antagonist) -> Option<Published> {
    use Antagonist::{Cache, Cpu, MemBw};
    use Sensitivity::{High, Low, Moderate};
    match (service, antagonist) {
        ("memcached", MemBw) => p(High, High, HERACLES),
        ("memcached", Cache) => p(Moderate, High, HERACLES),
        ("memcached", Cpu) => p(High, High, LEVERICH),
        ("moses", MemBw | Cache) => p(Moderate, High, T2),
        ("sphinx", MemBw | Cache) => p(Moderate, High, T2),
        ("xapian" | "mongodb", MemBw | Cache) => p(Low, Low, T2),
        // Little LLC traffic of its own, but a kernel network path like memcached's.
        ("nginx", MemBw) => p(Low, Moderate, T2),
        ("nginx", Cache) => p(Low, Moderate, T2),
        _ => None,
    }
}

/// One service's row: sustained load alone (rps) and the ratio beside each antagonist.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// Catalogue name.
    pub service: &'static str,
    /// Largest load meeting the target alone with half the host's cores (rps).
    pub alone_rps: f64,
    /// Load sustained beside each antagonist over `alone_rps`, in [`Antagonist::ALL`] order.
    pub ratio: [f64; 3],
}

impl Row {
    /// Whether the simulated class lies in the published range (`None`: nothing published).
    pub fn agrees(&self, antagonist: Antagonist) -> Option<bool> {
        let k = Antagonist::ALL.iter().position(|a| *a == antagonist)?;
        let expect = published(self.service, antagonist)?;
        let got = Sensitivity::of(self.ratio[k]);
        Some(got >= expect.at_least && got <= expect.at_most)
    }
}

/// The CPU latency-critical services of the catalogue.
fn cpu_services() -> impl Iterator<Item = &'static ServiceModel> {
    catalogue::catalogue()
        .iter()
        .filter(|m| m.latency.is_some() && m.gpu.is_none() && m.cpu.is_some())
        .map(|m| &**m)
}

/// The p99 (ms) of `service` at `load_rps` with half the cores of `host` and every way,
/// beside `antagonist` (or alone).
pub fn p99_beside(
    host: &SimHost,
    service: &ServiceModel,
    antagonist: Option<Antagonist>,
    load_rps: f64,
) -> f64 {
    let cap = &host.capacity;
    let half = f64::from(cap.cores / 2);
    let all = WayRange::new(0, cap.llc_ways);
    let lc = Tenant {
        model: service,
        p99_target_ms: service.latency.map(|l| l.p99_target_ms),
        cores: half,
        ways: all,
        mba_pct: 100.0,
        load_rps,
        gpu: None,
        downtime_ms: 0.0,
    };
    let Some(a) = antagonist else {
        return world::evaluate(host, &[lc], 1000.0).outcomes[0]
            .p99_ms
            .unwrap_or(f64::INFINITY);
    };
    let Some(be_model) = catalogue::model(a.model()) else {
        return f64::INFINITY;
    };
    let be = Tenant {
        model: be_model,
        p99_target_ms: None,
        // The CPU antagonist has no CPUs of its own: it runs on the service's.
        cores: if a == Antagonist::Cpu { 0.0 } else { half },
        ways: all,
        mba_pct: 100.0,
        load_rps: 0.0,
        gpu: None,
        downtime_ms: 0.0,
    };
    let sharing = [CpuSharing {
        service: 0,
        pool: 1,
        cpu: SharedCpu {
            cpus: half,
            quota_ms: None,
            period_ms: CFS_PERIOD_MS,
            idle_class: false,
        },
    }];
    let sharing: &[CpuSharing] = if a == Antagonist::Cpu { &sharing } else { &[] };
    world::evaluate_shared(host, &[lc, be], 1000.0, sharing).outcomes[0]
        .p99_ms
        .unwrap_or(f64::INFINITY)
}

/// The largest load (rps) at which `service` meets its target in that setting: 0 when it
/// misses it even unloaded.
pub fn sustainable_load(
    host: &SimHost,
    service: &ServiceModel,
    antagonist: Option<Antagonist>,
) -> f64 {
    let Some(lat) = service.latency else {
        return 0.0;
    };
    let ok = |rps: f64| p99_beside(host, service, antagonist, rps) <= lat.p99_target_ms;
    let (mut lo, mut hi) = (0.0, 2.0 * lat.knee_rps);
    if !ok(lat.knee_rps * 1e-4) {
        return 0.0;
    }
    for _ in 0..40 {
        let mid = 0.5 * (lo + hi);
        if ok(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

/// The comparison on `platform`, one row per CPU latency-critical service.
pub fn table(platform: Platform) -> Vec<Row> {
    let host = platform.host();
    cpu_services()
        .map(|m| {
            let alone = sustainable_load(&host, m, None);
            let ratio = Antagonist::ALL.map(|a| {
                if alone > 0.0 {
                    sustainable_load(&host, m, Some(a)) / alone
                } else {
                    0.0
                }
            });
            Row {
                service: &m.name,
                alone_rps: alone,
                ratio,
            }
        })
        .collect()
}

/// The table as text: per antagonist the sustained ratio, its class, the published class
/// range and whether they agree.
pub fn render(rows: &[Row]) -> String {
    use std::fmt::Write;
    let mut out = String::from(
        "SIMULATION: sustained load at the p99 target beside each antagonist, over alone \
         (half the cores, no partitioning)\n",
    );
    let _ = write!(out, "{:<10} {:>12}", "service", "alone_rps");
    for a in Antagonist::ALL {
        let _ = write!(out, "  {:<34}", a.name());
    }
    out.push('\n');
    for r in rows {
        let _ = write!(out, "{:<10} {:>12.0}", r.service, r.alone_rps);
        for (k, a) in Antagonist::ALL.iter().enumerate() {
            let got = Sensitivity::of(r.ratio[k]);
            let cell = match published(r.service, *a) {
                Some(p) => {
                    let range = if p.at_least == p.at_most {
                        p.at_least.name().to_string()
                    } else {
                        format!("{}-{}", p.at_least.name(), p.at_most.name())
                    };
                    let verdict = if r.agrees(*a) == Some(true) {
                        "ok"
                    } else {
                        "DIFFERS"
                    };
                    format!("{:.2} {} / {} {}", r.ratio[k], got.name(), range, verdict)
                }
                None => format!("{:.2} {} / -", r.ratio[k], got.name()),
            };
            let _ = write!(out, "  {cell:<34}");
        }
        out.push('\n');
    }
    out.push_str("cells: ratio, simulated class / published class, agreement. Sources: ");
    out.push_str(
        "PARTIES (ASPLOS'19) Table 2 footprints; Heracles (ISCA'15) Table 1, recalled; \
         Leverich & Kozyrakis (EuroSys'14). See cohabit_sim::sensitivity.\n",
    );
    out
}

/// Issue 13's layouts on a 2-CPU host with memcached at half of one CPU's capacity and a
/// CPU-bound batch job: (layout, memcached's p99 in ms, the job's CPUs' worth of time).
/// 1. one exclusive CPU each; 2. both CPUs to memcached, the job confined to the second
///    with a 5 ms / 100 ms CFS quota at normal weight; 3. the same with the job as an idle
///    class (what the daemon does now).
pub fn shared_cpu_layouts() -> Vec<(&'static str, f64, f64)> {
    let mut h = Platform::XeonE5_2697V4.host();
    h.capacity.cores = 2;
    let (Some(m), Some(job)) = (catalogue::model("memcached"), catalogue::model("compute")) else {
        return Vec::new();
    };
    let Some(cpu) = m.cpu else {
        return Vec::new();
    };
    let tenant = |model: &'static ServiceModel, cores: f64, load_rps: f64| Tenant {
        model,
        p99_target_ms: model.latency.map(|l| l.p99_target_ms),
        cores,
        ways: WayRange::new(0, h.capacity.llc_ways),
        mba_pct: 100.0,
        load_rps,
        gpu: None,
        downtime_ms: 0.0,
    };
    let probe = world::evaluate(&h, &[tenant(m, 1.0, 1.0)], 1000.0);
    let per_cpu = h.capacity.freq_ghz * 1e9 * probe.outcomes[0].ipc / cpu.instructions_per_request;
    let load = 0.5 * per_cpu;
    let shared = |quota_ms: Option<f64>, idle_class: bool| CpuSharing {
        service: 0,
        pool: 1,
        cpu: SharedCpu {
            cpus: 1.0,
            quota_ms,
            period_ms: CFS_PERIOD_MS,
            idle_class,
        },
    };
    let run = |label: &'static str, lc_cores: f64, job_cores: f64, sharing: &[CpuSharing]| {
        let e = world::evaluate_shared(
            &h,
            &[tenant(m, lc_cores, load), tenant(job, job_cores, 0.0)],
            1000.0,
            sharing,
        );
        let p99 = e.outcomes[0].p99_ms.unwrap_or(f64::INFINITY);
        (label, p99, e.outcomes[1].cpu_busy_cores)
    };
    vec![
        run("one exclusive CPU each", 1.0, 1.0, &[]),
        run(
            "2 CPUs to memcached, job on CPU 2 with a 5 % quota",
            2.0,
            0.0,
            &[shared(Some(5.0), false)],
        ),
        run(
            "2 CPUs to memcached, job on CPU 2 as an idle class",
            2.0,
            0.0,
            &[shared(None, true)],
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows() -> &'static [Row] {
        static ROWS: std::sync::OnceLock<Vec<Row>> = std::sync::OnceLock::new();
        ROWS.get_or_init(|| table(Platform::XeonE5_2697V4))
    }

    fn row(name: &str) -> &'static Row {
        rows()
            .iter()
            .find(|r| r.service == name)
            .unwrap_or_else(|| panic!("{name} in the table"))
    }

    #[test]
    fn every_published_cell_agrees_with_the_simulator() {
        let text = render(rows());
        println!("{text}");
        for r in rows() {
            for a in Antagonist::ALL {
                if let Some(ok) = r.agrees(a) {
                    assert!(ok, "{} beside {}: {text}", r.service, a.name());
                }
            }
        }
    }

    #[test]
    fn memcached_loses_most_of_its_load_beside_a_streaming_job() {
        // Heracles: memkeyval misses its SLO beside a DRAM antagonist at every load measured.
        let m = row("memcached");
        assert!(
            m.ratio[0] < 0.5,
            "memcached beside stream keeps {}",
            m.ratio[0]
        );
        // ... and more than a cache-only neighbour of the same LLC appetite costs it.
        assert!(m.ratio[0] < m.ratio[1], "{:?}", m.ratio);
    }

    #[test]
    fn the_kernel_path_not_the_llc_footprint_makes_memcached_fear_a_streaming_job() {
        let host = Platform::XeonE5_2697V4.host();
        let m = catalogue::model("memcached").unwrap();
        let mut footprint_only = ServiceModel::clone(m);
        if let Some(c) = footprint_only.cpu.as_mut() {
            c.kernel_llc_pki = 0.0;
        }
        let ratio = |s: &ServiceModel| {
            sustainable_load(&host, s, Some(Antagonist::MemBw)) / sustainable_load(&host, s, None)
        };
        let (with, without) = (ratio(m), ratio(&footprint_only));
        assert!(
            with < 0.5 && without > with + 0.1,
            "with the kernel path {with}, its LLC footprint alone {without}"
        );
    }

    #[test]
    fn services_without_llc_traffic_shrug_off_memory_antagonists() {
        for name in ["xapian", "mongodb"] {
            let r = row(name);
            assert!(
                r.ratio[0] > 0.85 && r.ratio[1] > 0.85,
                "{name}: {:?}",
                r.ratio
            );
        }
        // The memory-bound ones are hurt by both.
        for name in ["moses", "sphinx"] {
            let r = row(name);
            assert!(
                r.ratio[0] < 0.85 && r.ratio[1] < 0.85,
                "{name}: {:?}",
                r.ratio
            );
        }
    }

    #[test]
    fn a_cpu_antagonist_on_the_same_cpus_hurts_tight_targets_most() {
        // memcached's 600 µs target cannot absorb a scheduler slice; nginx's 10 ms can, and
        // loses the CPU time the hog takes.
        assert!(
            row("memcached").ratio[2] < 0.1,
            "{:?}",
            row("memcached").ratio
        );
        assert!(row("nginx").ratio[2] > 0.3, "{:?}", row("nginx").ratio);
    }
}
