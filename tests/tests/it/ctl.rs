use clap::Parser;
use inferyes_ctl::{Cli, run};
use serde_json::{Value, json};

use crate::support::{Fleet, chat_sim, embedding_model};

pub(crate) async fn ctl(controller: &str, args: &[&str]) -> anyhow::Result<String> {
    let mut argv = vec!["inferyesctl", "--controller", controller, "--admin-token", inferyes_tests::fleet::ADMIN_TOKEN];
    argv.extend_from_slice(args);
    run(Cli::try_parse_from(argv).expect("valid arguments")).await
}

#[tokio::test]
async fn inferyesctl_lists_and_drains_in_tables_and_json() {
    let fleet = Fleet::start(vec![chat_sim("chat"), embedding_model("embed")]).await;
    let url = fleet.controller().url();

    let table = ctl(&url, &["nodes"]).await.unwrap();
    let lines: Vec<&str> = table.lines().collect();
    assert!(lines[0].starts_with("NODE") && lines[0].contains("VRAM"), "{table}");
    assert!(lines[1].starts_with("node-a") && lines[1].contains("active") && lines[1].contains("chat"), "{table}");
    assert!(lines[2].starts_with("node-b") && lines[2].contains("embed"), "{table}");

    let models: Value = serde_json::from_str(&ctl(&url, &["models", "-o", "json"]).await.unwrap()).unwrap();
    let ids: Vec<&str> = models["models"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["chat", "embed"]);
    assert_eq!(models["models"][0]["loaded_on"][0], "node-a");
    let placement = &models["models"][0]["placements"][0];
    assert_eq!((&placement["node_id"], &placement["state"]), (&Value::from("node-a"), &Value::from("warm")));
    // The harness's backends list no kinds: any is tried, but infill, which
    // the agent asked of the simulated llama-server (no FIM tokens).
    inferyes_tests::eventually("chat known not to infill", std::time::Duration::from_secs(10), || {
        let url = url.clone();
        async move {
            let table = ctl(&url, &["models"]).await.unwrap();
            table.lines().nth(1).is_some_and(|line| line.contains("node-a/main(warm: any but infill)"))
        }
    })
    .await;

    let drained = ctl(&url, &["drain", "node-a", "--reason", "maintenance"]).await.unwrap();
    assert!(drained.starts_with("node node-a draining"), "{drained}");
    // The drain is in etcd at once; the controller's snapshot follows its watch.
    inferyes_tests::eventually("node-a listed as draining", std::time::Duration::from_secs(10), || {
        let url = url.clone();
        async move {
            let nodes: Value = serde_json::from_str(&ctl(&url, &["nodes", "-o", "json"]).await.unwrap()).unwrap();
            nodes["nodes"][0]["draining"] == true
        }
    })
    .await;
    let undrained = ctl(&url, &["undrain", "node-a"]).await.unwrap();
    assert!(undrained.contains("accepting new sessions"), "{undrained}");

    let missing = ctl(&url, &["node", "node-z"]).await.unwrap_err();
    assert!(missing.to_string().contains("no node `node-z`"), "{missing}");
    let completions = ctl("http://127.0.0.1:9", &["completions", "bash"]).await.unwrap();
    assert!(completions.contains("_inferyesctl()") && completions.contains("drain"), "needs no controller");
    let unreachable = ctl("http://127.0.0.1:9", &["nodes"]).await.unwrap_err();
    assert!(format!("{unreachable:#}").contains("cannot reach the controller"), "{unreachable:#}");
}

#[tokio::test]
async fn inferyesctl_manages_aliases_and_the_routing_policy() {
    let fleet = Fleet::start(vec![chat_sim("chat")]).await;
    let url = fleet.controller().url();
    let set = ctl(&url, &["alias", "set", "gpt-4o", "chat"]).await.unwrap();
    assert!(set.starts_with("alias gpt-4o -> chat"), "{set}");
    inferyes_tests::eventually("the alias listed", std::time::Duration::from_secs(5), || {
        let url = url.clone();
        async move { ctl(&url, &["alias", "list"]).await.unwrap().contains("gpt-4o  chat") }
    })
    .await;
    let refused = ctl(&url, &["alias", "set", "chat", "other"]).await.unwrap_err();
    assert!(refused.to_string().contains("cannot hide"), "{refused}");

    let shown = ctl(&url, &["policy", "show"]).await.unwrap();
    assert!(shown.contains("admission threshold: 0.92 (default)"), "{shown}");
    ctl(
        &url,
        &["policy", "set", "--admission", "0.85", "--strategy", "weighted", "--model-strategy", "chat=round-robin"],
    )
    .await
    .unwrap();
    inferyes_tests::eventually("the policy applied", std::time::Duration::from_secs(5), || {
        let url = url.clone();
        async move {
            let policy: Value =
                serde_json::from_str(&ctl(&url, &["policy", "show", "-o", "json"]).await.unwrap()).unwrap();
            policy["admission_threshold"] == 0.85
                && policy["default_strategy"] == "STRATEGY_WEIGHTED"
                && policy["model_strategies"]["chat"] == "STRATEGY_ROUND_ROBIN"
        }
    })
    .await;
    let bad = ctl(&url, &["policy", "set", "--admission", "0.99", "--hard-limit", "0.9"]).await.unwrap_err();
    assert!(bad.to_string().contains("must not exceed"), "{bad}");
    let node = ctl(&url, &["policy", "node", "node-a", "--admission", "0.5"]).await.unwrap();
    assert!(node.starts_with("node node-a thresholds set"), "{node}");
    fleet
        .dataplane
        .wait_for("node-a's own threshold", std::time::Duration::from_secs(5), |s| {
            s.nodes().first().is_some_and(|n| n.admission_threshold == 0.5)
        })
        .await;
}

#[tokio::test]
async fn inferyesctl_creates_lists_and_revokes_keys_showing_the_secret_once() {
    let fleet = Fleet::start(vec![chat_sim("chat")]).await;
    let url = fleet.controller().url();
    let created: Value = serde_json::from_str(
        &ctl(
            &url,
            &[
                "keys",
                "create",
                "ci",
                "--model",
                "chat",
                "--rpm",
                "60",
                "--max-concurrent",
                "8",
                "--expires-in",
                "30d",
                "-o",
                "json",
            ],
        )
        .await
        .unwrap(),
    )
    .unwrap();
    let key_id = created["key_id"].as_str().unwrap().to_string();
    let secret = created["secret"].as_str().unwrap().to_string();
    assert!(secret.starts_with(&format!("ify_{key_id}_")), "{created}");
    assert_eq!((&created["requests_per_minute"], &created["max_concurrent"]), (&json!(60), &json!(8)));
    let expires_in_days = (created["expires_unix_ms"].as_u64().unwrap() - inferyes_proto::unix_ms()) / 86_400_000;
    assert_eq!(expires_in_days, 29, "{created}");

    inferyes_tests::eventually("the key is listed", std::time::Duration::from_secs(10), || {
        let url = url.clone();
        async move { ctl(&url, &["keys", "list"]).await.unwrap().lines().count() == 2 }
    })
    .await;
    let listed = ctl(&url, &["keys", "list"]).await.unwrap();
    assert!(listed.contains(&key_id) && listed.contains("active") && listed.contains("in 29d"), "{listed}");
    // The secret, and even its hash, never come back.
    let shown = ctl(&url, &["keys", "show", &key_id, "-o", "json"]).await.unwrap();
    assert!(!shown.contains(&secret[4..]) && !shown.contains("argon2"), "{shown}");

    let revoked = ctl(&url, &["keys", "revoke", &key_id]).await.unwrap();
    assert!(revoked.contains("revoked"), "{revoked}");
    inferyes_tests::eventually("the key shows as revoked", std::time::Duration::from_secs(10), || {
        let (url, key_id) = (url.clone(), key_id.clone());
        async move { ctl(&url, &["keys", "show", &key_id]).await.unwrap().contains("revoked") }
    })
    .await;
    let bad = ctl(&url, &["keys", "create", "x", "--expires-in", "soon"]).await.unwrap_err();
    assert!(bad.to_string().contains("unit"), "{bad}");
}

#[tokio::test]
async fn inferyesctl_shows_usage_per_hour_key_and_model_and_exports_records() {
    let fleet = Fleet::start_with(vec![chat_sim("chat")], |c| c.usage_records = true).await;
    let url = fleet.controller().url();
    let chat = fleet.url("/v1/chat/completions");
    for i in 0..3 {
        let response = fleet.http.post_json(&chat, &crate::support::chat_body("chat", &format!("q{i}"))).await;
        assert_eq!(response.status, http::StatusCode::OK);
    }
    crate::usage::rolled_up(fleet.controller(), "", 3).await;
    let table = ctl(&url, &["usage", "--since", "2h"]).await.unwrap();
    let lines: Vec<&str> = table.lines().collect();
    assert!(lines[0].starts_with("HOUR (UTC)") && lines[0].contains("COMPLETION"), "{table}");
    assert!(lines[1].contains(" chat ") && lines[1].contains(" 3 "), "{table}");
    assert!(lines.last().unwrap().starts_with("total"), "{table}");
    let exported = ctl(&url, &["usage", "--export"]).await.unwrap();
    let records: Vec<Value> = exported.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(records.len(), 3, "{exported}");
    assert!(records.iter().all(|r| r["model"] == "chat" && r["outcome"] == "ok" && r["completion_tokens"] == 8));
}
