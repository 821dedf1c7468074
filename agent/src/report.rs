//! The agent's one stream to a controller: register, then report the node's
//! status whenever it changed (and heartbeat while it does not), moving to
//! the next controller with jittered backoff when the stream breaks.

use std::sync::Arc;
use std::time::Duration;

use inferyes_proto::v1::agent_service_client::AgentServiceClient;
use inferyes_proto::v1::{
    AgentMessage, Heartbeat, NodeStatus, PlacementOrder, Register, agent_message, controller_message,
};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

use crate::state::AgentState;

/// What the reporter tells the rest of the agent (and tests).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Connection {
    /// The controller currently holding the stream, if any.
    pub controller_id: Option<String>,
    pub draining: bool,
}

/// Where the reporter passes on what controllers tell the agent: which
/// controller holds the stream and whether the node drains, and the node's
/// placement orders.
pub struct Outlets {
    pub connection: watch::Sender<Connection>,
    /// The node's outstanding placement orders, as last heard.
    pub orders: watch::Sender<Vec<PlacementOrder>>,
    /// The node's drain and where its conversations may go, as last heard.
    pub drains: watch::Sender<Option<inferyes_proto::v1::DrainState>>,
}

pub async fn run(
    state: Arc<AgentState>,
    controllers: Vec<String>,
    tls: inferyes_proto::tls::Tls,
    join_token: Option<Arc<str>>,
    min_interval: Duration,
    outlets: Outlets,
    shutdown: CancellationToken,
) {
    let Outlets { connection, orders, drains } = outlets;
    let mut backoff = inferyes_net::backoff::RECONNECT;
    // Said once, not at every try, until the node is let in.
    let mut said_full = false;
    let mut next = 0usize;
    loop {
        let address = &controllers[next % controllers.len()];
        next += 1;
        let outlets = (&connection, &orders, &drains);
        let full = match session(&state, address, &tls, join_token.as_deref(), min_interval, outlets, &shutdown).await {
            Ok(()) => return,
            Err(Failure { error, registered, full }) => {
                connection.send_modify(|c| c.controller_id = None);
                // Orders are the leader's, heard through a controller: none
                // is started while no controller is heard from.
                orders.send_if_modified(|held| !std::mem::take(held).is_empty());
                if registered {
                    backoff.reset();
                    said_full = false;
                }
                if !full {
                    tracing::warn!(controller = %address, %error, "controller stream lost; trying the next one");
                } else if !std::mem::replace(&mut said_full, true) {
                    tracing::warn!(controller = %address, %error, "the fleet has no room for this node; asking again every 20-60 s");
                }
                full
            }
        };
        let waited = if full { FLEET_FULL.clone().sleep(&shutdown).await } else { backoff.sleep(&shutdown).await };
        if waited {
            return;
        }
    }
}

/// How long an agent the fleet has no room for waits before asking again,
/// 20-60 s: every controller would answer the same, and each try costs
/// them.
const FLEET_FULL: inferyes_net::backoff::Backoff =
    inferyes_net::backoff::Backoff::new(Duration::from_secs(40), Duration::from_secs(40));

/// Keeps what the controller issued this node, where it looks like what
/// a controller issues.
fn take_credentials(state: &AgentState, issued: inferyes_proto::v1::NodeCredentials) {
    let issued = crate::state::Issued { proxy_credential: issued.proxy_credential, intake_key: issued.intake_key };
    let sound = |s: &str| !s.is_empty() && s.len() <= MAX_CREDENTIAL_BYTES;
    if !sound(&issued.proxy_credential) || !sound(&issued.intake_key) {
        tracing::warn!("the controller's credentials are empty or too long; kept what was issued");
        return;
    }
    if state.issued.load().as_deref() != Some(&issued) {
        tracing::info!("credentials issued by the controller");
    }
    state.issued.store(Some(Arc::new(issued)));
    state.changed.notify_one();
}

/// Says, once in a while, that the node joined with a token and holds no
/// credential: a controller without one issues none.
fn warn_if_uncredentialed(state: &AgentState, controller_id: &str) {
    if state.closed && state.issued.load().is_none() {
        inferyes_net::warn_every!(
            controller = %controller_id,
            "the controller issued this node no credential (one with no join token?): the proxy refuses every \
             request, and no data plane sends it one"
        );
    }
}

/// Placement orders held for the node at once; more are not believed.
const MAX_ORDERS: usize = 64;
/// Backends a drain may move conversations to, at most.
const MAX_MOVE_TARGETS: usize = 1024;
/// The longest credential a controller issues, with room: HMACs in hex.
const MAX_CREDENTIAL_BYTES: usize = 256;

struct Failure {
    error: String,
    registered: bool,
    /// The controller has no room for the node (RESOURCE_EXHAUSTED).
    full: bool,
}

fn fail(error: impl std::fmt::Display, registered: bool) -> Failure {
    Failure { error: error.to_string(), registered, full: false }
}

async fn connect(address: &str, tls: &inferyes_proto::tls::Tls) -> Result<Channel, Failure> {
    inferyes_proto::tls::grpc_stream_endpoint(address, tls)
        .map_err(|e| fail(format!("{e:#}"), false))?
        .connect()
        .await
        .map_err(|e| fail(e, false))
}

/// One stream's life. Returns `Ok` only on shutdown.
async fn session(
    state: &AgentState,
    address: &str,
    tls: &inferyes_proto::tls::Tls,
    join_token: Option<&str>,
    min_interval: Duration,
    (connection, orders, drains): (
        &watch::Sender<Connection>,
        &watch::Sender<Vec<PlacementOrder>>,
        &watch::Sender<Option<inferyes_proto::v1::DrainState>>,
    ),
    shutdown: &CancellationToken,
) -> Result<(), Failure> {
    let channel = connect(address, tls).await?;
    let (tx, rx) = mpsc::channel(16);
    let mut sent: NodeStatus = state.status();
    let register = Register {
        status: Some(sent.clone()),
        join_token: join_token.map(str::to_string).unwrap_or_default(),
        instance: state.instance.clone(),
    };
    // Queued before the call: the controller answers once it has read it.
    let _ = tx.try_send(AgentMessage { msg: Some(agent_message::Msg::Register(register)) });
    let mut inbound = AgentServiceClient::new(channel)
        .join(ReceiverStream::new(rx))
        .await
        .map_err(|status| Failure {
            full: status.code() == tonic::Code::ResourceExhausted,
            ..fail(status.message(), false)
        })?
        .into_inner();

    // A new stream starts from the whole residency table.
    send_residency(state, &tx, true).await?;
    let registered = match inbound.message().await.map_err(|s| fail(s.message(), false))? {
        Some(inferyes_proto::v1::ControllerMessage { msg: Some(controller_message::Msg::Registered(r)) }) => r,
        _ => return Err(fail("controller did not confirm the registration", false)),
    };
    tracing::info!(controller = %registered.controller_id, "registered with controller");
    connection.send_modify(|c| c.controller_id = Some(registered.controller_id.clone()));
    let heartbeat_every = Duration::from_millis(u64::from(registered.heartbeat_interval_ms.max(100)));
    let mut last_sent = Instant::now();

    loop {
        let heartbeat_at = last_sent + heartbeat_every;
        tokio::select! {
            () = shutdown.cancelled() => {
                leave(tx, inbound).await;
                return Ok(());
            }
            message = inbound.message() => match message {
                Ok(Some(message)) => match message.msg {
                    Some(controller_message::Msg::Drain(mut drain)) => {
                        tracing::info!(draining = drain.draining, "drain state from controller");
                        connection.send_modify(|c| c.draining = drain.draining);
                        drain.targets.truncate(MAX_MOVE_TARGETS);
                        drains.send_replace(Some(drain));
                    }
                    Some(controller_message::Msg::Resync(_)) => {
                        send_residency(state, &tx, true).await?;
                    }
                    Some(controller_message::Msg::Peers(peers)) => {
                        *state.peers.lock() = peers.targets.into_iter().take(MAX_MOVE_TARGETS).collect();
                    }
                    Some(controller_message::Msg::Credentials(issued)) => take_credentials(state, issued),
                    Some(controller_message::Msg::Placement(placement)) => {
                        let mine: Vec<PlacementOrder> =
                            placement.orders.into_iter().filter(|o| o.node_id == state.node_id).take(MAX_ORDERS).collect();
                        orders.send_if_modified(|held| {
                            let changed = *held != mine;
                            *held = mine;
                            changed
                        });
                    }

                    _ => {}
                },
                Ok(None) => return Err(fail("controller closed the stream", true)),
                Err(status) => return Err(fail(status.message(), true)),
            },
            () = state.changed.notified() => {
                // Merge a burst of changes into one report.
                tokio::time::sleep_until(last_sent + min_interval).await;
                let status = state.status();
                if status != sent {
                    send(&tx, agent_message::Msg::Status(status.clone())).await?;
                    sent = status;
                    last_sent = Instant::now();
                }
                if send_residency(state, &tx, false).await? {
                    last_sent = Instant::now();
                }
            }
            () = tokio::time::sleep_until(heartbeat_at) => {
                warn_if_uncredentialed(state, &registered.controller_id);
                // In-flight counts change without a notification: the
                // heartbeat tick picks them up.
                let status = state.status();
                let message = if status != sent {
                    sent = status.clone();
                    agent_message::Msg::Status(status)
                } else {
                    agent_message::Msg::Heartbeat(Heartbeat {})
                };
                send(&tx, message).await?;
                last_sent = Instant::now();
            }
        }
    }
}

/// How long a stopping agent waits for its controller to end its node.
const LEAVE_TIMEOUT: Duration = Duration::from_secs(5);

/// Leaves the fleet: the stream's sending half is closed, and the
/// controller, having ended the node (its lease revoked, its record gone),
/// closes the stream in turn. Waited for within [`LEAVE_TIMEOUT`], so a
/// fleet stopped and started again never lists this node; past it (the
/// controller or etcd away), the node's lease runs out instead.
async fn leave(tx: mpsc::Sender<AgentMessage>, mut inbound: tonic::Streaming<inferyes_proto::v1::ControllerMessage>) {
    drop(tx);
    let closed = async {
        loop {
            match inbound.message().await {
                Ok(Some(_)) => {}
                Ok(None) => return true,
                Err(_) => return false,
            }
        }
    };
    match tokio::time::timeout(LEAVE_TIMEOUT, closed).await {
        Ok(true) => tracing::info!("left the fleet"),
        Ok(false) => tracing::warn!("the stream broke while leaving; the node's lease runs out instead"),
        Err(_) => tracing::warn!("the controller did not end the node in time; its lease runs out instead"),
    }
}

/// Sends the residency table's changes (or all of it); returns whether
/// anything was sent.
async fn send_residency(state: &AgentState, tx: &mpsc::Sender<AgentMessage>, full: bool) -> Result<bool, Failure> {
    let update = {
        let mut residency = state.residency.lock();
        if !full && !residency.has_changes() {
            return Ok(false);
        }
        residency.take_update(full)
    };
    send(tx, agent_message::Msg::Residency(update)).await?;
    Ok(true)
}

async fn send(tx: &mpsc::Sender<AgentMessage>, msg: agent_message::Msg) -> Result<(), Failure> {
    tx.send(AgentMessage { msg: Some(msg) }).await.map_err(|_| fail("stream to controller closed", true))
}
