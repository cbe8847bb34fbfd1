//! What operators look at: decision plots and a self-contained HTML report.

pub mod html;
pub mod plot;
