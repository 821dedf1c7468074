//! How long a valid key's first check takes amid a flood of wrong secrets,
//! against the same check alone, side by side in one run.
//!
//! ```sh
//! cargo bench -p inferyes-dataplane --bench auth
//! ```
//!
//! Each sample is a data plane's first sight of the valid key (a fresh
//! [`Auth`]), with 64 wrong secrets sent just before it: for one key id from
//! the valid key's own address (one client behind a balancer), for one key
//! id from 64 addresses, and for 64 key ids from one address (each key id's
//! first wrong secret is a fresh check, the worst case). The flood's checks
//! run out between samples, outside the timing. After criterion's runs, the
//! median of each case is printed as a multiple of the check alone.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::Criterion;
use http::{HeaderMap, HeaderValue, header};
use inferyes_dataplane::auth::{Auth, AuthMode};
use inferyes_dataplane::snapshot::RoutingSnapshot;
use inferyes_proto::apikey;
use inferyes_proto::v1::ApiKey;

const FLOOD: usize = 64;

struct Fleet {
    snapshot: RoutingSnapshot,
    valid: String,
    /// Key ids the flood guesses at.
    guessed: Vec<String>,
}

fn fleet() -> Fleet {
    let keys: Vec<_> = (0..=FLOOD).map(|_| apikey::generate().expect("a key")).collect();
    let records = keys.iter().map(|key| ApiKey {
        key_id: key.key_id.clone(),
        secret_hash: key.secret_hash.clone(),
        ..Default::default()
    });
    Fleet {
        snapshot: RoutingSnapshot::default().with_api_keys(records),
        valid: keys[0].token.clone(),
        guessed: keys[1..].iter().map(|key| key.key_id.clone()).collect(),
    }
}

fn bearer(token: &str) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert(header::AUTHORIZATION, HeaderValue::from_str(&format!("Bearer {token}")).expect("a header"));
    headers
}

#[derive(Clone, Copy)]
enum Flood {
    None,
    OneKeyOneAddress,
    OneKeyManyAddresses,
    ManyKeysOneAddress,
}

/// One sample: the valid key's first check, timed, amid `flood`; then
/// waits for the flood's checks to run out.
async fn sample(fleet: &Arc<Fleet>, flood: Flood) -> Duration {
    let auth = Arc::new(Auth::new(AuthMode::Keys, 10));
    let own = IpAddr::from([192, 0, 2, 1]);
    let mut guesses = tokio::task::JoinSet::new();
    for i in 0..FLOOD {
        let (key_id, client) = match flood {
            Flood::None => break,
            Flood::OneKeyOneAddress => (&fleet.guessed[0], own),
            Flood::OneKeyManyAddresses => (&fleet.guessed[0], IpAddr::from([198, 51, 100, i as u8])),
            Flood::ManyKeysOneAddress => (&fleet.guessed[i], own),
        };
        let letter = |n: usize| char::from(b'a' + (n % 26) as u8);
        let guess = bearer(&format!("ify_{key_id}_{}{}{}", "a".repeat(30), letter(i / 26), letter(i)));
        let (auth, fleet) = (Arc::clone(&auth), Arc::clone(fleet));
        guesses.spawn(async move { auth.authenticate(&guess, client, &fleet.snapshot).await.is_ok() });
    }
    // The flood reaches the queue first.
    tokio::time::sleep(Duration::from_millis(5)).await;
    let started = Instant::now();
    let served = auth.authenticate(&bearer(&fleet.valid), own, &fleet.snapshot).await.is_ok();
    let took = started.elapsed();
    assert!(served, "the valid key is served");
    assert!(!guesses.join_all().await.contains(&true), "no guess is served");
    took
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("a runtime");
    let fleet = Arc::new(fleet());
    let mut criterion = Criterion::default().configure_from_args().sample_size(10);
    let mut group = criterion.benchmark_group("first check of a valid key");
    group.measurement_time(Duration::from_secs(5)).warm_up_time(Duration::from_millis(500));
    let cases = [
        ("alone", Flood::None),
        ("amid 64 guesses at one key from its address", Flood::OneKeyOneAddress),
        ("amid 64 guesses at one key from 64 addresses", Flood::OneKeyManyAddresses),
        ("amid 64 guesses at 64 keys from its address", Flood::ManyKeysOneAddress),
    ];
    let mut medians = Vec::new();
    for (name, flood) in cases {
        let mut times = Vec::new();
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let took = runtime.block_on(sample(&fleet, flood));
                    times.push(took);
                    total += took;
                }
                total
            })
        });
        times.sort();
        medians.push((name, times[times.len() / 2]));
    }
    group.finish();
    let alone = medians[0].1.as_secs_f64();
    println!("\nmedian first check, as a multiple of the check alone ({:.1} ms):", alone * 1e3);
    for (name, median) in &medians {
        println!("  {name:<48} {:>6.1} ms  {:>5.2}x", median.as_secs_f64() * 1e3, median.as_secs_f64() / alone);
    }
}
