//! What one data plane's report costs the controller it reaches: taking
//! what its keys asked, and weighing every key some data plane asked of
//! against every data plane for its answer. Data planes report every
//! second, so a controller spends this, times the data planes, each second.
//!
//! ```sh
//! cargo bench -p inferyes-controller --bench allowances
//! ```

use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion};
use inferyes_controller::allowances::{Books, Budget, Limits, Report};
use inferyes_proto::v1::{Allowances, KeyDemand};

/// A key id of the key alphabet for `i`.
fn key_id(i: usize) -> String {
    let mut id = String::new();
    let mut n = i;
    for _ in 0..12 {
        id.push(char::from(b'a' + u8::try_from(n % 26).expect("a letter")));
        n /= 26;
    }
    id
}

/// Limits of requests: the parts of keys asked evenly are even, and no
/// answer lists them.
fn requests(_: &str) -> Option<Limits> {
    Some(Limits { requests_per_minute: 600, max_concurrent: 16, tokens: None })
}

/// Limits of requests and a daily budget: every answer lists every key.
fn budgets(_: &str) -> Option<Limits> {
    Some(Limits { tokens: Some(Budget { per_day: 10_000_000, left: 5_000_000 }), ..requests("")? })
}

/// Books past their warm-up, each of `dataplanes` data planes having
/// asked of every one of `keys` keys and taken its answer.
fn books(
    dataplanes: usize,
    keys: usize,
    limits: fn(&str) -> Option<Limits>,
) -> (Books, Vec<KeyDemand>, Vec<Option<Allowances>>, Instant) {
    let demand: Vec<KeyDemand> = (0..keys)
        .map(|i| KeyDemand { key_id: key_id(i), asked: 3, in_flight: 1, tokens_held: 4_000, ..KeyDemand::default() })
        .collect();
    let mut books = Books::default();
    let start = Instant::now();
    let mut held = vec![None; dataplanes];
    for round in 0..8u64 {
        let now = start + Duration::from_secs(round);
        for (i, held) in held.iter_mut().enumerate() {
            let id = format!("dp-{i}");
            let report =
                Report { dataplane: &id, instance: 1, sequence: round + 1, demand: &demand, held: held.as_ref() };
            books.report(&report, limits, now).expect("taken");
            *held = books.allowances(&id, limits, [], now);
        }
    }
    (books, demand, held, start + Duration::from_secs(8))
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("report");
    group.sample_size(10).measurement_time(Duration::from_secs(5));
    let cases = [(4, 100), (4, 4096), (32, 100), (32, 4096)];
    for ((dataplanes, keys), (limits, name)) in cases
        .into_iter()
        .flat_map(|case| [(case, (requests as fn(&str) -> Option<Limits>, "requests")), (case, (budgets, "budgets"))])
    {
        let (mut books, demand, mut held, mut now) = books(dataplanes, keys, limits);
        // Each data plane in turn, each once a second, as they report.
        let (mut turn, mut sequence) = (0usize, 100u64);
        let step = Duration::from_secs(1) / u32::try_from(dataplanes).expect("a few");
        group.bench_function(
            BenchmarkId::new(format!("{dataplanes} data planes"), format!("{keys} keys, {name}")),
            |b| {
                b.iter(|| {
                    turn = (turn + 1) % dataplanes;
                    if turn == 0 {
                        sequence += 1;
                    }
                    now += step;
                    let id = format!("dp-{turn}");
                    let report =
                        Report { dataplane: &id, instance: 1, sequence, demand: &demand, held: held[turn].as_ref() };
                    books.report(&report, limits, now).expect("taken");
                    held[turn] = books.allowances(&id, limits, [], now);
                });
            },
        );
    }
    group.finish();
}

fn main() {
    let mut criterion = Criterion::default().configure_from_args();
    bench(&mut criterion);
    criterion.final_summary();
}
