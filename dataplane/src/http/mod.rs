//! The OpenAI-compatible HTTP surface. Requests are parsed only as far as
//! routing needs ([`view`]); the original bytes are what is forwarded.
//!
//! An inference request goes through [`pipeline`]'s phases; its attempts
//! at nodes through [`attempt`], each judged by [`classify`] and sent by
//! [`client`]; a streamed answer through [`answer`]'s one body, which
//! [`continuation`] lets go on at another node.

mod answer;
mod attempt;
mod body;
mod carry;
mod classify;
mod client;
mod continuation;
mod edge;
mod form;
mod guard;
mod opening;
mod pipeline;
mod progress;
mod responses;
mod scan;
mod server;
mod sse;
mod upstream;
mod view;

use std::net::IpAddr;
use std::sync::Arc;

use http::HeaderMap;

pub use body::{Budget, Reservation};
pub use client::{Forwarder, Settings as ForwarderSettings};
pub use server::{Gateway, admin_router, router};
pub use view::{RoutingView, parse_view, session_key};

/// What the fuzz targets (`fuzz/`) reach of the request path beyond the
/// public API; built only for them.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing {
    pub use super::sse::{
        carries_output, count_data_events, ended_well, ended_with_event, is_usage_only_event, opens_with,
    };
    pub use super::view::{
        estimated_prompt_tokens, metered_prompt_estimate, parse_request_view, with_model, with_usage_requested,
    };
}

use crate::auth::Caller;
use crate::error::ApiError;
use crate::routing;
use crate::snapshot::{RoutingSnapshot, SnapshotStore};

/// What every request's handling shares.
#[derive(Clone)]
pub struct AppState {
    pub snapshots: Arc<SnapshotStore>,
    pub forwarder: Forwarder,
    pub metrics: Arc<crate::metrics::Metrics>,
    pub registry: Arc<prometheus_client::registry::Registry>,
    pub max_body_bytes: usize,
    pub request_body_timeout: std::time::Duration,
    pub mode: routing::Mode,
    /// Sessions' caches may be carried between nodes (`carry`).
    pub carry: bool,
    /// Request counter for rotating strategies.
    pub tickets: Arc<std::sync::atomic::AtomicU64>,
    /// Where requests no node can start now wait; `None`: sent on to wait
    /// in the servers' queues.
    pub queue: Option<Arc<crate::queue::Queue>>,
    /// The bounded queue of routing decisions, one per answered request,
    /// reported to a controller for the dashboard's recent requests.
    pub decisions: Arc<crate::report::DecisionLog>,
    pub auth: Arc<crate::auth::Auth>,
    /// Proxies whose `X-Forwarded-For` names the client.
    pub trusted_proxies: Arc<[inferyes_net::forwarded::Cidr]>,
    pub ledger: Arc<crate::usage::Ledger>,
    /// What each key and tenant holds of this data plane now.
    pub shares: Arc<crate::shares::Shares>,
    /// This data plane's parts of the keys' fleet-wide limits.
    pub allowances: Arc<crate::allowance::Allowances>,
    /// This data plane's parts of the busy models' slots, by flow.
    pub slot_shares: Arc<crate::slot_shares::SlotShares>,
}

impl AppState {
    /// The caller of a request from `client`, or the error that refuses
    /// it (counted).
    pub(crate) async fn authenticate(
        &self,
        headers: &HeaderMap,
        client: IpAddr,
        snapshot: &RoutingSnapshot,
    ) -> Result<Caller, ApiError> {
        self.auth.authenticate(headers, client, snapshot).await.map_err(|(refusal, error)| self.refused(refusal, error))
    }

    /// One more request in flight for `caller`'s key (and tenant), or the
    /// refusal (counted) where its share is all taken. None with auth off.
    pub(crate) fn take_share(&self, caller: &Caller) -> Result<Option<Arc<crate::shares::Share>>, ApiError> {
        let Caller::Key(grant) = caller else { return Ok(None) };
        match self.shares.take(grant, self.allowances.max_concurrent(grant)) {
            Ok(share) => Ok(Some(Arc::new(share))),
            Err(past) => {
                // A key's own limit is split among the data planes: what
                // this one holds is a part of it.
                let held = match past.whose {
                    crate::shares::Whose::Key if grant.max_concurrent > 0 => {
                        self.allowances.refused_in_flight(&grant.key_id);
                        if past.limit < grant.max_concurrent {
                            format!(
                                "{} here of {} at once, split among the data planes",
                                past.limit, grant.max_concurrent
                            )
                        } else {
                            format!("{} at once", past.limit)
                        }
                    }
                    _ => format!("{} at once", past.limit),
                };
                Err(self.refused(
                    crate::auth::Refusal::InFlightShare,
                    ApiError::past_share(past.whose, &format!("all the requests in flight ({held})")),
                ))
            }
        }
    }

    pub(crate) fn refused(&self, refusal: crate::auth::Refusal, error: ApiError) -> ApiError {
        self.metrics.auth_refusals.get_or_create(&crate::metrics::ReasonLabels { reason: refusal.as_str() }).inc();
        error
    }
}

/// A request's id as text, for log lines and records. Always the whole id:
/// the data plane takes a client's id only where it is text
/// (`edge::request_id`), and makes its own of hex digits otherwise.
fn id_text(id: &http::HeaderValue) -> &str {
    id.to_str().unwrap_or_default()
}
