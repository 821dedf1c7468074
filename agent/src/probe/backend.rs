use inferyes_proto::v1::{Backend, BackendKind, EndpointKind, Health, Model, ModelState};
use serde_json::Value;

use super::client::ProbeClient;
use super::throughput::Counters;
use crate::config;

/// Everything needed to poll one backend.
#[derive(Clone, Debug)]
pub struct BackendProbe {
    pub id: String,
    pub url: String,
    pub kind: config::BackendKind,
    pub weight: u32,
    pub endpoints: Vec<EndpointKind>,
    pub api_key: String,
    /// Models the operator declared, reported while the backend's own
    /// catalog cannot be read (a llama-server still loading answers 503
    /// everywhere).
    pub declared_models: Vec<String>,
    /// Tokens the backend's host prompt cache holds (llama-server
    /// `--cache-ram`), for the residency estimate.
    pub host_cache_tokens: u64,
    /// Model sizes the operator declared, for models the backend reports
    /// none for.
    pub model_sizes: std::collections::BTreeMap<String, u64>,
    /// Models it holds loaded at once, where it does not say (0: no limit).
    pub models_max: u32,
    /// Where its slots are saved, when they may be moved.
    pub slots: Option<crate::config::SlotsConfig>,
    pub slot_memo: std::sync::Arc<super::fingerprint::Memo>,
}

impl BackendProbe {
    /// One poll. Failures are part of the result (health and
    /// `probe_error`), never an error: a backend that cannot be read is a
    /// fact to report.
    ///
    /// `previous` is this backend's last observation: while the catalog
    /// cannot be read, the models last seen (else the declared ones) are
    /// still reported, as loading or of unknown state, so the fleet knows the
    /// model exists and says "not now" rather than "no such model".
    pub async fn probe(&self, client: &ProbeClient, previous: Option<&Backend>) -> Probed {
        let mut backend = Backend {
            id: self.id.clone(),
            kind: match self.kind {
                config::BackendKind::LlamaServer => BackendKind::LlamaServer,
                config::BackendKind::LlamaServerRouter => BackendKind::LlamaServerRouter,
                config::BackendKind::LlamaSwap => BackendKind::LlamaSwap,
                config::BackendKind::Openai => BackendKind::Openai,
            } as i32,
            weight: self.weight,
            ..Default::default()
        };
        let mut load = LoadReading::default();
        let result = match self.kind {
            config::BackendKind::LlamaServer | config::BackendKind::LlamaServerRouter => {
                self.probe_llama_server(client, &mut backend, &mut load, previous).await
            }
            config::BackendKind::LlamaSwap => self.probe_llama_swap(client, &mut backend).await,
            config::BackendKind::Openai => self.probe_openai(client, &mut backend).await,
        };
        // What the backend says of its limit, else what was configured.
        if backend.models_max == 0 {
            backend.models_max = self.models_max;
        }
        // A llama-server that answers its health but not the rest has counts
        // no more known than one whose /slots timed out.
        if result.is_err() && matches!(backend.kind(), BackendKind::LlamaServer | BackendKind::LlamaServerRouter) {
            (load.slots_unread, load.metrics_unread) = (true, true);
        }
        // Taken for idle, a server too busy to answer would draw more work:
        // what could not be read is the last reading, marked unknown.
        if let Some(previous) = previous {
            if load.slots_unread {
                backend.slots_total = backend.slots_total.max(previous.slots_total);
                backend.slots_busy = previous.slots_busy;
            }
            if load.metrics_unread {
                backend.requests_deferred = previous.requests_deferred;
                backend.tokens_per_second = previous.tokens_per_second;
            }
        }
        backend.load_unknown = load.slots_unread || load.metrics_unread;
        let unread = result.is_err() || backend.health() == Health::Loading;
        if let Err(error) = result {
            backend.probe_error = error;
            if backend.health() == Health::Unknown {
                backend.set_health(Health::Down);
            }
        }
        // The catalog could not be read (the server is loading, or its model
        // list failed): report what was last seen, as loading or as
        // possibly warm, never as gone.
        if backend.models.is_empty() && unread {
            let state = if backend.health() == Health::Loading { ModelState::Loading } else { ModelState::Unknown };
            backend.models = remembered_models(previous, &self.declared_models, state);
        }

        if backend.slot_fingerprint.is_empty() && backend.slots_unmovable.is_empty() {
            backend.slots_unmovable = match backend.kind() {
                _ if backend.health() != Health::Ready => "not ready".to_string(),
                BackendKind::LlamaServer => "no slots dir configured (backends.slots)".to_string(),
                BackendKind::LlamaServerRouter => "a router's slots are not moved".to_string(),
                BackendKind::LlamaSwap => "llama-swap's slots are not moved".to_string(),
                BackendKind::Openai | BackendKind::Unspecified => {
                    "an OpenAI-compatible server has no slots".to_string()
                }
            };
        }
        for model in &mut backend.models {
            if model.endpoints.is_empty() {
                model.endpoints = self.endpoints.iter().map(|e| *e as i32).collect();
            }
            if model.size_bytes == 0
                && let Some(size) = self.model_sizes.get(&model.id)
            {
                model.size_bytes = *size;
            }
        }
        Probed { backend, counters: load.counters }
    }

    async fn probe_llama_server(
        &self,
        client: &ProbeClient,
        backend: &mut Backend,
        load: &mut LoadReading,
        previous: Option<&Backend>,
    ) -> Result<(), String> {
        let (status, body) =
            client.get(&self.url, "/health", &self.api_key).await.map_err(|e| format!("health: {e}"))?;
        match status.as_u16() {
            200 => backend.set_health(Health::Ready),
            503 => {
                backend.set_health(Health::Loading);
                return Ok(());
            }
            code => {
                backend.set_health(Health::Down);
                return Err(format!("health: HTTP {code}: {}", String::from_utf8_lossy(&body)));
            }
        }
        // Optional endpoints: llama-server answers 501 without --slots or
        // --metrics, and that is not a fault.
        let props = match client.get(&self.url, "/props", &self.api_key).await {
            Ok((status, body)) if status.is_success() => serde_json::from_slice::<Value>(&body).ok(),
            _ => None,
        };
        let router = props.as_ref().and_then(|p| p.get("role")).and_then(Value::as_str) == Some("router");
        if router || self.kind == config::BackendKind::LlamaServerRouter {
            backend.set_kind(BackendKind::LlamaServerRouter);
            backend.models_max = props.as_ref().map_or(0, |p| u32_at(p, "/max_instances"));
            return self.probe_router(client, backend, load, previous).await;
        }
        let (_, body) = client.get(&self.url, "/v1/models", &self.api_key).await.map_err(|e| format!("models: {e}"))?;
        backend.models = parse_openai_models(&body, ModelState::Loaded);
        if let Some(props) = &props {
            let n_ctx = props.pointer("/default_generation_settings/n_ctx").and_then(Value::as_u64).unwrap_or(0);
            for model in &mut backend.models {
                model.context_window = u32::try_from(n_ctx).unwrap_or(u32::MAX);
            }
            backend.slots_total = u32_at(props, "/total_slots");
        }
        if let Some(slots) = &self.slots {
            let movable = super::fingerprint::movability(
                client,
                &self.url,
                &self.api_key,
                slots,
                props.as_ref(),
                &self.slot_memo,
            )
            .await;
            match movable {
                Ok(fingerprint) => backend.slot_fingerprint = fingerprint,
                Err(why) => backend.slots_unmovable = why,
            }
        }
        if self.fills_in_the_middle(client, None).await == Some(false) {
            for model in &mut backend.models {
                model.unsupported.push(EndpointKind::Infill as i32);
            }
        }
        match client.get(&self.url, "/slots", &self.api_key).await {
            Ok((status, body)) if status.is_success() => match parse_slots(&body) {
                Some(slots) => {
                    backend.slots_total = slots.total;
                    backend.slots_busy = slots.busy;
                }
                None => load.slots_unread = true,
            },
            Ok((status, _)) if not_offered(status) => {}
            _ => load.slots_unread = true,
        }
        match client.get(&self.url, "/metrics", &self.api_key).await {
            Ok((status, body)) if status.is_success() => {
                let metrics = parse_llamacpp_metrics(&String::from_utf8_lossy(&body));
                backend.requests_deferred = metrics.requests_deferred;
                backend.tokens_per_second = metrics.decode_tokens_per_second();
                load.counters = Some(metrics.counters());
            }
            Ok((status, _)) if not_offered(status) => {}
            _ => load.metrics_unread = true,
        }
        Ok(())
    }

    /// A llama-server in router mode: every model it can load, each in the
    /// state its `status.value` says; the loaded ones' windows, slots and
    /// whether they fill in the middle asked of each one, never loading
    /// one that is not (`autoload=false`): what a model could not do is
    /// kept from `previous` while it is unloaded. Its counters are each
    /// child's, not read: the slot time comes from the proxy's own count.
    async fn probe_router(
        &self,
        client: &ProbeClient,
        backend: &mut Backend,
        load: &mut LoadReading,
        previous: Option<&Backend>,
    ) -> Result<(), String> {
        let (status, body) =
            client.get(&self.url, "/v1/models", &self.api_key).await.map_err(|e| format!("models: {e}"))?;
        if !status.is_success() {
            return Err(format!("models: HTTP {}", status.as_u16()));
        }
        let (mut models, paths) = parse_router_models(&body);
        for (model, path) in models.iter_mut().zip(paths) {
            let before = previous.and_then(|p| p.models.iter().find(|m| m.id == model.id));
            // What the operator declared; else what was found before; else
            // the weights' file, where it is on this host: what a load
            // takes of the GPU, roughly.
            model.size_bytes = match (self.model_sizes.get(&model.id), before) {
                (Some(size), _) => *size,
                // Found before, or not to be found: the file is asked once.
                (None, Some(before)) => before.size_bytes,
                (None, _) => match path.filter(|p| p.is_absolute()) {
                    Some(path) => weights_size(path).await,
                    None => 0,
                },
            };
        }
        for model in models.iter_mut().filter(|m| m.state() != ModelState::Loaded) {
            let before = previous.and_then(|p| p.models.iter().find(|m| m.id == model.id));
            model.unsupported = before.map(|m| m.unsupported.clone()).unwrap_or_default();
        }
        let (mut slots_total, mut slots_busy) = (0u32, 0u32);
        for model in models.iter_mut().filter(|m| m.state() == ModelState::Loaded) {
            let query = format!("?model={}&autoload=false", percent_encoded(&model.id));
            if let Ok((status, body)) = client.get(&self.url, &format!("/props{query}"), &self.api_key).await
                && status.is_success()
                && let Ok(props) = serde_json::from_slice::<Value>(&body)
            {
                let n_ctx = u32_at(&props, "/default_generation_settings/n_ctx");
                if n_ctx > 0 {
                    model.context_window = n_ctx;
                }
            }
            match client.get(&self.url, &format!("/slots{query}"), &self.api_key).await {
                Ok((status, body)) if status.is_success() => match parse_slots(&body) {
                    Some(slots) => {
                        slots_total = slots_total.saturating_add(slots.total);
                        slots_busy = slots_busy.saturating_add(slots.busy);
                    }
                    None => load.slots_unread = true,
                },
                Ok((status, _)) if not_offered(status) => {}
                _ => load.slots_unread = true,
            }
            if self.fills_in_the_middle(client, Some(&model.id)).await == Some(false) {
                model.unsupported.push(EndpointKind::Infill as i32);
            }
        }
        backend.slots_total = slots_total;
        backend.slots_busy = slots_busy;
        backend.models = models;
        Ok(())
    }

    /// Whether the model fills in the middle: llama-server checks for its
    /// tokens before it reads an `/infill` request, so an empty one is
    /// answered 501 without them and 400 with them, and costs no compute.
    /// `None`: not known (not answered, or the model is not loaded).
    async fn fills_in_the_middle(&self, client: &ProbeClient, model: Option<&str>) -> Option<bool> {
        let (path, body) = match model {
            Some(model) => ("/infill?autoload=false", serde_json::json!({ "model": model })),
            None => ("/infill", serde_json::json!({})),
        };
        let (status, answer) = client.post_json(&self.url, path, &self.api_key, &body).await.ok()?;
        match status.as_u16() {
            501 => Some(false),
            400 if !String::from_utf8_lossy(&answer).contains("not loaded") => Some(true),
            _ => None,
        }
    }

    async fn probe_llama_swap(&self, client: &ProbeClient, backend: &mut Backend) -> Result<(), String> {
        let (status, _) = client.get(&self.url, "/health", &self.api_key).await.map_err(|e| format!("health: {e}"))?;
        if !status.is_success() {
            backend.set_health(Health::Down);
            return Err(format!("health: HTTP {}", status.as_u16()));
        }
        backend.set_health(Health::Ready);
        let (status, body) =
            client.get(&self.url, "/v1/models", &self.api_key).await.map_err(|e| format!("models: {e}"))?;
        if !status.is_success() {
            // Catalog unreadable: nothing listed; the node is "possibly warm"
            // for nothing, which routing treats as not serving.
            return Err(format!("models: HTTP {}", status.as_u16()));
        }
        let (mut models, has_status) = parse_llamaswap_models(&body);
        // Older llama-swap: /v1/models has no status; /running does. Newer:
        // `loaded` there means any process not stopped, one still starting
        // included, which /running tells apart.
        let loaded = models.iter().any(|m| m.state() == ModelState::Loaded);
        if !has_status || loaded {
            match client.get(&self.url, "/running", &self.api_key).await {
                Ok((status, body)) if status.is_success() => {
                    let running = parse_running(&body);
                    for model in &mut models {
                        let state = match running.iter().find(|(id, _)| *id == model.id).map(|(_, s)| s.as_str()) {
                            Some("starting") => ModelState::Loading,
                            Some("stopping") | None => ModelState::Unloaded,
                            Some(_) => ModelState::Loaded,
                        };
                        model.set_state(state);
                    }
                }
                _ => {}
            }
        }
        backend.models = models;
        Ok(())
    }

    async fn probe_openai(&self, client: &ProbeClient, backend: &mut Backend) -> Result<(), String> {
        let (status, body) =
            client.get(&self.url, "/v1/models", &self.api_key).await.map_err(|e| format!("models: {e}"))?;
        if !status.is_success() {
            backend.set_health(Health::Down);
            return Err(format!("models: HTTP {}", status.as_u16()));
        }
        backend.set_health(Health::Ready);
        // An upstream provider holds its models ready; nothing loads.
        backend.models = parse_openai_models(&body, ModelState::Loaded);
        Ok(())
    }
}

fn remembered_models(previous: Option<&Backend>, declared: &[String], state: ModelState) -> Vec<Model> {
    let mut models: Vec<Model> = match previous.filter(|p| !p.models.is_empty()) {
        Some(previous) => previous.models.clone(),
        None => declared.iter().map(|id| Model { id: id.clone(), ..Default::default() }).collect(),
    };
    for model in &mut models {
        model.set_state(state);
    }
    models
}

fn u32_at(value: &Value, pointer: &str) -> u32 {
    value.pointer(pointer).and_then(Value::as_u64).map(|v| u32::try_from(v).unwrap_or(u32::MAX)).unwrap_or(0)
}

/// An OpenAI-style `/v1/models` list. llama-server adds `meta` with the
/// weights' size and training context.
pub fn parse_openai_models(body: &[u8], state: ModelState) -> Vec<Model> {
    let Ok(value) = serde_json::from_slice::<Value>(body) else { return Vec::new() };
    let Some(data) = value.get("data").and_then(Value::as_array) else { return Vec::new() };
    let mut models: Vec<Model> = data
        .iter()
        .filter_map(|m| {
            let id = m.get("id")?.as_str()?.to_string();
            let mut model = Model {
                id,
                size_bytes: m.pointer("/meta/size").and_then(Value::as_u64).unwrap_or(0),
                context_window: u32_at(m, "/meta/n_ctx_train"),
                ..Default::default()
            };
            model.set_state(state);
            Some(model)
        })
        .collect();
    models.sort_by(|a, b| a.id.cmp(&b.id));
    models.dedup_by(|a, b| a.id == b.id);
    models
}

/// llama-swap's `/v1/models`: every configured model, with `status.value`
/// (`loaded`, `unloaded`, `loading`, ...) on builds since mid-2026. Returns
/// whether any status was present.
pub fn parse_llamaswap_models(body: &[u8]) -> (Vec<Model>, bool) {
    let Ok(value) = serde_json::from_slice::<Value>(body) else { return (Vec::new(), false) };
    let Some(data) = value.get("data").and_then(Value::as_array) else { return (Vec::new(), false) };
    let mut has_status = false;
    let mut models: Vec<Model> = data
        .iter()
        .filter_map(|m| {
            let id = m.get("id")?.as_str()?.to_string();
            let status = m.pointer("/status/value").and_then(Value::as_str);
            has_status |= status.is_some();
            let state = match status {
                Some("loaded" | "ready") => ModelState::Loaded,
                Some("loading" | "starting") => ModelState::Loading,
                Some(_) => ModelState::Unloaded,
                None => ModelState::Unknown,
            };
            let mut model = Model { id, ..Default::default() };
            model.set_state(state);
            Some(model)
        })
        .collect();
    models.sort_by(|a, b| a.id.cmp(&b.id));
    models.dedup_by(|a, b| a.id == b.id);
    (models, has_status)
}

/// llama-server's router-mode `/v1/models`: every model it can load, in
/// the state `status.value` says (`loaded`, `loading`, `unloaded`; any
/// other, a failed load say, as unloaded), its window from the arguments
/// it is started with (`--ctx-size`), and the path of its weights
/// (`--model`), side by side.
pub fn parse_router_models(body: &[u8]) -> (Vec<Model>, Vec<Option<std::path::PathBuf>>) {
    let Ok(value) = serde_json::from_slice::<Value>(body) else { return (Vec::new(), Vec::new()) };
    let Some(data) = value.get("data").and_then(Value::as_array) else { return (Vec::new(), Vec::new()) };
    let mut models: Vec<(Model, Option<std::path::PathBuf>)> = data
        .iter()
        .filter_map(|m| {
            let id = m.get("id")?.as_str()?.to_string();
            let state = match m.pointer("/status/value").and_then(Value::as_str) {
                Some("loaded") => ModelState::Loaded,
                Some("loading") => ModelState::Loading,
                _ => ModelState::Unloaded,
            };
            let args: Vec<&str> = m
                .pointer("/status/args")
                .and_then(Value::as_array)
                .map(|args| args.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            let after = |names: &[&str]| args.windows(2).find(|pair| names.contains(&pair[0])).map(|pair| pair[1]);
            let context_window = after(&["--ctx-size", "-c"]).and_then(|n| n.parse::<u32>().ok()).unwrap_or(0);
            let path = after(&["--model", "-m"]).map(std::path::PathBuf::from);
            let mut model = Model { id, context_window, ..Default::default() };
            model.set_state(state);
            Some((model, path))
        })
        .collect();
    models.sort_by(|a, b| a.0.id.cmp(&b.0.id));
    models.dedup_by(|a, b| a.0.id == b.0.id);
    models.into_iter().unzip()
}

/// The size of a model's weights file, 0 where it is not a file here or
/// does not answer within a second (a path a backend names may be on a
/// network mount that hangs; the poll does not).
async fn weights_size(path: std::path::PathBuf) -> u64 {
    let stat = tokio::task::spawn_blocking(move || std::fs::metadata(path));
    match tokio::time::timeout(std::time::Duration::from_secs(1), stat).await {
        Ok(Ok(Ok(metadata))) if metadata.is_file() => metadata.len(),
        _ => 0,
    }
}

/// A query value with every byte but the unreserved ones escaped.
fn percent_encoded(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// llama-swap's `/running`: each process's model and its state
/// (`starting`, `ready`, `stopping`; none in builds before states).
fn parse_running(body: &[u8]) -> Vec<(String, String)> {
    let Ok(value) = serde_json::from_slice::<Value>(body) else { return Vec::new() };
    let entry = |r: &Value| {
        let model = r.get("model").and_then(Value::as_str)?.to_string();
        let state = r.get("state").and_then(Value::as_str).unwrap_or("ready").to_string();
        Some((model, state))
    };
    value.get("running").and_then(Value::as_array).map(|all| all.iter().filter_map(entry).collect()).unwrap_or_default()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slots {
    pub total: u32,
    pub busy: u32,
}

/// llama-server's `/slots`: one object per slot. Only `is_processing` is
/// read: other fields changed shape across builds (`next_token` is an array
/// now, an object before).
pub fn parse_slots(body: &[u8]) -> Option<Slots> {
    let Value::Array(slots) = serde_json::from_slice::<Value>(body).ok()? else { return None };
    let busy = slots.iter().filter(|s| s.get("is_processing").and_then(Value::as_bool) == Some(true)).count();
    Some(Slots { total: u32::try_from(slots.len()).unwrap_or(u32::MAX), busy: u32::try_from(busy).unwrap_or(u32::MAX) })
}

/// One poll of a backend: what is reported, and the counters the poller
/// measures rates from (llama-server with `--metrics` only).
#[derive(Clone, Debug)]
pub struct Probed {
    pub backend: Backend,
    pub counters: Option<Counters>,
}

/// What the slot and queue endpoints gave this poll.
#[derive(Default)]
struct LoadReading {
    /// Each was offered but could not be read: timed out, refused, or an
    /// answer that is not theirs.
    slots_unread: bool,
    metrics_unread: bool,
    counters: Option<Counters>,
}

/// llama-server answers 501 for `/slots` and `/metrics` it was not started
/// with (`--no-slots`, no `--metrics`); older builds 404.
fn not_offered(status: http::StatusCode) -> bool {
    matches!(status.as_u16(), 404 | 501)
}

/// The llama-server gauges and counters the agent reads.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LlamaCppMetrics {
    pub requests_processing: u32,
    pub requests_deferred: u32,
    /// Throughput since the previous scrape: llama-server resets it on each
    /// read, so it reads 0 whenever nothing was generated in between.
    pub predicted_tokens_seconds: f64,
    pub tokens_predicted_total: f64,
    pub tokens_predicted_seconds_total: f64,
    pub prompt_tokens_total: f64,
    pub prompt_seconds_total: f64,
}

impl LlamaCppMetrics {
    /// The counters rates are measured from; `finished` is the proxy's, and
    /// the poller fills it in.
    pub fn counters(&self) -> Counters {
        Counters {
            prompt_tokens: self.prompt_tokens_total,
            prompt_seconds: self.prompt_seconds_total,
            predicted_seconds: self.tokens_predicted_seconds_total,
            finished: 0,
        }
    }

    /// Decode speed: tokens generated per second of generation since the
    /// server started, which stays put between bursts; the per-scrape gauge
    /// when the counters are missing.
    pub fn decode_tokens_per_second(&self) -> f64 {
        if self.tokens_predicted_seconds_total > 0.0 {
            self.tokens_predicted_total / self.tokens_predicted_seconds_total
        } else {
            self.predicted_tokens_seconds
        }
    }
}

/// Parses llama-server's Prometheus text (`llamacpp:*` series).
pub fn parse_llamacpp_metrics(text: &str) -> LlamaCppMetrics {
    let mut metrics = LlamaCppMetrics::default();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let mut parts = line.split_whitespace();
        let (Some(name), Some(value)) = (parts.next(), parts.next()) else { continue };
        let Ok(value) = value.parse::<f64>() else { continue };
        // Names may carry labels in future builds: match the bare name.
        let name = name.split('{').next().unwrap_or(name);
        // A hostile or broken server's NaN, infinity or negative reads as 0.
        let value = if value.is_finite() && value >= 0.0 { value } else { 0.0 };
        let whole = value.min(f64::from(u32::MAX)) as u32;
        match name {
            "llamacpp:requests_processing" => metrics.requests_processing = whole,
            "llamacpp:requests_deferred" => metrics.requests_deferred = whole,
            "llamacpp:predicted_tokens_seconds" => metrics.predicted_tokens_seconds = value,
            "llamacpp:tokens_predicted_total" => metrics.tokens_predicted_total = value,
            "llamacpp:tokens_predicted_seconds_total" => metrics.tokens_predicted_seconds_total = value,
            "llamacpp:prompt_tokens_total" => metrics.prompt_tokens_total = value,
            "llamacpp:prompt_seconds_total" => metrics.prompt_seconds_total = value,
            _ => {}
        }
    }
    metrics
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_router_s_models_are_in_the_state_it_says_with_their_window_and_weights() {
        // As llama-server b11434 in router mode answers, one loaded.
        let body = br#"{"data":[
            {"id":"tiny-chat","object":"model","status":{"value":"loaded","args":["llama-server","--port","0","--ctx-size","2048","--model","/models/tiny-chat.gguf"]}},
            {"id":"tiny-code","object":"model","status":{"value":"unloaded","args":["llama-server","-c","8192","-m","dir/tiny-code.gguf"]}},
            {"id":"big","object":"model","status":{"value":"loading"}},
            {"id":"broken","object":"model","status":{"value":"failed","args":["--ctx-size"]}}
        ],"object":"list"}"#;
        let (models, paths) = parse_router_models(body);
        let seen: Vec<(&str, ModelState, u32)> =
            models.iter().map(|m| (m.id.as_str(), m.state(), m.context_window)).collect();
        assert_eq!(
            seen,
            [
                ("big", ModelState::Loading, 0),
                ("broken", ModelState::Unloaded, 0),
                ("tiny-chat", ModelState::Loaded, 2048),
                ("tiny-code", ModelState::Unloaded, 8192),
            ]
        );
        let paths: Vec<Option<&str>> = paths.iter().map(|p| p.as_ref().and_then(|p| p.to_str())).collect();
        assert_eq!(paths, [None, None, Some("/models/tiny-chat.gguf"), Some("dir/tiny-code.gguf")]);
        assert_eq!(parse_router_models(b"not json"), (Vec::new(), Vec::new()));
    }

    #[test]
    fn model_names_in_a_query_are_escaped() {
        assert_eq!(percent_encoded("qwen2.5-7b_Q4~x"), "qwen2.5-7b_Q4~x");
        assert_eq!(percent_encoded("a b&c=d/é"), "a%20b%26c%3Dd%2F%C3%A9");
    }

    #[test]
    fn llama_server_models_carry_size_and_context() {
        let body = br#"{"models":[{"name":"m"}],"object":"list","data":[{"id":"qwen","object":"model","owned_by":"llamacpp","meta":{"n_ctx_train":32768,"size":123456}}]}"#;
        let models = parse_openai_models(body, ModelState::Loaded);
        assert_eq!(models.len(), 1);
        assert_eq!(models[0].id, "qwen");
        assert_eq!(models[0].size_bytes, 123456);
        assert_eq!(models[0].context_window, 32768);
        assert_eq!(models[0].state(), ModelState::Loaded);
    }

    #[test]
    fn llama_swap_status_is_read_and_its_absence_noticed() {
        let modern = br#"{"object":"list","data":[{"id":"b","status":{"value":"unloaded"}},{"id":"a","status":{"value":"loaded"}},{"id":"c","status":{"value":"loading"}}]}"#;
        let (models, has_status) = parse_llamaswap_models(modern);
        assert!(has_status);
        let states: Vec<_> = models.iter().map(|m| (m.id.as_str(), m.state())).collect();
        assert_eq!(states, [("a", ModelState::Loaded), ("b", ModelState::Unloaded), ("c", ModelState::Loading)]);
        let old = br#"{"object":"list","data":[{"id":"a","object":"model"}]}"#;
        let (models, has_status) = parse_llamaswap_models(old);
        assert!(!has_status);
        assert_eq!(models[0].state(), ModelState::Unknown);
        let running = parse_running(
            br#"{"running":[{"model":"a","state":"ready"},{"model":"c","state":"starting"},{"model":"d"}]}"#,
        );
        let running: Vec<(&str, &str)> = running.iter().map(|(m, s)| (m.as_str(), s.as_str())).collect();
        assert_eq!(running, [("a", "ready"), ("c", "starting"), ("d", "ready")]);
    }

    #[test]
    fn an_unreadable_catalog_keeps_the_models_last_seen_else_the_declared_ones() {
        let previous = Backend {
            models: parse_openai_models(br#"{"data":[{"id":"seen"}]}"#, ModelState::Loaded),
            ..Default::default()
        };
        let declared = vec!["declared".to_string()];
        let models = remembered_models(Some(&previous), &declared, ModelState::Loading);
        assert_eq!(
            models.iter().map(|m| (m.id.as_str(), m.state())).collect::<Vec<_>>(),
            [("seen", ModelState::Loading)]
        );
        let models = remembered_models(None, &declared, ModelState::Unknown);
        assert_eq!(
            models.iter().map(|m| (m.id.as_str(), m.state())).collect::<Vec<_>>(),
            [("declared", ModelState::Unknown)]
        );
        assert!(remembered_models(None, &[], ModelState::Unknown).is_empty());
    }

    /// A llama-swap backend at `url`, with `model_sizes` declared.
    fn swap_probe(url: String, model_sizes: std::collections::BTreeMap<String, u64>) -> BackendProbe {
        BackendProbe {
            id: "swap".into(),
            url,
            kind: config::BackendKind::LlamaSwap,
            weight: 1,
            endpoints: Vec::new(),
            api_key: String::new(),
            declared_models: Vec::new(),
            host_cache_tokens: 0,
            model_sizes,
            models_max: 1,
            slots: None,
            slot_memo: Default::default(),
        }
    }

    /// A llama-server whose `/slots` and `/metrics` answer these (both one
    /// busy slot of one, two requests deferred, where they answer).
    async fn server_with_load_endpoints(slots: http::StatusCode, metrics: http::StatusCode) -> BackendProbe {
        use axum::routing::get;
        let app = axum::Router::new()
            .route("/health", get(|| async { "OK" }))
            .route("/v1/models", get(|| async { r#"{"object":"list","data":[{"id":"m","object":"model"}]}"# }))
            .route("/slots", get(move || async move { (slots, r#"[{"id":0,"is_processing":true}]"#) }))
            .route("/metrics", get(move || async move { (metrics, "llamacpp:requests_deferred 2\n") }));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        BackendProbe {
            id: "server".into(),
            kind: config::BackendKind::LlamaServer,
            ..swap_probe(url, Default::default())
        }
    }

    #[tokio::test]
    async fn load_that_cannot_be_read_is_the_last_read_marked_unknown_not_idle() {
        let client = ProbeClient::new(std::time::Duration::from_secs(2));
        let previous = Backend { slots_total: 4, slots_busy: 4, requests_deferred: 3, ..Default::default() };
        let (ok, failed) = (http::StatusCode::OK, http::StatusCode::INTERNAL_SERVER_ERROR);
        let failing = server_with_load_endpoints(failed, failed).await;
        let backend = failing.probe(&client, Some(&previous)).await.backend;
        assert_eq!(backend.health(), Health::Ready);
        assert!(backend.load_unknown);
        assert_eq!((backend.slots_total, backend.slots_busy, backend.requests_deferred), (4, 4, 3));
        // What could be read is fresh, the rest the last reading.
        let slots_failing = server_with_load_endpoints(failed, ok).await;
        let backend = slots_failing.probe(&client, Some(&previous)).await.backend;
        assert!(backend.load_unknown);
        assert_eq!((backend.slots_total, backend.slots_busy, backend.requests_deferred), (4, 4, 2));
        let metrics_failing = server_with_load_endpoints(ok, failed).await;
        let backend = metrics_failing.probe(&client, Some(&previous)).await.backend;
        assert_eq!((backend.slots_total, backend.slots_busy, backend.requests_deferred), (1, 1, 3));

        // Not offered (started without --slots and --metrics): nothing is
        // unknown, there is just nothing to read.
        let absent =
            server_with_load_endpoints(http::StatusCode::NOT_IMPLEMENTED, http::StatusCode::NOT_IMPLEMENTED).await;
        let backend = absent.probe(&client, Some(&previous)).await.backend;
        assert!(!backend.load_unknown);
        assert_eq!((backend.slots_busy, backend.requests_deferred), (0, 0));
    }

    #[test]
    fn hostile_counters_read_as_zero() {
        let m = parse_llamacpp_metrics("llamacpp:prompt_tokens_total -5\nllamacpp:prompt_seconds_total inf\n");
        assert_eq!((m.prompt_tokens_total, m.prompt_seconds_total), (0.0, 0.0));
        let m = parse_llamacpp_metrics("llamacpp:prompt_tokens_total 900\nllamacpp:prompt_seconds_total 3\n");
        assert_eq!(m.counters(), Counters { prompt_tokens: 900.0, prompt_seconds: 3.0, ..Default::default() });
    }

    #[tokio::test]
    async fn a_catalog_that_cannot_be_read_leaves_the_models_possibly_warm() {
        use axum::routing::get;
        let app = axum::Router::new()
            .route("/health", get(|| async { "OK" }))
            .route("/v1/models", get(|| async { (http::StatusCode::INTERNAL_SERVER_ERROR, "boom") }));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        let probe = swap_probe(url, std::collections::BTreeMap::new());
        let client = ProbeClient::new(std::time::Duration::from_secs(2));
        let previous = Backend {
            models: parse_llamaswap_models(br#"{"data":[{"id":"alpha","status":{"value":"loaded"}}]}"#).0,
            ..Default::default()
        };
        let backend = probe.probe(&client, Some(&previous)).await.backend;
        assert_eq!(backend.health(), Health::Ready);
        assert!(backend.probe_error.contains("HTTP 500"), "{}", backend.probe_error);
        assert_eq!(
            backend.models.iter().map(|m| (m.id.as_str(), m.state())).collect::<Vec<_>>(),
            [("alpha", ModelState::Unknown)]
        );
    }

    #[tokio::test]
    async fn models_a_backend_gives_no_size_for_take_the_declared_one() {
        use axum::routing::get;
        let catalog = r#"{"object":"list","data":[{"id":"alpha","status":{"value":"loaded"}},{"id":"beta","status":{"value":"unloaded"}}]}"#;
        let app = axum::Router::new()
            .route("/health", get(|| async { "OK" }))
            .route("/v1/models", get(move || async move { catalog }));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        let probe = swap_probe(url, [("beta".to_string(), 7 << 30)].into());
        let backend = probe.probe(&ProbeClient::new(std::time::Duration::from_secs(2)), None).await.backend;
        let sizes: Vec<(&str, u64)> = backend.models.iter().map(|m| (m.id.as_str(), m.size_bytes)).collect();
        assert_eq!(sizes, [("alpha", 0), ("beta", 7 << 30)]);
        assert_eq!(backend.models_max, 1, "llama-swap says nothing of it: as configured");
    }

    #[tokio::test]
    async fn a_llama_swap_model_still_starting_is_loading_not_warm() {
        use axum::routing::get;
        // llama-swap says `loaded` for a process still starting; /running
        // says which.
        let catalog = r#"{"object":"list","data":[{"id":"a","status":{"value":"loaded"}},{"id":"b","status":{"value":"loaded"}},{"id":"c","status":{"value":"unloaded"}}]}"#;
        let running = r#"{"running":[{"model":"a","state":"ready"},{"model":"b","state":"starting"}]}"#;
        let app = axum::Router::new()
            .route("/health", get(|| async { "OK" }))
            .route("/v1/models", get(move || async move { catalog }))
            .route("/running", get(move || async move { running }));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        let backend = swap_probe(url, Default::default())
            .probe(&ProbeClient::new(std::time::Duration::from_secs(2)), None)
            .await
            .backend;
        let states: Vec<(&str, ModelState)> = backend.models.iter().map(|m| (m.id.as_str(), m.state())).collect();
        assert_eq!(states, [("a", ModelState::Loaded), ("b", ModelState::Loading), ("c", ModelState::Unloaded)]);
    }

    #[test]
    fn slots_of_old_and_new_builds_are_counted() {
        let new = br#"[{"id":0,"n_ctx":512,"is_processing":true,"next_token":[{"has_next_token":true,"n_remain":3}]},
                       {"id":1,"n_ctx":512,"is_processing":false,"next_token":[]}]"#;
        assert_eq!(parse_slots(new), Some(Slots { total: 2, busy: 1 }));
        let old = br#"[{"id":0,"n_ctx":512,"is_processing":false,"next_token":{"has_next_token":true,"n_remain":-1}}]"#;
        assert_eq!(parse_slots(old), Some(Slots { total: 1, busy: 0 }));
        assert_eq!(parse_slots(br#"{"error":{"code":501}}"#), None);
    }

    #[test]
    fn llamacpp_metrics_are_parsed_by_name() {
        let text = "# HELP llamacpp:requests_deferred Number of requests deferred.\n# TYPE llamacpp:requests_deferred gauge\nllamacpp:requests_deferred 3\nllamacpp:requests_processing 2\nllamacpp:predicted_tokens_seconds 41.5\nllamacpp:tokens_predicted_total 900\n";
        let metrics = parse_llamacpp_metrics(text);
        assert_eq!((metrics.requests_processing, metrics.requests_deferred), (2, 3));
        assert_eq!(metrics.decode_tokens_per_second(), 41.5, "the gauge, without the counters");
        let counters = parse_llamacpp_metrics(&format!("{text}llamacpp:tokens_predicted_seconds_total 20\n"));
        assert_eq!(counters.decode_tokens_per_second(), 45.0, "900 tokens in 20 s of generation");

        assert_eq!(parse_llamacpp_metrics("garbage\nllamacpp:requests_deferred NaN"), LlamaCppMetrics::default());
    }
}
