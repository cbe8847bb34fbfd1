//! The one float → integer rounding the workspace uses.

/// Rounds a non-negative float to the nearest whole number (`as` saturates: negative and
/// NaN become 0, huge values `u64::MAX`).
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
pub fn whole(x: f64) -> u64 {
    x.round() as u64
}

#[cfg(test)]
mod tests {
    use super::whole;

    #[test]
    fn whole_rounds_to_nearest_and_saturates() {
        assert_eq!(whole(2.5), 3);
        assert_eq!(whole(2.49), 2);
        assert_eq!(whole(-3.0), 0);
        assert_eq!(whole(f64::NAN), 0);
        assert_eq!(whole(1e300), u64::MAX);
    }
}
