//! Drives one memcached at a fixed rate with realbench's open-loop client and prints each
//! 1-second window's client-side p99, then how many windows met a target: for trying host
//! settings by hand (`window_p99 127.0.0.1:11211 2000 30 1.0`).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use cohabit_realbench::client::{preload, Load, LoadSpec, Proto};

fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [addr, rate, seconds, target_ms] = args.as_slice() else {
        return Err("usage: window_p99 ADDR RPS SECONDS TARGET_MS".into());
    };
    let addr: SocketAddr = addr.parse().map_err(|e| format!("ADDR: {e}"))?;
    let rate: f64 = rate.parse().map_err(|e| format!("RPS: {e}"))?;
    let seconds: u32 = seconds.parse().map_err(|e| format!("SECONDS: {e}"))?;
    let target_us = target_ms
        .parse::<f64>()
        .map_err(|e| format!("TARGET_MS: {e}"))?
        * 1000.0;
    let spec = LoadSpec {
        proto: Proto::Memcached,
        addr,
        rate_rps: rate,
        conns: 4,
        keys: 10_000,
        value_bytes: 100,
        set_every: 10,
        seed: 1,
    };
    preload(&spec)?;
    let load = Load::start(&spec, Instant::now() + Duration::from_millis(100), seconds)?;
    let (m, all) = load.finish(0);
    let mut p99: Vec<u64> = m.windows.iter().map(|w| w.p99_us).collect();
    let met = p99.iter().filter(|&&p| p as f64 <= target_us).count();
    if p99.is_empty() {
        return Err("no window was measured".into());
    }
    p99.sort_unstable();
    let q = |pct: usize| p99[(p99.len() * pct).div_ceil(100).saturating_sub(1)] as f64 / 1000.0;
    println!(
        "met {met}/{}  window p99 p50/p90/max {:.2}/{:.2}/{:.2} ms  all p99 {:.2} ms",
        p99.len(),
        q(50),
        q(90),
        q(100),
        all.p99_us as f64 / 1000.0
    );
    Ok(())
}
