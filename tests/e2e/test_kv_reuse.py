"""KV-cache residency with real llama-server nodes: a conversation that
stays on its node reuses its cache every turn; spread round-robin, it does
not. Servers run with --cache-ram 0, so a cache hit can only come from the
slot that served the previous turn."""

import json
import urllib.request

from openai import OpenAI

from harness import wait_until


def converse(base_url, api_key, session, system, turns=4):
    client = OpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=60)
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
        served.append((raw.headers["x-inferyes-node"], cached, reply.usage.prompt_tokens,
                       reply.usage.completion_tokens))
    return served


def slots(url):
    with urllib.request.urlopen(f"{url}/slots", timeout=5) as response:
        return json.loads(response.read())


def test_a_conversation_stays_on_its_node_and_reuses_its_cache(fleet):
    served = converse(fleet.url, fleet.api_key, "kv-affinity", "You are a storyteller of the affinity test.")
    nodes = {node for node, *_ in served}
    assert len(nodes) == 1, served
    cached = [c for _, c, *_ in served]
    # The first turn shares only its template's first tokens with what an
    # earlier test left in the slot.
    assert cached[0] < served[0][2] // 4, served
    # Every later turn finds the previous prompt and reply in the slot.
    assert all(c > 0 for c in cached[1:]), served
    assert cached[1] < cached[2] < cached[3], served
    for (_, c, *_), (_, _, previous_prompt, _) in zip(served[1:], served):
        assert c >= previous_prompt, served

    # The agent's residency estimate agrees with the server: the session is
    # resident where a slot holds its last prompt.
    node = nodes.pop()
    def mine():
        # Session keys are scoped by the caller's API key: `k:<key id>/kv-affinity`.
        return [s for s in fleet.ctl("sessions")["sessions"] if s["key"].endswith("/kv-affinity")]

    # Reports reach the controller within a poll interval or so.
    wait_until("the agent reported all four turns", lambda: mine() and mine()[0]["requests"] == 4, timeout=10)
    assert [s["node"] for s in mine()] == [node]
    # A slot holds the last prompt and reply, less the last token, which
    # never enters the cache; `n_prompt_tokens` is that slot's token count.
    _, _, prompt, completion = served[-1]
    held = prompt + completion - 1
    here = [s for s in slots(fleet.llama[node]) if s.get("n_prompt_tokens") == held]
    assert here, slots(fleet.llama[node])
    other = "node-b" if node == "node-a" else "node-a"
    assert not [s for s in slots(fleet.llama[other]) if s.get("n_prompt_tokens") == held]


def test_round_robin_loses_the_cache(fleet):
    served = converse(fleet.round_robin_url, fleet.api_key, "kv-round-robin", "You are a storyteller of the round-robin test.")
    nodes = [node for node, *_ in served]
    assert len(set(nodes)) == 2, served
    # Turn 2 lands on the other node, which has never seen the conversation:
    # it reuses at most a prefix another conversation left there (the chat
    # template, "You are a storyteller of the"), never this one's first turn.
    assert nodes[1] != nodes[0]
    assert served[1][1] < served[0][2], served
    # A hit as affinity gives: the whole previous turn found in the cache
    # (what another conversation left of a common prefix is not one).
    affinity_like_hits = sum(1 for (_, c, *_), (_, _, previous_prompt, _) in zip(served[1:], served)
                             if c >= previous_prompt)
    assert affinity_like_hits < 3, served
