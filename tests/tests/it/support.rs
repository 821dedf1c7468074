use inferyes_sim::{SimConfig, SimModel};
use inferyes_tests::{AgentHandle, ControllerHandle, DataplaneHandle, Etcd, HttpClient, SimHandle};
use serde_json::{Value, json};

/// etcd, one controller, one agent per simulator (node ids `node-a`,
/// `node-b`, ...), and a data plane that sees them all.
pub struct Fleet {
    pub etcd: Etcd,
    /// `None` while a test has it stopped.
    pub controller: Option<ControllerHandle>,
    pub sims: Vec<SimHandle>,
    pub agents: Vec<AgentHandle>,
    pub dataplane: DataplaneHandle,
    pub http: HttpClient,
}

pub fn node_id(i: usize) -> String {
    format!("node-{}", (b'a' + u8::try_from(i).expect("few nodes")) as char)
}

/// A fast simulated llama-server with one chat model.
pub fn chat_sim(model: &str) -> SimConfig {
    SimConfig { prefill_tokens_per_second: 1e6, decode_tokens_per_second: 1e5, ..SimConfig::llama_server(model) }
}

/// A simulated llama-server serving `chat` at five tokens a second: a
/// stream of [`long_story`] stays open for as long as a test needs.
pub fn slow_sim() -> SimConfig {
    SimConfig { decode_tokens_per_second: 5.0, ..chat_sim("chat") }
}

/// A streamed chat request for `chat` of 200 tokens at most.
pub fn long_story() -> bytes::Bytes {
    let body = json!({"model": "chat", "stream": true, "max_tokens": 200,
                      "messages": [{"role": "user", "content": "tell me a long story"}]});
    bytes::Bytes::from(body.to_string())
}

/// The state of `model`'s first placement in the data plane's snapshot.
pub fn state_of(fleet: &Fleet, model: &str) -> Option<inferyes_proto::v1::ModelState> {
    let snapshot = fleet.dataplane.store.current()?;
    snapshot.placements(model)?.first().map(|p| p.state)
}

impl Fleet {
    pub async fn start(sims: Vec<SimConfig>) -> Fleet {
        Self::start_with(sims, |_| {}).await
    }

    pub async fn start_with(sims: Vec<SimConfig>, tweak: impl FnOnce(&mut inferyes_dataplane::Config)) -> Fleet {
        let etcd = Etcd::start().await;
        let controller = ControllerHandle::start(&etcd.endpoint(), "controller-1").await;
        let mut handles = Vec::new();
        for config in sims {
            handles.push(SimHandle::start(config).await);
        }
        let mut agents = Vec::new();
        for (i, sim) in handles.iter().enumerate() {
            agents.push(AgentHandle::start(&node_id(i), &[controller.url()], &[("main", sim)]).await);
        }
        let dataplane = DataplaneHandle::start_with(&[controller.url()], tweak).await;
        let ids: Vec<String> = (0..handles.len()).map(node_id).collect();
        let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
        dataplane.wait_for_nodes(&ids).await;
        Fleet { etcd, controller: Some(controller), sims: handles, agents, dataplane, http: HttpClient::default() }
    }

    pub fn controller(&self) -> &ControllerHandle {
        self.controller.as_ref().expect("the controller is running")
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.dataplane.url)
    }
}

pub fn chat_body(model: &str, text: &str) -> Value {
    json!({
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 8,
    })
}

pub fn embedding_model(id: &str) -> SimConfig {
    SimConfig { models: vec![SimModel::embedding(id)], ..chat_sim(id) }
}

/// Creates an API key and waits until the fleet's data plane knows it and,
/// where the key has limits, holds its part of them: `(key_id, secret)`.
pub async fn create_key(fleet: &Fleet, request: inferyes_proto::v1::CreateKeyRequest) -> (String, String) {
    let limited = request.requests_per_minute > 0 || request.max_concurrent > 0 || request.tokens_per_day > 0;
    let created = fleet.controller().fleet().await.create_key(request).await.expect("key created").into_inner();
    let key_id = created.key.expect("the created key").key_id;
    let id = key_id.clone();
    fleet.dataplane.wait_for("the key", std::time::Duration::from_secs(10), move |s| s.api_key(&id).is_some()).await;
    if limited {
        // A controller gives parts of the keys' limits once every data
        // plane has had time to tell it what it holds.
        let metrics = format!("{}/metrics", fleet.dataplane.admin_url);
        inferyes_tests::eventually(
            "the data plane's parts of the keys' limits",
            std::time::Duration::from_secs(15),
            || async {
                scraped(&fleet.http, &metrics, "inferyes_dataplane_allowance_dataplanes", "").await >= 1.0
                    && scraped(&fleet.http, &metrics, "inferyes_dataplane_allowance_settling", "").await == 0.0
            },
        )
        .await;
    }
    (key_id, created.secret)
}

/// The sum of the series of metric `name` whose labels contain `labels`,
/// scraped from `url`.
pub async fn scraped(http: &HttpClient, url: &str, name: &str, labels: &str) -> f64 {
    String::from_utf8_lossy(&http.get(url).await.body)
        .lines()
        .filter(|line| line.split(['{', ' ']).next() == Some(name) && line.contains(labels))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
