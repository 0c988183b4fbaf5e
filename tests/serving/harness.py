"""Start mlx_lm.server / mlx_vlm.server on 127.0.0.1 and send it bounded request patterns.

Every loop here is bounded in count and time, the server listens on loopback only, and the test stops
it (terminate, then kill). ``KVPATCH=off`` in a server's environment runs it without kvpatch.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
START_TIMEOUT = 180.0
REQUEST_TIMEOUT = 300.0
TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

#: Layers the mlx-vlm 0.7.10 server imports that the shared test environment does not carry (its
#: FastAPI app, uvicorn, and modules it imports at start-up: mlx_audio's audio_io, cryptography's Fernet
#: for context compaction). Exact pins, layered once into the kvpatch cache like upstream releases.
VLM_SERVER_LAYERS = (
    "fastapi==0.165.0",
    "starlette==1.10.0",
    "uvicorn==0.54.0",
    "h11==0.16.0",
    "opentelemetry-api==1.45.2",
    "python-multipart==0.0.34",
    "mlx-audio==0.5.2",
    "cryptography==50.0.2",
    "cffi==2.1.1",
    "pycparser==3.12",
)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc; 0.0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICKS


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


@dataclass
class Server:
    """One server process. ``kind`` is ``lm`` (mlx_lm.server) or ``vlm`` (mlx_vlm.server)."""

    kind: str
    model: Path
    args: Sequence[str] = ()
    env: dict[str, str] = field(default_factory=dict)
    port: int = 0
    proc: subprocess.Popen | None = None
    log: Path | None = None

    def start(self, workdir: Path) -> Server:
        self.port = free_port()
        module = "mlx_lm.server" if self.kind == "lm" else "mlx_vlm.server"
        cmd = [sys.executable, "-m", module, "--model", str(self.model), "--host", HOST, "--port", str(self.port)]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **self.env}
        if self.kind == "vlm":
            try:
                from kvpatch.maint.envs import layer
            except ImportError:  # older layout
                from kvpatch.envs import layer  # type: ignore[no-redef]

            extra = [str(layer(req)) for req in VLM_SERVER_LAYERS]
            env["PYTHONPATH"] = os.pathsep.join([env.get("PYTHONPATH", ""), *extra]).strip(os.pathsep)
        self.log = workdir / f"server-{self.kind}-{self.port}.log"
        out = self.log.open("w")
        self.proc = subprocess.Popen([*cmd, *self.args], env=env, cwd=workdir, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{module} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"http://{HOST}:{self.port}/v1/models", timeout=5) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{module} did not answer within {START_TIMEOUT:.0f} s:\n{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        if self.log is None or not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=20)

    def cpu(self) -> float:
        return cpu_seconds(self.proc.pid) if self.proc is not None else 0.0

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- requests ----------------------------------------------------------------------------------
    def chat(self, content: str, max_tokens: int) -> dict[str, Any]:
        """One greedy chat completion: ``{"text", "status", "error"}``."""
        body = {
            "model": str(self.model),
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": False,
        }
        request = urllib.request.Request(
            f"http://{HOST}:{self.port}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT) as r:
                data = json.loads(r.read())
            return {"text": data["choices"][0]["message"]["content"], "status": 200, "error": None}
        except urllib.error.HTTPError as exc:
            return {"text": None, "status": exc.code, "error": exc.read().decode(errors="replace")[:500]}


def run_pattern(server: Server, prompts: Sequence[str], pattern: str, max_tokens: int) -> list[dict[str, Any]]:
    """Send ``prompts`` one ``pattern``: ``single`` (one after another), ``concurrent`` (all at once),
    ``staggered`` (one started every 50 ms, overlapping), ``prefix`` (the first alone, which fills the
    server's prompt cache, then the rest at once: they share its prefix)."""
    results: list[dict[str, Any] | None] = [None] * len(prompts)

    def send(i: int, delay: float = 0.0) -> None:
        if delay:
            time.sleep(delay)
        results[i] = server.chat(prompts[i], max_tokens)

    if pattern == "single":
        for i in range(len(prompts)):
            send(i)
    else:
        start = 0
        if pattern == "prefix":
            send(0)
            start = 1
        threads = [
            threading.Thread(target=send, args=(i, 0.05 * (i - start) if pattern == "staggered" else 0.0))
            for i in range(start, len(prompts))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(REQUEST_TIMEOUT + 10)
    return [r if r is not None else {"text": None, "status": 0, "error": "no answer"} for r in results]
