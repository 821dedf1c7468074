"""A conversation's cache outlives its slot: each turn's slot is saved to
the agent's KV tier on disk when it ends, and restored into an idle slot
when the conversation returns to a server that no longer holds it (its
slot taken by others, the server restarted, the agent restarted). Real
llama-server, no host cache: a cached token can only come from a slot."""

import json
import random
import signal

from openai import OpenAI

from harness import http_get, wait_until

MODEL = "tiny-chat"
# One token each in the tiny model's vocabulary.
WORDS = "the of and to in is you that it he was for on are as with his they at be this from have or by".split()


def text(seed, words):
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def turn(fleet, messages, said):
    messages.append({"role": "user", "content": said})
    client = OpenAI(base_url=f"{fleet.url}/v1", api_key=fleet.api_key, max_retries=0, timeout=60)
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    return reply.usage


def history(usage):
    """What a turn leaves in its slot: its prompt and reply but the last
    token, which llama-server never evaluates."""
    return usage.prompt_tokens + usage.completion_tokens - 1


def events(fleet, event):
    return fleet.agent_metric("node-a", "inferyes_agent_kv_tier_events_total", backend="chat", event=event)


def restart_server(fleet):
    port = int(fleet.llama["node-a"].rsplit(":", 1)[1])
    fleet.servers["keeper"].send_signal(signal.SIGKILL)
    fleet.servers["keeper"].wait()
    fleet.start_llama_server("keeper", fleet.model, MODEL, fleet.llama_args, port=port, context=4096)


def wait_serving(fleet):
    """Waits until a restarted agent's node serves through the data plane."""
    probe = OpenAI(base_url=f"{fleet.url}/v1", api_key=fleet.api_key, max_retries=0, timeout=60)

    def serving():
        probe.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=1)
        return True

    wait_until("the restarted agent serving", serving, timeout=60)


def test_a_conversation_s_cache_outlives_its_slot_its_server_and_its_agent(keepers):
    fleet = keepers
    kept = [{"role": "system", "content": text("kept", 600)}]
    first = turn(fleet, kept, "begin")
    # Two other conversations take both slots; no host cache keeps it.
    for seed in ("other-1", "other-2"):
        turn(fleet, [{"role": "system", "content": text(seed, 400)}], "begin")
    wait_until("all three turns' slots kept", lambda: events(fleet, "saved") >= 3)
    assert len(list(fleet.slots.glob("kv-*.bin"))) == 3

    second = turn(fleet, kept, "and then")
    assert second.prompt_tokens_details.cached_tokens >= 0.9 * history(first), (first, second)
    assert events(fleet, "restored") == 1

    # inferyesctl and the dashboard show the tier.
    def shown():
        [backend] = fleet.ctl("node", "node-a")["backends"]
        view = json.loads(http_get(f"{fleet.dashboard_url}/api/v1/fleet",
                                   headers={"Authorization": f"Bearer {fleet.admin_token}"})[1])
        [card] = [g for g in view["gpus"] if g["node"] == "node-a"]
        tiers = (backend["kv_tier"], card["backends"][0]["kv_tier"])
        return tiers if all(t and t["restores"] == 1 and t["states"] >= 3 for t in tiers) else None

    ctl, dashboard = wait_until("the tier shown", shown)
    assert ctl["bytes"] > 0 and ctl["bytes"] == dashboard["bytes"], (ctl, dashboard)

    # The server restarts: its slots hold nothing, the tier still does.
    restarts = fleet.agent_metric("node-a", "inferyes_agent_backend_restarts_total", backend="chat")
    wait_until("the second turn's slot kept", lambda: events(fleet, "saved") >= 4)
    restart_server(fleet)
    wait_until("the agent saw its server restart", lambda: fleet.agent_metric(
        "node-a", "inferyes_agent_backend_restarts_total", backend="chat") > restarts)
    # The data plane hears that the server is ready again a moment later:
    # until then the turn is refused (503) before it reaches any node.
    sent = []

    def third_turn():
        messages = list(kept)
        usage = turn(fleet, messages, "and after")
        sent[:] = messages
        return usage

    third = wait_until("the restarted server routed to", third_turn)
    kept[:] = sent
    assert third.prompt_tokens_details.cached_tokens >= 0.9 * history(second), (second, third)
    assert events(fleet, "restored") == 2

    # The agent dies at once, and its server with it: the new agent finds
    # the tier on disk.
    wait_until("the third turn's slot kept", lambda: events(fleet, "saved") >= 5)
    fleet.kill_agent("node-a")
    restart_server(fleet)
    fleet.restart_agent("node-a")
    wait_serving(fleet)
    fourth = turn(fleet, kept, "and at last")
    assert fourth.prompt_tokens_details.cached_tokens >= 0.9 * history(third), (third, fourth)
    assert events(fleet, "restored") == 1, "counted by the new agent"
    assert events(fleet, "restore_failed") == 0


def test_a_state_changed_on_disk_is_never_restored(keepers):
    """A slot file altered after it was kept (a bad disk, a hand) is refused
    when the tier is read at start, and the turn recomputes."""
    fleet = keepers
    messages = [{"role": "system", "content": text("altered", 500)}]
    first = turn(fleet, messages, "begin")

    def records():
        found = [path for path in fleet.slots.glob("kv-*.json")
                 if json.loads(path.read_text())["tokens"] == history(first)]
        return found or None

    [record] = wait_until("its slot kept", records)
    state = record.with_suffix(".bin")
    fleet.kill_agent("node-a")
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    restart_server(fleet)
    fleet.restart_agent("node-a")
    wait_until("the restarted agent's tier read", lambda: http_get(
        f"{fleet.agent_admin['node-a']}/metrics")[0] == 200 and not state.exists(), timeout=60)
    assert not record.exists()
    wait_serving(fleet)
    restored = events(fleet, "restored"), events(fleet, "restore_failed")
    second = turn(fleet, messages, "and then")
    assert second.prompt_tokens_details.cached_tokens < 0.5 * history(first), second
    assert (events(fleet, "restored"), events(fleet, "restore_failed")) == restored, "nothing of it was kept"
