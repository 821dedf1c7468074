"""Draining a node on real llama-server nodes serving Gemma 3 270M, with its
conversations' caches moved and without. Three nodes; conversations with
long histories begin on node-a (the others drained meanwhile), take a
second turn there, then node-a is drained and each takes a third turn on
the node that has it now. With moves on, the drain carries each slot to
another node first; with them off (the agents name no slot directory),
the third turn recomputes the history. The two runs use two fleets, one
after the other, on the same machine.

Reported per conversation: the prompt read from cache on its new node,
its time to first token there against on node-a and against the
recompute; and per 1,000 tokens, what a move cost (save, transfer,
restore, from the agents' logs) against the prefill rate.

    scripts/bench-drain.sh [--conversations 6 --tokens 1500]
"""

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from openai import OpenAI

from bench_chat import COLOURS, MODEL, WORDS
from harness import GEMMA_TEMPLATE, Fleet, http_get, llama_server, real_model, wait_until

NODES = ("node-a", "node-b", "node-c")


def history(rng, tokens):
    """A system prompt of about `tokens` tokens no cache holds a prefix of."""
    # About eight tokens an entry, as Gemma's tokenizer reads them.
    words = [f"{rng.choice(COLOURS)} {rng.choice(WORDS)} {rng.randrange(10_000)}" for _ in range(tokens // 8)]
    return f"Notebook {rng.random()}: " + ", ".join(words)


def turn(client, messages, text):
    """One streamed turn: its node, time to first token (s), usage and the
    server's timings."""
    messages.append({"role": "user", "content": text})
    started = time.monotonic()
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True})
    node, ttft, reply, usage, timings = raw.headers["x-inferyes-node"], None, "", None, {}
    for chunk in raw.parse():
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft or time.monotonic() - started
            reply += chunk.choices[0].delta.content
        usage = chunk.usage or usage
        timings = (chunk.model_extra or {}).get("timings") or timings
    messages.append({"role": "assistant", "content": reply or "."})
    return node, ttft or time.monotonic() - started, usage, timings


def fleet_for(tmp, args, moves):
    fleet = Fleet(tmp)
    fleet.llama_server = llama_server()
    fleet.model = real_model()
    fleet.start_etcd()
    fleet.start_controller()
    context = args.slots * 2048
    for node in NODES:
        slots = tmp / f"slots-{node}"
        slots.mkdir()
        server = ["-np", str(args.slots), "--chat-template-file", str(GEMMA_TEMPLATE), "--swa-full",
                  "--slot-save-path", f"{slots}/"]
        url = fleet.start_llama_server(f"gemma-{node}", fleet.model, MODEL, server, context=context)
        extra = f'\n[backends.slots]\ndir = "{slots}"\nflags = "--swa-full"\n' if moves else ""
        fleet.start_agent(node, [("chat", url, ["chat"], extra)], settings='log_format = "json"')
    fleet.url = fleet.start_dataplane("dataplane", "policy", {MODEL: len(NODES)})
    return fleet


def moved_lines(fleet):
    """The drained agent's log lines for each move."""
    lines = (fleet.logs / "agent-node-a.log").read_text().splitlines()
    events = [json.loads(line) for line in lines if line.startswith("{")]
    return [e["fields"] for e in events if e.get("fields", {}).get("message") == "drain: conversation moved"]


def run(args, moves):
    tmp = Path(tempfile.mkdtemp(prefix=f"inferyes-bench-drain-{'on' if moves else 'off'}-"))
    fleet = fleet_for(tmp, args, moves)
    try:
        client = OpenAI(base_url=f"{fleet.url}/v1", api_key=fleet.api_key, max_retries=0, timeout=600)
        for node in NODES[1:]:
            fleet.ctl("drain", node)
        fleet.wait_routing()
        rng = random.Random(args.seed)
        conversations = [[{"role": "system", "content": history(rng, args.tokens)}] for _ in range(args.conversations)]
        rows = []
        for messages in conversations:
            first = turn(client, messages, "Which colour comes first?")
            second = turn(client, messages, "And which comes next?")
            assert first[0] == second[0] == "node-a", (first, second)
            rows.append({"prefill_per_second": first[3].get("prompt_per_second", 0.0), "ttft_home": second[1]})
        for node in NODES[1:]:
            fleet.ctl("undrain", node)
        fleet.wait_routing()
        wait_until("the conversations resident on node-a",
                   lambda: sum(s["node"] == "node-a" for s in fleet.ctl("sessions")["sessions"]) == len(conversations))
        started = time.monotonic()
        fleet.ctl("drain", "node-a")
        fleet.wait_routing()
        progress = None
        if moves:
            def done():
                state = fleet.ctl("node", "node-a")["moves"]
                return state if state and state["finished_unix_ms"] else None

            progress = wait_until("the drain's moves", done, timeout=300)
            wait_until("the moved conversations resident elsewhere",
                       lambda: sum(s["node"] == "node-a" for s in fleet.ctl("sessions")["sessions"])
                       == progress["not_movable"] + progress["failed"])
        drain_seconds = time.monotonic() - started
        for row, messages in zip(rows, conversations):
            node, ttft, usage, _ = turn(client, messages, "And the one after that?")
            row.update(node=node, ttft_after=ttft, prompt=usage.prompt_tokens,
                       cached=usage.prompt_tokens_details.cached_tokens)
        return {"rows": rows, "progress": progress, "moves": moved_lines(fleet) if moves else [],
                "drain_seconds": drain_seconds}
    finally:
        fleet.stop()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=1500, help="each conversation's history, about")
    parser.add_argument("--slots", type=int, default=6, help="slots per node (2,048 tokens each)")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    on, off = run(args, moves=True), run(args, moves=False)

    print(f"\nDrain of node-a: {args.conversations} conversations of ~{args.tokens} tokens, "
          f"3 nodes x {args.slots} slots, Gemma 3 270M, one thread per server\n")
    print("| conv | new node (moved) | cached | TTFT on node-a | TTFT moved | x node-a | "
          "new node (off) | cached | TTFT recomputed | moved / recomputed |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for i, (a, b) in enumerate(zip(on["rows"], off["rows"])):
        print(f"| {i} | {a['node']} | {a['cached'] / a['prompt']:.1%} | {a['ttft_home'] * 1000:.0f} ms | "
              f"{a['ttft_after'] * 1000:.0f} ms | {a['ttft_after'] / a['ttft_home']:.2f}x | {b['node']} | "
              f"{b['cached'] / b['prompt']:.1%} | {b['ttft_after'] * 1000:.0f} ms | "
              f"{a['ttft_after'] / b['ttft_after']:.2f}x |")
    p = on["progress"]
    print(f"\nmoves: {p['moved']} moved, {p['failed']} failed, {p['not_movable']} not movable, "
          f"{p['bytes'] / 1e6:.1f} MB in {(p['finished_unix_ms'] - p['started_unix_ms']) / 1000:.2f} s "
          f"(drain to routed: {on['drain_seconds']:.1f} s)")
    moves = on["moves"]
    if moves:
        per_k = lambda key: 1000 * sum(m[key] for m in moves) / sum(m["tokens"] for m in moves)  # noqa: E731
        save, restore, total = per_k("save_ms"), per_k("restore_ms"), per_k("total_ms")
        prefill = sum(r["prefill_per_second"] for r in on["rows"]) / len(on["rows"])
        mb_per_k = 1000 * sum(m["bytes"] for m in moves) / sum(m["tokens"] for m in moves) / 1e6
        print(f"per 1,000 tokens: {mb_per_k:.1f} MB; save {save:.1f} ms, restore {restore:.1f} ms, "
              f"whole move {total:.1f} ms (transfer and checks: {total - save - restore:.1f} ms); "
              f"prefill {1e6 / prefill:.0f} ms ({prefill:.0f} tokens/s): a move is "
              f"{(1e6 / prefill) / total:.0f}x faster")
    worst_cached = min(r["cached"] / r["prompt"] for r in on["rows"])
    worst_home = max(r["ttft_after"] / r["ttft_home"] for r in on["rows"])
    worst_recompute = max(a["ttft_after"] / b["ttft_after"] for a, b in zip(on["rows"], off["rows"]))
    print(f"\nworst: cached {worst_cached:.1%} (target >= 90%), TTFT {worst_home:.2f}x node-a's (<= 2), "
          f"{worst_recompute:.2f}x the recompute's (<= 0.25)")
    return 0 if worst_cached >= 0.9 and worst_home <= 2 and worst_recompute <= 0.25 else 1


if __name__ == "__main__":
    sys.exit(main())
