//! A key's limits hold across data planes: four data planes behind a
//! round-robin balancer give a key its requests per minute, its requests
//! in flight and its daily budget once, not once each.

use std::time::Duration;

use http::{Method, StatusCode};
use inferyes_dataplane::auth::AuthMode;
use inferyes_proto::v1::CreateKeyRequest;
use inferyes_tests::{ControllerHandle, DataplaneHandle};
use serde_json::json;

use crate::support::{Fleet, chat_body, chat_sim, create_key, long_story, scraped, slow_sim};
use crate::usage::rolled_up;

const DATA_PLANES: usize = 4;

/// A fleet of one node with four data planes, each knowing it splits the
/// keys' limits with the three others. With a second controller, the
/// three data planes the test adds list it as well as the first.
pub(crate) async fn four_data_planes(
    sim: inferyes_sim::SimConfig,
    second_controller: bool,
) -> (Fleet, Vec<DataplaneHandle>, Option<ControllerHandle>) {
    let keys = |c: &mut inferyes_dataplane::Config| c.auth = AuthMode::Keys;
    let fleet = Fleet::start_with(vec![sim], |c| {
        keys(c);
        c.dataplane_id = "dp-0".into();
    })
    .await;
    let second = match second_controller {
        true => Some(ControllerHandle::start(&fleet.etcd.endpoint(), "controller-2").await),
        false => None,
    };
    let controllers: Vec<String> = second.iter().chain(fleet.controller.iter()).map(ControllerHandle::url).collect();
    let mut others = Vec::new();
    for i in 1..DATA_PLANES {
        let dataplane = DataplaneHandle::start_with(&controllers, |c| {
            keys(c);
            c.dataplane_id = format!("dp-{i}");
        })
        .await;
        dataplane.wait_for_nodes(&["node-a"]).await;
        others.push(dataplane);
    }
    for url in admin_urls(&fleet, &others) {
        let metrics = format!("{url}/metrics");
        inferyes_tests::eventually(
            "every data plane counts four, its splits whole",
            Duration::from_secs(15),
            || async {
                scraped(&fleet.http, &metrics, "inferyes_dataplane_allowance_dataplanes", "").await
                    == DATA_PLANES as f64
                    && scraped(&fleet.http, &metrics, "inferyes_dataplane_allowance_settling", "").await == 0.0
            },
        )
        .await;
    }
    (fleet, others, second)
}

pub(crate) fn urls(fleet: &Fleet, others: &[DataplaneHandle]) -> Vec<String> {
    std::iter::once(fleet.dataplane.url.clone()).chain(others.iter().map(|d| d.url.clone())).collect()
}

pub(crate) fn admin_urls(fleet: &Fleet, others: &[DataplaneHandle]) -> Vec<String> {
    std::iter::once(fleet.dataplane.admin_url.clone()).chain(others.iter().map(|d| d.admin_url.clone())).collect()
}

/// Creates a key and waits until every data plane knows it.
pub(crate) async fn key(fleet: &Fleet, others: &[DataplaneHandle], request: CreateKeyRequest) -> String {
    key_and_id(fleet, others, request).await.0
}

/// The key's bearer header and its id.
async fn key_and_id(fleet: &Fleet, others: &[DataplaneHandle], request: CreateKeyRequest) -> (String, String) {
    let (key_id, secret) = create_key(fleet, request).await;
    for dataplane in others {
        let id = key_id.clone();
        dataplane.wait_for("the key", Duration::from_secs(10), move |s| s.api_key(&id).is_some()).await;
    }
    (format!("Bearer {secret}"), key_id)
}

#[tokio::test]
async fn a_key_s_requests_per_minute_hold_across_four_data_planes() {
    let (fleet, others, _) = four_data_planes(chat_sim("chat"), false).await;
    burst_of_240_against_60_a_minute(&fleet, &others).await;
}

#[tokio::test]
async fn a_key_s_requests_per_minute_hold_across_data_planes_reporting_to_two_controllers() {
    // dp-0 lists the first controller only, its three peers both: the
    // second splits among three data planes, the first among four, and
    // each data plane takes the least part it is given.
    let (fleet, others, _second) = four_data_planes(chat_sim("chat"), true).await;
    burst_of_240_against_60_a_minute(&fleet, &others).await;
}

async fn burst_of_240_against_60_a_minute(fleet: &Fleet, others: &[DataplaneHandle]) {
    let request = CreateKeyRequest { name: "rpm".into(), requests_per_minute: 60, ..Default::default() };
    let bearer = key(fleet, others, request).await;
    let urls = urls(fleet, others);
    let body = chat_body("chat", "hello").to_string();
    let started = tokio::time::Instant::now();
    // 240 at once, dealt round robin: 60 to each data plane.
    let mut sends = tokio::task::JoinSet::new();
    for i in 0..240 {
        let url = format!("{}/v1/chat/completions", urls[i % DATA_PLANES]);
        let (http, body, bearer) = (fleet.http.clone(), body.clone(), bearer.clone());
        sends.spawn(
            async move { http.send(Method::POST, &url, body.into(), &[("authorization", &bearer)]).await.status },
        );
    }
    let statuses = sends.join_all().await;
    let seconds = started.elapsed().as_secs_f64();
    let served = statuses.iter().filter(|s| **s == StatusCode::OK).count();
    let refused = statuses.iter().filter(|s| **s == StatusCode::TOO_MANY_REQUESTS).count();
    assert_eq!(served + refused, 240, "{statuses:?}");
    // The burst of 60, and what refills at one a second while it runs.
    let bound = 60 + seconds.ceil() as usize;
    assert!(served <= bound, "{served} served in {seconds:.1}s, past {bound}");
    assert!(served >= 56, "{served} served: the key's parts add up to its limit");
}

async fn open_stream(
    http: &inferyes_tests::HttpClient,
    url: &str,
    bearer: &str,
) -> Result<http::Response<hyper::body::Incoming>, StatusCode> {
    let url = format!("{url}/v1/chat/completions");
    let response = http.start(Method::POST, &url, long_story(), &[("authorization", bearer)]).await;
    match response.status() {
        StatusCode::OK => Ok(response),
        status => Err(status),
    }
}

#[tokio::test]
async fn a_key_s_requests_in_flight_hold_across_four_data_planes_and_follow_its_traffic() {
    let (fleet, others, _) = four_data_planes(slow_sim(), false).await;
    let bearer =
        key(&fleet, &others, CreateKeyRequest { name: "four".into(), max_concurrent: 4, ..Default::default() }).await;
    let urls = urls(&fleet, &others);

    // Sixteen streams at once, dealt round robin: four are taken.
    let mut opens = tokio::task::JoinSet::new();
    for i in 0..16 {
        let (http, url, bearer) = (fleet.http.clone(), urls[i % DATA_PLANES].clone(), bearer.clone());
        opens.spawn(async move { open_stream(&http, &url, &bearer).await });
    }
    let mut open: Vec<_> = opens.join_all().await.into_iter().filter_map(Result::ok).collect();
    assert_eq!(open.len(), 4, "the key holds four requests in flight, fleet-wide");
    for url in &urls {
        assert_eq!(open_stream(&fleet.http, url, &bearer).await.err(), Some(StatusCode::TOO_MANY_REQUESTS));
    }
    open.clear();

    // All its traffic through one data plane now: that one's part grows to
    // the whole limit, as its refusals tell the controller.
    let held = std::sync::Mutex::new(Vec::new());
    inferyes_tests::eventually("four streams through one data plane", Duration::from_secs(20), || async {
        if let Ok(stream) = open_stream(&fleet.http, &urls[0], &bearer).await {
            held.lock().unwrap().push(stream);
        }
        held.lock().unwrap().len() == 4
    })
    .await;
    for url in &urls {
        assert_eq!(open_stream(&fleet.http, url, &bearer).await.err(), Some(StatusCode::TOO_MANY_REQUESTS));
    }
}

#[tokio::test]
async fn a_key_s_daily_budget_holds_across_four_data_planes() {
    // Slow enough that a wave's requests are in flight together.
    let slow = inferyes_sim::SimConfig { decode_tokens_per_second: 40.0, ..chat_sim("chat") };
    let (fleet, others, _) = four_data_planes(slow, false).await;
    let request = CreateKeyRequest { name: "budget".into(), tokens_per_day: 1_000, ..Default::default() };
    let (bearer, key_id) = key_and_id(&fleet, &others, request).await;
    let urls = urls(&fleet, &others);
    // Waves of 48 at once, dealt round robin, until the budget is spent;
    // each after the one before, as its refusals say to retry.
    let (mut answered, mut largest) = (0, 0);
    for wave in 0..30 {
        let mut asks = tokio::task::JoinSet::new();
        for i in 0..48 {
            let body = json!({"model": "chat", "max_tokens": 16, "messages": [{"role": "user",
                              "content": format!("question {wave}.{i}: {}", "tell me more about it ".repeat(5))}]});
            let url = format!("{}/v1/chat/completions", urls[i % DATA_PLANES]);
            let (http, bearer) = (fleet.http.clone(), bearer.clone());
            asks.spawn(async move {
                http.send(Method::POST, &url, body.to_string().into(), &[("authorization", &bearer)]).await
            });
        }
        let mut retry_after = 0;
        for response in asks.join_all().await {
            match response.status {
                StatusCode::OK => {
                    answered += 1;
                    largest = largest.max(response.json()["usage"]["total_tokens"].as_u64().expect("usage"));
                }
                StatusCode::TOO_MANY_REQUESTS => {
                    assert_eq!(response.openai_error()["code"], "rate_limit_exceeded");
                    let retry: u64 = response.header("retry-after").expect("retry-after").parse().expect("seconds");
                    retry_after = retry_after.max(retry);
                }
                other => panic!("{other}: {}", String::from_utf8_lossy(&response.body)),
            }
        }
        let spent = rolled_up(fleet.controller(), &key_id, answered).await;
        let spent = spent.prompt_tokens + spent.completion_tokens;
        if spent >= 1_000 {
            // Past it by at most one request's worth.
            assert!(
                spent <= 1_000 + largest,
                "{spent} tokens of a 1,000 budget ({answered} answered, each up to {largest})"
            );
            return;
        }
        // Nothing is left by some data plane's count, not yet by the
        // roll-up's: it counts what it used until the roll-up can show it.
        tokio::time::sleep(Duration::from_secs(retry_after.clamp(1, 2))).await;
    }
    panic!("the budget was never spent: {answered} answered");
}

/// One data plane of the simulation below: its ledger and parts, and its
/// requests in flight, each with what it will use and when it ends.
struct SimPlane {
    id: String,
    ledger: std::sync::Arc<inferyes_dataplane::usage::Ledger>,
    allowances: inferyes_dataplane::allowance::Allowances,
    sequence: u64,
    in_flight: Vec<(inferyes_dataplane::usage::Hold, u64, std::time::Instant)>,
}

#[test]
fn a_budget_split_among_data_planes_is_overrun_by_one_request_at_most() {
    // The split whole, without the network: four data planes' ledgers and
    // parts, one controller's books (started over once), a roll-up that
    // shows acknowledged usage up to 1.5 s late, answers lost at random,
    // requests of every size, long ones at once and short ones one after
    // another. However they fall, the key spends its budget and passes it
    // by at most one request's tokens.
    use inferyes_controller::allowances::{Books, Budget, Limits, Report};
    use inferyes_dataplane::usage::{Ledger, Unheld};
    const BUDGET: u64 = 20_000;
    const LARGEST: u64 = 900;
    let key =
        inferyes_proto::v1::ApiKey { key_id: "keyaaaaaaaaa".into(), tokens_per_day: BUDGET, ..Default::default() };
    fastrand::seed(7);
    let start = std::time::Instant::now();
    let mut planes: Vec<SimPlane> = (0..DATA_PLANES)
        .map(|i| SimPlane {
            id: format!("dp-{i}"),
            ledger: Ledger::new(&format!("dp-{i}"), false),
            allowances: Default::default(),
            sequence: 0,
            in_flight: Vec::new(),
        })
        .collect();
    for plane in &planes {
        plane.allowances.expect(1);
    }
    let mut books = Books::default();
    // What the roll-up shows, and what it will show when.
    let (mut rolled_up, mut rolling): (u64, Vec<(std::time::Instant, u64)>) = (0, Vec::new());
    let (mut used, mut largest_use, mut admitted, mut refused_for_parts) = (0u64, 0u64, 0u32, 0u32);
    for step in 0..6_000u64 {
        let now = start + Duration::from_millis(50 * step);
        if step == 2_000 {
            books = Books::default();
        }
        rolling.retain(|&(at, tokens)| {
            let due = at <= now;
            rolled_up += if due { tokens } else { 0 };
            !due
        });
        let limits = |key_id: &str| {
            (key_id == key.key_id).then_some(Limits {
                tokens: Some(Budget { per_day: BUDGET, left: BUDGET.saturating_sub(rolled_up) }),
                ..Limits::default()
            })
        };
        for (i, plane) in planes.iter_mut().enumerate() {
            // Requests that end give back their holds, with what they used.
            let (ended, running): (Vec<_>, Vec<_>) = plane.in_flight.drain(..).partition(|(_, _, end)| *end <= now);
            plane.in_flight = running;
            for (hold, uses, _) in ended {
                let record = inferyes_proto::v1::UsageRecord {
                    key_id: key.key_id.clone(),
                    model: "chat".into(),
                    unix_ms: inferyes_proto::unix_ms(),
                    prompt_tokens: uses,
                    ..Default::default()
                };
                plane.ledger.record(record, hold);
                used += uses;
            }
            // Usage goes out every 300 ms and is acknowledged at once; the
            // roll-up shows it up to 1.5 s later.
            if (step + i as u64).is_multiple_of(6)
                && let Some(batch) = plane.ledger.next_batch(usize::MAX)
            {
                plane.ledger.acknowledged(&batch, now);
                let tokens = batch.deltas.iter().filter_map(|d| d.usage).map(|u| u.prompt_tokens).sum();
                rolling.push((now + Duration::from_millis(fastrand::u64(0..1_500)), tokens));
            }
            // A report a second, each data plane in turn.
            if (step + 5 * i as u64).is_multiple_of(20) {
                let forget_before = plane.allowances.forget_acknowledged_before(now);
                let part = plane.allowances.budget(&key, rolled_up > 0);
                let holdings = plane.ledger.holdings(|_| Some(part), forget_before);
                let demand = plane.allowances.demand(&[], &holdings);
                plane.sequence += 1;
                let held = plane.allowances.held(0);
                let report = Report {
                    dataplane: &plane.id,
                    instance: 1,
                    sequence: plane.sequence,
                    demand: &demand,
                    held: held.as_ref(),
                };
                let answer = match books.report(&report, limits, now) {
                    Ok(()) => books.allowances(&plane.id, limits, (rolled_up > 0).then_some(key.key_id.as_str()), now),
                    Err(_) => Some(inferyes_controller::allowances::nothing()),
                };
                // One answer in eight is lost.
                if fastrand::u8(..8) > 0 {
                    plane.allowances.take(0, answer, now, now);
                }
            }
            // Requests of every size: short ones one after another on the
            // first data plane (which holds the overdraft while no other
            // asks for it more), long ones at once on the others.
            let (serial, asks) = (i == 0, fastrand::usize(0..3));
            for _ in 0..if serial { usize::from(plane.in_flight.is_empty()) } else { asks } {
                let tokens = fastrand::u64(50..=LARGEST);
                let before = plane.allowances.forget_acknowledged_before(now);
                let part = plane.allowances.budget(&key, rolled_up > 0);
                match plane.ledger.hold(&key.key_id, (BUDGET, rolled_up), tokens, part, before) {
                    Ok(hold) => {
                        admitted += 1;
                        let lasts = Duration::from_millis(if serial { 100 } else { fastrand::u64(2_000..8_000) });
                        // What it uses: far less than it may (its output
                        // limit is an upper bound).
                        let uses = fastrand::u64(tokens / 10..=tokens / 4);
                        largest_use = largest_use.max(uses);
                        plane.in_flight.push((hold, uses, now + lasts));
                    }
                    Err(Unheld::PartHeld { tokens, .. }) => {
                        refused_for_parts += 1;
                        plane.allowances.refused_tokens(&key.key_id, tokens);
                    }
                    Err(Unheld::Spent(_)) => {}
                }
            }
        }
        let in_flight: u64 = planes.iter().map(|plane| will_use(&plane.in_flight)).sum();
        assert!(
            used + in_flight <= BUDGET + largest_use,
            "step {step}: {used} used and {in_flight} in flight of a budget of {BUDGET}, each using up to {largest_use}"
        );
    }
    assert!(used + largest_use > BUDGET, "the budget is spent: {used} of {BUDGET}");
    assert!(admitted > 40 && refused_for_parts > 0, "{admitted} admitted, {refused_for_parts} refused for parts");
}

/// What requests in flight will use.
fn will_use(in_flight: &[(inferyes_dataplane::usage::Hold, u64, std::time::Instant)]) -> u64 {
    in_flight.iter().map(|(_, uses, _)| uses).sum()
}
