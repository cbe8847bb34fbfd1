//! Models compiled into the binary, one per simulated platform, so `cohabit` needs no
//! files beside it, and the GPU model ([`builtin_gpu`]) for the platforms with a GPU. Real
//! hosts load a model file (the top-level `model = "..."` key of the daemon's config).

use std::path::Path;

use crate::{Model, ModelError, GPU_SCHEMA};

/// (platform preset, metadata, weights, where they came from)
const BUILTIN: &[(&str, &str, &[u8], &str)] = &[
    (
        "xeon-e5-2697v4",
        include_str!("../default/qos-v1.json"),
        include_bytes!("../default/qos-v1.safetensors"),
        "models/default/qos-v1.json",
    ),
    (
        "xeon-gold-6338",
        include_str!("../xeon-gold-6338/qos-v1-gold.json"),
        include_bytes!("../xeon-gold-6338/qos-v1-gold.safetensors"),
        "models/xeon-gold-6338/qos-v1-gold.json",
    ),
];

/// The built-in model for a platform preset (`xeon-e5-2697v4-a100` uses its CPU's model),
/// `None` when there is none.
pub fn builtin(platform: &str) -> Option<Result<Model, ModelError>> {
    let cpu = platform.strip_suffix("-a100").unwrap_or(platform);
    BUILTIN
        .iter()
        .find(|(p, ..)| *p == cpu)
        .map(|(_, meta, weights, origin)| Model::from_bytes(meta, weights, Path::new(origin)))
}

/// The built-in GPU model (schema `qos-gpu`, trained on the simulated A100 behind MPS) for
/// a platform preset with that GPU (`…-a100`), `None` for the others.
pub fn builtin_gpu(platform: &str) -> Option<Result<Model, ModelError>> {
    platform.ends_with("-a100").then(|| {
        Model::from_bytes_schema(
            include_str!("../gpu/qos-gpu-v1.json"),
            include_bytes!("../gpu/qos-gpu-v1.safetensors"),
            Path::new("models/gpu/qos-gpu-v1.json"),
            &GPU_SCHEMA,
        )
    })
}

/// Platform presets that have a built-in model.
pub fn builtin_platforms() -> impl Iterator<Item = &'static str> {
    BUILTIN.iter().map(|(p, ..)| *p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_builtin_model_loads_and_the_gpu_platform_shares_its_cpus_model() {
        for p in builtin_platforms() {
            let m = builtin(p).unwrap().unwrap();
            assert!(m.meta.members > 0, "{p}");
        }
        assert!(builtin("xeon-e5-2697v4-a100").is_some());
        assert!(builtin("no-such-platform").is_none());
    }

    #[test]
    fn the_gpu_platform_has_a_gpu_model_with_its_figures_and_the_others_none() {
        let m = builtin_gpu("xeon-e5-2697v4-a100").unwrap().unwrap();
        assert_eq!(m.schema(), &GPU_SCHEMA);
        for k in [
            "rows",
            "in_distribution_median_abs_error",
            "held_out_median_abs_error",
        ] {
            assert!(m.meta.metrics.contains_key(k), "{k}");
        }
        assert!(m.meta.metrics["in_distribution_median_abs_error"] < 0.2);
        assert!(m.meta.change_sigma_scale.is_some());
        assert!(builtin_gpu("xeon-e5-2697v4").is_none());
        assert!(builtin_gpu("xeon-gold-6338").is_none());
    }
}
