use std::fmt;

use serde::{Deserialize, Serialize};

use crate::{CoreError, HostCapacity};

/// 100 % memory bandwidth: MBA throttling off.
pub const MBA_MAX_PCT: u8 = 100;

/// A contiguous range of LLC ways, as Intel CAT requires (a capacity bitmask with one run
/// of set bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WayRange {
    /// Lowest way in the range (bit index in the capacity bitmask).
    pub first: u32,
    /// Number of ways; at least 1.
    pub count: u32,
}

impl WayRange {
    /// A range of `count` ways starting at `first`.
    pub const fn new(first: u32, count: u32) -> Self {
        Self { first, count }
    }

    /// One past the highest way.
    pub const fn end(&self) -> u32 {
        self.first + self.count
    }

    /// True if way `w` is in the range.
    pub const fn contains(&self, w: u32) -> bool {
        w >= self.first && w < self.end()
    }

    /// True if the two ranges share at least one way.
    pub const fn overlaps(&self, other: &WayRange) -> bool {
        self.first < other.end() && other.first < self.end()
    }

    /// The capacity bitmask CAT would be given (`count` bits from `first`).
    pub fn mask(&self) -> u64 {
        if self.count == 0 {
            return 0;
        }
        let ones = if self.count >= 64 {
            u64::MAX
        } else {
            (1u64 << self.count) - 1
        };
        ones << self.first
    }
}

impl fmt::Display for WayRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.count == 0 {
            write!(f, "none")
        } else {
            write!(f, "{}-{}", self.first, self.end() - 1)
        }
    }
}

/// The share of a host given to one service or group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Allocation {
    /// Logical cores (a cpuset of this size). Best-effort pools may get 0 (paused).
    pub cores: u32,
    /// LLC ways (Intel CAT).
    pub llc_ways: WayRange,
    /// Memory-bandwidth throttle (Intel MBA), from the host's `mba_min_pct` to 100 %.
    pub mba_pct: u8,
    /// NVIDIA MPS active-thread percentage on the service's GPU, if it uses one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_mps_pct: Option<u8>,
}

/// One kind of resource an allocation hands out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Resource {
    /// Logical cores.
    Cores,
    /// LLC ways.
    LlcWays,
    /// Memory-bandwidth percentage.
    Mba,
    /// GPU MPS share.
    GpuShare,
}

impl Resource {
    /// Every resource, in the order feedback controllers rotate through them.
    pub const ALL: [Resource; 4] = [
        Resource::Cores,
        Resource::LlcWays,
        Resource::Mba,
        Resource::GpuShare,
    ];
}

impl fmt::Display for Resource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Resource::Cores => "cores",
            Resource::LlcWays => "llc_ways",
            Resource::Mba => "mba",
            Resource::GpuShare => "gpu_share",
        })
    }
}

impl Allocation {
    /// Checks the allocation against the host; `who` names the group in the error.
    pub fn validate(&self, host: &HostCapacity, who: &str) -> Result<(), CoreError> {
        if self.cores > host.cores {
            return Err(CoreError::invalid(
                format!("{who}.cores"),
                format!("{} exceeds the host's {} cores", self.cores, host.cores),
            ));
        }
        if self.llc_ways.count == 0 || self.llc_ways.end() > host.llc_ways {
            return Err(CoreError::invalid(
                format!("{who}.llc_ways"),
                format!(
                    "range {} must hold at least one way within the host's {} ways",
                    self.llc_ways, host.llc_ways
                ),
            ));
        }
        // resctrl refuses an MB value below `info/MB/min_bandwidth`; a host without MBA
        // offers only 100 (`mba_min_pct` = 100, see the daemon's capacity discovery).
        let lo = host.mba_min_pct.clamp(1, MBA_MAX_PCT);
        if !(lo..=MBA_MAX_PCT).contains(&self.mba_pct) {
            let why = if lo == MBA_MAX_PCT {
                "this host has no memory bandwidth allocation, so only 100".to_string()
            } else {
                format!("must be between the host's MBA minimum {lo} and 100")
            };
            return Err(CoreError::invalid(
                format!("{who}.mba_pct"),
                format!("{why}, got {}", self.mba_pct),
            ));
        }
        if let Some(g) = self.gpu_mps_pct {
            if !(1..=100).contains(&g) {
                return Err(CoreError::invalid(
                    format!("{who}.gpu_mps_pct"),
                    format!("must be between 1 and 100, got {g}"),
                ));
            }
        }
        Ok(())
    }

    /// The amount of `resource` as a number (cores, ways, percent), for feedback steps and
    /// plots. `GpuShare` is 0 when the allocation has none.
    pub fn amount(&self, resource: Resource) -> u32 {
        match resource {
            Resource::Cores => self.cores,
            Resource::LlcWays => self.llc_ways.count,
            Resource::Mba => u32::from(self.mba_pct),
            Resource::GpuShare => self.gpu_mps_pct.map_or(0, u32::from),
        }
    }

    /// The value of one resource as an operator would read it.
    pub fn describe(&self, resource: Resource) -> String {
        match resource {
            Resource::Cores => self.cores.to_string(),
            Resource::LlcWays => self.llc_ways.to_string(),
            Resource::Mba => format!("{}%", self.mba_pct),
            Resource::GpuShare => self
                .gpu_mps_pct
                .map_or_else(|| "none".to_string(), |p| format!("{p}%")),
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn masks_are_contiguous_runs() {
        assert_eq!(WayRange::new(0, 4).mask(), 0xf);
        assert_eq!(WayRange::new(4, 2).mask(), 0x30);
        assert_eq!(WayRange::new(0, 64).mask(), u64::MAX);
        assert_eq!(WayRange::new(3, 2).to_string(), "3-4");
    }

    #[test]
    fn overlap_is_symmetric_and_exact_at_edges() {
        let a = WayRange::new(0, 4);
        assert!(!a.overlaps(&WayRange::new(4, 2)));
        assert!(a.overlaps(&WayRange::new(3, 2)));
        assert!(WayRange::new(3, 2).overlaps(&a));
    }

    fn host(mba_min_pct: u8) -> HostCapacity {
        HostCapacity {
            name: "t".into(),
            cores: 4,
            freq_ghz: 2.0,
            llc_ways: 4,
            llc_way_bytes: 1 << 20,
            mem_bw_bytes_per_s: 1e10,
            gpus: vec![],
            closids: 4,
            mba_min_pct,
            mba_gran_pct: mba_min_pct,
            min_cbm_bits: 1,
            shareable_bits: 0,
        }
    }

    fn at_mba(mba_pct: u8) -> Allocation {
        Allocation {
            cores: 1,
            llc_ways: WayRange::new(0, 1),
            mba_pct,
            gpu_mps_pct: None,
        }
    }

    #[test]
    fn mba_below_the_hosts_minimum_is_refused_as_resctrl_refuses_it() {
        let rdt = host(20);
        at_mba(20).validate(&rdt, "g").unwrap();
        at_mba(100).validate(&rdt, "g").unwrap();
        let e = at_mba(10).validate(&rdt, "g").unwrap_err().to_string();
        assert!(e.contains("g.mba_pct") && e.contains("minimum 20"), "{e}");
        assert!(at_mba(101).validate(&rdt, "g").is_err());
        // A host without MBA offers only 100.
        let bare = host(100);
        at_mba(100).validate(&bare, "pool").unwrap();
        let e = at_mba(90).validate(&bare, "pool").unwrap_err().to_string();
        assert!(e.contains("no memory bandwidth allocation"), "{e}");
    }

    proptest! {
        #[test]
        fn mask_popcount_equals_count(first in 0u32..32, count in 1u32..32) {
            let r = WayRange::new(first, count);
            prop_assert_eq!(r.mask().count_ones(), count);
            prop_assert_eq!(r.mask().trailing_zeros(), first);
            for w in 0..64 {
                prop_assert_eq!(r.contains(w), r.mask() & (1u64 << w) != 0);
            }
        }
    }
}
