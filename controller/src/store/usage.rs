//! The usage ledger's etcd operations. Exactly-once rests on two
//! transactions: a batch is accepted only if it is neither pending nor
//! already applied, and it is applied (roll-ups updated, raw records kept,
//! `applied` marker written) in the same transaction that deletes it from
//! `pending`, guarded by the mod revisions it was computed from.

use etcd_client::{Compare, CompareOp, GetOptions, SortOrder, SortTarget, Txn, TxnOp};
use inferyes_proto::v1::{KeyUsageToday, UsageBatch, UsageRollup};
use prost::Message;

use super::{EtcdStore, StoreError};

/// A value read for an update, with the revision that guards the write
/// (0: the key did not exist).
pub struct Versioned<T> {
    pub value: T,
    pub mod_revision: i64,
}

/// What applying one batch writes.
pub struct Application {
    pub batch_id: String,
    /// The pending key's mod revision when the batch was read.
    pub pending_revision: i64,
    /// Hourly roll-ups: key suffix (`hourly/...`) → new value and guard.
    pub rollups: Vec<(String, Versioned<UsageRollup>)>,
    /// Today's tokens per key, and its guard; `None` when the batch leaves
    /// them as they were (no key's tokens): `today` is in the fleet's watch,
    /// and a write would make a new snapshot version for every data plane.
    pub today: Option<Versioned<KeyUsageToday>>,
    /// `raw/<hour>/<batch_id>` and the batch, for export, when it carries
    /// records.
    pub raw: Option<(String, UsageBatch)>,
}

impl EtcdStore {
    /// Accepts a batch unless it is pending or was applied already.
    /// Returns whether it was new.
    pub async fn put_usage_batch(&self, batch: &UsageBatch) -> Result<bool, StoreError> {
        let pending = self.keys().usage(&format!("pending/{}", batch.batch_id));
        let applied = self.keys().usage(&format!("applied/{}", batch.batch_id));
        let txn = Txn::new()
            .when([
                Compare::version(pending.clone(), CompareOp::Equal, 0),
                Compare::version(applied, CompareOp::Equal, 0),
            ])
            .and_then([TxnOp::put(pending, batch.encode_to_vec(), None)]);
        Ok(self.client.clone().txn(txn).await?.succeeded())
    }

    /// Up to `limit` pending batches, oldest first, with their revisions.
    pub async fn pending_usage(&self, limit: i64) -> Result<Vec<(UsageBatch, i64)>, StoreError> {
        let options =
            GetOptions::new().with_prefix().with_limit(limit).with_sort(SortTarget::Create, SortOrder::Ascend);
        let response = self.client.clone().get(self.keys().usage("pending/"), Some(options)).await?;
        Ok(response
            .kvs()
            .iter()
            .filter_map(|kv| UsageBatch::decode(kv.value()).ok().map(|b| (b, kv.mod_revision())))
            .collect())
    }

    pub async fn pending_usage_count(&self) -> Result<u64, StoreError> {
        let options = GetOptions::new().with_prefix().with_count_only();
        let response = self.client.clone().get(self.keys().usage("pending/"), Some(options)).await?;
        Ok(u64::try_from(response.count()).unwrap_or(0))
    }

    /// The current value of a roll-up (default when absent).
    pub async fn usage_rollup(&self, suffix: &str) -> Result<Versioned<UsageRollup>, StoreError> {
        let response = self.client.clone().get(self.keys().usage(suffix), None).await?;
        Ok(match response.kvs().first() {
            Some(kv) => Versioned {
                value: UsageRollup::decode(kv.value()).unwrap_or_default(),
                mod_revision: kv.mod_revision(),
            },
            None => Versioned { value: UsageRollup::default(), mod_revision: 0 },
        })
    }

    pub async fn usage_today(&self) -> Result<Versioned<KeyUsageToday>, StoreError> {
        let response = self.client.clone().get(self.keys().usage_today(), None).await?;
        Ok(match response.kvs().first() {
            Some(kv) => Versioned {
                value: KeyUsageToday::decode(kv.value()).unwrap_or_default(),
                mod_revision: kv.mod_revision(),
            },
            None => Versioned { value: KeyUsageToday::default(), mod_revision: 0 },
        })
    }

    /// Applies a batch in one transaction. `false`: something it was
    /// computed from changed (or it was applied meanwhile); read again.
    pub async fn apply_usage(&self, application: Application) -> Result<bool, StoreError> {
        let keys = self.keys();
        let pending = keys.usage(&format!("pending/{}", application.batch_id));
        let mut when = vec![Compare::mod_revision(pending.clone(), CompareOp::Equal, application.pending_revision)];
        let mut then = vec![
            TxnOp::delete(pending, None),
            TxnOp::put(keys.usage(&format!("applied/{}", application.batch_id)), Vec::new(), None),
        ];
        if let Some((raw_key, raw)) = &application.raw {
            then.push(TxnOp::put(keys.usage(raw_key), raw.encode_to_vec(), None));
        }
        for (suffix, rollup) in &application.rollups {
            let key = keys.usage(suffix);
            when.push(Compare::mod_revision(key.clone(), CompareOp::Equal, rollup.mod_revision));
            then.push(TxnOp::put(key, rollup.value.encode_to_vec(), None));
        }
        if let Some(today) = &application.today {
            let key = keys.usage_today();
            when.push(Compare::mod_revision(key.clone(), CompareOp::Equal, today.mod_revision));
            then.push(TxnOp::put(key, today.value.encode_to_vec(), None));
        }
        let txn = Txn::new().when(when).and_then(then);
        Ok(self.client.clone().txn(txn).await?.succeeded())
    }

    /// Roll-ups from `from_suffix` (e.g. `hourly/2026112900`) to the end of
    /// `hourly/`, as (suffix, value).
    pub async fn usage_rollups(&self, from_suffix: &str) -> Result<Vec<(String, UsageRollup)>, StoreError> {
        let end = self.keys().usage("hourly0");
        let options = GetOptions::new().with_range(end);
        let response = self.client.clone().get(self.keys().usage(from_suffix), Some(options)).await?;
        let prefix = self.keys().usage("");
        Ok(response
            .kvs()
            .iter()
            .filter_map(|kv| {
                let key = std::str::from_utf8(kv.key()).ok()?.strip_prefix(&prefix)?.to_string();
                Some((key, UsageRollup::decode(kv.value()).ok()?))
            })
            .collect())
    }

    /// Raw batches from `from_suffix` (`raw/<hour>`) on.
    pub async fn usage_raw(&self, from_suffix: &str) -> Result<Vec<UsageBatch>, StoreError> {
        let end = self.keys().usage("raw0");
        let options = GetOptions::new().with_range(end);
        let response = self.client.clone().get(self.keys().usage(from_suffix), Some(options)).await?;
        Ok(response.kvs().iter().filter_map(|kv| UsageBatch::decode(kv.value()).ok()).collect())
    }

    /// Deletes `<dir>/` keys that sort before `<dir>/<before>`: time-ordered
    /// names make retention one range delete.
    pub async fn delete_usage_before(&self, dir: &str, before: &str) -> Result<(), StoreError> {
        let options = etcd_client::DeleteOptions::new().with_range(self.keys().usage(&format!("{dir}/{before}")));
        self.client.clone().delete(self.keys().usage(&format!("{dir}/")), Some(options)).await?;
        Ok(())
    }

    /// Stands for the ledger's leadership under `lease`: a key of its own
    /// under `leader/`, written once. The keys and the rule are those of
    /// etcd's elections, so controllers that campaign through etcd's
    /// election API take part in the same one; but no call waits here for
    /// the leader to go, which the client's timeout would cut short, and
    /// each try would then write a new key.
    pub async fn stand_for_usage_leader(&self, controller_id: &str, lease: i64) -> Result<(), StoreError> {
        let key = self.candidacy(lease);
        let txn = Txn::new().when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)]).and_then([TxnOp::put(
            key,
            controller_id,
            Some(etcd_client::PutOptions::new().with_lease(lease)),
        )]);
        self.client.clone().txn(txn).await?;
        Ok(())
    }

    /// Whether the candidacy under `lease` leads: the oldest one alive does.
    pub async fn leads_usage(&self, lease: i64) -> Result<bool, StoreError> {
        let options = GetOptions::new()
            .with_prefix()
            .with_keys_only()
            .with_sort(SortTarget::Create, SortOrder::Ascend)
            .with_limit(1);
        let response = self.client.clone().get(self.keys().usage("leader/"), Some(options)).await?;
        Ok(response.kvs().first().is_some_and(|kv| kv.key() == self.candidacy(lease).as_bytes()))
    }

    fn candidacy(&self, lease: i64) -> String {
        self.keys().usage(&format!("leader/{lease:x}"))
    }
}
