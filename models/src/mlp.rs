//! Pure-Rust inference of an ensemble of small MLPs (ndarray; no libtorch at run time).
//!
//! Each member maps normalised features through dense layers with ReLU between them to one
//! output, the predicted ln(p99 / target). The ensemble's mean is the prediction and the
//! standard deviation across members its uncertainty. Inputs are scored in batches: one
//! matrix product per layer per member for all candidates at once.

use ndarray::{Array1, Array2, ArrayView2, Axis};

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
        let mut h = x.to_owned();
        for (i, layer) in self.layers.iter().enumerate() {
            let mut z = h.dot(&layer.weight.t());
            z += &layer.bias;
            if i + 1 < self.layers.len() {
                z.mapv_inplace(|v| v.max(0.0));
            }
            h = z;
        }
        h.index_axis_move(Axis(1), 0)
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
        let z = (&x - &self.mean) / &self.std;
        let mut out = Array2::<f32>::zeros((self.members.len(), x.nrows()));
        for (k, m) in self.members.iter().enumerate() {
            out.row_mut(k).assign(&m.forward(z.view()));
        }
        out
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
