//! cohabit's controller: policies, the control loop, run metrics and the `cohabit` CLI.
//!
//! - [`policy`]: the `Policy` trait and the `static`, `parties`, `ml` and `oracle` policies.
//! - [`bench`]: `cohabit bench`, every scenario × policy on two platforms, with `ml`'s targets.
//! - [`control`]: the loop that collects, decides, applies and records.
//! - [`metrics`]: the comparison metrics of a run.
//! - [`simulate`]: running and comparing policies on simulated scenarios.
//! - [`daemon`]: `cohabit run` on a real host, and `cohabit probe`.
//! - [`cli`]: the `cohabit` command.

pub mod bench;
pub mod cli;
pub mod control;
pub mod daemon;
pub mod metrics;
pub mod policy;
pub mod report;
pub mod simulate;
