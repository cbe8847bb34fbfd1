//! cohabit's learned QoS-impact model, inference side.
//!
//! - [`mod@features`]: the versioned feature schema (what a real host can measure under the
//!   current allocation, plus a candidate allocation).
//! - [`mod@gpu_features`]: the GPU schema (a GPU service's MPS share in force and candidate, its
//!   co-runners on the GPU), a schema of its own with its own artifacts.
//! - [`schema`]: what the two schemas have in common (names, candidate columns, presence
//!   flags) and the rule both follow for absent and implausible readings.
//! - [`mlp`]: pure-Rust inference of an MLP ensemble with ndarray; the spread of the
//!   members is the uncertainty.
//! - [`artifact`]: the model artifact (safetensors weights + JSON metadata), checked on load.
//! - [`posterior`]: a per-host posterior on the output layer (Bayesian linear regression on
//!   the last hidden layer), and the fold of a fleet's posteriors back into the model.
//!
//! Training (tch, linfa) lives in a separate crate so the daemon never links libtorch.

pub mod artifact;
pub mod builtin;
pub mod features;
pub mod gpu_features;
pub mod mlp;
pub mod posterior;
pub mod schema;

pub use artifact::{LoadRules, LoadedFiles, Model, ModelError, ModelMetadata};
pub use builtin::{builtin, builtin_gpu, builtin_platforms};
pub use features::{
    features, log_qos_ratio, present, target, Neighbours, FEATURE_NAMES, FEATURE_SCHEMA_VERSION,
    LOG_QOS_CLIP, N_FEATURES, PRESENCE_FLAGS,
};
pub use gpu_features::{
    gpu_features, gpu_present, GpuCoRunners, GpuReadings, GPU_FEATURE_NAMES,
    GPU_FEATURE_SCHEMA_VERSION, GPU_SCHEMA_NAME, N_GPU_FEATURES,
};
pub use schema::{Schema, CPU_SCHEMA, GPU_SCHEMA};
