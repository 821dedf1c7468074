//! Controllers exchange their nodes' live state: each one writes its gRPC
//! address to etcd under its own lease, and follows every other one's
//! `FollowLive` stream, handing what arrives to its reconciler. So a data
//! plane subscribed to any controller routes on every node's load and
//! sessions, whichever controller that node's agent reached.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use inferyes_proto::v1::routing_service_client::RoutingServiceClient;
use inferyes_proto::v1::{ControllerRecord, FollowLiveRequest};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::live::LiveEvent;
use crate::reconcile::SnapshotRx;
use crate::store::{EtcdStore, StoreError};

pub struct Peers {
    pub store: EtcdStore,
    pub snapshots: SnapshotRx,
    pub live: mpsc::Sender<LiveEvent>,
    pub record: ControllerRecord,
    pub lease_ttl: Duration,
    pub tls: inferyes_proto::tls::Tls,
    /// Presented to peers: the data planes' token, which every
    /// RoutingService call takes.
    pub bearer: inferyes_proto::bearer::Bearer,
    /// Presented to peers beside it ([`inferyes_proto::bearer::peer_credential`]),
    /// where the fleet has a join token.
    pub peer_credential: Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>,
    pub metrics: Arc<crate::metrics::Metrics>,
    pub shutdown: CancellationToken,
}

impl Peers {
    pub async fn run(self) {
        let peers = Arc::new(self);
        let register = tokio::spawn(Arc::clone(&peers).register().instrument(tracing::info_span!("register")));
        peers.follow_all().await;
        let _ = register.await;
    }

    /// Keeps this controller's record in etcd while it runs.
    async fn register(self: Arc<Self>) {
        let mut backoff = inferyes_net::backoff::RECONNECT;
        loop {
            match self.hold_record().await {
                Ok(()) => return,
                Err(error) => tracing::warn!(%error, "controller record not held; retrying"),
            }
            if backoff.sleep(&self.shutdown).await {
                return;
            }
        }
    }

    async fn hold_record(&self) -> Result<(), StoreError> {
        let mut lease = self.store.grant_lease(self.lease_ttl).await?;
        self.store.put_controller(&self.record, &lease).await?;
        let mut every = tokio::time::interval(self.lease_ttl / 3);
        loop {
            tokio::select! {
                () = self.shutdown.cancelled() => {
                    // Peers stop following at once rather than at the TTL.
                    let _ = self.store.revoke(lease).await;
                    return Ok(());
                }
                _ = every.tick() => self.store.keep_alive(&mut lease).await?,
            }
        }
    }

    /// One follower per other controller in the fleet's records, started
    /// and stopped as they come and go.
    async fn follow_all(self: &Arc<Self>) {
        let mut snapshots = self.snapshots.clone();
        let mut followers: BTreeMap<String, (String, CancellationToken)> = BTreeMap::new();
        loop {
            let wanted: BTreeMap<String, String> = snapshots
                .borrow_and_update()
                .as_ref()
                .map(|s| {
                    s.controllers()
                        .filter(|c| c.controller_id != self.record.controller_id && !c.grpc_url.is_empty())
                        .map(|c| (c.controller_id.clone(), c.grpc_url.clone()))
                        .collect()
                })
                .unwrap_or_default();
            followers.retain(|id, (url, stop)| {
                let keep = wanted.get(id) == Some(url);
                if !keep {
                    stop.cancel();
                }
                keep
            });
            for (id, url) in wanted {
                if followers.contains_key(&id) {
                    continue;
                }
                let stop = self.shutdown.child_token();
                let span = tracing::info_span!("follow", peer = %id);
                tokio::spawn(Arc::clone(self).follow(id.clone(), url.clone(), stop.clone()).instrument(span));
                followers.insert(id, (url, stop));
            }
            self.metrics.peers.set(i64::try_from(followers.len()).unwrap_or(i64::MAX));
            tokio::select! {
                () = self.shutdown.cancelled() => return,
                changed = snapshots.changed() => if changed.is_err() { return },
            }
        }
    }

    /// Follows one peer until `stop`, reconnecting with backoff.
    async fn follow(self: Arc<Self>, peer: String, url: String, stop: CancellationToken) {
        let origin: Arc<str> = peer.as_str().into();
        let mut backoff = inferyes_net::backoff::RECONNECT;
        loop {
            let result = tokio::select! {
                () = stop.cancelled() => Ok(false),
                result = self.follow_once(&origin, &url) => result,
            };
            match result {
                Ok(received) if received => backoff.reset(),
                Ok(_) => {}
                Err(error) => tracing::warn!(%error, %url, "peer stream failed; retrying"),
            }
            // What it relayed stays, marked not fresh: its agents reconnect
            // elsewhere within seconds and replace it.
            let _ = self.live.send(LiveEvent::PeerLost { origin: Arc::clone(&origin) }).await;
            if backoff.sleep(&stop).await {
                return;
            }
        }
    }

    fn follow_request(&self) -> tonic::Request<FollowLiveRequest> {
        let mut request = tonic::Request::new(FollowLiveRequest { controller_id: self.record.controller_id.clone() });
        if let Some(credential) = &self.peer_credential {
            request.metadata_mut().insert(inferyes_proto::bearer::PEER_CREDENTIAL, credential.clone());
        }
        request
    }

    /// One stream; returns whether anything arrived.
    async fn follow_once(&self, origin: &Arc<str>, url: &str) -> anyhow::Result<bool> {
        let channel = inferyes_proto::tls::grpc_stream_endpoint(url, &self.tls)?.connect().await?;
        let mut stream = RoutingServiceClient::with_interceptor(channel, self.bearer.clone())
            .max_decoding_message_size(256 << 20)
            .follow_live(self.follow_request())
            .await?
            .into_inner();
        let mut received = false;
        while let Some(update) = stream.message().await? {
            if update.controller_id == self.record.controller_id {
                anyhow::bail!(
                    "the peer `{origin}` advertises {url}, which reaches this controller: give each controller an \
                     advertise_url the others reach"
                );
            }
            if update.controller_id != **origin {
                anyhow::bail!("the peer at {url} calls itself {}", update.controller_id);
            }
            received = true;
            let origin = Arc::clone(origin);
            let event = if update.full {
                LiveEvent::PeerFull { origin, nodes: update.nodes }
            } else {
                LiveEvent::PeerDelta { origin, nodes: update.nodes, gone: update.gone }
            };
            self.live.send(event).await?;
        }
        Ok(received)
    }
}
