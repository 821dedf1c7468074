//! Traces: one request is one trace across data plane → agent → backend,
//! exported over OTLP/gRPC to a real receiver, continuing the client's own
//! `traceparent`. Its own test binary: the exporter is process-wide.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::Request;
use axum::middleware::Next;
use inferyes_agent::config::GpuSourceConfig;
use inferyes_sim::{SimConfig, Simulator};
use inferyes_tests::fleet::llama_server;
use inferyes_tests::{AgentHandle, ControllerHandle, DataplaneHandle, Etcd, HttpClient};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::any_value;
use opentelemetry_proto::tonic::trace::v1::Span;
use opentelemetry_sdk::trace::BatchConfigBuilder;
use serde_json::json;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// An OTLP trace receiver: every span it is sent, with its service name.
struct Receiver(mpsc::UnboundedSender<(String, Span)>);

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        for resource_spans in request.into_inner().resource_spans {
            let service = resource_spans
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|a| a.key == "service.name")
                .and_then(|a| a.value.as_ref())
                .and_then(|v| match &v.value {
                    Some(any_value::Value::StringValue(s)) => Some(s.clone()),
                    _ => None,
                })
                .unwrap_or_default();
            for span in resource_spans.scope_spans.into_iter().flat_map(|s| s.spans) {
                let _ = self.0.send((service.clone(), span));
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

fn attribute(span: &Span, key: &str) -> Option<String> {
    let value = span.attributes.iter().find(|a| a.key == key)?.value.as_ref()?.value.as_ref()?;
    Some(match value {
        any_value::Value::StringValue(s) => s.clone(),
        any_value::Value::IntValue(i) => i.to_string(),
        other => format!("{other:?}"),
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_is_one_trace_across_data_plane_agent_and_backend() {
    let receiver_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let receiver_addr = receiver_listener.local_addr().unwrap();
    let (span_tx, mut span_rx) = mpsc::unbounded_channel();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(Receiver(span_tx)))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(receiver_listener)),
    );
    let (layer, provider) = inferyes_net::telemetry::otlp_layer(
        "inferyes-test",
        &format!("http://{receiver_addr}"),
        BatchConfigBuilder::default().with_scheduled_delay(Duration::from_millis(50)),
    )
    .unwrap();
    tracing_subscriber::registry().with(layer).try_init().expect("the only subscriber of this test binary");

    // The backend: a simulated llama-server that notes the trace context
    // it is sent.
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let noted = Arc::clone(&seen);
    let sim = Simulator::new(SimConfig {
        prefill_tokens_per_second: 1e6,
        decode_tokens_per_second: 1e5,
        ..SimConfig::llama_server("chat")
    })
    .unwrap();
    let backend = sim.router().layer(axum::middleware::from_fn(move |request: Request, next: Next| {
        if request.uri().path().starts_with("/v1/chat")
            && let Some(value) = request.headers().get("traceparent").and_then(|v| v.to_str().ok())
        {
            noted.lock().unwrap().push(value.to_string());
        }
        next.run(request)
    }));
    let backend_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let backend_url = format!("http://{}", backend_listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(backend_listener, backend).await });

    let etcd = Etcd::start().await;
    let controller = ControllerHandle::start(&etcd.endpoint(), "controller-1").await;
    let _agent = AgentHandle::start_with(
        "node-a",
        &[controller.url()],
        GpuSourceConfig::Simulated,
        vec![llama_server(&backend_url, &["chat"])],
    )
    .await;
    let dataplane = DataplaneHandle::start(&[controller.url()]).await;
    dataplane.wait_for_nodes(&["node-a"]).await;

    let client_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let client_span = "00f067aa0ba902b7";
    let traceparent = format!("00-{client_trace}-{client_span}-01");
    let body = json!({"model": "chat", "max_tokens": 4, "messages": [{"role": "user", "content": "trace me"}]});
    let response = HttpClient::default()
        .send(
            http::Method::POST,
            &format!("{}/v1/chat/completions", dataplane.url),
            body.to_string().into(),
            &[("traceparent", &traceparent)],
        )
        .await;
    assert_eq!(response.status, http::StatusCode::OK);
    let request_id = response.header("x-request-id").unwrap().to_string();

    let flusher = provider.clone();
    tokio::task::spawn_blocking(move || flusher.force_flush()).await.unwrap().unwrap();
    let mut request_span: Option<Span> = None;
    let mut proxy_span: Option<Span> = None;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while request_span.is_none() || proxy_span.is_none() {
        let (service, span) = tokio::time::timeout_at(deadline, span_rx.recv())
            .await
            .expect("both spans exported within 10 s")
            .expect("the receiver runs");
        assert_eq!(service, "inferyes-test");
        if inferyes_proto::hex(&span.trace_id) != client_trace {
            continue;
        }
        match span.name.as_str() {
            "/v1/chat/completions" if attribute(&span, "request_id").as_deref() == Some(request_id.as_str()) => {
                request_span = Some(span);
            }
            "/v1/chat/completions" => proxy_span = Some(span),
            other => panic!("unexpected span `{other}` in the client's trace"),
        }
    }
    let (request_span, proxy_span) = (request_span.unwrap(), proxy_span.unwrap());

    // The data plane continued the client's trace...
    assert_eq!(inferyes_proto::hex(&request_span.parent_span_id), client_span);
    assert_eq!(attribute(&request_span, "node").as_deref(), Some("node-a"));
    assert_eq!(attribute(&request_span, "route").as_deref(), Some("placed"));
    assert_eq!(attribute(&request_span, "http.response.status_code").as_deref(), Some("200"));
    // ...with what routing weighed the node would cost, term by term: a
    // new conversation on an idle node pays only for reading its prompt.
    let term = |key: &str| -> u64 {
        let value = attribute(&request_span, key).unwrap_or_else(|| panic!("{key} on the request's span"));
        value.parse().unwrap_or_else(|_| panic!("{key} is a count: {value}"))
    };
    assert_eq!((term("cost.queue_ahead"), term("cost.cached_tokens"), term("cost.move_ms")), (0, 0, 0));
    assert_eq!((term("cost.wait_ms"), term("cost.carry_ms")), (0, 0));
    assert_eq!(term("cost.ms"), term("cost.prefill_ms"));
    // ...the agent's hop is its child...
    assert_eq!(proxy_span.parent_span_id, request_span.span_id);
    assert_eq!(attribute(&proxy_span, "backend").as_deref(), Some("main"));
    // ...and the backend was told the agent's span as its parent.
    let expected = format!("00-{client_trace}-{}-01", inferyes_proto::hex(&proxy_span.span_id));
    assert_eq!(seen.lock().unwrap().as_slice(), [expected]);

    tokio::task::spawn_blocking(move || provider.shutdown()).await.unwrap().unwrap();
}
