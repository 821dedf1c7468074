use std::collections::BTreeMap;

use inferyes_proto::ErrorKind;
use inferyes_proto::v1::fleet_service_server::{FleetService, FleetServiceServer};
use inferyes_proto::v1::{
    DrainRecord, DrainRequest, DrainResponse, GetNodeRequest, ListModelsRequest, ListModelsResponse, ListNodesRequest,
    ListNodesResponse, ListSessionsRequest, ListSessionsResponse, ModelState, ModelSummary, SessionInfo, SnapshotNode,
    UndrainRequest,
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
}

impl FleetSvc {
    pub fn svc(self) -> FleetServiceServer<Self> {
        FleetServiceServer::new(self)
    }

    fn snapshot(&self) -> Result<std::sync::Arc<Snapshot>, Status> {
        self.snapshots
            .borrow()
            .clone()
            .ok_or_else(|| status(ErrorKind::Unavailable, "the controller has not read the fleet from etcd yet"))
    }
}

#[tonic::async_trait]
impl FleetService for FleetSvc {
    async fn list_nodes(&self, _: Request<ListNodesRequest>) -> Result<Response<ListNodesResponse>, Status> {
        let snapshot = self.snapshot()?;
        Ok(Response::new(ListNodesResponse { version: snapshot.version(), nodes: snapshot.nodes().cloned().collect() }))
    }

    async fn get_node(&self, request: Request<GetNodeRequest>) -> Result<Response<SnapshotNode>, Status> {
        let node_id = request.into_inner().node_id;
        let snapshot = self.snapshot()?;
        let node = snapshot
            .node(&node_id)
            .cloned()
            .ok_or_else(|| status(ErrorKind::NotFound, format!("no node `{node_id}` in the fleet")))?;
        Ok(Response::new(node))
    }

    async fn list_models(&self, _: Request<ListModelsRequest>) -> Result<Response<ListModelsResponse>, Status> {
        let snapshot = self.snapshot()?;
        Ok(Response::new(ListModelsResponse { version: snapshot.version(), models: model_summaries(&snapshot) }))
    }

    async fn list_sessions(
        &self,
        request: Request<ListSessionsRequest>,
    ) -> Result<Response<ListSessionsResponse>, Status> {
        let filter = request.into_inner().node_id;
        let snapshot = self.snapshot()?;
        let sessions = snapshot
            .nodes()
            .filter_map(|n| n.status.as_ref())
            .filter(|s| filter.is_empty() || s.node_id == filter)
            .flat_map(|s| {
                s.sessions
                    .iter()
                    .map(|session| SessionInfo { node_id: s.node_id.clone(), session: Some(session.clone()) })
            })
            .collect();
        Ok(Response::new(ListSessionsResponse { version: snapshot.version(), sessions }))
    }

    async fn drain(&self, request: Request<DrainRequest>) -> Result<Response<DrainResponse>, Status> {
        let request = request.into_inner();
        let known = self.snapshot()?.node(&request.node_id).is_some();
        if !known && !request.force {
            return Err(status(
                ErrorKind::NotFound,
                format!("no node `{}` in the fleet (use force to drain it before it joins)", request.node_id),
            ));
        }
        let record = DrainRecord { reason: request.reason, since_unix_ms: inferyes_proto::unix_ms() };
        let revision = self.store.put_drain(&request.node_id, &record).await?;
        tracing::info!(node = %request.node_id, revision, "node drained");
        Ok(Response::new(DrainResponse { node_id: request.node_id, draining: true, revision }))
    }

    async fn undrain(&self, request: Request<UndrainRequest>) -> Result<Response<DrainResponse>, Status> {
        let node_id = request.into_inner().node_id;
        let revision = self.store.delete_drain(&node_id).await?;
        tracing::info!(node = %node_id, revision, "node undrained");
        Ok(Response::new(DrainResponse { node_id, draining: false, revision }))
    }
}

/// The fleet's model catalog: one entry per model id, with where it is
/// loaded and where it could be.
pub fn model_summaries(snapshot: &Snapshot) -> Vec<ModelSummary> {
    let mut models: BTreeMap<&str, ModelSummary> = BTreeMap::new();
    for status in snapshot.nodes().filter_map(|n| n.status.as_ref()) {
        for model in status.backends.iter().flat_map(|b| &b.models) {
            let summary =
                models.entry(&model.id).or_insert_with(|| ModelSummary { id: model.id.clone(), ..Default::default() });
            if !summary.available_on.contains(&status.node_id) {
                summary.available_on.push(status.node_id.clone());
            }
            if model.state() == ModelState::Loaded && !summary.loaded_on.contains(&status.node_id) {
                summary.loaded_on.push(status.node_id.clone());
            }
            summary.context_window = summary.context_window.max(model.context_window);
            for endpoint in &model.endpoints {
                if !summary.endpoints.contains(endpoint) {
                    summary.endpoints.push(*endpoint);
                }
            }
        }
    }
    models.into_values().collect()
}
