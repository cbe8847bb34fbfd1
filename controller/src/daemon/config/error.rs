//! What is wrong with a configuration: the field, as its dotted TOML path, and the problem,
//! as a kind with its details.

use std::fmt;

/// A configuration that failed to load: where it came from, the field and the problem.
///
/// `field` is the TOML path (`interval_ms`, `host.cpus`, `service[2].latency.push`; empty
/// for the text as a whole); a field inside a `[[service]]` or `[[best_effort]]` is shown
/// to people by the item's name (`service kv: latency.push …`), as they wrote it.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigError {
    /// Where the text came from: the file (or a pod's annotation); empty until known.
    pub path: String,
    /// The dotted TOML path of the field.
    pub field: String,
    /// The name of the `[[service]]` or `[[best_effort]]` the field is in, if it has one.
    pub item: Option<String>,
    /// What is wrong.
    pub problem: Problem,
}

/// The kinds of problem, with their details.
#[derive(Debug, Clone, PartialEq)]
pub enum Problem {
    /// The file cannot be read, or is not TOML (the reader's or parser's words).
    Unreadable(String),
    /// A key the table does not have; what it does have.
    UnknownKey {
        /// The keys the table takes (`` `a`, `b` ``).
        expected: String,
    },
    /// A value of the wrong TOML type, or not one of the words the key takes (serde's
    /// words: ``unknown variant `lc`, expected `shared` or `pool` ``).
    WrongType(String),
    /// A key that must be given is not; what needs it.
    Missing(String),
    /// A number outside its bounds.
    OutOfRange {
        /// The least allowed (`-inf`: not bounded below).
        min: f64,
        /// The most allowed (`inf`: not bounded above).
        max: f64,
        /// The value given.
        got: f64,
        /// What the bounds count, or why they are there (` control intervals`).
        note: &'static str,
    },
    /// Keys, or services, that do not go together, and why.
    Conflict(String),
    /// A value of the right type that cannot be used, and why (starting with the value).
    Invalid(String),
}

impl ConfigError {
    /// `problem` at `field` (a path relative to wherever the caller is; see [`Self::within`]).
    pub fn new(field: impl Into<String>, problem: Problem) -> Self {
        Self {
            path: String::new(),
            field: field.into(),
            item: None,
            problem,
        }
    }

    /// [`Problem::Invalid`] at `field`.
    pub(super) fn invalid(field: impl Into<String>, why: impl Into<String>) -> Self {
        Self::new(field, Problem::Invalid(why.into()))
    }

    /// [`Problem::Conflict`] at `field`.
    pub(super) fn conflict(field: impl Into<String>, why: impl Into<String>) -> Self {
        Self::new(field, Problem::Conflict(why.into()))
    }

    /// [`Problem::Missing`] at `field`.
    pub(super) fn missing(field: impl Into<String>, why: impl Into<String>) -> Self {
        Self::new(field, Problem::Missing(why.into()))
    }

    /// [`Problem::OutOfRange`] at `field`: `got` is not in `min..=max` (`None`: unbounded).
    pub(super) fn range(
        field: impl Into<String>,
        min: Option<f64>,
        max: Option<f64>,
        got: f64,
    ) -> Self {
        Self::new(
            field,
            Problem::OutOfRange {
                min: min.unwrap_or(f64::NEG_INFINITY),
                max: max.unwrap_or(f64::INFINITY),
                got,
                note: "",
            },
        )
    }

    /// The same, with what the bounds count or why they are there.
    pub(super) fn noted(mut self, text: &'static str) -> Self {
        if let Problem::OutOfRange { note, .. } = &mut self.problem {
            *note = text;
        }
        self
    }

    /// The same error seen from the table that holds `prefix`: `latency.push` within
    /// `service[2]` is `service[2].latency.push`.
    pub(super) fn within(mut self, prefix: &str) -> Self {
        self.field = match self.field.as_str() {
            "" => prefix.to_string(),
            f if f.starts_with('[') => format!("{prefix}{f}"),
            f => format!("{prefix}.{f}"),
        };
        self
    }

    /// The same error, inside the `[[service]]` or `[[best_effort]]` called `name`.
    pub(super) fn in_item(mut self, name: &str) -> Self {
        self.item = Some(name.to_string());
        self
    }

    /// The same error, in the text that came from `path`.
    pub(super) fn in_file(mut self, path: &str) -> Self {
        self.path = path.to_string();
        self
    }

    /// A serde error from reading a TOML value into a table's struct, at `prefix`: serde
    /// says what went wrong, toml which keys it had gone down (the `in `a.b`` line it adds
    /// to a value's error, which has no place in the text to point at).
    pub(super) fn from_toml(prefix: &str, e: &toml::de::Error) -> Self {
        let message = e.message();
        let keys = e
            .to_string()
            .lines()
            .find_map(|l| {
                l.strip_prefix("in `")?
                    .strip_suffix('`')
                    .map(str::to_string)
            })
            .unwrap_or_default();
        let named = |what: &str| {
            message
                .strip_prefix(what)?
                .strip_prefix('`')?
                .split_once('`')
                .map(|(key, rest)| (key.to_string(), rest.trim_start_matches(", ").to_string()))
        };
        let (key, problem) = if let Some((key, expected)) = named("unknown field ") {
            (Some(key), Problem::UnknownKey { expected })
        } else if let Some((key, _)) = named("missing field ") {
            (Some(key), Problem::Missing(String::new()))
        } else {
            (None, Problem::WrongType(message.to_string()))
        };
        let field = [prefix, &keys, key.as_deref().unwrap_or_default()]
            .iter()
            .filter(|k| !k.is_empty())
            .copied()
            .collect::<Vec<_>>()
            .join(".");
        Self::new(field, problem)
    }
}

impl std::error::Error for ConfigError {}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.path.is_empty() {
            write!(f, "{}: ", self.path)?;
        }
        // `service[2].latency.push` in the service called kv reads `service kv: latency.push`.
        let field = match &self.item {
            Some(name) => {
                let (list, rest) = self.field.split_once('.').unwrap_or((&self.field, ""));
                let list = list.split('[').next().unwrap_or(list);
                write!(f, "{list} {name}: ")?;
                rest
            }
            None => self.field.as_str(),
        };
        self.problem.describe(field, f)
    }
}

impl Problem {
    /// The problem as a sentence about `field`: `field problem`, or `field: problem` where
    /// the problem is another parser's words.
    fn describe(&self, field: &str, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (phrase, quote) = if field.is_empty() {
            (String::new(), String::new())
        } else {
            (format!("{field} "), format!("{field}: "))
        };
        match self {
            Problem::Unreadable(why) | Problem::WrongType(why) => write!(f, "{quote}{why}"),
            Problem::UnknownKey { expected } => write!(f, "{quote}unknown field, {expected}"),
            Problem::Missing(why) if why.is_empty() => write!(f, "{phrase}is missing"),
            Problem::Missing(why) | Problem::Conflict(why) | Problem::Invalid(why) => {
                write!(f, "{phrase}{why}")
            }
            Problem::OutOfRange {
                min,
                max,
                got,
                note,
            } => {
                write!(f, "{phrase}must be ")?;
                match (min.is_finite(), max.is_finite()) {
                    (true, true) => write!(f, "between {min} and {max}")?,
                    (true, false) => write!(f, "at least {min}")?,
                    (false, true) => write!(f, "at most {max}")?,
                    (false, false) => write!(f, "a number")?,
                }
                write!(f, "{note}, got {got}")
            }
        }
    }
}
