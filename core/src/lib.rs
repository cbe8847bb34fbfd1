//! cohabit's shared vocabulary.
//!
//! Everything the simulator, the real-host daemon, the policies and (later) training agree
//! on: what a host offers ([`HostCapacity`]), what runs on it ([`ServiceSpec`]), how a share
//! of it is described ([`Allocation`], [`Plan`]), what is measured ([`Sample`],
//! [`Observation`]) and what is written down each tick ([`DecisionRecord`]).
//!
//! This crate does no I/O and reads no clock: time is always passed in explicitly.

mod alloc;
mod error;
mod host;
mod plan;
mod record;
mod sample;
mod service;

pub use alloc::{Allocation, Resource, WayRange, MBA_MAX_PCT};
pub use error::CoreError;
pub use host::{GpuCapacity, HostCapacity};
pub use plan::{Change, Plan, BEST_EFFORT_GROUP};
pub use record::{DecisionRecord, GroundTruth, Prediction, DECISION_SCHEMA_VERSION};
pub use sample::{Observation, Sample, ServiceObservation};
pub use service::{ServiceClass, ServiceSpec};
