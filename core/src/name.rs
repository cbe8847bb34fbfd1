//! The one rule for service names and the group names made from them.
//!
//! A service's name becomes directory names on the host: its cgroup (`lc-<name>`) and its
//! resctrl group (`cohabit-<name>`), under prefixes of at most [`GROUP_PREFIX_MAX`]
//! characters. So a group name may be [`GROUP_NAME_MAX`] (64) characters, and a service name
//! is held to [`SERVICE_NAME_MAX`] (48), the 64 less room for any prefix: the shorter limit
//! is the one an operator meets, and every name that passes it is a valid group name once
//! prefixed. Both take the same portable characters: ASCII letters, digits, `.`, `_`, `-`,
//! not starting with `.` (no `/`, so no escaping the hierarchy; no `.`/`..`).

/// The longest service name: [`GROUP_NAME_MAX`] less [`GROUP_PREFIX_MAX`].
pub const SERVICE_NAME_MAX: usize = GROUP_NAME_MAX - GROUP_PREFIX_MAX;
/// The longest prefix the host puts before a service name in a group name.
pub const GROUP_PREFIX_MAX: usize = 16;
/// The longest group name (cgroup or resctrl directory) cohabit makes or accepts; the
/// kernel allows more, this keeps names readable.
pub const GROUP_NAME_MAX: usize = 64;

/// What is wrong with a name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    /// No characters.
    #[error("a name cannot be empty")]
    Empty,
    /// More characters than the limit.
    #[error("{name:?} has {len} characters, more than {max}")]
    TooLong {
        /// The name.
        name: String,
        /// Its length in bytes (ASCII: characters).
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A character outside `[A-Za-z0-9._-]`.
    #[error("{name:?} contains {bad:?}; use only [A-Za-z0-9._-]")]
    Character {
        /// The name.
        name: String,
        /// The first bad character.
        bad: char,
    },
    /// A leading `.` (hidden files, `.` and `..`).
    #[error("{name:?} starts with '.'")]
    LeadingDot {
        /// The name.
        name: String,
    },
}

/// Checks a service's name (the configuration's, or one made from a pod).
pub fn check_service_name(name: &str) -> Result<(), NameError> {
    check(name, SERVICE_NAME_MAX)
}

/// Checks a group (directory) name cohabit makes.
pub fn check_group_name(name: &str) -> Result<(), NameError> {
    check(name, GROUP_NAME_MAX)
}

fn check(name: &str, max: usize) -> Result<(), NameError> {
    if name.is_empty() {
        return Err(NameError::Empty);
    }
    if let Some(bad) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')))
    {
        return Err(NameError::Character {
            name: name.to_string(),
            bad,
        });
    }
    if name.starts_with('.') {
        return Err(NameError::LeadingDot {
            name: name.to_string(),
        });
    }
    if name.len() > max {
        return Err(NameError::TooLong {
            name: name.to_string(),
            len: name.len(),
            max,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_service_name_of_48_portable_characters_passes_and_one_more_does_not() {
        let longest = "a".repeat(SERVICE_NAME_MAX);
        assert_eq!(SERVICE_NAME_MAX, 48);
        check_service_name(&longest).unwrap();
        check_service_name("shop.memcached-1_a").unwrap();
        assert_eq!(
            check_service_name(&format!("{longest}a")),
            Err(NameError::TooLong {
                name: format!("{longest}a"),
                len: 49,
                max: 48
            })
        );
    }

    #[test]
    fn every_valid_service_name_is_a_valid_group_name_under_any_prefix() {
        let longest = "a".repeat(SERVICE_NAME_MAX);
        for prefix in ["lc-", "cohabit-", &"p".repeat(GROUP_PREFIX_MAX)] {
            check_group_name(&format!("{prefix}{longest}")).unwrap();
        }
        assert!(check_group_name(&"a".repeat(GROUP_NAME_MAX + 1)).is_err());
    }

    #[test]
    fn names_that_could_escape_or_hide_are_refused_by_their_problem() {
        assert_eq!(check_service_name(""), Err(NameError::Empty));
        for (name, bad) in [("a/b", '/'), ("a b", ' '), ("ü", 'ü'), ("a\n", '\n')] {
            assert_eq!(
                check_group_name(name),
                Err(NameError::Character {
                    name: name.into(),
                    bad
                })
            );
        }
        for name in [".", "..", ".hidden"] {
            assert_eq!(
                check_service_name(name),
                Err(NameError::LeadingDot { name: name.into() })
            );
        }
    }
}
