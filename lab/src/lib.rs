//! cohabit's lab: policies judged on the simulator.
//!
//! Everything here runs on the simulated host and says so in what it prints.
//!
//! - [`simulate`]: one run of a policy on a scenario, and comparisons of several.
//! - [`oracle`]: the ground-truth search, the bound the real policies are held against.
//! - [`metrics`]: the comparison metrics of a run and their table.
//! - [`bench`]: `cohabit bench`, every scenario × policy on two platforms, with `ml`'s targets.
//! - [`rundir`]: the only code that lays out or reads a run directory.
//! - [`outdir`]: output directories and files, reached through no symbolic link another
//!   user owns.
//! - [`report`]: decision plots and the self-contained HTML report.
//! - [`commands`]: the lab's subcommands of `cohabit` (the CLI only parses and dispatches).

pub mod batch;
pub mod bench;
pub mod commands;
pub mod metrics;
pub mod oracle;
pub mod outdir;
pub mod report;
pub mod rundir;
pub mod simulate;

pub use simulate::LabPolicy;

/// Output format of the lab's commands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Aligned text for people.
    Table,
    /// JSON for programs.
    Json,
}

/// The first line of every table the lab prints.
pub const BANNER: &str =
    "SIMULATION: every figure below comes from cohabit's simulated host, not from hardware.";
