//! Prints the simulator's interference-sensitivity table beside published measurements
//! (`cohabit_sim::sensitivity`): `cargo run -p cohabit-sim --example sensitivity [PRESET]`.

use cohabit_sim::catalogue::Platform;
use cohabit_sim::sensitivity;

fn main() {
    let preset = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "xeon-e5-2697v4".into());
    let Some(platform) = Platform::by_name(&preset) else {
        let known: Vec<&str> = Platform::ALL.iter().map(|(n, _)| *n).collect();
        eprintln!("unknown platform {preset:?}; known: {}", known.join(", "));
        std::process::exit(2);
    };
    println!("platform {preset}");
    print!("{}", sensitivity::render(&sensitivity::table(platform)));
    println!();
    println!("SIMULATION: CFS on a 2-CPU host, memcached (target 0.6 ms) at half a CPU's capacity");
    for (layout, p99, job) in sensitivity::shared_cpu_layouts() {
        println!("{layout:<52} p99 {p99:>6.2} ms   batch job {job:.2} CPUs");
    }
}
