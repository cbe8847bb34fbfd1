//! Training rows and how they are stored: JSON Lines, one row per line.

use std::io::{BufRead, Write};
use std::path::Path;

use anyhow::{Context, Result};
use cohabit_models::{Schema, CPU_SCHEMA};
use serde::{Deserialize, Serialize};

/// One example: features of a service under a candidate allocation, and what happened.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Row {
    /// Which service (for per-service and held-out evaluation).
    pub service: String,
    /// The feature vector (schema `cohabit_models::FEATURE_NAMES`, or
    /// `GPU_FEATURE_NAMES` in a GPU dataset).
    pub features: Vec<f32>,
    /// ln(p99 / target) in the interval after the decision.
    pub target: f32,
}

/// Rows in memory.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Dataset {
    /// The rows.
    pub rows: Vec<Row>,
}

impl Dataset {
    /// Reads a JSON Lines dataset of the CPU schema; a bad line is an error naming its
    /// number.
    pub fn read(path: &Path) -> Result<Self> {
        Self::read_for(path, &CPU_SCHEMA)
    }

    /// [`Dataset::read`] for rows of `schema`.
    pub fn read_for(path: &Path, schema: &Schema) -> Result<Self> {
        let n = schema.width();
        let f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
        let mut rows = Vec::new();
        for (i, line) in std::io::BufReader::new(f).lines().enumerate() {
            let line = line.with_context(|| format!("reading {}", path.display()))?;
            if line.trim().is_empty() {
                continue;
            }
            let row: Row = serde_json::from_str(&line)
                .with_context(|| format!("{} line {}", path.display(), i + 1))?;
            anyhow::ensure!(
                row.features.len() == n,
                "{} line {}: {} features, the schema {schema} has {n}",
                path.display(),
                i + 1,
                row.features.len()
            );
            rows.push(row);
        }
        Ok(Self { rows })
    }

    /// Writes the rows as JSON Lines.
    pub fn write(&self, path: &Path) -> Result<()> {
        let f =
            std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
        let mut w = std::io::BufWriter::new(f);
        for r in &self.rows {
            serde_json::to_writer(&mut w, r)?;
            w.write_all(b"\n")?;
        }
        w.flush()?;
        Ok(())
    }

    /// A digest of the rows (FNV-1a over their JSON), recorded in the model metadata.
    pub fn digest(&self) -> String {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for r in &self.rows {
            for b in serde_json::to_vec(r).unwrap_or_default() {
                h ^= u64::from(b);
                h = h.wrapping_mul(0x0100_0000_01b3);
            }
        }
        format!("fnv1a64:{h:016x}:{}rows", self.rows.len())
    }

    /// Distinct services, sorted.
    pub fn services(&self) -> Vec<String> {
        let mut v: Vec<String> = self.rows.iter().map(|r| r.service.clone()).collect();
        v.sort();
        v.dedup();
        v
    }
}
