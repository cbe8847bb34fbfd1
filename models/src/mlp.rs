//! Pure-Rust inference of an ensemble of small MLPs (ndarray; no libtorch at run time).
//!
//! Each member maps normalised features through dense layers with ReLU between them to one
//! output, the predicted ln(p99 / target). The ensemble's mean is the prediction and the
//! standard deviation across members its uncertainty. Inputs are scored in batches: one
//! matrix product per layer per member for all candidates at once.

use ndarray::{Array1, Array2, ArrayView1, ArrayView2, Axis};

/// One dense layer: `y = x · Wᵀ + b` with `W` of shape (out, in), as PyTorch stores it.
#[derive(Debug, Clone, PartialEq)]
pub struct Dense {
    /// Weights, (out, in).
    pub weight: Array2<f32>,
    /// Bias, (out).
    pub bias: Array1<f32>,
}

/// One MLP: dense layers with ReLU between them (none after the last).
#[derive(Debug, Clone, PartialEq)]
pub struct Mlp {
    /// The layers, input first.
    pub layers: Vec<Dense>,
}

impl Mlp {
    /// Outputs for a batch of (already normalised) inputs of shape (n, in).
    pub fn forward(&self, x: ArrayView2<'_, f32>) -> Array1<f32> {
        self.forward_from(x.to_owned(), 0)
    }

    /// Continues a forward pass: `h` is the input of layer `start`.
    fn forward_from(&self, h: Array2<f32>, start: usize) -> Array1<f32> {
        self.forward_from_basis(h, start).0
    }

    /// [`Mlp::forward_from`], also returning the input of the output layer (the last
    /// hidden layer's activations, n × width; the normalised input itself when there is no
    /// hidden layer): the basis a per-host posterior on the output layer regresses on.
    fn forward_from_basis(&self, mut h: Array2<f32>, start: usize) -> (Array1<f32>, Array2<f32>) {
        let Some((out, hidden)) = self.layers.split_last() else {
            let n = h.nrows();
            return (Array1::zeros(n), h);
        };
        for layer in hidden.iter().skip(start) {
            let mut z = h.dot(&layer.weight.t());
            z += &layer.bias;
            z.mapv_inplace(|v| v.max(0.0));
            h = z;
        }
        let y = if out.weight.nrows() == 1 {
            // One output: a matrix-vector product (a matrix product would pack the
            // weights and the batch for a single column).
            h.dot(&out.weight.row(0)) + out.bias[0]
        } else {
            let mut y = h.dot(&out.weight.t());
            y += &out.bias;
            y.index_axis_move(Axis(1), 0)
        };
        (y, h)
    }

    /// Width of the output layer's input (the last hidden layer), if the MLP has layers.
    pub fn basis_width(&self) -> Option<usize> {
        self.layers.last().map(|l| l.weight.ncols())
    }

    /// [`Mlp::forward`] for rows that differ only in the columns `varying`, given the
    /// normalised shared row `z0` and the normalised varying columns `zv` (n × varying):
    /// the first layer's product with the shared columns is computed once.
    fn forward_shared(
        &self,
        z0: ArrayView1<'_, f32>,
        zv: ArrayView2<'_, f32>,
        varying: &[usize],
    ) -> (Array1<f32>, Array2<f32>) {
        let Some(first) = self.layers.first() else {
            return (Array1::zeros(zv.nrows()), Array2::zeros((zv.nrows(), 0)));
        };
        if self.layers.len() == 1 {
            // No hidden layer: the basis is the normalised input itself.
            let n = zv.nrows();
            let mut z = Array2::from_shape_fn((n, z0.len()), |(_, j)| z0[j]);
            for (k, &j) in varying.iter().enumerate() {
                z.column_mut(j).assign(&zv.column(k));
            }
            return self.forward_from_basis(z, 0);
        }
        // W·z0 over all columns, minus the varying ones' share, plus the bias.
        let w = &first.weight;
        let mut base = w.dot(&z0) + &first.bias;
        for &j in varying {
            base.scaled_add(-z0[j], &w.column(j));
        }
        let wv = Array2::from_shape_fn((w.nrows(), varying.len()), |(o, k)| w[[o, varying[k]]]);
        let mut h = zv.dot(&wv.t());
        h += &base;
        h.mapv_inplace(|v| v.max(0.0));
        self.forward_from_basis(h, 1)
    }
}

/// An ensemble of MLPs with the input normalisation they were trained with.
#[derive(Debug, Clone, PartialEq)]
pub struct Ensemble {
    /// Members.
    pub members: Vec<Mlp>,
    /// Per-feature mean subtracted before the first layer.
    pub mean: Array1<f32>,
    /// Per-feature scale divided by before the first layer.
    pub std: Array1<f32>,
}

impl Ensemble {
    /// Input width.
    pub fn inputs(&self) -> usize {
        self.mean.len()
    }

    /// Every member's prediction for a batch of raw feature rows: (members, rows).
    pub fn members_predict(&self, x: ArrayView2<'_, f32>) -> Array2<f32> {
        self.members_predict_basis(x).0
    }

    /// [`Ensemble::members_predict`] and the members' mean basis for each row (see
    /// [`Ensemble::basis_width`]): rows × width, `None` when the members' widths differ.
    pub fn members_predict_basis(
        &self,
        x: ArrayView2<'_, f32>,
    ) -> (Array2<f32>, Option<Array2<f32>>) {
        let z = (&x - &self.mean) / &self.std;
        let mut out = Array2::<f32>::zeros((self.members.len(), x.nrows()));
        let mut basis = MeanBasis::new(self.basis_width(), x.nrows());
        for (k, m) in self.members.iter().enumerate() {
            let (y, h) = m.forward_from_basis(z.clone(), 0);
            out.row_mut(k).assign(&y);
            basis.add(&h);
        }
        (out, basis.finish(self.members.len()))
    }

    /// [`Ensemble::members_predict`] for rows that are equal outside the columns `varying`
    /// (candidates of one service at one tick): cheaper, same result up to rounding.
    pub fn members_predict_shared(&self, x: ArrayView2<'_, f32>, varying: &[usize]) -> Array2<f32> {
        self.members_predict_shared_basis(x, varying).0
    }

    /// [`Ensemble::members_predict_shared`] and the members' mean basis for each row, as
    /// [`Ensemble::members_predict_basis`].
    pub fn members_predict_shared_basis(
        &self,
        x: ArrayView2<'_, f32>,
        varying: &[usize],
    ) -> (Array2<f32>, Option<Array2<f32>>) {
        let n = x.nrows();
        let mut out = Array2::<f32>::zeros((self.members.len(), n));
        if n == 0 {
            return (out, self.basis_width().map(|w| Array2::zeros((0, w))));
        }
        // Normalise the shared row once and only the varying columns of every row.
        let z0 = (&x.row(0) - &self.mean) / &self.std;
        let zv = Array2::from_shape_fn((n, varying.len()), |(r, k)| {
            let j = varying[k];
            (x[[r, j]] - self.mean[j]) / self.std[j]
        });
        let mut basis = MeanBasis::new(self.basis_width(), n);
        for (k, m) in self.members.iter().enumerate() {
            let (y, h) = m.forward_shared(z0.view(), zv.view(), varying);
            out.row_mut(k).assign(&y);
            basis.add(&h);
        }
        (out, basis.finish(self.members.len()))
    }

    /// Width of the basis a per-host posterior regresses on: the input of the members'
    /// output layers (their last hidden layer), averaged over the members. Adding a vector
    /// `d` to every member's output weights adds `d · basis` to the ensemble's mean, so a
    /// correction learnt on this basis is a correction of the output layer
    /// ([`crate::posterior`]). `None` without members or when their widths differ.
    pub fn basis_width(&self) -> Option<usize> {
        let mut widths = self.members.iter().map(Mlp::basis_width);
        let first = widths.next()??;
        widths.all(|w| w == Some(first)).then_some(first)
    }

    /// Mean and spread of the members' predictions for a batch of raw feature rows.
    pub fn predict(&self, x: ArrayView2<'_, f32>) -> (Array1<f32>, Array1<f32>) {
        let z = (&x - &self.mean) / &self.std;
        let outs: Vec<Array1<f32>> = self.members.iter().map(|m| m.forward(z.view())).collect();
        let n = x.nrows();
        let k = outs.len().max(1) as f32;
        let mut mean = Array1::<f32>::zeros(n);
        for o in &outs {
            mean += o;
        }
        mean /= k;
        let mut var = Array1::<f32>::zeros(n);
        for o in &outs {
            let d = o - &mean;
            var += &(&d * &d);
        }
        var /= k;
        (mean, var.mapv(f32::sqrt))
    }
}

/// The members' last hidden layers summed as they come, then averaged.
struct MeanBasis(Option<Array2<f32>>);

impl MeanBasis {
    fn new(width: Option<usize>, rows: usize) -> Self {
        Self(width.map(|w| Array2::zeros((rows, w))))
    }

    fn add(&mut self, h: &Array2<f32>) {
        if let Some(sum) = &mut self.0 {
            if sum.dim() == h.dim() {
                *sum += h;
            }
        }
    }

    fn finish(self, members: usize) -> Option<Array2<f32>> {
        self.0.map(|s| s / members.max(1) as f32)
    }
}

#[cfg(test)]
mod tests {
    use ndarray::array;

    use super::*;

    fn mlp(scale: f32) -> Mlp {
        Mlp {
            layers: vec![
                Dense {
                    weight: array![[1.0, -1.0], [0.5, 0.5]] * scale,
                    bias: array![0.0, -1.0],
                },
                Dense {
                    weight: array![[2.0, 1.0]],
                    bias: array![0.5],
                },
            ],
        }
    }

    #[test]
    fn a_forward_pass_matches_the_hand_computation() {
        // x = [3, 1]: hidden = relu([2, 1]) = [2, 1]; out = 2*2 + 1 + 0.5 = 5.5
        // x = [0, 4]: hidden = relu([-4, 1]) = [0, 1]; out = 1.5
        let y = mlp(1.0).forward(array![[3.0, 1.0], [0.0, 4.0]].view());
        assert_eq!(y, array![5.5, 1.5]);
    }

    #[test]
    fn the_spread_is_zero_for_identical_members_and_grows_with_disagreement() {
        let x = array![[3.0, 1.0]];
        let same = Ensemble {
            members: vec![mlp(1.0), mlp(1.0)],
            mean: array![0.0, 0.0],
            std: array![1.0, 1.0],
        };
        let (m, s) = same.predict(x.view());
        assert_eq!((m[0], s[0]), (5.5, 0.0));
        let differ = Ensemble {
            members: vec![mlp(1.0), mlp(2.0)],
            ..same
        };
        let (_, s) = differ.predict(x.view());
        assert!(s[0] > 0.5);
    }

    #[test]
    fn inputs_are_normalised_first() {
        let e = Ensemble {
            members: vec![mlp(1.0)],
            mean: array![1.0, 1.0],
            std: array![2.0, 3.0],
        };
        // (7-1)/2 = 3, (4-1)/3 = 1 → the same as x = [3, 1].
        assert_eq!(e.predict(array![[7.0, 4.0]].view()).0[0], 5.5);
    }
}
