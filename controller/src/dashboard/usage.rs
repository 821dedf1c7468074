//! What each tenant used, hour by hour over the last day, for the
//! dashboard's chart: the backends' time on its requests (GPU-seconds),
//! its requests and tokens, summed from the ledger's hourly roll-ups. The
//! sum is pure ([`TenantUsage::of`]); [`sample`] reads the roll-ups.

use std::collections::BTreeMap;
use std::time::Duration;

use inferyes_proto::v1::UsageRollup;
use serde_json::{Value, json};

use crate::ledger::{RollupKey, hour_of, hour_start_ms};
use crate::store::EtcdStore;

/// Hours charted, the current one last.
pub const HOURS: usize = 24;
/// Tenants charted, the most GPU time first; the rest are summed as one.
pub const TENANTS_SHOWN: usize = 8;
/// The name the rest go under: no tenant can be named so (a tenant's name
/// is of `A-Z a-z 0-9 . _ -`).
pub const OTHERS: &str = "(others)";
/// How often the current hour's roll-ups are read: data planes send usage
/// every second, the ledger rolls it up as it comes.
const READ_EVERY: Duration = Duration::from_secs(5);
/// How often the hours before it are read again (late batches).
const READ_PAST_EVERY: Duration = Duration::from_secs(300);
const HOUR_MS: u64 = 3_600_000;

/// Each tenant's use, hour by hour.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TenantUsage {
    /// The start of the first hour charted (Unix ms).
    pub first_hour_ms: u64,
    pub tenants: Vec<Tenant>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tenant {
    /// The tenant, as [`inferyes_proto::usage::tenant_name`] names it.
    pub name: String,
    /// The backends' time on its requests each hour, in milliseconds.
    pub gpu_ms: [u64; HOURS],
    pub requests: u64,
    pub tokens: u64,
    /// That time at its nodes' prices, in millionths (0: none priced).
    pub cost_micros: u64,
}

impl Tenant {
    fn named(name: String) -> Tenant {
        Tenant { name, gpu_ms: [0; HOURS], requests: 0, tokens: 0, cost_micros: 0 }
    }

    fn gpu_ms_total(&self) -> u64 {
        self.gpu_ms.iter().sum()
    }
}

impl TenantUsage {
    /// The roll-ups (their stored suffixes and sums) of the day up to
    /// `now_ms`, by tenant: `tenant_of` names a key's.
    pub fn of(rollups: &[(String, UsageRollup)], tenant_of: impl Fn(&str) -> String, now_ms: u64) -> TenantUsage {
        let first_hour_ms = (now_ms / HOUR_MS).saturating_sub(HOURS as u64 - 1) * HOUR_MS;
        let mut by_name: BTreeMap<String, Tenant> = BTreeMap::new();
        for (suffix, usage) in rollups {
            let Some(key) = RollupKey::parse(suffix) else { continue };
            let Some(hour_ms) = hour_start_ms(&key.hour) else { continue };
            let Some(at) = hour_ms.checked_sub(first_hour_ms).map(|since| since / HOUR_MS) else { continue };
            let Ok(at) = usize::try_from(at) else { continue };
            if at >= HOURS {
                continue;
            }
            let name = inferyes_proto::usage::tenant_name(&tenant_of(&key.key_id), &key.key_id);
            let tenant = by_name.entry(name.clone()).or_insert_with(|| Tenant::named(name));
            tenant.gpu_ms[at] += usage.prompt_ms.saturating_add(usage.generation_ms);
            tenant.requests += usage.requests;
            tenant.tokens += usage.prompt_tokens.saturating_add(usage.completion_tokens);
            tenant.cost_micros += usage.cost_micros;
        }
        let mut tenants: Vec<Tenant> = by_name.into_values().collect();
        tenants.sort_by(|a, b| b.gpu_ms_total().cmp(&a.gpu_ms_total()).then_with(|| a.name.cmp(&b.name)));
        if tenants.len() > TENANTS_SHOWN {
            let rest = tenants.split_off(TENANTS_SHOWN - 1);
            let mut others = Tenant::named(OTHERS.to_string());
            for tenant in rest {
                others.gpu_ms.iter_mut().zip(tenant.gpu_ms).for_each(|(sum, ms)| *sum += ms);
                others.requests += tenant.requests;
                others.tokens += tenant.tokens;
                others.cost_micros += tenant.cost_micros;
            }
            tenants.push(others);
        }
        TenantUsage { first_hour_ms, tenants }
    }

    pub fn to_json(&self) -> Value {
        let hours: Vec<u64> = (0..HOURS as u64).map(|at| self.first_hour_ms + at * HOUR_MS).collect();
        let tenants: Vec<Value> = self
            .tenants
            .iter()
            .map(|t| {
                json!({
                    "tenant": t.name,
                    "gpu_ms": t.gpu_ms,
                    "gpu_ms_total": t.gpu_ms_total(),
                    "requests": t.requests,
                    "tokens": t.tokens,
                    "cost_micros": t.cost_micros,
                })
            })
            .collect();
        json!({ "hours": hours, "tenants": tenants })
    }
}

/// Reads the last day's roll-ups into `dashboard`'s usage until shutdown:
/// the current hour's every few seconds, the hours before (which change
/// only as late batches come) every few minutes and when the hour turns.
/// A failed read keeps what was read before.
pub async fn sample(dashboard: super::Dashboard, store: EtcdStore) {
    let mut every = tokio::time::interval(READ_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The hours before the current one, and when (which hour, at what
    // time) they were read.
    let mut past: Vec<(String, UsageRollup)> = Vec::new();
    let mut past_read: Option<(u64, tokio::time::Instant)> = None;
    let mut warned: Option<tokio::time::Instant> = None;
    loop {
        tokio::select! {
            () = dashboard.shutdown.cancelled() => return,
            _ = every.tick() => {}
        }
        let now_ms = inferyes_proto::unix_ms();
        let hour = now_ms / HOUR_MS;
        let current = format!("hourly/{}", hour_of(hour * HOUR_MS));
        let stale = past_read.is_none_or(|(read_hour, at)| read_hour != hour || at.elapsed() >= READ_PAST_EVERY);
        let read = async {
            if stale {
                let from = format!("hourly/{}", hour_of(now_ms.saturating_sub((HOURS as u64 - 1) * HOUR_MS)));
                let mut day = store.usage_rollups(&from).await?;
                day.retain(|(suffix, _)| *suffix < current);
                past = day;
                past_read = Some((hour, tokio::time::Instant::now()));
            }
            store.usage_rollups(&current).await
        };
        let now = match read.await {
            Ok(now) => now,
            Err(error) => {
                if warned.is_none_or(|at| at.elapsed() >= Duration::from_secs(60)) {
                    tracing::warn!(%error, "the dashboard's usage chart was not read; it shows what was read before");
                    warned = Some(tokio::time::Instant::now());
                }
                continue;
            }
        };
        let Some(snapshot) = dashboard.snapshots.borrow().clone() else { continue };
        let tenant_of = |key_id: &str| snapshot.tenant_of(key_id);
        let rollups: Vec<(String, UsageRollup)> = past.iter().cloned().chain(now).collect();
        let usage = TenantUsage::of(&rollups, tenant_of, now_ms);
        *dashboard.usage.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = usage;
        dashboard.sampled.send_modify(|n| *n += 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rollup(hour_ms: u64, key: &str, gpu_ms: u64) -> (String, UsageRollup) {
        let key = RollupKey { hour: hour_of(hour_ms), key_id: key.into(), model: "qwen/7b".into() };
        let usage = UsageRollup {
            requests: 1,
            prompt_tokens: 10,
            prompt_ms: gpu_ms / 4,
            generation_ms: gpu_ms - gpu_ms / 4,
            ..Default::default()
        };
        (key.suffix(), usage)
    }

    #[test]
    fn each_tenant_s_gpu_time_is_charted_by_hour_its_keys_together() {
        let now = 100 * HOUR_MS + 1_234;
        let tenants = |key: &str| if key.starts_with("a") { "team-a".to_string() } else { String::new() };
        let rollups = vec![
            rollup(100 * HOUR_MS, "a1", 4_000),
            rollup(100 * HOUR_MS, "a2", 2_000),
            rollup(99 * HOUR_MS, "a1", 1_000),
            rollup(77 * HOUR_MS, "b1", 9_000),
            // Older than the day charted.
            rollup(76 * HOUR_MS, "b1", 50_000),
            rollup(100 * HOUR_MS, "", 500),
        ];
        let usage = TenantUsage::of(&rollups, tenants, now);
        assert_eq!(usage.first_hour_ms, 77 * HOUR_MS);
        let names: Vec<(&str, u64, u64)> =
            usage.tenants.iter().map(|t| (t.name.as_str(), t.gpu_ms_total(), t.requests)).collect();
        assert_eq!(names, [("key:b1", 9_000, 1), ("team-a", 7_000, 3), (inferyes_proto::usage::NO_KEY, 500, 1)]);
        let team = &usage.tenants[1];
        assert_eq!((team.gpu_ms[HOURS - 1], team.gpu_ms[HOURS - 2], team.tokens), (6_000, 1_000, 30));
        assert_eq!(usage.tenants[0].gpu_ms[0], 9_000);
        let json = usage.to_json();
        assert_eq!(json["hours"][HOURS - 1], 100 * HOUR_MS);
        assert_eq!(json["tenants"][1]["gpu_ms_total"], 7_000);
    }

    #[test]
    fn past_the_tenants_shown_the_least_are_summed_as_one() {
        let now = 10 * HOUR_MS;
        let rollups: Vec<_> = (0..12u64).map(|i| rollup(10 * HOUR_MS, &format!("k{i:02}"), 1_000 * (i + 1))).collect();
        let usage = TenantUsage::of(&rollups, |_| String::new(), now);
        assert_eq!(usage.tenants.len(), TENANTS_SHOWN);
        assert_eq!(usage.tenants[0].name, "key:k11");
        let others = usage.tenants.last().unwrap();
        // k00..k04: 1 + 2 + 3 + 4 + 5 seconds.
        assert_eq!((others.name.as_str(), others.gpu_ms_total(), others.requests), (OTHERS, 15_000, 5));
    }
}
