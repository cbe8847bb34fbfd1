//! resctrl: the shared conformance vectors, and the fake tree that behaves like the kernel.

use std::sync::Arc;

use cohabit_collectors::resctrl::fake::FakeResctrl;
use cohabit_collectors::resctrl::{
    find_mount, parse_tasks, BandwidthRate, MbaUnits, MonReading, Resctrl, ResctrlError, Schemata,
    GROUP_PREFIX,
};
use cohabit_core::{Allocation, WayRange};
use serde_json::Value;

fn vectors() -> Value {
    serde_json::from_str(include_str!("data/resctrl_vectors.json")).unwrap()
}

fn hex(v: &Value) -> u64 {
    let s = v.as_str().unwrap();
    u64::from_str_radix(s.trim_start_matches("0x"), 16).unwrap()
}

#[test]
fn parse_vectors() {
    let v = vectors();
    for case in v["schemata_parse"].as_array().unwrap() {
        let input = case["input"].as_str().unwrap();
        let parsed = Schemata::parse(input);
        match &case["expect"] {
            Value::String(s) if s.starts_with("valid") => {
                assert!(!parsed.unwrap().is_empty(), "{input:?}");
            }
            Value::String(s) if s.contains("no L3 line") => {
                assert!(parsed.unwrap().domains("L3").is_empty(), "{input:?}");
            }
            Value::String(s) if s.contains("empty") => {
                assert!(parsed.unwrap().is_empty(), "{input:?}");
            }
            Value::Object(obj) => {
                let s = parsed.unwrap_or_else(|e| panic!("{input:?}: {e}"));
                for (key, want) in obj {
                    if key == "cdp" {
                        continue;
                    }
                    if let Some(level) = key.strip_suffix("[0]") {
                        assert!(s.has_cdp(level), "{input:?}");
                        assert_eq!(
                            s.get(&format!("{level}DATA"), 0),
                            Some(hex(&want["data"])),
                            "{input:?}"
                        );
                        assert_eq!(
                            s.get(&format!("{level}CODE"), 0),
                            Some(hex(&want["code"])),
                            "{input:?}"
                        );
                        continue;
                    }
                    for (domain, value) in want.as_object().unwrap() {
                        let d: u32 = domain.parse().unwrap();
                        let expected = value.as_u64().unwrap_or_else(|| hex(value));
                        assert_eq!(s.get(key, d), Some(expected), "{input:?} {key}:{d}");
                    }
                    if obj.get("cdp") == Some(&Value::Bool(false)) {
                        assert!(!s.has_cdp(key), "{input:?}");
                    }
                }
            }
            other => panic!("unhandled expectation {other}"),
        }
    }
}

#[test]
fn write_vectors() {
    let v = vectors();
    for case in v["schemata_write"].as_array().unwrap() {
        let set = case["set"].as_object().unwrap();
        let mut s = Schemata::default();
        if let Some(ids) = set.get("cacheids") {
            for id in ids.as_array().unwrap() {
                let d = u32::try_from(id.as_u64().unwrap()).unwrap();
                if let Some(m) = set.get("l3mask") {
                    s.set("L3", d, hex(m));
                }
                if let Some(mb) = set.get("mb") {
                    s.set("MB", d, mb.as_str().unwrap().parse().unwrap());
                }
            }
            // koordinator writes a trailing ';' and one line per write: same meaning.
            let expect = match &case["expect"] {
                Value::Array(lines) => lines
                    .iter()
                    .map(|l| l.as_str().unwrap())
                    .collect::<String>(),
                e => e.as_str().unwrap().to_string(),
            };
            assert_eq!(Schemata::parse(&expect).unwrap(), s, "{expect:?}");
        } else {
            for (res, domains) in set {
                for (d, m) in domains.as_object().unwrap() {
                    s.set(res, d.parse().unwrap(), hex(m));
                }
            }
            assert_eq!(s.to_string(), case["expect"].as_str().unwrap());
        }
    }
}

#[test]
fn equivalence_vectors() {
    let v = &vectors()["schemata_equivalence_youki"];
    for pair in v["same"].as_array().unwrap() {
        let (a, b) = (pair[0].as_str().unwrap(), pair[1].as_str().unwrap());
        let (pa, pb) = (Schemata::parse(a).unwrap(), Schemata::parse(b).unwrap());
        assert!(
            pa.changes_from(&pb).is_empty() && pb.changes_from(&pa).is_empty(),
            "{a:?} vs {b:?}"
        );
    }
    for pair in v["different"].as_array().unwrap() {
        let (a, b) = (pair[0].as_str().unwrap(), pair[1].as_str().unwrap());
        // A side we refuse to parse (`MB:0=f` is not decimal) cannot be the same either.
        let (Ok(pa), Ok(pb)) = (Schemata::parse(a), Schemata::parse(b)) else {
            continue;
        };
        assert!(
            !pa.changes_from(&pb).is_empty() || !pb.changes_from(&pa).is_empty(),
            "{a:?} vs {b:?}"
        );
    }
    for bad in v["invalid"].as_array().unwrap() {
        assert!(Schemata::parse(bad.as_str().unwrap()).is_err(), "{bad}");
    }
}

#[test]
fn a_task_list_with_garbage_is_an_error() {
    assert_eq!(parse_tasks("101\n111\n").unwrap(), vec![101, 111]);
    assert!(parse_tasks("101\n1aa\n").unwrap_err().contains("1aa"));
}

#[test]
fn the_mount_and_its_options_come_from_mountinfo() {
    let mi = "22 1 8:1 / / rw - ext4 /dev/sda1 rw\n40 25 0:35 / /sys/fs/resctrl rw,relatime shared:14 - resctrl resctrl rw,cdp,mba_MBps\n";
    let (root, opts) = find_mount(mi).unwrap();
    assert_eq!(root, std::path::PathBuf::from("/sys/fs/resctrl"));
    assert!(opts.iter().any(|o| o == "mba_MBps") && opts.iter().any(|o| o == "cdp"));
    assert!(find_mount("22 1 8:1 / / rw - ext4 /dev/sda1 rw\n").is_none());
}

fn open(fake: &FakeResctrl) -> Resctrl {
    Resctrl::discover(&fake.paths(), Arc::new(fake.clone()))
        .unwrap()
        .expect("resctrl present")
}

fn alloc(first: u32, count: u32, mba: u8) -> Allocation {
    Allocation {
        cores: 1,
        llc_ways: WayRange::new(first, count),
        mba_pct: mba,
        gpu_mps_pct: None,
    }
}

#[test]
fn info_is_read_from_the_tree() {
    let fake = FakeResctrl::builder()
        .ways(11)
        .min_cbm_bits(2)
        .num_closids(8)
        .domains(&[0, 1])
        .build()
        .unwrap();
    let r = open(&fake);
    let info = r.info();
    let l3 = info.l3.as_ref().unwrap();
    assert_eq!(
        (l3.ways(), l3.min_cbm_bits, l3.num_closids, l3.cdp),
        (11, 2, 8, false)
    );
    assert_eq!(
        info.mba.as_ref().unwrap().units,
        MbaUnits::Percent { min: 10, gran: 10 }
    );
    assert_eq!(info.l3_domains, vec![0, 1]);
    assert!(info
        .mon
        .as_ref()
        .unwrap()
        .features
        .iter()
        .any(|f| f == "mbm_total_bytes"));
}

#[test]
fn an_allocation_becomes_masks_on_every_domain_and_cdp_gets_both_halves() {
    let fake = FakeResctrl::builder().domains(&[0, 1]).build().unwrap();
    let s = open(&fake).schemata_for(&alloc(4, 3, 35));
    assert_eq!(s.to_string(), "L3:0=70;1=70\nMB:0=40;1=40\n");
    let cdp = FakeResctrl::builder().cdp(true).build().unwrap();
    let s = open(&cdp).schemata_for(&alloc(0, 2, 100));
    assert_eq!(s.to_string(), "L3CODE:0=3\nL3DATA:0=3\nMB:0=100\n");
}

#[test]
fn apply_writes_only_what_changed_and_rejections_carry_the_kernels_reason() {
    let fake = FakeResctrl::builder().min_cbm_bits(2).build().unwrap();
    let r = open(&fake);
    let g = format!("{GROUP_PREFIX}lc");
    r.ensure_group(&g).unwrap();
    let written = r.apply(&g, &r.schemata_for(&alloc(0, 4, 100))).unwrap();
    assert_eq!(written.to_string(), "L3:0=f\n", "MB was already 100");
    assert!(r
        .apply(&g, &r.schemata_for(&alloc(0, 4, 100)))
        .unwrap()
        .is_empty());
    let mut bad = Schemata::default();
    bad.set("L3", 0, 0xf7);
    match r.apply(&g, &bad) {
        Err(ResctrlError::Rejected { status, .. }) => {
            assert_eq!(status, "mask f7 has non-consecutive 1-bits")
        }
        other => panic!("{other:?}"),
    }
    let mut short = Schemata::default();
    short.set("L3", 0, 0x1);
    let err = r.apply(&g, &short).unwrap_err().to_string();
    assert!(err.contains("Need at least 2 bits"), "{err}");
    assert_eq!(
        r.schemata(Some(&g)).unwrap().get("L3", 0),
        Some(0xf),
        "last good state kept"
    );
}

#[test]
fn closids_run_out_and_names_are_checked() {
    let fake = FakeResctrl::builder().num_closids(3).build().unwrap();
    let r = open(&fake);
    r.ensure_group("cohabit-a").unwrap();
    r.ensure_group("cohabit-b").unwrap();
    r.ensure_group("cohabit-a").unwrap();
    let err = r.ensure_group("cohabit-c").unwrap_err();
    assert!(
        matches!(err, ResctrlError::OutOfClosids { num_closids: 3, .. }),
        "{err}"
    );
    for bad in [
        "",
        "../x",
        "a/b",
        ".hidden",
        "info",
        "tab\there",
        &"x".repeat(65),
    ] {
        assert!(
            matches!(r.ensure_group(bad), Err(ResctrlError::BadName(_))),
            "{bad:?}"
        );
    }
    assert!(matches!(
        r.ensure_group("not-ours"),
        Err(ResctrlError::BadName(_))
    ));
    assert_eq!(r.own_groups().unwrap(), vec!["cohabit-a", "cohabit-b"]);
    r.remove_group("cohabit-a").unwrap();
    r.remove_group("cohabit-a").unwrap();
    assert_eq!(r.own_groups().unwrap(), vec!["cohabit-b"]);
}

#[test]
fn tasks_move_between_groups_and_vanished_ones_are_skipped() {
    let fake = FakeResctrl::builder().build().unwrap();
    for t in [100, 101, 102] {
        fake.add_task(t).unwrap();
    }
    let r = open(&fake);
    r.ensure_group("cohabit-a").unwrap();
    r.ensure_group("cohabit-b").unwrap();
    assert_eq!(
        r.move_tasks(Some("cohabit-a"), &[100, 101, 999]).unwrap(),
        2
    );
    assert_eq!(r.tasks(Some("cohabit-a")).unwrap(), vec![100, 101]);
    assert_eq!(r.tasks(None).unwrap(), vec![102]);
    r.move_tasks(Some("cohabit-b"), &[101]).unwrap();
    assert_eq!(r.tasks(Some("cohabit-a")).unwrap(), vec![100]);
    r.remove_group("cohabit-a").unwrap();
    let mut root = r.tasks(None).unwrap();
    root.sort_unstable();
    assert_eq!(root, vec![100, 102]);
}

#[test]
fn bandwidth_needs_two_trustworthy_readings() {
    let fake = FakeResctrl::builder().domains(&[0, 1]).build().unwrap();
    let r = open(&fake);
    r.ensure_group("cohabit-a").unwrap();
    let g = Some("cohabit-a");
    fake.set_counter(g, 0, "mbm_total_bytes", Some(1_000))
        .unwrap();
    fake.set_counter(g, 1, "mbm_total_bytes", Some(1_000))
        .unwrap();
    fake.set_counter(g, 0, "llc_occupancy", Some(4096)).unwrap();
    let a = r.read_mon(g).unwrap();
    assert_eq!(
        (a.mbm_total_bytes, a.llc_occupancy_bytes),
        (Some(2_000), Some(4096))
    );
    fake.set_counter(g, 0, "mbm_total_bytes", Some(3_000))
        .unwrap();
    let b = r.read_mon(g).unwrap();
    let mut rate = BandwidthRate {
        dropped: 0,
        max_bytes_per_s: 1e12,
    };
    assert_eq!(rate.rate(&a, &b, 2.0), Some(1_000.0));
    assert_eq!(rate.rate(&b, &a, 1.0), None, "counter went backwards");
    fake.set_counter(g, 1, "mbm_total_bytes", None).unwrap();
    let c = r.read_mon(g).unwrap();
    assert_eq!(c.mbm_total_bytes, None, "Unavailable on one domain");
    assert_eq!(rate.rate(&b, &c, 1.0), None);
    r.remove_group("cohabit-a").unwrap();
    r.ensure_group("cohabit-a").unwrap();
    let recreated = MonReading {
        mbm_total_bytes: Some(5_000),
        ..r.read_mon(g).unwrap()
    };
    assert_ne!(recreated.identity, b.identity);
    assert_eq!(rate.rate(&b, &recreated, 1.0), None, "group was recreated");
    let glitch = MonReading {
        mbm_total_bytes: Some(3_000 + 176_000_000_000_000),
        ..b
    };
    assert_eq!(rate.rate(&b, &glitch, 1.0), None);
    assert_eq!(rate.dropped, 1);
}

#[test]
fn no_resctrl_mount_is_absence_not_an_error() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("proc/self")).unwrap();
    std::fs::write(
        dir.path().join("proc/self/mountinfo"),
        "22 1 8:1 / / rw - ext4 /dev/sda1 rw\n",
    )
    .unwrap();
    let mut paths = cohabit_collectors::HostPaths::under(dir.path());
    paths.resctrl = None;
    let r = Resctrl::discover(&paths, Arc::new(cohabit_collectors::kfs::RealFs)).unwrap();
    assert!(r.is_none());
}

#[test]
fn closids_are_the_smallest_over_l3_and_mb_and_mba_steps_come_from_info() {
    // The fake gives MB at most 8 CLOSIDs, as many Xeons do.
    let fake = FakeResctrl::builder()
        .num_closids(16)
        .mba(Some((20, 5)))
        .build()
        .unwrap();
    let info = open(&fake).info().clone();
    assert_eq!(info.l3.as_ref().unwrap().num_closids, 16);
    assert_eq!(info.num_closids(), 8, "MB binds");
    assert_eq!(
        (info.mba_min_pct(), info.mba_gran_pct()),
        (Some(20), Some(5))
    );
    assert!(info.allocates());
    let no_mba = FakeResctrl::builder()
        .num_closids(16)
        .mba(None)
        .build()
        .unwrap();
    let info = open(&no_mba).info().clone();
    assert_eq!(info.num_closids(), 16, "only L3 is in use");
    assert_eq!((info.mba_min_pct(), info.mba_gran_pct()), (None, None));
}

#[test]
fn an_applied_schemata_can_be_undone() {
    let fake = FakeResctrl::builder().domains(&[0, 1]).build().unwrap();
    let r = open(&fake);
    let g = format!("{GROUP_PREFIX}lc");
    r.ensure_group(&g).unwrap();
    r.apply(&g, &r.schemata_for(&alloc(0, 4, 50))).unwrap();
    let before = r.schemata(Some(&g)).unwrap();
    let applied = r
        .apply_undoable(&g, &r.schemata_for(&alloc(4, 4, 50)))
        .unwrap();
    assert_eq!(applied.written.to_string(), "L3:0=f0;1=f0\n");
    assert_eq!(
        applied.previous.to_string(),
        "L3:0=f;1=f\n",
        "only what changed"
    );
    r.apply(&g, &applied.previous).unwrap();
    assert_eq!(r.schemata(Some(&g)).unwrap(), before);
    let again = r
        .apply_undoable(&g, &r.schemata_for(&alloc(0, 4, 50)))
        .unwrap();
    assert!(again.written.is_empty() && again.previous.is_empty());
}

#[test]
fn an_amd_host_gets_absolute_mb_units() {
    let fake = FakeResctrl::builder().build().unwrap();
    let cpuinfo = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n\nprocessor\t: 1\nvendor_id\t: AuthenticAMD\n";
    std::fs::write(fake.base().join("proc/cpuinfo"), cpuinfo).unwrap();
    assert_eq!(
        open(&fake).info().mba.as_ref().unwrap().units,
        MbaUnits::AmdEighthsGbps
    );
    std::fs::write(
        fake.base().join("proc/cpuinfo"),
        cpuinfo.replace("AuthenticAMD", "GenuineIntel"),
    )
    .unwrap();
    assert!(matches!(
        open(&fake).info().mba.as_ref().unwrap().units,
        MbaUnits::Percent { .. }
    ));
}

#[test]
fn monitoring_groups_count_their_own_tasks_and_follow_the_kernels_rules() {
    let fake = FakeResctrl::builder().num_rmids(4).build().unwrap();
    for t in [100, 101, 102] {
        fake.add_task(t).unwrap();
    }
    let r = open(&fake);
    r.ensure_group("cohabit-a").unwrap();
    r.ensure_group("cohabit-b").unwrap();
    r.move_tasks(Some("cohabit-a"), &[100, 101]).unwrap();
    r.ensure_mon_group("cohabit-a", "kv").unwrap();
    r.ensure_mon_group("cohabit-a", "kv").unwrap();
    assert_eq!(r.mon_groups("cohabit-a").unwrap(), vec!["kv".to_string()]);
    // Only a task of the parent control group may join; the kernel says why not.
    r.move_tasks_to_mon("cohabit-a", "kv", &[100]).unwrap();
    let e = r.move_tasks_to_mon("cohabit-a", "kv", &[102]).unwrap_err();
    assert!(e.to_string().contains("moving a task"), "{e}");
    let status = std::fs::read_to_string(fake.root().join("info/last_cmd_status")).unwrap();
    assert!(status.contains("different control group"), "{status}");
    assert_eq!(r.mon_tasks("cohabit-a", "kv").unwrap(), vec![100]);
    assert_eq!(
        r.tasks(Some("cohabit-a")).unwrap(),
        vec![100, 101],
        "the control group lists it still"
    );
    // Each monitoring group reads its own RMID; the control group reads them all.
    fake.set_counter(Some("cohabit-a"), 0, "mbm_total_bytes", Some(1_000))
        .unwrap();
    fake.set_counter(
        Some("cohabit-a/mon_groups/kv"),
        0,
        "mbm_total_bytes",
        Some(300),
    )
    .unwrap();
    assert_eq!(
        r.read_mon_group("cohabit-a", "kv").unwrap().mbm_total_bytes,
        Some(300)
    );
    assert_eq!(
        r.read_mon(Some("cohabit-a")).unwrap().mbm_total_bytes,
        Some(1_300)
    );
    // RMIDs: the root, a, b and kv use all 4.
    let e = r.ensure_mon_group("cohabit-b", "web").unwrap_err();
    assert!(e.to_string().contains("out of RMIDs"), "{e}");
    // Writing the control group's tasks takes a task out of its monitoring group.
    r.move_tasks(Some("cohabit-a"), &[100]).unwrap();
    assert!(r.mon_tasks("cohabit-a", "kv").unwrap().is_empty());
    r.move_tasks_to_mon("cohabit-a", "kv", &[100]).unwrap();
    // Removing the monitoring group leaves its task in the control group.
    r.remove_mon_group("cohabit-a", "kv").unwrap();
    assert!(r.mon_groups("cohabit-a").unwrap().is_empty());
    let mut left = r.tasks(Some("cohabit-a")).unwrap();
    left.sort_unstable();
    assert_eq!(left, vec![100, 101]);
    // Removing a control group removes its monitoring groups; their tasks go to the root.
    r.ensure_mon_group("cohabit-a", "kv").unwrap();
    r.move_tasks_to_mon("cohabit-a", "kv", &[101]).unwrap();
    r.remove_group("cohabit-a").unwrap();
    let mut root = r.tasks(None).unwrap();
    root.sort_unstable();
    assert_eq!(root, vec![100, 101, 102]);
    assert!(
        r.ensure_mon_group("cohabit-a", "kv").is_err(),
        "no control group, no monitoring group"
    );
}
