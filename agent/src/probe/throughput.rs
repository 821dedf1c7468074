//! How fast a backend has lately read prompts and turned its slots over,
//! from llama-server's cumulative counters: what routing weighs a lost cache
//! and a queue with. Pure: the poller passes the time in.

use std::collections::VecDeque;

/// llama-server's cumulative counters at one reading, and the requests the
/// proxy had finished through to it by then.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Counters {
    pub prompt_tokens: f64,
    pub prompt_seconds: f64,
    /// Seconds slots spent generating, summed over slots.
    pub predicted_seconds: f64,
    pub finished: u64,
}

/// The rates routing reads, as reported (`Backend` fields 12 and 13).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Rates {
    /// Prompt tokens per second a request is read at; 0: not known.
    pub prefill_tokens_per_second: f64,
    /// Slot time per finished request, ms; 0: not known.
    pub service_ms: u32,
}

/// Readings of the last [`WINDOW_MS`], and the rates last measured.
#[derive(Clone, Debug, Default)]
pub struct Throughput {
    readings: VecDeque<(u64, Counters)>,
    rates: Rates,
    /// Times the server's counters went back: it restarted, and its slots
    /// and host cache hold nothing of what they held.
    pub restarts: u64,
}

/// The span the rates are measured over: long enough to hold a few
/// requests of a slow model, short enough to follow a change of load.
pub const WINDOW_MS: u64 = 30_000;
/// Readings kept at most: 30 s of polls at 250 ms, and a poll interval of
/// a millisecond cannot make the window hold 30,000.
const MAX_READINGS: usize = 128;

impl Throughput {
    /// Takes a reading and returns the rates. Where nothing happened in the
    /// window the last rates stand: an idle backend keeps reporting the same
    /// figures, so its record is not rewritten for nothing; before any work
    /// in the window, the prompt rate is the server's since it started.
    pub fn observe(&mut self, at_ms: u64, now: Counters) -> Rates {
        let restarted = self.readings.back().is_some_and(|(_, last)| {
            now.prompt_tokens < last.prompt_tokens
                || now.prompt_seconds < last.prompt_seconds
                || now.predicted_seconds < last.predicted_seconds
        });
        if restarted {
            self.readings.clear();
            self.restarts += 1;
        }
        // The newest reading stays whatever its age: with a poll interval
        // longer than the window, rates are taken between two polls.
        while self.readings.len() > 1
            && self.readings.front().is_some_and(|(at, _)| at_ms.saturating_sub(*at) > WINDOW_MS)
        {
            self.readings.pop_front();
        }
        // However short the poll interval, the window holds a bounded number
        // of readings: the oldest kept is as good a start as any.
        if self.readings.len() >= MAX_READINGS {
            self.readings.pop_front();
        }
        let oldest = self.readings.front().map(|(_, c)| *c);
        self.readings.push_back((at_ms, now));
        let Some(oldest) = oldest else {
            if self.rates.prefill_tokens_per_second == 0.0 && now.prompt_seconds > 0.0 {
                self.rates.prefill_tokens_per_second = rate(now.prompt_tokens, now.prompt_seconds);
            }
            return self.rates;
        };
        let prompt_seconds = now.prompt_seconds - oldest.prompt_seconds;
        if prompt_seconds > 0.0 {
            self.rates.prefill_tokens_per_second = rate(now.prompt_tokens - oldest.prompt_tokens, prompt_seconds);
        } else if self.rates.prefill_tokens_per_second == 0.0 && now.prompt_seconds > 0.0 {
            self.rates.prefill_tokens_per_second = rate(now.prompt_tokens, now.prompt_seconds);
        }
        let finished = now.finished - oldest.finished;
        let slot_seconds = prompt_seconds + (now.predicted_seconds - oldest.predicted_seconds);
        if finished > 0 && slot_seconds > 0.0 {
            let ms = (slot_seconds * 1e3 / finished as f64).round();
            self.rates.service_ms = if ms.is_finite() { ms.clamp(1.0, f64::from(u32::MAX)) as u32 } else { 0 };
        }
        self.rates
    }

    /// The rates last measured: what a poll that could not read the
    /// counters reports.
    pub fn rates(&self) -> Rates {
        self.rates
    }
}

/// Whole tokens per second: a reading that moves by a fraction of a token
/// is not worth rewriting the node's record for.
fn rate(tokens: f64, seconds: f64) -> f64 {
    let r = (tokens / seconds).round();
    if r.is_finite() && r > 0.0 { r } else { 0.0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(prompt_tokens: f64, prompt_seconds: f64, predicted_seconds: f64, finished: u64) -> Counters {
        Counters { prompt_tokens, prompt_seconds, predicted_seconds, finished }
    }

    #[test]
    fn rates_follow_the_window_not_the_servers_lifetime() {
        let mut t = Throughput::default();
        // A server that read 100,000 tokens at 1,000/s before the agent came.
        let first = t.observe(0, at(100_000.0, 100.0, 50.0, 0));
        assert_eq!(first, Rates { prefill_tokens_per_second: 1_000.0, service_ms: 0 }, "since start, no service yet");
        // Now it reads at 100/s: 1,000 tokens in 10 s; 4 requests finished,
        // with 10 s of prompt and 2 s of generation between them.
        let busy = t.observe(10_000, at(101_000.0, 110.0, 52.0, 4));
        assert_eq!(busy, Rates { prefill_tokens_per_second: 100.0, service_ms: 3_000 });
        // Idle: nothing moves, the last rates stand.
        assert_eq!(t.observe(20_000, at(101_000.0, 110.0, 52.0, 4)), busy);
        // Past the window the slow readings are forgotten: a faster spell
        // alone decides.
        let later = t.observe(60_000, at(101_000.0, 110.0, 52.0, 4));
        assert_eq!(later, busy, "an empty window keeps the last rates");
        let fast = t.observe(65_000, at(106_000.0, 115.0, 53.0, 6));
        assert_eq!(fast, Rates { prefill_tokens_per_second: 1_000.0, service_ms: 3_000 });
    }

    #[test]
    fn the_window_holds_a_bounded_number_of_readings() {
        let mut t = Throughput::default();
        for i in 0..1_000u64 {
            t.observe(i, at(i as f64 * 10.0, i as f64 * 0.01, 0.0, 0));
        }
        assert_eq!(t.readings.len(), MAX_READINGS);
        assert_eq!(t.rates().prefill_tokens_per_second, 1_000.0);
    }

    #[test]
    fn a_restarted_server_starts_a_new_window() {
        let mut t = Throughput::default();
        t.observe(0, at(1_000.0, 1.0, 1.0, 10));
        t.observe(1_000, at(2_000.0, 2.0, 2.0, 12));
        // Counters went back: no negative rate, no underflow.
        assert_eq!(t.restarts, 0);
        let after = t.observe(2_000, at(50.0, 1.0, 0.0, 12));
        assert_eq!(t.restarts, 1);
        assert_eq!(after.prefill_tokens_per_second, 1_000.0, "the last rate stands until the new window has work");
        let next = t.observe(3_000, at(250.0, 2.0, 0.5, 13));
        assert_eq!(next, Rates { prefill_tokens_per_second: 200.0, service_ms: 1_500 });
    }
}
