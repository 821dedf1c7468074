//! Client traffic does not reach etcd: new sessions, repeat turns and a
//! node restart leave etcd's database and node records within bounds, and
//! the fleet's own writes still work.

use std::time::Duration;

use bytes::Bytes;
use http::{Method, StatusCode};
use inferyes_proto::v1::{DrainRequest, UndrainRequest};
use inferyes_tests::AgentHandle;
use tokio::task::JoinSet;

use crate::support::{Fleet, chat_body, chat_sim};

/// New sessions per run; `CHURN_SESSIONS=30000` for the ten-times soak.
fn new_sessions() -> usize {
    std::env::var("CHURN_SESSIONS").ok().and_then(|v| v.parse().ok()).unwrap_or(3_000)
}

const AT_ONCE: usize = 16;

/// Sends one chat turn of each session, `AT_ONCE` at a time; returns the
/// node each was served by.
async fn turns(fleet: &Fleet, sessions: &[String]) -> Vec<(String, String, String)> {
    let url = fleet.url("/v1/chat/completions");
    let mut served = Vec::with_capacity(sessions.len());
    for chunk in sessions.chunks(AT_ONCE) {
        let mut set = JoinSet::new();
        for session in chunk {
            let (http, url, session) = (fleet.http.clone(), url.clone(), session.clone());
            set.spawn(async move {
                let mut body = chat_body("chat", "hi");
                body["max_tokens"] = 1.into();
                let response =
                    http.send(Method::POST, &url, Bytes::from(body.to_string()), &[("x-session-id", &session)]).await;
                assert_eq!(response.status, StatusCode::OK, "{}", String::from_utf8_lossy(&response.body));
                let header = |name| response.header(name).unwrap_or_default().to_string();
                (session, header("x-inferyes-node"), header("x-inferyes-route"))
            });
        }
        while let Some(done) = set.join_next().await {
            served.push(done.expect("a turn"));
        }
    }
    served
}

struct Etcd {
    db_size: i64,
    revision: i64,
    /// The largest node record, in bytes.
    largest_record: usize,
    /// The most writes any node record has had since it was created.
    record_writes: i64,
}

async fn etcd_now(client: &mut etcd_client::Client) -> Etcd {
    let status = client.status().await.expect("etcd status");
    let options = etcd_client::GetOptions::new().with_prefix();
    let nodes = client.get("/inferyes/v1/nodes/", Some(options)).await.expect("node records");
    Etcd {
        db_size: status.db_size(),
        revision: nodes.header().expect("a header").revision(),
        largest_record: nodes.kvs().iter().map(|kv| kv.value().len()).max().unwrap_or(0),
        record_writes: nodes.kvs().iter().map(|kv| kv.version()).max().unwrap_or(0),
    }
}

#[tokio::test]
async fn session_churn_and_node_restarts_leave_etcd_within_bounds() {
    let mut fleet = Fleet::start(vec![chat_sim("chat"), chat_sim("chat")]).await;
    let mut etcd = etcd_client::Client::connect([fleet.etcd.endpoint()], None).await.expect("etcd");
    let before = etcd_now(&mut etcd).await;
    let new_sessions = new_sessions();

    let first: Vec<String> = (0..new_sessions / 2).map(|i| format!("churn-{i}")).collect();
    let served = turns(&fleet, &first).await;
    // A node restarts mid-way: its agent joins again, without its table.
    let controller = fleet.controller().url();
    let index = fleet.agents.iter().position(|a| a.node_id == "node-a").expect("node-a");
    fleet.agents.remove(index).stop().await;
    fleet.agents.push(AgentHandle::start("node-a", &[controller], &[("main", &fleet.sims[index])]).await);
    fleet.dataplane.wait_for_nodes(&["node-a", "node-b"]).await;
    let second: Vec<String> = (new_sessions / 2..new_sessions).map(|i| format!("churn-{i}")).collect();
    let later = turns(&fleet, &second).await;
    let last = later.last().map(|(s, ..)| s.clone()).expect("sessions");
    fleet
        .dataplane
        .wait_for("the last session resident", Duration::from_secs(10), |s| s.resident(&last).is_some())
        .await;
    // The sessions each node's agent still holds (the oldest were evicted
    // from its table, node-a's first ones went with its restart), and a
    // later turn of every tenth of them.
    let snapshot = fleet.dataplane.store.current().expect("a snapshot");
    let holders: Vec<(String, String)> = served
        .iter()
        .chain(&later)
        .filter(|(session, node, _)| {
            snapshot.resident(session).and_then(|r| snapshot.node(r.target.node)).is_some_and(|n| *n.id == **node)
        })
        .map(|(session, node, _)| (session.clone(), node.clone()))
        .collect();
    assert!(holders.len() >= 1_000, "only {} sessions resident where they were served", holders.len());
    let repeats: Vec<String> = holders.iter().step_by(10).map(|(s, _)| s.clone()).collect();
    let repeated = turns(&fleet, &repeats).await;

    let after = etcd_now(&mut etcd).await;
    let writes = after.revision - before.revision;
    let grown = after.db_size - before.db_size;
    let requests = new_sessions + repeats.len();
    eprintln!(
        "{requests} requests, {new_sessions} new sessions: {writes} etcd revisions, database grown {grown} bytes"
    );
    assert!(after.largest_record < 16 << 10, "a node record of {} bytes", after.largest_record);
    // A record is written when the node's status changes, never per
    // request. (The other revisions are the usage ledger's batches, one a
    // second per data plane however many requests they hold.)
    assert!(after.record_writes <= 5, "a node record written {} times", after.record_writes);
    // Under 1 MB for 3,000 new sessions, under 2 MB for ten times as many.
    let bound = if new_sessions > 3_000 { 2 << 20 } else { 1 << 20 };
    assert!(grown < bound, "etcd's database grew {grown} bytes");

    // Routing still sends each later turn to the node holding its session.
    for (session, node, route) in &repeated {
        let holder = holders.iter().find(|(s, _)| s == session).map(|(_, n)| n);
        assert_eq!((Some(node), route.as_str()), (holder, "resident"), "{session}");
    }

    // The fleet's own writes go through.
    let mut admin = fleet.controller().fleet().await;
    let drained = admin
        .drain(DrainRequest { node_id: "node-b".into(), reason: "after churn".into(), force: false })
        .await
        .expect("a drain after the churn")
        .into_inner();
    fleet
        .dataplane
        .wait_for("the drain", Duration::from_secs(10), |s| s.version() >= drained.revision && s.nodes()[1].draining)
        .await;
    admin.undrain(UndrainRequest { node_id: "node-b".into() }).await.expect("an undrain");
}
