//! Placement orders from the controller, carried out one at a time, each
//! once, against the backends that load and unload models on request:
//! llama-swap (`GET /upstream/{model}/health` loads the model and answers
//! once it is ready; `POST /api/models/unload/{model}`) and llama-server's
//! router mode (`POST /models/load`, which answers at once, and
//! `/models/unload`). The poller then reads the model's new state, which
//! is how the controller learns the order's outcome.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use inferyes_proto::v1::{BackendKind, PlacementAction, PlacementOrder};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::probe::ProbeClient;
use crate::state::AgentState;

/// Longer than any model takes to load: llama-swap answers the warm-up
/// request only once the model is ready.
const ORDER_TIMEOUT: Duration = Duration::from_secs(20 * 60);
/// Orders remembered as carried out, so that hearing one again (a
/// reconnect, the list resent) does nothing.
const REMEMBERED: usize = 1024;
/// How often an order the backend could not take yet (not probed since
/// the agent started, the model not listed yet) is tried again.
const RETRY_EVERY: Duration = Duration::from_secs(1);

/// Why an order was not carried out.
enum Refused {
    /// Not now: tried again while it is listed.
    NotYet(&'static str),
    /// Not at all, or asked and refused: the leader sees it and decides.
    Failed(String),
}

pub async fn run(
    state: Arc<AgentState>,
    mut orders: watch::Receiver<Vec<PlacementOrder>>,
    shutdown: CancellationToken,
) {
    let client = ProbeClient::new(ORDER_TIMEOUT);
    let mut done: VecDeque<String> = VecDeque::new();
    let mut retry = tokio::time::interval(RETRY_EVERY);
    retry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            changed = orders.changed() => if changed.is_err() { return },
            _ = retry.tick() => {}
        }
        let next: Vec<PlacementOrder> =
            orders.borrow_and_update().iter().filter(|o| !done.contains(&o.id)).cloned().collect();
        for order in next {
            // Withdrawn while an earlier one ran (done, failed, or the
            // leader gone): not started.
            if !orders.borrow().iter().any(|o| o.id == order.id) {
                continue;
            }
            let outcome = tokio::select! {
                () = shutdown.cancelled() => return,
                outcome = carry_out(&state, &client, &order) => outcome,
            };
            let action = if order.action() == PlacementAction::Load { "load" } else { "unload" };
            let (backend, model, id) = (&order.backend_id, &order.model, &order.id);
            match outcome {
                Err(Refused::NotYet(why)) => {
                    tracing::debug!(%backend, %model, %id, why, "placement: {action} waits");
                    continue;
                }
                Ok(()) => tracing::info!(%backend, %model, %id, "placement: {action} asked"),
                Err(Refused::Failed(error)) => {
                    tracing::warn!(%backend, %model, %id, %error, "placement: {action} failed")
                }
            }
            done.push_back(order.id.clone());
            if done.len() > REMEMBERED {
                done.pop_front();
            }
            state.poll_now.notify_one();
        }
    }
}

/// Asks the order's backend for it.
async fn carry_out(state: &AgentState, client: &ProbeClient, order: &PlacementOrder) -> Result<(), Refused> {
    if order.node_id != state.node_id {
        return Err(Refused::Failed(format!("the order is for node `{}`", order.node_id)));
    }
    let handle = state.backend(&order.backend_id).ok_or_else(|| Refused::Failed("no such backend".into()))?;
    // The backend's kind and models as last probed: an order for a model
    // it does not list is not passed on.
    let (kind, listed) = {
        let observations = state.observations.lock();
        let backend = observations
            .backends
            .iter()
            .find(|b| b.id == order.backend_id)
            .ok_or(Refused::NotYet("the backend is not probed yet"))?;
        (backend.kind(), backend.models.iter().any(|m| m.id == order.model))
    };
    if !listed {
        return Err(Refused::NotYet("the backend does not list the model"));
    }
    let load = order.action() == PlacementAction::Load;
    // The leader planned the unload when the model was idle here; a
    // request since would be cut off by it.
    if !load && handle.in_flight.load(std::sync::atomic::Ordering::Relaxed) > 0 {
        // Tried again until the backend is idle, or the leader, seeing
        // the requests, withdraws it.
        return Err(Refused::NotYet("requests are in flight on the backend"));
    }
    let base = handle.probe.url.as_str();
    let key = handle.probe.api_key.as_str();
    let answer = match kind {
        BackendKind::LlamaSwap if load => {
            client.get(base, &format!("/upstream/{}/health", path(&order.model)), key).await
        }
        BackendKind::LlamaSwap => client.post(base, &format!("/api/models/unload/{}", path(&order.model)), key).await,
        BackendKind::LlamaServerRouter => {
            let route = if load { "/models/load" } else { "/models/unload" };
            client.post_json(base, route, key, &serde_json::json!({ "model": order.model })).await
        }
        _ => return Err(Refused::Failed("the backend does not load models on request".into())),
    };
    let (status, body) = answer.map_err(|e| Refused::Failed(e.to_string()))?;
    // A router asked to load a model it is loading or has says so with a
    // 400: the model is where it was asked to be.
    let already = status.as_u16() == 400 && body.windows(15).any(|w| w == b"already running");
    if status.is_success() || already {
        return Ok(());
    }
    let text = String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned();
    Err(Refused::Failed(format!("{status}: {text}")))
}

/// A model id as a path segment: unreserved bytes and `/` as they are (llama-swap
/// takes the rest of the path as the model), every other byte escaped.
fn path(model: &str) -> String {
    let mut out = String::with_capacity(model.len());
    for byte in model.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~' | b'/' | b':') {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_model_id_is_escaped_as_a_path() {
        assert_eq!(super::path("org/model:Q4_K_M"), "org/model:Q4_K_M");
        assert_eq!(super::path("a b?c#d%"), "a%20b%3Fc%23d%25");
        assert_eq!(super::path("..\u{e9}"), "..%C3%A9");
    }
}
