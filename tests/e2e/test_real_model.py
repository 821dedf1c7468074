"""The real model, Gemma 3 270M, through the fleet with the official OpenAI
and Anthropic clients: its catalog, streaming with usage, prompts near its
context window (served up to it, refused past it, by the model's own
count), a multi-turn chat (and a multi-turn Messages stream) whose later
turns are served from the KV cache of the node that served the first, and
a stream whose node dies mid-answer, finished by the other node with
continuation on and ended by an explicit error with it off."""

import json
import random
import signal
import urllib.request

import anthropic
import openai
import pytest
from openai import OpenAI

import sdk_helpers
from conftest import GEMMA
from harness import http_get, wait_until


def client(fleet):
    return OpenAI(base_url=f"{fleet.url}/v1", api_key=fleet.api_key, max_retries=0, timeout=120)


def system_prompt(seed, rules=25):
    """A distinct system prompt of about 20 tokens a rule."""
    rng = random.Random(seed)
    colours = ["red", "amber", "green", "blue", "violet", "grey", "white", "black"]
    return " ".join(f"Rule {i}: stone {rng.randrange(1000)} of the {rng.choice(colours)} path stays "
                    f"where the {rng.choice(colours)} river meets it." for i in range(rules))


def warm_nodes(fleet):
    auth = {"Authorization": f"Bearer {fleet.api_key}"}
    return json.loads(http_get(f"{fleet.url}/v1/models/{GEMMA}", headers=auth)[1])["inferyes"]["warm_nodes"]


def test_every_node_serves_the_real_model(gemma):
    assert [m.id for m in client(gemma).models.list()] == [GEMMA]
    assert warm_nodes(gemma) == 2
    for node in ("node-a", "node-b"):
        [backend] = gemma.ctl("node", node)["backends"]
        [model] = backend["models"]
        assert (model["id"], model["state"], model["context_window"]) == (GEMMA, "MODEL_STATE_LOADED", 4096)


def test_a_stream_carries_its_usage_when_asked(gemma):
    messages = [{"role": "system", "content": system_prompt("usage", rules=3)},
                {"role": "user", "content": "Which stone is first?"}]
    chunks = list(client(gemma).chat.completions.create(
        model=GEMMA, messages=messages, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip(), chunks
    *answer, last = chunks
    assert last.choices == [] and last.usage is not None, last
    assert all(c.usage is None for c in answer), answer
    assert answer[-1].choices[0].finish_reason in ("length", "stop"), answer[-1]
    assert last.usage.prompt_tokens > 60
    assert 0 < last.usage.completion_tokens <= 12


def http_post(url, body):
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


WINDOW = 4096
TEXTS = {
    "english": "The committee reviewed the quarterly figures and agreed that the new schedule "
               "would begin early in the spring, once the last of the surveys had come back. ",
    "code": "def area(width, height):\n    # a rectangle, in square metres\n    return width * height\n\n",
    "cjk": "東京の図書館では毎朝たくさんの学生が静かに本を読み、窓の外の桜を眺めています。",
}


def messages_of(kind, tokens, fleet):
    """Chat messages of `kind`'s text whose prompt, as the server templates
    and tokenizes it, is `tokens` long, give or take one repetition's."""
    node = fleet.llama["node-a"]

    def count(n):
        messages = [{"role": "user", "content": TEXTS[kind] * n}]
        prompt = http_post(f"{node}/apply-template", {"messages": messages})["prompt"]
        return len(http_post(f"{node}/tokenize", {"content": prompt, "add_special": True})["tokens"]), messages

    low, high = 1, WINDOW
    while low < high:
        middle = (low + high + 1) // 2
        if count(middle)[0] <= tokens:
            low = middle
        else:
            high = middle - 1
    return count(low)


@pytest.mark.parametrize("kind", TEXTS)
def test_a_prompt_of_most_of_the_window_is_served_and_one_past_it_refused_by_the_model_s_count(gemma, kind):
    # Whatever a tokenizer makes of the bytes: Gemma's takes six or more
    # bytes of English a token, three of Japanese.
    counted, messages = messages_of(kind, int(0.95 * WINDOW), gemma)
    assert counted > 0.94 * WINDOW, counted
    reply = client(gemma).chat.completions.create(model=GEMMA, messages=messages, max_tokens=1, temperature=0)
    assert abs(reply.usage.prompt_tokens - counted) <= 2, (reply.usage, counted)

    counted, messages = messages_of(kind, int(1.05 * WINDOW), gemma)
    with pytest.raises(openai.BadRequestError) as refused:
        client(gemma).chat.completions.create(model=GEMMA, messages=messages, max_tokens=1)
    assert refused.value.code == "context_length_exceeded", refused.value.body
    assert f"({WINDOW} tokens)" in refused.value.message, refused.value.message

    claude = anthropic.Anthropic(base_url=gemma.url, api_key=gemma.api_key, max_retries=0, timeout=120)
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(model=GEMMA, max_tokens=1, messages=messages)
    assert refused.value.body["type"] == "error", refused.value.body
    assert refused.value.body["error"]["type"] == "invalid_request_error", refused.value.body


def test_every_sdk_streaming_helper(gemma):
    sdk_helpers.check(gemma.url, GEMMA, gemma.api_key)


def test_each_tenant_s_gpu_time_shows_in_inferyesctl_and_the_dashboard(gemma):
    # A request of its own, so the key has used the model whatever ran
    # before; the fleet's key has no tenant: it is a tenant of its own.
    client(gemma).chat.completions.create(model=GEMMA, messages=[{"role": "user", "content": "Count to five."}],
                                          max_tokens=16, temperature=0)

    def tenants():
        rows = gemma.ctl("usage", "--by-tenant")["rows"]
        return [row for row in rows if row["prompt_ms"] + row["generation_ms"] > 0 and row["requests"] > 0]

    # One row an hour: the suite may run across the hour.
    rows = wait_until("GPU time rolled up", tenants, timeout=30)
    assert len({row["tenant"] for row in rows}) == 1, rows
    row = rows[-1]
    assert row["tenant"].startswith("key:") and row["model"] == GEMMA and row["key_id"] == "", row
    # Gemma 3 270M on one CPU thread: tens of milliseconds a token at least.
    assert sum(r["generation_ms"] for r in rows) >= 16 * 5, rows

    auth = {"Authorization": f"Bearer {gemma.admin_token}"}

    def charted():
        view = json.loads(http_get(f"{gemma.dashboard_url}/api/v1/fleet", headers=auth)[1])
        return [t for t in view["usage"]["tenants"] if t["tenant"] == row["tenant"] and t["gpu_ms_total"] > 0]

    [tenant] = wait_until("the dashboard's usage chart", charted, timeout=30)
    assert tenant["requests"] >= 1 and len(tenant["gpu_ms"]) == 24, tenant


def test_later_turns_are_served_from_the_cache_of_the_first_node(gemma):
    # No session header: the conversation's root (system prompt and first
    # message) keeps it on its node.
    messages = [{"role": "system", "content": system_prompt("turns")}]
    turns = []
    for turn in range(3):
        messages.append({"role": "user", "content": f"Turn {turn}: which stone comes next?"})
        raw = client(gemma).chat.completions.with_raw_response.create(
            model=GEMMA, messages=messages, max_tokens=16, temperature=0)
        reply = raw.parse()
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        turns.append((raw.headers["x-inferyes-node"], raw.headers["x-inferyes-route"], reply.usage))
    nodes = {node for node, _, _ in turns}
    assert len(nodes) == 1, turns
    assert [route for _, route, _ in turns] == ["placed", "resident", "resident"], turns
    # The first turn shares at most its first tokens (the template's) with
    # what an earlier test left in the slot.
    assert turns[0][2].prompt_tokens_details.cached_tokens < 16, turns
    assert turns[0][2].prompt_tokens > 400
    for (_, _, previous), (_, _, usage) in zip(turns, turns[1:]):
        # At best a turn reuses the previous prompt and reply (less the
        # reply's last token, which never entered the cache).
        best = previous.prompt_tokens + previous.completion_tokens - 1
        assert usage.prompt_tokens_details.cached_tokens >= 0.95 * best, turns


def test_a_streamed_messages_conversation_reads_more_of_its_cache_each_turn(gemma):
    # The Anthropic client, streaming, no session header: the root of the
    # conversation (its system prompt and first message) keeps it home.
    claude = anthropic.Anthropic(base_url=gemma.url, api_key=gemma.api_key, max_retries=0, timeout=120)
    system = system_prompt("messages")
    messages, turns = [], []
    for turn in range(3):
        messages.append({"role": "user", "content": f"Turn {turn}: which stone comes next?"})
        with claude.messages.stream(model=GEMMA, max_tokens=16, system=system, messages=messages) as stream:
            node = stream.response.headers["x-inferyes-node"]
            route = stream.response.headers["x-inferyes-route"]
            reply = stream.get_final_message()
        messages.append({"role": "assistant", "content": reply.content[0].text or "."})
        turns.append((node, route, reply.usage))
    assert len({node for node, _, _ in turns}) == 1, turns
    assert [route for _, route, _ in turns] == ["placed", "resident", "resident"], turns
    # The first turn shares at most its first tokens (the template's) with
    # what an earlier test left in the slot.
    assert turns[0][2].cache_read_input_tokens < 16 and turns[0][2].input_tokens > 400, turns
    prompts = [usage.input_tokens + usage.cache_read_input_tokens for _, _, usage in turns]
    for before, (_, _, usage) in zip(prompts, turns[1:]):
        # Reported as cache reads: the whole prompt before, at least.
        assert usage.cache_read_input_tokens >= before, turns
        assert usage.input_tokens < 60, turns


@pytest.fixture
def revive(gemma):
    """Restarts, after the test, every llama-server it killed, on its port,
    and waits until the data plane routes to both nodes again."""
    killed = []
    yield killed
    for node in killed:
        port = int(gemma.llama[node].rsplit(":", 1)[1])
        gemma.start_llama_server(f"gemma-{node}", gemma.model, GEMMA, gemma.llama_args, port=port, context=8192)
    wait_until("both nodes warm again", lambda: warm_nodes(gemma) == 2, timeout=30)


def kill_mid_stream(gemma, killed, continued):
    """Streams a long answer, kills the serving node's llama-server after its
    first words, and returns the node, the text before and the whole text."""
    raw = client(gemma).chat.completions.with_raw_response.create(
        model=GEMMA, temperature=0, max_tokens=64, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "system", "content": system_prompt(f"kill-{continued}", rules=4)},
                  {"role": "user", "content": "Tell the whole story of the stones."}],
        # A base model may end early; this answer must outlive the kill.
        extra_body={"ignore_eos": True})
    node = raw.headers["x-inferyes-node"]
    chunks = iter(raw.parse())
    before, words = "", 0
    while words < 3:
        chunk = next(chunks)
        if chunk.choices and chunk.choices[0].delta.content:
            before += chunk.choices[0].delta.content
            words += 1
    gemma.servers[f"gemma-{node}"].send_signal(signal.SIGKILL)
    gemma.servers[f"gemma-{node}"].wait()
    killed.append(node)
    rest = list(chunks)
    return node, before, rest


def continuations(fleet):
    metrics = fleet.metrics(fleet.url)
    return sum(float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith("inferyes_dataplane_continuations_total"))


def test_a_stream_whose_node_dies_is_finished_by_the_other_node(gemma, revive):
    gemma.set_policy("--continue-streams", "true")
    continued = continuations(gemma)
    try:
        node, before, rest = kill_mid_stream(gemma, revive, continued=True)
    finally:
        gemma.set_policy("--continue-streams", "false")
    # The other node took the answer over where the dead one stopped.
    assert continuations(gemma) == continued + 1
    text = before + "".join(c.choices[0].delta.content or "" for c in rest if c.choices)
    finish = [c.choices[0].finish_reason for c in rest if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"], rest
    assert len(text) > len(before) + 20, text
    assert rest[-1].usage is not None, "the usage chunk still ends the stream"


def test_with_continuation_off_a_stream_whose_node_dies_ends_with_an_error(gemma, revive):
    with pytest.raises(openai.APIError) as error:
        kill_mid_stream(gemma, revive, continued=False)
    [node] = revive
    assert f"node `{node}` failed in the middle of the stream" in str(error.value), error.value
