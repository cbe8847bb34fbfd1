//! Plots and the HTML report, checked the way a person would see them: the page is opened in
//! headless Chromium, which must decode every plot and lay out the tables. Without a
//! Chromium (`apt-get install chromium`) that part skips through `cohabit_testkit`'s gate, a
//! failure where `.ci/run` declares Chromium installed.

use std::path::Path;
use std::process::Command;

fn cohabit(args: &[&str]) -> String {
    let o = Command::new(env!("CARGO_BIN_EXE_cohabit"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "cohabit {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn headless(browser: &Path, profile: &Path) -> Command {
    let mut c = Command::new(browser);
    c.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--virtual-time-budget=5000",
    ])
    .arg(format!("--user-data-dir={}", profile.display()));
    c
}

fn attr(dom: &str, name: &str) -> Option<u32> {
    let key = format!("{name}=\"");
    let start = dom.find(&key)? + key.len();
    dom[start..].split('"').next()?.parse().ok()
}

#[test]
fn plots_come_out_as_png_and_svg_with_labels() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    cohabit(&[
        "simulate",
        "--scenario",
        "load-spike",
        "--policy",
        "parties",
        "--out",
        run.to_str().unwrap(),
    ]);
    let out = cohabit(&["plot", run.to_str().unwrap()]);
    assert!(
        out.contains("qos.png") && out.contains("allocations.png"),
        "{out}"
    );
    let png = std::fs::read(run.join("plots/qos.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    let svg_dir = dir.path().join("svg");
    cohabit(&[
        "plot",
        run.to_str().unwrap(),
        "--format",
        "svg",
        "--out",
        svg_dir.to_str().unwrap(),
    ]);
    let svg = std::fs::read_to_string(svg_dir.join("allocations.svg")).unwrap();
    for label in [
        "<svg",
        "time (s)",
        "cores",
        "LLC ways",
        "memcached",
        "best-effort",
        "actuation: feedback step",
    ] {
        assert!(
            svg.contains(label),
            "{label} missing from the allocation plot"
        );
    }
    let qos = std::fs::read_to_string(svg_dir.join("qos.svg")).unwrap();
    for label in [
        "p99 / target",
        "target",
        "measured",
        "true (simulator)",
        "violation",
    ] {
        assert!(qos.contains(label), "{label} missing from the latency plot");
    }
}

#[test]
fn the_report_renders_its_plots_and_tables_in_a_browser() {
    let dir = tempfile::tempdir().unwrap();
    let cmp = dir.path().join("cmp");
    cohabit(&[
        "compare",
        "--scenario",
        "demo",
        "--out",
        cmp.to_str().unwrap(),
    ]);
    let run = dir.path().join("run");
    cohabit(&[
        "simulate",
        "--scenario",
        "demo",
        "--policy",
        "parties",
        "--out",
        run.to_str().unwrap(),
    ]);
    for d in [&run, &cmp] {
        cohabit(&["report", d.to_str().unwrap()]);
        let html = std::fs::read_to_string(d.join("report.html")).unwrap();
        assert!(html.contains("SIMULATION"), "a simulated run says so");
        assert!(
            !html.contains("src=\"plots/"),
            "plots are inline, the page is self-contained"
        );
        assert!(html.matches("data:image/png;base64,").count() >= 2);
    }
    let Some(browser) = cohabit_testkit::chromium() else {
        return;
    };
    for (d, min_rows) in [(&run, 10), (&cmp, 3)] {
        let page = format!("file://{}", d.join("report.html").display());
        let profile = tempfile::tempdir().unwrap();
        let dom = headless(&browser, profile.path())
            .arg("--dump-dom")
            .arg(&page)
            .output()
            .unwrap();
        let dom = String::from_utf8_lossy(&dom.stdout);
        assert_eq!(
            attr(&dom, "data-plots"),
            Some(2),
            "both plots decoded in {}",
            d.display()
        );
        assert!(
            attr(&dom, "data-rows").unwrap_or(0) >= min_rows,
            "tables laid out in {}",
            d.display()
        );
        let shot = d.join("screenshot.png");
        let o = headless(&browser, profile.path())
            .arg(format!("--screenshot={}", shot.display()))
            .arg("--window-size=1280,2400")
            .arg(&page)
            .output()
            .unwrap();
        let png = std::fs::read(&shot)
            .unwrap_or_else(|_| panic!("no screenshot: {}", String::from_utf8_lossy(&o.stderr)));
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        assert!(
            png.len() > 50_000,
            "a page with plots is not a blank screenshot ({} bytes)",
            png.len()
        );
    }
}
