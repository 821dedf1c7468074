//! The data plane's routing snapshot: decoded once per update into the
//! indices routing needs, then shared immutably by every request.

mod client;
mod decode;
mod store;

pub use client::run as subscribe;
pub use decode::{Counters, decode};
pub use store::SnapshotStore;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::AtomicU32;

use inferyes_proto::v1::{EndpointKind, Health, ModelState};

/// An immutable routing snapshot. Built only by [`decode`].
#[derive(Debug, Default)]
pub struct RoutingSnapshot {
    pub(crate) version: u64,
    pub(crate) nodes: Vec<Node>,
    /// Model id → every backend that lists it.
    pub(crate) models: HashMap<String, Vec<Placement>>,
    /// Model ids, sorted: the fleet's catalog.
    pub(crate) catalog: Vec<CatalogEntry>,
    /// Session key → where its KV cache is resident.
    pub(crate) sessions: HashMap<String, Target>,
}

#[derive(Debug)]
pub struct Node {
    pub id: Arc<str>,
    /// Base URL of the node's agent proxy.
    pub proxy_url: Arc<str>,
    pub draining: bool,
    pub backends: Vec<BackendView>,
    /// This data plane's own requests in flight to the node: snapshots lag,
    /// and a burst must not all land on one node between two reports. The
    /// counter outlives snapshots (see [`Counters`]).
    pub local_in_flight: Arc<AtomicU32>,
}

#[derive(Debug)]
pub struct BackendView {
    pub id: Arc<str>,
    pub health: Health,
    pub weight: u32,
    pub slots_total: u32,
    pub slots_busy: u32,
    pub requests_deferred: u32,
    pub in_flight: u32,
}

/// Where a model can run: a backend of a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Target {
    pub node: usize,
    pub backend: usize,
}

#[derive(Clone, Debug)]
pub struct Placement {
    pub target: Target,
    pub state: ModelState,
    pub context_window: u32,
    /// Empty: not known, so any kind is tried.
    pub endpoints: Vec<EndpointKind>,
    /// Free VRAM on the node, for cold placement.
    pub free_vram_bytes: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CatalogEntry {
    pub id: String,
    /// Nodes with the model loaded (or possibly loaded).
    pub warm_nodes: u32,
    pub nodes: u32,
    pub context_window: u32,
}

impl RoutingSnapshot {
    pub fn version(&self) -> u64 {
        self.version
    }

    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    pub fn node(&self, index: usize) -> Option<&Node> {
        self.nodes.get(index)
    }

    pub fn placements(&self, model: &str) -> Option<&[Placement]> {
        self.models.get(model).map(Vec::as_slice)
    }

    pub fn resident(&self, session: &str) -> Option<Target> {
        self.sessions.get(session).copied()
    }

    pub fn catalog(&self) -> &[CatalogEntry] {
        &self.catalog
    }

    pub fn model(&self, id: &str) -> Option<&CatalogEntry> {
        self.catalog.binary_search_by(|e| e.id.as_str().cmp(id)).ok().map(|i| &self.catalog[i])
    }
}
