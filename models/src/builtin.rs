//! Models compiled into the binary, one per simulated platform, so `cohabit` needs no
//! files beside it. Real hosts load a model file (`[model] path` in the daemon's config).

use std::path::Path;

use crate::{Model, ModelError};

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
}
