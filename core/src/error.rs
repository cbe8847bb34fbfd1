use thiserror::Error;

/// A value that breaks an invariant of the vocabulary (a plan that does not fit the host,
/// a zero-sized host, a target of zero). The message names the offending field.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum CoreError {
    /// A field is outside its valid range.
    #[error("{field}: {problem}")]
    Invalid {
        /// Dotted path of the field, e.g. `host.cores` or `plan.memcached.llc_ways`.
        field: String,
        /// What is wrong with it, including the offending value.
        problem: String,
    },
}

impl CoreError {
    pub(crate) fn invalid(field: impl Into<String>, problem: impl Into<String>) -> Self {
        Self::Invalid {
            field: field.into(),
            problem: problem.into(),
        }
    }
}
