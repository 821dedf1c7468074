//! Jittered exponential backoff, for every loop that reconnects or retries
//! (an agent's stream to a controller, a data plane's snapshot stream, a
//! controller's etcd watches, peers and writes).

use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// Waits that double from `min` to `max`, each drawn between half and one
/// and a half times its step, so that many clients which lost the same
/// server do not come back at the same instant.
#[derive(Clone, Debug)]
pub struct Backoff {
    min: Duration,
    max: Duration,
    step: Duration,
}

/// What every reconnection loop waits: from 100 ms to 2 s (controllers
/// wait `startup_grace_ms` for agents after a start, which this fits
/// well inside).
pub const RECONNECT: Backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));

impl Backoff {
    /// `min` above zero (a loop that waits nothing spins) and at most
    /// `max`.
    pub const fn new(min: Duration, max: Duration) -> Backoff {
        assert!(!min.is_zero() && min.as_nanos() <= max.as_nanos(), "backoff from more than zero to at least that");
        Backoff { min, max, step: min }
    }

    /// The next wait; the step after it doubles, up to the maximum.
    pub fn next_wait(&mut self) -> Duration {
        let wait = self.step.mul_f64(0.5 + fastrand::f64());
        self.step = self.step.saturating_mul(2).min(self.max);
        wait
    }

    /// Back to the shortest wait, after a success.
    pub fn reset(&mut self) {
        self.step = self.min;
    }

    /// Sleeps the next wait; true where `shutdown` came first.
    pub async fn sleep(&mut self, shutdown: &CancellationToken) -> bool {
        let wait = self.next_wait();
        tokio::select! {
            () = shutdown.cancelled() => true,
            () = tokio::time::sleep(wait) => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_double_up_to_the_maximum_with_jitter_and_start_over_after_a_reset() {
        let (min, max) = (Duration::from_millis(100), Duration::from_millis(800));
        let mut backoff = Backoff::new(min, max);
        let steps = [100u64, 200, 400, 800, 800, 800];
        for step in steps {
            let wait = backoff.next_wait();
            let step = Duration::from_millis(step);
            assert!(wait >= step / 2 && wait < step * 3 / 2, "{wait:?} for a step of {step:?}");
        }
        backoff.reset();
        assert!(backoff.next_wait() < Duration::from_millis(150));
    }

    #[test]
    fn waits_are_not_all_the_same() {
        let mut a = Backoff::new(Duration::from_secs(1), Duration::from_secs(1));
        let waits: std::collections::BTreeSet<_> = (0..20).map(|_| a.next_wait()).collect();
        assert!(waits.len() > 10, "jittered: {waits:?}");
    }
}
