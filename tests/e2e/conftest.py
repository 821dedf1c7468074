"""A fleet of real llama-server nodes behind Inferyes, for the end-to-end
suite: etcd, a controller, two agents (node-a: one chat server; node-b: a chat
server and an embeddings server; the chat servers also answer the Messages
API), and two data planes (session affinity, and
forced round-robin for comparison). Every process is the real binary.

`gemma` is a second fleet, started only for the tests that ask for it: two
nodes each serving the real Gemma 3 270M, one policy data plane. `movers`
is a third: three Gemma nodes whose slots can move between them; `keepers`
a fourth: one node keeping conversations' slots in its KV tier.

Environment:
  INFERYES_BIN_DIR        where the Inferyes binaries are (default: target/debug)
  INFERYES_LLAMA_SERVER   a llama-server binary (default: scripts/llama-server.sh)
  INFERYES_REAL_MODEL     Gemma 3 270M's GGUF file (default: scripts/real-model.sh)
"""

import tempfile
from pathlib import Path

import pytest

import make_models
from harness import GEMMA_ARGS, GEMMA_TEMPLATE, Fleet, llama_server, real_model


@pytest.fixture(scope="session")
def fleet():
    tmp = Path(tempfile.mkdtemp(prefix="inferyes-e2e-"))
    fleet = Fleet(tmp)
    fleet.llama_server = llama_server()
    models = make_models.main(tmp / "models")
    try:
        fleet.start_etcd()
        fleet.start_controller()
        chat = models / "tiny-chat.gguf"
        embed = models / "tiny-embed.gguf"
        fleet.llama = {
            "node-a": fleet.start_llama_server("llama-a-chat", chat, "tiny-chat", ["-np", "4"]),
            "node-b": fleet.start_llama_server("llama-b-chat", chat, "tiny-chat", ["-np", "4"]),
        }
        fleet.llama_embed = fleet.start_llama_server(
            "llama-b-embed", embed, "tiny-embed", ["-np", "2", "--embeddings", "--pooling", "mean"])
        fleet.start_agent("node-a", [("chat", fleet.llama["node-a"], ["chat", "completion", "responses", "messages"])])
        fleet.start_agent("node-b", [
            ("chat", fleet.llama["node-b"], ["chat", "completion", "responses", "messages"]),
            ("embed", fleet.llama_embed, ["embedding"]),
        ])
        warm = {"tiny-chat": 2, "tiny-embed": 1}
        fleet.url = fleet.start_dataplane("dataplane", "policy", warm)
        fleet.round_robin_url = fleet.start_dataplane("dataplane-rr", "round-robin", warm)
        yield fleet
    finally:
        fleet.stop()
        print(f"\nend-to-end logs: {fleet.logs}")


GEMMA = "gemma-3-270m"


@pytest.fixture(scope="session")
def gemma():
    tmp = Path(tempfile.mkdtemp(prefix="inferyes-e2e-gemma-"))
    fleet = Fleet(tmp)
    fleet.llama_server = llama_server()
    fleet.model = real_model()
    try:
        fleet.start_etcd()
        fleet.start_controller()
        # Two slots of 4,096 tokens each; no host cache, so a cache hit can
        # only come from the slot that served the previous turn.
        fleet.llama_args = ["-np", "2", *GEMMA_ARGS]
        fleet.llama = {}
        for node in ("node-a", "node-b"):
            fleet.llama[node] = fleet.start_llama_server(
                f"gemma-{node}", fleet.model, GEMMA, fleet.llama_args, context=8192)
            fleet.start_agent(node, [("chat", fleet.llama[node], ["chat", "completion", "responses", "messages"])])
        fleet.url = fleet.start_dataplane("dataplane", "policy", {GEMMA: 2})
        yield fleet
    finally:
        fleet.stop()
        print(f"\nend-to-end logs (Gemma): {fleet.logs}")


@pytest.fixture(scope="session")
def keepers():
    """One node whose server has two slots and no host cache, and saves its
    slots where its agent keeps a KV tier; one policy data plane."""
    tmp = Path(tempfile.mkdtemp(prefix="inferyes-e2e-tier-"))
    fleet = Fleet(tmp)
    fleet.llama_server = llama_server()
    models = make_models.main(tmp / "models")
    try:
        fleet.start_etcd()
        fleet.start_controller()
        slots = tmp / "slots"
        slots.mkdir()
        fleet.slots = slots
        fleet.model = models / "tiny-chat.gguf"
        fleet.llama_args = ["-np", "2", "--slot-save-path", f"{slots}/"]
        fleet.llama = {"node-a": fleet.start_llama_server("keeper", fleet.model, "tiny-chat", fleet.llama_args,
                                                          context=4096)}
        # No host cache: a conversation out of the slots is gone but for
        # the tier, as its agent is told.
        tier = f'host_cache_tokens = 0\n[backends.slots]\ndir = "{slots}"\n'
        fleet.start_agent("node-a", [("chat", fleet.llama["node-a"], ["chat", "completion", "messages"], tier)])
        fleet.url = fleet.start_dataplane("dataplane", "policy", {"tiny-chat": 1})
        yield fleet
    finally:
        fleet.stop()
        print(f"\nend-to-end logs (KV tier): {fleet.logs}")


MOVERS_MAX_SLOT_BYTES = 1 << 50


@pytest.fixture(scope="session")
def movers():
    """Three nodes serving Gemma 3 270M, two slots each, whose servers save
    slots in a directory their agents read and write, and one policy data
    plane. node-c's server runs without --swa-full while its agent's
    configuration says it has it: a slot restored there holds nothing,
    which its agent must find out by itself."""
    tmp = Path(tempfile.mkdtemp(prefix="inferyes-e2e-movers-"))
    fleet = Fleet(tmp)
    fleet.llama_server = llama_server()
    fleet.model = real_model()
    try:
        fleet.start_etcd()
        fleet.start_controller()
        fleet.llama = {}
        for node in ("node-a", "node-b", "node-c"):
            slots = tmp / f"slots-{node}"
            slots.mkdir()
            kv = ["--swa-full"] if node != "node-c" else []
            args = ["-np", "2", "--chat-template-file", str(GEMMA_TEMPLATE), *kv, "--slot-save-path", f"{slots}/"]
            fleet.llama[node] = fleet.start_llama_server(f"gemma-{node}", fleet.model, GEMMA, args, context=8192)
            moves = f'\n[backends.slots]\ndir = "{slots}"\nflags = "--swa-full"\n'
            # node-b takes a slot file of any length its disk has room for,
            # and keeps few connections for strangers.
            bounds = (f"max_stranger_connections = 16\nmax_stranger_connections_per_address = 8\n"
                      f"[moves]\nmax_slot_bytes = {MOVERS_MAX_SLOT_BYTES}") if node == "node-b" else ""
            fleet.start_agent(node, [("chat", fleet.llama[node], ["chat", "completion", "messages"], moves)], bounds)
        fleet.url = fleet.start_dataplane("dataplane", "policy", {GEMMA: 3})
        yield fleet
    finally:
        fleet.stop()
        print(f"\nend-to-end logs (moves): {fleet.logs}")
