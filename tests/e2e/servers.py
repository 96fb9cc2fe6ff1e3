"""Helpers the end-to-end tests share: a checkpoint copy with a chat template (and the plain
one the tiny-model tests use), `ember serve`
started in a subprocess on a free port (ready once `/health` answers), an app served on a thread
of this process (`serve_in_thread`), and a server's metrics."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from transformers import AutoTokenizer

# A plain role-prefixed chat template for the tiny random checkpoints.
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


def with_chat_template(src: str, dest: str, template: str) -> str:
    """A copy of the checkpoint `src` at `dest` whose tokenizer has `template`."""
    shutil.copytree(src, dest)
    tok = AutoTokenizer.from_pretrained(dest)
    tok.chat_template = template
    tok.save_pretrained(dest)
    return dest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(
    args: list[str], env: dict[str, str] | None = None, timeout: float = 180
) -> tuple[subprocess.Popen[str], str]:
    """`ember serve ARGS --port P` on a free port P; (process, base URL) once /health answers.
    Fails the test with the server's output when it exits or does not come up in time."""
    port = free_port()
    cmd = [sys.executable, "-m", "ember.cli", "serve", *args, "--port", str(port)]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"ember serve exited: {proc.stdout.read()[-3000:]}")  # type: ignore[union-attr]
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.3)
    proc.kill()
    out = proc.stdout.read()[-3000:]  # type: ignore[union-attr]
    pytest.fail(f"ember serve did not come up in {timeout:.0f} s: {out}")


@contextlib.contextmanager
def serve_in_thread(app: Any) -> Iterator[str]:
    """`app` (an ASGI app: `build_app`'s, or several mounted under one) served by uvicorn on a
    thread of this process, on a free port: its base URL while the block runs."""
    import uvicorn

    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not srv.started and time.time() < deadline:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(timeout=10)


def metrics(server: str, api_key: str | None = None) -> dict[str, float]:
    """The server's Prometheus `/metrics` as {sample name with labels: value}."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with urllib.request.urlopen(urllib.request.Request(server + "/metrics", headers=headers)) as r:
        text = r.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def stop_serve(proc: subprocess.Popen[str]) -> str:
    """Stop the server; returns its output."""
    proc.terminate()
    out, _ = proc.communicate(timeout=60)
    return out
