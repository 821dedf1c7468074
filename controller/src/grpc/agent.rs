use std::pin::Pin;
use std::time::Duration;

use inferyes_proto::ErrorKind;
use inferyes_proto::v1::agent_message::Msg;
use inferyes_proto::v1::agent_service_server::{AgentService, AgentServiceServer};
use inferyes_proto::v1::{
    AgentMessage, ControllerMessage, DrainState, NodeRecord, NodeStatus, Registered, ResyncResidency,
    controller_message,
};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument;

use super::status;
use crate::live::LiveEvent;
use crate::reconcile::SnapshotRx;
use crate::residency::{Check, Numbering};

use crate::store::{EtcdStore, Lease, StoreError, held_by_another};

/// Serves agent streams. Each stream is the one writer of its node's etcd
/// key: it holds the node's lease, keeps it alive while the agent is heard
/// from, and writes the durable part of the node's status when (and only
/// when) it changed. The node's load and sessions, which change with its
/// traffic, go to the reconciler as live state, never to etcd.
#[derive(Clone)]
pub struct AgentSvc {
    pub store: EtcdStore,
    pub snapshots: SnapshotRx,
    pub controller_id: String,
    pub lease_ttl: Duration,
    pub heartbeat_interval: Duration,
    pub min_write_interval: Duration,
    pub shutdown: CancellationToken,
    pub metrics: std::sync::Arc<crate::metrics::Metrics>,
    /// Agents must present it to join; `None`: any agent may.
    pub join_token: Option<inferyes_proto::bearer::Accepted>,
    pub live: mpsc::Sender<LiveEvent>,
    /// The live state as of the last batch: where a drain's conversations
    /// may go.
    pub views: crate::reconcile::LiveViewRx,
    /// Numbers this controller's agent streams: a node's later stream wins
    /// over an earlier one not yet seen to end.
    pub streams: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// When each node's record may next be written, whichever of its
    /// streams writes it.
    pub pacing: std::sync::Arc<WritePacing>,
    /// How many nodes the fleet takes.
    pub seats: std::sync::Arc<Seats>,
    /// What the credentials issued to nodes derive from; `None`: no join
    /// token, so none issued (an open fleet's agents check nothing).
    pub fleet_secret: Option<std::sync::Arc<crate::store::FleetSecret>>,
}

/// The fleet's nodes, at most `max_nodes`: a join naming a node the fleet
/// does not hold is refused where it holds that many already. So a
/// join-token holder cannot add nodes without bound, each with its
/// sessions in every controller's and data plane's memory and its record
/// in etcd. The fleet's nodes are the snapshot's, and those with a stream
/// here that it does not show (joining, or their record gone while their
/// stream lasts): joins at once cannot all pass on a snapshot that shows
/// none of them. (Joins at the same moment through several controllers
/// can each take the free places.)
pub struct Seats {
    max: usize,
    held: std::sync::Mutex<Held>,
}

#[derive(Default)]
struct Held {
    /// This controller's streams, by node.
    streams: std::collections::HashMap<String, usize>,
    /// Of those, the nodes the snapshot of `version` does not show
    /// (joining, or gone from etcd while their stream lasts): counted once
    /// a snapshot, then kept as streams come and go.
    unseen: std::collections::HashSet<String>,
    version: Option<u64>,
}

/// A node's seat, held by one of its streams.
pub struct Seat {
    seats: std::sync::Arc<Seats>,
    node_id: String,
}

impl Seats {
    pub fn new(max: usize) -> Seats {
        Seats { max, held: std::sync::Mutex::default() }
    }

    /// A seat for `node_id` where the fleet, as `snapshot` shows it and
    /// this controller's streams hold it, has one; a node it holds always
    /// has one.
    fn take(self: &std::sync::Arc<Self>, node_id: &str, snapshot: &crate::snapshot::Snapshot) -> Option<Seat> {
        let shown = |id: &str| snapshot.node(id).is_some();
        let mut held = self.held.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if held.version != Some(snapshot.version()) {
            held.unseen = held.streams.keys().filter(|id| !shown(id)).cloned().collect();
            held.version = Some(snapshot.version());
        }
        if !shown(node_id) && !held.streams.contains_key(node_id) {
            let fleet = snapshot.node_count() + held.unseen.len();
            if fleet >= self.max {
                return None;
            }
            held.unseen.insert(node_id.to_string());
        }
        *held.streams.entry(node_id.to_string()).or_default() += 1;
        Some(Seat { seats: std::sync::Arc::clone(self), node_id: node_id.to_string() })
    }
}

impl Drop for Seat {
    fn drop(&mut self) {
        let mut held = self.seats.held.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(streams) = held.streams.get_mut(&self.node_id) {
            *streams -= 1;
            if *streams == 0 {
                held.streams.remove(&self.node_id);
                held.unseen.remove(&self.node_id);
            }
        }
    }
}

/// When each node's record may next be written: a write of a record's
/// bytes makes the next wait as long as they take at
/// [`NODE_WRITE_BYTES_PER_SECOND`], and `min_write_interval` at least,
/// across the node's streams to this controller, so that an agent joining
/// again and again writes no faster than one that stays. Only nodes that
/// must still wait are kept.
///
/// And all nodes' writes together, at most `max_node_write_bytes_per_second`
/// after a burst of [`FLEET_WRITE_BURST`] of it: etcd keeps every write
/// until compaction, and nodes joining under new ids, each a first write,
/// would otherwise fill its quota at the rate joins are answered.
pub struct WritePacing {
    nodes: std::sync::Mutex<std::collections::HashMap<String, Instant>>,
    /// All writes' bytes at `fleet_rate`, as one clock (GCRA): each write
    /// moves it on by its bytes' time, from now where it is behind, and
    /// goes once that leaves it at most a burst ahead of now. Reserved
    /// before the write, so that writes at once cannot all pass, and in
    /// order, so that none waits behind later ones.
    fleet: std::sync::Mutex<Instant>,
    fleet_rate: u64,
}

/// How far ahead of now all nodes' writes may be: at the default rate, a
/// few thousand nodes joining again at once after a restart.
const FLEET_WRITE_BURST: Duration = Duration::from_secs(64);

/// What etcd keeps of a write beyond its record: the key, the revision's
/// own bytes, the lease's.
const WRITE_OVERHEAD_BYTES: usize = 512;

impl WritePacing {
    pub fn new(fleet_bytes_per_second: u64) -> WritePacing {
        WritePacing {
            nodes: std::sync::Mutex::default(),
            fleet: std::sync::Mutex::new(Instant::now()),
            fleet_rate: fleet_bytes_per_second.max(1),
        }
    }

    /// When `node_id`'s record may next be written, by its own writes: now,
    /// or later.
    fn node_next(&self, node_id: &str) -> Instant {
        let now = Instant::now();
        let nodes = self.nodes.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        nodes.get(node_id).map_or(now, |at| now.max(*at))
    }

    /// Reserves a write of a record `bytes` long among all nodes' writes:
    /// when its turn comes, now or later. First come, first served.
    fn fleet_reserve(&self, bytes: usize) -> Instant {
        self.fleet_reserve_by(bytes, None).unwrap_or_else(Instant::now)
    }

    /// The same, where the turn comes by `by`; else nothing is reserved.
    fn fleet_reserve_by(&self, bytes: usize, by: Option<Instant>) -> Option<Instant> {
        let now = Instant::now();
        let mut fleet = self.fleet.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let after = (*fleet).max(now) + self.fleet_cost(bytes);
        let turn = after.checked_sub(FLEET_WRITE_BURST).map_or(now, |at| at.max(now));
        if by.is_some_and(|by| turn > by) {
            return None;
        }
        *fleet = after;
        Some(turn)
    }

    /// Gives back a turn reserved for `bytes` and not used: the turns
    /// reserved after it come that much sooner, never before now.
    fn fleet_give_back(&self, bytes: usize) {
        let now = Instant::now();
        let mut fleet = self.fleet.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        *fleet = fleet.checked_sub(self.fleet_cost(bytes)).map_or(now, |at| at.max(now));
    }

    fn fleet_cost(&self, bytes: usize) -> Duration {
        spacing(bytes.saturating_add(WRITE_OVERHEAD_BYTES), self.fleet_rate)
    }

    /// `node_id`'s record was written now, `bytes` long.
    fn wrote(&self, node_id: &str, bytes: usize, min_interval: Duration) {
        let now = Instant::now();
        let mut next = self.nodes.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        next.retain(|_, at| *at > now);
        next.insert(node_id.to_string(), now + min_interval.max(write_spacing(bytes)));
    }
}

/// How far in the future an agent's clock may put a session's last use:
/// further, and it would win every comparison with another node's copy.
const CLOCK_SKEW_MS: u64 = 60_000;

impl AgentSvc {
    pub fn svc(self) -> AgentServiceServer<Self> {
        AgentServiceServer::new(self)
    }

    fn refused(&self, reason: &'static str) {
        self.metrics.agents_refused.get_or_create(&crate::metrics::AgentRefusedLabels { reason }).inc();
    }

    /// The fleet as this controller last read it. A join waits for the
    /// first read (the controller has just started), else it is answered
    /// UNAVAILABLE and its agent tries another controller: before it, the
    /// nodes the fleet holds are not known to count them.
    async fn fleet_read(&self) -> Result<std::sync::Arc<crate::snapshot::Snapshot>, Status> {
        let mut snapshots = self.snapshots.clone();
        let read = tokio::time::timeout(CLAIM_TIMEOUT, snapshots.wait_for(Option::is_some)).await;
        read.ok().and_then(Result::ok).and_then(|snapshot| snapshot.clone()).ok_or_else(|| {
            status(ErrorKind::Unavailable, "this controller has not read the fleet from etcd yet: try another")
        })
    }
}

type JoinStream = Pin<Box<dyn Stream<Item = Result<ControllerMessage, Status>> + Send>>;

const REGISTER_TIMEOUT: Duration = Duration::from_secs(10);
/// A join waits this long for the node's first write before the stream is
/// answered; past it, the write is tried again from the stream (etcd's own
/// timeouts would hold the agent for several times as long).
const CLAIM_TIMEOUT: Duration = Duration::from_secs(5);
/// A first change waits this long for the rest of its batch before it is
/// written.
const COALESCE: Duration = Duration::from_millis(5);

#[tonic::async_trait]
impl AgentService for AgentSvc {
    type JoinStream = JoinStream;

    async fn join(&self, request: Request<Streaming<AgentMessage>>) -> Result<Response<JoinStream>, Status> {
        let peer = request.remote_addr();
        let mut inbound = request.into_inner();
        let first = tokio::time::timeout(REGISTER_TIMEOUT, inbound.message())
            .await
            .map_err(|_| status(ErrorKind::Timeout, "no register message within 10s"))??;
        let Some(AgentMessage { msg: Some(Msg::Register(register)) }) = first else {
            return Err(status(ErrorKind::BadRequest, "the first message on a join stream must be `register`"));
        };
        if let Some(accepted) = &self.join_token
            && !accepted.accepts(register.join_token.as_bytes())
        {
            self.refused("join_token");
            let reason = if register.join_token.is_empty() { "needs" } else { "refused the agent's" };
            tracing::warn!(peer = ?peer, "agent refused: wrong or missing join token");
            return Err(status(
                ErrorKind::PermissionDenied,
                format!("this controller {reason} join token (agent: join_token_file or INFERYES_JOIN_TOKEN)"),
            ));
        }
        let node = register.status.ok_or_else(|| status(ErrorKind::BadRequest, "register carries no node status"))?;
        validate(&node)?;
        let instance = instance_digest(&register.instance)?;
        let span = tracing::info_span!("agent", node = %node.node_id, peer = ?peer);
        let fleet = self.fleet_read().await?;
        let Some(seat) = self.seats.take(&node.node_id, &fleet) else {
            self.refused("max_nodes");
            tracing::warn!(parent: &span, max_nodes = self.seats.max, "agent refused: the fleet holds its most nodes");
            return Err(status(
                ErrorKind::Overloaded,
                format!(
                    "the fleet holds as many nodes as it takes ({}, the controllers' max_nodes): this node joins \
                     once another leaves, or once max_nodes is raised",
                    self.seats.max
                ),
            ));
        };
        let fleet_key = match &self.fleet_secret {
            Some(secret) => Some(secret.get().await.map_err(|e| status(e.kind(), e.to_string()))?.clone()),
            None => None,
        };
        let claim = self.claim(node, instance.clone(), seat).instrument(span.clone()).await?;

        let (tx, rx) = mpsc::channel(8);
        let registered = ControllerMessage {
            msg: Some(controller_message::Msg::Registered(Registered {
                controller_id: self.controller_id.clone(),
                lease_ttl_ms: millis(self.lease_ttl),
                heartbeat_interval_ms: millis(self.heartbeat_interval),
            })),
        };
        // The channel is empty and ours: these cannot fail.
        let _ = tx.try_send(Ok(registered));
        if let Some(key) = &fleet_key {
            let node_id = &claim.reported.durable.node_id;
            let credentials = inferyes_proto::v1::NodeCredentials {
                proxy_credential: key.proxy_credential(node_id, &instance),
                intake_key: key.intake_key(node_id, &instance),
            };
            let _ = tx.try_send(Ok(ControllerMessage { msg: Some(controller_message::Msg::Credentials(credentials)) }));
        }
        tracing::info!(parent: &span, "agent joined");
        tokio::spawn(self.clone().session(claim, inbound, tx, fleet_key).instrument(span));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// What etcd keeps of an agent's instance: its SHA-256, so that a reader
/// of etcd cannot present it. Empty for an agent that sends none (it can
/// then take a free node id, or one whose record has no instance either).
fn instance_digest(instance: &str) -> Result<String, Status> {
    if instance.is_empty() {
        return Ok(String::new());
    }
    if !(16..=128).contains(&instance.len()) || !instance.bytes().all(|b| b.is_ascii_alphanumeric()) {
        return Err(status(ErrorKind::BadRequest, "instance must be 16-128 letters and digits"));
    }
    Ok(inferyes_proto::bearer::sha256_hex(instance.as_bytes()))
}

/// The longest proxy address a node may give.
const MAX_URL_BYTES: usize = 2048;

/// What a node's record written `bytes` long makes it wait before the
/// next, past `min_write_interval`: every node's writes stay within
/// [`NODE_WRITE_BYTES_PER_SECOND`], however often its status changes,
/// so that no agent (or backend it reads) fills etcd's history.
fn write_spacing(bytes: usize) -> Duration {
    spacing(bytes, NODE_WRITE_BYTES_PER_SECOND)
}

/// How long `bytes` take at `bytes_per_second`.
fn spacing(bytes: usize, bytes_per_second: u64) -> Duration {
    let bytes = u64::try_from(bytes).unwrap_or(u64::MAX);
    Duration::from_millis(bytes.saturating_mul(1000) / bytes_per_second.max(1))
}

/// Bytes a node's record may be written at, sustained: a real node's
/// record of a few kilobytes is written every `min_write_interval`.
const NODE_WRITE_BYTES_PER_SECOND: u64 = 64 << 10;

fn validate(node: &NodeStatus) -> Result<(), Status> {
    let id_ok = crate::live::valid_node_id(&node.node_id);
    if !id_ok {
        return Err(status(ErrorKind::BadRequest, "node_id must be 1-128 characters of [A-Za-z0-9._-]"));
    }
    if !(node.proxy_url.starts_with("http://") || node.proxy_url.starts_with("https://")) {
        return Err(status(ErrorKind::BadRequest, "proxy_url must be an http:// or https:// URL"));
    }
    if node.proxy_url.len() > MAX_URL_BYTES {
        return Err(status(ErrorKind::BadRequest, format!("proxy_url must be at most {MAX_URL_BYTES} bytes")));
    }
    Ok(())
}

fn taken_status(node_id: &str) -> Status {
    status(
        ErrorKind::PermissionDenied,
        format!(
            "node id `{node_id}` is held by another agent whose lease is live: give this agent another node_id, \
             or it joins once that lease ends"
        ),
    )
}

fn millis(d: Duration) -> u32 {
    u32::try_from(d.as_millis()).unwrap_or(u32::MAX)
}

/// A registration taken: the agent's reported status, and the writer of
/// its node's key, its first write done or held for retry.
struct Claim {
    reported: Reported,
    /// Held for as long as the stream lasts.
    seat: Seat,
    /// The node's writer, its first write done or held for retry.
    writer: NodeWriter,
}

/// What the snapshot shows of one node: whether it drains, the placement
/// leader's orders for it, and every backend that can take a moved slot.
struct Shown {
    draining: Option<bool>,
    orders: Vec<inferyes_proto::v1::PlacementOrder>,
    movable: Option<std::sync::Arc<Vec<inferyes_proto::v1::MoveTarget>>>,
}

impl Shown {
    fn of(snapshot: Option<&crate::snapshot::Snapshot>, node_id: &str) -> Shown {
        Shown {
            draining: snapshot.and_then(|s| s.node(node_id).map(|n| n.draining)),
            orders: snapshot.map(|s| s.orders_for(node_id)).unwrap_or_default(),
            movable: snapshot.map(|s| std::sync::Arc::clone(s.movable())),
        }
    }
}

/// What a node's agent was last told of the snapshot, so that it hears
/// each change once, and only changes. Pure.
#[derive(Default)]
struct Told {
    draining: Option<bool>,
    targets: usize,
    /// `None` until the first are sent: a new stream always hears the
    /// node's orders, none included, replacing what its agent held.
    orders: Option<Vec<inferyes_proto::v1::PlacementOrder>>,
    peers: Option<Vec<inferyes_proto::v1::MoveTarget>>,
    /// The movable backends the peers were made of: while the snapshot's
    /// are the same (a pointer's comparison), the peers are not made again.
    movable: Option<std::sync::Arc<Vec<inferyes_proto::v1::MoveTarget>>>,
}

impl Told {
    /// What tells the agent of `node_id` what changed in `shown`: its peers
    /// (where its agent may carry a conversation's slot when a data plane
    /// asks), its orders, whether it drains and, draining, its `targets`
    /// (asked for only then), each with this node's grants.
    fn news(
        &mut self,
        node_id: &str,
        shown: Shown,
        granting: Option<&Granting>,
        targets: impl FnOnce() -> Vec<inferyes_proto::v1::MoveTarget>,
    ) -> Vec<ControllerMessage> {
        let message = |msg| ControllerMessage { msg: Some(msg) };
        let mut news = Vec::new();
        if let Some(movable) = shown.movable
            && !self.movable.as_ref().is_some_and(|sent| std::sync::Arc::ptr_eq(sent, &movable))
        {
            let peers = Granting::grant(granting, crate::moves::peers(&movable, node_id));
            if self.peers.as_ref() != Some(&peers) {
                let targets = peers.clone();
                news.push(message(controller_message::Msg::Peers(inferyes_proto::v1::Peers { targets })));
                self.peers = Some(peers);
            }
            self.movable = Some(movable);
        }
        if self.orders.as_ref() != Some(&shown.orders) {
            let orders = shown.orders.clone();
            news.push(message(controller_message::Msg::Placement(inferyes_proto::v1::Placement { orders })));
            self.orders = Some(shown.orders);
        }
        // Told again while draining to nowhere: the first targets may come
        // before the fleet's live state. A drain's targets' grants are not
        // renewed here: its agent takes the renewed peers' grants for the
        // same backends.
        if let Some(draining) = shown.draining
            && (self.draining != Some(draining) || (draining && self.targets == 0))
        {
            let targets = if draining { Granting::grant(granting, targets()) } else { Vec::new() };
            if self.draining != Some(draining) || !targets.is_empty() {
                self.draining = Some(draining);
                self.targets = targets.len();
                let drain = DrainState { draining, reason: String::new(), targets };
                news.push(message(controller_message::Msg::Drain(drain)));
            }
        }
        news
    }
}

/// What a node's move grants are made with.
struct Granting {
    key: inferyes_proto::bearer::FleetKey,
    from: String,
    /// The host of the node's proxy URL; `None`: it names none, and the
    /// node is granted no move.
    from_host: Option<String>,
}

impl Granting {
    fn new(key: inferyes_proto::bearer::FleetKey, from: &str, proxy_url: &str) -> Granting {
        Granting { key, from: from.to_string(), from_host: inferyes_proto::bearer::url_host(proxy_url) }
    }

    fn expiry() -> u64 {
        inferyes_proto::bearer::move_grant_expiry(inferyes_proto::unix_ms())
    }

    /// `targets`, each with this node's grant to send it slots, where the
    /// fleet grants any.
    fn grant(
        granting: Option<&Granting>,
        targets: Vec<inferyes_proto::v1::MoveTarget>,
    ) -> Vec<inferyes_proto::v1::MoveTarget> {
        match granting {
            Some(Granting { key, from, from_host: Some(host) }) => {
                crate::moves::granted(targets, key, from, host, Granting::expiry())
            }
            _ => targets,
        }
    }
}

/// One agent's stream as it runs: what the agent reported, the numbering
/// of its residency, and what it was told.
struct AgentStream<'s> {
    svc: &'s AgentSvc,
    node_id: String,
    origin: std::sync::Arc<str>,
    /// This stream's number among the controller's: tells the reconciler
    /// a stream's events from those of the node's stream before it.
    number: u64,
    reported: Reported,
    numbering: Numbering,
    /// What the node's writer is to write next.
    desired: watch::Sender<NodeStatus>,
    told: Told,
    granting: Option<Granting>,
}

impl AgentStream<'_> {
    /// An agent's message: its live events on to the reconciler, a changed
    /// record to the node's writer, or, where the residency numbering has
    /// a gap, the agent asked for its whole table.
    async fn heard(&mut self, msg: Msg, tx: &mpsc::Sender<Result<ControllerMessage, Status>>) -> Result<(), End> {
        let svc = self.svc;
        let (live, durable_changed) = match svc.take(msg, &self.node_id, &mut self.reported, &mut self.numbering) {
            Heard::Live { events, durable_changed } => (events, durable_changed),
            Heard::Resync(resync) => {
                deliver(tx, resync, svc.lease_ttl).await?;
                (Vec::new(), false)
            }
        };
        if durable_changed {
            self.desired.send_replace(self.reported.durable.clone());
        }
        let mut reconciler_gone = false;
        for event in live {
            reconciler_gone |= svc.live.send(event.of(&self.node_id, &self.origin, self.number)).await.is_err();
        }
        if reconciler_gone { Err(End::Shutdown) } else { Ok(()) }
    }

    /// What a snapshot `shown` tells the agent that it was not told yet.
    async fn tell(&mut self, shown: Shown, tx: &mpsc::Sender<Result<ControllerMessage, Status>>) -> Result<(), End> {
        let svc = self.svc;
        let node_id = &self.node_id;
        let news = self.told.news(node_id, shown, self.granting.as_ref(), || svc.move_targets(node_id));
        for message in news {
            deliver(tx, message, svc.lease_ttl).await?;
        }
        Ok(())
    }
}

/// Why an agent session ended.
enum End {
    AgentLeft,
    AgentSilent,
    /// Another agent's live lease holds the node id.
    Taken,
    Shutdown,
}

impl End {
    /// How the node leaves, said in the log and, where the agent is to
    /// know why, on its stream.
    fn leaving(self, node_id: &str, tx: &mpsc::Sender<Result<ControllerMessage, Status>>) -> Leaving {
        match self {
            End::Shutdown => {
                // Leave the lease to run out: the agent moves to another
                // controller, whose write replaces the key before then.
                tracing::info!("controller shutting down; agent stream closed");
                Leaving::AtTtl
            }
            End::Taken => {
                tracing::warn!("node id taken by another agent after this one's lease ran out; stream closed");
                let _ = tx.try_send(Err(taken_status(node_id)));
                Leaving::Now
            }
            End::AgentSilent => {
                tracing::warn!(
                    "agent silent (not writing, or not reading) for longer than the lease ttl; dropping its node"
                );
                let _ = tx.try_send(Err(status(ErrorKind::Timeout, "no heartbeat within the lease ttl")));
                Leaving::Now
            }
            End::AgentLeft => {
                tracing::info!("agent left");
                Leaving::Now
            }
        }
    }
}

/// Sends `message` to the agent. One that stops reading its stream (its
/// connection kept up by HTTP/2's pings) is as silent as one that stops
/// writing: past the lease's TTL its session ends, and its node leaves.
async fn deliver(
    tx: &mpsc::Sender<Result<ControllerMessage, Status>>,
    message: ControllerMessage,
    within: Duration,
) -> Result<(), End> {
    match tokio::time::timeout(within, tx.send(Ok(message))).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(_)) => Err(End::AgentLeft),
        Err(_) => Err(End::AgentSilent),
    }
}

impl AgentSvc {
    /// The node's first write, before the stream is answered: the node id
    /// is this agent's before anything of it reaches the fleet, and a
    /// registration naming another live agent's node id is refused.
    async fn claim(&self, node: NodeStatus, instance_digest: String, seat: Seat) -> Result<Claim, Status> {
        let registered_unix_ms = inferyes_proto::unix_ms();
        let mut lease: Option<Lease> = None;
        let mut reported = Reported::default();
        reported.update(node);
        let mut pending: Option<NodeStatus> = Some(reported.durable.clone());
        let mut written: Option<NodeStatus> = None;
        // A node that joins again before its last write's time is up waits
        // for it (8 s at most, for the largest record): joining again and
        // again writes no faster than staying.
        tokio::time::sleep_until(self.pacing.node_next(&reported.durable.node_id)).await;
        // A join whose turn among all nodes' writes is further off than it
        // waits is refused, and reserves nothing: turns held for streams
        // that may end at once would make every later write wait.
        let bytes = prost::Message::encoded_len(&reported.durable);
        let Some(turn) = self.pacing.fleet_reserve_by(bytes, Some(Instant::now() + CLAIM_TIMEOUT / 2)) else {
            self.refused("write_budget");
            tracing::warn!("agent refused: this controller's etcd writes are at their budget");
            return Err(status(
                ErrorKind::Overloaded,
                "this controller's writes to etcd are at their budget (max_node_write_bytes_per_second): the node \
                 joins once there is room",
            ));
        };
        let first = async {
            tokio::time::sleep_until(turn).await;
            self.write(&mut lease, reported.durable.clone(), registered_unix_ms, &instance_digest).await
        };
        match tokio::time::timeout(CLAIM_TIMEOUT, first).await {
            Ok(Ok(_)) => written = pending.take(),
            Ok(Err(StoreError::NodeTaken(node_id))) => {
                self.pacing.fleet_give_back(bytes);
                self.refused("node_taken");
                tracing::warn!("agent refused: its node id is held by another agent's live lease");
                return Err(taken_status(&node_id));
            }
            // Written on the next try, on the turn this one had; the stream
            // goes on meanwhile.
            Ok(Err(error)) => tracing::warn!(%error, "node status not written; holding it for retry"),
            Err(_) => tracing::warn!("etcd slow to take the node's first write; holding it for retry"),
        }
        // Not written yet, etcd has not said whose the node id is: the fleet
        // as last read says it, so that no stream goes on under a node id
        // another agent's live lease holds.
        let node_id = &reported.durable.node_id;
        let fleet = self.snapshots.borrow().clone();
        let held = fleet.as_deref().and_then(|fleet| fleet.record(node_id));
        if pending.is_some() && held.is_some_and(|held| held_by_another(held, &instance_digest)) {
            self.pacing.fleet_give_back(bytes);
            self.refused("node_taken");
            tracing::warn!("agent refused: its node id is held by another agent's live lease");
            return Err(taken_status(node_id));
        }
        let reserved = pending.as_ref().map(|_| bytes);
        let writer =
            NodeWriter { svc: self.clone(), lease, pending, reserved, written, registered_unix_ms, instance_digest };
        Ok(Claim { reported, seat, writer })
    }

    async fn session(
        self,
        claim: Claim,
        mut inbound: Streaming<AgentMessage>,
        tx: mpsc::Sender<Result<ControllerMessage, Status>>,
        fleet_key: Option<inferyes_proto::bearer::FleetKey>,
    ) {
        let Claim { reported, seat: _seat, writer } = claim;
        let node_id = reported.durable.node_id.clone();
        // The node's record and lease are written by a task of their own,
        // so that a slow or paused etcd never holds up this stream: what
        // is to be written waits there, the latest only.
        let (desired, desired_rx) = watch::channel(reported.durable.clone());
        // Peers' grants are made again each renewal period: the snapshot is
        // then looked at again as if it and the movable backends had
        // changed, and the peers are sent if their grants did.
        let granting = fleet_key.map(|key| Granting::new(key, &node_id, &reported.durable.proxy_url));
        let mut stream = AgentStream {
            svc: &self,
            origin: self.controller_id.as_str().into(),
            number: self.streams.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1,
            node_id,
            reported,
            numbering: Numbering::default(),
            desired,
            told: Told::default(),
            granting,
        };
        if self.live.send(stream.reported.load_event(&stream.node_id, &stream.origin, stream.number)).await.is_err() {
            return;
        }
        let (leaving, leaving_rx) = oneshot::channel();
        let taken = CancellationToken::new();
        let heard = std::sync::Arc::new(LastHeard::new());
        let writing = tokio::spawn(
            writer.run(desired_rx, leaving_rx, std::sync::Arc::clone(&heard), taken.clone()).in_current_span(),
        );
        self.metrics.agent_streams.inc();
        let mut silence = tokio::time::interval(self.lease_ttl / 3);
        silence.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut snapshots = self.snapshots.clone();
        let renew_every = Duration::from_millis(inferyes_proto::bearer::MOVE_GRANT_RENEW_MS / 2);
        let mut renew = tokio::time::interval_at(tokio::time::Instant::now() + renew_every, renew_every);

        let end = loop {
            // Biased: what the agent sent is read before its silence is
            // judged, so a controller starved of CPU for a while finds the
            // messages that waited instead of dropping their sender. News
            // for the agent (drains, orders, grants) comes first: it comes
            // at most once a publish, and a backlog of the agent's must not
            // hold it up.
            let step = tokio::select! {
                biased;
                () = self.shutdown.cancelled() => Err(End::Shutdown),
                () = taken.cancelled() => Err(End::Taken),
                changed = snapshots.changed() => match changed {
                    Ok(()) => {
                        let shown = Shown::of(snapshots.borrow_and_update().as_deref(), &stream.node_id);
                        stream.tell(shown, &tx).await
                    }
                    Err(_) => Err(End::Shutdown),
                },
                _ = renew.tick(), if stream.granting.is_some() => {
                    stream.told.movable = None;
                    snapshots.mark_changed();
                    Ok(())
                }
                message = inbound.message() => match message {
                    Ok(Some(AgentMessage { msg: Some(msg) })) => {
                        heard.now();
                        stream.heard(msg, &tx).await
                    }
                    Ok(Some(AgentMessage { msg: None })) => {
                        heard.now();
                        Ok(())
                    }
                    Ok(None) | Err(_) => Err(End::AgentLeft),
                },
                _ = silence.tick() => if heard.ago() > self.lease_ttl { Err(End::AgentSilent) } else { Ok(()) },
            };
            if let Err(end) = step {
                break end;
            }
        };

        let AgentStream { node_id, origin, number, .. } = stream;
        self.metrics.agent_streams.dec();
        let _ = self.live.send(LiveEvent::Gone { node_id: node_id.clone(), origin, stream: number }).await;
        let _ = leaving.send(end.leaving(&node_id, &tx));
        // The stream ends once the node has: an agent that left waits for
        // this end, and exits knowing its node is out of the fleet. Within
        // the TTL: past it, an etcd that hangs keeps the writer, not the
        // stream, and the lease runs out.
        if tokio::time::timeout(self.lease_ttl, writing).await.is_err() {
            tracing::warn!("etcd slow to end the node; closing the stream, its lease runs out");
        }
    }

    /// Where the conversations of `node_id`, draining, may be moved.
    fn move_targets(&self, node_id: &str) -> Vec<inferyes_proto::v1::MoveTarget> {
        let snapshot = self.snapshots.borrow();
        let Some(snapshot) = snapshot.as_ref() else { return Vec::new() };
        let live = self.views.borrow();
        crate::moves::targets(snapshot.merged_nodes(&live), node_id, snapshot.policy())
    }

    /// What one agent message comes to: live events for the reconciler and
    /// whether the node's durable record changed, or, where its residency
    /// numbering has a gap, a request for the agent's whole table.
    fn take(&self, msg: Msg, node_id: &str, reported: &mut Reported, numbering: &mut Numbering) -> Heard {
        match msg {
            Msg::Status(status) | Msg::Register(inferyes_proto::v1::Register { status: Some(status), .. }) => {
                if status.node_id != node_id {
                    tracing::warn!(reported = %status.node_id, "agent changed its node id; ignoring the report");
                    return Heard::Live { events: Vec::new(), durable_changed: false };
                }
                if let Err(refused) = validate(&status) {
                    tracing::warn!(why = refused.message(), "agent's status refused; ignoring the report");
                    return Heard::Live { events: Vec::new(), durable_changed: false };
                }
                let changed = reported.update(status);
                let mut events = Vec::new();
                if changed.load {
                    events.push(Live::Load(reported.load.clone()));
                }
                if changed.sessions && !numbering.in_use() {
                    events.push(Live::Sessions {
                        full: true,
                        upserted: reported.sessions.clone(),
                        removed: Vec::new(),
                    });
                }
                Heard::Live { events, durable_changed: changed.durable }
            }
            Msg::Residency(mut update) => match numbering.check(&update) {
                Check::Apply => {
                    let latest = inferyes_proto::unix_ms().saturating_add(CLOCK_SKEW_MS);
                    for session in &mut update.upserted {
                        session.last_seen_unix_ms = session.last_seen_unix_ms.min(latest);
                    }
                    let event =
                        Live::Sessions { full: update.full, upserted: update.upserted, removed: update.removed };
                    Heard::Live { events: vec![event], durable_changed: false }
                }
                Check::Drop => Heard::Live { events: Vec::new(), durable_changed: false },
                Check::Resync { expected_seq } => {
                    tracing::debug!(expected_seq, "residency numbering broken; asking for a full table");
                    Heard::Resync(ControllerMessage {
                        msg: Some(controller_message::Msg::Resync(ResyncResidency { expected_seq })),
                    })
                }
            },
            Msg::Register(_) | Msg::Heartbeat(_) => Heard::Live { events: Vec::new(), durable_changed: false },
        }
    }
}

/// What an agent's message came to.
enum Heard {
    Live { events: Vec<Live>, durable_changed: bool },
    Resync(ControllerMessage),
}

/// A change to a node's live state, before the node id, origin and stream
/// number are put on it.
enum Live {
    Load(inferyes_proto::v1::NodeLoad),
    Sessions { full: bool, upserted: Vec<inferyes_proto::v1::ResidentSession>, removed: Vec<String> },
}

impl Live {
    fn of(self, node_id: &str, origin: &std::sync::Arc<str>, stream: u64) -> LiveEvent {
        let (node_id, origin) = (node_id.to_string(), std::sync::Arc::clone(origin));
        match self {
            Live::Load(load) => LiveEvent::Load { node_id, origin, stream, load },
            Live::Sessions { full, upserted, removed } => {
                LiveEvent::Sessions { node_id, origin, stream, full, upserted, removed }
            }
        }
    }
}

/// When the agent was last heard from, as its stream writes it and its
/// node's writer reads it.
struct LastHeard {
    since: Instant,
    ms: std::sync::atomic::AtomicU64,
}

impl LastHeard {
    fn new() -> LastHeard {
        LastHeard { since: Instant::now(), ms: std::sync::atomic::AtomicU64::new(0) }
    }

    fn now(&self) {
        let ms = u64::try_from(self.since.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.ms.store(ms, std::sync::atomic::Ordering::Relaxed);
    }

    fn ago(&self) -> Duration {
        let at = Duration::from_millis(self.ms.load(std::sync::atomic::Ordering::Relaxed));
        self.since.elapsed().saturating_sub(at)
    }
}

/// Whether a node leaves the fleet as its stream ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Leaving {
    /// Its lease is revoked: the agent went, or is silent.
    Now,
    /// Its lease is left to run out, for the agent's next controller to
    /// take the key over before then.
    AtTtl,
}

/// The one writer of a node's etcd key for one agent stream: its record,
/// written when it changed (coalesced, retried with backoff), and its
/// lease, kept alive until the stream ends.
struct NodeWriter {
    svc: AgentSvc,
    lease: Option<Lease>,
    /// The status still to write, if any.
    pending: Option<NodeStatus>,
    written: Option<NodeStatus>,
    /// The bytes of a turn reserved among all nodes' writes and not yet
    /// used: the next write goes at that turn (`write_at`), and tries it
    /// again after a failure without a turn of its own.
    reserved: Option<usize>,
    registered_unix_ms: u64,
    instance_digest: String,
}

impl NodeWriter {
    /// Writes what `desired` says until `leaving` comes (or its stream is
    /// gone); `taken` is cancelled where another agent's live lease holds
    /// the node id.
    async fn run(
        mut self,
        mut desired: watch::Receiver<NodeStatus>,
        mut leaving: oneshot::Receiver<Leaving>,
        heard: std::sync::Arc<LastHeard>,
        taken: CancellationToken,
    ) {
        let node_id = desired.borrow().node_id.clone();
        let mut write_at = self.svc.pacing.node_next(&node_id);
        let mut backoff = inferyes_net::backoff::RECONNECT;
        let mut keepalive = tokio::time::interval(self.svc.lease_ttl / 3);
        keepalive.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let leaves = loop {
            let due = self.pending.as_ref().map(|_| write_at);
            tokio::select! {
                leaves = &mut leaving => break leaves.unwrap_or(Leaving::Now),
                changed = desired.changed() => {
                    if changed.is_err() {
                        break leaving.await.unwrap_or(Leaving::Now);
                    }
                    let status = desired.borrow_and_update().clone();
                    if self.pending.is_none() {
                        write_at = write_at.max(Instant::now() + COALESCE);
                    }
                    self.pending = (self.written.as_ref() != Some(&status)).then_some(status);
                }
                () = sleep_until(due) => {
                    let Some(status) = self.pending.clone() else { continue };
                    if self.reserved.is_none() {
                        let bytes = prost::Message::encoded_len(&status);
                        let turn = self.svc.pacing.fleet_reserve(bytes);
                        self.reserved = Some(bytes);
                        if turn > Instant::now() {
                            write_at = turn;
                            continue;
                        }
                    }
                    let svc = self.svc.clone();
                    match svc.write(&mut self.lease, status.clone(), self.registered_unix_ms, &self.instance_digest).await {
                        Ok(revision) => {
                            tracing::debug!(revision, "node status written");
                            self.reserved = None;
                            self.written = Some(status);
                            self.pending = None;
                            write_at = self.svc.pacing.node_next(&node_id);
                            backoff.reset();
                        }
                        Err(StoreError::NodeTaken(_)) => {
                            self.reserved = None;
                            taken.cancel();
                            break Leaving::Now;
                        }
                        Err(error) => {
                            tracing::warn!(%error, "node status not written; holding it for retry");
                            write_at = Instant::now() + backoff.next_wait();
                        }
                    }
                }
                _ = keepalive.tick() => self.keep_alive(&heard).await,
            }
        };
        if let Some(bytes) = self.reserved.take() {
            self.svc.pacing.fleet_give_back(bytes);
        }
        if leaves == Leaving::Now
            && let Some(lease) = self.lease.take()
            && let Err(error) = self.svc.store.revoke(lease).await
        {
            tracing::warn!(%error, "lease revoke failed; the node leaves when it expires");
        }
    }

    /// Renews the lease, if the agent was heard from within the TTL: the
    /// stream's loop ends the stream after that, but a loop held up (on a
    /// full channel, say) must not keep a node alive that nobody hears.
    async fn keep_alive(&mut self, heard: &LastHeard) {
        let Some(current) = self.lease.as_mut() else { return };
        if heard.ago() > self.svc.lease_ttl {
            return;
        }
        self.svc.metrics.lease_keepalives.inc();
        // Its answer comes on a stream of its own, which no request
        // timeout bounds.
        let renewing = tokio::time::timeout(self.svc.lease_ttl / 3, self.svc.store.keep_alive(current));
        let Ok(renewed) = renewing.await else {
            self.svc.metrics.lease_keepalive_failures.inc();
            tracing::warn!("lease keep-alive not answered in time");
            return;
        };
        match renewed {
            Ok(()) => {}
            Err(StoreError::LeaseExpired(id)) => {
                // etcd was away longer than the TTL: the node's key is
                // gone. Write it again under a new lease.
                tracing::warn!(lease = id, "node lease expired; re-registering");
                self.lease = None;
                // The newest status, whichever: what waits to be written,
                // else what was.
                self.pending = self.pending.take().or(self.written.take());
                self.written = None;
            }
            Err(error) => {
                self.svc.metrics.lease_keepalive_failures.inc();
                tracing::warn!(%error, "lease keep-alive failed");
            }
        }
    }
}

impl AgentSvc {
    async fn write(
        &self,
        lease: &mut Option<Lease>,
        status: NodeStatus,
        registered_unix_ms: u64,
        instance_digest: &str,
    ) -> Result<u64, StoreError> {
        let current = match lease.take() {
            Some(current) => current,
            None => self.store.grant_lease(self.lease_ttl).await?,
        };
        let (record_node_id, record_bytes) = (status.node_id.clone(), prost::Message::encoded_len(&status));
        let record = NodeRecord {
            status: Some(status),
            controller_id: self.controller_id.clone(),
            registered_unix_ms,
            instance_digest: instance_digest.to_string(),
        };
        // On failure the lease is dropped with the error: it may be gone
        // (etcd restarted, TTL passed), and the next try starts afresh.
        let started = std::time::Instant::now();
        let written = self.store.put_node(&record, &current).await;
        self.metrics.node_write_seconds.observe(started.elapsed().as_secs_f64());
        let revision = match written {
            Ok(revision) => revision,
            Err(StoreError::NodeTaken(node_id)) => {
                // Bound to nothing: gone now rather than at its TTL.
                if let Err(error) = self.store.revoke(current).await {
                    tracing::debug!(%error, "an unused lease was not revoked; it runs out");
                }
                return Err(StoreError::NodeTaken(node_id));
            }
            Err(error) => {
                self.metrics.node_write_failures.inc();
                return Err(error);
            }
        };
        self.metrics.node_writes.inc();
        self.metrics.node_write_bytes.inc_by(u64::try_from(record_bytes).unwrap_or(u64::MAX));
        self.pacing.wrote(&record_node_id, record_bytes, self.min_write_interval);
        *lease = Some(current);
        Ok(revision)
    }
}

/// The agent's last status, split into what etcd keeps and the load.
#[derive(Default)]
struct Reported {
    durable: NodeStatus,
    load: inferyes_proto::v1::NodeLoad,
    /// Sessions in the status itself, from agents that send no residency
    /// updates.
    sessions: Vec<inferyes_proto::v1::ResidentSession>,
    /// What the bounds dropped from the last status: said once, not on
    /// every status.
    dropped: usize,
}

/// What a new status changed.
struct Changed {
    durable: bool,
    load: bool,
    sessions: bool,
}

impl Reported {
    fn update(&mut self, mut status: NodeStatus) -> Changed {
        let sessions = std::mem::take(&mut status.sessions);
        let (durable, load, dropped) = crate::live::split(status);
        if dropped != self.dropped && dropped > 0 {
            tracing::warn!(dropped, "node status over the record's bounds; the rest is left out of etcd");
        }
        self.dropped = dropped;
        let changed =
            Changed { durable: durable != self.durable, load: load != self.load, sessions: sessions != self.sessions };
        self.durable = durable;
        self.load = load;
        self.sessions = sessions;
        changed
    }

    fn load_event(&self, node_id: &str, origin: &std::sync::Arc<str>, stream: u64) -> LiveEvent {
        LiveEvent::Load {
            node_id: node_id.to_string(),
            origin: std::sync::Arc::clone(origin),
            stream,
            load: self.load.clone(),
        }
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kinds(news: &[ControllerMessage]) -> Vec<&'static str> {
        news.iter()
            .map(|m| match &m.msg {
                Some(controller_message::Msg::Peers(_)) => "peers",
                Some(controller_message::Msg::Placement(_)) => "placement",
                Some(controller_message::Msg::Drain(d)) if d.draining => "drain",
                Some(controller_message::Msg::Drain(_)) => "undrain",
                _ => "other",
            })
            .collect()
    }

    #[test]
    fn an_agent_hears_each_change_of_the_snapshot_once_with_its_grants() {
        let target = |node: &str| inferyes_proto::v1::MoveTarget {
            node_id: node.into(),
            proxy_url: format!("http://{node}:9100"),
            backend_id: "main".into(),
            slot_fingerprint: "f".into(),
            ..Default::default()
        };
        let movable = std::sync::Arc::new(vec![target("a"), target("b")]);
        let shown = |draining, movable: &std::sync::Arc<Vec<_>>| Shown {
            draining: Some(draining),
            orders: Vec::new(),
            movable: Some(std::sync::Arc::clone(movable)),
        };
        let key = inferyes_proto::bearer::FleetKey::new(&[5; inferyes_proto::bearer::FLEET_KEY_BYTES]).unwrap();
        let granting = Granting::new(key, "a", "http://10.0.0.1:9100");
        let mut told = Told::default();
        let no_targets = Vec::new;
        // A new stream hears everything, none of its orders included.
        let news = told.news("a", shown(false, &movable), Some(&granting), no_targets);
        assert_eq!(kinds(&news), ["peers", "placement", "undrain"]);
        let Some(controller_message::Msg::Peers(peers)) = &news[0].msg else { unreachable!() };
        let [b] = peers.targets.as_slice() else { panic!("its peers are the others: {peers:?}") };
        assert_eq!(b.node_id, "b");
        assert!(!b.grant.is_empty() && b.grant_expires_unix_ms > inferyes_proto::unix_ms(), "{b:?}");
        // The same snapshot again: nothing.
        assert!(told.news("a", shown(false, &movable), Some(&granting), no_targets).is_empty());
        // Made again (a renewal) within one period: the same grants, not told.
        told.movable = None;
        assert!(told.news("a", shown(false, &movable), Some(&granting), no_targets).is_empty());
        // Drained to nowhere: told so, and told its targets once there are.
        assert_eq!(kinds(&told.news("a", shown(true, &movable), Some(&granting), no_targets)), ["drain"]);
        assert!(told.news("a", shown(true, &movable), Some(&granting), no_targets).is_empty());
        let news = told.news("a", shown(true, &movable), Some(&granting), || vec![target("b")]);
        let Some(controller_message::Msg::Drain(drain)) = &news[0].msg else { panic!("{news:?}") };
        assert!(!drain.targets[0].grant.is_empty(), "a drain's targets carry grants");
        assert!(told.news("a", shown(true, &movable), Some(&granting), || vec![target("b")]).is_empty());
        // Another node joins: its peers again.
        let more = std::sync::Arc::new(vec![target("a"), target("b"), target("c")]);
        assert_eq!(kinds(&told.news("a", shown(true, &more), Some(&granting), no_targets)), ["peers"]);
    }

    #[test]
    fn a_node_s_address_is_an_http_url_of_bounded_length() {
        let node = |proxy_url: String| NodeStatus { node_id: "n".into(), proxy_url, ..Default::default() };
        assert!(validate(&node("http://10.0.0.1:8081".into())).is_ok());
        assert!(validate(&node(format!("https://{}", "h".repeat(MAX_URL_BYTES - 8)))).is_ok());
        assert!(validate(&node(format!("https://{}", "h".repeat(MAX_URL_BYTES)))).is_err());
        assert!(validate(&node("ftp://h".into())).is_err());
    }

    fn snapshot(revision: u64, nodes: &[&str]) -> crate::snapshot::Snapshot {
        use crate::store::{WatchBatch, WatchEvent};
        let put = |id: &&str| {
            let status = NodeStatus { node_id: (*id).into(), ..Default::default() };
            WatchEvent::NodePut((*id).into(), NodeRecord { status: Some(status), ..Default::default() })
        };
        let events = nodes.iter().map(put).collect();
        crate::snapshot::build(&crate::fleet::FleetState::from_load(WatchBatch { revision, events }), None)
    }

    #[test]
    fn a_fleet_seats_its_nodes_and_those_joining_up_to_its_bound() {
        let seats = std::sync::Arc::new(Seats::new(4));
        let fleet = snapshot(1, &["a", "b"]);
        // Joining, in no snapshot yet: counted all the same.
        let c = seats.take("c", &fleet).expect("a third seat");
        let d = seats.take("d", &fleet).expect("a fourth seat");
        assert!(seats.take("e", &fleet).is_none(), "full");
        // Nodes the fleet holds join again, full as it is.
        let (_a, _c) = (seats.take("a", &fleet).expect("a"), seats.take("c", &fleet).expect("c"));
        // Joined nodes the snapshot now shows count once: a seat is free
        // when one leaves.
        let fleet = snapshot(2, &["a", "b", "c"]);
        drop(d);
        let e = seats.take("e", &fleet).expect("d's seat is e's");
        assert!(seats.take("f", &fleet).is_none(), "full again");
        // A node gone from the snapshot and from this controller's
        // streams is forgotten.
        drop((c, _c, e));
        let fleet = snapshot(3, &["a", "b"]);
        let _f = seats.take("f", &fleet).expect("f");
        let _g = seats.take("g", &fleet).expect("g");
        {
            let held = seats.held.lock().unwrap();
            assert!(!held.streams.contains_key("c") && !held.unseen.contains("c"), "c forgotten");
            assert_eq!(held.unseen.len(), 2, "f and g, not yet shown");
        }
        // A node whose record is gone while its stream here lasts (its
        // lease ran out with etcd away) still counts.
        let fleet = snapshot(4, &["b"]);
        assert!(seats.take("h", &fleet).is_none(), "a, b, f and g");
    }

    #[test]
    fn all_nodes_writes_go_in_turn_at_their_rate_after_a_burst() {
        // 64 s of 64 KiB a second: fifteen records of 256 KiB, each taking
        // 4,007 ms of the rate with what etcd keeps beside it.
        let pacing = WritePacing::new(64 << 10);
        let now = Instant::now();
        let turns: Vec<Duration> =
            (0..18).map(|_| pacing.fleet_reserve(256 << 10).saturating_duration_since(now)).collect();
        assert!(turns[..15].iter().all(|turn| *turn < Duration::from_secs(1)), "{turns:?}");
        assert!(turns[15] > Duration::ZERO, "{turns:?}");
        assert_eq!(turns[17] - turns[16], Duration::from_millis(4_007), "{turns:?}");
        assert_eq!(turns[16] - turns[15], Duration::from_millis(4_007), "{turns:?}");
        // A turn by a time is reserved only where it comes by then.
        let by = now + Duration::from_secs(10);
        assert!(pacing.fleet_reserve_by(256 << 10, Some(by)).is_none(), "{turns:?}");
        // A turn given back brings the next one that much sooner.
        pacing.fleet_give_back(256 << 10);
        let next = pacing.fleet_reserve(256 << 10).saturating_duration_since(now);
        assert_eq!(next, turns[17], "{turns:?}");
    }

    #[test]
    fn a_record_waits_before_the_next_as_long_as_its_bytes_take() {
        assert_eq!(write_spacing(0), Duration::ZERO);
        assert_eq!(write_spacing(64 << 10), Duration::from_secs(1));
        assert_eq!(write_spacing(crate::live::MAX_RECORD_BYTES), Duration::from_secs(8));
        assert!(write_spacing(usize::MAX) > Duration::from_secs(3600));
    }
}
