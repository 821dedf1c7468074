"""Multi-turn chats on real llama-server nodes serving Gemma 3 270M, through
three data planes side by side on one fleet: policy routing, round-robin and
least-outstanding. What it measures is what routing is for: whether a later
turn finds its conversation's KV cache where it is sent.

    scripts/bench-chat.sh [options]        # builds what it needs, then runs this

Each policy gets a workload of the same shape, with conversations of its own
(the agents' residency records outlive a server restart, so a policy run
after another must not meet that one's sessions) on freshly restarted servers
(so none is helped or slowed by another's caches). A conversation is a long distinct system prompt and a
few turns; each turn is streamed with the official OpenAI client and
`stream_options.include_usage`. Reported per policy:

- time to first token (first content chunk), p50 and p99, of first turns and
  of later turns;
- KV reuse against an oracle: a later turn can at best reuse the previous
  turn's prompt plus reply; reuse is the sum of `cached_tokens` (each capped
  at that) over the sum of that;
- session moves: later turns served by another node than the turn before;
- the wall time of the whole workload.

--move-caches starts every server with --slot-save-path and names it to its
agent, so a later turn whose home is busy may have its cache carried to a
free slot elsewhere (route `carried`); the `policy-no-carry` data plane
routes by the same policy with carrying off (`carry = false`), on the same
fleet, for the side-by-side: how many turns were carried, and what that did
to later turns' time to first token.

--concurrent runs every conversation as its own user, all at once, each
sending its next turn as soon as the last is answered; without it, turns go
one at a time, interleaved across conversations (turn 1 of each, then turn 2
of each...). With --arrivals S the users start S seconds apart, and with
--think S each waits S seconds between a reply and its next turn: real
conversations arriving over time rather than a burst.

--compare-tier (with --move-caches) runs each Inferyes row twice, with the
agents' KV tiers on (the default: each turn's slot saved to disk when it
ends, restored when its conversation returns to a slot that lost it) and
as `<row>-no-tier` with them off, the agents restarted between: what the
tier does to later turns, side by side. With a small --cache-ram and more
conversations than slots, turns taken one at a time come back in the worst
order for the servers' own least-recently-used host caches.

`smg` in --strategies adds a row for the Shepherd Model Gateway (`pip
install smg==1.13.0`: scripts/bench-chat.sh installs it in the benchmark's
environment when asked), given the llama-server URLs directly with its
`cache_aware` policy: the best text-prefix router, on the same nodes.
--routers N gives each row N routers behind a round-robin balancer: N data
planes, or N SMG instances with their mesh on; the load generator deals
each request to the next router in turn, so a conversation's turns go
through whichever router the requests of all users leave it (the turns
record which: `router`, and each row how many later turns changed
router: `router_switches`).
--repeat N runs every row N times, the order reversed each time (A B, B A,
A B...), each run with conversations of its own on freshly restarted
servers, and reports each row's mean and spread (min-max).
"""

import argparse
import itertools
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from openai import OpenAI

from harness import GEMMA_ARGS, Fleet, free_port, http_get, llama_server, real_model, wait_until

MODEL = "gemma-3-270m"
STRATEGIES = ("policy", "round-robin", "least-outstanding")
# Rows routed by another router, given the servers directly.
PEERS = ("smg",)
SMG_VERSION = "1.13.0"
# Data planes that route by a strategy with settings of their own.
VARIANTS = {"policy-no-carry": ("policy", "carry = false")}
# Gemma 3 270M keeps 18 KiB of KV cache per token (18 layers, one KV head of
# 256, f16 keys and values): what --cache-ram holds, in tokens.
KV_BYTES_PER_TOKEN = 18 * 1024
# Each agent's KV tier, where it has one: far more than a run keeps.
TIER_BYTES = 16 << 30
NO_TIER = "-no-tier"
WORDS = ("stone river path lantern harbour orchard bridge meadow tower garden valley forest island "
         "mountain village market castle temple desert canyon glacier lagoon cavern summit").split()
COLOURS = "red amber green blue violet grey white black silver golden".split()


def system_prompt(rng, tokens):
    """A distinct system prompt of about `tokens` tokens (Gemma's tokenizer
    makes about 18 tokens of each rule)."""
    rules = []
    for i in range(max(1, tokens // 18)):
        rules.append(f"Rule {i}: the {rng.choice(COLOURS)} {rng.choice(WORDS)} {rng.randrange(1000)} "
                     f"faces the {rng.choice(COLOURS)} {rng.choice(WORDS)}.")
    return "You keep the atlas of a country. " + " ".join(rules)


def percentile(values, p):
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(p / 100 * len(ordered) + 0.5)) - 1))]


class Conversation:
    def __init__(self, name, system):
        self.name = name
        self.messages = [{"role": "system", "content": system}]
        self.turns = []

    def turn(self, balancer, index, max_tokens):
        router, client = balancer.pick()
        self.messages.append({"role": "user", "content": f"Question {index}: where does the next road lead?"})
        started = time.monotonic()
        first, text, usage, last = None, "", None, None
        # Read as SSE lines, not the client's parsed chunks: a stream that
        # waited in the data plane's queue names its node in a comment.
        with client.chat.completions.with_streaming_response.create(
                model=MODEL, messages=self.messages, max_tokens=max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True}) as response:
            node, route = response.headers.get("x-inferyes-node"), response.headers.get("x-inferyes-route")
            for line in response.iter_lines():
                if line.startswith(": sent to node "):
                    node = line.split()[4]
                # Every event is one `data: ` line, as llama-server writes them.
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                last = line
                chunk = json.loads(line[len("data: "):])
                if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                    if first is None:
                        first = time.monotonic() - started
                    text += chunk["choices"][0]["delta"]["content"]
                if chunk.get("usage"):
                    usage = chunk["usage"]
        if usage is None:
            raise RuntimeError(f"{self.name} turn {index}: the stream ended without usage: {last}")
        self.messages.append({"role": "assistant", "content": text})
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        self.turns.append({
            "conversation": self.name, "turn": index, "node": node, "route": route, "router": router,
            "ttft_s": first if first is not None else time.monotonic() - started,
            "seconds": time.monotonic() - started, "prompt_tokens": usage["prompt_tokens"],
            "completion_tokens": usage["completion_tokens"], "cached_tokens": cached,
        })


def summarize(strategy, conversations, wall):
    first, later, moves, reused, best, switches = [], [], 0, 0, 0, 0
    for conversation in conversations:
        for previous, turn in zip([None] + conversation.turns, conversation.turns):
            if previous is None:
                first.append(turn["ttft_s"])
                continue
            later.append(turn["ttft_s"])
            moves += turn["node"] != previous["node"]
            switches += turn["router"] != previous["router"]
            oracle = previous["prompt_tokens"] + previous["completion_tokens"]
            best += oracle
            reused += min(turn["cached_tokens"], oracle)
    if all(turn["node"] is None for c in conversations for turn in c.turns):
        moves = None  # a router that does not say which node answered
    return {
        "strategy": strategy,
        "first_ttft_p50_ms": 1000 * percentile(first, 50), "first_ttft_p99_ms": 1000 * percentile(first, 99),
        "later_ttft_p50_ms": 1000 * percentile(later, 50), "later_ttft_p99_ms": 1000 * percentile(later, 99),
        "kv_reuse_of_oracle": reused / best if best else None, "session_moves": moves,
        # Later turns that went through another router than the turn before.
        "router_switches": switches,
        "later_turns": len(later), "wall_s": wall,
    }


class RoundRobin:
    """A round-robin balancer in front of a row's routers: each request
    goes to the next one in turn, whichever conversation it is of, so
    which router a conversation's next turn meets falls as the requests
    of all users come. (Turns taken one at a time, with as many
    conversations as a multiple of the routers, each keep to one.)"""

    def __init__(self, urls, api_key):
        self.clients = [OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=600) for url in urls]
        self.turns = itertools.count()

    def pick(self):
        """The next router: its place, and a client of it."""
        # itertools.count's next is atomic under the GIL: users' threads share it.
        router = next(self.turns) % len(self.clients)
        return router, self.clients[router]


def run_workload(urls, api_key, strategy, args, repetition=0):
    rng = random.Random(f"{args.seed}-{strategy}-{repetition}")
    conversations = [Conversation(f"{strategy}-{repetition}-{i}", system_prompt(rng, args.system_tokens))
                     for i in range(args.conversations)]
    client = RoundRobin(urls, api_key)
    started = time.monotonic()
    if args.concurrent:
        errors = []

        def user(conversation, arrives_s):
            # A load generator's clock, not a wait for an event: users come
            # `--arrivals` apart and read each reply for `--think`.
            time.sleep(arrives_s)
            try:
                for index in range(args.turns):
                    if index:
                        time.sleep(args.think)
                    conversation.turn(client, index, args.max_tokens)
            except Exception as error:  # noqa: BLE001 - reported after the run
                errors.append(error)

        threads = [threading.Thread(target=user, args=(c, i * args.arrivals)) for i, c in enumerate(conversations)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
    else:
        for index in range(args.turns):
            for conversation in conversations:
                conversation.turn(client, index, args.max_tokens)
    return summarize(strategy, conversations, time.monotonic() - started), conversations


def start_fleet(fleet, args):
    fleet.llama_server = llama_server()
    fleet.model = real_model()
    fleet.start_etcd()
    fleet.start_controller()
    fleet.nodes = [f"node-{chr(ord('a') + i)}" for i in range(args.nodes)]
    fleet.llama = {}
    # The tier's bound; 0 switches it off (see set_tier).
    tier = f"[tier]\nmax_bytes = {TIER_BYTES}\n" if args.move_caches else ""
    for node in fleet.nodes:
        slots = ""
        if args.move_caches:
            (fleet.tmp / f"slots-{node}").mkdir()
            slots = f'\n[backends.slots]\ndir = "{fleet.tmp / f"slots-{node}"}"\nflags = "--swa-full"\n'
        fleet.llama[node] = start_server(fleet, node, args)
        host_cache = args.cache_ram * 1024 * 1024 // KV_BYTES_PER_TOKEN
        fleet.start_agent(node, [("chat", fleet.llama[node], ["chat", "completion"],
                                  f"host_cache_tokens = {host_cache}\n{slots}")], tier)
    fleet.tier_on = bool(tier)
    extra = "queue = false" if args.no_queue else ""
    # Each row's routers: its URLs, which the load generator deals requests
    # to in turn. SMG's start for their rows only (see start_smg).
    fleet.urls = {}
    for name in args.strategies.split(","):
        if name in PEERS:
            continue
        strategy, own = VARIANTS.get(name, (name, ""))
        fleet.urls[name] = [fleet.start_dataplane(f"dataplane-{name}-{i}", strategy, {MODEL: args.nodes},
                                                  extra=f"{extra}\n{own}") for i in range(args.routers)]


def start_smg(fleet, routers):
    """SMG, its cache-aware policy over the llama-server URLs: `routers`
    instances, meshed where there are several (each joins the others'
    mesh, which shares their trees of what each worker holds). Started for
    its row and stopped after it: meshed instances keep a core busy between
    them even when no request comes, which would slow the other rows' nodes
    on a small machine. Its `smg` command is beside the benchmark's
    Python."""
    smg = Path(sys.executable).with_name("smg")
    if not smg.is_file():
        raise RuntimeError(f"no {smg}: pip install smg=={SMG_VERSION} into this environment")
    ports = [(free_port(), free_port()) for _ in range(routers)]
    urls = []
    for i, (port, mesh) in enumerate(ports):
        # Its metrics on a port of its own (by default every instance's is 29000).
        command = [str(smg), "launch", "--host", "127.0.0.1", "--port", str(port),
                   "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                   "--worker-urls", *fleet.llama.values(), "--policy", "cache_aware"]
        if routers > 1:
            peers = [f"127.0.0.1:{other}" for j, (_, other) in enumerate(ports) if j != i]
            command += ["--enable-mesh", "--mesh-server-name", f"smg-{i}", "--mesh-host", "127.0.0.1",
                        "--mesh-port", str(mesh), "--mesh-peer-urls", *peers]
        fleet.spawn(f"smg-{i}", command)
        urls.append(f"http://127.0.0.1:{port}")
    for url in urls:
        wait_until("smg serving", lambda url=url: http_get(f"{url}/v1/models")[0] == 200, timeout=60)
    return urls


def router_cpu_s(fleet, strategy):
    """CPU seconds the row's routers (its data planes, or its SMG
    instances) have used so far, from /proc. Inferyes's agents and
    controller, which run for every row, are not counted."""
    prefix = "smg" if strategy in PEERS else f"dataplane-{strategy}"
    ticks = 0
    for name, process in fleet.processes:
        # The row's own: `dataplane-policy-0`, not `dataplane-policy-no-carry-0`.
        if name.rsplit("-", 1)[0] != prefix:
            continue
        try:
            fields = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue  # it ended
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def stop_smg(fleet):
    """Stops every SMG instance; one that does not stop in 10 s is killed."""
    stopping = [(name, process) for name, process in fleet.processes if name.startswith("smg-")]
    fleet.processes = [(name, process) for name, process in fleet.processes if not name.startswith("smg-")]
    for _, process in stopping:
        process.terminate()
    for _, process in stopping:
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def start_server(fleet, node, args, port=None):
    llama_args = ["-np", str(args.slots), *GEMMA_ARGS]
    if args.move_caches:
        llama_args += ["--slot-save-path", f"{fleet.tmp / f'slots-{node}'}/"]
    return fleet.start_llama_server(f"gemma-{node}", fleet.model, MODEL, llama_args, port=port,
                                    context=args.slots * args.context, cache_ram=args.cache_ram)


def set_tier(fleet, on):
    """Restarts every agent with its KV tier on or off, where it is not so
    already."""
    if fleet.tier_on == on:
        return
    digests = {node: fleet.ctl("node", node).get("instance_digest") for node in fleet.nodes}
    for node in fleet.nodes:
        process, config = fleet.agents[node]
        text = config.read_text()
        config.write_text(text.replace(f"max_bytes = {0 if on else TIER_BYTES}\n",
                                       f"max_bytes = {TIER_BYTES if on else 0}\n"))
        process.terminate()
        process.wait(timeout=30)
        fleet.restart_agent(node)
    for node in fleet.nodes:
        def serving(node=node):
            seen = fleet.ctl("node", node)
            return seen.get("instance_digest") != digests[node] and not seen.get("awaiting_credential")
        wait_until(f"{node}'s new agent serving", serving, timeout=60)
    fleet.tier_on = on


def tier_events(fleet, event):
    """The agents' KV tier events of a kind, all nodes together."""
    return sum(fleet.agent_metric(node, "inferyes_agent_kv_tier_events_total", event=event) for node in fleet.nodes)


def restart_servers(fleet, args):
    """Empties every slot and host cache: each policy starts from nothing."""
    for node in fleet.nodes:
        process = fleet.servers[f"gemma-{node}"]
        process.terminate()
        process.wait(timeout=30)
        start_server(fleet, node, args, port=int(fleet.llama[node].rsplit(":", 1)[1]))
    auth = {"Authorization": f"Bearer {fleet.api_key}"}

    def all_warm():
        for name, urls in fleet.urls.items():
            if name in PEERS:
                continue
            for url in urls:
                model = json.loads(http_get(f"{url}/v1/models/{MODEL}", headers=auth)[1])
                if model["inferyes"]["warm_nodes"] != args.nodes:
                    return False
        return True

    wait_until("every node warm again", all_warm, timeout=60)


def table(results):
    lines = ["| data plane | first-turn TTFT p50 | p99 | later-turn TTFT p50 | p99 | KV reuse vs oracle "
             "| session moves (carried) | wall | routers' CPU |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(
            f"| {r['strategy']} | {r['first_ttft_p50_ms']:,.0f} ms | {r['first_ttft_p99_ms']:,.0f} ms "
            f"| {r['later_ttft_p50_ms']:,.0f} ms | {r['later_ttft_p99_ms']:,.0f} ms "
            f"| {100 * r['kv_reuse_of_oracle']:.1f}% | {moved(r)} | {r['wall_s']:.1f} s "
            f"| {r['router_cpu_s']:.1f} s |")
    return "\n".join(lines)


def moved(r):
    if r["session_moves"] is None:
        return "-"
    return f"{r['session_moves']} of {r['later_turns']} ({int(r.get('carried', 0))})"


def spread(results):
    """Each row's mean and range over its repetitions."""
    lines = ["| row | runs | wall | KV reuse vs oracle | first-turn TTFT p50 | later-turn TTFT p50 | later p99 "
             "| routers' CPU |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    rows = {}
    for r in results:
        rows.setdefault(r["strategy"], []).append(r)
    for name, runs in rows.items():
        def cell(key, scale=1.0, unit=" s", digits=1):
            values = [scale * r[key] for r in runs]
            mean = sum(values) / len(values)
            return f"{mean:.{digits}f}{unit} ({min(values):.{digits}f}-{max(values):.{digits}f})"
        lines.append(f"| {name} | {len(runs)} | {cell('wall_s')} | {cell('kv_reuse_of_oracle', 100, '%')} "
                     f"| {cell('first_ttft_p50_ms', 1e-3)} | {cell('later_ttft_p50_ms', 1e-3)} "
                     f"| {cell('later_ttft_p99_ms', 1e-3)} | {cell('router_cpu_s')} |")
    return "\n".join(lines)


def routed(fleet, url, route):
    """Requests the data plane serving `url` answered by `route`."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in fleet.metrics(url).splitlines()
               if line.startswith("inferyes_dataplane_requests_total{") and f'route="{route}"' in line)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--slots", type=int, default=4, help="slots per llama-server")
    parser.add_argument("--context", type=int, default=4096, help="tokens per slot")
    parser.add_argument("--cache-ram", type=int, default=512, help="llama-server --cache-ram, MiB")
    parser.add_argument("--conversations", type=int, default=7)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrent", action="store_true", help="every conversation its own user, all at once")
    parser.add_argument("--arrivals", type=float, default=0.0,
                        help="with --concurrent: seconds between one user's first turn and the next's")
    parser.add_argument("--think", type=float, default=0.0,
                        help="with --concurrent: seconds a user waits between a reply and its next turn")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--no-queue", action="store_true",
                        help="data planes send every request on at once, to wait in the servers' queues")
    parser.add_argument("--move-caches", action="store_true",
                        help="servers save slots and agents carry them (see the policy-no-carry data plane)")
    parser.add_argument("--compare-tier", action="store_true",
                        help="each Inferyes row also with the agents' KV tiers off (needs --move-caches)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs of every row, the order reversed each time")
    parser.add_argument("--routers", type=int, default=1,
                        help="each row's routers (data planes; SMG instances, meshed), requests dealt in turn")
    parser.add_argument("--seed", default="bench")
    parser.add_argument("--json", type=Path, help="write the results and every turn here")
    args = parser.parse_args()

    if args.turns < 2:
        parser.error("--turns must be 2 or more: later turns are what is measured")
    if (args.arrivals or args.think) and not args.concurrent:
        parser.error("--arrivals and --think shape users' turns: they need --concurrent")
    if args.compare_tier and not args.move_caches:
        parser.error("--compare-tier needs --move-caches: the tier keeps what the servers save")
    fleet = Fleet(Path(tempfile.mkdtemp(prefix="inferyes-bench-chat-")))
    results, turns = [], []
    try:
        start_fleet(fleet, args)
        rows = args.strategies.split(",")
        if args.compare_tier:
            rows = [row for name in rows for row in ((name,) if name in PEERS else (name, name + NO_TIER))]
        runs = [(repetition, strategy) for repetition in range(args.repeat)
                for strategy in (rows if repetition % 2 == 0 else rows[::-1])]
        for i, (repetition, strategy) in enumerate(runs):
            base = strategy.removesuffix(NO_TIER)
            if args.move_caches and base not in PEERS:
                set_tier(fleet, not strategy.endswith(NO_TIER))
            if i:
                restart_servers(fleet, args)
            print(f"running {strategy} ({repetition + 1} of {args.repeat})...", file=sys.stderr, flush=True)
            restored = tier_events(fleet, "restored") if args.move_caches else 0
            if base == "smg":
                fleet.urls[base] = start_smg(fleet, args.routers)
            try:
                cpu = router_cpu_s(fleet, base)
                result, conversations = run_workload(fleet.urls[base], fleet.api_key, strategy, args, repetition)
                result["router_cpu_s"] = router_cpu_s(fleet, base) - cpu
            finally:
                if base == "smg":
                    stop_smg(fleet)
            result["repetition"] = repetition
            if args.move_caches:
                result["tier_restored"] = tier_events(fleet, "restored") - restored
            if base not in PEERS:
                result["carried"] = sum(routed(fleet, url, "carried") for url in fleet.urls[base])
                # What routing saw and decided, from the dashboard: the rates
                # each backend reported and the recent decisions with every
                # candidate's cost terms.
                admin = {"Authorization": f"Bearer {fleet.admin_token}"}
                result["dashboard"] = json.loads(http_get(f"{fleet.dashboard_url}/api/v1/fleet", headers=admin)[1])
            results.append(result)
            turns += [t for c in conversations for t in c.turns]
            print(table([result]).splitlines()[-1], file=sys.stderr, flush=True)
    finally:
        fleet.stop()
    mode = "at once" if args.concurrent else "one request at a time"
    if args.arrivals or args.think:
        mode = f"arriving {args.arrivals:g} s apart, {args.think:g} s between a reply and the next turn"
    routers = f"; {args.routers} routers a row, requests dealt in turn" if args.routers > 1 else ""
    print(f"\n{args.conversations} conversations {mode}, {args.turns} turns, ~{args.system_tokens}-token "
          f"system prompts; {args.nodes} nodes x {args.slots} slots, --cache-ram {args.cache_ram}{routers}\n")
    print(table(results))
    if args.repeat > 1:
        print(f"\nMean (min-max) over {args.repeat} runs each:\n")
        print(spread(results))
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": results,
                                         "turns": turns}, indent=2))


if __name__ == "__main__":
    main()
