use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, KeyValue, LeaseKeepAliveStream, LeaseKeeper,
    PutOptions, Txn, TxnOp, TxnOpResponse, WatchOptions, WatchStream,
};
use inferyes_proto::ErrorKind;
use inferyes_proto::v1::{
    AliasRecord, ApiKey, ControllerRecord, DrainRecord, KeyUsageToday, NodePolicy, NodeRecord, PlacementOrders,
    RoutingPolicy,
};
use prost::Message;

use super::keys::{Key, Keys};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("etcd is unreachable or failed: {0}")]
    Etcd(#[from] etcd_client::Error),
    #[error("etcd lease {0:x} has expired")]
    LeaseExpired(i64),
    #[error("etcd watch was compacted at revision {0}; a full reload is needed")]
    Compacted(i64),
    #[error("etcd watch ended")]
    WatchEnded,
    #[error("node `{0}` is held by another agent, whose lease is live")]
    NodeTaken(String),
    #[error("{0}")]
    Invalid(String),
}

impl StoreError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            StoreError::NodeTaken(_) => ErrorKind::PermissionDenied,
            _ => ErrorKind::Unavailable,
        }
    }
}

/// The fleet's secret, read from etcd (or made there) at its first use,
/// then kept: it never changes while controllers run.
pub struct FleetSecret {
    store: EtcdStore,
    key: tokio::sync::OnceCell<inferyes_proto::bearer::FleetKey>,
}

impl FleetSecret {
    pub fn new(store: EtcdStore) -> FleetSecret {
        FleetSecret { store, key: tokio::sync::OnceCell::new() }
    }

    pub async fn get(&self) -> Result<&inferyes_proto::bearer::FleetKey, StoreError> {
        self.key.get_or_try_init(|| self.store.fleet_key()).await
    }
}

/// One change under the prefix, decoded. Values that fail to decode are
/// logged and dropped: a corrupt record must not stop the fleet.
#[derive(Clone, Debug, PartialEq)]
pub enum WatchEvent {
    NodePut(String, NodeRecord),
    NodeDeleted(String),
    DrainPut(String, DrainRecord),
    DrainDeleted(String),
    PolicyPut(RoutingPolicy),
    PolicyDeleted,
    NodePolicyPut(String, NodePolicy),
    NodePolicyDeleted(String),
    AliasPut(String, AliasRecord),
    AliasDeleted(String),
    ApiKeyPut(String, ApiKey),
    ApiKeyDeleted(String),
    UsageTodayPut(KeyUsageToday),
    UsageTodayDeleted,
    ControllerPut(String, ControllerRecord),
    ControllerDeleted(String),
    PlacementPut(PlacementOrders),
    PlacementDeleted,
}

/// The events of one etcd revision range, and the revision they bring the
/// reader to.
#[derive(Debug)]
pub struct WatchBatch {
    pub revision: u64,
    pub events: Vec<WatchEvent>,
}

/// etcd's database: the file, the part of it in use (the rest is free
/// pages a defragmentation gives back), and the quota (0: not reported;
/// etcd before 3.6).
#[derive(Clone, Copy, Debug)]
pub struct DbSize {
    pub size: u64,
    pub in_use: u64,
    pub quota: u64,
}

/// A lease with its keep-alive stream. Dropping it stops the keep-alives, so
/// the lease runs out on its own; [`EtcdStore::revoke`] ends it at once.
pub struct Lease {
    pub id: i64,
    keeper: LeaseKeeper,
    responses: LeaseKeepAliveStream,
}

#[derive(Clone)]
pub struct EtcdStore {
    pub(super) client: Client,
    keys: Keys,
}

/// How a controller reaches etcd, beyond its endpoints.
#[derive(Clone, Debug, Default)]
pub struct EtcdAccess {
    /// The user it signs in as, and its password.
    pub user: Option<(String, String)>,
    /// TLS, for `https://` endpoints.
    pub tls: Option<etcd_client::TlsOptions>,
}

/// Whether a sign-in failed for a reason that may pass (etcd unreachable
/// or not answering yet, between leaders), not for one that trying again
/// does not change: a wrong user or password, authentication off, an
/// address or a PEM that does not parse. (An address that parses but
/// reaches no etcd, or a wrong CA, is waited on, with a warning each try.)
fn is_passing(error: &etcd_client::Error) -> bool {
    use tonic::Code;
    match error {
        etcd_client::Error::GRpcStatus(status) => matches!(
            status.code(),
            // Cancelled: tonic's answer where a call ran past its timeout.
            Code::Unavailable
                | Code::DeadlineExceeded
                | Code::Cancelled
                | Code::Unknown
                | Code::Aborted
                | Code::ResourceExhausted
        ),
        etcd_client::Error::IoError(_) => true,
        _ => false,
    }
}

impl EtcdStore {
    /// Connects lazily: an etcd that is down at start is retried by each
    /// call, so a controller can start before its store. Where it signs in
    /// as a user, etcd's client signs in as it connects: that is tried
    /// until it succeeds, fails for good (a wrong password), or `shutdown`
    /// (`None`); and done again whenever etcd no longer takes its token.
    pub async fn connect(
        endpoints: &[String],
        keys: Keys,
        access: EtcdAccess,
        shutdown: &tokio_util::sync::CancellationToken,
    ) -> Result<Option<EtcdStore>, StoreError> {
        let mut options = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(2))
            .with_timeout(Duration::from_secs(5))
            .with_keep_alive(Duration::from_secs(2), Duration::from_secs(2))
            .with_keep_alive_while_idle(true);
        if let Some(tls) = access.tls {
            options = options.with_tls(tls);
        }
        let signs_in = access.user.is_some();
        if let Some((user, password)) = access.user {
            options = options.with_user(user, password).with_auto_token_refresh(true);
        }
        let mut backoff = inferyes_net::backoff::RECONNECT;
        loop {
            let attempt = tokio::select! {
                () = shutdown.cancelled() => return Ok(None),
                attempt = Client::connect(endpoints, Some(options.clone())) => attempt,
            };
            match attempt {
                Ok(client) => return Ok(Some(EtcdStore { client, keys })),
                Err(error) if signs_in && is_passing(&error) => {
                    tracing::warn!(%error, "cannot sign in to etcd yet; trying again");
                    if backoff.sleep(shutdown).await {
                        return Ok(None);
                    }
                }
                Err(error) => return Err(error.into()),
            }
        }
    }

    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    pub async fn grant_lease(&self, ttl: Duration) -> Result<Lease, StoreError> {
        let mut client = self.client.clone();
        let ttl_s = i64::try_from(ttl.as_secs().max(1)).unwrap_or(i64::MAX);
        let id = client.lease_grant(ttl_s, None).await?.id();
        let (keeper, responses) = client.lease_keep_alive(id).await?;
        Ok(Lease { id, keeper, responses })
    }

    /// One keep-alive round trip. `LeaseExpired` means the keys bound to the
    /// lease are gone and must be written again under a new one.
    pub async fn keep_alive(&self, lease: &mut Lease) -> Result<(), StoreError> {
        lease.keeper.keep_alive().await?;
        match lease.responses.message().await? {
            Some(response) if response.ttl() > 0 => Ok(()),
            _ => Err(StoreError::LeaseExpired(lease.id)),
        }
    }

    pub async fn revoke(&self, lease: Lease) -> Result<(), StoreError> {
        self.client.clone().lease_revoke(lease.id).await?;
        Ok(())
    }

    /// Writes a node's record bound to its lease; returns the revision.
    /// The key is written if it is this lease's already, free, held by the
    /// same agent instance (`record.instance_digest`: one that moved to
    /// this controller), or by a record without one; a live record of
    /// another instance is left alone ([`StoreError::NodeTaken`]), so no
    /// registration can take a live node's id, and its traffic, from its
    /// agent.
    pub async fn put_node(&self, record: &NodeRecord, lease: &Lease) -> Result<u64, StoreError> {
        let node_id = record.status.as_ref().map(|s| s.node_id.as_str()).unwrap_or_default();
        let key = self.keys.node(node_id);
        let put = || TxnOp::put(key.clone(), record.encode_to_vec(), Some(PutOptions::new().with_lease(lease.id)));
        let mut client = self.client.clone();
        // Every write but a node's first under a lease: one round trip.
        let ours = Txn::new()
            .when([Compare::lease(key.clone(), CompareOp::Equal, lease.id)])
            .and_then([put()])
            .or_else([TxnOp::get(key.clone(), None)]);
        let response = client.txn(ours).await?;
        if response.succeeded() {
            return Ok(revision(response.header()));
        }
        let held = response.op_responses().into_iter().find_map(|op| match op {
            TxnOpResponse::Get(get) => get.kvs().first().map(|kv| (kv.mod_revision(), NodeRecord::decode(kv.value()))),
            _ => None,
        });
        let claim = match held {
            None => Compare::version(key.clone(), CompareOp::Equal, 0),
            // The same instance, moving controllers; or a record with no
            // instance digest (its agent sends none), taken over by a
            // compare on its revision, the last write winning; or one no
            // controller can read.
            Some((mod_revision, Ok(current))) if !held_by_another(&current, &record.instance_digest) => {
                Compare::mod_revision(key.clone(), CompareOp::Equal, mod_revision)
            }
            Some((mod_revision, Err(_))) => Compare::mod_revision(key.clone(), CompareOp::Equal, mod_revision),
            Some(_) => return Err(StoreError::NodeTaken(node_id.to_string())),
        };
        let response = client.txn(Txn::new().when([claim]).and_then([put()])).await?;
        if response.succeeded() {
            Ok(revision(response.header()))
        } else {
            // Written in between, by the agent it belongs to or another.
            Err(StoreError::NodeTaken(node_id.to_string()))
        }
    }

    /// Writes this controller's address for its peers, bound to `lease`.
    pub async fn put_controller(&self, record: &ControllerRecord, lease: &Lease) -> Result<u64, StoreError> {
        let key = self.keys.controller(&record.controller_id);
        let options = PutOptions::new().with_lease(lease.id);
        let response = self.client.clone().put(key, record.encode_to_vec(), Some(options)).await?;
        Ok(revision(response.header()))
    }

    /// Writes the placement leader's orders, bound to its `lease`: they go
    /// when its leadership does.
    pub async fn put_placement(&self, orders: &PlacementOrders, lease: i64) -> Result<u64, StoreError> {
        let options = PutOptions::new().with_lease(lease);
        let response = self.client.clone().put(self.keys.placement(), orders.encode_to_vec(), Some(options)).await?;
        Ok(revision(response.header()))
    }

    /// The fleet's secret: the one in etcd, or, where there is none yet, a
    /// new one, written only if no other controller wrote one meanwhile.
    pub async fn fleet_key(&self) -> Result<inferyes_proto::bearer::FleetKey, StoreError> {
        let key = self.keys.fleet_key();
        let mut made = [0u8; inferyes_proto::bearer::FLEET_KEY_BYTES];
        getrandom::fill(&mut made).map_err(|e| StoreError::Invalid(format!("no randomness from the OS: {e}")))?;
        let response = self
            .client
            .clone()
            .txn(
                Txn::new()
                    .when([Compare::version(key.clone(), CompareOp::Equal, 0)])
                    .and_then([TxnOp::put(key.clone(), made.to_vec(), None)])
                    .or_else([TxnOp::get(key, None)]),
            )
            .await?;
        let kept = response.op_responses().into_iter().find_map(|op| match op {
            TxnOpResponse::Get(get) => get.kvs().first().map(|kv| kv.value().to_vec()),
            _ => None,
        });
        let secret = if response.succeeded() { made.to_vec() } else { kept.unwrap_or_default() };
        inferyes_proto::bearer::FleetKey::new(&secret)
            .ok_or_else(|| StoreError::Invalid("the fleet key in etcd is too short to be a controller's".into()))
    }

    /// The database's size on the member answering.
    pub async fn db_size(&self) -> Result<DbSize, StoreError> {
        let status = self.client.clone().status().await?;
        let size = |v: i64| u64::try_from(v).unwrap_or(0);
        Ok(DbSize {
            size: size(status.db_size()),
            in_use: size(status.raft_used_db_size()),
            quota: size(status.db_size_quota()),
        })
    }

    /// Writes a persistent (unleased) value; returns the revision.
    pub async fn put(&self, key: String, value: &impl Message) -> Result<u64, StoreError> {
        let response = self.client.clone().put(key, value.encode_to_vec(), None).await?;
        Ok(revision(response.header()))
    }

    pub async fn delete(&self, key: String) -> Result<u64, StoreError> {
        let response = self.client.clone().delete(key, None).await?;
        Ok(revision(response.header()))
    }

    /// Everything under the prefix, as events, at one revision.
    pub async fn load(&self) -> Result<WatchBatch, StoreError> {
        let options = GetOptions::new().with_prefix();
        let response = self.client.clone().get(self.keys.prefix(), Some(options)).await?;
        let events = response.kvs().iter().filter_map(|kv| self.decode(EventType::Put, kv)).collect();
        Ok(WatchBatch { revision: revision(response.header()), events })
    }

    /// Watches the prefix from `from_revision` on.
    pub async fn watch(&self, from_revision: u64) -> Result<Watch, StoreError> {
        let start = i64::try_from(from_revision).unwrap_or(i64::MAX);
        let options = WatchOptions::new().with_prefix().with_start_revision(start);
        let stream = self.client.clone().watch(self.keys.prefix(), Some(options)).await?;
        Ok(Watch { stream, keys: self.keys.clone() })
    }

    fn decode(&self, event_type: EventType, kv: &KeyValue) -> Option<WatchEvent> {
        decode(&self.keys, event_type, kv)
    }
}

pub struct Watch {
    stream: WatchStream,
    keys: Keys,
}

impl Watch {
    /// The next batch of events. Batches without events (the watch's
    /// "created" message, progress notifications) are skipped.
    pub async fn next(&mut self) -> Result<WatchBatch, StoreError> {
        loop {
            let Some(response) = self.stream.message().await? else {
                return Err(StoreError::WatchEnded);
            };
            if response.compact_revision() > 0 {
                return Err(StoreError::Compacted(response.compact_revision()));
            }
            if response.canceled() {
                return Err(StoreError::WatchEnded);
            }
            if response.events().is_empty() {
                continue;
            }
            // The revision of the last event, not the header's: the header
            // may be newer, and every controller must derive the same
            // version from the same events.
            let revision = response
                .events()
                .iter()
                .filter_map(|e| e.kv())
                .map(|kv| u64::try_from(kv.mod_revision()).unwrap_or(0))
                .max()
                .unwrap_or(0);
            let events = response
                .events()
                .iter()
                .filter_map(|e| e.kv().and_then(|kv| decode(&self.keys, e.event_type(), kv)))
                .collect();
            return Ok(WatchBatch { revision, events });
        }
    }
}

/// Whether a node's record `current` belongs to an agent other than the
/// one of `instance_digest`, so that it may not be written over: one of
/// another instance. A record with no instance (its agent sends none) is
/// anyone's, the last write winning.
pub fn held_by_another(current: &NodeRecord, instance_digest: &str) -> bool {
    !current.instance_digest.is_empty() && current.instance_digest != instance_digest
}

fn revision(header: Option<&etcd_client::ResponseHeader>) -> u64 {
    header.map(|h| u64::try_from(h.revision()).unwrap_or(0)).unwrap_or(0)
}

fn decode(keys: &Keys, event_type: EventType, kv: &KeyValue) -> Option<WatchEvent> {
    let key = keys.parse(kv.key())?;
    if event_type == EventType::Delete {
        return Some(match key {
            Key::Node(id) => WatchEvent::NodeDeleted(id),
            Key::Drain(id) => WatchEvent::DrainDeleted(id),
            Key::Policy => WatchEvent::PolicyDeleted,
            Key::NodePolicy(id) => WatchEvent::NodePolicyDeleted(id),
            Key::Alias(alias) => WatchEvent::AliasDeleted(alias),
            Key::ApiKey(id) => WatchEvent::ApiKeyDeleted(id),
            Key::UsageToday => WatchEvent::UsageTodayDeleted,
            Key::Controller(id) => WatchEvent::ControllerDeleted(id),
            Key::Placement => WatchEvent::PlacementDeleted,
        });
    }
    let value = kv.value();
    let decoded = match &key {
        Key::Node(id) => NodeRecord::decode(value).map(|r| WatchEvent::NodePut(id.clone(), r)),
        Key::Drain(id) => DrainRecord::decode(value).map(|r| WatchEvent::DrainPut(id.clone(), r)),
        Key::Policy => RoutingPolicy::decode(value).map(WatchEvent::PolicyPut),
        Key::NodePolicy(id) => NodePolicy::decode(value).map(|r| WatchEvent::NodePolicyPut(id.clone(), r)),
        Key::Alias(alias) => AliasRecord::decode(value).map(|r| WatchEvent::AliasPut(alias.clone(), r)),
        Key::ApiKey(id) => ApiKey::decode(value).map(|r| WatchEvent::ApiKeyPut(id.clone(), r)),
        Key::UsageToday => KeyUsageToday::decode(value).map(WatchEvent::UsageTodayPut),
        Key::Controller(id) => ControllerRecord::decode(value).map(|r| WatchEvent::ControllerPut(id.clone(), r)),
        Key::Placement => PlacementOrders::decode(value).map(WatchEvent::PlacementPut),
    };
    match decoded {
        Ok(event) => Some(event),
        Err(error) => {
            tracing::warn!(key = ?key, %error, "ignoring an undecodable record");
            None
        }
    }
}
