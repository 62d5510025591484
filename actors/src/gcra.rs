//! The generic cell rate algorithm on one bucket.
//!
//! A bucket is nothing but its theoretical arrival time (TAT, unix µs). A charge of
//! `increment` against `capacity` (both µs) is admitted when the TAT it would
//! produce is no further than `capacity` past now; the bucket is full again once
//! its TAT is in the past. This is the formulation the contract's ETS limiter uses:
//! at most `capacity / increment` charges in a burst, one per `increment` after.

/// The outcome of one charge that was not applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Denied {
    /// Microseconds until this charge would be admitted.
    pub retry_after_us: u64,
}

/// The TAT this charge produces, or how long until it would be admitted.
///
/// Pure: the caller decides whether to store the new TAT (all-or-nothing hits
/// evaluate every charge before writing any).
pub fn charge(
    tat_us: u64,
    now_us: u64,
    increment_us: u64,
    capacity_us: u64,
) -> Result<u64, Denied> {
    let new_tat = tat_us.max(now_us).saturating_add(increment_us);
    let limit = now_us.saturating_add(capacity_us);
    if new_tat <= limit {
        Ok(new_tat)
    } else {
        Err(Denied {
            retry_after_us: new_tat - limit,
        })
    }
}

/// A bucket is full (forgettable) once its TAT is not in the future.
pub fn is_full(tat_us: u64, now_us: u64) -> bool {
    tat_us <= now_us
}

/// Microseconds to whole milliseconds for a retry hint: rounded up, never 0, so a
/// sender that waits the hint is never told to wait again for the same reason.
pub fn retry_ms(us: u64) -> u64 {
    us.div_ceil(1000).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn burst_of_capacity_over_increment_then_one_per_increment() {
        let (inc, cap, now) = (100, 1_000, 1_000_000);
        let mut tat = 0;
        for _ in 0..10 {
            tat = charge(tat, now, inc, cap).expect("within burst");
        }
        assert_eq!(
            charge(tat, now, inc, cap),
            Err(Denied {
                retry_after_us: 100
            })
        );
        assert!(charge(tat, now + 99, inc, cap).is_err());
        assert!(charge(tat, now + 100, inc, cap).is_ok());
    }

    #[test]
    fn denied_charge_reports_exact_wait() {
        let tat = charge(0, 0, 600, 1_000).unwrap();
        let denied = charge(tat, 0, 600, 1_000).unwrap_err();
        assert_eq!(denied.retry_after_us, 200);
        assert!(charge(tat, 199, 600, 1_000).is_err());
        assert!(charge(tat, 200, 600, 1_000).is_ok());
    }

    #[test]
    fn full_bucket_and_retry_rounding() {
        assert!(is_full(10, 10));
        assert!(!is_full(11, 10));
        assert_eq!(retry_ms(0), 1);
        assert_eq!(retry_ms(1), 1);
        assert_eq!(retry_ms(1000), 1);
        assert_eq!(retry_ms(1001), 2);
    }

    #[test]
    fn saturates_instead_of_overflowing() {
        assert!(charge(u64::MAX - 1, u64::MAX - 1, u64::MAX, u64::MAX).is_ok());
        assert!(charge(u64::MAX, 0, 10, 10).is_err());
    }
}
