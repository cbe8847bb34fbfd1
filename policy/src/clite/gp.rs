//! A small Gaussian process for `clite`'s score surface, and expected improvement.
//!
//! Problem: predict a configuration's score, with an uncertainty, from the few dozen
//! configurations sampled so far, cheaply enough to score a thousand candidates per tick.
//!
//! Approach: a GP with a constant prior mean (the samples' mean), a Matérn
//! 5/2 kernel on inputs scaled to [0, 1], the signal variance the samples' variance and a
//! fixed observation noise; the length scale is the one of [`LENGTH_SCALES`] with the
//! highest log marginal likelihood. The kernel matrix is factored once per fit (Cholesky;
//! at most a few dozen points, so O(n³) is microseconds).

/// Length scales tried at each fit (inputs are scaled to [0, 1]).
pub(super) const LENGTH_SCALES: [f64; 4] = [0.1, 0.2, 0.4, 0.8];

/// Observation noise variance of a score (a score's spread of about 0.03 between two
/// samples of one configuration, from the measured p99's noise).
const NOISE_VAR: f64 = 1e-3;

/// Smallest signal variance (all samples alike early in a search).
const MIN_SIGNAL_VAR: f64 = 1e-3;

/// A Gaussian process fitted to scored configurations.
#[derive(Debug, Clone)]
pub(super) struct Gp {
    x: Vec<Vec<f64>>,
    /// Lower Cholesky factor of the kernel matrix (with noise).
    l: Vec<Vec<f64>>,
    /// `K⁻¹ (y − mean)`.
    alpha: Vec<f64>,
    mean: f64,
    signal_var: f64,
    length_scale: f64,
}

impl Gp {
    /// Fits `y` at `x` (rows of equal length); `None` without points or when no length
    /// scale gives a positive-definite kernel matrix.
    pub(super) fn fit(x: &[Vec<f64>], y: &[f64]) -> Option<Gp> {
        if x.is_empty() || x.len() != y.len() {
            return None;
        }
        let n = y.len() as f64;
        let mean = y.iter().sum::<f64>() / n;
        let signal_var =
            (y.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n).max(MIN_SIGNAL_VAR);
        let centred: Vec<f64> = y.iter().map(|v| v - mean).collect();
        let mut best: Option<(f64, Gp)> = None;
        for &ls in &LENGTH_SCALES {
            let k: Vec<Vec<f64>> = x
                .iter()
                .enumerate()
                .map(|(i, a)| {
                    x.iter()
                        .enumerate()
                        .map(|(j, b)| {
                            signal_var * matern52(a, b, ls) + if i == j { NOISE_VAR } else { 0.0 }
                        })
                        .collect()
                })
                .collect();
            let Some(l) = cholesky(&k) else { continue };
            let alpha = solve_upper_t(&l, &solve_lower(&l, &centred));
            let fit: f64 = centred.iter().zip(&alpha).map(|(a, b)| a * b).sum();
            let log_det: f64 = l.iter().enumerate().map(|(i, r)| r[i].ln()).sum();
            let lml = -0.5 * fit - log_det;
            if best.as_ref().is_none_or(|(b, _)| lml > *b) {
                best = Some((
                    lml,
                    Gp {
                        x: x.to_vec(),
                        l,
                        alpha,
                        mean,
                        signal_var,
                        length_scale: ls,
                    },
                ));
            }
        }
        best.map(|(_, gp)| gp)
    }

    /// Posterior mean and standard deviation at `x`.
    pub(super) fn predict(&self, x: &[f64]) -> (f64, f64) {
        let k: Vec<f64> = self
            .x
            .iter()
            .map(|xi| self.signal_var * matern52(xi, x, self.length_scale))
            .collect();
        let mu = self.mean + k.iter().zip(&self.alpha).map(|(a, b)| a * b).sum::<f64>();
        let v = solve_lower(&self.l, &k);
        let var = self.signal_var - v.iter().map(|a| a * a).sum::<f64>();
        (mu, var.max(1e-12).sqrt())
    }
}

/// Matérn 5/2 correlation of `a` and `b` at length scale `ls`.
fn matern52(a: &[f64], b: &[f64], ls: f64) -> f64 {
    let r = a
        .iter()
        .zip(b)
        .map(|(p, q)| (p - q).powi(2))
        .sum::<f64>()
        .sqrt();
    let s = 5f64.sqrt() * r / ls;
    (1.0 + s + s * s / 3.0) * (-s).exp()
}

/// Lower Cholesky factor of a symmetric matrix; `None` if it is not positive definite.
fn cholesky(a: &[Vec<f64>]) -> Option<Vec<Vec<f64>>> {
    let n = a.len();
    let mut l = vec![vec![0.0; n]; n];
    for i in 0..n {
        for j in 0..=i {
            let s: f64 = (0..j).map(|k| l[i][k] * l[j][k]).sum();
            if i == j {
                let d = a[i][i] - s;
                if d <= 0.0 || !d.is_finite() {
                    return None;
                }
                l[i][j] = d.sqrt();
            } else {
                l[i][j] = (a[i][j] - s) / l[j][j];
            }
        }
    }
    Some(l)
}

/// Solves `L z = b` for lower-triangular `L`.
fn solve_lower(l: &[Vec<f64>], b: &[f64]) -> Vec<f64> {
    let mut z = vec![0.0; b.len()];
    for i in 0..b.len() {
        let s: f64 = (0..i).map(|k| l[i][k] * z[k]).sum();
        z[i] = (b[i] - s) / l[i][i];
    }
    z
}

/// Solves `Lᵀ z = b` for lower-triangular `L`.
fn solve_upper_t(l: &[Vec<f64>], b: &[f64]) -> Vec<f64> {
    let n = b.len();
    let mut z = vec![0.0; n];
    for i in (0..n).rev() {
        let s: f64 = (i + 1..n).map(|k| l[k][i] * z[k]).sum();
        z[i] = (b[i] - s) / l[i][i];
    }
    z
}

/// Expected improvement over `best` of a point predicted at `mu` with spread `sd`.
pub(super) fn expected_improvement(mu: f64, sd: f64, best: f64) -> f64 {
    if sd <= 0.0 {
        return (mu - best).max(0.0);
    }
    let z = (mu - best) / sd;
    (mu - best) * normal_cdf(z) + sd * normal_pdf(z)
}

fn normal_pdf(z: f64) -> f64 {
    (-0.5 * z * z).exp() / (2.0 * std::f64::consts::PI).sqrt()
}

/// Standard normal CDF through erfc (Abramowitz and Stegun 7.1.26; error under 1.5e-7).
fn normal_cdf(z: f64) -> f64 {
    let x = z.abs() / 2f64.sqrt();
    let t = 1.0 / (1.0 + 0.327_591_1 * x);
    let poly = t
        * (0.254_829_592
            + t * (-0.284_496_736
                + t * (1.421_413_741 + t * (-1.453_152_027 + t * 1.061_405_429))));
    let erfc = poly * (-x * x).exp();
    if z >= 0.0 {
        1.0 - 0.5 * erfc
    } else {
        0.5 * erfc
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_normal_cdf_matches_known_values() {
        assert!((normal_cdf(0.0) - 0.5).abs() < 1e-7);
        assert!((normal_cdf(1.96) - 0.975_002).abs() < 1e-5);
        assert!((normal_cdf(-1.0) - 0.158_655).abs() < 1e-5);
    }

    #[test]
    fn the_posterior_passes_near_the_samples_and_is_unsure_away_from_them() {
        let x: Vec<Vec<f64>> = [0.0, 0.25, 0.5, 0.75, 1.0]
            .iter()
            .map(|v| vec![*v])
            .collect();
        let y: Vec<f64> = x.iter().map(|v| (3.0 * v[0]).sin()).collect();
        let gp = Gp::fit(&x, &y).unwrap();
        for (xi, yi) in x.iter().zip(&y) {
            let (mu, sd) = gp.predict(xi);
            assert!((mu - yi).abs() < 0.05, "{xi:?}: {mu} vs {yi}");
            assert!(sd < 0.1, "{sd}");
        }
        // Between samples the mean interpolates; far out the spread grows.
        let (mu, _) = gp.predict(&[0.375]);
        assert!((mu - (3.0f64 * 0.375).sin()).abs() < 0.1, "{mu}");
        let (_, far) = gp.predict(&[3.0]);
        let (_, near) = gp.predict(&[0.5]);
        assert!(far > 5.0 * near, "{far} vs {near}");
    }

    #[test]
    fn expected_improvement_favours_a_higher_mean_and_a_wider_spread() {
        let base = expected_improvement(0.5, 0.1, 0.6);
        assert!(expected_improvement(0.55, 0.1, 0.6) > base);
        assert!(expected_improvement(0.5, 0.2, 0.6) > base);
        assert_eq!(expected_improvement(0.5, 0.0, 0.6), 0.0);
        assert!((expected_improvement(0.7, 0.0, 0.6) - 0.1).abs() < 1e-12);
    }

    #[test]
    fn nothing_to_fit_is_no_process() {
        assert!(Gp::fit(&[], &[]).is_none());
        assert!(Gp::fit(&[vec![0.0]], &[1.0, 2.0]).is_none());
    }
}
