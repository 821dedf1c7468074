#!/usr/bin/env python3
"""Holds many connections to each port of a running local fleet from one
address (127.0.0.2) and times what everyone else gets meanwhile: 4,200
connections trickling a request head to the data plane, 1,100 silent ones
to an agent's proxy, 1,100 to the controller's HTTP port. Run the fleet at
the common descriptor limit, then this:

    prlimit --nofile=1024:1024 ./scripts/fleet.sh &
    python3 scripts/attack-listeners.py "$CARGO_TARGET_DIR/release/inferyesctl"

Prints, per port, what another client got and how long it took, and how
many of the attacker's connections were still open 3 s later (its share).
"""
import json, os, resource, socket, subprocess, sys, time, urllib.request

resource.setrlimit(resource.RLIMIT_NOFILE, (20000, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
CTL = sys.argv[1]
MODEL = "qwen2.5-7b-instruct"

def hold(port, count, first=b""):
    held, failed = [], 0
    for _ in range(count):
        s = socket.socket()
        s.bind(("127.0.0.2", 0))
        try:
            s.connect(("127.0.0.1", port))
            if first:
                s.sendall(first)
            held.append(s)
        except OSError:
            failed += 1
            s.close()
    return held, failed

def still_open(held, wait=3.0):
    time.sleep(wait)
    open_ = 0
    for s in held:
        s.setblocking(False)
        try:
            s.recv(65536)  # a refusal's answer, or the close
        except BlockingIOError:
            open_ += 1  # nothing to read: still held
        except OSError:
            pass
    return open_

def timed(what, f):
    t = time.monotonic()
    try:
        out = f()
        ok = True
    except Exception as e:
        out, ok = repr(e), False
    return what, ok, round(time.monotonic() - t, 3), out

def chat():
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}).encode()
    req = urllib.request.Request("http://127.0.0.1:8080/v1/chat/completions", body, {"content-type": "application/json"})
    return urllib.request.urlopen(req, timeout=15).status

def get(url):
    return urllib.request.urlopen(url, timeout=15).status

results = {}
# Row 1: 4,200 connections trickling a head to the data plane.
held, failed = hold(8080, 4200, b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
results["row1"] = {"opened": len(held), "connect_failed": failed,
                   "other": timed("chat from 127.0.0.1", chat), "attacker_open_after_3s": still_open(held)}
for s in held: s.close()
time.sleep(1)
# Row 2: 1,100 silent connections to an agent's proxy.
held, failed = hold(9101, 1100)
results["row2"] = {"opened": len(held), "connect_failed": failed,
                   "healthz": timed("proxy /healthz", lambda: get("http://127.0.0.1:9101/healthz")),
                   "chats": [timed("chat", chat) for _ in range(5)],
                   "attacker_open_after_3s": still_open(held)}
for s in held: s.close()
time.sleep(1)
# Row 3: 1,100 silent connections to the controller's HTTP port.
held, failed = hold(7071, 1100)
results["row3"] = {"opened": len(held), "connect_failed": failed,
                   "readyz": timed("/readyz", lambda: get("http://127.0.0.1:7071/readyz")),
                   "ctl_nodes": timed("inferyesctl nodes", lambda: subprocess.run([CTL, "nodes"], capture_output=True, timeout=20, check=True, env={**os.environ, "INFERYES_ADMIN_TOKEN_FILE": ".fleet/admin-token"}).returncode),
                   "attacker_open_after_3s": still_open(held)}
for s in held: s.close()
print(json.dumps(results, indent=1))
