//! Reloading `ml`'s model when its file changes: a fleet rolls a retrained model out by
//! replacing the file (a Kubernetes ConfigMap update swaps the mounted files atomically).
//!
//! Every `model_check_every_ticks` ticks the watcher looks at the model's two files, the
//! metadata (`NAME.json`, the configured `model`) and the weights it names beside it. It
//! stats them (size, modification time, inode; a ConfigMap update changes the inode of the
//! files its symbolic links lead to); only when a stat changed does it read the metadata
//! and compare its sha256 digest, which covers the weights' digest that `Model::save`
//! records. A new version is loaded with [`Model::load`], the hardened loader (regular
//! files of bounded size, the build's feature schema, shapes, finiteness, the weights'
//! digest), and swapped into the running policy ([`Policy::replace_model`]).
//!
//! A version that does not load (not a model, another schema, weights half-written or not
//! matching the metadata) is logged with the loader's error and counted in
//! `cohabit_model_reload_failures_total`; the previous model keeps running. The same
//! version is not tried again; the next change to either file is. A model that failed at
//! start stops the start instead ([`Models::load`]): an operator who asked for `ml` must
//! not silently get something else.
//!
//! The GPU services' share model (`gpu_model`, schema `qos-gpu`) is loaded at start with the
//! same loader and the same rule, and kept for the policy's lifetime; it is not watched.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use anyhow::Context as _;
use cohabit_models::{Model, Schema, CPU_SCHEMA, GPU_SCHEMA};
use cohabit_policy::{BuildError, HostContext, MlConfig, Policy, PolicyKind};
use sha2::{Digest, Sha256};

use super::config::DaemonConfig;
use super::exporter::Exporter;

/// The models a policy is built with, loaded at start from the files the configuration
/// names: `ml`'s model (`model`) and its GPU services' share model (`gpu_model`, optional),
/// with `ml`'s tunables (`ml = { … }`). The other policies load none.
#[derive(Debug, Clone, Default)]
pub struct Models {
    /// The CPU model (schema `qos`).
    pub cpu: Option<Arc<Model>>,
    /// The GPU services' share model (schema `qos-gpu`).
    pub gpu: Option<Arc<Model>>,
    /// `ml`'s tunables.
    pub ml: MlConfig,
}

impl Models {
    /// Loads the models `cfg` names for `ml` with the hardened loader ([`Model::load_schema`]),
    /// each against its schema: a file that does not load, or that holds a model of another
    /// schema, is an error naming the file, and the start stops before the host is touched.
    /// Logs the GPU model in force, or its absence where GPU services are configured, and
    /// `ml`'s tunables moved from the defaults (a line each).
    pub fn load(cfg: &DaemonConfig) -> anyhow::Result<Self> {
        if cfg.policy != PolicyKind::Ml {
            return Ok(Self::default());
        }
        let load = |path: Option<&Path>, schema: &'static Schema, what: &str| {
            path.map(|p| {
                Model::load_schema(p, schema)
                    .map(Arc::new)
                    .with_context(|| format!("loading the {what} for policy ml"))
            })
            .transpose()
        };
        let models = Self {
            cpu: load(cfg.model.as_deref(), &CPU_SCHEMA, "model")?,
            gpu: load(
                cfg.gpu_model.as_deref(),
                &GPU_SCHEMA,
                "GPU model (gpu_model)",
            )?,
            ml: cfg.ml,
        };
        match (&models.gpu, &cfg.gpu_model) {
            (Some(m), Some(path)) => tracing::info!(
                path = %path.display(),
                schema = %format_args!("{}-v{}", m.schema().name, m.meta.schema_version),
                weights_digest = m.meta.weights_digest.as_deref().unwrap_or("none"),
                "GPU model in force for the GPU services' shares (online share model as fallback)"
            ),
            _ if cfg.services.iter().any(|s| s.gpu.is_some()) => tracing::info!(
                "no GPU model (gpu_model): GPU services' shares come from the online share model"
            ),
            _ => {}
        }
        let moved = cfg.ml.moved_from_default();
        if !moved.is_empty() {
            tracing::info!(
                tunables = %moved.join(", "),
                "ml tunables moved from the defaults"
            );
        }
        Ok(models)
    }

    /// Builds `kind` for `ctx` with these models and `ml`'s tunables
    /// ([`PolicyKind::build_with_gpu`]).
    pub fn build(&self, kind: PolicyKind, ctx: HostContext) -> Result<Box<dyn Policy>, BuildError> {
        kind.build_with_gpu(ctx, self.cpu.clone(), self.gpu.clone(), self.ml)
    }
}

/// Largest metadata file the watcher reads to digest it; a larger one is left to the
/// loader, which refuses it.
const MAX_METADATA_BYTES: u64 = 16 << 20;

/// What `stat` says of one file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    len: u64,
    modified: Option<SystemTime>,
    ino: u64,
    dev: u64,
}

impl Stamp {
    fn of(path: &Path) -> Option<Stamp> {
        let m = std::fs::metadata(path).ok()?;
        Some(Stamp {
            len: m.len(),
            modified: m.modified().ok(),
            ino: m.ino(),
            dev: m.dev(),
        })
    }
}

/// One version of the model's files, as the watcher saw them.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Version {
    meta: Option<Stamp>,
    weights: Option<Stamp>,
    /// sha256 of the metadata's bytes (`None`: unreadable or too large).
    digest: Option<[u8; 32]>,
}

/// What a check found.
#[derive(Debug, Clone)]
pub enum Reload {
    /// Not due, or the files are the version last seen.
    Unchanged,
    /// A new version loaded.
    Loaded(Arc<Model>),
    /// A new version that did not load: the loader's error.
    Failed(String),
}

/// Watches the model file of a running `ml` policy.
#[derive(Debug)]
pub struct ModelWatch {
    path: PathBuf,
    every: u32,
    ticks: u32,
    seen: Version,
    /// The last version that loaded, for a policy built again later (the pods changed).
    latest: Option<Arc<Model>>,
}

impl ModelWatch {
    /// Watches `path` (the metadata `.json`), checking every `every` ticks (at least 1).
    /// Call it *before* loading the model at start, so that a change between the two is
    /// caught at the first check.
    pub fn new(path: &Path, every: u32) -> Self {
        Self {
            path: path.to_path_buf(),
            every: every.max(1),
            ticks: 0,
            seen: version(path),
            latest: None,
        }
    }

    /// The last version that loaded since start (`None`: the one loaded at start is
    /// still the newest): a policy built again for new services takes it.
    pub fn latest(&self) -> Option<Arc<Model>> {
        self.latest.clone()
    }

    /// The model's metadata file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Counts a tick and checks the files when one is due.
    pub fn tick(&mut self) -> Reload {
        self.ticks += 1;
        if self.ticks < self.every {
            return Reload::Unchanged;
        }
        self.ticks = 0;
        self.check()
    }

    /// Checks the files now: loads them if they are a version not seen before.
    pub fn check(&mut self) -> Reload {
        let meta = Stamp::of(&self.path);
        let weights = weights_path(&self.path).and_then(|w| Stamp::of(&w));
        if meta == self.seen.meta && weights == self.seen.weights {
            return Reload::Unchanged;
        }
        let now = Version {
            meta,
            weights,
            digest: digest(&self.path),
        };
        let same_bytes = now.digest.is_some() && now.digest == self.seen.digest;
        let weights_same = now.weights == self.seen.weights;
        self.seen = now;
        if same_bytes && weights_same {
            // Touched, or the same bytes written again.
            return Reload::Unchanged;
        }
        match Model::load(&self.path) {
            Ok(m) => {
                let m = Arc::new(m);
                self.latest = Some(Arc::clone(&m));
                Reload::Loaded(m)
            }
            Err(e) => Reload::Failed(e.to_string()),
        }
    }

    /// A tick's check, and what follows from it: a new model is swapped into `policy`; a
    /// version that does not load is logged and counted, and `policy` keeps its model.
    /// Returns what the check found.
    pub fn tick_and_swap(&mut self, policy: &mut dyn Policy, exporter: &Mutex<Exporter>) -> Reload {
        let found = self.tick();
        match &found {
            Reload::Unchanged => {}
            Reload::Loaded(model) => {
                let taken = policy.replace_model(Arc::clone(model));
                if taken {
                    tracing::info!(
                        path = %self.path.display(),
                        weights_digest = model.meta.weights_digest.as_deref().unwrap_or("none"),
                        rows = model.meta.metrics.get("rows").copied().unwrap_or(0.0),
                        "a new version of the model was loaded and is in use"
                    );
                } else {
                    tracing::warn!(
                        policy = policy.name(),
                        "a new model loaded, but the policy uses none"
                    );
                }
                if let Ok(mut ex) = exporter.lock() {
                    ex.model_reload(taken);
                }
            }
            Reload::Failed(error) => {
                tracing::warn!(
                    path = %self.path.display(),
                    %error,
                    "a new version of the model file does not load; the previous model keeps running"
                );
                if let Ok(mut ex) = exporter.lock() {
                    ex.model_reload(false);
                }
            }
        }
        found
    }
}

/// The version of the files at `path` now.
fn version(path: &Path) -> Version {
    Version {
        meta: Stamp::of(path),
        weights: weights_path(path).and_then(|w| Stamp::of(&w)),
        digest: digest(path),
    }
}

/// The sha256 of the metadata's bytes, when it can be read and is not too large.
fn digest(path: &Path) -> Option<[u8; 32]> {
    let m = std::fs::metadata(path).ok()?;
    if !m.is_file() || m.len() > MAX_METADATA_BYTES {
        return None;
    }
    let bytes = std::fs::read(path).ok()?;
    Some(Sha256::digest(&bytes).into())
}

/// The weights file the metadata names, beside it (a bare file name only, as the loader
/// requires).
fn weights_path(meta: &Path) -> Option<PathBuf> {
    #[derive(serde::Deserialize)]
    struct Names {
        weights: String,
    }
    let m = std::fs::metadata(meta).ok()?;
    if !m.is_file() || m.len() > MAX_METADATA_BYTES {
        return None;
    }
    let names: Names = serde_json::from_slice(&std::fs::read(meta).ok()?).ok()?;
    let name = Path::new(&names.weights);
    let bare = name.components().count() == 1 && name.file_name().is_some();
    bare.then(|| meta.parent().unwrap_or(Path::new(".")).join(name))
}

#[cfg(test)]
mod tests {
    use cohabit_core::Observation;
    use cohabit_policy::{Decision, HostContext, MlConfig, MlPolicy, StaticPolicy};

    use super::*;

    /// Keeps the weights digest of the model it was last given.
    struct Recorder {
        inner: StaticPolicy,
        model: Option<String>,
    }

    impl Policy for Recorder {
        fn name(&self) -> &'static str {
            "recorder"
        }
        fn initial(&mut self) -> Decision {
            self.inner.initial()
        }
        fn decide(&mut self, obs: &Observation, now_ms: u64) -> Decision {
            self.inner.decide(obs, now_ms)
        }
        fn replace_model(&mut self, model: Arc<Model>) -> bool {
            self.model = model.meta.weights_digest.clone();
            true
        }
    }

    fn ctx() -> HostContext {
        HostContext {
            host: cohabit_core::HostCapacity {
                name: "t".into(),
                cores: 4,
                freq_ghz: 2.0,
                llc_ways: 1,
                llc_way_bytes: 1 << 20,
                mem_bw_bytes_per_s: 1e10,
                gpus: vec![],
                closids: 4,
                mba_min_pct: 10,
                mba_gran_pct: 10,
                min_cbm_bits: 1,
                shareable_bits: 0,
            },
            specs: vec![],
        }
    }

    fn counters(ex: &Mutex<Exporter>) -> (f64, f64) {
        let text = ex.lock().unwrap().render();
        let get = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(&format!("{name} ")))
                .and_then(|v| v.trim().parse::<f64>().ok())
                .unwrap_or_else(|| panic!("no {name} in:\n{text}"))
        };
        (
            get("cohabit_model_reloads_total"),
            get("cohabit_model_reload_failures_total"),
        )
    }

    /// Saves a model with `seed`'s weights; returns its weights digest.
    fn save(dir: &Path, seed: u64) -> String {
        let m = Model::synthetic(2, &[4], seed);
        let path = m.save(dir, "qos").unwrap();
        Model::load(&path).unwrap().meta.weights_digest.unwrap()
    }

    #[test]
    fn a_good_model_is_swapped_in_and_a_bad_one_leaves_the_previous_running() {
        let dir = tempfile::tempdir().unwrap();
        let first = save(dir.path(), 1);
        let path = dir.path().join("qos.json");
        let mut watch = ModelWatch::new(&path, 3);
        let mut policy = Recorder {
            inner: StaticPolicy::new(ctx()),
            model: Some(first.clone()),
        };
        let ex = Mutex::new(Exporter::default());
        let tick = |watch: &mut ModelWatch, policy: &mut Recorder| {
            (0..3)
                .map(|_| watch.tick_and_swap(policy, &ex))
                .filter(|r| !matches!(r, Reload::Unchanged))
                .collect::<Vec<_>>()
        };
        assert!(tick(&mut watch, &mut policy).is_empty(), "nothing changed");

        // A retrained model: swapped in at the next check, not before.
        let second = save(dir.path(), 2);
        assert_ne!(first, second);
        assert!(matches!(
            watch.tick_and_swap(&mut policy, &ex),
            Reload::Unchanged
        ));
        assert!(matches!(
            watch.tick_and_swap(&mut policy, &ex),
            Reload::Unchanged
        ));
        assert!(matches!(
            watch.tick_and_swap(&mut policy, &ex),
            Reload::Loaded(_)
        ));
        assert_eq!(policy.model.as_deref(), Some(second.as_str()));
        assert_eq!(counters(&ex), (1.0, 0.0));
        let latest = watch
            .latest()
            .expect("the reloaded model is kept for rebuilt policies");

        // Not a model: the loader's error, counted; the second model stays.
        std::fs::write(&path, "{\"format\": \"something else\"}").unwrap();
        let found = tick(&mut watch, &mut policy);
        assert!(
            matches!(&found[..], [Reload::Failed(e)] if e.contains("qos.json")),
            "{found:?}"
        );
        assert_eq!(policy.model.as_deref(), Some(second.as_str()));
        assert_eq!(counters(&ex), (1.0, 1.0));
        assert!(
            watch.latest().is_some_and(|m| Arc::ptr_eq(&m, &latest)),
            "a version that failed does not replace the last good one"
        );
        // The same bad version is not retried.
        assert!(tick(&mut watch, &mut policy).is_empty());
        assert_eq!(counters(&ex), (1.0, 1.0));

        // Half-written: new metadata whose weights are cut short.
        let third = save(dir.path(), 3);
        let weights = dir.path().join("qos.safetensors");
        let bytes = std::fs::read(&weights).unwrap();
        std::fs::write(&weights, &bytes[..bytes.len() / 2]).unwrap();
        let found = tick(&mut watch, &mut policy);
        assert!(matches!(&found[..], [Reload::Failed(_)]), "{found:?}");
        assert_eq!(policy.model.as_deref(), Some(second.as_str()));
        // … until the writer finishes.
        std::fs::write(&weights, &bytes).unwrap();
        let found = tick(&mut watch, &mut policy);
        assert!(matches!(&found[..], [Reload::Loaded(_)]), "{found:?}");
        assert_eq!(policy.model.as_deref(), Some(third.as_str()));

        // Another schema: the loader refuses it.
        let mut other = Model::synthetic(2, &[4], 4);
        other.meta.schema_version += 1;
        other.save(dir.path(), "qos").unwrap();
        let found = tick(&mut watch, &mut policy);
        assert!(
            matches!(&found[..], [Reload::Failed(e)] if e.contains("schema")),
            "{found:?}"
        );
        assert_eq!(policy.model.as_deref(), Some(third.as_str()));
        // Gone: the running model stays, and nothing loads.
        std::fs::remove_file(&path).unwrap();
        let found = tick(&mut watch, &mut policy);
        assert!(matches!(&found[..], [Reload::Failed(_)]), "{found:?}");
        assert_eq!(policy.model.as_deref(), Some(third.as_str()));
        assert_eq!(counters(&ex), (2.0, 4.0));
    }

    /// A configuration of `policy` with `model` and `gpu_model` lines (`None`: none).
    fn config(policy: &str, model: Option<&Path>, gpu_model: Option<&Path>) -> DaemonConfig {
        let line = |key: &str, p: Option<&Path>| {
            p.map_or_else(String::new, |p| format!("{key} = \"{}\"\n", p.display()))
        };
        let text = format!(
            "policy = \"{policy}\"\n{}{}[[service]]\nname = \"kv\"\np99_target_ms = 1\nmatch = {{ process_name = \"kv\" }}\nlatency = {{ push = \"127.0.0.1:9400\", unauthenticated = true }}\n",
            line("model", model),
            line("gpu_model", gpu_model)
        );
        DaemonConfig::parse(&text, "t.toml").unwrap()
    }

    #[test]
    fn ml_loads_its_gpu_model_beside_its_model_and_other_policies_load_none() {
        let dir = tempfile::tempdir().unwrap();
        let cpu = Model::synthetic(1, &[], 0).save(dir.path(), "qos").unwrap();
        let gpu = Model::synthetic_schema(&GPU_SCHEMA, 2, &[4], 1)
            .save(dir.path(), "qos-gpu")
            .unwrap();
        let models = Models::load(&config("ml", Some(&cpu), Some(&gpu))).unwrap();
        assert_eq!(models.cpu.as_ref().unwrap().schema(), &CPU_SCHEMA);
        let g = models.gpu.as_ref().expect("the GPU model is loaded");
        assert_eq!(g.schema(), &GPU_SCHEMA);
        assert_eq!(g.ensemble.members.len(), 2);
        let mut policy = models.build(PolicyKind::Ml, ctx()).unwrap();
        assert_eq!(policy.name(), "ml");
        assert!(policy.replace_model(Arc::clone(models.cpu.as_ref().unwrap())));

        // Without gpu_model: the CPU model only.
        let models = Models::load(&config("ml", Some(&cpu), None)).unwrap();
        assert!(models.cpu.is_some() && models.gpu.is_none());
        assert_eq!(models.ml, MlConfig::default());
        // ml's tunables come with its models.
        let mut tuned = config("ml", Some(&cpu), None);
        tuned.ml.margin = 0.95;
        assert_eq!(Models::load(&tuned).unwrap().ml.margin, 0.95);

        // The GPU model where the CPU one belongs is refused too, naming the file.
        let e = Models::load(&config("ml", Some(&gpu), None)).unwrap_err();
        let msg = format!("{e:#}");
        assert!(
            msg.contains("loading the model for policy ml") && msg.contains("qos-gpu.json"),
            "{msg}"
        );

        // Other policies load nothing, not even a file that is missing.
        let missing = dir.path().join("missing.json");
        let models = Models::load(&config("parties", Some(&missing), Some(&missing))).unwrap();
        assert!(models.cpu.is_none() && models.gpu.is_none());
        assert_eq!(
            models.build(PolicyKind::Parties, ctx()).unwrap().name(),
            "parties"
        );
    }

    #[test]
    fn the_ml_policy_takes_a_new_model_and_others_do_not() {
        let model = Arc::new(Model::synthetic(2, &[4], 1));
        let mut ml = MlPolicy::new(ctx(), Arc::clone(&model), MlConfig::default());
        assert!(ml.replace_model(Arc::new(Model::synthetic(2, &[4], 2))));
        let mut st = StaticPolicy::new(ctx());
        assert!(!st.replace_model(model));
    }
}
