//! A controller's snapshot, as a data plane decodes it into routing
//! indices, and a routing decision over them: whatever the records hold
//! (a controller of another version, a corrupted record), neither panics,
//! and a route names only nodes and backends the snapshot has.

#![no_main]

use std::collections::BTreeMap;

use libfuzzer_sys::fuzz_target;
use prost::Message;

use inferyes_dataplane::routing::{Mode, RouteRequest, select};
use inferyes_dataplane::snapshot::{decode};
use inferyes_proto::v1::{EndpointKind, RoutingSnapshot};

fuzz_target!(|wire: &[u8]| {
    let Ok(full) = RoutingSnapshot::decode(wire) else { return };
    let nodes: BTreeMap<_, _> = full
        .nodes
        .into_iter()
        .map(|node| (node.status.as_ref().map(|s| s.node_id.clone()).unwrap_or_default(), node))
        .collect();
    let snapshot = decode(full.version, &nodes, full.policy.as_ref(), &full.aliases, &inferyes_dataplane::targets::NodeStates::default());
    let models: Vec<String> = snapshot.catalog().iter().map(|entry| entry.id.clone()).collect();
    for (ticket, model) in models.iter().enumerate() {
        for session in [None, Some("fuzzed-session")] {
            let request = RouteRequest {
                model: snapshot.resolve(model),
                kind: EndpointKind::Chat,
                session,
                prompt_tokens: 100,
                mode: Mode::Policy,
                carry: true,
                ticket: ticket as u64,
                now_ms: 0,
            };
            if let Ok(route) = select(&snapshot, snapshot.local(), &request) {
                for target in &route.targets {
                    let node = snapshot.node(target.node).expect("a route's node is the snapshot's");
                    assert!(target.backend < node.backends.len(), "a route's backend is its node's");
                }
            }
        }
    }
});
