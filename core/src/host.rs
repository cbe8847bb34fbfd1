use serde::{Deserialize, Serialize};

use crate::CoreError;

/// The shareable resources of one server, as the controller sees them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostCapacity {
    /// Human name of the platform, e.g. `Xeon E5-2697 v4`.
    pub name: String,
    /// Logical cores (hardware threads) available to managed services.
    pub cores: u32,
    /// Nominal core frequency.
    pub freq_ghz: f64,
    /// Number of last-level-cache ways that Intel CAT can hand out (bits in `cbm_mask`).
    pub llc_ways: u32,
    /// Size of one LLC way in bytes (LLC size / ways).
    pub llc_way_bytes: u64,
    /// Peak memory bandwidth of the socket(s).
    pub mem_bw_bytes_per_s: f64,
    /// GPUs that can be shared through NVIDIA MPS.
    #[serde(default)]
    pub gpus: Vec<GpuCapacity>,
    /// Classes of service (resctrl CLOSIDs) the host offers, the default (root) group
    /// included: the smallest `info/<resource>/num_closids` of the resources in use. Plans
    /// may use at most `closids - 1` groups besides the default one.
    #[serde(default = "default_closids")]
    pub closids: u32,
    /// Smallest memory-bandwidth (MBA) percentage the host accepts (`info/MB/min_bandwidth`).
    #[serde(default = "default_mba_min_pct")]
    pub mba_min_pct: u8,
    /// Step between MBA percentages (`info/MB/bandwidth_gran`); requests round to it.
    #[serde(default = "default_mba_gran_pct")]
    pub mba_gran_pct: u8,
    /// Fewest ways one cache allocation mask may hold (`info/L3/min_cbm_bits`): a narrower
    /// way range is widened to this many ways when it is written, and may then reach into
    /// a neighbour's ways. Logs and configs without the field mean 1 (no widening).
    #[serde(
        default = "default_min_cbm_bits",
        skip_serializing_if = "is_default_min_cbm_bits"
    )]
    pub min_cbm_bits: u32,
    /// Ways that other agents of the host (I/O devices) also fill, as a bit mask of
    /// `llc_ways` bits (`info/L3/shareable_bits`): a range there is not exclusive. Logs and
    /// configs without the field mean 0 (none).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub shareable_bits: u64,
}

fn default_min_cbm_bits() -> u32 {
    1
}

fn is_default_min_cbm_bits(v: &u32) -> bool {
    *v == default_min_cbm_bits()
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// CLOSIDs of logs and scenarios written before the field existed (L3 CAT on most Xeons).
pub const DEFAULT_CLOSIDS: u32 = 16;

fn default_closids() -> u32 {
    DEFAULT_CLOSIDS
}

fn default_mba_min_pct() -> u8 {
    10
}

fn default_mba_gran_pct() -> u8 {
    10
}

/// One GPU shared through MPS.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuCapacity {
    /// Model name, e.g. `A100-SXM4-40GB`.
    pub name: String,
    /// Streaming multiprocessors; the MPS active-thread percentage is a share of these.
    pub sms: u32,
    /// How a new MPS share reaches a running client on this GPU (from the host's probe).
    #[serde(default, skip_serializing_if = "ShareChange::is_restart")]
    pub share_change: ShareChange,
}

/// How a new GPU share reaches a running MPS client: the cost a policy weighs before
/// changing it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ShareChange {
    /// The client keeps the share it started with: a new share applies after its restart
    /// (seconds of downtime). MPS v2 `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`.
    #[default]
    Restart,
    /// The driver applies a new share to running clients (MPS v3 dynamic resource
    /// adjustment): no downtime.
    Live,
}

impl ShareChange {
    /// Whether a change needs the client's restart (also: the serialized default).
    pub fn is_restart(&self) -> bool {
        *self == ShareChange::Restart
    }
}

impl HostCapacity {
    /// Resctrl groups a plan may use besides the default one.
    pub fn groups_available(&self) -> u32 {
        self.closids.saturating_sub(1)
    }

    /// True when the LLC can be split between groups: CAT with more than one way. A host
    /// without CAT reports one way ([`Self::without_allocation`]).
    pub fn partitions_llc(&self) -> bool {
        self.llc_ways > 1
    }

    /// This host as cohabit sees it without RDT allocation (no resctrl: most VMs): the
    /// LLC is one way that every group shares whole, and memory bandwidth has one level,
    /// 100 %. The controller's host discovery reports such a host this way, and the
    /// training data puts scenes on it, so a model has seen `ways_now = 1`.
    #[must_use]
    pub fn without_allocation(&self) -> HostCapacity {
        HostCapacity {
            llc_ways: 1,
            llc_way_bytes: self.llc_bytes(),
            mba_min_pct: crate::MBA_MAX_PCT,
            mba_gran_pct: crate::MBA_MAX_PCT,
            min_cbm_bits: 1,
            shareable_bits: 0,
            ..self.clone()
        }
    }

    /// Total LLC size in bytes.
    pub fn llc_bytes(&self) -> u64 {
        self.llc_way_bytes * u64::from(self.llc_ways)
    }

    /// Checks that every capacity is positive and finite; the error names the field.
    pub fn validate(&self) -> Result<(), CoreError> {
        if self.cores == 0 {
            return Err(CoreError::invalid(
                "host.cores",
                "must be at least 1, got 0",
            ));
        }
        if !(self.freq_ghz.is_finite() && self.freq_ghz > 0.0) {
            return Err(CoreError::invalid(
                "host.freq_ghz",
                format!("must be a positive number, got {}", self.freq_ghz),
            ));
        }
        if self.llc_ways == 0 || self.llc_ways > 64 {
            return Err(CoreError::invalid(
                "host.llc_ways",
                format!("must be between 1 and 64, got {}", self.llc_ways),
            ));
        }
        if self.llc_way_bytes == 0 {
            return Err(CoreError::invalid(
                "host.llc_way_bytes",
                "must be positive, got 0",
            ));
        }
        if !(self.mem_bw_bytes_per_s.is_finite() && self.mem_bw_bytes_per_s > 0.0) {
            return Err(CoreError::invalid(
                "host.mem_bw_bytes_per_s",
                format!("must be a positive number, got {}", self.mem_bw_bytes_per_s),
            ));
        }
        if self.closids < 2 {
            return Err(CoreError::invalid(
                "host.closids",
                format!(
                    "must be at least 2 (the default group and one more), got {}",
                    self.closids
                ),
            ));
        }
        if self.mba_min_pct == 0 || self.mba_min_pct > 100 {
            return Err(CoreError::invalid(
                "host.mba_min_pct",
                format!("must be between 1 and 100, got {}", self.mba_min_pct),
            ));
        }
        if self.mba_gran_pct == 0 || self.mba_gran_pct > 100 {
            return Err(CoreError::invalid(
                "host.mba_gran_pct",
                format!("must be between 1 and 100, got {}", self.mba_gran_pct),
            ));
        }
        if self.min_cbm_bits == 0 || self.min_cbm_bits > self.llc_ways {
            return Err(CoreError::invalid(
                "host.min_cbm_bits",
                format!(
                    "must be between 1 and llc_ways ({}), got {}",
                    self.llc_ways, self.min_cbm_bits
                ),
            ));
        }
        if self.llc_ways < 64 && self.shareable_bits >> self.llc_ways != 0 {
            return Err(CoreError::invalid(
                "host.shareable_bits",
                format!(
                    "must lie within the {} ways, got {:#x}",
                    self.llc_ways, self.shareable_bits
                ),
            ));
        }
        for (i, gpu) in self.gpus.iter().enumerate() {
            if gpu.sms == 0 {
                return Err(CoreError::invalid(
                    format!("host.gpus[{i}].sms"),
                    "must be positive, got 0",
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host() -> HostCapacity {
        HostCapacity {
            name: "test".into(),
            cores: 8,
            freq_ghz: 2.0,
            llc_ways: 11,
            llc_way_bytes: 1 << 20,
            mem_bw_bytes_per_s: 20e9,
            gpus: vec![],
            closids: 16,
            mba_min_pct: 10,
            mba_gran_pct: 10,
            min_cbm_bits: 1,
            shareable_bits: 0,
        }
    }

    #[test]
    fn without_allocation_the_llc_is_one_shared_way_and_mba_only_100() {
        let vm = host().without_allocation();
        vm.validate().unwrap();
        assert_eq!((vm.llc_ways, vm.llc_bytes()), (1, 11 << 20));
        assert!(!vm.partitions_llc() && host().partitions_llc());
        assert_eq!((vm.cores, vm.closids), (8, 16));
        let whole = crate::Allocation {
            cores: 2,
            llc_ways: crate::WayRange::new(0, 1),
            mba_pct: 100,
            gpu_mps_pct: None,
        };
        whole.validate(&vm, "svc").unwrap();
        let throttled = crate::Allocation {
            mba_pct: 90,
            ..whole
        };
        assert!(throttled.validate(&vm, "svc").is_err());
        assert!(throttled.validate(&host(), "svc").is_ok());
    }

    #[test]
    fn valid_host_passes_and_reports_llc_size() {
        let h = host();
        h.validate().unwrap();
        assert_eq!(h.llc_bytes(), 11 << 20);
    }

    #[test]
    fn cache_mask_limits_default_for_old_files_and_are_checked() {
        // A capacity written before the fields existed reads with no widening and no
        // shared ways, and is written back without them.
        let mut v = serde_json::to_value(host()).unwrap();
        assert!(v.get("min_cbm_bits").is_none() && v.get("shareable_bits").is_none());
        let old: HostCapacity = serde_json::from_value(v.clone()).unwrap();
        assert_eq!((old.min_cbm_bits, old.shareable_bits), (1, 0));
        v["min_cbm_bits"] = 2.into();
        v["shareable_bits"] = 0x600.into();
        let new: HostCapacity = serde_json::from_value(v).unwrap();
        assert_eq!((new.min_cbm_bits, new.shareable_bits), (2, 0x600));
        new.validate().unwrap();
        let mut h = host();
        h.min_cbm_bits = 12;
        assert!(h
            .validate()
            .unwrap_err()
            .to_string()
            .contains("host.min_cbm_bits"));
        let mut h = host();
        h.shareable_bits = 1 << 11;
        assert!(h
            .validate()
            .unwrap_err()
            .to_string()
            .contains("host.shareable_bits"));
    }

    #[test]
    fn zero_or_negative_capacities_name_the_field() {
        let mut h = host();
        h.cores = 0;
        assert!(h.validate().unwrap_err().to_string().contains("host.cores"));
        let mut h = host();
        h.mem_bw_bytes_per_s = -1.0;
        assert!(h
            .validate()
            .unwrap_err()
            .to_string()
            .contains("mem_bw_bytes_per_s"));
        let mut h = host();
        h.freq_ghz = f64::NAN;
        assert!(h.validate().unwrap_err().to_string().contains("freq_ghz"));
    }
}
