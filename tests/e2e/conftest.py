"""A fleet of real llama-server nodes behind Inferyes, for the end-to-end
suite: etcd, a controller, two agents (node-a: one chat server; node-b: a chat
server and an embeddings server), and two data planes (session affinity, and
forced round-robin for comparison). Every process is the real binary.

Environment:
  INFERYES_BIN_DIR        where the Inferyes binaries are (default: target/debug)
  INFERYES_LLAMA_SERVER   a llama-server binary (default: scripts/llama-server.sh)
"""

import json
import secrets
import shutil
import tempfile
from pathlib import Path

import pytest

import make_models
from harness import Fleet, free_port, http_get, llama_server, wait_until


def start_llama_server(fleet, name, model, alias, extra=()):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    fleet.spawn(name, [
        fleet.llama_server, "-m", str(model), "--alias", alias, "--host", "127.0.0.1", "--port", str(port),
        "-c", "2048", "-t", "1", "--metrics", "--cache-ram", "0", *extra,
    ])
    wait_until(f"{name} healthy", lambda: http_get(f"{url}/health")[0] == 200)
    return url


@pytest.fixture(scope="session")
def fleet():
    tmp = Path(tempfile.mkdtemp(prefix="inferyes-e2e-"))
    fleet = Fleet(tmp)
    fleet.llama_server = llama_server()
    models = make_models.main(tmp / "models")
    try:
        etcd_port, peer_port = free_port(), free_port()
        etcd_url = f"http://127.0.0.1:{etcd_port}"
        etcd = shutil.which("etcd") or pytest.fail("etcd is required: apt-get install etcd-server")
        fleet.spawn("etcd", [
            etcd, "--name", "e2e", "--data-dir", str(tmp / "etcd"),
            "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
            "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-cluster", f"e2e=http://127.0.0.1:{peer_port}",
        ])
        wait_until("etcd healthy", lambda: http_get(f"{etcd_url}/health")[0] == 200)

        # Tokens on, as in production: every ctl call and agent presents one.
        fleet.admin_token_file = fleet.write("admin-token", secrets.token_urlsafe(24) + "\n")
        fleet.join_token_file = fleet.write("join-token", secrets.token_urlsafe(24) + "\n")
        grpc_port, http_port = free_port(), free_port()
        fleet.controller_url = f"http://127.0.0.1:{grpc_port}"
        controller = fleet.write("controller.toml", f"""
version = 1
controller_id = "e2e-controller"
etcd_endpoints = ["{etcd_url}"]
grpc_listen = "127.0.0.1:{grpc_port}"
http_listen = "127.0.0.1:{http_port}"
lease_ttl_ms = 3000
heartbeat_interval_ms = 500
admin_token_file = "{fleet.admin_token_file}"
join_token_file = "{fleet.join_token_file}"
""")
        fleet.spawn("controller", [str(fleet.bin / "inferyes-controller"), "--config", str(controller)])
        wait_until("controller ready", lambda: http_get(f"http://127.0.0.1:{http_port}/readyz")[0] == 200)
        fleet.api_key = fleet.ctl("keys", "create", "e2e")["secret"]

        chat = models / "tiny-chat.gguf"
        embed = models / "tiny-embed.gguf"
        fleet.llama = {
            "node-a": start_llama_server(fleet, "llama-a-chat", chat, "tiny-chat", ["-np", "4"]),
            "node-b": start_llama_server(fleet, "llama-b-chat", chat, "tiny-chat", ["-np", "4"]),
        }
        fleet.llama_embed = start_llama_server(
            fleet, "llama-b-embed", embed, "tiny-embed", ["-np", "2", "--embeddings", "--pooling", "mean"])

        def agent(node, backends):
            port = free_port()
            text = f"""
version = 1
node_id = "{node}"
controllers = ["{fleet.controller_url}"]
proxy_listen = "127.0.0.1:{port}"
poll_interval_ms = 250
join_token_file = "{fleet.join_token_file}"
[gpu]
source = "declared"
[[gpu.declared]]
name = "Declared test GPU"
memory_total_bytes = 8_000_000_000
"""
            for backend_id, url, endpoints in backends:
                text += f"""
[[backends]]
id = "{backend_id}"
url = "{url}"
kind = "llama-server"
endpoints = {json.dumps(endpoints)}
"""
            config = fleet.write(f"agent-{node}.toml", text)
            fleet.spawn(f"agent-{node}", [str(fleet.bin / "inferyes-agent"), "--config", str(config)])

        agent("node-a", [("chat", fleet.llama["node-a"], ["chat", "completion"])])
        agent("node-b", [
            ("chat", fleet.llama["node-b"], ["chat", "completion"]),
            ("embed", fleet.llama_embed, ["embedding"]),
        ])

        def dataplane(name, strategy):
            port = free_port()
            config = fleet.write(f"{name}.toml", f"""
version = 1
listen = "127.0.0.1:{port}"
controllers = ["{fleet.controller_url}"]
dataplane_id = "{name}"
routing_mode = "{strategy}"
join_token_file = "{fleet.join_token_file}"
""")
            fleet.spawn(name, [str(fleet.bin / "inferyes-dataplane"), "--config", str(config)])
            url = f"http://127.0.0.1:{port}"

            def ready():
                auth = {"Authorization": f"Bearer {fleet.api_key}"}
                models = json.loads(http_get(f"{url}/v1/models", headers=auth)[1])["data"]
                warm = {m["id"]: m["inferyes"]["warm_nodes"] for m in models}
                return warm.get("tiny-chat") == 2 and warm.get("tiny-embed") == 1

            wait_until(f"{name} routing over both nodes", ready)
            return url

        fleet.url = dataplane("dataplane", "policy")
        fleet.round_robin_url = dataplane("dataplane-rr", "round-robin")
        yield fleet
    finally:
        fleet.stop()
        print(f"\nend-to-end logs: {fleet.logs}")
