//! What sending a request to one candidate costs: its expected time to
//! first token, in named terms, from explicit inputs. Pure, and the only
//! place the weights live. Routing compares candidates by these terms, and
//! each decision keeps every target's terms, so "why node B and not A" is
//! answered by reading them (`inferyesctl explain`).
//!
//! ```text
//! cost = wait + prefill + carry + move
//!   wait    = requests ahead of it × service time / slots
//!   prefill = (prompt − cached) / prompt rate
//!   carry   = CARRY_FIXED + cached / CARRY_RATE      where its cache is carried there
//!   move    = MOVE_GAIN                              where it leaves its cache's node
//! ```
//!
//! The seconds are compared within a candidate's [`Standing`], never
//! across: a cold load's time is not estimated (loads take from seconds to
//! minutes), so a cold node is taken only where no warm one is admitted,
//! and a node held out after failures only where nothing else is.

/// Weights, in one place.
///
/// What a move must save, at least. Reports are up to a poll interval (1 s
/// by default) old: a home that looks busy may hold only this session's
/// previous turn, just ended, and a smaller gain is within that error.
pub const MOVE_GAIN_SECONDS: f64 = 1.0;
/// What carrying a conversation's cache from its home to another node
/// costs: the home's server saves its slot, its agent sends the file, the
/// other's restores it. Measured on the real model (Gemma 3 270M, 8.2 MB a
/// 1,000 tokens, two agents on one host): 90-150 ms for 1,500 tokens; such
/// a file crosses a 10 Gb/s link at about 150,000 tokens a second. Erring
/// long: `docs/routing.md` has the figures.
pub const CARRY_FIXED_SECONDS: f64 = 0.1;
pub const CARRY_TOKENS_PER_SECOND: f64 = 20_000.0;

/// Where a candidate would take the prompt's cached tokens from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Cache {
    /// Nowhere: the whole prompt is read.
    #[default]
    None,
    /// The session's slot on this node, or its server's host cache.
    Resident,
    /// The session's home, whose agent carries the slot here first.
    Carried,
}

/// What a candidate is to the request, compared before its seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Standing {
    /// Holds the session's cache; admitted up to the hard memory limit.
    Resident,
    /// Has the model loaded (or possibly loaded).
    #[default]
    Warm,
    /// Must load the model first.
    Cold,
    /// Failed lately: a last resort.
    Ejected,
}

/// Everything one candidate's seconds are computed from.
#[derive(Clone, Copy, Debug)]
pub struct Inputs {
    pub prompt_tokens: u32,
    /// Of them, those already in a cache the candidate reads from.
    pub cached_tokens: u32,
    pub cache: Cache,
    /// Requests that must leave a slot before this one gets one.
    pub queue_ahead: u32,
    /// The backend's slots (0: not known, taken for one).
    pub slots: u32,
    /// Seconds a request holds a slot there.
    pub service_seconds: f64,
    /// Prompt tokens read a second there; never zero.
    pub prefill_tokens_per_second: f64,
    /// The session's cache is on another node: going here leaves it.
    pub leaves_home: bool,
}

/// One candidate's cost, term by term, in seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Estimate {
    pub wait: f64,
    pub prefill: f64,
    pub carry: f64,
    pub moving: f64,
}

impl Estimate {
    /// The expected time to first token, the gain a move must bring included.
    pub fn seconds(&self) -> f64 {
        self.wait + self.prefill + self.carry + self.moving
    }

    /// The expected time to first token itself.
    pub fn ttft(&self) -> f64 {
        self.wait + self.prefill + self.carry
    }
}

/// The cost of `inputs`: the wait for a slot (a slot freeing every service
/// time over slots), the prompt not cached at the prompt rate, the carry
/// of the cached part where it is carried, and the gain asked of a move.
pub fn estimate(inputs: &Inputs) -> Estimate {
    let cached = if inputs.cache == Cache::None { 0 } else { inputs.cached_tokens };
    Estimate {
        wait: f64::from(inputs.queue_ahead) * inputs.service_seconds / f64::from(inputs.slots.max(1)),
        prefill: f64::from(inputs.prompt_tokens.saturating_sub(cached)) / inputs.prefill_tokens_per_second,
        carry: if inputs.cache == Cache::Carried { carry_seconds(cached) } else { 0.0 },
        moving: if inputs.leaves_home { MOVE_GAIN_SECONDS } else { 0.0 },
    }
}

/// What carrying `tokens` of a session's cache to another node costs.
pub fn carry_seconds(tokens: u32) -> f64 {
    CARRY_FIXED_SECONDS + f64::from(tokens) / CARRY_TOKENS_PER_SECOND
}

/// The least any node other than its home can cost a session of `prompt`
/// tokens, `tokens` of them cached at home: reading the prompt at the
/// fleet's fastest rate with no wait, or having the cache carried (`carry`:
/// whether its slots can be), plus the gain a move must bring. A home
/// cheaper than this keeps its session without a look at the others.
pub fn least_elsewhere(prompt: u32, tokens: u32, fastest_prefill_tokens_per_second: f64, carry: bool) -> f64 {
    let read = f64::from(prompt) / fastest_prefill_tokens_per_second;
    let carried = if carry { carry_seconds(tokens) } else { f64::MAX };
    read.min(carried) + MOVE_GAIN_SECONDS
}

/// The most sessions a node may hold after taking a new one: `factor`
/// times the average of `sessions` over `placements` (the new one
/// counted), plus one: at small loads the bare bound would refuse a home
/// holding a single session, and placements would flip between turns and
/// between data planes as the counts move.
pub fn load_bound(factor: f64, sessions: u64, placements: u64) -> f64 {
    (factor * (sessions + 1) as f64 / placements.max(1) as f64).ceil() + 1.0
}

/// Whether a new session would put a node holding `sessions` over `bound`.
pub fn over_bound(sessions: u32, bound: f64) -> bool {
    f64::from(sessions) + 1.0 > bound
}

/// One candidate's terms as a decision keeps them: whole milliseconds and
/// counts, small and comparable, for reports, headers and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Terms {
    pub standing: Standing,
    pub prompt_tokens: u32,
    pub cached_tokens: u32,
    pub cache: Cache,
    pub queue_ahead: u32,
    pub wait_ms: u32,
    pub prefill_ms: u32,
    pub carry_ms: u32,
    /// The gain asked of a session to leave its cache's node.
    pub move_ms: u32,
    /// Wait, prefill and carry together, rounded once; 0 for a cold load,
    /// whose time is not estimated.
    pub ttft_ms: u32,
    /// Sessions a new one is balanced against there: those resident, and
    /// this data plane's requests in flight.
    pub sessions: u32,
    /// Taking a new session would put the node over the fleet's load bound.
    pub over_bound: bool,
    /// The new session's own node by rendezvous hash: where every data
    /// plane places it unless its load or queue says otherwise.
    pub preferred: bool,
    /// The fullest GPU's memory in use, per mille.
    pub memory_permille: u32,
}

impl Terms {
    /// The terms of `estimate` for `inputs`, with the candidate's standing
    /// and load beside them.
    pub fn of(inputs: &Inputs, estimate: &Estimate, standing: Standing) -> Terms {
        Terms {
            standing,
            prompt_tokens: inputs.prompt_tokens,
            cached_tokens: if inputs.cache == Cache::None { 0 } else { inputs.cached_tokens.min(inputs.prompt_tokens) },
            cache: inputs.cache,
            queue_ahead: inputs.queue_ahead,
            wait_ms: millis(estimate.wait),
            prefill_ms: millis(estimate.prefill),
            carry_ms: millis(estimate.carry),
            move_ms: millis(estimate.moving),
            ttft_ms: if standing == Standing::Cold { 0 } else { millis(estimate.ttft()) },
            ..Terms::default()
        }
    }

    /// These terms as a decision record carries them, its node named.
    pub fn to_wire(&self, node_id: String, backend_id: String) -> inferyes_proto::v1::Candidate {
        use inferyes_proto::v1::{CacheSource, Standing as Wire};
        let standing = match self.standing {
            Standing::Resident => Wire::Resident,
            Standing::Warm => Wire::Warm,
            Standing::Cold => Wire::Cold,
            Standing::Ejected => Wire::Ejected,
        };
        let cache = match self.cache {
            Cache::None => CacheSource::None,
            Cache::Resident => CacheSource::Resident,
            Cache::Carried => CacheSource::Carried,
        };
        inferyes_proto::v1::Candidate {
            node_id,
            standing: standing as i32,
            prompt_tokens: self.prompt_tokens,
            cached_tokens: self.cached_tokens,
            cache: cache as i32,
            queue_ahead: self.queue_ahead,
            wait_ms: self.wait_ms,
            prefill_ms: self.prefill_ms,
            carry_ms: self.carry_ms,
            move_ms: self.move_ms,
            ttft_ms: self.ttft_ms,
            cost_ms: self.cost_ms(),
            sessions: self.sessions,
            over_bound: self.over_bound,
            preferred: self.preferred,
            memory_permille: self.memory_permille,
            backend_id,
            passed_over: false,
        }
    }

    /// The whole cost, in ms.
    pub fn cost_ms(&self) -> u32 {
        self.ttft_ms.saturating_add(self.move_ms)
    }
}

/// Seconds as whole milliseconds.
pub fn millis(seconds: f64) -> u32 {
    (seconds * 1e3).round().clamp(0.0, f64::from(u32::MAX)) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs() -> Inputs {
        Inputs {
            prompt_tokens: 1_000,
            cached_tokens: 0,
            cache: Cache::None,
            queue_ahead: 0,
            slots: 4,
            service_seconds: 2.0,
            prefill_tokens_per_second: 500.0,
            leaves_home: false,
        }
    }

    #[test]
    fn each_term_is_its_own_part_of_the_cost() {
        let free = estimate(&inputs());
        assert_eq!(free, Estimate { wait: 0.0, prefill: 2.0, carry: 0.0, moving: 0.0 });
        let queued = estimate(&Inputs { queue_ahead: 6, ..inputs() });
        assert_eq!(queued.wait, 3.0, "6 ahead, a slot of 4 freeing every 2 s");
        let home = estimate(&Inputs { cached_tokens: 900, cache: Cache::Resident, ..inputs() });
        assert_eq!((home.prefill, home.carry), (0.2, 0.0), "only the 100 uncached tokens are read");
        let carried = estimate(&Inputs { cached_tokens: 900, cache: Cache::Carried, leaves_home: true, ..inputs() });
        assert_eq!((carried.prefill, carried.carry, carried.moving), (0.2, 0.1 + 900.0 / 20_000.0, 1.0));
        assert_eq!(carried.seconds(), carried.ttft() + MOVE_GAIN_SECONDS);
    }

    #[test]
    fn cached_tokens_count_only_where_a_cache_is_read() {
        let claimed = estimate(&Inputs { cached_tokens: 900, ..inputs() });
        assert_eq!(claimed.prefill, 2.0, "tokens cached elsewhere are read again here");
        let terms = Terms::of(&Inputs { cached_tokens: 900, ..inputs() }, &claimed, Standing::Warm);
        assert_eq!(terms.cached_tokens, 0);
    }

    #[test]
    fn a_slot_count_not_known_is_one_slot_and_a_cold_load_has_no_ttft() {
        assert_eq!(estimate(&Inputs { queue_ahead: 1, slots: 0, ..inputs() }).wait, 2.0);
        let cold = Terms::of(&inputs(), &estimate(&inputs()), Standing::Cold);
        assert_eq!((cold.prefill_ms, cold.ttft_ms), (2_000, 0));
    }

    #[test]
    fn no_other_node_costs_less_than_the_least_elsewhere() {
        // The fastest rate with no wait, or a carry, plus the move's gain.
        assert_eq!(least_elsewhere(1_000, 900, 1_000.0, false), 1.0 + MOVE_GAIN_SECONDS);
        assert_eq!(least_elsewhere(1_000, 900, 1_000.0, true), carry_seconds(900) + MOVE_GAIN_SECONDS);
        let anywhere = estimate(&Inputs { leaves_home: true, prefill_tokens_per_second: 1_000.0, ..inputs() });
        assert!(anywhere.seconds() >= least_elsewhere(1_000, 900, 1_000.0, false));
    }

    #[test]
    fn milliseconds_are_rounded_and_bounded() {
        assert_eq!((millis(0.0004), millis(0.0005), millis(-1.0), millis(1e12)), (0, 1, 0, u32::MAX));
    }
}
