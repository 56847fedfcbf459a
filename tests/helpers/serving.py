"""Helpers of the server tests: a `dinfer serve` (or another launcher) in a subprocess on 127.0.0.1
and a free port, stopped by the test; the Prometheus text it serves, parsed."""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
MODEL = "tiny-llada-moe"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 10.0):
    """(status, body text) of a GET, error statuses included."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


class ServerProcess:
    """A server started with `args` after the interpreter (["-m", "dinfer", "serve", ...]), on its
    own port, with `env` added to the environment; `url` is its root. Waits for /health; stop() ends
    it (SIGINT, then SIGKILL)."""

    def __init__(self, args, startup_timeout: float = 180.0, env=None):
        self.port = free_port()
        env = dict(os.environ, **(env or {}), PYTHONPATH=str(ROOT))
        self.log = tempfile.TemporaryFile("w+")  # a file, not a pipe: a full pipe would stall the server
        self.proc = subprocess.Popen(
            [sys.executable, *args, "--port", str(self.port)],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if get(self.url + "/health", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not answer /health in {startup_timeout} s")
            time.sleep(0.2)

    def alive(self) -> bool:
        return self.proc.poll() is None and get(self.url + "/health")[0] == 200

    def metrics(self) -> dict:
        return parse_metrics(get(self.url + "/metrics")[1])

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> str:
        """Ends the server; its output."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.output()


def dinfer_serve(*args) -> ServerProcess:
    return ServerProcess(["-m", "dinfer", "serve", *args])


def endless_serve(*args) -> ServerProcess:
    """The embedded model that never writes EOS (tests/helpers/endless_server.py): every request runs
    to its max_tokens, as long as the test needs."""
    return ServerProcess([str(HERE / "endless_server.py"), *args])


def parse_metrics(text: str) -> dict:
    """{name or name{labels}: value} of a Prometheus text exposition."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def sse_events(lines) -> list:
    """The JSON payloads of an SSE stream's `data:` lines, "[DONE]" as is."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out
