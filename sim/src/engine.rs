//! One simulated llama-server model instance: its slots, their KV caches, the
//! host prompt cache and the scheduling between them.
//!
//! [`EngineState`] holds every decision and does no I/O or waiting, so the
//! cache and slot rules are unit-tested directly. [`Engine`] wraps it in a lock
//! and adds the waiting for a free slot and the simulated compute time.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;

use super::tokens::{Generator, token_id};
use super::{SimModel, SimStats};

/// Sizes that shape one engine, taken from [`super::SimConfig`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct EngineParams {
    pub slots: usize,
    /// Per-slot context window: llama-server splits `-c` evenly over `-np`.
    pub n_ctx_slot: usize,
    /// Capacity of the host prompt cache in tokens; 0 disables it.
    pub cache_ram_tokens: u64,
}

/// Simulated compute speed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Timing {
    pub prefill_tokens_per_second: f64,
    pub decode_tokens_per_second: f64,
}

impl Timing {
    fn prefill(&self, tokens: usize) -> Duration {
        secs(tokens as f64 / self.prefill_tokens_per_second)
    }

    fn per_token(&self) -> Duration {
        secs(1.0 / self.decode_tokens_per_second)
    }
}

fn secs(s: f64) -> Duration {
    // Config validation keeps the rates finite and positive; this guards the
    // conversion against anything that slips through rather than panicking.
    Duration::try_from_secs_f64(s).unwrap_or(Duration::ZERO)
}

/// Sleeps unless the duration is zero, so that tests with very fast engines
/// do not pay timer granularity per token.
async fn pause(d: Duration) {
    if !d.is_zero() {
        tokio::time::sleep(d).await;
    }
}

/// Why a request cannot be admitted at all (as opposed to having to wait).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum AdmitError {
    #[error("request ({n_prompt} tokens) exceeds the available context size ({n_ctx} tokens), try increasing it")]
    ExceedContext { n_prompt: usize, n_ctx: usize },
    #[error("invalid id_slot {id_slot}: the server has {slots} slots")]
    InvalidSlot { id_slot: usize, slots: usize },
}

/// Length of the common prefix of two token lists.
pub(crate) fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[derive(Debug, Default, Clone)]
struct Slot {
    /// Tokens whose KV entries the slot holds.
    tokens: Vec<u32>,
    busy: bool,
    last_used: u64,
    id_task: Option<u64>,
    n_prompt_tokens: usize,
    n_prompt_tokens_processed: usize,
    n_prompt_tokens_cache: usize,
    n_decoded: usize,
    n_remain: usize,
}

/// llama-server's `--cache-ram`: KV state of prompts evicted from slots, kept
/// in host memory so another slot can restore a long prefix later.
#[derive(Debug)]
struct HostCache {
    capacity: u64,
    used: u64,
    /// Oldest first.
    entries: VecDeque<Vec<u32>>,
}

impl HostCache {
    fn new(capacity: u64) -> HostCache {
        HostCache { capacity, used: 0, entries: VecDeque::new() }
    }

    fn save(&mut self, tokens: Vec<u32>) {
        let len = tokens.len() as u64;
        if len == 0 || len > self.capacity {
            return;
        }
        // An entry that already extends these tokens serves every prompt this
        // one could, so storing both would only waste capacity.
        if self.entries.iter().any(|e| e.starts_with(&tokens)) {
            return;
        }
        let mut freed = 0u64;
        self.entries.retain(|e| {
            let redundant = tokens.starts_with(e);
            if redundant {
                freed += e.len() as u64;
            }
            !redundant
        });
        self.used -= freed;
        while self.used + len > self.capacity {
            match self.entries.pop_front() {
                Some(old) => self.used -= old.len() as u64,
                None => break,
            }
        }
        self.used += len;
        self.entries.push_back(tokens);
    }

    /// Removes and returns the entry sharing the longest prefix with `prompt`,
    /// if that prefix is longer than `better_than`.
    fn take_best(&mut self, prompt: &[u32], better_than: usize) -> Option<(Vec<u32>, usize)> {
        let (idx, lcp) = self
            .entries
            .iter()
            .enumerate()
            .map(|(i, e)| (i, common_prefix(e, prompt)))
            .filter(|(_, lcp)| *lcp > better_than)
            // Ties go to the most recently saved entry.
            .max_by_key(|(i, lcp)| (*lcp, *i))?;
        let entry = self.entries.remove(idx)?;
        self.used -= entry.len() as u64;
        Some((entry, lcp))
    }

    #[cfg(test)]
    fn tokens(&self) -> u64 {
        self.used
    }
}

/// The outcome of admitting a request into a slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Admission {
    pub slot: usize,
    /// Prompt tokens whose KV state is reused, never the whole prompt.
    pub cached: usize,
    pub id_task: u64,
    /// Whether the reused prefix came from the host prompt cache.
    pub restored: bool,
}

/// Counters behind `/metrics`, named after llama-server's.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Metrics {
    pub prompt_tokens_total: u64,
    pub prompt_tokens_cached_total: u64,
    pub prompt_seconds_total: f64,
    pub tokens_predicted_total: u64,
    pub tokens_predicted_seconds_total: f64,
    pub n_decode_total: u64,
    pub n_busy_slots_total: u64,
    pub n_tokens_max: u64,
    pub requests_processing: u64,
    pub requests_deferred: u64,
}

/// What `/slots` reports for one slot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SlotView {
    pub id: usize,
    pub n_ctx: usize,
    pub is_processing: bool,
    pub id_task: Option<u64>,
    pub n_prompt_tokens: usize,
    pub n_prompt_tokens_processed: usize,
    pub n_prompt_tokens_cache: usize,
    pub n_decoded: usize,
    pub n_remain: usize,
    pub n_cached_tokens: usize,
}

/// Slots, caches and counters of one engine. Pure: no I/O, no clocks.
#[derive(Debug)]
pub(crate) struct EngineState {
    params: EngineParams,
    slots: Vec<Slot>,
    host: HostCache,
    /// Logical clock for least-recently-used ordering.
    clock: u64,
    next_task: u64,
    metrics: Metrics,
    /// Requests waiting for a slot, first come first: llama-server keeps
    /// its deferred tasks in order and puts the first back ahead of new
    /// ones when a slot frees, so a request never overtakes one deferred
    /// before it.
    deferred: std::collections::VecDeque<u64>,
    next_deferred: u64,
}

impl EngineState {
    pub(crate) fn new(params: EngineParams) -> EngineState {
        EngineState {
            params,
            slots: vec![Slot::default(); params.slots],
            host: HostCache::new(params.cache_ram_tokens),
            clock: 0,
            next_task: 0,
            metrics: Metrics::default(),
            deferred: std::collections::VecDeque::new(),
            next_deferred: 0,
        }
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Puts a prompt into a slot. `Ok(None)` means no suitable slot is idle and
    /// the request has to wait.
    pub(crate) fn admit(&mut self, prompt: &[u32], id_slot: Option<usize>) -> Result<Option<Admission>, AdmitError> {
        let n_ctx = self.params.n_ctx_slot;
        if prompt.len() > n_ctx {
            return Err(AdmitError::ExceedContext { n_prompt: prompt.len(), n_ctx });
        }
        let idx = match id_slot {
            Some(id) if id >= self.slots.len() => {
                return Err(AdmitError::InvalidSlot { id_slot: id, slots: self.slots.len() });
            }
            // A pinned slot that is busy makes the request wait even when
            // other slots are idle, as llama-server does.
            Some(id) if self.slots[id].busy => return Ok(None),
            Some(id) => id,
            None => match self.pick_slot(prompt) {
                Some(i) => i,
                None => return Ok(None),
            },
        };

        let old = std::mem::take(&mut self.slots[idx].tokens);
        let slot_lcp = common_prefix(&old, prompt);
        // Look up the host cache before saving into it, so the save cannot
        // evict the entry this request is about to restore.
        let restored = self.host.take_best(prompt, slot_lcp);
        if slot_lcp < old.len() {
            self.host.save(old);
        }
        let reuse = restored.as_ref().map_or(slot_lcp, |(_, lcp)| *lcp);
        // llama-server always evaluates at least the last prompt token, to get
        // logits to sample from.
        let cached = reuse.min(prompt.len().saturating_sub(1));

        let id_task = self.next_task;
        self.next_task += 1;
        let now = self.tick();
        let slot = &mut self.slots[idx];
        slot.tokens = prompt.to_vec();
        slot.busy = true;
        slot.last_used = now;
        slot.id_task = Some(id_task);
        slot.n_prompt_tokens = prompt.len();
        slot.n_prompt_tokens_processed = prompt.len() - cached;
        slot.n_prompt_tokens_cache = cached;
        slot.n_decoded = 0;
        slot.n_remain = n_ctx - prompt.len();
        self.metrics.requests_processing += 1;
        self.metrics.n_tokens_max = self.metrics.n_tokens_max.max(prompt.len() as u64);
        Ok(Some(Admission { slot: idx, cached, id_task, restored: restored.is_some() }))
    }

    /// llama-server's rule: the idle slot sharing the longest prefix with the
    /// prompt if that prefix is over 10% of it, else the least recently used.
    fn pick_slot(&self, prompt: &[u32]) -> Option<usize> {
        let idle = || self.slots.iter().enumerate().filter(|(_, s)| !s.busy);
        let (best, best_lcp) = idle()
            .map(|(i, s)| (i, common_prefix(&s.tokens, prompt)))
            // Prefer the lower id among equals, like llama-server's scan.
            .max_by_key(|(i, lcp)| (*lcp, std::cmp::Reverse(*i)))?;
        if best_lcp as f64 > 0.1 * prompt.len() as f64 {
            return Some(best);
        }
        idle().min_by_key(|(i, s)| (s.last_used, *i)).map(|(i, _)| i)
    }

    pub(crate) fn record_prompt(&mut self, processed: usize, cached: usize, seconds: f64) {
        self.metrics.prompt_tokens_total += processed as u64;
        self.metrics.prompt_tokens_cached_total += cached as u64;
        self.metrics.prompt_seconds_total += seconds;
        if processed > 0 {
            self.metrics.n_decode_total += 1;
            self.metrics.n_busy_slots_total += self.busy_slots() as u64;
        }
    }

    /// Accounts one decoded token. `feed` is the previously sampled token,
    /// which this decode step writes into the slot's KV cache.
    pub(crate) fn record_token(&mut self, slot: usize, feed: Option<u32>, seconds: f64) {
        let busy = self.busy_slots() as u64;
        let Some(s) = self.slots.get_mut(slot) else {
            return;
        };
        if let Some(t) = feed {
            s.tokens.push(t);
        }
        s.n_decoded += 1;
        s.n_remain = s.n_remain.saturating_sub(1);
        let len = s.tokens.len() as u64;
        let m = &mut self.metrics;
        m.n_tokens_max = m.n_tokens_max.max(len);
        m.tokens_predicted_total += 1;
        m.tokens_predicted_seconds_total += seconds;
        m.n_decode_total += 1;
        m.n_busy_slots_total += busy;
    }

    pub(crate) fn release(&mut self, slot: usize) {
        let now = self.tick();
        if let Some(s) = self.slots.get_mut(slot)
            && s.busy
        {
            s.busy = false;
            s.last_used = now;
            self.metrics.requests_processing = self.metrics.requests_processing.saturating_sub(1);
        }
    }

    pub(crate) fn busy_slots(&self) -> usize {
        self.slots.iter().filter(|s| s.busy).count()
    }

    pub(crate) fn slot_count(&self) -> usize {
        self.slots.len()
    }

    #[cfg(test)]
    pub(crate) fn slot_tokens(&self, slot: usize) -> &[u32] {
        self.slots.get(slot).map_or(&[], |s| s.tokens.as_slice())
    }

    #[cfg(test)]
    pub(crate) fn host_cache_tokens(&self) -> u64 {
        self.host.tokens()
    }

    pub(crate) fn metrics(&self) -> Metrics {
        self.metrics.clone()
    }

    pub(crate) fn slot_views(&self) -> Vec<SlotView> {
        self.slots
            .iter()
            .enumerate()
            .map(|(id, s)| SlotView {
                id,
                n_ctx: self.params.n_ctx_slot,
                is_processing: s.busy,
                id_task: s.id_task,
                n_prompt_tokens: s.n_prompt_tokens,
                n_prompt_tokens_processed: s.n_prompt_tokens_processed,
                n_prompt_tokens_cache: s.n_prompt_tokens_cache,
                n_decoded: s.n_decoded,
                n_remain: s.n_remain,
                n_cached_tokens: s.tokens.len(),
            })
            .collect()
    }
}

/// Totals across every engine of a simulator, for tests.
#[derive(Debug, Default)]
pub(crate) struct StatCounters {
    requests: AtomicU64,
    prompt_tokens: AtomicU64,
    cached_tokens: AtomicU64,
    completion_tokens: AtomicU64,
}

impl StatCounters {
    pub(crate) fn add_request(&self, prompt_tokens: usize, cached_tokens: usize) {
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.prompt_tokens.fetch_add(prompt_tokens as u64, Ordering::Relaxed);
        self.cached_tokens.fetch_add(cached_tokens as u64, Ordering::Relaxed);
    }

    fn add_completion_token(&self) {
        self.completion_tokens.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> SimStats {
        SimStats {
            requests: self.requests.load(Ordering::Relaxed),
            prompt_tokens: self.prompt_tokens.load(Ordering::Relaxed),
            cached_tokens: self.cached_tokens.load(Ordering::Relaxed),
            completion_tokens: self.completion_tokens.load(Ordering::Relaxed),
        }
    }
}

/// One loaded model: shared by the handlers serving it.
#[derive(Debug)]
pub(crate) struct Engine {
    model: SimModel,
    params: EngineParams,
    timing: Timing,
    state: Mutex<EngineState>,
    /// Woken whenever a slot frees up.
    freed: Notify,
    stats: Arc<StatCounters>,
}

impl Engine {
    pub(crate) fn new(model: SimModel, params: EngineParams, timing: Timing, stats: Arc<StatCounters>) -> Arc<Engine> {
        Arc::new(Engine {
            model,
            params,
            timing,
            state: Mutex::new(EngineState::new(params)),
            freed: Notify::new(),
            stats,
        })
    }

    /// The state lock is only ever held for short, synchronous updates, so a
    /// poisoned lock still holds consistent data.
    fn lock(&self) -> MutexGuard<'_, EngineState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn model(&self) -> &SimModel {
        &self.model
    }

    pub(crate) fn params(&self) -> EngineParams {
        self.params
    }

    pub(crate) fn timing(&self) -> Timing {
        self.timing
    }

    pub(crate) fn stats(&self) -> &StatCounters {
        &self.stats
    }

    /// (busy slots, all slots).
    pub(crate) fn busy(&self) -> (usize, usize) {
        let st = self.lock();
        (st.busy_slots(), st.slot_count())
    }

    pub(crate) fn metrics(&self) -> Metrics {
        self.lock().metrics()
    }

    pub(crate) fn slot_views(&self) -> Vec<SlotView> {
        self.lock().slot_views()
    }

    #[cfg(test)]
    pub(crate) fn with_state<R>(&self, f: impl FnOnce(&EngineState) -> R) -> R {
        f(&self.lock())
    }

    /// Waits for a slot and admits the prompt into it. `n_predict` of `None`
    /// generates until the slot's context is full.
    pub(crate) async fn acquire(
        self: &Arc<Self>,
        prompt: Vec<u32>,
        id_slot: Option<usize>,
        n_predict: Option<usize>,
    ) -> Result<Lease, AdmitError> {
        let mut deferred: Option<DeferredGuard> = None;
        loop {
            // Register for the wake-up before checking, so a slot freed in
            // between is not missed.
            let notified = self.freed.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            let outcome = {
                let mut st = self.lock();
                // Only the first of those waiting may take a slot; a new
                // request waits behind them.
                let turn = match &deferred {
                    Some(guard) => st.deferred.front() == Some(&guard.ticket),
                    None => st.deferred.is_empty(),
                };
                let outcome = if turn { st.admit(&prompt, id_slot) } else { Ok(None) };
                if matches!(outcome, Ok(None)) && deferred.is_none() {
                    st.metrics.requests_deferred += 1;
                    let ticket = st.next_deferred;
                    st.next_deferred += 1;
                    st.deferred.push_back(ticket);
                    deferred = Some(DeferredGuard { engine: Arc::clone(self), ticket });
                }
                outcome
            };
            match outcome {
                Err(e) => return Err(e),
                Ok(Some(admission)) => {
                    drop(deferred);
                    self.stats.add_request(prompt.len(), admission.cached);
                    let room = self.params.n_ctx_slot - prompt.len();
                    return Ok(Lease {
                        engine: Arc::clone(self),
                        admission,
                        generator: Generator::new(&prompt),
                        prompt_tokens: prompt.len(),
                        n_predict: n_predict.map_or(room, |n| n.min(room)),
                        generated: 0,
                        pending: None,
                        read: admission.cached,
                        prefilled: false,
                    });
                }
                Ok(None) => {}
            }
            notified.await;
        }
    }
}

/// A waiting request's place in line: taken out, and `requests_deferred`
/// kept right, when it is admitted or abandoned by its client; the next in
/// line is woken then, as another slot may be free.
struct DeferredGuard {
    engine: Arc<Engine>,
    ticket: u64,
}

impl Drop for DeferredGuard {
    fn drop(&mut self) {
        {
            let mut st = self.engine.lock();
            st.metrics.requests_deferred = st.metrics.requests_deferred.saturating_sub(1);
            st.deferred.retain(|ticket| *ticket != self.ticket);
        }
        self.engine.freed.notify_waiters();
    }
}

/// Nominal timings of one request, in llama-server's `timings` terms.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Timings {
    pub cache_n: usize,
    pub prompt_n: usize,
    pub prompt_ms: f64,
    pub predicted_n: usize,
    pub predicted_ms: f64,
}

/// A slot held by one request; dropping it frees the slot, which also covers
/// clients that disconnect mid-request.
#[derive(Debug)]
pub(crate) struct Lease {
    engine: Arc<Engine>,
    admission: Admission,
    generator: Generator,
    prompt_tokens: usize,
    n_predict: usize,
    generated: usize,
    /// The last sampled token, which enters the KV cache only when the next
    /// decode step feeds it back. The final token of a reply never does.
    pending: Option<u32>,
    /// The prompt's tokens read so far, the cached ones included.
    read: usize,
    /// The prompt was read whole and accounted.
    prefilled: bool,
}

impl Lease {
    pub(crate) fn admission(&self) -> Admission {
        self.admission
    }

    pub(crate) fn prompt_tokens(&self) -> usize {
        self.prompt_tokens
    }

    pub(crate) fn cached(&self) -> usize {
        self.admission.cached
    }

    #[cfg(test)]
    pub(crate) fn n_predict(&self) -> usize {
        self.n_predict
    }

    pub(crate) fn generated(&self) -> usize {
        self.generated
    }

    /// Spends the time to evaluate the uncached part of the prompt.
    pub(crate) async fn prefill(&mut self) {
        while self.prefill_batch(usize::MAX).await.is_some() {}
    }

    /// Evaluates up to `batch` more of the prompt's tokens, as llama-server
    /// reads a prompt a batch at a time: the tokens read so far after it,
    /// `None` once the prompt was read whole.
    pub(crate) async fn prefill_batch(&mut self, batch: usize) -> Option<usize> {
        let left = self.prompt_tokens.saturating_sub(self.read);
        if left == 0 {
            if !self.prefilled {
                self.prefilled = true;
                let processed = self.prompt_tokens - self.cached();
                let seconds = self.engine.timing.prefill(processed).as_secs_f64();
                self.engine.lock().record_prompt(processed, self.cached(), seconds);
            }
            return None;
        }
        let n = left.min(batch.max(1));
        pause(self.engine.timing.prefill(n)).await;
        self.read += n;
        Some(self.read)
    }

    /// Decodes the next token; `None` once `n_predict` tokens were produced.
    pub(crate) async fn next_piece(&mut self) -> Option<&'static str> {
        let piece = self.generator.piece(self.generated);
        self.decode(piece).await.then_some(piece)
    }

    /// Decodes `piece` as the next token, one a request's form dictates (as
    /// a grammar holds a model to a tool call); false once `n_predict`
    /// tokens were produced.
    pub(crate) async fn decode(&mut self, piece: &str) -> bool {
        if self.generated >= self.n_predict {
            return false;
        }
        let d = self.engine.timing.per_token();
        pause(d).await;
        self.engine.lock().record_token(self.admission.slot, self.pending.take(), d.as_secs_f64());
        self.pending = Some(token_id(piece));
        self.generated += 1;
        self.engine.stats.add_completion_token();
        true
    }

    pub(crate) fn timings(&self) -> Timings {
        let t = self.engine.timing;
        let prompt_n = self.prompt_tokens - self.cached();
        Timings {
            cache_n: self.cached(),
            prompt_n,
            prompt_ms: t.prefill(prompt_n).as_secs_f64() * 1e3,
            predicted_n: self.generated,
            predicted_ms: t.per_token().as_secs_f64() * 1e3 * self.generated as f64,
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.engine.lock().release(self.admission.slot);
        self.engine.freed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokens::{ChatMessage, render_chatml, tokenize};

    fn params(slots: usize, n_ctx_slot: usize, cache_ram_tokens: u64) -> EngineParams {
        EngineParams { slots, n_ctx_slot, cache_ram_tokens }
    }

    fn model() -> SimModel {
        SimModel::chat("m")
    }

    fn fast_engine(p: EngineParams) -> Arc<Engine> {
        // Rates this high round every simulated duration down to zero.
        let timing = Timing { prefill_tokens_per_second: 1e15, decode_tokens_per_second: 1e15 };
        Engine::new(model(), p, timing, Arc::new(StatCounters::default()))
    }

    fn chat(turns: &[(&str, &str)]) -> Vec<u32> {
        let msgs: Vec<ChatMessage> =
            turns.iter().map(|(r, c)| ChatMessage { role: (*r).into(), content: (*c).into() }).collect();
        tokenize(&render_chatml(&msgs))
    }

    fn toks(n: u32, base: u32) -> Vec<u32> {
        (base..base + n).collect()
    }

    /// Runs one full request on an engine, returning (cached, reply).
    async fn run(engine: &Arc<Engine>, prompt: Vec<u32>, n: usize) -> (usize, String) {
        let mut lease = engine.acquire(prompt, None, Some(n)).await.unwrap();
        lease.prefill().await;
        let mut reply = String::new();
        while let Some(p) = lease.next_piece().await {
            reply.push_str(p);
        }
        (lease.cached(), reply)
    }

    #[tokio::test]
    async fn second_turn_reuses_first_turn_prompt_and_reply() {
        let engine = fast_engine(params(1, 4096, 0));
        let turn1 = chat(&[("user", "tell me about routing")]);
        let (cached1, reply) = run(&engine, turn1.clone(), 16).await;
        assert_eq!(cached1, 0);
        let reply_tokens = tokenize(&reply).len();
        assert_eq!(reply_tokens, 16);

        let turn2 = chat(&[("user", "tell me about routing"), ("assistant", &reply), ("user", "and caching?")]);
        let (cached2, _) = run(&engine, turn2, 8).await;
        // The final sampled token of turn one never entered the KV cache.
        assert_eq!(cached2, turn1.len() + reply_tokens - 1);
        let stats = engine.stats().snapshot();
        assert_eq!(stats.requests, 2);
        assert_eq!(stats.cached_tokens, cached2 as u64);
        assert_eq!(stats.completion_tokens, 24);
    }

    #[test]
    fn slot_choice_prefers_matching_prefix() {
        let mut st = EngineState::new(params(3, 1000, 0));
        let a = toks(50, 0);
        let b = toks(50, 1000);
        let sa = st.admit(&a, None).unwrap().unwrap();
        let sb = st.admit(&b, None).unwrap().unwrap();
        st.release(sa.slot);
        st.release(sb.slot);
        // A continuation of `b` goes back to b's slot, not the LRU one.
        let mut b2 = b.clone();
        b2.extend(toks(10, 5000));
        let again = st.admit(&b2, None).unwrap().unwrap();
        assert_eq!(again.slot, sb.slot);
        assert_eq!(again.cached, 50);
    }

    #[test]
    fn unrelated_prompt_takes_least_recently_used_slot() {
        let mut st = EngineState::new(params(2, 1000, 0));
        let first = st.admit(&toks(20, 0), None).unwrap().unwrap();
        st.release(first.slot);
        let second = st.admit(&toks(20, 100), None).unwrap().unwrap();
        assert_ne!(first.slot, second.slot);
        st.release(second.slot);
        let third = st.admit(&toks(20, 200), None).unwrap().unwrap();
        assert_eq!(third.slot, first.slot);
        assert_eq!(third.cached, 0);
    }

    #[test]
    fn small_overlap_does_not_attract() {
        let mut st = EngineState::new(params(2, 1000, 0));
        let a = st.admit(&toks(100, 0), None).unwrap().unwrap();
        st.release(a.slot);
        let b = st.admit(&toks(100, 500), None).unwrap().unwrap();
        st.release(b.slot);
        // Shares 5 of 100 tokens with slot b: below 10%, so the least
        // recently used slot a wins and nothing is reused.
        let mut p = toks(5, 500);
        p.extend(toks(95, 9000));
        let c = st.admit(&p, None).unwrap().unwrap();
        assert_eq!(c.slot, a.slot);
        assert_eq!(c.cached, 0);
    }

    #[test]
    fn host_cache_restores_prefix_after_slot_reuse() {
        let mut st = EngineState::new(params(1, 1000, 10_000));
        let a = toks(200, 0);
        let x = st.admit(&a, None).unwrap().unwrap();
        st.release(x.slot);
        // An unrelated prompt overwrites the only slot; `a` goes to host RAM.
        let y = st.admit(&toks(50, 7000), None).unwrap().unwrap();
        assert_eq!(y.cached, 0);
        st.release(y.slot);
        assert_eq!(st.host_cache_tokens(), 200);

        let mut a2 = a.clone();
        a2.extend(toks(20, 9000));
        let z = st.admit(&a2, None).unwrap().unwrap();
        assert!(z.restored);
        assert_eq!(z.cached, 200);
        // The restored entry left the host cache; the evicted one took its place.
        assert_eq!(st.host_cache_tokens(), 50);
    }

    #[test]
    fn host_cache_disabled_and_bounded() {
        let mut st = EngineState::new(params(1, 1000, 0));
        let x = st.admit(&toks(200, 0), None).unwrap().unwrap();
        st.release(x.slot);
        st.admit(&toks(50, 7000), None).unwrap().unwrap();
        assert_eq!(st.host_cache_tokens(), 0);

        let mut host = HostCache::new(100);
        host.save(toks(60, 0));
        host.save(toks(60, 100));
        assert_eq!(host.tokens(), 60, "oldest entry evicted to fit");
        host.save(toks(101, 500));
        assert_eq!(host.tokens(), 60, "entries over capacity are skipped");
        host.save(toks(80, 100));
        assert_eq!(host.tokens(), 80, "a prefix entry is superseded");
    }

    #[test]
    fn cached_never_covers_the_whole_prompt() {
        let mut st = EngineState::new(params(1, 1000, 0));
        let p = toks(30, 0);
        let a = st.admit(&p, None).unwrap().unwrap();
        st.release(a.slot);
        let b = st.admit(&p, None).unwrap().unwrap();
        assert_eq!(b.cached, 29);
        st.release(b.slot);
        // A prompt that is a strict prefix of the slot's tokens.
        let c = st.admit(&p[..10], None).unwrap().unwrap();
        assert_eq!(c.cached, 9);
        st.release(c.slot);
        let d = st.admit(&[], None).unwrap().unwrap();
        assert_eq!(d.cached, 0);
    }

    #[test]
    fn context_overflow_is_rejected() {
        let mut st = EngineState::new(params(2, 64, 0));
        let err = st.admit(&toks(65, 0), None).unwrap_err();
        assert_eq!(err, AdmitError::ExceedContext { n_prompt: 65, n_ctx: 64 });
        assert_eq!(
            err.to_string(),
            "request (65 tokens) exceeds the available context size (64 tokens), try increasing it"
        );
        assert!(st.admit(&toks(64, 0), None).unwrap().is_some());
    }

    #[test]
    fn pinned_busy_slot_waits_and_bad_pin_fails() {
        let mut st = EngineState::new(params(2, 100, 0));
        let a = st.admit(&toks(5, 0), Some(1)).unwrap().unwrap();
        assert_eq!(a.slot, 1);
        assert_eq!(st.admit(&toks(5, 0), Some(1)).unwrap(), None);
        assert!(matches!(st.admit(&toks(5, 0), Some(2)), Err(AdmitError::InvalidSlot { .. })));
    }

    #[test]
    fn no_idle_slot_means_wait() {
        let mut st = EngineState::new(params(1, 100, 0));
        let a = st.admit(&toks(5, 0), None).unwrap().unwrap();
        assert_eq!(st.admit(&toks(5, 0), None).unwrap(), None);
        st.release(a.slot);
        assert!(st.admit(&toks(5, 0), None).unwrap().is_some());
    }

    #[tokio::test]
    async fn waiter_is_deferred_then_woken_when_slot_frees() {
        let engine = fast_engine(params(1, 100, 0));
        let first = engine.acquire(toks(5, 0), None, Some(1)).await.unwrap();
        let e2 = Arc::clone(&engine);
        let waiter = tokio::spawn(async move { e2.acquire(toks(5, 50), None, Some(1)).await });
        // Wait until the waiter is registered as deferred, by condition.
        loop {
            if engine.metrics().requests_deferred == 1 {
                break;
            }
            tokio::task::yield_now().await;
        }
        assert_eq!(engine.metrics().requests_processing, 1);
        drop(first);
        let second = waiter.await.unwrap().unwrap();
        assert_eq!(second.admission().slot, 0);
        assert_eq!(engine.metrics().requests_deferred, 0);
    }

    #[tokio::test]
    async fn waiting_requests_take_slots_in_the_order_they_came() {
        let engine = fast_engine(params(1, 100, 0));
        let first = engine.acquire(toks(5, 0), None, Some(1)).await.unwrap();
        let (order, mut waiters) = (Arc::new(std::sync::Mutex::new(Vec::new())), Vec::new());
        for i in 0..8u32 {
            let (waiting, order) = (Arc::clone(&engine), Arc::clone(&order));
            waiters.push(tokio::spawn(async move {
                let lease = waiting.acquire(toks(5, 10 + i), None, Some(1)).await.unwrap();
                order.lock().unwrap().push(i);
                drop(lease);
            }));
            // Each is deferred before the next comes.
            while engine.metrics().requests_deferred < u64::from(i) + 1 {
                tokio::task::yield_now().await;
            }
        }
        drop(first);
        // A newcomer, the moment the slot frees, does not take it.
        let newcomer = tokio::select! {
            biased;
            lease = engine.acquire(toks(5, 99), None, Some(1)) => Some(lease.map(|l| l.admission().slot)),
            () = std::future::ready(()) => None,
        };
        assert!(newcomer.is_none(), "a new request took the slot from those waiting before it: {newcomer:?}");
        for waiter in waiters {
            waiter.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), (0..8).collect::<Vec<_>>(), "first come, first served");
    }

    #[tokio::test]
    async fn generation_is_deterministic_and_respects_context() {
        let e1 = fast_engine(params(1, 40, 0));
        let e2 = fast_engine(params(1, 40, 0));
        let p = toks(30, 0);
        let (_, r1) = run(&e1, p.clone(), 6).await;
        let (_, r2) = run(&e2, p.clone(), 6).await;
        assert_eq!(r1, r2);
        let lease = e1.acquire(p, None, None).await.unwrap();
        assert_eq!(lease.n_predict(), 10, "unbounded replies stop at the window");
    }

    #[tokio::test]
    async fn dropped_lease_keeps_partial_reply_in_cache() {
        let engine = fast_engine(params(1, 100, 0));
        let mut lease = engine.acquire(toks(10, 0), None, Some(8)).await.unwrap();
        lease.prefill().await;
        lease.next_piece().await.unwrap();
        lease.next_piece().await.unwrap();
        lease.next_piece().await.unwrap();
        drop(lease);
        engine.with_state(|st| {
            assert_eq!(st.busy_slots(), 0);
            assert_eq!(st.slot_tokens(0).len(), 12);
        });
    }
}
