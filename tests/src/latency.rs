//! What the benchmark programs record and print: latency histograms in
//! microseconds and their durations as text.

use std::time::Duration;

use hdrhistogram::Histogram;

/// An empty histogram from 1 µs to 10 min at 3 significant digits.
pub fn histogram() -> anyhow::Result<Histogram<u64>> {
    Ok(Histogram::new_with_bounds(1, 600_000_000, 3)?)
}

/// `d` in whole microseconds, at least 1 (the histogram's floor).
pub fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX).max(1)
}

/// `us` microseconds as `850 µs`, `1.25 ms` or `5.10 s`.
pub fn duration_text(us: u64) -> String {
    match us {
        0..1_000 => format!("{us} µs"),
        1_000..1_000_000 => format!("{:.2} ms", us as f64 / 1e3),
        _ => format!("{:.2} s", us as f64 / 1e6),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_print_in_the_unit_that_fits() {
        assert_eq!(duration_text(850), "850 µs");
        assert_eq!(duration_text(1_250), "1.25 ms");
        assert_eq!(duration_text(5_100_000), "5.10 s");
        assert_eq!(micros(Duration::ZERO), 1);
    }
}
