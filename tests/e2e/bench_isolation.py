"""Isolation under a flood, on real llama-server nodes serving Gemma 3 270M:
what one tenant's backlog costs another's requests. Tenant A keeps many
long-prompt streams in flight (four times the fleet's slots by default);
tenant B sends one short chat at a time. B's time to first token is
measured idle and under A's flood, through a data plane with its queue on
and then through one with it off (`queue = false`: the servers' own queues
decide who waits), on the same fleet, its servers restarted in between.

    scripts/bench-isolation.sh [--nodes 2 --slots 2 --streams 16 --seconds 60]

The simulated fleet's version, at the issue's full scale, is
`cargo bench -p inferyes-tests --bench isolation`.
"""

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

from openai import OpenAI

from bench_chat import COLOURS, KV_BYTES_PER_TOKEN, MODEL, WORDS, percentile
from harness import GEMMA_ARGS, Fleet, http_get, llama_server, real_model, wait_until


def document(rng, tokens):
    """About `tokens` tokens of text no cache holds a prefix of."""
    words = [f"{rng.choice(COLOURS)} {rng.choice(WORDS)} {rng.randrange(10_000)}" for _ in range(tokens // 5)]
    return f"Request {rng.random()}: summarise this. " + ", ".join(words)


def first_token(client, text, max_tokens):
    """Seconds to the first content chunk of a streamed chat."""
    started = time.monotonic()
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}],
                                            max_tokens=max_tokens, temperature=0, stream=True)
    ttft = None
    for chunk in stream:
        if ttft is None and chunk.choices and chunk.choices[0].delta.content:
            ttft = time.monotonic() - started
    return ttft if ttft is not None else time.monotonic() - started


def complete(client, text, max_tokens):
    """A streamed chat, read to its end."""
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}],
                                            max_tokens=max_tokens, temperature=0, stream=True)
    for _ in stream:
        pass


def light(client, seconds):
    """B's chats, one at a time, for `seconds`: their times to first token."""
    until, ttfts, i = time.monotonic() + seconds, [], 0
    while time.monotonic() < until:
        i += 1
        ttfts.append(first_token(client, f"Light question {i}: what colour is the sky?", 8))
    return ttfts


def run(fleet, url, keys, args, label):
    heavy = OpenAI(base_url=f"{url}/v1", api_key=keys["heavy"], max_retries=0, timeout=900)
    light_client = OpenAI(base_url=f"{url}/v1", api_key=keys["light"], max_retries=0, timeout=900)
    idle = light(light_client, args.idle_seconds)
    stop, served, ended, failed = threading.Event(), [], [], []

    def stream(s):
        rng = random.Random(f"{args.seed}-{label}-{s}")
        while not stop.is_set():
            started = time.monotonic()
            try:
                # The whole stream: a slot is held until its last token.
                complete(heavy, document(rng, args.prompt_tokens), args.max_tokens)
                served.append(time.monotonic() - started)
                ended.append(time.monotonic())
            except Exception:  # noqa: BLE001 - counted: a refusal or a cut stream
                failed.append(1)

    threads = [threading.Thread(target=stream, args=(s,), daemon=True) for s in range(args.streams)]
    for thread in threads:
        thread.start()
    # Until every slot is taken and the backlog has formed.
    time.sleep(args.warmup_seconds)
    flood_started = time.monotonic()
    flooded = light(light_client, args.seconds)
    flood_ended = time.monotonic()
    stop.set()
    for thread in threads:
        thread.join(timeout=900)
    # How long a slot held one of A's requests: the fleet's slots times the
    # flood's length over A's requests that ended in it. B's bound is its
    # idle p90 plus one of those (one slot to free, never A's backlog).
    in_flood = sum(flood_started <= t <= flood_ended for t in ended)
    slot_s = args.nodes * args.slots * (flood_ended - flood_started) / max(1, in_flood)
    return {"data plane": label, "idle": idle, "flooded": flooded, "heavy_served": len(served),
            "heavy_failed": len(failed), "heavy_request_p50_s": percentile(served, 50) if served else 0.0,
            "heavy_service_s": slot_s}


def restart_servers(fleet, args):
    for node in fleet.nodes:
        process = fleet.servers[f"gemma-{node}"]
        process.terminate()
        process.wait(timeout=30)
        start_server(fleet, node, args, port=int(fleet.llama[node].rsplit(":", 1)[1]))


def start_server(fleet, node, args, port=None):
    return fleet.start_llama_server(f"gemma-{node}", fleet.model, MODEL, fleet.llama_args, port=port,
                                    context=args.slots * args.context, cache_ram=args.cache_ram)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--slots", type=int, default=2, help="slots per llama-server")
    parser.add_argument("--context", type=int, default=2048, help="tokens per slot")
    parser.add_argument("--cache-ram", type=int, default=0, help="llama-server --cache-ram, MiB")
    parser.add_argument("--streams", type=int, default=0, help="A's streams in flight (default: 4x the slots)")
    parser.add_argument("--prompt-tokens", type=int, default=400, help="A's prompts, about")
    parser.add_argument("--max-tokens", type=int, default=16, help="A's answers")
    parser.add_argument("--seconds", type=float, default=60, help="B's requests under the flood, for this long")
    parser.add_argument("--idle-seconds", type=float, default=10)
    parser.add_argument("--warmup-seconds", type=float, default=15)
    parser.add_argument("--seed", default="isolation")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    args.streams = args.streams or 4 * args.nodes * args.slots

    fleet = Fleet(Path(tempfile.mkdtemp(prefix="inferyes-bench-isolation-")))
    results = []
    try:
        fleet.llama_server = llama_server()
        fleet.model = real_model()
        fleet.start_etcd()
        fleet.start_controller()
        fleet.llama_args = ["-np", str(args.slots), *GEMMA_ARGS]
        fleet.nodes = [f"node-{chr(ord('a') + i)}" for i in range(args.nodes)]
        fleet.llama = {}
        for node in fleet.nodes:
            fleet.llama[node] = start_server(fleet, node, args)
            host_cache = args.cache_ram * 1024 * 1024 // KV_BYTES_PER_TOKEN
            fleet.start_agent(node, [("chat", fleet.llama[node], ["chat", "completion"],
                                      f"host_cache_tokens = {host_cache}\n")])
        urls = {"queue on": fleet.start_dataplane("dataplane-queue", "policy", {MODEL: args.nodes}),
                "queue off": fleet.start_dataplane("dataplane-no-queue", "policy", {MODEL: args.nodes},
                                                   extra="queue = false")}
        keys = {t: fleet.ctl("keys", "create", t, "--tenant", t)["secret"] for t in ("heavy", "light")}
        auth = {"Authorization": f"Bearer {keys['light']}"}
        for url in urls.values():
            wait_until("the keys", lambda u=url: http_get(f"{u}/v1/models", headers=auth)[0] == 200)
        for i, (label, url) in enumerate(urls.items()):
            if i:
                restart_servers(fleet, args)
            print(f"running with the {label}...", file=sys.stderr, flush=True)
            results.append(run(fleet, url, keys, args, label))
    finally:
        fleet.stop()
    print(f"\n{args.nodes} nodes x {args.slots} slots; tenant A keeps {args.streams} streams of ~{args.prompt_tokens} "
          f"prompt tokens and {args.max_tokens} answer tokens in flight; tenant B one short chat at a time\n")
    print("| data plane | B idle p50 | B idle p90 | B flooded p50 | B flooded p90 | B flooded max | B served "
          "| A served (failed) | A request p50 | A's service | within the bound |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in results:
        ms = lambda s: f"{1000 * s:,.0f} ms"  # noqa: E731
        bound = percentile(r['idle'], 90) + r['heavy_service_s']
        p90 = percentile(r['flooded'], 90)
        within = f"yes ({ms(bound)})" if p90 <= bound else f"no, {p90 / bound:.1f}x ({ms(bound)})"
        print(f"| {r['data plane']} | {ms(percentile(r['idle'], 50))} | {ms(percentile(r['idle'], 90))} "
              f"| {ms(percentile(r['flooded'], 50))} | {ms(p90)} "
              f"| {ms(max(r['flooded']))} | {len(r['flooded'])} | {r['heavy_served']} ({r['heavy_failed']}) "
              f"| {ms(r['heavy_request_p50_s'])} | {ms(r['heavy_service_s'])} | {within} |")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": results},
                                        indent=2))


if __name__ == "__main__":
    main()
