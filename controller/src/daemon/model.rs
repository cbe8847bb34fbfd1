//! Reloading `ml`'s model when its file changes: a fleet rolls a retrained model out by
//! replacing the file (a Kubernetes ConfigMap update swaps the mounted files atomically).
//!
//! Every `model_check_every_ticks` ticks the tick asks the watcher's loader thread for a
//! check, and takes what an earlier check found: no file is opened, read or parsed inside
//! the tick, so a slow or hostile file cannot stall control (2026-12b review, N7). The
//! loader stats the model's two files, the metadata (`NAME.json`, the configured `model`)
//! and the weights it names beside it (size, modification time, inode; a ConfigMap update
//! changes the inode of the files its symbolic links lead to); only when a stat changed
//! does it load them, with [`Model::load_files`] under the daemon's [`LoadRules`] (regular
//! files opened without blocking and checked on the descriptor, owned by root or the
//! daemon's user and writable by nobody else, of bounded size, the build's feature schema,
//! shapes, finiteness, a `weights_digest` that matches). Metadata whose bytes are those of
//! the model in force, beside the same weights, is not a new version. A new version is
//! handed to the tick, which swaps it into the running policy ([`Policy::replace_model`]).
//! One check at a time: while one runs, the ticks due meanwhile ask for nothing more.
//!
//! A version that does not load (not a model, another schema, weights half-written or not
//! matching the metadata, a FIFO, a file others can write) is logged with the loader's
//! error and counted in `cohabit_model_reload_failures_total`; the previous model keeps
//! running. The same version is not tried again; the next change to either file is. A model
//! that failed at start stops the start instead ([`Models::load`]): an operator who asked
//! for `ml` must not silently get something else.
//!
//! The GPU services' share model (`gpu_model`, schema `qos-gpu`) is loaded at start with the
//! same loader and the same rule, and kept for the policy's lifetime; it is not watched.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver, SyncSender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use anyhow::Context as _;
use cohabit_models::artifact::{read_model_file, MAX_METADATA_BYTES};
use cohabit_models::{LoadRules, Model, Schema, CPU_SCHEMA, GPU_SCHEMA};
use cohabit_policy::{BuildError, HostContext, MlConfig, Policy, PolicyKind};

use super::config::DaemonConfig;
use super::exporter::Exporter;

/// The rules the daemon loads its models under: files of root or of the user it runs as,
/// writable by nobody else, with a weights digest ([`LoadRules::daemon`]).
pub fn daemon_rules() -> LoadRules {
    LoadRules::daemon(cohabit_host::files::euid())
}

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
    /// Loads the models `cfg` names for `ml` with the hardened loader under the daemon's
    /// rules ([`daemon_rules`]), each against its schema: a file that does not load, or
    /// that holds a model of another schema, is an error naming the file, and the start
    /// stops before the host is touched. Logs the GPU model in force, or its absence where
    /// GPU services are configured, and `ml`'s tunables moved from the defaults (a line each).
    pub fn load(cfg: &DaemonConfig) -> anyhow::Result<Self> {
        if cfg.policy != PolicyKind::Ml {
            return Ok(Self::default());
        }
        let rules = daemon_rules();
        let load = |path: Option<&Path>, schema: &'static Schema, what: &str| {
            path.map(|p| {
                Model::load_files(p, schema, &rules)
                    .map(|l| Arc::new(l.model))
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

/// What `stat` says of one file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    len: u64,
    modified: Option<SystemTime>,
    ino: u64,
    dev: u64,
}

impl Stamp {
    /// `stat(2)` only: it never opens the file, so a FIFO at the path does not block it.
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

/// One version of the model's files, as the loader saw them.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Version {
    meta: Option<Stamp>,
    weights: Option<Stamp>,
    /// `sha256:` of the metadata in force (`None`: not known).
    digest: Option<String>,
}

/// What a check found.
#[derive(Debug, Clone)]
pub enum Reload {
    /// Not due, no check finished, or the files are the version last seen.
    Unchanged,
    /// A new version loaded.
    Loaded(Arc<Model>),
    /// A new version that did not load: the loader's error.
    Failed(String),
}

/// The loader's side of the watcher: checks the files and loads a new version. It blocks
/// on file I/O, so it runs on the watcher's thread, never in a tick.
#[derive(Debug)]
struct Checker {
    path: PathBuf,
    rules: LoadRules,
    /// The weights file the metadata in force names.
    weights: Option<PathBuf>,
    seen: Version,
}

impl Checker {
    /// Notes the files' version now (the metadata read once, under `rules`, for its digest
    /// and the weights' name).
    fn new(path: &Path, rules: LoadRules) -> Self {
        let (digest, weights) = peek(path, &rules);
        let seen = Version {
            meta: Stamp::of(path),
            weights: weights.as_deref().and_then(Stamp::of),
            digest,
        };
        Self {
            path: path.to_path_buf(),
            rules,
            weights,
            seen,
        }
    }

    /// Checks the files now: loads them if they are a version not seen before.
    fn check(&mut self) -> Reload {
        let meta = Stamp::of(&self.path);
        let weights = self.weights.as_deref().and_then(Stamp::of);
        if meta == self.seen.meta && weights == self.seen.weights {
            return Reload::Unchanged;
        }
        match Model::load_files(&self.path, &CPU_SCHEMA, &self.rules) {
            Ok(l) => {
                let weights_now = Stamp::of(&l.weights_path);
                let same = self.seen.digest.as_deref() == Some(l.meta_digest.as_str())
                    && self.weights.as_deref() == Some(l.weights_path.as_path())
                    && weights_now == self.seen.weights;
                self.seen = Version {
                    meta,
                    weights: weights_now,
                    digest: Some(l.meta_digest),
                };
                self.weights = Some(l.weights_path);
                if same {
                    // Touched, or the same bytes written again.
                    return Reload::Unchanged;
                }
                Reload::Loaded(Arc::new(l.model))
            }
            Err(e) => {
                self.seen.meta = meta;
                self.seen.weights = weights;
                Reload::Failed(e.to_string())
            }
        }
    }
}

/// The metadata's digest and the weights file it names (a bare file name beside it, as the
/// loader requires), read once under `rules`; `None`s when it cannot be read.
fn peek(meta: &Path, rules: &LoadRules) -> (Option<String>, Option<PathBuf>) {
    #[derive(serde::Deserialize)]
    struct Names {
        weights: String,
    }
    let Ok(bytes) = read_model_file(meta, MAX_METADATA_BYTES, rules) else {
        return (None, None);
    };
    let digest = cohabit_models::artifact::digest(&bytes);
    let weights = serde_json::from_slice::<Names>(&bytes).ok().and_then(|n| {
        let name = Path::new(&n.weights);
        let bare = name.components().count() == 1 && name.file_name().is_some();
        bare.then(|| meta.parent().unwrap_or(Path::new(".")).join(name))
    });
    (Some(digest), weights)
}

/// Watches the model file of a running `ml` policy; the files are checked and loaded on a
/// thread of its own (see the module doc).
#[derive(Debug)]
pub struct ModelWatch {
    path: PathBuf,
    every: u32,
    ticks: u32,
    /// The last version that loaded, for a policy built again later (the pods changed).
    latest: Option<Arc<Model>>,
    /// Asks the loader for a check; full while one waits.
    ask: SyncSender<()>,
    /// What the loader's checks found.
    found: Receiver<Reload>,
}

impl ModelWatch {
    /// Watches `path` (the metadata `.json`), checking every `every` ticks (at least 1),
    /// under the daemon's rules. Call it *before* loading the model at start, so that a
    /// change between the two is caught at the first check. Starts the loader's thread.
    pub fn new(path: &Path, every: u32) -> std::io::Result<Self> {
        Self::with_rules(path, every, daemon_rules())
    }

    /// [`Self::new`] under `rules`.
    pub fn with_rules(path: &Path, every: u32, rules: LoadRules) -> std::io::Result<Self> {
        let mut checker = Checker::new(path, rules);
        let (ask, asked) = mpsc::sync_channel::<()>(1);
        let (tell, found) = mpsc::channel();
        std::thread::Builder::new()
            .name("cohabit-model".into())
            .spawn(move || {
                // Ends when the watch is dropped.
                for () in asked {
                    if tell.send(checker.check()).is_err() {
                        break;
                    }
                }
            })?;
        Ok(Self {
            path: path.to_path_buf(),
            every: every.max(1),
            ticks: 0,
            latest: None,
            ask,
            found,
        })
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

    /// Counts a tick, takes what a finished check found, and asks for a check when one is
    /// due. Never blocks.
    pub fn tick(&mut self) -> Reload {
        let found = match self.found.try_recv() {
            Ok(r) => r,
            Err(TryRecvError::Empty | TryRecvError::Disconnected) => Reload::Unchanged,
        };
        self.take(&found);
        self.ticks += 1;
        if self.ticks >= self.every {
            self.ticks = 0;
            // Full: a check is still waiting to run; this one would find the same.
            let _ = self.ask.try_send(());
        }
        found
    }

    fn take(&mut self, found: &Reload) {
        if let Reload::Loaded(m) = found {
            self.latest = Some(Arc::clone(m));
        }
    }

    /// A tick's check, and what follows from it: a new model is swapped into `policy`; a
    /// version that does not load is logged and counted, and `policy` keeps its model.
    /// Returns what the check found.
    pub fn tick_and_swap(&mut self, policy: &mut dyn Policy, exporter: &Mutex<Exporter>) -> Reload {
        let found = self.tick();
        self.swap(&found, policy, exporter);
        found
    }

    fn swap(&self, found: &Reload, policy: &mut dyn Policy, exporter: &Mutex<Exporter>) {
        match found {
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
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

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

    /// Runs `f` on a thread and waits at most `limit` for it: a check that blocks (a FIFO
    /// opened for reading waits for a writer) fails the test instead of hanging it.
    fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        rx.recv_timeout(limit)
            .unwrap_or_else(|_| panic!("still blocked after {limit:?}"))
    }

    /// Ticks `watch` every 10 ms until a check finds something (at most `limit`); returns
    /// it, or `Unchanged` when nothing came.
    fn settle(
        watch: &mut ModelWatch,
        policy: &mut dyn Policy,
        ex: &Mutex<Exporter>,
        limit: Duration,
    ) -> Reload {
        let t = std::time::Instant::now();
        while t.elapsed() < limit {
            let found = watch.tick_and_swap(policy, ex);
            if !matches!(found, Reload::Unchanged) {
                return found;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Reload::Unchanged
    }

    #[test]
    fn a_new_version_is_found_once_and_a_bad_one_is_not_retried() {
        let dir = tempfile::tempdir().unwrap();
        let first = save(dir.path(), 1);
        let path = dir.path().join("qos.json");
        let mut c = Checker::new(&path, daemon_rules());
        assert!(matches!(c.check(), Reload::Unchanged), "nothing changed");
        // Touched, or the same bytes written again: not a new version.
        let same = std::fs::read(&path).unwrap();
        std::fs::write(&path, &same).unwrap();
        assert!(matches!(c.check(), Reload::Unchanged));

        // A retrained model.
        let second = save(dir.path(), 2);
        assert_ne!(first, second);
        let Reload::Loaded(m) = c.check() else {
            panic!("the new version was not loaded");
        };
        assert_eq!(m.meta.weights_digest.as_deref(), Some(second.as_str()));
        assert!(matches!(c.check(), Reload::Unchanged), "found once");

        // Not a model: the loader's error, once.
        std::fs::write(&path, "{\"format\": \"something else\"}").unwrap();
        assert!(matches!(c.check(), Reload::Failed(e) if e.contains("qos.json")));
        assert!(matches!(c.check(), Reload::Unchanged), "not retried");

        // Half-written: new metadata whose weights are cut short, until the writer finishes.
        let third = save(dir.path(), 3);
        let weights = dir.path().join("qos.safetensors");
        let bytes = std::fs::read(&weights).unwrap();
        std::fs::write(&weights, &bytes[..bytes.len() / 2]).unwrap();
        assert!(matches!(c.check(), Reload::Failed(_)));
        std::fs::write(&weights, &bytes).unwrap();
        assert!(
            matches!(c.check(), Reload::Loaded(m) if m.meta.weights_digest.as_deref() == Some(third.as_str()))
        );

        // Another schema: the loader refuses it.
        let mut other = Model::synthetic(2, &[4], 4);
        other.meta.schema_version += 1;
        other.save(dir.path(), "qos").unwrap();
        assert!(matches!(c.check(), Reload::Failed(e) if e.contains("schema")));
        // Gone: nothing loads.
        std::fs::remove_file(&path).unwrap();
        assert!(matches!(c.check(), Reload::Failed(_)));
    }

    #[test]
    fn a_good_model_is_swapped_in_and_a_bad_one_leaves_the_previous_running() {
        let dir = tempfile::tempdir().unwrap();
        let first = save(dir.path(), 1);
        let path = dir.path().join("qos.json");
        let mut watch = ModelWatch::new(&path, 3).unwrap();
        let mut policy = Recorder {
            inner: StaticPolicy::new(ctx()),
            model: Some(first.clone()),
        };
        let ex = Mutex::new(Exporter::default());
        let wait = Duration::from_secs(5);
        assert!(
            matches!(
                settle(&mut watch, &mut policy, &ex, Duration::from_millis(200)),
                Reload::Unchanged
            ),
            "nothing changed"
        );

        // A retrained model: swapped in by a tick once the loader has it.
        let second = save(dir.path(), 2);
        let found = settle(&mut watch, &mut policy, &ex, wait);
        assert!(matches!(found, Reload::Loaded(_)), "{found:?}");
        assert_eq!(policy.model.as_deref(), Some(second.as_str()));
        assert_eq!(counters(&ex), (1.0, 0.0));
        let latest = watch
            .latest()
            .expect("the reloaded model is kept for rebuilt policies");

        // Not a model: the loader's error, counted; the second model stays.
        std::fs::write(&path, "{\"format\": \"something else\"}").unwrap();
        let found = settle(&mut watch, &mut policy, &ex, wait);
        assert!(
            matches!(&found, Reload::Failed(e) if e.contains("qos.json")),
            "{found:?}"
        );
        assert_eq!(policy.model.as_deref(), Some(second.as_str()));
        assert_eq!(counters(&ex), (1.0, 1.0));
        assert!(
            watch.latest().is_some_and(|m| Arc::ptr_eq(&m, &latest)),
            "a version that failed does not replace the last good one"
        );
    }

    #[test]
    fn a_fifo_swapped_in_for_the_model_fails_its_reload_within_a_second_and_no_tick_waits() {
        let dir = tempfile::tempdir().unwrap();
        let first = save(dir.path(), 1);
        let path = dir.path().join("qos.json");
        let watch = ModelWatch::new(&path, 1).unwrap();
        std::fs::remove_file(&path).unwrap();
        let made = std::process::Command::new("mkfifo")
            .arg(&path)
            .status()
            .is_ok_and(|s| s.success());
        if !made {
            cohabit_testkit::skip(cohabit_testkit::Need::Machine, "mkfifo is not available");
            return;
        }
        let (found, slowest) = within(Duration::from_secs(1), move || {
            let mut watch = watch;
            let mut policy = Recorder {
                inner: StaticPolicy::new(ctx()),
                model: Some(first),
            };
            let ex = Mutex::new(Exporter::default());
            let mut slowest = Duration::ZERO;
            loop {
                let t = std::time::Instant::now();
                let found = watch.tick_and_swap(&mut policy, &ex);
                slowest = slowest.max(t.elapsed());
                if !matches!(found, Reload::Unchanged) {
                    assert!(policy.model.is_some(), "the model in force stays");
                    return (found, slowest);
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        assert!(
            matches!(&found, Reload::Failed(e) if e.contains("not a regular file") && e.contains("qos.json")),
            "{found:?}"
        );
        println!("slowest tick of the watcher while the FIFO was checked: {slowest:?}");
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
