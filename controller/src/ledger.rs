//! The usage ledger's leader: one controller at a time (an etcd election)
//! rolls pending batches up into hourly per-key, per-model totals and
//! today's tokens per key, and prunes what is past retention.
//!
//! Correctness does not rest on the election: a batch is applied in one
//! transaction that deletes it from `pending` and is guarded by the
//! revisions it was computed from, so two controllers that both believe
//! they lead can waste work but never count a batch twice or lose an
//! update. The election keeps them from wasting it.

use std::collections::BTreeMap;
use std::time::Duration;

use inferyes_proto::v1::{KeyUsageToday, UsageBatch, UsageRollup};

use tokio_util::sync::CancellationToken;

pub use inferyes_proto::usage::{add, hour_of, hour_start_ms, merge};

use crate::store::{Application, EtcdStore, Lease, StoreError};

/// How long raw records and roll-ups are kept.
#[derive(Clone, Copy, Debug)]
pub struct Retention {
    pub rollup_days: u64,
    pub raw_days: u64,
}

/// `applied` markers outlive any resend of their batch by far.
const APPLIED_DAYS: u64 = 2;
const LEADER_TTL: Duration = Duration::from_secs(6);
const POLL: Duration = Duration::from_millis(250);
const PRUNE_EVERY: Duration = Duration::from_secs(600);
const BATCHES_PER_ROUND: i64 = 64;

/// One roll-up: an hour (`YYYYMMDDHH`), a key (empty: auth off) and a
/// model. Stored at `hourly/<hour>/<key or ->/<model>`: written and read in
/// this one place.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct RollupKey {
    pub hour: String,
    pub key_id: String,
    pub model: String,
}

impl RollupKey {
    pub fn suffix(&self) -> String {
        let key = if self.key_id.is_empty() { "-" } else { self.key_id.as_str() };
        format!("hourly/{}/{key}/{}", self.hour, self.model)
    }

    /// The key a stored suffix names; models may hold `/`.
    pub fn parse(suffix: &str) -> Option<RollupKey> {
        let mut parts = suffix.strip_prefix("hourly/")?.splitn(3, '/');
        let (hour, key, model) = (parts.next()?, parts.next()?, parts.next()?);
        let key_id = if key == "-" { String::new() } else { key.to_string() };
        Some(RollupKey { hour: hour.to_string(), key_id, model: model.to_string() })
    }
}

/// Why a data plane's batch is not taken, if it is not: every hour it
/// names (its id's, its sums', its records') must be a real one no more
/// than an hour ahead of `now_ms`, or its keys in etcd would never be
/// pruned; every key id and model must fit a roll-up's key.
pub fn check_batch(batch: &UsageBatch, now_ms: u64) -> Result<(), String> {
    let latest = now_ms.saturating_add(3_600_000);
    let hour_ok = |hour: &str| hour_start_ms(hour).is_some_and(|start| start <= latest && hour_of(start) == hour);
    let name_ok = |key_id: &str, model: &str| {
        key_id.len() <= inferyes_proto::MAX_NAME_BYTES
            && !key_id.contains('/')
            && model.len() <= inferyes_proto::MAX_NAME_BYTES
    };
    if !batch.batch_id.split_once('.').is_some_and(|(hour, _)| hour_ok(hour)) {
        return Err("batch_id must start with its hour (YYYYMMDDHH, not ahead) and a dot".into());
    }
    for delta in &batch.deltas {
        if !hour_ok(&delta.hour) {
            return Err(format!("`{}` is not an hour (YYYYMMDDHH, UTC, not ahead)", delta.hour.escape_debug()));
        }
        if !name_ok(&delta.key_id, &delta.model) {
            return Err("a key id or model name is too long, or a key id holds `/`".into());
        }
    }
    for record in &batch.records {
        if record.unix_ms > latest {
            return Err("a record is dated more than an hour ahead".into());
        }
        if !name_ok(&record.key_id, &record.model) {
            return Err("a key id or model name is too long, or a key id holds `/`".into());
        }
    }
    Ok(())
}

/// A batch's contribution, per roll-up: its deltas (summed by the data
/// plane), or, from data planes that send only records, its records.
pub fn rollup_deltas(batch: &UsageBatch) -> BTreeMap<RollupKey, UsageRollup> {
    let mut deltas: BTreeMap<RollupKey, UsageRollup> = BTreeMap::new();
    if batch.deltas.is_empty() {
        for record in &batch.records {
            let key =
                RollupKey { hour: hour_of(record.unix_ms), key_id: record.key_id.clone(), model: record.model.clone() };
            add(deltas.entry(key).or_default(), record);
        }
    }
    for delta in &batch.deltas {
        let key = RollupKey { hour: delta.hour.clone(), key_id: delta.key_id.clone(), model: delta.model.clone() };
        merge(deltas.entry(key).or_default(), &delta.usage.unwrap_or_default());
    }
    deltas
}

/// Adds a batch's tokens (its [`rollup_deltas`]) to today's per-key totals;
/// a new day starts over. Returns whether the totals changed: a batch
/// without keys changes nothing, and so is not written.
pub fn add_today(today: &mut KeyUsageToday, deltas: &BTreeMap<RollupKey, UsageRollup>, now_ms: u64) -> bool {
    let day = &hour_of(now_ms)[..8];
    let mut changed = false;
    for (key, usage) in deltas {
        if key.key_id.is_empty() || !key.hour.starts_with(day) {
            continue;
        }
        // A new day starts over, once there is something to count in it.
        if today.day != day {
            *today = KeyUsageToday { day: day.to_string(), tokens: Default::default() };
            changed = true;
        }
        let tokens = usage.prompt_tokens + usage.completion_tokens;
        if tokens > 0 {
            *today.tokens.entry(key.key_id.clone()).or_default() += tokens;
            changed = true;
        }
    }
    changed
}

/// Campaigns, then leads until shutdown or until etcd takes the lead away.
/// `leading` holds the leadership's lease while it lasts: placement acts
/// on it (one election for the fleet's singleton work).
pub async fn run(
    store: EtcdStore,
    controller_id: String,
    retention: Retention,
    leading: tokio::sync::watch::Sender<Option<i64>>,
    shutdown: CancellationToken,
) {
    let mut backoff = inferyes_net::backoff::RECONNECT;
    loop {
        // `lead` ends on shutdown itself, revoking its lease: dropped
        // instead, its candidacy would hold the others back until the
        // lease ran out.
        let result = lead(&store, &controller_id, retention, &leading, &shutdown).await;
        leading.send_replace(None);
        match result {
            Ok(()) => return,
            Err(error) => tracing::warn!(%error, "usage ledger leadership lost; campaigning again"),
        }
        if backoff.sleep(&shutdown).await {
            return;
        }
    }
}

/// Stands, waits to lead, and leads, under one lease; revokes it when it
/// ends, however it ends, so that no candidacy of this controller stays
/// ahead of the next.
async fn lead(
    store: &EtcdStore,
    controller_id: &str,
    retention: Retention,
    leading: &tokio::sync::watch::Sender<Option<i64>>,
    shutdown: &CancellationToken,
) -> Result<(), StoreError> {
    let mut lease = store.grant_lease(LEADER_TTL).await?;
    let result = stand_and_lead(store, &mut lease, controller_id, retention, leading, shutdown).await;
    leading.send_replace(None);
    // Best effort: a lease not revoked runs out.
    let _ = tokio::time::timeout(LEADER_TTL / 3, store.revoke(lease)).await;
    result
}

async fn stand_and_lead(
    store: &EtcdStore,
    lease: &mut Lease,
    controller_id: &str,
    retention: Retention,
    leading: &tokio::sync::watch::Sender<Option<i64>>,
    shutdown: &CancellationToken,
) -> Result<(), StoreError> {
    store.stand_for_usage_leader(controller_id, lease.id).await?;
    // Until the leader before goes, each keep-alive looks whether it has:
    // a read, which etcd keeps no history of.
    let mut keepalive = tokio::time::interval(LEADER_TTL / 3);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return Ok(()),
            _ = keepalive.tick() => {}
        }
        store.keep_alive(lease).await?;
        match store.leads_usage(lease.id).await {
            Ok(true) => break,
            Ok(false) => {}
            // Looked at again at the next keep-alive, from the same place
            // in the line.
            Err(error) => tracing::debug!(%error, "the ledger's leader could not be read; looking again"),
        }
    }
    tracing::info!("leading the usage ledger and placement");
    leading.send_replace(Some(lease.id));
    let mut last_prune: Option<tokio::time::Instant> = None;
    let mut ticker = tokio::time::interval(POLL);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return Ok(()),
            _ = keepalive.tick() => {
                store.keep_alive(lease).await?;
                // A candidacy deleted by hand leaves its lease alive, and
                // the next one leads: this one steps down.
                if let Ok(false) = store.leads_usage(lease.id).await {
                    return Err(StoreError::Invalid("another candidacy leads the usage ledger".into()));
                }
            }
            _ = ticker.tick() => {
                for (batch, revision) in store.pending_usage(BATCHES_PER_ROUND).await? {
                    apply(store, batch, revision).await?;
                }
                if last_prune.is_none_or(|at| at.elapsed() >= PRUNE_EVERY) {
                    prune(store, retention).await?;
                    last_prune = Some(tokio::time::Instant::now());
                }
            }
        }
    }
}

/// Rolls one batch up, retrying while what it read changes underneath.
async fn apply(store: &EtcdStore, batch: UsageBatch, pending_revision: i64) -> Result<(), StoreError> {
    let deltas = rollup_deltas(&batch);
    let hour = batch.deltas.first().map(|d| d.hour.clone()).unwrap_or_else(|| {
        batch.records.first().map_or_else(|| hour_of(inferyes_proto::unix_ms()), |r| hour_of(r.unix_ms))
    });
    for _ in 0..10 {
        let mut rollups = Vec::with_capacity(deltas.len());
        for (key, delta) in &deltas {
            let suffix = key.suffix();
            let mut current = store.usage_rollup(&suffix).await?;
            merge(&mut current.value, delta);
            rollups.push((suffix, current));
        }
        // Read (and written) only for a batch with keys: today's totals are
        // in the fleet's watch, and a write is a new snapshot version.
        let today = if deltas.keys().any(|key| !key.key_id.is_empty()) {
            let mut today = store.usage_today().await?;
            add_today(&mut today.value, &deltas, inferyes_proto::unix_ms()).then_some(today)
        } else {
            None
        };
        let application = Application {
            batch_id: batch.batch_id.clone(),
            pending_revision,
            rollups,
            today,
            // Raw records only when the data plane kept them.
            raw: (!batch.records.is_empty()).then(|| (format!("raw/{hour}/{}", batch.batch_id), batch.clone())),
        };
        if store.apply_usage(application).await? {
            tracing::debug!(batch = %batch.batch_id, records = batch.records.len(), "usage rolled up");
            return Ok(());
        }
        if store.pending_usage(BATCHES_PER_ROUND).await?.iter().all(|(b, _)| b.batch_id != batch.batch_id) {
            // Applied by another controller meanwhile.
            return Ok(());
        }
    }
    tracing::warn!(batch = %batch.batch_id, "usage batch kept conflicting; leaving it for the next round");
    Ok(())
}

async fn prune(store: &EtcdStore, retention: Retention) -> Result<(), StoreError> {
    let now = inferyes_proto::unix_ms();
    let days_ago = |days: u64| hour_of(now.saturating_sub(days * 86_400_000));
    store.delete_usage_before("hourly", &days_ago(retention.rollup_days)).await?;
    store.delete_usage_before("raw", &days_ago(retention.raw_days)).await?;
    store.delete_usage_before("applied", &days_ago(APPLIED_DAYS)).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use inferyes_proto::v1::UsageRecord;

    use super::*;

    fn record(key: &str, model: &str, unix_ms: u64, tokens: (u64, u64), outcome: &str) -> UsageRecord {
        UsageRecord {
            key_id: key.into(),
            model: model.into(),
            unix_ms,
            prompt_tokens: tokens.0,
            completion_tokens: tokens.1,
            outcome: outcome.into(),
            latency_ms: 10,
            ..Default::default()
        }
    }

    #[test]
    fn a_batch_names_real_hours_not_ahead_and_names_that_fit_a_key() {
        use inferyes_proto::v1::UsageDelta;
        let now = 1_764_979_200_000; // 2025-12-06 00:00 UTC
        let hour = hour_of(now);
        let delta = |hour: &str, key_id: &str, model: &str| UsageDelta {
            hour: hour.into(),
            key_id: key_id.into(),
            model: model.into(),
            usage: None,
        };
        let batch = |id: &str, deltas: Vec<UsageDelta>, records: Vec<UsageRecord>| UsageBatch {
            batch_id: id.into(),
            dataplane_id: "dp".into(),
            records,
            deltas,
        };
        let id = format!("{hour}.dp.0000000000000001.0");
        assert_eq!(check_batch(&batch(&id, vec![delta(&hour, "k", "m")], vec![]), now), Ok(()));
        let next_hour = hour_of(now + 3_600_000);
        assert_eq!(check_batch(&batch(&id, vec![delta(&next_hour, "", "m")], vec![]), now), Ok(()));
        let long = "m".repeat(inferyes_proto::MAX_NAME_BYTES + 1);
        let refused = [
            batch("forged", vec![], vec![]),
            batch("9999123123.dp.0.0", vec![], vec![]),
            batch(&id, vec![delta(&hour_of(now + 2 * 3_600_000), "k", "m")], vec![]),
            batch(&id, vec![delta("9999999999", "k", "m")], vec![]),
            batch(&id, vec![delta("2025130100", "k", "m")], vec![]),
            batch(&id, vec![delta("", "k", "m")], vec![]),
            batch(&id, vec![delta(&hour, "k/other", "m")], vec![]),
            batch(&id, vec![delta(&hour, "k", &long)], vec![]),
            batch(&id, vec![], vec![record("k", "m", now + 2 * 3_600_000, (1, 1), "ok")]),
            batch(&id, vec![], vec![record(&long, "m", now, (1, 1), "ok")]),
        ];
        for (i, refused) in refused.iter().enumerate() {
            assert!(check_batch(refused, now).is_err(), "{i}: {refused:?}");
        }
    }

    #[test]
    fn a_batch_rolls_up_per_hour_key_and_model() {
        let hour = 1_795_948_925_000;
        let batch = UsageBatch {
            batch_id: "b".into(),
            dataplane_id: "dp".into(),
            records: vec![
                record("k1", "chat", hour, (10, 5), "ok"),
                record("k1", "chat", hour + 1, (20, 5), "error"),
                record("", "org/model", hour, (1, 1), "ok"),
                record("k1", "chat", hour + 3_600_000, (1, 1), "ok"),
            ],
            deltas: Vec::new(),
        };
        let deltas = rollup_deltas(&batch);
        // The same requests summed by a data plane roll up the same.
        let summed = UsageBatch {
            records: Vec::new(),
            deltas: deltas
                .iter()
                .map(|(key, usage)| inferyes_proto::v1::UsageDelta {
                    hour: key.hour.clone(),
                    key_id: key.key_id.clone(),
                    model: key.model.clone(),
                    usage: Some(*usage),
                })
                .collect(),
            ..batch.clone()
        };
        assert_eq!(rollup_deltas(&summed), deltas);
        let at = |suffix: &str| deltas[&RollupKey::parse(suffix).unwrap()];
        let k1 = at("hourly/2026112910/k1/chat");
        assert_eq!((k1.requests, k1.errors, k1.prompt_tokens, k1.completion_tokens), (2, 1, 30, 10));
        assert_eq!(at("hourly/2026112910/-/org/model").requests, 1);
        assert_eq!(at("hourly/2026112911/k1/chat").requests, 1);
        for key in deltas.keys() {
            assert_eq!(RollupKey::parse(&key.suffix()).as_ref(), Some(key), "stored and read the same");
        }

        let mut today = KeyUsageToday { day: "20261128".into(), tokens: [("old".to_string(), 99)].into() };
        assert!(add_today(&mut today, &deltas, hour + 3_600_000));
        assert_eq!(today.day, "20261129");
        assert_eq!(today.tokens.get("k1"), Some(&42), "15 + 25 + 2");
        assert!(!today.tokens.contains_key("old") && !today.tokens.contains_key(""));
        // Without keys, nothing changes, not even tomorrow's start.
        let keyless: BTreeMap<_, _> = deltas.into_iter().filter(|(key, _)| key.key_id.is_empty()).collect();
        let before = today.clone();
        assert!(!add_today(&mut today, &keyless, hour + 86_400_000));
        assert_eq!(today, before);
    }
}
