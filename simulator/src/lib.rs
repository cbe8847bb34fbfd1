//! A simulated co-located host for cohabit.
//!
//! The simulator is cohabit's embedded default: it runs the whole control loop on any
//! machine, generates training data, and lets policies be compared against each other and
//! against an oracle. Everything it reports is simulated and says so.
//!
//! - [`physics`]: the closed-form pieces (miss-ratio curves, CPI, the kernel path's
//!   exposure to LLC churn, memory queueing, MBA, CFS on shared CPUs, Erlang-C tail
//!   latency, GPU share scaling).
//! - [`world`]: one interval of the whole host (the fixed point between demand and CPI).
//! - [`catalogue`]: platforms and calibrated services; [`params`]: the rows they are built
//!   from, which a scenario may change.
//! - [`trace`]: load over time; [`scenario`]: TOML scenarios and the built-in ones.
//! - [`host`]: the simulated host behind the controller's collector and actuator traits.
//! - [`sensitivity`]: each service beside memory-bandwidth, cache and CPU antagonists,
//!   compared with published interference measurements.

pub mod catalogue;
pub mod host;
pub mod params;
pub mod physics;
pub mod scenario;
pub mod sensitivity;
pub mod trace;
pub mod world;

pub use cohabit_core::whole;

pub use host::{SimulatedHost, TruthModel};
pub use scenario::Scenario;

/// Why a scenario could not be loaded or a plan could not be applied.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The scenario is invalid; the message names the file and the field.
    #[error("{0}")]
    Scenario(String),
    /// The scenario is not valid TOML or has unknown or mistyped keys.
    #[error("{origin}: {message}")]
    Toml {
        /// File or built-in name.
        origin: String,
        /// The parser's message, with line and column.
        message: String,
    },
    /// A file could not be read.
    #[error("{what} {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// What was being done.
        what: &'static str,
        /// The OS error.
        source: std::io::Error,
    },
    /// Neither a built-in scenario nor an existing file.
    #[error("unknown scenario {name:?}: not a built-in one ({builtin}) and no such file")]
    UnknownScenario {
        /// What was asked for.
        name: String,
        /// The built-in names.
        builtin: String,
    },
    /// The plan does not fit the simulated host; nothing was changed.
    #[error("plan rejected: {0}")]
    Rejected(#[from] cohabit_core::CoreError),
    /// The plan needs more resctrl groups than the host has CLOSIDs: the kernel refuses
    /// the first group too many (`mkdir` fails with `ENOSPC`, `info/last_cmd_status` says
    /// out of CLOSIDs). Nothing was changed.
    #[error(
        "plan rejected by resctrl: mkdir failed with ENOSPC (out of CLOSIDs): the plan needs \
         {needed} groups and the host has {closids} CLOSIDs, {available} besides the default group",
        available = closids.saturating_sub(1)
    )]
    OutOfClosids {
        /// Resctrl groups the plan needs ([`cohabit_core::Plan::resctrl_groups`]).
        needed: usize,
        /// CLOSIDs of the host, the default group's included.
        closids: u32,
    },
}
