"""Every kind of job through the fleet, on real llama-server nodes: the
Anthropic Messages API with the official `anthropic` client (create, stream,
count tokens, a conversation that stays on its node and reads its cache,
errors in Anthropic's shape), fill-in-the-middle routed only to a model that
can do it, and llama-server's router mode, whose unloaded models are cold
and loaded on their first request."""

import json
import shutil
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import anthropic
import pytest
from openai import OpenAI

import make_models
from harness import Fleet, http_get, llama_server, wait_until


def claude(fleet):
    # The Anthropic client takes the base URL without `/v1`, and sends its
    # key as `x-api-key`.
    return anthropic.Anthropic(base_url=fleet.url, api_key=fleet.api_key, max_retries=0, timeout=60)


def post(url, path, body, headers=None):
    """A raw POST: the status and the JSON answer, errors included."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(f"{url}{path}", data=data, method="POST",
                                     headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read()), response.headers
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read()), error.headers


def test_messages_are_answered_whole_and_streamed(fleet):
    client = claude(fleet)
    # Greedy: sampled, a random model may pick its end-of-turn token.
    raw = client.messages.with_raw_response.create(
        model="tiny-chat", max_tokens=8, system="You are terse.", extra_body={"temperature": 0},
        messages=[{"role": "user", "content": "tell me a story"}])
    message = raw.parse()
    assert raw.headers["x-inferyes-node"] in ("node-a", "node-b")
    assert (message.type, message.role, message.stop_reason) == ("message", "assistant", "max_tokens")
    assert message.content[0].type == "text" and message.content[0].text
    assert message.usage.output_tokens == 8 and message.usage.input_tokens > 0

    with client.messages.stream(model="tiny-chat", max_tokens=8, extra_body={"temperature": 0},
                                messages=[{"role": "user", "content": "count to ten"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8

    counted = client.messages.count_tokens(model="tiny-chat",
                                           messages=[{"role": "user", "content": "count to ten"}])
    assert counted.input_tokens > 0


def test_a_messages_stream_opens_with_message_start_where_the_server_left_it_out(fleet):
    # llama-server writes `message_start` with the first token's text, and
    # leaves it out where that text is held back (the first bytes of a
    # character split across tokens). Greedy sampling makes such a prompt
    # findable on the tiny model, asked of its server directly.
    def starts(prompt):
        body = {"model": "tiny-chat", "max_tokens": 2, "stream": True, "temperature": 0,
                "messages": [{"role": "user", "content": prompt}]}
        request = urllib.request.Request(f"{fleet.llama['node-a']}/v1/messages", data=json.dumps(body).encode(),
                                         method="POST", headers={"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            return b"event: message_start" in response.read()

    prompt = next((p for p in (f"word {i}" for i in range(400)) if not starts(p)), None)
    assert prompt, "every stream llama-server sent opened with message_start: nothing to check"

    with claude(fleet).messages.stream(model="tiny-chat", max_tokens=4, extra_body={"temperature": 0},
                                       messages=[{"role": "user", "content": prompt}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text
    assert final.model == "tiny-chat" and final.id.startswith("msg_")
    assert final.usage.input_tokens > 0 and final.usage.output_tokens == 4


def test_a_messages_conversation_stays_on_its_node_and_reads_its_cache(fleet):
    # No session header: the conversation's root (the system prompt and the
    # first message) keeps it on its node.
    client = claude(fleet)
    system = "You answer in riddles about rivers and stones, and never twice the same way."
    messages, turns = [], []
    for turn in range(3):
        messages.append({"role": "user", "content": f"turn {turn}: tell me more about the river"})
        raw = client.messages.with_raw_response.create(model="tiny-chat", max_tokens=6, system=system,
                                                       messages=messages)
        reply = raw.parse()
        messages.append({"role": "assistant", "content": reply.content[0].text})
        turns.append((raw.headers["x-inferyes-node"], reply.usage))
    assert len({node for node, _ in turns}) == 1, turns
    # Every later turn reads the whole prompt before it from the cache
    # (Anthropic's input tokens are those not read from it).
    prompts = [usage.input_tokens + usage.cache_read_input_tokens for _, usage in turns]
    for before, (_, usage) in zip(prompts, turns[1:]):
        assert usage.cache_read_input_tokens >= before, turns


def test_a_coding_agent_s_session_header_keeps_its_requests_together(fleet):
    client = claude(fleet)
    nodes = set()
    # Six openings, six roots: without the header they would be spread over
    # both nodes (all on one by chance once in 32).
    for opening in range(6):
        raw = client.messages.with_raw_response.create(
            model="tiny-chat", max_tokens=2, messages=[{"role": "user", "content": f"task {opening}"}],
            extra_headers={"x-claude-code-session-id": "claude-session-e2e"})
        raw.parse()
        nodes.add(raw.headers["x-inferyes-node"])
    assert len(nodes) == 1, nodes


def test_errors_on_the_messages_api_are_in_anthropic_s_shape(fleet):
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude(fleet).messages.create(model="no-such-model", max_tokens=2,
                                      messages=[{"role": "user", "content": "hi"}])
    assert missing.value.body["type"] == "error"
    assert missing.value.body["error"]["type"] == "not_found_error"
    assert "no-such-model" in missing.value.body["error"]["message"]

    wrong = anthropic.Anthropic(base_url=fleet.url, api_key="ify_nope_nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        wrong.messages.create(model="tiny-chat", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert refused.value.body["error"]["type"] == "authentication_error"

    status, body, _ = post(fleet.url, "/v1/messages", b"{not json", {"x-api-key": fleet.api_key})
    assert status == 400 and body["type"] == "error", body
    assert body["error"]["type"] == "invalid_request_error" and "not valid JSON" in body["error"]["message"]

    # The OpenAI paths, and any path the fleet does not serve, keep
    # OpenAI's shape.
    status, body, _ = post(fleet.url, "/v1/nope", {}, {"authorization": f"Bearer {fleet.api_key}"})
    assert (status, body["error"]["code"]) == (404, "unknown_url"), body
    status, body, _ = post(fleet.url, "/v1/chat/completions", {"model": "no-such-model"},
                           {"authorization": f"Bearer {fleet.api_key}"})
    assert (status, body["error"]["code"]) == (404, "model_not_found"), body


# ---- a fleet with llama-server in router mode ----

@pytest.fixture(scope="module")
def routed():
    """node-a: one llama-server serving tiny-chat (no FIM tokens); node-r: a
    llama-server in router mode over tiny-code (FIM tokens), tiny-story (a
    chat model) and broken (not a model at all), one loaded at a time."""
    tmp = Path(tempfile.mkdtemp(prefix="inferyes-e2e-router-"))
    fleet = Fleet(tmp)
    fleet.llama_server = llama_server()
    models = make_models.main(tmp / "models")
    catalog = tmp / "router-models"
    catalog.mkdir()
    shutil.copy(models / "tiny-code.gguf", catalog / "tiny-code.gguf")
    shutil.copy(models / "tiny-chat.gguf", catalog / "tiny-story.gguf")
    (catalog / "broken.gguf").write_bytes(b"GGUF, but not a model")
    try:
        fleet.start_etcd()
        fleet.start_controller()
        chat = fleet.start_llama_server("llama-a", models / "tiny-chat.gguf", "tiny-chat", ["-np", "2"])
        router = fleet.start_llama_router("llama-r", catalog, 1, ["-np", "2"])
        # No kinds listed: what each model can do is the servers' to say.
        fleet.start_agent("node-a", [("chat", chat, [])])
        fleet.start_agent("node-r", [("router", router, [])])
        fleet.url = fleet.start_dataplane(
            "dataplane", "policy", {"tiny-chat": 1, "tiny-code": 0, "tiny-story": 0, "broken": 0})
        yield fleet
    finally:
        fleet.stop()
        print(f"\nend-to-end logs (router): {fleet.logs}")


def catalog(fleet):
    auth = {"Authorization": f"Bearer {fleet.api_key}"}
    return {m["id"]: m["inferyes"] for m in json.loads(http_get(f"{fleet.url}/v1/models", headers=auth)[1])["data"]}


def placement(fleet, model, node):
    [model] = [m for m in fleet.ctl("models")["models"] if m["id"] == model]
    [on] = [p for p in model["placements"] if p["node_id"] == node]
    return on


def test_a_router_s_unloaded_models_are_cold_and_one_asked_for_is_loaded(routed):
    models = catalog(routed)
    assert models["tiny-story"]["state"] == "cold" and models["tiny-code"]["state"] == "cold", models
    assert models["tiny-chat"]["state"] == "warm"
    assert placement(routed, "tiny-story", "node-r")["state"] == "cold"
    [node] = routed.ctl("node", "node-r")["backends"]
    assert node["kind"] == "BACKEND_KIND_LLAMA_SERVER_ROUTER" and node["models_max"] == 1, node

    client = OpenAI(base_url=f"{routed.url}/v1", api_key=routed.api_key, max_retries=0, timeout=120)
    raw = client.chat.completions.with_raw_response.create(
        model="tiny-story", messages=[{"role": "user", "content": "once upon a time"}], max_tokens=4)
    assert raw.parse().choices[0].message.content
    assert (raw.headers["x-inferyes-node"], raw.headers["x-inferyes-route"]) == ("node-r", "cold")
    wait_until("tiny-story warm", lambda: catalog(routed)["tiny-story"]["state"] == "warm", timeout=30)
    assert placement(routed, "tiny-story", "node-r")["state"] == "warm"


def test_infill_goes_only_to_a_model_that_fills_in_the_middle(routed):
    # node-a's agent asked its llama-server, which has no FIM tokens.
    wait_until("tiny-chat known not to infill",
               lambda: placement(routed, "tiny-chat", "node-a")["kinds"] == "any but infill", timeout=30)
    auth = {"authorization": f"Bearer {routed.api_key}"}
    infill = {"input_prefix": "def add(a, b):\n    return ", "input_suffix": "\n", "n_predict": 4}
    status, body, _ = post(routed.url, "/infill", {"model": "tiny-chat", **infill}, auth)
    assert status == 400 and body["error"]["code"] == "unsupported_endpoint", body
    assert "does not serve infill requests" in body["error"]["message"]

    # tiny-code loads on the router (unloading the model before it) and
    # fills in the middle.
    status, body, headers = post(routed.url, "/infill", {"model": "tiny-code", **infill}, auth)
    assert status == 200 and body["tokens_predicted"] == 4, body
    assert headers["x-inferyes-node"] == "node-r"
    wait_until("the router holds one model", lambda: [catalog(routed)[m]["state"] for m in
                                                      ("tiny-code", "tiny-story")] == ["warm", "cold"], timeout=30)


def test_a_cold_load_that_fails_ends_an_anthropic_stream_with_an_error_event(routed):
    client = anthropic.Anthropic(base_url=routed.url, api_key=routed.api_key, max_retries=0, timeout=60)
    with pytest.raises(anthropic.APIStatusError) as failed:
        with client.messages.stream(model="broken", max_tokens=4,
                                    messages=[{"role": "user", "content": "hi"}]) as stream:
            list(stream.text_stream)
    body = failed.value.body
    assert body["type"] == "error" and body["error"]["type"] == "api_error", body
    assert "failed to load" in body["error"]["message"], body
