//! cohabit's shared vocabulary.
//!
//! Everything the simulator, the real-host daemon, the policies and training agree
//! on: what a host offers ([`HostCapacity`]), what runs on it ([`ServiceSpec`]), how a share
//! of it is described ([`Allocation`], [`Plan`]), what is measured ([`Sample`],
//! [`Observation`]), what is written down each tick ([`DecisionRecord`]) and how those
//! records are stored ([`log`]: the decision log's one reader and writer).
//!
//! This crate opens no files and reads no clock: the log codec works over any
//! `std::io::Write` / `BufRead` it is given, and time is always passed in explicitly.

mod alloc;
mod error;
mod host;
pub mod log;
pub mod name;
pub mod num;
mod plan;
mod record;
mod sample;
mod service;
pub mod window;

pub use alloc::{Allocation, Resource, WayRange, MBA_MAX_PCT};
pub use error::CoreError;
pub use host::{GpuCapacity, HostCapacity, ShareChange, DEFAULT_CLOSIDS};
pub use log::{
    DecisionLogReader, DecisionLogWriter, LogError, LogHeader, LogSegment, DECISION_LOG_VERSION,
};
pub use num::whole;
pub use plan::{Change, Plan, ResctrlClass, BEST_EFFORT_GROUP};
pub use record::{
    ApplyOutcome, Control, DecisionPath, DecisionRecord, Estimate, GroundTruth, GroupControl,
    PosteriorEstimate, Prediction, Reason, DECISION_SCHEMA_VERSION,
};
pub use sample::{Observation, Sample, ServiceObservation};
pub use service::{ServiceClass, ServiceSpec};
pub use window::RunsUnder;

/// Where telemetry comes from: the simulator, or a real host's collectors.
///
/// `collect` returns the telemetry of the interval since the previous call, together with
/// the allocation that was in force during it. A real host waits for wall-clock time to
/// pass between calls; the simulator advances its clock by one tick on each call.
pub trait Collector {
    /// Why a collection failed as a whole (single missing readings are `None` fields).
    type Error: std::error::Error + Send + Sync + 'static;
    /// Telemetry of the interval that just ended.
    fn collect(&mut self) -> Result<Observation, Self::Error>;

    /// True for the simulator; copied into every decision record.
    fn simulated(&self) -> bool {
        false
    }

    /// The truth of the interval last collected, where the host knows it (the simulator).
    fn ground_truth(&self) -> Option<GroundTruth> {
        None
    }
}

/// Where plans are applied: the simulator, or a real host's resctrl/cgroup/MPS actuators.
pub trait Actuator {
    /// Why applying failed; the host keeps its last good state.
    type Error: std::error::Error + Send + Sync + 'static;
    /// Applies `plan`. `changes` is the difference from the plan now in force, so an
    /// actuator can write only what changed.
    fn apply(&mut self, plan: &Plan, changes: &[Change]) -> Result<(), Self::Error>;
}
