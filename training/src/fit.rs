//! Training the ensemble with tch (libtorch), and the linfa baseline.
//!
//! Each member is an MLP (24 CPU or 17 GPU features → hidden… → 1, ReLU) trained on a bootstrap resample of the
//! training rows with Adam and mean-squared error, with early stopping on a held-out
//! validation split; the best weights are kept. The members' spread is then calibrated on
//! the validation split: `sigma_scale` makes 95 % of validation errors fall inside ±2σ.
//! `--init` warm-starts every member from an existing artifact (transfer to a new platform
//! with few samples, as OSML+ does). The baseline is ridge regression (linfa-elasticnet
//! with l1_ratio 0) on the same normalised features.

use std::collections::BTreeMap;

use anyhow::{bail, Context, Result};
use cohabit_models::artifact::{FORMAT, FORMAT_VERSION};
use cohabit_models::mlp::{Dense, Ensemble, Mlp};
use cohabit_models::{Model, ModelMetadata, Schema, CPU_SCHEMA, N_FEATURES};
use linfa::prelude::*;
use ndarray::{Array1, Array2};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};

use crate::dataset::Row;

/// Training settings.
#[derive(Debug, Clone)]
pub struct FitConfig {
    /// Ensemble members.
    pub members: usize,
    /// Hidden layer widths.
    pub hidden: Vec<usize>,
    /// Most epochs per member.
    pub epochs: usize,
    /// Minibatch size.
    pub batch: usize,
    /// Adam learning rate.
    pub lr: f64,
    /// Epochs without validation improvement before stopping.
    pub patience: usize,
    /// Share of rows held out for validation.
    pub val_frac: f64,
    /// Seed (shuffles, bootstraps, initialisation).
    pub seed: u64,
    /// The feature schema of the rows and of the model (the CPU one by default).
    pub schema: &'static Schema,
}

impl Default for FitConfig {
    fn default() -> Self {
        Self {
            members: 5,
            hidden: vec![32, 32],
            epochs: 60,
            batch: 256,
            lr: 2e-3,
            patience: 6,
            val_frac: 0.15,
            seed: 1,
            schema: &CPU_SCHEMA,
        }
    }
}

/// Feature matrix and targets of some rows (as wide as the first row; every row of a
/// dataset has its schema's width).
pub fn matrix(rows: &[&Row]) -> (Array2<f32>, Array1<f32>) {
    let n = rows.first().map_or(N_FEATURES, |r| r.features.len());
    let x = Array2::from_shape_fn((rows.len(), n), |(i, j)| rows[i].features[j]);
    let y = rows.iter().map(|r| r.target).collect();
    (x, y)
}

/// Per-feature mean and scale of `x` (scale floored so flags and constants stay finite).
pub fn normalisation(x: &Array2<f32>) -> (Array1<f32>, Array1<f32>) {
    let mean = x
        .mean_axis(ndarray::Axis(0))
        .unwrap_or_else(|| Array1::zeros(x.ncols()));
    let std = x.std_axis(ndarray::Axis(0), 0.0).mapv(|s| s.max(1e-3));
    (mean, std)
}

/// The tch network of one member for `inputs` features: linear layers named `l0`, `l1`, …
/// with ReLU between.
pub fn mlp(p: nn::Path<'_>, inputs: usize, hidden: &[usize]) -> nn::Sequential {
    let mut seq = nn::seq();
    let mut inp = inputs;
    for (i, &h) in hidden.iter().enumerate() {
        seq = seq
            .add(nn::linear(
                &p / format!("l{i}"),
                i64::try_from(inp).unwrap_or(1),
                i64::try_from(h).unwrap_or(1),
                Default::default(),
            ))
            .add_fn(|x| x.relu());
        inp = h;
    }
    seq.add(nn::linear(
        &p / format!("l{}", hidden.len()),
        i64::try_from(inp).unwrap_or(1),
        1,
        Default::default(),
    ))
}

/// A row-major f32 matrix as a tensor.
pub fn to_tensor(x: &Array2<f32>) -> Tensor {
    let rows = i64::try_from(x.nrows()).unwrap_or(0);
    let cols = i64::try_from(x.ncols()).unwrap_or(0);
    Tensor::from_slice(x.as_slice().unwrap_or(&[])).view([rows, cols])
}

/// The weight and bias tensors of layer `i` of a member network.
fn layer_vars(
    vars: &std::collections::HashMap<String, Tensor>,
    i: usize,
) -> Result<(&Tensor, &Tensor)> {
    let get = |part: &str| {
        vars.get(&format!("l{i}.{part}"))
            .with_context(|| format!("no l{i}.{part}"))
    };
    Ok((get("weight")?, get("bias")?))
}

/// The weights of a member network as the pure-Rust inference type.
pub fn export(vs: &nn::VarStore, layers: usize) -> Result<Mlp> {
    let vars = vs.variables();
    let mut out = Vec::new();
    for i in 0..layers {
        let (w, b) = layer_vars(&vars, i)?;
        let shape = w.size();
        let (o, n) = (usize::try_from(shape[0])?, usize::try_from(shape[1])?);
        let wv: Vec<f32> = Vec::<f32>::try_from(&w.flatten(0, -1))?;
        let bv: Vec<f32> = Vec::<f32>::try_from(b)?;
        out.push(Dense {
            weight: Array2::from_shape_vec((o, n), wv)?,
            bias: Array1::from(bv),
        });
    }
    Ok(Mlp { layers: out })
}

fn import(vs: &mut nn::VarStore, m: &Mlp) -> Result<()> {
    let vars = vs.variables();
    tch::no_grad(|| -> Result<()> {
        for (i, l) in m.layers.iter().enumerate() {
            let (w, b) = layer_vars(&vars, i)?;
            let src = to_tensor(&l.weight);
            anyhow::ensure!(
                src.size() == w.size(),
                "warm start: layer {i} has shape {:?}, the new model {:?}",
                src.size(),
                w.size()
            );
            let mut w = w.shallow_clone();
            w.copy_(&src);
            let mut b = b.shallow_clone();
            b.copy_(&Tensor::from_slice(l.bias.as_slice().unwrap_or(&[])));
        }
        Ok(())
    })
}

/// Trains an ensemble on `train`, early-stopping on `val`. `progress` gets (member, epoch).
pub fn fit(
    train: &[&Row],
    val: &[&Row],
    cfg: &FitConfig,
    init: Option<&Model>,
    mut progress: impl FnMut(usize, usize),
) -> Result<Model> {
    check_inputs(train, val, cfg, init)?;
    tch::manual_seed(i64::try_from(cfg.seed % (1 << 62)).unwrap_or(0));
    let (x_all, y_all) = matrix(train);
    let (mean, std) = match init {
        Some(m) => (m.ensemble.mean.clone(), m.ensemble.std.clone()),
        None => normalisation(&x_all),
    };
    let norm = |x: &Array2<f32>| (x - &mean) / &std;
    let xv = to_tensor(&norm(&matrix(val).0));
    let yv = Tensor::from_slice(matrix(val).1.as_slice().unwrap_or(&[])).view([-1, 1]);
    let x_norm = norm(&x_all);
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed);
    let mut members = Vec::new();
    for k in 0..cfg.members {
        let mut vs = nn::VarStore::new(Device::Cpu);
        let net = mlp(vs.root(), cfg.schema.width(), &cfg.hidden);
        if let Some(m) = init {
            if let Some(src) = m.ensemble.members.get(k % m.ensemble.members.len()) {
                import(&mut vs, src)?;
            }
        }
        let mut opt = nn::Adam::default().build(&vs, cfg.lr)?;
        // Bootstrap resample: members see different data, so their spread means something.
        let idx: Vec<usize> = (0..train.len())
            .map(|_| rng.gen_range(0..train.len()))
            .collect();
        let xb = to_tensor(&x_norm.select(ndarray::Axis(0), &idx));
        let yb =
            Tensor::from_slice(&idx.iter().map(|&i| y_all[i]).collect::<Vec<f32>>()).view([-1, 1]);
        let n = i64::try_from(idx.len()).unwrap_or(0);
        let mut best = f64::INFINITY;
        let mut best_weights = export(&vs, cfg.hidden.len() + 1)?;
        let mut stale = 0;
        for epoch in 0..cfg.epochs {
            let mut order: Vec<i64> = (0..n).collect();
            order.shuffle(&mut rng);
            for chunk in order.chunks(cfg.batch) {
                let ids = Tensor::from_slice(chunk);
                let loss = net
                    .forward(&xb.index_select(0, &ids))
                    .mse_loss(&yb.index_select(0, &ids), tch::Reduction::Mean);
                opt.backward_step(&loss);
            }
            let val_loss = tch::no_grad(|| {
                net.forward(&xv)
                    .mse_loss(&yv, tch::Reduction::Mean)
                    .double_value(&[])
            });
            progress(k, epoch);
            if val_loss < best - 1e-5 {
                best = val_loss;
                best_weights = export(&vs, cfg.hidden.len() + 1)?;
                stale = 0;
            } else {
                stale += 1;
                if stale >= cfg.patience {
                    break;
                }
            }
        }
        members.push(best_weights);
    }
    let mut model = Model {
        meta: metadata(cfg, &mean, &std),
        ensemble: Ensemble {
            members,
            mean: mean.clone(),
            std: std.clone(),
        },
    };
    model.meta.sigma_scale = calibrate(&model, val);
    Ok(model)
}

/// Whether `train` and `val` can train a model of `cfg` (rows of its schema's width,
/// both non-empty), warm-started from `init` (of the same schema and hidden layers).
fn check_inputs(train: &[&Row], val: &[&Row], cfg: &FitConfig, init: Option<&Model>) -> Result<()> {
    if train.is_empty() || val.is_empty() {
        bail!(
            "need training and validation rows (got {} and {})",
            train.len(),
            val.len()
        );
    }
    if let Some(r) = train
        .iter()
        .chain(val)
        .find(|r| r.features.len() != cfg.schema.width())
    {
        bail!(
            "a row of service {} has {} features, the schema {} has {}",
            r.service,
            r.features.len(),
            cfg.schema,
            cfg.schema.width()
        );
    }
    if let Some(m) = init {
        anyhow::ensure!(
            m.schema() == cfg.schema,
            "warm start from a model of schema {} into {}",
            m.schema(),
            cfg.schema
        );
        anyhow::ensure!(
            m.meta.hidden == cfg.hidden,
            "warm start from hidden {:?} into {:?}",
            m.meta.hidden,
            cfg.hidden
        );
    }
    Ok(())
}

/// The metadata of a model trained with `cfg` on features normalised by `mean` and `std`
/// (its sigma scale 1 until calibrated, its digests and metrics filled in later).
fn metadata(cfg: &FitConfig, mean: &Array1<f32>, std: &Array1<f32>) -> ModelMetadata {
    ModelMetadata {
        format: FORMAT.into(),
        format_version: FORMAT_VERSION,
        schema: (cfg.schema != &CPU_SCHEMA).then(|| cfg.schema.name.to_string()),
        schema_version: cfg.schema.version,
        features: cfg.schema.features.iter().map(|s| s.to_string()).collect(),
        norm_mean: mean.to_vec(),
        norm_std: std.to_vec(),
        target:
            "ln(p99 / target) of the latency-critical service in the interval after the decision"
                .into(),
        weights: String::new(),
        members: cfg.members,
        hidden: cfg.hidden.clone(),
        training_data_digest: String::new(),
        weights_digest: None,
        metrics: BTreeMap::new(),
        sigma_scale: 1.0,
        change_sigma_scale: None,
    }
}

/// The factor that puts 95 % of `rows`' errors inside ±2 spread.
pub fn calibrate(model: &Model, rows: &[&Row]) -> f32 {
    let (x, y) = matrix(rows);
    let (m, s) = model.ensemble.predict(x.view());
    let mut z: Vec<f32> = m
        .iter()
        .zip(&s)
        .zip(&y)
        .map(|((m, s), y)| (y - m).abs() / s.max(1e-6))
        .collect();
    z.sort_by(f32::total_cmp);
    let q = z.get(z.len() * 95 / 100).copied().unwrap_or(2.0);
    (q / 2.0).max(1e-3)
}

/// The ridge-regression baseline (normalised features, l2 penalty only).
#[derive(Debug, Clone)]
pub struct Ridge {
    model: linfa_elasticnet::ElasticNet<f64>,
    mean: Array1<f32>,
    std: Array1<f32>,
}

impl Ridge {
    /// Fits the baseline on rows.
    pub fn fit(rows: &[&Row]) -> Result<Self> {
        if rows.is_empty() {
            bail!("the ridge baseline needs rows to fit on, and got none");
        }
        let (x, y) = matrix(rows);
        let (mean, std) = normalisation(&x);
        let xn = ((&x - &mean) / &std).mapv(f64::from);
        let ds = linfa::Dataset::new(xn, y.mapv(f64::from));
        let model = linfa_elasticnet::ElasticNet::params()
            .penalty(1e-3)
            .l1_ratio(0.0)
            .fit(&ds)
            .context("fitting the ridge baseline")?;
        Ok(Self { model, mean, std })
    }

    /// Predictions for rows.
    pub fn predict(&self, rows: &[&Row]) -> Array1<f32> {
        let (x, _) = matrix(rows);
        let xn = ((&x - &self.mean) / &self.std).mapv(f64::from);
        #[allow(clippy::cast_possible_truncation)]
        self.model.predict(&xn).mapv(|v| v as f32)
    }
}
