//! API keys at the data plane: every refusal path, revocation reaching two
//! data planes, expiry, model limits, request rates and failed attempts.

use std::time::Duration;

use http::{Method, StatusCode};
use inferyes_dataplane::auth::AuthMode;
use inferyes_proto::v1::{ApiKey, CreateKeyRequest, RevokeKeyRequest};
use inferyes_tests::{DataplaneHandle, TestResponse};
use prost::Message;

use crate::support::{Fleet, chat_body, chat_sim, create_key as create};

async fn keyed_fleet(tweak: impl FnOnce(&mut inferyes_dataplane::Config)) -> Fleet {
    Fleet::start_with(vec![chat_sim("chat"), chat_sim("other")], |config| {
        config.auth = AuthMode::Keys;
        tweak(config);
    })
    .await
}

async fn chat(fleet: &Fleet, url: &str, key: Option<&str>, model: &str) -> TestResponse {
    chat_from(fleet, url, key, model, None).await
}

/// A chat request that says, in `X-Forwarded-For`, it is from `client`.
async fn chat_from(fleet: &Fleet, url: &str, key: Option<&str>, model: &str, client: Option<&str>) -> TestResponse {
    let bearer = key.map(|k| format!("Bearer {k}"));
    let mut headers: Vec<(&str, &str)> = bearer.iter().map(|b| ("authorization", b.as_str())).collect();
    headers.extend(client.map(|client| ("x-forwarded-for", client)));
    let body = chat_body(model, "hello").to_string();
    fleet.http.send(Method::POST, &format!("{url}/v1/chat/completions"), body.into(), &headers).await
}

/// The `i`th of many well-formed, wrong secrets for `key_id`.
fn wrong_secret(key_id: &str, i: usize) -> String {
    let letter = |n: usize| char::from(b'a' + (n % 26) as u8);
    format!("ify_{key_id}_{}{}{}", "q".repeat(30), letter(i / 26), letter(i))
}

fn refused_as(response: &TestResponse, status: StatusCode, code: &str) {
    assert_eq!(response.status, status, "{}", String::from_utf8_lossy(&response.body));
    assert_eq!(response.openai_error()["code"], code);
}

#[tokio::test]
async fn requests_need_a_valid_key_and_get_only_its_models() {
    let fleet = keyed_fleet(|_| {}).await;
    let url = fleet.dataplane.url.clone();
    let (key_id, secret) = create(
        &fleet,
        CreateKeyRequest { name: "team-a".into(), allowed_models: vec!["ch*".into()], ..Default::default() },
    )
    .await;
    assert!(secret.starts_with(&format!("ify_{key_id}_")));

    let ok = chat(&fleet, &url, Some(&secret), "chat").await;
    assert_eq!(ok.status, StatusCode::OK);
    assert!(ok.header("x-ratelimit-limit-requests").is_none(), "no limit, no headers");

    refused_as(&chat(&fleet, &url, None, "chat").await, StatusCode::UNAUTHORIZED, "invalid_api_key");
    refused_as(&chat(&fleet, &url, Some("sk-not-ours"), "chat").await, StatusCode::UNAUTHORIZED, "invalid_api_key");
    let unknown_id = format!("ify_aaaaaaaaaaaa_{}", &secret[secret.len() - 32..]);
    refused_as(&chat(&fleet, &url, Some(&unknown_id), "chat").await, StatusCode::UNAUTHORIZED, "invalid_api_key");
    let wrong_secret = format!("ify_{key_id}_{}", "a".repeat(32));
    refused_as(&chat(&fleet, &url, Some(&wrong_secret), "chat").await, StatusCode::UNAUTHORIZED, "invalid_api_key");

    // Another model is, to this key, no model at all.
    let hidden = chat(&fleet, &url, Some(&secret), "other").await;
    refused_as(&hidden, StatusCode::NOT_FOUND, "model_not_found");
    assert!(hidden.openai_error()["message"].as_str().unwrap().contains("do not have access"));
    let auth = format!("Bearer {secret}");
    let listed = fleet
        .http
        .send(Method::GET, &format!("{url}/v1/models"), Default::default(), &[("authorization", &auth)])
        .await;
    let ids: Vec<String> =
        listed.json()["data"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap().to_string()).collect();
    assert_eq!(ids, ["chat"]);
    let one = fleet
        .http
        .send(Method::GET, &format!("{url}/v1/models/other"), Default::default(), &[("authorization", &auth)])
        .await;
    assert_eq!(one.status, StatusCode::NOT_FOUND);
    refused_as(&fleet.http.get(&format!("{url}/v1/models")).await, StatusCode::UNAUTHORIZED, "invalid_api_key");
    // A model the key may use that the fleet has not: its 404 names only
    // the models this key may use, never the rest of the catalog.
    let absent = chat(&fleet, &url, Some(&secret), "chatty").await;
    refused_as(&absent, StatusCode::NOT_FOUND, "model_not_found");
    let message = absent.openai_error()["message"].as_str().unwrap().to_string();
    assert!(message.contains("available models: chat") && !message.contains("other"), "{message}");
    let (_, narrow) = create(
        &fleet,
        CreateKeyRequest { name: "one".into(), allowed_models: vec!["gone".into()], ..Default::default() },
    )
    .await;
    let absent = chat(&fleet, &url, Some(&narrow), "gone").await;
    refused_as(&absent, StatusCode::NOT_FOUND, "model_not_found");
    let message = absent.openai_error()["message"].as_str().unwrap().to_string();
    assert!(!message.contains("chat") && !message.contains("other"), "{message}");

    // Refusals are counted by reason; no secret reaches the metrics.
    let metrics =
        String::from_utf8(fleet.http.get(&format!("{}/metrics", fleet.dataplane.admin_url)).await.body.to_vec())
            .unwrap();
    assert!(metrics.contains("inferyes_dataplane_auth_refusals_total{reason=\"missing\"} 2"), "{metrics}");
    assert!(metrics.contains("inferyes_dataplane_auth_refusals_total{reason=\"invalid\"} 3"), "{metrics}");
    assert!(!metrics.contains(&secret[4..]));
}

#[tokio::test]
async fn a_revoked_key_is_refused_by_every_data_plane_from_its_next_snapshot() {
    let fleet = keyed_fleet(|_| {}).await;
    let second = DataplaneHandle::start_with(&[fleet.controller().url()], |c| c.auth = AuthMode::Keys).await;
    second.wait_for_nodes(&["node-a", "node-b"]).await;
    let (key_id, secret) = create(&fleet, CreateKeyRequest { name: "leaving".into(), ..Default::default() }).await;
    let id = key_id.clone();
    second.wait_for("the key", Duration::from_secs(10), move |s| s.api_key(&id).is_some()).await;
    for url in [&fleet.dataplane.url, &second.url] {
        assert_eq!(chat(&fleet, url, Some(&secret), "chat").await.status, StatusCode::OK);
    }

    let revision = fleet
        .controller()
        .fleet()
        .await
        .revoke_key(RevokeKeyRequest { key_id: key_id.clone() })
        .await
        .unwrap()
        .into_inner()
        .revision;
    for dataplane in [&fleet.dataplane, &second] {
        dataplane.wait_for("the revocation", Duration::from_secs(10), move |s| s.version() >= revision).await;
        let refused = chat(&fleet, &dataplane.url, Some(&secret), "chat").await;
        refused_as(&refused, StatusCode::UNAUTHORIZED, "invalid_api_key");
        assert!(refused.openai_error()["message"].as_str().unwrap().contains("revoked"));
    }
    second.stop().await;
}

#[tokio::test]
async fn an_expired_key_is_refused() {
    let fleet = keyed_fleet(|_| {}).await;
    // Written straight to etcd: the API refuses to create a key that is
    // already expired, and waiting for one to expire would be a sleep.
    let generated = inferyes_proto::apikey::generate().unwrap();
    let record = ApiKey {
        key_id: generated.key_id.clone(),
        name: "old".into(),
        secret_hash: generated.secret_hash,
        expires_unix_ms: inferyes_proto::unix_ms() - 1000,
        ..Default::default()
    };
    let mut etcd = etcd_client::Client::connect([fleet.etcd.endpoint()], None).await.unwrap();
    etcd.put(format!("/inferyes/v1/keys/{}", record.key_id), record.encode_to_vec(), None).await.unwrap();
    let id = record.key_id.clone();
    fleet.dataplane.wait_for("the key", Duration::from_secs(10), move |s| s.api_key(&id).is_some()).await;
    let refused = chat(&fleet, &fleet.dataplane.url, Some(&generated.token), "chat").await;
    refused_as(&refused, StatusCode::UNAUTHORIZED, "invalid_api_key");
    assert!(refused.openai_error()["message"].as_str().unwrap().contains("expired"));
}

#[tokio::test]
async fn a_key_over_its_request_rate_gets_429_with_the_rate_headers() {
    let fleet = keyed_fleet(|_| {}).await;
    let (_, secret) =
        create(&fleet, CreateKeyRequest { name: "slow".into(), requests_per_minute: 2, ..Default::default() }).await;
    let url = fleet.dataplane.url.clone();
    let first = chat(&fleet, &url, Some(&secret), "chat").await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(first.header("x-ratelimit-limit-requests"), Some("2"));
    assert_eq!(first.header("x-ratelimit-remaining-requests"), Some("1"));
    assert_eq!(chat(&fleet, &url, Some(&secret), "chat").await.status, StatusCode::OK);
    let limited = chat(&fleet, &url, Some(&secret), "chat").await;
    refused_as(&limited, StatusCode::TOO_MANY_REQUESTS, "rate_limit_exceeded");
    assert_eq!(limited.header("x-ratelimit-remaining-requests"), Some("0"));
    let retry: u32 = limited.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=30).contains(&retry), "{retry}");
}

#[tokio::test]
async fn failed_attempts_from_one_address_are_cut_off_but_known_keys_still_pass() {
    let fleet = keyed_fleet(|c| c.auth_failures_per_minute = 3).await;
    let url = fleet.dataplane.url.clone();
    let (key_id, secret) = create(&fleet, CreateKeyRequest { name: "good".into(), ..Default::default() }).await;
    assert_eq!(chat(&fleet, &url, Some(&secret), "chat").await.status, StatusCode::OK);
    for i in 0..3 {
        let guess = format!("ify_{key_id}_{}", char::from(b'a' + i).to_string().repeat(32));
        refused_as(&chat(&fleet, &url, Some(&guess), "chat").await, StatusCode::UNAUTHORIZED, "invalid_api_key");
    }
    let guess = format!("ify_{key_id}_{}", "z".repeat(32));
    let cut_off = chat(&fleet, &url, Some(&guess), "chat").await;
    refused_as(&cut_off, StatusCode::TOO_MANY_REQUESTS, "rate_limit_exceeded");
    assert!(cut_off.header("retry-after").is_some());
    // A key this data plane has verified is not a guess.
    assert_eq!(chat(&fleet, &url, Some(&secret), "chat").await.status, StatusCode::OK);
}

/// The row: junk and wrong secrets from one address, then a key
/// this data plane has not seen yet, from the same address, is served.
#[tokio::test]
async fn a_key_not_seen_yet_is_served_after_failures_from_its_address() {
    let fleet = keyed_fleet(|c| c.auth_failures_per_minute = 3).await;
    let url = fleet.dataplane.url.clone();
    let (victim, _) = create(&fleet, CreateKeyRequest { name: "guessed".into(), ..Default::default() }).await;
    let (_, fresh) = create(&fleet, CreateKeyRequest { name: "new".into(), ..Default::default() }).await;
    let mut refused = Vec::new();
    for i in 0..15 {
        let junk = match i % 3 {
            0 => "not-a-key".to_string(),
            1 => format!("ify_nosuchkey{i}_{}", "a".repeat(32)),
            _ => wrong_secret(&victim, i),
        };
        refused.push(chat(&fleet, &url, Some(&junk), "chat").await.status);
    }
    assert!(
        refused.iter().all(|s| *s == StatusCode::UNAUTHORIZED || *s == StatusCode::TOO_MANY_REQUESTS),
        "{refused:?}"
    );
    assert!(refused.contains(&StatusCode::TOO_MANY_REQUESTS), "the guesses were cut off: {refused:?}");
    let served = chat(&fleet, &url, Some(&fresh), "chat").await;
    assert_eq!(served.status, StatusCode::OK, "{}", String::from_utf8_lossy(&served.body));
}

/// Many wrong secrets at once for one key, and a valid key's first
/// request among them: it is checked before the flood, not behind it.
#[tokio::test]
async fn a_flood_of_wrong_secrets_does_not_lock_out_a_valid_key() {
    let fleet = keyed_fleet(|c| c.auth_failures_per_minute = 5).await;
    let url = fleet.dataplane.url.clone();
    let (victim, _) = create(&fleet, CreateKeyRequest { name: "flooded".into(), ..Default::default() }).await;
    let (_, valid) = create(&fleet, CreateKeyRequest { name: "valid".into(), ..Default::default() }).await;
    let mut flood = tokio::task::JoinSet::new();
    for i in 0..64 {
        let (http, url) = (fleet.http.clone(), format!("{url}/v1/chat/completions"));
        let headers = format!("Bearer {}", wrong_secret(&victim, i));
        let body = chat_body("chat", "hello").to_string();
        flood.spawn(async move {
            http.send(Method::POST, &url, body.into(), &[("authorization", headers.as_str())]).await.status
        });
    }
    let served = chat(&fleet, &url, Some(&valid), "chat").await;
    let flooded = flood.join_all().await;
    assert_eq!(served.status, StatusCode::OK, "{}", String::from_utf8_lossy(&served.body));
    assert!(
        flooded.iter().all(|s| *s == StatusCode::UNAUTHORIZED || *s == StatusCode::TOO_MANY_REQUESTS),
        "{flooded:?}"
    );
    assert!(flooded.contains(&StatusCode::TOO_MANY_REQUESTS), "the flood was cut off: {flooded:?}");
}

/// Behind trusted proxies, each client's failures are its own; from
/// anyone else, `X-Forwarded-For` is not believed.
#[tokio::test]
async fn failures_are_counted_per_client_behind_trusted_proxies_only() {
    for trusted in [true, false] {
        let fleet = keyed_fleet(|c| {
            c.auth_failures_per_minute = 2;
            if trusted {
                c.trusted_proxies = vec!["127.0.0.0/8".parse().unwrap()];
            }
        })
        .await;
        let url = fleet.dataplane.url.clone();
        let (key_id, _) = create(&fleet, CreateKeyRequest { name: "guessed".into(), ..Default::default() }).await;
        let guesser = Some("198.51.100.1, 203.0.113.5");
        for i in 0..2 {
            let guess = wrong_secret(&key_id, i);
            refused_as(
                &chat_from(&fleet, &url, Some(&guess), "chat", guesser).await,
                StatusCode::UNAUTHORIZED,
                "invalid_api_key",
            );
        }
        let guess = wrong_secret(&key_id, 2);
        let cut_off = chat_from(&fleet, &url, Some(&guess), "chat", guesser).await;
        refused_as(&cut_off, StatusCode::TOO_MANY_REQUESTS, "rate_limit_exceeded");
        let guess = wrong_secret(&key_id, 3);
        let other = chat_from(&fleet, &url, Some(&guess), "chat", Some("203.0.113.6")).await;
        if trusted {
            refused_as(&other, StatusCode::UNAUTHORIZED, "invalid_api_key");
        } else {
            refused_as(&other, StatusCode::TOO_MANY_REQUESTS, "rate_limit_exceeded");
        }
    }
}

/// The row: tenant A sends a conversation, tenant B the same
/// opening; B must not be told A's conversation is resident anywhere, nor
/// be sent to join it. Two keys of one tenant share their conversations.
#[tokio::test]
async fn one_tenant_never_learns_of_nor_joins_another_s_conversation() {
    let fleet = keyed_fleet(|_| {}).await;
    let key =
        |name: &str, tenant: &str| CreateKeyRequest { name: name.into(), tenant: tenant.into(), ..Default::default() };
    let (_, alice) = create(&fleet, key("alice", "")).await;
    let (_, bob) = create(&fleet, key("bob", "")).await;
    let (_, acme_one) = create(&fleet, key("acme-1", "acme")).await;
    let (_, acme_two) = create(&fleet, key("acme-2", "acme")).await;
    let turn = |key: String, session: Option<&'static str>| {
        let (fleet, url) = (&fleet, fleet.dataplane.url.clone());
        async move {
            let bearer = format!("Bearer {key}");
            let mut headers = vec![("authorization", bearer.as_str())];
            if let Some(session) = session {
                headers.push(("x-session-id", session));
            }
            let body = serde_json::json!({"model": "chat", "max_tokens": 4, "messages": [
                {"role": "system", "content": "the same long system prompt every tenant happens to send"},
                {"role": "user", "content": "the same first question"},
            ]});
            let response = fleet
                .http
                .send(Method::POST, &format!("{url}/v1/chat/completions"), body.to_string().into(), &headers)
                .await;
            assert_eq!(response.status, StatusCode::OK, "{}", String::from_utf8_lossy(&response.body));
            response.header("x-inferyes-route").unwrap_or_default().to_string()
        }
    };
    // Derived from the conversation's root, and named by the client.
    for session in [None, Some("chat-1")] {
        let base = fleet.dataplane.store.current().map_or(0, |s| s.resident_sessions());
        assert_eq!(turn(alice.clone(), session).await, "placed", "{session:?}");
        wait_resident(&fleet, base + 1).await;
        assert_eq!(turn(alice.clone(), session).await, "resident", "the key's own conversation: {session:?}");
        assert_eq!(turn(bob.clone(), session).await, "placed", "another key is not told of it: {session:?}");
        wait_resident(&fleet, base + 2).await;
        assert_eq!(turn(acme_one.clone(), session).await, "placed", "{session:?}");
        wait_resident(&fleet, base + 3).await;
        assert_eq!(turn(acme_two.clone(), session).await, "resident", "one tenant's keys share: {session:?}");
    }
}

async fn wait_resident(fleet: &Fleet, count: usize) {
    let wait = Duration::from_secs(10);
    fleet.dataplane.wait_for("the sessions resident", wait, move |s| s.resident_sessions() >= count).await;
}
