"""KV-cache residency with real llama-server nodes: a conversation that
stays on its node reuses its cache every turn; spread round-robin, it does
not. Servers run with --cache-ram 0, so a cache hit can only come from the
slot that served the previous turn."""

import json
import urllib.request

from openai import OpenAI


def converse(base_url, session, system, turns=4):
    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "system", "content": system}]
    served = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"turn {turn}: tell me more about the story"})
        raw = client.chat.completions.with_raw_response.create(
            model="tiny-chat", messages=messages, max_tokens=8, temperature=0,
            extra_headers={"x-session-id": session})
        reply = raw.parse()
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        cached = reply.usage.prompt_tokens_details.cached_tokens
        served.append((raw.headers["x-inferyes-node"], cached, reply.usage.prompt_tokens))
    return served


def slots(url):
    with urllib.request.urlopen(f"{url}/slots", timeout=5) as response:
        return json.loads(response.read())


def test_a_conversation_stays_on_its_node_and_reuses_its_cache(fleet):
    served = converse(fleet.url, "kv-affinity", "You are a storyteller of the affinity test.")
    nodes = {node for node, _, _ in served}
    assert len(nodes) == 1, served
    cached = [c for _, c, _ in served]
    assert cached[0] == 0, served
    # Every later turn finds the previous prompt and reply in the slot.
    assert all(c > 0 for c in cached[1:]), served
    assert cached[1] < cached[2] < cached[3], served
    for (_, c, _), (_, _, previous_prompt) in zip(served[1:], served):
        assert c >= previous_prompt, served

    # The agent's residency estimate agrees with the server: the session is
    # resident where a slot holds its last prompt.
    node = nodes.pop()
    sessions = fleet.ctl("sessions")["sessions"]
    mine = [s for s in sessions if s["key"] == "kv-affinity"]
    assert [s["node"] for s in mine] == [node]
    assert mine[0]["requests"] == 4
    last_prompt = served[-1][2]
    holding = [s for s in slots(fleet.llama[node]) if s.get("n_prompt_tokens") == last_prompt]
    assert holding, slots(fleet.llama[node])
    assert holding[0]["n_prompt_tokens_cache"] > 0


def test_round_robin_loses_the_cache(fleet):
    served = converse(fleet.round_robin_url, "kv-round-robin", "You are a storyteller of the round-robin test.")
    nodes = [node for node, _, _ in served]
    assert len(set(nodes)) == 2, served
    # Turn 2 lands on the other node, which has never seen the conversation.
    assert nodes[1] != nodes[0]
    assert served[1][1] == 0, served
    affinity_like_hits = sum(1 for _, c, _ in served[1:] if c > 0)
    assert affinity_like_hits < 3, served
