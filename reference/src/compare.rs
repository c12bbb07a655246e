//! Error measures for comparing an output against a reference (DESIGN.md "Numerics").

/// ‖a − b‖₂ / ‖b‖₂ in f64, `b` being the reference. Returns +∞ if any value of either side is
/// NaN or infinite (so a NaN never passes a `<= tol` check), and if `b = 0` while `a ≠ b`.
///
/// # Panics
/// If the lengths differ.
pub fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "rel_err: lengths differ");
    if a.iter().chain(b).any(|v| !v.is_finite()) {
        return f64::INFINITY;
    }
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&x, &y) in a.iter().zip(b) {
        let d = x as f64 - y as f64;
        num += d * d;
        den += y as f64 * y as f64;
    }
    if num == 0.0 {
        0.0
    } else if den == 0.0 {
        f64::INFINITY
    } else {
        (num / den).sqrt()
    }
}

/// max |a_i − b_i|; +∞ if any value is NaN or infinite.
///
/// # Panics
/// If the lengths differ.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "max_abs_diff: lengths differ");
    let mut m = 0.0f64;
    for (&x, &y) in a.iter().zip(b) {
        if !x.is_finite() || !y.is_finite() {
            return f64::INFINITY;
        }
        m = m.max((x as f64 - y as f64).abs());
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rel_err_basics() {
        assert_eq!(rel_err(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        assert!((rel_err(&[3.0, 4.0], &[0.0, 0.0])).is_infinite());
        assert!((rel_err(&[f32::NAN], &[1.0])).is_infinite());
        assert!((rel_err(&[1.1, 0.0], &[1.0, 0.0]) - 0.1).abs() < 1e-6);
        assert!((max_abs_diff(&[1.0, 5.0], &[1.5, 4.0]) - 1.0).abs() < 1e-12);
    }
}
