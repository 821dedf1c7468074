"""A drained node's conversations move to other nodes with their KV cache:
each one's slot is saved by its server, carried agent to agent and restored
on a node that serves the model, and its next turn there reads its history
from cache instead of computing it again. A restore that holds nothing
(a server whose cache layout differs from what its agent was told) is
caught by the next turn and the node takes no more."""

import hashlib
import hmac
import http.client
import json
import socket
import time
import urllib.error
import urllib.request

import pytest
from openai import OpenAI

from conftest import GEMMA, MOVERS_MAX_SLOT_BYTES
from harness import http_get, wait_until
from test_real_model import system_prompt


def client(fleet):
    return OpenAI(base_url=f"{fleet.url}/v1", api_key=fleet.api_key, max_retries=0, timeout=120)


def turn(fleet, messages, text, **extra):
    """One turn of a conversation: its node, route and usage."""
    messages.append({"role": "user", "content": text})
    raw = client(fleet).chat.completions.with_raw_response.create(
        model=GEMMA, messages=messages, max_tokens=12, temperature=0, **extra)
    reply = raw.parse()
    messages.append({"role": "assistant", "content": reply.choices[0].message.content or "."})
    return raw.headers["x-inferyes-node"], raw.headers["x-inferyes-route"], reply.usage


def move_files(directory):
    """The slot files moves wrote in a slots directory and left there; the
    KV tier keeps its own (`kv-`)."""
    return [path for path in directory.iterdir() if path.name.startswith("inferyes-")]


def sessions_by_node(fleet):
    return sorted((s["node"], s["tokens"]) for s in fleet.ctl("sessions")["sessions"])


def test_a_drained_node_s_conversations_move_with_their_cache(movers):
    fleet = movers
    # Only node-a takes new conversations while they begin.
    for node in ("node-b", "node-c"):
        fleet.ctl("drain", node)
    fleet.wait_routing()
    # Histories of different lengths: a slot is found by its tokens.
    conversations = [[{"role": "system", "content": system_prompt(f"move-{i}", rules=12 + 3 * i)}] for i in range(2)]
    first = [turn(fleet, messages, "Which stone is first?") for messages in conversations]
    assert [node for node, _, _ in first] == ["node-a", "node-a"], first
    for node in ("node-b", "node-c"):
        fleet.ctl("undrain", node)
    fleet.wait_routing()
    wait_until("both conversations resident on node-a", lambda: [n for n, _ in sessions_by_node(fleet)] == ["node-a"] * 2)

    fleet.ctl("drain", "node-a")

    def finished():
        moves = fleet.ctl("node", "node-a")["moves"]
        return moves if moves and moves["finished_unix_ms"] else None

    wait_until("node-a's drain moved its conversations", finished, timeout=60)
    moves = finished()
    assert (moves["sessions"], moves["moved"], moves["failed"], moves["not_movable"]) == (2, 2, 0, 0), moves
    assert moves["bytes"] > 1_000_000, moves
    # The dashboard shows it too.
    view = json.loads(http_get(f"{fleet.dashboard_url}/api/v1/fleet",
                               headers={"Authorization": f"Bearer {fleet.admin_token}"})[1])
    [card] = [g for g in view["gpus"] if g["node"] == "node-a"]
    assert (card["moves"]["moved"], card["moves"]["running"]) == (2, False), card
    # The most recent first, to the roomiest node: node-b, then node-c.
    wait_until("the conversations resident where they moved",
               lambda: [n for n, _ in sessions_by_node(fleet)] == ["node-b", "node-c"])

    later = [turn(fleet, messages, "And which comes next?") for messages in conversations]
    (node_held, route_held, held), (node_lost, route_lost, lost) = later[1], later[0]
    assert (node_held, route_held) == ("node-b", "resident"), later
    history = first[1][2].prompt_tokens + first[1][2].completion_tokens - 1
    assert held.prompt_tokens_details.cached_tokens >= 0.9 * history, later

    # node-c's server has no --swa-full: the restore answered, and held
    # nothing; its agent finds it out from the turn and says so.
    assert (node_lost, route_lost) == ("node-c", "resident"), later
    assert lost.prompt_tokens_details.cached_tokens < 0.5 * history, later

    def refuses():
        [backend] = fleet.ctl("node", "node-c")["backends"]
        return backend if not backend["slot_fingerprint"] else None

    backend = wait_until("node-c takes no more slots", refuses, timeout=10)
    assert "read next to nothing from cache" in backend["slots_unmovable"], backend
    [backend_b] = fleet.ctl("node", "node-b")["backends"]
    assert backend_b["slot_fingerprint"], backend_b


def test_every_backend_says_whether_its_slots_can_move(movers, fleet):
    [backend] = movers.ctl("node", "node-b")["backends"]
    assert len(backend["slot_fingerprint"]) == 32 and backend["slots_unmovable"] == "", backend
    # The tiny fleet's servers have no --slot-save-path, nor their agents a
    # slots directory.
    [backend] = fleet.ctl("node", "node-a")["backends"]
    assert backend["slot_fingerprint"] == "", backend
    assert backend["slots_unmovable"] == "no slots dir configured (backends.slots)", backend


def mac(key, text):
    return hmac.new(key.encode(), text.encode(), hashlib.sha256).hexdigest()


def instance(fleet, node):
    """The digest of the agent instance that holds `node` now."""
    return fleet.ctl("node", node)["instance_digest"]


def proxy_credential(fleet, node):
    """What the controller issues `node`'s agent for data planes to present."""
    return mac(mac(fleet.fleet_key(), "inferyes node proxy key v3"),
               f"inferyes node proxy v3 {node} {instance(fleet, node)}")


def join_derived_proxy_credential(fleet, node):
    """What the join token derives for `node`: all an agent that holds it
    could make of another node's credential."""
    join = fleet.join_token_file.read_text().strip()
    return mac(mac(join, "inferyes agent proxy key v2"), f"inferyes agent proxy v2 {node}")


def grant_expiry(now_ms=None):
    """As a controller makes it: the end of the next 5-minute period."""
    period = 300_000
    return ((now_ms or int(time.time() * 1000)) // period + 2) * period


def slot_headers(fleet, body, until, to="node-b", sender="node-a", digest=None, length=None, fingerprint=None,
                 session="root-attacker", tokens=100, host="127.0.0.1", grant_until=None, join_derived=False,
                 to_instance=None):
    """A slot file's headers, with the credential a sender makes of its
    controller's grant (as the controller makes it, of the fleet key): by
    default for root-attacker's 100 tokens on the `chat` backend, from
    node-a at 127.0.0.1. `join_derived`: made as credentials were of the
    join token, all an agent holding it could make; `to_instance`: made for
    another agent that held the receiving node's id."""
    digest = digest or hashlib.sha256(body).hexdigest()
    fingerprint = fingerprint or fleet.ctl("node", to)["backends"][0]["slot_fingerprint"]
    grant_until = grant_until or grant_expiry()
    if join_derived:
        join = fleet.join_token_file.read_text().strip()
        move = f"inferyes slot move v2 {sender} {to} chat {tokens} {until} {digest} {session}"
        credential = mac(mac(join, "inferyes slot move key v2"), move)
    else:
        intake = mac(fleet.fleet_key(), f"inferyes slot intake v3 {to} {to_instance or instance(fleet, to)}")
        grant = mac(intake, f"inferyes move grant v3 {sender} {to} chat {grant_until} {host}")
        credential = mac(grant, f"inferyes slot move v3 {sender} {to} chat {tokens} {until} {digest} {session}")
    return {
        "Authorization": f"Bearer {credential}", "x-inferyes-move-from": sender,
        "x-inferyes-move-from-host": host, "x-inferyes-move-grant-expires": str(grant_until),
        "x-inferyes-move-expires": str(until), "x-inferyes-backend": "chat", "x-inferyes-model": GEMMA,
        "x-inferyes-session": session, "x-inferyes-slot-tokens": str(tokens),
        "x-inferyes-slot-fingerprint": fingerprint, "x-inferyes-slot-sha256": digest,
        "Content-Length": str(length or len(body)), "Content-Type": "application/octet-stream",
    }


def put_slot(url, headers, body, timeout=30):
    request = urllib.request.Request(f"{url}/_inferyes/slots", data=body, method="PUT", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_a_node_takes_a_slot_only_with_its_credential_and_a_file_that_checks_out(movers):
    fleet = movers
    url = fleet.ctl("node", "node-b")["proxy_url"]
    slots_dir = fleet.tmp / "slots-node-b"
    body = b"not a slot" * 100
    # As a sender makes one: good for 5 minutes from when it is made (a node
    # takes none made before it started).
    expires = int(time.time() * 1000) + 300_000

    def headers(until=expires, **rest):
        return slot_headers(fleet, body, until, **rest)

    refusals = {
        "no credential": ({k: v for k, v in headers().items() if k != "Authorization"}, 401, "invalid_credential"),
        # A stranger learns nothing of the node's backends.
        "no credential, for a backend it lacks": (
            {**{k: v for k, v in headers().items() if k != "Authorization"}, "x-inferyes-backend": "nope"},
            401, "invalid_credential"),
        # What planted a conversation before: a credential made of the join
        # token, which every agent holds.
        "made of the join token": (headers(join_derived=True), 401, "invalid_credential"),
        "another node's": (headers(to="node-c"), 401, "invalid_credential"),
        # What an agent that held node-b's id before (its lease since run
        # out) was issued opens nothing now.
        "for another agent of node-b": (headers(to_instance="0" * 64), 401, "invalid_credential"),
        "another host's claim": ({**headers(), "x-inferyes-move-from-host": "127.0.0.2"}, 401, "invalid_credential"),
        "a grant expired": (headers(grant_until=grant_expiry() - 600_000), 401, "invalid_credential"),
        "a grant too far ahead": (headers(grant_until=grant_expiry() + 600_000), 401, "invalid_credential"),
        # The grant names node-a at another address: a node's identity is
        # no use from anywhere else.
        "from another address": (headers(host="127.0.0.2", until=expires + 4), 403, "wrong_address"),
        "another sender's claim": ({**headers(), "x-inferyes-move-from": "node-c"}, 401, "invalid_credential"),
        "another conversation's": ({**headers(), "x-inferyes-session": "root-other"}, 401, "invalid_credential"),
        "another file's": ({**headers(), "x-inferyes-slot-sha256": "1" * 64}, 401, "invalid_credential"),
        "expired": (headers(until=expires - 300_000), 401, "invalid_credential"),
        "another fingerprint": (headers(fingerprint="0" * 32, until=expires + 1), 503, "fingerprint_differs"),
        "the wrong digest": (headers(digest="0" * 64), 400, "digest_mismatch"),
        "a credential taken before": (headers(digest="0" * 64), 401, "invalid_credential"),
        "too large": (headers(length=MOVERS_MAX_SLOT_BYTES + 1, until=expires + 2), 413, "slot_too_large"),
        # Refused before the body is read, so never mind it is shorter.
        "more than the disk has room for": (headers(length=MOVERS_MAX_SLOT_BYTES, until=expires + 3), 503, "no_room"),
        # The hash checks out; the server refuses the file, which the
        # agent says, never believed restored.
        "not a slot file": (headers(), 502, "restore_failed"),
        "that file again": (headers(), 401, "invalid_credential"),
    }
    for what, (sent, status, code) in refusals.items():
        answer = put_slot(url, sent, body)
        assert answer[0] == status and answer[1]["error"]["code"] == code, (what, answer)
    # Whatever came of them, no file is left behind.
    assert move_files(slots_dir) == [], move_files(slots_dir)
    assert "root-attacker" not in {s["key"] for s in fleet.ctl("sessions")["sessions"]}

    # The servers' slot endpoints are not reachable through the proxy, even
    # with the node's own credential (what data planes hold).
    credential = proxy_credential(fleet, "node-b")
    for path in ("/slots", "/slots/0?action=erase"):
        request = urllib.request.Request(f"{url}{path}", data=b'{"filename":"x"}', method="POST",
                                         headers={"Authorization": f"Bearer {credential}"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 404, path


def begin_on_node_a(fleet, seed, rules, **extra):
    """A new conversation's first turn, which node-a alone takes: its
    messages, usage, and the sessions there were before it."""
    fleet.ctl("undrain", "node-a")
    for node in ("node-b", "node-c"):
        fleet.ctl("drain", node)
    fleet.wait_routing()
    before = {s["key"] for s in fleet.ctl("sessions")["sessions"]}
    messages = [{"role": "system", "content": system_prompt(seed, rules=rules)}]
    node, _, usage = turn(fleet, messages, "Which stone is first?", **extra)
    assert node == "node-a", node
    return messages, usage, before


def test_a_data_plane_has_a_conversation_s_cache_carried_where_it_asks(movers):
    fleet = movers
    messages, usage, before = begin_on_node_a(fleet, "carry", 14)
    history = usage.prompt_tokens + usage.completion_tokens - 1

    def resident_on(node):
        return [s["key"] for s in fleet.ctl("sessions")["sessions"] if s["node"] == node]

    [key] = wait_until("the conversation resident on node-a",
                       lambda: [k for k in resident_on("node-a") if k not in before] or None)
    home = fleet.ctl("node", "node-a")["proxy_url"]
    credential = proxy_credential(fleet, "node-a")

    def carry(headers):
        request = urllib.request.Request(f"{home}/_inferyes/slots/carry", data=b"", method="POST", headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    asked = {"Authorization": f"Bearer {credential}", "x-inferyes-session": key, "x-inferyes-move-to": "node-b",
             "x-inferyes-move-to-backend": "chat", "x-inferyes-backend": "chat"}
    # node-b takes sessions again, and node-a's controller names it a peer.
    fleet.ctl("undrain", "node-b")
    fleet.wait_routing()
    wait_until("node-b a peer of node-a",
               lambda: carry({**asked, "x-inferyes-session": "root-nobody"})[1]["error"]["code"] == "not_resident")
    # Only a data plane (the node's credential) may ask: not an agent that
    # joined (node-c's credential is no use at node-a), nor one holding
    # only the join token; only for a conversation resident there; only to
    # a peer its controller named.
    assert carry({k: v for k, v in asked.items() if k != "Authorization"})[0] == 401
    for other in (proxy_credential(fleet, "node-c"), join_derived_proxy_credential(fleet, "node-a")):
        assert carry({**asked, "Authorization": f"Bearer {other}"})[0] == 401
    for peer in ({"x-inferyes-move-to": "node-zz"}, {"x-inferyes-move-to-backend": "other"}):
        status, answer = carry({**asked, **peer})
        assert (status, answer["error"]["code"]) == (404, "unknown_peer"), answer

    status, answer = carry(asked)
    assert status == 200 and answer["tokens"] == history and answer["bytes"] > 1_000_000, answer
    # Each node's agent reports its side: the one that took it, the one
    # that gave it up.
    wait_until("the conversation resident on node-b only",
               lambda: key in resident_on("node-b") and key not in resident_on("node-a"))
    # node-a drained, the next turn goes to node-b whether or not the data
    # plane has heard of the move yet: its cache is there either way.
    fleet.ctl("drain", "node-a")
    fleet.wait_routing()
    node, route, usage = turn(fleet, messages, "And which comes next?")
    assert node == "node-b" and route in ("resident", "placed"), (node, route)
    assert usage.prompt_tokens_details.cached_tokens >= 0.9 * history, usage


def generating(server):
    """A stream that keeps one of `server`'s slots busy until closed."""
    work = json.dumps({"prompt": "Count:", "n_predict": 3000, "ignore_eos": True, "stream": True}).encode()
    request = urllib.request.Request(f"{server}/completion", data=work, headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(request, timeout=30)


def busy_slots(server):
    return sum(s["is_processing"] for s in json.loads(http_get(f"{server}/slots")[1]))


def test_a_node_with_no_idle_slot_refuses_a_slot_file_before_it_is_sent(movers):
    fleet = movers
    server = fleet.llama["node-b"]
    # Both of node-b's slots generate until their streams are closed.
    streams = []
    try:
        for _ in range(2):
            streams.append(generating(server))
        wait_until("both of node-b's slots busy", lambda: busy_slots(server) == 2)
        # 64 MiB promised, ten bytes sent: the answer comes without
        # waiting for the rest.
        body = b"0123456789"
        sent = slot_headers(fleet, body, int(time.time() * 1000) + 300_000, length=64 << 20)
        status, answer = put_slot(fleet.ctl("node", "node-b")["proxy_url"], sent, body)
        assert (status, answer["error"]["code"]) == (503, "no_free_slot"), answer
        # A file small enough is read whole before the refusal: its sender
        # hears the refusal, not a connection closed under its write.
        body = bytes(24 << 20)
        sent = slot_headers(fleet, body, int(time.time() * 1000) + 300_000, session="root-small")
        status, answer = put_slot(fleet.ctl("node", "node-b")["proxy_url"], sent, body)
        assert (status, answer["error"]["code"]) == (503, "no_free_slot"), answer
    finally:
        for stream in streams:
            stream.close()
    assert move_files(fleet.tmp / "slots-node-b") == []


def run_in_slot(fleet, node, slot, prompt):
    """`prompt` read into `node`'s server's `slot`, and a few tokens written."""
    ran = json.dumps({"prompt": prompt, "n_predict": 4, "id_slot": slot}).encode()
    request = urllib.request.Request(f"{fleet.llama[node]}/completion", data=ran,
                                     headers={"Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=60).read()


def saved_slot(fleet, node, prompt):
    """A real slot file of `node`'s server: `prompt` read into slot 0 and
    saved; its bytes and tokens."""
    server, slots_dir = fleet.llama[node], fleet.tmp / f"slots-{node}"
    run_in_slot(fleet, node, 0, prompt)
    json_type = {"Content-Type": "application/json"}
    save = urllib.request.Request(f"{server}/slots/0?action=save", data=b'{"filename":"saved.bin"}', headers=json_type)
    with urllib.request.urlopen(save, timeout=60) as response:
        tokens = json.loads(response.read())["n_saved"]
    body = (slots_dir / "saved.bin").read_bytes()
    (slots_dir / "saved.bin").unlink()
    return body, tokens


def test_a_slot_restored_into_and_not_run_since_is_not_idle(movers):
    fleet = movers
    server, slots_dir = fleet.llama["node-b"], fleet.tmp / "slots-node-b"
    url = fleet.ctl("node", "node-b")["proxy_url"]
    body, tokens = saved_slot(fleet, "node-b", "Name three stones.")
    stream = generating(server)
    try:
        wait_until("one of node-b's slots busy", lambda: busy_slots(server) == 1)
        until = int(time.time() * 1000) + 300_000
        status, answer = put_slot(url, slot_headers(fleet, body, until, session="root-marked", tokens=tokens), body)
        assert status == 200 and answer["n_restored"] == tokens, answer
        # The other slot shows idle and empty, but holds the file just
        # restored: a file promised now is refused before it is sent,
        # not read for a minute and then refused.
        ten = b"0123456789"
        sent = slot_headers(fleet, ten, until + 1, session="root-marked-2", length=64 << 20)
        status, answer = put_slot(url, sent, ten, timeout=10)
        assert (status, answer["error"]["code"]) == (503, "no_free_slot"), answer
    finally:
        stream.close()
    assert move_files(slots_dir) == []


def test_a_transfer_from_a_fleet_node_outlives_a_flood_of_strangers_and_30_seconds(movers):
    """From an address no data plane vouches for (a sender on a host of
    its own), a slot file trickles in for longer than a stranger may go
    unproven, amid idle strangers from six other addresses, more than
    node-b keeps for strangers (16) each time they come: the sender's
    move, checked as it opens, makes it a fleet member's, and the file is
    restored."""
    fleet = movers
    url = fleet.ctl("node", "node-b")["proxy_url"]
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body, tokens = saved_slot(fleet, "node-b", "Name four rivers.")
    strangers = []

    def flood(addresses):
        # 8 from each (node-b's bound per address).
        for address in addresses:
            for _ in range(8):
                strangers.append(socket.create_connection((host, int(port)), timeout=10, source_address=(address, 0)))

    sender = "127.0.0.3"
    sent = slot_headers(fleet, body, int(time.time() * 1000) + 300_000, host=sender, session="root-trickled",
                        tokens=tokens)
    try:
        flood(("127.0.0.2", "127.0.0.4", "127.0.0.5"))
        connection = http.client.HTTPConnection(host, int(port), timeout=120, source_address=(sender, 0))
        connection.putrequest("PUT", "/_inferyes/slots", skip_accept_encoding=True)
        for name, value in sent.items():
            connection.putheader(name, value)
        connection.endheaders()
        started = time.monotonic()
        pieces = 8
        step = -(-len(body) // pieces)
        for i in range(pieces):
            connection.send(body[i * step:(i + 1) * step])
            if i == 1:
                # Newer strangers than the sender, as many again: room is
                # made for them by closing the oldest strangers'.
                flood(("127.0.0.6", "127.0.0.7", "127.0.0.8"))
            time.sleep(4.5)  # a trickle: a byte rate, not an event
        answer = connection.getresponse()
        taken = json.loads(answer.read())
        connection.close()
    finally:
        for stranger in strangers:
            stranger.close()
    assert time.monotonic() - started > 31, "longer than a stranger may go unproven"
    assert answer.status == 200 and taken["n_restored"] == tokens, taken
    assert move_files(fleet.tmp / "slots-node-b") == []


def restores_checked(fleet, node, outcome):
    """What node's agent counted of restored slots' next turns."""
    metrics = http_get(f"{fleet.agent_admin[node]}/metrics")[1].decode()
    name = f'inferyes_agent_slot_restores_checked_total{{backend="chat",outcome="{outcome}"}}'
    return sum(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(name))


def drain(fleet, node):
    """Drains `node`; what its drain moved, once it finished."""
    before = (fleet.ctl("node", node)["moves"] or {}).get("finished_unix_ms")

    def finished():
        moves = fleet.ctl("node", node)["moves"]
        return moves if moves and moves["finished_unix_ms"] not in (None, 0, before) else None

    fleet.ctl("drain", node)
    return wait_until(f"{node}'s drain moved its conversations", finished, timeout=60)


def test_a_drain_sends_what_the_kv_tier_kept_of_a_conversation_whose_slot_was_taken(movers):
    """Work the agent did not see takes both of node-a's slots after a
    conversation's turn: its drain finds no slot holding the conversation,
    and sends what node-a's KV tier kept of it instead."""
    fleet = movers
    messages, usage, _ = begin_on_node_a(fleet, "kept-in-the-tier", 15)
    history = usage.prompt_tokens + usage.completion_tokens - 1

    def kept():
        records = (fleet.tmp / "slots-node-a").glob("kv-*.json")
        return any(json.loads(record.read_text())["tokens"] == history for record in records)

    wait_until("its slot kept in node-a's tier", kept)
    for node, prompt in (("node-a", "Name two hills."), ("node-b", "Name two rivers.")):
        for slot in (0, 1):
            run_in_slot(fleet, node, slot, prompt)
    fleet.ctl("undrain", "node-b")
    fleet.wait_routing()
    moves = drain(fleet, "node-a")
    assert moves["moved"] >= 1 and moves["failed"] == 0, moves
    node, _, later = turn(fleet, messages, "And which comes next?")
    assert node == "node-b", node
    assert later.prompt_tokens_details.cached_tokens >= 0.9 * history, (history, later)
    fleet.ctl("undrain", "node-a")
    fleet.wait_routing()


def test_a_turn_that_sends_another_history_after_a_move_costs_its_node_no_moves(movers):
    """A conversation moved to node-b; its client then sends another
    history under its key (an edited first message): a new branch, which
    reads next to nothing of what was restored and costs node-b nothing.
    Drained after it, node-b moves the conversation on with its cache."""
    fleet = movers
    key = {"prompt_cache_key": "edited-after-a-move"}

    def chat(messages, text):
        node, _, usage = turn(fleet, messages, text, extra_body=key)
        return node, usage

    # node-b's slots each run a task: none is one restored into and not run
    # since, which would take no move.
    for slot in (0, 1):
        run_in_slot(fleet, "node-b", slot, "Name two hills.")
    # It begins on node-a; node-c (whose restores hold nothing) takes no part.
    _, _, before = begin_on_node_a(fleet, "branch", 12, extra_body=key)
    fleet.ctl("undrain", "node-b")
    fleet.wait_routing()

    def resident(node):
        return {s["key"] for s in fleet.ctl("sessions")["sessions"] if s["node"] == node}

    [ours] = wait_until("the conversation resident on node-a", lambda: resident("node-a") - before or None)
    # The most recent first, to the one node taking sessions.
    moves = drain(fleet, "node-a")
    assert moves["moved"] >= 1 and moves["failed"] == 0, moves
    wait_until("the conversation resident on node-b", lambda: ours in resident("node-b"))

    # Another history under the same key, longer than what was restored.
    diverged = restores_checked(fleet, "node-b", "diverged")
    edited = [{"role": "system", "content": system_prompt("edited", rules=16)}]
    node, usage = chat(edited, "Which river is first?")
    assert node == "node-b", node
    assert usage.prompt_tokens_details.cached_tokens < 0.5 * usage.prompt_tokens, usage
    wait_until("node-b's agent judged the turn a new branch",
               lambda: restores_checked(fleet, "node-b", "diverged") > diverged)
    assert restores_checked(fleet, "node-b", "reused_nothing") == 0
    [backend] = fleet.ctl("node", "node-b")["backends"]
    assert backend["slot_fingerprint"] and backend["slots_unmovable"] == "", backend

    # node-b drained: the conversation, as it now is, moves to node-a with
    # its cache.
    fleet.ctl("undrain", "node-a")
    fleet.wait_routing()
    moves = drain(fleet, "node-b")
    assert moves["moved"] >= 1 and moves["failed"] == 0, moves
    wait_until("the conversation resident on node-a", lambda: ours in resident("node-a"))
    history = usage.prompt_tokens + usage.completion_tokens - 1
    node, usage = chat(edited, "And which comes next?")
    assert node == "node-a", node
    assert usage.prompt_tokens_details.cached_tokens >= 0.9 * history, usage
    fleet.ctl("undrain", "node-b")
    fleet.wait_routing()
