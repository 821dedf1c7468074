//! The data plane's side of the usage ledger: one record per served
//! request, made by the data plane that served it (whatever retries and
//! failovers happened on the way), batched to a controller and resent
//! under the same batch id until acknowledged.
//!
//! Loss window: records are sent once a second; a graceful shutdown flushes
//! what is left (for up to [`FLUSH_ON_SHUTDOWN`]). A crash loses the
//! records of the last second, and of any batch a controller had not yet
//! acknowledged.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use inferyes_proto::kinds::UsageIn;
use inferyes_proto::usage::{PromptProgress, Usage, hour_of};
use inferyes_proto::v1::{UsageBatch, UsageDelta, UsageRecord, UsageRollup};
use inferyes_proto::{FastMap, value_for};
use tokio_util::sync::CancellationToken;

use crate::snapshot::Rates;

const SEND_EVERY: Duration = Duration::from_secs(1);
/// Raw records in one batch, when they are kept (the controller stores
/// them): keeps a batch well inside etcd's request size limit.
const MAX_RECORDS_PER_BATCH: usize = 500;
/// Each distinct hour, key and model is one roll-up in the controller's
/// transaction; etcd allows 128 operations in one.
const MAX_ROLLUPS_PER_BATCH: usize = 64;
const SEND_TIMEOUT: Duration = Duration::from_secs(5);
pub const FLUSH_ON_SHUTDOWN: Duration = Duration::from_secs(10);
/// Records held (with `usage_records`) while no controller acknowledges;
/// past it the oldest are dropped (and logged): memory is finite. Sums,
/// kept otherwise, need no bound: they grow with keys and models, not
/// requests.
const MAX_QUEUED: usize = 1_000_000;

/// Key → model → hour (since the epoch) → what those requests add up to.
type Sums = FastMap<String, FastMap<String, BTreeMap<u64, UsageRollup>>>;

pub struct Ledger {
    dataplane_id: String,
    /// Send each request's record, for export, besides the sums.
    keep_records: bool,
    /// Makes batch ids unique across restarts of the same data plane.
    nonce: u64,
    next_seq: AtomicU64,
    /// Records waiting to be sent, when they are kept.
    queue: Mutex<VecDeque<UsageRecord>>,
    /// Otherwise only sums wait, per key, model and hour: memory grows with
    /// the keys and models in use, not with the requests, even while no
    /// controller takes them.
    sums: Mutex<Sums>,
    /// What each key used, or holds for requests in flight, that the
    /// fleet's roll-up does not show yet: counted against its daily budget.
    tallies: Mutex<FastMap<String, Tally>>,
    dropped: AtomicU64,
}

/// A key's tokens, where its budget is spent: used today, and held for
/// requests in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Spent {
    pub used: u64,
    pub held: u64,
}

/// Why a request's tokens are not held of its key's budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unheld {
    /// Nothing is left of the budget today, by this data plane's count.
    Spent(Spent),
    /// This data plane's part of what is left (`part`) is held: `holds`
    /// by its requests (in flight, and ended but not in the roll-up yet),
    /// and the request's `tokens` do not fit.
    PartHeld { part: u64, holds: u64, tokens: u64 },
}

/// This data plane's part of what is left of a key's budget, as the
/// controllers split it (the data plane's allowances).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BudgetPart {
    pub tokens: u64,
    /// While it holds less than its part, it may admit one request at a
    /// time past it.
    pub overdraft: bool,
}

/// What this data plane holds of a key's daily budget, for its report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holding {
    pub key_id: String,
    /// Held by requests in flight, and used by those that ended and not
    /// yet in the fleet's roll-up as far as this data plane can tell.
    pub tokens: u64,
    /// A request admitted past this data plane's part is in flight, or
    /// what one used keeps it past its part: the overdraft is its own.
    pub overdrawn: bool,
}

/// What one request holds of its key's budget, given back when it is
/// recorded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Hold {
    pub tokens: u64,
    /// Admitted past this data plane's part, with its overdraft.
    pub overdrawn: bool,
}

/// How soon after a controller acknowledged usage the fleet's roll-up
/// shows it, to every controller and data plane: the ledger's leader rolls
/// acknowledged batches up every 250 ms. Tokens acknowledged stay counted
/// here until every controller splitting budgets has split them since
/// (`Allowances::forget_acknowledged_before`): counted twice
/// meanwhile, and never not at all while the leader keeps up.
pub const ROLLED_UP_WITHIN: Duration = Duration::from_secs(2);
/// Acknowledgements a key keeps apart at most; past them, the newest
/// takes in more (and is forgotten no sooner).
const MAX_ACKNOWLEDGED: usize = 64;

/// A key's tokens the roll-up does not show yet.
#[derive(Debug, Default)]
struct Tally {
    /// Recorded, and not yet acknowledged by a controller.
    unacknowledged: u64,
    /// Acknowledged lately, with when, and their sum: the roll-up may not
    /// show them yet.
    acknowledged: VecDeque<(Instant, u64)>,
    acknowledged_tokens: u64,
    /// Held for requests in flight, each until its record is made.
    held: u64,
    /// A request admitted with this data plane's overdraft is in flight.
    overdrawn: bool,
}

impl Tally {
    /// Recorded and not yet shown by the roll-up, as far as can be told:
    /// what was acknowledged before `forget_before` is.
    fn unrolled(&mut self, forget_before: Option<Instant>) -> u64 {
        while let Some(&(at, tokens)) = self.acknowledged.front()
            && forget_before.is_some_and(|before| at < before)
        {
            self.acknowledged.pop_front();
            self.acknowledged_tokens = self.acknowledged_tokens.saturating_sub(tokens);
        }
        self.unacknowledged.saturating_add(self.acknowledged_tokens)
    }

    fn acknowledged(&mut self, tokens: u64, now: Instant) {
        self.acknowledged_tokens = self.acknowledged_tokens.saturating_add(tokens);
        let full = self.acknowledged.len() >= MAX_ACKNOWLEDGED;
        match self.acknowledged.back_mut() {
            Some(newest) if full => *newest = (now, newest.1.saturating_add(tokens)),
            _ => self.acknowledged.push_back((now, tokens)),
        }
    }

    fn idle(&self) -> bool {
        self.unacknowledged == 0 && self.held == 0 && self.acknowledged.is_empty()
    }
}

impl Ledger {
    pub fn new(dataplane_id: &str, keep_records: bool) -> Arc<Ledger> {
        let id: String =
            dataplane_id.chars().map(|c| if c.is_ascii_alphanumeric() || "-_".contains(c) { c } else { '-' }).collect();
        Arc::new(Ledger {
            dataplane_id: id,
            keep_records,
            nonce: fastrand::u64(..),
            next_seq: AtomicU64::new(0),
            queue: Mutex::default(),
            sums: Mutex::default(),
            tallies: Mutex::default(),
            dropped: AtomicU64::new(0),
        })
    }

    /// Holds `tokens` of `key_id`'s daily `budget` for a request in flight,
    /// where what the key used today (`today`, by the fleet's roll-up, and
    /// what this data plane counted or holds since) leaves any of it, and
    /// the tokens fit in this data plane's `part` of what is left, or it
    /// holds the overdraft, holds less than its part and no overdrawn
    /// request. The parts of the fleet's data planes add up to what is
    /// left and one of them holds the overdraft: the fleet overruns the
    /// budget by one request's tokens at most, however many run at once.
    pub fn hold(
        &self,
        key_id: &str,
        (budget, today): (u64, u64),
        tokens: u64,
        part: BudgetPart,
        forget_before: Option<Instant>,
    ) -> Result<Hold, Unheld> {
        let mut tallies = self.tallies.lock().unwrap_or_else(PoisonError::into_inner);
        let tally = value_for(&mut tallies, key_id, Tally::default);
        let unrolled = tally.unrolled(forget_before);
        let (used, holds) = (today.saturating_add(unrolled), unrolled.saturating_add(tally.held));
        let fits = holds.saturating_add(tokens) <= part.tokens;
        // Past the part by one request, and only from within it: what an
        // overdrawn request used counts against the part until rolled up.
        let overdraws = !fits && part.overdraft && !tally.overdrawn && holds < part.tokens;
        let refused = if used.saturating_add(tally.held) >= budget {
            Some(Unheld::Spent(Spent { used, held: tally.held }))
        } else {
            (!fits && !overdraws).then_some(Unheld::PartHeld { part: part.tokens, holds, tokens })
        };
        if let Some(refused) = refused {
            if tally.idle() {
                tallies.remove(key_id);
            }
            return Err(refused);
        }
        tally.held = tally.held.saturating_add(tokens);
        tally.overdrawn |= overdraws;
        Ok(Hold { tokens, overdrawn: overdraws })
    }

    /// What the keys with budgets hold of them here, for the report: by
    /// `part`, each key's part of its budget, `None` for a key without one.
    /// A key holding past its part with the overdraft counts as overdrawn
    /// until it holds no more than its part: the overdraft stays its own
    /// until what the overdrawn request used is rolled up. Keys holding
    /// nothing are left out, and tallies with nothing left in them dropped.
    pub fn holdings(&self, part: impl Fn(&str) -> Option<BudgetPart>, forget_before: Option<Instant>) -> Vec<Holding> {
        // Parts are read once the lock requests take is let go.
        let mut held: Vec<(String, u64, bool)> = Vec::new();
        {
            let mut tallies = self.tallies.lock().unwrap_or_else(PoisonError::into_inner);
            tallies.retain(|key_id, tally| {
                let tokens = tally.unrolled(forget_before).saturating_add(tally.held);
                if tokens > 0 || tally.overdrawn {
                    held.push((key_id.clone(), tokens, tally.overdrawn));
                }
                !tally.idle()
            });
        }
        held.into_iter()
            .filter_map(|(key_id, tokens, overdrawn)| {
                let part = part(&key_id)?;
                let overdrawn = overdrawn || (part.overdraft && tokens > part.tokens);
                Some(Holding { key_id, tokens, overdrawn })
            })
            .collect()
    }

    /// Records a request's usage, giving back what its admission `held`.
    pub fn record(&self, record: UsageRecord, held: Hold) {
        if !record.key_id.is_empty() {
            let tokens = record.prompt_tokens + record.completion_tokens;
            let mut tallies = self.tallies.lock().unwrap_or_else(PoisonError::into_inner);
            let tally = value_for(&mut tallies, &record.key_id, Tally::default);
            tally.unacknowledged = tally.unacknowledged.saturating_add(tokens);
            tally.held = tally.held.saturating_sub(held.tokens);
            if held.overdrawn {
                tally.overdrawn = false;
            }
        }
        if !self.keep_records {
            let mut sums = self.sums.lock().unwrap_or_else(PoisonError::into_inner);
            let models = value_for(&mut sums, &record.key_id, FastMap::default);
            let hours = value_for(models, &record.model, BTreeMap::new);
            inferyes_proto::usage::add(hours.entry(record.unix_ms / 3_600_000).or_default(), &record);
            return;
        }
        let mut queue = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
        if queue.len() >= MAX_QUEUED {
            queue.pop_front();
            if self.dropped.fetch_add(1, Ordering::Relaxed).is_multiple_of(10_000) {
                tracing::error!("no controller takes usage records; dropping the oldest");
            }
        }
        queue.push_back(record);
    }

    /// Requests waiting to be sent.
    fn queued(&self) -> usize {
        if self.keep_records {
            return self.queue.lock().unwrap_or_else(PoisonError::into_inner).len();
        }
        let sums = self.sums.lock().unwrap_or_else(PoisonError::into_inner);
        let requests: u64 = sums.values().flat_map(|m| m.values()).flat_map(|h| h.values()).map(|u| u.requests).sum();
        usize::try_from(requests).unwrap_or(usize::MAX)
    }

    /// Up to [`MAX_ROLLUPS_PER_BATCH`] waiting sums, taken out.
    fn take_sums(&self) -> Vec<UsageDelta> {
        let mut sums = self.sums.lock().unwrap_or_else(PoisonError::into_inner);
        let mut deltas = Vec::new();
        'keys: for (key_id, models) in sums.iter_mut() {
            for (model, hours) in models.iter_mut() {
                while let Some((hour, usage)) = hours.pop_first() {
                    deltas.push(UsageDelta {
                        hour: hour_of(hour * 3_600_000),
                        key_id: key_id.clone(),
                        model: model.clone(),
                        usage: Some(usage),
                    });
                    if deltas.len() == MAX_ROLLUPS_PER_BATCH {
                        break 'keys;
                    }
                }
            }
        }
        sums.retain(|_, models| {
            models.retain(|_, hours| !hours.is_empty());
            !models.is_empty()
        });
        deltas
    }

    /// Tokens of `key_id` this data plane counted that the fleet's roll-up
    /// may not show yet.
    pub fn unacknowledged_tokens(&self, key_id: &str) -> u64 {
        let tallies = self.tallies.lock().unwrap_or_else(PoisonError::into_inner);
        tallies.get(key_id).map_or(0, |tally| tally.unacknowledged)
    }

    /// The next batch: up to the record and roll-up limits, oldest first.
    /// The queue's lock is held only to move records out (and, rarely, to
    /// put back those past the roll-up limit): requests finishing meanwhile
    /// must not wait for a batch to be summed.
    pub fn next_batch(&self, at_most: usize) -> Option<UsageBatch> {
        if !self.keep_records {
            let deltas = self.take_sums();
            return (!deltas.is_empty()).then(|| self.batch(Vec::new(), deltas));
        }
        let limit = MAX_RECORDS_PER_BATCH;
        let mut taken: Vec<UsageRecord> = {
            let mut queue = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
            let n = queue.len().min(limit).min(at_most);
            queue.drain(..n).collect()
        };
        if taken.is_empty() {
            return None;
        }
        let mut sums: BTreeMap<(u64, &str, &str), UsageRollup> = BTreeMap::new();
        let mut cut = taken.len();
        for (i, record) in taken.iter().enumerate() {
            let rollup = (record.unix_ms / 3_600_000, record.key_id.as_str(), record.model.as_str());
            if !sums.contains_key(&rollup) && sums.len() == MAX_ROLLUPS_PER_BATCH {
                cut = i;
                break;
            }
            inferyes_proto::usage::add(sums.entry(rollup).or_default(), record);
        }
        let deltas: Vec<UsageDelta> = sums
            .into_iter()
            .map(|((hour, key_id, model), usage)| UsageDelta {
                hour: hour_of(hour * 3_600_000),
                key_id: key_id.to_string(),
                model: model.to_string(),
                usage: Some(usage),
            })
            .collect();
        if cut < taken.len() {
            let rest = taken.split_off(cut);
            let mut queue = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
            for record in rest.into_iter().rev() {
                queue.push_front(record);
            }
        }
        Some(self.batch(taken, deltas))
    }

    fn batch(&self, records: Vec<UsageRecord>, deltas: Vec<UsageDelta>) -> UsageBatch {
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        // The hour first: the controller prunes its markers by name.
        let batch_id =
            format!("{}.{}.{:016x}.{seq}", hour_of(inferyes_proto::unix_ms()), self.dataplane_id, self.nonce);
        UsageBatch { batch_id, dataplane_id: self.dataplane_id.clone(), records, deltas }
    }

    /// A controller acknowledged `batch` at `now`: it is the ledger's, and
    /// its tokens leave this data plane's count once the roll-up can show
    /// them.
    pub fn acknowledged(&self, batch: &UsageBatch, now: Instant) {
        let mut tallies = self.tallies.lock().unwrap_or_else(PoisonError::into_inner);
        for delta in batch.deltas.iter().filter(|d| !d.key_id.is_empty()) {
            let usage = delta.usage.unwrap_or_default();
            if let Some(tally) = tallies.get_mut(&delta.key_id) {
                let tokens = (usage.prompt_tokens + usage.completion_tokens).min(tally.unacknowledged);
                tally.unacknowledged -= tokens;
                if tokens > 0 {
                    tally.acknowledged(tokens, now);
                }
            }
        }
        tallies.retain(|_, tally| !tally.idle());
    }
}

/// Sends batches until shutdown, then flushes for up to
/// [`FLUSH_ON_SHUTDOWN`]. `drained` is cancelled by the caller once no
/// request can add records any more.
pub async fn run(ledger: Arc<Ledger>, controllers: crate::Controllers, drained: CancellationToken) {
    let clients: Vec<crate::RoutingClient> = controllers
        .addresses
        .iter()
        .filter_map(|address| match controllers.endpoint(address) {
            Ok(endpoint) => Some(endpoint),
            Err(error) => {
                tracing::error!(controller = %address, error = format!("{error:#}"), "cannot send usage to this controller");
                None
            }
        })
        .map(|e| controllers.client(e.connect_timeout(Duration::from_secs(2)).tcp_nodelay(true).connect_lazy()))
        .collect();
    if clients.is_empty() {
        return;
    }
    let mut next = 0usize;
    // A batch stays current until acknowledged, so a resend carries the
    // same id and is counted once.
    let mut current: Option<UsageBatch> = None;
    // Controllers that refused the current batch for what it holds.
    let mut refusals = 0usize;
    let mut ticker = tokio::time::interval(SEND_EVERY);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut deadline: Option<Instant> = None;
    loop {
        if deadline.is_none() {
            tokio::select! {
                () = drained.cancelled() => deadline = Some(Instant::now() + FLUSH_ON_SHUTDOWN),
                _ = ticker.tick() => {}
            }
        }
        // Send what was queued when the tick came, one batch after another;
        // what arrives meanwhile waits for the next tick (else a busy data
        // plane would send a batch per round trip, not per second).
        let mut left = if deadline.is_some() { usize::MAX } else { ledger.queued() };
        loop {
            if current.is_none() && left > 0 {
                current = ledger.next_batch(left);
                left = left.saturating_sub(
                    current
                        .as_ref()
                        .map_or(left, |b| b.deltas.iter().map(|d| d.usage.map_or(0, |u| u.requests as usize)).sum()),
                );
            }
            let Some(batch) = &current else { break };
            let mut client = clients[next % clients.len()].clone();
            match tokio::time::timeout(SEND_TIMEOUT, client.record_usage(batch.clone())).await {
                Ok(Ok(_)) => {
                    ledger.acknowledged(batch, Instant::now());
                    current = None;
                    refusals = 0;
                }
                // Refused for what it holds: another controller (whose
                // clock is right) may take it; once every one has refused
                // it, none will.
                Ok(Err(status)) if !resent(status.code()) && refusals + 1 >= clients.len() => {
                    let records = batch.records.len();
                    tracing::error!(message = status.message(), records, "usage batch refused as invalid; dropped");
                    ledger.acknowledged(batch, Instant::now());
                    current = None;
                    refusals = 0;
                }
                Ok(Err(status)) if !resent(status.code()) => {
                    tracing::warn!(
                        message = status.message(),
                        "usage batch refused as invalid; trying another controller"
                    );
                    refusals += 1;
                    next += 1;
                    break;
                }
                Ok(Err(status)) => {
                    tracing::warn!(code = ?status.code(), message = status.message(), "usage batch not taken; retrying");
                    next += 1;
                    break;
                }
                Err(_) => {
                    tracing::warn!("usage batch not acknowledged in time; retrying");
                    next += 1;
                    break;
                }
            }
        }
        if let Some(at) = deadline {
            let empty = current.is_none() && ledger.queued() == 0;
            if empty {
                return;
            }
            if Instant::now() >= at {
                let left = ledger.queued()
                    + current.as_ref().map_or(0, |b| {
                        b.deltas.iter().map(|d| d.usage.map_or(0, |u| u.requests as usize)).sum::<usize>()
                    });
                tracing::error!(records = left, "shutdown: usage records could not be delivered");
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Whether a batch a controller refused with `code` is sent to it again:
/// not one refused for what it holds (dated an hour ahead of the
/// controller's clock), which no resend changes and which would hold up
/// every later batch.
fn resent(code: tonic::Code) -> bool {
    code != tonic::Code::InvalidArgument
}

/// One request's record, made once: by whoever finishes it first (the
/// answer's end, an error) or, if nothing did, when the last handle goes
/// (the client went away). Shared by the request's handler and its
/// answer's body: its usage, the node and route that answered it
/// ([`Served`]), its time to first token, and what the handler leaves to
/// do once the answer has ended ([`Meter::at_end`]).
#[derive(Clone)]
pub struct Meter(Arc<MeterInner>);

struct MeterInner {
    ledger: Arc<Ledger>,
    started: Instant,
    /// The record as far as it is known; taken (not copied) when finished.
    record: Mutex<UsageRecord>,
    /// How the answer's tokens are counted.
    counted: Counted,
    done: AtomicBool,
    /// Set by the answer's first token; read once, at the end.
    first_token: std::sync::OnceLock<Instant>,
    /// Where a stream's times are observed, at its end.
    stream_timers: Option<StreamTimers>,
    /// What its admission held of the key's budget, given back with the
    /// record.
    held: std::sync::OnceLock<Hold>,
    /// Data events seen in a stream: one token each, for an estimate.
    events: AtomicU64,
    /// What llama-server last said of the prompt it was reading, and how
    /// many of the data events are no token (its progress events, chat's
    /// opening role chunk).
    progress: Mutex<(Option<PromptProgress>, u64)>,
    /// The node that answered, once one did (or failed, answering).
    served: std::sync::OnceLock<Served>,
    /// When the request was last sent to a node, and that backend's rates.
    sent: Mutex<Option<(Instant, Rates)>>,
    /// What is done once the answer ended.
    ending: Mutex<Ending>,
    /// What is told the tokens counted, once known: the queue's fair order.
    settle: Mutex<Option<Settle>>,
}

/// Where a request's answer came from, as its attempts found: the node
/// and the route by which it was reached, and what routing weighed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Served {
    pub node: Arc<str>,
    pub route: &'static str,
    pub weighed: crate::routing::Weighed,
}

/// What a stream's handler leaves for its end, once it knows its time to
/// first token and what served it.
pub type AtEnd = Box<dyn FnOnce(Option<&Served>, u32) + Send>;

/// What runs with the tokens a request is counted for, once known.
pub type Settle = Box<dyn FnOnce(u64) + Send>;

/// Where the work left for a stream's end stands. The answer may end (its
/// body runs in a task of its own) before the handler hands that work
/// over, so whichever comes second does it.
#[derive(Default)]
enum Ending {
    #[default]
    None,
    Waiting(AtEnd),
    /// The answer ended first, this long after its start to its first token.
    Ended(u32),
}

/// Where a stream's times go: to its first token (its headers and first
/// bytes may come long before: a stream that starts a cold load is answered
/// at once, and llama-server sends the role before it reads the prompt),
/// and to its end, for a stream that ended well.
pub struct StreamTimers {
    pub first_token: prometheus_client::metrics::histogram::Histogram,
    pub whole: prometheus_client::metrics::histogram::Histogram,
}

/// How a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Ok,
    Error,
    Broken,
    Cancelled,
}

impl Outcome {
    fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Error => "error",
            Outcome::Broken => "broken",
            Outcome::Cancelled => "cancelled",
        }
    }
}

/// How a request's tokens are counted: where its answer says them (its
/// path's row), the prompt's estimate for an answer that says none, and
/// the most output it may be billed for where it has to be estimated (its
/// limit, else its model's window).
#[derive(Clone, Copy, Debug)]
pub struct Counted {
    pub usage: UsageIn,
    pub prompt_estimate: u64,
    pub output_limit: u64,
}

#[cfg(test)]
impl Counted {
    /// Tokens read from the end of the answer, as chat's are.
    pub fn at_the_end(prompt_estimate: u64) -> Counted {
        Counted { usage: UsageIn::Tail, prompt_estimate, output_limit: 0 }
    }
}

/// The output a node may have generated for a whole answer that said no
/// usage (its client gone, the node timed out or broke off, its usage
/// kept out of it): from when it was sent, less the time its prompt takes to read, at the
/// backend's decode rate (where it is not known, one few servers reach),
/// at most `limit`. It errs high where the request waited for a slot: a
/// client must not be able to make a node generate for nothing by leaving
/// just before the answer.
pub fn generated(elapsed: Duration, prompt_tokens: u64, rates: Rates, limit: u64) -> u64 {
    let decode = if rates.decode_tokens_per_second > 0.0 {
        rates.decode_tokens_per_second
    } else {
        UNKNOWN_DECODE_TOKENS_PER_SECOND
    };
    let reading = if rates.prefill_tokens_per_second > 0.0 {
        prompt_tokens as f64 / rates.prefill_tokens_per_second
    } else {
        0.0
    };
    let generating = (elapsed.as_secs_f64() - reading).max(0.0);
    // Saturates where the product is past u64 (or not a number).
    let tokens = (generating * decode).ceil() as u64;
    tokens.min(limit)
}

/// `gpu_ms` of a GPU priced `gpu_hour_price` an hour, in millionths.
pub fn cost_micros(gpu_ms: u64, gpu_hour_price: f64) -> u64 {
    // Saturates where the product is past u64 (or not a number).
    (gpu_ms as f64 * gpu_hour_price * 1e6 / 3_600_000.0).round() as u64
}

/// The decode rate a backend that reports none is taken to generate at,
/// one request alone: above most servers'.
const UNKNOWN_DECODE_TOKENS_PER_SECOND: f64 = 200.0;

impl Meter {
    pub fn new(
        ledger: Arc<Ledger>,
        request_id: &str,
        key_id: Option<String>,
        model: String,
        stream: bool,
        counted: Counted,
        stream_timers: Option<StreamTimers>,
    ) -> Meter {
        let keep_records = ledger.keep_records;
        Meter(Arc::new(MeterInner {
            ledger,
            started: Instant::now(),
            record: Mutex::new(UsageRecord {
                // Only a kept record travels with its id and node; sums need
                // neither.
                request_id: if keep_records { request_id.to_string() } else { String::new() },
                unix_ms: inferyes_proto::unix_ms(),
                key_id: key_id.unwrap_or_default(),
                model,
                stream,
                ..Default::default()
            }),
            counted,
            done: AtomicBool::new(false),
            first_token: std::sync::OnceLock::new(),
            stream_timers,
            held: std::sync::OnceLock::new(),
            events: AtomicU64::new(0),
            progress: Mutex::default(),
            served: std::sync::OnceLock::new(),
            sent: Mutex::default(),
            ending: Mutex::default(),
            settle: Mutex::default(),
        }))
    }

    /// What was held of the key's budget for this request
    /// ([`Ledger::hold`]), given back when it is recorded.
    pub fn holds(&self, held: Hold) {
        let _ = self.0.held.set(held);
    }

    /// Runs `settle` with the tokens the request is counted for (its
    /// prompt and its output) once its answer has ended, where it was sent
    /// to a node: what never reached one is settled by nothing.
    pub fn settles(&self, settle: Settle) {
        *self.0.settle.lock().unwrap_or_else(PoisonError::into_inner) = Some(settle);
    }

    /// Runs `at_end` once the answer has ended, with what served it and
    /// its time to first token, which a stream's head does not know yet.
    pub fn at_end(&self, at_end: AtEnd) {
        let mut slot = self.0.ending.lock().unwrap_or_else(PoisonError::into_inner);
        match *slot {
            Ending::Ended(ttft_ms) => {
                drop(slot);
                at_end(self.0.served.get(), ttft_ms);
            }
            _ => *slot = Ending::Waiting(at_end),
        }
    }

    /// The request is being sent to a backend of these rates: a whole
    /// answer that says no usage is billed for what that one may have
    /// generated.
    pub fn sent(&self, rates: Rates) {
        *self.0.sent.lock().unwrap_or_else(PoisonError::into_inner) = Some((Instant::now(), rates));
    }

    /// The node that answered, and how it was reached: the first to be
    /// told is kept (a request has one answer).
    pub fn served(&self, served: Served) {
        let node = Arc::clone(&served.node);
        if self.0.served.set(served).is_ok() && self.0.ledger.keep_records {
            let mut record = self.0.record.lock().unwrap_or_else(PoisonError::into_inner);
            record.node_id.clear();
            record.node_id.push_str(&node);
        }
    }

    /// What served the request, once something did.
    pub fn served_by(&self) -> Option<&Served> {
        self.0.served.get()
    }

    /// Called with every frame of a stream: the first for which
    /// `carries_output` says yes is the first token. After it, a call is
    /// one atomic load, and the frame is not looked at.
    pub fn frame(&self, carries_output: impl FnOnce() -> bool) {
        if self.0.first_token.get().is_none() && carries_output() {
            let _ = self.0.first_token.set(Instant::now());
        }
    }

    pub fn data_events(&self, events: usize) {
        if events > 0 {
            self.0.events.fetch_add(events as u64, Ordering::Relaxed);
        }
    }

    /// A data event of the stream's that is no token: a progress event
    /// (`super::http::progress`), with what it said where it could be read,
    /// or the answer's opening chunk.
    pub fn no_token(&self, progress: Option<PromptProgress>) {
        let mut last = self.0.progress.lock().unwrap_or_else(PoisonError::into_inner);
        last.1 += 1;
        if progress.is_some() {
            last.0 = progress;
        }
    }

    /// The stream went on at another node, which read the prompt again and
    /// what the first had said: its usage is estimated, as before progress
    /// was read.
    pub fn forget_progress(&self) {
        self.0.progress.lock().unwrap_or_else(PoisonError::into_inner).0 = None;
    }

    /// Reads the backend's own time on the request from the end of its
    /// answer (`timings`), for the record.
    pub fn timed(&self, tail: &[u8]) {
        if let Some(time) = inferyes_proto::usage::parse_backend_time(tail) {
            let mut record = self.0.record.lock().unwrap_or_else(PoisonError::into_inner);
            record.prompt_ms = u64::from(time.prompt_ms);
            record.generation_ms = u64::from(time.generation_ms);
        }
    }

    /// Records the request; later calls do nothing.
    pub fn finish(&self, status: u16, outcome: Outcome, usage: Option<Usage>) {
        self.0.finish(status, outcome, usage);
    }

    /// The prompt tokens the request is counted for where its answer says
    /// none.
    pub fn prompt_estimate(&self) -> u64 {
        self.0.counted.prompt_estimate
    }

    /// Whether the usage is partly in the answer's first bytes, which are
    /// then kept for [`Meter::usage`].
    pub fn reads_head(&self) -> bool {
        self.0.counted.usage == UsageIn::HeadAndTail
    }

    /// What an answer whose first bytes were `head` and last `tail` says
    /// it used, read where its path's answers say it.
    pub fn usage(&self, head: &[u8], tail: &[u8]) -> Option<Usage> {
        match self.0.counted.usage {
            UsageIn::Tail => inferyes_proto::usage::parse_usage(tail),
            UsageIn::HeadAndTail => inferyes_proto::usage::parse_stream_usage(head, tail),
            UsageIn::None => None,
        }
    }
}

impl MeterInner {
    fn finish(&self, status: u16, outcome: Outcome, usage: Option<Usage>) {
        if self.done.swap(true, Ordering::AcqRel) {
            return;
        }
        let mut record = std::mem::take(&mut *self.record.lock().unwrap_or_else(PoisonError::into_inner));
        let first_token = self.first_token.get().filter(|_| record.stream).map(|at| at.duration_since(self.started));
        if let (Some(timers), Some(first_token)) = (&self.stream_timers, first_token) {
            timers.first_token.observe(first_token.as_secs_f64());
            if outcome == Outcome::Ok {
                timers.whole.observe(self.started.elapsed().as_secs_f64());
            }
        }
        let ttft = first_token.map_or(0, millis);
        let waiting = {
            let mut slot = self.ending.lock().unwrap_or_else(PoisonError::into_inner);
            std::mem::replace(&mut *slot, Ending::Ended(ttft))
        };
        if let Ending::Waiting(at_end) = waiting {
            at_end(self.served.get(), ttft);
        }
        let sent = *self.sent.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((at, rates)) = sent {
            // A node that said nothing of its time (its answer cut short, an
            // API without timings) was worked from when it was sent: a
            // client cannot leave before the end to use it for nothing. A
            // refusal worked it for nothing.
            if record.prompt_ms == 0 && record.generation_ms == 0 && outcome != Outcome::Error {
                record.generation_ms = u64::from(millis(at.elapsed()));
            }
            record.cost_micros =
                cost_micros(record.prompt_ms.saturating_add(record.generation_ms), rates.gpu_hour_price);
        }
        record.status = u32::from(status);
        record.outcome = outcome.as_str().to_string();
        record.latency_ms = millis(self.started.elapsed());
        record.ttft_ms = ttft;
        match usage {
            Some(usage) => {
                record.prompt_tokens = u64::from(usage.prompt_tokens);
                record.cached_tokens = u64::from(usage.cached_tokens);
                record.completion_tokens = u64::from(usage.completion_tokens);
            }
            // Nothing reached the backend's model: nothing to count.
            None if outcome == Outcome::Error => {}
            // A job counted by requests, not tokens.
            None if self.counted.usage == UsageIn::None => {}
            // A whole answer that said nothing of its output (cut short,
            // or its usage kept out of it): its node worked from when it
            // was sent.
            None if !record.stream => {
                let prompt = self.counted.prompt_estimate;
                record.estimated = true;
                record.prompt_tokens = prompt;
                record.completion_tokens =
                    sent.map_or(0, |(at, rates)| generated(at.elapsed(), prompt, rates, self.counted.output_limit));
            }
            None => {
                let (progress, progress_events) = *self.progress.lock().unwrap_or_else(PoisonError::into_inner);
                let tokens = self.events.load(Ordering::Relaxed).saturating_sub(progress_events);
                match progress {
                    // The server said how much of the prompt it read; the
                    // tokens are the events it sent after, one each.
                    Some(progress) => {
                        let usage = progress.usage(u32::try_from(tokens).unwrap_or(u32::MAX));
                        record.prompt_tokens = u64::from(usage.prompt_tokens);
                        record.cached_tokens = u64::from(usage.cached_tokens);
                        record.completion_tokens = u64::from(usage.completion_tokens);
                    }
                    None => {
                        record.estimated = true;
                        record.prompt_tokens = self.counted.prompt_estimate;
                        record.completion_tokens = tokens;
                    }
                }
            }
        }
        let settle = self.settle.lock().unwrap_or_else(PoisonError::into_inner).take();
        let was_sent = self.sent.lock().unwrap_or_else(PoisonError::into_inner).is_some();
        if let Some(settle) = settle.filter(|_| was_sent) {
            settle(record.prompt_tokens.saturating_add(record.completion_tokens));
        }
        self.ledger.record(record, self.held.get().copied().unwrap_or_default());
    }
}

impl Drop for MeterInner {
    fn drop(&mut self) {
        // The client went away before the answer ended.
        self.finish(499, Outcome::Cancelled, None);
    }
}

fn millis(d: Duration) -> u32 {
    u32::try_from(d.as_millis()).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream_meter() -> Meter {
        Meter::new(Ledger::new("dp", false), "req", None, "m".into(), true, Counted::at_the_end(10), None)
    }

    #[test]
    fn a_stream_s_end_work_runs_once_whether_it_or_the_end_comes_first() {
        for end_first in [false, true] {
            let (tx, rx) = std::sync::mpsc::channel();
            let meter = stream_meter();
            meter.frame(|| true);
            let mut weighed = crate::routing::Weighed::default();
            weighed.ttft_ms = 5;
            let served = Served { node: "n".into(), route: "placed", weighed };
            meter.served(served.clone());
            meter.served(Served { node: "other".into(), ..served.clone() });
            let at_end: AtEnd = Box::new(move |served, _ttft| tx.send(served.cloned()).expect("sent"));
            if end_first {
                meter.finish(200, Outcome::Ok, None);
                meter.at_end(at_end);
            } else {
                meter.at_end(at_end);
                meter.finish(200, Outcome::Ok, None);
            }
            drop(meter);
            assert_eq!(rx.try_recv().expect("run"), Some(served), "the first node told");
            assert!(rx.try_recv().is_err(), "once");
        }
    }

    fn record(key: &str, model: &str, tokens: u64) -> UsageRecord {
        UsageRecord {
            key_id: key.into(),
            model: model.into(),
            unix_ms: inferyes_proto::unix_ms(),
            prompt_tokens: tokens,
            ..Default::default()
        }
    }

    #[test]
    fn batches_respect_the_record_and_rollup_limits_and_ids_are_unique() {
        let ledger = Ledger::new("dp/1 test", true);
        for i in 0..(MAX_RECORDS_PER_BATCH + 10) {
            ledger.record(record("k", "m", 1 + (i as u64 % 2)), Hold::default());
        }
        let first = ledger.next_batch(usize::MAX).unwrap();
        assert_eq!(first.records.len(), MAX_RECORDS_PER_BATCH);
        assert_eq!(first.deltas.len(), 1);
        let sum = first.deltas[0].usage.unwrap();
        assert_eq!((sum.requests, sum.prompt_tokens), (500, 750));
        assert!(first.batch_id.contains(".dp-1-test."), "{}", first.batch_id);
        let second = ledger.next_batch(usize::MAX).unwrap();
        assert_eq!(second.records.len(), 10);
        assert_ne!(first.batch_id, second.batch_id);
        assert!(ledger.next_batch(usize::MAX).is_none());

        for m in 0..(MAX_ROLLUPS_PER_BATCH + 1) {
            ledger.record(record("k", &format!("model-{m}"), 1), Hold::default());
        }
        assert_eq!(ledger.next_batch(usize::MAX).unwrap().deltas.len(), MAX_ROLLUPS_PER_BATCH);
        assert_eq!(ledger.next_batch(usize::MAX).unwrap().deltas.len(), 1);

        // A tick sends what was queued when it came, no more.
        for _ in 0..5 {
            ledger.record(record("k", "m", 1), Hold::default());
        }
        assert_eq!(ledger.next_batch(3).unwrap().deltas[0].usage.unwrap().requests, 3);
        assert_eq!(ledger.queued(), 2);
        assert_eq!(ledger.next_batch(usize::MAX).unwrap().deltas[0].usage.unwrap().requests, 2);

        // Without records, only sums travel, many requests to a batch.
        let summing = Ledger::new("dp", false);
        for _ in 0..(MAX_RECORDS_PER_BATCH * 3) {
            summing.record(record("k", "m", 2), Hold::default());
        }
        let batch = summing.next_batch(usize::MAX).unwrap();
        assert!(batch.records.is_empty());
        assert_eq!(batch.deltas[0].usage.unwrap().requests, 1500);
        assert!(summing.next_batch(usize::MAX).is_none());
    }

    /// The part of a budget nobody splits.
    const WHOLE: BudgetPart = BudgetPart { tokens: u64::MAX, overdraft: true };

    #[test]
    fn a_budget_admits_while_any_is_left_and_holds_each_request_s_tokens_until_recorded() {
        let ledger = Ledger::new("dp", false);
        // 1,000 a day, 100 used by the roll-up: requests of 300 each, all of
        // what is left this data plane's.
        let hold = || ledger.hold("k", (1_000, 100), 300, WHOLE, None);
        let admitted = (0..10).filter(|_| hold().is_ok()).count();
        assert_eq!(admitted, 3, "100 + 3 × 300 leaves none for a fourth");
        assert_eq!(hold(), Err(Unheld::Spent(Spent { used: 100, held: 900 })));
        // One ends, having used 50: what it held beyond them is free again.
        ledger.record(record("k", "m", 50), Hold { tokens: 300, overdrawn: false });
        assert_eq!(ledger.unacknowledged_tokens("k"), 50);
        assert!(hold().is_ok());
        assert!(ledger.hold("other", (1_000, 0), 300, WHOLE, None).is_ok(), "each key its own");
    }

    #[test]
    fn a_part_of_a_budget_admits_what_fits_and_one_request_past_it_with_the_overdraft() {
        let (ledger, now) = (Ledger::new("dp", false), Instant::now());
        let part = |tokens, overdraft| BudgetPart { tokens, overdraft };
        let hold = |part| ledger.hold("k", (1_000, 100), 300, part, Some(now));
        // A part of 700: two fit, the third would pass it.
        assert_eq!(hold(part(700, false)), Ok(Hold { tokens: 300, overdrawn: false }));
        assert_eq!(hold(part(700, false)), Ok(Hold { tokens: 300, overdrawn: false }));
        assert_eq!(hold(part(700, false)), Err(Unheld::PartHeld { part: 700, holds: 600, tokens: 300 }));
        // The overdraft takes one past it, and one only.
        assert_eq!(hold(part(700, true)), Ok(Hold { tokens: 300, overdrawn: true }));
        assert!(matches!(hold(part(700, true)), Err(Unheld::Spent(_))), "100 + 900 held: nothing is left");
        ledger.record(record("k", "m", 40), Hold { tokens: 300, overdrawn: true });
        let holdings = ledger.holdings(|_| Some(part(700, true)), Some(now));
        assert_eq!(holdings, vec![Holding { key_id: "k".into(), tokens: 640, overdrawn: false }]);
        let holdings = ledger.holdings(|_| Some(part(500, true)), Some(now));
        assert!(holdings[0].overdrawn, "past its part, it keeps the overdraft: {holdings:?}");
        let holdings = ledger.holdings(|_| Some(part(500, false)), Some(now));
        assert!(!holdings[0].overdrawn, "past its part without the overdraft, it claims none: {holdings:?}");
        assert_eq!(ledger.holdings(|_| None, Some(now)), Vec::new(), "a key with no budget");
        // What ended counts against the part until the roll-up shows it.
        assert_eq!(hold(part(700, false)), Err(Unheld::PartHeld { part: 700, holds: 640, tokens: 300 }));
        assert_eq!(hold(part(700, true)), Ok(Hold { tokens: 300, overdrawn: true }), "the overdraft is free again");
        // Held past its part, it takes no overdraft again, one request
        // after another, until what it used is rolled up.
        ledger.record(record("k", "m", 200), Hold { tokens: 300, overdrawn: true });
        assert_eq!(hold(part(700, true)), Err(Unheld::PartHeld { part: 700, holds: 840, tokens: 300 }));
        assert!(matches!(hold(part(0, true)), Err(Unheld::PartHeld { .. })), "a part of none takes no overdraft");
    }

    #[test]
    fn acknowledged_tokens_count_until_the_roll_up_can_show_them() {
        let (ledger, now) = (Ledger::new("dp", false), Instant::now());
        ledger.record(record("k", "m", 30), Hold::default());
        let batch = ledger.next_batch(usize::MAX).unwrap();
        ledger.acknowledged(&batch, now);
        let held = |before| ledger.holdings(|_| Some(WHOLE), before).first().map_or(0, |holding| holding.tokens);
        assert_eq!((ledger.unacknowledged_tokens("k"), held(None)), (0, 30), "acknowledged, maybe not rolled up");
        assert_eq!(held(Some(now)), 30, "rolled up before it was acknowledged: not it");
        let part = BudgetPart { tokens: 990, overdraft: false };
        let refused = ledger.hold("k", (1_000, 0), 980, part, Some(now));
        assert_eq!(refused, Err(Unheld::PartHeld { part: 990, holds: 30, tokens: 980 }), "counted until rolled up");
        assert_eq!(held(Some(now + Duration::from_millis(1))), 0);
        assert!(ledger.tallies.lock().unwrap().is_empty(), "a tally with nothing in it is dropped");
        // Many acknowledgements: the newest takes in those past the bound.
        for i in 0..100 {
            ledger.record(record("k", "m", 1), Hold::default());
            let batch = ledger.next_batch(usize::MAX).unwrap();
            ledger.acknowledged(&batch, now + Duration::from_secs(i));
        }
        let tally_len = ledger.tallies.lock().unwrap()["k"].acknowledged.len();
        assert_eq!((tally_len, held(None)), (MAX_ACKNOWLEDGED, 100));
        assert_eq!(held(Some(now + Duration::from_secs(98))), 37, "the newest holds the last 37, from the 64th on");
    }

    #[test]
    fn unacknowledged_tokens_count_until_their_batch_is_acknowledged() {
        let ledger = Ledger::new("dp", true);
        ledger.record(record("k", "m", 30), Hold::default());
        ledger.record(record("", "m", 50), Hold::default());
        assert_eq!(ledger.unacknowledged_tokens("k"), 30);
        let batch = ledger.next_batch(usize::MAX).unwrap();
        assert_eq!(ledger.unacknowledged_tokens("k"), 30, "sent is not acknowledged");
        ledger.acknowledged(&batch, Instant::now());
        assert_eq!(ledger.unacknowledged_tokens("k"), 0);
    }

    #[test]
    fn a_meter_records_once_and_a_dropped_one_as_cancelled() {
        let ledger = Ledger::new("dp", true);
        let meter =
            Meter::new(Arc::clone(&ledger), "r1", Some("k".into()), "m".into(), true, Counted::at_the_end(12), None);
        meter.served(Served { node: "node-a".into(), route: "placed", weighed: Default::default() });
        let clone = meter.clone();
        meter.finish(200, Outcome::Ok, Some(Usage { prompt_tokens: 10, completion_tokens: 4, cached_tokens: 6 }));
        clone.finish(500, Outcome::Error, None);
        drop((meter, clone));
        let unfinished = Meter::new(Arc::clone(&ledger), "r2", None, "m".into(), true, Counted::at_the_end(12), None);
        unfinished.data_events(2);
        drop(unfinished);

        let batch = ledger.next_batch(usize::MAX).unwrap();
        assert_eq!(batch.records.len(), 2);
        let (done, cancelled) = (&batch.records[0], &batch.records[1]);
        assert_eq!((done.request_id.as_str(), done.outcome.as_str(), done.status), ("r1", "ok", 200));
        assert_eq!((done.prompt_tokens, done.completion_tokens, done.cached_tokens), (10, 4, 6));
        assert_eq!((done.node_id.as_str(), done.estimated), ("node-a", false));
        assert_eq!((cancelled.outcome.as_str(), cancelled.estimated), ("cancelled", true));
        assert_eq!((cancelled.prompt_tokens, cancelled.completion_tokens), (12, 2));
    }

    #[test]
    fn a_batch_is_sent_again_unless_refused_for_what_it_holds() {
        for code in [tonic::Code::Unavailable, tonic::Code::DeadlineExceeded, tonic::Code::PermissionDenied] {
            assert!(resent(code), "{code:?}");
        }
        assert!(!resent(tonic::Code::InvalidArgument));
    }

    #[test]
    fn a_request_sent_to_a_node_settles_what_it_is_counted_for_once() {
        let ledger = Ledger::new("dp", false);
        let counted = Counted { usage: UsageIn::Tail, prompt_estimate: 12, output_limit: 300 };
        let (tx, rx) = std::sync::mpsc::channel();
        let settled = |tx: &std::sync::mpsc::Sender<(&'static str, u64)>, name| -> Settle {
            let tx = tx.clone();
            Box::new(move |spent| tx.send((name, spent)).expect("sent"))
        };
        let answered = Meter::new(Arc::clone(&ledger), "a", None, "m".into(), false, counted, None);
        answered.settles(settled(&tx, "answered"));
        answered.sent(Rates::default());
        answered.finish(
            200,
            Outcome::Ok,
            Some(Usage { prompt_tokens: 40, completion_tokens: 2_000, cached_tokens: 0 }),
        );
        answered.finish(200, Outcome::Ok, None);
        drop(answered);
        // One that never reached a node keeps the charge it entered with.
        let never_sent = Meter::new(Arc::clone(&ledger), "b", None, "m".into(), false, counted, None);
        never_sent.settles(settled(&tx, "never sent"));
        drop(never_sent);
        drop(tx);
        assert_eq!(rx.iter().collect::<Vec<_>>(), [("answered", 2_040)]);
    }

    #[test]
    fn a_whole_answer_cut_short_is_billed_what_its_node_may_have_generated() {
        let rates = Rates { prefill_tokens_per_second: 1_000.0, decode_tokens_per_second: 50.0, ..Rates::default() };
        // 2,000 prompt tokens read in 2 s, then 3 s of output at 50 a second.
        assert_eq!(generated(Duration::from_secs(5), 2_000, rates, 4_096), 150);
        assert_eq!(generated(Duration::from_secs(1), 2_000, rates, 4_096), 0, "still reading the prompt");
        assert_eq!(generated(Duration::from_secs(600), 2_000, rates, 4_096), 4_096, "at most its limit");
        let unknown = generated(Duration::from_millis(500), 2_000, Rates::default(), 4_096);
        assert_eq!(unknown, (UNKNOWN_DECODE_TOKENS_PER_SECOND / 2.0) as u64, "no rate known: a high one");
        let unread = Rates { prefill_tokens_per_second: 0.0, ..rates };
        assert_eq!(generated(Duration::from_secs(1), 2_000, unread, 4_096), 50);

        // Through a meter: a whole answer whose client left while its
        // node worked, and one never sent anywhere.
        let ledger = Ledger::new("dp", true);
        let counted = Counted { usage: UsageIn::Tail, prompt_estimate: 12, output_limit: 300 };
        // Any time at all past sending is the whole limit at this rate; the
        // clock is let move on past each `sent` (a nanosecond is enough).
        let fast = Rates { prefill_tokens_per_second: 0.0, decode_tokens_per_second: f64::MAX, ..Rates::default() };
        let clock_moves_on = || {
            let now = Instant::now();
            while Instant::now() <= now {}
        };
        let left = Meter::new(Arc::clone(&ledger), "sent", None, "m".into(), false, counted, None);
        left.sent(fast);
        clock_moves_on();
        drop(left);
        let queued = Meter::new(Arc::clone(&ledger), "queued", None, "m".into(), false, counted, None);
        drop(queued);
        // Answered, its usage kept out of the answer: guessed as well. A
        // batch (a TEI rerank says no usage) has no output to guess.
        let said_nothing = Meter::new(Arc::clone(&ledger), "ok", None, "m".into(), false, counted, None);
        said_nothing.sent(fast);
        clock_moves_on();
        said_nothing.finish(200, Outcome::Ok, None);
        let batch = Counted { output_limit: 0, ..counted };
        let rerank = Meter::new(Arc::clone(&ledger), "rerank", None, "m".into(), false, batch, None);
        rerank.sent(fast);
        rerank.finish(200, Outcome::Ok, None);
        let sent = ledger.next_batch(usize::MAX).unwrap();
        let billed: Vec<_> = sent.records.iter().map(|r| (r.prompt_tokens, r.completion_tokens, r.estimated)).collect();
        assert_eq!(billed, [(12, 300, true), (12, 0, true), (12, 300, true), (12, 0, true)]);
    }
}
