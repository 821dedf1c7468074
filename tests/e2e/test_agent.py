"""The agent reading real llama-server nodes: what it reports, as the
controller serves it."""

from openai import OpenAI

from harness import wait_until


def backends(fleet, node):
    return {b["id"]: b for b in fleet.ctl("node", node)["backends"]}


def test_the_agent_reports_what_the_server_says(fleet):
    chat = backends(fleet, "node-a")["chat"]
    assert chat["kind"] == "BACKEND_KIND_LLAMA_SERVER"
    assert chat["health"] == "HEALTH_READY"
    assert chat["probe_error"] == ""
    # -c 2048 -np 4: four slots of 512 tokens each (/props, /slots).
    assert chat["slots_total"] == 4
    [model] = chat["models"]
    assert model["id"] == "tiny-chat"
    assert model["state"] == "MODEL_STATE_LOADED"
    assert model["context_window"] == 512
    assert model["size_bytes"] > 0, "/v1/models meta.size"
    assert model["endpoints"] == ["ENDPOINT_KIND_CHAT", "ENDPOINT_KIND_COMPLETION", "ENDPOINT_KIND_RESPONSES",
                                 "ENDPOINT_KIND_MESSAGES"]
    # Not listed, and asked of the server: tiny-chat has no FIM tokens.
    assert model["unsupported"] == ["ENDPOINT_KIND_INFILL"]

    embed = backends(fleet, "node-b")["embed"]
    assert embed["slots_total"] == 2
    assert embed["models"][0]["endpoints"] == ["ENDPOINT_KIND_EMBEDDING"]


def test_decode_throughput_comes_from_the_server_metrics(fleet):
    client = OpenAI(base_url=f"{fleet.url}/v1", api_key=fleet.api_key, max_retries=0)
    for node in ("node-a", "node-b"):
        # Round-robin reaches both nodes.
        OpenAI(base_url=f"{fleet.round_robin_url}/v1", api_key=fleet.api_key).chat.completions.create(
            model="tiny-chat", messages=[{"role": "user", "content": node}], max_tokens=8)
    client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "x"}], max_tokens=8)
    # llamacpp:predicted_tokens_seconds, read from /metrics on the next poll.
    wait_until("tokens/s reported for both nodes",
               lambda: all(backends(fleet, n)["chat"]["tokens_per_second"] > 0 for n in ("node-a", "node-b")),
               timeout=10)
