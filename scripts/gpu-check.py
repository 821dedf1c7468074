#!/usr/bin/env python3
"""Checks a GPU host end to end, with real parts only: the agent's GPU
readings against nvidia-smi's own, from NVML and from nvidia-smi, and a
llama-server built with CUDA serving chats through the agent, its memory
on the GPU and seen in the agent's reading.

    python3 scripts/gpu-check.py --agent PATH --llama-server PATH --model GGUF

`--llama-server` may be a llama.cpp source tree instead (a directory): it
is built with CUDA for the GPU found (cmake, ninja, nvcc). Each check prints
`ok` or `FAIL` with what it saw; the exit status is the number failed.
Needs python3, nvidia-smi and the NVIDIA driver's libnvidia-ml; nothing
is fetched.
"""

import argparse
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

NODE_ID = "gpu-check"
MIB = 1 << 20
failed = 0


def check(what, passed, seen):
    global failed
    print(f"{'ok  ' if passed else 'FAIL'} {what}: {seen}", flush=True)
    failed += 0 if passed else 1


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method, url, body=None, headers=None, timeout=60):
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode(errors="replace"), dict(response.headers)
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace"), dict(error.headers)


def wait_until(what, timeout, probe, process=None):
    """Polls `probe` until it returns something true, at most `timeout` s,
    or until `process` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{what}: the process exited ({process.returncode})")
        try:
            value = probe()
        except OSError:
            value = None
        if value:
            return value
        time.sleep(0.25)
    raise TimeoutError(f"{what}: nothing within {timeout}s")


def smi():
    """nvidia-smi's own reading of each GPU: (name, total MiB, used MiB)."""
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,memory.total,memory.used", "--format=csv,noheader,nounits"],
        check=True, capture_output=True, text=True, timeout=30,
    ).stdout
    return [tuple(f.strip() for f in line.split(",")) for line in out.strip().splitlines()]


def metrics(admin):
    """The agent's gauges, `name{labels}` -> value."""
    status, text, _ = http("GET", f"http://{admin}/metrics")
    assert status == 200, status
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def stop(process):
    """Ends a process this check started, killing it if it does not stop."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def gpu_index(key):
    """A GPU gauge's `gpu` label, as a number (`gpu="10"` after `gpu="2"`)."""
    found = re.search(r'gpu="(\d+)"', key)
    return int(found.group(1)) if found else -1


def gauge(values, suffix):
    return {k: v for k, v in values.items() if k.split("{")[0].endswith(suffix)}


def start_agent(binary, work, source, backend_url, log):
    proxy, admin = free_port(), free_port()
    config = os.path.join(work, f"agent-{source}.toml")
    backends = f'[[backends]]\nid = "main"\nurl = "{backend_url}"\nkind = "llama-server"\n'
    with open(config, "w") as f:
        # No controller answers: the agent's readings and proxy do not wait
        # for one. No join token: a controller issues the credential a
        # closed agent takes, and none answers.
        f.write(
            f'version = 1\nnode_id = "{NODE_ID}"\ncontrollers = ["http://127.0.0.1:{free_port()}"]\n'
            f'proxy_listen = "127.0.0.1:{proxy}"\nadmin_listen = "127.0.0.1:{admin}"\n'
            f'[gpu]\nsource = "{source}"\n{backends}'
        )
    env = dict(os.environ, RUST_LOG="info")
    env.pop("INFERYES_JOIN_TOKEN", None)
    process = subprocess.Popen([binary, "--config", config], stdout=log, stderr=subprocess.STDOUT, env=env)
    return process, f"127.0.0.1:{proxy}", f"127.0.0.1:{admin}"


def readings_match(binary, work, source, out):
    """The agent reading from `source` reports what nvidia-smi reads."""
    with open(os.path.join(out, f"agent-{source}.log"), "w") as log:
        # A backend that does not answer: readings do not wait for one.
        agent, _, admin = start_agent(binary, work, source, f"http://127.0.0.1:{free_port()}", log)
        try:
            totals = wait_until(
                f"{source} readings", 30, lambda: gauge(metrics(admin), "gpu_memory_total_bytes"), agent
            )
            used = gauge(metrics(admin), "gpu_memory_used_bytes")
            own = smi()
        finally:
            stop(agent)
    check(f"{source}: one reading per GPU", len(totals) == len(own), f"{len(totals)} read, {len(own)} in nvidia-smi")
    for (name, total_mib, used_mib), (key, total) in zip(own, sorted(totals.items(), key=lambda kv: gpu_index(kv[0]))):
        check(f"{source}: {name} is named", f'name="{name}"' in key, key)
        check(f"{source}: total memory", int(total) // MIB == int(total_mib), f"{int(total) // MIB} MiB, nvidia-smi {total_mib} MiB")
        reading = next((v for k, v in used.items() if k.split("{", 1)[-1] == key.split("{", 1)[-1]), None)
        # Used memory moves with other processes: within 256 MiB.
        near = reading is not None and abs(reading / MIB - int(used_mib)) <= 256
        check(f"{source}: used memory", near, f"{None if reading is None else int(reading) // MIB} MiB, nvidia-smi {used_mib} MiB")


def stage(what, logs, run, *args):
    """Runs one stage; one that breaks off is a failure, shown with the
    last lines of its logs (where a process says why it stopped)."""
    try:
        run(*args)
    except Exception as error:  # noqa: BLE001 - any break is this stage's failure
        check(what, False, f"broke off: {error}")
        for path in logs:
            if os.path.exists(path):
                with open(path, errors="replace") as log:
                    print(f"--- {path}:\n" + "".join(log.readlines()[-20:]), flush=True)


def build_llama_server(src, work, out):
    """Starts building llama-server with CUDA for this machine's GPU from a
    source tree; returns the build and where its binary will be."""
    build = os.path.join(work, "llama-build")
    cap = subprocess.run(
        ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True, text=True, check=True
    ).stdout.split()[0].replace(".", "")
    configure = [
        "cmake", "-S", src, "-B", build, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_CUDA=ON",
        f"-DCMAKE_CUDA_ARCHITECTURES={cap}-real", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_UI=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_COMMIT=unknown",
        "-DGGML_NATIVE=OFF", "-DGGML_OPENMP=OFF", "-DGGML_BACKEND_DL=OFF",
        # Minutes, not tens of them: no flash-attention kernels (llama-server
        # runs without), no multi-GPU collectives, no fatbin compression.
        "-DGGML_CUDA_FA=OFF", "-DGGML_CUDA_NCCL=OFF", "-DGGML_CUDA_COMPRESSION_MODE=none",
    ]
    compile_ = ["cmake", "--build", build, "--target", "llama-server", f"-j{os.cpu_count()}"]
    script = " && ".join(shlex.join(command) for command in (configure, compile_))
    with open(os.path.join(out, "llama-build.log"), "w") as log:
        process = subprocess.Popen(["sh", "-c", script], stdout=log, stderr=subprocess.STDOUT)
    return process, os.path.join(build, "bin", "llama-server")


def served_on_the_gpu(binary, llama_server, model, source, work, out):
    """A chat through the agent, answered by llama-server on the GPU; the
    agent's reading before the server starts and after it served."""
    port = free_port()
    agent = server = None
    with open(os.path.join(out, "agent-llama.log"), "w") as agent_log, \
            open(os.path.join(out, "llama-server.log"), "w") as server_log:
        try:
            agent, proxy, admin = start_agent(binary, work, source, f"http://127.0.0.1:{port}", agent_log)
            used = lambda: gauge(metrics(admin), "gpu_memory_used_bytes")  # noqa: E731
            before = sum(wait_until("the agent's first reading", 30, used, agent).values()) // MIB
            server = subprocess.Popen(
                [llama_server, "--model", model, "--host", "127.0.0.1", "--port", str(port), "--n-gpu-layers", "99",
                 "--parallel", "2", "--ctx-size", "4096", "--alias", "tiny-chat", "--slots"],
                stdout=server_log, stderr=subprocess.STDOUT,
            )
            ready = lambda: http("GET", f"http://127.0.0.1:{port}/health", timeout=5)[0] == 200  # noqa: E731
            wait_until("llama-server ready", 300, ready, server)
            up = lambda: any(v == 1 for v in gauge(metrics(admin), "backend_up").values())  # noqa: E731
            wait_until("the backend up", 30, up, agent)
            chats(proxy, admin)
            # The server's process holds memory on a GPU, where nvidia-smi
            # can name processes (not from inside another PID namespace).
            apps = subprocess.run(
                ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                capture_output=True, text=True,
            ).stdout
            holders = dict(line.split(", ", 1) for line in apps.strip().splitlines() if ", " in line)
            if holders:
                held = holders.get(str(server.pid), "0")
                check("llama-server holds GPU memory", not held.isdigit() or int(held) > 0, f"pid {server.pid}; {holders}")
            else:
                print(f"note nvidia-smi names no process here (pid {server.pid})", flush=True)
            # Refreshed every few seconds: the rise is awaited, not assumed.
            rose = lambda: sum(used().values()) // MIB > before  # noqa: E731
            try:
                wait_until("a rise", 15, rose, agent)
            except TimeoutError:
                pass
            now = sum(used().values()) // MIB
            check(f"the agent's {source} reading rose with llama-server", now > before, f"{before} MiB before it, {now} MiB after")
        finally:
            stop(agent)
            stop(server)


def chats(proxy, admin):
    """A chat, a stream and a chat again through the agent's proxy, as a
    data plane sends them, and what the agent counts after."""
    headers = {
        "x-inferyes-backend": "main",
        "x-inferyes-model": "tiny-chat",
        "x-inferyes-session": "gpu-check-session",
    }
    url = f"http://{proxy}/v1/chat/completions"
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 16}
    status, text, _ = http("POST", url, body, headers)
    reply = json.loads(text) if status == 200 else {}
    tokens = reply.get("usage", {}).get("completion_tokens") or 0
    # A model may end its reply early; one token at least is generated.
    check("a chat through the agent", status == 200 and 1 <= tokens <= 16, f"{status}, {tokens} tokens")
    status, text, _ = http("POST", url, dict(body, stream=True), headers)
    ended = text.rstrip().endswith("data: [DONE]")
    check("a stream through the agent", status == 200 and ended, f"{status}, {len(text)} bytes")
    status, text, _ = http("POST", url, body, headers)
    timings = json.loads(text).get("timings", {}) if status == 200 else {}
    check("the repeated prompt is read from the slot's cache", timings.get("cache_n", 0) > 0, timings)
    after = metrics(admin)
    slots, resident = gauge(after, "slots_total"), gauge(after, "resident_sessions")
    check("the agent counts the slots", sum(slots.values()) == 2, slots)
    check("the agent holds the session resident", sum(resident.values()) >= 1, resident)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agent", required=True)
    parser.add_argument("--llama-server", required=True, help="a CUDA llama-server, or a llama.cpp source tree")
    parser.add_argument("--model", required=True)
    parser.add_argument("--source", default="nvml", help="the GPU reading of the agent llama-server is behind")
    parser.add_argument("--out", default=None, help="where logs go (a temporary directory if not given)")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="inferyes-gpu-check-")
    out = args.out or work
    os.makedirs(out, exist_ok=True)
    print("nvidia-smi:", smi(), flush=True)
    llama_server, build, started = args.llama_server, None, time.monotonic()
    if os.path.isdir(llama_server):
        build, llama_server = build_llama_server(llama_server, work, out)
    for source in ("nvml", "nvidia-smi"):
        logs = [os.path.join(out, f"agent-{source}.log")]
        stage(f"{source} readings", logs, readings_match, args.agent, work, source, out)
    if build is not None:
        built = build.wait() == 0
        check("llama-server built with CUDA", built, f"{time.monotonic() - started:.0f}s")
        if not built:
            sys.exit(min(failed, 100))
    logs = [os.path.join(out, name) for name in ("llama-server.log", "agent-llama.log")]
    stage("serving on the GPU", logs, served_on_the_gpu, args.agent, llama_server, args.model, args.source, work, out)
    print(f"{failed} failed", flush=True)
    sys.exit(min(failed, 100))


if __name__ == "__main__":
    main()
