//! A drain moves the node's resident conversations, most recently used
//! first, to the backends its controller named (warm, compatible, with
//! room), one at a time, within a time and a byte bound; what cannot be
//! moved is recomputed wherever its next turn goes, as without moves. The
//! drain is the one writer of the node's move progress.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use inferyes_proto::v1::{DrainState, MoveProgress, MoveTarget, ResidentSession};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::transfer::{MoveError, Sender};
use crate::config::MovesConfig;
use crate::metrics::{OutcomeLabels, SlotMetrics};
use crate::state::AgentState;

/// How often a drain looks again at what it waits for (requests still in
/// flight, a busy slot).
const RECHECK: Duration = Duration::from_millis(100);

/// The targets `session` may go to, best first: those serving its model
/// with a slot large enough and room left, the roomiest first (a drain
/// spreads its conversations), then in the controller's order.
pub fn candidates(session: &ResidentSession, targets: &[MoveTarget], room: &[u32]) -> Vec<usize> {
    let fits = |target: &MoveTarget| {
        target.models.iter().enumerate().any(|(i, model)| {
            let window = target.context_windows.get(i).copied().unwrap_or(0);
            *model == session.model && (window == 0 || session.tokens < window)
        })
    };
    let mut chosen: Vec<usize> =
        (0..targets.len()).filter(|&i| room.get(i).copied().unwrap_or(0) > 0 && fits(&targets[i])).collect();
    chosen.sort_by_key(|&i| (std::cmp::Reverse(room[i]), i));
    chosen
}

pub async fn run(
    state: Arc<AgentState>,
    sender: Arc<Sender>,
    mut drains: watch::Receiver<Option<DrainState>>,
    bounds: MovesConfig,
    metrics: SlotMetrics,
    shutdown: CancellationToken,
) {
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            changed = drains.changed() => if changed.is_err() { return },
        }
        let Some(drain) = drains.borrow_and_update().clone().filter(|d| d.draining) else { continue };
        let moves = drain_once(&state, &sender, &drain.targets, &bounds, &metrics, &mut drains);
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = moves => {}
        }
    }
}

/// One drain, until every resident conversation was tried, a bound is
/// reached, or the node is no longer draining.
async fn drain_once(
    state: &AgentState,
    sender: &Sender,
    targets: &[MoveTarget],
    bounds: &MovesConfig,
    metrics: &SlotMetrics,
    drains: &mut watch::Receiver<Option<DrainState>>,
) {
    let started = Instant::now();
    let deadline = started + Duration::from_secs(bounds.drain_seconds);
    let mut progress = MoveProgress { running: true, started_unix_ms: inferyes_proto::unix_ms(), ..Default::default() };
    publish(state, &progress);
    let still_draining =
        |drains: &watch::Receiver<Option<DrainState>>| drains.borrow().as_ref().is_some_and(|d| d.draining);
    // The last turns still running here end first: their slots are busy,
    // and the table does not know their tokens yet.
    while state.backends.iter().any(|b| b.in_flight.load(std::sync::atomic::Ordering::Relaxed) > 0)
        && Instant::now() < deadline
        && still_draining(drains)
    {
        tokio::time::sleep(RECHECK).await;
    }
    let mut sessions = state.residency.lock().sessions();
    sessions.sort_by(|a, b| b.last_seen_unix_ms.cmp(&a.last_seen_unix_ms).then_with(|| a.key.cmp(&b.key)));
    progress.sessions = u32::try_from(sessions.len()).unwrap_or(u32::MAX);
    publish(state, &progress);
    tracing::info!(sessions = sessions.len(), targets = targets.len(), "drain: moving resident conversations");
    let mut room: Vec<u32> = targets.iter().map(|t| t.free_slots).collect();
    let mut queue: VecDeque<ResidentSession> = sessions.into();
    let mut busy_in_a_row = 0usize;
    while let Some(session) = queue.pop_front() {
        let over = if Instant::now() >= deadline {
            Some(format!("past the drain's {} s", bounds.drain_seconds))
        } else if progress.bytes >= bounds.drain_bytes {
            Some(format!("past the drain's {} bytes", bounds.drain_bytes))
        } else if !still_draining(drains) {
            Some("the node is no longer draining".to_string())
        } else {
            None
        };
        if let Some(why) = over {
            let left = u32::try_from(queue.len() + 1).unwrap_or(u32::MAX);
            progress.not_movable = progress.not_movable.saturating_add(left);
            metrics.sent.get_or_create(&OutcomeLabels { outcome: "not_movable" }).inc_by(u64::from(left));
            progress.last_error = why;
            break;
        }
        // As the table has it now: a turn may have ended since.
        let Some(session) = state.residency.lock().session(&session.key) else {
            progress.not_movable += 1;
            progress.last_error = "it left the table (its cache was evicted)".into();
            continue;
        };
        let outcome = move_one(sender, &session, targets, &mut room, deadline).await;
        let label = match outcome {
            Outcome::Moved(moved) => {
                busy_in_a_row = 0;
                progress.moved += 1;
                progress.bytes = progress.bytes.saturating_add(moved.bytes);
                tracing::info!(
                    session = %session.key,
                    tokens = moved.tokens,
                    bytes = moved.bytes,
                    save_ms = moved.save_ms,
                    restore_ms = moved.restore_ms,
                    total_ms = moved.total_ms,
                    "drain: conversation moved"
                );
                "moved"
            }
            Outcome::Busy => {
                // Tried again once the rest had their turn; waited for
                // when nothing else is left.
                busy_in_a_row += 1;
                if busy_in_a_row > queue.len() {
                    tokio::time::sleep(RECHECK).await;
                }
                queue.push_back(session);
                continue;
            }
            Outcome::NotMovable(why) => {
                busy_in_a_row = 0;
                progress.not_movable += 1;
                tracing::info!(session = %session.key, reason = %why, "drain: conversation not movable");
                progress.last_error = why;
                "not_movable"
            }
            Outcome::Failed(why) => {
                busy_in_a_row = 0;
                progress.failed += 1;
                tracing::warn!(session = %session.key, reason = %why, "drain: move failed");
                progress.last_error = why;
                "failed"
            }
        };
        metrics.sent.get_or_create(&OutcomeLabels { outcome: label }).inc();
        publish(state, &progress);
    }
    progress.running = false;
    progress.finished_unix_ms = inferyes_proto::unix_ms().max(progress.started_unix_ms);
    publish(state, &progress);
    tracing::info!(
        moved = progress.moved,
        failed = progress.failed,
        not_movable = progress.not_movable,
        bytes = progress.bytes,
        ms = started.elapsed().as_millis(),
        "drain: moves done"
    );
}

enum Outcome {
    Moved(super::transfer::Moved),
    Busy,
    NotMovable(String),
    Failed(String),
}

/// Tries `session`'s targets in turn until one takes it.
async fn move_one(
    sender: &Sender,
    session: &ResidentSession,
    targets: &[MoveTarget],
    room: &mut [u32],
    deadline: Instant,
) -> Outcome {
    let chosen = candidates(session, targets, room);
    if chosen.is_empty() {
        return Outcome::NotMovable("no node that can take it has room".into());
    }
    let mut refusals = Vec::new();
    for i in chosen {
        let sent = tokio::time::timeout_at(deadline.into(), sender.send(session, &targets[i])).await;
        match sent {
            Ok(Ok(moved)) => {
                room[i] = room[i].saturating_sub(1);
                return Outcome::Moved(moved);
            }
            Ok(Err(MoveError::Busy)) => return Outcome::Busy,
            Ok(Err(MoveError::NotMovable(why))) => return Outcome::NotMovable(why),
            Ok(Err(MoveError::Failed(why))) => return Outcome::Failed(why),
            Ok(Err(MoveError::Refused(why))) => {
                // Taken for full: it said no once, and the drain is short.
                room[i] = 0;
                refusals.push(format!("{}: {why}", targets[i].node_id));
            }
            Err(_) => return Outcome::Failed("past the drain's time bound".into()),
        }
    }
    Outcome::NotMovable(format!("no node took it ({})", refusals.join("; ")))
}

fn publish(state: &AgentState, progress: &MoveProgress) {
    *state.moves.lock() = Some(progress.clone());
    state.changed.notify_one();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(node: &str, models: &[(&str, u32)]) -> MoveTarget {
        MoveTarget {
            node_id: node.into(),
            models: models.iter().map(|(m, _)| m.to_string()).collect(),
            context_windows: models.iter().map(|(_, w)| *w).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn a_conversation_goes_where_its_model_is_warm_with_room_and_a_slot_large_enough_roomiest_first() {
        let session = ResidentSession { model: "gemma".into(), tokens: 1_500, ..Default::default() };
        let targets = [
            target("b", &[("gemma", 4_096)]),
            target("c", &[("llama", 4_096)]),
            target("d", &[("gemma", 1_024)]),
            target("e", &[("other", 0), ("gemma", 0)]),
        ];
        assert_eq!(candidates(&session, &targets, &[1, 4, 4, 2]), [3, 0], "e has more room than b");
        assert_eq!(candidates(&session, &targets, &[2, 4, 4, 2]), [0, 3], "a tie goes in the given order");
        assert_eq!(candidates(&session, &targets, &[0, 4, 4, 0]), Vec::<usize>::new(), "no room");
        assert_eq!(candidates(&session, &targets, &[1]), [0], "a target without a count has none");
    }
}
