//! Offline training of cohabit's QoS-impact model (the `cohabit-train` command).
//!
//! - [`gen`]: datasets from the simulator ([`drawn`]: the hosts and services it draws from); [`gen_gpu`]: GPU-model datasets from it; [`logs`]: datasets from decision logs;
//!   [`dataset`]: rows on disk (JSON Lines); [`columnar`]: decision logs as Parquet.
//! - [`fit`]: the tch MLP ensemble (with warm start) and the linfa ridge baseline.
//! - [`eval`]: in-distribution, per-service and leave-one-service-out errors, calibration.
//! - [`fold`]: a fleet's per-host posteriors folded back into the model's output layer.
//!
//! Only this crate links libtorch (set `LIBTORCH`; `scripts/setup-libtorch.sh` makes one);
//! the daemon scores with `cohabit-models` alone.

pub mod columnar;
pub mod dataset;
pub mod drawn;
pub mod eval;
pub mod fit;
pub mod fold;
pub mod gen;
pub mod gen_gpu;
pub mod logs;
mod scene;
