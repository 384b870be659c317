//! Metric label values, shared by the edge filter's stats and the arbiter's
//! Prometheus metrics (ADR-22): namespace and class only, never a key, an
//! identity or a token.
//!
//! The namespace is the first segment of the *granted prefix* that let the
//! call in, so it ranges over the grant table rather than over what callers
//! send; the class is a known class name. Both are sanitised to
//! `[A-Za-z0-9_-]` and bounded in length.

/// The longest label value this produces.
pub const MAX_LABEL_CHARS: usize = 48;

/// A label value: `[A-Za-z0-9_-]`, at most [`MAX_LABEL_CHARS`], never empty.
pub fn metric_label(raw: &str) -> String {
    let mut out: String = raw
        .chars()
        .take(MAX_LABEL_CHARS)
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if out.is_empty() {
        out.push('_');
    }
    out
}

/// The namespace label of a call authorised by `granted_prefix`.
pub fn metric_namespace(granted_prefix: &str) -> String {
    let ns = granted_prefix.split('/').next().unwrap_or(granted_prefix);
    metric_label(ns)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_sanitised_and_bounded() {
        assert_eq!(metric_label("payments-ledger"), "payments-ledger");
        assert_eq!(metric_label("a.b c"), "a_b_c");
        assert_eq!(metric_label(""), "_");
        assert_eq!(metric_label(&"x".repeat(100)).len(), MAX_LABEL_CHARS);
    }

    #[test]
    fn the_namespace_is_the_first_segment_of_the_granted_prefix() {
        assert_eq!(metric_namespace("payments/ledger"), "payments");
        assert_eq!(metric_namespace("demo"), "demo");
    }
}
