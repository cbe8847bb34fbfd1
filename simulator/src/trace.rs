//! Offered load over time, as a fraction of a service's knee load.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::SimError;

/// A load shape. Fractions are of the service's simulated knee load (see
/// `catalogue::LatencyTarget::knee_rps`); 1.0 is the most it can take on the whole host.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum LoadTrace {
    /// The same load throughout.
    Constant {
        /// Fraction of the knee load.
        fraction: f64,
    },
    /// Piecewise-constant load: each step holds from `at_s` until the next.
    Steps {
        /// Steps in time order; the first should start at 0.
        steps: Vec<Step>,
    },
    /// A sinusoidal day compressed into `period_s`.
    Diurnal {
        /// Mean fraction.
        mean: f64,
        /// Peak deviation from the mean.
        amplitude: f64,
        /// Length of one cycle.
        period_s: f64,
        /// Shift of the cycle.
        #[serde(default)]
        phase_s: f64,
    },
    /// A base load with periodic spikes.
    Spikes {
        /// Fraction between spikes.
        base: f64,
        /// Fraction during a spike.
        peak: f64,
        /// Time from one spike's start to the next.
        every_s: f64,
        /// How long a spike lasts.
        duration_s: f64,
        /// Start of the first spike.
        #[serde(default)]
        first_at_s: f64,
    },
    /// Replay of a CSV file with a header and columns `t_s,fraction`; the load holds
    /// between rows and after the last one. `file` is relative to the scenario file.
    Replay {
        /// The CSV file.
        file: String,
        /// Multiplies every fraction.
        #[serde(default = "one")]
        scale: f64,
        /// Rows, filled in when the scenario is loaded.
        #[serde(skip)]
        rows: Vec<Step>,
    },
}

fn one() -> f64 {
    1.0
}

/// One point of a stepped or replayed trace.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Step {
    /// When it starts, seconds from the start of the run.
    pub at_s: f64,
    /// Fraction of the knee load from then on.
    pub fraction: f64,
}

impl LoadTrace {
    /// The load fraction at time `t_s`.
    pub fn at(&self, t_s: f64) -> f64 {
        let f = match self {
            LoadTrace::Constant { fraction } => *fraction,
            LoadTrace::Steps { steps } => hold(steps, t_s, 1.0),
            LoadTrace::Replay { rows, scale, .. } => hold(rows, t_s, *scale),
            LoadTrace::Diurnal {
                mean,
                amplitude,
                period_s,
                phase_s,
            } => mean + amplitude * (std::f64::consts::TAU * (t_s + phase_s) / period_s).sin(),
            LoadTrace::Spikes {
                base,
                peak,
                every_s,
                duration_s,
                first_at_s,
            } => {
                let since = t_s - first_at_s;
                if since >= 0.0 && since.rem_euclid(*every_s) < *duration_s {
                    *peak
                } else {
                    *base
                }
            }
        };
        f.max(0.0)
    }

    /// Highest fraction the trace reaches within `[0, duration_s)` (sampled each second).
    pub fn peak(&self, duration_s: f64) -> f64 {
        let mut t = 0.0;
        let mut best: f64 = 0.0;
        while t < duration_s {
            best = best.max(self.at(t));
            t += 1.0;
        }
        best
    }

    /// Checks the numbers; `who` names the service in the error.
    pub fn validate(&self, who: &str) -> Result<(), SimError> {
        let bad = |what: &str, v: f64| {
            Err(SimError::Scenario(format!(
                "service {who}: load {what} must be a non-negative number, got {v}"
            )))
        };
        match self {
            LoadTrace::Constant { fraction } if !(fraction.is_finite() && *fraction >= 0.0) => {
                bad("fraction", *fraction)
            }
            LoadTrace::Steps { steps } if steps.is_empty() => Err(SimError::Scenario(format!(
                "service {who}: load steps must not be empty"
            ))),
            LoadTrace::Steps { steps } => check_rows(steps, who),
            LoadTrace::Replay { rows, .. } => check_rows(rows, who),
            LoadTrace::Diurnal {
                mean,
                amplitude,
                period_s,
                ..
            } => {
                if period_s.is_nan() || *period_s <= 0.0 {
                    return bad("period_s", *period_s);
                }
                if !(mean.is_finite() && *mean >= 0.0) {
                    return bad("mean", *mean);
                }
                if !(amplitude.is_finite() && *amplitude >= 0.0) {
                    return bad("amplitude", *amplitude);
                }
                Ok(())
            }
            LoadTrace::Spikes {
                base,
                peak,
                every_s,
                duration_s,
                ..
            } => {
                if every_s.is_nan() || *every_s <= 0.0 {
                    return bad("every_s", *every_s);
                }
                for (n, v) in [("base", base), ("peak", peak), ("duration_s", duration_s)] {
                    if !(v.is_finite() && *v >= 0.0) {
                        return bad(n, *v);
                    }
                }
                Ok(())
            }
            LoadTrace::Constant { .. } => Ok(()),
        }
    }

    /// For a replay trace, reads its CSV relative to `base_dir`; other traces are unchanged.
    pub fn load_file(&mut self, base_dir: &Path) -> Result<(), SimError> {
        if let LoadTrace::Replay { file, rows, .. } = self {
            let path = base_dir.join(&*file);
            let text = std::fs::read_to_string(&path).map_err(|e| SimError::Io {
                path: path.display().to_string(),
                what: "reading a load trace",
                source: e,
            })?;
            *rows = parse_csv(&text)
                .map_err(|e| SimError::Scenario(format!("{}: {e}", path.display())))?;
        }
        Ok(())
    }

    /// For a replay trace, parses CSV text given directly (built-in scenarios embed theirs).
    pub fn load_text(&mut self, text: &str) -> Result<(), SimError> {
        if let LoadTrace::Replay { file, rows, .. } = self {
            *rows = parse_csv(text).map_err(|e| SimError::Scenario(format!("{file}: {e}")))?;
        }
        Ok(())
    }
}

fn check_rows(rows: &[Step], who: &str) -> Result<(), SimError> {
    for (i, r) in rows.iter().enumerate() {
        if !(r.fraction.is_finite() && r.fraction >= 0.0 && r.at_s.is_finite() && r.at_s >= 0.0) {
            return Err(SimError::Scenario(format!(
                "service {who}: load step {i} must have non-negative at_s and fraction, got at_s={} fraction={}",
                r.at_s, r.fraction
            )));
        }
        if i > 0 && r.at_s < rows[i - 1].at_s {
            return Err(SimError::Scenario(format!(
                "service {who}: load steps must be in time order (step {i} at {} s comes before {} s)",
                r.at_s,
                rows[i - 1].at_s
            )));
        }
    }
    Ok(())
}

fn hold(rows: &[Step], t_s: f64, scale: f64) -> f64 {
    let idx = rows.partition_point(|r| r.at_s <= t_s);
    if idx == 0 {
        rows.first().map_or(0.0, |r| r.fraction * scale)
    } else {
        rows[idx - 1].fraction * scale
    }
}

/// Parses `t_s,fraction` rows after a header line.
fn parse_csv(text: &str) -> Result<Vec<Step>, String> {
    let mut rows = Vec::new();
    for (n, line) in text.lines().enumerate().skip(1) {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut it = line.split(',');
        let parse = |v: Option<&str>, col: &str| -> Result<f64, String> {
            v.map(str::trim)
                .ok_or_else(|| format!("line {}: missing column {col}", n + 1))?
                .parse::<f64>()
                .map_err(|e| format!("line {}: column {col}: {e}", n + 1))
        };
        let at_s = parse(it.next(), "t_s")?;
        let fraction = parse(it.next(), "fraction")?;
        rows.push(Step { at_s, fraction });
    }
    if rows.is_empty() {
        return Err("no rows after the header".into());
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_hold_until_the_next_step() {
        let t = LoadTrace::Steps {
            steps: vec![
                Step {
                    at_s: 0.0,
                    fraction: 0.2,
                },
                Step {
                    at_s: 10.0,
                    fraction: 0.5,
                },
            ],
        };
        assert_eq!(t.at(0.0), 0.2);
        assert_eq!(t.at(9.99), 0.2);
        assert_eq!(t.at(10.0), 0.5);
        assert_eq!(t.at(1e6), 0.5);
    }

    #[test]
    fn spikes_repeat_and_diurnal_swings_around_its_mean() {
        let s = LoadTrace::Spikes {
            base: 0.2,
            peak: 0.6,
            every_s: 100.0,
            duration_s: 10.0,
            first_at_s: 50.0,
        };
        assert_eq!(s.at(49.0), 0.2);
        assert_eq!(s.at(55.0), 0.6);
        assert_eq!(s.at(65.0), 0.2);
        assert_eq!(s.at(155.0), 0.6);
        assert_eq!(s.peak(300.0), 0.6);
        let d = LoadTrace::Diurnal {
            mean: 0.4,
            amplitude: 0.2,
            period_s: 100.0,
            phase_s: 0.0,
        };
        assert!((d.at(25.0) - 0.6).abs() < 1e-9);
        assert!((d.at(75.0) - 0.2).abs() < 1e-9);
    }

    #[test]
    fn replay_parses_csv_and_reports_bad_rows_by_line() {
        let mut t = LoadTrace::Replay {
            file: "x.csv".into(),
            scale: 2.0,
            rows: vec![],
        };
        t.load_text("t_s,fraction\n0,0.1\n5,0.2\n").unwrap();
        assert_eq!(t.at(6.0), 0.4);
        let err = t
            .load_text("t_s,fraction\n0,abc\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("line 2") && err.contains("fraction"), "{err}");
    }

    #[test]
    fn negative_or_unordered_loads_are_rejected() {
        let t = LoadTrace::Constant { fraction: -0.1 };
        assert!(t
            .validate("m")
            .unwrap_err()
            .to_string()
            .contains("service m"));
        let t = LoadTrace::Steps {
            steps: vec![
                Step {
                    at_s: 5.0,
                    fraction: 0.1,
                },
                Step {
                    at_s: 1.0,
                    fraction: 0.1,
                },
            ],
        };
        assert!(t
            .validate("m")
            .unwrap_err()
            .to_string()
            .contains("time order"));
    }
}
