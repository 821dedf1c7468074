//! The data plane's HTTP surface: the service of each client connection,
//! which serves every path of the kinds table
//! ([`inferyes_proto::kinds::ROWS`]) itself, and the routes that are not
//! inference (models, health, metrics).

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use http::{Method, StatusCode, header};
use inferyes_proto::ErrorKind;
use inferyes_proto::kinds::{self, ErrorShape};
use serde_json::json;

use super::AppState;
use super::edge::{Edge, request_id};
use crate::error::{ApiError, ErrorCode};
use crate::snapshot::CatalogEntry;

/// The data plane's HTTP service for one client connection. Inference
/// requests go straight to their handler; everything else (models, health,
/// metrics, and any request the fast path does not take) goes through the
/// axum [`router`], which routes every path, inference included. Both are
/// wrapped by [`Edge`].
///
/// Why a fast path: axum's routing, middleware and boxed services cost
/// several allocations and about a tenth of the data plane's instructions
/// per request, for a choice among a few fixed paths.
#[derive(Clone)]
pub struct Gateway {
    state: Arc<AppState>,
    router: Router,
    peer: SocketAddr,
}

impl Gateway {
    pub fn new(state: AppState) -> Gateway {
        let state = Arc::new(state);
        Gateway { router: router(Arc::clone(&state)), state, peer: SocketAddr::from(([0, 0, 0, 0], 0)) }
    }

    /// The service of one connection from `peer`.
    pub fn connection(&self, peer: SocketAddr) -> Gateway {
        Gateway { peer, ..self.clone() }
    }

    /// Who a request on this connection is from.
    fn client(&self, headers: &http::HeaderMap) -> IpAddr {
        inferyes_net::forwarded::client_address(self.peer.ip(), headers, &self.state.trusted_proxies)
    }
}

impl hyper::service::Service<http::Request<hyper::body::Incoming>> for Gateway {
    type Response = Response;
    type Error = std::convert::Infallible;
    type Future = std::pin::Pin<Box<dyn Future<Output = Result<Response, Self::Error>> + Send>>;

    fn call(&self, request: http::Request<hyper::body::Incoming>) -> Self::Future {
        let id = request_id(request.headers());
        match kinds::row(request.uri().path()) {
            // Its body read as hyper's own type: no boxing per request.
            Some(row) if request.method() == Method::POST => {
                let client = self.client(request.headers());
                let handler = super::pipeline::inference(Arc::clone(&self.state), row, request, id.clone(), client);
                Box::pin(Edge::new(id, handler, row.errors))
            }
            Some(row) => {
                let refused = async move { method_not_allowed(request.map(Body::new)).await.in_shape(row.errors) };
                Box::pin(Edge::new(id, refused, row.errors))
            }
            None => {
                let client = Client(self.client(request.headers()));
                let mut request = request.map(Body::new);
                request.extensions_mut().insert(client);
                let routed = tower::ServiceExt::oneshot(self.router.clone(), request);
                Box::pin(Edge::new(id, routed, ErrorShape::OpenAi))
            }
        }
    }
}

/// Every public route but the inference endpoints, which a [`Gateway`]
/// serves itself. Requests reach it through a [`Gateway`], which gives them
/// their [`Client`].
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/v1/models", get(list_models))
        .route("/v1/models/{*id}", get(get_model))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

/// The admin port's routes: metrics for scrapers, health for probes.
pub fn admin_router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(state)
}

/// The client's address, for requests that go through the router.
#[derive(Clone, Copy, Debug)]
pub struct Client(pub IpAddr);

/// Without the connection's address (never, when served), failures share
/// one bucket.
fn client_of(extensions: &http::Extensions) -> IpAddr {
    extensions.get::<Client>().map_or(IpAddr::from([0, 0, 0, 0]), |client| client.0)
}

async fn readyz(State(state): State<Arc<AppState>>) -> Response {
    match state.snapshots.version() {
        Some(version) => (StatusCode::OK, format!("ready, snapshot version {version}\n")).into_response(),
        None => (StatusCode::SERVICE_UNAVAILABLE, "no routing snapshot yet\n").into_response(),
    }
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let snapshot = state.snapshots.current();
    let mut text = String::new();
    let encoded = {
        let _one_at_a_time = state.metrics.scrape.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        state.metrics.observe(snapshot.as_deref(), state.snapshots.age_seconds());
        state.metrics.buffered_bytes.set(i64::try_from(state.forwarder.budget().used()).unwrap_or(i64::MAX));
        state.metrics.allowance_dataplanes.set(i64::from(state.allowances.dataplanes()));
        state.metrics.allowance_settling.set(i64::from(state.allowances.settling()));
        prometheus_client::encoding::text::encode(&mut text, &state.registry)
    };
    if encoded.is_err() {
        return (StatusCode::INTERNAL_SERVER_ERROR, "metrics could not be encoded\n").into_response();
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response()
}

async fn not_found(request: Request) -> ApiError {
    ApiError::new(ErrorKind::NotFound, format!("unknown path {}", request.uri().path()), ErrorCode::UnknownUrl)
}

async fn method_not_allowed(request: Request) -> ApiError {
    let mut error = ApiError::new(
        ErrorKind::BadRequest,
        format!("{} is not allowed on {}", request.method(), request.uri().path()),
        ErrorCode::MethodNotAllowed,
    );
    error.status = Some(StatusCode::METHOD_NOT_ALLOWED);
    error
}

fn model_object(entry: &CatalogEntry) -> serde_json::Value {
    let mut object = json!({
        "id": entry.id,
        "object": "model",
        "created": 0,
        "owned_by": "inferyes",
        "inferyes": {
            "state": if entry.warm_nodes > 0 { "warm" } else { "cold" },
            "warm_nodes": entry.warm_nodes,
            "nodes": entry.nodes,
            "context_window": entry.context_window,
        }
    });
    if let Some(model) = &entry.alias_of {
        object["inferyes"]["alias_of"] = json!(model);
    }
    object
}

async fn list_models(State(state): State<Arc<AppState>>, request: Request) -> Result<Response, ApiError> {
    let snapshot = state.snapshots.current().ok_or_else(ApiError::not_ready)?;
    let caller = state.authenticate(request.headers(), client_of(request.extensions()), &snapshot).await?;
    let data: Vec<_> = snapshot.catalog().iter().filter(|entry| caller.may_see(entry)).map(model_object).collect();
    Ok(axum::Json(json!({"object": "list", "data": data})).into_response())
}

async fn get_model(
    State(state): State<Arc<AppState>>,
    id: Result<Path<String>, axum::extract::rejection::PathRejection>,
    request: Request,
) -> Result<Response, ApiError> {
    // axum's own rejection is plain text.
    let Path(id) = id.map_err(|rejection| {
        ApiError::new(
            ErrorKind::BadRequest,
            format!("the model id in the path is not usable: {rejection}"),
            ErrorCode::InvalidPath,
        )
    })?;
    let snapshot = state.snapshots.current().ok_or_else(ApiError::not_ready)?;
    let caller = state.authenticate(request.headers(), client_of(request.extensions()), &snapshot).await?;
    let entry =
        snapshot.model(&id).filter(|entry| caller.may_see(entry)).ok_or_else(|| ApiError::no_such_model(&id))?;
    Ok(axum::Json(model_object(entry)).into_response())
}
