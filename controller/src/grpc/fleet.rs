use inferyes_proto::ErrorKind;
use inferyes_proto::v1::fleet_service_server::{FleetService, FleetServiceServer};
use inferyes_proto::v1::{
    Alias, AliasRecord, ApiKey, CreateKeyRequest, CreatedKey, DeleteAliasRequest, DrainRecord, DrainRequest,
    DrainResponse, ExplainRequest, ExplainResponse, GetKeyRequest, GetNodeRequest, GetPolicyRequest,
    ListAliasesRequest, ListAliasesResponse, ListKeysRequest, ListKeysResponse, ListModelsRequest, ListModelsResponse,
    ListNodesRequest, ListNodesResponse, ListSessionsRequest, ListSessionsResponse, NodePolicy, Priority,
    RevokeKeyRequest, RoutingPolicy, SetNodePolicyRequest, SnapshotNode, UndrainRequest, UsageQuery, UsageRecord,
    UsageReport, UsageRow, WriteResponse,
};
use tonic::{Request, Response, Status};

use super::status;
use crate::reconcile::SnapshotRx;
use crate::snapshot::Snapshot;
use crate::store::EtcdStore;

/// Fleet queries (answered from this controller's snapshot) and admin
/// writes (to etcd; they reach every controller through the watch).
#[derive(Clone)]
pub struct FleetSvc {
    pub store: EtcdStore,
    pub snapshots: SnapshotRx,
    /// Writes and everything about API keys need it; `None`: open.
    pub admin_token: Option<inferyes_proto::bearer::Accepted>,
    /// Reads need one of these (the admin's or a viewer's); `None`: open.
    pub reader_tokens: Option<inferyes_proto::bearer::Accepted>,
    /// Resident sessions are asked of the reconciler, which holds them.
    pub live_requests: tokio::sync::mpsc::Sender<crate::reconcile::LiveRequest>,
    pub views: crate::reconcile::LiveViewRx,
    /// What data planes report they decided: `Explain` reads it.
    pub activity: std::sync::Arc<crate::activity::Activity>,
}

/// The most sessions one `ListSessions` answer holds.
const SESSIONS_LISTED: usize = 100_000;
/// How long `Explain` waits for a request it does not know yet: data
/// planes report what they decided each second.
const EXPLAIN_WAIT: std::time::Duration = std::time::Duration::from_secs(3);

impl FleetSvc {
    pub fn svc(self) -> FleetServiceServer<Self> {
        FleetServiceServer::new(self)
    }

    /// Refuses a call without the admin token (when one is configured).
    fn admin<T>(&self, request: &Request<T>) -> Result<(), Status> {
        require(
            request,
            self.admin_token.as_ref(),
            "this call needs the admin token (inferyesctl: --admin-token-file or INFERYES_ADMIN_TOKEN)",
            "this call needs the admin token, and that is not it",
        )
    }

    /// Refuses a read without a viewer's or the admin token (when reads
    /// need one): nodes, sessions and models are the operator's to see.
    fn reader<T>(&self, request: &Request<T>) -> Result<(), Status> {
        require(
            request,
            self.reader_tokens.as_ref(),
            "reading the fleet needs a viewer or the admin token (inferyesctl: --viewer-token-file or \
             --admin-token-file)",
            "the token is neither a viewer's nor the admin's of this fleet",
        )
    }

    fn snapshot(&self) -> Result<std::sync::Arc<Snapshot>, Status> {
        self.snapshots
            .borrow()
            .clone()
            .ok_or_else(|| status(ErrorKind::Unavailable, "the controller has not read the fleet from etcd yet"))
    }
}

/// A call's token checked against `accepted` (none: open), refused with
/// `missing` or `wrong` as the case is.
fn require<T>(
    request: &Request<T>,
    accepted: Option<&inferyes_proto::bearer::Accepted>,
    missing: &str,
    wrong: &str,
) -> Result<(), Status> {
    inferyes_proto::bearer::check_call(request, accepted).map_err(|refusal| match refusal {
        inferyes_proto::bearer::Refusal::Missing => status(ErrorKind::Unauthenticated, missing),
        inferyes_proto::bearer::Refusal::Wrong => status(ErrorKind::PermissionDenied, wrong),
    })
}

#[tonic::async_trait]
impl FleetService for FleetSvc {
    async fn list_nodes(&self, request: Request<ListNodesRequest>) -> Result<Response<ListNodesResponse>, Status> {
        self.reader(&request)?;
        let snapshot = self.snapshot()?;
        Ok(Response::new(ListNodesResponse {
            version: snapshot.version(),
            nodes: snapshot.merged_nodes(&self.views.borrow()).collect(),
        }))
    }

    async fn get_node(&self, request: Request<GetNodeRequest>) -> Result<Response<SnapshotNode>, Status> {
        self.reader(&request)?;
        let node_id = request.into_inner().node_id;
        let snapshot = self.snapshot()?;
        let node = snapshot
            .merged(&node_id, &self.views.borrow())
            .ok_or_else(|| status(ErrorKind::NotFound, format!("no node `{node_id}` in the fleet")))?;
        Ok(Response::new(node))
    }

    async fn list_models(&self, request: Request<ListModelsRequest>) -> Result<Response<ListModelsResponse>, Status> {
        self.reader(&request)?;
        let snapshot = self.snapshot()?;
        Ok(Response::new(ListModelsResponse {
            version: snapshot.version(),
            models: crate::snapshot::model_summaries(&snapshot),
        }))
    }

    async fn explain(&self, request: Request<ExplainRequest>) -> Result<Response<ExplainResponse>, Status> {
        self.reader(&request)?;
        let request_id = request.into_inner().request_id;
        if request_id.len() > inferyes_proto::MAX_NAME_BYTES {
            return Err(status(
                ErrorKind::BadRequest,
                "a request id is its answer's `x-request-id`, shorter than that",
            ));
        }
        // Reports come each second: a request answered a moment ago is
        // waited for, a report at a time.
        let mut reports = self.activity.subscribe();
        let found = tokio::time::timeout(EXPLAIN_WAIT, async {
            loop {
                if let Some(found) = self.activity.explain(&request_id) {
                    return Some(found);
                }
                reports.changed().await.ok()?;
            }
        })
        .await
        .ok()
        .flatten();
        let Some(found) = found else {
            if request_id.is_empty() {
                return Err(status(ErrorKind::NotFound, "no data plane has reported a request to this controller yet"));
            }
            return Err(status(
                ErrorKind::NotFound,
                format!(
                    "no request `{request_id}` among the last {} decisions data planes reported to this \
                     controller (a data plane reports to the controllers it lists, at most 512 decisions a \
                     second: ask one of those, soon after the request)",
                    crate::activity::KEPT
                ),
            ));
        };
        Ok(Response::new(ExplainResponse { dataplane_id: found.dataplane_id, decision: Some(found.decision) }))
    }

    async fn list_sessions(
        &self,
        request: Request<ListSessionsRequest>,
    ) -> Result<Response<ListSessionsResponse>, Status> {
        // Session keys name conversations, and listing them all is work
        // for the one task that holds them: for the operator's eyes only.
        self.reader(&request)?;
        let filter = request.into_inner().node_id;
        let snapshot = self.snapshot()?;
        let (reply, answer) = tokio::sync::oneshot::channel();
        let node_id = (!filter.is_empty()).then_some(filter);
        let request = crate::reconcile::LiveRequest::Sessions { node_id, limit: SESSIONS_LISTED, reply };
        let unavailable = || status(ErrorKind::Unavailable, "the controller is shutting down");
        self.live_requests.send(request).await.map_err(|_| unavailable())?;
        let (sessions, truncated) = answer.await.map_err(|_| unavailable())?;
        Ok(Response::new(ListSessionsResponse { version: snapshot.version(), sessions, truncated }))
    }

    async fn drain(&self, request: Request<DrainRequest>) -> Result<Response<DrainResponse>, Status> {
        self.admin(&request)?;
        let request = request.into_inner();
        let known = self.snapshot()?.node(&request.node_id).is_some();
        if !known && !request.force {
            return Err(status(
                ErrorKind::NotFound,
                format!("no node `{}` in the fleet (use force to drain it before it joins)", request.node_id),
            ));
        }
        let record = DrainRecord { reason: request.reason, since_unix_ms: inferyes_proto::unix_ms() };
        let revision = self.store.put(self.store.keys().drain(&request.node_id), &record).await?;
        tracing::info!(node = %request.node_id, revision, "node drained");
        Ok(Response::new(DrainResponse { node_id: request.node_id, draining: true, revision }))
    }

    async fn undrain(&self, request: Request<UndrainRequest>) -> Result<Response<DrainResponse>, Status> {
        self.admin(&request)?;
        let node_id = request.into_inner().node_id;
        let revision = self.store.delete(self.store.keys().drain(&node_id)).await?;
        tracing::info!(node = %node_id, revision, "node undrained");
        Ok(Response::new(DrainResponse { node_id, draining: false, revision }))
    }

    async fn list_aliases(
        &self,
        request: Request<ListAliasesRequest>,
    ) -> Result<Response<ListAliasesResponse>, Status> {
        self.reader(&request)?;
        let snapshot = self.snapshot()?;
        Ok(Response::new(ListAliasesResponse { version: snapshot.version(), aliases: snapshot.aliases().to_vec() }))
    }

    async fn set_alias(&self, request: Request<Alias>) -> Result<Response<WriteResponse>, Status> {
        self.admin(&request)?;
        let Alias { alias, model } = request.into_inner();
        validate_name("alias", &alias)?;
        validate_name("model", &model)?;
        if alias == model {
            return Err(status(ErrorKind::BadRequest, "an alias cannot name itself"));
        }
        let snapshot = self.snapshot()?;
        if snapshot.aliases().iter().any(|a| a.alias == model) {
            return Err(status(ErrorKind::BadRequest, format!("`{model}` is itself an alias: aliases name models")));
        }
        if crate::snapshot::model_summaries(&snapshot).iter().any(|m| m.id == alias) {
            return Err(status(
                ErrorKind::BadRequest,
                format!("`{alias}` is a model of the fleet; an alias cannot hide it"),
            ));
        }
        let revision = self.store.put(self.store.keys().alias(&alias), &AliasRecord { model: model.clone() }).await?;
        tracing::info!(%alias, %model, revision, "alias set");
        Ok(Response::new(WriteResponse { revision }))
    }

    async fn delete_alias(&self, request: Request<DeleteAliasRequest>) -> Result<Response<WriteResponse>, Status> {
        self.admin(&request)?;
        let alias = request.into_inner().alias;
        if !self.snapshot()?.aliases().iter().any(|a| a.alias == alias) {
            return Err(status(ErrorKind::NotFound, format!("no alias `{alias}`")));
        }
        let revision = self.store.delete(self.store.keys().alias(&alias)).await?;
        tracing::info!(%alias, revision, "alias deleted");
        Ok(Response::new(WriteResponse { revision }))
    }

    async fn get_policy(&self, request: Request<GetPolicyRequest>) -> Result<Response<RoutingPolicy>, Status> {
        self.reader(&request)?;
        Ok(Response::new(self.snapshot()?.policy().clone()))
    }

    async fn set_policy(&self, request: Request<RoutingPolicy>) -> Result<Response<WriteResponse>, Status> {
        self.admin(&request)?;
        let policy = request.into_inner();
        validate_thresholds(policy.admission_threshold, policy.hard_limit)?;
        if policy.load_bound != 0.0 && !(1.0..=100.0).contains(&policy.load_bound) {
            return Err(status(ErrorKind::BadRequest, "load_bound must be at least 1 (0: the default, 1.25)"));
        }
        validate_replicas(&policy)?;
        let revision = self.store.put(self.store.keys().policy(), &policy).await?;
        tracing::info!(revision, "routing policy set");
        Ok(Response::new(WriteResponse { revision }))
    }

    async fn set_node_policy(&self, request: Request<SetNodePolicyRequest>) -> Result<Response<WriteResponse>, Status> {
        self.admin(&request)?;
        let SetNodePolicyRequest { node_id, policy } = request.into_inner();
        validate_name("node_id", &node_id)?;
        let policy = policy.unwrap_or_default();
        validate_thresholds(policy.admission_threshold, policy.hard_limit)?;
        let key = self.store.keys().node_policy(&node_id);
        let revision = if policy == NodePolicy::default() {
            self.store.delete(key).await?
        } else {
            self.store.put(key, &policy).await?
        };
        tracing::info!(node = %node_id, revision, "node policy set");
        Ok(Response::new(WriteResponse { revision }))
    }

    async fn create_key(&self, request: Request<CreateKeyRequest>) -> Result<Response<CreatedKey>, Status> {
        self.admin(&request)?;
        let request = request.into_inner();
        let name = request.name.trim();
        if name.is_empty() || name.len() > 128 || name.chars().any(char::is_control) {
            return Err(status(ErrorKind::BadRequest, "a key needs a name of 1-128 printable characters"));
        }
        for pattern in &request.allowed_models {
            validate_name("model pattern", pattern)?;
        }
        if !inferyes_proto::apikey::valid_tenant(&request.tenant) {
            return Err(status(ErrorKind::BadRequest, "a tenant is 1-64 of A-Z a-z 0-9 . _ - (or none)"));
        }
        if request.weight > inferyes_proto::apikey::MAX_WEIGHT {
            return Err(status(
                ErrorKind::BadRequest,
                format!("a weight is 1-{} (0: 1)", inferyes_proto::apikey::MAX_WEIGHT),
            ));
        }
        if Priority::try_from(request.priority).is_err() {
            return Err(status(ErrorKind::BadRequest, "a priority is interactive or batch"));
        }
        let now = inferyes_proto::unix_ms();
        if request.expires_unix_ms != 0 && request.expires_unix_ms <= now {
            return Err(status(ErrorKind::BadRequest, "expires_unix_ms is in the past"));
        }
        // Hashing takes tens of milliseconds: off the async threads.
        let generated = tokio::task::spawn_blocking(inferyes_proto::apikey::generate)
            .await
            .map_err(|_| status(ErrorKind::Internal, "key generation failed"))?
            .map_err(|e| status(ErrorKind::Internal, e.to_string()))?;
        let key = ApiKey {
            key_id: generated.key_id,
            name: name.to_string(),
            secret_hash: generated.secret_hash,
            allowed_models: request.allowed_models,
            requests_per_minute: request.requests_per_minute,
            tokens_per_day: request.tokens_per_day,
            expires_unix_ms: request.expires_unix_ms,
            revoked: false,
            created_unix_ms: now,
            revoked_unix_ms: 0,
            tenant: request.tenant,
            max_concurrent: request.max_concurrent,
            weight: request.weight,
            priority: request.priority,
        };
        let revision = self.store.put(self.store.keys().api_key(&key.key_id), &key).await?;
        // The id and name are logged; the secret never is.
        tracing::info!(key_id = %key.key_id, name = %key.name, revision, "API key created");
        Ok(Response::new(CreatedKey { key: Some(without_hash(&key)), secret: generated.token, revision }))
    }

    async fn list_keys(&self, request: Request<ListKeysRequest>) -> Result<Response<ListKeysResponse>, Status> {
        self.admin(&request)?;
        let snapshot = self.snapshot()?;
        let keys = snapshot.api_keys().map(without_hash).collect();
        Ok(Response::new(ListKeysResponse { version: snapshot.version(), keys }))
    }

    async fn get_key(&self, request: Request<GetKeyRequest>) -> Result<Response<ApiKey>, Status> {
        self.admin(&request)?;
        let key_id = request.into_inner().key_id;
        let snapshot = self.snapshot()?;
        let key = snapshot.api_key(&key_id).ok_or_else(|| status(ErrorKind::NotFound, format!("no key `{key_id}`")))?;
        Ok(Response::new(without_hash(key)))
    }

    async fn revoke_key(&self, request: Request<RevokeKeyRequest>) -> Result<Response<WriteResponse>, Status> {
        self.admin(&request)?;
        let key_id = request.into_inner().key_id;
        let snapshot = self.snapshot()?;
        let mut key = snapshot
            .api_key(&key_id)
            .cloned()
            .ok_or_else(|| status(ErrorKind::NotFound, format!("no key `{key_id}`")))?;
        if key.revoked {
            return Ok(Response::new(WriteResponse { revision: snapshot.version() }));
        }
        key.revoked = true;
        key.revoked_unix_ms = inferyes_proto::unix_ms();
        let revision = self.store.put(self.store.keys().api_key(&key_id), &key).await?;
        tracing::info!(%key_id, revision, "API key revoked");
        Ok(Response::new(WriteResponse { revision }))
    }

    async fn get_usage(&self, request: Request<UsageQuery>) -> Result<Response<UsageReport>, Status> {
        self.admin(&request)?;
        let query = request.into_inner();
        let since = usage_since(&query);
        // Tenants as the fleet knows them now; none before it is read.
        let snapshot = self.snapshot().ok();
        let tenant_of = |key_id: &str| snapshot.as_ref().map(|s| s.tenant_of(key_id)).unwrap_or_default();
        let rows = self
            .store
            .usage_rollups(&format!("hourly/{}", crate::ledger::hour_of(since)))
            .await?
            .into_iter()
            .filter_map(|(suffix, usage)| {
                let key = crate::ledger::RollupKey::parse(&suffix)?;
                let wanted = (query.key_id.is_empty() || query.key_id == key.key_id)
                    && (query.model.is_empty() || query.model == key.model);
                wanted.then(|| UsageRow {
                    hour_unix_ms: crate::ledger::hour_start_ms(&key.hour).unwrap_or(0),
                    tenant: tenant_of(&key.key_id),
                    key_id: key.key_id,
                    model: key.model,
                    usage: Some(usage),
                })
            })
            .collect();
        let pending_batches = self.store.pending_usage_count().await?;
        Ok(Response::new(UsageReport { rows, pending_batches }))
    }

    type ExportUsageStream = std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<UsageRecord, Status>> + Send>>;

    async fn export_usage(&self, request: Request<UsageQuery>) -> Result<Response<Self::ExportUsageStream>, Status> {
        self.admin(&request)?;
        let query = request.into_inner();
        let since = usage_since(&query);
        let batches = self.store.usage_raw(&format!("raw/{}", crate::ledger::hour_of(since))).await?;
        let records: Vec<Result<UsageRecord, Status>> = batches
            .into_iter()
            .flat_map(|b| b.records)
            .filter(|r| {
                r.unix_ms >= since
                    && (query.key_id.is_empty() || query.key_id == r.key_id)
                    && (query.model.is_empty() || query.model == r.model)
            })
            .map(Ok)
            .collect();
        Ok(Response::new(Box::pin(tokio_stream::iter(records))))
    }
}

/// The start of a usage query: its own, else the last 24 hours.
fn usage_since(query: &UsageQuery) -> u64 {
    if query.since_unix_ms > 0 { query.since_unix_ms } else { inferyes_proto::unix_ms().saturating_sub(86_400_000) }
}

/// A key as operators see it: everything but the hash.
fn without_hash(key: &ApiKey) -> ApiKey {
    ApiKey { secret_hash: String::new(), ..key.clone() }
}

fn validate_name(what: &str, name: &str) -> Result<(), Status> {
    let most = inferyes_proto::MAX_NAME_BYTES;
    if name.is_empty() || name.len() > most || name.chars().any(char::is_control) {
        return Err(status(ErrorKind::BadRequest, format!("{what} must be 1-{most} bytes of printable characters")));
    }
    Ok(())
}

/// Models placement keeps warm at most: each is planned every second.
const MAX_DECLARED_MODELS: usize = 256;
/// Warm replicas a model may be declared to want.
const MAX_REPLICAS: u32 = 1024;

fn validate_replicas(policy: &RoutingPolicy) -> Result<(), Status> {
    if policy.replicas.len() + policy.latency_critical_models.len() > MAX_DECLARED_MODELS {
        return Err(status(
            ErrorKind::BadRequest,
            format!("at most {MAX_DECLARED_MODELS} models may have replicas or be latency-critical"),
        ));
    }
    for (model, replicas) in &policy.replicas {
        validate_name("a model with replicas", model)?;
        if replicas.min > MAX_REPLICAS || replicas.max > MAX_REPLICAS {
            return Err(status(ErrorKind::BadRequest, format!("replicas of `{model}` must be at most {MAX_REPLICAS}")));
        }
        if replicas.max != 0 && replicas.max < replicas.min {
            return Err(status(
                ErrorKind::BadRequest,
                format!("replicas of `{model}`: max ({}) is below min ({})", replicas.max, replicas.min),
            ));
        }
    }
    Ok(())
}

/// Fractions of GPU memory; 0 means "inherit".
fn validate_thresholds(admission: f64, hard: f64) -> Result<(), Status> {
    let fraction = |v: f64| v == 0.0 || (v > 0.0 && v <= 1.0);
    if !fraction(admission) || !fraction(hard) {
        return Err(status(ErrorKind::BadRequest, "thresholds are fractions of GPU memory in (0, 1], e.g. 0.92"));
    }
    if admission != 0.0 && hard != 0.0 && admission > hard {
        return Err(status(ErrorKind::BadRequest, "admission_threshold must not exceed hard_limit"));
    }
    Ok(())
}
