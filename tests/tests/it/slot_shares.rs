//! Fair shares hold across data planes: a tenant whose requests come
//! through three data planes takes no more of the nodes than one whose
//! requests come through the fourth.

use std::time::Duration;

use http::{Method, StatusCode};
use inferyes_proto::v1::CreateKeyRequest;
use serde_json::json;

use crate::allowances::{admin_urls, four_data_planes, key, urls};
use crate::support::{chat_sim, scraped};

const FLOOD: usize = 36;

#[tokio::test]
async fn a_tenant_at_one_data_plane_gets_its_share_of_slots_a_flood_through_three_holds() {
    light_through_one_against_a_flood_through_three(false).await;
}

#[tokio::test]
async fn shares_hold_where_data_planes_report_to_two_controllers() {
    // dp-0 lists the first controller only, its three peers both: the
    // second sees the flood alone and splits nothing, and each data plane
    // takes the least part the controllers that split give it.
    light_through_one_against_a_flood_through_three(true).await;
}

async fn light_through_one_against_a_flood_through_three(second_controller: bool) {
    // One node of two slots, 40 tokens a second in each: a flood request
    // holds a slot half a second, the flood 9 s in all.
    let sim = inferyes_sim::SimConfig { slots: 2, decode_tokens_per_second: 40.0, ..chat_sim("chat") };
    let (fleet, others, _second) = four_data_planes(sim, second_controller).await;
    let tenant = |name: &str| CreateKeyRequest { name: name.into(), tenant: name.into(), ..Default::default() };
    let heavy = key(&fleet, &others, tenant("heavy")).await;
    let light = key(&fleet, &others, tenant("light")).await;
    let urls = urls(&fleet, &others);
    let ask = |url: &str, bearer: &str, max_tokens: u32| {
        let (http, url, bearer) = (fleet.http.clone(), format!("{url}/v1/chat/completions"), bearer.to_string());
        let body = json!({"model": "chat", "max_tokens": max_tokens,
                          "messages": [{"role": "user", "content": "tell me more"}]});
        tokio::spawn(async move {
            http.send(Method::POST, &url, body.to_string().into(), &[("authorization", &bearer)]).await.status
        })
    };
    // The heavy tenant's flood, dealt round robin to dp-1, dp-2 and dp-3.
    let flood: Vec<_> = (0..FLOOD).map(|i| ask(&urls[1 + i % 3], &heavy, 20)).collect();
    let admin = admin_urls(&fleet, &others);
    inferyes_tests::eventually("the flood in", Duration::from_secs(10), || async {
        let mut held = 0.0;
        for url in &admin[1..] {
            let metrics = format!("{url}/metrics");
            held += scraped(&fleet.http, &metrics, "inferyes_dataplane_node_in_flight", "").await
                + scraped(&fleet.http, &metrics, "inferyes_dataplane_queue_waiting", "").await;
        }
        held >= FLOOD as f64
    })
    .await;
    // The light tenant, one request at a time through dp-0, which holds
    // no slot: the flood's data planes free theirs only to what waits
    // there, unless they hold back for the light tenant's share.
    let mut answered_before = Vec::new();
    for _ in 0..4 {
        assert_eq!(ask(&urls[0], &light, 2).await.expect("answered"), StatusCode::OK);
        answered_before.push(flood.iter().filter(|request| request.is_finished()).count());
    }
    for request in flood {
        assert_eq!(request.await.expect("answered"), StatusCode::OK);
    }
    // Its first request waits for the controllers to hear of it (a report
    // a second) and for a slot to free; the next find the slot its share
    // keeps.
    assert!(answered_before[0] <= 12, "{answered_before:?} of {FLOOD} flood requests answered before the light ones");
    let later = answered_before[3] - answered_before[0];
    assert!(later <= 6, "{answered_before:?}: the light tenant's next requests waited for the flood");
}
