//! Users and groups: a configured name or number turned into a uid or gid.
//!
//! Names go through the C library's NSS lookup (`getpwnam_r`, `getgrnam_r`, through `nix`),
//! so `/etc/passwd`, LDAP or systemd's dynamic users all work. A number is taken as it is,
//! without a lookup: a uid needs no entry to own processes or files.

/// A user as written in a configuration: a name or a uid.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum UserRef {
    /// A numeric uid.
    Id(u32),
    /// A user name, looked up when resolved.
    Name(String),
}

/// A group as written in a configuration: a name or a gid.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum GroupRef {
    /// A numeric gid.
    Id(u32),
    /// A group name, looked up when resolved.
    Name(String),
}

/// Why a user or group could not be resolved.
#[derive(Debug, thiserror::Error)]
pub enum UserError {
    /// No such user or group.
    #[error("no {kind} named {name:?} on this host")]
    Unknown {
        /// `user` or `group`.
        kind: &'static str,
        /// The name.
        name: String,
    },
    /// The lookup itself failed.
    #[error("looking up {kind} {name:?}: {source}")]
    Lookup {
        /// `user` or `group`.
        kind: &'static str,
        /// The name.
        name: String,
        /// The C library's error.
        source: nix::Error,
    },
}

impl std::fmt::Display for UserRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            UserRef::Id(id) => write!(f, "uid {id}"),
            UserRef::Name(n) => write!(f, "user {n}"),
        }
    }
}

impl std::fmt::Display for GroupRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GroupRef::Id(id) => write!(f, "gid {id}"),
            GroupRef::Name(n) => write!(f, "group {n}"),
        }
    }
}

impl UserRef {
    /// The uid.
    pub fn resolve(&self) -> Result<u32, UserError> {
        match self {
            UserRef::Id(id) => Ok(*id),
            UserRef::Name(name) => nix::unistd::User::from_name(name)
                .map_err(|source| UserError::Lookup {
                    kind: "user",
                    name: name.clone(),
                    source,
                })?
                .map(|u| u.uid.as_raw())
                .ok_or_else(|| UserError::Unknown {
                    kind: "user",
                    name: name.clone(),
                }),
        }
    }
}

impl GroupRef {
    /// The gid.
    pub fn resolve(&self) -> Result<u32, UserError> {
        match self {
            GroupRef::Id(id) => Ok(*id),
            GroupRef::Name(name) => nix::unistd::Group::from_name(name)
                .map_err(|source| UserError::Lookup {
                    kind: "group",
                    name: name.clone(),
                    source,
                })?
                .map(|g| g.gid.as_raw())
                .ok_or_else(|| UserError::Unknown {
                    kind: "group",
                    name: name.clone(),
                }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_resolves_by_name_and_numbers_need_no_entry() {
        assert_eq!(UserRef::Name("root".into()).resolve().unwrap(), 0);
        assert_eq!(GroupRef::Name("root".into()).resolve().unwrap(), 0);
        assert_eq!(UserRef::Id(4_000_123).resolve().unwrap(), 4_000_123);
        let e = UserRef::Name("no-such-user-cohabit".into())
            .resolve()
            .unwrap_err()
            .to_string();
        assert!(e.contains("no user named \"no-such-user-cohabit\""), "{e}");
    }
}
