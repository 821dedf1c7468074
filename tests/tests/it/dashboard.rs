//! The controller's live dashboard: its JSON and event stream, the page
//! itself in a real headless Chromium against a running fleet, and who may
//! see any of it.

use std::time::Duration;

use http::StatusCode;
use inferyes_proto::v1::GetPolicyRequest;
use inferyes_sim::SimConfig;
use inferyes_tests::{ADMIN_TOKEN, Browser, VIEWER_TOKEN, eventually};
use serde_json::{Value, json};

use crate::support::{Fleet, chat_body, chat_sim};

fn dashboard_url(fleet: &Fleet, path: &str) -> String {
    format!("http://{}{path}", fleet.controller().http_addr)
}

const VIEWER: (&str, &str) = ("authorization", "Bearer test-viewer-token-0123456789");

pub async fn fleet_view(fleet: &Fleet) -> Value {
    let response = get(fleet, "/api/v1/fleet", &[VIEWER]).await;
    assert_eq!(response.status, StatusCode::OK);
    response.json()
}

async fn get(fleet: &Fleet, path: &str, headers: &[(&str, &str)]) -> inferyes_tests::TestResponse {
    fleet.http.send(http::Method::GET, &dashboard_url(fleet, path), bytes::Bytes::new(), headers).await
}

async fn chat_in_session(fleet: &Fleet, session: &str, text: &str) {
    let body = chat_body("chat", text).to_string();
    let response = fleet
        .http
        .send(http::Method::POST, &fleet.url("/v1/chat/completions"), body.into(), &[("x-session-id", session)])
        .await;
    assert_eq!(response.status, StatusCode::OK);
}

#[tokio::test]
async fn the_fleet_view_shows_gpus_sessions_decisions_and_short_models() {
    // 20 ms a token: a stream's first token comes well after its head.
    let slow = || SimConfig { decode_tokens_per_second: 50.0, ..chat_sim("chat") };
    let mut fleet = Fleet::start(vec![slow(), slow()]).await;
    chat_in_session(&fleet, "conversation-1", "hello").await;
    let mut streamed = chat_body("chat", "a stream");
    streamed["stream"] = json!(true);
    let response = fleet
        .http
        .send(
            http::Method::POST,
            &fleet.url("/v1/chat/completions"),
            streamed.to_string().into(),
            &[("x-session-id", "s2")],
        )
        .await;
    assert_eq!(response.status, StatusCode::OK);
    // Named by a client to read as another name where it is shown.
    let missing =
        fleet.http.post_json(&fleet.url("/v1/chat/completions"), &chat_body("no-such-\u{202e}ledom", "x")).await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
    let tag = inferyes_proto::session_tag("conversation-1");

    // The session reaches the controller through its agent's residency
    // report, the decisions through the data plane's activity report.
    eventually("the session and both decisions are on the dashboard", Duration::from_secs(10), || async {
        let view = fleet_view(&fleet).await;
        let session = view["sessions"]["shown"].as_array().unwrap().iter().any(|s| s["tag"] == tag.as_str());
        let decisions = view["decisions"].as_array().unwrap();
        session && decisions.len() >= 3
    })
    .await;
    let view = fleet_view(&fleet).await;
    assert_eq!(view["controller"], "controller-1");
    let gpus = view["gpus"].as_array().unwrap();
    assert_eq!(gpus.len(), 2, "{view}");
    for card in gpus {
        assert!(card["gpu"]["total_bytes"].as_u64().unwrap() > 0, "{card}");
        assert_eq!(card["admission"], 0.92);
        assert!(card["slots_total"].as_u64().unwrap() > 0, "{card}");
        assert_eq!(card["models"][0]["state"], "warm", "{card}");
        assert_eq!(card["pressure"], "ok", "{card}");
        // A simulated server's slots cannot move; nothing drained.
        assert_eq!(card["backends"][0]["slots_movable"], false, "{card}");
        assert_eq!(card["backends"][0]["slots_unmovable"], "no slots dir configured (backends.slots)", "{card}");
        assert_eq!(card["moves"], Value::Null, "{card}");
    }
    let session = view["sessions"]["shown"].as_array().unwrap().iter().find(|s| s["tag"] == tag.as_str()).unwrap();
    let decisions = view["decisions"].as_array().unwrap();
    let routed = decisions.iter().find(|d| d["session"] == tag.as_str()).expect("the chat's decision");
    assert_eq!(routed["status"], 200);
    assert_eq!(routed["node"], session["node"], "the decision names the node the session lives on");
    assert_eq!(routed["dataplane"], "test-dataplane");
    // Every node routing weighed, the one it chose first, with its cost.
    let weighed = routed["candidates"].as_array().unwrap();
    assert_eq!(weighed[0]["node"], routed["node"], "{routed}");
    assert!(weighed[0]["cost_ms"].is_u64() && weighed[0]["standing"] == "warm", "{routed}");
    let failed = decisions.iter().find(|d| d["status"] == 404).expect("the failure's decision");
    assert_eq!(failed["candidates"], json!([]), "nothing was weighed for a model not found");
    assert_eq!(failed["error"], "model_not_found");
    assert_eq!(failed["model"], "no-such-\u{fffd}ledom", "shown as it is, not as it reads");
    assert_eq!(failed["ttft_ms"], 0, "a failure has no first token");
    // A whole answer's first token comes with its end; a stream's with its
    // first token, reported once it ended.
    assert_eq!(routed["ttft_ms"], routed["latency_ms"]);
    let stream = decisions.iter().find(|d| d["stream"] == true).expect("the stream's decision");
    let (head, first_token) = (stream["latency_ms"].as_u64().unwrap(), stream["ttft_ms"].as_u64().unwrap());
    assert!(first_token >= head + 15, "the first token, not the head nor the role chunk: {stream}");
    let placed = view["ttft"]["routes"]["placed"].as_array().unwrap();
    assert_eq!(placed.iter().map(|p| p[3].as_u64().unwrap()).sum::<u64>(), 2, "both chats are drawn: {view}");
    for card in gpus {
        let history = card["history"].as_array().unwrap();
        assert!(!history.is_empty(), "a card's pressure is sampled from the start: {card}");
        assert!(history.iter().all(|s| s[3].as_u64().unwrap() > 0), "slots in every sample: {card}");
    }
    assert_eq!(view["models"][0]["warning"], Value::Null);

    // A latency-critical model on fewer than two warm nodes is flagged.
    let mut admin = fleet.controller().fleet().await;
    let mut policy = admin.get_policy(GetPolicyRequest {}).await.unwrap().into_inner();
    policy.latency_critical_models = vec!["chat".into()];
    admin.set_policy(policy).await.unwrap();
    fleet.agents.pop().expect("two agents").stop().await;
    eventually("the short model is flagged", Duration::from_secs(10), || async {
        let view = fleet_view(&fleet).await;
        view["gpus"].as_array().unwrap().len() == 1
            && view["models"][0]["warning"].as_str().is_some_and(|w| w.contains("warm on 1 node"))
    })
    .await;
    let metrics = fleet.http.get(&dashboard_url(&fleet, "/metrics")).await;
    let text = String::from_utf8_lossy(&metrics.body);
    assert!(text.contains("inferyes_controller_critical_models_short 1"), "{text}");
    assert!(text.contains("inferyes_controller_model_warm_nodes{model=\"chat\"} 1"), "{text}");
}

#[tokio::test]
async fn the_event_stream_pushes_the_fleet_when_it_changes() {
    let fleet = Fleet::start(vec![chat_sim("chat")]).await;
    let mut response = fleet
        .http
        .start(http::Method::GET, &dashboard_url(&fleet, "/api/v1/events"), bytes::Bytes::new(), &[VIEWER])
        .await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    let body = response.body_mut();
    let mut buffer = String::new();
    let mut next_event = async || -> Value {
        loop {
            if let Some(end) = buffer.find("\n\n") {
                let event: String = buffer.drain(..end + 2).collect();
                if let Some(data) = event.lines().find_map(|l| l.strip_prefix("data: ")) {
                    assert!(event.starts_with("event: fleet\n"), "{event}");
                    return serde_json::from_str(data).unwrap();
                }
                continue;
            }
            let chunk = inferyes_tests::client::next_chunk(body).await.expect("the stream stays open");
            buffer.push_str(std::str::from_utf8(&chunk).unwrap());
        }
    };
    let first = next_event().await;
    assert_eq!(first["gpus"].as_array().unwrap().len(), 1);
    assert_eq!(first["sessions"]["total"], 0);
    chat_in_session(&fleet, "pushed", "hi").await;
    // Pushed, not polled: each event is a change.
    let tag = inferyes_proto::session_tag("pushed");
    loop {
        let event = next_event().await;
        if event["sessions"]["shown"].as_array().unwrap().iter().any(|s| s["tag"] == tag.as_str()) {
            break;
        }
    }
}

#[tokio::test]
async fn the_dashboard_page_updates_live_in_a_real_browser() {
    let fleet = Fleet::start(vec![chat_sim("chat"), chat_sim("chat")]).await;
    let browser = Browser::start().await;
    browser.goto(&dashboard_url(&fleet, "/")).await;
    // Signed in as a viewer would: the login page keeps a session.
    browser.wait_for("the login page", Duration::from_secs(15), "return !!document.getElementById('login')").await;
    let sign_in = format!(
        "document.getElementById('token').value = '{VIEWER_TOKEN}'; \
         document.getElementById('login').requestSubmit(); return true"
    );
    browser.eval(&sign_in).await;
    browser
        .wait_for(
            "two GPU cards",
            Duration::from_secs(15),
            "return document.querySelectorAll('.gpu-card').length === 2",
        )
        .await;
    assert_eq!(browser.eval("return document.getElementById('live').textContent").await, "live");
    let queue = browser.eval("return document.getElementById('queue').textContent").await;
    assert!(queue.as_str().is_some_and(|q| q.contains("nothing waits")), "{queue}");
    // Whatever happens next must arrive without a reload: this survives
    // only while the page stays the same document.
    browser.eval("window.loadedOnce = 'still here'; return true").await;

    chat_in_session(&fleet, "browser-session", "hello from the dashboard test").await;
    // What routing saved, as pictures: the new session's time to first
    // token on the route chart, each card's pressure over time.
    browser
        .wait_for(
            "the route chart's first point",
            Duration::from_secs(15),
            "const g = document.querySelector('#ttft-chart g.series[data-route=\"placed\"]'); \
             return g !== null && +g.dataset.points >= 1 && g.querySelectorAll('circle').length >= 1",
        )
        .await;
    browser
        .wait_for(
            "two samples of pressure on every card",
            Duration::from_secs(15),
            "const h = [...document.querySelectorAll('.gpu-card svg.history')]; \
             return h.length === 2 && h.every(s => +s.dataset.samples >= 2 \
               && s.querySelector('path.memory').getAttribute('d').includes('L'))",
        )
        .await;
    let tag = inferyes_proto::session_tag("browser-session");
    browser
        .wait_for(
            "the session row",
            Duration::from_secs(15),
            &format!("return document.querySelector('#sessions tr[data-tag=\"{tag}\"]') !== null"),
        )
        .await;
    browser
        .wait_for(
            "the routing decision",
            Duration::from_secs(15),
            "return [...document.querySelectorAll('#decisions tr')].some(r => r.textContent.includes('chat') \
               && r.querySelector('.weighed') !== null && /node-[ab] [\\d.]+ m?s/.test(r.querySelector('.weighed').textContent))",
        )
        .await;
    // Use without a key is charted as `(no key)`.
    browser
        .wait_for(
            "the usage chart's row",
            Duration::from_secs(20),
            "const row = document.querySelector('#usage tr[data-tenant=\"(no key)\"]'); \
             return row !== null && row.querySelector('.gpu-seconds') !== null && row.querySelector('svg.hours') !== null",
        )
        .await;
    let node: String = browser
        .eval(&format!("return document.querySelector('#sessions tr[data-tag=\"{tag}\"]').dataset.node"))
        .await
        .as_str()
        .unwrap()
        .to_string();
    let index = node.strip_prefix("node-").map(|c| usize::from(c.as_bytes()[0] - b'a')).unwrap();

    // Fill that node's GPU past the admission line: its card turns.
    let sim_gpu = format!("{}/sim/gpu", fleet.sims[index].url);
    let gpu = fleet.http.get(&sim_gpu).await.json();
    let (total, used) = (gpu["memory_total_bytes"].as_u64().unwrap(), gpu["memory_used_bytes"].as_u64().unwrap());
    let filled = fleet.http.post_json(&sim_gpu, &json!({ "extra_used_bytes": total / 100 * 95 - used })).await;
    assert_eq!(filled.status, StatusCode::OK);
    browser
        .wait_for(
            "the filled GPU's card to show pressure",
            Duration::from_secs(15),
            &format!(
                "const c = document.querySelector('.gpu-card[data-node=\"{node}\"]'); \
                 return c !== null && c.dataset.pressure === 'full' && c.textContent.includes('no new sessions')"
            ),
        )
        .await;
    let slots = browser.eval("return document.querySelector('.gpu-card .slot-moves').textContent").await;
    assert!(slots.as_str().is_some_and(|s| s.contains("not movable")), "{slots}");
    // Most pressure first.
    let first = browser.eval("return document.querySelector('.gpu-card').dataset.node").await;
    assert_eq!(first, node.as_str());
    assert_eq!(browser.eval("return window.loadedOnce").await, "still here");
    assert!(browser.eval("return window.inferyesUpdates").await.as_u64().unwrap() >= 3);
    // Markup that got past an escape runs no script: the page's policy
    // runs its own script only.
    browser
        .eval(
            "document.body.insertAdjacentHTML('beforeend', \
             '<img id=\"injected\" src=\"data:,x\" onerror=\"window.injectedRan = true\">'); return true",
        )
        .await;
    browser
        .wait_for(
            "the injected image to fail",
            Duration::from_secs(15),
            "return document.getElementById('injected').complete",
        )
        .await;
    assert_eq!(browser.eval("return window.injectedRan === undefined").await, true);

    let shot = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("dashboard.png");
    browser.screenshot(&shot).await;
    eprintln!("dashboard screenshot: {}", shot.display());
}

/// Nothing of the fleet without a viewer's or the admin token: not the
/// page, its JSON, its events, nor the fleet API's reads; a viewer reads
/// and changes nothing; `dashboard_auth = "none"` opens the dashboard.
#[tokio::test]
async fn the_dashboard_and_fleet_reads_need_a_viewer_or_the_admin_token() {
    let fleet = Fleet::start(vec![chat_sim("chat")]).await;
    assert_eq!(get(&fleet, "/api/v1/fleet", &[]).await.status, StatusCode::UNAUTHORIZED);
    assert_eq!(get(&fleet, "/api/v1/events", &[]).await.status, StatusCode::UNAUTHORIZED);
    let wrong = ("authorization", "Bearer test-join-token-0123456789");
    assert_eq!(get(&fleet, "/api/v1/fleet", &[wrong]).await.status, StatusCode::UNAUTHORIZED);
    let page = get(&fleet, "/", &[]).await;
    assert_page_headers(&page);
    let page = String::from_utf8_lossy(&page.body);
    assert!(page.contains("id=\"login\"") && !page.contains("gpu-card"), "the login page, not the fleet: {page}");
    let admin = format!("Bearer {ADMIN_TOKEN}");
    assert_eq!(get(&fleet, "/api/v1/fleet", &[("authorization", &admin)]).await.status, StatusCode::OK);

    // The login page's session.
    let login = |token: &str| {
        let body = json!({ "token": token }).to_string();
        let url = dashboard_url(&fleet, "/api/v1/login");
        let http = fleet.http.clone();
        async move { http.send(http::Method::POST, &url, body.into(), &[]).await }
    };
    assert_eq!(login("test-viewer-token-000000000").await.status, StatusCode::UNAUTHORIZED);
    // Another site's page can post a form here, never read the answer: it
    // signs no one in or out.
    let cross_site = |path: &str| {
        let url = dashboard_url(&fleet, path);
        let (http, body) = (fleet.http.clone(), json!({ "token": VIEWER_TOKEN }).to_string());
        async move { http.send(http::Method::POST, &url, body.into(), &[("sec-fetch-site", "cross-site")]).await }
    };
    for path in ["/api/v1/login", "/api/v1/logout"] {
        let refused = cross_site(path).await;
        assert_eq!(refused.status, StatusCode::FORBIDDEN, "{path}");
        assert!(refused.header("set-cookie").is_none(), "{path}");
    }
    let signed_in = login(VIEWER_TOKEN).await;
    assert_eq!(signed_in.status, StatusCode::NO_CONTENT);
    let cookie = signed_in.header("set-cookie").unwrap().split(';').next().unwrap().to_string();
    assert!(!cookie.contains(VIEWER_TOKEN), "{cookie}");
    let read = get(&fleet, "/api/v1/fleet", &[("cookie", &cookie)]).await;
    assert_eq!(read.status, StatusCode::OK);
    assert_page_headers(&read);
    let page = get(&fleet, "/", &[("cookie", &cookie)]).await;
    assert_page_headers(&page);
    assert!(String::from_utf8_lossy(&page.body).contains("gpu-card"));

    // The fleet API: reads need a token, a viewer's reads only.
    let channel = tonic::transport::Endpoint::from_shared(fleet.controller().url()).unwrap().connect().await.unwrap();
    let mut open = inferyes_ctl::admin_client(channel.clone(), None).unwrap();
    let refused = open.list_nodes(inferyes_proto::v1::ListNodesRequest {}).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unauthenticated, "{refused:?}");
    let refused = open.list_sessions(inferyes_proto::v1::ListSessionsRequest::default()).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unauthenticated);
    assert!(open.get_policy(GetPolicyRequest {}).await.is_err());
    let mut viewer = inferyes_ctl::admin_client(channel, Some(VIEWER_TOKEN)).unwrap();
    assert_eq!(viewer.list_nodes(inferyes_proto::v1::ListNodesRequest {}).await.unwrap().into_inner().nodes.len(), 1);
    assert!(viewer.list_sessions(inferyes_proto::v1::ListSessionsRequest::default()).await.is_ok());
    let drain = inferyes_proto::v1::DrainRequest { node_id: "node-a".into(), ..Default::default() };
    let refused = viewer.drain(drain).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");
    let refused = viewer.list_keys(inferyes_proto::v1::ListKeysRequest::default()).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::PermissionDenied);
}

/// What a browser may do with a dashboard answer: run the pages' own
/// scripts only, be framed nowhere, keep nothing.
fn assert_page_headers(answer: &inferyes_tests::TestResponse) {
    let policy = answer.header("content-security-policy").unwrap_or_default();
    for must in ["default-src 'none'", "script-src 'sha256-", "frame-ancestors 'none'"] {
        assert!(policy.contains(must), "{must} in {policy:?}");
    }
    assert_eq!(answer.header("x-frame-options"), Some("DENY"));
    assert_eq!(answer.header("x-content-type-options"), Some("nosniff"));
    assert_eq!(answer.header("cache-control"), Some("no-store"));
    assert_eq!(answer.header("referrer-policy"), Some("no-referrer"));
}

#[tokio::test]
async fn dashboard_auth_none_leaves_the_dashboard_open() {
    let etcd = inferyes_tests::Etcd::start().await;
    let controller = inferyes_tests::ControllerHandle::start_with(&etcd.endpoint(), "open", None, |config| {
        config.dashboard_auth = inferyes_controller::config::TokenAuth::None;
    })
    .await;
    let url = format!("http://{}/api/v1/fleet", controller.http_addr);
    let http = inferyes_tests::HttpClient::default();
    assert_eq!(http.get(&url).await.status, StatusCode::OK);
}

/// A try at the dashboard: a login with a token, or a read with one as a
/// Bearer token.
#[derive(Clone, Copy)]
enum Try<'a> {
    Login(&'a str),
    Read(&'a str),
    /// The dashboard's page, with a Bearer token: which page comes back
    /// says whether it was right.
    Page(&'a str),
}

/// `attempt` sent to the controller's HTTP port at `address` from `source`,
/// for the client `forwarded_for` names, if any: its status and
/// `Retry-After`.
async fn try_from(
    address: std::net::SocketAddr,
    source: &str,
    forwarded_for: Option<&str>,
    attempt: Try<'_>,
) -> (StatusCode, Option<u64>) {
    use http_body_util::BodyExt;
    let socket = tokio::net::TcpSocket::new_v4().expect("a socket");
    socket.bind(std::net::SocketAddr::new(source.parse().expect("an address"), 0)).expect("a loopback address");
    let stream = socket.connect(address).await.expect("connected");
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await.expect("a handshake");
    tokio::spawn(connection);
    let (method, path, body, bearer) = match attempt {
        Try::Login(token) => (http::Method::POST, "/api/v1/login", json!({ "token": token }).to_string(), None),
        Try::Read(token) => (http::Method::GET, "/api/v1/fleet", String::new(), Some(token)),
        Try::Page(token) => (http::Method::GET, "/", String::new(), Some(token)),
    };
    let mut request = http::Request::builder()
        .method(method)
        .uri(path)
        .header("host", "controller")
        .header("content-type", "application/json");
    if let Some(token) = bearer {
        request = request.header("authorization", format!("Bearer {token}"));
    }
    if let Some(client) = forwarded_for {
        request = request.header("x-forwarded-for", client);
    }
    let request = request.body(http_body_util::Full::new(bytes::Bytes::from(body))).expect("a request");
    let response = sender.send_request(request).await.expect("an answer");
    let retry_after =
        response.headers().get("retry-after").map(|v| v.to_str().expect("text").parse().expect("seconds"));
    let status = response.status();
    response.into_body().collect().await.expect("its body");
    (status, retry_after)
}

/// An address that presents wrong tokens, to the login or as a Bearer
/// token, is held to 10 and then one every 30 s, refused before its token
/// is looked at (so even the right one waits); another address is not held
/// back by it. Behind a trusted proxy, it is the client the proxy names
/// that is held back, not the proxy.
#[tokio::test]
async fn an_address_guessing_dashboard_tokens_is_held_back_and_no_one_else() {
    let etcd = inferyes_tests::Etcd::start().await;
    let proxy = "127.0.0.4";
    let controller = inferyes_tests::ControllerHandle::start_with(&etcd.endpoint(), "guessed", None, |config| {
        config.trusted_proxies = vec![proxy.parse().expect("an address")];
    })
    .await;
    let address = controller.http_addr;
    for (source, forwarded_for) in [("127.0.0.2", None), (proxy, Some("198.51.100.7"))] {
        for i in 0..10 {
            let wrong = format!("not-the-viewer-token-{i:04}");
            let (attempt, status) = match i % 3 {
                0 => (Try::Login(&wrong), StatusCode::UNAUTHORIZED),
                1 => (Try::Read(&wrong), StatusCode::UNAUTHORIZED),
                // The sign-in page.
                _ => (Try::Page(&wrong), StatusCode::OK),
            };
            let answer = try_from(address, source, forwarded_for, attempt).await;
            assert_eq!(answer, (status, None), "try {i} from {source}");
        }
        let (status, retry_after) = try_from(address, source, forwarded_for, Try::Login(VIEWER_TOKEN)).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "from {source}");
        assert!(retry_after.is_some_and(|s| (1..=30).contains(&s)), "{retry_after:?}");
        let (status, _) = try_from(address, source, forwarded_for, Try::Read(VIEWER_TOKEN)).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "reads with a token are tries too");
        let (status, _) = try_from(address, source, forwarded_for, Try::Page(VIEWER_TOKEN)).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "so is the page with one");
    }
    // Others are let in: another address, and another client of the proxy.
    assert_eq!(try_from(address, "127.0.0.3", None, Try::Login(VIEWER_TOKEN)).await, (StatusCode::NO_CONTENT, None));
    let other_client = try_from(address, proxy, Some("198.51.100.8"), Try::Login(VIEWER_TOKEN)).await;
    assert_eq!(other_client, (StatusCode::NO_CONTENT, None));
    // Right tokens are no wrong ones: a client signs in as often as it likes.
    for _ in 0..12 {
        assert_eq!(try_from(address, "127.0.0.5", None, Try::Read(VIEWER_TOKEN)).await.0, StatusCode::OK);
    }
    // A visit with no credential, or a stale cookie, is shown the sign-in
    // page, and is no wrong token.
    let http = inferyes_tests::HttpClient::default();
    assert_eq!(http.get(&format!("http://{address}/")).await.status, StatusCode::OK);
    let stale = [("cookie", "inferyes_session=1.00")];
    let visit = http.send(http::Method::GET, &format!("http://{address}/"), bytes::Bytes::new(), &stale).await;
    assert_eq!(visit.status, StatusCode::OK);
    let scraped = inferyes_tests::HttpClient::default().get(&format!("http://{address}/metrics")).await;
    let metrics = String::from_utf8_lossy(&scraped.body);
    assert!(metrics.contains("inferyes_controller_dashboard_refused_total{reason=\"attempts\"} 6"), "{metrics}");
    assert!(metrics.contains("inferyes_controller_dashboard_refused_total{reason=\"token\"} 20"), "{metrics}");
}
