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

/// DESIGN.md's whole-forward tolerances: the argmax may flip only when one side's
/// top1 − top2 margin is at most this.
pub const LOGIT_NEAR_TIE: f32 = 1.0;
/// DESIGN.md: the full-vocab max logit difference must stay at most this.
pub const LOGIT_MAX_DIFF: f32 = 8.0;

/// Index of the largest value (the first on ties). Empty input gives 0.
fn argmax_first(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best
}

/// top1 − top2 of `v` (+∞ for fewer than two values).
fn top_margin(v: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &x in v {
        if x > a {
            b = a;
            a = x;
        } else if x > b {
            b = x;
        }
    }
    a - b
}

/// DESIGN.md's logit verdict for two logit vectors of one position (e.g. batched prefill vs
/// token-by-token decode): every value finite, max |a − b| ≤ [`LOGIT_MAX_DIFF`], and equal
/// argmax unless the top1 − top2 margin of either side is ≤ [`LOGIT_NEAR_TIE`].
/// `Err` says which rule failed, prefixed with `what`.
///
/// # Panics
/// If the lengths differ.
pub fn logit_verdict(reference: &[f32], other: &[f32], what: &str) -> Result<(), String> {
    assert_eq!(
        reference.len(),
        other.len(),
        "logit_verdict: lengths differ"
    );
    if let Some(i) = reference.iter().position(|v| !v.is_finite()) {
        return Err(format!("{what}: reference logit {i} is {}", reference[i]));
    }
    if let Some(i) = other.iter().position(|v| !v.is_finite()) {
        return Err(format!("{what}: logit {i} is {}", other[i]));
    }
    let diff = max_abs_diff(reference, other);
    if diff > LOGIT_MAX_DIFF as f64 {
        return Err(format!(
            "{what}: max logit difference {diff} > {LOGIT_MAX_DIFF}"
        ));
    }
    let (ra, oa) = (argmax_first(reference), argmax_first(other));
    if ra != oa {
        let (mr, mo) = (top_margin(reference), top_margin(other));
        if mr > LOGIT_NEAR_TIE && mo > LOGIT_NEAR_TIE {
            return Err(format!(
                "{what}: argmax {ra} vs {oa} with top1−top2 margins {mr} / {mo} (both > {LOGIT_NEAR_TIE})"
            ));
        }
    }
    Ok(())
}

/// [`logit_verdict`] on every row of two `[n_rows, n_vocab]` logit matrices; all failing rows
/// are reported, one line each.
pub fn logit_verdict_rows(
    reference: &[f32],
    other: &[f32],
    n_vocab: usize,
    what: &str,
) -> Result<(), String> {
    assert!(
        n_vocab > 0 && reference.len() == other.len() && reference.len().is_multiple_of(n_vocab),
        "logit_verdict_rows: {} and {} values are not rows of {n_vocab}",
        reference.len(),
        other.len()
    );
    let failures: Vec<String> = reference
        .chunks_exact(n_vocab)
        .zip(other.chunks_exact(n_vocab))
        .enumerate()
        .filter_map(|(row, (r, o))| logit_verdict(r, o, &format!("{what}, row {row}")).err())
        .collect();
    if failures.is_empty() {
        Ok(())
    } else {
        Err(failures.join("\n"))
    }
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

    #[test]
    fn logit_verdict_rules() {
        assert!(logit_verdict(&[0.0, 5.0, 1.0], &[0.0, 5.5, 1.0], "same argmax").is_ok());
        // Argmax flip on a near-tie (margin 0.5 on the reference side) passes.
        assert!(logit_verdict(&[4.5, 5.0, 0.0], &[5.2, 5.0, 0.0], "near tie").is_ok());
        // Argmax flip with both margins > 1 fails.
        let e = logit_verdict(&[0.0, 5.0, 0.0], &[6.5, 5.0, 0.0], "flip").unwrap_err();
        assert!(e.contains("argmax 1 vs 0"), "{e}");
        // Large difference away from the argmax fails.
        let e = logit_verdict(&[0.0, 5.0, 0.0], &[0.0, 5.0, -9.0], "diff").unwrap_err();
        assert!(e.contains("max logit difference 9"), "{e}");
        let e = logit_verdict(&[0.0, 1.0], &[f32::NAN, 1.0], "nan").unwrap_err();
        assert!(e.contains("NaN"), "{e}");
        let e = logit_verdict_rows(&[0.0, 1.0, 0.0, 1.0], &[0.0, 1.0, 0.0, 10.0], 2, "rows")
            .unwrap_err();
        assert!(e.contains("rows, row 1"), "{e}");
    }
}
