use clap::Parser;
use inferyes_controller::ctl::{Cli, run};
use serde_json::Value;

use crate::support::{Fleet, chat_sim, embedding_model};

async fn ctl(controller: &str, args: &[&str]) -> anyhow::Result<String> {
    let mut argv = vec!["inferyesctl", "--controller", controller];
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
    let unreachable = ctl("http://127.0.0.1:9", &["nodes"]).await.unwrap_err();
    assert!(format!("{unreachable:#}").contains("cannot reach the controller"), "{unreachable:#}");
}
