//! Logs and traces, set up the same way in every binary.
//!
//! Logs go to stderr as text or JSON lines, filtered by `RUST_LOG`
//! (default `info`). When `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or
//! `OTEL_EXPORTER_OTLP_ENDPOINT` is set, request spans are also exported
//! over OTLP/gRPC (`OTEL_SERVICE_NAME` and the other standard `OTEL_*`
//! variables apply). W3C trace context travels between the components in
//! `traceparent`: data plane → agent → backend.
//!
//! Only spans of [`SPAN_TARGET`] are exported, and with them the warnings
//! and errors logged inside them: the components' long-lived task spans
//! would otherwise collect events in memory for as long as they run.
//!
//! Those request spans are traces only: logs do not show them. A span the
//! log layer sees has its fields formatted when it opens and each time one
//! is recorded, on every request; that cost the data plane 9% of its
//! throughput. Without an exporter the spans are disabled and cost nothing,
//! and the request path's log lines name their `request_id` themselves.

use std::time::Duration;

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{SpanExporter, WithExportConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{BatchConfigBuilder, BatchSpanProcessor, SdkTracerProvider};
use tracing::Subscriber;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::Layer;
use tracing_subscriber::filter::FilterExt;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;

use crate::process::LogFormat;

/// The target of the spans that are traces: one per request and hop.
pub const SPAN_TARGET: &str = "inferyes::trace";

/// Holds the span exporter, if any; [`Telemetry::shutdown`] flushes it.
#[must_use = "call shutdown before exit, or spans still buffered are lost"]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Exports what is still buffered (waits up to 5 s). Call it inside the
    /// runtime, before it ends: the exporter's connection lives on it.
    pub async fn shutdown(self) {
        if let Some(provider) = self.provider {
            let _ = tokio::task::spawn_blocking(move || provider.shutdown()).await;
        }
    }
}

/// Where spans go, from the standard variables; `None`: not exported.
pub fn otlp_endpoint_from_env() -> Option<String> {
    ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"]
        .into_iter()
        .filter_map(|name| std::env::var(name).ok())
        .find(|value| !value.trim().is_empty())
}

/// Installs the process-wide subscriber. Must run inside the Tokio runtime
/// (the OTLP exporter's connection is spawned on it).
pub fn init(format: LogFormat, service: &'static str) -> anyhow::Result<Telemetry> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let subscriber = tracing_subscriber::registry().with(log_layer(format, filter));
    // Not an `Option` layer: a `None` one says it wants every callsite, and
    // every request span would be built for nobody.
    let provider = match otlp_endpoint_from_env() {
        Some(endpoint) => {
            let (layer, provider) = otlp_layer(service, &endpoint, BatchConfigBuilder::default())?;
            subscriber.with(layer).try_init()?;
            Some(provider)
        }
        None => {
            subscriber.try_init()?;
            None
        }
    };
    if provider.is_some() {
        tracing::info!(service, "exporting traces over OTLP");
    }
    Ok(Telemetry { provider })
}

/// Logs: what `filter` lets through, except request spans (traces only).
fn log_layer<S>(format: LogFormat, filter: tracing_subscriber::EnvFilter) -> impl Layer<S>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    let logs = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let logs = match format {
        LogFormat::Text => logs.boxed(),
        LogFormat::Json => logs.json().boxed(),
    };
    let not_traces = tracing_subscriber::filter::filter_fn(|meta| !(meta.is_span() && meta.target() == SPAN_TARGET));
    logs.with_filter(filter.and(not_traces))
}

/// A layer exporting request spans to an OTLP/gRPC endpoint, and the
/// provider behind it (flush or shut it down before exit).
pub fn otlp_layer<S>(
    service: &'static str,
    endpoint: &str,
    batch: BatchConfigBuilder,
) -> anyhow::Result<(Box<dyn Layer<S> + Send + Sync>, SdkTracerProvider)>
where
    S: Subscriber + for<'a> LookupSpan<'a> + Send + Sync,
{
    let exporter = SpanExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint)
        .with_timeout(Duration::from_secs(5))
        .build()
        .map_err(|e| anyhow::anyhow!("cannot set up the OTLP exporter for {endpoint}: {e}"))?;
    let mut resource = Resource::builder();
    if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
        resource = resource.with_service_name(service);
    }
    let processor = BatchSpanProcessor::builder(exporter).with_batch_config(batch.build()).build();
    let provider = SdkTracerProvider::builder().with_span_processor(processor).with_resource(resource.build()).build();
    let layer = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer(service))
        .with_filter(tracing_subscriber::filter::filter_fn(|meta| {
            if meta.is_span() { meta.target() == SPAN_TARGET } else { *meta.level() <= tracing::Level::WARN }
        }))
        .boxed();
    Ok((layer, provider))
}

/// Continues the trace the request's `traceparent` names in `span`. Call
/// before the span is first entered.
pub fn continue_trace(span: &tracing::Span, headers: &http::HeaderMap) {
    // Most spans are not exported (no exporter, or filtered out): nothing
    // to read then, on every request's path.
    if span.is_disabled() {
        return;
    }
    let parent = TraceContextPropagator::new().extract(&HeaderExtractor(headers));
    // Fails only when traces are not exported or the span is filtered out:
    // then there is no trace to continue.
    let _ = span.set_parent(parent);
}

/// Writes `span`'s trace context into outgoing `headers`, replacing the
/// caller's. Without an exporter there is none, and a client's own
/// `traceparent` travels on untouched.
pub fn inject(span: &tracing::Span, headers: &mut http::HeaderMap) {
    if span.is_disabled() {
        return;
    }
    let context = span.context();
    TraceContextPropagator::new().inject_context(&context, &mut HeaderInjector(headers));
}

struct HeaderInjector<'a>(&'a mut http::HeaderMap);

impl Injector for HeaderInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(name), Ok(value)) =
            (http::HeaderName::from_bytes(key.as_bytes()), http::HeaderValue::from_str(&value))
        {
            self.0.insert(name, value);
        }
    }
}

struct HeaderExtractor<'a>(&'a http::HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_an_exporter_request_spans_are_not_even_built() {
        let subscriber =
            tracing_subscriber::registry().with(log_layer(LogFormat::Text, tracing_subscriber::EnvFilter::new("info")));
        tracing::subscriber::with_default(subscriber, || {
            assert!(tracing::info_span!(target: SPAN_TARGET, "request").is_disabled());
            assert!(!tracing::info_span!("snapshots").is_disabled());
        });
    }

    #[test]
    fn without_an_exporter_a_clients_traceparent_is_left_alone() {
        let mut headers = http::HeaderMap::new();
        let theirs = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        headers.insert("traceparent", http::HeaderValue::from_static(theirs));
        let span = tracing::info_span!(target: SPAN_TARGET, "request");
        continue_trace(&span, &headers);
        inject(&span, &mut headers);
        assert_eq!(headers["traceparent"], theirs);
    }
}
