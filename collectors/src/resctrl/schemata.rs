//! resctrl `schemata` text: parse, format, compare, and the masks and MBA values it holds.
//!
//! Kernel doc: `Documentation/arch/x86/resctrl.rst`. A schemata file has one line per
//! resource, `RES:<domain>=<value>;<domain>=<value>…`. Cache resources (`L3`, `L2`, and
//! `L3CODE`/`L3DATA`, `L2CODE`/`L2DATA` with CDP) take a hexadecimal capacity bitmask, with
//! or without `0x`; `MB` (and AMD's `SMBA`) takes a decimal number (percent, MBps with the
//! `mba_MBps` mount option, or AMD's absolute units). Parsing tolerates what the kernel and
//! other tools write: any order of domains, spaces around tokens, empty items from stray or
//! trailing `;`, leading zeros, a resource split over several lines. Lines of resources we
//! do not manage are kept aside and ignored by comparisons.

use std::collections::BTreeMap;
use std::fmt;

/// Resources whose values are capacity bitmasks.
const CACHE_RESOURCES: [&str; 6] = ["L3", "L3CODE", "L3DATA", "L2", "L2CODE", "L2DATA"];
/// Resources whose values are decimal bandwidth numbers.
const BANDWIDTH_RESOURCES: [&str; 2] = ["MB", "SMBA"];

/// A schemata line or item the kernel would refuse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid schemata {what}: {text:?}")]
pub struct SchemataError {
    /// What is wrong.
    pub what: &'static str,
    /// The offending text.
    pub text: String,
}

/// Parsed schemata: for each managed resource, domain id → value.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Schemata {
    resources: BTreeMap<String, BTreeMap<u32, u64>>,
    /// Names of resources present but not managed here (kept for diagnostics).
    pub ignored: Vec<String>,
}

fn is_cache(res: &str) -> bool {
    CACHE_RESOURCES.contains(&res)
}

fn is_managed(res: &str) -> bool {
    is_cache(res) || BANDWIDTH_RESOURCES.contains(&res)
}

impl Schemata {
    /// Only the cache lines (`L3`, `L3CODE`, `L3DATA`, …) of `self`: the bandwidth lines
    /// dropped.
    pub fn cache_only(&self) -> Schemata {
        Schemata {
            resources: self
                .resources
                .iter()
                .filter(|(r, _)| is_cache(r))
                .map(|(r, d)| (r.clone(), d.clone()))
                .collect(),
            ignored: Vec::new(),
        }
    }

    /// Parses schemata text.
    pub fn parse(text: &str) -> Result<Self, SchemataError> {
        let mut out = Schemata::default();
        for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
            let Some((res, items)) = line.split_once(':') else {
                return Err(SchemataError {
                    what: "line without `RESOURCE:`",
                    text: line.into(),
                });
            };
            let res = res.trim();
            if !is_managed(res) {
                out.ignored.push(res.to_string());
                continue;
            }
            let domains = out.resources.entry(res.to_string()).or_default();
            for item in items.split(';').map(str::trim).filter(|i| !i.is_empty()) {
                let mut parts = item.split('=');
                let (Some(d), Some(v), None) = (parts.next(), parts.next(), parts.next()) else {
                    return Err(SchemataError {
                        what: "item that is not `domain=value`",
                        text: item.into(),
                    });
                };
                let (d, v) = (d.trim(), v.trim());
                let domain = d.parse::<u32>().map_err(|_| SchemataError {
                    what: "domain id",
                    text: item.into(),
                })?;
                let value = if is_cache(res) {
                    parse_mask(v)
                } else {
                    v.parse::<u64>().ok()
                }
                .ok_or_else(|| SchemataError {
                    what: "value",
                    text: item.into(),
                })?;
                domains.insert(domain, value);
            }
        }
        Ok(out)
    }

    /// Sets one value.
    pub fn set(&mut self, resource: &str, domain: u32, value: u64) {
        self.resources
            .entry(resource.to_string())
            .or_default()
            .insert(domain, value);
    }

    /// One value, if present.
    pub fn get(&self, resource: &str, domain: u32) -> Option<u64> {
        self.resources.get(resource)?.get(&domain).copied()
    }

    /// The domains of a resource, in order.
    pub fn domains(&self, resource: &str) -> Vec<u32> {
        self.resources
            .get(resource)
            .map(|d| d.keys().copied().collect())
            .unwrap_or_default()
    }

    /// True if code/data prioritisation splits the L3 (or L2) resource.
    pub fn has_cdp(&self, level: &str) -> bool {
        self.resources.contains_key(&format!("{level}CODE"))
            || self.resources.contains_key(&format!("{level}DATA"))
    }

    /// True if no managed resource is present.
    pub fn is_empty(&self) -> bool {
        self.resources.values().all(BTreeMap::is_empty)
    }

    /// What to write to turn `current` into `self`: only the resources and domains whose
    /// values differ (the kernel leaves unlisted domains alone).
    pub fn changes_from(&self, current: &Schemata) -> Schemata {
        let mut out = Schemata::default();
        for (res, domains) in &self.resources {
            for (d, v) in domains {
                if current.get(res, *d) != Some(*v) {
                    out.set(res, *d, *v);
                }
            }
        }
        out
    }
}

impl Schemata {
    /// The values `self` holds for the resources and domains listed in `keys` (those it
    /// has): what to write back to undo writing `keys`.
    pub fn values_at(&self, keys: &Schemata) -> Schemata {
        let mut out = Schemata::default();
        for (res, domains) in &keys.resources {
            for d in domains.keys() {
                if let Some(v) = self.get(res, *d) {
                    out.set(res, *d, v);
                }
            }
        }
        out
    }
}

impl fmt::Display for Schemata {
    /// One line per resource, domains in order, masks in lower-case hex without `0x`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (res, domains) in self.resources.iter().filter(|(_, d)| !d.is_empty()) {
            let items: Vec<String> = domains
                .iter()
                .map(|(d, v)| {
                    if is_cache(res) {
                        format!("{d}={v:x}")
                    } else {
                        format!("{d}={v}")
                    }
                })
                .collect();
            writeln!(f, "{res}:{}", items.join(";"))?;
        }
        Ok(())
    }
}

fn parse_mask(v: &str) -> Option<u64> {
    let hex = v
        .strip_prefix("0x")
        .or_else(|| v.strip_prefix("0X"))
        .unwrap_or(v);
    if hex.is_empty() {
        return None;
    }
    u64::from_str_radix(hex, 16).ok()
}

/// Checks a capacity bitmask as the kernel does; the error is the kernel's
/// `info/last_cmd_status` text for the same write.
pub fn check_cbm(mask: u64, cbm_mask: u64, min_cbm_bits: u32) -> Result<(), String> {
    if mask & !cbm_mask != 0 {
        return Err(format!("Mask out of range: {mask:x}"));
    }
    if mask != 0 {
        let shifted = mask >> mask.trailing_zeros();
        if shifted & (shifted + 1) != 0 {
            return Err(format!("mask {mask:x} has non-consecutive 1-bits"));
        }
    }
    if mask.count_ones() < min_cbm_bits {
        return Err(format!("Need at least {min_cbm_bits} bits in the mask"));
    }
    Ok(())
}

/// The contiguous mask of `count` ways starting at `first`, widened to at least
/// `min_cbm_bits` ways (downwards if it would run past the top), within `cbm_mask`.
pub fn contiguous_mask(first: u32, count: u32, min_cbm_bits: u32, cbm_mask: u64) -> u64 {
    let width = 64 - cbm_mask.leading_zeros();
    let count = count.max(min_cbm_bits).min(width);
    let first = first.min(width - count);
    let ones = if count >= 64 {
        u64::MAX
    } else {
        (1u64 << count) - 1
    };
    (ones << first) & cbm_mask
}

/// How a host expresses memory bandwidth in `MB` lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "units", rename_all = "snake_case")]
pub enum MbaUnits {
    /// Intel: percent of peak, in steps of `gran` from `min` (`info/MB/min_bandwidth`,
    /// `bandwidth_gran`).
    Percent {
        /// Smallest value.
        min: u32,
        /// Step.
        gran: u32,
    },
    /// Intel with the `mba_MBps` mount option: an absolute MBps target; `max_mbps` is the
    /// host's peak.
    Mbps {
        /// What 100 % means.
        max_mbps: u32,
    },
    /// AMD: absolute units of 1/8 GB/s; 2048 means unlimited.
    AmdEighthsGbps,
}

impl MbaUnits {
    /// The `MB` value for a bandwidth percentage. Intel percentages are rounded up to the
    /// next step the hardware has, as the kernel does; 100 % means unthrottled everywhere.
    pub fn value(&self, pct: u8) -> u64 {
        let pct = u64::from(pct.clamp(1, 100));
        match *self {
            MbaUnits::Percent { min, gran } => {
                let (min, gran) = (u64::from(min), u64::from(gran.max(1)));
                if pct <= min {
                    min
                } else {
                    (min + (pct - min).div_ceil(gran) * gran).min(100)
                }
            }
            MbaUnits::Mbps { max_mbps } => (u64::from(max_mbps) * pct).div_ceil(100),
            MbaUnits::AmdEighthsGbps => {
                if pct >= 100 {
                    2048
                } else {
                    (2048 * pct).div_ceil(100)
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn cache_only_keeps_the_cache_lines_and_drops_bandwidth() {
        let s = Schemata::parse("L3CODE:0=ff;1=ff\nL3DATA:0=f0;1=f0\nMB:0=50;1=50\n").unwrap();
        let c = s.cache_only();
        assert_eq!(c.get("L3DATA", 1), Some(0xf0));
        assert_eq!(c.get("L3CODE", 0), Some(0xff));
        assert_eq!(c.get("MB", 0), None);
        assert!(c.domains("MB").is_empty());
    }

    use proptest::prelude::*;

    use super::*;

    #[test]
    fn masks_are_checked_like_the_kernel() {
        assert_eq!(
            check_cbm(0xf7, 0xfffff, 1).unwrap_err(),
            "mask f7 has non-consecutive 1-bits"
        );
        assert!(check_cbm(0x1, 0xfffff, 2)
            .unwrap_err()
            .contains("at least 2 bits"));
        assert!(check_cbm(0x100000, 0xfffff, 1)
            .unwrap_err()
            .contains("out of range"));
        check_cbm(0xff0, 0xfffff, 2).unwrap();
    }

    #[test]
    fn contiguous_masks_honour_min_bits_and_the_top() {
        assert_eq!(contiguous_mask(0, 4, 1, 0xfffff), 0xf);
        assert_eq!(contiguous_mask(19, 1, 2, 0xfffff), 0xc0000);
        assert_eq!(contiguous_mask(5, 1, 1, 0x7ff), 0x20);
    }

    #[test]
    fn mba_percent_rounds_up_to_the_next_step() {
        let intel = MbaUnits::Percent { min: 10, gran: 10 };
        assert_eq!(intel.value(35), 40);
        assert_eq!(intel.value(5), 10);
        assert_eq!(intel.value(100), 100);
        let fine = MbaUnits::Percent { min: 20, gran: 15 };
        assert_eq!(fine.value(36), 50);
        assert_eq!(fine.value(99), 100);
        assert_eq!(MbaUnits::AmdEighthsGbps.value(100), 2048);
        assert_eq!(MbaUnits::AmdEighthsGbps.value(50), 1024);
        assert_eq!(MbaUnits::Mbps { max_mbps: 10000 }.value(25), 2500);
    }

    #[test]
    fn changes_list_only_differing_domains() {
        let cur = Schemata::parse("L3:0=fffff;1=fffff\nMB:0=100;1=100").unwrap();
        let want = Schemata::parse("L3:0=f;1=fffff\nMB:0=100;1=50").unwrap();
        assert_eq!(want.changes_from(&cur).to_string(), "L3:0=f\nMB:1=50\n");
        assert!(cur.changes_from(&cur).is_empty());
    }

    fn arb_schemata() -> impl Strategy<Value = Schemata> {
        let res = prop::sample::select(vec!["L3", "L3CODE", "L3DATA", "L2", "MB"]);
        prop::collection::vec((res, 0u32..16, 0u64..0xfffff), 0..12).prop_map(|items| {
            let mut s = Schemata::default();
            for (r, d, v) in items {
                s.set(r, d, v);
            }
            s
        })
    }

    proptest! {
        #[test]
        fn format_then_parse_round_trips(s in arb_schemata()) {
            let text = s.to_string();
            let back = Schemata::parse(&text).unwrap();
            prop_assert_eq!(&back, &s);
            prop_assert_eq!(back.to_string(), text);
        }

        #[test]
        fn whitespace_order_and_zeros_do_not_change_meaning(s in arb_schemata(), pad in 0usize..3) {
            let spaced: String = s
                .to_string()
                .lines()
                .map(|l| {
                    let (r, items) = l.split_once(':').unwrap();
                    let mut items: Vec<String> = items
                        .split(';')
                        .map(|i| {
                            let (d, v) = i.split_once('=').unwrap();
                            let zeros = "0".repeat(pad);
                            let v = if r == "MB" { v.to_string() } else { format!("0x{zeros}{v}") };
                            format!(" {d} ={} {v} ", " ".repeat(pad))
                        })
                        .collect();
                    items.reverse();
                    format!("  {r}:{};\n", items.join(";;"))
                })
                .collect();
            prop_assert_eq!(Schemata::parse(&spaced).unwrap(), s);
        }
    }
}
