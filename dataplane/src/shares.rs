//! What one key, and one tenant, may hold of a data plane at once:
//! requests in flight and bytes of bodies read whole. Without shares, the
//! data plane's limits are one pool, first come first served: a key that
//! opens a thousand requests, or uploads a thousand large bodies, leaves
//! the others a 503.
//!
//! A request takes its [`Share`] once authenticated, before its body is
//! read, and holds it until its answer has been written out (a stream to
//! its end): the share travels with the request's buffered bytes
//! ([`crate::http::Reservation`]), which live exactly as long.

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use inferyes_proto::FastMap;
use inferyes_proto::v1::ApiKey;

/// What one holder may have at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub requests: u32,
    pub bytes: usize,
}

impl Limits {
    /// `percent` of a data plane's `connections` and `bytes`, at least one
    /// request and one body of `body_bytes`.
    pub fn percent_of(percent: u8, connections: usize, bytes: usize, body_bytes: usize) -> Limits {
        let part = |whole: usize| whole / 100 * usize::from(percent) + whole % 100 * usize::from(percent) / 100;
        Limits {
            requests: u32::try_from(part(connections).max(1)).unwrap_or(u32::MAX),
            bytes: part(bytes).max(body_bytes),
        }
    }
}

/// Whose share a request would pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Whose {
    Key,
    Tenant,
}

impl Whose {
    pub fn as_str(self) -> &'static str {
        match self {
            Whose::Key => "key",
            Whose::Tenant => "tenant",
        }
    }
}

/// Why a request may not have its share now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Past {
    pub whose: Whose,
    pub limit: u32,
}

/// What the keys and tenants hold now, and the default shares. A holder's
/// counts are found once per request, under the lock, where its requests
/// are checked and counted; its bytes are counted in passing, without it.
pub struct Shares {
    holders: Mutex<Holders>,
    key: Limits,
    tenant: Limits,
}

#[derive(Default)]
struct Holders {
    keys: FastMap<String, Arc<Holding>>,
    tenants: FastMap<String, Arc<Holding>>,
    /// Holders past which idle ones are let go: twice those held at the
    /// last sweep, so a sweep's cost is spread over as many requests.
    sweep_at: usize,
}

#[derive(Debug, Default)]
struct Holding {
    requests: AtomicU32,
    bytes: AtomicUsize,
}

/// Holders a table keeps before it first lets idle ones go.
const SWEEP_FROM: usize = 1024;

impl Shares {
    /// `key` is what a key may hold unless its record says otherwise;
    /// `tenant`, all the keys of one tenant together.
    pub fn new(key: Limits, tenant: Limits) -> Arc<Shares> {
        Arc::new(Shares { holders: Mutex::default(), key, tenant })
    }

    /// One more request in flight for `grant`, or the share it would pass.
    /// `max_concurrent` is this data plane's part of the key's own limit
    /// ([`crate::allowance`]); `None` where it has none, and the default
    /// share holds.
    pub fn take(&self, grant: &ApiKey, max_concurrent: Option<u32>) -> Result<Share, Past> {
        let key_limit = match max_concurrent {
            None => self.key,
            Some(requests) => Limits { requests, ..self.key },
        };
        let mut holders = self.lock();
        holders.sweep();
        let key = Arc::clone(holding(&mut holders.keys, &grant.key_id));
        if key.requests.load(Ordering::Relaxed) >= key_limit.requests {
            return Err(Past { whose: Whose::Key, limit: key_limit.requests });
        }
        let tenant = if grant.tenant.is_empty() {
            None
        } else {
            let tenant = Arc::clone(holding(&mut holders.tenants, &grant.tenant));
            if tenant.requests.load(Ordering::Relaxed) >= self.tenant.requests {
                return Err(Past { whose: Whose::Tenant, limit: self.tenant.requests });
            }
            tenant.requests.fetch_add(1, Ordering::Relaxed);
            Some(tenant)
        };
        key.requests.fetch_add(1, Ordering::Relaxed);
        Ok(Share { key, tenant, key_bytes: key_limit.bytes, tenant_bytes: self.tenant.bytes })
    }

    /// The keys holding requests in flight now, with how many.
    pub fn keys_in_flight(&self) -> Vec<(String, u32)> {
        let holders = self.lock();
        holders
            .keys
            .iter()
            .map(|(key_id, holding)| (key_id, holding.requests.load(Ordering::Relaxed)))
            .filter(|(_, requests)| *requests > 0)
            .map(|(key_id, requests)| (key_id.clone(), requests))
            .collect()
    }

    /// Requests in flight and bytes held now, by `key_id`.
    pub fn of_key(&self, key_id: &str) -> (u32, usize) {
        self.lock().keys.get(key_id).map_or((0, 0), |h| h.now())
    }

    /// Requests in flight and bytes held now, by `tenant`.
    pub fn of_tenant(&self, tenant: &str) -> (u32, usize) {
        self.lock().tenants.get(tenant).map_or((0, 0), |h| h.now())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Holders> {
        self.holders.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Holders {
    /// Lets go of holders no request holds, once the tables have grown
    /// past `sweep_at`: a table is as large as the holders of recent
    /// requests, whatever the number of keys.
    fn sweep(&mut self) {
        if self.keys.len() + self.tenants.len() < self.sweep_at.max(SWEEP_FROM) {
            return;
        }
        self.keys.retain(|_, holding| Arc::strong_count(holding) > 1);
        self.tenants.retain(|_, holding| Arc::strong_count(holding) > 1);
        self.sweep_at = 2 * (self.keys.len() + self.tenants.len());
    }
}

fn holding<'a>(table: &'a mut FastMap<String, Arc<Holding>>, holder: &str) -> &'a Arc<Holding> {
    inferyes_proto::value_for(table, holder, Arc::default)
}

impl Holding {
    fn now(&self) -> (u32, usize) {
        (self.requests.load(Ordering::Relaxed), self.bytes.load(Ordering::Relaxed))
    }

    /// Holds `bytes` more, within `limit`.
    fn grow(&self, bytes: usize, limit: usize) -> bool {
        self.bytes
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |held| {
                held.checked_add(bytes).filter(|total| *total <= limit)
            })
            .is_ok()
    }
}

/// One request's share of its key's (and tenant's): given back when the
/// last handle on it goes. Its bytes are held and given back by the
/// request's reservations.
#[derive(Debug)]
pub struct Share {
    key: Arc<Holding>,
    tenant: Option<Arc<Holding>>,
    key_bytes: usize,
    tenant_bytes: usize,
}

impl Share {
    /// Holds `bytes` more for this request's key and tenant; where that
    /// would pass either's share, holds nothing and says whose.
    pub fn grow(&self, bytes: usize) -> Result<(), Whose> {
        if !self.key.grow(bytes, self.key_bytes) {
            return Err(Whose::Key);
        }
        if let Some(tenant) = &self.tenant
            && !tenant.grow(bytes, self.tenant_bytes)
        {
            self.key.bytes.fetch_sub(bytes, Ordering::Relaxed);
            return Err(Whose::Tenant);
        }
        Ok(())
    }

    /// Gives back `bytes` that [`Share::grow`] held.
    pub fn shrink(&self, bytes: usize) {
        self.key.bytes.fetch_sub(bytes, Ordering::Relaxed);
        if let Some(tenant) = &self.tenant {
            tenant.bytes.fetch_sub(bytes, Ordering::Relaxed);
        }
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        self.key.requests.fetch_sub(1, Ordering::Relaxed);
        if let Some(tenant) = &self.tenant {
            tenant.requests.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A key's share, its own limit whole.
    fn own_limit(shares: &Shares, grant: &ApiKey) -> Result<Share, Past> {
        shares.take(grant, (grant.max_concurrent > 0).then_some(grant.max_concurrent))
    }

    fn key(id: &str, tenant: &str, max_concurrent: u32) -> Arc<ApiKey> {
        Arc::new(ApiKey { key_id: id.into(), tenant: tenant.into(), max_concurrent, ..Default::default() })
    }

    fn shares() -> Arc<Shares> {
        Shares::new(Limits { requests: 2, bytes: 10 }, Limits { requests: 3, bytes: 15 })
    }

    #[test]
    fn a_key_has_its_share_of_requests_and_gets_each_back() {
        let shares = shares();
        let (a, b) = (key("a", "", 0), key("b", "", 0));
        let first = own_limit(&shares, &a).unwrap();
        let _second = own_limit(&shares, &a).unwrap();
        assert_eq!(own_limit(&shares, &a).err(), Some(Past { whose: Whose::Key, limit: 2 }));
        assert!(own_limit(&shares, &b).is_ok(), "another key is not held back");
        drop(first);
        assert!(own_limit(&shares, &a).is_ok());
    }

    #[test]
    fn a_keys_own_limit_stands_for_the_default() {
        let shares = shares();
        let wide = key("w", "", 5);
        let held: Vec<Share> = (0..5).map(|_| own_limit(&shares, &wide).unwrap()).collect();
        assert_eq!(own_limit(&shares, &wide).err(), Some(Past { whose: Whose::Key, limit: 5 }));
        assert_eq!(shares.of_key("w").0, 5);
        drop(held);
        assert_eq!(shares.of_key("w"), (0, 0));
    }

    #[test]
    fn the_keys_of_a_tenant_share_its_share() {
        let shares = shares();
        let (a, b, c) = (key("a", "t", 0), key("b", "t", 0), key("c", "", 0));
        let _held = [own_limit(&shares, &a).unwrap(), own_limit(&shares, &a).unwrap(), own_limit(&shares, &b).unwrap()];
        assert_eq!(own_limit(&shares, &b).err(), Some(Past { whose: Whose::Tenant, limit: 3 }));
        assert!(own_limit(&shares, &c).is_ok(), "a key of no tenant is not held back");
        assert_eq!(shares.of_key("b").0, 1, "a refused request holds nothing");
    }

    #[test]
    fn bytes_are_held_within_both_shares_and_given_back() {
        let shares = shares();
        let (a, b) = (key("a", "t", 0), key("b", "t", 0));
        let (one, two) = (own_limit(&shares, &a).unwrap(), own_limit(&shares, &b).unwrap());
        assert_eq!(one.grow(8), Ok(()));
        assert_eq!(one.grow(3), Err(Whose::Key), "8 + 3 is past the key's 10");
        assert_eq!(two.grow(8), Err(Whose::Tenant), "8 + 8 is past the tenant's 15");
        assert_eq!(two.grow(7), Ok(()));
        assert_eq!(shares.of_tenant("t"), (2, 15));
        one.shrink(8);
        assert_eq!(two.grow(3), Ok(()));
        assert_eq!(shares.of_key("a"), (1, 0));
    }

    #[test]
    fn idle_holders_are_let_go_once_the_tables_grow() {
        let shares = shares();
        let busy = own_limit(&shares, &key("busy", "t", 0)).unwrap();
        for i in 0..SWEEP_FROM {
            drop(own_limit(&shares, &key(&format!("k{i}"), "", 0)).unwrap());
        }
        let held = {
            let holders = shares.lock();
            holders.keys.len() + holders.tenants.len()
        };
        assert!(held < 10, "{held} holders kept, most of them idle");
        assert_eq!((shares.of_key("busy"), shares.of_tenant("t")), ((1, 0), (1, 0)), "what is held is kept");
        drop(busy);
    }

    #[test]
    fn a_percent_of_a_data_plane_is_at_least_one_request_and_one_body() {
        assert_eq!(Limits::percent_of(25, 4096, 256 << 20, 32 << 20), Limits { requests: 1024, bytes: 64 << 20 });
        assert_eq!(Limits::percent_of(1, 10, 100, 50), Limits { requests: 1, bytes: 50 });
        assert_eq!(Limits::percent_of(100, usize::MAX, usize::MAX, 0).bytes, usize::MAX);
    }
}
