//! Log lines that would repeat for every request while something stays
//! wrong (a node refusing, failovers), let through at most once per
//! [`EVERY`] per call site, with a count of those held back.

use std::sync::LazyLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How often one call site's repeated event is logged at most.
pub const EVERY: Duration = Duration::from_secs(10);

/// One call site's gate (or one node's, or one backend's).
#[derive(Debug)]
pub struct Gate {
    /// Milliseconds since [`START`] plus one of the last event let
    /// through; 0 for none yet.
    last: AtomicU64,
    held_back: AtomicU64,
}

static START: LazyLock<Instant> = LazyLock::new(Instant::now);

impl Gate {
    pub const fn new() -> Gate {
        Gate { last: AtomicU64::new(0), held_back: AtomicU64::new(0) }
    }

    /// `Some(held_back)` where an event may be logged now (at most one per
    /// `every`), with the count of those held back since the last; else
    /// `None`, and this one is counted as held back.
    pub fn pass(&self, every: Duration) -> Option<u64> {
        self.pass_at(u64::try_from(START.elapsed().as_millis()).unwrap_or(u64::MAX - 1) + 1, every)
    }

    fn pass_at(&self, now: u64, every: Duration) -> Option<u64> {
        let every = u64::try_from(every.as_millis()).unwrap_or(u64::MAX);
        let last = self.last.load(Ordering::Relaxed);
        let due = last == 0 || now.saturating_sub(last) >= every;
        if due && self.last.compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed).is_ok() {
            return Some(self.held_back.swap(0, Ordering::Relaxed));
        }
        self.held_back.fetch_add(1, Ordering::Relaxed);
        None
    }
}

impl Default for Gate {
    fn default() -> Gate {
        Gate::new()
    }
}

#[doc(hidden)]
pub use tracing as __tracing;

/// `tracing::warn!`, at most once per [`log::EVERY`](crate::log::EVERY)
/// from this call site (or, with `gate: G;` first, per [`Gate`] `G`: one
/// per node, say, so that one node's failures do not hold back another's).
/// The line carries `held_back`, how many were not logged since the last;
/// those go out at debug level.
#[macro_export]
macro_rules! warn_every {
    ($($event:tt)+) => { $crate::__log_every!(warn, $($event)+) };
}

/// `tracing::error!`, as [`warn_every!`].
#[macro_export]
macro_rules! error_every {
    ($($event:tt)+) => { $crate::__log_every!(error, $($event)+) };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __log_every {
    ($level:ident, gate: $gate:expr; $($event:tt)+) => {{
        match $gate.pass($crate::log::EVERY) {
            Some(held_back) => $crate::log::__tracing::$level!(held_back, $($event)+),
            None => $crate::log::__tracing::debug!($($event)+),
        }
    }};
    ($level:ident, $($event:tt)+) => {{
        static GATE: $crate::log::Gate = $crate::log::Gate::new();
        $crate::__log_every!($level, gate: GATE; $($event)+)
    }};
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_event_per_interval_goes_out_with_a_count_of_those_held_back() {
        let gate = Gate::new();
        let every = Duration::from_secs(10);
        assert_eq!(gate.pass_at(1, every), Some(0), "the first goes out");
        assert_eq!(gate.pass_at(2, every), None);
        assert_eq!(gate.pass_at(9_000, every), None);
        assert_eq!(gate.pass_at(10_001, every), Some(2), "then one per interval, saying how many were not");
        assert_eq!(gate.pass_at(10_002, every), None);
        assert_eq!(gate.pass_at(30_000, every), Some(1));
    }
}
