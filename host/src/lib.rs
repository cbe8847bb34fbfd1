//! The real host cohabit drives.

pub mod spec;
