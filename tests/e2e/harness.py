"""The end-to-end harness: processes, ports and waits. The fleet itself is
built in conftest.py."""

import json
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def binary_dir():
    if os.environ.get("INFERYES_BIN_DIR"):
        return Path(os.environ["INFERYES_BIN_DIR"])
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    return target / "debug"


def llama_server():
    path = os.environ.get("INFERYES_LLAMA_SERVER")
    if not path:
        path = subprocess.run(
            [str(ROOT / "scripts" / "llama-server.sh")], check=True, capture_output=True, text=True
        ).stdout.strip()
    if not Path(path).is_file():
        raise RuntimeError(f"llama-server not found at {path}: run scripts/llama-server.sh")
    return path


def http_get(url, timeout=2.0, headers=None):
    request = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.status, response.read()


def wait_until(what, check, timeout=60.0):
    """Polls `check` (another process's state, seen through its API) until it
    holds; fails with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last_error = None
    while time.monotonic() < deadline:
        try:
            if check():
                return
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

    def ctl(self, *args):
        out = subprocess.run(
            [str(self.bin / "inferyesctl"), "--controller", self.controller_url,
             "--admin-token-file", str(self.admin_token_file), "-o", "json", *args],
            check=True, capture_output=True, text=True, timeout=30,
        )
        return json.loads(out.stdout)

    def stop(self):
        for _, process in reversed(self.processes):
            process.terminate()
        for name, process in reversed(self.processes):
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
